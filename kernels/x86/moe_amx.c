/*
 * moe_amx.c - the AMX entries of the kernel table (internal.h section C): bf16 x bf16 and
 * fp8-b128 x bf16 (TDPBF16PS), int8 x int8 and int4 x int8 (TDPBSSD), for many tokens per
 * expert.
 * Compiled twice (Makefile):
 *   - with -mamx-tile -mamx-bf16 -mamx-int8 and the AVX-512 flags into libkn, as
 *     kn__amx_register (listed in registrations[] of kn.c): the real instructions;
 *   - with -DKN_AMX_EMULATE=1 and the AVX-512 flags only, as the object the unit test
 *     tests/unit/test_kn_amx.c links (symbols kn__amx_emu_*): the SAME source over the
 *     scalar tile model of amx_tile.h, so that packing, tile indexing, edge tiles and
 *     dispatch are tested against kn_ref on CPUs without AMX (the Zen 4 this was written
 *     on). Everything but the eight tile macros is the same machine code path in both.
 *
 * Verified on real tiles (Intel Xeon, Emerald Rapids, AMX-TILE/BF16/INT8, 2026-12-02,
 * tests/unit/test_kn_amx.c) once the tile configuration was loaded through amx_tile.h's
 * own LDTILECFG: GCC 12's _tile_loadconfig let the compiler drop the configuration of
 * tiles 4-7, and the first TILELOADD killed every process with SIGILL. On CPUs without
 * AMX the tests run this object's machine code under a SIGILL trap that emulates each
 * tile instruction (tests/unit/amx_trap.h), which catches that class of bug too.

 * ---- operands: weights as A, activations as B ---------------------------------------
 *
 * The tile dot products compute C[M x N] += A[M x K] . B[K x N] where A's rows are K
 * contiguous (pairs of bf16 / quads of int8 per 4-byte column) and B is "VNNI-packed":
 * B row k holds, for each of the N columns, the pair / quad k of that column. The
 * canonical weight layout (internal.h section A: rows K-contiguous) IS the A layout, so
 * the weights are the A operand and are loaded straight from the packed layer with the
 * row stride (bf16 and int8, when a block has 16 rows and K is a multiple of the K step);
 * the activations, small and reused by every weight row, are VNNI-packed once per task
 * (prep for x, each down call for h). The output tile is therefore [rows x tokens] and
 * is transposed (16x16, in registers) on the way into h[token][row] / y[token][row].
 *
 *   bf16 (K step 32 elements):                               int8: the same with s8 quads,
 *                                                            K step 64 (colsb 64, 16 rows
 *           A = tile 4/5: 16 weight rows x 32 bf16          of 16 quads); int4: nibbles
 *               (row m = w[row0+m][k0 .. k0+31],             requantized to s8 rows on
 *                colsb 64, stride = row bytes)               one scale per row in tmp,
 *           B = tile 6/7: 16 pair-rows x 16 tokens          then as int8.
 *               (row k = (x[t][k0+2k], x[t][k0+2k+1])
 *                for t = 16 tokens, colsb 64)
 *           C = tiles 0-3: 16 rows x 16 tokens fp32 (int32 for int8 / int4)
 *
 *   per K step:  C0 += A4 . B6   C1 += A4 . B7   C2 += A5 . B6   C3 += A5 . B7
 *     gate_up: A4 = 16 gate rows, A5 = the same 16 up rows; B6 / B7 = 2 blocks of 16 tokens
 *     down:    A4 / A5 = two blocks of 16 down rows;        B6 / B7 = 2 blocks of 16 tokens
 *
 * Prepared activations of one task (n tokens, K elements), token block tb (16 tokens) at
 * tb * P * 64 bytes: a [P x 16] matrix of 4-byte columns, P = Kp * esz / 4 rows (Kp = K
 * rounded up to the K step), so that the B tile of K step kb is rows kb * (KS*esz/4) ..
 * of it, stride 64. Tokens beyond n and elements beyond K are zero (they then contribute
 * nothing whatever the weights hold). int8 / int4: then one fp32 scale per token (16 per
 * token block: amax / 127, the AVX-512 path's per-token quantization, round to nearest
 * even, clamp to +-127). No u8 offset trick is needed: AMX-INT8 has s8 x s8 (TDPBSSD).
 *
 * Edges: a row block of fewer than 16 rows, or K not a multiple of the K step, is copied
 * (zero-padded) into the worker's tmp before its tiles are loaded; int4 rows always are
 * (requantized to s8, requant_int4), and fp8 rows (converted to bf16 weights with their
 * block scales, fp8_row_bf16: then the bf16 tiles, activations and epilogue). Token tails
 * are the zero columns of B (results computed, not stored). int8 and int4 sums stay in
 * int32 over the whole K (|acc| <= 127 * 127 * 65536 < 2^31), converted once and
 * multiplied by the row's and the token's scales.
 * No new packed layout: weights are read in the canonical one (the edge copies, the int4
 * requantization and the fp8 conversion are the only repacking).
 *
 * ---- dispatch, crossover ------------------------------------------------------------
 *
 * Below the format's crossover (min_tok: measured defaults, or MOERPC_AMX_MIN_TOKENS, which
 * may ask kn.c to measure it through kn__amx_crossover) every entry (prep, prep_rows,
 * takes_rows, prep_bytes, tmp_floats, gate_up, down) forwards to the AVX-512 kernel of the
 * same format (kn__avx512_kernel), unchanged; from it on, the tiles. prep_bytes /
 * tmp_floats answer for the n they are given, so a task's buffers always match the path
 * its n takes. prep_rows packs x from the caller's rows (f32 / f16 / bf16, by token), prep
 * from fp32 rows: the same bytes.
 *
 * ---- the start-up gate --------------------------------------------------------------
 *
 * kn__amx_register fills the AMX column only when the CPU has AMX (kn__cpu.best ==
 * KN_ISA_AMX: cpuid, XCR0, the arch_prctl permission of kn.c) and AVX512_BF16/VNNI. Like
 * every fast entry, they are then candidates: the start-up self-test (kernels/selftest.c,
 * internal.h section F) runs each once in a child process against the REF kernels, with
 * the configuration audit below on, and a kernel that faults, hangs, or computes wrong
 * numbers is refused with one WARN while AVX-512 serves its format.
 *
 * Configuration audit: while kn__amx_cfg_audit(true), tiles_config reads the
 * configuration back (STTILECFG) after every LDTILECFG and compares it with what the
 * kernel asked for, built again from the K step alone: a compiler that drops a store of
 * the configuration (the SIGILL above) or an LDTILECFG that does not take is caught even
 * where it does not fault. The comparison never reads the struct that was loaded, so the
 * audit cannot make dead stores live again and hide the bug it looks for.
 *
 * Threads: as moe_avx512.c. Each call loads the tile configuration (tile state is per
 * thread), works in its own tmp, writes only its rows of h / y, and releases the tiles.
 */
#include "kernels/x86/common_x86.h"

#include "kernels/x86/amx_tile.h"

#include <immintrin.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#if KN_AMX_EMULATE
#define AMX_SYM(x) kn__amx_emu_##x
#define AMX_LABEL "amx-emulated"
#else
#define AMX_SYM(x) kn__amx_##x
#define AMX_LABEL "amx"
#endif

#define AI static inline __attribute__((always_inline))
#define UNROLL _Pragma("GCC unroll 16")

