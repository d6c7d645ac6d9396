/*
 * placement/pl_collect.c - `moerpc-place stats`: collects the routing statistics of a
 * running cluster into one moerpc-stats file (pl.h).
 *
 * Sources: every server of the cluster file (Hello, then the Stats RPC: tokens per
 * (layer, expert) it computed, remote slots only) and every client named by --client URL
 * (its GET /routing: every routing decision it made, local experts included, over its
 * window). Merge rule (docs/DESIGN.md section 13):
 *   - with client sources, counts = the sum of the clients' counts; the servers' counts are
 *     only cross-checked (one log line: remote slots the servers saw vs the clients' total);
 *   - without, counts = the sum of the servers' counts (remote slots only: local experts are
 *     never seen by a server), and "sources" and a log line say so.
 * Every source must serve one model: the servers' fingerprints are checked at open
 * (gc_cluster_open names both servers), a client's fingerprint and shape against theirs.
 *
 * Why two rules and never a sum of both: a slot computed remotely is counted once by the
 * client that routed it and once more by the server that computed it, so adding the two
 * would count every remote slot twice and every local one once. The clients see every slot;
 * the servers only theirs. Two accumulators are kept, and one of them becomes the output:
 *
 *   servers --Stats RPC-->  srv  (remote slots, since each server's last reset)
 *   --client URL ---GET /routing-->  cli  (every slot, the client's window)
 *   --from FILE  ---pl_stats_load-->  cli
 *   output = cli (+ srv's source names) when any client or file was given, else srv
 *
 * Without --cluster the --from files are merged alone (the first sets the shape). Counts of
 * a peer are input, not our bug: a Stats count outside the model's shape is refused as a
 * protocol error naming the server, never an assertion.
 *
 * --reset never loses counts (docs/DESIGN.md section 13). Stats{reset: true} is one
 * read-and-reset per server: each counter is swapped for 0 atomically, so every slot lands in
 * exactly one reply (a read, then a reset by a second call, would lose the slots counted in
 * between). What the replies held exists then only in this process, so:
 *   - everything that can fail without touching a server comes first (the clients' GETs,
 *     the --from files), the servers' Stats last;
 *   - once a server has been reset, a failure that keeps the output from being written (a
 *     later server's Stats, the output file on a full disk, a closed stdout) writes what
 *     was collected to a recovery file (the output that could not be written, or the
 *     counts of the servers reset so far), named in the error, in the moerpc-stats format:
 *     `--from` merges it again. If even that cannot be written, the JSON goes to stderr.
 * A reply lost on the wire after its server reset (a timeout at the deadline) is the one
 * loss left; the error names the server.
 */
#include "placement/internal.h"

#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "gpu_client/rpc/moerpc_client.h"

#define PROG "moerpc-place stats"
#define MAX_CLIENTS 32
/* Bound of one client's /routing answer: the largest stats file (2^22 pairs of up to 16
 * digits and a comma) with room for its head. */
#define ROUTING_MAX_BODY ((size_t)80 << 20)
#define DEFAULT_HTTP_TIMEOUT_MS 5000

