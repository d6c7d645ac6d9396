/*
 * test_kn_amx.c - the AMX kernels (kernels/x86/moe_amx.c) against the scalar reference.
 *
 * Two builds of the same kernel source are tested here:
 *   - "emulated": moe_amx.c compiled with -DKN_AMX_EMULATE=1 (kn__amx_emu_*, the Makefile's
 *     moe_amx_emu.o), whose tile macros run the scalar model of amx_tile.h. It runs on
 *     any CPU with AVX-512 BF16/VNNI (the kernels' packing and epilogues are AVX-512);
 *   - "real": the libkn object with the AMX instructions (kn__amx_*), natively where the
 *     CPU has AMX, else under the SIGILL trap of amx_trap.h, which emulates each tile
 *     instruction of that machine code on the same model ("real-trapped"). The trap is
 *     what sees the bytes a real LDTILECFG reads: the old tile layer, whose configuration
 *     stores GCC dropped, dies here at the first load into tmm4, as on the hardware.
 * Every case runs with the tile configuration audit on (STTILECFG after each LDTILECFG,
 * compared with what the kernel meant) and ends by checking that nothing differed.
 *
 * Per build: every format (bf16, int8, int4 g32/g64/g128) at the task level with the
 * tiles forced at every token count (1..47: partial token blocks, one and two B tiles)
 * on shapes with and without multiples of the K steps and of 16 rows (K % 32, K % 64,
 * rows % 16, n % 16), h and y against the REF kernels; row ranges from two threads give
 * the bits of one call and write nothing outside their rows (canaries); the dispatched
 * entries give the AVX-512 kernel's bits below the crossover and the tiles' bits from it
 * on; whole layers (kn_moe_forward with the AMX entry in the table, 1 and 2 slices,
 * T = 1..300) against kn_ref_moe_forward; the start-up self-test (kernels/selftest.c, in
 * its child) passes every format and refuses all of them at an impossible tolerance; a
 * load into an unconfigured tile kills. The tile model itself is checked on hand-computed
 * cases (shapes, zero fill, DAZ, int32 wrap-around).
 *
 * Tolerances (rel L2, kn_test.h, the AVX-512 kernels' own): TOL_BF16X = 1e-2 for bf16
 * (x and h rounded to bf16; the tile sums' fp32 order differs from kn_ref's by ~1e-6),
 * TOL_Q8X = 3e-2 for int8 / int4 (x and h quantized per token to int8, as AVX-512).
 */
#define _GNU_SOURCE /* REG_RIP and the other ucontext register names (amx_trap.h) */
#include "kernels/internal.h"
#include "tests/unit/kn_rows.h"
#include "tests/unit/kn_test.h"
#include "tests/unit/mt.h"

#define KN_AMX_EMULATE 1
#include "kernels/x86/amx_tile.h"
#include "tests/unit/amx_trap.h"

#include <pthread.h>

/* ---- the tile model on hand-computed cases --------------------------------------- */

static uint16_t bf(float f) { return mr_f32_to_bf16(f); }

MT_TEST(tile_model_semantics) {
  _Alignas(64) kn__amx_cfg c;
  kn__amx_cfg_init(&c);
  kn__amx_cfg_tile(&c, 0, 3, 12); /* C: 3 x 3 fp32 */
  kn__amx_cfg_tile(&c, 1, 3, 8);  /* A: 3 rows x 2 bf16 pairs (K = 2) */
  kn__amx_cfg_tile(&c, 2, 2, 12); /* B: 2 pair-rows x 3 columns */
  kn__amx_cfg_tile(&c, 3, 3, 12); /* int32 C */
  kn__amx_cfg_tile(&c, 4, 3, 8);  /* A quads: 3 x 2 */
  kn__amx_cfg_tile(&c, 5, 2, 12); /* B quads: 2 x 3 */
  KN_AMX_LOADCFG(&c);
  /* A[m][k] pairs, B[k][n] pairs of small integers: exact in bf16 and fp32 */
  uint16_t a[3][4], b[2][6];
  for (int m = 0; m < 3; m++)
    for (int e = 0; e < 4; e++) a[m][e] = bf((float)(m + 1) * (float)(e - 1));
  for (int k = 0; k < 2; k++)
    for (int e = 0; e < 6; e++) b[k][e] = bf((float)(k * 6 + e) - 4.0f);
  float cinit[3][3];
  for (int m = 0; m < 3; m++)
    for (int n = 0; n < 3; n++) cinit[m][n] = 0.5f * (float)(m - n);
  KN_AMX_LOAD(0, cinit, 12);
  KN_AMX_LOAD(1, a, 8);
  KN_AMX_LOAD(2, b, 12);
  KN_AMX_DPBF16PS(0, 1, 2);
  float out[3][3];
  KN_AMX_STORE(0, out, 12);
  for (int m = 0; m < 3; m++)
    for (int n = 0; n < 3; n++) {
      float want = cinit[m][n];
      for (int k = 0; k < 2; k++)
        want += mr_bf16_to_f32(a[m][2 * k]) * mr_bf16_to_f32(b[k][2 * n]) +
                mr_bf16_to_f32(a[m][2 * k + 1]) * mr_bf16_to_f32(b[k][2 * n + 1]);
      MT_TRUE(out[m][n] == want);
    }
  /* load zero-fills beyond colsb and rows */
  MT_TRUE(kn__amx_emu.t[1][0][8] == 0 && kn__amx_emu.t[1][3][0] == 0);
  /* DAZ: a denormal bf16 input counts as zero */
  uint16_t ad[3][4] = {{0x0001, 0, 0, 0}}, bd[2][6] = {{bf(0x1p100f), 0, 0, 0, 0, 0}};
  KN_AMX_ZERO(0);
  KN_AMX_LOAD(1, ad, 8);
  KN_AMX_LOAD(2, bd, 12);
  KN_AMX_DPBF16PS(0, 1, 2);
  KN_AMX_STORE(0, out, 12);
  MT_TRUE(out[0][0] == 0.0f);
  /* s8 x s8 and u8 x s8 quads, int32 wrap-around */
  int8_t qa[3][8], qb[2][12];
  for (int m = 0; m < 3; m++)
    for (int e = 0; e < 8; e++) qa[m][e] = (int8_t)(e * 37 - 128 + m * 11);
  for (int k = 0; k < 2; k++)
    for (int e = 0; e < 12; e++) qb[k][e] = (int8_t)(e * 23 - 100 + k * 50);
  int32_t ci[3][3], co[3][3];
  for (int m = 0; m < 3; m++)
    for (int n = 0; n < 3; n++) ci[m][n] = m == 0 ? INT32_MAX : -m * 1000 + n;
  for (int us = 0; us < 2; us++) {
    KN_AMX_LOAD(3, ci, 12);
    KN_AMX_LOAD(4, qa, 8);
    KN_AMX_LOAD(5, qb, 12);
    if (us)
      KN_AMX_DPBUSD(3, 4, 5);
    else
      KN_AMX_DPBSSD(3, 4, 5);
    KN_AMX_STORE(3, co, 12);
    for (int m = 0; m < 3; m++)
      for (int n = 0; n < 3; n++) {
        int64_t s = ci[m][n];
        for (int k = 0; k < 2; k++)
          for (int i = 0; i < 4; i++)
            s += (int64_t)(us ? (int)(uint8_t)qa[m][4 * k + i] : (int)qa[m][4 * k + i]) * qb[k][4 * n + i];
        MT_EQ_INT(co[m][n], (int32_t)(uint32_t)(uint64_t)s); /* modulo 2^32 */
      }
  }
  KN_AMX_RELEASE();
  printf("  dpbf16ps exact on integers, DAZ, zero fill, dpbssd/dpbusd modulo 2^32: ok\n");
}

