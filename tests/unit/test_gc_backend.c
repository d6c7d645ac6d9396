/*
 * test_gc_backend.c - the CPU backend's DeepSeek operations against independent
 * computations written here:
 *   route NOAUX_TC: groups by the sum of their top-2 biased scores, the bias choosing but
 *     not weighting, renormalisation, routed_scaling_factor, ids ordered by weight;
 *   rope: interleaved pairs give the same q.k as rotate-half on the de-interleaved vectors
 *     (which is what transformers' rope_interleave computes), and the yarn factor scales;
 *   mla_attention (absorbed form) equals standard attention on the expanded keys and
 *     values (k = [W_uk c, k_rot], v = W_uv c), for a ragged batch at several positions.
 */
#include <math.h>
#include <string.h>

#include "gpu_client/runner/backend.h"
#include "tests/unit/mt.h"

static kn_engine *eng;
static gc_backend *bk;

static void open_backend(uint32_t max_seq) {
  kn_engine_opts o = {.isa = KN_ISA_REF, .threads = 2};
  mr_err e = {0};
  MT_OK(kn_engine_new(&eng, &o, &e), &e);
  MT_OK(gc_bk_cpu_new(&bk, eng, max_seq, &e), &e);
}
static void close_backend(void) {
  bk->ops->destroy(bk);
  kn_engine_free(eng);
}

static uint64_t rng = 12345;
static float frand(void) { /* uniform in [-1, 1) */
  rng = rng * 6364136223846793005ull + 1442695040888963407ull;
  return (float)((rng >> 40) / (double)(1ull << 24)) * 2.0f - 1.0f;
}
static float sigm(float x) { return 1.0f / (1.0f + expf(-x)); }

MT_TEST(route_noaux_tc_groups_bias_and_scale) {
  open_backend(8);
  /* 8 experts in 4 groups of 2, keep 2 groups, top-3. Logits chosen so that:
   *  - group 3 (experts 6, 7) has the best single expert without bias (7) but a low pair;
   *  - the bias lifts expert 2 into the selection though its weight stays its own score. */
  const float logits[8] = {1.0f, 0.9f, -2.0f, 0.8f, -1.0f, -1.2f, 3.0f, -4.0f};
  const float bias[8] = {0, 0, 3.0f, 0, 0, 0, 0, 0};
  float s[8];
  for (int x = 0; x < 8; x++) s[x] = sigm(logits[x]);
  /* group sums of top-2 choices: g0 = s0+s1, g1 = (s2+3)+s3, g2 = s4+s5, g3 = s6+s7 */
  int32_t ids[3];
  float w[3];
  gc_bk_route r = {.n_tokens = 1, .num_experts = 8, .top_k = 3, .norm_topk = true,
                   .scoring = MR_SCORE_SIGMOID, .method = MR_TOPK_NOAUX_TC, .bias = bias,
                   .n_group = 4, .topk_group = 2, .scale = 2.5f, .logits = logits, .ids = ids,
                   .weights = w};
  mr_err e = {0};
  MT_OK(bk->ops->route(bk, &r, &e), &e);
  /* best groups: g1 (3.12 + 0.69) and g0 (0.73 + 0.71) beat g3 (0.95 + 0.02); experts by
   * choice among them: 2 (3.12), 0 (0.73), 1 (0.71); ordered by weight s: 0, 1, 2 */
  MT_EQ_INT(ids[0], 0);
  MT_EQ_INT(ids[1], 1);
  MT_EQ_INT(ids[2], 2);
  float sum = s[0] + s[1] + s[2];
  MT_NEAR(w[0], s[0] / sum * 2.5f, 1e-6);
  MT_NEAR(w[1], s[1] / sum * 2.5f, 1e-6);
  MT_NEAR(w[2], s[2] / sum * 2.5f, 1e-6);
  /* one group = plain top-k of the biased scores; without norm the weights are s * scale */
  r.n_group = 1, r.topk_group = 1, r.norm_topk = false, r.scale = 1.0f;
  MT_OK(bk->ops->route(bk, &r, &e), &e);
  MT_EQ_INT(ids[0], 6); /* by weight: s6 = 0.95 > s0 > s2 */
  MT_EQ_INT(ids[1], 0);
  MT_EQ_INT(ids[2], 2); /* chosen through the bias (choice 3.12), weighted 0.12 */
  MT_NEAR(w[0], s[6], 1e-6);
  MT_NEAR(w[2], s[2], 1e-6);
  /* groups that cannot hold top_k are refused */
  r.n_group = 4, r.topk_group = 1;
  MT_EQ_INT(bk->ops->route(bk, &r, &e), MR_ERANGE);
  close_backend();
}

