/*
 * pool.c - the host topology (hwloc), the worker plan (--numa, --threads, force_split),
 * the worker pool (pinned threads, dynamic work lists, spin-then-sleep waiting) and the
 * NUMA placement of weight slices (libnuma). The contracts are in internal.h section D.
 *
 * Waiting, everywhere in this file, is "spin for spin_ns, then sleep on a futex": a worker
 * that just finished a phase usually finds the next one within microseconds, while an idle
 * engine must not keep cores busy on a host that also runs the gRPC threads (kt-kernel's
 * workers spin for 50 ms, which is a full core per worker whenever requests pause). Every
 * futex word comes with a count of sleepers so that the waker pays for the wake system
 * call only when someone sleeps; the sleeper announces itself (seq_cst) before it
 * re-checks the word, and the waker changes the word (seq_cst) before it reads the count,
 * so that at least one of the two sees the other (the futex itself re-checks the word in
 * the kernel, closing the window between the check and the sleep).
 *
 * All shared words are plain integers accessed through the __atomic builtins (which TSan
 * understands); the futex calls carry no ordering of their own.
 */
#define _GNU_SOURCE /* sched_getaffinity, CPU_*, pthread_setaffinity_np, pthread_setname_np */
#include "kernels/internal.h"

#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <linux/futex.h>

#if MR_HAVE_NUMA
#include <numa.h>
#include <numaif.h>
#endif

/* ---- futex and spinning ------------------------------------------------------------ */

static void futex_wait(uint32_t *word, uint32_t old) {
  /* EINTR and EAGAIN (the word already changed) both mean "look again"; callers loop. */
  syscall(SYS_futex, word, FUTEX_WAIT_PRIVATE, old, NULL, NULL, 0);
}

