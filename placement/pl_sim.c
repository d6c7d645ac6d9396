/*
 * pl_sim.c - `moerpc-place simulate`: decode and prefill tokens/s of a placement on N hosts
 * from measured inputs (pl.h, "simulate"; docs/DESIGN.md section 16).
 *
 * Three parts: the readers of the measured inputs (JSON lines of moerpc-bench-kernels,
 * moerpc-client bench-rpc and moerpc-client bench), the model (pl_sim_run: routing sampled
 * per MoE layer, each host's time, the runner's overlap and deferral) and the command.
 * The model's formulas, with their units and what they leave out, head its section below.
 */
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "common/mr.h"
#include "placement/internal.h"

#define PROG "moerpc-place simulate"
/* The JSON-lines inputs are a few KB; this is only a bound against a wrong file. */
#define SIM_INPUT_MAX_BYTES ((size_t)64 << 20)
#define SIM_LINE_MAX 65536u

/* ---- JSON lines ----------------------------------------------------------------------- */

/* Calls fn for every line of text that starts with '{' (after blanks); other lines (the
 * human tables some tools print on stdout too) are skipped. fn gets the parsed object and
 * the 1-based line number; its non-zero return stops the walk. */
typedef int (*line_fn)(void *ctx, const cJSON *o, unsigned line, const char *label, mr_err *e);
static int json_lines(const char *text, size_t len, const char *label, line_fn fn, void *ctx,
                      mr_err *e) {
  size_t i = 0;
  unsigned line = 0;
  while (i < len) {
    size_t j = i;
    while (j < len && text[j] != '\n') j++;
    line++;
    size_t a = i;
    while (a < j && (text[a] == ' ' || text[a] == '\t' || text[a] == '\r')) a++;
    if (a < j && text[a] == '{') {
      if (j - a > SIM_LINE_MAX)
        return mr_err_set(e, MR_ERANGE, "%s: line %u: %zu bytes, at most %u", label, line,
                          j - a, SIM_LINE_MAX);
      char where[160];
      snprintf(where, sizeof where, "%s: line %u", label, line);
      cJSON *o = NULL;
      int rc = mr_json_parse_object(text + a, j - a, where, &o, e);
      if (rc) return rc;
      rc = fn(ctx, o, line, label, e);
      cJSON_Delete(o);
      if (rc) return rc;
    }
    i = j + 1;
  }
  return 0;
}

/* A required finite number >= lo (and > lo when strict). */
static int num_field(const cJSON *o, const char *field, double lo, bool strict, unsigned line,
                     const char *label, double *out, mr_err *e) {
  const cJSON *it = cJSON_GetObjectItemCaseSensitive(o, field);
  char desc[96];
  if (!cJSON_IsNumber(it)) {
    mr_json_describe(it, desc, sizeof desc);
    return mr_err_set(e, MR_EFORMAT, "%s: line %u: %s = %s, must be a number %s %g", label, line,
                      field, desc, strict ? ">" : ">=", lo);
  }
  double d = it->valuedouble;
  if (!isfinite(d) || d < lo || (strict && d == lo))
    return mr_err_set(e, MR_ERANGE, "%s: line %u: %s = %.17g, must be a finite number %s %g",
                      label, line, field, d, strict ? ">" : ">=", lo);
  *out = d;
  return 0;
}

static int int_field(const cJSON *o, const char *field, uint64_t lo, uint64_t hi, unsigned line,
                     const char *label, uint64_t *out, mr_err *e) {
  char f[96];
  snprintf(f, sizeof f, "line %u: %s", line, field);
  return mr_json_u64(cJSON_GetObjectItemCaseSensitive(o, field), label, f, lo, hi, out, e);
}

static const char *str_field(const cJSON *o, const char *field) {
  const cJSON *it = cJSON_GetObjectItemCaseSensitive(o, field);
  return cJSON_IsString(it) ? it->valuestring : NULL;
}


/* ---- kernel rates --------------------------------------------------------------------- */

typedef struct rates_ctx {
  pl_rates *r;
  const char *format; /* NULL = any */
} rates_ctx;

/* "int4-g64" matches format "int4" with group 64; "int4" any group. */
static bool format_matches(const char *want, const char *fmt, uint64_t group) {
  if (!want) return true;
  if (strcmp(want, "fp8") == 0 || strcmp(want, "fp8-b128") == 0) /* the kernels' name */
    return strcmp(fmt, "fp8-b128") == 0;
  const char *dash = strchr(want, '-');
  size_t n = dash ? (size_t)(dash - want) : strlen(want);
  if (strlen(fmt) != n || strncmp(want, fmt, n) != 0) return false;
  if (!dash) return true;
  unsigned g = 0;
  return sscanf(dash, "-g%u", &g) == 1 && g == group;
}

/* Expected distinct experts of a call of T tokens drawing k of E uniformly each: an expert
 * is missed by one token with probability 1 - k/E, by all T with (1 - k/E)^T. A bench line
 * measures a call of T tokens over a pool of E experts, so its u (tokens of work per expert
 * read) is T k / expected_active(T, k, E). */
static double expected_active(double T, double k, double E) {
  if (k >= E) return E;
  return E * (1.0 - pow(1.0 - k / E, T));
}

static int rates_line(void *ctx, const cJSON *o, unsigned line, const char *label, mr_err *e) {
  rates_ctx *c = ctx;
  const char *mode = str_field(o, "mode");
  if (mode) return 0; /* "linear" (dense layers), "selftest" (start-up cost): not expert rates */
  const char *fmt = str_field(o, "format");
  if (!fmt) {
    char desc[96];
    mr_json_describe(cJSON_GetObjectItemCaseSensitive(o, "format"), desc, sizeof desc);
    return mr_err_set(e, MR_EFORMAT, "%s: line %u: format = %s, must be a string (a "
                      "moerpc-bench-kernels --json line)", label, line, desc);
  }
  uint64_t T, k, pool, threads, group = 0;
  double gbps;
  int rc;
  if ((rc = int_field(o, "tokens", 1, 1u << 31, line, label, &T, e)) ||
      (rc = int_field(o, "top_k", 1, 65536, line, label, &k, e)) ||
      (rc = int_field(o, "experts_pool", 1, 65536, line, label, &pool, e)) ||
      (rc = int_field(o, "threads", 1, 65536, line, label, &threads, e)) ||
      (rc = num_field(o, "weight_gbps", 0, true, line, label, &gbps, e)))
    return rc;
  if (k > pool)
    return mr_err_set(e, MR_ERANGE, "%s: line %u: top_k = %llu, must be <= experts_pool %llu",
                      label, line, (unsigned long long)k, (unsigned long long)pool);
  const cJSON *g = cJSON_GetObjectItemCaseSensitive(o, "group");
  if (g && (rc = int_field(o, "group", 0, 65536, line, label, &group, e))) return rc;
  if (!format_matches(c->format, fmt, group)) return 0;
  pl_rates *r = c->r;
  if (r->n && r->threads != threads)
    return mr_err_set(e, MR_EINVAL, "%s: line %u: threads = %llu, but earlier lines have %u "
                      "(one file per thread count: one host)", label, line,
                      (unsigned long long)threads, r->threads);
  r->threads = (uint32_t)threads;
  double u = (double)T * (double)k / expected_active((double)T, (double)k, (double)pool);
  for (uint32_t i = 0; i < r->n; i++)
    if (r->pt[i].tokens == T) { /* another ISA or repeat: keep the fastest */
      if (gbps > r->pt[i].gbps) r->pt[i].gbps = gbps;
      return 0;
    }
  if (r->n == PL_RATES_MAX)
    return mr_err_set(e, MR_ERANGE, "%s: line %u: more than %u token counts", label, line,
                      PL_RATES_MAX);
  r->pt[r->n++] = (pl_rate_point){.u = u, .gbps = gbps, .tokens = (uint32_t)T};
  return 0;
}

static int cmp_point(const void *a, const void *b) {
  double x = ((const pl_rate_point *)a)->u, y = ((const pl_rate_point *)b)->u;
  return x < y ? -1 : x > y;
}

int pl_rates_parse(pl_rates *r, const char *text, size_t len, const char *format,
                   const char *label, mr_err *e) {
  memset(r, 0, sizeof *r);
  rates_ctx c = {.r = r, .format = format};
  int rc = json_lines(text, len, label, rates_line, &c, e);
  if (rc) {
    memset(r, 0, sizeof *r);
    return rc;
  }
  if (r->n == 0)
    return mr_err_set(e, MR_ENOTFOUND, "%s: no moerpc-bench-kernels line of format %s", label,
                      format ? format : "(any)");
  qsort(r->pt, r->n, sizeof r->pt[0], cmp_point);
  return 0;
}

static int rates_parse_cb(void *ctx, const char *text, size_t len, const char *path, mr_err *e) {
  rates_ctx *c = ctx;
  return pl_rates_parse(c->r, text, len, c->format, path, e);
}

int pl_rates_load(pl_rates *r, const char *path, const char *format, mr_err *e) {
  memset(r, 0, sizeof *r);
  rates_ctx c = {r, format};
  return mr_file_parse(path, SIM_INPUT_MAX_BYTES, rates_parse_cb, &c, e);
}

/* Log-linear (log GB/s against log u) between the two points around u: throughput grows
 * roughly as a power of u between the memory-bound end (u ~ 1: each weight byte read serves
 * one token) and the compute-bound end (large u), and a power law is a straight line in
 * log-log. Outside the measured range the nearest point: no extrapolation. */
double pl_rates_gbps(const pl_rates *r, double u) {
  MR_ASSERT(r && r->n > 0);
  if (u <= r->pt[0].u || r->n == 1) return r->pt[0].gbps;
  if (u >= r->pt[r->n - 1].u) return r->pt[r->n - 1].gbps;
  uint32_t i = 1;
  while (r->pt[i].u < u) i++;
  const pl_rate_point *a = &r->pt[i - 1], *b = &r->pt[i];
  if (b->u <= a->u) return b->gbps;
  double f = (log(u) - log(a->u)) / (log(b->u) - log(a->u));
  return exp(log(a->gbps) + f * (log(b->gbps) - log(a->gbps)));
}

/* ---- RPC cost ------------------------------------------------------------------------- */

typedef struct rpc_ctx {
  double sx, sy, sxx, sxy;
  uint32_t n;
} rpc_ctx;

static int rpc_line(void *ctx, const cJSON *o, unsigned line, const char *label, mr_err *e) {
  rpc_ctx *c = ctx;
  const char *b = str_field(o, "bench");
  if (!b || strcmp(b, "rpc") != 0) return 0;
  uint64_t T;
  double req, rep, p50, comp;
  int rc;
  if ((rc = int_field(o, "tokens", 1, 1u << 31, line, label, &T, e)) ||
      (rc = num_field(o, "req_bytes", 0, false, line, label, &req, e)) ||
      (rc = num_field(o, "reply_bytes", 0, false, line, label, &rep, e)) ||
      (rc = num_field(o, "grpc_p50_us", 0, false, line, label, &p50, e)) ||
      (rc = num_field(o, "server_compute_us_p50", 0, false, line, label, &comp, e)))
    return rc;
  double x = req + rep, y = p50 > comp ? p50 - comp : 0;
  c->sx += x;
  c->sy += y;
  c->sxx += x * x;
  c->sxy += x * y;
  c->n++;
  return 0;
}

