/*
 * tok_bpe.c - the BPE model (HF models/bpe: model.rs merge_word + word.rs merge_all) and its
 * word cache.
 *
 * A pre-token becomes one symbol per character (per byte in raw mode, see gc__tok_bpe), each
 * the id of that character in the vocabulary; a character missing from it becomes its
 * <0xNN> byte tokens (byte_fallback), or the unk token (consecutive ones fused into one with
 * fuse_unk), or nothing. Then merges are applied lowest rank first, and among equal ranks
 * leftmost first, until no adjacent pair has a merge:
 *
 *   symbols  h e l l o        heap of candidate merges, keyed (rank << 32 | position)
 *            0 1 2 3 4        pop the smallest; skip it if stale (its left symbol was
 *   merge "l l" at 2  ->  h e ll o    merged away, or the pair there now makes another
 *                                     token); else merge and push the pairs the new symbol
 *                                     forms with its neighbours.
 *
 * The stale test compares the new token id, not the rank, exactly as HF does: two merges
 * that make the same token ("a bc", "ab c") are interchangeable there, and this keeps the
 * same order of merges in that case too.
 */
#include "gpu_client/runner/tok_internal.h"

#include <stdio.h>
#include <string.h>

/* ---------------------------------------------------------------------------------------
 * Setup after loading: the raw-mode tables, the byte-fallback and ASCII tables, the cache.
 */
int gc__tok_bpe_finish(gc__tok_bpe *b, mr_err *e) {
  for (int i = 0; i < 256; i++) {
    char name[8];
    snprintf(name, sizeof name, "<0x%02X>", i);
    b->byte_fb[i] = gc__tok_strmap_get(&b->vocab, name, 6);
  }
  for (int i = 0; i < 128; i++) {
    char c = (char)i;
    b->ascii_id[i] = gc__tok_strmap_get(&b->vocab, &c, 1);
  }
  if (b->raw_mode) {
    /* Every byte must have its char in the vocabulary (else unk / byte fallback would see
     * the mapped char's UTF-8 bytes, which raw mode does not have): the caller checked. */
    gc__tok_buf tmp = {0};
    for (uint32_t i = 0; i < b->vocab.n; i++) {
      const gc__tok_strmap_ent *x = &b->vocab.ent[i];
      int rc;
      tmp.n = 0;
      if (!gc__tok_bl_to_bytes(b->vocab.blob.p + x->off, x->len, &tmp, &rc)) {
        if (rc) goto out_nomem;
        continue;
      }
      /* The map from byte-level strings to bytes is one to one, so no two tokens collide;
       * x->val is the id the vocabulary gives that text (the last one if repeated). */
      int32_t id = gc__tok_strmap_get(&b->vocab, b->vocab.blob.p + x->off, x->len);
      if (gc__tok_strmap_put(&b->raw, tmp.p ? tmp.p : "", tmp.n, id, NULL)) goto out_nomem;
    }
    gc__tok_buf_close(&tmp);
    for (int i = 0; i < 256; i++) {
      unsigned char c = (unsigned char)i;
      b->byte_id[i] = gc__tok_strmap_get(&b->raw, (const char *)&c, 1);
    }
    goto cache;
  out_nomem:
    gc__tok_buf_close(&tmp);
    return mr_err_set(e, MR_ENOMEM, "out of memory building the byte-level vocabulary");
  }
cache:
  for (int i = 0; i < GC__TOK_CACHE_SHARDS; i++) {
    gc__tok_cache_shard *s = &b->cache[i];
    if (pthread_mutex_init(&s->lock, NULL))
      return mr_err_set(e, MR_EINTERNAL, "cannot initialise the word cache's locks");
    s->max = 4096;
  }
  b->cache_on = true;
  return 0;
}

void gc__tok_bpe_close(gc__tok_bpe *b) {
  gc__tok_strmap_close(&b->vocab);
  gc__tok_strmap_close(&b->raw);
  gc__tok_pairmap_close(&b->merges);
  mr_free(b->cont_prefix);
  mr_free(b->eow_suffix);
  if (b->cache_on) {
    for (int i = 0; i < GC__TOK_CACHE_SHARDS; i++) {
      gc__tok_cache_shard *s = &b->cache[i];
      pthread_mutex_destroy(&s->lock);
      mr_free(s->slot);
      mr_free(s->ent);
      mr_free(s->ids);
      gc__tok_buf_close(&s->keys);
    }
  }
  memset(b, 0, sizeof *b);
}

void gc__tok_bpe_work_close(gc__tok_bpe_work *w) {
  mr_free(w->sym);
  mr_free(w->heap);
  mr_free(w->ids);
  gc__tok_buf_close(&w->tmp);
  memset(w, 0, sizeof *w);
}

