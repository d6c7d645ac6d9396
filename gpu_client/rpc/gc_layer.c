/*
 * gc_layer.c - one MoE layer call: submit (split, gather, queue, local part), wait
 * (deadline, first error, sum). The pendings and their arenas come from gc_pending.c.
 *
 * Buffers of one call, all from its pending's arena (reset when the pending returns to
 * the pool, so a steady stream of calls allocates nothing):
 *
 *   plan        rows / ids / weights of each part            (gc__plan_build)
 *   x of a part the part's hidden rows in the wire dtype     sent by reference (zero copy)
 *   out of a    the request's output in the wire dtype       written by the I/O thread
 *   request                                                   (gather from the reply slices)
 *   part_out    the local part's output, fp32
 *   reqs        one gc__req per ForwardRequest, resent ones appended
 *
 * The payload slices may outlive the call inside gRPC; each holds a reference of the
 * pending, so the arena is reset only after gRPC let go of them.
 *
 * Failover inside the wait (docs/DESIGN.md "Replicas and failover"): a request whose
 * stream broke (retry), whose OK reply held a NaN or an Inf (bad_reply: the I/O thread
 * checks every reply), or that is unanswered for failover_ms while its server has been
 * silent as long, is re-planned: its slots (a disjoint set of (token, slot) of the call)
 * are split again over the live replicas without its server, with its own gathered rows
 * as the source, and the new requests are appended and sent; the old one is marked
 * replaced and its result (or a late reply, which finds nothing outstanding) is never
 * added. The sum is the same set of (token, slot) products, so the call's result is too.
 */
#include <errno.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include <grpc/byte_buffer.h>

#include "gpu_client/rpc/internal.h"

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

/* Encodes r's ForwardRequest, its payload referencing r->x (rows the pending owns). */
static int req_encode(gc_pending *p, gc__req *r, mr_err *e) {
  const uint32_t k = p->top_k;
  Moerpc__V1__ForwardRequest m = MOERPC__V1__FORWARD_REQUEST__INIT;
  m.id = r->id;
  m.layer = p->layer;
  m.n_tokens = r->n_tokens;
  m.top_k = k;
  m.n_expert_ids = (size_t)r->n_tokens * k;
  m.expert_ids = (int32_t *)r->ids;
  m.n_weights = m.n_expert_ids;
  m.weights = (float *)r->weights;
  m.dtype = (Moerpc__V1__DType)p->dtype;
  /* The server drops the request rather than compute it after this client gave up. */
  uint64_t now = mr_now_ns();
  uint64_t left_us = p->deadline_ns > now ? (p->deadline_ns - now) / 1000u : 1;
  m.budget_us = left_us > UINT32_MAX ? UINT32_MAX : (uint32_t)(left_us ? left_us : 1);
  atomic_fetch_add(&p->refs, 1); /* the payload slice's reference */
  r->bb = pr_encode_with_payload(&m.base, r->x,
                                 (size_t)r->n_tokens * p->H * mr_dtype_size(p->dtype),
                                 gc__payload_release, p);
  if (!r->bb) {
    /* pr_encode_with_payload fails only before it made the slice that would release. */
    gc__pending_unref(p);
    return mr_err_set(e, MR_ENOMEM, "layer %u request %llu: encoding: out of memory", p->layer,
                      (unsigned long long)r->id);
  }
  r->bb_bytes = grpc_byte_buffer_length(r->bb);
  return 0;
}

/* Appends r to p->reqs, growing the array from the arena (the waiter's, or submit's). */
static int reqs_push(gc_pending *p, gc__req *r, uint32_t *n) {
  if (*n == p->cap_reqs) {
    uint32_t cap = p->cap_reqs ? 2 * p->cap_reqs : 8;
    gc__req **a = mr_arena_alloc(&p->arena, cap * sizeof *a, 8);
    if (!a) return MR_ENOMEM;
    if (*n) memcpy(a, p->reqs, *n * sizeof *a);
    p->reqs = a;
    p->cap_reqs = cap;
  }
  p->reqs[(*n)++] = r;
  return 0;
}

