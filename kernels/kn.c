/*
 * kn.c - the kernel engine: format and ISA names, ISA detection, engine and layer objects,
 * packing (conversion and quantization at load), request validation and kn_moe_forward.
 *
 * The per-slice arithmetic is not here: kn_moe_forward calls the kernel table of the engine
 * (internal.h section C), whose REF entries live in kn_ref.c and whose fast paths live in
 * kernels/x86/. Neither are the threads: the engine's topology, worker plan, pool and the
 * NUMA mapping of slices live in pool.c (internal.h section D). Here, loading and
 * kn_moe_forward cut their work into items for the pool (load_job, fwd_job).
 *
 * Threads (STYLE.md 8): the thread that calls kn_layer_load_expert or kn_moe_forward
 * prepares a job on its stack, runs it on every worker with kn__pool_run (taking part as
 * worker 0) and reads the results after it returns; during the run, workers write only
 * the rows of the items they claimed (disjoint by construction) and the job's few shared
 * words (work-list counters; load_job.bad under load_job.lock).
 */
#include "kernels/internal.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <stdatomic.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>
#define KN__X86 1
#else
#define KN__X86 0
#endif

#if MR_HAVE_NUMA
#include <numa.h>
#endif

/* ---- names ------------------------------------------------------------------------- */

static const char *const fmt_names[KN_FMT_COUNT] = {"f32", "f16", "bf16", "int8", "int4", "fp8-b128"};
static const char *const isa_names[KN_ISA_COUNT] = {"ref", "avx2", "avx512", "amx"};

const char *kn_format_name(kn_format f) {
  return (unsigned)f < KN_FMT_COUNT ? fmt_names[f] : "?";
}

int kn_format_parse(const char *s, kn_format *out) {
  if (!s) return MR_EINVAL;
  if (strcmp(s, "fp8") == 0) {
    *out = KN_FMT_FP8;
    return 0;
  }
  for (int f = 0; f < KN_FMT_COUNT; f++)
    if (strcmp(s, fmt_names[f]) == 0) {
      *out = (kn_format)f;
      return 0;
    }
  return MR_EINVAL;
}

void kn_format_wire_name(kn_format f, uint32_t group, char *buf, size_t len) {
  if (!buf || len == 0) return;
  if (f == KN_FMT_INT4)
    snprintf(buf, len, "int4-g%u", group);
  else
    snprintf(buf, len, "%s", kn_format_name(f));
}

const char *kn_isa_name(kn_isa isa) {
  return (unsigned)isa < KN_ISA_COUNT ? isa_names[isa] : "?";
}

int kn_isa_parse(const char *s, kn_isa *out) {
  if (!s) return MR_EINVAL;
  for (int i = 0; i < KN_ISA_COUNT; i++)
    if (strcmp(s, isa_names[i]) == 0) {
      *out = (kn_isa)i;
      return 0;
    }
  return MR_EINVAL;
}

/* ---- ISA detection ----------------------------------------------------------------- */

static kn__cpu cpu_info;
static pthread_once_t cpu_once = PTHREAD_ONCE_INIT;

#if KN__X86 && !defined(MR_FUZZ_NO_ISA)
/* XCR0 through XGETBV (only valid once cpuid says OSXSAVE). Written as bytes so that this
 * file needs no -mxsave. */
static uint64_t xgetbv0(void) {
  uint32_t lo, hi;
  __asm__ volatile(".byte 0x0f, 0x01, 0xd0" : "=a"(lo), "=d"(hi) : "c"(0));
  return ((uint64_t)hi << 32) | lo;
}
#define KN__ARCH_REQ_XCOMP_PERM 0x1023
#define KN__XFEATURE_XTILEDATA 18
#endif

/* The cpuid brand string (leaves 0x80000002..4), leading blanks trimmed: the name every
 * self-test WARN and benchmark line carries. */
static void cpu_model(kn__cpu *c) {
  snprintf(c->model, sizeof c->model, "unknown CPU");
#if KN__X86
  if (__get_cpuid_max(0x80000000u, NULL) < 0x80000004u) return;
  unsigned r[12];
  for (unsigned i = 0; i < 3; i++) __get_cpuid(0x80000002u + i, &r[4 * i], &r[4 * i + 1], &r[4 * i + 2], &r[4 * i + 3]);
  char brand[49];
  memcpy(brand, r, 48);
  brand[48] = '\0';
  const char *p = brand;
  while (*p == ' ') p++;
  if (*p) snprintf(c->model, sizeof c->model, "%s", p);
  for (size_t n = strlen(c->model); n > 0 && c->model[n - 1] == ' '; n--) c->model[n - 1] = '\0';
#endif
}

static void cpu_detect(void) {
  kn__cpu *c = &cpu_info;
  memset(c, 0, sizeof *c);
  c->best = KN_ISA_REF;
  cpu_model(c);
#if KN__X86 && !defined(MR_FUZZ_NO_ISA)
  unsigned a, b, cx, d;
  if (__get_cpuid(0, &a, &b, &cx, &d)) /* vendor string in ebx, edx, ecx */
    c->intel = b == 0x756e6547u && d == 0x49656e69u && cx == 0x6c65746eu;
  if (!__get_cpuid(1, &a, &b, &cx, &d)) return;
  bool osxsave = (cx >> 27) & 1;
  bool avx = (cx >> 28) & 1;
  c->fma = (cx >> 12) & 1;
  c->f16c = (cx >> 29) & 1;
  unsigned max_leaf = __get_cpuid_max(0, NULL);
  if (max_leaf >= 7) {
    __cpuid_count(7, 0, a, b, cx, d);
    c->avx2 = (b >> 5) & 1;
    c->avx512f = (b >> 16) & 1;
    c->avx512dq = (b >> 17) & 1;
    c->avx512bw = (b >> 30) & 1;
    c->avx512vl = (b >> 31) & 1;
    c->avx512_vnni = (cx >> 11) & 1;
    c->avx512_vbmi = (cx >> 1) & 1;
    c->amx_bf16 = (d >> 22) & 1;
    c->amx_tile = (d >> 24) & 1;
    c->amx_int8 = (d >> 25) & 1;
    unsigned max_sub = a;
    if (max_sub >= 1) {
      __cpuid_count(7, 1, a, b, cx, d);
      c->avx512_bf16 = (a >> 5) & 1;
    }
  }
  if (osxsave) {
    uint64_t xcr0 = xgetbv0();
    /* bit 1 SSE, 2 AVX (YMM upper halves); 5 opmask, 6 ZMM_Hi256, 7 Hi16_ZMM; 17 XTILECFG,
     * 18 XTILEDATA. */
    c->os_avx = avx && (xcr0 & 0x6) == 0x6;
    c->os_avx512 = c->os_avx && (xcr0 & 0xe0) == 0xe0;
    c->os_amx = (xcr0 & (3u << 17)) == (3u << 17);
  }
  /* Linux hands out the (8 KiB) AMX tile state only to processes that ask for it; without
   * the permission the first tile instruction faults. Ask once, for the whole process. */
  if (c->amx_tile && c->os_amx)
    c->amx_perm = syscall(SYS_arch_prctl, KN__ARCH_REQ_XCOMP_PERM, KN__XFEATURE_XTILEDATA) == 0;
  if (c->os_avx && c->avx2 && c->fma && c->f16c) c->best = KN_ISA_AVX2;
  if (c->best == KN_ISA_AVX2 && c->os_avx512 && c->avx512f && c->avx512bw && c->avx512vl &&
      c->avx512dq)
    c->best = KN_ISA_AVX512;
  if (c->best == KN_ISA_AVX512 && c->amx_tile && c->amx_bf16 && c->amx_int8 && c->amx_perm)
    c->best = KN_ISA_AMX;
#endif
}

const kn__cpu *kn__cpu_get(void) {
  pthread_once(&cpu_once, cpu_detect);
  return &cpu_info;
}

kn_isa kn_isa_detect(void) { return kn__cpu_get()->best; }

/* Why the CPU cannot run isa, for the error of a forced ISA. */
static const char *isa_missing(const kn__cpu *c, kn_isa isa) {
  if (!c->os_avx) return "no AVX, or the OS does not enable the AVX state (XCR0)";
  if (!(c->avx2 && c->fma && c->f16c)) return "it lacks AVX2, FMA or F16C";
  if (isa == KN_ISA_AVX2) return "?";
  if (!(c->avx512f && c->avx512bw && c->avx512vl && c->avx512dq))
    return "it lacks AVX-512 F/BW/VL/DQ";
  if (!c->os_avx512) return "the OS does not enable the AVX-512 state (XCR0)";
  if (isa == KN_ISA_AVX512) return "?";
  if (!(c->amx_tile && c->amx_bf16 && c->amx_int8)) return "it lacks AMX-TILE/BF16/INT8";
  if (!c->os_amx) return "the OS does not enable the AMX tile state (XCR0)";
  if (!c->amx_perm) return "arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA) was refused";
  return "?";
}

/* ---- engine ------------------------------------------------------------------------ */

/* The registration function of every ISA built into this binary: the fast paths under
 * #if MR_HAVE_<ISA>, never in a build with MR_FUZZ_NO_ISA, which leaves the ISA files out. */
static const struct {
  kn_isa isa;
  void (*reg)(kn__kernel_table *t);
} registrations[] = {
    {KN_ISA_REF, kn__ref_register},
#if !defined(MR_FUZZ_NO_ISA) && MR_HAVE_AVX2
    {KN_ISA_AVX2, kn__avx2_register},
#endif
#if !defined(MR_FUZZ_NO_ISA) && MR_HAVE_AVX512
    {KN_ISA_AVX512, kn__avx512_register},
#endif
#if !defined(MR_FUZZ_NO_ISA) && MR_HAVE_AMX
    /* after AVX-512: it forwards small token counts to those kernels; registers nothing
     * for a format whose start-up self-test fails (moe_amx.c) */
    {KN_ISA_AMX, kn__amx_register},
#endif
};

/* The process-wide kernel table (internal.h section F): every registration up to the CPU's
 * best ISA, then the start-up self-test in a child process, once. */
void (*kn__register_hook)(kn__kernel_table *t);
static pthread_once_t verified_once = PTHREAD_ONCE_INIT;
static kn__kernel_table verified_tab;
static kn__selftest_report verified_rep;

/* MOERPC_AMX_MIN_TOKENS (kernels/README.md): unset or "": each AMX format's default
 * crossover (moe_amx.c); "measure": each measured on this CPU at start-up; "N": every AMX
 * format from N tokens per expert; "bf16=N,int8=M,int4=K,fp8-b128=F" (any of them, in any
 * order): those formats, the others at their defaults. want[f] = 0: the default, AMX_MEASURE:
 * measure. N in 1..4096. */
#define KN_AMX_MIN_TOKENS_ENV_MAX 4096u
#define AMX_MEASURE UINT32_MAX
static int amx_min_env(uint32_t want[KN_FMT_COUNT], mr_err *e) {
  memset(want, 0, KN_FMT_COUNT * sizeof want[0]);
  const char *env = getenv("MOERPC_AMX_MIN_TOKENS");
  if (!env || !*env) return 0;
  if (strcmp(env, "measure") == 0) {
    want[KN_FMT_BF16] = want[KN_FMT_INT8] = want[KN_FMT_INT4] = want[KN_FMT_FP8] = AMX_MEASURE;
    return 0;
  }
  static const kn_format amx_fmts[4] = {KN_FMT_BF16, KN_FMT_INT8, KN_FMT_INT4, KN_FMT_FP8};
  const bool all = env[0] >= '0' && env[0] <= '9';
  bool ok = true;
  for (const char *p = env; ok;) {
    kn_format f = KN_FMT_COUNT;
    if (!all) { /* NAME=N */
      const char *eq = strchr(p, '=');
      for (int i = 0; i < 4 && eq; i++) {
        const char *name = kn_format_name(amx_fmts[i]);
        if ((size_t)(eq - p) == strlen(name) && strncmp(p, name, strlen(name)) == 0) f = amx_fmts[i];
      }
      if (f == KN_FMT_COUNT) {
        ok = false;
        break;
      }
      p = eq + 1;
    }
    char *end;
    errno = 0;
    unsigned long v = strtoul(p, &end, 10);
    ok = end != p && !errno && *p != '-' && v >= 1 && v <= KN_AMX_MIN_TOKENS_ENV_MAX &&
         (*end == '\0' || (*end == ',' && !all && end[1] != '\0'));
    if (!ok) break;
    for (int i = 0; i < 4; i++)
      if (all || amx_fmts[i] == f) want[amx_fmts[i]] = (uint32_t)v;
    if (*end == '\0') break;
    p = end + 1;
  }
  if (ok) return 0;
  memset(want, 0, KN_FMT_COUNT * sizeof want[0]);
  return mr_err_set(e, MR_EINVAL,
                    "MOERPC_AMX_MIN_TOKENS = \"%s\": must be measure, a count N, or "
                    "bf16=N,int8=N,int4=N,fp8-b128=N (any of them), each N in 1..%u tokens per expert",
                    env, KN_AMX_MIN_TOKENS_ENV_MAX);
}

