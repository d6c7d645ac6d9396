/*
 * test_es_control.c - the pure parts of live placement on the server side
 * (docs/DESIGN.md section 15):
 *   es_control_validate: a LoadRequest / UnloadRequest pair list against the model (ranges,
 *     dense layers, empty items, another model's fingerprint), the distinct pairs counted;
 *   es_load_mem_check: RESOURCE_EXHAUSTED naming the bytes needed and free;
 *   kn_layer_rebuild: the new layer shares kept experts with the old one (same results,
 *     no copy), takes the added ones from the staging layer, and freeing the old layer
 *     afterwards frees only the dropped experts (ASan checks there is no double free and no
 *     use after free); kn_layer_forget drops a rebuilt layer without its weights.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "expert_server/es.h"
#include "proto/pr.h"
#include "tests/unit/mt.h"

#define NL 4
#define E 8
static const uint8_t is_moe[NL] = {0, 1, 1, 1}; /* layer 0 dense */
static es_limits lim = {.num_layers = NL, .num_experts = E, .hidden_size = 16, .max_tokens = 8,
                        .is_moe = is_moe};

static uint32_t ids_a[] = {0, 3, 3, 7}, ids_b[] = {1};
static Moerpc__V1__LayerExperts item(uint32_t layer, uint32_t *ids, size_t n) {
  Moerpc__V1__LayerExperts it = MOERPC__V1__LAYER_EXPERTS__INIT;
  it.layer = layer;
  it.experts = ids;
  it.n_experts = n;
  return it;
}

static int check(Moerpc__V1__LayerExperts *items, size_t n, const char *fp, uint64_t *pairs,
                 uint8_t *bits, mr_err *e) {
  const Moerpc__V1__LayerExperts *p[4];
  for (size_t i = 0; i < n; i++) p[i] = &items[i];
  return es_control_validate(p, n, fp, "0123456789abcdef", &lim, bits, pairs, e);
}

MT_TEST(good_pairs_are_counted_once) {
  Moerpc__V1__LayerExperts it[3] = {item(1, ids_a, 4), item(3, ids_b, 1), item(1, ids_b, 1)};
  uint8_t bits[NL * E];
  uint64_t n = 0;
  mr_err e;
  MT_OK(check(it, 3, "", &n, bits, &e), &e);
  MT_EQ_U64(n, 5); /* (1,0) (1,3) (1,7) (3,1) (1,1): the repeated 3 counts once */
  MT_TRUE(bits[1 * E + 3] && bits[1 * E + 1] && bits[3 * E + 1] && !bits[2 * E + 3]);
}

MT_TEST(bad_pairs_name_the_field) {
  uint8_t bits[NL * E];
  uint64_t n = 0;
  mr_err e;
  Moerpc__V1__LayerExperts it = item(NL, ids_a, 4);
  MT_EQ_INT(check(&it, 1, "", &n, bits, &e), MR_EINVAL);
  MT_CONTAINS(e.msg, "layers[0].layer = 4, must be < num_layers = 4");
  it = item(0, ids_a, 4);
  MT_EQ_INT(check(&it, 1, "", &n, bits, &e), MR_EINVAL);
  MT_CONTAINS(e.msg, "is a dense layer");
  it = item(2, ids_a, 0);
  MT_EQ_INT(check(&it, 1, "", &n, bits, &e), MR_EINVAL);
  MT_CONTAINS(e.msg, "names no expert");
  uint32_t big[] = {2, 8};
  it = item(2, big, 2);
  MT_EQ_INT(check(&it, 1, "", &n, bits, &e), MR_EINVAL);
  MT_CONTAINS(e.msg, "layers[0].experts[1] = 8 in layer 2, must be < num_experts = 8");
  MT_EQ_INT(check(NULL, 0, "", &n, bits, &e), MR_EINVAL);
  MT_CONTAINS(e.msg, "names no (layer, expert) pair");
  it = item(2, ids_a, 4);
  MT_EQ_INT(check(&it, 1, "fedcba9876543210", &n, bits, &e), MR_EMISMATCH);
  MT_CONTAINS(e.msg, "model_fingerprint = \"fedcba9876543210\"");
  /* The peer's text is logged: escaped, and bounded. */
  MT_EQ_INT(check(&it, 1, "ab\ncd\x1b[31m", &n, bits, &e), MR_EMISMATCH);
  MT_CONTAINS(e.msg, "model_fingerprint = \"ab\\ncd\\x1b[31m\"");
  char longfp[300];
  memset(longfp, 'f', sizeof longfp - 1);
  longfp[sizeof longfp - 1] = '\0';
  MT_EQ_INT(check(&it, 1, longfp, &n, bits, &e), MR_EMISMATCH);
  MT_CONTAINS(e.msg, "fff...\", but this server");
  MT_EQ_INT(pr_status_from_mr(MR_EMISMATCH), 9); /* FAILED_PRECONDITION */
  MT_OK(check(&it, 1, "0123456789abcdef", &n, bits, &e), &e);
}

