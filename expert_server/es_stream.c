/*
 * es_stream.c - the Forward streams: decode + validate each request, hand it to the compute
 * side (es__inline_offer), take its reply back (es_job_ops) and send the replies one at a
 * time through the stream's send queue; admission (the byte budget) and the stall cut.
 *
 * One Forward stream, as batches on its call:
 *
 *   accept   {SEND_INITIAL_METADATA, RECV_MESSAGE}                           -> t_recv
 *            {RECV_CLOSE_ON_SERVER}: completes when the call ends; if the client cancelled
 *            it (or the connection broke) the stream is dead at once: its queued jobs are
 *            taken out of the compute queue and their memory freed     -> t_close
 *            (over --max-streams, or during a drain: {SEND_INITIAL_METADATA} and the final
 *            batch with RESOURCE_EXHAUSTED / UNAVAILABLE, nothing read)
 *   request  RECV_MESSAGE completes with a message: decode + validate; a valid request goes
 *            to the compute side (or is held in the CQ thread's inline slot, es_inline.c), a
 *            bad one gets an error reply at once; re-arm {RECV_MESSAGE} (one is outstanding
 *            while the stream is open, except while its request is held: then the re-arm
 *            waits for the slot to let go of it, es__stream_recv_resume, because gRPC
 *            answers the re-arm with a WINDOW_UPDATE write that would otherwise go out on
 *            its own ahead of the reply)
 *   reply    whoever answered the job (the compute thread, the CQ thread inline, the admin
 *            thread after a drain timeout) hands it back through es__stream_job_ops: the
 *            encoded reply joins the send queue; if no SEND_MESSAGE is in flight that thread
 *            starts {SEND_MESSAGE} itself (under the lock), else the CQ thread starts the
 *            next one when the current send completes                          -> t_send
 *   end      RECV_MESSAGE completes empty (half-close) or fails (client gone), or the drain
 *            asks to finish: once nothing is pending,
 *            {SEND_STATUS_FROM_SERVER OK}                                      -> t_final
 *   free     after t_final, t_close and any outstanding t_recv have completed (CQ thread)
 *
 * The read side, as flags under st->lock (at most one of the first four holds):
 *
 *   recv_inflight  a RECV_MESSAGE is armed
 *   recv_held      its request sits in the inline slot; es__stream_recv_resume re-arms
 *   recv_paused    over its own limits (ES_STREAM_MAX_*); re-armed below half of them
 *   mem_paused     over the server's byte budget; re-armed by es__streams_service or the
 *                  next completed send once the budget has room
 *   recv_done      never again: half-close, a failed call, a refusal, or the drain
 *
 * A stream may end only when recv_done (or finish_requested) holds and nothing is pending
 * (es__stream_maybe_finish_locked), and may be freed only when no batch of its call is
 * outstanding and no thread is inside a handler for it (es__stream_dead_locked).
 *
 * Admission: before re-arming RECV the stream checks its own limits (ES_STREAM_MAX_*) and
 * reserves its next message's size in the server's byte budget (es__stream_reserve_locked:
 * held + reserved bytes under max_inflight_bytes less the streams' room, and less the
 * reserve for a stream that is not light); over the budget it pauses
 * (mem_paused) until es__streams_service, run by the admin loop when bytes are returned,
 * re-arms it. Meanwhile the stream's own HTTP/2 window (stream_window, fixed: BDP probing
 * is off) holds its client; the connection and its other streams go on. A reply whose send has not completed after
 * --stall-timeout-ms (the client stopped reading) cuts the stream with RESOURCE_EXHAUSTED,
 * which frees what it held.
 *
 * Threads: the CQ thread of the call runs every es__on_stream_* handler and
 * es__stream_recv_resume; whoever answers a job runs es__stream_send (through the job's
 * ops); the admin thread runs es__streams_finish and es__streams_service. The shared fields
 * are under es_stream.lock (after streams_lock, before q_lock: internal.h). Only the CQ
 * thread frees a stream.
 */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "expert_server/internal.h"

/* Backpressure: a stream with this many requests (or bytes) taken and not yet answered and
 * sent stops being read until it is below half of both again. HTTP/2 flow control then holds
 * the client back, so a client that sends without reading its replies cannot grow the
 * server's memory without bound; well-behaved clients keep far fewer requests in flight. */
#define ES_STREAM_MAX_PENDING 128u
#define ES_STREAM_MAX_BYTES ((size_t)64 << 20)

/* Charges n bytes to the admission budget (any thread). */
static void es__held_add(es_server *s, size_t n) {
  long long now = atomic_fetch_add(&s->held_bytes, (long long)n) + (long long)n;
  long long peak = atomic_load(&s->held_peak);
  while (now > peak && !atomic_compare_exchange_weak(&s->held_peak, &peak, now)) {
  }
}

/* Returns n bytes; wakes the admin loop to resume paused streams once below the budget. */
static void es__held_sub(es_server *s, size_t n) {
  atomic_fetch_sub(&s->held_bytes, (long long)n);
  if (atomic_load(&s->mem_paused) > 0) es__admin_wake(s); /* paused streams may fit now */
}

uint64_t es__inflight_budget(const es_server *s) {
  uint64_t max_req = (uint64_t)s->opts.max_tokens * s->cfg.hidden_size * 4u;
  uint64_t floor = max_req * ES_INFLIGHT_MIN_REQUESTS;
  uint64_t b = s->opts.max_inflight_bytes;
  if (b == 0) {
    uint64_t avail;
    b = es__mem_available(&avail) ? avail / 4 : 0;
    if (b < ES_AUTO_INFLIGHT_MIN) b = ES_AUTO_INFLIGHT_MIN;
    if (b > ES_AUTO_INFLIGHT_MAX) b = ES_AUTO_INFLIGHT_MAX;
  }
  return b < floor ? floor : b;
}

