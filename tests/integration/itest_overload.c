/*
 * itest_overload.c - a real moerpc-server under hostile and greedy clients: the byte budget,
 * fair scheduling, the stall cut, deadlines on the wire, cancelled and killed clients, the
 * stream cap, the top_k cap, and a drain that keeps its word (docs/DESIGN.md §3.2).
 *
 * Figures the tests print (RSS, latencies) are recorded in docs/BENCHMARKS.md ("Overload").
 */
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/support/time.h>
#include <signal.h>
#include <stdio.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tests/unit/mt.h"
#include "tests/integration/util.h"

static char *tmp;
static char model[600];
static itu_server srv;

/* A model whose layer is cheap to compute: H 1024, 4 experts of intermediate 16. */
static const char *const light_model =
    "--layers 1 --experts 4 --topk 1 --hidden 1024 --inter 16 --vocab 64 --heads 2 --kv-heads 1 "
    "--head-dim 32 --seed 3";
/* One whose requests take a while: H 1024, intermediate 1024 (~1.6 GFLOP per 256 tokens). */
static const char *const heavy_model =
    "--layers 1 --experts 4 --topk 1 --hidden 1024 --inter 1024 --vocab 64 --heads 2 "
    "--kv-heads 1 --head-dim 32 --seed 4";
/* And one four times heavier still, for a drain that times out. */
static const char *const heavier_model =
    "--layers 1 --experts 4 --topk 1 --hidden 1024 --inter 4096 --vocab 64 --heads 2 "
    "--kv-heads 1 --head-dim 32 --seed 4";
#define H 1024

static void start(const char *mk, const char *extra) {
  grpc_init();
  tmp = itu_tmpdir();
  MT_TRUE(tmp != NULL);
  snprintf(model, sizeof model, "%s/model", tmp);
  MT_EQ_INT(itu_make_model(model, mk), 0);
  MT_EQ_INT(itu_server_start(&srv, model, extra, tmp, 60000), 0);
}

static void dump_log(void) {
  char cmd[700];
  snprintf(cmd, sizeof cmd, "tail -n 30 '%s' >&2", srv.log);
  if (system(cmd)) {
  }
}

static void stop(int sig, int want, int timeout_ms) {
  int st = 0;
  MT_EQ_INT(itu_server_stop(&srv, sig, timeout_ms, &st), 0);
  if (!WIFEXITED(st) || WEXITSTATUS(st) != want) dump_log();
  MT_TRUE(WIFEXITED(st));
  MT_EQ_INT(WEXITSTATUS(st), want);
}

static void finish(void) {
  itu_rm_rf(tmp);
  grpc_shutdown();
}

static void log_line(const char *needle, char *line, size_t len) {
  char cmd[900];
  snprintf(cmd, sizeof cmd, "grep -F -- '%s' '%s' | tail -n 1", needle, srv.log);
  line[0] = '\0';
  FILE *p = popen(cmd, "r");
  if (!p) return;
  if (!fgets(line, (int)len, p)) line[0] = '\0';
  pclose(p);
}

/* Resident set of the server in bytes (VmRSS), 0 if unreadable. */
static uint64_t server_rss(void) {
  char path[64], line[256];
  snprintf(path, sizeof path, "/proc/%d/status", (int)srv.pid);
  FILE *f = fopen(path, "r");
  if (!f) return 0;
  unsigned long long kb = 0;
  while (fgets(line, sizeof line, f))
    if (sscanf(line, "VmRSS: %llu kB", &kb) == 1) break;
  fclose(f);
  return (uint64_t)kb * 1024u;
}

/* The server's StatsReply (caller frees with protobuf_c_message_free_unpacked). */
static Moerpc__V1__StatsReply *stats(void) {
  /* 10 s; 60 s under a sanitizer. Under TSan, right after the 256-stream flood, the server's
   * threads spend seconds in the shadow-memory updates of the 4 MiB requests it copies
   * (perf: __tsan::MemoryAccessRange), and Stats took 2.6-6.4 s here (over 10 s once in
   * CI); the plain build answers in ~12 ms. */
  const char *san = getenv("SANITIZER");
  const int ms = san && san[0] ? 60000 : 10000;
  itu_call c;
  Moerpc__V1__StatsReply *r = NULL;
  if (itu_call_open(&c, srv.address, PR_METHOD_STATS, ms) == 0) {
    Moerpc__V1__StatsRequest sr = MOERPC__V1__STATS_REQUEST__INIT;
    grpc_byte_buffer *rb = NULL;
    if (itu_call_send(&c, pr_encode(&sr.base), ms) == 0 && itu_call_recv(&c, &rb, ms) == 0 &&
        rb) {
      ProtobufCMessage *m = NULL;
      if (pr_decode(rb, &moerpc__v1__stats_reply__descriptor, 1 << 20, &m, NULL) == 0)
        r = (Moerpc__V1__StatsReply *)m;
    }
    if (rb) grpc_byte_buffer_destroy(rb);
    itu_call_finish(&c, 5000);
  }
  itu_call_close(&c);
  MT_TRUE(r != NULL);
  return r;
}

static uint64_t tokens_counted(const Moerpc__V1__StatsReply *r) {
  uint64_t n = 0;
  for (size_t i = 0; i < r->n_counts; i++) n += r->counts[i]->tokens;
  return n;
}

/* Polls Stats until held_bytes is 0 (up to ms); returns the last value. */
static uint64_t wait_held_zero(int ms) {
  uint64_t held = UINT64_MAX;
  for (int t = 0; t < ms; t += 100) {
    Moerpc__V1__StatsReply *r = stats();
    held = r->held_bytes;
    protobuf_c_message_free_unpacked(&r->base, NULL);
    if (held == 0) break;
    usleep(100 * 1000);
  }
  return held;
}

