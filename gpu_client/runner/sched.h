/*
 * sched.h - continuous batching over one gc_model (prefix gc_sched_): the engine behind
 * `moerpc-client serve` and the text modes of `generate`.
 *
 * Requests (a prompt of token ids, sampling parameters, stop ids, a token budget) are
 * submitted from any thread and join the running batch at the next step boundary. Each
 * step, the scheduler thread builds one ragged gc_step:
 *
 *   1. every running sequence that has finished its prompt decodes one token;
 *   2. the rest of the step's token budget (step_tokens) goes to prompts, in arrival
 *      order: a prompt longer than what is left is prefilled in chunks over several
 *      steps (chunked prefill), so the running sequences keep their decode pace while a
 *      long prompt comes in;
 *   3. one gc_model_step; then, for each sequence whose logits were computed (a decode
 *      token, or the last chunk of a prompt), a token is sampled with the request's own
 *      PRNG and handed to on_token.
 *
 * A sequence owns one KV slot of the model from admission to its end; a slot is reset and
 * reused at once. A request ends (on_done, exactly once) with:
 *   GC_FINISH_STOP       a stop id was sampled (not passed to on_token), or on_token
 *                        returned true (a stop string the caller matched);
 *   GC_FINISH_LENGTH     max_new tokens were produced (or the slot's positions ran out);
 *   GC_FINISH_CANCELLED  gc_sched_cancel (a client that went away), or the scheduler was
 *                        freed or stopped without draining;
 *   GC_FINISH_ERROR      the model step failed (an expert server without a live replica):
 *                        every sequence of that step ends with its error, the next steps
 *                        go on with the others and with new requests.
 *
 * Independence: a sequence's tokens depend on its prompt, its seed and the model only. Its
 * attention reads its own slot; its sampling uses its own PRNG; on the fp32 wire with the
 * reference kernels every other computation of its token is per token, so greedy output is
 * the same alone or among others. With the fast kernels the experts of a step are computed
 * over the tokens that share them, and a kernel's summation order can depend on how many
 * tokens an expert sees (decode and prefill paths), so logits can differ in the last bits
 * and a near-tie can flip (docs/DESIGN.md section 9).
 *
 * Threads: gc_sched_submit, gc_sched_cancel, gc_sched_stop and gc_sched_stats from any
 * thread; gc_sched_step / gc_sched_run on one thread (the one that drives the model), which
 * is where on_token and on_done run. Lock: s->lock guards the queue, the cancel and stop
 * flags and the counters; it is never held while a callback or the model runs.
 */
#ifndef GC_SCHED_H
#define GC_SCHED_H

#include "gpu_client/runner/model.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct gc_sched gc_sched;

typedef enum gc_finish {
  GC_FINISH_NONE = 0,
  GC_FINISH_STOP,
  GC_FINISH_LENGTH,
  GC_FINISH_CANCELLED,
  GC_FINISH_ERROR,
} gc_finish;
/* "stop", "length", "cancelled", "error" */
const char *gc_finish_name(gc_finish f);

#define GC_SCHED_MAX_TOP_LOGPROBS 20u
#define GC_SCHED_MAX_STOP_IDS 16u

/* One produced token, valid during on_token. */
typedef struct gc_sched_token {
  int32_t id;
  uint32_t index;             /* 0 for the first produced token */
  float logprob;              /* with want_logprobs: log-softmax of the raw logits */
  uint32_t n_top;             /* top_logprobs entries (best first) */
  const gc_logprob *top;
} gc_sched_token;

typedef struct gc_sched_usage {
  uint32_t prompt_tokens, completion_tokens;
  uint64_t t_submit_ns, t_first_ns, t_end_ns; /* mr_now_ns; t_first 0 = no token */
} gc_sched_usage;

