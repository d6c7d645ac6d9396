/*
 * gc_cluster.c - opening and closing a cluster: the cluster file, the Hello round, the
 * consistency checks between servers (and against the model, when one is known), the
 * owner map, the coverage check; the getters; the unary calls (Hello, Stats).
 *
 * Open, step by step (every failure unwinds through gc_cluster_close):
 *   1. grpc_init; one control channel per server (Hello, Stats).
 *   2. Hello all servers at once on one completion queue, with WAIT_FOR_READY and one
 *      deadline (connect_timeout_ms), so servers still starting are waited for and a dead
 *      one costs the timeout once, not once per server.
 *   3. Check each reply (it is input from the network: ranges, ownership inside the
 *      model) and compare every server with the first.
 *   4. With a model: its config and fingerprint must match; local experts load from it.
 *   5. Owner map (local first, then the routed or first announcing server: the primary),
 *      replica sets (every announcing server of a server-owned pair), coverage check.
 *   6. Data channels sized from max_tokens, the I/O thread, one Forward stream per server,
 *      the prober thread (gc_health.c).
 */
#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc_security.h>
#include <grpc/slice.h>
#include <grpc/support/alloc.h>
#include <grpc/support/time.h>

#include "internal.h"

/* How long a unary round waits past its calls' deadline before cancelling them (a call with
 * a finite deadline ends by itself; this bounds a gRPC that would not). */
#define GC__UNARY_DRAIN_MARGIN_MS 5000
/* Reconnect backoff after a server went away: gRPC's default grows to 120 s, far longer
 * than a server restart; a short cap lets a restarted server serve again within ~2 s. */
#define GC__RECONNECT_INITIAL_MS 200
#define GC__RECONNECT_MAX_MS 2000
/* Largest PEM file of the "tls" section: a certificate chain is a few KiB. */
#define GC__MAX_PEM_BYTES ((size_t)1 << 20)

void gc_options_init(gc_options *o) {
  memset(o, 0, sizeof *o);
  o->local_format = KN_FMT_COUNT;
  o->local_engine.isa = KN_ISA_COUNT;
}

grpc_channel *gc__channel_new(const gc_cluster *c, const gc__server *srv, int max_bytes) {
  grpc_arg args[PR_CHANNEL_ARGS + 3];
  size_t n = pr_channel_args(args, max_bytes);
  args[n].type = GRPC_ARG_INTEGER;
  args[n].key = (char *)GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS;
  args[n++].value.integer = GC__RECONNECT_INITIAL_MS;
  args[n].type = GRPC_ARG_INTEGER;
  args[n].key = (char *)GRPC_ARG_MAX_RECONNECT_BACKOFF_MS;
  args[n++].value.integer = GC__RECONNECT_MAX_MS;
  if (c->tls && c->file.tls_server_name[0]) {
    /* The name the server's certificate must carry, instead of the address's host. */
    args[n].type = GRPC_ARG_STRING;
    args[n].key = (char *)GRPC_SSL_TARGET_NAME_OVERRIDE_ARG;
    args[n++].value.string = (char *)c->file.tls_server_name;
  }
  MR_ASSERT(n <= sizeof args / sizeof args[0]);
  grpc_channel_args ca = {n, args};
  return grpc_channel_create(srv->target, c->creds, &ca);
}

/* Reads one PEM file of the cluster file's "tls" section (field names it in errors). */
static int pem_read(const char *field, const char *path, char **out, mr_err *e) {
  size_t len = 0;
  *out = NULL;
  if (!path[0]) return 0;
  int rc = mr_file_read(path, GC__MAX_PEM_BYTES, out, &len, e);
  if (rc) return mr_err_prefix(e, rc, "cluster file: %s", field);
  if (!strstr(*out, "-----BEGIN ")) {
    mr_free(*out);
    *out = NULL;
    return mr_err_set(e, MR_EINVAL, "cluster file: %s = %s: not a PEM file (no \"-----BEGIN \" "
                      "line)", field, path);
  }
  return 0;
}

static void pem_free(char *p) {
  if (p) mr_secret_wipe(p, strlen(p));
  mr_free(p);
}

/* The credentials every channel of the cluster uses and the token metadata every call
 * sends, from the cluster file's "tls" and "token_file" (after grpc_init). */
static int security_init(gc_cluster *c, mr_err *e) {
  const mr_cluster_file *f = &c->file;
  int rc = 0;
  if (f->token_file[0]) {
    char tok[MR_SECRET_MAX_BYTES + 1], val[MR_SECRET_MAX_BYTES + 8];
    size_t n = 0;
    rc = mr_secret_read(f->token_file, "cluster file: token_file", tok, sizeof tok, &n, e);
    if (rc) return rc;
    memcpy(val, "Bearer ", 7);
    memcpy(val + 7, tok, n);
    c->auth_md.key = grpc_slice_from_static_string("authorization");
    c->auth_md.value = grpc_slice_from_copied_buffer(val, 7 + n);
    c->n_auth_md = 1;
    mr_secret_wipe(tok, sizeof tok);
    mr_secret_wipe(val, sizeof val);
  }
  if (!f->tls) {
    c->creds = grpc_insecure_credentials_create();
    return 0;
  }
  char *ca = NULL, *cert = NULL, *key = NULL;
  if ((rc = pem_read("tls.ca", f->tls_ca, &ca, e)) ||
      (rc = pem_read("tls.cert", f->tls_cert, &cert, e)) ||
      (rc = pem_read("tls.key", f->tls_key, &key, e)))
    goto out_free_pem;
  grpc_ssl_pem_key_cert_pair kp = {.private_key = key, .cert_chain = cert};
  /* ca NULL: gRPC's default roots (GRPC_DEFAULT_SSL_ROOTS_FILE_PATH or its bundled ones). */
  c->creds = grpc_ssl_credentials_create(ca, cert ? &kp : NULL, NULL, NULL);
  c->tls = true;
  if (!c->creds)
    rc = mr_err_set(e, MR_EINVAL, "cluster file: tls: gRPC refused the TLS credentials (tls.ca "
                    "%s, tls.cert %s)", f->tls_ca[0] ? f->tls_ca : "(default roots)",
                    f->tls_cert[0] ? f->tls_cert : "(none)");
out_free_pem:
  pem_free(ca);
  pem_free(cert);
  pem_free(key);
  return rc;
}

/* ---- unary calls ------------------------------------------------------------------------
 * A round of unary calls, one per channel, on one completion queue of the calling thread.
 * Each call has the deadline; the queue is drained with a margin past it, and calls still
 * open then (never seen with a finite call deadline, but a hang is not an option) are
 * cancelled, which completes them at once.
 */
