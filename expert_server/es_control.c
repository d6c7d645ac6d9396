/*
 * es_control.c - live placement (docs/DESIGN.md section 15): the control calls LoadExperts /
 * LoadStatus / UnloadExperts and the live loader thread es-ctl-load. Each change it makes is
 * a new owned table, built and published through es_table.c.
 *
 * Loading runs on its own thread (es-ctl-load), one load at a time, which also reads the
 * model's headers to check a LoadExperts before answering it (the LoadExperts section
 * below): the experts are packed from the model's safetensors (the same files, loader and
 * formats as at start-up: kn_layer_load_expert) into staging layers nobody else sees;
 * packing shares the engine's workers with the compute (kn.h: calls queue up), so requests
 * keep being answered between two experts. Then the new table is published at once. A load
 * that fails publishes nothing. The drain stops it after the expert it is packing. An
 * unload builds and publishes its table at once, on the CQ thread of its call.
 *
 * Locks: ctl_lock serialises the publishers and guards the load record (ld_*) and the
 * LoadExperts queue; it is held for table updates and short reads, never across a file
 * read (MemAvailable is read before it is taken). tab_lock is taken inside it, for the
 * pointer swap only (es_table.c).
 *
 * Authorisation is checked by es_grpc.c before these handlers run: a server without
 * --auth-token-file refuses every control call (PERMISSION_DENIED), a wrong or missing token
 * gets UNAUTHENTICATED.
 */
#define _GNU_SOURCE /* pthread_setname_np */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "expert_server/internal.h"

/* Most (layer, expert) pairs one control request may name (bounded by the message size
 * anyway; this bounds the work of validating it). */
#define ES_CONTROL_MAX_PAIRS (1u << 22)

/* ---- validation (pure) --------------------------------------------------------------------- */

int es_control_validate(const struct Moerpc__V1__LayerExperts *const *items, size_t n_items,
                        const char *req_fingerprint, const char *fingerprint, const es_limits *lim,
                        uint8_t *pairs, uint64_t *n_pairs, mr_err *e) {
  const uint32_t L = lim->num_layers, E = lim->num_experts;
  *n_pairs = 0;
  memset(pairs, 0, (size_t)L * E);
  if (req_fingerprint && req_fingerprint[0] && strcmp(req_fingerprint, fingerprint) != 0) {
    /* The peer's text goes into the reply and the log line: escaped and bounded. */
    char fp[72];
    mr_log_escape(fp, sizeof fp, req_fingerprint, strlen(req_fingerprint));
    return mr_err_set(e, MR_EMISMATCH, "model_fingerprint = \"%s\", but this server serves "
                      "model %s: the request is for another model", fp, fingerprint);
  }
  uint64_t named = 0;
  for (size_t i = 0; i < n_items; i++) {
    const Moerpc__V1__LayerExperts *it = items[i];
    if (it->layer >= L)
      return mr_err_set(e, MR_EINVAL, "layers[%zu].layer = %" PRIu32 ", must be < num_layers = %"
                        PRIu32, i, it->layer, L);
    if (!lim->is_moe[it->layer])
      return mr_err_set(e, MR_EINVAL, "layers[%zu].layer = %" PRIu32 " is a dense layer: it has "
                        "no experts", i, it->layer);
    if (it->n_experts == 0)
      return mr_err_set(e, MR_EINVAL, "layers[%zu] (layer %" PRIu32 ") names no expert", i,
                        it->layer);
    named += it->n_experts;
    if (named > ES_CONTROL_MAX_PAIRS)
      return mr_err_set(e, MR_EINVAL, "more than %u pairs in one request", ES_CONTROL_MAX_PAIRS);
    for (size_t k = 0; k < it->n_experts; k++) {
      uint32_t x = it->experts[k];
      if (x >= E)
        return mr_err_set(e, MR_EINVAL, "layers[%zu].experts[%zu] = %" PRIu32 " in layer %" PRIu32
                          ", must be < num_experts = %" PRIu32, i, k, x, it->layer, E);
      uint8_t *p = &pairs[(size_t)it->layer * E + x];
      if (!*p) (*n_pairs)++;
      *p = 1;
    }
  }
  if (*n_pairs == 0) return mr_err_set(e, MR_EINVAL, "the request names no (layer, expert) pair");
  return 0;
}

int es_load_mem_check(uint64_t need, uint64_t free_bytes, mr_err *e) {
  if (need <= free_bytes) return 0;
  return mr_err_set(e, MR_EEXHAUSTED, "loading needs %" PRIu64 " bytes (%.3f GB) of packed "
                    "weights, only %" PRIu64 " bytes (%.3f GB) are free for experts (MemAvailable "
                    "minus %" PRIu64 " MiB, and --max-expert-memory)",
                    need, (double)need / 1e9, free_bytes, (double)free_bytes / 1e9,
                    ES_LOAD_MEM_MARGIN >> 20);
}

void es__control_stop(es_server *s) {
  pthread_mutex_lock(&s->ctl_lock);
  s->ctl_stop = true; /* no LoadExperts is queued from here on */
  const bool started = s->ld_thread_started;
  s->ld_thread_started = false;
  pthread_cond_signal(&s->ctl_cond);
  pthread_mutex_unlock(&s->ctl_lock);
  if (!started) return;
  atomic_store(&s->load_abort, true); /* a load packing stops after its expert */
  pthread_join(s->ld_thread, NULL);
}

void es__control_close(es_server *s) {
  es__control_stop(s);
  es__tab_close(s);
}

/* ---- the control calls ----------------------------------------------------------------------- */

