/*
 * gc_text.c - text out of produced ids: streaming decode plus stop strings (text.h), and
 * the model's stop ids from generation_config.json.
 */
#include "gpu_client/runner/text.h"

#include "gpu_client/runner/chat_template.h"

#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include <cjson/cJSON.h>

struct gc_text_out {
  gc_tok_stream *st;
  char *stops[GC_TEXT_MAX_STOPS];
  size_t stop_len[GC_TEXT_MAX_STOPS];
  size_t n_stops;
  char *pend;            /* text decoded and not emitted yet */
  size_t pend_len, pend_cap;
  char *emit;            /* the last emitted piece */
  size_t emit_cap;
  bool stopped;
};

int gc_text_out_new(gc_text_out **out, const gc_tok *tok, const char *const *stops, size_t n_stops,
                    bool skip_special, mr_err *e) {
  *out = NULL;
  if (n_stops > GC_TEXT_MAX_STOPS)
    return mr_err_set(e, MR_ERANGE, "stop: %zu strings, at most %u", n_stops, GC_TEXT_MAX_STOPS);
  for (size_t i = 0; i < n_stops; i++) {
    size_t n = stops[i] ? strlen(stops[i]) : 0;
    if (n < 1 || n > GC_TEXT_MAX_STOP_BYTES)
      return mr_err_set(e, MR_ERANGE, "stop[%zu]: %zu bytes, must be 1..%u", i, n, GC_TEXT_MAX_STOP_BYTES);
  }
  gc_text_out *t = mr_calloc(1, sizeof *t);
  if (!t) return mr_err_set(e, MR_ENOMEM, "text output: out of memory");
  int rc = gc_tok_stream_new(tok, skip_special, &t->st, e);
  for (size_t i = 0; !rc && i < n_stops; i++) {
    t->stop_len[i] = strlen(stops[i]);
    if (!(t->stops[i] = mr_malloc(t->stop_len[i] + 1))) rc = mr_err_set(e, MR_ENOMEM, "stop: out of memory");
    else memcpy(t->stops[i], stops[i], t->stop_len[i] + 1);
    t->n_stops = i + 1;
  }
  if (rc) {
    gc_text_out_free(t);
    return rc;
  }
  *out = t;
  return 0;
}

void gc_text_out_free(gc_text_out *t) {
  if (!t) return;
  gc_tok_stream_free(t->st);
  for (size_t i = 0; i < t->n_stops; i++) mr_free(t->stops[i]);
  mr_free(t->pend);
  mr_free(t->emit);
  mr_free(t);
}

static int grow(char **buf, size_t *cap, size_t need, mr_err *e) {
  if (need <= *cap) return 0;
  size_t c = *cap ? *cap : 256;
  while (c < need) c *= 2;
  char *p = mr_realloc(*buf, c);
  if (!p) return mr_err_set(e, MR_ENOMEM, "text output: out of memory");
  *buf = p;
  *cap = c;
  return 0;
}

/* Emits pend[0..n) and keeps the rest pending. */
static int emit_prefix(gc_text_out *t, size_t n, const char **emit, size_t *len, mr_err *e) {
  int rc = grow(&t->emit, &t->emit_cap, n + 1, e);
  if (rc) return rc;
  memcpy(t->emit, t->pend, n);
  t->emit[n] = '\0';
  memmove(t->pend, t->pend + n, t->pend_len - n);
  t->pend_len -= n;
  *emit = t->emit;
  *len = n;
  return 0;
}

/* How much of pend may go out now: everything before the first complete stop (*stop set),
 * else everything but the longest suffix that is a proper prefix of some stop string. */
static size_t safe_len(const gc_text_out *t, bool *stop) {
  *stop = false;
  size_t first = t->pend_len;
  for (size_t i = 0; i < t->n_stops; i++) {
    const size_t L = t->stop_len[i];
    for (size_t p = 0; p + L <= t->pend_len && p < first; p++)
      if (memcmp(t->pend + p, t->stops[i], L) == 0) {
        first = p;
        *stop = true;
        break;
      }
  }
  if (*stop) return first;
  size_t keep = 0;
  for (size_t i = 0; i < t->n_stops; i++) {
    const size_t L = t->stop_len[i];
    for (size_t k = L - 1 < t->pend_len ? L - 1 : t->pend_len; k > keep; k--)
      if (memcmp(t->pend + t->pend_len - k, t->stops[i], k) == 0) {
        keep = k;
        break;
      }
  }
  return t->pend_len - keep;
}

