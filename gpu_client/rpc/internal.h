/*
 * gpu_client/internal.h - internals shared by the files of gpu_client/ (not public).
 *
 * Files:
 *   gc_fanout.c   pure functions: the owner map, the split of a layer call by owner, the
 *                 scatter-add of the parts, the coverage check, weight-format names.
 *                 No gRPC, no threads; unit-tested in tests/unit/test_gc_fanout.c.
 *   gc_channel.c  credentials, channels, rounds of unary calls, the Hello round and the
 *                 checks of a HelloReply.
 *   gc_pending.c  the pool of pendings (one per layer call) and the completion of a request.
 *   gc_routing.c  routing statistics (pure counters).
 *   gc_local.c    local experts: loading from the model's safetensors, computing with kn.
 *   gc_stream.c   the per-server Forward stream and the I/O thread.
 *   gc_health.c   which servers are up: marking down, the prober thread (fresh Hello,
 *                 backoff), the health counters.
 *   gc_layer.c    submit / wait / forward, failover of a call's requests.
 *   gc_cluster.c  open (cluster file, Hello round, checks, owner map), close, getters.
 *   gc_control.c  typed control calls (Hello, Stats, LoadExperts, LoadStatus, UnloadExperts).
 *   gc_moe.c      overlap and deferral across the MoE layers of a forward pass.
 *   gc_abi.c      struct layouts for foreign function interfaces.
 *
 * Floors (each file calls only files on its floor's left or below; no circle):
 *
 *   top      gc_moe -> gc_layer, gc_cluster, gc_control, gc_abi
 *   middle   gc_stream -> gc_health;   gc_local
 *   bottom   gc_channel, gc_pending, gc_fanout, gc_routing
 *
 * Threads and locks (STYLE.md 8):
 *
 *   caller threads   gc_layer_submit / gc_layer_wait: plan the split, gather rows, queue
 *                    requests on streams (under the stream lock, which also starts the
 *                    SEND batch if none is in flight), compute local experts (under
 *                    local_lock), wait on the pending's condvar, give up timed-out requests
 *                    (unlink them from their stream), sum the parts.
 *   I/O thread       the only reader of the completion queue `cq`: SEND done -> start the
 *                    next queued send; RECV done -> match the reply to its request by id,
 *                    gather its payload, complete it, re-arm RECV if anything is still
 *                    outstanding (else the next enqueue arms it); STATUS done -> the
 *                    stream broke: fail everything outstanding on it at once.
 *   prober thread    (gc_health.c) Hellos down servers on their control channels, with
 *                    backoff; marks one up again when its Hello matches the cluster's.
 *   gRPC threads     may run gc__payload_release (a request's payload slice dropped), which
 *                    only drops a pending reference.
 *
 *   stream->lock     the call state, the send queue and the outstanding list of one stream,
 *                    its counters. Never held while taking another stream's lock.
 *   pending->lock    n_done, the failed and closed flags, the result fields of its requests.
 *   pool->lock       the free list of pendings (c->pool, see below).
 *   c->local_lock    the local kernel engine (one forward at a time).
 *   c->calls_lock    the count of live gc__call objects (close waits on it).
 *   c->health_lock   every stream's health fields and up flag; a leaf: never held while taking
 *                    another lock, never taken under a stream or pending lock.
 *   Order: stream->lock before pool->lock (destroying a byte buffer under the stream lock
 *   may drop the last pending reference) and before calls_lock (a stream opens a call under
 *   its lock); pending->lock is never held while taking a stream
 *   lock or the other way round (each side copies what it needs and lets go first).
 *
 * Lifetime of a gc_pending (refcounted, atomic): one reference for the caller (dropped at
 * the end of gc_layer_wait), one per request linked on a stream's outstanding list (dropped
 * by whoever unlinks it: the reply, the stream failure, or the waiter giving up), one per
 * payload slice gRPC holds (dropped in gc__payload_release). At zero it returns to the pool
 * and its arena is reset. gRPC may drop a payload slice after the cluster is closed (its
 * channels are torn down asynchronously), so the pool is a separate object that outlives
 * the cluster until the last pending has come back: a late release then frees the pending
 * (and the pool, if it was the last) without touching the freed cluster.
 */
#ifndef GC_INTERNAL_H
#define GC_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>

#include <grpc/grpc.h>

#include "proto/pr.h"
#include "gpu_client/rpc/moerpc_client.h"

