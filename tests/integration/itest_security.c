/*
 * itest_security.c - TLS, mTLS, the bearer token, the loopback rule and keepalive, against
 * real moerpc-server processes on loopback, with certificates made at test time by the
 * openssl CLI (a CA, a server certificate for 127.0.0.1 / localhost, a client certificate,
 * and a second CA that signed nothing of ours):
 *   - TLS: Hello + a Forward round trip through the client library; the server name checked
 *     by IP SAN and by tls.server_name; a client trusting the other CA, a plaintext client
 *     and an mTLS server's client without a certificate all fail cleanly, naming the server;
 *   - token: missing / wrong / right for Hello, Stats (reset) and a Forward stream (refused
 *     at accept: status UNAUTHENTICATED, no request processed); health without a token; the
 *     token never appears in a reply or the server log;
 *   - --listen 0.0.0.0 without TLS: exit 2 naming --insecure; with --insecure it serves;
 *   - an idle stream lives through many keepalive periods (MOERPC_KEEPALIVE_TIME_MS=300 on
 *     both sides) without a too_many_pings GOAWAY: the same stream still answers;
 *   - a token file that is a FIFO: a clean error at once, on the server and on the client;
 *   - token and key files readable by others refused (server and client), naming the mode;
 *   - an expired or not-yet-valid certificate, or a key of another certificate, refused at
 *     start naming the file and the dates;
 *   - SIGHUP: the certificate and the token reloaded (new connections and calls use them),
 *     a bad reload refused with the old credentials kept, a plaintext server serving on.
 */
#include <grpc/byte_buffer.h>
#include <grpc/support/alloc.h>
#include <grpc/support/log.h>
#include <grpc/support/time.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <signal.h>
#include <sys/stat.h>

#include "expert_server/es.h"
#include "gpu_client/rpc/moerpc_client.h"
#include "tests/integration/util.h"
#include "tests/unit/mt.h"

#define TOKEN "itest-T0ken_0123456789abcdef"
#define SHAPE "--layers 2 --experts 8 --topk 2 --hidden 64 --inter 32 --vocab 64 --heads 2 " \
              "--kv-heads 1 --head-dim 32 --seed 5"

static char *tmp;
static char model[600];
static itu_server srv;
static char *ca_pem, *cert_pem, *key_pem; /* the client's view, PEM text */

static char *slurp(const char *name) {
  char p[700];
  snprintf(p, sizeof p, "%s/%s", tmp, name);
  char *t = NULL;
  mr_err e;
  MT_OK(mr_file_read(p, 1 << 20, &t, NULL, &e), &e);
  return t;
}

/* tmp/NAME as a path, in one of a few rotating buffers. */
static const char *path(const char *name) {
  static char b[8][700];
  static int k;
  char *p = b[k++ & 7];
  snprintf(p, sizeof b[0], "%s/%s", tmp, name);
  return p;
}

/* Writes tmp/NAME, mode 0600: token and key files readable by others are refused. */
static void write_text(const char *name, const char *text) {
  FILE *f = fopen(path(name), "w");
  MT_TRUE(f != NULL);
  fputs(text, f);
  fclose(f);
  MT_EQ_INT(chmod(path(name), 0600), 0);
}

/* Model, certificates and token file; skips (never passes) without the openssl CLI. */
static void setup(void) {
  if (system("command -v openssl >/dev/null 2>&1") != 0)
    MT_SKIP("the openssl CLI is not installed (deploy/install-deps.sh installs it): no "
            "certificates to test TLS with");
  grpc_init();
  tmp = itu_tmpdir();
  MT_TRUE(tmp != NULL);
  snprintf(model, sizeof model, "%s/model", tmp);
  MT_EQ_INT(itu_make_model(model, SHAPE), 0);
  char cmd[4096];
  const char *ec = "-newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes";
  snprintf(cmd, sizeof cmd,
           "cd '%s' && {"
           " openssl req -x509 %s -keyout ca.key -out ca.pem -days 2 -subj /CN=moerpc-test-ca &&"
           " openssl req -x509 %s -keyout other.key -out other.pem -days 2 -subj /CN=other-ca &&"
           " openssl req %s -keyout server.key -out server.csr -subj /CN=localhost &&"
           " printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\\nextendedKeyUsage=serverAuth\\n'"
           "   > server.ext &&"
           " openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial"
           "   -out server.pem -days 2 -extfile server.ext &&"
           " openssl req %s -keyout client.key -out client.csr -subj /CN=moerpc-client &&"
           " printf 'extendedKeyUsage=clientAuth\\n' > client.ext &&"
           " openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial"
           "   -out client.pem -days 2 -extfile client.ext;"
           " } >openssl.log 2>&1 || { cat openssl.log >&2; exit 1; }",
           tmp, ec, ec, ec, ec);
  MT_EQ_INT(system(cmd), 0);
  ca_pem = slurp("ca.pem");
  cert_pem = slurp("client.pem");
  key_pem = slurp("client.key");
  write_text("token", TOKEN "\n");
  write_text("wrong-token", "not-the-token\n");
}

