/*
 * avx512_math.h - exp and silu on 16 floats, shared by the AVX-512 and AMX kernel files
 * (both compiled with the AVX-512 flags; each defines AI before including it).
 * exp_ps: 2^n * p(r) with n = round(x log2 e), saturating like expf; silu_ps(g) =
 * g / (1 + exp(-g)), like kn__silu.
 */
#ifndef KN_X86_AVX512_MATH_H
#define KN_X86_AVX512_MATH_H

#include <immintrin.h>

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

#endif /* KN_X86_AVX512_MATH_H */
