/*
 * cli_model.c - the whole-model subcommands of moerpc-client (model.h):
 *
 *   generate  prompts -> generated ids per sequence, and timing
 *   logits    the fp32 logits [T, vocab] of one sequence's prefill, raw little-endian
 *   bench     prefill and decode tokens/s, per-layer time, overlap and decode_bw_ratio
 *
 * Without --cluster every expert is local (the all-local baseline). Exit status: 0 ok,
 * 1 failure, 2 usage error. Lifecycle lines go to stderr (mr_log), results to stdout.
 */
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "gpu_client/runner/cli.h"
#include "gpu_client/runner/comm.h"
#include "gpu_client/runner/model.h"
#include "gpu_client/runner/sched.h"
#include "gpu_client/runner/text.h"

#define PROG "moerpc-client"
/* Most ids one flag may list (a prompt longer than --max-seq is refused after open). */
#define CLI_MAX_IDS (1u << 20)
#define CLI_MAX_SEQS 4096u

const char gc__cli_model_help[] =
    "model and placement:\n"
    "  --model DIR              HF checkpoint (config.json + safetensors)       required\n"
    "  --cluster FILE           expert servers for the cold experts; without it every\n"
    "                           expert is local (the all-local baseline)\n"
    "  --local-experts N        with --cluster: N hot experts per MoE layer, computed here;\n"
    "                           layer l keeps experts (l*N + i) mod E, i < N (default: the\n"
    "                           cluster file's \"local\" section, else none)\n"
    "  --placement FILE         with --cluster: a placement file (local and remote experts\n"
    "                           per layer, see gpu_client/README.md); exclusive with\n"
    "                           --local-experts\n"
    "  --watch-placement        with --placement: at each step boundary, if FILE changed,\n"
    "                           Hello every server again and switch routing to it between\n"
    "                           two steps (moerpc-place apply writes it); a bad file is\n"
    "                           logged and ignored; local experts cannot change. The active\n"
    "                           placement is at GET /placement of --metrics-listen\n"
    "  --max-deferred K         defer each token's K lowest-ranked cold slots to the next\n"
    "                           MoE layer (kt-kernel semantics; changes results), default 0\n"
    "  --max-seq N              KV cache positions per sequence, 1..1048576 (default 4096,\n"
    "                           at most max_position_embeddings)\n"
    "compute:\n"
    "  --backend cpu|cuda       where the dense parts and hot experts run (default cpu);\n"
    "                           cuda loads libmoerpc-cuda.so (built where nvcc exists) and\n"
    "                           fails with a clear error on a host without a GPU\n"
    "  --device N               first CUDA device (rank r of --tp uses N + r), default 0\n"
    "  --tp G                   tensor parallelism over G ranks of this process (attention\n"
    "                           heads and dense MLP columns split, one all-reduce after each;\n"
    "                           NCCL on cuda, shared memory on cpu), 1..16, default 1\n"
    "  --threads N              kernel threads, the caller included; 0 = one per core\n"
    "                           (with --tp on cpu: split between the ranks)\n"
    "  --isa ref|avx2|avx512    force a kernel ISA (default: best; MOERPC_ISA too)\n"
    "  --numa SPEC              NUMA nodes of the kernel pool: auto, a count, or a list\n"
    "  --format FMT             hot experts: f32|f16|bf16|int8|int4 (default: the servers'\n"
    "                           weight format, or as stored without --cluster)\n"
    "  --dense-format FMT       projections and lm_head: f32|f16|bf16|int8|int4|fp8\n"
    "                           (default: as stored; FP8 codes as fp8-b128 on cpu)\n"
    "  --map-weights            cpu: serve the hot experts, the dense weights and the\n"
    "                           embeddings in place from the model's files (no copy) where\n"
    "                           they are stored as served (bf16/f16/f32, fp8; one\n"
    "                           NUMA node); the files must not change while it runs\n"
    "  --wire f32|f16|bf16      hidden states to the servers (default bf16)\n"
    "  --deadline-ms N          per-request deadline, 1..600000 (default: the cluster file's)\n"
    "  --connect-timeout-ms N   deadline of the Hello round, 1..600000 (default 10000)\n"
    "  --wait-spin-us N         watch for the servers' replies N us before sleeping on them,\n"
    "                           0..10000 (default 0): saves a thread wake-up per round trip,\n"
    "                           costs that much CPU per wait; for a client with cores of its\n"
    "                           own, not one that shares them with servers\n"
    "  --log LEVEL              error|warn|info|debug      --quiet  no loading progress\n"
    "  --metrics-listen HOST:PORT  serve Prometheus metrics at http://HOST:PORT/metrics while\n"
    "                           the command runs (port 0 = any free port, logged); also\n"
    "                           GET /placement (JSON: generation, hash, switched_at) and\n"
    "                           GET /routing: the routing counters as moerpc-stats JSON\n"
    "routing statistics (every routed slot, hot experts included; placement/README.md):\n"
    "  --routing-window STEPS   sliding window of the counters, 1..16777216 steps (a step:\n"
    "                           one pass of the model; default 1024)\n"
    "  --routing-stats FILE     at exit, write the window's counts there (moerpc-stats JSON,\n"
    "                           input of moerpc-place plan)\n"
    "  --help                   this text\n";


/* The --metrics-listen responder of this run (common/http.c): serves
 * gc_model_metrics_render from its own thread while the command runs. */
static mr_http_server *cli_metrics;

static void metrics_render(void *ud, mr_buf *p) { gc_model_metrics_render(ud, p); }
/* GET /placement: the active placement (live apply). */
static void placement_render(void *ud, mr_buf *p) { gc_model_placement_render(ud, p); }

/* GET /routing: the routing counters' window as moerpc-stats JSON (a 500 when out of
 * memory: the responder answers 500 for a text marked oom). */
static void routing_render(void *ud, mr_buf *p) {
  mr_err e;
  if (gc_model_routing_json(ud, GC_ROUTING_WINDOW, p, &e)) p->oom = true;
}

int gc__cli_model_routes(mr_http_server *h, gc_model *m, mr_err *e) {
  int rc = mr_http_server_route(h, "/routing", "application/json", routing_render, m, e);
  if (rc == 0) rc = mr_http_server_route(h, "/placement", "application/json", placement_render, m, e);
  return rc;
}

/* Writes --routing-stats (when given and the model opened); 0, or 1 on failure. Then stops
 * the responder and closes the model (the responder reads the model). */
int gc__cli_close_model(const gc__mcli *c, gc_model *m) {
  int status = 0;
  if (m && c->routing_stats) {
    mr_err e;
    mr_err_clear(&e);
    int rc = gc_model_routing_save(m, GC_ROUTING_WINDOW, c->routing_stats, &e);
    if (rc) {
      fprintf(stderr, PROG ": --routing-stats: %s: %s\n", mr_err_name(rc), e.msg);
      status = 1;
    } else {
      mr_log(MR_LOG_INFO, "routing statistics written to %s", c->routing_stats);
    }
  }
  mr_http_server_free(cli_metrics);
  cli_metrics = NULL;
  gc_model_close(m);
  return status;
}

bool gc__cli_u64(const char *flag, const char *s, uint64_t lo, uint64_t hi, uint64_t *out) {
  char *end = NULL;
  errno = 0;
  unsigned long long v = strtoull(s, &end, 10);
  if (!*s || *end || errno || s[0] == '-' || v < lo || v > hi) {
    fprintf(stderr, PROG ": %s = \"%s\", must be an integer in %llu..%llu\n", flag, s,
            (unsigned long long)lo, (unsigned long long)hi);
    return false;
  }
  *out = v;
  return true;
}
bool gc__cli_u32(const char *flag, const char *s, uint32_t lo, uint32_t hi, uint32_t *out) {
  uint64_t v;
  if (!gc__cli_u64(flag, s, lo, hi, &v)) return false;
  *out = (uint32_t)v;
  return true;
}
static bool p_float(const char *flag, const char *s, double lo, double hi, float *out) {
  char *end = NULL;
  errno = 0;
  double v = strtod(s, &end);
  if (!*s || *end || errno || !(v >= lo && v <= hi)) {
    fprintf(stderr, PROG ": %s = \"%s\", must be a number in %g..%g\n", flag, s, lo, hi);
    return false;
  }
  *out = (float)v;
  return true;
}
static bool p_format(const char *flag, const char *s, kn_format *f, uint32_t *group) {
  if (strncmp(s, "int4", 4) == 0 && group) {
    *f = KN_FMT_INT4;
    if (s[4] == 0) return true;
    if (strcmp(s, "int4-g32") == 0) *group = 32;
    else if (strcmp(s, "int4-g64") == 0) *group = 64;
    else if (strcmp(s, "int4-g128") == 0) *group = 128;
    else goto bad;
    return true;
  }
  if (kn_format_parse(s, f) == 0 && *f != KN_FMT_INT4) return true;
bad:
  fprintf(stderr, PROG ": %s = \"%s\", must be f32, f16, bf16, int8, int4[-g32|64|128] or fp8[-b128]\n",
          flag, s);
  return false;
}

