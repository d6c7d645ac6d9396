/*
 * tok_json.c - the loaders: Hugging Face tokenizer.json, tokenizer_config.json, and
 * Kimi-K2's tiktoken.model.
 *
 * tokenizer.json is read the way HF's serde code reads it (tokenizer/serialization.rs and
 * each component's Deserialize): the same required fields, the same defaults, the same
 * failures (a merge naming an unknown token, a bad "a b" merge line, an unknown version).
 * On top of HF, anything this implementation does not do is refused by name instead of
 * being approximated: unknown component types, BPE dropout, truncation and padding, and
 * the few combinations where it would need offsets it does not track. Every message names
 * the JSON path:
 *   tokenizer.json: pre_tokenizer.pretokenizers[1].type = "Whitespace": not supported
 *   (supported: Sequence, Split, ByteLevel, Metaspace, Digits)
 * Unknown keys are ignored, as serde ignores them.
 */
#include "gpu_client/runner/tok_internal.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <string.h>

/* Deepest nesting of Sequence components accepted. */
#define MAX_DEPTH 16
/* Most merges and pattern bytes accepted (far above real files: Qwen has 151387 merges). */
#define MAX_MERGES (1u << 26)
#define PATH_LEN 192

typedef struct ld {
  gc_tok *tok;
  const char *label;
  mr_err *e;
} ld;

/* ---------------------------------------------------------------------------------------
 * Field readers: each names "<label>: <path> = <value>" in its error.
 */
/* A path cut to fit ends in "..." (paths only ever name things in messages). */
static void fit(char *out, int n) {
  if (n >= PATH_LEN) memcpy(out + PATH_LEN - 4, "...", 4);
}
static void sub(char *out, const char *path, const char *key) {
  fit(out, snprintf(out, PATH_LEN, "%s%s%s", path, path[0] ? "." : "", key));
}
static void idx(char *out, const char *path, size_t i) {
  fit(out, snprintf(out, PATH_LEN, "%s[%zu]", path, i));
}

static int bad(ld *L, int code, const char *path, const cJSON *v, const char *what) {
  char desc[96];
  mr_json_describe(v, desc, sizeof desc);
  return mr_err_set(L->e, code, "%s: %s = %s: %s", L->label, path, desc, what);
}

static const cJSON *get(const cJSON *obj, const char *key) {
  return cJSON_GetObjectItemCaseSensitive(obj, key);
}

/* A bool field. Absent: dflt if optional (req false), else an error; null: dflt if
 * null_ok (Rust Option<bool>). */
static int get_bool(ld *L, const cJSON *obj, const char *key, const char *path, bool req,
                    bool null_ok, bool dflt, bool *out) {
  char p[PATH_LEN];
  sub(p, path, key);
  const cJSON *v = get(obj, key);
  if (!v && !req) {
    *out = dflt;
    return 0;
  }
  if (v && cJSON_IsNull(v) && null_ok) {
    *out = dflt;
    return 0;
  }
  if (!cJSON_IsBool(v)) return bad(L, MR_EFORMAT, p, v, "must be true or false");
  *out = cJSON_IsTrue(v);
  return 0;
}

/* A string field; *out NULL when absent (optional) or null (null_ok). */
static int get_str(ld *L, const cJSON *obj, const char *key, const char *path, bool req,
                   bool null_ok, const char **out) {
  char p[PATH_LEN];
  sub(p, path, key);
  const cJSON *v = get(obj, key);
  *out = NULL;
  if (!v && !req) return 0;
  if (v && cJSON_IsNull(v) && null_ok) return 0;
  if (!cJSON_IsString(v)) return bad(L, MR_EFORMAT, p, v, "must be a string");
  *out = v->valuestring;
  return 0;
}

static int get_uint(ld *L, const cJSON *v, const char *path, uint64_t hi, uint64_t *out) {
  mr_err sub_e;
  if (mr_json_u64(v, L->label, path, 0, hi, out, &sub_e))
    return mr_err_set(L->e, sub_e.code, "%s", sub_e.msg);
  return 0;
}

/* A single Unicode char given as a string (Rust `char`). */
static int get_char(ld *L, const cJSON *obj, const char *key, const char *path, uint32_t *cp,
                    char *utf8, uint8_t *len) {
  char p[PATH_LEN];
  sub(p, path, key);
  const cJSON *v = get(obj, key);
  if (!cJSON_IsString(v) || !v->valuestring[0]) return bad(L, MR_EFORMAT, p, v, "must be one character");
  size_t n = strlen(v->valuestring), l;
  uint32_t c = gc__tok_utf8_decode(v->valuestring, n, &l);
  if (l != n) return bad(L, MR_EFORMAT, p, v, "must be one character");
  *cp = c;
  if (utf8) {
    memcpy(utf8, v->valuestring, n);
    *len = (uint8_t)n;
  }
  return 0;
}

/* The "type" of a component, which must be one of `names` (NULL-terminated). Returns its
 * index, or a negative error naming the supported ones. */
static int get_type(ld *L, const cJSON *obj, const char *path, const char *const *names) {
  char p[PATH_LEN];
  sub(p, path, "type");
  if (!cJSON_IsObject(obj)) return bad(L, MR_EFORMAT, path, obj, "must be an object");
  const cJSON *v = get(obj, "type");
  if (!v)
    return mr_err_set(L->e, MR_ENOTSUP, "%s: %s has no \"type\": not supported (the untyped "
                      "legacy layout)", L->label, path[0] ? path : "top level");
  if (cJSON_IsString(v))
    for (int i = 0; names[i]; i++)
      if (strcmp(v->valuestring, names[i]) == 0) return i;
  char list[256] = "";
  for (int i = 0; names[i]; i++)
    snprintf(list + strlen(list), sizeof list - strlen(list), "%s%s", i ? ", " : "", names[i]);
  char desc[96];
  mr_json_describe(v, desc, sizeof desc);
  return mr_err_set(L->e, MR_ENOTSUP, "%s: %s = %s: not supported (supported: %s)", L->label,
                    p, desc, list);
}

static char *dup_n(const char *s, size_t n) {
  char *p = mr_malloc(n + 1);
  if (p) {
    memcpy(p, s, n);
    p[n] = '\0';
  }
  return p;
}

static int nomem(ld *L) { return mr_err_set(L->e, MR_ENOMEM, "%s: out of memory", L->label); }

