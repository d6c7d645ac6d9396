/*
 * moerpc_client.h - libmoerpc-client: the one public header of gpu_client/.
 *
 * A client of a moerpc cluster: one or more expert servers (moerpc-server) that each own
 * a set of (layer, expert) pairs of one MoE model, plus optionally experts the client
 * computes itself ("local" experts, the hot ones). One MoE layer call is
 *
 *     out[t] = sum over slots j of token t with ids[t,j] >= 0 of
 *              weights[t,j] * expert_{ids[t,j]}(x[t])
 *
 * and the library splits it by owner: each server gets one ForwardRequest with only the
 * tokens that have at least one slot it owns and only those slots (the others set to -1);
 * the local slots are computed on the calling thread while the requests are in flight;
 * the parts are summed in fp32 and scattered back to the original token rows.
 *
 *   gc_cluster_open      read the cluster file, Hello every server (concurrently, with a
 *                        deadline), check they serve one model, build the owner map, load
 *                        local experts, check every layer is covered, open the streams
 *   gc_layer_submit      fan one layer call out (non-blocking apart from local experts)
 *   gc_layer_wait        wait for every part (or the deadline) and sum them
 *   gc_layer_forward     submit + wait
 *   gc_cluster_close     tear everything down
 *
 * Ownership rule: an expert computed locally is never sent to a server; otherwise every
 * live server that announces the pair in its Hello is a replica of it, and each slot of a
 * layer call goes to the replica with the least outstanding work (slots queued and in
 * flight on its stream), ties taking turns (a placement's gc_options.route pins a pair to
 * one server while that server is up). A server still gets one request per layer call
 * (more only above its max_tokens).
 *
 * Failover (docs/DESIGN.md "Replicas and failover"): a server whose stream breaks, or that
 * leaves a request unanswered for failover_ms while other replicas could take it, is
 * marked down; the call's requests to it are re-planned over the live replicas of their
 * slots and resent, and the call completes with the same sum (replies of the failed
 * attempt are dropped). With no live replica for some slot the call fails with
 * MR_EUNAVAIL naming the layer, the experts and the down servers. A down server is Hello'd
 * in the background with backoff (200 ms doubling to 2 s) and serves again only when its
 * fingerprint, dimensions and weight_format match the cluster's.
 *
 * Errors: every function returning int returns 0 or a negative MR_E* code (common/mr.h) and
 * fills the caller's mr_err (may be NULL) with a message naming the server (name and
 * address), the request id and the layer where they apply, e.g.
 *   "layer 3 request 17: server s1 (127.0.0.1:50052): stream ended (UNAVAILABLE: Socket
 *    closed)".
 * Nothing here blocks without a deadline: a dead or slow server is an error naming it.
 *
 * Threads: gc_cluster_open/close are called by one thread while no other call on that
 * cluster runs. Everything else may be called from any thread, concurrently: several
 * threads may each submit and wait their own layer calls on one cluster. A gc_pending is
 * used by one thread at a time. Local experts are computed on the submitting thread, one
 * call at a time per cluster (a lock serialises them, as the kernel engine requires).
 * Internally one I/O thread per cluster owns the gRPC completion queue of the streams.
 */
#ifndef MOERPC_CLIENT_H
#define MOERPC_CLIENT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/mr.h"
#include "kernels/kn.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct gc_cluster gc_cluster;
typedef struct gc_pending gc_pending;

/* Most tokens in one layer call (the library splits a part that exceeds a server's
 * max_tokens into several requests; this bounds the client's own buffers). */
#define GC_MAX_TOKENS (1u << 20)
/* Most slots per token. */
#define GC_MAX_TOP_K 1024u

/* Deadline of the Hello round at open when gc_options.connect_timeout_ms is 0. */
#define GC_DEFAULT_CONNECT_TIMEOUT_MS 10000u

/* Values of gc_cluster_owner() besides a server index. */
#define GC_OWNER_NONE (-1)
#define GC_OWNER_LOCAL (-2)  /* computed by the library (the cluster file's "local" section) */
#define GC_OWNER_CALLER (-3) /* computed by the caller itself (gc_options.caller_local) */

