/*
 * itest_failover.c - replicas and failover with real server processes on loopback
 * (docs/DESIGN.md "Replicas and failover").
 *
 *   three servers, each expert on exactly two of them (experts in thirds A = 0-2,
 *   B = 3-5, C = 6-7: s0 owns A+B, s1 B+C, s2 C+A): greedy decode steps in process,
 *   `kill -9` of s1 after a few tokens -> no step fails and every token (and every step's
 *   logits within 1e-5, the tolerance of itest_model) equals the all-local run; the
 *   failover time (s1's last good reply -> the first rerouted reply) and the step latency
 *   during the failover are printed;
 *   s1 restarted on the same port during the generation -> it passes a fresh Hello and
 *   gets requests again (its Stats request count grows after the restart);
 *   the CLI: `moerpc-client generate` with a server killed mid-way exits 0, prints the same
 *   tokens as the all-local run and a "failover:" summary line;
 *   without replicas (experts 0-3 on one server, 4-7 on another) a kill -9 fails the next
 *   step within the deadline, naming the server and the experts with no live replica;
 *   one server listed twice (127.0.0.1:P and localhost:P) is one server, not two replicas:
 *   the library marks the second entry an alias (same Hello instance_id, one WARN naming
 *   both addresses), `moerpc-client info` says so and counts no pair as replicated, and
 *   `moerpc-place stats` asks it once.
 */
#include <grpc/grpc.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "gpu_client/runner/model.h"
#include "tests/integration/util.h"
#include "tests/unit/mt.h"

#define SHAPE "--layers 4 --experts 8 --topk 4 --hidden 64 --inter 32 --vocab 96 --heads 4 " \
              "--kv-heads 2 --head-dim 16"
#define V 96u
#define T_PROMPT 10u
#define N_GEN 100u /* decode steps of the in-process run (max_seq 128) */
#define KILL_AT 5u /* s1 dies right before this decode step */

static char *tmp;
static char model[600];
static const int32_t prompt[T_PROMPT] = {3, 14, 15, 92, 65, 35, 89, 79, 32, 38};

static void write_file(const char *path, const char *text) {
  FILE *f = fopen(path, "w");
  MT_TRUE(f != NULL);
  fputs(text, f);
  MT_EQ_INT(fclose(f), 0);
}

static void write_cluster(const char *path, itu_server *const *s, int n, int deadline_ms) {
  char text[2048];
  int pos = snprintf(text, sizeof text, "{\"deadline_ms\": %d, \"servers\": [", deadline_ms);
  for (int i = 0; i < n; i++)
    pos += snprintf(text + pos, sizeof text - (size_t)pos, "%s{\"name\": \"s%d\", \"address\": "
                    "\"%s\"}", i ? ", " : "", i, s[i]->address);
  snprintf(text + pos, sizeof text - (size_t)pos, "]}");
  write_file(path, text);
}

static void setup(void) {
  grpc_init();
  tmp = itu_tmpdir();
  MT_TRUE(tmp != NULL);
  snprintf(model, sizeof model, "%s/model", tmp);
  MT_EQ_INT(itu_make_model(model, SHAPE " --seed 21"), 0);
  itu_server_isa("ref"); /* the reference kernels on every side: comparable at 1e-5 */
}

static int open_runner(gc_model **m, const char *cluster, mr_err *e) {
  gc_model_opts o;
  gc_model_opts_init(&o);
  o.model_dir = model;
  o.cluster_path = cluster;
  o.local_experts = -1;
  o.max_seq = 128;
  o.engine.isa = KN_ISA_REF;
  o.engine.threads = 1;
  o.wire = MR_DTYPE_F32;
  o.quiet = true;
  return gc_model_open(m, &o, e);
}

static int32_t argmax(const float *l) {
  int32_t b = 0;
  for (uint32_t i = 1; i < V; i++)
    if (l[i] > l[b]) b = (int32_t)i; /* ties to the lower id, as gc_sample's greedy */
  return b;
}

/* Greedy decoding, one gc_model_step per token. */
typedef struct decoder {
  gc_model *m;
  uint32_t pos;
  int32_t next;
  float logits[T_PROMPT * V];
} decoder;

static int dec_prefill(decoder *d, mr_err *e) {
  uint32_t seq[T_PROMPT] = {0}, pos[T_PROMPT];
  for (uint32_t i = 0; i < T_PROMPT; i++) pos[i] = i;
  gc_model_seq_reset(d->m, 0);
  gc_step s = {.n_tokens = T_PROMPT, .ids = prompt, .seq = seq, .pos = pos,
               .logits = d->logits};
  int rc = gc_model_step(d->m, &s, e);
  d->pos = T_PROMPT;
  d->next = argmax(d->logits + (T_PROMPT - 1) * V);
  return rc;
}