int gc_text_out_feed(gc_text_out *t, int32_t id, const char **emit, size_t *len, bool *stopped, mr_err *e) {
  *emit = "";
  *len = 0;
  *stopped = t->stopped;
  if (t->stopped) return 0;
  const char *piece;
  size_t n;
  int rc = gc_tok_stream_step(t->st, id, &piece, &n, e);
  if (rc) return rc;
  if ((rc = grow(&t->pend, &t->pend_cap, t->pend_len + n + 1, e))) return rc;
  memcpy(t->pend + t->pend_len, piece, n);
  t->pend_len += n;
  bool stop;
  size_t ok = safe_len(t, &stop);
  if ((rc = emit_prefix(t, ok, emit, len, e))) return rc;
  if (stop) {
    t->stopped = true;
    t->pend_len = 0; /* the stop string and anything after it are dropped */
    *stopped = true;
  }
  return 0;
}

int gc_text_out_finish(gc_text_out *t, const char **emit, size_t *len, mr_err *e) {
  *emit = "";
  *len = 0;
  if (t->stopped) return 0;
  const char *piece;
  size_t n;
  int rc = gc_tok_stream_flush(t->st, &piece, &n, e); /* an unfinished UTF-8 tail, as U+FFFD */
  if (rc) return rc;
  if ((rc = grow(&t->pend, &t->pend_cap, t->pend_len + n + 1, e))) return rc;
  memcpy(t->pend + t->pend_len, piece, n);
  t->pend_len += n;
  return emit_prefix(t, t->pend_len, emit, len, e);
}

/* ---- stop ids ------------------------------------------------------------------------------- */

static void add_id(int32_t *ids, size_t cap, size_t *n, int32_t id) {
  for (size_t i = 0; i < *n; i++)
    if (ids[i] == id) return;
  if (*n < cap) ids[(*n)++] = id;
}

/* generation_config.json of model_dir into *root (NULL when there is none); its path in
 * path. A file that does not read or parse is an error naming it. */
static int gen_config(const char *model_dir, char *path, size_t cap, cJSON **root, mr_err *e) {
  *root = NULL;
  struct stat sb;
  if (!model_dir || snprintf(path, cap, "%s/generation_config.json", model_dir) >= (int)cap || stat(path, &sb) != 0)
    return 0;
  char *text = NULL;
  size_t len = 0;
  int rc = mr_file_read(path, MR_JSON_MAX_BYTES, &text, &len, e);
  if (!rc) rc = mr_json_parse_object(text, len, path, root, e);
  mr_free(text);
  return rc;
}

int gc_text_stop_ids(const char *model_dir, const gc_tok *tok, int32_t *ids, size_t cap, size_t *n, mr_err *e) {
  *n = 0;
  const uint32_t V = tok ? gc_tok_vocab_size(tok) : 0;
  char path[4096];
  cJSON *root = NULL;
  int rc = gen_config(model_dir, path, sizeof path, &root, e);
  if (rc) return rc;
  if (root) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, "eos_token_id");
    const cJSON *it;
    if (cJSON_IsNumber(v)) {
      if (v->valuedouble < 0 || (V && v->valuedouble >= V) || v->valuedouble != (double)(int32_t)v->valuedouble)
        rc = mr_err_set(e, MR_EFORMAT, "%s: eos_token_id = %g, must be an id in 0..%u", path, v->valuedouble, V - 1);
      else add_id(ids, cap, n, (int32_t)v->valuedouble);
    } else if (cJSON_IsArray(v)) {
      size_t k = 0;
      cJSON_ArrayForEach(it, v) {
        if (!cJSON_IsNumber(it) || it->valuedouble < 0 || (V && it->valuedouble >= V) ||
            it->valuedouble != (double)(int32_t)it->valuedouble) {
          rc = mr_err_set(e, MR_EFORMAT, "%s: eos_token_id[%zu] is not an id in 0..%u", path, k, V - 1);
          break;
        }
        add_id(ids, cap, n, (int32_t)it->valuedouble);
        k++;
      }
    } else if (v && !cJSON_IsNull(v)) {
      rc = mr_err_set(e, MR_EFORMAT, "%s: eos_token_id must be a number or a list of numbers", path);
    }
    cJSON_Delete(root);
    if (rc) return rc;
  }
  if (tok && gc_tok_eos_id(tok) >= 0) add_id(ids, cap, n, gc_tok_eos_id(tok));
  return 0;
}