typedef struct gc_options {
  /* Sent as HelloRequest.client_name (servers log it). NULL = "moerpc-client". */
  const char *client_name;
  /* Per-request deadline in ms from submit, 1..MR_CLUSTER_MAX_DEADLINE_MS; 0 = the cluster
   * file's deadline_ms. */
  uint32_t deadline_ms;
  /* Deadline of the Hello round at open (all servers at once), ms; 0 =
   * GC_DEFAULT_CONNECT_TIMEOUT_MS. Servers
   * that are still starting are waited for up to this long. */
  uint32_t connect_timeout_ms;
  /* Model directory; overrides the cluster file's "model". NULL or "" = the file's.
   * When a model is known its config and fingerprint are checked against the servers,
   * every MoE layer of its config must be covered, and local experts load from it. */
  const char *model_dir;
  /* Ignore the cluster file's "local" section (everything goes to servers). */
  bool no_local;
  /* Format of local experts; KN_FMT_COUNT = the servers' weight_format (so that local and
   * remote experts compute the same numbers). local_group: INT4 group, 0 = the servers'. */
  kn_format local_format;
  uint32_t local_group;
  /* Serve local experts in place from the model's safetensors mapping, as the server's
   * --map-weights does: where the file stores what is served (bf16, f16 or f32 with the
   * servers' format; no int8/int4/fp8 conversion) and the engine has one NUMA node, each
   * expert reads the three tensors where the file has them, after a finite check; the
   * others are packed as usual. The mapping stays open until gc_cluster_close: the model's
   * files must not be rewritten in place meanwhile (a replaced file is fine). */
  bool local_map_weights;
  /* Kernel engine of the local experts (ISA, threads, NUMA); see kernels/kn.h. */
  kn_engine_opts local_engine;
  /* An engine to compute local experts on instead of a new one (not owned; must outlive
   * the cluster). A model runner passes its own so that one pool serves everything. */
  kn_engine *shared_engine;
  /* Pairs the caller computes itself, e.g. hot experts on the GPU: caller_local[l * E + x]
   * != 0 for (layer l, expert x), caller_local_len = num_layers * num_experts of the
   * servers' model (checked at open), or NULL / 0 for none. They count as covered, are
   * never routed to a server, and submit skips their slots as if they were -1 (the
   * contract of kt-kernel's gpu_experts_mask). Read at open only. */
  const uint8_t *caller_local;
  size_t caller_local_len;
  /* A placement's routing: route[l * E + x] = index of the server (cluster file order) that
   * must compute (l, x), or -1 for the default rule (the least loaded live replica); route_len =
   * num_layers * num_experts, or NULL / 0. A server named for a pair it does not announce
   * is refused at open (MR_EPRECOND naming layer, expert and server). Read at open only. */
  const int32_t *route;
  size_t route_len;
  /* Failover deadline, ms: a request unanswered this long (and its server silent this
   * long) is resent to other replicas of its slots and its server marked down, when every
   * slot has another live replica; otherwise it waits for the request deadline. 0 = the
   * cluster file's "failover_ms", else min(deadline_ms / 4, 1000) (at least 1). A value
   * of deadline_ms or more leaves only broken streams to fail over. */
  uint32_t failover_ms;
  /* Sliding window of the routing counters, in steps (see "routing statistics"), 1..
   * GC_ROUTING_MAX_WINDOW; 0 = GC_ROUTING_DEFAULT_WINDOW. */
  uint32_t routing_window;
  /* Microseconds the waiter (gc_layer_wait) watches for its replies before it sleeps on
   * them, 0..GC_WAIT_SPIN_MAX_US (0 = it sleeps at once, the default). A reply then reaches
   * the caller without a wake-up of its thread (about 5 us a round trip on a 2-vCPU VM,
   * docs/DESIGN.md section 6), at the price of that much CPU per wait: for a caller with a
   * core of its own, not for one that shares its cores with the servers. The watch yields
   * the CPU to any other runnable thread (the library's I/O thread, on a one-CPU client). */
  uint32_t wait_spin_us;
} gc_options;
#define GC_WAIT_SPIN_MAX_US 10000u
/* Fills o with the defaults above. */
void gc_options_init(gc_options *o);

