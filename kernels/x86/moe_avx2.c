/*
 * moe_avx2.c - the AVX2 entries of the kernel table (internal.h section C), compiled with
 * the AVX2 flags of the Makefile only (-mavx2 -mfma -mf16c). For CPUs without AVX-512, for
 * the int8/int4 formats on AVX-512 CPUs without VNNI, and for fp8-b128 on AVX-512 CPUs
 * without BF16.
 *
 * The float formats are computed in fp32 with FMA on fp32 activations, so the results
 * match the reference (fp32 math over the stored weights) up to summation order: the
 * weights are widened in registers, once per load, and used for all tokens of the tile.
 * The integer formats multiply in integers, on activations quantized per token to int8
 * (KN__RND_Q8, as the AVX-512 VNNI and AMX-INT8 kernels: the same prepared layouts,
 * common_x86.h QI8 / QI4, with the same rounding), because widening every weight to
 * fp32 made them compute-bound at one token (2026-12-06, Zen 3: int4 decode read its
 * weights at 0.30 of the memory rate, int8 at 0.78). AVX2 has no vpdpbusd; its pair
 * vpmaddubsw (u8 x s8, adjacent pairs summed to int16, saturating) + vpmaddwd by ones
 * (adjacent int16 pairs to int32) gives the same sums where no int16 saturates:
 *
 *   f32   as is;              f16   vcvtph2ps;
 *   bf16  32-bit lanes of 16 bf16 values: even elements = dword << 16, odd ones =
 *         dword & 0xffff0000. The activations are prepared per block of 16 as 8 even then
 *         8 odd fp32 values, so no shuffle is needed in the loop;
 *   int8  32 weights per step against 32 int8 activations: vpmaddubsw(|w|, sign(x, w))
 *         (vpabsb, vpsignb), whose int16 pairs are at most 2 * 127 * 127 = 32258 (the
 *         AVX-512 kernel's w + 128 offset could reach 2 * 255 * 127 and saturate); exact
 *         int32 sums over the whole row, then one convert and the row and token scales;
 *   int4  32 bytes = 64 elements: b ^ 0x88 turns both nibbles v into v + 8 in 0..15,
 *         lo = b & 0xf holds the even elements, hi = (b >> 4) & 0xf the odd ones, the u8
 *         operands of vpmaddubsw against the even and odd activations of the chunk (QI4:
 *         per 128 elements, 64 even then 64 odd); int16 pairs at most 2 * 15 * 127, and
 *         lo + hi at most 7620. int32 lane l of a step covers 8 consecutive elements, all
 *         in one group: converted, times its group scale into fp32 accumulators. The +8
 *         is taken off once per row and token (sum over groups of s_g * 8 * X_g, the
 *         token's group sums from prep), as in moe_avx512.c.
 *   fp8   (fp8-b128) 16 e4m3 codes at a time widened exactly to code / 256 in registers
 *         (fp8_avx2.h, through fp16), fp32 activations in place; a step is one 128-block:
 *         its unscaled sum, times 256 and the block's scale, is added to the dot product
 *         (the scale once per block, as in the AVX-512 kernel: the conversion, not the
 *         memory, bounds this kernel, and a multiply per element was a third of it).
 *         From FP8_PRE_MIN_TOKENS tokens per expert the tile's rows are converted once
 *         into fp32 weights in tmp (code value times scale, one rounding) and the tiles
 *         run as f32 on them. For CPUs without AVX-512 BF16 (Zen 2 / 3, Skylake / Cascade
 *         Lake).
 *
 * Tiles: RW weight rows x C tokens, RW * C <= 8 ymm accumulators, reduced together by a
 * transposing tree (hsum8) into one vector with dot (c, r) in lane c * RW + r. n = 1:
 * 8 rows (gate_up: 4 gate + 4 up); n >= 2: 4 rows x 2 tokens, rows outer, tokens inner;
 * fp8 below FP8_PRE_MIN_TOKENS: 2 rows x 4 tokens, from it 4 rows x 2 tokens on the
 * converted rows.
 *
 * Threads: as in moe_avx512.c: disjoint row ranges of one task may run concurrently; down
 * converts h into t->tmp, and fp8 prefill converts its weight rows there (gate_up and
 * down), so tmp must be private to the calling thread.
 */
#include "kernels/x86/common_x86.h"

#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "kernels/x86/fp8_avx2.h"

#define AI static inline __attribute__((always_inline))
#define UNROLL _Pragma("GCC unroll 8")

typedef enum v256 { V_F32, V_F16, V_BF16, V_I8, V_I4, V_FP8, V_COUNT } v256;

/* Activations: fp32 in place, fp32 in even/odd blocks of 16 (bf16), int8 per token padded
 * to 32 (int8), int8 per token in even/odd blocks of 128 (int4; rows padded to 128 so that
 * a row's last group, up to 128 wide, never reads past the token). */
static const kn__x86_act_kind act_kind[V_COUNT] = {KN__ACT_NONE, KN__ACT_NONE, KN__ACT_F32EO,
                                                    KN__ACT_QI8,  KN__ACT_QI4,  KN__ACT_NONE};
static const uint32_t act_quantum[V_COUNT] = {8, 8, 16, 32, 128, 8};
static const uint32_t act_block[V_COUNT] = {8, 8, 16, 32, 128, 8};

static kn__x86_acts acts_layout(const v256 v, uint32_t K, uint32_t G, uint32_t n) {
  return kn__x86_acts_layout(act_kind[v], K, act_quantum[v], act_block[v], G, n);
}

/* ---- small vector helpers ---------------------------------------------------------- */

static inline __m256i iota8(void) { return _mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0); }

/* Lanes i < n set (as a maskload / maskstore mask). */
static inline __m256i lanes_lt(uint32_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n > 8 ? 8 : n)), iota8());
}

/* Lane l of the result is lane (l + s) mod 8 of v. */
AI __m256 rot_ps(__m256 v, int s) {
  return _mm256_permutevar8x32_ps(v, _mm256_and_si256(_mm256_add_epi32(iota8(), _mm256_set1_epi32(s)),
                                                      _mm256_set1_epi32(7)));
}

/* Lane i of the result = the sum of the 8 lanes of v[i]. */
AI __m256 hsum8_ps(const __m256 *v) {
  __m256 a0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  __m256 a1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  /* a0 = [v0..v3 sums over the low 128 bits | v0..v3 over the high 128 bits] */
  return _mm256_add_ps(_mm256_permute2f128_ps(a0, a1, 0x20), _mm256_permute2f128_ps(a0, a1, 0x31));
}

