/*
 * test_kn_ref.c - the kernel engine and the scalar reference of kernels/.
 *
 * Three levels of checking:
 *   1. kn_ref (kn_ref_moe_forward, kn_ref_expert_f32) against a naive triple loop written
 *      here independently, in double precision, over the same (rounded) weights;
 *   2. kn_moe_forward (grouping by expert, slices, kernel table) against kn_ref, for every
 *      format, token count, slot pattern, input dtype and slice count;
 *   3. the quantized formats against the fp32 reference under the tolerances of
 *      docs/DESIGN.md section 5, and their packing (round-trip bounds, nibble layout).
 * Plus every refused input: bad ids, experts not held, bad descs, non-finite weights.
 */
#include "kernels/internal.h"
#include "tests/unit/kn_test.h"
#include "tests/unit/mt.h"

/* ---- helpers ----------------------------------------------------------------------- */

/* MT_OK prints errp->msg; passing &e through a function keeps gcc's -Waddress quiet. */

static float round_to(float v, mr_dtype dt) {
  if (dt == MR_DTYPE_BF16) return mr_bf16_to_f32(mr_f32_to_bf16(v));
  if (dt == MR_DTYPE_F16) return mr_f16_to_f32(mr_f32_to_f16(v));
  return v;
}

/* E experts of fp32 weights in HF layout: gate/up [I, H], down [H, I]. */
typedef struct model {
  uint32_t H, I, E;
  float *gate, *up, *down; /* [E][I*H], [E][I*H], [E][H*I] */
} model;

/* Weights ~ scale * N(0, 1) (normal) or scale * U(-1, 1), rounded to `round` (F32: none). */
static model model_make(uint32_t H, uint32_t I, uint32_t E, float scale, bool normal,
                        mr_dtype round, uint64_t seed) {
  model m = {H, I, E, NULL, NULL, NULL};
  size_t n = (size_t)E * H * I;
  m.gate = malloc(n * sizeof(float));
  m.up = malloc(n * sizeof(float));
  m.down = malloc(n * sizeof(float));
  MT_TRUE(m.gate && m.up && m.down);
  rng_seed(seed);
  float *arr[3] = {m.gate, m.up, m.down};
  for (int a = 0; a < 3; a++)
    for (size_t i = 0; i < n; i++)
      arr[a][i] = round_to(scale * (normal ? rng_normal() : rng_uniform()), round);
  return m;
}
static void model_free(model *m) {
  free(m->gate);
  free(m->up);
  free(m->down);
}
static const float *mg(const model *m, uint32_t e) { return m->gate + (size_t)e * m->H * m->I; }
static const float *mu(const model *m, uint32_t e) { return m->up + (size_t)e * m->H * m->I; }
static const float *md(const model *m, uint32_t e) { return m->down + (size_t)e * m->H * m->I; }

static kn_engine *engine_make(uint32_t split) {
  kn_engine *eng = NULL;
  mr_err e = {0};
  kn_engine_opts o = {.isa = KN_ISA_REF, .threads = 0, .numa = NULL, .force_split = split};
  MT_OK(kn_engine_new(&eng, &o, &e), ep(&e));
  MT_EQ_INT(kn_engine_nodes(eng), split ? split : kn_engine_nodes(eng));
  return eng;
}

/* A layer of format fmt holding the experts with own[x] (all when own is NULL), loaded
 * from src-typed copies of m's weights. */
static kn_layer *layer_make(kn_engine *eng, const model *m, kn_format fmt, uint32_t group,
                            const bool *own, mr_dtype src) {
  kn_layer *L = NULL;
  mr_err e = {0};
  kn_layer_desc d = {.hidden = m->H, .inter = m->I, .num_experts = m->E, .format = fmt, .group = group};
  MT_OK(kn_layer_new(&L, eng, &d, &e), ep(&e));
  size_t n = (size_t)m->H * m->I;
  void *g = malloc(n * 4), *u = malloc(n * 4), *dn = malloc(n * 4);
  for (uint32_t x = 0; x < m->E; x++) {
    if (own && !own[x]) continue;
    mr_convert_from_f32(g, src, mg(m, x), n);
    mr_convert_from_f32(u, src, mu(m, x), n);
    mr_convert_from_f32(dn, src, md(m, x), n);
    MT_OK(kn_layer_load_expert(L, x, g, u, dn, src, &e), ep(&e));
    MT_TRUE(kn_layer_has_expert(L, x));
  }
  free(g);
  free(u);
  free(dn);
  return L;
}

/* One request: ids, weights, x (fp32 values already rounded to x_dtype, and the same in
 * x_dtype), out. */
typedef struct req {
  uint32_t T, k, H;
  int32_t *ids;
  float *w;
  float *xf;  /* [T, H] fp32 */
  void *x;    /* [T, H] x_dtype */
  mr_dtype dt;
  float *out; /* [T, H] */
} req;

/* Random request over the experts with own[x] (all when NULL); each slot is empty with
 * probability p_empty percent; experts repeat freely within and across tokens. */
static req req_make(uint32_t T, uint32_t k, const model *m, const bool *own, int p_empty,
                    mr_dtype dt, uint64_t seed) {
  req r = {T, k, m->H, NULL, NULL, NULL, NULL, dt, NULL};
  size_t TH = (size_t)T * m->H;
  r.ids = malloc((size_t)T * k * sizeof(int32_t) + 1);
  r.w = malloc((size_t)T * k * sizeof(float) + 1);
  r.xf = calloc(TH ? TH : 1, sizeof(float));
  r.x = malloc(TH * 4);
  r.out = malloc(TH * sizeof(float));
  rng_seed(seed);
  uint32_t owned[65536], n_owned = 0;
  for (uint32_t x = 0; x < m->E; x++)
    if (!own || own[x]) owned[n_owned++] = x;
  MT_TRUE(n_owned > 0);
  for (size_t p = 0; p < (size_t)T * k; p++) {
    r.ids[p] = (int)(rng_u32() % 100) < p_empty ? -1 : (int32_t)owned[rng_u32() % n_owned];
    r.w[p] = 0.1f + 0.9f * (rng_uniform() + 1.0f) * 0.5f;
  }
  for (size_t i = 0; i < TH; i++) r.xf[i] = round_to(rng_normal(), dt);
  mr_convert_from_f32(r.x, dt, r.xf, TH);
  for (size_t i = 0; i < TH; i++) r.out[i] = NAN; /* must be overwritten */
  return r;
}
static void req_free(req *r) {
  free(r->ids);
  free(r->w);
  free(r->xf);
  free(r->x);
  free(r->out);
}
static kn_moe_args req_args(const req *r) {
  return (kn_moe_args){.n_tokens = r->T, .top_k = r->k, .ids = r->ids, .weights = r->w,
                       .x = r->x, .x_dtype = r->dt, .out = r->out};
}

/* The naive expert, in double: y = down(silu(gate x) * up x). Written independently of
 * kernels/ on purpose. */
static void naive_expert(const float *g, const float *u, const float *d, uint32_t H, uint32_t I,
                         const float *x, double *y) {
  for (uint32_t o = 0; o < H; o++) y[o] = 0.0;
  for (uint32_t i = 0; i < I; i++) {
    double gs = 0.0, us = 0.0;
    for (uint32_t c = 0; c < H; c++) {
      gs += (double)g[(size_t)i * H + c] * x[c];
      us += (double)u[(size_t)i * H + c] * x[c];
    }
    double hi = gs / (1.0 + exp(-gs)) * us;
    for (uint32_t o = 0; o < H; o++) y[o] += (double)d[(size_t)o * I + i] * hi;
  }
}

/* The naive layer over m's fp32 weights for request r, into out [T, H] (fp32). */
static void naive_layer(const model *m, const req *r, float *out) {
  double *y = malloc(m->H * sizeof(double)), *acc = malloc(m->H * sizeof(double));
  for (uint32_t t = 0; t < r->T; t++) {
    for (uint32_t o = 0; o < m->H; o++) acc[o] = 0.0;
    for (uint32_t j = 0; j < r->k; j++) {
      int32_t id = r->ids[(size_t)t * r->k + j];
      if (id < 0) continue;
      naive_expert(mg(m, id), mu(m, id), md(m, id), m->H, m->I, r->xf + (size_t)t * m->H, y);
      for (uint32_t o = 0; o < m->H; o++) acc[o] += r->w[(size_t)t * r->k + j] * y[o];
    }
    for (uint32_t o = 0; o < m->H; o++) out[(size_t)t * m->H + o] = (float)acc[o];
  }
  free(y);
  free(acc);
}

