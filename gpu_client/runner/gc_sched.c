/*
 * gc_sched.c - continuous batching over one gc_model (sched.h has the contract).
 *
 * The life of a request:
 *
 *   submit (any thread)     validated, prompt copied, appended to the queue (s->lock)
 *        |                  refused: bad fields, queue full, stopping
 *        v
 *   queued  --a slot frees at a step boundary--> running (owns KV slot r->slot)
 *                                                  |  prefill: chunks of the prompt, as much
 *                                                  |  of each step's budget as decoders leave
 *                                                  v
 *                                               decoding: one token per step
 *                                                  |
 *        stop id / on_token true / max_new / cancel / step error
 *                                                  v
 *                                  on_done (once), slot reset and freed at once
 *
 * Step assembly, in this order, so that the tokens of one slot are contiguous and in
 * position order (gc_model_step's rule):
 *   - decoders: every running request whose prompt is in the cache, its last token at
 *     position len (the cache length), logits wanted;
 *   - prefill: requests whose prompt is not all in yet, in admission order, each a chunk
 *     of at most what is left of step_tokens (positions prefilled..), logits wanted only
 *     for the chunk that ends the prompt (its last token's logits give the first sample).
 * Decoders are never held back by the budget (step_tokens >= slots, checked at new), so a
 * long prompt costs the running streams at most one step of step_tokens tokens each step.
 *
 * Sampling uses the request's PRNG (seeded from its seed, or its id when the seed is 0),
 * advanced only by its own draws: the same request gives the same tokens whoever shares
 * its steps (sched.h, "Independence").
 */
#include "gpu_client/runner/sched.h"

#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#define GC__SCHED_DEFAULT_QUEUE 256u
#define GC__SCHED_DEFAULT_STEP_TOKENS 512u

typedef struct sreq {
  uint64_t id;
  gc_sched_req r;         /* r.prompt points at prompt below */
  int32_t *prompt;        /* owned copy */
  uint32_t slot;          /* KV slot while running */
  uint32_t len;           /* tokens in the slot's cache */
  uint32_t prefilled;     /* prompt tokens in the cache */
  uint32_t produced;      /* tokens sampled (a stop id included) */
  int32_t last;           /* the last sampled id: the next decode input */
  uint32_t in_step;       /* tokens of this request in the step being built */
  uint64_t rng;
  bool cancel;            /* under s->lock */
  bool ended;             /* on_done called (scheduler thread) */
  gc_sched_usage u;
  struct sreq *next;      /* queue link */
} sreq;

struct gc_sched {
  gc_model *m;
  uint32_t V, max_seq, slots, max_queue, step_tokens;
  pthread_mutex_t lock;   /* queue, run membership, cancel / stop flags, counters */
  pthread_cond_t cond;    /* work arrived or stop asked */
  sreq *q_head, *q_tail;
  uint32_t q_len;         /* queued, cancelled ones included until the next boundary */
  uint32_t q_live;        /* queued and not cancelled: what --max-queue bounds */
  sreq **run;             /* [slots] running requests (membership changes under lock) */
  uint32_t n_run;
  uint8_t *slot_used;     /* [slots] (scheduler thread) */
  uint64_t next_id;
  bool stopping;
  uint64_t drain_deadline_ns; /* 0 = no drain: stop at the next boundary */
  void (*on_boundary)(void *ud);
  void *boundary_ud;
  gc_sched_stats st;      /* counters (under lock) */
  /* step buffers (scheduler thread) */
  uint32_t cap;           /* tokens: step_tokens + slots */
  int32_t *ids;
  uint32_t *seq, *pos;
  uint8_t *want;
  float *logits;          /* [slots, V]: at most one wanted row per request per step */
  sreq **want_req;        /* [slots] the request of each wanted row */
  gc_logprob *top;        /* [GC_SCHED_MAX_TOP_LOGPROBS] */
};

const char *gc_finish_name(gc_finish f) {
  switch (f) {
    case GC_FINISH_STOP: return "stop";
    case GC_FINISH_LENGTH: return "length";
    case GC_FINISH_CANCELLED: return "cancelled";
    case GC_FINISH_ERROR: return "error";
    default: return "none";
  }
}

