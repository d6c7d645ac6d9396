/*
 * tok_encode.c - text to ids, in HF's order (tokenizer/mod.rs encode_single_sequence):
 *
 *   input --(invalid UTF-8 -> U+FFFD)--> text
 *   text  --added tokens, normalized = false, matched in the raw text----> segments
 *   each segment that is not an added token:
 *         --normalizers--> normalized text
 *         --added tokens, normalized = true, matched in normalized text--> segments
 *   each segment that is not an added token:
 *         --pre-tokenizers--> pre-tokens --BPE (tok_bpe.c)--> ids
 *   ids   --post-processor (add_special_tokens)--> result
 *
 * Each segment is normalized on its own (so Llama's Prepend("▁") also applies after an added
 * token), and empty pieces are dropped at every split, as HF's PreTokenizedString::split
 * drops them. Kimi (tiktoken) first cuts the text as tokenization_kimi.py's encode does.
 *
 * Offsets are not tracked. The one rule that reads them, Metaspace's prepend_scheme
 * "first" ("is this piece at offset 0 of the input?"), is answered by a per-piece flag, which
 * is exact in the configurations the loader accepts for it (no normalizer; only Split and
 * Digits before it, which do not move text): tok_json.c refuses the others.
 */
#define _GNU_SOURCE /* memmem */
#include "gpu_client/runner/tok_internal.h"

#include <string.h>
#include <utf8proc.h>

/* A piece of text on its way through the pipeline. */
typedef struct piece {
  const char *p;
  uint32_t n;
  bool origin; /* starts at offset 0 of the input (Metaspace prepend_scheme "first") */
} piece;
typedef struct pieces {
  piece *v;
  size_t n, cap;
} pieces;

/* A segment of the added-token split: text, or an added token (id >= 0). */
typedef struct seg {
  const char *p;
  uint32_t n;
  int32_t id;
  bool origin;
} seg;
typedef struct segs {
  seg *v;
  size_t n, cap;
} segs;

typedef struct enc_ctx {
  const gc_tok *tok;
  mr_arena arena;            /* pre-tokenizer output of one segment */
  gc__tok_buf san;           /* the input with invalid UTF-8 replaced */
  gc__tok_normbuf nb;        /* normalizer output and scratch */
  pieces a, b;
  segs s1, s2;
  gc__tok_matches m;
  OnigRegion *region;
  gc__tok_bpe_work w;
  gc_tok_ids *out;
  mr_err *e;
} enc_ctx;

static int pieces_put(pieces *v, const char *p, size_t n, bool origin) {
  if (n == 0) return 0;
  if (v->n == v->cap) {
    size_t cap = v->cap ? v->cap * 2 : 64;
    piece *x = mr_realloc(v->v, cap * sizeof *x);
    if (!x) return MR_ENOMEM;
    v->v = x;
    v->cap = cap;
  }
  v->v[v->n++] = (piece){.p = p, .n = (uint32_t)n, .origin = origin};
  return 0;
}

static int segs_put(segs *v, const char *p, size_t n, int32_t id, bool origin) {
  if (n == 0 && id < 0) return 0; /* empty text pieces are dropped; a token never is */
  if (v->n == v->cap) {
    size_t cap = v->cap ? v->cap * 2 : 16;
    seg *x = mr_realloc(v->v, cap * sizeof *x);
    if (!x) return MR_ENOMEM;
    v->v = x;
    v->cap = cap;
  }
  v->v[v->n++] = (seg){.p = p, .n = (uint32_t)n, .id = id, .origin = origin};
  return 0;
}

static int nomem(enc_ctx *c) { return mr_err_set(c->e, MR_ENOMEM, "tokenizer: out of memory"); }

/* ---------------------------------------------------------------------------------------
 * Added tokens (HF AddedVocabulary::find_matches).
 */

/* Rust regex's \w (UTS #18 word: Alphabetic, Mark, Decimal_Number, Connector_Punctuation,
 * Join_Control). Alphabetic is the letters, Nl and Other_Alphabetic; the members of
 * Other_Alphabetic that are neither marks nor letters are the circled and squared Latin
 * letters listed here. */
