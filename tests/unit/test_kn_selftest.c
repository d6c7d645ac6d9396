/*
 * test_kn_selftest.c - the start-up self-test of the fast kernels (kernels/selftest.c,
 * internal.h section F): a fast path can never kill the process.
 *
 *   - kn__guard_run: a function that returns, executes ud2 (SIGILL), writes through NULL
 *     (SIGSEGV), divides by zero (SIGFPE), aborts, exits non-zero or spins forever ends
 *     as OK / SIGNAL(sig) / EXIT(code) / TIMEOUT, and the caller goes on;
 *   - kn__selftest_table on a table holding deliberately broken kernels, built only into
 *     this test (ud2, a NULL write, a division by zero, an endless loop, wrong numbers,
 *     NaN), next to an honest one: each broken entry is cleared and named in one WARN
 *     (kernel, ISA, what happened, CPU model, who serves instead), the honest one stays;
 *   - an engine whose candidate table (kn__register_hook) holds a faulting kernel at the
 *     CPU's best ISA keeps working: the WARN is logged, the next best kernel serves that
 *     format, and kn_moe_forward matches kn_ref under that kernel's tolerance;
 *   - the time the self-test adds to start-up, measured and printed (not asserted: speed
 *     is measured in benchmarks, docs/BENCHMARKS.md).
 * None of this needs AMX: the broken kernels are plain C, so it runs on every machine.
 */
#define _GNU_SOURCE
#include "kernels/internal.h"
#include "tests/unit/kn_test.h"
#include "tests/unit/mt.h"

#include <fcntl.h>
#include <signal.h>
#include <time.h>

/* ---- stderr capture (the WARN lines) ------------------------------------------------ */

static int cap_fd = -1, cap_saved = -1;
static char cap_path[64];
static void cap_begin(void) {
  snprintf(cap_path, sizeof cap_path, "/tmp/kn_selftest_%d.log", (int)getpid());
  fflush(stderr);
  cap_fd = open(cap_path, O_RDWR | O_CREAT | O_TRUNC, 0600);
  MT_TRUE(cap_fd >= 0);
  cap_saved = dup(2);
  dup2(cap_fd, 2);
}
/* Ends the capture; returns what was logged (malloc'ed), echoed to the real stderr. */
static char *cap_end(void) {
  fflush(stderr);
  dup2(cap_saved, 2);
  close(cap_saved);
  off_t n = lseek(cap_fd, 0, SEEK_END);
  char *buf = calloc(1, (size_t)n + 1);
  MT_TRUE(buf != NULL);
  MT_EQ_INT(pread(cap_fd, buf, (size_t)n, 0), n);
  close(cap_fd);
  unlink(cap_path);
  fputs(buf, stderr);
  return buf;
}
static int count_lines_with(const char *log, const char *needle) {
  int n = 0;
  for (const char *p = log; (p = strstr(p, needle)) != NULL; p++) n++;
  return n;
}

/* ---- kernels that must never reach an engine ---------------------------------------- */

/* The faults are the point: UBSan (make SANITIZER=address) must not stop them first. */
#define DELIBERATE_UB __attribute__((no_sanitize("undefined"), noinline))

static void ud2_gate_up(const kn__task *t, uint32_t i0, uint32_t i1) {
  (void)t, (void)i0, (void)i1;
  __builtin_trap(); /* ud2 on x86: SIGILL, as an instruction the CPU lacks */
}
DELIBERATE_UB static void segv_gate_up(const kn__task *t, uint32_t i0, uint32_t i1) {
  (void)i0, (void)i1;
  volatile float *volatile p = NULL;
  *p = t->x[0]; /* SIGSEGV */
}
/* Both volatile: GCC turns 1 / x into a compare (it is 0 unless x is +-1), and must not
 * fold any of it; x86's idiv by zero raises #DE, i.e. SIGFPE. */