/* exp(x) to ~1 ulp on [-87, 88] (the polynomial of common_x86.h, 2^n built in the exponent
 * field); x is clamped to that range, so exp(-g) for g < -88 is ~1.6e38 instead of inf and
 * silu gives ~-6e-37 instead of -0 there. The clamps keep NaN (vmaxps / vminps return their
 * second operand when either is NaN). */
KN__X86_EXP_POLY(exp_poly, __m256, _mm256_set1_ps, _mm256_fmadd_ps, _mm256_fnmadd_ps,
                 _mm256_mul_ps, _mm256_add_ps)
AI __m256 exp_ps(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-87.0f), x);
  x = _mm256_min_ps(_mm256_set1_ps(88.0f), x);
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(KN__EXP_LOG2E)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 p = exp_poly(x, n);
  /* n in [-126, 127]: 2^n = (n + 127) << 23 as a float. */
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

AI __m256 silu_ps(__m256 g) {
  return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), g))));
}

/* ---- activation preparation: int8 per token ---------------------------------------- */

/* 8 values of x from k on, zero from K on. */
AI __m256 ld8z(const float *x, uint32_t k, uint32_t K) {
  if (k >= K) return _mm256_setzero_ps();
  return K - k >= 8 ? _mm256_loadu_ps(x + k) : _mm256_maskload_ps(x + k, lanes_lt(K - k));
}

/* A token's int8 scale and 1 / scale, as avx512_math.h's kn__quant_scale (the same values
 * bit for bit: amax / 127, NaN when the row holds a NaN or an inf; 0 to quantize with for
 * an all-zero or non-finite row). */
static float quant_scale8(const float *x, uint32_t K, __m256 *inv) {
  __m256 m = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
  const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (uint32_t k = 0; k < K; k += 8) {
    __m256 v = ld8z(x, k, K);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    m = _mm256_max_ps(m, _mm256_and_ps(v, abs));
  }
  float l[8], amax = 0.0f;
  _mm256_storeu_ps(l, m);
  for (int i = 0; i < 8; i++) amax = l[i] > amax ? l[i] : amax;
  if (_mm256_movemask_ps(nan)) amax = NAN;
  const float scale = amax / 127.0f;
  *inv = _mm256_set1_ps(scale > 0.0f && isfinite(scale) ? 127.0f / amax : 0.0f);
  return isfinite(amax) ? scale : NAN;
}

/* 8 int32 quantized values of x[k..k+8) (zero from K on): round(x / scale) to nearest
 * even (MXCSR), |q| <= 127. */
AI __m256i quant8(const float *x, uint32_t k, uint32_t K, __m256 inv) {
  __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(ld8z(x, k, K), inv));
  return _mm256_max_epi32(_mm256_min_epi32(q, _mm256_set1_epi32(127)), _mm256_set1_epi32(-127));
}

/* 32 int8 in natural order from four vectors of 8 int32 (each within -127..127). */
AI __m256i pack32(__m256i q0, __m256i q1, __m256i q2, __m256i q3) {
  __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(q0, q1), _mm256_packs_epi32(q2, q3));
  return _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

AI int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}

/* n fp32 rows of K (row r at src + r * src_stride floats) into the activation buffer dst
 * of layout a (common_x86.h): F32EO, or int8 per token: QI8 (natural order, + xs, xsum) or
 * QI4 (per chunk of 128: the 64 even elements, then the 64 odd ones; + xs and x8[g] =
 * 8 * the sum of group g's quantized values, zero beyond the row's groups). */
static void acts_convert(const kn__x86_acts *a, uint32_t G, uint32_t n, const float *src, size_t src_stride,
                         uint8_t *dst) {
  if (a->kind == KN__ACT_F32EO) {
    kn__x86_f32eo_convert(a, n, src, src_stride, dst);
    return;
  }
  MR_ASSERT(a->kind == KN__ACT_QI8 || (a->kind == KN__ACT_QI4 && a->Kp % 128 == 0 && 128 % G == 0));
  const uint32_t K = a->K, Kp = a->Kp;
  /* even bytes of 16, then the odd ones */
  const __m128i eo = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  for (uint32_t r = 0; r < n; r++) {
    const float *x = src + (size_t)r * src_stride;
    uint8_t *row = dst + (size_t)r * a->stride;
    __m256 inv;
    const float scale = quant_scale8(x, K, &inv);
    ((float *)(dst + a->off_xs))[r] = scale;
    if (a->kind == KN__ACT_QI8) {
      __m256i sum = _mm256_setzero_si256();
      for (uint32_t k = 0; k < Kp; k += 32) {
        __m256i q0 = quant8(x, k, K, inv), q1 = quant8(x, k + 8, K, inv);
        __m256i q2 = quant8(x, k + 16, K, inv), q3 = quant8(x, k + 24, K, inv);
        sum = _mm256_add_epi32(sum, _mm256_add_epi32(_mm256_add_epi32(q0, q1), _mm256_add_epi32(q2, q3)));
        _mm256_storeu_si256((__m256i *)(row + k), pack32(q0, q1, q2, q3));
      }
      ((int32_t *)(dst + a->off_xsum))[r] = hsum_epi32(sum);
      continue;
    }
    float *x8 = (float *)(dst + a->off_x8) + (size_t)r * a->ng16;
    memset(x8, 0, a->ng16 * sizeof(float));
    for (uint32_t k = 0; k < Kp; k += 128) {
      __m256i gsum = _mm256_setzero_si256();
      for (uint32_t i = 0; i < 4; i++) { /* 32 elements k + 32 i .. + 31 */
        const uint32_t kk = k + 32 * i;
        __m256i q0 = quant8(x, kk, K, inv), q1 = quant8(x, kk + 8, K, inv);
        __m256i q2 = quant8(x, kk + 16, K, inv), q3 = quant8(x, kk + 24, K, inv);
        const __m256i b = pack32(q0, q1, q2, q3);
        const __m128i b0 = _mm_shuffle_epi8(_mm256_castsi256_si128(b), eo);
        const __m128i b1 = _mm_shuffle_epi8(_mm256_extracti128_si256(b, 1), eo);
        /* elements kk + 2j (j < 16) are even number 16 i + j of the chunk */
        _mm_storeu_si128((__m128i *)(row + k + 16 * i), _mm_unpacklo_epi64(b0, b1));
        _mm_storeu_si128((__m128i *)(row + k + 64 + 16 * i), _mm_unpackhi_epi64(b0, b1));
        gsum = _mm256_add_epi32(gsum, _mm256_add_epi32(_mm256_add_epi32(q0, q1), _mm256_add_epi32(q2, q3)));
        if ((kk + 32) % G == 0) { /* G = 32, 64 or 128: the group ends here */
          const uint32_t g = kk / G;
          if (g < a->ng) x8[g] = 8.0f * (float)hsum_epi32(gsum);
          gsum = _mm256_setzero_si256();
        }
      }
    }
  }
}

