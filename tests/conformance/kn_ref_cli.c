/*
 * kn_ref_cli.c - runs one MoE layer through kernels/ on tensors from a safetensors file,
 * so that tests/conformance/test_kn_ref_torch.py can compare it with PyTorch.
 *
 *   kn_ref_cli IN.safetensors OUT.safetensors [--format f32|f16|bf16|int8|int4|fp8]
 *              [--group 32|64|128] [--split N] [--path ref|forward]
 *   kn_ref_cli --model DIR --layer L --dump OUT.safetensors [--format F] [--split N]
 *
 * The second form loads layer L of a checkpoint with the loader the server uses
 * (mr_config_expert_tensors_q + kn_layer_load_expert_st: float or FP8 block-scaled
 * experts) into a layer of --format (default: as stored, fp8-b128 for an FP8 checkpoint)
 * and writes what the layer holds, decoded by the reference decoder (kn__row_to_f32), as
 * experts.<e>.{gate,up,down}_proj.weight F32 in the HF layout: the "FP8 loading" check of
 * test_kn_ref_torch.py compares it with a numpy dequantization of the file.
 *
 * IN holds
 *   x                               [T, H]  F32, F16 or BF16
 *   ids                             [T, k]  I32, -1 = empty slot
 *   weights                         [T, k]  F32
 *   experts.<e>.gate_proj.weight    [I, H]  for e = 0, 1, ... (the first missing e ends
 *   experts.<e>.up_proj.weight      [I, H]   the list); all of one float dtype
 *   experts.<e>.down_proj.weight    [H, I]
 *   (or F8_E4M3 codes, each with experts.<e>.<proj>.weight_scale_inv F32 block scales
 *   [ceil(N/128), ceil(K/128)]: loaded with kn_layer_load_expert_fp8)
 * OUT gets `out` [T, H] F32: kn_ref_moe_forward (--path ref, the default) or
 * kn_moe_forward on an engine with --split slices (default 1).
 * Exit status 0 on success, 1 on any error (printed with the field that caused it).
 */
#include "common/mr.h"
#include "kernels/internal.h" /* kn__row_to_f32 for --dump */

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int usage(void) {
  fprintf(stderr, "usage: kn_ref_cli IN.safetensors OUT.safetensors [--format f32|f16|bf16|int8|int4|fp8]\n"
                  "                  [--group 32|64|128] [--split N] [--path ref|forward]\n"
                  "       kn_ref_cli --model DIR --layer L --dump OUT.safetensors [--format F] [--split N]\n");
  return 1;
}

/* A malloc'ed copy of a tensor's bytes: the data of a safetensors file is only as aligned
 * as the sizes of the tensors before it, and the kernels read whole floats. */
static void *dup_data(const mr_st_tensor *t) {
  void *p = malloc(t->nbytes + 1);
  if (p) memcpy(p, t->data, t->nbytes);
  return p;
}

static int find2(const mr_st *st, const char *name, mr_dtype want_dt, const char *want_name,
                 const mr_st_tensor **out, mr_err *e) {
  const mr_st_tensor *t = mr_st_find(st, name);
  if (!t) return mr_err_set(e, MR_ENOTFOUND, "tensor %s is missing", name);
  if (t->ndim != 2) return mr_err_set(e, MR_EFORMAT, "tensor %s has %u dims, expected 2", name, t->ndim);
  if (want_name ? strcmp(t->dtype_name, want_name) != 0
                : (want_dt != MR_DTYPE_UNSPECIFIED ? t->dtype != want_dt : t->dtype == MR_DTYPE_UNSPECIFIED))
    return mr_err_set(e, MR_EFORMAT, "tensor %s has dtype %s, expected %s", name, t->dtype_name,
                      want_name ? want_name : want_dt ? mr_dtype_name(want_dt) : "a float dtype");
  *out = t;
  return 0;
}

