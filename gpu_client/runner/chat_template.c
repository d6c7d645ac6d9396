/*
 * chat_template.c - the public API of the chat-template interpreter (chat_template.h):
 * compile (normalize, lex, parse), render (read the variables, walk the tree, hand the
 * text over) and finding a checkpoint's template.
 */
#include <cjson/cJSON.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "gpu_client/runner/tmpl_internal.h"

/* The compile heap's budget: the tree of a template of GC_TMPL_MAX_SOURCE bytes fits. */
#define COMPILE_MEMORY ((size_t)256 << 20)
#define ARENA_BLOCK ((size_t)64 << 10)

/* jinja2's first step: every \r\n and \r becomes \n, and one trailing newline goes
 * (keep_trailing_newline=False). */
static char *normalize(const char *src, size_t len, size_t *out_len) {
  char *s = mr_malloc(len + 1);
  if (!s) return NULL;
  size_t o = 0;
  for (size_t i = 0; i < len; i++) {
    if (src[i] == '\r') {
      s[o++] = '\n';
      if (i + 1 < len && src[i + 1] == '\n') i++;
    } else {
      s[o++] = src[i];
    }
  }
  if (o && s[o - 1] == '\n') o--;
  s[o] = '\0';
  *out_len = o;
  return s;
}

int gc_tmpl_compile(gc_tmpl **out, const char *src, size_t len, const char *origin, mr_err *e) {
  mr_err scratch;
  if (!e) e = &scratch;
  mr_err_clear(e);
  *out = NULL;
  if (!origin) origin = "chat_template";
  if (!src && len) return mr_err_set(e, MR_EINVAL, "%s: no template text", origin);
  if (len > GC_TMPL_MAX_SOURCE)
    return mr_err_set(e, MR_ERANGE, "%s: template of %zu bytes, the limit is %zu", origin, len,
                      GC_TMPL_MAX_SOURCE);
  size_t bad;
  if (!gc__tmpl_u8_valid(src ? src : "", len, &bad)) {
    char where[128];
    gc__tmpl_where(origin, src, len, (uint32_t)bad, where, sizeof where);
    return mr_err_set(e, MR_EFORMAT, "%s: invalid UTF-8", where);
  }
  gc_tmpl *t = mr_calloc(1, sizeof *t);
  if (!t) return mr_err_set(e, MR_ENOMEM, "%s: out of memory", origin);
  mr_arena_init(&t->heap.arena, ARENA_BLOCK);
  t->heap.limit = COMPILE_MEMORY;
  t->heap.e = e;
  gc__tmpl_tok *toks = NULL;
  size_t ntoks = 0;
  int rc;
  t->origin = mr_strdup(origin);
  t->src = normalize(src ? src : "", len, &t->len);
  if (!t->src || !t->origin) {
    rc = mr_err_set(e, MR_ENOMEM, "%s: out of memory", origin);
    goto out_free;
  }
  if ((rc = gc__tmpl_lex(t, &toks, &ntoks, e))) goto out_free;
  rc = gc__tmpl_parse(t, toks, ntoks, e);
  mr_free(toks);
  if (rc) goto out_free;
  t->heap.e = &t->heap_err; /* nothing allocates from it after compile */
  *out = t;
  return 0;
out_free:
  gc_tmpl_free(t);
  return rc;
}

void gc_tmpl_free(gc_tmpl *t) {
  if (!t) return;
  mr_arena_close(&t->heap.arena);
  mr_free(t->src);
  mr_free(t->origin);
  mr_free(t);
}

typedef int (*load_fn)(gc__tmpl_heap *h, const void *src, size_t len, gc__tmpl_val *out);

static int load_cjson(gc__tmpl_heap *h, const void *src, size_t len, gc__tmpl_val *out) {
  (void)len;
  return gc__tmpl_from_cjson(h, src, out);
}

static int load_text(gc__tmpl_heap *h, const void *src, size_t len, gc__tmpl_val *out) {
  return gc__tmpl_json_parse(h, src, len, out);
}

/* One render: limits with their defaults, a fresh heap with the memory budget, the
 * variables read into it, the tree walked into an output buffer that becomes the
 * caller's string; the heap goes whatever happened. */
static int render(const gc_tmpl *t, load_fn load, const void *src, size_t len,
                  const gc_tmpl_limits *limits, char **out, size_t *out_len, mr_err *e) {
  mr_err scratch;
  if (!e) e = &scratch;
  mr_err_clear(e);
  *out = NULL;
  if (out_len) *out_len = 0;
  if (!t) return mr_err_set(e, MR_EINVAL, "no template");
  gc_tmpl_limits lim = limits ? *limits : (gc_tmpl_limits){0};
  if (!lim.max_output) lim.max_output = GC_TMPL_DEFAULT_MAX_OUTPUT;
  if (!lim.max_memory) lim.max_memory = GC_TMPL_DEFAULT_MAX_MEMORY;
  if (!lim.max_steps) lim.max_steps = GC_TMPL_DEFAULT_MAX_STEPS;
  if (!lim.max_depth) lim.max_depth = GC_TMPL_DEFAULT_MAX_DEPTH;
  gc__tmpl_heap h = {.limit = lim.max_memory, .e = e};
  mr_arena_init(&h.arena, ARENA_BLOCK);
  gc__tmpl_sb sb;
  gc__tmpl_sb_init(&sb, lim.max_output, "output", e);
  gc__tmpl_val vars = {.kind = GC__TV_UNDEF};
  int rc = src ? load(&h, src, len, &vars) : 0;
  if (!rc && src && vars.kind != GC__TV_DICT)
    rc = mr_err_set(e, MR_EINVAL, "variables: a JSON object expected, got %s",
                    gc__tmpl_type_name(&vars));
  if (!rc) rc = gc__tmpl_run(t, vars, &lim, &h, &sb, e);
  if (!rc && !sb.p) { /* an empty rendering still gets its own buffer */
    sb.p = mr_malloc(1);
    if (!sb.p)
      rc = mr_err_set(e, MR_ENOMEM, "out of memory");
    else
      sb.p[0] = '\0';
  }
  if (!rc) {
    *out = sb.p;
    if (out_len) *out_len = sb.n;
  } else {
    gc__tmpl_sb_free(&sb);
  }
  mr_arena_close(&h.arena);
  return rc;
}