/* One decode step of d->next; *us gets its latency. */
static int dec_step(decoder *d, uint64_t *us, mr_err *e) {
  uint32_t seq = 0, pos = d->pos;
  gc_step s = {.n_tokens = 1, .ids = &d->next, .seq = &seq, .pos = &pos, .logits = d->logits};
  uint64_t t0 = mr_now_ns();
  int rc = gc_model_step(d->m, &s, e);
  if (us) *us = (mr_now_ns() - t0) / 1000u;
  if (rc) return rc;
  d->pos++;
  d->next = argmax(d->logits);
  return 0;
}

static int cmp_u64(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}

/* Requests server idx's process has answered since it started (Stats). */
static uint64_t stats_requests(gc_cluster *c, uint32_t idx) {
  gc_stats st;
  mr_err e = {0};
  MT_OK(gc_cluster_stats(c, idx, false, &st, &e), &e);
  uint64_t n = st.requests;
  gc_stats_close(&st);
  return n;
}

MT_TEST(kill9_replica_mid_generation_same_tokens_then_restart) {
  setup();
  itu_server s0, s1, s2;
  MT_EQ_INT(itu_server_start(&s0, model, "--experts 0-5", tmp, 60000), 0);
  MT_EQ_INT(itu_server_start(&s1, model, "--experts 3-7", tmp, 60000), 0);
  MT_EQ_INT(itu_server_start(&s2, model, "--experts 0-2,6-7", tmp, 60000), 0);
  char cluster[700];
  snprintf(cluster, sizeof cluster, "%s/cluster3.json", tmp);
  itu_server *ss[3] = {&s0, &s1, &s2};
  write_cluster(cluster, ss, 3, 5000);
  mr_err e = {0};

  /* The all-local reference. */
  static int32_t ref_tok[N_GEN];
  static float ref_logits[N_GEN][V];
  static decoder d;
  MT_OK(open_runner(&d.m, NULL, &e), &e);
  MT_OK(dec_prefill(&d, &e), &e);
  for (uint32_t i = 0; i < N_GEN; i++) {
    ref_tok[i] = d.next;
    MT_OK(dec_step(&d, NULL, &e), &e);
    memcpy(ref_logits[i], d.logits, sizeof ref_logits[i]);
  }
  gc_model_close(d.m);

  MT_OK(open_runner(&d.m, cluster, &e), &e);
  gc_cluster *c = gc_model_cluster(d.m);
  MT_TRUE(c != NULL);
  for (uint32_t x = 0; x < 8; x++) {
    int n = 0;
    for (uint32_t s = 0; s < 3; s++) n += gc_server_announces(c, s, 1, x);
    MT_EQ_INT(n, 2); /* each expert on exactly two servers */
  }
  MT_OK(dec_prefill(&d, &e), &e);
  static uint64_t lat[N_GEN];
  uint32_t n_steps = 0, failed = 0, mismatched = 0;
  double worst = 0;
  uint64_t kill_step_us = 0, t_restarted = 0;
  uint64_t returned_at = 0, s1_after = 0;
  double back_ms = -1;
  bool restarted = false;
  for (uint32_t i = 0; i < N_GEN; i++) {
    if (i == KILL_AT) {
      /* No wait for the death: the step below is in flight when the stream breaks. */
      kill(s1.pid, SIGKILL);
    }
    if (i == KILL_AT + 10) {
      /* Restart on the same port while decoding goes on (the model loads in ~1 s). */
      int st;
      waitpid(s1.pid, &st, 0);
      s1.pid = 0;
      MT_EQ_INT(itu_server_restart(&s1, model, "--experts 3-7", tmp, 60000), 0);
      t_restarted = mr_now_ns();
      restarted = true;
    }
    MT_EQ_INT(d.next, ref_tok[i]);
    mismatched += d.next != ref_tok[i];
    int rc = dec_step(&d, &lat[i], &e);
    if (rc) {
      fprintf(stderr, "  step %u failed: %s\n", i, e.msg);
      failed++;
      break;
    }
    n_steps++;
    if (i == KILL_AT) kill_step_us = lat[i];
    double err = kn_rel_l2(d.logits, ref_logits[i], V);
    if (err > worst) worst = err;
    if (restarted && !returned_at) {
      gc_server_counters ct;
      MT_OK(gc_server_counters_get(c, 1, false, &ct, &e), &e);
      if (ct.returns) {
        returned_at = i;
        back_ms = (double)(mr_now_ns() - t_restarted) / 1e6;
      }
    }
    /* Pace the steps after the restart so that the prober's backoff (up to 2 s) fits in. */
    if (restarted && !returned_at) usleep(100 * 1000);
    if (returned_at && i >= returned_at + 5) {
      s1_after = stats_requests(c, 1);
      if (s1_after > 0) break;
    }
  }
  gc_server_counters ct;
  MT_OK(gc_server_counters_get(c, 1, false, &ct, &e), &e);
  uint64_t sorted[N_GEN];
  memcpy(sorted, lat, n_steps * sizeof *lat);
  qsort(sorted, n_steps, sizeof *sorted, cmp_u64);
  uint64_t max_during = 0;
  for (uint32_t i = KILL_AT; i < KILL_AT + 10 && i < n_steps; i++)
    if (lat[i] > max_during) max_during = lat[i];
  fprintf(stderr,
          "  kill -9 s1 before decode step %u: %u steps, %u failed, %u tokens differ, logits "
          "rel L2 <= %.2e\n"
          "  failover: %.3f ms (s1's last good reply -> first rerouted reply), %llu requests "
          "resent, %llu failover(s)\n"
          "  step latency: median %.3f ms, the step during the failover %.3f ms, max of the "
          "10 steps from the kill %.3f ms\n"
          "  restart: s1 back %.0f ms after its restart (step %llu), %llu requests served by "
          "the restarted process, down %.0f ms in all\n",
          KILL_AT, n_steps, failed, mismatched, worst, ct.last_failover_us / 1e3,
          (unsigned long long)ct.resent, (unsigned long long)ct.failovers,
          sorted[n_steps / 2] / 1e3, kill_step_us / 1e3, max_during / 1e3,
          back_ms, (unsigned long long)returned_at,
          (unsigned long long)s1_after, ct.down_us / 1e3);
  MT_EQ_INT(failed, 0);
  MT_EQ_INT(mismatched, 0);
  MT_LE(worst, 1e-5);
  MT_TRUE(ct.failovers >= 1);
  MT_EQ_INT(ct.refusals, 0);
  MT_TRUE(ct.returns >= 1);
  MT_TRUE(s1_after > 0); /* the restarted process got requests */
  gc_model_close(d.m);
  int st;
  MT_EQ_INT(itu_server_stop(&s0, SIGTERM, 15000, &st), 0);
  MT_EQ_INT(itu_server_stop(&s1, SIGTERM, 15000, &st), 0);
  MT_EQ_INT(itu_server_stop(&s2, SIGTERM, 15000, &st), 0);
  itu_rm_rf(tmp);
  grpc_shutdown();
}

