/*
 * test_tokenizer.c - the tokenizer (gpu_client/runner/tokenizer.h) on hand-written
 * tokenizer.json files, one per component: BPE merge order (both merge layouts), byte
 * fallback / unk / fuse_unk / ignore_merges / prefix and suffix, added tokens (special or
 * not, single_word, lstrip, rstrip, normalized, leftmost-longest), each normalizer,
 * pre-tokenizer, post-processor and decoder, the streaming decoder, invalid UTF-8, Kimi's
 * tiktoken.model, the refusals at load (each message names the JSON path), failed
 * allocations, and encode from several threads. The expected ids and texts were checked
 * against HF `tokenizers` 0.23.3 on the same files (MT_TOK_DUMP below; tests/conformance
 * compares whole families on a corpus).
 */
#include "gpu_client/runner/tok_internal.h"
#include "tests/unit/mt.h"

#include <pthread.h>
#include <sys/stat.h>

/* ---------------------------------------------------------------------------------------
 * Helpers.
 */

/* JSON written with ' for " (readable literals); a real ' is written \u0027. */
static char *J(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static char *J(const char *fmt, ...) {
  static char ring[16][1 << 16];
  static int k;
  char *b = ring[k++ & 15];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(b, sizeof ring[0], fmt, ap);
  va_end(ap);
  for (char *p = b; *p; p++)
    if (*p == '\'') *p = '"';
  return b;
}

/* The 256 byte-level chars as vocab entries with id = byte, then `extra`. */
static const char *bl_vocab(const char *extra) {
  static char b[1 << 15];
  size_t o = 0;
  o += (size_t)snprintf(b + o, sizeof b - o, "{");
  for (int i = 0; i < 256; i++)
    o += (size_t)snprintf(b + o, sizeof b - o, "%s\"\\u%04x\": %d", i ? ", " : "", gc__tok_byte_cp[i], i);
  snprintf(b + o, sizeof b - o, "%s%s}", extra[0] ? ", " : "", extra);
  return b;
}

/* With MT_TOK_DUMP=FILE every tokenizer.json loaded and every expectation checked is also
 * appended to FILE as JSON lines, which `test_tokenizer_hf.py --check-unit-dump FILE` replays
 * through HF `tokenizers` (how the expected values here were checked). */
static FILE *dump_file(void) {
  static FILE *f;
  static int tried;
  if (!tried++ && getenv("MT_TOK_DUMP")) f = fopen(getenv("MT_TOK_DUMP"), "a");
  return f;
}
static void dump_str(FILE *f, const char *s, size_t n) {
  fputc('"', f);
  for (size_t i = 0; i < n; i++) {
    unsigned char c = (unsigned char)s[i];
    if (c == '"' || c == '\\') fprintf(f, "\\%c", c);
    else if (c < 0x20 || c >= 0x7f) fprintf(f, "\\u00%02x", c); /* bytes, as latin-1 */
    else fputc(c, f);
  }
  fputc('"', f);
}
static const gc_tok *dump_tok;
static const char *dump_json;

static gc_tok *load(const char *json) {
  gc_tok *t = NULL;
  mr_err e = {0};
  MT_OK(gc_tok_load_json(&t, json, strlen(json), NULL, 0, "t.json", &e), &e);
  if (dump_file()) {
    dump_tok = t;
    dump_json = json;
  }
  return t;
}

/* Loading must fail with code and a message containing want. */
static void refused(const char *json, int code, const char *want) {
  gc_tok *t = (gc_tok *)1;
  mr_err e = {0};
  int rc = gc_tok_load_json(&t, json, strlen(json), NULL, 0, "t.json", &e);
  if (rc == 0) gc_tok_free(t);
  MT_EQ_INT(rc, code);
  MT_TRUE(t == NULL);
  MT_CONTAINS(e.msg, want);
}

static void ids_eq(const gc_tok_ids *got, const int32_t *want, size_t n, const char *what) {
  bool same = got->n == n;
  for (size_t i = 0; same && i < n; i++) same = got->v[i] == want[i];
  if (!same) {
    fprintf(stderr, "  %s: got [", what);
    for (size_t i = 0; i < got->n; i++) fprintf(stderr, "%s%d", i ? "," : "", got->v[i]);
    fprintf(stderr, "] want [");
    for (size_t i = 0; i < n; i++) fprintf(stderr, "%s%d", i ? "," : "", want[i]);
    fprintf(stderr, "]\n");
  }
  MT_TRUE(same);
}

#define ENC(t, text, ...)                                                              \
  do {                                                                                 \
    const int32_t want_[] = {__VA_ARGS__};                                             \
    enc_check((t), (text), strlen(text), false, want_, sizeof want_ / sizeof *want_);  \
  } while (0)
#define ENC_SP(t, text, ...)                                                           \
  do {                                                                                 \
    const int32_t want_[] = {__VA_ARGS__};                                             \
    enc_check((t), (text), strlen(text), true, want_, sizeof want_ / sizeof *want_);   \
  } while (0)
static void enc_check(const gc_tok *t, const char *text, size_t n, bool sp, const int32_t *want,
                      size_t nw) {
  gc_tok_ids ids = {0};
  mr_err e = {0};
  MT_OK(gc_tok_encode(t, text, n, sp, &ids, &e), &e);
  ids_eq(&ids, want, nw, text);
  gc_tok_ids_close(&ids);
  FILE *f = dump_file();
  if (f && t == dump_tok) {
    fputs("{\"json\": ", f);
    dump_str(f, dump_json, strlen(dump_json));
    fputs(", \"text\": ", f);
    dump_str(f, text, n);
    fprintf(f, ", \"sp\": %s, \"want\": [", sp ? "true" : "false");
    for (size_t i = 0; i < nw; i++) fprintf(f, "%s%d", i ? "," : "", want[i]);
    fputs("]}\n", f);
    fflush(f);
  }
}
#define ENC_NONE(t, text) enc_check((t), (text), strlen(text), false, NULL, 0)

/* decode(ids) must be want, and so must the stream's steps + flush. */
static void dec_check(const gc_tok *t, const int32_t *ids, size_t n, bool skip, const char *want) {
  gc_tok_text out = {0};
  mr_err e = {0};
  MT_OK(gc_tok_decode(t, ids, n, skip, &out, &e), &e);
  MT_EQ_STR(out.s ? out.s : "", want);
  MT_EQ_INT(out.len, strlen(want));
  gc_tok_stream *s;
  MT_OK(gc_tok_stream_new(t, skip, &s, &e), &e);
  char acc[4096] = "";
  size_t al = 0;
  for (size_t i = 0; i <= n; i++) {
    const char *x;
    size_t l;
    if (i < n) MT_OK(gc_tok_stream_step(s, ids[i], &x, &l, &e), &e);
    else MT_OK(gc_tok_stream_flush(s, &x, &l, &e), &e);
    MT_TRUE(al + l < sizeof acc);
    memcpy(acc + al, x, l);
    al += l;
    acc[al] = '\0';
  }
  MT_EQ_STR(acc, want);
  gc_tok_stream_free(s);
  gc_tok_text_close(&out);
  FILE *f = dump_file();
  if (f && t == dump_tok) {
    fputs("{\"json\": ", f);
    dump_str(f, dump_json, strlen(dump_json));
    fputs(", \"ids\": [", f);
    for (size_t i = 0; i < n; i++) fprintf(f, "%s%d", i ? "," : "", ids[i]);
    fprintf(f, "], \"skip\": %s, \"want\": ", skip ? "true" : "false");
    dump_str(f, want, strlen(want));
    fputs("}\n", f);
    fflush(f);
  }
}
#define DEC(t, skip, want, ...)                                                        \
  do {                                                                                 \
    const int32_t ids_[] = {__VA_ARGS__};                                              \
    dec_check((t), ids_, sizeof ids_ / sizeof *ids_, (skip), (want));                  \
  } while (0)

/* ---------------------------------------------------------------------------------------
 * Building blocks.
 */

MT_TEST(byte_table_follows_gpt2_rule) {
  /* Printable bytes stand for themselves, the other 68 for U+0100.. in byte order. */
  int next = 0x100;
  for (int b = 0; b < 256; b++) {
    bool keep = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    int want = keep ? b : next++;
    MT_EQ_INT(gc__tok_byte_cp[b], want);
    MT_EQ_INT(gc__tok_cp_byte((uint32_t)want), b);
  }
  MT_EQ_INT(next, 0x144);
  MT_EQ_INT(gc__tok_cp_byte(0x144), -1);
  MT_EQ_INT(gc__tok_cp_byte(0x20), -1); /* ' ' is written U+0120 */
}

MT_TEST(lossy_utf8_is_maximal_subpart) {
  /* Python: b"a\xe4\xb8b\xed\xa0\x80\xf0\x9f\x98\x80\xc0\xaf\xf4\x90".decode("utf-8",
   * "replace") == "a\ufffdb\ufffd\ufffd\ufffd\U0001f600\ufffd\ufffd\ufffd\ufffd" */
  const char in[] = "a\xe4\xb8" "b\xed\xa0\x80\xf0\x9f\x98\x80\xc0\xaf\xf4\x90";
  gc__tok_lossy d = {0};
  gc__tok_buf out = {0};
  /* Fed one byte at a time: the state machine must carry across calls. */
  for (size_t i = 0; i < sizeof in - 1; i++) MT_OK(gc__tok_lossy_feed(&d, in + i, 1, &out), NULL);
  MT_OK(gc__tok_lossy_end(&d, &out), NULL);
  const char want[] = "a" GC__TOK_REPL "b" GC__TOK_REPL GC__TOK_REPL GC__TOK_REPL
                      "\xf0\x9f\x98\x80" GC__TOK_REPL GC__TOK_REPL GC__TOK_REPL GC__TOK_REPL;
  MT_EQ_INT(out.n, sizeof want - 1);
  MT_TRUE(memcmp(out.p, want, out.n) == 0);
  MT_EQ_INT(gc__tok_utf8_valid_prefix(in, sizeof in - 1), 1);
  MT_EQ_INT(gc__tok_utf8_valid_prefix("\xf0\x9f\x98\x80x", 5), 5);
  gc__tok_buf_close(&out);
}

MT_TEST(regex_find_matches_like_onig_crate) {
  regex_t *re;
  mr_err e = {0};
  OnigRegion *r = onig_region_new();
  gc__tok_matches m = {0};
  /* Empty matches: "x*" on "ab" gives (0,0) (0,1 unmatched) (1,1) ... as find_iter does. */
  MT_OK(gc__tok_re_new(&re, "x*", 2, false, "t", "p", &e), &e);
  MT_OK(gc__tok_re_find(re, r, "ab", 2, &m, &e), &e);
  /* onig: (0,0); from 0 again (0,0) is skipped -> from 1: (1,1); then (2,2). */
  MT_EQ_INT(m.n, 5);
  MT_TRUE(m.v[0].s == 0 && m.v[0].e == 0 && m.v[0].m);
  MT_TRUE(m.v[1].s == 0 && m.v[1].e == 1 && !m.v[1].m);
  MT_TRUE(m.v[2].s == 1 && m.v[2].e == 1 && m.v[2].m);
  MT_TRUE(m.v[3].s == 1 && m.v[3].e == 2 && !m.v[3].m);
  MT_TRUE(m.v[4].s == 2 && m.v[4].e == 2 && m.v[4].m);
  gc__tok_re_free(re);
  /* A literal pattern is escaped: "a.b" matches only itself. */
  MT_OK(gc__tok_re_new(&re, "a.b", 3, true, "t", "p", &e), &e);
  MT_OK(gc__tok_re_find(re, r, "axb a.b", 7, &m, &e), &e);
  MT_EQ_INT(m.n, 2);
  MT_TRUE(m.v[1].s == 4 && m.v[1].e == 7 && m.v[1].m);
  gc__tok_re_free(re);
  /* Kimi's && class intersection compiles (Oniguruma has it; PCRE2 does not). */
  MT_OK(gc__tok_re_new(&re, "[\\p{L}&&[^\\p{Han}]]+", 20, false, "t", "p", &e), &e);
  MT_OK(gc__tok_re_find(re, r, "ab\xe4\xb8\xad" "cd", 7, &m, &e), &e);
  MT_EQ_INT(m.n, 3); /* "ab" | "中" | "cd" */
  MT_TRUE(m.v[0].m && !m.v[1].m && m.v[2].m);
  gc__tok_re_free(re);
  /* A bad pattern is an error naming the path. */
  MT_TRUE(gc__tok_re_new(&re, "(", 1, false, "t.json", "pre_tokenizer.pattern.Regex", &e) != 0);
  MT_CONTAINS(e.msg, "pre_tokenizer.pattern.Regex");
  onig_region_free(r, 1);
  mr_free(m.v);
}

/* ---------------------------------------------------------------------------------------
 * BPE.
 */

/* a=0 b=1 c=2 ab=3 bc=4 abc=5 */
static const char *abc_json(const char *merges, const char *extra_model) {
  return J("{'model': {'type': 'BPE', 'vocab': {'a': 0, 'b': 1, 'c': 2, 'ab': 3, 'bc': 4, "
           "'abc': 5}, 'merges': %s %s}}", merges, extra_model);
}

MT_TEST(bpe_merges_by_rank_both_layouts) {
  /* "b c" first (rank 0), then "a bc": abc. */
  gc_tok *t = load(abc_json("[['b', 'c'], ['a', 'b'], ['a', 'bc']]", ""));
  ENC(t, "abc", 5);
  ENC(t, "ab", 3);
  ENC(t, "cab", 2, 3);
  gc_tok_free(t);
  /* The legacy layout, with a #version line that does not count as a rank. */
  t = load(abc_json("['#version: 0.2', 'b c', 'a b', 'a bc']", ""));
  ENC(t, "abc", 5);
  gc_tok_free(t);
  /* "a b" first: ab + c has no merge here, so "abc" stays ab, c. */
  t = load(abc_json("['a b', 'b c', 'a bc']", ""));
  ENC(t, "abc", 3, 2);
  gc_tok_free(t);
  /* Among equal ranks the leftmost merges first: "bcbc"? one merge, both places. */
  t = load(abc_json("['b c']", ""));
  ENC(t, "bcbc", 4, 4);
  ENC(t, "abca", 0, 4, 0);
  gc_tok_free(t);
}

MT_TEST(bpe_leftmost_first_on_overlap) {
  /* "aaa" with merge "a a": the leftmost pair merges, leaving aa + a. */
  gc_tok *t = load(J("{'model': {'type': 'BPE', 'vocab': {'a': 0, 'aa': 1}, 'merges': ['a a']}}"));
  ENC(t, "aaa", 1, 0);
  ENC(t, "aaaa", 1, 1);
  gc_tok_free(t);
}

MT_TEST(bpe_byte_fallback_unk_fuse) {
  /* Missing chars: <0xNN> tokens if all bytes have one, else unk (fused when fuse_unk). */
  const char *vocab = "{'<unk>': 0, '<0xC3>': 1, '<0xA9>': 2, 'a': 3, 'b': 4}";
  gc_tok *t = load(J("{'model': {'type': 'BPE', 'unk_token': '<unk>', 'byte_fallback': true, "
                     "'fuse_unk': true, 'vocab': %s, 'merges': []}}", vocab));
  ENC(t, "a\xc3\xa9" "b", 3, 1, 2, 4);      /* é = C3 A9: both byte tokens exist */
  ENC(t, "a\xe4\xb8\xad\xe4\xb8\xad" "b", 3, 0, 4); /* 中中: no <0xE4>: unk, fused */
  gc_tok_free(t);
  t = load(J("{'model': {'type': 'BPE', 'unk_token': '<unk>', 'byte_fallback': false, "
             "'fuse_unk': false, 'vocab': %s, 'merges': []}}", vocab));
  ENC(t, "a\xe4\xb8\xad\xe4\xb8\xad" "b", 3, 0, 0, 4);
  ENC(t, "a\xc3\xa9", 3, 0);
  gc_tok_free(t);
  /* No unk token: the char is dropped (HF). */
  t = load(J("{'model': {'type': 'BPE', 'vocab': %s, 'merges': []}}", vocab));
  ENC(t, "a\xe4\xb8\xad" "b", 3, 4);
  gc_tok_free(t);
  /* An unk_token that is not in the vocabulary loads (as in HF) but fails when needed. */
  t = load(J("{'model': {'type': 'BPE', 'unk_token': '<nope>', 'vocab': %s, 'merges': []}}", vocab));
  ENC(t, "ab", 3, 4);
  gc_tok_ids ids = {0};
  mr_err e = {0};
  MT_EQ_INT(gc_tok_encode(t, "az", 2, false, &ids, &e), MR_EFORMAT);
  MT_CONTAINS(e.msg, "unk_token");
  MT_EQ_INT(ids.n, 0);
  gc_tok_ids_close(&ids);
  gc_tok_free(t);
}

MT_TEST(bpe_ignore_merges_prefix_suffix) {
  /* ignore_merges: a pre-token in the vocabulary is taken whole, whatever the merges say. */
  gc_tok *t = load(abc_json("['a b']", ", 'ignore_merges': true"));
  ENC(t, "abc", 5);
  ENC(t, "ac", 0, 2);
  gc_tok_free(t);
  t = load(abc_json("['a b']", ", 'ignore_merges': false"));
  ENC(t, "abc", 3, 2);
  gc_tok_free(t);
  /* continuing_subword_prefix "##": non-first chars are looked up as "##x"; a merge
   * "a ##b" makes "ab". end_of_word_suffix "</w>" on the last char. */
  t = load(J("{'model': {'type': 'BPE', 'continuing_subword_prefix': '##', "
             "'end_of_word_suffix': '</w>', 'vocab': {'a': 0, '##b': 1, '##c</w>': 2, 'ab': 3, "
             "'abc</w>': 4, 'c</w>': 5}, 'merges': ['a ##b', 'ab ##c</w>']}}"));
  ENC(t, "abc", 4);
  ENC(t, "ab", 0); /* "##b</w>" is not a token and there is no unk: dropped */
  ENC(t, "c", 5);
  gc_tok_free(t);
}

/* ---------------------------------------------------------------------------------------
 * Byte-level (Qwen-like) pipeline.
 */

/* 256 bytes (id = byte), then Ġw=256, he=257, ll=258, hell=259, hello=260, Ġworld=261 ... */
static const char *qwen_like(const char *added, const char *extra) {
  return J("{'version': '1.0', 'truncation': null, 'padding': null, 'added_tokens': [%s], "
           "'normalizer': {'type': 'NFC'}, "
           "'pre_tokenizer': {'type': 'Sequence', 'pretokenizers': ["
           "{'type': 'Split', 'pattern': {'Regex': \"(?i:\\u0027s|\\u0027t|\\u0027re|\\u0027ve|"
           "\\u0027m|\\u0027ll|\\u0027d)|[^\\\\r\\\\n\\\\p{L}\\\\p{N}]?\\\\p{L}+|\\\\p{N}| ?"
           "[^\\\\s\\\\p{L}\\\\p{N}]+[\\\\r\\\\n]*|\\\\s*[\\\\r\\\\n]+|\\\\s+(?!\\\\S)|\\\\s+\"}, "
           "'behavior': 'Isolated', 'invert': false}, "
           "{'type': 'ByteLevel', 'add_prefix_space': false, 'trim_offsets': false, "
           "'use_regex': false}]}, "
           "'post_processor': {'type': 'ByteLevel', 'add_prefix_space': false, "
           "'trim_offsets': false, 'use_regex': false}, "
           "'decoder': {'type': 'ByteLevel', 'add_prefix_space': false, 'trim_offsets': false, "
           "'use_regex': false}, "
           "'model': {'type': 'BPE', 'dropout': null, 'unk_token': null, "
           "'continuing_subword_prefix': '', 'end_of_word_suffix': '', 'fuse_unk': false, "
           "'byte_fallback': false, 'ignore_merges': false, 'vocab': %s, "
           "'merges': [['h', 'e'], ['l', 'l'], ['he', 'll'], ['hell', 'o'], ['\\u0120', 'w'], "
           "['o', 'r'], ['or', 'ld'], ['l', 'd'], ['\\u0120w', 'orld']]}}",
           added,
           bl_vocab(J("'\\u0120w': 256, 'he': 257, 'll': 258, 'hell': 259, 'hello': 260, "
                      "'or': 261, 'ld': 262, 'orld': 263, '\\u0120world': 264%s", extra)));
}
#define QWEN_ADDED                                                                      \
  "{'id': 265, 'content': '<|im_start|>', 'single_word': false, 'lstrip': false, "        \
  "'rstrip': false, 'normalized': false, 'special': true}, "                              \
  "{'id': 266, 'content': '<|im_end|>', 'single_word': false, 'lstrip': false, "          \
  "'rstrip': false, 'normalized': false, 'special': true}, "                              \
  "{'id': 267, 'content': '<think>', 'single_word': false, 'lstrip': false, "             \
  "'rstrip': false, 'normalized': false, 'special': false}"

MT_TEST(byte_level_encode_decode) {
  gc_tok *t = load(qwen_like(J(QWEN_ADDED), ""));
  MT_EQ_INT(gc_tok_vocab_size(t), 268);
  ENC(t, "hello world", 260, 264);
  ENC(t, "hello  world", 260, ' ', 264); /* "\s+(?!\S)": one space stays, Ġworld */
  ENC(t, "Hello", 'H', 'e', 258, 'o');
  /* Special tokens in the text; add_special_tokens adds nothing (no template). */
  ENC(t, "<|im_start|>hello<|im_end|>", 265, 260, 266);
  ENC_SP(t, "<|im_start|>hello<|im_end|>", 265, 260, 266);
  ENC(t, "<|im_start", '<', '|', 'i', 'm', '_', 's', 't', 'a', 'r', 't');
  /* NFC: e + U+0301 is é (C3 A9: bytes 0xC3 0xA9, each one byte-level symbol). */
  ENC(t, "e\xcc\x81", 0xC3, 0xA9);
  ENC_NONE(t, "");
  DEC(t, false, "hello world", 260, 264);
  DEC(t, false, "<|im_start|>hello", 265, 260);
  DEC(t, true, "hello<think>", 265, 260, 267); /* <think> is not special */
  /* A character cut between tokens: U+FFFD for the unfinished sequence at the end. */
  DEC(t, false, "\xc3\xa9", 0xC3, 0xA9);
  DEC(t, false, GC__TOK_REPL, 0xC3);
  DEC(t, false, GC__TOK_REPL "a", 0xC3, 'a');
  /* Unknown ids are skipped, as HF skips them. */
  DEC(t, false, "hello", 260, 5000, -1);
  /* Queries. */
  MT_EQ_INT(gc_tok_token_id(t, "<|im_end|>"), 266);
  MT_EQ_INT(gc_tok_token_id(t, "\xc4\xa0world"), 264);
  MT_EQ_INT(gc_tok_token_id(t, "nope"), -1);
  size_t l;
  MT_EQ_STR(gc_tok_id_to_piece(t, 264, &l), "\xc4\xa0world");
  MT_EQ_INT(l, 7);
  MT_TRUE(gc_tok_id_to_piece(t, 268, NULL) == NULL);
  MT_TRUE(gc_tok_is_special(t, 265));
  MT_FALSE(gc_tok_is_special(t, 267));
  MT_TRUE(gc_tok_is_added(t, 267));
  MT_FALSE(gc_tok_is_added(t, 260));
  MT_EQ_INT(gc_tok_added_count(t), 3);
  gc_tok_added_info ai;
  gc_tok_added_at(t, 1, &ai);
  MT_EQ_INT(ai.id, 266);
  MT_EQ_STR(ai.content, "<|im_end|>");
  MT_TRUE(ai.special);
  MT_CONTAINS(gc_tok_describe(t), "byte-level");
  gc_tok_free(t);
}

MT_TEST(streaming_holds_back_unfinished_chars) {
  gc_tok *t = load(qwen_like(J(QWEN_ADDED), ""));
  gc_tok_stream *s;
  mr_err e = {0};
  MT_OK(gc_tok_stream_new(t, false, &s, &e), &e);
  const char *x;
  size_t l;
  /* 中 = E4 B8 AD in three byte tokens: nothing until the third. */
  MT_OK(gc_tok_stream_step(s, 260, &x, &l, &e), &e);
  MT_EQ_STR(x, "hello");
  MT_OK(gc_tok_stream_step(s, 0xE4, &x, &l, &e), &e);
  MT_EQ_INT(l, 0);
  MT_OK(gc_tok_stream_step(s, 0xB8, &x, &l, &e), &e);
  MT_EQ_INT(l, 0);
  MT_OK(gc_tok_stream_step(s, 0xAD, &x, &l, &e), &e);
  MT_EQ_STR(x, "\xe4\xb8\xad");
  /* An unfinished one at the end comes out of flush as U+FFFD, and the stream restarts. */
  MT_OK(gc_tok_stream_step(s, 0xF0, &x, &l, &e), &e);
  MT_EQ_INT(l, 0);
  MT_OK(gc_tok_stream_flush(s, &x, &l, &e), &e);
  MT_EQ_STR(x, GC__TOK_REPL);
  MT_OK(gc_tok_stream_step(s, 'a', &x, &l, &e), &e);
  MT_EQ_STR(x, "a");
  /* A byte that cannot continue the held sequence ends it at once. */
  MT_OK(gc_tok_stream_step(s, 0xE4, &x, &l, &e), &e);
  MT_OK(gc_tok_stream_step(s, 'b', &x, &l, &e), &e);
  MT_EQ_STR(x, GC__TOK_REPL "b");
  gc_tok_stream_reset(s);
  MT_OK(gc_tok_stream_flush(s, &x, &l, &e), &e);
  MT_EQ_INT(l, 0);
  gc_tok_stream_free(s);
  gc_tok_free(t);
}

MT_TEST(invalid_utf8_is_replaced_like_python) {
  /* The bytes "he\xffllo" encode as Python's "he\ufffdllo" does. */
  gc_tok *t = load(qwen_like(J(QWEN_ADDED), ""));
  gc_tok_ids a = {0}, b = {0};
  mr_err e = {0};
  MT_OK(gc_tok_encode(t, "he\xffllo", 6, false, &a, &e), &e);
  MT_OK(gc_tok_encode(t, "he" GC__TOK_REPL "llo", 8, false, &b, &e), &e);
  ids_eq(&a, b.v, b.n, "he\\xffllo");
  /* Surrogates (ED A0 80) are three maximal subparts: three U+FFFD. */
  MT_OK(gc_tok_encode(t, "\xed\xa0\x80", 3, false, &a, &e), &e);
  MT_OK(gc_tok_encode(t, GC__TOK_REPL GC__TOK_REPL GC__TOK_REPL, 9, false, &b, &e), &e);
  ids_eq(&a, b.v, b.n, "\\xed\\xa0\\x80");
  /* A cut special token is text, and a NUL byte is just a byte. */
  MT_OK(gc_tok_encode(t, "a\0b", 3, false, &a, &e), &e);
  const int32_t want[] = {'a', 0, 'b'};
  ids_eq(&a, want, 3, "a\\0b");
  gc_tok_ids_close(&a);
  gc_tok_ids_close(&b);
  gc_tok_free(t);
}

/* ---------------------------------------------------------------------------------------
 * Added tokens.
 */
/* An added_tokens entry. `id` is what the file says; HF (and this tokenizer) assign their
 * own and only warn when it differs. */
static const char *added_tok(int id, const char *content, bool special, bool norm, bool l,
                             bool r, bool single) {
  return J("{'id': %d, 'content': '%s', 'single_word': %s, 'lstrip': %s, 'rstrip': %s, "
           "'normalized': %s, 'special': %s}",
           id, content, single ? "true" : "false", l ? "true" : "false", r ? "true" : "false",
           norm ? "true" : "false", special ? "true" : "false");
}

MT_TEST(added_tokens_like_added_vocabulary) {
  /* Char-level model: a=0 .. z=25, ' '=26, 'X'=27, '<'=28 '>'=29; added from 30. */
  char vocab[1024] = "{";
  for (int c = 'a'; c <= 'z'; c++)
    snprintf(vocab + strlen(vocab), sizeof vocab - strlen(vocab), "'%c': %d, ", c, c - 'a');
  strcat(vocab, "' ': 26, 'X': 27, '<': 28, '>': 29}");
  char added[4096];
  snprintf(added, sizeof added, "%s, %s, %s, %s, %s, %s, %s",
           added_tok(30, "<a>", true, false, false, false, false),    /* longest wins: */
           added_tok(31, "<a><b>", true, false, false, false, false), /* this one */
           added_tok(32, "cat", false, false, false, false, true),    /* single word */
           added_tok(33, "<l>", false, false, true, false, false),    /* lstrip */
           added_tok(34, "<r>", false, false, false, true, false),    /* rstrip */
           added_tok(35, "dog", false, true, false, false, false),    /* normalized */
           added_tok(30, "<a>", true, false, false, false, false));   /* again: skipped */
  gc_tok *t = load(J("{'added_tokens': [%s], 'normalizer': {'type': 'Lowercase'}, "
                     "'model': {'type': 'BPE', 'vocab': %s, 'merges': []}}", added, vocab));
  ENC(t, "x<a>y", 23, 30, 24);
  ENC(t, "<a><b>z", 31, 25);
  ENC(t, "<a><", 30, 28);
  /* single_word: only between non-word chars (Rust regex \w). */
  ENC(t, "cat cats", 32, 26, 2, 0, 19, 18);
  ENC(t, "a cat.", 0, 26, 32);
  /* lstrip eats the spaces before, rstrip those after. */
  ENC(t, "a  <l>b", 0, 33, 1);
  ENC(t, "a<r>  b", 0, 34, 1);
  /* normalized: matched in the lowercased text; the others in the raw text. */
  ENC(t, "DOG", 35);
  ENC(t, "<A>", 28, 0, 29);
  /* Ids: HF's, the vocab size (30) and up. */
  MT_EQ_INT(gc_tok_token_id(t, "dog"), 35);
  MT_EQ_INT(gc_tok_vocab_size(t), 36);
  DEC(t, true, "x   y", 23, 30, 26, 24); /* no decoder: HF joins ["x", " ", "y"] with " " */
  DEC(t, false, "x <a> y", 23, 30, 24);
  gc_tok_free(t);
}

MT_TEST(added_tokens_relisted_empty_duplicate) {
  const char *m = "'model': {'type': 'BPE', 'vocab': {'a': 0, 'b': 1, ' ': 2, 'x': 3}, 'merges': []}";
  /* Listed again with other properties: the later one replaces it at the same id. */
  gc_tok *t = load(J("{'added_tokens': [%s, %s], %s}",
                     added_tok(4, "ab", false, false, false, false, false),
                     added_tok(4, "ab", true, false, false, false, false), m));
  ENC(t, "abab", 4, 4);
  MT_TRUE(gc_tok_is_special(t, 4));
  DEC(t, true, "", 4);
  gc_tok_free(t);
  /* A normalized token whose normalized form is "" is never matched (HF loads it too). */
  t = load(J("{'normalizer': {'type': 'Strip', 'strip_left': true, 'strip_right': true}, "
             "'added_tokens': [%s], %s}", added_tok(2, " ", false, true, false, false, false), m));
  ENC(t, "a b", 0, 2, 1);
  gc_tok_free(t);
  /* Two tokens matched by the same normalized text: HF's pick depends on its hash order. */
  refused(J("{'normalizer': {'type': 'Lowercase'}, 'added_tokens': [%s, %s], %s}",
            added_tok(4, "X", false, true, false, false, false),
            added_tok(3, "x", false, true, false, false, false), m),
          MR_ENOTSUP, "are matched by the same text: not supported");
}

/* ---------------------------------------------------------------------------------------
 * Normalizers, pre-tokenizers (seen through ignore_merges + whole-piece vocab entries).
 */

/* A model where each listed piece is one token (ids in list order) and every char of
 * "abcdefghijklmnopqrstuvwxyz0123456789 -_▁" one token after them. */
static const char *pieces_json(const char *pieces, const char *normalizer, const char *pre,
                               const char *decoder) {
  static char vocab[8192];
  char list[4096];
  snprintf(list, sizeof list, "%s", pieces);
  size_t o = (size_t)snprintf(vocab, sizeof vocab, "{");
  int id = 0;
  for (char *p = strtok(list, "|"); p; p = strtok(NULL, "|"))
    o += (size_t)snprintf(vocab + o, sizeof vocab - o, "%s'%s': %d", id ? ", " : "", p, id), id++;
  const char *chars[] = {"a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "k", "l", "m", "n", "o",
                         "p", "q", "r", "s", "t", "u", "v", "w", "x", "y", "z", "0", "1", "2", "3",
                         "4", "5", "6", "7", "8", "9", " ", "-", "_", "\xe2\x96\x81", NULL};
  for (int i = 0; chars[i]; i++)
    o += (size_t)snprintf(vocab + o, sizeof vocab - o, ", '%s': %d", chars[i], 100 + i);
  snprintf(vocab + o, sizeof vocab - o, "}");
  return J("{'normalizer': %s, 'pre_tokenizer': %s, 'decoder': %s, 'model': {'type': 'BPE', "
           "'ignore_merges': true, 'vocab': %s, 'merges': []}}",
           normalizer, pre, decoder, vocab);
}
#define CH(c) (100 + (int)(strchr("abcdefghijklmnopqrstuvwxyz0123456789 -_", (c)) - "abcdefghijklmnopqrstuvwxyz0123456789 -_"))
#define META 139 /* "▁" */

MT_TEST(split_behaviors) {
  /* "the-final--countdown" on '-', HF's own example for each behaviour. */
  const char *pieces = "the|final|countdown|the-|final-|-final|-countdown|--";
  const char *beh[] = {"Removed", "Isolated", "MergedWithPrevious", "MergedWithNext", "Contiguous"};
  for (int k = 0; k < 5; k++) {
    gc_tok *t = load(pieces_json(pieces, "null",
                                 J("{'type': 'Split', 'pattern': {'String': '-'}, 'behavior': '%s', "
                                   "'invert': false}", beh[k]), "null"));
    switch (k) {
    case 0: ENC(t, "the-final--countdown", 0, 1, 2); break;
    case 1: ENC(t, "the-final--countdown", 0, CH('-'), 1, CH('-'), CH('-'), 2); break;
    case 2: ENC(t, "the-final--countdown", 3, 4, CH('-'), 2); break;
    case 3: ENC(t, "the-final--countdown", 0, 5, CH('-'), 6); break;
    case 4: ENC(t, "the-final--countdown", 0, CH('-'), 1, 7, 2); break;
    }
    gc_tok_free(t);
  }
  /* invert: the pattern names the pieces to keep ("\w+" matches words). */
  gc_tok *t = load(pieces_json(pieces, "null",
                               J("{'type': 'Split', 'pattern': {'Regex': '\\\\w+'}, 'behavior': "
                                 "'Removed', 'invert': true}"), "null"));
  ENC(t, "the-final--countdown", 0, 1, 2);
  gc_tok_free(t);
}

MT_TEST(digits_and_metaspace) {
  gc_tok *t = load(pieces_json("12|345", "null",
                               J("{'type': 'Digits', 'individual_digits': false}"), "null"));
  ENC(t, "a12b345", CH('a'), 0, CH('b'), 1);
  gc_tok_free(t);
  t = load(pieces_json("12|345", "null", J("{'type': 'Digits', 'individual_digits': true}"), "null"));
  ENC(t, "a12", CH('a'), CH('1'), CH('2'));
  gc_tok_free(t);
  /* Metaspace always + split: "▁hey▁you"; never: no prefix; first: only at offset 0. */
  const char *pieces = "\xe2\x96\x81hey|\xe2\x96\x81you|hey";
  t = load(pieces_json(pieces, "null",
                       J("{'type': 'Metaspace', 'replacement': '\xe2\x96\x81', 'prepend_scheme': "
                         "'always', 'split': true}"), "null"));
  ENC(t, "hey you", 0, 1);
  ENC(t, " hey", 0);
  gc_tok_free(t);
  t = load(pieces_json(pieces, "null",
                       J("{'type': 'Metaspace', 'replacement': '\xe2\x96\x81', 'prepend_scheme': "
                         "'never', 'split': true}"), "null"));
  ENC(t, "hey you", 2, 1);
  gc_tok_free(t);
  /* add_prefix_space: false is the older spelling of never; with any other scheme (the
   * default "always" too) HF refuses the file. */
  t = load(pieces_json(pieces, "null",
                       J("{'type': 'Metaspace', 'replacement': '\xe2\x96\x81', "
                         "'add_prefix_space': false, 'prepend_scheme': 'never'}"), "null"));
  ENC(t, "hey you", 2, 1);
  gc_tok_free(t);
  refused(pieces_json(pieces, "null",
                      J("{'type': 'Metaspace', 'replacement': '\xe2\x96\x81', "
                        "'add_prefix_space': false}"), "null"),
          MR_EFORMAT, "pre_tokenizer.add_prefix_space = false: does not match");
  char added[512];
  snprintf(added, sizeof added, "[%s]", added_tok(43, "<s>", true, false, false, false, false));
  const char *json = pieces_json(pieces, "null",
                                 J("{'type': 'Metaspace', 'replacement': '\xe2\x96\x81', "
                                   "'prepend_scheme': 'first', 'split': false}"), "null");
  /* Splice the added token in (pieces_json has no room for it). */
  char buf[16384];
  snprintf(buf, sizeof buf, "{'added_tokens': %s, %s", added, json + 1);
  t = load(J("%s", buf));
  ENC(t, "hey", 0);
  ENC(t, "<s>hey", 43, 2); /* after an added token: not at offset 0, no prefix */
  gc_tok_free(t);
}

MT_TEST(normalizers) {
  const char *pieces = "fi|i\xcc\x87|\xc3\xa9|x\xe2\x96\x81y";
  /* NFKC: ﬁ -> fi; NFC: e + U+0301 -> é; NFD leaves é decomposed (e, U+0301 -> 2 chars). */
  gc_tok *t = load(pieces_json(pieces, J("{'type': 'NFKC'}"), "null", "null"));
  ENC(t, "\xef\xac\x81", 0);
  gc_tok_free(t);
  t = load(pieces_json(pieces, J("{'type': 'NFC'}"), "null", "null"));
  ENC(t, "e\xcc\x81", 2);
  gc_tok_free(t);
  t = load(pieces_json(pieces, J("{'type': 'NFD'}"), "null", "null"));
  ENC(t, "\xc3\xa9", CH('e')); /* U+0301 alone is no token and there is no unk: dropped */
  gc_tok_free(t);
  /* Lowercase: İ (U+0130) is "i" + U+0307 (Rust's to_lowercase), ASCII as usual. */
  t = load(pieces_json(pieces, J("{'type': 'Lowercase'}"), "null", "null"));
  ENC(t, "\xc4\xb0", 1);
  ENC(t, "AB", CH('a'), CH('b'));
  gc_tok_free(t);
  /* Sequence of Strip (right only), Prepend, Replace (string, then regex). */
  t = load(pieces_json(pieces,
                       J("{'type': 'Sequence', 'normalizers': [{'type': 'Strip', 'strip_left': "
                         "false, 'strip_right': true}, {'type': 'Prepend', 'prepend': '_'}, "
                         "{'type': 'Replace', 'pattern': {'String': ' '}, 'content': '\xe2\x96\x81'}, "
                         "{'type': 'Replace', 'pattern': {'Regex': '[0-9]+'}, 'content': '-'}]}"),
                       "null", "null"));
  ENC(t, " x y42  ", CH('_'), META, CH('x'), META, CH('y'), CH('-'));
  ENC_NONE(t, "   "); /* stripped to "", and Prepend adds nothing to "" */
  gc_tok_free(t);
}

MT_TEST(byte_level_pre_tokenizer_gpt2) {
  /* ByteLevel with add_prefix_space and the GPT-2 split: " hi" is one piece "Ġhi". */
  gc_tok *t = load(J("{'pre_tokenizer': {'type': 'ByteLevel', 'add_prefix_space': true, "
                     "'trim_offsets': true, 'use_regex': true}, 'decoder': {'type': 'ByteLevel', "
                     "'add_prefix_space': true, 'trim_offsets': true}, "
                     "'model': {'type': 'BPE', 'ignore_merges': true, 'vocab': %s, 'merges': []}}",
                     bl_vocab("'\\u0120hi': 256, '\\u0120you': 257, '\\u0027s': 258")));
  ENC(t, "hi you's", 256, 257, 258);
  ENC(t, " hi", 256);
  DEC(t, false, " hi you's", 256, 257, 258);
  gc_tok_free(t);
}

/* ---------------------------------------------------------------------------------------
 * Post-processor and decoders.
 */
MT_TEST(template_processing) {
  char added[1024];
  snprintf(added, sizeof added, "%s, %s", added_tok(1, "<s>", true, false, false, false, false),
           added_tok(2, "</s>", true, false, false, false, false));
  gc_tok *t = load(J("{'added_tokens': [%s], 'post_processor': {'type': 'Sequence', "
                     "'processors': [{'type': 'ByteLevel', 'add_prefix_space': false, "
                     "'trim_offsets': false}, "
                     "{'type': 'TemplateProcessing', "
                     "'single': [{'SpecialToken': {'id': '<s>', 'type_id': 0}}, "
                     "{'Sequence': {'id': 'A', 'type_id': 0}}, "
                     "{'SpecialToken': {'id': '</s>', 'type_id': 0}}], 'pair': [], "
                     "'special_tokens': {'<s>': {'id': '<s>', 'ids': [1], 'tokens': ['<s>']}, "
                     "'</s>': {'id': '</s>', 'ids': [2, 3], 'tokens': ['</s>', 'x']}}}]}, "
                     "'model': {'type': 'BPE', 'vocab': {'a': 0, '<s>': 1, '</s>': 2, 'x': 3}, "
                     "'merges': []}}", added));
  ENC(t, "a", 0);
  ENC_SP(t, "a", 1, 0, 2, 3);
  ENC_SP(t, "", 1, 2, 3);
  DEC(t, true, "a x", 1, 0, 2, 3); /* x is not special */
  gc_tok_free(t);
}

static const char *mistral_json(const char *decoder) {
  return J("{'added_tokens': [%s], 'decoder': %s, 'model': {'type': 'BPE', 'byte_fallback': true, "
           "'unk_token': '<unk>', 'vocab': {'<unk>': 0, '<s>': 1, '<0xE4>': 2, '<0xB8>': 3, "
           "'<0xAD>': 4, '\xe2\x96\x81hi': 5, '\xe2\x96\x81': 6, 'x': 7, '<0x41>': 8}, 'merges': []}}",
           added_tok(1, "<s>", true, false, false, false, false), decoder);
}

MT_TEST(decoders_mistral_chain) {
  /* Mixtral's: Replace ▁ -> " ", ByteFallback, Fuse, Strip one leading " ". */
  gc_tok *t = load(mistral_json(J("{'type': 'Sequence', 'decoders': [{'type': 'Replace', "
                                  "'pattern': {'String': '\xe2\x96\x81'}, 'content': ' '}, "
                                  "{'type': 'ByteFallback'}, {'type': 'Fuse'}, {'type': 'Strip', "
                                  "'content': ' ', 'start': 1, 'stop': 0}]}")));
  DEC(t, false, "hi\xe4\xb8\xad hi", 5, 2, 3, 4, 5);
  DEC(t, true, "hi", 1, 5);
  DEC(t, false, "<s> hi", 1, 5);
  /* An invalid byte run: one U+FFFD per byte (HF ByteFallback), not per maximal subpart. */
  DEC(t, false, "hi" GC__TOK_REPL GC__TOK_REPL "x", 5, 2, 3, 7);
  DEC(t, false, "A", 8);
  /* Strip start=1 takes only the first space of the whole text. */
  DEC(t, false, " hi", 6, 5);
  gc_tok_free(t);
  /* Metaspace decoder: the first token loses its ▁ (prepend_scheme != never). */
  t = load(mistral_json(J("{'type': 'Metaspace', 'replacement': '\xe2\x96\x81', "
                          "'prepend_scheme': 'always', 'split': true}")));
  DEC(t, false, "hi hi", 5, 5);
  DEC(t, true, "hi hi", 1, 5, 5); /* skipped tokens do not count as the first */
  gc_tok_free(t);
  t = load(mistral_json(J("{'type': 'Metaspace', 'replacement': '\xe2\x96\x81', "
                          "'prepend_scheme': 'never', 'split': true}")));
  DEC(t, false, " hi hi", 5, 5);
  gc_tok_free(t);
  /* Strip with stop: trailing content chars held back by the stream until settled. */
  t = load(mistral_json(J("{'type': 'Sequence', 'decoders': [{'type': 'Fuse'}, {'type': 'Strip', "
                          "'content': 'x', 'start': 0, 'stop': 2}]}")));
  DEC(t, false, "x", 7, 7, 7);
  DEC(t, false, "xx\xe2\x96\x81" "x", 7, 7, 6, 7, 7, 7);
  gc_tok_free(t);
}

/* ---------------------------------------------------------------------------------------
 * Load errors: each names the JSON path and what is wrong.
 */
MT_TEST(refusals_name_the_path) {
  const char *m = "'model': {'type': 'BPE', 'vocab': {'a': 0, 'b': 1}, 'merges': []}";
  refused(J("{'pre_tokenizer': {'type': 'Sequence', 'pretokenizers': [{'type': 'Digits', "
            "'individual_digits': true}, {'type': 'Whitespace'}]}, %s}", m),
          MR_ENOTSUP, "t.json: pre_tokenizer.pretokenizers[1].type = \"Whitespace\": not supported "
          "(supported: Sequence, Split, ByteLevel, Metaspace, Digits)");
  refused(J("{'normalizer': {'type': 'BertNormalizer'}, %s}", m), MR_ENOTSUP,
          "normalizer.type = \"BertNormalizer\": not supported");
  refused(J("{'decoder': {'type': 'WordPiece'}, %s}", m), MR_ENOTSUP,
          "decoder.type = \"WordPiece\": not supported");
  refused(J("{'post_processor': {'type': 'RobertaProcessing'}, %s}", m), MR_ENOTSUP,
          "post_processor.type = \"RobertaProcessing\"");
  refused(J("{'model': {'type': 'Unigram', 'vocab': []}}"), MR_ENOTSUP,
          "model.type = \"Unigram\": not supported (supported: BPE)");
  refused(J("{'model': {'type': 'BPE', 'vocab': {'a': 0}, 'merges': [['a', 'z']]}}"),
          MR_EFORMAT, "model.merges[0]: token \"z\" is not in model.vocab");
  refused(J("{'model': {'type': 'BPE', 'vocab': {'a': 0, 'b': 1}, 'merges': ['a b']}}"),
          MR_EFORMAT, "model.merges[0]: the merged token \"ab\" is not in model.vocab");
  refused(J("{'model': {'type': 'BPE', 'vocab': {'a': 0, 'b': 1}, 'merges': ['a b c']}}"),
          MR_EFORMAT, "model.merges[0] = \"a b c\": must be two tokens");
  refused(J("{'model': {'type': 'BPE', 'dropout': 0.1, 'vocab': {}, 'merges': []}}"),
          MR_ENOTSUP, "model.dropout = 0.10000000000000001: not supported");
  refused(J("{'truncation': {'max_length': 5}, %s}", m), MR_ENOTSUP, "truncation = an object");
  refused(J("{'version': '2.0', %s}", m), MR_ENOTSUP, "version = \"2.0\"");
  refused(J("{'model': {'type': 'BPE', 'vocab': {'a': 4194304}, 'merges': []}}"), MR_ERANGE,
          "model.vocab[\"a\"]");
  refused(J("{'model': {'type': 'BPE', 'vocab': {'a': 1, 'b': 1}, 'merges': []}}"), MR_EFORMAT,
          "id 1 is given to both");
  refused(J("{'model': {'type': 'BPE', 'vocab': {'a': 0}}}"), MR_EFORMAT, "model.merges = (missing)");
  refused(J("{'normalizer': {'type': 'Strip', 'strip_left': true}, %s}", m), MR_EFORMAT,
          "normalizer.strip_right = (missing): must be true or false");
  refused(J("{'normalizer': {'type': 'NFC'}, 'pre_tokenizer': {'type': 'Metaspace', "
            "'replacement': '_', 'prepend_scheme': 'first'}, %s}", m), MR_ENOTSUP,
          "pre_tokenizer.prepend_scheme = \"first\": not supported together with a normalizer");
  refused(J("{'decoder': {'type': 'ByteLevel', 'add_prefix_space': false}, %s}", m), MR_EFORMAT,
          "decoder.trim_offsets = (missing)");
  refused(J("{'decoder': {'type': 'Sequence', 'decoders': [{'type': 'ByteLevel', "
            "'add_prefix_space': false, 'trim_offsets': false}, "
            "{'type': 'Replace', 'pattern': {'String': 'a'}, 'content': 'b'}]}, %s}", m),
          MR_ENOTSUP, "decoder.decoders[1].type = \"Replace\": not supported after a ByteLevel");
  refused(J("{'post_processor': {'type': 'TemplateProcessing', 'single': [{'SpecialToken': "
            "{'id': '<x>', 'type_id': 0}}], 'pair': [], 'special_tokens': {}}, %s}", m),
          MR_EFORMAT, "post_processor.single[0].SpecialToken.id = \"<x>\": not in");
  refused(J("{'pre_tokenizer': {'type': 'Split', 'pattern': {'Regex': '(['}, 'behavior': "
            "'Isolated', 'invert': false}, %s}", m), MR_EFORMAT,
          "pre_tokenizer.pattern.Regex: invalid regular expression");
  refused(J("{'pre_tokenizer': {'type': 'Split', 'pattern': {'Regex': 'a'}, 'behavior': "
            "'Sideways', 'invert': false}, %s}", m), MR_EFORMAT, "pre_tokenizer.behavior = \"Sideways\"");
  refused(J("{'model': {'type': 'BPE', 'vocab': {'a\\u0000': 0}, 'merges': []}}"), MR_ENOTSUP,
          "\\u0000");
  refused(J("{'added_tokens': [{'id': 1, 'content': 'x'}], %s}", m), MR_EFORMAT,
          "added_tokens[0].single_word = (missing)");
  refused(J("{'pre_tokenizer': {'type': 'Whitespace'}, %s}", m), MR_ENOTSUP, "Whitespace");
  refused("{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0", MR_EFORMAT, "invalid JSON at byte");
  /* Bytes HF's serde_json refuses and cJSON would let into the vocabulary. */
  refused("{\"model\": {\"type\": \"BPE\", \"vocab\": {\"\xbc\": 0}, \"merges\": []}}", MR_EFORMAT,
          "t.json: byte 37 (line 1): not valid UTF-8");
  {
    static const char nul[] = "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\0b\": 0}, \"merges\": []}}";
    gc_tok *t;
    mr_err e = {0};
    MT_EQ_INT(gc_tok_load_json(&t, nul, sizeof nul - 1, NULL, 0, "t.json", &e), MR_EFORMAT);
    MT_CONTAINS(e.msg, "a NUL byte");
  }
  refused("", MR_EFORMAT, "t.json");
  refused("[1]", MR_EFORMAT, "must be a JSON object");
  /* A legacy untyped component. */
  refused(J("{'normalizer': {'strip_left': true, 'strip_right': true}, %s}", m), MR_ENOTSUP,
          "normalizer has no \"type\"");
  /* Nesting bounded. */
  char deep[4096] = "";
  for (int i = 0; i < 40; i++) strcat(deep, "{'type': 'Sequence', 'normalizers': [");
  strcat(deep, "{'type': 'NFC'}");
  for (int i = 0; i < 40; i++) strcat(deep, "]}");
  refused(J("{'normalizer': %s, %s}", deep, m), MR_ERANGE, "nested too deep");
}

MT_TEST(load_from_directory_and_config) {
  char dir[] = "/tmp/test_tok_XXXXXX";
  MT_TRUE(mkdtemp(dir) != NULL);
  char p[512];
  snprintf(p, sizeof p, "%s/tokenizer.json", dir);
  FILE *f = fopen(p, "w");
  MT_TRUE(f != NULL);
  fputs(qwen_like(J(QWEN_ADDED), ""), f);
  fclose(f);
  snprintf(p, sizeof p, "%s/tokenizer_config.json", dir);
  f = fopen(p, "w");
  fputs(J("{'bos_token': null, 'eos_token': {'__type': 'AddedToken', 'content': '<|im_end|>'}, "
          "'add_bos_token': false, 'add_eos_token': true}"), f);
  fclose(f);
  gc_tok *t;
  mr_err e = {0};
  MT_OK(gc_tok_load(&t, dir, &e), &e);
  MT_EQ_INT(gc_tok_bos_id(t), -1);
  MT_EQ_INT(gc_tok_eos_id(t), 266);
  MT_FALSE(gc_tok_add_bos(t));
  MT_TRUE(gc_tok_add_eos(t));
  gc_tok_free(t);
  snprintf(p, sizeof p, "%s/tokenizer.json", dir);
  MT_OK(gc_tok_load(&t, p, &e), &e);
  MT_EQ_INT(gc_tok_eos_id(t), 266);
  gc_tok_free(t);
  /* A bad config is named. */
  snprintf(p, sizeof p, "%s/tokenizer_config.json", dir);
  f = fopen(p, "w");
  fputs("{\"add_bos_token\": 3}", f);
  fclose(f);
  MT_EQ_INT(gc_tok_load(&t, dir, &e), MR_EFORMAT);
  MT_CONTAINS(e.msg, "tokenizer_config.json: add_bos_token = 3");
  unlink(p);
  snprintf(p, sizeof p, "%s/tokenizer.json", dir);
  unlink(p);
  MT_EQ_INT(gc_tok_load(&t, dir, &e), MR_ENOTFOUND);
  MT_CONTAINS(e.msg, "neither tokenizer.json nor tiktoken.model");
  MT_EQ_INT(gc_tok_load(&t, "/nonexistent/tokenizer.json", &e), MR_ENOTFOUND);
  MT_CONTAINS(e.msg, "/nonexistent/tokenizer.json");
  rmdir(dir);
}

/* ---------------------------------------------------------------------------------------
 * Kimi: tiktoken.model.
 */

/* All 256 bytes (rank = byte), then "bc" 256, "ab" 257, "abc" 258, "  " 259, "bcbc" 260. */
static char *kimi_model(void) {
  static char b[1 << 15];
  size_t o = 0;
  static const char *const b64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  for (int i = 0; i < 256; i++)
    o += (size_t)snprintf(b + o, sizeof b - o, "%c%c== %d\n", b64[i >> 2], b64[(i & 3) << 4], i);
  /* base64: "bc" YmM=, "ab" YWI=, "abc" YWJj, "  " ICA=, "bcbc" YmNiYw== */
  o += (size_t)snprintf(b + o, sizeof b - o, "YmM= 256\nYWI= 257\nYWJj 258\nICA= 259\nYmNiYw== 260\n");
  return b;
}

MT_TEST(kimi_tiktoken) {
  const char *cfg = J("{'bos_token': '[BOS]', 'eos_token': '[EOS]', 'added_tokens_decoder': "
                      "{'261': {'content': '[BOS]', 'special': true}, '262': {'content': '[EOS]'}, "
                      "'263': {'content': '<|im_end|>', 'special': true}}}");
  const char *model = kimi_model();
  gc_tok *t;
  mr_err e = {0};
  MT_OK(gc_tok_load_tiktoken(&t, model, strlen(model), cfg, strlen(cfg), "tiktoken.model", &e), &e);
  MT_EQ_INT(gc_tok_vocab_size(t), 261 + 256);
  MT_EQ_INT(gc_tok_bos_id(t), 261);
  MT_EQ_INT(gc_tok_eos_id(t), 262);
  MT_EQ_INT(gc_tok_token_id(t, "<|reserved_token_300|>"), 300);
  MT_TRUE(gc_tok_is_special(t, 300));
  /* A pre-token that is a token is taken whole; else tiktoken's rule: any two adjacent parts
   * whose bytes make a token merge, lowest rank first: x a b c -> x a bc -> x abc. */
  ENC(t, "abc", 258);
  ENC(t, "xabc", 'x', 258);
  ENC(t, "bcbc", 260); /* a token itself: taken whole */
  ENC(t, "xbcbcx", 'x', 260, 'x');
  ENC(t, "[BOS]abc<|im_end|>", 261, 258, 263);
  DEC(t, false, "[BOS]abc<|im_end|>", 261, 258, 263);
  DEC(t, true, "abc", 261, 258, 263);
  /* tokenization_kimi.py cuts runs of more than 25,000 (non-)whitespace chars: 25,001
   * spaces become 25,000 + 1, each piece encoded alone (two-space tokens: 12,500 + one). */
  char *sp = mr_malloc(25002);
  memset(sp, ' ', 25001);
  gc_tok_ids ids = {0};
  MT_OK(gc_tok_encode(t, sp, 25001, false, &ids, &e), &e);
  MT_EQ_INT(ids.n, 12501);
  MT_EQ_INT(ids.v[12499], 259);
  MT_EQ_INT(ids.v[12500], ' ');
  /* 25,000 is not cut: 12,500 pairs. */
  MT_OK(gc_tok_encode(t, sp, 25000, false, &ids, &e), &e);
  MT_EQ_INT(ids.n, 12500);
  mr_free(sp);
  gc_tok_ids_close(&ids);
  gc_tok_free(t);
  /* Refusals. */
  const char *bad[] = {"YWI= x\n", "YWI 3\n", "YWI= 1\nYWI= 2\n", "!!!! 1\n"};
  const char *want[] = {"line 1", "line 1", "line 2: the token is listed twice", "line 1"};
  for (int i = 0; i < 4; i++) {
    MT_TRUE(gc_tok_load_tiktoken(&t, bad[i], strlen(bad[i]), NULL, 0, "k.model", &e) != 0);
    MT_CONTAINS(e.msg, want[i]);
  }
  MT_TRUE(gc_tok_load_tiktoken(&t, "YWI= 0\n", 7, NULL, 0, "k.model", &e) != 0);
  MT_CONTAINS(e.msg, "byte 0x00 has no token");
}

/* ---------------------------------------------------------------------------------------
 * Faults and threads.
 */
MT_TEST(failed_allocations_fail_cleanly) {
  /* Every allocation of a load, then of an encode and a decode, is made to fail in turn:
   * each call fails with MR_ENOMEM (or succeeds once n passes its count), never crashes. */
  const char *json = qwen_like(J(QWEN_ADDED), "");
  int loads = 0;
  for (long n = 1; n < 100000; n++) {
    gc_tok *t = NULL;
    mr_err e = {0};
    mr_alloc_fail_after(n);
    int rc = gc_tok_load_json(&t, json, strlen(json), NULL, 0, "t.json", &e);
    mr_alloc_fail_after(0);
    if (rc == 0) {
      gc_tok_free(t);
      break;
    }
    MT_EQ_INT(rc, MR_ENOMEM);
    MT_TRUE(t == NULL);
    loads++;
  }
  MT_TRUE(loads > 10);
  gc_tok *t = load(json);
  const char *text = "<|im_start|>hello world \xe4\xb8\xad\xff and more text 123";
  int32_t want_ids[64];
  size_t want_n;
  {
    gc_tok_ids ids = {0};
    MT_OK(gc_tok_encode(t, text, strlen(text), true, &ids, NULL), NULL);
    want_n = ids.n;
    memcpy(want_ids, ids.v, ids.n * sizeof *ids.v);
    gc_tok_ids_close(&ids);
  }
  for (long n = 1; n < 10000; n++) {
    gc_tok_ids ids = {0};
    gc_tok_text tx = {0};
    mr_err e = {0};
    mr_alloc_fail_after(n);
    int rc = gc_tok_encode(t, text, strlen(text), true, &ids, &e);
    int rc2 = rc ? 0 : gc_tok_decode(t, ids.v, ids.n, false, &tx, &e);
    mr_alloc_fail_after(0);
    if (rc == 0 && rc2 == 0) {
      ids_eq(&ids, want_ids, want_n, "after faults");
      gc_tok_ids_close(&ids);
      gc_tok_text_close(&tx);
      break;
    }
    MT_EQ_INT(rc ? rc : rc2, MR_ENOMEM);
    gc_tok_ids_close(&ids);
    gc_tok_text_close(&tx);
  }
  gc_tok_free(t);
}

static gc_tok *g_tok;
static void *enc_thread(void *arg) {
  const char *texts[] = {"hello world hello", "<|im_start|>hello\xe4\xb8\xad", "abc def ghi jkl",
                         "hello  world   x"};
  gc_tok_ids ids = {0}, ref = {0};
  long bad = 0;
  for (int r = 0; r < 2000; r++) {
    const char *s = texts[(r + (int)(intptr_t)arg) % 4];
    gc_tok_encode(g_tok, s, strlen(s), false, &ids, NULL);
    gc_tok_encode(g_tok, s, strlen(s), false, &ref, NULL);
    bad += ids.n != ref.n || memcmp(ids.v, ref.v, ids.n * sizeof *ids.v) != 0;
  }
  gc_tok_ids_close(&ids);
  gc_tok_ids_close(&ref);
  return (void *)bad;
}

MT_TEST(encode_from_threads) {
  g_tok = load(qwen_like(J(QWEN_ADDED), ""));
  gc_tok_ids one = {0};
  MT_OK(gc_tok_encode(g_tok, "hello world hello", 17, false, &one, NULL), NULL);
  pthread_t th[4];
  for (intptr_t i = 0; i < 4; i++) pthread_create(&th[i], NULL, enc_thread, (void *)i);
  long bad = 0;
  for (int i = 0; i < 4; i++) {
    void *r;
    pthread_join(th[i], &r);
    bad += (long)r;
  }
  MT_EQ_INT(bad, 0);
  gc_tok_ids again = {0};
  MT_OK(gc_tok_encode(g_tok, "hello world hello", 17, false, &again, NULL), NULL);
  ids_eq(&again, one.v, one.n, "after threads");
  gc_tok_ids_close(&one);
  gc_tok_ids_close(&again);
  gc_tok_free(g_tok);
}

MT_MAIN()
