/*
 * flood.c - greedy Forward streams against a running moerpc-server, and what the server does
 * meanwhile: its peak RSS, and how long Hello, health and a one-token Forward take on the
 * greedy streams' own connection and on a connection of their own (issue 23, items 2 and 3;
 * docs/BENCHMARKS.md, "Overload").
 *
 *   build/tests/flood --address HOST:PORT --hidden H [--streams N] [--shared] [--tokens T]
 *                     [--seconds S] [--probe-ms MS] [--server-pid PID] [--json]
 *
 * Each greedy stream pipelines ForwardRequests of T tokens (f32, one slot each on expert 0)
 * as fast as the server takes them and never reads a reply. --shared puts every greedy
 * stream on one grpc_channel (one TCP connection, as grpcio does for channels with the same
 * options), else each has a connection of its own (a local subchannel pool). Every --probe-ms
 * the main thread sends, on the greedy streams' channel (shared) and on a separate one: a
 * Hello, a health Check and a new Forward stream with one 1-token request (each with a 10 s
 * deadline), and records the latencies; with --server-pid it samples the server's VmRSS every
 * 20 ms and reads its VmHWM at the end. Prints one JSON line on stdout, a summary on stderr.
 *
 * Threads: the main thread (probes, sampling, report) and one pump thread that owns every
 * greedy call and their completion queue.
 */
#include <grpc/grpc.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc_security.h>
#include <grpc/support/time.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "proto/pr.h"
#include "tests/integration/util.h"

#define FL_MAX_PROBES 4096

typedef struct fl_greedy {
  grpc_call *call;
  grpc_byte_buffer *bb; /* the send in flight, owned until it completes */
  bool busy, dead;
} fl_greedy;

static struct {
  const char *address;
  uint32_t hidden, tokens, streams;
  bool shared, json;
  double seconds;
  int probe_ms;
  int server_pid;
} opt = {NULL, 0, 1024, 50, false, false, 20.0, 200, 0};

static grpc_slice req_slice;       /* one encoded T-token request, shared by every send */
static grpc_completion_queue *gcq; /* the greedy calls' queue (pump thread) */
static fl_greedy *gs;
static atomic_bool stop;
static atomic_llong sends_done;
static atomic_ullong rss_max; /* the sampler's highest VmRSS of the server */

static gpr_timespec fl_in(int ms) {
  return gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_millis(ms, GPR_TIMESPAN));
}

/* A channel to the server; own: a connection of its own (local subchannel pool). */
static grpc_channel *fl_channel(bool own) {
  grpc_arg args[PR_CHANNEL_ARGS + 1];
  size_t n = pr_channel_args(args, 256 << 20);
  if (own) {
    args[n].type = GRPC_ARG_INTEGER;
    args[n].key = (char *)GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL;
    args[n++].value.integer = 1;
  }
  grpc_channel_args ca = {n, args};
  char target[300];
  pr_target_from_address(opt.address, target, sizeof target);
  grpc_channel_credentials *cr = grpc_insecure_credentials_create();
  grpc_channel *ch = grpc_channel_create(target, cr, &ca);
  grpc_channel_credentials_release(cr);
  return ch;
}

/* The request every greedy stream sends: T tokens of f32, slot 0 on expert 0. */
static int fl_request_init(void) {
  size_t len = (size_t)opt.tokens * opt.hidden * sizeof(float);
  float *x = malloc(len);
  int32_t *ids = malloc(opt.tokens * sizeof *ids);
  float *w = malloc(opt.tokens * sizeof *w);
  if (!x || !ids || !w) return -1;
  for (size_t i = 0; i < len / sizeof(float); i++) x[i] = (float)((i * 2654435761u) % 1000) / 1000.0f - 0.5f;
  for (uint32_t t = 0; t < opt.tokens; t++) ids[t] = 0, w[t] = 1.0f;
  grpc_byte_buffer *bb = itu_forward_request(1, 0, opt.tokens, 1, ids, opt.tokens, w, opt.tokens, 1, x, len);
  free(x), free(ids), free(w);
  grpc_byte_buffer_reader rd;
  if (!bb || !grpc_byte_buffer_reader_init(&rd, bb)) return -1;
  req_slice = grpc_byte_buffer_reader_readall(&rd);
  grpc_byte_buffer_reader_destroy(&rd);
  grpc_byte_buffer_destroy(bb);
  return 0;
}

/* Starts the next send of g (pump thread). */
static void fl_send(fl_greedy *g) {
  g->bb = grpc_raw_byte_buffer_create(&req_slice, 1);
  grpc_op op = {.op = GRPC_OP_SEND_MESSAGE};
  op.data.send_message.send_message = g->bb;
  if (grpc_call_start_batch(g->call, &op, 1, g, NULL) == GRPC_CALL_OK) {
    g->busy = true;
  } else {
    grpc_byte_buffer_destroy(g->bb);
    g->bb = NULL;
    g->dead = true;
  }
}