/* ---- the register tile ------------------------------------------------------------- */

typedef struct kctx {
  uint32_t K;        /* elements per weight row */
  size_t rb;         /* bytes per weight row */
  uint32_t G, ng;    /* INT4, FP8 (G = 128) */
  uint32_t gshift;   /* INT4: log2(G) (the group of element k is k >> gshift) */
  const uint8_t *xb; /* token c at xb + c * xstride: fp32 in place, or prepared */
  size_t xstride;
  const float *pre;  /* FP8 prefill: the tile's rows as fp32 weights (row r at pre + r * prestride) */
  size_t prestride;  /* floats */
  const float *xs;   /* INT8, INT4: the tokens' activation scales */
  const float *x8;   /* INT4: [token][ng16], 8 * the token's group sums */
  uint32_t ng16;
  size_t seq_pf;     /* INT8, INT4 seq tiles: prefetch distance in weight bytes, 0 = none */
} kctx;

/* The two loop orders of a tile (see moe_avx512.c, TILE_ORDER): seq = true reads the
 * tile's rows one after the other (one sequential stream, for the memory-bound few-token
 * steps), with U partial accumulators per dot product so that enough FMA chains are in
 * flight; seq = false reads all rows side by side, loading each token block once per
 * step for all rows (prefill), and prefetches into L2 the same bytes pf further on (the
 * next tile's rows; SB bytes per step, one prefetch per cache line). */
#define TILE_ORDER(SEQ, NFULL, HAS_TAIL, SB, STEP)                                               \
  do {                                                                                          \
    if (SEQ) {                                                                                  \
      const int U_ = C == 1 ? 4 : C == 2 ? 2 : 1;                                               \
      UNROLL for (int r_ = 0; r_ < RW; r_++) {                                                  \
        __m256 p_[4][4];                                                                        \
        UNROLL for (int u_ = 0; u_ < U_; u_++) UNROLL for (int c_ = 0; c_ < C; c_++) p_[u_][c_] = _mm256_setzero_ps(); \
        uint32_t s_ = 0;                                                                        \
        for (; s_ + U_ <= (NFULL); s_ += U_) UNROLL for (int u_ = 0; u_ < U_; u_++) STEP(r_, s_ + u_, false, p_[u_], 1); \
        for (; s_ < (NFULL); s_++) STEP(r_, s_, false, p_[0], 1);                              \
        if (HAS_TAIL) STEP(r_, (NFULL), true, p_[0], 1);                                        \
        UNROLL for (int c_ = 0; c_ < C; c_++) {                                                 \
          UNROLL for (int u_ = 1; u_ < U_; u_++) p_[0][c_] = _mm256_add_ps(p_[0][c_], p_[u_][c_]); \
          acc[c_ * RW + r_] = p_[0][c_];                                                        \
        }                                                                                       \
      }                                                                                         \
    } else {                                                                                    \
      for (uint32_t s_ = 0; s_ < (NFULL); s_++)                                                 \
        UNROLL for (int r_ = 0; r_ < RW; r_++) {                                                \
          if (pf && ((s_ * (SB)) & 63) == 0)                                                    \
            _mm_prefetch((const char *)w[r_] + pf + (size_t)s_ * (SB), _MM_HINT_T1);            \
          STEP(r_, s_, false, &acc[r_], RW);                                                    \
        }                                                                                       \
      if (HAS_TAIL) UNROLL for (int r_ = 0; r_ < RW; r_++) STEP(r_, (NFULL), true, &acc[r_], RW); \
    }                                                                                           \
  } while (0)

/* One step of 8 elements (F32, F16) of row wr against C tokens read in place (fp32);
 * the tail (K % 8 elements) is copied out zero-padded, and x masked. */
AI void step8(const v256 v, const int C, const uint8_t *wr, const float *const *xp, uint32_t s,
              bool tail, uint32_t rem, __m256 *a, const int st) {
  const size_t k = 8 * (size_t)s;
  __m256 wv;
  if (!tail) {
    if (v == V_F32)
      wv = _mm256_loadu_ps((const float *)wr + k);
    else
      wv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)wr + k)));
  } else if (v == V_F32) {
    wv = _mm256_maskload_ps((const float *)wr + k, lanes_lt(rem));
  } else {
    uint16_t b[8] = {0};
    memcpy(b, (const uint16_t *)wr + k, rem * 2);
    wv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b));
  }
  UNROLL for (int c = 0; c < C; c++) {
    __m256 xv = tail ? _mm256_maskload_ps(xp[c] + k, lanes_lt(rem)) : _mm256_loadu_ps(xp[c] + k);
    a[c * st] = _mm256_fmadd_ps(wv, xv, a[c * st]);
  }
}

/* One step of 16 bf16 elements against x in even/odd blocks of 16 (padded with zeros). */
AI void step_bf16(const int C, const uint8_t *wr, const float *const *xp, uint32_t s, bool tail,
                  uint32_t rem, __m256 *a, const int st) {
  const size_t k = 16 * (size_t)s;
  __m256i wv;
  if (!tail) {
    wv = _mm256_loadu_si256((const __m256i *)((const uint16_t *)wr + k));
  } else {
    uint16_t b[16] = {0};
    memcpy(b, (const uint16_t *)wr + k, rem * 2);
    wv = _mm256_loadu_si256((const __m256i *)b);
  }
  __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(wv, 16));
  __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(wv, _mm256_set1_epi32((int)0xffff0000u)));
  UNROLL for (int c = 0; c < C; c++) {
    a[c * st] = _mm256_fmadd_ps(we, _mm256_loadu_ps(xp[c] + k), a[c * st]);
    a[c * st] = _mm256_fmadd_ps(wo, _mm256_loadu_ps(xp[c] + k + 8), a[c * st]);
  }
}

/* The 16 fp8 codes at p, or the first n < 16 of them zero-padded (a row's last group). */
AI __m128i codes16(const uint8_t *p, uint32_t n) {
  if (n >= 16) return _mm_loadu_si128((const __m128i *)p);
  uint8_t b[16] = {0};
  memcpy(b, p, n);
  return _mm_loadu_si128((const __m128i *)b);
}

/* One 128-block b of fp8 row wr against C tokens in place: the codes widened to code / 256
 * (fp8_avx2.h: exact), two FMA chains per token summing the block without its scale, then
 * acc += (sum * 256) * sr[b] (the 256 exact; the scale once per block and token instead of
 * once per element: the conversion, not the memory, bounds this loop). A tail block
 * (rem = K % 128 codes) copies its last partial 16 out zero-padded and masks x. */