/*
 * Opens a cluster from the JSON cluster file at path (format in common/mr.h,
 * mr_cluster_load): Hellos every server concurrently (deadline connect_timeout_ms) and
 * refuses, with an error naming both servers and both values, a protocol major other
 * than 1, or any difference in model_fingerprint, hidden_size, intermediate_size,
 * num_layers, num_experts or weight_format. With a model known, also refuses a config or
 * fingerprint that differs from the servers'. Then loads the local experts, checks that
 * every layer any server owns (and every MoE layer of the model's config, when known) has
 * all experts 0..E-1 covered (else MR_EPRECOND "layer 3: experts 4-7 are owned by no
 * server and not local"), starts the I/O thread and opens one Forward stream per server.
 * opts may be NULL (defaults). On success *out is a new cluster the caller frees with
 * gc_cluster_close; on failure *out is NULL and e says why. Calls grpc_init (and
 * gc_cluster_close the matching grpc_shutdown).
 */
int gc_cluster_open(gc_cluster **out, const char *path, const gc_options *opts, mr_err *e);
/* Same, from an already parsed cluster file (copied; tests build one in memory). */
int gc_cluster_open_parsed(gc_cluster **out, const mr_cluster_file *file,
                           const gc_options *opts, mr_err *e);
/*
 * Half-closes every stream, waits up to 2 s for the servers to end them (then cancels),
 * joins the I/O thread and frees everything (gRPC objects, local experts). Every submitted
 * call must have been waited for. NULL is a no-op.
 */
void gc_cluster_close(gc_cluster *c);

/* One MoE layer call. Nothing is kept after gc_layer_submit returns: the caller may reuse
 * or free ids, weights and x at once. */
typedef struct gc_layer_req {
  uint32_t layer;        /* model layer, < num_layers */
  uint32_t n_tokens;     /* T, 1..GC_MAX_TOKENS */
  uint32_t top_k;        /* k, 1..min(num_experts, GC_MAX_TOP_K) */
  const int32_t *ids;    /* [T * k] expert ids, -1 = empty slot */
  const float *weights;  /* [T * k] slot weights (ignored for empty slots) */
  const void *x;         /* [T, hidden_size] row-major, of dtype */
  mr_dtype dtype;        /* wire dtype of x and of the servers' replies: f32, f16 or bf16 */
  /* Routing statistics only (see "routing statistics"); zero = none. */
  const int32_t *caller_ids; /* [T * k] or NULL: slots the caller computes itself and left
                              * out of ids (e.g. GPU experts masked to -1), counted, never
                              * routed; ids outside 0..num_experts-1 are ignored */
  uint32_t flags;            /* GC_REQ_PART: another part (a deferred one) of a call of this
                              * layer already submitted: counted, but ends no step.
                              * GC_REQ_FOLLOWED: this thread submits another call right
                              * after this one (gc_moe's deferred part): its requests are
                              * sent on their own rather than paired with their replies
                              * (docs/DESIGN.md section 6), so that the next call's requests
                              * to the same servers leave at once, not after these replies */
} gc_layer_req;
#define GC_REQ_PART 1u
#define GC_REQ_FOLLOWED 2u

/*
 * Starts one layer call: validates req (ids -1 or < num_experts, each owned by a server or
 * local: MR_ERANGE / MR_EPRECOND naming the slot, layer and expert; MR_EUNAVAIL when every
 * replica of some slot is down, naming the experts and servers), splits it by owner,
 * queues one request per server (several if a server's part exceeds its max_tokens) on that
 * server's stream, and computes the local experts' part on this thread while those are in
 * flight. Returns 0 and a new *pending, which the caller passes to gc_layer_wait exactly
 * once. Validation and out-of-memory errors return before anything is sent, with *pending
 * NULL; errors of one server (its stream could not be opened, a local kernel error) are
 * reported by gc_layer_wait. A stream that broke earlier is reopened here.
 */
int gc_layer_submit(gc_cluster *c, const gc_layer_req *req, gc_pending **pending, mr_err *e);
/*
 * Waits until every part of pending has replied, one part failed, or the deadline
 * (submit time + deadline_ms) passed; then, on success, writes the sum into out
 * ([T, hidden_size] fp32, overwritten; rows of tokens with no slot are 0). The parts are
 * summed in a fixed order (servers in file order, then local) so results do not depend on
 * reply order. Errors name the server, request id and layer: MR_ETIMEDOUT (no reply in
 * time), MR_EUNAVAIL (its stream broke: failed at once, not at the deadline), the reply's
 * status mapped to MR_E* with the server's own message, MR_EPROTO (a malformed reply, or
 * an OK reply holding a NaN or an Inf: every reply is checked, so no server's NaN or Inf
 * reaches out). A broken stream, a request past the failover deadline or a non-finite
 * reply is not an error while the slots of its request have other live replicas: they
 * are re-planned and resent inside this wait (same deadline); MR_EUNAVAIL "layer 3:
 * experts 4-7 have no live replica; down: server s1 (...): stream ended (...)" when they
 * do not (a non-finite reply: its own MR_EPROTO). With failovers the parts are summed in
 * request order (the first requests in server order, resent ones after). Replies that
 * arrive after the call gave up are dropped. Frees pending in every case.
 */
