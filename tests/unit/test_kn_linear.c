/*
 * test_kn_linear.c - dense linear layers (kn_linear_*) and the parallel-for kn_engine_run.
 *
 * Every format (f32, f16, bf16, int8, int4 g32/g64/g128) on every ISA this build and CPU
 * run (REF, AVX2, AVX-512; an ISA that is missing is printed as SKIP with the reason, and
 * AMX has no kernels), over shapes with odd n_out / n_in (not multiples of 32 or 64) and
 * T = 1, 3, 17, 300 (and 1100 on the smallest shape: several token tiles), is compared
 *   - with kn_ref_linear_forward on the same stored weights, under the tolerance of the
 *     kernel's activation handling (the names and reasons are those of test_kn_fast.c);
 *   - with an fp64 textbook matmul over the dequantized weights, computed here from the
 *     source weights by the rules of internal.h section A (and checked bitwise against the
 *     layout decoder kn__row_to_f32), under the same tolerance; the reference itself
 *     must match it to TOL_REF_F64.
 *
 * Named tolerances (relative L2 over the whole [T, n_out] output):
 *   TOL_FP32   = 1e-5  fp32 math on fp32 activations (AVX2 every format, AVX-512 f32/f16):
 *                      only the summation order differs (8/16 partial sums and a tree).
 *   TOL_BF16X  = 1e-2  AVX-512 bf16 x bf16 (vdpbf16ps): x rounded to bf16, relative error
 *                      <= 2^-9 per element, ~1.5e-3 per matrix product.
 *   TOL_Q8X    = 3e-2  AVX-512 VNNI int8/int4 x int8: x quantized per token, amax / 127;
 *                      ~1% of rms for Gaussian x.
 *   TOL_REF_F64 = 1e-5 the reference (fp32 running sums, K <= 1000 here) against fp64.
 *
 * Also: the REF kernel on the engine is bitwise the reference; results do not depend on
 * the thread count; loading in row bands equals one load (packed bytes and outputs);
 * n_out > 65536; a NaN in one token stays in its row; bad arguments are refused with the
 * field named and y untouched; out of memory anywhere is MR_ENOMEM with nothing leaked;
 * kn_engine_run hands out every item exactly once.
 */
#define _GNU_SOURCE /* sched_getaffinity, CPU_* */
#include "kernels/internal.h"
#include "tests/unit/kn_test.h"
#include "tests/unit/mt.h"

#include <pthread.h>
#include <sched.h>

#define TOL_REF_F64 1e-5

/* ---- helpers (deterministic inputs) ------------------------------------------------ */

static float *randn(size_t n, float scale, uint64_t seed) {
  float *v = malloc(n * sizeof(float));
  MT_TRUE(v != NULL);
  rng_seed(seed);
  for (size_t i = 0; i < n; i++) v[i] = scale * rng_normal();
  return v;
}

/* The ISAs to test: every one this build and CPU can run (REF always). Prints a SKIP line
 * for each that is not, with the reason, so that a missing ISA never passes silently. */
static int test_isas(kn_isa *out) {
  int n = 0;
  kn_isa best = kn_isa_detect();
  out[n++] = KN_ISA_REF;
#if MR_HAVE_AVX2
  if (best >= KN_ISA_AVX2)
    out[n++] = KN_ISA_AVX2;
  else
    printf("  SKIP isa avx2: not on this CPU (best %s)\n", kn_isa_name(best));
#else
  printf("  SKIP isa avx2: not in this build (HAVE_AVX2=0)\n");
#endif
#if MR_HAVE_AVX512
  if (best >= KN_ISA_AVX512)
    out[n++] = KN_ISA_AVX512;
  else
    printf("  SKIP isa avx512: not on this CPU (best %s)\n", kn_isa_name(best));
#else
  printf("  SKIP isa avx512: not in this build (HAVE_AVX512=0)\n");
#endif
#if MR_HAVE_AMX
  if (best >= KN_ISA_AMX)
    out[n++] = KN_ISA_AMX;
  else
    printf("  SKIP isa amx: not on this CPU (best %s)\n", kn_isa_name(best));
#else
  printf("  SKIP isa amx: not in this build (HAVE_AMX=0)\n");
#endif
  (void)best;
  return n;
}

/* The ISA format f must run on in an engine forced to isa (AVX-512 without VNNI leaves
 * int8/int4 on AVX2), and the tolerance of the kernel the engine picked. */
static kn_isa expected_isa(kn_isa isa, kn_format f) {
  /* AMX: bf16, int8, int4 and fp8 on the tiles (dispatched: AVX-512 below the crossover),
   * f32 / f16 on AVX-512 */
  if (isa == KN_ISA_AMX) return f == KN_FMT_F32 || f == KN_FMT_F16 ? KN_ISA_AVX512 : KN_ISA_AMX;
  if (isa == KN_ISA_AVX512 && (f == KN_FMT_INT8 || f == KN_FMT_INT4) && !kn__cpu_get()->avx512_vnni)
    return KN_ISA_AVX2;
  /* fp8: the AVX-512 kernel needs AVX512-BF16; without it the AVX2 one */
  if (f == KN_FMT_FP8 && isa >= KN_ISA_AVX2 && !(isa >= KN_ISA_AVX512 && kn__cpu_get()->avx512_bf16))
    return KN_ISA_AVX2;
  return isa;
}
/* The tolerance of the kernel the engine picked, from its activation rounding (fp8 x
 * bf16 activations: the bf16 rounding of x and h; its weights are the reference's own,
 * exact conversion), whatever its name: an AMX or a future kernel gets its format's. */
static double tolerance(const kn_engine *eng, kn_format f) { return kn__rounding_tol(eng->kern[f]->rounding); }

static kn_engine *engine_make(kn_isa isa, uint32_t threads) {
  kn_engine *eng = NULL;
  mr_err e = {0};
  unsetenv("MOERPC_ISA");
  kn_engine_opts o = {.isa = isa, .threads = threads};
  MT_OK(kn_engine_new(&eng, &o, &e), ep(&e));
  return eng;
}

static kn_linear *linear_make(kn_engine *eng, uint32_t N, uint32_t K, kn_format f, uint32_t G,
                              const float *w) {
  kn_linear *lin = NULL;
  mr_err e = {0};
  MT_OK(kn_linear_new(&lin, eng, N, K, f, G, &e), ep(&e));
  MT_OK(kn_linear_load_rows(lin, 0, N, w, MR_DTYPE_F32, &e), ep(&e));
  MT_EQ_INT(kn_linear_rows_loaded(lin), N);
  return lin;
}

/* The weights as stored, dequantized, computed from w [N, K] by the rules of internal.h
 * section A, independently of the packer: rounding for f16/bf16; int8 per row
 * (amax / 127) and int4 per group of G (amax / 7), round to nearest even. */
static float *dequant(const float *w, uint32_t N, uint32_t K, kn_format f, uint32_t G) {
  float *d = malloc((size_t)N * K * sizeof(float));
  MT_TRUE(d != NULL);
  if (f == KN_FMT_FP8) { /* 128 x 128 blocks from row 0: scale amax / 448 (1 if 0), e4m3(w / s) * s */
    for (uint32_t r0 = 0; r0 < N; r0 += 128)
      for (uint32_t k0 = 0; k0 < K; k0 += 128) {
        const uint32_t r1 = r0 + 128 < N ? r0 + 128 : N, k1 = k0 + 128 < K ? k0 + 128 : K;
        float amax = 0.0f;
        for (uint32_t r = r0; r < r1; r++)
          for (uint32_t k = k0; k < k1; k++) amax = fabsf(w[(size_t)r * K + k]) > amax ? fabsf(w[(size_t)r * K + k]) : amax;
        const float s = amax > 0.0f ? amax / 448.0f : 1.0f;
        for (uint32_t r = r0; r < r1; r++)
          for (uint32_t k = k0; k < k1; k++)
            d[(size_t)r * K + k] = kn_fp8_e4m3_to_f32(kn_fp8_e4m3_from_f32(w[(size_t)r * K + k] / s)) * s;
      }
    return d;
  }
  for (uint32_t j = 0; j < N; j++) {
    const float *r = w + (size_t)j * K;
    float *o = d + (size_t)j * K;
    switch (f) {
      case KN_FMT_F32: memcpy(o, r, K * sizeof(float)); break;
      case KN_FMT_F16:
        for (uint32_t k = 0; k < K; k++) o[k] = mr_f16_to_f32(mr_f32_to_f16(r[k]));
        break;
      case KN_FMT_BF16:
        for (uint32_t k = 0; k < K; k++) o[k] = mr_bf16_to_f32(mr_f32_to_bf16(r[k]));
        break;
      case KN_FMT_INT8:
      case KN_FMT_INT4: {
        const uint32_t span = f == KN_FMT_INT8 ? K : G;
        const float qmax = f == KN_FMT_INT8 ? 127.0f : 7.0f;
        for (uint32_t k0 = 0; k0 < K; k0 += span) {
          const uint32_t k1 = k0 + span < K ? k0 + span : K;
          float amax = 0.0f;
          for (uint32_t k = k0; k < k1; k++) amax = fabsf(r[k]) > amax ? fabsf(r[k]) : amax;
          const float s = amax / qmax;
          for (uint32_t k = k0; k < k1; k++) {
            float q = s > 0.0f ? nearbyintf(r[k] / s) : 0.0f;
            q = q > qmax ? qmax : q < -qmax ? -qmax : q;
            o[k] = q * s;
          }
        }
        break;
      }
      default: MT_TRUE(!"bad format");
    }
  }
  return d;
}

