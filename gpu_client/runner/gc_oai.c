/*
 * gc_oai.c - the OpenAI request parser of serve (serve.h): a request body in, the fields
 * serve acts on out, or an error naming the field and the limit.
 *
 * What is accepted follows OpenAI's API reference, with the extensions the common servers
 * (vLLM, SGLang, llama.cpp's) take and clients send: top_k, chat_template_kwargs, a
 * completions prompt given as token ids. Types are strict where OpenAI's are (a string
 * temperature is refused, not coerced); null stands for "not given" everywhere, as
 * OpenAI's server treats it.
 */
#include "gpu_client/runner/serve.h"

#include <math.h>
#include <string.h>

#include <cjson/cJSON.h>

/* A field error: sets *param and the message. */
#define OAI_ERR(code, field, ...) (*param = (field), mr_err_set(e, (code), __VA_ARGS__))

static const cJSON *field(const cJSON *o, const char *name) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, name);
  return v && !cJSON_IsNull(v) ? v : NULL;
}

static void describe(const cJSON *v, char *buf, size_t n) { mr_json_describe(v, buf, n); }

/* An integer in lo..hi. */
static int get_int(const cJSON *o, const char *name, double lo, double hi, bool *has, double *out, const char **param,
                   mr_err *e) {
  const cJSON *v = field(o, name);
  if (has) *has = v != NULL;
  if (!v) return 0;
  char d[64];
  if (!cJSON_IsNumber(v) || v->valuedouble != floor(v->valuedouble)) {
    describe(v, d, sizeof d);
    return OAI_ERR(MR_EINVAL, name, "%s = %s, must be an integer", name, d);
  }
  if (!(v->valuedouble >= lo && v->valuedouble <= hi))
    return OAI_ERR(MR_ERANGE, name, "%s = %.0f, must be in %.0f..%.0f", name, v->valuedouble, lo, hi);
  *out = v->valuedouble;
  return 0;
}

static int get_num(const cJSON *o, const char *name, double lo, double hi, bool *has, float *out, const char **param,
                   mr_err *e) {
  const cJSON *v = field(o, name);
  *has = v != NULL;
  if (!v) return 0;
  char d[64];
  if (!cJSON_IsNumber(v)) {
    describe(v, d, sizeof d);
    return OAI_ERR(MR_EINVAL, name, "%s = %s, must be a number", name, d);
  }
  if (!(v->valuedouble >= lo && v->valuedouble <= hi))
    return OAI_ERR(MR_ERANGE, name, "%s = %g, must be in %g..%g", name, v->valuedouble, lo, hi);
  *out = (float)v->valuedouble;
  return 0;
}

static int get_bool(const cJSON *o, const char *name, bool *out, const char **param, mr_err *e) {
  const cJSON *v = field(o, name);
  if (!v) return 0;
  if (!cJSON_IsBool(v)) {
    char d[64];
    describe(v, d, sizeof d);
    return OAI_ERR(MR_EINVAL, name, "%s = %s, must be true or false", name, d);
  }
  *out = cJSON_IsTrue(v);
  return 0;
}

/* stop: a string or an array of strings (null entries are not strings: refused). */
static int get_stops(const cJSON *o, gc_oai_req *r, const char **param, mr_err *e) {
  const cJSON *v = field(o, "stop");
  if (!v) return 0;
  const cJSON *one = cJSON_IsString(v) ? v : NULL;
  if (!one && !cJSON_IsArray(v))
    return OAI_ERR(MR_EINVAL, "stop", "stop: must be a string or an array of strings");
  const int n = one ? 1 : cJSON_GetArraySize(v);
  if (n > (int)GC_TEXT_MAX_STOPS)
    return OAI_ERR(MR_ERANGE, "stop", "stop: %d strings, at most %u", n, GC_TEXT_MAX_STOPS);
  for (int i = 0; i < n; i++) {
    const cJSON *s = one ? one : cJSON_GetArrayItem(v, i);
    if (!cJSON_IsString(s)) return OAI_ERR(MR_EINVAL, "stop", "stop[%d]: must be a string", i);
    const size_t len = strlen(s->valuestring);
    if (len == 0 || len > GC_TEXT_MAX_STOP_BYTES)
      return OAI_ERR(MR_ERANGE, "stop", "stop[%d]: %zu bytes, must be 1..%u", i, len, GC_TEXT_MAX_STOP_BYTES);
    r->stops[r->n_stops++] = s->valuestring;
  }
  return 0;
}

