/*
 * pl.h - placement/: the one public header of the placement module (prefix pl_).
 *
 * Which (layer, expert) pairs the client computes (the hot ones, on the GPU) and which expert
 * server computes each of the others. The module gathers routing statistics, plans
 * placements from them, compares and applies placements to a running cluster and simulates
 * their throughput; `moerpc-place` (placement/main.c) is its command-line face, one
 * subcommand per section below (placement/README.md, docs/DESIGN.md sections 13-16).
 *
 * Layers: placement/ sits above common/ and gpu_client/ (it talks to servers through
 * libmoerpc-client); nothing below it includes this header.
 *
 * Errors: every function returning int returns 0 or a negative MR_E* code (common/mr.h) and
 * fills the caller's mr_err (may be NULL) with a message naming the file, the field and the
 * limit.
 */
#ifndef PL_H
#define PL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/mr.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- stats ------------------------------------------------------------------------------
 * Routing statistics: tokens routed to each (layer, expert), one per token per selected
 * expert (a "slot"), local experts included. The file "moerpc-stats" version 1:
 *
 *   {"format": "moerpc-stats", "version": 1,
 *    "model_fingerprint": "0123456789abcdef",      "" when unknown (an SGLang import)
 *    "num_layers": 48, "num_experts": 128,         the model's (dense layers = rows of 0)
 *    "window": {"kind": "steps"|"since_reset"|"import", "steps": 512, "tokens": 4096,
 *               "seconds": 12.5},
 *    "sources": ["client", "s0"],                  informative: where the counts came from
 *    "counts": [[...num_experts integers...], ... num_layers rows]}
 *
 * Limits: num_layers 1..MR_MAX_LAYERS, num_experts 1..PL_STATS_MAX_EXPERTS, at most
 * PL_STATS_MAX_PAIRS pairs, counts and window.steps/tokens integers 0..2^53, window.seconds
 * a finite number >= 0, at most PL_STATS_MAX_SOURCES sources of 1..63 characters, a
 * fingerprint of at most 63 characters. "format", "version", "num_layers", "num_experts",
 * "window" (with "kind") and "counts" are required; the rest default to ""/0/none.
 * Unknown and duplicate keys, wrong types and a counts shape other than num_layers rows of
 * num_experts numbers are errors naming the file, the field and the limit.
 */
#define PL_STATS_FORMAT "moerpc-stats"
#define PL_STATS_VERSION 1u
#define PL_STATS_MAX_EXPERTS 65536u
#define PL_STATS_MAX_PAIRS (1u << 22)
#define PL_STATS_MAX_SOURCES 64u

typedef struct pl_stats {
  uint32_t num_layers, num_experts;
  char model_fingerprint[64];
  char window_kind[16];              /* "steps", "since_reset" or "import" */
  uint64_t steps, tokens;
  double seconds;
  uint32_t n_sources;
  char sources[PL_STATS_MAX_SOURCES][64];
  uint64_t *counts;                  /* [num_layers * num_experts], owned */
} pl_stats;

/* An empty (all-zero counts) stats of L x E, window kind "since_reset"; MR_ERANGE beyond the
 * limits above. Release with pl_stats_close. */
int pl_stats_init(pl_stats *s, uint32_t num_layers, uint32_t num_experts, mr_err *e);
/* Parses len bytes of a moerpc-stats file; label names it in messages (a path). On failure
 * *s is left empty (pl_stats_close is still allowed). */
int pl_stats_parse(pl_stats *s, const char *json, size_t len, const char *label, mr_err *e);
/* Reads and parses path (a regular file of at most MR_JSON_MAX_BYTES). */
int pl_stats_load(pl_stats *s, const char *path, mr_err *e);
/* The file's text (one row of counts per line, ending in a newline) in *out, which the
 * caller frees with mr_free; *len its length. */
int pl_stats_format(const pl_stats *s, char **out, size_t *len, mr_err *e);
/* Writes the file atomically: path.tmp.PID, then rename over path. */
int pl_stats_save(const pl_stats *s, const char *path, mr_err *e);
/* Adds src's counts, steps and tokens into dst (seconds: the larger) and appends src's
 * sources not yet listed; the shapes must match (MR_EINVAL naming both). */
int pl_stats_add(pl_stats *dst, const pl_stats *src, mr_err *e);
/* Appends a source name unless it is listed already (MR_ERANGE past PL_STATS_MAX_SOURCES
 * or 63 characters). */
int pl_stats_source_add(pl_stats *s, const char *name, mr_err *e);
/* Sum of all counts. */
uint64_t pl_stats_total(const pl_stats *s);
void pl_stats_close(pl_stats *s);

