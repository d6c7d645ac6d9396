/*
 * bench_wake.c - moerpc-bench-wake: what waking a thread on another, idle CPU costs on this
 * host, after idle gaps like a layer call's (docs/deploy.md, "Host tuning").
 *
 *   moerpc-bench-wake [--gaps 50,300,3000] [--iters 1000] [--cpus A,B]
 *
 * A waiter thread pinned to CPU B sleeps on a futex; the waker, pinned to CPU A, sleeps for
 * the gap (so that both CPUs go idle, as between two layer calls), then bumps the word and
 * calls FUTEX_WAKE, and spins until the waiter has run. Per gap, the medians and p90s of
 * the wake call (the waker's cost) and of wake-to-run (the store before FUTEX_WAKE to the
 * waiter's first instruction after it). On a KVM guest whose idle vCPUs halt at once both
 * are VM exits; with the guest's halt polling covering the gap they are a few microseconds.
 * One JSON line per gap on stdout, with the CPU and the host's idle settings; a table on
 * stderr.
 */
#define _GNU_SOURCE /* CPU_*, pthread_setaffinity_np */
#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "common/mr.h"

#define MAX_GAPS 16

static uint32_t word;    /* bumped by the waker; the waiter sleeps on it (__atomic) */
static uint64_t ran_ns;  /* set by the waiter when it runs again (__atomic) */
static uint32_t stop;    /* (__atomic) */

static void pin(pthread_t t, int cpu) {
  cpu_set_t s;
  CPU_ZERO(&s);
  CPU_SET(cpu, &s);
  int err = pthread_setaffinity_np(t, sizeof s, &s);
  if (err)
    fprintf(stderr, "moerpc-bench-wake: cannot pin to CPU %d: %s (runs unpinned)\n", cpu, strerror(err));
}