static void futex_wake_all(uint32_t *word) {
  syscall(SYS_futex, word, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ volatile("yield" ::: "memory");
#else
  __asm__ volatile("" ::: "memory");
#endif
}

static inline uint32_t ld(const uint32_t *p) { return __atomic_load_n(p, __ATOMIC_SEQ_CST); }

/* Spins until *word != old or spin_ns have passed: pause for the first half (a core that
 * is ours anyway), sched_yield for the second (hands the core to whoever is runnable when
 * there are more threads than cores). Returns the last value read. */
static uint32_t spin_while_eq(const uint32_t *word, uint32_t old, uint64_t spin_ns) {
  uint32_t v = ld(word);
  if (v != old || spin_ns == 0) return v;
  const uint64_t t0 = mr_now_ns();
  for (;;) {
    for (int i = 0; i < 32; i++) {
      cpu_relax();
      if ((v = ld(word)) != old) return v;
    }
    uint64_t dt = mr_now_ns() - t0;
    if (dt >= spin_ns) return v;
    if (dt >= spin_ns / 2) sched_yield();
  }
}

/* Waits until *word != old: spins, then sleeps (counted in *sleepers and *sleeps).
 * Returns the new value. Wakers: change *word, then futex_wake_all if *sleepers. */
static uint32_t wait_while_eq(uint32_t *word, uint32_t old, uint32_t *sleepers, uint64_t *sleeps,
                              uint64_t spin_ns) {
  uint32_t v = spin_while_eq(word, old, spin_ns);
  if (v != old) return v;
  __atomic_add_fetch(sleepers, 1, __ATOMIC_SEQ_CST);
  __atomic_add_fetch(sleeps, 1, __ATOMIC_RELAXED);
  while ((v = ld(word)) == old) futex_wait(word, old);
  __atomic_sub_fetch(sleepers, 1, __ATOMIC_SEQ_CST);
  return v;
}

static void wake_if_sleepers(uint32_t *word, const uint32_t *sleepers) {
  if (ld(sleepers) != 0) futex_wake_all(word);
}

/* ---- topology ---------------------------------------------------------------------- */

void kn__topo_close(kn__topo *t) {
  if (!t) return;
  mr_free(t->core_pu0);
  mr_free(t->pu);
#if MR_HAVE_HWLOC
  if (t->hw) hwloc_topology_destroy((hwloc_topology_t)t->hw);
#endif
  memset(t, 0, sizeof *t);
}

static int topo_alloc(kn__topo *t, uint32_t max_pus, mr_err *e) {
  t->core_pu0 = mr_calloc((size_t)max_pus + 1, sizeof *t->core_pu0);
  t->pu = mr_calloc(max_pus ? max_pus : 1, sizeof *t->pu);
  if (!t->core_pu0 || !t->pu) {
    kn__topo_close(t);
    return mr_err_set(e, MR_ENOMEM, "kn topology: out of memory for %u CPUs", max_pus);
  }
  return 0;
}

/* One node (OS number 0) whose cores are the CPUs this thread may run on (or, when the
 * affinity cannot be read, the online CPUs 0..n-1). */
static int topo_from_affinity(kn__topo *t, mr_err *e) {
  memset(t, 0, sizeof *t);
  cpu_set_t set;
  CPU_ZERO(&set);
  bool have_set = sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0;
  long online = sysconf(_SC_NPROCESSORS_ONLN);
  uint32_t n = have_set ? (uint32_t)CPU_COUNT(&set) : online > 0 ? (uint32_t)online : 1u;
  int rc = topo_alloc(t, n, e);
  if (rc) return rc;
  for (uint32_t cpu = 0, i = 0; i < n; cpu++)
    if (!have_set || CPU_ISSET(cpu, &set)) t->pu[i++] = cpu;
  t->n_pus = t->n_cores = n;
  for (uint32_t c = 0; c <= n; c++) t->core_pu0[c] = c;
  t->n_nodes = 1;
  t->node_os[0] = 0;
  t->node_core0[0] = 0;
  t->node_core0[1] = n;
  return 0;
}

#if MR_HAVE_HWLOC
static int cmp_node_os(const void *a, const void *b) {
  unsigned x = (*(hwloc_obj_t const *)a)->os_index, y = (*(hwloc_obj_t const *)b)->os_index;
  return x < y ? -1 : x > y;
}

int kn__topo_read(kn__topo *t, hwloc_topology_t topo, hwloc_const_cpuset_t allowed, mr_err *e) {
  memset(t, 0, sizeof *t);
  int n_numa = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_NUMANODE);
  int n_pu = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_PU);
  if (n_numa <= 0 || n_pu <= 0) return topo_from_affinity(t, e);
  int rc = topo_alloc(t, (uint32_t)n_pu, e);
  if (rc) return rc;
  hwloc_obj_t *nodes = mr_calloc((size_t)n_numa, sizeof *nodes);
  hwloc_bitmap_t taken = hwloc_bitmap_alloc();
  if (!nodes || !taken) {
    rc = mr_err_set(e, MR_ENOMEM, "kn topology: out of memory for %d NUMA nodes", n_numa);
    goto out_free;
  }
  for (int i = 0; i < n_numa; i++) nodes[i] = hwloc_get_obj_by_type(topo, HWLOC_OBJ_NUMANODE, (unsigned)i);
  qsort(nodes, (size_t)n_numa, sizeof *nodes, cmp_node_os);

  for (int i = 0; i < n_numa; i++) {
    hwloc_obj_t nd = nodes[i];
    const uint32_t core0 = t->n_cores, pu0 = t->n_pus;
    hwloc_obj_t prev_core = NULL, pu = NULL;
    if (nd->cpuset)
      while ((pu = hwloc_get_next_obj_inside_cpuset_by_type(topo, nd->cpuset, HWLOC_OBJ_PU, pu))) {
        if (allowed && !hwloc_bitmap_isset(allowed, pu->os_index)) continue;
        if (hwloc_bitmap_isset(taken, pu->os_index)) continue; /* a PU under two nodes */
        if (t->n_pus == (uint32_t)n_pu) break;
        hwloc_bitmap_set(taken, pu->os_index);
        /* PUs come in logical order, so the PUs of one core are consecutive. */
        hwloc_obj_t core = hwloc_get_ancestor_obj_by_type(topo, HWLOC_OBJ_CORE, pu);
        if (!core) core = pu;
        if (core != prev_core || t->n_cores == core0) t->core_pu0[t->n_cores++] = t->n_pus;
        prev_core = core;
        t->pu[t->n_pus++] = pu->os_index;
      }
    if (t->n_cores == core0) { /* no allowed core: memory only */
      if (t->n_memonly < KN_MAX_NODES) t->memonly_os[t->n_memonly] = nd->os_index;
      t->n_memonly++;
      continue;
    }
    if (t->n_nodes == KN_MAX_NODES) { /* keep the arrays consistent: forget this node */
      t->n_cores = core0;
      t->n_pus = pu0;
      t->n_dropped++;
      continue;
    }
    t->node_os[t->n_nodes] = nd->os_index;
    t->node_core0[t->n_nodes] = core0;
    t->n_nodes++;
  }
  t->node_core0[t->n_nodes] = t->n_cores;
  t->core_pu0[t->n_cores] = t->n_pus;
  t->from_hwloc = true;
  if (t->n_nodes == 0) {
    /* Nothing allowed matched a node (an odd affinity): fall back rather than refuse. */
    mr_free(nodes);
    hwloc_bitmap_free(taken);
    kn__topo_close(t);
    return topo_from_affinity(t, e);
  }
  rc = 0;
