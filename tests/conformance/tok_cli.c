/*
 * tok_cli.c - runs the tokenizer (gpu_client/runner/tokenizer.h) over lines of text, so that
 * tests/conformance/test_tokenizer_hf.py can compare it with the `tokenizers` package and
 * tests/bench/bench_tokenizer.py can time it.
 *
 *   tok_cli [-0] PATH run < lines   one JSON object per input line:
 *       {"ids": [...],        encode(line, add_special_tokens=false)
 *        "ids_sp": [...],     encode(line, add_special_tokens=true)
 *        "dec": "...",        decode(ids, skip_special_tokens=false)
 *        "dec_skip": "...",   decode(ids, skip_special_tokens=true)
 *        "stream": "..."}     the streaming decoder's steps + flush over ids, concatenated
 *   tok_cli PATH decode < lines  each line a JSON array of ids -> {"dec": "...", "dec_skip":
 *                                "...", "stream": "..."}
 *   tok_cli PATH bench [REPEAT] < lines   encodes every line REPEAT times (default 3) on one
 *       thread; prints {"bytes": B, "lines": L, "seconds": S, "mb_per_s": X} for the best
 *       repetition (encode only, reading and writing excluded)
 *   tok_cli PATH info        {"vocab_size": N, "bos": id, "eos": id, "describe": "..."}
 *
 * PATH is what gc_tok_load takes (a model directory, a tokenizer.json, a tiktoken.model).
 * Lines are split on '\n' only (with -0 first: on NUL bytes, so that a record may hold
 * newlines) and passed as raw bytes (invalid UTF-8 included); a final record without a
 * separator counts. Exit status 0, or 1 with the error on stderr.
 */
#include "gpu_client/runner/tokenizer.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static void json_str(FILE *f, const char *s, size_t n) {
  fputc('"', f);
  for (size_t i = 0; i < n; i++) {
    unsigned char c = (unsigned char)s[i];
    if (c == '"' || c == '\\') fprintf(f, "\\%c", c);
    else if (c < 0x20 || c == 0x7f) fprintf(f, "\\u%04x", c);
    else fputc(c, f);
  }
  fputc('"', f);
}

static void json_ids(FILE *f, const gc_tok_ids *v) {
  fputc('[', f);
  for (size_t i = 0; i < v->n; i++) fprintf(f, "%s%d", i ? "," : "", v->v[i]);
  fputc(']', f);
}