uint32_t es__auto_max_streams(uint64_t budget) {
  uint64_t n = budget / ES_STREAM_SHARE;
  if (n < ES_AUTO_STREAMS_MIN) n = ES_AUTO_STREAMS_MIN;
  if (n > ES_AUTO_STREAMS_MAX) n = ES_AUTO_STREAMS_MAX;
  return (uint32_t)n;
}

bool es__streams_size(es_server *s) {
  if (!s->max_streams) s->max_streams = es__auto_max_streams(s->max_inflight_bytes);
  uint64_t room = (uint64_t)s->max_streams * s->stream_charge;
  bool fits = room <= s->max_inflight_bytes / 2;
  s->stream_room = fits ? (size_t)room : s->max_inflight_bytes / 2;
  return fits;
}

size_t es__stream_window(uint64_t budget, uint32_t max_streams) {
  uint64_t w = max_streams ? budget / 8 / max_streams : ES_STREAM_SHARE / 8;
  if (w < ES_STREAM_WINDOW_MIN) w = ES_STREAM_WINDOW_MIN;
  if (w > ES_STREAM_WINDOW_MAX) w = ES_STREAM_WINDOW_MAX;
  return (size_t)w;
}

/* Releases what a settled job holds (reply, request header, buffer, table reference), its
 * units of the inflight count and of the byte budget, and returns it to the pool. */
static void es__job_release(es_server *s, es_job *job) {
  if (job->reply) grpc_byte_buffer_destroy(job->reply);
  if (job->req) moerpc__v1__forward_request__free_unpacked(job->req, NULL);
  if (job->buf) es__buf_release(job->buf);
  es__tab_put(job->tab);
  job->tab = NULL;
  if (job->counted) {
    /* Lost by the server only when its drain cut the call: a reply that a client cancelled
     * or disconnected from (greedy_close in itest_overload) has nobody to go to. */
    if (!job->sent && atomic_load(&s->cancelled_all)) atomic_fetch_add(&s->lost_in_drain, 1);
    es__counter_dec(s, &s->inflight);
  }
  if (job->held) es__held_sub(s, job->held);
  es__job_put(&s->pool, job);
}

void es__stream_free(es_stream *st) {
  es_server *s = st->srv;
  pthread_mutex_lock(&s->streams_lock);
  if (st->prev) st->prev->next = st->next;
  else if (s->streams == st) s->streams = st->next;
  if (st->next) st->next->prev = st->prev;
  if (st->listed) s->n_streams--;
  pthread_mutex_unlock(&s->streams_lock);
  if (st->mem_paused) atomic_fetch_sub(&s->mem_paused, 1);
  bool was_live = st->t_new.obj == NULL; /* see es__on_stream_new */
  if (st->recv_bb) grpc_byte_buffer_destroy(st->recv_bb);
  grpc_metadata_array_destroy(&st->md);
  grpc_slice_unref(st->details);
  pr_split_free(&st->split);
  mr_free((void *)st->used);
  if (st->call) grpc_call_unref(st->call);
  pthread_mutex_destroy(&st->lock);
  mr_free(st);
  if (was_live) es__counter_dec(s, &s->live_calls);
}

void es__stream_post(es_server *s, es_cq_thread *t) {
  es_stream *st = mr_calloc(1, sizeof *st);
  if (!st) {
    mr_log(MR_LOG_ERROR, "grpc: out of memory posting a Forward call");
    return;
  }
  st->srv = s;
  st->cq_thread = t;
  /* The pairs its requests name, for the unload grace (es__leaving_service); NULL when out
   * of memory, which the service counts as "uses every pair". */
  st->used = mr_calloc(((size_t)s->cfg.num_layers * s->cfg.num_experts + 63) / 64,
                       sizeof *st->used);
  st->details = grpc_empty_slice();
  grpc_metadata_array_init(&st->md);
  pthread_mutex_init(&st->lock, NULL);
  st->t_new = (es_tag){ES_TAG_STREAM_NEW, st};
  st->t_recv = (es_tag){ES_TAG_STREAM_RECV, st};
  st->t_send = (es_tag){ES_TAG_STREAM_SEND, st};
  st->t_final = (es_tag){ES_TAG_STREAM_FINAL, st};
  st->t_close = (es_tag){ES_TAG_STREAM_CLOSE, st};
  st->t_init = (es_tag){ES_TAG_STREAM_INIT, st};
  st->lane.heap_idx = -1;
  st->lane.name = st->peer;
  st->final_status = GRPC_STATUS_OK;
  atomic_init(&st->lane.dead, false);
  grpc_call_error ce = grpc_server_request_registered_call(s->gs, s->rm[ES_M_FORWARD], &st->call,
                                                           &st->deadline, &st->md, NULL, t->cq, t->cq,
                                                           &st->t_new);
  if (ce != GRPC_CALL_OK) {
    if (!atomic_load(&s->stop_reposting))
      mr_log(MR_LOG_ERROR, "grpc: request_registered_call(Forward) failed: %d", ce);
    es__stream_free(st);
  }
}

/* True when nothing refers to st any more: only then may the CQ thread free it. Every
 * batch of the call has completed (the final one; the close one, if it was started; a
 * RECV; a lone initial metadata) and no handler is inside es__stream_on_request (busy).
 * Jobs cannot still point at it: the final batch starts only once jobs_pending is 0. */