/* A request of T tokens, one slot each (expert t % 4, weight 1), f32 hidden. */
static grpc_byte_buffer *request(uint64_t id, uint32_t T, uint32_t budget_us) {
  static float x[1024 * H];
  static int32_t ids[1024];
  static float w[1024];
  static bool init;
  if (!init) {
    for (size_t i = 0; i < sizeof x / sizeof x[0]; i++) x[i] = (float)((i * 2654435761u) % 1000) / 1000.0f - 0.5f;
    for (int i = 0; i < 1024; i++) {
      ids[i] = i % 4;
      w[i] = 1.0f;
    }
    init = true;
  }
  return itu_forward_request_budget(id, 0, T, 1, ids, T, w, T, 1, x, (size_t)T * H * sizeof(float),
                                budget_us);
}

/* Sends one request on c and waits for its reply; returns its status, -1 on failure. */
static int round_trip(itu_call *c, uint64_t id, uint32_t T, uint32_t budget_us, char *err,
                      size_t err_len) {
  if (itu_call_send(c, request(id, T, budget_us), 10000) != 0) {
    fprintf(stderr, "  request %llu: send failed\n", (unsigned long long)id);
    return -1;
  }
  grpc_byte_buffer *rb = NULL;
  if (itu_call_recv(c, &rb, 30000) != 0 || !rb) {
    fprintf(stderr, "  request %llu: no reply\n", (unsigned long long)id);
    return -1;
  }
  Moerpc__V1__ForwardReply *r = NULL;
  void *out = NULL;
  size_t out_len = 0;
  int st = -1;
  if (itu_forward_reply(rb, &r, &out, &out_len) == 0) {
    st = (int)r->status;
    if (err) snprintf(err, err_len, "%s", r->error ? r->error : "");
    moerpc__v1__forward_reply__free_unpacked(r, NULL);
  }
  free(out);
  grpc_byte_buffer_destroy(rb);
  return st;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static double median(double *v, int n) {
  qsort(v, (size_t)n, sizeof *v, cmp_double);
  return v[n / 2];
}

/* ---- greedy streams: send, never read -------------------------------------------------- */

typedef struct greedy {
  itu_call c;
  grpc_byte_buffer *bb; /* in flight, owned until its send completes */
  bool busy, dead;
  int sent;
} greedy;

/* Keeps one send in flight on every stream that still takes them. Returns sends completed. */
static int pump(greedy *g, int n, uint32_t T) {
  int done = 0;
  for (int i = 0; i < n; i++) {
    if (g[i].busy) {
      grpc_event ev = grpc_completion_queue_next(g[i].c.cq, gpr_inf_past(GPR_CLOCK_MONOTONIC), NULL);
      if (ev.type != GRPC_OP_COMPLETE) continue;
      grpc_byte_buffer_destroy(g[i].bb);
      g[i].bb = NULL;
      g[i].busy = false;
      if (!ev.success) g[i].dead = true;
      else g[i].sent++, done++;
    }
    if (!g[i].busy && !g[i].dead) {
      g[i].bb = request((uint64_t)g[i].sent + 1, T, 0);
      grpc_op op = {.op = GRPC_OP_SEND_MESSAGE};
      op.data.send_message.send_message = g[i].bb;
      if (grpc_call_start_batch(g[i].c.call, &op, 1, (void *)2, NULL) == GRPC_CALL_OK) {
        g[i].busy = true;
      } else {
        grpc_byte_buffer_destroy(g[i].bb);
        g[i].bb = NULL;
        g[i].dead = true;
      }
    }
  }
  return done;
}

/* A channel with a connection of its own, as a separate client process would have (gRPC
 * shares one connection between the channels of a process otherwise). */
static grpc_channel *own_channel(void) {
  grpc_arg args[PR_CHANNEL_ARGS + 1];
  size_t n = pr_channel_args(args, 64 << 20);
  args[n].type = GRPC_ARG_INTEGER;
  args[n].key = (char *)GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL;
  args[n++].value.integer = 1;
  grpc_channel_args ca = {n, args};
  char target[300];
  pr_target_from_address(srv.address, target, sizeof target);
  grpc_channel_credentials *cr = grpc_insecure_credentials_create();
  grpc_channel *ch = grpc_channel_create(target, cr, &ca);
  grpc_channel_credentials_release(cr);
  return ch;
}

/* Opens a Forward stream on shared (not owned: greedy_close leaves it), or on a connection of
 * its own when shared is NULL. */
static int greedy_open_on(greedy *g, grpc_channel *shared) {
  itu_call *c = &g->c;
  memset(c, 0, sizeof *c);
  grpc_channel *ch = shared ? shared : own_channel();
  if (!shared) c->ch = ch;
  c->cq = grpc_completion_queue_create_for_next(NULL);
  grpc_slice m = grpc_slice_from_static_string(PR_METHOD_FORWARD);
  c->call = grpc_channel_create_call(ch, NULL, GRPC_PROPAGATE_DEFAULTS, c->cq, m, NULL,
                                     gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
  grpc_metadata_array_init(&c->md_initial);
  grpc_metadata_array_init(&c->md_trailing);
  c->details = grpc_empty_slice();
  grpc_op op = {.op = GRPC_OP_SEND_INITIAL_METADATA, .flags = GRPC_INITIAL_METADATA_WAIT_FOR_READY};
  if (grpc_call_start_batch(c->call, &op, 1, (void *)1, NULL) != GRPC_CALL_OK) return -1;
  grpc_event ev = grpc_completion_queue_next(
      c->cq, gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_millis(10000, GPR_TIMESPAN)),
      NULL);
  return ev.type == GRPC_OP_COMPLETE && ev.success ? 0 : -1;
}
static int greedy_open(greedy *g) { return greedy_open_on(g, NULL); }

static void greedy_close(greedy *g, int n) {
  for (int i = 0; i < n; i++) {
    grpc_call_cancel(g[i].c.call, NULL);
    if (g[i].busy) {
      grpc_event ev;
      do ev = grpc_completion_queue_next(g[i].c.cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL);
      while (ev.type == GRPC_OP_COMPLETE && ev.tag != (void *)2);
      grpc_byte_buffer_destroy(g[i].bb);
    }
    itu_call_close(&g[i].c);
  }
}

#define NGREEDY 50
#define BUDGET_MB 64

MT_TEST(fifty_streams_that_never_read_stay_within_the_budget_and_a_light_client_keeps_its_pace) {
  char flags[300];
  /* --max-streams: the auto cap of a 64 MiB budget is 16 streams (one per 4 MiB). */
  snprintf(flags, sizeof flags, "--experts all --max-tokens 1024 --max-inflight-bytes 64M "
           "--max-streams 64 --stall-timeout-ms 4000 --metrics-listen 127.0.0.1:0");
  start(light_model, flags);
  const int mport = itu_metrics_port(&srv, 10000); /* 0: picked by the server, logged */
  MT_TRUE(mport > 0);
  (void)BUDGET_MB;
  itu_call good;
  MT_EQ_INT(itu_call_open(&good, srv.address, PR_METHOD_FORWARD, 300000), 0);
  double base[40], loaded[40];
  for (int i = 0; i < 40; i++) {
    uint64_t t0 = mr_now_ns();
    MT_EQ_INT(round_trip(&good, (uint64_t)i + 1, 1, 0, NULL, 0), 0);
    base[i] = (double)(mr_now_ns() - t0) / 1e3;
  }
  uint64_t rss0 = server_rss();

  static greedy g[NGREEDY];
  memset(g, 0, sizeof g);
  for (int i = 0; i < NGREEDY; i++)
    MT_EQ_INT(greedy_open(&g[i]), 0);
  /* Flood: 4 MiB requests (1024 tokens x 1024 x f32), none of the replies read. */
  uint64_t rss_max = rss0, t_flood = mr_now_ns(), t_last_send = t_flood;
  int total = 0, n_loaded = 0;
  while (mr_now_ns() - t_flood < 6000000000ull) {
    int d = pump(g, NGREEDY, 1024);
    total += d;
    uint64_t now = mr_now_ns();
    if (d) t_last_send = now;
    uint64_t rss = server_rss();
    if (rss > rss_max) rss_max = rss;
    if (n_loaded < 40 && now - t_flood > 300000000ull) {
      uint64_t t0 = mr_now_ns();
      MT_EQ_INT(round_trip(&good, 1000u + (uint64_t)n_loaded, 1, 0, NULL, 0), 0);
      loaded[n_loaded++] = (double)(mr_now_ns() - t0) / 1e3;
    }
    if (n_loaded == 40 && now - t_last_send > 1500000000ull) break; /* all held back */
    usleep(2000);
  }
  Moerpc__V1__StatsReply *r = stats();
  uint64_t budget = r->max_inflight_bytes, peak = r->held_bytes_peak;
  protobuf_c_message_free_unpacked(&r->base, NULL);
  double b = median(base, 40), l = n_loaded ? median(loaded, n_loaded) : 0.0;
  fprintf(stderr,
          "  %d greedy streams: %d requests of 4 MiB taken (%.0f MB), server RSS %.0f MB idle, "
          "%.0f MB at most (+%.0f MB); held at most %.0f MB of a %.0f MB budget\n",
          NGREEDY, total, total * 4.194304, (double)rss0 / 1e6, (double)rss_max / 1e6,
          (double)(rss_max - rss0) / 1e6, (double)peak / 1e6, (double)budget / 1e6);
  fprintf(stderr, "  light client, 1-token round trip: median %.0f us alone, %.0f us under the flood (x%.1f)\n",
          b, l, l / b);
  /* Under a sanitizer everything runs 5-20x slower on these 2 cores: the light client's
   * pace says nothing about the server then, only that it is served at all. */
  const char *san = getenv("SANITIZER");
  bool timing_meaningful = !(san && san[0]);
  if (timing_meaningful) MT_EQ_INT(n_loaded, 40);
  else MT_TRUE(n_loaded >= 1);
  MT_EQ_U64(budget, (uint64_t)64 << 20);
  /* Held bytes (requests and replies): within the budget, its reserve inside it now, less
   * the room set aside for the streams' windows (docs/DESIGN.md 3.5). */
  MT_LE(peak, budget);
  /* RSS: idle (the model and the process) + the budget + 256 MiB, with every stream's
   * window and state counted in the budget (docs/DESIGN.md 3.5; was +330..+653 MB here
   * with gRPC's BDP-sized windows, +76..+116 MB with the fixed ones). Under a
   * sanitizer the allocator's quarantine holds freed memory: RSS says nothing. */
  bool rss_meaningful = timing_meaningful;
  if (rss_meaningful) MT_LE(rss_max, rss0 + budget + ((uint64_t)256 << 20));
  if (timing_meaningful) MT_LE(l, 10.0 * b + 2000.0);

  /* The greedy streams stalled: the server cuts them after --stall-timeout-ms and frees
   * everything they held. They are cut in waves: each wave is the streams the budget
   * admitted, stalled for 4 s; about 10 fit at once, so 50 take 4-5 waves. */
  uint64_t held = wait_held_zero(25000);
  MT_EQ_U64(held, 0);
  char line[512];
  log_line("stream cut", line, sizeof line);
  fprintf(stderr, "  server: %s", line);
  MT_CONTAINS(line, "--stall-timeout-ms");
  /* The cuts are counted as cuts, not as streams refused over --max-streams (nothing was);
   * StatsReply.refused counts both, as moe.proto says. */
  static char scraped[1 << 16];
  const char *get = "GET /metrics HTTP/1.1\r\nHost: t\r\n\r\n";
  itu_http(mport, get, strlen(get), scraped, sizeof scraped);
  double cuts = itu_metric(scraped, "moerpc_stall_cuts_total");
  fprintf(stderr, "  /metrics: moerpc_stall_cuts_total %.0f, moerpc_refused_total %.0f\n", cuts,
          itu_metric(scraped, "moerpc_refused_total"));
  MT_TRUE(cuts >= 1);
  MT_TRUE(itu_metric(scraped, "moerpc_refused_total") == 0);
  /* Held bytes can be 0 between two waves of cuts: more may come while we read, so Stats
   * (read in between) must lie between two scrapes. */
  r = stats();
  itu_http(mport, get, strlen(get), scraped, sizeof scraped);
  double cuts2 = itu_metric(scraped, "moerpc_stall_cuts_total");
  MT_TRUE(itu_metric(scraped, "moerpc_refused_total") == 0);
  MT_TRUE(r->refused >= (uint64_t)cuts);
  MT_LE(r->refused, (uint64_t)cuts2);
  protobuf_c_message_free_unpacked(&r->base, NULL);
  uint64_t rss_cut = server_rss();
  /* And the light client goes on. */
  MT_EQ_INT(round_trip(&good, 5000, 1, 0, NULL, 0), 0);
  greedy_close(g, NGREEDY); /* their connections go too */
  usleep(1600 * 1000);     /* the housekeeping trims once things are quiet for 1 s */
  uint64_t rss_after = server_rss();
  fprintf(stderr, "  RSS after the cut: %.0f MB, once their connections closed: %.0f MB\n",
          (double)rss_cut / 1e6, (double)rss_after / 1e6);
  if (rss_meaningful) {
    MT_LE(rss_after, rss0 + budget); /* given back, not kept at the peak */
  }
  else fprintf(stderr, "  (RSS not checked under SANITIZER=%s)\n", san);
  itu_call_close(&good);
  stop(SIGTERM, 0, 20000);
  finish();
}

/* Floods g[0..n) with 4 MiB requests, none of their replies read, until, after the first
 * send completed, nothing more has been taken for 1.5 s, or ms have passed; returns the
 * highest server RSS seen. (Many streams' first sends complete together, late: HTTP/2
 * interleaves them.) */
static uint64_t flood(greedy *g, int n, int ms, int *taken) {
  uint64_t rss_max = server_rss(), t0 = mr_now_ns(), t_last = t0;
  *taken = 0;
  while (mr_now_ns() - t0 < (uint64_t)ms * 1000000u) {
    int d = pump(g, n, 1024);
    *taken += d;
    uint64_t rss = server_rss();
    if (rss > rss_max) rss_max = rss;
    if (d) t_last = mr_now_ns();
    else if (*taken && mr_now_ns() - t_last > 1500000000ull) break; /* all held back */
    usleep(2000);
  }
  return rss_max;
}

#define NWIDE 256

MT_TEST(two_hundred_fifty_six_streams_that_never_read_keep_rss_within_the_budget_plus_256_mib) {
  /* Each stream's HTTP/2 window is an eighth of its share of the budget: 128 MiB / 8 / 256
   * = 64 KiB; with its state (64 KiB) the budget sets 256 x 128 KiB = 32 MiB aside for
   * them, and requests get the rest. */
  start(light_model, "--experts all --max-tokens 1024 --max-inflight-bytes 128M --max-streams 256");
  uint64_t rss0 = server_rss();
  static greedy g[NWIDE];
  memset(g, 0, sizeof g);
  for (int i = 0; i < NWIDE; i++)
    MT_EQ_INT(greedy_open(&g[i]), 0);
  int taken = 0;
  /* Under a sanitizer the server takes 4 MiB requests 5-50x slower (TSan: none of them
   * within 8 s on 2 cores): a longer window, and the budget-used count asks for one. */
  const char *san = getenv("SANITIZER");
  const bool sanitized = san && san[0];
  uint64_t rss_max = flood(g, NWIDE, sanitized ? 60000 : 8000, &taken);
  Moerpc__V1__StatsReply *r = stats();
  uint64_t budget = r->max_inflight_bytes, peak = r->held_bytes_peak, refused = r->refused;
  protobuf_c_message_free_unpacked(&r->base, NULL);
  fprintf(stderr,
          "  %d greedy streams: %d requests of 4 MiB taken, server RSS %.0f MB idle, %.0f MB at "
          "most (+%.0f MB); held at most %.0f MB of a %.0f MB budget\n",
          NWIDE, taken, (double)rss0 / 1e6, (double)rss_max / 1e6, (double)(rss_max - rss0) / 1e6,
          (double)peak / 1e6, (double)budget / 1e6);
  MT_EQ_U64(budget, (uint64_t)128 << 20);
  MT_EQ_U64(refused, 0); /* every stream fits --max-streams and the budget */
  /* RSS first: with gRPC's BDP-grown windows this was +821..+1115 MB (fd4e1d9). */
  if (!sanitized) MT_LE(rss_max, rss0 + budget + ((uint64_t)256 << 20));
  else fprintf(stderr, "  (RSS not checked under SANITIZER=%s)\n", san);
  /* Held: what the budget leaves once the streams' room is set aside. */
  MT_LE(peak, budget - (uint64_t)NWIDE * (128u << 10));
  MT_TRUE(taken >= (sanitized ? 1 : 16)); /* the budget was used */
  greedy_close(g, NWIDE);
  stop(SIGTERM, 0, 30000);
  finish();
}

/* One unary call on ch; its latency in ms, or -1 without an OK answer within 10 s. */
static double unary_on(grpc_channel *ch, const char *method, grpc_byte_buffer *req) {
  double us = itu_unary_on(ch, method, req, 10000);
  return us < 0 ? -1 : us / 1e3;
}

static grpc_byte_buffer *hello_request(void) {
  Moerpc__V1__HelloRequest h = MOERPC__V1__HELLO_REQUEST__INIT;
  h.protocol_major = PR_PROTOCOL_MAJOR;
  h.protocol_minor = PR_PROTOCOL_MINOR;
  h.client_name = (char *)"itest-overload";
  return pr_encode(&h.base);
}

/* A new Forward stream on ch with one 1-token request; the latency of its OK reply in ms, or
 * -1 without one within 10 s. */
static double forward1_on(grpc_channel *ch) {
  itu_call c;
  memset(&c, 0, sizeof c);
  grpc_metadata_array_init(&c.md_initial);
  grpc_metadata_array_init(&c.md_trailing);
  c.details = grpc_empty_slice();
  c.cq = grpc_completion_queue_create_for_next(NULL);
  uint64_t t0 = mr_now_ns();
  gpr_timespec dl = gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_millis(10000, GPR_TIMESPAN));
  c.call = grpc_channel_create_call(ch, NULL, GRPC_PROPAGATE_DEFAULTS, c.cq,
                                    grpc_slice_from_static_string(PR_METHOD_FORWARD), NULL, dl, NULL);
  grpc_op op = {.op = GRPC_OP_SEND_INITIAL_METADATA};
  double ms = -1;
  if (grpc_call_start_batch(c.call, &op, 1, (void *)1, NULL) == GRPC_CALL_OK &&
      grpc_completion_queue_next(c.cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL).success &&
      round_trip(&c, 1, 1, 0, NULL, 0) == 0)
    ms = (double)(mr_now_ns() - t0) / 1e6;
  itu_call_close(&c); /* the call is cancelled: the stream ends */
  return ms;
}