/* The stored weights, through the one decoder of the layout, equal dequant() (as values:
 * the decoder gives +0 where dequant's q * s may give -0). */
static void check_stored(const kn_linear *lin, const float *wd) {
  const uint32_t N = kn_linear_n_out(lin), K = kn_linear_n_in(lin);
  float *row = malloc(K * sizeof(float));
  uint32_t bad = 0;
  for (uint32_t j = 0; j < N; j++) {
    kn__row_to_f32(&lin->L, 0, &lin->w, KN__DOWN, j, row);
    for (uint32_t k = 0; k < K; k++)
      if (row[k] != wd[(size_t)j * K + k] && bad++ < 5)
        printf("  stored W[%u, %u] = %.9g, expected %.9g\n", j, k, (double)row[k], (double)wd[(size_t)j * K + k]);
  }
  MT_EQ_INT(bad, 0);
  free(row);
}

/* y = x wd^T in double. */
static void matmul_f64(const float *wd, uint32_t N, uint32_t K, uint32_t T, const float *x, float *y) {
  for (uint32_t t = 0; t < T; t++)
    for (uint32_t j = 0; j < N; j++) {
      double s = 0.0;
      for (uint32_t k = 0; k < K; k++) s += (double)wd[(size_t)j * K + k] * x[(size_t)t * K + k];
      y[(size_t)t * N + j] = (float)s;
    }
}

static float *nan_buf(size_t n) {
  float *y = malloc(n * sizeof(float));
  MT_TRUE(y != NULL);
  for (size_t i = 0; i < n; i++) y[i] = NAN;
  return y;
}

/* ---- every format x ISA x shape x T, against the reference and fp64 ------------------ */

static const uint32_t shapes[5][2] = {{67, 45}, {200, 136}, {130, 1000}, {256, 192}, {5, 3}};

static void check_format(kn_format f, uint32_t G) {
  kn_isa isas[KN_ISA_COUNT];
  const int n_isa = test_isas(isas);
  kn_engine *eng[KN_ISA_COUNT];
  for (int i = 0; i < n_isa; i++) {
    eng[i] = engine_make(isas[i], 0);
    MT_EQ_INT(kn_engine_isa(eng[i], f), expected_isa(isas[i], f));
  }
  const uint32_t Ts[5] = {1, 3, 17, 300, 1100};
  double worst[KN_ISA_COUNT] = {0}, worst_ref = 0.0;
  int cases = 0;
  for (int sh = 0; sh < 5; sh++) {
    const uint32_t N = shapes[sh][0], K = shapes[sh][1];
    float *w = randn((size_t)N * K, 0.05f, 100 + sh);
    float *wd = dequant(w, N, K, f, G);
    kn_linear *lin = linear_make(eng[0], N, K, f, G, w);
    MT_EQ_INT(kn_linear_format(lin), f);
    MT_EQ_INT(kn_linear_group(lin), f == KN_FMT_INT4 ? G : f == KN_FMT_FP8 ? 128 : 0);
    MT_EQ_U64(kn_linear_bytes(lin), (uint64_t)N * (kn__row_bytes(f, K, G) + 4 * kn__row_scales(f, K, G)));
    check_stored(lin, wd);
    for (int ti = 0; ti < 5; ti++) {
      const uint32_t T = Ts[ti];
      if (T == 1100 && sh != 0) continue;
      const size_t TN = (size_t)T * N;
      float *x = randn((size_t)T * K, 1.0f, 7 * T + sh);
      float *y64 = malloc(TN * sizeof(float)), *ref = nan_buf(TN), *y = malloc(TN * sizeof(float));
      matmul_f64(wd, N, K, T, x, y64);
      mr_err e = {0};
      MT_OK(kn_ref_linear_forward(lin, T, x, ref, &e), ep(&e));
      const double err_ref = kn_rel_l2(ref, y64, TN);
      if (err_ref > worst_ref) worst_ref = err_ref;
      MT_LE(err_ref, TOL_REF_F64);
      for (int i = 0; i < n_isa; i++) {
        for (size_t q = 0; q < TN; q++) y[q] = NAN; /* must all be overwritten */
        MT_OK(kn_linear_forward(eng[i], lin, T, x, y, NULL, &e), ep(&e));
        for (size_t q = 0; q < TN; q++) MT_TRUE(isfinite(y[q]));
        const double tol = tolerance(eng[i], f);
        const double e_ref = kn_rel_l2(y, ref, TN), e_64 = kn_rel_l2(y, y64, TN);
        if (e_ref > tol || e_64 > tol)
          printf("  %s %ux%u T=%u: rel L2 %.3g vs ref, %.3g vs fp64 (tol %.0e)\n", eng[i]->kern[f]->name,
                 N, K, T, e_ref, e_64, tol);
        MT_LE(e_ref, tol);
        MT_LE(e_64, tol);
        if (e_ref > worst[i]) worst[i] = e_ref;
        if (isas[i] == KN_ISA_REF) MT_EQ_INT(memcmp(y, ref, TN * sizeof(float)), 0);
        cases++;
      }
      free(x);
      free(y64);
      free(ref);
      free(y);
    }
    kn_linear_free(lin);
    free(w);
    free(wd);
  }
  for (int i = 0; i < n_isa; i++) {
    printf("  %-18s %s g%u: worst rel L2 vs ref %.3g (tol %.0e)\n", eng[i]->kern[f]->name,
           kn_format_name(f), G, worst[i], tolerance(eng[i], f));
    kn_engine_free(eng[i]);
  }
  printf("  reference vs fp64: worst %.3g (tol %.0e); %d fast cases\n", worst_ref, TOL_REF_F64, cases);
}

MT_TEST(linear_matches_ref_and_f64_f32) { check_format(KN_FMT_F32, 0); }
MT_TEST(linear_matches_ref_and_f64_f16) { check_format(KN_FMT_F16, 0); }
MT_TEST(linear_matches_ref_and_f64_bf16) { check_format(KN_FMT_BF16, 0); }
MT_TEST(linear_matches_ref_and_f64_int8) { check_format(KN_FMT_INT8, 0); }
MT_TEST(linear_matches_ref_and_f64_int4_g32) { check_format(KN_FMT_INT4, 32); }
MT_TEST(linear_matches_ref_and_f64_int4_g64) { check_format(KN_FMT_INT4, 64); }
MT_TEST(linear_matches_ref_and_f64_int4_g128) { check_format(KN_FMT_INT4, 128); }
MT_TEST(linear_matches_ref_and_f64_fp8) { check_format(KN_FMT_FP8, 0); }

/* ---- n_out above the MoE limit (an lm_head-like matrix) ----------------------------- */

MT_TEST(linear_n_out_above_65536) {
  const uint32_t N = 70000, K = 64;
  MT_TRUE(N > KN_MAX_DIM);
  const kn_format fmts[7] = {KN_FMT_F32, KN_FMT_F16, KN_FMT_BF16, KN_FMT_INT8, KN_FMT_INT4, KN_FMT_INT4, KN_FMT_INT4};
  const uint32_t groups[7] = {0, 0, 0, 0, 32, 64, 128};
  kn_isa isas[KN_ISA_COUNT];
  const int n_isa = test_isas(isas);
  float *w = randn((size_t)N * K, 0.05f, 900);
  const uint32_t T = 3;
  float *x = randn((size_t)T * K, 1.0f, 901);
  const size_t TN = (size_t)T * N;
  float *y64 = malloc(TN * 4), *ref = malloc(TN * 4), *y = malloc(TN * 4);
  for (int i = 0; i < n_isa; i++) {
    kn_engine *eng = engine_make(isas[i], 0);
    for (int fi = 0; fi < 7; fi++) {
      kn_linear *lin = linear_make(eng, N, K, fmts[fi], groups[fi], w);
      float *wd = dequant(w, N, K, fmts[fi], groups[fi]);
      matmul_f64(wd, N, K, T, x, y64);
      mr_err e = {0};
      MT_OK(kn_ref_linear_forward(lin, T, x, ref, &e), ep(&e));
      MT_LE(kn_rel_l2(ref, y64, TN), TOL_REF_F64);
      for (uint32_t t = 1; t <= T; t += 2) { /* T = 1 (decode tiles) and 3 */
        for (size_t q = 0; q < TN; q++) y[q] = NAN;
        MT_OK(kn_linear_forward(eng, lin, t, x, y, NULL, &e), ep(&e));
        const double tol = tolerance(eng, fmts[fi]);
        const double er = kn_rel_l2(y, ref, (size_t)t * N), e64 = kn_rel_l2(y, y64, (size_t)t * N);
        printf("  %-18s g%-3u %ux%u T=%u: rel L2 %.3g vs ref, %.3g vs fp64\n", eng->kern[fmts[fi]]->name,
               groups[fi], N, K, t, er, e64);
        MT_LE(er, tol);
        MT_LE(e64, tol);
        for (size_t q = (size_t)t * N; q < TN; q++) MT_TRUE(isnan(y[q])); /* rows of T only */
      }
      free(wd);
      kn_linear_free(lin);
    }
    kn_engine_free(eng);
  }
  free(w);
  free(x);
  free(y64);
  free(ref);
  free(y);
}