/* Ordinary least squares of y = round trip - server compute (us: what the RPC itself costs,
 * client and server gRPC, serialisation, loopback or wire) over x = request + reply bytes:
 * slope = cov(x, y) / var(x), fixed = mean(y) - slope x mean(x). One line (or lines of one
 * size: var(x) ~ 0) and a negative slope (noise) give slope 0 and the mean as the fixed
 * cost; a negative fixed cost puts it all in the per-byte part. */
int pl_rpc_parse(pl_rpc_cost *cost, const char *text, size_t len, const char *label, mr_err *e) {
  memset(cost, 0, sizeof *cost);
  rpc_ctx c = {0};
  int rc = json_lines(text, len, label, rpc_line, &c, e);
  if (rc) return rc;
  if (c.n == 0)
    return mr_err_set(e, MR_ENOTFOUND, "%s: no \"bench\": \"rpc\" line (moerpc-client "
                      "bench-rpc --json)", label);
  double n = c.n, mx = c.sx / n, my = c.sy / n;
  double vx = c.sxx / n - mx * mx;
  double slope = vx > 1e-9 * (mx * mx + 1) ? (c.sxy / n - mx * my) / vx : 0;
  if (slope < 0) slope = 0;
  cost->per_byte_us = slope;
  cost->fixed_us = my - slope * mx;
  if (cost->fixed_us < 0) { /* a steep fit through noise: keep the per-byte part */
    cost->fixed_us = 0;
    cost->per_byte_us = mx > 0 ? my / mx : 0;
  }
  cost->n_lines = c.n;
  return 0;
}

static int rpc_parse_cb(void *ctx, const char *text, size_t len, const char *path, mr_err *e) {
  return pl_rpc_parse(ctx, text, len, path, e);
}

int pl_rpc_load(pl_rpc_cost *c, const char *path, mr_err *e) {
  memset(c, 0, sizeof *c);
  return mr_file_parse(path, SIM_INPUT_MAX_BYTES, rpc_parse_cb, c, e);
}

/* ---- client bench --------------------------------------------------------------------- */

typedef struct client_ctx {
  pl_client_bench *b;
  bool have_model;
  uint32_t layer_lines;
} client_ctx;

static int client_line(void *ctx, const cJSON *o, unsigned line, const char *label, mr_err *e) {
  client_ctx *c = ctx;
  const char *kind = str_field(o, "bench");
  if (!kind) return 0;
  int rc;
  if (strcmp(kind, "model") == 0) {
    if (c->have_model)
      return mr_err_set(e, MR_EFORMAT, "%s: line %u: a second \"bench\": \"model\" line (one "
                        "run per file)", label, line);
    uint64_t servers, batch, plen, threads;
    double step_ms, ptok;
    if ((rc = num_field(o, "step_ms", 0, true, line, label, &step_ms, e)) ||
        (rc = num_field(o, "prefill_tok_s", 0, true, line, label, &ptok, e)) ||
        (rc = int_field(o, "batch", 1, 1u << 20, line, label, &batch, e)) ||
        (rc = int_field(o, "prompt_len", 1, 1u << 24, line, label, &plen, e)) ||
        (rc = int_field(o, "threads", 0, 65536, line, label, &threads, e)) ||
        (rc = int_field(o, "servers", 0, 0, line, label, &servers, e)))
      return rc == MR_ERANGE && cJSON_IsNumber(cJSON_GetObjectItemCaseSensitive(o, "servers")) &&
                     cJSON_GetObjectItemCaseSensitive(o, "servers")->valuedouble != 0
                 ? mr_err_prefix(e, rc, "the client's own time comes from an all-local run "
                                 "(moerpc-client bench without --cluster)")
                 : rc;
    c->b->step_us = step_ms * 1000.0;
    c->b->prefill_tok_s = ptok;
    c->b->batch = (uint32_t)batch;
    c->b->prompt_len = (uint32_t)plen;
    c->b->threads = (uint32_t)threads;
    c->have_model = true;
  } else if (strcmp(kind, "model-layer") == 0) {
    uint64_t layer;
    double local_us;
    if ((rc = int_field(o, "layer", 0, MR_MAX_LAYERS - 1, line, label, &layer, e)) ||
        (rc = num_field(o, "local_us", 0, false, line, label, &local_us, e)))
      return rc;
    const cJSON *moe = cJSON_GetObjectItemCaseSensitive(o, "moe");
    if (!cJSON_IsBool(moe)) {
      char desc[96];
      mr_json_describe(moe, desc, sizeof desc);
      return mr_err_set(e, MR_EFORMAT, "%s: line %u: moe = %s, must be true or false", label,
                        line, desc);
    }
    if (cJSON_IsTrue(moe)) c->b->expert_us += local_us;
    c->layer_lines++;
  }
  return 0;
}

int pl_client_bench_parse(pl_client_bench *b, const char *text, size_t len, const char *label,
                          mr_err *e) {
  memset(b, 0, sizeof *b);
  client_ctx c = {.b = b};
  int rc = json_lines(text, len, label, client_line, &c, e);
  if (!rc && !c.have_model)
    rc = mr_err_set(e, MR_ENOTFOUND, "%s: no \"bench\": \"model\" line (moerpc-client bench "
                    "--json)", label);
  if (rc) {
    memset(b, 0, sizeof *b);
    return rc;
  }
  b->layers = c.layer_lines;
  return 0;
}

static int client_bench_parse_cb(void *ctx, const char *text, size_t len, const char *path, mr_err *e) {
  return pl_client_bench_parse(ctx, text, len, path, e);
}

int pl_client_bench_load(pl_client_bench *b, const char *path, mr_err *e) {
  memset(b, 0, sizeof *b);
  return mr_file_parse(path, SIM_INPUT_MAX_BYTES, client_bench_parse_cb, b, e);
}

/* ---- formats -------------------------------------------------------------------------- */

double pl_sim_expert_bytes(const char *format, uint32_t H, uint32_t I) {
  /* The servers' packed size (the planner's pl_expert_bytes); "fp8" and "int4" are short
   * for fp8-b128 and int4-g64. */
  pl_wformat f;
  if (strcmp(format, "fp8") == 0) f = PL_WF_FP8_B128;
  else if (strcmp(format, "int4") == 0) f = PL_WF_INT4_G64;
  else if (pl_wformat_parse(format, &f) != 0) return 0;
  return (double)pl_expert_bytes(f, H, I, 1);
}

/* ---- the model ------------------------------------------------------------------------
 *
 * One decode step of the client (prefill: the same with T = batch x prompt_len tokens),
 * layer after layer; the client's own work between two MoE layers is `gap`:
 *
 *   client  |gap| hot experts |..wait..|gap| hot |..wait..|gap| ...
 *   host 0      |rpc+wire|compute  |rpc|            the slowest call of the layer sets
 *   host 1      |rpc+wire|compute.......|rpc|       the wait (fan-out in parallel)
 *               '----------- layer l -------'
 *
 * Units: times in microseconds, sizes in bytes, kernel rates in GB/s (1e9 bytes/s, so
 * bytes / (GB/s x 1e3) is us), links in Gbit/s (bits / (Gbit/s x 1e3) is us).
 *
 * Per MoE layer l, `samples` sampled steps (prefill: samples / 8, at least 1): each of T
 * tokens draws top-k distinct experts from the layer's counts (draw_token), each slot goes to
 * the client (a local pair), its host, the least-loaded of its replicas, or with no route the
 * least-loaded host (sample_layer). The call to host h then has s slots on a distinct
 * experts from t distinct tokens, and
 *
 *   compute_h = a x expert_bytes / (rate_h(s / a) x speed_h x 1e3)       each expert read once
 *   wire_h    = t x H x wire_bytes x 2 + 8 s + 96     hidden states there and back, an
 *                                                     (id, weight) per slot, framing
 *   link_h    = rpc_fixed + rpc_per_byte x wire_h + 8 wire_h / (gbps_h x 1e3) + 2 latency_h
 *   remote    = max over h of (compute_h + link_h),
 *               at least 8 x sum_h wire_h / (client_gbps x 1e3) + rpc_fixed   (one NIC)
 *   hot       = the client's local experts, the compute formula on the client's rates
 *
 * and the layer, as the runner does it (gpu_client's gc_moe: cold slots sent first, the hot
 * experts computed meanwhile, with --max-deferred K each token's slots of rank >= k - K in a
 * second call whose answer is awaited only in the next MoE layer):
 *
 *   layer_l = max(hot_l, remote_now_l, remote_def_(l-1) - (layer_(l-1) + gap))
 *   layer_l = hot_l + remote_now_l + remote_def_l           with --shared-cores
 *
 *   step  = other_us + sum over MoE layers of the mean of layer_l over the samples
 *   tok/s = tokens per step x 1e6 / step;  gap = other_us / num_layers
 *
 * Why sampled steps and not expected counts: the max over hosts of a random load is more
 * than the max of the expected loads (at batch 1, two hosts share 8 slots binomially and
 * the busier reads 5.1 experts on average, not 4), and a host's distinct experts a (what it
 * reads) fall below its slots s as soon as tokens share experts. Why rates by u = s / a: the
 * same bench table then serves decode (u ~ 1: bandwidth-bound) and prefill (u of tens:
 * compute-bound) for any shape of the same format. Why --shared-cores adds instead of
 * overlapping: servers on the client's own cores (loopback on one machine) take those cores
 * while they compute; and then the hosts together read no faster than the client alone
 * (remote_calls raises the critical host's compute to that floor).
 *
 * Where the time goes (pl_sim_phase.share): the client gets its own time and the layers
 * where the hot experts are the longest term; a remote term is split between its critical
 * host (the compute part) and "link" (RPC, transfer and latency; all of it when the client's
 * NIC is the limit); equal hosts share the blame by a drawn tie-break.
 *
 * Not modelled, and why: the queueing of a layer's deferred call and the next layer's call
 * on one host (timed as if apart, which is optimistic when that host is the bottleneck);
 * NUMA inside a host and a host's rate depending on the other hosts' load (the bench lines
 * measure one host alone; only the --shared-cores floor says anything about sharing); the
 * client's submit cost (it is inside the fixed RPC cost that bench-rpc measures); dense
 * layers other than as client time; the client's time between layers is spread evenly
 * (other_us / num_layers), not measured per layer; a replicated expert that alternates
 * between its hosts within one step is counted as a new read at each change (a slight
 * overcount).
 */

/* A uniform double in [0, 1): the top 53 bits over 2^53. */
static double rng_unit(uint64_t *s) { return (double)(pl__splitmix64(s) >> 11) / 9007199254740992.0; }

/* Per-call accumulators of one sampled step: index 0..n_hosts-1 hosts, n_hosts the client. */
typedef struct call_acc {
  uint32_t slots;  /* (token, expert) pairs sent: s */
  uint32_t active; /* distinct experts among them: a, what the host reads */
  uint32_t tokens; /* distinct tokens among them: t, whose hidden states cross the wire */
} call_acc;

/* The time of one set of calls (this layer's, or its deferred ones) and who it is due to. */
typedef struct remote_time {
  double wall;         /* the call set's time as the client sees it */
  double *comp;        /* [n_hosts] compute per host of this call set (caller's buffer) */
  int crit;            /* critical host (-1: the client's link, -2: nothing remote) */
  double crit_comp;    /* compute part of the critical term */
  double crit_link;    /* link + RPC part */
} remote_time;