#define NSHARED 30
#define NPROBE 100

MT_TEST(calls_sharing_a_connection_with_thirty_greedy_streams_are_answered_within_1_s_p99) {
  /* 30 streams on one connection pipeline 4 MiB requests and never read a reply (grpcio puts
   * the channels of a process with the same options on one connection). Each is held back
   * by its own HTTP/2 window; a Hello, a health check and a new Forward stream on the same
   * connection go through meanwhile. Was: the connection allowed 16 streams, so the probes
   * waited for a slot that greedy streams never gave back (unanswered for 10 s). */
  start(light_model, "--experts all --max-tokens 1024 --max-inflight-bytes 256M");
  grpc_channel *ch = own_channel();
  static greedy g[NSHARED];
  memset(g, 0, sizeof g);
  /* With 16 calls per connection (fd4e1d9) the 17th stream already failed here: its
   * initial metadata waited for a slot until greedy_open's 10 s ran out. */
  for (int i = 0; i < NSHARED; i++)
    MT_EQ_INT(greedy_open_on(&g[i], ch), 0);
  /* Under a sanitizer everything is 5-50x slower: a longer flood and 3 probe rounds, latency
   * reported but not bounded; the counts hold. (20 rounds outlasted a 60 s case under TSan on
   * a slow CI host: 3 probes a round, each waiting behind the greedy streams' frames; 8
   * rounds took 50-90 s of CI's TSan pass, 11 s a round.) */
  const char *san = getenv("SANITIZER");
  const bool sanitized = san && san[0];
  const int np = sanitized ? 3 : NPROBE;
  int taken = 0;
  flood(g, NSHARED, sanitized ? 15000 : 4000, &taken); /* until the budget holds them back */
  double hello[NPROBE], health[NPROBE], fwd[NPROBE];
  int answered = 0;
  for (int i = 0; i < np; i++) {
    pump(g, NSHARED, 1024); /* the greedy streams keep pushing */
    hello[i] = unary_on(ch, PR_METHOD_HELLO, hello_request());
    health[i] = unary_on(ch, PR_METHOD_HEALTH_CHECK, pr_health_request_encode(""));
    fwd[i] = forward1_on(ch);
    answered += (hello[i] >= 0) + (health[i] >= 0) + (fwd[i] >= 0);
    usleep(20 * 1000);
  }
  Moerpc__V1__StatsReply *r = stats();
  uint64_t held = r->held_bytes, budget = r->max_inflight_bytes;
  protobuf_c_message_free_unpacked(&r->base, NULL);
  double *sets[3] = {hello, health, fwd}, p99[3], p50[3];
  for (int k = 0; k < 3; k++) {
    for (int i = 0; i < np; i++)
      if (sets[k][i] < 0) sets[k][i] = 1e9; /* unanswered: worse than any bound */
    p50[k] = median(sets[k], np); /* sorts */
    p99[k] = sets[k][(int)(0.99 * (np - 1) + 0.5)];
  }
  fprintf(stderr,
          "  %d greedy streams on one connection (%d requests of 4 MiB taken, %.0f of %.0f MB "
          "held): %d of %d probes answered on that connection; p50 / p99 / max: Hello %.1f / "
          "%.1f / %.1f ms, health %.1f / %.1f / %.1f ms, 1-token Forward %.1f / %.1f / %.1f ms\n",
          NSHARED, taken, (double)held / 1e6, (double)budget / 1e6, answered, 3 * np,
          p50[0], p99[0], hello[np - 1], p50[1], p99[1], health[np - 1], p50[2], p99[2],
          fwd[np - 1]);
  MT_TRUE(taken >= 8);               /* the flood did reach the server */
  MT_EQ_INT(answered, 3 * np);   /* every probe answered OK, within its 10 s deadline */
  if (!sanitized) {
    for (int k = 0; k < 3; k++) MT_LE(p99[k], 1000.0);
  } else {
    fprintf(stderr, "  (latency not checked under SANITIZER=%s)\n", san);
  }
  greedy_close(g, NSHARED);
  grpc_channel_destroy(ch);
  stop(SIGTERM, 0, 30000);
  finish();
}