/* {"String": s} or {"Regex": r} (HF SplitPattern / ReplacePattern). */
static int get_pattern(ld *L, const cJSON *obj, const char *path, regex_t **re) {
  char p[PATH_LEN], q[PATH_LEN];
  sub(p, path, "pattern");
  const cJSON *v = get(obj, "pattern");
  const cJSON *s = v ? get(v, "String") : NULL, *r = v ? get(v, "Regex") : NULL;
  if (!cJSON_IsObject(v) || cJSON_GetArraySize(v) != 1 || (!cJSON_IsString(s) && !cJSON_IsString(r)))
    return bad(L, MR_EFORMAT, p, v, "must be {\"String\": ...} or {\"Regex\": ...}");
  const cJSON *x = s ? s : r;
  sub(q, p, s ? "String" : "Regex");
  return gc__tok_re_new(re, x->valuestring, strlen(x->valuestring), s != NULL, L->label, q, L->e);
}

/* Appends one zeroed element to the array *arr of *n elements of elem bytes; *slot points
 * at it. The arrays are short (one per component of a tokenizer.json), so one realloc each. */
static int append(ld *L, void **arr, uint32_t *n, size_t elem, void **slot) {
  char *p = mr_realloc(*arr, (*n + 1) * elem);
  if (!p) return nomem(L);
  *arr = p;
  *slot = p + (size_t)(*n)++ * elem;
  memset(*slot, 0, elem);
  return 0;
}

/* The "Sequence" component of a normalizer, pre-tokenizer, decoder or post-processor: the array under key,
 * each element parsed by parse one level deeper. */
static int parse_sequence(ld *L, const cJSON *o, const char *path, const char *key, int depth,
                          int (*parse)(ld *, const cJSON *, const char *, int)) {
  char p[PATH_LEN];
  sub(p, path, key);
  const cJSON *a = get(o, key);
  if (!cJSON_IsArray(a)) return bad(L, MR_EFORMAT, p, a, "must be an array");
  if (depth >= MAX_DEPTH) return bad(L, MR_ERANGE, p, a, "nested too deep");
  size_t i = 0;
  for (const cJSON *x = a->child; x; x = x->next, i++) {
    char q[PATH_LEN];
    idx(q, p, i);
    int rc = parse(L, x, q, depth + 1);
    if (rc) return rc;
  }
  return 0;
}

/* ---------------------------------------------------------------------------------------
 * Normalizers.
 */
static const char *const NORM_TYPES[] = {"Sequence", "NFC", "NFD", "NFKC", "NFKD", "Lowercase",
                                         "Strip", "Prepend", "Replace", NULL};

static int norm_add(ld *L, gc__tok_norm **slot) {
  void *arr = L->tok->norm, *v = NULL;
  int rc = append(L, &arr, &L->tok->n_norm, sizeof **slot, &v);
  L->tok->norm = arr;
  *slot = v;
  return rc;
}

static int parse_norm(ld *L, const cJSON *o, const char *path, int depth) {
  int k = get_type(L, o, path, NORM_TYPES);
  if (k < 0) return k;
  int rc;
  gc__tok_norm *n;
  switch (k) {
  case 0: { /* Sequence */
    return parse_sequence(L, o, path, "normalizers", depth, parse_norm);
  }
  case 1: case 2: case 3: case 4: case 5:
    if (norm_add(L, &n)) return MR_ENOMEM;
    n->kind = k == 1 ? GC__N_NFC : k == 2 ? GC__N_NFD : k == 3 ? GC__N_NFKC : k == 4 ? GC__N_NFKD
                                                                                     : GC__N_LOWERCASE;
    return 0;
  case 6: { /* Strip */
    bool l, r;
    if ((rc = get_bool(L, o, "strip_left", path, true, false, false, &l)) ||
        (rc = get_bool(L, o, "strip_right", path, true, false, false, &r)))
      return rc;
    if (norm_add(L, &n)) return MR_ENOMEM;
    n->kind = GC__N_STRIP;
    n->left = l;
    n->right = r;
    return 0;
  }
  case 7: { /* Prepend */
    const char *s;
    if ((rc = get_str(L, o, "prepend", path, true, false, &s))) return rc;
    if (norm_add(L, &n)) return MR_ENOMEM;
    n->kind = GC__N_PREPEND;
    n->str_len = strlen(s);
    if (!(n->str = dup_n(s, n->str_len))) return nomem(L);
    return 0;
  }
  case 8: { /* Replace */
    const char *content;
    if ((rc = get_str(L, o, "content", path, true, false, &content))) return rc;
    if (norm_add(L, &n)) return MR_ENOMEM;
    n->kind = GC__N_REPLACE;
    n->str_len = strlen(content);
    if (!(n->str = dup_n(content, n->str_len))) return nomem(L);
    return get_pattern(L, o, path, &n->re);
  }
  }
  return 0;
}

/* ---------------------------------------------------------------------------------------
 * Pre-tokenizers.
 */
static const char *const PRE_TYPES[] = {"Sequence", "Split", "ByteLevel", "Metaspace", "Digits",
                                        NULL};
static const char *const BEHAVIORS[] = {"Removed", "Isolated", "MergedWithPrevious",
                                        "MergedWithNext", "Contiguous", NULL};
