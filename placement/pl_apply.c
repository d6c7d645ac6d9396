/*
 * placement/pl_apply.c - `moerpc-place apply`: changes the placement of a running cluster
 * live (docs/DESIGN.md section 15).
 *
 * Order, chosen so that a routed pair never lacks a copy:
 *   1. read the cluster file and the plan (a placement file); Hello every server (protocol
 *      1.2 or later: the control RPCs); read each --client-placement file;
 *   2. refuse, before anything moves: a server of the plan not in the cluster file, servers
 *      of different models or a plan for another model (fingerprint), a plan of another
 *      shape, a pair of a served layer that is neither local nor on a server, a change of
 *      the client's local (hot) experts, a server without room for what it must load
 *      (HelloReply.load_free_bytes, MemAvailable-based on the server);
 *   3. per server, the pairs to add (planned there, not owned) and to drop (owned, not
 *      planned there) - pl_apply_prepare;
 *   4. LoadExperts on every server with something to add, in parallel (the servers load on
 *      their own threads); LoadStatus is polled, a progress line per server every second;
 *      then a Hello must announce every planned pair;
 *   5. write each --client-placement file atomically (tmp + rename) with the plan's bytes and
 *      wait until each --client's GET /placement reports their hash (FNV-1a 64);
 *   6. UnloadExperts of the pairs to drop; a summary line per server.
 *   7. Every client connected to a server (Stats, protocol 1.4), confirmed (a --client that
 *      switched) or not (it re-Hellos on its first "not served" reply): one line each.
 * Any failure stops there with exit status 1: before 5 nothing is routed differently (extra
 * copies may stay loaded, which is harmless), after 5 nothing is unloaded unless every
 * client confirmed the switch (or, with no --client at all, --unload-without-clients says
 * that no client needs asking; without it the old copies are kept).
 *
 * The steps are the step_* functions below, in this order, over one apply_run; pl_cmd_apply
 * runs them and has the one exit path.
 *
 * Replicas: a pair listed under several servers (mr_placement's rep lists) is loaded on
 * each of them; a pair on no server in a served layer is refused.
 */
#include "placement/internal.h"

#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "gpu_client/rpc/moerpc_client.h"

#define PROG "moerpc-place apply"
#define PL_APPLY_MAX_CLIENTS 32
#define PL_PLAN_MAX_BYTES ((size_t)64 << 20)
#define PL_POLL_MS 200
#define PL_DEFAULT_LOAD_TIMEOUT_S 3600u
#define PL_DEFAULT_SWITCH_TIMEOUT_S 60u

static const char APPLY_HELP[] =
    "usage: moerpc-place apply --cluster FILE PLAN.json\n"
    "                          [--client-placement PATH --client URL]... [options]\n"
    "\n"
    "Applies PLAN.json (a placement file, gpu_client/README.md) to a running cluster without\n"
    "stopping it: the servers load the experts they lack (LoadExperts, progress below), the\n"
    "clients switch their routing (each --client-placement file is rewritten atomically and\n"
    "each --client must report the new file's hash at GET /placement: moerpc-client\n"
    "--placement PATH --watch-placement --metrics-listen), then the old copies are unloaded\n"
    "(UnloadExperts). Bad plans are refused before anything moves. The servers must run with\n"
    "--auth-token-file and the cluster file must name the token (\"token_file\").\n"
    "\n"
    "  --cluster FILE           cluster file (required)\n"
    "  --client-placement PATH  a client's placement file (its --placement); repeatable\n"
    "  --client URL             that client's metrics endpoint, http://HOST:PORT[/placement];\n"
    "                           the i-th --client goes with the i-th --client-placement (at\n"
    "                           most 32)\n"
    "  --load-timeout-s N       give up loading after N s (default 3600)\n"
    "  --switch-timeout-s N     give up waiting for the clients after N s (default 60)\n"
    "  --no-unload              load and switch, keep the old copies\n"
    "  --unload-without-clients without any --client nothing confirms a switch, so the old\n"
    "                           copies are kept; this unloads them anyway (no client uses\n"
    "                           them, or every client was switched by other means)\n"
    "  --dry-run                print what would move, change nothing\n"
    "  --log LEVEL              error|warn|info|debug\n"
    "  --help                   this text\n"
    "\n"
    "After the unload, every client with an open Forward stream on a server (protocol 1.4\n"
    "Stats) is listed: \"confirmed\" when a --client reported its name and the plan's hash,\n"
    "else \"not confirmed; will re-Hello on first miss\" (it routes by its last Hello until a\n"
    "server answers \"not served\", then Hellos again and re-routes; the servers keep the\n"
    "moved copies for it until its stream closes or their --unload-grace ends).\n"
    "\n"
    "Local (hot) experts of a running client cannot change: a plan whose local sets differ\n"
    "from a --client-placement file's is refused. Exit status: 0 applied, 1 failed (the\n"
    "cluster serves the old placement, or the new one with extra copies), 2 usage error.\n";