#if !defined(MR_FUZZ_NO_ISA) && MR_HAVE_AMX
/* Each AMX format's crossover, once the self-test has passed its entry: the default, a count
 * from MOERPC_AMX_MIN_TOKENS, or measured here when it says "measure" (moe_amx.c, "the
 * crossover, measured"); one INFO line each. */
static void amx_crossover_choose(const kn__kernel_table *t) {
  if (kn__cpu_get()->best < KN_ISA_AMX) return;
  uint32_t want[KN_FMT_COUNT];
  mr_err e;
  if (amx_min_env(want, &e)) return; /* kn_engine_new refuses the engine, naming it */
  static const kn_format fmts[4] = {KN_FMT_BF16, KN_FMT_INT8, KN_FMT_INT4, KN_FMT_FP8};
  static const uint32_t ns[KN_XO_NS] = KN_XO_NS_INIT;
  for (int i = 0; i < 4; i++) {
    const kn_format f = fmts[i];
    if (!t->k[f][KN_ISA_AMX].gate_up) continue; /* no AMX entry, or refused by the self-test */
    if (want[f] == 0) {
      mr_log(MR_LOG_INFO, "kn: %s on AMX tiles from %u tokens per expert (the default; "
             "MOERPC_AMX_MIN_TOKENS=measure measures it on this CPU)", kn_format_name(f), kn__amx_min_tokens(f));
      continue;
    }
    if (want[f] != AMX_MEASURE) {
      kn__amx_set_min_tokens(f, want[f]);
      mr_log(MR_LOG_INFO, "kn: %s on AMX tiles from %u tokens per expert (MOERPC_AMX_MIN_TOKENS)",
             kn_format_name(f), kn__amx_min_tokens(f));
      continue;
    }
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
    /* Instrumented kernels' times say nothing about the CPU (and cost 10x): the default. */
    mr_log(MR_LOG_INFO, "kn: %s on AMX tiles from %u tokens per expert (not measured in a sanitizer build)",
           kn_format_name(f), kn__amx_min_tokens(f));
    continue;
#endif
    uint32_t m = 0;
    double r[KN_XO_NS];
    const uint64_t t0 = mr_now_ns();
    int rc = kn__amx_crossover(f, &m, r);
    if (rc) {
      mr_log(MR_LOG_WARN, "kn: the AMX crossover of %s could not be measured (%s): tiles from %u tokens "
             "per expert", kn_format_name(f), mr_err_name(rc), kn__amx_min_tokens(f));
      continue;
    }
    kn__amx_set_min_tokens(f, m);
    char buf[160];
    size_t o = 0;
    for (int j = 0; j < KN_XO_NS && o < sizeof buf; j++)
      o += (size_t)snprintf(buf + o, sizeof buf - o, "%s%u: %.2f", j ? ", " : "", ns[j], r[j]);
    mr_log(MR_LOG_INFO, "kn: %s on AMX tiles from %u tokens per expert (measured in %.0f ms; tiles / "
           "AVX-512 time by tokens per expert: %s)", kn_format_name(f), kn__amx_min_tokens(f),
           (double)(mr_now_ns() - t0) / 1e6, buf);
  }
}
#endif

static void verified_build(void) {
  const kn__cpu *cpu = kn__cpu_get();
  for (size_t i = 0; i < sizeof registrations / sizeof registrations[0]; i++)
    if (registrations[i].isa <= cpu->best) registrations[i].reg(&verified_tab);
  if (kn__register_hook) kn__register_hook(&verified_tab);
  const char *env = getenv("MOERPC_SELFTEST");
  if (env && strcmp(env, "off") == 0) {
    mr_log(MR_LOG_WARN, "kn: MOERPC_SELFTEST=off: the fast kernels are used without their start-up self-test on "
           "\"%s\"; a kernel that faults on this CPU will kill the process", cpu->model);
  } else {
    kn__selftest_table(&verified_tab, KN_ISA_COUNT - 1, 1.0, &verified_rep);
  }
#if !defined(MR_FUZZ_NO_ISA) && MR_HAVE_AMX
  amx_crossover_choose(&verified_tab);
#endif
}

const kn__kernel_table *kn__verified_table(const kn__selftest_report **rep) {
  pthread_once(&verified_once, verified_build);
  if (rep) *rep = &verified_rep;
  return &verified_tab;
}

/* MOERPC_SELFTEST: unset, "on" or "off" (kernels/README.md). */
static int selftest_env_check(mr_err *e) {
  const char *env = getenv("MOERPC_SELFTEST");
  if (!env || !*env || strcmp(env, "on") == 0 || strcmp(env, "off") == 0) return 0;
  return mr_err_set(e, MR_EINVAL, "MOERPC_SELFTEST = \"%s\": must be on (the default) or off", env);
}

/* The pool's spin before sleeping: KN_POOL_SPIN_US, or MOERPC_SPIN_US (microseconds). */
static int engine_spin(uint32_t *spin_us, mr_err *e) {
  *spin_us = KN_POOL_SPIN_US;
  const char *env = getenv("MOERPC_SPIN_US");
  if (!env || !*env) return 0;
  char *end;
  errno = 0;
  unsigned long v = strtoul(env, &end, 10);
  if (end == env || *end != '\0' || errno != 0 || env[0] == '-' || v > KN_POOL_SPIN_MAX_US)
    return mr_err_set(e, MR_EINVAL, "MOERPC_SPIN_US = \"%s\": must be an integer in 0..%u (microseconds)",
                      env, KN_POOL_SPIN_MAX_US);
  *spin_us = (uint32_t)v;
  return 0;
}

int kn_engine_new(kn_engine **out, const kn_engine_opts *opts, mr_err *e) {
  int rc;
  *out = NULL;
  kn_engine *eng = mr_calloc(1, sizeof *eng);
  if (!eng) return mr_err_set(e, MR_ENOMEM, "kn_engine_new: out of memory");

  const kn__cpu *cpu = kn__cpu_get();
  kn_isa want = opts ? opts->isa : KN_ISA_COUNT;
  const char *want_from = "isa";
  const char *env = getenv("MOERPC_ISA");
  if (env && *env && strcmp(env, "auto") != 0) {
    if (kn_isa_parse(env, &want) != 0) {
      rc = mr_err_set(e, MR_EINVAL, "MOERPC_ISA = \"%s\": must be ref, avx2, avx512, amx or auto", env);
      goto out_free_eng;
    }
    want_from = "MOERPC_ISA";
  } else if (env && strcmp(env, "auto") == 0) {
    want = KN_ISA_COUNT;
  }
  if (want == KN_ISA_COUNT) {
    want = cpu->best;
  } else if ((unsigned)want > KN_ISA_COUNT) {
    rc = mr_err_set(e, MR_EINVAL, "isa = %d: must be below %d", (int)want, KN_ISA_COUNT);
    goto out_free_eng;
  } else if (want > cpu->best) {
    rc = mr_err_set(e, MR_ENOTSUP, "%s = %s: this CPU/OS cannot run it (%s); best available is %s",
                    want_from, kn_isa_name(want), isa_missing(cpu, want), kn_isa_name(cpu->best));
    goto out_free_eng;
  }
  eng->isa = want;

  rc = engine_spin(&eng->spin_us, e);
  if (rc) goto out_free_eng;
  rc = selftest_env_check(e);
  if (rc) goto out_free_eng;
  {
    uint32_t amx_want[KN_FMT_COUNT];
    rc = amx_min_env(amx_want, e);
    if (rc) goto out_free_eng;
  }
  /* Topology, then the plan (validates threads / numa / force_split), then the threads. */
  rc = kn__topo_host(&eng->topo, e);
  if (rc) goto out_free_eng;
  rc = kn__plan_make(&eng->plan, &eng->topo, opts ? opts->numa : NULL, opts ? opts->threads : 0,
                     opts ? opts->force_split : 0, e);
  if (rc) goto out_free_eng;
  if (eng->topo.n_dropped)
    mr_log(MR_LOG_WARN, "kn engine: the host has more than %u NUMA nodes with CPUs; %u are not used",
           KN_MAX_NODES, eng->topo.n_dropped);
  eng->n_nodes = eng->plan.n_groups;
  memcpy(eng->node, eng->plan.group_node, sizeof eng->node);
  eng->forced_split = eng->plan.forced;
  eng->numa_place = false;
#if MR_HAVE_NUMA
  /* Placing slices pays only when they really sit on different nodes. */
  eng->numa_place = !eng->plan.forced && eng->plan.n_real_nodes > 1 && numa_available() >= 0;
#endif
  rc = kn__pool_new(&eng->pool, &eng->plan, &eng->topo, eng->spin_us, e);
  if (rc) goto out_free_eng;

  /* The REF column always; the fast columns up to the engine's ISA from the self-tested
   * process table (a REF engine never starts the self-test). */
  kn__ref_register(&eng->table);
  if (eng->isa > KN_ISA_REF) {
    const kn__kernel_table *v = kn__verified_table(NULL);
    for (int f = 0; f < KN_FMT_COUNT; f++)
      for (int i = KN_ISA_REF + 1; i <= (int)eng->isa; i++) eng->table.k[f][i] = v->k[f][i];
  }
  for (int f = 0; f < KN_FMT_COUNT; f++) {
    int i = eng->isa;
    while (i > KN_ISA_REF && !eng->table.k[f][i].gate_up) i--;
    MR_ASSERT(eng->table.k[f][i].gate_up && eng->table.k[f][i].down &&
              eng->table.k[f][i].tmp_floats);
    eng->fmt_isa[f] = (kn_isa)i;
    eng->kern[f] = &eng->table.k[f][i];
  }
  mr_arena_init(&eng->scratch, 4u << 20);
  if (mr__log_level >= MR_LOG_DEBUG) {
    kn__pool_stats st;
    kn__pool_get_stats(eng->pool, &st);
    mr_log(MR_LOG_DEBUG,
           "kn engine: isa %s (cpu best %s); %u worker(s), %u pinned pool thread(s); %u slice(s)%s; "
           "spin %u us; slices %s",
           kn_isa_name(eng->isa), kn_isa_name(cpu->best), eng->plan.n_workers, st.pinned,
           eng->n_nodes, eng->forced_split ? " (forced split)" : "", eng->spin_us,
           eng->numa_place ? "mapped on their nodes" : "in ordinary heap memory");
    for (uint32_t g = 0; g < eng->plan.n_groups; g++)
      mr_log(MR_LOG_DEBUG, "kn engine: slice %u on NUMA node %u, workers %u..%u", g,
             eng->plan.group_node[g], eng->plan.group_first[g], eng->plan.group_first[g + 1] - 1);
  }
  *out = eng;
  return 0;

out_free_eng:
  kn__pool_free(eng->pool);
  kn__plan_close(&eng->plan);
  kn__topo_close(&eng->topo);
  mr_free(eng);
  return rc;
}

void kn_engine_free(kn_engine *eng) {
  if (!eng) return;
  kn__pool_free(eng->pool); /* joins the workers */
  kn__plan_close(&eng->plan);
  kn__topo_close(&eng->topo);
  mr_arena_close(&eng->scratch);
  mr_free(eng);
}

kn_isa kn_engine_isa(const kn_engine *eng, kn_format f) {
  return (unsigned)f < KN_FMT_COUNT ? eng->fmt_isa[f] : KN_ISA_REF;
}

/* The caller of kn_moe_forward counts as one of them (kn.h). */
uint32_t kn_engine_threads(const kn_engine *eng) { return eng->plan.n_workers; }

uint32_t kn_engine_nodes(const kn_engine *eng) { return eng->n_nodes; }

int kn_engine_pin_caller(kn_engine *eng, mr_err *e) {
  if (!eng) return mr_err_set(e, MR_EINVAL, "kn_engine_pin_caller: engine is required");
  const int err = kn__pin_caller(&eng->plan, &eng->topo);
  if (err)
    return mr_err_set(e, MR_ENOTSUP, "kn_engine_pin_caller: pinning the calling thread failed: %s "
                      "(the engine works unpinned)", strerror(err));
  return 0;
}

/* ---- packing ----------------------------------------------------------------------- */

size_t kn__row_bytes(kn_format f, uint32_t K, uint32_t G) {
  switch (f) {
    case KN_FMT_F32: return (size_t)K * 4;
    case KN_FMT_F16:
    case KN_FMT_BF16: return (size_t)K * 2;
    case KN_FMT_INT8: return K;
    case KN_FMT_INT4: return (size_t)kn__ngroups(K, G) * G / 2;
    case KN_FMT_FP8: return K;
    default: MR_ASSERT(!"kn__row_bytes: bad format");
  }
  return 0;
}

size_t kn__row_scales(kn_format f, uint32_t K, uint32_t G) {
  if (f == KN_FMT_INT8) return 1;
  if (f == KN_FMT_INT4) return kn__ngroups(K, G);
  if (f == KN_FMT_FP8) return kn__ngroups(K, KN_FP8_BLOCK);
  return 0;
}

static size_t align_up(size_t n) { return (n + KN_PACK_ALIGN - 1) & ~(size_t)(KN_PACK_ALIGN - 1); }

/* Byte offsets of the six arrays of a slice inside its block (section A of internal.h). */
typedef struct slice_layout {
  size_t gate, up, down, gate_scale, up_scale, down_scale, total;
} slice_layout;

