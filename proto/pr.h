/*
 * pr.h - thin C glue over protobuf-c for the moerpc wire (proto/moe.proto): the one public
 * header of proto/.
 *
 * Framing of ForwardRequest / ForwardReply (byte layout, proto3 wire format):
 *
 *   +--------------------------------------+------+-------------+------------------------+
 *   | header: every field but 15, packed   | 0x7a | varint(len) | payload: len bytes     |
 *   | by protobuf-c with the bytes field   | tag  | 1..10 bytes | (hidden / output)      |
 *   | left empty (so proto3 omits it)      | 15|2 |             | referenced, not copied |
 *   +--------------------------------------+------+-------------+------------------------+
 *
 * Send: the header + tag + varint go in one small slice; the payload is a second slice that
 * references the caller's memory (grpc_slice_new_with_user_data), so it is never copied
 * in user space. A standard protobuf decoder reads the result as one message.
 *
 * Receive: gRPC hands a message as several slices. pr_split walks the top-level fields of
 * the message across the slice boundaries without joining them: every field other than 15
 * is copied into a small contiguous header buffer (then unpacked by protobuf-c), and field
 * 15 is kept as a list of views into the slices (pr_payload), gathered once by the consumer
 * straight into where it is needed. Any field order is accepted; if field 15 occurs more
 * than once the last occurrence wins (protobuf semantics for scalar bytes). Every length
 * is bounds-checked before use; malformed input is MR_EFORMAT with the offset and field.
 */
#ifndef PR_H
#define PR_H

#include <grpc/grpc.h>

#include "common/mr.h"
#include "moe.pb-c.h" /* generated from moe.proto at build time (build/gen/) */

