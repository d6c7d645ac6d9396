/*
 * gc_stream.c - one long-lived bidi Forward stream per server and the I/O thread that owns
 * the completion queue of all of them.
 *
 * A stream is a sequence of gRPC calls (gc__call): the live one (s->cur) and, after a
 * break, old ones that still wait for their last batches to complete. Each live call has
 * at most three batches in flight, as gRPC core requires (docs/DESIGN.md section 8):
 *
 *   t_start   SEND_INITIAL_METADATA (WAIT_FOR_READY on a first open, fail-fast on a
 *             reopen after a break, so a server that is gone fails requests at once
 *             instead of at their deadline)
 *   t_send    one SEND_MESSAGE (or, at close, SEND_CLOSE_FROM_CLIENT on t_close); the rest
 *             wait on the app-side send queue s->q_head..q_tail
 *   t_recv    RECV_MESSAGE (with RECV_INITIAL_METADATA the first time, without which gRPC
 *             never completes a client receive), re-armed after each reply while requests
 *             are outstanding; when none is, the next enqueue arms it, after its send
 *             (!cl->recv_armed), so that gRPC's flow-control update for the last reply rides
 *             in the request's write rather than in a write (and a server wake-up) of its
 *             own: one write and one read per round trip on each side instead of two
 *   t_sendrecv  SEND_MESSAGE and RECV_MESSAGE in one batch ("paired"): a request enqueued
 *             on an idle stream (nothing outstanding, no send in flight, no RECV armed) and
 *             not followed by another for the same stream (gc__req.followed). It stands for
 *             t_send and t_recv and completes once, with the reply. A SEND of its own
 *             completes as soon as it is written, on the caller's thread: gRPC then wakes
 *             the I/O thread through its eventfd to collect that completion, the I/O
 *             thread preempts the caller on its core and blocks on the locks the caller
 *             still holds (the pollset's, then s->lock), and the two swap the core about
 *             seven times before the caller sleeps, while the reply is on its way (a perf
 *             trace on a 2-vCPU Xeon VM, docs/BENCHMARKS.md "Paired sends"; 2.6 switches
 *             per round trip paired). Paired, the send has no completion of its own: one
 *             wake-up of the I/O thread per round trip, for the reply. The price: gRPC
 *             allows one SEND_MESSAGE in flight, so a request queued behind a paired one
 *             waits for its reply; hence only unfollowed requests pair, and a paired
 *             request given up moves the stream to a new call (stream_retire_paired_locked)
 *   t_status  RECV_STATUS_ON_CLIENT, started at open: it completes when the call ends for
 *             any reason, which is how a dead server is noticed at once
 *
 * The call's own deadline is infinite: it lives as long as the cluster, and every request
 * on it has its own deadline enforced by the waiter (gc_layer.c). Nothing waits on the
 * call without a bound: the waiter gives up at the request deadline, and close cancels the
 * calls that do not end within GC__CLOSE_WAIT_MS of the half-close.
 *
 * A request is "outstanding" from enqueue until its reply, its failure, or the waiter
 * giving up; while outstanding it holds one reference of its pending (internal.h).
 *
 * The state machines, all under s->lock (the I/O thread and the callers meet there):
 *
 *   stream:   no call --enqueue--> open (s->cur; START, STATUS and later RECV armed)
 *                ^                   |  one SEND in flight, the rest on the send queue
 *                |                   | STATUS (server gone, reset, our cancel after a bad
 *                |                   v  reply): every outstanding request fails with retry
 *                +---- enqueue ---- broken (s->cur = NULL; failfast: the next open does
 *                                  not WAIT_FOR_READY, so a dead server fails fast)
 *             close: closing (SEND_CLOSE_FROM_CLIENT after the last SEND) -> STATUS ->
 *                    ended; calls still open after GC__CLOSE_WAIT_MS are cancelled
 *
 *   request:  QUEUED (on the send queue, bb encoded) --its SEND completes--> SENT
 *             --a reply with its id--> DONE (completed OK, or with the reply's error)
 *             QUEUED / SENT --STATUS--> DONE (failed, retry: the waiter may re-plan it)
 *             QUEUED / SENT --the waiter gives up (gc__stream_forget)--> unlinked; a
 *             late reply then finds no outstanding request with its id and is dropped
 *
 *   gc__call: a call's batches end in any order; the call is freed when its last batch
 *             has completed (ops_pending 0) and it is no longer s->cur, which may happen
 *             long after the stream moved on to a new call.
 */
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include <grpc/byte_buffer.h>
#include <grpc/slice.h>
#include <grpc/support/alloc.h>
#include <grpc/support/time.h>

#include "gpu_client/rpc/internal.h"

#define GC__CLOSE_WAIT_MS 2000
#define GC__CANCEL_WAIT_MS 5000

/* ---- calls ------------------------------------------------------------------------------- */

