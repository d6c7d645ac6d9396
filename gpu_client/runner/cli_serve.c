/*
 * cli_serve.c - `moerpc-client serve`: the OpenAI-compatible server (serve.h) around one
 * model, with its cold experts on the cluster's expert servers.
 *
 * Start-up, one lifecycle line each:
 *   1. flags; the API key file; SIGTERM / SIGINT / SIGHUP blocked in every thread
 *   2. the HTTP server listens at once: /health and the model routes answer 503 "loading",
 *      so a load balancer or kubelet sees the process before the weights are in
 *   3. tokenizer, chat template, stop ids and sampling defaults (generation_config.json)
 *   4. the model opens (Hello every expert server, weights loaded): READY, /health 200
 *   5. this thread runs the scheduler (it opened the model and is pinned to its core)
 * Shutdown: the signal thread takes SIGTERM or SIGINT: /health 503, new requests 503, the
 * running and queued ones finish within --drain-timeout, the rest are cut with an error
 * (exit status 1 then: the drain was not clean). A second signal cuts at once. A signal
 * while loading exits at once (status 1).
 */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gpu_client/runner/cli.h"
#include "gpu_client/runner/sched.h"
#include "gpu_client/runner/serve.h"
#include "gpu_client/runner/text.h"

#define PROG "moerpc-client serve"

enum {
  SO_LISTEN = 3000, SO_MAXBATCH, SO_MAXQUEUE, SO_STEP, SO_KEYFILE, SO_DRAIN, SO_NAME, SO_MAXCONNS,
  SO_MAXBODY, SO_IDLE
};

typedef struct serve_cli {
  const char *listen, *key_file, *name;
  uint32_t max_batch, max_queue, step_tokens, drain_s, max_conns, idle_s;
  uint32_t max_body;
} serve_cli;

static const char USAGE[] =
    "usage: " PROG " --model DIR [--cluster FILE] [--listen HOST:PORT] [--max-batch N]\n"
    "                [--max-seq N] [--max-queue N] [--api-key-file FILE] [--drain-timeout S]\n"
    "An OpenAI-compatible HTTP server: POST /v1/chat/completions and /v1/completions\n"
    "(streamed as server-sent events with \"stream\": true), GET /v1/models, /health (200 once\n"
    "the model and the cluster are up), /metrics (Prometheus), /routing and /placement.\n"
    "Requests share model steps (continuous batching: new ones join at step boundaries, long\n"
    "prompts are prefilled in chunks); a client that disconnects is cancelled within a step.\n"
    "SIGTERM drains: new requests get 503, running ones finish within --drain-timeout.\n\n";
static const char HELP[] =
    "serving:\n"
    "  --listen HOST:PORT       where to serve (default 127.0.0.1:8000; port 0 = any free\n"
    "                           port, logged)\n"
    "  --max-batch N            KV slots: sequences decoded together, 1..4096 (default 8)\n"
    "  --max-queue N            requests waiting for a slot before 429, 1..1000000 (default 64)\n"
    "  --step-tokens N          tokens per model step (decodes first, then prompt chunks),\n"
    "                           1..1048576 (default 512): lower keeps decode pace steadier\n"
    "                           while long prompts arrive, higher prefills faster\n"
    "  --api-key-file FILE      require \"Authorization: Bearer KEY\" (the file's one line) on\n"
    "                           /v1/*; /health, /metrics and the probes stay open\n"
    "  --served-model-name NAME the model's id in /v1/models and requests (default: the\n"
    "                           model directory's name); a request naming another gets 404\n"
    "  --chat-template FILE     a Jinja chat template instead of the model's\n"
    "  --drain-timeout S        on SIGTERM, seconds the running requests may take to finish,\n"
    "                           0..86400 (default 30)\n"
    "  --max-conns N            HTTP connections at once, 16..1000000 (default 16384; more\n"
    "                           wait in the listen backlog)\n"
    "  --idle-timeout S         an HTTP connection silent this long is closed, 1..3600\n"
    "                           (default 30; a connection waiting for its answer is not idle)\n"
    "  --max-request-bytes N    request body limit, 1024..268435456 (default 8388608): 413\n";

static int serve_opt(void *ctx, int opt, const char *arg) {
  serve_cli *s = ctx;
  switch (opt) {
    case SO_LISTEN: s->listen = arg; return 1;
    case SO_MAXBATCH: return gc__cli_u32("--max-batch", arg, 1, 4096, &s->max_batch) ? 1 : -1;
    case SO_MAXQUEUE: return gc__cli_u32("--max-queue", arg, 1, 1000000, &s->max_queue) ? 1 : -1;
    case SO_STEP: return gc__cli_u32("--step-tokens", arg, 1, 1u << 20, &s->step_tokens) ? 1 : -1;
    case SO_KEYFILE: s->key_file = arg; return 1;
    case SO_DRAIN: return gc__cli_u32("--drain-timeout", arg, 0, 86400, &s->drain_s) ? 1 : -1;
    case SO_NAME:
      if (!*arg || strlen(arg) > 256) {
        fprintf(stderr, PROG ": --served-model-name: 1..256 bytes\n");
        return -1;
      }
      s->name = arg;
      return 1;
    case SO_MAXCONNS: return gc__cli_u32("--max-conns", arg, 16, 1000000, &s->max_conns) ? 1 : -1;
    case SO_IDLE: return gc__cli_u32("--idle-timeout", arg, 1, 3600, &s->idle_s) ? 1 : -1;
    case SO_MAXBODY: return gc__cli_u32("--max-request-bytes", arg, 1024, 1u << 28, &s->max_body) ? 1 : -1;
    default: return 0;
  }
}