/* Scratch of one run. The distinct-expert and distinct-token counts use stamps instead of
 * clearing sets: every step and every token takes the next value of one counter, and "seen
 * in this step" is "stamped with this step's value", so a step costs O(slots) however large
 * E is. */
typedef struct sim_scratch {
  uint32_t *chosen;    /* [E] stamp of the token that chose it */
  uint32_t *act_now;   /* [E] stamp of the step that activated it (now calls) */
  uint32_t *act_def;   /* [E] (deferred calls) */
  uint32_t *act_host;  /* [E] the owner that activated it (a pair with copies may move) */
  double *prev_def, *prev_wall; /* [samples] the previous MoE layer's deferred calls */
  remote_time *prev_rt;         /* [samples] */
  uint32_t *tok_now;   /* [n_hosts + 1] stamp of the token counted */
  uint32_t *tok_def;
  call_acc *now, *def; /* [n_hosts + 1] */
  int32_t *ids;        /* [k] draws of one token, in rank order */
  uint64_t tie_rng;    /* tie-breaks apart from the routing draws: same draws for any hosts */
} sim_scratch;

/* compute = a x expert_bytes / (rate(s / a) x speed), us: a call reads each of its a
 * distinct experts once, at the rate the kernels reach with s / a tokens per expert. */
static double host_compute_us(const pl_sim_input *in, const pl_rates *r, double speed,
                              const call_acc *a) {
  if (!a->active) return 0;
  double u = (double)a->slots / a->active;
  double gbps = pl_rates_gbps(r, u) * speed;
  return (double)a->active * in->expert_bytes / (gbps * 1e3); /* bytes / (GB/s) -> us */
}

/* Bytes of one call, request and reply: a call's 96 bytes of framing and headers are an
 * estimate (gRPC and protobuf overhead of a small message); the rest is exact. */
static double call_wire_bytes(const pl_sim_input *in, const call_acc *a) {
  /* request: hidden states + (id, weight) per slot; reply: one output row per token */
  return (double)a->tokens * in->hidden * in->wire_bytes * 2 + (double)a->slots * 8 + 96;
}

/* The time of one set of calls (one per host with work), fanned out in parallel: the
 * slowest host's compute + link, then two floors that can only raise it, the client's own
 * link carrying every host's bytes and, with --shared-cores, the client's rate for all the
 * hosts' bytes together. t->comp[] gets each host's compute (its busy time). */
static void remote_calls(const pl_sim_input *in, const call_acc *acc, remote_time *t,
                         uint64_t *rng) {
  uint32_t ties = 0;
  t->wall = 0;
  t->crit = -2;
  t->crit_comp = t->crit_link = 0;
  double total_bytes = 0, total_wire = 0, total_slots = 0, total_active = 0;
  for (uint32_t h = 0; h < in->n_hosts; h++) {
    const call_acc *a = &acc[h];
    t->comp[h] = 0;
    if (!a->slots) continue;
    const pl_sim_host *ho = &in->hosts[h];
    double comp = host_compute_us(in, ho->rates, ho->speed, a);
    double wire = call_wire_bytes(in, a);
    /* link_h: the RPC's own cost, latency both ways, transfer (bits / (Gbit/s x 1e3) = us) */
    double link = in->rpc.fixed_us + in->rpc.per_byte_us * wire + 2 * ho->link_latency_us;
    if (ho->link_gbps > 0) link += wire * 8 / (ho->link_gbps * 1e3);
    t->comp[h] = comp;
    total_bytes += (double)a->active * in->expert_bytes;
    total_slots += a->slots;
    total_active += a->active;
    total_wire += wire;
    /* equal hosts (a common case at batch 1) share the blame: a tie goes to one of them
     * drawn uniformly (reservoir sampling), not always to the first */
    double w = comp + link;
    bool tie = t->crit >= 0 && fabs(w - t->wall) <= 1e-9 * w;
    if (tie ? pl__splitmix64(rng) % ++ties == 0 : w > t->wall) {
      if (!tie) ties = 1;
      t->wall = w > t->wall ? w : t->wall;
      t->crit = (int)h;
      t->crit_comp = comp;
      t->crit_link = link;
    }
  }
  if (t->crit == -2) return;
  if (in->client_link_gbps > 0) { /* every host's bytes cross the client's own link */
    double nic = total_wire * 8 / (in->client_link_gbps * 1e3) + in->rpc.fixed_us;
    if (nic > t->wall) {
      t->wall = nic;
      t->crit = -1;
      t->crit_comp = 0;
      t->crit_link = nic;
    }
  }
  if (in->shared_cores && in->client_rates) {
    /* the hosts share the client's machine: together they read no faster than it does */
    double gbps = pl_rates_gbps(in->client_rates, total_slots / total_active);
    double floor_us = total_bytes / (gbps * 1e3);
    if (floor_us > t->crit_comp && t->crit >= 0) {
      t->wall += floor_us - t->crit_comp;
      t->crit_comp = floor_us;
    }
  }
}

/* Adds a term's time to the shares: compute to the critical host, the rest to the link, in
 * the proportions of the critical call (a term the client's NIC set goes to the link). */
static void attribute(double *share, const remote_time *t, double amount) {
  if (amount <= 0 || t->crit == -2) return;
  double tot = t->crit_comp + t->crit_link;
  if (tot <= 0) return;
  if (t->crit >= 0) share[2 + t->crit] += amount * t->crit_comp / tot;
  share[1] += amount * (t->crit >= 0 ? t->crit_link / tot : 1.0);
}

/* Draws one token's top-k in rank order (the first drawn ranks highest, as the router's
 * largest weights come from its most popular experts). Without replacement, by rejection:
 * an expert drawn already for this token (stamped) is drawn again, up to 64 times, then the
 * first unchosen expert is taken (only when the counts put nearly all the mass on fewer than
 * k experts). A draw from counts is a binary search of the layer's cumulative counts,
 * O(log E); with no counts, uniform. */
static void draw_token(const pl_sim_input *in, sim_scratch *s, const double *cdf, uint32_t stamp,
                       uint64_t *rng) {
  const uint32_t E = in->num_experts, k = in->top_k;
  for (uint32_t j = 0; j < k; j++) {
    int32_t x = -1;
    for (int tries = 0; tries < 64 && x < 0; tries++) {
      uint32_t c;
      if (cdf) {
        double r = rng_unit(rng) * cdf[E - 1];
        uint32_t lo = 0, hi = E - 1;
        while (lo < hi) {
          uint32_t mid = (lo + hi) / 2;
          if (cdf[mid] > r) hi = mid;
          else lo = mid + 1;
        }
        c = lo;
      } else {
        c = (uint32_t)(pl__splitmix64(rng) % E);
      }
      if (s->chosen[c] != stamp) x = (int32_t)c;
    }
    if (x < 0) /* the mass is on fewer than k experts: the next unchosen one */
      for (uint32_t c = 0; c < E && x < 0; c++)
        if (s->chosen[c] != stamp) x = (int32_t)c;
    s->chosen[x] = stamp;
    s->ids[j] = x;
  }
}

/* One sampled step of one MoE layer: the client's hot time, and this layer's calls now and
 * deferred (their wall time as the client sees it, and who each is due to). */
typedef struct layer_sample {
  double hot_us, now_wall, def_wall;
  remote_time now, def;
} layer_sample;

/* One sampled step of MoE layer l with T tokens: fills s->now / s->def (the calls, per
 * host, the client at index N) and the times. With defer, each token's slots of rank
 * >= keep = k - max_deferred go to a host's deferred call (all of them when max_deferred
 * >= k); the client's own slots are never deferred. O(T x k) plus, for unrouted and
 * replicated pairs, a scan of the candidate hosts. */
static void sample_layer(const pl_sim_input *in, sim_scratch *s, uint32_t l, uint32_t T,
                         bool defer, const double *cdf, uint32_t *stamp, uint64_t *rng,
                         layer_sample *ls) {
  const uint32_t E = in->num_experts, k = in->top_k, N = in->n_hosts;
  const uint32_t keep = defer && in->max_deferred < k ? k - in->max_deferred : (defer ? 0 : k);
  memset(s->now, 0, (N + 1) * sizeof *s->now);
  memset(s->def, 0, (N + 1) * sizeof *s->def);
  uint32_t step = ++*stamp;
  for (uint32_t t = 0; t < T; t++) {
    uint32_t ts = ++*stamp;
    draw_token(in, s, cdf, ts, rng);
    for (uint32_t j = 0; j < k; j++) {
      uint32_t x = (uint32_t)s->ids[j];
      size_t p = (size_t)l * E + x;
      uint32_t h;
      if (in->local && in->local[p]) {
        h = N;
      } else if (in->route && in->route[p] >= 0) {
        h = (uint32_t)in->route[p];
      } else if (in->rep_off && in->rep_off[p + 1] > in->rep_off[p]) {
        /* replicas: the least-loaded of the pair's own hosts this step (the client's rule) */
        const int32_t *c = in->rep + in->rep_off[p];
        const uint32_t nc = in->rep_off[p + 1] - in->rep_off[p];
        h = (uint32_t)c[0];
        for (uint32_t i = 1; i < nc; i++) {
          uint32_t g = (uint32_t)c[i];
          if (s->now[g].slots + s->def[g].slots < s->now[h].slots + s->def[h].slots) h = g;
        }
      } else { /* no route: the least-loaded host of this step */
        h = 0;
        for (uint32_t i = 1; i < N; i++)
          if (s->now[i].slots + s->def[i].slots < s->now[h].slots + s->def[h].slots) h = i;
      }
      bool d = h < N && j >= keep; /* a remote slot ranked past keep: deferred */
      call_acc *a = d ? &s->def[h] : &s->now[h];
      uint32_t *act = d ? s->act_def : s->act_now;
      uint32_t *tok = d ? s->tok_def : s->tok_now;
      a->slots++;
      /* experts of the client and of each host are disjoint, so one stamp per expert (with
       * the host that set it: a replicated or unrouted expert may go to several) */
      if (act[x] != step || s->act_host[x] != h) {
        act[x] = step;
        s->act_host[x] = h;
        a->active++;
      }
      if (tok[h] != ts) {
        tok[h] = ts;
        a->tokens++;
      }
    }
  }
  ls->hot_us = s->now[N].slots ? host_compute_us(in, in->client_rates, 1.0, &s->now[N]) : 0;
  remote_calls(in, s->now, &ls->now, &s->tie_rng);
  remote_calls(in, s->def, &ls->def, &s->tie_rng);
  ls->now_wall = ls->now.wall;
  ls->def_wall = ls->def.wall;
}

static int phase_alloc(pl_sim_phase *p, uint32_t n_hosts, uint32_t L) {
  p->share = mr_calloc(2 + n_hosts, sizeof *p->share);
  p->host_busy_us = mr_calloc(n_hosts + 1, sizeof *p->host_busy_us);
  p->layer_us = mr_calloc(L, sizeof *p->layer_us);
  return p->share && p->host_busy_us && p->layer_us ? 0 : MR_ENOMEM;
}

static void phase_free(pl_sim_phase *p) {
  mr_free(p->share);
  mr_free(p->host_busy_us);
  mr_free(p->layer_us);
  memset(p, 0, sizeof *p);
}