/* Runs `moerpc-client generate` with args; out gets its stdout+stderr (static buffer). */
static int read_log(const char *path, char *buf, size_t len) {
  FILE *f = fopen(path, "r");
  size_t n = f ? fread(buf, 1, len - 1, f) : 0;
  if (f) fclose(f);
  buf[n] = 0;
  return (int)n;
}

static const char *seq_line(const char *out) {
  const char *p = strstr(out, "seq 0:");
  return p ? p : "";
}

MT_TEST(cli_generate_kill9_replica_same_tokens_and_summary) {
  setup();
  itu_server s0, s1, s2;
  MT_EQ_INT(itu_server_start(&s0, model, "--experts 0-5", tmp, 60000), 0);
  MT_EQ_INT(itu_server_start(&s1, model, "--experts 3-7", tmp, 60000), 0);
  MT_EQ_INT(itu_server_start(&s2, model, "--experts 0-2,6-7", tmp, 60000), 0);
  char cluster[700], log[700], cmd[4096];
  snprintf(cluster, sizeof cluster, "%s/cluster3.json", tmp);
  itu_server *ss[3] = {&s0, &s1, &s2};
  write_cluster(cluster, ss, 3, 5000);
  static char ref[1 << 16], got[1 << 16];
  const char *gen = "generate --prompt-ids 3,14,15,92 --max-new 1500 --max-seq 1510 "
                    "--threads 1 --wire f32 --isa ref --quiet";

  snprintf(log, sizeof log, "%s/gen-local.log", tmp);
  snprintf(cmd, sizeof cmd, "'%s' %s --model '%s' >'%s' 2>&1", itu_bin("moerpc-client"), gen,
           model, log);
  MT_EQ_INT(system(cmd), 0);
  read_log(log, ref, sizeof ref);

  snprintf(log, sizeof log, "%s/gen-cluster.log", tmp);
  snprintf(cmd, sizeof cmd, "exec '%s' %s --model '%s' --cluster '%s' >'%s' 2>&1",
           itu_bin("moerpc-client"), gen, model, cluster, log);
  fflush(NULL);
  pid_t pid = fork();
  MT_TRUE(pid >= 0);
  if (pid == 0) {
    execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
    _exit(127);
  }
  usleep(700 * 1000);
  int st;
  MT_EQ_INT(waitpid(pid, &st, WNOHANG), 0); /* still generating */
  kill(s2.pid, SIGKILL);
  MT_EQ_INT(waitpid(pid, &st, 0), pid);
  read_log(log, got, sizeof got);
  const char *fo = strstr(got, "failover:");
  fprintf(stderr, "  generate exited %d; %.300s\n", WIFEXITED(st) ? WEXITSTATUS(st) : -1,
          fo ? fo : "(no failover line)");
  MT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  MT_TRUE(fo != NULL);
  MT_CONTAINS(got, "failover: s2 (");
  /* The same 1500 tokens as the all-local run. */
  const char *a = seq_line(ref), *b = seq_line(got);
  size_t la = strcspn(a, "\n"), lb = strcspn(b, "\n");
  MT_TRUE(la > 10);
  MT_EQ_INT(la, lb);
  MT_EQ_INT(memcmp(a, b, la), 0);
  s2.pid = 0;
  MT_EQ_INT(itu_server_stop(&s0, SIGTERM, 15000, &st), 0);
  MT_EQ_INT(itu_server_stop(&s1, SIGTERM, 15000, &st), 0);
  itu_rm_rf(tmp);
  grpc_shutdown();
}

