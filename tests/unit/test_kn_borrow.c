/*
 * test_kn_borrow.c - experts served in place (kn_layer_borrow_expert, the server's
 * --map-weights; docs/DESIGN.md section 6.6):
 *   - a borrowed expert gives the bits of the same expert packed by kn_layer_load_expert, for
 *     bf16 / f16 / f32 on every ISA this CPU has (AMX included, at T = 16 where its tiles
 *     run), one token and sixteen;
 *   - the layer reads the caller's arrays and never frees them (ASan would flag a free of a
 *     static array), also after kn_layer_rebuild shared the expert on;
 *   - refusals: a format that does not store the source dtype as it is, two slices (NUMA),
 *     an array not aligned to its element (MR_ENOTSUP: the caller packs instead), and a
 *     weight that is not finite (MR_EINVAL naming matrix, row and column), each leaving the
 *     expert unloaded;
 *   - FP8 (fp8-b128) codes served in place with the layer's own per-row scales: the bits of
 *     the packed layer on every ISA, from arrays and from safetensors-like tensors (F32 and
 *     BF16 scales); a NaN code and a bad scale refused and named, two slices MR_ENOTSUP;
 *     freeing the layer frees the scales and leaves the codes (ASan);
 *   - kn_layer_take_expert_st, the loaders' one "in place or packed" rule: in place where
 *     asked and possible, packed where not asked, misaligned, block-scaled (into a float
 *     layer) or of mixed
 *     dtypes (kn_layer_borrow_expert_st's refusals), and the same numbers either way.
 */
#include "kernels/kn.h"
#include "tests/unit/kn_test.h"
#include "tests/unit/mt.h"

#include <math.h>
#include <string.h>

#define H 256
#define I 128
#define NE 4
#define T_MAX 16

static uint16_t w16[NE][3][H * I + 8]; /* bf16 / f16 bits (+8: room for a misaligned copy) */
static float w32[NE][3][H * I];

static void fill(mr_dtype dt) {
  for (int x = 0; x < NE; x++)
    for (int p = 0; p < 3; p++)
      for (int i = 0; i < H * I; i++) {
        float v = rng_normal() * 0.05f;
        w32[x][p][i] = v;
        if (dt == MR_DTYPE_BF16) mr_convert_from_f32(&w16[x][p][i], MR_DTYPE_BF16, &v, 1);
        if (dt == MR_DTYPE_F16) mr_convert_from_f32(&w16[x][p][i], MR_DTYPE_F16, &v, 1);
      }
}

static const void *arr(mr_dtype dt, int x, int p) {
  return dt == MR_DTYPE_F32 ? (const void *)w32[x][p] : (const void *)w16[x][p];
}

static kn_format fmt_of(mr_dtype dt) {
  return dt == MR_DTYPE_F32 ? KN_FMT_F32 : dt == MR_DTYPE_F16 ? KN_FMT_F16 : KN_FMT_BF16;
}

/* T tokens, two experts each (ids cycle over the layer's experts), into out[T * H]. */
static void fwd(kn_engine *eng, const kn_layer *L, uint32_t T, float *out) {
  static float x[T_MAX * H], wts[T_MAX * 2];
  static int32_t ids[T_MAX * 2];
  for (uint32_t t = 0; t < T; t++) {
    for (int h = 0; h < H; h++) x[t * H + h] = (float)((t * 7 + (uint32_t)h) % 11) * 0.1f - 0.5f;
    ids[2 * t] = (int32_t)(t % NE);
    ids[2 * t + 1] = (int32_t)((t + 1) % NE);
    wts[2 * t] = 0.75f;
    wts[2 * t + 1] = 0.25f;
  }
  kn_moe_args a = {.n_tokens = T, .top_k = 2, .ids = ids, .weights = wts, .x = x,
                   .x_dtype = MR_DTYPE_F32, .out = out};
  mr_err e;
  MT_OK(kn_moe_forward(eng, L, &a, NULL, &e), &e);
}