out_free:
  mr_free(nodes);
  if (taken) hwloc_bitmap_free(taken);
  if (rc) kn__topo_close(t);
  return rc;
}
#endif

int kn__topo_host(kn__topo *t, mr_err *e) {
  memset(t, 0, sizeof *t);
#if MR_HAVE_HWLOC
  hwloc_topology_t topo;
  if (hwloc_topology_init(&topo) == 0) {
    if (hwloc_topology_load(topo) == 0) {
      /* Honour the CPUs this process was given (taskset, cgroup cpuset): hwloc already
       * drops those the cgroup forbids; the affinity mask may be narrower. The process's
       * mask is the union over its threads, so that an engine made from a pinned thread
       * (or after another engine pinned its workers) still sees every allowed core. */
      hwloc_bitmap_t allowed = hwloc_bitmap_alloc();
      if (allowed && hwloc_get_cpubind(topo, allowed, HWLOC_CPUBIND_PROCESS) != 0 &&
          hwloc_get_cpubind(topo, allowed, HWLOC_CPUBIND_THREAD) != 0) {
        hwloc_bitmap_free(allowed);
        allowed = NULL;
      }
      int rc = kn__topo_read(t, topo, allowed, e);
      if (allowed) hwloc_bitmap_free(allowed);
      if (rc) {
        hwloc_topology_destroy(topo);
        return rc;
      }
      t->hw = topo;
      return 0;
    }
    hwloc_topology_destroy(topo);
  }
  mr_log(MR_LOG_WARN, "kn: hwloc could not read the topology; using one NUMA node, unpinned cores");
#endif
  return topo_from_affinity(t, e);
}

/* ---- the plan ---------------------------------------------------------------------- */

void kn__plan_close(kn__plan *p) {
  if (!p) return;
  mr_free(p->w);
  memset(p, 0, sizeof *p);
}

static int topo_find_node(const kn__topo *t, unsigned long os) {
  for (uint32_t i = 0; i < t->n_nodes; i++)
    if (t->node_os[i] == os) return (int)i;
  return -1;
}

/* Writes the nodes list of t into buf ("0,1,3"), for messages. */
static void topo_nodes_str(const kn__topo *t, char *buf, size_t len) {
  size_t o = 0;
  buf[0] = '\0';
  for (uint32_t i = 0; i < t->n_nodes && o + 12 < len; i++)
    o += (size_t)snprintf(buf + o, len - o, "%s%u", i ? "," : "", t->node_os[i]);
}