/* `moerpc-place stats`: collect and merge statistics of a running cluster (pl_collect.c). */
int pl_cmd_stats(int argc, char **argv);

/* ---- plan ----
 *
 * A plan decides, for every (layer, expert) pair of the MoE layers, whether the client
 * computes it ("local", the hot set on the GPU) or which host(s) hold it, from token
 * counts per pair (moerpc-stats), the model's shapes, the weight format and the cluster's
 * capacities and speeds. Expected load of a host = sum over its pairs of
 * tokens(pair) / copies(pair) x bytes of one expert on that host / host speed; the
 * imbalance is max / mean over the hosts. See docs/DESIGN.md section 14.
 */
#define PL_MAX_REPLICAS 16u /* most copies of one cold pair (--replicas) */

typedef enum pl_strategy {
  PL_STRATEGY_BALANCED = 0, /* hot by frequency; cold LPT + local search + replicas */
  PL_STRATEGY_UNIFORM,      /* kt-kernel "uniform": N / moe_layers GPU experts per layer */
  PL_STRATEGY_FREQUENCY,    /* kt-kernel "frequency": global top-N by count */
  PL_STRATEGY_FRONT_LOADING,/* kt-kernel "front-loading": fill layers from the first */
  PL_STRATEGY_RANDOM,       /* kt-kernel "random": N random pairs (--seed, default 42) */
  PL_STRATEGY_COUNT
} pl_strategy;
/* "balanced", "uniform", ... ; returns 0 or MR_EINVAL. */
int pl_strategy_parse(const char *s, pl_strategy *out);
const char *pl_strategy_name(pl_strategy s);

/* Weight formats as the servers store them (kernels/internal.h section A). */
typedef enum pl_wformat {
  PL_WF_BF16 = 0, PL_WF_F16, PL_WF_F32, PL_WF_INT8,
  PL_WF_INT4_G32, PL_WF_INT4_G64, PL_WF_INT4_G128,
  PL_WF_FP8_B128, /* 1 byte a weight + one f32 scale per 128 x 128 block */
  PL_WF_COUNT
} pl_wformat;
/* "bf16", "f16", "f32", "int8", "int4-g32", "int4-g64", "int4-g128", "fp8-b128". */
int pl_wformat_parse(const char *s, pl_wformat *out);
const char *pl_wformat_name(pl_wformat f);
/* Bytes one routed expert (gate, up [I][H], down [H][I]) takes in format f when the server
 * splits it over n_slices NUMA nodes: the kernels' packed layout, each array of each slice
 * 64-byte aligned, slices cut at 32 intermediate rows (the int4 group when larger; 128 for
 * fp8). n_slices 0 is taken as 1. */
uint64_t pl_expert_bytes(pl_wformat f, uint32_t hidden, uint32_t inter, uint32_t n_slices);

typedef struct pl_host {
  char name[64];
  uint64_t capacity;   /* bytes for expert weights; 0 = unbounded */
  uint32_t numa_nodes; /* slices per expert, >= 1 */
  double speed;        /* relative kernel throughput, > 0 */
} pl_host;

typedef struct pl_problem {
  uint32_t num_layers, num_experts;
  const uint8_t *is_moe;        /* [num_layers]: 1 = has routed experts (others get nothing) */
  const uint64_t *counts;       /* [L * E] tokens per pair, or NULL: every pair 1 (uniform) */
  uint32_t hidden, inter;       /* the model's H and moe_intermediate I */
  pl_wformat format;
  uint32_t n_hosts;             /* 1..MR_PLACEMENT_MAX_SERVERS */
  const pl_host *hosts;
  uint64_t gpu_bytes;           /* the client's budget for hot experts (bytes, format f, 1 slice) */
  uint32_t replicas;            /* most copies of a cold pair, 1..PL_MAX_REPLICAS (0 = 1) */
  const mr_placement *current;  /* optional: the placement in use (same L, E) */
  uint64_t seed;                /* for "random" */
  pl_strategy strategy;
  double tolerance;             /* with current: keep it unless the fresh plan's expected step
                                   load is lower by more than this fraction (e.g. 0.02) */
  char model_fingerprint[64];   /* copied into the plan ("" = unknown) */
} pl_problem;