MT_TEST(kill9_without_replica_fails_naming_server_bounded) {
  setup();
  itu_server s0, s1;
  MT_EQ_INT(itu_server_start(&s0, model, "--experts 0-3", tmp, 60000), 0);
  MT_EQ_INT(itu_server_start(&s1, model, "--experts 4-7", tmp, 60000), 0);
  char cluster[700];
  snprintf(cluster, sizeof cluster, "%s/cluster2.json", tmp);
  itu_server *ss[2] = {&s0, &s1};
  write_cluster(cluster, ss, 2, 2000);
  mr_err e = {0};
  static decoder d;
  MT_OK(open_runner(&d.m, cluster, &e), &e);
  MT_OK(dec_prefill(&d, &e), &e);
  for (uint32_t i = 0; i < 3; i++) MT_OK(dec_step(&d, NULL, &e), &e);
  kill(s1.pid, SIGKILL);
  int st;
  waitpid(s1.pid, &st, 0);
  s1.pid = 0;
  uint64_t t0 = mr_now_ns();
  int rc = 0;
  uint32_t steps = 0;
  /* The first step after the death fails (every token routes some slot to experts 4-7
   * with top-4 of 8), at the latest by the next one. */
  for (; steps < 3 && rc == 0; steps++) rc = dec_step(&d, NULL, &e);
  double ms = (double)(mr_now_ns() - t0) / 1e6;
  fprintf(stderr, "  no replica: step failed after %.1f ms (%u steps): %s\n", ms, steps, e.msg);
  MT_EQ_INT(rc, MR_EUNAVAIL);
  MT_CONTAINS(e.msg, "server s1 (");
  MT_CONTAINS(e.msg, "no live replica");
  MT_TRUE(ms < 2000); /* within the deadline: a dead server fails at once */
  gc_model_close(d.m);
  MT_EQ_INT(itu_server_stop(&s0, SIGTERM, 15000, &st), 0);
  itu_rm_rf(tmp);
  grpc_shutdown();
}

/* The sum of the "counts" rows of a moerpc-stats file's text equals want. */
static void pl_total_check(const char *json, uint64_t want) {
  const char *p = strstr(json, "\"counts\"");
  MT_TRUE(p != NULL);
  uint64_t sum = 0;
  for (p = strchr(p, '['); p && *p; p++)
    if (*p >= '0' && *p <= '9') {
      char *end;
      sum += strtoull(p, &end, 10);
      p = end - 1;
    }
  fprintf(stderr, "  moerpc-place stats: %llu slots (the layer call had %llu)\n",
          (unsigned long long)sum, (unsigned long long)want);
  MT_EQ_U64(sum, want);
}