static void *waiter(void *arg) {
  (void)arg;
  uint32_t seen = 0;
  for (;;) {
    uint32_t v;
    while ((v = __atomic_load_n(&word, __ATOMIC_ACQUIRE)) == seen)
      syscall(SYS_futex, &word, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
    __atomic_store_n(&ran_ns, mr_now_ns(), __ATOMIC_RELEASE);
    seen = v;
    if (__atomic_load_n(&stop, __ATOMIC_ACQUIRE)) return NULL;
  }
}

static int cmp_u64(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}

static double pct_us(uint64_t *v, uint32_t n, uint32_t p) {
  qsort(v, n, sizeof *v, cmp_u64);
  return (double)v[(uint64_t)(n - 1) * p / 100] / 1e3;
}

static bool parse_list(const char *s, uint32_t *out, uint32_t max, uint32_t *n, uint32_t lo, uint32_t hi) {
  *n = 0;
  while (*s) {
    char *end;
    errno = 0;
    unsigned long v = strtoul(s, &end, 10);
    if (end == s || errno || v < lo || v > hi || *n == max) return false;
    out[(*n)++] = (uint32_t)v;
    if (*end == ',') end++;
    else if (*end) return false;
    s = end;
  }
  return *n > 0;
}

static int usage(FILE *f, int rc) {
  fprintf(f,
          "usage: moerpc-bench-wake [--gaps LIST] [--iters N] [--cpus A,B]\n"
          "What waking a thread on another, idle CPU costs here: per idle gap, the FUTEX_WAKE\n"
          "call and wake-to-run (p50 / p90 over N wakes), JSON lines on stdout with the\n"
          "CPU and the host's cpuidle governor and guest_halt_poll_ns (docs/deploy.md,\n"
          "\"Host tuning\").\n"
          "  --gaps LIST   idle gaps before each wake, microseconds, 0..1000000, at most %d\n"
          "                (default 50,300,3000)\n"
          "  --iters N     wakes per gap, 10..100000 (default 1000)\n"
          "  --cpus A,B    the waker's and the waiter's CPUs (default the first two this\n"
          "                process may use)\n",
          MAX_GAPS);
  return rc;
}

int main(int argc, char **argv) {
  uint32_t gaps[MAX_GAPS] = {50, 300, 3000}, n_gaps = 3, iters = 1000, cpus[2];
  bool cpus_set = false;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    uint32_t n;
    if (strcmp(a, "--help") == 0) return usage(stdout, 0);
    if (!v) {
      fprintf(stderr, "moerpc-bench-wake: unknown option or missing value: %s\n", a);
      return usage(stderr, 2);
    }
    if (strcmp(a, "--gaps") == 0) {
      if (!parse_list(v, gaps, MAX_GAPS, &n_gaps, 0, 1000000)) {
        fprintf(stderr, "moerpc-bench-wake: --gaps = \"%s\": 1..%d microsecond values in 0..1000000\n",
                v, MAX_GAPS);
        return 2;
      }
    } else if (strcmp(a, "--iters") == 0) {
      if (!parse_list(v, &iters, 1, &n, 10, 100000)) {
        fprintf(stderr, "moerpc-bench-wake: --iters = \"%s\": must be 10..100000\n", v);
        return 2;
      }
    } else if (strcmp(a, "--cpus") == 0) {
      if (!parse_list(v, cpus, 2, &n, 0, CPU_SETSIZE - 1) || n != 2 || cpus[0] == cpus[1]) {
        fprintf(stderr, "moerpc-bench-wake: --cpus = \"%s\": two different CPU numbers A,B\n", v);
        return 2;
      }
      cpus_set = true;
    } else {
      fprintf(stderr, "moerpc-bench-wake: unknown option %s\n", a);
      return usage(stderr, 2);
    }
    i++;
  }
  cpu_set_t mine;
  if (sched_getaffinity(0, sizeof mine, &mine) != 0) CPU_ZERO(&mine);
  if (!cpus_set) {
    uint32_t k = 0;
    for (int c = 0; c < CPU_SETSIZE && k < 2; c++)
      if (CPU_ISSET(c, &mine)) cpus[k++] = (uint32_t)c;
    if (k < 2) {
      fprintf(stderr, "moerpc-bench-wake: needs 2 CPUs, this process may use %u\n", k);
      return 1;
    }
  }
  mr_host h;
  mr_host_read(&h, NULL);
  uint64_t *call = malloc(iters * sizeof *call), *run = malloc(iters * sizeof *run);
  if (!call || !run) {
    fprintf(stderr, "moerpc-bench-wake: out of memory\n");
    return 1;
  }
  pthread_t t;
  int err = pthread_create(&t, NULL, waiter, NULL);
  if (err) {
    fprintf(stderr, "moerpc-bench-wake: cannot start the waiter: %s\n", strerror(err));
    return 1;
  }
  pin(t, (int)cpus[1]);
  pin(pthread_self(), (int)cpus[0]);
  fprintf(stderr, "%-8s %-12s %-12s %-12s %-12s   (us; cpu %s, cpuidle %s, guest_halt_poll_ns %lld)\n",
          "gap_us", "wake_p50", "wake_p90", "run_p50", "run_p90", h.cpu, h.idle_governor,
          (long long)h.halt_poll_ns);
  for (uint32_t g = 0; g < n_gaps; g++) {
    for (uint32_t i = 0; i < iters; i++) {
      if (gaps[g]) {
        struct timespec ts = {.tv_sec = gaps[g] / 1000000, .tv_nsec = (long)(gaps[g] % 1000000) * 1000};
        nanosleep(&ts, NULL);
      }
      __atomic_store_n(&ran_ns, 0, __ATOMIC_RELAXED);
      uint64_t t0 = mr_now_ns();
      __atomic_add_fetch(&word, 1, __ATOMIC_SEQ_CST);
      syscall(SYS_futex, &word, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
      uint64_t t1 = mr_now_ns(), r;
      while ((r = __atomic_load_n(&ran_ns, __ATOMIC_ACQUIRE)) == 0) sched_yield();
      call[i] = t1 - t0;
      run[i] = r > t0 ? r - t0 : 0;
    }
    double w50 = pct_us(call, iters, 50), w90 = pct_us(call, iters, 90);
    double r50 = pct_us(run, iters, 50), r90 = pct_us(run, iters, 90);
    fprintf(stderr, "%-8u %-12.1f %-12.1f %-12.1f %-12.1f\n", gaps[g], w50, w90, r50, r90);
    printf("{\"bench\":\"wake\",\"gap_us\":%u,\"iters\":%u,\"wake_call_p50_us\":%.2f,"
           "\"wake_call_p90_us\":%.2f,\"wake_to_run_p50_us\":%.2f,\"wake_to_run_p90_us\":%.2f,"
           "\"cpus\":[%u,%u],\"cpu\":\"%s\",\"cpuidle\":\"%s\",\"guest_halt_poll_ns\":%lld}\n",
           gaps[g], iters, w50, w90, r50, r90, cpus[0], cpus[1], h.cpu, h.idle_governor,
           (long long)h.halt_poll_ns);
    fflush(stdout);
  }
  __atomic_store_n(&stop, 1, __ATOMIC_RELEASE);
  __atomic_add_fetch(&word, 1, __ATOMIC_SEQ_CST);
  syscall(SYS_futex, &word, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
  pthread_join(t, NULL);
  free(call);
  free(run);
  return 0;
}
