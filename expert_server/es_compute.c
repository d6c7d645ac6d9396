/*
 * es_compute.c - the engine's side: the fair job queue, merging, kn_moe_forward, the replies'
 * encoding, deadlines, and the compute thread. It knows jobs, lanes and the engine only: a
 * job comes back to whoever submitted it through job->ops (internal.h), never by a call
 * into the stream code.
 *
 * Submitters push validated jobs (es__compute_submit); the compute thread takes the next job
 * in fair order (below) and with it every queued job of the same layer, dtype and owned
 * table, at the head of the other lanes, that still fits in max_tokens (looking at most
 * ES_MERGE_SCAN lanes, taking at most ES_MERGE_MAX jobs). The merged jobs run as one
 * kn_moe_forward call (docs/DESIGN.md section 3, step 6): each expert's weights are then read
 * once for the tokens of every client that asked for it, which is what decode-time traffic
 * from several GPU workers needs, since a decode step is bound by weight bandwidth.
 *
 * Merged input layout (rows of the jobs in the order taken; k = the largest top_k):
 *
 *   x    [T_total, H]  job 0 rows | job 1 rows | ...       (request dtype, copied once)
 *   ids  [T_total, k]  each job's slots, padded with -1 up to k
 *   w    [T_total, k]  each job's weights, padded with 0
 *   out  [T_total, H]  fp32, then job j's rows are converted into job j's buffer
 *                      and checked there, in the wire dtype (es_output_check_finite)
 *
 * A job alone is computed straight from its own buffer and header, without the copy.
 *
 * One user of the engine at a time: whoever runs a batch first sets srv->computing under
 * q_lock, the compute thread or a CQ thread that runs a small request inline (es_inline.c,
 * through es__compute_claim / es__compute_run_one / es__compute_release). The fp32 output
 * and the merged arrays live in the compute arena, reset after every batch, and shrunk back
 * to its first block size once ES_ARENA_SHRINK_AFTER batches in a row used under a quarter
 * of a larger block (a prefill peak is not kept forever).
 *
 * Fair order: start-time fair queueing over lanes (one per Forward stream). Each lane keeps
 * its queued jobs in arrival order (es_lane.head); a job's virtual start is max(V, the
 * virtual finish of its lane's previous job), its virtual finish that plus its cost
 * (tokens + 1). The compute thread serves the lane whose head job has the smallest virtual
 * start (a min-heap of lanes, srv->q_heap) and V follows the job taken. A stream that sends
 * one decode step now and then starts near V, so it is served next, however many jobs a
 * heavy stream has queued: one greedy stream cannot starve another's decode step.
 *
 * Not computed: jobs of a dead lane (cancelled or broken call: dropped), jobs past their
 * deadline (budget_us: DEADLINE_EXCEEDED) and, after a drain timed out, every queued job
 * (UNAVAILABLE). They are answered without touching the engine.
 */
#define _GNU_SOURCE /* pthread_setname_np */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "expert_server/internal.h"

#define ES_MERGE_MAX 64
#define ES_MERGE_SCAN 256
#define ES_ARENA_SHRINK_AFTER 64u

static uint32_t es__us(uint64_t ns) {
  uint64_t us = ns / 1000u;
  return us > UINT32_MAX ? UINT32_MAX : (uint32_t)us;
}

/* ForwardReply.server_us (protocol 1.5): arrival to now, the reply's encoding. */
static uint32_t es__server_us(const es_job *job) {
  return job->t_recv_ns ? es__us(mr_now_ns() - job->t_recv_ns) : 0;
}

int es__reply_encode_error(es_job *job, uint32_t status, const char *msg) {
  Moerpc__V1__ForwardReply r = MOERPC__V1__FORWARD_REPLY__INIT;
  r.id = job->id;
  r.status = status;
  r.error = (char *)msg;
  r.queue_us = job->queue_us;
  r.compute_us = job->compute_us;
  r.server_us = es__server_us(job);
  job->status = status;
  job->reply = pr_encode(&r.base);
  return job->reply ? 0 : MR_ENOMEM;
}

