/*
 * es_grpc.c - the gRPC side of the server: set-up (methods, completion queues, port), the
 * completion-queue threads that dispatch every event, the unary calls (Hello, Stats,
 * grpc.health.v1 Check; the control calls go to es_control.c) and the teardown. The Forward
 * streams are in es_stream.c, the reply of a unary call in es_rpc.c.
 *
 * Every call is bound to the completion queue of the thread that accepted it, so all of a
 * call's events are handled by one thread and a unary call needs no lock (a LoadExperts is
 * answered by es-ctl-load, whose hand-off is under ctl_lock). A Forward stream is also
 * written to by whoever answers its jobs (replies) and the admin thread (drain), through
 * the fields under es_stream.lock (internal.h).
 *
 * A CQ thread's loop: block for the next event, except while its inline slot holds a request
 * (es_inline.c): then poll, and when a poll finds nothing the round is over and the slot
 * runs. The only way up is the admin doorbell, rung on the shutdown notification.
 */
#define _GNU_SOURCE /* pthread_setname_np */
#include <grpc/grpc_security.h>
#include <grpc/support/time.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "expert_server/internal.h"

/* request_call contexts kept posted per method and per completion queue, so that a burst of
 * new calls does not wait for the CQ thread to re-post one. */
#define ES_PREPOST_UNARY 4
#define ES_PREPOST_STREAM 8
/* The service names the health check answers for. Readiness: "" (the whole server) and
 * ES_HEALTH_SERVICE, SERVING once every owned expert is loaded and until a drain begins.
 * Liveness: ES_HEALTH_LIVENESS, SERVING whenever the process answers at all (loading,
 * serving, draining). */
#define ES_HEALTH_SERVICE "moerpc.v1.ExpertService"
#define ES_HEALTH_LIVENESS "moerpc.v1.Liveness"

/* ---- set-up ------------------------------------------------------------------------------ */