static const kn_format all_fmts[KN_FMT_COUNT] = {KN_FMT_F32, KN_FMT_F16, KN_FMT_BF16, KN_FMT_INT8, KN_FMT_FP8,
                                                 KN_FMT_INT4};

/* ---- names and detection ----------------------------------------------------------- */

MT_TEST(format_and_isa_names) {
  char buf[32];
  for (int f = 0; f < KN_FMT_COUNT; f++) {
    kn_format g;
    MT_EQ_INT(kn_format_parse(kn_format_name((kn_format)f), &g), 0);
    MT_EQ_INT(g, f);
  }
  kn_format g;
  MT_EQ_INT(kn_format_parse("int4-g64", &g), MR_EINVAL);
  MT_EQ_INT(kn_format_parse("", &g), MR_EINVAL);
  MT_EQ_STR(kn_format_name(KN_FMT_COUNT), "?");
  kn_format_wire_name(KN_FMT_BF16, 0, buf, sizeof buf);
  MT_EQ_STR(buf, "bf16");
  kn_format_wire_name(KN_FMT_INT8, 64, buf, sizeof buf);
  MT_EQ_STR(buf, "int8");
  kn_format_wire_name(KN_FMT_INT4, 64, buf, sizeof buf);
  MT_EQ_STR(buf, "int4-g64");
  kn_format_wire_name(KN_FMT_INT4, 128, buf, sizeof buf);
  MT_EQ_STR(buf, "int4-g128");
  kn_format_wire_name(KN_FMT_F32, 0, buf, 3); /* truncates, stays terminated */
  MT_EQ_STR(buf, "f3");
  for (int i = 0; i < KN_ISA_COUNT; i++) {
    kn_isa j;
    MT_EQ_INT(kn_isa_parse(kn_isa_name((kn_isa)i), &j), 0);
    MT_EQ_INT(j, i);
  }
  kn_isa j;
  MT_EQ_INT(kn_isa_parse("sse2", &j), MR_EINVAL);
}

/* Reads the flags line of /proc/cpuinfo; returns false where there is none. */
static bool cpuinfo_flags(char *buf, size_t len) {
  FILE *f = fopen("/proc/cpuinfo", "r");
  if (!f) return false;
  bool found = false;
  char line[8192];
  while (fgets(line, sizeof line, f))
    if (strncmp(line, "flags", 5) == 0) {
      snprintf(buf, len, " %.8000s ", strchr(line, ':') ? strchr(line, ':') + 1 : line);
      char *nl = strchr(buf, '\n');
      if (nl) *nl = ' ';
      found = true;
      break;
    }
  fclose(f);
  return found;
}
static bool has_flag(const char *flags, const char *name) {
  char pat[64];
  snprintf(pat, sizeof pat, " %s ", name);
  return strstr(flags, pat) != NULL;
}

/* The kernel's own view of the CPU (/proc/cpuinfo lists only features the OS enabled)
 * must agree with our cpuid + XCR0 detection. AMX also needs the permission request, so
 * only its upper bound is checked here. */
MT_TEST(isa_detect_matches_cpuinfo) {
  char flags[8192];
  kn_isa best = kn_isa_detect();
  const kn__cpu *c = kn__cpu_get();
  MT_EQ_INT(best, c->best);
  if (!cpuinfo_flags(flags, sizeof flags))
    MT_SKIP("no flags line in /proc/cpuinfo to compare with");
  bool avx2 = has_flag(flags, "avx2") && has_flag(flags, "fma") && has_flag(flags, "f16c");
  bool avx512 = avx2 && has_flag(flags, "avx512f") && has_flag(flags, "avx512bw") &&
                has_flag(flags, "avx512vl") && has_flag(flags, "avx512dq");
  bool amx = avx512 && has_flag(flags, "amx_tile") && has_flag(flags, "amx_bf16") &&
             has_flag(flags, "amx_int8");
  kn_isa expect = amx ? KN_ISA_AMX : avx512 ? KN_ISA_AVX512 : avx2 ? KN_ISA_AVX2 : KN_ISA_REF;
  if (expect == KN_ISA_AMX) {
    MT_TRUE(best >= KN_ISA_AVX512);
    MT_EQ_INT(best == KN_ISA_AMX, c->amx_perm);
  } else {
    MT_EQ_INT(best, expect);
  }
  MT_EQ_INT(c->avx512_bf16, has_flag(flags, "avx512_bf16"));
  MT_EQ_INT(c->avx512_vnni, has_flag(flags, "avx512_vnni"));
}

MT_TEST(engine_isa_choice_and_override) {
  mr_err e = {0};
  kn_engine *eng = NULL;
  unsetenv("MOERPC_ISA");
  kn_engine_opts o = {.isa = KN_ISA_COUNT};
  MT_OK(kn_engine_new(&eng, &o, &e), ep(&e));
  /* Auto picks, per format, the best registered path the CPU supports: never above the
   * detected ISA. */
  for (int f = 0; f < KN_FMT_COUNT; f++)
    MT_TRUE(kn_engine_isa(eng, (kn_format)f) <= kn_isa_detect());
  MT_TRUE(kn_engine_nodes(eng) >= 1);
  MT_TRUE(kn_engine_threads(eng) >= 1);
  kn_engine_free(eng);
  kn_engine_free(NULL);

  setenv("MOERPC_ISA", "ref", 1);
  o.isa = kn_isa_detect();
  MT_OK(kn_engine_new(&eng, &o, &e), ep(&e));
  MT_EQ_INT(eng->isa, KN_ISA_REF); /* the env wins over opts */
  kn_engine_free(eng);

  setenv("MOERPC_ISA", "avx9", 1);
  MT_EQ_INT(kn_engine_new(&eng, &o, &e), MR_EINVAL);
  MT_CONTAINS(e.msg, "MOERPC_ISA");
  MT_TRUE(eng == NULL);
  unsetenv("MOERPC_ISA");

  if (kn_isa_detect() < KN_ISA_AMX) {
    o.isa = KN_ISA_AMX;
    MT_EQ_INT(kn_engine_new(&eng, &o, &e), MR_ENOTSUP);
    MT_CONTAINS(e.msg, "amx");
    setenv("MOERPC_ISA", "amx", 1);
    o.isa = KN_ISA_COUNT;
    MT_EQ_INT(kn_engine_new(&eng, &o, &e), MR_ENOTSUP);
    MT_CONTAINS(e.msg, "MOERPC_ISA = amx");
    unsetenv("MOERPC_ISA");
  }
  o = (kn_engine_opts){.isa = KN_ISA_COUNT, .force_split = KN_MAX_NODES + 1};
  MT_EQ_INT(kn_engine_new(&eng, &o, &e), MR_EINVAL);
  MT_CONTAINS(e.msg, "force_split");
  o = (kn_engine_opts){.isa = KN_ISA_COUNT, .numa = "0,x"};
  MT_EQ_INT(kn_engine_new(&eng, &o, &e), MR_EINVAL);
  MT_CONTAINS(e.msg, "numa");
  o = (kn_engine_opts){.isa = KN_ISA_COUNT, .numa = "999"};
#if MR_HAVE_HWLOC
  MT_EQ_INT(kn_engine_new(&eng, &o, &e), MR_EINVAL);
  MT_CONTAINS(e.msg, "node count");
#else /* without hwloc only one node can be used at all */
  MT_EQ_INT(kn_engine_new(&eng, &o, &e), MR_ENOTSUP);
#endif
  o = (kn_engine_opts){.isa = KN_ISA_COUNT, .numa = "1"};
  MT_OK(kn_engine_new(&eng, &o, &e), ep(&e));
  MT_EQ_INT(kn_engine_nodes(eng), 1);
  kn_engine_free(eng);
}

/* ---- kn_ref against the naive loop ------------------------------------------------- */

MT_TEST(ref_expert_f32_matches_naive) {
  const uint32_t H = 96, I = 160;
  model m = model_make(H, I, 1, 0.1f, true, MR_DTYPE_F32, 1);
  float x[96], y[96], yn[96];
  double yd[96];
  rng_seed(2);
  for (uint32_t i = 0; i < H; i++) x[i] = rng_normal();
  kn_ref_expert_f32(m.gate, m.up, m.down, H, I, x, y);
  naive_expert(m.gate, m.up, m.down, H, I, x, yd);
  for (uint32_t i = 0; i < H; i++) yn[i] = (float)yd[i];
  MT_LE(kn_rel_l2(y, yn, H), 1e-5);
  MT_TRUE(kn_rel_l2(yn, yn, H) == 0.0);
  model_free(&m);
}