AI void step_fp8(const int C, const uint8_t *wr, const float *sr, const float *const *xp,
                 uint32_t b, bool tail, uint32_t rem, __m256 *a, const int st) {
  const size_t k0 = 128 * (size_t)b;
  const uint32_t nsub = tail ? (rem + 15) / 16 : 8;
  /* p[c][j]: chains j = 0, 1 for the low / high 8 codes of even sub-steps, 2, 3 of odd
   * ones when C = 1 (four chains in flight: the FMA latency, not its throughput, would
   * otherwise bound a one-token block). */
  const int J = C == 1 ? 4 : 2;
  __m256 p[4][4];
  UNROLL for (int c = 0; c < C; c++) UNROLL for (int j = 0; j < J; j++) p[c][j] = _mm256_setzero_ps();
  UNROLL for (uint32_t q = 0; q < 8; q++) {
    if (q >= nsub) break;
    const size_t k = k0 + 16 * (size_t)q;
    const uint32_t left = tail ? rem - 16 * q : 16; /* codes in this group, <= 16 */
    const __m256i h = kn__fp8x16_to_ph(codes16(wr + k, left));
    const __m256 w0 = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
    const __m256 w1 = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
    UNROLL for (int c = 0; c < C; c++) {
      __m256 x0, x1;
      if (left >= 16) {
        x0 = _mm256_loadu_ps(xp[c] + k);
        x1 = _mm256_loadu_ps(xp[c] + k + 8);
      } else {
        x0 = _mm256_maskload_ps(xp[c] + k, lanes_lt(left));
        x1 = left > 8 ? _mm256_maskload_ps(xp[c] + k + 8, lanes_lt(left - 8)) : _mm256_setzero_ps();
      }
      const int j = J == 4 ? 2 * (int)(q & 1) : 0;
      p[c][j] = _mm256_fmadd_ps(w0, x0, p[c][j]);
      p[c][j + 1] = _mm256_fmadd_ps(w1, x1, p[c][j + 1]);
    }
  }
  const __m256 sc = _mm256_set1_ps(sr[b]);
  UNROLL for (int c = 0; c < C; c++) {
    __m256 sum = _mm256_add_ps(p[c][0], p[c][1]);
    if (J == 4) sum = _mm256_add_ps(sum, _mm256_add_ps(p[c][2], p[c][3]));
    a[c * st] = _mm256_fmadd_ps(_mm256_mul_ps(sum, _mm256_set1_ps(256.0f)), sc, a[c * st]);
  }
}

/* Row wr of K fp8 codes (block scales sr) converted once into dst as the reference's fp32
 * weights (the code's exact value times its block's scale, one rounding), zero beyond K up
 * to the next multiple of 16: the prefill tiles then read the row for every token pair as
 * V_F32 instead of converting it again. */
AI void fp8_row_to_f32(const uint8_t *wr, const float *sr, uint32_t K, float *dst) {
  const uint32_t nfull = K / 16, rem = K % 16;
  for (uint32_t s = 0; s < nfull + (rem != 0); s++) {
    const size_t k = 16 * (size_t)s;
    const __m256i h = kn__fp8x16_to_ph(codes16(wr + k, s < nfull ? 16 : rem));
    const __m256 sc = _mm256_set1_ps(sr[k / KN_FP8_BLOCK]);
    _mm256_storeu_ps(dst + k, _mm256_mul_ps(kn__fp8_ph_lo(h), sc));
    _mm256_storeu_ps(dst + k + 8, _mm256_mul_ps(kn__fp8_ph_hi(h), sc));
  }
}

/* Floats between two converted rows: K rounded up to 16, one cache line more when that
 * is a multiple of 1 KiB (so that the tile's rows do not share L1 sets). */
static inline size_t fp8_pre_stride(uint32_t K) {
  size_t f = ((size_t)K + 15) / 16 * 16;
  return (f * sizeof(float)) % 1024 == 0 ? f + 16 : f;
}

/* ---- integer steps (V_I8, V_I4) --------------------------------------------------- */

/* Per int32 lane: the sum of the 4 products of u8 u and s8 s in its bytes (vpdpbusd), for
 * operands whose adjacent-pair sums fit int16 (see the top of the file). */
AI __m256i dot4(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

/* 32 int8 weights of row wr from element 32 s on; the tail (rem = K % 32) zero-padded. */
AI __m256i ld_w8(const uint8_t *wr, uint32_t s, bool tail, uint32_t rem) {
  if (!tail) return _mm256_loadu_si256((const __m256i *)(wr + 32 * (size_t)s));
  uint8_t b[32] = {0};
  memcpy(b, wr + 32 * (size_t)s, rem);
  return _mm256_loadu_si256((const __m256i *)b);
}

/* Byte offsets in a QI4 token row of the even / odd activations of int4 byte b (a
 * multiple of 16): chunk b / 64, and its elements 2 (b % 64) on are even / odd number
 * b % 64 of that chunk. */
AI size_t qi4_even(size_t b) { return b / 64 * 128 + b % 64; }

/* The int4 dot (one int32 per 8 consecutive elements) of the 32 weight bytes at wb
 * against their even and odd activations xe, xo. */
AI __m256i i4_dot32(const uint8_t *wb, const uint8_t *xe, const uint8_t *xo) {
  const __m256i m0f = _mm256_set1_epi8(0x0f);
  const __m256i u = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)wb), _mm256_set1_epi8((char)0x88));
  const __m256i lo = _mm256_and_si256(u, m0f), hi = _mm256_and_si256(_mm256_srli_epi16(u, 4), m0f);
  const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)xe)),
                                     _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)xo)));
  return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}

/* The same for the 16 bytes at wb (a row's last 16 when its bytes are not a multiple of
 * 32), in the low 4 lanes, zero above. */
AI __m256i i4_dot16(const uint8_t *wb, const uint8_t *xe, const uint8_t *xo) {
  const __m128i m0f = _mm_set1_epi8(0x0f);
  const __m128i u = _mm_xor_si128(_mm_loadu_si128((const __m128i *)wb), _mm_set1_epi8((char)0x88));
  const __m128i lo = _mm_and_si128(u, m0f), hi = _mm_and_si128(_mm_srli_epi16(u, 4), m0f);
  const __m128i p = _mm_add_epi16(_mm_maddubs_epi16(lo, _mm_loadu_si128((const __m128i *)xe)),
                                  _mm_maddubs_epi16(hi, _mm_loadu_si128((const __m128i *)xo)));
  return _mm256_inserti128_si256(_mm256_setzero_si256(), _mm_madd_epi16(p, _mm_set1_epi16(1)), 0);
}

