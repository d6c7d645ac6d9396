/*
 * common/placement.c - the placement file (format in common/mr.h): which (layer, expert)
 * pairs the client computes and which server computes the others.
 *
 * Like the cluster file, unknown or duplicate keys are errors, every id set is checked
 * against num_experts, and a pair both local and remote is refused with both places
 * named, before anything is routed. A pair listed under several servers of a layer's
 * "remote" has replicas: route[] is -1 for it (the client's default rule picks the
 * least-loaded live replica among the servers announcing it) and rep_off/rep list the
 * servers in file order.
 */
#include "common/internal.h"

#include <stdio.h>
#include <string.h>

#define PLACEMENT_FORMAT "moerpc-placement"
#define PLACEMENT_VERSION 1u
#define PLACEMENT_MAX_LAYERS MR_MAX_LAYERS
#define PLACEMENT_MAX_EXPERTS 65536u
/* Most (layer, expert) pairs: 16x Kimi-K2's 61 x 384, and a bound on what a hostile file can
 * make us allocate (5 bytes a pair). */
#define PLACEMENT_MAX_PAIRS (1u << 22)
/* Most (pair, server) entries over all layers: 2x the pair bound, so that every pair of the
 * largest file may have two copies; 8 bytes an entry while parsing. */
#define PLACEMENT_MAX_COPIES MR_PLACEMENT_MAX_COPIES

/* One "remote" entry while parsing: pair index and server index, sorted into rep[] after. */
typedef struct pl_entry {
  uint32_t pair;
  int32_t server;
} pl_entry;

typedef struct pl_parse_state {
  uint8_t *seen;      /* [L] layer listed */
  pl_entry *ent;      /* growable */
  size_t n_ent, cap_ent;
} pl_parse_state;

void mr_placement_close(mr_placement *p) {
  if (!p) return;
  mr_free(p->local);
  mr_free(p->route);
  mr_free(p->server);
  mr_free(p->copies);
  mr_free(p->rep_off);
  mr_free(p->rep);
  memset(p, 0, sizeof *p);
}

static int pl_str(const cJSON *v, const char *label, const char *field, const char **out,
                  mr_err *e) {
  if (!cJSON_IsString(v)) {
    char desc[96];
    mr__json_describe(v, desc, sizeof desc);
    return mr_err_set(e, MR_EFORMAT, "%s: %s = %s, must be a string", label, field, desc);
  }
  *out = v->valuestring;
  return 0;
}

/* The index of server name in p->server, adding it if new. */
static int pl_server(mr_placement *p, const char *name, const char *label, const char *field,
                     int32_t *idx, mr_err *e) {
  size_t n = strlen(name);
  if (n == 0 || n >= sizeof p->server[0])
    return mr_err_set(e, MR_ERANGE, "%s: %s: server name of %zu characters, must be 1..%zu",
                      label, field, n, sizeof p->server[0] - 1);
  for (uint32_t i = 0; i < p->n_servers; i++)
    if (strcmp(p->server[i], name) == 0) {
      *idx = (int32_t)i;
      return 0;
    }
  if (p->n_servers >= MR_PLACEMENT_MAX_SERVERS)
    return mr_err_set(e, MR_ERANGE, "%s: %s: more than %u server names", label, field,
                      MR_PLACEMENT_MAX_SERVERS);
  memcpy(p->server[p->n_servers], name, n + 1);
  *idx = (int32_t)p->n_servers++;
  return 0;
}

static int pl_entry_add(mr_placement *p, pl_parse_state *st, uint32_t pair, int32_t si,
                        const char *label, const char *field, mr_err *e) {
  if (st->n_ent >= PLACEMENT_MAX_COPIES)
    return mr_err_set(e, MR_ERANGE, "%s: %s: more than %u (pair, server) entries in all "
                      "\"remote\" sets", label, field, PLACEMENT_MAX_COPIES);
  if (st->n_ent == st->cap_ent) {
    size_t cap = st->cap_ent ? st->cap_ent * 2 : 1024;
    pl_entry *n = mr_realloc(st->ent, cap * sizeof *n);
    if (!n) return mr_err_set(e, MR_ENOMEM, "%s: %s: out of memory", label, field);
    st->ent = n;
    st->cap_ent = cap;
  }
  st->ent[st->n_ent].pair = pair;
  st->ent[st->n_ent].server = si;
  st->n_ent++;
  p->copies[pair]++;
  return 0;
}

