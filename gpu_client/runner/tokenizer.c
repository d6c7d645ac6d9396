/*
 * tokenizer.c - gc_tok_load / gc_tok_free and the queries of tokenizer.h (but the lookup by
 * text, gc_tok_token_id, which the config loader needs too: tok_util.c), plus the step
 * after parsing that HF does in AddedVocabulary::add_tokens: the ids of the added tokens,
 * their normalized forms and the tries that find them, and the per-id table decode reads.
 */
#include "gpu_client/runner/tok_internal.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

/* ---------------------------------------------------------------------------------------
 * Release.
 */
void gc__tok_clear(gc_tok *t) {
  gc__tok_bpe_close(&t->bpe);
  for (uint32_t i = 0; i < t->n_norm; i++) {
    mr_free(t->norm[i].str);
    gc__tok_re_free(t->norm[i].re);
  }
  mr_free(t->norm);
  for (uint32_t i = 0; i < t->n_pre; i++) gc__tok_re_free(t->pre[i].re);
  mr_free(t->pre);
  for (uint32_t i = 0; i < t->n_dec; i++) {
    mr_free(t->dec[i].content);
    gc__tok_re_free(t->dec[i].re);
  }
  mr_free(t->dec);
  if (t->tpl) {
    for (uint32_t i = 0; i < t->tpl->n; i++) mr_free(t->tpl->item[i].ids);
    mr_free(t->tpl->item);
    mr_free(t->tpl);
  }
  for (uint32_t i = 0; i < t->n_added; i++) {
    mr_free(t->added[i].content);
    mr_free(t->added[i].norm);
  }
  mr_free(t->added);
  gc__tok_strmap_close(&t->added_map);
  gc__tok_trie_close(&t->trie_raw);
  gc__tok_trie_close(&t->trie_norm);
  mr_free(t->piece_off);
  mr_free(t->piece_len);
  mr_free(t->flags);
  gc__tok_buf_close(&t->pieces);
  memset(t, 0, sizeof *t);
}

void gc_tok_free(gc_tok *tok) {
  if (!tok) return;
  gc__tok_clear(tok);
  mr_free(tok);
}

/* ---------------------------------------------------------------------------------------
 * gc__tok_finish.
 */
static bool same_token(const gc__tok_added *a, const gc__tok_added *b) {
  return a->len == b->len && memcmp(a->content, b->content, a->len) == 0 &&
         a->single_word == b->single_word && a->lstrip == b->lstrip && a->rstrip == b->rstrip &&
         a->normalized == b->normalized && a->special == b->special;
}

/* Runs the tokenizer's normalizers over an added token's content (HF: the normalized form
 * an added token with normalized = true is matched by, and decoded as). */
static int normalize_content(const gc_tok *t, const char *s, size_t n, char **out,
                             size_t *out_len, mr_err *e) {
  gc__tok_normbuf nb = {0};
  gc__tok_matches m = {0};
  OnigRegion *region = onig_region_new();
  const char *res;
  size_t rl;
  int rc = region ? gc__tok_normalize(t, s, n, &res, &rl, &nb, region, &m, e)
                  : mr_err_set(e, MR_ENOMEM, "out of memory");
  *out = NULL;
  if (!rc && (rl != n || memcmp(res, s, n) != 0)) {
    *out = mr_malloc(rl + 1);
    if (!*out) {
      rc = mr_err_set(e, MR_ENOMEM, "out of memory");
    } else {
      memcpy(*out, res, rl);
      (*out)[rl] = '\0';
      *out_len = rl;
    }
  }
  if (region) onig_region_free(region, 1);
  gc__tok_normbuf_close(&nb);
  mr_free(m.v);
  return rc;
}

/*
 * HF AddedVocabulary::add_tokens over the file's list, in order. The file's "id" is not
 * used (HF only warns when it differs): a token whose content is already a token (added
 * before, or in the model's vocabulary) takes that id, any other the next free id counting
 * from the model's vocabulary size. A token listed again with the same properties is
 * skipped; with other properties it replaces the earlier one at that id.
 */
