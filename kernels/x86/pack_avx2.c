/*
 * pack_avx2.c - the AVX2 set of the loader's row converters (kn__pack_fns, internal.h
 * section B), compiled with the AVX2 flags of the Makefile only (-mavx2 -mfma -mf16c).
 *
 * Every function gives the bits of its scalar twin in kn.c for every input, which the
 * loaders rely on (a layer packs the same on any CPU, so a weight cache and the results do
 * not depend on which set ran; tests/unit/test_kn_pack.c compares them):
 *   - the int8 / int4 quotients are src / scale with a real division (vdivps is IEEE
 *     exact, like the scalar division) rounded to nearest even by vroundps, which is what
 *     the scalar kn__round_even computes for the |q| < 2^22 that occur;
 *   - amax is a maximum, exact in any order, taken on the source's bits (sign cleared,
 *     finite values order as their bits do), which also finds a NaN or an inf;
 *   - bf16 is the top half of fp32 (a shift); f16 <-> fp32 is vcvtph2ps / vcvtps2ph with
 *     round to nearest even, as mr_f16_to_f32 / mr_f32_to_f16 for finite values;
 *   - fp32 -> bf16 is mr_f32_to_bf16's integer rounding, lane by lane.
 * The checks for values that are not finite OR a compare mask over the row and, only when
 * it is set, find the first bad index with a scalar scan (a bad weight fails the load).
 *
 * Tails shorter than a vector are done by the scalar code of kn.c's rules, inline here.
 */
#include "kernels/internal.h"

#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "kernels/x86/fp8_avx2.h"

/* ---- conversions -------------------------------------------------------------------- */

static uint32_t to_f32_avx2(float *dst, const void *src, mr_dtype dt, uint32_t n) {
  uint32_t k = 0;
  const __m256i expo = _mm256_set1_epi32(0x7f800000);
  __m256i bad = _mm256_setzero_si256();
  switch (dt) {
    case MR_DTYPE_BF16: {
      const uint16_t *s = src;
      for (; k + 8 <= n; k += 8) {
        __m256i u = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(s + k))), 16);
        bad = _mm256_or_si256(bad, _mm256_cmpeq_epi32(_mm256_and_si256(u, expo), expo));
        _mm256_storeu_ps(dst + k, _mm256_castsi256_ps(u));
      }
      for (; k < n; k++) dst[k] = mr_bf16_to_f32(s[k]);
      break;
    }
    case MR_DTYPE_F16: {
      const uint16_t *s = src;
      for (; k + 8 <= n; k += 8) {
        __m256 v = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + k)));
        __m256i u = _mm256_castps_si256(v);
        bad = _mm256_or_si256(bad, _mm256_cmpeq_epi32(_mm256_and_si256(u, expo), expo));
        _mm256_storeu_ps(dst + k, v);
      }
      for (; k < n; k++) dst[k] = mr_f16_to_f32(s[k]);
      break;
    }
    case MR_DTYPE_F32: {
      const float *s = src;
      for (; k + 8 <= n; k += 8) {
        __m256 v = _mm256_loadu_ps(s + k);
        __m256i u = _mm256_castps_si256(v);
        bad = _mm256_or_si256(bad, _mm256_cmpeq_epi32(_mm256_and_si256(u, expo), expo));
        _mm256_storeu_ps(dst + k, v);
      }
      for (; k < n; k++) dst[k] = s[k];
      break;
    }
    default: MR_ASSERT(!"to_f32_avx2: bad dtype");
  }
  /* The vector loop covered n - n % 8 values; the tail is checked on its own. */
  const uint32_t kv = n - n % 8;
  if (_mm256_testz_si256(bad, bad) && kn__first_bad(dst + kv, MR_DTYPE_F32, n - kv) == n - kv) return n;
  return kn__first_bad(dst, MR_DTYPE_F32, n);
}

/* The finite check of n values of dt at src, copying them to dst when store (a constant
 * in each caller, so that the check-only loop has no store). */