/* ---- gc_fanout.c: pure parts ------------------------------------------------------------ */

/* Owner map: owner[layer * E + expert] is a server index, GC_OWNER_LOCAL or GC_OWNER_NONE. */

/* One server's or the local share of a layer call. */
typedef struct gc__part {
  int32_t target;    /* server index, or GC_OWNER_LOCAL */
  uint32_t n_tokens; /* rows of this part */
  uint32_t *rows;    /* [n_tokens] token index in the caller's request, increasing */
  int32_t *ids;      /* [n_tokens * k]: the slots this target owns, others -1 */
  float *weights;    /* [n_tokens * k]: their weights, 0 for slots set to -1 */
} gc__part;

typedef struct gc__plan {
  uint32_t n_tokens, top_k;
  uint32_t n_parts;  /* parts with at least one token: servers in index order, local last */
  gc__part *parts;
  uint8_t *missing;  /* [E] experts with no live replica (MR_EUNAVAIL), else NULL */
} gc__plan;

/* The replica sets of one layer and what the plan needs to choose among them. */
typedef struct gc__replicas {
  const uint32_t *off;  /* [E + 1]: expert x's replicas are srv[off[x] .. off[x + 1]) */
  const uint16_t *srv;  /* server indices, increasing within one expert */
  const int32_t *pref;  /* [E] a placement's server for x (used while live), -1; or NULL */
  const uint8_t *live;  /* [n_servers] 1 = may get traffic */
  const uint64_t *load; /* [n_servers] outstanding slots on its stream now, or NULL */
  uint32_t rot;         /* tie-break: the first index tried among equal loads */
} gc__replicas;

/*
 * Splits one layer call by owner. owner_row is owner[layer * E ..] (E entries); ids and
 * weights are the caller's [T * k]. rp NULL: a slot goes to owner_row's server; otherwise
 * a slot whose owner_row entry is a server goes to one live replica of rp (gc_fanout.c).
 * All arrays of the plan come from arena a.
 * Errors: MR_ERANGE for an id that is neither -1 nor < E ("ids[13] (token 3, slot 1) =
 * 200, must be -1 or < num_experts 128"), MR_EPRECOND for an id nobody owns ("layer L
 * expert X (ids[13]) is owned by no server and not local"), MR_EUNAVAIL when some slot's
 * replicas are all down ("layer 3: experts 4-7 have no live replica", p->missing lists
 * them), MR_ENOMEM.
 */
int gc__plan_build(gc__plan *p, const int32_t *owner_row, const gc__replicas *rp, uint32_t E,
                   uint32_t n_servers, uint32_t layer, uint32_t T, uint32_t k,
                   const int32_t *ids, const float *weights, mr_arena *a, mr_err *e);

/*
 * The replica sets of every pair in CSR form: for pair i = layer * E + expert whose owner[i]
 * is a server, every server s whose announce[s] has the bit, in index order, at
 * srv[off[i] .. off[i + 1]); none for local, caller-computed and unowned pairs. off has
 * L * E + 1 entries; srv may be NULL to count. Returns the number of entries;
 * assigned[s] (may be NULL) gets the pairs s is a replica of.
 */
size_t gc__replicas_build(uint32_t *off, uint16_t *srv, const int32_t *owner, uint32_t L,
                          uint32_t E, uint32_t n_servers, const uint64_t *const *announce,
                          uint64_t *assigned);

/* Copies rows[0..n) of src ([*, row_bytes]) into dst ([n, row_bytes]) in order. */
void gc__gather_rows(void *dst, const void *src, const uint32_t *rows, uint32_t n,
                     size_t row_bytes);
/* The client's check of one OK reply's output y ([n, H] of wire dtype dt, as gathered from
 * the reply): 0 if every element is finite, else MR_EPROTO for the first NaN / Inf in
 * memory order, e.g. "reply output[row 1 (token 5 of the call), index 0] = NaN (bf16 bits
 * 0x7fc0): an OK reply must hold finite values only" (rows[row] = the call's token; rows
 * may be NULL). The caller prefixes layer, request and server. Pure; run by the I/O thread
 * on every reply right after the gather (mr_nonfinite_find); fuzzed in
 * fuzz_hidden_finite.c. */
int gc__reply_check_finite(const void *y, mr_dtype dt, const uint32_t *rows, uint32_t n,
                           uint32_t H, mr_err *e);