/* ---------------------------------------------------------------------------------------
 * Cache. Lookups and inserts of one shard hold its mutex; the ids are copied out, so no
 * pointer into a shard outlives the lock. A shard is an open-addressing table of entries
 * whose keys and ids live in two growing arrays of the shard; it is emptied when full
 * rather than evicting one entry (a cache of pre-tokens: the hot ones come back at once).
 */
static bool cache_get(gc__tok_cache_shard *s, uint32_t h, const char *key, size_t n,
                      gc_tok_ids *out, int *rc) {
  bool hit = false;
  *rc = 0;
  pthread_mutex_lock(&s->lock);
  if (s->slot) {
    for (uint32_t j = h & s->mask;; j = (j + 1) & s->mask) {
      uint32_t k = s->slot[j];
      if (!k) break;
      const struct gc__tok_cache_ent *x = &s->ent[k - 1];
      if (x->hash == h && x->key_len == n && memcmp(s->keys.p + x->key_off, key, n) == 0) {
        /* A word may have no ids (chars the vocabulary lacks, no unk): then s->ids may be
         * NULL. */
        *rc = x->n_ids ? gc__tok_ids_put(out, s->ids + x->ids_off, x->n_ids) : 0;
        hit = true;
        break;
      }
    }
  }
  pthread_mutex_unlock(&s->lock);
  return hit;
}

/* Best effort: a failed allocation only means the word is not cached. */
static void cache_put(gc__tok_cache_shard *s, uint32_t h, const char *key, size_t n,
                      const int32_t *ids, size_t n_ids) {
  pthread_mutex_lock(&s->lock);
  if (!s->slot) {
    uint32_t cap = 2;
    while (cap < s->max * 2) cap *= 2;
    s->slot = mr_calloc(cap, sizeof *s->slot);
    s->ent = mr_malloc(s->max * sizeof *s->ent);
    if (!s->slot || !s->ent) {
      mr_free(s->slot);
      mr_free(s->ent);
      s->slot = NULL;
      s->ent = NULL;
      goto out_unlock;
    }
    s->mask = cap - 1;
  }
  if (s->n >= s->max) {
    /* Full: start again (HF stops inserting instead; the ids are the same either way). */
    memset(s->slot, 0, ((size_t)s->mask + 1) * sizeof *s->slot);
    s->n = 0;
    s->keys.n = 0;
    s->n_ids = 0;
  }
  uint32_t j = h & s->mask;
  for (;; j = (j + 1) & s->mask) {
    uint32_t k = s->slot[j];
    if (!k) break;
    const struct gc__tok_cache_ent *x = &s->ent[k - 1];
    if (x->hash == h && x->key_len == n && memcmp(s->keys.p + x->key_off, key, n) == 0)
      goto out_unlock; /* another thread put it first */
  }
  if (s->cap_ids - s->n_ids < n_ids) {
    size_t cap = s->cap_ids ? s->cap_ids : 4096;
    while (cap - s->n_ids < n_ids) cap *= 2;
    int32_t *p = mr_realloc(s->ids, cap * sizeof *p);
    if (!p) goto out_unlock;
    s->ids = p;
    s->cap_ids = cap;
  }
  uint32_t key_off = (uint32_t)s->keys.n;
  if (gc__tok_buf_put(&s->keys, key, n)) goto out_unlock;
  if (n_ids) memcpy(s->ids + s->n_ids, ids, n_ids * sizeof *ids);
  s->ent[s->n] = (struct gc__tok_cache_ent){.hash = h, .key_off = key_off,
                                            .key_len = (uint32_t)n,
                                            .ids_off = (uint32_t)s->n_ids,
                                            .n_ids = (uint32_t)n_ids};
  s->n_ids += n_ids;
  s->slot[j] = ++s->n;
out_unlock:
  pthread_mutex_unlock(&s->lock);
}

/* ---------------------------------------------------------------------------------------
 * Symbols and the merge loop.
 */
static int sym_push(gc__tok_bpe_work *w, size_t *n, int32_t c, uint32_t len) {
  if (*n == w->cap_sym) {
    size_t cap = w->cap_sym ? w->cap_sym * 2 : 64;
    struct gc__tok_sym *p = mr_realloc(w->sym, cap * sizeof *p);
    if (!p) return MR_ENOMEM;
    w->sym = p;
    w->cap_sym = cap;
  }
  w->sym[*n] = (struct gc__tok_sym){.c = c, .prev = (int32_t)*n - 1, .next = -1, .len = len};
  if (*n) w->sym[*n - 1].next = (int32_t)*n;
  (*n)++;
  return 0;
}

