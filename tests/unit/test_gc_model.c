/*
 * test_gc_model.c - the whole-model runner without servers (every expert local):
 * KV-cache decode equals recomputing the prefix, a ragged batch equals its sequences run
 * alone, bad steps are refused before anything changes, sampling, the --local-experts
 * rule, the fast path stays near the reference, and --map-weights (experts served in
 * place from the file) gives the packed model's logits. The runner against transformers is
 * tests/conformance/test_model_logits.py; against servers tests/integration/itest_model.c.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gpu_client/runner/model.h"
#include "kernels/internal.h"
#include "tests/unit/mt.h"
#include "tests/unit/st_poke.h"

static char dir[256];
static const uint32_t V = 128;

/* A 3-layer model in dir: Qwen3-MoE (seed 5) with extra's flags, or (extra starting with
 * "--arch", and naming its seed) that architecture, whose attention shape is its own. */
static void make_model(const char *extra) {
  snprintf(dir, sizeof dir, "/tmp/moerpc-test-model-%d", (int)getpid());
  char cmd[1024];
  const char *bin = getenv("MOERPC_BIN");
  const bool arch = extra && strncmp(extra, "--arch", 6) == 0;
  snprintf(cmd, sizeof cmd, "rm -rf '%s' && '%s/moerpc-mkmodel' --out '%s' --layers 3 "
           "--experts 8 --topk 2 --hidden 64 --inter 32 --vocab 128 --heads 4 %s "
           "%s >/dev/null 2>&1", dir, bin ? bin : "build/bin", dir,
           arch ? "" : "--kv-heads 2 --head-dim 16 --seed 5", extra ? extra : "");
  MT_EQ_INT(system(cmd), 0);
}
static void rm_model(void) {
  char cmd[300];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  if (system(cmd)) {}
}

static gc_model *open_model(kn_isa isa, uint32_t batch, uint32_t max_seq) {
  gc_model_opts o;
  gc_model_opts_init(&o);
  o.model_dir = dir;
  o.engine.isa = isa;
  o.engine.threads = 2;
  o.max_batch = batch;
  o.max_seq = max_seq;
  o.quiet = true;
  gc_model *m = NULL;
  mr_err e = {0};
  MT_OK(gc_model_open(&m, &o, &e), &e);
  return m;
}

static const int32_t prompt[12] = {5, 17, 99, 3, 64, 127, 0, 42, 42, 8, 77, 31};

MT_TEST(kv_cache_decode_equals_recompute) {
  make_model(NULL);
  gc_model *m = open_model(KN_ISA_REF, 1, 64);
  const uint32_t T = 12;
  static float full[12 * 128], one[128];
  uint32_t seq[12] = {0}, pos[12];
  for (uint32_t i = 0; i < T; i++) pos[i] = i;
  mr_err e = {0};
  gc_step s = {.n_tokens = T, .ids = prompt, .seq = seq, .pos = pos, .logits = full};
  MT_OK(gc_model_step(m, &s, &e), &e);
  MT_EQ_INT(gc_model_seq_len(m, 0), T);
  /* the same tokens one at a time through the cache */
  gc_model_seq_reset(m, 0);
  double worst = 0;
  for (uint32_t i = 0; i < T; i++) {
    gc_step d = {.n_tokens = 1, .ids = prompt + i, .seq = seq, .pos = pos + i, .logits = one};
    MT_OK(gc_model_step(m, &d, &e), &e);
    double r = kn_rel_l2(one, full + (size_t)i * V, V);
    if (r > worst) worst = r;
  }
  fprintf(stderr, "  decode vs prefill: worst rel L2 %.2e\n", worst);
  MT_LE(worst, 1e-5);
  gc_model_close(m);
  rm_model();
}