typedef struct pl_plan {
  uint32_t num_layers, num_experts, n_hosts, max_copies;
  char model_fingerprint[64];
  char host_name[MR_PLACEMENT_MAX_SERVERS][64];
  uint8_t *local;            /* [L * E] 1 = the client computes it */
  uint8_t *ncopy;            /* [L * E] hosts holding the pair (0: local or dense layer) */
  uint16_t *host;            /* [L * E * max_copies]: the first ncopy[i] entries of pair i */
  /* Figures (all expected, from the counts). Loads are in byte-tokens per unit speed. */
  uint64_t n_local, gpu_bytes_used, n_extra_copies;
  uint64_t host_bytes[MR_PLACEMENT_MAX_SERVERS];     /* bytes held after the plan */
  double host_load[MR_PLACEMENT_MAX_SERVERS];        /* after */
  double host_load_before[MR_PLACEMENT_MAX_SERVERS]; /* the current placement, or uniform */
  double imbalance_before, imbalance_after;          /* max / mean host load */
  double step_before, step_after;  /* sum over layers of the busiest host's load (a step's
                                      critical path when layers run one after another) */
  bool before_is_current;          /* "before" is --current (else the uniform plan) */
  bool kept_current;               /* --current: the plan was built from it (fewest moves) */
  uint64_t bytes_in[MR_PLACEMENT_MAX_SERVERS];  /* to load on each host (all without current) */
  uint64_t bytes_out[MR_PLACEMENT_MAX_SERVERS]; /* to drop */
  uint64_t gpu_in, gpu_out;                     /* local pairs gained / lost, in bytes */
} pl_plan;

/* Builds a plan. Errors (MR_EINVAL / MR_ERANGE / MR_EMISMATCH / MR_ENOSPC-like MR_ERANGE)
 * name the field and the limit: counts on a dense layer, a current placement of another
 * shape or naming a host not in hosts[], and a plan that cannot fit ("cold experts need N
 * bytes, the hosts have M"). On success *out is a new plan the caller frees with
 * pl_plan_free. Deterministic for the same problem (seed included); single-threaded. */
int pl_plan_make(const pl_problem *pb, pl_plan **out, mr_err *e);
void pl_plan_free(pl_plan *p); /* NULL is a no-op */
/* The plan as a moerpc-placement v1 JSON text (NUL-terminated, caller frees with mr_free):
 * every MoE layer with its "local" set and "remote" {host: set}; a pair with k copies is
 * listed under k hosts. */
int pl_plan_json(const pl_plan *p, char **out, mr_err *e);
/* Writes pl_plan_json to path atomically (path.tmp.PID + rename) when path is a regular file
 * or does not exist; in place when it is anything else (a device such as /dev/null, a FIFO,
 * a symlink), which a rename would replace; to stdout when path is "-". */
int pl_plan_write(const pl_plan *p, const char *path, mr_err *e);

/* `moerpc-place plan ...` and `moerpc-place diff A B ...` (exit 0 ok, 1 failure, 2 usage). */
int pl_cmd_plan(int argc, char **argv);
int pl_cmd_diff(int argc, char **argv);
/* ---- end plan ---- */

/* ---- apply ------------------------------------------------------------------------------
 * `moerpc-place apply` (pl_apply.c, docs/DESIGN.md section 15): applies a placement file
 * to a running cluster through the control RPCs (LoadExperts, LoadStatus, UnloadExperts) and
 * the clients' --watch-placement. The pure part, for tests: */
typedef struct pl_apply_plan {
  uint32_t n_servers, num_layers, num_experts;
  uint8_t *want;            /* [n_servers][L * E]: the plan puts (l, x) on server s */
  uint8_t *add, *drop;      /* same shape: to load (wanted, not owned), to unload (owned,
                             * not wanted) */
  uint64_t *n_add, *n_drop; /* [n_servers] */
} pl_apply_plan;
/* Computes ap from a plan (single-server form: route[] per pair), the cluster file (server
 * names, in file order) and what each server owns now (owned[s][L * E], 1 = announced in its
 * Hello). Refuses, naming label (the plan's path): a plan server not in the cluster file
 * (MR_ENOTFOUND); a pair of a served layer (one a server owns something in, or the plan
 * places something in) that is neither local nor on a server (MR_EPRECOND "layer 3: experts
 * 4-7 are neither local nor on a server"); with free_bytes ([n_servers], may be NULL), a
 * server that must load more than n_add * expert_bytes fits (MR_EEXHAUSTED naming server,
 * bytes needed and free). On error ap is empty. Release with pl_apply_plan_close. */
int pl_apply_prepare(pl_apply_plan *ap, const mr_placement *plan, const mr_cluster_file *cf,
                     const uint8_t *owned, const uint64_t *free_bytes, uint64_t expert_bytes,
                     const char *label, mr_err *e);
void pl_apply_plan_close(pl_apply_plan *ap);
/* FNV-1a 64 of a placement file's bytes: what a client's GET /placement reports as "hash"
 * (16 hex digits; gpu_client/gc_model.c computes the same). */