static bool es__stream_dead_locked(const es_stream *st) {
  return st->final_done && (st->close_done || !st->close_started) && !st->recv_inflight &&
         !st->init_inflight && !st->busy;
}

/* Bytes reserved for st's next message: the size of its last request, or for a stream
 * that has sent none yet the largest a request can be (max_tokens rows of f32). */
static size_t es__stream_expect(const es_stream *st) {
  if (st->expect) return st->expect;
  const es_server *s = st->srv;
  return es__request_cost(s->pool_max_buf, s->opts.max_tokens, s->limits.max_top_k);
}

/* Starts RECV_MESSAGE (with SEND_INITIAL_METADATA the first time). Caller holds st->lock. */
static void es__stream_recv_locked(es_stream *st, bool first) {
  grpc_op ops[2];
  size_t n = 0;
  memset(ops, 0, sizeof ops);
  if (first) {
    ops[n].op = GRPC_OP_SEND_INITIAL_METADATA;
    n++;
    st->initial_sent = true;
  }
  ops[n].op = GRPC_OP_RECV_MESSAGE;
  ops[n].data.recv_message.recv_message = &st->recv_bb;
  n++;
  grpc_call_error ce = grpc_call_start_batch(st->call, ops, n, &st->t_recv, NULL);
  if (ce != GRPC_CALL_OK) {
    mr_log(MR_LOG_ERROR, "stream %s: start_batch(RECV_MESSAGE) failed: %d", st->peer, ce);
    /* No message can come: the stream is done reading, and the room reserved for the
     * message goes back to the budget at once (no completion will return it). */
    st->recv_done = true;
    atomic_fetch_sub(&st->srv->reserved_bytes, (long long)st->reserved);
    st->reserved = 0;
    return;
  }
  st->recv_inflight = true;
}

/* Starts the final batch once the stream is closing and nothing is pending. Any thread;
 * caller holds st->lock. */
static void es__stream_maybe_finish_locked(es_stream *st) {
  /* Not while the CQ thread is inside es__stream_on_request (busy: a request is being
   * taken and will be pending in a moment) nor while any request waits for its reply or
   * for its send: the status must follow the last reply on the wire. */
  if (st->final_started || st->busy || st->jobs_pending > 0) return;
  /* Only once nothing more will be read, or the drain asked the stream to end. */
  if (!st->recv_done && !st->finish_requested) return;
  /* Every reply is settled (jobs_pending 0), so neither a send nor a queued reply is left. */
  MR_ASSERT(!st->sending && !st->sq_head);
  st->final_started = true;
  grpc_op ops[2];
  size_t n = 0;
  memset(ops, 0, sizeof ops);
  if (!st->initial_sent) { /* a stream refused at accept */
    ops[n++].op = GRPC_OP_SEND_INITIAL_METADATA;
    st->initial_sent = true;
  }
  ops[n].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
  ops[n].data.send_status_from_server.status = (grpc_status_code)st->final_status;
  ops[n].data.send_status_from_server.status_details = &st->details;
  n++;
  grpc_call_error ce = grpc_call_start_batch(st->call, ops, n, &st->t_final, NULL);
  if (ce != GRPC_CALL_OK) {
    /* Our bug: cancel the call so that an outstanding RECV completes and frees the stream. */
    mr_log(MR_LOG_ERROR, "stream %s: start_batch(SEND_STATUS) failed: %d", st->peer, ce);
    st->final_done = true;
    grpc_call_cancel(st->call, NULL);
  }
}

/* Takes a finished (sent or dropped) job off the stream's pending counts and releases it.
 * Caller holds st->lock. */
static void es__stream_settle_locked(es_stream *st, es_job *j) {
  MR_ASSERT(st->jobs_pending > 0 && st->bytes_pending >= j->nbytes);
  st->jobs_pending--;
  st->bytes_pending -= j->nbytes;
  es__job_release(st->srv, j);
}

/* True while the stream holds more unanswered work than a client should keep in flight:
 * div 1 to decide to pause, div 2 to decide to resume (below half of both limits), so that
 * a stream at the edge does not flip between the two on every reply. */
static bool es__stream_over_limit_locked(const es_stream *st, uint32_t div) {
  size_t max_bytes = ES_STREAM_MAX_BYTES;
  size_t max_req = (size_t)st->srv->opts.max_tokens * st->srv->cfg.hidden_size * 4u;
  if (max_bytes < 2 * max_req) max_bytes = 2 * max_req; /* always room for two requests */
  return st->jobs_pending >= ES_STREAM_MAX_PENDING / div || st->bytes_pending >= max_bytes / div;
}

/* The budget rule: the next request of st must fit what the byte budget leaves for requests
 * (held bytes plus the reservations of every armed RECV). The budget first sets aside the
 * streams' own room (stream_room: --max-streams windows and states, at most half of it);
 * of the rest, a quarter of the budget (at least one largest request, as the floor of the
 * budget ensures) is a reserve only a light stream may use (nothing pending, small or no
 * requests so far): a light client, or one that just connected, then gets in while greedy
 * streams hold the remainder. Windows, requests and replies together never
 * take more than the budget itself. */
/* Reserves the room of st's next message for the RECV the caller is about to arm, or
 * returns false, reserving nothing, when it does not fit (the rule above). Reserving first
 * and checking after makes two threads that admit streams at once unable to both take the
 * last room. Caller holds st->lock. */