/* Common refusals: not serving yet, draining. Returns true if r was answered. */
static bool es__control_refused(es_server *s, es_rpc *r) {
  char msg[600];
  if (atomic_load(&s->draining)) {
    es__rpc_reply(r, GRPC_STATUS_UNAVAILABLE, "server is draining (shutting down)", NULL);
    return true;
  }
  if (!atomic_load_explicit(&s->loaded, memory_order_acquire)) {
    es__loading_msg(s, msg, sizeof msg);
    es__rpc_reply(r, GRPC_STATUS_UNAVAILABLE, msg, NULL);
    return true;
  }
  return false;
}

/* The request of LoadExperts or UnloadExperts r, decoded (the caller frees it with
 * protobuf_c_message_free_unpacked), its peer's name in peer[96]; or NULL once r is
 * answered: refused (draining, loading) or INVALID_ARGUMENT "<what> does not decode: ..."
 * (an empty message too). */
static void *es__control_request(es_rpc *r, const ProtobufCMessageDescriptor *d, const char *what,
                                 char *peer) {
  mr_err e;
  mr_err_clear(&e);
  if (es__control_refused(r->srv, r)) return NULL;
  ProtobufCMessage *m = NULL;
  int rc = r->payload ? pr_decode(r->payload, d, ES_MAX_CONTROL_REQUEST_BYTES_LARGE, &m, &e)
                      : mr_err_set(&e, MR_EINVAL, "empty message");
  if (rc) {
    char where[64];
    snprintf(where, sizeof where, "%s does not decode", what);
    es__rpc_reply_err(r, MR_EINVAL, where, &e);
    return NULL;
  }
  es__call_peer(r->call, peer, 96);
  return m;
}

/* ---- LoadExperts ------------------------------------------------------------------------------
 *
 * A LoadExperts crosses two threads, so that no CQ thread reads the model and ctl_lock is
 * never held across a file read:
 *
 *   CQ thread     es__on_load: the refusals (draining, loading, a load running), decode,
 *                 the pure range checks (es_control_validate); then the request joins
 *                 srv->ld_queue (ctl_lock) and wakes es-ctl-load, which the first
 *                 LoadExperts starts and which then waits for the next one.
 *   es-ctl-load   es__load_serve, one request at a time, in arrival order:
 *                   es__load_admit          ctl_lock: pairs owned already are skipped, the
 *                                           memory rule against the current table
 *                   es__load_check_tensors  no lock: the safetensors reopened and
 *                                           re-fingerprinted, every tensor's presence, dtype
 *                                           and shape read from the headers
 *                   es__load_record         ctl_lock: the load's id and totals, RUNNING
 *                   es__load_reply          the LoadReply (es__rpc_reply, es_rpc.c)
 *                   es__load_run            pack (no lock), publish (ctl_lock), end (ctl_lock)
 *
 * Taking requests one at a time in arrival order answers them as if each had been checked
 * whole under ctl_lock, as one step: a request that arrives while a load runs is refused
 * "still running" at once by its CQ thread, and those queued behind one that turns RUNNING
 * are refused the same way by es-ctl-load (es__load_record hands them back).
 */

/* A LoadExperts call on its way from its CQ thread to es-ctl-load, and what es-ctl-load
 * finds out about it. Owned by the queue, then by es-ctl-load, which frees it. */
typedef struct es_load_req {
  struct es_load_req *next;  /* srv->ld_queue (ctl_lock) */
  es_rpc *r;                 /* the call: answered by es-ctl-load, freed by its CQ thread */
  char peer[96];             /* for log lines */
  uint8_t *want;             /* [num_layers * num_experts]: the pairs to load */
  uint64_t n_pairs;          /* pairs set in want */
  mr_st *st;                 /* the model's safetensors, open from the check to the end */
  uint64_t n_in_place;       /* pairs served in place from st (--map-weights): with any, st
                              * stays open for the server's life once the load is published */
  uint64_t tensors_total, bytes_total; /* what the load reads (headers) */
  uint64_t need, free_b;     /* packed bytes it adds, and the room there was */
  uint64_t id, t0_ns;        /* set when it becomes the latest load (es__load_record) */
} es_load_req;

static void es__load_req_free(es_load_req *lr) {
  if (!lr) return;
  mr_st_close(lr->st);
  mr_free(lr->want);
  mr_free(lr);
}

/* Refuses a LoadExperts: a WARN line (rate-limited) with the peer, rc's status. */
static void es__load_refuse(es_rpc *r, const char *peer, int rc, const mr_err *e) {
  mr_log_ratelimited(MR_LOG_WARN, 1, "placement: LoadExperts from %s refused: %s", peer, e->msg);
  es__rpc_reply_err(r, rc, "LoadExperts refused", e);
}

/* The refusal of a LoadExperts while load id packs. */
static int es__load_busy_err(uint64_t id, mr_err *e) {
  return mr_err_set(e, MR_EPRECOND, "load %" PRIu64 " is still running: one load at a time "
                    "(poll LoadStatus)", id);
}

/* MR_EPRECOND while a load packs, else 0. ctl_lock held. */
static int es__load_busy(const es_server *s, mr_err *e) {
  return s->ld_state == MOERPC__V1__LOAD_STATE__LOAD_STATE_RUNNING ? es__load_busy_err(s->ld_id, e) : 0;
}

static void *es__ctl_main(void *arg);