/* ---- the fair queue (q_lock) ------------------------------------------------------------- */

static inline uint64_t es__key(const es_lane *ln) { return ln->head->vstart; }

static inline void es__heap_set(es_server *s, uint32_t i, es_lane *ln) {
  s->q_heap[i] = ln;
  ln->heap_idx = (int32_t)i;
}

static void es__heap_up(es_server *s, uint32_t i) {
  es_lane *ln = s->q_heap[i];
  while (i > 0) {
    uint32_t p = (i - 1) / 2;
    if (es__key(s->q_heap[p]) <= es__key(ln)) break;
    es__heap_set(s, i, s->q_heap[p]);
    i = p;
  }
  es__heap_set(s, i, ln);
}

static void es__heap_down(es_server *s, uint32_t i) {
  es_lane *ln = s->q_heap[i];
  for (;;) {
    uint32_t c = 2 * i + 1;
    if (c >= s->q_heap_len) break;
    if (c + 1 < s->q_heap_len && es__key(s->q_heap[c + 1]) < es__key(s->q_heap[c])) c++;
    if (es__key(s->q_heap[c]) >= es__key(ln)) break;
    es__heap_set(s, i, s->q_heap[c]);
    i = c;
  }
  es__heap_set(s, i, ln);
}

static void es__heap_remove(es_server *s, es_lane *ln) {
  uint32_t i = (uint32_t)ln->heap_idx;
  ln->heap_idx = -1;
  s->q_heap_len--;
  if (i == s->q_heap_len) return;
  es_lane *last = s->q_heap[s->q_heap_len];
  es__heap_set(s, i, last);
  es__heap_up(s, i);
  es__heap_down(s, (uint32_t)last->heap_idx);
}

/* After ln's head job changed: moves ln to its place in the heap, or out of it. */
static void es__heap_fix(es_server *s, es_lane *ln) {
  if (!ln->head) {
    es__heap_remove(s, ln);
    return;
  }
  es__heap_up(s, (uint32_t)ln->heap_idx);
  es__heap_down(s, (uint32_t)ln->heap_idx);
}

static es_job *es__lane_pop_locked(es_server *s, es_lane *ln) {
  es_job *j = ln->head;
  ln->head = j->next;
  if (!ln->head) ln->tail = NULL;
  ln->len--;
  s->q_len--;
  j->next = NULL;
  return j;
}

/* Appends job to its lane, stamped with its virtual start. Caller holds q_lock. The heap
 * has room: it holds lanes, one per open stream, at most q_heap_cap of them (--max-streams,
 * or the largest auto cap). */
static void es__queue_append_locked(es_server *s, es_job *job) {
  es_lane *ln = job->lane;
  uint64_t start = ln->vfinish > s->q_vtime ? ln->vfinish : s->q_vtime;
  job->vstart = start;
  ln->vfinish = start + job->n_tokens + 1u;
  job->next = NULL;
  if (ln->tail) ln->tail->next = job;
  else ln->head = job;
  ln->tail = job;
  ln->len++;
  s->q_len++;
  if (ln->heap_idx < 0) {
    MR_ASSERT(s->q_heap_len < s->q_heap_cap);
    es__heap_set(s, s->q_heap_len++, ln);
    es__heap_up(s, (uint32_t)ln->heap_idx);
  }
}

es_job *es__compute_detach(es_server *s, es_lane *ln, uint32_t *n) {
  pthread_mutex_lock(&s->q_lock);
  es_job *list = ln->head;
  *n = ln->len;
  if (list) {
    s->q_len -= ln->len;
    ln->head = ln->tail = NULL;
    ln->len = 0;
    es__heap_remove(s, ln);
  }
  pthread_mutex_unlock(&s->q_lock);
  return list;
}