/* ---- the diff (pure) ------------------------------------------------------------------------ */

void pl_apply_plan_close(pl_apply_plan *ap) {
  mr_free(ap->want);
  mr_free(ap->add);
  mr_free(ap->drop);
  mr_free(ap->n_add);
  mr_free(ap->n_drop);
  memset(ap, 0, sizeof *ap);
}

/* "layer 3: experts 4-7" of the pairs set in bits[l * E ..], for messages. */
static void pairs_str(const uint8_t *row, uint32_t E, char *buf, size_t len) {
  mr_idlist w;
  mr_idlist_init(&w, buf, len);
  for (uint32_t x = 0; x < E; x++)
    if (row[x]) mr_idlist_add(&w, x);
  mr_idlist_end(&w, true);
}

/* Is pair i on at least one server? (Replicated pairs have route -1 and their servers in
 * the rep lists; a placement made by hand without the lists is read by route alone.) */
static bool pair_remote(const mr_placement *p, size_t i) {
  if (p->rep_off) return p->rep_off[i + 1] > p->rep_off[i];
  return p->route[i] >= 0;
}

int pl_apply_prepare(pl_apply_plan *ap, const mr_placement *plan, const mr_cluster_file *cf,
                     const uint8_t *owned, const uint64_t *free_bytes, uint64_t expert_bytes,
                     const char *label, mr_err *e) {
  memset(ap, 0, sizeof *ap);
  const uint32_t S = cf->n_servers, L = plan->num_layers, E = plan->num_experts;
  const size_t LE = (size_t)L * E;
  ap->n_servers = S;
  ap->num_layers = L;
  ap->num_experts = E;
  ap->want = mr_calloc((size_t)S * LE, 1);
  ap->add = mr_calloc((size_t)S * LE, 1);
  ap->drop = mr_calloc((size_t)S * LE, 1);
  ap->n_add = mr_calloc(S, sizeof *ap->n_add);
  ap->n_drop = mr_calloc(S, sizeof *ap->n_drop);
  uint8_t *row = mr_calloc(E, 1);
  int rc = 0;
  if (!ap->want || !ap->add || !ap->drop || !ap->n_add || !ap->n_drop || !row) {
    rc = mr_err_set(e, MR_ENOMEM, "apply: out of memory");
    goto out;
  }
  int32_t map[MR_PLACEMENT_MAX_SERVERS];
  for (uint32_t i = 0; i < plan->n_servers; i++) {
    map[i] = -1;
    for (uint32_t s = 0; s < S; s++)
      if (strcmp(cf->servers[s].name, plan->server[i]) == 0) map[i] = (int32_t)s;
    if (map[i] < 0) {
      rc = mr_err_set(e, MR_ENOTFOUND, "%s: server \"%s\" is not in the cluster file", label,
                      plan->server[i]);
      goto out;
    }
  }
  /* A layer is served if a server owns something in it now or the plan places something
   * there; every pair of a served layer must be local or on a server. */
  for (uint32_t l = 0; l < L; l++) {
    bool served = false;
    for (uint32_t s = 0; s < S && !served; s++)
      for (uint32_t x = 0; x < E && !served; x++) served = owned[s * LE + (size_t)l * E + x];
    for (uint32_t x = 0; x < E && !served; x++)
      served = pair_remote(plan, (size_t)l * E + x) || plan->local[(size_t)l * E + x];
    if (!served) continue;
    bool missing = false;
    for (uint32_t x = 0; x < E; x++) {
      size_t i = (size_t)l * E + x;
      row[x] = !plan->local[i] && !pair_remote(plan, i);
      missing |= row[x];
      if (plan->rep_off) { /* every copy: a replicated pair is loaded on each of its servers */
        for (uint32_t c = plan->rep_off[i]; c < plan->rep_off[i + 1]; c++)
          ap->want[(size_t)map[plan->rep[c]] * LE + i] = 1;
      } else if (plan->route[i] >= 0) {
        ap->want[(size_t)map[plan->route[i]] * LE + i] = 1;
      }
    }
    if (missing) {
      char ids[256];
      pairs_str(row, E, ids, sizeof ids);
      rc = mr_err_set(e, MR_EPRECOND, "%s: layer %" PRIu32 ": experts %s are neither local nor "
                      "on a server (every expert of a served layer needs a place)", label, l, ids);
      goto out;
    }
  }
  for (uint32_t s = 0; s < S; s++) {
    for (size_t i = 0; i < LE; i++) {
      uint8_t w = ap->want[s * LE + i], o = owned[s * LE + i];
      ap->add[s * LE + i] = w && !o;
      ap->drop[s * LE + i] = o && !w;
      ap->n_add[s] += w && !o;
      ap->n_drop[s] += o && !w;
    }
    uint64_t need = ap->n_add[s] * expert_bytes;
    if (free_bytes && need > free_bytes[s]) {
      rc = mr_err_set(e, MR_EEXHAUSTED, "%s: server %s must load %" PRIu64 " experts = %" PRIu64
                      " bytes (%.3f GB), it has room for %" PRIu64 " bytes (%.3f GB): the plan "
                      "exceeds its capacity", label, cf->servers[s].name, ap->n_add[s], need,
                      need / 1e9, free_bytes[s], free_bytes[s] / 1e9);
      goto out;
    }
  }
out:
  mr_free(row);
  if (rc) pl_apply_plan_close(ap);
  return rc;
}

