/*
 * es_table.c - the owned table (docs/DESIGN.md 15.1): what a request needs to be validated
 * and computed, as one immutable object swapped whole.
 *
 * The table (es_table, internal.h) holds the kn_layer of each layer, the owned sets, the
 * es_limits over them and the packed HelloReply. It never changes once published. A change
 * (es_control.c) builds a new table with es__tab_derive and swaps it in with
 * es__tab_publish, under tab_lock:
 *
 *   - a layer that does not change is passed on as it is (old->passed[l]: the old table
 *     will not free it);
 *   - a layer that changes is rebuilt with kn_layer_rebuild: the experts kept are shared
 *     (the new layer owns them, the old one only reads them), the experts loaded move in
 *     from a staging layer, the experts dropped stay owned by the old layer only.
 *
 * A ForwardRequest takes a reference to the current table when it is validated (es_stream.c)
 * and keeps it until its job is done, and the compute uses that table's layer, so a request
 * validated before a switch computes on the weights it was validated against, and a request
 * validated after it sees the new set (an unloaded expert gets FAILED_PRECONDITION "expert
 * not served here", like any expert the server does not own). Retired tables are freed by
 * the admin thread (es__tab_reap, every housekeeping tick) once no reference is left, and
 * with them the weights of dropped experts.
 *
 * Locks: publishers hold ctl_lock (one change at a time; it also guards tab_gen and the
 * retired list) and take tab_lock inside it for the pointer swap. Readers (es__tab_get: CQ
 * threads, any thread) take tab_lock alone, for a pointer read and an increment.
 */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "expert_server/internal.h"

/* ---- the memory rule ------------------------------------------------------------------------ */

/* MemAvailable now, UINT64_MAX when it cannot be read (no limit). Read before ctl_lock is
 * taken: the lock is never held across a file read. */
uint64_t es__mem_now(void) {
  uint64_t avail;
  return es__mem_available(&avail) ? avail : UINT64_MAX;
}

/* Bytes a load may still add, with weight_bytes packed and avail (es__mem_now) available
 * (ctl_lock held: a running load's packed bytes count as used). */
uint64_t es__load_free(es_server *s, uint64_t weight_bytes, uint64_t avail) {
  uint64_t free_b = avail == UINT64_MAX ? UINT64_MAX
                    : avail > ES_LOAD_MEM_MARGIN ? avail - ES_LOAD_MEM_MARGIN : 0;
  uint64_t running = s->ld_state == MOERPC__V1__LOAD_STATE__LOAD_STATE_RUNNING ? s->ld_packed : 0;
  free_b = free_b > running ? free_b - running : 0;
  if (s->opts.max_expert_memory) {
    uint64_t used = weight_bytes + running;
    uint64_t lim = s->opts.max_expert_memory > used ? s->opts.max_expert_memory - used : 0;
    if (lim < free_b) free_b = lim;
  }
  return free_b == UINT64_MAX ? (uint64_t)INT64_MAX : free_b;
}

/* ---- tables ---------------------------------------------------------------------------------- */

es_table *es__tab_get(es_server *s) {
  pthread_mutex_lock(&s->tab_lock);
  es_table *t = s->tab;
  if (t) atomic_fetch_add_explicit(&t->refs, 1, memory_order_relaxed);
  pthread_mutex_unlock(&s->tab_lock);
  if (t) atomic_thread_fence(memory_order_acquire);
  return t;
}

static void es__tab_free(es_server *s, es_table *t) {
  if (!t) return;
  for (uint32_t l = 0; l < s->cfg.num_layers; l++) {
    if (t->layers && !t->passed[l]) kn_layer_free(t->layers[l]);
    if (t->sets && t->sets[l].bits) mr_idset_close(&t->sets[l]);
  }
  mr_free(t->layers);
  mr_free(t->passed);
  mr_free(t->sets);
  mr_free(t->owned);
  grpc_slice_unref(t->hello);
  mr_free(t);
}

static es_table *es__tab_alloc(es_server *s) {
  const uint32_t L = s->cfg.num_layers;
  es_table *t = mr_calloc(1, sizeof *t);
  if (!t) return NULL;
  t->hello = grpc_empty_slice();
  t->layers = mr_calloc(L, sizeof *t->layers);
  t->passed = mr_calloc(L, 1);
  t->sets = mr_calloc(L, sizeof *t->sets);
  t->owned = mr_calloc(L, sizeof *t->owned);
  if (!t->layers || !t->passed || !t->sets || !t->owned) {
    es__tab_free(s, t);
    return NULL;
  }
  return t;
}

/* Fills sets, owned, lim, counts and the packed Hello from t->layers; avail is
 * es__mem_now(), for Hello's load_free_bytes. ctl_lock held. */