static const char STATS_HELP[] =
    "usage: moerpc-place stats --cluster FILE [--client URL]... [--from FILE]... [--reset]\n"
    "                          [-o FILE]\n"
    "       moerpc-place stats --from FILE... [-o FILE]          (merge files only)\n"
    "\n"
    "Collects routing statistics of a running cluster into one moerpc-stats JSON file\n"
    "(placement/README.md): tokens routed to each (layer, expert), one per token per\n"
    "selected expert, num_layers rows of num_experts counts.\n"
    "\n"
    "Hellos every server of the cluster file (they must serve one model: equal fingerprints),\n"
    "calls Stats on each, and fetches GET /routing of each --client (moerpc-client\n"
    "--metrics-listen). Merge rule: with --client sources the counts are the sum of the\n"
    "clients' (they see every slot, local experts included; the servers' counts are only\n"
    "cross-checked in a log line); without, the sum of the servers' (remote slots only:\n"
    "the client's local experts are not counted; \"sources\" lists the servers).\n"
    "--from files (moerpc-client --routing-stats, placement/sglang_dump.py imports, earlier\n"
    "outputs) count like clients: they are added to the clients' counts; their shape must\n"
    "match the servers' and their fingerprint too (\"\" = unknown matches any).\n"
    "\n"
    "  --cluster FILE           cluster file (required unless --from is given)\n"
    "  --client URL             a client's metrics endpoint, http://HOST:PORT[/routing];\n"
    "                           repeatable, at most 32\n"
    "  --from FILE              a moerpc-stats file to add; repeatable, at most 32\n"
    "  --reset                  ask each server to zero its counters as it answers (one\n"
    "                           read-and-reset); if the output then cannot be written, the\n"
    "                           stats go to a recovery file in $TMPDIR (else /tmp) that the\n"
    "                           error names: merge it again with --from\n"
    "  -o, --output FILE        write the stats there (atomically); default stdout\n"
    "  --timeout-ms N           deadline of each server RPC and client GET, 1..600000\n"
    "                           (default: the cluster file's deadline; 5000 for GETs)\n"
    "  --log LEVEL              error|warn|info|debug (default: $MOERPC_LOG, else info)\n"
    "  --help                   this text\n";

enum { OPT_CLUSTER = 1000, OPT_CLIENT, OPT_FROM, OPT_RESET, OPT_TIMEOUT, OPT_LOG, OPT_HELP };

typedef struct stats_args {
  const char *cluster, *output;
  const char *clients[MAX_CLIENTS];
  uint32_t n_clients;
  const char *files[MAX_CLIENTS];
  uint32_t n_files;
  bool reset;
  uint32_t timeout_ms;
} stats_args;

/* 0 to run, 1 after --help, 2 on a usage error. */
static int parse(int argc, char **argv, stats_args *a) {
  static const struct option lo[] = {{"cluster", required_argument, NULL, OPT_CLUSTER},
                                     {"client", required_argument, NULL, OPT_CLIENT},
                                     {"from", required_argument, NULL, OPT_FROM},
                                     {"reset", no_argument, NULL, OPT_RESET},
                                     {"output", required_argument, NULL, 'o'},
                                     {"timeout-ms", required_argument, NULL, OPT_TIMEOUT},
                                     {"log", required_argument, NULL, OPT_LOG},
                                     {"help", no_argument, NULL, OPT_HELP},
                                     {0, 0, 0, 0}};
  optind = 1;
  opterr = 0;
  for (;;) {
    int opt = getopt_long(argc, argv, "o:", lo, NULL);
    if (opt == -1) break;
    char *end = NULL;
    unsigned long v;
    switch (opt) {
    case OPT_HELP: fputs(STATS_HELP, stdout); return 1;
    case OPT_CLUSTER: a->cluster = optarg; break;
    case 'o': a->output = optarg; break;
    case OPT_RESET: a->reset = true; break;
    case OPT_CLIENT:
    case OPT_FROM: { /* two bounded lists of sources, filled alike */
      const bool cl = opt == OPT_CLIENT;
      uint32_t *n = cl ? &a->n_clients : &a->n_files;
      if (*n >= MAX_CLIENTS) {
        fprintf(stderr, PROG ": more than %d %s\n", MAX_CLIENTS,
                cl ? "--client URLs" : "--from files");
        return 2;
      }
      (cl ? a->clients : a->files)[(*n)++] = optarg;
      break;
    }
    case OPT_TIMEOUT:
      v = strtoul(optarg, &end, 10);
      if (!*optarg || *end || optarg[0] == '-' || v < 1 || v > 600000) {
        fprintf(stderr, PROG ": --timeout-ms = \"%s\", must be an integer in 1..600000\n", optarg);
        return 2;
      }
      a->timeout_ms = (uint32_t)v;
      break;
    case OPT_LOG:
      if (pl__log_level_set(PROG, optarg)) return 2;
      break;
    default:
      fprintf(stderr, PROG ": bad or incomplete option \"%s\" (see --help)\n", argv[optind - 1]);
      return 2;
    }
  }
  if (optind < argc) {
    fprintf(stderr, PROG ": unexpected argument \"%s\" (see --help)\n", argv[optind]);
    return 2;
  }
  if (!a->cluster && !a->n_files) {
    fprintf(stderr, PROG ": --cluster FILE (or --from FILE) is required (see --help)\n");
    return 2;
  }
  if (!a->cluster && (a->n_clients || a->reset)) {
    fprintf(stderr, PROG ": --client and --reset need --cluster (see --help)\n");
    return 2;
  }
  return 0;
}