typedef struct gc__unary {
  grpc_call *call;
  grpc_byte_buffer *req, *resp;
  grpc_metadata_array md_initial, md_trailing;
  grpc_status_code status;
  grpc_slice details;
  const char *error_string;
  bool done;
} gc__unary;

static void unary_round(const gc_cluster *c, grpc_channel *const *chs, size_t n,
                        const char *method, const grpc_byte_buffer *req, uint32_t timeout_ms,
                        gc__unary *u) {
  grpc_completion_queue *cq = grpc_completion_queue_create_for_next(NULL);
  gpr_timespec deadline = gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC),
                                       gpr_time_from_millis(timeout_ms, GPR_TIMESPAN));
  grpc_slice method_slice = grpc_slice_from_static_string(method);
  size_t started = 0;

  for (size_t i = 0; i < n; i++) {
    memset(&u[i], 0, sizeof u[i]);
    grpc_metadata_array_init(&u[i].md_initial);
    grpc_metadata_array_init(&u[i].md_trailing);
    u[i].details = grpc_empty_slice();
    u[i].status = GRPC_STATUS_UNKNOWN;
    u[i].call = grpc_channel_create_call(chs[i], NULL, GRPC_PROPAGATE_DEFAULTS, cq, method_slice,
                                         NULL, deadline, NULL);
    u[i].req = grpc_byte_buffer_copy((grpc_byte_buffer *)req);
    grpc_op ops[6];
    memset(ops, 0, sizeof ops);
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[0].flags = GRPC_INITIAL_METADATA_WAIT_FOR_READY |
                   GRPC_INITIAL_METADATA_WAIT_FOR_READY_EXPLICITLY_SET;
    ops[0].data.send_initial_metadata.count = c->n_auth_md;
    ops[0].data.send_initial_metadata.metadata =
        c->n_auth_md ? (grpc_metadata *)&c->auth_md : NULL;
    ops[1].op = GRPC_OP_SEND_MESSAGE;
    ops[1].data.send_message.send_message = u[i].req;
    ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[3].data.recv_initial_metadata.recv_initial_metadata = &u[i].md_initial;
    ops[4].op = GRPC_OP_RECV_MESSAGE;
    ops[4].data.recv_message.recv_message = &u[i].resp;
    ops[5].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    ops[5].data.recv_status_on_client.trailing_metadata = &u[i].md_trailing;
    ops[5].data.recv_status_on_client.status = &u[i].status;
    ops[5].data.recv_status_on_client.status_details = &u[i].details;
    ops[5].data.recv_status_on_client.error_string = &u[i].error_string;
    grpc_call_error ce = grpc_call_start_batch(u[i].call, ops, 6, &u[i], NULL);
    MR_ASSERT(ce == GRPC_CALL_OK); /* fresh call, legal ops: anything else is our bug */
    started++;
  }

  size_t done = 0;
  bool cancelled = false;
  gpr_timespec drain =
      gpr_time_add(deadline, gpr_time_from_millis(GC__UNARY_DRAIN_MARGIN_MS, GPR_TIMESPAN));
  while (done < started) {
    grpc_event ev = grpc_completion_queue_next(cq, cancelled ? gpr_inf_future(GPR_CLOCK_MONOTONIC)
                                                             : drain, NULL);
    if (ev.type == GRPC_QUEUE_TIMEOUT) {
      for (size_t i = 0; i < n; i++)
        if (!u[i].done) grpc_call_cancel(u[i].call, NULL);
      cancelled = true;
      continue;
    }
    MR_ASSERT(ev.type == GRPC_OP_COMPLETE);
    gc__unary *x = ev.tag;
    x->done = true;
    done++;
  }
  grpc_completion_queue_shutdown(cq);
  while (grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL).type !=
         GRPC_QUEUE_SHUTDOWN) {
  }
  grpc_completion_queue_destroy(cq);
}

static void unary_free(gc__unary *u) {
  if (u->call) grpc_call_unref(u->call);
  if (u->req) grpc_byte_buffer_destroy(u->req);
  if (u->resp) grpc_byte_buffer_destroy(u->resp);
  grpc_metadata_array_destroy(&u->md_initial);
  grpc_metadata_array_destroy(&u->md_trailing);
  grpc_slice_unref(u->details);
  if (u->error_string) gpr_free((void *)u->error_string);
  memset(u, 0, sizeof *u);
}

/* Turns a finished unary call into 0 or an error naming the server and the RPC. */
/* Turns a finished unary call into 0 or an error naming the server and the RPC. */
static int unary_result(const gc_cluster *c, const gc__unary *u, const gc__server *sv,
                        const char *rpc, uint32_t timeout_ms, mr_err *e) {
  if (u->status == GRPC_STATUS_OK && u->resp) return 0;
  if (u->status == GRPC_STATUS_DEADLINE_EXCEEDED) {
    /* With WAIT_FOR_READY a connection that keeps failing (refused, or a TLS handshake that
     * fails: wrong roots, no client certificate, TLS against plaintext) shows only as the
     * deadline; the channel's state tells that apart from a server that is merely slow. */
    bool failing = sv->ctl && grpc_channel_check_connectivity_state(sv->ctl, 0) ==
                                  GRPC_CHANNEL_TRANSIENT_FAILURE;
    return mr_err_set(e, MR_ETIMEDOUT,
                      GC__SRV_FMT ": no %s reply within %u ms (%s)", GC__SRV_ARGS(sv), rpc,
                      timeout_ms,
                      !failing ? "server down, unreachable or still loading?"
                      : c->tls ? "cannot connect: refused, or the TLS handshake failed: check "
                                 "tls.ca, tls.server_name, a client certificate the server "
                                 "requires, and that the server serves TLS"
                               : "cannot connect: refused, or the server wants TLS (a \"tls\" "
                                 "section in the cluster file)");
  }
  char det[MR_LOG_ESC_MAX]; /* the server's words: escaped */
  mr_log_escape(det, sizeof det, (const char *)GRPC_SLICE_START_PTR(u->details),
                GRPC_SLICE_LENGTH(u->details));
  int code = u->status == GRPC_STATUS_OK ? MR_EPROTO : pr_mr_from_status(u->status);
  return mr_err_set(e, code, GC__SRV_FMT ": %s failed: %s (%d): %s", GC__SRV_ARGS(sv), rpc,
                    pr_status_name(u->status), (int)u->status,
                    u->status == GRPC_STATUS_OK ? "OK status without a reply message" : det);
}

/* ---- Hello ------------------------------------------------------------------------------ */

#define GC__MAX_DIM 65536u
#define GC__MAX_PAIRS (1u << 22)