MT_TEST(ref_forward_f32_matches_naive) {
  model m = model_make(96, 160, 3, 0.1f, true, MR_DTYPE_F32, 3);
  kn_engine *eng = engine_make(1);
  kn_layer *L = layer_make(eng, &m, KN_FMT_F32, 0, NULL, MR_DTYPE_F32);
  req r = req_make(5, 2, &m, NULL, 10, MR_DTYPE_F32, 4);
  float *ref = malloc((size_t)r.T * m.H * sizeof(float));
  mr_err e = {0};
  kn_moe_args a = req_args(&r);
  MT_OK(kn_ref_moe_forward(L, &a, &e), ep(&e));
  naive_layer(&m, &r, ref);
  double err = kn_rel_l2(r.out, ref, (size_t)r.T * m.H);
  printf("  f32 kn_ref vs naive: rel L2 %.3g\n", err);
  MT_LE(err, 1e-5);
  free(ref);
  req_free(&r);
  kn_layer_free(L);
  kn_engine_free(eng);
  model_free(&m);
}

/* bf16 / f16 layers hold exactly the rounded weights; kn_ref over them equals the naive
 * loop over the same rounded values up to fp32 summation. Loaded from bf16 / f16 / f32
 * sources, which must all pack to the same bits. */
MT_TEST(ref_forward_bf16_f16_match_naive_on_rounded_weights) {
  const mr_dtype dts[2] = {MR_DTYPE_BF16, MR_DTYPE_F16};
  const kn_format fmts[2] = {KN_FMT_BF16, KN_FMT_F16};
  for (int i = 0; i < 2; i++) {
    model m = model_make(64, 96, 4, 0.1f, true, dts[i], 5 + i);
    kn_engine *eng = engine_make(1);
    kn_layer *L1 = layer_make(eng, &m, fmts[i], 0, NULL, dts[i]);
    kn_layer *L2 = layer_make(eng, &m, fmts[i], 0, NULL, MR_DTYPE_F32);
    for (uint32_t x = 0; x < m.E; x++) {
      const kn__slice_w *a = &L1->w[x][0], *b = &L2->w[x][0];
      MT_EQ_INT(memcmp(a->mem, b->mem, a->mem_bytes), 0);
    }
    req r = req_make(7, 3, &m, NULL, 15, MR_DTYPE_BF16, 9);
    float *ref = malloc((size_t)r.T * m.H * sizeof(float));
    mr_err e = {0};
    kn_moe_args a = req_args(&r);
    MT_OK(kn_ref_moe_forward(L1, &a, &e), ep(&e));
    naive_layer(&m, &r, ref);
    double err = kn_rel_l2(r.out, ref, (size_t)r.T * m.H);
    printf("  %s kn_ref vs naive on rounded weights: rel L2 %.3g\n", kn_format_name(fmts[i]), err);
    MT_LE(err, 1e-5);
    free(ref);
    req_free(&r);
    kn_layer_free(L1);
    kn_layer_free(L2);
    kn_engine_free(eng);
    model_free(&m);
  }
}

/* ---- kn_moe_forward against kn_ref ------------------------------------------------- */

static double forward_vs_ref(kn_engine *eng, const kn_layer *L, req *r) {
  mr_err e = {0};
  size_t TH = (size_t)r->T * r->H;
  float *ref = malloc(TH * sizeof(float));
  kn_moe_args a = req_args(r);
  a.out = ref;
  MT_OK(kn_ref_moe_forward(L, &a, &e), ep(&e));
  a.out = r->out;
  MT_OK(kn_moe_forward(eng, L, &a, NULL, &e), ep(&e));
  for (size_t i = 0; i < TH; i++) MT_TRUE(isfinite(r->out[i]));
  double err = kn_rel_l2(r->out, ref, TH);
  free(ref);
  return err;
}

MT_TEST(forward_matches_ref_every_format_and_token_count) {
  const uint32_t Ts[5] = {1, 2, 7, 64, 300};
  const mr_dtype xdt[3] = {MR_DTYPE_F32, MR_DTYPE_F16, MR_DTYPE_BF16};
  model m = model_make(64, 96, 8, 0.1f, true, MR_DTYPE_BF16, 11);
  kn_engine *eng = engine_make(1);
  int n = 0;
  for (int f = 0; f < KN_FMT_COUNT; f++) {
    kn_layer *L = layer_make(eng, &m, all_fmts[f], 32, NULL, MR_DTYPE_BF16);
    for (int ti = 0; ti < 5; ti++) {
      req r = req_make(Ts[ti], 4, &m, NULL, 20, xdt[n % 3], 100 + n);
      double err = forward_vs_ref(eng, L, &r);
      if (err > 1e-6)
        printf("  %s T=%u x=%s: rel L2 %.3g\n", kn_format_name(all_fmts[f]), Ts[ti],
               mr_dtype_name(r.dt), err);
      MT_LE(err, 1e-6);
      req_free(&r);
      n++;
    }
    kn_layer_free(L);
  }
  kn_engine_free(eng);
  model_free(&m);
}

/* The same request with x given as f32, f16 and bf16 holding the same (bf16-exact)
 * values must give the same output. */
MT_TEST(forward_input_dtypes_agree) {
  model m = model_make(64, 96, 4, 0.1f, true, MR_DTYPE_F32, 12);
  kn_engine *eng = engine_make(1);
  kn_layer *L = layer_make(eng, &m, KN_FMT_F32, 0, NULL, MR_DTYPE_F32);
  req r = req_make(9, 2, &m, NULL, 0, MR_DTYPE_BF16, 13);
  size_t TH = (size_t)r.T * m.H;
  float *o32 = malloc(TH * 4);
  void *x16 = malloc(TH * 2);
  mr_err e = {0};
  kn_moe_args a = req_args(&r);
  a.x = r.xf;
  a.x_dtype = MR_DTYPE_F32;
  a.out = o32;
  MT_OK(kn_moe_forward(eng, L, &a, NULL, &e), ep(&e));
  const mr_dtype others[2] = {MR_DTYPE_BF16, MR_DTYPE_F16};
  for (int i = 0; i < 2; i++) {
    mr_convert_from_f32(x16, others[i], r.xf, TH);
    a.x = x16;
    a.x_dtype = others[i];
    a.out = r.out;
    MT_OK(kn_moe_forward(eng, L, &a, NULL, &e), ep(&e));
    MT_EQ_INT(memcmp(r.out, o32, TH * 4), 0);
  }
  free(o32);
  free(x16);
  req_free(&r);
  kn_layer_free(L);
  kn_engine_free(eng);
  model_free(&m);
}

/* Experts held: 1, 4, 6 of 8. Hand-written slot patterns: a token hitting one expert in
 * three slots, a token with every slot empty, repeated experts across tokens. */
MT_TEST(forward_odd_expert_subsets_and_empty_slots) {
  model m = model_make(48, 64, 8, 0.1f, true, MR_DTYPE_F32, 14);
  bool own[8] = {false, true, false, false, true, false, true, false};
  for (int f = 0; f < KN_FMT_COUNT; f++) {
    kn_engine *eng = engine_make(2);
    kn_layer *L = layer_make(eng, &m, all_fmts[f], 32, own, MR_DTYPE_F32);
    MT_FALSE(kn_layer_has_expert(L, 0));
    MT_FALSE(kn_layer_has_expert(L, 8));
    MT_EQ_U64(kn_layer_bytes(L), 3 * kn_layer_expert_bytes(L));
    req r = req_make(4, 4, &m, own, 0, MR_DTYPE_F32, 15);
    const int32_t ids[16] = {4, 4, 4, -1, /* one expert, three slots */
                             -1, -1, -1, -1, /* all empty */
                             6, -1, 1, -1,   /* sparse */
                             1, 4, 6, 1};    /* repeats across tokens and within */
    memcpy(r.ids, ids, sizeof ids);
    double err = forward_vs_ref(eng, L, &r);
    MT_LE(err, 1e-6);
    for (uint32_t o = 0; o < m.H; o++) MT_TRUE(r.out[1 * m.H + o] == 0.0f);
    /* The token with expert 4 in three slots equals expert 4 once with the weights summed
     * (the float format only: the others are checked against ref above). */
    if (all_fmts[f] == KN_FMT_F32) {
      float *ref = malloc((size_t)r.T * m.H * 4);
      naive_layer(&m, &r, ref);
      MT_LE(kn_rel_l2(r.out, ref, (size_t)r.T * m.H), 1e-5);
      free(ref);
    }
    /* A request whose every slot is empty gives zeros. */
    for (int i = 0; i < 16; i++) r.ids[i] = -1;
    for (size_t i = 0; i < (size_t)r.T * m.H; i++) r.out[i] = NAN;
    mr_err e = {0};
    kn_moe_args a = req_args(&r);
    MT_OK(kn_moe_forward(eng, L, &a, NULL, &e), ep(&e));
    for (size_t i = 0; i < (size_t)r.T * m.H; i++) MT_TRUE(r.out[i] == 0.0f);
    for (size_t i = 0; i < (size_t)r.T * m.H; i++) r.out[i] = NAN;
    MT_OK(kn_ref_moe_forward(L, &a, &e), ep(&e));
    for (size_t i = 0; i < (size_t)r.T * m.H; i++) MT_TRUE(r.out[i] == 0.0f);
    /* n_tokens = 0 is a no-op. */
    a.n_tokens = 0;
    MT_OK(kn_moe_forward(eng, L, &a, NULL, &e), ep(&e));
    req_free(&r);
    kn_layer_free(L);
    kn_engine_free(eng);
  }
  model_free(&m);
}