MT_TEST(a_request_past_its_budget_is_answered_deadline_exceeded_and_not_computed) {
  start(light_model, "--experts all --max-tokens 64");
  itu_call c;
  MT_EQ_INT(itu_call_open(&c, srv.address, PR_METHOD_FORWARD, 60000), 0);
  char err[400];
  MT_EQ_INT(round_trip(&c, 1, 8, 10000000, err, sizeof err), 0); /* 10 s: computed */
  Moerpc__V1__StatsReply *r = stats();
  uint64_t tok0 = tokens_counted(r);
  protobuf_c_message_free_unpacked(&r->base, NULL);
  MT_EQ_U64(tok0, 8);
  /* 1 us: gone before any thread can take it. */
  MT_EQ_INT(round_trip(&c, 2, 8, 1, err, sizeof err), GRPC_STATUS_DEADLINE_EXCEEDED);
  fprintf(stderr, "  reply: %s\n", err);
  MT_CONTAINS(err, "budget_us = 1");
  r = stats();
  MT_EQ_U64(r->expired, 1);
  MT_EQ_U64(tokens_counted(r), tok0); /* not computed */
  protobuf_c_message_free_unpacked(&r->base, NULL);
  MT_EQ_INT(round_trip(&c, 3, 8, 0, err, sizeof err), 0); /* 0 = no deadline */
  itu_call_finish(&c, 5000);
  itu_call_close(&c);
  stop(SIGTERM, 0, 20000);
  finish();
}

