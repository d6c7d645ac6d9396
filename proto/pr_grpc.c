/*
 * pr_grpc.c - the send side of the zero-copy framing and the gRPC glue shared by the
 * server and the client: byte buffers, small messages, grpc.health.v1, channel args,
 * status codes and targets.
 *
 * Memory: gRPC's allocator (gpr_malloc) aborts on exhaustion instead of returning NULL,
 * so the encoders below do not return NULL in practice; their contract keeps NULL for a
 * gRPC built with another policy.
 */
#include <arpa/inet.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/slice.h>

#include "proto/internal.h"

/* ---- framing --------------------------------------------------------------------------- */

/* Our bug if a caller sets the payload field of the header: it would be sent twice. */
static void assert_payload_field_empty(const ProtobufCMessage *msg) {
  const ProtobufCFieldDescriptor *f =
      protobuf_c_message_descriptor_get_field(msg->descriptor, PR_PAYLOAD_FIELD);
  MR_ASSERT(f && f->type == PROTOBUF_C_TYPE_BYTES && f->label == PROTOBUF_C_LABEL_NONE);
  const ProtobufCBinaryData *bd = (const void *)((const char *)msg + f->offset);
  MR_ASSERT(bd->len == 0);
}

/*
 * Byte layout of a framed ForwardRequest / ForwardReply (proto3 wire format), as written
 * here and read by pr_split_message (pr_split.c):
 *
 *   +--------------------------------------+------+-------------+------------------------+
 *   | header: every field but 15, packed   | 0x7a | varint(len) | payload: len bytes     |
 *   | by protobuf-c with the bytes field   | tag  | 1..10 bytes | (hidden / output)      |
 *   | left empty (so proto3 omits it)      | 15|2 |             | referenced, not copied |
 *   +--------------------------------------+------+-------------+------------------------+
 *   slice 0: header, tag and varint, packed into one gRPC allocation;
 *   slice 1: the payload, a reference to the caller's memory (released through `release`).
 *
 * The header is packed by protobuf-c with field 15 empty. protobuf-c 1.4 packs a proto3
 * (LABEL_NONE) bytes field only when its len is not 0, so the header holds no field 15
 * and the tag + varint written after it are the only occurrence; pr_encode_with_payload
 * asserts the field is empty and test_proto.c checks the omission.
 */
grpc_byte_buffer *pr_encode_with_payload(const ProtobufCMessage *msg, const void *payload,
                                         size_t len, void (*release)(void *owner), void *owner) {
  uint8_t prefix[1 + PR__VARINT_MAX];
  grpc_slice s[2];
  size_t ns = 0;

  MR_ASSERT(msg && (payload || len == 0));
  assert_payload_field_empty(msg);
  size_t hlen = protobuf_c_message_get_packed_size(msg);
  size_t plen = len ? pr_payload_prefix(prefix, len) : 0;

  s[ns] = grpc_slice_malloc(hlen + plen);
  uint8_t *p = GRPC_SLICE_START_PTR(s[ns]);
  size_t packed = protobuf_c_message_pack(msg, p);
  MR_ASSERT(packed == hlen);
  memcpy(p + hlen, prefix, plen);
  ns++;
  if (len) {
    /* gRPC may hold the slice after SEND_MESSAGE completes (it is released with the last
     * reference), hence a release callback rather than "free after the batch". */
    s[ns++] = release ? grpc_slice_new_with_user_data((void *)payload, len, release, owner)
                      : grpc_slice_from_static_buffer(payload, len);
  }
  grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(s, ns); /* takes its own refs */
  for (size_t k = 0; k < ns; k++) grpc_slice_unref(s[k]);
  /* With len 0 there is no payload slice to carry the release, so the caller's memory is
   * handed back now; the contract stays "release is called exactly once". */
  if (!len && release) release(owner);
  return bb;
}

