/*
 * kernels/x86/fp8_avx2.h - e4m3fn codes to fp32 in AVX2 registers, for the files compiled
 * with the AVX2 flags (pack_avx2.c: the loader's dequantization; moe_avx2.c: the fp8-b128
 * kernel). Include after <immintrin.h>.
 *
 * Through fp16 (F16C): a code's 7 magnitude bits put at bits 13..7 of an fp16 are its
 * exponent and mantissa over fp16's bias of 15 instead of 7, so that fp16 holds the code's
 * value times 2^-8 exactly, subnormal codes included (they become fp16 subnormals, which
 * vcvtph2ps widens exactly); times 256 in fp32 is then exact too. The sign comes from
 * sign-extending the byte: shifted left by 7, the extension fills bits 15 and 14, and bit
 * 14 is masked off. Every finite code gives its exact value (the 256-entry table's,
 * kn_fp8_e4m3_to_f32); a NaN code (0x7f, 0xff) gives a finite value, so callers that must
 * refuse NaN codes check for them themselves.
 */
#ifndef KN_X86_FP8_AVX2_H
#define KN_X86_FP8_AVX2_H

/* The 16 codes of c16 as fp16 values of code / 256 (two halves of 8). */
static inline __attribute__((always_inline)) __m256i kn__fp8x16_to_ph(__m128i c16) {
  return _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(c16), 7), _mm256_set1_epi16((short)0xbf80));
}

/* fp16 lanes 0-7 (lo) or 8-15 (hi) of h as fp32, times 256: the codes' exact values. */
static inline __attribute__((always_inline)) __m256 kn__fp8_ph_lo(__m256i h) {
  return _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), _mm256_set1_ps(256.0f));
}
static inline __attribute__((always_inline)) __m256 kn__fp8_ph_hi(__m256i h) {
  return _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), _mm256_set1_ps(256.0f));
}

/* The 8 codes in the low 8 bytes of c8 as fp32. */
static inline __attribute__((always_inline)) __m256 kn__fp8x8_to_ps(__m128i c8) {
  return kn__fp8_ph_lo(kn__fp8x16_to_ph(c8));
}

#endif /* KN_X86_FP8_AVX2_H */