/* Tokens per expert from which the tiles are used (below: AVX-512), per format. Defaults:
 * the crossovers kn__amx_crossover ("the crossover" below) measured on an Emerald Rapids
 * Xeon (2026-12-04: bf16 8, int8 8, int4 16; 2026-12-06: fp8-b128 8). Fixed, not measured
 * at every start, so that a restarted process computes the same bits (which kernel serves a
 * count decides the last bits, and a measurement on a busy host moves by a step);
 * MOERPC_AMX_MIN_TOKENS sets them or asks for the measurement. Written only while the
 * process table is built, before any engine runs a kernel. KN_AMX_MIN_TOKENS: the value a
 * format without a default would get. */
#define KN_AMX_MIN_TOKENS 16u
#define KN_AMX_MIN_TOKENS_BF16 8u
#define KN_AMX_MIN_TOKENS_INT8 8u
#define KN_AMX_MIN_TOKENS_INT4 16u
#define KN_AMX_MIN_TOKENS_FP8 8u
#define KN_AMX_MIN_TOKENS_MAX 4096u

typedef enum av { A_BF16, A_I8, A_I4, A_FP8, A_COUNT } av;
static const kn_format av_format[A_COUNT] = {KN_FMT_BF16, KN_FMT_INT8, KN_FMT_INT4, KN_FMT_FP8};
static _Atomic uint32_t min_tok[A_COUNT] = {KN_AMX_MIN_TOKENS_BF16, KN_AMX_MIN_TOKENS_INT8,
                                             KN_AMX_MIN_TOKENS_INT4, KN_AMX_MIN_TOKENS_FP8};
static const char *const av_name[A_COUNT] = {AMX_LABEL "_bf16_bf16", AMX_LABEL "_int8_int8",
                                             AMX_LABEL "_int4_int8", AMX_LABEL "_fp8_bf16"};
/* The variants on bf16 tiles (TDPBF16PS, bf16 activations): bf16, and fp8 once its rows
 * are converted (fp8_row_bf16). */
#define BF_TILES(v) ((v) == A_BF16 || (v) == A_FP8)

/* ---- prepared activations (B operand) ---------------------------------------------- */

/* exp_ps, silu_ps (the epilogue) and the rows' loads and int8 quantization: the AVX-512
 * kernels' own. */
#include "kernels/x86/avx512_math.h"

typedef struct amx_acts {
  uint32_t K, KS, esz; /* elements, elements per K step, bytes per element */
  uint32_t nkb, ntb;   /* K steps, token blocks of 16 */
  uint32_t P;          /* 4-byte rows per token block: nkb * KS * esz / 4 */
  size_t tb_bytes;     /* P * 64 */
  size_t off_xs;       /* int8 / int4: ntb * 16 fp32 token scales */
  size_t bytes;
} amx_acts;

static uint32_t k_step(const av v) { return BF_TILES(v) ? 32 : 64; }

static amx_acts acts_layout(const av v, uint32_t K, uint32_t n) {
  amx_acts a;
  memset(&a, 0, sizeof a);
  a.K = K;
  a.KS = k_step(v);
  a.esz = BF_TILES(v) ? 2 : 1;
  a.nkb = (K + a.KS - 1) / a.KS;
  a.ntb = (n + 15) / 16;
  a.P = a.nkb * a.KS * a.esz / 4;
  a.tb_bytes = (size_t)a.P * 64;
  size_t at = a.tb_bytes * a.ntb;
  if (!BF_TILES(v)) {
    a.off_xs = at;
    at = kn__x86_align64(at + (size_t)a.ntb * 16 * sizeof(float));
  }
  a.bytes = at;
  return a;
}

static inline __mmask16 mask16(uint32_t n) { return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1); }
static inline __mmask32 mask32(uint32_t n) { return n >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << n) - 1); }
static inline __mmask64 mask64(uint32_t n) { return n >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << n) - 1); }
/* An int8 row chunk: 16 values of x from k on, quantized (kn__quant16), as bytes. */
AI __m128i quant16(const void *x, mr_dtype dt, uint32_t k, uint32_t K, __m512 inv) {
  return _mm512_cvtepi32_epi8(kn__quant16(x, dt, k, K, inv));
}

/* In-place transpose of a 16x16 matrix of 32-bit lanes (r[i] lane j <-> r[j] lane i). */
AI void transpose16(__m512 *r) {
  __m512i t[16], u[16];
  UNROLL for (int i = 0; i < 8; i++) {
    t[2 * i] = _mm512_unpacklo_epi32(_mm512_castps_si512(r[2 * i]), _mm512_castps_si512(r[2 * i + 1]));
    t[2 * i + 1] = _mm512_unpackhi_epi32(_mm512_castps_si512(r[2 * i]), _mm512_castps_si512(r[2 * i + 1]));
  }
  /* per 128-bit lane of u[4i + j]: rows 4i..4i+3 of column 4 * lane + j */
  UNROLL for (int i = 0; i < 4; i++) {
    u[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  UNROLL for (int j = 0; j < 4; j++) {
    __m512i v0 = _mm512_shuffle_i32x4(u[j], u[4 + j], _MM_SHUFFLE(2, 0, 2, 0));
    __m512i v1 = _mm512_shuffle_i32x4(u[j], u[4 + j], _MM_SHUFFLE(3, 1, 3, 1));
    __m512i w0 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], _MM_SHUFFLE(2, 0, 2, 0));
    __m512i w1 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], _MM_SHUFFLE(3, 1, 3, 1));
    r[0 + j] = _mm512_castsi512_ps(_mm512_shuffle_i32x4(v0, w0, _MM_SHUFFLE(2, 0, 2, 0)));
    r[8 + j] = _mm512_castsi512_ps(_mm512_shuffle_i32x4(v0, w0, _MM_SHUFFLE(3, 1, 3, 1)));
    r[4 + j] = _mm512_castsi512_ps(_mm512_shuffle_i32x4(v1, w1, _MM_SHUFFLE(2, 0, 2, 0)));
    r[12 + j] = _mm512_castsi512_ps(_mm512_shuffle_i32x4(v1, w1, _MM_SHUFFLE(3, 1, 3, 1)));
  }
}

/* Packs n rows of K values (src: where they are, of which dtype) into the layout a. Each
 * 64-byte chunk of a token's converted row (32 bf16 or 64 int8 = 16 columns of 4 bytes)
 * goes down one column of its token block: 4-byte column p to row p. Per token block and
 * 16 such rows, the 16 tokens' chunks are converted into registers, transposed 16 x 16
 * (rows p0..p0+15, one lane per token) and stored as 16 whole 64-byte rows; tokens past n
 * are zero columns, rows past P are not written (the layout has none). */