MT_TEST(ragged_batch_equals_each_sequence_alone) {
  make_model(NULL);
  gc_model *m = open_model(KN_ISA_REF, 3, 32);
  /* three sequences of 5, 2 and 7 tokens in one step, interleaved */
  const uint32_t lens[3] = {5, 2, 7};
  int32_t ids[14];
  uint32_t seq[14], pos[14], at[3] = {0};
  uint32_t n = 0;
  for (uint32_t r = 0; r < 7; r++)
    for (uint32_t b = 0; b < 3; b++)
      if (r < lens[b]) {
        ids[n] = prompt[(b * 4 + r) % 12];
        seq[n] = b;
        pos[n] = at[b]++;
        n++;
      }
  static float batched[14 * 128], alone[7 * 128];
  mr_err e = {0};
  gc_step s = {.n_tokens = n, .ids = ids, .seq = seq, .pos = pos, .logits = batched};
  MT_OK(gc_model_step(m, &s, &e), &e);
  for (uint32_t b = 0; b < 3; b++) {
    int32_t sid[7];
    uint32_t sseq[7], spos[7];
    for (uint32_t i = 0; i < lens[b]; i++) {
      sid[i] = prompt[(b * 4 + i) % 12];
      sseq[i] = 2; /* another slot */
      spos[i] = i;
    }
    gc_model_seq_reset(m, 2);
    gc_step a = {.n_tokens = lens[b], .ids = sid, .seq = sseq, .pos = spos, .logits = alone};
    MT_OK(gc_model_step(m, &a, &e), &e);
    for (uint32_t i = 0; i < n; i++) {
      if (seq[i] != b) continue;
      double r = kn_rel_l2(batched + (size_t)i * V, alone + (size_t)pos[i] * V, V);
      MT_LE(r, 1e-5);
    }
  }
  gc_model_close(m);
  rm_model();
}

MT_TEST(bad_steps_are_refused_and_change_nothing) {
  make_model(NULL);
  gc_model *m = open_model(KN_ISA_REF, 2, 8);
  float lg[8 * 128];
  uint32_t seq[9] = {0}, pos[9];
  for (int i = 0; i < 9; i++) pos[i] = (uint32_t)i;
  int32_t ids[9] = {1, 2, 3, 4, 5, 6, 7, 8, 9};
  mr_err e = {0};
  int32_t bad_id[2] = {1, 128};
  gc_step s = {.n_tokens = 2, .ids = bad_id, .seq = seq, .pos = pos, .logits = lg};
  MT_EQ_INT(gc_model_step(m, &s, &e), MR_ERANGE);
  MT_CONTAINS(e.msg, "vocabulary");
  s = (gc_step){.n_tokens = 9, .ids = ids, .seq = seq, .pos = pos, .logits = lg};
  MT_EQ_INT(gc_model_step(m, &s, &e), MR_ERANGE);
  MT_CONTAINS(e.msg, "max-seq");
  uint32_t skip[2] = {0, 2};
  s = (gc_step){.n_tokens = 2, .ids = ids, .seq = seq, .pos = skip, .logits = lg};
  MT_EQ_INT(gc_model_step(m, &s, &e), MR_EINVAL);
  MT_CONTAINS(e.msg, "continue the cache");
  uint32_t badseq[1] = {2};
  s = (gc_step){.n_tokens = 1, .ids = ids, .seq = badseq, .pos = pos, .logits = lg};
  MT_EQ_INT(gc_model_step(m, &s, &e), MR_ERANGE);
  MT_CONTAINS(e.msg, "slot");
  MT_EQ_INT(gc_model_seq_len(m, 0), 0);
  /* and a good step still works afterwards */
  s = (gc_step){.n_tokens = 3, .ids = ids, .seq = seq, .pos = pos, .logits = lg};
  MT_OK(gc_model_step(m, &s, &e), &e);
  MT_EQ_INT(gc_model_seq_len(m, 0), 3);
  gc_model_close(m);
  rm_model();
}

MT_TEST(generate_greedy_is_argmax_and_batch_independent) {
  make_model(NULL);
  gc_model *m = open_model(KN_ISA_REF, 2, 32);
  const int32_t *p[2] = {prompt, prompt + 3};
  const uint32_t lens[2] = {6, 4};
  int32_t out2[2 * 8], out1[8];
  gc_sampling g = {.temperature = 0, .top_p = 1};
  mr_err e = {0};
  MT_OK(gc_model_generate(m, 2, p, lens, 8, &g, out2, NULL, &e), &e);
  MT_OK(gc_model_generate(m, 1, p + 1, lens + 1, 8, &g, out1, NULL, &e), &e);
  for (int i = 0; i < 8; i++) MT_EQ_INT(out2[8 + i], out1[i]);
  /* prompt + max_new over max_seq */
  MT_EQ_INT(gc_model_generate(m, 1, p, lens, 40, &g, out1, NULL, &e), MR_ERANGE);
  MT_CONTAINS(e.msg, "max-seq");
  gc_model_close(m);
  rm_model();
}

