/*
 * gc_sample.c - picking the next token from a row of logits, and its log-probabilities.
 *
 * gc_sample: greedy (argmax, ties to the lower id) at temperature 0; otherwise
 *   p_i = exp((l_i - max) / T), the candidates in the order (p descending, id ascending),
 *   top_k keeps the first k (0 = all), top_p keeps the shortest prefix of those whose mass
 *   reaches top_p of theirs (the first candidate always), and one uniform draw u of the
 *   kept mass picks the candidate where the running sum passes u. This is the order of
 *   Hugging Face's TopK then TopP warpers; the draw comes from the caller's splitmix64
 *   state, so a request's tokens depend on its seed and its own logits alone, never on the
 *   other requests of a batch.
 *
 * The candidates are taken from a max-heap over the vocabulary (O(V) to build, O(log V) per
 * candidate taken), not from a sort of all V: a 152k vocabulary sorted per token would
 * cost milliseconds, while top_p = 0.9 usually stops after tens of candidates. The heap
 * pops them in exactly the sorted order, so the result is the one a full sort gives.
 *
 * gc_logprobs: log-softmax of the raw logits (temperature 1: the model's own distribution,
 * what an OpenAI client reads as logprobs), for the chosen id and the n_top most likely
 * ids (descending, ties to the lower id).
 */
#include "gpu_client/runner/model.h"

#include <math.h>
#include <string.h>

static uint64_t splitmix64(uint64_t *s) {
  uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

typedef struct cand {
  float p;
  int32_t id;
} cand;

/* a before b in the candidate order: larger p first, then the lower id */
static inline bool cand_before(const cand *a, const cand *b) {
  return a->p != b->p ? a->p > b->p : a->id < b->id;
}

static void heap_down(cand *h, uint32_t n, uint32_t i) {
  for (;;) {
    uint32_t l = 2 * i + 1, r = l + 1, top = i;
    if (l < n && cand_before(&h[l], &h[top])) top = l;
    if (r < n && cand_before(&h[r], &h[top])) top = r;
    if (top == i) return;
    cand t = h[i];
    h[i] = h[top];
    h[top] = t;
    i = top;
  }
}

static void heap_build(cand *h, uint32_t n) {
  for (uint32_t i = n / 2; i-- > 0;) heap_down(h, n, i);
}

/* Moves the heap's first candidate to h[n - 1] and shrinks the heap to n - 1. */
static void heap_pop(cand *h, uint32_t n) {
  cand t = h[0];
  h[0] = h[n - 1];
  h[n - 1] = t;
  heap_down(h, n - 1, 0);
}

static int32_t argmax(const float *logits, uint32_t V) {
  int32_t best = 0;
  for (uint32_t i = 1; i < V; i++)
    if (logits[i] > logits[best]) best = (int32_t)i;
  return best;
}

int32_t gc_sample(const float *logits, uint32_t V, const gc_sampling *smp, uint64_t *state) {
  const int32_t best = argmax(logits, V);
  if (!smp || smp->temperature <= 0) return best;
  cand *c = mr_malloc((size_t)V * sizeof *c);
  if (!c) return best; /* out of memory: degrade to greedy rather than fail the request */
  const float inv_t = 1.0f / smp->temperature, mx = logits[best];
  double sum = 0;
  for (uint32_t i = 0; i < V; i++) {
    c[i].id = (int32_t)i;
    c[i].p = expf((logits[i] - mx) * inv_t);
    sum += c[i].p;
  }
  heap_build(c, V);
  /* Taken candidates collect at the end of c, in order: c[V - 1], c[V - 2], ... */
  const uint32_t k = smp->top_k > 0 && smp->top_k < V ? smp->top_k : V;
  if (k < V) { /* top_k: the kept mass is the mass of the first k */
    sum = 0;
    for (uint32_t i = 0; i < k; i++) {
      heap_pop(c, V - i);
      sum += c[V - 1 - i].p;
    }
  }
  const float top_p = smp->top_p > 0 && smp->top_p < 1 ? smp->top_p : 1.0f;
  uint32_t n = 0;
  double mass = 0;
  while (n < k && (n == 0 || mass < top_p * sum)) {
    if (k == V) heap_pop(c, V - n); /* with top_k the first k are taken already */
    mass += c[V - 1 - n].p;
    n++;
  }
  double u = (double)(splitmix64(state) >> 11) / 9007199254740992.0 * mass;
  int32_t id = c[V - n].id;
  double acc = 0;
  for (uint32_t i = 0; i < n; i++) {
    acc += c[V - 1 - i].p;
    if (u < acc) {
      id = c[V - 1 - i].id;
      break;
    }
  }
  mr_free(c);
  return id;
}

int gc_logprobs(const float *logits, uint32_t V, int32_t chosen, uint32_t n_top, gc_logprob *top,
                float *chosen_lp) {
  const float mx = logits[argmax(logits, V)];
  double s = 0;
  for (uint32_t i = 0; i < V; i++) s += exp((double)logits[i] - mx);
  const double lse = mx + log(s);
  if (chosen_lp) *chosen_lp = (float)((double)logits[chosen] - lse);
  if (n_top == 0) return 0;
  if (n_top > V) n_top = V;
  /* the n_top best by a min-heap of size n_top over (logit, id): the root is the worst kept */
  cand *h = mr_malloc((size_t)n_top * sizeof *h);
  if (!h) return MR_ENOMEM;
  uint32_t n = 0;
  for (uint32_t i = 0; i < V; i++) {
    cand x = {logits[i], (int32_t)i};
    if (n < n_top) {
      h[n++] = x; /* sift up in the reversed order (the root is the worst) */
      for (uint32_t j = n - 1; j > 0;) {
        uint32_t p = (j - 1) / 2;
        if (!cand_before(&h[p], &h[j])) break;
        cand t = h[p];
        h[p] = h[j];
        h[j] = t;
        j = p;
      }
    } else if (cand_before(&x, &h[0])) {
      h[0] = x;
      for (uint32_t j = 0;;) { /* sift down: keep the worst at the root */
        uint32_t l = 2 * j + 1, r = l + 1, w = j;
        if (l < n && cand_before(&h[w], &h[l])) w = l;
        if (r < n && cand_before(&h[w], &h[r])) w = r;
        if (w == j) break;
        cand t = h[w];
        h[w] = h[j];
        h[j] = t;
        j = w;
      }
    }
  }
  /* best first: repeatedly take the worst off the root into the back of top */
  for (uint32_t k = n; k > 0; k--) {
    top[k - 1] = (gc_logprob){h[0].id, (float)((double)h[0].p - lse)};
    h[0] = h[k - 1];
    for (uint32_t j = 0;;) {
      uint32_t l = 2 * j + 1, r = l + 1, w = j;
      if (l < k - 1 && cand_before(&h[w], &h[l])) w = l;
      if (r < k - 1 && cand_before(&h[w], &h[r])) w = r;
      if (w == j) break;
      cand t = h[w];
      h[w] = h[j];
      h[j] = t;
      j = w;
    }
  }
  mr_free(h);
  return 0;
}
