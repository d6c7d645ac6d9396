/*
 * gc_routing.c - the client's routing counters (moerpc_client.h "routing statistics"): every
 * routing decision, one per token per selected expert (a slot), local and caller-computed
 * experts included, since start and over a sliding window of steps.
 *
 * The window is a ring of nb + 1 buckets, nb = min(GC_ROUTING_BUCKETS, window), of `per` =
 * ceil(window / nb) steps each: the current one fills, the nb before it are full. A step ends at the call
 * for the last MoE layer (its counts go into the current bucket before it may rotate), so a
 * bucket holds whole steps. The window (every bucket) covers between window and window + per
 * steps; its exact count is reported. Rotation zeroes the oldest bucket and makes it
 * current.
 *
 * Cost per call: a read lock, then one relaxed atomic add per slot into the current bucket;
 * a call with many slots per expert (a prefill) first counts into a histogram on the stack
 * and adds each expert's count once. No allocation. The since-start total is `folded` (the
 * buckets rotation dropped, added in before zeroing) plus every live bucket. Rotation
 * (every `per` steps) and snapshots take the write lock, so that no add lands in a bucket
 * while it is being zeroed.
 */
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "gpu_client/rpc/moerpc_client.h"

#define NB (GC_ROUTING_BUCKETS + 1u)
/* Experts up to which a call with many slots counts into a stack histogram first (16 KiB of
 * uint32: used only below 2^32 slots; gc_layer_submit's calls have at most 2^30). */
#define HIST_MAX 4096u

struct gc_routing {
  uint32_t L, E, window, per, last_layer;
  uint32_t nb;            /* buckets in the ring: min(BUCKETS, window) + 1 */
  pthread_rwlock_t lock;
  uint32_t cur;           /* current bucket; changes under the write lock only */
  uint64_t *folded;       /* [L * E] counts of buckets rotated out since start or reset */
  uint64_t *bucket;       /* [NB][L * E] (atomic adds) */
  uint64_t b_steps[NB], b_tokens[NB]; /* per bucket (atomic adds) */
  uint64_t b_start_ns[NB];            /* when each bucket became current (0: never) */
  uint64_t steps, tokens; /* since start or reset (atomic adds) */
  uint64_t start_ns;      /* start or reset */
};

int gc_routing_new(gc_routing **out, uint32_t num_layers, uint32_t num_experts,
                   uint32_t window_steps, uint32_t last_layer, mr_err *e) {
  *out = NULL;
  if (window_steps == 0) window_steps = GC_ROUTING_DEFAULT_WINDOW;
  if (num_layers == 0 || num_layers > MR_MAX_LAYERS || num_experts == 0 ||
      num_experts > 65536u || (uint64_t)num_layers * num_experts > GC_ROUTING_MAX_PAIRS)
    return mr_err_set(e, MR_ERANGE, "routing counters: %u layers x %u experts, must be 1..%u x "
                      "1..65536 and at most %u pairs", num_layers, num_experts, MR_MAX_LAYERS,
                      GC_ROUTING_MAX_PAIRS);
  if (window_steps > GC_ROUTING_MAX_WINDOW)
    return mr_err_set(e, MR_ERANGE, "routing window = %u steps, must be 1..%u", window_steps,
                      GC_ROUTING_MAX_WINDOW);
  if (last_layer >= num_layers)
    return mr_err_set(e, MR_ERANGE, "routing counters: last MoE layer %u, must be < %u",
                      last_layer, num_layers);
  gc_routing *r = mr_calloc(1, sizeof *r);
  size_t pairs = (size_t)num_layers * num_experts;
  if (r) {
    r->folded = mr_calloc(pairs, sizeof *r->folded);
    r->bucket = mr_calloc(pairs * NB, sizeof *r->bucket);
  }
  if (!r || !r->folded || !r->bucket) {
    if (r) {
      mr_free(r->folded);
      mr_free(r->bucket);
    }
    mr_free(r);
    return mr_err_set(e, MR_ENOMEM, "routing counters of %u x %u: out of memory", num_layers,
                      num_experts);
  }
  r->L = num_layers;
  r->E = num_experts;
  r->window = window_steps;
  const uint32_t full = window_steps < GC_ROUTING_BUCKETS ? window_steps : GC_ROUTING_BUCKETS;
  r->nb = full + 1;
  r->per = (window_steps + full - 1) / full;
  r->last_layer = last_layer;
  pthread_rwlock_init(&r->lock, NULL);
  r->start_ns = r->b_start_ns[0] = mr_now_ns();
  *out = r;
  return 0;
}