MT_TEST(sampling_is_seeded_and_top_p_narrows) {
  float lg[16];
  for (int i = 0; i < 16; i++) lg[i] = (float)(i % 5);
  lg[9] = 10.0f;
  gc_sampling greedy = {0};
  MT_EQ_INT(gc_sample(lg, 16, &greedy, NULL), 9);
  gc_sampling hot = {.temperature = 5.0f, .top_p = 1.0f, .seed = 3};
  uint64_t s1 = 11, s2 = 11;
  int differ = 0;
  for (int i = 0; i < 64; i++) {
    int32_t a = gc_sample(lg, 16, &hot, &s1), b = gc_sample(lg, 16, &hot, &s2);
    MT_EQ_INT(a, b); /* same state, same draw */
    MT_TRUE(a >= 0 && a < 16);
    differ += a != 9;
  }
  MT_TRUE(differ > 0); /* a high temperature really samples */
  gc_sampling nucleus = {.temperature = 5.0f, .top_p = 1e-4f};
  for (int i = 0; i < 32; i++) MT_EQ_INT(gc_sample(lg, 16, &nucleus, &s1), 9);
}

MT_TEST(local_experts_rule_rotates_and_counts) {
  for (uint32_t l = 0; l < 5; l++) {
    uint32_t n = 0;
    for (uint32_t x = 0; x < 16; x++) n += gc_model_local_rule(l, x, 3, 16);
    MT_EQ_INT(n, 3);
    MT_TRUE(gc_model_local_rule(l, (l * 3) % 16, 3, 16));
  }
  MT_TRUE(gc_model_local_rule(2, 15, 16, 16));
  MT_FALSE(gc_model_local_rule(0, 0, 0, 16));
}

MT_TEST(fast_path_is_close_to_reference) {
  make_model(NULL);
  gc_model *r = open_model(KN_ISA_REF, 1, 16), *f = open_model(KN_ISA_COUNT, 1, 16);
  static float lr[12 * 128], lf[12 * 128];
  uint32_t seq[12] = {0}, pos[12];
  for (uint32_t i = 0; i < 12; i++) pos[i] = i;
  mr_err e = {0};
  gc_step s = {.n_tokens = 12, .ids = prompt, .seq = seq, .pos = pos, .logits = lr};
  MT_OK(gc_model_step(r, &s, &e), &e);
  s.logits = lf;
  MT_OK(gc_model_step(f, &s, &e), &e);
  double d = kn_rel_l2(lf, lr, 12 * V);
  fprintf(stderr, "  fast (%s) vs ref: rel L2 %.2e\n",
          kn_isa_name(kn_engine_isa(gc_model_engine(f), KN_FMT_BF16)), d);
  /* bf16 kernels round activations to bf16 (DESIGN.md section 5: 1e-2 per layer); over a
   * whole model of 3 layers the logits stay within a few percent */
  MT_LE(d, 5e-2);
  gc_model_close(r);
  gc_model_close(f);
  rm_model();
}

/* Stats with reset zero the per-layer totals too (bench's repeats read one repeat each). */
MT_TEST(stats_reset_clears_the_layers) {
  make_model(NULL);
  gc_model *m = open_model(KN_ISA_REF, 1, 64);
  static float logits[12 * 128];
  uint32_t seq[12] = {0}, pos[12];
  for (uint32_t i = 0; i < 12; i++) pos[i] = i;
  mr_err e = {0};
  gc_step s = {.n_tokens = 12, .ids = prompt, .seq = seq, .pos = pos, .logits = logits};
  for (int r = 0; r < 8; r++) { /* enough work for whole microseconds per layer */
    gc_model_seq_reset(m, 0);
    MT_OK(gc_model_step(m, &s, &e), &e);
  }
  gc_model_stats st;
  gc_model_stats_get(m, &st, true);
  MT_EQ_INT(st.steps, 8);
  uint64_t attn = 0;
  for (uint32_t l = 0; l < 3; l++) attn += st.layer[l].attn_us + st.layer[l].local_us;
  MT_TRUE(attn > 0);
  gc_model_stats_get(m, &st, false);
  MT_EQ_INT(st.steps, 0);
  for (uint32_t l = 0; l < 3; l++) {
    MT_EQ_INT(st.layer[l].attn_us, 0);
    MT_EQ_INT(st.layer[l].local_us, 0);
  }
  gc_model_close(m);
  rm_model();
}