/* Queues lr for es-ctl-load, starting the thread the first time. ctl_lock held. */
static int es__load_enqueue_locked(es_server *s, es_load_req *lr, mr_err *e) {
  if (s->ctl_stop) return mr_err_set(e, MR_EUNAVAIL, "server is shutting down");
  if (!s->ld_thread_started) {
    int err = pthread_create(&s->ld_thread, NULL, es__ctl_main, s);
    if (err) return mr_err_set(e, MR_EINTERNAL, "cannot start the load thread: error %d", err);
    s->ld_thread_started = true;
  }
  lr->next = NULL;
  if (s->ld_queue_last) s->ld_queue_last->next = lr;
  else s->ld_queue = lr;
  s->ld_queue_last = lr;
  pthread_cond_signal(&s->ctl_cond);
  return 0;
}

void es__on_load(es_rpc *r) {
  char peer[96];
  Moerpc__V1__LoadRequest *req =
      es__control_request(r, &moerpc__v1__load_request__descriptor, "LoadRequest", peer);
  if (!req) return;
  es_server *s = r->srv;
  es_load_req *lr = mr_calloc(1, sizeof *lr);
  if (lr) lr->want = mr_malloc((size_t)s->cfg.num_layers * s->cfg.num_experts);
  mr_err e;
  mr_err_clear(&e);
  int rc;
  pthread_mutex_lock(&s->ctl_lock);
  rc = !lr || !lr->want ? mr_err_set(&e, MR_ENOMEM, "out of memory") : es__load_busy(s, &e);
  pthread_mutex_unlock(&s->ctl_lock);
  if (!rc)
    rc = es_control_validate((const Moerpc__V1__LayerExperts *const *)req->add, req->n_add,
                             req->model_fingerprint, s->fingerprint, &s->limits, lr->want,
                             &lr->n_pairs, &e);
  moerpc__v1__load_request__free_unpacked(req, NULL);
  if (!rc) {
    lr->r = r;
    snprintf(lr->peer, sizeof lr->peer, "%s", peer);
    pthread_mutex_lock(&s->ctl_lock);
    rc = es__load_busy(s, &e); /* a load may have started meanwhile */
    if (!rc) rc = es__load_enqueue_locked(s, lr, &e);
    pthread_mutex_unlock(&s->ctl_lock);
  }
  if (rc) {
    es__load_refuse(r, peer, rc, &e);
    es__load_req_free(lr);
  }
}

/* es-ctl-load: drops the pairs owned already (a retried apply is not an error) and applies
 * the memory rule, both against the current table (ctl_lock). */
static int es__load_admit(es_server *s, es_load_req *lr, mr_err *e) {
  const uint32_t L = s->cfg.num_layers, E = s->cfg.num_experts;
  uint64_t avail = es__mem_now();
  pthread_mutex_lock(&s->ctl_lock);
  const es_table *cur = s->tab;
  uint64_t kept = 0;
  for (uint32_t l = 0; l < L; l++)
    for (uint32_t x = 0; x < E; x++) {
      uint8_t *p = &lr->want[(size_t)l * E + x];
      if (*p && cur->owned[l] && mr_idset_has(cur->owned[l], x)) {
        *p = 0;
        lr->n_pairs--;
        /* A leaving pair asked for again stays: announced again, no longer freed. */
        if (s->leaving[(size_t)l * E + x]) {
          s->leaving[(size_t)l * E + x] = 0;
          s->n_leaving--;
          kept++;
        }
      }
    }
  if (kept) {
    s->leave_epoch++;
    mr_err re;
    if (es__tab_republish(s, avail, &re) == 0)
      mr_log(MR_LOG_INFO, "placement: %" PRIu64 " leaving pair%s asked for again: kept and "
             "announced again; owned generation %" PRIu64, kept, kept == 1 ? "" : "s", s->tab_gen);
    else
      mr_log(MR_LOG_ERROR, "placement: republishing %" PRIu64 " kept pairs: %s", kept, re.msg);
    cur = s->tab;
  }
  lr->need = lr->n_pairs * s->expert_bytes;
  lr->free_b = es__load_free(s, cur->weight_bytes, avail);
  pthread_mutex_unlock(&s->ctl_lock);
  return es_load_mem_check(lr->need, lr->free_b, e);
}

/* es-ctl-load, no lock: the tensors of every pair to load, before anything moves: the model
 * reopened and re-fingerprinted, each tensor's presence, dtype and shape (headers only).
 * Leaves the files open in lr->st for the packing. */
static int es__load_check_tensors(es_server *s, es_load_req *lr, mr_err *e) {
  const uint32_t L = s->cfg.num_layers, E = s->cfg.num_experts;
  if (!lr->n_pairs) return 0;
  int rc = mr_st_open(&lr->st, s->model_dir, e);
  if (rc) {
    mr_err_prefix(e, rc, "model %s", s->model_dir);
    return rc;
  }
  if (s->map_in_place) mr_st_advise_hugepage(lr->st); /* as at start-up (es_load.c) */
  char fp[17];
  if ((rc = mr_model_fingerprint(s->model_dir, lr->st, fp, e))) return rc;
  if (strcmp(fp, s->fingerprint) != 0)
    return mr_err_set(e, MR_EMISMATCH, "model %s changed on disk since start-up (fingerprint "
                      "%s, was %s): restart the server", s->model_dir, fp, s->fingerprint);
  for (uint32_t l = 0; l < L; l++)
    for (uint32_t x = 0; x < E; x++) {
      if (!lr->want[(size_t)l * E + x]) continue;
      const mr_st_tensor *t[3], *sc[3];
      if (mr_config_expert_tensors_q(&s->cfg, lr->st, l, x, t, sc, e)) {
        mr_err_prefix(e, MR_EFORMAT, "model %s", s->model_dir);
        return MR_EFORMAT;
      }
      lr->tensors_total += 3;
      lr->bytes_total += t[0]->nbytes + t[1]->nbytes + t[2]->nbytes;
    }
  return 0;
}

