/*
 * moe_avx512.c - the AVX-512 entries of the kernel table (internal.h section C), compiled
 * with the AVX-512 flags of the Makefile only (F/BW/VL/DQ + BF16 + VNNI + VBMI + FMA + F16C);
 * the registration checks BF16, VNNI and VBMI at run time and leaves out what the CPU lacks.
 *
 * Every step is a set of dot products between packed weight rows (canonical layout,
 * internal.h section A: row-major, K contiguous) and the n token vectors of the expert:
 *
 *   gate_up:  h[c, i] = silu(gate[i] . x[c]) * (up[i] . x[c])      rows i of [i0, i1)
 *   down:     y[c, j] = down[j] . h[c]                              rows j of [j0, j1)
 *
 * One register tile computes RW weight rows x C tokens (RW * C <= 16 accumulators).
 * Accumulator (c, r) is a 16-lane partial sum; at the end the RW * C accumulators are
 * reduced together by one transposing tree (hsum16), which leaves dot (c, r) in lane
 * c * RW + r of one vector (silu, scales and the stores then work on whole vectors):
 *
 *            K  ->  (one zmm of weights per row and step)
 *   row 0   [====|====|====| ... ]      acc[c*RW + r] += w[r, k:k+s] (.) x[c, k:k+s]
 *   ...                                   ...
 *   row RW-1[====|====|====| ... ]      lanes of hsum16(acc): [c0 r0..r(RW-1) | c1 r0.. | ...]
 *
 * Two loop orders (TILE_ORDER), chosen by the tokens per expert n of the step:
 *   - n <= seq_max_tokens (2 bf16 / 4 int8, decode): rows outer, K inner: the tile reads its
 *     rows one after another, one sequential stream through the weights, because this
 *     machine's prefetchers lose much of the bandwidth on short rows read side by side
 *     (10-19 GB/s instead of 24 for one core with 1-2 KiB rows, tests/bench/README.md,
 *     `moerpc-bench-kernels --streams`). Each weight byte is loaded once per call; the
 *     C token blocks are re-read from L1 per row. Tiles: n = 1:
 *     16 rows x 1 token, n = 2: 8 x 2, else 4 x 4 (+ one tile of the 1..3 rest). gate_up
 *     runs as two passes (gate . x into h, then h = silu(h) * (up . x)), so that each pass
 *     is one stream too.
 *   - larger n (prefill, compute-bound): K outer, rows inner: per step each of the RW
 *     rows and each of the C token blocks is loaded once (RW + C loads for RW * C
 *     multiplies). gate_up pairs R gate rows with the same R up rows in one tile
 *     (RW = 2R = 4, C = 4), so that silu(gate) * up is a lane rotation by R away. Rows are
 *     outer and token blocks inner, so the 4 rows (<= 16 KiB) stay in L1 while all token
 *     blocks pass and x streams from L2; the first token block prefetches the next
 *     tile's rows into L2, which hides the slow side-by-side DRAM reads behind compute.
 *
 * Per format (weights_activations):
 *   f32_f32    fp32 FMA; x read in place.
 *   f16_f32    vcvtph2ps then fp32 FMA; x read in place.
 *   bf16_bf16  vdpbf16ps (AVX512_BF16): x rounded to bf16 once per token (prep), h once per
 *              down call. Chosen over bf16_f32 on CPUs that have both: 1.8x faster from 4
 *              tokens per expert up (one core, qwen3 expert: 184 vs 103 GFLOP/s at 64
 *              tokens), equal when memory-bound (1 token: 33 vs 32 GB/s); the bf16
 *              rounding of x and h costs 1e-3 .. 4e-3 relative L2 per layer against the
 *              reference (tests/unit/test_kn_fast.c), within the 1e-2 bf16 budget.
 *   bf16_f32   (CPUs without AVX512_BF16) bf16 -> fp32 by shift/mask in registers: the even
 *              elements of a 32-element block are (dword << 16), the odd ones
 *              (dword & 0xffff0000); x is prepared as fp32 in the matching order (per block
 *              of 32: 16 even, 16 odd), so the math is exact fp32 like the reference.
 *   int8_int8  vpdpbusd (AVX512_VNNI) multiplies u8 x s8. Zen 4 has no vpdpbssd, so the
 *              weights take the unsigned side with an offset: w + 128 = w ^ 0x80, and the
 *              activations (quantized per token, dynamic symmetric amax/127) the signed
 *              side. sum (w + 128) x = sum w x + 128 sum x: the correction 128 * sum(xq)
 *              depends on the token only and is computed once in prep, not per row.
 *              y = w_scale[row] * x_scale[tok] * (acc - 128 * xsum[tok]), in int32 until
 *              the final convert (|acc| < 2^31 for K <= 65536, see tile()). The 8-bit
 *              activations cost 1.0e-2 .. 2.2e-2 relative L2 per layer against the
 *              reference, mostly from h (silu(g) * u has heavy tails, so amax / 127 is
 *              coarse); 2.1e-2 against the fp32 model, within docs/DESIGN.md's 2.5e-2.
 *   int4_int8  the same offset trick per nibble: byte ^ 0x88 turns both two's-complement
 *              nibbles v into v + 8 in 0..15, so lo = b & 0xf, hi = (b >> 4) & 0xf are the
 *              u8 operands of vpdpbusd directly (no sign extension, no LUT). lo holds the
 *              even elements of a 128-element chunk and hi the odd ones, so the activations
 *              are prepared per chunk as 64 even then 64 odd int8 values. One chunk gives
 *              an int32 per lane for 8 consecutive elements, all in one group (G >= 32):
 *              it is converted and multiplied by that lane's group scale in fp32. The +8
 *              offset is removed at the end: sum_g s_g * 8 * X_g with X_g the group sums of
 *              the token (prep), folded lane-wise into the same accumulators (ng / 16 FMAs
 *              per output instead of one subtraction per chunk). The per-group fp32 step
 *              (vcvtdq2ps + vfmaddps for every 2 vpdpbusd) bounds prefill at ~45% of the
 *              vpdpbusd peak, against ~65% for int8 (docs/BENCHMARKS.md).
 *
 *   fp8_bf16   (fp8-b128, AVX512_BF16) e4m3 codes converted to bf16 in registers, exactly
 *              (fp8_lut64: vpermi2b tables, needs VBMI, the default; fp8_shift32: exponent
 *              bias shift/add with a masked table for the subnormals, BW only), then
 *              vdpbf16ps against bf16 x / h per 128-element block into a fresh sum that the
 *              block scale multiplies into the accumulator. Decode converts in the
 *              sequential tiles; prefill converts each tile's rows once into tmp
 *              (fp8_row_to_bf16) and runs the tile over every token block from there.
 *              The LUT order of the converted words (per 128-bit lane: elements 0-7 then
 *              8-15) is matched by preparing x as KN__ACT_BF16P.
 *
 * Threads: gate_up and down may run concurrently on disjoint row ranges of the same task.
 * They read the weights, t->x / t->xq (prepared once per task by prep) and t->h; they write
 * only their own rows of h / y, and down converts h into t->tmp, which must therefore be
 * private to the calling thread (tmp_floats(L, s, n) floats per thread; see the fast-path
 * block of internal.h). Nothing is kept between calls.
 */
#include "kernels/x86/common_x86.h"

#include <immintrin.h>
#include <pthread.h>
#include <string.h>

#define AI static inline __attribute__((always_inline))
#define UNROLL _Pragma("GCC unroll 16")

/* The kernel variants of this file. */
typedef enum v512 { V_F32, V_F16, V_BF16DP, V_BF16F32, V_I8, V_I4, V_FP8L, V_FP8S, V_COUNT } v512;
#define IS_FP8(v) ((v) == V_FP8L || (v) == V_FP8S)

/* Activation kind of each variant and its padding (the step of the K loop), which is also
 * the even/odd block of F32EO and QI4. */
static const kn__x86_act_kind act_kind[V_COUNT] = {KN__ACT_NONE, KN__ACT_NONE, KN__ACT_BF16,
                                                    KN__ACT_F32EO, KN__ACT_QI8, KN__ACT_QI4,
                                                    KN__ACT_BF16P, KN__ACT_BF16};
static const uint32_t act_quantum[V_COUNT] = {16, 16, 32, 32, 64, 128, 128, 128};

