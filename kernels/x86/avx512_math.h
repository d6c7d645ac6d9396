/*
 * avx512_math.h - what the AVX-512 and AMX kernel files share (both compiled with the
 * AVX-512 flags; each defines AI before including it):
 *   - exp and silu on 16 floats. exp_ps: 2^n * p(r) with n = round(x log2 e), saturating
 *     like expf; silu_ps(g) = g / (1 + exp(-g)), like kn__silu;
 *   - activation rows read in their dtype (f32, f16, bf16; the widening is exact, so a row
 *     packs to the bytes of its fp32 copy), and their per-token int8 quantization.
 */
#ifndef KN_X86_AVX512_MATH_H
#define KN_X86_AVX512_MATH_H

#include <immintrin.h>
#include <math.h>

#include "kernels/x86/common_x86.h"

KN__X86_EXP_POLY(exp_poly, __m512, _mm512_set1_ps, _mm512_fmadd_ps, _mm512_fnmadd_ps,
                 _mm512_mul_ps, _mm512_add_ps)
AI __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-110.0f), x);
  x = _mm512_min_ps(_mm512_set1_ps(100.0f), x);
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(KN__EXP_LOG2E)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm512_scalef_ps(exp_poly(x, n), n);
}
AI __m512 silu_ps(__m512 g) {
  return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g))));
}

/* 16 values of a row of dtype dt from k on, as fp32, zero from n on. dt is a constant
 * wherever this is inlined. */
AI __m512 kn__ld16(const void *x, mr_dtype dt, uint32_t k, uint32_t n) {
  if (k >= n) return _mm512_setzero_ps();
  const __mmask16 m = n - k >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - k)) - 1);
  if (dt == MR_DTYPE_F32) return _mm512_maskz_loadu_ps(m, (const float *)x + k);
  const __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)x + k);
  if (dt == MR_DTYPE_F16) return _mm512_cvtph_ps(h);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* amax of n values, NaN if any is NaN (so that a NaN input gives a NaN output). */
AI float kn__amax_nan(const void *x, mr_dtype dt, uint32_t n) {
  __m512 m = _mm512_setzero_ps();
  __mmask16 nan = 0;
  for (uint32_t k = 0; k < n; k += 16) {
    __m512 v = kn__ld16(x, dt, k, n);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    m = _mm512_max_ps(m, _mm512_abs_ps(v));
  }
  return nan ? NAN : _mm512_reduce_max_ps(m);
}

/* A token's int8 scale (amax / 127, NaN if the row holds a NaN or an inf, so that the
 * token's outputs are NaN) and 1 / scale for quantizing (0 for an all-zero or non-finite
 * row: its values quantize to 0). */
AI float kn__quant_scale(const void *x, mr_dtype dt, uint32_t K, __m512 *inv) {
  float amax = kn__amax_nan(x, dt, K);
  float scale = amax / 127.0f;
  *inv = _mm512_set1_ps(scale > 0.0f && isfinite(scale) ? 127.0f / amax : 0.0f);
  return isfinite(amax) ? scale : NAN;
}

/* 16 int32 quantized values of x[k..k+16) (zero from n on): round(x / scale) (MXCSR:
 * to nearest even), |q| <= 127. */
AI __m512i kn__quant16(const void *x, mr_dtype dt, uint32_t k, uint32_t n, __m512 inv) {
  __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(kn__ld16(x, dt, k, n), inv));
  return _mm512_max_epi32(_mm512_min_epi32(q, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
}

#endif /* KN_X86_AVX512_MATH_H */
