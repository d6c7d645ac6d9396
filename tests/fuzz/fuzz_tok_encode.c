/*
 * fuzz_tok_encode.c - libFuzzer target for encode / decode / stream on arbitrary bytes
 * (invalid UTF-8, long inputs) with two fixed small tokenizers built in: a byte-level one
 * (Qwen's split regex, no normalizer, special and plain added tokens; none strips spaces, so
 * that the round trip below holds) and a byte-fallback
 * one (Mixtral's legacy normalizer, unk, template, the Replace/ByteFallback/Fuse/Strip
 * decoder). The first input byte picks one; the rest is the text.
 *
 * Checked: encode never fails; every id is below the vocab size; decode is valid UTF-8;
 * the stream's steps + flush equal decode; and for the byte-level tokenizer the round trip
 * is exact: decode(encode(x)) == x with invalid UTF-8 replaced (the input HF would get).
 */
#include "gpu_client/runner/tok_internal.h"
#include "tests/fuzz/fuzz.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static gc_tok *tok[2];

/* Byte-level: the 256 byte chars (id = byte) and a few merges. */
static char *byte_level_json(void) {
  static char b[1 << 15];
  size_t o = (size_t)snprintf(b, sizeof b,
      "{\"added_tokens\": ["
      "{\"id\": 265, \"content\": \"<|im_start|>\", \"single_word\": false, \"lstrip\": false, "
      "\"rstrip\": false, \"normalized\": false, \"special\": true},"
      "{\"id\": 266, \"content\": \"<|im_end|>\", \"single_word\": false, \"lstrip\": false, "
      "\"rstrip\": false, \"normalized\": false, \"special\": true},"
      "{\"id\": 267, \"content\": \"<think>\", \"single_word\": true, \"lstrip\": false, "
      "\"rstrip\": false, \"normalized\": false, \"special\": false}],"
      "\"pre_tokenizer\": {\"type\": \"Sequence\", \"pretokenizers\": ["
      "{\"type\": \"Split\", \"pattern\": {\"Regex\": \"(?i:'s|'t|'re|'ve|'m|'ll|'d)|"
      "[^\\\\r\\\\n\\\\p{L}\\\\p{N}]?\\\\p{L}+|\\\\p{N}| ?[^\\\\s\\\\p{L}\\\\p{N}]+[\\\\r\\\\n]*|"
      "\\\\s*[\\\\r\\\\n]+|\\\\s+(?!\\\\S)|\\\\s+\"}, \"behavior\": \"Isolated\", \"invert\": false},"
      "{\"type\": \"ByteLevel\", \"add_prefix_space\": false, \"trim_offsets\": false, "
      "\"use_regex\": false}]},"
      "\"decoder\": {\"type\": \"ByteLevel\", \"add_prefix_space\": false, \"trim_offsets\": false},"
      "\"model\": {\"type\": \"BPE\", \"vocab\": {");
  for (int i = 0; i < 256; i++)
    o += (size_t)snprintf(b + o, sizeof b - o, "\"\\u%04x\": %d, ", gc__tok_byte_cp[i], i);
  snprintf(b + o, sizeof b - o,
           "\"\\u0120t\": 256, \"he\": 257, \"\\u0120the\": 258, \"in\": 259, \"\\u0120a\": 260, "
           "\"er\": 261, \"\\u00e4\\u00b8\": 262, \"\\u00e4\\u00b8\\u0143\": 263, \"\\u0120\\u0120\": 264}, "
           "\"merges\": [\"\\u0120 t\", \"h e\", \"\\u0120t he\", \"i n\", \"\\u0120 a\", \"e r\", "
           "\"\\u00e4 \\u00b8\", \"\\u00e4\\u00b8 \\u0143\", \"\\u0120 \\u0120\"]}}");
  return b;
}

