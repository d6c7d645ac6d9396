/*
 * tok_util.c - the tokenizer's small tools: growable buffers (and the release of
 * tokenizer.h's id and text buffers), the two hash maps (vocabulary and merges) and the
 * token lookup by text over them, UTF-8 validation and lossy decoding, the Unicode classes
 * HF's Rust code asks std for, the GPT-2 byte <-> char table, the added-token trie, and the
 * Oniguruma wrapper that reproduces the `onig` crate's find_iter as HF's
 * Pattern::find_matches uses it.
 */
#include "gpu_client/runner/tok_internal.h"

#include <stdio.h>
#include <string.h>
#include <utf8proc.h>

/* ---------------------------------------------------------------------------------------
 * Buffers.
 */
int gc__tok_buf_reserve(gc__tok_buf *b, size_t extra) {
  if (b->cap - b->n > extra) return 0; /* keeps one byte for a NUL */
  size_t want = b->n + extra + 1;
  if (want < b->n) return MR_ENOMEM;
  size_t cap = b->cap ? b->cap : 64;
  while (cap < want) {
    if (cap > SIZE_MAX / 2) return MR_ENOMEM;
    cap *= 2;
  }
  char *p = mr_realloc(b->p, cap);
  if (!p) return MR_ENOMEM;
  b->p = p;
  b->cap = cap;
  return 0;
}

int gc__tok_buf_put(gc__tok_buf *b, const void *s, size_t n) {
  if (gc__tok_buf_reserve(b, n)) return MR_ENOMEM;
  if (n) memcpy(b->p + b->n, s, n);
  b->n += n;
  b->p[b->n] = '\0';
  return 0;
}

void gc__tok_buf_close(gc__tok_buf *b) {
  mr_free(b->p);
  memset(b, 0, sizeof *b);
}

void gc_tok_ids_close(gc_tok_ids *ids) {
  if (!ids) return;
  mr_free(ids->v);
  memset(ids, 0, sizeof *ids);
}

void gc_tok_text_close(gc_tok_text *t) {
  if (!t) return;
  mr_free(t->s);
  memset(t, 0, sizeof *t);
}

int gc__tok_ids_put(gc_tok_ids *v, const int32_t *ids, size_t n) {
  if (n == 0) return 0;
  if (v->cap - v->n < n) {
    size_t cap = v->cap ? v->cap : 64;
    while (cap - v->n < n) {
      if (cap > SIZE_MAX / 2 / sizeof(int32_t)) return MR_ENOMEM;
      cap *= 2;
    }
    int32_t *p = mr_realloc(v->v, cap * sizeof *p);
    if (!p) return MR_ENOMEM;
    v->v = p;
    v->cap = cap;
  }
  memcpy(v->v + v->n, ids, n * sizeof *ids);
  v->n += n;
  return 0;
}

/* ---------------------------------------------------------------------------------------
 * Hashing: 8 bytes per round of multiply-xorshift (the splitmix64 finaliser's constants),
 * then a final avalanche. Not cryptographic; the inputs are a vocabulary and pre-tokens.
 */
uint64_t gc__tok_hash(const void *p, size_t n) {
  const unsigned char *s = p;
  uint64_t h = 0x243F6A8885A308D3ull ^ ((uint64_t)n * 0x9E3779B97F4A7C15ull);
  while (n >= 8) {
    uint64_t w;
    memcpy(&w, s, 8);
    h = (h ^ w) * 0xBF58476D1CE4E5B9ull;
    h ^= h >> 31;
    s += 8;
    n -= 8;
  }
  uint64_t w = 0;
  if (n) memcpy(&w, s, n);
  h = (h ^ w) * 0x94D049BB133111EBull;
  h ^= h >> 29;
  h *= 0xBF58476D1CE4E5B9ull;
  h ^= h >> 32;
  return h;
}

/* ---------------------------------------------------------------------------------------
 * String map. Slots hold entry index + 1; the table is kept at most half full.
 */
