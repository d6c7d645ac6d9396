/*
 * moerpc-client - the command-line face of libmoerpc-client:
 *
 *   moerpc-client info      --cluster FILE           Hello all servers, print the cluster
 *   moerpc-client verify    --cluster FILE [...]     every MoE layer vs a local reference
 *   moerpc-client bench-rpc --cluster FILE [...]     per-request round trip vs raw TCP
 *   moerpc-client stats     --cluster FILE [--reset] Stats of every server
 *   moerpc-client check-host [DIR]                   host settings that cost latency
 *
 * Every subcommand takes --help. Exit status: 0 success, 1 failure (an error, a check that
 * failed), 2 usage error. Lifecycle lines go to stderr through mr_log; results to stdout.
 */
#define _GNU_SOURCE /* sched_setaffinity, CPU_SET */
#include <errno.h>
#include <getopt.h>
#include <sched.h>
#include <math.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "gpu_client/runner/cli.h"
#include "gpu_client/rpc/moerpc_client.h"

#define PROG "moerpc-client"
/* Most values of a --tokens list. */
#define MAX_T_LIST 32
/* Room for a subcommand's help text (its own part and the common options). */
#define HELP_BYTES 8192
/* Room for one line of `info`'s ownership map ("s0:0-7 s1:8-15 local:16-17"). */
#define OWNER_LINE_BYTES 8192

/* ---- shared options ------------------------------------------------------------------- */

typedef struct cli {
  const char *cluster;
  const char *model;
  uint32_t deadline_ms, connect_ms, wait_spin_us;
  bool no_local;
  bool map_weights; /* local experts served in place (gc_options.local_map_weights) */
} cli;

enum { OPT_CLUSTER = 1000, OPT_MODEL, OPT_DEADLINE, OPT_CONNECT, OPT_NO_LOCAL, OPT_LOG,
       OPT_TOKENS, OPT_DTYPE, OPT_SEED, OPT_TOL, OPT_ITERS, OPT_WARMUP, OPT_JSON, OPT_RESET,
       OPT_SERVER, OPT_TOPK, OPT_ALL, OPT_PEER_CPU, OPT_MAP_WEIGHTS, OPT_SPIN, OPT_HELP };

#define COMMON_OPTIONS                                                                 \
  {"cluster", required_argument, NULL, OPT_CLUSTER},                                   \
      {"deadline-ms", required_argument, NULL, OPT_DEADLINE},                          \
      {"connect-timeout-ms", required_argument, NULL, OPT_CONNECT},                    \
      {"wait-spin-us", required_argument, NULL, OPT_SPIN},                             \
      {"log", required_argument, NULL, OPT_LOG}, {"help", no_argument, NULL, OPT_HELP}

/* Writes a subcommand's help: its own text, then the common options. */
static void help_text(char *buf, size_t len, const char *own) {
  snprintf(buf, len,
           "%s"
           "  --cluster FILE           cluster file (JSON: servers, model, local experts;  "
           "required\n"
           "                           TLS and the bearer token file: \"tls\", \"token_file\",\n"
           "                           see gpu_client/README.md)\n"
           "  --deadline-ms N          per-request deadline, 1..%u (default: the file's)\n"
           "  --connect-timeout-ms N   deadline of the Hello round at start, 1..%u (default %u)\n"
           "  --wait-spin-us N         watch for replies N us before sleeping on them, 0..%u\n"
           "                           (default 0; gc_options.wait_spin_us)\n"
           "  --log LEVEL              error|warn|info|debug (default: $MOERPC_LOG, else info)\n"
           "  --help                   this text\n",
           own, MR_CLUSTER_MAX_DEADLINE_MS, MR_CLUSTER_MAX_DEADLINE_MS,
           GC_DEFAULT_CONNECT_TIMEOUT_MS, GC_WAIT_SPIN_MAX_US);
}

/* Handles the options every subcommand shares; returns 1 if taken, 0 if not one of them,
 * -1 on a bad value. */
static int common_opt(void *ctx, int opt, const char *arg) {
  cli *o = ctx;
  int lvl;
  switch (opt) {
  case OPT_CLUSTER: o->cluster = arg; return 1;
  case OPT_DEADLINE:
    return gc__cli_u32("--deadline-ms", arg, 1, MR_CLUSTER_MAX_DEADLINE_MS, &o->deadline_ms) ? 1 : -1;
  case OPT_CONNECT:
    return gc__cli_u32("--connect-timeout-ms", arg, 1, MR_CLUSTER_MAX_DEADLINE_MS, &o->connect_ms)
               ? 1 : -1;
  case OPT_SPIN:
    return gc__cli_u32("--wait-spin-us", arg, 0, GC_WAIT_SPIN_MAX_US, &o->wait_spin_us) ? 1 : -1;
  case OPT_LOG:
    if (mr_log_parse_level(arg, &lvl) != 0) {
      fprintf(stderr, PROG ": --log = \"%s\", must be error, warn, info or debug\n", arg);
      return -1;
    }
    mr_log_set_level(lvl);
    return 1;
  default: return 0;
  }
}

static int open_cluster(const cli *o, gc_cluster **c) {
  gc_options opts;
  mr_err e;
  mr_err_clear(&e);
  gc_options_init(&opts);
  opts.client_name = PROG;
  opts.deadline_ms = o->deadline_ms;
  opts.connect_timeout_ms = o->connect_ms;
  opts.wait_spin_us = o->wait_spin_us;
  opts.model_dir = o->model;
  opts.no_local = o->no_local;
  opts.local_map_weights = o->map_weights;
  int rc = gc_cluster_open(c, o->cluster, &opts, &e);
  if (rc) {
    fprintf(stderr, PROG ": %s: %s\n", mr_err_name(rc), e.msg);
    return rc;
  }
  return 0;
}

/* Parses argv of a subcommand: the cluster flags, then extra's (the subcommand's own).
 * Returns 0 to run, 1 after --help, 2 on a usage error. */
static int parse_args(int argc, char **argv, const struct option *lo, const char *help,
                      cli *o, gc__cli_opt_fn extra, void *ctx) {
  const char *const h[3] = {help, "", ""};
  int rc = gc__cli_getopt(argc, argv, lo, OPT_HELP, h, common_opt, o, extra, ctx);
  if (rc) return rc;
  if (!o->cluster) {
    fprintf(stderr, PROG " %s: --cluster FILE is required (see --help)\n", argv[0]);
    return 2;
  }
  return 0;
}

/* The first step of every subcommand: parse_args with its own help text (own_help, then the
 * common options). Returns -1 to go on, else the exit status (0 after --help, 2 on a usage
 * error). */
static int parse_command(int argc, char **argv, const struct option *lo, const char *own_help,
                         cli *o, gc__cli_opt_fn extra, void *ctx) {
  char help[HELP_BYTES];
  help_text(help, sizeof help, own_help);
  int pr = parse_args(argc, argv, lo, help, o, extra, ctx);
  return pr == 0 ? -1 : pr == 1 ? 0 : 2;
}

/* ---- info -------------------------------------------------------------------------------- */

static const char INFO_HELP[] =
    "usage: moerpc-client info --cluster FILE [options]\n"
    "\n"
    "Hellos every server of the cluster file, checks that they serve one model (fingerprint,\n"
    "shapes, weight format, protocol) and that every layer is covered, then prints the\n"
    "servers, the model and a summary of who computes which experts.\n"
    "\n"
    "  --model DIR              model directory (default: the file's \"model\"); when known,\n"
    "                           its config and fingerprint are checked too\n"
    "  --no-local               ignore the file's \"local\" section\n"
    "  --map-weights            serve the local experts in place from the model's files\n"
    "                           where they are stored as served (as moerpc-server\n"
    "                           --map-weights)\n";

static int info_opt(void *ctx, int opt, const char *arg) {
  cli *o = ctx;
  if (opt == OPT_MODEL) o->model = arg;
  else if (opt == OPT_NO_LOCAL) o->no_local = true;
  else if (opt == OPT_MAP_WEIGHTS) o->map_weights = true;
  else return 0;
  return 1;
}

