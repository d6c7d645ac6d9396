/*
 * gc_pending.c - the bottom of the client's call machinery: the pool of pendings (one per
 * layer call in flight, each with the arena that holds the call's buffers) and the
 * completion of one request. Nothing here knows streams, servers or the plan: gc_stream.c
 * completes requests from the I/O thread, gc_layer.c gets, waits on and releases pendings.
 *
 * Lifetime of a pending (refcounted, atomic; internal.h): the caller's reference, one per
 * request linked on a stream, one per payload slice gRPC holds. The last unref resets its
 * arena and returns it to the pool; once the cluster has closed the pool, it frees itself
 * instead, and the last one frees the pool (gRPC may drop a payload slice after the
 * cluster is gone, so the pool must outlive it).
 */
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "gpu_client/rpc/internal.h"

/* First block of a pending's arena; grows for large calls and keeps the largest block. */
#define GC__ARENA_BLOCK (1u << 20)

int gc__pool_new(gc_cluster *c, mr_err *e) {
  c->pool = mr_calloc(1, sizeof *c->pool);
  if (!c->pool) return mr_err_set(e, MR_ENOMEM, "pending pool: out of memory");
  pthread_mutex_init(&c->pool->lock, NULL);
  return 0;
}

static void pending_destroy(gc_pending *p) {
  mr_arena_close(&p->arena);
  pthread_mutex_destroy(&p->lock);
  pthread_cond_destroy(&p->cond);
  mr_free(p);
}

static void pool_destroy(gc__pool *pool) {
  pthread_mutex_destroy(&pool->lock);
  mr_free(pool);
}

gc_pending *gc__pending_get(gc_cluster *c, mr_err *e) {
  gc__pool *pool = c->pool;
  pthread_mutex_lock(&pool->lock);
  gc_pending *p = pool->free_list;
  if (p) pool->free_list = p->next_free;
  pool->live++;
  pthread_mutex_unlock(&pool->lock);
  if (!p) {
    p = mr_calloc(1, sizeof *p);
    if (!p) {
      pthread_mutex_lock(&pool->lock);
      pool->live--;
      pthread_mutex_unlock(&pool->lock);
      mr_err_set(e, MR_ENOMEM, "layer call: out of memory");
      return NULL;
    }
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC); /* deadlines are mr_now_ns based */
    pthread_cond_init(&p->cond, &ca);
    pthread_condattr_destroy(&ca);
    pthread_mutex_init(&p->lock, NULL);
    mr_arena_init(&p->arena, GC__ARENA_BLOCK);
    p->c = c;
    p->pool = pool;
  }
  p->next_free = NULL;
  p->n_reqs = p->n_done = p->cap_reqs = 0;
  p->failed = p->closed = false;
  atomic_store(&p->settled, false);
  p->reqs = NULL;
  p->excluded = NULL;
  p->misses = 0;
  p->part_out = NULL;
  p->local_rc = 0;
  p->t_last_reply_ns = p->local_ns = p->t_sent_ns = 0;
  mr_err_clear(&p->local_err);
  memset(&p->plan, 0, sizeof p->plan);
  atomic_store(&p->refs, 1);
  return p;
}

void gc__pending_unref(gc_pending *p) {
  int before = atomic_fetch_sub(&p->refs, 1);
  MR_ASSERT(before > 0);
  if (before != 1) return;
  gc__pool *pool = p->pool; /* never p->c: the cluster may be gone (internal.h) */
  mr_arena_reset(&p->arena);
  pthread_mutex_lock(&pool->lock);
  MR_ASSERT(pool->live > 0);
  pool->live--;
  bool closed = pool->closed, last = pool->live == 0;
  if (!closed) {
    p->next_free = pool->free_list;
    pool->free_list = p;
  }
  pthread_mutex_unlock(&pool->lock);
  if (closed) {
    pending_destroy(p);
    if (last) pool_destroy(pool);
  }
}

void gc__payload_release(void *pending) { gc__pending_unref(pending); }

void gc__pool_close(gc_cluster *c) {
  gc__pool *pool = c->pool;
  if (!pool) return;
  c->pool = NULL;
  pthread_mutex_lock(&pool->lock);
  gc_pending *p = pool->free_list;
  pool->free_list = NULL;
  pool->closed = true;
  bool last = pool->live == 0;
  pthread_mutex_unlock(&pool->lock);
  while (p) {
    gc_pending *next = p->next_free;
    pending_destroy(p);
    p = next;
  }
  if (last) pool_destroy(pool);
  else mr_log(MR_LOG_DEBUG, "close: pendings still referenced by gRPC; the pool goes with "
              "the last of them");
}

void gc__req_complete(gc__req *r, int rc, const mr_err *err, unsigned how) {
  gc_pending *p = r->p;
  pthread_mutex_lock(&p->lock);
  if (!p->closed && !r->done) {
    r->done = true;
    r->rc = rc;
    r->retry = rc != 0 && how != 0;
    r->avoid_server = rc != 0 && (how & (GC__DONE_BAD_REPLY | GC__DONE_REFUSED));
    r->miss = rc != 0 && (how & GC__DONE_MISS);
    r->t_done_ns = mr_now_ns();
    if (rc && err) r->err = *err;
    else if (rc) mr_err_set(&r->err, rc, "layer %u request %llu: %s", p->layer,
                            (unsigned long long)r->id, mr_strerror(rc));
    p->n_done++;
    if (rc) p->failed = true;
    else p->t_last_reply_ns = r->t_done_ns;
    if (rc || p->n_done == p->n_reqs) {
      atomic_store_explicit(&p->settled, true, memory_order_release);
      pthread_cond_broadcast(&p->cond);
    }
  }
  pthread_mutex_unlock(&p->lock);
}

