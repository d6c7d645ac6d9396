/*
 * tok_internal.h - the internals shared by the tokenizer's files (prefix gc__tok_):
 *
 *   tok_util.c     buffers (gc_tok_ids_close, gc_tok_text_close), hash maps and the token
 *                  lookup by text (gc_tok_token_id), UTF-8 (validation, lossy decoding,
 *                  classes), the GPT-2 byte <-> char table, the Oniguruma wrapper
 *   tok_json.c     the loaders: tokenizer.json, tokenizer_config.json, tiktoken.model
 *   tok_bpe.c      the BPE model (merges by rank, byte fallback, unk) and its word cache
 *   tok_encode.c   added tokens, normalizers, pre-tokenizers, post-processors, encode
 *   tok_decode.c   the decoder pipeline as a streaming machine (decode = stream + flush)
 *   tokenizer.c    load / free and the queries of tokenizer.h
 *
 * Calls go one way, down: tokenizer.c calls tok_json.c, tok_encode.c and tok_bpe.c;
 * tok_encode.c calls tok_bpe.c; all of them and tok_decode.c call tok_util.c; nothing
 * calls back up into tokenizer.c.
 *
 * Nothing here is part of the public contract (tokenizer.h).
 */
#ifndef GC_TOK_INTERNAL_H
#define GC_TOK_INTERNAL_H

#include "gpu_client/runner/tokenizer.h"

#include <oniguruma.h>
#include <pthread.h>

/* ---------------------------------------------------------------------------------------
 * Growable byte buffer (mr_malloc'ed).
 */
typedef struct gc__tok_buf {
  char *p;
  size_t n, cap;
} gc__tok_buf;
int gc__tok_buf_reserve(gc__tok_buf *b, size_t extra);
int gc__tok_buf_put(gc__tok_buf *b, const void *s, size_t n);
void gc__tok_buf_close(gc__tok_buf *b);

/* Appends n ids to v (growing it). */
int gc__tok_ids_put(gc_tok_ids *v, const int32_t *ids, size_t n);

/* ---------------------------------------------------------------------------------------
 * Hash maps.
 */
uint64_t gc__tok_hash(const void *p, size_t n);

/* Byte string -> int32, open addressing. Keys are copied into one blob; inserting an
 * existing key overwrites its value (the last one wins, as in a JSON object read by serde). */
typedef struct gc__tok_strmap_ent {
  uint64_t off;   /* key bytes at blob.p + off */
  uint32_t len;
  int32_t val;
  uint32_t hash;  /* low 32 bits of gc__tok_hash */
} gc__tok_strmap_ent;
typedef struct gc__tok_strmap {
  uint32_t *slot;           /* [mask + 1] entry index + 1, 0 = empty */
  uint32_t mask;
  gc__tok_strmap_ent *ent;  /* [n] in insertion order */
  uint32_t n, ent_cap;
  gc__tok_buf blob;
} gc__tok_strmap;
/* Sets key -> val; *fresh (may be NULL) tells whether the key was new. */
int gc__tok_strmap_put(gc__tok_strmap *m, const char *key, size_t len, int32_t val, bool *fresh);
/* The value of key, or -1. */
int32_t gc__tok_strmap_get(const gc__tok_strmap *m, const char *key, size_t len);
void gc__tok_strmap_close(gc__tok_strmap *m);
static inline const char *gc__tok_strmap_key(const gc__tok_strmap *m, uint32_t i) {
  return m->blob.p + m->ent[i].off;
}

/* (left id, right id) -> (rank, new id): the BPE merges. */
typedef struct gc__tok_pairmap {
  uint64_t *key;   /* [mask + 1] (left << 32 | right), GC__TOK_PAIR_EMPTY = empty */
  uint32_t *rank;
  int32_t *val;
  uint32_t mask, n;
} gc__tok_pairmap;
#define GC__TOK_PAIR_EMPTY UINT64_MAX
int gc__tok_pairmap_init(gc__tok_pairmap *m, size_t expected);
/* Sets (a, b) -> (rank, val), overwriting an earlier merge of the same pair (the last one
 * of the file wins, as in HF's map). */
