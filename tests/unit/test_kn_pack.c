/*
 * test_kn_pack.c - the loader's row converters (kn__pack_fns, kernels/internal.h section
 * B): the AVX2 set gives the bits of the scalar set (the definition) for every input.
 *
 * check (the same finite test without a copy) returns what copy returns.
 *
 * Inputs are random bit patterns (every exponent, subnormals, values that round to inf
 * in f16, exact rounding ties) plus the cases that matter to the loader: a value that is
 * not finite at the first, a middle and the last position of rows whose lengths are and
 * are not multiples of the vector width; int8 / int4 scales of every size down to
 * subnormal and zero; every INT4 group (32, 64, 128) with a ragged last group.
 *
 * The quantizers also read bf16 / f16 sources as stored: the same bits and the same first
 * bad index as the scalar set from those too. The quantizer checks run twice where the CPU
 * has AVX-512: with the AVX2 set and with the AVX-512 quantizers (x86/pack_avx512.c).
 *
 * Also: kn__pack() picks the AVX2 set on a CPU that has it, and MOERPC_PACK=scalar picks
 * the scalar one; a layer loaded with either packs the same bytes (kn_layer_expert_bytes
 * compared through the public loader in every format).
 */
#include "kernels/internal.h"
#include "tests/unit/kn_test.h"
#include "tests/unit/mt.h"

#include <math.h>
#include <sys/wait.h>
#include <unistd.h>

#if MR_HAVE_AVX2
#define NEED_AVX2()                                                                           \
  do {                                                                                        \
    const kn__cpu *c_ = kn__cpu_get();                                                        \
    if (!(c_->avx2 && c_->fma && c_->f16c && c_->os_avx)) MT_SKIP("no AVX2 on %s", c_->model); \
  } while (0)
#define A (&kn__pack_avx2)
#else
#define NEED_AVX2() MT_SKIP("built without AVX2")
#define A (&kn__pack_scalar)
#endif
#define S (&kn__pack_scalar)

static const uint32_t lens[] = {0, 1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 300, 2048, 2051};
#define N_LENS (sizeof lens / sizeof lens[0])
#define MAXN 2051