/* Parses the --numa spec into indices of t's nodes. */
static int parse_numa(const kn__topo *t, const char *spec, uint32_t *use, uint32_t *n_use, mr_err *e) {
  char have[256];
  topo_nodes_str(t, have, sizeof have);
  if (!spec || spec[0] == '\0' || strcmp(spec, "auto") == 0) {
    for (uint32_t i = 0; i < t->n_nodes; i++) use[i] = i;
    *n_use = t->n_nodes;
    return 0;
  }
  if (strlen(spec) > 200)
    return mr_err_set(e, MR_EINVAL, "numa = \"%.40s...\": longer than 200 characters", spec);
  if (!strchr(spec, ',')) { /* a count: the first N nodes */
    char *end;
    errno = 0;
    unsigned long n = strtoul(spec, &end, 10);
    if (end != spec && *end == '\0' && errno == 0 && spec[0] != '-' && spec[0] != '+') {
      if (n < 1 || n > t->n_nodes) {
        if (n > 1 && !t->from_hwloc)
          return mr_err_set(e, MR_ENOTSUP,
                            "numa = \"%s\": this build or host gives no NUMA topology (no hwloc); "
                            "node count must be 1",
                            spec);
        return mr_err_set(e, MR_EINVAL,
                          "numa = \"%s\": node count must be in 1..%u (NUMA nodes with CPUs on "
                          "this host: %s)",
                          spec, t->n_nodes, have);
      }
      for (uint32_t i = 0; i < n; i++) use[i] = i;
      *n_use = (uint32_t)n;
      return 0;
    }
  }
  /* A list "0,1" (a lone "3" was taken as a count above; "3," is node 3 alone). */
  uint32_t n = 0;
  const char *p = spec;
  while (*p) {
    char *end;
    errno = 0;
    unsigned long id = strtoul(p, &end, 10);
    if (end == p || errno != 0 || *p == '-' || *p == '+' || (*end != ',' && *end != '\0'))
      return mr_err_set(e, MR_EINVAL,
                        "numa = \"%s\": expected \"auto\", a node count like \"2\" or a node "
                        "list like \"0,1\"",
                        spec);
    int idx = topo_find_node(t, id);
    if (idx < 0) {
      for (uint32_t i = 0; i < t->n_memonly && i < KN_MAX_NODES; i++)
        if (t->memonly_os[i] == id)
          return mr_err_set(e, MR_ENOTSUP,
                            "numa = \"%s\": node %lu has no CPU this process may use (memory-only "
                            "or outside its cpuset); every node used needs workers (nodes with "
                            "CPUs: %s)",
                            spec, id, have);
      if (!t->from_hwloc)
        return mr_err_set(e, MR_ENOTSUP,
                          "numa = \"%s\": this build or host gives no NUMA topology (no hwloc); "
                          "only node 0 exists",
                          spec);
      return mr_err_set(e, MR_EINVAL, "numa = \"%s\": node %lu is not on this host (nodes with CPUs: %s)",
                        spec, id, have);
    }
    for (uint32_t i = 0; i < n; i++)
      if (use[i] == (uint32_t)idx)
        return mr_err_set(e, MR_EINVAL, "numa = \"%s\": node %lu listed twice", spec, id);
    use[n++] = (uint32_t)idx; /* n <= t->n_nodes <= KN_MAX_NODES: no duplicates */
    p = *end == ',' ? end + 1 : end;
  }
  if (n == 0) return mr_err_set(e, MR_EINVAL, "numa = \"%s\": empty node list", spec);
  *n_use = n;
  return 0;
}

int kn__plan_make(kn__plan *p, const kn__topo *t, const char *numa, uint32_t threads,
                  uint32_t force_split, mr_err *e) {
  memset(p, 0, sizeof *p);
  MR_ASSERT(t->n_nodes >= 1 && t->n_cores >= 1);
  if (force_split > KN_MAX_NODES)
    return mr_err_set(e, MR_EINVAL, "force_split = %u, must be in 0..%u", force_split, KN_MAX_NODES);
  if (threads > KN_MAX_THREADS)
    return mr_err_set(e, MR_EINVAL, "threads = %u, must be in 0..%u (0 = one per core)", threads,
                      KN_MAX_THREADS);
  uint32_t use[KN_MAX_NODES], n_use = 0;
  int rc = parse_numa(t, numa, use, &n_use, e);
  if (rc) return rc;

  /* Groups, and the topology node each one runs on. */
  uint32_t gnode[KN_MAX_NODES];
  p->forced = force_split > 0;
  p->n_groups = p->forced ? force_split : n_use;
  p->n_real_nodes = p->forced ? 1 : n_use;
  for (uint32_t g = 0; g < p->n_groups; g++) {
    gnode[g] = p->forced ? use[0] : use[g];
    p->group_node[g] = t->node_os[gnode[g]];
  }
  uint32_t cores = 0;
  for (uint32_t i = 0; i < p->n_real_nodes; i++)
    cores += t->node_core0[use[i] + 1] - t->node_core0[use[i]];
  uint32_t n = threads ? threads : cores;
  if (!p->forced && n < p->n_groups)
    return mr_err_set(e, MR_EINVAL,
                      "threads = %u: fewer than the %u NUMA nodes in use (numa = \"%s\"); give "
                      "at least one thread per node, or fewer nodes",
                      threads, p->n_groups, numa ? numa : "auto");
  p->n_workers = n;
  p->steal = p->forced;
  p->w = mr_calloc(n, sizeof *p->w);
  if (!p->w) return mr_err_set(e, MR_ENOMEM, "kn plan: out of memory for %u workers", n);

  /* Deal the workers out: group g gets base (+1 for the first rem groups). */
  const uint32_t base = n / p->n_groups, rem = n % p->n_groups;
  uint32_t wi = 0;
  for (uint32_t g = 0; g < p->n_groups; g++) {
    p->group_first[g] = wi;
    const uint32_t k = base + (g < rem ? 1u : 0u);
    for (uint32_t j = 0; j < k; j++) p->w[wi++] = (kn__worker_spec){.group = g, .node = gnode[g]};
  }
  p->group_first[p->n_groups] = wi;
  MR_ASSERT(wi == n);

  /* Cores: the i-th worker on a node (in worker order, the caller first) takes the node's
   * i-th core; a node with more workers than cores lets all of them float over it. The
   * caller is never pinned, but keeps "its" core free of pool threads. */
  for (uint32_t i = 0; i < p->n_real_nodes; i++) {
    const uint32_t nd = use[i], c0 = t->node_core0[nd], nc = t->node_core0[nd + 1] - c0;
    uint32_t on_node = 0;
    for (uint32_t w = 0; w < n; w++) on_node += p->w[w].node == nd;
    for (uint32_t w = 0, k = 0; w < n; w++) {
      if (p->w[w].node != nd) continue;
      p->w[w].core = on_node <= nc ? c0 + k : KN__CORE_NODE;
      k++;
    }
  }
  return 0;
}

