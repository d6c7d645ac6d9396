/*
 * gc_control.c - the typed control calls of the RPC library: Stats on an open cluster, and
 * the live-placement calls (Hello, LoadExperts, LoadStatus, UnloadExperts) on a control
 * handle (gc_control_open: channels, TLS and token, no streams). Each packs its request,
 * runs one unary call (gc_channel.c) and checks the reply as input from the network before
 * anything of it reaches the caller, so moerpc-place never touches protobuf (placement/
 * includes no proto/ header) and a HelloReply is checked by one function for everyone.
 */
#include <stdio.h>
#include <string.h>

#include <grpc/byte_buffer.h>

#include "gpu_client/rpc/internal.h"

/* Most (layer, expert) pairs of one Load/Unload request we pack (the Hello limit). */
#define GC__CTL_MAX_PAIRS (1u << 22)

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
  /* 1.4: the clients, input like the rest: bounded, printable (they reach log lines and
   * `moerpc-place apply`'s output). */
  if (r->n_clients > GC_STATS_MAX_CLIENTS)
    return mr_err_set(e, MR_EPROTO, GC__SRV_FMT ": Stats clients has %zu entries, at most %d",
                      GC__SRV_ARGS(sv), r->n_clients, GC_STATS_MAX_CLIENTS);
  if (r->n_clients) {
    out->clients = mr_calloc(r->n_clients, sizeof *out->clients);
    if (!out->clients)
      return mr_err_set(e, MR_ENOMEM, GC__SRV_FMT ": Stats reply of %zu clients: out of memory",
                        GC__SRV_ARGS(sv), r->n_clients);
  }
  for (size_t i = 0; i < r->n_clients; i++) {
    const Moerpc__V1__ClientInfo *x = r->clients[i];
    struct { const char *field, *v; size_t max; char *dst; } f[] = {
        {"client_name", x->client_name, GC_CLIENT_NAME_MAX, out->clients[i].name},
        {"peer", x->peer, GC_CLIENT_PEER_MAX, out->clients[i].peer},
    };
    for (size_t k = 0; k < 2; k++) {
      const char *v = f[k].v ? f[k].v : "";
      size_t len = strlen(v);
      if (len > f[k].max)
        return mr_err_set(e, MR_EPROTO, GC__SRV_FMT ": Stats clients[%zu].%s has %zu bytes, at "
                          "most %zu", GC__SRV_ARGS(sv), i, f[k].field, len, f[k].max);
      for (size_t j = 0; j < len; j++)
        if ((unsigned char)v[j] < 0x20 || v[j] == 0x7f)
          return mr_err_set(e, MR_EPROTO, GC__SRV_FMT ": Stats clients[%zu].%s has a control "
                            "byte 0x%02x at offset %zu", GC__SRV_ARGS(sv), i, f[k].field,
                            (unsigned char)v[j], j);
      memcpy(f[k].dst, v, len + 1);
    }
    out->clients[i].streams = x->streams;
    out->clients[i].hello_generation = x->hello_generation;
    out->clients[i].hello_age_ms = x->hello_age_ms;
    out->n_clients++;
  }
  return 0;
}

static int stats_call(gc_cluster *c, uint32_t idx, bool reset, uint32_t L, uint32_t E,
                      gc_stats *out, mr_err *e);

int gc_cluster_stats(gc_cluster *c, uint32_t idx, bool reset, gc_stats *out, mr_err *e) {
  return stats_call(c, idx, reset, c->L, c->E, out, e);
}

int gc_control_stats(gc_cluster *c, uint32_t idx, uint32_t L, uint32_t E, gc_stats *out,
                     mr_err *e) {
  return stats_call(c, idx, false, L, E, out, e);
}

