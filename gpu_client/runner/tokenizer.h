/*
 * tokenizer.h - text <-> token ids for the model runner (prefix gc_tok_): reads a Hugging
 * Face tokenizer.json (Qwen2/Qwen3, DeepSeek-V3, Mixtral/Mistral/Llama) or Kimi-K2's
 * tiktoken.model, and gives the ids the Python `tokenizers` package gives for the same text.
 *
 *   gc_tok *t;
 *   mr_err e;
 *   if (gc_tok_load(&t, "/models/qwen3-30b-a3b", &e)) { fprintf(stderr, "%s\n", e.msg); ... }
 *   gc_tok_ids ids = {0};
 *   gc_tok_encode(t, text, strlen(text), false, &ids, &e);      // ids.v[0 .. ids.n)
 *   gc_tok_text out = {0};
 *   gc_tok_decode(t, ids.v, ids.n, true, &out, &e);            // out.s, NUL-terminated
 *   gc_tok_ids_close(&ids); gc_tok_text_close(&out); gc_tok_free(t);
 *
 * What is read (gpu_client/runner/README.md "Tokenizer" has the full list): the BPE model
 * (byte-level or byte-fallback, both merge layouts), the normalizers, pre-tokenizers,
 * post-processors and decoders those families use, and `added_tokens` matched before the
 * model exactly as HF's AddedVocabulary matches them. Anything else in the file (an unknown
 * component type, a value that changes behaviour and is not implemented) is refused at load
 * with an error naming the JSON path, e.g.
 *   tokenizer.json: pre_tokenizer.pretokenizers[1].type = "Whitespace": not supported
 *   (supported: Sequence, Split, ByteLevel, Metaspace, Digits)
 * Nothing is approximated.
 *
 * Text is UTF-8. Invalid UTF-8 in the input of gc_tok_encode is not an error: each maximal
 * invalid subpart is replaced by U+FFFD first, exactly as Python's
 * bytes.decode("utf-8", "replace") does, and the result is encoded (the Python API only
 * takes str, so that is the HF behaviour on the equivalent input).
 *
 * Ids are int32_t (the runner's type), 0 <= id < gc_tok_vocab_size().
 *
 * Threads: a gc_tok is immutable after gc_tok_load except for an internal word cache that
 * is guarded by its own locks, so every const function here (encode, decode and the
 * queries) may be called from any number of threads at once on one gc_tok. A
 * gc_tok_stream, a gc_tok_ids and a gc_tok_text belong to one thread at a time.
 */
#ifndef GC_TOKENIZER_H
#define GC_TOKENIZER_H

#include "common/mr.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct gc_tok gc_tok;
typedef struct gc_tok_stream gc_tok_stream;

/* Largest id a file may give a token (real vocabularies stay under 2^18). */
#define GC_TOK_MAX_ID ((1u << 22) - 1u)
/* Largest tokenizer.json / tiktoken.model read (bytes). */
#define GC_TOK_MAX_FILE_BYTES ((size_t)512 << 20)

/* A caller-owned growable id vector: zero-initialise it ({0}), pass it to gc_tok_encode as
 * often as wanted (its memory is reused), release it with gc_tok_ids_close. */
typedef struct gc_tok_ids {
  int32_t *v;  /* [n] ids (owned) */
  size_t n;    /* ids held */
  size_t cap;  /* room at v, in ids */
} gc_tok_ids;
void gc_tok_ids_close(gc_tok_ids *ids);

/* A caller-owned growable text buffer, used like gc_tok_ids; s is NUL-terminated (s[len]). */
typedef struct gc_tok_text {
  char *s;     /* [len + 1] bytes (owned); NULL until first written */
  size_t len;  /* bytes of text, the NUL not counted */
  size_t cap;  /* room at s, in bytes */
} gc_tok_text;
void gc_tok_text_close(gc_tok_text *t);

/* ---------------------------------------------------------------------------------------
 * Loading.
 */