static void call_free(gc__call *cl) {
  gc_cluster *c = cl->s->c;
  if (cl->call) grpc_call_unref(cl->call);
  grpc_metadata_array_destroy(&cl->md_initial);
  grpc_metadata_array_destroy(&cl->md_trailing);
  grpc_slice_unref(cl->details);
  if (cl->error_string) gpr_free((void *)cl->error_string);
  MR_ASSERT(!cl->recv_bb && !cl->send_bb);
  mr_free(cl);
  pthread_mutex_lock(&c->calls_lock);
  c->live_calls--;
  pthread_cond_broadcast(&c->calls_cond);
  pthread_mutex_unlock(&c->calls_lock);
}

/* The completion queue orders a batch's start before its completion, which TSan cannot see
 * in the uninstrumented gRPC: the tag (and what it points to: the call, its stream) is
 * released here and acquired by the I/O thread (PR_HB_*, proto/pr.h). */
static void start_batch_locked(gc__call *cl, const grpc_op *ops, size_t n, gc__tag *tag) {
  PR_HB_RELEASE(tag);
  grpc_call_error ce = grpc_call_start_batch(cl->call, ops, n, tag, NULL);
  /* Only our own bugs (two sends in flight, ops on a freed call) make this fail. */
  MR_ASSERT(ce == GRPC_CALL_OK);
  cl->ops_pending++;
}

static void arm_recv_locked(gc__call *cl, bool with_initial_md) {
  grpc_op ops[2];
  size_t n = 0;
  memset(ops, 0, sizeof ops);
  if (with_initial_md) {
    ops[n].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[n++].data.recv_initial_metadata.recv_initial_metadata = &cl->md_initial;
  }
  ops[n].op = GRPC_OP_RECV_MESSAGE;
  ops[n++].data.recv_message.recv_message = &cl->recv_bb;
  MR_ASSERT(!cl->recv_armed); /* gRPC allows one RECV_MESSAGE in flight */
  start_batch_locked(cl, ops, n, &cl->t_recv);
  cl->recv_armed = true;
}

/* Opens a new call on s (s->cur must be NULL). Called with s->lock held, from a caller
 * thread (submit) or from gc__streams_start. */
