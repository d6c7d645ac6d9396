/* util.c - see util.h. */
#define _GNU_SOURCE
#include "tests/integration/util.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <grpc/byte_buffer.h>
#include <grpc/grpc_security.h>
#include <grpc/support/time.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

const char *itu_bin(const char *name) {
  static char buf[4][1024];
  static int slot;
  const char *dir = getenv("MOERPC_BIN");
  char *b = buf[slot++ & 3];
  snprintf(b, sizeof buf[0], "%s/%s", dir ? dir : "build/bin", name);
  return b;
}

char *itu_tmpdir(void) {
  const char *t = getenv("TMPDIR");
  char tmpl[512];
  snprintf(tmpl, sizeof tmpl, "%s/moerpc-itest-XXXXXX", t ? t : "/tmp");
  char *d = mkdtemp(tmpl);
  return d ? strdup(d) : NULL;
}

void itu_rm_rf(const char *dir) {
  if (!dir || !*dir || strcmp(dir, "/") == 0) return;
  char cmd[1024];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  if (system(cmd) != 0) fprintf(stderr, "itu: could not remove %s\n", dir);
}

int itu_free_port(void) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t len = sizeof a;
  if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof a) < 0 ||
      getsockname(fd, (struct sockaddr *)&a, &len) < 0) {
    if (fd >= 0) close(fd);
    return -1;
  }
  close(fd);
  return ntohs(a.sin_port);
}

int itu_make_model(const char *dir, const char *flags) {
  char cmd[2048];
  snprintf(cmd, sizeof cmd, "'%s' --out '%s' %s >'%s.log' 2>&1", itu_bin("moerpc-mkmodel"), dir,
           flags ? flags : "", dir);
  int rc = system(cmd);
  if (rc != 0) {
    fprintf(stderr, "itu: mkmodel failed (%d): %s\n", rc, cmd);
    snprintf(cmd, sizeof cmd, "tail -n 20 '%s.log' >&2", dir);
    if (system(cmd)) {}
  }
  return rc;
}

/* Splits s on spaces into argv (modifies s). */
static int split_args(char *s, char **argv, int max) {
  int n = 0;
  for (char *tok = strtok(s, " "); tok && n < max - 1; tok = strtok(NULL, " ")) argv[n++] = tok;
  argv[n] = NULL;
  return n;
}

static const char *server_isa;
void itu_server_isa(const char *isa) { server_isa = isa; }
static const char *server_host;
void itu_server_listen_host(const char *host) { server_host = host; }

static struct {
  const char *ca, *cert, *key, *name, *token;
} sec;
void itu_client_security(const char *ca_pem, const char *cert_pem, const char *key_pem,
                         const char *server_name, const char *token) {
  sec.ca = ca_pem;
  sec.cert = cert_pem;
  sec.key = key_pem;
  sec.name = server_name;
  sec.token = token;
}

static int server_start_on(itu_server *s, int port, const char *model, const char *extra,
                           const char *logdir, int timeout_ms);

/* Forks moerpc-server on port without waiting for it. */
static int server_spawn_on(itu_server *s, int port, const char *model, const char *extra,
                           const char *logdir) {
  static int seq;
  memset(s, 0, sizeof *s);
  s->port = port;
  if (s->port < 0) return -1;
  snprintf(s->address, sizeof s->address, "127.0.0.1:%d", s->port);
  snprintf(s->log, sizeof s->log, "%s/server-%d-%d.log", logdir, s->port, seq++);
  char args[2048];
  snprintf(args, sizeof args, "%s --model %s --listen %s:%d %s", itu_bin("moerpc-server"), model,
           server_host ? server_host : "127.0.0.1", s->port, extra ? extra : "");
  char *argv[64];
  split_args(args, argv, 64);
  fflush(NULL);
  pid_t pid = fork();
  if (pid < 0) return -1;
  if (pid == 0) {
    /* A test that dies (assert, timeout) must not leave its servers running. */
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    int fd = open(s->log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
      dup2(fd, 1);
      dup2(fd, 2);
    }
    if (server_isa) setenv("MOERPC_ISA", server_isa, 1);
    execv(argv[0], argv);
    _exit(127);
  }
  s->pid = pid;
  return 0;
}

