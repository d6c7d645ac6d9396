/*
 * model.h - the whole-model runner (prefix gc_model_): loads a Hugging Face MoE checkpoint
 * (Qwen3-MoE, Qwen2-MoE without shared experts, Mixtral) and runs its forward pass, with
 * the dense parts and the hot experts on a compute backend (backend.h; the CPU backend
 * here) and the cold experts on the expert servers of a cluster (moerpc_client.h),
 * overlapped and optionally deferred (gc_moe).
 *
 *   gc_model_open      config + weights (progress lines: tensors, GB, GB/s, ETA), the
 *                      placement of experts (all local, --local-experts N or a placement
 *                      file), the cluster (Hello checks: same model, coverage)
 *   gc_model_step      one forward over a batch of tokens of any sequences: each token is
 *                      (KV slot, position, id); positions continue each slot's cache
 *   gc_model_generate  prefill + decode of several prompts, greedy or sampled
 *   gc_model_close
 *
 * One forward, per decoder layer l (the order a GPU backend keeps on its stream):
 *   x += o_proj(attention(rope(qk_norm(qkv_proj(rmsnorm(x))))))
 *   MoE layer:  h = rmsnorm(x); route(h) -> ids, weights; cold slots -> gc_moe_submit
 *               (RPCs start); hot experts on the backend; gc_moe_wait (cold + the previous
 *               layer's deferred); x += hot + cold
 *   dense layer: x += down(silu(gate(h)) * up(h))
 * then logits = lm_head(rmsnorm(x)) for the tokens that want them.
 *
 * Tensor parallelism (opts.tp > 1, comm.h): ranks 1.. are threads of the model, each with
 * its own backend and slice of the weights; gc_model_step runs rank 0 on the caller's
 * thread and returns when every rank has finished the step.
 *
 * Threads: one thread drives a gc_model. Errors name the field and the limit.
 */
#ifndef GC_MODEL_H
#define GC_MODEL_H

#include "gpu_client/runner/backend.h"
#include "gpu_client/rpc/moerpc_client.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct gc_model gc_model;

typedef struct gc_model_opts {
  const char *model_dir;      /* HF checkpoint directory (config.json + safetensors) */
  const char *cluster_path;   /* cluster file, NULL = every expert local */
  const char *placement_path; /* placement file (mr.h), NULL = none */
  int32_t local_experts;      /* >= 0: N hot experts per MoE layer by the rotating rule
                               * (gc_model_local_rule); -1 = not given */
  uint32_t max_deferred;      /* K of gc_moe (0 = no deferral) */
  uint32_t max_seq;           /* KV cache positions per sequence, 0 = 4096 (capped by the
                               * model's max_position_embeddings) */
  uint32_t max_batch;         /* KV slots (sequences at once), 0 = 1 */
  kn_engine_opts engine;      /* the kernel engine (threads, ISA, NUMA) */
  const char *backend;        /* "cpu" (NULL = cpu) or "cuda" (gc_bk_open) */
  uint32_t device;            /* cuda: the first device; rank r uses device + r */
  uint32_t tp;                /* tensor-parallel ranks (comm.h), 0 or 1 = none */
  kn_format expert_format;    /* hot experts; KN_FMT_COUNT = the servers' format, or as stored
                               * without a cluster */
  uint32_t expert_group;      /* INT4 group, 0 = 64 (or the servers') */
  kn_format dense_format;     /* projections and lm_head; KN_FMT_COUNT = as stored */
  mr_dtype wire;              /* hidden states to the servers; 0 = bf16 */
  uint32_t deadline_ms, connect_timeout_ms; /* 0 = the cluster file's / the library's */
  uint32_t wait_spin_us;      /* gc_options.wait_spin_us: watch for replies before sleeping */
  bool quiet;                 /* no loading progress lines */
  bool map_weights;           /* hot experts, dense linears and the embedding table served
                               * in place from the model's mapping where the backend can
                               * (cpu: kn_layer_borrow_expert, kn_linear_borrow; the files
                               * must stay unchanged while the model is open); others packed */
  bool watch_placement;       /* with placement_path and cluster_path: at each step boundary
                               * re-read placement_path if it changed (inode, size, mtime)
                               * and switch to it (see gc_model_placement_get) */
  bool pin_caller;            /* pin the opening thread to worker 0's core
                               * (kn_engine_pin_caller): set it when that thread makes the
                               * steps and does nothing else heavy */
  uint32_t routing_window;    /* steps of the routing counters' window, 0 = the default
                               * (moerpc_client.h "routing statistics") */
} gc_model_opts;
void gc_model_opts_init(gc_model_opts *o);

