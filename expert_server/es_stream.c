/*
 * es_stream.c - the Forward streams: decode + validate each request, hand it to the compute
 * queue, and send the replies one at a time through the stream's send queue.
 *
 * One Forward stream, as batches on its call:
 *
 *   accept   {SEND_INITIAL_METADATA, RECV_MESSAGE}                           -> t_recv
 *   request  RECV_MESSAGE completes with a message: decode + validate; a valid request goes
 *            to the compute queue (or is held for inline compute, internal.h), a bad one
 *            gets an error reply at once; re-arm {RECV_MESSAGE} (one is outstanding while
 *            the stream is open, except while its request is held: then the re-arm waits
 *            until the reply's send has started, es__stream_recv_resume, because gRPC
 *            answers the re-arm with a WINDOW_UPDATE write that would otherwise go out on
 *            its own ahead of the reply)
 *   reply    the compute thread (or the CQ thread, inline) queues the encoded reply; if no
 *            SEND_MESSAGE is in flight it starts {SEND_MESSAGE} itself (under the lock),
 *            else the CQ thread starts the next one when the current send completes -> t_send
 *   end      RECV_MESSAGE completes empty (half-close) or fails (client gone), or the drain
 *            asks to finish: once nothing is pending,
 *            {SEND_STATUS_FROM_SERVER OK, RECV_CLOSE_ON_SERVER}                 -> t_final
 *   free     after t_final and any outstanding t_recv have completed (CQ thread only)
 *
 * Threads: the CQ thread of the call runs every es__on_stream_* handler; the compute thread
 * calls es__stream_send; the admin thread calls es__grpc_finish_streams. The shared fields
 * are under es_stream.lock (internal.h has the lock order). Only the CQ thread frees a stream.
 */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"

/* Backpressure: a stream with this many requests (or bytes) taken and not yet answered and
 * sent stops being read until it is below half of both again. HTTP/2 flow control then holds
 * the client back, so a client that sends without reading its replies cannot grow the
 * server's memory without bound; well-behaved clients keep far fewer requests in flight. */
#define ES_STREAM_MAX_PENDING 128u
#define ES_STREAM_MAX_BYTES ((size_t)64 << 20)

void es__stream_free(es_stream *st) {
  es_server *s = st->srv;
  pthread_mutex_lock(&s->streams_lock);
  if (st->prev) st->prev->next = st->next;
  else if (s->streams == st) s->streams = st->next;
  if (st->next) st->next->prev = st->prev;
  pthread_mutex_unlock(&s->streams_lock);
  bool was_live = st->t_new.obj == NULL; /* see es__on_stream_new */
  if (st->recv_bb) grpc_byte_buffer_destroy(st->recv_bb);
  grpc_metadata_array_destroy(&st->md);
  grpc_slice_unref(st->details);
  pr_split_free(&st->split);
  if (st->call) grpc_call_unref(st->call);
  pthread_mutex_destroy(&st->lock);
  mr_free(st);
  if (was_live) es__counter_dec(s, &s->live_calls);
}

void es__stream_post(es_server *s, es_cqt *t) {
  es_stream *st = mr_calloc(1, sizeof *st);
  if (!st) {
    mr_log(MR_LOG_ERROR, "grpc: out of memory posting a Forward call");
    return;
  }
  st->srv = s;
  st->cqt = t;
  st->details = grpc_empty_slice();
  grpc_metadata_array_init(&st->md);
  pthread_mutex_init(&st->lock, NULL);
  st->t_new = (es_tag){ES_TAG_STREAM_NEW, st};
  st->t_recv = (es_tag){ES_TAG_STREAM_RECV, st};
  st->t_send = (es_tag){ES_TAG_STREAM_SEND, st};
  st->t_final = (es_tag){ES_TAG_STREAM_FINAL, st};
  grpc_call_error ce = grpc_server_request_registered_call(s->gs, s->rm[ES_M_FORWARD], &st->call,
                                                           &st->deadline, &st->md, NULL, t->cq, t->cq,
                                                           &st->t_new);
  if (ce != GRPC_CALL_OK) {
    if (!atomic_load(&s->stop_reposting))
      mr_log(MR_LOG_ERROR, "grpc: request_registered_call(Forward) failed: %d", ce);
    es__stream_free(st);
  }
}

/* True when nothing refers to st any more: only then may the CQ thread free it. */
static bool es__stream_dead_locked(const es_stream *st) {
  return st->final_done && !st->recv_inflight && !st->busy;
}

