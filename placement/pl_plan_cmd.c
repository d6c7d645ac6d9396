/*
 * placement/pl_plan_cmd.c - `moerpc-place plan` and `moerpc-place diff` (the planner itself
 * is pl_plan.c). Results go to stdout or -o FILE; the figures to stderr, one line each.
 */
#include "placement/internal.h"

#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char PLAN_HELP[] =
    "usage: moerpc-place plan --model DIR --cluster FILE [--stats FILE] [options]\n"
    "\n"
    "Plans a placement (moerpc-placement v1 JSON, placement/README.md): which (layer,\n"
    "expert) pairs the client computes (the hot set, within --gpu-bytes) and which host or\n"
    "hosts hold each of the others. Expected load of a host = tokens x bytes of one expert\n"
    "there / its speed (a replicated pair's tokens split over its copies). Prints the\n"
    "expected imbalance (max / mean host load) before (--current, else the uniform plan) and\n"
    "after, and the bytes each host has to load and drop.\n"
    "\n"
    "  --model DIR              the model (its config.json gives the shapes)\n"
    "  --cluster FILE           cluster file: the hosts, with optional \"expert_memory\",\n"
    "                           \"numa_nodes\" and \"speed\" per server\n"
    "  --stats FILE             moerpc-stats counts (moerpc-place stats); none = every\n"
    "                           pair equally popular\n"
    "  --format F               weight format on the hosts and the GPU: bf16 (default), f16,\n"
    "                           f32, int8, int4-g32, int4-g64, int4-g128, fp8-b128\n"
    "  --gpu-bytes N            the client's budget for hot experts (bytes; K/M/G/T suffix;\n"
    "                           default 0 = none local)\n"
    "  --strategy S             balanced (default): hot by frequency, cold balanced over the\n"
    "                           hosts under their capacity, replicas, fewest moves from\n"
    "                           --current; or kt-kernel's uniform, frequency, front-loading,\n"
    "                           random (their GPU sets; cold pairs in even blocks per host)\n"
    "  --speed-from NAME=FILE   server NAME's speed from its moerpc-bench-kernels --json\n"
    "                           lines (repeatable): weight GB/s of --format at one token\n"
    "                           per expert (decode), relative to the mean of the servers\n"
    "                           given; replaces the cluster file's \"speed\"\n"
    "  --replicas R             most copies of a cold pair, 1..16 (default 1); copies go to\n"
    "                           the hottest pairs while there is room and they help\n"
    "  --current FILE           the placement in use: balanced keeps it where moving would\n"
    "                           not lower the expected step load by more than --tolerance\n"
    "  --tolerance F            0..1 (default 0.02)\n"
    "  --seed N                 for random (default 42, as kt-kernel)\n"
    "  --fingerprint HEX        model fingerprint to write (default: the stats', else the\n"
    "                           model's)\n"
    "  -o, --output FILE        write the placement there (atomically); default stdout\n"
    "  --log LEVEL              error|warn|info|debug\n"
    "  --help                   this text\n"
    "\n"
    "Exit status: 0 planned, 1 failure (bad input files, the plan does not fit: the message\n"
    "names the bytes needed and available), 2 usage error.\n";

static const char DIFF_HELP[] =
    "usage: moerpc-place diff A.json B.json [--model DIR [--format F] [--cluster FILE]]\n"
    "\n"
    "Compares two placements of one model: for each server the pairs B adds and removes\n"
    "(with the layers and experts), the local (client) changes, and with --model the bytes\n"
    "each server has to load and drop (--cluster: with each server's numa_nodes), then a\n"
    "summary line. Exit status 0 whether or not they differ (read the summary line:\n"
    "\"identical\" or \"N pairs change\"), 1 when a file cannot be read or the two are of\n"
    "different shapes, 2 usage error.\n"
    "\n"
    "  --model DIR              the model, for bytes (its config.json)\n"
    "  --format F               weight format (default bf16; see plan --help)\n"
    "  --cluster FILE           the cluster file, for numa_nodes per server\n"
    "  --log LEVEL              error|warn|info|debug\n"
    "  --help                   this text\n";

enum { OPT_MODEL = 1000, OPT_CLUSTER, OPT_STATS, OPT_FORMAT, OPT_GPU, OPT_STRATEGY,
       OPT_REPLICAS, OPT_CURRENT, OPT_TOL, OPT_SEED, OPT_FP, OPT_LOG, OPT_HELP, OPT_SPEED_FROM };

#define PLAN_MAX_SPEED_FROM 256u

typedef struct plan_args {
  const char *model, *cluster, *stats, *current, *output, *fingerprint;
  pl_wformat format;
  pl_strategy strategy;
  uint64_t gpu_bytes, seed;
  uint32_t replicas;
  double tolerance;
  uint32_t n_speed_from;                       /* --speed-from NAME=FILE */
  const char *speed_from[PLAN_MAX_SPEED_FROM]; /* "NAME=FILE" as given */
} plan_args;