MT_TEST(memory_rule_names_needed_and_free) {
  mr_err e;
  MT_OK(es_load_mem_check(100, 100, &e), &e);
  MT_EQ_INT(es_load_mem_check(3000000, 1000000, &e), MR_EEXHAUSTED);
  MT_CONTAINS(e.msg, "needs 3000000 bytes");
  MT_CONTAINS(e.msg, "only 1000000 bytes");
  MT_EQ_INT(pr_status_from_mr(MR_EEXHAUSTED), 8); /* RESOURCE_EXHAUSTED */
}

/* ---- kn_layer_rebuild -------------------------------------------------------------------- */

#define KH 32
#define KI 16
static float wt[E][3][KH * KI];

static void load(kn_layer *L, uint32_t x) {
  mr_err e;
  MT_OK(kn_layer_load_expert(L, x, wt[x][0], wt[x][1], wt[x][2], MR_DTYPE_F32, &e), &e);
}

/* One token through expert x of L (ref kernel): out[KH]. */
static void fwd(kn_engine *eng, const kn_layer *L, uint32_t x, float *out) {
  static float in[KH];
  for (int i = 0; i < KH; i++) in[i] = (float)(i % 5) * 0.25f - 0.5f;
  int32_t id = (int32_t)x;
  float w = 1.0f;
  kn_moe_args a = {.n_tokens = 1, .top_k = 1, .ids = &id, .weights = &w, .x = in,
                   .x_dtype = MR_DTYPE_F32, .out = out};
  mr_err e;
  MT_OK(kn_moe_forward(eng, L, &a, NULL, &e), &e);
}

MT_TEST(rebuild_shares_kept_takes_added_frees_dropped_once) {
  srand(7);
  for (int x = 0; x < E; x++)
    for (int p = 0; p < 3; p++)
      for (int i = 0; i < KH * KI; i++) wt[x][p][i] = (float)(rand() % 200 - 100) / 400.0f;
  kn_engine *eng = NULL;
  mr_err e;
  kn_engine_opts eo = {.isa = KN_ISA_REF, .threads = 1};
  MT_OK(kn_engine_new(&eng, &eo, &e), &e);
  kn_layer_desc d = {.hidden = KH, .inter = KI, .num_experts = E, .format = KN_FMT_F32};
  kn_layer *old = NULL, *stage = NULL, *nw = NULL;
  MT_OK(kn_layer_new(&old, eng, &d, &e), &e);
  MT_OK(kn_layer_new(&stage, eng, &d, &e), &e);
  for (uint32_t x = 0; x < 4; x++) load(old, x);  /* old: 0-3 */
  load(stage, 5);                                 /* add 5 */
  load(stage, 2);                                 /* and a fresh copy of 2 */
  float ref[E][KH], got[KH];
  for (uint32_t x = 0; x < 4; x++) fwd(eng, old, x, ref[x]);
  uint8_t keep[E] = {1, 0, 1, 1, 0, 0, 0, 0};     /* drop 1 */
  MT_OK(kn_layer_rebuild(&nw, old, keep, stage, &e), &e);
  for (uint32_t x = 0; x < E; x++)
    MT_EQ_INT(kn_layer_has_expert(nw, x), x == 0 || x == 2 || x == 3 || x == 5);
  MT_EQ_U64(kn_layer_bytes(nw), 4 * kn_layer_expert_bytes(nw));
  MT_FALSE(kn_layer_has_expert(stage, 5)); /* moved */
  MT_EQ_U64(kn_layer_bytes(stage), 0);
  /* The old layer still computes every expert it had (requests in flight on it). */
  for (uint32_t x = 0; x < 4; x++) {
    fwd(eng, old, x, got);
    MT_TRUE(memcmp(got, ref[x], sizeof got) == 0);
  }
  kn_layer_free(old);   /* frees expert 1 and its own copy of 2 only */
  kn_layer_free(stage); /* empty now */
  for (uint32_t x = 0; x < 4; x++) {
    if (x == 1) continue;
    fwd(eng, nw, x, got);
    MT_TRUE(memcmp(got, ref[x], sizeof got) == 0);
  }
  /* A second rebuild from the new layer, then forget it: nw owns all its weights again. */
  kn_layer *tmp = NULL;
  uint8_t all[E];
  memset(all, 1, sizeof all);
  MT_OK(kn_layer_rebuild(&tmp, nw, all, NULL, &e), &e);
  kn_layer_forget(tmp, nw);
  fwd(eng, nw, 5, got);
  MT_TRUE(isfinite(got[0]));
  MT_EQ_INT(kn_layer_rebuild(&tmp, NULL, NULL, NULL, &e), MR_EINVAL);
  kn_layer_free(nw);
  kn_engine_free(eng);
}