AI void acts_pack_dt(const av v, const amx_acts *a, uint32_t n, const kn__rows *src, const mr_dtype dt,
                     uint8_t *dst) {
  const uint32_t K = a->K;
  float *xs = !BF_TILES(v) ? (float *)(dst + a->off_xs) : NULL;
  if (xs) memset(xs, 0, (size_t)a->ntb * 16 * sizeof(float));
  for (uint32_t tb = 0; tb < a->ntb; tb++) {
    const uint32_t r0 = tb * 16, nv = n - r0 < 16 ? n - r0 : 16;
    uint8_t *blk = dst + (size_t)tb * a->tb_bytes;
    const char *row[16];
    float inv[16];
    for (uint32_t c = 0; c < nv; c++)
      row[c] = src->base + (size_t)(src->tok ? src->tok[r0 + c] : r0 + c) * src->stride;
    if (!BF_TILES(v))
      for (uint32_t c = 0; c < nv; c++) {
        __m512 iv;
        xs[r0 + c] = kn__quant_scale(row[c], dt, K, &iv);
        inv[c] = _mm512_cvtss_f32(iv);
      }
    for (uint32_t p0 = 0, k0 = 0; p0 < a->P; p0 += 16, k0 += BF_TILES(v) ? 32 : 64) {
      __m512 w[16];
      for (uint32_t c = 0; c < 16; c++) {
        if (c >= nv) {
          w[c] = _mm512_setzero_ps();
          continue;
        }
        const char *x = row[c];
        if (BF_TILES(v)) {
          w[c] = (__m512)_mm512_cvtne2ps_pbh(kn__ld16(x, dt, k0 + 16, K), kn__ld16(x, dt, k0, K));
        } else {
          const __m512 iv = _mm512_set1_ps(inv[c]);
          __m512i q = _mm512_castsi128_si512(quant16(x, dt, k0, K, iv));
          q = _mm512_inserti32x4(q, quant16(x, dt, k0 + 16, K, iv), 1);
          q = _mm512_inserti32x4(q, quant16(x, dt, k0 + 32, K, iv), 2);
          q = _mm512_inserti32x4(q, quant16(x, dt, k0 + 48, K, iv), 3);
          w[c] = _mm512_castsi512_ps(q);
        }
      }
      transpose16(w);
      const uint32_t rows = a->P - p0 < 16 ? a->P - p0 : 16;
      for (uint32_t j = 0; j < rows; j++) _mm512_storeu_ps((float *)(blk + (size_t)(p0 + j) * 64), w[j]);
    }
  }
}
/* One copy of the loop per dtype, so that the conversion is not a branch per load. */
static void acts_pack(const av v, const amx_acts *a, uint32_t n, const kn__rows *src, uint8_t *dst) {
  switch (src->dt) {
    case MR_DTYPE_BF16: acts_pack_dt(v, a, n, src, MR_DTYPE_BF16, dst); break;
    case MR_DTYPE_F16: acts_pack_dt(v, a, n, src, MR_DTYPE_F16, dst); break;
    default: acts_pack_dt(v, a, n, src, MR_DTYPE_F32, dst); break;
  }
}
/* n fp32 rows of K at x, one after another every stride floats. */
static void acts_pack_f32(const av v, const amx_acts *a, uint32_t n, const float *x, size_t stride, uint8_t *dst) {
  const kn__rows r = {.base = (const char *)x, .stride = stride * sizeof(float), .dt = MR_DTYPE_F32};
  acts_pack(v, a, n, &r, dst);
}

/* ---- the weight side (A operand) ----------------------------------------------------- */

typedef struct kctx {
  amx_acts a;        /* the B side of this step */
  const uint8_t *xb; /* prepared activations */
  const float *xs;   /* their token scales (int8 / int4) */
  uint32_t G, ng;    /* int4 group, groups per row */
  size_t rb;         /* bytes of one packed weight row */
  uint32_t KSb;      /* bytes of one K step of an A row (= A tile colsb) */
  size_t Kpb;        /* bytes of one zero-padded A row in tmp: nkb * KSb */
  bool direct;       /* K is a multiple of the K step: full row blocks load in place */
  uint8_t *scr[2];   /* two A row blocks of 16 x Kpb bytes */
  int32_t *stage;    /* 4 tiles of 16 x 16 int32 */
  float *res;        /* 4 tiles of 16 x 16 fp32 results */
  float rs[2][16];   /* int4: the scale of each row of the two A blocks once requantized */
} kctx;

/* Bytes of tmp the tiles need after the (down) activations. */
static size_t tile_tmp_bytes(const av v, uint32_t K) {
  uint32_t KS = k_step(v), esz = BF_TILES(v) ? 2 : 1;
  size_t Kpb = (size_t)((K + KS - 1) / KS) * KS * esz;
  return 2 * 16 * Kpb + 2 * 4 * 1024;
}

static kctx ctx_make(const av v, const kn_layer *L, uint32_t K, uint32_t n, const uint8_t *acts, uint8_t *tmp) {
  kctx cx;
  memset(&cx, 0, sizeof cx);
  cx.G = L->d.group;
  cx.a = acts_layout(v, K, n);
  cx.xb = acts;
  cx.xs = !BF_TILES(v) ? (const float *)(acts + cx.a.off_xs) : NULL;
  cx.ng = v == A_I4 ? kn__ngroups(K, cx.G) : v == A_FP8 ? kn__ngroups(K, KN_FP8_BLOCK) : 0;
  cx.rb = kn__row_bytes(L->d.format, K, cx.G);
  cx.KSb = cx.a.KS * cx.a.esz;
  cx.Kpb = (size_t)cx.a.nkb * cx.KSb;
  cx.direct = (v == A_BF16 || v == A_I8) && K % cx.a.KS == 0;
  cx.scr[0] = tmp;
  cx.scr[1] = tmp + 16 * cx.Kpb;
  cx.stage = (int32_t *)(tmp + 32 * cx.Kpb);
  cx.res = (float *)(tmp + 32 * cx.Kpb + 4096);
  return cx;
}

/* The 16 requantized codes of one group (see requant_int4), as a 128-bit table. */
static inline __m128i requant_tab(float f) {
  const __m512 qv = _mm512_set_ps(-1, -2, -3, -4, -5, -6, -7, -8, 7, 6, 5, 4, 3, 2, 1, 0);
  return _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(qv, _mm512_set1_ps(f)))); /* MXCSR: RNE */
}

#define KN_AMX_RQ_SEG 64u /* groups whose tables requant_int4 builds at a time */

/* int4 on the tiles: one int4 row (nibbles at s, group scales gs) becomes Kpb s8 values
 * in d (zero past the row) on ONE scale per row, srow = max_g gs[g] * 8 / 127, which is
 * returned: q8 = round_even(q4 * (gs[g] / srow)), so |q8| <= 127 for every nibble (-8
 * included). A row then sums in int32 through TDPBSSD like int8, where summing one group
 * at a time flushed the four result tiles through memory after every K step (G = 64).
 * The cost is a second rounding of each weight, by at most srow / 2 (BENCHMARKS, "AMX":
 * the layer's error stays within the int8 tolerance). */
static float requant_int4(const kctx *cx, const uint8_t *s, const float *gs, uint8_t *d) {
  const size_t Kpb = cx->Kpb, have = cx->rb < Kpb / 2 ? cx->rb : Kpb / 2; /* nibble bytes to read */
  const uint32_t ng = cx->ng, hshift = (uint32_t)__builtin_ctz(cx->G / 32); /* 32-element halves per group: 1, 2, 4 */
  __m512 mx = _mm512_setzero_ps();
  for (uint32_t g = 0; g < ng; g += 16) mx = _mm512_max_ps(mx, _mm512_maskz_loadu_ps(mask16(ng - g), gs + g));
  const float srow = _mm512_reduce_max_ps(mx) * (8.0f / 127.0f), inv = srow > 0.0f ? 1.0f / srow : 0.0f;
  /* A group's table: byte c = round_even(q(c) * gs[g] / srow), q(c) the signed value of
   * nibble c (0..7, then -8..-1); one byte shuffle then requantizes the 16 codes of a
   * 128-bit lane, which lie in one group (G >= 32, groups start at multiples of 32). The
   * tables of KN_AMX_RQ_SEG groups are built first, independent of each other. Past the
   * last group (the zero padding up to the K step: code 0) a zero table gives 0 as well. */
  _Alignas(16) uint8_t tab[KN_AMX_RQ_SEG + 1][16];
  memset(tab[KN_AMX_RQ_SEG], 0, 16);
  const __m512i m4 = _mm512_set1_epi16(0xf);
  const size_t halves = Kpb / 32, seg = (size_t)KN_AMX_RQ_SEG << hshift; /* both even */
  for (size_t h0 = 0; h0 < halves; h0 += seg) {
    const uint32_t g0 = (uint32_t)(h0 >> hshift), gn = g0 < ng ? (ng - g0 < KN_AMX_RQ_SEG ? ng - g0 : KN_AMX_RQ_SEG) : 0;
    for (uint32_t i = 0; i < gn; i++) _mm_store_si128((__m128i *)tab[i], requant_tab(gs[g0 + i] * inv));
    const size_t h1 = halves - h0 < seg ? halves : h0 + seg;
    for (size_t h = h0; h < h1; h += 2) {
      const uint32_t ta = (uint32_t)(h >> hshift) - g0, tb = (uint32_t)((h + 1) >> hshift) - g0;
      const __m512i t = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_broadcastsi128_si256(_mm_load_si128((const __m128i *)tab[ta < gn ? ta : KN_AMX_RQ_SEG]))),
          _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i *)tab[tb < gn ? tb : KN_AMX_RQ_SEG])), 1);
      /* 32 bytes = 64 codes: byte b -> its low nibble (element 2b), then its high one */
      const size_t b0 = h * 16;
      const __mmask32 lm = b0 < have ? mask32((uint32_t)(have - b0)) : 0;
      __m512i w = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(lm, s + b0));
      __m512i codes = _mm512_or_si512(_mm512_and_si512(w, m4),
                                      _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(w, 4), m4), 8));
      _mm512_mask_storeu_epi8(d + 2 * b0, mask64((uint32_t)(Kpb - 2 * b0)), _mm512_shuffle_epi8(t, codes));
    }
  }
  return srow;
}

