/*
 * gc_channel.c - the bottom of the client's transport: the channel credentials (TLS and
 * the bearer token from the cluster file), channels, rounds of unary calls, and the Hello
 * round with the client's checks of a HelloReply (input from the network). It calls
 * nothing of the client above it: gc_cluster.c (open), gc_health.c (the prober),
 * gc_stream.c (data channels) and gc_control.c (typed control calls) are built on it.
 *
 * A unary round: one call per channel, all on one completion queue of the calling thread,
 * with one deadline. The queue is drained with a margin past the deadline; calls still
 * open then (never seen with a finite call deadline, but a hang is not an option) are
 * cancelled, which completes them at once. WAIT_FOR_READY lets a round wait for servers
 * that are still starting, so a dead server costs the deadline once, not once per server.
 */
#include <limits.h>
#include <stdio.h>
#include <string.h>

#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc_security.h>
#include <grpc/slice.h>
#include <grpc/support/alloc.h>
#include <grpc/support/time.h>

#include "gpu_client/rpc/internal.h"

/* How long a unary round waits past its calls' deadline before cancelling them (a call with
 * a finite deadline ends by itself; this bounds a gRPC that would not). */
#define GC__UNARY_DRAIN_MARGIN_MS 5000
/* Reconnect backoff after a server went away: gRPC's default grows to 120 s, far longer
 * than a server restart; a short cap lets a restarted server serve again within ~2 s. */
#define GC__RECONNECT_INITIAL_MS 200
#define GC__RECONNECT_MAX_MS 2000
/* Largest PEM file of the "tls" section: a certificate chain is a few KiB. */
#define GC__MAX_PEM_BYTES ((size_t)1 << 20)

/* ---- credentials and channels ------------------------------------------------------- */

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

/* Reads one PEM file of the cluster file's "tls" section (field names it in errors); the
 * private key's file must not be readable by group or others (mr_file_read_private). */