int es__grpc_create(es_server *s, mr_err *e) {
  grpc_init();
  s->grpc_inited = true;
  s->t_shutdown = (es_tag){ES_TAG_SHUTDOWN, s}; /* before any failure: teardown waits for it */

  grpc_arg args[PR_SERVER_ARGS + 8];
  size_t nargs = pr_server_args(args, s->max_message_bytes);
  /* gRPC sets SO_REUSEPORT by default, so a second server on a busy port would start and
   * share the connections with the first, although it owns other experts. Refuse instead. */
  args[nargs].type = GRPC_ARG_INTEGER;
  args[nargs].key = (char *)GRPC_ARG_ALLOW_REUSEPORT;
  args[nargs].value.integer = 0;
  nargs++;
  /* Per connection, room for every Forward stream the server allows plus the control calls:
   * a client that multiplexes its streams on one connection (grpcio shares one among its
   * channels) still gets Hello, health and the control calls through while its Forward
   * streams are held back. The server-wide cap is max_streams (es_stream.c), which refuses
   * the streams past it at once. */
  uint32_t cap = s->opts.max_streams ? s->opts.max_streams : ES_AUTO_STREAMS_MAX;
  args[nargs].type = GRPC_ARG_INTEGER;
  args[nargs].key = (char *)GRPC_ARG_MAX_CONCURRENT_STREAMS;
  args[nargs].value.integer = (int)(cap + ES_CONTROL_CALLS_PER_CONNECTION);
  nargs++;
  /* A stream is held back by not arming its RECV; then gRPC reads ahead only as far as the
   * stream's HTTP/2 window. With BDP probing that window grows to what the link carries
   * (megabytes on loopback, per stream: measured 50 greedy streams at 1.4-2.3 GB over a
   * 537 MB budget); off, it is the fixed lookahead, stream_window, sized from the budget,
   * which sets it aside for every stream --max-streams allows (es__streams_size). The connection's window follows the sum of its
   * streams', so one stream held back does not close it for the others. */
  args[nargs].type = GRPC_ARG_INTEGER;
  args[nargs].key = (char *)GRPC_ARG_HTTP2_BDP_PROBE;
  args[nargs].value.integer = 0;
  nargs++;
  args[nargs].type = GRPC_ARG_INTEGER;
  args[nargs].key = (char *)GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES;
  args[nargs].value.integer = (int)s->stream_window;
  nargs++;
  /* gRPC grows its reads of a fast connection to megabytes and hands the frames on as
   * pieces of those buffers: a stream held back with a few KB of its next message keeps the whole buffer
   * alive. Smaller reads bound what a held-back stream pins to its window plus one read
   * (measured, 256 greedy streams: peak RSS -80..-200 MB). */
  args[nargs].type = GRPC_ARG_INTEGER;
  args[nargs].key = (char *)GRPC_ARG_TCP_MAX_READ_CHUNK_SIZE;
  args[nargs].value.integer = (int)ES_TCP_READ_CHUNK;
  nargs++;
  grpc_channel_args ca = {.num_args = nargs, .args = args};
  s->gs = grpc_server_create(&ca, NULL);
  if (!s->gs) return mr_err_set(e, MR_EINTERNAL, "grpc_server_create failed");
  for (int m = 0; m < ES_M_COUNT; m++) {
    grpc_server_register_method_payload_handling ph =
        m == ES_M_FORWARD ? GRPC_SRM_PAYLOAD_NONE : GRPC_SRM_PAYLOAD_READ_INITIAL_BYTE_BUFFER;
    s->rm[m] = grpc_server_register_method(s->gs, es__method_path(m), NULL, ph, 0);
    if (!s->rm[m])
      return mr_err_set(e, MR_EINTERNAL, "grpc_server_register_method(%s) failed", es__method_path(m));
  }
  s->n_cq_threads = s->opts.grpc_threads;
  s->cq_threads = mr_calloc(s->n_cq_threads, sizeof *s->cq_threads);
  if (!s->cq_threads) return mr_err_set(e, MR_ENOMEM, "out of memory for %u gRPC threads", s->n_cq_threads);
  for (uint32_t i = 0; i < s->n_cq_threads; i++) {
    s->cq_threads[i].srv = s;
    s->cq_threads[i].idx = i;
    s->cq_threads[i].cq = grpc_completion_queue_create_for_next(NULL);
    if (!s->cq_threads[i].cq) return mr_err_set(e, MR_EINTERNAL, "grpc_completion_queue_create failed");
    grpc_server_register_completion_queue(s->gs, s->cq_threads[i].cq, NULL);
  }
  grpc_server_credentials *creds = es__auth_server_creds(s);
  if (!creds)
    return mr_err_set(e, MR_EINVAL, "--tls-cert / --tls-key / --tls-client-ca: gRPC refused the "
                      "TLS credentials (see its log line above)");
  s->port = grpc_server_add_http2_port(s->gs, s->listen, creds);
  grpc_server_credentials_release(creds);
  if (s->port <= 0)
    return mr_err_set(e, MR_EUNAVAIL,
                      "--listen %s: cannot listen there (address in use, not an address of this "
                      "host, or not HOST:PORT%s)",
                      s->listen, s->tls_on ? "; or a --tls-cert / --tls-key gRPC cannot use" : "");
  return 0;
}

/* ---- unary calls ---------------------------------------------------------------------------- */

/* Posts one request_call for unary method m on t's queue. */
static void es__rpc_post(es_server *s, es_cq_thread *t, es_method m) {
  es_rpc *r = mr_calloc(1, sizeof *r);
  if (!r) {
    mr_log(MR_LOG_ERROR, "grpc: out of memory posting a %s call", es__method_path(m));
    return;
  }
  r->srv = s;
  r->cq_thread = t;
  r->m = m;
  r->details = grpc_empty_slice();
  grpc_metadata_array_init(&r->md);
  r->t_new = (es_tag){ES_TAG_RPC_NEW, r};
  r->t_done = (es_tag){ES_TAG_RPC_DONE, r};
  grpc_call_error ce = grpc_server_request_registered_call(s->gs, s->rm[m], &r->call, &r->deadline,
                                                           &r->md, &r->payload, t->cq, t->cq, &r->t_new);
  if (ce != GRPC_CALL_OK) {
    if (!atomic_load(&s->stop_reposting))
      mr_log(MR_LOG_ERROR, "grpc: request_registered_call(%s) failed: %d", es__method_path(m), ce);
    es__rpc_free(r);
  }
}