/* Binary min-heap on key = rank << 32 | position. */
static int heap_push(gc__tok_bpe_work *w, size_t *n, uint64_t key, int32_t new_id) {
  if (*n == w->cap_heap) {
    size_t cap = w->cap_heap ? w->cap_heap * 2 : 64;
    struct gc__tok_heap_ent *p = mr_realloc(w->heap, cap * sizeof *p);
    if (!p) return MR_ENOMEM;
    w->heap = p;
    w->cap_heap = cap;
  }
  struct gc__tok_heap_ent *h = w->heap;
  size_t i = (*n)++;
  while (i > 0) {
    size_t p = (i - 1) / 2;
    if (h[p].key <= key) break;
    h[i] = h[p];
    i = p;
  }
  h[i] = (struct gc__tok_heap_ent){.key = key, .new_id = new_id};
  return 0;
}

static struct gc__tok_heap_ent heap_pop(gc__tok_bpe_work *w, size_t *n) {
  struct gc__tok_heap_ent *h = w->heap, top = h[0], last = h[--(*n)];
  size_t i = 0;
  for (;;) {
    size_t c = 2 * i + 1;
    if (c >= *n) break;
    if (c + 1 < *n && h[c + 1].key < h[c].key) c++;
    if (h[c].key >= last.key) break;
    h[i] = h[c];
    i = c;
  }
  if (*n) h[i] = last;
  return top;
}

/*
 * HF word.rs merge_all. Symbols stay where they were pushed: a merge grows the left symbol
 * over the right one, marks the right one dead (len 0) and relinks prev/next around it, so
 * that a heap entry's position keeps naming the same left symbol, and the live symbols are
 * still in text order when read left to right at the end.
 */
static int merge_all(const gc__tok_bpe *b, gc__tok_bpe_work *w, size_t n_sym) {
  struct gc__tok_sym *sym = w->sym;
  size_t nh = 0;
  uint32_t rank;
  int32_t val;
  /* Every adjacent pair that has a merge is a candidate. */
  for (size_t i = 0; i + 1 < n_sym; i++)
    if (gc__tok_pairmap_get(&b->merges, sym[i].c, sym[i + 1].c, &rank, &val))
      if (heap_push(w, &nh, (uint64_t)rank << 32 | i, val)) return MR_ENOMEM;
  while (nh) {
    struct gc__tok_heap_ent top = heap_pop(w, &nh);
    size_t pos = (size_t)(uint32_t)top.key;
    /* Entries are never removed from the heap; one whose left symbol died, or that now
     * has no right neighbour, or whose pair no longer makes the same token, is skipped
     * here (the pair it stood for was pushed again when it changed). */
    if (sym[pos].len == 0 || sym[pos].next < 0) continue;
    size_t nx = (size_t)sym[pos].next;
    struct gc__tok_sym right = sym[nx];
    if (!gc__tok_pairmap_get(&b->merges, sym[pos].c, right.c, &rank, &val) || val != top.new_id)
      continue; /* stale */
    /* Merge: the left symbol becomes the new token and swallows the right one. */
    sym[pos].c = top.new_id;
    sym[pos].len += right.len;
    sym[pos].next = right.next;
    sym[nx].len = 0;
    if (right.next >= 0) sym[right.next].prev = (int32_t)pos;
    /* The two pairs the new symbol forms with its neighbours are new candidates; the old
     * ones with the same positions went stale. */
    if (sym[pos].prev >= 0) {
      size_t pv = (size_t)sym[pos].prev;
      if (gc__tok_pairmap_get(&b->merges, sym[pv].c, sym[pos].c, &rank, &val))
        if (heap_push(w, &nh, (uint64_t)rank << 32 | pv, val)) return MR_ENOMEM;
    }
    if (sym[pos].next >= 0) {
      size_t nn = (size_t)sym[pos].next;
      if (gc__tok_pairmap_get(&b->merges, sym[pos].c, sym[nn].c, &rank, &val))
        if (heap_push(w, &nh, (uint64_t)rank << 32 | pos, val)) return MR_ENOMEM;
    }
  }
  return 0;
}

/*
 * HF merge_word's loop over the characters of a pre-token (char mode): each char looked up
 * (with the continuing-subword prefix unless it is the first, the end-of-word suffix if it
 * is the last); a miss becomes byte tokens, or an unk, or nothing. Unks are held as
 * "pending" so that fuse_unk can grow one over a run of unknown chars; a pending unk goes
 * out before the next known char, but stays pending across byte-fallback tokens, so it
 * lands after them: HF's order, kept.
 */