/* Bytes of the model's dense 2-D float weights (projections, router, lm_head, embeddings;
 * not experts, norms or block scales): what --map-weights serves in place. */
static uint64_t dense_2d_bytes(void) {
  mr_st *st = NULL;
  mr_err e = {0};
  MT_OK(mr_st_open(&st, dir, &e), &e);
  uint64_t n = 0;
  for (size_t i = 0; i < mr_st_count(st); i++) {
    const mr_st_tensor *t = mr_st_at(st, i);
    if (t->ndim == 2 && !strstr(t->name, ".experts.") && !strstr(t->name, "_scale_inv") &&
        (t->dtype == MR_DTYPE_BF16 || t->dtype == MR_DTYPE_F16 || t->dtype == MR_DTYPE_F32))
      n += t->nbytes;
  }
  mr_st_close(st);
  return n;
}

/* --map-weights: every hot expert of a bf16 model, and of an FP8 one (the codes; the layer
 * makes their per-row scales), served in place from the file, and every dense weight
 * (q | k | v as three bands, o, the routers, lm_head, the embedding table), logits
 * bit-identical to the packed model (the fast path and the reference alike); with int8
 * hot experts no expert can be, with int8 dense weights only the embeddings, and the
 * logits are those of the packed model of those formats. */
MT_TEST(map_weights_serves_experts_in_place_with_the_same_logits) {
  static float a[12 * 128], b[12 * 128];
  uint32_t seq[12] = {0}, pos[12];
  for (uint32_t i = 0; i < 12; i++) pos[i] = i;
  mr_err e = {0};
  for (int fp8 = 0; fp8 < 2; fp8++) {
    make_model(fp8 ? "--dtype fp8" : NULL);
    for (int isa = 0; isa < 2; isa++)
      for (int fmt = 0; fmt < 3; fmt++) {
        gc_model *m[2];
        for (int map = 0; map < 2; map++) {
          gc_model_opts o;
          gc_model_opts_init(&o);
          o.model_dir = dir;
          o.engine.isa = isa ? KN_ISA_COUNT : KN_ISA_REF;
          o.engine.threads = 2;
          o.max_seq = 16;
          o.quiet = true;
          o.map_weights = map;
          if (fmt == 1) o.expert_format = KN_FMT_INT8;
          if (fmt == 2) o.dense_format = KN_FMT_INT8;
          MT_OK(gc_model_open(&m[map], &o, &e), &e);
        }
        MT_EQ_U64(gc_model_mapped_experts(m[0]), 0);
        MT_EQ_U64(gc_model_mapped_experts(m[1]), fmt == 1 ? 0 : 3 * 8); /* 3 layers x 8 experts */
        MT_EQ_U64(gc_model_mapped_dense_bytes(m[0]), 0);
        MT_EQ_U64(gc_model_mapped_dense_bytes(m[1]), fmt == 2 ? 128 * 64 * 2 : dense_2d_bytes());
        gc_step s = {.n_tokens = 12, .ids = prompt, .seq = seq, .pos = pos, .logits = a};
        MT_OK(gc_model_step(m[0], &s, &e), &e);
        s.logits = b;
        MT_OK(gc_model_step(m[1], &s, &e), &e);
        MT_TRUE(isfinite(a[0]));
        MT_TRUE(memcmp(a, b, sizeof a) == 0);
        gc_model_close(m[0]);
        gc_model_close(m[1]);
      }
    rm_model();
  }
}

/* The test model's options: 2 threads, max_seq 16, quiet, on isa with map_weights and
 * dense_format as given. open_prefill opens it so and prefills the prompt's 12 tokens
 * into logits; the caller closes it. */
