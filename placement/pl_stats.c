/*
 * placement/pl_stats.c - routing statistics in memory (pl_stats) and the moerpc-stats file
 * (format in pl.h): init, add, reader, writer. `moerpc-place stats`, which collects them from
 * a running cluster, is pl_collect.c.
 *
 * The reader is strict like common's readers: unknown or duplicate keys, a value of the wrong
 * type, a counts matrix of another shape than num_layers x num_experts, and counts that are
 * negative, fractional or beyond 2^53 are refused with the file, the field and the limit.
 * Strict because the files come from other programs (a client's --routing-stats, SGLang
 * imports, hand edits) and feed a planner whose output moves gigabytes: a file misread in
 * silence would plan for the wrong model. The reader is fuzzed (tests/fuzz/fuzz_pl_stats.c,
 * with a round trip through the writer).
 *
 * The writer puts one layer's row per line, so that two files compare with diff and a
 * 61 x 256 file stays readable; what it writes reads back to the same stats.
 */
#include "placement/pl.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* 2^53: the largest integer a JSON number (a double) carries exactly. */
#define PL_STATS_EXACT_MAX ((uint64_t)1 << 53)

void pl_stats_close(pl_stats *s) {
  if (!s) return;
  mr_free(s->counts);
  memset(s, 0, sizeof *s);
}

/* The shape limits of pl.h: layers 1..MR_MAX_LAYERS, experts 1..PL_STATS_MAX_EXPERTS and at
 * most PL_STATS_MAX_PAIRS pairs (32 MiB of counts), checked before the counts are allocated
 * so that a hostile header cannot make the reader allocate more. */
static int stats_shape(uint64_t L, uint64_t E, const char *label, mr_err *e) {
  if (L < 1 || L > MR_MAX_LAYERS)
    return mr_err_set(e, MR_ERANGE, "%s: num_layers = %llu, must be 1..%u", label,
                      (unsigned long long)L, MR_MAX_LAYERS);
  if (E < 1 || E > PL_STATS_MAX_EXPERTS)
    return mr_err_set(e, MR_ERANGE, "%s: num_experts = %llu, must be 1..%u", label,
                      (unsigned long long)E, PL_STATS_MAX_EXPERTS);
  if (L * E > PL_STATS_MAX_PAIRS)
    return mr_err_set(e, MR_ERANGE, "%s: num_layers x num_experts = %llu, at most %u pairs",
                      label, (unsigned long long)(L * E), PL_STATS_MAX_PAIRS);
  return 0;
}

int pl_stats_init(pl_stats *s, uint32_t num_layers, uint32_t num_experts, mr_err *e) {
  memset(s, 0, sizeof *s);
  int rc = stats_shape(num_layers, num_experts, "stats", e);
  if (rc) return rc;
  s->counts = mr_calloc((size_t)num_layers * num_experts, sizeof *s->counts);
  if (!s->counts)
    return mr_err_set(e, MR_ENOMEM, "stats: %u x %u counts: out of memory", num_layers,
                      num_experts);
  s->num_layers = num_layers;
  s->num_experts = num_experts;
  snprintf(s->window_kind, sizeof s->window_kind, "since_reset");
  return 0;
}

int pl_stats_source_add(pl_stats *s, const char *name, mr_err *e) {
  size_t n = strlen(name);
  if (n == 0 || n >= sizeof s->sources[0])
    return mr_err_set(e, MR_ERANGE, "stats: source \"%.64s\" has %zu characters, must be 1..%zu",
                      name, n, sizeof s->sources[0] - 1);
  for (uint32_t i = 0; i < s->n_sources; i++)
    if (strcmp(s->sources[i], name) == 0) return 0; /* listed once */
  if (s->n_sources >= PL_STATS_MAX_SOURCES)
    return mr_err_set(e, MR_ERANGE, "stats: more than %u sources", PL_STATS_MAX_SOURCES);
  memcpy(s->sources[s->n_sources++], name, n + 1);
  return 0;
}

uint64_t pl_stats_total(const pl_stats *s) {
  uint64_t t = 0;
  for (size_t i = 0; i < (size_t)s->num_layers * s->num_experts; i++) t += s->counts[i];
  return t;
}

/* Counts, steps and tokens add (several clients' windows are different traffic); seconds
 * take the larger, since the windows were observed over the same wall-clock time, not one
 * after another. */