/* Returns 1 taken, 0 not a model option, -1 bad value. */
static int model_opt(void *ctx, int opt, const char *arg) {
  gc__mcli *c = ctx;
  gc_model_opts *o = &c->mo;
  uint32_t v;
  int lvl;
  switch (opt) {
  case MO_MODEL: o->model_dir = arg; return 1;
  case MO_CLUSTER: o->cluster_path = arg; return 1;
  case MO_PLACEMENT: o->placement_path = arg; return 1;
  case MO_WATCH: o->watch_placement = true; return 1;
  case MO_LOCAL:
    if (!gc__cli_u32("--local-experts", arg, 0, 65536, &v)) return -1;
    o->local_experts = (int32_t)v;
    return 1;
  case MO_DEFER: return gc__cli_u32("--max-deferred", arg, 0, 1024, &o->max_deferred) ? 1 : -1;
  case MO_MAXSEQ: return gc__cli_u32("--max-seq", arg, 1, 1u << 20, &o->max_seq) ? 1 : -1;
  case MO_THREADS: return gc__cli_u32("--threads", arg, 0, 4096, &o->engine.threads) ? 1 : -1;
  case MO_BACKEND:
    if (strcmp(arg, "cpu") != 0 && strcmp(arg, "cuda") != 0) {
      fprintf(stderr, PROG ": --backend = \"%s\", must be cpu or cuda\n", arg);
      return -1;
    }
    o->backend = arg;
    return 1;
  case MO_DEVICE: return gc__cli_u32("--device", arg, 0, 1023, &o->device) ? 1 : -1;
  case MO_TP: return gc__cli_u32("--tp", arg, 1, GC_COMM_MAX_RANKS, &o->tp) ? 1 : -1;
  case MO_ISA:
    if (kn_isa_parse(arg, &o->engine.isa) != 0) {
      fprintf(stderr, PROG ": --isa = \"%s\", must be ref, avx2, avx512 or amx\n", arg);
      return -1;
    }
    return 1;
  case MO_NUMA: o->engine.numa = arg; return 1;
  case MO_FORMAT: return p_format("--format", arg, &o->expert_format, &o->expert_group) ? 1 : -1;
  case MO_DENSE: return p_format("--dense-format", arg, &o->dense_format, NULL) ? 1 : -1;
  case MO_WIRE:
    if (mr_dtype_parse(arg, &o->wire) != 0) {
      fprintf(stderr, PROG ": --wire = \"%s\", must be f32, f16 or bf16\n", arg);
      return -1;
    }
    return 1;
  case MO_DEADLINE: return gc__cli_u32("--deadline-ms", arg, 1, 600000, &o->deadline_ms) ? 1 : -1;
  case MO_CONNECT:
    return gc__cli_u32("--connect-timeout-ms", arg, 1, 600000, &o->connect_timeout_ms) ? 1 : -1;
  case MO_SPIN:
    return gc__cli_u32("--wait-spin-us", arg, 0, GC_WAIT_SPIN_MAX_US, &o->wait_spin_us) ? 1 : -1;
  case MO_LOG:
    if (mr_log_parse_level(arg, &lvl) != 0) {
      fprintf(stderr, PROG ": --log = \"%s\", must be error, warn, info or debug\n", arg);
      return -1;
    }
    mr_log_set_level(lvl);
    return 1;
  case MO_QUIET: o->quiet = true; return 1;
  case MO_MAP: o->map_weights = true; return 1;
  case MO_METRICS: c->metrics_listen = arg; return 1;
  case MO_RWINDOW:
    return gc__cli_u32("--routing-window", arg, 1, GC_ROUTING_MAX_WINDOW, &o->routing_window) ? 1 : -1;
  case MO_RSTATS: c->routing_stats = arg; return 1;
  case MO_PROMPT: c->prompt = arg; return 1;
  case MO_IDS: c->ids = arg; return 1;
  case MO_OUT: c->out = arg; return 1;
  case MO_COMPARE: c->compare = arg; return 1;
  case MO_JSON: c->json = true; return 1;
  case MO_BATCH:
    c->batch_set = true;
    return gc__cli_u32("--batch", arg, 1, CLI_MAX_SEQS, &c->batch) ? 1 : -1;
  case MO_MAXNEW: return gc__cli_u32("--max-new", arg, 0, 1u << 20, &c->max_new) ? 1 : -1;
  case MO_PLEN: return gc__cli_u32("--prompt-len", arg, 1, 1u << 20, &c->prompt_len) ? 1 : -1;
  case MO_DECODE: return gc__cli_u32("--decode", arg, 1, 1u << 20, &c->decode) ? 1 : -1;
  case MO_REPEATS: return gc__cli_u32("--repeats", arg, 1, 1000, &c->repeats) ? 1 : -1;
  case MO_TEMP: return p_float("--temperature", arg, 0, 100, &c->smp.temperature) ? 1 : -1;
  case MO_TOPP: return p_float("--top-p", arg, 1e-6, 1, &c->smp.top_p) ? 1 : -1;
  case MO_SEED: return gc__cli_u64("--seed", arg, 0, UINT64_MAX, &c->smp.seed) ? 1 : -1;
  case MO_TOPK: return gc__cli_u32("--top-k", arg, 0, 1u << 24, &c->smp.top_k) ? 1 : -1;
  case MO_TEXT:
  case MO_CHAT: {
    uint32_t *n = opt == MO_TEXT ? &c->n_texts : &c->n_chats;
    if (*n >= CLI_MAX_TEXTS) {
      fprintf(stderr, PROG ": at most %u --prompt / --chat\n", CLI_MAX_TEXTS);
      return -1;
    }
    (opt == MO_TEXT ? c->texts : c->chats)[(*n)++] = arg;
    return 1;
  }
  case MO_SYSTEM: c->system = arg; return 1;
  case MO_TEMPLATE: c->chat_template = arg; return 1;
  case MO_STOP:
    if (c->n_stops >= GC_TEXT_MAX_STOPS || !*arg || strlen(arg) > GC_TEXT_MAX_STOP_BYTES) {
      fprintf(stderr, PROG ": --stop \"%s\": at most %u stop strings of 1..%u bytes\n", arg, GC_TEXT_MAX_STOPS,
              GC_TEXT_MAX_STOP_BYTES);
      return -1;
    }
    c->stops[c->n_stops++] = arg;
    return 1;
  default: return 0;
  }
}

int gc__cli_getopt(int argc, char **argv, const struct option *lo, int help_opt,
                   const char *const help[3], gc__cli_opt_fn first, void *first_ctx,
                   gc__cli_opt_fn second, void *second_ctx) {
  optind = 1;
  opterr = 0;
  for (;;) {
    int oi = 0, opt = getopt_long(argc, argv, "", lo, &oi);
    if (opt == -1) break;
    if (opt == help_opt) {
      printf("%s%s%s", help[0], help[1], help[2]);
      return 1;
    }
    if (opt == '?' || opt == ':') {
      fprintf(stderr, PROG " %s: bad or incomplete option \"%s\" (see --help)\n", argv[0],
              argv[optind - 1]);
      return 2;
    }
    int r = first(first_ctx, opt, optarg);
    if (r == 0 && second) r = second(second_ctx, opt, optarg);
    if (r == 0) {
      fprintf(stderr, PROG " %s: unexpected option (see --help)\n", argv[0]);
      return 2;
    }
    if (r < 0) return 2;
  }
  if (optind < argc) {
    fprintf(stderr, PROG " %s: unexpected argument \"%s\" (see --help)\n", argv[0], argv[optind]);
    return 2;
  }
  return 0;
}