/*
 * Describes the requests of the server parts of plan pl and appends them to p->reqs from
 * index *n on (*n advances; they are neither counted in n_reqs nor queued yet). The plan's
 * rows index src: each part's hidden rows are gathered from src_x ([*, H] wire dtype), and
 * its token rows are src_rows[row] (src_rows NULL: the rows are the call's own). A part
 * over its server's max_tokens becomes several requests. fo_from marks resent requests.
 */
static int reqs_from_plan(gc_cluster *c, gc_pending *p, const gc__plan *pl, const void *src_x,
                          const uint32_t *src_rows, int32_t fo_from, uint64_t rt_gen,
                          uint32_t *n, mr_err *e) {
  const uint32_t k = pl->top_k;
  const size_t row_bytes = (size_t)c->H * mr_dtype_size(p->dtype);
  const uint64_t now = mr_now_ns();
  for (uint32_t i = 0; i < pl->n_parts; i++) {
    const gc__part *pt = &pl->parts[i];
    if (pt->target == GC_OWNER_LOCAL) continue;
    uint8_t *x = mr_arena_alloc(&p->arena, (size_t)pt->n_tokens * row_bytes, 64);
    uint8_t *out = mr_arena_alloc(&p->arena, (size_t)pt->n_tokens * row_bytes, 64);
    uint32_t *rows = (uint32_t *)pt->rows;
    if (src_rows) rows = mr_arena_alloc(&p->arena, pt->n_tokens * sizeof *rows, 8);
    if (!x || !out || !rows) goto out_nomem;
    if (src_rows)
      for (uint32_t t = 0; t < pt->n_tokens; t++) rows[t] = src_rows[pt->rows[t]];
    gc__gather_rows(x, src_x, pt->rows, pt->n_tokens, row_bytes);
    uint32_t mt = c->servers[pt->target].max_tokens;
    for (uint32_t row0 = 0; row0 < pt->n_tokens; row0 += mt) {
      gc__req *r = mr_arena_alloc(&p->arena, sizeof *r, 64);
      if (!r) goto out_nomem;
      memset(r, 0, sizeof *r);
      r->p = p;
      r->s = &c->streams[pt->target];
      r->n_tokens = pt->n_tokens - row0 < mt ? pt->n_tokens - row0 : mt;
      r->rows = rows + row0;
      r->ids = pt->ids + (size_t)row0 * k;
      r->weights = pt->weights + (size_t)row0 * k;
      for (size_t j = 0; j < (size_t)r->n_tokens * k; j++) r->n_slots += r->ids[j] >= 0;
      r->x = x + (size_t)row0 * row_bytes;
      r->out = out + (size_t)row0 * row_bytes;
      r->id = atomic_fetch_add(&c->next_id, 1);
      r->t_submit_ns = now;
      r->fo_from = fo_from;
      r->rt_gen = rt_gen;
      if (reqs_push(p, r, n)) goto out_nomem;
    }
  }
  return 0;
out_nomem:
  return mr_err_set(e, MR_ENOMEM, "layer %u: requests for %u tokens: out of memory", p->layer,
                    pl->n_tokens);
}

/* Encodes and queues requests [from, to) of p (counted in n_reqs already). followed: the
 * caller submits another call right after (GC_REQ_FOLLOWED). A request is "followed" when
 * the next one goes to the same stream (the chunks of a part over max_tokens are queued one
 * after another) or the caller's next call may: its send then completes on its own instead
 * of pairing with its reply (gc_stream.c), which would hold the next one back. */
