/*
 * common/safetensors.c - safetensors reader (mmap) and writer.
 *
 * File layout (https://github.com/huggingface/safetensors), all integers little-endian:
 *
 *   0        8                     8+N                                   file size
 *   +--------+---------------------+--------------------------------------+
 *   | u64 N  | JSON header, N bytes| data region: tensor bytes, row-major |
 *   +--------+---------------------+--------------------------------------+
 *
 *   header = {"__metadata__": {"format": "pt", ...},          (optional, strings only)
 *             "<name>": {"dtype": "BF16", "shape": [4096, 2048],
 *                        "data_offsets": [begin, end]}, ...}
 *
 * data_offsets are relative to the start of the data region. Everything in the header is
 * input from outside: the length, every number and every offset is checked before it is
 * used as a pointer (see st_parse_shard), so a malformed or hostile file is an error
 * message, never an out-of-bounds read. What mmap cannot protect against is the file
 * being truncated by someone else while mapped (SIGBUS); model files are not edited in
 * place by anything we know of.
 *
 * The reader keeps every tensor of every shard in one array sorted by name, so lookups
 * are a binary search (DeepSeek-V3 has ~92k tensors: 17 comparisons) and mr_st_at walks
 * them in a deterministic order.
 */
#include "common/internal.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---- dtypes -------------------------------------------------------------------------- */

/* Every dtype the reference implementation knows (safetensors 0.5). Only the three float
 * dtypes map to an mr_dtype; the others are kept so that models with integer buffers or
 * fp8 scales open, but their data cannot be asked for as float (mr_st_expect). */
static const struct st_dtype {
  const char *name;
  unsigned bits; /* per element */
  mr_dtype dt;
} st_dtypes[] = {
    {"BOOL", 8, MR_DTYPE_UNSPECIFIED},    {"U8", 8, MR_DTYPE_UNSPECIFIED},
    {"I8", 8, MR_DTYPE_UNSPECIFIED},      {"F8_E5M2", 8, MR_DTYPE_UNSPECIFIED},
    {"F8_E4M3", 8, MR_DTYPE_UNSPECIFIED}, {"F8_E8M0", 8, MR_DTYPE_UNSPECIFIED},
    {"I16", 16, MR_DTYPE_UNSPECIFIED},    {"U16", 16, MR_DTYPE_UNSPECIFIED},
    {"F16", 16, MR_DTYPE_F16},            {"BF16", 16, MR_DTYPE_BF16},
    {"I32", 32, MR_DTYPE_UNSPECIFIED},    {"U32", 32, MR_DTYPE_UNSPECIFIED},
    {"F32", 32, MR_DTYPE_F32},            {"I64", 64, MR_DTYPE_UNSPECIFIED},
    {"U64", 64, MR_DTYPE_UNSPECIFIED},    {"F64", 64, MR_DTYPE_UNSPECIFIED},
    {"C64", 64, MR_DTYPE_UNSPECIFIED},    {"F4", 4, MR_DTYPE_UNSPECIFIED},
    {"F6_E2M3", 6, MR_DTYPE_UNSPECIFIED}, {"F6_E3M2", 6, MR_DTYPE_UNSPECIFIED},
};

static const struct st_dtype *st_dtype_by_name(const char *s) {
  for (size_t i = 0; i < sizeof st_dtypes / sizeof st_dtypes[0]; i++)
    if (strcmp(st_dtypes[i].name, s) == 0) return &st_dtypes[i];
  return NULL;
}

static const char *st_dtype_file_name(mr_dtype dt) {
  switch (dt) {
  case MR_DTYPE_F32: return "F32";
  case MR_DTYPE_F16: return "F16";
  case MR_DTYPE_BF16: return "BF16";
  default: return NULL;
  }
}

/* Formats "[a, b, c]" for messages. */
static void st_fmt_shape(char *buf, size_t len, uint32_t ndim, const uint64_t *shape) {
  size_t o = (size_t)snprintf(buf, len, "[");
  for (uint32_t i = 0; i < ndim && o < len; i++)
    o += (size_t)snprintf(buf + o, len - o, "%s%llu", i ? ", " : "",
                          (unsigned long long)shape[i]);
  if (o < len) snprintf(buf + o, len - o, "]");
}

/* ---- reader -------------------------------------------------------------------------- */

typedef struct st_shard {
  char *path;          /* owned */
  const char *base;    /* basename, inside path */
  void *map;           /* mmap base, NULL for a buffer given by the caller */
  size_t map_len;
  const uint8_t *buf;  /* the whole file image */
  uint64_t size;       /* bytes in buf */
  uint64_t header_len; /* N */
} st_shard;

struct mr_st {
  char *label;            /* what was opened, for messages; owned */
  st_shard *shards;       /* sorted by basename once open */
  size_t n_shards;
  mr_st_tensor *tensors;  /* sorted by name once open */
  size_t n_tensors, cap_tensors;
  mr_arena names;         /* tensor names */
};

size_t mr__st_shard_count(const mr_st *st) { return st->n_shards; }

void mr__st_shard_get(const mr_st *st, size_t i, mr__st_shard_view *v) {
  MR_ASSERT(i < st->n_shards);
  const st_shard *s = &st->shards[i];
  v->path = s->path;
  v->base = s->base;
  v->header = s->buf + 8;
  v->header_len = s->header_len;
  v->data = s->buf + 8 + s->header_len;
  v->data_len = s->size - 8 - s->header_len;
  v->file_size = s->size;
}

static mr_st *st_new(const char *label) {
  mr_st *st = mr_calloc(1, sizeof *st);
  if (!st) return NULL;
  st->label = mr_strdup(label);
  if (!st->label) {
    mr_free(st);
    return NULL;
  }
  mr_arena_init(&st->names, 64 << 10);
  return st;
}

void mr_st_close(mr_st *st) {
  if (!st) return;
  for (size_t i = 0; i < st->n_shards; i++) {
    if (st->shards[i].map) munmap(st->shards[i].map, st->shards[i].map_len);
    mr_free(st->shards[i].path);
  }
  mr_free(st->shards);
  mr_free(st->tensors);
  mr_arena_close(&st->names);
  mr_free(st->label);
  mr_free(st);
}