/* Starts RECV_MESSAGE (with SEND_INITIAL_METADATA the first time). Caller holds st->lock. */
static void es__stream_recv_locked(es_stream *st, bool first) {
  grpc_op ops[2];
  size_t n = 0;
  memset(ops, 0, sizeof ops);
  if (first) {
    ops[n].op = GRPC_OP_SEND_INITIAL_METADATA;
    n++;
  }
  ops[n].op = GRPC_OP_RECV_MESSAGE;
  ops[n].data.recv_message.recv_message = &st->recv_bb;
  n++;
  grpc_call_error ce = grpc_call_start_batch(st->call, ops, n, &st->t_recv, NULL);
  if (ce != GRPC_CALL_OK) {
    mr_log(MR_LOG_ERROR, "stream %s: start_batch(RECV_MESSAGE) failed: %d", st->peer, ce);
    st->recv_done = true;
    return;
  }
  st->recv_inflight = true;
}

/* Starts the final batch once the stream is closing and nothing is pending. Any thread;
 * caller holds st->lock. */
static void es__stream_maybe_finish_locked(es_stream *st) {
  if (st->final_started || st->busy || st->jobs_pending > 0) return;
  if (!st->recv_done && !st->finish_requested) return;
  MR_ASSERT(!st->sending && !st->sq_head);
  st->final_started = true;
  grpc_op ops[2];
  memset(ops, 0, sizeof ops);
  ops[0].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
  ops[0].data.send_status_from_server.status = GRPC_STATUS_OK;
  ops[0].data.send_status_from_server.status_details = &st->details;
  ops[1].op = GRPC_OP_RECV_CLOSE_ON_SERVER;
  ops[1].data.recv_close_on_server.cancelled = &st->cancelled;
  grpc_call_error ce = grpc_call_start_batch(st->call, ops, 2, &st->t_final, NULL);
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
  es__job_done(st->srv, j);
}

/* True while the stream holds more unanswered work than a client should keep in flight. */
static bool es__stream_over_limit_locked(const es_stream *st, uint32_t div) {
  size_t max_bytes = ES_STREAM_MAX_BYTES;
  size_t max_req = (size_t)st->srv->opts.max_tokens * st->srv->cfg.hidden_size * 4u;
  if (max_bytes < 2 * max_req) max_bytes = 2 * max_req; /* always room for two requests */
  return st->jobs_pending >= ES_STREAM_MAX_PENDING / div || st->bytes_pending >= max_bytes / div;
}

/* Marks the call dead for sending. A paused stream will never be read again either, so it
 * counts as done receiving (else it could never finish). Caller holds st->lock. */
static void es__stream_fail_locked(es_stream *st) {
  st->send_failed = true;
  if (st->recv_paused) {
    st->recv_paused = false;
    st->recv_done = true;
  }
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
  grpc_op op;
  memset(&op, 0, sizeof op);
  op.op = GRPC_OP_SEND_MESSAGE;
  op.data.send_message.send_message = j->reply;
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

void es__stream_send(es_stream *st, es_job *job) {
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
    es__stream_settle_locked(st, job);
    es__stream_maybe_finish_locked(st);
  } else {
    job->next = NULL;
    if (st->sq_tail) st->sq_tail->next = job;
    else st->sq_head = job;
    st->sq_tail = job;
    if (!st->sending) es__stream_send_next_locked(st);
  }
  pthread_mutex_unlock(&st->lock);
}

/* Answers one request of st at once with an error (CQ thread). counted: the request holds a
 * unit of srv->inflight, handed to the job. */