static inline __attribute__((always_inline)) uint32_t scan_avx2(void *dst, const void *src,
                                                                mr_dtype dt, uint32_t n,
                                                                const bool store) {
  const size_t bytes = (size_t)n * mr_dtype_size(dt);
  uint8_t *d = dst;
  const uint8_t *s = src;
  size_t b = 0;
  __m256i bad = _mm256_setzero_si256();
  if (dt == MR_DTYPE_F32) {
    const __m256i m = _mm256_set1_epi32(0x7f800000);
    for (; b + 32 <= bytes; b += 32) {
      __m256i v = _mm256_loadu_si256((const __m256i *)(s + b));
      bad = _mm256_or_si256(bad, _mm256_cmpeq_epi32(_mm256_and_si256(v, m), m));
      if (store) _mm256_storeu_si256((__m256i *)(d + b), v);
    }
  } else {
    const __m256i m = _mm256_set1_epi16((short)(dt == MR_DTYPE_BF16 ? 0x7f80 : 0x7c00));
    for (; b + 32 <= bytes; b += 32) {
      __m256i v = _mm256_loadu_si256((const __m256i *)(s + b));
      bad = _mm256_or_si256(bad, _mm256_cmpeq_epi16(_mm256_and_si256(v, m), m));
      if (store) _mm256_storeu_si256((__m256i *)(d + b), v);
    }
  }
  if (store) memcpy(d + b, s + b, bytes - b);
  const uint32_t tail = (uint32_t)((bytes - b) / mr_dtype_size(dt));
  if (_mm256_testz_si256(bad, bad) && kn__first_bad(s + b, dt, tail) == tail) return n;
  return kn__first_bad(src, dt, n);
}

static uint32_t copy_avx2(void *dst, const void *src, mr_dtype dt, uint32_t n) {
  return scan_avx2(dst, src, dt, n, true);
}

static uint32_t check_avx2(const void *src, mr_dtype dt, uint32_t n) {
  return scan_avx2(NULL, src, dt, n, false);
}

static uint32_t check_fp8_avx2(const uint8_t *src, uint32_t n) {
  uint32_t k = 0;
  const __m256i m = _mm256_set1_epi8(0x7f);
  __m256i bad = _mm256_setzero_si256();
  for (; k + 32 <= n; k += 32) {
    __m256i v = _mm256_loadu_si256((const __m256i *)(src + k));
    bad = _mm256_or_si256(bad, _mm256_cmpeq_epi8(_mm256_and_si256(v, m), m));
  }
  bool tail_bad = false;
  for (uint32_t i = k; i < n; i++) tail_bad |= (src[i] & 0x7f) == 0x7f;
  if (_mm256_testz_si256(bad, bad) && !tail_bad) return n;
  for (k = 0; k < n; k++)
    if ((src[k] & 0x7f) == 0x7f) return k;
  return n;
}

/* e4m3fn -> fp32 times scale, 8 codes at a time (fp8_avx2.h), then rounded once: exactly
 * the table's value times the scale, as the scalar path. NaN codes are only looked for. */
static uint32_t dequant_fp8_avx2(float *dst, const uint8_t *q, uint32_t n, float scale) {
  const __m256 s = _mm256_set1_ps(scale);
  uint32_t k = 0;
  for (; k + 8 <= n; k += 8)
    _mm256_storeu_ps(dst + k, _mm256_mul_ps(kn__fp8x8_to_ps(_mm_loadl_epi64((const __m128i *)(q + k))), s));
  const float *tbl = mr_f8e4m3_table();
  for (; k < n; k++) dst[k] = tbl[q[k]] * scale;
  return check_fp8_avx2(q, n); /* the codes just read, still in L1 */
}

/* The copy, then the check of the source while its row is still in cache. */
static uint32_t copy_fp8_avx2(uint8_t *dst, const uint8_t *src, uint32_t n) {
  memcpy(dst, src, n);
  return check_fp8_avx2(src, n);
}

/* ---- quantizers, reading the source as stored --------------------------------------- */

/* 8 values of dt from element k of src as fp32 (dt a constant in every caller). */
static inline __attribute__((always_inline)) __m256 load8(const void *src, mr_dtype dt, uint32_t k) {
  if (dt == MR_DTYPE_F32) return _mm256_loadu_ps((const float *)src + k);
  const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)src + k));
  if (dt == MR_DTYPE_F16) return _mm256_cvtph_ps(h);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* The bits of the largest |value| of n values of dt: the sign bit cleared, finite values
 * order as their bits do, and a NaN or an inf is at or above kn__expo_bits(dt). */