/* Appends an empty shard record; returns it or NULL when out of memory. */
static st_shard *st_shard_add(mr_st *st, const char *path) {
  st_shard *grown = mr_realloc(st->shards, (st->n_shards + 1) * sizeof *grown);
  if (!grown) return NULL;
  st->shards = grown;
  st_shard *s = &st->shards[st->n_shards];
  memset(s, 0, sizeof *s);
  s->path = mr_strdup(path);
  if (!s->path) return NULL;
  const char *slash = strrchr(s->path, '/');
  s->base = slash ? slash + 1 : s->path;
  st->n_shards++;
  return s;
}

static mr_st_tensor *st_tensor_add(mr_st *st) {
  if (st->n_tensors == st->cap_tensors) {
    size_t cap = st->cap_tensors ? st->cap_tensors * 2 : 64;
    mr_st_tensor *t = mr_realloc(st->tensors, cap * sizeof *t);
    if (!t) return NULL;
    st->tensors = t;
    st->cap_tensors = cap;
  }
  mr_st_tensor *t = &st->tensors[st->n_tensors++];
  memset(t, 0, sizeof *t);
  return t;
}

typedef struct st_range {
  uint64_t begin, end;
  size_t tensor; /* index into st->tensors */
} st_range;

static int st_range_cmp(const void *a, const void *b) {
  const st_range *x = a, *y = b;
  if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
  if (x->end != y->end) return x->end < y->end ? -1 : 1;
  return 0;
}

/* Parses one tensor entry `item` (named item->string) of a shard whose data region is
 * [data, data + data_len). */
static int st_parse_tensor(mr_st *st, st_shard *sh, const cJSON *item, const uint8_t *data,
                           uint64_t data_len, st_range *range, mr_err *e) {
  const char *label = sh->path;
  const char *name = item->string ? item->string : "";
  char field[320];
  if (!cJSON_IsObject(item)) {
    char desc[96];
    mr__json_describe(item, desc, sizeof desc);
    return mr_err_set(e, MR_EFORMAT, "%s: tensor \"%.200s\" is %s, must be an object", label,
                      name, desc);
  }
  const cJSON *jdt = cJSON_GetObjectItemCaseSensitive(item, "dtype");
  const cJSON *jshape = cJSON_GetObjectItemCaseSensitive(item, "shape");
  const cJSON *joff = cJSON_GetObjectItemCaseSensitive(item, "data_offsets");

  if (!cJSON_IsString(jdt)) {
    char desc[96];
    mr__json_describe(jdt, desc, sizeof desc);
    return mr_err_set(e, MR_EFORMAT, "%s: tensor \"%.200s\": dtype = %s, must be a string",
                      label, name, desc);
  }
  const struct st_dtype *dt = st_dtype_by_name(jdt->valuestring);
  if (!dt) {
    char desc[96];
    mr__json_describe(jdt, desc, sizeof desc);
    return mr_err_set(e, MR_EFORMAT,
                      "%s: tensor \"%.200s\": dtype = %s is not a safetensors dtype (e.g. F32, "
                      "F16, BF16, I64)",
                      label, name, desc);
  }

  if (!cJSON_IsArray(jshape)) {
    char desc[96];
    mr__json_describe(jshape, desc, sizeof desc);
    return mr_err_set(e, MR_EFORMAT, "%s: tensor \"%.200s\": shape = %s, must be an array",
                      label, name, desc);
  }
  int ndim = cJSON_GetArraySize(jshape);
  if (ndim > MR_ST_MAX_DIMS)
    return mr_err_set(e, MR_ERANGE, "%s: tensor \"%.200s\": shape has %d dimensions, at most %d",
                      label, name, ndim, MR_ST_MAX_DIMS);
  uint64_t shape[MR_ST_MAX_DIMS];
  uint64_t nelem = 1;
  bool overflow = false;
  int d = 0;
  for (const cJSON *c = jshape->child; c; c = c->next, d++) {
    snprintf(field, sizeof field, "tensor \"%.200s\": shape[%d]", name, d);
    int rc = mr__json_u64(c, label, field, 0, UINT64_MAX, &shape[d], e);
    if (rc) return rc;
    if (shape[d] != 0 && nelem > UINT64_MAX / shape[d]) overflow = true;
    else nelem *= shape[d];
  }
  /* A zero dimension makes the tensor empty however large the others are. */
  for (int i = 0; i < ndim; i++)
    if (shape[i] == 0) overflow = false, nelem = 0;
  char shp[160];
  st_fmt_shape(shp, sizeof shp, (uint32_t)ndim, shape);
  if (overflow || nelem > UINT64_MAX / dt->bits)
    return mr_err_set(e, MR_ERANGE, "%s: tensor \"%.200s\": shape %s overflows 64-bit sizes",
                      label, name, shp);
  if ((nelem * dt->bits) % 8 != 0)
    return mr_err_set(e, MR_EFORMAT,
                      "%s: tensor \"%.200s\": shape %s of %s (%u bits each) is not a whole "
                      "number of bytes",
                      label, name, shp, dt->name, dt->bits);
  uint64_t nbytes = nelem * dt->bits / 8;

  if (!cJSON_IsArray(joff) || cJSON_GetArraySize(joff) != 2) {
    char desc[96];
    mr__json_describe(joff, desc, sizeof desc);
    return mr_err_set(e, MR_EFORMAT,
                      "%s: tensor \"%.200s\": data_offsets = %s, must be an array [begin, end]",
                      label, name, desc);
  }
  uint64_t begin, end;
  snprintf(field, sizeof field, "tensor \"%.200s\": data_offsets[0]", name);
  int rc = mr__json_u64(joff->child, label, field, 0, UINT64_MAX, &begin, e);
  if (rc) return rc;
  snprintf(field, sizeof field, "tensor \"%.200s\": data_offsets[1]", name);
  rc = mr__json_u64(joff->child->next, label, field, 0, UINT64_MAX, &end, e);
  if (rc) return rc;
  if (begin > data_len || end > data_len)
    return mr_err_set(e, MR_EFORMAT,
                      "%s: tensor \"%.200s\": data_offsets = [%llu, %llu] run past the end of "
                      "the data region (%llu bytes)",
                      label, name, (unsigned long long)begin, (unsigned long long)end,
                      (unsigned long long)data_len);
  if (begin > end)
    return mr_err_set(e, MR_EFORMAT,
                      "%s: tensor \"%.200s\": data_offsets = [%llu, %llu], begin > end", label,
                      name, (unsigned long long)begin, (unsigned long long)end);
  if (end - begin != nbytes)
    return mr_err_set(e, MR_EFORMAT,
                      "%s: tensor \"%.200s\": data_offsets = [%llu, %llu] hold %llu bytes, but "
                      "shape %s of %s needs %llu",
                      label, name, (unsigned long long)begin, (unsigned long long)end,
                      (unsigned long long)(end - begin), shp, dt->name,
                      (unsigned long long)nbytes);

  size_t nlen = strlen(name);
  char *nm = mr_arena_alloc(&st->names, nlen + 1, 1);
  if (!nm) return mr_err_set(e, MR_ENOMEM, "%s: out of memory for tensor names", label);
  memcpy(nm, name, nlen + 1);
  mr_st_tensor *t = st_tensor_add(st);
  if (!t) return mr_err_set(e, MR_ENOMEM, "%s: out of memory for the tensor table", label);
  t->name = nm;
  t->dtype = dt->dt;
  t->dtype_name = dt->name;
  t->ndim = (uint32_t)ndim;
  for (int i = 0; i < ndim; i++) t->shape[i] = shape[i];
  t->nbytes = nbytes;
  t->data = data + begin;
  t->file = sh->path;
  range->begin = begin;
  range->end = end;
  range->tensor = st->n_tensors - 1;
  return 0;
}