/* es-ctl-load: lr becomes the latest load, which LoadStatus reports: RUNNING, or DONE at once
 * when every pair was owned already (ctl_lock). When it runs, returns the requests queued
 * meanwhile (they are refused "still running", as they would have been after it). */
static es_load_req *es__load_record(es_server *s, es_load_req *lr) {
  const bool runs = lr->n_pairs > 0;
  pthread_mutex_lock(&s->ctl_lock);
  lr->id = ++s->ld_id;
  lr->t0_ns = s->ld_t0_ns = s->ld_t1_ns = mr_now_ns();
  s->ld_tensors_total = lr->tensors_total;
  s->ld_bytes_total = lr->bytes_total;
  s->ld_packed = lr->need;
  s->ld_status = 0;
  s->ld_error[0] = '\0';
  atomic_store(&s->ld_tensors_done, 0);
  atomic_store(&s->ld_bytes_done, 0);
  s->ld_state = runs ? MOERPC__V1__LOAD_STATE__LOAD_STATE_RUNNING
                     : MOERPC__V1__LOAD_STATE__LOAD_STATE_DONE;
  es_load_req *behind = runs ? s->ld_queue : NULL;
  if (runs) s->ld_queue = s->ld_queue_last = NULL;
  pthread_mutex_unlock(&s->ctl_lock);
  return behind;
}

/* es-ctl-load: logs the accepted load and answers its call with the LoadReply. */
static void es__load_reply(es_load_req *lr) {
  mr_log(MR_LOG_INFO, "placement: load %" PRIu64 " from %s: %" PRIu64 " pairs, %" PRIu64
         " tensors, %.3f GB to read, %.3f GB packed (%.3f GB free)", lr->id, lr->peer,
         lr->n_pairs, lr->tensors_total, lr->bytes_total / 1e9, lr->need / 1e9, lr->free_b / 1e9);
  Moerpc__V1__LoadReply rep = MOERPC__V1__LOAD_REPLY__INIT;
  rep.load_id = lr->id;
  rep.pairs = lr->n_pairs;
  rep.tensors_total = lr->tensors_total;
  rep.bytes_total = lr->bytes_total;
  rep.packed_bytes = lr->need;
  rep.free_bytes = lr->free_b;
  grpc_byte_buffer *bb = pr_encode(&rep.base);
  es__rpc_reply(lr->r, bb ? GRPC_STATUS_OK : GRPC_STATUS_RESOURCE_EXHAUSTED, bb ? "" : "out of memory", bb);
  lr->r = NULL; /* the CQ thread frees the call once the reply is sent */
}

/* es-ctl-load, no lock: packs every pair of lr into staging layers (nobody else sees them),
 * counting the tensors and bytes read in *tensors, *bytes and the progress atomics. Stops
 * with MR_ECANCELED after the expert it is packing once a drain or the teardown begins. */
static int es__load_pack(es_server *s, es_load_req *lr, kn_layer **staging,
                         uint64_t *tensors, uint64_t *bytes, bool use_cache, uint64_t *mapped,
                         mr_err *e) {
  const uint32_t L = s->cfg.num_layers, E = s->cfg.num_experts;
  kn_layer_desc d = {.hidden = s->cfg.hidden_size, .inter = s->cfg.moe_intermediate,
                     .num_experts = E, .format = s->format, .group = s->group};
  uint64_t last_log = mr_now_ns();
  for (uint32_t l = 0; l < L; l++) {
    for (uint32_t x = 0; x < E; x++) {
      if (!lr->want[(size_t)l * E + x]) continue;
      int rc = staging[l] ? 0 : kn_layer_new(&staging[l], s->eng, &d, e);
      if (rc) return rc;
      /* A pair the weight cache holds is mapped from it, not converted (es_cache.c). */
      if (use_cache && es__cache_adopt(s, staging[l], l, x)) {
        (*mapped)++;
        *tensors += 3;
        atomic_store(&s->ld_tensors_done, *tensors);
        continue;
      }
      const mr_st_tensor *t[3], *sc[3]; /* sc: an FP8 checkpoint's block scales */
      rc = mr_config_expert_tensors_q(&s->cfg, lr->st, l, x, t, sc, e);
      bool borrowed = false; /* in place where it can, as at start-up (es_load.c) */
      if (!rc) rc = kn_layer_take_expert_st(staging[l], x, t, sc, s->map_in_place, &borrowed, e);
      lr->n_in_place += borrowed;
      if (rc) {
        mr_err_prefix(e, rc, "layer %" PRIu32 " expert %" PRIu32, l, x);
        return rc;
      }
      *tensors += 3;
      *bytes += t[0]->nbytes + t[1]->nbytes + t[2]->nbytes;
      atomic_store(&s->ld_tensors_done, *tensors);
      atomic_store(&s->ld_bytes_done, *bytes);
      uint64_t now = mr_now_ns();
      if (now - last_log >= 1000000000ull) {
        last_log = now;
        double sec = (double)(now - lr->t0_ns) / 1e9, gbs = sec > 0 ? *bytes / sec / 1e9 : 0;
        mr_log(MR_LOG_INFO, "placement: load %" PRIu64 ": %" PRIu64 "/%" PRIu64 " tensors, "
               "%.3f/%.3f GB, %.2f GB/s, ETA %.0f s", lr->id, *tensors, lr->tensors_total,
               *bytes / 1e9, lr->bytes_total / 1e9, gbs,
               gbs > 0 ? (lr->bytes_total - *bytes) / 1e9 / gbs : 0);
      }
      for (uint32_t slept = 0; slept < s->load_delay_ms && !atomic_load(&s->load_abort) &&
                               !atomic_load(&s->draining); slept += 5)
        usleep(5000);
      if (atomic_load(&s->load_abort) || atomic_load(&s->draining))
        return mr_err_set(e, MR_ECANCELED, "the server began to drain: load stopped after %"
                          PRIu64 " of %" PRIu64 " tensors", *tensors, lr->tensors_total);
    }
  }
  return 0;
}

