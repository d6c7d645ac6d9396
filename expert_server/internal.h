/*
 * internal.h - what the files of expert_server/ share. Not a public header.
 *
 * Files, by floor. A file calls only files listed after it (below it, or to its right on its
 * floor), so no files call each other in a circle; where work must go back up, it goes
 * through a callback or a field set at start-up (es_job_ops, the admin doorbell srv->wake),
 * named under "Threads".
 *
 *   top      es_server.c    es_server_new/free: options, start-up order, teardown order
 *            es_admin.c     es_server_run: the libuv loop (signals, timers, housekeeping),
 *                           the loader thread, the drain sequence
 *            es_grpc.c      gRPC set-up and teardown, the completion-queue threads that
 *                           dispatch every event, the unary Hello / Stats / Health
 *   middle   es_stream.c    Forward streams: decode, validate, hand to compute; send queues;
 *                           admission (the byte budget); dead streams; the stall cut
 *            es_inline.c    the inline run: a small request computed on its CQ thread
 *            es_control.c   live placement: LoadExperts / LoadStatus / UnloadExperts and the
 *                           es-ctl-load thread
 *            es_compute.c   jobs and the engine: the fair queue, merging, kn_moe_forward,
 *                           deadlines, the replies' encoding, the compute thread
 *            es_table.c     the owned table (RCU-like), its memory rule, retiring old tables
 *   bottom   es_rpc.c       answering a unary call: the reply batch, status, peer, method names
 *            es_load.c      config + safetensors -> one kn_layer per owned layer, progress,
 *                           MemAvailable
 *            es_auth.c      TLS credentials, certificate checks, the bearer-token check of every
 *                           call, the SIGHUP reload, the loopback rule
 *            es_metrics.c   the --metrics-listen endpoint: what /metrics shows (Prometheus text)
 *            es_pool.c      reusable request/reply buffers and job records
 *            es_validate.c  es_forward_validate, es_hidden_check_finite, es_output_check_finite
 *                           (pure)
 *
 * Threads and where they meet (STYLE.md 8):
 *
 *   es-grpc-<i> (es_cq_thread)  owns every call accepted on cq_threads[i].cq: all of a
 *                        call's events come to it, so a unary call needs no lock. It decodes
 *                        and validates each ForwardRequest, gathers its payload once into an
 *                        es_buf and offers the es_job to the compute side (es__inline_offer:
 *                        the compute queue, q_lock + q_cond, or its own inline slot, below).
 *                        It starts the next send of a stream when one completes, and frees
 *                        every call of its queue.
 *   es-compute           takes jobs (q_lock), runs kn_moe_forward, writes each reply into
 *                        the job's buffer and gives the job back through job->ops->done: the
 *                        stream queues the reply (under its lock) and starts the send batch
 *                        itself when none is in flight.
 *   es-loader            es_server_run's first part: packs the owned experts
 *                        (es__load_weights) while the gRPC threads already answer health (and
 *                        UNAVAILABLE "loading" to everything else); publishes progress in
 *                        atomics, ends by ringing the admin doorbell. The admin thread joins
 *                        it, then creates the first table, starts es-compute and sets
 *                        srv->loaded (release): every thread reads the weights, the engine
 *                        and max_inflight_bytes only after seeing loaded.
 *   es-ctl-load          es_control.c, started by the first LoadExperts: takes the queued
 *                        LoadExperts calls (ctl_lock + ctl_cond) one at a time, reads the
 *                        model's headers, answers the call, packs the experts into staging
 *                        layers nobody else sees and publishes a new es_table (ctl_lock).
 *                        Requests hold a reference to the table they were validated against
 *                        (es_job.tab) until their reply is sent; the admin thread frees
 *                        retired tables once unreferenced.
 *   mr-metrics           the mr_http_server responder (common/http.c): es__metrics_render
 *                        reads atomics, and q_len / n_streams under q_lock / streams_lock,
 *                        one at a time, holding no other lock.
 *   admin (libuv)        the thread in es_server_run. Other threads reach it only through
 *                        its doorbell (es__admin_wake: uv_async_send on srv->wake, armed at
 *                        start-up) and the atomics below; during the drain it walks the stream
 *                        list (streams_lock) to finish streams.
 *   kn-w*                the engine's workers (kernels/), driven by whoever holds the engine.
 *
 * Inline run (es_inline.c has the rule): a CQ thread may hold one small request back in its
 * slot (es_cq_thread.inline_job) and, when its round of events is over and the engine is
 * idle, compute it itself. The engine and the compute arena belong to whoever set
 * srv->computing (under q_lock): es-compute or that CQ thread.
 *
 * Lock order (never take an earlier lock while holding a later one; each lock's own
 * comment says what it guards):
 *   srv->streams_lock  ->  es_stream.lock  ->  srv->q_lock  ->  es_pool.lock
 *   srv->ctl_lock  ->  srv->tab_lock
 * The two chains never nest: no table lock is taken under a stream or queue lock, and the
 * control code answers its calls after letting ctl_lock go. es_pool.lock and tab_lock are
 * leaves: gRPC may call the slice release callback (es__buf_release) from inside
 * grpc_byte_buffer_destroy while a stream lock is held; tab_lock is held for a pointer read
 * and an increment, or the swap. auth_lock and tls_lock (es_auth.c) are leaves too: a token
 * compare, a pointer swap.
 */
#ifndef ES_INTERNAL_H
#define ES_INTERNAL_H

#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <pthread.h>
#include <stdatomic.h>
#include <uv.h>

#include "proto/pr.h"
#include "expert_server/es.h"

/* ---- buffer and job pool (es_pool.c) --------------------------------------------------- */

/* One reusable buffer: holds a request's hidden rows as received, then the reply's output
 * rows (same size: n_tokens * H * dtype size). Released to its pool by the gRPC slice that
 * carries the reply, possibly after the call is over. */
typedef struct es_buf {
  struct es_buf *next; /* free-list link, while in the pool */
  struct es_pool *pool;
  size_t cap;          /* bytes usable at data */
  uint32_t cls;        /* size class: cap = ES_POOL_MIN << cls */
  uint8_t *data;       /* 64-byte aligned, right after the header */
} es_buf;

