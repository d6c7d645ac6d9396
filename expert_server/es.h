/*
 * es.h - moerpc expert server: the one public header of expert_server/.
 *
 * An es_server owns a set of (layer, expert) pairs of one MoE model, keeps their packed
 * weights in memory (kernels/kn.h) and answers ForwardRequests over gRPC (proto/moe.proto,
 * docs/DESIGN.md section 4). Life cycle:
 *
 *   es_server_opts o; es_server_opts_init(&o); o.model_dir = ...; o.experts = ...;
 *   es_server *s; es_server_new(&s, &o, &e);   checks flags, model and tensor shapes, binds
 *   es_server_run(s, &e);                      answers health at once, loads the owned experts
 *                                              (loader thread), serves until drained
 *   es_server_free(s);
 *
 * Threads (documented where they meet in internal.h):
 *   - the thread that calls es_server_run runs a libuv loop: signals, the metrics timer and
 *     the drain sequence;
 *   - opts.grpc_threads gRPC threads, one completion queue each; every call is bound to the
 *     queue of the thread that accepted it, so one call's events run on one thread;
 *   - one compute thread owns the kn_engine: it pops validated requests from a queue, merges
 *     queued requests of the same layer and runs kn_moe_forward on the engine's workers.
 *
 * Drain (SIGTERM/SIGINT or es_server_stop): health turns NOT_SERVING (and stays readable
 * until the end: the listener is kept), new Forward streams end at once with UNAVAILABLE,
 * requests that arrive on open streams get UNAVAILABLE replies, every request accepted
 * before is answered (bounded by opts.drain_timeout_ms; past it, queued ones are answered
 * UNAVAILABLE without being computed), open streams are finished with status OK, and
 * es_server_run returns 0 (es_server_unanswered says whether a reply was lost). A second signal during the drain makes
 * es_server_run return MR_ECANCELED at once.
 *
 * Also here: es_forward_validate, the pure validation of a decoded ForwardRequest against
 * the server's limits, and the finite checks of hidden states and outputs
 * (es_hidden_check_finite, es_output_check_finite), and the weight-cache manifest check
 * (es_cache_manifest_check), public so that the unit test and the fuzzer reach them
 * directly.
 *
 * This header needs neither gRPC nor the generated protobuf code: the decoded request is
 * an incomplete type here, defined by proto/pr.h (moe.pb-c.h) for the code that builds
 * or reads one.
 */
#ifndef ES_H
#define ES_H

#include "common/mr.h"
#include "kernels/kn.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Options of one server. Strings are borrowed: they must stay valid until es_server_new
 * returns (the server copies what it keeps). */
