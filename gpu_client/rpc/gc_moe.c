/*
 * gc_moe.c - overlap and deferral across the MoE layers of one forward pass
 * (moerpc_client.h, "overlap and deferral"), on top of gc_layer_submit / gc_layer_wait_timed.
 *
 * The calls in flight while layer l runs, with max_deferred = K > 0:
 *
 *   submit(l)   -> now[l]        (slots kept for layer l)   waited by wait(l)
 *               -> deferred[l]   (cold slots ranked low)    waited by wait(l+1)
 *   wait(l)     out += now[l] + deferred[l-1]
 *
 * so at most three calls are live: deferred[l-1] (in flight since submit(l-1)), now[l] and
 * deferred[l]. The split of a token's slots (kt-kernel's select_deferred_experts): rank its
 * non-empty slots by weight, ties keeping the earlier slot; the first (k - K) ranks are
 * "protected" and run now; a lower-ranked slot is deferred when a server computes it, and
 * runs now when the library computes it locally (hot experts are never deferred). Slots of
 * caller-computed pairs go in neither (submit skips them anyway).
 */
#include <string.h>

#include "gpu_client/rpc/internal.h"

struct gc_moe {
  gc_cluster *c;
  uint32_t max_deferred;
  gc_pending *now;           /* this layer's immediate call, submitted and not waited */
  gc_pending *deferred_cur;  /* this layer's deferred call (moves to prev at wait) */
  gc_pending *deferred_prev; /* the previous layer's deferred call, waited at this wait */
  uint32_t prev_tokens;      /* T of deferred_prev */
  uint32_t cur_tokens;       /* T of the current layer */
  uint32_t cur_deferred;     /* slots deferred by the current layer's submit */
  /* split buffers, grown on demand: [T * k] each */
  int32_t *ids_now, *ids_def;
  size_t cap;
};

int gc_moe_new(gc_moe **out, gc_cluster *c, uint32_t max_deferred, mr_err *e) {
  MR_ASSERT(out && c);
  gc_moe *m = mr_calloc(1, sizeof *m);
  if (!m) return mr_err_set(e, MR_ENOMEM, "MoE driver: out of memory");
  m->c = c;
  m->max_deferred = max_deferred;
  *out = m;
  return 0;
}

void gc_moe_abort(gc_moe *m) {
  if (!m) return;
  gc_layer_cancel(m->c, m->now);
  gc_layer_cancel(m->c, m->deferred_cur);
  gc_layer_cancel(m->c, m->deferred_prev);
  m->now = m->deferred_cur = m->deferred_prev = NULL;
}

void gc_moe_free(gc_moe *m) {
  if (!m) return;
  gc_moe_abort(m);
  mr_free(m->ids_now);
  mr_free(m->ids_def);
  mr_free(m);
}

uint32_t gc_moe_max_deferred(const gc_moe *m) { return m->max_deferred; }
bool gc_moe_has_deferred(const gc_moe *m) { return m->deferred_prev || m->deferred_cur; }

static int split_buffers(gc_moe *m, size_t n, mr_err *e) {
  if (n <= m->cap) return 0;
  int32_t *a = mr_realloc(m->ids_now, n * sizeof *a);
  if (a) m->ids_now = a;
  int32_t *b = a ? mr_realloc(m->ids_def, n * sizeof *b) : NULL;
  if (b) m->ids_def = b;
  if (!a || !b) return mr_err_set(e, MR_ENOMEM, "MoE driver: split of %zu slots: out of memory", n);
  m->cap = n;
  return 0;
}