void pl_sim_result_close(pl_sim_result *r) {
  if (!r) return;
  phase_free(&r->decode);
  phase_free(&r->prefill);
  r->n_hosts = 0;
}

const char *pl_sim_component_name(const pl_sim_input *in, int c) {
  if (c == 0) return "client";
  if (c == 1) return "link";
  if (c >= 2 && (uint32_t)(c - 2) < in->n_hosts) return in->hosts[c - 2].name;
  return "?";
}

/* The wall time of sampled step i of one MoE layer as the client sees it, with its
 * attribution added to share[] (weighted 1 / samples). Updates the scratch's record of this
 * layer's deferred calls, which the next MoE layer's step i overlaps. */
static double layer_wall(const pl_sim_input *in, sim_scratch *s, uint32_t i, double gap,
                         const layer_sample *ls, uint32_t samples, double *share) {
  double wall;
  if (in->shared_cores) {
    /* one set of cores: the hot experts, this layer's calls and its deferred calls run
     * one after the other (the deferral hides nothing) */
    wall = ls->hot_us + ls->now_wall + ls->def_wall;
    share[0] += ls->hot_us / samples;
    attribute(share, &ls->now, ls->now_wall / samples);
    attribute(share, &ls->def, ls->def_wall / samples);
    return wall;
  }
  /* the runner: cold slots sent first, hot experts computed meanwhile, then the wait
   * for this layer's calls and the previous layer's deferred ones, which ran during
   * that layer's wait and this layer's attention */
  double def_left = s->prev_def[i] - (s->prev_wall[i] + gap);
  wall = ls->hot_us;
  int who = 0;
  if (ls->now_wall > wall) wall = ls->now_wall, who = 1;
  if (def_left > wall) wall = def_left, who = 2;
  if (who == 0) share[0] += wall / samples;
  else if (who == 1) attribute(share, &ls->now, wall / samples);
  else {
    remote_time rt = s->prev_rt[i];
    attribute(share, &rt, wall / samples);
  }
  s->prev_def[i] = ls->def_wall;
  s->prev_wall[i] = wall;
  s->prev_rt[i] = ls->def;
  s->prev_rt[i].comp = NULL;
  return wall;
}

/* A phase's figures from its summed times: tokens/s, the shares as fractions of the step,
 * the bottleneck (the largest share; the first on ties) and the hosts' imbalance. */
static void phase_finish(pl_sim_phase *p, double step, uint32_t tokens_out, uint32_t N) {
  p->step_us = step;
  p->tok_s = step > 0 ? tokens_out * 1e6 / step : 0;
  double best = -1;
  for (uint32_t c = 0; c < 2 + N; c++) {
    p->share[c] = step > 0 ? p->share[c] / step : 0;
    if (p->share[c] > best) best = p->share[c], p->bottleneck = (int)c;
  }
  double mx = 0, mean = 0;
  for (uint32_t h = 0; h < N; h++) {
    mean += p->host_busy_us[h] / N;
    if (p->host_busy_us[h] > mx) mx = p->host_busy_us[h];
  }
  p->imbalance = mean > 0 ? mx / mean : 0;
}

/* One phase: T tokens per step, `samples` sampled steps per MoE layer, other_us of client
 * time per step besides the experts. Sample i of layer l follows sample i of the previous
 * MoE layer (its deferred calls overlap this layer), so the samples are `samples` whole
 * steps, and the step's time is other_us + the sum of the layers' means. The routing draws
 * and the tie-breaks have separate generators seeded from (seed, T), so that the same
 * routing is drawn whatever the hosts are: comparing two placements compares placements,
 * not draws. */
static void run_phase(const pl_sim_input *in, sim_scratch *s, double **cdfs, uint32_t T,
                      uint32_t samples, double other_us, uint32_t tokens_out, pl_sim_phase *p,
                      double *comp_buf) {
  const uint32_t L = in->num_layers, N = in->n_hosts;
  uint32_t last_moe = 0, n_moe = 0;
  for (uint32_t l = 0; l < L; l++)
    if (!in->is_moe || in->is_moe[l]) last_moe = l, n_moe++;
  const double gap = n_moe ? other_us / L : 0; /* the client's own time between two MoE layers
                                                  (spread evenly: not measured per layer) */
  uint64_t rng = in->seed ^ ((uint64_t)T << 32) ^ 0x5bd1e995u;
  s->tie_rng = rng ^ 0x2545f4914f6cdd1dull;
  uint32_t stamp = 0;
  memset(s->chosen, 0, in->num_experts * sizeof *s->chosen);
  memset(s->act_now, 0, in->num_experts * sizeof *s->act_now);
  memset(s->act_def, 0, in->num_experts * sizeof *s->act_def);
  memset(s->act_host, 0, in->num_experts * sizeof *s->act_host);
  memset(s->tok_now, 0, (N + 1) * sizeof *s->tok_now);
  memset(s->tok_def, 0, (N + 1) * sizeof *s->tok_def);
  double step = other_us;
  p->share[0] += other_us;
  /* the previous MoE layer's deferred calls, per sample: none before the first */
  memset(s->prev_def, 0, samples * sizeof *s->prev_def);
  memset(s->prev_wall, 0, samples * sizeof *s->prev_wall);
  memset(s->prev_rt, 0, samples * sizeof *s->prev_rt);
  for (uint32_t l = 0; l < L; l++) {
    if (in->is_moe && !in->is_moe[l]) continue;
    const bool defer = in->max_deferred > 0 && l != last_moe && N > 0;
    double sum = 0;
    for (uint32_t i = 0; i < samples; i++) {
      layer_sample ls;
      ls.now.comp = comp_buf;
      ls.def.comp = comp_buf + N;
      sample_layer(in, s, l, T, defer, cdfs[l], &stamp, &rng, &ls);
      for (uint32_t h = 0; h < N; h++)
        p->host_busy_us[h] += (ls.now.comp[h] + ls.def.comp[h]) / samples;
      sum += layer_wall(in, s, i, gap, &ls, samples, p->share);
    }
    p->layer_us[l] = sum / samples;
    step += p->layer_us[l];
  }
  phase_finish(p, step, tokens_out, N);
}

/* Every field of the input in range, naming the field (the command's flags are checked
 * before; this guards the library's other callers, such as the unit tests). */
static int check_input(const pl_sim_input *in, mr_err *e) {
  if (in->hidden < 1 || in->hidden > 65536 || in->inter < 1 || in->inter > 65536)
    return mr_err_set(e, MR_EINVAL, "simulate: hidden = %u, inter = %u, must be in 1..65536",
                      in->hidden, in->inter);
  if (in->num_experts < 1 || in->num_experts > 65536 || in->top_k < 1 ||
      in->top_k > in->num_experts)
    return mr_err_set(e, MR_EINVAL, "simulate: num_experts = %u, top_k = %u: experts must be "
                      "in 1..65536, top_k in 1..num_experts", in->num_experts, in->top_k);
  if (in->num_layers < 1 || in->num_layers > MR_MAX_LAYERS)
    return mr_err_set(e, MR_EINVAL, "simulate: num_layers = %u, must be in 1..%u",
                      in->num_layers, MR_MAX_LAYERS);
  if (!(in->expert_bytes > 0) || !isfinite(in->expert_bytes) || !(in->wire_bytes > 0))
    return mr_err_set(e, MR_EINVAL, "simulate: expert_bytes = %g, wire_bytes = %g, must be > 0",
                      in->expert_bytes, in->wire_bytes);
  if (in->n_hosts > PL_SIM_MAX_HOSTS)
    return mr_err_set(e, MR_EINVAL, "simulate: %u hosts, at most %u", in->n_hosts,
                      PL_SIM_MAX_HOSTS);
  if (in->batch < 1 || in->batch > (1u << 16) || in->prompt_len > (1u << 20) ||
      (uint64_t)in->batch * in->prompt_len > (1u << 20))
    return mr_err_set(e, MR_EINVAL, "simulate: batch = %u, prompt_len = %u: batch must be in "
                      "1..65536, batch x prompt_len at most 2^20", in->batch, in->prompt_len);
  if (in->samples < 1 || in->samples > 100000)
    return mr_err_set(e, MR_EINVAL, "simulate: samples = %u, must be in 1..100000", in->samples);
  if (!(in->decode_other_us >= 0) || !isfinite(in->decode_other_us))
    return mr_err_set(e, MR_EINVAL, "simulate: the client's decode step time = %g us, must be "
                      ">= 0", in->decode_other_us);
  if (in->rpc.fixed_us < 0 || in->rpc.per_byte_us < 0 || !isfinite(in->rpc.fixed_us) ||
      !isfinite(in->rpc.per_byte_us) || in->client_link_gbps < 0)
    return mr_err_set(e, MR_EINVAL, "simulate: rpc fixed %g us, per byte %g us, client link %g "
                      "Gbit/s: must be >= 0", in->rpc.fixed_us, in->rpc.per_byte_us,
                      in->client_link_gbps);
  for (uint32_t h = 0; h < in->n_hosts; h++) {
    const pl_sim_host *ho = &in->hosts[h];
    if (!ho->rates || !ho->rates->n)
      return mr_err_set(e, MR_EINVAL, "simulate: host %s has no kernel rates (--kernels or "
                        "--host-kernels %s=FILE)", ho->name, ho->name);
    if (!(ho->speed > 0) || !isfinite(ho->speed))
      return mr_err_set(e, MR_EINVAL, "simulate: host %s: speed = %g, must be > 0", ho->name,
                        ho->speed);
    if (!(ho->link_gbps >= 0) || !(ho->link_latency_us >= 0) || !isfinite(ho->link_gbps) ||
        !isfinite(ho->link_latency_us))
      return mr_err_set(e, MR_EINVAL, "simulate: host %s: link %g Gbit/s, latency %g us: must "
                        "be >= 0", ho->name, ho->link_gbps, ho->link_latency_us);
  }
  const size_t pairs = (size_t)in->num_layers * in->num_experts;
  bool any_local = false;
  for (size_t p = 0; p < pairs; p++) {
    uint32_t l = (uint32_t)(p / in->num_experts);
    if (in->is_moe && !in->is_moe[l]) continue;
    bool loc = in->local && in->local[p];
    any_local |= loc;
    int32_t r = in->route ? in->route[p] : -1;
    if (!loc && r >= (int32_t)in->n_hosts)
      return mr_err_set(e, MR_EINVAL, "simulate: layer %u expert %zu routed to host %d, only %u "
                        "hosts", l, p % in->num_experts, r, in->n_hosts);
    if (!loc && in->n_hosts == 0)
      return mr_err_set(e, MR_EINVAL, "simulate: layer %u expert %zu is not local and there is "
                        "no host", l, p % in->num_experts);
  }
  if (any_local && (!in->client_rates || !in->client_rates->n))
    return mr_err_set(e, MR_EINVAL, "simulate: the placement has local (hot) experts but the "
                      "client has no kernel rates (--client-kernels or --kernels)");
  if (in->shared_cores && (!in->client_rates || !in->client_rates->n))
    return mr_err_set(e, MR_EINVAL, "simulate: --shared-cores needs the client's kernel rates "
                      "(the machine's bandwidth): --client-kernels or --kernels");
  return 0;
}

/* Checks the input, builds each layer's cumulative counts (a layer of zeros, or no counts:
 * uniform draws) and runs decode, then prefill when its client time is known. Memory
 * O(L x E + samples + N); time O((samples x batch + samples / 8 x batch x prompt) x k) per
 * MoE layer. */