/* Reads all of stdin. */
static char *slurp(size_t *len) {
  size_t cap = 1 << 20, n = 0;
  char *p = malloc(cap);
  if (!p) return NULL;
  for (;;) {
    if (n == cap) {
      char *q = realloc(p, cap *= 2);
      if (!q) {
        free(p);
        return NULL;
      }
      p = q;
    }
    size_t r = fread(p + n, 1, cap - n, stdin);
    if (r == 0) break;
    n += r;
  }
  *len = n;
  return p;
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* The three decodings of ids, as JSON fields. */
static int put_decodes(const gc_tok *t, gc_tok_stream *st, const gc_tok_ids *ids, gc_tok_text *tx,
                       mr_err *e) {
  if (gc_tok_decode(t, ids->v, ids->n, false, tx, e)) return 1;
  fputs("\"dec\":", stdout);
  json_str(stdout, tx->s, tx->len);
  if (gc_tok_decode(t, ids->v, ids->n, true, tx, e)) return 1;
  fputs(",\"dec_skip\":", stdout);
  json_str(stdout, tx->s, tx->len);
  /* The stream with skip_special_tokens = false, glued back together. */
  gc_tok_text all = {0};
  const char *s;
  size_t n;
  all.s = malloc(1);
  all.s[0] = 0;
  for (size_t i = 0; i <= ids->n; i++) {
    int rc = i < ids->n ? gc_tok_stream_step(st, ids->v[i], &s, &n, e)
                        : gc_tok_stream_flush(st, &s, &n, e);
    if (rc) return 1;
    char *g = realloc(all.s, all.len + n + 1);
    if (!g) return 1;
    all.s = g;
    memcpy(all.s + all.len, s, n);
    all.len += n;
    all.s[all.len] = 0;
  }
  fputs(",\"stream\":", stdout);
  json_str(stdout, all.s, all.len);
  free(all.s);
  return 0;
}

/* A line "[1, 2, 3]" into ids. */
static int parse_ids(const char *s, size_t n, gc_tok_ids *out) {
  out->n = 0;
  size_t i = 0;
  while (i < n && s[i] != '[') i++;
  for (i++; i < n;) {
    while (i < n && (s[i] == ' ' || s[i] == ',')) i++;
    if (i >= n || s[i] == ']') break;
    char *end;
    long v = strtol(s + i, &end, 10);
    if (end == s + i) return 1;
    if (out->n == out->cap) {
      size_t cap = out->cap ? out->cap * 2 : 64;
      int32_t *p = realloc(out->v, cap * sizeof *p);
      if (!p) return 1;
      out->v = p;
      out->cap = cap;
    }
    out->v[out->n++] = (int32_t)v;
    i = (size_t)(end - s);
  }
  return 0;
}

int main(int argc, char **argv) {
  char sep = '\n';
  if (argc > 1 && strcmp(argv[1], "-0") == 0) {
    sep = '\0';
    argv++;
    argc--;
  }
  if (argc < 3) {
    fprintf(stderr, "usage: tok_cli [-0] PATH run|decode|bench [REPEAT]|info < lines\n");
    return 1;
  }
  mr_err e = {0};
  gc_tok *t;
  if (gc_tok_load(&t, argv[1], &e)) {
    fprintf(stderr, "tok_cli: %s\n", e.msg);
    return 1;
  }
  const char *mode = argv[2];
  int rc = 0;
  if (strcmp(mode, "info") == 0) {
    printf("{\"vocab_size\":%u,\"bos\":%d,\"eos\":%d,\"describe\":", gc_tok_vocab_size(t),
           gc_tok_bos_id(t), gc_tok_eos_id(t));
    json_str(stdout, gc_tok_describe(t), strlen(gc_tok_describe(t)));
    printf("}\n");
    gc_tok_free(t);
    return 0;
  }
  size_t len;
  char *in = slurp(&len);
  if (!in) {
    fprintf(stderr, "tok_cli: cannot read stdin\n");
    gc_tok_free(t);
    return 1;
  }
  /* Line starts and lengths. */
  size_t nl = 0, cap = 1024;
  size_t *ls = malloc(cap * sizeof *ls), *ll = malloc(cap * sizeof *ll);
  for (size_t i = 0; i < len;) {
    size_t j = i;
    while (j < len && in[j] != sep) j++;
    if (nl == cap) {
      cap *= 2;
      ls = realloc(ls, cap * sizeof *ls);
      ll = realloc(ll, cap * sizeof *ll);
    }
    ls[nl] = i;
    ll[nl++] = j - i;
    i = j + 1;
  }
  gc_tok_ids ids = {0}, ids2 = {0};
  gc_tok_text tx = {0};
  gc_tok_stream *st = NULL;
  if (gc_tok_stream_new(t, false, &st, &e)) {
    rc = 1;
    goto out;
  }
  if (strcmp(mode, "run") == 0) {
    for (size_t k = 0; k < nl && !rc; k++) {
      if (gc_tok_encode(t, in + ls[k], ll[k], false, &ids, &e) ||
          gc_tok_encode(t, in + ls[k], ll[k], true, &ids2, &e)) {
        rc = 1;
        break;
      }
      fputs("{\"ids\":", stdout);
      json_ids(stdout, &ids);
      fputs(",\"ids_sp\":", stdout);
      json_ids(stdout, &ids2);
      fputc(',', stdout);
      rc = put_decodes(t, st, &ids, &tx, &e);
      fputs("}\n", stdout);
    }
  } else if (strcmp(mode, "decode") == 0) {
    for (size_t k = 0; k < nl && !rc; k++) {
      if (parse_ids(in + ls[k], ll[k], &ids)) {
        fprintf(stderr, "tok_cli: line %zu is not a JSON array of ids\n", k + 1);
        rc = 1;
        break;
      }
      fputc('{', stdout);
      rc = put_decodes(t, st, &ids, &tx, &e);
      fputs("}\n", stdout);
    }
  } else if (strcmp(mode, "bench") == 0) {
    int rep = argc > 3 ? atoi(argv[3]) : 3;
    double best = 1e30;
    size_t bytes = 0, tokens = 0;
    for (size_t k = 0; k < nl; k++) bytes += ll[k];
    for (int r = 0; r < (rep > 0 ? rep : 1) && !rc; r++) {
      double t0 = now_s();
      tokens = 0;
      for (size_t k = 0; k < nl; k++) {
        if (gc_tok_encode(t, in + ls[k], ll[k], false, &ids, &e)) {
          rc = 1;
          break;
        }
        tokens += ids.n;
      }
      double dt = now_s() - t0;
      if (dt < best) best = dt;
    }
    if (!rc)
      printf("{\"bytes\":%zu,\"lines\":%zu,\"tokens\":%zu,\"seconds\":%.6f,\"mb_per_s\":%.3f}\n",
             bytes, nl, tokens, best, (double)bytes / 1e6 / best);
  } else {
    fprintf(stderr, "tok_cli: unknown mode %s\n", mode);
    rc = 1;
  }
out:
  if (rc && e.msg[0]) fprintf(stderr, "tok_cli: %s\n", e.msg);
  gc_tok_stream_free(st);
  gc_tok_ids_close(&ids);
  gc_tok_ids_close(&ids2);
  gc_tok_text_close(&tx);
  free(ls);
  free(ll);
  free(in);
  gc_tok_free(t);
  return rc;
}
