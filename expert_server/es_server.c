/*
 * es_server.c - es_server_new / es_server_free: option checks, start-up and teardown order.
 *
 * Start-up: options -> admin loop (so es_server_stop works from here on) -> config, owned
 * sets, tensor headers, engine (es__load_prepare: every mistake in a flag or the model, in
 * milliseconds) -> counters and pools -> gRPC server bound to the port -> the /metrics
 * endpoint. The weights themselves are packed by es_server_run's loader thread while gRPC
 * already answers health (docs/DESIGN.md 3.6), so a port that cannot be bound and every
 * usage error still fail here, before the long part. Teardown runs the other way round, and
 * grpc_shutdown comes after every gRPC object is destroyed.
 */
#include <sys/random.h>
#include <sys/time.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "expert_server/internal.h"

/* First block of the compute arena (merged inputs, fp32 output, kernel scratch): about 32
 * tokens x 8 slots of a qwen3-30b-a3b layer (kernels/README.md); a larger batch grows it,
 * and the arena keeps its largest block. */
#define ES_COMPUTE_ARENA_BLOCK ((size_t)4 << 20)
/* Request/reply buffers the pool keeps per size class, in bytes (es_pool.c). */
#define ES_POOL_CACHE_BYTES ((size_t)64 << 20)

void es_server_opts_init(es_server_opts *o) {
  memset(o, 0, sizeof *o);
  o->listen = ES_DEFAULT_LISTEN;
  o->layers = "all";
  o->numa = "auto";
  o->max_tokens = ES_DEFAULT_MAX_TOKENS;
  o->quant_set = false;
  o->quant = KN_FMT_BF16;
  o->group = ES_DEFAULT_GROUP;
  o->grpc_threads = ES_DEFAULT_GRPC_THREADS;
  o->drain_timeout_ms = ES_DEFAULT_DRAIN_TIMEOUT_MS;
  o->metrics_interval_ms = ES_DEFAULT_METRICS_INTERVAL_MS;
  o->handle_signals = true;
  o->max_inflight_bytes = 0; /* auto */
  o->max_streams = 0; /* auto: from the budget */
  o->stall_timeout_ms = ES_DEFAULT_STALL_TIMEOUT_MS;
  o->unload_grace_s = ES_DEFAULT_UNLOAD_GRACE_S;
  o->metrics_listen = NULL;
}

/* The checks that need no model. main.c checks the same ranges while parsing, to name the
 * flag as typed; these protect library callers. */
