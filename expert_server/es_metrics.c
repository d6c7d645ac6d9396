/*
 * es_metrics.c - the server's /metrics (--metrics-listen): Prometheus text exposition 0.0.4
 * through the shared responder of common/http.c. The list of metrics, their types and
 * labels is in docs/DESIGN.md 3.8; this file is the one place that writes them.
 *
 * es__metrics_render runs on the responder thread. It reads counters (relaxed atomics),
 * the histograms (mr_hist, lock-free), q_len under q_lock and n_streams under
 * streams_lock, one lock at a time and never with another held, so it cannot take part in
 * a lock-order cycle (internal.h). Whatever loading writes (weight_bytes,
 * n_experts_loaded, max_inflight_bytes) is read only after srv->loaded (acquire).
 */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "expert_server/internal.h"

#define ES_VERSION "0.1.0"

/* VmRSS of this process in bytes, 0 if /proc/self/status cannot be read. */
/* Layers with per-layer series: those served at start-up and any served since. */
static bool es__layer_labelled(es_server *s, uint32_t l) {
  if (mr_idset_has(&s->owned_layers, l)) return true;
  return atomic_load_explicit(&s->loaded, memory_order_acquire) && s->layer_served &&
         atomic_load(&s->layer_served[l]);
}

static uint64_t es__rss_bytes(void) {
  FILE *f = fopen("/proc/self/status", "r");
  if (!f) return 0;
  char line[256];
  unsigned long long kb = 0;
  while (fgets(line, sizeof line, f))
    if (sscanf(line, "VmRSS: %llu kB", &kb) == 1) break;
  fclose(f);
  return (uint64_t)kb * 1024u;
}

static void es__counter(mr_buf *p, const char *name, const char *help, uint64_t v) {
  mr_prom_family(p, name, MR_PROM_COUNTER, help);
  mr_prom_u64(p, name, NULL, v);
}

static void es__gauge(mr_buf *p, const char *name, const char *help, double v) {
  mr_prom_family(p, name, MR_PROM_GAUGE, help);
  mr_prom_double(p, name, NULL, v);
}