/* ---- the two builds -------------------------------------------------------------- */

typedef struct impl {
  const char *what;
  void (*kernels)(kn_format f, kn__kernel *dispatched, kn__kernel *forced);
  void (*entries)(kn__kernel_table *t);
  void (*audit_on)(bool on);
  uint64_t (*audit_take)(char *why, size_t n);
  uint64_t (*audit_loads)(void);
  uint32_t (*min_tokens)(kn_format f);
  void (*set_min_tokens)(kn_format f, uint32_t n);
  int (*crossover)(kn_format f, uint32_t *min_tokens, double ratio[KN_XO_NS]);
  void (*set_b_chunk)(size_t bytes);
} impl;

#if MR_HAVE_AMX
static impl impls[2] = {
    {"emulated", kn__amx_emu_kernels, kn__amx_emu_entries, kn__amx_emu_cfg_audit, kn__amx_emu_cfg_audit_take,
     kn__amx_emu_cfg_audit_loads, kn__amx_emu_min_tokens, kn__amx_emu_set_min_tokens, kn__amx_emu_crossover,
     kn__amx_emu_set_b_chunk},
    {"real", kn__amx_kernels, kn__amx_entries, kn__amx_cfg_audit, kn__amx_cfg_audit_take, kn__amx_cfg_audit_loads,
     kn__amx_min_tokens, kn__amx_set_min_tokens, kn__amx_crossover, kn__amx_set_b_chunk},
};
#endif

static void cpu_model_print(void) { printf("  cpu: %s\n", kn__cpu_get()->model); }

/* The build `which` (0 emulated, 1 real), with its configuration audit on, or a skip
 * that says why it cannot run here. The real object runs natively where the CPU has AMX,
 * else under the SIGILL trap of amx_trap.h (its own machine code, each tile instruction
 * emulated): so its cases run on every x86 CPU with AVX-512 BF16/VNNI. */
static const impl *impl_or_skip(int which) {
#if MR_HAVE_AMX
  cpu_model_print();
  if (!kn__amx_emu_usable())
    MT_SKIP("the AMX kernels need AVX-512 with BF16 and VNNI for their packing (CPU %s, best ISA %s)",
            kn__cpu_get()->model, kn_isa_name(kn_isa_detect()));
  if (which == 1) {
    if (kn__cpu_get()->best == KN_ISA_AMX) {
      impls[1].what = "real";
      printf("  real AMX instructions on this CPU\n");
    } else if (amx_trap_install()) {
      impls[1].what = "real-trapped";
      printf("  no AMX on this CPU: the real object's tile instructions run under the SIGILL trap\n");
    } else {
      MT_SKIP("no AMX on this CPU (%s) and no SIGILL trap on this platform", kn__cpu_get()->model);
    }
  }
  impls[which].audit_on(true);
  return &impls[which];
#else
  (void)which;
  MT_SKIP("built without AMX kernels (HAVE_AMX=0)");
  return NULL;
#endif
}

/* Every tile configuration the kernels loaded read back as asked (STTILECFG), and there
 * were loads to check. */
static void audit_clean(const impl *im) {
  char why[160];
  uint64_t bad = im->audit_take(why, sizeof why);
  if (bad) printf("  %s: %llu tile configuration(s) read back wrong: %s\n", im->what, (unsigned long long)bad, why);
  MT_EQ_INT(bad, 0);
  MT_TRUE(im->audit_loads() > 0);
  printf("  %s: %llu tile configurations read back (STTILECFG) equal to what was loaded\n", im->what,
         (unsigned long long)im->audit_loads());
}

/* ---- helpers --------------------------------------------------------------------- */

typedef struct fmt_case {
  kn_format f;
  uint32_t G;
  double tol;
} fmt_case;
/* fp8-b128 holds the bf16 tolerance: its rows become bf16 weights with their block scales
 * (one more rounding of each weight than the AVX-512 kernel's exact conversion). */
#define N_FMTS 6
static const fmt_case fmts[N_FMTS] = {{KN_FMT_BF16, 0, TOL_BF16X}, {KN_FMT_INT8, 0, TOL_Q8X},
                                      {KN_FMT_INT4, 32, TOL_Q8X},  {KN_FMT_INT4, 64, TOL_Q8X},
                                      {KN_FMT_INT4, 128, TOL_Q8X}, {KN_FMT_FP8, 0, TOL_BF16X}};

/* H x I shapes: aligned to every step; H % 64 = 8 and I % 16 = 8 (bf16 K tail, int8 K
 * tail, partial row blocks); tiny (one partial K step, one partial row block); H % 64 = 32
 * with I = 40 (down K % 32 = 8, two row blocks of which one partial). */
static const uint32_t shapes[4][2] = {{256, 192}, {200, 72}, {40, 24}, {160, 40}};

static kn_engine *engine_make(kn_isa isa, uint32_t split) {
  kn_engine *eng = NULL;
  mr_err e = {0};
  unsetenv("MOERPC_ISA");
  kn_engine_opts o = {.isa = isa, .threads = 0, .numa = NULL, .force_split = split};
  MT_OK(kn_engine_new(&eng, &o, &e), ep(&e));
  return eng;
}