int pl_stats_add(pl_stats *dst, const pl_stats *src, mr_err *e) {
  if (dst->num_layers != src->num_layers || dst->num_experts != src->num_experts)
    return mr_err_set(e, MR_EINVAL, "stats: cannot add %u x %u counts to %u x %u (num_layers x "
                      "num_experts differ)", src->num_layers, src->num_experts,
                      dst->num_layers, dst->num_experts);
  for (size_t i = 0; i < (size_t)dst->num_layers * dst->num_experts; i++)
    dst->counts[i] += src->counts[i];
  dst->steps += src->steps;
  dst->tokens += src->tokens;
  if (src->seconds > dst->seconds) dst->seconds = src->seconds;
  for (uint32_t i = 0; i < src->n_sources; i++) {
    int rc = pl_stats_source_add(dst, src->sources[i], e);
    if (rc) return rc;
  }
  return 0;
}

/* ---- reader ------------------------------------------------------------------------------ */

/* A string field into out[cap]: MR_EFORMAT for another type, MR_ERANGE past cap - 1 bytes. */
static int get_string(const cJSON *v, const char *label, const char *field, char *out,
                      size_t cap, mr_err *e) {
  char desc[96];
  if (!cJSON_IsString(v)) {
    mr_json_describe(v, desc, sizeof desc);
    return mr_err_set(e, MR_EFORMAT, "%s: %s = %s, must be a string", label, field, desc);
  }
  size_t n = strlen(v->valuestring);
  if (n >= cap)
    return mr_err_set(e, MR_ERANGE, "%s: %s has %zu characters, at most %zu", label, field, n,
                      cap - 1);
  memcpy(out, v->valuestring, n + 1);
  return 0;
}

/* "window": {"kind" (required, one of three), "steps", "tokens" (integers 0..2^53),
 * "seconds" (finite, >= 0)}; the rest of its keys are refused. */
static int parse_window(pl_stats *s, const cJSON *w, const char *label, mr_err *e) {
  static const char *const keys[] = {"kind", "steps", "tokens", "seconds", NULL};
  char desc[96];
  if (!cJSON_IsObject(w)) {
    mr_json_describe(w, desc, sizeof desc);
    return mr_err_set(e, MR_EFORMAT, "%s: window = %s, must be an object", label, desc);
  }
  int rc = mr_json_check_keys(w, keys, label, "window", e);
  if (rc) return rc;
  const cJSON *k = cJSON_GetObjectItemCaseSensitive(w, "kind");
  if (!k) return mr_err_set(e, MR_EFORMAT, "%s: window.kind is missing", label);
  if ((rc = get_string(k, label, "window.kind", s->window_kind, sizeof s->window_kind, e)))
    return rc;
  if (strcmp(s->window_kind, "steps") != 0 && strcmp(s->window_kind, "since_reset") != 0 &&
      strcmp(s->window_kind, "import") != 0)
    return mr_err_set(e, MR_EINVAL, "%s: window.kind = \"%s\", must be \"steps\", "
                      "\"since_reset\" or \"import\"", label, s->window_kind);
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(w, "steps");
  if (v && (rc = mr_json_u64(v, label, "window.steps", 0, PL_STATS_EXACT_MAX, &s->steps, e)))
    return rc;
  v = cJSON_GetObjectItemCaseSensitive(w, "tokens");
  if (v && (rc = mr_json_u64(v, label, "window.tokens", 0, PL_STATS_EXACT_MAX, &s->tokens, e)))
    return rc;
  v = cJSON_GetObjectItemCaseSensitive(w, "seconds");
  if (v) {
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble) || v->valuedouble < 0) {
      mr_json_describe(v, desc, sizeof desc);
      return mr_err_set(e, MR_ERANGE, "%s: window.seconds = %s, must be a finite number >= 0",
                        label, desc);
    }
    s->seconds = v->valuedouble;
  }
  return 0;
}

/* "sources": up to PL_STATS_MAX_SOURCES non-empty strings of at most 63 bytes. Only
 * informative (where the counts came from), but bounded like everything else. */
static int parse_sources(pl_stats *s, const cJSON *a, const char *label, mr_err *e) {
  char desc[96], field[48];
  if (!cJSON_IsArray(a)) {
    mr_json_describe(a, desc, sizeof desc);
    return mr_err_set(e, MR_EFORMAT, "%s: sources = %s, must be an array of strings", label,
                      desc);
  }
  uint32_t i = 0;
  for (const cJSON *v = a->child; v; v = v->next, i++) {
    if (i >= PL_STATS_MAX_SOURCES)
      return mr_err_set(e, MR_ERANGE, "%s: sources has more than %u entries", label,
                        PL_STATS_MAX_SOURCES);
    snprintf(field, sizeof field, "sources[%u]", i);
    int rc = get_string(v, label, field, s->sources[i], sizeof s->sources[i], e);
    if (rc) return rc;
    if (!s->sources[i][0])
      return mr_err_set(e, MR_EINVAL, "%s: %s is empty, must be 1..%zu characters", label,
                        field, sizeof s->sources[i] - 1);
    s->n_sources = i + 1;
  }
  return 0;
}