static inline __attribute__((always_inline)) uint32_t amax_bits(const void *src, mr_dtype dt, uint32_t n) {
  uint32_t k = 0, b = 0;
  if (dt == MR_DTYPE_F32) {
    const uint32_t *v = src;
    const __m256i m = _mm256_set1_epi32(0x7fffffff);
    __m256i a0 = _mm256_setzero_si256(), a1 = _mm256_setzero_si256();
    for (; k + 16 <= n; k += 16) {
      a0 = _mm256_max_epu32(a0, _mm256_and_si256(m, _mm256_loadu_si256((const __m256i *)(v + k))));
      a1 = _mm256_max_epu32(a1, _mm256_and_si256(m, _mm256_loadu_si256((const __m256i *)(v + k + 8))));
    }
    __m128i x = _mm_max_epu32(_mm256_castsi256_si128(_mm256_max_epu32(a0, a1)),
                              _mm256_extracti128_si256(_mm256_max_epu32(a0, a1), 1));
    x = _mm_max_epu32(x, _mm_srli_si128(x, 8));
    x = _mm_max_epu32(x, _mm_srli_si128(x, 4));
    b = (uint32_t)_mm_cvtsi128_si32(x);
    for (; k < n; k++) b = (v[k] & 0x7fffffffu) > b ? v[k] & 0x7fffffffu : b;
    return b;
  }
  const uint16_t *v = src;
  const __m256i m = _mm256_set1_epi16(0x7fff);
  __m256i a0 = _mm256_setzero_si256(), a1 = _mm256_setzero_si256();
  for (; k + 32 <= n; k += 32) {
    a0 = _mm256_max_epu16(a0, _mm256_and_si256(m, _mm256_loadu_si256((const __m256i *)(v + k))));
    a1 = _mm256_max_epu16(a1, _mm256_and_si256(m, _mm256_loadu_si256((const __m256i *)(v + k + 16))));
  }
  for (; k + 16 <= n; k += 16)
    a0 = _mm256_max_epu16(a0, _mm256_and_si256(m, _mm256_loadu_si256((const __m256i *)(v + k))));
  a0 = _mm256_max_epu16(a0, a1);
  __m128i x = _mm_max_epu16(_mm256_castsi256_si128(a0), _mm256_extracti128_si256(a0, 1));
  x = _mm_max_epu16(x, _mm_srli_si128(x, 8));
  x = _mm_max_epu16(x, _mm_srli_si128(x, 4));
  x = _mm_max_epu16(x, _mm_srli_si128(x, 2));
  b = (uint32_t)_mm_extract_epi16(x, 0);
  for (; k < n; k++) b = (v[k] & 0x7fffu) > b ? v[k] & 0x7fffu : b;
  return b;
}

static inline __attribute__((always_inline)) float amax_t(const void *src, mr_dtype dt, uint32_t n,
                                                          uint32_t *bad) {
  uint32_t b = amax_bits(src, dt, n);
  *bad = n;
  if (b >= kn__expo_bits(dt)) {
    *bad = kn__first_bad(src, dt, n);
    b = amax_bits(src, dt, *bad); /* the scalar rule: the amax of those before it */
  }
  return kn__bits_f32(b, dt);
}

static float amax_avx2(const void *src, mr_dtype dt, uint32_t n, uint32_t *bad) {
  switch (dt) {
    case MR_DTYPE_BF16: return amax_t(src, MR_DTYPE_BF16, n, bad);
    case MR_DTYPE_F16: return amax_t(src, MR_DTYPE_F16, n, bad);
    default: return amax_t(src, MR_DTYPE_F32, n, bad);
  }
}

/* 8 quotients round(x / scale) clamped to +-lim, as int32 (scale > 0). A real division:
 * a multiply by 1 / scale with a check of the lanes near a rounding tie (to keep the
 * division's bits) was tried and is slower here; the division is not the bound. */