int gc_sched_new(gc_sched **out, gc_model *m, const gc_sched_opts *o, mr_err *e) {
  *out = NULL;
  gc_sched *s = mr_calloc(1, sizeof *s);
  if (!s) return mr_err_set(e, MR_ENOMEM, "scheduler: out of memory");
  s->m = m;
  s->V = gc_model_config(m)->vocab_size;
  s->max_seq = gc_model_max_seq(m);
  s->slots = gc_model_max_batch(m);
  s->max_queue = o && o->max_queue ? o->max_queue : GC__SCHED_DEFAULT_QUEUE;
  s->step_tokens = o && o->step_tokens ? o->step_tokens : GC__SCHED_DEFAULT_STEP_TOKENS;
  if (s->step_tokens < s->slots) s->step_tokens = s->slots; /* decoders never wait */
  if (o) {
    s->on_boundary = o->on_boundary;
    s->boundary_ud = o->boundary_ud;
  }
  s->cap = s->step_tokens + s->slots;
  s->run = mr_calloc(s->slots, sizeof *s->run);
  s->slot_used = mr_calloc(s->slots, 1);
  s->ids = mr_malloc((size_t)s->cap * sizeof *s->ids);
  s->seq = mr_malloc((size_t)s->cap * sizeof *s->seq);
  s->pos = mr_malloc((size_t)s->cap * sizeof *s->pos);
  s->want = mr_malloc(s->cap);
  s->logits = mr_malloc((size_t)s->slots * s->V * sizeof *s->logits);
  s->want_req = mr_calloc(s->slots, sizeof *s->want_req);
  s->top = mr_calloc(GC_SCHED_MAX_TOP_LOGPROBS, sizeof *s->top);
  pthread_mutex_init(&s->lock, NULL);
  pthread_cond_init(&s->cond, NULL);
  if (!s->run || !s->slot_used || !s->ids || !s->seq || !s->pos || !s->want || !s->logits ||
      !s->want_req || !s->top) {
    gc_sched_free(s);
    return mr_err_set(e, MR_ENOMEM, "scheduler of %u slots x %u vocabulary: out of memory", s->slots, s->V);
  }
  s->st.slots = s->slots;
  *out = s;
  return 0;
}

static void sreq_free(sreq *r) {
  if (!r) return;
  mr_free(r->prompt);
  mr_free(r);
}

/* Ends r (once): counters, slot, on_done. The scheduler thread; r must be out of the run
 * array and the queue already. */
static void finish(gc_sched *s, sreq *r, gc_finish why, const mr_err *err) {
  if (r->ended) return;
  r->ended = true;
  r->u.t_end_ns = mr_now_ns();
  r->u.completion_tokens = r->produced;
  pthread_mutex_lock(&s->lock);
  s->st.finished[why]++;
  s->st.completion_tokens += r->produced;
  pthread_mutex_unlock(&s->lock);
  if (r->r.on_done) r->r.on_done(r->r.ud, why, err, &r->u);
  sreq_free(r);
}

/* Takes running request i out of the run array and frees its slot (reset for the next). */
static sreq *run_remove(gc_sched *s, uint32_t i) {
  sreq *r = s->run[i];
  pthread_mutex_lock(&s->lock);
  s->run[i] = s->run[--s->n_run];
  s->run[s->n_run] = NULL;
  pthread_mutex_unlock(&s->lock);
  gc_model_seq_reset(s->m, r->slot);
  s->slot_used[r->slot] = 0;
  return r;
}

void gc_sched_free(gc_sched *s) {
  if (!s) return;
  while (s->n_run) finish(s, run_remove(s, s->n_run - 1), GC_FINISH_CANCELLED, NULL);
  for (sreq *r = s->q_head, *n; r; r = n) {
    n = r->next;
    finish(s, r, GC_FINISH_CANCELLED, NULL);
  }
  pthread_mutex_destroy(&s->lock);
  pthread_cond_destroy(&s->cond);
  mr_free(s->run);
  mr_free(s->slot_used);
  mr_free(s->ids);
  mr_free(s->seq);
  mr_free(s->pos);
  mr_free(s->want);
  mr_free(s->logits);
  mr_free(s->want_req);
  mr_free(s->top);
  mr_free(s);
}

/* ---- submit / cancel / stop (any thread) ------------------------------------------------ */

