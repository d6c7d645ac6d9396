/*
 * gc_cluster.c - opening and closing a cluster: the cluster file, the Hello round, the
 * consistency checks between servers (and against the model, when one is known), the
 * owner map, the coverage check; the getters; the unary calls (Hello, Stats).
 *
 * Open, step by step (every failure unwinds through gc_cluster_close):
 *   1. grpc_init; one control channel per server (Hello, Stats).
 *   2. Hello all servers at once on one completion queue, with WAIT_FOR_READY and one
 *      deadline (connect_timeout_ms), so servers still starting are waited for and a dead
 *      one costs the timeout once, not once per server.
 *   3. Check each reply (it is input from the network: ranges, ownership inside the
 *      model) and compare every server with the first.
 *   4. One server under two addresses ("localhost:P" and "127.0.0.1:P", a DNS name and its
 *      IP): the entries whose Hello carries the instance_id of an earlier one are aliases
 *      of it (one WARN line naming both addresses); they count once: no announcements, no
 *      stream, no traffic, a route to one goes to its original (aliases_find).
 *   5. With a model: its config and fingerprint must match; local experts load from it.
 *   6. Owner map (local first, then the routed or first announcing server: the primary),
 *      replica sets (every announcing server of a server-owned pair), coverage check.
 *   7. Data channels sized from max_tokens, the I/O thread, one Forward stream per server
 *      (aliases: none), the prober thread (gc_health.c).
 */
#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc_security.h>
#include <grpc/slice.h>
#include <grpc/support/alloc.h>
#include <grpc/support/time.h>

#include "gpu_client/rpc/internal.h"

void gc_options_init(gc_options *o) {
  memset(o, 0, sizeof *o);
  o->local_format = KN_FMT_COUNT;
  o->local_engine.isa = KN_ISA_COUNT;
}

/* ---- Hello ------------------------------------------------------------------------------ */

/* Every server must serve the model of the first one. */
static int hello_compare(const gc__server *a, const gc__server *b, mr_err *e) {
#define GC__CMP_U(field, label)                                                          \
  if (a->field != b->field)                                                             \
    return mr_err_set(e, MR_EMISMATCH, GC__SRV_FMT " has %s %u but " GC__SRV_FMT " has %u", \
                      GC__SRV_ARGS(b), label, b->field, GC__SRV_ARGS(a), a->field);
  if (strcmp(a->fingerprint, b->fingerprint) != 0)
    return mr_err_set(e, MR_EMISMATCH,
                      GC__SRV_FMT " has model_fingerprint %s but " GC__SRV_FMT " has %s (not "
                      "the same model files)",
                      GC__SRV_ARGS(b), b->fingerprint, GC__SRV_ARGS(a), a->fingerprint);
  GC__CMP_U(hidden, "hidden_size")
  GC__CMP_U(inter, "intermediate_size")
  GC__CMP_U(layers, "num_layers")
  GC__CMP_U(experts, "num_experts")
#undef GC__CMP_U
  if (strcmp(a->weight_format, b->weight_format) != 0)
    return mr_err_set(e, MR_EMISMATCH,
                      GC__SRV_FMT " has weight_format %s but " GC__SRV_FMT " has %s (one "
                      "layer's experts would not compute the same numbers)",
                      GC__SRV_ARGS(b), b->weight_format, GC__SRV_ARGS(a), a->weight_format);
  return 0;
}

/* Hellos every server at once (gc__hello_round), then reports the first failing server in
 * file order (so the message is reproducible), and compares every server with the first. */
static int hello_all(gc_cluster *c, uint32_t timeout_ms, mr_err *e) {
  const uint32_t n = c->n_servers;
  gc__server *tmp = mr_calloc(n, sizeof *tmp);
  int *rcs = mr_calloc(n, sizeof *rcs);
  mr_err *errs = mr_calloc(n, sizeof *errs);
  int rc = 0;
  if (!tmp || !rcs || !errs) {
    rc = mr_err_set(e, MR_ENOMEM, "Hello round of %u servers: out of memory", n);
    goto out_free;
  }
  mr_log(MR_LOG_INFO, "Hello to %u server%s (timeout %u ms)", n, n == 1 ? "" : "s", timeout_ms);
  gc__hello_round(c, NULL, n, timeout_ms, tmp, rcs, errs);
  for (uint32_t i = 0; i < n && !rc; i++) {
    gc__server *sv = &c->servers[i];
    if (rcs[i]) {
      *e = errs[i];
      rc = rcs[i];
      break;
    }
    gc__hello_take(sv, &tmp[i]);
    if (i > 0 && (rc = hello_compare(&c->servers[0], sv, e))) break;
    mr_log(MR_LOG_INFO,
           GC__SRV_FMT ": protocol %u.%u, model %s, H=%u I=%u L=%u E=%u, %s, max_tokens %u, "
           "%llu (layer, expert) pairs",
           GC__SRV_ARGS(sv), sv->proto_major, sv->proto_minor, sv->fingerprint, sv->hidden,
           sv->inter, sv->layers, sv->experts, sv->weight_format, sv->max_tokens,
           (unsigned long long)sv->announced);
  }
out_free:
  for (uint32_t i = 0; tmp && i < n; i++) mr_free(tmp[i].announce);
  mr_free(tmp);
  mr_free(rcs);
  mr_free(errs);
  return rc;
}