/* Sends n requests of T tokens on c without reading. */
static void send_n(itu_call *c, int n, uint32_t T) {
  for (int i = 0; i < n; i++) MT_EQ_INT(itu_call_send(c, request((uint64_t)i + 1, T, 0), 10000), 0);
}

/* Starts the heavy model with every batch sleeping ms first (MOERPC_TEST_BATCH_DELAY_MS),
 * so that queued work outlasts what a case does next on any CPU: with AMX tiles (Xeon,
 * 2026-12-04, under TSan) all 40 requests of the cancel case were computed before the
 * cancel, and none was left to drop. */
static void start_slow_batches(const char *extra, const char *ms) {
  setenv("MOERPC_TEST_BATCH_DELAY_MS", ms, 1);
  start(heavy_model, extra);
  unsetenv("MOERPC_TEST_BATCH_DELAY_MS");
}

MT_TEST(a_cancelled_stream_frees_its_memory_and_its_queued_work_is_not_computed) {
  start_slow_batches("--experts all --max-tokens 256 --threads 1", "50");
  itu_call c;
  MT_EQ_INT(itu_call_open(&c, srv.address, PR_METHOD_FORWARD, 60000), 0);
  send_n(&c, 40, 256);
  Moerpc__V1__StatsReply *r = stats();
  uint64_t held = r->held_bytes;
  protobuf_c_message_free_unpacked(&r->base, NULL);
  fprintf(stderr, "  40 requests of 1 MiB sent, %.1f MB held\n", (double)held / 1e6);
  MT_TRUE(held > 0);
  grpc_call_cancel(c.call, NULL);
  uint64_t t0 = mr_now_ns();
  MT_EQ_U64(wait_held_zero(10000), 0);
  fprintf(stderr, "  all of it freed %.0f ms after the cancel\n", (double)(mr_now_ns() - t0) / 1e6);
  r = stats();
  uint64_t computed = tokens_counted(r) / 256;
  fprintf(stderr, "  computed %llu of 40, dropped %llu\n", (unsigned long long)computed,
          (unsigned long long)r->dropped);
  MT_TRUE(r->dropped >= 10);
  MT_LE(computed + r->dropped, 40);
  protobuf_c_message_free_unpacked(&r->base, NULL);
  itu_call_close(&c);
  stop(SIGTERM, 0, 20000);
  finish();
}