/* fp8 on the tiles: one row of K e4m3 codes (block scales gs, one per 128 columns) becomes
 * Kpb / 2 bf16 weights in d, each bf16(code value * its block's scale), zero past K. The
 * scale cannot stay outside the dot product as in the AVX-512 kernel (a tile sums the whole
 * K, and the scale changes every 128 columns), so it goes into the weight: one bf16
 * rounding of each weight (relative 2^-9 at most), which the bf16 tolerance covers
 * (tests/unit/test_kn_amx.c). 32 codes at a time: widened to fp16 bits whose value is
 * code / 256 exactly, subnormals included ((c & 0x7f) << 7, sign to bit 15: the AVX2
 * kernel's conversion, fp8_avx2.h), to fp32 (vcvtph2ps), times scale * 256 (exact), and
 * rounded to bf16 (vcvtne2ps2bf16, nearest even). The codes are this call's first touch of
 * the weights, one stream through a block's rows (contiguous), so each line is prefetched
 * KN_AMX_FP8_PF bytes ahead: without it the loads waited on DRAM for most of the
 * conversion's time (DeepSeek-V3 shapes, 2 threads: T = 2048 2.40-2.70 s -> 1.56 s, T = 256
 * 504-533 -> 268-292 ms; 1 KiB ahead slower, 4 KiB no better; docs/BENCHMARKS.md). */
#define KN_AMX_FP8_PF 2048u
static void fp8_row_bf16(const kctx *cx, const uint8_t *s, const float *gs, uint8_t *d) {
  const size_t K = cx->rb, n = cx->Kpb / 2; /* codes in the row, bf16 weights to write */
  const __m512i m7f = _mm512_set1_epi16(0x7f);
  for (size_t k = 0; k < n; k += 32) {
    const uint32_t g = (uint32_t)(k / KN_FP8_BLOCK) < cx->ng ? (uint32_t)(k / KN_FP8_BLOCK) : cx->ng - 1;
    const __m512 sv = _mm512_set1_ps(gs[g] * 256.0f);
    if ((k & 63) == 0) _mm_prefetch((const char *)s + k + KN_AMX_FP8_PF, _MM_HINT_T0);
    const __m256i c8 = _mm256_maskz_loadu_epi8(k < K ? mask32((uint32_t)(K - k)) : 0, s + k);
    const __m512i w = _mm512_cvtepu8_epi16(c8);
    /* (w & 0x7f) << 7 | (w & 0x80) << 8: (w << 7) & 0x3f80, then bit 7 of w to bit 15 */
    const __m512i h = _mm512_ternarylogic_epi32(_mm512_slli_epi16(_mm512_and_si512(w, m7f), 7),
                                                _mm512_slli_epi16(w, 8), _mm512_set1_epi16((short)0x8000), 0xF8);
    const __m512 lo = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(h)), sv);
    const __m512 hi = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1)), sv);
    _mm512_storeu_si512(d + 2 * k, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
}

/* The 16-row A block of rows [row, row + Mv) of a matrix at base: in place (stride rb)
 * when it is whole and K a multiple of the K step; else copied into scr with zero padding
 * (stride Kpb). int4 rows (scales sc: [rows][ng]) are always copied, requantized to s8 on
 * one scale per row, rs[r] (requant_int4; rs[r] = 0 for the zero rows past Mv); fp8 rows
 * (block scales sc: [rows][ng]) are always converted to bf16 with their scales
 * (fp8_row_bf16). */
static const uint8_t *a_block(const av v, const kctx *cx, const uint8_t *base, const float *sc, uint32_t row,
                              uint32_t Mv, uint8_t *scr, float rs[16], size_t *stride) {
  if (cx->direct && Mv == 16) {
    *stride = cx->rb;
    return base + (size_t)row * cx->rb;
  }
  *stride = cx->Kpb;
  const size_t Kpb = cx->Kpb;
  for (uint32_t r = 0; r < 16; r++) {
    uint8_t *d = scr + r * Kpb;
    if (r >= Mv) {
      memset(d, 0, Kpb);
      if (v == A_I4) rs[r] = 0.0f;
      continue;
    }
    const uint8_t *s = base + (size_t)(row + r) * cx->rb;
    if (v == A_FP8) {
      fp8_row_bf16(cx, s, sc + (size_t)(row + r) * cx->ng, d);
      continue;
    }
    if (v != A_I4) {
      memcpy(d, s, cx->rb);
      memset(d + cx->rb, 0, Kpb - cx->rb);
      continue;
    }
    rs[r] = requant_int4(cx, s, sc + (size_t)(row + r) * cx->ng, d);
  }
  return scr;
}

/* The configuration every kernel loads for A rows of KSb bytes per K step. */
static void cfg_make(kn__amx_cfg *c, uint32_t KSb) {
  kn__amx_cfg_init(c);
  for (int t = 0; t < 4; t++) kn__amx_cfg_tile(c, t, 16, 64); /* C */
  kn__amx_cfg_tile(c, 4, 16, (int)KSb);                       /* A */
  kn__amx_cfg_tile(c, 5, 16, (int)KSb);
  kn__amx_cfg_tile(c, 6, (int)KSb / 4, 64);                   /* B */
  kn__amx_cfg_tile(c, 7, (int)KSb / 4, 64);
}

/* ---- configuration audit (see the top of the file) ------------------------------------ */

static atomic_bool audit_on;
static atomic_uint_fast64_t audit_bad, audit_loads;
static atomic_flag audit_first_taken = ATOMIC_FLAG_INIT;
static char audit_first[160];

static __attribute__((noinline)) void cfg_audit(uint32_t KSb) {
  _Alignas(64) kn__amx_cfg got, want;
  KN_AMX_STORECFG(&got);
  cfg_make(&want, KSb);
  atomic_fetch_add(&audit_loads, 1);
  if (memcmp(&got, &want, sizeof want) == 0) return;
  if (!atomic_flag_test_and_set(&audit_first_taken)) {
    int t = 0;
    while (t < 16 && got.rows[t] == want.rows[t] && got.colsb[t] == want.colsb[t]) t++;
    if (t < 16)
      snprintf(audit_first, sizeof audit_first, "tile %d read back as %u rows x %u bytes, loaded as %u x %u",
               t, got.rows[t], got.colsb[t], want.rows[t], want.colsb[t]);
    else
      snprintf(audit_first, sizeof audit_first, "palette read back as %u, loaded as %u", got.palette,
               want.palette);
  }
  atomic_fetch_add(&audit_bad, 1);
}