static void es__on_hello(es_rpc *r) {
  es_server *s = r->srv;
  mr_err e;
  char msg[600], peer[96];
  mr_err_clear(&e);
  Moerpc__V1__HelloRequest *req = NULL;
  if (r->payload) {
    int rc = pr_decode(r->payload, &moerpc__v1__hello_request__descriptor,
                       ES_MAX_CONTROL_REQUEST_BYTES, (ProtobufCMessage **)&req, &e);
    if (rc) {
      snprintf(msg, sizeof msg, "HelloRequest does not decode: %s", e.msg);
      es__rpc_reply(r, GRPC_STATUS_INVALID_ARGUMENT, msg, NULL);
      return;
    }
  }
  uint32_t major = req ? req->protocol_major : 0, minor = req ? req->protocol_minor : 0;
  es__call_peer(r->call, peer, sizeof peer);
  if (atomic_load(&s->draining)) {
    es__rpc_reply(r, GRPC_STATUS_UNAVAILABLE, "server is draining (shutting down)", NULL);
  } else if (!atomic_load_explicit(&s->loaded, memory_order_acquire)) {
    es__loading_msg(s, msg, sizeof msg);
    es__rpc_reply(r, GRPC_STATUS_UNAVAILABLE, msg, NULL);
  } else if (major != PR_PROTOCOL_MAJOR) {
    snprintf(msg, sizeof msg,
             "protocol_major = %" PRIu32 " (client protocol %" PRIu32 ".%" PRIu32
             "), but this server speaks protocol %d.%d: protocol_major must be %d",
             major, major, minor, PR_PROTOCOL_MAJOR, PR_PROTOCOL_MINOR, PR_PROTOCOL_MAJOR);
    mr_log_ratelimited(MR_LOG_WARN, 5, "hello from %s: %s", peer, msg);
    es__rpc_reply(r, GRPC_STATUS_FAILED_PRECONDITION, msg, NULL);
  } else {
    /* The name as sent, not protobuf-c's NUL-terminated copy (a NUL would cut the line
     * there and hide the rest): escaped, NUL and control bytes as \xNN, and cut. Reading
     * more than MR_LOG_ESC_MAX bytes is never needed: they escape to more than fits. */
    char raw[MR_LOG_ESC_MAX], name[MR_LOG_ESC_MAX];
    size_t raw_len = 0;
    const char *cn = raw;
    if (pr_hello_client_name(r->payload, raw, sizeof raw, &raw_len, &e) != 0) {
      /* Framing protobuf-c took leniently (a field number 0): its copy, to the NUL. */
      cn = req->client_name ? req->client_name : "";
      raw_len = strlen(cn);
    }
    mr_log_escape(name, sizeof name, cn, raw_len < sizeof raw ? raw_len : sizeof raw);
    mr_log_ratelimited(MR_LOG_INFO, 5, "hello from %s: client \"%s\", protocol %" PRIu32
                       ".%" PRIu32, peer, name, major, minor);
    es_table *t = es__tab_get(s); /* not NULL once loaded */
    es__hello_seen(s, name, t->gen);
    es__rpc_reply(r, GRPC_STATUS_OK, "", grpc_raw_byte_buffer_create(&t->hello, 1));
    es__tab_put(t);
  }
  if (req) protobuf_c_message_free_unpacked(&req->base, NULL);
}

void es__hello_seen(es_server *s, const char *name, uint64_t gen) {
  char cut[PR_CLIENT_NAME_MAX + 1];
  snprintf(cut, sizeof cut, "%s", name);
  pthread_mutex_lock(&s->hello_lock);
  const uint32_t cap = sizeof s->hello_seen / sizeof s->hello_seen[0];
  uint32_t n = s->n_hello_seen < cap ? s->n_hello_seen : cap, slot = 0;
  uint64_t oldest = UINT64_MAX;
  for (uint32_t i = 0; i < n; i++) {
    if (strcmp(s->hello_seen[i].name, cut) == 0) {
      oldest = 0;
      slot = i;
      break;
    }
    if (s->hello_seen[i].t_ns < oldest) {
      oldest = s->hello_seen[i].t_ns;
      slot = i;
    }
  }
  if (oldest && n < cap) slot = s->n_hello_seen++; /* a new name while there is room */
  snprintf(s->hello_seen[slot].name, sizeof s->hello_seen[slot].name, "%s", cut);
  s->hello_seen[slot].gen = gen;
  s->hello_seen[slot].t_ns = mr_now_ns();
  pthread_mutex_unlock(&s->hello_lock);
}