uint64_t pl_placement_hash(const void *bytes, size_t len);
/* `moerpc-place apply`. */
int pl_cmd_apply(int argc, char **argv);

/* ---- simulate ---------------------------------------------------------------------------
 * `moerpc-place simulate` (pl_sim.c): decode and prefill tokens/s of a placement on N hosts
 * from measured inputs, and the bottleneck. The model (docs/DESIGN.md section 16):
 *
 *   per MoE layer and sampled step (routing drawn from the stats, or uniform):
 *     host h:  t_h = bytes_h / rate_h(u_h)  +  rpc_fixed + rpc_per_byte * wire_h
 *                    + wire_h / link_h + latency_h          (bytes_h: its distinct activated
 *                                                           experts x bytes per expert)
 *     remote = max_h t_h (fan-out in parallel), at least wire bytes / the client's link
 *     hot    = the client's own experts, bytes / client rate
 *     layer  = max(hot, remote)          the runner's overlap (cold slots sent first)
 *            = hot + remote              --shared-cores: the hosts run on the client's cores
 *   step = client's non-expert time + sum over MoE layers; decode tok/s = B / step.
 *
 * Rates: weight GB/s of moerpc-bench-kernels lines, interpolated over u = slots / activated
 * experts (tokens per expert) of the call, so that one table serves decode (u ~ 1) and
 * prefill (u ~ T k / E). */

/* Kernel throughput of one host: moerpc-bench-kernels --json lines of one format. */
#define PL_RATES_MAX 64u
typedef struct pl_rate_point {
  double u;       /* tokens per activated expert of the bench call */
  double gbps;    /* weight bytes read / time, GB/s (1e9 bytes) */
  uint32_t tokens; /* the bench line's T */
} pl_rate_point;
typedef struct pl_rates {
  uint32_t n;     /* points, sorted by u; 1..PL_RATES_MAX */
  uint32_t threads;
  pl_rate_point pt[PL_RATES_MAX];
} pl_rates;
/* Reads the JSON lines of `moerpc-bench-kernels --json` (text of len bytes; lines not
 * starting with '{' and lines with a "mode" ("linear", "selftest") are skipped) and keeps those of `format`
 * ("bf16", "int8", "int4" (any group), "int4-g64", ...; NULL = every format). Required per
 * line: format, tokens (1..2^31), top_k (>= 1), experts_pool (>= 1), threads, weight_gbps
 * (> 0, finite); a missing or bad field is MR_EFORMAT / MR_ERANGE naming label, the line
 * and the field. For several lines of one T the fastest is kept (best ISA). No line of the
 * format: MR_ENOTFOUND. */
int pl_rates_parse(pl_rates *r, const char *text, size_t len, const char *format,
                   const char *label, mr_err *e);
int pl_rates_load(pl_rates *r, const char *path, const char *format, mr_err *e);
/* GB/s at u tokens per expert: log-linear between points, clamped at both ends. */
double pl_rates_gbps(const pl_rates *r, double u);

/* RPC cost: a request costs fixed_us + per_byte_us * (request + reply bytes), on top of the
 * server's compute and of the link. */
typedef struct pl_rpc_cost {
  double fixed_us;
  double per_byte_us;
  uint32_t n_lines;
} pl_rpc_cost;
/* Fits pl_rpc_cost to `moerpc-client bench-rpc --json` lines ("bench": "rpc"; required:
 * tokens, req_bytes, reply_bytes, grpc_p50_us, server_compute_us_p50, all >= 0): least
 * squares of (grpc_p50_us - server_compute_us_p50) over req_bytes + reply_bytes; a negative
 * slope (noise) becomes 0 with the mean as the fixed cost. */
int pl_rpc_parse(pl_rpc_cost *c, const char *text, size_t len, const char *label, mr_err *e);
int pl_rpc_load(pl_rpc_cost *c, const char *path, mr_err *e);

/* The client's own time, from an all-local `moerpc-client bench --json` ("bench": "model"
 * line: step_ms, prefill_tok_s, batch, prompt_len, threads, servers = 0; "model-layer"
 * lines: layer, moe, local_us, summed into expert_us for information: the command takes
 * the experts out of step_us with the model itself, see step_client_other in pl_sim.c). */
typedef struct pl_client_bench {
  double step_us;          /* decode step, all-local */
  double expert_us;        /* of which the experts (sum of local_us over MoE layers) */
  double prefill_tok_s;
  uint32_t batch, prompt_len, threads, layers;
} pl_client_bench;
int pl_client_bench_parse(pl_client_bench *b, const char *text, size_t len, const char *label,
                          mr_err *e);