/* "s0:0-7 s1:8-15 local:16-17" for one layer. */
static void owner_line(const gc_cluster *c, uint32_t l, char *buf, size_t len) {
  gc_cluster_info ci;
  gc_cluster_info_get(c, &ci);
  size_t pos = 0;
  buf[0] = '\0';
  for (int o = -2; o < (int)ci.n_servers; o++) { /* local, none, then servers */
    char list[OWNER_LINE_BYTES];
    mr_idlist w;
    mr_idlist_init(&w, list, sizeof list);
    for (uint32_t x = 0; x < ci.num_experts; x++)
      if (gc_cluster_owner(c, l, x) == o) mr_idlist_add(&w, x);
    if (mr_idlist_end(&w, true) == 0) continue;
    char name[80];
    gc_server_info si;
    if (o == GC_OWNER_LOCAL) snprintf(name, sizeof name, "local");
    else if (o == GC_OWNER_NONE) snprintf(name, sizeof name, "nobody");
    else {
      gc_server_info_get(c, (uint32_t)o, &si, NULL);
      snprintf(name, sizeof name, "%s", si.name);
    }
    int n = snprintf(buf + pos, len - pos, "%s%s:%s", pos ? " " : "", name, list);
    if (n < 0 || (size_t)n >= len - pos) break;
    pos += (size_t)n;
  }
}

static int cmd_info(int argc, char **argv) {
  cli o = {0};
  static const struct option lo[] = {COMMON_OPTIONS,
                                      {"model", required_argument, NULL, OPT_MODEL},
                                      {"no-local", no_argument, NULL, OPT_NO_LOCAL},
                                      {"map-weights", no_argument, NULL, OPT_MAP_WEIGHTS},
                                      {0, 0, 0, 0}};
  int pr = parse_command(argc, argv, lo, INFO_HELP, &o, info_opt, &o);
  if (pr >= 0) return pr;
  gc_cluster *c = NULL;
  if (open_cluster(&o, &c)) return 1;
  gc_cluster_info ci;
  gc_cluster_info_get(c, &ci);
  printf("cluster %s: %u server%s\n", o.cluster, ci.n_servers, ci.n_servers == 1 ? "" : "s");
  printf("model: fingerprint %s, hidden %u, intermediate %u, layers %u, experts %u, weights %s\n",
         ci.model_fingerprint, ci.hidden_size, ci.intermediate_size, ci.num_layers,
         ci.num_experts, ci.weight_format);
  printf("model dir: %s\n", ci.model_dir[0] ? ci.model_dir : "(none: not checked locally)");
  printf("max_tokens per request: %u (smallest of all servers); deadline %u ms; local pairs "
         "%llu (%llu in place)\n", ci.max_tokens, ci.deadline_ms,
         (unsigned long long)ci.local_pairs, (unsigned long long)ci.local_mapped);
  for (uint32_t i = 0; i < ci.n_servers; i++) {
    gc_server_info si;
    gc_server_info_get(c, i, &si, NULL);
    if (si.alias_of >= 0) { /* one process under a second address: counted once */
      gc_server_info orig;
      gc_server_info_get(c, (uint32_t)si.alias_of, &orig, NULL);
      printf("server %-12s %-22s the same server as %s (%s, instance %s): counted once, no "
             "traffic, no replica\n", si.name, si.address, orig.name, orig.address,
             si.instance_id);
      continue;
    }
    printf("server %-12s %-22s protocol %u.%u  max_tokens %-6u announced %llu pairs, assigned "
           "%llu%s%s\n", si.name, si.address, si.protocol_major, si.protocol_minor, si.max_tokens,
           (unsigned long long)si.announced_pairs, (unsigned long long)si.assigned_pairs,
           si.instance_id[0] ? ", instance " : "", si.instance_id);
  }
  /* Ownership, consecutive layers with the same owners on one line. */
  printf("ownership:\n");
  char prev[OWNER_LINE_BYTES] = "", cur[OWNER_LINE_BYTES];
  uint32_t first = 0;
  for (uint32_t l = 0; l <= ci.num_layers; l++) {
    if (l < ci.num_layers) owner_line(c, l, cur, sizeof cur);
    if (l == ci.num_layers || strcmp(cur, prev) != 0) {
      if (l > 0) {
        if (first == l - 1) printf("  layer  %-9u %s\n", first, prev[0] ? prev : "(no experts)");
        else {
          char range[32];
          snprintf(range, sizeof range, "%u-%u", first, l - 1);
          printf("  layers %-9s %s\n", range, prev[0] ? prev : "(no experts)");
        }
      }
      first = l;
      snprintf(prev, sizeof prev, "%s", cur);
    }
  }
  /* Replication: how many servers hold each served pair (failover needs two). */
  enum { MAX_REP = 8 };
  uint64_t by_rep[MAX_REP + 1] = {0};
  uint64_t local = 0;
  uint32_t single_layer = UINT32_MAX, single_expert = 0;
  for (uint32_t l = 0; l < ci.num_layers; l++)
    for (uint32_t x = 0; x < ci.num_experts; x++) {
      int own = gc_cluster_owner(c, l, x);
      if (own == GC_OWNER_LOCAL || own == GC_OWNER_CALLER) {
        local++;
        continue;
      }
      if (own < 0) continue; /* dense layer or nobody */
      uint32_t n = 0;
      for (uint32_t i = 0; i < ci.n_servers; i++) n += gc_server_announces(c, i, l, x);
      by_rep[n < MAX_REP ? n : MAX_REP]++;
      if (n == 1 && single_layer == UINT32_MAX) {
        single_layer = l;
        single_expert = x;
      }
    }
  printf("replication:");
  for (uint32_t n = 1; n <= MAX_REP; n++)
    if (by_rep[n])
      printf(" %llu pairs on %u%s server%s;", (unsigned long long)by_rep[n], n,
             n == MAX_REP ? "+" : "", n == 1 ? "" : "s");
  printf(" %llu local; failover after %u ms of silence\n", (unsigned long long)local,
         ci.failover_ms);
  if (single_layer != UINT32_MAX)
    printf("  (pairs on one server have no failover: e.g. layer %u expert %u)\n", single_layer,
           single_expert);
  mr_log(MR_LOG_INFO, "info done; closing");
  gc_cluster_close(c);
  return 0;
}

/* ---- stats -------------------------------------------------------------------------------- */

static const char STATS_HELP[] =
    "usage: moerpc-client stats --cluster FILE [--reset] [--all]\n"
    "\n"
    "Calls Stats on every server: requests and errors it served, and tokens routed to each\n"
    "(layer, expert) it owns. Prints per layer the total tokens and the hottest expert.\n"
    "\n"
    "  --reset                  ask each server to zero its counters after answering\n"
    "  --all                    print every (layer, expert, tokens) count\n";

typedef struct stats_ctx {
  bool reset, all;
} stats_ctx;

static int stats_opt(void *ctx, int opt, const char *arg) {
  stats_ctx *s = ctx;
  if (opt == OPT_RESET) s->reset = true;
  else if (opt == OPT_ALL) s->all = true;
  else return 0;
  return 1;
}

static int cmd_stats(int argc, char **argv) {
  cli o = {0};
  stats_ctx sc = {0};
  static const struct option lo[] = {COMMON_OPTIONS,
                                      {"reset", no_argument, NULL, OPT_RESET},
                                      {"all", no_argument, NULL, OPT_ALL},
                                      {0, 0, 0, 0}};
  int pr = parse_command(argc, argv, lo, STATS_HELP, &o, stats_opt, &sc);
  if (pr >= 0) return pr;
  o.no_local = true; /* stats needs no local experts */
  gc_cluster *c = NULL;
  if (open_cluster(&o, &c)) return 1;
  gc_cluster_info ci;
  gc_cluster_info_get(c, &ci);
  int status = 0;
  for (uint32_t i = 0; i < ci.n_servers; i++) {
    gc_server_info si;
    gc_stats st;
    mr_err e;
    gc_server_info_get(c, i, &si, NULL);
    if (si.alias_of >= 0) { /* the same process as an earlier entry: its counts are those */
      printf("server %s (%s): the same server as entry %d (instance %s), not asked twice\n",
             si.name, si.address, si.alias_of, si.instance_id);
      continue;
    }
    int rc = gc_cluster_stats(c, i, sc.reset, &st, &e);
    if (rc) {
      fprintf(stderr, PROG ": %s: %s\n", mr_err_name(rc), e.msg);
      status = 1;
      continue;
    }
    printf("server %s (%s): requests %llu, errors %llu, %zu expert counts%s\n", si.name,
           si.address, (unsigned long long)st.requests, (unsigned long long)st.errors,
           st.n_counts, sc.reset ? " (now reset)" : "");
    for (uint32_t l = 0; l < ci.num_layers; l++) {
      uint64_t total = 0, best = 0;
      uint32_t best_x = 0, touched = 0;
      for (size_t k = 0; k < st.n_counts; k++) {
        if (st.counts[k].layer != l) continue;
        total += st.counts[k].tokens;
        touched += st.counts[k].tokens > 0;
        if (st.counts[k].tokens > best) {
          best = st.counts[k].tokens;
          best_x = st.counts[k].expert;
        }
      }
      if (total)
        printf("  layer %-4u tokens %-10llu experts used %-5u hottest expert %u (%llu)\n", l,
               (unsigned long long)total, touched, best_x, (unsigned long long)best);
    }
    if (sc.all)
      for (size_t k = 0; k < st.n_counts; k++)
        printf("  count layer %u expert %u tokens %llu\n", st.counts[k].layer,
               st.counts[k].expert, (unsigned long long)st.counts[k].tokens);
    gc_stats_close(&st);
  }
  gc_cluster_close(c);
  return status;
}