static slice_layout slice_layout_of(const kn_layer *L, uint32_t s) {
  kn_format f = L->d.format;
  uint32_t H = L->d.hidden, Is = L->slice_len[s], G = L->d.group;
  size_t gu = (size_t)Is * kn__row_bytes(f, H, G);
  size_t dn = (size_t)H * kn__row_bytes(f, Is, G);
  size_t gus = (size_t)Is * kn__row_scales(f, H, G) * sizeof(float);
  size_t dns = (size_t)H * kn__row_scales(f, Is, G) * sizeof(float);
  slice_layout l;
  l.gate = 0;
  l.up = align_up(l.gate + gu);
  l.down = align_up(l.up + gu);
  l.gate_scale = align_up(l.down + dn);
  l.up_scale = align_up(l.gate_scale + gus);
  l.down_scale = align_up(l.up_scale + gus);
  l.total = align_up(l.down_scale + dns);
  return l;
}

void kn__split_inter(uint32_t I, uint32_t n, uint32_t unit, uint32_t *off, uint32_t *len) {
  MR_ASSERT(n >= 1 && unit >= 1);
  /* units = ceil(I / unit); only the very last unit may be short. */
  uint32_t units = (I + unit - 1) / unit, base = units / n, rem = units % n, u = 0;
  for (uint32_t s = 0; s < n; s++) {
    uint32_t nu = base + (s < rem ? 1u : 0u);
    uint64_t b = (uint64_t)u * unit, end = (uint64_t)(u + nu) * unit;
    if (b > I) b = I;
    if (end > I) end = I;
    off[s] = (uint32_t)b;
    len[s] = (uint32_t)(end - b);
    u += nu;
  }
  MR_ASSERT(off[n - 1] + len[n - 1] == I);
}

uint32_t kn__first_bad(const void *src, mr_dtype dt, uint32_t n) {
  for (uint32_t k = 0; k < n; k++)
    if (!isfinite(kn__src_f32(src, dt, k))) return k;
  return n;
}

static float pack_amax(const void *src, mr_dtype dt, uint32_t n, uint32_t *bad) {
  float amax = 0.0f;
  for (uint32_t i = 0; i < n; i++) {
    const float v = kn__src_f32(src, dt, i);
    if (!isfinite(v)) {
      *bad = i;
      return amax;
    }
    amax = kn__max_f(amax, fabsf(v));
  }
  *bad = n;
  return amax;
}

static void pack_quant_int8(const void *src, mr_dtype dt, uint32_t n, float scale, int8_t *dst) {
  for (uint32_t i = 0; i < n; i++) {
    /* scale == 0 also covers amax so small that amax / 127 underflows: those rows are 0. */
    float q = scale > 0.0f ? kn__round_even(kn__src_f32(src, dt, i) / scale) : 0.0f;
    dst[i] = (int8_t)kn__min_f(kn__max_f(q, -127.0f), 127.0f);
  }
}

static uint32_t pack_quant_int4(const void *src, mr_dtype dt, uint32_t K, uint32_t G, uint8_t *dst,
                                float *scale) {
  uint32_t ng = kn__ngroups(K, G);
  memset(dst, 0, (size_t)ng * G / 2);
  for (uint32_t g = 0; g < ng; g++) {
    uint32_t k0 = g * G, k1 = k0 + G < K ? k0 + G : K, bad;
    const float amax = pack_amax((const char *)src + (size_t)k0 * mr_dtype_size(dt), dt, k1 - k0, &bad);
    if (bad < k1 - k0) return k0 + bad;
    float sc = amax / 7.0f;
    scale[g] = sc;
    for (uint32_t k = k0; k < k1; k++) {
      float q = sc > 0.0f ? kn__round_even(kn__src_f32(src, dt, k) / sc) : 0.0f;
      int v = (int)kn__min_f(kn__max_f(q, -7.0f), 7.0f);
      uint8_t nib = (uint8_t)(v & 0xf);
      dst[k / 2] |= (k & 1) ? (uint8_t)(nib << 4) : nib;
    }
  }
  return K;
}

static uint32_t pack_to_f32(float *dst, const void *src, mr_dtype dt, uint32_t n) {
  mr_convert_to_f32(dst, src, dt, n);
  for (uint32_t k = 0; k < n; k++)
    if (!isfinite(dst[k])) return k;
  return n;
}

static uint32_t pack_check(const void *src, mr_dtype dt, uint32_t n);

static uint32_t pack_copy(void *dst, const void *src, mr_dtype dt, uint32_t n) {
  memcpy(dst, src, (size_t)n * mr_dtype_size(dt));
  return pack_check(src, dt, n);
}

static uint32_t pack_check(const void *src, mr_dtype dt, uint32_t n) {
  if (dt == MR_DTYPE_F32) {
    const float *v = src;
    for (uint32_t k = 0; k < n; k++)
      if (!isfinite(v[k])) return k;
    return n;
  }
  const uint16_t *v = src, m = dt == MR_DTYPE_BF16 ? 0x7f80 : 0x7c00; /* exponent all ones */
  for (uint32_t k = 0; k < n; k++)
    if ((v[k] & m) == m) return k;
  return n;
}

static uint32_t pack_check_fp8(const uint8_t *src, uint32_t n) {
  for (uint32_t k = 0; k < n; k++)
    if ((src[k] & 0x7f) == 0x7f) return k;
  return n;
}

static uint32_t pack_copy_fp8(uint8_t *dst, const uint8_t *src, uint32_t n) {
  memcpy(dst, src, n);
  return pack_check_fp8(src, n);
}

static uint32_t pack_dequant_fp8(float *dst, const uint8_t *q, uint32_t n, float scale) {
  const float *tbl = mr_f8e4m3_table();
  uint32_t bad = n;
  for (uint32_t k = 0; k < n; k++) {
    dst[k] = tbl[q[k]] * scale;
    if (bad == n && (q[k] & 0x7f) == 0x7f) bad = k;
  }
  return bad;
}

static void pack_from_f32(void *dst, mr_dtype dt, const float *src, uint32_t n) {
  mr_convert_from_f32(dst, dt, src, n);
}

const kn__pack_fns kn__pack_scalar = {
    .to_f32 = pack_to_f32,
    .copy = pack_copy,
    .check = pack_check,
    .copy_fp8 = pack_copy_fp8,
    .check_fp8 = pack_check_fp8,
    .dequant_fp8 = pack_dequant_fp8,
    .amax = pack_amax,
    .quant_int8 = pack_quant_int8,
    .quant_int4 = pack_quant_int4,
    .from_f32 = pack_from_f32,
    .name = "scalar",
};

static const kn__pack_fns *pack_fns = &kn__pack_scalar;
static pthread_once_t pack_once = PTHREAD_ONCE_INIT;

static void pack_pick(void) {
  const char *env = getenv("MOERPC_PACK");
  if (env && strcmp(env, "scalar") == 0) {
    mr_log(MR_LOG_INFO, "kn: MOERPC_PACK=scalar: weights are converted by the scalar packer");
    return;
  }
#if KN__X86 && !defined(MR_FUZZ_NO_ISA) && MR_HAVE_AVX2
  const kn__cpu *c = kn__cpu_get();
  if (c->avx2 && c->fma && c->f16c && c->os_avx) pack_fns = &kn__pack_avx2;
  if (env && strcmp(env, "avx2") == 0) {
    mr_log(MR_LOG_INFO, "kn: MOERPC_PACK=avx2: weights are converted by the AVX2 packer");
    return;
  }
  if (kn__pack_avx512()) pack_fns = kn__pack_avx512();
#endif
}

#if KN__X86 && !defined(MR_FUZZ_NO_ISA) && MR_HAVE_AVX2 && MR_HAVE_AVX512
static kn__pack_fns pack_avx512_set;
static const kn__pack_fns *pack_avx512_ptr;
static pthread_once_t pack_avx512_once = PTHREAD_ONCE_INIT;

static void pack_avx512_make(void) {
  const kn__cpu *c = kn__cpu_get();
  if (!(c->avx2 && c->fma && c->f16c && c->os_avx && c->avx512f && c->avx512bw && c->avx512vl &&
        c->avx512dq && c->os_avx512))
    return;
  pack_avx512_set = kn__pack_avx2;
  pack_avx512_set.amax = kn__amax_avx512;
  pack_avx512_set.quant_int8 = kn__quant_int8_avx512;
  pack_avx512_set.quant_int4 = kn__quant_int4_avx512;
  pack_avx512_set.name = "avx512";
  pack_avx512_ptr = &pack_avx512_set;
}

const kn__pack_fns *kn__pack_avx512(void) {
  pthread_once(&pack_avx512_once, pack_avx512_make);
  return pack_avx512_ptr;
}
#else
const kn__pack_fns *kn__pack_avx512(void) { return NULL; }
#endif

const kn__pack_fns *kn__pack(void) {
  pthread_once(&pack_once, pack_pick);
  return pack_fns;
}

mr_dtype kn__format_dtype(kn_format f) {
  return f == KN_FMT_F32 ? MR_DTYPE_F32 : f == KN_FMT_F16 ? MR_DTYPE_F16
         : f == KN_FMT_BF16 ? MR_DTYPE_BF16 : MR_DTYPE_UNSPECIFIED;
}

float kn__amax(const float *src, uint32_t n) {
  uint32_t bad;
  return kn__pack()->amax(src, MR_DTYPE_F32, n, &bad);
}

void kn__quant_row_int8(const float *src, uint32_t n, float scale, int8_t *dst) {
  kn__pack()->quant_int8(src, MR_DTYPE_F32, n, scale, dst);
}

void kn__quant_row_int4(const float *src, uint32_t K, uint32_t G, uint8_t *dst, float *scale) {
  kn__pack()->quant_int4(src, MR_DTYPE_F32, K, G, dst, scale);
}

void kn__pack_row(kn_format f, uint32_t G, const float *src, uint32_t K, float int8_scale,
                  void *dst, float *scale) {
  const kn__pack_fns *P = kn__pack();
  switch (f) {
    case KN_FMT_F32: memcpy(dst, src, (size_t)K * 4); break;
    case KN_FMT_F16: P->from_f32(dst, MR_DTYPE_F16, src, K); break;
    case KN_FMT_BF16: P->from_f32(dst, MR_DTYPE_BF16, src, K); break;
    case KN_FMT_INT8:
      *scale = int8_scale;
      P->quant_int8(src, MR_DTYPE_F32, K, int8_scale, dst);
      break;
    case KN_FMT_INT4: P->quant_int4(src, MR_DTYPE_F32, K, G, dst, scale); break;
    default: MR_ASSERT(!"kn__pack_row: bad format");
  }
}

uint32_t kn__pack_row_src(kn_format f, uint32_t G, const void *src, mr_dtype dt, uint32_t K,
                          float *buf, void *dst, float *scale) {
  const kn__pack_fns *P = kn__pack();
  uint32_t bad;
  switch (f) {
    case KN_FMT_INT8: {
      const float amax = P->amax(src, dt, K, &bad);
      if (bad < K) return bad;
      *scale = amax / 127.0f;
      P->quant_int8(src, dt, K, *scale, dst);
      return K;
    }
    case KN_FMT_INT4: return P->quant_int4(src, dt, K, G, dst, scale);
    default:
      bad = P->to_f32(buf, src, dt, K);
      if (bad == K) kn__pack_row(f, G, buf, K, 0.0f, dst, scale);
      return bad;
  }
}

/* ---- FP8 e4m3fn -------------------------------------------------------------------- */

const float *kn__fp8_table(void) { return mr_f8e4m3_table(); }

float kn_fp8_e4m3_to_f32(uint8_t code) { return mr_f8e4m3_table()[code]; }

uint8_t kn_fp8_e4m3_from_f32(float v) { return mr_f32_to_f8e4m3(v); }

int kn_fp8_quantize_b128(const void *w, mr_dtype src, uint32_t N, uint32_t K, uint8_t *q,
                         float *scale_inv, mr_err *e) {
  if (!w || !q || !scale_inv || N == 0 || K == 0)
    return mr_err_set(e, MR_EINVAL, "kn_fp8_quantize_b128: w, q, scale_inv and a non-empty shape are required");
  if (src != MR_DTYPE_F32 && src != MR_DTYPE_F16 && src != MR_DTYPE_BF16)
    return mr_err_set(e, MR_EINVAL, "src dtype = %d, must be f32, f16 or bf16", (int)src);
  const uint32_t B = KN_FP8_BLOCK, nkb = kn__ngroups(K, B);
  const size_t es = mr_dtype_size(src);
  float *buf = mr_malloc((size_t)B * K * sizeof(float)); /* one block row in fp32 */
  if (!buf) return mr_err_set(e, MR_ENOMEM, "kn_fp8_quantize_b128: out of memory");
  for (uint32_t r0 = 0; r0 < N; r0 += B) {
    const uint32_t nr = N - r0 < B ? N - r0 : B;
    mr_convert_to_f32(buf, (const char *)w + (size_t)r0 * K * es, src, (size_t)nr * K);
    for (size_t i = 0; i < (size_t)nr * K; i++)
      if (!isfinite(buf[i])) {
        float bad = buf[i];
        mr_free(buf);
        return mr_err_set(e, MR_EINVAL, "w[%u, %u] = %g: weights must be finite",
                          r0 + (uint32_t)(i / K), (uint32_t)(i % K), (double)bad);
      }
    mr_f8e4m3_quantize_rows(buf, nr, K, q + (size_t)r0 * K, scale_inv + (size_t)(r0 / B) * nkb);
  }
  mr_free(buf);
  return 0;
}