/* "counts": exactly num_layers rows of exactly num_experts integers, into s->counts (already
 * allocated from the header's shape). Each error names the cell ("counts[3][17]"). */
static int parse_counts(pl_stats *s, const cJSON *a, const char *label, mr_err *e) {
  char desc[96], field[64];
  if (!cJSON_IsArray(a)) {
    mr_json_describe(a, desc, sizeof desc);
    return mr_err_set(e, MR_EFORMAT, "%s: counts = %s, must be an array of num_layers (%u) "
                      "arrays", label, desc, s->num_layers);
  }
  int rows = cJSON_GetArraySize(a);
  if (rows < 0 || (uint32_t)rows != s->num_layers)
    return mr_err_set(e, MR_EINVAL, "%s: counts has %d rows, must be num_layers = %u", label,
                      rows, s->num_layers);
  uint32_t l = 0;
  for (const cJSON *row = a->child; row; row = row->next, l++) {
    snprintf(field, sizeof field, "counts[%u]", l);
    if (!cJSON_IsArray(row)) {
      mr_json_describe(row, desc, sizeof desc);
      return mr_err_set(e, MR_EFORMAT, "%s: %s = %s, must be an array of num_experts (%u) "
                        "integers", label, field, desc, s->num_experts);
    }
    uint64_t *out = s->counts + (size_t)l * s->num_experts;
    uint32_t x = 0;
    for (const cJSON *v = row->child; v; v = v->next, x++) {
      if (x >= s->num_experts)
        return mr_err_set(e, MR_EINVAL, "%s: %s has more than num_experts = %u numbers", label,
                          field, s->num_experts);
      char cell[64];
      snprintf(cell, sizeof cell, "counts[%u][%u]", l, x);
      int rc = mr_json_u64(v, label, cell, 0, PL_STATS_EXACT_MAX, &out[x], e);
      if (rc) return rc;
    }
    if (x != s->num_experts)
      return mr_err_set(e, MR_EINVAL, "%s: counts[%u] has %u numbers, must be num_experts = %u",
                        label, l, x, s->num_experts);
  }
  return 0;
}

/* Order of the checks: the keys, the format tag, the required keys, then the header
 * (version, shape) before anything is allocated, then the optional fields, then the counts.
 * The first error wins, and *s is left empty. */
int pl_stats_parse(pl_stats *s, const char *json, size_t len, const char *label, mr_err *e) {
  static const char *const keys[] = {"format", "version", "model_fingerprint", "num_layers",
                                     "num_experts", "window", "sources", "counts", NULL};
  memset(s, 0, sizeof *s);
  if (!label) label = "stats";
  cJSON *root = NULL;
  int rc = mr_json_parse_object(json, len, label, &root, e);
  if (rc) return rc;
  if ((rc = mr_json_check_keys(root, keys, label, "top level", e))) goto out;
  const cJSON *it = cJSON_GetObjectItemCaseSensitive(root, "format");
  if (!cJSON_IsString(it) || strcmp(it->valuestring, PL_STATS_FORMAT) != 0) {
    char desc[96];
    mr_json_describe(it, desc, sizeof desc);
    rc = mr_err_set(e, MR_EFORMAT, "%s: format = %s, must be \"%s\"", label, desc,
                    PL_STATS_FORMAT);
    goto out;
  }
  uint64_t v, L, E;
  static const char *const req[] = {"version", "num_layers", "num_experts", "window", "counts"};
  for (size_t i = 0; i < sizeof req / sizeof req[0]; i++)
    if (!cJSON_GetObjectItemCaseSensitive(root, req[i])) {
      rc = mr_err_set(e, MR_EFORMAT, "%s: %s is missing", label, req[i]);
      goto out;
    }
  if ((rc = mr_json_u64(cJSON_GetObjectItemCaseSensitive(root, "version"), label, "version",
                        PL_STATS_VERSION, PL_STATS_VERSION, &v, e)))
    goto out;
  if ((rc = mr_json_u64(cJSON_GetObjectItemCaseSensitive(root, "num_layers"), label,
                        "num_layers", 1, MR_MAX_LAYERS, &L, e)))
    goto out;
  if ((rc = mr_json_u64(cJSON_GetObjectItemCaseSensitive(root, "num_experts"), label,
                        "num_experts", 1, PL_STATS_MAX_EXPERTS, &E, e)))
    goto out;
  if ((rc = stats_shape(L, E, label, e))) goto out;
  s->num_layers = (uint32_t)L;
  s->num_experts = (uint32_t)E;
  it = cJSON_GetObjectItemCaseSensitive(root, "model_fingerprint");
  if (it && (rc = get_string(it, label, "model_fingerprint", s->model_fingerprint,
                             sizeof s->model_fingerprint, e)))
    goto out;
  if ((rc = parse_window(s, cJSON_GetObjectItemCaseSensitive(root, "window"), label, e)))
    goto out;
  it = cJSON_GetObjectItemCaseSensitive(root, "sources");
  if (it && (rc = parse_sources(s, it, label, e))) goto out;
  s->counts = mr_calloc((size_t)L * E, sizeof *s->counts);
  if (!s->counts) {
    rc = mr_err_set(e, MR_ENOMEM, "%s: %llu x %llu counts: out of memory", label,
                    (unsigned long long)L, (unsigned long long)E);
    goto out;
  }
  rc = parse_counts(s, cJSON_GetObjectItemCaseSensitive(root, "counts"), label, e);
out:
  cJSON_Delete(root);
  if (rc) pl_stats_close(s);
  return rc;
}