static bool es__stream_reserve_locked(es_stream *st) {
  es_server *s = st->srv;
  long long want = (long long)es__stream_expect(st);
  long long limit = (long long)(s->max_inflight_bytes - s->stream_room);
  /* The reserve is for light streams: nothing pending, and a last request of at most an
   * eighth of the reserve (or none yet). A greedy stream whose replies have all gone out
   * has nothing pending for a moment too; were it let in, greedy streams would fill the
   * reserve between their requests and a newcomer would wait for bytes to come back. */
  long long reserve = (long long)(s->max_inflight_bytes / 4);
  bool light = st->jobs_pending == 0 && (long long)st->expect <= reserve / 8;
  if (!light) limit -= reserve;
  /* r counts this reservation with every other one, so of two threads racing for the last
   * room at least one sees the other's and backs off. held_bytes may move meanwhile; it
   * only grows by requests that had reserved their room first. */
  long long r = atomic_fetch_add(&s->reserved_bytes, want) + want;
  if (atomic_load(&s->held_bytes) + r > limit) {
    atomic_fetch_sub(&s->reserved_bytes, want);
    return false;
  }
  st->reserved = (size_t)want;
  return true;
}

/* Re-arms RECV unless a limit says wait: the stream's own (recv_paused, re-armed by
 * es__on_stream_send below half) or the server's budget (mem_paused, re-armed by
 * es__streams_service). Caller holds st->lock; the stream is open for reading. */
static void es__stream_rearm_locked(es_stream *st) {
  if (es__stream_over_limit_locked(st, 1)) {
    st->recv_paused = true;
    mr_log(MR_LOG_DEBUG, "stream %s: %" PRIu32 " requests / %zu bytes pending, pausing reads",
           st->peer, st->jobs_pending, st->bytes_pending);
  } else if (!es__stream_reserve_locked(st)) {
    if (!st->mem_paused) atomic_fetch_add(&st->srv->mem_paused, 1);
    st->mem_paused = true;
  } else {
    es__stream_recv_locked(st, false);
  }
}

/* Takes st's queued jobs out of the compute queue and releases them: the call is dead, nobody
 * will read their replies. Caller holds st->lock (q_lock comes after it). A job in a CQ
 * thread's inline slot is not in the queue: it is answered CANCELLED, uncomputed, when the
 * slot runs (lane.dead), and its send then fails like any other. */
static void es__stream_purge_locked(es_stream *st) {
  uint32_t n = 0;
  es_job *list = es__compute_detach(st->srv, &st->lane, &n);
  if (!n) return;
  atomic_fetch_add(&st->srv->n_dropped, n);
  atomic_fetch_add_explicit(&st->srv->tot_dropped, n, memory_order_relaxed);
  mr_log(MR_LOG_DEBUG, "stream %s: dead, %" PRIu32 " queued requests dropped", st->peer, n);
  while (list) {
    es_job *j = list;
    list = j->next;
    j->next = NULL;
    es__stream_settle_locked(st, j);
  }
}

/* Marks the call dead for sending. A paused stream will never be read again either, so it
 * counts as done receiving (else it could never finish). Caller holds st->lock. */
static void es__stream_fail_locked(es_stream *st) {
  st->send_failed = true;
  atomic_store(&st->lane.dead, true);
  if (st->recv_paused || st->mem_paused) {
    if (st->mem_paused) atomic_fetch_sub(&st->srv->mem_paused, 1);
    st->recv_paused = st->mem_paused = false;
    st->recv_done = true;
  }
  es__stream_purge_locked(st);
}

/* Drops every queued reply (the call is dead). Caller holds st->lock. */
static void es__stream_drop_queue_locked(es_stream *st) {
  while (st->sq_head) {
    es_job *j = st->sq_head;
    st->sq_head = j->next;
    es__stream_settle_locked(st, j);
  }
  st->sq_tail = NULL;
}

/* Starts SEND_MESSAGE for the head of the send queue. Caller holds st->lock, no send is in
 * flight and the queue is not empty. */
static void es__stream_send_next_locked(es_stream *st) {
  MR_ASSERT(!st->sending && st->sq_head);
  es_job *j = st->sq_head;
  st->sq_head = j->next;
  if (!st->sq_head) st->sq_tail = NULL;
  j->next = NULL;
  st->sending = j;
  st->send_t0_ns = mr_now_ns();
  grpc_op op;
  memset(&op, 0, sizeof op);
  op.op = GRPC_OP_SEND_MESSAGE;
  op.data.send_message.send_message = j->reply;
  j->reply_bytes = grpc_byte_buffer_length(j->reply); /* gRPC may empty it as it sends */
  grpc_call_error ce = grpc_call_start_batch(st->call, &op, 1, &st->t_send, NULL);
  if (ce != GRPC_CALL_OK) {
    mr_log(MR_LOG_ERROR, "stream %s: start_batch(SEND_MESSAGE) failed: %d", st->peer, ce);
    st->sending = NULL;
    es__stream_fail_locked(st);
    es__stream_settle_locked(st, j);
    es__stream_drop_queue_locked(st);
    grpc_call_cancel(st->call, NULL);
  }
}

/* Queues job's encoded reply and starts its send if none is in flight; a job without a
 * reply (out of memory) ends the call. Any thread; takes st->lock. */
static void es__stream_send(es_stream *st, es_job *job) {
  pthread_mutex_lock(&st->lock);
  if (!job->reply && !st->send_failed) {
    /* No reply could be encoded (out of memory): end the stream so the client learns. */
    mr_log(MR_LOG_ERROR, "stream %s: no reply for request %" PRIu64 " (out of memory); cancelling",
           st->peer, job->id);
    grpc_call_cancel_with_status(st->call, GRPC_STATUS_RESOURCE_EXHAUSTED, "server out of memory", NULL);
    es__stream_fail_locked(st);
    if (!st->sending) es__stream_drop_queue_locked(st);
  }
  if (st->send_failed) {
    /* Nobody will read it: settle it now, and this may have been the last pending job the
     * final batch waited for. */
    es__stream_settle_locked(st, job);
    es__stream_maybe_finish_locked(st);
  } else {
    /* One SEND_MESSAGE in flight per call (gRPC's rule): queue behind it, or start now. */
    job->next = NULL;
    if (st->sq_tail) st->sq_tail->next = job;
    else st->sq_head = job;
    st->sq_tail = job;
    if (!st->sending) es__stream_send_next_locked(st);
  }
  pthread_mutex_unlock(&st->lock);
}

