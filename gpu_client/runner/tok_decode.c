/*
 * tok_decode.c - ids to text: HF's decoder chain run as a streaming machine.
 *
 * HF decodes a whole list at once: ids -> token strings (skipping special ones if asked) ->
 * each decoder of the Sequence maps the list of strings to a new list -> join. The decoders
 * the supported families use fall in two kinds:
 *
 *   per token      Replace, Metaspace, Strip, ByteFallback (which joins runs of <0xNN>
 *                  tokens): each output depends on the token and a little state (the
 *                  token's index, the pending byte run);
 *   collapse       ByteLevel (all tokens' bytes, then one lossy UTF-8 decoding) and Fuse
 *                  (join): after one of these the list is a single string, so the decoders
 *                  that follow act on the whole text; only Strip and Fuse are accepted there
 *                  (tok_json.c), and Strip on the whole text streams: leading chars are
 *                  dropped as they come, trailing ones held until a later char shows they
 *                  are not trailing.
 *
 *   id -> piece -> [per-token stages...] -> collapse -> [whole-text stages...] -> text
 *
 * Pushing each id through this chain as it arrives and flushing at the end gives exactly
 * the whole-list result, so gc_tok_decode is the stream run over all ids plus a flush,
 * and the streaming API cannot drift from it. What a stage cannot decide yet stays inside
 * it: a run of byte tokens (ByteFallback), the bytes of an unfinished UTF-8 sequence (the
 * lossy decoder after ByteLevel), trailing Strip chars.
 */
#include "gpu_client/runner/tok_internal.h"

#include <string.h>

struct gc_tok_stream {
  const gc_tok *tok;
  bool skip_special;
  uint32_t n_pre;          /* per-token stages before the collapse (dec[0 .. n_pre)) */
  int collapse;            /* GC__D_BYTELEVEL, GC__D_FUSE, or -1 (HF's final join) */
  uint64_t n_tokens;       /* tokens that reached the end without a decoder (join " ") */
  uint64_t *seen;          /* [n_dec] tokens each stage has received (Metaspace's rule) */
  gc__tok_buf *scratch;    /* [n_dec] each stage's output buffer */
  gc__tok_buf *group;      /* [n_dec] ByteFallback's pending bytes */
  uint32_t *lead_left;     /* [n_dec] whole-text Strip: leading chars still to drop */
  uint32_t *held;          /* [n_dec] whole-text Strip: trailing content chars held */
  gc__tok_lossy lossy;     /* after ByteLevel */
  gc__tok_buf bytes;       /* ByteLevel's bytes of one token */
  gc__tok_buf utf8;        /* the lossy decoder's output */
  gc__tok_matches m;
  OnigRegion *region;
  gc__tok_buf *out;        /* where text goes: own (steps) or the caller's (decode) */
  gc__tok_buf own;
};

static int text_stage(gc_tok_stream *s, uint32_t i, const char *t, size_t n);

/* ---------------------------------------------------------------------------------------
 * Whole-text stages (after the collapse).
 */
static int put_cp_n(gc__tok_buf *b, uint32_t cp, uint32_t times) {
  char u[4];
  size_t l = gc__tok_utf8_encode(cp, u);
  for (uint32_t k = 0; k < times; k++)
    if (gc__tok_buf_put(b, u, l)) return MR_ENOMEM;
  return 0;
}

static int text_stage(gc_tok_stream *s, uint32_t i, const char *t, size_t n) {
  const gc_tok *tok = s->tok;
  while (i < tok->n_dec && tok->dec[i].kind == GC__D_FUSE) i++; /* a no-op on one string */
  if (i >= tok->n_dec) return gc__tok_buf_put(s->out, t, n);
  const gc__tok_dec *d = &tok->dec[i];
  MR_ASSERT(d->kind == GC__D_STRIP);
  gc__tok_buf *o = &s->scratch[i];
  o->n = 0;
  for (size_t k = 0; k < n;) {
    size_t l;
    uint32_t cp = gc__tok_utf8_decode(t + k, n - k, &l);
    if (s->lead_left[i] > 0) {
      if (cp == d->cp) {
        s->lead_left[i]--;
        k += l;
        continue;
      }
      s->lead_left[i] = 0;
    }
    if (d->stop > 0 && cp == d->cp) {
      s->held[i]++;
    } else {
      if (s->held[i] && put_cp_n(o, d->cp, s->held[i])) return MR_ENOMEM;
      s->held[i] = 0;
      if (gc__tok_buf_put(o, t + k, l)) return MR_ENOMEM;
    }
    k += l;
  }
  /* The next stage may use its own scratch; ours stays intact until it returns. */
  return o->n ? text_stage(s, i + 1, o->p, o->n) : 0;
}