/* Splitting the intermediate dimension over 2, 3 or 5 slices (5 > units of I = 96: two
 * empty slices) changes only the fp32 summation order, in every format: the packed values
 * do not depend on the slice count (internal.h section A). Shapes with tails too. */
MT_TEST(force_split_gives_same_result) {
  const uint32_t shapes[3][2] = {{64, 96}, {50, 70}, {128, 256}};
  const uint32_t splits[4] = {1, 2, 3, 5};
  const uint32_t groups[3] = {32, 64, 128};
  for (int sh = 0; sh < 3; sh++) {
    model m = model_make(shapes[sh][0], shapes[sh][1], 5, 0.1f, true, MR_DTYPE_BF16, 20 + sh);
    for (int f = 0; f < KN_FMT_COUNT; f++) {
      uint32_t G = groups[sh];
      req r = req_make(13, 3, &m, NULL, 10, MR_DTYPE_BF16, 30 + sh);
      size_t TH = (size_t)r.T * m.H;
      float *base = malloc(TH * 4);
      for (int si = 0; si < 4; si++) {
        kn_engine *eng = engine_make(splits[si]);
        kn_layer *L = layer_make(eng, &m, all_fmts[f], G, NULL, MR_DTYPE_BF16);
        /* Slices cover I in order, each starting at a multiple of the unit. */
        uint32_t unit = all_fmts[f] == KN_FMT_INT4 && G > 32 ? G : 32, o = 0;
        MT_EQ_INT(L->n_slices, splits[si]);
        for (uint32_t s = 0; s < L->n_slices; s++) {
          MT_EQ_INT(L->slice_off[s], o);
          if (L->slice_len[s]) MT_EQ_INT(L->slice_off[s] % unit, 0);
          o += L->slice_len[s];
        }
        MT_EQ_INT(o, m.I);
        MT_LE(forward_vs_ref(eng, L, &r), 1e-6);
        if (si == 0) {
          memcpy(base, r.out, TH * 4);
        } else {
          double err = kn_rel_l2(r.out, base, TH);
          if (err > 1e-6)
            printf("  %s H=%u I=%u split %u: rel L2 %.3g vs split 1\n",
                   kn_format_name(all_fmts[f]), m.H, m.I, splits[si], err);
          MT_LE(err, 1e-6);
        }
        kn_layer_free(L);
        kn_engine_free(eng);
      }
      free(base);
      req_free(&r);
    }
    model_free(&m);
  }
}

/* A caller-provided scratch arena works, is reused after reset, and leaves the engine's
 * own arena alone. */
MT_TEST(forward_with_caller_scratch) {
  model m = model_make(64, 96, 4, 0.1f, true, MR_DTYPE_F32, 40);
  kn_engine *eng = engine_make(2);
  kn_layer *L = layer_make(eng, &m, KN_FMT_BF16, 0, NULL, MR_DTYPE_F32);
  mr_arena ar;
  mr_arena_init(&ar, 4096); /* small: forces chained blocks */
  for (int it = 0; it < 3; it++) {
    req r = req_make(33, 4, &m, NULL, 10, MR_DTYPE_F16, 41 + it);
    float *ref = malloc((size_t)r.T * m.H * 4);
    mr_err e = {0};
    kn_moe_args a = req_args(&r);
    a.out = ref;
    MT_OK(kn_ref_moe_forward(L, &a, &e), ep(&e));
    a.out = r.out;
    MT_OK(kn_moe_forward(eng, L, &a, &ar, &e), ep(&e));
    MT_TRUE(ar.used > 0);
    MT_LE(kn_rel_l2(r.out, ref, (size_t)r.T * m.H), 1e-6);
    mr_arena_reset(&ar);
    MT_EQ_INT(ar.used, 0);
    free(ref);
    req_free(&r);
  }
  MT_EQ_INT(eng->scratch.used, 0);
  mr_arena_close(&ar);
  kn_layer_free(L);
  kn_engine_free(eng);
  model_free(&m);
}

/* ---- quantization ------------------------------------------------------------------ */

/* Every decoded INT8 weight is within amax / 254 of the original, amax being that of its
 * full HF row (gate/up: the row along H; down: the row along all of I). */
MT_TEST(int8_round_trip_bound) {
  model m = model_make(70, 100, 2, 0.05f, true, MR_DTYPE_F32, 50);
  for (uint32_t split = 1; split <= 3; split += 2) {
    kn_engine *eng = engine_make(split);
    kn_layer *L = layer_make(eng, &m, KN_FMT_INT8, 0, NULL, MR_DTYPE_F32);
    float *dq = malloc(256 * 4);
    double worst = 0.0;
    for (uint32_t x = 0; x < m.E; x++)
      for (uint32_t s = 0; s < L->n_slices; s++) {
        const kn__slice_w *w = &L->w[x][s];
        uint32_t off = L->slice_off[s], Is = L->slice_len[s];
        for (uint32_t i = 0; i < Is; i++)
          for (int p = 0; p < 2; p++) {
            const float *src = (p == 0 ? mg(&m, x) : mu(&m, x)) + (size_t)(off + i) * m.H;
            kn__row_to_f32(L, s, w, (kn__proj)p, i, dq);
            float amax = 0;
            for (uint32_t c = 0; c < m.H; c++) amax = fmaxf(amax, fabsf(src[c]));
            MT_NEAR((p == 0 ? w->gate_scale : w->up_scale)[i], amax / 127.0f, 1e-12);
            for (uint32_t c = 0; c < m.H; c++) {
              double err = fabs(dq[c] - src[c]);
              MT_LE(err, amax / 254.0 * (1 + 1e-5));
              if (err / amax > worst) worst = err / amax;
            }
          }
        for (uint32_t j = 0; j < m.H; j++) {
          const float *src = md(&m, x) + (size_t)j * m.I;
          float amax = 0;
          for (uint32_t c = 0; c < m.I; c++) amax = fmaxf(amax, fabsf(src[c]));
          kn__row_to_f32(L, s, w, KN__DOWN, j, dq);
          for (uint32_t c = 0; c < Is; c++) MT_LE(fabs(dq[c] - src[off + c]), amax / 254.0 * (1 + 1e-5));
        }
      }
    /* The bound is tight: some weight lands near half a step. */
    MT_TRUE(worst > 0.8 / 254.0);
    free(dq);
    kn_layer_free(L);
    kn_engine_free(eng);
  }
  model_free(&m);
}

/* Every decoded INT4 weight is within scale / 2 of the original, scale = amax(group) / 7;
 * shapes with short last groups included. */