static void es__stream_recv_resume(es_stream *st);

/* How a job comes back to its stream (es_job_ops, internal.h): its reply goes to the send
 * queue; a request held in the inline slot re-arms the RECV it held back. */
static void es__stream_job_done(es_job *job, void *owner) { es__stream_send(owner, job); }
static void es__stream_job_released(void *owner) { es__stream_recv_resume(owner); }
static const es_job_ops es__stream_job_ops = {
    .done = es__stream_job_done,
    .released = es__stream_job_released,
};

/* Makes st the owner of a new job: its lane, its way back. */
static void es__stream_job_init(es_stream *st, es_job *job) {
  job->lane = &st->lane;
  job->ops = &es__stream_job_ops;
  job->owner = st;
}

/* Answers one request of st at once with an error (CQ thread). counted: the request holds a
 * unit of srv->inflight, handed to the job. */
static void es__stream_reply_error(es_stream *st, uint64_t id, uint32_t status, const char *msg,
                                   bool counted) {
  es_server *s = st->srv;
  es__count_error(s, status);
  if (status == GRPC_STATUS_UNAVAILABLE)
    mr_log_ratelimited(MR_LOG_INFO, 5, "forward from %s: request %" PRIu64 ": %s: %s", st->peer, id,
                       pr_status_name((grpc_status_code)status), msg);
  else
    mr_log_ratelimited(MR_LOG_WARN, 5, "forward from %s: request %" PRIu64 ": %s: %s", st->peer, id,
                       pr_status_name((grpc_status_code)status), msg);
  es_job *job = es__job_get(&s->pool);
  if (job) {
    es__stream_job_init(st, job);
    job->id = id;
    job->status = status;
    job->counted = counted;
    if (es__reply_encode_error(job, status, msg) == 0) {
      pthread_mutex_lock(&st->lock);
      st->jobs_pending++;
      pthread_mutex_unlock(&st->lock);
      es__stream_send(st, job);
      return;
    }
    job->counted = false;
    es__job_put(&s->pool, job);
  }
  /* Out of memory even for an error reply: end the stream so the client learns. */
  mr_log(MR_LOG_ERROR, "stream %s: out of memory replying to request %" PRIu64 "; cancelling the stream",
         st->peer, id);
  if (counted) es__counter_dec(s, &s->inflight);
  grpc_call_cancel_with_status(st->call, GRPC_STATUS_RESOURCE_EXHAUSTED, "server out of memory", NULL);
}

/* Handles one received ForwardRequest (CQ thread; st->busy is set, so the stream cannot be
 * finished underneath). The payload is gathered from bb's slices once, into a pool buffer. */
