/*
 * selftest.c - the start-up self-test of the fast kernels (internal.h section F): every
 * candidate entry of a kernel table runs once, in a child process, on small problems whose
 * answers the REF kernels computed in the parent; an entry that kills the child (SIGILL,
 * SIGSEGV, SIGBUS, SIGFPE, ...), hangs past the deadline, or misses its tolerance is
 * cleared from the table and named in one WARN, and the next best entry serves its format.
 *
 * Why a child process: a fast path that has never run on this CPU model can fault at its
 * first instruction (the AMX kernels did, on every binary, on Emerald Rapids), and a
 * signal handler in the process cannot contain a hang, a wild write, or a fault on a
 * worker thread. A fork is cheap (page tables; ~1 ms here) and the kernels need nothing
 * but memory, so the child runs exactly the machine code the engine would, on inputs the
 * parent prepared, and reports through one MAP_SHARED page.
 *
 * The child is a fork of a process that may have other threads (gRPC, the CUDA runtime,
 * Python): it owns no lock another thread might have held, so it allocates nothing, logs
 * nothing and calls no library function that could lock. Everything it touches (the
 * problems, its scratch, the table) was allocated before the fork; it writes only its
 * private copies and the shared results. It is started with _Fork where glibc has it (no
 * pthread_atfork handlers run: a library's fork hooks must not run for this child).
 *
 * Problems: H = 160, I = 56 (partial 16-row blocks, K tails for every K step, int4 groups
 * that do not divide K), random weights ~ U(-0.05, 0.05) packed by the one packer of
 * section A (fp8: a code and a scale per (row, 128-column block)), x ~ U(-1, 1); n = 1
 * token (the decode paths) and n = 21 (the prefill paths, two AMX token blocks, one
 * partial). Each case checks gate_up's h against REF's, and down, fed REF's h, against
 * REF's y, both by rel L2 under kn__rounding_tol of the kernel, and that every output is
 * finite. AMX kernels also run with their tile configuration audit on.
 */
#define _GNU_SOURCE /* _Fork, prctl */
#include "kernels/internal.h"

#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

bool kn__guard_keep_handlers;

/* ---- running a function in a child ------------------------------------------------ */

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static pid_t fork_bare(void) {
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 34))
  return _Fork();
#else
  return fork();
#endif
}

/* The child's side: only async-signal-safe calls before fn. */
static void guard_child(void (*fn)(void *), void *arg, pid_t parent) {
  /* Die with the parent (a killed server must not leave a self-test behind). */
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != parent) _exit(126);
  /* A fault must end this child with its signal: no core file, and not the parent's
   * handler (a server's or a sanitizer's SIGSEGV handler would report, or even recover). */
  struct rlimit no_core = {0, 0};
  setrlimit(RLIMIT_CORE, &no_core);
  static const int faults[] = {SIGILL, SIGSEGV, SIGBUS, SIGFPE, SIGTRAP, SIGABRT, SIGSYS};
  sigset_t unblock;
  sigemptyset(&unblock);
  for (size_t i = 0; i < sizeof faults / sizeof faults[0]; i++) {
    if (!kn__guard_keep_handlers) {
      struct sigaction sa;
      memset(&sa, 0, sizeof sa);
      sa.sa_handler = SIG_DFL;
      sigaction(faults[i], &sa, NULL);
    }
    sigaddset(&unblock, faults[i]);
  }
  sigprocmask(SIG_UNBLOCK, &unblock, NULL);
  fn(arg);
  _exit(0);
}

