/*
 * common/cluster.c - the cluster file: which expert servers a client talks to.
 *
 *   {
 *     "model": "/models/Qwen3-30B-A3B",           optional
 *     "deadline_ms": 5000,                         optional, 1..600000
 *     "failover_ms": 1000,                         optional, 1..600000 (0 / absent: the
 *                                                  client's default, min(deadline/4, 1 s))
 *     "servers": [{"name": "s0", "address": "10.0.0.5:50051"},
 *                 {"name": "s1", "address": "[fd00::7]:50051",
 *                  "expert_memory": "64G", "numa_nodes": 2, "speed": 1.5}],
 *                                                  the last three optional, for planning
 *     "local": {"layers": "all", "experts": "0-3"} optional
 *     "tls": {"ca": FILE, "cert": FILE, "key": FILE, "server_name": STR}  optional, each key
 *                                                  optional; cert and key together
 *     "token_file": FILE                           optional
 *   }
 *
 * Unknown keys anywhere are errors: a misspelt "deadline_msec" silently falling back to
 * the default is the kind of mistake that costs an afternoon. Duplicate keys too.
 */
#include "common/internal.h"

#include <stdio.h>
#include <string.h>
#include <strings.h>

/* Syntax check of the local id sets without the model: the largest ids any model may have. */
#define CLUSTER_MAX_EXPERT_ID 65536u

/* Copies a string field into dst (size cap), or reports its type or length. */
static int cluster_str(const cJSON *v, const char *label, const char *field, char *dst,
                       size_t cap, bool nonempty, mr_err *e) {
  if (!cJSON_IsString(v)) {
    char desc[96];
    mr__json_describe(v, desc, sizeof desc);
    return mr_err_set(e, MR_EFORMAT, "%s: %s = %s, must be a string", label, field, desc);
  }
  size_t n = strlen(v->valuestring);
  if (n >= cap)
    return mr_err_set(e, MR_ERANGE, "%s: %s is %zu characters long, at most %zu", label, field, n,
                      cap - 1);
  if (nonempty && n == 0)
    return mr_err_set(e, MR_EINVAL, "%s: %s is empty", label, field);
  memcpy(dst, v->valuestring, n + 1);
  return 0;
}

static bool cluster_name_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
         c == '-' || c == '_' || c == '.';
}

static bool cluster_host_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
         c == '-' || c == '.' || c == '_';
}

