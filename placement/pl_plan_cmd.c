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

int pl_cmd_plan(int argc, char **argv) {
  static const char prog[] = "moerpc-place plan";
  plan_args a = {0};
  int pr = plan_parse(argc, argv, &a);
  if (pr) return pr == 1 ? 0 : 2;
  mr_err e;
  mr_err_clear(&e);
  int rc;
  static mr_cluster_file cf; /* ~90 KiB: not on the stack */
  static mr_model_config cfg;
  static pl_host hosts[MR_CLUSTER_MAX_SERVERS];
  pl_stats st = {0};
  mr_placement cur = {0};
  pl_plan *p = NULL;
  bool have_cur = false;
  if ((rc = mr_config_load(&cfg, a.model, &e))) goto fail;
  if ((rc = mr_cluster_load(&cf, a.cluster, &e))) goto fail;
  for (uint32_t h = 0; h < cf.n_servers; h++) {
    snprintf(hosts[h].name, sizeof hosts[h].name, "%s", cf.servers[h].name);
    hosts[h].capacity = cf.servers[h].expert_memory;
    hosts[h].numa_nodes = cf.servers[h].numa_nodes ? cf.servers[h].numa_nodes : 1;
    hosts[h].speed = cf.servers[h].speed;
  }
  if ((rc = speeds_from_benches(&a, &cf, hosts, &e))) goto fail;
  pl_problem pb = {0};
  pb.num_layers = cfg.num_layers;
  pb.num_experts = cfg.num_experts;
  pb.is_moe = cfg.is_moe;
  pb.hidden = cfg.hidden_size;
  pb.inter = cfg.moe_intermediate;
  pb.format = a.format;
  pb.n_hosts = cf.n_servers;
  pb.hosts = hosts;
  pb.gpu_bytes = a.gpu_bytes;
  pb.replicas = a.replicas;
  pb.seed = a.seed;
  pb.strategy = a.strategy;
  pb.tolerance = a.tolerance;
  char model_fp[64] = "";
  if (!a.fingerprint) model_fingerprint(a.model, model_fp);
  if (a.stats) {
    if ((rc = pl_stats_load(&st, a.stats, &e))) goto fail;
    if (st.num_layers != cfg.num_layers || st.num_experts != cfg.num_experts) {
      rc = mr_err_set(&e, MR_EMISMATCH, "%s: num_layers = %u, num_experts = %u, the model %s "
                      "has %u and %u", a.stats, st.num_layers, st.num_experts, a.model,
                      cfg.num_layers, cfg.num_experts);
      goto fail;
    }
    if (st.model_fingerprint[0] && model_fp[0] && strcmp(st.model_fingerprint, model_fp) != 0) {
      rc = mr_err_set(&e, MR_EMISMATCH, "%s: model_fingerprint = \"%s\", the model %s has "
                      "\"%s\": statistics of another model", a.stats, st.model_fingerprint,
                      a.model, model_fp);
      goto fail;
    }
    pb.counts = st.counts;
  }
  if (a.current) {
    if ((rc = mr_placement_load(&cur, a.current, &e))) goto fail;
    have_cur = true;
    pb.current = &cur;
  }
  const char *fp = a.fingerprint ? a.fingerprint : st.model_fingerprint[0] ? st.model_fingerprint : model_fp;
  if (have_cur && fp[0] && cur.model_fingerprint[0] && strcmp(fp, cur.model_fingerprint) != 0) {
    rc = mr_err_set(&e, MR_EMISMATCH, "%s: model_fingerprint = \"%s\", the plan is for \"%s\": "
                    "a placement of another model", a.current, cur.model_fingerprint, fp);
    goto fail;
  }
  snprintf(pb.model_fingerprint, sizeof pb.model_fingerprint, "%s", fp);
  if (have_cur && a.stats && cur.n_local > 0 && cur.num_layers == st.num_layers &&
      cur.num_experts == st.num_experts) {
    uint64_t hot_tokens = 0;
    for (size_t i = 0; i < (size_t)st.num_layers * st.num_experts; i++)
      if (cur.local[i]) hot_tokens += st.counts[i];
    if (hot_tokens == 0)
      mr_log(MR_LOG_WARN, "plan: %s counts no token for the %llu local experts of %s (servers' "
             "counts only? collect with moerpc-place stats --client): they plan as unused",
             a.stats, (unsigned long long)cur.n_local, a.current);
  }
  mr_log(MR_LOG_INFO, "plan: %s, %u layers x %u experts (H %u, I %u), %s, %u hosts, %s%s",
         pl_strategy_name(a.strategy), cfg.num_layers, cfg.num_experts, cfg.hidden_size,
         cfg.moe_intermediate, pl_wformat_name(a.format), cf.n_servers,
         a.stats ? "stats " : "no stats (uniform counts)", a.stats ? a.stats : "");
  uint64_t t0 = mr_now_us();
  if ((rc = pl_plan_make(&pb, &p, &e))) {
    if (have_cur) mr_err_prefix(&e, rc, "%s", a.current);
    goto fail;
  }
  double ms = (double)(mr_now_us() - t0) / 1000.0;
  if ((rc = pl_plan_write(p, a.output, &e))) goto fail;

  char b1[32], b2[32], b3[32], b4[32];
  uint64_t eb = pl_expert_bytes(a.format, cfg.hidden_size, cfg.moe_intermediate, 1);
  pl__bytes_human(eb, b1, sizeof b1);
  pl__bytes_human(p->gpu_bytes_used, b2, sizeof b2);
  pl__bytes_human(a.gpu_bytes, b3, sizeof b3);
  fprintf(stderr, "plan: %s: %llu local experts (%s of --gpu-bytes %s, %s each), %llu extra "
          "copies (--replicas %u), planned in %.1f ms\n", pl_strategy_name(a.strategy),
          (unsigned long long)p->n_local, b2, b3, b1, (unsigned long long)p->n_extra_copies,
          a.replicas, ms);
  fprintf(stderr, "plan: expected imbalance (max/mean host load): before %.3f (%s), after "
          "%.3f; expected step load %.4g -> %.4g (%+.1f%%)\n", p->imbalance_before,
          p->before_is_current ? "--current" : "uniform", p->imbalance_after, p->step_before,
          p->step_after,
          p->step_before > 0 ? 100.0 * (p->step_after - p->step_before) / p->step_before : 0.0);
  uint64_t tin = 0, tout = 0;
  double mean = 0;
  for (uint32_t h = 0; h < p->n_hosts; h++) mean += p->host_load[h] / p->n_hosts;
  for (uint32_t h = 0; h < p->n_hosts; h++) {
    pl__bytes_human(p->host_bytes[h], b1, sizeof b1);
    pl__bytes_human(hosts[h].capacity, b2, sizeof b2);
    pl__bytes_human(p->bytes_in[h], b3, sizeof b3);
    pl__bytes_human(p->bytes_out[h], b4, sizeof b4);
    fprintf(stderr, "plan: host %s: %s of %s, load %.3f of the mean, to load %llu bytes (%s), "
            "to drop %llu bytes (%s)\n", p->host_name[h], b1,
            hosts[h].capacity ? b2 : "unbounded", mean > 0 ? p->host_load[h] / mean : 1.0,
            (unsigned long long)p->bytes_in[h], b3, (unsigned long long)p->bytes_out[h], b4);
    tin += p->bytes_in[h];
    tout += p->bytes_out[h];
  }
  pl__bytes_human(tin, b1, sizeof b1);
  pl__bytes_human(tout, b2, sizeof b2);
  fprintf(stderr, "plan: bytes to move: %llu to load (%s), %llu to drop (%s); client +%llu "
          "-%llu bytes of local experts%s\n", (unsigned long long)tin, b1,
          (unsigned long long)tout, b2, (unsigned long long)p->gpu_in,
          (unsigned long long)p->gpu_out,
          !have_cur ? " (no --current: every copy is new)"
                    : p->kept_current ? " (kept --current where balance allowed)"
                                      : " (a fresh plan: --current was too far off)");
  if (strcmp(a.output, "-") != 0) mr_log(MR_LOG_INFO, "plan: wrote %s", a.output);
  pl_plan_free(p);
  pl_stats_close(&st);
  if (have_cur) mr_placement_close(&cur);
  return 0;
fail:
  fprintf(stderr, "%s: %s: %s\n", prog, mr_err_name(rc), e.msg);
  pl_plan_free(p);
  pl_stats_close(&st);
  if (have_cur) mr_placement_close(&cur);
  return 1;
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

int pl_cmd_diff(int argc, char **argv) {
  static const char prog[] = "moerpc-place diff";
  static const struct option lo[] = {{"model", required_argument, NULL, OPT_MODEL},
                                     {"format", required_argument, NULL, OPT_FORMAT},
                                     {"cluster", required_argument, NULL, OPT_CLUSTER},
                                     {"log", required_argument, NULL, OPT_LOG},
                                     {"help", no_argument, NULL, OPT_HELP},
                                     {0, 0, 0, 0}};
  const char *model = NULL, *cluster = NULL, *files[2] = {NULL, NULL};
  pl_wformat fmt = PL_WF_BF16;
  int nfiles = 0;
  optind = 1;
  opterr = 0;
  for (;;) {
    int opt = getopt_long(argc, argv, "", lo, NULL); /* GNU: the files are moved last */
    if (opt == -1) break;
    switch (opt) {
    case OPT_HELP: fputs(DIFF_HELP, stdout); return 0;
    case OPT_MODEL: model = optarg; break;
    case OPT_CLUSTER: cluster = optarg; break;
    case OPT_FORMAT:
      if (pl_wformat_parse(optarg, &fmt))
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
    files[nfiles++] = argv[optind];
  }
  if (nfiles != 2) return usage_err(prog, "%s", "needs two placement files: A.json B.json");
  if (cluster && !model) return usage_err(prog, "%s", "--cluster needs --model (for bytes)");
  mr_err e;
  mr_err_clear(&e);
  mr_placement A = {0}, B = {0};
  static mr_model_config cfg;
  static mr_cluster_file cf;
  int rc;
  if ((rc = mr_placement_load(&A, files[0], &e))) goto fail;
  if ((rc = mr_placement_load(&B, files[1], &e))) goto fail;
  if (A.num_layers != B.num_layers || A.num_experts != B.num_experts) {
    rc = mr_err_set(&e, MR_EMISMATCH, "%s has %u layers x %u experts, %s has %u x %u: not the "
                    "same model", files[0], A.num_layers, A.num_experts, files[1], B.num_layers,
                    B.num_experts);
    goto fail;
  }
  if (A.model_fingerprint[0] && B.model_fingerprint[0] &&
      strcmp(A.model_fingerprint, B.model_fingerprint) != 0)
    mr_log(MR_LOG_WARN, "diff: model fingerprints differ: %s has %s, %s has %s", files[0],
           A.model_fingerprint, files[1], B.model_fingerprint);
  uint64_t eb1 = 0;
  if (model) {
    if ((rc = mr_config_load(&cfg, model, &e))) goto fail;
    if (cfg.num_layers != A.num_layers || cfg.num_experts != A.num_experts) {
      rc = mr_err_set(&e, MR_EMISMATCH, "%s: %u layers x %u experts, the model %s has %u x %u",
                      files[0], A.num_layers, A.num_experts, model, cfg.num_layers,
                      cfg.num_experts);
      goto fail;
    }
    eb1 = pl_expert_bytes(fmt, cfg.hidden_size, cfg.moe_intermediate, 1);
    if (cluster && (rc = mr_cluster_load(&cf, cluster, &e))) goto fail;
  }
  /* Servers: A's in order, then B's new ones. */
  char names[2 * MR_PLACEMENT_MAX_SERVERS][64];
  uint32_t n = 0;
  for (uint32_t i = 0; i < A.n_servers; i++) snprintf(names[n++], 64, "%s", A.server[i]);
  for (uint32_t i = 0; i < B.n_servers; i++)
    if (server_index(&A, B.server[i]) < 0) snprintf(names[n++], 64, "%s", B.server[i]);
  if (cluster)
    for (uint32_t s = 0; s < n; s++) {
      bool found = false;
      for (uint32_t h = 0; h < cf.n_servers; h++) found |= strcmp(cf.servers[h].name, names[s]) == 0;
      if (!found) {
        rc = mr_err_set(&e, MR_ENOTFOUND, "server \"%s\" is not in the cluster file %s",
                        names[s], cluster);
        goto fail;
      }
    }
  printf("diff %s -> %s (%u layers x %u experts)\n", files[0], files[1], A.num_layers,
         A.num_experts);
  uint64_t moved = 0, bin = 0, bout = 0, la = 0, ld = 0;
  uint32_t changed_servers = 0;
  char h1[32], h2[32];
  for (uint32_t s = 0; s < n; s++) {
    uint64_t add = 0, del = 0, eb = eb1;
    if (cluster)
      for (uint32_t h = 0; h < cf.n_servers; h++)
        if (strcmp(cf.servers[h].name, names[s]) == 0)
          eb = pl_expert_bytes(fmt, cfg.hidden_size, cfg.moe_intermediate,
                               cf.servers[h].numa_nodes);
    diff_rows(&A, &B, names[s], false, server_index(&A, names[s]), server_index(&B, names[s]),
              &add, &del);
    if (add || del) changed_servers++;
    moved += add;
    if (model) {
      pl__bytes_human(add * eb, h1, sizeof h1);
      pl__bytes_human(del * eb, h2, sizeof h2);
      printf("server %s: +%llu pairs, -%llu pairs, to load %llu bytes (%s), to drop %llu bytes "
             "(%s)\n", names[s], (unsigned long long)add, (unsigned long long)del,
             (unsigned long long)(add * eb), h1, (unsigned long long)(del * eb), h2);
      bin += add * eb;
      bout += del * eb;
    } else {
      printf("server %s: +%llu pairs, -%llu pairs\n", names[s], (unsigned long long)add,
             (unsigned long long)del);
    }
  }
  diff_rows(&A, &B, "local", true, -1, -1, &la, &ld);
  if (model)
    printf("local: +%llu pairs, -%llu pairs (%llu bytes to load on the client)\n",
           (unsigned long long)la, (unsigned long long)ld, (unsigned long long)(la * eb1));
  else
    printf("local: +%llu pairs, -%llu pairs\n", (unsigned long long)la, (unsigned long long)ld);
  if (!moved && !la && !ld && changed_servers == 0) {
    printf("diff: identical placements\n");
  } else if (model) {
    pl__bytes_human(bin, h1, sizeof h1);
    pl__bytes_human(bout, h2, sizeof h2);
    printf("diff: %llu server copies added on %u servers, %llu bytes to load (%s), %llu bytes "
           "to drop (%s); local +%llu -%llu\n", (unsigned long long)moved, changed_servers,
           (unsigned long long)bin, h1, (unsigned long long)bout, h2, (unsigned long long)la,
           (unsigned long long)ld);
  } else {
    printf("diff: %llu server copies added on %u servers; local +%llu -%llu (--model for "
           "bytes)\n", (unsigned long long)moved, changed_servers, (unsigned long long)la,
           (unsigned long long)ld);
  }
  mr_placement_close(&A);
  mr_placement_close(&B);
  return 0;
fail:
  fprintf(stderr, "%s: %s: %s\n", prog, mr_err_name(rc), e.msg);
  mr_placement_close(&A);
  mr_placement_close(&B);
  return 1;
}