void es__compute_submit(es_server *s, es_job **jobs, uint32_t n) {
  pthread_mutex_lock(&s->q_lock);
  for (uint32_t i = 0; i < n; i++) es__queue_append_locked(s, jobs[i]);
  pthread_cond_signal(&s->q_cond);
  pthread_mutex_unlock(&s->q_lock);
}

/* True for a job that must not be computed (see the top). */
static bool es__job_skip(const es_server *s, const es_job *j, uint64_t now) {
  return atomic_load_explicit(&j->lane->dead, memory_order_relaxed) ||
         atomic_load_explicit(&s->abort_jobs, memory_order_relaxed) ||
         (j->deadline_ns && now > j->deadline_ns);
}

/* Takes the next job in fair order and the queued jobs that merge with it into batch; jobs
 * that must not be computed go to *skipped (linked through next). Caller holds q_lock.
 * Returns the number of jobs in batch, 0 when none was left to compute. */
static uint32_t es__batch_take(es_server *s, es_job **batch, es_job **skipped) {
  uint64_t now = mr_now_ns();
  es_job *h = NULL;
  /* The head: the first job in fair order that is still worth computing; the ones passed
   * over on the way (dead lane, past their deadline, aborted) are answered by the caller. */
  while (!h && s->q_heap_len) {
    es_lane *ln = s->q_heap[0];
    es_job *j = es__lane_pop_locked(s, ln);
    es__heap_fix(s, ln);
    if (es__job_skip(s, j, now)) {
      j->next = *skipped;
      *skipped = j;
    } else {
      h = j;
    }
  }
  if (!h) return 0;
  s->q_vtime = h->vstart; /* V follows the job taken: new lanes start from here */
  batch[0] = h;
  uint32_t n = 1, tokens = h->n_tokens;
  /* The lanes' heads, in heap order (a snapshot: taking jobs re-orders the heap). */
  es_lane *cand[ES_MERGE_SCAN];
  uint32_t nc = s->q_heap_len < ES_MERGE_SCAN ? s->q_heap_len : ES_MERGE_SCAN;
  memcpy(cand, s->q_heap, nc * sizeof *cand);
  for (uint32_t c = 0; c < nc && n < ES_MERGE_MAX; c++) {
    es_lane *ln = cand[c];
    bool took = false;
    while (ln->head && n < ES_MERGE_MAX) {
      es_job *j = ln->head;
      /* Only the head of each lane is looked at, in the lane's own order: a lane's later
       * job never overtakes its earlier one. Same table too: a switch between two jobs
       * means two different kn_layers. */
      if (j->layer != h->layer || j->tab != h->tab || j->dtype != h->dtype || tokens + j->n_tokens > s->opts.max_tokens)
        break;
      es__lane_pop_locked(s, ln);
      took = true;
      if (es__job_skip(s, j, now)) {
        j->next = *skipped;
        *skipped = j;
        continue;
      }
      batch[n++] = j;
      tokens += j->n_tokens;
    }
    if (took) es__heap_fix(s, ln);
  }
  return n;
}

static void es__reply_fail(es_server *s, es_job *job, uint32_t status, const char *msg);

/* Answers skipped jobs (a list from es__batch_take) without computing them. No lock held. */
static void es__skipped_answer(es_server *s, es_job *list) {
  uint64_t now = mr_now_ns();
  char msg[200];
  while (list) {
    es_job *j = list;
    list = j->next;
    j->next = NULL;
    j->queue_us = es__us(now - j->t_enqueue_ns);
    if (atomic_load(&j->lane->dead)) {
      atomic_fetch_add(&s->n_dropped, 1);
      atomic_fetch_add_explicit(&s->tot_dropped, 1, memory_order_relaxed);
      es__reply_fail(s, j, GRPC_STATUS_CANCELLED, "stream cancelled: request not computed");
    } else if (atomic_load(&s->abort_jobs)) {
      es__reply_fail(s, j, GRPC_STATUS_UNAVAILABLE,
                     "server is shutting down: the drain timed out before this request ran");
    } else {
      atomic_fetch_add(&s->n_expired, 1);
      atomic_fetch_add_explicit(&s->tot_expired, 1, memory_order_relaxed);
      snprintf(msg, sizeof msg,
               "request %" PRIu64 " waited %" PRIu32 " us in the queue, past its budget_us = %" PRIu32
               ": not computed",
               j->id, j->queue_us, j->budget_us);
      es__reply_fail(s, j, GRPC_STATUS_DEADLINE_EXCEEDED, msg);
    }
  }
}