/* The GPT-2 split of HF's ByteLevel with use_regex (pre_tokenizers/byte_level.rs). */
static const char GPT2_PATTERN[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

static int pre_add(ld *L, gc__tok_pre **slot) {
  void *arr = L->tok->pre, *v = NULL;
  int rc = append(L, &arr, &L->tok->n_pre, sizeof **slot, &v);
  L->tok->pre = arr;
  *slot = v;
  return rc;
}

static int get_prepend_scheme(ld *L, const cJSON *o, const char *path, int *out) {
  char p[PATH_LEN];
  sub(p, path, "prepend_scheme");
  const cJSON *v = get(o, "prepend_scheme");
  *out = GC__PREPEND_ALWAYS; /* HF's default */
  if (v) {
    if (!cJSON_IsString(v)) return bad(L, MR_EFORMAT, p, v, "must be \"first\", \"always\" or \"never\"");
    if (strcmp(v->valuestring, "first") == 0) *out = GC__PREPEND_FIRST;
    else if (strcmp(v->valuestring, "always") == 0) *out = GC__PREPEND_ALWAYS;
    else if (strcmp(v->valuestring, "never") == 0) *out = GC__PREPEND_NEVER;
    else return bad(L, MR_EFORMAT, p, v, "must be \"first\", \"always\" or \"never\"");
  }
  /* The older add_prefix_space: false means never, and any other scheme with it (the
   * default "always" included) is HF's error "add_prefix_space does not match declared
   * prepend_scheme". */
  bool aps;
  int rc = get_bool(L, o, "add_prefix_space", path, false, true, true, &aps);
  if (rc) return rc;
  if (!aps) {
    if (*out != GC__PREPEND_NEVER) {
      char q[PATH_LEN];
      sub(q, path, "add_prefix_space");
      return bad(L, MR_EFORMAT, q, get(o, "add_prefix_space"),
                 "does not match the declared prepend_scheme");
    }
    *out = GC__PREPEND_NEVER;
  }
  return 0;
}

/* ByteLevel's fields, whichever part it is used as: add_prefix_space and trim_offsets are
 * required (serde, no default), use_regex defaults to true. */
static int bytelevel_fields(ld *L, const cJSON *o, const char *path, bool *aps, bool *use_re) {
  bool trim;
  int rc;
  if ((rc = get_bool(L, o, "add_prefix_space", path, true, false, false, aps)) ||
      (rc = get_bool(L, o, "trim_offsets", path, true, false, false, &trim)) ||
      (rc = get_bool(L, o, "use_regex", path, false, false, true, use_re)))
    return rc;
  return 0;
}

static int parse_pre(ld *L, const cJSON *o, const char *path, int depth) {
  int k = get_type(L, o, path, PRE_TYPES);
  if (k < 0) return k;
  int rc;
  gc__tok_pre *n;
  switch (k) {
  case 0: { /* Sequence */
    return parse_sequence(L, o, path, "pretokenizers", depth, parse_pre);
  }
  case 1: { /* Split */
    char p[PATH_LEN];
    sub(p, path, "behavior");
    const cJSON *b = get(o, "behavior");
    int beh = -1;
    if (cJSON_IsString(b))
      for (int i = 0; BEHAVIORS[i]; i++)
        if (strcmp(b->valuestring, BEHAVIORS[i]) == 0) beh = i;
    if (beh < 0)
      return bad(L, MR_EFORMAT, p, b, "must be one of Removed, Isolated, MergedWithPrevious, "
                 "MergedWithNext, Contiguous");
    bool inv;
    if ((rc = get_bool(L, o, "invert", path, true, false, false, &inv))) return rc;
    if (pre_add(L, &n)) return MR_ENOMEM;
    n->kind = GC__P_SPLIT;
    n->behavior = beh == 0 ? GC__B_REMOVED : beh == 1 ? GC__B_ISOLATED : beh == 2 ? GC__B_MERGED_PREV
                : beh == 3 ? GC__B_MERGED_NEXT : GC__B_CONTIGUOUS;
    n->invert = inv;
    return get_pattern(L, o, path, &n->re);
  }
  case 2: { /* ByteLevel; trim_offsets only moves offsets */
    bool aps, use_re;
    if ((rc = bytelevel_fields(L, o, path, &aps, &use_re))) return rc;
    if (pre_add(L, &n)) return MR_ENOMEM;
    n->kind = GC__P_BYTELEVEL;
    n->add_prefix_space = aps;
    n->map_bytes = true;
    if (use_re)
      return gc__tok_re_new(&n->re, GPT2_PATTERN, strlen(GPT2_PATTERN), false, L->label, path,
                            L->e);
    return 0;
  }
  case 3: { /* Metaspace */
    uint32_t cp;
    char u[4];
    uint8_t ul;
    int scheme;
    bool split;
    if ((rc = get_char(L, o, "replacement", path, &cp, u, &ul)) ||
        (rc = get_prepend_scheme(L, o, path, &scheme)) ||
        (rc = get_bool(L, o, "split", path, false, true, true, &split)))
      return rc;
    if (scheme == GC__PREPEND_FIRST) {
      /* "first" asks whether a piece starts at offset 0 of the input, which is known here
       * only while nothing before this step has moved text (tok_encode.c). */
      char p[PATH_LEN];
      sub(p, path, "prepend_scheme");
      if (L->tok->n_norm)
        return bad(L, MR_ENOTSUP, p, get(o, "prepend_scheme"),
                   "not supported together with a normalizer (offsets are not tracked)");
      for (uint32_t i = 0; i < L->tok->n_pre; i++)
        if (L->tok->pre[i].kind != GC__P_SPLIT && L->tok->pre[i].kind != GC__P_DIGITS)
          return bad(L, MR_ENOTSUP, p, get(o, "prepend_scheme"),
                     "not supported after a ByteLevel or Metaspace pre-tokenizer (offsets are "
                     "not tracked)");
    }
    if (pre_add(L, &n)) return MR_ENOMEM;
    n->kind = GC__P_METASPACE;
    n->repl_cp = cp;
    memcpy(n->repl, u, ul);
    n->repl_len = ul;
    n->prepend = scheme;
    n->split = split;
    return 0;
  }
  case 4: { /* Digits */
    bool ind;
    if ((rc = get_bool(L, o, "individual_digits", path, true, false, false, &ind))) return rc;
    if (pre_add(L, &n)) return MR_ENOMEM;
    n->kind = GC__P_DIGITS;
    n->individual = ind;
    return 0;
  }
  }
  return 0;
}

/* ---------------------------------------------------------------------------------------
 * Decoders.
 */
static const char *const DEC_TYPES[] = {"Sequence", "ByteLevel", "Metaspace", "ByteFallback",
                                        "Fuse", "Strip", "Replace", NULL};

static int dec_add(ld *L, gc__tok_dec **slot) {
  void *arr = L->tok->dec, *v = NULL;
  int rc = append(L, &arr, &L->tok->n_dec, sizeof **slot, &v);
  L->tok->dec = arr;
  *slot = v;
  return rc;
}

/* True once the list holds a ByteLevel or Fuse: what follows sees one whole string. */
static bool collapsed(const gc_tok *t) {
  for (uint32_t i = 0; i < t->n_dec; i++)
    if (t->dec[i].kind == GC__D_BYTELEVEL || t->dec[i].kind == GC__D_FUSE) return true;
  return false;
}

static int parse_dec(ld *L, const cJSON *o, const char *path, int depth) {
  int k = get_type(L, o, path, DEC_TYPES);
  if (k < 0) return k;
  int rc;
  gc__tok_dec *n;
  if (k == 0) { /* Sequence */
    return parse_sequence(L, o, path, "decoders", depth, parse_dec);
  }
  /* After a ByteLevel or Fuse the rest of a Sequence acts on the whole text; of those only
   * Strip and Fuse are streamed (tok_decode.c). */
  if (collapsed(L->tok) && k != 4 && k != 5) {
    char p[PATH_LEN];
    sub(p, path, "type");
    return bad(L, MR_ENOTSUP, p, get(o, "type"),
               "not supported after a ByteLevel or Fuse decoder (only Strip and Fuse are)");
  }
  bool aps, use_re;
  if (k == 1 && (rc = bytelevel_fields(L, o, path, &aps, &use_re))) return rc;
  if (dec_add(L, &n)) return MR_ENOMEM;
  switch (k) {
  case 1: /* the decoder ignores its fields */
    n->kind = GC__D_BYTELEVEL;
    return 0;
  case 2: {
    int scheme;
    n->kind = GC__D_METASPACE;
    if ((rc = get_char(L, o, "replacement", path, &n->cp, NULL, NULL)) ||
        (rc = get_prepend_scheme(L, o, path, &scheme)))
      return rc;
    n->drop_first = scheme != GC__PREPEND_NEVER;
    return 0;
  }
  case 3:
    n->kind = GC__D_BYTEFALLBACK;
    return 0;
  case 4:
    n->kind = GC__D_FUSE;
    return 0;
  case 5: {
    uint64_t a, b;
    char p[PATH_LEN];
    n->kind = GC__D_STRIP;
    if ((rc = get_char(L, o, "content", path, &n->cp, NULL, NULL))) return rc;
    sub(p, path, "start");
    if ((rc = get_uint(L, get(o, "start"), p, UINT32_MAX, &a))) return rc;
    sub(p, path, "stop");
    if ((rc = get_uint(L, get(o, "stop"), p, UINT32_MAX, &b))) return rc;
    n->start = (uint32_t)a;
    n->stop = (uint32_t)b;
    return 0;
  }
  case 6: {
    const char *content;
    n->kind = GC__D_REPLACE;
    if ((rc = get_str(L, o, "content", path, true, false, &content))) return rc;
    n->content_len = strlen(content);
    if (!(n->content = dup_n(content, n->content_len))) return nomem(L);
    return get_pattern(L, o, path, &n->re);
  }
  }
  return 0;
}

/* ---------------------------------------------------------------------------------------
 * Post-processors.
 */
static const char *const POST_TYPES[] = {"Sequence", "TemplateProcessing", "ByteLevel", NULL};

static int parse_template(ld *L, const cJSON *o, const char *path) {
  int rc;
  char p[PATH_LEN], q[PATH_LEN];
  if (L->tok->tpl) {
    sub(p, path, "type");
    return bad(L, MR_ENOTSUP, p, get(o, "type"), "a second TemplateProcessing is not supported "
               "(HF cannot apply it either)");
  }
  sub(p, path, "special_tokens");
  const cJSON *sp = get(o, "special_tokens");
  if (!cJSON_IsObject(sp)) return bad(L, MR_EFORMAT, p, sp, "must be an object");
  sub(p, path, "pair");
  if (!cJSON_IsArray(get(o, "pair"))) return bad(L, MR_EFORMAT, p, get(o, "pair"), "must be an array");
  sub(p, path, "single");
  const cJSON *single = get(o, "single");
  if (!cJSON_IsArray(single)) return bad(L, MR_EFORMAT, p, single, "must be an array");
  gc__tok_tpl *tp = mr_calloc(1, sizeof *tp);
  if (!tp) return nomem(L);
  L->tok->tpl = tp;
  int n = cJSON_GetArraySize(single);
  tp->item = mr_calloc(n ? (size_t)n : 1, sizeof *tp->item);
  if (!tp->item) return nomem(L);
  size_t i = 0;
  for (const cJSON *x = single->child; x; x = x->next, i++) {
    idx(q, p, i);
    const cJSON *seq = get(x, "Sequence"), *spt = get(x, "SpecialToken");
    if (!cJSON_IsObject(x) || cJSON_GetArraySize(x) != 1 || (!cJSON_IsObject(seq) && !cJSON_IsObject(spt)))
      return bad(L, MR_EFORMAT, q, x, "must be {\"Sequence\": ...} or {\"SpecialToken\": ...}");
    gc__tok_tpl_item *it = &tp->item[tp->n++];
    const char *id;
    char r[PATH_LEN];
    sub(r, q, seq ? "Sequence" : "SpecialToken");
    if ((rc = get_str(L, seq ? seq : spt, "id", r, true, false, &id))) return rc;
    if (seq) {
      char s[PATH_LEN];
      sub(s, r, "id");
      if (strcmp(id, "B") == 0)
        return bad(L, MR_ENOTSUP, s, get(seq, "id"), "sequence B in the single template");
      if (strcmp(id, "A") != 0) return bad(L, MR_EFORMAT, s, get(seq, "id"), "must be \"A\" or \"B\"");
      it->seq = true;
      continue;
    }
    /* The ids of special token `id`, from special_tokens. */
    const cJSON *st = get(sp, id);
    char s[PATH_LEN];
    snprintf(s, sizeof s, "%s.special_tokens[\"%.60s\"]", path, id);
    if (!st)
      return mr_err_set(L->e, MR_EFORMAT, "%s: %s.id = \"%.60s\": not in %s.special_tokens",
                        L->label, r, id, path);
    const cJSON *ids = get(st, "ids");
    char t[PATH_LEN];
    sub(t, s, "ids");
    if (!cJSON_IsArray(ids) || cJSON_GetArraySize(ids) < 1)
      return bad(L, MR_EFORMAT, t, ids, "must be a non-empty array of ids");
    it->n = (uint32_t)cJSON_GetArraySize(ids);
    if (!(it->ids = mr_calloc(it->n, sizeof *it->ids))) return nomem(L);
    size_t j = 0;
    for (const cJSON *y = ids->child; y; y = y->next, j++) {
      char u[PATH_LEN];
      uint64_t v;
      idx(u, t, j);
      if ((rc = get_uint(L, y, u, GC_TOK_MAX_ID, &v))) return rc;
      it->ids[j] = (int32_t)v;
    }
  }
  return 0;
}

static int parse_post(ld *L, const cJSON *o, const char *path, int depth) {
  int k = get_type(L, o, path, POST_TYPES);
  if (k < 0) return k;
  if (k == 1) return parse_template(L, o, path);
  if (k == 2) { /* ByteLevel: offsets only */
    bool aps, use_re;
    return bytelevel_fields(L, o, path, &aps, &use_re);
  }
  return parse_sequence(L, o, path, "processors", depth, parse_post); /* Sequence */
}

/* ---------------------------------------------------------------------------------------
 * The BPE model.
 */
static int parse_model(ld *L, const cJSON *o) {
  static const char *const MODEL_TYPES[] = {"BPE", NULL};
  gc__tok_bpe *b = &L->tok->bpe;
  int rc = get_type(L, o, "model", MODEL_TYPES);
  if (rc < 0) return rc;
  /* dropout: null or 0 is the deterministic path; anything else samples merges. */
  const cJSON *d = get(o, "dropout");
  if (d && !cJSON_IsNull(d)) {
    if (!cJSON_IsNumber(d) || d->valuedouble < 0 || d->valuedouble > 1)
      return bad(L, MR_EFORMAT, "model.dropout", d, "must be null or in 0..1");
    if (d->valuedouble != 0)
      return bad(L, MR_ENOTSUP, "model.dropout", d, "not supported (BPE dropout is random)");
  }
  const char *unk, *prefix, *suffix;
  bool fuse, fallback, ignore;
  if ((rc = get_str(L, o, "unk_token", "model", false, true, &unk)) ||
      (rc = get_str(L, o, "continuing_subword_prefix", "model", false, true, &prefix)) ||
      (rc = get_str(L, o, "end_of_word_suffix", "model", false, true, &suffix)) ||
      (rc = get_bool(L, o, "fuse_unk", "model", false, true, false, &fuse)) ||
      (rc = get_bool(L, o, "byte_fallback", "model", false, true, false, &fallback)) ||
      (rc = get_bool(L, o, "ignore_merges", "model", false, true, false, &ignore)))
    return rc;
  b->fuse_unk = fuse;
  b->byte_fallback = fallback;
  b->ignore_merges = ignore;
  /* "" (Qwen writes it) means the same as null: nothing is added or removed. */
  if (prefix && prefix[0] && !(b->cont_prefix = dup_n(prefix, b->cont_len = strlen(prefix))))
    return nomem(L);
  if (suffix && suffix[0] && !(b->eow_suffix = dup_n(suffix, b->eow_len = strlen(suffix))))
    return nomem(L);

  const cJSON *vocab = get(o, "vocab"), *merges = get(o, "merges");
  if (!cJSON_IsObject(vocab))
    return bad(L, MR_EFORMAT, "model.vocab", vocab, "must be an object (token -> id)");
  if (!cJSON_IsArray(merges)) return bad(L, MR_EFORMAT, "model.merges", merges, "must be an array");
  for (const cJSON *x = vocab->child; x; x = x->next) {
    char p[PATH_LEN];
    uint64_t id;
    snprintf(p, sizeof p, "model.vocab[\"%.60s\"]", x->string);
    if ((rc = get_uint(L, x, p, GC_TOK_MAX_ID, &id))) return rc;
    if (gc__tok_strmap_put(&b->vocab, x->string, strlen(x->string), (int32_t)id, NULL))
      return nomem(L);
  }
  b->model_size = b->vocab.n;
  b->unk_id = -1;
  if (unk) {
    b->unk_id = gc__tok_strmap_get(&b->vocab, unk, strlen(unk));
    b->unk_missing = b->unk_id < 0;
  }

  /* Merges: all "a b" strings (the older layout; "#version" lines skipped, each split on
   * ' ' into exactly two parts) or all ["a", "b"] pairs (the layout is the first entry's;
   * HF's untagged enum takes one or the other, never a mix). Rank = position among the
   * merges kept; a pair listed twice keeps its last rank (HF builds a map). Each merge
   * is stored by ids: (id a, id b) -> (rank, id of the merged token), the token a + b
   * less the continuing-subword prefix's length of bytes at the start of b. */
  int n = cJSON_GetArraySize(merges);
  if ((unsigned)n > MAX_MERGES) return bad(L, MR_ERANGE, "model.merges", merges, "too many merges");
  if (gc__tok_pairmap_init(&b->merges, (size_t)n)) return nomem(L);
  bool legacy = merges->child && cJSON_IsString(merges->child);
  gc__tok_buf cat = {0};
  uint32_t rank = 0;
  size_t i = 0;
  rc = 0;
  for (const cJSON *x = merges->child; x && !rc; x = x->next, i++) {
    char p[PATH_LEN];
    idx(p, "model.merges", i);
    const char *a, *bb;
    size_t al, bl;
    if (legacy) {
      if (!cJSON_IsString(x)) {
        rc = bad(L, MR_EFORMAT, p, x, "must be a string like the merges before it");
        break;
      }
      const char *s = x->valuestring;
      if (strncmp(s, "#version", 8) == 0) continue;
      const char *sp = strchr(s, ' ');
      if (!sp || strchr(sp + 1, ' ')) {
        rc = bad(L, MR_EFORMAT, p, x, "must be two tokens separated by one space");
        break;
      }
      a = s;
      al = (size_t)(sp - s);
      bb = sp + 1;
      bl = strlen(bb);
    } else {
      if (!cJSON_IsArray(x) || cJSON_GetArraySize(x) != 2 || !cJSON_IsString(x->child) ||
          !cJSON_IsString(x->child->next)) {
        rc = bad(L, MR_EFORMAT, p, x, "must be a pair of token strings");
        break;
      }
      a = x->child->valuestring;
      al = strlen(a);
      bb = x->child->next->valuestring;
      bl = strlen(bb);
    }
    int32_t ia = gc__tok_strmap_get(&b->vocab, a, al), ib = gc__tok_strmap_get(&b->vocab, bb, bl);
    if (ia < 0 || ib < 0) {
      rc = mr_err_set(L->e, MR_EFORMAT, "%s: %s: token \"%.*s\" is not in model.vocab", L->label,
                      p, (int)(ia < 0 ? (al > 60 ? 60 : al) : (bl > 60 ? 60 : bl)), ia < 0 ? a : bb);
      break;
    }
    /* The merged token is a + b without the continuing_subword_prefix's length of bytes. */
    if (bl < b->cont_len) {
      rc = bad(L, MR_EFORMAT, p, x, "the second token is shorter than continuing_subword_prefix");
      break;
    }
    cat.n = 0;
    if (gc__tok_buf_put(&cat, a, al) || gc__tok_buf_put(&cat, bb + b->cont_len, bl - b->cont_len)) {
      rc = nomem(L);
      break;
    }
    int32_t im = gc__tok_strmap_get(&b->vocab, cat.p, cat.n);
    if (im < 0) {
      rc = mr_err_set(L->e, MR_EFORMAT, "%s: %s: the merged token \"%.*s\" is not in model.vocab",
                      L->label, p, (int)(cat.n > 60 ? 60 : cat.n), cat.p);
      break;
    }
    if (gc__tok_pairmap_put(&b->merges, ia, ib, rank++, im)) rc = nomem(L);
  }
  gc__tok_buf_close(&cat);
  return rc;
}

/* ---------------------------------------------------------------------------------------
 * added_tokens.
 */
static int parse_added(ld *L, const cJSON *a) {
  gc_tok *t = L->tok;
  if (!cJSON_IsArray(a)) return bad(L, MR_EFORMAT, "added_tokens", a, "must be an array");
  int n = cJSON_GetArraySize(a);
  if (n > (int)GC_TOK_MAX_ID) return bad(L, MR_ERANGE, "added_tokens", a, "too many tokens");
  t->added = mr_calloc(n ? (size_t)n : 1, sizeof *t->added);
  if (!t->added) return nomem(L);
  size_t i = 0;
  for (const cJSON *x = a->child; x; x = x->next, i++) {
    char p[PATH_LEN], q[PATH_LEN];
    idx(p, "added_tokens", i);
    if (!cJSON_IsObject(x)) return bad(L, MR_EFORMAT, p, x, "must be an object");
    gc__tok_added *k = &t->added[t->n_added];
    const char *content;
    uint64_t id;
    int rc;
    sub(q, p, "id");
    if ((rc = get_uint(L, get(x, "id"), q, GC_TOK_MAX_ID, &id)) ||
        (rc = get_str(L, x, "content", p, true, false, &content)) ||
        (rc = get_bool(L, x, "single_word", p, true, false, false, &k->single_word)) ||
        (rc = get_bool(L, x, "lstrip", p, true, false, false, &k->lstrip)) ||
        (rc = get_bool(L, x, "rstrip", p, true, false, false, &k->rstrip)) ||
        (rc = get_bool(L, x, "normalized", p, true, false, false, &k->normalized)) ||
        (rc = get_bool(L, x, "special", p, true, false, false, &k->special)))
      return rc;
    k->id = (int32_t)id; /* the file's id; gc__tok_finish computes HF's */
    k->len = (uint32_t)strlen(content);
    if (!(k->content = dup_n(content, k->len))) return nomem(L);
    t->n_added++;
  }
  return 0;
}

/* ---------------------------------------------------------------------------------------
 * tokenizer.json
 */

/* The bytes of a JSON text: valid UTF-8 (serde_json, reading a &str, refuses anything else;
 * cJSON would pass invalid bytes into the vocabulary), no NUL byte, and no "\u0000" escape
 * (cJSON keeps strings NUL-terminated, so either would silently cut a string; an escape is
 * a backslash preceded by an even number of them). */
static int check_text(ld *L, const char *s, size_t n) {
  size_t ok = gc__tok_utf8_valid_prefix(s, n);
  const char *nul = memchr(s, '\0', n);
  if (ok < n || nul) {
    size_t at = nul && (size_t)(nul - s) < ok ? (size_t)(nul - s) : ok, line = 1;
    for (size_t j = 0; j < at; j++) line += s[j] == '\n';
    return mr_err_set(L->e, MR_EFORMAT, "%s: byte %zu (line %zu): %s", L->label, at, line,
                      nul && (size_t)(nul - s) < ok ? "a NUL byte" : "not valid UTF-8");
  }
  for (size_t i = 0; i + 6 <= n; i++) {
    if (s[i] != '\\') continue;
    size_t k = i, bs = 0;
    while (k < n && s[k] == '\\') {
      k++;
      bs++;
    }
    if (bs % 2 == 1 && k + 5 <= n && memcmp(s + k, "u0000", 5) == 0) {
      size_t line = 1;
      for (size_t j = 0; j < i; j++) line += s[j] == '\n';
      return mr_err_set(L->e, MR_ENOTSUP, "%s: line %zu: a string contains \\u0000: not "
                        "supported", L->label, line);
    }
    i = k - 1;
  }
  return 0;
}

int gc__tok_parse_json(gc_tok *tok, const char *json, size_t len, const char *label, mr_err *e) {
  ld L = {.tok = tok, .label = label, .e = e};
  int rc;
  if ((rc = check_text(&L, json, len))) return rc;
  cJSON *root = NULL;
  if ((rc = mr_json_parse_object(json, len, label, &root, e))) return rc;
  const cJSON *v = get(root, "version");
  if (v && (!cJSON_IsString(v) || strcmp(v->valuestring, "1.0") != 0)) {
    rc = bad(&L, MR_ENOTSUP, "version", v, "unknown tokenizer version (HF reads \"1.0\")");
    goto out;
  }
  const char *const params[] = {"truncation", "padding"};
  for (int i = 0; i < 2; i++) {
    v = get(root, params[i]);
    if (v && !cJSON_IsNull(v)) {
      rc = bad(&L, MR_ENOTSUP, params[i], v, "not supported (must be null)");
      goto out;
    }
  }
  v = get(root, "model");
  if (!v) {
    rc = mr_err_set(e, MR_EFORMAT, "%s: model is missing", label);
    goto out;
  }
  if ((rc = parse_model(&L, v))) goto out;
  v = get(root, "normalizer");
  if (v && !cJSON_IsNull(v) && (rc = parse_norm(&L, v, "normalizer", 0))) goto out;
  v = get(root, "pre_tokenizer");
  if (v && !cJSON_IsNull(v) && (rc = parse_pre(&L, v, "pre_tokenizer", 0))) goto out;
  v = get(root, "post_processor");
  if (v && !cJSON_IsNull(v) && (rc = parse_post(&L, v, "post_processor", 0))) goto out;
  v = get(root, "decoder");
  if (v && !cJSON_IsNull(v)) {
    tok->has_decoder = true;
    if ((rc = parse_dec(&L, v, "decoder", 0))) goto out;
  }
  v = get(root, "added_tokens");
  if (v && (rc = parse_added(&L, v))) goto out;
out:
  cJSON_Delete(root);
  return rc;
}

/* ---------------------------------------------------------------------------------------
 * tokenizer_config.json: bos / eos and whether transformers adds them. For Kimi also the
 * names of the special tokens (added_tokens_decoder), read by gc__tok_parse_tiktoken.
 */
static const char *config_token(const cJSON *v) {
  if (cJSON_IsString(v)) return v->valuestring;
  if (cJSON_IsObject(v) && cJSON_IsString(get(v, "content"))) return get(v, "content")->valuestring;
  return NULL;
}

static int config_bool(ld *L, const cJSON *root, const char *key, bool *out) {
  const cJSON *v = get(root, key);
  *out = false;
  if (!v || cJSON_IsNull(v)) return 0;
  if (!cJSON_IsBool(v)) return bad(L, MR_EFORMAT, key, v, "must be true or false");
  *out = cJSON_IsTrue(v);
  return 0;
}

static int config_read(ld *L, const cJSON *root) {
  gc_tok *t = L->tok;
  const char *names[2] = {"bos_token", "eos_token"};
  int32_t *ids[2] = {&t->bos_id, &t->eos_id};
  for (int i = 0; i < 2; i++) {
    const cJSON *v = get(root, names[i]);
    *ids[i] = -1;
    if (!v || cJSON_IsNull(v)) continue;
    const char *s = config_token(v);
    if (!s) return bad(L, MR_EFORMAT, names[i], v, "must be a string or {\"content\": ...}");
    *ids[i] = gc_tok_token_id(t, s);
  }
  int rc;
  if ((rc = config_bool(L, root, "add_bos_token", &t->add_bos)) ||
      (rc = config_bool(L, root, "add_eos_token", &t->add_eos)))
    return rc;
  return 0;
}

int gc__tok_parse_config(gc_tok *tok, const char *json, size_t len, const char *label,
                         mr_err *e) {
  ld L = {.tok = tok, .label = label, .e = e};
  cJSON *root = NULL;
  int rc = check_text(&L, json, len);
  if (!rc) rc = mr_json_parse_object(json, len, label, &root, e);
  if (!rc) rc = config_read(&L, root);
  cJSON_Delete(root);
  return rc;
}

/* ---------------------------------------------------------------------------------------
 * tiktoken.model (Kimi-K2): lines "<base64 of the token's bytes> <rank>"; the ranks are the
 * ids 0 .. n-1. The model is what tokenization_kimi.py builds with tiktoken.Encoding:
 *   - the split pattern below (the file does not carry it);
 *   - byte-level BPE by ranks: any two adjacent parts whose concatenation is a token may
 *     merge, the lowest rank first (tiktoken's _byte_pair_merge); a pre-token that is a
 *     token itself is that token at once;
 *   - 256 special tokens with ids n .. n+255, named by tokenizer_config.json's
 *     added_tokens_decoder, the others "<|reserved_token_ID|>".
 * Here that is a BPE with a merge (a, b) -> a+b for every split of every token into two
 * tokens, ranked by a+b's rank, and ignore_merges (the whole-piece lookup).
 */

/* Kimi-K2's pat_str: TikTokenTokenizer.pat_str of tokenization_kimi.py in the moonshotai
 * Kimi-K2 repositories on the Hugging Face Hub, the eight alternatives joined with "|",
 * unchanged. The Hub is not reachable from here; it was taken from published copies of
 * that file and ports that quote it verbatim (a vendored tokenization_kimi.py, two Rust
 * ports, a GGUF reference script), which all agree. It needs Oniguruma's `&&` class
 * intersection. */
static const char KIMI_PATTERN[] =
    "[\\p{Han}]+"
    "|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]*"
    "[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    "|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]+"
    "[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    "|\\p{N}{1,3}"
    "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
    "|\\s*[\\r\\n]+"
    "|\\s+(?!\\S)"
    "|\\s+";