uint64_t pl_placement_hash(const void *b, size_t n) {
  const uint8_t *p = b;
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < n; i++) {
    h ^= p[i];
    h *= 0x100000001b3ull;
  }
  return h;
}

/* ---- the command ---------------------------------------------------------------------------- */

typedef struct apply_args {
  const char *cluster, *plan;
  const char *cl_files[PL_APPLY_MAX_CLIENTS], *cl_urls[PL_APPLY_MAX_CLIENTS];
  uint32_t n_files, n_urls;
  uint32_t load_timeout_s, switch_timeout_s;
  bool no_unload, unload_without_clients, dry_run;
} apply_args;

/* The string field key of the client's GET /placement object, or "" (cJSON; a body that is
 * not an object, or a field that is not a string, reads as ""). */
static void placement_field(const char *body, size_t len, const char *key, char *out,
                            size_t cap) {
  cJSON *o = NULL;
  mr_err pe;
  out[0] = '\0';
  if (mr_json_parse_object(body, len, "GET /placement", &o, &pe) != 0) return;
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
  if (cJSON_IsString(v)) snprintf(out, cap, "%s", v->valuestring);
  cJSON_Delete(o);
}

static int parse_args(int argc, char **argv, apply_args *a) {
  enum { O_CLUSTER = 1000, O_FILE, O_URL, O_LT, O_ST, O_NOUNLOAD, O_UWC, O_DRY, O_LOG, O_HELP };
  static const struct option lo[] = {{"cluster", required_argument, NULL, O_CLUSTER},
                                     {"client-placement", required_argument, NULL, O_FILE},
                                     {"client", required_argument, NULL, O_URL},
                                     {"load-timeout-s", required_argument, NULL, O_LT},
                                     {"switch-timeout-s", required_argument, NULL, O_ST},
                                     {"no-unload", no_argument, NULL, O_NOUNLOAD},
                                     {"unload-without-clients", no_argument, NULL, O_UWC},
                                     {"dry-run", no_argument, NULL, O_DRY},
                                     {"log", required_argument, NULL, O_LOG},
                                     {"help", no_argument, NULL, O_HELP},
                                     {NULL, 0, NULL, 0}};
  memset(a, 0, sizeof *a);
  a->load_timeout_s = PL_DEFAULT_LOAD_TIMEOUT_S;
  a->switch_timeout_s = PL_DEFAULT_SWITCH_TIMEOUT_S;
  optind = 1;
  for (;;) {
    int opt = getopt_long(argc, argv, "", lo, NULL);
    if (opt == -1) break;
    char *end = NULL;
    unsigned long v = 0;
    switch (opt) {
    case O_CLUSTER: a->cluster = optarg; break;
    case O_FILE:
    case O_URL: {
      uint32_t *n = opt == O_FILE ? &a->n_files : &a->n_urls;
      if (*n >= PL_APPLY_MAX_CLIENTS) {
        fprintf(stderr, PROG ": at most %d --client / --client-placement\n", PL_APPLY_MAX_CLIENTS);
        return 2;
      }
      (opt == O_FILE ? a->cl_files : a->cl_urls)[(*n)++] = optarg;
      break;
    }
    case O_LT:
    case O_ST:
      errno = 0;
      v = strtoul(optarg, &end, 10);
      if (errno || !end || *end || v < 1 || v > 86400) {
        fprintf(stderr, PROG ": %s = \"%s\", must be 1..86400\n",
                opt == O_LT ? "--load-timeout-s" : "--switch-timeout-s", optarg);
        return 2;
      }
      if (opt == O_LT) a->load_timeout_s = (uint32_t)v;
      else a->switch_timeout_s = (uint32_t)v;
      break;
    case O_NOUNLOAD: a->no_unload = true; break;
    case O_UWC: a->unload_without_clients = true; break;
    case O_DRY: a->dry_run = true; break;
    case O_LOG:
      if (pl__log_level_set(PROG, optarg)) return 2;
      break;
    case O_HELP: fputs(APPLY_HELP, stdout); return 1;
    default: fprintf(stderr, PROG ": unexpected option (see --help)\n"); return 2;
    }
  }
  if (!a->cluster) {
    fprintf(stderr, PROG ": --cluster FILE is required (see --help)\n");
    return 2;
  }
  if (optind != argc - 1) {
    fprintf(stderr, PROG ": exactly one PLAN.json is required (see --help)\n");
    return 2;
  }
  a->plan = argv[optind];
  if (a->n_files != a->n_urls) {
    fprintf(stderr, PROG ": %u --client-placement but %u --client: give them in pairs\n",
            a->n_files, a->n_urls);
    return 2;
  }
  return 0;
}