int pl_sim_run(const pl_sim_input *in, pl_sim_result *r, mr_err *e) {
  memset(r, 0, sizeof *r);
  int rc = check_input(in, e);
  if (rc) return rc;
  const uint32_t L = in->num_layers, E = in->num_experts, N = in->n_hosts;
  sim_scratch s;
  memset(&s, 0, sizeof s);
  double **cdfs = mr_calloc(L, sizeof *cdfs);
  double *comp_buf = mr_calloc(2 * (size_t)N + 2, sizeof *comp_buf);
  s.chosen = mr_calloc(E, sizeof *s.chosen);
  s.act_now = mr_calloc(E, sizeof *s.act_now);
  s.act_def = mr_calloc(E, sizeof *s.act_def);
  s.tok_now = mr_calloc(N + 1, sizeof *s.tok_now);
  s.tok_def = mr_calloc(N + 1, sizeof *s.tok_def);
  s.now = mr_calloc(N + 1, sizeof *s.now);
  s.def = mr_calloc(N + 1, sizeof *s.def);
  s.ids = mr_calloc(in->top_k, sizeof *s.ids);
  s.act_host = mr_calloc(E, sizeof *s.act_host);
  s.prev_def = mr_calloc(in->samples, sizeof *s.prev_def);
  s.prev_wall = mr_calloc(in->samples, sizeof *s.prev_wall);
  s.prev_rt = mr_calloc(in->samples, sizeof *s.prev_rt);
  rc = MR_ENOMEM;
  if (!cdfs || !comp_buf || !s.chosen || !s.act_now || !s.act_def || !s.tok_now || !s.tok_def ||
      !s.now || !s.def || !s.ids || !s.act_host || !s.prev_def || !s.prev_wall || !s.prev_rt || phase_alloc(&r->decode, N, L) || phase_alloc(&r->prefill, N, L))
    goto out_nomem;
  r->n_hosts = N;
  if (in->counts) {
    for (uint32_t l = 0; l < L; l++) {
      const uint64_t *row = in->counts + (size_t)l * E;
      uint64_t tot = 0;
      for (uint32_t x = 0; x < E; x++) tot += row[x];
      if (!tot) continue; /* no statistics for this layer: uniform */
      if (!(cdfs[l] = mr_malloc(E * sizeof **cdfs))) goto out_nomem;
      double acc = 0;
      for (uint32_t x = 0; x < E; x++) cdfs[l][x] = acc += (double)row[x];
    }
  }
  run_phase(in, &s, cdfs, in->batch, in->samples, in->decode_other_us, in->batch, &r->decode,
            comp_buf);
  if (in->prompt_len > 0 && in->prefill_other_us >= 0) {
    uint32_t ps = in->samples / 8 ? in->samples / 8 : 1;
    const uint32_t T = in->batch * in->prompt_len;
    run_phase(in, &s, cdfs, T, ps, in->prefill_other_us, T, &r->prefill, comp_buf);
  } else {
    r->prefill.step_us = -1;
  }
  rc = 0;
  goto out;
out_nomem:
  mr_err_set(e, MR_ENOMEM, "simulate: out of memory (%u layers x %u experts, %u hosts)", L, E, N);
  pl_sim_result_close(r);
out:
  if (cdfs)
    for (uint32_t l = 0; l < L; l++) mr_free(cdfs[l]);
  mr_free(cdfs);
  mr_free(comp_buf);
  mr_free(s.chosen);
  mr_free(s.act_now);
  mr_free(s.act_def);
  mr_free(s.tok_now);
  mr_free(s.tok_def);
  mr_free(s.now);
  mr_free(s.def);
  mr_free(s.ids);
  mr_free(s.act_host);
  mr_free(s.prev_def);
  mr_free(s.prev_wall);
  mr_free(s.prev_rt);
  return rc;
}

/* ---- the command ---------------------------------------------------------------------- */

static const char SIM_HELP[] =
    "usage: moerpc-place simulate (--model DIR | --shape NAME) [options]\n"
    "\n"
    "Projects decode and prefill tokens/s of a placement on N hosts from measured inputs and\n"
    "names the bottleneck (a host, the link, or the client). Every input is measured or a\n"
    "stated assumption; units are given with each flag. docs/DESIGN.md section 16.\n"
    "\n"
    "Placement and routing:\n"
    "  --placement FILE       moerpc-placement JSON; the hosts are its servers (a pair with no\n"
    "                         server goes to the least-loaded host of each step; a replicated\n"
    "                         pair to the least-loaded of its own servers)\n"
    "  --cluster FILE         cluster file: each host's \"speed\" key (--speed overrides it)\n"
    "  --hosts N              N hosts h0..h{N-1}, experts split in N contiguous ranges per\n"
    "                         layer (without --placement, or when it names no server)\n"
    "  --stats FILE           moerpc-stats JSON: routing frequencies per (layer, expert)\n"
    "                         (default: uniform routing)\n"
    "Model:\n"
    "  --model DIR            config.json of the checkpoint: H, I, experts, top-k, layers\n"
    "  --shape NAME           qwen3-30b-a3b (H 2048, I 768, 128 top-8, 48 layers) or\n"
    "                         deepseek-v3 (H 7168, I 2048, 256 top-8, 61 layers, 3 dense)\n"
    "  --moe-layers N         with --shape: that many MoE layers instead\n"
    "  --format F             weight format on the servers: bf16 (default), f16, f32, int8,\n"
    "                         int4[-g32|64|128], fp8 (= fp8-b128); its bench-kernels lines\n"
    "                         are used\n"
    "  --rates-format F       the bench-kernels lines to read, if not --format's\n"
    "  --expert-bytes N       bytes of one expert as stored (default: from --format)\n"
    "  --wire F               hidden states on the wire: bf16 (default), f16, f32\n"
    "Measured throughput:\n"
    "  --kernels FILE         moerpc-bench-kernels --json lines: every host's and the client's\n"
    "                         expert throughput (weight GB/s by tokens per expert)\n"
    "  --host-kernels NAME=FILE  one host's own (repeatable)\n"
    "  --client-kernels FILE  the client's own (hot experts; --shared-cores: the machine)\n"
    "  --speed NAME=X         multiplies a host's rates (relative speed, > 0; repeatable)\n"
    "  --rpc FILE             moerpc-client bench-rpc --json lines: the fixed cost per request\n"
    "                         (us) and per byte, fitted over T (default: 0)\n"
    "  --rpc-fixed-us X       instead: fixed cost per request, us\n"
    "  --rpc-per-kb-us X      instead: cost per KiB of request + reply, us\n"
    "Link:\n"
    "  --link-gbps G          every host's link, Gbit/s (default 0: no transfer cost)\n"
    "  --link-latency-us U    one-way latency, us (paid twice per call; default 0)\n"
    "  --host-link NAME=G[,U] one host's link (repeatable)\n"
    "  --client-link-gbps G   the client's own link, crossed by every host's bytes (default:\n"
    "                         --link-gbps when given, else none)\n"
    "The client:\n"
    "  --client-bench FILE    an all-local moerpc-client bench --json run: the decode step\n"
    "                         without the experts, and prefill (its batch and prompt length\n"
    "                         are the defaults of --batch / --prompt-len)\n"
    "  --client-step-us X     instead: the client's decode step besides the experts, us\n"
    "  --client-prefill-us X  instead: its prefill step (batch x prompt tokens), us\n"
    "  --batch B              sequences per decode step (default 1)\n"
    "  --prompt-len P         prefill tokens per sequence (default 128; 0 = no prefill)\n"
    "  --max-deferred K       the client's --max-deferred (default 0)\n"
    "  --shared-cores         the hosts run on the client's cores (servers on loopback on the\n"
    "                         same machine): host and client work serialize, and the hosts\n"
    "                         together read no faster than the client's rates\n"
    "Output:\n"
    "  --samples N            sampled steps per MoE layer (default 256; prefill N/8)\n"
    "  --seed S               routing draws (default 1)\n"
    "  --json                 one JSON line (and --layers-detail lines) on stdout\n"
    "  --layers-detail        per-layer MoE time\n"
    "\n"
    "Exit status: 0 ok, 1 a bad input file or a failed run, 2 a usage error.\n";

enum {
  SO_HELP = 1000, SO_PLACEMENT, SO_HOSTS, SO_STATS, SO_MODEL, SO_SHAPE, SO_MOE_LAYERS,
  SO_FORMAT, SO_RATES_FORMAT, SO_EXPERT_BYTES, SO_WIRE, SO_KERNELS, SO_HOST_KERNELS,
  SO_CLIENT_KERNELS, SO_SPEED, SO_RPC, SO_RPC_FIXED, SO_RPC_KB, SO_LINK, SO_LATENCY,
  SO_HOST_LINK, SO_CLIENT_LINK, SO_CLIENT_BENCH, SO_CLIENT_STEP, SO_CLIENT_PREFILL, SO_BATCH,
  SO_PLEN, SO_DEFER, SO_SHARED, SO_SAMPLES, SO_SEED, SO_JSON, SO_LAYERS, SO_CLUSTER
};

#define SIM_MAX_KV 256
typedef struct kv {
  char name[64];
  const char *val;
} kv;
typedef struct sim_opts {
  const char *placement, *cluster, *stats, *model, *shape, *format, *rates_format, *wire, *kernels;
  const char *client_kernels, *rpc, *client_bench;
  uint32_t hosts, moe_layers, batch, prompt_len, max_deferred, samples;
  bool batch_set, plen_set, shared, json, layers_detail;
  double expert_bytes, rpc_fixed, rpc_kb, link_gbps, latency, client_link, client_step,
      client_prefill;
  uint64_t seed;
  kv host_kernels[SIM_MAX_KV], speed[SIM_MAX_KV], host_link[SIM_MAX_KV];
  uint32_t n_hk, n_speed, n_hl;
} sim_opts;

static int parse_num(const char *flag, const char *s, double lo, double hi, double *out) {
  char *end = NULL;
  double d = strtod(s, &end);
  if (!*s || *end || !isfinite(d) || d < lo || d > hi) {
    fprintf(stderr, PROG ": %s = \"%s\", must be a number in %g..%g\n", flag, s, lo, hi);
    return -1;
  }
  *out = d;
  return 0;
}

static int parse_u32(const char *flag, const char *s, uint32_t lo, uint32_t hi, uint32_t *out) {
  char *end = NULL;
  unsigned long long v = strtoull(s, &end, 10);
  if (!*s || *end || *s == '-' || v < lo || v > hi) {
    fprintf(stderr, PROG ": %s = \"%s\", must be an integer in %u..%u\n", flag, s, lo, hi);
    return -1;
  }
  *out = (uint32_t)v;
  return 0;
}

static int parse_kv(const char *flag, const char *s, kv *list, uint32_t *n) {
  const char *eq = strchr(s, '=');
  if (!eq || eq == s || (size_t)(eq - s) > 63 || !eq[1]) {
    fprintf(stderr, PROG ": %s = \"%s\", must be NAME=VALUE (a name of 1..63 characters)\n",
            flag, s);
    return -1;
  }
  if (*n == SIM_MAX_KV) {
    fprintf(stderr, PROG ": %s given more than %u times\n", flag, SIM_MAX_KV);
    return -1;
  }
  kv *k = &list[(*n)++];
  memcpy(k->name, s, (size_t)(eq - s));
  k->name[eq - s] = '\0';
  k->val = eq + 1;
  return 0;
}