/* ---- random numbers ------------------------------------------------------------------------ */

static uint64_t splitmix64(uint64_t *x) {
  uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
/* Uniform in (0, 1]. */
static double unif(uint64_t *s) { return ((double)(splitmix64(s) >> 11) + 1.0) / 9007199254740992.0; }
/* Standard normal (Box-Muller). */
static float gauss(uint64_t *s) {
  double u1 = unif(s), u2 = unif(s);
  return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

/* ---- verify -------------------------------------------------------------------------------- */

static const char VERIFY_HELP[] =
    "usage: moerpc-client verify --cluster FILE [--model DIR] [options]\n"
    "\n"
    "For every MoE layer of the model: T random hidden states x ~ N(0,1) (deterministic by\n"
    "--seed), routed by the model's own router (softmax over mlp.gate.weight . x, top-k,\n"
    "renormalised when the config says norm_topk_prob), sent through the cluster, and\n"
    "compared with a local reference: the layer's experts packed in the SAME weight format\n"
    "the servers report (bf16, int8, int4-g64, ...) and computed by kn_ref (fp32 math).\n"
    "Edge cases in every layer: the last token has all slots empty (its output must be 0),\n"
    "and a second call with T=1. One line per layer (layer, T, relative L2 error, round\n"
    "trip), then a summary. Only one layer's experts are held at a time.\n"
    "\n"
    "Default tolerance (relative L2 of the layer output): the reference computes the same\n"
    "stored weights in fp32, so what is left is (a) the wire and (b) the servers' kernels,\n"
    "and the default is the larger of the two terms:\n"
    "  (a) f32 wire 1e-5 (summation order only); f16 wire 2e-3 (11-bit mantissa: 2^-12\n"
    "      relative rounding per element of x and of each server's partial sum); bf16 wire\n"
    "      1e-2 (8-bit mantissa, 2^-9 per element, same reasoning).\n"
    "  (b) f32/f16 weights 1e-5 (the fast kernels compute in fp32); bf16 weights 1e-2 (with\n"
    "      AVX512_BF16 the kernel rounds x and the hidden activation to bf16, ~3e-3; fp8-b128\n"
    "      weights the same, its kernel also runs on bf16 x and h);\n"
    "      int8/int4 weights 5e-2 (the VNNI kernels quantize x and the hidden activation to\n"
    "      int8 per token, ~2.5e-2 measured on small models).\n"
    "A real fault (a wrong expert, row or slot) gives errors of order 1.\n"
    "\n"
    "  --model DIR              model directory (default: the file's \"model\")   required\n"
    "  --tokens N               tokens per layer call, 1..4096 (default 8)\n"
    "  --dtype f32|f16|bf16     wire dtype of hidden states and replies (default f32)\n"
    "  --seed S                 seed of the hidden states (default 1)\n"
    "  --tol X                  fail above this relative L2 error (default: above)\n"
    "  --no-local               ignore the file's \"local\" section\n"
    "  --map-weights            serve the local experts in place from the model's files\n"
    "                           where they are stored as served (as moerpc-server\n"
    "                           --map-weights)\n"
    "Exit status 1 if any layer is above the tolerance or any call fails.\n";

typedef struct verify_ctx {
  cli *o;
  uint32_t T;
  mr_dtype dt;
  uint64_t seed;
  double tol;
  bool tol_set;
} verify_ctx;

static int verify_opt(void *ctx, int opt, const char *arg) {
  verify_ctx *v = ctx;
  char *end = NULL;
  switch (opt) {
  case OPT_MODEL: v->o->model = arg; return 1;
  case OPT_NO_LOCAL: v->o->no_local = true; return 1;
  case OPT_MAP_WEIGHTS: v->o->map_weights = true; return 1;
  case OPT_TOKENS: return gc__cli_u32("--tokens", arg, 1, 4096, &v->T) ? 1 : -1;
  case OPT_SEED: return gc__cli_u64("--seed", arg, 0, UINT64_MAX, &v->seed) ? 1 : -1;
  case OPT_DTYPE:
    if (mr_dtype_parse(arg, &v->dt) != 0) {
      fprintf(stderr, PROG ": --dtype = \"%s\", must be f32, f16 or bf16\n", arg);
      return -1;
    }
    return 1;
  case OPT_TOL:
    v->tol = strtod(arg, &end);
    if (!*arg || *end || !(v->tol > 0) || v->tol > 1e3) {
      fprintf(stderr, PROG ": --tol = \"%s\", must be a number in (0, 1000]\n", arg);
      return -1;
    }
    v->tol_set = true;
    return 1;
  default: return 0;
  }
}

/* Router: softmax over W x, the k largest (ties: lower id), renormalised if asked. */
static void route(const float *W, uint32_t E, uint32_t H, const float *x, uint32_t k, bool norm,
                  float *prob, int32_t *ids, float *w) {
  float mx = -INFINITY;
  for (uint32_t x_ = 0; x_ < E; x_++) {
    double acc = 0;
    for (uint32_t h = 0; h < H; h++) acc += (double)W[(size_t)x_ * H + h] * x[h];
    prob[x_] = (float)acc;
    if (prob[x_] > mx) mx = prob[x_];
  }
  double sum = 0;
  for (uint32_t x_ = 0; x_ < E; x_++) sum += prob[x_] = expf(prob[x_] - mx);
  for (uint32_t x_ = 0; x_ < E; x_++) prob[x_] = (float)(prob[x_] / sum);
  double sel = 0;
  for (uint32_t j = 0; j < k; j++) {
    int32_t best = -1;
    for (uint32_t x_ = 0; x_ < E; x_++) {
      bool taken = false;
      for (uint32_t jj = 0; jj < j; jj++) taken |= ids[jj] == (int32_t)x_;
      if (!taken && (best < 0 || prob[x_] > prob[best])) best = (int32_t)x_;
    }
    ids[j] = best;
    w[j] = prob[best];
    sel += w[j];
  }
  if (norm && sel > 0)
    for (uint32_t j = 0; j < k; j++) w[j] = (float)(w[j] / sel);
}

/* Default tolerance (relative L2) of a layer: the larger of the wire's rounding and the
 * servers' kernels' (VERIFY_HELP gives the reasons). */
static double verify_default_tol(mr_dtype wire, kn_format weights) {
  double w = wire == MR_DTYPE_F32 ? 1e-5 : wire == MR_DTYPE_F16 ? 2e-3 : 1e-2;
  double k = weights == KN_FMT_F32 || weights == KN_FMT_F16 ? 1e-5
             : weights == KN_FMT_BF16 || weights == KN_FMT_FP8 ? 1e-2
                                                          : 5e-2;
  return w > k ? w : k;
}

/* Everything one verify run holds: the cluster, the model, the reference engine and the
 * buffers of one layer call (T tokens). Filled by verify_setup, freed by verify_close. */
typedef struct verify_run {
  const verify_ctx *v;
  gc_cluster *c;
  gc_cluster_info ci;
  mr_model_config cfg;
  mr_st *st;
  kn_engine *eng;            /* the reference (KN_ISA_REF, one thread) */
  kn_format fmt;             /* the servers' weight format, which the reference packs too */
  uint32_t group;
  uint32_t H, E, T, k;
  float *W;                  /* [E, H] the router of the current layer, fp32 */
  float *xf, *prob, *wts;    /* [T, H] x as fp32; [E] router probabilities; [T, k] weights */
  int32_t *ids;              /* [T, k] */
  void *xw;                  /* [T, H] x in the wire dtype */
  float *out, *out_ref;      /* [T, H] the cluster's and the reference's output */
  uint64_t seed;
} verify_run;

/* One layer's outcome. */
typedef struct verify_layer_result {
  double rel, rel1;          /* relative L2 at T and at T = 1 (NAN if not measured) */
  double rtt_ms;             /* the T-token call's submit + wait */
  bool empty_ok;             /* the all-empty token's output row is exactly 0 */
  int call_rc;               /* the cluster's error (0: both calls answered) */
  bool call_rc_t1;           /* ... and it was the T = 1 call's */
  mr_err call_err;
} verify_layer_result;

static void verify_close(verify_run *r) {
  kn_engine_free(r->eng);
  mr_st_close(r->st);
  free(r->W);
  free(r->xf);
  free(r->xw);
  free(r->out);
  free(r->out_ref);
  free(r->prob);
  free(r->ids);
  free(r->wts);
}

/* Step 1: the model, the reference engine, the tolerance, the buffers. */
static int verify_setup(verify_run *r, verify_ctx *v, mr_err *e) {
  int rc;
  if ((rc = gc_weight_format_parse(r->ci.weight_format, &r->fmt, &r->group, e)) ||
      (rc = mr_config_load(&r->cfg, r->ci.model_dir, e)) ||
      (rc = mr_st_open(&r->st, r->ci.model_dir, e)))
    return rc;
  if (!v->tol_set) v->tol = verify_default_tol(v->dt, r->fmt);
  kn_engine_opts eo = {.isa = KN_ISA_REF, .threads = 1};
  if ((rc = kn_engine_new(&r->eng, &eo, e))) return rc;

  r->H = r->ci.hidden_size;
  r->E = r->ci.num_experts;
  r->T = v->T;
  r->k = r->cfg.top_k;
  r->seed = v->seed;
  const size_t TH = (size_t)r->T * r->H, Tk = (size_t)r->T * r->k;
  r->W = malloc((size_t)r->E * r->H * sizeof *r->W);
  r->xf = malloc(TH * sizeof *r->xf);
  r->xw = malloc(TH * mr_dtype_size(v->dt));
  r->out = malloc(TH * sizeof *r->out);
  r->out_ref = malloc(TH * sizeof *r->out_ref);
  r->prob = malloc(r->E * sizeof *r->prob);
  r->ids = malloc(Tk * sizeof *r->ids);
  r->wts = malloc(Tk * sizeof *r->wts);
  if (!r->W || !r->xf || !r->xw || !r->out || !r->out_ref || !r->prob || !r->ids || !r->wts)
    return mr_err_set(e, MR_ENOMEM, "verify buffers: out of memory");
  return 0;
}

/* Step 2 of a layer: T random hidden states, routed by the layer's own router on what the
 * servers will see (x rounded to the wire dtype); the last token (T >= 2) gets no slot. */
static int verify_inputs(verify_run *r, uint32_t l, mr_err *e) {
  const uint32_t H = r->H, E = r->E, T = r->T, k = r->k;
  char key[256];
  snprintf(key, sizeof key,
           r->cfg.arch == MR_ARCH_MIXTRAL ? "model.layers.%u.block_sparse_moe.gate.weight"
                                          : "model.layers.%u.mlp.gate.weight",
           l);
  const mr_st_tensor *rt;
  const uint64_t rshape[2] = {E, H};
  int rc = mr_st_expect(r->st, key, 2, rshape, &rt, e);
  if (rc) return rc;
  mr_convert_to_f32(r->W, rt->data, rt->dtype, (size_t)E * H);

  for (size_t i = 0; i < (size_t)T * H; i++) r->xf[i] = gauss(&r->seed);
  mr_convert_from_f32(r->xw, r->v->dt, r->xf, (size_t)T * H);
  mr_convert_to_f32(r->xf, r->xw, r->v->dt, (size_t)T * H);
  for (uint32_t t = 0; t < T; t++)
    route(r->W, E, H, r->xf + (size_t)t * H, k, r->cfg.norm_topk_prob, r->prob,
          r->ids + (size_t)t * k, r->wts + (size_t)t * k);
  if (T >= 2)
    for (uint32_t j = 0; j < k; j++) r->ids[(size_t)(T - 1) * k + j] = -1;
  return 0;
}

/* Step 3 of a layer: its experts packed in the servers' format, for kn_ref. */
static int verify_layer_ref(const verify_run *r, uint32_t l, kn_layer **out, mr_err *e) {
  kn_layer_desc d = {.hidden = r->H, .inter = r->ci.intermediate_size,
                     .num_experts = r->E, .format = r->fmt, .group = r->group};
  int rc = kn_layer_new(out, r->eng, &d, e);
  for (uint32_t x = 0; x < r->E && !rc; x++) {
    const mr_st_tensor *t[3], *sc[3];
    rc = mr_config_expert_tensors_q(&r->cfg, r->st, l, x, t, sc, e);
    if (!rc) rc = kn_layer_load_expert_st(*out, x, t, sc, e);
  }
  return rc;
}

/* Step 4 of a layer: the call through the cluster at T tokens and at T = 1, each against
 * kn_ref on the same inputs. A failed cluster call is the layer's result (res->call_rc);
 * the return value is a failure of the reference itself. */
static int verify_compare(verify_run *r, uint32_t l, const kn_layer *ref, verify_layer_result *res,
                          mr_err *e) {
  const uint32_t H = r->H, T = r->T;
  gc_layer_req q = {.layer = l, .n_tokens = T, .top_k = r->k, .ids = r->ids, .weights = r->wts,
                    .x = r->xw, .dtype = r->v->dt};
  kn_moe_args a = {.n_tokens = T, .top_k = r->k, .ids = r->ids, .weights = r->wts, .x = r->xw,
                   .x_dtype = r->v->dt, .out = r->out_ref};
  res->rel = res->rel1 = NAN;
  uint64_t t0 = mr_now_ns();
  res->call_rc = gc_layer_forward(r->c, &q, r->out, &res->call_err);
  res->rtt_ms = (double)(mr_now_ns() - t0) / 1e6;
  if (res->call_rc) return 0;
  int rc = kn_ref_moe_forward(ref, &a, e);
  if (rc) return rc;
  res->rel = kn_rel_l2(r->out, r->out_ref, (size_t)T * H);
  res->empty_ok = true;
  if (T >= 2)
    for (uint32_t h = 0; h < H; h++) res->empty_ok &= r->out[(size_t)(T - 1) * H + h] == 0.0f;

  /* T = 1: the first token alone. */
  q.n_tokens = a.n_tokens = 1;
  res->call_rc = gc_layer_forward(r->c, &q, r->out, &res->call_err);
  res->call_rc_t1 = res->call_rc != 0;
  if (res->call_rc) return 0;
  if ((rc = kn_ref_moe_forward(ref, &a, e))) return rc;
  res->rel1 = kn_rel_l2(r->out, r->out_ref, H);
  return 0;
}

/* Step 5 of a layer: its line of the table; true if it passed. */
static bool verify_report_layer(const verify_run *r, uint32_t l, const verify_layer_result *res) {
  if (res->call_rc && !res->call_rc_t1) {
    printf("%-6u %-5u %-12s %-12s %-9.3f FAIL %s: %s\n", l, r->T, "-", "-", res->rtt_ms,
           mr_err_name(res->call_rc), res->call_err.msg);
    return false;
  }
  if (res->call_rc) {
    printf("%-6u %-5u %-12.3e %-12s %-9.3f FAIL (T=1) %s: %s\n", l, r->T, res->rel, "-",
           res->rtt_ms, mr_err_name(res->call_rc), res->call_err.msg);
    return false;
  }
  bool ok = res->rel <= r->v->tol && res->rel1 <= r->v->tol && res->empty_ok;
  printf("%-6u %-5u %-12.3e %-12.3e %-9.3f %s%s\n", l, r->T, res->rel, res->rel1, res->rtt_ms,
         ok ? "ok" : "FAIL", res->empty_ok ? "" : " (empty token's output is not 0)");
  return ok;
}

static int cmd_verify(int argc, char **argv) {
  cli o = {0};
  verify_ctx v = {.o = &o, .T = 8, .dt = MR_DTYPE_F32, .seed = 1};
  static const struct option lo[] = {COMMON_OPTIONS,
                                      {"model", required_argument, NULL, OPT_MODEL},
                                      {"no-local", no_argument, NULL, OPT_NO_LOCAL},
                                      {"map-weights", no_argument, NULL, OPT_MAP_WEIGHTS},
                                      {"tokens", required_argument, NULL, OPT_TOKENS},
                                      {"dtype", required_argument, NULL, OPT_DTYPE},
                                      {"seed", required_argument, NULL, OPT_SEED},
                                      {"tol", required_argument, NULL, OPT_TOL},
                                      {0, 0, 0, 0}};
  int pr = parse_command(argc, argv, lo, VERIFY_HELP, &o, verify_opt, &v);
  if (pr >= 0) return pr;

  verify_run r = {.v = &v};
  kn_layer *ref = NULL;
  mr_err e;
  mr_err_clear(&e);
  int status = 1, rc = 0;
  if (open_cluster(&o, &r.c)) return 1;
  gc_cluster_info_get(r.c, &r.ci);
  if (!r.ci.model_dir[0]) {
    fprintf(stderr, PROG " verify: needs the model: set \"model\" in the cluster file or pass "
            "--model DIR\n");
    goto out;
  }
  if ((rc = verify_setup(&r, &v, &e))) goto out_err;
  mr_log(MR_LOG_INFO, "verify: %u MoE layers, T=%u, k=%u, wire %s, reference format %s, tol %g",
         mr_config_num_moe_layers(&r.cfg), r.T, r.k, mr_dtype_name(v.dt), r.ci.weight_format,
         v.tol);
  printf("%-6s %-5s %-12s %-12s %-9s %s\n", "layer", "T", "rel_l2", "rel_l2(T=1)", "rtt_ms",
         "result");

  double worst = 0;
  uint32_t worst_layer = 0, n_layers = 0, n_fail = 0;
  for (uint32_t l = 0; l < r.cfg.num_layers; l++) {
    if (!mr_config_is_moe_layer(&r.cfg, l)) continue;
    n_layers++;
    verify_layer_result res = {0};
    if ((rc = verify_inputs(&r, l, &e)) || (rc = verify_layer_ref(&r, l, &ref, &e)) ||
        (rc = verify_compare(&r, l, ref, &res, &e)))
      goto out_err;
    if (!verify_report_layer(&r, l, &res)) n_fail++;
    double lw = res.rel > res.rel1 ? res.rel : res.rel1;
    if (!res.call_rc && (lw > worst || n_layers == 1)) {
      worst = lw;
      worst_layer = l;
    }
    fflush(stdout);
    kn_layer_free(ref);
    ref = NULL;
  }
  printf("verify: %u MoE layers, %u failed; worst rel_l2 %.3e (layer %u); tol %g (%s wire, "
         "%s weights)\n", n_layers, n_fail, worst, worst_layer, v.tol, mr_dtype_name(v.dt),
         r.ci.weight_format);
  status = n_fail ? 1 : 0;
  goto out;
out_err:
  fprintf(stderr, PROG " verify: %s: %s\n", mr_err_name(rc), e.msg);
  status = 1;
out:
  kn_layer_free(ref);
  verify_close(&r);
  mr_log(MR_LOG_INFO, "verify done (%s); closing", status ? "FAILED" : "passed");
  gc_cluster_close(r.c);
  return status;
}

/* ---- bench-rpc ------------------------------------------------------------------------------ */

static const char BENCH_HELP[] =
    "usage: moerpc-client bench-rpc --cluster FILE [options]\n"
    "\n"
    "Per-request round trip of one whole layer call to ONE server (every token routed to\n"
    "experts that server owns in one layer, so the call is one ForwardRequest), measured as\n"
    "submit + wait, against a raw TCP ping-pong of the same request and reply byte counts\n"
    "in the same run (a forked child on 127.0.0.1, TCP_NODELAY). Loopback only.\n"
    "Prints p50 / p99 / mean in microseconds per T, the ratio of the p50s, the server's own\n"
    "compute time (p50 of the compute_us it reports) and the p50 of round trip minus compute\n"
    "per request (what transport, framing and queueing cost; compare it with tcp_p50).\n"
    "tcp_held is the same ping-pong with the peer holding each reply (busy, on its CPU)\n"
    "for the server's compute p50 of that T, minus the hold: on hosts whose idle CPUs wake\n"
    "slowly (VMs) a round trip that waits costs more than an instant one, and this is the\n"
    "raw TCP cost of a round trip that waits as long as the server computes.\n"
    "The JSON line also splits the round trip: client_submit (gather, encode, queue),\n"
    "client_wake (the reply seen by the client's I/O thread -> the sum in the caller's\n"
    "hands: the thread hop and the scatter), server_own (the server's time with the\n"
    "request, ForwardReply.server_us, less its queue and compute: decode, checks, copies)\n"
    "and transport (requests queued -> reply seen, less server_us: the kernel and gRPC\n"
    "both ways, moerpc's code on neither side; transport_over_tcp = its p50 / tcp_p50).\n"
    "server_own and transport need a protocol 1.5 server (0 from older ones).\n"
    "\n"
    "  --tokens LIST            comma list of T, each 1..server max_tokens (default 1,16,256)\n"
    "  --iters N                measured calls per T, 1..1000000 (default 200)\n"
    "  --warmup N               unmeasured calls first, 0..100000 (default 20)\n"
    "  --dtype bf16|f32|f16     wire dtype (default bf16)\n"
    "  --server NAME            the server to measure (default: the first with experts)\n"
    "  --top-k K                slots per token (default: the model's top_k, else 8; at\n"
    "                           most the experts the server owns in the layer)\n"
    "  --peer-cpu N             pin the TCP peer to CPU N (give the server's CPU when the\n"
    "                           server is pinned, and pin this client with taskset, so\n"
    "                           that both round trips cross the same cores; default: not\n"
    "                           pinned, where the kernel may put both ends on one core)\n"
    "  --json                   also print one JSON line per T\n";

typedef struct bench_ctx {
  uint32_t tokens[MAX_T_LIST];
  uint32_t n_tokens;
  uint32_t iters, warmup, top_k;
  mr_dtype dt;
  const char *server;
  bool json;
  int peer_cpu; /* -1: the TCP peer is not pinned */
  mr_host host; /* what the JSON lines record of the host (CPU, idle polling) */
} bench_ctx;

static int bench_opt(void *ctx, int opt, const char *arg) {
  bench_ctx *b = ctx;
  switch (opt) {
  case OPT_ITERS: return gc__cli_u32("--iters", arg, 1, 1000000, &b->iters) ? 1 : -1;
  case OPT_WARMUP: return gc__cli_u32("--warmup", arg, 0, 100000, &b->warmup) ? 1 : -1;
  case OPT_TOPK: return gc__cli_u32("--top-k", arg, 1, GC_MAX_TOP_K, &b->top_k) ? 1 : -1;
  case OPT_SERVER: b->server = arg; return 1;
  case OPT_JSON: b->json = true; return 1;
  case OPT_PEER_CPU: {
    uint32_t cpu;
    if (!gc__cli_u32("--peer-cpu", arg, 0, CPU_SETSIZE - 1, &cpu)) return -1;
    long online = sysconf(_SC_NPROCESSORS_ONLN);
    if (online > 0 && cpu >= (uint32_t)online) {
      fprintf(stderr, PROG ": --peer-cpu = %u: this machine has %ld CPUs online (0..%ld)\n", cpu,
              online, online - 1);
      return -1;
    }
    b->peer_cpu = (int)cpu;
    return 1;
  }
  case OPT_DTYPE:
    if (mr_dtype_parse(arg, &b->dt) != 0) {
      fprintf(stderr, PROG ": --dtype = \"%s\", must be bf16, f32 or f16\n", arg);
      return -1;
    }
    return 1;
  case OPT_TOKENS: {
    char buf[512];
    snprintf(buf, sizeof buf, "%s", arg);
    b->n_tokens = 0;
    char *rest = buf;
    for (char *tok = strsep(&rest, ","); tok; tok = strsep(&rest, ",")) {
      if (b->n_tokens == MAX_T_LIST) {
        fprintf(stderr, PROG ": --tokens: at most %d values\n", MAX_T_LIST);
        return -1;
      }
      if (!gc__cli_u32("--tokens", tok, 1, GC_MAX_TOKENS, &b->tokens[b->n_tokens++])) return -1;
    }
    if (b->n_tokens == 0) {
      fprintf(stderr, PROG ": --tokens is empty\n");
      return -1;
    }
    return 1;
  }
  default: return 0;
  }
}

static int cmp_u64(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}
/* Percentile by nearest rank of a sorted array. */
static double pct(const uint64_t *v, size_t n, double p) {
  size_t i = (size_t)ceil(p / 100.0 * (double)n);
  if (i < 1) i = 1;
  if (i > n) i = n;
  return (double)v[i - 1];
}
static double mean_u64(const uint64_t *v, size_t n) {
  double s = 0;
  for (size_t i = 0; i < n; i++) s += (double)v[i];
  return n ? s / (double)n : 0;
}

/* The TCP ping-pong peer, forked before gRPC starts any thread (so the child may allocate).
 * Per connection: a 12-byte header (request bytes, reply bytes, hold µs: little-endian
 * u32), then for every request read in full, reply-size bytes back after busy-waiting the
 * hold, until the peer closes. */
static int read_full(int fd, void *buf, size_t n) {
  uint8_t *p = buf;
  while (n) {
    ssize_t r = read(fd, p, n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return -1;
    p += r;
    n -= (size_t)r;
  }
  return 0;
}
static int write_full(int fd, const void *buf, size_t n) {
  const uint8_t *p = buf;
  while (n) {
    ssize_t r = write(fd, p, n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return -1;
    p += r;
    n -= (size_t)r;
  }
  return 0;
}

static void tcp_peer_main(int lfd, int cpu) {
  alarm(3600); /* bounded even if the parent vanished without closing */
  if (cpu >= 0) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    if (sched_setaffinity(0, sizeof set, &set) != 0) { /* a CPU outside our cpuset */
      fprintf(stderr, PROG " bench-rpc: the TCP peer cannot run on CPU %d (--peer-cpu): %s\n",
              cpu, strerror(errno));
      _exit(1);
    }
  }
  for (;;) {
    int fd = accept(lfd, NULL, NULL);
    if (fd < 0) {
      if (errno == EINTR) continue;
      _exit(1);
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    uint32_t hdr[3];
    if (read_full(fd, hdr, sizeof hdr) != 0 || hdr[0] == 0) _exit(0); /* done */
    uint8_t *req = malloc(hdr[0]), *rep = calloc(1, hdr[1] ? hdr[1] : 1);
    if (!req || !rep) _exit(1);
    const uint64_t hold_ns = (uint64_t)hdr[2] * 1000u;
    while (read_full(fd, req, hdr[0]) == 0) {
      for (uint64_t t0 = mr_now_ns(); hold_ns && mr_now_ns() - t0 < hold_ns;) {
      }
      if (write_full(fd, rep, hdr[1]) != 0) break;
    }
    free(req);
    free(rep);
    close(fd);
  }
}

typedef struct tcp_peer {
  pid_t pid;
  int port;
} tcp_peer;

static int tcp_peer_start(tcp_peer *tp, int cpu) {
  int lfd = socket(AF_INET, SOCK_STREAM, 0);
  if (lfd < 0) return -1;
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t al = sizeof a;
  if (bind(lfd, (struct sockaddr *)&a, sizeof a) != 0 || listen(lfd, 4) != 0 ||
      getsockname(lfd, (struct sockaddr *)&a, &al) != 0) {
    close(lfd);
    return -1;
  }
  tp->port = ntohs(a.sin_port);
  fflush(NULL);
  tp->pid = fork();
  if (tp->pid < 0) {
    close(lfd);
    return -1;
  }
  if (tp->pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    tcp_peer_main(lfd, cpu);
    _exit(0);
  }
  close(lfd);
  return 0;
}

static void tcp_peer_stop(tcp_peer *tp) {
  if (tp->pid <= 0) return;
  /* A connection with a zero header tells the peer to exit. */
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)tp->port),
                          .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  if (fd >= 0 && connect(fd, (struct sockaddr *)&a, sizeof a) == 0) {
    uint32_t hdr[3] = {0, 0, 0};
    write_full(fd, hdr, sizeof hdr);
  }
  if (fd >= 0) close(fd);
  int st;
  for (int i = 0; i < 200; i++) { /* 2 s, then SIGKILL our own child */
    if (waitpid(tp->pid, &st, WNOHANG) == tp->pid) {
      tp->pid = 0;
      return;
    }
    usleep(10000);
  }
  kill(tp->pid, SIGKILL);
  waitpid(tp->pid, &st, 0);
  tp->pid = 0;
}

/* n round trips of req_bytes out, reply_bytes back, the peer holding each reply hold_us;
 * lat[i] in µs, the round trip minus the hold. */
static int tcp_pingpong(const tcp_peer *tp, uint32_t req_bytes, uint32_t reply_bytes,
                        uint32_t hold_us, uint32_t warmup, uint32_t n, uint64_t *lat) {
  int rc = -1;
  uint8_t *req = calloc(1, req_bytes), *rep = malloc(reply_bytes ? reply_bytes : 1);
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)tp->port),
                          .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  struct timeval tv = {.tv_sec = 10};
  int one = 1;
  if (!req || !rep || fd < 0) goto out;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) goto out;
  uint32_t hdr[3] = {req_bytes, reply_bytes, hold_us};
  if (write_full(fd, hdr, sizeof hdr) != 0) goto out;
  for (uint32_t i = 0; i < warmup + n; i++) {
    uint64_t t0 = mr_now_ns();
    if (write_full(fd, req, req_bytes) != 0 || read_full(fd, rep, reply_bytes) != 0) goto out;
    uint64_t us = (mr_now_ns() - t0) / 1000u;
    if (i >= warmup) lat[i - warmup] = us > hold_us ? us - hold_us : 0;
  }
  rc = 0;