void gc_routing_free(gc_routing *r) {
  if (!r) return;
  pthread_rwlock_destroy(&r->lock);
  mr_free(r->folded);
  mr_free(r->bucket);
  mr_free(r);
}

/* Makes the oldest bucket current, zeroed after folding it into the total (write lock
 * held). */
static void rotate(gc_routing *r) {
  size_t pairs = (size_t)r->L * r->E;
  r->cur = (r->cur + 1) % r->nb;
  uint64_t *b = r->bucket + (size_t)r->cur * pairs;
  for (size_t i = 0; i < pairs; i++) r->folded[i] += b[i];
  memset(b, 0, pairs * sizeof *r->bucket);
  r->b_steps[r->cur] = r->b_tokens[r->cur] = 0;
  r->b_start_ns[r->cur] = mr_now_ns();
}

void gc_routing_count(gc_routing *r, uint32_t layer, const int32_t *ids, size_t n_slots,
                      uint32_t n_tokens, bool may_step) {
  if (!r || layer >= r->L) return;
  const size_t pairs = (size_t)r->L * r->E;
  const bool step = may_step && layer == r->last_layer;
  bool full = false;
  pthread_rwlock_rdlock(&r->lock);
  const uint32_t cur = r->cur;
  uint64_t *bk = r->bucket + (size_t)cur * pairs + (size_t)layer * r->E;
  if (n_slots >= 2u * r->E && r->E <= HIST_MAX && n_slots < UINT32_MAX) {
    /* Many slots per expert: count on the stack, then one add per expert used. */
    uint32_t h[HIST_MAX];
    memset(h, 0, r->E * sizeof *h);
    for (size_t i = 0; i < n_slots; i++) {
      int32_t x = ids[i];
      if (x >= 0 && (uint32_t)x < r->E) h[x]++;
    }
    for (uint32_t x = 0; x < r->E; x++)
      if (h[x]) __atomic_fetch_add(&bk[x], h[x], __ATOMIC_RELAXED);
  } else {
    for (size_t i = 0; i < n_slots; i++) {
      int32_t x = ids[i];
      if (x >= 0 && (uint32_t)x < r->E) __atomic_fetch_add(&bk[x], 1, __ATOMIC_RELAXED);
    }
  }
  if (step) {
    __atomic_fetch_add(&r->steps, 1, __ATOMIC_RELAXED);
    __atomic_fetch_add(&r->tokens, n_tokens, __ATOMIC_RELAXED);
    __atomic_fetch_add(&r->b_tokens[cur], n_tokens, __ATOMIC_RELAXED);
    full = __atomic_add_fetch(&r->b_steps[cur], 1, __ATOMIC_RELAXED) >= r->per;
  }
  pthread_rwlock_unlock(&r->lock);
  if (full) {
    pthread_rwlock_wrlock(&r->lock);
    if (r->b_steps[r->cur] >= r->per) rotate(r); /* once, whoever comes first */
    pthread_rwlock_unlock(&r->lock);
  }
}

void gc_routing_reset(gc_routing *r) {
  if (!r) return;
  pthread_rwlock_wrlock(&r->lock);
  size_t pairs = (size_t)r->L * r->E;
  memset(r->folded, 0, pairs * sizeof *r->folded);
  memset(r->bucket, 0, pairs * NB * sizeof *r->bucket);
  memset(r->b_steps, 0, sizeof r->b_steps);
  memset(r->b_tokens, 0, sizeof r->b_tokens);
  memset(r->b_start_ns, 0, sizeof r->b_start_ns);
  r->steps = r->tokens = 0;
  r->cur = 0;
  r->start_ns = r->b_start_ns[0] = mr_now_ns();
  pthread_rwlock_unlock(&r->lock);
}

uint32_t gc_routing_window(const gc_routing *r) { return r ? r->window : 0; }