static void reqs_send(gc_pending *p, uint32_t from, uint32_t to, bool followed) {
  for (uint32_t i = from; i < to; i++) {
    gc__req *r = p->reqs[i];
    r->followed = followed || (i + 1 < to && p->reqs[i + 1]->s == r->s);
    mr_err err;
    int erc = req_encode(p, r, &err);
    if (erc) gc__req_complete(r, erc, &err, 0);
    else gc__stream_enqueue(r->s, r);
  }
}

/* The replica view of layer for a plan: the current replica sets (their generation in
 * *gen), live and load snapshots from the arena; skip is a server to leave out (-1 none),
 * as are the servers that replied non-finite earlier in this call (p->excluded). */
static int replicas_view(gc_cluster *c, gc_pending *p, uint32_t layer, int32_t skip,
                         gc__replicas *rp, uint64_t *gen) {
  const gc__routes *rt = gc__routes_get(c);
  *gen = rt->gen;
  uint8_t *live = mr_arena_alloc(&p->arena, c->n_servers, 8);
  uint64_t *load = mr_arena_alloc(&p->arena, c->n_servers * sizeof *load, 8);
  if (!live || !load) return MR_ENOMEM;
  for (uint32_t s = 0; s < c->n_servers; s++) {
    live[s] = atomic_load(&c->streams[s].up) && (int32_t)s != skip &&
              !(p->excluded && p->excluded[s]);
    load[s] = atomic_load(&c->streams[s].out_slots);
  }
  rp->off = rt->rep_off + (size_t)layer * c->E;
  rp->srv = rt->rep;
  rp->pref = rt->pref ? rt->pref + (size_t)layer * c->E : NULL;
  rp->live = live;
  rp->load = load;
  rp->rot = atomic_fetch_add(&c->rot, 1);
  return 0;
}

static void miss_explain(const gc_cluster *c, uint32_t layer, const uint8_t *missing, char *msg,
                         size_t len);

/* Whether an expert of missing[E] (a plan's, NULL = none) has no replica at all in the
 * current replica sets: no server announced it at the last Hello (not merely down). */
static bool missing_unannounced(const gc_cluster *c, uint32_t layer, const uint8_t *missing) {
  const gc__routes *rt = gc__routes_get(c);
  for (uint32_t x = 0; missing && x < c->E; x++) {
    size_t i = (size_t)layer * c->E + x;
    if (missing[x] && rt->rep_off[i] == rt->rep_off[i + 1]) return true;
  }
  return false;
}

/* A re-Hello for an expert no server announced is tried at most this often (a lost expert
 * asked for every step would otherwise cost a Hello round each time). */
#define GC__UNANNOUNCED_GAP_MS 200u