/* ---- threads, bands, special inputs ------------------------------------------------ */

/* The split of rows over workers does not change a bit of y (each row's result depends
 * only on its weights and the token tile, which depends on T alone). */
MT_TEST(linear_result_independent_of_thread_count) {
  kn_isa isas[KN_ISA_COUNT];
  const int n_isa = test_isas(isas);
  const uint32_t N = 333, K = 200, T = 37;
  float *w = randn((size_t)N * K, 0.05f, 40), *x = randn((size_t)T * K, 1.0f, 41);
  float *y1 = malloc((size_t)T * N * 4), *y3 = malloc((size_t)T * N * 4);
  const kn_format fmts[5] = {KN_FMT_F32, KN_FMT_F16, KN_FMT_BF16, KN_FMT_INT8, KN_FMT_INT4};
  for (int i = 0; i < n_isa; i++) {
    kn_engine *e1 = engine_make(isas[i], 1), *e3 = engine_make(isas[i], 3);
    MT_EQ_INT(kn_engine_threads(e3), 3);
    for (int fi = 0; fi < 5; fi++) {
      kn_linear *lin = linear_make(e3, N, K, fmts[fi], 64, w);
      mr_err e = {0};
      mr_arena ar;
      mr_arena_init(&ar, 1u << 16);
      for (uint32_t t = 1; t <= T; t += 12) {
        MT_OK(kn_linear_forward(e1, lin, t, x, y1, NULL, &e), ep(&e));
        MT_OK(kn_linear_forward(e3, lin, t, x, y3, &ar, &e), ep(&e)); /* caller's arena */
        mr_arena_reset(&ar);
        MT_EQ_INT(memcmp(y1, y3, (size_t)t * N * 4), 0);
      }
      mr_arena_close(&ar);
      kn_linear_free(lin);
    }
    kn_engine_free(e1);
    kn_engine_free(e3);
  }
  free(w);
  free(x);
  free(y1);
  free(y3);
}

/* Loading in row bands (odd sizes, out of order, from separate tensors as q/k/v would be)
 * gives the same packed bytes and outputs as one load; so does a bf16 source in bands. */
MT_TEST(linear_bands_equal_one_load) {
  const uint32_t N = 200, K = 136, T = 5;
  const uint32_t cut[4] = {0, 37, 101, 200};
  const int order[3] = {2, 0, 1};
  float *w = randn((size_t)N * K, 0.05f, 50), *x = randn((size_t)T * K, 1.0f, 51);
  uint16_t *wb = malloc((size_t)N * K * 2);
  mr_convert_from_f32(wb, MR_DTYPE_BF16, w, (size_t)N * K);
  float *y1 = malloc((size_t)T * N * 4), *y2 = malloc((size_t)T * N * 4);
  const kn_format fmts[7] = {KN_FMT_F32, KN_FMT_F16, KN_FMT_BF16, KN_FMT_INT8, KN_FMT_INT4, KN_FMT_INT4, KN_FMT_INT4};
  const uint32_t groups[7] = {0, 0, 0, 0, 32, 64, 128};
  kn_engine *eng = engine_make(KN_ISA_COUNT, 0);
  for (int fi = 0; fi < 7; fi++) {
    for (int srci = 0; srci < 2; srci++) {
      const mr_dtype dt = srci ? MR_DTYPE_BF16 : MR_DTYPE_F32;
      const size_t esz = srci ? 2 : 4;
      const char *src = srci ? (const char *)wb : (const char *)w;
      kn_linear *one = NULL, *band = NULL;
      mr_err e = {0};
      MT_OK(kn_linear_new(&one, eng, N, K, fmts[fi], groups[fi], &e), ep(&e));
      MT_OK(kn_linear_new(&band, eng, N, K, fmts[fi], groups[fi], &e), ep(&e));
      MT_OK(kn_linear_load_rows(one, 0, N, src, dt, &e), ep(&e));
      for (int b = 0; b < 3; b++) {
        const int q = order[b];
        /* each band its own copy, as separate checkpoint tensors are */
        const size_t n = (size_t)(cut[q + 1] - cut[q]) * K * esz;
        char *part = malloc(n);
        memcpy(part, src + (size_t)cut[q] * K * esz, n);
        MT_OK(kn_linear_load_rows(band, cut[q], cut[q + 1] - cut[q], part, dt, &e), ep(&e));
        free(part);
        if (b < 2) MT_TRUE(kn_linear_rows_loaded(band) < N);
      }
      MT_EQ_INT(kn_linear_rows_loaded(band), N);
      /* loading a band again changes nothing */
      MT_OK(kn_linear_load_rows(band, cut[1], cut[2] - cut[1], src + (size_t)cut[1] * K * esz, dt, &e), ep(&e));
      MT_EQ_INT(kn_linear_rows_loaded(band), N);
      const size_t wbytes = (size_t)N * kn__row_bytes(fmts[fi], K, groups[fi]);
      MT_EQ_INT(memcmp(one->w.down, band->w.down, wbytes), 0);
      if (one->w.down_scale)
        MT_EQ_INT(memcmp(one->w.down_scale, band->w.down_scale,
                         (size_t)N * kn__row_scales(fmts[fi], K, groups[fi]) * 4), 0);
      MT_OK(kn_linear_forward(eng, one, T, x, y1, NULL, &e), ep(&e));
      MT_OK(kn_linear_forward(eng, band, T, x, y2, NULL, &e), ep(&e));
      MT_EQ_INT(memcmp(y1, y2, (size_t)T * N * 4), 0);
      kn_linear_free(one);
      kn_linear_free(band);
    }
  }
  kn_engine_free(eng);
  free(w);
  free(wb);
  free(x);
  free(y1);
  free(y2);
}

/* ---- served in place (kn_linear_borrow) --------------------------------------------- */

/* Band b of W (rows cut[b] .. cut[b + 1] - 1) in dtype dt, in its own allocation of exactly
 * its size (separate checkpoint tensors; a read past a band's end is an ASan error). */
static void **bands_of(const float *w, uint32_t K, const uint32_t *cut, uint32_t nb, mr_dtype dt) {
  void **p = calloc(nb, sizeof *p);
  MT_TRUE(p != NULL);
  for (uint32_t b = 0; b < nb; b++) {
    const size_t n = (size_t)(cut[b + 1] - cut[b]) * K;
    p[b] = malloc(n * mr_dtype_size(dt));
    MT_TRUE(p[b] != NULL);
    mr_convert_from_f32(p[b], dt, w + (size_t)cut[b] * K, n);
  }
  return p;
}

/* Every float format on every ISA, one to four bands (one of a single row), odd shapes,
 * T from 1 to a few token tiles: a linear served in place gives the bits of the same
 * weights packed, through the engine and through the reference, on 2 and 3 threads. */