/* Marks every server whose instance_id an earlier one already had as that one's alias (see
 * the top). Servers older than protocol 1.3 send no id and are never aliases. */
static void aliases_find(gc_cluster *c) {
  for (uint32_t i = 1; i < c->n_servers; i++) {
    gc__server *sv = &c->servers[i];
    if (!sv->instance_id[0]) continue;
    for (uint32_t j = 0; j < i; j++) {
      const gc__server *o = &c->servers[j];
      if (o->alias_of >= 0 || strcmp(o->instance_id, sv->instance_id) != 0) continue;
      sv->alias_of = (int32_t)j;
      mr_log(MR_LOG_WARN, GC__SRV_FMT " and " GC__SRV_FMT " are one server (both answer "
             "Hello with instance_id %s): counted once, as %s; %s gets no traffic and is no "
             "replica (list each server once in the cluster file)", GC__SRV_ARGS(o),
             GC__SRV_ARGS(sv), sv->instance_id, o->cfg.name, sv->cfg.name);
      break;
    }
  }
}

/* ---- the model --------------------------------------------------------------------------- */

static int model_check(gc_cluster *c, uint8_t *must, mr_err *e) {
  mr_model_config cfg;
  mr_st *st = NULL;
  char fp[17];
  const gc__server *s0 = &c->servers[0];
  int rc = mr_config_load(&cfg, c->model_dir, e);
  if (rc) return mr_err_prefix(e, rc, "model %s", c->model_dir);
  struct { const char *name; uint32_t mine, theirs; } dims[] = {
      {"hidden_size", cfg.hidden_size, c->H},
      {"moe_intermediate_size", cfg.moe_intermediate, c->I},
      {"num_hidden_layers", cfg.num_layers, c->L},
      {"num_experts", cfg.num_experts, c->E},
  };
  for (size_t i = 0; i < sizeof dims / sizeof dims[0]; i++)
    if (dims[i].mine != dims[i].theirs)
      return mr_err_set(e, MR_EMISMATCH, "model %s: config %s = %u but " GC__SRV_FMT " has %u",
                        c->model_dir, dims[i].name, dims[i].mine, GC__SRV_ARGS(s0),
                        dims[i].theirs);
  rc = mr_st_open(&st, c->model_dir, e);
  if (rc) return mr_err_prefix(e, rc, "model %s", c->model_dir);
  rc = mr_model_fingerprint(c->model_dir, st, fp, e);
  mr_st_close(st);
  if (rc) return mr_err_prefix(e, rc, "model %s: fingerprint", c->model_dir);
  if (strcmp(fp, c->fingerprint) != 0)
    return mr_err_set(e, MR_EMISMATCH,
                      "model %s has fingerprint %s but " GC__SRV_FMT " serves %s (not the same "
                      "model files)",
                      c->model_dir, fp, GC__SRV_ARGS(s0), c->fingerprint);
  for (uint32_t l = 0; l < c->L; l++) must[l] = mr_config_is_moe_layer(&cfg, l);
  return 0;
}

/* ---- the replica sets (gc__routes) --------------------------------------------------------- */

static void routes_free_all(gc__routes *rt, uint32_t n_servers) {
  while (rt) {
    gc__routes *older = rt->older;
    for (uint32_t i = 0; rt->ann && i < n_servers; i++) mr_free(rt->ann[i]);
    mr_free(rt->ann);
    mr_free(rt->rep_off);
    mr_free(rt->rep);
    mr_free(rt->pref);
    mr_free(rt);
    rt = older;
  }
}

static bool ann_has(const uint64_t *ann, size_t i) { return ann && ann[i >> 6] >> (i & 63) & 1u; }

/* A new table (gen 0) of replica sets over c->owner from the owned sets ann[] (copied; NULL
 * for an alias): every announcing server of a server-owned pair, the placement's server
 * preferred while it announces the pair. assigned (may be NULL) gets each server's pairs.
 * NULL and MR_ENOMEM in e on failure. */