/* packed and inplace hold the same experts: the same bytes counted, no packed block to copy
 * out of inplace, the same outputs at T = 1 and T_MAX; then inplace shared on by a rebuild
 * and every layer freed (the caller's arrays are still its own; ASan checks). Returns the
 * forward pairs compared. */
static int expect_in_place_like_packed(kn_engine *eng, kn_layer *packed, kn_layer *inplace) {
  const kn_format f = kn_layer_get_desc(packed)->format;
  int runs = 0;
  mr_err e;
  MT_EQ_U64(kn_layer_bytes(inplace), kn_layer_bytes(packed));
  MT_TRUE(kn_layer_expert_slice(inplace, 0, 0) == NULL); /* no packed block to copy out */
  static float ref[T_MAX * H], got[T_MAX * H];
  for (uint32_t T = 1; T <= T_MAX; T += T_MAX - 1) {
    memset(got, 0xff, sizeof got);
    fwd(eng, packed, T, ref);
    fwd(eng, inplace, T, got);
    MT_TRUE(isfinite(ref[0]) && ref[0] != 0.0f);
    if (memcmp(ref, got, (size_t)T * H * sizeof(float)) != 0)
      MT__FAIL("%s %s T=%u: in place differs from packed", kn_isa_name(kn_engine_isa(eng, f)),
               kn_format_name(f), T);
    runs++;
  }
  kn_layer *nw = NULL;
  uint8_t all[NE] = {1, 1, 1, 1};
  MT_OK(kn_layer_rebuild(&nw, inplace, all, NULL, &e), &e);
  kn_layer_free(inplace);
  fwd(eng, nw, T_MAX, got);
  fwd(eng, packed, T_MAX, ref);
  MT_TRUE(memcmp(ref, got, sizeof got) == 0);
  kn_layer_free(nw);
  kn_layer_free(packed);
  return runs;
}

MT_TEST(borrowed_experts_compute_like_packed_ones_on_every_isa) {
  const mr_dtype dts[] = {MR_DTYPE_BF16, MR_DTYPE_F16, MR_DTYPE_F32};
  const kn_isa top = kn_isa_detect();
  int runs = 0;
  rng_seed(5);
  for (int d = 0; d < 3; d++) {
    fill(dts[d]);
    for (int isa = KN_ISA_REF; isa <= (int)top; isa++) {
      kn_engine *eng = NULL;
      mr_err e;
      kn_engine_opts eo = {.isa = (kn_isa)isa, .threads = 2};
      MT_OK(kn_engine_new(&eng, &eo, &e), &e);
      kn_layer_desc desc = {.hidden = H, .inter = I, .num_experts = NE, .format = fmt_of(dts[d])};
      kn_layer *packed = NULL, *inplace = NULL;
      MT_OK(kn_layer_new(&packed, eng, &desc, &e), &e);
      MT_OK(kn_layer_new(&inplace, eng, &desc, &e), &e);
      MT_TRUE(kn_layer_can_borrow(inplace, dts[d]));
      for (uint32_t x = 0; x < NE; x++) {
        MT_OK(kn_layer_load_expert(packed, x, arr(dts[d], x, 0), arr(dts[d], x, 1), arr(dts[d], x, 2),
                                   dts[d], &e), &e);
        MT_OK(kn_layer_borrow_expert(inplace, x, arr(dts[d], x, 0), arr(dts[d], x, 1),
                                     arr(dts[d], x, 2), dts[d], &e), &e);
      }
      runs += expect_in_place_like_packed(eng, packed, inplace);
      kn_engine_free(eng);
    }
  }
  MT_TRUE(runs >= 6);
}