MT_TEST(int4_round_trip_bound) {
  const uint32_t groups[3] = {32, 64, 128};
  model m = model_make(150, 200, 2, 0.05f, true, MR_DTYPE_F32, 51);
  for (int gi = 0; gi < 3; gi++) {
    const uint32_t G = groups[gi];
    kn_engine *eng = engine_make(2);
    kn_layer *L = layer_make(eng, &m, KN_FMT_INT4, G, NULL, MR_DTYPE_F32);
    float *dq = malloc(256 * 4);
    for (uint32_t x = 0; x < m.E; x++)
      for (uint32_t s = 0; s < L->n_slices; s++) {
        const kn__slice_w *w = &L->w[x][s];
        uint32_t off = L->slice_off[s], Is = L->slice_len[s];
        for (int p = 0; p < 3; p++) {
          uint32_t rows = p == KN__DOWN ? m.H : Is, K = p == KN__DOWN ? Is : m.H;
          const float *sc = p == 0 ? w->gate_scale : p == 1 ? w->up_scale : w->down_scale;
          for (uint32_t rr = 0; rr < rows; rr++) {
            const float *src = p == KN__DOWN ? md(&m, x) + (size_t)rr * m.I + off
                                             : (p == 0 ? mg(&m, x) : mu(&m, x)) + (size_t)(off + rr) * m.H;
            kn__row_to_f32(L, s, w, (kn__proj)p, rr, dq);
            for (uint32_t g = 0; g < kn__ngroups(K, G); g++) {
              float amax = 0;
              for (uint32_t c = g * G; c < K && c < (g + 1) * G; c++) amax = fmaxf(amax, fabsf(src[c]));
              float scale = sc[(size_t)rr * kn__ngroups(K, G) + g];
              MT_NEAR(scale, amax / 7.0f, 1e-12);
              for (uint32_t c = g * G; c < K && c < (g + 1) * G; c++)
                MT_LE(fabs(dq[c] - src[c]), scale / 2 * (1 + 1e-5));
            }
          }
        }
      }
    free(dq);
    kn_layer_free(L);
    kn_engine_free(eng);
  }
  model_free(&m);
}

/* Pins the INT4 bit layout of internal.h: low nibble first, two's complement, one scale
 * per group, short last group padded with zero nibbles. */
MT_TEST(int4_nibble_layout) {
  const uint32_t H = 36, I = 32, G = 32; /* gate/up rows: one full group + a 4-wide tail */
  float *g = calloc(I * H, 4), *u = calloc(I * H, 4), *d = calloc(H * I, 4);
  /* gate row 0: 7, -7, 1, -1, 0 ... (amax 7 -> scale 1), tail group: 3.5, -0.5 -> scale 0.5 */
  g[0] = 7; g[1] = -7; g[2] = 1; g[3] = -1;
  g[32] = 3.5f; g[33] = -0.5f; g[34] = 0.2f; g[35] = 0.3f;
  kn_engine *eng = engine_make(1);
  kn_layer *L = NULL;
  mr_err e = {0};
  kn_layer_desc desc = {.hidden = H, .inter = I, .num_experts = 1, .format = KN_FMT_INT4, .group = G};
  MT_OK(kn_layer_new(&L, eng, &desc, &e), ep(&e));
  MT_OK(kn_layer_load_expert(L, 0, g, u, d, MR_DTYPE_F32, &e), ep(&e));
  const kn__slice_w *w = &L->w[0][0];
  const uint8_t *b = w->gate;
  MT_EQ_INT(kn__row_bytes(KN_FMT_INT4, H, G), 32); /* two groups of 16 bytes */
  MT_EQ_INT(b[0], 0x97); /* lo 7, hi -7 = 0x9 */
  MT_EQ_INT(b[1], 0xF1); /* lo 1, hi -1 = 0xF */
  MT_EQ_INT(b[2], 0x00);
  MT_NEAR(w->gate_scale[0], 1.0f, 0);
  MT_NEAR(w->gate_scale[1], 0.5f, 0);
  /* tail: 3.5/0.5 = 7, -0.5/0.5 = -1 -> 0xF7; 0.2/0.5 = 0.4 -> 0, 0.3/0.5 = 0.6 -> 1 -> 0x10 */
  MT_EQ_INT(b[16], 0xF7);
  MT_EQ_INT(b[17], 0x10);
  for (int i = 18; i < 32; i++) MT_EQ_INT(b[i], 0); /* padding */
  float dq[36];
  kn__row_to_f32(L, 0, w, KN__GATE, 0, dq);
  MT_NEAR(dq[1], -7.0f, 0);
  MT_NEAR(dq[33], -0.5f, 0);
  MT_NEAR(dq[35], 0.5f, 0);
  /* An all-zero row has scale 0 and decodes to zeros. */
  MT_NEAR(w->up_scale[0], 0.0f, 0);
  kn__row_to_f32(L, 0, w, KN__UP, 0, dq);
  for (uint32_t i = 0; i < H; i++) MT_TRUE(dq[i] == 0.0f);
  free(g);
  free(u);
  free(d);
  kn_layer_free(L);
  kn_engine_free(eng);
}

/* docs/DESIGN.md section 5: relative L2 of a layer's output vs the fp32 reference on bf16
 * weights. Weights ~ N(0, 0.02^2) rounded to bf16 (like checkpoint weights), x ~ N(0, 1),
 * Qwen3-like proportions (I = H / 2), 8 experts, top-4.
 *
 * INT4 could not meet the 6e-2 first asked for, and no 4-bit grid can: the RMS error of one
 * quantized Gaussian weight relative to its std is 0.097 / 0.108 / 0.117 for groups of
 * 32 / 64 / 128 with scale amax / 7 (0.086 / 0.095 / 0.101 even with a per-group searched
 * scale over -8..7), and the three chained matrices add up to about sqrt(3) times that:
 * 0.168 / 0.186 / 0.203, which is what this test measures (0.172 / 0.191 / 0.210). The
 * limits below are that estimate plus 15 %, and docs/DESIGN.md section 5 states them. */
MT_TEST(layer_tolerance_design_section5) {
  const uint32_t H = 512, I = 256;
  model m = model_make(H, I, 8, 0.02f, true, MR_DTYPE_BF16, 60);
  req r = req_make(24, 4, &m, NULL, 0, MR_DTYPE_BF16, 61);
  size_t TH = (size_t)r.T * H;
  float *ref = malloc(TH * 4);
  naive_layer(&m, &r, ref);
  struct {
    kn_format f;
    uint32_t G;
    double tol;
  } cases[] = {{KN_FMT_F32, 0, 1e-5},   {KN_FMT_BF16, 0, 1e-2},  {KN_FMT_F16, 0, 1e-2},
               {KN_FMT_INT8, 0, 2.5e-2}, {KN_FMT_INT4, 32, 0.20}, {KN_FMT_INT4, 64, 0.22},
               {KN_FMT_INT4, 128, 0.24}, {KN_FMT_FP8, 128, 0.06}};
  kn_engine *eng = engine_make(2);
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
    kn_layer *L = layer_make(eng, &m, cases[c].f, cases[c].G, NULL, MR_DTYPE_BF16);
    mr_err e = {0};
    kn_moe_args a = req_args(&r);
    MT_OK(kn_moe_forward(eng, L, &a, NULL, &e), ep(&e));
    double err = kn_rel_l2(r.out, ref, TH);
    printf("  %-5s g%-3u rel L2 vs fp32 reference: %.4g (limit %.3g)\n", kn_format_name(cases[c].f),
           cases[c].G, err, cases[c].tol);
    MT_LE(err, cases[c].tol);
    kn_layer_free(L);
  }
  kn_engine_free(eng);
  free(ref);
  req_free(&r);
  model_free(&m);
}

/* ---- refused input ----------------------------------------------------------------- */