static int assign_added(gc_tok *t, const char *label, gc__tok_pairmap *live,
                        gc__tok_pairmap *normed, gc__tok_strmap *special, uint32_t *moved,
                        mr_err *e) {
  /* live: id -> the index of the token that holds it now; normed: id -> the index of the
   * token whose normalized form the id last got (HF's normalized_cache, kept even when a
   * later token takes the id). */
  uint32_t next_id = t->bpe.model_size;
  for (uint32_t k = 0; k < t->n_added; k++) {
    gc__tok_added *a = &t->added[k];
    int32_t file_id = a->id;
    a->id = -1;
    if (a->len == 0) continue;
    int32_t id = gc__tok_strmap_get(&t->added_map, a->content, a->len);
    uint32_t r;
    int32_t cur;
    if (id >= 0 && gc__tok_pairmap_get(live, id, 0, &r, &cur) && same_token(&t->added[cur], a))
      continue;
    if (id < 0) id = gc__tok_strmap_get(&t->bpe.vocab, a->content, a->len);
    if (id < 0) {
      if (next_id > GC_TOK_MAX_ID)
        return mr_err_set(e, MR_ERANGE, "%s: added_tokens[%u]: id %u is past %u", label, k,
                          next_id, GC_TOK_MAX_ID);
      id = (int32_t)next_id++;
    }
    if (id != file_id && !t->tiktoken && ++*moved <= 3)
      mr_log(MR_LOG_WARN, "%s: added_tokens[%u] \"%.60s\" has id %d in the file but gets %d "
             "(as in HF tokenizers)", label, k, a->content, file_id, id);
    a->id = id;
    if (a->normalized && t->n_norm) {
      size_t nl = 0;
      int rc = normalize_content(t, a->content, a->len, &a->norm, &nl, e);
      if (rc) return rc;
      a->norm_len = (uint32_t)nl;
      if (a->norm && gc__tok_pairmap_put(normed, id, 1, 0, (int32_t)k)) goto out_nomem;
    }
    if (gc__tok_strmap_put(&t->added_map, a->content, a->len, id, NULL)) goto out_nomem;
    if (a->special && gc__tok_strmap_put(special, a->content, a->len, 1, NULL)) goto out_nomem;
    if (gc__tok_pairmap_put(live, id, 0, 0, (int32_t)k)) goto out_nomem;
  }
  return 0;
out_nomem:
  return mr_err_set(e, MR_ENOMEM, "%s: out of memory", label);
}

static int set_piece(gc_tok *t, uint32_t id, const char *s, size_t n) {
  t->piece_off[id] = t->pieces.n;
  t->piece_len[id] = (uint32_t)n;
  return gc__tok_buf_put(&t->pieces, s, n) || gc__tok_buf_put(&t->pieces, "", 1);
}