#define ES_POOL_MIN ((size_t)4096)
#define ES_POOL_CLASSES 32
typedef struct es_job es_job;
typedef struct es_pool {
  pthread_mutex_t lock; /* a leaf (order at the top): any thread, for the free lists only */
  es_buf *free[ES_POOL_CLASSES];
  uint32_t nfree[ES_POOL_CLASSES];
  uint32_t keep[ES_POOL_CLASSES]; /* most buffers kept per class */
  size_t cached, cache_max;       /* bytes of the buffers kept, and their bound */
  es_job *free_jobs;
  uint32_t nfree_jobs;
  atomic_long out_bufs; /* buffers handed out and not yet returned */
  atomic_long out_jobs;
} es_pool;
/* A reply buffer goes from the thread that wrote the output (compute thread or CQ thread)
 * to gRPC, whose slice release returns it to the pool, whence any CQ thread may take it
 * for the next request. That ordering comes from gRPC's own atomics, which TSan cannot
 * see: PR_HB_RELEASE after the last write and PR_HB_ACQUIRE after es__buf_get state it
 * (proto/pr.h). */

/* Initialises p for buffers of up to max_bytes; keeps at most cache_bytes of free buffers
 * in all (and a bounded count per class). */
int es__pool_init(es_pool *p, size_t max_bytes, size_t cache_bytes);
/* Frees every cached buffer and job. Buffers still out (owned by gRPC slices that were never
 * released) are reported at WARN and leaked on purpose rather than freed under gRPC's feet. */
void es__pool_close(es_pool *p);
/* Frees cached buffers, largest first, until at most keep_bytes are cached (any thread). */
void es__pool_trim(es_pool *p, size_t keep_bytes);
/* Returns a buffer of at least n bytes (any thread), NULL on ENOMEM. */
es_buf *es__buf_get(es_pool *p, size_t n);
/* Returns b to its pool (any thread). Matches pr_encode_with_payload's release(owner). */
void es__buf_release(void *b);
/* Job records (any thread). es__job_get zero-fills; NULL on ENOMEM. */
es_job *es__job_get(es_pool *p);
void es__job_put(es_pool *p, es_job *j);

/* ---- tags ------------------------------------------------------------------------------- */

/* Every completion-queue tag points at one of these, embedded in the object it concerns. */
typedef enum es_tag_kind {
  ES_TAG_RPC_NEW = 1,   /* a unary call arrived (obj: es_rpc) */
  ES_TAG_RPC_DONE,      /* its reply batch completed */
  ES_TAG_STREAM_NEW,    /* a Forward stream arrived (obj: es_stream) */
  ES_TAG_STREAM_RECV,   /* SEND_INITIAL_METADATA + RECV_MESSAGE / RECV_MESSAGE completed */
  ES_TAG_STREAM_SEND,   /* SEND_MESSAGE completed */
  ES_TAG_STREAM_FINAL,  /* SEND_STATUS_FROM_SERVER completed */
  ES_TAG_STREAM_CLOSE,  /* RECV_CLOSE_ON_SERVER completed: the call is over (cancelled or not) */
  ES_TAG_STREAM_INIT,   /* SEND_INITIAL_METADATA alone (a stream accepted over the budget) */
  ES_TAG_SHUTDOWN,      /* grpc_server_shutdown_and_notify finished (obj: es_server) */
} es_tag_kind;
typedef struct es_tag {
  es_tag_kind kind;
  void *obj;
} es_tag;

typedef enum es_method {
  ES_M_HELLO = 0,
  ES_M_STATS,
  ES_M_HEALTH,
  ES_M_FORWARD,
  ES_M_LOAD,        /* control (protocol 1.2): LoadExperts */
  ES_M_LOAD_STATUS, /* LoadStatus */
  ES_M_UNLOAD,      /* UnloadExperts */
  ES_M_COUNT
} es_method;

/* The owned set and its weights, as one immutable object (es_table.c). A new one is built
 * and swapped in for every change; readers hold a reference (refs) from validation to the
 * reply, so an old table, and the weights only it holds, are freed (by the admin thread)
 * only once no request can use them. */
typedef struct es_table {
  atomic_long refs;          /* +1 while current, +1 per holder */
  uint64_t gen;              /* owned_generation: 1 at start-up, +1 per change */
  kn_layer **layers;         /* [num_layers], NULL where no expert is owned */
  uint8_t *passed;           /* [num_layers]: layers[l] now belongs to the next table */
  mr_idset *sets;            /* [num_layers] experts owned (empty where layers[l] NULL) */
  const mr_idset **owned;    /* [num_layers] &sets[l] or NULL, for lim */
  es_limits lim;             /* the server's limits with this owned set */
  uint64_t weight_bytes;     /* packed bytes of the owned experts */
  uint64_t pairs;            /* (layer, expert) pairs owned */
  grpc_slice hello;          /* the packed HelloReply of this set */
  struct es_table *next;     /* the retired list (ctl_lock) */
  atomic_bool bad;           /* some of its weights come from a cache file that failed its
                              * checksum (es_cache.c): requests validated against it are
                              * refused UNAVAILABLE, never computed; inherited by derived tables
                              * until the repacked table replaces it */
} es_table;

/* One gRPC thread with its completion queue. */
typedef struct es_cq_thread {
  struct es_server *srv;
  uint32_t idx;
  grpc_completion_queue *cq;
  pthread_t thread;
  bool started;
  struct es_job *inline_job; /* the inline slot: a small request held back to run on this
                              * thread (es_inline.c; this thread only) */
} es_cq_thread;

/* Requests of at most this many tokens may run on the CQ thread (es_inline.c). Larger
 * ones keep the CQ thread free to read other streams while they compute. */
#define ES_INLINE_MAX_TOKENS 32u

/* ---- calls -------------------------------------------------------------------------------- */

/* A unary call (Hello, Stats, Health, the control calls). Lives on its CQ thread, no lock:
 * a LoadExperts is handed to es-ctl-load (through ctl_lock) until that thread starts its
 * reply; the CQ thread frees it on ES_TAG_RPC_DONE (es_rpc.c). */
typedef struct es_rpc {
  struct es_server *srv;
  es_cq_thread *cq_thread;
  es_method m;
  grpc_call *call;
  gpr_timespec deadline;
  grpc_metadata_array md;
  grpc_byte_buffer *payload; /* the request, read with the call (may be NULL) */
  grpc_byte_buffer *reply;   /* owned until RPC_DONE */
  grpc_slice details;        /* status message, owned until RPC_DONE */
  int cancelled;             /* RECV_CLOSE_ON_SERVER */
  es_tag t_new, t_done;
} es_rpc;