uint32_t gc__defer_split(const int32_t *owner_row, uint32_t E, uint32_t T, uint32_t k,
                         uint32_t K, const int32_t *ids, const float *weights, int32_t *now,
                         int32_t *def) {
  const uint32_t keep = k > K ? k - K : 0;
  uint32_t n_def = 0;
  for (uint32_t t = 0; t < T; t++) {
    const int32_t *id = ids + (size_t)t * k;
    const float *w = weights + (size_t)t * k;
    int32_t *nw = now + (size_t)t * k, *df = def + (size_t)t * k;
    for (uint32_t j = 0; j < k; j++) {
      nw[j] = id[j];
      df[j] = -1;
      if (id[j] < 0 || (uint32_t)id[j] >= E || owner_row[id[j]] < 0) continue;
      /* rank of slot j: non-empty slots with a larger weight, or an equal one earlier */
      uint32_t rank = 0;
      for (uint32_t i = 0; i < k; i++) {
        if (i == j || id[i] < 0) continue;
        if (w[i] > w[j] || (w[i] == w[j] && i < j)) rank++;
      }
      if (rank >= keep) {
        df[j] = id[j];
        nw[j] = -1;
        n_def++;
      }
    }
  }
  return n_def;
}

int gc_moe_submit(gc_moe *m, const gc_layer_req *q, bool last, mr_err *e) {
  MR_ASSERT(m && q);
  MR_ASSERT(!m->now && !m->deferred_cur); /* the previous submit was waited */
  if (m->deferred_prev && q->n_tokens != m->prev_tokens)
    return mr_err_set(e, MR_EINVAL, "layer %u: n_tokens = %u, but the previous MoE layer's "
                      "deferred experts are for %u tokens (one pass keeps its tokens)", q->layer,
                      q->n_tokens, m->prev_tokens);
  m->cur_tokens = q->n_tokens;
  m->cur_deferred = 0;
  if (last || m->max_deferred == 0 || q->layer >= m->c->L || q->top_k == 0 || !q->ids ||
      !q->weights)
    return gc_layer_submit(m->c, q, &m->now, e); /* nothing to split; submit validates */

  size_t n = (size_t)q->n_tokens * q->top_k;
  int rc = split_buffers(m, n, e);
  if (rc) return rc;
  const gc_cluster *c = m->c;
  uint32_t n_def = gc__defer_split(c->owner + (size_t)q->layer * c->E, c->E, q->n_tokens,
                                   q->top_k, m->max_deferred, q->ids, q->weights, m->ids_now,
                                   m->ids_def);
  gc_layer_req now = *q, def = *q;
  now.ids = m->ids_now;
  def.ids = m->ids_def;
  if (n_def) now.flags |= GC_REQ_FOLLOWED; /* def follows at once, to the same servers */
  rc = gc_layer_submit(m->c, &now, &m->now, e);
  if (rc) return rc;
  if (n_def == 0) return 0;
  def.flags |= GC_REQ_PART; /* counted, but not a second step */
  def.caller_ids = NULL;     /* counted with the immediate part */
  rc = gc_layer_submit(m->c, &def, &m->deferred_cur, e);
  if (rc) {
    gc_layer_cancel(m->c, m->now);
    m->now = NULL;
    return mr_err_prefix(e, rc, "layer %u: deferred experts", q->layer);
  }
  m->cur_deferred = n_def;
  return 0;
}

int gc_moe_wait(gc_moe *m, float *out, gc_moe_timing *t, mr_err *e) {
  MR_ASSERT(m && m->now);
  gc_moe_timing tm;
  memset(&tm, 0, sizeof tm);
  tm.deferred_slots = m->cur_deferred;
  gc_pending *now = m->now, *prev = m->deferred_prev;
  m->now = m->deferred_prev = NULL;
  int rc = gc_layer_wait_timed(m->c, now, out, GC_WAIT_ACCUMULATE, &tm.now, e);
  if (rc) {
    gc_layer_cancel(m->c, prev);
    gc_moe_abort(m);
    return rc;
  }
  if (prev) {
    rc = gc_layer_wait_timed(m->c, prev, out, GC_WAIT_ACCUMULATE, &tm.deferred, e);
    if (rc) {
      gc_moe_abort(m);
      return mr_err_prefix(e, rc, "deferred experts of the previous MoE layer");
    }
  }
  m->deferred_prev = m->deferred_cur;
  m->deferred_cur = NULL;
  m->prev_tokens = m->cur_tokens;
  if (t) *t = tm;
  return 0;
}