static bool is_word_char(uint32_t c) {
  if (c < 0x80) return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
  if (c == 0x200C || c == 0x200D) return true;
  if ((c >= 0x24B6 && c <= 0x24E9) || (c >= 0x1F130 && c <= 0x1F149) ||
      (c >= 0x1F150 && c <= 0x1F169) || (c >= 0x1F170 && c <= 0x1F189))
    return true;
  switch (utf8proc_category((utf8proc_int32_t)c)) {
  case UTF8PROC_CATEGORY_LU: case UTF8PROC_CATEGORY_LL: case UTF8PROC_CATEGORY_LT:
  case UTF8PROC_CATEGORY_LM: case UTF8PROC_CATEGORY_LO: case UTF8PROC_CATEGORY_MN:
  case UTF8PROC_CATEGORY_MC: case UTF8PROC_CATEGORY_ME: case UTF8PROC_CATEGORY_ND:
  case UTF8PROC_CATEGORY_NL: case UTF8PROC_CATEGORY_PC:
    return true;
  default:
    return false;
  }
}

/* The code point that ends s[0, n) (n > 0, valid UTF-8). */
static uint32_t last_cp(const char *s, size_t n) {
  size_t i = n - 1;
  while (i > 0 && ((unsigned char)s[i] & 0xC0) == 0x80) i--;
  size_t l;
  return gc__tok_utf8_decode(s + i, n - i, &l);
}

/* Start of the run of White_Space that ends s[0, n). */
static size_t ws_run_start(const char *s, size_t n) {
  while (n > 0) {
    size_t i = n - 1;
    while (i > 0 && ((unsigned char)s[i] & 0xC0) == 0x80) i--;
    size_t l;
    if (!gc__tok_is_ws(gc__tok_utf8_decode(s + i, n - i, &l))) break;
    n = i;
  }
  return n;
}

/* Length of the run of White_Space that starts s[0, n). */
static size_t ws_run_len(const char *s, size_t n) {
  size_t i = 0;
  while (i < n) {
    size_t l;
    if (!gc__tok_is_ws(gc__tok_utf8_decode(s + i, n - i, &l))) break;
    i += l;
  }
  return i;
}

/* The leftmost-longest match of trie t in s[from, n): its start, end and token index. */
static bool trie_find(const gc__tok_trie *t, const unsigned char *s, size_t from, size_t n,
                      size_t *ms, size_t *me, int32_t *term) {
  for (size_t i = from; i < n; i++) {
    int32_t cur = t->root[s[i]];
    if (cur < 0) continue;
    int32_t best = -1;
    size_t best_end = 0, j = i + 1;
    for (;;) {
      if (t->node[cur].term >= 0) {
        best = t->node[cur].term;
        best_end = j;
      }
      if (j >= n) break;
      int32_t c = t->node[cur].child;
      while (c >= 0 && t->node[c].byte != s[j]) c = t->node[c].sibling;
      if (c < 0) break;
      cur = c;
      j++;
    }
    if (best >= 0) {
      *ms = i;
      *me = best_end;
      *term = best;
      return true;
    }
  }
  return false;
}

/*
 * Splits s[0, n) around the added tokens of trie t into out (appended). A match refused by
 * single_word is skipped as a whole (the search goes on after it); lstrip / rstrip widen a
 * match over the whitespace around it, never back over the previous match.
 */
static int added_split(enc_ctx *c, const gc__tok_trie *t, const char *s, size_t n, bool origin,
                       segs *out) {
  const gc_tok *tok = c->tok;
  if (!t->any) return segs_put(out, s, n, -1, origin) ? nomem(c) : 0;
  /* start_offset: the end of the last accepted token (with its stripped spaces); pos:
   * where the matcher resumes, the end of the last match found, accepted or not. They
   * differ after rstrip, and after a refused single_word match. */
  size_t start_offset = 0, pos = 0, ms, me;
  int32_t term;
  while (pos < n && trie_find(t, (const unsigned char *)s, pos, n, &ms, &me, &term)) {
    pos = me;
    const gc__tok_added *a = &tok->added[term];
    size_t start = ms, stop = me;
    if (a->single_word) {
      bool start_space = start == 0 || !is_word_char(last_cp(s, start));
      size_t l;
      bool stop_space = stop == n || !is_word_char(gc__tok_utf8_decode(s + stop, n - stop, &l));
      if (!start_space || !stop_space) continue;
    }
    if (a->lstrip) {
      /* Back over the spaces before, but not into the previous token. */
      size_t ns = ws_run_start(s, start);
      start = ns > start_offset ? ns : start_offset;
    }
    if (a->rstrip) stop += ws_run_len(s + stop, n - stop);
    if (start_offset < start && segs_put(out, s + start_offset, start - start_offset, -1,
                                         origin && start_offset == 0))
      return nomem(c);
    if (segs_put(out, s + start, stop - start, a->id, false)) return nomem(c);
    start_offset = stop;
  }
  if (start_offset < n &&
      segs_put(out, s + start_offset, n - start_offset, -1, origin && start_offset == 0))
    return nomem(c);
  return 0;
}