int gc__hello_check(gc__server *sv, const Moerpc__V1__HelloReply *h, mr_err *e) {
  sv->proto_major = h->protocol_major;
  sv->proto_minor = h->protocol_minor;
  if (h->protocol_major != PR_PROTOCOL_MAJOR)
    return mr_err_set(e, MR_EMISMATCH,
                      GC__SRV_FMT ": speaks protocol %u.%u, this client speaks %d.%d",
                      GC__SRV_ARGS(sv), h->protocol_major, h->protocol_minor, PR_PROTOCOL_MAJOR,
                      PR_PROTOCOL_MINOR);
  const char *fp = h->model_fingerprint ? h->model_fingerprint : "";
  const char *wf = h->weight_format ? h->weight_format : "";
  if (strlen(fp) == 0 || strlen(fp) >= sizeof sv->fingerprint)
    return mr_err_set(e, MR_EPROTO, GC__SRV_FMT ": Hello model_fingerprint has %zu characters, "
                      "must be 1..%zu", GC__SRV_ARGS(sv), strlen(fp), sizeof sv->fingerprint - 1);
  if (strlen(wf) == 0 || strlen(wf) >= sizeof sv->weight_format)
    return mr_err_set(e, MR_EPROTO, GC__SRV_FMT ": Hello weight_format has %zu characters, "
                      "must be 1..%zu", GC__SRV_ARGS(sv), strlen(wf), sizeof sv->weight_format - 1);
  /* Both go into log lines and messages: printable ASCII only (a fingerprint is hex, a
   * format name like "int4-g64"). */
  for (int f = 0; f < 2; f++)
    for (const char *p = f ? wf : fp; *p; p++)
      if ((unsigned char)*p < 0x21 || (unsigned char)*p > 0x7e)
        return mr_err_set(e, MR_EPROTO, GC__SRV_FMT ": Hello %s has byte 0x%02x at offset %zu, "
                          "must be printable ASCII", GC__SRV_ARGS(sv),
                          f ? "weight_format" : "model_fingerprint", (unsigned char)*p,
                          (size_t)(p - (f ? wf : fp)));
  snprintf(sv->fingerprint, sizeof sv->fingerprint, "%s", fp);
  snprintf(sv->weight_format, sizeof sv->weight_format, "%s", wf);
  struct { const char *name; uint32_t v, max; } dims[] = {
      {"hidden_size", h->hidden_size, GC__MAX_DIM},
      {"intermediate_size", h->intermediate_size, GC__MAX_DIM},
      {"num_layers", h->num_layers, MR_MAX_LAYERS},
      {"num_experts", h->num_experts, GC__MAX_DIM},
      {"max_tokens", h->max_tokens, GC_MAX_TOKENS},
  };
  for (size_t i = 0; i < sizeof dims / sizeof dims[0]; i++)
    if (dims[i].v < 1 || dims[i].v > dims[i].max)
      return mr_err_set(e, MR_EPROTO, GC__SRV_FMT ": Hello %s = %u, must be 1..%u",
                        GC__SRV_ARGS(sv), dims[i].name, dims[i].v, dims[i].max);
  /* Bounds the owner map and the announce bitsets a Hello can make us allocate (Kimi-K2
   * has 61 x 384 = 23k pairs). */
  if ((uint64_t)h->num_layers * h->num_experts > GC__MAX_PAIRS)
    return mr_err_set(e, MR_EPROTO, GC__SRV_FMT ": Hello num_layers x num_experts = %u x %u, "
                      "at most %u pairs", GC__SRV_ARGS(sv), h->num_layers, h->num_experts,
                      GC__MAX_PAIRS);
  sv->hidden = h->hidden_size;
  sv->inter = h->intermediate_size;
  sv->layers = h->num_layers;
  sv->experts = h->num_experts;
  sv->max_tokens = h->max_tokens;
  if (h->max_top_k > h->num_experts)
    return mr_err_set(e, MR_EPROTO, GC__SRV_FMT ": Hello max_top_k = %u, must be at most "
                      "num_experts = %u", GC__SRV_ARGS(sv), h->max_top_k, h->num_experts);
  sv->max_top_k = h->max_top_k ? h->max_top_k : h->num_experts; /* 0: a protocol 1.0 server */

  size_t bits = (size_t)sv->layers * sv->experts;
  sv->announce = mr_calloc((bits + 63) / 64, sizeof *sv->announce);
  if (!sv->announce) return mr_err_set(e, MR_ENOMEM, GC__SRV_FMT ": ownership map: out of memory",
                                       GC__SRV_ARGS(sv));
  for (size_t i = 0; i < h->n_owned; i++) {
    const Moerpc__V1__LayerExperts *le = h->owned[i];
    if (le->layer >= sv->layers)
      return mr_err_set(e, MR_EPROTO, GC__SRV_FMT ": Hello owned[%zu].layer = %u, must be < "
                        "num_layers %u", GC__SRV_ARGS(sv), i, le->layer, sv->layers);
    for (size_t j = 0; j < le->n_experts; j++) {
      uint32_t x = le->experts[j];
      if (x >= sv->experts)
        return mr_err_set(e, MR_EPROTO, GC__SRV_FMT ": Hello owned[%zu].experts[%zu] = %u "
                          "(layer %u), must be < num_experts %u", GC__SRV_ARGS(sv), i, j, x,
                          le->layer, sv->experts);
      size_t b = (size_t)le->layer * sv->experts + x;
      if (!(sv->announce[b >> 6] >> (b & 63) & 1u)) sv->announced++;
      sv->announce[b >> 6] |= 1ull << (b & 63);
    }
  }
  return 0;
}

/* Every server must serve the model of the first one. */
static int hello_compare(const gc__server *a, const gc__server *b, mr_err *e) {
#define GC__CMP_U(field, label)                                                          \
  if (a->field != b->field)                                                             \
    return mr_err_set(e, MR_EMISMATCH, GC__SRV_FMT " has %s %u but " GC__SRV_FMT " has %u", \
                      GC__SRV_ARGS(b), label, b->field, GC__SRV_ARGS(a), a->field);
  if (strcmp(a->fingerprint, b->fingerprint) != 0)
    return mr_err_set(e, MR_EMISMATCH,
                      GC__SRV_FMT " has model_fingerprint %s but " GC__SRV_FMT " has %s (not "
                      "the same model files)",
                      GC__SRV_ARGS(b), b->fingerprint, GC__SRV_ARGS(a), a->fingerprint);
  GC__CMP_U(hidden, "hidden_size")
  GC__CMP_U(inter, "intermediate_size")
  GC__CMP_U(layers, "num_layers")
  GC__CMP_U(experts, "num_experts")
#undef GC__CMP_U
  if (strcmp(a->weight_format, b->weight_format) != 0)
    return mr_err_set(e, MR_EMISMATCH,
                      GC__SRV_FMT " has weight_format %s but " GC__SRV_FMT " has %s (one "
                      "layer's experts would not compute the same numbers)",
                      GC__SRV_ARGS(b), b->weight_format, GC__SRV_ARGS(a), a->weight_format);
  return 0;
}