static bool es__stream_on_request(es_stream *st, grpc_byte_buffer *bb) {
  const uint64_t t_recv = mr_now_ns(); /* ForwardReply.server_us counts from here */
  es_server *s = st->srv;
  mr_err e;
  char msg[700];
  pr_seg *segs = NULL;
  size_t nseg = 0;
  Moerpc__V1__ForwardRequest *req = NULL;
  uint64_t id = 0;
  bool held = false;
  mr_err_clear(&e);
  atomic_fetch_add(&s->n_requests, 1);
  atomic_fetch_add(&s->tot_requests, 1);
  atomic_fetch_add_explicit(&s->bytes_in, grpc_byte_buffer_length(bb), memory_order_relaxed);

  int rc = pr_bb_segs(bb, &segs, &nseg, &e);
  if (rc == 0) rc = pr_forward_request_decode(segs, nseg, &st->split, &req, &e);
  if (rc) {
    /* Garbage: there is no id to echo, so the reply carries id 0. */
    snprintf(msg, sizeof msg, "ForwardRequest does not decode: %s", e.msg);
    es__stream_reply_error(st, 0,
                           rc == MR_ENOMEM ? GRPC_STATUS_RESOURCE_EXHAUSTED : GRPC_STATUS_INVALID_ARGUMENT,
                           msg, false);
    goto out_free_input;
  }
  id = req->id;

  /* Count the request as accepted, then look at the drain flag: the admin thread sets the
   * flag before it reads the count, so a request is either seen by the drain or refused. */
  atomic_fetch_add(&s->inflight, 1);
  if (atomic_load(&s->draining)) {
    es__counter_dec(s, &s->inflight);
    es__stream_reply_error(st, id, GRPC_STATUS_UNAVAILABLE,
                           "server is draining (shutting down): request not accepted, send it to "
                           "another server",
                           false);
    goto out_free_input;
  }
  /* Validated against the current owned table, which the job keeps until it is done
   * (es_table.c): a switch meanwhile does not take its experts away. */
  es_table *tab = es__tab_get(s);
  rc = atomic_load(&tab->bad)
           ? mr_err_set(&e, MR_EUNAVAIL, "the weight cache failed its checksum: its weights are "
                        "not served while they are repacked from the model; send to another "
                        "replica or retry")
           : es_forward_validate(req, st->split.payload.len, &tab->lim, &e);
  if (rc) {
    es__tab_put(tab);
    es__stream_reply_error(st, id, (uint32_t)pr_status_from_mr(rc), e.msg, true);
    goto out_free_input;
  }
  if (st->used) { /* validated: every id is -1 or < num_experts */
    const size_t base = (size_t)req->layer * s->cfg.num_experts;
    for (size_t i = 0; i < req->n_expert_ids; i++) {
      if (req->expert_ids[i] < 0) continue;
      size_t b = base + (size_t)req->expert_ids[i];
      unsigned long long bit = 1ull << (b & 63);
      if (!(atomic_load_explicit(&st->used[b >> 6], memory_order_relaxed) & bit))
        atomic_fetch_or_explicit(&st->used[b >> 6], bit, memory_order_relaxed);
    }
  }
  es_job *job = es__job_get(&s->pool);
  es_buf *buf = job ? es__buf_get(&s->pool, st->split.payload.len) : NULL;
  if (!buf) {
    es__tab_put(tab);
    if (job) es__job_put(&s->pool, job);
    snprintf(msg, sizeof msg, "server out of memory for a %zu-byte request buffer",
             st->split.payload.len);
    es__stream_reply_error(st, id, GRPC_STATUS_RESOURCE_EXHAUSTED, msg, true);
    goto out_free_input;
  }
  PR_HB_ACQUIRE(buf); /* after the release of its last user's reply (internal.h) */
  pr_payload_gather(&st->split.payload, buf->data);
  /* Finite check while the gathered bytes are in cache (es.h). */
  rc = es_hidden_check_finite(buf->data, (mr_dtype)req->dtype, req->n_tokens,
                              s->limits.hidden_size, &e);
  if (rc) {
    es__tab_put(tab);
    es__buf_release(buf);
    es__job_put(&s->pool, job);
    es__stream_reply_error(st, id, (uint32_t)pr_status_from_mr(rc), e.msg, true);
    goto out_free_input;
  }
  es__stream_job_init(st, job);
  job->t_recv_ns = t_recv;
  job->tab = tab;
  job->req = req;
  req = NULL;
  job->id = id;
  job->layer = job->req->layer;
  job->n_tokens = job->req->n_tokens;
  job->top_k = job->req->top_k;
  job->dtype = (mr_dtype)job->req->dtype;
  job->buf = buf;
  job->nbytes = st->split.payload.len;
  job->counted = true;
  job->budget_us = job->req->budget_us;
  if (job->budget_us) job->deadline_ns = mr_now_ns() + (uint64_t)job->budget_us * 1000u;
  /* What the request holds until its reply is sent: the buffer (request, then reply) and
   * the decoded header (ids and weights, 8 bytes a slot, plus the record). */
  job->held = es__request_cost(buf->cap, job->n_tokens, job->top_k);
  es__held_add(s, job->held);
  st->expect = job->held; /* the next request is likely of the same size (CQ thread field) */
  /* Pending from here until its reply is sent or dropped: the final batch waits for it. */
  pthread_mutex_lock(&st->lock);
  st->jobs_pending++;
  st->bytes_pending += job->nbytes;
  pthread_mutex_unlock(&st->lock);
  /* To the compute side; true when the inline slot holds it (the RECV then waits). */
  held = es__inline_offer(st->cq_thread, job);
out_free_input:
  if (req) moerpc__v1__forward_request__free_unpacked(req, NULL);
  mr_free(segs);
  return held;
}

/* Starts the RECV_CLOSE_ON_SERVER batch that tells when the call is over. st->lock held. */
static void es__stream_close_start_locked(es_stream *st) {
  grpc_op op;
  memset(&op, 0, sizeof op);
  op.op = GRPC_OP_RECV_CLOSE_ON_SERVER;
  op.data.recv_close_on_server.cancelled = &st->cancelled;
  grpc_call_error ce = grpc_call_start_batch(st->call, &op, 1, &st->t_close, NULL);
  if (ce != GRPC_CALL_OK) {
    mr_log(MR_LOG_ERROR, "stream %s: start_batch(RECV_CLOSE_ON_SERVER) failed: %d", st->peer, ce);
    return;
  }
  st->close_started = true;
}

void es__stream_refuse_locked(es_stream *st, uint32_t status, const char *msg) {
  grpc_slice_unref(st->details);
  st->details = grpc_slice_from_copied_string(msg);
  st->final_status = status;
  st->recv_done = true;
}