static gc__routes *routes_build(gc_cluster *c, const uint64_t *const *ann, uint64_t *assigned,
                                mr_err *e) {
  const size_t pairs = (size_t)c->L * c->E, words = (pairs + 63) / 64;
  gc__routes *rt = mr_calloc(1, sizeof *rt);
  if (!rt) goto out_nomem;
  rt->ann = mr_calloc(c->n_servers, sizeof *rt->ann);
  rt->rep_off = mr_malloc((pairs + 1) * sizeof *rt->rep_off);
  if (!rt->ann || !rt->rep_off) goto out_nomem;
  for (uint32_t s = 0; s < c->n_servers; s++) {
    if (!ann[s]) continue;
    rt->ann[s] = mr_malloc(words * sizeof **rt->ann);
    if (!rt->ann[s]) goto out_nomem;
    memcpy(rt->ann[s], ann[s], words * sizeof **rt->ann);
  }
  size_t n_rep = gc__replicas_build(rt->rep_off, NULL, c->owner, c->L, c->E, c->n_servers,
                                    (const uint64_t *const *)rt->ann, NULL);
  rt->rep = mr_malloc((n_rep ? n_rep : 1) * sizeof *rt->rep);
  if (!rt->rep) goto out_nomem;
  gc__replicas_build(rt->rep_off, rt->rep, c->owner, c->L, c->E, c->n_servers,
                     (const uint64_t *const *)rt->ann, assigned);
  if (c->route) {
    rt->pref = mr_malloc(pairs * sizeof *rt->pref);
    if (!rt->pref) goto out_nomem;
    for (size_t i = 0; i < pairs; i++) {
      int32_t s = c->route[i];
      rt->pref[i] = c->local[i] || s < 0 || !ann_has(rt->ann[s], i) ? -1 : s;
    }
  }
  return rt;
out_nomem:
  routes_free_all(rt, c->n_servers);
  mr_err_set(e, MR_ENOMEM, "replica sets of %u x %u: out of memory", c->L, c->E);
  return NULL;
}

/* Whether two tables route alike: the same replica sets and preferences. */
static bool routes_same(const gc_cluster *c, const gc__routes *a, const gc__routes *b) {
  const size_t pairs = (size_t)c->L * c->E;
  if (memcmp(a->rep_off, b->rep_off, (pairs + 1) * sizeof *a->rep_off) != 0) return false;
  if (memcmp(a->rep, b->rep, a->rep_off[pairs] * sizeof *a->rep) != 0) return false;
  return !a->pref || memcmp(a->pref, b->pref, pairs * sizeof *a->pref) == 0;
}