static void es__metrics_render(void *ud, mr_buf *p) {
  es_server *s = ud;
  bool loaded = atomic_load_explicit(&s->loaded, memory_order_acquire);
  bool draining = atomic_load(&s->draining);
  const char *state = draining ? "draining" : loaded ? "serving" : "loading";

  mr_prom_family(p, "moerpc_build_info", MR_PROM_GAUGE,
                 "Always 1; the labels say what runs: version, weight format, wire protocol, "
                 "model fingerprint.");
  char proto[32];
  snprintf(proto, sizeof proto, "%d.%d", PR_PROTOCOL_MAJOR, PR_PROTOCOL_MINOR);
  const char *bl[] = {"version", ES_VERSION, "weight_format", s->weight_format, "protocol", proto,
                      "model_fingerprint", s->fingerprint, NULL};
  mr_prom_u64(p, "moerpc_build_info", bl, 1);

  mr_host_render(p); /* moerpc_host_advice, moerpc_host_info */

  mr_prom_family(p, "moerpc_server_state", MR_PROM_GAUGE,
                 "1 for the state the server is in (loading, serving, draining), 0 for the others.");
  static const char *const states[] = {"loading", "serving", "draining"};
  for (int i = 0; i < 3; i++) {
    const char *l[] = {"state", states[i], NULL};
    mr_prom_u64(p, "moerpc_server_state", l, strcmp(state, states[i]) == 0);
  }
  es__gauge(p, "moerpc_ready", "Readiness: 1 when every owned expert is loaded and no drain began.",
            atomic_load(&s->serving) ? 1 : 0);
  es__gauge(p, "moerpc_load_owned_tensors", "Weight tensors the start-up load packs (gate, up, "
            "down: 3 per owned expert; FP8 block scales not counted).",
            (double)s->load_tensors_total);
  es__gauge(p, "moerpc_load_loaded_tensors", "Weight tensors the start-up load has packed so far.",
            (double)atomic_load(&s->load_tensors_done));
  es__gauge(p, "moerpc_load_owned_bytes", "Bytes of those tensors as stored in the model files "
            "(FP8 block scales not counted).", (double)s->load_bytes_total);
  es__gauge(p, "moerpc_load_loaded_bytes", "Bytes of those tensors packed so far.",
            (double)atomic_load(&s->load_bytes_done));
  es__gauge(p, "moerpc_loaded_experts", "Experts (layer, expert pairs) loaded and served.",
            loaded ? (double)atomic_load(&s->cur_pairs) : 0);
  es__gauge(p, "moerpc_weight_bytes", "Bytes of packed expert weights held.",
            loaded ? (double)atomic_load(&s->cur_weight_bytes) : 0);
  es__gauge(p, "moerpc_owned_generation", "Generation of the owned set (1 at start-up, +1 per "
            "LoadExperts or UnloadExperts that changed it).", loaded ? (double)atomic_load(&s->cur_gen) : 0);

  es__counter(p, "moerpc_requests_total", "ForwardRequests received (decoded or not; during a "
              "drain too).", atomic_load(&s->tot_requests));
  mr_prom_family(p, "moerpc_errors_total", MR_PROM_COUNTER,
                 "ForwardRequests answered with an error reply, by its gRPC status (stream and "
                 "unary call statuses are not counted).");
  for (uint32_t st = 1; st < ES_N_STATUS; st++) {
    const char *l[] = {"status", pr_status_name((grpc_status_code)st), NULL};
    mr_prom_u64(p, "moerpc_errors_total", l, atomic_load(&s->err_by_status[st]));
  }
  es__counter(p, "moerpc_expired_total", "Requests not computed: past their budget_us in the queue "
              "(answered DEADLINE_EXCEEDED).", atomic_load(&s->tot_expired));
  es__counter(p, "moerpc_dropped_total", "Queued requests not computed because their stream was "
              "cancelled, broke or was cut.", atomic_load(&s->tot_dropped));
  es__counter(p, "moerpc_refused_total", "Forward streams refused at accept over --max-streams.",
              atomic_load(&s->tot_refused));
  es__counter(p, "moerpc_stall_cuts_total", "Forward streams cut because their client took no reply "
              "for --stall-timeout-ms.", atomic_load(&s->tot_stall_cuts));
  es__counter(p, "moerpc_computed_requests_total", "Requests run by the engine (one whose output "
              "overflowed is then answered INTERNAL).", atomic_load(&s->n_computed));
  es__counter(p, "moerpc_batches_total", "Engine runs (batches of merged requests).",
              atomic_load(&s->n_batches));
  es__counter(p, "moerpc_received_bytes_total", "Bytes of ForwardRequest messages received.",
              atomic_load(&s->bytes_in));
  es__counter(p, "moerpc_sent_bytes_total", "Bytes of ForwardReply messages whose send completed.",
              atomic_load(&s->bytes_out));

  uint64_t tok = 0;
  for (uint32_t l = 0; l < s->cfg.num_layers; l++) tok += atomic_load(&s->layer_tokens[l]);
  es__counter(p, "moerpc_tokens_total", "Tokens computed (rows of requests the engine ran), all "
              "layers.", tok);
  char lid[16];
  mr_prom_family(p, "moerpc_layer_tokens_total", MR_PROM_COUNTER, "Tokens computed, by layer.");
  for (uint32_t l = 0; l < s->cfg.num_layers; l++) {
    if (!es__layer_labelled(s, l)) continue;
    snprintf(lid, sizeof lid, "%" PRIu32, l);
    const char *ll[] = {"layer", lid, NULL};
    mr_prom_u64(p, "moerpc_layer_tokens_total", ll, atomic_load(&s->layer_tokens[l]));
  }
  mr_prom_family(p, "moerpc_layer_compute_seconds", MR_PROM_HISTOGRAM,
                 "Engine time of each computed request (that of its batch), by layer.");
  for (uint32_t l = 0; l < s->cfg.num_layers; l++) {
    if (!es__layer_labelled(s, l)) continue;
    snprintf(lid, sizeof lid, "%" PRIu32, l);
    const char *ll[] = {"layer", lid, NULL};
    mr_prom_hist(p, "moerpc_layer_compute_seconds", ll, &s->layer_hist[l]);
  }
  mr_prom_family(p, "moerpc_queue_seconds", MR_PROM_HISTOGRAM,
                 "Time a computed request waited between validation and its batch's start.");
  mr_prom_hist(p, "moerpc_queue_seconds", NULL, &s->queue_hist);

  pthread_mutex_lock(&s->q_lock);
  uint32_t qlen = s->q_len;
  pthread_mutex_unlock(&s->q_lock);
  es__gauge(p, "moerpc_compute_queue_depth", "Requests waiting in the compute queue.", qlen);
  pthread_mutex_lock(&s->streams_lock);
  uint32_t nst = s->n_streams;
  pthread_mutex_unlock(&s->streams_lock);
  es__gauge(p, "moerpc_open_streams", "Forward streams open (counted against --max-streams).", nst);
  es__gauge(p, "moerpc_open_calls", "gRPC calls open (streams and unary).",
            (double)atomic_load(&s->live_calls));
  es__gauge(p, "moerpc_inflight_requests", "Requests accepted whose reply has not been sent yet.",
            (double)atomic_load(&s->inflight));
  long long held = atomic_load(&s->held_bytes);
  es__gauge(p, "moerpc_held_bytes", "Bytes held for requests and replies not yet sent.",
            held > 0 ? (double)held : 0);
  es__gauge(p, "moerpc_inflight_budget_bytes", "The admission budget (--max-inflight-bytes or auto).",
            loaded ? (double)s->max_inflight_bytes : (double)s->opts.max_inflight_bytes);
  es__gauge(p, "moerpc_paused_streams", "Streams waiting for room in the byte budget.",
            atomic_load(&s->mem_paused));

  es__gauge(p, "process_resident_memory_bytes", "Resident memory size in bytes.",
            (double)es__rss_bytes());
  es__gauge(p, "process_start_time_seconds", "Start time of the process since unix epoch in seconds.",
            s->start_time_s);
}