/* Parses the header of shard sh (its buf/size already set) and appends its tensors. */
static int st_parse_shard(mr_st *st, st_shard *sh, mr_err *e) {
  const char *label = sh->path;
  int rc = 0;
  cJSON *root = NULL;
  st_range *ranges = NULL;

  if (sh->size < 8)
    return mr_err_set(e, MR_EFORMAT,
                      "%s: file is %llu bytes, too short for the 8-byte header length", label,
                      (unsigned long long)sh->size);
  uint64_t hlen = 0;
  for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | sh->buf[i];
  if (hlen > MR__ST_MAX_HEADER)
    return mr_err_set(e, MR_EFORMAT, "%s: header length = %llu bytes, exceeds the limit of %llu",
                      label, (unsigned long long)hlen, (unsigned long long)MR__ST_MAX_HEADER);
  if (hlen > sh->size - 8)
    return mr_err_set(e, MR_EFORMAT,
                      "%s: header length = %llu bytes runs past the end of the file (%llu bytes "
                      "after the length field)",
                      label, (unsigned long long)hlen, (unsigned long long)(sh->size - 8));
  sh->header_len = hlen;
  const uint8_t *data = sh->buf + 8 + hlen;
  uint64_t data_len = sh->size - 8 - hlen;

  char hlabel[4200];
  snprintf(hlabel, sizeof hlabel, "%s: header", label);
  rc = mr__json_parse_object((const char *)sh->buf + 8, (size_t)hlen, hlabel, &root, e);
  if (rc) return rc;
  size_t n = (size_t)cJSON_GetArraySize(root);
  ranges = mr_malloc((n ? n : 1) * sizeof *ranges);
  if (!ranges) {
    rc = mr_err_set(e, MR_ENOMEM, "%s: out of memory for %zu tensors", label, n);
    goto out_free_root;
  }
  size_t nr = 0;
  for (const cJSON *item = root->child; item; item = item->next) {
    if (item->string && strcmp(item->string, "__metadata__") == 0) {
      /* Free-form string->string metadata ({"format": "pt"}); nothing here is ours, but
       * the reference implementation refuses anything but a map of strings, so do we. */
      if (!cJSON_IsObject(item)) {
        rc = mr_err_set(e, MR_EFORMAT, "%s: __metadata__ must be an object of strings", label);
        goto out_free_ranges;
      }
      for (const cJSON *m = item->child; m; m = m->next)
        if (!cJSON_IsString(m)) {
          rc = mr_err_set(e, MR_EFORMAT, "%s: __metadata__ \"%.64s\" must be a string", label,
                          m->string ? m->string : "");
          goto out_free_ranges;
        }
      continue;
    }
    rc = st_parse_tensor(st, sh, item, data, data_len, &ranges[nr], e);
    if (rc) goto out_free_ranges;
    nr++;
  }

  /* No two tensors may share bytes: sort by begin and compare neighbours. Empty tensors
   * own no bytes and may sit anywhere. Gaps are allowed (the reference writer makes none,
   * but nothing breaks if another writer pads). */
  if (nr > 1) qsort(ranges, nr, sizeof *ranges, st_range_cmp);
  const st_range *prev = NULL;
  for (size_t i = 0; i < nr; i++) {
    if (ranges[i].begin == ranges[i].end) continue;
    if (prev && ranges[i].begin < prev->end) {
      const mr_st_tensor *a = &st->tensors[prev->tensor], *b = &st->tensors[ranges[i].tensor];
      rc = mr_err_set(e, MR_EFORMAT,
                      "%s: tensor \"%.200s\" data_offsets = [%llu, %llu] overlaps tensor "
                      "\"%.200s\" [%llu, %llu]",
                      label, b->name, (unsigned long long)ranges[i].begin,
                      (unsigned long long)ranges[i].end, a->name,
                      (unsigned long long)prev->begin, (unsigned long long)prev->end);
      goto out_free_ranges;
    }
    prev = &ranges[i];
  }

out_free_ranges:
  mr_free(ranges);
out_free_root:
  cJSON_Delete(root);
  return rc;
}

static int st_tensor_name_cmp(const void *a, const void *b) {
  return strcmp(((const mr_st_tensor *)a)->name, ((const mr_st_tensor *)b)->name);
}

/* Sorts the tensors by name and rejects duplicates (within one header, where cJSON kept
 * both keys, or across shards). */
static int st_finish(mr_st *st, mr_err *e) {
  if (st->n_tensors > 1)
    qsort(st->tensors, st->n_tensors, sizeof *st->tensors, st_tensor_name_cmp);
  for (size_t i = 1; i < st->n_tensors; i++) {
    const mr_st_tensor *a = &st->tensors[i - 1], *b = &st->tensors[i];
    if (strcmp(a->name, b->name) == 0) {
      if (a->file == b->file)
        return mr_err_set(e, MR_EFORMAT, "%s: tensor \"%.200s\" appears twice in the header",
                          a->file, a->name);
      return mr_err_set(e, MR_EFORMAT, "%s: duplicate tensor \"%.200s\" in shards %s and %s",
                        st->label, a->name, a->file, b->file);
    }
  }
  return 0;
}