int gc__routes_refresh(gc_cluster *c, uint64_t seen_gen, uint32_t min_gap_ms,
                       const char *trigger, mr_err *e) {
  const uint32_t n = c->n_servers;
  const size_t pairs = (size_t)c->L * c->E;
  int rc = 0;
  pthread_mutex_lock(&c->refresh_lock);
  gc__routes *cur = atomic_load(&c->routes);
  const uint64_t now = mr_now_ns();
  /* Another caller refreshed since that request was planned, or a re-Hello just now found
   * what this one would (a lost expert asked for every step costs one round per gap). */
  if (cur->gen > seen_gen ||
      (c->t_refresh_ns && now - c->t_refresh_ns < (uint64_t)min_gap_ms * 1000000u)) {
    pthread_mutex_unlock(&c->refresh_lock);
    return 0;
  }
  c->t_refresh_ns = now;
  uint32_t *idx = mr_calloc(n, sizeof *idx);
  gc__server *tmp = mr_calloc(n, sizeof *tmp);
  int *rcs = mr_calloc(n, sizeof *rcs);
  mr_err *errs = mr_calloc(n, sizeof *errs);
  const uint64_t **ann = mr_calloc(n, sizeof *ann);
  uint32_t k = 0, answered = 0;
  if (!idx || !tmp || !rcs || !errs || !ann) {
    rc = mr_err_set(e, MR_ENOMEM, "re-Hello of %u servers: out of memory", n);
    goto out_free;
  }
  for (uint32_t s = 0; s < n; s++) {
    ann[s] = cur->ann[s]; /* a server that does not answer keeps its previous set */
    if (c->servers[s].alias_of < 0 && atomic_load(&c->streams[s].up)) idx[k++] = s;
  }
  /* A short deadline: the servers are up and answered a moment ago; the call waits. */
  uint32_t tmo = c->deadline_ms / 4 < 2000 ? c->deadline_ms / 4 : 2000;
  gc__hello_round(c, idx, k, tmo ? tmo : 1, tmp, rcs, errs);
  for (uint32_t i = 0; i < k; i++) {
    const gc__server *sv = &c->servers[idx[i]];
    if (rcs[i]) {
      mr_log_ratelimited(MR_LOG_WARN, 10, "re-Hello: %s (its owned set stays as it was)",
                         errs[i].msg);
      continue;
    }
    if (strcmp(tmp[i].fingerprint, c->fingerprint) != 0 || tmp[i].layers != c->L ||
        tmp[i].experts != c->E || tmp[i].hidden != c->H ||
        strcmp(tmp[i].weight_format, c->weight_format) != 0) {
      mr_log_ratelimited(MR_LOG_WARN, 10, "re-Hello: " GC__SRV_FMT " now serves model %s (%s), "
                         "the cluster's is %s (%s): its owned set stays as it was",
                         GC__SRV_ARGS(sv), tmp[i].fingerprint, tmp[i].weight_format,
                         c->fingerprint, c->weight_format);
      continue;
    }
    ann[idx[i]] = tmp[i].announce;
    answered++;
  }
  gc__routes *rt = routes_build(c, ann, NULL, e);
  if (!rt) {
    rc = MR_ENOMEM;
    goto out_free;
  }
  if (routes_same(c, cur, rt)) {
    mr_log(MR_LOG_INFO, "re-Hello of %u server%s (%u answered) after %s: the owned sets are "
           "unchanged, routing generation %llu stays", k, k == 1 ? "" : "s", answered, trigger,
           (unsigned long long)cur->gen);
    routes_free_all(rt, n);
    goto out_free;
  }
  uint64_t moved = 0;
  for (size_t i = 0; i < pairs; i++)
    moved += cur->rep_off[i + 1] - cur->rep_off[i] != rt->rep_off[i + 1] - rt->rep_off[i] ||
             memcmp(cur->rep + cur->rep_off[i], rt->rep + rt->rep_off[i],
                    (rt->rep_off[i + 1] - rt->rep_off[i]) * sizeof *rt->rep) != 0;
  rt->gen = cur->gen + 1;
  rt->older = cur;
  atomic_store_explicit(&c->routes, rt, memory_order_release);
  mr_log(MR_LOG_INFO, "re-Hello of %u server%s (%u answered) after %s: %llu pair%s changed "
         "servers; routing generation %llu", k, k == 1 ? "" : "s", answered, trigger,
         (unsigned long long)moved, moved == 1 ? "" : "s", (unsigned long long)rt->gen);
out_free:
  pthread_mutex_unlock(&c->refresh_lock);
  for (uint32_t i = 0; tmp && i < n; i++) mr_free(tmp[i].announce);
  mr_free(tmp);
  mr_free(idx);
  mr_free(rcs);
  mr_free(errs);
  mr_free(ann);
  return rc;
}

/* ---- open / close ------------------------------------------------------------------------ */