/* ---- jobs: what crosses from a call to the engine and back --------------------------------- */

/* How a job comes back to whoever submitted it (STYLE.md 8). es_compute.c and es_inline.c
 * know jobs, lanes and the engine only; the submitter (es_stream.c for every Forward request)
 * sets job->ops and job->owner, and these callbacks are the only way back up. */
typedef struct es_job_ops {
  /* The job is answered: job->reply holds its encoded reply (OK or an error; NULL if even
   * that could not be encoded). Takes the job back, which may be freed before this returns.
   * Called once, by the thread that computed or skipped it (the compute thread, a CQ thread
   * running it inline, or the admin thread answering queued jobs after a drain timeout),
   * with no lock held. */
  void (*done)(es_job *job, void *owner);
  /* The inline slot (es_inline.c) let go of a job it held back: the job went to the compute
   * queue, or its done has returned. CQ thread of the slot; owner is the job's, read before
   * the job could be freed. */
  void (*released)(void *owner);
} es_job_ops;

/* A submitter's lane in the fair compute queue (es_compute.c): its queued jobs in arrival
 * order and its virtual finish time. One per Forward stream (es_stream.lane). Every field
 * but `dead` and `name` is under srv->q_lock. */
typedef struct es_lane {
  es_job *head, *tail;
  uint32_t len;
  uint64_t vfinish;          /* virtual finish time of its last queued job */
  int32_t heap_idx;          /* position in srv->q_heap, -1 when it has no queued job */
  atomic_bool dead;          /* set by the submitter: nobody will read the replies, so its
                              * jobs are answered (CANCELLED) without being computed */
  const char *name;          /* for log lines (the stream's peer); set before the first job */
} es_lane;

/* One request's life: decoded header + payload in, reply out. Owned in turn by the CQ thread,
 * the compute queue (or the CQ thread's inline slot), the engine's user, and the owner's
 * send queue. */
struct es_job {
  es_job *next;                    /* link in a lane, a send queue or the pool */
  es_lane *lane;                   /* the lane it queues in */
  const es_job_ops *ops;           /* how it comes back (set by the submitter) */
  void *owner;                     /* passed to ops: the es_stream, which counts the job in
                                    * its jobs_pending until the job is settled */
  Moerpc__V1__ForwardRequest *req; /* decoded header (ids, weights), owned; NULL for errors */
  es_table *tab;                   /* the owned table it was validated against (a reference) */
  uint64_t id;
  uint32_t layer, n_tokens, top_k;
  mr_dtype dtype;
  es_buf *buf;                     /* hidden in, output out; owned until the reply is encoded */
  size_t nbytes;                   /* payload bytes in buf */
  bool counted;                    /* holds one unit of srv->inflight */
  bool sent;                       /* its reply's SEND_MESSAGE completed */
  size_t held;                     /* bytes charged to srv->held_bytes (es_stream.c) */
  uint64_t deadline_ns;            /* mr_now_ns() past which it is not computed, 0 = none */
  uint32_t budget_us;              /* ForwardRequest.budget_us, for the error message */
  uint64_t vstart;                 /* virtual start time (fair queueing, es_compute.c) */
  uint32_t status;                 /* gRPC status of the reply */
  uint64_t t_recv_ns;               /* its ForwardRequest seen by the CQ thread (0: none) */
  uint64_t t_enqueue_ns;
  uint32_t queue_us, compute_us;
  grpc_byte_buffer *reply;         /* encoded reply, owned until its send completes */
  size_t reply_bytes;              /* its length when its send started (metrics) */
};

/* A Forward stream. The fields above `lock` belong to the CQ thread (set once at accept or
 * only touched by it); the fields below are shared with the compute and admin threads and
 * are protected by `lock`.
 *
 * States: accepted -> serving (one RECV_MESSAGE outstanding, replies queued and sent one at a
 * time) -> closing (no more RECVs: the client half-closed, the call failed, or the drain asked
 * to finish) -> final (SEND_STATUS started once nothing is pending) -> freed (when the final
 * batch and any outstanding RECV have completed). Only the CQ thread frees a stream. */
typedef struct es_stream {
  struct es_server *srv;
  es_cq_thread *cq_thread;
  grpc_call *call;
  gpr_timespec deadline;
  grpc_metadata_array md;
  grpc_byte_buffer *recv_bb; /* RECV_MESSAGE output */
  int cancelled;             /* RECV_CLOSE_ON_SERVER output */
  grpc_slice details;        /* final status message */
  pr_split split;            /* reused for every request of the stream */
  char peer[96];             /* for log lines */
  es_tag t_new, t_recv, t_send, t_final, t_close, t_init;
  size_t expect;             /* CQ thread: bytes the next request is expected to hold */
  struct es_stream *prev, *next; /* srv->streams list, under srv->streams_lock */
  bool listed;               /* counted in srv->n_streams (streams_lock) */
  es_lane lane;              /* its jobs in the compute queue; lane.dead: the call is cancelled
                              * or broken, its queued work is dropped */

  pthread_mutex_t lock;      /* lock order: after srv->streams_lock, before srv->q_lock and
                              * es_pool.lock. Taken by the CQ thread (handlers), whoever
                              * answers a job (its reply) and the admin thread (drain, budget,
                              * stall cut); guards every field below */
  es_job *sq_head, *sq_tail; /* encoded replies waiting for the send slot */
  es_job *sending;           /* the reply whose SEND_MESSAGE is in flight, or NULL */
  uint32_t jobs_pending;     /* requests taken and not yet answered-and-sent (or dropped) */
  size_t bytes_pending;      /* their payload bytes (request buffers, then reply buffers) */
  bool recv_paused;          /* over the pending limits: RECV not re-armed until below half */
  bool mem_paused;           /* over the server's byte budget: re-armed by es__streams_service */
  bool recv_inflight;        /* a RECV_MESSAGE batch is outstanding */
  bool recv_held;            /* RECV not re-armed until the held-back request's reply started */
  bool busy;                 /* the CQ thread is handling a received request: no final yet */
  bool recv_done;            /* no more RECV_MESSAGE will be started */
  bool finish_requested;     /* the drain asked to end the stream */
  bool send_failed;          /* a send failed: the call is dead, drop further replies */
  bool final_started, final_done;
  bool close_started, close_done; /* the RECV_CLOSE_ON_SERVER batch */
  bool initial_sent;         /* SEND_INITIAL_METADATA started */
  bool init_inflight;        /* the lone SEND_INITIAL_METADATA batch is outstanding */
  size_t reserved;           /* bytes reserved in srv->reserved_bytes for the armed RECV */
  uint32_t final_status;     /* status the final batch sends: OK, or UNAVAILABLE (draining) */
  uint64_t send_t0_ns;       /* when the SEND_MESSAGE in flight started (stall detection) */
  char client[PR_CLIENT_NAME_MAX + 1]; /* its "moerpc-client" metadata, escaped and cut
                              * ("" when none); set before it is listed, read-only after */
  atomic_ullong *used;       /* bitset over layer * num_experts + expert: the pairs its
                              * requests named (CQ thread sets; es__leaving_service reads
                              * under streams_lock); NULL when out of memory (counts as all) */
} es_stream;