uint32_t es__compute_abort_queued(es_server *s) {
  atomic_store(&s->abort_jobs, true);
  es_job *list = NULL;
  uint32_t n = 0;
  pthread_mutex_lock(&s->q_lock);
  while (s->q_heap_len) {
    es_lane *ln = s->q_heap[0];
    while (ln->head) {
      es_job *j = es__lane_pop_locked(s, ln);
      j->next = list;
      list = j;
      n++;
    }
    es__heap_remove(s, ln);
  }
  pthread_mutex_unlock(&s->q_lock);
  es__skipped_answer(s, list);
  return n;
}

bool es__compute_busy(es_server *s) {
  pthread_mutex_lock(&s->q_lock);
  bool busy = s->computing;
  pthread_mutex_unlock(&s->q_lock);
  return busy;
}

/* Encodes job's OK reply around its buffer (which now holds the output) and queues it. */
static void es__reply_ok(es_server *s, es_job *job) {
  Moerpc__V1__ForwardReply r = MOERPC__V1__FORWARD_REPLY__INIT;
  r.id = job->id;
  r.queue_us = job->queue_us;
  r.compute_us = job->compute_us;
  r.server_us = es__server_us(job);
  r.dtype = (Moerpc__V1__DType)job->dtype;
  job->reply = pr_encode_with_payload(&r.base, job->buf->data, job->nbytes, es__buf_release, job->buf);
  if (job->reply) {
    job->buf = NULL; /* owned by the reply's slice now, returned by es__buf_release */
  } else {
    mr_log(MR_LOG_ERROR, "compute: out of memory encoding the reply to request %" PRIu64, job->id);
    es__count_error(s, GRPC_STATUS_RESOURCE_EXHAUSTED);
    /* If even this fails, the owner's done settles the job and ends its call. */
    es__reply_encode_error(job, GRPC_STATUS_RESOURCE_EXHAUSTED, "server out of memory encoding the reply");
  }
  job->ops->done(job, job->owner);
}

static void es__reply_fail(es_server *s, es_job *job, uint32_t status, const char *msg) {
  es__count_error(s, status);
  if (job->req) {
    moerpc__v1__forward_request__free_unpacked(job->req, NULL);
    job->req = NULL;
  }
  if (job->buf) {
    es__buf_release(job->buf);
    job->buf = NULL;
  }
  es__reply_encode_error(job, status, msg);
  job->ops->done(job, job->owner);
}

/* Resets the compute arena after a batch; shrinks it back after a peak (see the top). */
static void es__arena_done(es_server *s) {
  size_t used = s->arena.used;
  mr_arena_reset(&s->arena);
  if (used > s->arena_recent_peak) s->arena_recent_peak = used;
  if (used * 4 >= s->arena_recent_peak) {
    s->arena_small_runs = 0;
  } else if (++s->arena_small_runs >= ES_ARENA_SHRINK_AFTER) {
    mr_arena_shrink(&s->arena);
    s->arena_recent_peak = used;
    s->arena_small_runs = 0;
  }
}

/* MOERPC_TEST_NONFINITE_LAYER (test only, tests/README.md): makes this server the faulty
 * one the client's reply check is there for. The first element of the last token's row of
 * an OK reply becomes NaN in the wire dtype, after the output check, so that it crosses
 * the wire with status OK. */