/* Opens the model (see the top of the file). On failure *out is NULL and e says why. */
int gc_model_open(gc_model **out, const gc_model_opts *o, mr_err *e);
void gc_model_close(gc_model *m); /* NULL is a no-op */
/* Hot experts (all ranks) served in place from the model's files (map_weights). */
uint64_t gc_model_mapped_experts(const gc_model *m);
/* Bytes of dense linears and embedding tables (all ranks) served in place (map_weights). */
uint64_t gc_model_mapped_dense_bytes(const gc_model *m);
/* Dense linears (all ranks) kept in fp8-b128: an FP8 checkpoint's codes and block scales
 * as stored, or others quantized so by dense_format fp8. */
uint64_t gc_model_fp8_linears(const gc_model *m);

const mr_model_config *gc_model_config(const gc_model *m);
uint32_t gc_model_max_seq(const gc_model *m);
uint32_t gc_model_max_batch(const gc_model *m);
/* The kernel engine (its pool serves the backend and the client library). */
kn_engine *gc_model_engine(gc_model *m);
/* The cluster, or NULL when every expert is local. */
gc_cluster *gc_model_cluster(gc_model *m);
/* The routing counters of the run: the cluster's, or the runner's own without a cluster
 * (every routed slot of every MoE layer, hot experts included; a step = one gc_model_step).
 * _json appends them as moerpc-stats JSON with the model's fingerprint; _save writes a file. */
gc_routing *gc_model_routing(gc_model *m);
int gc_model_routing_json(gc_model *m, gc_routing_span span, mr_buf *out, mr_err *e);
int gc_model_routing_save(gc_model *m, gc_routing_span span, const char *path, mr_err *e);
/* Whether the client computes (layer, expert) itself. */
bool gc_model_is_local(const gc_model *m, uint32_t layer, uint32_t expert);
/* The documented --local-experts rule: MoE layer l keeps experts (l * n + i) mod E, i < n,
 * so that consecutive layers keep different experts and the servers' load stays even. */
bool gc_model_local_rule(uint32_t layer, uint32_t expert, uint32_t n, uint32_t num_experts);
/* Packed weight bytes the client holds: dense parts (projections, norms, lm_head) and
 * hot experts; and the bytes of one expert in the experts' format. */
uint64_t gc_model_dense_bytes(const gc_model *m);
uint64_t gc_model_expert_bytes(const gc_model *m);

/* Forgets what KV slot `seq` holds (its next token starts at position 0). */
void gc_model_seq_reset(gc_model *m, uint32_t seq);
uint32_t gc_model_seq_len(const gc_model *m, uint32_t seq);

typedef struct gc_step {
  uint32_t n_tokens;          /* T, 1..max_batch * max_seq */
  const int32_t *ids;         /* [T] token ids < vocab */
  const uint32_t *seq;        /* [T] KV slots < max_batch */
  const uint32_t *pos;        /* [T] positions: a slot's tokens must continue its cache in
                               * order (pos = its length so far, then +1 per token) */
  const uint8_t *want_logits; /* [T] or NULL = every token */
  float *logits;              /* [tokens wanting logits, vocab] fp32, in token order */
} gc_step;
/* One forward over the tokens of s. Errors (bad ids, positions, slots) come before any
 * computation and leave the caches as they were; an RPC failure mid-way names the server
 * and leaves the slots of this step undefined (reset them). */
int gc_model_step(gc_model *m, const gc_step *s, mr_err *e);

/* Time and bytes since open or the last reset, summed over steps. */
typedef struct gc_layer_stats {
  uint64_t attn_us;     /* norm + qkv + attention + o_proj */
  uint64_t local_us;    /* hot experts (MoE layer) or the dense MLP, routing included */
  uint64_t wait_us;     /* blocked on the servers' replies */
  uint64_t submit_us;   /* splitting, encoding and queueing the requests */
  uint64_t rpc_us;      /* requests queued -> last reply of the immediate calls */
  uint64_t deferred_rpc_us, deferred_wait_us;
  uint64_t deferred_slots;
} gc_layer_stats;
typedef struct gc_model_stats {
  uint64_t steps, tokens;
  uint64_t step_us;          /* wall time inside gc_model_step */
  uint64_t head_us;          /* final norm + lm_head */
  uint64_t expert_bytes_read;/* bytes of the distinct experts each step activated, summed */
  uint64_t dense_bytes_read; /* dense bytes read, summed over steps */
  gc_layer_stats *layer;     /* [num_layers], owned by the model */
} gc_model_stats;
/* Copies the totals, the per-layer ones included (layer points to a copy kept by the
 * model, valid until the next call or close) and, with reset, zeroes them all. */