static int usage_err(const char *prog, const char *fmt, const char *arg) {
  fprintf(stderr, "%s: ", prog);
  fprintf(stderr, fmt, arg);
  fprintf(stderr, "\n(see %s --help)\n", prog);
  return 2;
}

static bool parse_u64(const char *s, uint64_t lo, uint64_t hi, uint64_t *out) {
  char *end = NULL;
  if (!*s || *s == '-' || *s == '+' || *s == ' ') return false;
  unsigned long long v = strtoull(s, &end, 10);
  if (*end || v < lo || v > hi) return false;
  *out = v;
  return true;
}

/* --log LEVEL; a bad level is a usage error, with the "(see --help)" line of usage_err. */
static int set_log(const char *prog, const char *s) {
  if (!pl__log_level_set(prog, s)) return 0;
  fprintf(stderr, "(see %s --help)\n", prog);
  return 2;
}

/* 0 to run, 1 after --help, 2 on a usage error. */
static int plan_parse(int argc, char **argv, plan_args *a) {
  static const char prog[] = "moerpc-place plan";
  static const struct option lo[] = {
      {"model", required_argument, NULL, OPT_MODEL},     {"cluster", required_argument, NULL, OPT_CLUSTER},
      {"stats", required_argument, NULL, OPT_STATS},     {"format", required_argument, NULL, OPT_FORMAT},
      {"gpu-bytes", required_argument, NULL, OPT_GPU},   {"strategy", required_argument, NULL, OPT_STRATEGY},
      {"replicas", required_argument, NULL, OPT_REPLICAS}, {"current", required_argument, NULL, OPT_CURRENT},
      {"tolerance", required_argument, NULL, OPT_TOL},   {"seed", required_argument, NULL, OPT_SEED},
      {"fingerprint", required_argument, NULL, OPT_FP},  {"output", required_argument, NULL, 'o'},
      {"log", required_argument, NULL, OPT_LOG},         {"help", no_argument, NULL, OPT_HELP},
      {"speed-from", required_argument, NULL, OPT_SPEED_FROM},
      {0, 0, 0, 0}};
  a->format = PL_WF_BF16;
  a->strategy = PL_STRATEGY_BALANCED;
  a->replicas = 1;
  a->tolerance = 0.02;
  a->seed = 42;
  a->output = "-";
  optind = 1;
  opterr = 0;
  for (;;) {
    int opt = getopt_long(argc, argv, "o:", lo, NULL);
    if (opt == -1) break;
    uint64_t v;
    mr_err e;
    char *end = NULL;
    switch (opt) {
    case OPT_HELP: fputs(PLAN_HELP, stdout); return 1;
    case OPT_MODEL: a->model = optarg; break;
    case OPT_CLUSTER: a->cluster = optarg; break;
    case OPT_STATS: a->stats = optarg; break;
    case OPT_CURRENT: a->current = optarg; break;
    case 'o': a->output = optarg; break;
    case OPT_FORMAT:
      if (pl_wformat_parse(optarg, &a->format))
        return usage_err(prog, "--format = \"%s\", must be bf16, f16, f32, int8, int4-g32, "
                         "int4-g64, int4-g128 or fp8-b128", optarg);
      break;
    case OPT_STRATEGY:
      if (pl_strategy_parse(optarg, &a->strategy))
        return usage_err(prog, "--strategy = \"%s\", must be balanced, uniform, frequency, "
                         "front-loading or random", optarg);
      break;
    case OPT_GPU:
      if (strcmp(optarg, "0") == 0) a->gpu_bytes = 0;
      else if (mr_size_parse(optarg, "--gpu-bytes", &a->gpu_bytes, &e)) {
        fprintf(stderr, "%s: %s\n(see %s --help)\n", prog, e.msg, prog);
        return 2;
      }
      break;
    case OPT_REPLICAS:
      if (!parse_u64(optarg, 1, PL_MAX_REPLICAS, &v))
        return usage_err(prog, "--replicas = \"%s\", must be an integer in 1..16", optarg);
      a->replicas = (uint32_t)v;
      break;
    case OPT_SEED:
      if (!parse_u64(optarg, 0, UINT64_MAX, &a->seed))
        return usage_err(prog, "--seed = \"%s\", must be an unsigned integer", optarg);
      break;
    case OPT_TOL:
      a->tolerance = strtod(optarg, &end);
      if (!*optarg || *end || !(a->tolerance >= 0 && a->tolerance <= 1))
        return usage_err(prog, "--tolerance = \"%s\", must be a number in 0..1", optarg);
      break;
    case OPT_FP:
      if (strlen(optarg) > 63 || !*optarg)
        return usage_err(prog, "--fingerprint = \"%s\", must be 1..63 characters", optarg);
      a->fingerprint = optarg;
      break;
    case OPT_LOG:
      if (set_log(prog, optarg)) return 2;
      break;
    case OPT_SPEED_FROM:
      if (!strchr(optarg, '=') || optarg[0] == '=' || !strchr(optarg, '=')[1])
        return usage_err(prog, "--speed-from = \"%s\", must be NAME=FILE (a server of the "
                         "cluster file and its moerpc-bench-kernels --json lines)", optarg);
      if (a->n_speed_from >= PLAN_MAX_SPEED_FROM)
        return usage_err(prog, "--speed-from %s: more than 256 given", optarg);
      a->speed_from[a->n_speed_from++] = optarg;
      break;
    case ':': return usage_err(prog, "%s needs a value", argv[optind - 1]);
    default: return usage_err(prog, "unknown option \"%s\"", argv[optind - 1]);
    }
  }
  if (optind < argc) return usage_err(prog, "unexpected argument \"%s\"", argv[optind]);
  if (!a->model) return usage_err(prog, "%s", "--model DIR is required (the shapes)");
  if (!a->cluster) return usage_err(prog, "%s", "--cluster FILE is required (the hosts)");
  return 0;
}

