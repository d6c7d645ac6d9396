/*
 * test_gc_comm.c - the CPU communicator (gpu_client/comm.h):
 *   all_reduce_sum over 2..5 ranks (threads) for sizes 0, 1, odd, and larger than one chunk
 *   per rank: every rank ends with the same bits, equal to the sum taken in rank order;
 *   many collectives in a row (no rank runs ahead into the next one's buffers);
 *   abort wakes a rank blocked in a collective with MR_ECANCELED, and later calls fail at
 *   once; a rank that reduces another size than rank 0 is an internal error on every rank;
 *   n_ranks outside 1..16 is refused naming the limit; one rank is a no-op.
 */
#include <pthread.h>
#include <string.h>
#include <time.h>

#include "gpu_client/runner/comm.h"
#include "tests/unit/mt.h"

#define MAX_N 1001u
#define ROUNDS 50u

typedef struct job {
  gc_comm *c;
  uint32_t rank;
  size_t n;        /* floats of each collective; (size_t)-1: rank-dependent (mismatch) */
  float buf[MAX_N];
  int rc;
  mr_err e;
} job;

static float val(uint32_t rank, size_t i, uint32_t round) {
  /* values whose sum depends on the order of the additions */
  return (float)((double)(i + 1) * 1e-3 * (rank + 1) + (rank % 2 ? 1e4 : -1e4) + round * 0.37);
}

static void *worker(void *arg) {
  job *j = arg;
  for (uint32_t round = 0; round < ROUNDS && !j->rc; round++) {
    for (size_t i = 0; i < j->n; i++) j->buf[i] = val(j->rank, i, round);
    j->rc = j->c->ops->all_reduce_sum(j->c, j->rank, NULL, j->buf, j->n, &j->e);
  }
  return NULL;
}

MT_TEST(sums_in_rank_order_identical_on_every_rank) {
  const size_t sizes[] = {0, 1, 7, 64, MAX_N};
  for (uint32_t G = 2; G <= 5; G++)
    for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
      gc_comm *c = NULL;
      mr_err e = {0};
      MT_OK(gc_comm_cpu_new(&c, G, &e), &e);
      MT_EQ_INT(c->n_ranks, G);
      static job jobs[5];
      pthread_t th[5];
      for (uint32_t r = 0; r < G; r++) {
        memset(&jobs[r], 0, sizeof jobs[r]);
        jobs[r] = (job){.c = c, .rank = r, .n = sizes[si]};
        MT_EQ_INT(pthread_create(&th[r], NULL, worker, &jobs[r]), 0);
      }
      for (uint32_t r = 0; r < G; r++) pthread_join(th[r], NULL);
      for (uint32_t r = 0; r < G; r++) MT_OK(jobs[r].rc, &jobs[r].e);
      /* the last round's sums, in rank order, bit for bit on every rank */
      for (size_t i = 0; i < sizes[si]; i++) {
        float s = val(0, i, ROUNDS - 1);
        for (uint32_t r = 1; r < G; r++) s += val(r, i, ROUNDS - 1);
        for (uint32_t r = 0; r < G; r++) MT_TRUE(memcmp(&jobs[r].buf[i], &s, sizeof s) == 0);
      }
      c->ops->destroy(c);
    }
}

static void *blocked(void *arg) {
  job *j = arg;
  j->rc = j->c->ops->all_reduce_sum(j->c, j->rank, NULL, j->buf, j->n, &j->e);
  return NULL;
}

MT_TEST(abort_wakes_a_blocked_rank_and_stays_aborted) {
  gc_comm *c = NULL;
  mr_err e = {0};
  MT_OK(gc_comm_cpu_new(&c, 3, &e), &e);
  static job j;
  j = (job){.c = c, .rank = 1, .n = 8};
  pthread_t th;
  MT_EQ_INT(pthread_create(&th, NULL, blocked, &j), 0);
  struct timespec ts = {0, 50 * 1000 * 1000};
  nanosleep(&ts, NULL); /* rank 1 waits for ranks 0 and 2, which never come */
  c->ops->abort(c);
  pthread_join(th, NULL);
  MT_EQ_INT(j.rc, MR_ECANCELED);
  MT_TRUE(strstr(j.e.msg, "aborted") != NULL);
  float x[4] = {0};
  MT_EQ_INT(c->ops->all_reduce_sum(c, 0, NULL, x, 4, &e), MR_ECANCELED);
  c->ops->destroy(c);
}

MT_TEST(ranks_out_of_step_fail_on_every_rank) {
  gc_comm *c = NULL;
  mr_err e = {0};
  MT_OK(gc_comm_cpu_new(&c, 2, &e), &e);
  static job a, b;
  a = (job){.c = c, .rank = 0, .n = 8};
  b = (job){.c = c, .rank = 1, .n = 9};
  pthread_t ta, tb;
  MT_EQ_INT(pthread_create(&ta, NULL, blocked, &a), 0);
  MT_EQ_INT(pthread_create(&tb, NULL, blocked, &b), 0);
  pthread_join(ta, NULL);
  pthread_join(tb, NULL);
  /* both see the mismatch before touching a buffer (the abort may reach one first) */
  MT_TRUE(a.rc == MR_EINTERNAL || a.rc == MR_ECANCELED);
  MT_TRUE(b.rc == MR_EINTERNAL || b.rc == MR_ECANCELED);
  MT_TRUE(a.rc == MR_EINTERNAL || b.rc == MR_EINTERNAL);
  const char *msg = b.rc == MR_EINTERNAL ? b.e.msg : a.e.msg;
  MT_TRUE(strstr(msg, "rank 1 reduces 9 floats, rank 0 8") ||
          strstr(msg, "rank 0 reduces 8 floats, rank 1 9"));
  c->ops->destroy(c);
}

MT_TEST(bad_rank_counts_are_refused_and_one_rank_is_a_no_op) {
  gc_comm *c = NULL;
  mr_err e = {0};
  MT_EQ_INT(gc_comm_cpu_new(&c, 0, &e), MR_EINVAL);
  MT_TRUE(strstr(e.msg, "n_ranks = 0, must be 1..16") != NULL);
  MT_EQ_INT(gc_comm_cpu_new(&c, 17, &e), MR_EINVAL);
  MT_TRUE(c == NULL);
  MT_OK(gc_comm_cpu_new(&c, 1, &e), &e);
  float x[3] = {1, 2, 3};
  MT_OK(c->ops->all_reduce_sum(c, 0, NULL, x, 3, &e), &e);
  MT_TRUE(x[0] == 1 && x[1] == 2 && x[2] == 3);
  MT_EQ_INT(c->ops->all_reduce_sum(c, 1, NULL, x, 3, &e), MR_ERANGE);
  c->ops->destroy(c);
}

MT_MAIN()