static const char MIXTRAL_JSON[] =
    "{\"added_tokens\": ["
    "{\"id\": 0, \"content\": \"<unk>\", \"single_word\": false, \"lstrip\": false, \"rstrip\": false, "
    "\"normalized\": false, \"special\": true},"
    "{\"id\": 1, \"content\": \"<s>\", \"single_word\": false, \"lstrip\": false, \"rstrip\": false, "
    "\"normalized\": false, \"special\": true}],"
    "\"normalizer\": {\"type\": \"Sequence\", \"normalizers\": [{\"type\": \"Prepend\", \"prepend\": "
    "\"\\u2581\"}, {\"type\": \"Replace\", \"pattern\": {\"String\": \" \"}, \"content\": \"\\u2581\"}]},"
    "\"post_processor\": {\"type\": \"TemplateProcessing\", \"single\": [{\"SpecialToken\": "
    "{\"id\": \"<s>\", \"type_id\": 0}}, {\"Sequence\": {\"id\": \"A\", \"type_id\": 0}}], "
    "\"pair\": [], \"special_tokens\": {\"<s>\": {\"id\": \"<s>\", \"ids\": [1], \"tokens\": [\"<s>\"]}}},"
    "\"decoder\": {\"type\": \"Sequence\", \"decoders\": [{\"type\": \"Replace\", \"pattern\": "
    "{\"String\": \"\\u2581\"}, \"content\": \" \"}, {\"type\": \"ByteFallback\"}, {\"type\": \"Fuse\"}, "
    "{\"type\": \"Strip\", \"content\": \" \", \"start\": 1, \"stop\": 0}]},"
    "\"model\": {\"type\": \"BPE\", \"unk_token\": \"<unk>\", \"fuse_unk\": true, "
    "\"byte_fallback\": true, \"vocab\": {\"<unk>\": 0, \"<s>\": 1, \"<0x0A>\": 2, \"<0xE4>\": 3, "
    "\"<0xB8>\": 4, \"<0xAD>\": 5, \"<0xFF>\": 6, \"\\u2581\": 7, \"a\": 8, \"b\": 9, \"ab\": 10, "
    "\"\\u2581ab\": 11, \"c\": 12, \"<0x41>\": 13}, \"merges\": [[\"a\", \"b\"], [\"\\u2581\", \"ab\"]]}}";

static void init(void) {
  mr_err e;
  const char *js[2] = {byte_level_json(), MIXTRAL_JSON};
  for (int k = 0; k < 2; k++)
    if (gc_tok_load_json(&tok[k], js[k], strlen(js[k]), NULL, 0, "fuzz", &e) != 0) {
      fprintf(stderr, "fuzz_tok_encode: built-in tokenizer %d: %s\n", k, e.msg);
      abort();
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (!tok[0]) init();
  fuzz_verdict_set(true);
  if (size == 0) return 0;
  int which = data[0] & 1;
  const gc_tok *t = tok[which];
  const char *text = (const char *)data + 1;
  size_t n = size - 1;
  gc_tok_ids ids = {0};
  gc_tok_text tx = {0};
  mr_err e;
  if (gc_tok_encode(t, text, n, (data[0] & 2) != 0, &ids, &e) != 0) abort();
  for (size_t i = 0; i < ids.n; i++)
    if (ids.v[i] < 0 || (uint32_t)ids.v[i] >= gc_tok_vocab_size(t)) abort();
  bool skip = (data[0] & 4) != 0;
  if (gc_tok_decode(t, ids.v, ids.n, skip, &tx, &e) != 0) abort();
  if (gc__tok_utf8_valid_prefix(tx.s, tx.len) != tx.len) abort();
  gc_tok_stream *s;
  if (gc_tok_stream_new(t, skip, &s, &e) != 0) abort();
  size_t got = 0;
  for (size_t i = 0; i <= ids.n; i++) {
    const char *x;
    size_t l;
    if ((i < ids.n ? gc_tok_stream_step(s, ids.v[i], &x, &l, &e) : gc_tok_stream_flush(s, &x, &l, &e)) != 0)
      abort();
    if (got + l > tx.len || memcmp(tx.s + got, x, l) != 0) abort();
    got += l;
  }
  if (got != tx.len) abort();
  gc_tok_stream_free(s);
  if (which == 0 && !skip) {
    /* Byte-level BPE loses nothing: the text comes back, invalid bytes as U+FFFD. */
    gc__tok_buf want = {0};
    gc__tok_lossy d = {0};
    if (gc__tok_lossy_feed(&d, text, n, &want) || gc__tok_lossy_end(&d, &want)) abort();
    if (want.n != tx.len || (want.n && memcmp(want.p, tx.s, want.n) != 0)) abort();
    gc__tok_buf_close(&want);
  }
  gc_tok_ids_close(&ids);
  gc_tok_text_close(&tx);
  return 0;
}