/* out[rows[i], :] += src[i, :] (src of dtype dt, [n, H]) converted to fp32. */
void gc__scatter_add(float *out, uint32_t H, const uint32_t *rows, uint32_t n, const void *src,
                     mr_dtype dt);

/*
 * Builds the owner map (L * E entries) from announced ownership: local[] (L * E entries, or
 * NULL; GC__LOCAL_LIB = the library computes it, GC__LOCAL_CALLER = the caller does) wins,
 * then route[] (L * E server indices, -1 = none, or NULL; the caller has checked that the
 * server announces the pair), then the first server in index order whose announce[s] bit
 * is set. announce[s] is a bitset over layer * E + expert. assigned[s] (n_servers
 * entries, may be NULL) gets the pairs routed to each server.
 */
#define GC__LOCAL_LIB 1
#define GC__LOCAL_CALLER 2
void gc__owner_build(int32_t *owner, uint32_t L, uint32_t E, uint32_t n_servers,
                     const uint64_t *const *announce, const uint8_t *local, const int32_t *route,
                     uint64_t *assigned);

/*
 * Checks that every layer l with must[l] != 0, or with at least one owned expert, has all
 * of its E experts owned. Returns the number of incomplete layers (0 = covered) and writes
 * into msg a description of the first few: "layer 3: experts 4-7 are owned by no server and
 * not local; layer 5: ...". must may be NULL.
 */
uint32_t gc__coverage_check(const int32_t *owner, uint32_t L, uint32_t E, const uint8_t *must,
                            char *msg, size_t len);

/*
 * The deferral split of one layer call (gc_moe.c, kt-kernel's select_deferred_experts): a
 * token's non-empty slots are ranked by weight (ties keep the earlier slot); a slot ranked
 * at or below k - K (0-based rank >= k - K) whose owner_row entry is a server (>= 0) goes
 * to def[], every other slot stays in now[] (so library-local and caller-local ones are
 * never deferred; ids out of range stay in now[] for submit to report). Both are [T * k]
 * with -1 where a slot went to the other. Returns the number of deferred slots.
 */
uint32_t gc__defer_split(const int32_t *owner_row, uint32_t E, uint32_t T, uint32_t k,
                         uint32_t K, const int32_t *ids, const float *weights, int32_t *now,
                         int32_t *def);

/* ---- the cluster ------------------------------------------------------------------------- */

typedef struct gc__req gc__req;
typedef struct gc__call gc__call;
typedef struct gc__stream gc__stream;

/* Completion-queue tags: each live gc__call has one per kind of batch. */
enum gc__op { GC__OP_START, GC__OP_SEND, GC__OP_RECV, GC__OP_SENDRECV, GC__OP_STATUS,
              GC__OP_CLOSE };
typedef struct gc__tag {
  gc__call *call;
  enum gc__op op;
} gc__tag;

/* One gRPC Forward call (a stream's incarnation). A broken stream's call lives on until all
 * its batches have completed, while a new one may already serve the stream. */
struct gc__call {
  gc__stream *s;
  grpc_call *call;
  int ops_pending;   /* batches started and not completed (under s->lock) */
  bool finished;     /* status received */
  bool recv_armed;   /* a RECV_MESSAGE is in flight (t_recv or t_sendrecv); cleared when
                      * it completes, before its reply is handed on (under s->lock) */
  gc__tag t_start, t_send, t_recv, t_sendrecv, t_status, t_close;
  grpc_metadata_array md_initial, md_trailing;
  grpc_byte_buffer *recv_bb;     /* RECV_MESSAGE target (I/O thread) */
  grpc_byte_buffer *send_bb;     /* the SEND_MESSAGE in flight, destroyed when it completes */
  gc__req *paired;               /* the request whose SEND is paired with its reply's RECV
                                  * (t_sendrecv) while that batch is in flight and the
                                  * request outstanding; compared, never dereferenced
                                  * (under s->lock) */
  grpc_status_code status;
  grpc_slice details;
  const char *error_string;
};

/* A request in flight: one ForwardRequest of one part (a part over a server's max_tokens is
 * split into several). Lives in its pending's arena. */