#define KIMI_SPECIALS 256

static int b64_val(unsigned char c) {
  if (c >= 'A' && c <= 'Z') return c - 'A';
  if (c >= 'a' && c <= 'z') return c - 'a' + 26;
  if (c >= '0' && c <= '9') return c - '0' + 52;
  if (c == '+') return 62;
  if (c == '/') return 63;
  return -1;
}

/* Standard base64 with '=' padding (Python's base64.b64decode as tiktoken calls it). */
static bool b64_decode(const char *s, size_t n, gc__tok_buf *out) {
  if (n % 4) return false;
  for (size_t i = 0; i < n; i += 4) {
    int v[4];
    int pad = 0;
    for (int k = 0; k < 4; k++) {
      unsigned char c = (unsigned char)s[i + k];
      if (c == '=' && i + 4 == n && k >= 2) {
        v[k] = 0;
        pad++;
        continue;
      }
      if (pad) return false;
      if ((v[k] = b64_val(c)) < 0) return false;
    }
    unsigned char b[3] = {(unsigned char)(v[0] << 2 | v[1] >> 4),
                          (unsigned char)((v[1] & 15) << 4 | v[2] >> 2),
                          (unsigned char)((v[2] & 3) << 6 | v[3])};
    if (gc__tok_buf_put(out, b, 3 - (size_t)pad)) return false;
  }
  return true;
}