MT_TEST(forward_refuses_bad_ids_and_weights) {
  model m = model_make(32, 32, 6, 0.1f, true, MR_DTYPE_F32, 70);
  bool own[6] = {true, true, true, true, false, true};
  kn_engine *eng = engine_make(2);
  kn_layer *L = layer_make(eng, &m, KN_FMT_INT8, 0, own, MR_DTYPE_F32);
  req r = req_make(3, 2, &m, own, 0, MR_DTYPE_F32, 71);
  mr_err e = {0};
  kn_moe_args a = req_args(&r);
  for (int which = 0; which < 2; which++) {
    struct {
      uint32_t at;
      int32_t id;
      float w;
      int code;
      const char *msg;
    } bad[] = {
        {3, 6, 1.0f, MR_ERANGE, "expert_ids[token 1, slot 1] = 6, must be -1 (empty) or in 0..5"},
        {0, 1000000, 1.0f, MR_ERANGE, "token 0, slot 0"},
        {4, -2, 1.0f, MR_ERANGE, "= -2"},
        {5, 4, 1.0f, MR_EPRECOND, "expert 4 (token 2, slot 1) is not held"},
        {2, 1, NAN, MR_EINVAL, "weights[token 1, slot 0]"},
        {2, 1, INFINITY, MR_EINVAL, "must be finite"},
    };
    for (size_t b = 0; b < sizeof bad / sizeof bad[0]; b++) {
      req_free(&r);
      r = req_make(3, 2, &m, own, 0, MR_DTYPE_F32, 71);
      a = req_args(&r);
      r.ids[bad[b].at] = bad[b].id;
      r.w[bad[b].at] = bad[b].w;
      for (size_t i = 0; i < (size_t)r.T * m.H; i++) r.out[i] = 123.0f;
      int rc = which == 0 ? kn_moe_forward(eng, L, &a, NULL, &e) : kn_ref_moe_forward(L, &a, &e);
      MT_EQ_INT(rc, bad[b].code);
      MT_CONTAINS(e.msg, bad[b].msg);
      /* Refused before anything is computed: out untouched. */
      for (size_t i = 0; i < (size_t)r.T * m.H; i++) MT_TRUE(r.out[i] == 123.0f);
    }
    /* An empty slot's weight is ignored, even when it is NaN. */
    req_free(&r);
    r = req_make(3, 2, &m, own, 0, MR_DTYPE_F32, 71);
    r.ids[0] = -1;
    r.w[0] = NAN;
    r.ids[4] = 0;
    r.w[4] = 0.5f;
    a = req_args(&r);
    MT_OK(which == 0 ? kn_moe_forward(eng, L, &a, NULL, &e) : kn_ref_moe_forward(L, &a, &e), ep(&e));
  }
  /* Bad args. */
  a = req_args(&r);
  a.top_k = 0;
  MT_EQ_INT(kn_moe_forward(eng, L, &a, NULL, &e), MR_EINVAL);
  MT_CONTAINS(e.msg, "top_k = 0");
  a = req_args(&r);
  a.x_dtype = MR_DTYPE_UNSPECIFIED;
  MT_EQ_INT(kn_moe_forward(eng, L, &a, NULL, &e), MR_EINVAL);
  MT_CONTAINS(e.msg, "x_dtype");
  a = req_args(&r);
  a.x = NULL;
  MT_EQ_INT(kn_ref_moe_forward(L, &a, &e), MR_EINVAL);
  req_free(&r);
  kn_layer_free(L);
  kn_engine_free(eng);
  model_free(&m);
}

MT_TEST(layer_new_refuses_bad_desc) {
  kn_engine *eng = engine_make(1);
  kn_layer *L = NULL;
  mr_err e = {0};
  struct {
    kn_layer_desc d;
    const char *msg;
  } bad[] = {
      {{0, 64, 8, KN_FMT_BF16, 0}, "hidden = 0, must be in 1..65536"},
      {{65537, 64, 8, KN_FMT_BF16, 0}, "hidden = 65537"},
      {{64, 0, 8, KN_FMT_BF16, 0}, "inter = 0, must be in 1..65536"},
      {{64, 70000, 8, KN_FMT_BF16, 0}, "inter = 70000"},
      {{64, 64, 0, KN_FMT_BF16, 0}, "num_experts = 0, must be in 1..65536"},
      {{64, 64, 65537, KN_FMT_BF16, 0}, "num_experts = 65537"},
      {{64, 64, 8, KN_FMT_COUNT, 0}, "format = 6"},
      {{64, 64, 8, KN_FMT_INT4, 0}, "group = 0, must be 32, 64 or 128"},
      {{64, 64, 8, KN_FMT_INT4, 48}, "group = 48"},
      {{64, 64, 8, KN_FMT_INT4, 256}, "group = 256"},
  };
  for (size_t b = 0; b < sizeof bad / sizeof bad[0]; b++) {
    MT_EQ_INT(kn_layer_new(&L, eng, &bad[b].d, &e), MR_EINVAL);
    MT_CONTAINS(e.msg, bad[b].msg);
    MT_TRUE(L == NULL);
  }
  /* The limits themselves are accepted; group is ignored outside INT4. */
  kn_layer_desc ok = {1, 1, 65536, KN_FMT_BF16, 48};
  MT_OK(kn_layer_new(&L, eng, &ok, &e), ep(&e));
  MT_EQ_INT(kn_layer_get_desc(L)->group, 0);
  MT_EQ_U64(kn_layer_bytes(L), 0);
  kn_layer_free(L);
  kn_layer_free(NULL);
  kn_engine_free(eng);
}

MT_TEST(load_expert_refuses_bad_input) {
  model m = model_make(32, 40, 2, 0.1f, true, MR_DTYPE_F32, 80);
  kn_engine *eng = engine_make(2);
  kn_layer *L = NULL;
  mr_err e = {0};
  kn_layer_desc d = {32, 40, 2, KN_FMT_INT4, 32};
  MT_OK(kn_layer_new(&L, eng, &d, &e), ep(&e));
  MT_EQ_INT(kn_layer_load_expert(L, 2, m.gate, m.up, m.down, MR_DTYPE_F32, &e), MR_ERANGE);
  MT_CONTAINS(e.msg, "expert = 2, must be below num_experts = 2");
  MT_EQ_INT(kn_layer_load_expert(L, 0, m.gate, m.up, m.down, MR_DTYPE_UNSPECIFIED, &e), MR_EINVAL);
  MT_CONTAINS(e.msg, "dtype");
  MT_EQ_INT(kn_layer_load_expert(L, 0, NULL, m.up, m.down, MR_DTYPE_F32, &e), MR_EINVAL);
  /* A non-finite weight is refused with its place; nothing is kept. */
  m.up[3 * 32 + 5] = NAN;
  MT_EQ_INT(kn_layer_load_expert(L, 1, m.gate, m.up, m.down, MR_DTYPE_F32, &e), MR_EINVAL);
  MT_CONTAINS(e.msg, "expert 1 up[3, 5] = nan");
  m.up[3 * 32 + 5] = 0.0f;
  m.down[7 * 40 + 39] = INFINITY; /* column 39 lives in the second slice */
  MT_EQ_INT(kn_layer_load_expert(L, 1, m.gate, m.up, m.down, MR_DTYPE_F32, &e), MR_EINVAL);
  MT_CONTAINS(e.msg, "expert 1 down[7, 39] = inf");
  MT_FALSE(kn_layer_has_expert(L, 1));
  MT_EQ_U64(kn_layer_bytes(L), 0);
  m.down[7 * 40 + 39] = 0.0f;
  /* Reloading replaces: bytes count the expert once. */
  MT_OK(kn_layer_load_expert(L, 1, m.gate, m.up, m.down, MR_DTYPE_F32, &e), ep(&e));
  MT_OK(kn_layer_load_expert(L, 1, m.gate, m.up, m.down, MR_DTYPE_F32, &e), ep(&e));
  MT_EQ_U64(kn_layer_bytes(L), kn_layer_expert_bytes(L));
  kn_layer_free(L);
  kn_engine_free(eng);
  model_free(&m);
}

/* Out-of-memory anywhere in load or forward is an error, never a crash or a leak of
 * state: after it, the same calls succeed. */
MT_TEST(allocation_failures_are_errors) {
  model m = model_make(64, 96, 2, 0.1f, true, MR_DTYPE_F32, 90);
  kn_engine *eng = engine_make(3);
  kn_layer *L = NULL;
  mr_err e = {0};
  kn_layer_desc d = {64, 96, 2, KN_FMT_INT8, 0};
  MT_OK(kn_layer_new(&L, eng, &d, &e), ep(&e));
  int failures = 0;
  for (long n = 1; n < 20; n++) {
    mr_alloc_fail_after(n);
    int rc = kn_layer_load_expert(L, 0, mg(&m, 0), mu(&m, 0), md(&m, 0), MR_DTYPE_F32, &e);
    mr_alloc_fail_after(0);
    if (rc == 0) break;
    MT_EQ_INT(rc, MR_ENOMEM);
    MT_FALSE(kn_layer_has_expert(L, 0));
    failures++;
  }
  MT_TRUE(failures >= 3); /* slice array, row buffer, one block per slice */
  MT_TRUE(kn_layer_has_expert(L, 0));
  req r = req_make(40, 2, &m, (bool[]){true, false}, 0, MR_DTYPE_BF16, 91);
  kn_moe_args a = req_args(&r);
  for (long n = 1; n < 8; n++) {
    mr_alloc_fail_after(n);
    int rc = kn_moe_forward(eng, L, &a, NULL, &e);
    mr_alloc_fail_after(0);
    if (rc == 0) break;
    MT_EQ_INT(rc, MR_ENOMEM);
    MT_CONTAINS(e.msg, "scratch");
  }
  MT_LE(forward_vs_ref(eng, L, &r), 1e-6);
  mr_alloc_fail_after(1);
  MT_EQ_INT(kn_ref_moe_forward(L, &a, &e), MR_ENOMEM);
  mr_alloc_fail_after(0);
  req_free(&r);
  kn_layer_free(L);
  kn_engine_free(eng);
  model_free(&m);
}