void kn__guard_run(void (*fn)(void *), void *arg, uint32_t timeout_ms, kn__guard_result *r) {
  memset(r, 0, sizeof *r);
  const double t0 = now_ms();
  const pid_t parent = getpid();
  pid_t pid = fork_bare();
  if (pid < 0) {
    r->end = KN__GUARD_NOCHILD;
    r->code = errno;
    return;
  }
  if (pid == 0) guard_child(fn, arg, parent);

  /* Poll with a growing sleep: the usual self-test ends within a few ms, and a pidfd
   * would need Linux 5.3 and a poll loop all the same. */
  long sleep_ns = 20000;
  for (;;) {
    int st = 0;
    pid_t w = waitpid(pid, &st, WNOHANG);
    if (w == pid) {
      if (WIFSIGNALED(st)) {
        r->end = KN__GUARD_SIGNAL;
        r->sig = WTERMSIG(st);
      } else if (WIFEXITED(st) && WEXITSTATUS(st) != 0) {
        r->end = KN__GUARD_EXIT;
        r->code = WEXITSTATUS(st);
      } else {
        r->end = KN__GUARD_OK;
      }
      break;
    }
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) { /* ECHILD: SIGCHLD is ignored, the kernel reaped it; the caller decides */
      r->end = KN__GUARD_LOST;
      break;
    }
    if (now_ms() - t0 > (double)timeout_ms) {
      kill(pid, SIGKILL);
      while (waitpid(pid, &st, 0) < 0 && errno == EINTR) {
      }
      r->end = KN__GUARD_TIMEOUT;
      break;
    }
    struct timespec ts = {0, sleep_ns};
    nanosleep(&ts, NULL);
    if (sleep_ns < 2000000) sleep_ns *= 2;
  }
  r->ms = now_ms() - t0;
}

/* ---- the problems ----------------------------------------------------------------- */

#define ST_H 160u
#define ST_I 56u
#define ST_NMAX 21u
static const uint32_t st_ns[2] = {1, ST_NMAX};
/* Scratch caps of one case (the child refuses a kernel that asks for more). */
#define ST_TMP_BYTES (1u << 20)
#define ST_XQ_BYTES (256u << 10)
/* Default deadline of one child (MOERPC_SELFTEST_TIMEOUT_MS overrides): generous for a
 * loaded host or a sanitizer build; only a hanging kernel ever waits for it. */
#define ST_TIMEOUT_MS 5000u

typedef struct st_prob {
  kn_layer L;
  kn__slice_w w;
  float *x;        /* [ST_NMAX, H] */
  float *h_ref[2]; /* [n, I] of REF for st_ns[i] */
  float *y_ref[2]; /* [n, H] of REF from h_ref */
} st_prob;

typedef struct st_case {
  uint8_t f, isa, prob, ni;
} st_case;

enum { ST_NOT_RUN = 0, ST_DONE, ST_SCRATCH };
typedef struct st_res {
  int state;
  int finite;
  double eh, ey;
  uint64_t audit_bad;
  char audit[160];
} st_res;

/* The page the child reports through (MAP_SHARED). */
typedef struct st_shared {
  volatile uint32_t cur;      /* the case the child is running */
  volatile int finished;      /* it ran every case */
  volatile uint8_t refused[KN_FMT_COUNT][KN_ISA_COUNT]; /* skip these (the parent's verdict) */
  st_res res[];
} st_shared;

typedef struct st_run {
  const kn__kernel_table *t;
  st_prob *prob;
  st_case *cases;
  uint32_t n_cases, first;
  st_shared *sh;
  float *h, *y, *tmp; /* the child's scratch (its copy-on-write pages) */
  void *xq;
} st_run;

static float st_uniform(uint64_t *s) {
  *s ^= *s << 13;
  *s ^= *s >> 7;
  *s ^= *s << 17;
  return (float)(((*s >> 11) & 0xffffff) / 8388608.0 - 1.0);
}

/* The groups a format is tested at (int4: every group size a layer may have). */
static int st_groups(kn_format f, uint32_t *g) {
  if (f == KN_FMT_INT4) {
    g[0] = 32;
    g[1] = 64;
    g[2] = 128;
    return 3;
  }
  g[0] = f == KN_FMT_FP8 ? KN_FP8_BLOCK : 0; /* what kn_layer_new gives each format */
  return 1;
}

/* One packed matrix [rows][K] of format f from random fp32 rows. */
static void st_pack(kn_format f, uint32_t G, uint32_t rows, uint32_t K, uint64_t *seed, float *row, uint8_t *dst,
                    float *scales) {
  const size_t rb = kn__row_bytes(f, K, G), ns = kn__row_scales(f, K, G);
  for (uint32_t r = 0; r < rows; r++) {
    for (uint32_t k = 0; k < K; k++) row[k] = 0.05f * st_uniform(seed);
    uint8_t *d = dst + r * rb;
    float *sc = scales ? scales + r * ns : NULL;
    if (f != KN_FMT_FP8) {
      kn__pack_row(f, G, row, K, kn__amax(row, K) / 127.0f, d, sc);
      continue;
    }
    /* fp8-b128: one scale per (row, 128-column block), amax / 448 (legal in the layout,
     * which holds a scale per row and block), codes of w / scale */
    for (uint32_t b = 0; b < ns; b++) {
      const uint32_t k0 = b * KN_FP8_BLOCK, k1 = k0 + KN_FP8_BLOCK < K ? k0 + KN_FP8_BLOCK : K;
      const float amax = kn__amax(row + k0, k1 - k0);
      sc[b] = amax > 0.0f ? amax / 448.0f : 1.0f;
      for (uint32_t k = k0; k < k1; k++) d[k] = kn_fp8_e4m3_from_f32(row[k] / sc[b]);
    }
  }
}