void es__on_stream_new(es_stream *st, bool ok) {
  es_server *s = st->srv;
  if (!ok) {
    es__stream_free(st);
    return;
  }
  if (!atomic_load(&s->stop_reposting)) es__stream_post(s, st->cq_thread);
  atomic_fetch_add(&s->live_calls, 1);
  st->t_new.obj = NULL; /* marks the stream as counted in live_calls, for es__stream_free */
  es__call_peer(st->call, st->peer, sizeof st->peer);
  bool authed = es__auth_ok(s, &st->md, st->peer, "Forward");
  /* Protocol 1.4: the client's name, for StatsReply.clients (input: escaped and cut). */
  for (size_t i = 0; i < st->md.count; i++) {
    const grpc_metadata *m = &st->md.metadata[i];
    if (!grpc_slice_str_cmp(m->key, PR_MD_CLIENT_NAME)) {
      mr_log_escape(st->client, sizeof st->client, (const char *)GRPC_SLICE_START_PTR(m->value),
                    GRPC_SLICE_LENGTH(m->value));
      break;
    }
  }
  mr_log(MR_LOG_DEBUG, "stream from %s opened", st->peer);

  /* Listed under streams_lock, where the drain's es__streams_finish reads `finishing` too:
   * a stream accepted after the drain asked every stream to finish still learns it. */
  pthread_mutex_lock(&s->streams_lock);
  st->next = s->streams;
  if (s->streams) s->streams->prev = st;
  s->streams = st;
  bool finishing = s->finishing;
  bool loaded = atomic_load_explicit(&s->loaded, memory_order_acquire);
  /* max_streams is set with the budget, before loaded is published: a stream accepted while
   * loading is refused below without being counted. */
  bool over = authed && loaded && s->n_streams >= s->max_streams;
  if (authed && loaded && !over) {
    s->n_streams++;
    st->listed = true;
  }
  uint32_t n_open = s->n_streams;
  pthread_mutex_lock(&st->lock); /* taken before streams_lock is let go: the lock order */
  pthread_mutex_unlock(&s->streams_lock);
  st->finish_requested = finishing;
  es__stream_close_start_locked(st);
  /* Then the first of: refused (token, cap, drain, loading: final batch only, nothing read),
   * paused on the budget (initial metadata only), or read. */
  if (!authed) {
    /* No request is read; nothing is counted against the stream cap. */
    es__stream_refuse_locked(st, GRPC_STATUS_UNAUTHENTICATED, ES_AUTH_REFUSED_MSG);
  } else if (over || atomic_load(&s->draining) || !loaded) {
    char msg[200];
    bool loading = !over && !atomic_load(&s->draining);
    if (loading) {
      es__loading_msg(s, msg, sizeof msg);
    } else if (over) {
      atomic_fetch_add(&s->n_refused, 1);
      atomic_fetch_add_explicit(&s->tot_refused, 1, memory_order_relaxed);
      snprintf(msg, sizeof msg, "server has %" PRIu32 " Forward streams open, the limit "
               "(--max-streams %" PRIu32 "): stream refused", n_open, s->max_streams);
      mr_log_ratelimited(MR_LOG_WARN, 5, "stream from %s refused: %s", st->peer, msg);
    } else {
      snprintf(msg, sizeof msg, "server is draining (shutting down): send to another server");
    }
    es__stream_refuse_locked(st, over ? GRPC_STATUS_RESOURCE_EXHAUSTED : GRPC_STATUS_UNAVAILABLE, msg);
  } else if (!es__stream_reserve_locked(st)) {
    /* Initial metadata now, the first RECV once the budget has room. */
    grpc_op op;
    memset(&op, 0, sizeof op);
    op.op = GRPC_OP_SEND_INITIAL_METADATA;
    st->initial_sent = true;
    st->init_inflight = grpc_call_start_batch(st->call, &op, 1, &st->t_init, NULL) == GRPC_CALL_OK;
    atomic_fetch_add(&s->mem_paused, 1);
    st->mem_paused = true;
  } else {
    es__stream_recv_locked(st, true);
  }
  es__stream_maybe_finish_locked(st);
  pthread_mutex_unlock(&st->lock);
}

void es__on_stream_init(es_stream *st, bool ok) {
  (void)ok;
  pthread_mutex_lock(&st->lock);
  st->init_inflight = false;
  bool dead = es__stream_dead_locked(st);
  pthread_mutex_unlock(&st->lock);
  if (dead) es__stream_free(st);
}

void es__on_stream_close(es_stream *st, bool ok) {
  (void)ok;
  pthread_mutex_lock(&st->lock);
  st->close_done = true;
  if (st->cancelled && !st->send_failed) {
    /* Cancelled by the client, its deadline or a broken connection: nothing will read. */
    mr_log(MR_LOG_DEBUG, "stream %s: cancelled with %" PRIu32 " requests pending", st->peer,
           st->jobs_pending);
    es__stream_fail_locked(st);
    if (st->sending == NULL) es__stream_drop_queue_locked(st);
  }
  es__stream_maybe_finish_locked(st);
  bool dead = es__stream_dead_locked(st);
  pthread_mutex_unlock(&st->lock);
  if (dead) es__stream_free(st);
}

void es__on_stream_recv(es_stream *st, bool ok) {
  grpc_byte_buffer *bb = st->recv_bb;
  st->recv_bb = NULL;
  /* A message is taken unless the stream has already ended (a drain that finished it while
   * the RECV was out). busy keeps the final batch and the free away while the lock is let
   * go for the decode and the validation. */
  pthread_mutex_lock(&st->lock);
  st->recv_inflight = false;
  bool take = ok && bb && !st->final_started;
  if (take) st->busy = true;
  pthread_mutex_unlock(&st->lock);

  bool held = take && es__stream_on_request(st, bb);
  if (!take && ok && bb)
    mr_log(MR_LOG_DEBUG, "stream %s: message after the stream ended, dropped", st->peer);
  if (bb) grpc_byte_buffer_destroy(bb);

  pthread_mutex_lock(&st->lock);
  /* The request is charged (or refused) now: its reservation goes, in that order, so that
   * the budget never looks emptier than it is. */
  atomic_fetch_sub(&st->srv->reserved_bytes, (long long)st->reserved);
  st->reserved = 0;
  st->busy = false;
  if (held) {
    /* Re-arming now would make gRPC write a WINDOW_UPDATE ahead of the reply (one more
     * write and one more wake-up of the client per round trip): es__stream_recv_resume
     * does it once the reply is on its way. */
    st->recv_held = true;
  } else if (take && !st->finish_requested && !st->send_failed) {
    es__stream_rearm_locked(st);
  } else {
    st->recv_done = true;
  }
  if (!ok) es__stream_fail_locked(st); /* the call failed: later sends would fail too */
  if (!take && !ok)
    mr_log(MR_LOG_DEBUG, "stream %s: receive failed (client gone or call cancelled)", st->peer);
  else if (!take && !bb)
    mr_log(MR_LOG_DEBUG, "stream %s: client half-closed", st->peer);
  es__stream_maybe_finish_locked(st);
  bool dead = es__stream_dead_locked(st);
  pthread_mutex_unlock(&st->lock);
  if (dead) es__stream_free(st);
}