static void es__stream_reply_error(es_stream *st, uint64_t id, uint32_t status, const char *msg,
                                   bool counted) {
  es_server *s = st->srv;
  atomic_fetch_add(&s->n_errors, 1);
  atomic_fetch_add(&s->tot_errors, 1);
  if (status == GRPC_STATUS_UNAVAILABLE)
    mr_log_ratelimited(MR_LOG_INFO, 5, "forward from %s: request %" PRIu64 ": %s: %s", st->peer, id,
                       pr_status_name((grpc_status_code)status), msg);
  else
    mr_log_ratelimited(MR_LOG_WARN, 5, "forward from %s: request %" PRIu64 ": %s: %s", st->peer, id,
                       pr_status_name((grpc_status_code)status), msg);
  es_job *job = es__job_get(&s->pool);
  if (job) {
    job->st = st;
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
  rc = es_forward_validate(req, st->split.payload.len, &s->limits, &e);
  if (rc) {
    es__stream_reply_error(st, id, (uint32_t)pr_status_from_mr(rc), e.msg, true);
    goto out_free_input;
  }
  es_job *job = es__job_get(&s->pool);
  es_buf *buf = job ? es__buf_get(&s->pool, st->split.payload.len) : NULL;
  if (!buf) {
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
    es__buf_release(buf);
    es__job_put(&s->pool, job);
    es__stream_reply_error(st, id, (uint32_t)pr_status_from_mr(rc), e.msg, true);
    goto out_free_input;
  }
  job->st = st;
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
  pthread_mutex_lock(&st->lock);
  st->jobs_pending++;
  st->bytes_pending += job->nbytes;
  pthread_mutex_unlock(&st->lock);
  held = es__compute_offer(s, st->cqt, job);
out_free_input:
  if (req) moerpc__v1__forward_request__free_unpacked(req, NULL);
  mr_free(segs);
  return held;
}

void es__on_stream_new(es_stream *st, bool ok) {
  es_server *s = st->srv;
  if (!ok) {
    es__stream_free(st);
    return;
  }
  if (!atomic_load(&s->stop_reposting)) es__stream_post(s, st->cqt);
  atomic_fetch_add(&s->live_calls, 1);
  st->t_new.obj = NULL; /* marks the stream as counted in live_calls, for es__stream_free */
  es__call_peer(st->call, st->peer, sizeof st->peer);
  mr_log(MR_LOG_DEBUG, "stream from %s opened", st->peer);

  pthread_mutex_lock(&s->streams_lock);
  st->next = s->streams;
  if (s->streams) s->streams->prev = st;
  s->streams = st;
  bool finishing = s->finishing;
  pthread_mutex_lock(&st->lock);
  pthread_mutex_unlock(&s->streams_lock);
  st->finish_requested = finishing;
  es__stream_recv_locked(st, true);
  es__stream_maybe_finish_locked(st);
  pthread_mutex_unlock(&st->lock);
}

void es__on_stream_recv(es_stream *st, bool ok) {
  grpc_byte_buffer *bb = st->recv_bb;
  st->recv_bb = NULL;
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
  st->busy = false;
  if (held) {
    /* Re-arming now would make gRPC write a WINDOW_UPDATE ahead of the reply (one more
     * write and one more wake-up of the client per round trip): es__stream_recv_resume
     * does it once the reply is on its way. */
    st->recv_held = true;
  } else if (take && !st->finish_requested && !st->send_failed) {
    if (es__stream_over_limit_locked(st, 1)) {
      st->recv_paused = true; /* es__on_stream_send re-arms once below half */
      mr_log(MR_LOG_DEBUG, "stream %s: %" PRIu32 " requests / %zu bytes pending, pausing reads",
             st->peer, st->jobs_pending, st->bytes_pending);
    } else {
      es__stream_recv_locked(st, false);
    }
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

void es__stream_recv_resume(es_stream *st) {
  pthread_mutex_lock(&st->lock);
  MR_ASSERT(st->recv_held);
  st->recv_held = false;
  if (st->finish_requested || st->send_failed) {
    st->recv_done = true;
  } else if (es__stream_over_limit_locked(st, 1)) {
    st->recv_paused = true;
  } else {
    es__stream_recv_locked(st, false);
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
  es__stream_settle_locked(st, j);
  if (!ok) {
    if (!st->send_failed)
      mr_log(MR_LOG_DEBUG, "stream %s: send failed (client gone or call cancelled)", st->peer);
    es__stream_fail_locked(st);
  }
  if (st->send_failed) es__stream_drop_queue_locked(st);
  else if (st->sq_head) es__stream_send_next_locked(st);
  if (st->recv_paused && st->finish_requested) {
    /* The drain ends the stream: reads stay off for good. */
    st->recv_paused = false;
    st->recv_done = true;
  } else if (st->recv_paused && !es__stream_over_limit_locked(st, 2)) {
    st->recv_paused = false;
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

void es__grpc_finish_streams(es_server *s) {
  pthread_mutex_lock(&s->streams_lock);
  s->finishing = true;
  for (es_stream *st = s->streams; st; st = st->next) {
    pthread_mutex_lock(&st->lock);
    st->finish_requested = true;
    es__stream_maybe_finish_locked(st);
    pthread_mutex_unlock(&st->lock);
  }
  pthread_mutex_unlock(&s->streams_lock);
}