typedef struct es_server_opts {
  const char *model_dir;     /* HF model directory: config.json + *.safetensors (required) */
  const char *listen;        /* "HOST:PORT" ("[v6addr]:PORT" for IPv6); port 0 = any free port */
  const char *experts;       /* id set of experts owned in every owned layer (required) */
  const char *layers;        /* id set of layers, "all" = every MoE layer of the model */
  uint32_t threads;          /* kernel worker threads, 0 = one per core of the used nodes */
  const char *numa;          /* "auto", a node count, or a node list; passed to kn_engine */
  uint32_t max_tokens;       /* most tokens in one ForwardRequest, 1..65536 */
  bool quant_set;            /* false: keep the stored dtype (bf16 stays bf16) */
  kn_format quant;           /* weight format when quant_set */
  uint32_t group;            /* int4 group size along K: 32, 64 or 128 (int4 only) */
  uint32_t grpc_threads;     /* gRPC threads = completion queues, 1..64 */
  uint32_t drain_timeout_ms; /* bound on answering accepted requests during a drain */
  uint32_t metrics_interval_ms; /* period of the metrics log line, 0 = never */
  bool handle_signals;       /* install SIGTERM/SIGINT (drain) and SIGHUP (reload the TLS files
                              * and the token) handlers in es_server_run */
  uint64_t max_inflight_bytes; /* admission budget: bytes held for requests and replies not yet
                                * sent; 0 = auto (es_server_new: a quarter of the memory
                                * available after loading, within ES_AUTO_INFLIGHT_MIN..MAX,
                                * and never below ES_INFLIGHT_MIN_REQUESTS requests) */
  uint32_t max_streams;      /* Forward streams open at once, server-wide, 1..ES_MAX_MAX_STREAMS;
                              * 0 = auto: the budget / ES_STREAM_SHARE, within
                              * ES_AUTO_STREAMS_MIN..MAX, set once the budget is */
  uint32_t stall_timeout_ms; /* a stream whose reply has not been taken by its client for this
                              * long is cut (RESOURCE_EXHAUSTED) and its memory freed; 0 = never */
  /* Security (docs/DESIGN.md section 11). Files are read by es_server_new, before the model
   * is loaded, through mr_file_read (regular files only, PEM files at most
   * ES_MAX_PEM_BYTES; the key and the token also not readable by group or others), and
   * again on SIGHUP. Every certificate of tls_cert must be valid now and tls_key must be
   * the first one's key. The server keeps its own copies of the paths. */
  const char *tls_cert;      /* PEM certificate chain: serve TLS (with tls_key); NULL = plaintext */
  const char *tls_key;       /* PEM private key of tls_cert */
  const char *tls_client_ca; /* PEM roots: require and verify a client certificate (mTLS) */
  const char *auth_token_file; /* bearer token every Hello, Stats and Forward call must carry
                                * ("authorization: Bearer <token>"); NULL = no token needed */
  bool insecure;             /* allow plaintext on a non-loopback listen address */
  uint64_t max_expert_memory; /* live placement: LoadExperts is refused RESOURCE_EXHAUSTED when
                               * the packed expert bytes would exceed this; 0 = no limit of its
                               * own (MemAvailable minus ES_LOAD_MEM_MARGIN always applies) */
  uint32_t unload_grace_s;   /* live placement: an unloaded pair leaves Hello at once but is
                              * still served until no open Forward stream has used it, at most
                              * this long (seconds, 0..ES_MAX_UNLOAD_GRACE_S; 0 = freed at
                              * once); es_server_opts_init sets ES_DEFAULT_UNLOAD_GRACE_S */
  const char *metrics_listen; /* "HOST:PORT" (or "PORT": 127.0.0.1) of the Prometheus /metrics
                               * endpoint, NULL = off; port 0 = any free port (logged;
                               * es_server_metrics_port) */
  const char *weight_cache;  /* --weight-cache DIR: packed-weight cache (docs/DESIGN.md section
                              * 23), NULL = none */
  bool verify_cache;         /* check the cache's checksums before readiness, not after */
  bool map_weights;          /* --map-weights: serve experts stored as served (bf16 / f16 /
                              * f32, one NUMA node) in place from the model's files, no copy
                              * (docs/DESIGN.md section 6.6); others are packed as usual */
  const char *metrics_token_file; /* bearer token /metrics requires (the probes /healthz and
                                   * /readyz stay open, for kubelet); NULL = none */
} es_server_opts;

#define ES_DEFAULT_LISTEN "127.0.0.1:50051"
#define ES_DEFAULT_UNLOAD_GRACE_S 30u
#define ES_MAX_UNLOAD_GRACE_S 86400u
#define ES_DEFAULT_MAX_TOKENS 1024u
#define ES_MAX_MAX_TOKENS 65536u
#define ES_DEFAULT_GROUP 64u
#define ES_DEFAULT_GRPC_THREADS 1u
#define ES_MAX_GRPC_THREADS 64u
#define ES_DEFAULT_METRICS_INTERVAL_MS 10000u
#define ES_DEFAULT_DRAIN_TIMEOUT_MS 10000u
#define ES_MAX_DRAIN_TIMEOUT_MS 3600000u
#define ES_MAX_THREADS 4096u
#define ES_MAX_MAX_STREAMS 65536u
/* The auto --max-streams: one Forward stream per ES_STREAM_SHARE bytes of the budget, within
 * ES_AUTO_STREAMS_MIN..MAX (512 MiB: 128 streams; 2 GiB: 512). A stream's own charge
 * (ES_STREAM_OVERHEAD plus its HTTP/2 window, an eighth of its share) then takes at most
 * a seventh of the budget (docs/DESIGN.md 3.5). */