static int strmap_grow(gc__tok_strmap *m) {
  uint32_t cap = m->slot ? (m->mask + 1) * 2 : 64;
  if (cap == 0 || cap > (1u << 30)) return MR_ENOMEM;
  uint32_t *slot = mr_calloc(cap, sizeof *slot);
  if (!slot) return MR_ENOMEM;
  for (uint32_t i = 0; i < m->n; i++) {
    uint32_t j = m->ent[i].hash & (cap - 1);
    while (slot[j]) j = (j + 1) & (cap - 1);
    slot[j] = i + 1;
  }
  mr_free(m->slot);
  m->slot = slot;
  m->mask = cap - 1;
  return 0;
}

int32_t gc__tok_strmap_get(const gc__tok_strmap *m, const char *key, size_t len) {
  if (!m->slot) return -1;
  uint32_t h = (uint32_t)gc__tok_hash(key, len);
  for (uint32_t j = h & m->mask;; j = (j + 1) & m->mask) {
    uint32_t s = m->slot[j];
    if (!s) return -1;
    const gc__tok_strmap_ent *x = &m->ent[s - 1];
    if (x->hash == h && x->len == len && memcmp(m->blob.p + x->off, key, len) == 0) return x->val;
  }
}

int gc__tok_strmap_put(gc__tok_strmap *m, const char *key, size_t len, int32_t val,
                       bool *fresh) {
  if (len > UINT32_MAX) return MR_ERANGE;
  if (!m->slot || (uint64_t)(m->n + 1) * 2 > (uint64_t)m->mask + 1)
    if (strmap_grow(m)) return MR_ENOMEM;
  uint32_t h = (uint32_t)gc__tok_hash(key, len);
  uint32_t j = h & m->mask;
  for (;; j = (j + 1) & m->mask) {
    uint32_t s = m->slot[j];
    if (!s) break;
    gc__tok_strmap_ent *x = &m->ent[s - 1];
    if (x->hash == h && x->len == len && memcmp(m->blob.p + x->off, key, len) == 0) {
      x->val = val;
      if (fresh) *fresh = false;
      return 0;
    }
  }
  if (m->n == m->ent_cap) {
    uint32_t cap = m->ent_cap ? m->ent_cap * 2 : 64;
    gc__tok_strmap_ent *ent = mr_realloc(m->ent, (size_t)cap * sizeof *ent);
    if (!ent) return MR_ENOMEM;
    m->ent = ent;
    m->ent_cap = cap;
  }
  uint64_t off = m->blob.n;
  if (gc__tok_buf_put(&m->blob, key, len)) return MR_ENOMEM;
  m->ent[m->n] = (gc__tok_strmap_ent){.off = off, .len = (uint32_t)len, .val = val, .hash = h};
  m->slot[j] = ++m->n;
  if (fresh) *fresh = true;
  return 0;
}

void gc__tok_strmap_close(gc__tok_strmap *m) {
  mr_free(m->slot);
  mr_free(m->ent);
  gc__tok_buf_close(&m->blob);
  memset(m, 0, sizeof *m);
}

/* ---------------------------------------------------------------------------------------
 * Token lookup by text (tokenizer.h): the added tokens first, then the model's vocabulary.
 * Here, below the loaders, because tokenizer_config.json's reader (tok_json.c) resolves
 * bos_token / eos_token with it.
 */
int32_t gc_tok_token_id_n(const gc_tok *tok, const char *piece, size_t len) {
  int32_t id = gc__tok_strmap_get(&tok->added_map, piece, len);
  return id >= 0 ? id : gc__tok_strmap_get(&tok->bpe.vocab, piece, len);
}

int32_t gc_tok_token_id(const gc_tok *tok, const char *piece) {
  return gc_tok_token_id_n(tok, piece, strlen(piece));
}

/* ---------------------------------------------------------------------------------------
 * Pair map, sized once for the merges of the file (kept at most half full).
 */
