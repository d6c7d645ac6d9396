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
 * Any failure stops there with exit status 1: before 5 nothing is routed differently (extra
 * copies may stay loaded, which is harmless), after 5 nothing is unloaded unless every
 * client confirmed the switch.
 *
 * Replicas: a pair listed under several servers (mr_placement's rep lists) is loaded on
 * each of them; a pair on no server in a served layer is refused.
 */
#include "placement/pl.h"

#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "gpu_client/moerpc_client.h"
#include "proto/pr.h"

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

/* What one server said in its Hello. */
typedef struct srv_state {
  char fingerprint[64];
  uint32_t L, E, minor;
  uint64_t gen, weight_bytes, expert_bytes, free_bytes;
} srv_state;

static int hello(gc_cluster *c, const mr_cluster_file *cf, uint32_t s, uint8_t *owned,
                 size_t LE_cap, srv_state *st, mr_err *e) {
  Moerpc__V1__HelloRequest hq = MOERPC__V1__HELLO_REQUEST__INIT;
  hq.protocol_major = PR_PROTOCOL_MAJOR;
  hq.protocol_minor = PR_PROTOCOL_MINOR;
  hq.client_name = (char *)"moerpc-place apply";
  uint8_t req[128];
  size_t n = moerpc__v1__hello_request__pack(&hq, req);
  uint8_t *resp = NULL;
  size_t rlen = 0;
  int rc = gc_control_call(c, s, PR_METHOD_HELLO, req, n, 0, &resp, &rlen, e);
  if (rc) return rc;
  Moerpc__V1__HelloReply *h = moerpc__v1__hello_reply__unpack(NULL, rlen, resp);
  mr_free(resp);
  if (!h) return mr_err_set(e, MR_EPROTO, "server %s: HelloReply does not decode", cf->servers[s].name);
  memset(st, 0, sizeof *st);
  snprintf(st->fingerprint, sizeof st->fingerprint, "%s", h->model_fingerprint ? h->model_fingerprint : "");
  st->L = h->num_layers;
  st->E = h->num_experts;
  st->minor = h->protocol_minor;
  st->gen = h->owned_generation;
  st->weight_bytes = h->weight_bytes;
  st->expert_bytes = h->expert_bytes;
  st->free_bytes = h->load_free_bytes;
  if (h->protocol_major != PR_PROTOCOL_MAJOR || h->protocol_minor < 2) {
    rc = mr_err_set(e, MR_ENOTSUP, "server %s speaks protocol %" PRIu32 ".%" PRIu32 ": live apply "
                    "needs 1.2 or later (the control RPCs)", cf->servers[s].name,
                    h->protocol_major, h->protocol_minor);
  } else if ((size_t)st->L * st->E != LE_cap && LE_cap) {
    rc = mr_err_set(e, MR_EMISMATCH, "server %s serves %" PRIu32 " layers x %" PRIu32 " experts, "
                    "the plan is for %zu pairs", cf->servers[s].name, st->L, st->E, LE_cap);
  } else if (owned) {
    memset(owned, 0, LE_cap);
    for (size_t i = 0; i < h->n_owned && !rc; i++) {
      const Moerpc__V1__LayerExperts *it = h->owned[i];
      for (size_t k = 0; k < it->n_experts && !rc; k++) {
        if (it->layer >= st->L || it->experts[k] >= st->E)
          rc = mr_err_set(e, MR_EPROTO, "server %s: Hello owned pair (%" PRIu32 ", %" PRIu32
                          ") out of range", cf->servers[s].name, it->layer, it->experts[k]);
        else
          owned[(size_t)it->layer * st->E + it->experts[k]] = 1;
      }
    }
  }
  moerpc__v1__hello_reply__free_unpacked(h, NULL);
  return rc;
}

/* Packs LayerExperts items of the pairs set in bits (L x E) into a Load/UnloadRequest. */
static int pack_pairs(const uint8_t *bits, uint32_t L, uint32_t E, const char *fingerprint,
                      bool load, uint8_t **out, size_t *len, mr_err *e) {
  Moerpc__V1__LayerExperts *items = mr_calloc(L, sizeof *items);
  Moerpc__V1__LayerExperts **ptrs = mr_calloc(L, sizeof *ptrs);
  uint32_t *ids = mr_calloc((size_t)L * E, sizeof *ids);
  int rc = 0;
  if (!items || !ptrs || !ids) {
    rc = mr_err_set(e, MR_ENOMEM, "apply: out of memory");
    goto out;
  }
  size_t k = 0, off = 0;
  for (uint32_t l = 0; l < L; l++) {
    Moerpc__V1__LayerExperts init = MOERPC__V1__LAYER_EXPERTS__INIT;
    items[k] = init;
    items[k].layer = l;
    items[k].experts = ids + off;
    for (uint32_t x = 0; x < E; x++)
      if (bits[(size_t)l * E + x]) ids[off + items[k].n_experts++] = x;
    if (!items[k].n_experts) continue;
    off += items[k].n_experts;
    ptrs[k] = &items[k];
    k++;
  }
  ProtobufCMessage *msg;
  Moerpc__V1__LoadRequest lr = MOERPC__V1__LOAD_REQUEST__INIT;
  Moerpc__V1__UnloadRequest ur = MOERPC__V1__UNLOAD_REQUEST__INIT;
  if (load) {
    lr.n_add = k;
    lr.add = ptrs;
    lr.model_fingerprint = (char *)fingerprint;
    msg = &lr.base;
  } else {
    ur.n_drop = k;
    ur.drop = ptrs;
    ur.model_fingerprint = (char *)fingerprint;
    msg = &ur.base;
  }
  *len = protobuf_c_message_get_packed_size(msg);
  *out = mr_malloc(*len ? *len : 1);
  if (!*out) rc = mr_err_set(e, MR_ENOMEM, "apply: out of memory");
  else protobuf_c_message_pack(msg, *out);
out:
  mr_free(items);
  mr_free(ptrs);
  mr_free(ids);
  return rc;
}

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
    int lvl;
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
      if (mr_log_parse_level(optarg, &lvl) != 0) {
        fprintf(stderr, PROG ": --log = \"%s\", must be error, warn, info or debug\n", optarg);
        return 2;
      }
      mr_log_set_level(lvl);
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

int pl_cmd_apply(int argc, char **argv) {
  apply_args a;
  int prc = parse_args(argc, argv, &a);
  if (prc == 1) return 0;
  if (prc) return prc;
  mr_err e;
  mr_err_clear(&e);
  int rc = 0;
  mr_cluster_file *cf = mr_calloc(1, sizeof *cf);
  mr_placement plan;
  memset(&plan, 0, sizeof plan);
  char *plan_json = NULL;
  size_t plan_len = 0;
  gc_cluster *c = NULL;
  uint8_t *owned = NULL;
  srv_state *st = NULL;
  uint64_t *free_b = NULL, *load_id = NULL;
  pl_apply_plan ap;
  memset(&ap, 0, sizeof ap);
  const uint64_t t0 = mr_now_ns();
  if (!cf) {
    rc = mr_err_set(&e, MR_ENOMEM, "out of memory");
    goto out;
  }
  if ((rc = mr_cluster_load(cf, a.cluster, &e))) goto out;
  if ((rc = mr_file_read(a.plan, PL_PLAN_MAX_BYTES, &plan_json, &plan_len, &e))) goto out;
  if ((rc = mr_placement_parse(&plan, plan_json, plan_len, a.plan, &e))) goto out;
  const uint32_t S = cf->n_servers, L = plan.num_layers, E = plan.num_experts;
  const size_t LE = (size_t)L * E;
  if ((rc = gc_control_open(&c, cf, &e))) goto out;
  owned = mr_calloc((size_t)S * LE, 1);
  st = mr_calloc(S, sizeof *st);
  free_b = mr_calloc(S, sizeof *free_b);
  load_id = mr_calloc(S, sizeof *load_id);
  if (!owned || !st || !free_b || !load_id) {
    rc = mr_err_set(&e, MR_ENOMEM, "out of memory");
    goto out;
  }
  /* 1-2: what every server owns now, and the refusals. */
  for (uint32_t s = 0; s < S; s++) {
    if ((rc = hello(c, cf, s, owned + s * LE, LE, &st[s], &e))) goto out;
    free_b[s] = st[s].free_bytes;
    if (strcmp(st[s].fingerprint, st[0].fingerprint) != 0) {
      rc = mr_err_set(&e, MR_EMISMATCH, "servers %s and %s serve different models (fingerprints "
                      "%s and %s)", cf->servers[0].name, cf->servers[s].name, st[0].fingerprint,
                      st[s].fingerprint);
      goto out;
    }
  }
  if (plan.model_fingerprint[0] && strcmp(plan.model_fingerprint, st[0].fingerprint) != 0) {
    rc = mr_err_set(&e, MR_EMISMATCH, "%s: model_fingerprint %s, but the servers serve model %s",
                    a.plan, plan.model_fingerprint, st[0].fingerprint);
    goto out;
  }
  for (uint32_t i = 0; i < a.n_files; i++) {
    mr_placement cur;
    rc = mr_placement_load(&cur, a.cl_files[i], &e);
    if (!rc && (cur.num_layers != L || cur.num_experts != E))
      rc = mr_err_set(&e, MR_EMISMATCH, "%s: %u x %u pairs, the plan has %u x %u", a.cl_files[i],
                      cur.num_layers, cur.num_experts, L, E);
    if (!rc && memcmp(cur.local, plan.local, LE) != 0) {
      size_t k = 0;
      while (k < LE && cur.local[k] == plan.local[k]) k++;
      rc = mr_err_set(&e, MR_ENOTSUP, "%s: the plan changes the client's local (hot) experts "
                      "(first: layer %zu expert %zu is %s in %s): a running client cannot "
                      "change them; restart it with the new file instead", a.plan, k / E, k % E,
                      plan.local[k] ? "local" : "not local", a.plan);
    }
    mr_placement_close(&cur);
    if (rc) goto out;
  }
  if ((rc = pl_apply_prepare(&ap, &plan, cf, owned, free_b, st[0].expert_bytes, a.plan, &e)))
    goto out;
  uint64_t tot_add = 0, tot_drop = 0;
  for (uint32_t s = 0; s < S; s++) {
    tot_add += ap.n_add[s];
    tot_drop += ap.n_drop[s];
    mr_log(MR_LOG_INFO, "apply: server %s: load %" PRIu64 " experts (%.3f GB), unload %" PRIu64
           " (%.3f GB); owns %.3f GB now, %.3f GB free for experts", cf->servers[s].name,
           ap.n_add[s], ap.n_add[s] * st[s].expert_bytes / 1e9, ap.n_drop[s],
           ap.n_drop[s] * st[s].expert_bytes / 1e9, st[s].weight_bytes / 1e9, free_b[s] / 1e9);
  }
  if (a.dry_run) {
    printf("dry run: %" PRIu64 " experts to load, %" PRIu64 " to unload; nothing changed\n",
           tot_add, tot_drop);
    goto out;
  }

  /* 4: load everywhere at once, then poll. */
  for (uint32_t s = 0; s < S; s++) {
    if (!ap.n_add[s]) continue;
    uint8_t *req = NULL, *resp = NULL;
    size_t len = 0, rlen = 0;
    if ((rc = pack_pairs(ap.add + s * LE, L, E, st[0].fingerprint, true, &req, &len, &e))) goto out;
    rc = gc_control_call(c, s, PR_METHOD_LOAD_EXPERTS, req, len, 0, &resp, &rlen, &e);
    mr_free(req);
    if (rc) goto out;
    Moerpc__V1__LoadReply *lr = moerpc__v1__load_reply__unpack(NULL, rlen, resp);
    mr_free(resp);
    if (!lr) {
      rc = mr_err_set(&e, MR_EPROTO, "server %s: LoadReply does not decode", cf->servers[s].name);
      goto out;
    }
    load_id[s] = lr->load_id;
    mr_log(MR_LOG_INFO, "apply: server %s: load %" PRIu64 " started: %" PRIu64 " experts, %" PRIu64
           " tensors, %.3f GB to read", cf->servers[s].name, lr->load_id, lr->pairs,
           lr->tensors_total, lr->bytes_total / 1e9);
    moerpc__v1__load_reply__free_unpacked(lr, NULL);
  }
  uint64_t deadline = mr_now_ns() + (uint64_t)a.load_timeout_s * 1000000000ull, last_print = 0;
  for (;;) {
    bool all_done = true, print = mr_now_ns() - last_print >= 1000000000ull;
    if (print) last_print = mr_now_ns();
    for (uint32_t s = 0; s < S; s++) {
      if (!load_id[s]) continue;
      Moerpc__V1__LoadStatusRequest q = MOERPC__V1__LOAD_STATUS_REQUEST__INIT;
      q.load_id = load_id[s];
      uint8_t req[32], *resp = NULL;
      size_t len = moerpc__v1__load_status_request__pack(&q, req), rlen = 0;
      if ((rc = gc_control_call(c, s, PR_METHOD_LOAD_STATUS, req, len, 0, &resp, &rlen, &e))) goto out;
      Moerpc__V1__LoadProgress *p = moerpc__v1__load_progress__unpack(NULL, rlen, resp);
      mr_free(resp);
      if (!p) {
        rc = mr_err_set(&e, MR_EPROTO, "server %s: LoadProgress does not decode", cf->servers[s].name);
        goto out;
      }
      double gbs = p->seconds > 0 ? p->bytes_done / p->seconds / 1e9 : 0;
      bool done = p->state == MOERPC__V1__LOAD_STATE__LOAD_STATE_DONE;
      if (p->state == MOERPC__V1__LOAD_STATE__LOAD_STATE_FAILED) {
        rc = mr_err_set(&e, pr_mr_from_status((grpc_status_code)p->status),
                        "server %s: load %" PRIu64 " failed: %s (nothing was switched or "
                        "unloaded)", cf->servers[s].name, p->load_id, p->error ? p->error : "");
        moerpc__v1__load_progress__free_unpacked(p, NULL);
        goto out;
      }
      if (print || done) {
        double eta = gbs > 0 ? (p->bytes_total - p->bytes_done) / 1e9 / gbs : 0;
        printf("load %-12s %6" PRIu64 "/%" PRIu64 " tensors, %.3f/%.3f GB, %.2f GB/s, %s%.0f s\n",
               cf->servers[s].name, p->tensors_done, p->tensors_total, p->bytes_done / 1e9,
               p->bytes_total / 1e9, gbs, done ? "done in " : "ETA ", done ? p->seconds : eta);
        fflush(stdout);
      }
      if (done) load_id[s] = 0; /* printed once */
      else all_done = false;
      moerpc__v1__load_progress__free_unpacked(p, NULL);
    }
    if (all_done) break;
    if (mr_now_ns() > deadline) {
      rc = mr_err_set(&e, MR_ETIMEDOUT, "loading did not finish within --load-timeout-s %u "
                      "(nothing was switched or unloaded)", a.load_timeout_s);
      goto out;
    }
    usleep(PL_POLL_MS * 1000);
  }
  /* Every new copy must answer Hello before any client is switched. */
  uint8_t *now = mr_calloc(LE, 1);
  if (!now) {
    rc = mr_err_set(&e, MR_ENOMEM, "out of memory");
    goto out;
  }
  for (uint32_t s = 0; s < S && !rc; s++) {
    srv_state tmp;
    if ((rc = hello(c, cf, s, now, LE, &tmp, &e))) break;
    for (size_t i = 0; i < LE && !rc; i++)
      if (ap.want[s * LE + i] && !now[i])
        rc = mr_err_set(&e, MR_EPRECOND, "server %s does not announce layer %zu expert %zu after "
                        "its load (nothing was switched)", cf->servers[s].name, i / E, i % E);
  }
  mr_free(now);
  if (rc) goto out;

  /* 5: switch the clients. */
  uint64_t hash = pl_placement_hash(plan_json, plan_len);
  char want_hash[24];
  snprintf(want_hash, sizeof want_hash, "%016" PRIx64, hash);
  for (uint32_t i = 0; i < a.n_files; i++) {
    if ((rc = mr_file_write_atomic(a.cl_files[i], plan_json, plan_len, &e))) goto out;
    mr_log(MR_LOG_INFO, "apply: wrote %s (hash %s)", a.cl_files[i], want_hash);
  }
  deadline = mr_now_ns() + (uint64_t)a.switch_timeout_s * 1000000000ull;
  for (uint32_t i = 0; i < a.n_urls; i++) {
    uint64_t t_sw = mr_now_ns();
    for (;;) {
      int status = 0;
      char *body = NULL;
      size_t blen = 0;
      mr_err ge;
      int grc = mr_http_get(a.cl_urls[i], "/placement", 1 << 16, 5000, &status, &body, &blen, &ge);
      char h[64] = "", err[600] = "";
      if (grc == 0 && status == 200) {
        placement_field(body, blen, "hash", h, sizeof h);
        placement_field(body, blen, "last_error", err, sizeof err);
      }
      mr_free(body);
      if (strcmp(h, want_hash) == 0) {
        mr_log(MR_LOG_INFO, "apply: client %s switched (hash %s) after %.2f s", a.cl_urls[i],
               want_hash, (double)(mr_now_ns() - t_sw) / 1e9);
        break;
      }
      if (mr_now_ns() > deadline) {
        rc = mr_err_set(&e, MR_ETIMEDOUT, "client %s did not report placement hash %s within "
                        "--switch-timeout-s %u (it reports \"%s\"%s%s%s%s); nothing was "
                        "unloaded: the cluster holds both copies", a.cl_urls[i], want_hash,
                        a.switch_timeout_s, h, grc ? "; GET failed: " : "", grc ? ge.msg : "",
                        err[0] ? "; its last refusal: " : "", err);
        goto out;
      }
      usleep(PL_POLL_MS * 1000);
    }
  }

  /* 6: unload the old copies. */
  bool may_unload = !a.no_unload && (a.n_urls > 0 || a.unload_without_clients);
  if (!may_unload && tot_drop)
    mr_log(MR_LOG_WARN, "apply: %" PRIu64 " old copies kept (%s)", tot_drop,
           a.no_unload ? "--no-unload" : "no --client confirmed a switch; see --unload-without-clients");
  uint64_t *freed = mr_calloc(S, sizeof *freed);
  for (uint32_t s = 0; s < S && may_unload && freed; s++) {
    if (!ap.n_drop[s]) continue;
    uint8_t *req = NULL, *resp = NULL;
    size_t len = 0, rlen = 0;
    if ((rc = pack_pairs(ap.drop + s * LE, L, E, st[0].fingerprint, false, &req, &len, &e))) break;
    rc = gc_control_call(c, s, PR_METHOD_UNLOAD_EXPERTS, req, len, 0, &resp, &rlen, &e);
    mr_free(req);
    if (rc) break;
    Moerpc__V1__UnloadReply *ur = moerpc__v1__unload_reply__unpack(NULL, rlen, resp);
    mr_free(resp);
    if (!ur) {
      rc = mr_err_set(&e, MR_EPROTO, "server %s: UnloadReply does not decode", cf->servers[s].name);
      break;
    }
    freed[s] = ur->bytes_freed;
    moerpc__v1__unload_reply__free_unpacked(ur, NULL);
  }
  double secs = (double)(mr_now_ns() - t0) / 1e9;
  for (uint32_t s = 0; s < S && freed; s++)
    printf("applied %-12s loaded %" PRIu64 " experts (%.3f GB), unloaded %" PRIu64 " (%.3f GB)\n",
           cf->servers[s].name, ap.n_add[s], ap.n_add[s] * st[s].expert_bytes / 1e9,
           freed[s] ? ap.n_drop[s] : 0, freed[s] / 1e9);
  mr_free(freed);
  if (!rc) printf("applied %s in %.2f s\n", a.plan, secs);
out:
  if (rc) {
    fprintf(stderr, PROG ": %s: %s\n", mr_err_name(rc), e.msg);
    mr_log(MR_LOG_ERROR, "apply failed: %s", e.msg);
  }
  pl_apply_plan_close(&ap);
  gc_cluster_close(c);
  mr_placement_close(&plan);
  mr_free(plan_json);
  mr_free(owned);
  mr_free(st);
  mr_free(free_b);
  mr_free(load_id);
  mr_free(cf);
  return rc ? 1 : 0;
}