/* Validates "host:port" or "[v6]:port". */
static int cluster_address(const char *a, const char *label, const char *field, mr_err *e) {
  const char *port;
  if (a[0] == '[') {
    const char *close = strchr(a, ']');
    if (!close || close == a + 1 || close[1] != ':')
      return mr_err_set(e, MR_EINVAL,
                        "%s: %s = \"%s\", an IPv6 address must be written [addr]:port", label,
                        field, a);
    for (const char *p = a + 1; p < close; p++) {
      char c = *p;
      bool ok = (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F') ||
                c == ':' || c == '.';
      if (!ok)
        return mr_err_set(e, MR_EINVAL,
                          "%s: %s = \"%s\", character '%c' is not allowed in an IPv6 address",
                          label, field, a, c);
    }
    port = close + 2;
  } else {
    const char *colon = strrchr(a, ':');
    if (!colon || colon == a)
      return mr_err_set(e, MR_EINVAL, "%s: %s = \"%s\", must be host:port", label, field, a);
    for (const char *p = a; p < colon; p++)
      if (!cluster_host_char(*p))
        return mr_err_set(e, MR_EINVAL,
                          "%s: %s = \"%s\", character '%c' is not allowed in a host name "
                          "(IPv6 addresses go in brackets: [::1]:50051)",
                          label, field, a, *p);
    port = colon + 1;
  }
  unsigned long v = 0;
  size_t nd = 0;
  for (const char *p = port; *p; p++, nd++) {
    if (*p < '0' || *p > '9' || nd >= 5)
      return mr_err_set(e, MR_EINVAL, "%s: %s = \"%s\", port must be a number in 1..65535",
                        label, field, a);
    v = v * 10 + (unsigned long)(*p - '0');
  }
  if (nd == 0 || v < 1 || v > 65535)
    return mr_err_set(e, MR_ERANGE, "%s: %s = \"%s\", port must be a number in 1..65535", label,
                      field, a);
  return 0;
}

int mr_size_parse(const char *s, const char *what, uint64_t *out, mr_err *e) {
  static const char rule[] = "must be a byte count: digits with an optional K, M, G, T or P "
                             "suffix (x 1024^n), e.g. \"64G\"";
  const char *p = s;
  uint64_t v = 0;
  if (*p < '0' || *p > '9') return mr_err_set(e, MR_EINVAL, "%s = \"%s\", %s", what, s, rule);
  for (; *p >= '0' && *p <= '9'; p++) {
    if (v > (MR_CLUSTER_MAX_EXPERT_MEMORY - (uint64_t)(*p - '0')) / 10)
      return mr_err_set(e, MR_ERANGE, "%s = \"%s\", at most 2^50 bytes (1P)", what, s);
    v = v * 10 + (uint64_t)(*p - '0');
  }
  unsigned shift = 0;
  if (*p) {
    static const char units[] = "KMGTP";
    const char *u = strchr(units, *p >= 'a' && *p <= 'z' ? *p - 'a' + 'A' : *p);
    if (!u || !*u) return mr_err_set(e, MR_EINVAL, "%s = \"%s\", %s", what, s, rule);
    shift = 10u * (unsigned)(u - units + 1);
    p++;
    if (*p == 'i') p++;
    if (*p == 'B' || *p == 'b') p++;
    if (*p) return mr_err_set(e, MR_EINVAL, "%s = \"%s\", %s", what, s, rule);
  }
  if (shift && v > (MR_CLUSTER_MAX_EXPERT_MEMORY >> shift))
    return mr_err_set(e, MR_ERANGE, "%s = \"%s\", at most 2^50 bytes (1P)", what, s);
  v <<= shift;
  if (v == 0 || v > MR_CLUSTER_MAX_EXPERT_MEMORY)
    return mr_err_set(e, MR_ERANGE, "%s = \"%s\", must be 1..2^50 bytes", what, s);
  *out = v;
  return 0;
}

/* The optional planning keys of a server (expert_memory, numa_nodes, speed). */
static int cluster_server_plan(const cJSON *s, const char *where, const char *label,
                               mr_cluster_server *out, mr_err *e) {
  char field[96];
  int rc;
  out->speed = 1.0;
  const cJSON *jm = cJSON_GetObjectItemCaseSensitive(s, "expert_memory");
  if (jm) {
    snprintf(field, sizeof field, "%s.expert_memory", where);
    if (cJSON_IsString(jm)) {
      char what[160];
      snprintf(what, sizeof what, "%s: %s", label, field);
      if ((rc = mr_size_parse(jm->valuestring, what, &out->expert_memory, e))) return rc;
    } else if ((rc = mr__json_u64(jm, label, field, 1, MR_CLUSTER_MAX_EXPERT_MEMORY,
                                  &out->expert_memory, e))) {
      return rc;
    }
  }
  const cJSON *jn = cJSON_GetObjectItemCaseSensitive(s, "numa_nodes");
  if (jn) {
    uint64_t v;
    snprintf(field, sizeof field, "%s.numa_nodes", where);
    if ((rc = mr__json_u64(jn, label, field, 1, MR_CLUSTER_MAX_NUMA_NODES, &v, e))) return rc;
    out->numa_nodes = (uint32_t)v;
  }
  const cJSON *jv = cJSON_GetObjectItemCaseSensitive(s, "speed");
  if (jv) {
    snprintf(field, sizeof field, "%s.speed", where);
    /* !(d > 0) also refuses NaN, which cJSON never produces but a future parser might. */
    double d = cJSON_IsNumber(jv) ? jv->valuedouble : 0;
    if (!cJSON_IsNumber(jv) || !(d > 0) || d > MR_CLUSTER_MAX_SPEED) {
      char desc[96];
      mr__json_describe(jv, desc, sizeof desc);
      return mr_err_set(e, cJSON_IsNumber(jv) ? MR_ERANGE : MR_EFORMAT,
                        "%s: %s = %s, must be a number > 0 and <= 1e6 (relative kernel "
                        "throughput, 1 = the reference host)", label, field, desc);
    }
    out->speed = d;
  }
  return 0;
}

static int cluster_server(const cJSON *s, size_t i, const char *label, mr_cluster_server *out,
                          mr_err *e) {
  static const char *const keys[] = {"name", "address", "expert_memory", "numa_nodes", "speed",
                                     NULL};
  char where[48], field[64];
  snprintf(where, sizeof where, "servers[%zu]", i);
  if (!cJSON_IsObject(s)) {
    char desc[96];
    mr__json_describe(s, desc, sizeof desc);
    return mr_err_set(e, MR_EFORMAT,
                      "%s: %s = %s, must be an object {\"name\": ..., \"address\": ...}", label,
                      where, desc);
  }
  int rc = mr__json_check_keys(s, keys, label, where, e);
  if (rc) return rc;
  snprintf(field, sizeof field, "%s.name", where);
  rc = cluster_str(cJSON_GetObjectItemCaseSensitive(s, "name"), label, field, out->name,
                   sizeof out->name, true, e);
  if (rc) return rc;
  for (const char *p = out->name; *p; p++)
    if (!cluster_name_char(*p))
      return mr_err_set(e, MR_EINVAL,
                        "%s: %s = \"%s\", character '%c' is not allowed (letters, digits, "
                        "'-', '_', '.')",
                        label, field, out->name, *p);
  snprintf(field, sizeof field, "%s.address", where);
  rc = cluster_str(cJSON_GetObjectItemCaseSensitive(s, "address"), label, field, out->address,
                   sizeof out->address, true, e);
  if (rc) return rc;
  if ((rc = cluster_address(out->address, label, field, e))) return rc;
  return cluster_server_plan(s, where, label, out, e);
}

static int cluster_local(const cJSON *local, const char *label, mr_cluster_file *c, mr_err *e) {
  static const char *const keys[] = {"layers", "experts", NULL};
  if (!cJSON_IsObject(local)) {
    char desc[96];
    mr__json_describe(local, desc, sizeof desc);
    return mr_err_set(e, MR_EFORMAT,
                      "%s: local = %s, must be an object {\"layers\": ..., \"experts\": ...}",
                      label, desc);
  }
  int rc = mr__json_check_keys(local, keys, label, "local", e);
  if (rc) return rc;
  const cJSON *jl = cJSON_GetObjectItemCaseSensitive(local, "layers");
  const cJSON *je = cJSON_GetObjectItemCaseSensitive(local, "experts");
  if (je && (rc = cluster_str(je, label, "local.experts", c->local_experts,
                              sizeof c->local_experts, false, e)))
    return rc;
  if (jl) {
    if ((rc = cluster_str(jl, label, "local.layers", c->local_layers, sizeof c->local_layers,
                          false, e)))
      return rc;
  } else if (c->local_experts[0]) {
    /* Experts without layers mean those experts in every layer. */
    snprintf(c->local_layers, sizeof c->local_layers, "all");
  }
  /* Syntax-check the sets now, against the largest ids any model may have; the client
   * checks them again against the model it loads. */
  char what[320];
  mr_idset s;
  snprintf(what, sizeof what, "%s: local.layers", label);
  if ((rc = mr_idset_parse(&s, c->local_layers, MR_MAX_LAYERS, what, e))) return rc;
  mr_idset_close(&s);
  snprintf(what, sizeof what, "%s: local.experts", label);
  if ((rc = mr_idset_parse(&s, c->local_experts, CLUSTER_MAX_EXPERT_ID, what, e))) return rc;
  mr_idset_close(&s);
  return 0;
}

static int cluster_tls(const cJSON *tls, const char *label, mr_cluster_file *c, mr_err *e) {
  static const char *const keys[] = {"ca", "cert", "key", "server_name", NULL};
  if (!cJSON_IsObject(tls)) {
    char desc[96];
    mr__json_describe(tls, desc, sizeof desc);
    return mr_err_set(e, MR_EFORMAT,
                      "%s: tls = %s, must be an object {\"ca\": FILE, \"cert\": FILE, \"key\": "
                      "FILE, \"server_name\": NAME}", label, desc);
  }
  int rc = mr__json_check_keys(tls, keys, label, "tls", e);
  if (rc) return rc;
  struct { const char *key, *field; char *dst; size_t cap; } f[] = {
      {"ca", "tls.ca", c->tls_ca, sizeof c->tls_ca},
      {"cert", "tls.cert", c->tls_cert, sizeof c->tls_cert},
      {"key", "tls.key", c->tls_key, sizeof c->tls_key},
      {"server_name", "tls.server_name", c->tls_server_name, sizeof c->tls_server_name},
  };
  for (size_t i = 0; i < sizeof f / sizeof f[0]; i++) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(tls, f[i].key);
    if (v && (rc = cluster_str(v, label, f[i].field, f[i].dst, f[i].cap, true, e))) return rc;
  }
  if (!c->tls_cert[0] != !c->tls_key[0])
    return mr_err_set(e, MR_EINVAL, "%s: tls.%s is given without tls.%s: a client certificate "
                      "needs its key and the other way round", label,
                      c->tls_cert[0] ? "cert" : "key", c->tls_cert[0] ? "key" : "cert");
  for (const char *p = c->tls_server_name; *p; p++)
    if (!cluster_host_char(*p))
      return mr_err_set(e, MR_EINVAL,
                        "%s: tls.server_name = \"%s\", character '%c' is not allowed in a host "
                        "name", label, c->tls_server_name, *p);
  c->tls = true;
  return 0;
}