/* Opens the cluster for Hello and Stats only. Local experts are not loaded; a cluster whose
 * coverage needs them (a model with a "local" section) is opened again with them. */
static int open_cluster(const stats_args *a, gc_cluster **c, mr_err *e) {
  gc_options o;
  gc_options_init(&o);
  o.client_name = "moerpc-place";
  o.no_local = true;
  o.deadline_ms = a->timeout_ms;
  int rc = gc_cluster_open(c, a->cluster, &o, e);
  if (rc == MR_EPRECOND) {
    mr_log(MR_LOG_INFO, "stats: %s; opening again with the file's local experts", e->msg);
    o.no_local = false;
    rc = gc_cluster_open(c, a->cluster, &o, e);
  }
  return rc;
}

/* The servers' counts summed into srv (already L x E): each server reports only the pairs it
 * computed since its last reset (sparse, as (layer, expert, tokens) triples), and a
 * replicated pair's slots are split among its servers, so the sum is the cluster's remote
 * traffic. With reset, each server zeroes its counters as it answers; *n_reset counts the
 * servers that did (their counts are then in srv and nowhere else). */
static int collect_servers(gc_cluster *c, const gc_cluster_info *ci, bool reset, pl_stats *srv,
                           uint32_t *n_reset, mr_err *e) {
  for (uint32_t i = 0; i < ci->n_servers; i++) {
    gc_server_info si;
    gc_stats st;
    int rc = gc_server_info_get(c, i, &si, e);
    if (rc) return rc;
    if (si.alias_of >= 0) { /* one process under a second address: its counts once */
      mr_log(MR_LOG_INFO, "stats: server %s (%s) is the same server as entry %d (instance %s): "
             "not asked twice", si.name, si.address, si.alias_of, si.instance_id);
      continue;
    }
    rc = gc_cluster_stats(c, i, reset, &st, e);
    if (rc) {
      gc_stats_close(&st);
      return rc;
    }
    if (reset) (*n_reset)++;
    uint64_t total = 0;
    for (size_t k = 0; k < st.n_counts; k++) {
      const gc_expert_count *x = &st.counts[k];
      if (x->layer >= srv->num_layers || x->expert >= srv->num_experts) {
        rc = mr_err_set(e, MR_EPROTO, "server %s (%s): Stats count for layer %u expert %u, "
                        "beyond the model's %u x %u", si.name, si.address, x->layer, x->expert,
                        srv->num_layers, srv->num_experts);
        break;
      }
      srv->counts[(size_t)x->layer * srv->num_experts + x->expert] += x->tokens;
      total += x->tokens;
    }
    if (!rc) rc = pl_stats_source_add(srv, si.name, e);
    if (!rc)
      mr_log(MR_LOG_INFO, "stats: server %s (%s): %llu requests, %llu slots over %zu pairs%s",
             si.name, si.address, (unsigned long long)st.requests, (unsigned long long)total,
             st.n_counts, reset ? " (now reset)" : "");
    gc_stats_close(&st);
    if (rc) return rc;
  }
  return 0;
}