void AMX_SYM(cfg_audit)(bool on) { atomic_store(&audit_on, on); }

uint64_t AMX_SYM(cfg_audit_loads)(void) { return atomic_load(&audit_loads); }

uint64_t AMX_SYM(cfg_audit_take)(char *why, size_t n) {
  uint64_t bad = atomic_exchange(&audit_bad, 0);
  if (why && n) snprintf(why, n, "%s", bad ? audit_first : "");
  atomic_flag_clear(&audit_first_taken);
  return bad;
}

static void tiles_config(const kctx *cx) {
  _Alignas(64) kn__amx_cfg c;
  cfg_make(&c, cx->KSb);
  KN_AMX_LOADCFG(&c);
  if (atomic_load_explicit(&audit_on, memory_order_relaxed)) cfg_audit(cx->KSb);
}

#define DOT(v, c, a, b)                 \
  do {                                  \
    if (BF_TILES(v))                    \
      KN_AMX_DPBF16PS(c, a, b);         \
    else                                \
      KN_AMX_DPBSSD(c, a, b);           \
  } while (0)

/* res[2 * ia + ib] (16 rows x 16 tokens) = A_ia . B_ib over the whole K, for ia < na
 * (A1 = NULL: one; astride[ia] = A_ia's row stride), ib < nb. B is token block tb's
 * [P x 16] matrix, B_1 the next one. int8 / int4 sums stay in int32 (|acc| <= 127 * 127 *
 * K) and are converted to fp32 once, at the end. */
static void micro(const av v, const kctx *cx, const uint8_t *A0, const uint8_t *A1, const size_t astride[2],
                  const uint8_t *B, uint32_t nb) {
  const bool two_a = A1 != NULL, two_b = nb > 1;
  const uint32_t nkb = cx->a.nkb, KSb = cx->KSb;
  const size_t btile = (size_t)KSb * 16; /* KSb / 4 rows of 64 bytes */
  KN_AMX_ZERO(0);
  if (two_b) KN_AMX_ZERO(1);
  if (two_a) {
    KN_AMX_ZERO(2);
    if (two_b) KN_AMX_ZERO(3);
  }
  for (uint32_t kb = 0; kb < nkb; kb++) {
    KN_AMX_LOAD(4, A0 + (size_t)kb * KSb, astride[0]);
    if (two_a) KN_AMX_LOAD(5, A1 + (size_t)kb * KSb, astride[1]);
    KN_AMX_LOAD(6, B + kb * btile, 64);
    if (two_b) KN_AMX_LOAD(7, B + cx->a.tb_bytes + kb * btile, 64);
    DOT(v, 0, 4, 6);
    if (two_b) DOT(v, 1, 4, 7);
    if (two_a) {
      DOT(v, 2, 5, 6);
      if (two_b) DOT(v, 3, 5, 7);
    }
  }
  /* bf16 results straight into res; int8 / int4 through stage */
  void *dst = BF_TILES(v) ? (void *)cx->res : (void *)cx->stage;
  KN_AMX_STORE(0, (uint8_t *)dst + 0 * 1024, 64);
  if (two_b) KN_AMX_STORE(1, (uint8_t *)dst + 1 * 1024, 64);
  if (two_a) {
    KN_AMX_STORE(2, (uint8_t *)dst + 2 * 1024, 64);
    if (two_b) KN_AMX_STORE(3, (uint8_t *)dst + 3 * 1024, 64);
  }
  if (BF_TILES(v)) return;
  for (uint32_t c = 0; c < 4; c++) {
    if ((c / 2 && !two_a) || (c % 2 && !two_b)) continue;
    for (uint32_t m = 0; m < 16; m++)
      _mm512_storeu_ps(cx->res + c * 256 + m * 16, _mm512_cvtepi32_ps(_mm512_loadu_si512(cx->stage + c * 256 + m * 16)));
  }
}

/* Row m's multiplier of the result tile: int8 / int4 the weight row's scale (wscale: the
 * layer's for int8, the requantized block's for int4) times the token's; bf16 1, and fp8 1
 * (its scales are in the converted weights). */
AI __m512 row_scaled(const av v, const kctx *cx, uint32_t c, uint32_t m, const float *wscale, uint32_t Mv, __m512 xsv) {
  __m512 r = _mm512_loadu_ps(cx->res + c * 256 + m * 16);
  if (!BF_TILES(v)) r = _mm512_mul_ps(r, _mm512_mul_ps(_mm512_set1_ps(m < Mv ? wscale[m] : 0.0f), xsv));
  return r;
}

/* Token blocks per pass over a task's rows: as many as keep the B operand of one pass
 * (b_chunk bytes, default KN_AMX_B_CHUNK) in the core's L2 while every row block of the
 * task meets it; even (the micro kernel takes blocks in pairs) and at least 2, or all of
 * them in one pass. Without passes, from a few hundred tokens per expert on, each row
 * block streamed all of B again from beyond L2 (BENCHMARKS, "AMX"). Each (row block,
 * token pair) is computed whole either way, so the results do not depend on it. */
#define KN_AMX_B_CHUNK ((size_t)1 << 20)
static _Atomic size_t b_chunk = KN_AMX_B_CHUNK;

void AMX_SYM(set_b_chunk)(size_t bytes) { atomic_store(&b_chunk, bytes ? bytes : KN_AMX_B_CHUNK); }

static uint32_t chunk_blocks(const kctx *cx) {
  size_t nb = atomic_load_explicit(&b_chunk, memory_order_relaxed) / cx->a.tb_bytes;
  if (nb >= cx->a.ntb) return cx->a.ntb; /* one pass */
  nb &= ~(size_t)1;
  return nb < 2 ? 2u : (uint32_t)nb;
}

AI void amx_gate_up(const av v, const kn__task *t, uint32_t i0, uint32_t i1) {
  const kn_layer *L = t->L;
  const uint32_t n = t->n, H = L->d.hidden, Is = L->slice_len[t->slice];
  if (n == 0 || i0 >= i1) return;
  const kn__slice_w *ws = t->w;
  kctx cx = ctx_make(v, L, H, n, (const uint8_t *)t->xq, (uint8_t *)t->tmp);
  tiles_config(&cx);
  const uint32_t cb = chunk_blocks(&cx);
  for (uint32_t tc0 = 0; tc0 < cx.a.ntb; tc0 += cb) {
    const uint32_t tc1 = cx.a.ntb - tc0 < cb ? cx.a.ntb : tc0 + cb;
    for (uint32_t i = i0; i < i1; i += 16) {
      const uint32_t Mv = i1 - i < 16 ? i1 - i : 16;
      size_t st[2];
      const uint8_t *Ag = a_block(v, &cx, ws->gate, ws->gate_scale, i, Mv, cx.scr[0], cx.rs[0], &st[0]);
      const uint8_t *Au = a_block(v, &cx, ws->up, ws->up_scale, i, Mv, cx.scr[1], cx.rs[1], &st[1]);
      /* the rows' weight scales (int8: the layer's; int4: the requantized block's; bf16 and
       * fp8: none, fp8's are in its converted weights) */
      const float *gsc = v == A_I8 ? ws->gate_scale + i : cx.rs[0], *usc = v == A_I8 ? ws->up_scale + i : cx.rs[1];
      for (uint32_t tb = tc0; tb < tc1; tb += 2) {
        const uint32_t nb = tc1 - tb < 2 ? 1 : 2;
        micro(v, &cx, Ag, Au, st, cx.xb + tb * cx.a.tb_bytes, nb);
        for (uint32_t ib = 0; ib < nb; ib++) {
          const uint32_t c0 = (tb + ib) * 16, Nv = n - c0 < 16 ? n - c0 : 16;
          const __m512 xsv = !BF_TILES(v) ? _mm512_loadu_ps(cx.xs + c0) : _mm512_set1_ps(1.0f);
          __m512 hv[16];
          UNROLL for (uint32_t m = 0; m < 16; m++) {
            __m512 g = row_scaled(v, &cx, ib, m, gsc, Mv, xsv);
            __m512 u = row_scaled(v, &cx, 2 + ib, m, usc, Mv, xsv);
            hv[m] = _mm512_mul_ps(silu_ps(g), u);
          }
          transpose16(hv);
          for (uint32_t c = 0; c < Nv; c++) _mm512_mask_storeu_ps(t->h + (size_t)(c0 + c) * Is + i, mask16(Mv), hv[c]);
        }
      }
    }
  }
  KN_AMX_RELEASE();
}