int mr_cluster_parse(mr_cluster_file *c, const char *json, size_t len, const char *label,
                     mr_err *e) {
  static const char *const keys[] = {"model", "deadline_ms", "failover_ms", "servers", "local",
                                     "tls", "token_file", NULL};
  memset(c, 0, sizeof *c);
  if (!label) label = "cluster file";
  cJSON *root = NULL;
  int rc = mr__json_parse_object(json, len, label, &root, e);
  if (rc) return rc;
  if ((rc = mr__json_check_keys(root, keys, label, "the top level", e))) goto out_free_root;

  const cJSON *jm = cJSON_GetObjectItemCaseSensitive(root, "model");
  if (jm && (rc = cluster_str(jm, label, "model", c->model, sizeof c->model, true, e)))
    goto out_free_root;

  c->deadline_ms = MR_CLUSTER_DEFAULT_DEADLINE_MS;
  const cJSON *jd = cJSON_GetObjectItemCaseSensitive(root, "deadline_ms");
  if (jd) {
    uint64_t v;
    if ((rc = mr__json_u64(jd, label, "deadline_ms", 1, MR_CLUSTER_MAX_DEADLINE_MS, &v, e)))
      goto out_free_root;
    c->deadline_ms = (uint32_t)v;
  }

  /* 0 = not given: the client derives it from the deadline (moerpc_client.h). */
  const cJSON *jf = cJSON_GetObjectItemCaseSensitive(root, "failover_ms");
  if (jf) {
    uint64_t v;
    if ((rc = mr__json_u64(jf, label, "failover_ms", 1, MR_CLUSTER_MAX_DEADLINE_MS, &v, e)))
      goto out_free_root;
    c->failover_ms = (uint32_t)v;
  }

  const cJSON *js = cJSON_GetObjectItemCaseSensitive(root, "servers");
  if (!js) {
    rc = mr_err_set(e, MR_EFORMAT, "%s: required field servers is missing", label);
    goto out_free_root;
  }
  if (!cJSON_IsArray(js)) {
    char desc[96];
    mr__json_describe(js, desc, sizeof desc);
    rc = mr_err_set(e, MR_EFORMAT, "%s: servers = %s, must be an array of objects", label, desc);
    goto out_free_root;
  }
  int n = cJSON_GetArraySize(js);
  if (n < 1 || n > MR_CLUSTER_MAX_SERVERS) {
    rc = mr_err_set(e, MR_ERANGE, "%s: servers has %d entries, must have 1..%d", label, n,
                    MR_CLUSTER_MAX_SERVERS);
    goto out_free_root;
  }
  size_t i = 0;
  for (const cJSON *s = js->child; s; s = s->next, i++) {
    mr_cluster_server *srv = &c->servers[i];
    if ((rc = cluster_server(s, i, label, srv, e))) goto out_free_root;
    for (size_t j = 0; j < i; j++) {
      if (strcmp(c->servers[j].name, srv->name) == 0) {
        rc = mr_err_set(e, MR_EINVAL, "%s: servers[%zu].name = \"%s\" is also servers[%zu].name",
                        label, i, srv->name, j);
        goto out_free_root;
      }
      /* Host names compare case-insensitively; "LOCALHOST:1" is "localhost:1". */
      if (strcasecmp(c->servers[j].address, srv->address) == 0) {
        rc = mr_err_set(e, MR_EINVAL,
                        "%s: servers[%zu].address = \"%s\" is also servers[%zu].address", label,
                        i, srv->address, j);
        goto out_free_root;
      }
    }
  }
  c->n_servers = (uint32_t)i;

  const cJSON *jl = cJSON_GetObjectItemCaseSensitive(root, "local");
  if (jl && (rc = cluster_local(jl, label, c, e))) goto out_free_root;

  const cJSON *jt = cJSON_GetObjectItemCaseSensitive(root, "tls");
  if (jt && (rc = cluster_tls(jt, label, c, e))) goto out_free_root;
  const cJSON *jk = cJSON_GetObjectItemCaseSensitive(root, "token_file");
  if (jk && (rc = cluster_str(jk, label, "token_file", c->token_file, sizeof c->token_file, true,
                              e)))
    goto out_free_root;

out_free_root:
  cJSON_Delete(root);
  if (rc) memset(c, 0, sizeof *c);
  return rc;
}

int mr_cluster_load(mr_cluster_file *c, const char *path, mr_err *e) {
  memset(c, 0, sizeof *c);
  return MR__PARSE_FILE(path, mr_cluster_parse, c, e);
}