int gc__tok_pairmap_put(gc__tok_pairmap *m, int32_t a, int32_t b, uint32_t rank, int32_t val);
static inline bool gc__tok_pairmap_get(const gc__tok_pairmap *m, int32_t a, int32_t b,
                                       uint32_t *rank, int32_t *val) {
  if (!m->key) return false;
  uint64_t k = (uint64_t)(uint32_t)a << 32 | (uint32_t)b;
  uint64_t h = k * 0x9E3779B97F4A7C15ull;
  uint32_t i = (uint32_t)(h >> 32) & m->mask;
  for (;;) {
    uint64_t s = m->key[i];
    if (s == k) {
      *rank = m->rank[i];
      *val = m->val[i];
      return true;
    }
    if (s == GC__TOK_PAIR_EMPTY) return false;
    i = (i + 1) & m->mask;
  }
}
void gc__tok_pairmap_close(gc__tok_pairmap *m);

/* ---------------------------------------------------------------------------------------
 * UTF-8 and Unicode classes.
 */
#define GC__TOK_REPL "\xEF\xBF\xBD" /* U+FFFD */

/* Length of the valid UTF-8 prefix of s (n if all valid). */
size_t gc__tok_utf8_valid_prefix(const char *s, size_t n);
/* Decodes the code point at s (valid UTF-8, n > 0); *len gets its byte length. */
uint32_t gc__tok_utf8_decode(const char *s, size_t n, size_t *len);
/* Writes cp as UTF-8 into out (4 bytes room); returns the length. */
size_t gc__tok_utf8_encode(uint32_t cp, char *out);
static inline size_t gc__tok_utf8_len(unsigned char c) {
  return c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
}

/* Incremental "lossy" UTF-8 decoder: valid sequences pass through, each maximal invalid
 * subpart becomes one U+FFFD (the Unicode "substitution of maximal subparts" practice that
 * Rust's String::from_utf8_lossy and Python's decode("utf-8", "replace") follow). A
 * sequence that may still complete is held back between calls. */
typedef struct gc__tok_lossy {
  unsigned char pend[4];
  uint8_t n;     /* bytes held */
  uint8_t need;  /* total length of the held sequence */
} gc__tok_lossy;
int gc__tok_lossy_feed(gc__tok_lossy *d, const char *s, size_t n, gc__tok_buf *out);
/* Emits U+FFFD for an unfinished sequence and resets. */
int gc__tok_lossy_end(gc__tok_lossy *d, gc__tok_buf *out);

/* Unicode White_Space (Rust char::is_whitespace, regex \s). */
bool gc__tok_is_ws(uint32_t cp);
/* Rust char::is_numeric: general category Nd, Nl or No. */
bool gc__tok_is_numeric(uint32_t cp);
/* Python str.isspace: category Zs or bidirectional class WS, B or S. */
bool gc__tok_is_pyspace(uint32_t cp);

/* The GPT-2 byte <-> char table (HF pre_tokenizers/byte_level.rs bytes_char): byte b is
 * written as code point gc__tok_byte_cp[b], which is 1 or 2 UTF-8 bytes. */
extern const uint16_t gc__tok_byte_cp[256];
/* The byte a code point stands for, or -1 if it is not one of the 256. */
int gc__tok_cp_byte(uint32_t cp);
/* Maps raw bytes to their byte-level string (appends to out). */
int gc__tok_bytes_to_bl(const char *s, size_t n, gc__tok_buf *out);
/* Maps a byte-level string back to bytes: true and the bytes appended to out if every char
 * is one of the 256, false (out unchanged) otherwise. */
bool gc__tok_bl_to_bytes(const char *s, size_t n, gc__tok_buf *out, int *rc);