static inline __attribute__((always_inline)) __m256i quant8(__m256 x, __m256 scale, __m256 lim) {
  __m256 q = _mm256_round_ps(_mm256_div_ps(x, scale), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  q = _mm256_min_ps(_mm256_max_ps(q, _mm256_sub_ps(_mm256_setzero_ps(), lim)), lim);
  return _mm256_cvtps_epi32(q);
}

/* 32 quotients of dt values from element k of src as int8, in order. */
static inline __attribute__((always_inline)) __m256i quant32(const void *src, mr_dtype dt, uint32_t k,
                                                             __m256 scale, __m256 lim) {
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  __m256i a = quant8(load8(src, dt, k), scale, lim), b = quant8(load8(src, dt, k + 8), scale, lim);
  __m256i c = quant8(load8(src, dt, k + 16), scale, lim), d = quant8(load8(src, dt, k + 24), scale, lim);
  /* packs work per 128-bit lane: [a0-3 b0-3 c0-3 d0-3 | a4-7 b4-7 c4-7 d4-7] as dwords */
  __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
  return _mm256_permutevar8x32_epi32(p, order);
}

/* n quotients of dt values (scale > 0, clamp +-lim) as int8 at dst. */
static inline __attribute__((always_inline)) void quant_i8(const void *src, mr_dtype dt, uint32_t n,
                                                           float scale, float lim, int8_t *dst) {
  const __m256 vs = _mm256_set1_ps(scale), vl = _mm256_set1_ps(lim);
  uint32_t k = 0;
  for (; k + 32 <= n; k += 32) _mm256_storeu_si256((__m256i *)(dst + k), quant32(src, dt, k, vs, vl));
  for (; k < n; k++)
    dst[k] = (int8_t)kn__min_f(kn__max_f(kn__round_even(kn__src_f32(src, dt, k) / scale), -lim), lim);
}

/* Two int8 values per 16-bit lane, element 2i low, to the byte (e0 & 0xf) | (e1 & 0xf) << 4
 * in the lane's low half. */
static inline __m256i nibbles(__m256i v) {
  return _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi16(0x000f)),
                         _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi16(0x00f0)));
}

static inline __attribute__((always_inline)) void quant_int8_t(const void *src, mr_dtype dt, uint32_t n,
                                                               float scale, int8_t *dst) {
  if (!(scale > 0.0f)) {
    memset(dst, 0, n);
    return;
  }
  quant_i8(src, dt, n, scale, 127.0f, dst);
}

static void quant_int8_avx2(const void *src, mr_dtype dt, uint32_t n, float scale, int8_t *dst) {
  switch (dt) {
    case MR_DTYPE_BF16: quant_int8_t(src, MR_DTYPE_BF16, n, scale, dst); break;
    case MR_DTYPE_F16: quant_int8_t(src, MR_DTYPE_F16, n, scale, dst); break;
    default: quant_int8_t(src, MR_DTYPE_F32, n, scale, dst); break;
  }
}

static inline __attribute__((always_inline)) uint32_t quant_int4_t(const void *src, mr_dtype dt, uint32_t K,
                                                                   uint32_t G, uint8_t *dst, float *scale) {
  const uint32_t ng = kn__ngroups(K, G);
  const size_t esz = mr_dtype_size(dt);
  int8_t q[128] __attribute__((aligned(32))); /* G <= 128 (kn_layer_new, kn_linear_new) */
  MR_ASSERT(G <= 128 && G % 32 == 0);
  const __m256 lim = _mm256_set1_ps(7.0f);
  for (uint32_t g = 0; g < ng; g++) {
    const uint32_t k0 = g * G, len = k0 + G < K ? G : K - k0;
    const void *s = (const char *)src + k0 * esz;
    uint8_t *d = dst + k0 / 2;
    const uint32_t b = amax_bits(s, dt, len);
    if (b >= kn__expo_bits(dt)) return k0 + kn__first_bad(s, dt, len);
    const float sc = kn__bits_f32(b, dt) / 7.0f;
    scale[g] = sc;
    if (!(sc > 0.0f)) {
      memset(d, 0, G / 2);
      continue;
    }
    const __m256 vs = _mm256_set1_ps(sc);
    if (len == G) {
      /* In registers: 64 values to 32 bytes (packus per 128-bit lane, then the 64-bit
       * order 0 2 1 3), or 32 to 16. */
      uint32_t k = 0;
      for (; k + 64 <= G; k += 64) {
        __m256i p = _mm256_packus_epi16(nibbles(quant32(s, dt, k, vs, lim)),
                                        nibbles(quant32(s, dt, k + 32, vs, lim)));
        _mm256_storeu_si256((__m256i *)(d + k / 2), _mm256_permute4x64_epi64(p, 0xd8));
      }
      if (k < G) {
        __m256i n = nibbles(quant32(s, dt, k, vs, lim));
        __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi16(n, n), 0xd8);
        _mm_storeu_si128((__m128i *)(d + k / 2), _mm256_castsi256_si128(p));
      }
      continue;
    }
    /* The ragged last group: through q, zero past its end. */
    memset(q + len, 0, G - len);
    quant_i8(s, dt, len, sc, 7.0f, q);
    for (uint32_t k = 0; k < G; k += 32) {
      __m256i n = nibbles(_mm256_load_si256((const __m256i *)(q + k)));
      __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi16(n, n), 0xd8);
      _mm_storeu_si128((__m128i *)(d + k / 2), _mm256_castsi256_si128(p));
    }
  }
  return K;
}