static void es__test_corrupt(es_job *b, uint32_t H) {
  size_t i = (size_t)(b->n_tokens - 1) * H;
  if (b->dtype == MR_DTYPE_F32) {
    uint32_t nan32 = 0x7fc00000u;
    memcpy((uint8_t *)b->buf->data + 4 * i, &nan32, 4);
  } else {
    uint16_t nan16 = b->dtype == MR_DTYPE_F16 ? 0x7e00u : 0x7fc0u;
    memcpy((uint8_t *)b->buf->data + 2 * i, &nan16, 2);
  }
}

/* Runs one batch of same-layer, same-dtype jobs and answers each of them. */
static void es__batch_run(es_server *s, es_job **batch, uint32_t n) {
  const uint32_t H = s->cfg.hidden_size, E = s->cfg.num_experts;
  const es_job *h = batch[0];
  mr_err e;
  mr_err_clear(&e);
  uint64_t t0 = mr_now_ns();
  for (uint32_t j = 0; j < n; j++) batch[j]->queue_us = es__us(t0 - batch[j]->t_enqueue_ns);
  if (s->test_batch_delay_ms) usleep(s->test_batch_delay_ms * 1000u);

  uint32_t T = 0, k = 0;
  for (uint32_t j = 0; j < n; j++) {
    T += batch[j]->n_tokens;
    if (batch[j]->top_k > k) k = batch[j]->top_k;
  }
  size_t esize = mr_dtype_size(h->dtype);
  kn_moe_args a = {.n_tokens = T, .top_k = k, .x_dtype = h->dtype};
  float *out = mr_arena_alloc(&s->arena, (size_t)T * H * sizeof(float), 64);
  int rc = out ? 0 : MR_ENOMEM;
  if (rc == 0 && n == 1) {
    a.ids = h->req->expert_ids;
    a.weights = h->req->weights;
    a.x = h->buf->data;
  } else if (rc == 0) {
    uint8_t *x = mr_arena_alloc(&s->arena, (size_t)T * H * esize, 64);
    int32_t *ids = mr_arena_alloc(&s->arena, (size_t)T * k * sizeof *ids, 64);
    float *w = mr_arena_alloc(&s->arena, (size_t)T * k * sizeof *w, 64);
    if (!x || !ids || !w) {
      rc = MR_ENOMEM;
    } else {
      size_t row = 0;
      for (uint32_t j = 0; j < n; j++) {
        const es_job *b = batch[j];
        memcpy(x + row * H * esize, b->buf->data, b->nbytes);
        for (uint32_t t = 0; t < b->n_tokens; t++) {
          int32_t *di = ids + (row + t) * k;
          float *dw = w + (row + t) * k;
          memcpy(di, b->req->expert_ids + (size_t)t * b->top_k, b->top_k * sizeof *di);
          memcpy(dw, b->req->weights + (size_t)t * b->top_k, b->top_k * sizeof *dw);
          for (uint32_t q = b->top_k; q < k; q++) {
            di[q] = -1;
            dw[q] = 0.0f;
          }
        }
        row += b->n_tokens;
      }
      a.ids = ids;
      a.weights = w;
      a.x = x;
    }
  }
  if (rc == 0 && atomic_load(&h->tab->bad)) {
    /* Validated before a corrupt cache file was found: never computed on those weights. */
    rc = MR_EUNAVAIL;
    for (uint32_t j = 0; j < n; j++)
      es__reply_fail(s, batch[j], (uint32_t)pr_status_from_mr(rc),
                     "the weight cache failed its checksum: its weights are not served while they "
                     "are repacked from the model; send to another replica or retry");
    es__arena_done(s);
    return;
  }
  if (rc == 0) {
    a.out = out;
    rc = kn_moe_forward(s->eng, h->tab->layers[h->layer], &a, &s->arena, &e);
  } else {
    mr_err_set(&e, rc, "server out of memory for a batch of %" PRIu32 " tokens", T);
  }
  uint64_t t1 = mr_now_ns();
  uint32_t compute_us = es__us(t1 - t0);

  if (rc) {
    /* Validation admitted these requests, so the kernel refusing them is our bug (or memory). */
    mr_log(MR_LOG_ERROR, "compute: layer %" PRIu32 ", %" PRIu32 " request(s), %" PRIu32 " tokens: %s",
           h->layer, n, T, e.msg);
    for (uint32_t j = 0; j < n; j++) {
      batch[j]->compute_us = compute_us;
      es__reply_fail(s, batch[j], (uint32_t)pr_status_from_mr(rc), e.msg);
    }
    es__arena_done(s);
    return;
  }

  size_t row = 0;
  uint64_t sum_queue = 0;
  mr_hist *lh = &s->layer_hist[h->layer];
  for (uint32_t j = 0; j < n; j++) {
    es_job *b = batch[j];
    b->compute_us = compute_us;
    sum_queue += b->queue_us;
    /* Metrics: every request of the batch took the batch's time (lock-free, mr.h). */
    mr_hist_observe(lh, t1 - t0);
    mr_hist_observe(&s->queue_hist, t0 > b->t_enqueue_ns ? t0 - b->t_enqueue_ns : 0);
    atomic_fetch_add_explicit(&s->layer_tokens[b->layer], b->n_tokens, memory_order_relaxed);
    /* Finite inputs can still give outputs that are not finite on the wire: over fp32's
     * range, or (far more often) over f16's 65504 once converted. The check reads the
     * converted bytes, so it judges exactly what would be sent; this job alone fails. */
    mr_convert_from_f32(b->buf->data, b->dtype, out + row * H, (size_t)b->n_tokens * H);
    if (es_output_check_finite(b->buf->data, b->dtype, out + row * H, b->layer, b->n_tokens, H,
                               &e) != 0) {
      mr_log_ratelimited(MR_LOG_WARN, 5, "forward from %s: request %" PRIu64 ": INTERNAL: %s",
                         b->lane->name, b->id, e.msg);
      row += b->n_tokens;
      es__reply_fail(s, b, GRPC_STATUS_INTERNAL, e.msg);
      continue;
    }
    if (s->test_nonfinite_layer == (int64_t)b->layer) es__test_corrupt(b, H);
    PR_HB_RELEASE(b->buf); /* the last write before gRPC takes the buffer */
    row += b->n_tokens;
    /* Tokens per (layer, expert), for Stats and placement. */
    size_t slots = (size_t)b->n_tokens * b->top_k;
    atomic_ullong *cnt = s->tokens + (size_t)b->layer * E;
    for (size_t q = 0; q < slots; q++) {
      int32_t id = b->req->expert_ids[q];
      if (id >= 0) atomic_fetch_add_explicit(&cnt[id], 1, memory_order_relaxed);
    }
    moerpc__v1__forward_request__free_unpacked(b->req, NULL);
    b->req = NULL;
    es__reply_ok(s, b);
  }
  es__arena_done(s);
  atomic_fetch_add(&s->n_batches, 1);
  atomic_fetch_add(&s->n_merged, n - 1);
  atomic_fetch_add(&s->n_computed, n);
  atomic_fetch_add(&s->sum_queue_us, sum_queue);
  atomic_fetch_add(&s->sum_compute_us, (uint64_t)compute_us * n);
}