/* The model's fingerprint, or "" when it cannot be computed (a config-only directory). */
static void model_fingerprint(const char *dir, char out[64]) {
  mr_st *st = NULL;
  mr_err e;
  char fp[17] = "";
  out[0] = '\0';
  if (mr_st_open(&st, dir, &e) == 0 && mr_model_fingerprint(dir, st, fp, &e) == 0)
    snprintf(out, 64, "%s", fp);
  else
    mr_log(MR_LOG_INFO, "plan: no model fingerprint (%s)", e.msg);
  mr_st_close(st);
}

/* --speed-from NAME=FILE: each named server's decode rate (GB/s of the plan's format at
 * one token per expert, pl_rates_gbps) over the mean of the servers given. */
static int speeds_from_benches(const plan_args *a, const mr_cluster_file *cf, pl_host *hosts,
                               mr_err *e) {
  if (!a->n_speed_from) return 0;
  static double gbps[MR_CLUSTER_MAX_SERVERS];
  static pl_rates r;
  bool given[MR_CLUSTER_MAX_SERVERS] = {false};
  double sum = 0;
  for (uint32_t i = 0; i < a->n_speed_from; i++) {
    const char *eq = strchr(a->speed_from[i], '=');
    size_t nl = (size_t)(eq - a->speed_from[i]);
    uint32_t h = 0;
    while (h < cf->n_servers &&
           (strlen(cf->servers[h].name) != nl || strncmp(cf->servers[h].name, a->speed_from[i], nl)))
      h++;
    if (h == cf->n_servers)
      return mr_err_set(e, MR_ENOTFOUND, "--speed-from %s: no server \"%.*s\" in the cluster "
                        "file", a->speed_from[i], (int)nl, a->speed_from[i]);
    if (given[h])
      return mr_err_set(e, MR_EINVAL, "--speed-from %s: server %s given twice", a->speed_from[i],
                        cf->servers[h].name);
    int rc = pl_rates_load(&r, eq + 1, pl_wformat_name(a->format), e);
    if (rc) return rc;
    given[h] = true;
    gbps[h] = pl_rates_gbps(&r, 1.0);
    sum += gbps[h];
  }
  const double mean = sum / a->n_speed_from;
  for (uint32_t h = 0; h < cf->n_servers; h++)
    if (given[h]) {
      hosts[h].speed = gbps[h] / mean;
      mr_log(MR_LOG_INFO, "plan: host %s: %.2f GB/s decode (%s) -> speed %.3f", cf->servers[h].name,
             gbps[h], pl_wformat_name(a->format), hosts[h].speed);
    }
  return 0;
}

/* ---- plan, step by step -------------------------------------------------------------------
 *
 * pl_cmd_plan has pl_cmd_apply's shape: a plan_run holds what every step reads and writes,
 * each step fills its part or fails (a negative MR_E* code, e filled: exit 1), and one exit
 * path releases it. The data flow (placement/README.md):
 *
 *   config.json + cluster file (+ --speed-from)  --step_hosts-->  hosts[]
 *   the above + flags                            --step_problem-> pb (+ the model's fingerprint)
 *   --stats FILE                                 --step_stats-->  pb.counts
 *   --current FILE                               --step_current-> pb.current
 *   --fingerprint / the stats' / the model's     --step_fingerprint-> pb.model_fingerprint
 *   pb  --pl_plan_make-->  pl_plan  --pl_plan_write-->  -o FILE    (step_make)
 *   pl_plan's figures  -->  stderr, one line each                  (step_report)
 */