/* A layer of E experts, weights ~ 0.05 N(0, 1) in bf16 (what checkpoints hold). */
static kn_layer *layer_make(kn_engine *eng, uint32_t H, uint32_t I, uint32_t E, kn_format f, uint32_t G, uint64_t seed) {
  kn_layer *L = NULL;
  mr_err e = {0};
  kn_layer_desc d = {.hidden = H, .inter = I, .num_experts = E, .format = f, .group = G};
  MT_OK(kn_layer_new(&L, eng, &d, &e), ep(&e));
  size_t n = (size_t)H * I;
  float *w = malloc(n * 4);
  uint16_t *g = malloc(n * 2), *u = malloc(n * 2), *dn = malloc(n * 2);
  rng_seed(seed);
  for (uint32_t x = 0; x < E; x++) {
    uint16_t *arr[3] = {g, u, dn};
    for (int a = 0; a < 3; a++) {
      for (size_t i = 0; i < n; i++) w[i] = 0.05f * rng_normal();
      mr_convert_from_f32(arr[a], MR_DTYPE_BF16, w, n);
    }
    MT_OK(kn_layer_load_expert(L, x, g, u, dn, MR_DTYPE_BF16, &e), ep(&e));
  }
  free(w);
  free(g);
  free(u);
  free(dn);
  return L;
}

static const kn__kernel *ref_kernel(kn_format f) {
  static kn__kernel_table tab;
  kn__ref_register(&tab);
  return &tab.k[f][KN_ISA_REF];
}

/* Buffers of one task of n tokens on slice s of L for kernel k (and the REF one). */
typedef struct tbuf {
  float *x, *h, *y, *tmp;
  void *xq;
} tbuf;
static tbuf tbuf_make(const kn_layer *L, const kn__kernel *k, uint32_t n) {
  tbuf b;
  const uint32_t H = L->d.hidden, Is = L->slice_len[0];
  size_t tn = k->tmp_floats(L, 0, n), rn = ref_kernel(L->d.format)->tmp_floats(L, 0, n);
  b.x = malloc((size_t)n * H * 4);
  b.h = malloc((size_t)(n + 2) * Is * 4); /* + a canary row each side */
  b.y = malloc((size_t)(n + 2) * H * 4);
  b.tmp = mr_malloc_aligned((tn > rn ? tn : rn) * 4 + 64, 64);
  b.xq = mr_malloc_aligned((k->prep ? k->prep_bytes(L, n) : 0) + 64, 64);
  for (size_t i = 0; i < (size_t)n * H; i++) b.x[i] = rng_normal();
  for (size_t i = 0; i < (size_t)(n + 2) * Is; i++) b.h[i] = -7.0f;
  for (size_t i = 0; i < (size_t)(n + 2) * H; i++) b.y[i] = -7.0f;
  return b;
}
static void tbuf_free(tbuf *b) {
  free(b->x);
  free(b->h);
  free(b->y);
  mr_free_aligned(b->tmp);
  mr_free_aligned(b->xq);
}
static void canaries_intact(const tbuf *b, uint32_t n, uint32_t rowlen_h, uint32_t rowlen_y) {
  for (uint32_t i = 0; i < rowlen_h; i++) {
    MT_TRUE(b->h[i] == -7.0f);
    MT_TRUE(b->h[(size_t)(n + 1) * rowlen_h + i] == -7.0f);
  }
  for (uint32_t i = 0; i < rowlen_y; i++) {
    MT_TRUE(b->y[i] == -7.0f);
    MT_TRUE(b->y[(size_t)(n + 1) * rowlen_y + i] == -7.0f);
  }
}

/* gate_up then down (down from h_in when not NULL) of kernel k on b's x. */
static void run_task(const kn_layer *L, const kn__kernel *k, uint32_t n, tbuf *b, const float *h_in) {
  const uint32_t H = L->d.hidden, Is = L->slice_len[0];
  if (k->prep) k->prep(L, n, b->x, b->xq);
  kn__task t = {.L = L, .slice = 0, .w = &L->w[0][0], .n = n, .x = b->x, .xq = b->xq,
                .h = b->h + Is, .y = b->y + H, .tmp = b->tmp};
  k->gate_up(&t, 0, Is);
  if (h_in) memcpy(b->h + Is, h_in, (size_t)n * Is * 4);
  k->down(&t, 0, H);
}

/* ---- the tiles at every token count against the REF kernels ------------------------ */

static void forced_matches_ref(int which) {
  const impl *im = impl_or_skip(which);
  kn_engine *eng = engine_make(KN_ISA_REF, 1);
  const uint32_t ns[8] = {1, 3, 15, 16, 17, 32, 33, 47};
  for (int fi = 0; fi < N_FMTS; fi++) {
    kn__kernel dk, fk;
    im->kernels(fmts[fi].f, &dk, &fk);
    MT_TRUE(fk.gate_up != NULL);
    double worst_h = 0.0, worst_y = 0.0;
    for (int sh = 0; sh < 4; sh++) {
      const uint32_t H = shapes[sh][0], I = shapes[sh][1];
      kn_layer *L = layer_make(eng, H, I, 1, fmts[fi].f, fmts[fi].G, 100 + sh);
      for (int ni = 0; ni < 8; ni++) {
        const uint32_t n = ns[ni];
        rng_seed(1000 + 7 * ni + sh);
        tbuf r = tbuf_make(L, &fk, n), a = tbuf_make(L, &fk, n);
        memcpy(a.x, r.x, (size_t)n * H * 4);
        run_task(L, ref_kernel(fmts[fi].f), n, &r, NULL);
        /* the tiles' gate_up against the reference h, then their down from the reference h */
        fk.prep(L, n, a.x, a.xq);
        kn__task t = {.L = L, .slice = 0, .w = &L->w[0][0], .n = n, .x = a.x, .xq = a.xq,
                      .h = a.h + I, .y = a.y + H, .tmp = a.tmp};
        fk.gate_up(&t, 0, I);
        for (size_t i = 0; i < (size_t)n * I; i++) MT_TRUE(isfinite(a.h[I + i]));
        double eh = kn_rel_l2(a.h + I, r.h + I, (size_t)n * I);
        memcpy(a.h + I, r.h + I, (size_t)n * I * 4);
        fk.down(&t, 0, H);
        for (size_t i = 0; i < (size_t)n * H; i++) MT_TRUE(isfinite(a.y[H + i]));
        double ey = kn_rel_l2(a.y + H, r.y + H, (size_t)n * H);
        canaries_intact(&a, n, I, H);
        if (eh > fmts[fi].tol || ey > fmts[fi].tol)
          printf("  %s g%u H=%u I=%u n=%u: rel L2 h %.3g y %.3g > %.0e\n", fk.name, fmts[fi].G, H, I, n, eh, ey,
                 fmts[fi].tol);
        MT_LE(eh, fmts[fi].tol);
        MT_LE(ey, fmts[fi].tol);
        if (eh > worst_h) worst_h = eh;
        if (ey > worst_y) worst_y = ey;
        tbuf_free(&r);
        tbuf_free(&a);
      }
      kn_layer_free(L);
    }
    printf("  %s %-17s g%-3u tiles at n=1..47: worst rel L2 gate_up %.3g, down %.3g (tol %.0e)\n", im->what,
           fk.name, fmts[fi].G, worst_h, worst_y, fmts[fi].tol);
  }
  kn_engine_free(eng);
  audit_clean(im);
}
MT_TEST(emulated_tiles_match_ref_every_format_and_edge) { forced_matches_ref(0); }
MT_TEST(real_tiles_match_ref_every_format_and_edge) { forced_matches_ref(1); }