/* ---- kn_layer_adopt_expert (the weight cache, docs/DESIGN.md section 23) --------------------- */

/* Blocks copied out of a packed layer, adopted by another layer (split into 2 slices):
 * bit-identical outputs; the blocks are borrowed (the layer frees none of them: ASan would
 * flag a free of this one buffer's interior); misaligned blocks are refused; populate faults
 * in every byte of the regions. */
MT_TEST(adopted_blocks_compute_like_packed_ones) {
  srand(11);
  for (int x = 0; x < E; x++)
    for (int p = 0; p < 3; p++)
      for (int i = 0; i < KH * KI; i++) wt[x][p][i] = (float)(rand() % 200 - 100) / 400.0f;
  kn_engine *eng = NULL;
  mr_err e;
  kn_engine_opts eo = {.isa = KN_ISA_REF, .threads = 2, .force_split = 2};
  MT_OK(kn_engine_new(&eng, &eo, &e), &e);
  kn_layer_desc d = {.hidden = KH, .inter = 64, .num_experts = E, .format = KN_FMT_INT8};
  static float big[3][KH * 64];
  for (int p = 0; p < 3; p++)
    for (int i = 0; i < KH * 64; i++) big[p][i] = (float)(rand() % 200 - 100) / 300.0f;
  kn_layer *src = NULL, *dst = NULL;
  MT_OK(kn_layer_new(&src, eng, &d, &e), &e);
  MT_OK(kn_layer_new(&dst, eng, &d, &e), &e);
  MT_EQ_INT(kn_layer_slices(src), 2);
  MT_OK(kn_layer_load_expert(src, 3, big[0], big[1], big[2], MR_DTYPE_F32, &e), &e);
  uint64_t b0 = kn_layer_slice_bytes(src, 0), b1 = kn_layer_slice_bytes(src, 1);
  MT_TRUE(b0 > 0 && b1 > 0 && b0 % 64 == 0 && b1 % 64 == 0);
  MT_EQ_U64(b0 + b1, kn_layer_expert_bytes(src));
  MT_EQ_U64(kn_layer_slice_off(src, 1), kn_layer_slice_len(src, 0));
  char *buf = mr_malloc_aligned(b0 + b1 + 64, 4096);
  MT_TRUE(buf != NULL);
  memcpy(buf, kn_layer_expert_slice(src, 3, 0), b0);
  memcpy(buf + b0, kn_layer_expert_slice(src, 3, 1), b1);
  MT_TRUE(kn_layer_expert_slice(src, 4, 0) == NULL); /* not loaded */
  void *bad[2] = {buf + 8, buf + b0};
  MT_EQ_INT(kn_layer_adopt_expert(dst, 3, bad, &e), MR_EINVAL);
  MT_CONTAINS(e.msg, "not 64-byte aligned");
  MT_FALSE(kn_layer_has_expert(dst, 3));
  void *mem[2] = {buf, buf + b0};
  MT_OK(kn_layer_adopt_expert(dst, 3, mem, &e), &e);
  MT_TRUE(kn_layer_has_expert(dst, 3));
  MT_EQ_U64(kn_layer_bytes(dst), kn_layer_expert_bytes(dst));
  float ref[KH], got[KH];
  fwd(eng, src, 3, ref);
  fwd(eng, dst, 3, got);
  MT_TRUE(memcmp(got, ref, sizeof got) == 0);
  /* Shared on by a rebuild, then all layers freed: the buffer is still ours. */
  kn_layer *nw = NULL;
  uint8_t all[E];
  memset(all, 1, sizeof all);
  MT_OK(kn_layer_rebuild(&nw, dst, all, NULL, &e), &e);
  kn_layer_free(dst);
  fwd(eng, nw, 3, got);
  MT_TRUE(memcmp(got, ref, sizeof got) == 0);
  kn_layer_free(nw);
  const void *base[2] = {buf, buf + b0};
  const uint64_t bytes[2] = {b0, b1};
  MT_EQ_U64(kn_engine_populate(eng, base, bytes, 2), b0 + b1);
  mr_free_aligned(buf);
  kn_layer_free(src);
  kn_engine_free(eng);
}

MT_MAIN()