int mr_st_parse_buffer(mr_st **out, const void *buf, size_t len, const char *label, mr_err *e) {
  *out = NULL;
  mr_st *st = st_new(label ? label : "(buffer)");
  if (!st) return mr_err_set(e, MR_ENOMEM, "%s: out of memory", label ? label : "(buffer)");
  st_shard *sh = st_shard_add(st, st->label);
  int rc;
  if (!sh) {
    rc = mr_err_set(e, MR_ENOMEM, "%s: out of memory", st->label);
    goto out_close;
  }
  sh->buf = buf;
  sh->size = len;
  rc = st_parse_shard(st, sh, e);
  if (rc) goto out_close;
  rc = st_finish(st, e);
  if (rc) goto out_close;
  *out = st;
  return 0;
out_close:
  mr_st_close(st);
  return rc;
}

/* mmaps the file of shard sh (path already set). */
static int st_shard_map(st_shard *sh, mr_err *e) {
  int rc = 0;
  int fd = -1;
  uint64_t fsize = 0;
  rc = mr_file_open_regular(sh->path, &fd, &fsize, e);
  if (rc) return rc;
  sh->size = fsize;
  if (sh->size < 8) {
    /* mmap of an empty file fails; let the parser word the error. */
    static const uint8_t zeros[8];
    sh->buf = zeros;
    goto out_close_fd;
  }
  if (sh->size > (uint64_t)SIZE_MAX) {
    rc = mr_err_set(e, MR_ERANGE, "%s: %llu bytes do not fit the address space", sh->path,
                    (unsigned long long)sh->size);
    goto out_close_fd;
  }
  void *m = mmap(NULL, (size_t)sh->size, PROT_READ, MAP_PRIVATE, fd, 0);
  if (m == MAP_FAILED) {
    rc = mr_err_set(e, MR_EIO, "%s: mmap of %llu bytes: %s", sh->path,
                    (unsigned long long)sh->size, strerror(errno));
    goto out_close_fd;
  }
  sh->map = m;
  sh->map_len = (size_t)sh->size;
  sh->buf = m;
out_close_fd:
  close(fd);
  return rc;
}

static int st_cstr_cmp(const void *a, const void *b) {
  return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* Opens a sharded model: dir/model.safetensors.index.json lists "weight_map":
 * {"<tensor>": "<shard file>"}. Every listed shard is opened, and every listed tensor must
 * be in the shard the index names. */
static int st_open_index(mr_st *st, const char *dir, const char *index_path, mr_err *e) {
  int rc;
  char *text = NULL;
  size_t len = 0;
  cJSON *root = NULL;
  const char **names = NULL;
  char path[4096];

  rc = mr_file_read(index_path, MR_JSON_MAX_BYTES, &text, &len, e);
  if (rc) return rc;
  rc = mr__json_parse_object(text, len, index_path, &root, e);
  if (rc) goto out_free_text;
  const cJSON *wm = cJSON_GetObjectItemCaseSensitive(root, "weight_map");
  if (!cJSON_IsObject(wm)) {
    char desc[96];
    mr__json_describe(wm, desc, sizeof desc);
    rc = mr_err_set(e, MR_EFORMAT, "%s: weight_map = %s, must be an object {tensor: shard file}",
                    index_path, desc);
    goto out_free_root;
  }
  size_t n = (size_t)cJSON_GetArraySize(wm);
  if (n == 0) {
    rc = mr_err_set(e, MR_EFORMAT, "%s: weight_map is empty", index_path);
    goto out_free_root;
  }
  names = mr_malloc(n * sizeof *names);
  if (!names) {
    rc = mr_err_set(e, MR_ENOMEM, "%s: out of memory", index_path);
    goto out_free_root;
  }
  size_t i = 0;
  for (const cJSON *c = wm->child; c; c = c->next, i++) {
    const char *v = cJSON_IsString(c) ? c->valuestring : NULL;
    /* Shard names are plain file names next to the index; anything with a '/' or a
     * leading '.' could reach outside the model directory. */
    if (!v || !v[0] || v[0] == '.' || strchr(v, '/') || strlen(v) > 255) {
      char desc[96];
      mr__json_describe(c, desc, sizeof desc);
      rc = mr_err_set(e, MR_EFORMAT,
                      "%s: weight_map[\"%.200s\"] = %s, must be a file name in the same "
                      "directory (no '/', not starting with '.')",
                      index_path, c->string ? c->string : "", desc);
      goto out_free_names;
    }
    names[i] = v;
  }
  qsort(names, n, sizeof *names, st_cstr_cmp);
  /* One shard record per distinct file, in sorted order. */
  for (i = 0; i < n; i++) {
    if (i > 0 && strcmp(names[i], names[i - 1]) == 0) continue;
    if (mr__path_join(path, sizeof path, dir, names[i]) != 0) {
      rc = mr_err_set(e, MR_ERANGE, "%s: path of shard \"%s\" is too long", index_path, names[i]);
      goto out_free_names;
    }
    if (!st_shard_add(st, path)) {
      rc = mr_err_set(e, MR_ENOMEM, "%s: out of memory", index_path);
      goto out_free_names;
    }
  }
  for (i = 0; i < st->n_shards; i++) {
    rc = st_shard_map(&st->shards[i], e);
    if (rc) {
      mr_err_prefix(e, rc, "%s: shard \"%s\" listed in weight_map", index_path,
                    st->shards[i].base);
      goto out_free_names;
    }
  }
  for (i = 0; i < st->n_shards; i++) {
    rc = st_parse_shard(st, &st->shards[i], e);
    if (rc) goto out_free_names;
  }
  rc = st_finish(st, e);
  if (rc) goto out_free_names;

  /* Every entry of the index must point at a tensor that is in the shard it names. */
  for (const cJSON *c = wm->child; c; c = c->next) {
    const mr_st_tensor *t = mr_st_find(st, c->string);
    if (!t) {
      rc = mr_err_set(e, MR_ENOTFOUND,
                      "%s: weight_map lists tensor \"%.200s\" in shard \"%s\", which has no such "
                      "tensor",
                      index_path, c->string, c->valuestring);
      goto out_free_names;
    }
    const char *slash = strrchr(t->file, '/');
    const char *base = slash ? slash + 1 : t->file;
    if (strcmp(base, c->valuestring) != 0) {
      rc = mr_err_set(e, MR_EFORMAT,
                      "%s: weight_map puts tensor \"%.200s\" in shard \"%s\", but it is in \"%s\"",
                      index_path, c->string, c->valuestring, base);
      goto out_free_names;
    }
  }
  if (st->n_tensors != n)
    mr_log(MR_LOG_DEBUG, "%s: shards hold %zu tensors, weight_map lists %zu", index_path,
           st->n_tensors, n);

out_free_names:
  mr_free(names);
out_free_root:
  cJSON_Delete(root);
out_free_text:
  mr_free(text);
  return rc;
}

int mr_st_open(mr_st **out, const char *path, mr_err *e) {
  *out = NULL;
  struct stat sb;
  if (stat(path, &sb) != 0) {
    int err = errno;
    return mr_err_set(e, err == ENOENT ? MR_ENOTFOUND : MR_EIO, "%s: cannot open: %s", path,
                      strerror(err));
  }
  mr_st *st = st_new(path);
  if (!st) return mr_err_set(e, MR_ENOMEM, "%s: out of memory", path);
  int rc = 0;
  char p[4096];
  if (S_ISDIR(sb.st_mode)) {
    struct stat sb2;
    if (mr__path_join(p, sizeof p, path, "model.safetensors.index.json") != 0) {
      rc = mr_err_set(e, MR_ERANGE, "%s: path too long", path);
      goto out_close;
    }
    if (stat(p, &sb2) == 0) {
      rc = st_open_index(st, path, p, e);
      if (rc) goto out_close;
      goto out_ok;
    }
    if (mr__path_join(p, sizeof p, path, "model.safetensors") != 0) {
      rc = mr_err_set(e, MR_ERANGE, "%s: path too long", path);
      goto out_close;
    }
    if (stat(p, &sb2) != 0) {
      rc = mr_err_set(e, MR_ENOTFOUND,
                      "%s: directory has neither model.safetensors.index.json nor "
                      "model.safetensors",
                      path);
      goto out_close;
    }
  } else {
    if (strlen(path) >= sizeof p) {
      rc = mr_err_set(e, MR_ERANGE, "%s: path too long", path);
      goto out_close;
    }
    strcpy(p, path);
  }
  st_shard *sh = st_shard_add(st, p);
  if (!sh) {
    rc = mr_err_set(e, MR_ENOMEM, "%s: out of memory", path);
    goto out_close;
  }
  rc = st_shard_map(sh, e);
  if (rc) goto out_close;
  rc = st_parse_shard(st, sh, e);
  if (rc) goto out_close;
  rc = st_finish(st, e);
  if (rc) goto out_close;
out_ok:
  mr_log(MR_LOG_DEBUG, "%s: %zu tensors in %zu shard(s)", path, st->n_tensors, st->n_shards);
  *out = st;
  return 0;
out_close:
  mr_st_close(st);
  return rc;
}

const mr_st_tensor *mr_st_find(const mr_st *st, const char *name) {
  size_t lo = 0, hi = st->n_tensors;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    int c = strcmp(name, st->tensors[mid].name);
    if (c == 0) return &st->tensors[mid];
    if (c < 0) hi = mid;
    else lo = mid + 1;
  }
  return NULL;
}

