/*
 * common/json.c - small validating helpers over cJSON shared by the config, cluster and
 * safetensors readers, so that every reader words its errors the same way:
 * "<label>: <field> = <value>, <what was expected>".
 */
#include "common/internal.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

/* 2^53: the largest range in which every integer is exactly representable as a double,
 * and so the largest integer we can trust cJSON to have parsed exactly. */
#define MR__JSON_EXACT_MAX ((uint64_t)1 << 53)

void mr__json_describe(const cJSON *item, char *buf, size_t len) {
  if (!item) {
    snprintf(buf, len, "(missing)");
  } else if (cJSON_IsNumber(item)) {
    snprintf(buf, len, "%.17g", item->valuedouble);
  } else if (cJSON_IsString(item)) {
    /* Long or binary strings are cut and escaped so the message stays one short line. */
    size_t o = 0;
    const unsigned char *s = (const unsigned char *)item->valuestring;
    if (o + 1 < len) buf[o++] = '"';
    for (size_t i = 0; s[i] && o + 8 < len; i++) {
      if (i >= 64) {
        o += (size_t)snprintf(buf + o, len - o, "...");
        break;
      }
      if (s[i] < 0x20 || s[i] == '"' || s[i] == '\\' || s[i] >= 0x7f)
        o += (size_t)snprintf(buf + o, len - o, "\\x%02x", s[i]);
      else
        buf[o++] = (char)s[i];
    }
    if (o + 1 < len) buf[o++] = '"';
    buf[o < len ? o : len - 1] = '\0';
  } else if (cJSON_IsBool(item)) {
    snprintf(buf, len, "%s", cJSON_IsTrue(item) ? "true" : "false");
  } else if (cJSON_IsNull(item)) {
    snprintf(buf, len, "null");
  } else if (cJSON_IsArray(item)) {
    snprintf(buf, len, "an array");
  } else if (cJSON_IsObject(item)) {
    snprintf(buf, len, "an object");
  } else {
    snprintf(buf, len, "an invalid value");
  }
}

int mr__json_u64(const cJSON *item, const char *label, const char *field, uint64_t lo,
                 uint64_t hi, uint64_t *out, mr_err *e) {
  char desc[96];
  if (!cJSON_IsNumber(item)) {
    mr__json_describe(item, desc, sizeof desc);
    return mr_err_set(e, MR_EFORMAT, "%s: %s = %s, must be an integer in %llu..%llu", label,
                      field, desc, (unsigned long long)lo, (unsigned long long)hi);
  }
  double d = item->valuedouble;
  /* isfinite/floor first: casting a NaN or an out-of-range double to an integer is UB. */
  if (!isfinite(d) || d != floor(d) || d < 0 || d > (double)MR__JSON_EXACT_MAX ||
      (uint64_t)d < lo || (uint64_t)d > hi) {
    return mr_err_set(e, MR_ERANGE, "%s: %s = %.17g, must be an integer in %llu..%llu", label,
                      field, d, (unsigned long long)lo, (unsigned long long)hi);
  }
  *out = (uint64_t)d;
  return 0;
}

int mr__json_check_keys(const cJSON *obj, const char *const *allowed, const char *label,
                        const char *where, mr_err *e) {
  for (const cJSON *c = obj->child; c; c = c->next) {
    const char *k = c->string ? c->string : "";
    bool ok = false;
    for (size_t i = 0; allowed[i]; i++)
      if (strcmp(k, allowed[i]) == 0) ok = true;
    if (!ok) {
      char list[256];
      size_t o = 0;
      list[0] = '\0';
      for (size_t i = 0; allowed[i] && o < sizeof list; i++)
        o += (size_t)snprintf(list + o, sizeof list - o, "%s\"%s\"", i ? ", " : "",
                              allowed[i]);
      return mr_err_set(e, MR_EFORMAT, "%s: unknown key \"%.64s\" in %s (allowed: %s)", label, k,
                        where, list);
    }
    /* cJSON keeps duplicate keys and lookups return the first; a second value that is
     * silently ignored is exactly the kind of typo this check exists to catch. */
    for (const cJSON *d = obj->child; d != c; d = d->next)
      if (d->string && strcmp(d->string, k) == 0)
        return mr_err_set(e, MR_EFORMAT, "%s: key \"%.64s\" appears twice in %s", label, k,
                          where);
  }
  return 0;
}

int mr__json_parse(const char *text, size_t len, const char *label, cJSON **out, mr_err *e) {
  *out = NULL;
  const char *end = NULL;
  /* cJSON records every parse's error position in one process-wide variable, written even
   * by successful parses: a data race when two threads parse at once (a server reading
   * its cluster file while another thread opens a model). Parsing is never on a hot path,
   * so one lock makes the readers safe from any thread, as mr.h promises. */
  static pthread_mutex_t parse_lock = PTHREAD_MUTEX_INITIALIZER;
  pthread_mutex_lock(&parse_lock);
  cJSON *root = cJSON_ParseWithLengthOpts(text, len, &end, 0);
  pthread_mutex_unlock(&parse_lock);
  if (!root) {
    /* cJSON reports where it stopped through `end` (its global error pointer is shared by
     * all threads, so it is not used). */
    if (!end || end < text || end > text + len)
      return mr_err_set(e, MR_EFORMAT, "%s: invalid JSON", label);
    size_t off = (size_t)(end - text);
    size_t line = 1;
    for (size_t i = 0; i < off; i++)
      if (text[i] == '\n') line++;
    return mr_err_set(e, MR_EFORMAT, "%s: invalid JSON at byte %zu (line %zu)", label, off,
                      line);
  }
  for (const char *p = end; p && p < text + len; p++) {
    if (*p != ' ' && *p != '\t' && *p != '\n' && *p != '\r') {
      cJSON_Delete(root);
      return mr_err_set(e, MR_EFORMAT, "%s: trailing data after the JSON value at byte %zu",
                        label, (size_t)(p - text));
    }
  }
  *out = root;
  return 0;
}

int mr__json_parse_object(const char *text, size_t len, const char *label, cJSON **out,
                          mr_err *e) {
  int rc = mr__json_parse(text, len, label, out, e);
  if (rc || cJSON_IsObject(*out)) return rc;
  char desc[96];
  mr__json_describe(*out, desc, sizeof desc);
  cJSON_Delete(*out);
  *out = NULL;
  return mr_err_set(e, MR_EFORMAT, "%s: top level is %s, must be a JSON object", label, desc);
}

/* The public face of the helpers above (mr.h), for placement/'s file formats. */
int mr_json_u64(const cJSON *item, const char *label, const char *field, uint64_t lo,
                uint64_t hi, uint64_t *out, mr_err *e) {
  return mr__json_u64(item, label, field, lo, hi, out, e);
}
int mr_json_check_keys(const cJSON *obj, const char *const *allowed, const char *label,
                       const char *where, mr_err *e) {
  return mr__json_check_keys(obj, allowed, label, where, e);
}
int mr_json_parse_object(const char *text, size_t len, const char *label, cJSON **out,
                         mr_err *e) {
  if (len > MR_JSON_MAX_BYTES)
    return mr_err_set(e, MR_ERANGE, "%s: %zu bytes of JSON, at most %zu", label, len,
                      MR_JSON_MAX_BYTES);
  return mr__json_parse_object(text, len, label, out, e);
}
void mr_json_describe(const cJSON *item, char *buf, size_t len) { mr__json_describe(item, buf, len); }