/* Child: opens a stream to the address read from rd, sends requests without reading, tells
 * the parent and waits to be killed. */
static void doomed_client(int rd, int wr) {
  char address[64] = "";
  if (read(rd, address, sizeof address - 1) <= 0) _exit(3);
  grpc_init();
  itu_call c;
  if (itu_call_open(&c, address, PR_METHOD_FORWARD, 60000) != 0) _exit(4);
  for (int i = 0; i < 30; i++)
    if (itu_call_send(&c, request((uint64_t)i + 1, 256, 0), 10000) != 0) _exit(5);
  if (write(wr, "k", 1) != 1) _exit(6);
  pause();
  _exit(0);
}

MT_TEST(a_client_killed_mid_stream_leaves_nothing_held) {
  int to_child[2], to_parent[2];
  MT_EQ_INT(pipe(to_child), 0);
  MT_EQ_INT(pipe(to_parent), 0);
  fflush(NULL);
  pid_t child = fork(); /* before grpc_init: the child starts its own gRPC */
  MT_TRUE(child >= 0);
  if (child == 0) doomed_client(to_child[0], to_parent[1]);
  start_slow_batches("--experts all --max-tokens 256 --threads 1", "50");
  MT_EQ_INT(write(to_child[1], srv.address, strlen(srv.address)), (long)strlen(srv.address));
  char k;
  MT_EQ_INT(read(to_parent[0], &k, 1), 1);
  Moerpc__V1__StatsReply *r = stats();
  uint64_t held = r->held_bytes;
  protobuf_c_message_free_unpacked(&r->base, NULL);
  MT_TRUE(held > 0);
  MT_EQ_INT(kill(child, SIGKILL), 0);
  int cst;
  MT_EQ_INT(waitpid(child, &cst, 0), child);
  uint64_t t0 = mr_now_ns();
  MT_EQ_U64(wait_held_zero(10000), 0);
  fprintf(stderr, "  %.1f MB held by the killed client, freed %.0f ms after SIGKILL\n",
          (double)held / 1e6, (double)(mr_now_ns() - t0) / 1e6);
  r = stats();
  MT_TRUE(r->dropped > 0);
  protobuf_c_message_free_unpacked(&r->base, NULL);
  close(to_child[0]), close(to_child[1]), close(to_parent[0]), close(to_parent[1]);
  stop(SIGTERM, 0, 20000);
  finish();
}