MT_TEST(what_cannot_be_served_in_place_is_refused_and_left_unloaded) {
  rng_seed(9);
  fill(MR_DTYPE_BF16);
  kn_engine *eng = NULL, *two = NULL;
  mr_err e;
  kn_engine_opts eo = {.isa = KN_ISA_REF, .threads = 2};
  MT_OK(kn_engine_new(&eng, &eo, &e), &e);
  kn_layer_desc desc = {.hidden = H, .inter = I, .num_experts = NE, .format = KN_FMT_INT8};
  kn_layer *L = NULL;
  /* A quantized format: the weights must be converted. */
  MT_OK(kn_layer_new(&L, eng, &desc, &e), &e);
  MT_FALSE(kn_layer_can_borrow(L, MR_DTYPE_BF16));
  MT_EQ_INT(kn_layer_borrow_expert(L, 0, w16[0][0], w16[0][1], w16[0][2], MR_DTYPE_BF16, &e), MR_ENOTSUP);
  MT_CONTAINS(e.msg, "a int8 layer on 1 slice(s) cannot serve bf16 weights in place");
  MT_FALSE(kn_layer_has_expert(L, 0));
  kn_layer_free(L);
  /* Another float dtype than the one stored. */
  desc.format = KN_FMT_BF16;
  MT_OK(kn_layer_new(&L, eng, &desc, &e), &e);
  MT_EQ_INT(kn_layer_borrow_expert(L, 0, w32[0][0], w32[0][1], w32[0][2], MR_DTYPE_F32, &e), MR_ENOTSUP);
  /* Misaligned: a bf16 array at an odd address. */
  static uint8_t odd[H * I * 2 + 2];
  memcpy(odd + 1, w16[0][2], (size_t)H * I * 2);
  MT_EQ_INT(kn_layer_borrow_expert(L, 0, w16[0][0], w16[0][1], odd + 1, MR_DTYPE_BF16, &e), MR_ENOTSUP);
  MT_CONTAINS(e.msg, "down at");
  MT_CONTAINS(e.msg, "not 2-byte aligned");
  /* A weight that is not finite: named, nothing loaded. */
  const uint16_t keep = w16[1][2][5 * I + 7];
  w16[1][2][5 * I + 7] = 0x7fc0; /* bf16 NaN */
  MT_EQ_INT(kn_layer_borrow_expert(L, 1, w16[1][0], w16[1][1], w16[1][2], MR_DTYPE_BF16, &e), MR_EINVAL);
  MT_CONTAINS(e.msg, "expert 1 down[5, 7]");
  MT_CONTAINS(e.msg, "weights must be finite");
  w16[1][2][5 * I + 7] = keep;
  MT_FALSE(kn_layer_has_expert(L, 0));
  MT_FALSE(kn_layer_has_expert(L, 1));
  MT_EQ_U64(kn_layer_bytes(L), 0);
  MT_EQ_INT(kn_layer_borrow_expert(L, NE, w16[0][0], w16[0][1], w16[0][2], MR_DTYPE_BF16, &e), MR_ERANGE);
  MT_OK(kn_layer_borrow_expert(L, 1, w16[1][0], w16[1][1], w16[1][2], MR_DTYPE_BF16, &e), &e);
  MT_TRUE(kn_layer_has_expert(L, 1));
  kn_layer_free(L);
  /* Two slices (two NUMA nodes, forced): each slice needs its own block on its node. */
  kn_engine_opts e2 = {.isa = KN_ISA_REF, .threads = 2, .force_split = 2};
  MT_OK(kn_engine_new(&two, &e2, &e), &e);
  MT_OK(kn_layer_new(&L, two, &desc, &e), &e);
  MT_FALSE(kn_layer_can_borrow(L, MR_DTYPE_BF16));
  MT_EQ_INT(kn_layer_borrow_expert(L, 0, w16[0][0], w16[0][1], w16[0][2], MR_DTYPE_BF16, &e), MR_ENOTSUP);
  MT_CONTAINS(e.msg, "on 2 slice(s)");
  kn_layer_free(L);
  kn_engine_free(two);
  kn_engine_free(eng);
}

/* Tensors of expert x as a loader sees them (gate, up, down). */
static void st_of(mr_st_tensor t[3], int x, const void *down) {
  static const char *const nm[3] = {"gate_proj.weight", "up_proj.weight", "down_proj.weight"};
  for (int p = 0; p < 3; p++)
    t[p] = (mr_st_tensor){.name = nm[p], .dtype = MR_DTYPE_BF16, .dtype_name = "BF16", .ndim = 2,
                          .nbytes = (uint64_t)H * I * 2, .data = p == 2 && down ? down : w16[x][p]};
}