static void finish(void) {
  if (srv.pid > 0) itu_server_stop(&srv, SIGKILL, 5000, NULL);
  itu_rm_rf(tmp);
  grpc_shutdown();
}

/* Writes a one-server cluster file (extra: more top-level JSON members, leading comma). */
static const char *cluster(const char *name, const char *extra) {
  char j[2048];
  snprintf(j, sizeof j, "{\"servers\": [{\"name\": \"s0\", \"address\": \"%s\"}]%s}\n",
           srv.address, extra ? extra : "");
  write_text(name, j);
  return path(name);
}

static int open_cluster_ms(const char *file, uint32_t connect_ms, gc_cluster **c, mr_err *e) {
  gc_options o;
  gc_options_init(&o);
  o.connect_timeout_ms = connect_ms;
  o.deadline_ms = 10000;
  mr_err_clear(e);
  return gc_cluster_open(c, file, &o, e);
}
/* Expected to connect: a generous timeout (a TLS handshake under TSan on a loaded host). */
static int open_cluster(const char *file, gc_cluster **c, mr_err *e) {
  return open_cluster_ms(file, 4000, c, e);
}
/* Expected to be refused: a refused handshake is only seen as the timeout, so a short one
 * (each of these cases waits it out in full). */
#define REFUSED_CONNECT_MS 1500u
static int open_refused(const char *file, gc_cluster **c, mr_err *e) {
  return open_cluster_ms(file, REFUSED_CONNECT_MS, c, e);
}

/* One layer call of 3 tokens through c; returns its rc. */
static int forward(gc_cluster *c, mr_err *e) {
  float x[3 * 64], out[3 * 64];
  int32_t ids[6] = {0, 1, 2, 3, 4, 5};
  float w[6] = {0.5f, 0.5f, 0.7f, 0.3f, 0.9f, 0.1f};
  for (int i = 0; i < 3 * 64; i++) x[i] = (float)((i * 37) % 17) / 17.0f - 0.5f;
  gc_layer_req r = {.layer = 0, .n_tokens = 3, .top_k = 2, .ids = ids, .weights = w, .x = x,
                    .dtype = MR_DTYPE_F32};
  mr_err_clear(e);
  int rc = gc_layer_forward(c, &r, out, e);
  if (rc == 0) {
    double s = 0;
    for (int i = 0; i < 3 * 64; i++) s += out[i] * out[i];
    MT_TRUE(s > 0); /* the experts computed something */
  }
  return rc;
}

/* True if the server log holds needle. */
static bool log_has(const char *needle) {
  char *t = NULL;
  if (mr_file_read(srv.log, 64 << 20, &t, NULL, NULL) != 0) return false;
  bool has = strstr(t, needle) != NULL;
  mr_free(t);
  return has;
}

static void start_tls(const char *extra) {
  char flags[2048];
  snprintf(flags, sizeof flags, "--experts all --tls-cert %s --tls-key %s %s",
           path("server.pem"), path("server.key"), extra ? extra : "");
  MT_EQ_INT(itu_server_start(&srv, model, flags, tmp, 60000), 0);
}

MT_TEST(tls_hello_and_forward) {
  setup();
  itu_client_security(ca_pem, NULL, NULL, NULL, NULL);
  start_tls(NULL);
  MT_EQ_INT(itu_health(srv.address, 5000), PR_HEALTH_SERVING);
  gc_cluster *c = NULL;
  mr_err e;
  char extra[1024];
  /* The certificate names 127.0.0.1 (IP SAN): no server_name needed. */
  snprintf(extra, sizeof extra, ", \"tls\": {\"ca\": \"%s\"}", path("ca.pem"));
  MT_OK(open_cluster(cluster("c1.json", extra), &c, &e), &e);
  MT_OK(forward(c, &e), &e);
  gc_cluster_close(c);
  /* And by name, as through a DNS name or a load balancer. */
  snprintf(extra, sizeof extra, ", \"tls\": {\"ca\": \"%s\", \"server_name\": \"localhost\"}",
           path("ca.pem"));
  MT_OK(open_cluster(cluster("c2.json", extra), &c, &e), &e);
  MT_OK(forward(c, &e), &e);
  gc_cluster_close(c);
  /* A name the certificate does not carry is refused. */
  snprintf(extra, sizeof extra, ", \"tls\": {\"ca\": \"%s\", \"server_name\": \"evil.example\"}",
           path("ca.pem"));
  MT_NE_INT(open_refused(cluster("c3.json", extra), &c, &e), 0);
  MT_CONTAINS(e.msg, "s0");
  finish();
}