/* StatsReply.clients (protocol 1.4): one entry per (client name, peer) of the open Forward
 * streams, at most ES_STATS_MAX_CLIENTS, with the latest Hello of that name. Out of memory
 * leaves the list empty. Takes streams_lock, then hello_lock (never nested). */
#define ES_STATS_MAX_CLIENTS 4096u
static void es__clients_fill(es_server *s, Moerpc__V1__StatsReply *rep) {
  Moerpc__V1__ClientInfo *items = NULL;
  uint32_t n = 0, cap = 0;
  pthread_mutex_lock(&s->streams_lock);
  for (es_stream *st = s->streams; st; st = st->next) {
    if (!st->listed) continue; /* refused streams are no clients */
    uint32_t i = 0;
    while (i < n && !(strcmp(items[i].client_name, st->client) == 0 &&
                      strcmp(items[i].peer, st->peer) == 0))
      i++;
    if (i < n) {
      items[i].streams++;
      continue;
    }
    if (n == ES_STATS_MAX_CLIENTS) continue;
    if (n == cap) {
      uint32_t nc = cap ? 2 * cap : 16;
      Moerpc__V1__ClientInfo *g = mr_realloc(items, nc * sizeof *g);
      if (!g) break;
      items = g;
      cap = nc;
    }
    Moerpc__V1__ClientInfo init = MOERPC__V1__CLIENT_INFO__INIT;
    items[n] = init;
    items[n].client_name = mr_strdup(st->client);
    items[n].peer = mr_strdup(st->peer);
    items[n].streams = 1;
    if (!items[n].client_name || !items[n].peer) {
      mr_free(items[n].client_name);
      mr_free(items[n].peer);
      break;
    }
    n++;
  }
  pthread_mutex_unlock(&s->streams_lock);
  const uint64_t now = mr_now_ns();
  pthread_mutex_lock(&s->hello_lock);
  for (uint32_t i = 0; i < n; i++)
    for (uint32_t j = 0; j < s->n_hello_seen && j < 64; j++)
      if (items[i].client_name[0] && strcmp(s->hello_seen[j].name, items[i].client_name) == 0) {
        items[i].hello_generation = s->hello_seen[j].gen;
        items[i].hello_age_ms = (now - s->hello_seen[j].t_ns) / 1000000u;
      }
  pthread_mutex_unlock(&s->hello_lock);
  Moerpc__V1__ClientInfo **ptrs = n ? mr_calloc(n, sizeof *ptrs) : NULL;
  if (n && !ptrs) {
    for (uint32_t i = 0; i < n; i++) {
      mr_free(items[i].client_name);
      mr_free(items[i].peer);
    }
    n = 0;
  }
  for (uint32_t i = 0; i < n; i++) ptrs[i] = &items[i];
  if (!n) mr_free(items);
  rep->clients = ptrs;
  rep->n_clients = n;
}

/* Frees what es__clients_fill allocated. */
static void es__clients_free(Moerpc__V1__StatsReply *rep) {
  for (size_t i = 0; i < rep->n_clients; i++) {
    mr_free(rep->clients[i]->client_name);
    mr_free(rep->clients[i]->peer);
  }
  if (rep->n_clients) mr_free(rep->clients[0]); /* the items array */
  mr_free(rep->clients);
  rep->clients = NULL;
  rep->n_clients = 0;
}