grpc_byte_buffer *pr_encode(const ProtobufCMessage *msg) {
  MR_ASSERT(msg);
  size_t len = protobuf_c_message_get_packed_size(msg);
  grpc_slice s = grpc_slice_malloc(len);
  size_t packed = protobuf_c_message_pack(msg, GRPC_SLICE_START_PTR(s));
  MR_ASSERT(packed == len);
  grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&s, 1);
  grpc_slice_unref(s);
  return bb;
}

/* ---- received byte buffers -------------------------------------------------------------- */

/*
 * Compressed buffers. gRPC 1.51's byte buffer reader no longer decompresses (measured:
 * grpc_byte_buffer_reader_readall on a GRPC_COMPRESS_GZIP buffer returns the compressed
 * bytes). Decompression happens in gRPC's message_decompress filter, which is on by
 * default and hands the application plain buffers; a compressed buffer reaches us only if
 * someone turned GRPC_ARG_ENABLE_PER_MESSAGE_DECOMPRESSION off. Parsing it would read
 * deflate output as protobuf, so it is refused instead.
 */
static int bb_check_plain(const grpc_byte_buffer *bb, mr_err *e) {
  if (bb->type == GRPC_BB_RAW && bb->data.raw.compression == GRPC_COMPRESS_NONE) return 0;
  return mr_err_set(e, MR_ENOTSUP,
                    "message arrived compressed (compression algorithm %d); gRPC's "
                    "per-message decompression must stay enabled",
                    (int)bb->data.raw.compression);
}

int pr_bb_segs(grpc_byte_buffer *bb, pr_seg **segs, size_t *n, mr_err *e) {
  MR_ASSERT(bb && segs && n);
  *segs = NULL;
  *n = 0;
  int rc = bb_check_plain(bb, e);
  if (rc) return rc;

  const grpc_slice_buffer *sb = &bb->data.raw.slice_buffer;
  pr_seg *v = mr_malloc((sb->count ? sb->count : 1) * sizeof *v);
  if (!v) return mr_err_set(e, MR_ENOMEM, "view list of %zu slices: out of memory", sb->count);
  for (size_t k = 0; k < sb->count; k++) {
    /* GRPC_SLICE_START_PTR of an inlined slice points into sb->slices[k] itself, which
     * stays put as long as nobody modifies the byte buffer. */
    v[k].p = GRPC_SLICE_START_PTR(sb->slices[k]);
    v[k].len = GRPC_SLICE_LENGTH(sb->slices[k]);
  }
  *segs = v;
  *n = sb->count;
  return 0;
}

int pr_decode(grpc_byte_buffer *bb, const ProtobufCMessageDescriptor *d, size_t max_bytes,
              ProtobufCMessage **out, mr_err *e) {
  MR_ASSERT(bb && d && out);
  *out = NULL;
  int rc = bb_check_plain(bb, e);
  if (rc) return mr_err_prefix(e, rc, "%s", d->short_name);
  size_t len = grpc_byte_buffer_length(bb);
  if (len > max_bytes)
    return mr_err_set(e, MR_EEXHAUSTED, "%s: message of %zu bytes exceeds the limit of %zu bytes",
                      d->short_name, len, max_bytes);

  /* Common case: one slice, unpacked in place. Otherwise join the slices once. */
  const grpc_slice_buffer *sb = &bb->data.raw.slice_buffer;
  if (sb->count == 1) {
    *out = protobuf_c_message_unpack(d, NULL, len, GRPC_SLICE_START_PTR(sb->slices[0]));
  } else {
    grpc_byte_buffer_reader rd;
    MR_ASSERT(grpc_byte_buffer_reader_init(&rd, bb)); /* cannot fail on a plain buffer */
    grpc_slice all = grpc_byte_buffer_reader_readall(&rd);
    grpc_byte_buffer_reader_destroy(&rd);
    *out = protobuf_c_message_unpack(d, NULL, GRPC_SLICE_LENGTH(all), GRPC_SLICE_START_PTR(all));
    grpc_slice_unref(all);
  }
  if (!*out)
    return mr_err_set(e, MR_EFORMAT, "%s: protobuf-c could not unpack %zu bytes", d->short_name,
                      len);
  return 0;
}