MT_TEST(rope_interleave_equals_rotate_half_of_the_deinterleaved) {
  open_backend(8);
  enum { D = 8, T = 3 };
  float inv[D / 2] = {1.0f, 0.3f, 0.05f, 0.001f};
  uint32_t pos[T] = {0, 5, 77};
  float a[T][D], b[T][D], ra[T][D], rb[T][D];
  for (int t = 0; t < T; t++)
    for (int i = 0; i < D; i++) a[t][i] = frand(), b[t][i] = frand();
  memcpy(ra, a, sizeof a);
  memcpy(rb, b, sizeof b);
  gc_bk_rope r = {.n_tokens = T, .n_heads = 1, .head_stride = D, .dim = D, .interleave = true,
                  .scale = 1.0f, .x = &ra[0][0], .ld = D, .pos = pos, .inv_freq = inv};
  mr_err e = {0};
  MT_OK(bk->ops->rope(bk, &r, &e), &e);
  r.x = &rb[0][0];
  MT_OK(bk->ops->rope(bk, &r, &e), &e);
  /* de-interleave (x0, x2, x4, x6, x1, x3, x5, x7), rotate-half, compare dot products */
  float da[T][D], db[T][D];
  for (int t = 0; t < T; t++)
    for (int i = 0; i < D / 2; i++) {
      da[t][i] = a[t][2 * i], da[t][i + D / 2] = a[t][2 * i + 1];
      db[t][i] = b[t][2 * i], db[t][i + D / 2] = b[t][2 * i + 1];
    }
  r.interleave = false;
  r.x = &da[0][0];
  MT_OK(bk->ops->rope(bk, &r, &e), &e);
  r.x = &db[0][0];
  MT_OK(bk->ops->rope(bk, &r, &e), &e);
  for (int t = 0; t < T; t++)
    for (int u = 0; u < T; u++) {
      double d1 = 0, d2 = 0;
      for (int i = 0; i < D; i++) d1 += ra[t][i] * rb[u][i], d2 += da[t][i] * db[u][i];
      MT_NEAR(d1, d2, 1e-5);
    }
  /* scale multiplies cos and sin: the rotated vector scales */
  float c[D], c2[D];
  for (int i = 0; i < D; i++) c[i] = c2[i] = frand();
  uint32_t p1 = 9;
  gc_bk_rope s1 = {.n_tokens = 1, .n_heads = 1, .head_stride = D, .dim = D, .scale = 1.0f,
                   .x = c, .ld = D, .pos = &p1, .inv_freq = inv};
  gc_bk_rope s2 = s1;
  s2.x = c2, s2.scale = 1.5f;
  MT_OK(bk->ops->rope(bk, &s1, &e), &e);
  MT_OK(bk->ops->rope(bk, &s2, &e), &e);
  for (int i = 0; i < D; i++) MT_NEAR(c2[i], 1.5f * c[i], 1e-6);
  /* a part outside the head is refused */
  s1.offset = 4;
  MT_EQ_INT(bk->ops->rope(bk, &s1, &e), MR_EINVAL);
  close_backend();
}