/* getopt_long over argv; 0 = run, 1 = --help printed, 2 = usage error. */
int gc__cli_parse(int argc, char **argv, const struct option *lo, const char *usage, const char *own_help,
                  gc__mcli *c, gc__cli_opt_fn own, void *ctx) {
  const char *const help[3] = {usage, own_help, gc__cli_model_help};
  int rc = gc__cli_getopt(argc, argv, lo, MO_HELP, help, model_opt, c, own, ctx);
  if (rc) return rc;
  if (!c->mo.model_dir) {
    fprintf(stderr, PROG " %s: --model DIR is required (see --help)\n", argv[0]);
    return 2;
  }
  if ((c->mo.local_experts >= 0 || c->mo.placement_path) && !c->mo.cluster_path) {
    fprintf(stderr, PROG " %s: --local-experts and --placement need --cluster (without it "
            "every expert is local)\n", argv[0]);
    return 2;
  }
  if (c->mo.local_experts >= 0 && c->mo.placement_path) {
    fprintf(stderr, PROG " %s: --local-experts and --placement are exclusive\n", argv[0]);
    return 2;
  }
  if (c->mo.watch_placement && !c->mo.placement_path) {
    fprintf(stderr, PROG " %s: --watch-placement needs --placement FILE\n", argv[0]);
    return 2;
  }
  return 0;
}

void gc__cli_init(gc__mcli *c) {
  memset(c, 0, sizeof *c);
  gc_model_opts_init(&c->mo);
  c->batch = 1;
  c->smp.top_p = 1.0f;
  c->mo.pin_caller = true; /* this thread makes every step */
}

/* Parses "1,2,3;4,5" into sequences (';' separates them). *ids and *lens are heap arrays
 * the caller frees; the sequences are consecutive in *ids. */
static int parse_prompts(const char *flag, const char *s, int32_t **ids, uint32_t **lens,
                         uint32_t *n_seqs) {
  size_t cap = strlen(s) / 2 + 2;
  if (cap > CLI_MAX_IDS) cap = CLI_MAX_IDS;
  *ids = malloc(cap * sizeof **ids);
  *lens = calloc(CLI_MAX_SEQS, sizeof **lens);
  *n_seqs = 0;
  if (!*ids || !*lens) return fprintf(stderr, PROG ": out of memory\n"), -1;
  size_t n = 0;
  uint32_t seq = 0;
  const char *p = s;
  for (;;) {
    char *end;
    errno = 0;
    if (*p == '-' || *p < '0' || *p > '9') goto bad;
    unsigned long v = strtoul(p, &end, 10);
    if (errno || end == p || v > INT32_MAX) goto bad;
    if (n >= cap) {
      fprintf(stderr, PROG ": %s: more than %zu ids\n", flag, cap);
      return -1;
    }
    (*ids)[n++] = (int32_t)v;
    (*lens)[seq]++;
    p = end;
    if (*p == 0) break;
    if (*p == ';') {
      if (++seq >= CLI_MAX_SEQS) {
        fprintf(stderr, PROG ": %s: more than %u sequences\n", flag, CLI_MAX_SEQS);
        return -1;
      }
      p++;
      continue;
    }
    if (*p != ',') goto bad;
    p++;
  }
  *n_seqs = seq + 1;
  return 0;
bad:
  fprintf(stderr, PROG ": %s = \"%.64s\": expected comma-separated token ids (0..2^31-1), "
          "sequences separated by ';' (at offset %zu)\n", flag, s, (size_t)(p - s));
  return -1;
}

int gc__cli_open_model(gc__mcli *c, gc_model **m) {
  mr_err e;
  mr_err_clear(&e);
  int rc = gc_model_open(m, &c->mo, &e);
  if (rc) {
    fprintf(stderr, PROG ": %s: %s\n", mr_err_name(rc), e.msg);
    return rc;
  }
  if (c->metrics_listen) {
    rc = mr_http_server_new(&cli_metrics, c->metrics_listen, "--metrics-listen", "/metrics",
                            metrics_render, *m, &e);
    if (rc) {
      fprintf(stderr, PROG ": %s: %s\n", mr_err_name(rc), e.msg);
      return rc;
    }
    if ((rc = gc__cli_model_routes(cli_metrics, *m, &e))) {
      fprintf(stderr, PROG ": %s: %s\n", mr_err_name(rc), e.msg);
      return rc;
    }
    const char *l = c->metrics_listen;
    mr_log(MR_LOG_INFO, "metrics: http://%.*s:%d/metrics", (int)(strrchr(l, ':') - l), l,
           mr_http_server_port(cli_metrics));
  }
  return 0;
}

/* Vocabulary and length checks of prompts against the opened model. */
static int check_prompts(gc_model *m, const int32_t *ids, const uint32_t *lens, uint32_t n,
                         uint32_t extra) {
  const mr_model_config *cfg = gc_model_config(m);
  size_t off = 0;
  for (uint32_t b = 0; b < n; b++) {
    for (uint32_t i = 0; i < lens[b]; i++)
      if ((uint32_t)ids[off + i] >= cfg->vocab_size) {
        fprintf(stderr, PROG ": prompt %u token %u: id %d is out of the vocabulary (0..%u)\n", b,
                i, ids[off + i], cfg->vocab_size - 1);
        return -1;
      }
    if ((uint64_t)lens[b] + extra > gc_model_max_seq(m)) {
      fprintf(stderr, PROG ": prompt %u: %u tokens + %u new is longer than --max-seq %u\n", b,
              lens[b], extra, gc_model_max_seq(m));
      return -1;
    }
    off += lens[b];
  }
  return 0;
}

/* ---- generate ---------------------------------------------------------------------------- */

/* One line (stdout; a JSON object with --json) when a server of the cluster failed over
 * or was refused on return during the run: which, how often, how many requests were
 * resent, how long it was down and its last failover time (last good reply -> first
 * rerouted reply). Nothing when none did, or without a cluster. */
static void failover_summary(gc_model *m, bool json) {
  gc_cluster *cl = m ? gc_model_cluster(m) : NULL;
  if (!cl) return;
  gc_cluster_info ci;
  gc_cluster_info_get(cl, &ci);
  bool any = false;
  for (uint32_t i = 0; i < ci.n_servers; i++) {
    gc_server_counters ct;
    gc_server_info si;
    if (gc_server_counters_get(cl, i, false, &ct, NULL) || gc_server_info_get(cl, i, &si, NULL))
      continue;
    if (!ct.failovers && !ct.refusals) continue;
    if (json)
      printf("%s{\"server\": \"%s\", \"failovers\": %llu, \"resent\": %llu, \"returns\": %llu, "
             "\"refusals\": %llu, \"down_ms\": %.1f, \"down_now\": %s, \"failover_ms\": %.3f}",
             any ? ", " : "{\"failover\": [", si.name, (unsigned long long)ct.failovers,
             (unsigned long long)ct.resent, (unsigned long long)ct.returns,
             (unsigned long long)ct.refusals, ct.down_us / 1e3, ct.down ? "true" : "false",
             ct.last_failover_us / 1e3);
    else
      printf("%s%s (%s): %llu failover%s, %llu request%s resent, %llu return%s, %llu refusal%s, "
             "down %.1f ms%s, failover time %.3f ms", any ? "; " : "failover: ", si.name,
             si.address, (unsigned long long)ct.failovers, ct.failovers == 1 ? "" : "s",
             (unsigned long long)ct.resent, ct.resent == 1 ? "" : "s",
             (unsigned long long)ct.returns, ct.returns == 1 ? "" : "s",
             (unsigned long long)ct.refusals, ct.refusals == 1 ? "" : "s", ct.down_us / 1e3,
             ct.down ? " (still down)" : "", ct.last_failover_us / 1e3);
    any = true;
  }
  if (any) printf(json ? "]}\n" : "\n");
}

/* ---- generate: text in, text out ---------------------------------------------------------
 *
 * --prompt TEXT (as tokenizer(text): its post-processor may add a BOS) and --chat MESSAGE
 * (with --system: rendered by the model's chat template with add_generation_prompt, then
 * tokenized as apply_chat_template does: special tokens matched, nothing added) make one
 * sequence each. They run through the continuous-batching scheduler (sched.h), which
 * serve uses too, and each stops at the model's stop ids (generation_config.json and the
 * tokenizer's eos), at a --stop string (never printed), or after --max-new tokens. With
 * one sequence the text is printed as it is produced; with several, each when it ends. */

typedef struct gen_seq {
  uint32_t idx;
  gc_text_out *txt;
  bool stream;            /* print as produced (one sequence, not --json) */
  char *text;             /* all emitted text (for --json and the several-sequence print) */
  size_t text_len, text_cap;
  int32_t *ids;           /* produced ids */
  uint32_t n_ids;
  gc_finish why;
  mr_err err;
  gc_sched_usage u;
  bool done;
  int text_rc;            /* a decoding failure (ends the sequence) */
} gen_seq;