static const struct option sim_longopts[] = {
    {"help", no_argument, NULL, SO_HELP},
    {"placement", required_argument, NULL, SO_PLACEMENT},
    {"cluster", required_argument, NULL, SO_CLUSTER},
    {"hosts", required_argument, NULL, SO_HOSTS},
    {"stats", required_argument, NULL, SO_STATS},
    {"model", required_argument, NULL, SO_MODEL},
    {"shape", required_argument, NULL, SO_SHAPE},
    {"moe-layers", required_argument, NULL, SO_MOE_LAYERS},
    {"format", required_argument, NULL, SO_FORMAT},
    {"rates-format", required_argument, NULL, SO_RATES_FORMAT},
    {"expert-bytes", required_argument, NULL, SO_EXPERT_BYTES},
    {"wire", required_argument, NULL, SO_WIRE},
    {"kernels", required_argument, NULL, SO_KERNELS},
    {"host-kernels", required_argument, NULL, SO_HOST_KERNELS},
    {"client-kernels", required_argument, NULL, SO_CLIENT_KERNELS},
    {"speed", required_argument, NULL, SO_SPEED},
    {"rpc", required_argument, NULL, SO_RPC},
    {"rpc-fixed-us", required_argument, NULL, SO_RPC_FIXED},
    {"rpc-per-kb-us", required_argument, NULL, SO_RPC_KB},
    {"link-gbps", required_argument, NULL, SO_LINK},
    {"link-latency-us", required_argument, NULL, SO_LATENCY},
    {"host-link", required_argument, NULL, SO_HOST_LINK},
    {"client-link-gbps", required_argument, NULL, SO_CLIENT_LINK},
    {"client-bench", required_argument, NULL, SO_CLIENT_BENCH},
    {"client-step-us", required_argument, NULL, SO_CLIENT_STEP},
    {"client-prefill-us", required_argument, NULL, SO_CLIENT_PREFILL},
    {"batch", required_argument, NULL, SO_BATCH},
    {"prompt-len", required_argument, NULL, SO_PLEN},
    {"max-deferred", required_argument, NULL, SO_DEFER},
    {"shared-cores", no_argument, NULL, SO_SHARED},
    {"samples", required_argument, NULL, SO_SAMPLES},
    {"seed", required_argument, NULL, SO_SEED},
    {"json", no_argument, NULL, SO_JSON},
    {"layers-detail", no_argument, NULL, SO_LAYERS},
    {NULL, 0, NULL, 0}};

/* The checks between flags, once all are read: 0, or 2 after printing the usage error. */
static int sim_check_opts(const sim_opts *o) {
  if (!o->model == !o->shape) {
    fprintf(stderr, PROG ": give exactly one of --model DIR and --shape NAME (see --help)\n");
    return 2;
  }
  if (o->moe_layers && !o->shape) {
    fprintf(stderr, PROG ": --moe-layers goes with --shape\n");
    return 2;
  }
  if (o->rpc && (o->rpc_fixed >= 0 || o->rpc_kb >= 0)) {
    fprintf(stderr, PROG ": --rpc FILE or --rpc-fixed-us / --rpc-per-kb-us, not both\n");
    return 2;
  }
  if (o->client_bench && (o->client_step >= 0 || o->client_prefill >= 0)) {
    fprintf(stderr, PROG ": --client-bench FILE or --client-step-us / --client-prefill-us, "
            "not both\n");
    return 2;
  }
  if (!o->client_bench && o->client_step < 0) {
    fprintf(stderr, PROG ": the client's own step time is needed: --client-bench FILE or "
            "--client-step-us X\n");
    return 2;
  }
  if (!pl_sim_expert_bytes(o->format, 64, 64)) {
    fprintf(stderr, PROG ": --format = \"%s\", must be f32, f16, bf16, int8, int4[-gG] or fp8\n",
            o->format);
    return 2;
  }
  if (strcmp(o->wire, "bf16") && strcmp(o->wire, "f16") && strcmp(o->wire, "f32")) {
    fprintf(stderr, PROG ": --wire = \"%s\", must be bf16, f16 or f32\n", o->wire);
    return 2;
  }
  return 0;
}

/* 0 to run, 1 after --help, 2 on a usage error (printed). Defaults: bf16 on the wire and on
 * the servers, batch 1, prompt 128, 256 samples, seed 1; -1 marks a number not given. */
static int sim_parse(int argc, char **argv, sim_opts *o) {
  memset(o, 0, sizeof *o);
  o->format = "bf16";
  o->wire = "bf16";
  o->batch = 1;
  o->prompt_len = 128;
  o->samples = 256;
  o->seed = 1;
  o->rpc_fixed = o->rpc_kb = o->client_link = o->client_step = o->client_prefill = -1;
  optind = 1;
  opterr = 0;
  for (;;) {
    int oi = 0, opt = getopt_long(argc, argv, "", sim_longopts, &oi), r = 0;
    if (opt == -1) break;
    double d;
    switch (opt) {
      case SO_HELP: fputs(SIM_HELP, stdout); return 1;
      case SO_PLACEMENT: o->placement = optarg; break;
      case SO_CLUSTER: o->cluster = optarg; break;
      case SO_HOSTS: r = parse_u32("--hosts", optarg, 1, PL_SIM_MAX_HOSTS, &o->hosts); break;
      case SO_STATS: o->stats = optarg; break;
      case SO_MODEL: o->model = optarg; break;
      case SO_SHAPE: o->shape = optarg; break;
      case SO_MOE_LAYERS: r = parse_u32("--moe-layers", optarg, 1, MR_MAX_LAYERS, &o->moe_layers); break;
      case SO_FORMAT: o->format = optarg; break;
      case SO_RATES_FORMAT: o->rates_format = optarg; break;
      case SO_EXPERT_BYTES: r = parse_num("--expert-bytes", optarg, 1, 1e12, &o->expert_bytes); break;
      case SO_WIRE: o->wire = optarg; break;
      case SO_KERNELS: o->kernels = optarg; break;
      case SO_HOST_KERNELS: r = parse_kv("--host-kernels", optarg, o->host_kernels, &o->n_hk); break;
      case SO_CLIENT_KERNELS: o->client_kernels = optarg; break;
      case SO_SPEED: r = parse_kv("--speed", optarg, o->speed, &o->n_speed); break;
      case SO_RPC: o->rpc = optarg; break;
      case SO_RPC_FIXED: r = parse_num("--rpc-fixed-us", optarg, 0, 1e9, &o->rpc_fixed); break;
      case SO_RPC_KB: r = parse_num("--rpc-per-kb-us", optarg, 0, 1e9, &o->rpc_kb); break;
      case SO_LINK: r = parse_num("--link-gbps", optarg, 0, 1e6, &o->link_gbps); break;
      case SO_LATENCY: r = parse_num("--link-latency-us", optarg, 0, 1e9, &o->latency); break;
      case SO_HOST_LINK: r = parse_kv("--host-link", optarg, o->host_link, &o->n_hl); break;
      case SO_CLIENT_LINK: r = parse_num("--client-link-gbps", optarg, 0, 1e6, &o->client_link); break;
      case SO_CLIENT_BENCH: o->client_bench = optarg; break;
      case SO_CLIENT_STEP: r = parse_num("--client-step-us", optarg, 0, 1e12, &o->client_step); break;
      case SO_CLIENT_PREFILL: r = parse_num("--client-prefill-us", optarg, 0, 1e12, &o->client_prefill); break;
      case SO_BATCH: r = parse_u32("--batch", optarg, 1, 65536, &o->batch); o->batch_set = true; break;
      case SO_PLEN: r = parse_u32("--prompt-len", optarg, 0, 1u << 20, &o->prompt_len); o->plen_set = true; break;
      case SO_DEFER: r = parse_u32("--max-deferred", optarg, 0, 65536, &o->max_deferred); break;
      case SO_SHARED: o->shared = true; break;
      case SO_SAMPLES: r = parse_u32("--samples", optarg, 1, 100000, &o->samples); break;
      case SO_SEED: r = parse_num("--seed", optarg, 0, 9007199254740992.0, &d); o->seed = (uint64_t)d; break;
      case SO_JSON: o->json = true; break;
      case SO_LAYERS: o->layers_detail = true; break;
      default:
        fprintf(stderr, PROG ": bad or incomplete option \"%s\" (see --help)\n", argv[optind - 1]);
        return 2;
    }
    if (r) return 2;
  }
  if (optind < argc) {
    fprintf(stderr, PROG ": unexpected argument \"%s\" (see --help)\n", argv[optind]);
    return 2;
  }
  return sim_check_opts(o);
}

/* The shapes of --shape; is_moe from first_dense. */
static int builtin_shape(const char *name, uint32_t moe_layers, mr_model_config *c) {
  memset(c, 0, sizeof *c);
  uint32_t dense = 0;
  if (strcmp(name, "qwen3-30b-a3b") == 0) {
    c->hidden_size = 2048, c->moe_intermediate = 768, c->num_experts = 128, c->top_k = 8;
    c->num_layers = 48;
  } else if (strcmp(name, "deepseek-v3") == 0) {
    c->hidden_size = 7168, c->moe_intermediate = 2048, c->num_experts = 256, c->top_k = 8;
    c->num_layers = 61, dense = 3;
  } else {
    fprintf(stderr, PROG ": --shape = \"%s\", must be qwen3-30b-a3b or deepseek-v3\n", name);
    return 2;
  }
  if (moe_layers) c->num_layers = dense + moe_layers;
  if (c->num_layers > MR_MAX_LAYERS) {
    fprintf(stderr, PROG ": --moe-layers = %u: %u layers, at most %u\n", moe_layers,
            c->num_layers, MR_MAX_LAYERS);
    return 2;
  }
  for (uint32_t l = 0; l < c->num_layers; l++) c->is_moe[l] = l >= dense;
  snprintf(c->arch_name, sizeof c->arch_name, "%s", name);
  return 0;
}

static const kv *kv_find(const kv *list, uint32_t n, const char *name) {
  for (uint32_t i = 0; i < n; i++)
    if (strcmp(list[i].name, name) == 0) return &list[i];
  return NULL;
}

/* Checks that every NAME of a per-host flag is a host. */
static int kv_check(const char *flag, const kv *list, uint32_t n, const pl_sim_host *hosts,
                    uint32_t nh) {
  for (uint32_t i = 0; i < n; i++) {
    bool ok = false;
    for (uint32_t h = 0; h < nh; h++) ok |= strcmp(hosts[h].name, list[i].name) == 0;
    if (!ok) {
      fprintf(stderr, PROG ": %s %s=...: no host of that name (hosts:", flag, list[i].name);
      for (uint32_t h = 0; h < nh; h++) fprintf(stderr, " %s", hosts[h].name);
      fprintf(stderr, ")\n");
      return -1;
    }
  }
  return 0;
}

static const char *const phase_names[2] = {"decode", "prefill"};

/* --json: one "simulate" line with both phases (a phase not simulated is null), then with
 * --layers-detail one "simulate-layer" line per phase and MoE layer. */