/* CQ thread: re-arms the RECV that es__on_stream_recv held back while the stream's request
 * was held in the inline slot, once the slot let go of it (recv_held). */
static void es__stream_recv_resume(es_stream *st) {
  pthread_mutex_lock(&st->lock);
  MR_ASSERT(st->recv_held);
  st->recv_held = false;
  if (st->finish_requested || st->send_failed) {
    st->recv_done = true;
  } else {
    es__stream_rearm_locked(st);
  }
  es__stream_maybe_finish_locked(st);
  bool dead = es__stream_dead_locked(st);
  pthread_mutex_unlock(&st->lock);
  if (dead) es__stream_free(st);
}

void es__on_stream_send(es_stream *st, bool ok) {
  pthread_mutex_lock(&st->lock);
  es_job *j = st->sending;
  MR_ASSERT(j);
  st->sending = NULL;
  j->sent = ok;
  if (ok) atomic_fetch_add_explicit(&st->srv->bytes_out, j->reply_bytes, memory_order_relaxed);
  es__stream_settle_locked(st, j);
  if (!ok) {
    if (!st->send_failed)
      mr_log(MR_LOG_DEBUG, "stream %s: send failed (client gone or call cancelled)", st->peer);
    es__stream_fail_locked(st);
  }
  if (st->send_failed) es__stream_drop_queue_locked(st);
  else if (st->sq_head) es__stream_send_next_locked(st);
  /* A reply sent frees room in the stream's own limits and in the budget: a paused stream
   * may read again (or, finishing, never will). */
  if ((st->recv_paused || st->mem_paused) && st->finish_requested) {
    /* The drain ends the stream: reads stay off for good. */
    if (st->mem_paused) atomic_fetch_sub(&st->srv->mem_paused, 1);
    st->recv_paused = st->mem_paused = false;
    st->recv_done = true;
  } else if (st->recv_paused && !es__stream_over_limit_locked(st, 2)) {
    st->recv_paused = false;
    es__stream_rearm_locked(st);
  } else if (st->mem_paused && es__stream_reserve_locked(st)) {
    atomic_fetch_sub(&st->srv->mem_paused, 1);
    st->mem_paused = false;
    es__stream_recv_locked(st, false);
  }
  es__stream_maybe_finish_locked(st);
  bool dead = es__stream_dead_locked(st);
  pthread_mutex_unlock(&st->lock);
  if (dead) es__stream_free(st);
}

void es__on_stream_final(es_stream *st, bool ok) {
  pthread_mutex_lock(&st->lock);
  st->final_done = true;
  bool dead = es__stream_dead_locked(st);
  pthread_mutex_unlock(&st->lock);
  mr_log(MR_LOG_DEBUG, "stream %s: finished%s", st->peer, st->cancelled ? " (cancelled)" : "");
  if (dead) es__stream_free(st);
}

void es__streams_finish(es_server *s) {
  pthread_mutex_lock(&s->streams_lock);
  s->finishing = true;
  for (es_stream *st = s->streams; st; st = st->next) {
    pthread_mutex_lock(&st->lock);
    st->finish_requested = true;
    if (st->recv_paused || st->mem_paused) {
      /* Never read again: the stream counts as done receiving, so that it can finish. */
      if (st->mem_paused) atomic_fetch_sub(&s->mem_paused, 1);
      st->recv_paused = st->mem_paused = false;
      st->recv_done = true;
    }
    es__stream_maybe_finish_locked(st);
    pthread_mutex_unlock(&st->lock);
  }
  pthread_mutex_unlock(&s->streams_lock);
}

void es__streams_service(es_server *s) {
  uint64_t stall_ns = (uint64_t)s->opts.stall_timeout_ms * 1000000u;
  pthread_mutex_lock(&s->streams_lock);
  for (es_stream *st = s->streams; st; st = st->next) {
    pthread_mutex_lock(&st->lock);
    if (st->mem_paused && !st->finish_requested && !st->send_failed &&
        es__stream_reserve_locked(st)) {
      atomic_fetch_sub(&s->mem_paused, 1);
      st->mem_paused = false;
      es__stream_recv_locked(st, false);
    }
    /* The clock is read under the stream's lock: a send another thread started after an
     * earlier reading would otherwise look 2^64 ns old. */
    uint64_t now = mr_now_ns();
    if (stall_ns && st->sending && !st->send_failed && now > st->send_t0_ns &&
        now - st->send_t0_ns > stall_ns) {
      char msg[160];
      snprintf(msg, sizeof msg, "replies not read for %" PRIu32 " ms (--stall-timeout-ms): stream cut",
               s->opts.stall_timeout_ms);
      mr_log_ratelimited(MR_LOG_WARN, 5, "stream %s: %s, %" PRIu32 " requests / %zu bytes freed",
                         st->peer, msg, st->jobs_pending, st->bytes_pending);
      atomic_fetch_add(&s->n_refused, 1); /* StatsReply.refused counts cuts too (moe.proto) */
      atomic_fetch_add_explicit(&s->tot_stall_cuts, 1, memory_order_relaxed);
      grpc_call_cancel_with_status(st->call, GRPC_STATUS_RESOURCE_EXHAUSTED, msg, NULL);
      es__stream_fail_locked(st); /* the send in flight completes failed and drops the rest */
    }
    pthread_mutex_unlock(&st->lock);
  }
  pthread_mutex_unlock(&s->streams_lock);
}