int gc__tok_pairmap_init(gc__tok_pairmap *m, size_t expected) {
  memset(m, 0, sizeof *m);
  size_t cap = 64;
  while (cap < expected * 2 + 2) {
    if (cap > ((size_t)1 << 31)) return MR_ENOMEM;
    cap *= 2;
  }
  m->key = mr_malloc(cap * sizeof *m->key);
  m->rank = mr_malloc(cap * sizeof *m->rank);
  m->val = mr_malloc(cap * sizeof *m->val);
  if (!m->key || !m->rank || !m->val) {
    gc__tok_pairmap_close(m);
    return MR_ENOMEM;
  }
  memset(m->key, 0xff, cap * sizeof *m->key);
  m->mask = (uint32_t)(cap - 1);
  return 0;
}

static int pairmap_grow(gc__tok_pairmap *m) {
  gc__tok_pairmap g;
  if (gc__tok_pairmap_init(&g, (size_t)m->mask + 1)) return MR_ENOMEM;
  for (uint32_t i = 0; i <= m->mask; i++)
    if (m->key[i] != GC__TOK_PAIR_EMPTY)
      gc__tok_pairmap_put(&g, (int32_t)(m->key[i] >> 32), (int32_t)(uint32_t)m->key[i],
                          m->rank[i], m->val[i]);
  gc__tok_pairmap_close(m);
  *m = g;
  return 0;
}

int gc__tok_pairmap_put(gc__tok_pairmap *m, int32_t a, int32_t b, uint32_t rank, int32_t val) {
  if ((uint64_t)(m->n + 1) * 2 > (uint64_t)m->mask + 1)
    if (pairmap_grow(m)) return MR_ENOMEM;
  uint64_t k = (uint64_t)(uint32_t)a << 32 | (uint32_t)b;
  uint64_t h = k * 0x9E3779B97F4A7C15ull;
  uint32_t i = (uint32_t)(h >> 32) & m->mask;
  while (m->key[i] != GC__TOK_PAIR_EMPTY && m->key[i] != k) i = (i + 1) & m->mask;
  if (m->key[i] == GC__TOK_PAIR_EMPTY) m->n++;
  m->key[i] = k;
  m->rank[i] = rank;
  m->val[i] = val;
  return 0;
}

void gc__tok_pairmap_close(gc__tok_pairmap *m) {
  mr_free(m->key);
  mr_free(m->rank);
  mr_free(m->val);
  memset(m, 0, sizeof *m);
}

/* ---------------------------------------------------------------------------------------
 * UTF-8. The second byte of a 3- or 4-byte sequence has a narrower range after E0, ED, F0
 * and F4 (no overlongs, no surrogates, nothing past U+10FFFF): Unicode table 3-7.
 */
static inline void second_range(unsigned char lead, unsigned char *lo, unsigned char *hi) {
  *lo = 0x80;
  *hi = 0xBF;
  if (lead == 0xE0) *lo = 0xA0;
  else if (lead == 0xED) *hi = 0x9F;
  else if (lead == 0xF0) *lo = 0x90;
  else if (lead == 0xF4) *hi = 0x8F;
}

static inline size_t lead_need(unsigned char c) {
  if (c >= 0xC2 && c <= 0xDF) return 2;
  if (c >= 0xE0 && c <= 0xEF) return 3;
  if (c >= 0xF0 && c <= 0xF4) return 4;
  return 0; /* a continuation byte, C0, C1 or F5..FF: never valid as a lead */
}