/* ---- the pool ---------------------------------------------------------------------- */

typedef struct pool_thread {
  kn__pool *pool;
  uint32_t worker;      /* 1..n-1 */
  uint32_t group;
  const uint32_t *pus;  /* the PUs to pin to (into the topology; read at start only) */
  uint32_t n_pus;
  int pin_err;          /* 0, or the errno of the failed pin */
  pthread_t th;
  bool started;
} pool_thread;

struct kn__pool {
  uint32_t n;                /* workers, the caller included */
  uint32_t group0;           /* the caller's group */
  bool steal;                /* plan.steal */
  uint64_t spin_ns;
  pool_thread *th;           /* [n]; th[0] unused (the caller) */
  void *hw;                  /* hwloc topology, only during kn__pool_new */
  pthread_mutex_t run_lock;  /* serialises kn__pool_run callers; held for the whole run */
  kn__pool_fn fn;            /* the current run's function and argument: written by the */
  void *arg;                 /* caller under run_lock before it bumps epoch */
  uint64_t runs;             /* under run_lock */

  /* Dispatch: the caller bumps epoch to start a run (or to stop); workers wait on it. */
  _Alignas(64) uint32_t epoch;
  uint32_t epoch_sleepers;
  uint32_t stop;             /* set before the final epoch bump */
  /* Completion: workers still in the current run; the caller waits for 0. */
  _Alignas(64) uint32_t remaining;
  uint32_t done_sleepers;
  /* Barrier: arrivals still expected, and the generation the waiters sleep on. */
  _Alignas(64) uint32_t bar_count;
  uint32_t bar_gen;
  uint32_t bar_sleepers;
  _Alignas(64) uint64_t sleeps; /* statistics, relaxed */
  uint32_t pinned;
};

/* Pins the calling thread to the given PUs. Returns 0 or an errno. */
static int pin_self(void *hw, const uint32_t *pus, uint32_t n_pus) {
  if (n_pus == 0) return EINVAL;
#if MR_HAVE_HWLOC
  if (hw) {
    hwloc_bitmap_t set = hwloc_bitmap_alloc();
    if (!set) return ENOMEM;
    for (uint32_t i = 0; i < n_pus; i++) hwloc_bitmap_set(set, pus[i]);
    errno = 0;
    int rc = hwloc_set_cpubind((hwloc_topology_t)hw, set, HWLOC_CPUBIND_THREAD | HWLOC_CPUBIND_STRICT);
    int err = errno ? errno : EINVAL;
    hwloc_bitmap_free(set);
    return rc == 0 ? 0 : err;
  }
#endif
  cpu_set_t set;
  CPU_ZERO(&set);
  for (uint32_t i = 0; i < n_pus; i++)
    if (pus[i] < CPU_SETSIZE) CPU_SET(pus[i], &set);
  return pthread_setaffinity_np(pthread_self(), sizeof set, &set);
}