out:
  if (fd >= 0) close(fd);
  free(req);
  free(rep);
  return rc;
}

/* What bench-rpc measures: one server, one layer where the owner map routes experts to it,
 * and one call's inputs for the largest T (smaller T use its first rows). */
typedef struct bench_target {
  int server;                /* index in the cluster */
  gc_server_info info;
  uint32_t layer;
  uint32_t *owned;           /* [n_owned] experts of layer routed to the server */
  uint32_t n_owned;
  uint32_t k;                /* slots per token, at most n_owned */
  uint32_t tmax;             /* the largest T asked for */
  int32_t *ids;              /* [tmax, k]: the owned experts in turn */
  float *w;                  /* [tmax, k]: 1 / k */
  uint8_t *x;                /* [tmax, H] N(0, 1) in the wire dtype */
  float *out;                /* [tmax, H] */
} bench_target;

/* Latencies of one T, in µs, iters each. */
typedef struct bench_samples {
  uint64_t *grpc;            /* submit + wait */
  uint64_t *tcp;             /* the raw TCP round trip of the same byte counts */
  uint64_t *tcp_held;        /* the same, the peer holding each reply hold_us, minus it */
  uint32_t hold_us;          /* the compute p50 of the gRPC calls */
  uint64_t *compute;         /* the server's compute_us of the same call */
  uint64_t *net;             /* grpc - compute: transport, framing and queueing */
  uint64_t *submit;          /* the caller's own time in submit (gather, encode, queue) */
  uint64_t *wake;            /* the reply seen by the client's I/O thread -> the sum in the
                              * caller's hands: the hop to the caller and the scatter */
  uint64_t *server_own;      /* the server's own work: server_us - queue_us - compute_us */
  uint64_t *transport;       /* requests queued -> reply seen, minus server_us: both ways
                              * through the kernel and gRPC, moerpc's code on neither side */
  uint32_t req_bytes, reply_bytes;
} bench_samples;