/* The group scales of the 8 lanes of an int4 step at byte b of a row (scales sr): lane l
 * covers elements 2 b + 8 l .. + 7, so G = 32 gives two groups (lanes 0-3, 4-7) and a
 * larger G one; a 16-byte tail has one group in its 4 lanes. */
AI __m256 i4_scales(const kctx *cx, const float *sr, size_t b, bool tail) {
  const size_t g = (2 * b) >> cx->gshift;
  if (cx->G != 32 || tail) return _mm256_set1_ps(sr[g]);
  return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_set1_ps(sr[g])), _mm_set1_ps(sr[g + 1]), 1);
}

/*
 * Dot products of RW int8 / int4 weight rows w[r] (INT4 group scales at s[r]) with the
 * int8 tokens c0 .. c0 + Cv - 1 (missing tokens repeat the last one), as tile() below:
 * dot (c, r) in lane c * RW + r, times the token's scale, before the INT8 row scale; INT4
 * with its +8 offset taken off. seq: rows outer (one stream through the weights, for the
 * memory-bound few-token steps), else rows inner with each token's activations loaded
 * once per step for all rows, the next tile's rows prefetched pf bytes on.
 */
AI __m256 tile_q(const v256 v, const int RW, const int C, const bool seq, const kctx *cx,
                 const uint8_t *const *w, const float *const *s, uint32_t c0, uint32_t Cv, size_t pf) {
  const uint8_t *xp[4];
  uint32_t tok[4];
  UNROLL for (int c = 0; c < C; c++) {
    tok[c] = c0 + ((uint32_t)c < Cv ? (uint32_t)c : Cv - 1);
    xp[c] = cx->xb + (size_t)tok[c] * cx->xstride;
  }
  const uint32_t K = cx->K;
  __m256 acc[8];
  if (v == V_I8) {
    const uint32_t nfull = K / 32, rem = K % 32;
    __m256i ai[8];
    UNROLL for (int i = 0; i < 8; i++) ai[i] = _mm256_setzero_si256();
    if (seq) {
      UNROLL for (int r = 0; r < RW; r++) {
        for (uint32_t st = 0; st < nfull + (rem != 0); st++) {
          if (cx->seq_pf && (st & 1) == 0) _mm_prefetch((const char *)w[r] + cx->seq_pf + 32 * (size_t)st, _MM_HINT_T0);
          const __m256i wv = ld_w8(w[r], st, st == nfull, rem), aw = _mm256_abs_epi8(wv);
          UNROLL for (int c = 0; c < C; c++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(xp[c] + 32 * (size_t)st));
            ai[c * RW + r] = _mm256_add_epi32(ai[c * RW + r], dot4(aw, _mm256_sign_epi8(xv, wv)));
          }
        }
      }
    } else {
      for (uint32_t st = 0; st < nfull + (rem != 0); st++) {
        __m256i xv[4];
        UNROLL for (int c = 0; c < C; c++) xv[c] = _mm256_loadu_si256((const __m256i *)(xp[c] + 32 * (size_t)st));
        UNROLL for (int r = 0; r < RW; r++) {
          if (pf && ((st * 32) & 63) == 0) _mm_prefetch((const char *)w[r] + pf + (size_t)st * 32, _MM_HINT_T1);
          const __m256i wv = ld_w8(w[r], st, st == nfull, rem), aw = _mm256_abs_epi8(wv);
          UNROLL for (int c = 0; c < C; c++)
            ai[c * RW + r] = _mm256_add_epi32(ai[c * RW + r], dot4(aw, _mm256_sign_epi8(xv[c], wv)));
        }
      }
    }
    UNROLL for (int i = 0; i < 8; i++) acc[i] = _mm256_cvtepi32_ps(ai[i]); /* |sum| < 2^31 for K <= 65536 */
  } else {
    const size_t nb = cx->rb / 32;       /* whole 32-byte steps of a row */
    const bool tail16 = cx->rb % 32 != 0; /* and a last 16 bytes */
    UNROLL for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
    if (seq) {
      UNROLL for (int r = 0; r < RW; r++) {
        __m256 p[4][2];
        UNROLL for (int c = 0; c < C; c++) p[c][0] = p[c][1] = _mm256_setzero_ps();
        /* two accumulators per token, alternating steps (the FMA latency) */
        for (size_t st = 0; st < nb; st += 2) {
          if (cx->seq_pf) _mm_prefetch((const char *)w[r] + cx->seq_pf + 32 * st, _MM_HINT_T0);
          UNROLL for (int u = 0; u < 2; u++) {
            if (u == 1 && st + 1 == nb) break;
            const size_t b = 32 * (st + (size_t)u), xe = qi4_even(b);
            const __m256 sv = i4_scales(cx, s[r], b, false);
            UNROLL for (int c = 0; c < C; c++) {
              const __m256i d = i4_dot32(w[r] + b, xp[c] + xe, xp[c] + xe + 64);
              p[c][u] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), sv, p[c][u]);
            }
          }
        }
        if (tail16) {
          const size_t b = 32 * nb, xe = qi4_even(b);
          const __m256 sv = i4_scales(cx, s[r], b, true);
          UNROLL for (int c = 0; c < C; c++) {
            const __m256i d = i4_dot16(w[r] + b, xp[c] + xe, xp[c] + xe + 64);
            p[c][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), sv, p[c][0]);
          }
        }
        UNROLL for (int c = 0; c < C; c++) acc[c * RW + r] = _mm256_add_ps(p[c][0], p[c][1]);
      }
    } else {
      for (size_t st = 0; st < nb + tail16; st++) {
        const size_t b = 32 * st, xe = qi4_even(b);
        const bool tl = st == nb;
        UNROLL for (int r = 0; r < RW; r++) {
          if (pf && (b & 63) == 0) _mm_prefetch((const char *)w[r] + pf + b, _MM_HINT_T1);
          const __m256 sv = i4_scales(cx, s[r], b, tl);
          UNROLL for (int c = 0; c < C; c++) {
            const __m256i d = tl ? i4_dot16(w[r] + b, xp[c] + xe, xp[c] + xe + 64)
                                 : i4_dot32(w[r] + b, xp[c] + xe, xp[c] + xe + 64);
            acc[c * RW + r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), sv, acc[c * RW + r]);
          }
        }
      }
    }
    /* The +8 offset: minus sum over groups of s_g * x8_g, lane-wise (x8 is zero beyond ng,
     * the scales are masked there; the lanes are summed below anyway). */
    for (uint32_t g = 0; g < cx->ng; g += 8) {
      const __m256i m = lanes_lt(cx->ng - g);
      UNROLL for (int r = 0; r < RW; r++) {
        const __m256 sv = _mm256_maskload_ps(s[r] + g, m);
        UNROLL for (int c = 0; c < C; c++)
          acc[c * RW + r] = _mm256_fnmadd_ps(sv, _mm256_loadu_ps(cx->x8 + (size_t)tok[c] * cx->ng16 + g), acc[c * RW + r]);
      }
    }
  }
  float xs[8];
  for (int i = 0; i < 8; i++) xs[i] = cx->xs[tok[i / RW < C ? i / RW : C - 1]];
  return _mm256_mul_ps(hsum8_ps(acc), _mm256_loadu_ps(xs));
}