/* es-ctl-load: rebuilds every layer that got experts from the current table (which may have
 * changed since the load started: an unload meanwhile is kept) and publishes the new table
 * (ctl_lock). On failure nothing is published and the current table is as it was. */
static int es__load_publish(es_server *s, uint64_t id, kn_layer **staging, bool repair, mr_err *e) {
  const uint32_t L = s->cfg.num_layers, E = s->cfg.num_experts;
  uint8_t *is_changed = mr_calloc(L, 1), *keep = mr_malloc(E);
  kn_layer **changed = mr_calloc(L, sizeof *changed);
  int rc = 0;
  if (!is_changed || !keep || !changed) {
    rc = mr_err_set(e, MR_ENOMEM, "out of memory for the load");
    goto out_free;
  }
  memset(keep, 1, E);
  uint64_t avail = es__mem_now();
  pthread_mutex_lock(&s->ctl_lock);
  es_table *cur = s->tab;
  for (uint32_t l = 0; l < L && !rc; l++) {
    if (!staging[l]) continue;
    rc = kn_layer_rebuild(&changed[l], cur->layers[l], keep, staging[l], e);
    is_changed[l] = 1;
  }
  es_table *t = rc ? NULL : es__tab_derive(s, cur, changed, is_changed, avail, e);
  if (!t && !rc) rc = e->code ? e->code : MR_ENOMEM;
  if (t && repair) atomic_store(&t->bad, false); /* every pair was repacked from the model */
  if (t && repair) {
    es__tab_publish(s, t);
    mr_log(MR_LOG_INFO, "weight cache: repacked table published: owned generation %" PRIu64
           ", %" PRIu64 " pairs, %.3f GB packed", t->gen, t->pairs, t->weight_bytes / 1e9);
  } else if (t) {
    es__tab_publish(s, t);
    mr_log(MR_LOG_INFO, "placement: load %" PRIu64 " published: owned generation %" PRIu64
           ", %" PRIu64 " pairs, %.3f GB packed", id, t->gen, t->pairs, t->weight_bytes / 1e9);
  } else {
    /* The rebuilt layers are undone: cur's experts are cur's again (the caller frees the
     * staged ones). */
    for (uint32_t l = 0; l < L; l++) kn_layer_forget(changed[l], cur->layers[l]);
  }
  pthread_mutex_unlock(&s->ctl_lock);
out_free:
  mr_free(is_changed);
  mr_free(keep);
  mr_free(changed);
  return rc;
}

/* es-ctl-load: the end of load lr, as LoadStatus reports it (ctl_lock) and in the log. */
static void es__load_end(es_server *s, es_load_req *lr, int rc, const mr_err *e, uint64_t tensors,
                         uint64_t bytes) {
  const uint64_t t1 = mr_now_ns();
  pthread_mutex_lock(&s->ctl_lock);
  s->ld_t1_ns = t1;
  s->ld_state = rc ? MOERPC__V1__LOAD_STATE__LOAD_STATE_FAILED : MOERPC__V1__LOAD_STATE__LOAD_STATE_DONE;
  s->ld_status = rc ? (uint32_t)pr_status_from_mr(rc) : 0;
  snprintf(s->ld_error, sizeof s->ld_error, "%s", rc ? e->msg : "");
  /* Published experts served in place read lr->st's mapping from now on. */
  if (!rc && lr->n_in_place) {
    es__keep_st(s, lr->st);
    lr->st = NULL;
  }
  pthread_mutex_unlock(&s->ctl_lock);
  mr_st_close(lr->st);
  lr->st = NULL;
  double sec = (double)(t1 - lr->t0_ns) / 1e9;
  if (rc)
    mr_log(MR_LOG_ERROR, "placement: load %" PRIu64 " failed after %.1f s: %s (nothing published)",
           lr->id, sec, e->msg);
  else
    mr_log(MR_LOG_INFO, "placement: load %" PRIu64 " done: %" PRIu64 " tensors, %.3f GB in %.1f s "
           "(%.2f GB/s), %" PRIu64 " pairs in place", lr->id, tensors, bytes / 1e9, sec,
           sec > 0 ? bytes / sec / 1e9 : 0, lr->n_in_place);
}

/* es-ctl-load: packs, publishes and ends the load recorded for lr. */
static void es__load_run(es_server *s, es_load_req *lr) {
  const uint32_t L = s->cfg.num_layers;
  mr_err e;
  mr_err_clear(&e);
  uint64_t tensors = 0, bytes = 0, mapped = 0;
  kn_layer **staging = mr_calloc(L, sizeof *staging);
  int rc = staging ? es__load_pack(s, lr, staging, &tensors, &bytes, true, &mapped, &e)
                   : mr_err_set(&e, MR_ENOMEM, "out of memory for the load");
  if (!rc && mapped)
    mr_log(MR_LOG_INFO, "placement: load %" PRIu64 ": %" PRIu64 " of %" PRIu64 " pairs mapped from "
           "the weight cache, the rest packed from the model", lr->id, mapped, lr->n_pairs);
  if (!rc) rc = es__load_publish(s, lr->id, staging, false, &e);
  es__load_end(s, lr, rc, &e, tensors, bytes);
  for (uint32_t l = 0; staging && l < L; l++) kn_layer_free(staging[l]);
  mr_free(staging);
  /* After the load is DONE (LoadStatus does not wait for the disk): the pairs packed from
   * the model join the weight cache as a new segment. */
  if (!rc) es__cache_extend(s, lr->want);
}