typedef struct plan_run {
  plan_args a;
  mr_cluster_file cf;      /* the hosts, in file order (~90 KiB: the run is static) */
  mr_model_config cfg;     /* the model's shapes */
  pl_host hosts[MR_CLUSTER_MAX_SERVERS]; /* [cf.n_servers]: pb.hosts */
  char model_fp[64];       /* the model's own fingerprint; "" unknown, or --fingerprint given */
  pl_stats st;             /* --stats (all zero without) */
  mr_placement cur;        /* --current (have_cur) */
  bool have_cur;
  pl_problem pb;           /* what pl_plan_make solves; points into the fields above */
  pl_plan *p;              /* the plan (owned) */
  double ms;               /* pl_plan_make's wall time */
} plan_run;

/* The model's shapes, the cluster's hosts with their planning keys (expert_memory,
 * numa_nodes, speed), and --speed-from's measured speeds over the file's. */
static int step_hosts(plan_run *r, mr_err *e) {
  int rc;
  if ((rc = mr_config_load(&r->cfg, r->a.model, e))) return rc;
  if ((rc = mr_cluster_load(&r->cf, r->a.cluster, e))) return rc;
  for (uint32_t h = 0; h < r->cf.n_servers; h++) {
    const mr_cluster_server *s = &r->cf.servers[h];
    pl_host *ho = &r->hosts[h];
    snprintf(ho->name, sizeof ho->name, "%s", s->name);
    ho->capacity = s->expert_memory;
    ho->numa_nodes = s->numa_nodes ? s->numa_nodes : 1;
    ho->speed = s->speed;
  }
  return speeds_from_benches(&r->a, &r->cf, r->hosts, e);
}

/* The problem from the shapes, the hosts and the flags; the model's own fingerprint when
 * --fingerprint does not give one (it checks --stats and names the plan's model). */
static int step_problem(plan_run *r, mr_err *e) {
  const plan_args *a = &r->a;
  pl_problem *pb = &r->pb;
  pb->num_layers = r->cfg.num_layers;
  pb->num_experts = r->cfg.num_experts;
  pb->is_moe = r->cfg.is_moe;
  pb->hidden = r->cfg.hidden_size;
  pb->inter = r->cfg.moe_intermediate;
  pb->format = a->format;
  pb->n_hosts = r->cf.n_servers;
  pb->hosts = r->hosts;
  pb->gpu_bytes = a->gpu_bytes;
  pb->replicas = a->replicas;
  pb->seed = a->seed;
  pb->strategy = a->strategy;
  pb->tolerance = a->tolerance;
  if (!a->fingerprint) model_fingerprint(a->model, r->model_fp);
  return 0;
}

/* --stats FILE: counts of the model's shape and, when both are known, of the model's
 * fingerprint. Without, pb.counts stays NULL: every pair counts 1. */
static int step_stats(plan_run *r, mr_err *e) {
  const plan_args *a = &r->a;
  if (!a->stats) return 0;
  int rc = pl_stats_load(&r->st, a->stats, e);
  if (rc) return rc;
  const pl_stats *st = &r->st;
  if (st->num_layers != r->cfg.num_layers || st->num_experts != r->cfg.num_experts)
    return mr_err_set(e, MR_EMISMATCH, "%s: num_layers = %u, num_experts = %u, the model %s "
                      "has %u and %u", a->stats, st->num_layers, st->num_experts, a->model,
                      r->cfg.num_layers, r->cfg.num_experts);
  if (st->model_fingerprint[0] && r->model_fp[0] && strcmp(st->model_fingerprint, r->model_fp) != 0)
    return mr_err_set(e, MR_EMISMATCH, "%s: model_fingerprint = \"%s\", the model %s has "
                      "\"%s\": statistics of another model", a->stats, st->model_fingerprint,
                      a->model, r->model_fp);
  r->pb.counts = st->counts;
  return 0;
}

/* --current FILE: the placement in use (its shape and servers pl_plan_make checks). */
static int step_current(plan_run *r, mr_err *e) {
  if (!r->a.current) return 0;
  int rc = mr_placement_load(&r->cur, r->a.current, e);
  if (rc) return rc;
  r->have_cur = true;
  r->pb.current = &r->cur;
  return 0;
}

/* The plan's fingerprint: --fingerprint, else the stats', else the model's own; a --current
 * of another model is refused. Then a warning when --current keeps local experts that the
 * stats never counted (servers' counts only), since the plan would treat them as unused. */