#define ES_STREAM_SHARE ((uint64_t)4 << 20)
#define ES_AUTO_STREAMS_MIN 16u
#define ES_AUTO_STREAMS_MAX 1024u
/* The HTTP/2 window of one stream (GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, BDP probing off):
 * what gRPC reads ahead of a RECV the server has not armed. An eighth of a stream's share of
 * the budget, within these bounds. */
#define ES_STREAM_WINDOW_MIN ((uint64_t)64 << 10)
#define ES_STREAM_WINDOW_MAX ((uint64_t)1 << 20)
/* What else one open Forward stream costs beyond its requests and its window: gRPC's call
 * and HTTP/2 stream state, our es_stream, a partly parsed frame. Charged to the budget with
 * the window from accept to free. */
#define ES_STREAM_OVERHEAD ((uint64_t)64 << 10)
/* The largest read gRPC makes from one connection (GRPC_ARG_TCP_MAX_READ_CHUNK_SIZE). */
#define ES_TCP_READ_CHUNK ((uint64_t)64 << 10)
/* Calls one HTTP/2 connection may have open beyond --max-streams
 * (GRPC_ARG_MAX_CONCURRENT_STREAMS is max_streams + this): Hello, Stats, health and the
 * control calls still get a stream while one connection carries every Forward stream the
 * server allows. Forward streams past --max-streams are refused by the server, which ends
 * them at once and frees their HTTP/2 slot. */
#define ES_CONTROL_CALLS_PER_CONNECTION 32u
#define ES_DEFAULT_STALL_TIMEOUT_MS 30000u
#define ES_MAX_STALL_TIMEOUT_MS 3600000u
#define ES_AUTO_INFLIGHT_MIN ((uint64_t)256 << 20)
#define ES_AUTO_INFLIGHT_MAX ((uint64_t)8 << 30)
/* The budget holds at least this many largest requests (max_tokens rows of f32). */
#define ES_INFLIGHT_MIN_REQUESTS 4u
/* top_k accepted per token: the model's num_experts_per_tok times this, at most num_experts
 * (announced as HelloReply.max_top_k). A client that computes shared or extra experts on
 * the server's side may send a few more slots than the router picks; far more is no client
 * of this model, and top_k sizes the kernel's scratch. */
#define ES_TOP_K_FACTOR 4u
static inline uint32_t es_max_top_k(uint32_t experts_per_tok, uint32_t num_experts) {
  uint64_t k = (uint64_t)experts_per_tok * ES_TOP_K_FACTOR;
  return k > num_experts ? num_experts : (uint32_t)k;
}
#define ES_MAX_PEM_BYTES ((size_t)1 << 20)
/* A LoadExperts must leave this much of MemAvailable (/proc/meminfo) free. */
#define ES_LOAD_MEM_MARGIN ((uint64_t)512 << 20)

/* True if the host of listen ("HOST:PORT", "[V6]:PORT") is a loopback address: 127.0.0.0/8,
 * ::1 or "localhost". 0.0.0.0, [::] and every other name are not. es_server_new refuses
 * plaintext on anything else unless opts.insecure. */
bool es_listen_is_loopback(const char *listen);

/* Fills o with the defaults above (layers "all", numa "auto", signals on).
 * model_dir and experts stay NULL: the caller must set them. */
void es_server_opts_init(es_server_opts *o);

typedef struct es_server es_server;

/* Opens the model, checks every owned tensor's presence and shape, creates the kn_engine
 * and empty layers, creates the gRPC server and binds opts->listen (and
 * opts->metrics_listen, whose endpoint is up from here on); the weights are packed by
 * es_server_run, while health already answers (liveness SERVING, readiness NOT_SERVING).
 * No call is answered before es_server_run. On success the caller owns *out and frees it with es_server_free.
 * Errors: MR_EINVAL only when an option is wrong, in itself or for this model (the message
 * names the flag and the limit, e.g. "--experts: id 300 must be < num_experts = 256"; a
 * non-loopback --listen without --tls-cert or --insecure; a token or PEM file that is not a
 * regular file or not a valid token); any
 * other code is a runtime failure (a missing tensor or a wrong shape names the file, the
 * tensor and both shapes; a port that cannot be bound names the address). */
int es_server_new(es_server **out, const es_server_opts *opts, mr_err *e);