/* Pages of [a, end) looked at by mr_st_prefetch before it asks for a read. */
#define ST_RESIDENT_SAMPLES 8u

void mr_st_prefetch(const mr_st_tensor *t) {
  if (!t || !t->nbytes) return;
  const uintptr_t pg = (uintptr_t)sysconf(_SC_PAGESIZE);
  const uintptr_t a = (uintptr_t)t->data & ~(pg - 1), end = (uintptr_t)t->data + t->nbytes;
  /* A warm restart finds the file in the page cache, where WILLNEED still walks the cache
   * page by page (6 % of a 2-vCPU INT4 load): a few pages spread over the tensor, all
   * resident (mincore), stand for the rest. A miss, or a mincore that fails (not a file
   * mapping: mr_st_parse_buffer), asks for the read, which is advice only. */
  const uintptr_t pages = (end - a + pg - 1) / pg;
  bool resident = true;
  for (uint32_t i = 0; i < ST_RESIDENT_SAMPLES && resident; i++) {
    unsigned char v = 0;
    const uintptr_t at = a + (uintptr_t)((uint64_t)pages * i / ST_RESIDENT_SAMPLES) * pg;
    resident = mincore((void *)at, pg, &v) == 0 && (v & 1);
  }
  if (!resident) (void)madvise((void *)a, end - a, MADV_WILLNEED);
}

void mr_st_populate(const mr_st_tensor *t) {
  if (!t || !t->nbytes) return;
  const uintptr_t pg = (uintptr_t)sysconf(_SC_PAGESIZE);
  const uintptr_t a = (uintptr_t)t->data & ~(pg - 1), end = (uintptr_t)t->data + t->nbytes;
#ifdef MADV_POPULATE_READ
  if (madvise((void *)a, end - a, MADV_POPULATE_READ) == 0) return;
#endif
  (void)madvise((void *)a, end - a, MADV_WILLNEED);
}

void mr_st_advise_hugepage(const mr_st *st) {
#ifdef MADV_HUGEPAGE
  for (size_t i = 0; st && i < st->n_shards; i++)
    if (st->shards[i].map) (void)madvise(st->shards[i].map, st->shards[i].map_len, MADV_HUGEPAGE);
#else
  (void)st;
#endif
}

size_t mr_st_count(const mr_st *st) { return st->n_tensors; }

const mr_st_tensor *mr_st_at(const mr_st *st, size_t i) {
  return i < st->n_tensors ? &st->tensors[i] : NULL;
}

bool mr_st_is_f8e4m3(const mr_st_tensor *t) {
  return t && t->dtype == MR_DTYPE_UNSPECIFIED && t->dtype_name && strcmp(t->dtype_name, "F8_E4M3") == 0;
}

int mr_st_expect(const mr_st *st, const char *name, uint32_t ndim, const uint64_t *shape,
                 const mr_st_tensor **out, mr_err *e) {
  return mr_st_expect_as(st, name, NULL, ndim, shape, out, e);
}