/* ---- the server --------------------------------------------------------------------------- */

/* gRPC status codes 0..16 (errors counted by status). */
#define ES_N_STATUS 17

typedef enum es_phase {
  ES_PHASE_NEW = 0,    /* bound, not started */
  ES_PHASE_LOADING,    /* gRPC started (health only), the loader thread packs the weights */
  ES_PHASE_SERVING,
  ES_PHASE_DRAIN_REQUESTS, /* waiting for every accepted request to be answered */
  ES_PHASE_DRAIN_CALLS,    /* streams asked to finish; waiting for every call to end */
  ES_PHASE_DRAIN_SHUTDOWN, /* waiting for the gRPC server's shutdown notification */
  ES_PHASE_STOPPED,
} es_phase;

struct es_server {
  es_server_opts opts;   /* strings below point at the copies */
  char *model_dir, *listen, *experts_spec, *layers_spec, *numa, *metrics_listen, *metrics_token_file;

  /* Model and weights: written by es_server_new, and the packed weights by the loader
   * thread; read-only once srv->loaded is set (every thread). */
  mr_model_config cfg;
  char fingerprint[17];
  char instance_id[33];    /* HelloReply.instance_id: 128 random bits in hex, made at start */
  kn_format format;
  uint32_t group;
  char weight_format[32];  /* wire name, "bf16" / "int4-g64" */
  kn_engine *eng;          /* used by the compute thread only once serving */
  kn_layer **layers;       /* [num_layers], NULL where not owned */
  mr_idset owned_layers;   /* layers served */
  mr_idset owned_experts;  /* experts served in every served layer */
  const mr_idset **owned;  /* [num_layers] for es_limits: &owned_experts or NULL */
  es_limits limits;
  uint64_t weight_bytes;   /* packed bytes held */
  uint32_t n_experts_loaded;

  /* Loading (es_load.c; the loader thread, es_admin.c). The totals are set by es_server_new;
   * the progress counters are written by the loader and read by anyone. */
  mr_st *st;                 /* the open safetensors, until the weights are packed */
  bool map_in_place;         /* --map-weights took effect (es__load_prepare): owned experts
                              * borrow the model's mapping (kn_layer_borrow_expert) */
  uint64_t n_mapped;         /* experts served in place at start-up (the rest were packed) */
  mr_st **st_kept;           /* the mappings in-place experts read: start-up's, then one per
                              * live load that mapped experts (appended under ctl_lock);
                              * closed by es__unload after the layers */
  uint32_t n_st_kept;
  uint64_t load_tensors_total, load_bytes_total;
  atomic_ullong load_tensors_done, load_bytes_done;
  atomic_bool load_abort;    /* the drain began during the load: stop after this expert */
  atomic_bool load_finished; /* the loader returned (load_rc, load_err are set) */
  atomic_bool loaded;        /* every owned expert is packed and the compute thread runs */
  pthread_t loader;
  bool loader_started;       /* admin thread */
  int load_rc;
  mr_err load_err;
  uint32_t load_delay_ms;    /* MOERPC_TEST_LOAD_DELAY_MS: test only, per expert */
  uint64_t load_t0_ns;       /* the loader's start (before the cache is tried), for "loaded:" */
  struct es_cache *cache;    /* --weight-cache, NULL without (es_cache.c) */
  atomic_bool cache_bad;     /* a corrupt cache file was found after readiness: NOT_SERVING
                              * until the repacked table is published */
  int (*cache_repack)(struct es_server *s, mr_err *e); /* es__control_repack_all */
  int64_t test_nonfinite_layer; /* MOERPC_TEST_NONFINITE_LAYER: test only, -1 = off (es_compute.c) */
  uint32_t test_batch_delay_ms; /* MOERPC_TEST_BATCH_DELAY_MS: test only, a slow batch (es_compute.c) */

  /* Live placement (es_table.c, es_control.c). tab: the current owned table, swapped under
   * tab_lock by publishers serialised by ctl_lock; NULL until the start-up load is done.
   * Lock order: ctl_lock -> tab_lock, never nested with the stream chain (top). ctl_lock:
   * the publishers (the admin thread once, es-ctl-load, a CQ thread's unload), the load
   * record and the LoadExperts queue below; never held across a file read. tab_lock: a
   * leaf, the pointer swap and every reader's es__tab_get. */
  pthread_mutex_t tab_lock, ctl_lock;
  es_table *tab;
  es_table *retired;         /* tables no longer current, not yet freed (ctl_lock) */
  uint64_t tab_gen;          /* ctl_lock */
  uint64_t expert_bytes;     /* packed bytes of one expert (set with the first table) */
  atomic_ullong cur_weight_bytes, cur_pairs, cur_gen; /* of the current table, for metrics */
  atomic_uchar *layer_served; /* [num_layers]: the layer was ever served (metrics labels) */
  /* The latest Hello of each client name (protocol 1.4, StatsReply.clients), under
   * hello_lock (a leaf): a ring of ES_HELLO_SEEN entries, the oldest replaced. */
  pthread_mutex_t hello_lock;
  struct es_hello_seen {
    char name[PR_CLIENT_NAME_MAX + 1]; /* escaped and cut like a stream's client name */
    uint64_t gen;            /* owned_generation of the HelloReply it got */
    uint64_t t_ns;           /* when */
  } hello_seen[64];
  uint32_t n_hello_seen;
  /* Unloaded pairs in their grace (docs/DESIGN.md 15.1, "Unload grace"), ctl_lock: still
   * in the table (served), no longer in its Hello; es__leaving_service frees them once no
   * open stream has used one, or when --unload-grace ends. */
  uint8_t *leaving;          /* [num_layers * num_experts] 1 = leaving */
  uint64_t n_leaving;
  uint64_t leave_until_ns;   /* the grace ends (mr_now_ns) */
  uint64_t leave_epoch;      /* +1 per change of leaving */
  /* The live load (ctl_lock, except the progress atomics). */
  uint64_t ld_id;            /* the latest load, 0 = none */
  int ld_state;              /* MOERPC__V1__LOAD_STATE__* */
  uint32_t ld_status;
  char ld_error[512];
  uint64_t ld_t0_ns, ld_t1_ns, ld_tensors_total, ld_bytes_total, ld_packed;
  atomic_ullong ld_tensors_done, ld_bytes_done;
  /* es-ctl-load and its queue of LoadExperts calls (ctl_lock): started by the first
   * LoadExperts, waits on ctl_cond for the next, joined by es__control_stop. */
  pthread_cond_t ctl_cond;
  struct es_load_req *ld_queue, *ld_queue_last;
  bool ctl_stop;             /* es__control_stop: no more requests, the thread ends */
  pthread_t ld_thread;
  bool ld_thread_started;

