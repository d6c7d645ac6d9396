/*
 * mr.h - moerpc common runtime: the one public header of common/.
 *
 * Everything here is shared by the server, the client, the kernels and the tools:
 *   - one error space (MR_E* codes) and an error record that names the field and limit,
 *   - logging (mr_log), assertions (MR_ASSERT),
 *   - arenas for per-request scratch,
 *   - dtypes and conversion (bf16/f16/f32),
 *   - id sets ("0-7,12" / "all"),
 *   - safetensors reader (mmap) and writer, HF config.json reader,
 *   - cluster file (JSON) reader,
 *   - model fingerprint,
 *   - Prometheus text exposition and a /metrics HTTP responder,
 *   - the host's latency settings (cpuidle halt polling, THP, NUMA balancing) and CPU name.
 *
 * Threads: every function is safe to call from any thread on distinct objects; a reader
 * object (mr_st, mr_model_config, mr_cluster) is immutable after open and may be shared
 * read-only between threads.
 */
#ifndef MR_H
#define MR_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------------------------------
 * Errors. Functions return int: 0 ok, a negative MR_E* code on failure.
 * X(name, value, message)
 */
#define MR_ERRNO_MAP(X)                                                              \
  X(EINVAL, -1, "invalid argument")                                                  \
  X(ENOMEM, -2, "out of memory")                                                     \
  X(EIO, -3, "I/O error")                                                            \
  X(EFORMAT, -4, "malformed file or message")                                        \
  X(ERANGE, -5, "value out of range")                                                \
  X(ENOTFOUND, -6, "not found")                                                      \
  X(EPROTO, -7, "protocol error")                                                    \
  X(ETIMEDOUT, -8, "deadline exceeded")                                              \
  X(EUNAVAIL, -9, "peer unavailable")                                                \
  X(EPRECOND, -10, "failed precondition")                                            \
  X(EEXHAUSTED, -11, "resource exhausted")                                           \
  X(ECANCELED, -12, "canceled")                                                      \
  X(EMISMATCH, -13, "mismatch between peers or files")                               \
  X(ENOTSUP, -14, "not supported")                                                   \
  X(EINTERNAL, -15, "internal error")                                                \
  X(EAUTH, -16, "not authenticated")

enum mr_errno {
  MR_OK = 0,
#define MR__ERR_ENUM(name, val, msg) MR_##name = val,
  MR_ERRNO_MAP(MR__ERR_ENUM)
#undef MR__ERR_ENUM
};

/* Returns a static message for code (never NULL; "unknown error" for unknown codes). */
const char *mr_strerror(int code);
/* Returns the static symbolic name ("MR_EINVAL"), or "MR_E?" for unknown codes. */
const char *mr_err_name(int code);

/*
 * An error record: the code plus a message that names the offending field and the limit,
 * e.g. "model/config.json: num_experts = 0, must be in 1..65536".
 * Callers may pass NULL wherever an mr_err * is taken; the message is then dropped.
 */
typedef struct mr_err {
  int code;
  char msg[512];
} mr_err;

/* Sets e (if not NULL) to code and the printf-formatted message; returns code, so that
 * callers write `return mr_err_set(e, MR_EFORMAT, "...", ...);`. */