/* One run of the command: what every step reads and writes. */
typedef struct apply_run {
  apply_args a;
  mr_cluster_file *cf;
  mr_placement plan;
  char *plan_json;
  size_t plan_len;
  gc_cluster *c;             /* the control handle */
  uint32_t S, L, E;          /* servers, and the plan's layers x experts */
  size_t LE;
  gc_hello_info *hello;      /* [S] each server's Hello at the start */
  uint8_t *owned;            /* [S * LE] what each server owns at the start */
  uint64_t *free_b;          /* [S] bytes each may still load */
  uint64_t *load_id;         /* [S] its load in flight, 0 = none (or done) */
  pl_apply_plan ap;          /* pairs to add and drop per server */
  char cl_names[PL_APPLY_MAX_CLIENTS][GC_CLIENT_NAME_MAX + 1]; /* each --client's client_name
                                                      * at GET /placement ("" = not given) */
  uint64_t tot_add, tot_drop;
  uint64_t t0;
} apply_run;

/* Hello of server s through the typed control call (the RPC library checks the reply as
 * the cluster does), then what apply needs: the control RPCs (protocol 1.2), and, when
 * LE is not 0, the plan's shape. */
static int server_hello(apply_run *r, uint32_t s, size_t LE, gc_hello_info *h, mr_err *e) {
  int rc = gc_control_hello(r->c, s, h, e);
  if (rc) return rc;
  if (h->protocol_minor < 2)
    return mr_err_set(e, MR_ENOTSUP, "server %s speaks protocol %" PRIu32 ".%" PRIu32 ": live apply "
                      "needs 1.2 or later (the control RPCs)", r->cf->servers[s].name,
                      h->protocol_major, h->protocol_minor);
  if (LE && (size_t)h->num_layers * h->num_experts != LE)
    return mr_err_set(e, MR_EMISMATCH, "server %s serves %" PRIu32 " layers x %" PRIu32 " experts, "
                      "the plan is for %zu pairs", r->cf->servers[s].name, h->num_layers,
                      h->num_experts, LE);
  return 0;
}

/* 1: the cluster file, the plan, and the arrays sized by them; the control handle. */
static int step_read(apply_run *r, mr_err *e) {
  int rc;
  r->cf = mr_calloc(1, sizeof *r->cf);
  if (!r->cf) return mr_err_set(e, MR_ENOMEM, "out of memory");
  if ((rc = mr_cluster_load(r->cf, r->a.cluster, e)) ||
      (rc = mr_file_read(r->a.plan, PL_PLAN_MAX_BYTES, &r->plan_json, &r->plan_len, e)) ||
      (rc = mr_placement_parse(&r->plan, r->plan_json, r->plan_len, r->a.plan, e)))
    return rc;
  r->S = r->cf->n_servers;
  r->L = r->plan.num_layers;
  r->E = r->plan.num_experts;
  r->LE = (size_t)r->L * r->E;
  if ((rc = gc_control_open(&r->c, r->cf, e))) return rc;
  r->hello = mr_calloc(r->S, sizeof *r->hello);
  r->owned = mr_calloc((size_t)r->S * r->LE, 1);
  r->free_b = mr_calloc(r->S, sizeof *r->free_b);
  r->load_id = mr_calloc(r->S, sizeof *r->load_id);
  if (!r->hello || !r->owned || !r->free_b || !r->load_id) return mr_err_set(e, MR_ENOMEM, "out of memory");
  return 0;
}