/* The TCP port bound by es_server_new (the real one when opts.listen asked for port 0). */
int es_server_port(const es_server *s);
/* The port of the /metrics endpoint, 0 without opts.metrics_listen. */
int es_server_metrics_port(const es_server *s);

/* The admission budget in use (opts.max_inflight_bytes, or the one derived from the machine). */
uint64_t es_server_inflight_budget(const es_server *s);

/* After es_server_run returned 0: requests accepted before or during the drain whose reply
 * was never delivered (the drain timed out, or their client went away meanwhile). The
 * server binary exits 3 when it is not 0. */
uint64_t es_server_unanswered(const es_server *s);

/* Starts gRPC (health only), loads the owned experts on a loader thread (logging progress
 * at most once a second), then serves on the calling thread until a drain completes; a
 * drain may begin during the load. Returns 0 after a clean drain, a load error (a tensor
 * that cannot be packed, MR_EFORMAT naming it) if loading failed,
 * MR_ECANCELED when a second signal arrived during the drain (the caller should then exit
 * the process at once without es_server_free: calls may still be in flight), or another
 * code if serving could not start. Call at most once. */
int es_server_run(es_server *s, mr_err *e);

/* Starts the drain as a signal would. Safe from any thread and from a signal handler, at
 * any time between es_server_new and es_server_free; a no-op once a drain has begun. */
void es_server_stop(es_server *s);

/* Frees the server: joins its threads, destroys every gRPC object and the weights. Call after
 * es_server_run returned 0, or instead of es_server_run. NULL is a no-op. */
void es_server_free(es_server *s);

/* Largest HelloRequest / StatsRequest accepted (pr_decode's limit in es_grpc.c; the fuzz
 * targets of both decoders use it too). */
#define ES_MAX_CONTROL_REQUEST_BYTES (64u << 10)

/* ---- request validation ---------------------------------------------------------------- */

/* Largest LoadRequest / UnloadRequest accepted (a whole model's pairs fit). */
#define ES_MAX_CONTROL_REQUEST_BYTES_LARGE (16u << 20)
struct Moerpc__V1__LayerExperts;

/* A ForwardRequest header as pr_forward_request_decode returns it (proto/pr.h). */
struct Moerpc__V1__ForwardRequest;

/* What a server accepts. Every pointer is borrowed and read-only. */
typedef struct es_limits {
  uint32_t num_layers;         /* layers of the model; valid layer ids are < num_layers */
  uint32_t num_experts;        /* routed experts per MoE layer */
  uint32_t hidden_size;        /* H: elements per token row of hidden */
  uint32_t max_tokens;         /* most tokens in one request */
  uint32_t max_top_k;          /* most slots per token; 0 = num_experts. A server sets it to
                                * es_max_top_k(num_experts_per_tok, num_experts) */
  const uint8_t *is_moe;       /* [num_layers]: 1 = the layer has routed experts */
  const mr_idset *const *owned; /* [num_layers]: experts served in layer l, NULL = layer
                                  * not served here */
} es_limits;

/* Checks a decoded ForwardRequest (its payload field not decoded: hidden_len is the length
 * of field 15 as framed) against lim. Pure: no I/O, no allocation, no global state, so the
 * same request always gets the same answer. Returns 0 or
 *   MR_EINVAL     (INVALID_ARGUMENT 3): layer out of range or not a MoE layer, n_tokens 0,
 *                 top_k 0 or > max_top_k (num_experts when 0), expert_ids/weights length != n_tokens * top_k,
 *                 an id < -1 or >= num_experts, dtype not F32/F16/BF16, hidden length !=
 *                 n_tokens * hidden_size * dtype size, a non-finite weight;
 *   MR_EPRECOND   (FAILED_PRECONDITION 9): layer or expert not served here;
 *   MR_EEXHAUSTED (RESOURCE_EXHAUSTED 8): n_tokens > max_tokens;
 * with e->msg naming the field, its value and the limit. The checks run in this order, and
 * the first one that fails is reported: layer range, layer served, n_tokens, top_k,
 * max_tokens, the two lengths, every id's range, every id's ownership, dtype, hidden length,
 * weights. (Ranges of all ids come before ownership so that a malformed request is always
 * INVALID_ARGUMENT, whatever its other ids are.) */