/*
 * Dot products of RW weight rows w[r] (INT4 group scales at s[r]) with the tokens c0 ..
 * c0 + Cv - 1 (Cv <= C; missing tokens repeat the last one and are ignored by the caller).
 * Returns dot (c, r) in lane c * RW + r, before the INT8 row scale. RW * C <= 8.
 */
AI __m256 tile(const v256 v, const int RW, const int C, const bool seq, const kctx *cx,
               const uint8_t *const *w, const float *const *s, uint32_t c0, uint32_t Cv, size_t pf) {
  if (v == V_I8 || v == V_I4) return tile_q(v, RW, C, seq, cx, w, s, c0, Cv, pf);
  const float *xp[4];
  UNROLL for (int c = 0; c < C; c++)
    xp[c] = (const float *)(cx->xb + (size_t)(c0 + ((uint32_t)c < Cv ? (uint32_t)c : Cv - 1)) * cx->xstride);
  const uint32_t K = cx->K;
  __m256 acc[8];
  UNROLL for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
  if (v == V_F32 || v == V_F16) {
#define STEP(r, st_, tail, a, stride) step8(v, C, w[r], xp, st_, tail, K % 8, a, stride)
    TILE_ORDER(seq, K / 8, K % 8 != 0, v == V_F32 ? 32 : v == V_F16 ? 16 : 8, STEP);
#undef STEP
  } else if (v == V_BF16) {
#define STEP(r, st_, tail, a, stride) step_bf16(C, w[r], xp, st_, tail, K % 16, a, stride)
    TILE_ORDER(seq, K / 16, K % 16 != 0, 32, STEP);
#undef STEP
  } else {
#define STEP(r, st_, tail, a, stride) step_fp8(C, w[r], s[r], xp, st_, tail, K % KN_FP8_BLOCK, a, stride)
    TILE_ORDER(seq, K / KN_FP8_BLOCK, K % KN_FP8_BLOCK != 0, KN_FP8_BLOCK, STEP);
#undef STEP
  }
  return hsum8_ps(acc);
}

/* INT8 row scales in lanes c * RW + r (rows from two arrays for gate_up). */
AI __m256 row_scales(const int RW, const int R, const float *a, const float *b, uint32_t Rv) {
  float sc[8] = {0};
  for (int c = 0; c < 8 / RW; c++)
    for (uint32_t r = 0; r < Rv; r++) {
      sc[c * RW + (int)r] = a[r];
      if (b) sc[c * RW + R + (int)r] = b[r];
    }
  return _mm256_loadu_ps(sc);
}

/* ---- gate_up and down drivers ------------------------------------------------------ */

/* Rows [i, i + R) of gate and up paired in one tile, tokens c0 .. c0 + Cv - 1. pre (FP8
 * prefill): the R gate rows then the R up rows are already fp32 weights in cx->pre. */
AI void gu_block(const v256 v, const bool pre, const int R, const int C, const kn__task *t, const kctx *cx,
                 uint32_t i, uint32_t i_end, uint32_t c0, uint32_t Cv) {
  const kn__slice_w *ws = t->w;
  const uint32_t Rv = i_end - i < (uint32_t)R ? i_end - i : (uint32_t)R;
  const uint32_t Is = t->L->slice_len[t->slice];
  const uint8_t *w[8];
  const float *s[8];
  UNROLL for (int r = 0; r < R; r++) {
    uint32_t row = i + ((uint32_t)r < Rv ? (uint32_t)r : Rv - 1);
    if (pre) {
      w[r] = (const uint8_t *)(cx->pre + (size_t)r * cx->prestride);
      w[R + r] = (const uint8_t *)(cx->pre + (size_t)(R + r) * cx->prestride);
      continue;
    }
    w[r] = (const uint8_t *)ws->gate + row * cx->rb;
    w[R + r] = (const uint8_t *)ws->up + row * cx->rb;
    if (v == V_I4 || v == V_FP8) {
      s[r] = ws->gate_scale + (size_t)row * cx->ng;
      s[R + r] = ws->up_scale + (size_t)row * cx->ng;
    }
  }
  __m256 d = pre ? tile(V_F32, 2 * R, C, false, cx, w, s, c0, Cv, 0)
                 : tile(v, 2 * R, C, false, cx, w, s, c0, Cv, c0 == 0 ? R * cx->rb : 0);
  if (v == V_I8) d = _mm256_mul_ps(d, row_scales(2 * R, R, ws->gate_scale + i, ws->up_scale + i, Rv));
  __m256 hv = _mm256_mul_ps(silu_ps(d), rot_ps(d, R));
  const __m256i m = lanes_lt(Rv);
  UNROLL for (int c = 0; c < C; c++)
    if ((uint32_t)c < Cv) _mm256_maskstore_ps(t->h + (size_t)(c0 + c) * Is + i, m, rot_ps(hv, c * 2 * R));
}

typedef enum epi { EP_STORE, EP_SILU_MUL } epi;

/* Rows [row, row + RW) of one matrix for tokens c0 .. c0 + Cv - 1: EP_STORE writes the dot
 * products, EP_SILU_MUL turns the gate values of a first pass into silu(gate) * dot. pre
 * (FP8 prefill): the RW rows are already fp32 weights in cx->pre. */
AI void mat_block(const v256 v, const bool pre, const int RW, const int C, const bool seq, const epi ep,
                  const kctx *cx, const uint8_t *base, const float *scale, uint32_t row,
                  uint32_t row_end, uint32_t c0, uint32_t Cv, float *out, size_t out_stride) {
  const uint32_t Rv = row_end - row < (uint32_t)RW ? row_end - row : (uint32_t)RW;
  const uint8_t *w[8];
  const float *s[8];
  UNROLL for (int r = 0; r < RW; r++) {
    uint32_t rr = row + ((uint32_t)r < Rv ? (uint32_t)r : Rv - 1);
    w[r] = pre ? (const uint8_t *)(cx->pre + (size_t)r * cx->prestride) : base + rr * cx->rb;
    if (!pre && (v == V_I4 || v == V_FP8)) s[r] = scale + (size_t)rr * cx->ng;
  }
  __m256 d = pre ? tile(V_F32, RW, C, seq, cx, w, s, c0, Cv, 0)
                 : tile(v, RW, C, seq, cx, w, s, c0, Cv, !seq && c0 == 0 ? RW * cx->rb : 0);
  if (v == V_I8) d = _mm256_mul_ps(d, row_scales(RW, RW, scale + row, NULL, Rv));
  const __m256i m = lanes_lt(Rv);
  UNROLL for (int c = 0; c < C; c++)
    if ((uint32_t)c < Cv) {
      float *dst = out + (size_t)(c0 + c) * out_stride + row;
      __m256 val = rot_ps(d, c * RW);
      if (ep == EP_SILU_MUL) val = _mm256_mul_ps(silu_ps(_mm256_maskload_ps(dst, m)), val);
      _mm256_maskstore_ps(dst, m, val);
    }
}

