/*
 * kernels/x86/amx_tile.h - the thin tile layer under kernels/x86/moe_amx.c: the tile
 * configuration, tile load / store / zero and the three dot products AMX kernels use,
 * either as the real instructions or as a scalar C model of their documented semantics.
 *
 *   KN_AMX_EMULATE = 0 (the real build, moe_amx.c with -mamx-tile -mamx-bf16 -mamx-int8):
 *     each macro is one instruction (LDTILECFG, STTILECFG, TILELOADD, TILESTORED,
 *     TILEZERO, TDPBF16PS, TDPBUSD, TDPBSSD, TILERELEASE) in inline assembly whose
 *     operands tell the compiler what memory it reads and writes (why not the
 *     <immintrin.h> intrinsics: see the real half below). Tile numbers must be literal
 *     constants (they are encoded in the instruction).
 *   KN_AMX_EMULATE = 1 (the test build, tests/unit/test_kn_amx.c and the emulated object
 *     of the Makefile): the same macros call the functions below, which keep eight
 *     1 KiB tiles and their shapes in thread-local memory (each thread has its own tile
 *     state, like the hardware's per-thread XTILEDATA) and implement the Intel SDM
 *     pseudo-code. Shape errors that would raise #UD on the hardware (a dot product whose
 *     operand shapes do not agree, a tile used but not configured) are MR_ASSERTs here,
 *     so the test build catches configuration mistakes of the kernels.
 *
 * What is modelled (Intel SDM vol. 2, TILELOADD / TILESTORED / TILEZERO / TDPBF16PS /
 * TDPBSSD / TDPBUSD; a tile is up to 16 rows x 64 bytes; palette 1):
 *   load:   rows r < cfg.rows get cfg.colsb bytes from base + r * stride; the rest of each
 *           row and every row >= cfg.rows are zeroed.
 *   store:  rows r < cfg.rows, cfg.colsb bytes each, to base + r * stride.
 *   dpbf16ps C, A, B (C fp32 [M x N], A = M rows of K bf16 pairs, B = K rows of N bf16
 *           pairs, K = A.colsb / 4, N = C.colsb / 4; needs A.rows = C.rows = M,
 *           B.rows = K, B.colsb = C.colsb):
 *             for m, n:  e = o = 0  (fp32)
 *                        for k:  e += A[m].bf16[2k]   * B[k].bf16[2n]     (fp32 FMA, RNE)
 *                                o += A[m].bf16[2k+1] * B[k].bf16[2n+1]
 *                        C[m].fp32[n] += e + o                              (RNE)
 *           with denormal inputs read as zero and denormal results flushed to zero
 *           (DAZ/FTZ; MXCSR is neither read nor written). This is the order of the current
 *           SDM text (two partial sums, even and odd elements of the pairs, added at the
 *           end of the instruction); the intrinsics guide writes one running sum instead
 *           (C += even product, then += odd product, per k). The two differ by fp32
 *           rounding of the summation order only: <= K * 2^-24 relative per instruction
 *           (K <= 16 pairs), ~1e-6 of a K = 2048 dot product, which is three orders below
 *           the 1e-2 bf16 tolerance the kernels are held to against kn_ref (whose order,
 *           one running sum over K, differs from both anyway). Bit-exact equality with
 *           the hardware is therefore not claimed; the tests compare against kn_ref with
 *           that tolerance, and the start-up self-test (moe_amx.c) checks the real
 *           instruction against kn_ref with the same one.
 *   dpbssd C, A, B (int32 C; A = M rows of K quads of s8, B = K rows of N quads of s8):
 *             C[m].s32[n] += sum over k, i < 4 of s8(A[m].byte[4k+i]) * s8(B[k].byte[4n+i])
 *           in int32 with wrap-around (exact, no saturation).
 *   dpbusd: the same with A's bytes unsigned (u8 x s8).
 * Not modelled: start_row (restart after a fault; always 0 here), palette 0 / tile
 * release semantics beyond forgetting the configuration, the bf16 NaN payloads.
 */
#ifndef KN_AMX_TILE_H
#define KN_AMX_TILE_H

#include <stdint.h>
#include <string.h>

#include "common/mr.h"

#ifndef KN_AMX_EMULATE
#define KN_AMX_EMULATE 0
#endif