/* Room for an array of n bytes plus slack for kernels that read whole vectors past the
 * last scale or row (their loads are masked, but the slack costs nothing here). */
static void *st_alloc(size_t n) {
  void *p = mr_malloc_aligned(n + 256, 64);
  if (p) memset(p, 0, n + 256);
  return p;
}

static void st_prob_free(st_prob *p) {
  mr_free_aligned(p->w.gate);
  mr_free_aligned(p->w.up);
  mr_free_aligned(p->w.down);
  mr_free_aligned(p->w.gate_scale);
  mr_free_aligned(p->w.up_scale);
  mr_free_aligned(p->w.down_scale);
  mr_free_aligned(p->x);
  for (int i = 0; i < 2; i++) {
    mr_free_aligned(p->h_ref[i]);
    mr_free_aligned(p->y_ref[i]);
  }
}

/* Builds problem p of format f, group G, and REF's answers with ref (the REF entry). */
static int st_prob_make(st_prob *p, kn_format f, uint32_t G, const kn__kernel *ref, float *tmp, size_t tmp_cap) {
  memset(p, 0, sizeof *p);
  const uint32_t H = ST_H, I = ST_I;
  p->L.d = (kn_layer_desc){.hidden = H, .inter = I, .num_experts = 1, .format = f, .group = G};
  p->L.n_slices = 1;
  p->L.slice_len[0] = I;
  p->L.max_slice_len = I;
  const size_t rbg = kn__row_bytes(f, H, G), rbd = kn__row_bytes(f, I, G);
  const size_t nsg = kn__row_scales(f, H, G), nsd = kn__row_scales(f, I, G);
  p->w.gate = st_alloc(I * rbg);
  p->w.up = st_alloc(I * rbg);
  p->w.down = st_alloc(H * rbd);
  if (nsg) {
    p->w.gate_scale = st_alloc(I * nsg * sizeof(float));
    p->w.up_scale = st_alloc(I * nsg * sizeof(float));
    p->w.down_scale = st_alloc(H * nsd * sizeof(float));
  }
  p->x = st_alloc((size_t)ST_NMAX * H * sizeof(float));
  for (int i = 0; i < 2; i++) {
    p->h_ref[i] = st_alloc((size_t)st_ns[i] * I * sizeof(float));
    p->y_ref[i] = st_alloc((size_t)st_ns[i] * H * sizeof(float));
  }
  float row[ST_H > ST_I ? ST_H : ST_I];
  if (!p->w.gate || !p->w.up || !p->w.down || (nsg && (!p->w.gate_scale || !p->w.up_scale || !p->w.down_scale)) ||
      !p->x || !p->h_ref[0] || !p->h_ref[1] || !p->y_ref[0] || !p->y_ref[1])
    return MR_ENOMEM;
  uint64_t seed = 0x9E3779B97F4A7C15ull ^ ((uint64_t)f * 131u + G);
  st_pack(f, G, I, H, &seed, row, p->w.gate, p->w.gate_scale);
  st_pack(f, G, I, H, &seed, row, p->w.up, p->w.up_scale);
  st_pack(f, G, H, I, &seed, row, p->w.down, p->w.down_scale);
  for (size_t i = 0; i < (size_t)ST_NMAX * H; i++) p->x[i] = st_uniform(&seed);
  for (int i = 0; i < 2; i++) {
    if (ref->tmp_floats(&p->L, 0, st_ns[i]) * sizeof(float) > tmp_cap) return MR_ENOMEM;
    kn__task t = {.L = &p->L, .slice = 0, .w = &p->w, .n = st_ns[i], .x = p->x, .h = p->h_ref[i],
                  .y = p->y_ref[i], .tmp = tmp};
    ref->gate_up(&t, 0, I);
    ref->down(&t, 0, H);
  }
  return 0;
}