static void bench_target_close(bench_target *t) {
  free(t->owned);
  free(t->ids);
  free(t->w);
  free(t->x);
  free(t->out);
}

static void bench_samples_close(bench_samples *sm) {
  free(sm->grpc);
  free(sm->tcp);
  free(sm->tcp_held);
  free(sm->compute);
  free(sm->net);
  free(sm->submit);
  free(sm->wake);
  free(sm->server_own);
  free(sm->transport);
}

/* Step 1: the server (--server, else the first with experts) and the first layer where the
 * owner map (not just its Hello) routes experts to it. */
static int bench_pick(gc_cluster *c, const gc_cluster_info *ci, const bench_ctx *b,
                      const char *cluster, bench_target *t) {
  t->owned = malloc(ci->num_experts * sizeof *t->owned);
  if (!t->owned) {
    fprintf(stderr, PROG " bench-rpc: out of memory\n");
    return -1;
  }
  int first = 0;
  if (b->server) {
    first = gc_cluster_find_server(c, b->server);
    if (first < 0) {
      fprintf(stderr, PROG " bench-rpc: --server \"%s\" is not in %s\n", b->server, cluster);
      return -1;
    }
  }
  int last = b->server ? first : (int)ci->n_servers - 1;
  for (int s = first; s <= last && !t->n_owned; s++)
    for (uint32_t l = 0; l < ci->num_layers && !t->n_owned; l++) {
      for (uint32_t x = 0; x < ci->num_experts; x++)
        if (gc_cluster_owner(c, l, x) == s) t->owned[t->n_owned++] = x;
      t->server = s;
      t->layer = l;
    }
  if (!t->n_owned) {
    fprintf(stderr, PROG " bench-rpc: %s owns no expert to route to\n",
            b->server ? b->server : "no server");
    return -1;
  }
  gc_server_info_get(c, (uint32_t)t->server, &t->info, NULL);
  t->k = b->top_k;
  if (!t->k) {
    mr_model_config cfg;
    t->k = ci->model_dir[0] && mr_config_load(&cfg, ci->model_dir, NULL) == 0 ? cfg.top_k : 8;
  }
  if (t->k > t->n_owned) t->k = t->n_owned;
  return 0;
}