static volatile int zero_divisor = 0, dividend = 7;
DELIBERATE_UB static void fpe_down(const kn__task *t, uint32_t j0, uint32_t j1) {
  for (uint32_t j = j0; j < j1; j++) t->y[j] = (float)(dividend / zero_divisor);
}
static void hang_gate_up(const kn__task *t, uint32_t i0, uint32_t i1) {
  (void)t, (void)i0, (void)i1;
  for (volatile int spin = 1; spin;) {
  }
}
static void zero_gate_up(const kn__task *t, uint32_t i0, uint32_t i1) {
  for (uint32_t r = 0; r < t->n; r++)
    for (uint32_t i = i0; i < i1; i++) t->h[(size_t)r * t->L->slice_len[t->slice] + i] = 0.0f;
}
static void nan_down(const kn__task *t, uint32_t j0, uint32_t j1) {
  for (uint32_t r = 0; r < t->n; r++)
    for (uint32_t j = j0; j < j1; j++) t->y[(size_t)r * t->L->d.hidden + j] = NAN;
}

/* A broken entry: REF's functions but for the one replaced. */
static kn__kernel broken(const kn__kernel *ref, const char *name, void (*gu)(const kn__task *, uint32_t, uint32_t),
                         void (*dn)(const kn__task *, uint32_t, uint32_t)) {
  kn__kernel k = *ref;
  k.name = name;
  if (gu) k.gate_up = gu;
  if (dn) k.down = dn;
  return k;
}

/* ---- the guard ------------------------------------------------------------------------ */

static void fn_ok(void *arg) { *(volatile int *)arg = 1; }
static void fn_ud2(void *arg) { (void)arg, __builtin_trap(); }
DELIBERATE_UB static void fn_segv(void *arg) {
  (void)arg;
  volatile int *volatile p = NULL;
  *p = 1;
}
DELIBERATE_UB static void fn_fpe(void *arg) { *(volatile int *)arg = dividend / zero_divisor; }
static void fn_abort(void *arg) { (void)arg, abort(); }
static void fn_exit3(void *arg) { (void)arg, _exit(3); }
static void fn_hang(void *arg) {
  (void)arg;
  for (volatile int spin = 1; spin;) {
  }
}

MT_TEST(guard_contains_faults_hangs_and_exits) {
  int x = 0;
  kn__guard_result r;
  kn__guard_run(fn_ok, &x, 2000, &r);
  MT_EQ_INT(r.end, KN__GUARD_OK);
  MT_EQ_INT(x, 0); /* the child's write stays in the child */
  printf("  ok: %.2f ms for fork, run and reap\n", r.ms);
  const struct {
    void (*fn)(void *);
    int sig;
    const char *what;
  } faults[] = {{fn_ud2, SIGILL, "ud2"}, {fn_segv, SIGSEGV, "NULL write"}, {fn_fpe, SIGFPE, "1 / 0"},
                {fn_abort, SIGABRT, "abort"}};
  for (size_t i = 0; i < sizeof faults / sizeof faults[0]; i++) {
    kn__guard_run(faults[i].fn, &x, 2000, &r);
    MT_EQ_INT(r.end, KN__GUARD_SIGNAL);
    MT_EQ_INT(r.sig, faults[i].sig);
    printf("  %-10s -> signal %d (%s) in %.2f ms\n", faults[i].what, r.sig, strsignal(r.sig), r.ms);
  }
  kn__guard_run(fn_exit3, &x, 2000, &r);
  MT_EQ_INT(r.end, KN__GUARD_EXIT);
  MT_EQ_INT(r.code, 3);
  kn__guard_run(fn_hang, &x, 150, &r);
  MT_EQ_INT(r.end, KN__GUARD_TIMEOUT);
  MT_TRUE(r.ms >= 150.0 && r.ms < 5000.0);
  printf("  endless loop -> killed at the deadline after %.0f ms\n", r.ms);
  /* a host's own SIGSEGV handler does not catch the child's fault (the child resets it) */
  struct sigaction sa, old;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = SIG_IGN; /* would loop forever on the faulting store if inherited */
  sigaction(SIGFPE, &sa, &old);
  kn__guard_run(fn_fpe, &x, 2000, &r);
  sigaction(SIGFPE, &old, NULL);
  MT_EQ_INT(r.end, KN__GUARD_SIGNAL);
  MT_EQ_INT(r.sig, SIGFPE);
}