MT_TEST(take_serves_in_place_where_it_can_and_packs_the_rest) {
  rng_seed(11);
  fill(MR_DTYPE_BF16);
  kn_engine *eng = NULL;
  mr_err e;
  kn_engine_opts eo = {.isa = KN_ISA_REF, .threads = 2};
  MT_OK(kn_engine_new(&eng, &eo, &e), &e);
  kn_layer_desc desc = {.hidden = H, .inter = I, .num_experts = NE, .format = KN_FMT_BF16};
  kn_layer *L = NULL, *packed = NULL;
  MT_OK(kn_layer_new(&L, eng, &desc, &e), &e);
  MT_OK(kn_layer_new(&packed, eng, &desc, &e), &e);
  mr_st_tensor t[3];
  const mr_st_tensor *tp[3] = {&t[0], &t[1], &t[2]}, *none[3] = {NULL, NULL, NULL};
  bool b = true;
  for (int x = 0; x < NE; x++) {
    st_of(t, x, NULL);
    MT_OK(kn_layer_take_expert_st(packed, (uint32_t)x, tp, NULL, false, &b, &e), &e);
    MT_FALSE(b);
  }
  /* Expert 0 in place; expert 1 not asked: packed. */
  st_of(t, 0, NULL);
  MT_OK(kn_layer_take_expert_st(L, 0, tp, none, true, &b, &e), &e);
  MT_TRUE(b);
  MT_TRUE(kn_layer_expert_slice(L, 0, 0) == NULL);
  st_of(t, 1, NULL);
  MT_OK(kn_layer_take_expert_st(L, 1, tp, NULL, false, &b, &e), &e);
  MT_FALSE(b);
  MT_TRUE(kn_layer_expert_slice(L, 1, 0) != NULL);
  /* Expert 2's down misaligned in its "file": packed, and no error left behind. */
  static uint8_t odd[H * I * 2 + 2];
  memcpy(odd + 1, w16[2][2], (size_t)H * I * 2);
  st_of(t, 2, odd + 1);
  MT_OK(kn_layer_take_expert_st(L, 2, tp, NULL, true, &b, &e), &e);
  MT_FALSE(b);
  MT_EQ_INT(e.code, 0);
  MT_TRUE(kn_layer_expert_slice(L, 2, 0) != NULL);
  /* What kn_layer_borrow_expert_st refuses before it looks at the layer. */
  st_of(t, 3, NULL);
  const mr_st_tensor *scaled[3] = {&t[0], &t[1], &t[2]};
  MT_EQ_INT(kn_layer_borrow_expert_st(L, 3, tp, scaled, &e), MR_ENOTSUP);
  MT_CONTAINS(e.msg, "is fp8: served in place only by an fp8-b128 layer"); /* a bf16 layer */
  t[1].dtype = MR_DTYPE_F16;
  t[1].dtype_name = "F16";
  MT_EQ_INT(kn_layer_borrow_expert_st(L, 3, tp, NULL, &e), MR_ENOTSUP);
  MT_CONTAINS(e.msg, "\"gate_proj.weight\" is BF16 and \"up_proj.weight\" F16");
  MT_EQ_INT(kn_layer_borrow_expert_st(L, 3, NULL, NULL, &e), MR_EINVAL);
  MT_FALSE(kn_layer_has_expert(L, 3));
  st_of(t, 3, NULL);
  MT_OK(kn_layer_borrow_expert_st(L, 3, tp, none, &e), &e);
  /* Same bytes held, same numbers as all packed. */
  MT_EQ_U64(kn_layer_bytes(L), kn_layer_bytes(packed));
  static float ref[T_MAX * H], got[T_MAX * H];
  fwd(eng, packed, T_MAX, ref);
  fwd(eng, L, T_MAX, got);
  MT_TRUE(memcmp(ref, got, sizeof got) == 0);
  kn_layer_free(L);
  kn_layer_free(packed);
  kn_engine_free(eng);
}