/* Step 2: the inputs of the largest call and the sample arrays. */
static int bench_inputs(const gc_cluster_info *ci, const bench_ctx *b, bench_target *t,
                        bench_samples *sm) {
  for (uint32_t i = 0; i < b->n_tokens; i++)
    if (b->tokens[i] > t->tmax) t->tmax = b->tokens[i];
  const size_t xs = mr_dtype_size(b->dt), Tk = (size_t)t->tmax * t->k;
  const size_t TH = (size_t)t->tmax * ci->hidden_size;
  sm->grpc = malloc(b->iters * sizeof *sm->grpc);
  sm->tcp = malloc(b->iters * sizeof *sm->tcp);
  sm->tcp_held = malloc(b->iters * sizeof *sm->tcp_held);
  sm->compute = malloc(b->iters * sizeof *sm->compute);
  sm->net = malloc(b->iters * sizeof *sm->net);
  sm->submit = malloc(b->iters * sizeof *sm->submit);
  sm->wake = malloc(b->iters * sizeof *sm->wake);
  sm->server_own = malloc(b->iters * sizeof *sm->server_own);
  sm->transport = malloc(b->iters * sizeof *sm->transport);
  t->ids = malloc(Tk * sizeof *t->ids);
  t->w = malloc(Tk * sizeof *t->w);
  t->x = malloc(TH * xs);
  t->out = malloc(TH * sizeof *t->out);
  if (!sm->grpc || !sm->tcp || !sm->tcp_held || !sm->compute || !sm->net || !sm->submit ||
      !sm->wake || !sm->server_own || !sm->transport || !t->ids || !t->w || !t->x || !t->out) {
    fprintf(stderr, PROG " bench-rpc: out of memory\n");
    return -1;
  }
  uint64_t seed = 7;
  for (size_t i = 0; i < TH; i++) {
    float f = gauss(&seed);
    mr_convert_from_f32(t->x + i * xs, b->dt, &f, 1);
  }
  for (size_t i = 0; i < Tk; i++) {
    t->ids[i] = (int32_t)t->owned[i % t->n_owned];
    t->w[i] = 1.0f / (float)t->k;
  }
  return 0;
}