static void print_result_json(const sim_opts *o, const pl_sim_input *in, const pl_sim_result *r) {
  const uint32_t N = in->n_hosts;
  const pl_sim_phase *ph[2] = {&r->decode, &r->prefill};
  const char *const *pn = phase_names;
  printf("{\"bench\": \"simulate\", \"model\": \"%s\", \"hosts\": %u, \"format\": \"%s\", "
         "\"expert_bytes\": %.0f, \"batch\": %u, \"prompt_len\": %u, \"max_deferred\": %u, "
         "\"shared_cores\": %s, \"rpc_fixed_us\": %.2f, \"rpc_per_kb_us\": %.4f, "
         "\"decode_other_us\": %.1f, \"prefill_other_us\": %.1f",
         o->model ? o->model : o->shape, N, o->format, in->expert_bytes, in->batch,
         in->prompt_len, in->max_deferred, in->shared_cores ? "true" : "false",
         in->rpc.fixed_us, in->rpc.per_byte_us * 1024, in->decode_other_us,
         in->prefill_other_us);
  for (int i = 0; i < 2; i++) {
    const pl_sim_phase *p = ph[i];
    if (p->step_us < 0) {
      printf(", \"%s_tok_s\": null", pn[i]);
      continue;
    }
    printf(", \"%s_tok_s\": %.3f, \"%s_step_us\": %.1f, \"%s_bottleneck\": \"%s\", "
           "\"%s_bottleneck_share\": %.3f, \"%s_imbalance\": %.3f, \"%s_shares\": {",
           pn[i], p->tok_s, pn[i], p->step_us, pn[i],
           pl_sim_component_name(in, p->bottleneck), pn[i], p->share[p->bottleneck], pn[i],
           p->imbalance, pn[i]);
    for (uint32_t c = 0; c < 2 + N; c++)
      printf("%s\"%s\": %.4f", c ? ", " : "", pl_sim_component_name(in, (int)c), p->share[c]);
    printf("}, \"%s_host_busy_us\": {", pn[i]);
    for (uint32_t h = 0; h < N; h++)
      printf("%s\"%s\": %.1f", h ? ", " : "", in->hosts[h].name, p->host_busy_us[h]);
    printf("}");
  }
  printf("}\n");
  if (o->layers_detail)
    for (int i = 0; i < 2; i++) {
      if (ph[i]->step_us < 0) continue;
      for (uint32_t l = 0; l < in->num_layers; l++)
        if (!in->is_moe || in->is_moe[l])
          printf("{\"bench\": \"simulate-layer\", \"phase\": \"%s\", \"layer\": %u, "
                 "\"moe_us\": %.2f}\n", pn[i], l, ph[i]->layer_us[l]);
    }
}

/* The text report: the model and inputs, then per phase tokens/s, the bottleneck and the
 * shares (and with --layers-detail each MoE layer's time). */
static void print_result_text(const sim_opts *o, const pl_sim_input *in, const pl_sim_result *r,
                              const mr_model_config *cfg) {
  const uint32_t N = in->n_hosts;
  const pl_sim_phase *ph[2] = {&r->decode, &r->prefill};
  const char *const *pn = phase_names;
  printf("%s: H %u, I %u, %u experts top-%u, %u MoE layers; %s, %.2f MB per expert; %u host%s%s\n",
         o->model ? o->model : o->shape, cfg->hidden_size, cfg->moe_intermediate,
         cfg->num_experts, cfg->top_k, mr_config_num_moe_layers(cfg), o->format,
         in->expert_bytes / 1e6, N, N == 1 ? "" : "s",
         in->shared_cores ? " on the client's cores" : "");
  printf("inputs: rpc %.1f us + %.3f us/KiB; client %.1f us per decode step besides experts\n",
         in->rpc.fixed_us, in->rpc.per_byte_us * 1024, in->decode_other_us);
  for (int i = 0; i < 2; i++) {
    const pl_sim_phase *p = ph[i];
    if (p->step_us < 0) {
      printf("%s: not simulated (no client prefill time: --client-bench or --client-prefill-us)\n",
             pn[i]);
      continue;
    }
    printf("%s: %.2f tok/s (%.1f us per step of %u tokens); bottleneck %s (%.0f %% of the step)",
           pn[i], p->tok_s, p->step_us, i ? in->batch * in->prompt_len : in->batch,
           pl_sim_component_name(in, p->bottleneck), 100 * p->share[p->bottleneck]);
    if (N) printf("; host imbalance %.2f", p->imbalance);
    printf("\n  shares:");
    for (uint32_t c = 0; c < 2 + N; c++)
      printf(" %s %.1f %%", pl_sim_component_name(in, (int)c), 100 * p->share[c]);
    printf("\n");
    if (o->layers_detail)
      for (uint32_t l = 0; l < in->num_layers; l++)
        if (!in->is_moe || in->is_moe[l]) printf("  layer %3u MoE %.1f us\n", l, p->layer_us[l]);
  }
}

static void print_result(const sim_opts *o, const pl_sim_input *in, const pl_sim_result *r,
                         const mr_model_config *cfg) {
  if (o->json) print_result_json(o, in, r);
  else print_result_text(o, in, r, cfg);
}

/* ---- the command, step by step ------------------------------------------------------------
 *
 * pl_cmd_simulate has pl_cmd_apply's shape: a sim_run holds what every step reads and writes,
 * each step fills its part or fails, and one exit path releases it. In order:
 *
 *   step_shape         --model DIR or --shape NAME        -> cfg, the shapes in in
 *   step_stats         --stats FILE                       -> in.counts
 *   step_placement     --placement FILE, --hosts N        -> pl, N, named
 *   step_routes        who computes each pair             -> local[], route[]
 *   step_rates         --kernels, --client-kernels, --host-kernels, --cluster -> rates[], cf
 *   step_hosts         per host: name, rates, speed, link -> hosts[], in's placement
 *   step_rpc           --rpc or --rpc-fixed-us / --rpc-per-kb-us, the client's link
 *   step_client_time   --client-bench or --client-step-us -> what the client measured
 *   step_client_other  measured step less the modelled experts -> in.*_other_us
 *   step_run           pl_sim_run, then the result on stdout
 *
 * A step returns 0, a negative MR_E* code with e filled (exit 1), or SIM_USAGE after printing
 * a usage error itself (exit 2), as the flags' own checks in sim_parse do. */
#define SIM_USAGE 2

typedef struct sim_run {
  sim_opts o;
  mr_model_config cfg;
  pl_stats st;                /* --stats (have_st) */
  mr_placement pl;            /* --placement (have_pl) */
  bool have_st, have_pl;
  bool named;                 /* the hosts are the placement's servers, else h0..h{N-1} */
  uint32_t N;                 /* hosts */
  pl_rates *rates;            /* [0] --kernels, [1] --client-kernels, [2 + i] --host-kernels i */
  pl_sim_host *hosts;         /* [N], at least one entry */
  int32_t *route;             /* [L * E] host index, -1 = several copies or none */
  uint8_t *local;             /* [L * E] 1 = the client computes the pair */
  mr_cluster_file *cf;        /* --cluster: the hosts' speed keys (large: on the heap) */
  double decode_measured_us;  /* the all-local run's decode step (us), -1 = not measured */
  double prefill_measured_us; /* its prefill of batch x prompt_len tokens (us), -1 = none */
  pl_sim_input in;
  pl_sim_result res;
} sim_run;

/* --model DIR (config.json) or --shape NAME: the model's shapes into cfg, and the options
 * that need nothing else into in. */
static int step_shape(sim_run *r, mr_err *e) {
  const sim_opts *o = &r->o;
  if (o->model) {
    int rc = mr_config_load(&r->cfg, o->model, e);
    if (rc) return rc;
  } else if (builtin_shape(o->shape, o->moe_layers, &r->cfg)) {
    return SIM_USAGE;
  }
  pl_sim_input *in = &r->in;
  in->hidden = r->cfg.hidden_size;
  in->inter = r->cfg.moe_intermediate;
  in->num_experts = r->cfg.num_experts;
  in->top_k = r->cfg.top_k;
  in->num_layers = r->cfg.num_layers;
  in->is_moe = r->cfg.is_moe;
  in->expert_bytes = o->expert_bytes > 0 ? o->expert_bytes
                                         : pl_sim_expert_bytes(o->format, in->hidden, in->inter);
  in->wire_bytes = strcmp(o->wire, "f32") == 0 ? 4 : 2;
  in->max_deferred = o->max_deferred;
  in->shared_cores = o->shared;
  in->samples = o->samples;
  in->seed = o->seed;
  return 0;
}

/* --stats FILE: routing frequencies of the model's shape (none: uniform routing). */
static int step_stats(sim_run *r, mr_err *e) {
  if (!r->o.stats) return 0;
  int rc = pl_stats_load(&r->st, r->o.stats, e);
  if (rc) return rc;
  r->have_st = true;
  if (r->st.num_layers != r->cfg.num_layers || r->st.num_experts != r->cfg.num_experts)
    return mr_err_set(e, MR_EMISMATCH, "%s: %u layers x %u experts, the model has %u x %u",
                      r->o.stats, r->st.num_layers, r->st.num_experts, r->cfg.num_layers,
                      r->cfg.num_experts);
  r->in.counts = r->st.counts;
  return 0;
}

/* --placement FILE and --hosts N: the host count. A placement that names servers makes them
 * the hosts (--hosts, if given, must agree); one that names none (all local) or no placement
 * leaves --hosts N anonymous hosts. */
static int step_placement(sim_run *r, mr_err *e) {
  const sim_opts *o = &r->o;
  uint32_t N = 0;
  if (o->placement) {
    int rc = mr_placement_load(&r->pl, o->placement, e);
    if (rc) return rc;
    r->have_pl = true;
    if (r->pl.num_layers != r->cfg.num_layers || r->pl.num_experts != r->cfg.num_experts)
      return mr_err_set(e, MR_EMISMATCH, "%s: %u layers x %u experts, the model has %u x %u",
                        o->placement, r->pl.num_layers, r->pl.num_experts, r->cfg.num_layers,
                        r->cfg.num_experts);
    N = r->pl.n_servers;
    if (o->hosts && N && o->hosts != N) {
      fprintf(stderr, PROG ": --hosts %u, but %s names %u servers\n", o->hosts, o->placement, N);
      return SIM_USAGE;
    }
  }
  r->named = N > 0;
  r->N = N ? N : o->hosts;
  return 0;
}

/* Who computes each pair: the placement's local set and single-copy routes; with anonymous
 * hosts, expert x of every layer goes to host x * N / E (N contiguous ranges). Allocates the
 * per-host and per-pair arrays. */
static int step_routes(sim_run *r, mr_err *e) {
  const uint32_t N = r->N, E = r->cfg.num_experts;
  const size_t LE = (size_t)r->cfg.num_layers * E;
  r->hosts = mr_calloc(N ? N : 1, sizeof *r->hosts);
  r->rates = mr_calloc(2 + r->o.n_hk, sizeof *r->rates);
  r->route = mr_malloc(LE * sizeof *r->route);
  r->local = mr_calloc(LE, 1);
  if (!r->hosts || !r->rates || !r->route || !r->local)
    return mr_err_set(e, MR_ENOMEM, "out of memory");
  for (size_t p = 0; p < LE; p++) {
    if (r->have_pl) {
      r->local[p] = r->pl.local[p];
      r->route[p] = r->named ? r->pl.route[p] : -1;
    } else {
      r->route[p] = -1;
    }
    if (!r->named && N && !r->local[p]) r->route[p] = (int32_t)((p % E) * N / E);
  }
  return 0;
}