AI void amx_down(const av v, const kn__task *t, uint32_t j0, uint32_t j1) {
  const kn_layer *L = t->L;
  const uint32_t n = t->n, H = L->d.hidden, Is = L->slice_len[t->slice];
  if (n == 0 || j0 >= j1) return;
  const kn__slice_w *ws = t->w;
  /* h packed by every down call into its own tmp (as moe_avx512.c), the tiles' scratch after it */
  const amx_acts a = acts_layout(v, Is, n);
  uint8_t *acts = (uint8_t *)t->tmp;
  acts_pack_f32(v, &a, n, t->h, Is, acts);
  kctx cx = ctx_make(v, L, Is, n, acts, acts + kn__x86_align64(a.bytes));
  tiles_config(&cx);
  const uint32_t cb = chunk_blocks(&cx);
  for (uint32_t tc0 = 0; tc0 < cx.a.ntb; tc0 += cb) {
    const uint32_t tc1 = cx.a.ntb - tc0 < cb ? cx.a.ntb : tc0 + cb;
    for (uint32_t j = j0; j < j1; j += 32) {
      const uint32_t M0 = j1 - j < 16 ? j1 - j : 16, M1 = j1 - j <= 16 ? 0 : (j1 - j - 16 < 16 ? j1 - j - 16 : 16);
      size_t st[2] = {0, 0};
      const uint8_t *A0 = a_block(v, &cx, ws->down, ws->down_scale, j, M0, cx.scr[0], cx.rs[0], &st[0]);
      const uint8_t *A1 =
          M1 ? a_block(v, &cx, ws->down, ws->down_scale, j + 16, M1, cx.scr[1], cx.rs[1], &st[1]) : NULL;
      const uint32_t Mvs[2] = {M0, M1};
      for (uint32_t tb = tc0; tb < tc1; tb += 2) {
        const uint32_t nb = tc1 - tb < 2 ? 1 : 2;
        micro(v, &cx, A0, A1, st, cx.xb + tb * cx.a.tb_bytes, nb);
        for (uint32_t ia = 0; ia < (A1 ? 2u : 1u); ia++)
          for (uint32_t ib = 0; ib < nb; ib++) {
            const uint32_t c0 = (tb + ib) * 16, Nv = n - c0 < 16 ? n - c0 : 16;
            const uint32_t row = j + 16 * ia, Mv = Mvs[ia];
            const __m512 xsv = !BF_TILES(v) ? _mm512_loadu_ps(cx.xs + c0) : _mm512_set1_ps(1.0f);
            __m512 yv[16];
            UNROLL for (uint32_t m = 0; m < 16; m++)
              yv[m] = row_scaled(v, &cx, 2 * ia + ib, m, v == A_I8 ? ws->down_scale + row : cx.rs[ia], Mv, xsv);
            transpose16(yv);
            for (uint32_t c = 0; c < Nv; c++) _mm512_mask_storeu_ps(t->y + (size_t)(c0 + c) * H + row, mask16(Mv), yv[c]);
          }
      }
    }
  }
  KN_AMX_RELEASE();
}

/* ---- table entries: tiles from the crossover on (forced: always), AVX-512 below ---- */

#define SMALL(FORCED, V, n) (!(FORCED) && (n) < atomic_load_explicit(&min_tok[V], memory_order_relaxed))

static kn__kernel fallback[A_COUNT]; /* the AVX-512 kernels, set before any entry is used */

static size_t amx_prep_bytes(const av v, const kn_layer *L, uint32_t n) {
  return acts_layout(v, L->d.hidden, n).bytes;
}
static size_t amx_tmp_floats(const av v, const kn_layer *L, uint32_t s, uint32_t n) {
  const uint32_t H = L->d.hidden, Is = L->slice_len[s];
  size_t gu = tile_tmp_bytes(v, H);
  size_t dn = kn__x86_align64(acts_layout(v, Is, n).bytes) + tile_tmp_bytes(v, Is);
  return kn__x86_floats_for(gu > dn ? gu : dn);
}

#define AMX_ENTRY(V, id, FORCED)                                                                     \
  static void gate_up_##id(const kn__task *t, uint32_t i0, uint32_t i1) {                          \
    if (SMALL(FORCED, V, t->n)) fallback[V].gate_up(t, i0, i1);                                               \
    else amx_gate_up(V, t, i0, i1);                                                                 \
  }                                                                                                 \
  static void down_##id(const kn__task *t, uint32_t j0, uint32_t j1) {                             \
    if (SMALL(FORCED, V, t->n)) fallback[V].down(t, j0, j1);                                                  \
    else amx_down(V, t, j0, j1);                                                                    \
  }                                                                                                 \
  static void prep_##id(const kn_layer *L, uint32_t n, const float *x, void *xq) {                 \
    if (SMALL(FORCED, V, n)) {                                                                                \
      if (fallback[V].prep) fallback[V].prep(L, n, x, xq);                                          \
      return;                                                                                       \
    }                                                                                               \
    amx_acts a = acts_layout(V, L->d.hidden, n);                                                    \
    acts_pack_f32(V, &a, n, x, L->d.hidden, xq);                                                    \
  }                                                                                                 \
  static bool takes_rows_##id(const kn_layer *L, uint32_t n) {                                     \
    if (SMALL(FORCED, V, n)) return fallback[V].takes_rows && fallback[V].takes_rows(L, n);         \
    return true;                                                                                    \
  }                                                                                                 \
  static void prep_rows_##id(const kn_layer *L, uint32_t n, const kn__rows *x, void *xq) {         \
    if (SMALL(FORCED, V, n)) {                                                                      \
      fallback[V].prep_rows(L, n, x, xq);                                                           \
      return;                                                                                       \
    }                                                                                               \
    amx_acts a = acts_layout(V, L->d.hidden, n);                                                    \
    acts_pack(V, &a, n, x, xq);                                                                     \
  }                                                                                                 \
  static size_t prep_bytes_##id(const kn_layer *L, uint32_t n) {                                   \
    if (SMALL(FORCED, V, n)) return fallback[V].prep_bytes ? fallback[V].prep_bytes(L, n) : 0;               \
    return amx_prep_bytes(V, L, n);                                                                 \
  }                                                                                                 \
  static size_t tmp_##id(const kn_layer *L, uint32_t s, uint32_t n) {                              \
    if (SMALL(FORCED, V, n)) return fallback[V].tmp_floats(L, s, n);                                          \
    return amx_tmp_floats(V, L, s, n);                                                              \
  }