typedef struct gc_sched_req {
  const int32_t *prompt;      /* [n_prompt] ids < vocab (copied at submit) */
  uint32_t n_prompt;          /* >= 1; n_prompt + max_new <= the model's max_seq */
  uint32_t max_new;           /* >= 1 */
  gc_sampling smp;            /* temperature, top_p, top_k, seed */
  int32_t stop_ids[GC_SCHED_MAX_STOP_IDS]; /* ids that end the request (EOS), -1 unused */
  bool want_logprobs;
  uint32_t top_logprobs;      /* 0..GC_SCHED_MAX_TOP_LOGPROBS (needs want_logprobs) */
  /* On the scheduler thread, once per produced token (never for a stop id). Return true
   * to end the request now with GC_FINISH_STOP. */
  bool (*on_token)(void *ud, const gc_sched_token *t);
  /* On the scheduler thread, exactly once; err is set for GC_FINISH_ERROR. After it the
   * scheduler never touches ud again. */
  void (*on_done)(void *ud, gc_finish why, const mr_err *err, const gc_sched_usage *u);
  void *ud;
} gc_sched_req;

typedef struct gc_sched_opts {
  uint32_t max_queue;         /* requests waiting for a slot; 0 = 256 */
  uint32_t step_tokens;       /* token budget of one step (decode + prefill chunks); 0 = 512 */
  /* Called on the scheduler thread at the start of every step, before the boundary takes
   * cancels and admits requests: the place to gc_sched_cancel what went away (serve polls
   * its waiting connections there, so a dropped client ends within one step). NULL = none. */
  void (*on_boundary)(void *ud);
  void *boundary_ud;
} gc_sched_opts;

typedef struct gc_sched_stats {
  uint32_t queued, running, slots, slots_in_use;
  uint64_t submitted, refused_full, finished[GC_FINISH_ERROR + 1];
  uint64_t prompt_tokens, completion_tokens, steps;
  uint64_t failed_steps; /* steps whose gc_model_step failed (their sequences ended with ERROR) */
} gc_sched_stats;

/* A scheduler over m (it drives m from now on: nobody else may step it). o may be NULL. */
int gc_sched_new(gc_sched **out, gc_model *m, const gc_sched_opts *o, mr_err *e);
/* Ends every request left (GC_FINISH_CANCELLED, on the calling thread) and frees. Call it
 * from the thread that ran the scheduler, after gc_sched_run returned. NULL is a no-op. */
void gc_sched_free(gc_sched *s);

/* Queues r (its arrays are copied) and returns its id. Refused, with nothing queued:
 * MR_EINVAL / MR_ERANGE naming the field and the limit (empty prompt, an id out of the
 * vocabulary, prompt + max_new over max_seq, ...), MR_EEXHAUSTED when max_queue requests
 * wait already, MR_EUNAVAIL once the scheduler is stopping. Any thread. */
int gc_sched_submit(gc_sched *s, const gc_sched_req *r, uint64_t *id, mr_err *e);
/* Asks request id to end (GC_FINISH_CANCELLED) at the next step boundary; unknown or
 * finished ids are ignored. Any thread. */
void gc_sched_cancel(gc_sched *s, uint64_t id);

/* One step: admits queued requests into free slots, runs one model step over the running
 * sequences and calls their callbacks. *busy is false when there was nothing to do.
 * Returns 0; a failed model step is not an error of the scheduler (its sequences end with
 * GC_FINISH_ERROR). Scheduler thread. */
int gc_sched_step(gc_sched *s, bool *busy);
/* Steps until gc_sched_stop, sleeping while there is nothing to do. With a drain stop, it
 * returns once every running and queued request has ended (or the drain deadline passed:
 * those left end CANCELLED); without, at the next step boundary, cancelling what is left.
 * Scheduler thread. */
void gc_sched_run(gc_sched *s);
/* Stops taking requests (submit answers MR_EUNAVAIL) and makes gc_sched_run return:
 * drain_ms > 0 finishes the running and queued requests first, for at most drain_ms. Any
 * thread, any number of times. */
void gc_sched_stop(gc_sched *s, uint32_t drain_ms);
bool gc_sched_stopping(gc_sched *s);
void gc_sched_stats_get(gc_sched *s, gc_sched_stats *out);

#ifdef __cplusplus
}
#endif
#endif /* GC_SCHED_H */