/* 1-2: what every server owns now; every server serves the plan's model. */
static int step_hello(apply_run *r, mr_err *e) {
  for (uint32_t s = 0; s < r->S; s++) {
    gc_hello_info *h = &r->hello[s];
    int rc = server_hello(r, s, r->LE, h, e);
    if (rc) return rc;
    memcpy(r->owned + s * r->LE, h->owned, r->LE);
    r->free_b[s] = h->load_free_bytes;
    if (strcmp(h->model_fingerprint, r->hello[0].model_fingerprint) != 0)
      return mr_err_set(e, MR_EMISMATCH, "servers %s and %s serve different models (fingerprints "
                        "%s and %s)", r->cf->servers[0].name, r->cf->servers[s].name,
                        r->hello[0].model_fingerprint, h->model_fingerprint);
    /* One process under two addresses (protocol 1.3's instance_id) would be loaded and
     * unloaded as two servers: refused before anything moves. */
    for (uint32_t o = 0; o < s && h->instance_id[0]; o++)
      if (strcmp(r->hello[o].instance_id, h->instance_id) == 0)
        return mr_err_set(e, MR_EINVAL, "servers %s (%s) and %s (%s) are one server (both answer "
                          "Hello with instance_id %s): list it once in the cluster file",
                          r->cf->servers[o].name, r->cf->servers[o].address,
                          r->cf->servers[s].name, r->cf->servers[s].address, h->instance_id);
  }
  if (r->plan.model_fingerprint[0] && strcmp(r->plan.model_fingerprint, r->hello[0].model_fingerprint) != 0)
    return mr_err_set(e, MR_EMISMATCH, "%s: model_fingerprint %s, but the servers serve model %s",
                      r->a.plan, r->plan.model_fingerprint, r->hello[0].model_fingerprint);
  return 0;
}

/* 2: each --client-placement file has the plan's shape, and the plan keeps its client's
 * local (hot) experts: a running client cannot change them. */
static int step_client_files(apply_run *r, mr_err *e) {
  for (uint32_t i = 0; i < r->a.n_files; i++) {
    mr_placement cur;
    int rc = mr_placement_load(&cur, r->a.cl_files[i], e);
    if (!rc && (cur.num_layers != r->L || cur.num_experts != r->E))
      rc = mr_err_set(e, MR_EMISMATCH, "%s: %u x %u pairs, the plan has %u x %u", r->a.cl_files[i],
                      cur.num_layers, cur.num_experts, r->L, r->E);
    if (!rc && memcmp(cur.local, r->plan.local, r->LE) != 0) {
      size_t k = 0;
      while (k < r->LE && cur.local[k] == r->plan.local[k]) k++;
      rc = mr_err_set(e, MR_ENOTSUP, "%s: the plan changes the client's local (hot) experts "
                      "(first: layer %zu expert %zu is %s in %s): a running client cannot "
                      "change them; restart it with the new file instead", r->a.plan, k / r->E,
                      k % r->E, r->plan.local[k] ? "local" : "not local", r->a.plan);
    }
    mr_placement_close(&cur);
    if (rc) return rc;
  }
  return 0;
}

/* 3: the pairs to add and to drop per server, one log line each. */
static int step_prepare(apply_run *r, mr_err *e) {
  int rc = pl_apply_prepare(&r->ap, &r->plan, r->cf, r->owned, r->free_b, r->hello[0].expert_bytes,
                            r->a.plan, e);
  if (rc) return rc;
  for (uint32_t s = 0; s < r->S; s++) {
    const uint64_t xb = r->hello[s].expert_bytes;
    r->tot_add += r->ap.n_add[s];
    r->tot_drop += r->ap.n_drop[s];
    mr_log(MR_LOG_INFO, "apply: server %s: load %" PRIu64 " experts (%.3f GB), unload %" PRIu64
           " (%.3f GB); owns %.3f GB now, %.3f GB free for experts", r->cf->servers[s].name,
           r->ap.n_add[s], r->ap.n_add[s] * xb / 1e9, r->ap.n_drop[s], r->ap.n_drop[s] * xb / 1e9,
           r->hello[s].weight_bytes / 1e9, r->free_b[s] / 1e9);
  }
  return 0;
}

/* 4: LoadExperts on every server with something to add, at once. */
static int step_load_start(apply_run *r, mr_err *e) {
  for (uint32_t s = 0; s < r->S; s++) {
    if (!r->ap.n_add[s]) continue;
    gc_load_started ls;
    int rc = gc_control_load(r->c, s, r->ap.add + s * r->LE, r->L, r->E, r->hello[0].model_fingerprint,
                             &ls, e);
    if (rc) return rc;
    r->load_id[s] = ls.load_id;
    mr_log(MR_LOG_INFO, "apply: server %s: load %" PRIu64 " started: %" PRIu64 " experts, %" PRIu64
           " tensors, %.3f GB to read", r->cf->servers[s].name, ls.load_id, ls.pairs, ls.tensors_total,
           ls.bytes_total / 1e9);
  }
  return 0;
}