/* Spawns on port and waits until health answers SERVING. */
static int server_start_on(itu_server *s, int port, const char *model, const char *extra,
                           const char *logdir, int timeout_ms) {
  if (server_spawn_on(s, port, model, extra, logdir) != 0) return -1;
  pid_t pid = s->pid;
  uint64_t t_end = mr_now_ns() / 1000000u + (uint64_t)timeout_ms;
  while (mr_now_ns() / 1000000u < t_end) {
    int st;
    if (waitpid(pid, &st, WNOHANG) == pid) {
      fprintf(stderr, "itu: server exited early (status %d); log %s:\n", st, s->log);
      char cmd[700];
      snprintf(cmd, sizeof cmd, "tail -n 30 '%s' >&2", s->log);
      if (system(cmd)) {}
      s->pid = 0;
      return -1;
    }
    if (itu_health(s->address, 500) == PR_HEALTH_SERVING) return 0;
    usleep(50 * 1000);
  }
  fprintf(stderr, "itu: server %s not SERVING after %d ms; log %s\n", s->address, timeout_ms,
          s->log);
  itu_server_stop(s, SIGKILL, 2000, NULL);
  return -1;
}

int itu_server_start(itu_server *s, const char *model, const char *extra, const char *logdir,
                     int timeout_ms) {
  /* The free port is free when itu_free_port looks, not always when the server binds it
   * (another process's ephemeral port can take it meanwhile): that one failure is retried
   * on a fresh port, twice. */
  for (int attempt = 0;; attempt++) {
    int rc = server_start_on(s, itu_free_port(), model, extra, logdir, timeout_ms);
    if (rc == 0 || attempt == 2) return rc;
    char taken[160];
    snprintf(taken, sizeof taken, "--listen %s: cannot listen there", s->address);
    if (!strstr(itu_log_text(s), taken)) return rc;
    fprintf(stderr, "itu: port %d was taken before the server bound it: another port\n", s->port);
  }
}

int itu_server_restart(itu_server *s, const char *model, const char *extra, const char *logdir,
                       int timeout_ms) {
  int port = s->port;
  if (s->pid > 0) itu_server_stop(s, SIGKILL, 5000, NULL);
  return server_start_on(s, port, model, extra, logdir, timeout_ms);
}

int itu_server_spawn(itu_server *s, const char *model, const char *extra, const char *logdir) {
  return server_spawn_on(s, itu_free_port(), model, extra, logdir);
}

int itu_server_stop(itu_server *s, int sig, int timeout_ms, int *status) {
  if (s->pid <= 0) return -1;
  kill(s->pid, sig);
  uint64_t t_end = mr_now_ns() / 1000000u + (uint64_t)timeout_ms;
  int st = 0;
  while (mr_now_ns() / 1000000u < t_end) {
    if (waitpid(s->pid, &st, WNOHANG) == s->pid) {
      if (status) *status = st;
      s->pid = 0;
      return 0;
    }
    usleep(20 * 1000);
  }
  kill(s->pid, SIGKILL);
  waitpid(s->pid, &st, 0);
  if (status) *status = st;
  s->pid = 0;
  return -1;
}

int itu_server_pause(itu_server *s, int timeout_ms) {
  if (s->pid <= 0) return -1;
  kill(s->pid, SIGSTOP);
  uint64_t t_end = mr_now_ns() / 1000000u + (uint64_t)timeout_ms;
  while (mr_now_ns() / 1000000u < t_end) {
    int st = 0;
    pid_t w = waitpid(s->pid, &st, WNOHANG | WUNTRACED);
    if (w == s->pid && WIFSTOPPED(st)) return 0;
    if (w == s->pid) return -1; /* it exited */
    usleep(1000);
  }
  return -1;
}

void itu_server_resume(itu_server *s) {
  if (s->pid > 0) kill(s->pid, SIGCONT);
}

static gpr_timespec deadline_in(int ms) {
  return gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_millis(ms, GPR_TIMESPAN));
}