/* ---- passes over token chunks: the same bits as one pass ---------------------------- */

/* gate_up and down of the tiles with the B operand in passes of 2 token blocks (the
 * smallest chunk) against one pass over all blocks (the default chunk holds them): every
 * (row block, token pair) is computed whole either way, so h and y must be the same bits.
 * n = 47 and 80 give 3 and 5 blocks: a pass ending on a single block, then pairs. */
static void chunks_bit_identical(int which) {
  const impl *im = impl_or_skip(which);
  kn_engine *eng = engine_make(KN_ISA_REF, 1);
  const uint32_t ns[2] = {47, 80};
  for (int fi = 0; fi < N_FMTS; fi++) {
    kn__kernel dk, fk;
    im->kernels(fmts[fi].f, &dk, &fk);
    for (int sh = 0; sh < 4; sh++) {
      const uint32_t H = shapes[sh][0], I = shapes[sh][1];
      kn_layer *L = layer_make(eng, H, I, 1, fmts[fi].f, fmts[fi].G, 300 + sh);
      for (int ni = 0; ni < 2; ni++) {
        const uint32_t n = ns[ni];
        rng_seed(3000 + ni + 10 * sh);
        tbuf one = tbuf_make(L, &fk, n), two = tbuf_make(L, &fk, n);
        memcpy(two.x, one.x, (size_t)n * H * 4);
        im->set_b_chunk(0); /* the default: one pass at these sizes */
        run_task(L, &fk, n, &one, NULL);
        im->set_b_chunk(1); /* passes of 2 token blocks */
        run_task(L, &fk, n, &two, NULL);
        im->set_b_chunk(0);
        MT_TRUE(memcmp(one.h, two.h, (size_t)(n + 2) * I * 4) == 0);
        MT_TRUE(memcmp(one.y, two.y, (size_t)(n + 2) * H * 4) == 0);
        canaries_intact(&two, n, I, H);
        tbuf_free(&one);
        tbuf_free(&two);
      }
      kn_layer_free(L);
    }
  }
  printf("  %s: passes of 2 token blocks give the bits of one pass (6 formats, 4 shapes, n = 47, 80)\n",
         im->what);
  kn_engine_free(eng);
  audit_clean(im);
}
MT_TEST(emulated_token_chunks_bit_identical) { chunks_bit_identical(0); }
MT_TEST(real_token_chunks_bit_identical) { chunks_bit_identical(1); }

/* ---- int4 requantized for the tiles: every code, -8 included ----------------------- */

/* The int4 packer writes codes -7..7, but the format has -8 (nibble 8), which kn_ref
 * decodes; the tiles requantize each row to s8 on one scale (requant_int4) and must keep
 * such a code in range (|q8| <= 127) rather than wrap. Nibbles of the packed weights are
 * set to 8 in places (low and high, in the row's largest group too), then the tiles run
 * against the reference on the same bytes. */
static void int4_every_code(int which) {
  const impl *im = impl_or_skip(which);
  kn_engine *eng = engine_make(KN_ISA_REF, 1);
  for (uint32_t G = 32; G <= 128; G *= 2) {
    kn__kernel dk, fk;
    im->kernels(KN_FMT_INT4, &dk, &fk);
    const uint32_t H = 256, I = 72, n = 33;
    kn_layer *L = layer_make(eng, H, I, 1, KN_FMT_INT4, G, 500 + G);
    kn__slice_w *w = &L->w[0][0];
    uint8_t *mats[3] = {w->gate, w->up, w->down};
    const size_t bytes[3] = {(size_t)I * kn__row_bytes(KN_FMT_INT4, H, G),
                             (size_t)I * kn__row_bytes(KN_FMT_INT4, H, G),
                             (size_t)H * kn__row_bytes(KN_FMT_INT4, I, G)};
    for (int m = 0; m < 3; m++)
      for (size_t b = 0; b < bytes[m]; b += 5) mats[m][b] = (uint8_t)(b % 2 ? (mats[m][b] & 0x0f) | 0x80 : (mats[m][b] & 0xf0) | 0x08);
    rng_seed(77 + G);
    tbuf r = tbuf_make(L, &fk, n), a = tbuf_make(L, &fk, n);
    memcpy(a.x, r.x, (size_t)n * H * 4);
    run_task(L, ref_kernel(KN_FMT_INT4), n, &r, NULL);
    run_task(L, &fk, n, &a, NULL); /* gate_up on its own */
    const double eh = kn_rel_l2(a.h + I, r.h + I, (size_t)n * I);
    run_task(L, &fk, n, &a, r.h + I); /* down from the reference h */
    const double ey = kn_rel_l2(a.y + H, r.y + H, (size_t)n * H);
    printf("  %s int4 g%u with code -8: rel L2 gate_up %.3g, down %.3g (tol %.0e)\n", im->what, G, eh, ey, TOL_Q8X);
    MT_LE(eh, TOL_Q8X);
    MT_LE(ey, TOL_Q8X);
    canaries_intact(&a, n, I, H);
    tbuf_free(&r);
    tbuf_free(&a);
    kn_layer_free(L);
  }
  kn_engine_free(eng);
  audit_clean(im);
}
MT_TEST(emulated_int4_every_code) { int4_every_code(0); }
MT_TEST(real_int4_every_code) { int4_every_code(1); }


/* ---- activations packed from the caller's rows: the bytes of the fp32 copy -------- */

/* prep_rows (the caller's rows in place, gathered by token, in f32, bf16 or f16) writes
 * the bytes prep writes from the same rows widened to fp32 and gathered: every format, K
 * with and without a whole K step, n with partial token blocks, tokens repeated and out of
 * order, rows with a NaN, zeros, huge values and subnormals of each dtype; the tiles
 * forced, and dispatched (below the crossover the AVX-512 kernel packs its own layout
 * from the rows, equally the bytes of its fp32 prep). */