static void prefill_opts(gc_model_opts *o, kn_isa isa, bool map, kn_format dense) {
  gc_model_opts_init(o);
  o->model_dir = dir;
  o->engine.isa = isa;
  o->engine.threads = 2;
  o->max_seq = 16;
  o->quiet = true;
  o->map_weights = map;
  o->dense_format = dense;
}
static gc_model *open_prefill(kn_isa isa, bool map, kn_format dense, float *logits) {
  gc_model_opts o;
  prefill_opts(&o, isa, map, dense);
  gc_model *m = NULL;
  mr_err e = {0};
  MT_OK(gc_model_open(&m, &o, &e), &e);
  uint32_t seq[12] = {0}, pos[12];
  for (uint32_t i = 0; i < 12; i++) pos[i] = i;
  gc_step s = {.n_tokens = 12, .ids = prompt, .seq = seq, .pos = pos, .logits = logits};
  MT_OK(gc_model_step(m, &s, &e), &e);
  return m;
}

/* DeepSeek-V3's FP8 layout (every decoder linear F8_E4M3 with 128x128 block scales): the
 * dense linears are kept as fp8-b128, their codes as stored (about half the bytes of the
 * bf16 copy they used to be dequantized into). On the reference kernels that is the exact
 * dequantization, so the logits are those of --dense-format f32 bit for bit; served in
 * place (--map-weights) they are the packed model's bit for bit, on the reference and the
 * fast path; the fast path stays near the reference. --dense-format bf16 still gives the
 * old dequantized copy; an AVX2 engine keeps fp8 (its fp32-FMA fp8 kernel). */
MT_TEST(fp8_checkpoint_dense_weights_kept_as_fp8) {
  /* seed 6: with seed 5 one token's routing is a near-tie that the bf16 rounding of the
   * fast path's activations flips (bf16 dense weights flip it too), which then spreads
   * through attention; the bound below is for the kernels, not for such ties */
  make_model("--arch deepseek-v3 --groups 4 --topk-groups 2 --dense-layers 1 "
             "--shared-experts 1 --yarn 4 --dtype fp8 --seed 6");
  static float l[5][12 * 128];
  /* ref fp8, ref --dense-format f32, ref fp8 in place, fast fp8, fast fp8 in place */
  const struct { bool fast, map; kn_format dense; } cfg[5] = {
      {false, false, KN_FMT_COUNT}, {false, false, KN_FMT_F32}, {false, true, KN_FMT_COUNT},
      {true, false, KN_FMT_COUNT}, {true, true, KN_FMT_COUNT}};
  uint64_t dense_fp8 = 0, dense_f32 = 0;
  for (int c = 0; c < 5; c++) {
    gc_model *m = open_prefill(cfg[c].fast ? KN_ISA_COUNT : KN_ISA_REF, cfg[c].map, cfg[c].dense, l[c]);
    /* 3 layers of q_a | kv_a, q_b, o; the dense layer's gate | up and down; the shared
     * experts' gate | up and down in the 2 MoE layers */
    MT_EQ_U64(gc_model_fp8_linears(m), cfg[c].dense == KN_FMT_F32 ? 0 : 3 * 3 + 2 + 2 * 2);
    if (c == 0) dense_fp8 = gc_model_dense_bytes(m);
    if (c == 1) dense_f32 = gc_model_dense_bytes(m);
    if (cfg[c].map) MT_TRUE(gc_model_mapped_dense_bytes(m) > 0);
    MT_TRUE(isfinite(l[c][0]));
    gc_model_close(m);
  }
  fprintf(stderr, "  dense bytes: fp8 %llu, f32 %llu\n", (unsigned long long)dense_fp8,
          (unsigned long long)dense_f32);
  MT_TRUE(dense_fp8 < dense_f32);
  MT_TRUE(memcmp(l[0], l[1], sizeof l[0]) == 0); /* exact dequantization either way */
  MT_TRUE(memcmp(l[0], l[2], sizeof l[0]) == 0); /* in place = packed */
  MT_TRUE(memcmp(l[3], l[4], sizeof l[0]) == 0);
  const double d = kn_rel_l2(l[3], l[0], 12 * V);
  fprintf(stderr, "  fp8 dense, fast vs ref: rel L2 %.2e\n", d);
  MT_LE(d, 5e-2); /* bf16 activations, as fast_path_is_close_to_reference */
  /* an AVX2 engine keeps fp8 too (its fp32-FMA fp8 kernel: the reference's weights) */
  static float la[12 * 128];
  gc_model *m = open_prefill(KN_ISA_AVX2, false, KN_FMT_COUNT, la);
  if (kn_engine_isa(gc_model_engine(m), KN_FMT_FP8) == KN_ISA_AVX2) {
    MT_EQ_U64(gc_model_fp8_linears(m), 3 * 3 + 2 + 2 * 2);
    const double d2 = kn_rel_l2(la, l[0], 12 * V);
    fprintf(stderr, "  avx2 engine, dense in fp8, vs ref fp8: rel L2 %.2e\n", d2);
    MT_LE(d2, 1e-4);
  } else {
    printf("  SKIP avx2 engine: this CPU has no AVX2\n");
  }
  gc_model_close(m);
  rm_model();
}