/* ---- signals ------------------------------------------------------------------------------- */

typedef struct sig_ctx {
  sigset_t set;
  gc_serve *sv;
  _Atomic(gc_sched *) sched;    /* NULL while loading */
  _Atomic bool done;            /* the scheduler has ended: signals change nothing now */
  uint32_t drain_ms;
} sig_ctx;

static void *signal_main(void *arg) {
  sig_ctx *c = arg;
  for (int n = 0;; n++) {
    int sig = 0;
    if (sigwait(&c->set, &sig) != 0) continue;
    if (sig == SIGHUP) {
      mr_log(MR_LOG_INFO, "serve: SIGHUP ignored (the placement follows --watch-placement)");
      n--;
      continue;
    }
    gc_sched *s = atomic_load(&c->sched);
    if (atomic_load(&c->done)) continue;
    if (!s) {
      mr_log(MR_LOG_WARN, "serve: %s while loading: exiting", strsignal(sig));
      _exit(1);
    }
    gc_serve_drain(c->sv);
    if (n == 0) {
      mr_log(MR_LOG_INFO, "serve: %s: draining (new requests get 503; running ones have %u s)", strsignal(sig),
             c->drain_ms / 1000);
      gc_sched_stop(s, c->drain_ms);
    } else {
      mr_log(MR_LOG_WARN, "serve: %s again: cutting the running requests", strsignal(sig));
      gc_sched_stop(s, 0);
    }
  }
  return NULL;
}

/* The served name: --served-model-name, else the model directory's last component. */
static void model_name(const char *dir, const char *given, char *out, size_t cap) {
  if (given) {
    snprintf(out, cap, "%s", given);
    return;
  }
  size_t n = strlen(dir);
  while (n > 1 && dir[n - 1] == '/') n--;
  size_t b = n;
  while (b > 0 && dir[b - 1] != '/') b--;
  snprintf(out, cap, "%.*s", (int)(n - b), dir + b);
  if (!out[0]) snprintf(out, cap, "moerpc");
}