/* kn_fp8_dequant_b128 in items of whole rows; the first NaN code (row-major) is kept. */
typedef struct dequant_job {
  const kn__pack_fns *P;
  const uint8_t *q;
  const float *scale_inv;
  uint32_t K, row0, n_rows, rows_per_item;
  float *dst;
  pthread_mutex_t lock; /* guards bad_* (taken only at a NaN code) */
  bool bad;
  uint32_t bad_row, bad_col;
} dequant_job;

static void dequant_item(void *arg, uint32_t item, uint32_t worker) {
  (void)worker;
  dequant_job *j = arg;
  const uint32_t K = j->K, nkb = kn__ngroups(K, KN_FP8_BLOCK);
  const uint32_t r0 = item * j->rows_per_item;
  const uint32_t r1 = r0 + j->rows_per_item < j->n_rows ? r0 + j->rows_per_item : j->n_rows;
  for (uint32_t r = r0; r < r1; r++) {
    const uint32_t row = j->row0 + r;
    const uint8_t *q = j->q + (size_t)row * K;
    const float *sr = j->scale_inv + (size_t)(row / KN_FP8_BLOCK) * nkb;
    float *d = j->dst + (size_t)r * K;
    for (uint32_t c0 = 0; c0 < K; c0 += KN_FP8_BLOCK) {
      const uint32_t n = K - c0 < KN_FP8_BLOCK ? K - c0 : KN_FP8_BLOCK;
      const float scale = sr[c0 / KN_FP8_BLOCK];
      const uint32_t k = kn__fp8_first_inf(d + c0, j->P->dequant_fp8(d + c0, q + c0, n, scale), scale);
      if (k == n) continue;
      pthread_mutex_lock(&j->lock);
      if (!j->bad || row < j->bad_row || (row == j->bad_row && c0 + k < j->bad_col)) {
        j->bad = true;
        j->bad_row = row;
        j->bad_col = c0 + k;
      }
      pthread_mutex_unlock(&j->lock);
      return; /* the rest of this item cannot hold an earlier one */
    }
  }
}

int kn_fp8_dequant_b128(kn_engine *eng, const uint8_t *q, const float *scale_inv, uint32_t N,
                        uint32_t K, uint32_t row0, uint32_t n_rows, float *dst, mr_err *e) {
  if (!q || !scale_inv || !dst || K == 0)
    return mr_err_set(e, MR_EINVAL, "kn_fp8_dequant_b128: q, scale_inv, dst and K > 0 are required");
  if (row0 > N || n_rows > N - row0)
    return mr_err_set(e, MR_EINVAL, "kn_fp8_dequant_b128: rows %u..%u of a %u-row matrix", row0,
                      row0 + n_rows, N);
  if (n_rows == 0) return 0;
  /* items of >= 64 KiB of codes: small enough to balance, large enough to amortize a claim */
  const uint32_t per = K >= 65536u ? 1u : 65536u / K;
  dequant_job j = {.P = kn__pack(), .q = q, .scale_inv = scale_inv, .K = K, .row0 = row0,
                   .n_rows = n_rows, .rows_per_item = per, .dst = dst};
  pthread_mutex_init(&j.lock, NULL);
  const uint32_t items = (n_rows + per - 1) / per;
  if (eng)
    kn_engine_run(eng, items, dequant_item, &j);
  else
    for (uint32_t i = 0; i < items && !j.bad; i++) dequant_item(&j, i, 0);
  pthread_mutex_destroy(&j.lock);
  if (j.bad) {
    const uint8_t c = q[(size_t)j.bad_row * K + j.bad_col];
    if ((c & 0x7f) == 0x7f)
      return mr_err_set(e, MR_EINVAL, "[%u, %u] is a NaN code (0x%02x): e4m3fn weights must be finite",
                        j.bad_row, j.bad_col, c);
    return mr_err_set(e, MR_EINVAL, "[%u, %u]: code 0x%02x times block scale %g overflows fp32: "
                      "weights must be finite", j.bad_row, j.bad_col, c,
                      (double)scale_inv[(size_t)(j.bad_row / KN_FP8_BLOCK) * kn__ngroups(K, KN_FP8_BLOCK) +
                                        j.bad_col / KN_FP8_BLOCK]);
  }
  return 0;
}

int kn_fp8_check_scales(const float *s, uint32_t N, uint32_t K, const char *what, mr_err *e) {
  const uint32_t nr = kn__ngroups(N, KN_FP8_BLOCK), nc = kn__ngroups(K, KN_FP8_BLOCK);
  for (uint32_t r = 0; r < nr; r++)
    for (uint32_t c = 0; c < nc; c++) {
      float v = s[(size_t)r * nc + c];
      if (!(isfinite(v) && v > 0.0f))
        return mr_err_set(e, MR_EINVAL, "%s scale_inv[%u, %u] = %g: block scales must be finite and > 0",
                          what ? what : "fp8", r, c, (double)v);
    }
  return 0;
}

/* ---- layer ------------------------------------------------------------------------- */

int kn_layer_new(kn_layer **out, kn_engine *eng, const kn_layer_desc *d, mr_err *e) {
  *out = NULL;
  if (!eng || !d) return mr_err_set(e, MR_EINVAL, "kn_layer_new: engine and desc are required");
  if (d->hidden < 1 || d->hidden > KN_MAX_DIM)
    return mr_err_set(e, MR_EINVAL, "hidden = %u, must be in 1..%u", d->hidden, KN_MAX_DIM);
  if (d->inter < 1 || d->inter > KN_MAX_DIM)
    return mr_err_set(e, MR_EINVAL, "inter = %u, must be in 1..%u", d->inter, KN_MAX_DIM);
  if (d->num_experts < 1 || d->num_experts > KN_MAX_EXPERTS)
    return mr_err_set(e, MR_EINVAL, "num_experts = %u, must be in 1..%u", d->num_experts,
                      KN_MAX_EXPERTS);
  if ((unsigned)d->format >= KN_FMT_COUNT)
    return mr_err_set(e, MR_EINVAL, "format = %d, must be below %d", (int)d->format, KN_FMT_COUNT);
  if (d->format == KN_FMT_INT4 && d->group != 32 && d->group != 64 && d->group != 128)
    return mr_err_set(e, MR_EINVAL, "group = %u, must be 32, 64 or 128 for int4", d->group);

  kn_layer *L = mr_calloc(1, sizeof *L);
  if (!L) return mr_err_set(e, MR_ENOMEM, "kn_layer_new: out of memory");
  L->d = *d;
  if (d->format != KN_FMT_INT4) L->d.group = d->format == KN_FMT_FP8 ? KN_FP8_BLOCK : 0;
  L->n_slices = eng->n_nodes;
  memcpy(L->node, eng->node, sizeof L->node);
  L->eng = eng;
  L->numa_place = eng->numa_place;
  /* INT4 slices are cut at whole groups, so that the groups of the down matrix are the
   * same (in HF column coordinates) for any slice count and the packed values do not
   * depend on it. */
  uint32_t unit = KN_SLICE_ALIGN;
  if (d->format == KN_FMT_INT4 && d->group > unit) unit = d->group;
  /* FP8 slices are cut at whole 128x128 blocks for the same reason. */
  if (d->format == KN_FMT_FP8) unit = KN_FP8_BLOCK;
  kn__split_inter(d->inter, L->n_slices, unit, L->slice_off, L->slice_len);
  for (uint32_t s = 0; s < L->n_slices; s++) {
    if (L->slice_len[s] > L->max_slice_len) L->max_slice_len = L->slice_len[s];
    if (L->slice_len[s]) L->expert_bytes += slice_layout_of(L, s).total;
  }
  L->w = mr_calloc(d->num_experts, sizeof *L->w);
  L->owned = mr_calloc((d->num_experts + 63) / 64, sizeof *L->owned);
  L->lent = mr_calloc((d->num_experts + 63) / 64, sizeof *L->lent);
  if (!L->w || !L->owned || !L->lent) {
    kn_layer_free(L);
    return mr_err_set(e, MR_ENOMEM, "kn_layer_new: out of memory for %u experts", d->num_experts);
  }
  *out = L;
  return 0;
}

static void slices_free(kn__slice_w *w, uint32_t n) {
  if (!w) return;
  for (uint32_t s = 0; s < n; s++) {
    if (w[s].borrowed)
      continue;
    if (w[s].map_bytes)
      kn__mem_unmap(w[s].mem, w[s].map_bytes);
    else
      mr_free_aligned(w[s].mem);
  }
  mr_free(w);
}

/* Puts an expert's slices (bytes in all) into the layer, freeing the ones it replaces.
 * Reloading an expert replaces it; the layer must not be in use meanwhile (kn.h). */
static void expert_install(kn_layer *L, uint32_t expert, kn__slice_w *w, uint64_t bytes) {
  if (L->w[expert]) {
    slices_free(L->w[expert], L->n_slices);
    L->bytes -= L->expert_bytes;
  } else {
    L->owned[expert >> 6] |= 1ull << (expert & 63);
    L->n_owned++;
  }
  L->w[expert] = w;
  L->bytes += bytes;
}

void kn_layer_free(kn_layer *L) {
  if (!L) return;
  if (L->w)
    for (uint32_t x = 0; x < L->d.num_experts; x++)
      if (!L->lent || !((L->lent[x >> 6] >> (x & 63)) & 1u)) slices_free(L->w[x], L->n_slices);
  mr_free(L->w);
  mr_free(L->owned);
  mr_free(L->lent);
  mr_free(L);
}

void kn_layer_forget(kn_layer *L, kn_layer *old) {
  if (!L) return;
  for (uint32_t x = 0; x < L->d.num_experts; x++) {
    if (!L->w[x]) continue;
    if (old && x < old->d.num_experts && old->w[x] == L->w[x])
      old->lent[x >> 6] &= ~(1ull << (x & 63));
    else
      slices_free(L->w[x], L->n_slices);
  }
  mr_free(L->w);
  mr_free(L->owned);
  mr_free(L->lent);
  mr_free(L);
}

int kn_layer_rebuild(kn_layer **out, kn_layer *old, const uint8_t *keep, kn_layer *add, mr_err *e) {
  *out = NULL;
  kn_layer *ref = old ? old : add;
  if (!ref) return mr_err_set(e, MR_EINVAL, "kn_layer_rebuild: old or add is required");
  if (old && add &&
      (old->eng != add->eng || memcmp(&old->d, &add->d, sizeof old->d) != 0 ||
       old->n_slices != add->n_slices))
    return mr_err_set(e, MR_EINVAL, "kn_layer_rebuild: old and add differ in engine, shape or "
                      "format");
  kn_layer *N = NULL;
  int rc = kn_layer_new(&N, ref->eng, &ref->d, e);
  if (rc) return rc;
  const uint32_t E = ref->d.num_experts;
  /* Nothing below can fail: the new layer's arrays exist. */
  for (uint32_t x = 0; x < E; x++) {
    const uint64_t bit = 1ull << (x & 63);
    if (add && kn__layer_owns(add, x)) {
      N->w[x] = add->w[x];
      add->w[x] = NULL;
      add->owned[x >> 6] &= ~bit;
      add->n_owned--;
      add->bytes -= add->expert_bytes;
    } else if (old && keep && keep[x] && kn__layer_owns(old, x) && !(old->lent[x >> 6] & bit)) {
      N->w[x] = old->w[x];
      old->lent[x >> 6] |= bit;
    } else {
      continue;
    }
    N->owned[x >> 6] |= bit;
    N->n_owned++;
    N->bytes += N->expert_bytes;
  }
  N->misplaced = ref->misplaced;
  *out = N;
  return 0;
}

static const char *const proj_names[3] = {"gate", "up", "down"};

/* Rows of one matrix per load work item. */
#define LOAD_BLOCK 32u

/* The first non-finite weight met while packing, in (matrix: gate, up, down; row; column)
 * order whichever worker met it, so that the message does not depend on the schedule. */
typedef struct bad_weight {
  bool set;
  uint32_t proj, row, col;
  float v;
} bad_weight;

/* One kn_layer_load_expert on the engine's workers: group s packs slice s, so that every
 * page of a slice is first written by a worker pinned on the slice's node. */
typedef struct load_job {
  kn_layer *L;
  kn__slice_w *w;                    /* [n_slices], being filled */
  const void *src[3];                /* gate [I, H], up [I, H], down [H, I] */
  mr_dtype dt;                       /* MR_DTYPE_UNSPECIFIED when src_fp8 */
  bool src_fp8;                      /* src are e4m3 codes with block scales bscale */
  bool same;                         /* dt is what the format stores: rows are copied */
  bool check_only;                   /* kn_layer_borrow_expert: same (or src_fp8 into an FP8
                                      * layer), rows only checked, FP8 scales still written */
  const kn__pack_fns *P;             /* kn__pack() */
  const float *bscale[3];            /* [ceil(N/128)][ceil(K/128)] of each matrix (src_fp8) */
  float *rows;                       /* [n_workers][row_floats]: one fp32 row per worker */
  size_t row_floats;
  uint32_t gu_items[KN_MAX_NODES];   /* items of group s: gate/up row blocks, then down */
  bool skip_caller;                  /* worker 0 packs nothing (see kn_layer_load_expert) */
  pthread_mutex_t lock;              /* guards bad; taken only when a weight is bad */
  bad_weight bad;
  kn__work work;
} load_job;