static int step_fingerprint(plan_run *r, mr_err *e) {
  const plan_args *a = &r->a;
  const pl_stats *st = &r->st;
  const mr_placement *cur = &r->cur;
  const char *fp = a->fingerprint ? a->fingerprint : st->model_fingerprint[0] ? st->model_fingerprint : r->model_fp;
  if (r->have_cur && fp[0] && cur->model_fingerprint[0] && strcmp(fp, cur->model_fingerprint) != 0)
    return mr_err_set(e, MR_EMISMATCH, "%s: model_fingerprint = \"%s\", the plan is for \"%s\": "
                      "a placement of another model", a->current, cur->model_fingerprint, fp);
  snprintf(r->pb.model_fingerprint, sizeof r->pb.model_fingerprint, "%s", fp);
  if (r->have_cur && a->stats && cur->n_local > 0 && cur->num_layers == st->num_layers &&
      cur->num_experts == st->num_experts) {
    uint64_t hot_tokens = 0;
    for (size_t i = 0; i < (size_t)st->num_layers * st->num_experts; i++)
      if (cur->local[i]) hot_tokens += st->counts[i];
    if (hot_tokens == 0)
      mr_log(MR_LOG_WARN, "plan: %s counts no token for the %llu local experts of %s (servers' "
             "counts only? collect with moerpc-place stats --client): they plan as unused",
             a->stats, (unsigned long long)cur->n_local, a->current);
  }
  return 0;
}

/* The plan itself (timed), written to -o (or stdout). */
static int step_make(plan_run *r, mr_err *e) {
  const plan_args *a = &r->a;
  mr_log(MR_LOG_INFO, "plan: %s, %u layers x %u experts (H %u, I %u), %s, %u hosts, %s%s",
         pl_strategy_name(a->strategy), r->cfg.num_layers, r->cfg.num_experts,
         r->cfg.hidden_size, r->cfg.moe_intermediate, pl_wformat_name(a->format),
         r->cf.n_servers, a->stats ? "stats " : "no stats (uniform counts)",
         a->stats ? a->stats : "");
  uint64_t t0 = mr_now_us();
  int rc = pl_plan_make(&r->pb, &r->p, e);
  if (rc) {
    if (r->have_cur) mr_err_prefix(e, rc, "%s", a->current);
    return rc;
  }
  r->ms = (double)(mr_now_us() - t0) / 1000.0;
  return pl_plan_write(r->p, a->output, e);
}

/* One stderr line per host: bytes held of its capacity, load relative to the mean, bytes
 * to load and to drop; adds the latter two into *tin / *tout. */
static void report_hosts(const plan_run *r, uint64_t *tin, uint64_t *tout) {
  const pl_plan *p = r->p;
  char b1[32], b2[32], b3[32], b4[32];
  double mean = 0;
  for (uint32_t h = 0; h < p->n_hosts; h++) mean += p->host_load[h] / p->n_hosts;
  for (uint32_t h = 0; h < p->n_hosts; h++) {
    pl__bytes_human(p->host_bytes[h], b1, sizeof b1);
    pl__bytes_human(r->hosts[h].capacity, b2, sizeof b2);
    pl__bytes_human(p->bytes_in[h], b3, sizeof b3);
    pl__bytes_human(p->bytes_out[h], b4, sizeof b4);
    fprintf(stderr, "plan: host %s: %s of %s, load %.3f of the mean, to load %llu bytes (%s), "
            "to drop %llu bytes (%s)\n", p->host_name[h], b1,
            r->hosts[h].capacity ? b2 : "unbounded", mean > 0 ? p->host_load[h] / mean : 1.0,
            (unsigned long long)p->bytes_in[h], b3, (unsigned long long)p->bytes_out[h], b4);
    *tin += p->bytes_in[h];
    *tout += p->bytes_out[h];
  }
}

/* The figures on stderr: the hot set and copies, the imbalance and step load before and
 * after, each host, the bytes to move. */
static int step_report(plan_run *r, mr_err *e) {
  const plan_args *a = &r->a;
  const pl_plan *p = r->p;
  char b1[32], b2[32], b3[32];
  uint64_t eb = pl_expert_bytes(a->format, r->cfg.hidden_size, r->cfg.moe_intermediate, 1);
  pl__bytes_human(eb, b1, sizeof b1);
  pl__bytes_human(p->gpu_bytes_used, b2, sizeof b2);
  pl__bytes_human(a->gpu_bytes, b3, sizeof b3);
  fprintf(stderr, "plan: %s: %llu local experts (%s of --gpu-bytes %s, %s each), %llu extra "
          "copies (--replicas %u), planned in %.1f ms\n", pl_strategy_name(a->strategy),
          (unsigned long long)p->n_local, b2, b3, b1, (unsigned long long)p->n_extra_copies,
          a->replicas, r->ms);
  fprintf(stderr, "plan: expected imbalance (max/mean host load): before %.3f (%s), after "
          "%.3f; expected step load %.4g -> %.4g (%+.1f%%)\n", p->imbalance_before,
          p->before_is_current ? "--current" : "uniform", p->imbalance_after, p->step_before,
          p->step_after,
          p->step_before > 0 ? 100.0 * (p->step_after - p->step_before) / p->step_before : 0.0);
  uint64_t tin = 0, tout = 0;
  report_hosts(r, &tin, &tout);
  pl__bytes_human(tin, b1, sizeof b1);
  pl__bytes_human(tout, b2, sizeof b2);
  fprintf(stderr, "plan: bytes to move: %llu to load (%s), %llu to drop (%s); client +%llu "
          "-%llu bytes of local experts%s\n", (unsigned long long)tin, b1,
          (unsigned long long)tout, b2, (unsigned long long)p->gpu_in,
          (unsigned long long)p->gpu_out,
          !r->have_cur ? " (no --current: every copy is new)"
                       : p->kept_current ? " (kept --current where balance allowed)"
                                         : " (a fresh plan: --current was too far off)");
  if (strcmp(a->output, "-") != 0) mr_log(MR_LOG_INFO, "plan: wrote %s", a->output);
  return 0;
}