static void rows_pack_like_f32(int which) {
  const impl *im = impl_or_skip(which);
  kn_engine *eng = engine_make(KN_ISA_REF, 1);
  const uint32_t Ks[3] = {256, 200, 40}, ns[5] = {1, 16, 17, 33, 47}, T = 61;
  const mr_dtype dts[3] = {MR_DTYPE_F32, MR_DTYPE_BF16, MR_DTYPE_F16};
  uint32_t cases = 0;
  static const int fis[4] = {0, 1, 3, 5}; /* bf16, int8, int4 g64, fp8: the group does not reach prep */
  for (int ii = 0; ii < 4; ii++) {
    const int fi = fis[ii];
    kn__kernel dk, fk;
    im->kernels(fmts[fi].f, &dk, &fk);
    MT_TRUE(fk.prep_rows != NULL && fk.takes_rows != NULL && dk.takes_rows != NULL);
    for (int ki = 0; ki < 3; ki++) {
      const uint32_t H = Ks[ki];
      kn_layer *L = layer_make(eng, H, 72, 1, fmts[fi].f, fmts[fi].G, 900 + ki);
      for (int di = 0; di < 3; di++) {
        rows_case c = rows_case_make(T, H, dts[di], 4000 + 10 * ki + di);
        for (int ni = 0; ni < 5; ni++) {
          const uint32_t n = ns[ni];
          uint32_t tok[47];
          rows_tokens(tok, n, T);
          /* the tiles forced, and dispatched: below the crossover the AVX-512 kernel's */
          MT_TRUE(fk.takes_rows(L, n));
          MT_TRUE(dk.takes_rows(L, n));
          uint8_t *tiles = malloc(fk.prep_bytes(L, n)), *disp = malloc(dk.prep_bytes(L, n));
          MT_EQ_INT(rows_prep_diff(&fk, L, n, &c, tok, tiles), 0);
          MT_EQ_INT(rows_prep_diff(&dk, L, n, &c, tok, disp), 0);
          if (n < im->min_tokens(fmts[fi].f))
            MT_TRUE(dk.prep_bytes(L, n) != fk.prep_bytes(L, n) || memcmp(tiles, disp, fk.prep_bytes(L, n)) != 0);
          free(tiles);
          free(disp);
          cases++;
        }
        rows_case_free(&c);
      }
      kn_layer_free(L);
    }
  }
  printf("  %s: rows packed in place (f32, bf16, f16) give the bytes of their fp32 copy (%u cases)\n",
         im->what, cases);
  kn_engine_free(eng);
}
MT_TEST(emulated_rows_pack_like_f32) { rows_pack_like_f32(0); }
MT_TEST(real_rows_pack_like_f32) { rows_pack_like_f32(1); }

/* ---- row ranges from two threads: the bits of one call, only their own rows -------- */

typedef struct range_job {
  const kn__kernel *k;
  kn__task task;
  int step;
  uint32_t n_ranges;
  const uint32_t *cuts;
  uint32_t first;
} range_job;
static void *range_worker(void *arg) {
  range_job *j = arg;
  for (uint32_t q = j->first; q < j->n_ranges; q += 2) {
    if (j->step == 0)
      j->k->gate_up(&j->task, j->cuts[q], j->cuts[q + 1]);
    else
      j->k->down(&j->task, j->cuts[q], j->cuts[q + 1]);
  }
  return NULL;
}
static uint32_t make_cuts(uint32_t total, uint32_t *cuts) {
  uint32_t n = 0, at = 0;
  cuts[0] = 0;
  while (at < total) {
    uint32_t len = rng_u32() % 38;
    at = at + len > total ? total : at + len;
    cuts[++n] = at;
  }
  return n;
}

static void ranges_compose(int which) {
  const impl *im = impl_or_skip(which);
  kn_engine *eng = engine_make(KN_ISA_REF, 1);
  for (int fi = 0; fi < N_FMTS; fi++) {
    kn__kernel dk, fk;
    im->kernels(fmts[fi].f, &dk, &fk);
    kn_layer *L = layer_make(eng, 200, 136, 1, fmts[fi].f, fmts[fi].G, 300 + fi);
    const uint32_t H = 200, Is = L->slice_len[0];
    const uint32_t ns[3] = {5, 17, 40};
    for (int ni = 0; ni < 3; ni++) {
      const uint32_t n = ns[ni];
      rng_seed(400 + ni);
      tbuf a = tbuf_make(L, &fk, n), b = tbuf_make(L, &fk, n);
      memcpy(b.x, a.x, (size_t)n * H * 4);
      run_task(L, &fk, n, &a, NULL);
      fk.prep(L, n, b.x, b.xq);
      float *tmp2 = mr_malloc_aligned(fk.tmp_floats(L, 0, n) * 4 + 64, 64);
      uint32_t cuts[1024];
      for (int step = 0; step < 2; step++) {
        uint32_t nr = make_cuts(step == 0 ? Is : H, cuts);
        range_job jobs[2];
        pthread_t th[2];
        for (int w = 0; w < 2; w++) {
          jobs[w] = (range_job){.k = &fk, .step = step, .n_ranges = nr, .cuts = cuts, .first = (uint32_t)w};
          jobs[w].task = (kn__task){.L = L, .slice = 0, .w = &L->w[0][0], .n = n, .x = b.x, .xq = b.xq,
                                    .h = b.h + Is, .y = b.y + H, .tmp = w ? tmp2 : b.tmp};
          MT_EQ_INT(pthread_create(&th[w], NULL, range_worker, &jobs[w]), 0);
        }
        for (int w = 0; w < 2; w++) pthread_join(th[w], NULL);
      }
      MT_EQ_INT(memcmp(a.h, b.h, (size_t)(n + 2) * Is * 4), 0);
      MT_EQ_INT(memcmp(a.y, b.y, (size_t)(n + 2) * H * 4), 0);
      canaries_intact(&b, n, Is, H);
      mr_free_aligned(tmp2);
      tbuf_free(&a);
      tbuf_free(&b);
    }
    kn_layer_free(L);
  }
  printf("  %s: random row ranges on two threads = one call, bitwise, canaries intact\n", im->what);
  kn_engine_free(eng);
  audit_clean(im);
}
MT_TEST(emulated_row_ranges_compose_across_threads) { ranges_compose(0); }
MT_TEST(real_row_ranges_compose_across_threads) { ranges_compose(1); }

/* ---- dispatch by tokens per expert -------------------------------------------------- */