int gc__tok_finish(gc_tok *t, const char *label, mr_err *e) {
  gc__tok_pairmap live = {0}, normed = {0};
  gc__tok_strmap special = {0};
  gc__tok_buf tmp = {0};
  int rc = 0;
  gc__tok_trie_init(&t->trie_raw);
  gc__tok_trie_init(&t->trie_norm);
  if (gc__tok_pairmap_init(&live, t->n_added) || gc__tok_pairmap_init(&normed, t->n_added))
    goto out_nomem;
  uint32_t moved = 0; /* tokens whose id differs from the file's: 3 warnings, then a count */
  if ((rc = assign_added(t, label, &live, &normed, &special, &moved, e))) goto out;
  if (moved > 3)
    mr_log(MR_LOG_WARN, "%s: %u added tokens in all get another id than the file's", label, moved);

  /* The live added tokens (the last one given each id): the tries and the decode text. A
   * normalized token is matched by its normalized form; two tokens matched by the same text
   * are refused (HF would pick one by hash order), one whose normalized form is "" is never
   * matched (as in HF). vocab_size covers the model's ids, the added ones and the
   * template's. */
  uint32_t max_id = 0;
  for (uint32_t i = 0; i < t->bpe.vocab.n; i++)
    if ((uint32_t)t->bpe.vocab.ent[i].val > max_id) max_id = (uint32_t)t->bpe.vocab.ent[i].val;
  for (uint32_t k = 0; k < t->n_added; k++)
    if (t->added[k].id >= 0 && (uint32_t)t->added[k].id > max_id) max_id = (uint32_t)t->added[k].id;
  if (t->tpl)
    for (uint32_t i = 0; i < t->tpl->n; i++)
      for (uint32_t j = 0; j < t->tpl->item[i].n; j++)
        if ((uint32_t)t->tpl->item[i].ids[j] > max_id) max_id = (uint32_t)t->tpl->item[i].ids[j];
  if (t->bpe.vocab.n == 0 && t->n_added == 0) {
    rc = mr_err_set(e, MR_EFORMAT, "%s: the vocabulary is empty", label);
    goto out;
  }
  t->vocab_size = max_id + 1;
  t->piece_off = mr_malloc((size_t)t->vocab_size * sizeof *t->piece_off);
  t->piece_len = mr_calloc(t->vocab_size, sizeof *t->piece_len);
  t->flags = mr_calloc(t->vocab_size, 1);
  if (!t->piece_off || !t->piece_len || !t->flags) goto out_nomem;
  memset(t->piece_off, 0xff, (size_t)t->vocab_size * sizeof *t->piece_off);

  /* The model's vocabulary: one text per id (HF's vocab_r would pick one of two texts with
   * the same id at random, so that is refused). */
  for (uint32_t i = 0; i < t->bpe.vocab.n; i++) {
    const gc__tok_strmap_ent *x = &t->bpe.vocab.ent[i];
    const char *s = gc__tok_strmap_key(&t->bpe.vocab, i);
    /* A key listed twice keeps the last value: skip the shadowed entries. */
    if (gc__tok_strmap_get(&t->bpe.vocab, s, x->len) != x->val) continue;
    if (t->piece_off[x->val] != UINT64_MAX) {
      rc = mr_err_set(e, MR_EFORMAT, "%s: model.vocab: id %d is given to both \"%.40s\" and "
                      "\"%.40s\"", label, x->val, t->pieces.p + t->piece_off[x->val], s);
      goto out;
    }
    if (set_piece(t, (uint32_t)x->val, s, x->len)) goto out_nomem;
  }
  for (uint32_t k = 0; k < t->n_added; k++) {
    gc__tok_added *a = &t->added[k];
    uint32_t r;
    int32_t cur, nk;
    if (a->id < 0 || !gc__tok_pairmap_get(&live, a->id, 0, &r, &cur) || cur != (int32_t)k) continue;
    /* Decoded as the normalized form the id last got, if any (HF normalized_cache). */
    const char *ds = a->content;
    size_t dl = a->len;
    if (gc__tok_pairmap_get(&normed, a->id, 1, &r, &nk)) {
      ds = t->added[nk].norm;
      dl = t->added[nk].norm_len;
    }
    /* A normalized token is matched by that same text (HF reads the same cache). */
    const char *ms = a->normalized ? ds : a->content;
    size_t ml = a->normalized ? dl : a->len;
    if (t->tiktoken) {
      /* tiktoken decodes a special token to its UTF-8 bytes: give the ByteLevel decoder
       * those bytes spelled as byte chars. */
      tmp.n = 0;
      if (gc__tok_bytes_to_bl(a->content, a->len, &tmp)) goto out_nomem;
      ds = tmp.p;
      dl = tmp.n;
    }
    if (set_piece(t, (uint32_t)a->id, ds, dl)) goto out_nomem;
    t->flags[a->id] |= GC__TOK_F_ADDED;
    gc__tok_trie *tr = a->normalized ? &t->trie_norm : &t->trie_raw;
    if (ml == 0) continue; /* normalizes to "": HF's matcher never finds it either */
    /* Duplicate texts: look the text up in the trie first. */
    int32_t cur_node = tr->root[(unsigned char)ms[0]];
    for (size_t j = 1; cur_node >= 0 && j < ml; j++) {
      int32_t c = tr->node[cur_node].child;
      while (c >= 0 && tr->node[c].byte != (unsigned char)ms[j]) c = tr->node[c].sibling;
      cur_node = c;
    }
    if (cur_node >= 0 && tr->node[cur_node].term >= 0) {
      rc = mr_err_set(e, MR_ENOTSUP, "%s: added tokens \"%.40s\" and \"%.40s\" are matched by "
                      "the same text: not supported (which one HF picks depends on its hash "
                      "order)", label, t->added[tr->node[cur_node].term].content, a->content);
      goto out;
    }
    if (gc__tok_trie_add(tr, ms, ml, (int32_t)k)) goto out_nomem;
  }
  /* Special: the ids whose decode text is a special token's content (HF checks the text). */
  for (uint32_t id = 0; id < t->vocab_size && special.n; id++) {
    if (t->piece_off[id] == UINT64_MAX) continue;
    if (!(t->flags[id] & GC__TOK_F_ADDED)) continue;
    if (gc__tok_strmap_get(&special, t->pieces.p + t->piece_off[id], t->piece_len[id]) >= 0)
      t->flags[id] |= GC__TOK_F_SPECIAL;
  }
  for (uint32_t i = 0; i < special.n; i++) {
    int32_t id = gc__tok_strmap_get(&t->bpe.vocab, gc__tok_strmap_key(&special, i),
                                    special.ent[i].len);
    if (id >= 0 && !(t->flags[id] & GC__TOK_F_ADDED)) t->flags[id] |= GC__TOK_F_SPECIAL;
  }
  if (t->tiktoken)
    for (uint32_t k = 0; k < t->n_added; k++)
      if (t->added[k].id >= 0) t->flags[t->added[k].id] |= GC__TOK_F_SPECIAL;

  /* Raw mode: byte-level BPE whose last pre-tokenizer step is ByteLevel. */
  if (t->n_pre && t->pre[t->n_pre - 1].kind == GC__P_BYTELEVEL && !t->bpe.cont_prefix &&
      !t->bpe.eow_suffix) {
    bool all = true;
    for (int c = 0; c < 256 && all; c++) {
      char u[2];
      size_t ul = gc__tok_utf8_encode(gc__tok_byte_cp[c], u);
      all = gc__tok_strmap_get(&t->bpe.vocab, u, ul) >= 0;
    }
    if (all) {
      t->bpe.raw_mode = true;
      t->pre[t->n_pre - 1].map_bytes = false;
    }
  }
  if ((rc = gc__tok_bpe_finish(&t->bpe, e))) goto out;

  /* One line for logs. */
  {
    char pre[96] = "";
    for (uint32_t i = 0; i < t->n_pre && strlen(pre) < 80; i++) {
      static const char *const names[] = {"Split", "ByteLevel", "Metaspace", "Digits"};
      snprintf(pre + strlen(pre), sizeof pre - strlen(pre), "%s%s", i ? "+" : "",
               names[t->pre[i].kind]);
    }
    snprintf(t->desc, sizeof t->desc, "%s BPE%s, %u tokens + %u added, %s%s%s",
             t->tiktoken ? "tiktoken" : "tokenizer.json",
             t->bpe.raw_mode ? " byte-level" : t->bpe.byte_fallback ? " byte-fallback" : "",
             t->bpe.model_size, t->n_added, t->n_norm ? "normalizer, " : "",
             t->n_pre ? pre : "no pre-tokenizer", t->tpl ? ", template" : "");
  }
  goto out;
out_nomem:
  rc = mr_err_set(e, MR_ENOMEM, "%s: out of memory", label);
out:
  gc__tok_pairmap_close(&live);
  gc__tok_pairmap_close(&normed);
  gc__tok_strmap_close(&special);
  gc__tok_buf_close(&tmp);
  return rc;
}