static int hello_all(gc_cluster *c, uint32_t timeout_ms, mr_err *e) {
  int rc = 0;
  uint32_t n = c->n_servers;
  gc__unary *u = mr_calloc(n, sizeof *u);
  grpc_channel **chs = mr_calloc(n, sizeof *chs);
  if (!u || !chs) {
    rc = mr_err_set(e, MR_ENOMEM, "Hello round of %u servers: out of memory", n);
    goto out_free;
  }
  for (uint32_t i = 0; i < n; i++) chs[i] = c->servers[i].ctl;

  Moerpc__V1__HelloRequest hq = MOERPC__V1__HELLO_REQUEST__INIT;
  hq.protocol_major = PR_PROTOCOL_MAJOR;
  hq.protocol_minor = PR_PROTOCOL_MINOR;
  hq.client_name = c->client_name;
  grpc_byte_buffer *req = pr_encode(&hq.base);
  if (!req) {
    rc = mr_err_set(e, MR_ENOMEM, "HelloRequest: out of memory");
    goto out_free;
  }
  mr_log(MR_LOG_INFO, "Hello to %u server%s (timeout %u ms)", n, n == 1 ? "" : "s", timeout_ms);
  unary_round(c, chs, n, PR_METHOD_HELLO, req, timeout_ms, u);
  grpc_byte_buffer_destroy(req);

  /* Report the first failing server in file order, so the message is reproducible. */
  for (uint32_t i = 0; i < n && !rc; i++) {
    gc__server *sv = &c->servers[i];
    rc = unary_result(c, &u[i], sv, "Hello", timeout_ms, e);
    if (rc) break;
    Moerpc__V1__HelloReply *h = NULL;
    rc = pr_decode(u[i].resp, &moerpc__v1__hello_reply__descriptor, GC__CTL_MAX_BYTES,
                   (ProtobufCMessage **)&h, e);
    if (rc) {
      rc = mr_err_prefix(e, MR_EPROTO, GC__SRV_FMT ": Hello reply", GC__SRV_ARGS(sv));
      break;
    }
    rc = gc__hello_check(sv, h, e);
    moerpc__v1__hello_reply__free_unpacked(h, NULL);
    if (!rc && i > 0) rc = hello_compare(&c->servers[0], sv, e);
    if (!rc)
      mr_log(MR_LOG_INFO,
             GC__SRV_FMT ": protocol %u.%u, model %s, H=%u I=%u L=%u E=%u, %s, max_tokens %u, "
             "%llu (layer, expert) pairs",
             GC__SRV_ARGS(sv), sv->proto_major, sv->proto_minor, sv->fingerprint, sv->hidden,
             sv->inter, sv->layers, sv->experts, sv->weight_format, sv->max_tokens,
             (unsigned long long)sv->announced);
  }
out_free:
  if (u)
    for (uint32_t i = 0; i < n; i++) unary_free(&u[i]);
  mr_free(u);
  mr_free(chs);
  return rc;
}

void gc__hello_probe(gc_cluster *c, const uint32_t *idx, uint32_t n, uint32_t timeout_ms,
                     gc__server *tmp, int *rcs, mr_err *errs) {
  gc__unary *u = mr_calloc(n, sizeof *u);
  grpc_channel **chs = mr_calloc(n, sizeof *chs);
  Moerpc__V1__HelloRequest hq = MOERPC__V1__HELLO_REQUEST__INIT;
  hq.protocol_major = PR_PROTOCOL_MAJOR;
  hq.protocol_minor = PR_PROTOCOL_MINOR;
  hq.client_name = c->client_name;
  grpc_byte_buffer *req = u && chs ? pr_encode(&hq.base) : NULL;
  for (uint32_t i = 0; i < n; i++) {
    memset(&tmp[i], 0, sizeof tmp[i]);
    tmp[i].cfg = c->servers[idx[i]].cfg;
    rcs[i] = req ? 0 : mr_err_set(&errs[i], MR_ENOMEM, "Hello probe: out of memory");
    if (chs) chs[i] = c->servers[idx[i]].ctl;
  }
  if (!req) goto out_free;
  unary_round(c, chs, n, PR_METHOD_HELLO, req, timeout_ms, u);
  grpc_byte_buffer_destroy(req);
  for (uint32_t i = 0; i < n; i++) {
    gc__server *sv = &tmp[i];
    Moerpc__V1__HelloReply *h = NULL;
    rcs[i] = unary_result(c, &u[i], &c->servers[idx[i]], "Hello", timeout_ms, &errs[i]);
    if (rcs[i]) continue;
    rcs[i] = pr_decode(u[i].resp, &moerpc__v1__hello_reply__descriptor, GC__CTL_MAX_BYTES,
                       (ProtobufCMessage **)&h, &errs[i]);
    if (rcs[i]) {
      rcs[i] = mr_err_prefix(&errs[i], MR_EPROTO, GC__SRV_FMT ": Hello reply", GC__SRV_ARGS(sv));
      continue;
    }
    rcs[i] = gc__hello_check(sv, h, &errs[i]);
    moerpc__v1__hello_reply__free_unpacked(h, NULL);
  }
out_free:
  if (u)
    for (uint32_t i = 0; i < n; i++) unary_free(&u[i]);
  mr_free(u);
  mr_free(chs);
}

/* ---- the model --------------------------------------------------------------------------- */