static void *fl_pump(void *arg) {
  (void)arg;
  for (uint32_t i = 0; i < opt.streams; i++) fl_send(&gs[i]);
  while (!atomic_load(&stop)) {
    grpc_event ev = grpc_completion_queue_next(gcq, fl_in(50), NULL);
    if (ev.type != GRPC_OP_COMPLETE || (uintptr_t)ev.tag < 4096) continue; /* timeout, metadata */
    fl_greedy *g = ev.tag;
    grpc_byte_buffer_destroy(g->bb);
    g->bb = NULL;
    g->busy = false;
    if (!ev.success) {
      g->dead = true;
      continue;
    }
    atomic_fetch_add(&sends_done, 1);
    fl_send(g);
  }
  return NULL;
}

/* One unary call (method, request) on ch; returns its latency in us, or -1 (no OK answer
 * within 10 s). */
static double fl_unary(grpc_channel *ch, const char *method, grpc_byte_buffer *req) {
  return itu_unary_on(ch, method, req, 10000);
}

static grpc_byte_buffer *fl_hello_req(void) {
  Moerpc__V1__HelloRequest h = MOERPC__V1__HELLO_REQUEST__INIT;
  h.protocol_major = PR_PROTOCOL_MAJOR;
  h.protocol_minor = PR_PROTOCOL_MINOR;
  h.client_name = (char *)"flood-probe";
  return pr_encode(&h.base);
}

/* A new Forward stream on ch with one 1-token request; latency of its reply in us, or -1. */
static double fl_forward1(grpc_channel *ch) {
  static float x[65536];
  int32_t id = 0;
  float w = 1.0f;
  if (opt.hidden > 65536) return -1;
  grpc_completion_queue *cq = grpc_completion_queue_create_for_next(NULL);
  uint64_t t0 = mr_now_ns();
  grpc_call *call = grpc_channel_create_call(ch, NULL, GRPC_PROPAGATE_DEFAULTS, cq,
                                             grpc_slice_from_static_string(PR_METHOD_FORWARD), NULL,
                                             fl_in(10000), NULL);
  grpc_metadata_array mi, mt;
  grpc_metadata_array_init(&mi);
  grpc_metadata_array_init(&mt);
  grpc_byte_buffer *req = itu_forward_request(7, 0, 1, 1, &id, 1, &w, 1, 1, x, opt.hidden * sizeof(float));
  grpc_byte_buffer *resp = NULL;
  grpc_status_code status = GRPC_STATUS_UNKNOWN;
  grpc_slice details = grpc_empty_slice();
  grpc_op ops[5];
  memset(ops, 0, sizeof ops);
  ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
  ops[1].op = GRPC_OP_SEND_MESSAGE;
  ops[1].data.send_message.send_message = req;
  ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
  ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
  ops[3].data.recv_initial_metadata.recv_initial_metadata = &mi;
  ops[4].op = GRPC_OP_RECV_MESSAGE;
  ops[4].data.recv_message.recv_message = &resp;
  double us = -1;
  if (grpc_call_start_batch(call, ops, 5, (void *)1, NULL) == GRPC_CALL_OK) {
    grpc_event ev = grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL);
    if (ev.type == GRPC_OP_COMPLETE && ev.success && resp) {
      Moerpc__V1__ForwardReply *r = NULL;
      void *out = NULL;
      size_t len = 0;
      if (itu_forward_reply(resp, &r, &out, &len) == 0 && r->status == 0)
        us = (double)(mr_now_ns() - t0) / 1e3;
      if (r) moerpc__v1__forward_reply__free_unpacked(r, NULL);
      free(out);
    }
  }
  grpc_op fin = {.op = GRPC_OP_RECV_STATUS_ON_CLIENT};
  fin.data.recv_status_on_client.trailing_metadata = &mt;
  fin.data.recv_status_on_client.status = &status;
  fin.data.recv_status_on_client.status_details = &details;
  if (grpc_call_start_batch(call, &fin, 1, (void *)2, NULL) == GRPC_CALL_OK)
    grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL);
  if (resp) grpc_byte_buffer_destroy(resp);
  grpc_byte_buffer_destroy(req);
  grpc_slice_unref(details);
  grpc_metadata_array_destroy(&mi);
  grpc_metadata_array_destroy(&mt);
  grpc_call_unref(call);
  grpc_completion_queue_shutdown(cq);
  while (grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL).type != GRPC_QUEUE_SHUTDOWN) {
  }
  grpc_completion_queue_destroy(cq);
  return us;
}