/* ---------------------------------------------------------------------------------------
 * Regular expressions: Oniguruma, configured as HF's Rust `onig` crate configures it
 * (Regex::new: ONIG_OPTION_NONE, ONIG_SYNTAX_DEFAULT, UTF-8) so that patterns mean the
 * same here as there. `literal` escapes the pattern first, as HF does with regex::escape
 * for {"String": ...} patterns.
 */
int gc__tok_re_new(regex_t **out, const char *pat, size_t len, bool literal, const char *label,
                   const char *path, mr_err *e);
void gc__tok_re_free(regex_t *re);

/* One piece of HF's Pattern::find_matches: [s, e) with whether it matched. */
typedef struct gc__tok_match {
  uint32_t s, e;
  bool m;
} gc__tok_match;
typedef struct gc__tok_matches {
  gc__tok_match *v;
  size_t n, cap;
} gc__tok_matches;
/* HF's find_matches of re over s[0, n): the whole string cut into matched and unmatched
 * pieces in order (empty matches kept, as the onig crate's find_iter yields them). */
int gc__tok_re_find(regex_t *re, OnigRegion *region, const char *s, size_t n,
                    gc__tok_matches *out, mr_err *e);

/* ---------------------------------------------------------------------------------------
 * The parts of a tokenizer.
 */
enum gc__tok_norm_kind {
  GC__N_NFC, GC__N_NFD, GC__N_NFKC, GC__N_NFKD, GC__N_LOWERCASE, GC__N_STRIP, GC__N_PREPEND,
  GC__N_REPLACE,
};
typedef struct gc__tok_norm {
  int kind;
  bool left, right;      /* STRIP */
  char *str;             /* PREPEND: the text; REPLACE: the content (owned) */
  size_t str_len;
  regex_t *re;           /* REPLACE */
} gc__tok_norm;

enum gc__tok_split_behavior {
  GC__B_REMOVED, GC__B_ISOLATED, GC__B_MERGED_PREV, GC__B_MERGED_NEXT, GC__B_CONTIGUOUS,
};
enum gc__tok_pre_kind { GC__P_SPLIT, GC__P_BYTELEVEL, GC__P_METASPACE, GC__P_DIGITS };
enum gc__tok_prepend { GC__PREPEND_ALWAYS, GC__PREPEND_FIRST, GC__PREPEND_NEVER };
typedef struct gc__tok_pre {
  int kind;
  regex_t *re;              /* SPLIT; BYTELEVEL with use_regex (the GPT-2 pattern) */
  int behavior;             /* SPLIT */
  bool invert;              /* SPLIT */
  bool add_prefix_space;    /* BYTELEVEL */
  bool map_bytes;           /* BYTELEVEL: write the byte-level chars (false when it is the
                               last step and the model reads raw bytes, see gc__tok_bpe) */
  char repl[4];             /* METASPACE replacement, UTF-8 */
  uint8_t repl_len;
  uint32_t repl_cp;
  int prepend;              /* METASPACE */
  bool split;               /* METASPACE */
  bool individual;          /* DIGITS */
} gc__tok_pre;

enum gc__tok_dec_kind {
  GC__D_REPLACE, GC__D_METASPACE, GC__D_STRIP, GC__D_BYTEFALLBACK, GC__D_BYTELEVEL, GC__D_FUSE,
};
typedef struct gc__tok_dec {
  int kind;
  regex_t *re;        /* REPLACE */
  char *content;      /* REPLACE (owned) */
  size_t content_len;
  uint32_t cp;        /* STRIP content / METASPACE replacement */
  uint32_t start, stop; /* STRIP */
  bool drop_first;    /* METASPACE: prepend_scheme != never (the first token loses them) */
} gc__tok_dec;

/* One item of a TemplateProcessing "single" template. */
typedef struct gc__tok_tpl_item {
  bool seq;           /* $A */
  int32_t *ids;       /* a special token's ids (owned) */
  uint32_t n;
} gc__tok_tpl_item;
typedef struct gc__tok_tpl {
  gc__tok_tpl_item *item;
  uint32_t n;
} gc__tok_tpl;

