/*
 * tmpl_cli.c - the chat-template interpreter (gpu_client/runner/chat_template.h) from the
 * command line, for tests/conformance/test_chat_template_jinja.py.
 *
 *   tmpl_cli [--cjson] TEMPLATE CONTEXT.json   renders once: the text on stdout; on error
 *                                              "MR_E...: message" on stderr, exit 2 if the
 *                                              template was refused, 1 if the render failed
 *   tmpl_cli [--cjson] --batch FILE            FILE: line 1 the template as a JSON string,
 *                                              every further line one context (JSON text);
 *                                              the template is compiled once
 *   tmpl_cli --pairs FILE                      FILE: one case a line, the template as a JSON
 *                                              string, a tab, the context (JSON text)
 *
 * Batch output, one record per context, each "<TAG> <name> <len>\n" + len bytes + "\n":
 * TAG OK (name "-", the rendered text), ERR (the error code's name, its message); if the
 * template is refused, one CERR record instead (--pairs: a CERR record for that line).
 * Lengths keep any byte safe.
 * --cjson renders through cJSON (gc_tmpl_render) instead of the JSON text reader.
 */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/mr.h"
#include "gpu_client/runner/chat_template.h"

static char *slurp(const char *path, size_t *len) {
  FILE *f = strcmp(path, "-") == 0 ? stdin : fopen(path, "rb");
  if (!f) return NULL;
  size_t cap = 1 << 16, n = 0;
  char *buf = malloc(cap);
  while (buf) {
    if (n + 1 >= cap) {
      char *g = realloc(buf, cap * 2);
      if (!g) {
        free(buf);
        buf = NULL;
        break;
      }
      buf = g, cap *= 2;
    }
    size_t k = fread(buf + n, 1, cap - n - 1, f);
    if (k == 0) break;
    n += k;
  }
  if (f != stdin) fclose(f);
  if (buf) buf[n] = '\0';
  *len = n;
  return buf;
}

static void record(const char *tag, const char *name, const char *p, size_t n) {
  printf("%s %s %zu\n", tag, name, n);
  fwrite(p, 1, n, stdout);
  putchar('\n');
}

static int render_one(const gc_tmpl *t, const char *ctx, size_t len, bool use_cjson, char **out,
                      size_t *out_len, mr_err *e) {
  if (!use_cjson) return gc_tmpl_render_json(t, ctx, len, NULL, out, out_len, e);
  cJSON *j = cJSON_ParseWithLength(ctx, len);
  if (!j) return mr_err_set(e, MR_EFORMAT, "context: not valid JSON");
  int rc = gc_tmpl_render(t, j, NULL, out, out_len, e);
  cJSON_Delete(j);
  return rc;
}

static int batch(const char *path, bool use_cjson) {
  size_t len;
  char *data = slurp(path, &len);
  if (!data) {
    fprintf(stderr, "tmpl_cli: cannot read %s\n", path);
    return 3;
  }
  char *line = data, *end = data + len;
  char *nl = memchr(line, '\n', (size_t)(end - line));
  size_t l0 = nl ? (size_t)(nl - line) : (size_t)(end - line);
  cJSON *tj = cJSON_ParseWithLength(line, l0);
  if (!cJSON_IsString(tj)) {
    fprintf(stderr, "tmpl_cli: line 1 of %s is not a JSON string\n", path);
    cJSON_Delete(tj);
    free(data);
    return 3;
  }
  gc_tmpl *t = NULL;
  mr_err e;
  if (gc_tmpl_compile(&t, tj->valuestring, strlen(tj->valuestring), "chat_template", &e) != 0) {
    record("CERR", mr_err_name(e.code), e.msg, strlen(e.msg));
  } else {
    for (line = nl ? nl + 1 : end; line < end;) {
      nl = memchr(line, '\n', (size_t)(end - line));
      size_t ll = nl ? (size_t)(nl - line) : (size_t)(end - line);
      if (ll) {
        char *out = NULL;
        size_t out_len = 0;
        if (render_one(t, line, ll, use_cjson, &out, &out_len, &e) == 0)
          record("OK", "-", out, out_len);
        else
          record("ERR", mr_err_name(e.code), e.msg, strlen(e.msg));
        mr_free(out);
      }
      line = nl ? nl + 1 : end;
    }
  }
  gc_tmpl_free(t);
  cJSON_Delete(tj);
  free(data);
  return 0;
}

