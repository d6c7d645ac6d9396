/*
 * test_gc_sched.c - the sampler (gc_sample.c) and continuous batching (gc_sched.c).
 *
 *   - gc_sample against a full sort of the vocabulary (the algorithm spelled out with qsort)
 *     for temperatures, top_k and top_p together, from the same PRNG state: the same id and
 *     the same state after; greedy ties go to the lower id;
 *   - gc_logprobs against a log-softmax in double, and its top-n against a sort;
 *   - the scheduler on a small random model with the reference kernels (MOERPC_ISA=ref):
 *     six prompts of different lengths, each alone, give the same greedy tokens as all six
 *     together with two KV slots (queueing and slot reuse) and a step budget of 5 tokens
 *     (chunked prefill); stop ids end a request before the id is delivered; on_token
 *     returning true ends it; cancel ends a running and a queued request and frees the
 *     slot for the next; a full queue is refused; bad requests are refused naming the
 *     field; sampled output is the same for the same seed, alone or in company; a drain
 *     stop finishes what was accepted, a hard stop cancels it.
 */
#include "gpu_client/runner/sched.h"
#include "tests/unit/kn_test.h"
#include "tests/unit/mt.h"

#include <stdlib.h>

/* ---- the sampler ------------------------------------------------------------------------- */