static int stats_call(gc_cluster *c, uint32_t idx, bool reset, uint32_t L, uint32_t E,
                      gc_stats *out, mr_err *e) {
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
  gc__unary_round(c, &sv->ctl, 1, PR_METHOD_STATS, req, c->deadline_ms, &u);
  grpc_byte_buffer_destroy(req);
  int rc = gc__unary_result(c, &u, sv, "Stats", c->deadline_ms, e);
  if (rc) goto out_free;
  rc = pr_decode(u.resp, &moerpc__v1__stats_reply__descriptor, GC__CTL_MAX_BYTES,
                 (ProtobufCMessage **)&r, e);
  if (rc) {
    rc = mr_err_prefix(e, MR_EPROTO, GC__SRV_FMT ": Stats reply", GC__SRV_ARGS(sv));
    goto out_free;
  }
  rc = gc__stats_reply_check(sv, r, L, E, out, e);
out_free:
  if (r) moerpc__v1__stats_reply__free_unpacked(r, NULL);
  gc__unary_free(&u);
  if (rc) gc_stats_close(out);
  return rc;
}

void gc_stats_close(gc_stats *s) {
  if (!s) return;
  mr_free(s->counts);
  mr_free(s->clients);
  memset(s, 0, sizeof *s);
}

/* ---- the control handle ----------------------------------------------------------------- */

int gc_control_open(gc_cluster **out, const mr_cluster_file *file, mr_err *e) {
  MR_ASSERT(out && file);
  *out = NULL;
  gc_cluster *c = mr_calloc(1, sizeof *c);
  if (!c) return mr_err_set(e, MR_ENOMEM, "cluster: out of memory");
  gc_options o;
  gc_options_init(&o);
  o.client_name = "moerpc-place";
  int rc = gc__cluster_init(c, file, &o, e);
  if (!rc) rc = gc__ctl_channels_open(c, e);
  if (rc) {
    gc_cluster_close(c);
    return rc;
  }
  *out = c;
  return 0;
}

/* One control call on server idx: req packed, the reply decoded as d (at most
 * GC__CTL_MAX_BYTES) into *reply (free with protobuf_c_message_free_unpacked). */
static int control_call(gc_cluster *c, uint32_t idx, const char *method, const ProtobufCMessage *req,
                        const ProtobufCMessageDescriptor *d, ProtobufCMessage **reply, mr_err *e) {
  *reply = NULL;
  if (idx >= c->n_servers)
    return mr_err_set(e, MR_ERANGE, "server index %u, must be < %u", idx, c->n_servers);
  const gc__server *sv = &c->servers[idx];
  const char *rpc = strrchr(method, '/') ? strrchr(method, '/') + 1 : method;
  grpc_byte_buffer *bb = pr_encode(req);
  if (!bb) return mr_err_set(e, MR_ENOMEM, "%s request: out of memory", rpc);
  gc__unary u;
  grpc_channel *ch = sv->ctl;
  gc__unary_round(c, &ch, 1, method, bb, c->deadline_ms, &u);
  grpc_byte_buffer_destroy(bb);
  int rc = gc__unary_result(c, &u, sv, rpc, c->deadline_ms, e);
  if (!rc) {
    rc = pr_decode(u.resp, d, GC__CTL_MAX_BYTES, reply, e);
    if (rc) rc = mr_err_prefix(e, MR_EPROTO, GC__SRV_FMT ": %s reply", GC__SRV_ARGS(sv), rpc);
  }
  gc__unary_free(&u);
  return rc;
}

