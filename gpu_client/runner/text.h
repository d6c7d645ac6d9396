/*
 * text.h - text out of produced token ids (prefix gc_text_): streaming detokenization with
 * stop strings, and the model's stop ids. Shared by `moerpc-client generate` and `serve`.
 *
 * A gc_text_out follows one generated sequence. Each produced id goes through the
 * tokenizer's streaming decoder (bytes of an unfinished UTF-8 character wait for the rest),
 * then through the stop strings: text that could still be the start of a stop string is
 * held back until it is not (or until it is one), so what was emitted never has to be taken
 * back, and a stop string never reaches the client:
 *
 *     ids -> gc_tok_stream -> pending text -> [longest suffix that prefixes a stop] held
 *                                          -> the rest emitted; a complete stop: emit what
 *                                             precedes it, drop it and everything after
 *
 * Threads: a gc_text_out belongs to one thread at a time (the scheduler's, in serve).
 */
#ifndef GC_TEXT_H
#define GC_TEXT_H

#include "gpu_client/runner/model.h"
#include "gpu_client/runner/tokenizer.h"

#ifdef __cplusplus
extern "C" {
#endif

#define GC_TEXT_MAX_STOPS 16u
#define GC_TEXT_MAX_STOP_BYTES 1024u

typedef struct gc_text_out gc_text_out;

/* stops: n_stops strings (each 1..GC_TEXT_MAX_STOP_BYTES bytes; copied), n_stops <=
 * GC_TEXT_MAX_STOPS. skip_special: special tokens produce no text. MR_EINVAL / MR_ERANGE
 * naming the stop and the limit. */
int gc_text_out_new(gc_text_out **out, const gc_tok *tok, const char *const *stops, size_t n_stops,
                    bool skip_special, mr_err *e);
void gc_text_out_free(gc_text_out *t); /* NULL is a no-op */
/* Feeds one produced id. *emit / *len (valid until the next call on t) get the text to show
 * now, possibly empty; *stopped is set when a stop string completed: the text before it
 * was emitted and the sequence should end (feed nothing more). */
int gc_text_out_feed(gc_text_out *t, int32_t id, const char **emit, size_t *len, bool *stopped, mr_err *e);
/* The sequence ended otherwise (length, a stop id): the text still held back. */
int gc_text_out_finish(gc_text_out *t, const char **emit, size_t *len, mr_err *e);

/* The model's stop ids: generation_config.json's eos_token_id (a number or a list) in
 * model_dir when there is one, then the tokenizer's eos id, without repeats; at most cap.
 * A generation_config.json that does not parse, or an id outside the vocabulary, is
 * MR_EFORMAT naming the file and the field. */
int gc_text_stop_ids(const char *model_dir, const gc_tok *tok, int32_t *ids, size_t cap, size_t *n,
                     mr_err *e);

/* The model's recommended sampling, from generation_config.json in model_dir (as vLLM and
 * SGLang take it by default): temperature, top_p and top_k where given (do_sample false
 * means greedy); fields not given keep smp's values. *found tells whether the file gave
 * any. A field of the wrong type or out of range is MR_EFORMAT naming the file and it. */
int gc_text_sampling(const char *model_dir, gc_sampling *smp, bool *found, mr_err *e);

/* ---- chat prompts ----------------------------------------------------------------------------
 *
 * A model's chat template with what transformers passes next to the messages: the special
 * tokens of tokenizer_config.json (bos_token, eos_token, as strings), tools and documents
 * (null when none), add_generation_prompt and any extra variable (enable_thinking, ...).
 * The messages are normalized as transformers does before rendering: keys whose value is
 * null are dropped, "thinking" / "reasoning" become "reasoning_content". A content that is
 * a list of only text parts is joined into one string when the template is not known to
 * read parts (most published templates concatenate message['content'] as a string). */
typedef struct gc_chat gc_chat;
/* The template of model_dir (gc_tmpl_load_dir), or of template_file when not NULL (the
 * --chat-template override). MR_ENOTFOUND when the model has none, compile refusals as
 * gc_tmpl_compile (naming the construct and the line). */
int gc_chat_load(gc_chat **out, const char *model_dir, const char *template_file, mr_err *e);
void gc_chat_free(gc_chat *c); /* NULL is a no-op */
/* Renders messages (a cJSON array of {"role", "content", ...}) with tools (a cJSON array or
 * NULL) and extra (a cJSON object of more variables or NULL) into *out (mr_free). Errors as
 * gc_tmpl_render, and MR_EINVAL naming messages[i] for a message that is not an object or
 * has no string role. Any thread. */
int gc_chat_render(const gc_chat *c, const struct cJSON *messages, const struct cJSON *tools,
                   bool add_generation_prompt, const struct cJSON *extra, char **out, size_t *len,
                   mr_err *e);

#ifdef __cplusplus
}
#endif
#endif /* GC_TEXT_H */