static void plan_run_close(plan_run *r) {
  pl_plan_free(r->p);
  pl_stats_close(&r->st);
  if (r->have_cur) mr_placement_close(&r->cur);
}

int pl_cmd_plan(int argc, char **argv) {
  static plan_run r; /* large (the cluster file): static, not on the stack */
  memset(&r, 0, sizeof r);
  int pr = plan_parse(argc, argv, &r.a);
  if (pr) return pr == 1 ? 0 : 2;
  mr_err e;
  mr_err_clear(&e);
  int rc = step_hosts(&r, &e);
  if (!rc) rc = step_problem(&r, &e);
  if (!rc) rc = step_stats(&r, &e);
  if (!rc) rc = step_current(&r, &e);
  if (!rc) rc = step_fingerprint(&r, &e);
  if (!rc) rc = step_make(&r, &e);
  if (!rc) rc = step_report(&r, &e);
  if (rc) fprintf(stderr, "moerpc-place plan: %s: %s\n", mr_err_name(rc), e.msg);
  plan_run_close(&r);
  return rc ? 1 : 0;
}

/* ---- diff ---------------------------------------------------------------------------- */

/* Index of name among b's servers, or -1. */
static int32_t server_index(const mr_placement *p, const char *name) {
  for (uint32_t i = 0; i < p->n_servers; i++)
    if (strcmp(p->server[i], name) == 0) return (int32_t)i;
  return -1;
}

static bool on_server(const mr_placement *p, size_t i, int32_t s) {
  if (s < 0) return false;
  for (uint32_t c = p->rep_off[i]; c < p->rep_off[i + 1]; c++)
    if (p->rep[c] == s) return true;
  return false;
}

/* Prints "  <what> layer L: +ids -ids" lines for one server (s_a in A, s_b in B; -1 = not
 * there) or for the local set (local = true); counts into *add / *del. */
static void diff_rows(const mr_placement *A, const mr_placement *B, const char *what, bool local,
                      int32_t sa, int32_t sb, uint64_t *add, uint64_t *del) {
  const uint32_t L = A->num_layers, E = A->num_experts;
  mr_idlist pa, pd;
  char bufa[4096], bufd[4096];
  for (uint32_t l = 0; l < L; l++) {
    mr_idlist_init(&pa, bufa, sizeof bufa);
    mr_idlist_init(&pd, bufd, sizeof bufd);
    uint32_t na = 0, nd = 0;
    for (uint32_t x = 0; x < E; x++) {
      size_t i = (size_t)l * E + x;
      bool in_a = local ? A->local[i] != 0 : on_server(A, i, sa);
      bool in_b = local ? B->local[i] != 0 : on_server(B, i, sb);
      if (in_b && !in_a) {
        mr_idlist_add(&pa, x);
        na++;
      }
      if (in_a && !in_b) {
        mr_idlist_add(&pd, x);
        nd++;
      }
    }
    if (!na && !nd) continue;
    mr_idlist_end(&pa, true);
    mr_idlist_end(&pd, true);
    printf("  %s layer %u: +%u [%s] -%u [%s]\n", what, l, na, na ? bufa : "", nd, nd ? bufd : "");
    *add += na;
    *del += nd;
  }
}

/* ---- diff, step by step -------------------------------------------------------------------
 *
 * The same shape as plan: a diff_run, steps that read (step_read, step_model, step_servers)
 * then print (step_print_servers, step_print_local), one exit path. Output on stdout:
 *
 *   diff A.json -> B.json (L layers x E experts)
 *     s0 layer 3: +2 [4-5] -1 [9]        per server, the layers where it changes
 *   server s0: +N pairs, -M pairs[, bytes]
 *     local layer 0: +1 [3] -0 []        the client's local set
 *   local: +N pairs, -M pairs[, bytes]
 *   diff: identical placements | diff: N server copies added on K servers ...
 */
typedef struct diff_run {
  const char *model, *cluster, *files[2];
  pl_wformat fmt;
  mr_placement A, B;
  mr_model_config cfg;        /* --model */
  mr_cluster_file cf;         /* --cluster: numa_nodes per server (large: the run is static) */
  uint64_t eb1;               /* bytes of one expert in one slice (--model), 0 without */
  char names[2 * MR_PLACEMENT_MAX_SERVERS][64]; /* A's servers in order, then B's new ones */
  uint32_t n_names;
  uint64_t moved, bin, bout;  /* server copies added; bytes to load / drop on the servers */
  uint32_t changed_servers;
} diff_run;