int gc__tok_parse_tiktoken(gc_tok *tok, const char *model, size_t len, const char *config,
                           size_t config_len, const char *label, mr_err *e) {
  ld L = {.tok = tok, .label = label, .e = e};
  gc__tok_bpe *b = &tok->bpe;
  gc__tok_buf raw = {0}, bl = {0};
  cJSON *cfg = NULL;
  int rc = 0;
  tok->tiktoken = true;
  b->unk_id = -1;
  b->ignore_merges = true;
  /* Pass 1: the vocabulary, token bytes -> rank, keyed by the byte-level string (so that the
   * rest of the tokenizer, the decoder included, is the byte-level BPE's). Blank lines are
   * skipped, as tiktoken's loader skips them; a '\r' before '\n' is tolerated. */
  size_t line = 0, max_rank = 0;
  for (size_t i = 0; i < len;) {
    size_t j = i;
    while (j < len && model[j] != '\n') j++;
    line++;
    size_t end = j;
    if (end > i && model[end - 1] == '\r') end--;
    if (end > i) {
      const char *sp = memchr(model + i, ' ', end - i);
      uint64_t rank = 0;
      bool ok = sp && sp > model + i && sp + 1 < model + end;
      for (const char *q = sp ? sp + 1 : NULL; ok && q < model + end; q++) {
        if (*q < '0' || *q > '9' || rank > GC_TOK_MAX_ID) ok = false;
        else rank = rank * 10 + (uint64_t)(*q - '0');
      }
      raw.n = 0;
      if (ok) ok = b64_decode(model + i, (size_t)(sp - (model + i)), &raw) && raw.n > 0;
      if (!ok || rank > GC_TOK_MAX_ID) {
        rc = mr_err_set(e, MR_EFORMAT, "%s: line %zu: not \"<base64 token> <rank>\" with a rank "
                        "in 0..%u", label, line, GC_TOK_MAX_ID);
        goto out;
      }
      bl.n = 0;
      bool fresh;
      if (gc__tok_bytes_to_bl(raw.p, raw.n, &bl) ||
          gc__tok_strmap_put(&b->vocab, bl.p, bl.n, (int32_t)rank, &fresh)) {
        rc = nomem(&L);
        goto out;
      }
      if (!fresh) {
        rc = mr_err_set(e, MR_EFORMAT, "%s: line %zu: the token is listed twice", label, line);
        goto out;
      }
      if (rank > max_rank) max_rank = rank;
    }
    i = j + 1;
  }
  b->model_size = b->vocab.n;
  if (b->vocab.n == 0) {
    rc = mr_err_set(e, MR_EFORMAT, "%s: no tokens", label);
    goto out;
  }
  for (int c = 0; c < 256; c++) {
    /* tiktoken starts from single bytes: each must be a token. */
    char u[2];
    size_t ul = gc__tok_utf8_encode(gc__tok_byte_cp[c], u);
    if (gc__tok_strmap_get(&b->vocab, u, ul) < 0) {
      rc = mr_err_set(e, MR_EFORMAT, "%s: byte 0x%02X has no token (every single byte must)",
                      label, c);
      goto out;
    }
  }
  if (max_rank + 1 != b->vocab.n || b->vocab.n + KIMI_SPECIALS - 1 > GC_TOK_MAX_ID) {
    rc = mr_err_set(e, MR_EFORMAT, "%s: %u tokens with ranks up to %zu: the ranks must be "
                    "0..%u, each once", label, b->vocab.n, max_rank, b->vocab.n - 1);
    goto out;
  }
  /* Ranks unique: n distinct tokens with ranks in 0..n-1 and no rank twice. */
  {
    uint8_t *seen = mr_calloc(b->vocab.n, 1);
    if (!seen) {
      rc = nomem(&L);
      goto out;
    }
    for (uint32_t i = 0; i < b->vocab.n && !rc; i++) {
      int32_t r = b->vocab.ent[i].val;
      if (seen[r]++)
        rc = mr_err_set(e, MR_EFORMAT, "%s: rank %d is given to two tokens", label, r);
    }
    mr_free(seen);
    if (rc) goto out;
  }
  /* Pass 2: a merge for every split of every token into two tokens. tiktoken merges any
   * two adjacent parts whose bytes are a token, at that token's rank; listing every such
   * pair once (a pair determines its concatenation) lets the BPE loop of tok_bpe.c do
   * exactly that. About len - 1 lookups per token: ~1M for Kimi's 163,840. */
  if (gc__tok_pairmap_init(&b->merges, (size_t)b->vocab.n * 2)) {
    rc = nomem(&L);
    goto out;
  }
  for (uint32_t i = 0; i < b->vocab.n; i++) {
    const gc__tok_strmap_ent *x = &b->vocab.ent[i];
    const char *s = gc__tok_strmap_key(&b->vocab, i);
    for (size_t k = gc__tok_utf8_len((unsigned char)s[0]); k < x->len;
         k += gc__tok_utf8_len((unsigned char)s[k])) {
      int32_t l = gc__tok_strmap_get(&b->vocab, s, k), r = gc__tok_strmap_get(&b->vocab, s + k, x->len - k);
      if (l >= 0 && r >= 0 && gc__tok_pairmap_put(&b->merges, l, r, (uint32_t)x->val, x->val)) {
        rc = nomem(&L);
        goto out;
      }
    }
  }
  /* The pipeline of tiktoken.Encoding(pat_str=...). */
  gc__tok_pre *pre;
  if ((rc = pre_add(&L, &pre))) goto out;
  pre->kind = GC__P_SPLIT;
  pre->behavior = GC__B_ISOLATED;
  if ((rc = gc__tok_re_new(&pre->re, KIMI_PATTERN, strlen(KIMI_PATTERN), false, label,
                           "the Kimi split pattern", e)))
    goto out;
  if ((rc = pre_add(&L, &pre))) goto out;
  pre->kind = GC__P_BYTELEVEL;
  pre->map_bytes = true;
  gc__tok_dec *dec;
  if ((rc = dec_add(&L, &dec))) goto out;
  dec->kind = GC__D_BYTELEVEL;
  tok->has_decoder = true;

  /* The special tokens: names from added_tokens_decoder, else reserved ones. */
  const cJSON *atd = NULL;
  if (config) {
    L.label = "tokenizer_config.json";
    if ((rc = check_text(&L, config, config_len)) ||
        (rc = mr_json_parse_object(config, config_len, "tokenizer_config.json", &cfg, e)))
      goto out;
    L.label = label;
    atd = get(cfg, "added_tokens_decoder");
    if (atd && !cJSON_IsObject(atd) && !cJSON_IsNull(atd)) {
      L.label = "tokenizer_config.json";
      rc = bad(&L, MR_EFORMAT, "added_tokens_decoder", atd, "must be an object (id -> token)");
      goto out;
    }
  }
  tok->added = mr_calloc(KIMI_SPECIALS, sizeof *tok->added);
  if (!tok->added) {
    rc = nomem(&L);
    goto out;
  }
  for (uint32_t k = 0; k < KIMI_SPECIALS; k++) {
    uint32_t id = b->vocab.n + k;
    char key[16], name[48];
    const char *content = NULL;
    snprintf(key, sizeof key, "%u", id);
    const cJSON *ent = atd ? get(atd, key) : NULL;
    if (ent) {
      content = config_token(ent);
      if (!content || !content[0]) {
        char p[PATH_LEN];
        snprintf(p, sizeof p, "added_tokens_decoder[\"%s\"]", key);
        L.label = "tokenizer_config.json";
        rc = bad(&L, MR_EFORMAT, p, ent, "must be {\"content\": \"...\"} or a string");
        goto out;
      }
    } else {
      snprintf(name, sizeof name, "<|reserved_token_%u|>", id);
      content = name;
    }
    gc__tok_added *a = &tok->added[tok->n_added++];
    a->len = (uint32_t)strlen(content);
    if (!(a->content = dup_n(content, a->len))) {
      rc = nomem(&L);
      goto out;
    }
    a->id = (int32_t)id;
    a->special = true;
  }
  /* bos / eos are read by gc_tok_load_tiktoken once the ids are known. */
out:
  gc__tok_buf_close(&raw);
  gc__tok_buf_close(&bl);
  cJSON_Delete(cfg);
  return rc;
}