/* At crossovers set per format (as kn.c sets the measured ones), the dispatched entry gives
 * the AVX-512 kernel's bits below and the tiles' bits from the crossover on. */
static void dispatch_by_tokens(int which) {
  const impl *im = impl_or_skip(which);
  kn_engine *eng = engine_make(KN_ISA_REF, 1);
  im->set_min_tokens(KN_FMT_BF16, 16);
  im->set_min_tokens(KN_FMT_INT8, 4);
  im->set_min_tokens(KN_FMT_INT4, 9);
  im->set_min_tokens(KN_FMT_FP8, 4);
  for (int fi = 0; fi < N_FMTS; fi++) {
    const uint32_t min = im->min_tokens(fmts[fi].f);
    MT_TRUE(min == 16 || min == 4 || min == 9);
    kn__kernel dk, fk;
    im->kernels(fmts[fi].f, &dk, &fk);
    const kn__kernel *avx = kn__avx512_kernel(fmts[fi].f);
    MT_TRUE(avx != NULL);
    kn_layer *L = layer_make(eng, 200, 72, 1, fmts[fi].f, fmts[fi].G, 500 + fi);
    const uint32_t H = 200, Is = L->slice_len[0];
    const uint32_t ns[4] = {1, min - 1, min, min + 9};
    for (int ni = 0; ni < 4; ni++) {
      const uint32_t n = ns[ni] ? ns[ni] : 1;
      const kn__kernel *want = n < min ? avx : &fk;
      rng_seed(600 + ni);
      tbuf a = tbuf_make(L, &dk, n), b = tbuf_make(L, want, n);
      memcpy(b.x, a.x, (size_t)n * H * 4);
      MT_EQ_INT(dk.tmp_floats(L, 0, n), want->tmp_floats(L, 0, n));
      MT_EQ_INT(dk.prep_bytes(L, n), want->prep ? want->prep_bytes(L, n) : 0);
      run_task(L, &dk, n, &a, NULL);
      run_task(L, want, n, &b, NULL);
      MT_EQ_INT(memcmp(a.h, b.h, (size_t)(n + 2) * Is * 4), 0);
      MT_EQ_INT(memcmp(a.y, b.y, (size_t)(n + 2) * H * 4), 0);
      tbuf_free(&a);
      tbuf_free(&b);
    }
    kn_layer_free(L);
  }
  printf("  %s: below the crossover (bf16 16, int8 4, int4 9, fp8 4 tokens) the AVX-512 kernel's bits, from it on "
         "the tiles' bits\n", im->what);
  im->set_min_tokens(KN_FMT_INT8, 0); /* clamped to 1 */
  MT_EQ_INT(im->min_tokens(KN_FMT_INT8), 1);
  im->set_min_tokens(KN_FMT_INT8, 1u << 30); /* clamped to 4096 */
  MT_EQ_INT(im->min_tokens(KN_FMT_INT8), 4096);
  kn_engine_free(eng);
  audit_clean(im);
}
MT_TEST(emulated_dispatch_by_tokens_per_expert) { dispatch_by_tokens(0); }
MT_TEST(real_dispatch_by_tokens_per_expert) { dispatch_by_tokens(1); }

/* The measured crossover on real tiles (the emulated ones are scalar: timing them would
 * say nothing): one per format, within the counts measured or "never", with a finite
 * positive time ratio at each count; the engine then logs it and dispatches by it. */
/* Only where the tiles run natively: under the SIGILL trap each tile instruction is
 * emulated, whose times say nothing (and would take minutes). */
static const impl *native_or_skip(void) {
  const impl *im = impl_or_skip(1);
  if (kn__cpu_get()->best != KN_ISA_AMX)
    MT_SKIP("timing: the tiles run under the SIGILL trap on this CPU (%s), not natively", kn__cpu_get()->model);
  return im;
}

MT_TEST(real_crossover_is_measured_per_format) {
  const impl *im = native_or_skip();
  static const kn_format f3[4] = {KN_FMT_BF16, KN_FMT_INT8, KN_FMT_INT4, KN_FMT_FP8};
  static const uint32_t ns[KN_XO_NS] = KN_XO_NS_INIT;
  for (int i = 0; i < 4; i++) {
    uint32_t m = 0;
    double r[KN_XO_NS];
    const uint64_t t0 = mr_now_ns();
    MT_EQ_INT(im->crossover(f3[i], &m, r), 0);
    const double ms = (double)(mr_now_ns() - t0) / 1e6;
    bool listed = m == 4096;
    for (int j = 0; j < KN_XO_NS; j++) {
      MT_TRUE(isfinite(r[j]) && r[j] > 0.0);
      listed = listed || m == ns[j];
    }
    MT_TRUE(listed);
    /* from m on, the tiles were faster at every count measured */
    for (int j = 0; j < KN_XO_NS; j++)
      if (ns[j] >= m) MT_TRUE(r[j] < 1.0);
    printf("  %s: tiles from %u tokens per expert, measured in %.0f ms; tiles / AVX-512 time:", kn_format_name(f3[i]),
           m, ms);
    for (int j = 0; j < KN_XO_NS; j++) printf(" %u: %.2f", ns[j], r[j]);
    printf("\n");
  }
  uint32_t m;
  double r[KN_XO_NS];
  MT_EQ_INT(im->crossover(KN_FMT_F32, &m, r), MR_ENOTSUP);
}

/* MOERPC_AMX_MIN_TOKENS: a count for every format, per format, or a clear refusal. */
MT_TEST(amx_min_tokens_environment) {
  mr_err e;
  kn_engine *eng = NULL;
  kn_engine_opts o = {.threads = 1};
  static const char *const bad[] = {"0", "4097", "x", "bf16=", "bf16=4,", "fp8=4", "bf16=4;int8=2", "-3", "4,int8=2"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    setenv("MOERPC_AMX_MIN_TOKENS", bad[i], 1);
    MT_EQ_INT(kn_engine_new(&eng, &o, &e), MR_EINVAL);
    MT_CONTAINS(e.msg, "MOERPC_AMX_MIN_TOKENS");
    MT_CONTAINS(e.msg, "1..4096");
  }
  static const char *const good[] = {"measure", "", "8", "bf16=16", "int8=2,bf16=32,int4=4", "fp8-b128=12,int4=4"};
  for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
    setenv("MOERPC_AMX_MIN_TOKENS", good[i], 1);
    MT_EQ_INT(kn_engine_new(&eng, &o, &e), 0);
    kn_engine_free(eng);
  }
  printf("  refused: %s\n", "bad values name the variable and 1..4096");
  unsetenv("MOERPC_AMX_MIN_TOKENS");
}