static int text_end(gc_tok_stream *s, uint32_t i) {
  const gc_tok *tok = s->tok;
  for (; i < tok->n_dec; i++) {
    const gc__tok_dec *d = &tok->dec[i];
    if (d->kind != GC__D_STRIP) continue;
    uint32_t keep = s->held[i] > d->stop ? s->held[i] - d->stop : 0;
    s->held[i] = 0;
    if (keep) {
      gc__tok_buf *o = &s->scratch[i];
      o->n = 0;
      if (put_cp_n(o, d->cp, keep)) return MR_ENOMEM;
      int rc = text_stage(s, i + 1, o->p, o->n);
      if (rc) return rc;
    }
  }
  return 0;
}

/* ---------------------------------------------------------------------------------------
 * The collapse.
 */
static int collapse_feed(gc_tok_stream *s, const char *t, size_t n) {
  const gc_tok *tok = s->tok;
  uint32_t next = s->n_pre + 1;
  if (s->collapse == GC__D_BYTELEVEL) {
    /* A token whose chars are all byte chars gives those bytes; any other token gives
     * its own UTF-8 (HF: try_fold ... unwrap_or_else(as_bytes)). */
    int rc;
    s->bytes.n = 0;
    if (!gc__tok_bl_to_bytes(t, n, &s->bytes, &rc)) {
      if (rc) return rc;
      if (gc__tok_buf_put(&s->bytes, t, n)) return MR_ENOMEM;
    }
    s->utf8.n = 0;
    if (gc__tok_lossy_feed(&s->lossy, s->bytes.p, s->bytes.n, &s->utf8)) return MR_ENOMEM;
    return s->utf8.n ? text_stage(s, next, s->utf8.p, s->utf8.n) : 0;
  }
  if (s->collapse == GC__D_FUSE) return n ? text_stage(s, next, t, n) : 0;
  /* No collapse stage: HF joins the final list, with "" when there is a decoder and " "
   * when there is none. */
  if (!tok->has_decoder && s->n_tokens++ > 0 && gc__tok_buf_put(s->out, " ", 1))
    return MR_ENOMEM;
  return gc__tok_buf_put(s->out, t, n);
}

static int collapse_end(gc_tok_stream *s) {
  if (s->collapse == GC__D_BYTELEVEL) {
    s->utf8.n = 0;
    if (gc__tok_lossy_end(&s->lossy, &s->utf8)) return MR_ENOMEM;
    if (s->utf8.n) {
      int rc = text_stage(s, s->n_pre + 1, s->utf8.p, s->utf8.n);
      if (rc) return rc;
    }
  }
  return s->collapse >= 0 ? text_end(s, s->n_pre + 1) : 0;
}

/* ---------------------------------------------------------------------------------------
 * Per-token stages.
 */
static int token_stage(gc_tok_stream *s, uint32_t i, const char *t, size_t n);

/* "<0xNN>": HF reads token[3..5] with u8::from_str_radix(_, 16), which also takes a '+'
 * sign ("<0x+A>" is byte 10). */
static int byte_token(const char *t, size_t n) {
  if (n != 6 || memcmp(t, "<0x", 3) != 0 || t[5] != '>') return -1;
  int v = 0;
  for (int k = 3; k < 5; k++) {
    char c = t[k];
    int d;
    if (k == 3 && c == '+') continue;
    if (c >= '0' && c <= '9') d = c - '0';
    else if (c >= 'a' && c <= 'f') d = c - 'a' + 10;
    else if (c >= 'A' && c <= 'F') d = c - 'A' + 10;
    else return -1;
    v = v * 16 + d;
  }
  return v;
}

/* Ends ByteFallback i's run: valid UTF-8 goes on as one token, else one U+FFFD token per
 * byte (HF's rule, not the maximal-subpart one). */
static int group_end(gc_tok_stream *s, uint32_t i) {
  gc__tok_buf *g = &s->group[i];
  if (g->n == 0) return 0;
  int rc = 0;
  size_t n = g->n;
  g->n = 0; /* the run is over before anything downstream runs */
  if (gc__tok_utf8_valid_prefix(g->p, n) == n) {
    rc = token_stage(s, i + 1, g->p, n);
  } else {
    for (size_t k = 0; k < n && !rc; k++) rc = token_stage(s, i + 1, GC__TOK_REPL, 3);
  }
  return rc;
}