/* Drops every fast fp8-b128 kernel from the engine's candidates (kn__register_hook). */
static void no_fast_fp8(kn__kernel_table *t) {
  for (int i = KN_ISA_AVX2; i < KN_ISA_COUNT; i++) memset(&t->k[KN_FMT_FP8][i], 0, sizeof t->k[KN_FMT_FP8][i]);
}

/* An engine with no fp8 kernel but a fast bf16 one (an fp8 kernel that failed its start-up
 * self-test): the reference would be slower than bf16, so the FP8 dense weights are
 * dequantized into bf16 as before, near the reference's fp8 logits. (Its own test: the
 * hook must be set before the process's first engine.) */
MT_TEST(fp8_dense_weights_go_to_bf16_without_an_fp8_kernel) {
  make_model("--arch deepseek-v3 --groups 4 --topk-groups 2 --dense-layers 1 "
             "--shared-experts 1 --yarn 4 --dtype fp8 --seed 6");
  kn__register_hook = no_fast_fp8;
  static float lr[12 * 128], lb[12 * 128];
  gc_model *m = open_prefill(KN_ISA_COUNT, false, KN_FMT_COUNT, lb);
  const bool bf16_fast = kn_engine_isa(gc_model_engine(m), KN_FMT_BF16) != KN_ISA_REF;
  MT_EQ_INT(kn_engine_isa(gc_model_engine(m), KN_FMT_FP8), KN_ISA_REF);
  MT_EQ_U64(gc_model_fp8_linears(m), bf16_fast ? 0 : 3 * 3 + 2 + 2 * 2);
  gc_model_close(m);
  m = open_prefill(KN_ISA_REF, false, KN_FMT_COUNT, lr);
  gc_model_close(m);
  const double d = kn_rel_l2(lb, lr, 12 * V);
  fprintf(stderr, "  dense in %s vs ref fp8: rel L2 %.2e\n", bf16_fast ? "bf16" : "fp8", d);
  MT_LE(d, 5e-2);
  rm_model();
}

/* --dense-format fp8 quantizes a bf16 checkpoint's dense linears at load (128x128 blocks,
 * amax / 448), in place as packed alike (nothing can be served from the file), and the
 * logits stay near the bf16 model's. */
MT_TEST(dense_format_fp8_quantizes_a_bf16_checkpoint) {
  make_model(NULL);
  static float l[3][12 * 128];
  for (int c = 0; c < 3; c++) {
    gc_model *m = open_prefill(KN_ISA_REF, c == 2, c ? KN_FMT_FP8 : KN_FMT_COUNT, l[c]);
    /* q | k | v and o in 3 layers, 3 routers, lm_head */
    MT_EQ_U64(gc_model_fp8_linears(m), c ? 3 * 2 + 3 + 1 : 0);
    gc_model_close(m);
  }
  MT_TRUE(memcmp(l[1], l[2], sizeof l[1]) == 0);
  const double d = kn_rel_l2(l[1], l[0], 12 * V);
  fprintf(stderr, "  --dense-format fp8 vs bf16: rel L2 %.2e\n", d);
  MT_TRUE(d > 0);
  MT_LE(d, 1e-1);
  rm_model();
}

/* Rewrites the test model's one file with every kv_a_proj_with_mqa stored as bf16 (its
 * F8 codes dequantized with their block scales, then rounded) and without its scales:
 * an FP8 checkpoint whose q_a_proj and kv_a_proj_with_mqa (one linear) differ in dtype. */