/* Step 3 for one T: warm-up, then iters layer calls through the cluster, each with the
 * server's compute_us; the request and reply sizes of the last call. */
static int bench_grpc(gc_cluster *c, const bench_ctx *b, const bench_target *t, uint32_t T,
                      bench_samples *sm, mr_err *e) {
  gc_layer_req q = {.layer = t->layer, .n_tokens = T, .top_k = t->k, .ids = t->ids,
                    .weights = t->w, .x = t->x, .dtype = b->dt};
  gc_server_counters ct;
  for (uint32_t i = 0; i < b->warmup + b->iters; i++) {
    uint64_t t0 = mr_now_ns();
    gc_pending *p = NULL;
    gc_call_timing tm = {0};
    int rc = gc_layer_submit(c, &q, &p, e);
    if (!rc) rc = gc_layer_wait_timed(c, p, t->out, 0, &tm, e);
    uint64_t dt_us = (mr_now_ns() - t0) / 1000u;
    if (rc) return rc;
    if (i < b->warmup) continue;
    const uint64_t io_us = tm.submit_us + tm.rpc_us;
    sm->submit[i - b->warmup] = tm.submit_us;
    sm->wake[i - b->warmup] = dt_us > io_us ? dt_us - io_us : 0;
    gc_server_counters_get(c, (uint32_t)t->server, false, &ct, NULL);
    sm->grpc[i - b->warmup] = dt_us;
    sm->compute[i - b->warmup] = ct.last_compute_us;
    sm->net[i - b->warmup] = dt_us > ct.last_compute_us ? dt_us - ct.last_compute_us : 0;
    /* From a protocol 1.5 server (server_us 0 from older ones: both read 0). */
    const uint64_t busy = (uint64_t)ct.last_queue_us + ct.last_compute_us;
    sm->server_own[i - b->warmup] = ct.last_server_us > busy ? ct.last_server_us - busy : 0;
    sm->transport[i - b->warmup] =
        ct.last_server_us && tm.rpc_us > ct.last_server_us ? tm.rpc_us - ct.last_server_us : 0;
  }
  gc_server_counters_get(c, (uint32_t)t->server, false, &ct, NULL);
  sm->req_bytes = (uint32_t)ct.last_req_bytes;
  sm->reply_bytes = (uint32_t)ct.last_reply_bytes;
  return 0;
}

/* Step 4 for one T: percentiles of the same run, as a table line and a JSON line. */
static void bench_report(const bench_ctx *b, const bench_target *t, uint32_t T, bench_samples *sm) {
  const uint32_t n = b->iters;
  qsort(sm->grpc, n, sizeof *sm->grpc, cmp_u64);
  qsort(sm->tcp, n, sizeof *sm->tcp, cmp_u64);
  qsort(sm->tcp_held, n, sizeof *sm->tcp_held, cmp_u64);
  qsort(sm->net, n, sizeof *sm->net, cmp_u64);
  qsort(sm->submit, n, sizeof *sm->submit, cmp_u64);
  qsort(sm->wake, n, sizeof *sm->wake, cmp_u64);
  qsort(sm->server_own, n, sizeof *sm->server_own, cmp_u64);
  qsort(sm->transport, n, sizeof *sm->transport, cmp_u64);
  double gp50 = pct(sm->grpc, n, 50), gp99 = pct(sm->grpc, n, 99), gmean = mean_u64(sm->grpc, n);
  double tp50 = pct(sm->tcp, n, 50), tp99 = pct(sm->tcp, n, 99), hp50 = pct(sm->tcp_held, n, 50);
  double ratio = tp50 > 0 ? gp50 / tp50 : 0;
  double cp50 = pct(sm->compute, n, 50), np50 = pct(sm->net, n, 50);
  double sp50 = pct(sm->submit, n, 50), wp50 = pct(sm->wake, n, 50);
  double op50 = pct(sm->server_own, n, 50), xp50 = pct(sm->transport, n, 50);
  printf("%-6u %-10u %-10u %-10.0f %-10.0f %-10.1f %-10.0f %-10.0f %-8.2f %-12.0f %-16.0f %.0f\n",
         T, sm->req_bytes, sm->reply_bytes, gp50, gp99, gmean, tp50, tp99, ratio, cp50, np50, hp50);
  if (b->json)
    printf("{\"bench\":\"rpc\",\"tokens\":%u,\"req_bytes\":%u,\"reply_bytes\":%u,"
           "\"grpc_p50_us\":%.1f,\"grpc_p99_us\":%.1f,\"grpc_mean_us\":%.1f,"
           "\"tcp_p50_us\":%.1f,\"tcp_p99_us\":%.1f,\"ratio_p50\":%.3f,"
           "\"server_compute_us_p50\":%.1f,\"grpc_minus_compute_p50_us\":%.1f,"
           "\"ratio_minus_compute_p50\":%.3f,\"tcp_held_p50_us\":%.1f,\"hold_us\":%u,"
           "\"ratio_minus_compute_held_p50\":%.3f,\"client_submit_p50_us\":%.1f,"
           "\"client_wake_p50_us\":%.1f,\"server_own_p50_us\":%.1f,\"transport_p50_us\":%.1f,"
           "\"transport_over_tcp_p50\":%.3f,\"peer_cpu\":%d,\"server\":\"%s\","
           "\"dtype\":\"%s\",\"top_k\":%u,\"iters\":%u,\"cpu\":\"%s\",\"cpuidle\":\"%s\","
           "\"guest_halt_poll_ns\":%lld}\n",
           T, sm->req_bytes, sm->reply_bytes, gp50, gp99, gmean, tp50, tp99, ratio, cp50, np50,
           tp50 > 0 ? np50 / tp50 : 0, hp50, sm->hold_us, hp50 > 0 ? np50 / hp50 : 0, sp50, wp50, op50, xp50,
           tp50 > 0 ? xp50 / tp50 : 0, b->peer_cpu,
           t->info.name, mr_dtype_name(b->dt), t->k, n, b->host.cpu, b->host.idle_governor,
           (long long)b->host.halt_poll_ns);
  fflush(stdout);
}

