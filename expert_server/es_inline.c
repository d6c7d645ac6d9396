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
 * Threads: the slot belongs to its CQ thread alone. The engine and the compute arena belong
 * to whoever set srv->computing (es__compute_claim): the compute thread or one CQ thread.
 */
#include "expert_server/internal.h"

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
  es__compute_run_one(s, job);
  ops->released(owner); /* after the reply's send started: see the top */
  es__compute_release(s);
}