/* ---------------------------------------------------------------------------------------
 * Normalizers.
 */
static int unicode_norm(int kind, const char *s, size_t n, gc__tok_buf *out, gc__tok_buf *tmp) {
  utf8proc_option_t opt = UTF8PROC_STABLE;
  if (kind == GC__N_NFC || kind == GC__N_NFKC) opt |= UTF8PROC_COMPOSE;
  else opt |= UTF8PROC_DECOMPOSE;
  if (kind == GC__N_NFKC || kind == GC__N_NFKD) opt |= UTF8PROC_COMPAT;
  size_t cap = n + 16; /* code points */
  utf8proc_ssize_t r;
  for (;;) {
    if (cap > (SIZE_MAX / 4) - 1) return MR_ENOMEM;
    tmp->n = 0;
    if (gc__tok_buf_reserve(tmp, cap * sizeof(utf8proc_int32_t))) return MR_ENOMEM;
    r = utf8proc_decompose((const utf8proc_uint8_t *)s, (utf8proc_ssize_t)n,
                           (utf8proc_int32_t *)(void *)tmp->p, (utf8proc_ssize_t)cap, opt);
    if (r < 0) return MR_EINTERNAL; /* only for invalid UTF-8, which never gets here */
    if ((size_t)r <= cap) break;
    cap = (size_t)r;
  }
  /* Composition (for NFC / NFKC) and UTF-8 encoding in place. */
  r = utf8proc_reencode((utf8proc_int32_t *)(void *)tmp->p, r, opt);
  if (r < 0) return MR_EINTERNAL;
  out->n = 0;
  return gc__tok_buf_put(out, tmp->p, (size_t)r);
}

/* True if normalization `kind` leaves s unchanged for sure: ASCII for all four forms, and
 * for NFC nothing below U+0300 (no combining mark, and every precomposed Latin-1 / Latin
 * Extended letter there recomposes to itself). */
static bool norm_quick_yes(int kind, const char *s, size_t n) {
  const unsigned char *u = (const unsigned char *)s;
  if (kind != GC__N_NFC) {
    for (size_t i = 0; i < n; i++)
      if (u[i] >= 0x80) return false;
    return true;
  }
  for (size_t i = 0; i < n; i++) {
    if (u[i] < 0x80) continue;
    if (u[i] >= 0xCC) return false; /* lead of a 2-byte sequence >= U+0300, or longer */
  }
  return true;
}

/* Rust char::to_lowercase: the simple mapping, except U+0130 whose lowercase is two chars. */
static int lowercase(const char *s, size_t n, gc__tok_buf *out) {
  out->n = 0;
  if (gc__tok_buf_reserve(out, n + 8)) return MR_ENOMEM;
  for (size_t i = 0; i < n;) {
    unsigned char b = (unsigned char)s[i];
    if (b < 0x80) {
      char ch = (char)(b >= 'A' && b <= 'Z' ? b + 32 : b);
      if (gc__tok_buf_put(out, &ch, 1)) return MR_ENOMEM;
      i++;
      continue;
    }
    size_t l;
    uint32_t cp = gc__tok_utf8_decode(s + i, n - i, &l);
    char u[8];
    size_t k;
    if (cp == 0x130) {
      memcpy(u, "i\xCC\x87", 3);
      k = 3;
    } else {
      k = gc__tok_utf8_encode((uint32_t)utf8proc_tolower((utf8proc_int32_t)cp), u);
    }
    if (gc__tok_buf_put(out, u, k)) return MR_ENOMEM;
    i += l;
  }
  return 0;
}

void gc__tok_normbuf_close(gc__tok_normbuf *nb) {
  gc__tok_buf_close(&nb->out);
  gc__tok_buf_close(&nb->tmp);
  gc__tok_buf_close(&nb->u32);
}