static bool gen_append(gen_seq *q, const char *s, size_t n) {
  if (n == 0) return true;
  if (q->stream) {
    fwrite(s, 1, n, stdout);
    fflush(stdout);
  }
  if (q->text_len + n + 1 > q->text_cap) {
    size_t c = q->text_cap ? q->text_cap * 2 : 256;
    while (c < q->text_len + n + 1) c *= 2;
    char *p = mr_realloc(q->text, c);
    if (!p) return false;
    q->text = p;
    q->text_cap = c;
  }
  memcpy(q->text + q->text_len, s, n);
  q->text_len += n;
  q->text[q->text_len] = '\0';
  return true;
}

static bool gen_on_token(void *ud, const gc_sched_token *t) {
  gen_seq *q = ud;
  q->ids[q->n_ids++] = t->id;
  const char *s;
  size_t n;
  bool stopped = false;
  mr_err e;
  q->text_rc = gc_text_out_feed(q->txt, t->id, &s, &n, &stopped, &e);
  if (q->text_rc || !gen_append(q, s, n)) {
    if (!q->text_rc) q->text_rc = MR_ENOMEM;
    return true;
  }
  return stopped;
}

static void gen_on_done(void *ud, gc_finish why, const mr_err *err, const gc_sched_usage *u) {
  gen_seq *q = ud;
  q->why = why;
  q->u = *u;
  q->done = true;
  if (err) q->err = *err;
  const char *s;
  size_t n;
  mr_err e;
  if (why != GC_FINISH_ERROR && gc_text_out_finish(q->txt, &s, &n, &e) == 0) gen_append(q, s, n);
  if (q->stream) putchar('\n');
}

/* The prompts of --prompt and --chat, tokenized, into prompts[i] (mr_malloc'ed); the time
 * spent rendering templates and encoding into *tmpl_ns / *enc_ns. */
static int gen_prompts(const gc__mcli *c, const gc_tok *tok, gc_tok_ids *prompts, uint64_t *tmpl_ns, uint64_t *enc_ns,
                       mr_err *e) {
  gc_chat *chat = NULL;
  int rc = 0;
  uint32_t k = 0;
  uint64_t t0 = mr_now_ns();
  for (uint32_t i = 0; i < c->n_texts && !rc; i++, k++)
    rc = gc_tok_encode(tok, c->texts[i], strlen(c->texts[i]), true, &prompts[k], e);
  *enc_ns = mr_now_ns() - t0;
  *tmpl_ns = 0;
  if (!rc && c->n_chats) rc = gc_chat_load(&chat, c->mo.model_dir, c->chat_template, e);
  for (uint32_t i = 0; i < c->n_chats && !rc; i++, k++) {
    cJSON *msgs = cJSON_CreateArray(), *m;
    if (c->system && (m = cJSON_CreateObject())) {
      cJSON_AddStringToObject(m, "role", "system");
      cJSON_AddStringToObject(m, "content", c->system);
      cJSON_AddItemToArray(msgs, m);
    }
    if ((m = cJSON_CreateObject())) {
      cJSON_AddStringToObject(m, "role", "user");
      cJSON_AddStringToObject(m, "content", c->chats[i]);
      cJSON_AddItemToArray(msgs, m);
    }
    char *text = NULL;
    size_t len = 0;
    t0 = mr_now_ns();
    rc = gc_chat_render(chat, msgs, NULL, true, NULL, &text, &len, e);
    *tmpl_ns += mr_now_ns() - t0;
    t0 = mr_now_ns();
    if (!rc) rc = gc_tok_encode(tok, text, len, false, &prompts[k], e);
    *enc_ns += mr_now_ns() - t0;
    mr_free(text);
    cJSON_Delete(msgs);
  }
  gc_chat_free(chat);
  return rc;
}

static void gen_print_json(const gen_seq *q) {
  cJSON *o = cJSON_CreateObject(), *ids = cJSON_CreateArray();
  cJSON_AddNumberToObject(o, "seq", q->idx);
  cJSON_AddStringToObject(o, "text", q->text ? q->text : "");
  for (uint32_t i = 0; i < q->n_ids; i++) cJSON_AddItemToArray(ids, cJSON_CreateNumber(q->ids[i]));
  cJSON_AddItemToObject(o, "ids", ids);
  cJSON_AddStringToObject(o, "finish_reason", gc_finish_name(q->why));
  cJSON_AddNumberToObject(o, "prompt_tokens", q->u.prompt_tokens);
  cJSON_AddNumberToObject(o, "completion_tokens", q->u.completion_tokens);
  if (q->why == GC_FINISH_ERROR) cJSON_AddStringToObject(o, "error", q->err.msg);
  char *s = cJSON_PrintUnformatted(o);
  if (s) printf("%s\n", s);
  cJSON_free(s);
  cJSON_Delete(o);
}

static int gen_text(gc__mcli *c) {
  const uint32_t n = c->n_texts + c->n_chats;
  mr_err e;
  mr_err_clear(&e);
  gc_tok *tok = NULL;
  gc_model *m = NULL;
  gc_sched *sch = NULL;
  gc_tok_ids *prompts = mr_calloc(n, sizeof *prompts);
  gen_seq *seqs = mr_calloc(n, sizeof *seqs);
  int32_t stop_ids[GC_SCHED_MAX_STOP_IDS];
  size_t n_stop = 0;
  int rc = prompts && seqs ? 0 : mr_err_set(&e, MR_ENOMEM, "out of memory"), status = 1;
  if (!rc) rc = gc_tok_load(&tok, c->mo.model_dir, &e);
  uint64_t tmpl_ns = 0, enc_ns = 0;
  if (!rc) rc = gen_prompts(c, tok, prompts, &tmpl_ns, &enc_ns, &e);
  if (!rc) rc = gc_text_stop_ids(c->mo.model_dir, tok, stop_ids, GC_SCHED_MAX_STOP_IDS, &n_stop, &e);
  if (rc) {
    fprintf(stderr, PROG " generate: %s: %s\n", mr_err_name(rc), e.msg);
    goto out;
  }
  c->mo.max_batch = c->batch_set ? c->batch : n;
  if (gc__cli_open_model(c, &m)) goto out;
  gc_sched_opts so = {.max_queue = n};
  if ((rc = gc_sched_new(&sch, m, &so, &e))) {
    fprintf(stderr, PROG " generate: %s: %s\n", mr_err_name(rc), e.msg);
    goto out;
  }
  const uint64_t t0 = mr_now_ns();
  for (uint32_t i = 0; i < n; i++) {
    gen_seq *q = &seqs[i];
    q->idx = i;
    q->stream = n == 1 && !c->json;
    q->ids = mr_malloc(((size_t)c->max_new + 1) * sizeof *q->ids);
    if (!q->ids) rc = mr_err_set(&e, MR_ENOMEM, "out of memory");
    if (!rc) rc = gc_text_out_new(&q->txt, tok, c->stops, c->n_stops, true, &e);
    gc_sched_req r = {.prompt = prompts[i].v, .n_prompt = (uint32_t)prompts[i].n, .max_new = c->max_new,
                      .smp = c->smp, .on_token = gen_on_token, .on_done = gen_on_done, .ud = q};
    for (uint32_t k = 0; k < GC_SCHED_MAX_STOP_IDS; k++) r.stop_ids[k] = k < n_stop ? stop_ids[k] : -1;
    if (!rc) rc = gc_sched_submit(sch, &r, NULL, &e);
    if (rc) {
      fprintf(stderr, PROG " generate: sequence %u: %s: %s\n", i, mr_err_name(rc), e.msg);
      goto out;
    }
  }
  for (bool busy = true; busy;) gc_sched_step(sch, &busy);
  const double secs = (double)(mr_now_ns() - t0) / 1e9;
  uint64_t p_tok = 0, c_tok = 0, first_ns = 0;
  status = 0;
  for (uint32_t i = 0; i < n; i++) {
    const gen_seq *q = &seqs[i];
    p_tok += q->u.prompt_tokens;
    c_tok += q->u.completion_tokens;
    if (q->u.t_first_ns && (!first_ns || q->u.t_first_ns - q->u.t_submit_ns > first_ns))
      first_ns = q->u.t_first_ns - q->u.t_submit_ns;
    if (q->why == GC_FINISH_ERROR || q->text_rc) {
      fprintf(stderr, PROG " generate: sequence %u: %s\n", i, q->why == GC_FINISH_ERROR ? q->err.msg : "decoding failed");
      status = 1;
    }
    if (c->json) gen_print_json(q);
    else if (n > 1) printf("[%u] %s\n", i, q->text ? q->text : "");
  }
  if (c->json)
    printf("{\"prompt_tokens\": %llu, \"completion_tokens\": %llu, \"seconds\": %.3f, \"template_s\": %.6f, "
           "\"encode_s\": %.6f, \"first_token_s\": %.3f, \"tok_s\": %.2f}\n", (unsigned long long)p_tok,
           (unsigned long long)c_tok, secs, tmpl_ns / 1e9, enc_ns / 1e9, first_ns / 1e9, secs > 0 ? c_tok / secs : 0.0);
  else
    fprintf(stderr, "%u sequence%s: %llu prompt tokens, %llu generated in %.3f s (%.1f tok/s), first token after "
            "%.3f s; finish: %s\n", n, n == 1 ? "" : "s", (unsigned long long)p_tok, (unsigned long long)c_tok, secs,
            secs > 0 ? c_tok / secs : 0.0, first_ns / 1e9, gc_finish_name(seqs[n - 1].why));
out:
  gc_sched_free(sch);
  failover_summary(m, c->json);
  if (gc__cli_close_model(c, m) && status == 0) status = 1;
  for (uint32_t i = 0; seqs && i < n; i++) {
    gc_text_out_free(seqs[i].txt);
    mr_free(seqs[i].text);
    mr_free(seqs[i].ids);
  }
  for (uint32_t i = 0; prompts && i < n; i++) mr_free(prompts[i].v);
  mr_free(prompts);
  mr_free(seqs);
  gc_tok_free(tok);
  return status;
}