static int pl_layer(mr_placement *p, const cJSON *o, uint32_t i, pl_parse_state *st,
                    const char *label, mr_err *e) {
  uint8_t *seen = st->seen;
  static const char *const keys[] = {"layer", "local", "remote", NULL};
  char where[48], field[160];
  snprintf(where, sizeof where, "layers[%u]", i);
  if (!cJSON_IsObject(o)) {
    char desc[96];
    mr__json_describe(o, desc, sizeof desc);
    return mr_err_set(e, MR_EFORMAT, "%s: %s = %s, must be an object", label, where, desc);
  }
  int rc = mr__json_check_keys(o, keys, label, where, e);
  if (rc) return rc;
  uint64_t l;
  const cJSON *lv = cJSON_GetObjectItemCaseSensitive(o, "layer");
  snprintf(field, sizeof field, "%s.layer", where);
  if (!lv) return mr_err_set(e, MR_EFORMAT, "%s: %s is missing", label, field);
  if ((rc = mr__json_u64(lv, label, field, 0, p->num_layers - 1, &l, e))) return rc;
  if (seen[l]) return mr_err_set(e, MR_EINVAL, "%s: %s: layer %u is listed twice", label, where, (unsigned)l);
  seen[l] = 1;
  const size_t base = (size_t)l * p->num_experts;

  const cJSON *loc = cJSON_GetObjectItemCaseSensitive(o, "local");
  if (loc) {
    const char *spec = NULL;
    snprintf(field, sizeof field, "%s.local", where);
    if ((rc = pl_str(loc, label, field, &spec, e))) return rc;
    mr_idset s;
    char what[200];
    snprintf(what, sizeof what, "%s: %s", label, field);
    if ((rc = mr_idset_parse(&s, spec, p->num_experts, what, e))) return rc;
    for (uint32_t x = 0; x < p->num_experts; x++)
      if (mr_idset_has(&s, x)) {
        p->local[base + x] = 1;
        p->n_local++;
      }
    mr_idset_close(&s);
  }
  const cJSON *rem = cJSON_GetObjectItemCaseSensitive(o, "remote");
  if (rem) {
    if (!cJSON_IsObject(rem)) {
      char desc[96];
      mr__json_describe(rem, desc, sizeof desc);
      return mr_err_set(e, MR_EFORMAT, "%s: %s.remote = %s, must be an object mapping server "
                        "names to expert id sets", label, where, desc);
    }
    for (const cJSON *sv = rem->child; sv; sv = sv->next) {
      snprintf(field, sizeof field, "%s.remote.%.64s", where, sv->string ? sv->string : "?");
      for (const cJSON *d = rem->child; d != sv; d = d->next)
        if (strcmp(d->string, sv->string) == 0)
          return mr_err_set(e, MR_EFORMAT, "%s: %s: server named twice", label, field);
      int32_t si = -1;
      if ((rc = pl_server(p, sv->string, label, field, &si, e))) return rc;
      const char *spec = NULL;
      if ((rc = pl_str(sv, label, field, &spec, e))) return rc;
      mr_idset s;
      char what[200];
      snprintf(what, sizeof what, "%s: %s", label, field);
      if ((rc = mr_idset_parse(&s, spec, p->num_experts, what, e))) return rc;
      for (uint32_t x = 0; x < p->num_experts && !rc; x++) {
        if (!mr_idset_has(&s, x)) continue;
        if (p->local[base + x])
          rc = mr_err_set(e, MR_EINVAL, "%s: %s: layer %u expert %u is also local", label,
                          field, (unsigned)l, x);
        else
          rc = pl_entry_add(p, st, (uint32_t)(base + x), si, label, field, e);
      }
      mr_idset_close(&s);
      if (rc) return rc;
    }
  }
  return 0;
}