int gc_control_hello(gc_cluster *c, uint32_t idx, gc_hello_info *out, mr_err *e) {
  memset(out, 0, sizeof *out);
  Moerpc__V1__HelloRequest hq = MOERPC__V1__HELLO_REQUEST__INIT;
  hq.protocol_major = PR_PROTOCOL_MAJOR;
  hq.protocol_minor = PR_PROTOCOL_MINOR;
  hq.client_name = c->client_name;
  Moerpc__V1__HelloReply *h = NULL;
  int rc = control_call(c, idx, PR_METHOD_HELLO, &hq.base, &moerpc__v1__hello_reply__descriptor,
                        (ProtobufCMessage **)&h, e);
  if (rc) return rc;
  gc__server sv; /* the same checks as the cluster's Hello round */
  memset(&sv, 0, sizeof sv);
  sv.cfg = c->servers[idx].cfg;
  rc = gc__hello_check(&sv, h, e);
  moerpc__v1__hello_reply__free_unpacked(h, NULL);
  const size_t LE = (size_t)sv.layers * sv.experts;
  if (!rc && !(out->owned = mr_calloc(LE ? LE : 1, 1)))
    rc = mr_err_set(e, MR_ENOMEM, GC__SRV_FMT ": Hello of %zu pairs: out of memory", GC__SRV_ARGS(&sv), LE);
  if (!rc) {
    out->protocol_major = sv.proto_major;
    out->protocol_minor = sv.proto_minor;
    memcpy(out->model_fingerprint, sv.fingerprint, sizeof out->model_fingerprint);
    memcpy(out->weight_format, sv.weight_format, sizeof out->weight_format);
    out->hidden_size = sv.hidden;
    out->intermediate_size = sv.inter;
    out->num_layers = sv.layers;
    out->num_experts = sv.experts;
    out->max_tokens = sv.max_tokens;
    out->max_top_k = sv.max_top_k;
    out->owned_generation = sv.owned_generation;
    out->weight_bytes = sv.weight_bytes;
    out->expert_bytes = sv.expert_bytes;
    out->load_free_bytes = sv.load_free_bytes;
    memcpy(out->instance_id, sv.instance_id, sizeof out->instance_id);
    out->n_owned = sv.announced;
    for (size_t i = 0; i < LE; i++) out->owned[i] = (uint8_t)(sv.announce[i >> 6] >> (i & 63) & 1u);
  }
  mr_free(sv.announce);
  return rc;
}

void gc_hello_info_close(gc_hello_info *h) {
  if (!h) return;
  mr_free(h->owned);
  memset(h, 0, sizeof *h);
}

/* The LayerExperts of the pairs marked in mask[L * E]: one entry per layer with any, the
 * experts in increasing order. The arrays come from a (freed with it). */
static int pairs_pack(const uint8_t *mask, uint32_t L, uint32_t E, mr_arena *a, Moerpc__V1__LayerExperts ***out,
                      size_t *n_out, mr_err *e) {
  *out = NULL;
  *n_out = 0;
  if ((uint64_t)L * E > GC__CTL_MAX_PAIRS)
    return mr_err_set(e, MR_EINVAL, "%u layers x %u experts: at most %u pairs", L, E, GC__CTL_MAX_PAIRS);
  size_t n_layers = 0;
  for (uint32_t l = 0; l < L; l++)
    for (uint32_t x = 0; x < E; x++)
      if (mask[(size_t)l * E + x]) {
        n_layers++;
        break;
      }
  Moerpc__V1__LayerExperts **v = mr_arena_alloc(a, (n_layers ? n_layers : 1) * sizeof *v, 8);
  if (!v) return mr_err_set(e, MR_ENOMEM, "control request: out of memory");
  size_t k = 0;
  for (uint32_t l = 0; l < L; l++) {
    uint32_t n = 0;
    for (uint32_t x = 0; x < E; x++) n += mask[(size_t)l * E + x] != 0;
    if (!n) continue;
    Moerpc__V1__LayerExperts *le = mr_arena_alloc(a, sizeof *le, 8);
    uint32_t *xs = mr_arena_alloc(a, n * sizeof *xs, 4);
    if (!le || !xs) return mr_err_set(e, MR_ENOMEM, "control request: out of memory");
    moerpc__v1__layer_experts__init(le);
    le->layer = l;
    le->n_experts = 0;
    for (uint32_t x = 0; x < E; x++)
      if (mask[(size_t)l * E + x]) xs[le->n_experts++] = x;
    le->experts = xs;
    v[k++] = le;
  }
  *out = v;
  *n_out = k;
  return 0;
}