size_t gc__tok_utf8_valid_prefix(const char *str, size_t n) {
  const unsigned char *s = (const unsigned char *)str;
  size_t i = 0;
  while (i < n) {
    /* ASCII runs, 8 bytes at a time. */
    while (i + 8 <= n) {
      uint64_t w;
      memcpy(&w, s + i, 8);
      if (w & 0x8080808080808080ull) break;
      i += 8;
    }
    if (i >= n) break;
    unsigned char c = s[i];
    if (c < 0x80) {
      i++;
      continue;
    }
    size_t need = lead_need(c);
    if (!need || i + need > n) return i;
    unsigned char lo, hi;
    second_range(c, &lo, &hi);
    if (s[i + 1] < lo || s[i + 1] > hi) return i;
    for (size_t k = 2; k < need; k++)
      if ((s[i + k] & 0xC0) != 0x80) return i;
    i += need;
  }
  return n;
}

uint32_t gc__tok_utf8_decode(const char *str, size_t n, size_t *len) {
  const unsigned char *s = (const unsigned char *)str;
  unsigned char c = s[0];
  size_t l = gc__tok_utf8_len(c);
  if (l > n) l = n; /* never for valid input; keeps a bad caller inside the buffer */
  *len = l;
  switch (l) {
  case 1: return c;
  case 2: return (uint32_t)(c & 0x1F) << 6 | (s[1] & 0x3F);
  case 3: return (uint32_t)(c & 0x0F) << 12 | (uint32_t)(s[1] & 0x3F) << 6 | (s[2] & 0x3F);
  default:
    return (uint32_t)(c & 0x07) << 18 | (uint32_t)(s[1] & 0x3F) << 12 |
           (uint32_t)(s[2] & 0x3F) << 6 | (s[3] & 0x3F);
  }
}

size_t gc__tok_utf8_encode(uint32_t cp, char *out) {
  unsigned char *o = (unsigned char *)out;
  if (cp < 0x80) {
    o[0] = (unsigned char)cp;
    return 1;
  }
  if (cp < 0x800) {
    o[0] = (unsigned char)(0xC0 | cp >> 6);
    o[1] = (unsigned char)(0x80 | (cp & 0x3F));
    return 2;
  }
  if (cp < 0x10000) {
    o[0] = (unsigned char)(0xE0 | cp >> 12);
    o[1] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
    o[2] = (unsigned char)(0x80 | (cp & 0x3F));
    return 3;
  }
  o[0] = (unsigned char)(0xF0 | cp >> 18);
  o[1] = (unsigned char)(0x80 | ((cp >> 12) & 0x3F));
  o[2] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
  o[3] = (unsigned char)(0x80 | (cp & 0x3F));
  return 4;
}

/*
 * The lossy decoder's state machine. With nothing held, a byte is ASCII (out), a valid lead
 * (held; `need` is the sequence's length) or never valid (U+FFFD). With a sequence held, a
 * byte in the range allowed at that position extends it (out when complete); any other byte
 * ends the held bytes as one U+FFFD (they are a maximal subpart: the longest prefix of a
 * valid sequence) and is then looked at afresh.
 */
int gc__tok_lossy_feed(gc__tok_lossy *d, const char *str, size_t n, gc__tok_buf *out) {
  const unsigned char *s = (const unsigned char *)str;
  size_t i = 0;
  while (i < n) {
    if (d->n == 0) {
      size_t j = i;
      while (j < n && s[j] < 0x80) j++;
      if (j > i && gc__tok_buf_put(out, s + i, j - i)) return MR_ENOMEM;
      i = j;
      if (i >= n) break;
      unsigned char c = s[i++];
      size_t need = lead_need(c);
      if (!need) {
        if (gc__tok_buf_put(out, GC__TOK_REPL, 3)) return MR_ENOMEM;
      } else {
        d->pend[0] = c;
        d->n = 1;
        d->need = (uint8_t)need;
      }
      continue;
    }
    unsigned char c = s[i];
    unsigned char lo = 0x80, hi = 0xBF;
    if (d->n == 1) second_range(d->pend[0], &lo, &hi);
    if (c >= lo && c <= hi) {
      d->pend[d->n++] = c;
      i++;
      if (d->n == d->need) {
        if (gc__tok_buf_put(out, d->pend, d->n)) return MR_ENOMEM;
        d->n = 0;
      }
    } else {
      if (gc__tok_buf_put(out, GC__TOK_REPL, 3)) return MR_ENOMEM;
      d->n = 0; /* c is looked at again as a fresh byte */
    }
  }
  return 0;
}