  /* gRPC: created by es_server_new, started by es_server_run. */
  bool grpc_inited;
  grpc_server *gs;
  void *rm[ES_M_COUNT];    /* registered methods */
  es_cq_thread *cq_threads;
  uint32_t n_cq_threads;
  int port;
  bool shutdown_called;    /* grpc_server_shutdown_and_notify called */
  es_tag t_shutdown;
  int max_message_bytes;

  /* Security (es_auth.c). The flags and paths are set by es__auth_init and read-only
   * afterwards; the token and the pending TLS config change on SIGHUP (es__auth_reload). */
  bool tls_on, mtls_on;
  bool auth_on;                          /* a token is required */
  char *token_path, *tls_cert_path, *tls_key_path, *tls_ca_path; /* owned copies, or NULL */
  pthread_mutex_t auth_lock; /* a leaf: auth_value and auth_len (CQ threads read, admin writes) */
  char auth_value[MR_SECRET_MAX_BYTES + 8]; /* "Bearer <token>" */
  size_t auth_len;
  pthread_mutex_t tls_lock;  /* a leaf: tls_pending (admin writes, gRPC's handshakes take it) */
  grpc_ssl_server_certificate_config *tls_pending; /* the next handshake's config, or NULL */
  char tls_until[40];        /* notAfter of the certificate last read (admin thread) */

  atomic_bool serving;       /* readiness: weights loaded and no drain started */
  atomic_bool draining;      /* new Forward requests get UNAVAILABLE */
  atomic_bool stop_reposting;/* do not pre-post request_call any more */
  atomic_bool abort_jobs;    /* drain timed out: answer queued jobs UNAVAILABLE, don't compute */
  atomic_bool shutdown_notified; /* ES_TAG_SHUTDOWN seen */
  atomic_bool stop_requested;    /* es_server_stop was called */
  atomic_llong inflight;     /* Forward requests accepted before the drain, not yet sent */
  atomic_llong live_calls;   /* accepted calls (unary + streams) not yet freed */
  atomic_llong lost_in_drain; /* accepted requests whose reply was never sent because the
                               * drain cut their call (cancelled_all); not those whose client
                               * cancelled or went away first */
  atomic_bool cancelled_all;  /* the drain cancelled every call left: set by the loop before
                               * it cancels, read by es_stream.c for lost_in_drain */

  /* Admission (es_stream.c). held_bytes: request and reply buffers and decoded headers of
   * every request taken and not yet answered-and-sent; a stream arms its next RECV only
   * while held + reserved bytes fit the budget less stream_room, and less its reserve
   * unless the stream is light (es__stream_reserve_locked: so a light client is never
   * locked out by heavy ones); the rest wait, paused (mem_paused), for
   * es__streams_service. */
  size_t max_inflight_bytes;
  uint32_t max_streams;      /* Forward streams open at once: opts.max_streams, or (auto) the
                              * budget / ES_STREAM_SHARE, set with max_inflight_bytes (read
                              * after loaded, like it) */
  size_t stream_window;      /* HTTP/2 read-ahead of one stream, bytes (es__grpc_create) */
  size_t stream_charge;      /* what one open Forward stream costs outside its requests: its
                              * window plus ES_STREAM_OVERHEAD */
  size_t stream_room;        /* max_streams x stream_charge, at most half the budget: set aside
                              * from the budget, requests get the rest (es_stream.c) */
  atomic_llong held_bytes;
  atomic_llong reserved_bytes; /* expected sizes of the messages armed RECVs may bring */
  atomic_llong held_peak;    /* since start or the last Stats reset */
  atomic_int mem_paused;     /* streams paused on the budget */
  uint32_t n_streams;        /* open streams (streams_lock) */

  pthread_mutex_t streams_lock; /* first in the lock order (then es_stream.lock, q_lock): the
                                 * list and the two fields below, and n_streams. CQ threads
                                 * (accept, free), the admin thread (drain, service), and
                                 * mr-metrics (n_streams alone) */
  es_stream *streams;           /* open streams */
  bool finishing;               /* the drain asked every stream to finish */

  /* Compute queue. q_lock: after es_stream.lock, before es_pool.lock in the order; guards
   * the heap and the lanes' queues, q_vtime, q_len, q_stop and computing. Taken by the CQ
   * threads (submit, inline claim), es-compute, a stream purging its lane, the admin thread
   * (drain abort) and mr-metrics (q_len alone). q_cond: es-compute waits there. */
  pthread_mutex_t q_lock;
  pthread_cond_t q_cond;
  es_lane **q_heap;             /* lanes with queued jobs, a min-heap on their head's vstart */
  uint32_t q_heap_len, q_heap_cap;
  uint64_t q_vtime;             /* virtual time: vstart of the job taken last */
  uint32_t q_len;               /* jobs queued, all streams */
  bool q_stop;
  bool computing;               /* the engine and the arena are in use (see the top) */
  pthread_t compute_thread;
  bool compute_started;
  atomic_bool pin_refused;      /* the OS refused kn_engine_pin_caller: run unpinned (logged once) */
  mr_arena arena;               /* engine owner only: merged inputs, fp32 output, scratch */
  size_t arena_recent_peak;     /* engine owner only: es__arena_done's shrink rule */
  uint32_t arena_small_runs;

  es_pool pool;
  bool pool_inited;
  size_t pool_max_buf;          /* capacity of the largest request buffer */