/* Adds one parsed source to acc, which takes its window kind (several differing kinds give
 * "since_reset"), after checking its shape and fingerprint against the servers' (ci) or,
 * without a cluster, acc's. name: the source to list, NULL = the file's own sources.
 * A source whose fingerprint is "" (an import) matches any model; when the reference is ""
 * (files only, the first one unknown) the first known fingerprint becomes acc's. */
static int add_source(pl_stats *acc, pl_stats *one, const char *label, const char *name,
                      const gc_cluster_info *ci, mr_err *e) {
  const uint32_t L = ci ? ci->num_layers : acc->num_layers, E = ci ? ci->num_experts : acc->num_experts;
  const char *fp = ci ? ci->model_fingerprint : acc->model_fingerprint;
  const char *whose = ci ? "the servers serve" : "the first --from file has";
  if (one->num_layers != L || one->num_experts != E)
    return mr_err_set(e, MR_EMISMATCH, "%s: %u x %u counts, but %s %u layers x %u experts", label,
                      one->num_layers, one->num_experts, whose, L, E);
  if (one->model_fingerprint[0] && fp[0] && strcmp(one->model_fingerprint, fp) != 0)
    return mr_err_set(e, MR_EMISMATCH, "%s has model_fingerprint %s but %s %s (not the same "
                      "model)", label, one->model_fingerprint, whose, fp);
  if (!fp[0] && one->model_fingerprint[0])
    snprintf(acc->model_fingerprint, sizeof acc->model_fingerprint, "%s", one->model_fingerprint);
  mr_log(MR_LOG_INFO, "stats: %s: %llu slots over %llu steps (%llu tokens), window %s", label,
         (unsigned long long)pl_stats_total(one), (unsigned long long)one->steps,
         (unsigned long long)one->tokens, one->window_kind);
  if (acc->n_sources == 0) snprintf(acc->window_kind, sizeof acc->window_kind, "%s", one->window_kind);
  else if (strcmp(acc->window_kind, one->window_kind) != 0)
    snprintf(acc->window_kind, sizeof acc->window_kind, "since_reset");
  if (name) one->n_sources = 0;
  int rc = pl_stats_add(acc, one, e);
  if (!rc && name) rc = pl_stats_source_add(acc, name, e);
  if (!rc && !name && one->n_sources == 0) rc = pl_stats_source_add(acc, "file", e);
  return rc;
}

/* Fetches one client's /routing and adds it to acc (which takes its window). */
static int collect_client(const char *url, uint32_t timeout_ms, const gc_cluster_info *ci,
                          pl_stats *acc, mr_err *e) {
  int status = 0;
  char *body = NULL;
  size_t len = 0;
  int rc = mr_http_get(url, "/routing", ROUTING_MAX_BODY,
                       (int)(timeout_ms ? timeout_ms : DEFAULT_HTTP_TIMEOUT_MS), &status, &body,
                       &len, e);
  if (rc) return mr_err_prefix(e, rc, "--client");
  if (status != 200) {
    rc = mr_err_set(e, MR_EPROTO, "--client %s: GET answered HTTP %d (is it a moerpc-client "
                    "with --metrics-listen?)", url, status);
    mr_free(body);
    return rc;
  }
  char label[300];
  snprintf(label, sizeof label, "--client %.200s", url);
  pl_stats one;
  rc = pl_stats_parse(&one, body, len, label, e);
  mr_free(body);
  if (rc) return rc;
  rc = add_source(acc, &one, label, "client", ci, e);
  pl_stats_close(&one);
  return rc;
}

/* Reads one --from file and adds it to acc (shape and fingerprint checked against the
 * servers' when ci is known, else against acc's). */