/*
 * Loads a tokenizer from path:
 *   - a directory: tokenizer.json in it, or else tiktoken.model (Kimi-K2); in both cases
 *     plus tokenizer_config.json when it is there (bos_token / eos_token / add_bos_token /
 *     add_eos_token; for tiktoken.model also added_tokens_decoder, the special tokens);
 *   - a file: a tokenizer.json (any name ending in .json) or a tiktoken.model (any other
 *     name), with tokenizer_config.json read from the same directory when present.
 * On success *out is a new tokenizer the caller owns (gc_tok_free). On failure *out is
 * NULL and e names the file, the JSON path or line, and the limit: MR_ENOTFOUND (no file),
 * MR_EIO, MR_EFORMAT (malformed), MR_ENOTSUP (a component or value not supported),
 * MR_ERANGE (a value past a limit), MR_ENOMEM. Any thread.
 */
int gc_tok_load(gc_tok **out, const char *path, mr_err *e);

/* The same from memory: json (len bytes) is the text of a tokenizer.json; config_json (may
 * be NULL) that of a tokenizer_config.json. `label` names the input in messages
 * ("tokenizer.json"). Nothing is kept from the buffers. */
int gc_tok_load_json(gc_tok **out, const char *json, size_t len, const char *config_json,
                     size_t config_len, const char *label, mr_err *e);

/* The same for a tiktoken.model text (len bytes: lines "<base64 token bytes> <rank>") and
 * its tokenizer_config.json (may be NULL: then the 256 special tokens get their reserved
 * names, and there is no bos/eos). */
int gc_tok_load_tiktoken(gc_tok **out, const char *model, size_t len, const char *config_json,
                         size_t config_len, const char *label, mr_err *e);

/* Releases everything the tokenizer owns. NULL is a no-op. No call on tok may be running. */
void gc_tok_free(gc_tok *tok);

/* ---------------------------------------------------------------------------------------
 * Encoding and decoding.
 */

/*
 * Encodes len bytes of text (need not be NUL-terminated; invalid UTF-8 as said above) into
 * out, replacing what out held. add_special_tokens applies the file's post-processor
 * (TemplateProcessing: e.g. Llama's "<s>" in front), like HF's encode(text,
 * add_special_tokens=...); a tokenizer without one (Qwen, Kimi) adds nothing either way.
 * Special tokens written in the text ("<|im_start|>") are always recognised, as in HF.
 * Returns 0, or MR_ENOMEM / MR_ERANGE (text over 2^31 bytes) / MR_EINTERNAL (the regex engine
 * failed) with out->n = 0. Any thread, concurrently with other calls on tok.
 */
int gc_tok_encode(const gc_tok *tok, const char *text, size_t len, bool add_special_tokens,
                  gc_tok_ids *out, mr_err *e);

/*
 * Decodes n ids into out (replacing its text) through the file's decoder, like HF's
 * decode(ids, skip_special_tokens). With skip_special_tokens, tokens marked special are
 * left out. Ids that name no token are skipped, as HF skips them. Bytes that do not form
 * valid UTF-8 (a byte-level token sequence cut inside a character) come out as U+FFFD, one
 * per maximal invalid subpart (HF: String::from_utf8_lossy), so out->s is always valid
 * UTF-8. Returns 0 or MR_ENOMEM. Any thread.
 */
int gc_tok_decode(const gc_tok *tok, const int32_t *ids, size_t n, bool skip_special_tokens,
                  gc_tok_text *out, mr_err *e);

/*
 * Streaming decoder, for printing tokens as they are generated. Each step returns the text
 * that id completes; bytes of a character that is not finished yet (a byte-level token
 * ending inside a multi-byte UTF-8 sequence, a run of <0xNN> byte tokens) are held back
 * until it is. The concatenation of every step's text and the final flush is exactly
 * gc_tok_decode of all the ids (gc_tok_decode is itself this machine run to the end).
 *
 *   gc_tok_stream *s;
 *   gc_tok_stream_new(tok, true, &s, &e);
 *   for each generated id: gc_tok_stream_step(s, id, &txt, &len, &e); fwrite(txt, 1, len, f);
 *   gc_tok_stream_flush(s, &txt, &len, &e); fwrite(...);   // end of the sequence
 *   gc_tok_stream_free(s);
 *
 * The text returned is owned by the stream and valid until its next call. The stream keeps
 * a pointer to tok, which must outlive it. One thread at a time per stream.
 */