static int token_stage(gc_tok_stream *s, uint32_t i, const char *t, size_t n) {
  if (i == s->n_pre) return collapse_feed(s, t, n);
  const gc__tok_dec *d = &s->tok->dec[i];
  gc__tok_buf *o = &s->scratch[i];
  uint64_t idx = s->seen[i]++;
  int rc;
  switch (d->kind) {
  case GC__D_REPLACE:
    if ((rc = gc__tok_re_find(d->re, s->region, t, n, &s->m, NULL))) return rc;
    o->n = 0;
    for (size_t k = 0; k < s->m.n; k++) {
      const gc__tok_match *x = &s->m.v[k];
      if (x->m ? gc__tok_buf_put(o, d->content, d->content_len)
               : gc__tok_buf_put(o, t + x->s, x->e - x->s))
        return MR_ENOMEM;
    }
    if (!o->p && gc__tok_buf_put(o, "", 0)) return MR_ENOMEM;
    return token_stage(s, i + 1, o->p, o->n);
  case GC__D_METASPACE:
    o->n = 0;
    if (gc__tok_buf_reserve(o, n)) return MR_ENOMEM;
    for (size_t k = 0; k < n;) {
      size_t l;
      uint32_t cp = gc__tok_utf8_decode(t + k, n - k, &l);
      if (cp != d->cp) {
        if (gc__tok_buf_put(o, t + k, l)) return MR_ENOMEM;
      } else if (!(idx == 0 && d->drop_first) && gc__tok_buf_put(o, " ", 1)) {
        return MR_ENOMEM;
      }
      k += l;
    }
    return token_stage(s, i + 1, o->p, o->n);
  case GC__D_STRIP: {
    /* Up to `start` leading and `stop` trailing content chars, counted in chars. */
    size_t a = 0, b = n;
    for (uint32_t k = 0; k < d->start && a < n; k++) {
      size_t l;
      if (gc__tok_utf8_decode(t + a, n - a, &l) != d->cp) break;
      a += l;
    }
    for (uint32_t k = 0; k < d->stop && b > a; k++) {
      size_t j = b - 1;
      while (j > a && ((unsigned char)t[j] & 0xC0) == 0x80) j--;
      size_t l;
      if (gc__tok_utf8_decode(t + j, b - j, &l) != d->cp) break;
      b = j;
    }
    return token_stage(s, i + 1, t + a, b - a);
  }
  case GC__D_BYTEFALLBACK: {
    int byte = byte_token(t, n);
    if (byte >= 0) {
      unsigned char c = (unsigned char)byte;
      return gc__tok_buf_put(&s->group[i], &c, 1);
    }
    if ((rc = group_end(s, i))) return rc;
    return token_stage(s, i + 1, t, n);
  }
  default:
    MR_ASSERT(0);
    return MR_EINTERNAL;
  }
}

static int stream_end(gc_tok_stream *s) {
  /* Stage by stage: what one stage still holds goes through the ones after it, which are
   * flushed after it. */
  for (uint32_t i = 0; i < s->n_pre; i++) {
    if (s->tok->dec[i].kind == GC__D_BYTEFALLBACK) {
      int rc = group_end(s, i);
      if (rc) return rc;
    }
  }
  return collapse_end(s);
}

/* ---------------------------------------------------------------------------------------
 * Public API.
 */
/* Back to the start of a sequence (the returned text, in own, is left alone). */
static void state_reset(gc_tok_stream *s) {
  uint32_t n = s->tok->n_dec;
  s->n_tokens = 0;
  memset(&s->lossy, 0, sizeof s->lossy);
  for (uint32_t i = 0; i < n; i++) {
    s->seen[i] = 0;
    s->group[i].n = 0;
    s->held[i] = 0;
    s->lead_left[i] = s->tok->dec[i].kind == GC__D_STRIP ? s->tok->dec[i].start : 0;
  }
}

void gc_tok_stream_reset(gc_tok_stream *s) {
  state_reset(s);
  s->own.n = 0;
}

void gc_tok_stream_free(gc_tok_stream *s) {
  if (!s) return;
  uint32_t n = s->tok->n_dec;
  for (uint32_t i = 0; i < n; i++) {
    if (s->scratch) gc__tok_buf_close(&s->scratch[i]);
    if (s->group) gc__tok_buf_close(&s->group[i]);
  }
  mr_free(s->seen);
  mr_free(s->scratch);
  mr_free(s->group);
  mr_free(s->lead_left);
  mr_free(s->held);
  gc__tok_buf_close(&s->bytes);
  gc__tok_buf_close(&s->utf8);
  gc__tok_buf_close(&s->own);
  mr_free(s->m.v);
  if (s->region) onig_region_free(s->region, 1);
  mr_free(s);
}