int gc__cluster_init(gc_cluster *c, const mr_cluster_file *file, const gc_options *opts,
                      mr_err *e) {
  c->file = *file;
  if (opts) c->opts = *opts;
  else gc_options_init(&c->opts);
  snprintf(c->client_name, sizeof c->client_name, "%s",
           c->opts.client_name ? c->opts.client_name : "moerpc-client");
  const char *model = c->opts.model_dir && *c->opts.model_dir ? c->opts.model_dir : file->model;
  if (strlen(model) >= sizeof c->model_dir)
    return mr_err_set(e, MR_EINVAL, "model path has %zu characters, at most %zu", strlen(model),
                      sizeof c->model_dir - 1);
  snprintf(c->model_dir, sizeof c->model_dir, "%s", model);
  c->deadline_ms = c->opts.deadline_ms ? c->opts.deadline_ms : file->deadline_ms;
  if (c->deadline_ms == 0) c->deadline_ms = MR_CLUSTER_DEFAULT_DEADLINE_MS;
  if (c->deadline_ms > MR_CLUSTER_MAX_DEADLINE_MS)
    return mr_err_set(e, MR_EINVAL, "deadline_ms = %u, must be 1..%u", c->deadline_ms,
                      MR_CLUSTER_MAX_DEADLINE_MS);
  if (file->n_servers < 1 || file->n_servers > MR_CLUSTER_MAX_SERVERS)
    return mr_err_set(e, MR_EINVAL, "cluster: %u servers, must be 1..%d", file->n_servers,
                      MR_CLUSTER_MAX_SERVERS);
  c->n_servers = file->n_servers;
  /* The failover deadline: long enough not to take a busy server for a dead one, short
   * enough that a stalled one costs a fraction of the request deadline. */
  c->failover_ms = c->opts.failover_ms ? c->opts.failover_ms : file->failover_ms;
  if (c->failover_ms == 0) c->failover_ms = c->deadline_ms / 4 < 1000 ? c->deadline_ms / 4 : 1000;
  if (c->failover_ms == 0) c->failover_ms = 1;
  if (c->failover_ms > MR_CLUSTER_MAX_DEADLINE_MS)
    return mr_err_set(e, MR_EINVAL, "failover_ms = %u, must be 1..%u", c->failover_ms,
                      MR_CLUSTER_MAX_DEADLINE_MS);
  if (c->opts.wait_spin_us > GC_WAIT_SPIN_MAX_US)
    return mr_err_set(e, MR_EINVAL, "wait_spin_us = %u, must be 0..%u", c->opts.wait_spin_us,
                      GC_WAIT_SPIN_MAX_US);
  atomic_init(&c->next_id, 1);
  atomic_init(&c->rot, 0);
  pthread_mutex_init(&c->health_lock, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC); /* probe times are mr_now_ns based */
  pthread_cond_init(&c->health_cond, &ca);
  pthread_condattr_destroy(&ca);
  pthread_mutex_init(&c->local_lock, NULL);
  pthread_mutex_init(&c->calls_lock, NULL);
  pthread_cond_init(&c->calls_cond, NULL);
  pthread_mutex_init(&c->refresh_lock, NULL);
  atomic_init(&c->routes, NULL);
  c->locks_inited = true;
  int rc = gc__pool_new(c, e);
  if (rc) return rc;
  c->servers = mr_calloc(c->n_servers, sizeof *c->servers);
  c->streams = mr_calloc(c->n_servers, sizeof *c->streams);
  if (!c->servers || !c->streams)
    return mr_err_set(e, MR_ENOMEM, "cluster of %u servers: out of memory", c->n_servers);
  for (uint32_t i = 0; i < c->n_servers; i++) {
    c->servers[i].cfg = file->servers[i];
    c->servers[i].alias_of = -1;
    pr_target_from_address(file->servers[i].address, c->servers[i].target,
                           sizeof c->servers[i].target);
  }
  return 0;
}

/* Applies gc_options.caller_local to local[] and checks gc_options.route against the
 * servers' Hellos, before anything is routed: sizes must be the servers' L * E, a routed
 * server must exist and announce the pair, and a pair cannot be both local and routed. */
static int caller_placement_check(gc_cluster *c, uint8_t *local, mr_err *e) {
  const size_t pairs = (size_t)c->L * c->E;
  const gc_options *o = &c->opts;
  if (o->caller_local) {
    if (o->caller_local_len != pairs)
      return mr_err_set(e, MR_EMISMATCH, "caller-local experts: %zu entries given, the "
                        "servers' model has %u layers x %u experts = %zu", o->caller_local_len,
                        c->L, c->E, pairs);
    for (size_t i = 0; i < pairs; i++) {
      if (!o->caller_local[i]) continue;
      if (local[i])
        return mr_err_set(e, MR_EINVAL, "layer %zu expert %zu is both in the cluster file's "
                          "\"local\" section and computed by the caller", i / c->E, i % c->E);
      local[i] = GC__LOCAL_CALLER;
      c->caller_pairs++;
    }
  }
  if (o->route) {
    if (o->route_len != pairs)
      return mr_err_set(e, MR_EMISMATCH, "placement routing: %zu entries given, the servers' "
                        "model has %u layers x %u experts = %zu", o->route_len, c->L, c->E,
                        pairs);
    /* A copy: the caller's array need not outlive open, and a re-Hello (gc__routes_refresh)
     * reads it later. A placement naming an alias means its original. */
    c->route_own = mr_malloc(pairs * sizeof *c->route_own);
    if (!c->route_own) return mr_err_set(e, MR_ENOMEM, "placement routing: out of memory");
    for (size_t i = 0; i < pairs; i++) {
      int32_t s = o->route[i];
      c->route_own[i] = s >= 0 && (uint32_t)s < c->n_servers && c->servers[s].alias_of >= 0
                            ? c->servers[s].alias_of : s;
    }
    c->route = c->route_own;
    for (size_t i = 0; i < pairs; i++) {
      int32_t s = c->route[i];
      if (s < 0) continue;
      if ((uint32_t)s >= c->n_servers)
        return mr_err_set(e, MR_ERANGE, "placement: layer %zu expert %zu is routed to server "
                          "index %d, the cluster has %u servers", i / c->E, i % c->E, s,
                          c->n_servers);
      if (local[i])
        return mr_err_set(e, MR_EINVAL, "placement: layer %zu expert %zu is both local and "
                          "routed to " GC__SRV_FMT, i / c->E, i % c->E,
                          GC__SRV_ARGS(&c->servers[s]));
      const uint64_t *ann = c->servers[s].announce;
      if (!ann || !(ann[i >> 6] >> (i & 63) & 1u))
        return mr_err_set(e, MR_EPRECOND, "placement: layer %zu expert %zu is placed on "
                          GC__SRV_FMT ", which does not own it (its Hello does not announce it)",
                          i / c->E, i % c->E, GC__SRV_ARGS(&c->servers[s]));
    }
  }
  return 0;
}