/* ---- fp8-b128 ---------------------------------------------------------------------- */

/* The e4m3fn table and the rounding: every finite code round-trips; the midpoint between
 * two neighbours rounds to the even code; beyond 448 saturates; NaN stays NaN. */
MT_TEST(fp8_e4m3_table_and_rounding) {
  MT_EQ_INT(kn_fp8_e4m3_to_f32(0x7e) == 448.0f, 1);
  MT_EQ_INT(kn_fp8_e4m3_to_f32(0x01) == ldexpf(1.0f, -9), 1); /* smallest subnormal */
  MT_EQ_INT(kn_fp8_e4m3_to_f32(0x08) == ldexpf(1.0f, -6), 1); /* smallest normal */
  MT_EQ_INT(kn_fp8_e4m3_to_f32(0x38) == 1.0f, 1);
  MT_EQ_INT(kn_fp8_e4m3_to_f32(0xb8) == -1.0f, 1);
  MT_TRUE(isnan(kn_fp8_e4m3_to_f32(0x7f)) && isnan(kn_fp8_e4m3_to_f32(0xff)));
  MT_TRUE(signbit(kn_fp8_e4m3_to_f32(0x80)) && kn_fp8_e4m3_to_f32(0x80) == 0.0f);
  int n = 0;
  for (int c = 0; c < 256; c++) {
    if ((c & 0x7f) == 0x7f) continue;
    float v = kn_fp8_e4m3_to_f32((uint8_t)c);
    MT_EQ_INT(kn_fp8_e4m3_from_f32(v), c);
    /* Midpoint to the next code up (in magnitude): ties go to the even code. */
    if ((c & 0x7f) < 0x7e) {
      float up = kn_fp8_e4m3_to_f32((uint8_t)(c + 1));
      float mid = (v + up) / 2.0f; /* exact: few mantissa bits */
      int even = (c & 1) ? c + 1 : c;
      MT_EQ_INT(kn_fp8_e4m3_from_f32(mid), even);
      MT_EQ_INT(kn_fp8_e4m3_from_f32(nextafterf(mid, 0.0f)), c); /* just below: down */
      MT_EQ_INT(kn_fp8_e4m3_from_f32(nextafterf(mid, (c & 0x80) ? -INFINITY : INFINITY)), c + 1);
    }
    n++;
  }
  MT_EQ_INT(n, 254);
  MT_EQ_INT(kn_fp8_e4m3_from_f32(449.0f), 0x7e);
  MT_EQ_INT(kn_fp8_e4m3_from_f32(1e30f), 0x7e);
  MT_EQ_INT(kn_fp8_e4m3_from_f32(-INFINITY), 0xfe);
  MT_EQ_INT(kn_fp8_e4m3_from_f32(NAN) & 0x7f, 0x7f);
  MT_EQ_INT(kn_fp8_e4m3_from_f32(ldexpf(1.0f, -11)), 0x00); /* below half the smallest: 0 */
  MT_EQ_INT(kn_fp8_e4m3_from_f32(ldexpf(1.0f, -10)), 0x00); /* the tie 0 / 2^-9: even = 0 */
  MT_EQ_INT(kn_fp8_e4m3_from_f32(ldexpf(3.0f, -10)), 0x02); /* 1.5 * 2^-9 ties to 2 * 2^-9 */
}

/* Block quantization: scale = amax / 448 of each 128x128 block (1 for a zero block), and
 * the dequantized weights within half a step (relative 2^-4) of the originals; an FP8
 * layer loaded from the codes decodes to e4m3 * scale bit-exactly, and other formats
 * loaded from the same codes see those values. */
MT_TEST(fp8_quantize_and_load_round_trip) {
  const uint32_t N = 200, K = 300; /* partial blocks in both directions */
  float *w = malloc((size_t)N * K * 4);
  for (uint32_t i = 0; i < N; i++)
    for (uint32_t k = 0; k < K; k++)
      w[(size_t)i * K + k] = (i >= 128 && k < 128) ? 0.0f : sinf(0.37f * (float)(i * K + k)) * (1.0f + (float)(k / 128));
  uint8_t *q = malloc((size_t)N * K);
  float sc[2 * 3];
  mr_err e = {0};
  MT_OK(kn_fp8_quantize_b128(w, MR_DTYPE_F32, N, K, q, sc, &e), ep(&e));
  MT_TRUE(sc[3] == 1.0f); /* block [1, 0] is all zero */
  for (int b = 0; b < 6; b++) MT_TRUE(sc[b] > 0.0f);
  for (uint32_t i = 0; i < N; i++)
    for (uint32_t k = 0; k < K; k++) {
      float s = sc[(i / 128) * 3 + k / 128], v = w[(size_t)i * K + k];
      float dq = kn_fp8_e4m3_to_f32(q[(size_t)i * K + k]) * s;
      MT_TRUE(fabsf(dq - v) <= fmaxf(fabsf(v) / 16.0f, s * ldexpf(1.0f, -10)) * 1.0001f);
    }
  /* As an expert: gate = up = W [I = 200, H = 300], down = W^T needs [300, 200]. */
  uint8_t *qd = malloc((size_t)N * K);
  float scd[3 * 2];
  float *wt = malloc((size_t)N * K * 4);
  for (uint32_t i = 0; i < N; i++)
    for (uint32_t k = 0; k < K; k++) wt[(size_t)k * N + i] = w[(size_t)i * K + k];
  MT_OK(kn_fp8_quantize_b128(wt, MR_DTYPE_F32, K, N, qd, scd, &e), ep(&e));
  const kn_format fmts[2] = {KN_FMT_FP8, KN_FMT_F32};
  for (int fi = 0; fi < 2; fi++)
    for (uint32_t split = 1; split <= 2; split++) {
      kn_engine *eng = engine_make(split);
      kn_layer *L = NULL;
      kn_layer_desc d = {.hidden = K, .inter = N, .num_experts = 2, .format = fmts[fi]};
      MT_OK(kn_layer_new(&L, eng, &d, &e), ep(&e));
      MT_OK(kn_layer_load_expert_fp8(L, 1, q, sc, q, sc, qd, scd, &e), ep(&e));
      float *row = malloc(K * 4);
      for (uint32_t s = 0; s < L->n_slices; s++) {
        if (fmts[fi] == KN_FMT_FP8) MT_EQ_INT(L->slice_off[s] % 128, 0);
        for (uint32_t i = 0; i < L->slice_len[s]; i++) {
          kn__row_to_f32(L, s, &L->w[1][s], KN__UP, i, row);
          uint32_t hi = L->slice_off[s] + i;
          for (uint32_t k = 0; k < K; k++)
            MT_TRUE(row[k] == kn_fp8_e4m3_to_f32(q[(size_t)hi * K + k]) * sc[(hi / 128) * 3 + k / 128]);
        }
        for (uint32_t j = 0; j < K; j++) {
          kn__row_to_f32(L, s, &L->w[1][s], KN__DOWN, j, row);
          for (uint32_t c = 0; c < L->slice_len[s]; c++) {
            uint32_t col = L->slice_off[s] + c;
            MT_TRUE(row[c] == kn_fp8_e4m3_to_f32(qd[(size_t)j * N + col]) * scd[(j / 128) * 2 + col / 128]);
          }
        }
      }
      free(row);
      kn_layer_free(L);
      kn_engine_free(eng);
    }
  free(w);
  free(wt);
  free(q);
  free(qd);
}

/* kn_fp8_dequant_b128: any band of rows (starting inside a block row, K not a multiple of
 * 128) gives the table's value times its block's scale bit for bit, on the engine's
 * workers and on the calling thread alike; a NaN code is refused naming the first one in
 * row-major order (two are planted in different items, the later one first in the
 * matrix's second half), and so is a code whose product with a huge block scale overflows
 * fp32; bad arguments are refused. */