/* 4: polls LoadStatus until every load is done, printing a progress line per server and
 * second; a failed load or --load-timeout-s stops the command (nothing switched yet). */
static int step_load_wait(apply_run *r, mr_err *e) {
  uint64_t deadline = mr_now_ns() + (uint64_t)r->a.load_timeout_s * 1000000000ull, last_print = 0;
  for (;;) {
    bool all_done = true, print = mr_now_ns() - last_print >= 1000000000ull;
    if (print) last_print = mr_now_ns();
    for (uint32_t s = 0; s < r->S; s++) {
      if (!r->load_id[s]) continue;
      gc_load_progress p;
      int rc = gc_control_load_status(r->c, s, r->load_id[s], &p, e);
      if (rc) return rc;
      if (p.state == GC_LOAD_FAILED)
        return mr_err_set(e, p.error_code, "server %s: load %" PRIu64 " failed: %s (nothing was "
                          "switched or unloaded)", r->cf->servers[s].name, p.load_id, p.error);
      const bool done = p.state == GC_LOAD_DONE;
      const double gbs = p.seconds > 0 ? p.bytes_done / p.seconds / 1e9 : 0;
      if (print || done) {
        double eta = gbs > 0 ? (p.bytes_total - p.bytes_done) / 1e9 / gbs : 0;
        printf("load %-12s %6" PRIu64 "/%" PRIu64 " tensors, %.3f/%.3f GB, %.2f GB/s, %s%.0f s\n",
               r->cf->servers[s].name, p.tensors_done, p.tensors_total, p.bytes_done / 1e9,
               p.bytes_total / 1e9, gbs, done ? "done in " : "ETA ", done ? p.seconds : eta);
        fflush(stdout);
      }
      if (done) r->load_id[s] = 0; /* printed once */
      else all_done = false;
    }
    if (all_done) return 0;
    if (mr_now_ns() > deadline)
      return mr_err_set(e, MR_ETIMEDOUT, "loading did not finish within --load-timeout-s %u "
                        "(nothing was switched or unloaded)", r->a.load_timeout_s);
    usleep(PL_POLL_MS * 1000);
  }
}

/* 4: every new copy must answer Hello before any client is switched. */
static int step_confirm_loaded(apply_run *r, mr_err *e) {
  int rc = 0;
  for (uint32_t s = 0; s < r->S && !rc; s++) {
    gc_hello_info h;
    rc = server_hello(r, s, r->LE, &h, e);
    for (size_t i = 0; !rc && i < r->LE; i++)
      if (r->ap.want[s * r->LE + i] && !h.owned[i])
        rc = mr_err_set(e, MR_EPRECOND, "server %s does not announce layer %zu expert %zu after "
                        "its load (nothing was switched)", r->cf->servers[s].name, i / r->E, i % r->E);
    gc_hello_info_close(&h);
  }
  return rc;
}

/* 5: the plan's bytes into each --client-placement file, then each --client must report
 * the plan's hash on GET /placement within --switch-timeout-s. */
static int step_switch_clients(apply_run *r, mr_err *e) {
  char want_hash[24];
  snprintf(want_hash, sizeof want_hash, "%016" PRIx64, pl_placement_hash(r->plan_json, r->plan_len));
  for (uint32_t i = 0; i < r->a.n_files; i++) {
    int rc = mr_file_write_atomic(r->a.cl_files[i], r->plan_json, r->plan_len, e);
    if (rc) return rc;
    mr_log(MR_LOG_INFO, "apply: wrote %s (hash %s)", r->a.cl_files[i], want_hash);
  }
  const uint64_t deadline = mr_now_ns() + (uint64_t)r->a.switch_timeout_s * 1000000000ull;
  for (uint32_t i = 0; i < r->a.n_urls; i++) {
    const char *url = r->a.cl_urls[i];
    const uint64_t t_sw = mr_now_ns();
    for (;;) {
      int status = 0;
      char *body = NULL;
      size_t blen = 0;
      mr_err ge;
      int grc = mr_http_get(url, "/placement", 1 << 16, 5000, &status, &body, &blen, &ge);
      char h[64] = "", err[600] = "";
      if (grc == 0 && status == 200) {
        placement_field(body, blen, "hash", h, sizeof h);
        placement_field(body, blen, "last_error", err, sizeof err);
        placement_field(body, blen, "client_name", r->cl_names[i], sizeof r->cl_names[i]);
      }
      mr_free(body);
      if (strcmp(h, want_hash) == 0) {
        mr_log(MR_LOG_INFO, "apply: client %s switched (hash %s) after %.2f s", url, want_hash,
               (double)(mr_now_ns() - t_sw) / 1e9);
        break;
      }
      if (mr_now_ns() > deadline)
        return mr_err_set(e, MR_ETIMEDOUT, "client %s did not report placement hash %s within "
                          "--switch-timeout-s %u (it reports \"%s\"%s%s%s%s); nothing was "
                          "unloaded: the cluster holds both copies", url, want_hash,
                          r->a.switch_timeout_s, h, grc ? "; GET failed: " : "", grc ? ge.msg : "",
                          err[0] ? "; its last refusal: " : "", err);
      usleep(PL_POLL_MS * 1000);
    }
  }
  return 0;
}