int gc__tok_normalize(const gc_tok *tok, const char *s, size_t n, const char **res,
                      size_t *res_len, gc__tok_normbuf *nb, OnigRegion *region,
                      gc__tok_matches *m, mr_err *e) {
  gc__tok_buf *out = &nb->out, *tmp = &nb->tmp;
  /* cur is the text so far: s, or out. Each step writes tmp and swaps it with out. */
  const char *cur = s;
  size_t cn = n;
  for (uint32_t k = 0; k < tok->n_norm; k++) {
    const gc__tok_norm *st = &tok->norm[k];
    gc__tok_buf *dst = tmp;
    int rc = 0;
    dst->n = 0;
    /* A step that changes nothing `continue`s: cur stays, no copy is made (the common
     * case for NFC on text that is already NFC, the one normalizer Qwen has). */
    switch (st->kind) {
    case GC__N_NFC: case GC__N_NFD: case GC__N_NFKC: case GC__N_NFKD:
      if (norm_quick_yes(st->kind, cur, cn)) continue;
      rc = unicode_norm(st->kind, cur, cn, dst, &nb->u32);
      break;
    case GC__N_LOWERCASE:
      rc = lowercase(cur, cn, dst);
      break;
    case GC__N_STRIP: {
      size_t a = 0, b = cn;
      if (st->left) a = ws_run_len(cur, cn);
      if (st->right && a < b) b = ws_run_start(cur + a, b - a) + a;
      if (a == 0 && b == cn) continue;
      rc = gc__tok_buf_put(dst, cur + a, b - a);
      break;
    }
    case GC__N_PREPEND:
      if (cn == 0) continue;
      rc = gc__tok_buf_put(dst, st->str, st->str_len);
      if (!rc) rc = gc__tok_buf_put(dst, cur, cn);
      break;
    case GC__N_REPLACE: {
      /* HF NormalizedString::replace: every match becomes the content, the text between
       * matches is copied. */
      if ((rc = gc__tok_re_find(st->re, region, cur, cn, m, e))) return rc;
      bool any = false;
      for (size_t i = 0; i < m->n && !rc; i++) {
        if (m->v[i].m) {
          any = true;
          rc = gc__tok_buf_put(dst, st->str, st->str_len);
        } else {
          rc = gc__tok_buf_put(dst, cur + m->v[i].s, m->v[i].e - m->v[i].s);
        }
      }
      if (!rc && !any) continue;
      break;
    }
    default:
      MR_ASSERT(0);
    }
    if (rc == MR_EINTERNAL)
      return mr_err_set(e, MR_EINTERNAL, "tokenizer: Unicode normalization failed");
    if (rc) return mr_err_set(e, MR_ENOMEM, "tokenizer: out of memory");
    /* Swap: out holds the result, tmp is free again. */
    gc__tok_buf t = *out;
    *out = *tmp;
    *tmp = t;
    if (!out->p && gc__tok_buf_put(out, "", 0))
      return mr_err_set(e, MR_ENOMEM, "tokenizer: out of memory");
    cur = out->p;
    cn = out->n;
  }
  *res = cur;
  *res_len = cn;
  return 0;
}

/* ---------------------------------------------------------------------------------------
 * Pre-tokenizers. Each step maps the list c->a to c->b, then the lists swap.
 */

/* Appends a piece even when empty: an empty piece still takes part in HF's folds below,
 * and is dropped only at the end (PreTokenizedString::split drops empty splits). */
static int piece_raw(enc_ctx *c, pieces *dst, const char *p, uint32_t n, bool origin) {
  if (dst->n == dst->cap) {
    size_t cap = dst->cap ? dst->cap * 2 : 64;
    piece *x = mr_realloc(dst->v, cap * sizeof *x);
    if (!x) return nomem(c);
    dst->v = x;
    dst->cap = cap;
  }
  dst->v[dst->n++] = (piece){.p = p, .n = n, .origin = origin};
  return 0;
}

/*
 * HF NormalizedString::split's behaviours over a match list (pieces appended to dst):
 *   Removed / Isolated       the matches dropped / kept as pieces of their own;
 *   Contiguous               forward fold: a piece with the same flag as the one before
 *                            joins it (runs of matches become one piece);
 *   MergedWithPrevious       forward fold: a match after a non-match joins it;
 *   MergedWithNext           backward fold: a match before a non-match joins it.
 */