/* ---- the child ------------------------------------------------------------------- */

static bool all_finite(const float *v, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (!isfinite(v[i])) return false;
  return true;
}

static void st_case_run(const st_run *r, const st_case *c, st_res *res) {
  const kn__kernel *k = &r->t->k[c->f][c->isa];
  const st_prob *p = &r->prob[c->prob];
  const uint32_t n = st_ns[c->ni], H = ST_H, I = ST_I;
  if (k->tmp_floats(&p->L, 0, n) * sizeof(float) > ST_TMP_BYTES ||
      (k->prep && k->prep_bytes(&p->L, n) > ST_XQ_BYTES)) {
    res->state = ST_SCRATCH;
    return;
  }
  if (k->audit_on) {
    k->audit_on(true);
    k->audit_take(NULL, 0);
  }
  if (k->prep) k->prep(&p->L, n, p->x, r->xq);
  kn__task t = {.L = &p->L, .slice = 0, .w = &p->w, .n = n, .x = p->x, .xq = k->prep ? r->xq : NULL, .h = r->h,
                .tmp = r->tmp};
  k->gate_up(&t, 0, I);
  t.h = p->h_ref[c->ni]; /* down on REF's h: each step is judged on its own */
  t.y = r->y;
  k->down(&t, 0, H);
  if (k->audit_on) {
    res->audit_bad = k->audit_take(res->audit, sizeof res->audit);
    k->audit_on(false);
  }
  res->finite = all_finite(r->h, (size_t)n * I) && all_finite(r->y, (size_t)n * H);
  res->eh = kn_rel_l2(r->h, p->h_ref[c->ni], (size_t)n * I);
  res->ey = kn_rel_l2(r->y, p->y_ref[c->ni], (size_t)n * H);
  res->state = ST_DONE;
}

static void st_child(void *arg) {
  const st_run *r = arg;
  for (uint32_t i = r->first; i < r->n_cases; i++) {
    const st_case *c = &r->cases[i];
    if (r->sh->refused[c->f][c->isa]) continue;
    r->sh->cur = i;
    st_case_run(r, c, &r->sh->res[i]);
  }
  r->sh->finished = 1;
}

/* ---- the parent's verdicts -------------------------------------------------------- */

static const char *sig_text(int sig) {
  switch (sig) {
    case SIGILL: return "SIGILL (illegal instruction)";
    case SIGSEGV: return "SIGSEGV (invalid memory access)";
    case SIGBUS: return "SIGBUS (bus error)";
    case SIGFPE: return "SIGFPE (arithmetic exception)";
    case SIGTRAP: return "SIGTRAP";
    case SIGABRT: return "SIGABRT (abort)";
    case SIGKILL: return "SIGKILL";
    default: return "a signal";
  }
}