int gc__tok_lossy_end(gc__tok_lossy *d, gc__tok_buf *out) {
  if (d->n == 0) return 0;
  d->n = 0;
  return gc__tok_buf_put(out, GC__TOK_REPL, 3);
}

/* ---------------------------------------------------------------------------------------
 * Unicode classes.
 */
bool gc__tok_is_ws(uint32_t c) {
  /* The White_Space property (PropList.txt), unchanged since Unicode 6.3. */
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F ||
         c == 0x205F || c == 0x3000;
}

bool gc__tok_is_numeric(uint32_t c) {
  if (c < 0x80) return c >= '0' && c <= '9';
  utf8proc_category_t k = utf8proc_category((utf8proc_int32_t)c);
  return k == UTF8PROC_CATEGORY_ND || k == UTF8PROC_CATEGORY_NL || k == UTF8PROC_CATEGORY_NO;
}

bool gc__tok_is_pyspace(uint32_t c) {
  /* CPython's _PyUnicode_IsWhitespace: bidirectional class WS, B or S, or category Zs. */
  if (c < 0x80) return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20);
  const utf8proc_property_t *p = utf8proc_get_property((utf8proc_int32_t)c);
  return p->category == UTF8PROC_CATEGORY_ZS || p->bidi_class == UTF8PROC_BIDI_CLASS_WS ||
         p->bidi_class == UTF8PROC_BIDI_CLASS_B || p->bidi_class == UTF8PROC_BIDI_CLASS_S;
}

/* ---------------------------------------------------------------------------------------
 * GPT-2's byte <-> char table: the printable bytes '!'..'~', 0xA1..0xAC and 0xAE..0xFF stand
 * for themselves; the other 68 bytes, in increasing order, for U+0100, U+0101, ... U+0143.
 * (tests/unit/test_tokenizer.c rebuilds it from that rule.)
 */