MT_TEST(tls_failures_are_clean_and_name_the_server) {
  setup();
  itu_client_security(ca_pem, NULL, NULL, NULL, NULL);
  start_tls(NULL);
  gc_cluster *c = NULL;
  mr_err e;
  char extra[1024];
  /* Trusting the other CA. */
  snprintf(extra, sizeof extra, ", \"tls\": {\"ca\": \"%s\"}", path("other.pem"));
  uint64_t t0 = mr_now_ns();
  int rc = open_refused(cluster("wrong-ca.json", extra), &c, &e);
  fprintf(stderr, "  wrong CA: %s: %s\n", mr_err_name(rc), e.msg);
  MT_NE_INT(rc, 0);
  MT_TRUE(c == NULL);
  MT_CONTAINS(e.msg, "s0");
  MT_CONTAINS(e.msg, srv.address);
  MT_CONTAINS(e.msg, "TLS");
  MT_TRUE((mr_now_ns() - t0) / 1000000 < 15000); /* bounded by the connect timeout */
  /* Plaintext to a TLS server. */
  rc = open_refused(cluster("plain.json", NULL), &c, &e);
  fprintf(stderr, "  plaintext: %s: %s\n", mr_err_name(rc), e.msg);
  MT_NE_INT(rc, 0);
  MT_CONTAINS(e.msg, "s0");
  MT_CONTAINS(e.msg, srv.address);
  /* The server keeps serving good clients. */
  snprintf(extra, sizeof extra, ", \"tls\": {\"ca\": \"%s\"}", path("ca.pem"));
  MT_OK(open_cluster(cluster("good.json", extra), &c, &e), &e);
  gc_cluster_close(c);
  finish();
}

MT_TEST(mtls_requires_a_client_certificate) {
  setup();
  itu_client_security(ca_pem, cert_pem, key_pem, NULL, NULL); /* the start-up probe has one */
  char flags[800];
  snprintf(flags, sizeof flags, "--tls-client-ca %s", path("ca.pem"));
  start_tls(flags);
  gc_cluster *c = NULL;
  mr_err e;
  char extra[2048];
  snprintf(extra, sizeof extra, ", \"tls\": {\"ca\": \"%s\"}", path("ca.pem"));
  int rc = open_refused(cluster("nocert.json", extra), &c, &e);
  fprintf(stderr, "  no client certificate: %s: %s\n", mr_err_name(rc), e.msg);
  MT_NE_INT(rc, 0);
  MT_CONTAINS(e.msg, "s0");
  itu_client_security(ca_pem, NULL, NULL, NULL, NULL);
  MT_EQ_INT(itu_health(srv.address, 2000), -1); /* not even health without a certificate */
  /* A certificate from the other CA is refused too. */
  snprintf(extra, sizeof extra, ", \"tls\": {\"ca\": \"%s\", \"cert\": \"%s\", \"key\": \"%s\"}",
           path("ca.pem"), path("other.pem"), path("other.key"));
  MT_NE_INT(open_refused(cluster("othercert.json", extra), &c, &e), 0);
  snprintf(extra, sizeof extra, ", \"tls\": {\"ca\": \"%s\", \"cert\": \"%s\", \"key\": \"%s\"}",
           path("ca.pem"), path("client.pem"), path("client.key"));
  MT_OK(open_cluster(cluster("cert.json", extra), &c, &e), &e);
  MT_OK(forward(c, &e), &e);
  gc_cluster_close(c);
  finish();
}

/* A raw unary call with the current itu_client_security; returns the status. */
static int raw_unary(const char *method, grpc_byte_buffer *req, char *details, size_t len) {
  itu_call call;
  int st = -1;
  if (itu_call_open(&call, srv.address, method, 5000) == 0 &&
      itu_call_send(&call, req, 5000) == 0) {
    grpc_byte_buffer *bb = NULL;
    itu_call_recv(&call, &bb, 5000);
    if (bb) grpc_byte_buffer_destroy(bb);
    if (itu_call_finish(&call, 5000) == 0) {
      st = (int)call.status;
      char *d = grpc_slice_to_c_string(call.details);
      snprintf(details, len, "%s", d);
      gpr_free(d);
    }
  } else {
    grpc_byte_buffer_destroy(req);
  }
  itu_call_close(&call);
  return st;
}