/* An array of token ids (0..2^31-1) into r->prompt_ids. */
static int get_ids(const cJSON *a, gc_oai_req *r, const char **param, mr_err *e) {
  const int n = cJSON_GetArraySize(a);
  if (n < 1) return OAI_ERR(MR_EINVAL, "prompt", "prompt: an empty list of token ids");
  if ((uint32_t)n > GC_OAI_MAX_PROMPT_IDS)
    return OAI_ERR(MR_ERANGE, "prompt", "prompt: %d token ids, at most %u", n, GC_OAI_MAX_PROMPT_IDS);
  r->prompt_ids = mr_malloc((size_t)n * sizeof *r->prompt_ids);
  if (!r->prompt_ids) return OAI_ERR(MR_ENOMEM, "prompt", "prompt: out of memory for %d ids", n);
  int i = 0;
  for (const cJSON *v = a->child; v; v = v->next, i++) {
    if (!cJSON_IsNumber(v) || v->valuedouble != floor(v->valuedouble) || v->valuedouble < 0 ||
        v->valuedouble > INT32_MAX)
      return OAI_ERR(MR_EINVAL, "prompt", "prompt[%d]: must be a token id (an integer in 0..%d)", i, INT32_MAX);
    r->prompt_ids[i] = (int32_t)v->valuedouble;
  }
  r->n_prompt_ids = (uint32_t)n;
  return 0;
}

/* prompt: a string, [string], token ids, or [[ids]]: one prompt (n = 1). */
static int get_prompt(const cJSON *o, gc_oai_req *r, const char **param, mr_err *e) {
  const cJSON *v = field(o, "prompt");
  if (!v) return OAI_ERR(MR_EINVAL, "prompt", "prompt: required (a string or a list of token ids)");
  if (cJSON_IsArray(v) && cJSON_GetArraySize(v) == 1 && (cJSON_IsString(v->child) || cJSON_IsArray(v->child)))
    v = v->child; /* a batch of one */
  if (cJSON_IsString(v)) {
    r->prompt = v->valuestring;
    r->prompt_len = strlen(v->valuestring);
    if (r->prompt_len == 0) return OAI_ERR(MR_EINVAL, "prompt", "prompt: empty");
    return 0;
  }
  if (cJSON_IsArray(v) && cJSON_GetArraySize(v) > 1 && (cJSON_IsString(v->child) || cJSON_IsArray(v->child)))
    return OAI_ERR(MR_EINVAL, "prompt", "prompt: %d prompts, this server takes one per request",
                   cJSON_GetArraySize(v));
  if (cJSON_IsArray(v)) return get_ids(v, r, param, e);
  return OAI_ERR(MR_EINVAL, "prompt", "prompt: must be a string or a list of token ids");
}