const uint16_t gc__tok_byte_cp[256] = {
    0x100, 0x101, 0x102, 0x103, 0x104, 0x105, 0x106, 0x107, 0x108, 0x109, 0x10A, 0x10B, 0x10C, 0x10D, 0x10E, 0x10F,
    0x110, 0x111, 0x112, 0x113, 0x114, 0x115, 0x116, 0x117, 0x118, 0x119, 0x11A, 0x11B, 0x11C, 0x11D, 0x11E, 0x11F,
    0x120, 0x021, 0x022, 0x023, 0x024, 0x025, 0x026, 0x027, 0x028, 0x029, 0x02A, 0x02B, 0x02C, 0x02D, 0x02E, 0x02F,
    0x030, 0x031, 0x032, 0x033, 0x034, 0x035, 0x036, 0x037, 0x038, 0x039, 0x03A, 0x03B, 0x03C, 0x03D, 0x03E, 0x03F,
    0x040, 0x041, 0x042, 0x043, 0x044, 0x045, 0x046, 0x047, 0x048, 0x049, 0x04A, 0x04B, 0x04C, 0x04D, 0x04E, 0x04F,
    0x050, 0x051, 0x052, 0x053, 0x054, 0x055, 0x056, 0x057, 0x058, 0x059, 0x05A, 0x05B, 0x05C, 0x05D, 0x05E, 0x05F,
    0x060, 0x061, 0x062, 0x063, 0x064, 0x065, 0x066, 0x067, 0x068, 0x069, 0x06A, 0x06B, 0x06C, 0x06D, 0x06E, 0x06F,
    0x070, 0x071, 0x072, 0x073, 0x074, 0x075, 0x076, 0x077, 0x078, 0x079, 0x07A, 0x07B, 0x07C, 0x07D, 0x07E, 0x121,
    0x122, 0x123, 0x124, 0x125, 0x126, 0x127, 0x128, 0x129, 0x12A, 0x12B, 0x12C, 0x12D, 0x12E, 0x12F, 0x130, 0x131,
    0x132, 0x133, 0x134, 0x135, 0x136, 0x137, 0x138, 0x139, 0x13A, 0x13B, 0x13C, 0x13D, 0x13E, 0x13F, 0x140, 0x141,
    0x142, 0x0A1, 0x0A2, 0x0A3, 0x0A4, 0x0A5, 0x0A6, 0x0A7, 0x0A8, 0x0A9, 0x0AA, 0x0AB, 0x0AC, 0x143, 0x0AE, 0x0AF,
    0x0B0, 0x0B1, 0x0B2, 0x0B3, 0x0B4, 0x0B5, 0x0B6, 0x0B7, 0x0B8, 0x0B9, 0x0BA, 0x0BB, 0x0BC, 0x0BD, 0x0BE, 0x0BF,
    0x0C0, 0x0C1, 0x0C2, 0x0C3, 0x0C4, 0x0C5, 0x0C6, 0x0C7, 0x0C8, 0x0C9, 0x0CA, 0x0CB, 0x0CC, 0x0CD, 0x0CE, 0x0CF,
    0x0D0, 0x0D1, 0x0D2, 0x0D3, 0x0D4, 0x0D5, 0x0D6, 0x0D7, 0x0D8, 0x0D9, 0x0DA, 0x0DB, 0x0DC, 0x0DD, 0x0DE, 0x0DF,
    0x0E0, 0x0E1, 0x0E2, 0x0E3, 0x0E4, 0x0E5, 0x0E6, 0x0E7, 0x0E8, 0x0E9, 0x0EA, 0x0EB, 0x0EC, 0x0ED, 0x0EE, 0x0EF,
    0x0F0, 0x0F1, 0x0F2, 0x0F3, 0x0F4, 0x0F5, 0x0F6, 0x0F7, 0x0F8, 0x0F9, 0x0FA, 0x0FB, 0x0FC, 0x0FD, 0x0FE, 0x0FF,
};

/* The inverse for U+0100..U+0143: the byte each of the 68 remapped chars stands for. */
static int16_t cp_byte_hi[0x44];
static pthread_once_t cp_byte_once = PTHREAD_ONCE_INIT;
static void cp_byte_init(void) {
  for (int b = 0; b < 256; b++)
    if (gc__tok_byte_cp[b] >= 0x100) cp_byte_hi[gc__tok_byte_cp[b] - 0x100] = (int16_t)b;
}

int gc__tok_cp_byte(uint32_t cp) {
  if (cp < 0x100) return gc__tok_byte_cp[cp] == cp ? (int)cp : -1;
  if (cp > 0x143) return -1;
  pthread_once(&cp_byte_once, cp_byte_init);
  return cp_byte_hi[cp - 0x100];
}

int gc__tok_bytes_to_bl(const char *str, size_t n, gc__tok_buf *out) {
  const unsigned char *s = (const unsigned char *)str;
  if (gc__tok_buf_reserve(out, n * 2)) return MR_ENOMEM;
  char *o = out->p + out->n;
  for (size_t i = 0; i < n; i++) o += gc__tok_utf8_encode(gc__tok_byte_cp[s[i]], o);
  out->n = (size_t)(o - out->p);
  out->p[out->n] = '\0';
  return 0;
}

bool gc__tok_bl_to_bytes(const char *s, size_t n, gc__tok_buf *out, int *rc) {
  *rc = 0;
  size_t mark = out->n;
  for (size_t i = 0; i < n;) {
    size_t l;
    uint32_t cp = gc__tok_utf8_decode(s + i, n - i, &l);
    int b = gc__tok_cp_byte(cp);
    if (b < 0) {
      out->n = mark;
      if (out->p) out->p[mark] = '\0';
      return false;
    }
    unsigned char c = (unsigned char)b;
    if (gc__tok_buf_put(out, &c, 1)) {
      *rc = MR_ENOMEM;
      return false;
    }
    i += l;
  }
  return true;
}