static int cmd_bench_rpc(int argc, char **argv) {
  cli o = {0};
  bench_ctx b = {.tokens = {1, 16, 256}, .n_tokens = 3, .iters = 200, .warmup = 20,
                 .dt = MR_DTYPE_BF16, .peer_cpu = -1};
  static const struct option lo[] = {COMMON_OPTIONS,
                                      {"tokens", required_argument, NULL, OPT_TOKENS},
                                      {"iters", required_argument, NULL, OPT_ITERS},
                                      {"warmup", required_argument, NULL, OPT_WARMUP},
                                      {"dtype", required_argument, NULL, OPT_DTYPE},
                                      {"server", required_argument, NULL, OPT_SERVER},
                                      {"top-k", required_argument, NULL, OPT_TOPK},
                                      {"json", no_argument, NULL, OPT_JSON},
                                      {"peer-cpu", required_argument, NULL, OPT_PEER_CPU},
                                      {0, 0, 0, 0}};
  int pr = parse_command(argc, argv, lo, BENCH_HELP, &o, bench_opt, &b);
  if (pr >= 0) return pr;
  o.no_local = true; /* one server, one RPC: local experts would only add noise */
  mr_host_read(&b.host, NULL);

  /* The peer is forked before gRPC starts any thread. */
  tcp_peer tp = {0};
  if (tcp_peer_start(&tp, b.peer_cpu) != 0) {
    fprintf(stderr, PROG " bench-rpc: could not start the TCP peer on 127.0.0.1: %s\n",
            strerror(errno));
    return 1;
  }
  int status = 1;
  gc_cluster *c = NULL;
  bench_target t = {0};
  bench_samples sm = {0};
  mr_err e;
  mr_err_clear(&e);
  if (open_cluster(&o, &c)) goto out;
  gc_cluster_info ci;
  gc_cluster_info_get(c, &ci);
  if (bench_pick(c, &ci, &b, o.cluster, &t) || bench_inputs(&ci, &b, &t, &sm)) goto out;
  mr_log(MR_LOG_INFO, "bench-rpc: server %s (%s), layer %u, k=%u, %s wire, %u iterations "
         "(+%u warm-up)", t.info.name, t.info.address, t.layer, t.k, mr_dtype_name(b.dt),
         b.iters, b.warmup);
  printf("%-6s %-10s %-10s %-10s %-10s %-10s %-10s %-10s %-8s %-12s %-16s %s\n", "T", "req_B",
         "reply_B", "grpc_p50", "grpc_p99", "grpc_mean", "tcp_p50", "tcp_p99", "ratio",
         "compute_p50", "grpc-compute_p50", "tcp_held_p50");
  status = 0;
  for (uint32_t ti = 0; ti < b.n_tokens; ti++) {
    uint32_t T = b.tokens[ti];
    if (T > t.info.max_tokens) {
      printf("%-6u skipped: above %s's max_tokens %u (the call would be split into several "
             "requests)\n", T, t.info.name, t.info.max_tokens);
      continue;
    }
    int rc = bench_grpc(c, &b, &t, T, &sm, &e);
    if (rc) {
      fprintf(stderr, PROG " bench-rpc: T=%u: %s: %s\n", T, mr_err_name(rc), e.msg);
      status = 1;
      break;
    }
    /* The hold: the compute p50 of the calls just made (sm.compute sorted here). */
    qsort(sm.compute, b.iters, sizeof *sm.compute, cmp_u64);
    sm.hold_us = (uint32_t)pct(sm.compute, b.iters, 50);
    if (tcp_pingpong(&tp, sm.req_bytes, sm.reply_bytes, 0, b.warmup, b.iters, sm.tcp) != 0 ||
        tcp_pingpong(&tp, sm.req_bytes, sm.reply_bytes, sm.hold_us, b.warmup, b.iters,
                     sm.tcp_held) != 0) {
      fprintf(stderr, PROG " bench-rpc: T=%u: TCP ping-pong on 127.0.0.1:%d failed: %s\n", T,
              tp.port, strerror(errno));
      status = 1;
      break;
    }
    bench_report(&b, &t, T, &sm);
  }
out:
  tcp_peer_stop(&tp);
  bench_samples_close(&sm);
  bench_target_close(&t);
  if (c) mr_log(MR_LOG_INFO, "bench-rpc done; closing");
  gc_cluster_close(c);
  return status;
}

/* ---- check-host ----------------------------------------------------------------------------- */

static const char CHECK_HOST_HELP[] =
    "usage: moerpc-client check-host [DIR]\n"
    "\n"
    "Prints the host settings that change moerpc's latency (a KVM guest's cpuidle halt\n"
    "polling, transparent huge pages, NUMA balancing on a multi-node host) and what to\n"
    "write instead, as moerpc-server --check-host does; the client logs the same advice\n"
    "at WARN when it opens a cluster (docs/deploy.md, \"Host tuning\"). DIR: read DIR/sys\n"
    "and DIR/proc (an image) instead of this host's.\n"
    "\n"
    "Exit status: 0 when there is nothing to change, 1 otherwise, 2 on a usage error.\n";

static int cmd_check_host(int argc, char **argv) {
  const char *root = NULL;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
      fputs(CHECK_HOST_HELP, stdout);
      return 0;
    }
    if (argv[i][0] == '-' || root) {
      fprintf(stderr, PROG " check-host: unexpected argument \"%s\"\n(see " PROG
              " check-host --help)\n", argv[i]);
      return 2;
    }
    root = argv[i];
  }
  mr_buf out;
  mr_buf_init(&out);
  uint32_t n = 0;
  mr_err e;
  int rc = mr_host_report_at(&out, root, &n, &e);
  if (rc == 0) fputs(out.buf, stdout);
  else fprintf(stderr, PROG " check-host: %s\n", e.msg);
  mr_buf_close(&out);
  return rc == MR_EINVAL ? 2 : rc || n ? 1 : 0;
}

/* ---- main ----------------------------------------------------------------------------------- */

/* The subcommands, in the order `--help` lists them. run gets argv from the command's name
 * on. A group of subcommands in its own file (gpu_client/cli_<group>.c, linked into this
 * binary by the Makefile) adds its lines here and a declaration of its entry points. */
static const mr_cli_command commands[] = {
    {"info", cmd_info, "Hello every server; print the cluster, model and ownership"},
    {"verify", cmd_verify, "every MoE layer through the cluster vs a local reference"},
    {"bench-rpc", cmd_bench_rpc, "per-request round trip to one server vs raw TCP"},
    {"stats", cmd_stats, "Stats of every server"},
    {"generate", gc__cli_generate, "run the model: generate tokens after prompts (--model DIR)"},
    {"logits", gc__cli_logits, "run the model: fp32 logits of one sequence's prefill, to a file"},
    {"bench", gc__cli_bench, "run the model: prefill/decode tok/s, per-layer time, overlap"},
    {"serve", gc__cli_serve, "an OpenAI-compatible HTTP server of the model (continuous batching)"},
    {"tokenize", gc__cli_tokenize, "the model's tokenizer: text -> ids"},
    {"detokenize", gc__cli_detokenize, "the model's tokenizer: ids -> text"},
    {"chat-template", gc__cli_chat_template, "the prompt the model's chat template renders for messages"},
    {"check-host", cmd_check_host, "the host settings that change moerpc's latency, and what to change"},
};

int main(int argc, char **argv) {
  static const mr_cli_program prog = {
      .name = PROG,
      .component = "client",
      .synopsis = "cluster commands take --cluster FILE,\n"
                  "       the model commands --model DIR [--cluster FILE]",
      .about = "commands:",
      .commands = commands,
      .n_commands = sizeof commands / sizeof commands[0],
  };
  return mr_cli_main(&prog, argc, argv);
}