MT_TEST(linear_in_place_is_bitwise_packed) {
  kn_isa isas[KN_ISA_COUNT];
  const int n_isa = test_isas(isas);
  const mr_dtype dts[3] = {MR_DTYPE_F32, MR_DTYPE_F16, MR_DTYPE_BF16};
  const kn_format fmts[3] = {KN_FMT_F32, KN_FMT_F16, KN_FMT_BF16};
  const struct { uint32_t N, K, nb, cut[KN_LINEAR_MAX_BANDS + 1]; } shp[4] = {
      {37, 29, 1, {0, 37}},
      {300, 515, 3, {0, 192, 257, 300}},         /* q | k | v-like, edges off the row units */
      {130, 2048, 4, {0, 64, 65, 129, 130}},     /* a band of one row, a last row alone */
      {1029, 96, 2, {0, 1000, 1029}}};
  const uint32_t Ts[4] = {1, 3, 17, 300};
  for (int ii = 0; ii < n_isa; ii++) {
    for (uint32_t th = 2; th <= 3; th++) {
      kn_engine *eng = engine_make(isas[ii], th);
      for (int fi = 0; fi < 3; fi++) {
        for (int si = 0; si < 4; si++) {
          const uint32_t N = shp[si].N, K = shp[si].K, nb = shp[si].nb;
          const uint32_t *cut = shp[si].cut;
          float *w = randn((size_t)N * K, 0.05f, 70 + si), *x = randn((size_t)300 * K, 1.0f, 80 + si);
          void **band = bands_of(w, K, cut, nb, dts[fi]);
          uint32_t rows[KN_LINEAR_MAX_BANDS];
          for (uint32_t b = 0; b < nb; b++) rows[b] = cut[b + 1] - cut[b];
          kn_linear *packed = NULL, *mapped = NULL;
          mr_err e = {0};
          MT_OK(kn_linear_new(&packed, eng, N, K, fmts[fi], 0, &e), ep(&e));
          for (uint32_t b = 0; b < nb; b++)
            MT_OK(kn_linear_load_rows(packed, cut[b], rows[b], band[b], dts[fi], &e), ep(&e));
          MT_OK(kn_linear_borrow(&mapped, eng, nb, (const void *const *)band, rows, K, dts[fi], &e), ep(&e));
          MT_TRUE(kn_linear_in_place(mapped));
          MT_FALSE(kn_linear_in_place(packed));
          MT_EQ_INT(kn_linear_n_out(mapped), N);
          MT_EQ_INT(kn_linear_n_in(mapped), K);
          MT_EQ_INT(kn_linear_format(mapped), fmts[fi]);
          MT_EQ_INT(kn_linear_rows_loaded(mapped), N);
          MT_EQ_U64(kn_linear_bytes(mapped), kn_linear_bytes(packed));
          float *y1 = malloc((size_t)300 * N * 4), *y2 = malloc((size_t)300 * N * 4);
          for (int ti = 0; ti < 4; ti++) {
            const uint32_t T = Ts[ti];
            memset(y2, 0xff, (size_t)T * N * 4);
            MT_OK(kn_linear_forward(eng, packed, T, x, y1, NULL, &e), ep(&e));
            MT_OK(kn_linear_forward(eng, mapped, T, x, y2, NULL, &e), ep(&e));
            if (memcmp(y1, y2, (size_t)T * N * 4))
              printf("  FAIL isa %s threads %u %s %ux%u in %u bands, T = %u\n", kn_isa_name(isas[ii]), th,
                     kn_format_name(fmts[fi]), N, K, nb, T);
            MT_EQ_INT(memcmp(y1, y2, (size_t)T * N * 4), 0);
          }
          if (ii == 0 && th == 2) { /* the reference: once per format and shape */
            MT_OK(kn_ref_linear_forward(packed, 17, x, y1, &e), ep(&e));
            MT_OK(kn_ref_linear_forward(mapped, 17, x, y2, &e), ep(&e));
            MT_EQ_INT(memcmp(y1, y2, (size_t)17 * N * 4), 0);
          }
          /* read-only: a load is refused and leaves it as it was */
          MT_EQ_INT(kn_linear_load_rows(mapped, 0, 1, band[0], dts[fi], &e), MR_EPRECOND);
          MT_CONTAINS(e.msg, "served in place");
          MT_EQ_INT(kn_linear_rows_loaded(mapped), N);
          kn_linear_free(packed);
          kn_linear_free(mapped); /* the bands are the caller's: freed below, once */
          for (uint32_t b = 0; b < nb; b++) free(band[b]);
          free(band);
          free(w);
          free(x);
          free(y1);
          free(y2);
        }
      }
      kn_engine_free(eng);
    }
  }
}

/* What cannot be served in place is refused, with the field and the limit named, and
 * nothing is made: non-finite weights (named by row, column and part), another dtype, a
 * misaligned part, bad counts. An engine that pretends to have two NUMA nodes (forced:
 * it places nothing) still serves in place. */
MT_TEST(linear_in_place_refusals) {
  const uint32_t N = 96, K = 40;
  const uint32_t cut[4] = {0, 64, 80, 96}, rows[3] = {64, 16, 16};
  float *w = randn((size_t)N * K, 0.05f, 90), *x = randn((size_t)3 * K, 1.0f, 91);
  void **band = bands_of(w, K, cut, 3, MR_DTYPE_BF16);
  kn_engine *eng = engine_make(KN_ISA_COUNT, 2);
  kn_linear *lin = (kn_linear *)&lin; /* not NULL: every failure must clear it */
  mr_err e = {0};
  uint16_t *b2 = band[2];
  const uint16_t keep = b2[5 * K + 7];
  b2[5 * K + 7] = 0x7fc0; /* NaN */
  MT_EQ_INT(kn_linear_borrow(&lin, eng, 3, (const void *const *)band, rows, K, MR_DTYPE_BF16, &e), MR_EINVAL);
  MT_TRUE(lin == NULL);
  MT_CONTAINS(e.msg, "W[row 85, column 7]");
  MT_CONTAINS(e.msg, "part 2, its row 5 of 16");
  MT_CONTAINS(e.msg, "must be finite");
  b2[5 * K + 7] = 0xff80; /* -inf */
  MT_EQ_INT(kn_linear_borrow(&lin, eng, 3, (const void *const *)band, rows, K, MR_DTYPE_BF16, &e), MR_EINVAL);
  MT_CONTAINS(e.msg, "= -inf");
  b2[5 * K + 7] = keep;
  /* a bad value in the last column of the last row of the first band */
  uint16_t *b0 = band[0];
  const uint16_t keep0 = b0[64 * K - 1];
  b0[64 * K - 1] = 0x7f80;
  MT_EQ_INT(kn_linear_borrow(&lin, eng, 3, (const void *const *)band, rows, K, MR_DTYPE_BF16, &e), MR_EINVAL);
  MT_CONTAINS(e.msg, "W[row 63, column 39]");
  b0[64 * K - 1] = keep0;

  MT_EQ_INT(kn_linear_borrow(&lin, eng, 3, (const void *const *)band, rows, K, MR_DTYPE_UNSPECIFIED, &e),
            MR_ENOTSUP);
  MT_CONTAINS(e.msg, "only f32, f16 and bf16");
  const void *odd[1] = {(const char *)band[0] + 1};
  const uint32_t one[1] = {1};
  MT_EQ_INT(kn_linear_borrow(&lin, eng, 1, odd, one, K - 1, MR_DTYPE_BF16, &e), MR_ENOTSUP);
  MT_CONTAINS(e.msg, "not 2-byte aligned");
  MT_EQ_INT(kn_linear_borrow(&lin, eng, 0, (const void *const *)band, rows, K, MR_DTYPE_BF16, &e), MR_EINVAL);
  MT_CONTAINS(e.msg, "n_parts = 0, must be in 1..4");
  MT_EQ_INT(kn_linear_borrow(&lin, eng, 5, (const void *const *)band, rows, K, MR_DTYPE_BF16, &e), MR_EINVAL);
  const uint32_t zero[3] = {64, 0, 16};
  MT_EQ_INT(kn_linear_borrow(&lin, eng, 3, (const void *const *)band, zero, K, MR_DTYPE_BF16, &e), MR_EINVAL);
  MT_CONTAINS(e.msg, "part 1: rows = 0");
  MT_EQ_INT(kn_linear_borrow(&lin, eng, 3, (const void *const *)band, rows, 0, MR_DTYPE_BF16, &e), MR_EINVAL);
  MT_CONTAINS(e.msg, "n_in = 0");
  MT_EQ_INT(kn_linear_borrow(&lin, eng, 3, (const void *const *)band, rows, KN_LINEAR_MAX_IN + 1,
                             MR_DTYPE_BF16, &e), MR_EINVAL);
  const void *nul[1] = {NULL};
  MT_EQ_INT(kn_linear_borrow(&lin, eng, 1, nul, one, K, MR_DTYPE_BF16, &e), MR_EINVAL);
  MT_EQ_INT(kn_linear_borrow(&lin, NULL, 3, (const void *const *)band, rows, K, MR_DTYPE_BF16, &e), MR_EINVAL);
  MT_FALSE(kn_linear_in_place(NULL));

  /* a forced two-node engine places nothing: served in place, as packed */
  kn_engine *two = NULL;
  kn_engine_opts o2 = {.isa = KN_ISA_COUNT, .threads = 2, .force_split = 2};
  MT_OK(kn_engine_new(&two, &o2, &e), ep(&e));
  kn_linear *packed = NULL;
  float y1[3 * 96], y2[3 * 96];
  MT_OK(kn_linear_new(&packed, two, N, K, KN_FMT_BF16, 0, &e), ep(&e));
  for (int b = 0; b < 3; b++) MT_OK(kn_linear_load_rows(packed, cut[b], rows[b], band[b], MR_DTYPE_BF16, &e), ep(&e));
  MT_OK(kn_linear_borrow(&lin, two, 3, (const void *const *)band, rows, K, MR_DTYPE_BF16, &e), ep(&e));
  MT_OK(kn_linear_forward(two, packed, 3, x, y1, NULL, &e), ep(&e));
  MT_OK(kn_linear_forward(two, lin, 3, x, y2, NULL, &e), ep(&e));
  MT_EQ_INT(memcmp(y1, y2, sizeof y1), 0);
  kn_linear_free(lin);
  kn_linear_free(packed);
  kn_engine_free(two);
  kn_engine_free(eng);
  for (int b = 0; b < 3; b++) free(band[b]);
  free(band);
  free(w);
  free(x);
}