static int stream_open_locked(gc__stream *s, mr_err *e) {
  gc_cluster *c = s->c;
  MR_ASSERT(!s->cur);
  gc__call *cl = mr_calloc(1, sizeof *cl);
  if (!cl)
    return mr_err_set(e, MR_ENOMEM, GC__SRV_FMT ": opening the Forward stream: out of memory",
                      GC__SRV_ARGS(s->srv));
  cl->s = s;
  cl->t_start = (gc__tag){cl, GC__OP_START};
  cl->t_send = (gc__tag){cl, GC__OP_SEND};
  cl->t_recv = (gc__tag){cl, GC__OP_RECV};
  cl->t_sendrecv = (gc__tag){cl, GC__OP_SENDRECV};
  cl->t_status = (gc__tag){cl, GC__OP_STATUS};
  cl->t_close = (gc__tag){cl, GC__OP_CLOSE};
  grpc_metadata_array_init(&cl->md_initial);
  grpc_metadata_array_init(&cl->md_trailing);
  cl->details = grpc_empty_slice();
  cl->call = grpc_channel_create_registered_call(s->ch, NULL, GRPC_PROPAGATE_DEFAULTS, c->cq,
                                                 s->forward_method,
                                                 gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
  if (!cl->call) {
    grpc_metadata_array_destroy(&cl->md_initial);
    grpc_metadata_array_destroy(&cl->md_trailing);
    mr_free(cl);
    return mr_err_set(e, MR_EUNAVAIL, GC__SRV_FMT ": could not create the Forward call",
                      GC__SRV_ARGS(s->srv));
  }
  pthread_mutex_lock(&c->calls_lock);
  c->live_calls++;
  pthread_mutex_unlock(&c->calls_lock);

  grpc_op op;
  memset(&op, 0, sizeof op);
  op.op = GRPC_OP_SEND_INITIAL_METADATA;
  op.flags = GRPC_INITIAL_METADATA_WAIT_FOR_READY_EXPLICITLY_SET |
             (s->failfast ? 0 : GRPC_INITIAL_METADATA_WAIT_FOR_READY);
  /* The bearer token, if any (the server checks it when it accepts the stream), and the
   * client's name (protocol 1.4: the server reports its clients in Stats). */
  op.data.send_initial_metadata.count = c->n_fwd_md;
  op.data.send_initial_metadata.metadata = c->fwd_md;
  start_batch_locked(cl, &op, 1, &cl->t_start);
  arm_recv_locked(cl, true);
  memset(&op, 0, sizeof op);
  op.op = GRPC_OP_RECV_STATUS_ON_CLIENT;
  op.data.recv_status_on_client.trailing_metadata = &cl->md_trailing;
  op.data.recv_status_on_client.status = &cl->status;
  op.data.recv_status_on_client.status_details = &cl->details;
  op.data.recv_status_on_client.error_string = &cl->error_string;
  start_batch_locked(cl, &op, 1, &cl->t_status);

  s->cur = cl;
  s->send_busy = false;
  s->half_closed = false;
  s->break_rc = 0;
  s->break_msg[0] = '\0';
  mr_log(MR_LOG_DEBUG, GC__SRV_FMT ": Forward stream opened (%s)", GC__SRV_ARGS(s->srv),
         s->failfast ? "fail-fast" : "wait-for-ready");
  return 0;
}

/* Starts the SEND of the send queue's head on the live call (no send in flight): alone
 * (t_send), or paired with the RECV of its reply (t_sendrecv, above: the head is then the
 * only request outstanding and no RECV is armed). Armed in the same batch, the RECV lets
 * the flow-control update gRPC owes for the last reply ride in this request's write, as in
 * the unpaired order (send, then arm). */
static void stream_send_head_locked(gc__stream *s, bool paired) {
  gc__call *cl = s->cur;
  gc__req *r = s->q_head;
  MR_ASSERT(cl && r && !s->send_busy && (!paired || (!cl->recv_armed && !r->q_next)));
  s->q_head = r->q_next;
  if (!s->q_head) s->q_tail = NULL;
  r->q_next = NULL;
  r->state = GC__REQ_SENT;
  cl->send_bb = r->bb;
  r->bb = NULL;
  grpc_op ops[2];
  memset(ops, 0, sizeof ops);
  ops[0].op = GRPC_OP_SEND_MESSAGE;
  ops[0].data.send_message.send_message = cl->send_bb;
  if (paired) {
    ops[1].op = GRPC_OP_RECV_MESSAGE;
    ops[1].data.recv_message.recv_message = &cl->recv_bb;
    start_batch_locked(cl, ops, 2, &cl->t_sendrecv);
    cl->recv_armed = true;
    cl->paired = r;
    s->ctr.paired++;
  } else {
    start_batch_locked(cl, ops, 1, &cl->t_send);
  }
  s->send_busy = true;
}

/* Starts the next send on the live call if none is in flight: the head of the send queue,
 * or the half-close once the queue is empty and close asked for it. */
static void stream_kick_locked(gc__stream *s) {
  gc__call *cl = s->cur;
  if (!cl || s->send_busy) return;
  if (s->q_head) {
    stream_send_head_locked(s, false);
  } else if (s->closing && !s->half_closed) {
    grpc_op op;
    memset(&op, 0, sizeof op);
    op.op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    start_batch_locked(cl, &op, 1, &cl->t_close);
    s->send_busy = true;
    s->half_closed = true;
  }
}

/* ---- the outstanding list ---------------------------------------------------------------- */

static void outstanding_unlink_locked(gc__stream *s, gc__req *r) {
  MR_ASSERT(r->linked);
  atomic_fetch_sub(&s->out_slots, r->n_slots);
  if (r->o_prev) r->o_prev->o_next = r->o_next;
  else s->o_head = r->o_next;
  if (r->o_next) r->o_next->o_prev = r->o_prev;
  r->o_prev = r->o_next = NULL;
  r->linked = false;
}

/* Removes a queued (not yet sent) r from the send queue; returns its byte buffer. */
static grpc_byte_buffer *queue_remove_locked(gc__stream *s, gc__req *r) {
  gc__req *prev = NULL;
  for (gc__req *q = s->q_head; q; prev = q, q = q->q_next) {
    if (q != r) continue;
    if (prev) prev->q_next = r->q_next;
    else s->q_head = r->q_next;
    if (s->q_tail == r) s->q_tail = prev;
    r->q_next = NULL;
    grpc_byte_buffer *bb = r->bb;
    r->bb = NULL;
    return bb;
  }
  MR_ASSERT(!"queued request missing from its send queue");
  return NULL;
}

void gc__stream_enqueue(gc__stream *s, gc__req *r) {
  mr_err err;
  int rc = 0;
  bool retry = false;
  mr_err_clear(&err);
  pthread_mutex_lock(&s->lock);
  if (s->closing) {
    rc = mr_err_set(&err, MR_ECANCELED, "layer %u request %llu: " GC__SRV_FMT ": cluster is "
                    "closing", r->p->layer, (unsigned long long)r->id, GC__SRV_ARGS(s->srv));
  } else if (!s->cur && !atomic_load(&s->up)) {
    /* Down since the plan chose it: no new stream before a fresh Hello (gc_health.c). */
    rc = mr_err_set(&err, MR_EUNAVAIL, "layer %u request %llu: " GC__SRV_FMT ": server is down",
                    r->p->layer, (unsigned long long)r->id, GC__SRV_ARGS(s->srv));
    retry = true;
  } else if (!s->cur) {
    rc = stream_open_locked(s, &err);
    if (rc) mr_err_prefix(&err, rc, "layer %u request %llu", r->p->layer,
                          (unsigned long long)r->id);
  }
  if (rc) {
    s->ctr.errors++;
    pthread_mutex_unlock(&s->lock);
    grpc_byte_buffer_destroy(r->bb); /* drops the payload's pending reference */
    r->bb = NULL;
    gc__req_complete(r, rc, &err, retry ? GC__DONE_RETRY : 0);
    return;
  }
  atomic_fetch_add(&r->p->refs, 1); /* the outstanding list's reference */
  atomic_fetch_add(&s->out_slots, r->n_slots);
  r->state = GC__REQ_QUEUED;
  r->linked = true;
  r->o_prev = NULL;
  r->o_next = s->o_head;
  if (s->o_head) s->o_head->o_prev = r;
  s->o_head = r;
  r->q_next = NULL;
  if (s->q_tail) s->q_tail->q_next = r;
  else s->q_head = r;
  s->q_tail = r;
  s->ctr.requests++;
  s->ctr.bytes_sent += r->bb_bytes;
  s->ctr.last_req_bytes = r->bb_bytes;
  gc__call *cl = s->cur;
  if (!cl->recv_armed && !s->send_busy && s->q_head == r && !r->o_next && !r->followed) {
    stream_send_head_locked(s, true); /* the only one outstanding, nothing behind it */
  } else {
    stream_kick_locked(s);
    /* After the send: the flow-control update gRPC owes for the last reply then goes out
     * in the same write as this request instead of in one of its own. */
    if (!cl->recv_armed) arm_recv_locked(cl, false);
  }
  pthread_mutex_unlock(&s->lock);
}

/* r, whose SEND is paired with its reply's RECV on the live call, was given up (unlinked
 * already). Nothing more can be sent on that call before r's reply, which may never come
 * (a stalled server), and what is queued behind r would wait for it. So the call is
 * cancelled (the server drops the work nobody waits for) and left to end on its own as an
 * old call, and the stream goes on in a new one, where the queued requests (never sent:
 * the paired send held them) go out at once. Nothing outstanding fails. While closing, the
 * call is only cancelled: its status fails what is left, as for any call then. */
static void stream_retire_paired_locked(gc__stream *s, gc__req *r) {
  gc__call *cl = s->cur;
  cl->paired = NULL;
  grpc_call_cancel_with_status(cl->call, GRPC_STATUS_CANCELLED, "request given up by the client",
                               NULL);
  if (s->closing) return;
  for (gc__req *q = s->o_head; q; q = q->o_next) MR_ASSERT(q->state == GC__REQ_QUEUED);
  mr_log(MR_LOG_DEBUG, GC__SRV_FMT ": request %llu given up while its send was paired with its "
         "reply: its call cancelled, the stream goes on in a new one", GC__SRV_ARGS(s->srv),
         (unsigned long long)r->id);
  s->cur = NULL;
  s->send_busy = false;
  mr_err err;
  if (stream_open_locked(s, &err) == 0) {
    stream_kick_locked(s);
  } else {
    /* The next enqueue tries again; until then the queued requests wait (their deadlines
     * still bound them). */
    mr_log_ratelimited(MR_LOG_WARN, 5, "%s", err.msg);
  }
}

bool gc__stream_forget(gc__stream *s, gc__req *r, bool timed_out, enum gc__req_state *state) {
  grpc_byte_buffer *bb = NULL;
  pthread_mutex_lock(&s->lock);
  *state = r->state;
  if (!r->linked) {
    pthread_mutex_unlock(&s->lock);
    return false;
  }
  if (r->state == GC__REQ_QUEUED) bb = queue_remove_locked(s, r);
  outstanding_unlink_locked(s, r);
  if (s->cur && s->cur->paired == r) stream_retire_paired_locked(s, r);
  if (timed_out) {
    s->ctr.timeouts++;
    s->ctr.errors++;
  }
  pthread_mutex_unlock(&s->lock);
  if (bb) grpc_byte_buffer_destroy(bb);
  return true;
}

/* ---- I/O thread: completions ------------------------------------------------------------- */

/* Drops one batch of cl; frees cl when it has ended and nothing is in flight. */
static void call_batch_done(gc__stream *s, gc__call *cl) {
  pthread_mutex_lock(&s->lock);
  MR_ASSERT(cl->ops_pending > 0);
  cl->ops_pending--;
  bool free_it = cl->finished && cl->ops_pending == 0;
  pthread_mutex_unlock(&s->lock);
  if (free_it) call_free(cl);
}

/* A send's part of a completed batch (t_send, t_close, t_sendrecv): its buffer released,
 * and the next send started. */
static void send_settle(gc__stream *s, gc__call *cl, bool ok) {
  pthread_mutex_lock(&s->lock);
  grpc_byte_buffer *bb = cl->send_bb;
  cl->send_bb = NULL;
  cl->paired = NULL;
  if (s->cur == cl) {
    s->send_busy = false;
    /* A failed send means the call is ending; its status will fail what is outstanding. */
    if (ok) stream_kick_locked(s);
  }
  pthread_mutex_unlock(&s->lock);
  if (bb) grpc_byte_buffer_destroy(bb);
}

static void on_send(gc__stream *s, gc__call *cl, bool ok) {
  send_settle(s, cl, ok);
  call_batch_done(s, cl);
}

/* A reply: match it to its request by id, check it, gather its output, check that every
 * value is finite, complete it. */
static void on_reply(gc__stream *s, gc__call *cl, grpc_byte_buffer *bb) {
  gc_cluster *c = s->c;
  pr_seg *segs = NULL;
  size_t nseg = 0;
  Moerpc__V1__ForwardReply *h = NULL;
  mr_err err;
  size_t wire = grpc_byte_buffer_length(bb);

  int rc = pr_bb_segs(bb, &segs, &nseg, &err);
  if (rc == 0) {
    rc = pr_forward_reply_decode(segs, nseg, &c->io_split, &h, &err);
    if (rc) h = NULL;
  }
  if (rc) {
    /* A reply we cannot parse cannot be matched to its request either: end the stream, so
     * that everything outstanding on it fails now, with this reason, not at the deadline. */
    mr_log_ratelimited(MR_LOG_WARN, 5, GC__SRV_FMT ": malformed ForwardReply (%zu bytes): %s; "
                       "ending the stream", GC__SRV_ARGS(s->srv), wire, err.msg);
    pthread_mutex_lock(&s->lock);
    if (s->cur == cl && !s->break_rc) {
      s->break_rc = MR_EPROTO;
      snprintf(s->break_msg, sizeof s->break_msg, "malformed ForwardReply: %.200s", err.msg);
      grpc_call_cancel_with_status(cl->call, GRPC_STATUS_INTERNAL, "malformed ForwardReply",
                                   NULL);
    }
    pthread_mutex_unlock(&s->lock);
    goto out_free;
  }

  uint64_t now = mr_now_ns();
  atomic_store(&s->t_reply_ns, now); /* the server is alive (gc_layer.c's stall check) */
  pthread_mutex_lock(&s->lock);
  gc__req *r = s->o_head;
  while (r && r->id != h->id) r = r->o_next;
  if (!r || r->state != GC__REQ_SENT) {
    pthread_mutex_unlock(&s->lock);
    /* Most likely the reply of a request whose waiter gave up (deadline, or another part
     * failed first): dropped as designed. */
    mr_log_ratelimited(MR_LOG_DEBUG, 5, GC__SRV_FMT ": reply for request %llu that is not "
                       "outstanding (given up?), dropped", GC__SRV_ARGS(s->srv),
                       (unsigned long long)h->id);
    goto out_free;
  }
  outstanding_unlink_locked(s, r);
  s->failfast = false; /* the server answers: open the next stream normally */
  gc_pending *p = r->p;
  size_t want = (size_t)r->n_tokens * p->H * mr_dtype_size(p->dtype);
  mr_err_clear(&err);
  unsigned how = 0;
  if (h->status != 0) {
    int code = h->status <= GRPC_STATUS_UNAUTHENTICATED
                   ? pr_mr_from_status((grpc_status_code)h->status)
                   : MR_EINTERNAL;
    if (code == 0) code = MR_EINTERNAL;
    char msg[MR_LOG_ESC_MAX];
    mr_log_escape(msg, sizeof msg, h->error ? h->error : "", h->error ? strlen(h->error) : 0);
    rc = mr_err_set(&err, code, "layer %u request %llu: " GC__SRV_FMT ": %s (%u): %s", p->layer,
                    (unsigned long long)r->id, GC__SRV_ARGS(s->srv),
                    pr_status_name((grpc_status_code)h->status), h->status,
                    *msg ? msg : "(no message)");
    /* A Forward's FAILED_PRECONDITION means "this server does not serve that layer or
     * expert" (docs/DESIGN.md section 4): the owned sets moved; the waiter re-Hellos. */
    if (h->status == GRPC_STATUS_FAILED_PRECONDITION) how = GC__DONE_MISS;
    /* UNAVAILABLE on one request (the stream stays open) is a draining server refusing new
     * work ("send it to another server"): a replica takes it, and this server gets nothing
     * more of the call; its stream's end soon marks it down for the next calls. */
    else if (h->status == GRPC_STATUS_UNAVAILABLE) how = GC__DONE_REFUSED;
  } else if ((mr_dtype)h->dtype != p->dtype) {
    rc = mr_err_set(&err, MR_EPROTO, "layer %u request %llu: " GC__SRV_FMT ": reply dtype %d, "
                    "the request's is %d (%s)", p->layer, (unsigned long long)r->id,
                    GC__SRV_ARGS(s->srv), (int)h->dtype, (int)p->dtype, mr_dtype_name(p->dtype));
  } else if (c->io_split.payload.len != want) {
    rc = mr_err_set(&err, MR_EPROTO, "layer %u request %llu: " GC__SRV_FMT ": reply output has "
                    "%zu bytes, must be %zu (%u tokens x %u x %s)", p->layer,
                    (unsigned long long)r->id, GC__SRV_ARGS(s->srv), c->io_split.payload.len,
                    want, r->n_tokens, p->H, mr_dtype_name(p->dtype));
  }
  pthread_mutex_unlock(&s->lock);

  /* The output buffer belongs to r's pending, kept alive by the reference r held on the
   * outstanding list, which is ours now. The finite check runs on the gathered bytes while
   * they are in cache: a NaN or Inf in an OK reply would poison the sum and surface a layer
   * later as someone else's fault ("weights[0] = nan"), so it fails this request here,
   * naming the server, and the waiter re-plans it onto another replica (gc_layer.c). */
  if (rc == 0) {
    pr_payload_gather(&c->io_split.payload, r->out);
    rc = gc__reply_check_finite(r->out, p->dtype, r->rows, r->n_tokens, p->H, &err);
    if (rc) {
      mr_err_prefix(&err, rc, "layer %u request %llu: " GC__SRV_FMT, p->layer,
                    (unsigned long long)r->id, GC__SRV_ARGS(s->srv));
      how = GC__DONE_BAD_REPLY;
    }
  }

  pthread_mutex_lock(&s->lock);
  gc_server_counters *ct = &s->ctr;
  ct->bytes_received += wire;
  ct->last_reply_bytes = wire;
  if (rc == 0) {
    uint64_t rtt = (now - r->t_submit_ns) / 1000u;
    ct->replies++;
    ct->last_rtt_us = rtt;
    ct->last_queue_us = h->queue_us;
    ct->last_compute_us = h->compute_us;
    ct->last_server_us = h->server_us;
    s->sum_rtt_us += (double)rtt;
    s->sum_queue_us += h->queue_us;
    s->sum_compute_us += h->compute_us;
    s->sum_server_us += h->server_us;
    ct->mean_rtt_us = s->sum_rtt_us / (double)ct->replies;
    ct->mean_queue_us = s->sum_queue_us / (double)ct->replies;
    ct->mean_compute_us = s->sum_compute_us / (double)ct->replies;
    ct->mean_server_us = s->sum_server_us / (double)ct->replies;
    atomic_store(&s->t_last_ok_ns, now);
  } else {
    ct->errors++;
  }
  pthread_mutex_unlock(&s->lock);

  /* A miss is logged by the re-Hello it triggers (one INFO line naming it). */
  if (rc) mr_log_ratelimited(how == GC__DONE_MISS ? MR_LOG_DEBUG : MR_LOG_WARN, 10, "%s", err.msg);
  gc__req_complete(r, rc, &err, how);
  gc__pending_unref(p);
out_free:
  if (h) moerpc__v1__forward_reply__free_unpacked(h, NULL);
  mr_free(segs);
}

static void on_recv(gc__stream *s, gc__call *cl, bool ok) {
  grpc_byte_buffer *bb = cl->recv_bb;
  cl->recv_bb = NULL;
  /* Before the reply wakes its waiter: a request that waiter enqueues next then finds no
   * RECV in flight, and may pair with its own reply. */
  pthread_mutex_lock(&s->lock);
  cl->recv_armed = false;
  pthread_mutex_unlock(&s->lock);
  if (ok && bb) {
    on_reply(s, cl, bb);
    grpc_byte_buffer_destroy(bb);
    pthread_mutex_lock(&s->lock);
    if (!cl->finished) {
      /* The stream goes on until its status says otherwise: re-armed while requests are
       * outstanding (unless an enqueue armed it meanwhile). With nothing outstanding,
       * arming now would make gRPC write a WINDOW_UPDATE on its own (one more write here
       * and one more wake-up of the server per round trip): the next enqueue arms it, or
       * pairs it with its send; the call's end still completes t_status meanwhile. */
      if (!cl->recv_armed && (s->o_head || s->cur != cl)) arm_recv_locked(cl, false);
      cl->ops_pending--;
      pthread_mutex_unlock(&s->lock);
      return;
    }
    pthread_mutex_unlock(&s->lock);
    call_batch_done(s, cl);
    return;
  }
  if (bb) grpc_byte_buffer_destroy(bb);
  /* End of stream or failure: the status batch reports why. */
  call_batch_done(s, cl);
}

/* A paired send and receive (t_sendrecv) completed: the send's part (what queued behind it
 * goes now), then the reply's, which also settles the batch. */
static void on_sendrecv(gc__stream *s, gc__call *cl, bool ok) {
  send_settle(s, cl, ok);
  on_recv(s, cl, ok);
}

/* The call ended: fail everything outstanding on the stream at once. */
static void on_status(gc__stream *s, gc__call *cl) {
  gc__req *list = NULL;
  int rc = MR_EUNAVAIL;
  bool down = false;
  char why[384];

  pthread_mutex_lock(&s->lock);
  cl->finished = true;
  bool was_cur = s->cur == cl;
  bool closing = s->closing;
  if (was_cur) {
    char det[MR_LOG_ESC_MAX]; /* the server's words: escaped before they reach a log line */
    mr_log_escape(det, sizeof det, (const char *)GRPC_SLICE_START_PTR(cl->details),
                  GRPC_SLICE_LENGTH(cl->details));
    if (s->break_rc) {
      rc = s->break_rc;
      snprintf(why, sizeof why, "%s", s->break_msg);
    } else if (closing) {
      rc = MR_ECANCELED;
      snprintf(why, sizeof why, "cluster closed (%s: %s)", pr_status_name(cl->status), det);
    } else {
      /* A refused token is no outage: retrying the same token will not help. */
      if (cl->status == GRPC_STATUS_UNAUTHENTICATED) rc = MR_EAUTH;
      snprintf(why, sizeof why, "stream ended (%s: %s)", pr_status_name(cl->status),
               *det ? det : "no details");
    }
    s->cur = NULL;
    s->send_busy = false;
    /* Detach the outstanding list: these requests are ours now (linked = false makes a
     * waiter's gc__stream_forget leave them alone). */
    list = s->o_head;
    s->o_head = NULL;
    for (gc__req *r = list; r; r = r->o_next) r->linked = false;
    s->q_head = s->q_tail = NULL;
    if (!closing) {
      s->ctr.stream_breaks++;
      s->failfast = true;
    }
    uint64_t n = 0;
    for (gc__req *r = list; r; r = r->o_next) {
      n++;
      atomic_fetch_sub(&s->out_slots, r->n_slots);
    }
    s->ctr.errors += n;
    /* A stream that ended by itself (server gone, connection reset) takes the server down
     * until a fresh Hello; its requests go to other replicas. Our own cancel (a malformed
     * reply) and a refused token are errors of this call, not an outage. */
    down = !closing && rc == MR_EUNAVAIL;
    if (!closing || n)
      mr_log(closing ? MR_LOG_INFO : down ? MR_LOG_DEBUG : MR_LOG_WARN, GC__SRV_FMT ": Forward "
             "%s; failing %llu outstanding request%s", GC__SRV_ARGS(s->srv), why,
             (unsigned long long)n, n == 1 ? "" : "s");
    else
      mr_log(MR_LOG_DEBUG, GC__SRV_FMT ": Forward stream closed (%s)", GC__SRV_ARGS(s->srv),
             pr_status_name(cl->status));
  }
  pthread_mutex_unlock(&s->lock);
  /* Before the requests fail, so that the waiters' re-plans leave this server out. */
  if (down) gc__server_down(s->c, s->idx, true, why);

  for (gc__req *r = list, *next; r; r = next) {
    next = r->o_next;
    r->o_prev = r->o_next = NULL;
    r->q_next = NULL;
    gc_pending *p = r->p;
    grpc_byte_buffer *bb = r->bb;
    r->bb = NULL;
    if (bb) grpc_byte_buffer_destroy(bb);
    mr_err err;
    mr_err_set(&err, rc, "layer %u request %llu: " GC__SRV_FMT ": %s", p->layer,
               (unsigned long long)r->id, GC__SRV_ARGS(s->srv), why);
    gc__req_complete(r, rc, &err, down ? GC__DONE_RETRY : 0);
    gc__pending_unref(p); /* last use of r */
  }
  call_batch_done(s, cl);
}

static void *io_main(void *arg) {
  gc_cluster *c = arg;
  for (;;) {
    grpc_event ev = grpc_completion_queue_next(c->cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL);
    if (ev.type == GRPC_QUEUE_SHUTDOWN) break;
    MR_ASSERT(ev.type == GRPC_OP_COMPLETE);
    gc__tag *t = ev.tag;
    PR_HB_ACQUIRE(t);
    gc__call *cl = t->call;
    gc__stream *s = cl->s;
    switch (t->op) {
    case GC__OP_START:
      if (!ev.success)
        mr_log(MR_LOG_DEBUG, GC__SRV_FMT ": initial metadata not sent (call ending)",
               GC__SRV_ARGS(s->srv));
      call_batch_done(s, cl);
      break;
    case GC__OP_SEND:
    case GC__OP_CLOSE: on_send(s, cl, ev.success != 0); break;
    case GC__OP_RECV: on_recv(s, cl, ev.success != 0); break;
    case GC__OP_SENDRECV: on_sendrecv(s, cl, ev.success != 0); break;
    case GC__OP_STATUS: on_status(s, cl); break;
    }
  }
  return NULL;
}

/* ---- start / stop ------------------------------------------------------------------------ */

int gc__streams_start(gc_cluster *c, mr_err *e) {
  int rc = 0;
  if (c->n_auth_md) c->fwd_md[c->n_fwd_md++] = c->auth_md;
  char name[PR_CLIENT_NAME_MAX + 1];
  size_t n = 0;
  for (const char *p = c->client_name; *p && n < PR_CLIENT_NAME_MAX; p++)
    name[n++] = *p >= 0x20 && *p < 0x7f ? *p : '?'; /* a header value: printable ASCII */
  name[n] = '\0';
  c->fwd_md[c->n_fwd_md].key = grpc_slice_from_static_string(PR_MD_CLIENT_NAME);
  c->fwd_md[c->n_fwd_md++].value = grpc_slice_from_copied_string(name);
  c->cq = grpc_completion_queue_create_for_next(NULL);
  for (uint32_t i = 0; i < c->n_servers; i++) {
    gc__stream *s = &c->streams[i];
    s->c = c;
    s->idx = i;
    s->srv = &c->servers[i];
    pthread_mutex_init(&s->lock, NULL);
    atomic_init(&s->out_slots, 0);
    atomic_init(&s->t_reply_ns, 0);
    atomic_init(&s->t_last_ok_ns, 0);
    atomic_init(&s->up, true); /* it answered the Hello round */
    /* Room for a full request or reply at the server's max_tokens: the server's own limit. */
    uint64_t max = pr_forward_max_bytes(s->srv->max_tokens, c->H, c->E);
    s->ch = gc__channel_new(c, s->srv, max > INT_MAX ? INT_MAX : (int)max);
    s->inited = true;
    if (!s->ch)
      return mr_err_set(e, MR_EUNAVAIL, GC__SRV_FMT ": could not create a data channel",
                        GC__SRV_ARGS(s->srv));
    s->forward_method = grpc_channel_register_call(s->ch, PR_METHOD_FORWARD, NULL, NULL);
  }
  if (pthread_create(&c->io_thread, NULL, io_main, c) != 0)
    return mr_err_set(e, MR_ENOMEM, "client I/O thread: %s", strerror(errno));
  c->io_started = true;
  for (uint32_t i = 0; i < c->n_servers && !rc; i++) {
    gc__stream *s = &c->streams[i];
    /* An alias of another entry gets no traffic: no stream of its own to the same server
     * (so its death is not seen twice either). */
    if (c->servers[i].alias_of >= 0) continue;
    pthread_mutex_lock(&s->lock);
    rc = stream_open_locked(s, e);
    pthread_mutex_unlock(&s->lock);
  }
  return rc;
}

static bool wait_calls(gc_cluster *c, int ms) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  ts.tv_sec += ms / 1000;
  ts.tv_nsec += (long)(ms % 1000) * 1000000L;
  if (ts.tv_nsec >= 1000000000L) {
    ts.tv_sec++;
    ts.tv_nsec -= 1000000000L;
  }
  pthread_mutex_lock(&c->calls_lock);
  while (c->live_calls > 0)
    if (pthread_cond_timedwait(&c->calls_cond, &c->calls_lock, &ts) == ETIMEDOUT) break;
  bool all = c->live_calls == 0;
  pthread_mutex_unlock(&c->calls_lock);
  return all;
}