static int collect_file(const char *path, const gc_cluster_info *ci, pl_stats *acc, mr_err *e) {
  pl_stats one;
  int rc = pl_stats_load(&one, path, e);
  if (rc) return rc;
  char label[300];
  snprintf(label, sizeof label, "--from %.200s", path);
  if (!acc->counts) { /* the first file, without a cluster: it sets the shape */
    rc = pl_stats_init(acc, one.num_layers, one.num_experts, e);
    if (!rc) snprintf(acc->model_fingerprint, sizeof acc->model_fingerprint, "%s", one.model_fingerprint);
  }
  if (!rc) rc = add_source(acc, &one, label, NULL, ci, e);
  pl_stats_close(&one);
  return rc;
}

/* Writes the result to path ("-" or NULL: stdout). */
static int write_out(const pl_stats *out, const char *path, mr_err *e) {
  if (path && strcmp(path, "-") != 0) {
    int rc = pl_stats_save(out, path, e);
    if (rc) return rc;
    mr_log(MR_LOG_INFO, "stats: wrote %s (%u x %u, %llu slots)", path, out->num_layers,
           out->num_experts, (unsigned long long)pl_stats_total(out));
    return 0;
  }
  char *text = NULL;
  size_t len = 0;
  int rc = pl_stats_format(out, &text, &len, e);
  if (rc) return rc;
  bool ok = fwrite(text, 1, len, stdout) == len && fflush(stdout) == 0;
  mr_free(text);
  return ok ? 0 : mr_err_set(e, MR_EIO, "stdout: write failed");
}

/* The cluster's sources merged into *out (srv or cli, per the merge rule above). The servers
 * are asked even when clients give the counts: their Stats are the cross-check in the log
 * line, and --reset must reach them. They are asked last (see the top): *n_reset gets the
 * servers whose counters were reset. */
static int collect_cluster(const stats_args *a, pl_stats *srv, pl_stats *cli, pl_stats **out,
                           uint32_t *n_reset, mr_err *e) {
  gc_cluster *c = NULL;
  int rc = open_cluster(a, &c, e);
  if (rc) return rc;
  gc_cluster_info ci;
  gc_cluster_info_get(c, &ci);
  if (!(rc = pl_stats_init(srv, ci.num_layers, ci.num_experts, e)))
    rc = pl_stats_init(cli, ci.num_layers, ci.num_experts, e);
  if (!rc) {
    snprintf(srv->model_fingerprint, sizeof srv->model_fingerprint, "%s", ci.model_fingerprint);
    snprintf(cli->model_fingerprint, sizeof cli->model_fingerprint, "%s", ci.model_fingerprint);
  }
  for (uint32_t i = 0; i < a->n_clients && !rc; i++)
    rc = collect_client(a->clients[i], a->timeout_ms, &ci, cli, e);
  for (uint32_t i = 0; i < a->n_files && !rc; i++) rc = collect_file(a->files[i], &ci, cli, e);
  if (!rc) rc = collect_servers(c, &ci, a->reset, srv, n_reset, e); /* last: it may reset */
  gc_cluster_close(c);
  if (rc) {
    snprintf(srv->window_kind, sizeof srv->window_kind, "since_reset");
    return rc;
  }

  uint64_t srv_total = pl_stats_total(srv);
  if (a->n_clients || a->n_files) {
    mr_log(MR_LOG_INFO, "stats: counts from %u client%s and %u file%s: %llu slots (local experts "
           "included); the servers saw %llu remote slots since their last reset (cross-check "
           "only)", a->n_clients, a->n_clients == 1 ? "" : "s", a->n_files,
           a->n_files == 1 ? "" : "s", (unsigned long long)pl_stats_total(cli),
           (unsigned long long)srv_total);
    for (uint32_t i = 0; i < srv->n_sources && !rc; i++)
      rc = pl_stats_source_add(cli, srv->sources[i], e);
    *out = cli;
  } else {
    mr_log(MR_LOG_INFO, "stats: no --client: counts are the servers' (%llu remote slots; "
           "experts the client computes locally are not counted)", (unsigned long long)srv_total);
    snprintf(srv->window_kind, sizeof srv->window_kind, "since_reset");
    *out = srv;
  }
  return rc;
}

