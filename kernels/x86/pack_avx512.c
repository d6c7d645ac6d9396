/*
 * pack_avx512.c - the loader's quantizers (amax, INT8, INT4 of kn__pack_fns, internal.h
 * section B) sixteen lanes at a time, compiled with the AVX-512 flags of the Makefile.
 * kn__pack() uses them, with the rest of the AVX2 set, where the CPU and the OS have
 * AVX-512 F, BW, VL and DQ (KN_ISA_AVX512): online INT8 / INT4 packing is the part of a
 * load that computes (a bf16 -> INT4 load spent half its time in quant_int4 on 2 vCPUs).
 *
 * The same bits as the scalar set in kn.c for every input, like pack_avx2.c, and for the
 * same reasons: the quotients are a real division (vdivps is IEEE exact) rounded to nearest
 * even by vrndscaleps, clamped, and converted exactly; amax is taken on the source's bits
 * (sign cleared: finite values order as their bits do, and a NaN or an inf is at or above
 * the exponent mask). tests/unit/test_kn_pack.c compares this set with the scalar one.
 *
 * Only F / BW / VL / DQ intrinsics here; tails shorter than a vector use the scalar rules.
 */
#include "kernels/internal.h"

#include <immintrin.h>
#include <math.h>
#include <string.h>

/* 16 values of dt from element k of src as fp32 (dt a constant in every caller). */
static inline __attribute__((always_inline)) __m512 load16(const void *src, mr_dtype dt, uint32_t k) {
  if (dt == MR_DTYPE_F32) return _mm512_loadu_ps((const float *)src + k);
  const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)src + k));
  if (dt == MR_DTYPE_F16) return _mm512_cvtph_ps(h);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* The bits of the largest |value| of n values of dt (see the header). */