static void kv_a_to_bf16(void) {
  char path[300];
  snprintf(path, sizeof path, "%s/model.safetensors", dir);
  mr_st *st = NULL;
  mr_st_writer *w = NULL;
  mr_err e = {0};
  MT_OK(mr_st_open(&st, path, &e), &e);
  MT_OK(mr_st_writer_new(&w), &e);
  int changed = 0;
  for (size_t i = 0; i < mr_st_count(st); i++) {
    const mr_st_tensor *t = mr_st_at(st, i);
    const bool kv_a = strstr(t->name, "kv_a_proj_with_mqa.weight") != NULL;
    if (kv_a && strstr(t->name, "_scale_inv")) continue;
    if (kv_a && mr_st_is_f8e4m3(t)) {
      char sn[200];
      snprintf(sn, sizeof sn, "%s_scale_inv", t->name);
      const mr_st_tensor *s = mr_st_find(st, sn);
      MT_TRUE(s != NULL && s->dtype == MR_DTYPE_F32);
      const uint64_t N = t->shape[0], K = t->shape[1], C = (K + 127) / 128;
      uint16_t *b = malloc(N * K * 2);
      for (uint64_t n = 0; n < N; n++)
        for (uint64_t k = 0; k < K; k++)
          b[n * K + k] = mr_f32_to_bf16(kn_fp8_e4m3_to_f32(((const uint8_t *)t->data)[n * K + k]) *
                                        ((const float *)s->data)[(n / 128) * C + k / 128]);
      MT_OK(mr_st_writer_add(w, t->name, MR_DTYPE_BF16, 2, t->shape, b), &e);
      free(b);
      changed++;
    } else if (mr_st_is_f8e4m3(t)) {
      MT_OK(mr_st_writer_add_f8e4m3(w, t->name, t->ndim, t->shape, t->data), &e);
    } else {
      MT_OK(mr_st_writer_add(w, t->name, t->dtype, t->ndim, t->shape, t->data), &e);
    }
  }
  MT_EQ_INT(changed, 3);
  MT_OK(mr_st_writer_write(w, path, &e), &e);
  mr_st_writer_free(w);
  mr_st_close(st);
}

/* FP8 parts stacked with bf16 ones in one linear (q_a_proj | kv_a_proj_with_mqa above) are
 * kept together in bf16 (the widest float of the parts), packed under --map-weights too:
 * the other linears stay fp8-b128; the logits are near --dense-format f32's (the same
 * linear in f32) and bit-identical with and without --map-weights. */
MT_TEST(fp8_beside_bf16_parts_are_widened) {
  make_model("--arch deepseek-v3 --groups 4 --topk-groups 2 --dense-layers 1 "
             "--shared-experts 1 --yarn 4 --dtype fp8 --seed 6");
  kv_a_to_bf16();
  static float l[3][12 * 128];
  for (int c = 0; c < 3; c++) {
    gc_model *m = open_prefill(KN_ISA_REF, c == 1, c == 2 ? KN_FMT_F32 : KN_FMT_COUNT, l[c]);
    MT_EQ_U64(gc_model_fp8_linears(m), c == 2 ? 0 : 3 * 3 + 2 + 2 * 2 - 3);
    gc_model_close(m);
  }
  MT_TRUE(memcmp(l[0], l[1], sizeof l[0]) == 0);
  const double d = kn_rel_l2(l[0], l[2], 12 * V);
  fprintf(stderr, "  q_a | kv_a in bf16 vs f32: rel L2 %.2e\n", d);
  MT_TRUE(d > 0); /* q_a is rounded to bf16 */
  MT_LE(d, 2e-2);
  rm_model();
}

/* Writes a bf16 NaN over element k of tensor name in the test model's one file. */
static void poke_nan(const char *name, uint64_t k) {
  char path[300];
  snprintf(path, sizeof path, "%s/model.safetensors", dir);
  const uint16_t nan = 0x7fc0;
  st_poke(path, name, 2 * k, &nan, 2);
}

/* A NaN in a dense weight fails the open, named, in place as packed: a weight served from
 * the file is checked as one copied out of it. */