int mr_placement_parse(mr_placement *p, const char *json, size_t len, const char *label,
                       mr_err *e) {
  static const char *const keys[] = {"format", "version", "model_fingerprint", "num_layers",
                                     "num_experts", "layers", NULL};
  memset(p, 0, sizeof *p);
  if (!label) label = "placement";
  cJSON *root = NULL;
  pl_parse_state st = {0};
  int rc = mr__json_parse(json, len, label, &root, e);
  if (rc) return rc;
  if (!cJSON_IsObject(root)) {
    rc = mr_err_set(e, MR_EFORMAT, "%s: top level must be a JSON object", label);
    goto out;
  }
  if ((rc = mr__json_check_keys(root, keys, label, "top level", e))) goto out;
  const cJSON *fmt = cJSON_GetObjectItemCaseSensitive(root, "format");
  if (!cJSON_IsString(fmt) || strcmp(fmt->valuestring, PLACEMENT_FORMAT) != 0) {
    rc = mr_err_set(e, MR_EFORMAT, "%s: format must be \"%s\"", label, PLACEMENT_FORMAT);
    goto out;
  }
  uint64_t v, L, E;
  const cJSON *it = cJSON_GetObjectItemCaseSensitive(root, "version");
  if (!it) {
    rc = mr_err_set(e, MR_EFORMAT, "%s: version is missing (must be %u)", label, PLACEMENT_VERSION);
    goto out;
  }
  if ((rc = mr__json_u64(it, label, "version", PLACEMENT_VERSION, PLACEMENT_VERSION, &v, e))) goto out;
  it = cJSON_GetObjectItemCaseSensitive(root, "num_layers");
  if (!it) {
    rc = mr_err_set(e, MR_EFORMAT, "%s: num_layers is missing", label);
    goto out;
  }
  if ((rc = mr__json_u64(it, label, "num_layers", 1, PLACEMENT_MAX_LAYERS, &L, e))) goto out;
  it = cJSON_GetObjectItemCaseSensitive(root, "num_experts");
  if (!it) {
    rc = mr_err_set(e, MR_EFORMAT, "%s: num_experts is missing", label);
    goto out;
  }
  if ((rc = mr__json_u64(it, label, "num_experts", 1, PLACEMENT_MAX_EXPERTS, &E, e))) goto out;
  if (L * E > PLACEMENT_MAX_PAIRS) {
    rc = mr_err_set(e, MR_ERANGE, "%s: num_layers x num_experts = %llu, at most %u pairs", label,
                    (unsigned long long)(L * E), PLACEMENT_MAX_PAIRS);
    goto out;
  }
  p->num_layers = (uint32_t)L;
  p->num_experts = (uint32_t)E;
  it = cJSON_GetObjectItemCaseSensitive(root, "model_fingerprint");
  if (it) {
    const char *fp = NULL;
    if ((rc = pl_str(it, label, "model_fingerprint", &fp, e))) goto out;
    if (strlen(fp) >= sizeof p->model_fingerprint) {
      rc = mr_err_set(e, MR_ERANGE, "%s: model_fingerprint is %zu characters, at most %zu",
                      label, strlen(fp), sizeof p->model_fingerprint - 1);
      goto out;
    }
    snprintf(p->model_fingerprint, sizeof p->model_fingerprint, "%s", fp);
  }
  size_t pairs = (size_t)L * E;
  p->local = mr_calloc(pairs, 1);
  p->route = mr_malloc(pairs * sizeof *p->route);
  p->server = mr_calloc(MR_PLACEMENT_MAX_SERVERS, sizeof *p->server);
  p->copies = mr_calloc(pairs, sizeof *p->copies);
  p->rep_off = mr_malloc((pairs + 1) * sizeof *p->rep_off);
  st.seen = mr_calloc(L, 1);
  if (!p->local || !p->route || !p->server || !p->copies || !p->rep_off || !st.seen) {
    rc = mr_err_set(e, MR_ENOMEM, "%s: %llu x %llu pairs: out of memory", label,
                    (unsigned long long)L, (unsigned long long)E);
    goto out;
  }
  for (size_t i = 0; i < pairs; i++) p->route[i] = -1;
  const cJSON *layers = cJSON_GetObjectItemCaseSensitive(root, "layers");
  if (!cJSON_IsArray(layers)) {
    rc = mr_err_set(e, MR_EFORMAT, "%s: layers must be an array of layer objects", label);
    goto out;
  }
  uint32_t i = 0;
  for (const cJSON *o = layers->child; o; o = o->next, i++)
    if ((rc = pl_layer(p, o, i, &st, label, e))) goto out;
  /* Counting sort of the entries by pair (stable: servers in file order). */
  p->rep = mr_malloc((st.n_ent ? st.n_ent : 1) * sizeof *p->rep);
  if (!p->rep) {
    rc = mr_err_set(e, MR_ENOMEM, "%s: %zu remote entries: out of memory", label, st.n_ent);
    goto out;
  }
  p->rep_off[0] = 0;
  for (size_t k = 0; k < pairs; k++) {
    p->rep_off[k + 1] = p->rep_off[k] + p->copies[k];
    if (p->copies[k] == 1) p->n_single++;
    else if (p->copies[k] > 1) p->n_replicated++;
  }
  p->n_copies = st.n_ent;
  {
    uint32_t *fill = mr_malloc((pairs ? pairs : 1) * sizeof *fill);
    if (!fill) {
      rc = mr_err_set(e, MR_ENOMEM, "%s: out of memory", label);
      goto out;
    }
    memcpy(fill, p->rep_off, pairs * sizeof *fill);
    for (size_t k = 0; k < st.n_ent; k++) p->rep[fill[st.ent[k].pair]++] = st.ent[k].server;
    mr_free(fill);
  }
  for (size_t k = 0; k < pairs; k++)
    p->route[k] = p->copies[k] == 1 ? p->rep[p->rep_off[k]] : -1;
out:
  cJSON_Delete(root);
  mr_free(st.seen);
  mr_free(st.ent);
  if (rc) mr_placement_close(p);
  return rc;
}

int mr_placement_load(mr_placement *p, const char *path, mr_err *e) {
  memset(p, 0, sizeof *p);
  return MR__PARSE_FILE(path, mr_placement_parse, p, e);
}