static int req_check(const gc_sched *s, const gc_sched_req *r, mr_err *e) {
  if (!r->prompt || r->n_prompt < 1)
    return mr_err_set(e, MR_EINVAL, "prompt: empty (at least one token)");
  if (r->max_new < 1) return mr_err_set(e, MR_EINVAL, "max_tokens = 0, must be at least 1");
  if ((uint64_t)r->n_prompt + r->max_new > s->max_seq)
    return mr_err_set(e, MR_ERANGE, "prompt of %u tokens + max_tokens %u = %llu, more than the "
                      "context of %u tokens (--max-seq)", r->n_prompt, r->max_new,
                      (unsigned long long)r->n_prompt + r->max_new, s->max_seq);
  for (uint32_t i = 0; i < r->n_prompt; i++)
    if (r->prompt[i] < 0 || (uint32_t)r->prompt[i] >= s->V)
      return mr_err_set(e, MR_ERANGE, "prompt[%u] = %d, must be in 0..%u (the vocabulary)", i, r->prompt[i],
                        s->V - 1);
  if (!(r->smp.temperature >= 0 && r->smp.temperature <= 100))
    return mr_err_set(e, MR_ERANGE, "temperature = %g, must be in 0..100", r->smp.temperature);
  if (!(r->smp.top_p > 0 && r->smp.top_p <= 1) && r->smp.top_p != 0)
    return mr_err_set(e, MR_ERANGE, "top_p = %g, must be in (0, 1]", r->smp.top_p);
  if (r->top_logprobs > GC_SCHED_MAX_TOP_LOGPROBS)
    return mr_err_set(e, MR_ERANGE, "top_logprobs = %u, must be at most %u", r->top_logprobs,
                      GC_SCHED_MAX_TOP_LOGPROBS);
  return 0;
}

int gc_sched_submit(gc_sched *s, const gc_sched_req *r, uint64_t *id, mr_err *e) {
  int rc = req_check(s, r, e);
  if (rc) return rc;
  sreq *q = mr_calloc(1, sizeof *q);
  int32_t *p = q ? mr_malloc((size_t)r->n_prompt * sizeof *p) : NULL;
  if (!q || !p) {
    mr_free(q);
    return mr_err_set(e, MR_ENOMEM, "request of %u tokens: out of memory", r->n_prompt);
  }
  memcpy(p, r->prompt, (size_t)r->n_prompt * sizeof *p);
  q->r = *r;
  q->r.prompt = q->prompt = p;
  q->u.prompt_tokens = r->n_prompt;
  q->u.t_submit_ns = mr_now_ns();
  pthread_mutex_lock(&s->lock);
  if (s->stopping) {
    rc = mr_err_set(e, MR_EUNAVAIL, "the server is shutting down");
  } else if (s->q_live >= s->max_queue) {
    s->st.refused_full++;
    rc = mr_err_set(e, MR_EEXHAUSTED, "%u requests wait already (--max-queue %u)", s->q_live, s->max_queue);
  } else {
    q->id = ++s->next_id;
    /* seed 0: a stream of its own anyway, from the request id */
    q->rng = (r->smp.seed ? r->smp.seed : q->id) ^ 0x632be59bd9b4e019ull;
    if (s->q_tail) s->q_tail->next = q;
    else s->q_head = q;
    s->q_tail = q;
    s->q_len++;
    s->q_live++;
    s->st.submitted++;
    s->st.prompt_tokens += r->n_prompt;
    if (id) *id = q->id;
    pthread_cond_signal(&s->cond);
  }
  pthread_mutex_unlock(&s->lock);
  if (rc) sreq_free(q);
  return rc;
}

void gc_sched_cancel(gc_sched *s, uint64_t id) {
  pthread_mutex_lock(&s->lock);
  for (sreq *q = s->q_head; q; q = q->next)
    if (q->id == id && !q->cancel) {
      q->cancel = true;
      s->q_live--; /* its place in the queue is free at once */
    }
  for (uint32_t i = 0; i < s->n_run; i++)
    if (s->run[i]->id == id) s->run[i]->cancel = true;
  pthread_cond_signal(&s->cond);
  pthread_mutex_unlock(&s->lock);
}