static float f32_of(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* A random finite fp32: a random bit pattern, exponent redrawn while all ones. */
static float rand_finite(void) {
  uint32_t u;
  do u = rng_u32(); while ((u & 0x7f800000u) == 0x7f800000u);
  return f32_of(u);
}

/* Random finite values of a realistic spread (normal times 2^[-20, 20]). */
static float rand_weight(void) { return rng_normal() * ldexpf(1.0f, (int)(rng_u32() % 41) - 20); }

/* Runs a check of the quantizers with the AVX2 set, and with the AVX-512 quantizers where
 * this build and CPU have them (the rest of that set is the AVX2 one, checked as A). */
static void for_each_fast_set(void (*check)(const kn__pack_fns *X)) {
  check(A);
  const kn__pack_fns *w = kn__pack_avx512();
  if (w) check(w);
  else fprintf(stderr, "test_kn_pack: no AVX-512 here: its quantizers not checked\n");
}

MT_TEST(to_f32_and_copy_match_the_scalar_set_with_bad_values_anywhere) {
  NEED_AVX2();
  static uint16_t h[MAXN];
  static float f[MAXN], a[MAXN], b[MAXN];
  static uint8_t ca[MAXN * 4 + 1], cb[MAXN * 4 + 1];
  const mr_dtype dts[] = {MR_DTYPE_BF16, MR_DTYPE_F16, MR_DTYPE_F32};
  rng_seed(11);
  for (int round = 0; round < 40; round++)
    for (size_t li = 0; li < N_LENS; li++)
      for (int d = 0; d < 3; d++) {
        const uint32_t n = lens[li];
        const mr_dtype dt = dts[d];
        const uint16_t expo = dt == MR_DTYPE_BF16 ? 0x7f80 : 0x7c00;
        for (uint32_t k = 0; k < n; k++) {
          h[k] = (uint16_t)rng_u32();
          if ((h[k] & expo) == expo) h[k] &= (uint16_t)~0x0400u; /* finite: clear one exponent bit */
          f[k] = round & 1 ? rand_finite() : rand_weight();
        }
        /* Rounds 0-9 clean; then one bad value at the start, the middle or the end. */
        if (round >= 10 && n) {
          uint32_t at = round % 3 == 0 ? 0 : round % 3 == 1 ? n / 2 : n - 1;
          h[at] = (uint16_t)(expo | (round & 2 ? 0x8000u : 0) | (round & 4 ? 1u : 0)); /* inf or NaN */
          f[at] = f32_of(0x7f800000u | (round & 4 ? 1u : 0));
        }
        const void *src = dt == MR_DTYPE_F32 ? (const void *)f : (const void *)h;
        uint32_t ra = A->to_f32(a, src, dt, n), rb = S->to_f32(b, src, dt, n);
        MT_EQ_INT(ra, rb);
        for (uint32_t k = 0; k < n; k++)
          if (isfinite(b[k])) MT_EQ_INT(memcmp(&a[k], &b[k], 4), 0);
        memset(ca, 0xa5, sizeof ca);
        memset(cb, 0x5a, sizeof cb);
        ra = A->copy(ca, src, dt, n);
        rb = S->copy(cb, src, dt, n);
        MT_EQ_INT(ra, rb);
        MT_EQ_INT(memcmp(ca, cb, (size_t)n * mr_dtype_size(dt)), 0);
        MT_EQ_INT(memcmp(ca, src, (size_t)n * mr_dtype_size(dt)), 0);
        MT_EQ_INT(ca[(size_t)n * mr_dtype_size(dt)], 0xa5); /* nothing written past the row */
        /* check (the finite check of weights served in place) finds what copy finds. */
        MT_EQ_INT(A->check(src, dt, n), rb);
        MT_EQ_INT(S->check(src, dt, n), rb);
      }
}

MT_TEST(fp8_copy_and_check_find_the_first_nan_code) {
  NEED_AVX2();
  static uint8_t q[MAXN], a[MAXN + 1], b[MAXN + 1];
  rng_seed(12);
  for (int round = 0; round < 40; round++)
    for (size_t li = 0; li < N_LENS; li++) {
      const uint32_t n = lens[li];
      for (uint32_t k = 0; k < n; k++) {
        q[k] = (uint8_t)rng_u32();
        if ((q[k] & 0x7f) == 0x7f) q[k] ^= 1;
      }
      if (round >= 10 && n) q[round % 3 == 0 ? 0 : round % 3 == 1 ? n / 2 : n - 1] = round & 1 ? 0xff : 0x7f;
      memset(a, 0xa5, sizeof a);
      memset(b, 0xa5, sizeof b);
      const uint32_t first = S->copy_fp8(b, q, n);
      MT_EQ_INT(A->copy_fp8(a, q, n), first);
      MT_EQ_INT(memcmp(a, b, n + 1), 0);
      MT_EQ_INT(memcmp(a, q, n), 0);
      /* The check of codes served in place finds the same one, writing nothing. */
      MT_EQ_INT(A->check_fp8(q, n), first);
      MT_EQ_INT(S->check_fp8(q, n), first);
      MT_TRUE(round < 10 || n == 0 || first < n);
    }
}

/* dequant_fp8 (the loader's FP8 -> fp32): every code, subnormal ones (exponent 0) and both
 * zeros included, times scales of every size (the product rounding in the subnormal range
 * too), bit for bit the scalar set, which is the code table times the scale; the first NaN
 * code found as copy_fp8 finds it, and nothing written past n. */
MT_TEST(fp8_dequant_is_the_table_times_the_scale_bit_for_bit) {
  NEED_AVX2();
  static uint8_t q[MAXN];
  static float a[MAXN + 1], b[MAXN + 1];
  const float *tbl = mr_f8e4m3_table();
  rng_seed(14);
  for (int round = 0; round < 40; round++)
    for (size_t li = 0; li < N_LENS; li++) {
      const uint32_t n = lens[li];
      for (uint32_t k = 0; k < n; k++) {
        /* round 0: the 256 codes in order (NaN codes turned finite), later random */
        q[k] = round == 0 ? (uint8_t)k : (uint8_t)rng_u32();
        if ((q[k] & 0x7f) == 0x7f) q[k] ^= 1;
      }
      if (round >= 10 && n) q[round % 3 == 0 ? 0 : round % 3 == 1 ? n / 2 : n - 1] = round & 1 ? 0xff : 0x7f;
      const float scales[] = {1.0f, rand_finite(), ldexpf(1.0f, -140), ldexpf(1.5f, 100),
                              fabsf(rand_weight()) + 1e-30f, 3.0e-3f};
      for (size_t si = 0; si < sizeof scales / sizeof scales[0]; si++) {
        const float sc = fabsf(scales[si]);
        a[n] = b[n] = 12345.0f;
        const uint32_t first = S->dequant_fp8(b, q, n, sc);
        MT_EQ_INT(A->dequant_fp8(a, q, n, sc), first);
        MT_EQ_INT(first, S->check_fp8(q, n));
        for (uint32_t k = 0; k < n; k++) {
          if ((q[k] & 0x7f) == 0x7f) continue; /* what a NaN code gives is unspecified */
          const float want = tbl[q[k]] * sc;
          MT_EQ_INT(memcmp(&b[k], &want, 4), 0);
          if (memcmp(&a[k], &want, 4) != 0)
            MT__FAIL("n %u code 0x%02x scale %a: avx2 %a, want %a", n, q[k], (double)sc, (double)a[k],
                    (double)want);
        }
        MT_TRUE(a[n] == 12345.0f && b[n] == 12345.0f);
      }
    }
}

static void amax_int8_and_float_outputs_are_bit_identical_with(const kn__pack_fns *X) {
  static float x[MAXN];
  static int8_t qa[MAXN], qb[MAXN];
  static uint16_t ha[MAXN], hb[MAXN];
  rng_seed(13);
  for (int round = 0; round < 60; round++)
    for (size_t li = 0; li < N_LENS; li++) {
      const uint32_t n = lens[li];
      for (uint32_t k = 0; k < n; k++) x[k] = round % 3 ? rand_weight() : rand_finite();
      uint32_t ba, bb;
      const float am = X->amax(x, MR_DTYPE_F32, n, &ba);
      MT_EQ_INT(memcmp(&am, &(float){S->amax(x, MR_DTYPE_F32, n, &bb)}, 4), 0);
      MT_EQ_INT(ba, n);
      MT_EQ_INT(bb, n);
      /* The loader's scale, then scales that put quotients on exact ties, subnormal and 0. */
      float scales[5] = {am / 127.0f, 0.5f, ldexpf(1.0f, -140), 0.0f, am / 127.0f};
      if (round % 5 == 0)
        for (uint32_t k = 0; k < n; k++) x[k] = ((float)(int)(rng_u32() % 255) - 127.0f + 0.5f) * 0.5f;
      for (int s = 0; s < 5; s++) {
        memset(qa, 0x55, sizeof qa);
        memset(qb, 0x55, sizeof qb);
        X->quant_int8(x, MR_DTYPE_F32, n, scales[s], qa);
        S->quant_int8(x, MR_DTYPE_F32, n, scales[s], qb);
        MT_EQ_INT(memcmp(qa, qb, sizeof qa), 0);
      }
      for (uint32_t k = 0; k < n; k++)
        if (round & 1) x[k] = rand_finite(); /* f16 overflow to inf and subnormals included */
      const mr_dtype dts[] = {MR_DTYPE_BF16, MR_DTYPE_F16};
      for (int d = 0; d < 2; d++) {
        memset(ha, 0x55, sizeof ha);
        memset(hb, 0x55, sizeof hb);
        A->from_f32(ha, dts[d], x, n);
        S->from_f32(hb, dts[d], x, n);
        MT_EQ_INT(memcmp(ha, hb, sizeof ha), 0);
      }
    }
}

MT_TEST(amax_int8_and_float_outputs_are_bit_identical) {
  NEED_AVX2();
  for_each_fast_set(amax_int8_and_float_outputs_are_bit_identical_with);
}

static void int4_groups_and_ragged_rows_are_bit_identical_with(const kn__pack_fns *X) {
  static float x[MAXN];
  static uint8_t qa[MAXN], qb[MAXN];
  static float sa[MAXN], sb[MAXN];
  const uint32_t groups[] = {32, 64, 128};
  rng_seed(14);
  for (int round = 0; round < 40; round++)
    for (int gi = 0; gi < 3; gi++)
      for (size_t li = 1; li < N_LENS; li++) {
        const uint32_t G = groups[gi], K = lens[li], ng = kn__ngroups(K, G);
        for (uint32_t k = 0; k < K; k++) x[k] = round % 4 ? rand_weight() : rand_finite();
        if (round % 7 == 0 && K > G)
          for (uint32_t k = 0; k < G; k++) x[k] = 0.0f; /* a zero group: scale 0 */
        memset(qa, 0x55, sizeof qa);
        memset(qb, 0x55, sizeof qb);
        MT_EQ_INT(X->quant_int4(x, MR_DTYPE_F32, K, G, qa, sa), K);
        MT_EQ_INT(S->quant_int4(x, MR_DTYPE_F32, K, G, qb, sb), K);
        MT_EQ_INT(memcmp(qa, qb, sizeof qa), 0);
        MT_EQ_INT(memcmp(sa, sb, ng * sizeof(float)), 0);
      }
}

MT_TEST(int4_groups_and_ragged_rows_are_bit_identical) {
  NEED_AVX2();
  for_each_fast_set(int4_groups_and_ragged_rows_are_bit_identical_with);
}

/* The quantizers read bf16 and f16 sources as stored (no fp32 row in between): amax (on
 * the source's bits), INT8 and INT4 give the scalar set's bits, and the same first bad
 * index for a NaN or an inf (either sign) at the start, the middle or the end of the row
 * or of a group; negative zeros, subnormals and rows whose amax is subnormal included. */
static void quantizers_from_16_bit_sources_match_the_scalar_set_with(const kn__pack_fns *X) {
  static uint16_t h[MAXN];
  static int8_t qa[MAXN], qb[MAXN];
  static uint8_t pa[MAXN], pb[MAXN];
  static float sa[MAXN], sb[MAXN];
  const mr_dtype dts[] = {MR_DTYPE_BF16, MR_DTYPE_F16};
  const uint32_t groups[] = {32, 64, 128};
  rng_seed(16);
  uint32_t bad_seen = 0;
  for (int round = 0; round < 60; round++)
    for (int d = 0; d < 2; d++)
      for (size_t li = 0; li < N_LENS; li++) {
        const mr_dtype dt = dts[d];
        const uint32_t n = lens[li], G = groups[round % 3];
        const uint16_t expo = dt == MR_DTYPE_BF16 ? 0x7f80 : 0x7c00;
        for (uint32_t k = 0; k < n; k++) {
          float v = round % 4 == 3 ? rng_normal() * 0x1p-134f : rand_weight(); /* subnormal rows */
          h[k] = dt == MR_DTYPE_BF16 ? mr_f32_to_bf16(v) : mr_f32_to_f16(v * 0x1p-10f);
          if (round % 5 == 1) h[k] = (uint16_t)rng_u32(); /* every pattern */
          if ((h[k] & expo) == expo) h[k] &= (uint16_t)~0x0400u;
          if (rng_u32() % 16 == 0) h[k] = 0x8000; /* -0 */
        }
        if (round >= 20 && n) {
          const uint32_t at = round % 3 == 0 ? 0 : round % 3 == 1 ? n / 2 : n - 1;
          h[at] = (uint16_t)(expo | (round & 2 ? 0x8000u : 0) | (round & 4 ? 1u : 0));
        }
        uint32_t ba, bb;
        const float ama = X->amax(h, dt, n, &ba), amb = S->amax(h, dt, n, &bb);
        MT_EQ_INT(ba, bb);
        MT_EQ_INT(memcmp(&ama, &amb, 4), 0);
        bad_seen += bb < n;
        if (bb == n) {
          const float sc = amb / 127.0f;
          memset(qa, 0x55, sizeof qa);
          memset(qb, 0x55, sizeof qb);
          X->quant_int8(h, dt, n, sc, qa);
          S->quant_int8(h, dt, n, sc, qb);
          MT_EQ_INT(memcmp(qa, qb, sizeof qa), 0);
        }
        if (!n) continue;
        memset(pa, 0x55, sizeof pa);
        memset(pb, 0x55, sizeof pb);
        memset(sa, 0x55, sizeof sa);
        memset(sb, 0x55, sizeof sb);
        const uint32_t ra = X->quant_int4(h, dt, n, G, pa, sa), rb = S->quant_int4(h, dt, n, G, pb, sb);
        MT_EQ_INT(ra, rb);
        MT_EQ_INT(rb, bb); /* the row's first bad value, found group by group */
        if (rb == n) {
          MT_EQ_INT(memcmp(pa, pb, (size_t)kn__ngroups(n, G) * G / 2), 0);
          MT_EQ_INT(memcmp(sa, sb, kn__ngroups(n, G) * sizeof(float)), 0);
        }
      }
  MT_TRUE(bad_seen > 100);
}

MT_TEST(quantizers_from_16_bit_sources_match_the_scalar_set) {
  NEED_AVX2();
  for_each_fast_set(quantizers_from_16_bit_sources_match_the_scalar_set_with);
}

/* Values within a few ulps of (j + 1/2) * scale for scales that are not powers of two:
 * quotients next to a rounding tie, where any shortcut to the division (a multiply by
 * 1 / scale: tried, and slower here than vdivps) would round some the other way; for int8
 * (the caller's scale) and int4 (the group's own scale, its amax placed first). */
static float near_tie(float scale, int lim) {
  float x = ((float)(int)(rng_u32() % (2u * (uint32_t)lim)) - (float)lim + 0.5f) * scale;
  for (int step = (int)(rng_u32() % 7) - 3; step != 0; step += step > 0 ? -1 : 1)
    x = nextafterf(x, step > 0 ? INFINITY : -INFINITY);
  return x;
}

static void near_ties_of_the_quotient_are_bit_identical_with(const kn__pack_fns *X) {
  static float x[MAXN];
  static int8_t qa[MAXN], qb[MAXN];
  static uint8_t pa[MAXN], pb[MAXN];
  static float sa[MAXN], sb[MAXN];
  rng_seed(15);
  uint64_t near = 0;
  for (int round = 0; round < 200; round++) {
    const float sc = fabsf(rand_weight()) + 0x1p-30f;
    const uint32_t n = 2048, G = 32u << (round % 3);
    for (uint32_t k = 0; k < n; k++) x[k] = rng_u32() % 4 ? near_tie(sc, 127) : rand_weight();
    memset(qa, 0x55, sizeof qa);
    memset(qb, 0x55, sizeof qb);
    X->quant_int8(x, MR_DTYPE_F32, n, sc, qa);
    S->quant_int8(x, MR_DTYPE_F32, n, sc, qb);
    MT_EQ_INT(memcmp(qa, qb, sizeof qa), 0);
    for (uint32_t k = 0; k < n; k++) {
      const float q = x[k] / sc, f = q + 0.5f - floorf(q + 0.5f);
      near += f < 0x1p-12f || f > 1.0f - 0x1p-12f;
    }
    for (uint32_t g = 0; g < n / G; g++) {
      const float gs = fabsf(rand_weight()) + 0x1p-30f, amax = gs * 7.0f, s7 = amax / 7.0f;
      x[g * G] = rng_u32() % 2 ? amax : -amax;
      for (uint32_t k = 1; k < G; k++) x[g * G + k] = near_tie(s7, 7);
    }
    memset(pa, 0x55, sizeof pa);
    memset(pb, 0x55, sizeof pb);
    X->quant_int4(x, MR_DTYPE_F32, n, G, pa, sa);
    S->quant_int4(x, MR_DTYPE_F32, n, G, pb, sb);
    MT_EQ_INT(memcmp(pa, pb, sizeof pa), 0);
    MT_EQ_INT(memcmp(sa, sb, (n / G) * sizeof(float)), 0);
  }
  MT_TRUE(near > 1000); /* the inputs do come within 2^-12 of a tie */
}

MT_TEST(near_ties_of_the_quotient_are_bit_identical) {
  NEED_AVX2();
  for_each_fast_set(near_ties_of_the_quotient_are_bit_identical_with);
}

/* The set kn__pack() picks by itself on this CPU: AVX2 with the AVX-512 quantizers where
 * the CPU has AVX-512, else AVX2. */
static const char *best_set(void) { return kn__pack_avx512() ? "avx512" : "avx2"; }

/* The set kn__pack() picks, in a fresh process (pthread_once: the env is read once). */
static void expect_pick(const char *env, const char *want) {
  if (env) setenv("MOERPC_PACK", env, 1);
  else unsetenv("MOERPC_PACK");
  MT_EQ_STR(kn__pack()->name, want);
}

MT_TEST(the_best_set_is_picked_where_the_cpu_has_it) {
  NEED_AVX2();
  expect_pick(NULL, best_set());
}

MT_TEST(moerpc_pack_scalar_picks_the_scalar_set) { expect_pick("scalar", "scalar"); }

MT_TEST(moerpc_pack_avx2_keeps_the_avx2_quantizers) {
  NEED_AVX2();
  expect_pick("avx2", "avx2");
  MT_TRUE(kn__pack()->quant_int4 == kn__pack_avx2.quant_int4);
}

/* A whole expert packed through the public loader in every format, on one slice and on
 * three: the same bytes with the set kn__pack() picks as with the scalar one, from bf16,
 * f16 and f32 sources (copied where the format stores the source's dtype, converted or
 * quantized straight from the source elsewhere). */
static void pack_all(const char *env, uint8_t **out, size_t *len) {
  if (env) setenv("MOERPC_PACK", env, 1);
  mr_err e = {0};
  const uint32_t H = 96, I = 160;
  const kn_format fmts[] = {KN_FMT_F32, KN_FMT_F16, KN_FMT_BF16, KN_FMT_INT8, KN_FMT_INT4};
  const mr_dtype srcs[] = {MR_DTYPE_F32, MR_DTYPE_F16, MR_DTYPE_BF16};
  static float w[3][160 * 96];
  static uint16_t h[3][160 * 96];
  size_t total = 0;
  *out = NULL;
  /* One slice, and three (forced): an INT8 down band takes the whole HF row's scale. */
  for (uint32_t split = 1; split <= 3; split += 2) {
    kn_engine *eng = NULL;
    kn_engine_opts eo = {.isa = KN_ISA_REF, .threads = 2, .force_split = split};
    MT_OK(kn_engine_new(&eng, &eo, &e), &e);
    for (int fi = 0; fi < 5; fi++)
      for (int si = 0; si < 3; si++) {
        rng_seed(100 + (uint64_t)fi * 3 + (uint64_t)si);
        for (int p = 0; p < 3; p++)
          for (uint32_t k = 0; k < H * I; k++) {
            w[p][k] = rand_weight();
            h[p][k] = srcs[si] == MR_DTYPE_BF16 ? mr_f32_to_bf16(w[p][k]) : mr_f32_to_f16(w[p][k] * 1e-3f);
            if (srcs[si] == MR_DTYPE_F16 && !isfinite(mr_f16_to_f32(h[p][k]))) h[p][k] = 0;
          }
        kn_layer_desc d = {.hidden = H, .inter = I, .num_experts = 1, .format = fmts[fi],
                           .group = fmts[fi] == KN_FMT_INT4 ? 32 : 0};
        kn_layer *L = NULL;
        MT_OK(kn_layer_new(&L, eng, &d, &e), &e);
        const void *g = srcs[si] == MR_DTYPE_F32 ? (const void *)w[0] : h[0];
        const void *u = srcs[si] == MR_DTYPE_F32 ? (const void *)w[1] : h[1];
        const void *dn = srcs[si] == MR_DTYPE_F32 ? (const void *)w[2] : h[2];
        MT_OK(kn_layer_load_expert(L, 0, g, u, dn, srcs[si], &e), &e);
        for (uint32_t s = 0; s < L->n_slices; s++) {
          /* The six arrays, not the block: its alignment padding is not written. */
          const kn__slice_w *ws = &L->w[0][s];
          const kn_format f = fmts[fi];
          const uint32_t Is = L->slice_len[s], G = L->d.group;
          const size_t gu = Is * kn__row_bytes(f, H, G), dnb = H * kn__row_bytes(f, Is, G);
          const size_t gus = Is * kn__row_scales(f, H, G) * 4, dns = H * kn__row_scales(f, Is, G) * 4;
          const void *part[6] = {ws->gate, ws->up, ws->down, ws->gate_scale, ws->up_scale, ws->down_scale};
          const size_t plen[6] = {gu, gu, dnb, gus, gus, dns};
          for (int q = 0; q < 6; q++) {
            if (!plen[q]) continue;
            *out = realloc(*out, total + plen[q]);
            MT_TRUE(*out != NULL);
            memcpy(*out + total, part[q], plen[q]);
            total += plen[q];
          }
        }
        MT_EQ_INT(L->n_slices, split);
        kn_layer_free(L);
      }
    kn_engine_free(eng);
  }
  *len = total;
}

MT_TEST(a_layer_packs_the_same_bytes_with_either_set) {
  NEED_AVX2();
  /* Two children (kn__pack() picks once per process), each writing its bytes to a file of
   * its own: a child that fails exits non-zero and blocks nobody. */
  char path[2][64];
  pid_t pid[2];
  for (int c = 0; c < 2; c++) {
    snprintf(path[c], sizeof path[c], "/tmp/test_kn_pack.%d.%d", (int)getpid(), c);
    pid[c] = fork();
    MT_TRUE(pid[c] >= 0);
    if (pid[c] == 0) {
      uint8_t *b;
      size_t n;
      pack_all(c ? "scalar" : NULL, &b, &n);
      if (strcmp(kn__pack()->name, c ? "scalar" : best_set()) != 0) _exit(2);
      FILE *f = fopen(path[c], "w");
      if (!f || fwrite(&n, sizeof n, 1, f) != 1 || fwrite(b, 1, n, f) != n || fclose(f) != 0) _exit(3);
      _exit(0);
    }
  }
  uint8_t *buf[2] = {NULL, NULL};
  size_t n[2] = {0, 0};
  for (int c = 0; c < 2; c++) {
    int st;
    MT_EQ_INT(waitpid(pid[c], &st, 0), pid[c]);
    MT_TRUE(WIFEXITED(st));
    MT_EQ_INT(WEXITSTATUS(st), 0);
    FILE *f = fopen(path[c], "r");
    MT_TRUE(f != NULL);
    MT_EQ_INT(fread(&n[c], sizeof n[c], 1, f), 1);
    buf[c] = malloc(n[c]);
    MT_EQ_U64(fread(buf[c], 1, n[c], f), n[c]);
    fclose(f);
    unlink(path[c]);
  }
  MT_EQ_U64(n[0], n[1]);
  MT_TRUE(n[0] > 0);
  MT_EQ_INT(memcmp(buf[0], buf[1], n[0]), 0);
  free(buf[0]);
  free(buf[1]);
}

MT_MAIN()