int gc_layer_wait(gc_cluster *c, gc_pending *pending, float *out, mr_err *e);
/* gc_layer_submit + gc_layer_wait. */
int gc_layer_forward(gc_cluster *c, const gc_layer_req *req, float *out, mr_err *e);

/* Where the time of one layer call went (microseconds), for overlap accounting. */
typedef struct gc_call_timing {
  uint64_t submit_us; /* the caller's own time in submit: split, gather, encode, queue */
  uint64_t rpc_us;    /* requests queued -> the last server reply arrived (0: no server
                       * part); what overlap can hide: rpc_us - wait_us */
  uint64_t wait_us;   /* time the caller spent blocked in the wait */
  uint64_t local_us;  /* library-local experts computed inside submit */
  uint32_t requests;  /* ForwardRequests sent */
} gc_call_timing;
#define GC_WAIT_ACCUMULATE 1u /* add the sum into out instead of overwriting it */
/* gc_layer_wait with options: flags GC_WAIT_ACCUMULATE; t (may be NULL) gets the timing.
 * out may be NULL when the call has no part at all (gc_pending_empty). */
int gc_layer_wait_timed(gc_cluster *c, gc_pending *pending, float *out, uint32_t flags,
                     gc_call_timing *t, mr_err *e);
/* Gives up a submitted call without waiting for it: requests still queued or in flight are
 * forgotten (their late replies are dropped) and pending is freed. NULL is a no-op. */
void gc_layer_cancel(gc_cluster *c, gc_pending *pending);
/* True when the submitted call had no slot for any server or the library (all empty or
 * caller-local): its wait returns at once and adds nothing. */
bool gc_pending_empty(const gc_pending *pending);

/* ---- overlap and deferral across MoE layers (kt-kernel's semantics) -------------------
 *
 * A gc_moe drives the MoE layers of one forward pass in order. Per layer:
 *
 *   gc_moe_submit   right after routing: the slots of pairs the caller computes
 *                   (caller_local) are skipped. A token's slots are ranked by weight
 *                   (empty slots last, ties keep the earlier slot); its slots ranked below
 *                   the top (top_k - max_deferred) that a server computes go out as a
 *                   separate DEFERRED call (hot ones are never deferred); the others as
 *                   the IMMEDIATE call.
 *                   last = true (the last MoE layer) defers nothing.
 *   ... the caller computes its hot and shared experts while both are in flight ...
 *   gc_moe_wait     waits for this layer's immediate call and for the deferred call of the
 *                   previous gc_moe_submit, and adds both into out ([T, H] fp32): the
 *                   deferred result of layer l (computed on layer l's input) lands in layer
 *                   l+1's output, so its RPC overlaps layer l+1's attention.
 *
 * With max_deferred = 0 it is plain overlap: one call per layer, exact results. With
 * max_deferred > 0 results change by design (the deferred experts see an older hidden
 * state); callers report the difference. Every layer of one pass must have the same T.
 * One thread drives a gc_moe; several gc_moe may share one cluster.
 */
typedef struct gc_moe gc_moe;
typedef struct gc_moe_timing {
  gc_call_timing now;      /* this layer's immediate call */
  gc_call_timing deferred; /* the previous layer's deferred call, waited here */
  uint32_t deferred_slots; /* slots this layer's submit deferred */
} gc_moe_timing;
/* A driver over cluster c (not owned; must outlive it). MR_ENOMEM only. */
int gc_moe_new(gc_moe **out, gc_cluster *c, uint32_t max_deferred, mr_err *e);
/* Waits out and drops any call still in flight, then frees. NULL is a no-op. */
void gc_moe_free(gc_moe *m);
uint32_t gc_moe_max_deferred(const gc_moe *m);
/* Starts layer req->layer (see above). A previous submit must have been waited. Errors as
 * gc_layer_submit; on error nothing of this layer is in flight (a deferred call of the
 * previous layer stays pending until gc_moe_wait or gc_moe_abort). */
