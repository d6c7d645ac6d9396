/*
 * gc_layer.c - one MoE layer call: submit (split, gather, queue, local part), wait
 * (deadline, first error, sum), and the pool of pendings whose arenas hold each call's
 * buffers.
 *
 * Buffers of one call, all from its pending's arena (reset when the pending returns to
 * the pool, so a steady stream of calls allocates nothing):
 *
 *   plan        rows / ids / weights of each part            (gc__plan_build)
 *   x_part[i]   the part's hidden rows in the wire dtype     sent by reference (zero copy)
 *   part_out[i] the part's output: wire dtype for a server   written by the I/O thread
 *               part, fp32 for the local part                 (gather from the reply slices)
 *   reqs        one gc__req per ForwardRequest
 *
 * The payload slices of x_part may outlive the call inside gRPC; each holds a reference
 * of the pending, so the arena is reset only after gRPC let go of them.
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include <grpc/byte_buffer.h>

#include "internal.h"

/* First block of a pending's arena; grows for large calls and keeps the largest block. */
#define GC__ARENA_BLOCK (1u << 20)

/* ---- the pool ---------------------------------------------------------------------------- */

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

static gc_pending *pending_get(gc_cluster *c, mr_err *e) {
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
  p->n_reqs = p->n_done = 0;
  p->failed = p->closed = false;
  p->reqs = NULL;
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

void gc__req_complete(gc__req *r, int rc, const mr_err *err) {
  gc_pending *p = r->p;
  pthread_mutex_lock(&p->lock);
  if (!p->closed && !r->done) {
    r->done = true;
    r->rc = rc;
    if (rc && err) r->err = *err;
    else if (rc) mr_err_set(&r->err, rc, "layer %u request %llu: %s", p->layer,
                            (unsigned long long)r->id, mr_strerror(rc));
    p->n_done++;
    if (rc) p->failed = true;
    else p->t_last_reply_ns = mr_now_ns();
    if (rc || p->n_done == p->n_reqs) pthread_cond_broadcast(&p->cond);
  }
  pthread_mutex_unlock(&p->lock);
}

/* ---- submit ------------------------------------------------------------------------------ */

static int req_validate(const gc_cluster *c, const gc_layer_req *q, mr_err *e) {
  if (!q) return mr_err_set(e, MR_EINVAL, "layer call: req is NULL");
  if (q->layer >= c->L)
    return mr_err_set(e, MR_ERANGE, "layer call: layer = %u, must be < num_layers %u", q->layer,
                      c->L);
  if (q->n_tokens < 1 || q->n_tokens > GC_MAX_TOKENS)
    return mr_err_set(e, MR_ERANGE, "layer %u: n_tokens = %u, must be 1..%u", q->layer,
                      q->n_tokens, GC_MAX_TOKENS);
  uint32_t kmax = c->E < GC_MAX_TOP_K ? c->E : GC_MAX_TOP_K;
  if (c->n_servers && c->max_top_k_min < kmax) kmax = c->max_top_k_min;
  if (q->top_k < 1 || q->top_k > kmax)
    return mr_err_set(e, MR_ERANGE, "layer %u: top_k = %u, must be 1..%u (the servers' max_top_k "
                      "and num_experts)", q->layer, q->top_k, kmax);
  if (q->dtype != MR_DTYPE_F32 && q->dtype != MR_DTYPE_F16 && q->dtype != MR_DTYPE_BF16)
    return mr_err_set(e, MR_EINVAL, "layer %u: dtype = %d, must be f32 (1), f16 (2) or bf16 (3)",
                      q->layer, (int)q->dtype);
  if (!q->ids || !q->weights || !q->x)
    return mr_err_set(e, MR_EINVAL, "layer %u: ids, weights and x must not be NULL", q->layer);
  return 0;
}

/* Encodes r's ForwardRequest, its payload referencing x (the part's gathered rows). */
static int req_encode(gc_pending *p, gc__req *r, const gc__part *pt, const uint8_t *x,
                      uint32_t k, size_t row_bytes, mr_err *e) {
  Moerpc__V1__ForwardRequest m = MOERPC__V1__FORWARD_REQUEST__INIT;
  m.id = r->id;
  m.layer = p->layer;
  m.n_tokens = r->n_tokens;
  m.top_k = k;
  m.n_expert_ids = (size_t)r->n_tokens * k;
  m.expert_ids = pt->ids + (size_t)r->row0 * k;
  m.n_weights = m.n_expert_ids;
  m.weights = pt->weights + (size_t)r->row0 * k;
  m.dtype = (Moerpc__V1__DType)p->dtype;
  /* The server drops the request rather than compute it after this client gave up. */
  uint64_t now = mr_now_ns();
  uint64_t left_us = p->deadline_ns > now ? (p->deadline_ns - now) / 1000u : 1;
  m.budget_us = left_us > UINT32_MAX ? UINT32_MAX : (uint32_t)(left_us ? left_us : 1);
  atomic_fetch_add(&p->refs, 1); /* the payload slice's reference */
  r->bb = pr_encode_with_payload(&m.base, x + (size_t)r->row0 * row_bytes,
                                 (size_t)r->n_tokens * row_bytes, gc__payload_release, p);
  if (!r->bb) {
    /* pr_encode_with_payload fails only before it made the slice that would release. */
    gc__pending_unref(p);
    return mr_err_set(e, MR_ENOMEM, "layer %u request %llu: encoding: out of memory", p->layer,
                      (unsigned long long)r->id);
  }
  r->bb_bytes = grpc_byte_buffer_length(r->bb);
  return 0;
}

int gc_layer_submit(gc_cluster *c, const gc_layer_req *q, gc_pending **pending, mr_err *e) {
  MR_ASSERT(c && pending);
  *pending = NULL;
  int rc = req_validate(c, q, e);
  if (rc) return rc;
  gc_pending *p = pending_get(c, e);
  if (!p) return MR_ENOMEM;
  p->layer = q->layer;
  p->H = c->H;
  p->dtype = q->dtype;
  p->t_submit_ns = mr_now_ns();
  p->deadline_ns = p->t_submit_ns + (uint64_t)c->deadline_ms * 1000000u;

  const uint32_t k = q->top_k;
  const size_t row_bytes = (size_t)c->H * mr_dtype_size(q->dtype);
  rc = gc__plan_build(&p->plan, c->owner + (size_t)q->layer * c->E, c->E, c->n_servers,
                      q->layer, q->n_tokens, k, q->ids, q->weights, &p->arena, e);
  if (rc) goto out_unref;
  const uint32_t np = p->plan.n_parts;

  /* Count the requests: a part larger than its server's max_tokens becomes several. */
  uint32_t n_reqs = 0;
  for (uint32_t i = 0; i < np; i++) {
    const gc__part *pt = &p->plan.parts[i];
    if (pt->target == GC_OWNER_LOCAL) continue;
    uint32_t mt = c->servers[pt->target].max_tokens;
    n_reqs += (pt->n_tokens + mt - 1) / mt;
  }
  uint8_t **x_part = mr_arena_alloc(&p->arena, (np ? np : 1) * sizeof *x_part, 8);
  p->part_out = mr_arena_alloc(&p->arena, (np ? np : 1) * sizeof *p->part_out, 8);
  p->reqs = mr_arena_alloc(&p->arena, (n_reqs ? n_reqs : 1) * sizeof *p->reqs, 64);
  if (!x_part || !p->part_out || !p->reqs) goto out_nomem;
  for (uint32_t i = 0; i < np; i++) {
    const gc__part *pt = &p->plan.parts[i];
    size_t out_row = pt->target == GC_OWNER_LOCAL ? (size_t)c->H * sizeof(float) : row_bytes;
    x_part[i] = mr_arena_alloc(&p->arena, (size_t)pt->n_tokens * row_bytes, 64);
    p->part_out[i] = mr_arena_alloc(&p->arena, (size_t)pt->n_tokens * out_row, 64);
    if (!x_part[i] || !p->part_out[i]) goto out_nomem;
    gc__gather_rows(x_part[i], q->x, pt->rows, pt->n_tokens, row_bytes);
  }

  /* Describe every request before the first is queued: the I/O thread may complete one
   * while later ones are still being queued, and counts against n_reqs. */
  uint32_t ri = 0;
  for (uint32_t i = 0; i < np; i++) {
    const gc__part *pt = &p->plan.parts[i];
    if (pt->target == GC_OWNER_LOCAL) continue;
    uint32_t mt = c->servers[pt->target].max_tokens;
    for (uint32_t row0 = 0; row0 < pt->n_tokens; row0 += mt) {
      gc__req *r = &p->reqs[ri++];
      memset(r, 0, sizeof *r);
      r->p = p;
      r->s = &c->streams[pt->target];
      r->row0 = row0;
      r->n_tokens = pt->n_tokens - row0 < mt ? pt->n_tokens - row0 : mt;
      r->id = atomic_fetch_add(&c->next_id, 1);
      r->t_submit_ns = p->t_submit_ns;
      r->out = (uint8_t *)p->part_out[i] + (size_t)row0 * row_bytes;
    }
  }
  MR_ASSERT(ri == n_reqs);
  p->n_reqs = n_reqs;

  ri = 0;
  for (uint32_t i = 0; i < np; i++) {
    const gc__part *pt = &p->plan.parts[i];
    if (pt->target == GC_OWNER_LOCAL) continue;
    for (uint32_t row0 = 0; row0 < pt->n_tokens; row0 += c->servers[pt->target].max_tokens) {
      gc__req *r = &p->reqs[ri++];
      mr_err err;
      int erc = req_encode(p, r, pt, x_part[i], k, row_bytes, &err);
      if (erc) gc__req_complete(r, erc, &err);
      else gc__stream_enqueue(r->s, r);
    }
  }

  p->t_sent_ns = mr_now_ns(); /* every request is with the transport */
  /* The servers work on their parts while this thread computes the local one. */
  for (uint32_t i = 0; i < np; i++) {
    if (p->plan.parts[i].target != GC_OWNER_LOCAL) continue;
    uint64_t t0 = mr_now_ns();
    p->local_rc = gc__local_forward(c, p, i, x_part[i], &p->local_err);
    p->local_ns += mr_now_ns() - t0;
    if (p->local_rc)
      mr_err_prefix(&p->local_err, p->local_rc, "layer %u: local experts", q->layer);
  }
  *pending = p;
  return 0;

out_nomem:
  rc = mr_err_set(e, MR_ENOMEM, "layer %u: buffers for %u tokens: out of memory", q->layer,
                  q->n_tokens);
out_unref:
  gc__pending_unref(p);
  return rc;
}

/* ---- wait -------------------------------------------------------------------------------- */

static void abs_from_ns(struct timespec *ts, uint64_t ns) {
  ts->tv_sec = (time_t)(ns / 1000000000u);
  ts->tv_nsec = (long)(ns % 1000000000u);
}

bool gc_pending_empty(const gc_pending *p) { return p->plan.n_parts == 0; }

int gc_layer_wait(gc_cluster *c, gc_pending *p, float *out, mr_err *e) {
  return gc_layer_wait_ex(c, p, out, 0, NULL, e);
}

int gc_layer_wait_ex(gc_cluster *c, gc_pending *p, float *out, uint32_t flags,
                     gc_call_timing *t, mr_err *e) {
  MR_ASSERT(c && p && p->c == c && (out || p->plan.n_parts == 0));
  const uint64_t t_wait0 = mr_now_ns();
  struct timespec ts;
  abs_from_ns(&ts, p->deadline_ns);
  pthread_mutex_lock(&p->lock);
  while (p->n_done < p->n_reqs && !p->failed) {
    int w = pthread_cond_timedwait(&p->cond, &p->lock, &ts);
    if (w == ETIMEDOUT) break;
  }
  /* From here on no other thread writes the requests' result fields. */
  p->closed = true;
  bool timed_out = p->n_done < p->n_reqs && !p->failed;
  const uint64_t t_reply = p->t_last_reply_ns;
  pthread_mutex_unlock(&p->lock);
  if (t) {
    t->wait_us = (mr_now_ns() - t_wait0) / 1000u;
    t->rpc_us = p->n_reqs && t_reply > p->t_sent_ns ? (t_reply - p->t_sent_ns) / 1000u : 0;
    t->submit_us = (p->t_sent_ns - p->t_submit_ns) / 1000u;
    t->local_us = p->local_ns / 1000u;
    t->requests = p->n_reqs;
  }

  /* The first failure in part order (servers in file order), so that the same fault gives
   * the same message whichever reply came first. */
  int rc = 0;
  uint32_t n_failed = 0;
  uint64_t waited_ms = (mr_now_ns() - p->t_submit_ns) / 1000000u;
  for (uint32_t i = 0; i < p->n_reqs; i++) {
    gc__req *r = &p->reqs[i];
    if (!r->done) {
      /* Not answered: give it up (a reply that comes later is dropped by the I/O thread). */
      enum gc__req_state st;
      bool mine = gc__stream_forget(r->s, r, timed_out, &st);
      if (!timed_out) {
        if (mine) gc__pending_unref(p);
        continue; /* abandoned because another request failed first */
      }
      n_failed++;
      if (!rc)
        rc = mr_err_set(e, MR_ETIMEDOUT,
                        "layer %u request %llu: " GC__SRV_FMT ": no reply within %u ms "
                        "(waited %llu ms; %s)",
                        p->layer, (unsigned long long)r->id, GC__SRV_ARGS(r->s->srv),
                        c->deadline_ms, (unsigned long long)waited_ms,
                        st == GC__REQ_QUEUED ? "still queued: the stream is not ready"
                                                   : "sent, server slow or stuck");
      if (mine) gc__pending_unref(p);
    } else if (r->rc) {
      n_failed++;
      if (!rc) {
        rc = r->rc;
        if (e) *e = r->err;
      }
    }
  }
  if (p->local_rc) {
    n_failed++;
    if (!rc) {
      rc = p->local_rc;
      if (e) *e = p->local_err;
    }
  }
  if (rc) {
    if (n_failed > 1 && e) {
      size_t len = strlen(e->msg);
      snprintf(e->msg + len, sizeof e->msg - len, " (and %u more failed part%s)", n_failed - 1,
               n_failed - 1 == 1 ? "" : "s");
    }
    goto out_unref;
  }

  if (out && !(flags & GC_WAIT_ACCUMULATE))
    memset(out, 0, (size_t)p->plan.n_tokens * c->H * sizeof *out);
  for (uint32_t i = 0; i < p->plan.n_parts; i++) {
    const gc__part *pt = &p->plan.parts[i];
    gc__scatter_add(out, c->H, pt->rows, pt->n_tokens, p->part_out[i],
                    pt->target == GC_OWNER_LOCAL ? MR_DTYPE_F32 : p->dtype);
  }
out_unref:
  gc__pending_unref(p);
  return rc;
}

void gc_layer_cancel(gc_cluster *c, gc_pending *p) {
  if (!p) return;
  MR_ASSERT(p->c == c);
  pthread_mutex_lock(&p->lock);
  p->closed = true; /* from here on late results are ignored */
  pthread_mutex_unlock(&p->lock);
  for (uint32_t i = 0; i < p->n_reqs; i++) {
    gc__req *r = &p->reqs[i];
    if (r->done) continue;
    enum gc__req_state st;
    if (gc__stream_forget(r->s, r, false, &st)) gc__pending_unref(p);
  }
  gc__pending_unref(p);
}

int gc_layer_forward(gc_cluster *c, const gc_layer_req *q, float *out, mr_err *e) {
  gc_pending *p = NULL;
  int rc = gc_layer_submit(c, q, &p, e);
  if (rc) return rc;
  return gc_layer_wait(c, p, out, e);
}