enum gc__req_state { GC__REQ_QUEUED, GC__REQ_SENT, GC__REQ_DONE };
struct gc__req {
  gc_pending *p;
  gc__stream *s;
  uint32_t n_tokens;
  uint32_t n_slots;         /* non-empty slots: its weight in the replica choice */
  const uint32_t *rows;     /* [n_tokens] token rows of the call, increasing */
  const int32_t *ids;       /* [n_tokens * k] its slots, others -1 */
  const float *weights;     /* [n_tokens * k] */
  const uint8_t *x;         /* [n_tokens, H] of the wire dtype: the payload */
  uint64_t id;
  enum gc__req_state state; /* under s->lock until unlinked */
  bool linked;              /* on s's outstanding list (under s->lock) */
  grpc_byte_buffer *bb;     /* encoded, while on the send queue */
  size_t bb_bytes;
  uint64_t t_submit_ns;
  void *out;                /* [n_tokens, H] of the wire dtype (arena) */
  bool done;                /* result fields valid (under p->lock) */
  int rc;
  bool retry;               /* failed because its stream broke, or with a non-finite
                             * reply: re-plan it (under p->lock) */
  bool avoid_server;        /* failed so that its server gets nothing more of this call: a
                             * non-finite value in an OK reply, or a drain refusal (p->lock) */
  bool miss;                /* the server answered FAILED_PRECONDITION: it does not serve a
                             * slot's expert (moved away): re-Hello, re-plan (p->lock) */
  uint64_t rt_gen;          /* the routing generation (gc__routes.gen) it was planned with */
  bool replaced;            /* re-planned onto other replicas: result unused (waiter) */
  bool no_failover;         /* a stall with nowhere to go: wait for it (waiter) */
  int32_t fo_from;          /* resent from this server index after a failover, else -1 */
  uint64_t t_done_ns;       /* when it completed (under p->lock) */
  mr_err err;
  bool followed;            /* another request for the same stream is queued right after
                             * it (the next chunk, or the caller's GC_REQ_FOLLOWED): its send
                             * must not wait for its reply (gc_stream.c, "paired") */
  gc__req *q_next;          /* send queue (FIFO) */
  gc__req *o_prev, *o_next; /* outstanding list */
};

typedef struct gc__server {
  mr_cluster_server cfg;    /* name and address */
  char target[300];         /* gRPC target */
  grpc_channel *ctl;        /* Hello / Stats */
  /* Hello */
  uint32_t proto_major, proto_minor, max_tokens;
  uint32_t max_top_k;       /* HelloReply.max_top_k, num_experts for a 1.0 server */
  char fingerprint[64], weight_format[32];
  uint32_t hidden, inter, layers, experts;
  uint64_t owned_generation, weight_bytes, expert_bytes, load_free_bytes; /* 1.2; else 0 */
  char instance_id[65];     /* 1.3: the server process's id, "" from older servers */
  uint64_t *announce;       /* bitset over layer * E + expert */
  uint64_t announced, assigned;
  /* Set at open, read-only afterwards: the index of an earlier entry whose Hello had the
   * same instance_id (one process under two addresses), else -1. An alias announces
   * nothing to the owner map or the replica sets, gets no stream and no traffic. */
  int32_t alias_of;
} gc__server;

struct gc__stream {
  gc_cluster *c;
  uint32_t idx;
  const gc__server *srv;
  grpc_channel *ch;         /* data channel, sized from max_tokens */
  void *forward_method;     /* grpc_channel_register_call handle */
  bool inited;              /* lock initialised, channel created */
  pthread_mutex_t lock;
  gc__call *cur;            /* the live call, or NULL (never opened / broke) */
  bool send_busy;           /* a SEND_MESSAGE (or the half-close) is in flight on cur */
  bool failfast;            /* the last call broke: open the next without WAIT_FOR_READY */
  bool closing;             /* close asked for a half-close */
  bool half_closed;
  int break_rc;             /* set when we cancel the call ourselves (malformed reply) */
  char break_msg[256];
  gc__req *q_head, *q_tail; /* send queue */
  gc__req *o_head;          /* outstanding: queued or sent, not answered */
  gc_server_counters ctr;    /* the health fields (failovers ... down) live in health below */
  double sum_rtt_us, sum_queue_us, sum_compute_us, sum_server_us;
  atomic_uint_fast64_t t_last_ok_ns; /* latest OK reply, 0 = none */
  /* Read without a lock by the plan (gc_layer.c): */
  atomic_uint_fast64_t out_slots;    /* slots of its outstanding requests */
  atomic_uint_fast64_t t_reply_ns;   /* latest reply of any kind, 0 = none yet */
  atomic_bool up;                    /* may get traffic (written under c->health_lock) */
  /* Health (gc_health.c), under c->health_lock: */
  struct {
    uint64_t t_down_ns;     /* when it went down */
    uint64_t t_up_ns;       /* when it last came back */
    uint64_t next_probe_ns; /* when the prober Hellos it next */
    uint32_t backoff_ms;    /* wait after the next failed probe */
    bool refusal_logged;    /* one log line per down spell */
    bool fo_measured;       /* this spell's failover time is recorded */
    uint64_t t_last_ok_ns;  /* its last OK reply before it went down */
    char why[320];          /* why it is down */
    uint64_t failovers, resent, returns, refusals, down_ns, last_failover_us;
  } health;
};