int gc_cluster_open_parsed(gc_cluster **out, const mr_cluster_file *file,
                           const gc_options *opts, mr_err *e) {
  uint8_t *must = NULL, *local = NULL;
  char *msg = NULL;
  MR_ASSERT(out && file);
  *out = NULL;
  gc_cluster *c = mr_calloc(1, sizeof *c);
  if (!c) return mr_err_set(e, MR_ENOMEM, "cluster: out of memory");
  int rc = gc__cluster_init(c, file, opts, e);
  if (rc) goto out_close;

  rc = gc__ctl_channels_open(c, e);
  if (rc) goto out_close;
  uint32_t connect_ms = c->opts.connect_timeout_ms ? c->opts.connect_timeout_ms
                                                   : GC_DEFAULT_CONNECT_TIMEOUT_MS;
  rc = hello_all(c, connect_ms, e);
  if (rc) goto out_close;
  aliases_find(c);

  const gc__server *s0 = &c->servers[0];
  c->H = s0->hidden;
  c->I = s0->inter;
  c->L = s0->layers;
  c->E = s0->experts;
  snprintf(c->fingerprint, sizeof c->fingerprint, "%s", s0->fingerprint);
  snprintf(c->weight_format, sizeof c->weight_format, "%s", s0->weight_format);
  c->max_tokens_min = UINT32_MAX;
  c->max_top_k_min = UINT32_MAX;
  for (uint32_t i = 0; i < c->n_servers; i++) {
    if (c->servers[i].max_tokens < c->max_tokens_min) c->max_tokens_min = c->servers[i].max_tokens;
    if (c->servers[i].max_top_k < c->max_top_k_min) c->max_top_k_min = c->servers[i].max_top_k;
  }
  rc = gc_weight_format_parse(c->weight_format, &c->fmt, &c->group, e);
  if (rc) {
    rc = mr_err_prefix(e, MR_EPROTO, GC__SRV_FMT ": Hello", GC__SRV_ARGS(s0));
    goto out_close;
  }

  size_t pairs = (size_t)c->L * c->E;
  must = mr_calloc(c->L, 1);
  local = c->local = mr_calloc(pairs, 1);
  c->owner = mr_malloc(pairs * sizeof *c->owner);
  msg = mr_malloc(sizeof e->msg);
  if (!must || !local || !c->owner || !msg) {
    rc = mr_err_set(e, MR_ENOMEM, "owner map of %u x %u: out of memory", c->L, c->E);
    goto out_close;
  }
  if (c->model_dir[0]) {
    rc = model_check(c, must, e);
    if (rc) goto out_close;
  }
  bool want_local = !c->opts.no_local && c->file.local_layers[0] && c->file.local_experts[0];
  if (want_local) {
    if (!c->model_dir[0]) {
      rc = mr_err_set(e, MR_EINVAL, "cluster file: a \"local\" section needs a model to load "
                      "the local experts from (\"model\" in the file, or the model option)");
      goto out_close;
    }
    rc = gc__local_load(c, local, e);
    if (rc) goto out_close;
  }

  rc = caller_placement_check(c, local, e);
  if (rc) goto out_close;

  const uint64_t **ann = mr_calloc(c->n_servers, sizeof *ann);
  uint64_t *assigned = mr_calloc(c->n_servers, sizeof *assigned);
  if (!ann || !assigned) {
    mr_free(ann);
    mr_free(assigned);
    rc = mr_err_set(e, MR_ENOMEM, "owner map: out of memory");
    goto out_close;
  }
  /* An alias announces nothing: its pairs are its original's, counted once. */
  for (uint32_t i = 0; i < c->n_servers; i++)
    ann[i] = c->servers[i].alias_of >= 0 ? NULL : c->servers[i].announce;
  gc__owner_build(c->owner, c->L, c->E, c->n_servers, ann, local, c->route, NULL);
  /* Every announcing server is a replica of a server-owned pair; a routed pair prefers
   * its placement's server while it is up. */
  gc__routes *rt = routes_build(c, ann, assigned, e);
  if (!rt) {
    mr_free(ann);
    mr_free(assigned);
    rc = e && e->code ? e->code : MR_ENOMEM;
    goto out_close;
  }
  rt->gen = 1;
  atomic_store(&c->routes, rt);
  uint64_t replicated = 0;
  for (size_t i = 0; i < pairs; i++) replicated += rt->rep_off[i + 1] - rt->rep_off[i] > 1;
  for (uint32_t i = 0; i < c->n_servers; i++) {
    c->servers[i].assigned = assigned[i];
    if (assigned[i] == 0 && c->servers[i].alias_of < 0)
      mr_log(MR_LOG_WARN, GC__SRV_FMT ": every expert it announces is local or "
             "caller-computed; it gets no traffic", GC__SRV_ARGS(&c->servers[i]));
  }
  if (replicated)
    mr_log(MR_LOG_INFO, "replicas: %llu of %zu pairs on more than one server; failover after "
           "%u ms without a reply", (unsigned long long)replicated, pairs, c->failover_ms);
  mr_free(ann);
  mr_free(assigned);

  if (gc__coverage_check(c->owner, c->L, c->E, must, msg, sizeof e->msg) > 0) {
    rc = mr_err_set(e, MR_EPRECOND, "%s", msg);
    goto out_close;
  }
  /* A step ends at the last layer that anyone computes (a server, local or the caller). */
  uint32_t last_layer = 0;
  for (size_t i = 0; i < pairs; i++)
    if (c->owner[i] != GC_OWNER_NONE) last_layer = (uint32_t)(i / c->E);
  if (c->opts.routing_window > GC_ROUTING_MAX_WINDOW) {
    rc = mr_err_set(e, MR_EINVAL, "routing_window = %u steps, must be 1..%u (0 = default %u)",
                    c->opts.routing_window, GC_ROUTING_MAX_WINDOW, GC_ROUTING_DEFAULT_WINDOW);
    goto out_close;
  }
  rc = gc_routing_new(&c->routing, c->L, c->E, c->opts.routing_window, last_layer, e);
  if (rc) goto out_close;

  rc = gc__streams_start(c, e);
  if (rc) goto out_close;
  rc = gc__health_start(c, e);
  if (rc) goto out_close;
  mr_log(MR_LOG_INFO, "cluster open: %u server%s, model %s, H=%u E=%u L=%u, %s, %llu local "
         "pairs, deadline %u ms", c->n_servers, c->n_servers == 1 ? "" : "s", c->fingerprint,
         c->H, c->E, c->L, c->weight_format, (unsigned long long)c->local_pairs, c->deadline_ms);
  mr_host_check(); /* once per process: host settings that cost every round trip */
  *out = c;
  c = NULL;
out_close:
  gc_cluster_close(c);
  mr_free(must);
  mr_free(msg);
  return rc;
}