/* /healthz: the process answers (as gRPC's moerpc.v1.Liveness); /readyz: every owned
 * expert loaded and no drain (as "" and moerpc.v1.ExpertService). */
static bool es__metrics_probe(void *ud, bool ready) {
  es_server *s = ud;
  return !ready || atomic_load(&s->serving);
}

/* True for 127.0.0.0/8, ::1, localhost and a port alone (which binds 127.0.0.1). */
static bool es__loopback(const char *listen) {
  if (strspn(listen, "0123456789") == strlen(listen)) return true;
  return strncmp(listen, "127.", 4) == 0 || strncmp(listen, "[::1]:", 6) == 0 || strncmp(listen, "localhost:", 10) == 0;
}

int es__metrics_start(es_server *s, mr_err *e) {
  if (!s->opts.metrics_listen) return 0;
  char token[MR_SECRET_MAX_BYTES + 1];
  size_t token_len = 0;
  int rc = 0;
  if (s->opts.metrics_token_file &&
      (rc = mr_secret_read(s->opts.metrics_token_file, "--metrics-token-file", token, sizeof token, &token_len, e)))
    return rc;
  mr_http_opts o = {.listen = s->opts.metrics_listen, .flag = "--metrics-listen", .probe_ud = s,
                    .token = s->opts.metrics_token_file ? token : NULL, .token_on_renders = true};
  rc = mr_http_server_start(&s->metrics_http, &o, e);
  mr_secret_wipe(token, sizeof token);
  if (!rc) rc = mr_http_server_route(s->metrics_http, "/metrics", NULL, es__metrics_render, s, e);
  if (rc) {
    mr_http_server_free(s->metrics_http);
    s->metrics_http = NULL;
    return rc;
  }
  mr_http_server_probes(s->metrics_http, es__metrics_probe);
  const char *l = s->opts.metrics_listen, *colon = strrchr(l, ':');
  mr_log(MR_LOG_INFO, "metrics: http://%.*s:%d/metrics%s", colon ? (int)(colon - l) : 9, colon ? l : "127.0.0.1",
         mr_http_server_port(s->metrics_http), s->opts.metrics_token_file ? " (bearer token required)" : "");
  if (!es__loopback(l) && !s->opts.metrics_token_file)
    mr_log(MR_LOG_WARN, "metrics: %s is not loopback and /metrics needs no token: whoever reaches it reads the "
           "model fingerprint, the load and the request counts (--metrics-token-file)", l);
  return 0;
}

void es__metrics_stop(es_server *s) {
  mr_http_server_free(s->metrics_http);
  s->metrics_http = NULL;
}