static int es__opts_check(const es_server_opts *o, mr_err *e) {
  if (!o->model_dir || !o->model_dir[0]) return mr_err_set(e, MR_EINVAL, "--model is required");
  if (!o->experts || !o->experts[0])
    return mr_err_set(e, MR_EINVAL, "--experts is required (\"all\" or ids/ranges like 0-7,12)");
  if (!o->listen || !o->listen[0]) return mr_err_set(e, MR_EINVAL, "--listen must be HOST:PORT");
  if (strlen(o->listen) > 255)
    return mr_err_set(e, MR_EINVAL, "--listen is %zu characters, at most 255", strlen(o->listen));
  if (!o->layers || !o->layers[0])
    return mr_err_set(e, MR_EINVAL, "--layers must be \"all\" or ids/ranges like 0-7,12");
  if (o->max_tokens < 1 || o->max_tokens > ES_MAX_MAX_TOKENS)
    return mr_err_set(e, MR_EINVAL, "--max-tokens %" PRIu32 ", must be in 1..%u", o->max_tokens,
                      ES_MAX_MAX_TOKENS);
  if (o->quant_set && (o->quant < 0 || o->quant >= KN_FMT_COUNT))
    return mr_err_set(e, MR_EINVAL, "--quant: unknown format %d", (int)o->quant);
  if (o->quant_set && o->quant == KN_FMT_INT4 && o->group != 32 && o->group != 64 && o->group != 128)
    return mr_err_set(e, MR_EINVAL, "--group %" PRIu32 ", must be 32, 64 or 128", o->group);
  if (o->grpc_threads < 1 || o->grpc_threads > ES_MAX_GRPC_THREADS)
    return mr_err_set(e, MR_EINVAL, "--grpc-threads %" PRIu32 ", must be in 1..%u", o->grpc_threads,
                      ES_MAX_GRPC_THREADS);
  if (o->threads > ES_MAX_THREADS)
    return mr_err_set(e, MR_EINVAL, "--threads %" PRIu32 ", must be in 0..%u (0 = auto)", o->threads,
                      ES_MAX_THREADS);
  if (o->max_streams > ES_MAX_MAX_STREAMS)
    return mr_err_set(e, MR_EINVAL, "--max-streams %" PRIu32 ", must be in 1..%u (0 = auto)",
                      o->max_streams, ES_MAX_MAX_STREAMS);
  if (o->stall_timeout_ms > ES_MAX_STALL_TIMEOUT_MS)
    return mr_err_set(e, MR_EINVAL, "--stall-timeout-ms %" PRIu32 ", must be in 0..%u (0 = never)",
                      o->stall_timeout_ms, ES_MAX_STALL_TIMEOUT_MS);
  if (o->unload_grace_s > ES_MAX_UNLOAD_GRACE_S)
    return mr_err_set(e, MR_EINVAL, "--unload-grace %" PRIu32 ", must be in 0..%u seconds",
                      o->unload_grace_s, ES_MAX_UNLOAD_GRACE_S);
  if (o->drain_timeout_ms > ES_MAX_DRAIN_TIMEOUT_MS)
    return mr_err_set(e, MR_EINVAL, "--drain-timeout-ms %" PRIu32 ", must be in 0..%u",
                      o->drain_timeout_ms, ES_MAX_DRAIN_TIMEOUT_MS);
  return 0;
}

/* HelloReply.instance_id: 128 bits from the kernel's random source, so that two server
 * processes (on one host or two, started in the same microsecond or not) never share one,
 * as lowercase hex. Without getrandom (never seen on Linux >= 3.17), the clock, the pid and
 * an address stand in: a client then at worst takes two servers for one only if these
 * collide too. */
static void es__instance_id(es_server *s) {
  uint64_t w[2] = {0, 0};
  if (getrandom(w, sizeof w, 0) != (ssize_t)sizeof w) {
    w[0] = mr_now_ns() ^ ((uint64_t)getpid() << 32);
    w[1] = (uint64_t)(uintptr_t)s * 0x9e3779b97f4a7c15ull ^ (uint64_t)time(NULL);
  }
  snprintf(s->instance_id, sizeof s->instance_id, "%016" PRIx64 "%016" PRIx64, w[0], w[1]);
}

static char *es__dup(const char *s, int *rc) {
  char *d = mr_strdup(s ? s : "");
  if (!d) *rc = MR_ENOMEM;
  return d;
}