/* FP8 codes and block scales of NE experts, quantized from w32 (fill(MR_DTYPE_F32) first). */
#define NB_GU ((I + 127) / 128 * ((H + 127) / 128))
#define NB_DN ((H + 127) / 128 * ((I + 127) / 128))
static uint8_t q8[NE][3][H * I];
static float s8[NE][3][NB_GU > NB_DN ? NB_GU : NB_DN];

static void fill_fp8(void) {
  mr_err e;
  for (int x = 0; x < NE; x++)
    for (int p = 0; p < 3; p++)
      MT_OK(kn_fp8_quantize_b128(w32[x][p], MR_DTYPE_F32, p == 2 ? H : I, p == 2 ? I : H, q8[x][p],
                                 s8[x][p], &e), &e);
}

MT_TEST(fp8_codes_served_in_place_compute_like_packed_ones_on_every_isa) {
  rng_seed(13);
  fill(MR_DTYPE_F32);
  fill_fp8();
  const kn_isa top = kn_isa_detect();
  int runs = 0;
  for (int isa = KN_ISA_REF; isa <= (int)top; isa++) {
    kn_engine *eng = NULL;
    mr_err e;
    kn_engine_opts eo = {.isa = (kn_isa)isa, .threads = 2};
    MT_OK(kn_engine_new(&eng, &eo, &e), &e);
    kn_layer_desc desc = {.hidden = H, .inter = I, .num_experts = NE, .format = KN_FMT_FP8};
    kn_layer *packed = NULL, *inplace = NULL;
    MT_OK(kn_layer_new(&packed, eng, &desc, &e), &e);
    MT_OK(kn_layer_new(&inplace, eng, &desc, &e), &e);
    MT_TRUE(kn_layer_can_borrow_fp8(inplace));
    MT_FALSE(kn_layer_can_borrow(inplace, MR_DTYPE_BF16));
    for (uint32_t x = 0; x < NE; x++) {
      MT_OK(kn_layer_load_expert_fp8(packed, x, q8[x][0], s8[x][0], q8[x][1], s8[x][1], q8[x][2],
                                     s8[x][2], &e), &e);
      MT_OK(kn_layer_borrow_expert_fp8(inplace, x, q8[x][0], s8[x][0], q8[x][1], s8[x][1],
                                       q8[x][2], s8[x][2], &e), &e);
    }
    MT_TRUE(kn_layer_expert_slice(packed, 0, 0) != NULL);
    /* The rebuild and frees: the codes stay ours, the scales are freed. */
    runs += expect_in_place_like_packed(eng, packed, inplace);
    kn_engine_free(eng);
  }
  MT_TRUE(runs >= 2);
}