/* --pairs: a template and a context per line (JSON strings escape tabs, so the first
 * raw tab separates them). */
static int pairs(const char *path) {
  size_t len;
  char *data = slurp(path, &len);
  if (!data) {
    fprintf(stderr, "tmpl_cli: cannot read %s\n", path);
    return 3;
  }
  for (char *line = data, *end = data + len; line < end;) {
    char *nl = memchr(line, '\n', (size_t)(end - line));
    size_t ll = nl ? (size_t)(nl - line) : (size_t)(end - line);
    char *tab = memchr(line, '\t', ll);
    if (ll && tab) {
      cJSON *tj = cJSON_ParseWithLength(line, (size_t)(tab - line));
      gc_tmpl *t = NULL;
      mr_err e;
      char *out = NULL;
      size_t out_len = 0;
      if (!cJSON_IsString(tj)) {
        record("CERR", "MR_EINVAL", "not a JSON string", 17);
      } else if (gc_tmpl_compile(&t, tj->valuestring, strlen(tj->valuestring), "chat_template", &e)) {
        record("CERR", mr_err_name(e.code), e.msg, strlen(e.msg));
      } else if (gc_tmpl_render_json(t, tab + 1, (size_t)(line + ll - tab - 1), NULL, &out, &out_len, &e)) {
        record("ERR", mr_err_name(e.code), e.msg, strlen(e.msg));
      } else {
        record("OK", "-", out, out_len);
      }
      mr_free(out);
      gc_tmpl_free(t);
      cJSON_Delete(tj);
    }
    line = nl ? nl + 1 : end;
  }
  free(data);
  return 0;
}

int main(int argc, char **argv) {
  bool use_cjson = false;
  int a = 1;
  if (a < argc && strcmp(argv[a], "--cjson") == 0) use_cjson = true, a++;
  if (a + 1 < argc && strcmp(argv[a], "--batch") == 0) return batch(argv[a + 1], use_cjson);
  if (a + 1 < argc && strcmp(argv[a], "--pairs") == 0) return pairs(argv[a + 1]);
  if (a + 2 != argc) {
    fprintf(stderr, "usage: tmpl_cli [--cjson] TEMPLATE CONTEXT.json | [--cjson] --batch FILE | "
                    "--pairs FILE\n");
    return 3;
  }
  size_t tl, cl;
  char *src = slurp(argv[a], &tl), *ctx = slurp(argv[a + 1], &cl);
  if (!src || !ctx) {
    fprintf(stderr, "tmpl_cli: cannot read %s\n", !src ? argv[a] : argv[a + 1]);
    free(src);
    free(ctx);
    return 3;
  }
  gc_tmpl *t = NULL;
  mr_err e;
  int rc = 0;
  if (gc_tmpl_compile(&t, src, tl, "chat_template", &e) != 0) {
    fprintf(stderr, "%s: %s\n", mr_err_name(e.code), e.msg);
    rc = 2;
  } else {
    char *out = NULL;
    size_t out_len = 0;
    if (render_one(t, ctx, cl, use_cjson, &out, &out_len, &e) != 0) {
      fprintf(stderr, "%s: %s\n", mr_err_name(e.code), e.msg);
      rc = 1;
    } else {
      fwrite(out, 1, out_len, stdout);
    }
    mr_free(out);
  }
  gc_tmpl_free(t);
  free(src);
  free(ctx);
  return rc;
}