/* 6: UnloadExperts of the old copies (only once every client confirmed, or when told so),
 * then a summary line per server. */
static int step_unload(apply_run *r, mr_err *e) {
  const apply_args *a = &r->a;
  bool may_unload = !a->no_unload && (a->n_urls > 0 || a->unload_without_clients);
  if (!may_unload && r->tot_drop)
    mr_log(MR_LOG_WARN, "apply: %" PRIu64 " old copies kept (%s)", r->tot_drop,
           a->no_unload ? "--no-unload" : "no --client confirmed a switch; see --unload-without-clients");
  uint64_t *freed = mr_calloc(r->S, sizeof *freed);
  if (!freed) return mr_err_set(e, MR_ENOMEM, "out of memory");
  int rc = 0;
  for (uint32_t s = 0; s < r->S && may_unload && !rc; s++) {
    if (!r->ap.n_drop[s]) continue;
    gc_unload_result u;
    rc = gc_control_unload(r->c, s, r->ap.drop + s * r->LE, r->L, r->E, r->hello[0].model_fingerprint, &u, e);
    if (!rc) freed[s] = u.bytes_freed;
  }
  for (uint32_t s = 0; s < r->S; s++)
    printf("applied %-12s loaded %" PRIu64 " experts (%.3f GB), unloaded %" PRIu64 " (%.3f GB)\n",
           r->cf->servers[s].name, r->ap.n_add[s], r->ap.n_add[s] * r->hello[s].expert_bytes / 1e9,
           freed[s] ? r->ap.n_drop[s] : 0, freed[s] / 1e9);
  mr_free(freed);
  if (!rc) printf("applied %s in %.2f s\n", a->plan, (double)(mr_now_ns() - r->t0) / 1e9);
  return rc;
}

/* One client as the servers report it (Stats, protocol 1.4), merged by name. */
typedef struct seen_client {
  char name[GC_CLIENT_NAME_MAX + 1];
  char servers[256];         /* "s0, s1": the servers it has a Forward stream to */
  uint64_t streams;
  int32_t confirmed;         /* index of the --client that reported it, else -1 */
  char hello[160];           /* its oldest Hello among the servers, vs their generation now */
  uint64_t hello_lag;        /* generations its oldest Hello is behind (0 = up to date) */
} seen_client;

/*
 * 7: every client connected to the servers, not only the --client ones: each server's
 * Stats (protocol 1.4) lists the clients with an open Forward stream. A client is confirmed
 * when a --client URL reported its name at GET /placement with the plan's hash; any other
 * is reported as not confirmed: it routes by the owned sets of its last Hello and re-Hellos
 * on its first "not served" reply (docs/DESIGN.md 3.7). Never fails the apply (it is done):
 * a server that cannot say is named instead.
 */