static int get_messages(const cJSON *o, gc_oai_req *r, const char **param, mr_err *e) {
  const cJSON *v = field(o, "messages");
  if (!v) return OAI_ERR(MR_EINVAL, "messages", "messages: required (an array of {role, content})");
  if (!cJSON_IsArray(v) || cJSON_GetArraySize(v) < 1)
    return OAI_ERR(MR_EINVAL, "messages", "messages: must be a non-empty array");
  int i = 0;
  for (const cJSON *m = v->child; m; m = m->next, i++) {
    if (!cJSON_IsObject(m)) return OAI_ERR(MR_EINVAL, "messages", "messages[%d]: must be an object", i);
    const cJSON *role = cJSON_GetObjectItemCaseSensitive(m, "role");
    if (!cJSON_IsString(role)) return OAI_ERR(MR_EINVAL, "messages", "messages[%d].role: must be a string", i);
    const cJSON *c = cJSON_GetObjectItemCaseSensitive(m, "content");
    if (c && !cJSON_IsNull(c) && !cJSON_IsString(c) && !cJSON_IsArray(c))
      return OAI_ERR(MR_EINVAL, "messages", "messages[%d].content: must be a string, an array of parts or null", i);
    if (cJSON_IsArray(c)) {
      int k = 0;
      for (const cJSON *p = c->child; p; p = p->next, k++) {
        const cJSON *type = cJSON_IsObject(p) ? cJSON_GetObjectItemCaseSensitive(p, "type") : NULL;
        if (!cJSON_IsString(type))
          return OAI_ERR(MR_EINVAL, "messages", "messages[%d].content[%d]: must be an object with a string type", i, k);
        if (strcmp(type->valuestring, "text") == 0 &&
            !cJSON_IsString(cJSON_GetObjectItemCaseSensitive(p, "text")))
          return OAI_ERR(MR_EINVAL, "messages", "messages[%d].content[%d].text: must be a string", i, k);
        if (strcmp(type->valuestring, "text") != 0)
          return OAI_ERR(MR_EINVAL, "messages", "messages[%d].content[%d].type = \"%.32s\": this model takes text "
                         "parts only", i, k, type->valuestring);
      }
    }
  }
  r->messages = v;
  const cJSON *t = field(o, "tools");
  if (t && !cJSON_IsArray(t)) return OAI_ERR(MR_EINVAL, "tools", "tools: must be an array");
  r->tools = t;
  const cJSON *k = field(o, "chat_template_kwargs");
  if (k && !cJSON_IsObject(k)) return OAI_ERR(MR_EINVAL, "chat_template_kwargs", "chat_template_kwargs: must be an object");
  r->template_kwargs = k;
  return 0;
}

static int parse_fields(const cJSON *o, gc_oai_req *r, const char **param, mr_err *e) {
  int rc;
  const cJSON *model = field(o, "model");
  if (model && !cJSON_IsString(model)) return OAI_ERR(MR_EINVAL, "model", "model: must be a string");
  r->model = model ? model->valuestring : NULL;
  if ((rc = r->kind == GC_OAI_CHAT ? get_messages(o, r, param, e) : get_prompt(o, r, param, e))) return rc;
  double d = 0;
  bool has = false;
  if ((rc = get_int(o, "n", 1, 1e9, NULL, &d, param, e))) return rc;
  if (field(o, "n") && d != 1) return OAI_ERR(MR_ERANGE, "n", "n = %.0f: this server makes one choice per request (n = 1)", d);
  if ((rc = get_int(o, "best_of", 1, 1e9, &has, &d, param, e))) return rc;
  if (has && d != 1) return OAI_ERR(MR_ERANGE, "best_of", "best_of = %.0f: only 1 is served", d);
  /* max_completion_tokens (the newer name) wins over max_tokens */
  if ((rc = get_int(o, "max_tokens", 1, GC_OAI_MAX_PROMPT_IDS, &r->has_max_tokens, &d, param, e))) return rc;
  if (r->has_max_tokens) r->max_tokens = (uint32_t)d;
  if ((rc = get_int(o, "max_completion_tokens", 1, GC_OAI_MAX_PROMPT_IDS, &has, &d, param, e))) return rc;
  if (has) {
    r->has_max_tokens = true;
    r->max_tokens = (uint32_t)d;
  }
  if ((rc = get_num(o, "temperature", 0, 2, &r->has_temperature, &r->temperature, param, e))) return rc;
  if ((rc = get_num(o, "top_p", 0, 1, &r->has_top_p, &r->top_p, param, e))) return rc;
  if (r->has_top_p && r->top_p == 0) r->top_p = 1e-9f;
  if ((rc = get_int(o, "top_k", -1, 1 << 24, &r->has_top_k, &d, param, e))) return rc;
  r->top_k = r->has_top_k && d > 0 ? (uint32_t)d : 0;
  if ((rc = get_int(o, "seed", -9223372036854775808.0, 18446744073709551615.0, &r->has_seed, &d, param, e)))
    return rc;
  if (r->has_seed) r->seed = d < 0 ? (uint64_t)(int64_t)d : (uint64_t)d;
  if ((rc = get_stops(o, r, param, e))) return rc;
  if ((rc = get_bool(o, "stream", &r->stream, param, e))) return rc;
  const cJSON *so = field(o, "stream_options");
  if (so && !cJSON_IsObject(so)) return OAI_ERR(MR_EINVAL, "stream_options", "stream_options: must be an object");
  if (so && (rc = get_bool(so, "include_usage", &r->include_usage, param, e))) {
    *param = "stream_options";
    return rc;
  }
  if (so && !r->stream)
    return OAI_ERR(MR_EINVAL, "stream_options", "stream_options: only allowed with stream = true");
  if ((rc = get_bool(o, "ignore_eos", &r->ignore_eos, param, e))) return rc;
  bool echo = false;
  if ((rc = get_bool(o, "echo", &echo, param, e))) return rc;
  if (echo) return OAI_ERR(MR_EINVAL, "echo", "echo = true: not served (the prompt is not returned)");
  if (r->kind == GC_OAI_CHAT) {
    if ((rc = get_bool(o, "logprobs", &r->logprobs, param, e))) return rc;
    if ((rc = get_int(o, "top_logprobs", 0, GC_OAI_MAX_TOP_LOGPROBS, &has, &d, param, e))) return rc;
    if (has && !r->logprobs)
      return OAI_ERR(MR_EINVAL, "top_logprobs", "top_logprobs: needs logprobs = true");
    r->top_logprobs = has ? (uint32_t)d : 0;
  } else {
    if ((rc = get_int(o, "logprobs", 0, GC_OAI_MAX_LOGPROBS, &r->logprobs, &d, param, e))) return rc;
    r->top_logprobs = r->logprobs ? (uint32_t)d : 0;
  }
  return 0;
}