typedef struct gc__tok_added {
  char *content;      /* owned, NUL-terminated */
  uint32_t len;
  char *norm;         /* the normalizer's output for a normalized token when it differs
                         (matched against normalized text, and what decode writes), else
                         NULL (owned) */
  uint32_t norm_len;
  int32_t id;
  bool special, single_word, lstrip, rstrip, normalized;
} gc__tok_added;

/* A byte trie of added-token texts for leftmost-longest matching (HF: daachorse,
 * MatchKind::LeftmostLongest). */
typedef struct gc__tok_trie_node {
  int32_t child;    /* first child, -1 none */
  int32_t sibling;  /* next sibling, -1 none */
  int32_t term;     /* index into gc_tok.added of the token ending here, -1 none */
  uint8_t byte;
} gc__tok_trie_node;
typedef struct gc__tok_trie {
  int32_t root[256];         /* node of the first byte, -1 none */
  gc__tok_trie_node *node;
  uint32_t n, cap;
  bool any;
} gc__tok_trie;
int gc__tok_trie_add(gc__tok_trie *t, const char *s, size_t n, int32_t term);
void gc__tok_trie_init(gc__tok_trie *t);
void gc__tok_trie_close(gc__tok_trie *t);

/* The word cache: pre-token bytes -> ids, like HF's BPE cache (capacity 10000, words under
 * 256 bytes). Shards, each behind its own mutex, so that encode from many threads on one
 * gc_tok stays safe; a full shard is emptied and refilled. */
#define GC__TOK_CACHE_SHARDS 16
#define GC__TOK_CACHE_MAX_WORD 256
typedef struct gc__tok_cache_shard {
  pthread_mutex_t lock;
  uint32_t *slot;       /* [mask + 1] entry + 1 */
  uint32_t mask;
  struct gc__tok_cache_ent { uint32_t hash, key_off, key_len, ids_off, n_ids; } *ent;
  uint32_t n, max;
  gc__tok_buf keys;
  int32_t *ids;
  size_t n_ids, cap_ids;
} gc__tok_cache_shard;

typedef struct gc__tok_bpe {
  gc__tok_strmap vocab;     /* token text (as in the file) -> id */
  gc__tok_pairmap merges;
  uint32_t model_size;      /* entries of vocab (HF get_vocab_size: ids of added tokens
                               start there) */
  int32_t unk_id;           /* -1 none */
  bool unk_missing;         /* unk_token names no token: an unknown char is an error, as in
                               HF (UnkTokenOutOfVocabulary), which loads such files too */
  bool fuse_unk, byte_fallback, ignore_merges;
  char *cont_prefix;        /* continuing_subword_prefix (owned) or NULL */
  size_t cont_len;
  char *eow_suffix;         /* end_of_word_suffix (owned) or NULL */
  size_t eow_len;
  int32_t byte_fb[256];     /* byte_fallback: the id of "<0xNN>", -1 none */
  /* Raw mode (byte-level BPE with ByteLevel as the last pre-tokenizer step): pre-tokens
   * stay raw bytes instead of being mapped to the GPT-2 chars; each byte is one symbol
   * (byte_id), and `raw` maps the raw bytes of every token made only of the 256 chars to
   * its id. That is the same function as HF's on the mapped text, without the mapping. */
  bool raw_mode;
  int32_t byte_id[256];
  gc__tok_strmap raw;
  int32_t ascii_id[128];    /* char mode: the id of each ASCII char alone, -1 none */
  bool cache_on;
  gc__tok_cache_shard cache[GC__TOK_CACHE_SHARDS];
} gc__tok_bpe;

#define GC__TOK_F_ADDED 1u
#define GC__TOK_F_SPECIAL 2u  /* skipped by decode(skip_special_tokens) */