int gc_text_sampling(const char *model_dir, gc_sampling *smp, bool *found, mr_err *e) {
  *found = false;
  char path[4096];
  cJSON *root = NULL;
  int rc = gen_config(model_dir, path, sizeof path, &root, e);
  if (rc || !root) return rc;
  const cJSON *ds = cJSON_GetObjectItemCaseSensitive(root, "do_sample");
  const cJSON *t = cJSON_GetObjectItemCaseSensitive(root, "temperature");
  const cJSON *p = cJSON_GetObjectItemCaseSensitive(root, "top_p");
  const cJSON *k = cJSON_GetObjectItemCaseSensitive(root, "top_k");
  if ((t && !cJSON_IsNumber(t)) || (t && !(t->valuedouble >= 0 && t->valuedouble <= 100)))
    rc = mr_err_set(e, MR_EFORMAT, "%s: temperature must be a number in 0..100", path);
  else if ((p && !cJSON_IsNumber(p)) || (p && !(p->valuedouble > 0 && p->valuedouble <= 1)))
    rc = mr_err_set(e, MR_EFORMAT, "%s: top_p must be a number in (0, 1]", path);
  else if ((k && !cJSON_IsNumber(k)) || (k && !(k->valuedouble >= 0 && k->valuedouble <= (1 << 24))))
    rc = mr_err_set(e, MR_EFORMAT, "%s: top_k must be an integer in 0..16777216", path);
  else if (cJSON_IsFalse(ds)) { /* transformers: greedy whatever the rest says */
    smp->temperature = 0;
    *found = true;
  } else {
    if (t) smp->temperature = (float)t->valuedouble;
    if (p) smp->top_p = (float)p->valuedouble;
    if (k) smp->top_k = (uint32_t)k->valuedouble;
    *found = t || p || k;
  }
  cJSON_Delete(root);
  return rc;
}

/* ---- chat prompts ----------------------------------------------------------------------------- */

struct gc_chat {
  gc_tmpl *t;
  char bos[256], eos[256]; /* tokenizer_config.json's bos_token / eos_token ("" = none) */
  bool has_bos, has_eos;
};

/* A special token of tokenizer_config.json: a string, or an AddedToken {"content": ...}. */
static bool special_token(const cJSON *cfg, const char *key, char *out, size_t cap) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(cfg, key);
  if (cJSON_IsObject(v)) v = cJSON_GetObjectItemCaseSensitive(v, "content");
  if (!cJSON_IsString(v) || strlen(v->valuestring) >= cap) return false;
  snprintf(out, cap, "%s", v->valuestring);
  return true;
}

int gc_chat_load(gc_chat **out, const char *model_dir, const char *template_file, mr_err *e) {
  *out = NULL;
  gc_chat *c = mr_calloc(1, sizeof *c);
  if (!c) return mr_err_set(e, MR_ENOMEM, "chat template: out of memory");
  int rc;
  if (template_file) {
    char *text = NULL;
    size_t len = 0;
    rc = mr_file_read(template_file, 4u << 20, &text, &len, e);
    if (!rc) rc = gc_tmpl_compile(&c->t, text, len, template_file, e);
    mr_free(text);
  } else {
    rc = gc_tmpl_load_dir(&c->t, model_dir, NULL, e);
  }
  char path[4096];
  struct stat sb;
  if (!rc && model_dir && snprintf(path, sizeof path, "%s/tokenizer_config.json", model_dir) < (int)sizeof path &&
      stat(path, &sb) == 0) {
    char *text = NULL;
    size_t len = 0;
    cJSON *cfg = NULL;
    rc = mr_file_read(path, MR_JSON_MAX_BYTES, &text, &len, e);
    if (!rc) rc = mr_json_parse_object(text, len, path, &cfg, e);
    mr_free(text);
    if (!rc) {
      c->has_bos = special_token(cfg, "bos_token", c->bos, sizeof c->bos);
      c->has_eos = special_token(cfg, "eos_token", c->eos, sizeof c->eos);
    }
    cJSON_Delete(cfg);
  }
  if (rc) {
    gc_chat_free(c);
    return rc;
  }
  *out = c;
  return 0;
}

void gc_chat_free(gc_chat *c) {
  if (!c) return;
  gc_tmpl_free(c->t);
  mr_free(c);
}