/* ---- the engine for one job, on the caller's thread (es_inline.c) ------------------------- */

bool es__compute_claim(es_server *s) {
  pthread_mutex_lock(&s->q_lock);
  bool idle = !s->q_heap_len && !s->computing;
  if (idle) s->computing = true;
  pthread_mutex_unlock(&s->q_lock);
  return idle;
}

void es__compute_run_one(es_server *s, es_job *job) {
  if (es__job_skip(s, job, mr_now_ns())) es__skipped_answer(s, job);
  else es__batch_run(s, &job, 1);
}

void es__compute_release(es_server *s) {
  pthread_mutex_lock(&s->q_lock);
  s->computing = false;
  /* Jobs queued meanwhile waited for the engine: the compute thread may take them now. */
  if (s->q_heap_len) pthread_cond_signal(&s->q_cond);
  pthread_mutex_unlock(&s->q_lock);
}

/* ---- the compute thread -------------------------------------------------------------------- */

bool es__compute_pin(es_server *s, const char *who) {
  /* One thread: no pool thread to collide with, and several such servers on one host
   * would all be pinned to the same first core. */
  if (kn_engine_threads(s->eng) < 2) return false;
  if (atomic_load_explicit(&s->pin_refused, memory_order_relaxed)) return false;
  mr_err e;
  if (kn_engine_pin_caller(s->eng, &e) == 0) return true;
  if (!atomic_exchange(&s->pin_refused, true))
    mr_log(MR_LOG_WARN, "%s: %s; no thread that runs the engine is pinned from now on", who, e.msg);
  return false;
}