/* Waits for tag on cq; returns 1 on success, 0 on failed op, -1 on timeout. */
static int wait_tag(grpc_completion_queue *cq, void *tag, int timeout_ms) {
  for (;;) {
    grpc_event ev = grpc_completion_queue_next(cq, deadline_in(timeout_ms), NULL);
    if (ev.type == GRPC_QUEUE_TIMEOUT) return -1;
    if (ev.type == GRPC_QUEUE_SHUTDOWN) return -1;
    if (ev.tag == tag) return ev.success ? 1 : 0;
  }
}

int itu_call_open(itu_call *c, const char *address, const char *method, int deadline_ms) {
  memset(c, 0, sizeof *c);
  grpc_arg args[PR_CHANNEL_ARGS + 1];
  grpc_channel_args ca = {pr_channel_args(args, 256 << 20), args};
  char target[300];
  pr_target_from_address(address, target, sizeof target);
  grpc_channel_credentials *cr;
  if (sec.ca) {
    grpc_ssl_pem_key_cert_pair kp = {.private_key = sec.key, .cert_chain = sec.cert};
    cr = grpc_ssl_credentials_create(sec.ca, sec.cert ? &kp : NULL, NULL, NULL);
    if (sec.name) {
      args[ca.num_args].type = GRPC_ARG_STRING;
      args[ca.num_args].key = (char *)GRPC_SSL_TARGET_NAME_OVERRIDE_ARG;
      args[ca.num_args++].value.string = (char *)sec.name;
    }
  } else {
    cr = grpc_insecure_credentials_create();
  }
  c->ch = grpc_channel_create(target, cr, &ca);
  grpc_channel_credentials_release(cr);
  c->cq = grpc_completion_queue_create_for_next(NULL);
  grpc_slice m = grpc_slice_from_static_string(method);
  c->call = grpc_channel_create_call(c->ch, NULL, GRPC_PROPAGATE_DEFAULTS, c->cq, m, NULL,
                                     deadline_in(deadline_ms), NULL);
  grpc_metadata_array_init(&c->md_initial);
  grpc_metadata_array_init(&c->md_trailing);
  c->details = grpc_empty_slice();
  grpc_op op = {.op = GRPC_OP_SEND_INITIAL_METADATA,
                .flags = GRPC_INITIAL_METADATA_WAIT_FOR_READY};
  char auth[5000];
  grpc_metadata md;
  if (sec.token) {
    snprintf(auth, sizeof auth, "Bearer %s", sec.token);
    md.key = grpc_slice_from_static_string("authorization");
    md.value = grpc_slice_from_copied_string(auth);
    op.data.send_initial_metadata.count = 1;
    op.data.send_initial_metadata.metadata = &md;
  }
  int rc = grpc_call_start_batch(c->call, &op, 1, (void *)1, NULL) == GRPC_CALL_OK ? 0 : -1;
  if (sec.token) grpc_slice_unref(md.value); /* gRPC took its own reference */
  if (rc) return -1;
  return wait_tag(c->cq, (void *)1, deadline_ms) == 1 ? 0 : -1;
}

int itu_call_send(itu_call *c, grpc_byte_buffer *bb, int timeout_ms) {
  grpc_op op = {.op = GRPC_OP_SEND_MESSAGE};
  op.data.send_message.send_message = bb;
  int rc = -1;
  if (grpc_call_start_batch(c->call, &op, 1, (void *)2, NULL) == GRPC_CALL_OK)
    rc = wait_tag(c->cq, (void *)2, timeout_ms) == 1 ? 0 : -1;
  grpc_byte_buffer_destroy(bb);
  return rc;
}

int itu_call_recv(itu_call *c, grpc_byte_buffer **bb, int timeout_ms) {
  grpc_op ops[2];
  size_t n = 0;
  memset(ops, 0, sizeof ops);
  if (!c->got_initial) {
    ops[n].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[n++].data.recv_initial_metadata.recv_initial_metadata = &c->md_initial;
    c->got_initial = true;
  }
  ops[n].op = GRPC_OP_RECV_MESSAGE;
  ops[n++].data.recv_message.recv_message = bb;
  *bb = NULL;
  if (grpc_call_start_batch(c->call, ops, n, (void *)3, NULL) != GRPC_CALL_OK) return -1;
  return wait_tag(c->cq, (void *)3, timeout_ms) >= 0 ? 0 : -1;
}