MT_TEST(fp8_dequant_bands_on_the_workers) {
  const uint32_t N = 700, K = 333, C = 3; /* 6 block rows, the last partial; 3 block columns */
  uint8_t *q = malloc((size_t)N * K);
  float sc[6 * 3];
  rng_seed(21);
  for (size_t i = 0; i < (size_t)N * K; i++) {
    q[i] = (uint8_t)rng_u32();
    if ((q[i] & 0x7f) == 0x7f) q[i] = 0x01; /* the smallest subnormal instead */
  }
  for (int b = 0; b < 18; b++) sc[b] = ldexpf(1.0f + (float)b / 7.0f, b * 9 - 80);
  kn_engine *eng = engine_make(0);
  mr_err e = {0};
  float *d = malloc(((size_t)N * K + 1) * 4);
  const uint32_t bands[][2] = {{0, 700}, {1, 1}, {130, 300}, {699, 1}, {5, 0}};
  for (int use_eng = 0; use_eng < 2; use_eng++)
    for (size_t bi = 0; bi < sizeof bands / sizeof bands[0]; bi++) {
      const uint32_t r0 = bands[bi][0], n = bands[bi][1];
      memset(d, 0xff, ((size_t)N * K + 1) * 4);
      MT_OK(kn_fp8_dequant_b128(use_eng ? eng : NULL, q, sc, N, K, r0, n, d, &e), ep(&e));
      for (uint32_t r = 0; r < n; r++)
        for (uint32_t k = 0; k < K; k++) {
          const uint32_t row = r0 + r;
          const float want = kn_fp8_e4m3_to_f32(q[(size_t)row * K + k]) * sc[(row / 128) * C + k / 128];
          MT_EQ_INT(memcmp(&d[(size_t)r * K + k], &want, 4), 0);
        }
      MT_TRUE(isnan(d[(size_t)n * K])); /* nothing written past the band */
    }
  q[(size_t)650 * K + 3] = 0x7f;
  q[(size_t)200 * K + 300] = 0xff;
  for (int use_eng = 0; use_eng < 2; use_eng++) {
    MT_EQ_INT(kn_fp8_dequant_b128(use_eng ? eng : NULL, q, sc, N, K, 0, N, d, &e), MR_EINVAL);
    MT_CONTAINS(e.msg, "[200, 300] is a NaN code (0xff)");
    MT_EQ_INT(kn_fp8_dequant_b128(use_eng ? eng : NULL, q, sc, N, K, 201, 499, d, &e), MR_EINVAL);
    MT_CONTAINS(e.msg, "[650, 3] is a NaN code (0x7f)");
    MT_OK(kn_fp8_dequant_b128(use_eng ? eng : NULL, q, sc, N, K, 201, 449, d, &e), ep(&e));
  }
  /* a block scale so large that a code overflows fp32: refused, named (block [1, 2]) */
  sc[1 * C + 2] = 1e37f;
  for (uint32_t r = 128; r < 256; r++) memset(q + (size_t)r * K + 256, 0x38, K - 256); /* 1.0 */
  q[(size_t)140 * K + 300] = 0x7e; /* 448: 4.48e39 */
  q[(size_t)150 * K + 257] = 0x66; /* 56 x 1e37 overflows too; row 151 stays finite */
  MT_EQ_INT(kn_fp8_dequant_b128(eng, q, sc, N, K, 130, 60, d, &e), MR_EINVAL);
  MT_CONTAINS(e.msg, "[140, 300]: code 0x7e times block scale 1e+37 overflows fp32");
  MT_EQ_INT(kn_fp8_dequant_b128(eng, q, sc, N, K, 150, 1, d, &e), MR_EINVAL);
  MT_CONTAINS(e.msg, "[150, 257]: code 0x66");
  MT_OK(kn_fp8_dequant_b128(eng, q, sc, N, K, 151, 1, d, &e), ep(&e));
  MT_TRUE(d[300] == 1e37f);
  MT_EQ_INT(kn_fp8_dequant_b128(eng, q, sc, N, K, 600, 101, d, &e), MR_EINVAL);
  MT_CONTAINS(e.msg, "rows 600..701 of a 700-row matrix");
  MT_EQ_INT(kn_fp8_dequant_b128(eng, q, NULL, N, K, 0, 1, d, &e), MR_EINVAL);
  MT_EQ_INT(kn_fp8_dequant_b128(eng, q, sc, N, 0, 0, 1, d, &e), MR_EINVAL);
  kn_engine_free(eng);
  free(d);
  free(q);
}

/* Bad fp8 input: a zero, negative, NaN or inf block scale (named: expert, matrix, block),
 * a NaN code (named by row and column), non-finite source weights when quantizing. */
MT_TEST(fp8_load_refuses_bad_scales_and_codes) {
  const uint32_t H = 130, I = 64;
  kn_engine *eng = engine_make(1);
  kn_layer *L = NULL;
  mr_err e = {0};
  kn_layer_desc d = {.hidden = H, .inter = I, .num_experts = 4, .format = KN_FMT_FP8};
  MT_OK(kn_layer_new(&L, eng, &d, &e), ep(&e));
  MT_EQ_INT(L->d.group, 128);
  uint8_t *q = calloc((size_t)H * I, 1);
  float gs[2] = {1, 1}, ds[2] = {1, 1};
  MT_OK(kn_layer_load_expert_fp8(L, 0, q, gs, q, gs, q, ds, &e), ep(&e));
  const float bad[4] = {0.0f, -1.0f, NAN, INFINITY};
  for (int b = 0; b < 4; b++) {
    float us[2] = {1, bad[b]};
    MT_EQ_INT(kn_layer_load_expert_fp8(L, 2, q, gs, q, us, q, ds, &e), MR_EINVAL);
    MT_CONTAINS(e.msg, "expert 2 up scale_inv[0, 1]");
    MT_CONTAINS(e.msg, "finite and > 0");
  }
  MT_FALSE(kn_layer_has_expert(L, 2));
  uint8_t *qd = calloc((size_t)H * I, 1);
  qd[5 * I + 7] = 0xff; /* down [H, I]: [5, 7] */
  MT_EQ_INT(kn_layer_load_expert_fp8(L, 3, q, gs, q, gs, qd, ds, &e), MR_EINVAL);
  free(qd);
  MT_CONTAINS(e.msg, "expert 3 down[5, 7] = nan");
  MT_FALSE(kn_layer_has_expert(L, 3));
  MT_EQ_INT(kn_layer_load_expert_fp8(L, 3, q, gs, NULL, gs, q, ds, &e), MR_EINVAL);
  /* converted to another format (int8 here), a code whose product with a huge block scale
   * overflows fp32 is refused as a non-finite weight, named */
  {
    kn_layer *L8 = NULL;
    kn_layer_desc d8 = {.hidden = H, .inter = I, .num_experts = 1, .format = KN_FMT_INT8};
    MT_OK(kn_layer_new(&L8, eng, &d8, &e), ep(&e));
    uint8_t *qu = calloc((size_t)H * I, 1);
    qu[9 * H + 129] = 0x7e; /* up [I, H]: [9, 129], block column 1 */
    float big[2] = {1, 1e37f};
    MT_EQ_INT(kn_layer_load_expert_fp8(L8, 0, q, gs, qu, big, q, ds, &e), MR_EINVAL);
    MT_CONTAINS(e.msg, "expert 0 up[9, 129] = inf");
    MT_OK(kn_layer_load_expert_fp8(L8, 0, q, gs, q, big, q, ds, &e), ep(&e)); /* zeros: finite */
    free(qu);
    kn_layer_free(L8);
  }
  float *w = calloc((size_t)H * I, 4);
  w[H * 3 + 1] = INFINITY; /* gate [I, H]: [3, 1] */
  MT_EQ_INT(kn_layer_load_expert(L, 1, w, w, w, MR_DTYPE_F32, &e), MR_EINVAL);
  MT_CONTAINS(e.msg, "expert 1 gate");
  MT_CONTAINS(e.msg, "w[3, 1] = inf");
  /* dense layers take the format too, and refuse the same bad input
   * (test_kn_linear has their own tests) */
  kn_linear *lin = NULL;
  MT_OK(kn_linear_new(&lin, eng, 64, 64, KN_FMT_FP8, 0, &e), ep(&e));
  MT_EQ_INT(kn_linear_load_rows(lin, 0, 64, w, MR_DTYPE_F32, &e), MR_EINVAL);
  MT_CONTAINS(e.msg, "w[6, 7] = inf"); /* element 3 * 130 + 1 of a 64 x 64 matrix */
  kn_linear_free(lin);
  free(w);
  free(q);
  kn_layer_free(L);
  kn_engine_free(eng);
}

MT_MAIN()