int gc_cluster_open(gc_cluster **out, const char *path, const gc_options *opts, mr_err *e) {
  MR_ASSERT(out && path);
  *out = NULL;
  mr_cluster_file *f = mr_malloc(sizeof *f);
  if (!f) return mr_err_set(e, MR_ENOMEM, "cluster file: out of memory");
  int rc = mr_cluster_load(f, path, e);
  if (rc == 0) {
    mr_log(MR_LOG_INFO, "opening cluster %s (%u server%s)", path, f->n_servers,
           f->n_servers == 1 ? "" : "s");
    rc = gc_cluster_open_parsed(out, f, opts, e);
  }
  mr_free(f);
  return rc;
}

void gc_cluster_close(gc_cluster *c) {
  if (!c) return;
  gc__health_stop(c); /* first: it uses the control channels and the streams' state */
  gc__streams_stop(c);
  gc__pool_close(c);
  gc__local_free(c);
  for (uint32_t i = 0; c->servers && i < c->n_servers; i++) {
    if (c->servers[i].ctl) grpc_channel_destroy(c->servers[i].ctl);
    mr_free(c->servers[i].announce);
  }
  mr_free(c->servers);
  mr_free(c->streams);
  mr_free(c->owner);
  mr_free(c->local);
  routes_free_all(atomic_load(&c->routes), c->n_servers);
  mr_free(c->route_own);
  gc_routing_free(c->routing);
  if (c->creds) grpc_channel_credentials_release(c->creds);
  if (c->n_auth_md) {
    grpc_slice_unref(c->auth_md.key);
    grpc_slice_unref(c->auth_md.value);
  }
  if (c->n_fwd_md > c->n_auth_md) grpc_slice_unref(c->fwd_md[c->n_fwd_md - 1].value);
  if (c->locks_inited) {
    pthread_mutex_destroy(&c->local_lock);
    pthread_mutex_destroy(&c->health_lock);
    pthread_cond_destroy(&c->health_cond);
    pthread_mutex_destroy(&c->calls_lock);
    pthread_cond_destroy(&c->calls_cond);
    pthread_mutex_destroy(&c->refresh_lock);
  }
  if (c->grpc_inited) grpc_shutdown();
  mr_free(c);
}

