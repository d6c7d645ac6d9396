/*
 * chat_template.h - Hugging Face chat templates (prefix gc_tmpl_): an interpreter for the
 * subset of Jinja that the published templates of Qwen3 / Qwen3-MoE (and Qwen3-Coder),
 * DeepSeek-V3 / R1 / V3.1, Kimi-K2 and Mixtral / Mistral use, rendering byte for byte what
 * transformers' apply_chat_template renders with jinja2 (its sandboxed environment with
 * trim_blocks, lstrip_blocks, the loopcontrols extension, raise_exception, strftime_now,
 * namespace, and its own tojson).
 *
 *   gc_tmpl_compile    template text -> a compiled template, or a refusal that names the
 *                      construct and its place: `chat_template:12:5: "include" is not
 *                      supported`. Every name of a filter, test, method or function is
 *                      checked here, so that a template that would fail later fails now.
 *   gc_tmpl_render     compiled template + the variables (one JSON object, as cJSON or as
 *                      text) -> the rendered text
 *   gc_tmpl_load_dir   the template of a checkpoint directory (chat_template.jinja,
 *                      additional_chat_templates/<name>.jinja or tokenizer_config.json)
 *
 * The variables are exactly the keyword arguments transformers passes to the template:
 *
 *   {"messages": [{"role": "user", "content": "Hi"}, ...],
 *    "tools": null, "documents": null, "add_generation_prompt": true,
 *    "bos_token": "<s>", "eos_token": "</s>", "enable_thinking": false, ...}
 *
 * transformers passes "tools" and "documents" as null when it has none (so `tools is
 * defined` is true); pass them the same way to render what it renders. A message's
 * "content" may be a string or a list of parts ({"type": "text", "text": ...}); tool calls,
 * tool_call_id, name, reasoning_content and any other key are seen by the template as
 * they are. transformers also drops the keys of a message whose value is null and copies
 * "thinking"/"reasoning" into "reasoning_content" (and back) before rendering; that is
 * the caller's to do.
 *
 * Errors (mr_err): compile refusals MR_ENOTSUP (a construct outside the subset) or
 * MR_EFORMAT (a syntax error), both "origin:line:col: ..."; at render, a template's
 * raise_exception(msg) is MR_EPRECOND with msg (its first 500 bytes) as the whole
 * message (the conversation broke the template's rule, e.g. roles must alternate), a
 * limit is MR_EEXHAUSTED naming it, anything else (a type error, an undefined value
 * used) MR_EINVAL "origin:line:col: ...". Nothing a template or a context can do aborts
 * or hangs: output, memory, loop iterations, macro depth and value nesting are bounded
 * (gc_tmpl_limits).
 *
 * Threads: a compiled template is immutable; any number of threads may render it at
 * once, each render with its own scratch memory.
 */
#ifndef GC_CHAT_TEMPLATE_H
#define GC_CHAT_TEMPLATE_H

#include <stddef.h>
#include <stdint.h>

#include "common/mr.h"

#ifdef __cplusplus
extern "C" {
#endif

struct cJSON;
typedef struct gc_tmpl gc_tmpl;

/* Bounds of one render; a field at 0 takes its default. */
typedef struct gc_tmpl_limits {
  size_t max_output;     /* bytes of rendered text (and of any captured block); 16 MiB */
  size_t max_memory;     /* bytes of values the render makes (strings, lists, ...); 256 MiB */
  uint64_t max_steps;    /* loop iterations + macro calls, all loops together; 1,000,000 */
  uint32_t max_depth;    /* nested macro calls; 64 */
} gc_tmpl_limits;

#define GC_TMPL_DEFAULT_MAX_OUTPUT ((size_t)16 << 20)
#define GC_TMPL_DEFAULT_MAX_MEMORY ((size_t)256 << 20)
#define GC_TMPL_DEFAULT_MAX_STEPS 1000000u
#define GC_TMPL_DEFAULT_MAX_DEPTH 64u
/* Templates longer than this are refused (the largest published ones are ~20 KB). */
#define GC_TMPL_MAX_SOURCE ((size_t)1 << 20)

/*
 * Compiles len bytes of template text src (UTF-8; need not be NUL-terminated). origin
 * names the template in messages ("chat_template" if NULL). On success
 * *out is a new template that the caller frees with gc_tmpl_free; on failure *out is NULL
 * and e says why (MR_ENOTSUP, MR_EFORMAT, MR_ERANGE for a source over GC_TMPL_MAX_SOURCE,
 * MR_ENOMEM).
 */
int gc_tmpl_compile(gc_tmpl **out, const char *src, size_t len, const char *origin, mr_err *e);

/* Frees a compiled template; NULL is a no-op. No render of it may be running. */
void gc_tmpl_free(gc_tmpl *t);

/*
 * Renders t with the variables of vars, a JSON object (NULL = no variables). JSON numbers
 * become Python ints when integral and within +-2^53, floats otherwise (cJSON does not
 * keep "1.0" apart from "1"; gc_tmpl_render_json does). A cJSON_Raw item is read as
 * JSON text. limits may be NULL (all defaults).
 * On success *out is a new NUL-terminated string of *out_len bytes (out_len may be NULL)
 * that the caller frees with mr_free. On failure *out is NULL and e says why (see above).
 */
int gc_tmpl_render(const gc_tmpl *t, const struct cJSON *vars, const gc_tmpl_limits *limits,
                   char **out, size_t *out_len, mr_err *e);

/*
 * The same, with the variables as JSON text (len bytes, a JSON object) read as Python's
 * json.loads reads it: "1" is an int and "1.0" a float, duplicate keys keep the first
 * place and the last value, NaN / Infinity are accepted, integers beyond 64 bits are
 * refused (MR_ERANGE). Malformed JSON is MR_EFORMAT naming the byte offset.
 */
int gc_tmpl_render_json(const gc_tmpl *t, const char *json, size_t len,
                        const gc_tmpl_limits *limits, char **out, size_t *out_len, mr_err *e);

/*
 * Finds and compiles the chat template of a Hugging Face checkpoint directory, the way
 * transformers picks it: name NULL or "default": chat_template.jinja, else
 * tokenizer_config.json's "chat_template" (a string, or a list of {"name", "template"}
 * from which "default" is taken); another name: additional_chat_templates/<name>.jinja,
 * else the list entry of that name. The template's origin is the file it came from.
 * MR_ENOTFOUND if the directory has no such template. *out as for gc_tmpl_compile.
 */
int gc_tmpl_load_dir(gc_tmpl **out, const char *dir, const char *name, mr_err *e);

#ifdef __cplusplus
}
#endif

#endif /* GC_CHAT_TEMPLATE_H */