static int split_behavior(enc_ctx *c, const piece *src, const gc__tok_matches *m, int behavior,
                          pieces *dst) {
  const gc__tok_match *v = m->v;
  size_t n = m->n, first = dst->n;
  int rc = 0;
  if (behavior == GC__B_ISOLATED || behavior == GC__B_REMOVED) {
    for (size_t i = 0; i < n && !rc; i++)
      if (behavior == GC__B_ISOLATED || !v[i].m)
        rc = pieces_put(dst, src->p + v[i].s, v[i].e - v[i].s, src->origin && v[i].s == 0);
    return rc ? nomem(c) : 0;
  }
  bool prev = false;
  if (behavior == GC__B_MERGED_NEXT) {
    for (size_t k = n; k-- > 0 && !rc;) {
      if (v[k].m && !prev && dst->n > first) {
        piece *last = &dst->v[dst->n - 1];
        last->n = (uint32_t)(last->p + last->n - (src->p + v[k].s));
        last->p = src->p + v[k].s;
        last->origin = src->origin && v[k].s == 0;
      } else {
        rc = piece_raw(c, dst, src->p + v[k].s, v[k].e - v[k].s, src->origin && v[k].s == 0);
      }
      prev = v[k].m;
    }
    for (size_t i = first, j = dst->n; i + 1 < j; i++, j--) { /* back into text order */
      piece t = dst->v[i];
      dst->v[i] = dst->v[j - 1];
      dst->v[j - 1] = t;
    }
  } else {
    for (size_t i = 0; i < n && !rc; i++) {
      bool join = behavior == GC__B_CONTIGUOUS ? v[i].m == prev : (v[i].m && !prev);
      if (join && dst->n > first) {
        piece *last = &dst->v[dst->n - 1];
        last->n = (uint32_t)(src->p + v[i].e - last->p);
      } else {
        rc = piece_raw(c, dst, src->p + v[i].s, v[i].e - v[i].s, src->origin && v[i].s == 0);
      }
      prev = v[i].m;
    }
  }
  if (rc) return rc;
  size_t w = first;
  for (size_t i = first; i < dst->n; i++)
    if (dst->v[i].n) dst->v[w++] = dst->v[i];
  dst->n = w;
  return 0;
}

/* Appends the span [s, e) of the piece to c->m, as a match or as the text between two. */
static int match_push(enc_ctx *c, size_t s, size_t e, bool match) {
  gc__tok_matches *m = &c->m;
  if (m->n == m->cap) {
    size_t cap = m->cap ? m->cap * 2 : 32;
    gc__tok_match *x = mr_realloc(m->v, cap * sizeof *x);
    if (!x) return nomem(c);
    m->v = x;
    m->cap = cap;
  }
  m->v[m->n++] = (gc__tok_match){.s = (uint32_t)s, .e = (uint32_t)e, .m = match};
  return 0;
}

/* A match at [at, end) after the text since *last (pushed first when not empty). */
static int match_after_gap(enc_ctx *c, size_t *last, size_t at, size_t end) {
  int rc = *last < at ? match_push(c, *last, at, false) : 0;
  if (!rc) rc = match_push(c, at, end, true);
  *last = end;
  return rc;
}

/* HF's Pattern for a char predicate: each char that satisfies it is a match of its own. */
static int digit_matches(enc_ctx *c, const piece *src) {
  c->m.n = 0;
  size_t last = 0;
  for (size_t i = 0; i < src->n;) {
    size_t l;
    uint32_t cp = gc__tok_utf8_decode(src->p + i, src->n - i, &l);
    int rc = gc__tok_is_numeric(cp) ? match_after_gap(c, &last, i, i + l) : 0;
    if (rc) return rc;
    i += l;
  }
  return last < src->n ? match_push(c, last, src->n, false) : 0;
}

/* The same for one given char (Metaspace's split on its replacement). */
static int char_matches(enc_ctx *c, const piece *src, const char *ch, size_t chl) {
  c->m.n = 0;
  size_t last = 0;
  while (last < src->n) {
    const char *hit = chl <= src->n - last ? memmem(src->p + last, src->n - last, ch, chl) : NULL;
    if (!hit) break;
    int rc = match_after_gap(c, &last, (size_t)(hit - src->p), (size_t)(hit - src->p) + chl);
    if (rc) return rc;
  }
  return last < src->n ? match_push(c, last, src->n, false) : 0;
}