  /* Counters (atomics, relaxed: they are statistics). tokens is [num_layers * num_experts]. */
  atomic_ullong *tokens;
  atomic_ullong n_requests, n_errors;     /* for Stats: reset by Stats{reset: true} */
  atomic_ullong n_expired, n_dropped, n_refused; /* idem: see StatsReply in moe.proto */
  atomic_ullong tot_requests, tot_errors; /* for the metrics line: never reset */
  atomic_ullong n_computed, sum_queue_us, sum_compute_us, n_batches, n_merged;

  /* Metrics (es_metrics.c): never reset. errors by gRPC status; bytes of ForwardRequest
   * messages received and of ForwardReply messages whose send completed; per-layer tokens
   * and compute-time histograms ([num_layers], allocated by es_server_new). */
  atomic_ullong err_by_status[ES_N_STATUS];
  atomic_ullong tot_expired, tot_dropped, tot_refused; /* n_expired... without the reset, but
                                                        * tot_refused only over --max-streams */
  atomic_ullong tot_stall_cuts; /* streams cut after --stall-timeout-ms (in n_refused too) */
  atomic_ullong bytes_in, bytes_out;
  atomic_ullong *layer_tokens;
  mr_hist *layer_hist;           /* compute time of each request (its batch's), ns */
  mr_hist queue_hist;            /* time in the compute queue, ns */
  mr_http_server *metrics_http;  /* NULL without --metrics-listen */
  double start_time_s;           /* Unix time of es_server_new */

  /* Admin loop (es_admin.c): touched by the es_server_run thread only, except that
   * es__admin_wake may be called from any thread once loop_inited. */
  uv_loop_t loop;
  uv_async_t wake;
  uv_signal_t sig_term, sig_int, sig_hup;
  uv_timer_t metrics_timer, drain_timer, house_timer;
  bool loop_inited, run_called;
  es_phase phase;
  int run_rc;
  uint64_t drain_t0_ms, drain_deadline_ms, calls_deadline_ms;
  int64_t house_trim_peak;     /* held_bytes high-water mark since the last malloc_trim */
  uint64_t house_last_requests, house_quiet_ms;
  long long house_last_calls;
  bool house_dirty;            /* activity since the last trim */
  uint64_t house_trim_bytes_in; /* bytes_in at the last malloc_trim */
  uint64_t m_last_ms, m_last_requests, m_last_errors, m_last_computed, m_last_queue_us,
      m_last_compute_us, m_last_batches, m_last_merged;
};

/* es_load.c. es__load_prepare (es_server_new): config, the owned sets, every owned tensor's
 * presence and shape, the engine and empty layers; fills cfg, fingerprint, format, limits,
 * owned_*, load_*_total and keeps st open. Option errors are MR_EINVAL naming the flag; file
 * errors keep their own codes. es__load_weights (the loader thread): packs every owned
 * expert, publishing progress (nothing when cached: es__cache_attach filled the layers);
 * MR_ECANCELED once load_abort is seen; closes st. */
int es__load_prepare(es_server *s, mr_err *e);
int es__load_weights(es_server *s, bool cached, mr_err *e);
/* Keeps a model mapping that in-place experts read until es__unload (ctl_lock held, or
 * the loader before serving): the server owns st from now on, whatever happens. */
void es__keep_st(es_server *s, mr_st *st);
void es__unload(es_server *s);
/* The "loading: N of M tensors" status message of calls refused while loading. */
void es__loading_msg(es_server *s, char *buf, size_t len);
/* MemAvailable of /proc/meminfo into *bytes; false when it cannot be read. For the load
 * memory rule (es_table.c) and the auto admission budget (es__inflight_budget). */
bool es__mem_available(uint64_t *bytes);

/* es_cache.c: the packed-weight cache (docs/DESIGN.md section 23).
 *   es__cache_new      es_server_new: checks and creates --weight-cache DIR (MR_EINVAL
 *                      naming the flag); a no-op without the flag;
 *   es__cache_attach   the loader thread, before packing: true when every owned expert was
 *                      adopted from a usable cache (then nothing is packed); false on a miss,
 *                      a refusal or a corrupt cache (logged with the reason; the layers are
 *                      left empty for packing and the cache is rewritten once serving);
 *   es__cache_start    the admin thread, once loaded: es-cache writes the cache (after a
 *                      miss) or checks the mapped files' checksums (after a hit without
 *                      --verify-cache), and repairs a corrupt one (es__control_repack_all);
 *   es__cache_adopt    es-ctl-load: expert x of layer from the cache into L (no copy), true
 *                      when the cache had it (verified);
 *   es__cache_extend   es-ctl-load, after a load published: a segment of the pairs of want
 *                      the cache lacks is written and the manifest rewritten;
 *   es__cache_stop / _close  teardown: joins es-cache; unmaps (after the layers are gone). */
struct es_table;
int es__cache_new(es_server *s, const char *dir, mr_err *e);
bool es__cache_attach(es_server *s);
void es__cache_start(es_server *s);
bool es__cache_adopt(es_server *s, kn_layer *L, uint32_t layer, uint32_t x);
void es__cache_extend(es_server *s, const uint8_t *want);
void es__cache_stop(es_server *s);
void es__cache_close(es_server *s);
/* es_table.c: marks the current and every retired table bad and the server NOT_SERVING
 * (cache_bad); es__tab_serve_again undoes the readiness part once a clean table is
 * current (unless a drain began). */
void es__tab_mark_bad(es_server *s);
void es__tab_serve_again(es_server *s);
/* es_control.c, es-cache: repacks every pair of the current table from the model (never
 * from the cache) and publishes the result as a table that is not bad. es_cache.c sits
 * below es_control.c, so it calls this through srv->cache_repack (set by es_server_new). */
int es__control_repack_all(es_server *s, mr_err *e);

/* es_table.c: the owned table. */
/* A reference to the current table (NULL before the start-up load is done). Any thread. */
es_table *es__tab_get(es_server *s);
/* Drops a reference (any thread, lock-free; NULL is a no-op). */
static inline void es__tab_put(es_table *t) {
  if (t) atomic_fetch_sub_explicit(&t->refs, 1, memory_order_release);
}
/* Admin thread, after the start-up load: the first table from s->layers (moved into it). */
int es__tab_init(es_server *s, mr_err *e);
/* Admin thread, housekeeping: frees retired tables nobody references. */
void es__tab_reap(es_server *s);
/* Republishes the current table's layers as a new generation (only its Hello changes: a
 * pair entered or left s->leaving). ctl_lock held; avail as for es__tab_derive. */