MT_TEST(streams_past_max_streams_are_refused_resource_exhausted) {
  start(light_model, "--experts all --max-tokens 16 --max-streams 2");
  itu_call a, b, c;
  MT_EQ_INT(itu_call_open(&a, srv.address, PR_METHOD_FORWARD, 10000), 0);
  MT_EQ_INT(itu_call_open(&b, srv.address, PR_METHOD_FORWARD, 10000), 0);
  MT_EQ_INT(round_trip(&a, 1, 1, 0, NULL, 0), 0);
  MT_EQ_INT(round_trip(&b, 1, 1, 0, NULL, 0), 0);
  MT_EQ_INT(itu_call_open(&c, srv.address, PR_METHOD_FORWARD, 10000), 0);
  grpc_byte_buffer *rb = NULL;
  MT_EQ_INT(itu_call_recv(&c, &rb, 10000), 0);
  MT_TRUE(rb == NULL);
  itu_call_finish(&c, 5000);
  char det[300];
  snprintf(det, sizeof det, "%.*s", (int)GRPC_SLICE_LENGTH(c.details),
           (const char *)GRPC_SLICE_START_PTR(c.details));
  fprintf(stderr, "  third stream: status %d: %s\n", c.status, det);
  MT_EQ_INT(c.status, GRPC_STATUS_RESOURCE_EXHAUSTED);
  MT_CONTAINS(det, "--max-streams 2");
  itu_call_close(&c);
  /* A slot frees when a stream ends. */
  itu_call_finish(&b, 5000);
  itu_call_close(&b);
  usleep(200 * 1000);
  MT_EQ_INT(itu_call_open(&c, srv.address, PR_METHOD_FORWARD, 10000), 0);
  MT_EQ_INT(round_trip(&c, 1, 1, 0, NULL, 0), 0);
  itu_call_close(&c);
  itu_call_close(&a);
  stop(SIGTERM, 0, 20000);
  finish();
}

MT_TEST(top_k_is_capped_at_a_factor_of_the_models_and_announced) {
  start("--layers 1 --experts 16 --topk 2 --hidden 64 --inter 16 --vocab 64 --heads 2 "
        "--kv-heads 1 --head-dim 32 --seed 5",
        "--experts all --max-tokens 16");
  itu_call c;
  MT_EQ_INT(itu_call_open(&c, srv.address, PR_METHOD_HELLO, 10000), 0);
  Moerpc__V1__HelloRequest hq = MOERPC__V1__HELLO_REQUEST__INIT;
  hq.protocol_major = PR_PROTOCOL_MAJOR;
  grpc_byte_buffer *rb = NULL;
  MT_EQ_INT(itu_call_send(&c, pr_encode(&hq.base), 5000), 0);
  MT_EQ_INT(itu_call_recv(&c, &rb, 5000), 0);
  ProtobufCMessage *m = NULL;
  MT_EQ_INT(pr_decode(rb, &moerpc__v1__hello_reply__descriptor, 1 << 20, &m, NULL), 0);
  MT_EQ_INT(((Moerpc__V1__HelloReply *)m)->max_top_k, 8); /* 2 x 4 */
  protobuf_c_message_free_unpacked(m, NULL);
  grpc_byte_buffer_destroy(rb);
  itu_call_finish(&c, 5000);
  itu_call_close(&c);

  MT_EQ_INT(itu_call_open(&c, srv.address, PR_METHOD_FORWARD, 10000), 0);
  float x[64] = {0};
  int32_t ids[9] = {0, 1, 2, 3, 4, 5, 6, 7, 8};
  float w[9] = {0};
  MT_EQ_INT(itu_call_send(&c, itu_forward_request_budget(7, 0, 1, 9, ids, 9, w, 9, 1, x, sizeof x, 0), 5000), 0);
  MT_EQ_INT(itu_call_recv(&c, &rb, 5000), 0);
  Moerpc__V1__ForwardReply *r = NULL;
  void *out = NULL;
  size_t len = 0;
  MT_EQ_INT(itu_forward_reply(rb, &r, &out, &len), 0);
  fprintf(stderr, "  top_k 9: %s\n", r->error);
  MT_EQ_INT(r->status, GRPC_STATUS_INVALID_ARGUMENT);
  MT_CONTAINS(r->error, "max_top_k = 8");
  moerpc__v1__forward_reply__free_unpacked(r, NULL);
  free(out);
  grpc_byte_buffer_destroy(rb);
  itu_call_close(&c);
  stop(SIGTERM, 0, 20000);
  finish();
}

/* ---- drain ------------------------------------------------------------------------------ */

/* Health/Check on an existing channel; the serving status or -1. */
static int health_on(grpc_channel *ch) {
  grpc_byte_buffer *resp = NULL;
  int st = -1;
  if (itu_unary_reply_on(ch, PR_METHOD_HEALTH_CHECK, pr_health_request_encode(""), 5000, &resp) < 0 ||
      pr_health_response_decode(resp, &st, NULL) != 0)
    st = -1;
  if (resp) grpc_byte_buffer_destroy(resp);
  return st;
}

#define NDRAIN 60

/* The replies of the drain test's stream, counted by status. */
typedef struct drain_reader {
  itu_call *c;
  int ok, unavailable, other, bad_reply;
} drain_reader;

static void *drain_read(void *arg) {
  drain_reader *d = arg;
  for (int i = 0; i < NDRAIN; i++) {
    grpc_byte_buffer *rb = NULL;
    if (itu_call_recv(d->c, &rb, 10000) != 0 || !rb) break;
    Moerpc__V1__ForwardReply *r = NULL;
    void *out = NULL;
    size_t len = 0;
    if (itu_forward_reply(rb, &r, &out, &len) != 0) {
      d->bad_reply++;
    } else {
      if (r->status == 0) d->ok++;
      else if (r->status == GRPC_STATUS_UNAVAILABLE) d->unavailable++;
      else d->other++;
      moerpc__v1__forward_reply__free_unpacked(r, NULL);
    }
    free(out);
    grpc_byte_buffer_destroy(rb);
  }
  return NULL;
}