/* A Hello whose client_name holds a newline, an escape sequence and a NUL with text after
 * it (framed by hand: protobuf-c would stop at the NUL). */
static grpc_byte_buffer *hello_req(void) {
  static const char name[] = "raw\nclient\x1b[31m\0hidden";
  uint8_t m[64] = {0x08, PR_PROTOCOL_MAJOR, 0x1a, sizeof name - 1};
  memcpy(m + 4, name, sizeof name - 1);
  grpc_slice s = grpc_slice_from_copied_buffer((const char *)m, 4 + sizeof name - 1);
  grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&s, 1);
  grpc_slice_unref(s);
  return bb;
}

static grpc_byte_buffer *stats_req(bool reset) {
  Moerpc__V1__StatsRequest q = MOERPC__V1__STATS_REQUEST__INIT;
  q.reset = reset;
  return pr_encode(&q.base);
}

MT_TEST(token_on_every_call) {
  setup();
  char flags[800];
  snprintf(flags, sizeof flags, "--experts all --auth-token-file %s", path("token"));
  MT_EQ_INT(itu_server_start(&srv, model, flags, tmp, 60000), 0); /* health needs no token */
  char det[600];
  const char *tokens[] = {NULL, "not-the-token", TOKEN "x", TOKEN};
  for (int k = 0; k < 4; k++) {
    itu_client_security(NULL, NULL, NULL, NULL, tokens[k]);
    int want = k == 3 ? GRPC_STATUS_OK : GRPC_STATUS_UNAUTHENTICATED;
    MT_EQ_INT(raw_unary(PR_METHOD_HELLO, hello_req(), det, sizeof det), want);
    if (want) {
      MT_CONTAINS(det, "bearer token");
      MT_TRUE(strstr(det, "not-the-token") == NULL && strstr(det, TOKEN) == NULL);
    }
    MT_EQ_INT(raw_unary(PR_METHOD_STATS, stats_req(true), det, sizeof det), want);
    MT_EQ_INT(itu_health(srv.address, 5000), PR_HEALTH_SERVING);
  }
  /* A Forward stream without the token ends UNAUTHENTICATED at accept; its request is never
   * read (Stats below counts none). */
  itu_client_security(NULL, NULL, NULL, NULL, "not-the-token");
  usleep(1100 * 1000); /* a fresh second for the rate-limited refusal line */
  itu_call call;
  MT_EQ_INT(itu_call_open(&call, srv.address, PR_METHOD_FORWARD, 5000), 0);
  float x[64] = {0};
  int32_t ids[2] = {0, 1};
  float w[2] = {0.5f, 0.5f};
  itu_call_send(&call, itu_forward_request(1, 0, 1, 2, ids, 2, w, 2, MR_DTYPE_F32, x, sizeof x),
                5000);
  MT_EQ_INT(itu_call_finish(&call, 5000), 0);
  if (call.status != GRPC_STATUS_UNAUTHENTICATED) {
    char cmd[800];
    snprintf(cmd, sizeof cmd, "cat '%s' >&2", srv.log);
    if (system(cmd)) {}
  }
  MT_EQ_INT(call.status, GRPC_STATUS_UNAUTHENTICATED);
  itu_call_close(&call);

  /* Through the library: the cluster file's token_file on Hello, Forward and Stats. */
  gc_cluster *c = NULL;
  mr_err e;
  char extra[800];
  snprintf(extra, sizeof extra, ", \"token_file\": \"%s\"", path("wrong-token"));
  int rc = open_cluster(cluster("wrong.json", extra), &c, &e);
  MT_EQ_INT(rc, MR_EAUTH);
  MT_CONTAINS(e.msg, "s0");
  MT_CONTAINS(e.msg, "UNAUTHENTICATED");
  snprintf(extra, sizeof extra, ", \"token_file\": \"%s\"", path("token"));
  MT_OK(open_cluster(cluster("right.json", extra), &c, &e), &e);
  gc_stats st;
  MT_OK(gc_cluster_stats(c, 0, true, &st, &e), &e);
  MT_EQ_U64(st.requests, 0); /* the refused stream's request was not processed */
  gc_stats_close(&st);
  MT_OK(forward(c, &e), &e);
  MT_OK(gc_cluster_stats(c, 0, true, &st, &e), &e);
  MT_EQ_U64(st.requests, 1);
  gc_stats_close(&st);
  gc_cluster_close(c);
  /* The log says who was refused and who reset the counters, escapes the hostile client
   * name, and never holds a token. */
  MT_TRUE(log_has("refused Hello from ipv4:127.0.0.1:"));
  MT_TRUE(log_has("refused Stats from ipv4:127.0.0.1:"));
  MT_TRUE(log_has("refused Forward from ipv4:127.0.0.1:"));
  MT_TRUE(log_has("stats reset by ipv4:127.0.0.1:"));
  MT_TRUE(log_has("client \"raw\\nclient\\x1b[31m\\x00hidden\""));
  MT_FALSE(log_has(TOKEN));
  MT_FALSE(log_has("not-the-token"));
  int ws = 0;
  MT_EQ_INT(itu_server_stop(&srv, SIGTERM, 20000, &ws), 0);
  MT_TRUE(WIFEXITED(ws) && WEXITSTATUS(ws) == 0);
  finish();
}