int es__tab_republish(es_server *s, uint64_t avail, mr_err *e);
/* Admin thread, housekeeping: frees the leaving pairs once no open stream has used any of
 * them, or their grace has ended (one INFO line). Takes ctl_lock and streams_lock, never
 * nested. */
void es__leaving_service(es_server *s);
/* es_grpc.c: records a Hello of client name (escaped) answered with owned generation gen
 * (hello_lock). */
void es__hello_seen(es_server *s, const char *name, uint64_t gen);
/* A new table from cur with every layer passed on except those with is_changed[l], which
 * take changed[l] (owned by the new table from here on; on failure, NULL and they stay the
 * caller's); avail is es__mem_now(), read before ctl_lock. ctl_lock held. */
es_table *es__tab_derive(es_server *s, es_table *cur, kn_layer **changed, const uint8_t *is_changed,
                         uint64_t avail, mr_err *e);
/* Makes t current (ctl_lock held; takes tab_lock); the previous table is retired. */
void es__tab_publish(es_server *s, es_table *t);
/* Teardown, no request left: frees every table, current and retired. */
void es__tab_close(es_server *s);
/* The memory rule (docs/DESIGN.md 15.1). es__mem_now: MemAvailable, UINT64_MAX when it
 * cannot be read, read before ctl_lock is taken. es__load_free: the bytes a load may still
 * add with weight_bytes packed (ctl_lock held: a running load's bytes count as used). */
uint64_t es__mem_now(void);
uint64_t es__load_free(es_server *s, uint64_t weight_bytes, uint64_t avail);

/* es_control.c: live placement. */
/* es_server_free: stops and joins es-ctl-load (first, before the engine and gRPC go) */
void es__control_stop(es_server *s);
/* ... and later frees every table. */
void es__control_close(es_server *s);
/* The control calls (CQ thread); the caller checked authorisation. A LoadExperts is answered
 * by es-ctl-load once it has read the model's headers. */
void es__on_load(es_rpc *r);
void es__on_load_status(es_rpc *r);
void es__on_unload(es_rpc *r);

/* es_metrics.c */
/* Binds opts.metrics_listen and starts its responder (es_server_new, before the load). */
int es__metrics_start(es_server *s, mr_err *e);
void es__metrics_stop(es_server *s);
/* Counts one error reply of status (any thread). */
static inline void es__count_error(es_server *s, uint32_t status) {
  atomic_fetch_add_explicit(&s->n_errors, 1, memory_order_relaxed);
  atomic_fetch_add_explicit(&s->tot_errors, 1, memory_order_relaxed);
  atomic_fetch_add_explicit(&s->err_by_status[status < ES_N_STATUS ? status : GRPC_STATUS_UNKNOWN],
                            1, memory_order_relaxed);
}

/* es_rpc.c: answering a unary call. */
/* The method's path ("/moerpc.v1.ExpertService/Hello") and short name ("Hello"). */
const char *es__method_path(es_method m);
const char *es__method_name(es_method m);
/* Answers a unary call: status, details (copied) and reply (NULL, or owned from here on).
 * The CQ thread of the call, or es-ctl-load for a LoadExperts; r is freed by the CQ thread
 * on ES_TAG_RPC_DONE (or here, and live_calls settled, if the batch cannot start). */
void es__rpc_reply(es_rpc *r, grpc_status_code status, const char *details, grpc_byte_buffer *reply);
/* Answers with the status of MR code rc and the message "what: e->msg". */
void es__rpc_reply_err(es_rpc *r, int rc, const char *what, const mr_err *e);
/* Frees a unary call's context (its payload, reply, metadata, details and call reference). */
void es__rpc_free(es_rpc *r);
/* Writes the peer address of call ("ipv4:127.0.0.1:5555"), escaped, into buf, for log lines. */
void es__call_peer(grpc_call *call, char *buf, size_t len);

/* es_grpc.c */
/* Creates the gRPC server, registers the methods and the completion queues, binds. */
int es__grpc_create(es_server *s, mr_err *e);
/* Starts the server and the CQ threads (which pre-post their request_calls). */
int es__grpc_start(es_server *s, mr_err *e);
/* Drain, admin thread: stops re-posting and calls grpc_server_shutdown_and_notify (the
 * notification arrives as ES_TAG_SHUTDOWN: shutdown_notified + es__admin_wake). */
void es__grpc_shutdown_begin(es_server *s);
/* Teardown: shuts the CQs down, joins their threads, destroys the server and the CQs. If the
 * drain has not run, first shuts the server down and cancels every call. */
void es__grpc_destroy(es_server *s);

/* es_auth.c */
/* The status message of a refused call: says what is missing, never echoes what came. */
#define ES_AUTH_REFUSED_MSG "missing or wrong bearer token (metadata \"authorization: Bearer <token>\", see --auth-token-file)"
/* Checks the options that concern security (TLS flags in pairs, the loopback rule), reads the
 * token and PEM files (modes, certificate dates, the key against the certificate) and keeps
 * their paths for es__auth_reload. Start-up only, before the model loads. MR_EINVAL for
 * option and file errors, naming the flag and the file. */
int es__auth_init(es_server *s, mr_err *e);
/* The credentials for grpc_server_add_http2_port: insecure, or TLS/mTLS on a certificate
 * config fetcher that hands gRPC the config of the last (re)load. The caller releases them. */
grpc_server_credentials *es__auth_server_creds(es_server *s);
/* SIGHUP (admin thread): reads and checks the token file and the TLS files again and, only
 * if all of them pass, puts them in place: the token for every call from now on, the TLS
 * files for every connection made from now on. what (len bytes) gets the files reloaded,
 * for the log line. On failure nothing changes and e says which file and why. */
int es__auth_reload(es_server *s, char *what, size_t len, mr_err *e);
void es__auth_close(es_server *s);
/* True if md carries the expected bearer token (or none is required); else logs the refusal
 * (rate-limited, with peer and method) and returns false. CQ threads. */
bool es__auth_ok(es_server *s, const grpc_metadata_array *md, const char *peer,
                 const char *method);
/* A Forward stream that fails it is refused at accept (es__on_stream_new), before any message
 * is read, and does not count against --max-streams. */

/* es_stream.c. The es__on_stream_* handlers run on the call's CQ thread, with ok = the
 * event's success flag. */