/* One message as transformers hands it to the template (see text.h). */
static int message_norm(const cJSON *m, size_t i, cJSON **out, mr_err *e) {
  *out = NULL;
  if (!cJSON_IsObject(m)) return mr_err_set(e, MR_EINVAL, "messages[%zu]: must be an object", i);
  const cJSON *role = cJSON_GetObjectItemCaseSensitive(m, "role");
  if (!cJSON_IsString(role)) return mr_err_set(e, MR_EINVAL, "messages[%zu].role: must be a string", i);
  cJSON *o = cJSON_CreateObject();
  if (!o) return mr_err_set(e, MR_ENOMEM, "messages: out of memory");
  const cJSON *f;
  cJSON_ArrayForEach(f, m) {
    if (cJSON_IsNull(f)) continue; /* transformers drops keys whose value is None */
    const char *key = f->string;
    if (strcmp(key, "thinking") == 0 || strcmp(key, "reasoning") == 0) key = "reasoning_content";
    if (cJSON_GetObjectItemCaseSensitive(o, key)) continue;
    cJSON *v;
    if (strcmp(key, "content") == 0 && cJSON_IsArray(f)) {
      /* a list of only text parts: one string (the parts concatenated, as OpenAI reads them) */
      bool only_text = true;
      size_t n = 0;
      const cJSON *p;
      cJSON_ArrayForEach(p, f) {
        const cJSON *ty = cJSON_GetObjectItemCaseSensitive(p, "type");
        const cJSON *tx = cJSON_GetObjectItemCaseSensitive(p, "text");
        if (!cJSON_IsString(ty) || strcmp(ty->valuestring, "text") != 0 || !cJSON_IsString(tx)) only_text = false;
        else n += strlen(tx->valuestring);
      }
      if (only_text) {
        char *buf = mr_malloc(n + 1);
        if (!buf) {
          cJSON_Delete(o);
          return mr_err_set(e, MR_ENOMEM, "messages: out of memory");
        }
        size_t at = 0;
        cJSON_ArrayForEach(p, f) {
          const char *tx = cJSON_GetObjectItemCaseSensitive(p, "text")->valuestring;
          memcpy(buf + at, tx, strlen(tx));
          at += strlen(tx);
        }
        buf[at] = '\0';
        v = cJSON_CreateString(buf);
        mr_free(buf);
      } else {
        v = cJSON_Duplicate(f, true);
      }
    } else {
      v = cJSON_Duplicate(f, true);
    }
    if (!v || !cJSON_AddItemToObject(o, key, v)) {
      cJSON_Delete(v);
      cJSON_Delete(o);
      return mr_err_set(e, MR_ENOMEM, "messages: out of memory");
    }
  }
  *out = o;
  return 0;
}

int gc_chat_render(const gc_chat *c, const cJSON *messages, const cJSON *tools, bool add_generation_prompt,
                   const cJSON *extra, char **out, size_t *len, mr_err *e) {
  *out = NULL;
  *len = 0;
  if (!cJSON_IsArray(messages)) return mr_err_set(e, MR_EINVAL, "messages: must be a list");
  cJSON *vars = cJSON_CreateObject(), *msgs = cJSON_CreateArray();
  int rc = 0;
  if (!vars || !msgs || !cJSON_AddItemToObject(vars, "messages", msgs)) {
    cJSON_Delete(msgs);
    rc = mr_err_set(e, MR_ENOMEM, "chat: out of memory");
    goto out;
  }
  size_t i = 0;
  const cJSON *m;
  cJSON_ArrayForEach(m, messages) {
    cJSON *n = NULL;
    if ((rc = message_norm(m, i++, &n, e))) goto out;
    cJSON_AddItemToArray(msgs, n);
  }
  cJSON_AddItemToObject(vars, "tools", tools ? cJSON_Duplicate(tools, true) : cJSON_CreateNull());
  cJSON_AddItemToObject(vars, "documents", cJSON_CreateNull());
  cJSON_AddBoolToObject(vars, "add_generation_prompt", add_generation_prompt);
  if (c->has_bos) cJSON_AddStringToObject(vars, "bos_token", c->bos);
  if (c->has_eos) cJSON_AddStringToObject(vars, "eos_token", c->eos);
  const cJSON *x;
  if (cJSON_IsObject(extra))
    cJSON_ArrayForEach(x, extra) {
      cJSON_DeleteItemFromObjectCaseSensitive(vars, x->string);
      cJSON_AddItemToObject(vars, x->string, cJSON_Duplicate(x, true));
    }
  rc = gc_tmpl_render(c->t, vars, NULL, out, len, e);
out:
  cJSON_Delete(vars);
  return rc;
}