/* A NaN in one token's x makes that token's row non-finite and leaves the others as the
 * reference computes them (per-token activation scales must not leak); zero x gives 0. */
MT_TEST(linear_nan_token_stays_in_its_row) {
  kn_isa isas[KN_ISA_COUNT];
  const int n_isa = test_isas(isas);
  const uint32_t N = 96, K = 80, T = 6;
  float *w = randn((size_t)N * K, 0.05f, 60), *x = randn((size_t)T * K, 1.0f, 61);
  x[2 * K + 5] = NAN;
  float *ref = malloc((size_t)T * N * 4), *y = malloc((size_t)T * N * 4);
  const kn_format fmts[5] = {KN_FMT_F32, KN_FMT_F16, KN_FMT_BF16, KN_FMT_INT8, KN_FMT_INT4};
  for (int i = 0; i < n_isa; i++) {
    kn_engine *eng = engine_make(isas[i], 0);
    for (int fi = 0; fi < 5; fi++) {
      kn_linear *lin = linear_make(eng, N, K, fmts[fi], 32, w);
      mr_err e = {0};
      MT_OK(kn_ref_linear_forward(lin, T, x, ref, &e), ep(&e));
      MT_OK(kn_linear_forward(eng, lin, T, x, y, NULL, &e), ep(&e));
      for (uint32_t t = 0; t < T; t++) {
        if (t == 2) {
          for (uint32_t j = 0; j < N; j++) MT_FALSE(isfinite(y[2 * N + j]));
          continue;
        }
        MT_LE(kn_rel_l2(y + (size_t)t * N, ref + (size_t)t * N, N), tolerance(eng, fmts[fi]));
      }
      float *z = calloc((size_t)T * K, 4);
      MT_OK(kn_linear_forward(eng, lin, T, z, y, NULL, &e), ep(&e));
      for (size_t q = 0; q < (size_t)T * N; q++) MT_TRUE(y[q] == 0.0f);
      free(z);
      kn_linear_free(lin);
    }
    kn_engine_free(eng);
  }
  free(w);
  free(x);
  free(ref);
  free(y);
}

/* ---- bad arguments ----------------------------------------------------------------- */

#define EXPECT_ERR(call, code, text)          \
  do {                                        \
    mr_err e_ = {0};                          \
    mr_err *e = &e_;                          \
    MT_EQ_INT((call), (code));                \
    MT_CONTAINS(e_.msg, (text));              \
    printf("  refused: %s\n", e_.msg);        \
  } while (0)

MT_TEST(linear_bad_arguments) {
  kn_engine *eng = engine_make(KN_ISA_COUNT, 2);
  kn_linear *lin = NULL;
  /* kn_linear_new */
  EXPECT_ERR(kn_linear_new(&lin, NULL, 8, 8, KN_FMT_BF16, 0, e), MR_EINVAL, "engine");
  EXPECT_ERR(kn_linear_new(&lin, eng, 0, 8, KN_FMT_BF16, 0, e), MR_EINVAL, "n_out = 0, must be in 1..262144");
  EXPECT_ERR(kn_linear_new(&lin, eng, 262145, 8, KN_FMT_BF16, 0, e), MR_EINVAL, "n_out = 262145");
  EXPECT_ERR(kn_linear_new(&lin, eng, 8, 0, KN_FMT_BF16, 0, e), MR_EINVAL, "n_in = 0, must be in 1..65536");
  EXPECT_ERR(kn_linear_new(&lin, eng, 8, 65537, KN_FMT_BF16, 0, e), MR_EINVAL, "n_in = 65537");
  EXPECT_ERR(kn_linear_new(&lin, eng, 8, 8, (kn_format)99, 0, e), MR_EINVAL, "format = 99");
  EXPECT_ERR(kn_linear_new(&lin, eng, 8, 8, KN_FMT_INT4, 16, e), MR_EINVAL, "group = 16");
  MT_TRUE(lin == NULL);
  mr_err err = {0};
  /* the limits themselves are accepted */
  MT_OK(kn_linear_new(&lin, eng, KN_LINEAR_MAX_OUT, 1, KN_FMT_INT8, 0, &err), ep(&err));
  kn_linear_free(lin);
  MT_OK(kn_linear_new(&lin, eng, 1, KN_LINEAR_MAX_IN, KN_FMT_INT4, 128, &err), ep(&err));
  kn_linear_free(lin);
  kn_linear_free(NULL);

  const uint32_t N = 10, K = 7;
  MT_OK(kn_linear_new(&lin, eng, N, K, KN_FMT_F32, 0, &err), ep(&err));
  float *w = randn((size_t)N * K, 0.05f, 70), x[3 * 7] = {0}, y[3 * 10];
  for (int i = 0; i < 30; i++) y[i] = 42.0f;
  /* kn_linear_load_rows */
  EXPECT_ERR(kn_linear_load_rows(NULL, 0, 1, w, MR_DTYPE_F32, e), MR_EINVAL, "lin is required");
  EXPECT_ERR(kn_linear_load_rows(lin, 8, 3, w, MR_DTYPE_F32, e), MR_ERANGE, "n_out = 10");
  EXPECT_ERR(kn_linear_load_rows(lin, 11, 0, w, MR_DTYPE_F32, e), MR_ERANGE, "row0 = 11");
  EXPECT_ERR(kn_linear_load_rows(lin, UINT32_MAX, 2, w, MR_DTYPE_F32, e), MR_ERANGE, "n_out = 10");
  EXPECT_ERR(kn_linear_load_rows(lin, 0, 1, NULL, MR_DTYPE_F32, e), MR_EINVAL, "w is required");
  EXPECT_ERR(kn_linear_load_rows(lin, 0, 1, w, (mr_dtype)9, e), MR_EINVAL, "src dtype = 9");
  MT_OK(kn_linear_load_rows(lin, 10, 0, NULL, MR_DTYPE_F32, &err), ep(&err)); /* empty band */
  MT_EQ_INT(kn_linear_rows_loaded(lin), 0);
  /* kn_linear_forward before every row is loaded */
  EXPECT_ERR(kn_linear_forward(eng, lin, 3, x, y, NULL, e), MR_EPRECOND, "row 0 of W [10 x 7] is not loaded");
  MT_OK(kn_linear_load_rows(lin, 0, 4, w, MR_DTYPE_F32, &err), ep(&err));
  MT_OK(kn_linear_load_rows(lin, 6, 4, w + 6 * K, MR_DTYPE_F32, &err), ep(&err));
  EXPECT_ERR(kn_linear_forward(eng, lin, 3, x, y, NULL, e), MR_EPRECOND, "row 4 of W");
  EXPECT_ERR(kn_ref_linear_forward(lin, 3, x, y, e), MR_EPRECOND, "(8 of 10 rows are)");
  /* a non-finite weight: refused naming row and column; the band is then not loaded */
  w[5 * K + 3] = INFINITY;
  EXPECT_ERR(kn_linear_load_rows(lin, 2, 6, w + 2 * K, MR_DTYPE_F32, e), MR_EINVAL, "W[row 5, column 3] = inf");
  MT_EQ_INT(kn_linear_rows_loaded(lin), 4); /* rows 0-1 and 8-9 */
  w[5 * K + 3] = 0.0f;
  MT_OK(kn_linear_load_rows(lin, 0, N, w, MR_DTYPE_F32, &err), ep(&err));
  MT_EQ_INT(kn_linear_rows_loaded(lin), N);
  /* kn_linear_forward / kn_ref_linear_forward */
  EXPECT_ERR(kn_linear_forward(NULL, lin, 3, x, y, NULL, e), MR_EINVAL, "engine is required");
  EXPECT_ERR(kn_linear_forward(eng, NULL, 3, x, y, NULL, e), MR_EINVAL, "lin is required");
  EXPECT_ERR(kn_linear_forward(eng, lin, 3, NULL, y, NULL, e), MR_EINVAL, "x and y are required");
  EXPECT_ERR(kn_linear_forward(eng, lin, 3, x, NULL, NULL, e), MR_EINVAL, "x and y are required");
  EXPECT_ERR(kn_linear_forward(eng, lin, 65537, x, y, NULL, e), MR_ERANGE, "T = 65537, must be in 0..65536");
  EXPECT_ERR(kn_ref_linear_forward(NULL, 3, x, y, e), MR_EINVAL, "lin is required");
  EXPECT_ERR(kn_ref_linear_forward(lin, 65537, x, y, e), MR_ERANGE, "T = 65537");
  for (int i = 0; i < 30; i++) MT_TRUE(y[i] == 42.0f); /* untouched by every refusal */
  MT_OK(kn_linear_forward(eng, lin, 0, NULL, NULL, NULL, &err), ep(&err)); /* T = 0: no-op */
  MT_OK(kn_ref_linear_forward(lin, 0, NULL, NULL, &err), ep(&err));
  MT_OK(kn_linear_forward(eng, lin, 3, x, y, NULL, &err), ep(&err));
  for (int i = 0; i < 30; i++) MT_TRUE(y[i] == 0.0f); /* x = 0 */
  kn_linear_free(lin);
  free(w);
  kn_engine_free(eng);
}