static int model_check(gc_cluster *c, uint8_t *must, mr_err *e) {
  mr_model_config cfg;
  mr_st *st = NULL;
  char fp[17];
  const gc__server *s0 = &c->servers[0];
  int rc = mr_config_load(&cfg, c->model_dir, e);
  if (rc) return mr_err_prefix(e, rc, "model %s", c->model_dir);
  struct { const char *name; uint32_t mine, theirs; } dims[] = {
      {"hidden_size", cfg.hidden_size, c->H},
      {"moe_intermediate_size", cfg.moe_intermediate, c->I},
      {"num_hidden_layers", cfg.num_layers, c->L},
      {"num_experts", cfg.num_experts, c->E},
  };
  for (size_t i = 0; i < sizeof dims / sizeof dims[0]; i++)
    if (dims[i].mine != dims[i].theirs)
      return mr_err_set(e, MR_EMISMATCH, "model %s: config %s = %u but " GC__SRV_FMT " has %u",
                        c->model_dir, dims[i].name, dims[i].mine, GC__SRV_ARGS(s0),
                        dims[i].theirs);
  rc = mr_st_open(&st, c->model_dir, e);
  if (rc) return mr_err_prefix(e, rc, "model %s", c->model_dir);
  rc = mr_model_fingerprint(c->model_dir, st, fp, e);
  mr_st_close(st);
  if (rc) return mr_err_prefix(e, rc, "model %s: fingerprint", c->model_dir);
  if (strcmp(fp, c->fingerprint) != 0)
    return mr_err_set(e, MR_EMISMATCH,
                      "model %s has fingerprint %s but " GC__SRV_FMT " serves %s (not the same "
                      "model files)",
                      c->model_dir, fp, GC__SRV_ARGS(s0), c->fingerprint);
  for (uint32_t l = 0; l < c->L; l++) must[l] = mr_config_is_moe_layer(&cfg, l);
  return 0;
}

/* ---- open / close ------------------------------------------------------------------------ */

static int cluster_init(gc_cluster *c, const mr_cluster_file *file, const gc_options *opts,
                        mr_err *e) {
  c->file = *file;
  if (opts) c->opts = *opts;
  else gc_options_init(&c->opts);
  snprintf(c->client_name, sizeof c->client_name, "%s",
           c->opts.client_name ? c->opts.client_name : "moerpc-client");
  const char *model = c->opts.model_dir && *c->opts.model_dir ? c->opts.model_dir : file->model;
  if (strlen(model) >= sizeof c->model_dir)
    return mr_err_set(e, MR_EINVAL, "model path has %zu characters, at most %zu", strlen(model),
                      sizeof c->model_dir - 1);
  snprintf(c->model_dir, sizeof c->model_dir, "%s", model);
  c->deadline_ms = c->opts.deadline_ms ? c->opts.deadline_ms : file->deadline_ms;
  if (c->deadline_ms == 0) c->deadline_ms = MR_CLUSTER_DEFAULT_DEADLINE_MS;
  if (c->deadline_ms > MR_CLUSTER_MAX_DEADLINE_MS)
    return mr_err_set(e, MR_EINVAL, "deadline_ms = %u, must be 1..%u", c->deadline_ms,
                      MR_CLUSTER_MAX_DEADLINE_MS);
  if (file->n_servers < 1 || file->n_servers > MR_CLUSTER_MAX_SERVERS)
    return mr_err_set(e, MR_EINVAL, "cluster: %u servers, must be 1..%d", file->n_servers,
                      MR_CLUSTER_MAX_SERVERS);
  c->n_servers = file->n_servers;
  /* The failover deadline: long enough not to take a busy server for a dead one, short
   * enough that a stalled one costs a fraction of the request deadline. */
  c->failover_ms = c->opts.failover_ms ? c->opts.failover_ms : file->failover_ms;
  if (c->failover_ms == 0) c->failover_ms = c->deadline_ms / 4 < 1000 ? c->deadline_ms / 4 : 1000;
  if (c->failover_ms == 0) c->failover_ms = 1;
  if (c->failover_ms > MR_CLUSTER_MAX_DEADLINE_MS)
    return mr_err_set(e, MR_EINVAL, "failover_ms = %u, must be 1..%u", c->failover_ms,
                      MR_CLUSTER_MAX_DEADLINE_MS);
  atomic_init(&c->next_id, 1);
  atomic_init(&c->rot, 0);
  pthread_mutex_init(&c->health_lock, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC); /* probe times are mr_now_ns based */
  pthread_cond_init(&c->health_cond, &ca);
  pthread_condattr_destroy(&ca);
  pthread_mutex_init(&c->local_lock, NULL);
  pthread_mutex_init(&c->calls_lock, NULL);
  pthread_cond_init(&c->calls_cond, NULL);
  c->locks_inited = true;
  int rc = gc__pool_new(c, e);
  if (rc) return rc;
  c->servers = mr_calloc(c->n_servers, sizeof *c->servers);
  c->streams = mr_calloc(c->n_servers, sizeof *c->streams);
  if (!c->servers || !c->streams)
    return mr_err_set(e, MR_ENOMEM, "cluster of %u servers: out of memory", c->n_servers);
  for (uint32_t i = 0; i < c->n_servers; i++) {
    c->servers[i].cfg = file->servers[i];
    pr_target_from_address(file->servers[i].address, c->servers[i].target,
                           sizeof c->servers[i].target);
  }
  return 0;
}

/* Applies gc_options.caller_local to local[] and checks gc_options.route against the
 * servers' Hellos, before anything is routed: sizes must be the servers' L * E, a routed
 * server must exist and announce the pair, and a pair cannot be both local and routed. */
static int caller_placement_check(gc_cluster *c, uint8_t *local, mr_err *e) {
  const size_t pairs = (size_t)c->L * c->E;
  const gc_options *o = &c->opts;
  if (o->caller_local) {
    if (o->caller_local_len != pairs)
      return mr_err_set(e, MR_EMISMATCH, "caller-local experts: %zu entries given, the "
                        "servers' model has %u layers x %u experts = %zu", o->caller_local_len,
                        c->L, c->E, pairs);
    for (size_t i = 0; i < pairs; i++) {
      if (!o->caller_local[i]) continue;
      if (local[i])
        return mr_err_set(e, MR_EINVAL, "layer %zu expert %zu is both in the cluster file's "
                          "\"local\" section and computed by the caller", i / c->E, i % c->E);
      local[i] = GC__LOCAL_CALLER;
      c->caller_pairs++;
    }
  }
  if (o->route) {
    if (o->route_len != pairs)
      return mr_err_set(e, MR_EMISMATCH, "placement routing: %zu entries given, the servers' "
                        "model has %u layers x %u experts = %zu", o->route_len, c->L, c->E,
                        pairs);
    for (size_t i = 0; i < pairs; i++) {
      int32_t s = o->route[i];
      if (s < 0) continue;
      if ((uint32_t)s >= c->n_servers)
        return mr_err_set(e, MR_ERANGE, "placement: layer %zu expert %zu is routed to server "
                          "index %d, the cluster has %u servers", i / c->E, i % c->E, s,
                          c->n_servers);
      if (local[i])
        return mr_err_set(e, MR_EINVAL, "placement: layer %zu expert %zu is both local and "
                          "routed to " GC__SRV_FMT, i / c->E, i % c->E,
                          GC__SRV_ARGS(&c->servers[s]));
      const uint64_t *ann = c->servers[s].announce;
      if (!ann || !(ann[i >> 6] >> (i & 63) & 1u))
        return mr_err_set(e, MR_EPRECOND, "placement: layer %zu expert %zu is placed on "
                          GC__SRV_FMT ", which does not own it (its Hello does not announce it)",
                          i / c->E, i % c->E, GC__SRV_ARGS(&c->servers[s]));
    }
  }
  return 0;
}