/* ---- the table ------------------------------------------------------------------------ */

MT_TEST(broken_kernels_are_refused_with_one_warn_each) {
  kn__kernel_table t;
  memset(&t, 0, sizeof t);
  kn__ref_register(&t);
  /* column AVX2 of this table holds the candidates whatever the CPU: the self-test runs
   * what is in a table, and these are plain C */
  const kn_isa col = KN_ISA_AVX2;
  t.k[KN_FMT_BF16][col] = broken(&t.k[KN_FMT_BF16][KN_ISA_REF], "test_ud2_bf16", ud2_gate_up, NULL);
  t.k[KN_FMT_F32][col] = broken(&t.k[KN_FMT_F32][KN_ISA_REF], "test_segv_f32", segv_gate_up, NULL);
  t.k[KN_FMT_F16][col] = broken(&t.k[KN_FMT_F16][KN_ISA_REF], "test_fpe_f16", NULL, fpe_down);
  t.k[KN_FMT_INT8][col] = broken(&t.k[KN_FMT_INT8][KN_ISA_REF], "test_hang_int8", hang_gate_up, NULL);
  t.k[KN_FMT_INT4][col] = broken(&t.k[KN_FMT_INT4][KN_ISA_REF], "test_zero_int4", zero_gate_up, NULL);
  /* fp8: one honest entry (the REF functions under another name) beside a NaN one */
  t.k[KN_FMT_FP8][col] = broken(&t.k[KN_FMT_FP8][KN_ISA_REF], "test_honest_fp8", NULL, NULL);
  t.k[KN_FMT_FP8][KN_ISA_AVX512] = broken(&t.k[KN_FMT_FP8][KN_ISA_REF], "test_nan_fp8", NULL, nan_down);
  setenv("MOERPC_SELFTEST_TIMEOUT_MS", "300", 1);
  kn__selftest_report rep;
  cap_begin();
  int refused = kn__selftest_table(&t, KN_ISA_AVX512, 1.0, &rep);
  char *log = cap_end();
  printf("  %u tested, %d refused, %u child processes, %.0f ms\n", rep.tested, refused, rep.children, rep.ms);
  MT_EQ_INT(rep.tested, 7);
  MT_EQ_INT(refused, 6);
  MT_EQ_INT(rep.refused, 6);
  const struct {
    kn_format f;
    kn_isa isa;
    const char *why;
  } want[] = {{KN_FMT_BF16, col, "killed by SIGILL"},     {KN_FMT_F32, col, "killed by SIGSEGV"},
              {KN_FMT_F16, col, "killed by SIGFPE"},      {KN_FMT_INT8, col, "no result within 300 ms"},
              {KN_FMT_INT4, col, "rel L2 against the reference"}, {KN_FMT_FP8, KN_ISA_AVX512, "non-finite output"}};
  const char *model = kn__cpu_get()->model;
  for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
    const kn__selftest_entry *en = &rep.e[want[i].f][want[i].isa];
    MT_TRUE(en->tested && !en->passed);
    MT_CONTAINS(en->why, want[i].why);
    MT_TRUE(t.k[want[i].f][want[i].isa].gate_up == NULL); /* cleared */
    /* one WARN naming the kernel, its ISA, what happened and the CPU model */
    char needle[160];
    snprintf(needle, sizeof needle, "the %s kernel of %s (%s) failed its start-up self-test on \"%s\": %s",
             kn_isa_name(want[i].isa), kn_format_name(want[i].f), en->name, model, want[i].why);
    if (count_lines_with(log, needle) != 1) printf("  expected one WARN with: %s\n", needle);
    MT_EQ_INT(count_lines_with(log, needle), 1);
  }
  /* who serves: the honest fp8 entry below the NaN one, REF for the others */
  MT_CONTAINS(log, "not used, test_honest_fp8 serves fp8-b128");
  MT_CONTAINS(log, "not used, ref_bf16_f32 serves bf16");
  MT_EQ_INT(count_lines_with(log, "WARN"), 6);
  MT_TRUE(rep.e[KN_FMT_FP8][col].passed);
  MT_EQ_STR(t.k[KN_FMT_FP8][col].name, "test_honest_fp8");
  MT_TRUE(rep.e[KN_FMT_FP8][col].worst == 0.0); /* the REF functions: the reference's bits */
  /* the REF column is never touched */
  for (int f = 0; f < KN_FMT_COUNT; f++) MT_TRUE(t.k[f][KN_ISA_REF].gate_up != NULL);
  free(log);
}