static const char GEN_USAGE[] =
    "usage: " PROG " generate --model DIR (--prompt TEXT | --chat MESSAGE [--system TEXT] |\n"
    "                --prompt-ids 1,2,3[;4,5]) [--max-new N] [--stop STRING]...\n"
    "                [--cluster FILE] [--local-experts N | --placement FILE] [--max-deferred K]\n"
    "                [--temperature T --top-p P --top-k K --seed S] [--json]\n"
    "Text: each --prompt / --chat is one sequence; the text is printed as it is produced (one\n"
    "sequence) or when each ends (several), then a timing line on stderr. A sequence stops at\n"
    "the model's stop ids (generation_config.json, the tokenizer's eos), at a --stop string\n"
    "(not printed) or after --max-new tokens. Requests share steps as serve's do (continuous\n"
    "batching). Ids: --prompt-ids generates exactly N tokens after each prompt and prints the\n"
    "ids (';' between sequences; --batch B repeats them cyclically): all prompts are\n"
    "prefilled in one step, then every sequence decodes one token per step.\n\n";
static const char GEN_HELP[] =
    "generation:\n"
    "  --prompt TEXT            a completion prompt, tokenized as tokenizer(TEXT) (repeatable)\n"
    "  --chat MESSAGE           a user message rendered by the model's chat template with the\n"
    "                           assistant's turn opened (repeatable)\n"
    "  --system TEXT            a system message before each --chat\n"
    "  --chat-template FILE     use this Jinja template instead of the model's\n"
    "  --stop STRING            end a sequence when its text contains STRING (repeatable,\n"
    "                           at most 16); the text stops before it\n"
    "  --prompt-ids LIST        token ids, ';' between sequences (prints ids)\n"
    "  --batch B                sequences, 1..4096 (default: the prompts given)\n"
    "  --max-new N              tokens to generate per sequence (default 16)\n"
    "  --temperature T          0 = greedy (default), else softmax(logits / T) sampling\n"
    "  --top-k K                keep the K most likely tokens (0 = all, the default)\n"
    "  --top-p P                nucleus sampling mass in (0, 1] (default 1)\n"
    "  --seed S                 sampling seed (default 0)\n"
    "  --json                   one JSON line per sequence (text: also the ids, finish_reason,\n"
    "                           token counts) and a timing line\n";

int gc__cli_generate(int argc, char **argv) {
  static const struct option lo[] = {
      MODEL_OPTIONS, {"prompt-ids", required_argument, NULL, MO_PROMPT},
      {"prompt", required_argument, NULL, MO_TEXT}, {"chat", required_argument, NULL, MO_CHAT},
      {"system", required_argument, NULL, MO_SYSTEM}, {"stop", required_argument, NULL, MO_STOP},
      {"chat-template", required_argument, NULL, MO_TEMPLATE},
      {"batch", required_argument, NULL, MO_BATCH},
      {"max-new", required_argument, NULL, MO_MAXNEW},
      {"temperature", required_argument, NULL, MO_TEMP},
      {"top-p", required_argument, NULL, MO_TOPP}, {"top-k", required_argument, NULL, MO_TOPK},
      {"seed", required_argument, NULL, MO_SEED},
      {"json", no_argument, NULL, MO_JSON}, {NULL, 0, NULL, 0}};
  gc__mcli c;
  gc__cli_init(&c);
  c.max_new = 16;
  int r = gc__cli_parse(argc, argv, lo, GEN_USAGE, GEN_HELP, &c, NULL, NULL);
  if (r) return r == 1 ? 0 : 2;
  const bool text = c.n_texts || c.n_chats;
  if (!c.prompt == !text) {
    fprintf(stderr, PROG " generate: give --prompt / --chat (text) or --prompt-ids (ids), not both "
            "(see --help)\n");
    return 2;
  }
  if (!text && (c.n_stops || c.system || c.chat_template || c.smp.top_k)) {
    fprintf(stderr, PROG " generate: --stop, --system, --chat-template and --top-k go with --prompt / "
            "--chat\n");
    return 2;
  }
  if (c.system && !c.n_chats) {
    fprintf(stderr, PROG " generate: --system goes with --chat\n");
    return 2;
  }
  if (text) {
    if (c.max_new < 1) {
      fprintf(stderr, PROG " generate: --max-new = 0: text generation makes at least one token\n");
      return 2;
    }
    if (c.batch_set && c.batch < c.n_texts + c.n_chats) {
      fprintf(stderr, PROG " generate: --batch %u is below the %u sequences (it sets the KV slots; "
              "sequences wait for a slot)\n", c.batch, c.n_texts + c.n_chats);
    }
    return gen_text(&c);
  }
  int32_t *ids = NULL, *gen = NULL;
  uint32_t *lens = NULL, n_given = 0;
  const int32_t **prompts = NULL;
  uint32_t *blen = NULL;
  gc_model *m = NULL;
  int rc = 1;
  if (parse_prompts("--prompt-ids", c.prompt, &ids, &lens, &n_given)) {
    rc = 2;
    goto out;
  }
  uint32_t B = c.batch_set ? c.batch : n_given;
  c.mo.max_batch = B;
  prompts = calloc(B, sizeof *prompts);
  blen = calloc(B, sizeof *blen);
  size_t *off = calloc(n_given, sizeof *off);
  if (!prompts || !blen || !off) {
    free(off);
    goto out;
  }
  for (uint32_t i = 1; i < n_given; i++) off[i] = off[i - 1] + lens[i - 1];
  for (uint32_t b = 0; b < B; b++) {
    prompts[b] = ids + off[b % n_given];
    blen[b] = lens[b % n_given];
  }
  free(off);
  if (gc__cli_open_model(&c, &m)) goto out;
  if (check_prompts(m, ids, lens, n_given, c.max_new)) goto out;
  gen = malloc(((size_t)B * c.max_new + 1) * sizeof *gen);
  if (!gen) goto out;
  gc_gen_timing t;
  mr_err e;
  mr_err_clear(&e);
  int grc = gc_model_generate(m, B, prompts, blen, c.max_new, &c.smp, gen, &t, &e);
  if (grc) {
    fprintf(stderr, PROG ": %s: %s\n", mr_err_name(grc), e.msg);
    goto out;
  }
  double pf = t.prefill_us ? t.prefill_tokens * 1e6 / t.prefill_us : 0;
  double dc = t.decode_us ? t.decode_tokens * 1e6 / t.decode_us : 0;
  for (uint32_t b = 0; b < B; b++) {
    printf(c.json ? "{\"seq\": %u, \"ids\": [" : "seq %u:", b);
    for (uint32_t i = 0; i < c.max_new; i++)
      printf(c.json ? "%s%d" : "%s%d", c.json ? (i ? ", " : "") : " ", gen[(size_t)b * c.max_new + i]);
    printf(c.json ? "]}\n" : "\n");
  }
  if (c.json)
    printf("{\"prefill_tokens\": %llu, \"prefill_s\": %.6f, \"prefill_tok_s\": %.2f, "
           "\"decode_tokens\": %llu, \"decode_s\": %.6f, \"decode_tok_s\": %.2f}\n",
           (unsigned long long)t.prefill_tokens, t.prefill_us / 1e6, pf,
           (unsigned long long)t.decode_tokens, t.decode_us / 1e6, dc);
  else
    printf("prefill %llu tokens in %.3f s (%.1f tok/s), decode %llu tokens in %.3f s (%.1f "
           "tok/s)\n", (unsigned long long)t.prefill_tokens, t.prefill_us / 1e6, pf,
           (unsigned long long)t.decode_tokens, t.decode_us / 1e6, dc);
  rc = 0;
out:
  failover_summary(m, c.json);
  if (gc__cli_close_model(&c, m) && rc == 0) rc = 1;
  free(ids);
  free(lens);
  free(prompts);
  free(blen);
  free(gen);
  return rc;
}