static void *es__compute_main(void *arg) {
  es_server *s = arg;
  es_job *batch[ES_MERGE_MAX];
  pthread_setname_np(pthread_self(), "es-compute");
  /* This thread does worker 0's share of every batch it runs: on worker 0's core, not on
   * a pool thread's (es_inline.c says what that costs). */
  (void)es__compute_pin(s, "the compute thread");
  for (;;) {
    pthread_mutex_lock(&s->q_lock);
    /* Wait for work and for the engine (a CQ thread may be running a job inline); stop
     * only once the queue is empty. */
    while ((!s->q_heap_len || s->computing) && !(s->q_stop && !s->q_heap_len))
      pthread_cond_wait(&s->q_cond, &s->q_lock);
    /* Signalled by es__compute_submit, es__compute_release and es__compute_stop. */
    if (!s->q_heap_len) {
      pthread_mutex_unlock(&s->q_lock);
      break;
    }
    s->computing = true;
    es_job *skipped = NULL;
    uint32_t n = es__batch_take(s, batch, &skipped);
    pthread_mutex_unlock(&s->q_lock);
    es__skipped_answer(s, skipped);
    if (n) es__batch_run(s, batch, n);
    pthread_mutex_lock(&s->q_lock);
    s->computing = false;
    pthread_mutex_unlock(&s->q_lock);
  }
  return NULL;
}

int es__compute_start(es_server *s, mr_err *e) {
  const char *bad = getenv("MOERPC_TEST_NONFINITE_LAYER");
  s->test_nonfinite_layer = -1;
  if (bad && bad[0]) {
    s->test_nonfinite_layer = (int64_t)strtoul(bad, NULL, 10);
    mr_log(MR_LOG_WARN, "MOERPC_TEST_NONFINITE_LAYER=%" PRId64 ": test only: OK replies of that "
           "layer carry a NaN", s->test_nonfinite_layer);
  }
  const char *slow = getenv("MOERPC_TEST_BATCH_DELAY_MS");
  s->test_batch_delay_ms = slow && slow[0] ? (uint32_t)strtoul(slow, NULL, 10) : 0;
  if (s->test_batch_delay_ms)
    mr_log(MR_LOG_WARN, "MOERPC_TEST_BATCH_DELAY_MS=%" PRIu32 ": test only: every batch sleeps that long",
           s->test_batch_delay_ms);
  int err = pthread_create(&s->compute_thread, NULL, es__compute_main, s);
  if (err) return mr_err_set(e, MR_EINTERNAL, "cannot start the compute thread: error %d", err);
  s->compute_started = true;
  return 0;
}

void es__compute_stop(es_server *s) {
  if (!s->compute_started) return;
  pthread_mutex_lock(&s->q_lock);
  s->q_stop = true;
  pthread_cond_broadcast(&s->q_cond);
  pthread_mutex_unlock(&s->q_lock);
  pthread_join(s->compute_thread, NULL);
  s->compute_started = false;
}