int mr_st_expect_as(const mr_st *st, const char *name, const char *dtype_name, uint32_t ndim,
                    const uint64_t *shape, const mr_st_tensor **out, mr_err *e) {
  if (out) *out = NULL;
  const mr_st_tensor *t = mr_st_find(st, name);
  if (!t)
    return mr_err_set(e, MR_ENOTFOUND, "%s: tensor \"%.200s\" not found (%zu tensors)",
                      st->label, name, st->n_tensors);
  if (dtype_name && strcmp(t->dtype_name, dtype_name) != 0)
    return mr_err_set(e, MR_EFORMAT, "%s: tensor \"%.200s\": dtype = %s, expected %s", t->file,
                      name, t->dtype_name, dtype_name);
  if (!dtype_name && t->dtype != MR_DTYPE_F32 && t->dtype != MR_DTYPE_F16 && t->dtype != MR_DTYPE_BF16)
    return mr_err_set(e, MR_EFORMAT, "%s: tensor \"%.200s\": dtype = %s, expected F32, F16 or BF16",
                      t->file, name, t->dtype_name);
  bool same = t->ndim == ndim;
  for (uint32_t i = 0; same && i < ndim; i++) same = t->shape[i] == shape[i];
  if (!same) {
    char got[160], want[160];
    st_fmt_shape(got, sizeof got, t->ndim, t->shape);
    st_fmt_shape(want, sizeof want, ndim > MR_ST_MAX_DIMS ? MR_ST_MAX_DIMS : ndim, shape);
    return mr_err_set(e, MR_EMISMATCH, "%s: tensor \"%.200s\": shape = %s, expected %s", t->file,
                      name, got, want);
  }
  if (out) *out = t;
  return 0;
}

/* ---- writer -------------------------------------------------------------------------- */

typedef struct st_wtensor {
  char *name;      /* owned */
  mr_dtype dt;     /* MR_DTYPE_UNSPECIFIED when f8 */
  bool f8;         /* F8_E4M3 codes, 1 byte each */
  uint32_t ndim;
  uint64_t shape[MR_ST_MAX_DIMS];
  uint64_t nbytes;
  void *data;      /* owned copy, NULL for a lazy tensor */
  size_t index;    /* order of addition, passed to fill() */
  uint64_t begin;  /* offset in the data region, set by the layout */
} st_wtensor;

struct mr_st_writer {
  st_wtensor *t;
  size_t n, cap;
  /* Open-addressing set of names for the duplicate check: slot = tensor index + 1, 0 =
   * empty; nslots is a power of two kept above 2n, so adding is O(1) however many
   * tensors a model has. */
  uint32_t *slots;
  size_t nslots;
};

static uint64_t st_name_hash(const char *s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
    h ^= *p;
    h *= 0x100000001b3ull;
  }
  return h;
}

/* Returns the slot where name is, or the empty slot where it would go. */
static size_t st_writer_slot(const mr_st_writer *w, const char *name) {
  size_t mask = w->nslots - 1, i = (size_t)st_name_hash(name) & mask;
  while (w->slots[i] && strcmp(w->t[w->slots[i] - 1].name, name) != 0) i = (i + 1) & mask;
  return i;
}

/* Makes room for one more name in the set. */
static int st_writer_slots_grow(mr_st_writer *w) {
  if (w->nslots > 2 * (w->n + 1)) return 0;
  size_t ns = w->nslots ? w->nslots * 2 : 64;
  while (ns <= 2 * (w->n + 1)) ns *= 2;
  if (w->n + 1 > UINT32_MAX - 1) return MR_ERANGE;
  uint32_t *old = w->slots;
  size_t old_n = w->nslots;
  w->slots = mr_calloc(ns, sizeof *w->slots);
  if (!w->slots) {
    w->slots = old;
    return MR_ENOMEM;
  }
  w->nslots = ns;
  for (size_t i = 0; i < old_n; i++)
    if (old[i]) w->slots[st_writer_slot(w, w->t[old[i] - 1].name)] = old[i];
  mr_free(old);
  return 0;
}

int mr_st_writer_new(mr_st_writer **out) {
  *out = mr_calloc(1, sizeof **out);
  return *out ? 0 : MR_ENOMEM;
}

void mr_st_writer_free(mr_st_writer *w) {
  if (!w) return;
  for (size_t i = 0; i < w->n; i++) {
    mr_free(w->t[i].name);
    mr_free(w->t[i].data);
  }
  mr_free(w->t);
  mr_free(w->slots);
  mr_free(w);
}

size_t mr__st_writer_count(const mr_st_writer *w) { return w->n; }

static int st_writer_add(mr_st_writer *w, const char *name, mr_dtype dt, bool f8, uint32_t ndim,
                         const uint64_t *shape, const void *data, bool lazy) {
  if (!name || strcmp(name, "__metadata__") == 0 || (!f8 && !st_dtype_file_name(dt)) ||
      ndim > MR_ST_MAX_DIMS || (ndim > 0 && !shape) || (!lazy && !data))
    return MR_EINVAL;
  uint64_t nelem = 1;
  for (uint32_t i = 0; i < ndim; i++) {
    if (shape[i] != 0 && nelem > UINT64_MAX / shape[i]) return MR_ERANGE;
    nelem *= shape[i];
  }
  size_t es = f8 ? 1 : mr_dtype_size(dt);
  if (nelem > UINT64_MAX / es) return MR_ERANGE;
  uint64_t nbytes = nelem * es;
  if (!lazy && nbytes > SIZE_MAX) return MR_ERANGE;
  int rc = st_writer_slots_grow(w);
  if (rc) return rc;
  size_t slot = st_writer_slot(w, name);
  if (w->slots[slot]) return MR_EINVAL; /* duplicate name */
  if (w->n == w->cap) {
    size_t cap = w->cap ? w->cap * 2 : 32;
    st_wtensor *t = mr_realloc(w->t, cap * sizeof *t);
    if (!t) return MR_ENOMEM;
    w->t = t;
    w->cap = cap;
  }
  st_wtensor *t = &w->t[w->n];
  memset(t, 0, sizeof *t);
  t->name = mr_strdup(name);
  if (!t->name) return MR_ENOMEM;
  if (!lazy) {
    t->data = mr_malloc(nbytes ? (size_t)nbytes : 1);
    if (!t->data) {
      mr_free(t->name);
      return MR_ENOMEM;
    }
    if (nbytes) memcpy(t->data, data, (size_t)nbytes);
  }
  t->dt = f8 ? MR_DTYPE_UNSPECIFIED : dt;
  t->f8 = f8;
  t->ndim = ndim;
  for (uint32_t i = 0; i < ndim; i++) t->shape[i] = shape[i];
  t->nbytes = nbytes;
  t->index = w->n;
  w->n++;
  w->slots[slot] = (uint32_t)w->n;
  return 0;
}