/* ---- logits ------------------------------------------------------------------------------ */

static const char LOGITS_USAGE[] =
    "usage: " PROG " logits --model DIR --ids 1,2,3 --out FILE [--cluster FILE]\n"
    "                [--local-experts N | --placement FILE] [--max-deferred K]\n"
    "Prefills one sequence and writes its fp32 logits [T, vocab] to FILE, row-major, raw\n"
    "little-endian (T = the number of ids). MOERPC_ISA=ref (or --isa ref) computes on the\n"
    "fp32 reference path, which the conformance tests compare with transformers.\n\n";
static const char LOGITS_HELP[] =
    "logits:\n"
    "  --ids LIST               token ids of the sequence                        required\n"
    "  --out FILE               where the logits go                              required\n"
    "  --compare FILE           logits written earlier (e.g. all-local): print the relative\n"
    "                           L2 difference and how many rows agree on the argmax\n";

/* Prints the difference of logits [T, V] from the raw fp32 file ref_path. */
static int compare_logits(const char *ref_path, const float *logits, uint32_t T, uint32_t V) {
  const size_t n = (size_t)T * V;
  float *ref = malloc(n * sizeof *ref);
  FILE *f = fopen(ref_path, "rb");
  size_t got = f && ref ? fread(ref, sizeof *ref, n, f) : 0;
  int extra = f ? fgetc(f) : EOF;
  if (f) fclose(f);
  if (got != n || extra != EOF) {
    fprintf(stderr, PROG ": --compare %s: must hold exactly %u x %u fp32 logits\n", ref_path, T,
            V);
    free(ref);
    return -1;
  }
  uint32_t agree = 0;
  for (uint32_t t = 0; t < T; t++) {
    const float *a = logits + (size_t)t * V, *b = ref + (size_t)t * V;
    uint32_t ia = 0, ib = 0;
    for (uint32_t i = 1; i < V; i++) {
      if (a[i] > a[ia]) ia = i;
      if (b[i] > b[ib]) ib = i;
    }
    agree += ia == ib;
  }
  printf("logits vs %s: relative L2 %.3e, argmax equal in %u of %u rows\n", ref_path,
         kn_rel_l2(logits, ref, n), agree, T);
  free(ref);
  return 0;
}

int gc__cli_logits(int argc, char **argv) {
  static const struct option lo[] = {MODEL_OPTIONS, {"ids", required_argument, NULL, MO_IDS},
                                     {"out", required_argument, NULL, MO_OUT},
                                     {"compare", required_argument, NULL, MO_COMPARE},
                                     {NULL, 0, NULL, 0}};
  gc__mcli c;
  gc__cli_init(&c);
  int r = gc__cli_parse(argc, argv, lo, LOGITS_USAGE, LOGITS_HELP, &c, NULL, NULL);
  if (r) return r == 1 ? 0 : 2;
  if (!c.ids || !c.out) {
    fprintf(stderr, PROG " logits: --ids and --out are required (see --help)\n");
    return 2;
  }
  int32_t *ids = NULL;
  uint32_t *lens = NULL, n = 0, *seq = NULL, *pos = NULL;
  float *logits = NULL;
  gc_model *m = NULL;
  FILE *f = NULL;
  int rc = 1;
  if (parse_prompts("--ids", c.ids, &ids, &lens, &n)) {
    rc = 2;
    goto out;
  }
  if (n != 1) {
    fprintf(stderr, PROG " logits: --ids holds %u sequences, must be one\n", n);
    rc = 2;
    goto out;
  }
  const uint32_t T = lens[0];
  if (c.mo.max_seq == 0) c.mo.max_seq = T; /* the cache needs no more */
  if (gc__cli_open_model(&c, &m)) goto out;
  if (check_prompts(m, ids, lens, 1, 0)) goto out;
  const uint32_t V = gc_model_config(m)->vocab_size;
  seq = calloc(T, sizeof *seq);
  pos = malloc(T * sizeof *pos);
  logits = malloc((size_t)T * V * sizeof *logits);
  if (!seq || !pos || !logits) goto out;
  for (uint32_t i = 0; i < T; i++) pos[i] = i;
  gc_step s = {.n_tokens = T, .ids = ids, .seq = seq, .pos = pos, .logits = logits};
  mr_err e;
  mr_err_clear(&e);
  int src = gc_model_step(m, &s, &e);
  if (src) {
    fprintf(stderr, PROG ": %s: %s\n", mr_err_name(src), e.msg);
    goto out;
  }
  f = fopen(c.out, "wb");
  if (!f || fwrite(logits, sizeof *logits, (size_t)T * V, f) != (size_t)T * V ||
      fclose(f) != 0) {
    f = NULL;
    fprintf(stderr, PROG ": %s: cannot write: %s\n", c.out, strerror(errno));
    goto out;
  }
  f = NULL;
  mr_log(MR_LOG_INFO, "logits: %u x %u fp32 written to %s", T, V, c.out);
  if (c.compare && compare_logits(c.compare, logits, T, V)) goto out;
  rc = 0;
out:
  if (f) fclose(f);
  if (gc__cli_close_model(&c, m) && rc == 0) rc = 1;
  free(ids);
  free(lens);
  free(seq);
  free(pos);
  free(logits);
  return rc;
}

/* ---- bench ------------------------------------------------------------------------------- */

static const char BENCH_USAGE[] =
    "usage: " PROG " bench --model DIR [--cluster FILE] [--local-experts N | --placement FILE]\n"
    "                [--max-deferred K] [--batch B] [--prompt-len P] [--decode N]\n"
    "                [--repeats R] [--json]\n"
    "Prefills B random prompts of P tokens (seeded), then decodes N tokens per sequence,\n"
    "R times, and reports the median: prefill_tok_s, decode_tok_s, per layer the decode\n"
    "time in attention, local experts (or the dense MLP), submitting and waiting on RPC,\n"
    "the overlap ratio (RPC time hidden / RPC time, RPC time from the requests queued to\n"
    "the last reply) and decode_bw_ratio = (weight bytes one decode\n"
    "step reads / step time) / (a plain read of the same bytes, same run). Also each\n"
    "run's median and p90 step (step_ms_p50, step_ms_p90) and, with servers, the decode\n"
    "replies' mean server compute, server arrival-to-reply and submit-to-reply times\n"
    "(server_compute_us, server_us, server_rtt_us).\n\n";
static const char BENCH_HELP[] =
    "bench:\n"
    "  --batch B                sequences, 1..4096 (default 1)\n"
    "  --prompt-len P           prompt tokens per sequence (default 32)\n"
    "  --decode N               decode steps (default 32)\n"
    "  --repeats R              runs, the median is reported (default 3)\n"
    "  --seed S                 prompt ids seed (default 0)\n"
    "  --json                   JSON lines: one summary, one per layer\n";

typedef struct read_job {
  const uint64_t *buf;
  size_t words, per_item;
  uint64_t sink[64];
} read_job;

static void read_item(void *arg, uint32_t item, uint32_t worker) {
  read_job *j = arg;
  size_t a = (size_t)item * j->per_item, b = a + j->per_item;
  if (b > j->words) b = j->words;
  uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  for (size_t i = a; i + 4 <= b; i += 4) {
    s0 += j->buf[i];
    s1 += j->buf[i + 1];
    s2 += j->buf[i + 2];
    s3 += j->buf[i + 3];
  }
  j->sink[worker & 63] += s0 ^ s1 ^ s2 ^ s3;
}