static void es__on_stats(es_rpc *r) {
  es_server *s = r->srv;
  mr_err e;
  char msg[600];
  mr_err_clear(&e);
  Moerpc__V1__StatsRequest *req = NULL;
  if (r->payload) {
    int rc = pr_decode(r->payload, &moerpc__v1__stats_request__descriptor,
                       ES_MAX_CONTROL_REQUEST_BYTES, (ProtobufCMessage **)&req, &e);
    if (rc) {
      snprintf(msg, sizeof msg, "StatsRequest does not decode: %s", e.msg);
      es__rpc_reply(r, GRPC_STATUS_INVALID_ARGUMENT, msg, NULL);
      return;
    }
  }
  bool reset = req && req->reset;
  if (req) protobuf_c_message_free_unpacked(&req->base, NULL);
  if (!atomic_load_explicit(&s->loaded, memory_order_acquire)) {
    es__loading_msg(s, msg, sizeof msg);
    es__rpc_reply(r, GRPC_STATUS_UNAVAILABLE, msg, NULL);
    return;
  }
  if (reset) {
    char peer[96];
    es__call_peer(r->call, peer, sizeof peer);
    mr_log_ratelimited(MR_LOG_INFO, 5, "stats reset by %s", peer);
  }

  uint32_t E = s->cfg.num_experts;
  es_table *tab = es__tab_get(s);
  size_t cap = tab->pairs;
  Moerpc__V1__ExpertCount *items = mr_calloc(cap ? cap : 1, sizeof *items);
  Moerpc__V1__ExpertCount **ptrs = mr_calloc(cap ? cap : 1, sizeof *ptrs);
  if (!items || !ptrs) {
    mr_free(items);
    mr_free(ptrs);
    es__tab_put(tab);
    es__rpc_reply(r, GRPC_STATUS_RESOURCE_EXHAUSTED, "server out of memory for StatsReply", NULL);
    return;
  }
  /* Each counter is read and zeroed in one atomic exchange, so tokens counted concurrently
   * land either in this reply or in the next one, never in neither. */
  size_t n = 0;
  for (uint32_t l = 0; l < s->cfg.num_layers; l++) {
    if (!tab->owned[l]) continue;
    for (uint32_t x = 0; x < E; x++) {
      if (!mr_idset_has(tab->owned[l], x)) continue;
      atomic_ullong *c = &s->tokens[(size_t)l * E + x];
      uint64_t v = reset ? atomic_exchange(c, 0) : atomic_load(c);
      if (!v) continue;
      Moerpc__V1__ExpertCount init = MOERPC__V1__EXPERT_COUNT__INIT;
      items[n] = init;
      items[n].layer = l;
      items[n].expert = x;
      items[n].tokens = v;
      ptrs[n] = &items[n];
      n++;
    }
  }
  Moerpc__V1__StatsReply rep = MOERPC__V1__STATS_REPLY__INIT;
  rep.n_counts = n;
  rep.counts = ptrs;
  rep.requests = reset ? atomic_exchange(&s->n_requests, 0) : atomic_load(&s->n_requests);
  rep.errors = reset ? atomic_exchange(&s->n_errors, 0) : atomic_load(&s->n_errors);
  rep.expired = reset ? atomic_exchange(&s->n_expired, 0) : atomic_load(&s->n_expired);
  rep.dropped = reset ? atomic_exchange(&s->n_dropped, 0) : atomic_load(&s->n_dropped);
  rep.refused = reset ? atomic_exchange(&s->n_refused, 0) : atomic_load(&s->n_refused);
  long long held = atomic_load(&s->held_bytes);
  rep.held_bytes = held > 0 ? (uint64_t)held : 0;
  long long peak = reset ? atomic_exchange(&s->held_peak, held) : atomic_load(&s->held_peak);
  rep.held_bytes_peak = peak > 0 ? (uint64_t)peak : 0;
  rep.max_inflight_bytes = s->max_inflight_bytes;
  es__clients_fill(s, &rep);
  grpc_byte_buffer *bb = pr_encode(&rep.base);
  es__clients_free(&rep);
  mr_free(items);
  mr_free(ptrs);
  es__tab_put(tab);
  if (!bb)
    es__rpc_reply(r, GRPC_STATUS_RESOURCE_EXHAUSTED, "server out of memory for StatsReply", NULL);
  else
    es__rpc_reply(r, GRPC_STATUS_OK, "", bb);
}