int gc_moe_submit(gc_moe *m, const gc_layer_req *req, bool last, mr_err *e);
/* Waits as described above; out += immediate + previous deferred. t may be NULL. On error
 * everything in flight is dropped (the pass cannot go on). */
int gc_moe_wait(gc_moe *m, float *out, gc_moe_timing *t, mr_err *e);
/* Drops every call in flight (after an error elsewhere, or to end a pass early). */
void gc_moe_abort(gc_moe *m);
/* True while a deferred call waits for the next layer. */
bool gc_moe_has_deferred(const gc_moe *m);

/* ---- cluster information (valid from open to close; any thread) ------------------------ */

typedef struct gc_cluster_info {
  uint32_t hidden_size, intermediate_size, num_layers, num_experts; /* from Hello */
  char model_fingerprint[64];
  char weight_format[32];  /* "bf16", "int8", "int4-g64", ... */
  uint32_t max_tokens;     /* smallest max_tokens of all servers */
  uint32_t n_servers;
  uint32_t deadline_ms;    /* per-request deadline in effect */
  uint32_t failover_ms;    /* failover deadline in effect (gc_options.failover_ms) */
  uint64_t local_pairs;    /* (layer, expert) pairs computed locally by the library */
  uint64_t caller_pairs;   /* pairs the caller computes (gc_options.caller_local) */
  uint64_t local_mapped;   /* of local_pairs, those served in place (local_map_weights) */
  char model_dir[1024];    /* "" when no model is known */
} gc_cluster_info;
void gc_cluster_info_get(const gc_cluster *c, gc_cluster_info *out);

typedef struct gc_server_info {
  char name[64];
  char address[256];
  uint32_t protocol_major, protocol_minor;
  uint32_t max_tokens;
  uint64_t announced_pairs; /* (layer, expert) pairs in its Hello */
  uint64_t assigned_pairs;  /* pairs it is a replica of (not local, not caller-computed) */
  char instance_id[65];     /* its Hello's instance_id (protocol 1.3), "" from older servers */
  int32_t alias_of;         /* index of an earlier entry that is the same server process (same
                             * instance_id under another address), else -1: an alias is
                             * counted once, as that one, and gets no traffic */
} gc_server_info;
/* MR_ERANGE if idx >= n_servers. */
int gc_server_info_get(const gc_cluster *c, uint32_t idx, gc_server_info *out, mr_err *e);
/* The owner of (layer, expert) at open: its primary server (the routed one, else the first
 * in the file that announces it; other announcing servers are replicas,
 * gc_server_announces), GC_OWNER_LOCAL, GC_OWNER_CALLER or GC_OWNER_NONE (also for
 * out-of-range arguments). Not updated by a re-Hello after a "not served" reply (docs/
 * DESIGN.md 3.7), which re-routes a server-owned pair to whichever server announces it. */
int gc_cluster_owner(const gc_cluster *c, uint32_t layer, uint32_t expert);
/* Whether server idx announced (layer, expert) in its Hello at open (a replica of it); false
 * for an alias (gc_server_info.alias_of), whose pairs are its original's. */
bool gc_server_announces(const gc_cluster *c, uint32_t idx, uint32_t layer, uint32_t expert);
/* Index of the server called name, or -1. */
int gc_cluster_find_server(const gc_cluster *c, const char *name);