/* ---------------------------------------------------------------------------------------
 * Loading.
 */
static int load_common(gc_tok **out, bool tiktoken, const char *data, size_t len,
                       const char *config, size_t config_len, const char *label,
                       const char *config_label, mr_err *e) {
  *out = NULL;
  gc_tok *t = mr_calloc(1, sizeof *t);
  if (!t) return mr_err_set(e, MR_ENOMEM, "%s: out of memory", label);
  t->bos_id = t->eos_id = -1;
  int rc = tiktoken ? gc__tok_parse_tiktoken(t, data, len, config, config_len, label, e)
                    : gc__tok_parse_json(t, data, len, label, e);
  if (!rc) rc = gc__tok_finish(t, label, e);
  if (!rc && config) rc = gc__tok_parse_config(t, config, config_len, config_label, e);
  if (rc) {
    gc_tok_free(t);
    return rc;
  }
  *out = t;
  return 0;
}

int gc_tok_load_json(gc_tok **out, const char *json, size_t len, const char *config_json,
                     size_t config_len, const char *label, mr_err *e) {
  MR_ASSERT(out && (json || len == 0));
  return load_common(out, false, json ? json : "", len, config_json, config_len,
                     label ? label : "tokenizer.json", "tokenizer_config.json", e);
}

int gc_tok_load_tiktoken(gc_tok **out, const char *model, size_t len, const char *config_json,
                         size_t config_len, const char *label, mr_err *e) {
  MR_ASSERT(out && (model || len == 0));
  return load_common(out, true, model ? model : "", len, config_json, config_len,
                     label ? label : "tiktoken.model", "tokenizer_config.json", e);
}

static bool is_file(const char *p) {
  struct stat sb;
  return stat(p, &sb) == 0 && S_ISREG(sb.st_mode);
}

