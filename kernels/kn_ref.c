/*
 * kn_ref.c - the scalar reference: the decoder of the canonical packed layout, the REF
 * entries of the kernel table, kn_ref_moe_forward, kn_ref_linear_forward and the textbook
 * kn_ref_expert_f32.
 *
 * Everything here is plain fp32 C with no attempt at speed: it is what every fast path is
 * compared with (docs/DESIGN.md section 5), and is itself compared with PyTorch in
 * tests/conformance/. Dot products accumulate in fp32, left to right, like the fast paths
 * (which only reorder the sum).
 */
#include "kernels/internal.h"

#include <string.h>

/* ---- the decoder of the canonical layout (internal.h section A) -------------------- */

void kn__row_to_f32(const kn_layer *L, uint32_t slice, const kn__slice_w *w, kn__proj p,
                    uint32_t row, float *dst) {
  const kn_format f = L->d.format;
  const uint32_t G = L->d.group;
  const uint32_t K = p == KN__DOWN ? L->slice_len[slice] : L->d.hidden;
  const void *base = p == KN__GATE ? w->gate : p == KN__UP ? w->up : w->down;
  const float *scales = p == KN__GATE ? w->gate_scale : p == KN__UP ? w->up_scale : w->down_scale;
  const unsigned char *r = (const unsigned char *)base + (size_t)row * kn__row_bytes(f, K, G);
  switch (f) {
    case KN_FMT_F32:
      memcpy(dst, r, (size_t)K * sizeof(float));
      break;
    case KN_FMT_F16:
    case KN_FMT_BF16:
      mr_convert_to_f32(dst, r, f == KN_FMT_F16 ? MR_DTYPE_F16 : MR_DTYPE_BF16, K);
      break;
    case KN_FMT_INT8: {
      const int8_t *q = (const int8_t *)r;
      const float sc = scales[row];
      for (uint32_t k = 0; k < K; k++) dst[k] = (float)q[k] * sc;
      break;
    }
    case KN_FMT_INT4: {
      const float *sc = scales + (size_t)row * kn__ngroups(K, G);
      for (uint32_t k = 0; k < K; k++) {
        uint8_t b = r[k / 2];
        /* Sign-extend the nibble: low nibble for even k, high for odd k. */
        int v = (k & 1) ? (int8_t)b >> 4 : (int8_t)(uint8_t)(b << 4) >> 4;
        dst[k] = (float)v * sc[k / G];
      }
      break;
    }
    case KN_FMT_FP8: {
      /* e4m3 through the exact table, times the block scale (one fp32 multiply). */
      const float *tbl = kn__fp8_table(), *sc = scales + (size_t)row * kn__ngroups(K, KN_FP8_BLOCK);
      for (uint32_t k = 0; k < K; k++) dst[k] = tbl[r[k]] * sc[k / KN_FP8_BLOCK];
      break;
    }
    default:
      MR_ASSERT(!"kn__row_to_f32: bad format");
  }
}

static float dot_f32(const float *a, const float *b, uint32_t n) {
  float s = 0.0f;
  for (uint32_t i = 0; i < n; i++) s += a[i] * b[i];
  return s;
}

/* ---- REF kernel-table entries ------------------------------------------------------ */

/* tmp holds the decoded gate row [0, H) and up row [H, 2H) in gate_up, and the decoded down
 * row (I_s floats) in down. */
static size_t ref_tmp_floats(const kn_layer *L, uint32_t slice, uint32_t n) {
  (void)n;
  size_t a = 2 * (size_t)L->d.hidden, b = L->slice_len[slice];
  return a > b ? a : b;
}

static void ref_gate_up(const kn__task *t, uint32_t i0, uint32_t i1) {
  const uint32_t H = t->L->d.hidden, Is = t->L->slice_len[t->slice];
  float *g = t->tmp, *u = t->tmp + H;
  for (uint32_t i = i0; i < i1; i++) {
    kn__row_to_f32(t->L, t->slice, t->w, KN__GATE, i, g);
    kn__row_to_f32(t->L, t->slice, t->w, KN__UP, i, u);
    for (uint32_t r = 0; r < t->n; r++) {
      const float *x = t->x + (size_t)r * H;
      t->h[(size_t)r * Is + i] = kn__silu(dot_f32(g, x, H)) * dot_f32(u, x, H);
    }
  }
}

static void ref_down(const kn__task *t, uint32_t j0, uint32_t j1) {
  const uint32_t H = t->L->d.hidden, Is = t->L->slice_len[t->slice];
  float *d = t->tmp;
  for (uint32_t j = j0; j < j1; j++) {
    kn__row_to_f32(t->L, t->slice, t->w, KN__DOWN, j, d);
    for (uint32_t r = 0; r < t->n; r++) t->y[(size_t)r * H + j] = dot_f32(d, t->h + (size_t)r * Is, Is);
  }
}