static int es__tab_finish(es_server *s, es_table *t, uint64_t avail, mr_err *e) {
  const uint32_t L = s->cfg.num_layers, E = s->cfg.num_experts;
  uint32_t n_items = 0;
  for (uint32_t l = 0; l < L; l++) {
    if (!t->layers[l]) continue;
    if (mr_idset_init(&t->sets[l], E)) return mr_err_set(e, MR_ENOMEM, "owned table: out of memory");
    for (uint32_t x = 0; x < E; x++)
      if (kn_layer_has_expert(t->layers[l], x)) mr_idset_add(&t->sets[l], x);
    uint32_t c = mr_idset_count(&t->sets[l]);
    if (!c) continue; /* an empty layer serves nothing: no owned entry */
    t->owned[l] = &t->sets[l];
    t->pairs += c;
    t->weight_bytes += kn_layer_bytes(t->layers[l]);
    n_items++;
  }
  t->lim = s->limits;
  t->lim.owned = t->owned;

  Moerpc__V1__LayerExperts *items = mr_calloc(n_items ? n_items : 1, sizeof *items);
  Moerpc__V1__LayerExperts **ptrs = mr_calloc(n_items ? n_items : 1, sizeof *ptrs);
  uint32_t *ids = mr_calloc(t->pairs ? t->pairs : 1, sizeof *ids);
  int rc = 0;
  if (!items || !ptrs || !ids) {
    rc = mr_err_set(e, MR_ENOMEM, "out of memory packing HelloReply");
    goto out_free;
  }
  /* Hello announces the owned pairs except the leaving ones (served in their grace, but a
   * client that Hellos now must route them elsewhere); a layer left with none is omitted. */
  uint32_t k = 0;
  size_t off = 0;
  for (uint32_t l = 0; l < L; l++) {
    if (!t->owned[l]) continue;
    Moerpc__V1__LayerExperts init = MOERPC__V1__LAYER_EXPERTS__INIT;
    items[k] = init;
    items[k].layer = l;
    items[k].experts = ids + off;
    for (uint32_t x = 0; x < E; x++)
      if (mr_idset_has(&t->sets[l], x) && !(s->leaving && s->leaving[(size_t)l * E + x]))
        ids[off + items[k].n_experts++] = x;
    if (!items[k].n_experts) continue;
    off += items[k].n_experts;
    ptrs[k] = &items[k];
    k++;
  }
  Moerpc__V1__HelloReply r = MOERPC__V1__HELLO_REPLY__INIT;
  r.protocol_major = PR_PROTOCOL_MAJOR;
  r.protocol_minor = PR_PROTOCOL_MINOR;
  r.model_fingerprint = s->fingerprint;
  r.instance_id = s->instance_id;
  r.hidden_size = s->cfg.hidden_size;
  r.intermediate_size = s->cfg.moe_intermediate;
  r.num_layers = s->cfg.num_layers;
  r.num_experts = s->cfg.num_experts;
  r.n_owned = k;
  r.owned = ptrs;
  r.weight_format = s->weight_format;
  r.max_tokens = s->opts.max_tokens;
  r.max_top_k = s->limits.max_top_k;
  r.owned_generation = t->gen;
  r.weight_bytes = t->weight_bytes;
  r.expert_bytes = s->expert_bytes;
  /* load_free_bytes is a snapshot at publish time (MemAvailable moves on its own). */
  r.load_free_bytes = es__load_free(s, t->weight_bytes, avail);
  size_t len = moerpc__v1__hello_reply__get_packed_size(&r);
  grpc_slice_unref(t->hello);
  t->hello = grpc_slice_malloc(len);
  moerpc__v1__hello_reply__pack(&r, GRPC_SLICE_START_PTR(t->hello));
out_free:
  mr_free(items);
  mr_free(ptrs);
  mr_free(ids);
  return rc;
}

/* Makes t current (ctl_lock held); the previous table goes to the retired list. */
void es__tab_publish(es_server *s, es_table *t) {
  atomic_init(&t->refs, 1);
  for (uint32_t l = 0; l < s->cfg.num_layers; l++)
    if (t->owned[l]) atomic_store(&s->layer_served[l], 1);
  atomic_store(&s->cur_weight_bytes, t->weight_bytes);
  atomic_store(&s->cur_pairs, t->pairs);
  atomic_store(&s->cur_gen, t->gen);
  pthread_mutex_lock(&s->tab_lock);
  es_table *old = s->tab;
  s->tab = t;
  pthread_mutex_unlock(&s->tab_lock);
  if (old) {
    old->next = s->retired;
    s->retired = old;
    es__tab_put(old); /* its "current" reference */
  }
}