/* ---- an engine with a faulting kernel among its candidates ---------------------------- */

static kn_isa hook_col;
static void inject_ud2(kn__kernel_table *t) {
  kn__kernel ref;
  memset(&ref, 0, sizeof ref);
  kn__kernel_table r;
  memset(&r, 0, sizeof r);
  kn__ref_register(&r);
  t->k[KN_FMT_BF16][hook_col] = broken(&r.k[KN_FMT_BF16][KN_ISA_REF], "test_ud2_bf16", ud2_gate_up, NULL);
}

MT_TEST(engine_keeps_working_when_its_best_kernel_faults) {
  hook_col = kn_isa_detect();
  if (hook_col == KN_ISA_REF) MT_SKIP("the CPU has no fast ISA (%s): an engine never runs a self-test", kn__cpu_get()->model);
  kn__register_hook = inject_ud2;
  unsetenv("MOERPC_ISA");
  cap_begin();
  kn_engine *eng = NULL;
  mr_err e = {0};
  kn_engine_opts o = {.isa = KN_ISA_COUNT, .threads = 2};
  int rc = kn_engine_new(&eng, &o, &e);
  char *log = cap_end();
  MT_OK(rc, ep(&e));
  char needle[160];
  snprintf(needle, sizeof needle, "the %s kernel of bf16 (test_ud2_bf16) failed its start-up self-test on \"%s\": killed by SIGILL",
           kn_isa_name(hook_col), kn__cpu_get()->model);
  MT_EQ_INT(count_lines_with(log, needle), 1);
  /* bf16 runs on the next best kernel, the other formats on theirs */
  const kn__kernel *k = eng->kern[KN_FMT_BF16];
  MT_TRUE(strcmp(k->name, "test_ud2_bf16") != 0);
  MT_TRUE(kn_engine_isa(eng, KN_FMT_BF16) < hook_col);
  printf("  bf16 now on %s (isa %s); the engine's ISA is %s\n", k->name,
         kn_isa_name(kn_engine_isa(eng, KN_FMT_BF16)), kn_isa_name(hook_col));
  /* and computes: a bf16 layer against the reference, under the serving kernel's tolerance */
  enum { H = 96, I = 64, E = 3, T = 9, K = 2 };
  kn_layer *L = NULL;
  kn_layer_desc d = {.hidden = H, .inter = I, .num_experts = E, .format = KN_FMT_BF16};
  MT_OK(kn_layer_new(&L, eng, &d, &e), ep(&e));
  rng_seed(7);
  float *g = malloc((size_t)H * I * 4), *u = malloc((size_t)H * I * 4), *dn = malloc((size_t)H * I * 4);
  for (uint32_t x = 0; x < E; x++) {
    for (size_t i = 0; i < (size_t)H * I; i++) {
      g[i] = 0.05f * rng_normal();
      u[i] = 0.05f * rng_normal();
      dn[i] = 0.05f * rng_normal();
    }
    MT_OK(kn_layer_load_expert(L, x, g, u, dn, MR_DTYPE_F32, &e), ep(&e));
  }
  int32_t ids[T * K];
  float w[T * K], *xin = malloc((size_t)T * H * 4), *out = malloc((size_t)T * H * 4), *ref = malloc((size_t)T * H * 4);
  for (uint32_t p = 0; p < T * K; p++) {
    ids[p] = (int32_t)(rng_u32() % E);
    w[p] = 0.5f;
  }
  for (size_t i = 0; i < (size_t)T * H; i++) xin[i] = rng_normal();
  kn_moe_args a = {.n_tokens = T, .top_k = K, .ids = ids, .weights = w, .x = xin, .x_dtype = MR_DTYPE_F32, .out = ref};
  MT_OK(kn_ref_moe_forward(L, &a, &e), ep(&e));
  a.out = out;
  MT_OK(kn_moe_forward(eng, L, &a, NULL, &e), ep(&e));
  double err = kn_rel_l2(out, ref, (size_t)T * H);
  printf("  bf16 layer on %s: rel L2 %.3g vs kn_ref (tol %.0e)\n", k->name, err, kn__rounding_tol(k->rounding));
  MT_LE(err, kn__rounding_tol(k->rounding));
  kn_layer_free(L);
  kn_engine_free(eng);
  free(g), free(u), free(dn), free(xin), free(out), free(ref), free(log);
}