void kn__ref_register(kn__kernel_table *t) {
  static const char *const names[KN_FMT_COUNT] = {"ref_f32_f32", "ref_f16_f32", "ref_bf16_f32",
                                                  "ref_int8_f32", "ref_int4_f32", "ref_fp8_f32"};
  for (int f = 0; f < KN_FMT_COUNT; f++)
    t->k[f][KN_ISA_REF] = (kn__kernel){.gate_up = ref_gate_up,
                                       .down = ref_down,
                                       .prep = NULL,
                                       .prep_bytes = NULL,
                                       .tmp_floats = ref_tmp_floats,
                                       .name = names[f],
                                       .rounding = KN__RND_F32};
}

/* ---- kn_ref_moe_forward ------------------------------------------------------------ */

int kn_ref_moe_forward(const kn_layer *L, const kn_moe_args *a, mr_err *e) {
  int rc = kn__moe_validate(L, a, e);
  if (rc) return rc;
  const uint32_t T = a->n_tokens, k = a->top_k, H = L->d.hidden, I = L->d.inter;
  if (T == 0) return 0;
  const size_t esz = mr_dtype_size(a->x_dtype);
  const size_t rowmax = H > I ? H : I;
  /* x row, decoded weight row, h (one slice), y */
  float *buf = mr_malloc(((size_t)H + rowmax + I + H) * sizeof(float));
  if (!buf) return mr_err_set(e, MR_ENOMEM, "kn_ref_moe_forward: out of memory");
  float *x = buf, *wrow = x + H, *h = wrow + rowmax, *y = h + I;

  memset(a->out, 0, (size_t)T * H * sizeof(float));
  for (uint32_t t = 0; t < T; t++) {
    mr_convert_to_f32(x, (const char *)a->x + (size_t)t * H * esz, a->x_dtype, H);
    for (uint32_t j = 0; j < k; j++) {
      const int32_t id = a->ids[(size_t)t * k + j];
      if (id < 0) continue;
      const kn__slice_w *ws = L->w[id];
      memset(y, 0, (size_t)H * sizeof(float));
      for (uint32_t s = 0; s < L->n_slices; s++) {
        const uint32_t Is = L->slice_len[s];
        for (uint32_t i = 0; i < Is; i++) {
          kn__row_to_f32(L, s, &ws[s], KN__GATE, i, wrow);
          float g = dot_f32(wrow, x, H);
          kn__row_to_f32(L, s, &ws[s], KN__UP, i, wrow);
          float u = dot_f32(wrow, x, H);
          h[i] = kn__silu(g) * u;
        }
        for (uint32_t o = 0; o < H && Is > 0; o++) {
          kn__row_to_f32(L, s, &ws[s], KN__DOWN, o, wrow);
          y[o] += dot_f32(wrow, h, Is);
        }
      }
      const float w = a->weights[(size_t)t * k + j];
      float *out = a->out + (size_t)t * H;
      for (uint32_t o = 0; o < H; o++) out[o] += w * y[o];
    }
  }
  mr_free(buf);
  return 0;
}

/* ---- kn_ref_linear_forward --------------------------------------------------------- */

/* The REF down kernel over the whole matrix and all T tokens at once (internal.h section
 * E): each row decoded once into buf, then its dot product with every token, in fp32 left
 * to right. */
int kn_ref_linear_forward(const kn_linear *lin, uint32_t T, const float *x, float *y, mr_err *e) {
  int rc = kn__linear_validate(lin, T, x, y, "kn_ref_linear_forward", e);
  if (rc || T == 0) return rc;
  const kn_layer *L = &lin->L;
  float *buf = mr_malloc((size_t)L->d.inter * sizeof(float)); /* one decoded row */
  if (!buf) return mr_err_set(e, MR_ENOMEM, "kn_ref_linear_forward: out of memory");
  for (uint32_t b = 0; b < lin->n_bands; b++) { /* one band unless served in place */
    const uint32_t r0 = lin->band_row0[b], r1 = lin->band_row0[b + 1];
    const kn__task t = {.L = L, .slice = 0, .w = lin->w.in_place ? &lin->band[b] : L->w[0], .n = T,
                        .x = x, .xq = NULL, .h = (float *)x /* read only */, .y = y + r0, .tmp = buf};
    ref_down(&t, 0, r1 - r0);
  }
  mr_free(buf);
  return 0;
}

/* ---- textbook expert --------------------------------------------------------------- */

void kn_ref_expert_f32(const float *gate, const float *up, const float *down, uint32_t H,
                       uint32_t I, const float *x, float *y) {
  for (uint32_t o = 0; o < H; o++) y[o] = 0.0f;
  for (uint32_t i = 0; i < I; i++) {
    float g = 0.0f, u = 0.0f;
    for (uint32_t c = 0; c < H; c++) {
      g += gate[(size_t)i * H + c] * x[c];
      u += up[(size_t)i * H + c] * x[c];
    }
    float hi = kn__silu(g) * u;
    for (uint32_t o = 0; o < H; o++) y[o] += down[(size_t)o * I + i] * hi;
  }
}