int pl_client_bench_load(pl_client_bench *b, const char *path, mr_err *e);

/* One host of the simulation. */
typedef struct pl_sim_host {
  char name[64];
  const pl_rates *rates; /* kernel throughput (borrowed) */
  double speed;          /* multiplies the rates (the cluster file's "speed"), > 0 */
  double link_gbps;      /* Gbit/s of its link, 0 = no link cost */
  double link_latency_us; /* one-way latency added once per call (request + reply: 2x) */
} pl_sim_host;

#define PL_SIM_MAX_HOSTS 256u
typedef struct pl_sim_input {
  /* model shapes */
  uint32_t hidden, inter, num_experts, top_k, num_layers;
  const uint8_t *is_moe;        /* [num_layers], NULL = every layer */
  double expert_bytes;          /* bytes of one expert as the servers store it */
  double wire_bytes;            /* bytes per hidden-state element on the wire (bf16: 2) */
  /* routing: counts [num_layers * num_experts] (a layer of zeros = uniform), NULL = uniform */
  const uint64_t *counts;
  /* placement: local [L * E] (1 = the client computes it), route [L * E] host index or -1
   * (several copies or unrouted: each sampled slot goes to the least-loaded host so far) */
  const uint8_t *local;         /* NULL = nothing local */
  const int32_t *route;         /* NULL = every pair -1 */
  const uint32_t *rep_off;      /* NULL, or [L * E + 1]: a replicated pair's hosts are */
  const int32_t *rep;           /* rep[rep_off[p] .. rep_off[p + 1]) (mr_placement's lists) */
  uint32_t n_hosts;             /* 0..PL_SIM_MAX_HOSTS (0: all local) */
  const pl_sim_host *hosts;
  const pl_rates *client_rates; /* the client's expert throughput (hot experts; all-local) */
  pl_rpc_cost rpc;
  double client_link_gbps;      /* the client's own link (all hosts' bytes), 0 = none */
  /* the client's own time per step besides the experts */
  double decode_other_us;       /* per decode step */
  double prefill_other_us;      /* per prefill step of batch x prompt_len tokens; < 0: unknown */
  uint32_t batch, prompt_len, max_deferred;
  bool shared_cores;            /* hosts and client on the same cores: their work serializes */
  uint32_t samples;             /* sampled steps per MoE layer (decode; prefill uses 1/8) */
  uint64_t seed;
} pl_sim_input;

/* Where the time of a step goes. Component 0 is the client, 1 the link (transfer, latency
 * and the RPC cost), 2 + h host h. */
typedef struct pl_sim_phase {
  double step_us;               /* one step */
  double tok_s;                 /* batch (decode) or batch x prompt_len (prefill) / step */
  double *share;                /* [2 + n_hosts] fraction of step_us, sums to 1 (owned) */
  double *host_busy_us;         /* [n_hosts] compute per step, mean (owned) */
  double *layer_us;             /* [num_layers] MoE part per layer (0 for dense) (owned) */
  int bottleneck;               /* component index with the largest share */
  double imbalance;             /* max / mean of host_busy_us (1 = even; 0 with no host) */
} pl_sim_phase;
typedef struct pl_sim_result {
  pl_sim_phase decode, prefill; /* prefill.step_us < 0 when prefill_other_us is unknown */
  uint32_t n_hosts;
} pl_sim_result;
/* Runs the model; deterministic for a seed. Errors: MR_EINVAL naming the field (shapes
 * out of range, a host without rates, a speed <= 0, route >= n_hosts, a non-local pair
 * with no host), MR_ENOMEM. Release r with pl_sim_result_close (also after a failure). */
int pl_sim_run(const pl_sim_input *in, pl_sim_result *r, mr_err *e);
void pl_sim_result_close(pl_sim_result *r);
/* "client", "link" or the host's name, for component c of a result of in. */
const char *pl_sim_component_name(const pl_sim_input *in, int c);
/* Bytes of one expert (gate, up, down) in a weight format as the servers pack it:
 * "f32", "f16", "bf16", "int8" (fp32 scale per row), "int4[-gG]" (fp32 scale per group
 * of G, default 64), "fp8" (e4m3 with a fp32 scale per 128 x 128 block, DeepSeek-V3's).
 * Returns 0 for an unknown format. */
double pl_sim_expert_bytes(const char *format, uint32_t hidden, uint32_t inter);

/* `moerpc-place simulate` (pl_sim.c). */
int pl_cmd_simulate(int argc, char **argv);

#ifdef __cplusplus
}
#endif
#endif /* PL_H */