int gc_routing_get(gc_routing *r, gc_routing_span span, gc_routing_counts *out, mr_err *e) {
  memset(out, 0, sizeof *out);
  if (!r) return mr_err_set(e, MR_EINVAL, "routing counters: none (no MoE layer is routed here)");
  size_t pairs = (size_t)r->L * r->E;
  out->counts = mr_malloc(pairs * sizeof *out->counts);
  if (!out->counts)
    return mr_err_set(e, MR_ENOMEM, "routing counters of %u x %u: out of memory", r->L, r->E);
  out->num_layers = r->L;
  out->num_experts = r->E;
  out->window_steps = r->window;
  out->span = span;
  pthread_rwlock_wrlock(&r->lock);
  uint64_t now = mr_now_ns();
  /* The window: every live bucket; the total: those plus what rotation folded. */
  if (span == GC_ROUTING_TOTAL) memcpy(out->counts, r->folded, pairs * sizeof *out->counts);
  else memset(out->counts, 0, pairs * sizeof *out->counts);
  uint64_t oldest = now;
  for (uint32_t b = 0; b < r->nb; b++) {
    if (!r->b_start_ns[b]) continue; /* never used since start or reset */
    const uint64_t *bk = r->bucket + (size_t)b * pairs;
    for (size_t i = 0; i < pairs; i++) out->counts[i] += bk[i];
    out->steps += r->b_steps[b];
    out->tokens += r->b_tokens[b];
    if (r->b_start_ns[b] < oldest) oldest = r->b_start_ns[b];
  }
  out->seconds = (double)(now - oldest) / 1e9;
  if (span == GC_ROUTING_TOTAL) {
    out->steps = r->steps;
    out->tokens = r->tokens;
    out->seconds = (double)(now - r->start_ns) / 1e9;
  }
  pthread_rwlock_unlock(&r->lock);
  return 0;
}

void gc_routing_counts_close(gc_routing_counts *c) {
  if (!c) return;
  mr_free(c->counts);
  memset(c, 0, sizeof *c);
}

int gc_routing_json(gc_routing *r, gc_routing_span span, const char *fingerprint,
                    mr_buf *out, mr_err *e) {
  gc_routing_counts rc;
  int err = gc_routing_get(r, span, &rc, e);
  if (err) return err;
  /* The layout of placement/pl_stats.c's writer, so that both read the same. */
  mr_buf_printf(out, "{\"format\": \"moerpc-stats\", \"version\": 1,\n \"model_fingerprint\": ");
  mr_buf_json_str(out, fingerprint ? fingerprint : "");
  mr_buf_printf(out, ", \"num_layers\": %u, \"num_experts\": %u,\n \"window\": {\"kind\": \"%s\", "
                 "\"steps\": %llu, \"tokens\": %llu, \"seconds\": %.17g},\n \"sources\": "
                 "[\"client\"],\n \"counts\": [", rc.num_layers, rc.num_experts,
                 span == GC_ROUTING_TOTAL ? "since_reset" : "steps",
                 (unsigned long long)rc.steps, (unsigned long long)rc.tokens, rc.seconds);
  for (uint32_t l = 0; l < rc.num_layers; l++) {
    mr_buf_append(out, l ? ",\n  [" : "\n  [", l ? 5 : 4);
    const uint64_t *row = rc.counts + (size_t)l * rc.num_experts;
    for (uint32_t x = 0; x < rc.num_experts; x++)
      mr_buf_printf(out, x ? ",%llu" : "%llu", (unsigned long long)row[x]);
    mr_buf_append(out, "]", 1);
  }
  mr_buf_append(out, "]}\n", 3);
  gc_routing_counts_close(&rc);
  if (out->oom)
    return mr_err_set(e, MR_ENOMEM, "routing counters as JSON: out of memory");
  return 0;
}

int gc_routing_save(gc_routing *r, gc_routing_span span, const char *fingerprint,
                    const char *path, mr_err *e) {
  mr_buf p;
  mr_buf_init(&p);
  int rc = gc_routing_json(r, span, fingerprint, &p, e);
  if (rc) {
    mr_buf_close(&p);
    return rc;
  }
  rc = mr_file_write_atomic(path, p.buf, p.len, e);
  mr_buf_close(&p);
  return rc;
}