/* --model DIR --layer L --dump OUT [--format F] [--split N] (see the top of the file). */
static int dump_main(int argc, char **argv) {
  const char *model = NULL, *dump = NULL;
  uint32_t layer = 0, split = 1;
  bool fmt_set = false;
  kn_format fmt = KN_FMT_F32;
  for (int i = 1; i + 1 < argc; i += 2) {
    const char *f = argv[i], *v = argv[i + 1];
    if (strcmp(f, "--model") == 0) model = v;
    else if (strcmp(f, "--dump") == 0) dump = v;
    else if (strcmp(f, "--layer") == 0) layer = (uint32_t)strtoul(v, NULL, 10);
    else if (strcmp(f, "--split") == 0) split = (uint32_t)strtoul(v, NULL, 10);
    else if (strcmp(f, "--format") == 0) {
      if (kn_format_parse(v, &fmt) != 0) return fprintf(stderr, "--format %s: unknown\n", v), 1;
      fmt_set = true;
    } else return usage();
  }
  if (!model || !dump || split < 1) return usage();
  int rc = 1;
  mr_err e = {0};
  mr_model_config c;
  mr_st *st = NULL;
  kn_engine *eng = NULL;
  kn_layer *L = NULL;
  mr_st_writer *w = NULL;
  float *buf = NULL;
  if (mr_config_load(&c, model, &e) || mr_st_open(&st, model, &e)) goto out;
  if (!fmt_set) fmt = c.fp8 ? KN_FMT_FP8 : KN_FMT_BF16;
  kn_engine_opts eo = {.isa = KN_ISA_REF, .threads = 1, .force_split = split};
  kn_layer_desc d = {.hidden = c.hidden_size, .inter = c.moe_intermediate, .num_experts = c.num_experts,
                     .format = fmt, .group = 64};
  if (kn_engine_new(&eng, &eo, &e) || kn_layer_new(&L, eng, &d, &e) || mr_st_writer_new(&w)) goto out;
  const uint32_t H = c.hidden_size, I = c.moe_intermediate;
  buf = malloc((size_t)H * I * sizeof(float) + (H > I ? H : I) * sizeof(float));
  if (!buf) goto out;
  float *row = buf + (size_t)H * I;
  static const char *const pn[3] = {"gate_proj", "up_proj", "down_proj"};
  for (uint32_t x = 0; x < c.num_experts; x++) {
    const mr_st_tensor *t[3], *sc[3];
    if (mr_config_expert_tensors_q(&c, st, layer, x, t, sc, &e) || kn_layer_load_expert_st(L, x, t, sc, &e))
      goto out;
    for (int p = 0; p < 3; p++) {
      /* Reassemble the HF [N, K] matrix from the slices. */
      for (uint32_t s = 0; s < L->n_slices; s++)
        if (p < 2)
          for (uint32_t i = 0; i < L->slice_len[s]; i++)
            kn__row_to_f32(L, s, &L->w[x][s], (kn__proj)p, i, buf + (size_t)(L->slice_off[s] + i) * H);
        else
          for (uint32_t j = 0; j < H && L->slice_len[s]; j++) {
            kn__row_to_f32(L, s, &L->w[x][s], KN__DOWN, j, row);
            memcpy(buf + (size_t)j * I + L->slice_off[s], row, L->slice_len[s] * sizeof(float));
          }
      char name[96];
      snprintf(name, sizeof name, "experts.%u.%s.weight", x, pn[p]);
      uint64_t shape[2] = {p < 2 ? I : H, p < 2 ? H : I};
      if (mr_st_writer_add(w, name, MR_DTYPE_F32, 2, shape, buf) != 0) {
        mr_err_set(&e, MR_ENOMEM, "out of memory writing %s", dump);
        goto out;
      }
    }
  }
  if (mr_st_writer_write(w, dump, &e) == 0) rc = 0;
out:
  if (rc) fprintf(stderr, "kn_ref_cli: %s: %s\n", mr_err_name(e.code), e.msg[0] ? e.msg : "out of memory");
  free(buf);
  mr_st_writer_free(w);
  kn_layer_free(L);
  kn_engine_free(eng);
  mr_st_close(st);
  return rc;
}