/* VmRSS or VmHWM of pid in bytes, 0 if unreadable. */
static uint64_t fl_mem(int pid, const char *field) {
  char path[64], line[256], fmt[32];
  snprintf(path, sizeof path, "/proc/%d/status", pid);
  snprintf(fmt, sizeof fmt, "%s: %%llu kB", field);
  FILE *f = fopen(path, "r");
  if (!f) return 0;
  unsigned long long kb = 0;
  while (fgets(line, sizeof line, f))
    if (sscanf(line, fmt, &kb) == 1) break;
  fclose(f);
  return (uint64_t)kb * 1024u;
}

/* Established TCP connections to the server's port (ss), -1 if ss fails. */
static int fl_conns(void) {
  const char *colon = strrchr(opt.address, ':');
  char cmd[200];
  snprintf(cmd, sizeof cmd, "ss -Htn state established '( dport = :%s )' 2>/dev/null | wc -l",
           colon ? colon + 1 : "0");
  FILE *p = popen(cmd, "r");
  if (!p) return -1;
  int n = -1;
  if (fscanf(p, "%d", &n) != 1) n = -1;
  pclose(p);
  return n;
}

/* Samples the server's VmRSS every 20 ms until stop (sampler thread). */
static void *fl_sampler(void *arg) {
  (void)arg;
  while (!atomic_load(&stop)) {
    uint64_t r = fl_mem(opt.server_pid, "VmRSS");
    if (r > atomic_load(&rss_max)) atomic_store(&rss_max, r);
    usleep(20000);
  }
  return NULL;
}