/* The pool of pendings (gc_layer.c). */
typedef struct gc__pool {
  pthread_mutex_t lock;
  gc_pending *free_list;
  uint32_t live;            /* pendings handed out and not yet back */
  bool closed;              /* the cluster is gone: returning pendings are freed */
} gc__pool;

struct gc_pending {
  gc_cluster *c;            /* not used once refs may outlive the cluster (unref) */
  gc__pool *pool;
  atomic_int refs;
  pthread_mutex_t lock;
  pthread_cond_t cond;
  uint32_t n_reqs, n_done;  /* every request, replaced ones included */
  uint32_t cap_reqs;        /* room in reqs */
  uint32_t top_k;
  bool failed;              /* a request failed (wake the waiter early) */
  atomic_bool settled;      /* every request done, or one failed: a hint for the waiter's
                             * spin (gc_options.wait_spin_us), set with the broadcast; the
                             * waiter decides under lock */
  bool closed;              /* the waiter gave up or finished; late results are ignored */
  uint64_t t_submit_ns, deadline_ns;
  uint64_t t_sent_ns;       /* submit handed the last request to the transport */
  uint64_t t_last_reply_ns; /* latest OK reply of its requests (under lock), 0 = none */
  uint64_t local_ns;        /* library-local experts computed in submit */
  uint32_t layer, H;
  mr_dtype dtype;
  gc__plan plan;
  void **part_out;          /* [n_parts]: server parts in wire dtype, the local part f32 */
  gc__req **reqs;           /* [n_reqs]: the first ones in server order, resent ones after */
  uint8_t *excluded;        /* [n_servers] 1 = replied non-finite in this call: no more of
                             * its requests (waiter; arena, NULL until the first) */
  uint32_t misses;          /* re-plans after "not served" replies in this call (waiter),
                             * at most GC__MISS_MAX */
  int local_rc;
  mr_err local_err;
  mr_arena arena;
  gc_pending *next_free;
};

/*
 * The replica sets a plan chooses from, as one immutable object (RCU-like, like the
 * server's owned table): gc_cluster_open builds generation 1 from the Hellos of open;
 * gc__routes_refresh (a re-Hello of the cluster after a server answered "not served")
 * builds the next one from the fresh owned sets and swaps the pointer. Readers load
 * c->routes once per plan and never see a table freed: the retired ones stay on the
 * `older` list until gc_cluster_close (one per change of the servers' owned sets).
 */
typedef struct gc__routes {
  uint64_t gen;             /* 1 at open, +1 per refresh that changed a replica set */
  uint32_t *rep_off;        /* [L * E + 1] replica sets (gc__replicas_build) */
  uint16_t *rep;
  int32_t *pref;            /* [L * E] placement's server while it serves the pair, or NULL */
  uint64_t **ann;           /* [n_servers] the owned sets (bitsets) this table was built from;
                             * NULL for an alias */
  struct gc__routes *older; /* retired tables (freed at close) */
} gc__routes;

/* Re-plans of one call after "not served" replies before it fails (no livelock when a
 * server's Hello and its Forward disagree, or owned sets keep moving). */
#define GC__MISS_MAX 3