/* The 64-byte tile configuration of LDTILECFG, palette 1. */
typedef struct kn__amx_cfg {
  uint8_t palette;   /* 1 */
  uint8_t start_row; /* 0 */
  uint8_t reserved[14];
  uint16_t colsb[16]; /* bytes per row of tile t (<= 64); tiles 8..15 must stay 0 */
  uint8_t rows[16];   /* rows of tile t (<= 16) */
} kn__amx_cfg;
_Static_assert(sizeof(kn__amx_cfg) == 64, "LDTILECFG reads 64 bytes");

#define KN_AMX_TILES 8
#define KN_AMX_MAX_ROWS 16
#define KN_AMX_MAX_COLSB 64

static inline void kn__amx_cfg_init(kn__amx_cfg *c) {
  memset(c, 0, sizeof *c);
  c->palette = 1;
}
static inline void kn__amx_cfg_tile(kn__amx_cfg *c, int tile, int rows, int colsb) {
  MR_ASSERT(tile >= 0 && tile < KN_AMX_TILES && rows >= 1 && rows <= KN_AMX_MAX_ROWS &&
            colsb >= 4 && colsb <= KN_AMX_MAX_COLSB && colsb % 4 == 0);
  c->rows[tile] = (uint8_t)rows;
  c->colsb[tile] = (uint16_t)colsb;
}

#if KN_AMX_EMULATE

#include <math.h>

typedef struct kn__amx_emu_state {
  _Alignas(64) uint8_t t[KN_AMX_TILES][KN_AMX_MAX_ROWS][KN_AMX_MAX_COLSB];
  uint8_t rows[KN_AMX_TILES];
  uint16_t colsb[KN_AMX_TILES];
  int configured;
} kn__amx_emu_state;
static __thread kn__amx_emu_state kn__amx_emu;

static inline void kn__amx_emu_loadcfg(const kn__amx_cfg *c) {
  MR_ASSERT(c->palette == 1 && c->start_row == 0);
  for (int i = 0; i < 16; i++) {
    if (i >= KN_AMX_TILES) {
      MR_ASSERT(c->rows[i] == 0 && c->colsb[i] == 0);
      continue;
    }
    MR_ASSERT(c->rows[i] <= KN_AMX_MAX_ROWS && c->colsb[i] <= KN_AMX_MAX_COLSB);
    MR_ASSERT((c->rows[i] == 0) == (c->colsb[i] == 0));
    kn__amx_emu.rows[i] = c->rows[i];
    kn__amx_emu.colsb[i] = c->colsb[i];
  }
  memset(kn__amx_emu.t, 0, sizeof kn__amx_emu.t); /* LDTILECFG zeroes the tile data */
  kn__amx_emu.configured = 1;
}
/* STTILECFG: the configuration in force (all zero when none is loaded). */
static inline void kn__amx_emu_storecfg(kn__amx_cfg *c) {
  memset(c, 0, sizeof *c);
  if (!kn__amx_emu.configured) return;
  c->palette = 1;
  for (int i = 0; i < KN_AMX_TILES; i++) {
    c->rows[i] = kn__amx_emu.rows[i];
    c->colsb[i] = kn__amx_emu.colsb[i];
  }
}
static inline void kn__amx_emu_release(void) {
  memset(&kn__amx_emu, 0, sizeof kn__amx_emu);
}
static inline void kn__amx_emu_check(int t) {
  MR_ASSERT(kn__amx_emu.configured && t >= 0 && t < KN_AMX_TILES && kn__amx_emu.rows[t] > 0);
}
static inline void kn__amx_emu_load(int t, const void *base, size_t stride) {
  kn__amx_emu_check(t);
  const int R = kn__amx_emu.rows[t], CB = kn__amx_emu.colsb[t];
  memset(kn__amx_emu.t[t], 0, sizeof kn__amx_emu.t[t]);
  for (int r = 0; r < R; r++) memcpy(kn__amx_emu.t[t][r], (const uint8_t *)base + (size_t)r * stride, (size_t)CB);
}
static inline void kn__amx_emu_store(int t, void *base, size_t stride) {
  kn__amx_emu_check(t);
  const int R = kn__amx_emu.rows[t], CB = kn__amx_emu.colsb[t];
  for (int r = 0; r < R; r++) memcpy((uint8_t *)base + (size_t)r * stride, kn__amx_emu.t[t][r], (size_t)CB);
}
static inline void kn__amx_emu_zero(int t) {
  kn__amx_emu_check(t);
  memset(kn__amx_emu.t[t], 0, sizeof kn__amx_emu.t[t]);
}
/* The operand shapes every dot product needs (else #UD): M = C.rows = A.rows,
 * K = A.colsb / 4 = B.rows, C.colsb = B.colsb. */