/* GB/s of a plain read of `bytes` on the engine's threads (median of 3, warm pages). */
static double plain_read_gbs(kn_engine *eng, uint64_t bytes) {
  size_t words = (size_t)(bytes / 8) & ~(size_t)3;
  if (words < 1024) words = 1024;
  uint64_t *buf = mr_malloc_aligned(words * 8, 64);
  if (!buf) return 0;
  for (size_t i = 0; i < words; i++) buf[i] = i;
  read_job j = {.buf = buf, .words = words, .per_item = 1u << 16};
  uint32_t items = (uint32_t)((words + j.per_item - 1) / j.per_item);
  double best[3];
  for (int r = 0; r < 3; r++) {
    uint64_t t0 = mr_now_ns();
    kn_engine_run(eng, items, read_item, &j);
    best[r] = (double)words * 8 / (double)(mr_now_ns() - t0);
  }
  mr_free_aligned(buf);
  double a = best[0], b = best[1], c = best[2]; /* median */
  return a > b ? (b > c ? b : (a > c ? c : a)) : (a > c ? a : (b > c ? c : b));
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}
static double median(double *v, uint32_t n) {
  qsort(v, n, sizeof *v, cmp_double);
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

typedef struct bench_run {
  double prefill_tok_s, decode_tok_s, step_ms, overlap, bw_ratio, read_gbs, weight_gbs;
  double bytes_per_step;
  double step_p50_ms, step_p90_ms; /* of this run's decode steps, one by one */
  /* The decode's replies, mean per reply over every server (0 without servers): the
   * server's compute_us and server_us (arrival to reply encoded), and submit to reply. */
  double srv_compute_us, srv_us, srv_rtt_us;
  uint64_t rpc_us, wait_us;
} bench_run;

/* What `bench` measures and reports: the buffers of one batch, each run's figures and the
 * per-layer sums over all runs. */
typedef struct bench_state {
  gc_model *m;
  uint32_t B, P, N, V, L, repeats;
  int32_t *ids;
  uint32_t *seq, *pos;
  uint8_t *want;          /* [B * P] logits wanted (each prompt's last token) */
  float *logits;          /* [B, V] */
  bench_run *runs;        /* [repeats] */
  gc_layer_stats *lsum;   /* [L] sums over every decode step of every run */
  double *step_ms;        /* [N] this run's decode steps, one by one */
  uint64_t rng;
  /* medians of the runs, and the plain read of the same bytes */
  double ptok, dtok, over, bytes, weight_gbs, read_gbs, ratio, step_p50, step_p90;
  double srv_compute_us, srv_us, srv_rtt_us;
} bench_state;

static int bench_alloc(bench_state *b) {
  const size_t BP = (size_t)b->B * b->P;
  b->ids = malloc(BP * sizeof *b->ids);
  b->seq = malloc(BP * sizeof *b->seq);
  b->pos = malloc(BP * sizeof *b->pos);
  b->want = calloc(BP, 1);
  b->logits = malloc((size_t)b->B * b->V * sizeof *b->logits);
  b->runs = calloc(b->repeats, sizeof *b->runs);
  b->lsum = calloc(b->L, sizeof *b->lsum);
  b->step_ms = calloc(b->N ? b->N : 1, sizeof *b->step_ms);
  return b->ids && b->seq && b->pos && b->want && b->logits && b->runs && b->lsum && b->step_ms
             ? 0 : MR_ENOMEM;
}

static void bench_free(bench_state *b) {
  free(b->ids);
  free(b->seq);
  free(b->pos);
  free(b->want);
  free(b->logits);
  free(b->runs);
  free(b->lsum);
  free(b->step_ms);
}

/* B fresh sequences of P random tokens (a fixed LCG from --seed: every run and every
 * configuration sees the same prompts), logits wanted at each prompt's end. */
static void bench_prompts(bench_state *b) {
  for (uint32_t s = 0; s < b->B; s++) {
    gc_model_seq_reset(b->m, s);
    for (uint32_t p = 0; p < b->P; p++) {
      size_t i = (size_t)s * b->P + p;
      b->rng = b->rng * 6364136223846793005ull + 1442695040888963407ull;
      b->ids[i] = (int32_t)((b->rng >> 33) % b->V);
      b->seq[i] = s;
      b->pos[i] = p;
      b->want[i] = p + 1 == b->P;
    }
  }
}

/* One run: the prefill of the batch, then N greedy decode steps; its figures into r and
 * the per-layer times of its decode steps added to b->lsum. */
static int bench_one(bench_state *b, bench_run *r, mr_err *e) {
  const size_t BP = (size_t)b->B * b->P;
  bench_prompts(b);
  gc_model_stats ms;
  gc_model_stats_get(b->m, &ms, true);
  gc_step s = {.n_tokens = (uint32_t)BP, .ids = b->ids, .seq = b->seq, .pos = b->pos,
               .want_logits = b->want, .logits = b->logits};
  uint64_t t0 = mr_now_ns();
  int rc = gc_model_step(b->m, &s, e);
  if (rc) return rc;
  const double pf_s = (double)(mr_now_ns() - t0) / 1e9;
  gc_model_stats_get(b->m, &ms, true); /* the decode's statistics alone from here */
  gc_cluster *cl = gc_model_cluster(b->m);
  gc_cluster_info ci = {0};
  if (cl) gc_cluster_info_get(cl, &ci);
  gc_server_counters ct;
  for (uint32_t i = 0; i < ci.n_servers; i++) (void)gc_server_counters_get(cl, i, true, &ct, NULL);
  t0 = mr_now_ns();
  for (uint32_t step = 0; step < b->N; step++) {
    for (uint32_t q = 0; q < b->B; q++) {
      b->ids[q] = gc_sample(b->logits + (size_t)q * b->V, b->V, NULL, NULL);
      b->seq[q] = q;
      b->pos[q] = b->P + step;
    }
    s = (gc_step){.n_tokens = b->B, .ids = b->ids, .seq = b->seq, .pos = b->pos, .logits = b->logits};
    const uint64_t t_step = mr_now_ns();
    if ((rc = gc_model_step(b->m, &s, e))) return rc;
    b->step_ms[step] = (double)(mr_now_ns() - t_step) / 1e6;
  }
  const double dc_s = (double)(mr_now_ns() - t0) / 1e9;
  double n_rep = 0, sum_c = 0, sum_s = 0, sum_r = 0;
  for (uint32_t i = 0; i < ci.n_servers; i++) {
    if (gc_server_counters_get(cl, i, false, &ct, NULL) || !ct.replies) continue;
    n_rep += (double)ct.replies;
    sum_c += ct.mean_compute_us * (double)ct.replies;
    sum_s += ct.mean_server_us * (double)ct.replies;
    sum_r += ct.mean_rtt_us * (double)ct.replies;
  }
  if (n_rep > 0) {
    r->srv_compute_us = sum_c / n_rep;
    r->srv_us = sum_s / n_rep;
    r->srv_rtt_us = sum_r / n_rep;
  }
  if (b->N) { /* the typical step, whatever the host did to a few of them */
    r->step_p50_ms = median(b->step_ms, b->N); /* sorts */
    r->step_p90_ms = b->step_ms[(size_t)(0.9 * (b->N - 1) + 0.5)];
  }
  gc_model_stats_get(b->m, &ms, false);
  r->prefill_tok_s = BP / pf_s;
  r->decode_tok_s = (double)b->B * b->N / dc_s;
  r->step_ms = dc_s * 1e3 / b->N;
  for (uint32_t l = 0; l < b->L; l++) {
    const gc_layer_stats *x = &ms.layer[l];
    gc_layer_stats *sum = &b->lsum[l];
    r->rpc_us += x->rpc_us + x->deferred_rpc_us;
    r->wait_us += x->wait_us;
    sum->attn_us += x->attn_us;
    sum->local_us += x->local_us;
    sum->wait_us += x->wait_us;
    sum->rpc_us += x->rpc_us + x->deferred_rpc_us;
    sum->submit_us += x->submit_us;
    sum->deferred_slots += x->deferred_slots;
  }
  /* overlap: the share of the RPC time the client did not wait for (DESIGN section 6) */
  r->overlap = r->rpc_us ? 1.0 - (double)(r->wait_us < r->rpc_us ? r->wait_us : r->rpc_us) / (double)r->rpc_us : 0;
  r->bytes_per_step = (double)(ms.dense_bytes_read + ms.expert_bytes_read) / (double)b->N;
  r->weight_gbs = r->bytes_per_step / (dc_s / b->N) / 1e9;
  return 0;
}

/* Medians over the runs, and a plain read of the same bytes per step on the same threads
 * right after them (the decode's bandwidth ratio is against that, same run). */
static void bench_summarize(bench_state *b) {
  double bps[64], pf[64], dc[64], ov[64], wg[64], p50[64], p90[64], sc[64], ss[64], sr[64];
  const uint32_t R = b->repeats < 64 ? b->repeats : 64;
  for (uint32_t i = 0; i < R; i++) {
    bps[i] = b->runs[i].bytes_per_step;
    pf[i] = b->runs[i].prefill_tok_s;
    dc[i] = b->runs[i].decode_tok_s;
    ov[i] = b->runs[i].overlap;
    wg[i] = b->runs[i].weight_gbs;
    p50[i] = b->runs[i].step_p50_ms;
    p90[i] = b->runs[i].step_p90_ms;
    sc[i] = b->runs[i].srv_compute_us;
    ss[i] = b->runs[i].srv_us;
    sr[i] = b->runs[i].srv_rtt_us;
  }
  b->srv_compute_us = median(sc, R);
  b->srv_us = median(ss, R);
  b->srv_rtt_us = median(sr, R);
  b->step_p50 = median(p50, R);
  b->step_p90 = median(p90, R);
  b->bytes = median(bps, R);
  b->read_gbs = plain_read_gbs(gc_model_engine(b->m), (uint64_t)b->bytes);
  b->weight_gbs = median(wg, R);
  b->ratio = b->read_gbs > 0 ? b->weight_gbs / b->read_gbs : 0;
  b->dtok = median(dc, R);
  b->ptok = median(pf, R);
  b->over = median(ov, R);
}

static void bench_print(const bench_state *b, const gc__mcli *c) {
  const mr_model_config *cfg = gc_model_config(b->m);
  gc_cluster *cl = gc_model_cluster(b->m);
  uint32_t n_servers = 0;
  if (cl) {
    gc_cluster_info ci;
    gc_cluster_info_get(cl, &ci);
    n_servers = ci.n_servers;
  }
  mr_host host;
  mr_host_read(&host, NULL);
  const double d = (double)b->repeats * b->N; /* decode steps the layer sums cover */
  if (c->json) {
    printf("{\"bench\": \"model\", \"model\": \"%s\", \"arch\": \"%s\", \"cpu\": \"%s\", "
           "\"threads\": %u, \"servers\": %u, \"local_experts\": %d, \"max_deferred\": %u, "
           "\"batch\": %u, \"prompt_len\": %u, \"decode\": %u, \"repeats\": %u, "
           "\"prefill_tok_s\": %.2f, \"decode_tok_s\": %.3f, \"step_ms\": %.3f, "
           "\"step_ms_p50\": %.3f, \"step_ms_p90\": %.3f, "
           "\"overlap\": %.3f, \"bytes_per_step\": %.0f, \"weight_gbs\": %.2f, "
           "\"read_gbs\": %.2f, \"decode_bw_ratio\": %.3f, \"server_compute_us\": %.1f, "
           "\"server_us\": %.1f, \"server_rtt_us\": %.1f, \"cpuidle\": \"%s\", "
           "\"guest_halt_poll_ns\": %lld, \"thp\": \"%s\"}\n",
           c->mo.model_dir, cfg->arch_name, host.cpu, c->mo.engine.threads, n_servers, c->mo.local_experts,
           c->mo.max_deferred, b->B, b->P, b->N, b->repeats, b->ptok, b->dtok, 1e3 * b->B / b->dtok,
           b->step_p50, b->step_p90, b->over, b->bytes, b->weight_gbs, b->read_gbs, b->ratio,
           b->srv_compute_us, b->srv_us, b->srv_rtt_us, host.idle_governor,
           (long long)host.halt_poll_ns, host.thp);
    for (uint32_t l = 0; l < b->L; l++)
      printf("{\"bench\": \"model-layer\", \"layer\": %u, \"moe\": %s, \"attn_us\": %.1f, "
             "\"local_us\": %.1f, \"rpc_submit_us\": %.1f, \"rpc_wait_us\": %.1f, "
             "\"rpc_us\": %.1f, \"deferred_slots\": %.2f}\n", l, cfg->is_moe[l] ? "true" : "false",
             b->lsum[l].attn_us / d, b->lsum[l].local_us / d, b->lsum[l].submit_us / d, b->lsum[l].wait_us / d,
             b->lsum[l].rpc_us / d, b->lsum[l].deferred_slots / d);
    return;
  }
  printf("%s: %s, %u servers, cpu %s\n", cfg->arch_name, c->mo.model_dir, n_servers, host.cpu);
  printf("prefill %.1f tok/s (%u x %u tokens), decode %.2f tok/s (batch %u, %.2f ms/step; "
         "steps one by one: p50 %.2f ms, p90 %.2f ms), overlap %.2f, decode_bw_ratio %.2f (%.2f "
         "GB/s of weights vs %.2f GB/s plain read, %.1f MB/step); medians of %u\n", b->ptok, b->B,
         b->P, b->dtok, b->B, 1e3 * b->B / b->dtok, b->step_p50, b->step_p90, b->over, b->ratio,
         b->weight_gbs, b->read_gbs, b->bytes / 1e6, b->repeats);
  if (n_servers)
    printf("decode replies, mean: server compute %.1f us, server arrival to reply %.1f us, submit "
           "to reply %.1f us\n", b->srv_compute_us, b->srv_us, b->srv_rtt_us);
  printf("layer   attn_us  local_us  submit_us  rpc_wait_us  rpc_us  (per decode step)\n");
  for (uint32_t l = 0; l < b->L; l++)
    printf("%5u %9.1f %9.1f %10.1f %12.1f %7.1f%s\n", l, b->lsum[l].attn_us / d, b->lsum[l].local_us / d,
           b->lsum[l].submit_us / d, b->lsum[l].wait_us / d, b->lsum[l].rpc_us / d,
           cfg->is_moe[l] ? "" : "  (dense)");
}

int gc__cli_bench(int argc, char **argv) {
  static const struct option lo[] = {
      MODEL_OPTIONS, {"batch", required_argument, NULL, MO_BATCH},
      {"prompt-len", required_argument, NULL, MO_PLEN},
      {"decode", required_argument, NULL, MO_DECODE},
      {"repeats", required_argument, NULL, MO_REPEATS},
      {"seed", required_argument, NULL, MO_SEED}, {"json", no_argument, NULL, MO_JSON},
      {NULL, 0, NULL, 0}};
  gc__mcli c;
  gc__cli_init(&c);
  c.prompt_len = 32;
  c.decode = 32;
  c.repeats = 3;
  int r = gc__cli_parse(argc, argv, lo, BENCH_USAGE, BENCH_HELP, &c, NULL, NULL);
  if (r) return r == 1 ? 0 : 2;
  bench_state b;
  memset(&b, 0, sizeof b);
  b.B = c.batch;
  b.P = c.prompt_len;
  b.N = c.decode;
  b.repeats = c.repeats;
  b.rng = c.smp.seed ^ 0x9e3779b97f4a7c15ull;
  c.mo.max_batch = b.B;
  if (!c.mo.max_seq) c.mo.max_seq = b.P + b.N;
  int rc = 1;
  mr_err e;
  mr_err_clear(&e);
  if (gc__cli_open_model(&c, &b.m)) goto out;
  b.V = gc_model_config(b.m)->vocab_size;
  b.L = gc_model_config(b.m)->num_layers;
  if ((uint64_t)b.P + b.N > gc_model_max_seq(b.m)) {
    fprintf(stderr, PROG " bench: --prompt-len + --decode = %u, more than --max-seq %u\n", b.P + b.N,
            gc_model_max_seq(b.m));
    goto out;
  }
  if (bench_alloc(&b)) {
    fprintf(stderr, PROG " bench: out of memory\n");
    goto out;
  }
  for (uint32_t rep = 0; rep < b.repeats; rep++) {
    int src = bench_one(&b, &b.runs[rep], &e);
    if (src) {
      fprintf(stderr, PROG ": %s: %s\n", mr_err_name(src), e.msg);
      goto out;
    }
  }
  bench_summarize(&b);
  bench_print(&b, &c);
  rc = 0;
out:
  failover_summary(b.m, c.json);
  if (gc__cli_close_model(&c, b.m) && rc == 0) rc = 1;
  bench_free(&b);
  return rc;
}