struct gc_cluster {
  mr_cluster_file file;
  gc_options opts;
  char client_name[128];
  char model_dir[1024];
  uint32_t deadline_ms;
  /* the model, from Hello (identical on every server) */
  uint32_t H, I, L, E;
  char fingerprint[64], weight_format[32];
  kn_format fmt;
  uint32_t group;
  uint32_t max_tokens_min;
  uint32_t max_top_k_min;   /* smallest max_top_k of all servers */
  uint32_t n_servers;
  gc__server *servers;      /* [n_servers] */
  gc__stream *streams;      /* [n_servers] */
  int32_t *owner;           /* [L * E]: the primary (routed or first announcing) server at
                             * open; fixed: local, caller-computed and server-owned pairs stay
                             * so (the server is chosen from c->routes) */
  uint8_t *local;           /* [L * E] GC__LOCAL_LIB / GC__LOCAL_CALLER, else 0 (open) */
  _Atomic(gc__routes *) routes; /* the current replica sets */
  pthread_mutex_t refresh_lock; /* one re-Hello at a time; publishers of c->routes */
  uint64_t t_refresh_ns;    /* the last re-Hello (refresh_lock) */
  const int32_t *route;     /* route_own, or NULL without gc_options.route */
  int32_t *route_own;       /* a copy of gc_options.route, aliases mapped to their original */
  atomic_uint rot;          /* replica tie-break rotation, one step per plan */
  uint32_t failover_ms;     /* a request unanswered this long moves to another replica */
  /* health (gc_health.c) */
  pthread_mutex_t health_lock; /* the health fields of every stream and its up flag */
  pthread_cond_t health_cond;
  pthread_t health_thread;
  bool health_started, health_stop;
  /* local experts (gc_local.c) */
  kn_engine *local_eng;     /* own, or opts.shared_engine */
  bool own_local_eng;
  kn_layer **local_layers;  /* [L], NULL where no local expert */
  uint64_t local_pairs;
  uint64_t local_mapped;    /* of them, served in place from local_st (local_map_weights) */
  mr_st *local_st;          /* the model's mapping, kept while experts read it in place */
  uint64_t caller_pairs;    /* pairs of opts.caller_local */
  pthread_mutex_t local_lock;
  /* I/O */
  bool grpc_inited;
  grpc_completion_queue *cq;
  pthread_t io_thread;
  bool io_started;
  pr_split io_split;        /* I/O thread scratch */
  pthread_mutex_t calls_lock;
  pthread_cond_t calls_cond;
  int live_calls;
  atomic_uint_fast64_t next_id;
  gc__pool *pool;           /* owned; may outlive the cluster (see above) */
  bool locks_inited;
  /* Security (cluster file "tls" and "token_file"), set at open, read-only afterwards. */
  grpc_channel_credentials *creds; /* for every channel: insecure or TLS */
  bool tls;
  grpc_metadata auth_md;    /* "authorization: Bearer <token>" */
  size_t n_auth_md;         /* 1 with a token, else 0: sent on every call */
  /* A Forward stream's initial metadata: the token (if any), then PR_MD_CLIENT_NAME =
   * client_name as printable ASCII (protocol 1.4; the server reports it in its Stats). Set
   * by gc__streams_start; the name's value slice is released by gc_cluster_close. */
  grpc_metadata fwd_md[2];
  size_t n_fwd_md;
  /* Routing counters (gc_routing.c), created at open, counted in gc_layer_submit. */
  gc_routing *routing;
};

/* gc_local.c */
/* Loads the local experts of the cluster file's "local" section from c->model_dir into
 * c->local_layers (format c->fmt / c->group, or the options' override), marking local[]
 * (L * E flags). Errors name the model file and tensor. */
int gc__local_load(gc_cluster *c, uint8_t *local, mr_err *e);
/* Computes the local part (plan part `part` of p) into p->part_out[part] (fp32). Takes
 * c->local_lock. */
int gc__local_forward(gc_cluster *c, gc_pending *p, uint32_t part, const void *x_rows,
                      mr_err *e);
void gc__local_free(gc_cluster *c);

/* gc_stream.c */
int gc__streams_start(gc_cluster *c, mr_err *e);
/* Half-closes every stream, waits for their calls to end (bounded), stops the I/O thread. */
void gc__streams_stop(gc_cluster *c);
/* Queues r on its stream (opening the stream if it is not open) and starts the send if
 * none is in flight. On failure r is completed with the error (counted in its pending). */
void gc__stream_enqueue(gc__stream *s, gc__req *r);
/* Unlinks r if it is still outstanding (queued or sent); returns true if this call did
 * (and so owns r's pending reference). *state gets r's state at that moment; timed_out
 * counts it as a timeout of the server. */
bool gc__stream_forget(gc__stream *s, gc__req *r, bool timed_out, enum gc__req_state *state);