static void note_bad(load_job *j, kn__proj p, uint32_t row, uint32_t col, float v) {
  pthread_mutex_lock(&j->lock);
  bad_weight *b = &j->bad;
  if (!b->set || p < b->proj || (p == b->proj && (row < b->row || (row == b->row && col < b->col))))
    *b = (bad_weight){true, p, row, col, v};
  pthread_mutex_unlock(&j->lock);
}

/* Converts K source elements of matrix p (from element elem_off) to fp32 at dst; false,
 * noting the first, if one is not finite: a NaN or inf weight would silently poison
 * every token routed to the expert. */
static bool load_row(load_job *j, float *dst, kn__proj p, size_t elem_off, uint32_t K, uint32_t row,
                     uint32_t col0) {
  if (j->src_fp8) {
    /* Dequantize: w = e4m3 * scale_inv of its block, one fp32 multiply (kn.h). */
    const uint8_t *q = (const uint8_t *)j->src[p] + elem_off;
    const uint32_t Kf = p == KN__DOWN ? j->L->d.inter : j->L->d.hidden;
    const float *sr = j->bscale[p] + (size_t)(row / KN_FP8_BLOCK) * kn__ngroups(Kf, KN_FP8_BLOCK);
    /* block by block (a slice of an int8 / int4 layer may start inside one) */
    for (uint32_t k = 0; k < K;) {
      const uint32_t c = col0 + k, n = K - k < KN_FP8_BLOCK - c % KN_FP8_BLOCK ? K - k : KN_FP8_BLOCK - c % KN_FP8_BLOCK;
      const float scale = sr[c / KN_FP8_BLOCK];
      const uint32_t b = kn__fp8_first_inf(dst + k, j->P->dequant_fp8(dst + k, q + k, n, scale), scale);
      if (b < n) {
        note_bad(j, p, row, c + b, (q[k + b] & 0x7f) == 0x7f ? NAN : dst[k + b]);
        return false;
      }
      k += n;
    }
    return true;
  }
  const uint32_t k = j->P->to_f32(dst, (const char *)j->src[p] + elem_off * mr_dtype_size(j->dt), j->dt, K);
  if (k < K) {
    note_bad(j, p, row, col0 + k, dst[k]);
    return false;
  }
  return true;
}

/* Stored format == served format: copies the K values of matrix p from element elem_off
 * to dst as they are (no conversion), noting the first one that is not finite. */
static void load_row_same(load_job *j, void *dst, kn__proj p, size_t elem_off, uint32_t K,
                          uint32_t row, uint32_t col0) {
  const size_t esz = mr_dtype_size(j->dt);
  const char *src = (const char *)j->src[p] + elem_off * esz;
  const uint32_t k = j->check_only ? j->P->check(src, j->dt, K) : j->P->copy(dst, src, j->dt, K);
  if (k < K) {
    float v;
    mr_convert_to_f32(&v, src + (size_t)k * esz, j->dt, 1);
    note_bad(j, p, row, col0 + k, v);
  }
}

/* FP8 layer from an FP8 source: copies the K codes of HF row `row` from column col0 (noting
 * a NaN code) and writes the row's ceil(K / 128) scales from the block scales. */
static void load_row_fp8(load_job *j, kn__proj p, uint32_t row, uint32_t col0, uint32_t K,
                         uint8_t *dst, float *scale) {
  const uint32_t Kf = p == KN__DOWN ? j->L->d.inter : j->L->d.hidden;
  const uint8_t *q = (const uint8_t *)j->src[p] + (size_t)row * Kf + col0;
  const uint32_t k = j->check_only ? j->P->check_fp8(q, K) : j->P->copy_fp8(dst, q, K);
  if (k < K) {
    note_bad(j, p, row, col0 + k, NAN);
    return;
  }
  const float *sr = j->bscale[p] + (size_t)(row / KN_FP8_BLOCK) * kn__ngroups(Kf, KN_FP8_BLOCK);
  for (uint32_t g = 0; g < kn__ngroups(K, KN_FP8_BLOCK); g++) scale[g] = sr[col0 / KN_FP8_BLOCK + g];
}

/* Packs K source elements of matrix p from element elem_off (HF row `row`, from column
 * col0) into dst and its scales at scale, straight from the source where it is not FP8
 * (kn__pack_row_src); notes the first weight that is not finite. buf: the worker's row. */
static void pack_row(load_job *j, float *buf, kn__proj p, size_t elem_off, uint32_t K, uint32_t row,
                     uint32_t col0, void *dst, float *scale) {
  const kn_format f = j->L->d.format;
  if (j->src_fp8) {
    if (load_row(j, buf, p, elem_off, K, row, col0))
      kn__pack_row(f, j->L->d.group, buf, K, f == KN_FMT_INT8 ? kn__amax(buf, K) / 127.0f : 0.0f, dst,
                   scale);
    return;
  }
  const size_t esz = mr_dtype_size(j->dt);
  const char *src = (const char *)j->src[p] + elem_off * esz;
  const uint32_t k = kn__pack_row_src(f, j->L->d.group, src, j->dt, K, buf, dst, scale);
  if (k < K) {
    float v;
    mr_convert_to_f32(&v, src + (size_t)k * esz, j->dt, 1);
    note_bad(j, p, row, col0 + k, v);
  }
}

/* The INT8 scale of HF down row r, amax / 127 over all I columns; false (noted) when one
 * of them is not finite. buf: the worker's row. */
static bool down_int8_scale(load_job *j, float *buf, uint32_t r, float *s8) {
  const uint32_t I = j->L->d.inter;
  if (j->src_fp8) {
    if (!load_row(j, buf, KN__DOWN, (size_t)r * I, I, r, 0)) return false;
    *s8 = kn__amax(buf, I) / 127.0f;
    return true;
  }
  const size_t esz = mr_dtype_size(j->dt);
  const char *src = (const char *)j->src[KN__DOWN] + (size_t)r * I * esz;
  uint32_t bad;
  const float amax = j->P->amax(src, j->dt, I, &bad);
  if (bad < I) {
    float v;
    mr_convert_to_f32(&v, src + (size_t)bad * esz, j->dt, 1);
    note_bad(j, KN__DOWN, r, bad, v);
    return false;
  }
  *s8 = amax / 127.0f;
  return true;
}

static void load_fn(void *arg, const kn__pool_ctx *c) {
  load_job *j = arg;
  if (c->worker == 0 && j->skip_caller) return;
  const kn_layer *L = j->L;
  const uint32_t H = L->d.hidden, I = L->d.inter, G = L->d.group;
  const kn_format f = L->d.format;
  float *row = j->rows + (size_t)c->worker * j->row_floats;
  uint32_t s, item;
  while (kn__work_claim(&j->work, c, &s, &item)) {
    kn__slice_w *ws = &j->w[s];
    const uint32_t off = L->slice_off[s], Is = L->slice_len[s];
    if (item < j->gu_items[s]) {
      const size_t rb = kn__row_bytes(f, H, G), sc = kn__row_scales(f, H, G);
      const uint32_t i0 = item * LOAD_BLOCK, i1 = i0 + LOAD_BLOCK < Is ? i0 + LOAD_BLOCK : Is;
      void *dsts[2] = {ws->gate, ws->up};
      float *scs[2] = {ws->gate_scale, ws->up_scale};
      for (uint32_t i = i0; i < i1; i++)
        for (int p = 0; p < 2; p++)
          if (j->same)
            load_row_same(j, (char *)dsts[p] + i * rb, (kn__proj)p, (size_t)(off + i) * H, H, off + i, 0);
          else if (f == KN_FMT_FP8)
            load_row_fp8(j, (kn__proj)p, off + i, 0, H, (uint8_t *)dsts[p] + i * rb, scs[p] + i * sc);
          else
            pack_row(j, row, (kn__proj)p, (size_t)(off + i) * H, H, off + i, 0, (char *)dsts[p] + i * rb,
                     scs[p] ? scs[p] + i * sc : NULL);
    } else {
      const size_t rb = kn__row_bytes(f, Is, G), sc = kn__row_scales(f, Is, G);
      const uint32_t j0 = (item - j->gu_items[s]) * LOAD_BLOCK;
      const uint32_t j1 = j0 + LOAD_BLOCK < H ? j0 + LOAD_BLOCK : H;
      for (uint32_t r = j0; r < j1 && j->same; r++)
        load_row_same(j, (char *)ws->down + r * rb, KN__DOWN, (size_t)r * I + off, Is, r, off);
      for (uint32_t r = j0; r < j1 && f == KN_FMT_FP8; r++)
        load_row_fp8(j, KN__DOWN, r, off, Is, (uint8_t *)ws->down + r * rb, ws->down_scale + r * sc);
      for (uint32_t r = j0; r < j1 && f != KN_FMT_FP8 && !j->same; r++) {
        void *d = (char *)ws->down + r * rb;
        float *dsc = ws->down_scale ? ws->down_scale + r * sc : NULL;
        /* The INT8 scale of a down row is that of the whole HF row (all I columns), not of
         * the slice's band, so that the packed values do not depend on the slice count and
         * a layer gives the same result on any number of nodes (docs/DESIGN.md section 5).
         * With one slice the band is the whole row. */
        float s8;
        if (f != KN_FMT_INT8 || Is == I) pack_row(j, row, KN__DOWN, (size_t)r * I + off, Is, r, off, d, dsc);
        else if (down_int8_scale(j, row, r, &s8)) {
          *dsc = s8;
          if (!j->src_fp8)
            j->P->quant_int8((const char *)j->src[KN__DOWN] + ((size_t)r * I + off) * mr_dtype_size(j->dt),
                             j->dt, Is, s8, d);
          else if (load_row(j, row, KN__DOWN, (size_t)r * I + off, Is, r, off))
            kn__pack_row(f, G, row, Is, s8, d, dsc);
        }
      }
    }
  }
}

/* Gives slice s of w its memory: mapped (on its node, huge pages when large) or from the
 * heap (small slices on one node). */
static int slice_alloc(kn_layer *L, uint32_t expert, uint32_t s, kn__slice_w *ws, mr_err *e) {
  const slice_layout lay = slice_layout_of(L, s);
  char *mem;
  if (L->numa_place || lay.total >= KN__HUGE_BYTES) {
    mem = kn__mem_map_on_node(lay.total, L->numa_place ? L->node[s] : KN__NO_NODE, &ws->map_bytes);
    if (!mem) {
      char where[48] = "";
      if (L->numa_place) snprintf(where, sizeof where, " on NUMA node %u", L->node[s]);
      return mr_err_set(e, MR_ENOMEM,
                        "expert %u slice %u: mapping %zu bytes%s failed: %s (out of memory, or "
                        "vm.max_map_count too low: each slice is one mapping)",
                        expert, s, lay.total, where, strerror(errno));
    }
  } else {
    mem = mr_malloc_aligned(lay.total, KN_PACK_ALIGN);
    if (!mem)
      return mr_err_set(e, MR_ENOMEM, "expert %u slice %u: out of memory for %zu bytes", expert, s,
                        lay.total);
  }
  ws->mem = mem;
  ws->mem_bytes = lay.total;
  ws->gate = mem + lay.gate;
  ws->up = mem + lay.up;
  ws->down = mem + lay.down;
  const bool scaled = L->d.format == KN_FMT_INT8 || L->d.format == KN_FMT_INT4 || L->d.format == KN_FMT_FP8;
  ws->gate_scale = scaled ? (float *)(mem + lay.gate_scale) : NULL;
  ws->up_scale = scaled ? (float *)(mem + lay.up_scale) : NULL;
  ws->down_scale = scaled ? (float *)(mem + lay.down_scale) : NULL;
  return 0;
}

static int load_run(load_job *jp, uint32_t expert, mr_err *e);