/* ---------------------------------------------------------------------------------------
 * Trie.
 */
void gc__tok_trie_init(gc__tok_trie *t) {
  memset(t, 0, sizeof *t);
  for (int i = 0; i < 256; i++) t->root[i] = -1;
}

static int32_t trie_node(gc__tok_trie *t, uint8_t byte) {
  if (t->n == t->cap) {
    uint32_t cap = t->cap ? t->cap * 2 : 64;
    gc__tok_trie_node *p = mr_realloc(t->node, (size_t)cap * sizeof *p);
    if (!p) return -1;
    t->node = p;
    t->cap = cap;
  }
  t->node[t->n] = (gc__tok_trie_node){.child = -1, .sibling = -1, .term = -1, .byte = byte};
  return (int32_t)t->n++;
}

int gc__tok_trie_add(gc__tok_trie *t, const char *str, size_t n, int32_t term) {
  const unsigned char *s = (const unsigned char *)str;
  if (n == 0) return 0;
  int32_t cur = t->root[s[0]];
  if (cur < 0) {
    if ((cur = trie_node(t, s[0])) < 0) return MR_ENOMEM;
    t->root[s[0]] = cur;
  }
  for (size_t i = 1; i < n; i++) {
    int32_t c = t->node[cur].child;
    while (c >= 0 && t->node[c].byte != s[i]) c = t->node[c].sibling;
    if (c < 0) {
      if ((c = trie_node(t, s[i])) < 0) return MR_ENOMEM;
      t->node[c].sibling = t->node[cur].child;
      t->node[cur].child = c;
    }
    cur = c;
  }
  t->node[cur].term = term;
  t->any = true;
  return 0;
}

void gc__tok_trie_close(gc__tok_trie *t) {
  mr_free(t->node);
  gc__tok_trie_init(t);
}

/* ---------------------------------------------------------------------------------------
 * Oniguruma.
 */
static pthread_once_t onig_once = PTHREAD_ONCE_INIT;
static int onig_init_rc;
/* Making and freeing regex objects is not safe from two threads at once, even for different
 * objects (Oniguruma's FAQ, "Thread safe" (B); the onig crate locks onig_new the same way).
 * Searching a compiled regex from many threads is: the object is read-only then. */
static pthread_mutex_t onig_new_lock = PTHREAD_MUTEX_INITIALIZER;

static void tok_onig_init(void) {
  OnigEncoding enc[1] = {ONIG_ENCODING_UTF8};
  onig_init_rc = onig_initialize(enc, 1);
}

/* Rust's regex::escape: these are the characters it escapes (regex-syntax is_meta_character);
 * Oniguruma reads a backslash before any of them as the character itself. */
static bool is_meta(char c) {
  return strchr("\\.+*?()|[]{}^$#&-~", c) != NULL && c != '\0';
}