/* 0 to run, 1 after --help, 2 on a usage error. Options and the two files may mix: GNU
 * getopt moves the operands last. */
static int diff_parse(int argc, char **argv, diff_run *r) {
  static const char prog[] = "moerpc-place diff";
  static const struct option lo[] = {{"model", required_argument, NULL, OPT_MODEL},
                                     {"format", required_argument, NULL, OPT_FORMAT},
                                     {"cluster", required_argument, NULL, OPT_CLUSTER},
                                     {"log", required_argument, NULL, OPT_LOG},
                                     {"help", no_argument, NULL, OPT_HELP},
                                     {0, 0, 0, 0}};
  int nfiles = 0;
  r->fmt = PL_WF_BF16;
  optind = 1;
  opterr = 0;
  for (;;) {
    int opt = getopt_long(argc, argv, "", lo, NULL); /* GNU: the files are moved last */
    if (opt == -1) break;
    switch (opt) {
    case OPT_HELP: fputs(DIFF_HELP, stdout); return 1;
    case OPT_MODEL: r->model = optarg; break;
    case OPT_CLUSTER: r->cluster = optarg; break;
    case OPT_FORMAT:
      if (pl_wformat_parse(optarg, &r->fmt))
        return usage_err(prog, "--format = \"%s\", must be bf16, f16, f32, int8, int4-g32, "
                         "int4-g64, int4-g128 or fp8-b128", optarg);
      break;
    case OPT_LOG:
      if (set_log(prog, optarg)) return 2;
      break;
    case ':': return usage_err(prog, "%s needs a value", argv[optind - 1]);
    default: return usage_err(prog, "unknown option \"%s\"", argv[optind - 1]);
    }
  }
  for (; optind < argc; optind++) {
    if (nfiles == 2)
      return usage_err(prog, "unexpected argument \"%s\" (two placements only)", argv[optind]);
    r->files[nfiles++] = argv[optind];
  }
  if (nfiles != 2) return usage_err(prog, "%s", "needs two placement files: A.json B.json");
  if (r->cluster && !r->model) return usage_err(prog, "%s", "--cluster needs --model (for bytes)");
  return 0;
}

/* Both placements, of one shape; differing fingerprints are only a warning (a placement
 * carried over to a re-exported checkpoint is still worth comparing). */
static int step_read(diff_run *r, mr_err *e) {
  int rc;
  if ((rc = mr_placement_load(&r->A, r->files[0], e))) return rc;
  if ((rc = mr_placement_load(&r->B, r->files[1], e))) return rc;
  const mr_placement *A = &r->A, *B = &r->B;
  if (A->num_layers != B->num_layers || A->num_experts != B->num_experts)
    return mr_err_set(e, MR_EMISMATCH, "%s has %u layers x %u experts, %s has %u x %u: not the "
                      "same model", r->files[0], A->num_layers, A->num_experts, r->files[1],
                      B->num_layers, B->num_experts);
  if (A->model_fingerprint[0] && B->model_fingerprint[0] &&
      strcmp(A->model_fingerprint, B->model_fingerprint) != 0)
    mr_log(MR_LOG_WARN, "diff: model fingerprints differ: %s has %s, %s has %s", r->files[0],
           A->model_fingerprint, r->files[1], B->model_fingerprint);
  return 0;
}

/* --model: its shape must be the placements', and gives the bytes of one expert; --cluster
 * (only with --model) gives each server's slices. */
static int step_model(diff_run *r, mr_err *e) {
  if (!r->model) return 0;
  int rc = mr_config_load(&r->cfg, r->model, e);
  if (rc) return rc;
  if (r->cfg.num_layers != r->A.num_layers || r->cfg.num_experts != r->A.num_experts)
    return mr_err_set(e, MR_EMISMATCH, "%s: %u layers x %u experts, the model %s has %u x %u",
                      r->files[0], r->A.num_layers, r->A.num_experts, r->model,
                      r->cfg.num_layers, r->cfg.num_experts);
  r->eb1 = pl_expert_bytes(r->fmt, r->cfg.hidden_size, r->cfg.moe_intermediate, 1);
  if (r->cluster && (rc = mr_cluster_load(&r->cf, r->cluster, e))) return rc;
  return 0;
}