int gc_tok_stream_new(const gc_tok *tok, bool skip_special_tokens, gc_tok_stream **out,
                      mr_err *e);
/* Feeds one id; *text / *len get what it completes (often "" / 0 while a character is
 * unfinished). Returns 0 or MR_ENOMEM. */
int gc_tok_stream_step(gc_tok_stream *s, int32_t id, const char **text, size_t *len, mr_err *e);
/* Ends the sequence: returns what was held back (an unfinished character as U+FFFD) and
 * resets the stream, ready for a new sequence. */
int gc_tok_stream_flush(gc_tok_stream *s, const char **text, size_t *len, mr_err *e);
/* Drops what the stream holds and starts a new sequence. */
void gc_tok_stream_reset(gc_tok_stream *s);
/* NULL is a no-op. */
void gc_tok_stream_free(gc_tok_stream *s);

/* ---------------------------------------------------------------------------------------
 * Queries. All O(1) or one hash lookup; any thread.
 */

/* One more than the largest id of the model or an added token (the rows an embedding
 * table needs at least). */
uint32_t gc_tok_vocab_size(const gc_tok *tok);
/* The id of the token whose text is piece (len bytes; an added token first, then the
 * model's vocabulary, as HF's token_to_id), or -1. */
int32_t gc_tok_token_id_n(const gc_tok *tok, const char *piece, size_t len);
/* The same for a NUL-terminated piece: gc_tok_token_id(t, "<|im_start|>"). */
int32_t gc_tok_token_id(const gc_tok *tok, const char *piece);
/* The text of token id as the vocabulary spells it (HF id_to_token: "Ġhello", "▁the",
 * "<0x0A>", "<|im_end|>"), NUL-terminated, owned by tok; *len (may be NULL) gets its length.
 * NULL when id names no token. */
const char *gc_tok_id_to_piece(const gc_tok *tok, int32_t id, size_t *len);
/* True if id is an added token (added_tokens of tokenizer.json, or a Kimi special token). */
bool gc_tok_is_added(const gc_tok *tok, int32_t id);
/* True if id is a special token (left out by decode with skip_special_tokens). */
bool gc_tok_is_special(const gc_tok *tok, int32_t id);
/* The added tokens, in the order of the file; i < gc_tok_added_count. The strings are owned
 * by tok. */
typedef struct gc_tok_added_info {
  int32_t id;
  const char *content; /* NUL-terminated */
  bool special, single_word, lstrip, rstrip, normalized;
} gc_tok_added_info;
size_t gc_tok_added_count(const gc_tok *tok);
void gc_tok_added_at(const gc_tok *tok, size_t i, gc_tok_added_info *info);

/* tokenizer_config.json's bos_token / eos_token as ids, or -1 when absent or naming no
 * token. */
int32_t gc_tok_bos_id(const gc_tok *tok);
int32_t gc_tok_eos_id(const gc_tok *tok);
/* tokenizer_config.json's add_bos_token / add_eos_token (false when absent). These are
 * what transformers' slow tokenizers add; gc_tok_encode follows tokenizer.json's
 * post-processor instead (as HF `tokenizers` does), so a runner that wants transformers'
 * behaviour on a file without a post-processor prepends gc_tok_bos_id itself. */
bool gc_tok_add_bos(const gc_tok *tok);
bool gc_tok_add_eos(const gc_tok *tok);

/* A short description of what was loaded, for logs: "BPE byte-level, 151643 + 22 added,
 * NFC, Split+ByteLevel" (owned by tok). */
const char *gc_tok_describe(const gc_tok *tok);

#ifdef __cplusplus
}
#endif
#endif /* GC_TOKENIZER_H */