static char *arena_copy(enc_ctx *c, size_t n) { return mr_arena_alloc(&c->arena, n ? n : 1, 1); }

static int pre_step(enc_ctx *c, const gc__tok_pre *st, const pieces *src, pieces *dst) {
  dst->n = 0;
  for (size_t i = 0; i < src->n; i++) {
    piece pc = src->v[i];
    int rc;
    switch (st->kind) {
    case GC__P_SPLIT:
      if ((rc = gc__tok_re_find(st->re, c->region, pc.p, pc.n, &c->m, c->e))) return rc;
      if (st->invert)
        for (size_t k = 0; k < c->m.n; k++) c->m.v[k].m = !c->m.v[k].m;
      if ((rc = split_behavior(c, &pc, &c->m, st->behavior, dst))) return rc;
      break;
    case GC__P_DIGITS:
      if ((rc = digit_matches(c, &pc))) return rc;
      if ((rc = split_behavior(c, &pc, &c->m,
                               st->individual ? GC__B_ISOLATED : GC__B_CONTIGUOUS, dst)))
        return rc;
      break;
    case GC__P_BYTELEVEL: {
      /* HF's order: the prefix space, the GPT-2 split (use_regex), then every piece
       * spelled in the byte chars; raw mode skips the spelling (the model reads bytes). */
      if (st->add_prefix_space && pc.p[0] != ' ') {
        char *p = arena_copy(c, (size_t)pc.n + 1);
        if (!p) return nomem(c);
        p[0] = ' ';
        memcpy(p + 1, pc.p, pc.n);
        pc.p = p;
        pc.n++;
      }
      size_t first = dst->n;
      if (st->re) {
        if ((rc = gc__tok_re_find(st->re, c->region, pc.p, pc.n, &c->m, c->e))) return rc;
        if ((rc = split_behavior(c, &pc, &c->m, GC__B_ISOLATED, dst))) return rc;
      } else if (pieces_put(dst, pc.p, pc.n, pc.origin)) {
        return nomem(c);
      }
      if (st->map_bytes) {
        for (size_t k = first; k < dst->n; k++) {
          piece *q = &dst->v[k];
          char *p = arena_copy(c, (size_t)q->n * 2);
          if (!p) return nomem(c);
          char *o = p;
          for (uint32_t j = 0; j < q->n; j++)
            o += gc__tok_utf8_encode(gc__tok_byte_cp[(unsigned char)q->p[j]], o);
          q->p = p;
          q->n = (uint32_t)(o - p);
        }
      }
      break;
    }
    case GC__P_METASPACE: {
      /* ' ' -> the replacement, then the prefix per scheme, then the split. */
      size_t spaces = 0;
      for (uint32_t j = 0; j < pc.n; j++) spaces += pc.p[j] == ' ';
      bool lead = pc.n >= st->repl_len && memcmp(pc.p, st->repl, st->repl_len) == 0;
      if (pc.n > 0 && pc.p[0] == ' ') lead = true; /* it becomes the replacement */
      bool pre = !lead && (st->prepend == GC__PREPEND_ALWAYS ||
                           (st->prepend == GC__PREPEND_FIRST && pc.origin));
      if (spaces || pre) {
        size_t len = (size_t)pc.n + spaces * (st->repl_len - 1) + (pre ? st->repl_len : 0);
        char *p = arena_copy(c, len);
        if (!p) return nomem(c);
        char *o = p;
        if (pre) {
          memcpy(o, st->repl, st->repl_len);
          o += st->repl_len;
        }
        for (uint32_t j = 0; j < pc.n; j++) {
          if (pc.p[j] == ' ') {
            memcpy(o, st->repl, st->repl_len);
            o += st->repl_len;
          } else {
            *o++ = pc.p[j];
          }
        }
        pc.p = p;
        pc.n = (uint32_t)(o - p);
      }
      if (!st->split) {
        if (pieces_put(dst, pc.p, pc.n, pc.origin)) return nomem(c);
        break;
      }
      if ((rc = char_matches(c, &pc, st->repl, st->repl_len))) return rc;
      if ((rc = split_behavior(c, &pc, &c->m, GC__B_MERGED_NEXT, dst))) return rc;
      break;
    }
    default:
      MR_ASSERT(0);
    }
  }
  return 0;
}