int es_server_new(es_server **out, const es_server_opts *opts, mr_err *e) {
  *out = NULL;
  int rc = es__opts_check(opts, e);
  if (rc) return rc;
  es_server *s = mr_calloc(1, sizeof *s);
  if (!s) return mr_err_set(e, MR_ENOMEM, "out of memory for the server");
  pthread_mutex_init(&s->streams_lock, NULL);
  pthread_mutex_init(&s->hello_lock, NULL);
  pthread_mutex_init(&s->q_lock, NULL);
  pthread_cond_init(&s->q_cond, NULL);
  pthread_mutex_init(&s->tab_lock, NULL);
  pthread_mutex_init(&s->ctl_lock, NULL);
  pthread_cond_init(&s->ctl_cond, NULL);
  pthread_mutex_init(&s->auth_lock, NULL);
  pthread_mutex_init(&s->tls_lock, NULL);
  mr_arena_init(&s->arena, ES_COMPUTE_ARENA_BLOCK);

  s->opts = *opts;
  s->model_dir = es__dup(opts->model_dir, &rc);
  s->listen = es__dup(opts->listen, &rc);
  s->experts_spec = es__dup(opts->experts, &rc);
  s->layers_spec = es__dup(opts->layers, &rc);
  s->numa = es__dup(opts->numa ? opts->numa : "auto", &rc);
  s->metrics_listen = opts->metrics_listen ? es__dup(opts->metrics_listen, &rc) : NULL;
  s->metrics_token_file = opts->metrics_token_file ? es__dup(opts->metrics_token_file, &rc) : NULL;
  if (rc) {
    mr_err_set(e, rc, "out of memory copying the options");
    goto out_free_server;
  }
  s->opts.model_dir = s->model_dir;
  s->opts.listen = s->listen;
  s->opts.experts = s->experts_spec;
  s->opts.layers = s->layers_spec;
  s->opts.numa = s->numa;
  s->opts.metrics_listen = s->metrics_listen;
  s->opts.metrics_token_file = s->metrics_token_file;
  struct timeval tv;
  gettimeofday(&tv, NULL);
  s->start_time_s = (double)tv.tv_sec + (double)tv.tv_usec / 1e6;
  mr_hist_init_latency(&s->queue_hist);
  es__instance_id(s);

  if ((rc = es__auth_init(s, e))) goto out_free_server;
  if ((rc = es__admin_init(s, e))) goto out_free_server;
  if (opts->map_weights && opts->weight_cache) {
    rc = mr_err_set(e, MR_EINVAL, "--map-weights with --weight-cache %s: experts served in place "
                    "leave nothing to cache; give one of the two", opts->weight_cache);
    goto out_free_server;
  }
  if ((rc = es__cache_new(s, opts->weight_cache, e))) goto out_free_server;
  s->cache_repack = es__control_repack_all;
  if ((rc = es__load_prepare(s, e))) goto out_free_server;

  size_t ncnt = (size_t)s->cfg.num_layers * s->cfg.num_experts;
  s->tokens = mr_calloc(ncnt, sizeof *s->tokens);
  if (!s->tokens) {
    rc = mr_err_set(e, MR_ENOMEM, "out of memory for %zu token counters", ncnt);
    goto out_free_server;
  }
  for (size_t i = 0; i < ncnt; i++) atomic_init(&s->tokens[i], 0);
  s->layer_tokens = mr_calloc(s->cfg.num_layers, sizeof *s->layer_tokens);
  s->layer_hist = mr_calloc(s->cfg.num_layers, sizeof *s->layer_hist);
  if (!s->layer_tokens || !s->layer_hist) {
    rc = mr_err_set(e, MR_ENOMEM, "out of memory for per-layer metrics");
    goto out_free_server;
  }
  for (uint32_t l = 0; l < s->cfg.num_layers; l++) {
    atomic_init(&s->layer_tokens[l], 0);
    mr_hist_init_latency(&s->layer_hist[l]);
  }
  /* Buffers hold at most one request's hidden rows: max_tokens * H * 4 bytes (f32). */
  size_t max_buf = (size_t)s->opts.max_tokens * s->cfg.hidden_size * 4u;
  if ((rc = es__pool_init(&s->pool, max_buf, ES_POOL_CACHE_BYTES))) {
    mr_err_set(e, rc, "cannot create the buffer pool");
    goto out_free_server;
  }
  s->pool_inited = true;
  es_buf *probe = es__buf_get(&s->pool, max_buf); /* the size class of the largest request */
  s->pool_max_buf = probe ? probe->cap : max_buf;
  es__buf_release(probe);
  if (s->opts.max_inflight_bytes) s->max_inflight_bytes = es__inflight_budget(s);
  if (s->opts.max_inflight_bytes && s->max_inflight_bytes > s->opts.max_inflight_bytes) {
    rc = mr_err_set(e, MR_EINVAL,
                    "--max-inflight-bytes %" PRIu64 " is below %u requests of --max-tokens %" PRIu32
                    " x hidden_size %" PRIu32 " x 4 bytes = %" PRIu64,
                    s->opts.max_inflight_bytes, ES_INFLIGHT_MIN_REQUESTS, s->opts.max_tokens,
                    s->cfg.hidden_size, (uint64_t)s->max_inflight_bytes);
    goto out_free_server;
  }
  /* The stream cap and each stream's HTTP/2 window come from the budget (docs/DESIGN.md
   * 3.5). The window must be known now, for gRPC's arguments; an auto budget is only known
   * once the weights are in, so it is sized from the smallest auto budget there can be. An
   * auto cap is set with an auto budget (es_admin.c), before any stream is accepted. */
  s->max_streams = s->opts.max_streams;
  s->stream_window = es__stream_window(s->opts.max_inflight_bytes ? s->max_inflight_bytes
                                                                  : ES_AUTO_INFLIGHT_MIN,
                                       s->opts.max_streams);
  s->stream_charge = s->stream_window + ES_STREAM_OVERHEAD;
  if (s->opts.max_inflight_bytes && !es__streams_size(s)) {
    rc = mr_err_set(e, MR_EINVAL,
                    "--max-streams %" PRIu32 ": the streams' windows and state (%" PRIu32
                    " x %zu bytes) would take more than half of --max-inflight-bytes %" PRIu64
                    "; lower --max-streams or raise the budget",
                    s->max_streams, s->max_streams, s->stream_charge, s->opts.max_inflight_bytes);
    goto out_free_server;
  }
  s->q_heap_cap = s->opts.max_streams ? s->opts.max_streams : ES_AUTO_STREAMS_MAX;
  s->q_heap = mr_calloc(s->q_heap_cap, sizeof *s->q_heap);
  if (!s->q_heap) {
    rc = mr_err_set(e, MR_ENOMEM, "out of memory for the compute queue");
    goto out_free_server;
  }
  if ((rc = es__grpc_create(s, e))) goto out_free_server;
  if ((rc = es__metrics_start(s, e))) goto out_free_server;
  *out = s;
  return 0;
out_free_server:
  es_server_free(s);
  return rc;
}