int itu_call_finish(itu_call *c, int timeout_ms) {
  grpc_op ops[3];
  size_t n = 0;
  memset(ops, 0, sizeof ops);
  ops[n++].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
  if (!c->got_initial) {
    ops[n].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[n++].data.recv_initial_metadata.recv_initial_metadata = &c->md_initial;
    c->got_initial = true;
  }
  ops[n].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
  ops[n].data.recv_status_on_client.trailing_metadata = &c->md_trailing;
  ops[n].data.recv_status_on_client.status = &c->status;
  ops[n++].data.recv_status_on_client.status_details = &c->details;
  if (grpc_call_start_batch(c->call, ops, n, (void *)4, NULL) != GRPC_CALL_OK) {
    /* Close may fail if already half-closed; retry with the status alone. */
    if (grpc_call_start_batch(c->call, ops + n - 1, 1, (void *)4, NULL) != GRPC_CALL_OK)
      return -1;
  }
  return wait_tag(c->cq, (void *)4, timeout_ms) >= 0 ? 0 : -1;
}

void itu_call_close(itu_call *c) {
  if (c->call) {
    grpc_call_cancel(c->call, NULL);
    grpc_call_unref(c->call);
  }
  if (c->ch) grpc_channel_destroy(c->ch);
  if (c->cq) {
    grpc_completion_queue_shutdown(c->cq);
    while (grpc_completion_queue_next(c->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
           GRPC_QUEUE_SHUTDOWN) {
    }
    grpc_completion_queue_destroy(c->cq);
  }
  grpc_metadata_array_destroy(&c->md_initial);
  grpc_metadata_array_destroy(&c->md_trailing);
  grpc_slice_unref(c->details);
  memset(c, 0, sizeof *c);
}

int itu_health(const char *address, int timeout_ms) {
  return itu_health_service(address, "", timeout_ms);
}

int itu_health_service(const char *address, const char *service, int timeout_ms) {
  itu_call c;
  int result = -1;
  if (itu_call_open(&c, address, PR_METHOD_HEALTH_CHECK, timeout_ms) != 0) goto out;
  if (itu_call_send(&c, pr_health_request_encode(service), timeout_ms) != 0) goto out;
  grpc_byte_buffer *bb = NULL;
  if (itu_call_recv(&c, &bb, timeout_ms) != 0 || !bb) goto out;
  int st = -1;
  if (pr_health_response_decode(bb, &st, NULL) == 0) result = st;
  grpc_byte_buffer_destroy(bb);
  itu_call_finish(&c, timeout_ms);
out:
  itu_call_close(&c);
  return result;
}

static void free_cb(void *p) { free(p); }

grpc_byte_buffer *itu_forward_request(uint64_t id, uint32_t layer, uint32_t n_tokens,
                                      uint32_t top_k, const int32_t *ids, size_t n_ids,
                                      const float *w, size_t n_w, int dtype, const void *hidden,
                                      size_t hidden_len) {
  return itu_forward_request_budget(id, layer, n_tokens, top_k, ids, n_ids, w, n_w, dtype, hidden,
                                hidden_len, 0);
}

grpc_byte_buffer *itu_forward_request_budget(uint64_t id, uint32_t layer, uint32_t n_tokens,
                                         uint32_t top_k, const int32_t *ids, size_t n_ids,
                                         const float *w, size_t n_w, int dtype,
                                         const void *hidden, size_t hidden_len,
                                         uint32_t budget_us) {
  Moerpc__V1__ForwardRequest r = MOERPC__V1__FORWARD_REQUEST__INIT;
  r.budget_us = budget_us;
  r.id = id;
  r.layer = layer;
  r.n_tokens = n_tokens;
  r.top_k = top_k;
  r.n_expert_ids = n_ids;
  r.expert_ids = (int32_t *)ids;
  r.n_weights = n_w;
  r.weights = (float *)w;
  r.dtype = (Moerpc__V1__DType)dtype;
  void *copy = malloc(hidden_len ? hidden_len : 1);
  if (hidden_len) memcpy(copy, hidden, hidden_len);
  return pr_encode_with_payload(&r.base, copy, hidden_len, free_cb, copy);
}

int itu_forward_reply(grpc_byte_buffer *bb, Moerpc__V1__ForwardReply **hdr, void **out,
                      size_t *out_len) {
  pr_seg *segs = NULL;
  size_t n = 0;
  mr_err e;
  int rc = pr_bb_segs(bb, &segs, &n, &e);
  if (rc) return rc;
  pr_split sp;
  memset(&sp, 0, sizeof sp);
  rc = pr_forward_reply_decode(segs, n, &sp, hdr, &e);
  if (rc == 0) {
    *out_len = sp.payload.len;
    *out = malloc(sp.payload.len ? sp.payload.len : 1);
    pr_payload_gather(&sp.payload, *out);
  } else {
    fprintf(stderr, "itu: reply decode failed: %s\n", e.msg);
  }
  pr_split_free(&sp);
  mr_free(segs);
  return rc;
}

int itu_ref_forward(const char *model, uint32_t layer, kn_format format, uint32_t group,
                    const kn_moe_args *a, mr_err *e) {
  mr_model_config cfg;
  mr_st *st = NULL;
  kn_engine *eng = NULL;
  kn_layer *L = NULL;
  int rc = mr_config_load(&cfg, model, e);
  if (rc) return rc;
  if ((rc = mr_st_open(&st, model, e))) return rc;
  kn_engine_opts eo = {.isa = KN_ISA_REF, .threads = 1};
  if ((rc = kn_engine_new(&eng, &eo, e))) goto out;
  kn_layer_desc d = {.hidden = cfg.hidden_size, .inter = cfg.moe_intermediate,
                     .num_experts = cfg.num_experts, .format = format, .group = group};
  if ((rc = kn_layer_new(&L, eng, &d, e))) goto out;
  for (uint32_t i = 0; i < a->n_tokens * a->top_k; i++) {
    int32_t x = a->ids[i];
    if (x < 0 || (uint32_t)x >= cfg.num_experts || kn_layer_has_expert(L, (uint32_t)x)) continue;
    const mr_st_tensor *t[3], *sc[3];
    if ((rc = mr_config_expert_tensors_q(&cfg, st, layer, (uint32_t)x, t, sc, e))) goto out;
    if ((rc = kn_layer_load_expert_st(L, (uint32_t)x, t, sc, e))) goto out;
  }
  rc = kn_ref_moe_forward(L, a, e);
out:
  kn_layer_free(L);
  kn_engine_free(eng);
  mr_st_close(st);
  return rc;
}

size_t itu_http(int port, const char *req, size_t len, char *buf, size_t cap) {
  buf[0] = '\0';
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return 0;
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  struct timeval tv = {.tv_sec = 10};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  size_t n = 0;
  if (connect(fd, (struct sockaddr *)&a, sizeof a) == 0 &&
      (len == 0 || send(fd, req, len, MSG_NOSIGNAL) == (ssize_t)len)) {
    ssize_t r;
    while (n + 1 < cap && (r = recv(fd, buf + n, cap - 1 - n, 0)) > 0) n += (size_t)r;
  }
  buf[n] = '\0';
  close(fd);
  return n;
}

double itu_metric(const char *text, const char *sample) {
  size_t n = strlen(sample);
  for (const char *p = text; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL) {
    if (strncmp(p, sample, n) == 0 && p[n] == ' ') return strtod(p + n + 1, NULL);
  }
  return -1;
}

double itu_unary_reply_on(grpc_channel *ch, const char *method, grpc_byte_buffer *req, int deadline_ms,
                          grpc_byte_buffer **reply) {
  if (reply) *reply = NULL;
  grpc_completion_queue *cq = grpc_completion_queue_create_for_next(NULL);
  uint64_t t0 = mr_now_ns();
  gpr_timespec dl = gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_millis(deadline_ms, GPR_TIMESPAN));
  grpc_call *call = grpc_channel_create_call(ch, NULL, GRPC_PROPAGATE_DEFAULTS, cq,
                                             grpc_slice_from_static_string(method), NULL, dl, NULL);
  grpc_metadata_array mi, mt;
  grpc_metadata_array_init(&mi);
  grpc_metadata_array_init(&mt);
  grpc_byte_buffer *resp = NULL;
  grpc_status_code status = GRPC_STATUS_UNKNOWN;
  grpc_slice details = grpc_empty_slice();
  grpc_op ops[6];
  memset(ops, 0, sizeof ops);
  ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
  ops[1].op = GRPC_OP_SEND_MESSAGE;
  ops[1].data.send_message.send_message = req;
  ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
  ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
  ops[3].data.recv_initial_metadata.recv_initial_metadata = &mi;
  ops[4].op = GRPC_OP_RECV_MESSAGE;
  ops[4].data.recv_message.recv_message = &resp;
  ops[5].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
  ops[5].data.recv_status_on_client.trailing_metadata = &mt;
  ops[5].data.recv_status_on_client.status = &status;
  ops[5].data.recv_status_on_client.status_details = &details;
  double us = -1;
  if (grpc_call_start_batch(call, ops, 6, (void *)1, NULL) == GRPC_CALL_OK) {
    grpc_event ev = grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL);
    if (ev.type == GRPC_OP_COMPLETE && status == GRPC_STATUS_OK && resp)
      us = (double)(mr_now_ns() - t0) / 1e3;
  }
  if (reply && us >= 0) {
    *reply = resp; /* the caller's now */
    resp = NULL;
  }
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