MT_TEST(one_server_under_two_addresses_counts_once) {
  setup();
  itu_server s0;
  MT_EQ_INT(itu_server_start(&s0, model, "--experts all", tmp, 60000), 0);
  char cluster[700], text[1024];
  snprintf(cluster, sizeof cluster, "%s/alias.json", tmp);
  snprintf(text, sizeof text, "{\"deadline_ms\": 5000, \"servers\": [{\"name\": \"s0\", "
           "\"address\": \"127.0.0.1:%d\"}, {\"name\": \"s1\", \"address\": "
           "\"localhost:%d\"}]}", s0.port, s0.port);
  write_file(cluster, text);

  /* The library: s1 is an alias of s0, announces nothing of its own, and a layer call goes
   * through s0 alone. */
  gc_cluster *c = NULL;
  gc_options o;
  gc_options_init(&o);
  o.deadline_ms = 5000;
  mr_err e = {0};
  MT_OK(gc_cluster_open(&c, cluster, &o, &e), &e);
  gc_server_info si0, si1;
  MT_OK(gc_server_info_get(c, 0, &si0, &e), &e);
  MT_OK(gc_server_info_get(c, 1, &si1, &e), &e);
  fprintf(stderr, "  s0 instance %s, s1 instance %s, alias_of %d\n", si0.instance_id,
          si1.instance_id, si1.alias_of);
  MT_EQ_INT(si0.alias_of, -1);
  MT_EQ_INT(si1.alias_of, 0);
  MT_EQ_U64(strlen(si0.instance_id), 32);
  MT_EQ_STR(si0.instance_id, si1.instance_id);
  MT_TRUE(gc_server_announces(c, 0, 1, 3));
  MT_FALSE(gc_server_announces(c, 1, 1, 3));
  enum { T = 5, K = 4, H = 64 };
  static float x[T * H], out[T * H];
  int32_t ids[T * K];
  float w[T * K];
  for (int i = 0; i < T * H; i++) x[i] = (float)((i * 7) % 13) / 13.0f - 0.5f;
  for (int i = 0; i < T * K; i++) {
    ids[i] = i % 8;
    w[i] = 0.25f;
  }
  gc_layer_req r = {.layer = 1, .n_tokens = T, .top_k = K, .ids = ids, .weights = w, .x = x,
                    .dtype = MR_DTYPE_F32};
  MT_OK(gc_layer_forward(c, &r, out, &e), &e);
  gc_server_counters ct0, ct1;
  MT_OK(gc_server_counters_get(c, 0, false, &ct0, &e), &e);
  MT_OK(gc_server_counters_get(c, 1, false, &ct1, &e), &e);
  MT_EQ_U64(ct0.replies, 1);
  MT_EQ_U64(ct1.requests, 0);
  gc_cluster_close(c);

  /* The CLI: info names the alias and counts no pair on two servers. */
  char log[700], cmd[2048];
  static char got[1 << 16];
  snprintf(log, sizeof log, "%s/info.log", tmp);
  snprintf(cmd, sizeof cmd, "'%s' info --cluster '%s' >'%s' 2>&1", itu_bin("moerpc-client"),
           cluster, log);
  MT_EQ_INT(system(cmd), 0);
  read_log(log, got, sizeof got);
  fprintf(stderr, "%s", got);
  char want[300];
  snprintf(want, sizeof want, "server s1           localhost:%d", s0.port);
  MT_CONTAINS(got, want);
  MT_CONTAINS(got, "the same server as s0 (127.0.0.1:");
  MT_CONTAINS(got, "pairs on 1 server;");
  MT_TRUE(strstr(got, "pairs on 2 servers") == NULL);
  /* The WARN names both addresses. */
  snprintf(want, sizeof want, "server s0 (127.0.0.1:%d) and server s1 (localhost:%d) are one "
           "server", s0.port, s0.port);
  MT_CONTAINS(got, want);

  /* moerpc-place stats: the server's counts once, not twice. */
  snprintf(log, sizeof log, "%s/stats.json", tmp);
  snprintf(cmd, sizeof cmd, "'%s' stats --cluster '%s' -o '%s' --log warn", itu_bin("moerpc-place"),
           cluster, log);
  MT_EQ_INT(system(cmd), 0);
  read_log(log, got, sizeof got);
  pl_total_check(got, T * K);
  int st;
  MT_EQ_INT(itu_server_stop(&s0, SIGTERM, 15000, &st), 0);
  itu_rm_rf(tmp);
  grpc_shutdown();
}

MT_MAIN()