int kn__pin_caller(const kn__plan *plan, const kn__topo *t) {
  const kn__worker_spec *ws = &plan->w[0];
  uint32_t c0 = ws->core, c1 = ws->core + 1;
  if (ws->core == KN__CORE_NODE) {
    c0 = t->node_core0[ws->node];
    c1 = t->node_core0[ws->node + 1];
  }
  return pin_self(t->hw, t->pu + t->core_pu0[c0], t->core_pu0[c1] - t->core_pu0[c0]);
}

static void *pool_main(void *arg) {
  pool_thread *me = arg;
  kn__pool *p = me->pool;
  char name[16];
  snprintf(name, sizeof name, "kn-w%u-g%u", me->worker, me->group);
  pthread_setname_np(pthread_self(), name);
  me->pin_err = pin_self(p->hw, me->pus, me->n_pus);
  if (me->pin_err == 0) __atomic_add_fetch(&p->pinned, 1, __ATOMIC_RELAXED);
  /* Start-up is a run of its own: the creator waits for remaining to reach 0. */
  uint32_t seen = ld(&p->epoch);
  if (__atomic_sub_fetch(&p->remaining, 1, __ATOMIC_SEQ_CST) == 0) wake_if_sleepers(&p->remaining, &p->done_sleepers);
  const kn__pool_ctx ctx = {.pool = p, .worker = me->worker, .group = me->group};
  for (;;) {
    seen = wait_while_eq(&p->epoch, seen, &p->epoch_sleepers, &p->sleeps, p->spin_ns);
    if (ld(&p->stop)) break;
    p->fn(p->arg, &ctx);
    if (__atomic_sub_fetch(&p->remaining, 1, __ATOMIC_SEQ_CST) == 0)
      wake_if_sleepers(&p->remaining, &p->done_sleepers);
  }
  return NULL;
}

/* The caller's wait for the end of a run: until remaining is 0, with one spin budget. */
static void wait_done(kn__pool *p) {
  uint32_t v = ld(&p->remaining);
  const uint64_t t0 = mr_now_ns();
  while (v != 0) {
    uint64_t dt = mr_now_ns() - t0;
    if (dt < p->spin_ns) {
      v = spin_while_eq(&p->remaining, v, p->spin_ns - dt);
      continue;
    }
    __atomic_add_fetch(&p->done_sleepers, 1, __ATOMIC_SEQ_CST);
    __atomic_add_fetch(&p->sleeps, 1, __ATOMIC_RELAXED);
    while ((v = ld(&p->remaining)) != 0) futex_wait(&p->remaining, v);
    __atomic_sub_fetch(&p->done_sleepers, 1, __ATOMIC_SEQ_CST);
  }
}

/* Stops and joins the started threads; frees p. */
static void pool_destroy(kn__pool *p) {
  pthread_mutex_lock(&p->run_lock);
  __atomic_store_n(&p->stop, 1, __ATOMIC_SEQ_CST);
  __atomic_add_fetch(&p->epoch, 1, __ATOMIC_SEQ_CST);
  futex_wake_all(&p->epoch);
  pthread_mutex_unlock(&p->run_lock);
  for (uint32_t w = 1; w < p->n; w++)
    if (p->th[w].started) pthread_join(p->th[w].th, NULL);
  pthread_mutex_destroy(&p->run_lock);
  mr_free(p->th);
  mr_free_aligned(p);
}