/* Pre-tokenizes one text segment and runs the model on each pre-token. The pre-tokenizer
 * steps map the piece list a to b and swap; pieces point into the input, the normalizer's
 * buffer or the arena, which lives until this segment's ids are out. */
static int encode_text(enc_ctx *c, const char *s, size_t n, bool origin) {
  const gc_tok *tok = c->tok;
  c->a.n = 0;
  if (pieces_put(&c->a, s, n, origin)) return nomem(c);
  for (uint32_t k = 0; k < tok->n_pre; k++) {
    int rc = pre_step(c, &tok->pre[k], &c->a, &c->b);
    if (rc) return rc;
    pieces t = c->a;
    c->a = c->b;
    c->b = t;
  }
  for (size_t i = 0; i < c->a.n; i++) {
    int rc = gc__tok_bpe_tokenize(&tok->bpe, c->a.v[i].p, c->a.v[i].n, &c->w, c->out);
    if (rc == MR_ENOTFOUND)
      return mr_err_set(c->e, MR_EFORMAT, "tokenizer: the text has a character the "
                        "vocabulary lacks, and model.unk_token is not in the vocabulary");
    if (rc) return nomem(c);
  }
  mr_arena_reset(&c->arena);
  return 0;
}

/* Everything after the input has been made valid UTF-8 (and, for Kimi, cut): HF's
 * AddedVocabulary::extract_and_normalize, then pre-tokenization and the model, segment by
 * segment so that the ids come out in text order. */
static int encode_core(enc_ctx *c, const char *s, size_t n, bool origin) {
  const gc_tok *tok = c->tok;
  int rc;
  c->s1.n = 0;
  if ((rc = added_split(c, &tok->trie_raw, s, n, origin, &c->s1))) return rc;
  for (size_t i = 0; i < c->s1.n; i++) {
    seg g = c->s1.v[i];
    if (g.id >= 0) {
      if (gc__tok_ids_put(c->out, &g.id, 1)) return nomem(c);
      continue;
    }
    /* Each segment between raw added tokens is normalized alone (so a Prepend normalizer
     * also applies after "<s>"), then searched for the normalized added tokens. */
    const char *ns = g.p;
    size_t nn = g.n;
    if (tok->n_norm &&
        (rc = gc__tok_normalize(tok, g.p, g.n, &ns, &nn, &c->nb, c->region, &c->m, c->e)))
      return rc;
    if (!tok->trie_norm.any) {
      if (nn && (rc = encode_text(c, ns, nn, g.origin))) return rc;
      continue;
    }
    c->s2.n = 0;
    if ((rc = added_split(c, &tok->trie_norm, ns, nn, g.origin, &c->s2))) return rc;
    for (size_t j = 0; j < c->s2.n; j++) {
      seg h = c->s2.v[j];
      if (h.id >= 0) {
        if (gc__tok_ids_put(c->out, &h.id, 1)) return nomem(c);
      } else if ((rc = encode_text(c, h.p, h.n, h.origin))) {
        return rc;
      }
    }
  }
  return 0;
}

/*
 * tokenization_kimi.py's encode: the text in chunks of 400,000 code points, each cut so that
 * no piece holds more than 25,000 consecutive whitespace (str.isspace) or non-whitespace
 * code points (_split_whitespaces_or_nonwhitespaces); each piece is encoded on its own.
 */