/* gc_health.c: which servers are up; the prober thread. */
int gc__health_start(gc_cluster *c, mr_err *e);
void gc__health_stop(gc_cluster *c);
/* Marks server idx down (no traffic until a fresh Hello matches the cluster's model) for
 * the reason why, logs it, counts a failover and wakes the prober: at once when
 * probe_now (its stream broke: a live server answers a Hello in milliseconds), else after
 * the backoff. No-op if already down. Any thread; takes c->health_lock (never held with a
 * stream lock). */
void gc__server_down(gc_cluster *c, uint32_t idx, bool probe_now, const char *why);
/* Counts n requests of server idx re-planned onto other replicas. */
void gc__server_resent(gc_cluster *c, uint32_t idx, uint32_t n);
/* Records the failover time of server idx's current down spell (first one only):
 * t_first_ns (the first rerouted reply) minus its last OK reply. */
void gc__server_failover_time(gc_cluster *c, uint32_t idx, uint64_t t_first_ns);
/* Appends to msg (len) "; down: server s1 (addr): why, ..." for the servers that replicate
 * the experts marked in missing[E] of layer. */
void gc__down_explain(gc_cluster *c, uint32_t layer, const uint8_t *missing, char *msg,
                      size_t len);
/* Adds the health counters of server idx to out (under health_lock). */
void gc__health_counters(gc_cluster *c, uint32_t idx, bool reset, gc_server_counters *out);

/* gc_pending.c: the pool of pendings and the completion of a request. */
/* Creates c->pool. */
int gc__pool_new(gc_cluster *c, mr_err *e);
/* Frees the idle pendings and hands the pool over to the pendings still out (if any). */
void gc__pool_close(gc_cluster *c);
/* A pending from c's pool with one reference (the caller's), its arena reset; NULL and
 * MR_ENOMEM in e when none can be made. */
gc_pending *gc__pending_get(gc_cluster *c, mr_err *e);
void gc__pending_unref(gc_pending *p);
/* How a request failed, for gc__req_complete (flags). */
#define GC__DONE_RETRY 1u      /* its stream broke or its server is down: re-plan it */
#define GC__DONE_BAD_REPLY 2u  /* an OK reply with a NaN / Inf: re-plan it without that
                                * server for the rest of the call; it stays up */
#define GC__DONE_MISS 4u       /* FAILED_PRECONDITION: its server no longer serves a slot's
                                * expert; re-Hello the cluster and re-plan it */
#define GC__DONE_REFUSED 8u    /* UNAVAILABLE for this request alone (its server drains and
                                * takes no new work): re-plan it without that server for the
                                * rest of the call, as BAD_REPLY */
/* Completes r with rc and err (copied; may be NULL when rc is 0): counts it in its pending
 * and wakes the waiter when all are done or rc != 0. how (GC__DONE_*, 0 = a plain failure)
 * marks a failure the waiter may re-plan onto other replicas. Ignored once the waiter has
 * given up (the waiter then owns r's result fields). Any thread; takes r->p->lock. */
void gc__req_complete(gc__req *r, int rc, const mr_err *err, unsigned how);
/* Releases a payload slice's reference (gRPC threads). */
void gc__payload_release(void *pending);

/* gc_channel.c: credentials, channels, unary rounds, the Hello round. */
/* "server s0 (127.0.0.1:50051)" */
#define GC__SRV_FMT "server %s (%s)"
#define GC__SRV_ARGS(sv) (sv)->cfg.name, (sv)->cfg.address
/* Message limit of the control channels: a HelloReply of a large model lists every owned
 * expert (61 layers x 256 experts is ~40 KB), Stats counts up to L x E entries. */
#define GC__CTL_MAX_BYTES (64 << 20)
/* The credentials every channel of c uses and the token metadata every call sends, from
 * the cluster file's "tls" and "token_file" (after grpc_init). Errors name the field. */
int gc__security_init(gc_cluster *c, mr_err *e);
/* grpc_init, the credentials, and one control channel per server (c->servers[i].ctl). */
int gc__ctl_channels_open(gc_cluster *c, mr_err *e);
/* A channel to srv->target with message limits of max_bytes. */
grpc_channel *gc__channel_new(const gc_cluster *c, const gc__server *srv, int max_bytes);
/* One unary call of a round. */
typedef struct gc__unary {
  grpc_call *call;
  grpc_byte_buffer *req, *resp;
  grpc_metadata_array md_initial, md_trailing;
  grpc_status_code status;
  grpc_slice details;
  const char *error_string;
  bool done;
} gc__unary;
/* Calls method on every channel chs[0..n) with request req (copied), all with one deadline
 * of timeout_ms, on a completion queue of the calling thread; u[i] gets call i's outcome
 * (release each with gc__unary_free). Blocks until every call has ended. */