/* Posts one request_call for Forward on t's queue (CQ thread, or at start-up). */
void es__stream_post(es_server *s, es_cq_thread *t);
void es__on_stream_new(es_stream *st, bool ok);
void es__on_stream_recv(es_stream *st, bool ok);
void es__on_stream_send(es_stream *st, bool ok);
void es__on_stream_final(es_stream *st, bool ok);
void es__on_stream_close(es_stream *st, bool ok);
void es__on_stream_init(es_stream *st, bool ok);
/* Refuses a stream just accepted: no RECV; the final batch sends status and msg. st->lock
 * held; the caller then calls es__stream_maybe_finish_locked (through es__on_stream_new). */
void es__stream_refuse_locked(es_stream *st, uint32_t status, const char *msg);
/* Frees a stream nothing refers to any more (CQ thread; also for a request_call context that
 * came back unused). */
void es__stream_free(es_stream *st);
/* Drain, admin thread: asks every open stream (and any accepted later) to finish. */
void es__streams_finish(es_server *s);

/* Bytes a request holds until its reply is sent: its buffer (request rows, then reply rows,
 * buf_cap bytes) and its decoded header (ids and weights, 8 bytes a slot, and the record). */
static inline size_t es__request_cost(size_t buf_cap, uint32_t n_tokens, uint32_t top_k) {
  return buf_cap + (size_t)n_tokens * top_k * 8u + sizeof(es_job) + 256u;
}
/* The admission budget: opts.max_inflight_bytes, or (auto) a quarter of MemAvailable within
 * ES_AUTO_INFLIGHT_MIN..MAX; never below ES_INFLIGHT_MIN_REQUESTS largest requests.
 * es_server_new checks an explicit option; the auto budget is taken when loading ends
 * (es_admin.c). */
uint64_t es__inflight_budget(const es_server *s);
/* The auto --max-streams for a budget: budget / ES_STREAM_SHARE within
 * ES_AUTO_STREAMS_MIN..MAX. */
uint32_t es__auto_max_streams(uint64_t budget);
/* Once the budget is known (es_server_new for an explicit one, the end of loading for an
 * auto one): the auto max_streams, and stream_room = max_streams x stream_charge. Returns
 * false when that is over half the budget; the room is then capped at half (the caller
 * refuses an explicit budget, or logs a WARN for an auto one). */
bool es__streams_size(es_server *s);
/* The HTTP/2 window of one stream: an eighth of a stream's share of the budget, within
 * ES_STREAM_WINDOW_MIN..MAX. budget is the explicit one, or (auto, not known before the
 * weights load) ES_AUTO_INFLIGHT_MIN, which no auto budget is below; max_streams 0 = auto. */
size_t es__stream_window(uint64_t budget, uint32_t max_streams);
/* Admin thread: re-arms the RECV of streams paused on the budget while it has room, and cuts
 * streams whose reply send has stalled past opts.stall_timeout_ms. */
void es__streams_service(es_server *s);

/* es_compute.c */
int es__compute_start(es_server *s, mr_err *e);
/* Takes every job of lane ln out of the compute queue and returns them (linked through next),
 * their number in *n. Any thread; takes q_lock, so a caller may hold its stream's lock. */
es_job *es__compute_detach(es_server *s, es_lane *ln, uint32_t *n);
/* Drain timeout, admin thread: answers every queued job UNAVAILABLE without computing it. */
uint32_t es__compute_abort_queued(es_server *s);
/* True while a batch is being computed (srv->computing, read under q_lock). Any thread. */
bool es__compute_busy(es_server *s);
/* Queues n jobs (one q_lock, one wake-up of the compute thread). Any thread. */
void es__compute_submit(es_server *s, es_job **jobs, uint32_t n);
/* Takes the engine and the arena for the caller if the compute queue is empty and nobody
 * computes (srv->computing, under q_lock); true if taken. */
bool es__compute_claim(es_server *s);
/* With the engine claimed: computes job alone, or answers it uncomputed if it must not be
 * computed (dead lane, past its deadline, drain timed out). Its ops->done runs either way. */
void es__compute_run_one(es_server *s, es_job *job);
/* Gives the engine back; wakes the compute thread if jobs were queued meanwhile. */
void es__compute_release(es_server *s);
/* Pins the calling thread to worker 0's core (kn_engine_pin_caller) for the engine runs it
 * is about to make; true if pinned. Not with a one-thread engine (no pool thread to collide
 * with). The first refusal is logged (naming who) and ends pinning for the server's life.
 * Any thread that runs the engine. */
bool es__compute_pin(es_server *s, const char *who);
/* Stops the compute thread once its queue is empty and joins it. */
void es__compute_stop(es_server *s);
/* Encodes an error reply into job->reply (no payload). Returns 0 or MR_ENOMEM. */
int es__reply_encode_error(es_job *job, uint32_t status, const char *msg);

/* es_inline.c: the inline run (the rule is at the top of es_inline.c). CQ thread t only. */
/* Takes a validated job received on t: holds it in t's slot when it is small and the slot
 * was empty (returns true: its stream's RECV then waits for ops->released), else queues it
 * (and a job the slot held, which ops->released then lets go). */
bool es__inline_offer(es_cq_thread *t, es_job *job);
/* True while t's slot holds a job (the dispatcher then polls without blocking). */
bool es__inline_held(const es_cq_thread *t);
/* t's round of events is over: runs the held job here if the compute queue is empty and the
 * engine idle, else queues it. No-op with an empty slot. */
void es__inline_run(es_cq_thread *t);

/* es_admin.c */
int es__admin_init(es_server *s, mr_err *e);
void es__admin_close(es_server *s);

/* Rings the admin loop's doorbell (any thread, async-signal-safe): s->wake is the uv_async_t
 * that es__admin_init armed before any other thread exists, and es_admin.c's handler
 * re-checks the drain, the end of loading and the streams paused on the budget. The lower
 * floors wake the loop through this field, never by calling into es_admin.c. */
static inline void es__admin_wake(es_server *s) {
  if (s->loop_inited) uv_async_send(&s->wake);
}

/* Decrements a drain-relevant counter and wakes the admin loop when it reaches zero during a
 * drain. */
static inline void es__counter_dec(es_server *s, atomic_llong *c) {
  if (atomic_fetch_sub(c, 1) == 1 && atomic_load(&s->draining)) es__admin_wake(s);
}

#endif /* ES_INTERNAL_H */