/* Runs the server binary with args, stdout+stderr into log; returns its exit status. */
static int run_server(const char *args, const char *log) {
  char cmd[2048];
  snprintf(cmd, sizeof cmd, "timeout 20 '%s' --model '%s' --experts all %s >'%s' 2>&1",
           itu_bin("moerpc-server"), model, args, log);
  int st = system(cmd);
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

MT_TEST(plaintext_only_on_loopback_unless_insecure) {
  setup();
  MT_EQ_INT(run_server("--listen 0.0.0.0:0", path("wild.log")), 2);
  char *t = slurp("wild.log");
  fprintf(stderr, "  %s", t);
  MT_CONTAINS(t, "--listen 0.0.0.0:0 is not a loopback address");
  MT_CONTAINS(t, "--insecure");
  mr_free(t);
  MT_EQ_INT(run_server("--listen [::]:0", path("wild6.log")), 2);
  MT_EQ_INT(run_server("--listen 127.0.0.1:0 --tls-cert x.pem", path("half.log")), 2);
  t = slurp("half.log");
  MT_CONTAINS(t, "--tls-cert needs --tls-key");
  mr_free(t);
  MT_TRUE(es_listen_is_loopback("127.0.0.1:1") && es_listen_is_loopback("127.8.9.10:1"));
  MT_TRUE(es_listen_is_loopback("[::1]:1") && es_listen_is_loopback("LOCALHOST:1"));
  MT_FALSE(es_listen_is_loopback("0.0.0.0:1") || es_listen_is_loopback("[::]:1"));
  MT_FALSE(es_listen_is_loopback("10.0.0.1:1") || es_listen_is_loopback("localhost.evil:1"));
  MT_FALSE(es_listen_is_loopback(":50051") || es_listen_is_loopback("[::ffff:127.0.0.1]:1"));
  itu_server_listen_host("0.0.0.0");
  MT_EQ_INT(itu_server_start(&srv, model, "--experts all --insecure", tmp, 60000), 0);
  itu_server_listen_host(NULL);
  finish();
}

/* gRPC's own log lines in this process: a client that receives a too_many_pings GOAWAY logs
 * it here (the stream itself may survive it, gRPC then throttles its pings). */
static int n_too_many_pings;
static void grpc_log_watch(gpr_log_func_args *a) {
  if (a->message && strstr(a->message, "too_many_pings"))
    __atomic_add_fetch(&n_too_many_pings, 1, __ATOMIC_RELAXED);
  fprintf(stderr, "grpc: %s\n", a->message ? a->message : "");
}

MT_TEST(idle_stream_outlives_many_keepalive_periods) {
  gpr_set_log_function(grpc_log_watch);
  setenv("MOERPC_KEEPALIVE_TIME_MS", "300", 1); /* this process and the server it starts */
  setup();
  MT_EQ_INT(pr_keepalive_time_ms(), 300);
  MT_EQ_INT(itu_server_start(&srv, model, "--experts all", tmp, 60000), 0);
  gc_cluster *c = NULL;
  mr_err e;
  MT_OK(open_cluster(cluster("c.json", NULL), &c, &e), &e);
  MT_OK(forward(c, &e), &e);
  /* 4 s idle: ~13 pings of each side; the server's policy allows one every 100 ms. */
  usleep(4000 * 1000);
  MT_OK(forward(c, &e), &e);
  gc_server_counters ct;
  MT_OK(gc_server_counters_get(c, 0, false, &ct, &e), &e);
  MT_EQ_U64(ct.stream_breaks, 0);
  MT_EQ_U64(ct.replies, 2);
  gc_cluster_close(c);
  MT_EQ_INT(__atomic_load_n(&n_too_many_pings, __ATOMIC_RELAXED), 0);
  MT_FALSE(log_has("too_many_pings"));
  finish();
}

MT_TEST(token_file_fifo_is_a_clean_error) {
  setup();
  MT_EQ_INT(mkfifo(path("fifo"), 0600), 0);
  char args[800];
  snprintf(args, sizeof args, "--auth-token-file %s", path("fifo"));
  uint64_t t0 = mr_now_ns();
  MT_EQ_INT(run_server(args, path("fifo.log")), 2);
  MT_TRUE((mr_now_ns() - t0) / 1000000 < 10000);
  char *t = slurp("fifo.log");
  MT_CONTAINS(t, "--auth-token-file");
  MT_CONTAINS(t, "not a regular file (a FIFO)");
  mr_free(t);
  /* The empty token is refused by name and limit too. */
  write_text("empty", "\n");
  snprintf(args, sizeof args, "--auth-token-file %s", path("empty"));
  MT_EQ_INT(run_server(args, path("empty.log")), 2);
  t = slurp("empty.log");
  MT_CONTAINS(t, "the token is empty");
  mr_free(t);
  /* The client's token_file and tls.ca likewise, before anything connects. */
  snprintf(srv.address, sizeof srv.address, "127.0.0.1:9");
  gc_cluster *c = NULL;
  mr_err e;
  char extra[800];
  snprintf(extra, sizeof extra, ", \"token_file\": \"%s\"", path("fifo"));
  alarm(20);
  MT_EQ_INT(open_cluster(cluster("fifo.json", extra), &c, &e), MR_EINVAL);
  MT_CONTAINS(e.msg, "token_file");
  MT_CONTAINS(e.msg, "not a regular file (a FIFO)");
  snprintf(extra, sizeof extra, ", \"tls\": {\"ca\": \"%s\"}", path("fifo"));
  MT_EQ_INT(open_cluster(cluster("fifo2.json", extra), &c, &e), MR_EINVAL);
  MT_CONTAINS(e.msg, "tls.ca");
  MT_CONTAINS(e.msg, "not a regular file (a FIFO)");
  alarm(0);
  finish();
}

/* Token and key files that group or others may read are refused at start, naming the flag,
 * the file and its mode; the server and the client alike. */
MT_TEST(secret_files_readable_by_others_are_refused) {
  setup();
  MT_EQ_INT(chmod(path("token"), 0644), 0);
  char args[1200];
  snprintf(args, sizeof args, "--auth-token-file %s", path("token"));
  MT_EQ_INT(run_server(args, path("mode.log")), 2);
  char *t = slurp("mode.log");
  fprintf(stderr, "  %s", t);
  char want[800];
  snprintf(want, sizeof want, "--auth-token-file: %s: mode 0644, must not be readable by group "
           "or others (chmod 600)", path("token"));
  MT_CONTAINS(t, want);
  mr_free(t);
  MT_EQ_INT(chmod(path("server.key"), 0644), 0);
  snprintf(args, sizeof args, "--tls-cert %s --tls-key %s", path("server.pem"),
           path("server.key"));
  MT_EQ_INT(run_server(args, path("keymode.log")), 2);
  t = slurp("keymode.log");
  fprintf(stderr, "  %s", t);
  snprintf(want, sizeof want, "--tls-key: %s: mode 0644", path("server.key"));
  MT_CONTAINS(t, want);
  mr_free(t);
  /* The client's token_file and tls.key likewise, before anything connects. */
  snprintf(srv.address, sizeof srv.address, "127.0.0.1:9");
  gc_cluster *c = NULL;
  mr_err e;
  char extra[1200];
  snprintf(extra, sizeof extra, ", \"token_file\": \"%s\"", path("token"));
  MT_EQ_INT(open_cluster(cluster("tokmode.json", extra), &c, &e), MR_EINVAL);
  MT_CONTAINS(e.msg, "token_file");
  MT_CONTAINS(e.msg, "mode 0644");
  MT_EQ_INT(chmod(path("client.key"), 0604), 0);
  snprintf(extra, sizeof extra, ", \"tls\": {\"ca\": \"%s\", \"cert\": \"%s\", \"key\": \"%s\"}",
           path("ca.pem"), path("client.pem"), path("client.key"));
  MT_EQ_INT(open_cluster(cluster("keymode.json", extra), &c, &e), MR_EINVAL);
  MT_CONTAINS(e.msg, "tls.key");
  MT_CONTAINS(e.msg, "mode 0604");
  finish();
}

/* Writes tmp/NAME: a self-signed certificate for CN=localhost with the key of tmp/server.key,
 * valid from now + from_s to now + to_s (seconds; libcrypto, since the openssl CLI of
 * Debian 12 cannot date a certificate in the past). */
static void make_cert(const char *name, long from_s, long to_s) {
  FILE *kf = fopen(path("server.key"), "r");
  MT_TRUE(kf != NULL);
  EVP_PKEY *k = PEM_read_PrivateKey(kf, NULL, NULL, NULL);
  fclose(kf);
  MT_TRUE(k != NULL);
  X509 *x = X509_new();
  MT_TRUE(x != NULL);
  X509_set_version(x, 2);
  ASN1_INTEGER_set(X509_get_serialNumber(x), 7);
  X509_gmtime_adj(X509_getm_notBefore(x), from_s);
  X509_gmtime_adj(X509_getm_notAfter(x), to_s);
  X509_set_pubkey(x, k);
  X509_NAME *n = X509_get_subject_name(x);
  X509_NAME_add_entry_by_txt(n, "CN", MBSTRING_ASC, (const unsigned char *)"localhost", -1, -1, 0);
  X509_set_issuer_name(x, n);
  MT_TRUE(X509_sign(x, k, EVP_sha256()) > 0);
  FILE *f = fopen(path(name), "w");
  MT_TRUE(f != NULL);
  MT_EQ_INT(PEM_write_X509(f, x), 1);
  fclose(f);
  X509_free(x);
  EVP_PKEY_free(k);
}

MT_TEST(expired_or_future_certificate_or_wrong_key_refused_at_start) {
  setup();
  make_cert("expired.pem", -3 * 86400L, -86400L);
  make_cert("future.pem", 86400L, 3 * 86400L);
  char args[1200], want[800];
  snprintf(args, sizeof args, "--tls-cert %s --tls-key %s", path("expired.pem"), path("server.key"));
  MT_EQ_INT(run_server(args, path("expired.log")), 2);
  char *t = slurp("expired.log");
  fprintf(stderr, "  %s", t);
  snprintf(want, sizeof want, "--tls-cert %s: certificate 1 (subject /CN=localhost) expired: "
           "valid from 20", path("expired.pem"));
  MT_CONTAINS(t, want);
  MT_CONTAINS(t, " UTC to 20");
  mr_free(t);
  snprintf(args, sizeof args, "--tls-cert %s --tls-key %s", path("future.pem"), path("server.key"));
  MT_EQ_INT(run_server(args, path("future.log")), 2);
  t = slurp("future.log");
  fprintf(stderr, "  %s", t);
  snprintf(want, sizeof want, "--tls-cert %s: certificate 1 (subject /CN=localhost) is not valid "
           "yet: valid from 20", path("future.pem"));
  MT_CONTAINS(t, want);
  MT_CONTAINS(t, "clock");
  mr_free(t);
  /* The client's key with the server's certificate. */
  snprintf(args, sizeof args, "--tls-cert %s --tls-key %s", path("server.pem"), path("client.key"));
  MT_EQ_INT(run_server(args, path("wrongkey.log")), 2);
  t = slurp("wrongkey.log");
  fprintf(stderr, "  %s", t);
  MT_CONTAINS(t, "--tls-key is not the key of the first certificate of --tls-cert");
  mr_free(t);
  finish();
}

/* Waits up to 5 s for needle in the server log. */
static bool log_wait(const char *needle) {
  for (int i = 0; i < 500; i++) {
    if (log_has(needle)) return true;
    usleep(10 * 1000);
  }
  return false;
}

static void copy_file(const char *from, const char *to) {
  char *t = slurp(from);
  write_text(to, t);
  mr_free(t);
}

MT_TEST(sighup_reloads_certificate_and_token) {
  setup();
  /* A second server certificate, signed by the other CA: which CA a client must trust tells
   * which certificate the server presents. */
  char cmd[1200];
  snprintf(cmd, sizeof cmd, "cd '%s' && openssl x509 -req -in server.csr -CA other.pem -CAkey "
           "other.key -CAcreateserial -out server2.pem -days 2 -extfile server.ext "
           ">>openssl.log 2>&1", tmp);
  MT_EQ_INT(system(cmd), 0);
  copy_file("server.pem", "live.pem");
  copy_file("server.key", "live.key");
  copy_file("token", "live-token");
  itu_client_security(ca_pem, NULL, NULL, NULL, NULL); /* the start-up probe */
  char flags[1200];
  snprintf(flags, sizeof flags, "--experts all --tls-cert %s --tls-key %s --auth-token-file %s",
           path("live.pem"), path("live.key"), path("live-token"));
  MT_EQ_INT(itu_server_start(&srv, model, flags, tmp, 60000), 0);
  gc_cluster *c = NULL;
  mr_err e;
  char extra[1200];
  snprintf(extra, sizeof extra, ", \"tls\": {\"ca\": \"%s\"}, \"token_file\": \"%s\"",
           path("ca.pem"), path("token"));
  MT_OK(open_cluster(cluster("before.json", extra), &c, &e), &e);
  MT_OK(forward(c, &e), &e);
  gc_cluster_close(c);

  /* New certificate and token in the same files, then SIGHUP. */
  copy_file("server2.pem", "live.pem");
  write_text("live-token", "the-second-T0ken\n");
  write_text("token2", "the-second-T0ken\n");
  MT_EQ_INT(kill(srv.pid, SIGHUP), 0);
  MT_TRUE(log_wait("SIGHUP: reloaded --tls-cert"));
  MT_TRUE(log_has("--auth-token-file"));
  MT_EQ_INT(kill(srv.pid, 0), 0); /* alive */
  snprintf(extra, sizeof extra, ", \"tls\": {\"ca\": \"%s\"}, \"token_file\": \"%s\"",
           path("other.pem"), path("token2"));
  MT_OK(open_cluster(cluster("after.json", extra), &c, &e), &e);
  MT_OK(forward(c, &e), &e);
  gc_cluster_close(c);
  /* The old token is refused now; the old CA does not verify the new certificate. */
  snprintf(extra, sizeof extra, ", \"tls\": {\"ca\": \"%s\"}, \"token_file\": \"%s\"",
           path("other.pem"), path("token"));
  MT_EQ_INT(open_cluster(cluster("oldtoken.json", extra), &c, &e), MR_EAUTH);
  snprintf(extra, sizeof extra, ", \"tls\": {\"ca\": \"%s\"}, \"token_file\": \"%s\"",
           path("ca.pem"), path("token2"));
  MT_NE_INT(open_refused(cluster("oldca.json", extra), &c, &e), 0);

  /* A bad reload (an expired certificate) is refused and changes nothing. */
  make_cert("expired.pem", -3 * 86400L, -86400L);
  copy_file("expired.pem", "live.pem");
  write_text("live-token", "a-third-token-never-used\n");
  MT_EQ_INT(kill(srv.pid, SIGHUP), 0);
  MT_TRUE(log_wait("SIGHUP: reload refused, the credentials in use stay: --tls-cert"));
  MT_TRUE(log_has("expired: valid from"));
  snprintf(extra, sizeof extra, ", \"tls\": {\"ca\": \"%s\"}, \"token_file\": \"%s\"",
           path("other.pem"), path("token2"));
  MT_OK(open_cluster(cluster("still.json", extra), &c, &e), &e);
  MT_OK(forward(c, &e), &e);
  gc_cluster_close(c);
  MT_FALSE(log_has("the-second-T0ken") || log_has("a-third-token"));
  int ws = 0;
  MT_EQ_INT(itu_server_stop(&srv, SIGTERM, 20000, &ws), 0);
  MT_TRUE(WIFEXITED(ws) && WEXITSTATUS(ws) == 0);
  finish();
}

MT_TEST(sighup_on_a_plaintext_server_is_not_fatal) {
  setup();
  MT_EQ_INT(itu_server_start(&srv, model, "--experts all", tmp, 60000), 0);
  MT_EQ_INT(kill(srv.pid, SIGHUP), 0);
  MT_TRUE(log_wait("SIGHUP: nothing to reload"));
  MT_EQ_INT(itu_health(srv.address, 5000), PR_HEALTH_SERVING);
  gc_cluster *c = NULL;
  mr_err e;
  MT_OK(open_cluster(cluster("plain.json", NULL), &c, &e), &e);
  MT_OK(forward(c, &e), &e);
  gc_cluster_close(c);
  int ws = 0;
  MT_EQ_INT(itu_server_stop(&srv, SIGTERM, 20000, &ws), 0);
  MT_TRUE(WIFEXITED(ws) && WEXITSTATUS(ws) == 0);
  finish();
}

MT_MAIN()