static int pem_read(const char *field, const char *path, bool private, char **out, mr_err *e) {
  size_t len = 0;
  *out = NULL;
  if (!path[0]) return 0;
  int rc = private ? mr_file_read_private(path, GC__MAX_PEM_BYTES, out, &len, e)
                   : mr_file_read(path, GC__MAX_PEM_BYTES, out, &len, e);
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
int gc__security_init(gc_cluster *c, mr_err *e) {
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
  if ((rc = pem_read("tls.ca", f->tls_ca, false, &ca, e)) ||
      (rc = pem_read("tls.cert", f->tls_cert, false, &cert, e)) ||
      (rc = pem_read("tls.key", f->tls_key, true, &key, e)))
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

/* ---- unary calls (see the top of the file) --------------------------------------------- */

void gc__unary_round(const gc_cluster *c, grpc_channel *const *chs, size_t n, const char *method,
                     const grpc_byte_buffer *req, uint32_t timeout_ms, gc__unary *u) {
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

void gc__unary_free(gc__unary *u) {
  if (u->call) grpc_call_unref(u->call);
  if (u->req) grpc_byte_buffer_destroy(u->req);
  if (u->resp) grpc_byte_buffer_destroy(u->resp);
  grpc_metadata_array_destroy(&u->md_initial);
  grpc_metadata_array_destroy(&u->md_trailing);
  grpc_slice_unref(u->details);
  if (u->error_string) gpr_free((void *)u->error_string);
  memset(u, 0, sizeof *u);
}

int gc__unary_result(const gc_cluster *c, const gc__unary *u, const gc__server *sv,
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


int gc__ctl_channels_open(gc_cluster *c, mr_err *e) {
  grpc_init();
  c->grpc_inited = true;
  int rc = gc__security_init(c, e);
  if (rc) return rc;
  for (uint32_t i = 0; i < c->n_servers; i++) {
    c->servers[i].ctl = gc__channel_new(c, &c->servers[i], GC__CTL_MAX_BYTES);
    if (!c->servers[i].ctl)
      return mr_err_set(e, MR_EUNAVAIL, GC__SRV_FMT ": could not create a channel to %s",
                        GC__SRV_ARGS(&c->servers[i]), c->servers[i].target);
  }
  return 0;
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
  /* 1.3: the server process's id; it goes into log lines too. */
  const char *iid = h->instance_id ? h->instance_id : "";
  if (strlen(iid) >= sizeof sv->instance_id)
    return mr_err_set(e, MR_EPROTO, GC__SRV_FMT ": Hello instance_id has %zu characters, at "
                      "most %zu", GC__SRV_ARGS(sv), strlen(iid), sizeof sv->instance_id - 1);
  for (const char *p = iid; *p; p++)
    if ((unsigned char)*p < 0x21 || (unsigned char)*p > 0x7e)
      return mr_err_set(e, MR_EPROTO, GC__SRV_FMT ": Hello instance_id has byte 0x%02x at "
                        "offset %zu, must be printable ASCII", GC__SRV_ARGS(sv),
                        (unsigned char)*p, (size_t)(p - iid));
  snprintf(sv->instance_id, sizeof sv->instance_id, "%s", iid);
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
  sv->owned_generation = h->owned_generation; /* 1.2: 0 from older servers */
  sv->weight_bytes = h->weight_bytes;
  sv->expert_bytes = h->expert_bytes;
  sv->load_free_bytes = h->load_free_bytes;

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


/* Copies the Hello fields of src (a gc__hello_round result) into dst, which takes over
 * src's announce bitset. cfg, target and ctl of dst stay. */
void gc__hello_take(gc__server *dst, gc__server *src) {
  mr_free(dst->announce);
  dst->proto_major = src->proto_major;
  dst->proto_minor = src->proto_minor;
  dst->max_tokens = src->max_tokens;
  dst->max_top_k = src->max_top_k;
  memcpy(dst->fingerprint, src->fingerprint, sizeof dst->fingerprint);
  memcpy(dst->weight_format, src->weight_format, sizeof dst->weight_format);
  dst->hidden = src->hidden;
  dst->inter = src->inter;
  dst->layers = src->layers;
  dst->experts = src->experts;
  dst->owned_generation = src->owned_generation;
  dst->weight_bytes = src->weight_bytes;
  dst->expert_bytes = src->expert_bytes;
  dst->load_free_bytes = src->load_free_bytes;
  memcpy(dst->instance_id, src->instance_id, sizeof dst->instance_id);
  dst->announce = src->announce;
  dst->announced = src->announced;
  src->announce = NULL;
}

void gc__hello_round(gc_cluster *c, const uint32_t *idx, uint32_t n, uint32_t timeout_ms,
                     gc__server *out, int *rcs, mr_err *errs) {
  gc__unary *u = mr_calloc(n, sizeof *u);
  grpc_channel **chs = mr_calloc(n, sizeof *chs);
  Moerpc__V1__HelloRequest hq = MOERPC__V1__HELLO_REQUEST__INIT;
  hq.protocol_major = PR_PROTOCOL_MAJOR;
  hq.protocol_minor = PR_PROTOCOL_MINOR;
  hq.client_name = c->client_name;
  grpc_byte_buffer *req = u && chs ? pr_encode(&hq.base) : NULL;
  for (uint32_t i = 0; i < n; i++) {
    const gc__server *srv = &c->servers[idx ? idx[i] : i];
    memset(&out[i], 0, sizeof out[i]);
    out[i].cfg = srv->cfg;
    rcs[i] = req ? 0 : mr_err_set(&errs[i], MR_ENOMEM, "Hello round: out of memory");
    if (chs) chs[i] = srv->ctl;
  }
  if (!req) goto out_free;
  gc__unary_round(c, chs, n, PR_METHOD_HELLO, req, timeout_ms, u);
  grpc_byte_buffer_destroy(req);
  for (uint32_t i = 0; i < n; i++) {
    gc__server *sv = &out[i];
    Moerpc__V1__HelloReply *h = NULL;
    rcs[i] = gc__unary_result(c, &u[i], &c->servers[idx ? idx[i] : i], "Hello", timeout_ms, &errs[i]);
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
    for (uint32_t i = 0; i < n; i++) gc__unary_free(&u[i]);
  mr_free(u);
  mr_free(chs);
}