int gc_cluster_open_parsed(gc_cluster **out, const mr_cluster_file *file,
                           const gc_options *opts, mr_err *e) {
  uint8_t *must = NULL, *local = NULL;
  char *msg = NULL;
  MR_ASSERT(out && file);
  *out = NULL;
  gc_cluster *c = mr_calloc(1, sizeof *c);
  if (!c) return mr_err_set(e, MR_ENOMEM, "cluster: out of memory");
  int rc = cluster_init(c, file, opts, e);
  if (rc) goto out_close;

  grpc_init();
  c->grpc_inited = true;
  rc = security_init(c, e);
  if (rc) goto out_close;
  for (uint32_t i = 0; i < c->n_servers; i++) {
    c->servers[i].ctl = gc__channel_new(c, &c->servers[i], GC__CTL_MAX_BYTES);
    if (!c->servers[i].ctl) {
      rc = mr_err_set(e, MR_EUNAVAIL, GC__SRV_FMT ": could not create a channel to %s",
                      GC__SRV_ARGS(&c->servers[i]), c->servers[i].target);
      goto out_close;
    }
  }
  uint32_t connect_ms = c->opts.connect_timeout_ms ? c->opts.connect_timeout_ms
                                                   : GC_DEFAULT_CONNECT_TIMEOUT_MS;
  rc = hello_all(c, connect_ms, e);
  if (rc) goto out_close;

  const gc__server *s0 = &c->servers[0];
  c->H = s0->hidden;
  c->I = s0->inter;
  c->L = s0->layers;
  c->E = s0->experts;
  snprintf(c->fingerprint, sizeof c->fingerprint, "%s", s0->fingerprint);
  snprintf(c->weight_format, sizeof c->weight_format, "%s", s0->weight_format);
  c->max_tokens_min = UINT32_MAX;
  c->max_top_k_min = UINT32_MAX;
  for (uint32_t i = 0; i < c->n_servers; i++) {
    if (c->servers[i].max_tokens < c->max_tokens_min) c->max_tokens_min = c->servers[i].max_tokens;
    if (c->servers[i].max_top_k < c->max_top_k_min) c->max_top_k_min = c->servers[i].max_top_k;
  }
  rc = gc_weight_format_parse(c->weight_format, &c->fmt, &c->group, e);
  if (rc) {
    rc = mr_err_prefix(e, MR_EPROTO, GC__SRV_FMT ": Hello", GC__SRV_ARGS(s0));
    goto out_close;
  }

  size_t pairs = (size_t)c->L * c->E;
  must = mr_calloc(c->L, 1);
  local = mr_calloc(pairs, 1);
  c->owner = mr_malloc(pairs * sizeof *c->owner);
  msg = mr_malloc(sizeof e->msg);
  if (!must || !local || !c->owner || !msg) {
    rc = mr_err_set(e, MR_ENOMEM, "owner map of %u x %u: out of memory", c->L, c->E);
    goto out_close;
  }
  if (c->model_dir[0]) {
    rc = model_check(c, must, e);
    if (rc) goto out_close;
  }
  bool want_local = !c->opts.no_local && c->file.local_layers[0] && c->file.local_experts[0];
  if (want_local) {
    if (!c->model_dir[0]) {
      rc = mr_err_set(e, MR_EINVAL, "cluster file: a \"local\" section needs a model to load "
                      "the local experts from (\"model\" in the file, or the model option)");
      goto out_close;
    }
    rc = gc__local_load(c, local, e);
    if (rc) goto out_close;
  }

  rc = caller_placement_check(c, local, e);
  if (rc) goto out_close;

  const uint64_t **ann = mr_calloc(c->n_servers, sizeof *ann);
  uint64_t *assigned = mr_calloc(c->n_servers, sizeof *assigned);
  if (!ann || !assigned) {
    mr_free(ann);
    mr_free(assigned);
    rc = mr_err_set(e, MR_ENOMEM, "owner map: out of memory");
    goto out_close;
  }
  for (uint32_t i = 0; i < c->n_servers; i++) ann[i] = c->servers[i].announce;
  gc__owner_build(c->owner, c->L, c->E, c->n_servers, ann, local, c->opts.route, NULL);
  /* Every announcing server is a replica of a server-owned pair; a routed pair prefers
   * its placement's server while that one is up. */
  c->rep_off = mr_malloc((pairs + 1) * sizeof *c->rep_off);
  size_t n_rep = c->rep_off ? gc__replicas_build(c->rep_off, NULL, c->owner, c->L, c->E,
                                                 c->n_servers, ann, NULL) : 0;
  c->rep = c->rep_off ? mr_malloc((n_rep ? n_rep : 1) * sizeof *c->rep) : NULL;
  if (c->opts.route) {
    c->pref = mr_malloc(pairs * sizeof *c->pref);
    if (c->pref)
      for (size_t i = 0; i < pairs; i++) c->pref[i] = local[i] ? -1 : c->opts.route[i];
  }
  if (!c->rep_off || !c->rep || (c->opts.route && !c->pref)) {
    mr_free(ann);
    mr_free(assigned);
    rc = mr_err_set(e, MR_ENOMEM, "replica sets of %u x %u: out of memory", c->L, c->E);
    goto out_close;
  }
  gc__replicas_build(c->rep_off, c->rep, c->owner, c->L, c->E, c->n_servers, ann, assigned);
  uint64_t replicated = 0;
  for (size_t i = 0; i < pairs; i++) replicated += c->rep_off[i + 1] - c->rep_off[i] > 1;
  for (uint32_t i = 0; i < c->n_servers; i++) {
    c->servers[i].assigned = assigned[i];
    if (assigned[i] == 0)
      mr_log(MR_LOG_WARN, GC__SRV_FMT ": every expert it announces is local or "
             "caller-computed; it gets no traffic", GC__SRV_ARGS(&c->servers[i]));
  }
  if (replicated)
    mr_log(MR_LOG_INFO, "replicas: %llu of %zu pairs on more than one server; failover after "
           "%u ms without a reply", (unsigned long long)replicated, pairs, c->failover_ms);
  mr_free(ann);
  mr_free(assigned);

  if (gc__coverage_check(c->owner, c->L, c->E, must, msg, sizeof e->msg) > 0) {
    rc = mr_err_set(e, MR_EPRECOND, "%s", msg);
    goto out_close;
  }
  /* A step ends at the last layer that anyone computes (a server, local or the caller). */
  uint32_t last_layer = 0;
  for (size_t i = 0; i < pairs; i++)
    if (c->owner[i] != GC_OWNER_NONE) last_layer = (uint32_t)(i / c->E);
  if (c->opts.routing_window > GC_ROUTING_MAX_WINDOW) {
    rc = mr_err_set(e, MR_EINVAL, "routing_window = %u steps, must be 1..%u (0 = default %u)",
                    c->opts.routing_window, GC_ROUTING_MAX_WINDOW, GC_ROUTING_DEFAULT_WINDOW);
    goto out_close;
  }
  rc = gc_routing_new(&c->routing, c->L, c->E, c->opts.routing_window, last_layer, e);
  if (rc) goto out_close;

  rc = gc__streams_start(c, e);
  if (rc) goto out_close;
  rc = gc__health_start(c, e);
  if (rc) goto out_close;
  mr_log(MR_LOG_INFO, "cluster open: %u server%s, model %s, H=%u E=%u L=%u, %s, %llu local "
         "pairs, deadline %u ms", c->n_servers, c->n_servers == 1 ? "" : "s", c->fingerprint,
         c->H, c->E, c->L, c->weight_format, (unsigned long long)c->local_pairs, c->deadline_ms);
  *out = c;
  c = NULL;
out_close:
  gc_cluster_close(c);
  mr_free(must);
  mr_free(local);
  mr_free(msg);
  return rc;
}