/* Client-side counters of one server since open (or the last reset). */
typedef struct gc_server_counters {
  uint64_t requests;         /* ForwardRequests queued */
  uint64_t paired;           /* of those, sent in one batch with their reply's receive
                              * (docs/DESIGN.md section 6: the rest were followed by another
                              * for this server, or found one outstanding) */
  uint64_t replies;          /* OK replies */
  uint64_t errors;           /* error replies + timeouts + stream failures */
  uint64_t timeouts;         /* requests given up at the deadline */
  uint64_t stream_breaks;    /* streams that ended while open */
  uint64_t bytes_sent;       /* serialized ForwardRequest bytes */
  uint64_t bytes_received;   /* serialized ForwardReply bytes */
  uint64_t last_req_bytes, last_reply_bytes;
  uint64_t last_rtt_us;      /* submit to reply of the latest OK reply */
  double mean_rtt_us;
  uint32_t last_queue_us, last_compute_us; /* as the server reported them */
  double mean_queue_us, mean_compute_us;
  /* ForwardReply.server_us (protocol 1.5; 0 from older servers): arrival -> reply encoded
   * on the server; last_rtt_us - last_server_us is the wire and gRPC both ways plus this
   * client's own work (bench-rpc splits it). */
  uint32_t last_server_us;
  double mean_server_us;
  /* Replicas and failover (not zeroed by reset while it is down: down_us keeps counting). */
  uint64_t failovers;        /* times it was marked down (stream broke, failover deadline) */
  uint64_t resent;           /* its requests re-planned onto other replicas and resent */
  uint64_t returns;          /* times it passed a fresh Hello and got traffic again */
  uint64_t refusals;         /* Hellos on return refused (another model or shape) */
  uint64_t down_us;          /* time spent down, the current spell included */
  uint64_t last_failover_us; /* its last OK reply -> the first rerouted reply, latest spell
                              * that rerouted requests (0 = none) */
  bool down;                 /* down now */
} gc_server_counters;
/* Copies server idx's counters into out and, with reset, zeroes them (down, and down_us of
 * a spell in progress, are kept). MR_ERANGE if idx is
 * out of range. */
int gc_server_counters_get(gc_cluster *c, uint32_t idx, bool reset, gc_server_counters *out,
                           mr_err *e);

/* ---- Stats (unary RPC, for placement) --------------------------------------------------- */

typedef struct gc_expert_count {
  uint32_t layer, expert;
  uint64_t tokens; /* tokens routed to it since the server started (or the last reset) */
} gc_expert_count;
/* A client with an open Forward stream on the server (protocol 1.4, StatsReply.clients). */
#define GC_CLIENT_NAME_MAX 128
#define GC_CLIENT_PEER_MAX 255
#define GC_STATS_MAX_CLIENTS 4096
typedef struct gc_client_info {
  char name[GC_CLIENT_NAME_MAX + 1]; /* its name ("" = none sent: a client older than 1.4) */
  char peer[GC_CLIENT_PEER_MAX + 1]; /* gRPC peer of its stream, "ipv4:127.0.0.1:53122" */
  uint32_t streams;                  /* open Forward streams of that name from that peer */
  uint64_t hello_generation;         /* owned_generation its latest Hello got, 0 = none seen */
  uint64_t hello_age_ms;             /* since that Hello */
} gc_client_info;

typedef struct gc_stats {
  uint64_t requests, errors;
  size_t n_counts;
  gc_expert_count *counts; /* owned; free with gc_stats_close */
  size_t n_clients;
  gc_client_info *clients; /* owned (NULL when none); protocol 1.4, empty from older servers */
} gc_stats;
/* Calls Stats on server idx (deadline: the per-request deadline) and fills out, which the
 * caller releases with gc_stats_close (also after a failure). reset asks the server to
 * zero its counters after answering. */
int gc_cluster_stats(gc_cluster *c, uint32_t server_idx, bool reset, gc_stats *out, mr_err *e);
void gc_stats_close(gc_stats *s);

/* ---- control calls (live placement, protocol 1.2; docs/DESIGN.md section 15) ------------
 *
 * For moerpc-place apply: a cluster handle with the file's channels, TLS and token but no
 * Hello round, no coverage check and no streams (so it opens whatever the servers own),
 * and typed calls on one server. The replies are checked as the cluster checks them
 * (gc_control_hello runs the same HelloReply checks as gc_cluster_open); errors name the
 * server and the RPC and carry the server's message: MR_ETIMEDOUT, or the status mapped to
 * MR_E* (PERMISSION_DENIED and UNAUTHENTICATED -> MR_EAUTH, RESOURCE_EXHAUSTED ->
 * MR_EEXHAUSTED), MR_EPROTO for a reply that does not decode or breaks a limit. The handle
 * answers the gc_control_* calls, gc_cluster_find_server and gc_cluster_close only. Each
 * call waits up to the cluster file's deadline_ms. One thread at a time per handle. */