/* The integer seq tiles (1-4 tokens per expert) prefetch their one stream this far ahead:
 * their loop asks for the next lines too late for the hardware prefetchers to cover. Zen 3
 * (2 vCPUs, qwen3 shapes, T = 1, one thread, 2026-12-06): int8 read at 0.72-0.73 of a
 * plain read without, 0.76 at 512 B, 0.78 at 1 KiB, 0.93-0.95 at 2 KiB; int4 0.69-0.73,
 * 0.74-0.76, 0.85-0.89, 0.86-0.89. bf16 did not gain (already at the rate of a read) and
 * fp8 little (0.56 -> 0.60-0.66: its conversion bounds it), so they prefetch nothing. */
#define SEQ_PF_BYTES 2048

static kctx ctx_make(const v256 v, const kn_layer *L, uint32_t K, const void *acts,
                     const float *xf, size_t xf_stride, uint32_t n) {
  kctx cx;
  memset(&cx, 0, sizeof cx);
  cx.K = K;
  cx.G = v == V_FP8 ? KN_FP8_BLOCK : L->d.group; /* fp8-b128's blocks, whatever d.group says */
  cx.rb = kn__row_bytes(L->d.format, K, cx.G);
  if (v == V_I4 || v == V_FP8) cx.ng = kn__ngroups(K, cx.G);
  if (v == V_I4) cx.gshift = cx.G == 32 ? 5 : cx.G == 64 ? 6 : 7;
  if (v == V_I8 || v == V_I4) cx.seq_pf = SEQ_PF_BYTES;
  if (act_kind[v] == KN__ACT_NONE) {
    cx.xb = (const uint8_t *)xf;
    cx.xstride = xf_stride * sizeof(float);
  } else {
    const kn__x86_acts a = acts_layout(v, K, cx.G, n);
    cx.xb = acts;
    cx.xstride = a.stride;
    if (v == V_I8 || v == V_I4) cx.xs = (const float *)((const uint8_t *)acts + a.off_xs);
    if (v == V_I4) {
      cx.x8 = (const float *)((const uint8_t *)acts + a.off_x8);
      cx.ng16 = a.ng16;
    }
  }
  return cx;
}

/* Up to this many tokens per expert (fp8: below FP8_PRE_MIN_TOKENS): sequential tiles
 * (see TILE_ORDER); gate_up in two passes over gate then up. */
#define SEQ_MAX_TOKENS 4
/* FP8 below this many tokens per expert runs the sequential tiles (rows outer), 2 rows by
 * up to 4 tokens per pass, converting the codes in registers once per 4 tokens
 * (step_fp8); from it, the tile's rows are converted once into fp32 weights in tmp
 * (fp8_row_to_f32) and every token pair reads them from there. Measured on DeepSeek-V3
 * shapes (Zen 4, 2026-12-05, n tokens per expert): the passes of 4 were 16-18 % faster at
 * n = 6-8, 10-15 % at 12 and even at 16-24; the converted rows 14 % faster at 32 and 31 %
 * at 64, and 20 % faster for a dense linear of K = 16384 in its 16-token tiles (5-10 %
 * slower there at K = 7168). Rows converted to bf16 pairs instead (half the cache traffic)
 * were 10-15 % slower than fp32 at 32-64: the shift and mask per 16 values cost more than
 * the extra loads. */
#define FP8_PRE_MIN_TOKENS 16

/* All rows [r0, r1) of one matrix with sequential tiles. */
AI void mat_rows_seq(const v256 v, const epi ep, const kctx *cx, uint32_t n, const uint8_t *base,
                     const float *scale, uint32_t r0, uint32_t r1, float *out, size_t out_stride) {
  if (n == 1) {
    for (uint32_t r = r0; r < r1; r += 8) mat_block(v, false, 8, 1, true, ep, cx, base, scale, r, r1, 0, 1, out, out_stride);
    return;
  }
  if (v == V_FP8) { /* pairs of rows, up to 4 tokens per pass: the codes converted once per 4 */
    for (uint32_t r = r0; r < r1; r += 2) {
      uint32_t c0 = 0;
      for (; c0 + 3 <= n; c0 += 4)
        mat_block(v, false, 2, 4, true, ep, cx, base, scale, r, r1, c0, n - c0 < 4 ? n - c0 : 4, out, out_stride);
      if (c0 + 2 == n) mat_block(v, false, 2, 2, true, ep, cx, base, scale, r, r1, c0, 2, out, out_stride);
      if (c0 + 1 == n) mat_block(v, false, 2, 1, true, ep, cx, base, scale, r, r1, c0, 1, out, out_stride);
    }
    return;
  }
  for (uint32_t r = r0; r < r1; r += 4) {
    uint32_t c0 = 0;
    for (; c0 + 2 <= n; c0 += 2) mat_block(v, false, 4, 2, true, ep, cx, base, scale, r, r1, c0, 2, out, out_stride);
    if (c0 < n) mat_block(v, false, 4, 1, true, ep, cx, base, scale, r, r1, c0, 1, out, out_stride);
  }
}