int gc_control_load(gc_cluster *c, uint32_t idx, const uint8_t *pairs, uint32_t L, uint32_t E,
                    const char *fingerprint, gc_load_started *out, mr_err *e) {
  memset(out, 0, sizeof *out);
  mr_arena a;
  mr_arena_init(&a, 1u << 16);
  Moerpc__V1__LoadRequest q = MOERPC__V1__LOAD_REQUEST__INIT;
  q.model_fingerprint = (char *)(fingerprint ? fingerprint : "");
  Moerpc__V1__LoadReply *r = NULL;
  int rc = pairs_pack(pairs, L, E, &a, &q.add, &q.n_add, e);
  if (!rc)
    rc = control_call(c, idx, PR_METHOD_LOAD_EXPERTS, &q.base, &moerpc__v1__load_reply__descriptor,
                      (ProtobufCMessage **)&r, e);
  if (!rc) {
    *out = (gc_load_started){r->load_id, r->pairs, r->tensors_total, r->bytes_total, r->packed_bytes,
                             r->free_bytes};
    moerpc__v1__load_reply__free_unpacked(r, NULL);
  }
  mr_arena_close(&a);
  return rc;
}

int gc_control_load_status(gc_cluster *c, uint32_t idx, uint64_t load_id, gc_load_progress *out, mr_err *e) {
  memset(out, 0, sizeof *out);
  Moerpc__V1__LoadStatusRequest q = MOERPC__V1__LOAD_STATUS_REQUEST__INIT;
  q.load_id = load_id;
  Moerpc__V1__LoadProgress *p = NULL;
  int rc = control_call(c, idx, PR_METHOD_LOAD_STATUS, &q.base, &moerpc__v1__load_progress__descriptor,
                        (ProtobufCMessage **)&p, e);
  if (rc) return rc;
  if ((unsigned)p->state > MOERPC__V1__LOAD_STATE__LOAD_STATE_FAILED)
    rc = mr_err_set(e, MR_EPROTO, GC__SRV_FMT ": LoadProgress state = %d, must be 0..3",
                    GC__SRV_ARGS(&c->servers[idx]), (int)p->state);
  if (!rc) {
    out->load_id = p->load_id;
    out->state = (gc_load_state)p->state;
    out->tensors_done = p->tensors_done;
    out->tensors_total = p->tensors_total;
    out->bytes_done = p->bytes_done;
    out->bytes_total = p->bytes_total;
    out->seconds = p->seconds;
    out->owned_generation = p->owned_generation;
    if (out->state == GC_LOAD_FAILED) {
      out->error_code = pr_mr_from_status((grpc_status_code)p->status);
      const char *w = p->error ? p->error : "";
      mr_log_escape(out->error, sizeof out->error, w, strlen(w)); /* the server's words */
    }
  }
  moerpc__v1__load_progress__free_unpacked(p, NULL);
  return rc;
}

int gc_control_unload(gc_cluster *c, uint32_t idx, const uint8_t *pairs, uint32_t L, uint32_t E,
                      const char *fingerprint, gc_unload_result *out, mr_err *e) {
  memset(out, 0, sizeof *out);
  mr_arena a;
  mr_arena_init(&a, 1u << 16);
  Moerpc__V1__UnloadRequest q = MOERPC__V1__UNLOAD_REQUEST__INIT;
  q.model_fingerprint = (char *)(fingerprint ? fingerprint : "");
  Moerpc__V1__UnloadReply *r = NULL;
  int rc = pairs_pack(pairs, L, E, &a, &q.drop, &q.n_drop, e);
  if (!rc)
    rc = control_call(c, idx, PR_METHOD_UNLOAD_EXPERTS, &q.base, &moerpc__v1__unload_reply__descriptor,
                      (ProtobufCMessage **)&r, e);
  if (!rc) {
    *out = (gc_unload_result){r->pairs, r->bytes_freed, r->owned_generation};
    moerpc__v1__unload_reply__free_unpacked(r, NULL);
  }
  mr_arena_close(&a);
  return rc;
}