static inline __attribute__((always_inline)) uint32_t amax_bits(const void *src, mr_dtype dt, uint32_t n) {
  uint32_t k = 0, b;
  if (dt == MR_DTYPE_F32) {
    const uint32_t *v = src;
    const __m512i m = _mm512_set1_epi32(0x7fffffff);
    __m512i a = _mm512_setzero_si512();
    for (; k + 16 <= n; k += 16) a = _mm512_max_epu32(a, _mm512_and_si512(m, _mm512_loadu_si512(v + k)));
    b = _mm512_reduce_max_epu32(a);
    for (; k < n; k++) b = (v[k] & 0x7fffffffu) > b ? v[k] & 0x7fffffffu : b;
    return b;
  }
  const uint16_t *v = src;
  const __m512i m = _mm512_set1_epi16(0x7fff);
  __m512i a = _mm512_setzero_si512();
  for (; k + 32 <= n; k += 32) a = _mm512_max_epu16(a, _mm512_and_si512(m, _mm512_loadu_si512(v + k)));
  /* 32 lanes of 16 bits to one: as 16 lanes of 32, the larger half of each */
  __m512i w = _mm512_max_epu32(_mm512_srli_epi32(a, 16), _mm512_and_si512(a, _mm512_set1_epi32(0xffff)));
  b = _mm512_reduce_max_epu32(w);
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

float kn__amax_avx512(const void *src, mr_dtype dt, uint32_t n, uint32_t *bad) {
  switch (dt) {
    case MR_DTYPE_BF16: return amax_t(src, MR_DTYPE_BF16, n, bad);
    case MR_DTYPE_F16: return amax_t(src, MR_DTYPE_F16, n, bad);
    default: return amax_t(src, MR_DTYPE_F32, n, bad);
  }
}

/* 16 quotients round(x / scale) clamped to +-lim, as int32 (scale > 0). */
static inline __attribute__((always_inline)) __m512i quant16(__m512 x, __m512 scale, __m512 lim) {
  __m512 q = _mm512_roundscale_ps(_mm512_div_ps(x, scale), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  q = _mm512_min_ps(_mm512_max_ps(q, _mm512_sub_ps(_mm512_setzero_ps(), lim)), lim);
  return _mm512_cvtps_epi32(q);
}

/* 64 quotients of dt values from element k of src as int8, in order. */
static inline __attribute__((always_inline)) __m512i quant64(const void *src, mr_dtype dt, uint32_t k,
                                                             __m512 scale, __m512 lim) {
  /* packs work per 128-bit lane: lane i holds a_i b_i c_i d_i (4 bytes each, a_i the i-th
   * quarter of a), so dword 4i + j is quarter i of vector j */
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  __m512i a = quant16(load16(src, dt, k), scale, lim), b = quant16(load16(src, dt, k + 16), scale, lim);
  __m512i c = quant16(load16(src, dt, k + 32), scale, lim), d = quant16(load16(src, dt, k + 48), scale, lim);
  __m512i p = _mm512_packs_epi16(_mm512_packs_epi32(a, b), _mm512_packs_epi32(c, d));
  return _mm512_permutexvar_epi32(order, p);
}

/* 16 quotients as int8 (an xmm), for a group or a row of 16 or 48. */
static inline __attribute__((always_inline)) __m128i quant16_i8(const void *src, mr_dtype dt, uint32_t k,
                                                                __m512 scale, __m512 lim) {
  return _mm512_cvtsepi32_epi8(quant16(load16(src, dt, k), scale, lim));
}

static inline __attribute__((always_inline)) void quant_i8(const void *src, mr_dtype dt, uint32_t n,
                                                           float scale, float lim, int8_t *dst) {
  const __m512 vs = _mm512_set1_ps(scale), vl = _mm512_set1_ps(lim);
  uint32_t k = 0;
  for (; k + 64 <= n; k += 64) _mm512_storeu_si512(dst + k, quant64(src, dt, k, vs, vl));
  for (; k + 16 <= n; k += 16) _mm_storeu_si128((__m128i *)(dst + k), quant16_i8(src, dt, k, vs, vl));
  for (; k < n; k++)
    dst[k] = (int8_t)kn__min_f(kn__max_f(kn__round_even(kn__src_f32(src, dt, k) / scale), -lim), lim);
}

static inline __attribute__((always_inline)) void quant_int8_t(const void *src, mr_dtype dt, uint32_t n,
                                                               float scale, int8_t *dst) {
  if (!(scale > 0.0f)) {
    memset(dst, 0, n);
    return;
  }
  quant_i8(src, dt, n, scale, 127.0f, dst);
}

void kn__quant_int8_avx512(const void *src, mr_dtype dt, uint32_t n, float scale, int8_t *dst) {
  switch (dt) {
    case MR_DTYPE_BF16: quant_int8_t(src, MR_DTYPE_BF16, n, scale, dst); break;
    case MR_DTYPE_F16: quant_int8_t(src, MR_DTYPE_F16, n, scale, dst); break;
    default: quant_int8_t(src, MR_DTYPE_F32, n, scale, dst); break;
  }
}

/* int8 values two per 16-bit lane, element 2i low, to the bytes (e0 & 0xf) | (e1 & 0xf) << 4. */
static inline __m256i nibbles(__m512i v) {
  __m512i n = _mm512_or_si512(_mm512_and_si512(v, _mm512_set1_epi16(0x000f)),
                              _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi16(0x00f0)));
  return _mm512_cvtepi16_epi8(n);
}

static inline __attribute__((always_inline)) uint32_t quant_int4_t(const void *src, mr_dtype dt, uint32_t K,
                                                                   uint32_t G, uint8_t *dst, float *scale) {
  const uint32_t ng = kn__ngroups(K, G);
  const size_t esz = mr_dtype_size(dt);
  int8_t q[128] __attribute__((aligned(64))); /* G <= 128 (kn_layer_new, kn_linear_new) */
  MR_ASSERT(G <= 128 && G % 32 == 0);
  const __m512 lim = _mm512_set1_ps(7.0f);
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
    const __m512 vs = _mm512_set1_ps(sc);
    if (len == G) {
      uint32_t k = 0;
      for (; k + 64 <= G; k += 64)
        _mm256_storeu_si256((__m256i *)(d + k / 2), nibbles(quant64(s, dt, k, vs, lim)));
      if (k < G) { /* 32 left (G = 32 or 96 does not occur; 32 does) */
        __m512i v = _mm512_inserti32x4(_mm512_castsi128_si512(quant16_i8(s, dt, k, vs, lim)),
                                       quant16_i8(s, dt, k + 16, vs, lim), 1);
        _mm_storeu_si128((__m128i *)(d + k / 2), _mm256_castsi256_si128(nibbles(v)));
      }
      continue;
    }
    /* The ragged last group: through q, zero past its end. */
    memset(q + len, 0, sizeof q - len);
    quant_i8(s, dt, len, sc, 7.0f, q);
    for (uint32_t k = 0; k < G; k += 64) {
      __m256i n = nibbles(_mm512_load_si512(q + k));
      if (k + 64 <= G) _mm256_storeu_si256((__m256i *)(d + k / 2), n);
      else _mm_storeu_si128((__m128i *)(d + k / 2), _mm256_castsi256_si128(n));
    }
  }
  return K;
}

uint32_t kn__quant_int4_avx512(const void *src, mr_dtype dt, uint32_t K, uint32_t G, uint8_t *dst,
                               float *scale) {
  switch (dt) {
    case MR_DTYPE_BF16: return quant_int4_t(src, MR_DTYPE_BF16, K, G, dst, scale);
    case MR_DTYPE_F16: return quant_int4_t(src, MR_DTYPE_F16, K, G, dst, scale);
    default: return quant_int4_t(src, MR_DTYPE_F32, K, G, dst, scale);
  }
}