static void es__on_health(es_rpc *r) {
  es_server *s = r->srv;
  mr_err e;
  char svc[256], msg[600];
  mr_err_clear(&e);
  svc[0] = '\0';
  if (r->payload && pr_health_request_decode(r->payload, svc, sizeof svc, &e) != 0) {
    es__rpc_reply(r, GRPC_STATUS_INVALID_ARGUMENT, e.msg, NULL);
    return;
  }
  bool live = strcmp(svc, ES_HEALTH_LIVENESS) == 0;
  if (svc[0] && !live && strcmp(svc, ES_HEALTH_SERVICE) != 0) {
    snprintf(msg, sizeof msg,
             "unknown service \"%s\": this server answers for \"\" and \"%s\" (readiness) and "
             "\"%s\" (liveness)",
             svc, ES_HEALTH_SERVICE, ES_HEALTH_LIVENESS);
    es__rpc_reply(r, GRPC_STATUS_NOT_FOUND, msg, NULL);
    return;
  }
  int st = live || atomic_load(&s->serving) ? PR_HEALTH_SERVING : PR_HEALTH_NOT_SERVING;
  grpc_byte_buffer *bb = pr_health_response_encode(st);
  if (!bb)
    es__rpc_reply(r, GRPC_STATUS_RESOURCE_EXHAUSTED, "server out of memory", NULL);
  else
    es__rpc_reply(r, GRPC_STATUS_OK, "", bb);
}

static void es__on_rpc_new(es_rpc *r, bool ok) {
  es_server *s = r->srv;
  if (!ok) { /* the server is shutting down: the request_call was cancelled */
    es__rpc_free(r);
    return;
  }
  if (!atomic_load(&s->stop_reposting)) es__rpc_post(s, r->cq_thread, r->m);
  atomic_fetch_add(&s->live_calls, 1);
  bool control = r->m == ES_M_LOAD || r->m == ES_M_LOAD_STATUS || r->m == ES_M_UNLOAD;
  if (control && !s->auth_on) {
    /* Changing what a server holds needs a credential: no token configured, no control. */
    es__rpc_reply(r, GRPC_STATUS_PERMISSION_DENIED,
                  "control RPCs (LoadExperts, LoadStatus, UnloadExperts) are disabled: start the "
                  "server with --auth-token-file to allow them", NULL);
    return;
  }
  if (r->m != ES_M_HEALTH) {
    char peer[96];
    es__call_peer(r->call, peer, sizeof peer);
    if (!es__auth_ok(s, &r->md, peer, es__method_name(r->m))) {
      es__rpc_reply(r, GRPC_STATUS_UNAUTHENTICATED, ES_AUTH_REFUSED_MSG, NULL);
      return;
    }
  }
  switch (r->m) {
  case ES_M_HELLO: es__on_hello(r); break;
  case ES_M_STATS: es__on_stats(r); break;
  case ES_M_HEALTH: es__on_health(r); break;
  case ES_M_LOAD: es__on_load(r); break;
  case ES_M_LOAD_STATUS: es__on_load_status(r); break;
  case ES_M_UNLOAD: es__on_unload(r); break;
  default: MR_ASSERT(!"unary method");
  }
}

/* ---- completion-queue threads ------------------------------------------------------------- */

static void *es__cq_main(void *arg) {
  es_cq_thread *t = arg;
  es_server *s = t->srv;
  char name[16];
  snprintf(name, sizeof name, "es-grpc-%u", t->idx);
  pthread_setname_np(pthread_self(), name);
  for (int m = 0; m < ES_M_COUNT; m++) {
    if (m == ES_M_FORWARD)
      for (int k = 0; k < ES_PREPOST_STREAM; k++) es__stream_post(s, t);
    else
      for (int k = 0; k < ES_PREPOST_UNARY; k++) es__rpc_post(s, t, (es_method)m);
  }
  for (;;) {
    /* With a small request held in the inline slot, look for more events without blocking
     * first: the queue running dry is what lets the request run inline (es_inline.c). */
    gpr_timespec until = es__inline_held(t) ? gpr_inf_past(GPR_CLOCK_MONOTONIC)
                                            : gpr_inf_future(GPR_CLOCK_MONOTONIC);
    grpc_event ev = grpc_completion_queue_next(t->cq, until, NULL);
    if (ev.type != GRPC_OP_COMPLETE) es__inline_run(t);
    if (ev.type == GRPC_QUEUE_SHUTDOWN) break;
    if (ev.type != GRPC_OP_COMPLETE) continue;
    es_tag *tag = ev.tag;
    bool ok = ev.success != 0;
    switch (tag->kind) {
    case ES_TAG_RPC_NEW: es__on_rpc_new(tag->obj, ok); break;
    case ES_TAG_RPC_DONE: {
      es_rpc *r = tag->obj;
      PR_HB_ACQUIRE(r); /* its reply may have been started by es-ctl-load (es_rpc.c) */
      es__rpc_free(r);
      es__counter_dec(s, &s->live_calls);
      break;
    }
    case ES_TAG_STREAM_NEW: es__on_stream_new(tag->obj, ok); break;
    case ES_TAG_STREAM_RECV: es__on_stream_recv(tag->obj, ok); break;
    case ES_TAG_STREAM_SEND: es__on_stream_send(tag->obj, ok); break;
    case ES_TAG_STREAM_FINAL: es__on_stream_final(tag->obj, ok); break;
    case ES_TAG_STREAM_CLOSE: es__on_stream_close(tag->obj, ok); break;
    case ES_TAG_STREAM_INIT: es__on_stream_init(tag->obj, ok); break;
    case ES_TAG_SHUTDOWN:
      atomic_store(&s->shutdown_notified, true);
      es__admin_wake(s);
      break;
    default: MR_ASSERT(!"unknown tag kind");
    }
  }
  return NULL;
}