int kn_layer_load_expert(kn_layer *L, uint32_t expert, const void *gate, const void *up,
                         const void *down, mr_dtype src, mr_err *e) {
  if (!L || !gate || !up || !down)
    return mr_err_set(e, MR_EINVAL, "kn_layer_load_expert: layer, gate, up and down are required");
  if (expert >= L->d.num_experts)
    return mr_err_set(e, MR_ERANGE, "expert = %u, must be below num_experts = %u", expert,
                      L->d.num_experts);
  if (src != MR_DTYPE_F32 && src != MR_DTYPE_F16 && src != MR_DTYPE_BF16)
    return mr_err_set(e, MR_EINVAL, "src dtype = %d, must be f32, f16 or bf16", (int)src);
  if (L->d.format == KN_FMT_FP8) {
    /* Quantize each matrix to fp8-b128 here (block scales need 128 whole rows), then pack
     * the codes as from an FP8 checkpoint. */
    const uint32_t H = L->d.hidden, I = L->d.inter;
    const size_t nq = (size_t)I * H, ns = (size_t)kn__ngroups(I, KN_FP8_BLOCK) * kn__ngroups(H, KN_FP8_BLOCK);
    uint8_t *q = mr_malloc(3 * nq);
    float *sc = mr_malloc(3 * ns * sizeof(float));
    int rc = q && sc ? 0 : mr_err_set(e, MR_ENOMEM, "expert %u: out of memory quantizing to fp8", expert);
    const void *srcs[3] = {gate, up, down};
    for (int p = 0; p < 3 && !rc; p++) {
      rc = kn_fp8_quantize_b128(srcs[p], src, p == 2 ? H : I, p == 2 ? I : H, q + p * nq, sc + p * ns, e);
      if (rc) mr_err_prefix(e, rc, "expert %u %s", expert, proj_names[p]);
    }
    if (!rc)
      rc = kn_layer_load_expert_fp8(L, expert, q, sc, q + nq, sc + ns, q + 2 * nq, sc + 2 * ns, e);
    mr_free(q);
    mr_free(sc);
    return rc;
  }
  load_job j = {.L = L, .src = {gate, up, down}, .dt = src, .bad = {.set = false}};
  return load_run(&j, expert, e);
}

/* FP8 codes and block scales of one expert, the scales checked: packed, or (check_only)
 * served in place with per-row scales of the layer's own. */
static int fp8_run(kn_layer *L, uint32_t expert, const uint8_t *gate, const float *gate_scale,
                   const uint8_t *up, const float *up_scale, const uint8_t *down,
                   const float *down_scale, bool check_only, mr_err *e) {
  if (expert >= L->d.num_experts)
    return mr_err_set(e, MR_ERANGE, "expert = %u, must be below num_experts = %u", expert,
                      L->d.num_experts);
  const uint32_t H = L->d.hidden, I = L->d.inter;
  const float *scs[3] = {gate_scale, up_scale, down_scale};
  for (int p = 0; p < 3; p++) {
    char what[64];
    snprintf(what, sizeof what, "expert %u %s", expert, proj_names[p]);
    int rc = kn_fp8_check_scales(scs[p], p == 2 ? H : I, p == 2 ? I : H, what, e);
    if (rc) return rc;
  }
  load_job j = {.L = L, .src = {gate, up, down}, .dt = MR_DTYPE_UNSPECIFIED, .src_fp8 = true,
                .check_only = check_only, .bscale = {gate_scale, up_scale, down_scale},
                .bad = {.set = false}};
  return load_run(&j, expert, e);
}

int kn_layer_load_expert_fp8(kn_layer *L, uint32_t expert, const uint8_t *gate,
                             const float *gate_scale, const uint8_t *up, const float *up_scale,
                             const uint8_t *down, const float *down_scale, mr_err *e) {
  if (!L || !gate || !up || !down || !gate_scale || !up_scale || !down_scale)
    return mr_err_set(e, MR_EINVAL,
                      "kn_layer_load_expert_fp8: layer, gate, up, down and their scales are required");
  return fp8_run(L, expert, gate, gate_scale, up, up_scale, down, down_scale, false, e);
}

/* Runs a prepared load job (src, dt / src_fp8 set) for one expert. */
static int load_run(load_job *jp, uint32_t expert, mr_err *e) {
  int rc = 0;
  load_job j = *jp;
  kn_layer *L = j.L;
  kn_engine *eng = L->eng;
  MR_ASSERT(eng->plan.n_groups == L->n_slices);
  j.P = kn__pack();
  j.same = !j.src_fp8 && j.dt == kn__format_dtype(L->d.format);
  const uint32_t H = L->d.hidden, I = L->d.inter, nw = eng->plan.n_workers;
  /* One row per worker, each on its own cache lines. */
  j.row_floats = ((size_t)(H > I ? H : I) + 15) & ~(size_t)15;
  j.w = mr_calloc(L->n_slices, sizeof *j.w);
  j.rows = mr_malloc_aligned(j.row_floats * nw * sizeof(float), KN_PACK_ALIGN);
  if (!j.w || !j.rows) {
    rc = mr_err_set(e, MR_ENOMEM, "expert %u: out of memory", expert);
    goto out_free;
  }
  uint64_t bytes = 0;
  uint32_t counts[KN_MAX_NODES];
  for (uint32_t s = 0; s < L->n_slices; s++) {
    counts[s] = j.gu_items[s] = 0;
    if (L->slice_len[s] == 0) continue;
    if (j.check_only) { /* one slice, the whole expert: the source arrays themselves */
      const slice_layout lay = slice_layout_of(L, s);
      j.w[s] = (kn__slice_w){.borrowed = !j.src_fp8, .in_place = true, .mem_bytes = lay.total,
                             .gate = (void *)j.src[0], .up = (void *)j.src[1],
                             .down = (void *)j.src[2]};
      if (j.src_fp8) { /* the codes in place; their per-row scales are ours */
        char *m = mr_malloc_aligned(lay.total - lay.gate_scale, KN_PACK_ALIGN);
        if (!m) {
          rc = mr_err_set(e, MR_ENOMEM, "expert %u: out of memory for its scales", expert);
          goto out_free;
        }
        j.w[s].mem = m;
        j.w[s].gate_scale = (float *)m;
        j.w[s].up_scale = (float *)(m + (lay.up_scale - lay.gate_scale));
        j.w[s].down_scale = (float *)(m + (lay.down_scale - lay.gate_scale));
      }
    } else if ((rc = slice_alloc(L, expert, s, &j.w[s], e))) {
      goto out_free;
    }
    bytes += j.w[s].mem_bytes;
    j.gu_items[s] = (L->slice_len[s] + LOAD_BLOCK - 1) / LOAD_BLOCK;
    counts[s] = j.gu_items[s] + (H + LOAD_BLOCK - 1) / LOAD_BLOCK;
  }
  MR_ASSERT(bytes == L->expert_bytes);
  /* With placement, the caller (not pinned by us, running anywhere) leaves group 0's
   * items to group 0's pinned workers when there are any, so that first touch puts every
   * page on its node even where mbind is forbidden. */
  j.skip_caller = L->numa_place && eng->plan.group_first[1] > 1;
  kn__work_init(&j.work, L->n_slices, counts);
  pthread_mutex_init(&j.lock, NULL);
  kn__pool_run(eng->pool, load_fn, &j);
  pthread_mutex_destroy(&j.lock);
  if (j.bad.set) {
    rc = mr_err_set(e, MR_EINVAL, "expert %u %s[%u, %u] = %g: weights must be finite%s", expert,
                    proj_names[j.bad.proj], j.bad.row, j.bad.col, (double)j.bad.v,
                    j.src_fp8 ? " (an e4m3 NaN code 0x7f/0xff)" : "");
    goto out_free;
  }
  if (L->numa_place)
    for (uint32_t s = 0; s < L->n_slices; s++) {
      if (!j.w[s].mem) continue;
      int node = kn__mem_node_of(j.w[s].mem);
      if (node >= 0 && (uint32_t)node != L->node[s]) {
        L->misplaced++;
        mr_log_ratelimited(MR_LOG_WARN, 1,
                           "kn: expert %u slice %u landed on NUMA node %d, not %u (node memory "
                           "full?); %u slice(s) of this layer are off their node",
                           expert, s, node, L->node[s], L->misplaced);
      }
    }

  expert_install(L, expert, j.w, bytes);
  j.w = NULL;

out_free:
  mr_free_aligned(j.rows);
  slices_free(j.w, L->n_slices);
  return rc;
}

/* The fp32 block scales of an F8_E4M3 expert's tensors (t, scales as
 * mr_config_expert_tensors_q finds them), checked; the caller frees sc[0..2]. */
static int st_fp8_scales(const kn_layer *L, uint32_t expert, const mr_st_tensor *const t[3],
                         const mr_st_tensor *const scales[3], float *sc[3], mr_err *e) {
  int rc = 0;
  sc[0] = sc[1] = sc[2] = NULL;
  for (int p = 0; p < 3 && !rc; p++) {
    const mr_st_tensor *s = scales[p];
    const uint32_t N = p == 2 ? L->d.hidden : L->d.inter, K = p == 2 ? L->d.inter : L->d.hidden;
    const size_t n = (size_t)kn__ngroups(N, KN_FP8_BLOCK) * kn__ngroups(K, KN_FP8_BLOCK);
    if (!s || (s->dtype != MR_DTYPE_F32 && s->dtype != MR_DTYPE_BF16) ||
        s->nbytes != n * mr_dtype_size(s->dtype) || !mr_st_is_f8e4m3(t[p]) || t[p]->nbytes != (uint64_t)N * K) {
      rc = mr_err_set(e, MR_EFORMAT, "expert %u: tensor \"%.200s\": fp8 weights need F8_E4M3 [%u, %u] "
                      "and F32/BF16 scales [%zu] (found %s)", expert, t[p]->name, N, K, n,
                      s ? s->dtype_name : "none");
      break;
    }
    if (!(sc[p] = mr_malloc(n * sizeof(float)))) {
      rc = mr_err_set(e, MR_ENOMEM, "expert %u: out of memory for scales", expert);
      break;
    }
    mr_convert_to_f32(sc[p], s->data, s->dtype, n);
    char what[256];
    snprintf(what, sizeof what, "tensor \"%.200s\"", s->name);
    rc = kn_fp8_check_scales(sc[p], N, K, what, e);
  }
  return rc;
}

/* fp8_run on tensors: their block scales converted and checked first. */
static int st_fp8_run(kn_layer *L, uint32_t expert, const mr_st_tensor *const t[3],
                      const mr_st_tensor *const scales[3], bool check_only, mr_err *e) {
  float *sc[3];
  int rc = st_fp8_scales(L, expert, t, scales, sc, e);
  if (!rc)
    rc = fp8_run(L, expert, t[0]->data, sc[0], t[1]->data, sc[1], t[2]->data, sc[2], check_only, e);
  for (int p = 0; p < 3; p++) mr_free(sc[p]);
  return rc;
}

int kn_layer_load_expert_st(kn_layer *L, uint32_t expert, const mr_st_tensor *const t[3],
                            const mr_st_tensor *const scales[3], mr_err *e) {
  if (!t || !t[0] || !t[1] || !t[2])
    return mr_err_set(e, MR_EINVAL, "kn_layer_load_expert_st: three tensors are required");
  if (!scales || !scales[0])
    return kn_layer_load_expert(L, expert, t[0]->data, t[1]->data, t[2]->data, t[0]->dtype, e);
  if (!L) return mr_err_set(e, MR_EINVAL, "kn_layer_load_expert_st: layer is required");
  return st_fp8_run(L, expert, t, scales, false, e);
}

bool kn_layer_has_expert(const kn_layer *L, uint32_t expert) { return kn__layer_owns(L, expert); }

bool kn_layer_can_borrow(const kn_layer *L, mr_dtype src) {
  return L && src != MR_DTYPE_UNSPECIFIED && src == kn__format_dtype(L->d.format) &&
         L->n_slices == 1 && !L->numa_place && L->slice_len[0] == L->d.inter;
}

int kn_layer_borrow_expert(kn_layer *L, uint32_t expert, const void *gate, const void *up,
                           const void *down, mr_dtype src, mr_err *e) {
  if (!L || !gate || !up || !down)
    return mr_err_set(e, MR_EINVAL, "kn_layer_borrow_expert: layer, gate, up and down are required");
  if (expert >= L->d.num_experts)
    return mr_err_set(e, MR_ERANGE, "expert = %u, must be below num_experts = %u", expert,
                      L->d.num_experts);
  if (!kn_layer_can_borrow(L, src))
    return mr_err_set(e, MR_ENOTSUP, "expert %u: a %s layer on %u slice(s) cannot serve %s "
                      "weights in place (the format must store them as they are, on one slice)",
                      expert, kn_format_name(L->d.format), L->n_slices, mr_dtype_name(src));
  const void *srcs[3] = {gate, up, down};
  for (int p = 0; p < 3; p++)
    if ((uintptr_t)srcs[p] % mr_dtype_size(src))
      return mr_err_set(e, MR_ENOTSUP, "expert %u %s at %p is not %zu-byte aligned: cannot be "
                        "served in place", expert, proj_names[p], srcs[p], mr_dtype_size(src));
  load_job j = {.L = L, .src = {gate, up, down}, .dt = src, .check_only = true,
                .bad = {.set = false}};
  return load_run(&j, expert, e);
}

bool kn_layer_can_borrow_fp8(const kn_layer *L) {
  return L && L->d.format == KN_FMT_FP8 && L->n_slices == 1 && !L->numa_place &&
         L->slice_len[0] == L->d.inter;
}

int kn_layer_borrow_expert_fp8(kn_layer *L, uint32_t expert, const uint8_t *gate,
                               const float *gate_scale, const uint8_t *up, const float *up_scale,
                               const uint8_t *down, const float *down_scale, mr_err *e) {
  if (!L || !gate || !up || !down || !gate_scale || !up_scale || !down_scale)
    return mr_err_set(e, MR_EINVAL, "kn_layer_borrow_expert_fp8: layer, gate, up, down and "
                      "their scales are required");
  if (expert < L->d.num_experts && !kn_layer_can_borrow_fp8(L))
    return mr_err_set(e, MR_ENOTSUP, "expert %u: a %s layer on %u slice(s) cannot serve fp8 "
                      "weights in place (it must be fp8-b128, on one slice)", expert,
                      kn_format_name(L->d.format), L->n_slices);
  return fp8_run(L, expert, gate, gate_scale, up, up_scale, down, down_scale, true, e);
}