MT_TEST(sigterm_under_load_answers_every_accepted_request_and_health_says_not_serving) {
  /* Under a sanitizer one merged batch of 256 tokens can take over a second to compute
   * (TSan, 2 loaded cores): the drain would then cut the batch in flight (exit 3,
   * "accepted unanswered"), which is the drain timeout working, not what this case checks.
   * So there: batches of one 64-token request, and 3 s, which still leaves most of the
   * queued work unanswered. */
  const char *san = getenv("SANITIZER");
  /* And every batch sleeps too (MOERPC_TEST_BATCH_DELAY_MS), so the queue holds more work
   * than the drain timeout whatever the CPU: with AMX tiles all 60 requests were computed
   * within the 400 ms (2026-12-04, Xeon), and none was left to answer UNAVAILABLE. */
  setenv("MOERPC_TEST_BATCH_DELAY_MS", san && *san ? "80" : "20", 1);
  start(heavier_model, san && *san ? "--experts all --max-tokens 64 --threads 1 --drain-timeout-ms 3000"
                                   : "--experts all --max-tokens 256 --threads 1 --drain-timeout-ms 400");
  unsetenv("MOERPC_TEST_BATCH_DELAY_MS");
  grpc_arg args[PR_CHANNEL_ARGS];
  grpc_channel_args ca = {pr_channel_args(args, 64 << 20), args};
  char target[300];
  pr_target_from_address(srv.address, target, sizeof target);
  grpc_channel_credentials *cr = grpc_insecure_credentials_create();
  grpc_channel *ch = grpc_channel_create(target, cr, &ca);
  grpc_channel_credentials_release(cr);
  MT_EQ_INT(health_on(ch), PR_HEALTH_SERVING);

  /* 60 requests of at least 20 ms each queued: more than the 400 ms drain timeout allows.
   * Under a sanitizer one request of 256 tokens can take longer than the drain's last
   * second for open calls (seen under TSan: the one being computed at the timeout was
   * cut, exit 3); 64 tokens still queue far more than 400 ms of work. */
  const uint32_t T_DRAIN = san && *san ? 64 : 256;
  itu_call c;
  MT_EQ_INT(itu_call_open(&c, srv.address, PR_METHOD_FORWARD, 60000), 0);
  send_n(&c, NDRAIN, T_DRAIN);
  usleep(100 * 1000);
  MT_EQ_INT(kill(srv.pid, SIGTERM), 0);
  /* The replies are read from now on, on a thread of their own: a client that stopped
   * reading during the drain (this one, busy with the checks below, which are slow under
   * a sanitizer) would have its unsent replies cut when the drain ends the calls. */
  drain_reader rd = {.c = &c};
  pthread_t rt;
  MT_EQ_INT(pthread_create(&rt, NULL, drain_read, &rd), 0);
  usleep(100 * 1000);
  MT_EQ_INT(health_on(ch), PR_HEALTH_NOT_SERVING); /* the open channel still gets answers */
  /* A new stream during the drain is refused UNAVAILABLE at once. */
  itu_call late;
  MT_EQ_INT(itu_call_open(&late, srv.address, PR_METHOD_FORWARD, 5000), 0);
  itu_call_finish(&late, 5000);
  MT_EQ_INT(late.status, GRPC_STATUS_UNAVAILABLE);
  itu_call_close(&late);

  pthread_join(rt, NULL);
  const int ok = rd.ok, unavailable = rd.unavailable, other = rd.other;
  MT_EQ_INT(rd.bad_reply, 0);
  itu_call_finish(&c, 10000);
  fprintf(stderr, "  %d accepted: %d OK, %d UNAVAILABLE, %d other; stream status %d\n", NDRAIN,
          ok, unavailable, other, c.status);
  MT_EQ_INT(other, 0);
  MT_TRUE(unavailable > 0);
  /* Every request the server read is answered. One it had not read when the drain ended
   * the stream (its reads paused by the stream's admission limits, which happens on a
   * loaded host or under a sanitizer) was never accepted: the stream then ends
   * UNAVAILABLE, which tells the client to send the rest elsewhere. */
  if (ok + unavailable == NDRAIN) {
    /* Seen once in CI (ASan, 2026-12-06): every reply came, then status UNAVAILABLE; not
     * reproduced in 26 runs here. The server's drain lines tell which path ended it. */
    if (c.status != GRPC_STATUS_OK) dump_log();
    MT_EQ_INT(c.status, GRPC_STATUS_OK);
  } else {
    fprintf(stderr, "  %d requests were not read before the drain ended the stream\n",
            NDRAIN - ok - unavailable);
    MT_TRUE(ok + unavailable < NDRAIN);
    MT_EQ_INT(c.status, GRPC_STATUS_UNAVAILABLE);
  }
  itu_call_close(&c);
  /* The open, idle channel does not hold the exit up. */
  uint64_t t0 = mr_now_ns();
  stop(0, 0, 20000);
  double secs = (double)(mr_now_ns() - t0) / 1e9;
  fprintf(stderr, "  exited %.2f s after the last reply, with a client channel still open\n", secs);
  MT_LE(secs, 2.0);
  char line[512];
  log_line("stopped:", line, sizeof line);
  fprintf(stderr, "  server: %s", line);
  MT_CONTAINS(line, " 0 accepted unanswered");
  grpc_channel_destroy(ch);
  finish();
}

MT_TEST(an_idle_connection_does_not_delay_the_exit) {
  start(light_model, "--experts all --max-tokens 16");
  grpc_arg args[PR_CHANNEL_ARGS];
  grpc_channel_args ca = {pr_channel_args(args, 64 << 20), args};
  char target[300];
  pr_target_from_address(srv.address, target, sizeof target);
  grpc_channel_credentials *cr = grpc_insecure_credentials_create();
  grpc_channel *ch = grpc_channel_create(target, cr, &ca);
  grpc_channel_credentials_release(cr);
  MT_EQ_INT(health_on(ch), PR_HEALTH_SERVING);
  uint64_t t0 = mr_now_ns();
  stop(SIGTERM, 0, 20000);
  double secs = (double)(mr_now_ns() - t0) / 1e9;
  fprintf(stderr, "  exited %.2f s after SIGTERM with an idle connection open\n", secs);
  MT_LE(secs, 1.0);
  grpc_channel_destroy(ch);
  finish();
}

MT_MAIN()