void gc_sched_stop(gc_sched *s, uint32_t drain_ms) {
  pthread_mutex_lock(&s->lock);
  if (!s->stopping) {
    s->stopping = true;
    s->drain_deadline_ns = drain_ms ? mr_now_ns() + (uint64_t)drain_ms * 1000000u : 0;
  } else if (!drain_ms) {
    s->drain_deadline_ns = 0; /* a second stop without drain cuts the drain short */
  }
  pthread_cond_broadcast(&s->cond);
  pthread_mutex_unlock(&s->lock);
}

bool gc_sched_stopping(gc_sched *s) {
  pthread_mutex_lock(&s->lock);
  bool v = s->stopping;
  pthread_mutex_unlock(&s->lock);
  return v;
}

void gc_sched_stats_get(gc_sched *s, gc_sched_stats *out) {
  pthread_mutex_lock(&s->lock);
  *out = s->st;
  out->queued = s->q_live;
  out->running = s->n_run;
  out->slots_in_use = s->n_run;
  pthread_mutex_unlock(&s->lock);
}

/* ---- one step (the scheduler thread) ----------------------------------------------------- */

/* At a step boundary: the requests to end now (cancelled, or everything when a stop cuts
 * short), and queued requests into free slots. */
static void boundary(gc_sched *s) {
  sreq *ending = NULL; /* queued ones cancelled: finished below, outside the lock */
  pthread_mutex_lock(&s->lock);
  const bool cut = s->stopping && (!s->drain_deadline_ns || mr_now_ns() > s->drain_deadline_ns);
  for (sreq **pp = &s->q_head; *pp;) {
    sreq *q = *pp;
    if (q->cancel || cut) {
      *pp = q->next;
      if (s->q_tail == q) s->q_tail = NULL;
      s->q_len--;
      if (!q->cancel) s->q_live--;
      q->next = ending;
      ending = q;
      continue;
    }
    pp = &q->next;
  }
  if (!s->q_head) s->q_tail = NULL;
  else
    for (sreq *q = s->q_head; q; q = q->next) s->q_tail = q;
  for (uint32_t i = 0; i < s->n_run; i++)
    if (cut) s->run[i]->cancel = true;
  pthread_mutex_unlock(&s->lock);
  for (sreq *q = ending, *n; q; q = n) {
    n = q->next;
    finish(s, q, GC_FINISH_CANCELLED, NULL);
  }
  for (uint32_t i = 0; i < s->n_run;) { /* running ones cancelled */
    bool c;
    pthread_mutex_lock(&s->lock);
    c = s->run[i]->cancel;
    pthread_mutex_unlock(&s->lock);
    if (c) finish(s, run_remove(s, i), GC_FINISH_CANCELLED, NULL);
    else i++;
  }
  /* admission: FIFO into free slots */
  for (uint32_t slot = 0; slot < s->slots; slot++) {
    if (s->slot_used[slot]) continue;
    pthread_mutex_lock(&s->lock);
    sreq *q = s->q_head;
    if (q) {
      s->q_head = q->next;
      if (!s->q_head) s->q_tail = NULL;
      s->q_len--;
      s->q_live--;
      q->next = NULL;
      q->slot = slot;
      s->run[s->n_run++] = q;
    }
    pthread_mutex_unlock(&s->lock);
    if (!q) break;
    s->slot_used[slot] = 1;
    gc_model_seq_reset(s->m, slot);
  }
}

/* The tokens of one step (see the top of the file); returns their number, 0 = nothing. */
static uint32_t assemble(gc_sched *s, uint32_t *n_want) {
  uint32_t n = 0, w = 0;
  for (uint32_t i = 0; i < s->n_run; i++) { /* decoders */
    sreq *r = s->run[i];
    r->in_step = 0;
    if (r->prefilled < r->r.n_prompt) continue;
    s->ids[n] = r->last;
    s->seq[n] = r->slot;
    s->pos[n] = r->len;
    s->want[n] = 1;
    s->want_req[w++] = r;
    r->in_step = 1;
    n++;
  }
  uint32_t budget = s->step_tokens > n ? s->step_tokens - n : 0;
  for (uint32_t i = 0; i < s->n_run && budget > 0; i++) { /* prompts, in admission order */
    sreq *r = s->run[i];
    if (r->prefilled >= r->r.n_prompt) continue;
    uint32_t c = r->r.n_prompt - r->prefilled;
    if (c > budget) c = budget;
    for (uint32_t k = 0; k < c; k++) {
      s->ids[n + k] = r->prompt[r->prefilled + k];
      s->seq[n + k] = r->slot;
      s->pos[n + k] = r->prefilled + k;
      s->want[n + k] = 0;
    }
    if (r->prefilled + c == r->r.n_prompt) { /* the prompt's last token: the first sample */
      s->want[n + c - 1] = 1;
      s->want_req[w++] = r;
    }
    r->in_step = c;
    n += c;
    budget -= c;
  }
  *n_want = w;
  return n;
}