int kn_layer_borrow_expert_st(kn_layer *L, uint32_t expert, const mr_st_tensor *const t[3],
                              const mr_st_tensor *const scales[3], mr_err *e) {
  if (!t || !t[0] || !t[1] || !t[2])
    return mr_err_set(e, MR_EINVAL, "kn_layer_borrow_expert_st: three tensors are required");
  if (scales && scales[0]) { /* F8_E4M3 with block scales: the codes in place */
    if (!kn_layer_can_borrow_fp8(L))
      return mr_err_set(e, MR_ENOTSUP, "expert %u: \"%.200s\" is fp8: served in place only by "
                        "an fp8-b128 layer on one slice", expert, t[0]->name);
    return st_fp8_run(L, expert, t, scales, true, e);
  }
  for (int p = 1; p < 3; p++)
    if (t[p]->dtype != t[0]->dtype)
      return mr_err_set(e, MR_ENOTSUP, "expert %u: \"%.200s\" is %s and \"%.200s\" %s: not "
                        "served in place", expert, t[0]->name, t[0]->dtype_name, t[p]->name,
                        t[p]->dtype_name);
  return kn_layer_borrow_expert(L, expert, t[0]->data, t[1]->data, t[2]->data, t[0]->dtype, e);
}

int kn_layer_take_expert_st(kn_layer *L, uint32_t expert, const mr_st_tensor *const t[3],
                            const mr_st_tensor *const scales[3], bool in_place, bool *borrowed,
                            mr_err *e) {
  *borrowed = false;
  if (in_place) {
    int rc = kn_layer_borrow_expert_st(L, expert, t, scales, e);
    if (rc != MR_ENOTSUP) {
      *borrowed = rc == 0;
      return rc;
    }
    mr_err_clear(e); /* the reason it cannot is no error: packed instead */
  }
  return kn_layer_load_expert_st(L, expert, t, scales, e);
}

/* ---- packed-weight cache (kn.h) ---------------------------------------------------- */

uint32_t kn_layer_slices(const kn_layer *L) { return L->n_slices; }
uint32_t kn_layer_slice_off(const kn_layer *L, uint32_t s) { return s < L->n_slices ? L->slice_off[s] : 0; }
uint32_t kn_layer_slice_len(const kn_layer *L, uint32_t s) { return s < L->n_slices ? L->slice_len[s] : 0; }
uint64_t kn_layer_slice_bytes(const kn_layer *L, uint32_t s) {
  return s < L->n_slices && L->slice_len[s] ? slice_layout_of(L, s).total : 0;
}

const void *kn_layer_expert_slice(const kn_layer *L, uint32_t expert, uint32_t s) {
  if (!kn__layer_owns(L, expert) || s >= L->n_slices || L->w[expert][s].in_place) return NULL;
  return L->w[expert][s].mem;
}

int kn_layer_adopt_expert(kn_layer *L, uint32_t expert, void *const *mem, mr_err *e) {
  if (!L || !mem) return mr_err_set(e, MR_EINVAL, "kn_layer_adopt_expert: layer and mem are required");
  if (expert >= L->d.num_experts)
    return mr_err_set(e, MR_ERANGE, "expert = %u, must be below num_experts = %u", expert,
                      L->d.num_experts);
  for (uint32_t s = 0; s < L->n_slices; s++)
    if (L->slice_len[s] && (!mem[s] || ((uintptr_t)mem[s] & (KN_PACK_ALIGN - 1))))
      return mr_err_set(e, MR_EINVAL, "expert %u slice %u: block %p is not %u-byte aligned", expert,
                        s, mem[s], KN_PACK_ALIGN);
  kn__slice_w *w = mr_calloc(L->n_slices, sizeof *w);
  if (!w) return mr_err_set(e, MR_ENOMEM, "expert %u: out of memory", expert);
  const bool scaled = L->d.format == KN_FMT_INT8 || L->d.format == KN_FMT_INT4 || L->d.format == KN_FMT_FP8;
  for (uint32_t s = 0; s < L->n_slices; s++) {
    w[s].borrowed = true;
    if (!L->slice_len[s]) continue;
    const slice_layout lay = slice_layout_of(L, s);
    char *m = mem[s];
    w[s].mem = m;
    w[s].mem_bytes = lay.total;
    w[s].gate = m + lay.gate;
    w[s].up = m + lay.up;
    w[s].down = m + lay.down;
    w[s].gate_scale = scaled ? (float *)(m + lay.gate_scale) : NULL;
    w[s].up_scale = scaled ? (float *)(m + lay.up_scale) : NULL;
    w[s].down_scale = scaled ? (float *)(m + lay.down_scale) : NULL;
  }
  expert_install(L, expert, w, L->expert_bytes);
  return 0;
}

/* kn_engine_populate: 2 MiB pieces of each region, claimed by the workers of its group. */
#define KN__POPULATE_PIECE ((uint64_t)2 << 20)
typedef struct populate_job {
  const char *base[KN_MAX_NODES];
  uint64_t bytes[KN_MAX_NODES];
  _Atomic uint64_t done;
  kn__work work;
} populate_job;

static void populate_fn(void *arg, const kn__pool_ctx *c) {
  populate_job *j = arg;
  uint32_t g, item;
  uint64_t done = 0;
  const long page = sysconf(_SC_PAGESIZE);
  while (kn__work_claim(&j->work, c, &g, &item)) {
    const uint64_t off = (uint64_t)item * KN__POPULATE_PIECE;
    const uint64_t n = j->bytes[g] - off < KN__POPULATE_PIECE ? j->bytes[g] - off : KN__POPULATE_PIECE;
    const char *p = j->base[g] + off;
    bool ok = false;
#ifdef MADV_POPULATE_READ
    /* The base is page-aligned (an mmap) and pieces are multiples of a page. */
    ok = madvise((void *)p, n, MADV_POPULATE_READ) == 0;
#endif
    if (!ok) {
      volatile char sink = 0;
      for (uint64_t k = 0; k < n; k += (uint64_t)page) sink ^= p[k];
      (void)sink;
    }
    done += n;
  }
  atomic_fetch_add_explicit(&j->done, done, memory_order_relaxed);
}

uint64_t kn_engine_populate(kn_engine *eng, const void *const *base, const uint64_t *bytes,
                            uint32_t n_regions) {
  MR_ASSERT(eng && n_regions <= eng->n_nodes);
  populate_job *j = mr_calloc(1, sizeof *j);
  if (!j) return 0;
  uint32_t counts[KN_MAX_NODES] = {0};
  for (uint32_t s = 0; s < eng->n_nodes; s++) {
    if (s >= n_regions || !base[s] || !bytes[s]) continue;
    j->base[s] = base[s];
    j->bytes[s] = bytes[s];
    counts[s] = (uint32_t)((bytes[s] + KN__POPULATE_PIECE - 1) / KN__POPULATE_PIECE);
  }
  kn__work_init(&j->work, eng->n_nodes, counts);
  kn__pool_run(eng->pool, populate_fn, j);
  uint64_t done = atomic_load(&j->done);
  mr_free(j);
  return done;
}
const kn_layer_desc *kn_layer_get_desc(const kn_layer *L) { return &L->d; }
uint64_t kn_layer_bytes(const kn_layer *L) { return L->bytes; }
uint64_t kn_layer_expert_bytes(const kn_layer *L) { return L->expert_bytes; }

/* ---- forward ----------------------------------------------------------------------- */

int kn__moe_validate(const kn_layer *L, const kn_moe_args *a, mr_err *e) {
  if (!L || !a) return mr_err_set(e, MR_EINVAL, "kn_moe_forward: layer and args are required");
  if (a->n_tokens == 0) return 0;
  if (a->top_k < 1 || a->top_k > KN_MAX_TOP_K)
    return mr_err_set(e, MR_EINVAL, "top_k = %u, must be in 1..%u", a->top_k, KN_MAX_TOP_K);
  if (a->x_dtype != MR_DTYPE_F32 && a->x_dtype != MR_DTYPE_F16 && a->x_dtype != MR_DTYPE_BF16)
    return mr_err_set(e, MR_EINVAL, "x_dtype = %d, must be f32, f16 or bf16", (int)a->x_dtype);
  if (!a->ids || !a->weights || !a->x || !a->out)
    return mr_err_set(e, MR_EINVAL, "kn_moe_forward: ids, weights, x and out are required");
  const uint32_t E = L->d.num_experts, k = a->top_k;
  for (uint32_t t = 0; t < a->n_tokens; t++)
    for (uint32_t j = 0; j < k; j++) {
      int32_t id = a->ids[(size_t)t * k + j];
      if (id == -1) continue;
      if (id < -1 || (uint32_t)id >= E)
        return mr_err_set(e, MR_ERANGE,
                          "expert_ids[token %u, slot %u] = %d, must be -1 (empty) or in 0..%u",
                          t, j, id, E - 1);
      if (!kn__layer_owns(L, (uint32_t)id))
        return mr_err_set(e, MR_EPRECOND, "expert %d (token %u, slot %u) is not held here", id, t, j);
      /* A NaN or inf routing weight would turn the token's whole output row into NaN; the
       * router never produces one, so it is a broken or hostile peer. */
      float w = a->weights[(size_t)t * k + j];
      if (!isfinite(w))
        return mr_err_set(e, MR_EINVAL, "weights[token %u, slot %u] = %g, must be finite", t, j,
                          (double)w);
    }
  return 0;
}