AMX_ENTRY(A_BF16, bf16, 0)
AMX_ENTRY(A_I8, i8, 0)
AMX_ENTRY(A_I4, i4, 0)
AMX_ENTRY(A_FP8, fp8, 0)
AMX_ENTRY(A_BF16, bf16_all, 1)
AMX_ENTRY(A_I8, i8_all, 1)
AMX_ENTRY(A_I4, i4_all, 1)
AMX_ENTRY(A_FP8, fp8_all, 1)

#define AMX_KERNEL(id, label, rnd)                                                             \
  (kn__kernel) {                                                                               \
    .gate_up = gate_up_##id, .down = down_##id, .prep = prep_##id, .prep_bytes = prep_bytes_##id, \
    .takes_rows = takes_rows_##id, .prep_rows = prep_rows_##id,                                \
    .tmp_floats = tmp_##id, .name = label, .rounding = rnd, .audit_on = AMX_SYM(cfg_audit),   \
    .audit_take = AMX_SYM(cfg_audit_take)                                                      \
  }

static void kernels_of(av v, kn__kernel *dispatched, kn__kernel *forced) {
  switch (v) {
    case A_BF16:
      *dispatched = AMX_KERNEL(bf16, av_name[v], KN__RND_BF16);
      *forced = AMX_KERNEL(bf16_all, av_name[v], KN__RND_BF16);
      break;
    case A_I8:
      *dispatched = AMX_KERNEL(i8, av_name[v], KN__RND_Q8);
      *forced = AMX_KERNEL(i8_all, av_name[v], KN__RND_Q8);
      break;
    case A_FP8:
      *dispatched = AMX_KERNEL(fp8, av_name[v], KN__RND_BF16);
      *forced = AMX_KERNEL(fp8_all, av_name[v], KN__RND_BF16);
      break;
    default:
      *dispatched = AMX_KERNEL(i4, av_name[v], KN__RND_Q8);
      *forced = AMX_KERNEL(i4_all, av_name[v], KN__RND_Q8);
      break;
  }
}

/* The CPU features the entries need besides the tiles (AVX-512 with BF16 for the
 * activation packing and the epilogue, and the AVX-512 kernels of the fallback). */
static bool cpu_can_run(const kn__cpu *c, bool need_amx) {
  if (c->best < KN_ISA_AVX512 || !c->avx512_bf16 || !c->avx512_vnni) return false;
  return !need_amx || c->best == KN_ISA_AMX;
}

static pthread_once_t fallback_once = PTHREAD_ONCE_INIT;
static bool fallback_ok[A_COUNT];
static void fallback_init(void) {
  for (int v = 0; v < A_COUNT; v++) {
    const kn__kernel *k = kn__avx512_kernel(av_format[v]);
    fallback_ok[v] = k != NULL;
    if (k) fallback[v] = *k;
  }
}

/* The entries of format f (gate_up NULL where there is none): `dispatched` switches to
 * the AVX-512 kernel below KN_AMX_MIN_TOKENS, `forced` uses the tiles at every n. */
void AMX_SYM(kernels)(kn_format f, kn__kernel *dispatched, kn__kernel *forced) {
  pthread_once(&fallback_once, fallback_init);
  memset(dispatched, 0, sizeof *dispatched);
  memset(forced, 0, sizeof *forced);
  for (int v = 0; v < A_COUNT; v++)
    if (av_format[v] == f && fallback_ok[v]) kernels_of((av)v, dispatched, forced);
}

uint32_t AMX_SYM(min_tokens)(kn_format f) {
  for (int v = 0; v < A_COUNT; v++)
    if (av_format[v] == f) return atomic_load(&min_tok[v]);
  return KN_AMX_MIN_TOKENS;
}

void AMX_SYM(set_min_tokens)(kn_format f, uint32_t n) {
  if (n < 1) n = 1;
  if (n > KN_AMX_MIN_TOKENS_MAX) n = KN_AMX_MIN_TOKENS_MAX;
  for (int v = 0; v < A_COUNT; v++)
    if (av_format[v] == f) atomic_store(&min_tok[v], n);
}

/* ---- the crossover, measured ----------------------------------------------------------
 *
 * Where the tiles start to pay depends on the CPU (tile throughput against AVX-512's, the
 * caches) and on the format (on Emerald Rapids Xeons: bf16 ~16 and int8 ~4 in the issue's
 * run; bf16 8, int8 8-16 and int4 16 on 2026-12-04). So it can be measured once per
 * process (MOERPC_AMX_MIN_TOKENS=measure; the defaults above came from it), on the calling
 * thread, after the self-test has shown the entries run: KN_XO_EXPERTS
 * synthetic experts of hidden KN_XO_H x inter KN_XO_I (bf16 3 MiB each: together past the
 * L2 of one core, as a real layer's weights are), the AVX-512 kernel and the tiles
 * alternately at each token count of xo_ns, best of KN_XO_ROUNDS. The crossover is the
 * smallest count from which the tiles are faster at every larger count measured
 * (KN_AMX_MIN_TOKENS_MAX if never); ratio[i] gets tiles / AVX-512 time at xo_ns[i].
 * About 10-25 ms per format. */
#define KN_XO_H 1024u
#define KN_XO_I 512u
#define KN_XO_EXPERTS 2u
#define KN_XO_ROUNDS 2u
static const uint32_t xo_ns[KN_XO_NS] = KN_XO_NS_INIT;

/* One pass of kernel k over the experts at n tokens; seconds. */
static double xo_pass(const kn__kernel *k, const kn_layer *L, const kn__slice_w *w, uint32_t n,
                      const float *x, void *xq, float *h, float *y, float *tmp) {
  const uint64_t t0 = mr_now_ns();
  for (uint32_t e = 0; e < KN_XO_EXPERTS; e++) {
    if (k->prep) k->prep(L, n, x, xq);
    const kn__task t = {.L = L, .slice = 0, .w = &w[e], .n = n, .x = x, .xq = xq, .h = h, .y = y, .tmp = tmp};
    k->gate_up(&t, 0, KN_XO_I);
    k->down(&t, 0, KN_XO_H);
  }
  return (double)(mr_now_ns() - t0) / 1e9;
}

