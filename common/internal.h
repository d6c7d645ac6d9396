/*
 * common/internal.h - internals shared between the files of common/ and its tools.
 *
 * Nothing here is part of the public contract (mr.h). Other folders must not include it;
 * the one exception is common/tools/, which is part of common.
 */
#ifndef MR_INTERNAL_H
#define MR_INTERNAL_H

#include "common/mr.h"

#include <cjson/cJSON.h>

/* Largest header a safetensors file may declare (bytes). DeepSeek-V3's biggest shard header
 * is about 300 KiB; the HF reference implementation refuses headers over 100 MB. */
#define MR__ST_MAX_HEADER ((uint64_t)100 << 20)

/* Reads the JSON file at path (at most MR_JSON_MAX_BYTES, mr.h) and parses it with
 * parse(obj, text, len, path, e), the mr_*_parse signature every file reader here shares
 * (mr_config_load, mr_cluster_load, mr_placement_load). Evaluates to parse's result, or
 * the read's error (naming the path). A statement expression: parse keeps its own type. */
#define MR__PARSE_FILE(path, parse, obj, e)                                         \
  ({                                                                                \
    char *mr_t_ = NULL;                                                             \
    size_t mr_n_ = 0;                                                               \
    int mr_rc_ = mr_file_read((path), MR_JSON_MAX_BYTES, &mr_t_, &mr_n_, (e));      \
    if (mr_rc_ == 0) mr_rc_ = parse((obj), mr_t_, mr_n_, (path), (e));              \
    mr_free(mr_t_);                                                                 \
    mr_rc_;                                                                         \
  })

/* One shard of an mr_st as the fingerprint needs it: the header bytes and the data region. */
typedef struct mr__st_shard_view {
  const char *path;        /* as opened; owned by the mr_st */
  const char *base;        /* basename of path, points into path */
  const uint8_t *header;   /* the JSON header (header_len bytes), inside the mapping */
  uint64_t header_len;
  const uint8_t *data;     /* start of the data region, inside the mapping */
  uint64_t data_len;
  uint64_t file_size;
} mr__st_shard_view;

/* Number of shards of st (1 for a single file or a parsed buffer). */
size_t mr__st_shard_count(const mr_st *st);
/* Fills *v for shard i (< mr__st_shard_count). Shards are kept sorted by basename. */
void mr__st_shard_get(const mr_st *st, size_t i, mr__st_shard_view *v);

/*
 * Streaming writes for tensors too big to hold in memory (moerpc-mkmodel). A lazy tensor
 * is declared with its name, dtype and shape but no data; mr__st_writer_write_fill then
 * asks fill() for its bytes in order, in pieces of at most MR__ST_FILL_CHUNK bytes that
 * always hold whole elements, and writes them straight to the file. So memory stays
 * bounded by one chunk whatever the size of the file.
 *
 * fill(ctx, index, offset, n, dst) must write n bytes of tensor `index` (the 0-based order
 * of mr_st_writer_add / mr__st_writer_add_lazy calls) starting at byte `offset` into dst,
 * and return 0 or a negative MR_E* code that aborts the write (the partial temp file is
 * removed). Pieces of one tensor come in increasing offset order, but tensors may come in
 * any order (the file is laid out in the HF order: alignment, then name).
 */
#define MR__ST_FILL_CHUNK ((size_t)4 << 20)
typedef int (*mr__st_fill_fn)(void *ctx, size_t index, uint64_t offset, size_t n, void *dst);
int mr__st_writer_add_lazy(mr_st_writer *w, const char *name, mr_dtype dt, uint32_t ndim,
                           const uint64_t *shape);
/* The same for a tensor of float8_e4m3fn codes (dtype "F8_E4M3", 1 byte per element). */
int mr__st_writer_add_lazy_f8e4m3(mr_st_writer *w, const char *name, uint32_t ndim,
                                  const uint64_t *shape);
int mr__st_writer_write_fill(mr_st_writer *w, const char *path, mr__st_fill_fn fill, void *ctx,
                             mr_err *e);
/* Total bytes the file would have if written now (header + data). */
uint64_t mr__st_writer_file_size(const mr_st_writer *w);
/* Number of tensors added so far. */
size_t mr__st_writer_count(const mr_st_writer *w);

/*
 * JSON helpers (cJSON). Each one validates one field of object `obj` and on error fills e
 * with "<label>: <field> = <value>, <what was expected>". `field` is the name printed; it
 * may be a path like "servers[3].name".
 */
/* Reads an integer-valued number in lo..hi. Numbers with a fraction, beyond 2^53 (where
 * doubles stop being exact), or of another JSON type are errors. */
int mr__json_u64(const cJSON *item, const char *label, const char *field, uint64_t lo,
                 uint64_t hi, uint64_t *out, mr_err *e);
/* Renders item as short text for error messages ("\"abc\"", "12.5", "an object"). */
void mr__json_describe(const cJSON *item, char *buf, size_t len);
/* Checks that every key of object obj is in allowed[] (NULL-terminated) and appears once;
 * `where` names the object in the message ("top level", "servers[2]"). */
int mr__json_check_keys(const cJSON *obj, const char *const *allowed, const char *label,
                        const char *where, mr_err *e);
/* Parses text of len bytes with cJSON. Allocation goes through cJSON's own hooks; the
 * caller deletes the result with cJSON_Delete. Only whitespace may follow the value. */
int mr__json_parse(const char *text, size_t len, const char *label, cJSON **out, mr_err *e);
/* The prologue of every JSON reader here: mr__json_parse, then the value must be an object,
 * else MR_EFORMAT "<label>: top level is <value>, must be a JSON object". */
int mr__json_parse_object(const char *text, size_t len, const char *label, cJSON **out,
                          mr_err *e);

/* Joins dir and name into buf ("dir/name"); returns MR_ERANGE if it does not fit. */
int mr__path_join(char *buf, size_t len, const char *dir, const char *name);

/* Splits HOST:PORT / [V6]:PORT into host (NUL-terminated, hlen bytes of room) and *port
 * (pointing into listen); MR_EINVAL naming flag and the form otherwise (http.c). */
int mr__http_split(const char *listen, const char *flag, char *host, size_t hlen, const char **port, mr_err *e);

#endif /* MR_INTERNAL_H */