int kn__pool_new(kn__pool **out, const kn__plan *plan, const kn__topo *t, uint32_t spin_us,
                 mr_err *e) {
  *out = NULL;
  MR_ASSERT(plan->n_workers >= 1);
  kn__pool *p = mr_malloc_aligned(sizeof *p, 64);
  if (!p) return mr_err_set(e, MR_ENOMEM, "kn pool: out of memory");
  memset(p, 0, sizeof *p);
  p->n = plan->n_workers;
  p->group0 = plan->w[0].group;
  p->steal = plan->steal;
  p->spin_ns = (uint64_t)spin_us * 1000u;
  p->hw = t->hw;
  p->bar_count = p->n;
  p->th = mr_calloc(p->n, sizeof *p->th);
  if (!p->th) {
    mr_free_aligned(p);
    return mr_err_set(e, MR_ENOMEM, "kn pool: out of memory for %u workers", plan->n_workers);
  }
  pthread_mutex_init(&p->run_lock, NULL);

  /* Threads start with every asynchronous signal blocked: signals belong to the server's
   * own loop, and a worker interrupted in a kernel would only delay the request. The
   * synchronous fault signals stay open: the kernel delivers them to the faulting thread
   * anyway, and a blocked one is delivered with its handler reset to the default, which
   * would bypass a crash reporter, a sanitizer, or a test's SIGILL trap. */
  sigset_t all, old;
  sigfillset(&all);
  static const int faults[] = {SIGILL, SIGSEGV, SIGBUS, SIGFPE, SIGTRAP, SIGSYS};
  for (size_t i = 0; i < sizeof faults / sizeof faults[0]; i++) sigdelset(&all, faults[i]);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  int rc = 0;
  p->remaining = p->n - 1;
  for (uint32_t w = 1; w < p->n; w++) {
    pool_thread *pt = &p->th[w];
    const kn__worker_spec *ws = &plan->w[w];
    uint32_t c0, c1;
    if (ws->core == KN__CORE_NODE) {
      c0 = t->node_core0[ws->node];
      c1 = t->node_core0[ws->node + 1];
    } else {
      c0 = ws->core;
      c1 = ws->core + 1;
    }
    *pt = (pool_thread){.pool = p, .worker = w, .group = ws->group, .pus = t->pu + t->core_pu0[c0],
                        .n_pus = t->core_pu0[c1] - t->core_pu0[c0]};
    int err = pthread_create(&pt->th, NULL, pool_main, pt);
    if (err) {
      /* The threads not started will never count down: take them off. */
      __atomic_sub_fetch(&p->remaining, p->n - w, __ATOMIC_SEQ_CST);
      rc = mr_err_set(e, MR_EEXHAUSTED, "threads = %u: could not start worker thread %u: %s",
                      p->n, w, strerror(err));
      break;
    }
    pt->started = true;
  }
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  wait_done(p); /* every started thread has tried to pin itself */
  p->hw = NULL;
  if (rc) {
    pool_destroy(p);
    return rc;
  }
  if (p->pinned + 1 < p->n) {
    int err = 0;
    for (uint32_t w = 1; w < p->n && !err; w++) err = p->th[w].pin_err;
    mr_log(MR_LOG_WARN,
           "kn pool: could not pin %u of %u worker threads to their cores (%s); they run "
           "unpinned (containers often forbid pinning; NUMA locality then rests on the OS)",
           p->n - 1 - p->pinned, p->n - 1, strerror(err));
  }
  *out = p;
  return 0;
}

void kn__pool_free(kn__pool *p) {
  if (!p) return;
  pool_destroy(p);
}

uint32_t kn__pool_size(const kn__pool *p) { return p->n; }

void kn__pool_run(kn__pool *p, kn__pool_fn fn, void *arg) {
  pthread_mutex_lock(&p->run_lock);
  const kn__pool_ctx c0 = {.pool = p, .worker = 0, .group = p->group0};
  p->runs++;
  if (p->n == 1) {
    fn(arg, &c0);
    pthread_mutex_unlock(&p->run_lock);
    return;
  }
  p->fn = fn;
  p->arg = arg;
  __atomic_store_n(&p->remaining, p->n - 1, __ATOMIC_SEQ_CST);
  __atomic_add_fetch(&p->epoch, 1, __ATOMIC_SEQ_CST);
  wake_if_sleepers(&p->epoch, &p->epoch_sleepers);
  fn(arg, &c0);
  wait_done(p);
  pthread_mutex_unlock(&p->run_lock);
}

void kn__pool_barrier(const kn__pool_ctx *c) {
  kn__pool *p = c->pool;
  if (p->n == 1) return;
  const uint32_t gen = ld(&p->bar_gen);
  if (__atomic_sub_fetch(&p->bar_count, 1, __ATOMIC_SEQ_CST) == 0) {
    /* Last to arrive: re-arm for the next barrier before releasing anyone into it. */
    __atomic_store_n(&p->bar_count, p->n, __ATOMIC_SEQ_CST);
    __atomic_add_fetch(&p->bar_gen, 1, __ATOMIC_SEQ_CST);
    wake_if_sleepers(&p->bar_gen, &p->bar_sleepers);
    return;
  }
  wait_while_eq(&p->bar_gen, gen, &p->bar_sleepers, &p->sleeps, p->spin_ns);
}