/* ---- grpc.health.v1 --------------------------------------------------------------------
 *
 * Hand-framed, as there is no generated code for health.proto here:
 *   HealthCheckRequest  { string service = 1; }       0x0a varint(len) service-bytes
 *   HealthCheckResponse { ServingStatus status = 1; } 0x08 varint(status)
 * proto3 omits default values, so service "" and status UNKNOWN (0) are empty messages.
 */
grpc_byte_buffer *pr_health_response_encode(int status) {
  uint8_t buf[1 + PR__VARINT_MAX];
  size_t k = 0;
  if (status != 0) {
    buf[k++] = 1u << 3 | PR__WT_VARINT;
    /* An enum is an int32 on the wire: negative values are sign-extended to 64 bits. */
    k += pr__varint_put(buf + k, (uint64_t)(int64_t)status);
  }
  grpc_slice s = grpc_slice_from_copied_buffer((const char *)buf, k);
  grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&s, 1);
  grpc_slice_unref(s);
  return bb;
}

grpc_byte_buffer *pr_health_request_encode(const char *service) {
  size_t len = service ? strlen(service) : 0;
  uint8_t pre[1 + PR__VARINT_MAX];
  size_t k = 0;
  if (len) {
    pre[k++] = 1u << 3 | PR__WT_LEN;
    k += pr__varint_put(pre + k, len);
  }
  grpc_slice s = grpc_slice_malloc(k + len);
  memcpy(GRPC_SLICE_START_PTR(s), pre, k);
  if (len) memcpy(GRPC_SLICE_START_PTR(s) + k, service, len);
  grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&s, 1);
  grpc_slice_unref(s);
  return bb;
}

/* Both health messages hold one field of interest, number 1, and so does the raw reading of
 * HelloRequest.client_name (field 3). one_field_decode walks bb with the segment reader,
 * skips the other fields and hands every field `want` of wire type want_wt to take(), which
 * consumes its body (the last occurrence wins, as protobuf requires). Errors are prefixed
 * with the message name. */
typedef int (*health_take_fn)(pr__rd *r, uint64_t val, size_t body, size_t start, void *ctx,
                              mr_err *e);
static int one_field_decode(grpc_byte_buffer *bb, const char *msg, uint32_t want,
                            const char *fname, unsigned want_wt, health_take_fn take, void *ctx,
                            mr_err *e) {
  pr_seg *segs = NULL;
  size_t n = 0;
  pr__rd r;

  int rc = pr_bb_segs(bb, &segs, &n, e);
  if (rc) return mr_err_prefix(e, rc, "%s", msg);
  pr__rd_init(&r, segs, n);
  while (pr__rd_left(&r) > 0) {
    uint32_t field;
    unsigned wt;
    uint64_t val;
    size_t body, start;
    rc = pr__rd_field(&r, &field, &wt, &val, &body, &start, e);
    if (rc) {
      mr_err_prefix(e, rc, "%s", msg);
      goto out_free;
    }
    if (field != want) {
      pr__rd_skip(&r, body); /* unknown fields, or ones the caller does not want */
      continue;
    }
    if (wt != want_wt) {
      rc = mr_err_set(e, MR_EFORMAT, "%s: field %u (%s) at byte %zu has wire type %u, must be %u",
                      msg, want, fname, start, wt, want_wt);
      goto out_free;
    }
    rc = take(&r, val, body, start, ctx, e);
    if (rc) goto out_free;
  }
out_free:
  mr_free(segs);
  return rc;
}

static int health_take_status(pr__rd *r, uint64_t val, size_t body, size_t start, void *ctx,
                              mr_err *e) {
  *(int *)ctx = (int)(int32_t)(uint32_t)val; /* int32 enum: keep the low 32 bits */
  return 0;
}

