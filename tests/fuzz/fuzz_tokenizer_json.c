/*
 * fuzz_tokenizer_json.c - libFuzzer target for the tokenizer's loaders
 * (gpu_client/runner/tok_json.c): an input starting with '{' is a tokenizer.json, any other
 * a tiktoken.model. A refusal must come with a message; a tokenizer that loads must then
 * encode and decode a fixed text without crashing, with every id below its vocab size and
 * the decoded text valid UTF-8, and its stream must agree with decode.
 */
#include "gpu_client/runner/tok_internal.h"
#include "tests/fuzz/fuzz.h"

#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void exercise(const gc_tok *t) {
  static const char *const texts[] = {
      "Hello world, <|im_start|>user\nhi<|im_end|> 123 4567",
      "  caf\xc3\xa9 e\xcc\x81 \xe4\xb8\xad\xe6\x96\x87 \xf0\x9f\x91\x8b\xf0\x9f\x8f\xbd\t\n",
      "<s>abc</s> \xff\xfe bad \xe4\xb8",
      "",
  };
  gc_tok_ids ids = {0};
  gc_tok_text tx = {0};
  mr_err e;
  for (size_t k = 0; k < sizeof texts / sizeof *texts; k++) {
    for (int sp = 0; sp < 2; sp++) {
      if (gc_tok_encode(t, texts[k], strlen(texts[k]), sp, &ids, &e) != 0) {
        /* Only an unk token missing from the vocabulary may refuse a text. */
        if (e.code != MR_EFORMAT || !strstr(e.msg, "unk_token")) abort();
        continue;
      }
      for (size_t i = 0; i < ids.n; i++)
        if (ids.v[i] < 0 || (uint32_t)ids.v[i] >= gc_tok_vocab_size(t)) abort();
      for (int skip = 0; skip < 2; skip++) {
        if (gc_tok_decode(t, ids.v, ids.n, skip, &tx, &e) != 0) continue;
        if (gc__tok_utf8_valid_prefix(tx.s, tx.len) != tx.len || strlen(tx.s) > tx.len) abort();
        gc_tok_stream *s;
        if (gc_tok_stream_new(t, skip, &s, &e) != 0) continue;
        size_t got = 0;
        bool same = true;
        for (size_t i = 0; i <= ids.n && same; i++) {
          const char *x;
          size_t l;
          int rc = i < ids.n ? gc_tok_stream_step(s, ids.v[i], &x, &l, &e)
                             : gc_tok_stream_flush(s, &x, &l, &e);
          if (rc) break;
          same = got + l <= tx.len && memcmp(tx.s + got, x, l) == 0;
          got += l;
        }
        gc_tok_stream_free(s);
        if (!same) abort();
      }
    }
  }
  /* Queries on every id, and on ids out of range. */
  for (uint32_t id = 0; id < gc_tok_vocab_size(t) && id < 4096; id++) {
    size_t l;
    const char *p = gc_tok_id_to_piece(t, (int32_t)id, &l);
    if (p && strlen(p) > l) abort();
  }
  if (gc_tok_id_to_piece(t, -1, NULL) || gc_tok_id_to_piece(t, (int32_t)gc_tok_vocab_size(t), NULL))
    abort();
  gc_tok_ids_close(&ids);
  gc_tok_text_close(&tx);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  gc_tok *t = NULL;
  mr_err e = {0};
  int rc = size && data[0] == '{'
               ? gc_tok_load_json(&t, (const char *)data, size, NULL, 0, "fuzz.json", &e)
               : gc_tok_load_tiktoken(&t, (const char *)data, size, NULL, 0, "fuzz.model", &e);
  fuzz_verdict_set(rc == 0);
  if (rc != 0) {
    if (rc > 0 || e.msg[0] == '\0' || t != NULL) abort();
    return 0;
  }
  exercise(t);
  gc_tok_free(t);
  return 0;
}