int gc_control_open(gc_cluster **out, const mr_cluster_file *file, mr_err *e);
/* Stats of server idx (no reset) checked against a model of L x E (the Hello's): counts and,
 * from a 1.4 server, the clients with an open Forward stream. Release with gc_stats_close. */
int gc_control_stats(gc_cluster *c, uint32_t idx, uint32_t L, uint32_t E, gc_stats *out,
                     mr_err *e);

/* One server's Hello. owned is [num_layers * num_experts] bytes, 1 where the server owns
 * (layer, expert), allocated by gc_control_hello; release with gc_hello_info_close. */
typedef struct gc_hello_info {
  uint32_t protocol_major, protocol_minor;
  char model_fingerprint[64], weight_format[32];
  uint32_t hidden_size, intermediate_size, num_layers, num_experts, max_tokens, max_top_k;
  uint64_t owned_generation;   /* +1 each time the owned set changed (protocol 1.2; else 0) */
  uint64_t weight_bytes;       /* packed expert bytes it holds */
  uint64_t expert_bytes;       /* packed bytes of one expert */
  uint64_t load_free_bytes;    /* bytes it may still load */
  char instance_id[65];        /* the server process's id (protocol 1.3), "" from older ones */
  uint64_t n_owned;            /* pairs owned */
  uint8_t *owned;
} gc_hello_info;
int gc_control_hello(gc_cluster *c, uint32_t server, gc_hello_info *out, mr_err *e);
void gc_hello_info_close(gc_hello_info *h);

/* LoadExperts: server loads the pairs marked in pairs[num_layers * num_experts] (pairs it
 * owns already are skipped) from its model, checked against fingerprint ("" = not
 * checked). Returns at once; the load runs on the server (gc_control_load_status). */
typedef struct gc_load_started {
  uint64_t load_id;            /* names the load in gc_control_load_status */
  uint64_t pairs, tensors_total, bytes_total, packed_bytes, free_bytes;
} gc_load_started;
int gc_control_load(gc_cluster *c, uint32_t server, const uint8_t *pairs, uint32_t num_layers,
                    uint32_t num_experts, const char *fingerprint, gc_load_started *out, mr_err *e);

typedef enum gc_load_state {
  GC_LOAD_NONE = 0, GC_LOAD_RUNNING = 1, GC_LOAD_DONE = 2, GC_LOAD_FAILED = 3
} gc_load_state;
typedef struct gc_load_progress {
  uint64_t load_id;
  gc_load_state state;
  uint64_t tensors_done, tensors_total, bytes_done, bytes_total;
  double seconds;              /* since the load started (to its end once finished) */
  int error_code;              /* GC_LOAD_FAILED: the MR_E* code of the server's status */
  char error[512];             /* GC_LOAD_FAILED: the server's words, escaped */
  uint64_t owned_generation;
} gc_load_progress;
/* LoadStatus of load_id (0 = the latest) on server. */
int gc_control_load_status(gc_cluster *c, uint32_t server, uint64_t load_id, gc_load_progress *out,
                           mr_err *e);

/* UnloadExperts: server drops the pairs marked in pairs (pairs it does not own are
 * skipped). */
typedef struct gc_unload_result {
  uint64_t pairs, bytes_freed, owned_generation;
} gc_unload_result;
int gc_control_unload(gc_cluster *c, uint32_t server, const uint8_t *pairs, uint32_t num_layers,
                      uint32_t num_experts, const char *fingerprint, gc_unload_result *out,
                      mr_err *e);

/* ---- routing statistics (for placement) -------------------------------------------------
 * The client counts every routing decision: one per token per selected expert (a "slot")
 * of every layer call, whoever computes it (a server, the library's local experts, or the
 * caller: gc_options.caller_local slots are counted too), in gc_layer_submit (which the
 * runner, gc_moe and the Python adapter all go through; a gc_moe deferred part is counted
 * once, with its layer). Two spans: since open (or gc_routing_reset) and a sliding window
 * of the last gc_options.routing_window steps, where a step ends with the call for the
 * last MoE layer (the highest layer any server, local or caller expert covers). The window
 * is a ring of nb + 1 buckets of ceil(window / nb) steps, nb = min(GC_ROUTING_BUCKETS,
 * window): a count stays at least `window` steps and leaves within window + window/nb
 * (rounded up) steps; the
 * snapshot says exactly how many steps and tokens it covers. Cost per call: a read lock
 * and one relaxed atomic add per slot (a call with many slots per expert counts on the
 * stack first: one add per expert), no allocation. Memory: (BUCKETS + 2) x L x E x 8
 * bytes (2.2 MB for 61 x 256). Any thread.
 */