MT_TEST(map_weights_refuses_a_nan_dense_weight) {
  static const char *const names[2] = {"model.layers.1.self_attn.o_proj.weight",
                                       "model.layers.2.self_attn.v_proj.weight"};
  for (int w = 0; w < 2; w++) {
    make_model(NULL);
    poke_nan(names[w], 70);
    for (int map = 0; map < 2; map++) {
      gc_model_opts o;
      gc_model_opts_init(&o);
      o.model_dir = dir;
      o.engine.threads = 2;
      o.max_seq = 16;
      o.quiet = true;
      o.map_weights = map;
      gc_model *m = (gc_model *)&m;
      mr_err e = {0};
      MT_EQ_INT(gc_model_open(&m, &o, &e), MR_EINVAL);
      MT_TRUE(m == NULL);
      fprintf(stderr, "  map %d: %s\n", map, e.msg);
      MT_CONTAINS(e.msg, "must be finite");
      /* packed, each part is loaded on its own; in place, q | k | v is one linear */
      MT_CONTAINS(e.msg, names[w]);
      MT_CONTAINS(e.msg, "column 6");
      if (map && w == 1) MT_CONTAINS(e.msg, "q_proj.weight | model.layers.2.self_attn.k_proj.weight | ");
      if (map && w == 1) MT_CONTAINS(e.msg, "(part 2, its row 1 of 32)");
    }
    rm_model();
  }
}

/* Writes e4m3 code c (a NaN: 0x7f / 0xff) at [row, col] of 2-D tensor name in the test
 * model's one file. */
static void poke_code(const char *name, uint64_t row, uint64_t col, uint8_t c) {
  char path[300];
  snprintf(path, sizeof path, "%s/model.safetensors", dir);
  mr_st *st = NULL;
  mr_err e = {0};
  MT_OK(mr_st_open(&st, path, &e), &e);
  const mr_st_tensor *t = mr_st_find(st, name);
  MT_TRUE(t != NULL && mr_st_is_f8e4m3(t) && t->ndim == 2 && row < t->shape[0] && col < t->shape[1]);
  const uint64_t K = t->shape[1];
  mr_st_close(st);
  st_poke(path, name, row * K + col, &c, 1);
}

/* A NaN code in an FP8 weight that the loader dequantizes (kv_b_proj, always fp32 for the
 * absorbed MLA; o_proj under --dense-format bf16) fails the open, naming the tensor and the
 * code's [row, column] (the first of two in row-major order); kept as fp8-b128
 * (the default) the same o_proj is refused too. */
MT_TEST(fp8_nan_code_in_a_dequantized_weight_is_named) {
  static const struct { const char *name; kn_format dense; const char *want; } c[3] = {
      {"model.layers.1.self_attn.kv_b_proj.weight", KN_FMT_COUNT, "[40, 5] is a NaN code (0xff)"},
      {"model.layers.2.self_attn.o_proj.weight", KN_FMT_BF16, "[40, 5] is a NaN code (0xff)"},
      {"model.layers.2.self_attn.o_proj.weight", KN_FMT_COUNT, "W[row 40, column 5] is a NaN code"}};
  for (int i = 0; i < 3; i++) {
    make_model("--arch deepseek-v3 --groups 4 --topk-groups 2 --dense-layers 1 "
               "--shared-experts 1 --yarn 4 --dtype fp8 --seed 6");
    poke_code(c[i].name, 60, 3, 0x7f);
    poke_code(c[i].name, 40, 5, 0xff);
    gc_model_opts o;
    prefill_opts(&o, KN_ISA_REF, false, c[i].dense);
    gc_model *m = (gc_model *)&m;
    mr_err e = {0};
    MT_EQ_INT(gc_model_open(&m, &o, &e), MR_EINVAL);
    MT_TRUE(m == NULL);
    fprintf(stderr, "  %s\n", e.msg);
    MT_CONTAINS(e.msg, c[i].name);
    MT_CONTAINS(e.msg, c[i].want);
    rm_model();
  }
}

MT_TEST(open_refuses_bad_options) {
  make_model(NULL);
  gc_model_opts o;
  gc_model_opts_init(&o);
  o.quiet = true;
  gc_model *m = NULL;
  mr_err e = {0};
  MT_EQ_INT(gc_model_open(&m, &o, &e), MR_EINVAL);
  MT_CONTAINS(e.msg, "--model");
  o.model_dir = "/nonexistent/moerpc-model";
  MT_TRUE(gc_model_open(&m, &o, &e) != 0);
  MT_CONTAINS(e.msg, "/nonexistent/moerpc-model");
  o.model_dir = dir;
  o.max_batch = 100000;
  MT_EQ_INT(gc_model_open(&m, &o, &e), MR_ERANGE);
  MT_CONTAINS(e.msg, "--batch");
  MT_TRUE(m == NULL);
  rm_model();
}

MT_MAIN()