int es__control_repack_all(es_server *s, mr_err *e) {
  const uint32_t L = s->cfg.num_layers, E = s->cfg.num_experts;
  es_load_req *lr = mr_calloc(1, sizeof *lr);
  kn_layer **staging = mr_calloc(L, sizeof *staging);
  int rc = 0;
  if (!lr || !staging || !(lr->want = mr_calloc((size_t)L * E, 1))) {
    rc = mr_err_set(e, MR_ENOMEM, "out of memory for the repack");
    goto out;
  }
  es_table *cur = es__tab_get(s);
  for (uint32_t l = 0; l < L; l++)
    for (uint32_t x = 0; cur->owned[l] && x < E; x++)
      if (mr_idset_has(cur->owned[l], x)) {
        lr->want[(size_t)l * E + x] = 1;
        lr->n_pairs++;
      }
  es__tab_put(cur);
  lr->t0_ns = mr_now_ns();
  snprintf(lr->peer, sizeof lr->peer, "weight cache repair");
  uint64_t tensors = 0, bytes = 0, mapped = 0;
  rc = es__load_check_tensors(s, lr, e);
  if (!rc) rc = es__load_pack(s, lr, staging, &tensors, &bytes, false, &mapped, e);
  if (!rc) rc = es__load_publish(s, 0, staging, true, e);
  /* A repair happens only with a weight cache, which --map-weights refuses (main.c,
   * es_server_new): nothing here reads the model's mapping after it is closed. */
  MR_ASSERT(!lr->n_in_place);
out:
  for (uint32_t l = 0; staging && l < L; l++) kn_layer_free(staging[l]);
  mr_free(staging);
  es__load_req_free(lr);
  return rc;
}

/* es-ctl-load: one LoadExperts, from its admission to the end of its load. Frees lr. */
static void es__load_serve(es_server *s, es_load_req *lr) {
  mr_err e;
  mr_err_clear(&e);
  int rc = es__load_admit(s, lr, &e);
  if (!rc) rc = es__load_check_tensors(s, lr, &e);
  if (rc) {
    es__load_refuse(lr->r, lr->peer, rc, &e);
    es__load_req_free(lr);
    return;
  }
  es_load_req *behind = es__load_record(s, lr);
  es__load_reply(lr);
  while (behind) {
    es_load_req *b = behind;
    behind = b->next;
    es__load_refuse(b->r, b->peer, es__load_busy_err(lr->id, &e), &e);
    es__load_req_free(b);
  }
  if (lr->n_pairs) es__load_run(s, lr);
  es__load_req_free(lr);
}

/* The thread es-ctl-load: serves the LoadExperts queue until es__control_stop. Requests
 * still queued then are answered UNAVAILABLE. */
static void *es__ctl_main(void *arg) {
  es_server *s = arg;
  pthread_setname_np(pthread_self(), "es-ctl-load");
  for (;;) {
    pthread_mutex_lock(&s->ctl_lock);
    while (!s->ld_queue && !s->ctl_stop) pthread_cond_wait(&s->ctl_cond, &s->ctl_lock);
    es_load_req *lr = s->ld_queue;
    const bool stop = s->ctl_stop;
    if (stop) s->ld_queue = s->ld_queue_last = NULL;
    else if (!(s->ld_queue = lr->next)) s->ld_queue_last = NULL;
    pthread_mutex_unlock(&s->ctl_lock);
    if (stop) {
      while (lr) {
        es_load_req *n = lr->next;
        es__rpc_reply(lr->r, GRPC_STATUS_UNAVAILABLE, "server is draining (shutting down)", NULL);
        es__load_req_free(lr);
        lr = n;
      }
      return NULL;
    }
    es__load_serve(s, lr);
  }
}

/* ---- LoadStatus, UnloadExperts (CQ thread) -------------------------------------------------- */

void es__on_load_status(es_rpc *r) {
  es_server *s = r->srv;
  mr_err e;
  mr_err_clear(&e);
  if (es__control_refused(s, r)) return;
  Moerpc__V1__LoadStatusRequest *req = NULL;
  if (r->payload && pr_decode(r->payload, &moerpc__v1__load_status_request__descriptor,
                              ES_MAX_CONTROL_REQUEST_BYTES, (ProtobufCMessage **)&req, &e)) {
    es__rpc_reply_err(r, MR_EINVAL, "LoadStatusRequest does not decode", &e);
    return;
  }
  uint64_t id = req ? req->load_id : 0;
  if (req) moerpc__v1__load_status_request__free_unpacked(req, NULL);
  Moerpc__V1__LoadProgress p = MOERPC__V1__LOAD_PROGRESS__INIT;
  char err[sizeof s->ld_error];
  pthread_mutex_lock(&s->ctl_lock);
  if (id && id != s->ld_id) {
    uint64_t latest = s->ld_id;
    pthread_mutex_unlock(&s->ctl_lock);
    char msg[160];
    snprintf(msg, sizeof msg, "load_id = %" PRIu64 ": unknown (the latest load is %" PRIu64 ")",
             id, latest);
    es__rpc_reply(r, GRPC_STATUS_NOT_FOUND, msg, NULL);
    return;
  }
  p.load_id = s->ld_id;
  p.state = (Moerpc__V1__LoadState)s->ld_state;
  p.tensors_done = atomic_load(&s->ld_tensors_done);
  p.tensors_total = s->ld_tensors_total;
  p.bytes_done = atomic_load(&s->ld_bytes_done);
  p.bytes_total = s->ld_bytes_total;
  uint64_t end = s->ld_state == MOERPC__V1__LOAD_STATE__LOAD_STATE_RUNNING ? mr_now_ns() : s->ld_t1_ns;
  p.seconds = s->ld_id ? (double)(end - s->ld_t0_ns) / 1e9 : 0;
  p.status = s->ld_status;
  snprintf(err, sizeof err, "%s", s->ld_error);
  p.error = err;
  p.owned_generation = s->tab_gen;
  pthread_mutex_unlock(&s->ctl_lock);
  grpc_byte_buffer *bb = pr_encode(&p.base);
  es__rpc_reply(r, bb ? GRPC_STATUS_OK : GRPC_STATUS_RESOURCE_EXHAUSTED, bb ? "" : "out of memory", bb);
}