void gc__unary_round(const gc_cluster *c, grpc_channel *const *chs, size_t n, const char *method,
                     const grpc_byte_buffer *req, uint32_t timeout_ms, gc__unary *u);
void gc__unary_free(gc__unary *u);
/* 0 for an OK call with a reply, else an error naming sv and rpc (MR_ETIMEDOUT with a hint
 * from the channel's state, or the status mapped by pr_mr_from_status). */
int gc__unary_result(const gc_cluster *c, const gc__unary *u, const gc__server *sv,
                     const char *rpc, uint32_t timeout_ms, mr_err *e);
/* The client's checks of one decoded HelloReply from sv (input from the network): protocol
 * major, fingerprint and weight_format lengths, every dimension in 1..its limit, at most
 * 2^22 (layer, expert) pairs, every owned pair inside the model, an instance_id of at most 64
 * printable ASCII bytes ("" from a server older than 1.3). Fills sv's Hello fields and
 * allocates sv->announce (owned by sv, freed by gc_cluster_close; also after a failure,
 * which may leave it allocated). MR_EMISMATCH (protocol), MR_EPROTO naming the field and
 * the limit, MR_ENOMEM. Pure apart from that allocation; fuzzed (fuzz_hello_reply.c). */
int gc__hello_check(gc__server *sv, const Moerpc__V1__HelloReply *h, mr_err *e);
/* One Hello round: Hellos servers idx[0..n) (idx NULL: servers 0..n-1) concurrently
 * (deadline timeout_ms) and checks each reply into out[i] (gc__hello_check; out[i].cfg is
 * set here, out[i].announce is owned by the caller); rcs[i] / errs[i] get each result. */
void gc__hello_round(gc_cluster *c, const uint32_t *idx, uint32_t n, uint32_t timeout_ms,
                     gc__server *out, int *rcs, mr_err *errs);
/* Moves the Hello fields (and the announce bitset) of a round's result src into dst. */
void gc__hello_take(gc__server *dst, gc__server *src);

/* gc_cluster.c */
/* The part of open that needs no server: the cluster file, the options, the servers'
 * targets, the locks. */
int gc__cluster_init(gc_cluster *c, const mr_cluster_file *file, const gc_options *opts,
                     mr_err *e);

/*
 * The re-Hello of the cluster after a "not served" reply (docs/DESIGN.md 3.7, "Moved
 * experts"): Hellos every server that is up and no alias, and rebuilds the replica sets
 * from the owned sets their replies announce (a server that does not answer, or answers
 * for another model, keeps its previous set). A routed pair prefers its placement's server
 * only while that server still announces it. Publishes a new c->routes when a set changed
 * (one INFO line naming the trigger and the pairs that moved), else leaves it. seen_gen is
 * the generation the failed request was planned with: when c->routes is newer already
 * (another thread refreshed meanwhile), no Hello is sent; nor when the last re-Hello was
 * less than min_gap_ms ago (0: always Hello). Returns 0, or MR_ENOMEM. Caller threads
 * (submit, the waiter); takes refresh_lock.
 */
int gc__routes_refresh(gc_cluster *c, uint64_t seen_gen, uint32_t min_gap_ms,
                       const char *trigger, mr_err *e);
/* The current replica sets (acquire); valid until gc_cluster_close. Any thread. */
static inline const gc__routes *gc__routes_get(const gc_cluster *c) {
  return atomic_load_explicit(&((gc_cluster *)c)->routes, memory_order_acquire);
}

/* gc_control.c */
/* Copies a decoded StatsReply from sv into out after checking each count's (layer, expert)
 * against the model's L x E: MR_EPROTO naming the entry, MR_ENOMEM. out->counts is
 * allocated even on failure (the caller releases out with gc_stats_close). Fuzzed
 * (fuzz_stats_reply.c). */
int gc__stats_reply_check(const gc__server *sv, const Moerpc__V1__StatsReply *r, uint32_t L,
                          uint32_t E, gc_stats *out, mr_err *e);

#endif /* GC_INTERNAL_H */