int gc_tok_load(gc_tok **out, const char *path, mr_err *e) {
  MR_ASSERT(out && path);
  *out = NULL;
  char file[4096], cfg[4096], dir[4096];
  struct stat sb;
  if (stat(path, &sb) != 0)
    return mr_err_set(e, errno == ENOENT ? MR_ENOTFOUND : MR_EIO, "%s: %s", path, strerror(errno));
  bool tiktoken;
  if (S_ISDIR(sb.st_mode)) {
    if (snprintf(dir, sizeof dir, "%s", path) >= (int)sizeof dir ||
        snprintf(file, sizeof file, "%s/tokenizer.json", path) >= (int)sizeof file)
      return mr_err_set(e, MR_ERANGE, "%s: path too long", path);
    tiktoken = false;
    if (!is_file(file)) {
      snprintf(file, sizeof file, "%s/tiktoken.model", path);
      tiktoken = true;
      if (!is_file(file))
        return mr_err_set(e, MR_ENOTFOUND, "%s: neither tokenizer.json nor tiktoken.model is "
                          "there", path);
    }
  } else {
    if (snprintf(file, sizeof file, "%s", path) >= (int)sizeof file)
      return mr_err_set(e, MR_ERANGE, "%s: path too long", path);
    size_t n = strlen(path);
    tiktoken = !(n >= 5 && strcmp(path + n - 5, ".json") == 0);
    const char *slash = strrchr(path, '/');
    if (slash) snprintf(dir, sizeof dir, "%.*s", (int)(slash - path), path);
    else snprintf(dir, sizeof dir, ".");
    if (slash == path) snprintf(dir, sizeof dir, "/");
  }
  if (snprintf(cfg, sizeof cfg, "%s/tokenizer_config.json", dir) >= (int)sizeof cfg)
    return mr_err_set(e, MR_ERANGE, "%s: path too long", path);
  char *data = NULL, *cdata = NULL;
  size_t len = 0, clen = 0;
  int rc = mr_file_read(file, GC_TOK_MAX_FILE_BYTES, &data, &len, e);
  if (rc) return rc;
  bool have_cfg = is_file(cfg);
  if (have_cfg && (rc = mr_file_read(cfg, MR_JSON_MAX_BYTES, &cdata, &clen, e))) goto out;
  rc = load_common(out, tiktoken, data, len, have_cfg ? cdata : NULL, clen, file, cfg, e);
out:
  mr_free(data);
  mr_free(cdata);
  return rc;
}

/* ---------------------------------------------------------------------------------------
 * Queries.
 */
uint32_t gc_tok_vocab_size(const gc_tok *tok) { return tok->vocab_size; }

const char *gc_tok_id_to_piece(const gc_tok *tok, int32_t id, size_t *len) {
  if (id < 0 || (uint32_t)id >= tok->vocab_size || tok->piece_off[id] == UINT64_MAX) {
    if (len) *len = 0;
    return NULL;
  }
  if (len) *len = tok->piece_len[id];
  return tok->pieces.p + tok->piece_off[id];
}

bool gc_tok_is_added(const gc_tok *tok, int32_t id) {
  return id >= 0 && (uint32_t)id < tok->vocab_size && (tok->flags[id] & GC__TOK_F_ADDED);
}

bool gc_tok_is_special(const gc_tok *tok, int32_t id) {
  return id >= 0 && (uint32_t)id < tok->vocab_size && (tok->flags[id] & GC__TOK_F_SPECIAL);
}

size_t gc_tok_added_count(const gc_tok *tok) { return tok->n_added; }

void gc_tok_added_at(const gc_tok *tok, size_t i, gc_tok_added_info *info) {
  MR_ASSERT(i < tok->n_added);
  const gc__tok_added *a = &tok->added[i];
  *info = (gc_tok_added_info){.id = a->id, .content = a->content, .special = a->special,
                              .single_word = a->single_word, .lstrip = a->lstrip,
                              .rstrip = a->rstrip, .normalized = a->normalized};
}

int32_t gc_tok_bos_id(const gc_tok *tok) { return tok->bos_id; }
int32_t gc_tok_eos_id(const gc_tok *tok) { return tok->eos_id; }
bool gc_tok_add_bos(const gc_tok *tok) { return tok->add_bos; }
bool gc_tok_add_eos(const gc_tok *tok) { return tok->add_eos; }
const char *gc_tok_describe(const gc_tok *tok) { return tok->desc; }