/* The kernel rates files (of --rates-format, default --format) and the cluster file. The
 * client's own rates are --client-kernels, else --kernels (none: no local expert allowed). */
static int step_rates(sim_run *r, mr_err *e) {
  const sim_opts *o = &r->o;
  const char *rfmt = o->rates_format ? o->rates_format : o->format;
  int rc;
  if (o->kernels && (rc = pl_rates_load(&r->rates[0], o->kernels, rfmt, e))) return rc;
  if (o->client_kernels && (rc = pl_rates_load(&r->rates[1], o->client_kernels, rfmt, e)))
    return rc;
  for (uint32_t i = 0; i < o->n_hk; i++)
    if ((rc = pl_rates_load(&r->rates[2 + i], o->host_kernels[i].val, rfmt, e))) return rc;
  r->in.client_rates = o->client_kernels ? &r->rates[1] : o->kernels ? &r->rates[0] : NULL;
  if (!o->cluster) return 0;
  if (!(r->cf = mr_malloc(sizeof *r->cf))) return mr_err_set(e, MR_ENOMEM, "out of memory");
  return mr_cluster_load(r->cf, o->cluster, e);
}

/* Host h: its name, its rates (--host-kernels NAME=FILE, else --kernels), its speed (the
 * cluster file's "speed", then --speed NAME=X) and its link (--link-gbps and
 * --link-latency-us, then --host-link NAME=G[,U]). */
static int host_setup(sim_run *r, uint32_t h) {
  const sim_opts *o = &r->o;
  pl_sim_host *ho = &r->hosts[h];
  if (r->named) snprintf(ho->name, sizeof ho->name, "%s", r->pl.server[h]);
  else snprintf(ho->name, sizeof ho->name, "h%u", h);
  const kv *k = kv_find(o->host_kernels, o->n_hk, ho->name);
  ho->rates = k ? &r->rates[2 + (k - o->host_kernels)] : o->kernels ? &r->rates[0] : NULL;
  ho->speed = 1.0;
  for (uint32_t c = 0; r->cf && c < r->cf->n_servers; c++)
    if (strcmp(r->cf->servers[c].name, ho->name) == 0) ho->speed = r->cf->servers[c].speed;
  if ((k = kv_find(o->speed, o->n_speed, ho->name)) &&
      parse_num("--speed", k->val, 1e-6, 1e6, &ho->speed))
    return SIM_USAGE;
  ho->link_gbps = o->link_gbps;
  ho->link_latency_us = o->latency;
  if ((k = kv_find(o->host_link, o->n_hl, ho->name))) {
    char buf[128];
    snprintf(buf, sizeof buf, "%s", k->val);
    char *comma = strchr(buf, ',');
    if (comma) *comma = '\0';
    if (parse_num("--host-link (Gbit/s)", buf, 0, 1e6, &ho->link_gbps) ||
        (comma && parse_num("--host-link (latency us)", comma + 1, 0, 1e9, &ho->link_latency_us)))
      return SIM_USAGE;
  }
  return 0;
}

/* Every host set up; every NAME of a per-host flag names one; the placement into in. */
static int step_hosts(sim_run *r, mr_err *e) {
  const sim_opts *o = &r->o;
  for (uint32_t h = 0; h < r->N; h++)
    if (host_setup(r, h)) return SIM_USAGE;
  if (kv_check("--host-kernels", o->host_kernels, o->n_hk, r->hosts, r->N) ||
      kv_check("--speed", o->speed, o->n_speed, r->hosts, r->N) ||
      kv_check("--host-link", o->host_link, o->n_hl, r->hosts, r->N))
    return SIM_USAGE;
  r->in.n_hosts = r->N;
  r->in.hosts = r->hosts;
  r->in.local = r->local;
  r->in.route = r->route;
  if (r->have_pl && r->named) { /* replicated pairs: route -1, their hosts in the rep lists */
    r->in.rep_off = r->pl.rep_off;
    r->in.rep = r->pl.rep;
  }
  return 0;
}

/* The cost of a request: fitted to --rpc FILE, or the two flags (default 0); and the
 * client's own link (--client-link-gbps, default --link-gbps). */
static int step_rpc(sim_run *r, mr_err *e) {
  const sim_opts *o = &r->o;
  if (o->rpc) {
    int rc = pl_rpc_load(&r->in.rpc, o->rpc, e);
    if (rc) return rc;
  } else {
    r->in.rpc.fixed_us = o->rpc_fixed > 0 ? o->rpc_fixed : 0;
    r->in.rpc.per_byte_us = o->rpc_kb > 0 ? o->rpc_kb / 1024 : 0; /* us per KiB -> per byte */
  }
  r->in.client_link_gbps = o->client_link >= 0 ? o->client_link : o->link_gbps;
  return 0;
}

/* Batch, prompt length and the client's own time: --client-step-us / --client-prefill-us
 * as given (already without the experts), or an all-local --client-bench run, whose batch
 * and prompt length are the defaults and whose whole step step_client_other splits. Its
 * prefill is used only at the batch and prompt length it was measured at. */
static int step_client_time(sim_run *r, mr_err *e) {
  const sim_opts *o = &r->o;
  pl_sim_input *in = &r->in;
  in->batch = o->batch;
  in->prompt_len = o->prompt_len;
  in->prefill_other_us = -1;
  r->prefill_measured_us = r->decode_measured_us = -1;
  if (!o->client_bench) {
    in->decode_other_us = o->client_step;
    in->prefill_other_us = o->client_prefill;
    return 0;
  }
  pl_client_bench cb;
  int rc = pl_client_bench_load(&cb, o->client_bench, e);
  if (rc) return rc;
  if (!o->batch_set) in->batch = cb.batch;
  if (!o->plen_set) in->prompt_len = cb.prompt_len;
  if (in->batch != cb.batch)
    mr_log(MR_LOG_WARN, "%s was measured at batch %u, simulating batch %u: the client's "
           "time is taken as it is", o->client_bench, cb.batch, in->batch);
  r->decode_measured_us = cb.step_us;
  if (in->batch == cb.batch && in->prompt_len == cb.prompt_len)
    r->prefill_measured_us = (double)cb.batch * cb.prompt_len / cb.prefill_tok_s * 1e6;
  else
    mr_log(MR_LOG_WARN, "%s: prefill measured at batch %u x %u tokens, not simulated at %u x "
           "%u", o->client_bench, cb.batch, cb.prompt_len, in->batch, in->prompt_len);
  return 0;
}

/* The model run all-local: every pair on the client at its rates, no host, nothing
 * deferred, no time besides the experts; prefill only when it was measured. ar is the
 * caller's (pl_sim_result_close). */
static int model_all_local(const sim_run *r, pl_sim_result *ar, mr_err *e) {
  const size_t LE = (size_t)r->cfg.num_layers * r->cfg.num_experts;
  uint8_t *ones = mr_malloc(LE);
  if (!ones) return mr_err_set(e, MR_ENOMEM, "out of memory");
  memset(ones, 1, LE);
  pl_sim_input all = r->in;
  all.local = ones;
  all.route = NULL;
  all.n_hosts = 0;
  all.shared_cores = false;
  all.max_deferred = 0;
  all.decode_other_us = 0;
  all.prefill_other_us = r->prefill_measured_us > 0 ? 0 : -1;
  int rc = pl_sim_run(&all, ar, e);
  mr_free(ones);
  return rc;
}

/* The client's time besides the experts: the measured all-local step less the experts' time
 * by the same model on the client's rates, so that an error in the rates cancels between the
 * all-local run and the simulated one. (The run's per-layer local_us are not used:
 * moerpc-client bench's layer lines include its prefill.) A negative difference (rates
 * faster than the client ran) is taken as 0, with a warning. */
static int step_client_other(sim_run *r, mr_err *e) {
  pl_sim_input *in = &r->in;
  const double dm = r->decode_measured_us, pm = r->prefill_measured_us;
  if (!(dm > 0)) return 0;
  if (!in->client_rates)
    return mr_err_set(e, MR_EINVAL, "the client's own time needs its kernel rates "
                      "(--kernels or --client-kernels) to take the experts out of it");
  pl_sim_result ar;
  int rc = model_all_local(r, &ar, e);
  if (rc) return rc;
  in->decode_other_us = dm - ar.decode.step_us;
  mr_log(MR_LOG_INFO, "client decode step %.0f us measured, experts %.0f us modelled: %.0f us "
         "besides the experts", dm, ar.decode.step_us, in->decode_other_us);
  if (pm > 0) {
    in->prefill_other_us = pm - ar.prefill.step_us;
    mr_log(MR_LOG_INFO, "client prefill %.0f us measured, experts %.0f us modelled: %.0f us "
           "besides the experts", pm, ar.prefill.step_us, in->prefill_other_us);
  }
  pl_sim_result_close(&ar);
  if (in->decode_other_us < 0 || (pm > 0 && in->prefill_other_us < 0)) {
    mr_log(MR_LOG_WARN, "the modelled experts take longer than the measured all-local run "
           "(the kernel rates are faster than the client ran): its time besides the "
           "experts is taken as 0");
    if (in->decode_other_us < 0) in->decode_other_us = 0;
    if (in->prefill_other_us < 0 && pm > 0) in->prefill_other_us = 0;
  }
  return 0;
}

/* The model itself, and its result on stdout. */
static int step_run(sim_run *r, mr_err *e) {
  mr_log(MR_LOG_INFO, "simulating %u hosts, %u MoE layers, batch %u, prompt %u, %u samples",
         r->N, mr_config_num_moe_layers(&r->cfg), r->in.batch, r->in.prompt_len, r->in.samples);
  int rc = pl_sim_run(&r->in, &r->res, e);
  if (!rc) print_result(&r->o, &r->in, &r->res, &r->cfg);
  return rc;
}

static void sim_run_close(sim_run *r) {
  pl_sim_result_close(&r->res);
  if (r->have_pl) mr_placement_close(&r->pl);
  if (r->have_st) pl_stats_close(&r->st);
  mr_free(r->hosts);
  mr_free(r->rates);
  mr_free(r->route);
  mr_free(r->cf);
  mr_free(r->local);
}

int pl_cmd_simulate(int argc, char **argv) {
  sim_run r;
  memset(&r, 0, sizeof r);
  int pr = sim_parse(argc, argv, &r.o);
  if (pr) return pr == 1 ? 0 : 2;
  mr_err e;
  mr_err_clear(&e);
  int rc = step_shape(&r, &e);
  if (!rc) rc = step_stats(&r, &e);
  if (!rc) rc = step_placement(&r, &e);
  if (!rc) rc = step_routes(&r, &e);
  if (!rc) rc = step_rates(&r, &e);
  if (!rc) rc = step_hosts(&r, &e);
  if (!rc) rc = step_rpc(&r, &e);
  if (!rc) rc = step_client_time(&r, &e);
  if (!rc) rc = step_client_other(&r, &e);
  if (!rc) rc = step_run(&r, &e);
  if (rc < 0) fprintf(stderr, PROG ": %s: %s\n", mr_err_name(rc), e.msg);
  sim_run_close(&r);
  return rc == 0 ? 0 : rc == SIM_USAGE ? 2 : 1;
}