int mr_st_writer_add(mr_st_writer *w, const char *name, mr_dtype dt, uint32_t ndim,
                     const uint64_t *shape, const void *data) {
  return st_writer_add(w, name, dt, false, ndim, shape, data, false);
}

int mr_st_writer_add_f8e4m3(mr_st_writer *w, const char *name, uint32_t ndim,
                            const uint64_t *shape, const void *data) {
  return st_writer_add(w, name, MR_DTYPE_UNSPECIFIED, true, ndim, shape, data, false);
}

int mr__st_writer_add_lazy_f8e4m3(mr_st_writer *w, const char *name, uint32_t ndim,
                                  const uint64_t *shape) {
  return st_writer_add(w, name, MR_DTYPE_UNSPECIFIED, true, ndim, shape, NULL, true);
}

int mr__st_writer_add_lazy(mr_st_writer *w, const char *name, mr_dtype dt, uint32_t ndim,
                           const uint64_t *shape) {
  return st_writer_add(w, name, dt, false, ndim, shape, NULL, true);
}

/* The reference writer sorts tensors by dtype, descending in the order of its Rust `Dtype`
 * enum (... F16 < BF16 < ... < F32), then by name, and packs them with no gaps. Larger
 * elements thus come first, so every tensor stays aligned to its element size, and our
 * files are byte-identical to what safetensors writes for the same tensors
 * (tests/conformance/test_safetensors_python.py checks this). */
static int st_dtype_rank(const st_wtensor *t) {
  if (t->f8) return -1; /* F8_E4M3 < F16 in the reference's enum */
  switch (t->dt) {
  case MR_DTYPE_F32: return 2;
  case MR_DTYPE_BF16: return 1;
  default: return 0; /* F16 */
  }
}

static int st_wtensor_cmp(const void *a, const void *b) {
  const st_wtensor *const *x = a, *const *y = b;
  int rx = st_dtype_rank(*x), ry = st_dtype_rank(*y);
  if (rx != ry) return rx > ry ? -1 : 1;
  return strcmp((*x)->name, (*y)->name);
}

/* A growable text buffer for the header. */
typedef struct st_text {
  char *s;
  size_t len, cap;
  bool oom;
} st_text;

static void st_text_put(st_text *t, const char *s, size_t n) {
  if (t->oom) return;
  if (t->len + n + 1 > t->cap) {
    size_t cap = t->cap ? t->cap : 4096;
    while (cap < t->len + n + 1) cap *= 2;
    char *g = mr_realloc(t->s, cap);
    if (!g) {
      t->oom = true;
      return;
    }
    t->s = g;
    t->cap = cap;
  }
  memcpy(t->s + t->len, s, n);
  t->len += n;
  t->s[t->len] = '\0';
}

static void st_text_str(st_text *t, const char *s) { st_text_put(t, s, strlen(s)); }

static void st_text_u64(st_text *t, uint64_t v) {
  char b[24];
  int n = snprintf(b, sizeof b, "%llu", (unsigned long long)v);
  st_text_put(t, b, (size_t)n);
}

/* Writes s as a JSON string literal: quotes, backslashes and control bytes escaped. */
static void st_text_json_str(st_text *t, const char *s) {
  st_text_put(t, "\"", 1);
  for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
    if (*p == '"' || *p == '\\') {
      char b[2] = {'\\', (char)*p};
      st_text_put(t, b, 2);
    } else if (*p < 0x20) {
      char b[8];
      snprintf(b, sizeof b, "\\u%04x", *p);
      st_text_put(t, b, 6);
    } else {
      st_text_put(t, (const char *)p, 1);
    }
  }
  st_text_put(t, "\"", 1);
}

/* Lays out the tensors (sets begin) and renders the header, padded with spaces so that the
 * data region starts at a multiple of 8 bytes, as the HF writer does. */
static int st_writer_layout(mr_st_writer *w, st_wtensor ***order_out, st_text *hdr,
                            uint64_t *data_len) {
  st_wtensor **order = mr_malloc((w->n ? w->n : 1) * sizeof *order);
  if (!order) return MR_ENOMEM;
  for (size_t i = 0; i < w->n; i++) order[i] = &w->t[i];
  if (w->n > 1) qsort(order, w->n, sizeof *order, st_wtensor_cmp);
  uint64_t off = 0;
  st_text_str(hdr, "{\"__metadata__\":{\"format\":\"pt\"}");
  for (size_t i = 0; i < w->n; i++) {
    st_wtensor *t = order[i];
    t->begin = off;
    off += t->nbytes;
    st_text_put(hdr, ",", 1);
    st_text_json_str(hdr, t->name);
    st_text_str(hdr, ":{\"dtype\":\"");
    st_text_str(hdr, t->f8 ? "F8_E4M3" : st_dtype_file_name(t->dt));
    st_text_str(hdr, "\",\"shape\":[");
    for (uint32_t d = 0; d < t->ndim; d++) {
      if (d) st_text_put(hdr, ",", 1);
      st_text_u64(hdr, t->shape[d]);
    }
    st_text_str(hdr, "],\"data_offsets\":[");
    st_text_u64(hdr, t->begin);
    st_text_put(hdr, ",", 1);
    st_text_u64(hdr, t->begin + t->nbytes);
    st_text_str(hdr, "]}");
  }
  st_text_put(hdr, "}", 1);
  while (!hdr->oom && hdr->len % 8 != 0) st_text_put(hdr, " ", 1);
  if (hdr->oom) {
    mr_free(order);
    return MR_ENOMEM;
  }
  *order_out = order;
  *data_len = off;
  return 0;
}