/* ---- getters ----------------------------------------------------------------------------- */

void gc_cluster_info_get(const gc_cluster *c, gc_cluster_info *out) {
  memset(out, 0, sizeof *out);
  out->hidden_size = c->H;
  out->intermediate_size = c->I;
  out->num_layers = c->L;
  out->num_experts = c->E;
  snprintf(out->model_fingerprint, sizeof out->model_fingerprint, "%s", c->fingerprint);
  snprintf(out->weight_format, sizeof out->weight_format, "%s", c->weight_format);
  out->max_tokens = c->max_tokens_min;
  out->n_servers = c->n_servers;
  out->deadline_ms = c->deadline_ms;
  out->failover_ms = c->failover_ms;
  out->local_pairs = c->local_pairs;
  out->local_mapped = c->local_mapped;
  out->caller_pairs = c->caller_pairs;
  snprintf(out->model_dir, sizeof out->model_dir, "%s", c->model_dir);
}

int gc_server_info_get(const gc_cluster *c, uint32_t idx, gc_server_info *out, mr_err *e) {
  if (idx >= c->n_servers)
    return mr_err_set(e, MR_ERANGE, "server index %u, must be < %u", idx, c->n_servers);
  const gc__server *sv = &c->servers[idx];
  memset(out, 0, sizeof *out);
  snprintf(out->name, sizeof out->name, "%s", sv->cfg.name);
  snprintf(out->address, sizeof out->address, "%s", sv->cfg.address);
  out->protocol_major = sv->proto_major;
  out->protocol_minor = sv->proto_minor;
  out->max_tokens = sv->max_tokens;
  out->announced_pairs = sv->announced;
  out->assigned_pairs = sv->assigned;
  out->alias_of = sv->alias_of;
  memcpy(out->instance_id, sv->instance_id, sizeof out->instance_id);
  return 0;
}

int gc_cluster_owner(const gc_cluster *c, uint32_t layer, uint32_t expert) {
  if (layer >= c->L || expert >= c->E) return GC_OWNER_NONE;
  return c->owner[(size_t)layer * c->E + expert];
}

bool gc_server_announces(const gc_cluster *c, uint32_t idx, uint32_t layer, uint32_t expert) {
  if (idx >= c->n_servers || layer >= c->L || expert >= c->E) return false;
  if (c->servers[idx].alias_of >= 0) return false; /* counted once, as its original */
  size_t b = (size_t)layer * c->E + expert;
  return c->servers[idx].announce[b >> 6] >> (b & 63) & 1u;
}

int gc_cluster_find_server(const gc_cluster *c, const char *name) {
  for (uint32_t i = 0; i < c->n_servers; i++)
    if (strcmp(c->servers[i].cfg.name, name) == 0) return (int)i;
  return -1;
}

int gc_server_counters_get(gc_cluster *c, uint32_t idx, bool reset, gc_server_counters *out,
                           mr_err *e) {
  if (idx >= c->n_servers)
    return mr_err_set(e, MR_ERANGE, "server index %u, must be < %u", idx, c->n_servers);
  gc__stream *s = &c->streams[idx];
  pthread_mutex_lock(&s->lock);
  *out = s->ctr;
  if (reset) {
    memset(&s->ctr, 0, sizeof s->ctr);
    s->sum_rtt_us = s->sum_queue_us = s->sum_compute_us = s->sum_server_us = 0;
  }
  pthread_mutex_unlock(&s->lock);
  gc__health_counters(c, idx, reset, out);
  return 0;
}

gc_routing *gc_cluster_routing(gc_cluster *c) { return c ? c->routing : NULL; }

void gc_cluster_routing_exchange(gc_cluster *a, gc_cluster *b) {
  if (!a || !b || a->L != b->L || a->E != b->E) return;
  gc_routing *r = a->routing;
  a->routing = b->routing;
  b->routing = r;
}