static int word_symbols(const gc__tok_bpe *b, const char *s, size_t n, gc__tok_bpe_work *w,
                        size_t *n_sym) {
  int32_t unk = -1;     /* pending unk token and its byte length */
  uint32_t unk_len = 0;
  for (size_t i = 0; i < n;) {
    size_t cl = gc__tok_utf8_len((unsigned char)s[i]);
    if (cl > n - i) cl = n - i;
    bool first = i == 0, last = i + cl == n;
    const char *key = s + i;
    size_t klen = cl;
    int32_t id;
    if ((first || !b->cont_prefix) && (!last || !b->eow_suffix)) {
      /* The char alone: ASCII from a table, the rest through the hash map. */
      id = cl == 1 ? b->ascii_id[(unsigned char)s[i] & 0x7F] : gc__tok_strmap_get(&b->vocab, key, klen);
    } else {
      w->tmp.n = 0;
      if ((!first && b->cont_prefix && gc__tok_buf_put(&w->tmp, b->cont_prefix, b->cont_len)) ||
          gc__tok_buf_put(&w->tmp, s + i, cl) ||
          (last && b->eow_suffix && gc__tok_buf_put(&w->tmp, b->eow_suffix, b->eow_len)))
        return MR_ENOMEM;
      key = w->tmp.p;
      klen = w->tmp.n;
      id = gc__tok_strmap_get(&b->vocab, key, klen);
    }
    if (id >= 0) {
      if (unk >= 0) {
        if (sym_push(w, n_sym, unk, unk_len)) return MR_ENOMEM;
        unk = -1;
      }
      if (sym_push(w, n_sym, id, (uint32_t)cl)) return MR_ENOMEM;
      i += cl;
      continue;
    }
    if (b->byte_fallback) {
      /* Every byte of the looked-up text (prefix and suffix included) must have its
       * <0xNN> token; a pending unk stays pending across them, as in HF. */
      bool all = true;
      for (size_t k = 0; k < klen && all; k++) all = b->byte_fb[(unsigned char)key[k]] >= 0;
      if (all) {
        for (size_t k = 0; k < klen; k++)
          if (sym_push(w, n_sym, b->byte_fb[(unsigned char)key[k]], 1)) return MR_ENOMEM;
        i += cl;
        continue;
      }
    }
    if (b->unk_missing) return MR_ENOTFOUND; /* HF: UnkTokenOutOfVocabulary, here too */
    if (b->unk_id >= 0) {
      if (unk >= 0 && b->fuse_unk) {
        unk_len += (uint32_t)cl;
      } else {
        if (unk >= 0 && sym_push(w, n_sym, unk, unk_len)) return MR_ENOMEM;
        unk = b->unk_id;
        unk_len = (uint32_t)cl;
      }
    }
    i += cl;
  }
  if (unk >= 0 && sym_push(w, n_sym, unk, unk_len)) return MR_ENOMEM;
  return 0;
}

/* HF BPE::tokenize_with_cache: the whole-piece lookup (ignore_merges), the cache, then the
 * merge. Words of 256 bytes and more are not cached (HF's MAX_LENGTH). */
int gc__tok_bpe_tokenize(const gc__tok_bpe *b, const char *s, size_t n, gc__tok_bpe_work *w,
                         gc_tok_ids *out) {
  if (b->ignore_merges) {
    int32_t id = gc__tok_strmap_get(b->raw_mode ? &b->raw : &b->vocab, s, n);
    if (id >= 0) return gc__tok_ids_put(out, &id, 1);
  }
  uint64_t h64 = 0;
  gc__tok_cache_shard *shard = NULL;
  if (b->cache_on && n < GC__TOK_CACHE_MAX_WORD) {
    h64 = gc__tok_hash(s, n);
    /* The cache is the one mutable part of a const gc_tok (tokenizer.h, Threads). */
    shard = (gc__tok_cache_shard *)&b->cache[h64 >> 60];
    int rc;
    if (cache_get(shard, (uint32_t)h64, s, n, out, &rc)) return rc;
  }
  size_t n_sym = 0;
  if (b->raw_mode) {
    /* One symbol per byte: every byte has its token (checked at load). */
    for (size_t i = 0; i < n; i++)
      if (sym_push(w, &n_sym, b->byte_id[(unsigned char)s[i]], 1)) return MR_ENOMEM;
  } else {
    int rc = word_symbols(b, s, n, w, &n_sym);
    if (rc) return rc;
  }
  if (merge_all(b, w, n_sym)) return MR_ENOMEM;
  size_t first = out->n;
  for (size_t i = 0; i < n_sym; i++)
    if (w->sym[i].len && gc__tok_ids_put(out, &w->sym[i].c, 1)) return MR_ENOMEM;
  if (shard) cache_put(shard, (uint32_t)h64, s, n, out->n > first ? out->v + first : NULL,
                       out->n - first);
  return 0;
}