/* ---- FP8 codes (kn_linear_load_rows_fp8, kn_linear_borrow_fp8) --------------------- */

/* An FP8 checkpoint tensor: N x K codes and its block scales, quantized from seed's w. */
typedef struct fp8_tensor {
  uint32_t N, K;
  uint8_t *q;
  float *s; /* [ceil(N / 128), ceil(K / 128)] */
} fp8_tensor;

static fp8_tensor fp8_tensor_make(uint32_t N, uint32_t K, uint64_t seed) {
  fp8_tensor t = {.N = N, .K = K};
  float *w = randn((size_t)N * K, 0.05f, seed);
  t.q = malloc((size_t)N * K);
  t.s = malloc((size_t)((N + 127) / 128) * ((K + 127) / 128) * sizeof(float));
  MT_TRUE(t.q && t.s);
  mr_err e = {0};
  MT_OK(kn_fp8_quantize_b128(w, MR_DTYPE_F32, N, K, t.q, t.s, &e), ep(&e));
  free(w);
  return t;
}

/* Rows [r0, r0 + n) of t dequantized by the checkpoint's rule, into d (row-major, K wide). */
static void fp8_rows(const fp8_tensor *t, uint32_t r0, uint32_t n, float *d) {
  const uint32_t C = (t->K + 127) / 128;
  for (uint32_t i = 0; i < n; i++)
    for (uint32_t k = 0; k < t->K; k++)
      d[(size_t)i * t->K + k] =
          kn_fp8_e4m3_to_f32(t->q[(size_t)(r0 + i) * t->K + k]) * t->s[(size_t)((r0 + i) / 128) * C + k / 128];
}

/* A linear of row ranges of FP8 tensors (as q_a_proj | kv_a_proj_with_mqa, and a tensor
 * parallel rank's rows, whose first row is off the 128-row blocks), packed from the codes
 * in bands and served in place, on every ISA, 2 and 3 threads, T = 1 .. 300:
 *   - the stored weights are the checkpoint's dequantization, bit for bit;
 *   - the reference matches fp64 over them, the fast kernels the reference within their
 *     tolerance;
 *   - in place gives the packed linear's bits (engine and reference);
 *   - f32 rows loaded into an fp8 linear pack as kn_fp8_quantize_b128 + load_rows_fp8. */
MT_TEST(linear_fp8_codes_packed_and_in_place) {
  kn_isa isas[KN_ISA_COUNT];
  const int n_isa = test_isas(isas);
  const uint32_t K = 515; /* 5 column blocks, the last of 3 columns */
  fp8_tensor A = fp8_tensor_make(192, K, 300), B = fp8_tensor_make(300, K, 301), C1 = fp8_tensor_make(1, K, 302);
  /* shapes: parts (tensor, first row, rows) */
  const struct { uint32_t nb; const fp8_tensor *t[3]; uint32_t first[3], rows[3]; } shp[3] = {
      {1, {&B}, {0}, {300}},
      {2, {&A, &B}, {0, 37}, {192, 108}},       /* B's rows 37 .. 144: blocks 0 and 1 */
      {3, {&B, &C1, &A}, {129, 0, 5}, {171, 1, 100}}};
  const uint32_t Ts[4] = {1, 3, 17, 300};
  for (int si = 0; si < 3; si++) {
    const uint32_t nb = shp[si].nb;
    uint32_t N = 0;
    for (uint32_t b = 0; b < nb; b++) N += shp[si].rows[b];
    float *wd = malloc((size_t)N * K * sizeof(float)), *x = randn((size_t)300 * K, 1.0f, 310 + si);
    const uint8_t *q[3];
    const float *sc[3];
    for (uint32_t b = 0, at = 0; b < nb; at += shp[si].rows[b], b++) {
      fp8_rows(shp[si].t[b], shp[si].first[b], shp[si].rows[b], wd + (size_t)at * K);
      q[b] = shp[si].t[b]->q + (size_t)shp[si].first[b] * K;
      sc[b] = shp[si].t[b]->s;
    }
    const size_t TN = (size_t)300 * N;
    float *y64 = malloc(TN * 4), *ref = malloc(TN * 4), *ref2 = malloc(TN * 4), *y1 = malloc(TN * 4),
          *y2 = malloc(TN * 4);
    matmul_f64(wd, N, K, 300, x, y64);
    for (int ii = 0; ii < n_isa; ii++) {
      for (uint32_t th = 2; th <= 3; th++) {
        kn_engine *eng = engine_make(isas[ii], th);
        MT_EQ_INT(kn_engine_isa(eng, KN_FMT_FP8), expected_isa(isas[ii], KN_FMT_FP8));
        kn_linear *packed = NULL, *mapped = NULL;
        mr_err e = {0};
        MT_OK(kn_linear_new(&packed, eng, N, K, KN_FMT_FP8, 0, &e), ep(&e));
        for (uint32_t b = nb, at = N; b-- > 0;) { /* bands out of order */
          at -= shp[si].rows[b];
          MT_OK(kn_linear_load_rows_fp8(packed, at, shp[si].rows[b], q[b], sc[b], shp[si].first[b], &e), ep(&e));
        }
        MT_EQ_INT(kn_linear_rows_loaded(packed), N);
        MT_OK(kn_linear_borrow_fp8(&mapped, eng, nb, q, shp[si].rows, K, sc, shp[si].first, &e), ep(&e));
        MT_TRUE(kn_linear_in_place(mapped));
        MT_EQ_INT(kn_linear_format(mapped), KN_FMT_FP8);
        MT_EQ_INT(kn_linear_group(mapped), 128);
        MT_EQ_INT(kn_linear_rows_loaded(mapped), N);
        MT_EQ_U64(kn_linear_bytes(packed), (uint64_t)N * (K + 4 * 5));
        MT_EQ_U64(kn_linear_bytes(mapped), kn_linear_bytes(packed));
        if (ii == 0 && th == 2) {
          check_stored(packed, wd);
          MT_OK(kn_ref_linear_forward(packed, 300, x, ref, &e), ep(&e));
          MT_OK(kn_ref_linear_forward(mapped, 300, x, ref2, &e), ep(&e));
          MT_EQ_INT(memcmp(ref, ref2, TN * 4), 0);
          MT_LE(kn_rel_l2(ref, y64, TN), TOL_REF_F64);
        }
        for (int ti = 0; ti < 4; ti++) {
          const uint32_t T = Ts[ti];
          const size_t n = (size_t)T * N;
          memset(y2, 0xff, n * 4);
          MT_OK(kn_linear_forward(eng, packed, T, x, y1, NULL, &e), ep(&e));
          MT_OK(kn_linear_forward(eng, mapped, T, x, y2, NULL, &e), ep(&e));
          MT_EQ_INT(memcmp(y1, y2, n * 4), 0);
          const double tol = tolerance(eng, KN_FMT_FP8), er = kn_rel_l2(y1, ref, n);
          if (er > tol)
            printf("  %s %ux%u in %u bands T=%u: rel L2 %.3g vs ref (tol %.0e)\n", eng->kern[KN_FMT_FP8]->name, N,
                   K, nb, T, er, tol);
          MT_LE(er, tol);
          if (isas[ii] == KN_ISA_REF) MT_EQ_INT(memcmp(y1, ref, n * 4), 0);
        }
        /* in place is read-only */
        MT_EQ_INT(kn_linear_load_rows_fp8(mapped, 0, 1, q[0], sc[0], 0, &e), MR_EPRECOND);
        MT_CONTAINS(e.msg, "served in place");
        kn_linear_free(packed);
        kn_linear_free(mapped);
        kn_engine_free(eng);
      }
    }
    free(wd);
    free(x);
    free(y64);
    free(ref);
    free(ref2);
    free(y1);
    free(y2);
  }
  /* f32 rows into an fp8 linear: quantized in blocks from the band's first row */
  kn_engine *eng = engine_make(KN_ISA_COUNT, 2);
  float *w = randn((size_t)300 * K, 0.05f, 320);
  uint8_t *qw = malloc((size_t)300 * K);
  float *sw = malloc((size_t)3 * 5 * sizeof(float));
  mr_err e = {0};
  kn_linear *viaf = NULL, *viaq = NULL;
  MT_OK(kn_linear_new(&viaf, eng, 300, K, KN_FMT_FP8, 0, &e), ep(&e));
  MT_OK(kn_linear_new(&viaq, eng, 300, K, KN_FMT_FP8, 0, &e), ep(&e));
  MT_OK(kn_linear_load_rows(viaf, 0, 100, w, MR_DTYPE_F32, &e), ep(&e));
  MT_OK(kn_linear_load_rows(viaf, 100, 200, w + (size_t)100 * K, MR_DTYPE_F32, &e), ep(&e));
  MT_OK(kn_fp8_quantize_b128(w, MR_DTYPE_F32, 100, K, qw, sw, &e), ep(&e));
  MT_OK(kn_linear_load_rows_fp8(viaq, 0, 100, qw, sw, 0, &e), ep(&e));
  MT_OK(kn_fp8_quantize_b128(w + (size_t)100 * K, MR_DTYPE_F32, 200, K, qw, sw, &e), ep(&e));
  MT_OK(kn_linear_load_rows_fp8(viaq, 100, 200, qw, sw, 0, &e), ep(&e));
  MT_EQ_INT(memcmp(viaf->w.down, viaq->w.down, (size_t)300 * K), 0);
  MT_EQ_INT(memcmp(viaf->w.down_scale, viaq->w.down_scale, (size_t)300 * 5 * 4), 0);
  kn_linear_free(viaf);
  kn_linear_free(viaq);
  kn_engine_free(eng);
  free(w);
  free(qw);
  free(sw);
  free(A.q), free(A.s), free(B.q), free(B.s), free(C1.q), free(C1.s);
}