static inline void kn__amx_emu_shapes(int c, int a, int b) {
  kn__amx_emu_check(c);
  kn__amx_emu_check(a);
  kn__amx_emu_check(b);
  MR_ASSERT(c != a && c != b && a != b);
  MR_ASSERT(kn__amx_emu.rows[c] == kn__amx_emu.rows[a]);
  MR_ASSERT(kn__amx_emu.colsb[a] / 4 == kn__amx_emu.rows[b]);
  MR_ASSERT(kn__amx_emu.colsb[c] == kn__amx_emu.colsb[b]);
}
/* bf16 -> fp32 with denormals read as zero (DAZ). */
static inline float kn__amx_emu_bf16(const uint8_t *p) {
  uint32_t u = (uint32_t)(p[0] | (p[1] << 8)) << 16;
  if ((u & 0x7f800000u) == 0) u &= 0x80000000u;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
static inline float kn__amx_emu_ftz(float f) {
  return fpclassify(f) == FP_SUBNORMAL ? copysignf(0.0f, f) : f;
}
static inline void kn__amx_emu_dpbf16ps(int c, int a, int b) {
  kn__amx_emu_shapes(c, a, b);
  const int M = kn__amx_emu.rows[c], K = kn__amx_emu.colsb[a] / 4, N = kn__amx_emu.colsb[c] / 4;
  for (int m = 0; m < M; m++)
    for (int n = 0; n < N; n++) {
      float e = 0.0f, o = 0.0f;
      for (int k = 0; k < K; k++) {
        const uint8_t *pa = &kn__amx_emu.t[a][m][4 * k], *pb = &kn__amx_emu.t[b][k][4 * n];
        e = kn__amx_emu_ftz(fmaf(kn__amx_emu_bf16(pa), kn__amx_emu_bf16(pb), e));
        o = kn__amx_emu_ftz(fmaf(kn__amx_emu_bf16(pa + 2), kn__amx_emu_bf16(pb + 2), o));
      }
      float d;
      memcpy(&d, &kn__amx_emu.t[c][m][4 * n], 4);
      if (fpclassify(d) == FP_SUBNORMAL) d = copysignf(0.0f, d);
      d = kn__amx_emu_ftz(d + kn__amx_emu_ftz(e + o));
      memcpy(&kn__amx_emu.t[c][m][4 * n], &d, 4);
    }
}
/* a_signed: A's bytes are s8 (TDPBSSD) or u8 (TDPBUSD); B's are s8 in both. */
static inline void kn__amx_emu_dp8(int c, int a, int b, int a_signed) {
  kn__amx_emu_shapes(c, a, b);
  const int M = kn__amx_emu.rows[c], K = kn__amx_emu.colsb[a] / 4, N = kn__amx_emu.colsb[c] / 4;
  for (int m = 0; m < M; m++)
    for (int n = 0; n < N; n++) {
      uint32_t acc;
      memcpy(&acc, &kn__amx_emu.t[c][m][4 * n], 4);
      for (int k = 0; k < K; k++)
        for (int i = 0; i < 4; i++) {
          uint8_t ab = kn__amx_emu.t[a][m][4 * k + i];
          int32_t av = a_signed ? (int32_t)(int8_t)ab : (int32_t)ab;
          int32_t bv = (int8_t)kn__amx_emu.t[b][k][4 * n + i];
          acc += (uint32_t)(av * bv); /* wraps modulo 2^32 like the hardware */
        }
      memcpy(&kn__amx_emu.t[c][m][4 * n], &acc, 4);
    }
}

#define KN_AMX_LOADCFG(cfg) kn__amx_emu_loadcfg(cfg)
#define KN_AMX_STORECFG(cfg) kn__amx_emu_storecfg(cfg)
#define KN_AMX_RELEASE() kn__amx_emu_release()
#define KN_AMX_LOAD(t, base, stride) kn__amx_emu_load((t), (base), (size_t)(stride))
#define KN_AMX_STORE(t, base, stride) kn__amx_emu_store((t), (base), (size_t)(stride))
#define KN_AMX_ZERO(t) kn__amx_emu_zero(t)
#define KN_AMX_DPBF16PS(c, a, b) kn__amx_emu_dpbf16ps((c), (a), (b))
#define KN_AMX_DPBSSD(c, a, b) kn__amx_emu_dp8((c), (a), (b), 1)
#define KN_AMX_DPBUSD(c, a, b) kn__amx_emu_dp8((c), (a), (b), 0)

#else /* the real instructions */

/* Our own inline assembly, not <immintrin.h>'s _tile_* intrinsics, for two reasons that
 * each killed or could kill the process:
 *   - GCC 12's _tile_loadconfig declares its memory operand as "m" (*(const void **)cfg),
 *     i.e. as reading the first 8 bytes of the configuration only. GCC then treated the
 *     stores of tiles 4-7's rows and colsb as dead and dropped them: LDTILECFG left those
 *     tiles unconfigured and the first TILELOADD into tmm4 raised #UD, so every binary died
 *     with SIGILL at the AMX self-test (Emerald Rapids, 2026-12-02). Here the operand is the
 *     whole 64-byte struct, so every field is an input the compiler must store first.
 *   - GCC 12's _tile_loadd declares no memory at all (only the base and stride registers),
 *     so stores into a buffer that only a tile load reads (the zero-padded A blocks, the
 *     packed activations) could be sunk past the load or dropped. Loads and stores here
 *     clobber "memory": every earlier store is done before a tile load, and every later
 *     read sees what a tile store wrote.
 * Tile numbers are literals spliced into the mnemonic (they are encoded in the
 * instruction); every statement is extended asm (": :" at least), so "%%" is one "%".
 * AT&T operand order: the destination last. */
#define KN__AMX_STR2(x) #x
#define KN__AMX_STR(x) KN__AMX_STR2(x)
#define KN__AMX_TMM(t) "%%tmm" KN__AMX_STR(t)

static inline void kn__amx_ldtilecfg(const kn__amx_cfg *cfg) {
  __asm__ volatile("ldtilecfg %0" : : "m"(*cfg));
}
/* STTILECFG: the configuration the tiles really have (all zero when none is loaded). */
static inline void kn__amx_sttilecfg(kn__amx_cfg *cfg) {
  __asm__ volatile("sttilecfg %0" : "=m"(*cfg));
}

#define KN_AMX_LOADCFG(cfg) kn__amx_ldtilecfg(cfg)
#define KN_AMX_STORECFG(cfg) kn__amx_sttilecfg(cfg)
#define KN_AMX_RELEASE() __asm__ volatile("tilerelease" ::: "memory")
#define KN_AMX_LOAD(t, base, stride)                                                      \
  __asm__ volatile("tileloadd (%0,%1,1), " KN__AMX_TMM(t)                                 \
                   : : "r"((const void *)(base)), "r"((long)(stride)) : "memory")
#define KN_AMX_STORE(t, base, stride)                                                     \
  __asm__ volatile("tilestored " KN__AMX_TMM(t) ", (%0,%1,1)"                             \
                   : : "r"((void *)(base)), "r"((long)(stride)) : "memory")
#define KN_AMX_ZERO(t) __asm__ volatile("tilezero " KN__AMX_TMM(t) : :)
/* C += A . B: Intel order "tdpbf16ps C, A, B", so AT&T "B, A, C". */
#define KN_AMX_DPBF16PS(c, a, b) __asm__ volatile("tdpbf16ps " KN__AMX_TMM(b) ", " KN__AMX_TMM(a) ", " KN__AMX_TMM(c) : :)
#define KN_AMX_DPBSSD(c, a, b) __asm__ volatile("tdpbssd " KN__AMX_TMM(b) ", " KN__AMX_TMM(a) ", " KN__AMX_TMM(c) : :)
#define KN_AMX_DPBUSD(c, a, b) __asm__ volatile("tdpbusd " KN__AMX_TMM(b) ", " KN__AMX_TMM(a) ", " KN__AMX_TMM(c) : :)

#endif

#endif /* KN_AMX_TILE_H */