void gc_model_stats_get(gc_model *m, gc_model_stats *out, bool reset);
/* Writes the client's metrics in Prometheus text (docs/DESIGN.md 3.7): steps, tokens,
 * generated tokens, local expert slots, step-time and layer-RPC histograms, and per server
 * (label server) requests, replies, errors, timeouts, bytes and mean RTT. Any thread while
 * m is open (what the stepping thread writes is read through atomics, the per-server
 * counters under their stream's lock); for the --metrics-listen responder. Never reset. */
void gc_model_metrics_render(gc_model *m, mr_buf *p);

/* ---- live placement (docs/DESIGN.md section 15) -------------------------------------------
 *
 * With opts.watch_placement, gc_model_step first looks at the placement file (one stat): if
 * its inode, size or mtime changed and its bytes differ, it parses it, refuses it if its
 * local (hot) experts differ from the active ones (the runner cannot load hot experts while
 * running), opens a new cluster with its routing (a fresh Hello of every server: every
 * routed pair must be announced by its server, every pair covered) and, only if all that
 * passed, swaps it in and closes the old one: between two steps, with no call in flight.
 * A file that fails is logged and ignored (the active placement stays) until it changes
 * again. */
typedef struct gc_model_placement {
  bool watching;
  uint64_t generation;  /* 1 = the file opened with, +1 per switch */
  uint64_t hash;        /* FNV-1a 64 of the active file's bytes (0 without a placement file) */
  double switched_at;   /* Unix time of the last switch (of the open for generation 1) */
  uint64_t rejected;    /* changed files refused */
  char error[512];      /* why the last one was refused, "" when the last change switched */
} gc_model_placement;
/* Any thread while m is open. */
void gc_model_placement_get(gc_model *m, gc_model_placement *out);
/* GET /placement of --metrics-listen: {"file", "watching", "generation", "hash" (16 hex
 * digits), "switched_at", "rejected", "last_error"} as one JSON object. Any thread. */
void gc_model_placement_render(gc_model *m, mr_buf *p);

/* ---- generation -------------------------------------------------------------------------- */

typedef struct gc_sampling {
  float temperature; /* 0 = greedy (argmax, ties to the lower id) */
  float top_p;       /* nucleus mass in (0, 1]; 1 = off */
  uint32_t top_k;    /* keep the k most likely before top_p; 0 = off */
  uint64_t seed;     /* PRNG seed; sequence b uses a stream derived from (seed, b) */
} gc_sampling;
typedef struct gc_gen_timing {
  uint64_t prefill_us, decode_us;
  uint64_t prefill_tokens, decode_tokens;
} gc_gen_timing;
/* Generates max_new tokens after each of the n prompts (prompt b: lens[b] ids at
 * prompts[b]), n <= max_batch, every prompt + max_new <= max_seq. All prompts are
 * prefilled in one step, then one decode step per new token for all sequences. out gets
 * [n, max_new] ids. Resets the KV slots 0..n-1 first. */
int gc_model_generate(gc_model *m, uint32_t n, const int32_t *const *prompts,
                      const uint32_t *lens, uint32_t max_new, const gc_sampling *smp,
                      int32_t *out, gc_gen_timing *t, mr_err *e);
/* Picks the next id from logits[vocab] (temperature, top_k, top_p as above; state: the
 * caller's PRNG, advanced by one draw when sampling; gc_sample.c). smp NULL = greedy. */
int32_t gc_sample(const float *logits, uint32_t vocab, const gc_sampling *smp, uint64_t *state);
typedef struct gc_logprob {
  int32_t id;
  float logprob;
} gc_logprob;
/* Log-softmax of logits[vocab] at temperature 1: *chosen_lp (may be NULL) gets chosen's, and
 * top[0..n_top) the n_top most likely ids, best first (ties to the lower id). MR_ENOMEM. */
int gc_logprobs(const float *logits, uint32_t vocab, int32_t chosen, uint32_t n_top, gc_logprob *top,
                float *chosen_lp);

#ifdef __cplusplus
}
#endif
#endif /* GC_MODEL_H */