static kn__x86_acts acts_layout(const v512 v, uint32_t K, uint32_t G, uint32_t n) {
  return kn__x86_acts_layout(act_kind[v], K, act_quantum[v], act_quantum[v], G, n);
}

/* ---- small vector helpers ---------------------------------------------------------- */

static inline __m512i iota16(void) {
  return _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
}

/* Lane l of the result is lane (l + s) mod 16 of v. */
AI __m512 rot_ps(__m512 v, int s) {
  __m512i idx = _mm512_and_si512(_mm512_add_epi32(iota16(), _mm512_set1_epi32(s)), _mm512_set1_epi32(15));
  return _mm512_permutexvar_ps(idx, v);
}

/* Lane i of the result = the sum of the 16 lanes of v[i]. A transposing tree: 45
 * shuffles/adds for 16 sums instead of ~8 per sum for separate reductions. */
AI __m512 hsum16_ps(const __m512 *v) {
  __m512 a[8], b[4];
  UNROLL for (int i = 0; i < 8; i++)
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  /* a[i], per 128-bit block: [v2i.e, v2i+1.e, v2i.o, v2i+1.o] (two half sums each) */
  UNROLL for (int i = 0; i < 4; i++) {
    __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(a[2 * i]), _mm512_castps_pd(a[2 * i + 1]));
    __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(a[2 * i]), _mm512_castps_pd(a[2 * i + 1]));
    b[i] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
  }
  /* b[i], per 128-bit block B: the sums over B of v4i .. v4i+3. Now add the 4 blocks. */
  __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(2, 0, 2, 0)),
                            _mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(3, 1, 3, 1)));
  __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(2, 0, 2, 0)),
                            _mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(d0, d1, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* The same in int32 (exact). */
AI __m512i hsum16_epi32(const __m512i *v) {
  __m512i a[8], b[4];
  UNROLL for (int i = 0; i < 8; i++)
    a[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]),
                            _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
  UNROLL for (int i = 0; i < 4; i++)
    b[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(a[2 * i], a[2 * i + 1]),
                            _mm512_unpackhi_epi64(a[2 * i], a[2 * i + 1]));
  __m512i d0 = _mm512_add_epi32(_mm512_shuffle_i32x4(b[0], b[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                _mm512_shuffle_i32x4(b[0], b[1], _MM_SHUFFLE(3, 1, 3, 1)));
  __m512i d1 = _mm512_add_epi32(_mm512_shuffle_i32x4(b[2], b[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                _mm512_shuffle_i32x4(b[2], b[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_epi32(_mm512_shuffle_i32x4(d0, d1, _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_i32x4(d0, d1, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* exp_ps (exp to ~1 ulp, inf above ~88.7 and 0 below ~-104 like expf, NaN kept) and
 * silu_ps (like kn__silu): shared with the AMX kernels. */
#include "kernels/x86/avx512_math.h"

/* acc += sum over 4 bytes of a (u8) * b (s8), per int32 lane: vpdpbusd. Written as asm
 * because GCC 12 compiles _mm512_dpbusd_epi32 with a register copy of the accumulator per
 * call (and spills in a 16-accumulator tile), which halved the int8 tile's speed. */
AI __m512i dpbusd(__m512i acc, __m512i a, __m512i b) {
  __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "vm"(b));
  return acc;
}

static inline __mmask16 mask16(uint32_t n) { return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1); }
static inline __mmask32 mask32(uint32_t n) { return n >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << n) - 1); }
static inline __mmask64 mask64(uint32_t n) { return n >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << n) - 1); }

/* ---- activation preparation -------------------------------------------------------- */

/* Converts n rows of K values (src: where they are, of which dtype, dt the same) into the
 * activation buffer `dst` of layout a (common_x86.h), in the element order of kind. */
AI void acts_convert_dt(const kn__x86_acts *a, uint32_t G, uint32_t n, const kn__rows *src, const mr_dtype dt,
                        uint8_t *dst) {
  const uint32_t K = a->K, Kp = a->Kp;
  MR_ASSERT(a->kind != KN__ACT_F32EO || a->block == 32);
  MR_ASSERT(a->kind != KN__ACT_QI4 || a->block == 128);
  MR_ASSERT(a->kind != KN__ACT_BF16P || a->Kp % 64 == 0);
  for (uint32_t r = 0; r < n; r++) {
    const void *x = src->base + (size_t)(src->tok ? src->tok[r] : r) * src->stride;
    uint8_t *row = dst + (size_t)r * a->stride;
    switch (a->kind) {
      case KN__ACT_BF16:
        for (uint32_t k = 0; k < Kp; k += 32) {
          __m512 lo = kn__ld16(x, dt, k, K), hi = kn__ld16(x, dt, k + 16, K);
          _mm512_storeu_si512(row + 2 * (size_t)k, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
        break;
      case KN__ACT_BF16P: {
        /* Natural bf16 of 64 elements (n0: 0..31, n1: 32..63), then the unpack order: word
         * i of the first vector is element 16 (i / 8) + i % 8, of the second that + 8. */
        __m512i ia, ib;
        {
          uint16_t a16[32], b16[32];
          for (int i = 0; i < 32; i++) {
            a16[i] = (uint16_t)(16 * (i / 8) + i % 8);
            b16[i] = (uint16_t)(a16[i] + 8);
          }
          ia = _mm512_loadu_si512(a16);
          ib = _mm512_loadu_si512(b16);
        }
        for (uint32_t k = 0; k < Kp; k += 64) {
          __m512 v[4];
          for (int q = 0; q < 4; q++) {
            uint32_t kk = k + 16 * (uint32_t)q;
            v[q] = kn__ld16(x, dt, kk, K);
          }
          __m512i n0 = (__m512i)_mm512_cvtne2ps_pbh(v[1], v[0]), n1 = (__m512i)_mm512_cvtne2ps_pbh(v[3], v[2]);
          _mm512_storeu_si512(row + 2 * (size_t)k, _mm512_permutex2var_epi16(n0, ia, n1));
          _mm512_storeu_si512(row + 2 * (size_t)k + 64, _mm512_permutex2var_epi16(n0, ib, n1));
        }
        break;
      }
      case KN__ACT_F32EO: {
        const __m512i ev = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
        const __m512i od = _mm512_add_epi32(ev, _mm512_set1_epi32(1));
        float *o = (float *)row;
        for (uint32_t k = 0; k < Kp; k += 32) {
          __m512 lo = kn__ld16(x, dt, k, K), hi = kn__ld16(x, dt, k + 16, K);
          _mm512_storeu_ps(o + k, _mm512_permutex2var_ps(lo, ev, hi));
          _mm512_storeu_ps(o + k + 16, _mm512_permutex2var_ps(lo, od, hi));
        }
        break;
      }
      case KN__ACT_QI8: {
        __m512 inv;
        float scale = kn__quant_scale(x, dt, K, &inv);
        __m512i sum = _mm512_setzero_si512();
        for (uint32_t k = 0; k < Kp; k += 16) {
          __m512i q = kn__quant16(x, dt, k, K, inv);
          sum = _mm512_add_epi32(sum, q);
          _mm_storeu_si128((__m128i *)(row + k), _mm512_cvtepi32_epi8(q));
        }
        ((float *)(dst + a->off_xs))[r] = scale;
        ((int32_t *)(dst + a->off_xsum))[r] = _mm512_reduce_add_epi32(sum);
        break;
      }
      case KN__ACT_QI4: {
        /* Per chunk of 128 elements: bytes 0..63 = elements 0, 2, .., 126; bytes 64..127 =
         * elements 1, 3, .., 127 (the order of the low and high nibbles of 64 weight
         * bytes). x8[g] = 8 * sum of group g (G = 32, 64 or 128 divides the chunk). */
        const __m512i ev = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
        const __m512i od = _mm512_add_epi32(ev, _mm512_set1_epi32(1));
        __m512 inv;
        float scale = kn__quant_scale(x, dt, K, &inv);
        float *x8 = (float *)(dst + a->off_x8) + (size_t)r * a->ng16;
        memset(x8, 0, a->ng16 * sizeof(float));
        for (uint32_t k = 0; k < Kp; k += 128) {
          __m512i q[8], gsum = _mm512_setzero_si512();
          for (int i = 0; i < 8; i++) q[i] = kn__quant16(x, dt, k + 16 * (uint32_t)i, K, inv);
          for (int i = 0; i < 4; i++) {
            __m512i e = _mm512_permutex2var_epi32(q[2 * i], ev, q[2 * i + 1]);
            __m512i o = _mm512_permutex2var_epi32(q[2 * i], od, q[2 * i + 1]);
            _mm_storeu_si128((__m128i *)(row + k + 16 * i), _mm512_cvtepi32_epi8(e));
            _mm_storeu_si128((__m128i *)(row + k + 64 + 16 * i), _mm512_cvtepi32_epi8(o));
          }
          /* Group sums: q[i] covers elements k + 16 i .. +15; a group is G / 16 of them. */
          const uint32_t per = G / 16;
          for (uint32_t i = 0; i < 8; i++) {
            gsum = _mm512_add_epi32(gsum, q[i]);
            if ((i + 1) % per == 0) {
              uint32_t g = (k + 16 * i) / G;
              if (g < a->ng) x8[g] = 8.0f * (float)_mm512_reduce_add_epi32(gsum);
              gsum = _mm512_setzero_si512();
            }
          }
        }
        ((float *)(dst + a->off_xs))[r] = scale;
        break;
      }
      case KN__ACT_NONE:
        MR_ASSERT(!"acts_convert: nothing to convert");
    }
  }
}
/* One copy of the loop per dtype, so that the conversion is not a branch per load. */
static void acts_convert_rows(const kn__x86_acts *a, uint32_t G, uint32_t n, const kn__rows *src, uint8_t *dst) {
  switch (src->dt) {
    case MR_DTYPE_BF16: acts_convert_dt(a, G, n, src, MR_DTYPE_BF16, dst); break;
    case MR_DTYPE_F16: acts_convert_dt(a, G, n, src, MR_DTYPE_F16, dst); break;
    default: acts_convert_dt(a, G, n, src, MR_DTYPE_F32, dst); break;
  }
}
/* n fp32 rows of K, row r at src + r * src_stride floats. */
static void acts_convert(const kn__x86_acts *a, uint32_t G, uint32_t n, const float *src, size_t src_stride,
                         uint8_t *dst) {
  const kn__rows r = {.base = (const char *)src, .stride = src_stride * sizeof(float), .dt = MR_DTYPE_F32};
  acts_convert_dt(a, G, n, &r, MR_DTYPE_F32, dst);
}

/* ---- the register tile ------------------------------------------------------------- */

/* What one gate_up / down call reads, set up once per call. */
typedef struct kctx {
  uint32_t K;           /* elements per weight row */
  size_t rb;            /* bytes per weight row */
  uint32_t G, ng;       /* INT4 group and groups per row */
  uint32_t gshift;      /* INT4: log2(G), so that the group of an element is a shift */
  __mmask8 gfull;       /* INT4: the scales of a whole chunk (128 / G of them) */
  const uint8_t *xb;    /* token c at xb + c * xstride (prepared, or fp32 in place) */
  size_t xstride;
  const float *xs;      /* I8/I4: token scales */
  const int32_t *xsum;  /* I8: token sums */
  const float *x8;      /* I4: [n][ng16] */
  uint32_t ng16;
  __m512i gidx;         /* I4: lane -> group of its chunk (lane / (G / 8)) */
  __m512i lut[4];       /* FP8L: bf16 high bytes of codes 0..63, 64..127, low bytes 0..63,
                         * 64..127; FP8S: lut[0] = bf16 of the subnormals m * 2^-9, m < 8 */
  const uint8_t *pre;   /* FP8 prefill: the tile's rows converted to bf16 (row r at
                         * pre + r * prestride), read instead of the codes; NULL = decode */
  size_t prestride;
  size_t seq_pf;        /* seq tiles: prefetch distance in weight bytes, 0 = none */
} kctx;

/* One row of a seq tile (TILE_ORDER below): its C dot products are split over U partial
 * accumulators each (consecutive steps), so that U * C multiply chains are in flight, not
 * C. With spf_ != 0, each round of U steps first prefetches its bytes spf_ further on in
 * the weight stream (the rows of a seq tile, and of consecutive tiles, are contiguous). */
#define TILE_SEQ_ROW(T, ZERO, ADD, NFULL, HAS_TAIL, SB, STEP, r_)                                \
  do {                                                                                          \
    const int U_ = C == 1 ? 4 : 2;                                                              \
    T p_[4][4];                                                                                 \
    UNROLL for (int u_ = 0; u_ < U_; u_++) UNROLL for (int c_ = 0; c_ < C; c_++) p_[u_][c_] = ZERO; \
    uint32_t s_ = 0;                                                                            \
    for (; s_ + U_ <= (NFULL); s_ += U_) {                                                      \
      if (spf_) {                                                                               \
        for (size_t o_ = 0; o_ < (size_t)U_ * (SB); o_ += 64)                                   \
          _mm_prefetch((const char *)w[r_] + (size_t)s_ * (SB) + spf_ + o_, _MM_HINT_T0);       \
      }                                                                                         \
      UNROLL for (int u_ = 0; u_ < U_; u_++) STEP(r_, s_ + u_, false, p_[u_], 1);              \
    }                                                                                           \
    for (; s_ < (NFULL); s_++) STEP(r_, s_, false, p_[0], 1);                                  \
    if (HAS_TAIL) STEP(r_, (NFULL), true, p_[0], 1);                                            \
    UNROLL for (int c_ = 0; c_ < C; c_++) {                                                     \
      UNROLL for (int u_ = 1; u_ < U_; u_++) p_[0][c_] = ADD(p_[0][c_], p_[u_][c_]);            \
      acc[c_ * RW + r_] = p_[0][c_];                                                            \
    }                                                                                           \
  } while (0)

/* The loop orders of a tile over its RW rows and the K steps of each row:
 *   seq = false: steps outer, rows inner. Each step loads one block of every row and of
 *                every token: RW + C loads for RW * C dot steps, the fewest loads per
 *                multiply; the rows are read side by side (RW interleaved streams).
 *   seq = true:  rows outer, steps inner: the tile reads its rows one after the other,
 *                i.e. one sequential stream through memory (the rows are contiguous), and
 *                re-reads the C token blocks (from L1) for each row.
 * On the Zen 4 this was tuned on, RW interleaved rows of 1-2 KiB read from DRAM at 10-19
 * GB/s where one sequential stream reads at 24 (tests/bench/README.md): the memory-bound
 * tiles (few tokens per expert) use seq, the compute-bound ones (prefill) do not.
 * STEP(r, s, tail, a, stride) adds step s of row r against the C tokens into a[c * stride]
 * (the tile's acc[c * RW + r], or a row's partial accumulators); the last step of a row
 * may be partial (tail). T, ZERO, ADD: the accumulator type and its zero and add; SB: the
 * weight bytes of one step. With seq = false and pf != 0, each step also prefetches the
 * bytes pf further on in each row (the next tile's rows); with seq = true and
 * cx->seq_pf != 0, the bytes seq_pf further on in the one stream (seq_pf_bytes). Uses the
 * enclosing tile()'s v, cx, RW, C, w[], acc[] and pf. */
#define TILE_ORDER(T, ZERO, ADD, SEQ, NFULL, HAS_TAIL, SB, STEP)                                   \
  do {                                                                                          \
    if (SEQ) {                                                                                  \
      /* One row at a time. The rows of the formats with a long step (fp8, int4) are a loop  \
       * at run time: unrolled, a tile's 16 copies of the row's code (20 KiB for fp8) did not \
       * fit the instruction caches, each running only K / (U * step) rounds (fp8 1 token:  \
       * -12 % as a loop). The others stay unrolled (bf16 as a loop: +10 %). */              \
      /* bf16 / f16 / f32 prefetch nothing, and get none of its code (bf16: +2 % with it) */  \
      const size_t spf_ = IS_FP8(v) || v == V_I8 || v == V_I4 ? cx->seq_pf : 0;                 \
      if (IS_FP8(v) || v == V_I4) {                                                             \
        _Pragma("GCC unroll 1") for (int r_ = 0; r_ < RW; r_++)                                 \
            TILE_SEQ_ROW(T, ZERO, ADD, NFULL, HAS_TAIL, SB, STEP, r_);                          \
      } else {                                                                                  \
        UNROLL for (int r_ = 0; r_ < RW; r_++) TILE_SEQ_ROW(T, ZERO, ADD, NFULL, HAS_TAIL, SB, STEP, r_); \
      }                                                                                         \
    } else {                                                                                    \
      for (uint32_t s_ = 0; s_ < (NFULL); s_++)                                                 \
        UNROLL for (int r_ = 0; r_ < RW; r_++) {                                                \
          if (pf) _mm_prefetch((const char *)w[r_] + pf + (size_t)s_ * (SB), PF_HINT);          \
          STEP(r_, s_, false, &acc[r_], RW);                                                    \
        }                                                                                       \
      if (HAS_TAIL) UNROLL for (int r_ = 0; r_ < RW; r_++) STEP(r_, (NFULL), true, &acc[r_], RW); \
    }                                                                                           \
  } while (0)

/* The interleaved tiles prefetch the rows of the next tile into L2 (T1), not L1: the
 * current rows and token blocks live in L1, and L2 is close enough for the next tile's
 * first pass (bf16 8 tokens: 129 GFLOP/s with T1, 90 with T0, 88 without). */
#define PF_HINT _MM_HINT_T1

/* fp32 FMA step of 16 elements (F32, F16): x is read in place, so its tail is masked too
 * (the bytes after the last token may not exist). */
AI void step_f32(const v512 v, const int C, const uint8_t *wr, const float *const *xf, uint32_t s,
                 bool tail, __mmask16 tm, __m512 *a, const int st) {
  const size_t k = 16 * (size_t)s;
  __m512 wv;
  if (v == V_F32)
    wv = tail ? _mm512_maskz_loadu_ps(tm, wr + 4 * k) : _mm512_loadu_ps(wr + 4 * k);
  else
    wv = _mm512_cvtph_ps(tail ? _mm256_maskz_loadu_epi16(tm, wr + 2 * k) : _mm256_loadu_si256((const __m256i *)(wr + 2 * k)));
  UNROLL for (int c = 0; c < C; c++) {
    __m512 xv = tail ? _mm512_maskz_loadu_ps(tm, xf[c] + k) : _mm512_loadu_ps(xf[c] + k);
    a[c * st] = _mm512_fmadd_ps(wv, xv, a[c * st]);
  }
}

/* bf16 step of 32 elements: vdpbf16ps on bf16 x, or the fp32 widening of the even/odd
 * halves against fp32 x in even/odd order. x is padded: only the weights are masked. */
AI void step_bf16(const v512 v, const int C, const uint8_t *wr, const uint8_t *const *xp,
                  uint32_t s, bool tail, __mmask32 tm, __m512 *a, const int st) {
  const size_t k = 32 * (size_t)s;
  __m512i wv = tail ? _mm512_maskz_loadu_epi16(tm, wr + 2 * k) : _mm512_loadu_si512(wr + 2 * k);
  if (v == V_BF16DP) {
    UNROLL for (int c = 0; c < C; c++)
      a[c * st] = _mm512_dpbf16_ps(a[c * st], (__m512bh)wv, (__m512bh)_mm512_loadu_si512(xp[c] + 2 * k));
  } else {
    __m512 we = _mm512_castsi512_ps(_mm512_slli_epi32(wv, 16));
    __m512 wo = _mm512_castsi512_ps(_mm512_and_si512(wv, _mm512_set1_epi32((int)0xffff0000u)));
    UNROLL for (int c = 0; c < C; c++) {
      a[c * st] = _mm512_fmadd_ps(we, _mm512_loadu_ps((const float *)(xp[c] + 4 * k)), a[c * st]);
      a[c * st] = _mm512_fmadd_ps(wo, _mm512_loadu_ps((const float *)(xp[c] + 4 * k + 64)), a[c * st]);
    }
  }
}

/* int8 step of 64 elements: vpdpbusd on (w ^ 0x80) = w + 128 (u8) and xq (s8). Masked-off
 * weight bytes become 0x80 = +128, against zero padding of x. */
AI void step_i8(const int C, const uint8_t *wr, const uint8_t *const *xp, uint32_t s, bool tail,
                __mmask64 tm, __m512i *a, const int st) {
  const size_t k = 64 * (size_t)s;
  __m512i wv = tail ? _mm512_maskz_loadu_epi8(tm, wr + k) : _mm512_loadu_si512(wr + k);
  wv = _mm512_xor_si512(wv, _mm512_set1_epi8((char)0x80));
  UNROLL for (int c = 0; c < C; c++) a[c * st] = dpbusd(a[c * st], wv, _mm512_loadu_si512(xp[c] + k));
}

/* int4 step: one chunk of 64 weight bytes = 128 elements (a short last chunk, G = 32 or
 * 64, has tb = 16, 32 or 48 bytes). gm masks the scales of the groups in the chunk. */
AI void step_i4(const int C, const kctx *cx, const uint8_t *wr, const float *sr,
                const uint8_t *const *xp, uint32_t s, bool tail, __mmask64 tm, __mmask8 tgm,
                __m512 *a, const int st) {
  const size_t cb = 64 * (size_t)s;
  const __m512i m0f = _mm512_set1_epi8(0x0f), m88 = _mm512_set1_epi8((char)0x88);
  const __mmask8 gm = tail ? tgm : cx->gfull;
  __m512i wv = tail ? _mm512_maskz_loadu_epi8(tm, wr + cb) : _mm512_loadu_si512(wr + cb);
  /* (b ^ 0x88) & 0x0f in one vpternlogd (0x28 = (A ^ B) & C); the high nibbles after a
   * 16-bit shift by 4, whose bits from the next byte land in the masked-off half. */
  __m512i lo = _mm512_ternarylogic_epi32(wv, m88, m0f, 0x28);
  __m512i hi = _mm512_ternarylogic_epi32(_mm512_srli_epi16(wv, 4), m88, m0f, 0x28);
  __m512 sv = _mm512_permutexvar_ps(cx->gidx, _mm512_castps128_ps512(_mm_maskz_loadu_ps(gm, sr + ((cb * 2) >> cx->gshift))));
  UNROLL for (int c = 0; c < C; c++) {
    __m512i ai = dpbusd(_mm512_setzero_si512(), lo, _mm512_loadu_si512(xp[c] + 2 * cb));
    ai = dpbusd(ai, hi, _mm512_loadu_si512(xp[c] + 2 * cb + 64));
    a[c * st] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ai), sv, a[c * st]);
  }
}

/* FP8 e4m3 -> bf16, exact for every code (vdpbf16ps treats bf16 subnormals as zero, but
 * no e4m3 value is one: they span 2^-9 .. 448, all bf16 normals).
 *   LUT (AVX512_VBMI): 64 codes at a time; vpermi2b looks up the high and the low byte of
 *     the bf16 of (code & 0x7f) in two 128-entry tables (it ignores index bit 7), the sign
 *     is or-ed into the high byte, and vpunpck{l,h}bw interleave low/high bytes into words:
 *     per 128-bit lane, elements 0-7 then 8-15, hence the KN__ACT_BF16P order of x.
 *   shift (AVX512BW only): 32 codes zero-extended to words and moved to the high byte
 *     (s eeee mmm 0..0); an arithmetic shift right by 4 copies s down to bit 11 and puts
 *     e.m at bits 10..4, a mask keeps bits 15 and 10..4, and + 120 << 7 gives the bf16 of
 *     a normal e.m with its sign ((e + 120) << 7 | m << 4): 5 instructions per 32 codes.
 *     The 16 codes with e = 0 (+-m * 2^-9) are rare in real weights, so one test per 128
 *     codes sends a block that has any to fp8_shift32_sub (out of line), which replaces
 *     them from an 8-entry word table (vpermw under a mask) and puts the sign back.
 *     Natural order. Was the table lookup on every vector: 15-30% slower at 1-4 tokens
 *     per expert (docs/BENCHMARKS.md). */
AI void fp8_lut64(const kctx *cx, __m512i w, __m512i *a, __m512i *b) {
  __m512i hi = _mm512_permutex2var_epi8(cx->lut[0], w, cx->lut[1]);
  __m512i lo = _mm512_permutex2var_epi8(cx->lut[2], w, cx->lut[3]);
  hi = _mm512_ternarylogic_epi32(hi, w, _mm512_set1_epi8((char)0x80), 0xF8); /* hi | (w & 0x80) */
  *a = _mm512_unpacklo_epi8(lo, hi);
  *b = _mm512_unpackhi_epi8(lo, hi);
}
AI __m512i fp8_shift32(__m256i w8) {
  const __m512i hi = _mm512_slli_epi16(_mm512_cvtepu8_epi16(w8), 8); /* s eeee mmm 0..0 */
  return _mm512_add_epi16(_mm512_and_si512(_mm512_srai_epi16(hi, 4), _mm512_set1_epi16((short)0x87f0)),
                          _mm512_set1_epi16(120 << 7));
}
/* The e = 0 codes of the 32 of w8 replaced in v (fp8_shift32's) from the table. */
static __attribute__((noinline)) __m512i fp8_shift32_sub(const kctx *cx, __m256i w8, __m512i v) {
  const __m512i w = _mm512_cvtepu8_epi16(w8);
  const __mmask32 sub = _mm512_testn_epi16_mask(w, _mm512_set1_epi16(0x78));
  v = _mm512_mask_permutexvar_epi16(v, sub, w, cx->lut[0]);
  return _mm512_ternarylogic_epi32(v, _mm512_slli_epi16(w, 8), _mm512_set1_epi16((short)0x8000), 0xF8);
}

/* The 128 codes of block s of row wr as four vectors of 32 bf16 (the order of x's
 * activations for v). tm0 / tm1 mask the two 64-byte halves of a short last block (codes 0
 * = +0 there, against zero padding of x). */
AI void fp8_block(const v512 v, const kctx *cx, const uint8_t *wr, uint32_t s, bool tail,
                  __mmask64 tm0, __mmask64 tm1, __m512i *wb) {
  const size_t k = 128 * (size_t)s;
  if (v == V_FP8L) {
    __m512i w0 = tail ? _mm512_maskz_loadu_epi8(tm0, wr + k) : _mm512_loadu_si512(wr + k);
    __m512i w1 = tail ? _mm512_maskz_loadu_epi8(tm1, wr + k + 64) : _mm512_loadu_si512(wr + k + 64);
    fp8_lut64(cx, w0, &wb[0], &wb[1]);
    fp8_lut64(cx, w1, &wb[2], &wb[3]);
  } else {
    __m256i w8[4];
    UNROLL for (int q = 0; q < 4; q++) {
      __mmask32 m = (__mmask32)((q < 2 ? tm0 : tm1) >> (32 * (q & 1)));
      w8[q] = tail ? _mm256_maskz_loadu_epi8(m, wr + k + 32 * q) : _mm256_loadu_si256((const __m256i *)(wr + k + 32 * q));
      wb[q] = fp8_shift32(w8[q]);
    }
    const __m256i e = _mm256_set1_epi8(0x78);
    const __mmask32 z = _mm256_testn_epi8_mask(w8[0], e) | _mm256_testn_epi8_mask(w8[1], e) |
                        _mm256_testn_epi8_mask(w8[2], e) | _mm256_testn_epi8_mask(w8[3], e);
    if (__builtin_expect(z != 0, 0))
      UNROLL for (int q = 0; q < 4; q++) wb[q] = fp8_shift32_sub(cx, w8[q], wb[q]);
  }
}

/* Row wr of K codes converted once into dst as bf16, block s at dst + 256 s (zero beyond K
 * up to the next multiple of 128): the prefill tiles then read the same row for every
 * token block without converting it again. */
AI void fp8_row_to_bf16(const v512 v, const kctx *cx, const uint8_t *wr, uint32_t K, uint8_t *dst) {
  const uint32_t nfull = K / 128, tb = K % 128;
  const __mmask64 tm0 = mask64(tb), tm1 = mask64(tb > 64 ? tb - 64 : 0);
  for (uint32_t s = 0; s < nfull + (tb != 0); s++) {
    __m512i wb[4];
    fp8_block(v, cx, wr, s, s == nfull, tm0, tm1, wb);
    UNROLL for (int q = 0; q < 4; q++) _mm512_storeu_si512(dst + 256 * (size_t)s + 64 * q, wb[q]);
  }
}

/* FP8 step: one 128-element block of the row (one scale): four vdpbf16ps per token into a
 * fresh sum, then acc += sum * scale. pre: wr is the row already converted by
 * fp8_row_to_bf16 (prefill); else the codes are converted here (decode). */
AI void step_fp8(const v512 v, const bool pre, const int C, const kctx *cx, const uint8_t *wr,
                 const float *sr, const uint8_t *const *xp, uint32_t s, bool tail, __mmask64 tm0,
                 __mmask64 tm1, __m512 *a, const int st) {
  const size_t k = 128 * (size_t)s;
  __m512i wb[4];
  if (pre) {
    UNROLL for (int q = 0; q < 4; q++) wb[q] = _mm512_loadu_si512(wr + 256 * (size_t)s + 64 * q);
  } else {
    fp8_block(v, cx, wr, s, tail, tm0, tm1, wb);
  }
  const __m512 sc = _mm512_set1_ps(sr[s]);
  UNROLL for (int c = 0; c < C; c++) {
    const uint8_t *x = xp[c] + 2 * k;
    __m512 d = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)wb[0], (__m512bh)_mm512_loadu_si512(x));
    d = _mm512_dpbf16_ps(d, (__m512bh)wb[1], (__m512bh)_mm512_loadu_si512(x + 64));
    d = _mm512_dpbf16_ps(d, (__m512bh)wb[2], (__m512bh)_mm512_loadu_si512(x + 128));
    d = _mm512_dpbf16_ps(d, (__m512bh)wb[3], (__m512bh)_mm512_loadu_si512(x + 192));
    a[c * st] = _mm512_fmadd_ps(d, sc, a[c * st]);
  }
}

/*
 * The dot products of RW weight rows w[r] (row scales in lanes r of rsc, INT8 only; group
 * scales at s[r], INT4 only) with the tokens c0 .. c0 + Cv - 1 (Cv <= C; the missing tokens
 * repeat the last one and their lanes are ignored by the caller). Returns dot (c, r) in lane
 * c * RW + r. RW * C <= 16, RW a power of two.
 */
AI __m512 tile(const v512 v, const int RW, const int C, const bool seq, const kctx *cx,
               const uint8_t *const *w, const float *const *s, __m512 rsc, uint32_t c0, uint32_t Cv,
               size_t pf) {
  const uint8_t *xp[4];
  UNROLL for (int c = 0; c < C; c++)
    xp[c] = cx->xb + (size_t)(c0 + ((uint32_t)c < Cv ? (uint32_t)c : Cv - 1)) * cx->xstride;
  const uint32_t K = cx->K;
  const int sh = RW == 16 ? 4 : RW == 8 ? 3 : RW == 4 ? 2 : RW == 2 ? 1 : 0;
  const __m512i tok = _mm512_srli_epi32(iota16(), sh); /* lane -> token of the tile */

  if (v == V_I8) {
    /* acc lanes: sum of (w + 128) * xq over 4 elements per step. Bound for K <= 65536:
     * the 16-lane total is <= 255 * 127 * 65536 < 2^31, and so is every partial sum. */
    __m512i acc[16];
    UNROLL for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_si512();
    const __mmask64 tm = mask64(K % 64);
#define STEP(r, st, tail, a, stride) step_i8(C, w[r], xp, st, tail, tm, a, stride)
    TILE_ORDER(__m512i, _mm512_setzero_si512(), _mm512_add_epi32, seq, K / 64, K % 64 != 0, 64, STEP);
#undef STEP
    __m512i sum = hsum16_epi32(acc);
    __m512i row = _mm512_and_si512(iota16(), _mm512_set1_epi32(RW - 1));
    __m512i xsum = _mm512_permutexvar_epi32(tok, _mm512_maskz_loadu_epi32(mask16(Cv), cx->xsum + c0));
    __m512 xs = _mm512_permutexvar_ps(tok, _mm512_maskz_loadu_ps(mask16(Cv), cx->xs + c0));
    sum = _mm512_sub_epi32(sum, _mm512_slli_epi32(xsum, 7));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(xs, _mm512_permutexvar_ps(row, rsc)));
  }

  __m512 acc[16];
  UNROLL for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
  if (v == V_F32 || v == V_F16) {
    const float *xf[4];
    UNROLL for (int c = 0; c < C; c++) xf[c] = (const float *)xp[c];
    const __mmask16 tm = mask16(K % 16);
#define STEP(r, st, tail, a, stride) step_f32(v, C, w[r], xf, st, tail, tm, a, stride)
    TILE_ORDER(__m512, _mm512_setzero_ps(), _mm512_add_ps, seq, K / 16, K % 16 != 0, v == V_F32 ? 64 : 32, STEP);
#undef STEP
  } else if (v == V_BF16DP || v == V_BF16F32) {
    const __mmask32 tm = mask32(K % 32);
#define STEP(r, st, tail, a, stride) step_bf16(v, C, w[r], xp, st, tail, tm, a, stride)
    TILE_ORDER(__m512, _mm512_setzero_ps(), _mm512_add_ps, seq, K / 32, K % 32 != 0, 64, STEP);
#undef STEP
  } else if (IS_FP8(v)) {
    const uint32_t tb = K % 128;
    const __mmask64 tm0 = mask64(tb), tm1 = mask64(tb > 64 ? tb - 64 : 0);
    if (cx->pre) {
#define STEP(r, st, tail, a, stride) step_fp8(v, true, C, cx, w[r], s[r], xp, st, tail, tm0, tm1, a, stride)
      TILE_ORDER(__m512, _mm512_setzero_ps(), _mm512_add_ps, seq, K / 128, tb != 0, 256, STEP);
#undef STEP
    } else {
#define STEP(r, st, tail, a, stride) step_fp8(v, false, C, cx, w[r], s[r], xp, st, tail, tm0, tm1, a, stride)
      TILE_ORDER(__m512, _mm512_setzero_ps(), _mm512_add_ps, seq, K / 128, tb != 0, 128, STEP);
#undef STEP
    }
  } else { /* V_I4 */
    const uint32_t tb = (uint32_t)(cx->rb % 64); /* short last chunk: 16, 32 or 48 bytes */
    const __mmask64 tm = mask64(tb);
    const __mmask8 tgm = (__mmask8)((1u << (tb * 2 / cx->G)) - 1);
#define STEP(r, st, tail, a, stride) step_i4(C, cx, w[r], s[r], xp, st, tail, tm, tgm, a, stride)
    TILE_ORDER(__m512, _mm512_setzero_ps(), _mm512_add_ps, seq, (uint32_t)(cx->rb / 64), tb != 0, 64, STEP);
#undef STEP
    /* Remove the +8 offset: acc -= s_g * 8 X_g, lane-wise over the row's ng scales (the
     * lanes are summed below anyway). x8 is zero beyond ng; the scales are masked there. */
    const float *x8[4];
    UNROLL for (int c = 0; c < C; c++)
      x8[c] = cx->x8 + (size_t)(c0 + ((uint32_t)c < Cv ? (uint32_t)c : Cv - 1)) * cx->ng16;
    for (uint32_t g = 0; g < cx->ng; g += 16) {
      __mmask16 m = mask16(cx->ng - g);
      UNROLL for (int r = 0; r < RW; r++) {
        __m512 sv = _mm512_maskz_loadu_ps(m, s[r] + g);
        UNROLL for (int c = 0; c < C; c++)
          acc[c * RW + r] = _mm512_fnmadd_ps(sv, _mm512_loadu_ps(x8[c] + g), acc[c * RW + r]);
      }
    }
  }
  __m512 sum = hsum16_ps(acc);
  if (v == V_I4) sum = _mm512_mul_ps(sum, _mm512_permutexvar_ps(tok, _mm512_maskz_loadu_ps(mask16(Cv), cx->xs + c0)));
  return sum;
}

/* ---- gate_up and down drivers ------------------------------------------------------ */

/* Rows [i, i + R) of gate and up in one tile (the last ones clamped to i_end - 1) for
 * tokens c0 .. c0 + Cv - 1: h[c, i + r] = silu(gate . x) * (up . x). */
AI void gu_block(const v512 v, const int R, const int C, const kn__task *t, const kctx *cx,
                 uint32_t i, uint32_t i_end, uint32_t c0, uint32_t Cv) {
  const kn__slice_w *ws = t->w;
  const uint32_t Rv = i_end - i < (uint32_t)R ? i_end - i : (uint32_t)R;
  const uint32_t Is = t->L->slice_len[t->slice];
  const uint8_t *w[16];
  const float *s[16];
  UNROLL for (int r = 0; r < R; r++) {
    uint32_t row = i + ((uint32_t)r < Rv ? (uint32_t)r : Rv - 1);
    w[r] = cx->pre ? cx->pre + (size_t)r * cx->prestride : (const uint8_t *)ws->gate + row * cx->rb;
    w[R + r] = cx->pre ? cx->pre + (size_t)(R + r) * cx->prestride : (const uint8_t *)ws->up + row * cx->rb;
    if (v == V_I4 || IS_FP8(v)) {
      s[r] = ws->gate_scale + (size_t)row * cx->ng;
      s[R + r] = ws->up_scale + (size_t)row * cx->ng;
    }
  }
  __m512 rsc = _mm512_setzero_ps();
  if (v == V_I8) { /* lanes r < R: gate scales, R <= r < 2R: up scales */
    rsc = _mm512_maskz_loadu_ps(mask16(Rv), ws->gate_scale + i);
    __m512 us = _mm512_maskz_loadu_ps(mask16(Rv), ws->up_scale + i);
    rsc = _mm512_mask_permutexvar_ps(rsc, (__mmask16)(((1u << R) - 1) << R),
                                     _mm512_sub_epi32(iota16(), _mm512_set1_epi32(R)), us);
  }
  /* The first token block prefetches the rows of the next tile (R rows further on). */
  __m512 d = tile(v, 2 * R, C, false, cx, w, s, rsc, c0, Cv, c0 == 0 && !cx->pre ? R * cx->rb : 0);
  __m512 hv = _mm512_mul_ps(silu_ps(d), rot_ps(d, R)); /* lane c*2R + r: token c, row i + r */
  UNROLL for (int c = 0; c < C; c++)
    if ((uint32_t)c < Cv)
      _mm512_mask_storeu_ps(t->h + (size_t)(c0 + c) * Is + i, mask16(Rv), rot_ps(hv, c * 2 * R));
}

/* What a single-matrix block does with its dot products d (row r of token c at
 * out[c * out_stride + row + r]). */
typedef enum epi { EP_STORE, EP_SILU_MUL } epi;

/* Rows [row, row + RW) of one matrix (base, scales) for tokens c0 .. c0 + Cv - 1:
 * EP_STORE writes the dot products; EP_SILU_MUL turns the gate values a first pass left in
 * out into silu(gate) * dot (the second, up pass of gate_up). */
AI void mat_block(const v512 v, const int RW, const int C, const bool seq, const epi ep,
                  const kctx *cx, const uint8_t *base, const float *scale, uint32_t row,
                  uint32_t row_end, uint32_t c0, uint32_t Cv, float *out, size_t out_stride) {
  const uint32_t Rv = row_end - row < (uint32_t)RW ? row_end - row : (uint32_t)RW;
  const uint8_t *w[16];
  const float *s[16];
  UNROLL for (int r = 0; r < RW; r++) {
    uint32_t rr = row + ((uint32_t)r < Rv ? (uint32_t)r : Rv - 1);
    w[r] = cx->pre ? cx->pre + (size_t)r * cx->prestride : base + rr * cx->rb;
    if (v == V_I4 || IS_FP8(v)) s[r] = scale + (size_t)rr * cx->ng;
  }
  __m512 rsc = _mm512_setzero_ps();
  if (v == V_I8) rsc = _mm512_maskz_loadu_ps(mask16(Rv), scale + row);
  __m512 d = tile(v, RW, C, seq, cx, w, s, rsc, c0, Cv, !seq && c0 == 0 && !cx->pre ? RW * cx->rb : 0);
  UNROLL for (int c = 0; c < C; c++)
    if ((uint32_t)c < Cv) {
      float *dst = out + (size_t)(c0 + c) * out_stride + row;
      __m512 val = rot_ps(d, c * RW);
      if (ep == EP_SILU_MUL) val = _mm512_mul_ps(silu_ps(_mm512_maskz_loadu_ps(mask16(Rv), dst)), val);
      _mm512_mask_storeu_ps(dst, mask16(Rv), val);
    }
}

/* Bytes of one row of K elements converted to bf16 for the prefill tiles (whole 128-blocks;
 * an odd number of cache lines apart, so that the tile's rows do not share L1 sets). */
static inline size_t fp8_pre_stride(uint32_t K) {
  size_t b = (size_t)(K + 127) / 128 * 256;
  return b % 1024 == 0 ? b + 64 : b;
}

/* FP8 conversion tables (built once by fp8_luts_init from the exact code table):
 * [0] LUT: high bytes of bf16(code) for codes 0..63, 64..127, low bytes 0..63, 64..127;
 * [1] shift: words 0..7 = bf16(m * 2^-9) (the subnormals), rest 0. */
static _Alignas(64) uint8_t fp8_luts[2][4][64];
static pthread_once_t fp8_luts_once = PTHREAD_ONCE_INIT;
static void fp8_luts_init(void) {
  const float *tbl = kn__fp8_table();
  for (int c = 0; c < 128; c++) {
    uint16_t b = mr_f32_to_bf16(tbl[c]);
    fp8_luts[0][c / 64][c % 64] = (uint8_t)(b >> 8);
    fp8_luts[0][2 + c / 64][c % 64] = (uint8_t)b;
  }
  for (int m = 0; m < 8; m++) {
    uint16_t b = mr_f32_to_bf16(tbl[m]);
    memcpy(&fp8_luts[1][0][2 * m], &b, 2);
  }
}

/* How far ahead (bytes of the weight stream) the seq tiles prefetch, 0 = not at all. On
 * the Emerald Rapids Xeon (one core, a qwen3 expert streamed from DRAM, 1 token, medians
 * of 5 interleaved runs, docs/BENCHMARKS.md) the hardware prefetchers alone kept fp8 at
 * ~9 GB/s of weights against ~15 for bf16: the longer a line takes to compute, the fewer
 * of the next lines they have asked for by then. With the rows as a loop (TILE_ORDER):
 * fp8 at 2 KiB -32 % (1 KiB -26 %), int4 at 1 KiB -17 %, int8 at 1 KiB -5 %; bf16 / f16 /
 * f32 (already at the rate of a plain read): 1 KiB no gain, 2 KiB +8 %. Not measured on
 * AMD, so off there (the decode tiles were tuned on Zen 4 without it). */
static size_t seq_pf_bytes(const v512 v) { /* TILE_ORDER reads it for fp8 / int8 / int4 only */
  if (!kn__cpu_get()->intel) return 0;
  return IS_FP8(v) ? 2048 : v == V_I8 || v == V_I4 ? 1024 : 0;
}

/* The call-level set-up: where the activations are, in which layout. */
static kctx ctx_make(const v512 v, const kn_layer *L, uint32_t K, const void *acts,
                     const float *xf, size_t xf_stride, uint32_t n) {
  kctx cx;
  memset(&cx, 0, sizeof cx);
  const kn_format f = L->d.format;
  cx.K = K;
  cx.G = L->d.group;
  cx.rb = kn__row_bytes(f, K, cx.G);
  cx.seq_pf = seq_pf_bytes(v);
  if (v == V_F32 || v == V_F16) {
    cx.xb = (const uint8_t *)xf;
    cx.xstride = xf_stride * sizeof(float);
    return cx;
  }
  kn__x86_acts a = acts_layout(v, K, cx.G, n);
  if (IS_FP8(v)) {
    cx.ng = kn__ngroups(K, KN_FP8_BLOCK);
    for (int i = 0; i < 4; i++) cx.lut[i] = _mm512_load_si512(fp8_luts[v == V_FP8L ? 0 : 1][i]);
  }
  cx.xb = acts;
  cx.xstride = a.stride;
  if (v == V_I8 || v == V_I4) cx.xs = (const float *)((const uint8_t *)acts + a.off_xs);
  if (v == V_I8) cx.xsum = (const int32_t *)((const uint8_t *)acts + a.off_xsum);
  if (v == V_I4) {
    cx.ng = a.ng;
    cx.ng16 = a.ng16;
    cx.x8 = (const float *)((const uint8_t *)acts + a.off_x8);
    cx.gidx = _mm512_srli_epi32(iota16(), cx.G == 32 ? 2 : cx.G == 64 ? 3 : 4);
    cx.gshift = cx.G == 32 ? 5 : cx.G == 64 ? 6 : 7;
    cx.gfull = (__mmask8)((1u << (128 / cx.G)) - 1);
  }
  return cx;
}

/* Up to this many tokens per expert a step uses the sequential tiles (gate_up: two passes);
 * above, the interleaved compute tiles with the next tile's rows prefetched (gate_up:
 * gate and up rows paired in one tile). Crossovers measured on Zen 4, one core, a qwen3
 * expert streamed from DRAM (GFLOP/s, sequential vs interleaved): bf16 2 tokens 50 vs 47,
 * 4: 77 vs 84; int8 4: 203 vs 159, 8: 173 vs 242; int4 4: 207 vs 203, 8: 174 vs 229.
 * f32/f16 follow bf16 (their rows are as long or longer). */
static const uint32_t seq_max_tokens[V_COUNT] = {2, 2, 2, 2, 4, 4, 2, 2};

/* Token blocks of 4, then one block of the rest (1..3). */
#define TOKEN_BLOCKS(n, BLOCK, ...)                                      \
  do {                                                                   \
    uint32_t c0_ = 0;                                                    \
    for (; c0_ + 4 <= (n); c0_ += 4) BLOCK(__VA_ARGS__, 4, c0_, 4);      \
    switch ((n) - c0_) {                                                 \
      case 1: BLOCK(__VA_ARGS__, 1, c0_, 1); break;                      \
      case 2: BLOCK(__VA_ARGS__, 2, c0_, 2); break;                      \
      case 3: BLOCK(__VA_ARGS__, 3, c0_, 3); break;                      \
      default: break;                                                    \
    }                                                                    \
  } while (0)

/* All rows [r0, r1) of one matrix, sequential tiles by token count. */
AI void mat_rows_seq(const v512 v, const epi ep, const kctx *cx, uint32_t n, const uint8_t *base,
                     const float *scale, uint32_t r0, uint32_t r1, float *out, size_t out_stride) {
#define MB(RW_, C_, c0_, Cv_) mat_block(v, RW_, C_, true, ep, cx, base, scale, r, r1, c0_, Cv_, out, out_stride)
  if (n == 1) {
    for (uint32_t r = r0; r < r1; r += 16) MB(16, 1, 0, 1);
  } else if (n == 2) {
    for (uint32_t r = r0; r < r1; r += 8) MB(8, 2, 0, 2);
  } else {
    for (uint32_t r = r0; r < r1; r += 4) TOKEN_BLOCKS(n, MB, 4);
  }
#undef MB
}

AI void gate_up_run(const v512 v, const kn__task *t, uint32_t i0, uint32_t i1) {
  const kn_layer *L = t->L;
  const uint32_t n = t->n, H = L->d.hidden, Is = L->slice_len[t->slice];
  if (n == 0 || i0 >= i1) return;
  kctx cx = ctx_make(v, L, H, t->xq, t->x, H, n);
  if (n <= seq_max_tokens[v]) {
    /* Two sequential passes: gate . x into h, then h = silu(h) * (up . x). Each reads one
     * matrix front to back; h rows [i0, i1) are this call's own. */
    const kn__slice_w *ws = t->w;
    mat_rows_seq(v, EP_STORE, &cx, n, ws->gate, ws->gate_scale, i0, i1, t->h, Is);
    mat_rows_seq(v, EP_SILU_MUL, &cx, n, ws->up, ws->up_scale, i0, i1, t->h, Is);
    return;
  }
#define GU(R_, C_, c0_, Cv_) gu_block(v, R_, C_, t, &cx, i, i1, c0_, Cv_)
  if (IS_FP8(v)) {
    /* Prefill: the tile's 2 gate and 2 up rows converted to bf16 once (into tmp, which
     * gate_up does not otherwise use), then read by every token block. */
    const kn__slice_w *ws = t->w;
    uint8_t *buf = (uint8_t *)t->tmp;
    cx.prestride = fp8_pre_stride(H);
    cx.pre = buf;
    for (uint32_t i = i0; i < i1; i += 2) {
      for (uint32_t r = 0; r < 2; r++) {
        uint32_t row = i + r < i1 ? i + r : i1 - 1;
        fp8_row_to_bf16(v, &cx, (const uint8_t *)ws->gate + row * cx.rb, H, buf + r * cx.prestride);
        fp8_row_to_bf16(v, &cx, (const uint8_t *)ws->up + row * cx.rb, H, buf + (2 + r) * cx.prestride);
      }
      TOKEN_BLOCKS(n, GU, 2);
    }
    return;
  }
  for (uint32_t i = i0; i < i1; i += 2) TOKEN_BLOCKS(n, GU, 2);
#undef GU
}

AI void down_run(const v512 v, const kn__task *t, uint32_t j0, uint32_t j1) {
  const kn_layer *L = t->L;
  const uint32_t n = t->n, Is = L->slice_len[t->slice], H = L->d.hidden;
  if (n == 0 || j0 >= j1) return;
  const void *acts = NULL;
  if (act_kind[v] != KN__ACT_NONE) {
    /* h is converted by every down call into its own tmp: concurrent calls on other rows
     * of the same task each make their own copy (n * Is elements, small next to the
     * (j1 - j0) * Is weights the call reads). */
    kn__x86_acts a = acts_layout(v, Is, L->d.group, n);
    acts_convert(&a, L->d.group, n, t->h, Is, (uint8_t *)t->tmp);
    acts = t->tmp;
  }
  kctx cx = ctx_make(v, L, Is, acts, t->h, Is, n);
  const kn__slice_w *ws = t->w;
  if (n <= seq_max_tokens[v]) {
    mat_rows_seq(v, EP_STORE, &cx, n, ws->down, ws->down_scale, j0, j1, t->y, H);
    return;
  }
#define MB(RW_, C_, c0_, Cv_) mat_block(v, RW_, C_, false, EP_STORE, &cx, ws->down, ws->down_scale, j, j1, c0_, Cv_, t->y, H)
  if (IS_FP8(v)) { /* prefill: 4 rows converted once, after the activations in tmp */
    uint8_t *buf = (uint8_t *)t->tmp + kn__x86_align64(acts_layout(v, Is, L->d.group, n).bytes);
    cx.prestride = fp8_pre_stride(Is);
    cx.pre = buf;
    for (uint32_t j = j0; j < j1; j += 4) {
      for (uint32_t r = 0; r < 4; r++) {
        uint32_t row = j + r < j1 ? j + r : j1 - 1;
        fp8_row_to_bf16(v, &cx, (const uint8_t *)ws->down + row * cx.rb, Is, buf + r * cx.prestride);
      }
      TOKEN_BLOCKS(n, MB, 4);
    }
    return;
  }
  for (uint32_t j = j0; j < j1; j += 4) TOKEN_BLOCKS(n, MB, 4);
#undef MB
}

/* ---- kernel-table entries ---------------------------------------------------------- */

static size_t prep_bytes_of(const v512 v, const kn_layer *L, uint32_t n) {
  return acts_layout(v, L->d.hidden, L->d.group, n).bytes;
}
static size_t tmp_floats_of(const v512 v, const kn_layer *L, uint32_t slice, uint32_t n) {
  size_t b = acts_layout(v, L->slice_len[slice], L->d.group, n).bytes;
  if (IS_FP8(v)) { /* + the prefill's converted rows: 4 of down after h, or 4 of gate/up */
    size_t d = kn__x86_align64(b) + 4 * fp8_pre_stride(L->slice_len[slice]);
    size_t g = 4 * fp8_pre_stride(L->d.hidden);
    b = d > g ? d : g;
  }
  return kn__x86_floats_for(b);
}
static void prep_of(const v512 v, const kn_layer *L, uint32_t n, const float *x, void *xq) {
  kn__x86_acts a = acts_layout(v, L->d.hidden, L->d.group, n);
  acts_convert(&a, L->d.group, n, x, L->d.hidden, xq);
}
static void prep_rows_of(const v512 v, const kn_layer *L, uint32_t n, const kn__rows *x, void *xq) {
  kn__x86_acts a = acts_layout(v, L->d.hidden, L->d.group, n);
  acts_convert_rows(&a, L->d.group, n, x, xq);
}
static bool takes_rows_all(const kn_layer *L, uint32_t n) {
  (void)L;
  (void)n;
  return true;
}
/* The kernels with a prep also read the caller's rows in place (kn__kernel.prep_rows). */
#define ROWS_ENTRY(V, id) \
  static void prep_rows_##id(const kn_layer *L, uint32_t n, const kn__rows *x, void *xq) { prep_rows_of(V, L, n, x, xq); }
#define WITH_ROWS(k, id) ((k).takes_rows = takes_rows_all, (k).prep_rows = prep_rows_##id)


KN__X86_ENTRY(V_F32, f32)
KN__X86_ENTRY(V_F16, f16)
KN__X86_ENTRY(V_BF16DP, bf16dp)
KN__X86_ENTRY(V_BF16F32, bf16f32)
KN__X86_ENTRY(V_I8, i8)
KN__X86_ENTRY(V_I4, i4)
KN__X86_ENTRY(V_FP8L, fp8l)
KN__X86_ENTRY(V_FP8S, fp8s)
ROWS_ENTRY(V_BF16DP, bf16dp)
ROWS_ENTRY(V_BF16F32, bf16f32)
ROWS_ENTRY(V_I8, i8)
ROWS_ENTRY(V_I4, i4)
ROWS_ENTRY(V_FP8L, fp8l)
ROWS_ENTRY(V_FP8S, fp8s)


void kn__avx512_register_cpu(kn__kernel_table *t, const kn__cpu *cpu) {
  t->k[KN_FMT_F32][KN_ISA_AVX512] = KN__X86_KERNEL(f32, false, "avx512_f32_f32", KN__RND_F32);
  t->k[KN_FMT_F16][KN_ISA_AVX512] = KN__X86_KERNEL(f16, false, "avx512_f16_f32", KN__RND_F32);
  kn__kernel *k = &t->k[KN_FMT_BF16][KN_ISA_AVX512];
  if (cpu->avx512_bf16) {
    *k = KN__X86_KERNEL(bf16dp, true, "avx512_bf16_bf16", KN__RND_BF16);
    WITH_ROWS(*k, bf16dp);
  } else {
    *k = KN__X86_KERNEL(bf16f32, true, "avx512_bf16_f32", KN__RND_F32);
    WITH_ROWS(*k, bf16f32);
  }
  /* Without VNNI the int8/int4 formats stay on the next ISA down (AVX2 fp32 FMA). */
  if (cpu->avx512_vnni) {
    t->k[KN_FMT_INT8][KN_ISA_AVX512] = KN__X86_KERNEL(i8, true, "avx512_int8_int8", KN__RND_Q8);
    t->k[KN_FMT_INT4][KN_ISA_AVX512] = KN__X86_KERNEL(i4, true, "avx512_int4_int8", KN__RND_Q8);
    WITH_ROWS(t->k[KN_FMT_INT8][KN_ISA_AVX512], i8);
    WITH_ROWS(t->k[KN_FMT_INT4][KN_ISA_AVX512], i4);
  }
  /* FP8 needs vdpbf16ps; the LUT conversion also VBMI (else the shift conversion). Without
   * BF16 it stays on the REF kernel. */
  pthread_once(&fp8_luts_once, fp8_luts_init);
  k = &t->k[KN_FMT_FP8][KN_ISA_AVX512];
  if (cpu->avx512_bf16 && cpu->avx512_vbmi) {
    *k = KN__X86_KERNEL(fp8l, true, "avx512_fp8lut_bf16", KN__RND_BF16);
    WITH_ROWS(*k, fp8l);
  } else if (cpu->avx512_bf16) {
    *k = KN__X86_KERNEL(fp8s, true, "avx512_fp8shift_bf16", KN__RND_BF16);
    WITH_ROWS(*k, fp8s);
  }
}

void kn__avx512_register(kn__kernel_table *t) { kn__avx512_register_cpu(t, kn__cpu_get()); }

/* The AVX-512 entry of format f for this CPU (NULL where it has none), from a table built
 * once: the AMX kernels forward small token counts to it (moe_amx.c). */
static kn__kernel_table cpu_tab;
static pthread_once_t cpu_tab_once = PTHREAD_ONCE_INIT;
static void cpu_tab_init(void) { kn__avx512_register(&cpu_tab); }
const kn__kernel *kn__avx512_kernel(kn_format f) {
  pthread_once(&cpu_tab_once, cpu_tab_init);
  const kn__kernel *k = &cpu_tab.k[f][KN_ISA_AVX512];
  return k->gate_up ? k : NULL;
}