static bool is_stop(const sreq *r, int32_t id) {
  for (uint32_t i = 0; i < GC_SCHED_MAX_STOP_IDS; i++)
    if (r->r.stop_ids[i] >= 0 && r->r.stop_ids[i] == id) return true;
  return false;
}

/* Samples request r's next token from row and hands it on; returns the finish reason,
 * GC_FINISH_NONE to go on. */
static gc_finish next_token(gc_sched *s, sreq *r, const float *row) {
  const int32_t id = gc_sample(row, s->V, &r->r.smp, &r->rng);
  if (r->produced == 0) r->u.t_first_ns = mr_now_ns();
  r->produced++;
  if (is_stop(r, id)) return GC_FINISH_STOP;
  gc_sched_token t = {.id = id, .index = r->produced - 1};
  if (r->r.want_logprobs &&
      gc_logprobs(row, s->V, id, r->r.top_logprobs, s->top, &t.logprob) == 0) {
    t.n_top = r->r.top_logprobs;
    t.top = s->top;
  }
  if (r->r.on_token && r->r.on_token(r->r.ud, &t)) return GC_FINISH_STOP;
  if (r->produced >= r->r.max_new || r->len + 1 > s->max_seq) return GC_FINISH_LENGTH;
  r->last = id;
  return GC_FINISH_NONE;
}

int gc_sched_step(gc_sched *s, bool *busy) {
  if (s->on_boundary) s->on_boundary(s->boundary_ud);
  boundary(s);
  uint32_t n_want = 0, n = assemble(s, &n_want);
  if (busy) *busy = n > 0;
  if (n == 0) return 0;
  mr_err e;
  mr_err_clear(&e);
  gc_step st = {.n_tokens = n, .ids = s->ids, .seq = s->seq, .pos = s->pos, .want_logits = s->want,
                .logits = s->logits};
  int rc = gc_model_step(s->m, &st, &e);
  pthread_mutex_lock(&s->lock);
  s->st.steps++;
  if (rc) s->st.failed_steps++;
  pthread_mutex_unlock(&s->lock);
  if (rc) { /* every sequence of the step ends with the error; the others go on */
    for (uint32_t i = 0; i < s->n_run;)
      if (s->run[i]->in_step) finish(s, run_remove(s, i), GC_FINISH_ERROR, &e);
      else i++;
    return 0;
  }
  for (uint32_t i = 0; i < s->n_run; i++) { /* the cache grew by what each fed */
    sreq *r = s->run[i];
    r->len += r->in_step;
    if (r->prefilled < r->r.n_prompt) r->prefilled += r->in_step;
  }
  for (uint32_t k = 0; k < n_want; k++) {
    sreq *r = s->want_req[k];
    gc_finish why = next_token(s, r, s->logits + (size_t)k * s->V);
    if (why == GC_FINISH_NONE) continue;
    for (uint32_t i = 0; i < s->n_run; i++)
      if (s->run[i] == r) {
        finish(s, run_remove(s, i), why, NULL);
        break;
      }
  }
  return 0;
}

void gc_sched_run(gc_sched *s) {
  for (;;) {
    bool busy = false;
    gc_sched_step(s, &busy);
    pthread_mutex_lock(&s->lock);
    const bool empty = s->n_run == 0 && s->q_len == 0;
    if (s->stopping && empty) {
      pthread_mutex_unlock(&s->lock);
      return;
    }
    if (!busy && !s->stopping && s->q_len == 0) {
      /* idle: wait for a request, a cancel or a stop (bounded: a stop deadline moves on) */
      struct timespec ts;
      clock_gettime(CLOCK_REALTIME, &ts);
      ts.tv_sec += 1;
      pthread_cond_timedwait(&s->cond, &s->lock, &ts);
    }
    pthread_mutex_unlock(&s->lock);
  }
}