int gc_tmpl_render(const gc_tmpl *t, const struct cJSON *vars, const gc_tmpl_limits *limits,
                   char **out, size_t *out_len, mr_err *e) {
  return render(t, load_cjson, vars, 0, limits, out, out_len, e);
}

int gc_tmpl_render_json(const gc_tmpl *t, const char *json, size_t len,
                        const gc_tmpl_limits *limits, char **out, size_t *out_len, mr_err *e) {
  if (!json) {
    if (!e) return MR_EINVAL;
    return mr_err_set(e, MR_EINVAL, "variables: no JSON text");
  }
  return render(t, load_text, json, len, limits, out, out_len, e);
}

/* ---- checkpoint directories ----------------------------------------------------------- */

/* Reads a whole file (at most GC_TMPL_MAX_SOURCE * 8 bytes) into a new buffer. MR_ENOTFOUND
 * if it does not exist. */
static int read_file(const char *path, char **data, size_t *len, mr_err *e) {
  FILE *f = fopen(path, "rb");
  if (!f) {
    if (errno == ENOENT) return MR_ENOTFOUND;
    return mr_err_set(e, MR_EIO, "%s: %s", path, strerror(errno));
  }
  struct stat st;
  if (fstat(fileno(f), &st) != 0 || st.st_size < 0 || (size_t)st.st_size > GC_TMPL_MAX_SOURCE * 8) {
    fclose(f);
    return mr_err_set(e, MR_ERANGE, "%s: cannot stat, or larger than %zu bytes", path,
                      GC_TMPL_MAX_SOURCE * 8);
  }
  size_t n = (size_t)st.st_size;
  char *buf = mr_malloc(n + 1);
  if (!buf) {
    fclose(f);
    return mr_err_set(e, MR_ENOMEM, "%s: out of memory", path);
  }
  if (fread(buf, 1, n, f) != n) {
    fclose(f);
    mr_free(buf);
    return mr_err_set(e, MR_EIO, "%s: short read", path);
  }
  fclose(f);
  buf[n] = '\0';
  *data = buf, *len = n;
  return 0;
}

int gc_tmpl_load_dir(gc_tmpl **out, const char *dir, const char *name, mr_err *e) {
  mr_err scratch;
  if (!e) e = &scratch;
  mr_err_clear(e);
  *out = NULL;
  bool dflt = !name || strcmp(name, "default") == 0;
  if (!dflt && (strchr(name, '/') || strstr(name, "..")))
    return mr_err_set(e, MR_EINVAL, "template name \"%s\" is not a plain name", name);
  char path[4096];
  char *data = NULL;
  size_t len = 0;
  if (dflt)
    snprintf(path, sizeof path, "%s/chat_template.jinja", dir);
  else
    snprintf(path, sizeof path, "%s/additional_chat_templates/%s.jinja", dir, name);
  int rc = read_file(path, &data, &len, e);
  if (rc == 0) {
    rc = gc_tmpl_compile(out, data, len, path, e);
    mr_free(data);
    return rc;
  }
  if (rc != MR_ENOTFOUND) return rc;
  /* tokenizer_config.json's "chat_template": a string, or a list of named templates. */
  snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
  rc = read_file(path, &data, &len, e);
  if (rc == MR_ENOTFOUND)
    return mr_err_set(e, MR_ENOTFOUND, "%s: no chat_template.jinja and no tokenizer_config.json", dir);
  if (rc) return rc;
  cJSON *j = cJSON_ParseWithLength(data, len);
  mr_free(data);
  if (!j) return mr_err_set(e, MR_EFORMAT, "%s: not valid JSON", path);
  const cJSON *ct = cJSON_GetObjectItemCaseSensitive(j, "chat_template");
  const char *text = NULL;
  char origin[4200];
  snprintf(origin, sizeof origin, "%s:chat_template", path);
  if (cJSON_IsString(ct) && dflt) {
    text = ct->valuestring;
  } else if (cJSON_IsArray(ct)) {
    const cJSON *it;
    cJSON_ArrayForEach(it, ct) {
      const cJSON *nm = cJSON_GetObjectItemCaseSensitive(it, "name");
      const cJSON *tp = cJSON_GetObjectItemCaseSensitive(it, "template");
      if (cJSON_IsString(nm) && cJSON_IsString(tp) && strcmp(nm->valuestring, dflt ? "default" : name) == 0) {
        text = tp->valuestring;
        snprintf(origin, sizeof origin, "%s:chat_template[%s]", path, nm->valuestring);
        break;
      }
    }
  }
  if (!text) {
    rc = mr_err_set(e, MR_ENOTFOUND, "%s: no chat template named \"%s\"", path, dflt ? "default" : name);
  } else {
    rc = gc_tmpl_compile(out, text, strlen(text), origin, e);
  }
  cJSON_Delete(j);
  return rc;
}