/* The layers of cur that lose experts named in drop (pairs not owned are skipped), rebuilt
 * without them into changed[] (NULL for a layer that goes empty), marked in is_changed[];
 * the pairs dropped in *dropped. keep is scratch [num_experts]. ctl_lock held. */
static int es__unload_rebuild(es_server *s, const es_table *cur, const uint8_t *drop, uint8_t *keep,
                              kn_layer **changed, uint8_t *is_changed, uint64_t *dropped, mr_err *e) {
  const uint32_t L = s->cfg.num_layers, E = s->cfg.num_experts;
  for (uint32_t l = 0; l < L; l++) {
    if (!cur->owned[l]) continue;
    uint32_t n_drop = 0;
    for (uint32_t x = 0; x < E; x++) {
      bool d = drop[(size_t)l * E + x] && mr_idset_has(cur->owned[l], x);
      keep[x] = !d;
      n_drop += d;
    }
    if (!n_drop) continue;
    is_changed[l] = 1;
    *dropped += n_drop;
    if (n_drop < mr_idset_count(cur->owned[l])) {
      int rc = kn_layer_rebuild(&changed[l], cur->layers[l], keep, NULL, e);
      if (rc) return rc;
    }
    /* else: the layer goes empty (changed[l] stays NULL) */
  }
  return 0;
}

void es__on_unload(es_rpc *r) {
  char peer[96];
  Moerpc__V1__UnloadRequest *req =
      es__control_request(r, &moerpc__v1__unload_request__descriptor, "UnloadRequest", peer);
  if (!req) return;
  es_server *s = r->srv;
  const uint32_t L = s->cfg.num_layers, E = s->cfg.num_experts;
  mr_err e;
  mr_err_clear(&e);
  int rc;
  uint8_t *drop = mr_malloc((size_t)L * E), *keep = mr_malloc(E), *is_changed = mr_calloc(L, 1);
  kn_layer **changed = mr_calloc(L, sizeof *changed);
  uint64_t n_pairs = 0, dropped = 0, freed = 0, gen = 0;
  uint64_t avail = es__mem_now();
  pthread_mutex_lock(&s->ctl_lock);
  if (!drop || !keep || !is_changed || !changed) {
    rc = mr_err_set(&e, MR_ENOMEM, "out of memory");
    goto out_unlock;
  }
  rc = es_control_validate((const Moerpc__V1__LayerExperts *const *)req->drop, req->n_drop,
                           req->model_fingerprint, s->fingerprint, &s->limits, drop, &n_pairs, &e);
  if (rc) goto out_unlock;
  es_table *cur = s->tab;
  if (s->opts.unload_grace_s) {
    /* Grace: the pairs leave Hello now and are freed by es__leaving_service once no open
     * stream uses them (or the grace ends); requests for them are served meanwhile. */
    for (uint32_t l = 0; l < L; l++)
      for (uint32_t x = 0; x < E; x++) {
        size_t i = (size_t)l * E + x;
        if (drop[i] && cur->owned[l] && mr_idset_has(cur->owned[l], x) && !s->leaving[i]) {
          s->leaving[i] = 1;
          s->n_leaving++;
          dropped++;
        }
      }
    freed = dropped * s->expert_bytes;
    if (dropped) {
      s->leave_until_ns = mr_now_ns() + (uint64_t)s->opts.unload_grace_s * 1000000000u;
      s->leave_epoch++;
      if ((rc = es__tab_republish(s, avail, &e))) goto out_unlock;
    }
    gen = s->tab_gen;
    pthread_mutex_unlock(&s->ctl_lock);
    mr_log(MR_LOG_INFO, "placement: unload from %s: %" PRIu64 " of %" PRIu64 " pairs named "
           "were owned and leave Hello (owned generation %" PRIu64 "); still served until no "
           "open stream uses them, at most %" PRIu32 " s (--unload-grace), then freed (%.3f GB)",
           peer, dropped, n_pairs, gen, s->opts.unload_grace_s, freed / 1e9);
    goto out_reply;
  }
  if ((rc = es__unload_rebuild(s, cur, drop, keep, changed, is_changed, &dropped, &e)))
    goto out_unlock;
  freed = dropped * s->expert_bytes;
  if (dropped) {
    es_table *t = es__tab_derive(s, cur, changed, is_changed, avail, &e);
    if (!t) {
      rc = e.code ? e.code : MR_ENOMEM;
      goto out_unlock;
    }
    es__tab_publish(s, t);
    gen = t->gen;
  } else {
    gen = s->tab_gen;
  }
  pthread_mutex_unlock(&s->ctl_lock);
  mr_log(MR_LOG_INFO, "placement: unload from %s: %" PRIu64 " of %" PRIu64 " pairs named were "
         "owned and are dropped (%.3f GB, freed once no request uses them); owned generation %"
         PRIu64, peer, dropped, n_pairs, freed / 1e9, gen);
out_reply:;
  Moerpc__V1__UnloadReply rep = MOERPC__V1__UNLOAD_REPLY__INIT;
  rep.pairs = dropped;
  rep.bytes_freed = freed;
  rep.owned_generation = gen;
  grpc_byte_buffer *bb = pr_encode(&rep.base);
  es__rpc_reply(r, bb ? GRPC_STATUS_OK : GRPC_STATUS_RESOURCE_EXHAUSTED, bb ? "" : "out of memory", bb);
  goto out_free;
out_unlock:
  /* A rebuilt layer that was not published: its experts are cur's again (under ctl_lock:
   * no publisher runs meanwhile, so s->tab is the cur it was rebuilt from). */
  for (uint32_t l = 0; changed && l < L; l++)
    if (changed[l]) kn_layer_forget(changed[l], s->tab->layers[l]);
  pthread_mutex_unlock(&s->ctl_lock);
  mr_log_ratelimited(MR_LOG_WARN, 1, "placement: UnloadExperts from %s refused: %s", peer, e.msg);
  es__rpc_reply_err(r, rc, "UnloadExperts refused", &e);
out_free:
  mr_free(drop);
  mr_free(keep);
  mr_free(is_changed);
  mr_free(changed);
  moerpc__v1__unload_request__free_unpacked(req, NULL);
}