double itu_unary_on(grpc_channel *ch, const char *method, grpc_byte_buffer *req, int deadline_ms) {
  return itu_unary_reply_on(ch, method, req, deadline_ms, NULL);
}

int itu_load_wait(gc_cluster *ctl, uint64_t load_id, int timeout_ms, mr_err *e) {
  for (int t = 0; t <= timeout_ms; t += 10) {
    gc_load_progress p;
    if (gc_control_load_status(ctl, 0, load_id, &p, e)) return -1;
    if (p.state == GC_LOAD_DONE) return 0;
    if (p.state == GC_LOAD_FAILED) {
      mr_err_set(e, MR_EINTERNAL, "load %llu failed", (unsigned long long)load_id);
      return -1;
    }
    usleep(10000);
  }
  mr_err_set(e, MR_EINTERNAL, "load %llu not done after %d ms", (unsigned long long)load_id, timeout_ms);
  return -1;
}

const char *itu_log_text(const itu_server *s) {
  static char buf[1 << 20];
  buf[0] = '\0';
  FILE *f = fopen(s->log, "r");
  if (!f) return buf;
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  buf[n] = '\0';
  fclose(f);
  return buf;
}

int itu_metrics_port(const itu_server *s, int timeout_ms) {
  const uint64_t t_end = mr_now_ns() / 1000000u + (uint64_t)(timeout_ms > 0 ? timeout_ms : 0);
  for (;;) {
    const char *t = itu_log_text(s), *m = strstr(t, "metrics: http://");
    const char *end = m ? strstr(m, "/metrics\n") : NULL;
    if (!end && m) end = strstr(m + 16, "/metrics");
    if (end) {
      const char *colon = end;
      while (colon > m && *colon != ':') colon--;
      int port = atoi(colon + 1);
      if (*colon == ':' && port > 0) return port;
    }
    if (mr_now_ns() / 1000000u >= t_end) return -1;
    usleep(10 * 1000);
  }
}

int itu_load_pairs(const char *address, const char *token_file, const char *dir,
                   const uint8_t *want, uint32_t L, uint32_t E, int timeout_ms, uint64_t *pairs,
                   mr_err *e) {
  char path[1024];
  snprintf(path, sizeof path, "%s/ctl-load.json", dir);
  FILE *f = fopen(path, "w");
  if (!f) return mr_err_set(e, MR_EIO, "%s: %s", path, strerror(errno)), -1;
  fprintf(f, "{\"token_file\": \"%s\", \"servers\": [{\"name\": \"s0\", \"address\": \"%s\"}]}\n",
          token_file, address);
  if (fclose(f) != 0) return mr_err_set(e, MR_EIO, "%s: %s", path, strerror(errno)), -1;
  mr_cluster_file cf;
  gc_cluster *ctl = NULL;
  if (mr_cluster_load(&cf, path, e) || gc_control_open(&ctl, &cf, e)) return -1;
  gc_load_started ls;
  int rc = gc_control_load(ctl, 0, want, L, E, "", &ls, e) ? -1 : itu_load_wait(ctl, ls.load_id, timeout_ms, e);
  if (!rc) *pairs = ls.pairs;
  gc_cluster_close(ctl);
  return rc;
}
