/*
 * gc_comm_cpu.c - the CPU communicator (comm.h): the ranks are threads of this process and
 * their buffers host memory, so an all-reduce is two barriers around a shared-memory sum.
 *
 *   rank r posts its buffer       bufs[r] = dev
 *   barrier                       every buffer is posted (and written: the CPU backend's
 *                                 ops are synchronous)
 *   rank r sums chunk r           s = bufs[0][i] + bufs[1][i] + ... (rank order), and
 *                                 writes s into chunk r of every buffer: chunks are
 *                                 disjoint, so no two ranks touch the same float
 *   barrier                       every chunk is written before anyone reads its buffer
 *
 * Every rank ends with the same bits (one sum per element, in one order). The barrier is a
 * mutex and condition variable with a generation count; abort wakes every waiter.
 */
#include <pthread.h>
#include <string.h>

#include "gpu_client/runner/comm.h"

typedef struct cpu_comm {
  gc_comm base;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  uint32_t arrived;
  uint64_t gen;
  bool aborted;
  size_t ns[GC_COMM_MAX_RANKS];    /* floats each rank reduces in this collective */
  float *bufs[GC_COMM_MAX_RANKS];
} cpu_comm;

/* Waits for every rank; MR_ECANCELED once aborted. */
static int barrier(cpu_comm *c, mr_err *e) {
  pthread_mutex_lock(&c->mu);
  int rc = 0;
  if (c->aborted) {
    rc = MR_ECANCELED;
  } else if (++c->arrived == c->base.n_ranks) {
    c->arrived = 0;
    c->gen++;
    pthread_cond_broadcast(&c->cv);
  } else {
    const uint64_t gen = c->gen;
    while (c->gen == gen && !c->aborted) pthread_cond_wait(&c->cv, &c->mu);
    if (c->gen == gen) rc = MR_ECANCELED;
  }
  pthread_mutex_unlock(&c->mu);
  if (rc) return mr_err_set(e, rc, "comm cpu: aborted (another rank failed)");
  return 0;
}

static int cpu_all_reduce_sum(gc_comm *base, uint32_t rank, gc_backend *b, float *dev, size_t n,
                              mr_err *e) {
  cpu_comm *c = (cpu_comm *)base;
  const uint32_t G = base->n_ranks;
  if (rank >= G) return mr_err_set(e, MR_ERANGE, "comm cpu: rank %u of %u", rank, G);
  if (G == 1) return 0;
  pthread_mutex_lock(&c->mu);
  c->bufs[rank] = dev;
  c->ns[rank] = n;
  pthread_mutex_unlock(&c->mu);
  int rc = barrier(c, e);
  if (rc) return rc;
  /* Every rank checks every size, so that all of them agree to stop before anyone touches
   * a buffer shorter than its own n: a rank out of step is a bug in the caller. */
  for (uint32_t r = 0; r < G; r++)
    if (c->ns[r] != n) {
      base->ops->abort(base);
      return mr_err_set(e, MR_EINTERNAL, "comm cpu: rank %u reduces %zu floats, rank %u %zu",
                        rank, n, r, c->ns[r]);
    }
  const size_t lo = n * rank / G, hi = n * (rank + 1) / G;
  for (size_t i = lo; i < hi; i++) {
    float s = c->bufs[0][i];
    for (uint32_t r = 1; r < G; r++) s += c->bufs[r][i];
    for (uint32_t r = 0; r < G; r++) c->bufs[r][i] = s;
  }
  return barrier(c, e);
}

static void cpu_abort(gc_comm *base) {
  cpu_comm *c = (cpu_comm *)base;
  pthread_mutex_lock(&c->mu);
  c->aborted = true;
  pthread_cond_broadcast(&c->cv);
  pthread_mutex_unlock(&c->mu);
}

static void cpu_destroy(gc_comm *base) {
  cpu_comm *c = (cpu_comm *)base;
  if (!c) return;
  pthread_mutex_destroy(&c->mu);
  pthread_cond_destroy(&c->cv);
  mr_free(c);
}

static const gc_comm_ops cpu_comm_ops = {
    .name = "cpu",
    .all_reduce_sum = cpu_all_reduce_sum,
    .abort = cpu_abort,
    .destroy = cpu_destroy,
};

int gc_comm_cpu_new(gc_comm **out, uint32_t n_ranks, mr_err *e) {
  *out = NULL;
  if (n_ranks < 1 || n_ranks > GC_COMM_MAX_RANKS)
    return mr_err_set(e, MR_EINVAL, "comm cpu: n_ranks = %u, must be 1..%u", n_ranks,
                      GC_COMM_MAX_RANKS);
  cpu_comm *c = mr_calloc(1, sizeof *c);
  if (!c) return mr_err_set(e, MR_ENOMEM, "comm cpu: out of memory");
  c->base.ops = &cpu_comm_ops;
  c->base.n_ranks = n_ranks;
  pthread_mutex_init(&c->mu, NULL);
  pthread_cond_init(&c->cv, NULL);
  *out = &c->base;
  return 0;
}