int AMX_SYM(crossover)(kn_format f, uint32_t *min_tokens, double ratio[KN_XO_NS]) {
  pthread_once(&fallback_once, fallback_init);
  int v = -1;
  for (int i = 0; i < A_COUNT; i++)
    if (av_format[i] == f && fallback_ok[i]) v = i;
  if (v < 0) return MR_ENOTSUP;
  kn__kernel dk, fk;
  kernels_of((av)v, &dk, &fk);
  const kn__kernel *avx = &fallback[v];
  const uint32_t H = KN_XO_H, I = KN_XO_I, G = 128, nmax = xo_ns[KN_XO_NS - 1];
  kn_layer L;
  memset(&L, 0, sizeof L);
  L.d = (kn_layer_desc){.hidden = H, .inter = I, .num_experts = KN_XO_EXPERTS, .format = f, .group = G};
  L.n_slices = 1;
  L.slice_len[0] = I;
  L.max_slice_len = I;
  const size_t rbg = kn__row_bytes(f, H, G), rbd = kn__row_bytes(f, I, G);
  const size_t nsg = kn__row_scales(f, H, G), nsd = kn__row_scales(f, I, G);
  const size_t wbytes = (2 * (size_t)I * rbg + (size_t)H * rbd) + 4 * 64;
  const size_t sbytes = (2 * (size_t)I * nsg + (size_t)H * nsd) * sizeof(float) + 4 * 64;
  size_t xq_bytes = 0, tmp_floats = 0;
  for (uint32_t i = 0; i < KN_XO_NS; i++) {
    const kn__kernel *ks[2] = {avx, &fk};
    for (int j = 0; j < 2; j++) {
      size_t pb = ks[j]->prep_bytes ? ks[j]->prep_bytes(&L, xo_ns[i]) : 0;
      size_t tf = ks[j]->tmp_floats(&L, 0, xo_ns[i]);
      if (pb > xq_bytes) xq_bytes = pb;
      if (tf > tmp_floats) tmp_floats = tf;
    }
  }
  kn__slice_w w[KN_XO_EXPERTS];
  memset(w, 0, sizeof w);
  uint8_t *mem[KN_XO_EXPERTS] = {NULL};
  float *x = mr_malloc_aligned((size_t)nmax * H * sizeof(float) + 256, 64);
  float *h = mr_malloc_aligned((size_t)(nmax + 2) * I * sizeof(float) + 256, 64);
  float *y = mr_malloc_aligned((size_t)(nmax + 2) * H * sizeof(float) + 256, 64);
  float *tmp = mr_malloc_aligned(tmp_floats * sizeof(float) + 256, 64);
  void *xq = mr_malloc_aligned(xq_bytes + 256, 64);
  int rc = x && h && y && tmp && xq ? 0 : MR_ENOMEM;
  for (uint32_t e = 0; e < KN_XO_EXPERTS && !rc; e++) {
    mem[e] = mr_malloc_aligned(wbytes + sbytes, 64);
    if (!mem[e]) {
      rc = MR_ENOMEM;
      break;
    }
    /* Values do not change the time of either kernel; small finite ones keep every
     * intermediate finite: bf16 0x3c00 = 2^-7, int8 / int4 bytes 0x11, scales 2^-10. */
    uint8_t *p = mem[e];
    if (f == KN_FMT_BF16) {
      for (size_t i = 0; i < wbytes / 2; i++) ((uint16_t *)p)[i] = 0x3c00;
    } else {
      memset(p, 0x11, wbytes);
    }
    float *sc = (float *)(p + wbytes);
    for (size_t i = 0; i < sbytes / sizeof(float); i++) sc[i] = 1.0f / 1024.0f;
    w[e].gate = p;
    w[e].up = p + (size_t)I * rbg;
    w[e].down = p + 2 * (size_t)I * rbg;
    if (nsg) {
      w[e].gate_scale = sc;
      w[e].up_scale = sc + (size_t)I * nsg;
      w[e].down_scale = sc + 2 * (size_t)I * nsg;
    }
  }
  if (!rc) {
    for (size_t i = 0; i < (size_t)nmax * H; i++) x[i] = (float)((i * 2654435761u) % 1000) / 1000.0f - 0.5f;
    double best[2][KN_XO_NS];
    for (uint32_t i = 0; i < KN_XO_NS; i++) best[0][i] = best[1][i] = 1e30;
    xo_pass(&fk, &L, w, 16, x, xq, h, y, tmp); /* first touches, tile state */
    xo_pass(avx, &L, w, 16, x, xq, h, y, tmp);
    for (uint32_t r = 0; r < KN_XO_ROUNDS; r++)
      for (uint32_t i = 0; i < KN_XO_NS; i++) {
        double ta = xo_pass(avx, &L, w, xo_ns[i], x, xq, h, y, tmp);
        double tt = xo_pass(&fk, &L, w, xo_ns[i], x, xq, h, y, tmp);
        if (ta < best[0][i]) best[0][i] = ta;
        if (tt < best[1][i]) best[1][i] = tt;
      }
    uint32_t from = KN_AMX_MIN_TOKENS_MAX;
    for (int i = KN_XO_NS - 1; i >= 0; i--) {
      ratio[i] = best[1][i] / best[0][i];
      if (ratio[i] >= 1.0) break;
      from = xo_ns[i];
    }
    for (int i = 0; i < KN_XO_NS; i++) ratio[i] = best[1][i] / best[0][i];
    *min_tokens = from;
  }
  for (uint32_t e = 0; e < KN_XO_EXPERTS; e++) mr_free_aligned(mem[e]);
  mr_free_aligned(x);
  mr_free_aligned(h);
  mr_free_aligned(y);
  mr_free_aligned(tmp);
  mr_free_aligned(xq);
  return rc;
}

/* The AMX column of t: the dispatched entry of every format whose AVX-512 fallback exists.
 * Candidates only: the self-test of kernels/selftest.c decides whether an engine uses them. */
void AMX_SYM(entries)(kn__kernel_table *t) {
  pthread_once(&fallback_once, fallback_init); /* here, never first in a self-test child */
  for (int v = 0; v < A_COUNT; v++) {
    if (!fallback_ok[v]) continue;
    kn__kernel dk, fk;
    kernels_of((av)v, &dk, &fk);
    t->k[av_format[v]][KN_ISA_AMX] = dk;
  }
}

#if !KN_AMX_EMULATE
void kn__amx_register(kn__kernel_table *t) {
  if (cpu_can_run(kn__cpu_get(), true)) kn__amx_entries(t);
}
#endif

/* Whether this CPU can run this object's entries (the emulated ones need no AMX). */
bool AMX_SYM(usable)(void) { return cpu_can_run(kn__cpu_get(), !KN_AMX_EMULATE); }

/* ---- the tile peak (moerpc-bench-kernels) ------------------------------------------------------
 *
 * What the tiles can do with nothing to wait for: operands resident in tiles, a 2 x 2
 * block of dot products per iteration (C0..C3 in tmm0-3 += A0, A1 in tmm4-5 times B0, B1 in
 * tmm6-7), each on full tiles (16 rows x 64 bytes). AMX instructions take as long whatever
 * the values, so the operands are zero. One call runs iters iterations on the calling
 * thread and returns the operations it did: 4 x 2 x 16 x 16 x K per iteration, K = 32
 * (bf16 pairs) or 64 (int8 quads; int4 runs on int8 tiles after its unpack, so its peak is
 * int8's). The bench runs it on every thread and divides by the wall time: the roofline's
 * compute ceiling. */
uint64_t AMX_SYM(peak)(kn_format f, uint64_t iters) {
  const bool bf16 = f == KN_FMT_BF16 || f == KN_FMT_FP8;
  _Alignas(64) kn__amx_cfg c;
  cfg_make(&c, 64);
  KN_AMX_LOADCFG(&c);
  KN_AMX_ZERO(0); /* tile numbers are encoded in the instruction: no loop */
  KN_AMX_ZERO(1);
  KN_AMX_ZERO(2);
  KN_AMX_ZERO(3);
  KN_AMX_ZERO(4);
  KN_AMX_ZERO(5);
  KN_AMX_ZERO(6);
  KN_AMX_ZERO(7);
  for (uint64_t i = 0; i < iters; i++) {
    if (bf16) {
      KN_AMX_DPBF16PS(0, 4, 6);
      KN_AMX_DPBF16PS(1, 4, 7);
      KN_AMX_DPBF16PS(2, 5, 6);
      KN_AMX_DPBF16PS(3, 5, 7);
    } else {
      KN_AMX_DPBSSD(0, 4, 6);
      KN_AMX_DPBSSD(1, 4, 7);
      KN_AMX_DPBSSD(2, 5, 6);
      KN_AMX_DPBSSD(3, 5, 7);
    }
  }
  KN_AMX_RELEASE();
  return iters * 4u * 2u * 16u * 16u * (bf16 ? 32u : 64u);
}