int pr_health_response_decode(grpc_byte_buffer *bb, int *status, mr_err *e) {
  int st = PR_HEALTH_UNKNOWN;
  MR_ASSERT(bb && status);
  int rc = one_field_decode(bb, "HealthCheckResponse", 1, "status", PR__WT_VARINT, health_take_status,
                         &st, e);
  if (rc == 0) *status = st;
  return rc;
}

typedef struct health_service {
  char *buf;
  size_t cap;
} health_service;

static int health_take_service(pr__rd *r, uint64_t val, size_t body, size_t start, void *ctx,
                               mr_err *e) {
  health_service *hs = ctx;
  if (body >= hs->cap)
    return mr_err_set(e, MR_EFORMAT,
                      "HealthCheckRequest: field 1 (service) at byte %zu: name of %zu bytes, at "
                      "most %zu",
                      start, body, hs->cap - 1);
  pr__rd_copy(r, (uint8_t *)hs->buf, body);
  hs->buf[body] = '\0';
  return 0;
}

int pr_health_request_decode(grpc_byte_buffer *bb, char *service, size_t cap, mr_err *e) {
  MR_ASSERT(bb && service && cap > 0);
  health_service hs = {service, cap};
  service[0] = '\0';
  int rc = one_field_decode(bb, "HealthCheckRequest", 1, "service", PR__WT_LEN,
                            health_take_service, &hs, e);
  if (rc) service[0] = '\0';
  return rc;
}

/* ---- HelloRequest.client_name, raw ---------------------------------------------------- */

typedef struct raw_string {
  char *buf;
  size_t cap, len;
} raw_string;

/* Keeps the first cap bytes of the body, and its whole length. */
static int take_raw_string(pr__rd *r, uint64_t val, size_t body, size_t start, void *ctx,
                           mr_err *e) {
  raw_string *rs = ctx;
  size_t k = body < rs->cap ? body : rs->cap;
  pr__rd_copy(r, (uint8_t *)rs->buf, k);
  pr__rd_skip(r, body - k);
  rs->len = body;
  return 0;
}

int pr_hello_client_name(grpc_byte_buffer *bb, char *buf, size_t cap, size_t *len, mr_err *e) {
  MR_ASSERT(bb && buf && len);
  raw_string rs = {buf, cap, 0};
  *len = 0;
  int rc = one_field_decode(bb, "HelloRequest", 3, "client_name", PR__WT_LEN, take_raw_string,
                            &rs, e);
  if (rc == 0) *len = rs.len;
  return rc;
}

/* ---- channel args, status codes, targets ----------------------------------------------- */

int pr_keepalive_time_ms(void) {
  static int cached; /* 0 = not read yet; racing first readers compute the same value */
  int v = __atomic_load_n(&cached, __ATOMIC_RELAXED);
  if (v) return v;
  v = PR_KEEPALIVE_TIME_MS;
  const char *s = getenv("MOERPC_KEEPALIVE_TIME_MS");
  if (s && *s) {
    char *end = NULL;
    long x = strtol(s, &end, 10);
    if (end && !*end && x >= 100 && x <= 3600000) v = (int)x;
  }
  __atomic_store_n(&cached, v, __ATOMIC_RELAXED);
  return v;
}

static void arg_int(grpc_arg *a, const char *key, int v) {
  a->type = GRPC_ARG_INTEGER;
  a->key = (char *)key;
  a->value.integer = v;
}