/* What an fp8 load or an fp8 linear in place refuses, naming the field and the limit:
 * a NaN code (row, column, part), a block scale that is not finite and > 0 (its block;
 * only the blocks of the rows loaded count), another format, NULL and out-of-range
 * arguments. A refused load leaves its band not loaded; nothing is made by a refused
 * borrow; out of memory is MR_ENOMEM with nothing leaked. */
MT_TEST(linear_fp8_refusals) {
  const uint32_t K = 200;
  fp8_tensor t = fp8_tensor_make(260, K, 330); /* 3 x 2 blocks */
  kn_engine *eng = engine_make(KN_ISA_COUNT, 2);
  kn_linear *lin = NULL;
  mr_err err = {0};
  MT_OK(kn_linear_new(&lin, eng, 260, K, KN_FMT_FP8, 0, &err), ep(&err));
  /* a NaN code, either sign: the band is then not loaded */
  MT_OK(kn_linear_load_rows_fp8(lin, 0, 260, t.q, t.s, 0, &err), ep(&err));
  const uint8_t keep = t.q[(size_t)140 * K + 199];
  t.q[(size_t)140 * K + 199] = 0x7f;
  EXPECT_ERR(kn_linear_load_rows_fp8(lin, 100, 160, t.q + (size_t)100 * K, t.s, 100, e), MR_EINVAL,
             "W[row 140, column 199] is a NaN code (row 40 of this band of 160 rows)");
  MT_EQ_INT(kn_linear_rows_loaded(lin), 100);
  t.q[(size_t)140 * K + 199] = 0xff;
  EXPECT_ERR(kn_linear_load_rows_fp8(lin, 0, 260, t.q, t.s, 0, e), MR_EINVAL, "W[row 140, column 199] is a NaN code");
  /* in place: named by part */
  const uint8_t *parts[2] = {t.q, t.q + (size_t)128 * K};
  const uint32_t rows[2] = {128, 132}, first[2] = {0, 128};
  const float *scs[2] = {t.s, t.s};
  kn_linear *m = (kn_linear *)&m;
  EXPECT_ERR(kn_linear_borrow_fp8(&m, eng, 2, parts, rows, K, scs, first, e), MR_EINVAL,
             "W[row 140, column 199] is a NaN code (part 1, its row 12 of 132)");
  MT_TRUE(m == NULL);
  t.q[(size_t)140 * K + 199] = keep;
  MT_OK(kn_linear_load_rows_fp8(lin, 0, 260, t.q, t.s, 0, &err), ep(&err));
  /* block scales: zero, negative, NaN, inf; only the block rows of the band's rows count */
  const float bad[4] = {0.0f, -1.0f, NAN, INFINITY};
  const char *shown[4] = {"= 0:", "= -1:", "= nan:", "= inf:"};
  for (int i = 0; i < 4; i++) {
    const float ks = t.s[2 * 2 + 1];
    t.s[2 * 2 + 1] = bad[i]; /* block [2, 1]: rows 256 .. 259 */
    EXPECT_ERR(kn_linear_load_rows_fp8(lin, 200, 60, t.q + (size_t)200 * K, t.s, 200, e), MR_EINVAL,
               "scale_inv[2, 1]");
    EXPECT_ERR(kn_linear_load_rows_fp8(lin, 200, 60, t.q + (size_t)200 * K, t.s, 200, e), MR_EINVAL, shown[i]);
    EXPECT_ERR(kn_linear_borrow_fp8(&m, eng, 2, parts, rows, K, scs, first, e), MR_EINVAL,
               "part 1: scale_inv[2, 1]");
    MT_OK(kn_linear_load_rows_fp8(lin, 0, 256, t.q, t.s, 0, &err), ep(&err)); /* not its rows */
    t.s[2 * 2 + 1] = ks;
  }
  MT_OK(kn_linear_load_rows_fp8(lin, 0, 260, t.q, t.s, 0, &err), ep(&err));
  /* arguments */
  EXPECT_ERR(kn_linear_load_rows_fp8(NULL, 0, 1, t.q, t.s, 0, e), MR_EINVAL, "lin is required");
  EXPECT_ERR(kn_linear_load_rows_fp8(lin, 0, 1, NULL, t.s, 0, e), MR_EINVAL, "w is required");
  EXPECT_ERR(kn_linear_load_rows_fp8(lin, 0, 1, t.q, NULL, 0, e), MR_EINVAL, "scale_inv is required");
  EXPECT_ERR(kn_linear_load_rows_fp8(lin, 250, 11, t.q, t.s, 0, e), MR_ERANGE, "n_out = 260");
  EXPECT_ERR(kn_linear_load_rows_fp8(lin, 0, 2, t.q, t.s, UINT32_MAX, e), MR_ERANGE, "overflows");
  MT_OK(kn_linear_load_rows_fp8(lin, 260, 0, NULL, NULL, 0, &err), ep(&err)); /* empty band */
  kn_linear *bf = NULL;
  MT_OK(kn_linear_new(&bf, eng, 260, K, KN_FMT_BF16, 0, &err), ep(&err));
  EXPECT_ERR(kn_linear_load_rows_fp8(bf, 0, 1, t.q, t.s, 0, e), MR_EINVAL, "format is bf16, not fp8-b128");
  kn_linear_free(bf);
  EXPECT_ERR(kn_linear_borrow_fp8(&m, eng, 2, parts, rows, K, NULL, first, e), MR_EINVAL, "scale_inv and first_row");
  EXPECT_ERR(kn_linear_borrow_fp8(&m, eng, 2, parts, rows, K, scs, NULL, e), MR_EINVAL, "scale_inv and first_row");
  const float *nos[2] = {t.s, NULL};
  EXPECT_ERR(kn_linear_borrow_fp8(&m, eng, 2, parts, rows, K, nos, first, e), MR_EINVAL, "part 1: scale_inv is required");
  EXPECT_ERR(kn_linear_borrow_fp8(&m, eng, 0, parts, rows, K, scs, first, e), MR_EINVAL, "n_parts = 0");
  EXPECT_ERR(kn_linear_borrow_fp8(&m, NULL, 2, parts, rows, K, scs, first, e), MR_EINVAL, "engine");
  EXPECT_ERR(kn_linear_borrow(&m, eng, 2, (const void *const *)parts, rows, K, MR_DTYPE_UNSPECIFIED, e),
             MR_ENOTSUP, "kn_linear_borrow_fp8");
  MT_TRUE(m == NULL);
  /* a non-finite f32 weight quantized into an fp8 linear: named, the band not loaded */
  float *w = randn((size_t)50 * K, 0.05f, 331);
  w[3 * K + 4] = -INFINITY;
  EXPECT_ERR(kn_linear_load_rows(lin, 10, 50, w, MR_DTYPE_F32, e), MR_EINVAL, "w[3, 4] = -inf");
  MT_EQ_INT(kn_linear_rows_loaded(lin), 210);
  free(w);
  /* out of memory: borrow_fp8 (the struct, the row bitmap, the scales) and a load */
  int failures = 0;
  for (long n = 1; n < 10; n++) {
    mr_alloc_fail_after(n);
    int rc = kn_linear_borrow_fp8(&m, eng, 2, parts, rows, K, scs, first, &err);
    mr_alloc_fail_after(0);
    if (rc == 0) break;
    MT_EQ_INT(rc, MR_ENOMEM);
    MT_TRUE(m == NULL);
    failures++;
  }
  MT_EQ_INT(failures, 3);
  kn_linear_free(m);
  /* a forced two-node engine places nothing: an fp8 linear in place as packed */
  kn_engine *two = NULL;
  kn_engine_opts o2 = {.isa = KN_ISA_COUNT, .threads = 2, .force_split = 2};
  MT_OK(kn_engine_new(&two, &o2, &err), ep(&err));
  kn_linear *p2 = NULL, *m2 = NULL;
  float *xx = randn((size_t)3 * K, 1.0f, 333), y1[3 * 260], y2[3 * 260];
  MT_OK(kn_linear_new(&p2, two, 260, K, KN_FMT_FP8, 0, &err), ep(&err));
  MT_OK(kn_linear_load_rows_fp8(p2, 0, 260, t.q, t.s, 0, &err), ep(&err));
  MT_OK(kn_linear_borrow_fp8(&m2, two, 2, parts, rows, K, scs, first, &err), ep(&err));
  MT_OK(kn_linear_forward(two, p2, 3, xx, y1, NULL, &err), ep(&err));
  MT_OK(kn_linear_forward(two, m2, 3, xx, y2, NULL, &err), ep(&err));
  MT_EQ_INT(memcmp(y1, y2, sizeof y1), 0);
  kn_linear_free(p2);
  kn_linear_free(m2);
  kn_engine_free(two);
  free(xx);
  kn_linear_free(lin);
  kn_engine_free(eng);
  free(t.q);
  free(t.s);
}