static int cmp_d(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

/* p50 / p99 / max of the answered probes in ms (missing ones count as +inf). */
typedef struct fl_lat {
  double v[FL_MAX_PROBES];
  int n, missed;
} fl_lat;
static void fl_lat_add(fl_lat *l, double us) {
  if (l->n >= FL_MAX_PROBES) return;
  if (us < 0) l->missed++, us = 1e12;
  l->v[l->n++] = us;
}
static double fl_pct(fl_lat *l, double p) {
  if (!l->n) return 0;
  qsort(l->v, (size_t)l->n, sizeof l->v[0], cmp_d);
  int i = (int)(p * (l->n - 1) + 0.5);
  return l->v[i] >= 1e12 ? -1 : l->v[i] / 1e3;
}

static void usage(void) {
  fprintf(stderr, "usage: flood --address HOST:PORT --hidden H [--streams N] [--shared] [--tokens T]\n"
                  "             [--seconds S] [--probe-ms MS] [--server-pid PID] [--json]\n");
  exit(2);
}

int main(int argc, char **argv) {
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (!strcmp(a, "--shared")) opt.shared = true;
    else if (!strcmp(a, "--json")) opt.json = true;
    else if (!v) usage();
    else if (!strcmp(a, "--address")) opt.address = v, i++;
    else if (!strcmp(a, "--hidden")) opt.hidden = (uint32_t)atoi(v), i++;
    else if (!strcmp(a, "--streams")) opt.streams = (uint32_t)atoi(v), i++;
    else if (!strcmp(a, "--tokens")) opt.tokens = (uint32_t)atoi(v), i++;
    else if (!strcmp(a, "--seconds")) opt.seconds = atof(v), i++;
    else if (!strcmp(a, "--probe-ms")) opt.probe_ms = atoi(v), i++;
    else if (!strcmp(a, "--server-pid")) opt.server_pid = atoi(v), i++;
    else usage();
  }
  if (!opt.address || !opt.hidden || !opt.streams || !opt.tokens || opt.probe_ms < 1) usage();
  grpc_init();
  if (fl_request_init()) {
    fprintf(stderr, "flood: out of memory\n");
    return 1;
  }
  grpc_channel *probe_own = fl_channel(true);
  double idle_hello = fl_unary(probe_own, PR_METHOD_HELLO, fl_hello_req());
  if (idle_hello < 0) {
    fprintf(stderr, "flood: no Hello answer from %s\n", opt.address);
    return 1;
  }
  uint64_t rss0 = opt.server_pid ? fl_mem(opt.server_pid, "VmRSS") : 0;
  int conns0 = fl_conns();

  gcq = grpc_completion_queue_create_for_next(NULL);
  gs = calloc(opt.streams, sizeof *gs);
  grpc_channel **chans = calloc(opt.streams, sizeof *chans);
  grpc_channel *shared = opt.shared ? fl_channel(true) : NULL;
  for (uint32_t i = 0; i < opt.streams; i++) {
    grpc_channel *ch = shared ? shared : (chans[i] = fl_channel(true));
    gs[i].call = grpc_channel_create_call(ch, NULL, GRPC_PROPAGATE_DEFAULTS, gcq,
                                          grpc_slice_from_static_string(PR_METHOD_FORWARD), NULL,
                                          gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
    grpc_op op = {.op = GRPC_OP_SEND_INITIAL_METADATA, .flags = GRPC_INITIAL_METADATA_WAIT_FOR_READY};
    grpc_call_start_batch(gs[i].call, &op, 1, (void *)1, NULL);
  }
  pthread_t pump, sampler;
  pthread_create(&pump, NULL, fl_pump, NULL);
  atomic_store(&rss_max, rss0);
  if (opt.server_pid) pthread_create(&sampler, NULL, fl_sampler, NULL);

  static fl_lat hello_same, health_same, fwd_same, hello_own, fwd_own;
  uint64_t t0 = mr_now_ns(), next_probe = t0 + 300000000ull; /* flood first */
  int conns_flood = -1;
  while (mr_now_ns() - t0 < (uint64_t)(opt.seconds * 1e9)) {
    uint64_t now = mr_now_ns();
    if (now >= next_probe) {
      if (conns_flood < 0) conns_flood = fl_conns();
      if (shared) {
        fl_lat_add(&hello_same, fl_unary(shared, PR_METHOD_HELLO, fl_hello_req()));
        fl_lat_add(&health_same, fl_unary(shared, PR_METHOD_HEALTH_CHECK, pr_health_request_encode("")));
        fl_lat_add(&fwd_same, fl_forward1(shared));
      }
      fl_lat_add(&hello_own, fl_unary(probe_own, PR_METHOD_HELLO, fl_hello_req()));
      fl_lat_add(&fwd_own, fl_forward1(probe_own));
      next_probe = mr_now_ns() + (uint64_t)opt.probe_ms * 1000000u;
    }
    usleep(20000);
  }
  uint64_t hwm = opt.server_pid ? fl_mem(opt.server_pid, "VmHWM") : 0;
  long long taken = atomic_load(&sends_done);
  atomic_store(&stop, true);
  pthread_join(pump, NULL);
  if (opt.server_pid) pthread_join(sampler, NULL);
  uint64_t rss_peak = atomic_load(&rss_max);

  fprintf(stderr,
          "flood: %u greedy streams (%s), %u-token requests: %lld sends completed; "
          "connections to the port %d idle -> %d under the flood\n",
          opt.streams, shared ? "one shared connection" : "a connection each", opt.tokens, taken,
          conns0, conns_flood);
  if (opt.server_pid)
    fprintf(stderr, "flood: server RSS %.0f MB idle, %.0f MB at most (sampled), VmHWM %.0f MB\n",
            (double)rss0 / 1e6, (double)rss_peak / 1e6, (double)hwm / 1e6);
  fl_lat *ls[] = {&hello_same, &health_same, &fwd_same, &hello_own, &fwd_own};
  const char *names[] = {"hello_same_conn", "health_same_conn", "forward1_same_conn", "hello_own_conn",
                         "forward1_own_conn"};
  char js[2048];
  int off = snprintf(js, sizeof js,
                     "{\"streams\": %u, \"shared\": %s, \"tokens\": %u, \"sends\": %lld, "
                     "\"conns\": %d, \"rss_idle_mb\": %.1f, \"rss_max_mb\": %.1f, \"vmhwm_mb\": %.1f",
                     opt.streams, shared ? "true" : "false", opt.tokens, taken, conns_flood,
                     (double)rss0 / 1e6, (double)rss_peak / 1e6, (double)hwm / 1e6);
  for (int k = 0; k < 5; k++) {
    if (!ls[k]->n) continue;
    int missed = ls[k]->missed, n = ls[k]->n;
    double p50 = fl_pct(ls[k], 0.5), p99 = fl_pct(ls[k], 0.99), mx = fl_pct(ls[k], 1.0);
    fprintf(stderr, "flood: %-19s %3d probes, %d unanswered in 10 s; p50 %.2f ms, p99 %.2f ms, max %.2f ms\n",
            names[k], n, missed, p50, p99, mx);
    off += snprintf(js + off, sizeof js - (size_t)off,
                    ", \"%s\": {\"n\": %d, \"missed\": %d, \"p50_ms\": %.3f, \"p99_ms\": %.3f, \"max_ms\": %.3f}",
                    names[k], n, missed, p50, p99, mx);
  }
  if (opt.json) printf("%s}\n", js);
  /* The process exits without tearing the calls down: the server sees the connections go. */
  fflush(NULL);
  _exit(0);
}