/* Without MOERPC_AMX_MIN_TOKENS the crossovers are the fixed defaults (the same bits after
 * every restart), not a measurement. */
MT_TEST(amx_min_tokens_default_is_fixed) {
  const impl *im = native_or_skip();
  unsetenv("MOERPC_AMX_MIN_TOKENS");
  mr_err e;
  kn_engine *eng = NULL;
  kn_engine_opts o = {.isa = KN_ISA_AMX, .threads = 1};
  MT_OK(kn_engine_new(&eng, &o, &e), &e);
  MT_EQ_INT(im->min_tokens(KN_FMT_BF16), 8);
  MT_EQ_INT(im->min_tokens(KN_FMT_INT8), 8);
  MT_EQ_INT(im->min_tokens(KN_FMT_INT4), 16);
  MT_EQ_INT(im->min_tokens(KN_FMT_FP8), 8);
  kn_engine_free(eng);
}

/* Set by MOERPC_AMX_MIN_TOKENS, the crossovers are the ones the engine dispatches by (and
 * nothing is measured). */
MT_TEST(amx_min_tokens_environment_sets_the_crossover) {
  const impl *im = native_or_skip();
  setenv("MOERPC_AMX_MIN_TOKENS", "int8=2,bf16=32,int4=5,fp8-b128=12", 1);
  mr_err e;
  kn_engine *eng = NULL;
  kn_engine_opts o = {.isa = KN_ISA_AMX, .threads = 1};
  MT_OK(kn_engine_new(&eng, &o, &e), &e); /* the first engine of this process builds the table */
  MT_EQ_INT(im->min_tokens(KN_FMT_BF16), 32);
  MT_EQ_INT(im->min_tokens(KN_FMT_INT8), 2);
  MT_EQ_INT(im->min_tokens(KN_FMT_INT4), 5);
  MT_EQ_INT(im->min_tokens(KN_FMT_FP8), 12);
  kn_engine_free(eng);
  unsetenv("MOERPC_AMX_MIN_TOKENS");
}

/* ---- whole layers: kn_moe_forward with the AMX entry against kn_ref_moe_forward ----- */

static void layer_matches_ref(int which) {
  const impl *im = impl_or_skip(which);
  const uint32_t Ts[4] = {1, 7, 64, 300};
  for (int fi = 0; fi < N_FMTS; fi++) {
    kn__kernel dk, fk;
    im->kernels(fmts[fi].f, &dk, &fk);
    double worst = 0.0;
    for (uint32_t split = 1; split <= 2; split++) {
      kn_engine *eng = engine_make(KN_ISA_AVX512, split);
      /* the AMX entry where the engine looks for this format */
      eng->table.k[fmts[fi].f][KN_ISA_AVX512] = dk;
      MT_TRUE(eng->kern[fmts[fi].f] == &eng->table.k[fmts[fi].f][KN_ISA_AVX512]);
      kn_layer *L = layer_make(eng, 256, 192, 4, fmts[fi].f, fmts[fi].G, 700 + split);
      for (int ti = 0; ti < 4; ti++) {
        const uint32_t T = Ts[ti], k = 2;
        int32_t *ids = malloc((size_t)T * k * 4);
        float *w = malloc((size_t)T * k * 4), *x = malloc((size_t)T * 256 * 4);
        float *ref = malloc((size_t)T * 256 * 4), *out = malloc((size_t)T * 256 * 4);
        rng_seed(800 + ti);
        for (size_t p = 0; p < (size_t)T * k; p++) {
          ids[p] = rng_u32() % 10 == 0 ? -1 : (int32_t)(p % k == 0 ? rng_u32() % 2 : 2 + rng_u32() % 2);
          w[p] = 0.25f + 0.5f * (rng_uniform() + 1.0f) / 2.0f;
        }
        for (size_t i = 0; i < (size_t)T * 256; i++) x[i] = rng_normal();
        mr_err e = {0};
        kn_moe_args a = {.n_tokens = T, .top_k = k, .ids = ids, .weights = w, .x = x, .x_dtype = MR_DTYPE_F32,
                         .out = ref};
        MT_OK(kn_ref_moe_forward(L, &a, &e), ep(&e));
        a.out = out;
        MT_OK(kn_moe_forward(eng, L, &a, NULL, &e), ep(&e));
        for (size_t i = 0; i < (size_t)T * 256; i++) MT_TRUE(isfinite(out[i]));
        double err = kn_rel_l2(out, ref, (size_t)T * 256);
        MT_LE(err, fmts[fi].tol);
        if (err > worst) worst = err;
        /* x in bf16 and f16, read in place by the tiles' prep (and converted for the
         * experts below the crossover): the bits of the same values given in fp32 */
        for (int di = 0; di < 2; di++) {
          const mr_dtype dt = di ? MR_DTYPE_F16 : MR_DTYPE_BF16;
          uint16_t *x16 = malloc((size_t)T * 256 * 2);
          float *o16 = malloc((size_t)T * 256 * 4);
          mr_convert_from_f32(x16, dt, x, (size_t)T * 256);
          mr_convert_to_f32(x, x16, dt, (size_t)T * 256);
          a.x = x;
          a.x_dtype = MR_DTYPE_F32;
          a.out = out;
          MT_OK(kn_moe_forward(eng, L, &a, NULL, &e), ep(&e));
          a.x = x16;
          a.x_dtype = dt;
          a.out = o16;
          MT_OK(kn_moe_forward(eng, L, &a, NULL, &e), ep(&e));
          MT_EQ_INT(memcmp(out, o16, (size_t)T * 256 * 4), 0);
          a.x = x;
          a.x_dtype = MR_DTYPE_F32;
          free(x16);
          free(o16);
        }
        free(ids);
        free(w);
        free(x);
        free(ref);
        free(out);
      }
      kn_layer_free(L);
      kn_engine_free(eng);
    }
    printf("  %s %-17s g%-3u layer (T=1..300, 1-2 slices): worst rel L2 %.3g (tol %.0e)\n", im->what, dk.name,
           fmts[fi].G, worst, fmts[fi].tol);
  }
  audit_clean(im);
}
MT_TEST(emulated_layer_matches_ref) { layer_matches_ref(0); }
MT_TEST(real_layer_matches_ref) { layer_matches_ref(1); }

/* ---- the start-up gate -------------------------------------------------------------- */

/* The AMX column through the start-up self-test of kernels/selftest.c (in its child
 * process: under the trap, the child keeps the trap): every format passes at its
 * tolerance, with the tiles really run (an error above zero) and the configuration audit
 * clean; at an impossible tolerance every one is refused and cleared. */