typedef struct gc_routing gc_routing;
#define GC_ROUTING_DEFAULT_WINDOW 1024u
#define GC_ROUTING_MAX_WINDOW (1u << 24)
#define GC_ROUTING_BUCKETS 16u
#define GC_ROUTING_MAX_PAIRS (1u << 22)
typedef enum gc_routing_span { GC_ROUTING_WINDOW = 0, GC_ROUTING_TOTAL = 1 } gc_routing_span;
typedef struct gc_routing_counts {
  uint32_t num_layers, num_experts;
  uint32_t window_steps;   /* the configured window */
  gc_routing_span span;
  uint64_t steps, tokens;  /* covered by this snapshot (tokens: of the last MoE layer's calls) */
  double seconds;          /* time the snapshot covers */
  uint64_t *counts;        /* [num_layers * num_experts] slots per (layer, expert); owned */
} gc_routing_counts;
/* The cluster's counters (created at open; never NULL for an open cluster). */
gc_routing *gc_cluster_routing(gc_cluster *c);
/* Exchanges the counters of two clusters of the same model (a placement switch hands the
 * running counts to the new cluster); nothing when their shapes differ. Not thread-safe
 * against counting on either: call between steps. */
void gc_cluster_routing_exchange(gc_cluster *a, gc_cluster *b);
/* A snapshot into out (release with gc_routing_counts_close, also after a failure). */
int gc_routing_get(gc_routing *r, gc_routing_span span, gc_routing_counts *out, mr_err *e);
void gc_routing_counts_close(gc_routing_counts *c);
/* Appends a snapshot as a "moerpc-stats" version 1 JSON document (placement/README.md;
 * window kind "steps" for the window, "since_reset" for the total; sources ["client"]). */
int gc_routing_json(gc_routing *r, gc_routing_span span, const char *fingerprint, mr_buf *out,
                    mr_err *e);
/* Writes gc_routing_json to path (path.tmp, then rename). Errors name the path. */
int gc_routing_save(gc_routing *r, gc_routing_span span, const char *fingerprint,
                    const char *path, mr_err *e);
/* Zeroes both spans. */
void gc_routing_reset(gc_routing *r);
/* The configured window in steps. */
uint32_t gc_routing_window(const gc_routing *r);
/* Standalone counters (the runner without a cluster, tests): L x E (at most
 * GC_ROUTING_MAX_PAIRS), window_steps 0 = GC_ROUTING_DEFAULT_WINDOW, last_layer ends a step.
 * Free with gc_routing_free (NULL is a no-op). */
int gc_routing_new(gc_routing **out, uint32_t num_layers, uint32_t num_experts,
                   uint32_t window_steps, uint32_t last_layer, mr_err *e);
void gc_routing_free(gc_routing *r);
/* Counts n_slots ids of one call of layer (ids -1 or out of range are skipped); when
 * may_step and layer is the last MoE layer, a step of n_tokens tokens ends. */
void gc_routing_count(gc_routing *r, uint32_t layer, const int32_t *ids, size_t n_slots,
                      uint32_t n_tokens, bool may_step);

/* Parses a HelloReply weight_format ("f32", "f16", "bf16", "int8", "int4-g32|64|128") into a
 * kernel format and its INT4 group (0 for the others). A bare "int4" is refused rather than
 * guessed, since the group changes the numbers. MR_EINVAL naming the text otherwise. */
int gc_weight_format_parse(const char *s, kn_format *fmt, uint32_t *group, mr_err *e);

/* ---- layout for foreign function interfaces ------------------------------------------ */

/* The size of a public struct ("gc_options") or the offset of one of its fields
 * ("gc_options.caller_local"), or the value of a flag ("GC_WAIT_ACCUMULATE"); -1 for a name
 * not in the table (gc_abi.c). For bindings that do not compile against this header (the
 * Python package, ctypes): they build the structs from these numbers, so that a field added
 * here needs no change there. Any thread; no allocation. */
long gc_abi_layout(const char *name);

#ifdef __cplusplus
}
#endif
#endif /* MOERPC_CLIENT_H */