typedef struct rc_cand {
  float p;
  int32_t id;
} rc_cand;
static int rc_cmp(const void *a, const void *b) {
  const rc_cand *x = a, *y = b;
  if (x->p != y->p) return x->p > y->p ? -1 : 1;
  return x->id - y->id;
}
static uint64_t rc_splitmix(uint64_t *s) {
  uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
/* The sampler spelled out: sort everything, keep top_k, then top_p of that, draw. */
static int32_t ref_sample(const float *l, uint32_t V, const gc_sampling *g, uint64_t *state) {
  int32_t best = 0;
  for (uint32_t i = 1; i < V; i++)
    if (l[i] > l[best]) best = (int32_t)i;
  if (g->temperature <= 0) return best;
  rc_cand *c = malloc(V * sizeof *c);
  double tot = 0;
  for (uint32_t i = 0; i < V; i++) {
    c[i] = (rc_cand){expf((l[i] - l[best]) / g->temperature), (int32_t)i};
    tot += c[i].p;
  }
  qsort(c, V, sizeof *c, rc_cmp);
  uint32_t k = g->top_k && g->top_k < V ? g->top_k : V;
  double sum = 0;
  if (k < V)
    for (uint32_t i = 0; i < k; i++) sum += c[i].p;
  else
    sum = tot;
  float tp = g->top_p > 0 && g->top_p < 1 ? g->top_p : 1.0f;
  uint32_t n = 0;
  double mass = 0;
  while (n < k && (n == 0 || mass < tp * sum)) mass += c[n++].p;
  double u = (double)(rc_splitmix(state) >> 11) / 9007199254740992.0 * mass, acc = 0;
  int32_t id = c[n - 1].id;
  for (uint32_t i = 0; i < n; i++) {
    acc += c[i].p;
    if (u < acc) {
      id = c[i].id;
      break;
    }
  }
  free(c);
  return id;
}

MT_TEST(sample_matches_the_full_sort) {
  const uint32_t V = 3001;
  float *l = malloc(V * sizeof *l);
  const float temps[] = {0.0f, 0.3f, 1.0f, 2.5f};
  const uint32_t ks[] = {0, 1, 7, 200, 5000};
  const float ps[] = {1.0f, 0.95f, 0.5f, 0.01f};
  int checked = 0, differ_from_greedy = 0;
  for (int trial = 0; trial < 6; trial++) {
    rng_seed(100 + trial);
    for (uint32_t i = 0; i < V; i++) l[i] = 3.0f * rng_normal();
    if (trial == 5) l[17] = l[4] = 50.0f; /* a tie at the top: greedy takes id 4 */
    for (size_t a = 0; a < 4; a++)
      for (size_t b = 0; b < 5; b++)
        for (size_t c = 0; c < 4; c++) {
          gc_sampling g = {.temperature = temps[a], .top_k = ks[b], .top_p = ps[c]};
          for (uint64_t seed = 1; seed <= 3; seed++) {
            uint64_t s1 = seed * 77, s2 = seed * 77;
            int32_t got = gc_sample(l, V, &g, &s1), want = ref_sample(l, V, &g, &s2);
            MT_EQ_INT(got, want);
            MT_EQ_U64(s1, s2);
            checked++;
            differ_from_greedy += got != ref_sample(l, V, &(gc_sampling){0}, &s2);
          }
        }
  }
  MT_EQ_INT(gc_sample(l, V, NULL, NULL), 4);
  MT_TRUE(differ_from_greedy > 100); /* sampling really sampled */
  printf("  %d draws identical to the full sort (%d differ from greedy)\n", checked, differ_from_greedy);
  free(l);
}

MT_TEST(logprobs_match_double) {
  const uint32_t V = 1000;
  float *l = malloc(V * sizeof *l);
  rng_seed(9);
  for (uint32_t i = 0; i < V; i++) l[i] = 4.0f * rng_normal();
  l[10] = l[11] = 20.0f;
  double mx = -1e30, s = 0;
  for (uint32_t i = 0; i < V; i++) mx = l[i] > mx ? l[i] : mx;
  for (uint32_t i = 0; i < V; i++) s += exp((double)l[i] - mx);
  double lse = mx + log(s);
  gc_logprob top[20];
  float lp = 0;
  MT_EQ_INT(gc_logprobs(l, V, 123, 20, top, &lp), 0);
  MT_NEAR(lp, l[123] - lse, 1e-5);
  MT_EQ_INT(top[0].id, 10); /* the tie: the lower id first */
  MT_EQ_INT(top[1].id, 11);
  for (int i = 0; i < 20; i++) {
    MT_NEAR(top[i].logprob, l[top[i].id] - lse, 1e-5);
    if (i) MT_TRUE(top[i].logprob <= top[i - 1].logprob);
  }
  /* nothing outside the top 20 is more likely than the 20th */
  int above = 0;
  for (uint32_t i = 0; i < V; i++) above += l[i] > l[top[19].id];
  MT_EQ_INT(above, 19);
  free(l);
}

/* ---- the scheduler ------------------------------------------------------------------------ */

static char dir[256];
static void rm_dir(void) {
  char cmd[512];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  if (system(cmd) != 0) fprintf(stderr, "cleanup failed\n");
}

static gc_model *model_open(uint32_t slots, uint32_t max_seq) {
  snprintf(dir, sizeof dir, "/tmp/moerpc-sched-%d", (int)getpid());
  const char *bin = getenv("MOERPC_BIN") ? getenv("MOERPC_BIN") : "build/bin";
  char cmd[1024];
  snprintf(cmd, sizeof cmd, "rm -rf '%s' && '%s/moerpc-mkmodel' --out '%s' --layers 2 --experts 8 --topk 2 "
           "--hidden 64 --inter 32 --vocab 300 --heads 2 --kv-heads 1 --head-dim 32 --seed 3 >/dev/null 2>&1",
           dir, bin, dir);
  MT_EQ_INT(system(cmd), 0);
  mt_defer(rm_dir);
  setenv("MOERPC_ISA", "ref", 1);
  gc_model_opts o;
  gc_model_opts_init(&o);
  o.model_dir = dir;
  o.max_batch = slots;
  o.max_seq = max_seq;
  o.quiet = true;
  o.engine.threads = 1;
  gc_model *m = NULL;
  mr_err e;
  MT_OK(gc_model_open(&m, &o, &e), &e);
  return m;
}

typedef struct out {
  int32_t ids[64];
  uint32_t n;
  gc_finish why;
  int done;
  int stop_after;      /* on_token returns true at this many tokens (0 = never) */
  uint64_t cancel_id;  /* cancel this request at the second token (0 = none) */
  gc_sched *s;
  uint32_t prompt_tokens, completion_tokens;
} out;
static bool on_token(void *ud, const gc_sched_token *t) {
  out *o = ud;
  MT_EQ_INT(t->index, o->n);
  o->ids[o->n++] = t->id;
  if (o->cancel_id && o->n == 2) gc_sched_cancel(o->s, o->cancel_id);
  return o->stop_after && (int)o->n >= o->stop_after;
}
static void on_done(void *ud, gc_finish why, const mr_err *err, const gc_sched_usage *u) {
  out *o = ud;
  if (why == GC_FINISH_ERROR) printf("  error: %s\n", err ? err->msg : "?");
  o->why = why;
  o->done++;
  o->prompt_tokens = u->prompt_tokens;
  o->completion_tokens = u->completion_tokens;
}

static gc_sched_req req(const int32_t *p, uint32_t n, uint32_t max_new, out *o) {
  gc_sched_req r;
  memset(&r, 0, sizeof r);
  r.prompt = p;
  r.n_prompt = n;
  r.max_new = max_new;
  r.smp.top_p = 1;
  for (int i = 0; i < (int)GC_SCHED_MAX_STOP_IDS; i++) r.stop_ids[i] = -1;
  r.on_token = on_token;
  r.on_done = on_done;
  r.ud = o;
  return r;
}

static void drain(gc_sched *s) {
  bool busy = true;
  for (int i = 0; i < 10000 && busy; i++) gc_sched_step(s, &busy);
}

static const int32_t P[6][12] = {{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}, {200, 17}, {5, 5, 5, 5, 5, 5, 5},
                                  {299}, {40, 41, 42, 43, 44, 45, 46, 47, 48}, {7, 100, 250, 3}};
static const uint32_t PL[6] = {12, 2, 7, 1, 9, 4};

MT_TEST(batched_equals_alone_with_chunked_prefill_and_slot_reuse) {
  gc_model *m = model_open(2, 64);
  gc_sched_opts so = {.step_tokens = 5};
  out alone[6], together[6];
  memset(alone, 0, sizeof alone);
  memset(together, 0, sizeof together);
  for (int i = 0; i < 6; i++) { /* each alone */
    gc_sched *s = NULL;
    mr_err e;
    MT_OK(gc_sched_new(&s, m, NULL, &e), &e);
    gc_sched_req r = req(P[i], PL[i], 10, &alone[i]);
    MT_OK(gc_sched_submit(s, &r, NULL, &e), &e);
    drain(s);
    MT_EQ_INT(alone[i].done, 1);
    MT_EQ_INT(alone[i].why, GC_FINISH_LENGTH);
    MT_EQ_INT(alone[i].n, 10);
    gc_sched_free(s);
  }
  gc_sched *s = NULL;
  mr_err e;
  MT_OK(gc_sched_new(&s, m, &so, &e), &e);
  for (int i = 0; i < 6; i++) {
    gc_sched_req r = req(P[i], PL[i], 10, &together[i]);
    MT_OK(gc_sched_submit(s, &r, NULL, &e), &e);
  }
  gc_sched_stats st;
  gc_sched_stats_get(s, &st);
  MT_EQ_INT(st.queued, 6);
  drain(s);
  for (int i = 0; i < 6; i++) {
    MT_EQ_INT(together[i].done, 1);
    MT_EQ_INT(together[i].n, 10);
    MT_EQ_INT(together[i].prompt_tokens, PL[i]);
    MT_EQ_INT(together[i].completion_tokens, 10);
    MT_TRUE(memcmp(together[i].ids, alone[i].ids, sizeof alone[i].ids) == 0);
  }
  gc_sched_stats_get(s, &st);
  MT_EQ_INT(st.running, 0);
  MT_EQ_INT(st.queued, 0);
  MT_EQ_U64(st.finished[GC_FINISH_LENGTH], 6);
  /* 6 x 10 decode-ish tokens over 2 slots and 5-token prefill chunks: well over 30 steps */
  MT_TRUE(st.steps >= 30);
  printf("  6 requests, 2 slots, step budget 5: identical to each alone, %llu steps\n",
         (unsigned long long)st.steps);
  gc_sched_free(s);
  gc_model_close(m);
}

MT_TEST(stop_ids_stop_strings_cancel_and_refusals) {
  gc_model *m = model_open(1, 32);
  gc_sched *s = NULL;
  mr_err e;
  gc_sched_opts so = {.max_queue = 2};
  MT_OK(gc_sched_new(&s, m, &so, &e), &e);
  out ref;
  memset(&ref, 0, sizeof ref);
  gc_sched_req r = req(P[0], PL[0], 8, &ref);
  MT_OK(gc_sched_submit(s, &r, NULL, &e), &e);
  drain(s);
  MT_EQ_INT(ref.n, 8);
  /* a stop id: the 4th greedy token ends the request before it is delivered */
  out o1;
  memset(&o1, 0, sizeof o1);
  r = req(P[0], PL[0], 8, &o1);
  r.stop_ids[3] = ref.ids[3];
  int first = 0;
  while (ref.ids[first] != ref.ids[3]) first++;
  MT_OK(gc_sched_submit(s, &r, NULL, &e), &e);
  drain(s);
  MT_EQ_INT(o1.why, GC_FINISH_STOP);
  MT_EQ_INT(o1.n, first);
  MT_EQ_INT(o1.completion_tokens, first + 1); /* the stop id counts as produced */
  /* on_token true: a stop string the caller matched */
  out o2;
  memset(&o2, 0, sizeof o2);
  o2.stop_after = 2;
  r = req(P[0], PL[0], 8, &o2);
  MT_OK(gc_sched_submit(s, &r, NULL, &e), &e);
  drain(s);
  MT_EQ_INT(o2.why, GC_FINISH_STOP);
  MT_EQ_INT(o2.n, 2);
  /* cancel a running request from its own callback, and one that is still queued: the one
   * slot is freed for the third */
  out a, b, c;
  memset(&a, 0, sizeof a);
  memset(&b, 0, sizeof b);
  memset(&c, 0, sizeof c);
  uint64_t ida, idb, idc;
  r = req(P[0], PL[0], 8, &a);
  MT_OK(gc_sched_submit(s, &r, &ida, &e), &e);
  r = req(P[1], PL[1], 8, &b);
  MT_OK(gc_sched_submit(s, &r, &idb, &e), &e);
  r = req(P[2], PL[2], 8, &c);
  MT_EQ_INT(gc_sched_submit(s, &r, &idc, &e), MR_EEXHAUSTED); /* --max-queue 2 */
  MT_CONTAINS(e.msg, "--max-queue 2");
  a.cancel_id = ida;
  a.s = s;
  gc_sched_cancel(s, idb);
  MT_OK(gc_sched_submit(s, &r, &idc, &e), &e); /* b's cancel freed its place in the queue */
  drain(s);
  MT_EQ_INT(a.why, GC_FINISH_CANCELLED);
  MT_EQ_INT(a.n, 2);
  MT_EQ_INT(b.why, GC_FINISH_CANCELLED);
  MT_EQ_INT(b.n, 0);
  MT_EQ_INT(c.why, GC_FINISH_LENGTH);
  MT_EQ_INT(c.n, 8);
  /* refusals name the field and the limit */
  int32_t bad = 300;
  r = req(&bad, 1, 4, &c);
  MT_EQ_INT(gc_sched_submit(s, &r, NULL, &e), MR_ERANGE);
  MT_CONTAINS(e.msg, "prompt[0] = 300, must be in 0..299");
  r = req(P[0], PL[0], 30, &c);
  MT_EQ_INT(gc_sched_submit(s, &r, NULL, &e), MR_ERANGE);
  MT_CONTAINS(e.msg, "more than the context of 32 tokens (--max-seq)");
  r = req(P[0], 0, 4, &c);
  MT_EQ_INT(gc_sched_submit(s, &r, NULL, &e), MR_EINVAL);
  r = req(P[0], PL[0], 4, &c);
  r.top_logprobs = 21;
  MT_EQ_INT(gc_sched_submit(s, &r, NULL, &e), MR_ERANGE);
  MT_CONTAINS(e.msg, "top_logprobs = 21");
  gc_sched_free(s);
  gc_model_close(m);
}

MT_TEST(seeded_sampling_is_the_same_alone_or_in_company) {
  gc_model *m = model_open(3, 64);
  out solo, mix[3];
  memset(&solo, 0, sizeof solo);
  memset(mix, 0, sizeof mix);
  mr_err e;
  gc_sched *s = NULL;
  MT_OK(gc_sched_new(&s, m, NULL, &e), &e);
  gc_sched_req r = req(P[4], PL[4], 12, &solo);
  r.smp = (gc_sampling){.temperature = 1.3f, .top_p = 0.9f, .top_k = 50, .seed = 42};
  r.want_logprobs = true;
  r.top_logprobs = 3;
  MT_OK(gc_sched_submit(s, &r, NULL, &e), &e);
  drain(s);
  for (int i = 0; i < 3; i++) {
    gc_sched_req q = req(P[4 - i], PL[4 - i], 12, &mix[i]);
    q.smp = (gc_sampling){.temperature = 1.3f, .top_p = 0.9f, .top_k = 50, .seed = 42 + (uint64_t)i};
    MT_OK(gc_sched_submit(s, &q, NULL, &e), &e);
  }
  drain(s);
  MT_TRUE(memcmp(solo.ids, mix[0].ids, sizeof solo.ids) == 0);
  MT_TRUE(memcmp(mix[0].ids, mix[1].ids, sizeof solo.ids) != 0);
  gc_sched_free(s);
  gc_model_close(m);
}

MT_TEST(drain_finishes_and_hard_stop_cancels) {
  gc_model *m = model_open(1, 64);
  mr_err e;
  for (int hard = 0; hard < 2; hard++) {
    gc_sched *s = NULL;
    MT_OK(gc_sched_new(&s, m, NULL, &e), &e);
    out a, b;
    memset(&a, 0, sizeof a);
    memset(&b, 0, sizeof b);
    gc_sched_req r = req(P[0], PL[0], 6, &a);
    MT_OK(gc_sched_submit(s, &r, NULL, &e), &e);
    r = req(P[1], PL[1], 6, &b);
    MT_OK(gc_sched_submit(s, &r, NULL, &e), &e);
    bool busy;
    gc_sched_step(s, &busy); /* a is running */
    gc_sched_stop(s, hard ? 0 : 60000);
    MT_EQ_INT(gc_sched_submit(s, &r, NULL, &e), MR_EUNAVAIL);
    gc_sched_run(s);
    MT_EQ_INT(a.why, hard ? GC_FINISH_CANCELLED : GC_FINISH_LENGTH);
    MT_EQ_INT(b.why, hard ? GC_FINISH_CANCELLED : GC_FINISH_LENGTH);
    MT_EQ_INT(a.done + b.done, 2);
    gc_sched_free(s);
  }
  gc_model_close(m);
}

MT_MAIN()