/* ---- the unload grace (admin thread) ----------------------------------------------------- */

void es__leaving_service(es_server *s) {
  const uint32_t L = s->cfg.num_layers, E = s->cfg.num_experts;
  const size_t pairs = (size_t)L * E, words = (pairs + 63) / 64;
  pthread_mutex_lock(&s->ctl_lock);
  if (!s->n_leaving || !s->tab) {
    pthread_mutex_unlock(&s->ctl_lock);
    return;
  }
  uint64_t epoch = s->leave_epoch;
  bool expired = mr_now_ns() >= s->leave_until_ns;
  unsigned long long *bits = expired ? NULL : mr_calloc(words, sizeof *bits);
  for (size_t i = 0; bits && i < pairs; i++)
    if (s->leaving[i]) bits[i >> 6] |= 1ull << (i & 63);
  pthread_mutex_unlock(&s->ctl_lock);
  if (!expired && !bits) return; /* out of memory: the next tick tries again */

  /* Streams first, without ctl_lock (the two are never nested): does an open stream still
   * name a leaving pair? */
  uint32_t users = 0;
  if (!expired) {
    pthread_mutex_lock(&s->streams_lock);
    for (es_stream *st = s->streams; st; st = st->next) {
      bool uses = !st->used;
      for (size_t w = 0; !uses && w < words; w++)
        uses = atomic_load_explicit(&st->used[w], memory_order_relaxed) & bits[w];
      users += uses;
    }
    pthread_mutex_unlock(&s->streams_lock);
    mr_free(bits);
    if (users) return;
  }

  uint8_t *keep = mr_malloc(E), *is_changed = mr_calloc(L, 1), *drop = mr_malloc(pairs);
  kn_layer **changed = mr_calloc(L, sizeof *changed);
  uint64_t dropped = 0, avail = es__mem_now();
  mr_err e;
  mr_err_clear(&e);
  int rc = 0;
  pthread_mutex_lock(&s->ctl_lock);
  if (!keep || !is_changed || !drop || !changed) {
    rc = mr_err_set(&e, MR_ENOMEM, "out of memory");
  } else if (s->leave_epoch == epoch) { /* else: changed meanwhile, the next tick decides */
    memcpy(drop, s->leaving, pairs);
    rc = es__unload_rebuild(s, s->tab, drop, keep, changed, is_changed, &dropped, &e);
    es_table *t = NULL;
    if (rc == 0) {
      memset(s->leaving, 0, pairs); /* before the derive: its Hello must not hide them */
      s->n_leaving = 0;
      s->leave_epoch++;
      t = es__tab_derive(s, s->tab, changed, is_changed, avail, &e);
      if (!t) rc = e.code ? e.code : MR_ENOMEM;
    }
    if (t) {
      es__tab_publish(s, t);
    } else {
      for (uint32_t l = 0; l < L; l++)
        if (changed[l]) kn_layer_forget(changed[l], s->tab->layers[l]);
      if (rc && dropped) { /* try again next tick */
        memcpy(s->leaving, drop, pairs);
        s->n_leaving = 0;
        for (size_t i = 0; i < pairs; i++) s->n_leaving += drop[i];
      }
    }
  }
  uint64_t gen = s->tab_gen;
  pthread_mutex_unlock(&s->ctl_lock);
  if (rc)
    mr_log_ratelimited(MR_LOG_ERROR, 10, "placement: freeing the leaving pairs: %s", e.msg);
  else if (dropped)
    mr_log(MR_LOG_INFO, "placement: %" PRIu64 " leaving pair%s freed (%s); owned generation %"
           PRIu64, dropped, dropped == 1 ? "" : "s",
           expired ? "the --unload-grace ended" : "no open stream uses them", gen);
  mr_free(keep);
  mr_free(is_changed);
  mr_free(drop);
  mr_free(changed);
}