void kn__pool_get_stats(const kn__pool *p, kn__pool_stats *s) {
  kn__pool *q = (kn__pool *)p;
  pthread_mutex_lock(&q->run_lock);
  s->runs = q->runs;
  pthread_mutex_unlock(&q->run_lock);
  s->sleeps = __atomic_load_n(&q->sleeps, __ATOMIC_RELAXED);
  s->sleeping = ld(&q->epoch_sleepers);
  s->pinned = __atomic_load_n(&q->pinned, __ATOMIC_RELAXED);
}

/* ---- work lists -------------------------------------------------------------------- */

void kn__work_init(kn__work *w, uint32_t n_groups, const uint32_t *counts) {
  MR_ASSERT(n_groups >= 1 && n_groups <= KN_MAX_NODES);
  w->n_groups = n_groups;
  for (uint32_t g = 0; g < n_groups; g++) {
    w->count[g] = counts[g];
    w->ctr[g].next = 0;
  }
}

bool kn__work_claim(kn__work *w, const kn__pool_ctx *c, uint32_t *group, uint32_t *item) {
  const uint32_t G = w->n_groups;
  const uint32_t g0 = G == 1 ? 0 : c->group % G;
  const uint32_t tries = G == 1 || !c->pool->steal ? 1 : G;
  for (uint32_t k = 0; k < tries; k++) {
    const uint32_t g = (g0 + k) % G;
    /* Look before taking, so that exhausted lists are not hammered by late workers. */
    if (__atomic_load_n(&w->ctr[g].next, __ATOMIC_RELAXED) >= w->count[g]) continue;
    const uint32_t i = __atomic_fetch_add(&w->ctr[g].next, 1, __ATOMIC_RELAXED);
    if (i < w->count[g]) {
      *group = g;
      *item = i;
      return true;
    }
  }
  return false;
}

/* ---- NUMA placement ---------------------------------------------------------------- */

#define KN__NODEMASK_BITS 1024u

void *kn__mem_map_on_node(size_t bytes, uint32_t node, size_t *mapped) {
  *mapped = 0;
  const size_t pg = (size_t)sysconf(_SC_PAGESIZE);
  const size_t len = bytes ? (bytes + pg - 1) / pg * pg : pg;
  void *p;
  if (len >= KN__HUGE_BYTES) {
    /* Over-map by 2 MiB and give back the ends, so that the mapping starts on a huge-page
     * boundary (the kernel aligns only some anonymous mappings itself). */
    char *raw = mmap(NULL, len + KN__HUGE_BYTES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) return NULL;
    const uintptr_t a = ((uintptr_t)raw + KN__HUGE_BYTES - 1) & ~(uintptr_t)(KN__HUGE_BYTES - 1);
    const size_t head = a - (uintptr_t)raw, tail = KN__HUGE_BYTES - head;
    if (head) munmap(raw, head);
    if (tail) munmap((char *)a + len, tail);
    p = (void *)a;
  } else {
    p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return NULL;
  }
  *mapped = len;
#ifdef MADV_HUGEPAGE
  /* Weights are read in long streams: fewer TLB misses, and 512 times fewer page faults
   * while loading, where THP is in "madvise" mode. */
  (void)madvise(p, *mapped, MADV_HUGEPAGE);
#endif
#if MR_HAVE_NUMA
  if (node != KN__NO_NODE && node < KN__NODEMASK_BITS) {
    unsigned long mask[KN__NODEMASK_BITS / (8 * sizeof(unsigned long))] = {0};
    mask[node / (8 * sizeof(unsigned long))] |= 1ul << (node % (8 * sizeof(unsigned long)));
    if (mbind(p, *mapped, MPOL_PREFERRED, mask, KN__NODEMASK_BITS + 1, 0) != 0)
      mr_log_ratelimited(MR_LOG_WARN, 1,
                         "kn: mbind(node %u) failed: %s; slice placement rests on first touch "
                         "by the node's pinned workers",
                         node, strerror(errno));
  }
#else
  (void)node;
#endif
  return p;
}

void kn__mem_unmap(void *p, size_t mapped) {
  if (p && mapped) munmap(p, mapped);
}

int kn__mem_node_of(const void *p) {
#if MR_HAVE_NUMA
  int node = -1;
  if (get_mempolicy(&node, NULL, 0, (void *)p, MPOL_F_NODE | MPOL_F_ADDR) != 0) return -1;
  return node;
#else
  (void)p;
  return -1;
#endif
}