int es__tab_init(es_server *s, mr_err *e) {
  const uint32_t L = s->cfg.num_layers;
  s->layer_served = mr_calloc(L, sizeof *s->layer_served);
  s->leaving = mr_calloc((size_t)L * s->cfg.num_experts, 1);
  es_table *t = es__tab_alloc(s);
  if (!t || !s->layer_served || !s->leaving) {
    es__tab_free(s, t);
    return mr_err_set(e, MR_ENOMEM, "owned table: out of memory");
  }
  for (uint32_t l = 0; l < L; l++) {
    t->layers[l] = s->layers[l];
    if (!s->expert_bytes && s->layers[l]) s->expert_bytes = kn_layer_expert_bytes(s->layers[l]);
  }
  /* The layers belong to the table from here on (es__unload then frees an empty array). */
  memset(s->layers, 0, L * sizeof *s->layers);
  uint64_t avail = es__mem_now();
  pthread_mutex_lock(&s->ctl_lock);
  t->gen = s->tab_gen = 1;
  int rc = es__tab_finish(s, t, avail, e);
  if (rc == 0) es__tab_publish(s, t);
  pthread_mutex_unlock(&s->ctl_lock);
  if (rc) es__tab_free(s, t);
  return rc;
}

void es__tab_reap(es_server *s) {
  pthread_mutex_lock(&s->ctl_lock);
  es_table **pp = &s->retired;
  while (*pp) {
    es_table *t = *pp;
    if (atomic_load_explicit(&t->refs, memory_order_acquire) == 0) {
      *pp = t->next;
      uint64_t gen = t->gen;
      es__tab_free(s, t);
      mr_log(MR_LOG_DEBUG, "placement: owned table %" PRIu64 " freed (no request uses it)", gen);
    } else {
      pp = &t->next;
    }
  }
  pthread_mutex_unlock(&s->ctl_lock);
}

/* A new table from cur with every layer passed on except those in changed[] (ctl_lock). */
es_table *es__tab_derive(es_server *s, es_table *cur, kn_layer **changed, const uint8_t *is_changed,
                         uint64_t avail, mr_err *e) {
  es_table *t = es__tab_alloc(s);
  if (!t) {
    mr_err_set(e, MR_ENOMEM, "owned table: out of memory");
    return NULL;
  }
  for (uint32_t l = 0; l < s->cfg.num_layers; l++)
    t->layers[l] = is_changed[l] ? changed[l] : cur->layers[l];
  t->gen = s->tab_gen + 1;
  atomic_init(&t->bad, atomic_load(&cur->bad));
  if (es__tab_finish(s, t, avail, e)) {
    memset(t->layers, 0, s->cfg.num_layers * sizeof *t->layers); /* the caller frees changed[] */
    es__tab_free(s, t);
    return NULL;
  }
  s->tab_gen++;
  for (uint32_t l = 0; l < s->cfg.num_layers; l++)
    if (!is_changed[l]) cur->passed[l] = 1;
  return t;
}

int es__tab_republish(es_server *s, uint64_t avail, mr_err *e) {
  uint8_t *none = mr_calloc(s->cfg.num_layers, 1);
  if (!none) return mr_err_set(e, MR_ENOMEM, "owned table: out of memory");
  es_table *t = es__tab_derive(s, s->tab, NULL, none, avail, e);
  mr_free(none);
  if (!t) return e && e->code ? e->code : MR_ENOMEM;
  es__tab_publish(s, t);
  return 0;
}

void es__tab_mark_bad(es_server *s) {
  pthread_mutex_lock(&s->ctl_lock);
  atomic_store(&s->cache_bad, true);
  atomic_store(&s->serving, false);
  for (es_table *t = s->retired; t; t = t->next) atomic_store(&t->bad, true);
  if (s->tab) atomic_store(&s->tab->bad, true);
  pthread_mutex_unlock(&s->ctl_lock);
}

void es__tab_serve_again(es_server *s) {
  atomic_store(&s->cache_bad, false);
  atomic_store(&s->serving, true);
  /* A drain that began meanwhile wins (it set serving false before draining true). */
  if (atomic_load(&s->draining)) atomic_store(&s->serving, false);
}

void es__tab_close(es_server *s) {
  /* Teardown: no request is left, so every table goes, current and retired. */
  es_table *t = s->retired;
  while (t) {
    es_table *n = t->next;
    es__tab_free(s, t);
    t = n;
  }
  s->retired = NULL;
  es__tab_free(s, s->tab);
  s->tab = NULL;
  mr_free((void *)s->layer_served);
  s->layer_served = NULL;
  mr_free(s->leaving);
  s->leaving = NULL;
}