AI void gate_up_run(const v256 v, const kn__task *t, uint32_t i0, uint32_t i1) {
  const kn_layer *L = t->L;
  const uint32_t n = t->n, H = L->d.hidden, Is = L->slice_len[t->slice];
  if (n == 0 || i0 >= i1) return;
  kctx cx = ctx_make(v, L, H, t->xq, t->x, H, n);
  if (n <= SEQ_MAX_TOKENS || (v == V_FP8 && n < FP8_PRE_MIN_TOKENS)) {
    const kn__slice_w *ws = t->w;
    mat_rows_seq(v, EP_STORE, &cx, n, ws->gate, ws->gate_scale, i0, i1, t->h, Is);
    mat_rows_seq(v, EP_SILU_MUL, &cx, n, ws->up, ws->up_scale, i0, i1, t->h, Is);
    return;
  }
  if (v == V_FP8) {
    /* Prefill (n >= FP8_PRE_MIN_TOKENS here): the tile's 2 gate and 2 up rows converted to
     * fp32 weights once (into tmp, which gate_up does not otherwise use), then read by
     * every token pair. */
    const kn__slice_w *ws = t->w;
    float *buf = t->tmp;
    cx.prestride = fp8_pre_stride(H);
    cx.pre = buf;
    for (uint32_t i = i0; i < i1; i += 2) {
      for (uint32_t r = 0; r < 2; r++) {
        const uint32_t row = i + r < i1 ? i + r : i1 - 1;
        fp8_row_to_f32((const uint8_t *)ws->gate + row * cx.rb, ws->gate_scale + (size_t)row * cx.ng, H,
                       buf + r * cx.prestride);
        fp8_row_to_f32((const uint8_t *)ws->up + row * cx.rb, ws->up_scale + (size_t)row * cx.ng, H,
                       buf + (2 + r) * cx.prestride);
      }
      uint32_t c0 = 0;
      for (; c0 + 2 <= n; c0 += 2) gu_block(v, true, 2, 2, t, &cx, i, i1, c0, 2);
      if (c0 < n) gu_block(v, true, 2, 1, t, &cx, i, i1, c0, 1);
    }
    return;
  }
  for (uint32_t i = i0; i < i1; i += 2) {
    uint32_t c0 = 0;
    for (; c0 + 2 <= n; c0 += 2) gu_block(v, false, 2, 2, t, &cx, i, i1, c0, 2);
    if (c0 < n) gu_block(v, false, 2, 1, t, &cx, i, i1, c0, 1);
  }
}

AI void down_run(const v256 v, const kn__task *t, uint32_t j0, uint32_t j1) {
  const kn_layer *L = t->L;
  const uint32_t n = t->n, Is = L->slice_len[t->slice], H = L->d.hidden;
  if (n == 0 || j0 >= j1) return;
  const void *acts = NULL;
  if (act_kind[v] != KN__ACT_NONE) { /* into this call's own tmp (see the top of the file) */
    kn__x86_acts a = acts_layout(v, Is, L->d.group, n);
    acts_convert(&a, L->d.group, n, t->h, Is, (uint8_t *)t->tmp);
    acts = t->tmp;
  }
  kctx cx = ctx_make(v, L, Is, acts, t->h, Is, n);
  const kn__slice_w *ws = t->w;
  if (n <= SEQ_MAX_TOKENS || (v == V_FP8 && n < FP8_PRE_MIN_TOKENS)) {
    mat_rows_seq(v, EP_STORE, &cx, n, ws->down, ws->down_scale, j0, j1, t->y, H);
    return;
  }
  if (v == V_FP8) { /* prefill (n >= FP8_PRE_MIN_TOKENS here): 4 rows converted once into tmp */
    cx.prestride = fp8_pre_stride(Is);
    cx.pre = t->tmp;
    for (uint32_t j = j0; j < j1; j += 4) {
      for (uint32_t r = 0; r < 4; r++) {
        const uint32_t row = j + r < j1 ? j + r : j1 - 1;
        fp8_row_to_f32((const uint8_t *)ws->down + row * cx.rb, ws->down_scale + (size_t)row * cx.ng, Is,
                       t->tmp + r * cx.prestride);
      }
      uint32_t c0 = 0;
      for (; c0 + 2 <= n; c0 += 2) mat_block(v, true, 4, 2, false, EP_STORE, &cx, NULL, NULL, j, j1, c0, 2, t->y, H);
      if (c0 < n) mat_block(v, true, 4, 1, false, EP_STORE, &cx, NULL, NULL, j, j1, c0, 1, t->y, H);
    }
    return;
  }
  for (uint32_t j = j0; j < j1; j += 4) {
    uint32_t c0 = 0;
    for (; c0 + 2 <= n; c0 += 2) mat_block(v, false, 4, 2, false, EP_STORE, &cx, ws->down, ws->down_scale, j, j1, c0, 2, t->y, H);
    if (c0 < n) mat_block(v, false, 4, 1, false, EP_STORE, &cx, ws->down, ws->down_scale, j, j1, c0, 1, t->y, H);
  }
}

/* ---- kernel-table entries ---------------------------------------------------------- */

static size_t prep_bytes_of(const v256 v, const kn_layer *L, uint32_t n) {
  return acts_layout(v, L->d.hidden, L->d.group, n).bytes;
}
static size_t tmp_floats_of(const v256 v, const kn_layer *L, uint32_t slice, uint32_t n) {
  if (v == V_FP8) { /* the prefill's converted rows: 4 of gate/up, or 4 of down (whatever n) */
    const size_t g = 4 * fp8_pre_stride(L->d.hidden), d = 4 * fp8_pre_stride(L->slice_len[slice]);
    return g > d ? g : d;
  }
  return kn__x86_floats_for(acts_layout(v, L->slice_len[slice], L->d.group, n).bytes);
}
static void prep_of(const v256 v, const kn_layer *L, uint32_t n, const float *x, void *xq) {
  kn__x86_acts a = acts_layout(v, L->d.hidden, L->d.group, n);
  acts_convert(&a, L->d.group, n, x, L->d.hidden, xq);
}


KN__X86_ENTRY(V_F32, f32)
KN__X86_ENTRY(V_F16, f16)
KN__X86_ENTRY(V_BF16, bf16)
KN__X86_ENTRY(V_I8, i8)
KN__X86_ENTRY(V_I4, i4)
KN__X86_ENTRY(V_FP8, fp8)


void kn__avx2_register(kn__kernel_table *t) {
  t->k[KN_FMT_F32][KN_ISA_AVX2] = KN__X86_KERNEL(f32, false, "avx2_f32_f32", KN__RND_F32);
  t->k[KN_FMT_F16][KN_ISA_AVX2] = KN__X86_KERNEL(f16, false, "avx2_f16_f32", KN__RND_F32);
  t->k[KN_FMT_BF16][KN_ISA_AVX2] = KN__X86_KERNEL(bf16, true, "avx2_bf16_f32", KN__RND_F32);
  t->k[KN_FMT_INT8][KN_ISA_AVX2] = KN__X86_KERNEL(i8, true, "avx2_int8_int8", KN__RND_Q8);
  t->k[KN_FMT_INT4][KN_ISA_AVX2] = KN__X86_KERNEL(i4, true, "avx2_int4_int8", KN__RND_Q8);
  t->k[KN_FMT_FP8][KN_ISA_AVX2] = KN__X86_KERNEL(fp8, false, "avx2_fp8_f32", KN__RND_F32);
}