/* Saves what a failed run collected after resetting servers (see the top): to
 * $TMPDIR (else /tmp)/moerpc-stats-recovery-<UTC time>-<pid>.json, whose path goes into
 * path; if that fails too, path gets "" and the caller prints the JSON to stderr. */
static void recovery_save(const pl_stats *st, char *path, size_t len) {
  const char *dir = getenv("TMPDIR");
  if (!dir || !dir[0]) dir = "/tmp";
  char stamp[32];
  time_t now = time(NULL);
  struct tm tm;
  gmtime_r(&now, &tm);
  strftime(stamp, sizeof stamp, "%Y%m%dT%H%M%SZ", &tm);
  snprintf(path, len, "%s/moerpc-stats-recovery-%s-%ld.json", dir, stamp, (long)getpid());
  mr_err e;
  mr_err_clear(&e);
  if (pl_stats_save(st, path, &e) != 0) {
    mr_log(MR_LOG_ERROR, "stats: cannot write the recovery file either: %s", e.msg);
    path[0] = '\0';
  }
}

/* The error line, and with a reset behind it, where the collected counts went. */
static void report_failure(int rc, const mr_err *e, uint32_t n_reset, const pl_stats *saved) {
  if (!n_reset || !saved || !saved->counts) {
    fprintf(stderr, PROG ": %s: %s\n", mr_err_name(rc), e->msg);
    return;
  }
  char path[4200];
  recovery_save(saved, path, sizeof path);
  if (path[0]) {
    fprintf(stderr, PROG ": %s: %s; %u server%s reset %s counters (--reset): the statistics "
            "collected (%llu slots) are saved in %s (merge them again: moerpc-place stats "
            "--from %s -o FILE)\n", mr_err_name(rc), e->msg, n_reset, n_reset == 1 ? "" : "s",
            n_reset == 1 ? "its" : "their", (unsigned long long)pl_stats_total(saved), path, path);
    return;
  }
  fprintf(stderr, PROG ": %s: %s; %u server%s reset %s counters (--reset) and no recovery file "
          "could be written: the statistics collected follow on stderr, between the lines "
          "BEGIN and END moerpc-stats\n", mr_err_name(rc), e->msg, n_reset,
          n_reset == 1 ? "" : "s", n_reset == 1 ? "its" : "their");
  char *text = NULL;
  size_t len = 0;
  mr_err fe;
  if (pl_stats_format(saved, &text, &len, &fe) == 0) {
    fputs("BEGIN moerpc-stats\n", stderr);
    fwrite(text, 1, len, stderr);
    fputs("END moerpc-stats\n", stderr);
  }
  mr_free(text);
}

int pl_cmd_stats(int argc, char **argv) {
  stats_args a = {0};
  int pr = parse(argc, argv, &a);
  if (pr) return pr == 1 ? 0 : 2;
  mr_err e;
  mr_err_clear(&e);
  pl_stats srv = {0}, cli = {0}, *out = &cli;
  uint32_t n_reset = 0;
  int rc = 0;
  if (a.cluster) {
    rc = collect_cluster(&a, &srv, &cli, &out, &n_reset, &e);
    if (rc) out = &srv; /* a failure after a reset: the servers' counts so far are what is lost */
  } else { /* files only */
    for (uint32_t i = 0; i < a.n_files && !rc; i++) rc = collect_file(a.files[i], NULL, &cli, &e);
    if (!rc)
      mr_log(MR_LOG_INFO, "stats: %u file%s merged: %llu slots", a.n_files,
             a.n_files == 1 ? "" : "s", (unsigned long long)pl_stats_total(&cli));
  }
  if (!rc) rc = write_out(out, a.output, &e);
  if (rc) report_failure(rc, &e, n_reset, out);
  pl_stats_close(&srv);
  pl_stats_close(&cli);
  return rc ? 1 : 0;
}