static uint32_t quant_int4_avx2(const void *src, mr_dtype dt, uint32_t K, uint32_t G, uint8_t *dst,
                                float *scale) {
  switch (dt) {
    case MR_DTYPE_BF16: return quant_int4_t(src, MR_DTYPE_BF16, K, G, dst, scale);
    case MR_DTYPE_F16: return quant_int4_t(src, MR_DTYPE_F16, K, G, dst, scale);
    default: return quant_int4_t(src, MR_DTYPE_F32, K, G, dst, scale);
  }
}

static void from_f32_avx2(void *dst, mr_dtype dt, const float *src, uint32_t n) {
  uint16_t *d = dst;
  uint32_t k = 0;
  if (dt == MR_DTYPE_F16) {
    for (; k + 8 <= n; k += 8)
      _mm_storeu_si128((__m128i *)(d + k), _mm256_cvtps_ph(_mm256_loadu_ps(src + k), _MM_FROUND_TO_NEAREST_INT));
    for (; k < n; k++) d[k] = mr_f32_to_f16(src[k]);
    return;
  }
  MR_ASSERT(dt == MR_DTYPE_BF16);
  const __m256i one = _mm256_set1_epi32(1), r = _mm256_set1_epi32(0x7fff);
  const __m256i absm = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
  const __m256i quiet = _mm256_set1_epi32(0x40);
  for (; k + 16 <= n; k += 16) {
    __m256i h[2];
    for (int i = 0; i < 2; i++) {
      __m256i u = _mm256_loadu_si256((const __m256i *)(src + k + 8 * i));
      __m256i rounded = _mm256_srli_epi32(
          _mm256_add_epi32(u, _mm256_add_epi32(r, _mm256_and_si256(_mm256_srli_epi32(u, 16), one))), 16);
      __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, absm), inf);
      __m256i qn = _mm256_or_si256(_mm256_srli_epi32(u, 16), quiet);
      h[i] = _mm256_blendv_epi8(rounded, qn, nan);
    }
    /* packus per 128-bit lane: [h0 0-3 h1 0-3 | h0 4-7 h1 4-7]; 64-bit order 0 2 1 3 fixes it */
    __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(h[0], h[1]), 0xd8);
    _mm256_storeu_si256((__m256i *)(d + k), p);
  }
  for (; k < n; k++) d[k] = mr_f32_to_bf16(src[k]);
}

const kn__pack_fns kn__pack_avx2 = {
    .to_f32 = to_f32_avx2,
    .copy = copy_avx2,
    .check = check_avx2,
    .copy_fp8 = copy_fp8_avx2,
    .check_fp8 = check_fp8_avx2,
    .dequant_fp8 = dequant_fp8_avx2,
    .amax = amax_avx2,
    .quant_int8 = quant_int8_avx2,
    .quant_int4 = quant_int4_avx2,
    .from_f32 = from_f32_avx2,
    .name = "avx2",
};