int gc_oai_parse(gc_oai_kind kind, const char *body, size_t len, gc_oai_req *r, const char **param, mr_err *e) {
  const char *p_dummy;
  if (!param) param = &p_dummy;
  *param = "";
  memset(r, 0, sizeof *r);
  r->kind = kind;
  r->top_p = 1.0f;
  r->temperature = 1.0f;
  cJSON *root = NULL;
  int rc = mr_json_parse_object(body ? body : "", body ? len : 0, "request body", &root, e);
  if (rc) return rc;
  r->root = root;
  if ((rc = parse_fields(root, r, param, e))) gc_oai_req_close(r);
  return rc;
}

void gc_oai_req_close(gc_oai_req *r) {
  if (!r) return;
  cJSON_Delete(r->root);
  mr_free(r->prompt_ids);
  memset(r, 0, sizeof *r);
}

/* ---- UTF-8 for JSON strings ------------------------------------------------------------------ */

/* The well-formed UTF-8 sequence at s[0..n) (Unicode's table 3-7): its length, or 0 when
 * it is ill-formed or cut short, with *bad the length of its maximal subpart (the bytes
 * that one U+FFFD replaces, as Python's errors="replace" and Rust's from_utf8_lossy do). */
static size_t utf8_seq(const unsigned char *s, size_t n, size_t *bad) {
  const unsigned c = s[0];
  *bad = 1;
  if (c < 0x80) return 1;
  size_t len;
  unsigned lo = 0x80, hi = 0xBF;
  if (c >= 0xC2 && c <= 0xDF) len = 2;
  else if (c >= 0xE0 && c <= 0xEF) {
    len = 3;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    len = 4;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else
    return 0;
  for (size_t i = 1; i < len; i++) {
    if (i >= n) return 0;
    const unsigned lo_i = i == 1 ? lo : 0x80, hi_i = i == 1 ? hi : 0xBF;
    if (s[i] < lo_i || s[i] > hi_i) return 0;
    *bad = i + 1;
  }
  return len;
}

bool gc_oai_utf8_append(char **out, size_t *len, size_t *cap, const char *s, size_t n) {
  if (*len + n * 3 + 1 > *cap) { /* each byte at most U+FFFD's three */
    size_t c = *cap ? *cap : 64;
    while (c < *len + n * 3 + 1) c *= 2;
    char *p = mr_realloc(*out, c);
    if (!p) return false;
    *out = p;
    *cap = c;
  }
  const unsigned char *u = (const unsigned char *)s;
  for (size_t i = 0; i < n;) {
    size_t bad, k = utf8_seq(u + i, n - i, &bad);
    if (k) {
      memcpy(*out + *len, u + i, k);
      *len += k;
      i += k;
    } else {
      memcpy(*out + *len, "\xEF\xBF\xBD", 3);
      *len += 3;
      i += bad;
    }
  }
  (*out)[*len] = '\0';
  return true;
}