static void refuse(kn__selftest_report *rep, const st_case *c, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void refuse(kn__selftest_report *rep, const st_case *c, const char *fmt, ...) {
  kn__selftest_entry *en = &rep->e[c->f][c->isa];
  if (!en->passed && en->why[0]) return; /* the first reason stands */
  en->passed = false;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(en->why, sizeof en->why, fmt, ap);
  va_end(ap);
}

static uint32_t st_timeout_ms(void) {
  const char *env = getenv("MOERPC_SELFTEST_TIMEOUT_MS");
  if (env && *env) {
    char *end;
    unsigned long v = strtoul(env, &end, 10);
    if (*end == '\0' && v >= 1 && v <= 600000) return (uint32_t)v;
  }
  return ST_TIMEOUT_MS;
}

/* The entry that serves format f once the refusals are cleared: the best at or below top. */
static const kn__kernel *best_left(const kn__kernel_table *t, int f, kn_isa top) {
  for (int i = top; i >= KN_ISA_REF; i--)
    if (t->k[f][i].gate_up) return &t->k[f][i];
  return NULL;
}

int kn__selftest_table(kn__kernel_table *t, kn_isa top, double tol_scale, kn__selftest_report *rep_out) {
  kn__selftest_report rep_local, *rep = rep_out ? rep_out : &rep_local;
  memset(rep, 0, sizeof *rep);
  const double t0 = now_ms();
  const kn__cpu *cpu = kn__cpu_get();
  if ((unsigned)top >= KN_ISA_COUNT) top = (kn_isa)(KN_ISA_COUNT - 1);

  /* The cases, entry by entry (so that a fault skips the rest of its entry), and which
   * problems they need. */
  st_prob prob[KN_FMT_COUNT * 3];
  int prob_of[KN_FMT_COUNT][3];
  uint32_t n_prob = 0, n_cases = 0;
  st_case cases[KN_FMT_COUNT * KN_ISA_COUNT * 3 * 2];
  for (int f = 0; f < KN_FMT_COUNT; f++) {
    uint32_t groups[3];
    const int ng = st_groups((kn_format)f, groups);
    for (int g = 0; g < 3; g++) prob_of[f][g] = -1;
    for (int i = KN_ISA_REF + 1; i <= (int)top; i++) {
      if (!t->k[f][i].gate_up) continue;
      rep->e[f][i].tested = true;
      rep->e[f][i].passed = true;
      rep->e[f][i].name = t->k[f][i].name;
      rep->tested++;
      for (int g = 0; g < ng; g++) {
        if (prob_of[f][g] < 0) prob_of[f][g] = (int)n_prob++;
        for (uint8_t ni = 0; ni < 2; ni++)
          cases[n_cases++] = (st_case){(uint8_t)f, (uint8_t)i, (uint8_t)prob_of[f][g], ni};
      }
    }
  }
  if (n_cases == 0) {
    rep->ms = now_ms() - t0;
    return 0;
  }

  int rc = 0;
  uint32_t made = 0;
  st_run run = {.t = t, .prob = prob, .cases = cases, .n_cases = n_cases};
  const size_t sh_bytes = sizeof(st_shared) + n_cases * sizeof(st_res);
  st_shared *sh = mmap(NULL, sh_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  run.h = st_alloc((size_t)ST_NMAX * ST_I * sizeof(float));
  run.y = st_alloc((size_t)ST_NMAX * ST_H * sizeof(float));
  run.tmp = st_alloc(ST_TMP_BYTES);
  run.xq = st_alloc(ST_XQ_BYTES);
  if (sh == MAP_FAILED) sh = NULL;
  run.sh = sh;
  if (!sh || !run.h || !run.y || !run.tmp || !run.xq) {
    rc = MR_ENOMEM;
    goto out_free;
  }
  memset(sh, 0, sh_bytes);
  for (int f = 0; f < KN_FMT_COUNT; f++) {
    uint32_t groups[3];
    const int ng = st_groups((kn_format)f, groups);
    for (int g = 0; g < ng; g++) {
      if (prob_of[f][g] < 0) continue;
      rc = st_prob_make(&prob[prob_of[f][g]], (kn_format)f, groups[g], &t->k[f][KN_ISA_REF], run.tmp, ST_TMP_BYTES);
      made++;
      if (rc) goto out_free;
    }
  }

  /* Children until every case ran: a case that ends its child refuses its entry, and
   * the next child starts after it. */
  const uint32_t timeout_ms = st_timeout_ms();
  run.first = 0;
  while (run.first < n_cases) {
    sh->cur = UINT32_MAX;
    sh->finished = 0;
    kn__guard_result g;
    kn__guard_run(st_child, &run, timeout_ms, &g);
    rep->children++;
    if (g.end == KN__GUARD_NOCHILD) {
      for (uint32_t i = run.first; i < n_cases; i++)
        refuse(rep, &cases[i], "no child process to run it in (fork: %s); MOERPC_SELFTEST=off trusts it untested",
               strerror(g.code));
      break;
    }
    if ((g.end == KN__GUARD_OK || g.end == KN__GUARD_LOST) && sh->finished) break;
    const uint32_t at = sh->cur;
    if (at == UINT32_MAX || at < run.first || at >= n_cases) { /* died before its first case */
      for (uint32_t i = run.first; i < n_cases; i++)
        refuse(rep, &cases[i], "the self-test child ended before its first case (%s)",
               g.end == KN__GUARD_SIGNAL ? sig_text(g.sig) : "no signal");
      break;
    }
    const st_case *c = &cases[at];
    const char *fmtn = kn_format_name((kn_format)c->f);
    if (g.end == KN__GUARD_SIGNAL)
      refuse(rep, c, "killed by %s on its first run of %s, %u token%s", sig_text(g.sig), fmtn, st_ns[c->ni],
             st_ns[c->ni] == 1 ? "" : "s");
    else if (g.end == KN__GUARD_TIMEOUT)
      refuse(rep, c, "no result within %u ms (hung; killed) on %s, %u token%s", timeout_ms, fmtn, st_ns[c->ni],
             st_ns[c->ni] == 1 ? "" : "s");
    else if (g.end == KN__GUARD_EXIT)
      refuse(rep, c, "its child exited with status %d on %s, %u token%s", g.code, fmtn, st_ns[c->ni],
             st_ns[c->ni] == 1 ? "" : "s");
    else
      refuse(rep, c, "its child vanished (status unknown) on %s, %u token%s", fmtn, st_ns[c->ni],
             st_ns[c->ni] == 1 ? "" : "s");
    sh->refused[c->f][c->isa] = 1;
    run.first = at + 1;
  }

  /* Verdicts of the cases that ran. */
  for (uint32_t i = 0; i < n_cases; i++) {
    const st_case *c = &cases[i];
    const st_res *res = &sh->res[i];
    kn__selftest_entry *en = &rep->e[c->f][c->isa];
    const kn__kernel *k = &t->k[c->f][c->isa];
    const double tol = kn__rounding_tol(k->rounding) * tol_scale;
    const uint32_t n = st_ns[c->ni], G = prob[c->prob].L.d.group;
    if (res->state == ST_SCRATCH) {
      refuse(rep, c, "asks for more scratch than the self-test has (%u KiB) at %u tokens", ST_TMP_BYTES >> 10, n);
      continue;
    }
    if (res->state != ST_DONE) continue;
    if (res->eh > en->worst) en->worst = res->eh;
    if (res->ey > en->worst) en->worst = res->ey;
    if (res->audit_bad)
      refuse(rep, c, "tile configuration read back differs from what it loaded (%s; %llu load%s)", res->audit,
             (unsigned long long)res->audit_bad, res->audit_bad == 1 ? "" : "s");
    else if (!res->finite)
      refuse(rep, c, "non-finite output from finite inputs (%u token%s%s%.0u)", n, n == 1 ? "" : "s",
             G ? ", group " : "", G);
    else if (!(res->eh <= tol && res->ey <= tol))
      refuse(rep, c, "rel L2 against the reference gate_up %.3g, down %.3g > tolerance %.0e (%u token%s%s%.0u)",
             res->eh, res->ey, tol, n, n == 1 ? "" : "s", G ? ", group " : "", G);
  }

out_free:
  if (rc) { /* nothing could be tested: no candidate is trusted */
    for (uint32_t i = 0; i < n_cases; i++)
      refuse(rep, &cases[i], "the self-test could not allocate its problems (out of memory)");
  }
  for (uint32_t i = 0; i < made; i++) st_prob_free(&prob[i]);
  mr_free_aligned(run.h);
  mr_free_aligned(run.y);
  mr_free_aligned(run.tmp);
  mr_free_aligned(run.xq);
  if (sh) munmap(sh, sh_bytes);

  /* Clear the refused entries first, then name who serves in their place. */
  for (int f = 0; f < KN_FMT_COUNT; f++)
    for (int i = KN_ISA_REF + 1; i <= (int)top; i++)
      if (rep->e[f][i].tested && !rep->e[f][i].passed) {
        memset(&t->k[f][i], 0, sizeof t->k[f][i]);
        rep->refused++;
      }
  for (int f = 0; f < KN_FMT_COUNT; f++)
    for (int i = KN_ISA_REF + 1; i <= (int)top; i++) {
      const kn__selftest_entry *en = &rep->e[f][i];
      if (!en->tested || en->passed) continue;
      const kn__kernel *b = best_left(t, f, top);
      mr_log(MR_LOG_WARN, "kn: the %s kernel of %s (%s) failed its start-up self-test on \"%s\": %s; "
             "not used, %s serves %s", kn_isa_name((kn_isa)i), kn_format_name((kn_format)f),
             en->name ? en->name : "?", cpu->model, en->why, b ? b->name : "nothing",
             kn_format_name((kn_format)f));
    }
  rep->ms = now_ms() - t0;
  if (rep->refused == 0)
    mr_log(MR_LOG_DEBUG, "kn: %u fast kernel(s) passed their start-up self-test in %.1f ms (%u child process%s) on \"%s\"",
           rep->tested, rep->ms, rep->children, rep->children == 1 ? "" : "es", cpu->model);
  return rc ? rc : (int)rep->refused;
}