int gc_layer_submit(gc_cluster *c, const gc_layer_req *q, gc_pending **pending, mr_err *e) {
  MR_ASSERT(c && pending);
  *pending = NULL;
  int rc = req_validate(c, q, e);
  if (rc) return rc;
  gc_pending *p = gc__pending_get(c, e);
  if (!p) return MR_ENOMEM;
  p->layer = q->layer;
  p->H = c->H;
  p->dtype = q->dtype;
  p->top_k = q->top_k;
  p->t_submit_ns = mr_now_ns();
  p->deadline_ns = p->t_submit_ns + (uint64_t)c->deadline_ms * 1000000u;

  const size_t row_bytes = (size_t)c->H * mr_dtype_size(q->dtype);
  gc__replicas rp;
  uint64_t gen;
  if (replicas_view(c, p, q->layer, -1, &rp, &gen)) goto out_nomem;
  rc = gc__plan_build(&p->plan, c->owner + (size_t)q->layer * c->E, &rp, c->E, c->n_servers,
                      q->layer, q->n_tokens, q->top_k, q->ids, q->weights, &p->arena, e);
  bool unannounced = rc == MR_EUNAVAIL && missing_unannounced(c, q->layer, p->plan.missing);
  if (unannounced) {
    /* An expert that left every server may have come back (a LoadExperts since the last
     * Hello): ask again, then plan again. */
    char trigger[120];
    snprintf(trigger, sizeof trigger, "a layer %u call for experts no server announced",
             q->layer);
    mr_err rerr;
    if (gc__routes_refresh(c, gen, GC__UNANNOUNCED_GAP_MS, trigger, &rerr) == 0 &&
        gc__routes_get(c)->gen != gen) {
      if (replicas_view(c, p, q->layer, -1, &rp, &gen)) goto out_nomem;
      rc = gc__plan_build(&p->plan, c->owner + (size_t)q->layer * c->E, &rp, c->E,
                          c->n_servers, q->layer, q->n_tokens, q->top_k, q->ids, q->weights,
                          &p->arena, e);
      unannounced = rc == MR_EUNAVAIL && missing_unannounced(c, q->layer, p->plan.missing);
    }
  }
  if (rc == MR_EUNAVAIL && e) {
    if (unannounced) {
      size_t len = strlen(e->msg);
      miss_explain(c, q->layer, p->plan.missing, e->msg + len, sizeof e->msg - len);
    } else {
      gc__down_explain(c, q->layer, p->plan.missing, e->msg, sizeof e->msg);
    }
  }
  if (rc) goto out_unref;
  const uint32_t np = p->plan.n_parts;
  /* Every slot is valid now: count the routing decisions, caller-computed ones included
   * (caller_local slots are in ids; caller_ids holds those a caller masked out). */
  const size_t n_slots = (size_t)q->n_tokens * q->top_k;
  const bool may_step = !(q->flags & GC_REQ_PART);
  gc_routing_count(c->routing, q->layer, q->ids, n_slots, q->n_tokens,
                   may_step && !q->caller_ids);
  if (q->caller_ids)
    gc_routing_count(c->routing, q->layer, q->caller_ids, n_slots, q->n_tokens, may_step);

  /* Describe every request before the first is queued: the I/O thread may complete one
   * while later ones are still being queued, and counts against n_reqs. */
  uint32_t n = 0;
  rc = reqs_from_plan(c, p, &p->plan, q->x, NULL, -1, gen, &n, e);
  if (rc) goto out_unref;
  p->n_reqs = n;

  p->part_out = mr_arena_alloc(&p->arena, (np ? np : 1) * sizeof *p->part_out, 8);
  if (!p->part_out) goto out_nomem;
  uint8_t *x_local = NULL;
  for (uint32_t i = 0; i < np; i++) {
    const gc__part *pt = &p->plan.parts[i];
    p->part_out[i] = NULL;
    if (pt->target != GC_OWNER_LOCAL) continue;
    x_local = mr_arena_alloc(&p->arena, (size_t)pt->n_tokens * row_bytes, 64);
    p->part_out[i] = mr_arena_alloc(&p->arena, (size_t)pt->n_tokens * c->H * sizeof(float), 64);
    if (!x_local || !p->part_out[i]) goto out_nomem;
    gc__gather_rows(x_local, q->x, pt->rows, pt->n_tokens, row_bytes);
  }

  reqs_send(p, 0, n, (q->flags & GC_REQ_FOLLOWED) != 0);
  p->t_sent_ns = mr_now_ns(); /* every request is with the transport */
  /* The servers work on their parts while this thread computes the local one. */
  for (uint32_t i = 0; i < np; i++) {
    if (p->plan.parts[i].target != GC_OWNER_LOCAL) continue;
    uint64_t t0 = mr_now_ns();
    p->local_rc = gc__local_forward(c, p, i, x_local, &p->local_err);
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

/* ---- failover ---------------------------------------------------------------------------- */

/* Marks the broken request r a plain failure (the wait reports it in request order), its
 * message extended by the printf-style suffix. */
static void req_give_up(gc_pending *p, gc__req *r, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void req_give_up(gc_pending *p, gc__req *r, const char *fmt, ...) {
  char extra[600];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(extra, sizeof extra, fmt, ap);
  va_end(ap);
  pthread_mutex_lock(&p->lock);
  r->retry = false;
  size_t len = strlen(r->err.msg);
  snprintf(r->err.msg + len, sizeof r->err.msg - len, "%s", extra);
  pthread_mutex_unlock(&p->lock);
}

/*
 * The first half of the re-plan of a request answered "not served" (FAILED_PRECONDITION:
 * its server no longer holds an expert of its slots, typically moved by `moerpc-place
 * apply` to another server while this client was not told): re-Hellos the cluster
 * (gc__routes_refresh; nothing is sent when another caller already refreshed since r was
 * planned), so that the re-plan sees the servers' owned sets of now. Bounded: after
 * GC__MISS_MAX such re-plans in one call r fails with its own message (no livelock when a
 * server's Hello and its Forward disagree). Returns 0 to re-plan, 1 when r was given up,
 * or an error (MR_ENOMEM).
 */
static int miss_refresh(gc_cluster *c, gc_pending *p, gc__req *r, mr_err *e) {
  if (p->misses >= GC__MISS_MAX) {
    req_give_up(p, r, " (still not served after %u re-Hellos of the cluster in this call)",
                p->misses);
    return 1;
  }
  p->misses++;
  char trigger[600];
  snprintf(trigger, sizeof trigger, "a \"not served\" reply (FAILED_PRECONDITION) of " GC__SRV_FMT
           " to layer %u request %llu", GC__SRV_ARGS(r->s->srv), p->layer,
           (unsigned long long)r->id);
  int rc = gc__routes_refresh(c, r->rt_gen, 0, trigger, e);
  return rc ? rc : 0;
}

/* The experts of missing[E] and the servers asked, for a request that no server serves
 * after a re-Hello: " (layer 1: expert 6 is served by no server after a re-Hello of the
 * cluster; asked s0 (...), s1 (...))". */
static void miss_explain(const gc_cluster *c, uint32_t layer, const uint8_t *missing, char *msg,
                         size_t len) {
  char list[256];
  uint32_t n_missing = 0;
  mr_idlist w;
  mr_idlist_init(&w, list, sizeof list);
  for (uint32_t x = 0; missing && x < c->E; x++)
    if (missing[x]) {
      mr_idlist_add(&w, x);
      n_missing++;
    }
  mr_idlist_end(&w, true);
  int pos = snprintf(msg, len, " (layer %u: expert%s %s %s served by no live server after a "
                     "re-Hello of the cluster; asked", layer, n_missing == 1 ? "" : "s", list,
                     n_missing == 1 ? "is" : "are");
  bool first = true;
  for (uint32_t s = 0; s < c->n_servers && pos > 0 && (size_t)pos < len; s++) {
    if (c->servers[s].alias_of >= 0) continue;
    pos += snprintf(msg + pos, len - (size_t)pos, "%s " GC__SRV_FMT "%s", first ? "" : ",",
                    GC__SRV_ARGS(&c->servers[s]), atomic_load(&c->streams[s].up) ? "" : " (down)");
    first = false;
  }
  if (pos > 0 && (size_t)pos < len) snprintf(msg + pos, len - (size_t)pos, ")");
}

/* Whether the unanswered r has waited failover_ms and its server said nothing for as long
 * (a server that answers other requests is busy, not gone); else *wake gets when it would. */
static bool req_stalled(const gc_cluster *c, const gc__req *r, uint64_t now, uint64_t *wake) {
  const uint64_t fo = (uint64_t)c->failover_ms * 1000000u;
  uint64_t t = r->t_submit_ns + fo;
  uint64_t tr = atomic_load(&r->s->t_reply_ns) + fo;
  if (tr > t) t = tr;
  if (now >= t) return true;
  if (t < *wake) *wake = t;
  return false;
}

/*
 * One failover round of the waiter (p->lock not held): every request that broke with
 * retry, or is unanswered on a server that is down or stalled, is re-planned over the live
 * replicas of its slots and resent. A request answered with a non-finite value, or refused
 * by a draining server (avoid_server), is re-planned the same way with its server excluded
 * from the rest of the call (so two faulty replicas cannot bounce it between them); with
 * nowhere to go it becomes a plain
 * failure, reported with its own message. A stalled request with nowhere to go is left to
 * its deadline (no_failover). Returns 0, or the call's error: MR_EUNAVAIL when a broken
 * request's slots have no live replica, MR_ENOMEM.
 */
static int failover_round(gc_cluster *c, gc_pending *p, mr_err *e) {
  const uint32_t n0 = p->n_reqs; /* only the waiter appends */
  const uint64_t now = mr_now_ns();
  uint32_t n = n0;
  for (uint32_t i = 0; i < n0; i++) {
    gc__req *r = p->reqs[i];
    pthread_mutex_lock(&p->lock);
    bool done = r->done, broke = r->done && r->rc && r->retry, replaced = r->replaced;
    bool bad = broke && r->avoid_server, miss = broke && r->miss;
    pthread_mutex_unlock(&p->lock);
    /* no_failover holds only while r is unanswered: a broken stream must still be
     * re-planned (or reported) even if an earlier stall found nowhere to go. */
    if (replaced || (done && !broke) || (!done && r->no_failover)) continue;
    const uint32_t idx = r->s->idx;
    uint64_t wake = UINT64_MAX;
    bool stalled = false;
    if (!done) {
      bool down = !atomic_load(&r->s->up);
      stalled = !down && req_stalled(c, r, now, &wake);
      if (!down && !stalled) continue;
    }

    if (bad) {
      /* A server that sent a NaN or an Inf as OK gets nothing more of this call; it stays
       * up for other calls (its stream and other layers may be fine, and a fresh Hello
       * would not tell). */
      if (!p->excluded) {
        p->excluded = mr_arena_alloc(&p->arena, c->n_servers, 8);
        if (!p->excluded)
          return mr_err_set(e, MR_ENOMEM, "layer %u: failover: out of memory", p->layer);
        memset(p->excluded, 0, c->n_servers);
      }
      p->excluded[idx] = 1;
    }
    if (miss) {
      /* Not a fault of the server: it serves what its Hello says, and the re-Hello tells
       * where the expert went; the server is not left out (it may serve the other slots). */
      int mrc = miss_refresh(c, p, r, e);
      if (mrc < 0 || mrc > 1) return mrc;
      if (mrc == 1) continue;
    }
    gc__plan sub;
    gc__replicas rp;
    mr_err perr;
    uint64_t gen;
    if (replicas_view(c, p, p->layer, miss ? -1 : (int32_t)idx, &rp, &gen))
      return mr_err_set(e, MR_ENOMEM, "layer %u: failover: out of memory", p->layer);
    int rc = gc__plan_build(&sub, c->owner + (size_t)p->layer * c->E, &rp, c->E, c->n_servers,
                            p->layer, r->n_tokens, p->top_k, r->ids, r->weights, &p->arena,
                            &perr);
    if (rc == MR_EUNAVAIL && miss) {
      char why[600];
      miss_explain(c, p->layer, sub.missing, why, sizeof why);
      req_give_up(p, r, "%s", why);
      continue;
    }
    if (rc == MR_EUNAVAIL && !done) {
      r->no_failover = true; /* nowhere to go: its own server may still answer in time */
      continue;
    }
    if (rc == MR_EUNAVAIL && bad) {
      /* Nowhere else to ask: the call fails with the reply's own error, which names the
       * server, the layer and the value (reported in request order by the wait). */
      pthread_mutex_lock(&p->lock);
      r->retry = false;
      size_t len = strlen(r->err.msg);
      snprintf(r->err.msg + len, sizeof r->err.msg - len, " (no other live replica to ask)");
      pthread_mutex_unlock(&p->lock);
      continue;
    }
    if (rc == MR_EUNAVAIL) {
      if (e) {
        *e = perr;
        gc__down_explain(c, p->layer, sub.missing, e->msg, sizeof e->msg);
      }
      return rc;
    }
    if (rc) {
      if (e) *e = perr;
      return rc;
    }

    if (!done) {
      enum gc__req_state st;
      if (!gc__stream_forget(r->s, r, false, &st)) continue; /* answered just now */
      gc__pending_unref(p); /* the outstanding list's reference, ours now */
      char why[200];
      if (stalled)
        snprintf(why, sizeof why, "no reply to request %llu (layer %u) within failover_ms %u "
                 "(%s, server silent)", (unsigned long long)r->id, p->layer, c->failover_ms,
                 st == GC__REQ_QUEUED ? "still queued" : "sent");
      else
        snprintf(why, sizeof why, "marked down while request %llu (layer %u) was unanswered",
                 (unsigned long long)r->id, p->layer);
      gc__server_down(c, idx, false, why);
      pthread_mutex_lock(&p->lock);
      r->done = true;
      p->n_done++;
      r->replaced = true;
      pthread_mutex_unlock(&p->lock);
    } else {
      pthread_mutex_lock(&p->lock);
      r->replaced = true;
      p->failed = false;
      for (uint32_t j = 0; j < n0; j++) {
        const gc__req *o = p->reqs[j];
        if (o->done && o->rc && !o->replaced) p->failed = true;
      }
      pthread_mutex_unlock(&p->lock);
    }
    gc__server_resent(c, idx, 1);
    uint32_t from = n;
    /* fo_from times a failover of a down server; a bad reply or a miss is none (its server
     * is up). */
    rc = reqs_from_plan(c, p, &sub, r->x, r->rows, bad || miss ? -1 : (int32_t)idx, gen, &n, e);
    if (rc) return rc;
    pthread_mutex_lock(&p->lock);
    p->n_reqs = n;
    pthread_mutex_unlock(&p->lock);
    mr_log(MR_LOG_DEBUG, "layer %u request %llu of " GC__SRV_FMT ": resent as %u request%s",
           p->layer, (unsigned long long)r->id, GC__SRV_ARGS(r->s->srv), n - from,
           n - from == 1 ? "" : "s");
    reqs_send(p, from, n, false);
  }
  return 0;
}

/* ---- wait -------------------------------------------------------------------------------- */

static void abs_from_ns(struct timespec *ts, uint64_t ns) {
  ts->tv_sec = (time_t)(ns / 1000000000u);
  ts->tv_nsec = (long)(ns % 1000000000u);
}

bool gc_pending_empty(const gc_pending *p) { return p->plan.n_parts == 0; }

int gc_layer_wait(gc_cluster *c, gc_pending *p, float *out, mr_err *e) {
  return gc_layer_wait_timed(c, p, out, 0, NULL, e);
}

/* Under p->lock: whether a failover round has work (a broken request to re-plan, or an
 * unanswered one on a down or stalled server); *hard: a failure no round can mend. *wake
 * gets the next time a stall could be due. */
static bool failover_due(const gc_cluster *c, const gc_pending *p, uint64_t now, bool *hard,
                         uint64_t *wake) {
  bool due = false;
  *hard = false;
  for (uint32_t i = 0; i < p->n_reqs; i++) {
    const gc__req *r = p->reqs[i];
    if (r->replaced) continue;
    if (r->done) {
      if (r->rc && r->retry) due = true;
      else if (r->rc) *hard = true;
    } else if (!r->no_failover &&
               (!atomic_load(&r->s->up) || req_stalled(c, r, now, wake))) {
      due = true;
    }
  }
  return due;
}

int gc_layer_wait_timed(gc_cluster *c, gc_pending *p, float *out, uint32_t flags,
                     gc_call_timing *t, mr_err *e) {
  MR_ASSERT(c && p && p->c == c && (out || p->plan.n_parts == 0));
  const uint64_t t_wait0 = mr_now_ns();
  uint64_t spin_ns = (uint64_t)c->opts.wait_spin_us * 1000u;
  int rc = 0;
  pthread_mutex_lock(&p->lock);
  for (;;) {
    uint64_t now = mr_now_ns();
    if (now >= p->deadline_ns) break;
    bool hard;
    uint64_t wake = p->deadline_ns;
    bool due = failover_due(c, p, now, &hard, &wake);
    if (hard) break; /* reported below, in request order */
    if (due) {
      pthread_mutex_unlock(&p->lock);
      rc = failover_round(c, p, e);
      pthread_mutex_lock(&p->lock);
      if (rc) break;
      continue;
    }
    if (p->n_done == p->n_reqs) break;
    if (spin_ns) { /* once per wait: watch for the replies before sleeping on them */
      const uint64_t until = now + spin_ns < wake ? now + spin_ns : wake;
      spin_ns = 0;
      pthread_mutex_unlock(&p->lock);
      while (!atomic_load_explicit(&p->settled, memory_order_acquire) && mr_now_ns() < until)
        sched_yield(); /* lets the I/O thread run if it shares this CPU */
      pthread_mutex_lock(&p->lock);
      continue;
    }
    struct timespec ts;
    abs_from_ns(&ts, wake);
    pthread_cond_timedwait(&p->cond, &p->lock, &ts);
  }
  /* From here on no other thread writes the requests' result fields. */
  p->closed = true;
  bool timed_out = !rc && p->n_done < p->n_reqs && !p->failed;
  const uint64_t t_reply = p->t_last_reply_ns;
  pthread_mutex_unlock(&p->lock);
  if (t) {
    t->wait_us = (mr_now_ns() - t_wait0) / 1000u;
    t->rpc_us = p->n_reqs && t_reply > p->t_sent_ns ? (t_reply - p->t_sent_ns) / 1000u : 0;
    t->submit_us = (p->t_sent_ns - p->t_submit_ns) / 1000u;
    t->local_us = p->local_ns / 1000u;
    t->requests = p->n_reqs;
  }

  /* The first failure in request order (servers in file order), so that the same fault
   * gives the same message whichever reply came first. */
  uint32_t n_failed = rc ? 1 : 0;
  uint64_t waited_ms = (mr_now_ns() - p->t_submit_ns) / 1000000u;
  for (uint32_t i = 0; i < p->n_reqs; i++) {
    gc__req *r = p->reqs[i];
    if (r->replaced) continue;
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
  for (uint32_t i = 0; i < p->n_reqs; i++) {
    const gc__req *r = p->reqs[i];
    if (r->replaced) continue;
    gc__scatter_add(out, c->H, r->rows, r->n_tokens, r->out, p->dtype);
    if (r->fo_from < 0) continue;
    /* The first rerouted reply of a failover: the earliest of the requests resent from
     * the same server. */
    uint64_t first = r->t_done_ns;
    for (uint32_t j = 0; j < p->n_reqs; j++) {
      const gc__req *o = p->reqs[j];
      if (!o->replaced && o->fo_from == r->fo_from && o->t_done_ns < first) first = o->t_done_ns;
    }
    gc__server_failover_time(c, (uint32_t)r->fo_from, first);
  }
  for (uint32_t i = 0; i < p->plan.n_parts; i++) {
    const gc__part *pt = &p->plan.parts[i];
    if (pt->target != GC_OWNER_LOCAL) continue;
    gc__scatter_add(out, c->H, pt->rows, pt->n_tokens, p->part_out[i], MR_DTYPE_F32);
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
    gc__req *r = p->reqs[i];
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