int gc_tok_stream_new(const gc_tok *tok, bool skip_special_tokens, gc_tok_stream **out,
                      mr_err *e) {
  MR_ASSERT(tok && out);
  *out = NULL;
  gc_tok_stream *s = mr_calloc(1, sizeof *s);
  if (!s) return mr_err_set(e, MR_ENOMEM, "tokenizer: out of memory");
  s->tok = tok;
  s->skip_special = skip_special_tokens;
  uint32_t n = tok->n_dec ? tok->n_dec : 1;
  s->seen = mr_calloc(n, sizeof *s->seen);
  s->scratch = mr_calloc(n, sizeof *s->scratch);
  s->group = mr_calloc(n, sizeof *s->group);
  s->lead_left = mr_calloc(n, sizeof *s->lead_left);
  s->held = mr_calloc(n, sizeof *s->held);
  s->region = onig_region_new();
  if (!s->seen || !s->scratch || !s->group || !s->lead_left || !s->held || !s->region) {
    gc_tok_stream_free(s);
    return mr_err_set(e, MR_ENOMEM, "tokenizer: out of memory");
  }
  s->n_pre = tok->n_dec;
  s->collapse = -1;
  for (uint32_t i = 0; i < tok->n_dec; i++) {
    if (tok->dec[i].kind == GC__D_BYTELEVEL || tok->dec[i].kind == GC__D_FUSE) {
      s->n_pre = i;
      s->collapse = tok->dec[i].kind;
      break;
    }
  }
  s->out = &s->own;
  state_reset(s);
  *out = s;
  return 0;
}

static int feed(gc_tok_stream *s, int32_t id) {
  const gc_tok *tok = s->tok;
  if (id < 0 || (uint32_t)id >= tok->vocab_size || tok->piece_off[id] == UINT64_MAX) return 0;
  if (s->skip_special && (tok->flags[id] & GC__TOK_F_SPECIAL)) return 0;
  return token_stage(s, 0, tok->pieces.p + tok->piece_off[id], tok->piece_len[id]);
}

/* The error of a failed step: out of memory, or (Replace decoders) the regex engine. */
static int fail(mr_err *e, int rc) {
  if (rc == MR_ENOMEM) return mr_err_set(e, MR_ENOMEM, "tokenizer: out of memory");
  return mr_err_set(e, rc, "tokenizer: a Replace decoder's regular expression failed");
}

int gc_tok_stream_step(gc_tok_stream *s, int32_t id, const char **text, size_t *len, mr_err *e) {
  s->own.n = 0;
  int rc = gc__tok_buf_put(&s->own, "", 0);
  if (!rc) rc = feed(s, id);
  if (rc) {
    *text = "";
    *len = 0;
    return fail(e, rc);
  }
  *text = s->own.p;
  *len = s->own.n;
  return 0;
}

int gc_tok_stream_flush(gc_tok_stream *s, const char **text, size_t *len, mr_err *e) {
  s->own.n = 0;
  int rc = gc__tok_buf_put(&s->own, "", 0);
  if (!rc) rc = stream_end(s);
  /* The text is returned; the state starts over for the next sequence. */
  size_t n = s->own.n;
  state_reset(s);
  if (rc) {
    *text = "";
    *len = 0;
    return fail(e, rc);
  }
  *text = s->own.p;
  *len = n;
  return 0;
}

int gc_tok_decode(const gc_tok *tok, const int32_t *ids, size_t n, bool skip_special_tokens,
                  gc_tok_text *out, mr_err *e) {
  MR_ASSERT(tok && out && (ids || n == 0));
  gc_tok_stream *s;
  int rc = gc_tok_stream_new(tok, skip_special_tokens, &s, e);
  if (rc) return rc;
  /* The stream writes straight into the caller's buffer. */
  gc__tok_buf b = {.p = out->s, .n = 0, .cap = out->cap};
  s->out = &b;
  rc = gc__tok_buf_put(&b, "", 0);
  for (size_t i = 0; i < n && !rc; i++) rc = feed(s, ids[i]);
  if (!rc) rc = stream_end(s);
  out->s = b.p;
  out->cap = b.cap;
  out->len = rc ? 0 : b.n;
  if (out->s) out->s[out->len] = '\0';
  gc_tok_stream_free(s);
  return rc ? fail(e, rc) : 0;
}