void gc__streams_stop(gc_cluster *c) {
  if (!c->streams) return;
  if (c->io_started) {
    for (uint32_t i = 0; i < c->n_servers; i++) {
      gc__stream *s = &c->streams[i];
      if (!s->inited) continue;
      pthread_mutex_lock(&s->lock);
      s->closing = true;
      stream_kick_locked(s);
      pthread_mutex_unlock(&s->lock);
    }
    if (!wait_calls(c, GC__CLOSE_WAIT_MS)) {
      mr_log(MR_LOG_WARN, "close: servers did not end their streams within %d ms; cancelling",
             GC__CLOSE_WAIT_MS);
      for (uint32_t i = 0; i < c->n_servers; i++) {
        gc__stream *s = &c->streams[i];
        if (!s->inited) continue;
        pthread_mutex_lock(&s->lock);
        if (s->cur) grpc_call_cancel(s->cur->call, NULL);
        pthread_mutex_unlock(&s->lock);
      }
      if (!wait_calls(c, GC__CANCEL_WAIT_MS))
        mr_log(MR_LOG_ERROR, "close: %d calls still open %d ms after cancel", c->live_calls,
               GC__CANCEL_WAIT_MS);
    }
    grpc_completion_queue_shutdown(c->cq);
    pthread_join(c->io_thread, NULL);
    c->io_started = false;
  } else if (c->cq) {
    grpc_completion_queue_shutdown(c->cq);
    while (grpc_completion_queue_next(c->cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL).type !=
           GRPC_QUEUE_SHUTDOWN) {
    }
  }
  if (c->cq) grpc_completion_queue_destroy(c->cq);
  c->cq = NULL;
  for (uint32_t i = 0; i < c->n_servers; i++) {
    gc__stream *s = &c->streams[i];
    if (!s->inited) continue;
    if (s->ch) grpc_channel_destroy(s->ch);
    pthread_mutex_destroy(&s->lock);
    s->inited = false;
  }
  pr_split_free(&c->io_split);
}