static void selftest_gate(int which) {
  const impl *im = impl_or_skip(which);
  kn__guard_keep_handlers = true;
  for (int pass = 0; pass < 2; pass++) {
    kn__kernel_table t;
    memset(&t, 0, sizeof t);
    kn__ref_register(&t);
    im->entries(&t);
    kn__selftest_report rep;
    int refused = kn__selftest_table(&t, KN_ISA_AMX, pass == 0 ? 1.0 : 1e-12, &rep);
    printf("  %s self-test, tolerance x%g: %u tested, %d refused, %.1f ms, %u child process(es)\n", im->what,
           pass == 0 ? 1.0 : 1e-12, rep.tested, refused, rep.ms, rep.children);
    MT_EQ_INT(rep.tested, 4);
    for (int f = 0; f < KN_FMT_COUNT; f++) {
      const kn__selftest_entry *en = &rep.e[f][KN_ISA_AMX];
      bool amx = f == KN_FMT_BF16 || f == KN_FMT_INT8 || f == KN_FMT_INT4 || f == KN_FMT_FP8;
      MT_EQ_INT(en->tested, amx);
      if (!amx) continue;
      if (pass == 0) {
        if (!en->passed) printf("  %s refused: %s\n", en->name, en->why);
        MT_TRUE(en->passed);
        MT_TRUE(en->worst > 0.0 && en->worst < (f == KN_FMT_BF16 || f == KN_FMT_FP8 ? TOL_BF16X : TOL_Q8X));
        MT_TRUE(t.k[f][KN_ISA_AMX].gate_up != NULL);
        printf("  %s %s: passed, worst rel L2 %.3g\n", im->what, en->name, en->worst);
      } else {
        MT_TRUE(!en->passed && strstr(en->why, "rel L2") != NULL);
        MT_TRUE(t.k[f][KN_ISA_AMX].gate_up == NULL);
      }
    }
    MT_EQ_INT(refused, pass == 0 ? 0 : 4);
  }
}
MT_TEST(emulated_selftest_gate) { selftest_gate(0); }
MT_TEST(real_selftest_gate) { selftest_gate(1); }

/* Where the CPU has AMX, an auto engine picks the AMX entries (their self-tests passed at
 * start-up); elsewhere the engine never registers them. */
MT_TEST(engine_registers_amx_only_with_amx) {
#if MR_HAVE_AMX
  cpu_model_print();
  kn_engine *eng = engine_make(KN_ISA_COUNT, 1);
  bool amx = kn__cpu_get()->best == KN_ISA_AMX && kn__amx_usable();
  for (int f = 0; f < KN_FMT_COUNT; f++) {
    bool want = amx && (f == KN_FMT_BF16 || f == KN_FMT_INT8 || f == KN_FMT_INT4 || f == KN_FMT_FP8);
    MT_EQ_INT(kn_engine_isa(eng, (kn_format)f) == KN_ISA_AMX, want);
    printf("  %-4s -> %s\n", kn_format_name((kn_format)f), eng->kern[f]->name);
  }
  kn_engine_free(eng);
  if (!amx) printf("  (no AMX on this CPU: %s; nothing registered, as it must be)\n", kn__cpu_get()->model);
#else
  MT_SKIP("built without AMX kernels (HAVE_AMX=0)");
#endif
}

/* The tile peak loop of moerpc-bench-kernels (issue 19): runs on the real tiles (or under
 * the trap) and on the emulated ones, and counts its operations: 4 dot products of full
 * tiles per iteration, K = 32 bf16 pairs or 64 int8 quads; int4 runs on the int8 tiles. */
static void peak_loop(int which) {
#if MR_HAVE_AMX
  impl_or_skip(which);
  uint64_t (*peak)(kn_format, uint64_t) = which ? kn__amx_peak : kn__amx_emu_peak;
  MT_EQ_U64(peak(KN_FMT_BF16, 3), 3ull * 4 * 2 * 16 * 16 * 32);
  MT_EQ_U64(peak(KN_FMT_INT8, 2), 2ull * 4 * 2 * 16 * 16 * 64);
  MT_EQ_U64(peak(KN_FMT_INT4, 1), 1ull * 4 * 2 * 16 * 16 * 64);
  MT_EQ_U64(peak(KN_FMT_FP8, 2), 2ull * 4 * 2 * 16 * 16 * 32); /* on the bf16 tiles */
  MT_EQ_U64(peak(KN_FMT_BF16, 0), 0);
#else
  (void)which;
  MT_SKIP("built without AMX kernels (HAVE_AMX=0)");
#endif
}
MT_TEST(emulated_peak_loop_counts) { peak_loop(0); }
MT_TEST(real_peak_loop_counts) { peak_loop(1); }

/* The trap is no softer than the hardware: a TILELOADD into a tile the loaded
 * configuration leaves out (what the dropped stores of GCC 12 did to tmm4) kills the
 * process, by #UD on an AMX CPU and by the trap's abort elsewhere. Run in a child. */
MT_TEST(unconfigured_tile_load_kills) {
#if MR_HAVE_AMX && defined(__x86_64__)
  if (kn__cpu_get()->best != KN_ISA_AMX && !amx_trap_install())
    MT_SKIP("no AMX and no SIGILL trap on this platform (%s)", kn__cpu_get()->model);
  fflush(stdout);
  pid_t pid = fork();
  MT_TRUE(pid >= 0);
  if (pid == 0) {
    _Alignas(64) kn__amx_cfg c;
    kn__amx_cfg_init(&c);
    for (int t = 0; t < 4; t++) kn__amx_cfg_tile(&c, t, 16, 64); /* tiles 4-7 left out */
    _Alignas(64) uint8_t buf[16 * 64] = {0};
    __asm__ volatile("ldtilecfg %0" : : "m"(c));
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm0" : : "r"(buf), "r"(64L) : "memory"); /* configured: fine */
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm4" : : "r"(buf), "r"(64L) : "memory"); /* not: #UD */
    _exit(0);
  }
  int st = 0;
  MT_EQ_INT(waitpid(pid, &st, 0), pid);
  MT_TRUE(WIFSIGNALED(st));
  printf("  a load into unconfigured tmm4: the child died of signal %d (%s)\n", WIFSIGNALED(st) ? WTERMSIG(st) : 0,
         kn__cpu_get()->best == KN_ISA_AMX ? "hardware #UD" : "trap");
#else
  MT_SKIP("built without AMX kernels (HAVE_AMX=0) or not x86-64");
#endif
}

MT_MAIN()