MT_TEST(fp8_in_place_refusals_and_tensors) {
  rng_seed(17);
  fill(MR_DTYPE_F32);
  fill_fp8();
  kn_engine *eng = NULL, *two = NULL;
  mr_err e;
  kn_engine_opts eo = {.isa = KN_ISA_REF, .threads = 2};
  MT_OK(kn_engine_new(&eng, &eo, &e), &e);
  kn_layer_desc desc = {.hidden = H, .inter = I, .num_experts = NE, .format = KN_FMT_FP8};
  kn_layer *L = NULL, *packed = NULL;
  MT_OK(kn_layer_new(&L, eng, &desc, &e), &e);
  /* A NaN code (0x7f), named; a scale that is not > 0, named; nothing loaded. */
  const uint8_t keep = q8[1][1][3 * H + 9];
  q8[1][1][3 * H + 9] = 0x7f;
  MT_EQ_INT(kn_layer_borrow_expert_fp8(L, 1, q8[1][0], s8[1][0], q8[1][1], s8[1][1], q8[1][2],
                                       s8[1][2], &e), MR_EINVAL);
  MT_CONTAINS(e.msg, "expert 1 up[3, 9]");
  q8[1][1][3 * H + 9] = keep;
  const float ks = s8[1][2][1];
  s8[1][2][1] = 0.0f;
  MT_EQ_INT(kn_layer_borrow_expert_fp8(L, 1, q8[1][0], s8[1][0], q8[1][1], s8[1][1], q8[1][2],
                                       s8[1][2], &e), MR_EINVAL);
  MT_CONTAINS(e.msg, "expert 1 down");
  s8[1][2][1] = ks;
  MT_FALSE(kn_layer_has_expert(L, 1));
  MT_EQ_U64(kn_layer_bytes(L), 0);
  MT_EQ_INT(kn_layer_borrow_expert_fp8(L, NE, q8[0][0], s8[0][0], q8[0][1], s8[0][1], q8[0][2],
                                       s8[0][2], &e), MR_ERANGE);
  /* From tensors as mr_config_expert_tensors_q finds them: F8 codes, F32 / BF16 scales. */
  static uint16_t s16[NB_GU > NB_DN ? NB_GU : NB_DN];
  mr_st_tensor t[3], sc[3];
  const mr_st_tensor *tp[3] = {&t[0], &t[1], &t[2]}, *sp[3] = {&sc[0], &sc[1], &sc[2]};
  MT_OK(kn_layer_new(&packed, eng, &desc, &e), &e);
  for (int x = 0; x < NE; x++) {
    for (int p = 0; p < 3; p++) {
      const uint32_t N = p == 2 ? H : I, K = p == 2 ? I : H, nb = (N + 127) / 128 * ((K + 127) / 128);
      t[p] = (mr_st_tensor){.name = "w", .dtype = MR_DTYPE_UNSPECIFIED, .dtype_name = "F8_E4M3",
                            .ndim = 2, .shape = {N, K}, .nbytes = (uint64_t)N * K, .data = q8[x][p]};
      const bool b16 = x % 2 && p == 0; /* some scales as BF16: exactly representable ones */
      if (b16) {
        for (uint32_t i = 0; i < nb; i++) s8[x][p][i] = mr_bf16_to_f32(mr_f32_to_bf16(s8[x][p][i]));
        mr_convert_from_f32(s16, MR_DTYPE_BF16, s8[x][p], nb);
      }
      sc[p] = (mr_st_tensor){.name = "w_scale_inv", .dtype = b16 ? MR_DTYPE_BF16 : MR_DTYPE_F32,
                             .dtype_name = b16 ? "BF16" : "F32", .ndim = 2,
                             .shape = {(N + 127) / 128, (K + 127) / 128},
                             .nbytes = (uint64_t)nb * (b16 ? 2 : 4),
                             .data = b16 ? (const void *)s16 : (const void *)s8[x][p]};
    }
    bool b = false;
    MT_OK(kn_layer_take_expert_st(L, (uint32_t)x, tp, sp, true, &b, &e), &e);
    MT_TRUE(b);
    MT_OK(kn_layer_take_expert_st(packed, (uint32_t)x, tp, sp, false, &b, &e), &e);
    MT_FALSE(b);
  }
  static float ref[T_MAX * H], got[T_MAX * H];
  fwd(eng, packed, T_MAX, ref);
  fwd(eng, L, T_MAX, got);
  MT_TRUE(memcmp(ref, got, sizeof got) == 0);
  kn_layer_free(L);
  kn_layer_free(packed);
  /* Two slices: packed instead (take), refused by the borrow itself. */
  kn_engine_opts e2 = {.isa = KN_ISA_REF, .threads = 2, .force_split = 2};
  MT_OK(kn_engine_new(&two, &e2, &e), &e);
  MT_OK(kn_layer_new(&L, two, &desc, &e), &e);
  MT_FALSE(kn_layer_can_borrow_fp8(L));
  MT_EQ_INT(kn_layer_borrow_expert_st(L, 0, tp, sp, &e), MR_ENOTSUP);
  MT_CONTAINS(e.msg, "served in place only by an fp8-b128 layer on one slice");
  bool b = true;
  MT_OK(kn_layer_take_expert_st(L, 0, tp, sp, true, &b, &e), &e);
  MT_FALSE(b);
  MT_TRUE(kn_layer_has_expert(L, 0));
  kn_layer_free(L);
  kn_engine_free(two);
  kn_engine_free(eng);
}

MT_MAIN()