#define ARENA_ALLOC(var, count)                                                              \
  do {                                                                                       \
    (var) = mr_arena_alloc(ar, (size_t)(count) * sizeof *(var) + 1, KN_PACK_ALIGN);          \
    if (!(var)) {                                                                            \
      rc = mr_err_set(e, MR_ENOMEM, "kn_moe_forward: out of scratch memory (%s, %zu bytes)", \
                      #var, (size_t)(count) * sizeof *(var));                                \
      goto out_reset;                                                                        \
    }                                                                                        \
  } while (0)

/* fwd_job.xg_off of an expert whose kernel packs the caller's rows in place (prep_rows). */
#define KN__NO_XG SIZE_MAX

/* One kn_moe_forward on the engine's workers. Filled by the caller before kn__pool_run and
 * read-only during the run, except the work lists and the rows each item owns. Sorted
 * position p (0 .. pairs-1) is a non-empty (token, slot) pair in expert order: the pairs
 * of expert x are start[x] .. start[x+1]-1, in token order. */
typedef struct fwd_job {
  const kn_layer *L;
  const kn__kernel *kern;
  const kn_moe_args *a;
  uint32_t H;
  const uint32_t *used;       /* experts with at least one pair, ascending (w_in's items) */
  const uint32_t *start;      /* [E + 1] */
  const uint32_t *tok;        /* [pairs]: token of sorted pair p */
  const uint32_t *pos;        /* [T * k]: sorted position of pair (t, slot); -1 slots unused */
  float *xg;                  /* fp32 inputs of the experts whose kernel reads them */
  const size_t *xg_off;       /* [n_used]: their rows in xg (floats); KN__NO_XG: read in place */
  unsigned char *xq;          /* prepared inputs (kern->prep), expert used[u] at xq_off[u] */
  const size_t *xq_off;       /* [w_in's items] */
  float *h[KN_MAX_NODES];     /* [pairs, I_s]: intermediate of slice s */
  float *y[KN_MAX_NODES];     /* [pairs, H]: output of slice s (NULL: empty slice) */
  float *tmp;                 /* [n_workers][tmp_stride]: kernel scratch per worker */
  size_t tmp_stride;
  uint32_t gu_rows[KN_MAX_NODES], gu_nb[KN_MAX_NODES]; /* gate_up: rows per item, items per expert */
  uint32_t dn_rows[KN_MAX_NODES], dn_nb[KN_MAX_NODES]; /* down: the same over H */
  uint32_t cb, n_cb;          /* combine: columns per item, items per token */
  kn__work w_in, w_gu, w_dn, w_out;
} fwd_job;

/* Rows per work item for a step of `rows` output rows per expert over n_used experts and
 * `workers` workers: about four items per worker, so that dynamic claiming evens out
 * experts of different token counts, cut at multiples of KN_SLICE_ALIGN rows (SIMD kernels
 * step by whole 32-row blocks). One worker takes whole experts. */
static uint32_t block_rows(uint32_t rows, uint32_t n_used, uint32_t workers) {
  if (rows == 0) return 1;
  if (workers <= 1) return rows;
  const uint64_t per = (4ull * workers + n_used - 1) / n_used; /* items per expert */
  uint64_t bs = (rows + per - 1) / per;
  bs = (bs + KN_SLICE_ALIGN - 1) / KN_SLICE_ALIGN * KN_SLICE_ALIGN;
  return bs > rows ? rows : (uint32_t)bs;
}

static kn__task fwd_task(const fwd_job *j, uint32_t s, uint32_t u, float *tmp) {
  const uint32_t x = j->used[u], p0 = j->start[x], H = j->H;
  return (kn__task){.L = j->L,
                    .slice = s,
                    .w = &j->L->w[x][s],
                    .n = j->start[x + 1] - p0,
                    .x = j->xg_off[u] == KN__NO_XG ? NULL : j->xg + j->xg_off[u],
                    .xq = j->xq ? j->xq + j->xq_off[u] : NULL,
                    .h = j->h[s] + (size_t)p0 * j->L->slice_len[s],
                    .y = j->y[s] + (size_t)p0 * H,
                    .tmp = tmp};
}

/* Four floats, unaligned: the combine's vectors (two SSE registers per 8 on plain x86-64,
 * NEON elsewhere). A multiply and an add per element, never fused: kn.c is built for the
 * baseline ISA, which has no FMA, so the bits are those of kn_ref's scalar loop. */
typedef float kn__v4 __attribute__((vector_size(16), aligned(4), may_alias));

/* o[c] += w * y[c] for c < n. */
static void axpy(float *restrict o, const float *restrict y, float w, uint32_t n) {
  uint32_t c = 0;
  for (; c + 8 <= n; c += 8) {
    *(kn__v4 *)(o + c) += w * *(const kn__v4 *)(y + c);
    *(kn__v4 *)(o + c + 4) += w * *(const kn__v4 *)(y + c + 4);
  }
  for (; c < n; c++) o[c] += w * y[c];
}

/* o[c] += w * (ys[0][c] + ys[1][c] + .. + ys[ns - 1][c]), the slices added in order. */
static void axpy_sum(float *restrict o, const float *const *ys, uint32_t ns, float w, uint32_t n) {
  uint32_t c = 0;
  for (; c + 4 <= n; c += 4) {
    kn__v4 acc = *(const kn__v4 *)(ys[0] + c);
    for (uint32_t q = 1; q < ns; q++) acc += *(const kn__v4 *)(ys[q] + c);
    *(kn__v4 *)(o + c) += w * acc;
  }
  for (; c < n; c++) {
    float acc = ys[0][c];
    for (uint32_t q = 1; q < ns; q++) acc += ys[q][c];
    o[c] += w * acc;
  }
}

/* out[t, c0..c1) = sum over the non-empty slots of t, in slot order, of w * (sum over the
 * slices, in slice order, of y_s): the fp32 reduction across nodes, in the same order of
 * additions as kn_ref_moe_forward, so that the result depends neither on the thread count
 * nor on which worker computed what. Vectors change no bit: each lane is one column's own
 * sequence of the same operations. */
static void fwd_combine(const fwd_job *j, uint32_t t, uint32_t c0, uint32_t c1) {
  const kn_moe_args *a = j->a;
  const uint32_t H = j->H, k = a->top_k, S = j->L->n_slices, n = c1 - c0;
  float *o = a->out + (size_t)t * H + c0;
  memset(o, 0, (size_t)n * sizeof(float));
  for (uint32_t slot = 0; slot < k; slot++) {
    const size_t pi = (size_t)t * k + slot;
    if (a->ids[pi] < 0) continue;
    const float w = a->weights[pi];
    const size_t off = (size_t)j->pos[pi] * H + c0;
    const float *ys[KN_MAX_NODES];
    uint32_t ns = 0;
    for (uint32_t s = 0; s < S; s++)
      if (j->y[s]) ys[ns++] = j->y[s] + off;
    if (ns == 1)
      axpy(o, ys[0], w, n);
    else
      axpy_sum(o, ys, ns, w, n);
  }
}

/* The body every worker runs: four phases separated by barriers, each a work list. */
static void fwd_fn(void *arg, const kn__pool_ctx *c) {
  fwd_job *j = arg;
  const kn_layer *L = j->L;
  const kn_moe_args *a = j->a;
  const uint32_t H = j->H;
  const size_t esz = mr_dtype_size(a->x_dtype);
  float *tmp = j->tmp + (size_t)c->worker * j->tmp_stride;
  uint32_t s, it;

  /* 1. Prepare the input rows of each used expert: from where the caller keeps them, or
   * gathered (and converted) to fp32 first where the kernel reads fp32. */
  while (kn__work_claim(&j->w_in, c, &s, &it)) {
    const uint32_t x = j->used[it], p0 = j->start[x], n = j->start[x + 1] - p0;
    if (j->xg_off[it] == KN__NO_XG) {
      const kn__rows rows = {.base = a->x, .stride = (size_t)H * esz, .tok = j->tok + p0, .dt = a->x_dtype};
      j->kern->prep_rows(L, n, &rows, j->xq + j->xq_off[it]);
      continue;
    }
    float *xg = j->xg + j->xg_off[it];
    for (uint32_t r = 0; r < n; r++)
      mr_convert_to_f32(xg + (size_t)r * H, (const char *)a->x + (size_t)j->tok[p0 + r] * H * esz,
                        a->x_dtype, H);
    if (j->kern->prep) j->kern->prep(L, n, xg, j->xq + j->xq_off[it]);
  }
  kn__pool_barrier(c);

  /* 2. gate_up: (expert, row block of I_s) items of slice s, by the workers of node s. */
  while (kn__work_claim(&j->w_gu, c, &s, &it)) {
    const uint32_t u = it / j->gu_nb[s], b = it % j->gu_nb[s], Is = L->slice_len[s];
    const uint32_t i0 = b * j->gu_rows[s], i1 = i0 + j->gu_rows[s] < Is ? i0 + j->gu_rows[s] : Is;
    const kn__task task = fwd_task(j, s, u, tmp);
    j->kern->gate_up(&task, i0, i1);
  }
  kn__pool_barrier(c); /* down reads all of h */

  /* 3. down: (expert, row block of H) items of slice s. */
  while (kn__work_claim(&j->w_dn, c, &s, &it)) {
    const uint32_t u = it / j->dn_nb[s], b = it % j->dn_nb[s];
    const uint32_t r0 = b * j->dn_rows[s], r1 = r0 + j->dn_rows[s] < H ? r0 + j->dn_rows[s] : H;
    const kn__task task = fwd_task(j, s, u, tmp);
    j->kern->down(&task, r0, r1);
  }
  kn__pool_barrier(c);

  /* 4. Reduction across slices and slots into out, by (token, column block). */
  while (kn__work_claim(&j->w_out, c, &s, &it)) {
    const uint32_t t = it / j->n_cb, c0 = (it % j->n_cb) * j->cb;
    fwd_combine(j, t, c0, c0 + j->cb < H ? c0 + j->cb : H);
  }
}

int kn_moe_forward(kn_engine *eng, const kn_layer *L, const kn_moe_args *a, mr_arena *scratch,
                   mr_err *e) {
  if (!eng) return mr_err_set(e, MR_EINVAL, "kn_moe_forward: engine is required");
  int rc = kn__moe_validate(L, a, e);
  if (rc) return rc;
  const uint32_t T = a->n_tokens, k = a->top_k, H = L->d.hidden, E = L->d.num_experts;
  if (T == 0) return 0;
  if (L->n_slices != eng->n_nodes)
    return mr_err_set(e, MR_EINVAL,
                      "kn_moe_forward: the layer has %u slices per expert, this engine %u nodes "
                      "(use the engine that created the layer, or one with the same split)",
                      L->n_slices, eng->n_nodes);
  const kn__plan *plan = &eng->plan;
  const uint32_t nw = plan->n_workers, S = L->n_slices;
  mr_arena *ar = scratch ? scratch : &eng->scratch;
  const size_t slots = (size_t)T * k;
  fwd_job j = {.L = L, .kern = eng->kern[L->d.format], .a = a, .H = H};

  /* Counting sort of the non-empty (token, slot) pairs by expert. */
  uint32_t *start, *cur, *tok, *pos, *used;
  ARENA_ALLOC(start, (size_t)E + 1);
  ARENA_ALLOC(cur, E);
  ARENA_ALLOC(pos, slots);
  memset(start, 0, ((size_t)E + 1) * sizeof *start);
  for (size_t p = 0; p < slots; p++)
    if (a->ids[p] >= 0) start[a->ids[p] + 1]++;
  uint32_t max_n = 0, n_used = 0;
  for (uint32_t x = 0; x < E; x++) {
    if (start[x + 1] > max_n) max_n = start[x + 1];
    n_used += start[x + 1] > 0;
    start[x + 1] += start[x];
  }
  const uint32_t pairs = start[E];
  if (pairs == 0) { /* every slot empty: out is zero */
    memset(a->out, 0, (size_t)T * H * sizeof(float));
    goto out_reset;
  }
  ARENA_ALLOC(tok, pairs);
  ARENA_ALLOC(used, n_used);
  memcpy(cur, start, (size_t)E * sizeof *cur);
  for (size_t p = 0; p < slots; p++) {
    const int32_t id = a->ids[p];
    if (id < 0) continue;
    const uint32_t at = cur[id]++;
    tok[at] = (uint32_t)(p / k);
    pos[p] = at;
  }
  for (uint32_t x = 0, u = 0; x < E; x++)
    if (start[x + 1] > start[x]) used[u++] = x;
  j.used = used;
  j.start = start;
  j.tok = tok;
  j.pos = pos;

  /* Buffers: fp32 inputs where the kernel reads them, prepared inputs, h and y per slice,
   * kernel scratch per worker. In all: at most pairs * (H + I + S * H) floats + prep
   * bytes + nw * tmp floats. */
  size_t *xg_off, xg_rows = 0;
  ARENA_ALLOC(xg_off, n_used);
  for (uint32_t u = 0; u < n_used; u++) {
    const uint32_t n = start[used[u] + 1] - start[used[u]];
    if (j.kern->prep && j.kern->prep_rows && j.kern->takes_rows(L, n)) {
      xg_off[u] = KN__NO_XG;
    } else {
      xg_off[u] = xg_rows * H;
      xg_rows += n;
    }
  }
  j.xg_off = xg_off;
  if (xg_rows) ARENA_ALLOC(j.xg, xg_rows * H);
  if (j.kern->prep) {
    size_t *xq_off, total = 0;
    ARENA_ALLOC(xq_off, n_used);
    for (uint32_t u = 0; u < n_used; u++) {
      xq_off[u] = total;
      const size_t b = j.kern->prep_bytes(L, start[used[u] + 1] - start[used[u]]);
      total += (b + KN_PACK_ALIGN - 1) & ~(size_t)(KN_PACK_ALIGN - 1);
    }
    j.xq_off = xq_off;
    ARENA_ALLOC(j.xq, total);
  }
  size_t tmp_n = 0;
  for (uint32_t s = 0; s < S; s++) {
    if (L->slice_len[s] == 0) continue;
    ARENA_ALLOC(j.h[s], (size_t)pairs * L->slice_len[s]);
    ARENA_ALLOC(j.y[s], (size_t)pairs * H);
    const size_t t = j.kern->tmp_floats(L, s, max_n);
    if (t > tmp_n) tmp_n = t;
  }
  j.tmp_stride = (tmp_n + 15) & ~(size_t)15; /* whole cache lines per worker */
  ARENA_ALLOC(j.tmp, j.tmp_stride * nw);

  /* Work lists. Per-slice phases are per group; the others are one shared list. */
  uint32_t gu[KN_MAX_NODES], dn[KN_MAX_NODES], one;
  for (uint32_t s = 0; s < S; s++) {
    const uint32_t Is = L->slice_len[s];
    /* Stealing plans (forced splits) share all workers among the groups. */
    const uint32_t ws = plan->steal ? nw : plan->group_first[s + 1] - plan->group_first[s];
    j.gu_rows[s] = block_rows(Is, n_used, ws);
    j.gu_nb[s] = Is ? (Is + j.gu_rows[s] - 1) / j.gu_rows[s] : 0;
    j.dn_rows[s] = block_rows(H, n_used, ws);
    j.dn_nb[s] = Is ? (H + j.dn_rows[s] - 1) / j.dn_rows[s] : 0;
    gu[s] = j.gu_nb[s] * n_used;
    dn[s] = j.dn_nb[s] * n_used;
  }
  kn__work_init(&j.w_gu, S, gu);
  kn__work_init(&j.w_dn, S, dn);
  kn__work_init(&j.w_in, 1, &n_used);
  /* The reduction: whole rows when there are enough tokens, else column blocks of >= 64. */
  uint32_t per_tok = nw <= 1 ? 1 : (4 * nw + T - 1) / T;
  if (per_tok > (H + 63) / 64) per_tok = (H + 63) / 64;
  j.cb = (H + per_tok - 1) / per_tok;
  j.cb = (j.cb + 15) & ~15u;
  j.n_cb = (H + j.cb - 1) / j.cb;
  one = T * j.n_cb;
  kn__work_init(&j.w_out, 1, &one);

  kn__pool_run(eng->pool, fwd_fn, &j);

out_reset:
  if (!scratch) mr_arena_reset(&eng->scratch);
  return rc;
}

double kn_rel_l2(const float *y, const float *ref, size_t n) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < n; i++) {
    double d = (double)y[i] - (double)ref[i];
    num += d * d;
    den += (double)ref[i] * ref[i];
  }
  if (den == 0.0) return num == 0.0 ? 0.0 : INFINITY;
  return sqrt(num / den);
}