int es__grpc_start(es_server *s, mr_err *e) {
  grpc_server_start(s->gs);
  for (uint32_t i = 0; i < s->n_cq_threads; i++) {
    int err = pthread_create(&s->cq_threads[i].thread, NULL, es__cq_main, &s->cq_threads[i]);
    if (err) return mr_err_set(e, MR_EINTERNAL, "cannot start gRPC thread %u: error %d", i, err);
    s->cq_threads[i].started = true;
  }
  return 0;
}

/* Waits on a queue whose thread never started until the shutdown tag arrives (or the queue
 * ends), freeing any call context that comes back. */
static void es__cq_drain_unthreaded(es_server *s, grpc_completion_queue *cq, bool until_shutdown_tag) {
  for (;;) {
    grpc_event ev = grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL);
    if (ev.type == GRPC_QUEUE_SHUTDOWN) return;
    if (ev.type != GRPC_OP_COMPLETE) continue;
    es_tag *tag = ev.tag;
    if (tag->kind == ES_TAG_SHUTDOWN) {
      atomic_store(&s->shutdown_notified, true);
      if (until_shutdown_tag) return;
    } else if (tag->kind == ES_TAG_RPC_NEW) {
      es__rpc_free(tag->obj);
    } else if (tag->kind == ES_TAG_STREAM_NEW) {
      es__stream_free(tag->obj);
    }
  }
}

void es__grpc_shutdown_begin(es_server *s) {
  if (!s->gs || s->shutdown_called) return;
  atomic_store(&s->stop_reposting, true);
  s->shutdown_called = true;
  grpc_server_shutdown_and_notify(s->gs, s->cq_threads[0].cq, &s->t_shutdown);
}

void es__grpc_destroy(es_server *s) {
  if (s->gs) {
    if (!atomic_load(&s->shutdown_notified)) {
      es__grpc_shutdown_begin(s);
      grpc_server_cancel_all_calls(s->gs);
      if (!s->cq_threads[0].started) es__cq_drain_unthreaded(s, s->cq_threads[0].cq, true);
      /* With the threads running, they see the notification; the calls were cancelled, so it
       * comes as soon as their last batches complete. */
      while (!atomic_load(&s->shutdown_notified)) usleep(1000);
    }
    for (uint32_t i = 0; i < s->n_cq_threads; i++) grpc_completion_queue_shutdown(s->cq_threads[i].cq);
    for (uint32_t i = 0; i < s->n_cq_threads; i++) {
      if (s->cq_threads[i].started) {
        pthread_join(s->cq_threads[i].thread, NULL);
        s->cq_threads[i].started = false;
      } else {
        es__cq_drain_unthreaded(s, s->cq_threads[i].cq, false);
      }
    }
    grpc_server_destroy(s->gs);
    s->gs = NULL;
  }

  if (s->cq_threads) {
    for (uint32_t i = 0; i < s->n_cq_threads; i++)
      if (s->cq_threads[i].cq) grpc_completion_queue_destroy(s->cq_threads[i].cq);
    mr_free(s->cq_threads);
    s->cq_threads = NULL;
  }
}