uint64_t mr__st_writer_file_size(const mr_st_writer *w) {
  /* An estimate good to a few bytes per tensor would do for sharding decisions, but the
   * exact size is cheap: render the header. */
  st_wtensor **order = NULL;
  st_text hdr = {0};
  uint64_t data_len = 0, size = 0;
  if (st_writer_layout((mr_st_writer *)w, &order, &hdr, &data_len) == 0)
    size = 8 + hdr.len + data_len;
  mr_free(order);
  mr_free(hdr.s);
  return size;
}

/* Buffered output to one fd. */
typedef struct st_out {
  int fd;
  uint8_t *buf;
  size_t used, cap;
  const char *path;
} st_out;

static int st_write_all(int fd, const void *p, size_t n, const char *path, mr_err *e) {
  const uint8_t *b = p;
  while (n > 0) {
    ssize_t k = write(fd, b, n);
    if (k < 0) {
      if (errno == EINTR) continue;
      return mr_err_set(e, MR_EIO, "%s: write: %s", path, strerror(errno));
    }
    b += k;
    n -= (size_t)k;
  }
  return 0;
}

static int st_out_flush(st_out *o, mr_err *e) {
  int rc = st_write_all(o->fd, o->buf, o->used, o->path, e);
  o->used = 0;
  return rc;
}

static int st_out_put(st_out *o, const void *p, uint64_t n, mr_err *e) {
  const uint8_t *b = p;
  if (n >= o->cap) {
    int rc = st_out_flush(o, e);
    if (rc) return rc;
    while (n > 0) {
      size_t k = n > ((size_t)1 << 30) ? ((size_t)1 << 30) : (size_t)n;
      rc = st_write_all(o->fd, b, k, o->path, e);
      if (rc) return rc;
      b += k;
      n -= k;
    }
    return 0;
  }
  if (o->used + n > o->cap) {
    int rc = st_out_flush(o, e);
    if (rc) return rc;
  }
  memcpy(o->buf + o->used, b, (size_t)n);
  o->used += (size_t)n;
  return 0;
}

int mr__st_writer_write_fill(mr_st_writer *w, const char *path, mr__st_fill_fn fill, void *ctx,
                             mr_err *e) {
  int rc;
  st_wtensor **order = NULL;
  st_text hdr = {0};
  uint64_t data_len = 0;
  char tmp[4096];
  st_out o = {.fd = -1, .path = path};

  int n = snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid());
  if (n < 0 || (size_t)n >= sizeof tmp) return mr_err_set(e, MR_ERANGE, "%s: path too long", path);
  for (size_t i = 0; i < w->n; i++)
    if (!w->t[i].data && !fill)
      return mr_err_set(e, MR_EINVAL, "%s: tensor \"%s\" has no data and no fill function", path,
                        w->t[i].name);
  rc = st_writer_layout(w, &order, &hdr, &data_len);
  if (rc) return mr_err_set(e, rc, "%s: out of memory rendering the header", path);
  if (hdr.len > MR__ST_MAX_HEADER) {
    rc = mr_err_set(e, MR_ERANGE, "%s: header of %zu bytes exceeds the limit of %llu", path,
                    hdr.len, (unsigned long long)MR__ST_MAX_HEADER);
    goto out_free;
  }
  o.cap = MR__ST_FILL_CHUNK;
  o.buf = mr_malloc(o.cap);
  if (!o.buf) {
    rc = mr_err_set(e, MR_ENOMEM, "%s: out of memory for the write buffer", path);
    goto out_free;
  }
  o.fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (o.fd < 0) {
    rc = mr_err_set(e, MR_EIO, "%s: cannot create: %s", tmp, strerror(errno));
    goto out_free;
  }
  o.path = tmp;
  uint8_t len8[8];
  for (int i = 0; i < 8; i++) len8[i] = (uint8_t)((uint64_t)hdr.len >> (8 * i));
  rc = st_out_put(&o, len8, 8, e);
  if (!rc) rc = st_out_put(&o, hdr.s, hdr.len, e);
  for (size_t i = 0; !rc && i < w->n; i++) {
    st_wtensor *t = order[i];
    if (t->data) {
      rc = st_out_put(&o, t->data, t->nbytes, e);
      continue;
    }
    /* Lazy tensor: fill() writes straight into the output buffer, whole elements at a
     * time, so nothing bigger than the buffer is ever held. */
    size_t es = t->f8 ? 1 : mr_dtype_size(t->dt);
    uint64_t off = 0;
    while (!rc && off < t->nbytes) {
      size_t room = (o.cap - o.used) / es * es;
      if (room == 0) {
        rc = st_out_flush(&o, e);
        continue;
      }
      uint64_t left = t->nbytes - off;
      size_t k = left < room ? (size_t)left : room;
      rc = fill(ctx, t->index, off, k, o.buf + o.used);
      if (rc) {
        mr_err_set(e, rc, "%s: filling tensor \"%s\" at byte %llu failed: %s", path, t->name,
                   (unsigned long long)off, mr_strerror(rc));
        break;
      }
      o.used += k;
      off += k;
    }
  }
  if (!rc) rc = st_out_flush(&o, e);
  if (!rc && fsync(o.fd) != 0) rc = mr_err_set(e, MR_EIO, "%s: fsync: %s", tmp, strerror(errno));
  if (close(o.fd) != 0 && !rc) rc = mr_err_set(e, MR_EIO, "%s: close: %s", tmp, strerror(errno));
  o.fd = -1;
  if (!rc && rename(tmp, path) != 0)
    rc = mr_err_set(e, MR_EIO, "%s: rename from %s: %s", path, tmp, strerror(errno));
  if (rc) {
    unlink(tmp);
    goto out_free;
  }
  /* Make the rename itself durable; failing to sync a directory is not worth failing the
   * write for (some file systems refuse it). */
  char dir[4096];
  snprintf(dir, sizeof dir, "%s", path);
  char *slash = strrchr(dir, '/');
  if (slash) *(slash == dir ? slash + 1 : slash) = '\0';
  else snprintf(dir, sizeof dir, ".");
  int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    (void)fsync(dfd);
    close(dfd);
  }
out_free:
  if (o.fd >= 0) {
    close(o.fd);
    unlink(tmp);
  }
  mr_free(o.buf);
  mr_free(order);
  mr_free(hdr.s);
  return rc;
}

int mr_st_writer_write(mr_st_writer *w, const char *path, mr_err *e) {
  return mr__st_writer_write_fill(w, path, NULL, NULL, e);
}