static int stats_parse_cb(void *ctx, const char *text, size_t len, const char *path, mr_err *e) {
  return pl_stats_parse(ctx, text, len, path, e);
}

int pl_stats_load(pl_stats *s, const char *path, mr_err *e) {
  memset(s, 0, sizeof *s);
  return mr_file_parse(path, MR_JSON_MAX_BYTES, stats_parse_cb, s, e);
}

/* ---- writer ------------------------------------------------------------------------------ */

/* The text is built in an mr_buf (common's growable text buffer, the one /metrics uses),
 * whose out-of-memory is sticky in p.oom instead of failing each append: checked once at
 * the end. */
int pl_stats_format(const pl_stats *s, char **out, size_t *len, mr_err *e) {
  *out = NULL;
  *len = 0;
  mr_buf p;
  mr_buf_init(&p);
  mr_buf_printf(&p, "{\"format\": \"%s\", \"version\": %u,\n \"model_fingerprint\": ",
                 PL_STATS_FORMAT, PL_STATS_VERSION);
  mr_buf_json_str(&p, s->model_fingerprint);
  mr_buf_printf(&p, ", \"num_layers\": %u, \"num_experts\": %u,\n \"window\": {\"kind\": ",
                 s->num_layers, s->num_experts);
  mr_buf_json_str(&p, s->window_kind[0] ? s->window_kind : "since_reset");
  mr_buf_printf(&p, ", \"steps\": %llu, \"tokens\": %llu, \"seconds\": %.17g},\n \"sources\": [",
                 (unsigned long long)s->steps, (unsigned long long)s->tokens,
                 isfinite(s->seconds) && s->seconds >= 0 ? s->seconds : 0.0);
  for (uint32_t i = 0; i < s->n_sources; i++) {
    if (i) mr_buf_append(&p, ", ", 2);
    mr_buf_json_str(&p, s->sources[i]);
  }
  mr_buf_append(&p, "],\n \"counts\": [", 15);
  for (uint32_t l = 0; l < s->num_layers; l++) {
    mr_buf_append(&p, l ? ",\n  [" : "\n  [", l ? 5 : 4);
    const uint64_t *row = s->counts + (size_t)l * s->num_experts;
    for (uint32_t x = 0; x < s->num_experts; x++)
      mr_buf_printf(&p, x ? ",%llu" : "%llu", (unsigned long long)row[x]);
    mr_buf_append(&p, "]", 1);
  }
  mr_buf_append(&p, "]}\n", 3);
  if (p.oom) {
    mr_buf_close(&p);
    return mr_err_set(e, MR_ENOMEM, "stats: %u x %u counts as JSON: out of memory",
                      s->num_layers, s->num_experts);
  }
  *out = p.buf;
  *len = p.len;
  return 0;
}

int pl_stats_save(const pl_stats *s, const char *path, mr_err *e) {
  char *text = NULL;
  size_t len = 0;
  int rc = pl_stats_format(s, &text, &len, e);
  if (rc) return rc;
  rc = mr_file_write_atomic(path, text, len, e);
  mr_free(text);
  return rc;
}