/* The part both sides share: message limits, own keepalive pings. */
static size_t common_args(grpc_arg *a, int max_bytes) {
  int t = pr_keepalive_time_ms();
  /* A shortened period (tests) shortens the timeout too, never below 1 s. */
  int timeout = t < PR_KEEPALIVE_TIMEOUT_MS ? (t < 1000 ? 1000 : t) : PR_KEEPALIVE_TIMEOUT_MS;
  arg_int(&a[0], GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH, max_bytes);
  arg_int(&a[1], GRPC_ARG_MAX_SEND_MESSAGE_LENGTH, max_bytes);
  arg_int(&a[2], GRPC_ARG_KEEPALIVE_TIME_MS, t);
  arg_int(&a[3], GRPC_ARG_KEEPALIVE_TIMEOUT_MS, timeout);
  /* The control channel idles between Hello and Stats and still wants a dead server found;
   * and keepalive must go on whether or not data flows (gRPC stops after 2 pings without
   * data by default). */
  arg_int(&a[4], GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  arg_int(&a[5], GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  return 6;
}

size_t pr_channel_args(grpc_arg *args_out, int max_bytes) {
  size_t n = common_args(args_out, max_bytes);
  MR_ASSERT(n == PR_CHANNEL_ARGS);
  return n;
}

size_t pr_server_args(grpc_arg *args_out, int max_bytes) {
  size_t n = common_args(args_out, max_bytes);
  int t = pr_keepalive_time_ms();
  /* Below the clients' period with room for timer jitter: their pings never count as strikes. */
  arg_int(&args_out[n++], GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, t / 3);
  arg_int(&args_out[n++], GRPC_ARG_HTTP2_MAX_PING_STRIKES, PR_KEEPALIVE_MAX_PING_STRIKES);
  MR_ASSERT(n == PR_SERVER_ARGS);
  return n;
}

uint64_t pr_forward_token_bytes(uint32_t hidden_size, uint32_t num_experts) {
  return (uint64_t)hidden_size * 4u + (uint64_t)num_experts * PR_FORWARD_SLOT_BYTES;
}

uint64_t pr_forward_max_bytes(uint32_t max_tokens, uint32_t hidden_size, uint32_t num_experts) {
  uint64_t bytes = (uint64_t)max_tokens * pr_forward_token_bytes(hidden_size, num_experts) +
                   PR_FORWARD_FRAMING_BYTES;
  return bytes < PR_GRPC_DEFAULT_MAX_MESSAGE_BYTES ? PR_GRPC_DEFAULT_MAX_MESSAGE_BYTES : bytes;
}

grpc_status_code pr_status_from_mr(int code) {
  switch (code) {
  case MR_OK: return GRPC_STATUS_OK;
  case MR_EINVAL:
  case MR_ERANGE:
  case MR_EFORMAT: return GRPC_STATUS_INVALID_ARGUMENT;
  case MR_EPRECOND:
  case MR_EMISMATCH: return GRPC_STATUS_FAILED_PRECONDITION;
  case MR_EEXHAUSTED: return GRPC_STATUS_RESOURCE_EXHAUSTED;
  case MR_ETIMEDOUT: return GRPC_STATUS_DEADLINE_EXCEEDED;
  case MR_EUNAVAIL: return GRPC_STATUS_UNAVAILABLE;
  case MR_ECANCELED: return GRPC_STATUS_CANCELLED;
  case MR_ENOTSUP: return GRPC_STATUS_UNIMPLEMENTED;
  case MR_ENOTFOUND: return GRPC_STATUS_NOT_FOUND;
  case MR_EAUTH: return GRPC_STATUS_UNAUTHENTICATED;
  default: return GRPC_STATUS_INTERNAL;
  }
}

const char *pr_status_name(grpc_status_code st) {
  static const char *const names[] = {
      [GRPC_STATUS_OK] = "OK",
      [GRPC_STATUS_CANCELLED] = "CANCELLED",
      [GRPC_STATUS_UNKNOWN] = "UNKNOWN",
      [GRPC_STATUS_INVALID_ARGUMENT] = "INVALID_ARGUMENT",
      [GRPC_STATUS_DEADLINE_EXCEEDED] = "DEADLINE_EXCEEDED",
      [GRPC_STATUS_NOT_FOUND] = "NOT_FOUND",
      [GRPC_STATUS_ALREADY_EXISTS] = "ALREADY_EXISTS",
      [GRPC_STATUS_PERMISSION_DENIED] = "PERMISSION_DENIED",
      [GRPC_STATUS_RESOURCE_EXHAUSTED] = "RESOURCE_EXHAUSTED",
      [GRPC_STATUS_FAILED_PRECONDITION] = "FAILED_PRECONDITION",
      [GRPC_STATUS_ABORTED] = "ABORTED",
      [GRPC_STATUS_OUT_OF_RANGE] = "OUT_OF_RANGE",
      [GRPC_STATUS_UNIMPLEMENTED] = "UNIMPLEMENTED",
      [GRPC_STATUS_INTERNAL] = "INTERNAL",
      [GRPC_STATUS_UNAVAILABLE] = "UNAVAILABLE",
      [GRPC_STATUS_DATA_LOSS] = "DATA_LOSS",
      [GRPC_STATUS_UNAUTHENTICATED] = "UNAUTHENTICATED",
  };
  if ((unsigned)st < sizeof names / sizeof names[0] && names[st]) return names[st];
  return "STATUS?";
}

/* The inverse picks the first MR code of each status above; statuses we never send
 * (UNKNOWN, ABORTED, ...) are MR_EINTERNAL. */
int pr_mr_from_status(grpc_status_code st) {
  switch (st) {
  case GRPC_STATUS_OK: return MR_OK;
  case GRPC_STATUS_INVALID_ARGUMENT: return MR_EINVAL;
  case GRPC_STATUS_FAILED_PRECONDITION: return MR_EPRECOND;
  case GRPC_STATUS_RESOURCE_EXHAUSTED: return MR_EEXHAUSTED;
  case GRPC_STATUS_DEADLINE_EXCEEDED: return MR_ETIMEDOUT;
  case GRPC_STATUS_UNAVAILABLE: return MR_EUNAVAIL;
  case GRPC_STATUS_CANCELLED: return MR_ECANCELED;
  case GRPC_STATUS_UNIMPLEMENTED: return MR_ENOTSUP;
  case GRPC_STATUS_NOT_FOUND: return MR_ENOTFOUND;
  case GRPC_STATUS_UNAUTHENTICATED:
  case GRPC_STATUS_PERMISSION_DENIED: return MR_EAUTH; /* control RPCs without a token */
  default: return MR_EINTERNAL;
  }
}

/* An IPv4 literal skips gRPC's resolver ("ipv4:"), a bracketed IPv6 literal likewise
 * ("ipv6:"); anything else, or an address that already names a scheme, goes to the DNS
 * resolver or through unchanged. The result is truncated to len - 1 bytes. */
void pr_target_from_address(const char *address, char *buf, size_t len) {
  char host[256];
  unsigned char bin[16];
  if (!buf || len == 0) return;
  if (!address) address = "";

  if (strncmp(address, "ipv4:", 5) == 0 || strncmp(address, "ipv6:", 5) == 0 ||
      strncmp(address, "dns:", 4) == 0 || strncmp(address, "unix:", 5) == 0) {
    snprintf(buf, len, "%s", address);
    return;
  }
  if (address[0] == '[') {
    const char *close = strchr(address, ']');
    size_t hl = close ? (size_t)(close - address - 1) : 0;
    if (close && close[1] == ':' && hl > 0 && hl < sizeof host) {
      memcpy(host, address + 1, hl);
      host[hl] = '\0';
      if (inet_pton(AF_INET6, host, bin) == 1) {
        snprintf(buf, len, "ipv6:%s", address);
        return;
      }
    }
  } else {
    const char *colon = strrchr(address, ':');
    size_t hl = colon ? (size_t)(colon - address) : 0;
    if (colon && hl > 0 && hl < sizeof host) {
      memcpy(host, address, hl);
      host[hl] = '\0';
      if (inet_pton(AF_INET, host, bin) == 1) {
        snprintf(buf, len, "ipv4:%s", address);
        return;
      }
    }
  }
  snprintf(buf, len, "dns:///%s", address);
}