/* The servers to report, A's in order then B's new ones; with --cluster each must be in it. */
static int step_servers(diff_run *r, mr_err *e) {
  uint32_t n = 0;
  for (uint32_t i = 0; i < r->A.n_servers; i++) snprintf(r->names[n++], 64, "%s", r->A.server[i]);
  for (uint32_t i = 0; i < r->B.n_servers; i++)
    if (server_index(&r->A, r->B.server[i]) < 0) snprintf(r->names[n++], 64, "%s", r->B.server[i]);
  r->n_names = n;
  if (!r->cluster) return 0;
  for (uint32_t s = 0; s < n; s++) {
    bool found = false;
    for (uint32_t h = 0; h < r->cf.n_servers; h++) found |= strcmp(r->cf.servers[h].name, r->names[s]) == 0;
    if (!found)
      return mr_err_set(e, MR_ENOTFOUND, "server \"%s\" is not in the cluster file %s",
                        r->names[s], r->cluster);
  }
  return 0;
}

/* Bytes of one expert on the named server: split over its numa_nodes with --cluster. */
static uint64_t server_expert_bytes(const diff_run *r, const char *name) {
  uint64_t eb = r->eb1;
  if (r->cluster)
    for (uint32_t h = 0; h < r->cf.n_servers; h++)
      if (strcmp(r->cf.servers[h].name, name) == 0)
        eb = pl_expert_bytes(r->fmt, r->cfg.hidden_size, r->cfg.moe_intermediate,
                             r->cf.servers[h].numa_nodes);
  return eb;
}

/* The header line, then per server its changed layers and a total line (with --model the
 * bytes to load and drop); sums into moved, bin, bout, changed_servers. */
static int step_print_servers(diff_run *r, mr_err *e) {
  printf("diff %s -> %s (%u layers x %u experts)\n", r->files[0], r->files[1], r->A.num_layers,
         r->A.num_experts);
  char h1[32], h2[32];
  for (uint32_t s = 0; s < r->n_names; s++) {
    const char *name = r->names[s];
    uint64_t add = 0, del = 0, eb = server_expert_bytes(r, name);
    diff_rows(&r->A, &r->B, name, false, server_index(&r->A, name), server_index(&r->B, name),
              &add, &del);
    if (add || del) r->changed_servers++;
    r->moved += add;
    if (r->model) {
      pl__bytes_human(add * eb, h1, sizeof h1);
      pl__bytes_human(del * eb, h2, sizeof h2);
      printf("server %s: +%llu pairs, -%llu pairs, to load %llu bytes (%s), to drop %llu bytes "
             "(%s)\n", name, (unsigned long long)add, (unsigned long long)del,
             (unsigned long long)(add * eb), h1, (unsigned long long)(del * eb), h2);
      r->bin += add * eb;
      r->bout += del * eb;
    } else {
      printf("server %s: +%llu pairs, -%llu pairs\n", name, (unsigned long long)add,
             (unsigned long long)del);
    }
  }
  return 0;
}

/* The client's local set (its layers, its total), then the summary line. */
static int step_print_local(diff_run *r, mr_err *e) {
  uint64_t la = 0, ld = 0;
  char h1[32], h2[32];
  diff_rows(&r->A, &r->B, "local", true, -1, -1, &la, &ld);
  if (r->model)
    printf("local: +%llu pairs, -%llu pairs (%llu bytes to load on the client)\n",
           (unsigned long long)la, (unsigned long long)ld, (unsigned long long)(la * r->eb1));
  else
    printf("local: +%llu pairs, -%llu pairs\n", (unsigned long long)la, (unsigned long long)ld);
  if (!r->moved && !la && !ld && r->changed_servers == 0) {
    printf("diff: identical placements\n");
  } else if (r->model) {
    pl__bytes_human(r->bin, h1, sizeof h1);
    pl__bytes_human(r->bout, h2, sizeof h2);
    printf("diff: %llu server copies added on %u servers, %llu bytes to load (%s), %llu bytes "
           "to drop (%s); local +%llu -%llu\n", (unsigned long long)r->moved, r->changed_servers,
           (unsigned long long)r->bin, h1, (unsigned long long)r->bout, h2,
           (unsigned long long)la, (unsigned long long)ld);
  } else {
    printf("diff: %llu server copies added on %u servers; local +%llu -%llu (--model for "
           "bytes)\n", (unsigned long long)r->moved, r->changed_servers, (unsigned long long)la,
           (unsigned long long)ld);
  }
  return 0;
}

int pl_cmd_diff(int argc, char **argv) {
  static diff_run r; /* large (the cluster file, the names): static, not on the stack */
  memset(&r, 0, sizeof r);
  int pr = diff_parse(argc, argv, &r);
  if (pr) return pr == 1 ? 0 : 2;
  mr_err e;
  mr_err_clear(&e);
  int rc = step_read(&r, &e);
  if (!rc) rc = step_model(&r, &e);
  if (!rc) rc = step_servers(&r, &e);
  if (!rc) rc = step_print_servers(&r, &e);
  if (!rc) rc = step_print_local(&r, &e);
  if (rc) fprintf(stderr, "moerpc-place diff: %s: %s\n", mr_err_name(rc), e.msg);
  mr_placement_close(&r.A);
  mr_placement_close(&r.B);
  return rc ? 1 : 0;
}
