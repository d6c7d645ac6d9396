/*
 * es_inline.c - the inline run: a small request computed on the CQ thread that received it,
 * when nothing else wants the engine. Everything about it is here; the rest of the server
 * sees three calls (internal.h): es__inline_offer (es_stream.c, for every valid request),
 * es__inline_run and es__inline_held (es_grpc.c's dispatcher).
 *
 * Why. Handing a request to the compute thread costs a wake-up (~15-20 us on a busy host) on
 * every round trip, as much as the whole compute of a decode-sized request.
 *
 * The rule. A CQ thread holds back a request of at most ES_INLINE_MAX_TOKENS tokens in its
 * slot (es_cq_thread.inline_job) and polls its completion queue without blocking. When the
 * poll finds no event (the round of events is over) and the compute queue is empty and the
 * engine idle, the CQ thread claims the engine (srv->computing, under q_lock) and runs the
 * request itself. Otherwise it goes to the compute queue:
 *
 *   offer(job)    slot empty, job small   -> held in the slot (the stream's RECV waits)
 *                 slot empty, job large   -> compute queue
 *                 slot full               -> the held job and this one both go to the queue,
 *                                            where they merge if they share layer and dtype
 *   run()         slot full, engine idle  -> computed here (or answered uncomputed if its
 *                 and queue empty            stream died or its budget passed meanwhile)
 *                 slot full, else         -> compute queue
 *
 * While it computes, the CQ thread reads nothing: requests of other streams wait in gRPC (they
 * would wait for the engine anyway) and are read, and merged, in the next round. Larger
 * requests never run inline, so that the thread stays responsive.
 *
 * The held request's stream. Its RECV is not re-armed while the request is in the slot: gRPC
 * answers a re-arm with a WINDOW_UPDATE write, which would go out on its own ahead of the
 * reply (one more write and one more client wake-up per round trip). So the slot tells the
 * stream when it lets go of the job (es_job_ops.released): at once when the job goes to the
 * queue, and after the job's done (its reply's send started) when it ran here, so that the
 * WINDOW_UPDATE rides in the reply's write. A held request's stream has no RECV armed, so it
 * can have no second request in the same round: the two jobs of a full slot are of two
 * streams.
 *
 * Where it runs. The thread that calls the engine does worker 0's share, and the engine's
 * pool threads are pinned to the other cores: a CQ thread left wherever the OS put it may
 * sit on a pool thread's core while worker 0's core idles, and the step then runs at about
 * half speed for as long as it stays there (measured on a 2-vCPU Xeon with the client on
 * the same cores, 5 rounds: one server's decode 0.87 of all-local unpinned, 0.93 pinned;
 * docs/BENCHMARKS.md). So a CQ thread takes worker 0's core for the run
 * (kn_engine_pin_caller) and gets its own mask back after: two sched_setaffinity calls
 * per inline run, 1.2 us together when the thread already runs there. Moving it costs
 * more (~40 us on a 2-vCPU VM), but a thread wakes where it last ran: a 64-token decode
 * moved the server's threads once in 3 s (67 times unpinned). The compute thread pins
 * itself once (es_compute.c).
 *
 * Threads: the slot belongs to its CQ thread alone. The engine and the compute arena belong
 * to whoever set srv->computing (es__compute_claim): the compute thread or one CQ thread.
 */
#define _GNU_SOURCE /* pthread_getaffinity_np, pthread_setaffinity_np */
#include <pthread.h>
#include <sched.h>

#include "expert_server/internal.h"

/* This CQ thread's own CPU mask, read at its first inline run; restored after each. */
static _Thread_local cpu_set_t io_mask;
static _Thread_local int io_mask_state; /* 0 unread, 1 read, -1 unreadable (no pinning) */

/* Pins the calling CQ thread to worker 0's core for one run. True when it did (and the
 * caller must call unpin_after_run). Once the OS refuses, the server stops trying and runs
 * unpinned (logged once, by es__compute_pin). */
static bool pin_for_run(es_server *s) {
  if (atomic_load_explicit(&s->pin_refused, memory_order_relaxed)) return false;
  if (io_mask_state == 0)
    io_mask_state = pthread_getaffinity_np(pthread_self(), sizeof io_mask, &io_mask) == 0 ? 1 : -1;
  if (io_mask_state < 0) return false;
  return es__compute_pin(s, "a gRPC thread's inline run");
}

static void unpin_after_run(void) {
  (void)pthread_setaffinity_np(pthread_self(), sizeof io_mask, &io_mask);
}

bool es__inline_offer(es_cq_thread *t, es_job *job) {
  es_server *s = t->srv;
  job->t_enqueue_ns = mr_now_ns();
  if (t->inline_job) {
    es_job *both[2] = {t->inline_job, job};
    t->inline_job = NULL;
    MR_ASSERT(both[0]->lane != job->lane); /* a held request's stream has no RECV armed */
    const es_job_ops *ops = both[0]->ops;
    void *owner = both[0]->owner; /* the compute thread may answer it before the call below */
    es__compute_submit(s, both, 2);
    ops->released(owner);
    return false;
  }
  if (job->n_tokens <= ES_INLINE_MAX_TOKENS) {
    t->inline_job = job; /* decided by es__inline_run when this round of events is over */
    return true;
  }
  es__compute_submit(s, &job, 1);
  return false;
}

bool es__inline_held(const es_cq_thread *t) { return t->inline_job != NULL; }

void es__inline_run(es_cq_thread *t) {
  es_job *job = t->inline_job;
  if (!job) return;
  t->inline_job = NULL;
  es_server *s = t->srv;
  const es_job_ops *ops = job->ops;
  void *owner = job->owner; /* the job may be gone once it is answered */
  if (!es__compute_claim(s)) {
    es__compute_submit(s, &job, 1);
    ops->released(owner);
    return;
  }
  const bool pinned = pin_for_run(s);
  es__compute_run_one(s, job);
  if (pinned) unpin_after_run();
  ops->released(owner); /* after the reply's send started: see the top */
  es__compute_release(s);
}