#ifdef __cplusplus
extern "C" {
#endif

#define PR_PROTOCOL_MAJOR 1
#define PR_PROTOCOL_MINOR 5
#define PR_PAYLOAD_FIELD 15
#define PR_METHOD_HELLO "/moerpc.v1.ExpertService/Hello"
#define PR_METHOD_FORWARD "/moerpc.v1.ExpertService/Forward"
#define PR_METHOD_STATS "/moerpc.v1.ExpertService/Stats"
/* Protocol 1.4: a Forward stream's client name, sent as initial metadata by the client
 * (printable ASCII, at most PR_CLIENT_NAME_MAX bytes) and reported in StatsReply.clients. */
#define PR_MD_CLIENT_NAME "moerpc-client"
#define PR_CLIENT_NAME_MAX 128
/* Control methods (protocol 1.2, docs/DESIGN.md section 15). */
#define PR_METHOD_LOAD_EXPERTS "/moerpc.v1.ExpertService/LoadExperts"
#define PR_METHOD_LOAD_STATUS "/moerpc.v1.ExpertService/LoadStatus"
#define PR_METHOD_UNLOAD_EXPERTS "/moerpc.v1.ExpertService/UnloadExperts"
#define PR_METHOD_HEALTH_CHECK "/grpc.health.v1.Health/Check"
/* Largest header (all fields but the payload) accepted: ids + weights of max_tokens*top_k
 * slots fit easily (16 MiB). */
#define PR_MAX_HEADER_BYTES (16u << 20)

/* Message sizes. gRPC refuses a message over its default limit (4 MiB) unless both sides
 * raise GRPC_ARG_MAX_{RECEIVE,SEND}_MESSAGE_LENGTH (pr_channel_args); server and client
 * raise them to pr_forward_max_bytes of the server's max_tokens. */
#define PR_GRPC_DEFAULT_MAX_MESSAGE_BYTES (4u << 20)
/* Header bytes one slot of a ForwardRequest may take: its id as an int32 varint (up to 10
 * bytes; -1 takes all 10) and its float weight (4). */
#define PR_FORWARD_SLOT_BYTES 14u
/* An upper bound of the tags, lengths and scalar fields of a Forward message. */
#define PR_FORWARD_FRAMING_BYTES 4096u
/* The most bytes one token adds to a ForwardRequest or ForwardReply: its row of hidden_size
 * elements at 4 bytes (the f32 wire, the largest) and num_experts slots (top_k is at most
 * num_experts). */
uint64_t pr_forward_token_bytes(uint32_t hidden_size, uint32_t num_experts);
/* The largest Forward message of up to max_tokens tokens: max_tokens * token bytes + the
 * framing, never below PR_GRPC_DEFAULT_MAX_MESSAGE_BYTES. */
uint64_t pr_forward_max_bytes(uint32_t max_tokens, uint32_t hidden_size, uint32_t num_experts);
/* Keepalive (docs/DESIGN.md section 11). Both sides ping their peer after this long without
 * activity and drop the connection when the ack does not come within the timeout: a dead
 * peer on an idle long-lived stream is found in about 35 s instead of TCP's minutes, and a
 * peer that stops answering mid-stream within 5 s of the next ping. The server accepts a
 * ping without data every PR_KEEPALIVE_TIME_MS / 3 (10 s), well below the client's 30 s, so
 * an idle stream never collects ping strikes (no too_many_pings GOAWAY) however long it
 * idles; a peer pinging faster than that gets PR_KEEPALIVE_MAX_PING_STRIKES strikes and then
 * a GOAWAY. The environment variable MOERPC_KEEPALIVE_TIME_MS (100..3600000; tests only)
 * replaces the 30 s on the side that reads it, and the rest follows from it. */
#define PR_KEEPALIVE_TIME_MS 30000
#define PR_KEEPALIVE_TIMEOUT_MS 5000
#define PR_KEEPALIVE_MAX_PING_STRIKES 2
/* The keepalive period in effect: PR_KEEPALIVE_TIME_MS, or MOERPC_KEEPALIVE_TIME_MS when set
 * to a number in 100..3600000 (read once). */
int pr_keepalive_time_ms(void);

/* A read-only view of bytes. */
typedef struct pr_seg {
  const uint8_t *p;
  size_t len;
} pr_seg;

/* The payload (field 15) of a received message: views into the received slices. */
typedef struct pr_payload {
  pr_seg *segs;  /* n views, owned by the pr_split */
  size_t n;
  size_t len;    /* total bytes */
  bool present;  /* field 15 occurred */
} pr_payload;

/* A received message split into header bytes and payload views. Zero-initialise it
 * (pr_split s = {0};) before the first pr_split_message. */
typedef struct pr_split {
  uint8_t *hdr;  /* contiguous copy of all fields but 15, owned */
  size_t hdr_len;
  pr_payload payload;
  size_t cap_hdr, cap_segs; /* internal */
} pr_split;

/* Splits the message made of in[0..n) (concatenated) into header and payload views.
 * The views stay valid as long as the input memory does. The caller releases the split
 * with pr_split_free (it may be reused: a second pr_split call reuses its buffers).
 * Errors: MR_EFORMAT (bad varint, truncated field, bad wire type, header over
 * PR_MAX_HEADER_BYTES) naming the byte offset and field number; MR_ENOMEM. */
int pr_split_message(pr_split *s, const pr_seg *in, size_t n, mr_err *e);
void pr_split_free(pr_split *s);
/* Copies the payload into dst (which holds at least s->payload.len bytes). */
void pr_payload_gather(const pr_payload *p, void *dst);

/* Decodes a ForwardRequest / ForwardReply from segments: *hdr gets the protobuf-c message
 * (its hidden/output field empty; free with the matching __free_unpacked(hdr, NULL)) and
 * split holds the payload views. No semantic validation (that is the server's). */
int pr_forward_request_decode(const pr_seg *in, size_t n, pr_split *split,
                              Moerpc__V1__ForwardRequest **hdr, mr_err *e);
int pr_forward_reply_decode(const pr_seg *in, size_t n, pr_split *split,
                            Moerpc__V1__ForwardReply **hdr, mr_err *e);

/* Writes into out (at least 11 bytes) the tag of field 15 (0x7a) and varint(len); returns
 * the bytes written. */
size_t pr_payload_prefix(uint8_t *out, uint64_t len);

/* ---- gRPC byte buffers -------------------------------------------------------------- */

/* Lists the slices of a received raw, uncompressed byte buffer as views into segs
 * (heap array, caller frees with mr_free); the views point into bb, so they are valid until
 * bb is destroyed. A compressed buffer (possible only if gRPC's per-message decompression
 * is turned off; 1.51's reader does not decompress) is refused with MR_ENOTSUP. */
int pr_bb_segs(grpc_byte_buffer *bb, pr_seg **segs, size_t *n, mr_err *e);

/* Encodes msg (whose payload field must be empty) followed by payload[0..len) as field 15.
 * The payload is referenced, not copied: release(owner) is called once gRPC drops its
 * last reference, which can be after the SEND_MESSAGE completes. release may be NULL when
 * the memory outlives the call (static). len 0 sends no field 15. Returns NULL on ENOMEM. */
grpc_byte_buffer *pr_encode_with_payload(const ProtobufCMessage *msg, const void *payload,
                                         size_t len, void (*release)(void *owner), void *owner);
/* Encodes a small message into one slice (copying). NULL on ENOMEM. */
grpc_byte_buffer *pr_encode(const ProtobufCMessage *msg);
/* Decodes a small message from bb with protobuf-c (joins slices). *out is freed with
 * protobuf_c_message_free_unpacked(*out, NULL). MR_EFORMAT names the message type. */
int pr_decode(grpc_byte_buffer *bb, const ProtobufCMessageDescriptor *d, size_t max_bytes,
              ProtobufCMessage **out, mr_err *e);

/* ---- Health ------------------------------------------------------------------------- */
/* grpc.health.v1 HealthCheckResponse.ServingStatus values. */
enum { PR_HEALTH_UNKNOWN = 0, PR_HEALTH_SERVING = 1, PR_HEALTH_NOT_SERVING = 2 };
/* Encodes a HealthCheckResponse{status} (hand-framed: one varint field). */
grpc_byte_buffer *pr_health_response_encode(int status);
/* Decodes a HealthCheckResponse; MR_EFORMAT on malformed input. */
int pr_health_response_decode(grpc_byte_buffer *bb, int *status, mr_err *e);
/* Encodes a HealthCheckRequest{service} (service may be "" for the whole server). */
grpc_byte_buffer *pr_health_request_encode(const char *service);
/* Decodes a HealthCheckRequest into service (cap bytes, NUL-terminated; "" when the field
 * is absent). Walks the slices with the segment reader of the Forward decoder: unknown
 * fields are skipped and the last `service` wins. MR_EFORMAT (naming the byte offset) on
 * malformed framing, a service field that is not length-delimited, or a name of cap bytes
 * or more; MR_ENOTSUP on a compressed buffer. */
int pr_health_request_decode(grpc_byte_buffer *bb, char *service, size_t cap, mr_err *e);

/* ---- HelloRequest.client_name as sent -------------------------------------------------- */
/* protobuf-c hands a string field over NUL-terminated and without its length, so a NUL in
 * client_name would cut what the server logs; this reads the field's bytes as they are on
 * the wire. Copies the first min(length, cap) bytes of the last client_name (field 3) of
 * the HelloRequest in bb into buf (not NUL-terminated) and sets *len to the field's whole
 * length (0 when absent; more than cap when cut). Walks the slices like the health
 * decoders: other fields skipped, MR_EFORMAT (naming the byte offset) on malformed framing
 * or a field 3 that is not length-delimited; MR_ENOTSUP on a compressed buffer. The bytes
 * are the peer's: escape them (mr_log_escape) before they reach a log line. */
int pr_hello_client_name(grpc_byte_buffer *bb, char *buf, size_t cap, size_t *len, mr_err *e);

/* ---- gRPC helpers shared by server and client ---------------------------------------- */
/* Client channels: fills args_out[0..PR_CHANNEL_ARGS) with max send/receive message length =
 * max_bytes and the client's keepalive (ping period pr_keepalive_time_ms(), timeout, pings
 * allowed without calls and without data); returns PR_CHANNEL_ARGS. */
#define PR_CHANNEL_ARGS 6
size_t pr_channel_args(grpc_arg *args_out, int max_bytes);
/* The server: the same message limits and keepalive, plus the ping policy that accepts the
 * clients' pings (minimum interval pr_keepalive_time_ms() / 3, PR_KEEPALIVE_MAX_PING_STRIKES);
 * returns PR_SERVER_ARGS. */
#define PR_SERVER_ARGS 8
size_t pr_server_args(grpc_arg *args_out, int max_bytes);
/* Converts an MR_E* code to the gRPC status of docs/DESIGN.md section 4 and back. */
grpc_status_code pr_status_from_mr(int code);
int pr_mr_from_status(grpc_status_code st);
/* The name of a gRPC status ("INVALID_ARGUMENT"), "STATUS?" for a code gRPC does not
 * define: for log lines and error messages of both sides. */
const char *pr_status_name(grpc_status_code st);
/* Converts a "host:port" address to a gRPC target ("ipv4:1.2.3.4:5", "ipv6:[::1]:5",
 * else "dns:///host:port"). */
void pr_target_from_address(const char *address, char *buf, size_t len);

/* ---- ThreadSanitizer and gRPC --------------------------------------------------------- */
/* gRPC is not built with ThreadSanitizer, so TSan cannot see the orderings that gRPC's own
 * locks and atomics create between two of our threads: a batch started on one thread and
 * completed on the completion-queue thread, a payload slice released on a gRPC thread
 * after the last write to its memory. PR_HB_RELEASE(p) on the thread that hands p over and
 * PR_HB_ACQUIRE(p) on the thread that takes it state that edge to TSan. Outside TSan
 * builds they compile to nothing. */
#if defined(__SANITIZE_THREAD__)
#define PR__TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define PR__TSAN 1
#endif
#endif
#ifdef PR__TSAN
void __tsan_acquire(void *addr);
void __tsan_release(void *addr);
#define PR_HB_RELEASE(p) __tsan_release(p)
#define PR_HB_ACQUIRE(p) __tsan_acquire(p)
#else
#define PR_HB_RELEASE(p) ((void)(p))
#define PR_HB_ACQUIRE(p) ((void)(p))
#endif

#ifdef __cplusplus
}
#endif
#endif /* PR_H */