MT_TEST(mla_absorbed_equals_expanded_attention) {
  enum { NH = 3, NOPE = 8, ROPE = 4, VD = 6, R = 10, S = 16, QH = NOPE + ROPE, T = 5 };
  open_backend(S);
  static float w[NH * (NOPE + VD) * R];
  for (size_t i = 0; i < sizeof w / sizeof w[0]; i++) w[i] = 0.5f * frand();
  /* a ragged step: slot 0 prefills 3 tokens, slot 1 has 2 new tokens at positions 0, 1 */
  const uint32_t seq[T] = {0, 1, 0, 0, 1}, pos[T] = {0, 0, 1, 2, 1};
  static float q[T][NH * QH], kv[T][R + ROPE], out[T][NH * VD];
  for (int t = 0; t < T; t++) {
    for (int i = 0; i < NH * QH; i++) q[t][i] = frand();
    for (int i = 0; i < R + ROPE; i++) kv[t][i] = frand();
  }
  static float cache[2 * S * (R + ROPE)];
  gc_bk_mla a = {.n_tokens = T, .seq = seq, .pos = pos, .n_heads = NH, .nope = NOPE,
                 .rope = ROPE, .v_dim = VD, .kv_lora = R, .max_seq = S, .scale = 0.3f,
                 .q = &q[0][0], .ldq = NH * QH, .kv = &kv[0][0], .ldkv = R + ROPE, .w_kv_b = w,
                 .cache = cache, .out = &out[0][0]};
  mr_err e = {0};
  MT_OK(bk->ops->mla_attention(bk, &a, &e), &e);
  /* expanded: per token k_h = [W_uk_h c, k_rot], v_h = [W_uv_h c, 0 pad to QH] */
  static float k[T][NH * QH], v[T][NH * QH], eq[T][NH * QH], eo[T][NH * QH];
  static float kc[2 * S * NH * QH], vc[2 * S * NH * QH];
  for (int t = 0; t < T; t++)
    for (int h = 0; h < NH; h++) {
      const float *wh = w + (size_t)h * (NOPE + VD) * R;
      for (int i = 0; i < NOPE; i++) {
        double s = 0;
        for (int j = 0; j < R; j++) s += wh[i * R + j] * kv[t][j];
        k[t][h * QH + i] = (float)s;
      }
      for (int i = 0; i < ROPE; i++) k[t][h * QH + NOPE + i] = kv[t][R + i];
      for (int d = 0; d < QH; d++) {
        double s = 0;
        if (d < VD)
          for (int j = 0; j < R; j++) s += wh[(NOPE + d) * R + j] * kv[t][j];
        v[t][h * QH + d] = (float)s;
      }
      memcpy(&eq[t][h * QH], &q[t][h * QH], QH * sizeof(float));
    }
  gc_bk_attn x = {.n_tokens = T, .seq = seq, .pos = pos, .n_heads = NH, .n_kv_heads = NH,
                  .head_dim = QH, .max_seq = S, .scale = 0.3f, .q = &eq[0][0], .k = &k[0][0],
                  .v = &v[0][0], .ld = NH * QH, .k_cache = kc, .v_cache = vc,
                  .out = &eo[0][0]};
  MT_OK(bk->ops->attention(bk, &x, &e), &e);
  double worst = 0;
  for (int t = 0; t < T; t++)
    for (int h = 0; h < NH; h++)
      for (int d = 0; d < VD; d++) {
        double diff = fabs(out[t][h * VD + d] - eo[t][h * QH + d]);
        if (diff > worst) worst = diff;
      }
  fprintf(stderr, "  absorbed vs expanded: worst abs diff %.2e\n", worst);
  MT_LE(worst, 1e-5);
  /* the cache holds the latents, not expanded keys */
  MT_TRUE(memcmp(cache + (size_t)(1 * S + 1) * (R + ROPE), kv[4], sizeof kv[4]) == 0);
  close_backend();
}

MT_MAIN()