int es_server_port(const es_server *s) { return s->port; }

int es_server_metrics_port(const es_server *s) {
  return s->metrics_http ? mr_http_server_port(s->metrics_http) : 0;
}

uint64_t es_server_inflight_budget(const es_server *s) { return s->max_inflight_bytes; }

uint64_t es_server_unanswered(const es_server *s) {
  long long n = atomic_load(&s->lost_in_drain);
  return n > 0 ? (uint64_t)n : 0;
}

void es_server_stop(es_server *s) {
  if (!s) return;
  atomic_store(&s->stop_requested, true);
  es__admin_wake(s);
}

void es_server_free(es_server *s) {
  if (!s) return;
  es__metrics_stop(s);
  /* es-cache first: a write stops after its block (so es-ctl-load, which may wait for the
   * cache's lock to extend it, is not held up), a repack after its expert. */
  es__cache_stop(s);
  es__control_stop(s); /* a live load still packing stops after its expert */
  if (s->loader_started) { /* es_server_run failed or was cut short during the load */
    atomic_store(&s->load_abort, true);
    pthread_join(s->loader, NULL);
    s->loader_started = false;
  }
  es__compute_stop(s);
  es__grpc_destroy(s);
  es__control_close(s); /* the tables hold grpc slices: before grpc_shutdown */
  if (s->grpc_inited) grpc_shutdown();
  es__admin_close(s);
  es__unload(s);
  es__cache_close(s); /* the layers that borrowed its mappings are gone */
  es__auth_close(s);
  mr_free(s->tokens);
  mr_free(s->layer_tokens);
  mr_free(s->layer_hist);
  mr_free(s->metrics_listen);
  mr_free(s->metrics_token_file);
  mr_free(s->q_heap);
  mr_arena_close(&s->arena);
  if (s->pool_inited) es__pool_close(&s->pool);
  mr_free(s->model_dir);
  mr_free(s->listen);
  mr_free(s->experts_spec);
  mr_free(s->layers_spec);
  mr_free(s->numa);
  pthread_cond_destroy(&s->q_cond);
  pthread_mutex_destroy(&s->q_lock);
  pthread_mutex_destroy(&s->streams_lock);
  pthread_mutex_destroy(&s->hello_lock);
  pthread_mutex_destroy(&s->tab_lock);
  pthread_cond_destroy(&s->ctl_cond);
  pthread_mutex_destroy(&s->ctl_lock);
  pthread_mutex_destroy(&s->auth_lock);
  pthread_mutex_destroy(&s->tls_lock);
  mr_free(s);
}