int gc_cluster_open(gc_cluster **out, const char *path, const gc_options *opts, mr_err *e) {
  MR_ASSERT(out && path);
  *out = NULL;
  mr_cluster_file *f = mr_malloc(sizeof *f);
  if (!f) return mr_err_set(e, MR_ENOMEM, "cluster file: out of memory");
  int rc = mr_cluster_load(f, path, e);
  if (rc == 0) {
    mr_log(MR_LOG_INFO, "opening cluster %s (%u server%s)", path, f->n_servers,
           f->n_servers == 1 ? "" : "s");
    rc = gc_cluster_open_parsed(out, f, opts, e);
  }
  mr_free(f);
  return rc;
}

void gc_cluster_close(gc_cluster *c) {
  if (!c) return;
  gc__health_stop(c); /* first: it uses the control channels and the streams' state */
  gc__streams_stop(c);
  gc__pool_close(c);
  gc__local_free(c);
  for (uint32_t i = 0; c->servers && i < c->n_servers; i++) {
    if (c->servers[i].ctl) grpc_channel_destroy(c->servers[i].ctl);
    mr_free(c->servers[i].announce);
  }
  mr_free(c->servers);
  mr_free(c->streams);
  mr_free(c->owner);
  mr_free(c->rep_off);
  mr_free(c->rep);
  mr_free(c->pref);
  gc_routing_free(c->routing);
  if (c->creds) grpc_channel_credentials_release(c->creds);
  if (c->n_auth_md) {
    grpc_slice_unref(c->auth_md.key);
    grpc_slice_unref(c->auth_md.value);
  }
  if (c->locks_inited) {
    pthread_mutex_destroy(&c->local_lock);
    pthread_mutex_destroy(&c->health_lock);
    pthread_cond_destroy(&c->health_cond);
    pthread_mutex_destroy(&c->calls_lock);
    pthread_cond_destroy(&c->calls_cond);
  }
  if (c->grpc_inited) grpc_shutdown();
  mr_free(c);
}

/* ---- getters ----------------------------------------------------------------------------- */

void gc_cluster_info_get(const gc_cluster *c, gc_cluster_info *out) {
  memset(out, 0, sizeof *out);
  out->hidden_size = c->H;
  out->intermediate_size = c->I;
  out->num_layers = c->L;
  out->num_experts = c->E;
  snprintf(out->model_fingerprint, sizeof out->model_fingerprint, "%s", c->fingerprint);
  snprintf(out->weight_format, sizeof out->weight_format, "%s", c->weight_format);
  out->max_tokens = c->max_tokens_min;
  out->n_servers = c->n_servers;
  out->deadline_ms = c->deadline_ms;
  out->failover_ms = c->failover_ms;
  out->local_pairs = c->local_pairs;
  out->caller_pairs = c->caller_pairs;
  snprintf(out->model_dir, sizeof out->model_dir, "%s", c->model_dir);
}

int gc_server_info_get(const gc_cluster *c, uint32_t idx, gc_server_info *out, mr_err *e) {
  if (idx >= c->n_servers)
    return mr_err_set(e, MR_ERANGE, "server index %u, must be < %u", idx, c->n_servers);
  const gc__server *sv = &c->servers[idx];
  memset(out, 0, sizeof *out);
  snprintf(out->name, sizeof out->name, "%s", sv->cfg.name);
  snprintf(out->address, sizeof out->address, "%s", sv->cfg.address);
  out->protocol_major = sv->proto_major;
  out->protocol_minor = sv->proto_minor;
  out->max_tokens = sv->max_tokens;
  out->announced_pairs = sv->announced;
  out->assigned_pairs = sv->assigned;
  return 0;
}

int gc_cluster_owner(const gc_cluster *c, uint32_t layer, uint32_t expert) {
  if (layer >= c->L || expert >= c->E) return GC_OWNER_NONE;
  return c->owner[(size_t)layer * c->E + expert];
}

bool gc_server_announces(const gc_cluster *c, uint32_t idx, uint32_t layer, uint32_t expert) {
  if (idx >= c->n_servers || layer >= c->L || expert >= c->E) return false;
  size_t b = (size_t)layer * c->E + expert;
  return c->servers[idx].announce[b >> 6] >> (b & 63) & 1u;
}

int gc_cluster_find_server(const gc_cluster *c, const char *name) {
  for (uint32_t i = 0; i < c->n_servers; i++)
    if (strcmp(c->servers[i].cfg.name, name) == 0) return (int)i;
  return -1;
}

int gc_server_counters_get(gc_cluster *c, uint32_t idx, bool reset, gc_server_counters *out,
                           mr_err *e) {
  if (idx >= c->n_servers)
    return mr_err_set(e, MR_ERANGE, "server index %u, must be < %u", idx, c->n_servers);
  gc__stream *s = &c->streams[idx];
  pthread_mutex_lock(&s->lock);
  *out = s->ctr;
  if (reset) {
    memset(&s->ctr, 0, sizeof s->ctr);
    s->sum_rtt_us = s->sum_queue_us = s->sum_compute_us = 0;
  }
  pthread_mutex_unlock(&s->lock);
  gc__health_counters(c, idx, reset, out);
  return 0;
}