/* Out of memory at every allocation of new, load and forward: MR_ENOMEM, nothing leaked
 * (ASan), the linear unchanged, and the next call works. */
MT_TEST(linear_out_of_memory) {
  kn_engine *eng = engine_make(KN_ISA_COUNT, 2);
  const uint32_t N = 70, K = 33, T = 20;
  float *w = randn((size_t)N * K, 0.05f, 80), *x = randn((size_t)T * K, 1.0f, 81);
  float *y = malloc((size_t)T * N * 4), *ref = malloc((size_t)T * N * 4);
  mr_err e = {0};
  kn_linear *lin = NULL;
  int failures = 0;
  for (long n = 1; n < 10; n++) {
    mr_alloc_fail_after(n);
    int rc = kn_linear_new(&lin, eng, N, K, KN_FMT_INT8, 0, &e);
    mr_alloc_fail_after(0);
    if (rc == 0) break;
    MT_EQ_INT(rc, MR_ENOMEM);
    MT_TRUE(lin == NULL);
    failures++;
  }
  MT_EQ_INT(failures, 3); /* the struct, the row bitmap, the weights */
  for (long n = 1; n < 10; n++) {
    mr_alloc_fail_after(n);
    int rc = kn_linear_load_rows(lin, 0, N, w, MR_DTYPE_F32, &e);
    mr_alloc_fail_after(0);
    if (rc == 0) break;
    MT_EQ_INT(rc, MR_ENOMEM);
    MT_EQ_INT(kn_linear_rows_loaded(lin), 0);
  }
  MT_EQ_INT(kn_linear_rows_loaded(lin), N);
  MT_OK(kn_ref_linear_forward(lin, T, x, ref, &e), ep(&e));
  for (long n = 1; n < 10; n++) {
    mr_alloc_fail_after(n);
    int rc = kn_linear_forward(eng, lin, T, x, y, NULL, &e);
    mr_alloc_fail_after(0);
    if (rc == 0) break;
    MT_EQ_INT(rc, MR_ENOMEM);
    MT_CONTAINS(e.msg, "scratch");
  }
  MT_OK(kn_linear_forward(eng, lin, T, x, y, NULL, &e), ep(&e));
  MT_LE(kn_rel_l2(y, ref, (size_t)T * N), tolerance(eng, KN_FMT_INT8));
  mr_alloc_fail_after(1);
  MT_EQ_INT(kn_ref_linear_forward(lin, T, x, ref, &e), MR_ENOMEM);
  mr_alloc_fail_after(0);
  kn_linear_free(lin);
  kn_engine_free(eng);
  free(w);
  free(x);
  free(y);
  free(ref);
}

/* ---- kn_engine_run ----------------------------------------------------------------- */

typedef struct run_check {
  uint32_t threads;
  uint32_t *hits;     /* [n]: atomic counts */
  uint32_t *val;      /* [n]: plain writes, read after the run */
  uint32_t bad_worker;
  uint32_t per_worker[8];
} run_check;

static void run_item(void *arg, uint32_t item, uint32_t worker) {
  run_check *c = arg;
  __atomic_fetch_add(&c->hits[item], 1, __ATOMIC_RELAXED);
  c->val[item] = item * 3 + 1;
  if (worker >= c->threads) __atomic_store_n(&c->bad_worker, 1, __ATOMIC_RELAXED);
  else __atomic_fetch_add(&c->per_worker[worker], 1, __ATOMIC_RELAXED);
}

static void run_and_check(kn_engine *eng, uint32_t n) {
  run_check c = {.threads = kn_engine_threads(eng)};
  c.hits = calloc(n + 1, sizeof *c.hits);
  c.val = calloc(n + 1, sizeof *c.val);
  kn_engine_run(eng, n, run_item, &c);
  for (uint32_t i = 0; i < n; i++) {
    if (c.hits[i] != 1) printf("  item %u of %u ran %u times\n", i, n, c.hits[i]);
    MT_EQ_INT(c.hits[i], 1);
    MT_EQ_INT(c.val[i], i * 3 + 1);
  }
  MT_EQ_INT(c.hits[n], 0);
  MT_EQ_INT(c.bad_worker, 0);
  uint32_t sum = 0;
  for (uint32_t w = 0; w < c.threads; w++) sum += c.per_worker[w];
  MT_EQ_INT(sum, n);
  free(c.hits);
  free(c.val);
}

typedef struct run_thread_arg {
  kn_engine *eng;
  uint32_t n, rounds;
} run_thread_arg;
static void *run_thread(void *p) {
  run_thread_arg *a = p;
  for (uint32_t r = 0; r < a->rounds; r++) run_and_check(a->eng, a->n + r);
  return NULL;
}

MT_TEST(engine_run_covers_every_item_once) {
  const uint32_t threads[2] = {2, 3};
  const uint32_t ns[7] = {0, 1, 2, 3, 7, 1000, 100000};
  for (int ti = 0; ti < 2; ti++) {
    kn_engine *eng = engine_make(KN_ISA_COUNT, threads[ti]);
    MT_EQ_INT(kn_engine_threads(eng), threads[ti]);
    for (int ni = 0; ni < 7; ni++) run_and_check(eng, ns[ni]);
    for (uint32_t r = 0; r < 200; r++) run_and_check(eng, 1 + r % 9); /* back to back */
    /* two threads calling at once: the pool runs one job at a time */
    pthread_t th[2];
    run_thread_arg a[2] = {{eng, 500, 20}, {eng, 77, 20}};
    for (int i = 0; i < 2; i++) MT_EQ_INT(pthread_create(&th[i], NULL, run_thread, &a[i]), 0);
    for (int i = 0; i < 2; i++) pthread_join(th[i], NULL);
    kn_engine_free(eng);
  }
}

/* kn_engine_pin_caller puts the calling thread on worker 0's core: the PUs the plan keeps
 * free of pool threads, and no others. */
MT_TEST(engine_pin_caller_takes_worker0_core) {
  mr_err e = {0};
  MT_EQ_INT(kn_engine_pin_caller(NULL, &e), MR_EINVAL);
  kn_engine *eng = engine_make(KN_ISA_COUNT, 2);
  int rc = kn_engine_pin_caller(eng, &e);
  if (rc != 0) {
    MT_EQ_INT(rc, MR_ENOTSUP);
    printf("  SKIP: the OS refused the pin: %s\n", e.msg);
    kn_engine_free(eng);
    return;
  }
  const kn__worker_spec *w0 = &eng->plan.w[0];
  const kn__topo *t = &eng->topo;
  const uint32_t c0 = w0->core == KN__CORE_NODE ? t->node_core0[w0->node] : w0->core;
  const uint32_t c1 = w0->core == KN__CORE_NODE ? t->node_core0[w0->node + 1] : w0->core + 1;
  cpu_set_t want, got;
  CPU_ZERO(&want);
  for (uint32_t i = t->core_pu0[c0]; i < t->core_pu0[c1]; i++) CPU_SET(t->pu[i], &want);
  MT_EQ_INT(sched_getaffinity(0, sizeof got, &got), 0);
  MT_TRUE(CPU_EQUAL(&want, &got));
  printf("  caller pinned to %d PU(s), cpu %d now\n", CPU_COUNT(&got), sched_getcpu());
  run_and_check(eng, 1000); /* still works */
  kn_engine_free(eng);
}

MT_MAIN()