#define KIMI_CHUNK_CHARS 400000
#define KIMI_MAX_RUN 25000
static int encode_kimi(enc_ctx *c, const char *s, size_t n) {
  size_t i = 0;
  /* Python's loop, in bytes: the chunk's code points counted, then a run counter that
   * restarts at every change between whitespace and not; when a run passes the limit the
   * slice so far is encoded and the next slice starts at that char. */
  while (i < n) {
    /* One chunk: up to KIMI_CHUNK_CHARS code points. */
    size_t chunk_end = i, chars = 0;
    while (chunk_end < n && chars < KIMI_CHUNK_CHARS) {
      chunk_end += gc__tok_utf8_len((unsigned char)s[chunk_end]);
      chars++;
    }
    if (chunk_end > n) chunk_end = n;
    size_t slice_start = i, run = 0, j = i;
    bool run_space = false;
    if (j < chunk_end) {
      size_t l;
      run_space = gc__tok_is_pyspace(gc__tok_utf8_decode(s + j, chunk_end - j, &l));
    }
    while (j < chunk_end) {
      size_t l;
      bool sp = gc__tok_is_pyspace(gc__tok_utf8_decode(s + j, chunk_end - j, &l));
      if (sp != run_space) {
        run = 1;
        run_space = sp;
      } else if (++run > KIMI_MAX_RUN) {
        int rc = encode_core(c, s + slice_start, j - slice_start, slice_start == 0);
        if (rc) return rc;
        slice_start = j;
        run = 1;
      }
      j += l;
    }
    int rc = encode_core(c, s + slice_start, chunk_end - slice_start, slice_start == 0);
    if (rc) return rc;
    i = chunk_end;
  }
  return 0;
}

/* ---------------------------------------------------------------------------------------
 * Post-processor: the TemplateProcessing "single" template (at most one per tokenizer, see
 * tok_json.c; ByteLevel's post-processor only touches offsets). HF applies it whether or
 * not special tokens are added: $A is copied where it appears, the special tokens only with
 * add_special_tokens.
 */
static int post_process(enc_ctx *c, gc_tok_ids *out, bool add_special) {
  const gc__tok_tpl *tp = c->tok->tpl;
  gc_tok_ids seq = {0};
  int rc = gc__tok_ids_put(&seq, out->v, out->n);
  out->n = 0;
  for (uint32_t k = 0; k < tp->n && !rc; k++) {
    const gc__tok_tpl_item *it = &tp->item[k];
    if (it->seq) rc = gc__tok_ids_put(out, seq.v, seq.n);
    else if (add_special) rc = gc__tok_ids_put(out, it->ids, it->n);
  }
  gc_tok_ids_close(&seq);
  return rc ? nomem(c) : 0;
}

/* ---------------------------------------------------------------------------------------
 * The public entry point.
 */
int gc_tok_encode(const gc_tok *tok, const char *text, size_t len, bool add_special_tokens,
                  gc_tok_ids *out, mr_err *e) {
  MR_ASSERT(tok && out && (text || len == 0));
  out->n = 0;
  if (len > INT32_MAX)
    return mr_err_set(e, MR_ERANGE, "tokenizer: text of %zu bytes, at most %d", len, INT32_MAX);
  enc_ctx c;
  memset(&c, 0, sizeof c);
  c.tok = tok;
  c.out = out;
  c.e = e;
  mr_arena_init(&c.arena, 16384);
  int rc = 0;
  const char *s = text ? text : "";
  size_t n = len;
  size_t ok = gc__tok_utf8_valid_prefix(s, n);
  if (ok < n) {
    /* Python's bytes.decode("utf-8", "replace"): the input HF would have been given. */
    gc__tok_lossy d = {0};
    if (gc__tok_buf_put(&c.san, s, ok) || gc__tok_lossy_feed(&d, s + ok, n - ok, &c.san) ||
        gc__tok_lossy_end(&d, &c.san)) {
      rc = nomem(&c);
      goto out;
    }
    s = c.san.p;
    n = c.san.n;
    if (n > INT32_MAX) {
      rc = mr_err_set(e, MR_ERANGE, "tokenizer: text of %zu bytes after U+FFFD replacement, "
                      "at most %d", n, INT32_MAX);
      goto out;
    }
  }
  c.region = onig_region_new();
  if (!c.region) {
    rc = nomem(&c);
    goto out;
  }
  rc = tok->tiktoken ? encode_kimi(&c, s, n) : encode_core(&c, s, n, true);
  if (!rc && tok->tpl) rc = post_process(&c, out, add_special_tokens);
out:
  if (rc) out->n = 0;
  if (c.region) onig_region_free(c.region, 1);
  mr_arena_close(&c.arena);
  gc__tok_buf_close(&c.san);
  gc__tok_normbuf_close(&c.nb);
  mr_free(c.a.v);
  mr_free(c.b.v);
  mr_free(c.s1.v);
  mr_free(c.s2.v);
  mr_free(c.m.v);
  gc__tok_bpe_work_close(&c.w);
  return rc;
}