int es_forward_validate(const struct Moerpc__V1__ForwardRequest *req, size_t hidden_len,
                        const es_limits *lim, mr_err *e);

/* Checks the pairs of a LoadRequest.add / UnloadRequest.drop (n_items LayerExperts) against
 * the model: req_fingerprint ("" or NULL = not checked) must equal fingerprint (else
 * MR_EMISMATCH), each layer < num_layers and a MoE layer (lim->is_moe), each expert <
 * num_experts, at least one expert per item and one pair in all (else MR_EINVAL naming the
 * item, the value and the limit). Ownership is not looked at (the caller skips pairs that
 * need nothing). Fills pairs[num_layers * num_experts] (1 = named) and *n_pairs (distinct
 * pairs). Pure. */
int es_control_validate(const struct Moerpc__V1__LayerExperts *const *items, size_t n_items,
                        const char *req_fingerprint, const char *fingerprint, const es_limits *lim,
                        uint8_t *pairs, uint64_t *n_pairs, mr_err *e);
/* What a weight-cache manifest must say for this server to use it (es_cache.c): every
 * identity field of docs/DESIGN.md section 23. Borrowed strings and arrays ([n_slices]). */
typedef struct es_cache_want {
  const char *fingerprint, *model_stamp, *model_dir, *format, *isa;
  uint32_t hidden, inter, num_layers, num_experts, n_slices;
  const uint32_t *slice_off, *slice_len;
  const uint64_t *slice_bytes;
} es_cache_want;
/* Checks a manifest's text (read from path, named in messages) against w without touching
 * any file: 0 with *n_segs its segments, MR_EMISMATCH (made for another server: e names the
 * field), MR_EFORMAT (malformed: e names the field and the limit) or MR_ENOMEM. Pure. The
 * server's own reader and tests/fuzz/fuzz_cache_manifest.c use it. */
int es_cache_manifest_check(const es_cache_want *w, const char *text, size_t len, const char *path,
                            uint32_t *n_segs, mr_err *e);

/* The memory rule of LoadExperts: 0 if need <= free_bytes, else MR_EEXHAUSTED naming both
 * (RESOURCE_EXHAUSTED on the wire). Pure. */
int es_load_mem_check(uint64_t need, uint64_t free_bytes, mr_err *e);

/* Checks that the n_tokens x H hidden states at x (row-major, dtype dt: F32, F16 or BF16,
 * little-endian, any alignment) are all finite: one pass, an integer test of each
 * element's exponent bits (all set = NaN or Inf), vectorised. Pure. Called by the gRPC
 * thread right after the payload is gathered into the request's buffer, while those bytes
 * are in cache. Returns 0, or MR_EINVAL (INVALID_ARGUMENT) for the first non-finite
 * element in memory order, e.g. "hidden[token 3, index 17] = NaN (bf16 bits 0x7fc1):
 * hidden states must be finite". Denormals and the largest finite value pass. */
int es_hidden_check_finite(const void *x, mr_dtype dt, uint32_t n_tokens, uint32_t H, mr_err *e);

/* Checks one request's output rows y[n_tokens x H] of `layer` as they go on the wire: in
 * the wire dtype dt (F32, F16 or BF16), after the conversion from fp32, so that an fp32
 * value that overflows f16 (> 65504) is caught too. y32 (may be NULL) is the fp32 rows y
 * was converted from, used only to word the message. Pure. Returns 0, or MR_ERANGE for the
 * first non-finite element in memory order: "output[token t, index i] = +Inf in layer l:
 * the expert output 7.2e+04 does not fit the f16 wire dtype (largest finite 65504; ...)"
 * when y32[i] is finite, else "... = NaN in layer l: the expert output is not finite in
 * fp32 (...)": the request was valid (finite inputs) but its expert outputs do not fit. The
 * compute thread answers that request alone with INTERNAL (13), never OK with a NaN or an
 * Inf (docs/DESIGN.md section 5, "Finite checks"). */
int es_output_check_finite(const void *y, mr_dtype dt, const float *y32, uint32_t layer,
                           uint32_t n_tokens, uint32_t H, mr_err *e);

#ifdef __cplusplus
}
#endif
#endif /* ES_H */
