/*
 * es_pool.c - reusable request/reply buffers and job records.
 *
 * Every Forward request needs one buffer for its hidden rows, which is reused for the reply's
 * output rows (same size) and handed to gRPC by reference. Its lifetime therefore ends
 * whenever gRPC drops its last reference to the reply slice, on whatever thread that
 * happens; a per-thread arena cannot hold it. Buffers come in power-of-two size classes from
 * 4 KiB up, and a few of each class are kept for reuse, so steady traffic allocates nothing
 * (STYLE.md 6), and the pages of a reused buffer are already faulted in (the notes measured
 * ~300 page faults per 4 MiB message with fresh buffers).
 */
#include <string.h>

#include "expert_server/internal.h"

/* The header sits in the first cache line; data starts on the next one. */
#define ES_BUF_HDR 64u
/* Buffers kept per size class: cache_bytes / class size, within these bounds. */
#define ES_POOL_KEEP_MIN 2u
#define ES_POOL_KEEP_MAX 64u
/* Job records kept for reuse; more requests than this in flight at once are rare. */
#define ES_POOL_JOBS_MAX 1024u

int es__pool_init(es_pool *p, size_t max_bytes, size_t cache_bytes) {
  memset(p, 0, sizeof *p);
  p->cache_max = cache_bytes;
  if (pthread_mutex_init(&p->lock, NULL) != 0) return MR_ENOMEM;
  for (uint32_t c = 0; c < ES_POOL_CLASSES; c++) {
    size_t sz = ES_POOL_MIN << c;
    size_t keep = cache_bytes / sz;
    if (keep > ES_POOL_KEEP_MAX) keep = ES_POOL_KEEP_MAX;
    if (keep < ES_POOL_KEEP_MIN) keep = ES_POOL_KEEP_MIN;
    p->keep[c] = (uint32_t)keep;
    if (sz >= max_bytes) break;
  }
  atomic_init(&p->out_bufs, 0);
  atomic_init(&p->out_jobs, 0);
  return 0;
}

void es__pool_close(es_pool *p) {
  for (uint32_t c = 0; c < ES_POOL_CLASSES; c++) {
    es_buf *b = p->free[c];
    while (b) {
      es_buf *n = b->next;
      mr_free_aligned(b);
      b = n;
    }
    p->free[c] = NULL;
    p->nfree[c] = 0;
  }
  es_job *j = p->free_jobs;
  while (j) {
    es_job *n = j->next;
    mr_free(j);
    j = n;
  }
  p->free_jobs = NULL;
  long ob = atomic_load(&p->out_bufs), oj = atomic_load(&p->out_jobs);
  if (ob || oj)
    mr_log(MR_LOG_WARN, "pool: %ld buffers and %ld jobs still out at close (leaked on purpose)", ob,
           oj);
  pthread_mutex_destroy(&p->lock);
}

static uint32_t es__pool_class(size_t n) {
  uint32_t c = 0;
  while (c + 1 < ES_POOL_CLASSES && (ES_POOL_MIN << c) < n) c++;
  return c;
}

es_buf *es__buf_get(es_pool *p, size_t n) {
  uint32_t c = es__pool_class(n);
  size_t cap = ES_POOL_MIN << c;
  if (cap < n) return NULL; /* over 4 KiB << 31: never reached within max_tokens limits */
  es_buf *b = NULL;
  pthread_mutex_lock(&p->lock);
  if (p->free[c]) {
    b = p->free[c];
    p->free[c] = b->next;
    p->nfree[c]--;
    p->cached -= b->cap;
  }
  pthread_mutex_unlock(&p->lock);
  if (!b) {
    b = mr_malloc_aligned(ES_BUF_HDR + cap, 64);
    if (!b) return NULL;
    b->pool = p;
    b->cap = cap;
    b->cls = c;
    b->data = (uint8_t *)b + ES_BUF_HDR;
  }
  b->next = NULL;
  atomic_fetch_add(&p->out_bufs, 1);
  return b;
}

void es__buf_release(void *owner) {
  es_buf *b = owner;
  if (!b) return;
  es_pool *p = b->pool;
  atomic_fetch_sub(&p->out_bufs, 1);
  pthread_mutex_lock(&p->lock);
  /* Kept within both the class's count and the pool's total: after a burst of large
   * requests the pool holds at most cache_max bytes, the rest goes back to malloc. */
  if (p->nfree[b->cls] < p->keep[b->cls] && p->cached + b->cap <= p->cache_max) {
    b->next = p->free[b->cls];
    p->free[b->cls] = b;
    p->nfree[b->cls]++;
    p->cached += b->cap;
    b = NULL;
  }
  pthread_mutex_unlock(&p->lock);
  if (b) mr_free_aligned(b);
}

void es__pool_trim(es_pool *p, size_t keep_bytes) {
  es_buf *drop = NULL;
  pthread_mutex_lock(&p->lock);
  for (int c = ES_POOL_CLASSES - 1; c >= 0 && p->cached > keep_bytes; c--) {
    while (p->free[c] && p->cached > keep_bytes) {
      es_buf *b = p->free[c];
      p->free[c] = b->next;
      p->nfree[c]--;
      p->cached -= b->cap;
      b->next = drop;
      drop = b;
    }
  }
  pthread_mutex_unlock(&p->lock);
  while (drop) {
    es_buf *n = drop->next;
    mr_free_aligned(drop);
    drop = n;
  }
}

es_job *es__job_get(es_pool *p) {
  es_job *j = NULL;
  pthread_mutex_lock(&p->lock);
  if (p->free_jobs) {
    j = p->free_jobs;
    p->free_jobs = j->next;
    p->nfree_jobs--;
  }
  pthread_mutex_unlock(&p->lock);
  if (!j) j = mr_malloc(sizeof *j);
  if (!j) return NULL;
  memset(j, 0, sizeof *j);
  atomic_fetch_add(&p->out_jobs, 1);
  return j;
}

void es__job_put(es_pool *p, es_job *j) {
  if (!j) return;
  atomic_fetch_sub(&p->out_jobs, 1);
  pthread_mutex_lock(&p->lock);
  if (p->nfree_jobs < ES_POOL_JOBS_MAX) {
    j->next = p->free_jobs;
    p->free_jobs = j;
    p->nfree_jobs++;
    j = NULL;
  }
  pthread_mutex_unlock(&p->lock);
  mr_free(j);
}