int mr_err_set(mr_err *e, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* Prepends "prefix: " to e->msg (if e is not NULL); returns e->code (or code if e is NULL). */
int mr_err_prefix(mr_err *e, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* Clears e. */
void mr_err_clear(mr_err *e);

/* ---------------------------------------------------------------------------------------
 * Logging. One line per event: "2026-11-30T06:10:00.123Z INFO  server: message".
 * mr_log checks the level before formatting anything. Output goes to stderr.
 * The level comes from mr_log_set_level() or the env MOERPC_LOG=error|warn|info|debug.
 */
enum mr_log_level { MR_LOG_ERROR = 0, MR_LOG_WARN = 1, MR_LOG_INFO = 2, MR_LOG_DEBUG = 3 };
extern int mr__log_level; /* read by the macro; set through mr_log_set_level */
void mr_log_set_level(int level);
/* Parses "error".."debug" (or 0..3); returns MR_EINVAL if unknown. */
int mr_log_parse_level(const char *s, int *level);
/* Sets the component name printed on every line ("server", "client", ...). Not thread-safe:
 * call once at start-up. */
void mr_log_set_component(const char *name);
void mr__log(int level, const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
#define mr_log(level, ...)                                                           \
  do {                                                                               \
    if ((level) <= mr__log_level) mr__log((level), __FILE__, __LINE__, __VA_ARGS__); \
  } while (0)
/* Rate-limited logging for peer input: at most `per_sec` lines per second per call site
 * (all threads together); a line that gets through after some were dropped ends in
 * " (+N similar lines suppressed)". */
#define mr_log_ratelimited(level, per_sec, ...)                                      \
  do {                                                                               \
    static struct mr_ratelimit mr__rl_;                                              \
    uint64_t mr__sup_ = 0;                                                           \
    if ((level) <= mr__log_level && mr_ratelimit_pass(&mr__rl_, (per_sec), &mr__sup_)) \
      mr__log_suppressed((level), __FILE__, __LINE__, mr__sup_, __VA_ARGS__);        \
  } while (0)
/* One call site's budget. Zero-initialised (static) is ready; the fields are guarded by
 * `lock`, a spin lock taken for a few instructions (gcc __atomic builtins, so that this
 * header needs neither <stdatomic.h> nor <pthread.h>). */
struct mr_ratelimit {
  unsigned char lock;      /* 0 free, 1 taken */
  int64_t window_start_ms; /* start of the current 1 s window */
  int count;               /* lines let through in the window */
  uint64_t suppressed;     /* lines dropped since the last one let through */
};
/* True if one more line may be logged now; then *suppressed (if not NULL) gets the number of
 * lines dropped since the previous one let through, and that count restarts at 0. Safe from
 * any number of threads at once. */
bool mr_ratelimit_pass(struct mr_ratelimit *rl, int per_sec, uint64_t *suppressed);
/* mr__log plus the " (+N similar lines suppressed)" suffix when suppressed > 0. */
void mr__log_suppressed(int level, const char *file, int line, uint64_t suppressed,
                        const char *fmt, ...) __attribute__((format(printf, 5, 6)));

/* Escapes srclen bytes of untrusted text (a peer's name, address or error message) for a log
 * line: \n \r \t and \\ as two characters, other C0 controls, DEL and every byte that is
 * not part of valid UTF-8 as \xNN; valid UTF-8 is copied as is. The result is NUL-terminated
 * and never longer than cap - 1 bytes; a text cut to fit ends in "...". Returns its length.
 * cap 0 writes nothing. */
size_t mr_log_escape(char *dst, size_t cap, const char *src, size_t srclen);
/* Room for mr_log_escape of a peer string in a log line: 256 escaped bytes at most. */
#define MR_LOG_ESC_MAX 257

/* Our own bugs abort loudly with file:line; input from outside never reaches an assert. */
#define MR_ASSERT(cond)                                                              \
  do {                                                                               \
    if (!(cond)) mr__assert_fail(#cond, __FILE__, __LINE__);                         \
  } while (0)
void mr__assert_fail(const char *expr, const char *file, int line) __attribute__((noreturn));

/* Monotonic clock in nanoseconds / microseconds. */
uint64_t mr_now_ns(void);
static inline uint64_t mr_now_us(void) { return mr_now_ns() / 1000u; }

/* ---------------------------------------------------------------------------------------
 * Allocation. All heap allocation in the project goes through these, so that tests can
 * fail the n-th allocation (mr_alloc_fail_after). They return NULL on failure.
 */
void *mr_malloc(size_t n);
void *mr_calloc(size_t n, size_t size);
void *mr_realloc(void *p, size_t n);
/* 64-byte (cache line) or larger power-of-two alignment; free with mr_free_aligned. */
void *mr_malloc_aligned(size_t n, size_t align);
void mr_free(void *p);
void mr_free_aligned(void *p);
char *mr_strdup(const char *s);
/* Fault injection: the n-th allocation from now (1-based) and every one after fail;
 * n = 0 turns injection off. For tests only; not thread-safe against concurrent setting. */
void mr_alloc_fail_after(long n);

/* ---------------------------------------------------------------------------------------
 * Arena: bump allocator for per-request scratch. Reset after each reply; grows by chaining
 * blocks when a request needs more than its capacity (growth is logged at DEBUG).
 */
typedef struct mr_arena_block mr_arena_block;
typedef struct mr_arena {
  mr_arena_block *head; /* current block (owned) */
  size_t block_size;    /* default size of new blocks, bytes */
  size_t used_peak;     /* most bytes in use since init, for metrics */
  size_t used;          /* bytes in use now */
} mr_arena;
/* Initialises a caller-owned arena; the first block (block_size bytes) is allocated lazily. */
void mr_arena_init(mr_arena *a, size_t block_size);
/* Returns align-aligned (power of two, <= 4096) memory that lives until the next reset or
 * close, or NULL if out of memory. */
void *mr_arena_alloc(mr_arena *a, size_t n, size_t align);
/* Frees everything allocated since init; keeps the largest block for reuse. */
void mr_arena_reset(mr_arena *a);
/* Right after a reset: frees the kept block if it is larger than block_size (a peak), so
 * that the next allocation starts again from a block of block_size. */
void mr_arena_shrink(mr_arena *a);
/* Releases all memory. The arena may be re-initialised afterwards. */
void mr_arena_close(mr_arena *a);

/* ---------------------------------------------------------------------------------------
 * DTypes. The numbering equals the wire enum moerpc.v1.DType.
 */
typedef enum mr_dtype {
  MR_DTYPE_UNSPECIFIED = 0,
  MR_DTYPE_F32 = 1,
  MR_DTYPE_F16 = 2,
  MR_DTYPE_BF16 = 3,
} mr_dtype;
/* Bytes per element, 0 for an unknown dtype. */
size_t mr_dtype_size(mr_dtype dt);
/* "f32" / "f16" / "bf16" / "?" */
const char *mr_dtype_name(mr_dtype dt);
/* Parses "f32|fp32|float32", "f16|fp16|float16", "bf16|bfloat16"; MR_EINVAL otherwise. */
int mr_dtype_parse(const char *s, mr_dtype *out);

static inline float mr_bf16_to_f32(uint16_t h) {
  union { uint32_t u; float f; } v;
  v.u = (uint32_t)h << 16;
  return v.f;
}
/* Round to nearest even; NaN stays NaN (quiet). */
static inline uint16_t mr_f32_to_bf16(float f) {
  union { uint32_t u; float f; } v;
  v.f = f;
  if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40u);
  uint32_t rounding = 0x7fffu + ((v.u >> 16) & 1u);
  return (uint16_t)((v.u + rounding) >> 16);
}
float mr_f16_to_f32(uint16_t h);
uint16_t mr_f32_to_f16(float f); /* round to nearest even, overflow to inf */
/* float8_e4m3fn (safetensors "F8_E4M3"; storage only, not a wire dtype): 1 sign, 4
 * exponent bits (bias 7), 3 mantissa bits; no inf; 0x7f / 0xff are NaN; largest 448. */
#define MR_F8E4M3_MAX 448.0f
/* The 256 exact code values (NaN for 0x7f, 0xff), built once, thread-safe. */
const float *mr_f8e4m3_table(void);
/* Round to nearest even, saturating to +-448 (inf too); NaN -> 0x7f (sign kept). */
uint8_t mr_f32_to_f8e4m3(float v);
/* Block quantization of rows <= 128 rows of K finite fp32 values (one 128-row band of a
 * matrix): per 128-column block scale_inv[b] = amax / 448 (1 for an all-zero block),
 * q = e4m3(w / scale_inv), so that w ~ e4m3(q) * scale_inv (DeepSeek-V3 weight_scale_inv). */
void mr_f8e4m3_quantize_rows(const float *w, uint32_t rows, uint32_t K, uint8_t *q,
                             float *scale_inv);
/* Bulk conversions of the wire dtypes (convert.c): the bits of the per-element rules
 * above for every input, eight lanes at a time where the CPU has AVX2 and F16C.
 * n elements of src (dtype dt, little-endian) to f32 at dst: */
void mr_convert_to_f32(float *dst, const void *src, mr_dtype dt, size_t n);
/* ... added into dst (dst[i] += src[i] as f32): a reply summed into a hidden state: */
void mr_convert_add_f32(float *dst, const void *src, mr_dtype dt, size_t n);
/* n f32 elements to dtype dt at dst: */
void mr_convert_from_f32(void *dst, mr_dtype dt, const float *src, size_t n);
/* "avx2" or "scalar" (MOERPC_CONVERT=scalar, or a CPU without AVX2 and F16C). */
const char *mr_convert_impl(void);

/* The finite scan (finite.c) of n elements at x (dt F32, F16 or BF16, little-endian, any
 * alignment; another dt is our bug and asserts): the index of the first element, in memory
 * order, that is NaN or +-Inf in dt, or n if every one is finite. One integer test of the
 * exponent bits per element, vectorised; denormals, -0 and the largest finite value pass.
 * Pure, any thread. Used on every hidden state and expert output the server receives or
 * sends and on every reply the client receives (docs/DESIGN.md section 5). */
size_t mr_nonfinite_find(const void *x, mr_dtype dt, size_t n);
/* "NaN", "+Inf", "-Inf" (or "finite") for element i of x (dtype dt); *bits (may be NULL)
 * gets its raw bits, for messages like "= NaN (bf16 bits 0x7fc1)". Pure. */
const char *mr_nonfinite_name(const void *x, mr_dtype dt, size_t i, uint32_t *bits);

/* ---------------------------------------------------------------------------------------
 * Id sets: "all", "", or a comma list of ids and inclusive ranges, "0-7,12,20-23".
 */
typedef struct mr_idset {
  uint32_t limit; /* ids are < limit */
  uint64_t *bits; /* (limit + 63) / 64 words, owned */
} mr_idset;
/* Parses spec into a new set of ids < limit. Errors name `what` (e.g. "--experts"), the bad
 * token and the limit. The caller frees with mr_idset_close. */
int mr_idset_parse(mr_idset *s, const char *spec, uint32_t limit, const char *what, mr_err *e);
int mr_idset_init(mr_idset *s, uint32_t limit); /* empty set */
void mr_idset_close(mr_idset *s);
static inline bool mr_idset_has(const mr_idset *s, uint32_t id) {
  return id < s->limit && (s->bits[id >> 6] >> (id & 63)) & 1u;
}
void mr_idset_add(mr_idset *s, uint32_t id); /* id must be < limit */
uint32_t mr_idset_count(const mr_idset *s);
/* Writes the canonical spec ("0-7,12") into buf; returns the length it needed (mr_idlist). */
size_t mr_idset_format(const mr_idset *s, char *buf, size_t len);

/* A writer of id lists in the same syntax, for any source of ids: ids added in increasing
 * order come out as "0-3,7,9-10" (runs of consecutive ids as ranges). It never writes past
 * buf[len - 1] and never allocates; like snprintf it keeps counting the length the whole
 * text needs. Every message that lists ids is written with it, so they all read alike:
 *
 *   mr_idlist w;
 *   mr_idlist_init(&w, buf, sizeof buf);
 *   for (uint32_t l = 0; l < n; l++) if (served[l]) mr_idlist_add(&w, l);
 *   mr_idlist_end(&w, true);
 */
typedef struct mr_idlist {
  char *buf;
  size_t len;           /* bytes at buf (0: only count) */
  size_t need;          /* bytes the text written so far needs, NUL not counted */
  uint32_t first, last; /* the run not written yet */
  bool open;            /* a run is pending */
} mr_idlist;
void mr_idlist_init(mr_idlist *w, char *buf, size_t len);
/* Adds id: one past the previous id extends the current range, anything else starts a new
 * item. */
void mr_idlist_add(mr_idlist *w, uint32_t id);
/* Adds every id of s, in increasing order. */
void mr_idlist_add_set(mr_idlist *w, const mr_idset *s);
/* Writes the pending run and returns the length the whole text needs. A text that does not
 * fit is cut after the last whole item; with ellipsis (and len > 4) it then ends in "...",
 * so that a message says it was cut. */
size_t mr_idlist_end(mr_idlist *w, bool ellipsis);

/* ---------------------------------------------------------------------------------------
 * Safetensors reader. Opens one file, a directory with model.safetensors, or a directory
 * with model.safetensors.index.json (sharded); every shard is mmap'ed read-only and its
 * header is bounds-checked (header length, JSON, dtype, shape, offsets inside the file,
 * no overlap, nbytes = prod(shape) * dtype size). Unknown dtypes are kept and reported
 * as MR_DTYPE_UNSPECIFIED with dtype_name set, so that models with e.g. I64 buffers open;
 * asking for their data as a float tensor is an error.
 */
#define MR_ST_MAX_DIMS 8
typedef struct mr_st_tensor {
  const char *name;      /* owned by the mr_st */
  mr_dtype dtype;        /* MR_DTYPE_UNSPECIFIED for other dtypes */
  const char *dtype_name;/* as written in the file, e.g. "BF16" */
  uint32_t ndim;
  uint64_t shape[MR_ST_MAX_DIMS];
  uint64_t nbytes;
  const void *data;      /* inside the mmap, valid until mr_st_close */
  const char *file;      /* path of the shard holding it */
} mr_st_tensor;
typedef struct mr_st mr_st;
/* Opens path (file or directory). On failure returns a negative code with e naming the
 * file and the field. The caller owns *out and frees it with mr_st_close. */
int mr_st_open(mr_st **out, const char *path, mr_err *e);
void mr_st_close(mr_st *st); /* NULL is a no-op */
/* Asks the kernel to start reading t's bytes from disk now (madvise WILLNEED on its pages),
 * so that a loader reads one tensor while it converts the one before; nothing where a
 * sample of its pages is already in the page cache. Never fails. */
void mr_st_prefetch(const mr_st_tensor *t);
/* Reads t's bytes into the page cache and maps them, waiting for the disk
 * (MADV_POPULATE_READ; MADV_WILLNEED where the kernel lacks it). Through a mapping advised
 * by mr_st_advise_hugepage the reads come in 2 MiB folios, which a WILLNEED readahead does
 * not give. Never fails. */
void mr_st_populate(const mr_st_tensor *t);
/* Advises huge pages (MADV_HUGEPAGE) on every file mapping of st, before its pages are
 * touched: weights read in place from the mapping (the server's --map-weights) are then
 * mapped 2 MiB at a time where the kernel and file system give large folios, as packed
 * weights are, instead of one TLB entry per 4 KiB. Advice only. */
void mr_st_advise_hugepage(const mr_st *st);
/* Returns the tensor called name, or NULL. */
const mr_st_tensor *mr_st_find(const mr_st *st, const char *name);
size_t mr_st_count(const mr_st *st);
const mr_st_tensor *mr_st_at(const mr_st *st, size_t i);
/* Finds name and checks its dtype is a float dtype and its shape equals shape[0..ndim);
 * errors name the file, tensor and both shapes. */
int mr_st_expect(const mr_st *st, const char *name, uint32_t ndim, const uint64_t *shape,
                 const mr_st_tensor **out, mr_err *e);
/* Like mr_st_expect, but the tensor's safetensors dtype must be dtype_name (e.g. "F8_E4M3",
 * which maps to no mr_dtype), or, for dtype_name NULL, a float dtype as mr_st_expect. */
int mr_st_expect_as(const mr_st *st, const char *name, const char *dtype_name, uint32_t ndim,
                    const uint64_t *shape, const mr_st_tensor **out, mr_err *e);
/* The tensor holds float8_e4m3fn codes (safetensors dtype "F8_E4M3"; mr_dtype UNSPECIFIED). */
bool mr_st_is_f8e4m3(const mr_st_tensor *t);
/* Parses one safetensors file image held in memory (len bytes); used by mr_st_open and by
 * the fuzzer. On success *out lists the tensors with data pointing into buf. */
int mr_st_parse_buffer(mr_st **out, const void *buf, size_t len, const char *label, mr_err *e);

/* Safetensors writer: collects tensors, then writes one file. Data is copied at add time. */
typedef struct mr_st_writer mr_st_writer;
int mr_st_writer_new(mr_st_writer **out);
int mr_st_writer_add(mr_st_writer *w, const char *name, mr_dtype dt, uint32_t ndim,
                     const uint64_t *shape, const void *data);
/* A tensor of float8_e4m3fn codes (dtype "F8_E4M3"), prod(shape) bytes at data. */
int mr_st_writer_add_f8e4m3(mr_st_writer *w, const char *name, uint32_t ndim,
                            const uint64_t *shape, const void *data);
/* Writes the file atomically (tmp + rename); e names the path on failure. */
int mr_st_writer_write(mr_st_writer *w, const char *path, mr_err *e);
void mr_st_writer_free(mr_st_writer *w);

/* ---------------------------------------------------------------------------------------
 * HF config.json reader (Qwen3-MoE, Mixtral, DeepSeek-V3 families).
 */
typedef enum mr_arch {
  MR_ARCH_UNKNOWN = 0,
  MR_ARCH_QWEN3_MOE,  /* Qwen3MoeForCausalLM (also Qwen2MoeForCausalLM) */
  MR_ARCH_MIXTRAL,    /* MixtralForCausalLM */
  MR_ARCH_DEEPSEEK_V3 /* DeepseekV3ForCausalLM (also DeepseekV2ForCausalLM) */
} mr_arch;
typedef enum mr_proj { MR_PROJ_GATE = 0, MR_PROJ_UP = 1, MR_PROJ_DOWN = 2 } mr_proj;
typedef enum mr_score_func { MR_SCORE_SOFTMAX = 0, MR_SCORE_SIGMOID = 1 } mr_score_func;
/* How the k experts are chosen from the scores (DeepSeek's topk_method):
 *   GREEDY    top-k of the scores (every family but DeepSeek-V3);
 *   NOAUX_TC  DeepSeek-V3: top-k of score + e_score_correction_bias among the topk_group
 *             groups of highest (sum of the top-2 biased scores); weights = the unbiased
 *             scores of the chosen. */
typedef enum mr_topk_method {
  MR_TOPK_GREEDY = 0,
  MR_TOPK_NOAUX_TC = 1,
  MR_TOPK_GROUP_LIMITED_GREEDY = 2 /* DeepSeek-V2: parsed, not run by the model runner */
} mr_topk_method;
#define MR_MAX_LAYERS 1024
typedef struct mr_model_config {
  mr_arch arch;
  char arch_name[64];          /* "Qwen3MoeForCausalLM" */
  uint32_t hidden_size;        /* H */
  uint32_t moe_intermediate;   /* I of one routed expert */
  uint32_t num_experts;        /* routed experts per MoE layer */
  uint32_t top_k;              /* num_experts_per_tok */
  uint32_t num_layers;         /* num_hidden_layers */
  uint32_t vocab_size;
  uint32_t num_heads, num_kv_heads, head_dim;
  uint32_t dense_intermediate; /* intermediate_size of dense MLP layers (0 if none) */
  bool norm_topk_prob;
  float routed_scaling_factor; /* 1.0 unless the config says otherwise */
  float rms_norm_eps;
  uint8_t is_moe[MR_MAX_LAYERS]; /* 1 if layer l has routed experts */
  /* What a whole-model runner needs besides the experts (gpu_client/model.h). */
  float rope_theta;            /* rope_theta, or rope_parameters.rope_theta (transformers 5) */
  char rope_type[32];          /* rope_scaling / rope_parameters rope_type; "default" if none */
  bool tie_word_embeddings;    /* lm_head shares embed_tokens (default false) */
  bool attention_bias;         /* q/k/v (and o) projections have biases (Qwen attention_bias) */
  bool qk_norm;                /* per-head RMSNorm of q and k before RoPE (Qwen3) */
  uint32_t sliding_window;     /* attention window in tokens, 0 = none */
  uint32_t max_position;       /* max_position_embeddings, 0 if absent */
  /* quantization_config {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme":
   * "dynamic", "weight_block_size": [128, 128]} (transformers FineGrainedFP8: DeepSeek-V3,
   * Qwen3-*-FP8): expert projections may then be F8_E4M3 with F32 (or BF16)
   * "<name>_scale_inv" block scales [ceil(N/128), ceil(K/128)]. Other quant_methods, fmts
   * and block sizes are refused by name (MR_ENOTSUP). */
  bool fp8;
  uint32_t fp8_block[2];       /* weight_block_size: [128, 128] when fp8 */
  /* DeepSeek-V3 / Kimi-K2 (MLA attention, grouped routing, shared experts); 0 elsewhere.
   * head_dim above is then qk_nope_dim + qk_rope_dim (a query head's width; transformers'
   * config calls qk_rope_head_dim "head_dim"). */
  uint32_t q_lora_rank;        /* 0 = a plain q_proj (q_lora_rank null) */
  uint32_t kv_lora_rank;       /* the latent each token caches, besides its rope part */
  uint32_t qk_nope_dim, qk_rope_dim, v_head_dim;
  uint32_t n_shared_experts;   /* one MLP of n_shared * moe_intermediate per MoE layer */
  uint32_t n_group, topk_group;/* group-limited top-k; 1, 1 when ungrouped */
  mr_score_func scoring;       /* router scores: softmax (Qwen, Mixtral, V2) or sigmoid */
  mr_topk_method topk_method;
  bool rope_interleave;        /* RoPE on (x0, x1), (x2, x3)... pairs (DeepSeek-V3) */
  /* rope_type "yarn" (rope_scaling / rope_parameters): the values as transformers 5 derives
   * them (_compute_yarn_parameters); attention_factor multiplies cos and sin, and
   * mscale_all_dim scales the softmax by yarn_get_mscale(factor, mscale_all_dim)^2. */
  float yarn_factor, yarn_beta_fast, yarn_beta_slow, yarn_mscale, yarn_mscale_all_dim;
  float yarn_attention_factor;
  uint32_t yarn_original_max_position;
  bool yarn_truncate;
} mr_model_config;
/* Reads config.json at path (a file, or a directory containing config.json). Validates
 * ranges (hidden 1..65536, experts 1..65536, top_k 1..num_experts, layers 1..MR_MAX_LAYERS)
 * and names the field and the limit on error. */
int mr_config_load(mr_model_config *cfg, const char *path, mr_err *e);
/* Same, from a JSON text of len bytes; label names it in errors. Used by the fuzzer. */
int mr_config_parse(mr_model_config *cfg, const char *json, size_t len, const char *label,
                    mr_err *e);
static inline bool mr_config_is_moe_layer(const mr_model_config *c, uint32_t l) {
  return l < c->num_layers && c->is_moe[l];
}
uint32_t mr_config_num_moe_layers(const mr_model_config *c);
/* Writes the checkpoint key of one routed expert's projection for cfg's architecture into
 * buf, e.g. "model.layers.3.mlp.experts.17.gate_proj.weight"; returns snprintf's result. */
int mr_config_expert_key(const mr_model_config *c, uint32_t layer, uint32_t expert, mr_proj p,
                         char *buf, size_t len);
/* Finds the three projections of routed expert `expert` of layer `layer` in st, under the
 * checkpoint names of c's architecture, and checks them against the shapes c implies:
 * gate and up [moe_intermediate, hidden], down [hidden, moe_intermediate] (HF nn.Linear),
 * a float dtype, one dtype for all three. out[MR_PROJ_GATE..MR_PROJ_DOWN] point into st.
 * The one place where the server, the client and the tests find an expert's weights.
 * Errors: those of mr_st_expect (naming the file, the tensor and both shapes), prefixed
 * with "layer L expert X gate|up|down"; MR_EFORMAT when the three dtypes differ. */
int mr_config_expert_tensors(const mr_model_config *c, const mr_st *st, uint32_t layer,
                             uint32_t expert, const mr_st_tensor *out[3], mr_err *e);
/* The same, and for FP8 checkpoints (c->fp8) also the F8_E4M3 projections' block scales:
 * scales[p] = "<key of p>_scale_inv" (F32 or BF16, shape [ceil(N/128), ceil(K/128)] of the
 * projection's [N, K]), or NULL for a float projection. All three projections must then be
 * F8_E4M3 or all float. Errors name the tensor and the expected shape; an F8_E4M3
 * projection in a config without fp8 quantization_config is MR_EFORMAT. The values of the
 * scales are checked at load (kn_fp8_check_scales). */
int mr_config_expert_tensors_q(const mr_model_config *c, const mr_st *st, uint32_t layer,
                               uint32_t expert, const mr_st_tensor *out[3],
                               const mr_st_tensor *scales[3], mr_err *e);

/* Fingerprint of a model: 16 hex chars over config.json and every shard's header and a
 * sample of its data, identical on every server that opens the same files. */
int mr_model_fingerprint(const char *model_dir, const mr_st *st, char out[17], mr_err *e);

/* ---------------------------------------------------------------------------------------
 * Cluster file (JSON):
 * {
 *   "model": "/path/to/model",            optional: the client loads local experts from it
 *   "deadline_ms": 5000,                  optional: per-request deadline, ms
 *   "failover_ms": 1000,                  optional: a replica's reply later than this moves
 *                                         its work to another replica (gc_options.failover_ms)
 *   "servers": [ {"name": "s0", "address": "127.0.0.1:50051"}, ... ],
 *   "local": {"layers": "all", "experts": "0-3"}   optional: experts the client computes
 *   "tls": {"ca": "ca.pem", "cert": "client.pem", "key": "client.key",
 *           "server_name": "experts.example"}     optional: TLS for every channel; each key
 *                                                 optional, cert and key together
 *   "token_file": "token"                         optional: bearer token sent on every call
 * }
 * Each server may also carry planning keys (read by moerpc-place, ignored by the client):
 *   "expert_memory": 68719476736 or "64G"  bytes for expert weights (1..2^50)
 *   "numa_nodes": 2                         NUMA nodes its engine splits experts over (1..64)
 *   "speed": 1.5                            relative kernel throughput (> 0, <= 1e6; default 1)
 * Paths are used as written (relative ones from the client's working directory); the files
 * are read when the cluster is opened.
 */
#define MR_CLUSTER_MAX_SERVERS 256
/* deadline_ms when the file has none, and the largest one accepted (also for the
 * client's own deadline options): 5 s and 10 minutes. */
#define MR_CLUSTER_DEFAULT_DEADLINE_MS 5000u
#define MR_CLUSTER_MAX_DEADLINE_MS 600000u
/* Bounds of the planning keys of a server (moerpc-place plan / simulate; the client
 * ignores them). */
#define MR_CLUSTER_MAX_EXPERT_MEMORY (1ull << 50) /* 1 PiB */
#define MR_CLUSTER_MAX_NUMA_NODES 64u
#define MR_CLUSTER_MAX_SPEED 1e6
typedef struct mr_cluster_server {
  char name[64];
  char address[256]; /* host:port, passed to gRPC as "ipv4:" / "ipv6:" / dns target */
  /* Planning keys, all optional: */
  uint64_t expert_memory; /* "expert_memory": bytes for expert weights; 0 = not given
                             (unbounded). A number or "64G" (mr_size_parse) */
  uint32_t numa_nodes;    /* "numa_nodes": 1..MR_CLUSTER_MAX_NUMA_NODES; 0 = not given (1) */
  double speed;           /* "speed": relative kernel throughput, > 0; 1.0 when absent */
} mr_cluster_server;
/* Parses a byte count: decimal digits with an optional binary suffix K, M, G, T or P
 * (x 1024^n; upper or lower case, optionally followed by "B" or "iB": "64G", "512MiB",
 * "1024"). Values above MR_CLUSTER_MAX_EXPERT_MEMORY, empty strings, fractions and
 * anything else are refused with "<what> = \"<s>\", <the rule>" (MR_EINVAL / MR_ERANGE). */
int mr_size_parse(const char *s, const char *what, uint64_t *out, mr_err *e);
typedef struct mr_cluster_file {
  char model[1024];        /* "" if absent */
  uint32_t deadline_ms;
  uint32_t failover_ms;    /* 0 if absent: the client's default */
  uint32_t n_servers;
  mr_cluster_server servers[MR_CLUSTER_MAX_SERVERS];
  char local_layers[256];  /* id-set spec, "" if no local experts */
  char local_experts[1024];
  bool tls;                /* a "tls" object was given (even an empty one: system roots) */
  char tls_ca[1024];       /* PEM roots to trust, "" = gRPC's default roots */
  char tls_cert[1024];     /* PEM client certificate chain (mTLS), "" = none */
  char tls_key[1024];      /* its PEM private key, set exactly when tls_cert is */
  char tls_server_name[256]; /* name the server's certificate must carry, "" = the host */
  char token_file[1024];   /* bearer token file, "" = no token */
} mr_cluster_file;
/* Reads and validates a cluster file (servers 1..MR_CLUSTER_MAX_SERVERS, unique names and
 * addresses, deadline 1..MR_CLUSTER_MAX_DEADLINE_MS). */
int mr_cluster_load(mr_cluster_file *c, const char *path, mr_err *e);
int mr_cluster_parse(mr_cluster_file *c, const char *json, size_t len, const char *label,
                     mr_err *e);

/* ---------------------------------------------------------------------------------------
 * Placement file (JSON): which experts the client computes itself ("local", the hot set)
 * and, optionally, which server computes each cold expert. Written by hand or by
 * moerpc-place; read by the model runner (gpu_client/model.h).
 * {
 *   "format": "moerpc-placement", "version": 1,
 *   "model_fingerprint": "0123456789abcdef",   optional: checked against the servers
 *   "num_layers": 48, "num_experts": 128,
 *   "layers": [
 *     {"layer": 0, "local": "0-3,17",             id set (see mr_idset_parse), optional
 *      "remote": {"s0": "4-63", "s1": "64-127"}}, optional: server name -> id set
 *     ...
 *   ]
 * }
 * Layers not listed have no local expert and default routing (the first server of the
 * cluster file that announces the pair). A pair is either local or remote, not both. A pair
 * listed under several servers of one layer's "remote" has replicas (one copy on each):
 * its route is -1, so that the client's default rule applies (the least-loaded live
 * replica among the servers announcing it); with one server, route names it. Files
 * without replicas read exactly as before (version 1 either way).
 */
#define MR_PLACEMENT_MAX_SERVERS MR_CLUSTER_MAX_SERVERS
/* Most (pair, server) entries of all "remote" sets together (refused beyond, MR_ERANGE). */
#define MR_PLACEMENT_MAX_COPIES (1u << 23)
typedef struct mr_placement {
  uint32_t num_layers, num_experts;
  char model_fingerprint[64];  /* "" when absent */
  uint8_t *local;              /* [L * E] 1 = the client computes it (owned) */
  int32_t *route;              /* [L * E] the one server (index into server[]) holding the
                                  pair, or -1: not remote, or replicated (copies > 1) (owned) */
  uint16_t *copies;            /* [L * E] servers listing the pair (0 = local / not listed) */
  uint32_t *rep_off;           /* [L * E + 1] pair i's servers are rep[rep_off[i] ..
                                  rep_off[i + 1]), in file order (owned) */
  int32_t *rep;                /* [n_copies] indices into server[] (owned) */
  uint64_t n_copies;           /* (pair, server) entries = sum of copies */
  uint64_t n_single;           /* pairs on exactly one server */
  uint64_t n_replicated;       /* pairs on two or more servers */
  uint32_t n_servers;          /* distinct server names used in "remote" */
  char (*server)[64];          /* [n_servers] names, in order of first use (owned) */
  uint64_t n_local;            /* pairs marked local */
} mr_placement;
/* Reads and validates a placement file; errors name the file, the field and the limit.
 * The caller releases p with mr_placement_close (also after a failure). */
int mr_placement_load(mr_placement *p, const char *path, mr_err *e);
int mr_placement_parse(mr_placement *p, const char *json, size_t len, const char *label,
                       mr_err *e);
void mr_placement_close(mr_placement *p);

/* Reads a whole file into a NUL-terminated heap buffer (caller frees with mr_free);
 * refuses files over max_bytes, and anything but a regular file (mr_file_open_regular). */
int mr_file_read(const char *path, size_t max_bytes, char **out, size_t *len, mr_err *e);
/* mr_file_read, then parse(ctx, text, len, path, e) on its text, which is freed after. */
typedef int (*mr_file_parse_fn)(void *ctx, const char *text, size_t len, const char *path, mr_err *e);
int mr_file_parse(const char *path, size_t max_bytes, mr_file_parse_fn parse, void *ctx, mr_err *e);
/* mr_file_read for a secret (a bearer token, an API key, a TLS private key): also refuses,
 * from the open descriptor's mode, a file that others may access in any way, or that its
 * group may access, unless root owns it and the group may only read it (root:ssl-cert 0640,
 * a Kubernetes secret volume with fsGroup): MR_EINVAL,
 * "PATH: mode 0644, must not be readable by group or others (chmod 600)". */
int mr_file_read_private(const char *path, size_t max_bytes, char **out, size_t *len,
                         mr_err *e);
/* Opens path read-only for a reader of a user-named file: a FIFO, device, socket or
 * directory is refused before it can block ("PATH: not a regular file (a FIFO)", MR_EINVAL):
 * the open is non-blocking, fstat decides, and only a regular file's descriptor is switched
 * back to blocking and returned in *fd (the caller closes it), with its size in *size (may be
 * NULL). A missing file is MR_ENOTFOUND, other failures MR_EIO, each naming the path. */
int mr_file_open_regular(const char *path, int *fd, uint64_t *size, mr_err *e);
/* Writes len bytes of data as the whole content of path, so that a reader never sees half a
 * file: a new name or a regular file is replaced atomically (path.tmp.PID, fsync, rename);
 * an existing device, FIFO or symlink ("-o /dev/null", a pipe, a link into a config dir) is
 * written in place instead, since renaming over it would replace the device or the link.
 * Errors (MR_EIO, MR_ERANGE for a path too long) name the path; a failed attempt leaves no
 * temporary file behind. */
int mr_file_write_atomic(const char *path, const void *data, size_t len, mr_err *e);

/* ---------------------------------------------------------------------------------------
 * Secrets (bearer tokens) come from files only, never from argv or logs.
 */
#define MR_SECRET_MAX_BYTES 4096
/* Reads the token in path into buf (cap >= MR_SECRET_MAX_BYTES + 1, NUL-terminated) and its
 * length into *len: one trailing "\n" (or "\r\n") is trimmed; an empty token, one over
 * MR_SECRET_MAX_BYTES bytes, or one with a byte outside printable ASCII 0x21..0x7e is refused
 * (MR_EINVAL / MR_ERANGE), as is a file that is not a regular file or that group or others
 * may read (mr_file_read_private). Errors start with
 * "<what> <path>: " (what names the flag or field, e.g. "--auth-token-file") and never
 * quote the file's contents. On failure buf is zeroed. */
int mr_secret_read(const char *path, const char *what, char *buf, size_t cap, size_t *len,
                   mr_err *e);
/* Compares two secrets of up to MR_SECRET_MAX_BYTES + 16 bytes in time that depends only on
 * that bound (a fixed loop over it, no early exit), so that a peer cannot learn how much of a
 * guess was right. Longer inputs are never equal. */
bool mr_secret_equal(const char *a, size_t alen, const char *b, size_t blen);
/* Overwrites n bytes at p with zeros in a way the compiler does not drop. */
void mr_secret_wipe(void *p, size_t n);

/* ---------------------------------------------------------------------------------------
 * JSON field readers for the file formats of the modules above common (placement/'s stats
 * and plan files), worded like common's own readers: "<label>: <field> = <value>, <what was
 * expected>". cJSON values; the caller includes <cjson/cJSON.h>.
 */
struct cJSON;
/* An integer-valued number in lo..hi (no fraction, at most 2^53), else MR_EFORMAT/MR_ERANGE. */
int mr_json_u64(const struct cJSON *item, const char *label, const char *field, uint64_t lo,
                uint64_t hi, uint64_t *out, mr_err *e);
/* Every key of object obj is in allowed[] (NULL-terminated) and appears once; `where` names
 * the object ("top level", "window"). */
int mr_json_check_keys(const struct cJSON *obj, const char *const *allowed, const char *label,
                       const char *where, mr_err *e);
/* Largest JSON document read or parsed (config.json, index.json, cluster and placement
 * files, stats): a DeepSeek-V3 model.safetensors.index.json is ~9 MiB; 256 MiB is far
 * above any real file and still bounds what a hostile path can make us allocate. */
#define MR_JSON_MAX_BYTES ((size_t)256 << 20)
/* Parses len bytes (at most MR_JSON_MAX_BYTES; only whitespace may follow) into an object;
 * the caller deletes *out with cJSON_Delete. Thread-safe. */
int mr_json_parse_object(const char *text, size_t len, const char *label, struct cJSON **out,
                         mr_err *e);
/* Short text of a value for messages ("\"abc\"", "12.5", "an object"). */
void mr_json_describe(const struct cJSON *item, char *buf, size_t len);

/* ---------------------------------------------------------------------------------------
 * The subcommand front door of moerpc-client and moerpc-place (cli.c): names the log
 * component, ignores SIGPIPE, answers `--help` / `-h` / `help` on stdout (exit 0), an
 * unknown or missing command with the usage on stderr (exit 2), and otherwise returns what
 * the command's run returns (argv from the command's name on).
 */
typedef struct mr_cli_command {
  const char *name;
  int (*run)(int argc, char **argv);
  const char *summary; /* one line in --help */
} mr_cli_command;
typedef struct mr_cli_program {
  const char *name;      /* "moerpc-client" */
  const char *component; /* the log component ("client") */
  const char *synopsis;  /* after "usage: NAME COMMAND [options]", in parentheses */
  const char *about;     /* a paragraph before the command list */
  const char *footer;    /* NULL, or a sentence after the exit codes */
  const mr_cli_command *commands;
  size_t n_commands;
} mr_cli_program;
int mr_cli_main(const mr_cli_program *p, int argc, char **argv);

/* ---------------------------------------------------------------------------------------
 * A growable, NUL-terminated text buffer (buf.c). Out of memory is sticky (oom) and the
 * text is then incomplete: the writer checks oom once at the end (callers answer 500 or
 * fail with MR_ENOMEM). One thread per mr_buf.
 */
typedef struct mr_buf {
  char *buf; /* NUL-terminated text, owned; NULL until the first append */
  size_t len, cap;
  bool oom;
} mr_buf;
void mr_buf_init(mr_buf *p);
void mr_buf_close(mr_buf *p);
/* Empties the text, keeps the memory. */
void mr_buf_reset(mr_buf *p);
/* Appends raw bytes / printf text. */
void mr_buf_append(mr_buf *p, const char *s, size_t n);
void mr_buf_printf(mr_buf *p, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* s as a JSON string: quote, backslash and control bytes escaped, other bytes as they are
 * (UTF-8 passes through; what our JSON readers accept, so a document round-trips). */
void mr_buf_json_str(mr_buf *p, const char *s);

/* ---------------------------------------------------------------------------------------
 * Prometheus text exposition, format 0.0.4 (metrics.c), written into an mr_buf: one writer
 * per sample kind; the server's and the client's /metrics both use it.
 *
 *   mr_buf p; mr_buf_init(&p);
 *   mr_prom_family(&p, "moerpc_requests_total", MR_PROM_COUNTER, "ForwardRequests received");
 *   mr_prom_u64(&p, "moerpc_requests_total", NULL, n);
 *   const char *lab[] = {"status", "INVALID_ARGUMENT", NULL};
 *   mr_prom_u64(&p, "moerpc_errors_total", lab, k);   ... p.buf, p.len ... mr_buf_close(&p);
 *
 * Names are ours, but are still made valid: a metric name keeps [a-zA-Z0-9_:] (others become
 * '_', a leading digit gets a '_' before it), a label name [a-zA-Z0-9_]; label values escape
 * backslash, double quote and newline, HELP text backslash and newline (the spec's rules).
 */
typedef enum mr_prom_type { MR_PROM_COUNTER, MR_PROM_GAUGE, MR_PROM_HISTOGRAM } mr_prom_type;
/* "# HELP name help" and "# TYPE name type"; once per family, before its samples. */
void mr_prom_family(mr_buf *p, const char *name, mr_prom_type t, const char *help);
/* One sample "name{l1="v1",...} value". labels: NULL, or name/value pairs ending in NULL.
 * Doubles are written in their shortest round-trip form, +Inf, -Inf, NaN as the spec says. */
void mr_prom_double(mr_buf *p, const char *name, const char *const *labels, double v);
void mr_prom_u64(mr_buf *p, const char *name, const char *const *labels, uint64_t v);

/* A histogram updated lock-free from any thread: fixed upper bounds in integer units
 * (nanoseconds, bytes), one relaxed atomic add per observation into its bucket and one
 * into the sum. Not cumulative inside; mr_prom_hist makes the buckets cumulative from one
 * read of each, so a scrape always shows non-decreasing buckets with _count equal to the
 * +Inf bucket (the sum may run a few observations ahead or behind). No allocation. */
#define MR_HIST_MAX_BUCKETS 24
typedef struct mr_hist {
  uint32_t n;                             /* finite bounds */
  double scale;                           /* exposition unit per integer unit, 1e-9 for ns */
  uint64_t bounds[MR_HIST_MAX_BUCKETS];   /* ascending upper bounds, integer units */
  uint64_t counts[MR_HIST_MAX_BUCKETS + 1]; /* per bucket, [n] = above the last bound
                                           * (__atomic builtins only) */
  uint64_t sum;                           /* integer units (__atomic builtins only) */
} mr_hist;
/* n ascending bounds (1..MR_HIST_MAX_BUCKETS; MR_ASSERT otherwise: our tables). */
void mr_hist_init(mr_hist *h, const uint64_t *bounds, uint32_t n, double scale);
/* Latency in nanoseconds exposed in seconds, buckets 50 us .. 1 s (1-2.5-5 steps). */
void mr_hist_init_latency(mr_hist *h);
/* Records v (integer units). Any thread, lock-free. */
void mr_hist_observe(mr_hist *h, uint64_t v);
/* Writes name_bucket{labels...,le="..."} for every bound and +Inf, name_sum, name_count
 * (after the caller's mr_prom_family(name, MR_PROM_HISTOGRAM, ...)). */
void mr_prom_hist(mr_buf *p, const char *name, const char *const *labels, const mr_hist *h);

/* ---------------------------------------------------------------------------------------
 * The host (host.c): the kernel settings that change what a wake-up, a weight read or a
 * page costs moerpc, read from sysfs and procfs, and one advice line for each that costs
 * it (docs/deploy.md, "Host tuning"). Nothing here changes a setting: the operator owns
 * the host. Also the CPU's model name, which every benchmark record carries.
 */
/* The haltpoll governor's poll limit below which idle vCPUs halt too soon for moerpc's
 * round trips (the upstream default, 200 us). */
#define MR_HOST_HALT_POLL_NS 200000
#define MR_HOST_ADVICE_MAX 3 /* advice lines mr_host_advice can write */
#define MR_HOST_LINE 512     /* bytes per advice line, with its NUL */
typedef struct mr_host {
  char cpu[128];            /* /proc/cpuinfo "model name", "unknown" if absent */
  char idle_driver[32];     /* cpuidle driver ("haltpoll", "intel_idle", ...), "" unknown */
  char idle_governor[32];   /* cpuidle governor ("haltpoll", "menu", ...), "" unknown */
  int64_t halt_poll_ns;     /* /sys/module/haltpoll/parameters/guest_halt_poll_ns, -1 absent */
  char thp[16];             /* transparent huge pages: "always", "madvise", "never", "" */
  int numa_balancing;       /* /proc/sys/kernel/numa_balancing (0, 1, 2, 3), -1 unknown */
  uint32_t numa_nodes;      /* online NUMA nodes, 0 unknown */
} mr_host;
/* Reads the host's settings under root (NULL or "" = "/"; tests give a directory holding
 * sys/... and proc/... files). A file that is absent or unreadable leaves its field unknown;
 * never fails. */
void mr_host_read(mr_host *h, const char *root);
/* Writes one line into lines[i] for each setting of h that costs moerpc (a haltpoll guest
 * that halts before polling, transparent huge pages off, NUMA balancing on a multi-node
 * host) and returns how many (0..MR_HOST_ADVICE_MAX). Each line names the file, its value,
 * what it costs and what to write instead. Pure. */
uint32_t mr_host_advice(const mr_host *h, char lines[][MR_HOST_LINE]);
/* Appends one summary line ("host: cpu ...; cpuidle ...: nothing to change", or "...: to
 * change:") and then each advice line, each ending in a newline; returns the number of
 * advice lines. For `moerpc-server --check-host` and `moerpc-client check-host`. */
uint32_t mr_host_report(mr_buf *out, const mr_host *h);
/* mr_host_read under root (NULL: this host), then mr_host_report into out; *n_advice gets
 * the number of advice lines. MR_EINVAL ("ROOT: not a directory") when root is not a
 * directory, MR_ENOMEM when out ran out of memory. The two commands' whole work. */
int mr_host_report_at(mr_buf *out, const char *root, uint32_t *n_advice, mr_err *e);
/* The Prometheus families of the host, read at each call (a scrape sees a host tuned or
 * re-tuned since start): moerpc_host_advice (gauge: the settings mr_host_advice names) and
 * moerpc_host_info{cpuidle_governor, guest_halt_poll_ns, thp, numa_balancing} 1. For the
 * server's and the client's /metrics; a few small sysfs reads, safe on any thread. */
void mr_host_render(mr_buf *p);
/* This host's advice lines logged as WARN ("host: ..."), once per process: the first call
 * reads and logs, later ones return at once. */
void mr_host_check(void);
/* The CPU's model name from /proc/cpuinfo ("unknown" when absent), without quotes or
 * backslashes (it goes into JSON records as it is). */
void mr_host_cpu_model(char *buf, size_t len);

/*
 * The HTTP server (common/http_server.c, on libmicrohttpd): one epoll thread serves every
 * connection, with an idle timeout per connection (an idle or slowloris connection costs a
 * socket, never a thread, and never delays another request), HTTP/1.1 keep-alive and
 * chunked bodies, a body limit (413), a connection limit, and an optional bearer token
 * (401). Routes are either renders (GET/HEAD: the body rendered on the server's thread,
 * which must read only what is safe there: atomics, or state under its own lock) or
 * handlers (any method) that get the request as an mr_http_call and answer it at once or
 * later, from any thread, in one piece or as a stream (server-sent events).
 */
#define MR_HTTP_MAX_HEAD 8192u

typedef struct mr_http_server mr_http_server;
typedef struct mr_http_call mr_http_call;
/* Writes the body of a 200 answer into out (empty on entry). Runs on the server's thread. */
typedef void (*mr_http_render_fn)(void *ud, mr_buf *out);
/* A handler route: runs on the server's thread with the whole request (head and body).
 * It must make exactly one terminal call on c, now or later from any thread:
 * mr_http_reply, or mr_http_stream_begin + writes + mr_http_stream_end. It must not block. */
typedef void (*mr_http_handler_fn)(void *ud, mr_http_call *c);
/* Liveness (ready false) or readiness (ready true) of the process, for /healthz and /readyz.
 * Runs on the server's thread; reads atomics only. */
typedef bool (*mr_http_probe_fn)(void *ud, bool ready);

typedef struct mr_http_opts {
  const char *listen;         /* "HOST:PORT", "[V6]:PORT"; port 0 = any free port */
  const char *flag;           /* names the option in messages ("--metrics-listen") */
  uint32_t max_conns;         /* connections at once, 0 = 4096 (more wait in the backlog) */
  uint32_t idle_timeout_s;    /* a connection silent this long is closed, 0 = 10 */
  size_t max_body;            /* request body limit (413 past it), 0 = 1 MiB */
  size_t max_stream_buffer;   /* streamed bytes the peer has not taken yet, past which
                                 mr_http_stream_write refuses (MR_EEXHAUSTED); 0 = 8 MiB */
  bool json_errors;           /* the server's own 4xx/5xx answers as OpenAI's JSON error
                                 object {"error": {"message", "type", "param", "code"}} */
  const char *token;          /* bearer token required on auth routes (copied), NULL = none */
  bool token_on_renders;      /* render routes (metrics, ...) need the token too */
  const char *auth_body;      /* the body of a 401 (copied; NULL = a text line) */
  const char *auth_ctype;     /* its Content-Type (default application/json) */
  void *probe_ud;             /* the probes' ud */
} mr_http_opts;
/* Binds and starts serving (no route yet: 404). Errors: MR_EINVAL for an address that is
 * not HOST:PORT or does not resolve, MR_EUNAVAIL when it cannot be bound. Raises the
 * process's soft limit on open files to its hard limit. The caller owns *out. */
int mr_http_server_start(mr_http_server **out, const mr_http_opts *o, mr_err *e);
/* mr_http_server_start with the defaults and one render route (path, Prometheus text). */
int mr_http_server_new(mr_http_server **out, const char *listen, const char *flag,
                       const char *path, mr_http_render_fn render, void *ud, mr_err *e);
/* The bound port. */
int mr_http_server_port(const mr_http_server *h);
/* Also answers GET /healthz (probe(probe_ud, false)) and /readyz (probe(probe_ud, true))
 * with 200 "ok" or 503, for kubelet and load balancers that cannot speak gRPC health over
 * TLS; never behind the token. Any thread, any time. */
void mr_http_server_probes(mr_http_server *h, mr_http_probe_fn probe);
/* Writes name{code="200"} N ... for every answer this server queued, by HTTP status (200,
 * 400, 401, 404, 405, 408, 413, 429, 500, 503, other), after the caller's
 * mr_prom_family(name, MR_PROM_COUNTER, ...). Any thread. */
void mr_http_server_render_answers(mr_http_server *h, mr_buf *p, const char *name);
/* Stops serving: answers the app has finished go out first (at most 2 s, for peers that
 * read them); calls still open are answered 503 or their stream ends with an error, then
 * the connections close (their on_close runs). Calls the app still holds stay valid until
 * its terminal call. NULL is a no-op. */
void mr_http_server_free(mr_http_server *h);

/* A GET render route, with its Content-Type (NULL = the Prometheus text type; kept, not
 * copied: a string literal). At most 32 routes; a route already served is MR_EINVAL. Any
 * thread, before or after traffic starts. */
int mr_http_server_route(mr_http_server *h, const char *path, const char *content_type,
                         mr_http_render_fn render, void *ud, mr_err *e);
/* A handler route for method and path; auth: the bearer token is required (401 without). */
int mr_http_server_handle(mr_http_server *h, const char *method, const char *path, bool auth,
                          mr_http_handler_fn handle, void *ud, mr_err *e);

/* The request of a call (valid until its terminal call; the body is NUL-terminated). */
const char *mr_http_call_method(const mr_http_call *c);
const char *mr_http_call_path(const mr_http_call *c);
const char *mr_http_call_body(const mr_http_call *c, size_t *len);
/* A request header (case-insensitive name), NULL if absent. Only inside the handler. */
const char *mr_http_call_header(mr_http_call *c, const char *name);
/* fn(ud) runs once if the call ends on the wire before the app's terminal call (the peer
 * went away, timed out, or the server stopped): the app should stop the work behind it and
 * still make its terminal call. Once the terminal call has returned, fn never runs (so ud
 * need live only until then). fn runs on the server's thread with the call's lock held (or
 * at once, on the caller's, if the call is over already): it must not call mr_http_* on c
 * nor take a lock the app holds while calling them. */
void mr_http_call_on_close(mr_http_call *c, void (*fn)(void *ud), void *ud);
/* Terminal: answers status with body[0..len) (copied) and its Content-Type; headers: NULL
 * or name, value, ..., NULL. Any thread. */
void mr_http_reply(mr_http_call *c, int status, const char *content_type, const char *body, size_t len,
                   const char *const *headers);
/* A streamed answer (chunked, Cache-Control: no-cache): the head now, the body as written.
 * Any thread. MR_ENOMEM. */
int mr_http_stream_begin(mr_http_call *c, int status, const char *content_type, const char *const *headers);
/* Appends n bytes to the stream (copied; sent as the peer takes them). MR_EUNAVAIL once the
 * peer is gone (the app should end the work behind it), MR_EEXHAUSTED when the peer has
 * left more than max_stream_buffer bytes unread (end it too), MR_ENOMEM. Any thread. */
int mr_http_stream_write(mr_http_call *c, const char *data, size_t n);
/* Terminal: ends the stream after what was written. Any thread. */
void mr_http_stream_end(mr_http_call *c);
/* True when the peer has gone: the call ended on the wire, or the socket of a call that
 * waits for its answer (suspended) was closed by the peer. Any thread; one poll(2). */
bool mr_http_call_peer_gone(mr_http_call *c);

/* A one-shot HTTP/1.0 GET client for our own endpoints (moerpc-place reads a client's
 * /routing): url is "http://HOST:PORT/PATH" (or "HOST:PORT/PATH"; PATH defaults to
 * default_path). Connects, sends, reads the answer within timeout_ms in all; an answer over
 * max_body bytes of body is MR_EEXHAUSTED. On success *status is the HTTP status and *body
 * a NUL-terminated copy of the body (caller frees with mr_free), *len its length. Errors
 * (MR_EINVAL bad url, MR_EUNAVAIL cannot connect, MR_ETIMEDOUT, MR_EPROTO a malformed
 * answer) name the url. */
int mr_http_get(const char *url, const char *default_path, size_t max_body, int timeout_ms,
                int *status, char **body, size_t *len, mr_err *e);
/* The pure part of mr_http_get (network input; fuzzed by tests/fuzz/fuzz_http_answer.c):
 * checks that buf[0..len) starts with an HTTP/1.0 or 1.1 status line and has a whole head
 * (ending in an empty CRLF line within MR_HTTP_MAX_HEAD bytes) and at most max_body bytes
 * after it; sets *status (100..599) and *body_off (the body's first byte). MR_EPROTO or
 * MR_EEXHAUSTED with the reason otherwise. Headers are not interpreted (our answers end
 * with the connection). */
int mr_http_parse_answer(const char *buf, size_t len, size_t max_body, int *status,
                         size_t *body_off, mr_err *e);

#ifdef __cplusplus
}
#endif
#endif /* MR_H */
