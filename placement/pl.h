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

#include "../common/mr.h"

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

/* ---- plan ---- */

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

/* ---- simulate ---- */

#ifdef __cplusplus
}
#endif
#endif /* PL_H */