static void step_report_clients(apply_run *r) {
  seen_client *cl = NULL;
  size_t n = 0, cap = 0;
  for (uint32_t s = 0; s < r->S; s++) {
    const char *sname = r->cf->servers[s].name;
    gc_hello_info h;
    mr_err e;
    uint64_t gen_now = 0;
    if (gc_control_hello(r->c, s, &h, &e) == 0) {
      gen_now = h.owned_generation;
      bool old = h.protocol_minor < 4;
      gc_hello_info_close(&h);
      if (old) {
        printf("clients of %s: not known (protocol 1.%u reports none; 1.4 does): any client it "
               "serves is not confirmed; it re-Hellos on its first miss\n", sname,
               r->hello[s].protocol_minor);
        continue;
      }
    }
    gc_stats st;
    if (gc_control_stats(r->c, s, r->L, r->E, &st, &e) != 0) {
      printf("clients of %s: not known (%s)\n", sname, e.msg);
      continue;
    }
    for (size_t i = 0; i < st.n_clients; i++) {
      const gc_client_info *ci = &st.clients[i];
      size_t k = 0;
      while (k < n && strcmp(cl[k].name, ci->name) != 0) k++;
      if (k == n) {
        if (n == cap) {
          size_t nc = cap ? 2 * cap : 8;
          seen_client *g = mr_realloc(cl, nc * sizeof *g);
          if (!g) break;
          cl = g;
          cap = nc;
        }
        memset(&cl[n], 0, sizeof cl[n]);
        snprintf(cl[n].name, sizeof cl[n].name, "%s", ci->name);
        cl[n].confirmed = -1;
        for (uint32_t u = 0; u < r->a.n_urls; u++)
          if (ci->name[0] && strcmp(r->cl_names[u], ci->name) == 0) cl[n].confirmed = (int32_t)u;
        n++;
      }
      seen_client *c = &cl[k];
      size_t len = strlen(c->servers);
      if (!strstr(c->servers, sname))
        snprintf(c->servers + len, sizeof c->servers - len, "%s%s", len ? ", " : "", sname);
      c->streams += ci->streams;
      uint64_t lag = gen_now > ci->hello_generation ? gen_now - ci->hello_generation : 0;
      if (!c->hello[0] || lag > c->hello_lag) {
        c->hello_lag = lag;
        if (ci->hello_generation)
          snprintf(c->hello, sizeof c->hello, "its last Hello to %s got owned generation %"
                   PRIu64 " (%.1f s ago), %s is at %" PRIu64, sname, ci->hello_generation,
                   ci->hello_age_ms / 1e3, sname, gen_now);
        else
          snprintf(c->hello, sizeof c->hello, "%s saw no Hello of that name", sname);
      }
    }
    gc_stats_close(&st);
  }
  size_t n_conf = 0;
  for (size_t k = 0; k < n; k++) {
    const seen_client *c = &cl[k];
    const char *name = c->name[0] ? c->name : "(unnamed: a client older than protocol 1.4)";
    if (c->confirmed >= 0) {
      n_conf++;
      printf("client \"%s\" (streams to %s): confirmed: %s reports the plan's hash\n", name,
             c->servers, r->a.cl_urls[c->confirmed]);
    } else {
      printf("client \"%s\" (streams to %s): not confirmed; will re-Hello on first miss (%s)\n",
             name, c->servers, c->hello);
    }
  }
  printf("clients: %zu connected, %zu confirmed, %zu not confirmed\n", n, n_conf, n - n_conf);
  if (n > n_conf)
    mr_log(MR_LOG_WARN, "apply: %zu client%s not confirmed: %s route%s by the owned sets of "
           "%s last Hello until a \"not served\" reply makes %s re-Hello", n - n_conf,
           n - n_conf == 1 ? "" : "s", n - n_conf == 1 ? "it" : "they",
           n - n_conf == 1 ? "s" : "", n - n_conf == 1 ? "its" : "their",
           n - n_conf == 1 ? "it" : "them");
  mr_free(cl);
}

static void apply_run_close(apply_run *r) {
  pl_apply_plan_close(&r->ap);
  gc_cluster_close(r->c);
  mr_placement_close(&r->plan);
  mr_free(r->plan_json);
  for (uint32_t s = 0; r->hello && s < r->S; s++) gc_hello_info_close(&r->hello[s]);
  mr_free(r->hello);
  mr_free(r->owned);
  mr_free(r->free_b);
  mr_free(r->load_id);
  mr_free(r->cf);
}

int pl_cmd_apply(int argc, char **argv) {
  apply_run r;
  memset(&r, 0, sizeof r);
  int prc = parse_args(argc, argv, &r.a);
  if (prc == 1) return 0;
  if (prc) return prc;
  mr_err e;
  mr_err_clear(&e);
  r.t0 = mr_now_ns();
  int rc = step_read(&r, &e);
  if (!rc) rc = step_hello(&r, &e);
  if (!rc) rc = step_client_files(&r, &e);
  if (!rc) rc = step_prepare(&r, &e);
  if (!rc && r.a.dry_run) {
    printf("dry run: %" PRIu64 " experts to load, %" PRIu64 " to unload; nothing changed\n", r.tot_add,
           r.tot_drop);
  } else if (!rc) {
    if (!rc) rc = step_load_start(&r, &e);
    if (!rc) rc = step_load_wait(&r, &e);
    if (!rc) rc = step_confirm_loaded(&r, &e);
    if (!rc) rc = step_switch_clients(&r, &e);
    if (!rc) rc = step_unload(&r, &e);
    if (!rc) step_report_clients(&r);
  }
  if (rc) {
    fprintf(stderr, PROG ": %s: %s\n", mr_err_name(rc), e.msg);
    mr_log(MR_LOG_ERROR, "apply failed: %s", e.msg);
  }
  apply_run_close(&r);
  return rc ? 1 : 0;
}