/* ---- what it costs at start-up ------------------------------------------------------- */

MT_TEST(startup_cost_of_the_selftest) {
  const kn__selftest_report *rep = NULL;
  double t0 = 0;
  struct timespec a, b;
  clock_gettime(CLOCK_MONOTONIC, &a);
  const kn__kernel_table *t = kn__verified_table(&rep);
  clock_gettime(CLOCK_MONOTONIC, &b);
  t0 = (double)(b.tv_sec - a.tv_sec) * 1e3 + (double)(b.tv_nsec - a.tv_nsec) / 1e6;
  MT_TRUE(t != NULL && rep != NULL);
  printf("  cpu %s (best ISA %s): %u fast kernels self-tested in %.1f ms (%u child), %u refused; "
         "first kn__verified_table call %.1f ms\n",
         kn__cpu_get()->model, kn_isa_name(kn_isa_detect()), rep->tested, rep->ms, rep->children, rep->refused, t0);
  if (kn_isa_detect() > KN_ISA_REF && (MR_HAVE_AVX2 || MR_HAVE_AVX512)) MT_TRUE(rep->tested > 0);
  MT_EQ_INT(rep->refused, 0); /* this project's own kernels pass on every CPU it runs on */
  /* the second call costs nothing: once per process */
  clock_gettime(CLOCK_MONOTONIC, &a);
  (void)kn__verified_table(NULL);
  clock_gettime(CLOCK_MONOTONIC, &b);
  MT_TRUE((double)(b.tv_sec - a.tv_sec) * 1e3 + (double)(b.tv_nsec - a.tv_nsec) / 1e6 < 5.0);
}

/* MOERPC_SELFTEST is validated: a typo is refused by name rather than silently ignored. */
MT_TEST(selftest_env_is_validated) {
  setenv("MOERPC_SELFTEST", "maybe", 1);
  kn_engine *eng = NULL;
  mr_err e = {0};
  kn_engine_opts o = {.isa = KN_ISA_COUNT, .threads = 1};
  MT_EQ_INT(kn_engine_new(&eng, &o, &e), MR_EINVAL);
  MT_CONTAINS(e.msg, "MOERPC_SELFTEST = \"maybe\": must be on (the default) or off");
  unsetenv("MOERPC_SELFTEST");
}

MT_MAIN()