/* ---- Stats -------------------------------------------------------------------------------- */

int gc__stats_reply_check(const gc__server *sv, const Moerpc__V1__StatsReply *r, uint32_t L,
                          uint32_t E, gc_stats *out, mr_err *e) {
  out->requests = r->requests;
  out->errors = r->errors;
  out->counts = mr_calloc(r->n_counts ? r->n_counts : 1, sizeof *out->counts);
  if (!out->counts)
    return mr_err_set(e, MR_ENOMEM, GC__SRV_FMT ": Stats reply of %zu counts: out of memory",
                      GC__SRV_ARGS(sv), r->n_counts);
  for (size_t i = 0; i < r->n_counts; i++) {
    const Moerpc__V1__ExpertCount *x = r->counts[i];
    if (x->layer >= L || x->expert >= E)
      return mr_err_set(e, MR_EPROTO, GC__SRV_FMT ": Stats counts[%zu] = (layer %u, expert %u), "
                        "outside the model's %u layers x %u experts", GC__SRV_ARGS(sv), i,
                        x->layer, x->expert, L, E);
    out->counts[out->n_counts++] = (gc_expert_count){x->layer, x->expert, x->tokens};
  }
  return 0;
}

int gc_cluster_stats(gc_cluster *c, uint32_t idx, bool reset, gc_stats *out, mr_err *e) {
  gc__unary u;
  Moerpc__V1__StatsReply *r = NULL;
  memset(out, 0, sizeof *out);
  if (idx >= c->n_servers)
    return mr_err_set(e, MR_ERANGE, "server index %u, must be < %u", idx, c->n_servers);
  const gc__server *sv = &c->servers[idx];
  Moerpc__V1__StatsRequest q = MOERPC__V1__STATS_REQUEST__INIT;
  q.reset = reset;
  grpc_byte_buffer *req = pr_encode(&q.base);
  if (!req) return mr_err_set(e, MR_ENOMEM, "StatsRequest: out of memory");
  unary_round(c, &sv->ctl, 1, PR_METHOD_STATS, req, c->deadline_ms, &u);
  grpc_byte_buffer_destroy(req);
  int rc = unary_result(c, &u, sv, "Stats", c->deadline_ms, e);
  if (rc) goto out_free;
  rc = pr_decode(u.resp, &moerpc__v1__stats_reply__descriptor, GC__CTL_MAX_BYTES,
                 (ProtobufCMessage **)&r, e);
  if (rc) {
    rc = mr_err_prefix(e, MR_EPROTO, GC__SRV_FMT ": Stats reply", GC__SRV_ARGS(sv));
    goto out_free;
  }
  rc = gc__stats_reply_check(sv, r, c->L, c->E, out, e);
out_free:
  if (r) moerpc__v1__stats_reply__free_unpacked(r, NULL);
  unary_free(&u);
  if (rc) gc_stats_close(out);
  return rc;
}

void gc_stats_close(gc_stats *s) {
  if (!s) return;
  mr_free(s->counts);
  memset(s, 0, sizeof *s);
}

gc_routing *gc_cluster_routing(gc_cluster *c) { return c ? c->routing : NULL; }

void gc_cluster_routing_exchange(gc_cluster *a, gc_cluster *b) {
  if (!a || !b || a->L != b->L || a->E != b->E) return;
  gc_routing *r = a->routing;
  a->routing = b->routing;
  b->routing = r;
}

/* ---- control handle (placement apply) ---------------------------------------------------- */

int gc_control_open(gc_cluster **out, const mr_cluster_file *file, mr_err *e) {
  MR_ASSERT(out && file);
  *out = NULL;
  gc_cluster *c = mr_calloc(1, sizeof *c);
  if (!c) return mr_err_set(e, MR_ENOMEM, "cluster: out of memory");
  gc_options o;
  gc_options_init(&o);
  o.client_name = "moerpc-place";
  int rc = cluster_init(c, file, &o, e);
  if (rc) goto out_close;
  grpc_init();
  c->grpc_inited = true;
  if ((rc = security_init(c, e))) goto out_close;
  for (uint32_t i = 0; i < c->n_servers; i++) {
    c->servers[i].ctl = gc__channel_new(c, &c->servers[i], GC__CTL_MAX_BYTES);
    if (!c->servers[i].ctl) {
      rc = mr_err_set(e, MR_EUNAVAIL, GC__SRV_FMT ": could not create a channel to %s",
                      GC__SRV_ARGS(&c->servers[i]), c->servers[i].target);
      goto out_close;
    }
  }
  *out = c;
  return 0;
out_close:
  gc_cluster_close(c);
  return rc;
}

int gc_control_call(gc_cluster *c, uint32_t idx, const char *method, const void *req,
                    size_t req_len, uint32_t timeout_ms, uint8_t **resp, size_t *resp_len,
                    mr_err *e) {
  *resp = NULL;
  *resp_len = 0;
  if (idx >= c->n_servers)
    return mr_err_set(e, MR_ERANGE, "server index %u, must be < %u", idx, c->n_servers);
  const gc__server *sv = &c->servers[idx];
  const char *rpc = strrchr(method, '/') ? strrchr(method, '/') + 1 : method;
  grpc_slice sl = grpc_slice_from_copied_buffer(req_len ? (const char *)req : "", req_len);
  grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&sl, 1);
  grpc_slice_unref(sl);
  gc__unary u;
  grpc_channel *ch = sv->ctl;
  unary_round(c, &ch, 1, method, bb, timeout_ms ? timeout_ms : c->deadline_ms, &u);
  grpc_byte_buffer_destroy(bb);
  int rc = unary_result(c, &u, sv, rpc, timeout_ms ? timeout_ms : c->deadline_ms, e);
  if (rc == 0) {
    grpc_byte_buffer_reader rd;
    if (!grpc_byte_buffer_reader_init(&rd, u.resp)) {
      rc = mr_err_set(e, MR_EPROTO, GC__SRV_FMT ": %s reply unreadable", GC__SRV_ARGS(sv), rpc);
    } else {
      grpc_slice all = grpc_byte_buffer_reader_readall(&rd);
      grpc_byte_buffer_reader_destroy(&rd);
      size_t n = GRPC_SLICE_LENGTH(all);
      *resp = mr_malloc(n ? n : 1);
      if (!*resp) {
        rc = mr_err_set(e, MR_ENOMEM, "%s reply: out of memory", rpc);
      } else {
        memcpy(*resp, GRPC_SLICE_START_PTR(all), n);
        *resp_len = n;
      }
      grpc_slice_unref(all);
    }
  }
  unary_free(&u);
  return rc;
}