struct gc_tok {
  gc__tok_bpe bpe;
  gc__tok_norm *norm;       /* flattened normalizer Sequence */
  uint32_t n_norm;
  gc__tok_pre *pre;         /* flattened pre_tokenizer Sequence */
  uint32_t n_pre;
  gc__tok_dec *dec;         /* flattened decoder Sequence */
  uint32_t n_dec;
  bool has_decoder;         /* false: HF joins the tokens with " " */
  gc__tok_tpl *tpl;         /* the post_processor's TemplateProcessing, or NULL */
  gc__tok_added *added;     /* in file order */
  uint32_t n_added;
  gc__tok_strmap added_map; /* content -> index into added */
  gc__tok_trie trie_raw;    /* normalized = false tokens, matched in the input */
  gc__tok_trie trie_norm;   /* normalized = true tokens, matched in normalized text */
  regex_t *re_word_end;     /* \w$ and ^\w for single_word tokens (Rust regex \w) */
  regex_t *re_word_start;
  /* Per id (0 .. vocab_size): the text decode reads and flags. */
  uint32_t vocab_size;
  uint64_t *piece_off;      /* [vocab_size] into pieces.p, UINT64_MAX = no token */
  uint32_t *piece_len;
  gc__tok_buf pieces;
  uint8_t *flags;           /* [vocab_size] GC__TOK_F_* */
  int32_t bos_id, eos_id;
  bool add_bos, add_eos;
  bool tiktoken;            /* Kimi: tokenization_kimi.py's chunking rules apply */
  char desc[192];
};

/* Loader entry points (tok_json.c); *tok is zeroed and owned by the caller. */
int gc__tok_parse_json(gc_tok *tok, const char *json, size_t len, const char *label, mr_err *e);
int gc__tok_parse_tiktoken(gc_tok *tok, const char *model, size_t len, const char *config,
                           size_t config_len, const char *label, mr_err *e);
int gc__tok_parse_config(gc_tok *tok, const char *json, size_t len, const char *label,
                         mr_err *e);
/* After the parts are read: computes the added tokens' ids and normalized forms, the tries,
 * the per-id tables; label names the file in messages. */
int gc__tok_finish(gc_tok *tok, const char *label, mr_err *e);

/* tok_bpe.c */
int gc__tok_bpe_finish(gc__tok_bpe *b, mr_err *e);
void gc__tok_bpe_close(gc__tok_bpe *b);
/* Scratch of one encode call for the model. */
typedef struct gc__tok_bpe_work {
  struct gc__tok_sym { int32_t c; int32_t prev, next; uint32_t len; } *sym;
  size_t cap_sym;
  struct gc__tok_heap_ent { uint64_t key; int32_t new_id; } *heap;
  size_t cap_heap;
  gc__tok_buf tmp;
  int32_t *ids;
  size_t n_ids, cap_ids;
} gc__tok_bpe_work;
void gc__tok_bpe_work_close(gc__tok_bpe_work *w);
/* Appends the ids of one pre-token (n > 0 bytes) to out. Returns 0, MR_ENOMEM, or
 * MR_ENOTFOUND when it needs an unk token the vocabulary lacks. */
int gc__tok_bpe_tokenize(const gc__tok_bpe *b, const char *s, size_t n, gc__tok_bpe_work *w,
                         gc_tok_ids *out);

/* tok_encode.c: normalizes s[0, n) with tok's normalizers; *res / *res_len get the result,
 * which is s itself when nothing changed, else in nb->out. */
typedef struct gc__tok_normbuf {
  gc__tok_buf out, tmp; /* the result and the other half of the double buffer */
  gc__tok_buf u32;      /* code points for utf8proc */
} gc__tok_normbuf;
int gc__tok_normalize(const gc_tok *tok, const char *s, size_t n, const char **res,
                      size_t *res_len, gc__tok_normbuf *nb, OnigRegion *region,
                      gc__tok_matches *m, mr_err *e);
void gc__tok_normbuf_close(gc__tok_normbuf *nb);

/* tokenizer.c: releases the parts (the loaders' cleanup). */
void gc__tok_clear(gc_tok *tok);

#endif /* GC_TOK_INTERNAL_H */