int main(int argc, char **argv) {
  if (argc > 1 && strcmp(argv[1], "--model") == 0) return dump_main(argc, argv);
  if (argc < 3) return usage();
  const char *in = argv[1], *outp = argv[2];
  kn_format fmt = KN_FMT_F32;
  uint32_t group = 64, split = 1;
  bool forward = false;
  for (int i = 3; i < argc; i++) {
    if (i + 1 >= argc) return usage();
    const char *v = argv[++i];
    if (strcmp(argv[i - 1], "--format") == 0) {
      if (kn_format_parse(v, &fmt) != 0) return fprintf(stderr, "--format %s: unknown\n", v), 1;
    } else if (strcmp(argv[i - 1], "--group") == 0) {
      group = (uint32_t)strtoul(v, NULL, 10);
    } else if (strcmp(argv[i - 1], "--split") == 0) {
      split = (uint32_t)strtoul(v, NULL, 10);
      if (split < 1) return fprintf(stderr, "--split %s: must be >= 1\n", v), 1;
    } else if (strcmp(argv[i - 1], "--path") == 0) {
      if (strcmp(v, "ref") == 0) forward = false;
      else if (strcmp(v, "forward") == 0) forward = true;
      else return fprintf(stderr, "--path %s: must be ref or forward\n", v), 1;
    } else {
      return usage();
    }
  }

  int rc = 1;
  mr_err e = {0};
  mr_st *st = NULL;
  kn_engine *eng = NULL;
  kn_layer *L = NULL;
  float *out = NULL;
  void *xc = NULL, *idc = NULL, *wc = NULL;
  mr_st_writer *w = NULL;
  if (mr_st_open(&st, in, &e) != 0) goto out_print;

  const mr_st_tensor *x, *ids, *wts, *g0;
  if (find2(st, "x", MR_DTYPE_UNSPECIFIED, NULL, &x, &e) ||
      find2(st, "ids", MR_DTYPE_UNSPECIFIED, "I32", &ids, &e) ||
      find2(st, "weights", MR_DTYPE_F32, NULL, &wts, &e) ||
      mr_st_find(st, "experts.0.gate_proj.weight") == NULL ||
      find2(st, "experts.0.gate_proj.weight", MR_DTYPE_UNSPECIFIED,
            mr_st_is_f8e4m3(mr_st_find(st, "experts.0.gate_proj.weight")) ? "F8_E4M3" : NULL, &g0, &e))
    goto out_print;
  const uint64_t T = x->shape[0], H = x->shape[1], k = ids->shape[1], I = g0->shape[0];
  if (ids->shape[0] != T || wts->shape[0] != T || wts->shape[1] != k || g0->shape[1] != H) {
    mr_err_set(&e, MR_EFORMAT, "shapes disagree: x [%lu, %lu], ids [%lu, %lu], weights [%lu, %lu], "
               "gate [%lu, %lu]", (unsigned long)T, (unsigned long)H, (unsigned long)ids->shape[0],
               (unsigned long)k, (unsigned long)wts->shape[0], (unsigned long)wts->shape[1],
               (unsigned long)I, (unsigned long)g0->shape[1]);
    goto out_print;
  }
  uint32_t E = 0;
  char name[128];
  for (;; E++) {
    snprintf(name, sizeof name, "experts.%u.gate_proj.weight", E);
    if (!mr_st_find(st, name) || E == 65536) break;
  }

  kn_engine_opts eo = {.isa = KN_ISA_COUNT, .force_split = split};
  if (kn_engine_new(&eng, &eo, &e) != 0) goto out_print;
  kn_layer_desc d = {.hidden = (uint32_t)H, .inter = (uint32_t)I, .num_experts = E, .format = fmt,
                     .group = group};
  if (H > 65536 || I > 65536 || kn_layer_new(&L, eng, &d, &e) != 0) {
    if (!e.code) mr_err_set(&e, MR_EINVAL, "hidden %lu or inter %lu over 65536", (unsigned long)H, (unsigned long)I);
    goto out_print;
  }
  for (uint32_t x_ = 0; x_ < E; x_++) {
    const mr_st_tensor *g, *u, *dn;
    uint64_t gu_shape[2] = {I, H}, d_shape[2] = {H, I};
    if (mr_st_is_f8e4m3(g0)) { /* codes + weight_scale_inv, through the checkpoint loader */
      const mr_st_tensor *t[3], *sc[3];
      static const char *const pn[3] = {"gate_proj", "up_proj", "down_proj"};
      for (int p = 0; p < 3; p++) {
        uint64_t ss[2] = {((p < 2 ? I : H) + 127) / 128, ((p < 2 ? H : I) + 127) / 128};
        snprintf(name, sizeof name, "experts.%u.%s.weight", x_, pn[p]);
        if (mr_st_expect_as(st, name, "F8_E4M3", 2, p < 2 ? gu_shape : d_shape, &t[p], &e)) goto out_print;
        snprintf(name, sizeof name, "experts.%u.%s.weight_scale_inv", x_, pn[p]);
        if (mr_st_expect(st, name, 2, ss, &sc[p], &e)) goto out_print;
      }
      if (kn_layer_load_expert_st(L, x_, t, sc, &e) != 0) goto out_print;
      continue;
    }
    snprintf(name, sizeof name, "experts.%u.gate_proj.weight", x_);
    if (mr_st_expect(st, name, 2, gu_shape, &g, &e) != 0) goto out_print;
    snprintf(name, sizeof name, "experts.%u.up_proj.weight", x_);
    if (mr_st_expect(st, name, 2, gu_shape, &u, &e) != 0) goto out_print;
    snprintf(name, sizeof name, "experts.%u.down_proj.weight", x_);
    if (mr_st_expect(st, name, 2, d_shape, &dn, &e) != 0) goto out_print;
    if (u->dtype != g->dtype || dn->dtype != g->dtype) {
      mr_err_set(&e, MR_EFORMAT, "expert %u: gate, up and down dtypes differ", x_);
      goto out_print;
    }
    void *gc = dup_data(g), *uc = dup_data(u), *dc = dup_data(dn);
    int lrc = gc && uc && dc ? kn_layer_load_expert(L, x_, gc, uc, dc, g->dtype, &e)
                             : mr_err_set(&e, MR_ENOMEM, "out of memory for expert %u", x_);
    free(gc);
    free(uc);
    free(dc);
    if (lrc != 0) goto out_print;
  }

  out = malloc(T * H * sizeof(float) + 1);
  xc = dup_data(x);
  idc = dup_data(ids);
  wc = dup_data(wts);
  if (!out || !xc || !idc || !wc) {
    mr_err_set(&e, MR_ENOMEM, "out of memory for out");
    goto out_print;
  }
  kn_moe_args a = {.n_tokens = (uint32_t)T, .top_k = (uint32_t)k, .ids = idc, .weights = wc,
                   .x = xc, .x_dtype = x->dtype, .out = out};
  if ((forward ? kn_moe_forward(eng, L, &a, NULL, &e) : kn_ref_moe_forward(L, &a, &e)) != 0)
    goto out_print;
  uint64_t shape[2] = {T, H};
  if (mr_st_writer_new(&w) != 0 || mr_st_writer_add(w, "out", MR_DTYPE_F32, 2, shape, out) != 0) {
    mr_err_set(&e, MR_ENOMEM, "out of memory writing %s", outp);
    goto out_print;
  }
  if (mr_st_writer_write(w, outp, &e) != 0) goto out_print;
  rc = 0;

out_print:
  if (rc) fprintf(stderr, "kn_ref_cli: %s: %s\n", mr_err_name(e.code), e.msg);
  mr_st_writer_free(w);
  free(out);
  free(xc);
  free(idc);
  free(wc);
  kn_layer_free(L);
  kn_engine_free(eng);
  mr_st_close(st);
  return rc;
}