int gc__tok_re_new(regex_t **out, const char *pat, size_t len, bool literal, const char *label,
                   const char *path, mr_err *e) {
  *out = NULL;
  pthread_once(&onig_once, tok_onig_init);
  if (onig_init_rc != ONIG_NORMAL)
    return mr_err_set(e, MR_EINTERNAL, "%s: %s: cannot initialise Oniguruma (%d)", label, path,
                      onig_init_rc);
  gc__tok_buf esc = {0};
  const char *p = pat;
  size_t n = len;
  if (literal) {
    for (size_t i = 0; i < len; i++) {
      if (is_meta(pat[i]) && gc__tok_buf_put(&esc, "\\", 1)) goto out_nomem;
      if (gc__tok_buf_put(&esc, pat + i, 1)) goto out_nomem;
    }
    p = esc.p ? esc.p : "";
    n = esc.n;
  }
  OnigErrorInfo einfo;
  memset(&einfo, 0, sizeof einfo);
  pthread_mutex_lock(&onig_new_lock);
  int r = onig_new(out, (const OnigUChar *)p, (const OnigUChar *)p + n, ONIG_OPTION_NONE,
                   ONIG_ENCODING_UTF8, ONIG_SYNTAX_DEFAULT, &einfo);
  pthread_mutex_unlock(&onig_new_lock);
  gc__tok_buf_close(&esc);
  if (r != ONIG_NORMAL) {
    *out = NULL;
    OnigUChar msg[ONIG_MAX_ERROR_MESSAGE_LEN];
    onig_error_code_to_str(msg, r, &einfo);
    return mr_err_set(e, r == ONIGERR_MEMORY ? MR_ENOMEM : MR_EFORMAT,
                      "%s: %s: invalid regular expression: %s", label, path, (char *)msg);
  }
  return 0;
out_nomem:
  gc__tok_buf_close(&esc);
  return mr_err_set(e, MR_ENOMEM, "%s: %s: out of memory", label, path);
}

void gc__tok_re_free(regex_t *re) {
  if (!re) return;
  pthread_mutex_lock(&onig_new_lock);
  onig_free(re);
  pthread_mutex_unlock(&onig_new_lock);
}

static int matches_put(gc__tok_matches *m, uint32_t s, uint32_t e, bool hit) {
  if (m->n == m->cap) {
    size_t cap = m->cap ? m->cap * 2 : 32;
    gc__tok_match *v = mr_realloc(m->v, cap * sizeof *v);
    if (!v) return MR_ENOMEM;
    m->v = v;
    m->cap = cap;
  }
  m->v[m->n++] = (gc__tok_match){.s = s, .e = e, .m = hit};
  return 0;
}

/*
 * The onig crate's FindMatches iterator: search from last_end to the end of the text (the
 * whole text is the subject, so look-behind sees before last_end); an empty match right
 * where the previous match ended is not taken: last_end moves one character on and the
 * search is repeated. HF's Pattern::find_matches then fills the gaps between matches with
 * unmatched pieces, and answers [(0, 0) unmatched] for an empty text.
 */
int gc__tok_re_find(regex_t *re, OnigRegion *region, const char *str, size_t n,
                    gc__tok_matches *out, mr_err *e) {
  out->n = 0;
  if (n == 0) return matches_put(out, 0, 0, false) ? mr_err_set(e, MR_ENOMEM, "out of memory") : 0;
  const OnigUChar *s = (const OnigUChar *)str, *end = s + n;
  size_t last_end = 0, prev = 0, last_match_end = 0;
  bool have_last = false;
  while (last_end <= n) {
    int r = onig_search(re, s, end, s + last_end, end, region, ONIG_OPTION_NONE);
    if (r == ONIG_MISMATCH) break;
    if (r < 0) {
      OnigUChar msg[ONIG_MAX_ERROR_MESSAGE_LEN];
      onig_error_code_to_str(msg, r);
      return mr_err_set(e, MR_EINTERNAL, "regular expression search failed: %s", (char *)msg);
    }
    size_t ms = (size_t)region->beg[0], me = (size_t)region->end[0];
    if (ms == me && have_last && last_match_end == me) {
      last_end += last_end < n ? gc__tok_utf8_len(s[last_end]) : 1;
      continue;
    }
    last_end = me;
    last_match_end = me;
    have_last = true;
    if (prev != ms && matches_put(out, (uint32_t)prev, (uint32_t)ms, false)) goto out_nomem;
    if (matches_put(out, (uint32_t)ms, (uint32_t)me, true)) goto out_nomem;
    prev = me;
  }
  if (prev != n && matches_put(out, (uint32_t)prev, (uint32_t)n, false)) goto out_nomem;
  return 0;
out_nomem:
  return mr_err_set(e, MR_ENOMEM, "out of memory");
}