int gc__cli_serve(int argc, char **argv) {
  static const struct option lo[] = {
      MODEL_OPTIONS,
      {"listen", required_argument, NULL, SO_LISTEN},
      {"max-batch", required_argument, NULL, SO_MAXBATCH},
      {"max-queue", required_argument, NULL, SO_MAXQUEUE},
      {"step-tokens", required_argument, NULL, SO_STEP},
      {"api-key-file", required_argument, NULL, SO_KEYFILE},
      {"drain-timeout", required_argument, NULL, SO_DRAIN},
      {"served-model-name", required_argument, NULL, SO_NAME},
      {"chat-template", required_argument, NULL, MO_TEMPLATE},
      {"max-conns", required_argument, NULL, SO_MAXCONNS},
      {"idle-timeout", required_argument, NULL, SO_IDLE},
      {"max-request-bytes", required_argument, NULL, SO_MAXBODY},
      {NULL, 0, NULL, 0}};
  gc__mcli c;
  gc__cli_init(&c);
  serve_cli s = {.listen = "127.0.0.1:8000", .max_batch = 8, .max_queue = 64, .step_tokens = 512, .drain_s = 30,
                 .max_conns = 16384, .idle_s = 30, .max_body = 8u << 20};
  int r = gc__cli_parse(argc, argv, lo, USAGE, HELP, &c, serve_opt, &s);
  if (r) return r == 1 ? 0 : 2;
  if (c.metrics_listen) {
    fprintf(stderr, PROG ": --metrics-listen: serve has /metrics, /routing and /placement on --listen\n");
    return 2;
  }
  mr_err e;
  mr_err_clear(&e);
  static char key[MR_SECRET_MAX_BYTES + 1];
  size_t key_len = 0;
  if (s.key_file && mr_secret_read(s.key_file, "--api-key-file", key, sizeof key, &key_len, &e)) {
    fprintf(stderr, PROG ": %s\n", e.msg);
    return 2;
  }
  char name[260];
  model_name(c.mo.model_dir, s.name, name, sizeof name);

  /* Signals go to the signal thread only: block them before any thread starts. */
  static sig_ctx sc;
  sigemptyset(&sc.set);
  sigaddset(&sc.set, SIGTERM);
  sigaddset(&sc.set, SIGINT);
  sigaddset(&sc.set, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &sc.set, NULL);
  sc.drain_ms = s.drain_s * 1000u;

  int status = 1;
  mr_http_server *h = NULL;
  gc_serve *sv = NULL;
  gc_tok *tok = NULL;
  gc_chat *chat = NULL;
  gc_model *m = NULL;
  gc_sched *sched = NULL;
  static const char auth_body[] = "{\"error\":{\"message\":\"Incorrect or missing API key (Authorization: Bearer "
                                  "KEY)\",\"type\":\"authentication_error\",\"param\":null,\"code\":\"invalid_api_key\"}}";
  mr_http_opts ho = {.listen = s.listen, .flag = "--listen", .max_conns = s.max_conns, .idle_timeout_s = s.idle_s,
                     .max_body = s.max_body, .token = s.key_file ? key : NULL, .auth_body = auth_body,
                     .json_errors = true};
  int rc = mr_http_server_start(&h, &ho, &e);
  mr_secret_wipe(key, sizeof key);
  gc_serve_opts so = {.model_name = name, .drain_timeout_ms = sc.drain_ms};
  if (!rc) rc = gc_serve_new(&sv, h, &so, &e);
  if (rc) {
    fprintf(stderr, PROG ": %s: %s\n", mr_err_name(rc), e.msg);
    goto out;
  }
  sc.sv = sv;
  pthread_t sig_thread;
  if (pthread_create(&sig_thread, NULL, signal_main, &sc) == 0) pthread_detach(sig_thread);
  {
    const char *l = s.listen;
    const char *colon = strrchr(l, ':');
    mr_log(MR_LOG_INFO, "serve: listening on http://%.*s:%d (model \"%s\" loading)", (int)(colon ? colon - l : 0), l,
           mr_http_server_port(h), name);
  }

  gc_serve_model sm = {0};
  int32_t stop_ids[GC_SCHED_MAX_STOP_IDS];
  size_t n_stop = 0;
  sm.defaults.top_p = 1.0f;
  sm.defaults.temperature = 1.0f; /* OpenAI's defaults, unless the model recommends others */
  if (!rc) rc = gc_tok_load(&tok, c.mo.model_dir, &e);
  if (!rc) rc = gc_text_stop_ids(c.mo.model_dir, tok, stop_ids, GC_SCHED_MAX_STOP_IDS, &n_stop, &e);
  if (!rc) rc = gc_text_sampling(c.mo.model_dir, &sm.defaults, &sm.defaults_set, &e);
  if (!rc) {
    rc = gc_chat_load(&chat, c.mo.model_dir, c.chat_template, &e);
    if (rc == MR_ENOTFOUND && !c.chat_template) { /* completions only */
      mr_log(MR_LOG_WARN, "serve: %s: /v1/chat/completions will answer 400", e.msg);
      rc = 0;
    }
  }
  if (rc) {
    fprintf(stderr, PROG ": %s: %s\n", mr_err_name(rc), e.msg);
    goto out;
  }
  c.mo.max_batch = s.max_batch;
  if (gc__cli_open_model(&c, &m)) goto out;
  gc_sched_opts sco = {.max_queue = s.max_queue, .step_tokens = s.step_tokens};
  gc_serve_sched_opts(sv, &sco);
  if ((rc = gc_sched_new(&sched, m, &sco, &e)) || (rc = gc__cli_model_routes(h, m, &e))) {
    fprintf(stderr, PROG ": %s: %s\n", mr_err_name(rc), e.msg);
    goto out;
  }
  sm.model = m;
  sm.sched = sched;
  sm.tok = tok;
  sm.chat = chat;
  sm.stop_ids = stop_ids;
  sm.n_stop_ids = (uint32_t)n_stop;
  gc_serve_attach(sv, &sm);
  atomic_store(&sc.sched, sched);
  mr_log(MR_LOG_INFO, "serve: ready: model \"%s\", %u KV slots of %u positions, queue %u, %u tokens a step; "
         "sampling defaults temperature %g top_p %g top_k %u (%s)", name, gc_model_max_batch(m),
         gc_model_max_seq(m), s.max_queue, s.step_tokens, sm.defaults.temperature, sm.defaults.top_p,
         sm.defaults.top_k, sm.defaults_set ? "generation_config.json" : "OpenAI's");

  gc_sched_run(sched); /* until a signal stops it and the drain ends */

  const uint64_t cut = gc_serve_cut(sv);
  gc_sched_stats st;
  gc_sched_stats_get(sched, &st);
  status = 0;
  if (cut || st.running || st.queued) {
    mr_log(MR_LOG_WARN, "serve: drain cut %llu request%s short (--drain-timeout %u s)",
           (unsigned long long)(cut + st.running + st.queued), cut + st.running + st.queued == 1 ? "" : "s",
           s.drain_s);
    status = 1;
  }
out:
  atomic_store(&sc.done, true);
  gc_sched_free(sched); /* ends what is left: their answers go out before the server stops */
  mr_http_server_free(h); /* before the model: its routes read it */
  if (gc__cli_close_model(&c, m) && status == 0) status = 1;
  gc_serve_free(sv);
  gc_chat_free(chat);
  gc_tok_free(tok);
  mr_log(MR_LOG_INFO, "serve: stopped (exit status %d)", status);
  return status;
}
