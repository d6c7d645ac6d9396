/*
 * es_cache.c - the packed-weight cache (--weight-cache DIR, docs/DESIGN.md section 23).
 *
 * What this process serves, packed (format, ISA layout, NUMA split), is written once into
 * DIR so that the next start maps it instead of converting. DIR holds:
 *
 *   manifest.json          the one file that makes the rest usable: written last
 *                          (tmp, fsync, rename: mr_file_write_atomic, then the directory
 *                          fsynced), so a crash while writing leaves the old manifest or none
 *   w<ID>.n<s>.bin         segment ID, slice s: the packed block of slice s
 *                          (kn_layer_slice_bytes) of each pair of the segment, in (layer,
 *                          expert) order, back to back. Every block is a multiple of
 *                          KN_PACK_ALIGN bytes, so each starts aligned in the mapping.
 *
 *   manifest: {"version", "layout_version", "model_fingerprint", "model_files", "format", "isa",
 *              "pack_align", "hidden", "inter", "num_layers", "num_experts",
 *              "slices": [{"off", "len", "bytes"}...],
 *              "segments": [{"id", "pairs": {"<layer>": "<id set>", ...},
 *                            "files": [{"name", "bytes", "crc32"}...]}...]}
 *
 * Segment 0..n: the start-up write makes one segment of every owned pair; each LoadExperts
 * that packed pairs from the model appends a segment of those (a cache is extended, never
 * rewritten for a load). A start uses the cache only if every field of the identity is
 * this server's and every owned pair is in a segment; then each file is mapped read-only
 * (MAP_PRIVATE, MADV_HUGEPAGE), its size checked against the manifest, the pairs adopted
 * by their layers (kn_layer_adopt_expert: no copy), and the pages faulted in by the
 * workers of the slice's node (kn_engine_populate). The CRC-32 (zlib) of every file is
 * checked before readiness with --verify-cache, else after it on the thread es-cache.
 *
 * Threads: the loader thread attaches (before anyone else sees s->cache); es-cache writes
 * the start-up segment or verifies the mapped ones after readiness; es-ctl-load adopts
 * from and extends the cache. cache->lock guards the segment list and serialises writers;
 * it is taken before ctl_lock where both are held (es__cache_extend reads the table
 * through es__tab_get, which takes tab_lock only).
 *
 * MOERPC_TEST_CACHE_WRITE_DELAY_MS (tests only): sleeps that long after each expert block
 * written, so that a test can kill the server in the middle of a write.
 */
#define _GNU_SOURCE /* pthread_setname_np */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <zlib.h>

#include "expert_server/internal.h"

/* Version of the manifest's own format. */
#define ES_CACHE_VERSION 1u
#define ES_CACHE_MANIFEST "manifest.json"
#define ES_CACHE_MAX_SEGMENTS 4096u
/* Most NUMA slices per expert (the kernels' KN_MAX_NODES). */
#define ES_CACHE_MAX_SLICES 64u
typedef struct es_cache es_cache;
/* Pieces of a checksum: zlib takes an unsigned int length; pieces also bound how long the
 * background check runs before it looks at the stop flag. */
#define ES_CACHE_CRC_PIECE ((uint64_t)16 << 20)

typedef struct es_cache_seg {
  uint64_t id;
  uint8_t *pairs;                     /* [num_layers * num_experts]: 1 = in this segment */
  uint64_t n_pairs;
  uint64_t *pos;                      /* [num_layers * num_experts]: block index of a pair */
  char name[ES_CACHE_MAX_SLICES][64];        /* file of slice s (empty for an empty slice) */
  uint64_t bytes[ES_CACHE_MAX_SLICES];
  uint32_t crc[ES_CACHE_MAX_SLICES];
  char *map[ES_CACHE_MAX_SLICES];            /* MAP_PRIVATE read-only mapping, or NULL */
  bool verified;                      /* checksums known good (checked or written by us) */
} es_cache_seg;

struct es_cache {
  char *dir;
  pthread_mutex_t lock;               /* segs, n_segs, writers (see the top) */
  es_cache_seg *segs;                 /* the manifest's segments, in its order */
  uint32_t n_segs;
  es_cache_seg *old;                  /* replaced segments, still mapped until close */
  uint32_t n_old;
  /* The identity this server needs (from its first layer). */
  uint32_t n_slices;
  uint32_t slice_off[ES_CACHE_MAX_SLICES], slice_len[ES_CACHE_MAX_SLICES];
  uint64_t slice_bytes[ES_CACHE_MAX_SLICES];
  char isa[16];
  bool identity_set;
  /* After the start-up load (loader thread, then read by es-cache). */
  bool hit;                           /* the owned pairs come from the cache */
  bool write_needed;                  /* a miss: es-cache writes the start-up segment */
  uint32_t write_delay_ms;            /* MOERPC_TEST_CACHE_WRITE_DELAY_MS */
  pthread_t thread;
  bool thread_started;
  atomic_bool stop;
};

/* ---- small helpers ---------------------------------------------------------------------------- */

static void es__seg_unmap(es_cache_seg *g) {
  for (uint32_t s = 0; s < ES_CACHE_MAX_SLICES; s++)
    if (g->map[s]) {
      munmap(g->map[s], g->bytes[s]);
      g->map[s] = NULL;
    }
}

static void es__seg_free(es_cache_seg *g) {
  es__seg_unmap(g);
  mr_free(g->pairs);
  mr_free(g->pos);
  g->pairs = NULL;
  g->pos = NULL;
}

static void es__segs_free(es_cache_seg *segs, uint32_t n) {
  for (uint32_t i = 0; i < n; i++) es__seg_free(&segs[i]);
  mr_free(segs);
}

/* Block positions of g's pairs, in (layer, expert) order. */
static void es__seg_index(es_cache_seg *g, uint64_t n) {
  uint64_t k = 0;
  for (uint64_t i = 0; i < n; i++) g->pos[i] = g->pairs[i] ? k++ : UINT64_MAX;
  g->n_pairs = k;
}

static void es__path(const es_cache *c, const char *name, char *buf, size_t len) {
  snprintf(buf, len, "%s/%s", c->dir, name);
}

static int es__fsync_dir(const char *dir) {
  int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return -1;
  int rc = fsync(fd);
  close(fd);
  return rc;
}

/* The identity of this server's packed layout, from its first owned layer. */
static void es__cache_identity(es_server *s) {
  es_cache *c = s->cache;
  if (c->identity_set) return;
  for (uint32_t l = 0; l < s->cfg.num_layers; l++) {
    const kn_layer *L = s->layers[l];
    if (!L) continue;
    c->n_slices = kn_layer_slices(L);
    for (uint32_t i = 0; i < c->n_slices; i++) {
      c->slice_off[i] = kn_layer_slice_off(L, i);
      c->slice_len[i] = kn_layer_slice_len(L, i);
      c->slice_bytes[i] = kn_layer_slice_bytes(L, i);
    }
    snprintf(c->isa, sizeof c->isa, "%s", kn_isa_name(kn_engine_isa(s->eng, s->format)));
    c->identity_set = true;
    return;
  }
}

/* Progress of a background check: one log line every 10 s at most. */
typedef struct es_crc_progress {
  uint64_t done, total, t0_ns, last_ns;
} es_crc_progress;

/* CRC-32 (zlib) of n bytes; pieces of ES_CACHE_CRC_PIECE, stopping early (returning false)
 * when stop becomes true; counting into prog (may be NULL). */
static bool es__crc(const char *p, uint64_t n, atomic_bool *stop, es_crc_progress *prog, uint32_t *out) {
  uLong crc = crc32(0L, Z_NULL, 0);
  for (uint64_t off = 0; off < n; off += ES_CACHE_CRC_PIECE) {
    if (stop && atomic_load(stop)) return false;
    uint64_t k = n - off < ES_CACHE_CRC_PIECE ? n - off : ES_CACHE_CRC_PIECE;
    crc = crc32(crc, (const Bytef *)p + off, (uInt)k);
    if (!prog) continue;
    prog->done += k;
    uint64_t now = mr_now_ns();
    if (now - prog->last_ns >= 10000000000ull) {
      prog->last_ns = now;
      double sec = (double)(now - prog->t0_ns) / 1e9, gbs = sec > 0 ? prog->done / sec / 1e9 : 0;
      mr_log(MR_LOG_INFO, "weight cache: checking %.2f/%.2f GB, %.2f GB/s, ETA %.0f s",
             prog->done / 1e9, prog->total / 1e9, gbs,
             gbs > 0 ? (prog->total - prog->done) / 1e9 / gbs : 0);
    }
  }
  *out = (uint32_t)crc;
  return true;
}

/* The same on the engine's workers (before readiness: nothing else runs on them). */
typedef struct es_crc_job {
  const char *p;
  uint64_t n;
  uint32_t *piece; /* [pieces] */
} es_crc_job;

static void es__crc_item(void *arg, uint32_t item, uint32_t worker) {
  (void)worker;
  es_crc_job *j = arg;
  uint64_t off = (uint64_t)item * ES_CACHE_CRC_PIECE;
  uint64_t k = j->n - off < ES_CACHE_CRC_PIECE ? j->n - off : ES_CACHE_CRC_PIECE;
  j->piece[item] = (uint32_t)crc32(crc32(0L, Z_NULL, 0), (const Bytef *)j->p + off, (uInt)k);
}

static bool es__crc_parallel(kn_engine *eng, const char *p, uint64_t n, uint32_t *out) {
  uint64_t pieces = (n + ES_CACHE_CRC_PIECE - 1) / ES_CACHE_CRC_PIECE;
  if (pieces <= 1 || pieces > UINT32_MAX) return es__crc(p, n, NULL, NULL, out);
  es_crc_job j = {.p = p, .n = n, .piece = mr_malloc(pieces * sizeof(uint32_t))};
  if (!j.piece) return es__crc(p, n, NULL, NULL, out);
  kn_engine_run(eng, (uint32_t)pieces, es__crc_item, &j);
  uLong crc = j.piece[0];
  for (uint64_t i = 1; i < pieces; i++) {
    uint64_t k = n - i * ES_CACHE_CRC_PIECE < ES_CACHE_CRC_PIECE ? n - i * ES_CACHE_CRC_PIECE
                                                                 : ES_CACHE_CRC_PIECE;
    crc = crc32_combine(crc, j.piece[i], (z_off_t)k);
  }
  mr_free(j.piece);
  *out = (uint32_t)crc;
  return true;
}

/* The model files' stamp: FNV-1a 64 of each *.safetensors / config.json file's name, size
 * and mtime (ns), summed (readdir's order does not matter). The fingerprint samples only
 * the ends of each shard (common/fingerprint.c); a checkpoint rewritten in place keeps it
 * but not its mtimes, and its cache is then refused. */
static void es__model_stamp(const es_server *s, char out[17]) {
  uint64_t sum = 0;
  DIR *d = opendir(s->model_dir);
  struct dirent *de;
  while (d && (de = readdir(d))) {
    const char *n = de->d_name;
    size_t len = strlen(n);
    if (!(len > 12 && strcmp(n + len - 12, ".safetensors") == 0) && strcmp(n, "config.json") != 0) continue;
    char path[4400];
    snprintf(path, sizeof path, "%s/%s", s->model_dir, n);
    struct stat st;
    if (stat(path, &st) != 0) continue;
    uint64_t h = 1469598103934665603ull;
    uint64_t v[3] = {(uint64_t)st.st_size, (uint64_t)st.st_mtim.tv_sec, (uint64_t)st.st_mtim.tv_nsec};
    for (size_t i = 0; i < len; i++) h = (h ^ (uint8_t)n[i]) * 1099511628211ull;
    for (int k = 0; k < 3; k++)
      for (int b = 0; b < 8; b++) h = (h ^ (uint8_t)(v[k] >> (8 * b))) * 1099511628211ull;
    sum += h;
  }
  if (d) closedir(d);
  snprintf(out, 17, "%016" PRIx64, sum);
}

/* ---- the manifest ------------------------------------------------------------------------------ */

static int es__json_u64(const cJSON *o, const char *field, uint64_t hi, uint64_t *out, const char *path,
                        mr_err *e) {
  const cJSON *it = cJSON_GetObjectItemCaseSensitive(o, field);
  if (!it) return mr_err_set(e, MR_EFORMAT, "%s: field \"%s\" is missing", path, field);
  /* A value out of its range is a malformed manifest too: one code for the caller. */
  if (mr_json_u64(it, path, field, 0, hi, out, e) == 0) return 0;
  if (e) e->code = MR_EFORMAT;
  return MR_EFORMAT;
}

static const char *es__json_str(const cJSON *o, const char *field) {
  const cJSON *it = cJSON_GetObjectItemCaseSensitive(o, field);
  return cJSON_IsString(it) ? it->valuestring : NULL;
}

/* Checks manifest text (from file path, for messages) against what w needs: MR_EMISMATCH
 * (made for another model, format, layout or owned set: e names the field), MR_EFORMAT
 * (unreadable or inconsistent), MR_ENOMEM. On success *segs_out holds the segments
 * (unmapped). Reads nothing but text: es_cache_manifest_check (fuzz_cache_manifest) and
 * es__manifest_read share it. */
static int es__manifest_parse(const es_cache_want *w, const char *text, size_t len, const char *path,
                              es_cache_seg **segs_out, uint32_t *n_out, mr_err *e) {
  const uint32_t NL = w->num_layers, E = w->num_experts;
  const uint64_t NP = (uint64_t)NL * E;
  cJSON *root = NULL;
  es_cache_seg *segs = NULL;
  uint32_t n_segs = 0;
  if (w->n_slices < 1 || w->n_slices > ES_CACHE_MAX_SLICES)
    return mr_err_set(e, MR_EINTERNAL, "%s: %u NUMA slices, at most %u", path, w->n_slices, ES_CACHE_MAX_SLICES);
  int rc = mr_json_parse_object(text, len, path, &root, e);
  if (rc) return MR_EFORMAT;
  uint64_t v;
#define MISMATCH(...) do { rc = mr_err_set(e, MR_EMISMATCH, __VA_ARGS__); goto out; } while (0)
  if ((rc = es__json_u64(root, "version", UINT32_MAX, &v, path, e))) goto out;
  if (v != ES_CACHE_VERSION) MISMATCH("%s: version = %" PRIu64 ", this server reads %u", path, v, ES_CACHE_VERSION);
  if ((rc = es__json_u64(root, "layout_version", UINT32_MAX, &v, path, e))) goto out;
  if (v != KN_PACK_LAYOUT_VERSION)
    MISMATCH("%s: layout_version = %" PRIu64 ", this server packs layout %u", path, v, KN_PACK_LAYOUT_VERSION);
  const char *fp = es__json_str(root, "model_fingerprint"), *fmt = es__json_str(root, "format"),
             *isa = es__json_str(root, "isa");
  if (!fp || strcmp(fp, w->fingerprint) != 0)
    MISMATCH("%s: model_fingerprint = %.32s, this server serves model %s", path, fp ? fp : "(none)", w->fingerprint);
  const char *mf = es__json_str(root, "model_files");
  if (!mf || strcmp(mf, w->model_stamp) != 0)
    MISMATCH("%s: model_files = %.32s, the files of %s are now %s (rewritten or copied since the "
             "cache was made: sizes and mtimes)", path, mf ? mf : "(none)", w->model_dir, w->model_stamp);
  if (!fmt || strcmp(fmt, w->format) != 0)
    MISMATCH("%s: format = %.32s, this server packs %s", path, fmt ? fmt : "(none)", w->format);
  if (!isa || strcmp(isa, w->isa) != 0)
    MISMATCH("%s: isa = %.32s, this server's %s kernels run on %s", path, isa ? isa : "(none)",
             w->format, w->isa);
  static const struct { const char *f; int which; } dims[] = {
      {"pack_align", 0}, {"hidden", 1}, {"inter", 2}, {"num_layers", 3}, {"num_experts", 4}};
  for (size_t i = 0; i < sizeof dims / sizeof dims[0]; i++) {
    uint64_t want = dims[i].which == 0 ? 64u : dims[i].which == 1 ? w->hidden
                    : dims[i].which == 2 ? w->inter : dims[i].which == 3 ? NL : E;
    if ((rc = es__json_u64(root, dims[i].f, UINT32_MAX, &v, path, e))) goto out;
    if (v != want) MISMATCH("%s: %s = %" PRIu64 ", this server has %" PRIu64, path, dims[i].f, v, want);
  }
  const cJSON *sl = cJSON_GetObjectItemCaseSensitive(root, "slices");
  if (!cJSON_IsArray(sl)) {
    rc = mr_err_set(e, MR_EFORMAT, "%s: field \"slices\" must be an array", path);
    goto out;
  }
  if ((uint32_t)cJSON_GetArraySize(sl) != w->n_slices)
    MISMATCH("%s: slices: %d NUMA slice(s) per expert, this server splits into %u (--numa): the "
             "split differs", path, cJSON_GetArraySize(sl), w->n_slices);
  for (uint32_t i = 0; i < w->n_slices; i++) {
    const cJSON *o = cJSON_GetArrayItem(sl, (int)i);
    uint64_t off, ln, by;
    if ((rc = es__json_u64(o, "off", UINT32_MAX, &off, path, e)) ||
        (rc = es__json_u64(o, "len", UINT32_MAX, &ln, path, e)) ||
        (rc = es__json_u64(o, "bytes", UINT64_MAX >> 11, &by, path, e)))
      goto out;
    if (off != w->slice_off[i] || ln != w->slice_len[i] || by != w->slice_bytes[i])
      MISMATCH("%s: slices[%u] = rows %" PRIu64 "+%" PRIu64 " in %" PRIu64 " bytes, this server's "
               "slice %u is rows %u+%u in %" PRIu64 " bytes", path, i, off, ln, by, i,
               w->slice_off[i], w->slice_len[i], w->slice_bytes[i]);
  }
  const cJSON *sg = cJSON_GetObjectItemCaseSensitive(root, "segments");
  if (!cJSON_IsArray(sg) || cJSON_GetArraySize(sg) < 1 || cJSON_GetArraySize(sg) > (int)ES_CACHE_MAX_SEGMENTS) {
    rc = mr_err_set(e, MR_EFORMAT, "%s: field \"segments\" must be an array of 1..%u", path, ES_CACHE_MAX_SEGMENTS);
    goto out;
  }
  n_segs = (uint32_t)cJSON_GetArraySize(sg);
  segs = mr_calloc(n_segs, sizeof *segs);
  if (!segs) {
    rc = mr_err_set(e, MR_ENOMEM, "%s: out of memory", path);
    goto out;
  }
  for (uint32_t k = 0; k < n_segs; k++) {
    const cJSON *o = cJSON_GetArrayItem(sg, (int)k);
    es_cache_seg *g = &segs[k];
    g->pairs = mr_calloc(NP, 1);
    g->pos = mr_calloc(NP, sizeof *g->pos);
    if (!g->pairs || !g->pos) {
      rc = mr_err_set(e, MR_ENOMEM, "%s: out of memory", path);
      goto out;
    }
    if ((rc = es__json_u64(o, "id", UINT32_MAX, &g->id, path, e))) goto out;
    const cJSON *pr = cJSON_GetObjectItemCaseSensitive(o, "pairs"), *it;
    if (!cJSON_IsObject(pr)) {
      rc = mr_err_set(e, MR_EFORMAT, "%s: segments[%u].pairs must be an object", path, k);
      goto out;
    }
    cJSON_ArrayForEach(it, pr) {
      char *end = NULL;
      unsigned long l = strtoul(it->string, &end, 10);
      if (!cJSON_IsString(it) || *end || l >= NL) {
        rc = mr_err_set(e, MR_EFORMAT, "%s: segments[%u].pairs: key \"%.20s\" must be a layer "
                        "below %u with an id set", path, k, it->string, NL);
        goto out;
      }
      mr_idset set;
      if ((rc = mr_idset_parse(&set, it->valuestring, E, "segments[].pairs", e))) {
        mr_err_prefix(e, MR_EFORMAT, "%s", path);
        rc = MR_EFORMAT;
        goto out;
      }
      for (uint32_t x = 0; x < E; x++)
        if (mr_idset_has(&set, x)) g->pairs[(uint64_t)l * E + x] = 1;
      mr_idset_close(&set);
    }
    es__seg_index(g, NP);
    const cJSON *fl = cJSON_GetObjectItemCaseSensitive(o, "files");
    if (!cJSON_IsArray(fl) || (uint32_t)cJSON_GetArraySize(fl) != w->n_slices) {
      rc = mr_err_set(e, MR_EFORMAT, "%s: segments[%u].files must list %u file(s)", path, k, w->n_slices);
      goto out;
    }
    for (uint32_t i = 0; i < w->n_slices; i++) {
      const cJSON *f = cJSON_GetArrayItem(fl, (int)i);
      const char *name = es__json_str(f, "name");
      uint64_t crc;
      if ((rc = es__json_u64(f, "bytes", UINT64_MAX >> 11, &g->bytes[i], path, e)) ||
          (rc = es__json_u64(f, "crc32", UINT32_MAX, &crc, path, e)))
        goto out;
      if (!name || !name[0] || strlen(name) >= sizeof g->name[i] || strchr(name, '/') || name[0] == '.') {
        rc = mr_err_set(e, MR_EFORMAT, "%s: segments[%u].files[%u].name must be a plain file name "
                        "of at most %zu bytes", path, k, i, sizeof g->name[i] - 1);
        goto out;
      }
      snprintf(g->name[i], sizeof g->name[i], "%s", name);
      g->crc[i] = (uint32_t)crc;
      if (g->bytes[i] != g->n_pairs * w->slice_bytes[i]) {
        rc = mr_err_set(e, MR_EFORMAT, "%s: segments[%u].files[%u].bytes = %" PRIu64 ", its %" PRIu64
                        " pairs need %" PRIu64, path, k, i, g->bytes[i], g->n_pairs,
                        g->n_pairs * w->slice_bytes[i]);
        goto out;
      }
    }
  }
#undef MISMATCH
  rc = 0;
out:
  cJSON_Delete(root);
  if (rc) {
    es__segs_free(segs, n_segs);
    return rc;
  }
  *segs_out = segs;
  *n_out = n_segs;
  return 0;
}


/* Reads DIR/manifest.json and checks it against this server: MR_ENOTFOUND (none), else as
 * es__manifest_parse. */
static int es__manifest_read(es_server *s, es_cache_seg **segs_out, uint32_t *n_out, mr_err *e) {
  es_cache *c = s->cache;
  char path[4200], *text = NULL, stamp[17];
  size_t len = 0;
  es__path(c, ES_CACHE_MANIFEST, path, sizeof path);
  int rc = mr_file_read(path, MR_JSON_MAX_BYTES, &text, &len, e);
  if (rc) return rc == MR_ENOTFOUND ? mr_err_set(e, MR_ENOTFOUND, "%s: no manifest", path) : rc;
  es__model_stamp(s, stamp);
  es_cache_want w = {.fingerprint = s->fingerprint, .model_stamp = stamp, .model_dir = s->model_dir,
                     .format = s->weight_format, .isa = c->isa, .hidden = s->cfg.hidden_size,
                     .inter = s->cfg.moe_intermediate, .num_layers = s->cfg.num_layers,
                     .num_experts = s->cfg.num_experts, .n_slices = c->n_slices,
                     .slice_off = c->slice_off, .slice_len = c->slice_len, .slice_bytes = c->slice_bytes};
  rc = es__manifest_parse(&w, text, len, path, segs_out, n_out, e);
  mr_free(text);
  return rc;
}

int es_cache_manifest_check(const es_cache_want *w, const char *text, size_t len, const char *path,
                            uint32_t *n_segs, mr_err *e) {
  es_cache_seg *segs = NULL;
  uint32_t n = 0;
  int rc = es__manifest_parse(w, text, len, path, &segs, &n, e);
  if (rc == 0) {
    *n_segs = n;
    es__segs_free(segs, n);
  }
  return rc;
}

/* Writes the manifest of segs (atomically, then fsyncs the directory). */
static int es__manifest_write(es_server *s, const es_cache_seg *segs, uint32_t n_segs, mr_err *e) {
  es_cache *c = s->cache;
  const uint32_t NL = s->cfg.num_layers, E = s->cfg.num_experts;
  cJSON *root = cJSON_CreateObject();
  char *buf = mr_malloc((size_t)E * 8 + 16);
  int rc = 0;
  if (!root || !buf) {
    rc = mr_err_set(e, MR_ENOMEM, "weight cache: out of memory for the manifest");
    goto out;
  }
  cJSON_AddNumberToObject(root, "version", ES_CACHE_VERSION);
  cJSON_AddNumberToObject(root, "layout_version", KN_PACK_LAYOUT_VERSION);
  cJSON_AddStringToObject(root, "model_fingerprint", s->fingerprint);
  char stamp[17];
  es__model_stamp(s, stamp);
  cJSON_AddStringToObject(root, "model_files", stamp);
  cJSON_AddStringToObject(root, "format", s->weight_format);
  cJSON_AddStringToObject(root, "isa", c->isa);
  cJSON_AddNumberToObject(root, "pack_align", 64);
  cJSON_AddNumberToObject(root, "hidden", s->cfg.hidden_size);
  cJSON_AddNumberToObject(root, "inter", s->cfg.moe_intermediate);
  cJSON_AddNumberToObject(root, "num_layers", NL);
  cJSON_AddNumberToObject(root, "num_experts", E);
  cJSON *sl = cJSON_AddArrayToObject(root, "slices");
  for (uint32_t i = 0; sl && i < c->n_slices; i++) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "off", c->slice_off[i]);
    cJSON_AddNumberToObject(o, "len", c->slice_len[i]);
    cJSON_AddNumberToObject(o, "bytes", (double)c->slice_bytes[i]);
    cJSON_AddItemToArray(sl, o);
  }
  cJSON *sg = cJSON_AddArrayToObject(root, "segments");
  for (uint32_t k = 0; sg && k < n_segs; k++) {
    const es_cache_seg *g = &segs[k];
    cJSON *o = cJSON_CreateObject(), *pr = cJSON_CreateObject(), *fl = cJSON_CreateArray();
    cJSON_AddNumberToObject(o, "id", (double)g->id);
    for (uint32_t l = 0; l < NL; l++) {
      mr_idlist w;
      mr_idlist_init(&w, buf, (size_t)E * 8 + 16);
      uint32_t n = 0;
      for (uint32_t x = 0; x < E; x++)
        if (g->pairs[(uint64_t)l * E + x]) {
          mr_idlist_add(&w, x);
          n++;
        }
      mr_idlist_end(&w, false);
      char key[16];
      snprintf(key, sizeof key, "%u", l);
      if (n) cJSON_AddStringToObject(pr, key, buf);
    }
    cJSON_AddItemToObject(o, "pairs", pr);
    for (uint32_t i = 0; i < c->n_slices; i++) {
      cJSON *f = cJSON_CreateObject();
      cJSON_AddStringToObject(f, "name", g->name[i]);
      cJSON_AddNumberToObject(f, "bytes", (double)g->bytes[i]);
      cJSON_AddNumberToObject(f, "crc32", g->crc[i]);
      cJSON_AddItemToArray(fl, f);
    }
    cJSON_AddItemToObject(o, "files", fl);
    cJSON_AddItemToArray(sg, o);
  }
  char *text = cJSON_Print(root);
  if (!text) {
    rc = mr_err_set(e, MR_ENOMEM, "weight cache: out of memory for the manifest");
    goto out;
  }
  char path[4200];
  es__path(c, ES_CACHE_MANIFEST, path, sizeof path);
  rc = mr_file_write_atomic(path, text, strlen(text), e);
  cJSON_free(text);
  if (!rc && es__fsync_dir(c->dir) != 0)
    rc = mr_err_set(e, MR_EIO, "weight cache %s: fsync of the directory: %s", c->dir, strerror(errno));
out:
  cJSON_Delete(root);
  mr_free(buf);
  return rc;
}

/* Removes the data files and temporaries of DIR that no segment of segs names. */
static void es__cache_sweep(const es_cache *c, const es_cache_seg *segs, uint32_t n_segs) {
  DIR *d = opendir(c->dir);
  if (!d) return;
  struct dirent *de;
  while ((de = readdir(d))) {
    const char *n = de->d_name;
    size_t len = strlen(n);
    bool ours = n[0] == 'w' && ((len > 4 && strcmp(n + len - 4, ".bin") == 0) || strstr(n, ".bin.tmp"));
    if (!ours) continue;
    bool used = false;
    for (uint32_t k = 0; k < n_segs && !used; k++)
      for (uint32_t i = 0; i < c->n_slices && !used; i++) used = strcmp(segs[k].name[i], n) == 0;
    if (used) continue;
    char path[4200];
    es__path(c, n, path, sizeof path);
    unlink(path);
  }
  closedir(d);
}

/* Maps the files of g (read-only, private), checking each size against the manifest. */
static int es__seg_map(const es_cache *c, es_cache_seg *g, mr_err *e) {
  for (uint32_t i = 0; i < c->n_slices; i++) {
    if (!g->bytes[i]) continue;
    char path[4200];
    es__path(c, g->name[i], path, sizeof path);
    int fd;
    uint64_t size;
    int rc = mr_file_open_regular(path, &fd, &size, e);
    if (rc) return rc;
    if (size != g->bytes[i]) {
      close(fd);
      return mr_err_set(e, MR_EFORMAT, "%s is %" PRIu64 " bytes, the manifest says %" PRIu64
                        " (truncated or replaced)", path, size, g->bytes[i]);
    }
    void *p = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (p == MAP_FAILED) return mr_err_set(e, MR_EIO, "%s: mmap of %" PRIu64 " bytes: %s", path, size, strerror(errno));
#ifdef MADV_HUGEPAGE
    (void)madvise(p, size, MADV_HUGEPAGE); /* where the kernel gives them (file THP) */
#endif
    g->map[i] = p;
  }
  return 0;
}

/* Checks g's files against their checksums; the first mismatch in e. eng != NULL: on the
 * engine's workers (before readiness), else on the calling thread, stopping (true) at
 * cache->stop. */
static int es__seg_verify(const es_cache *c, es_cache_seg *g, kn_engine *eng, atomic_bool *stop,
                          es_crc_progress *prog, mr_err *e) {
  for (uint32_t i = 0; i < c->n_slices; i++) {
    if (!g->map[i]) continue;
    uint32_t crc;
    if (eng) es__crc_parallel(eng, g->map[i], g->bytes[i], &crc);
    else if (!es__crc(g->map[i], g->bytes[i], stop, prog, &crc)) return 0;
    if (crc != g->crc[i])
      return mr_err_set(e, MR_EFORMAT, "%s/%s: crc32 %08" PRIx32 ", the manifest says %08" PRIx32
                        " (corrupt)", c->dir, g->name[i], crc, g->crc[i]);
  }
  g->verified = true;
  return 0;
}

/* ---- writing ------------------------------------------------------------------------------------ */

/* Writes a segment of the pairs set in want[] from tab's layers into DIR (one file per
 * slice, tmp + fsync + rename), appends it to the cache's segments (mapped) and writes the
 * manifest of all of them (replace: only this one). cache->lock held. */
static int es__seg_write(es_server *s, es_table *tab, const uint8_t *want, bool replace, mr_err *e) {
  es_cache *c = s->cache;
  const uint32_t NL = s->cfg.num_layers, E = s->cfg.num_experts;
  const uint64_t NP = (uint64_t)NL * E;
  const uint64_t t0 = mr_now_ns();
  es_cache_seg g;
  memset(&g, 0, sizeof g);
  g.pairs = mr_calloc(NP, 1);
  g.pos = mr_calloc(NP, sizeof *g.pos);
  int rc = 0, fd = -1;
  char tmp[4300] = "", path[4200];
  if (!g.pairs || !g.pos) {
    rc = mr_err_set(e, MR_ENOMEM, "weight cache: out of memory");
    goto out;
  }
  for (uint64_t i = 0; i < NP; i++)
    g.pairs[i] = want[i] && tab->layers[i / E] && kn_layer_has_expert(tab->layers[i / E], (uint32_t)(i % E));
  es__seg_index(&g, NP);
  if (!g.n_pairs) goto out;
  for (uint32_t k = 0; k < c->n_segs; k++)
    if (c->segs[k].id >= g.id) g.id = c->segs[k].id + 1;
  if (replace) g.id = (mr_now_ns() / 1000) & 0xffffffffu; /* fresh names: nothing to clash with */
  uint64_t total = 0, done = 0, last_log = t0;
  for (uint32_t i = 0; i < c->n_slices; i++) total += g.n_pairs * c->slice_bytes[i];
  for (uint32_t i = 0; i < c->n_slices; i++) {
    if (!c->slice_bytes[i]) continue;
    snprintf(g.name[i], sizeof g.name[i], "w%" PRIu64 ".n%u.bin", g.id, i);
    es__path(c, g.name[i], path, sizeof path);
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) {
      rc = mr_err_set(e, MR_EIO, "weight cache: %s: %s", tmp, strerror(errno));
      goto out;
    }
    uLong crc = crc32(0L, Z_NULL, 0);
    for (uint64_t p = 0; p < NP; p++) {
      if (!g.pairs[p]) continue;
      const char *blk = kn_layer_expert_slice(tab->layers[p / E], (uint32_t)(p % E), i);
      MR_ASSERT(blk);
      for (uint64_t off = 0; off < c->slice_bytes[i];) {
        ssize_t w = write(fd, blk + off, c->slice_bytes[i] - off);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) {
          rc = mr_err_set(e, MR_EIO, "weight cache: writing %s: %s", tmp, w < 0 ? strerror(errno) : "no progress");
          goto out;
        }
        off += (uint64_t)w;
      }
      crc = crc32(crc, (const Bytef *)blk, (uInt)c->slice_bytes[i]);
      g.bytes[i] += c->slice_bytes[i];
      done += c->slice_bytes[i];
      uint64_t now = mr_now_ns();
      if (now - last_log >= 1000000000ull) {
        last_log = now;
        mr_log(MR_LOG_INFO, "weight cache: writing %.2f/%.2f GB", done / 1e9, total / 1e9);
      }
      for (uint32_t slept = 0; slept < c->write_delay_ms && !atomic_load(&c->stop); slept += 5) usleep(5000);
      if (atomic_load(&c->stop)) {
        rc = mr_err_set(e, MR_ECANCELED, "weight cache: write stopped by the shutdown");
        goto out;
      }
    }
    g.crc[i] = (uint32_t)crc;
    if (fsync(fd) != 0) {
      rc = mr_err_set(e, MR_EIO, "weight cache: fsync %s: %s", tmp, strerror(errno));
      goto out;
    }
    close(fd);
    fd = -1;
    if (rename(tmp, path) != 0) {
      rc = mr_err_set(e, MR_EIO, "weight cache: rename %s: %s", tmp, strerror(errno));
      goto out;
    }
    tmp[0] = '\0';
  }
  if (es__fsync_dir(c->dir) != 0) {
    rc = mr_err_set(e, MR_EIO, "weight cache %s: fsync of the directory: %s", c->dir, strerror(errno));
    goto out;
  }
  /* The new list: the old segments (unless replaced) and g, mapped for later adoption. */
  g.verified = true;
  if ((rc = es__seg_map(c, &g, e))) goto out;
  uint32_t keep = replace ? 0 : c->n_segs;
  es_cache_seg *segs = mr_calloc(keep + 1, sizeof *segs);
  if (!segs) {
    rc = mr_err_set(e, MR_ENOMEM, "weight cache: out of memory");
    goto out;
  }
  if (keep) memcpy(segs, c->segs, keep * sizeof *segs);
  segs[keep] = g;
  if ((rc = es__manifest_write(s, segs, keep + 1, e))) {
    mr_free(segs);
    goto out;
  }
  memset(&g, 0, sizeof g); /* now segs[keep]'s */
  if (replace && c->n_segs) {
    /* Replaced segments leave the list but stay mapped (layers may still borrow from them)
     * until es__cache_close. */
    es_cache_seg *old = mr_realloc(c->old, (c->n_old + c->n_segs) * sizeof *old);
    if (old) {
      memcpy(old + c->n_old, c->segs, c->n_segs * sizeof *old);
      c->old = old;
      c->n_old += c->n_segs;
    } else {
      for (uint32_t k = 0; k < c->n_segs; k++) es__seg_free(&c->segs[k]); /* cannot happen in practice */
    }
  }
  mr_free(c->segs);
  c->segs = segs;
  c->n_segs = keep + 1;
  const es_cache_seg *ng = &c->segs[c->n_segs - 1];
  es__cache_sweep(c, c->segs, c->n_segs);
  mr_log(MR_LOG_INFO, "weight cache: written %s: segment %" PRIu64 ", %" PRIu64 " pairs, %.3f GB "
         "in %.2f s (%u file(s), manifest last)", c->dir, ng->id, ng->n_pairs, total / 1e9,
         (double)(mr_now_ns() - t0) / 1e9, c->n_slices);
out:
  if (fd >= 0) close(fd);
  if (tmp[0]) unlink(tmp);
  es__seg_free(&g);
  return rc;
}

/* ---- the calls of the other files ---------------------------------------------------------------- */

int es__cache_new(es_server *s, const char *dir, mr_err *e) {
  if (!dir) return 0;
  if (mkdir(dir, 0755) != 0 && errno != EEXIST)
    return mr_err_set(e, MR_EINVAL, "--weight-cache %s: cannot create the directory: %s", dir, strerror(errno));
  struct stat st;
  if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode))
    return mr_err_set(e, MR_EINVAL, "--weight-cache %s: not a directory", dir);
  if (access(dir, W_OK | X_OK) != 0)
    return mr_err_set(e, MR_EINVAL, "--weight-cache %s: not writable: %s", dir, strerror(errno));
  es_cache *c = mr_calloc(1, sizeof *c);
  if (!c || !(c->dir = mr_strdup(dir))) {
    mr_free(c);
    return mr_err_set(e, MR_ENOMEM, "--weight-cache: out of memory");
  }
  pthread_mutex_init(&c->lock, NULL);
  const char *delay = getenv("MOERPC_TEST_CACHE_WRITE_DELAY_MS");
  if (delay && delay[0]) {
    c->write_delay_ms = (uint32_t)strtoul(delay, NULL, 10);
    if (c->write_delay_ms > 60000) c->write_delay_ms = 60000;
    mr_log(MR_LOG_WARN, "MOERPC_TEST_CACHE_WRITE_DELAY_MS=%" PRIu32 ": cache writing slowed down "
           "for a test", c->write_delay_ms);
  }
  s->cache = c;
  return 0;
}

bool es__cache_attach(es_server *s) {
  es_cache *c = s->cache;
  if (!c) return false;
  es__cache_identity(s);
  const uint64_t t0 = mr_now_ns();
  const uint32_t NL = s->cfg.num_layers, E = s->cfg.num_experts;
  mr_err e;
  mr_err_clear(&e);
  es_cache_seg *segs = NULL;
  uint32_t n = 0;
  int rc = es__manifest_read(s, &segs, &n, &e);
  const char *kind = rc == MR_ENOTFOUND ? "miss" : rc == MR_EMISMATCH ? "refused (made for another server)"
                     : "corrupt";
  /* Every owned pair must be in a segment (the first that has it). */
  uint32_t *which = NULL;
  if (!rc && !(which = mr_malloc((size_t)NL * E * sizeof *which)))
    rc = mr_err_set(&e, MR_ENOMEM, "out of memory");
  for (uint32_t l = 0; !rc && l < NL; l++) {
    if (!s->layers[l]) continue;
    for (uint32_t x = 0; !rc && x < E; x++) {
      if (!mr_idset_has(&s->owned_experts, x)) continue;
      uint32_t k = 0;
      while (k < n && !segs[k].pairs[(uint64_t)l * E + x]) k++;
      if (k == n) kind = "refused (made for another server)";
      if (k == n)
        rc = mr_err_set(&e, MR_EMISMATCH, "owned set: layer %" PRIu32 " expert %" PRIu32 " is not "
                        "in the cache (it holds %u segment(s) of other pairs)", l, x, n);
      which[(uint64_t)l * E + x] = k;
    }
  }
  for (uint32_t k = 0; !rc && k < n; k++) {
    rc = es__seg_map(c, &segs[k], &e);
    if (rc) kind = "corrupt";
  }
  uint64_t bytes = 0;
  for (uint32_t k = 0; !rc && k < n; k++)
    for (uint32_t i = 0; i < c->n_slices; i++) bytes += segs[k].bytes[i];
  if (!rc && s->opts.verify_cache) {
    const uint64_t tv = mr_now_ns();
    for (uint32_t k = 0; !rc && k < n; k++) rc = es__seg_verify(c, &segs[k], s->eng, NULL, NULL, &e);
    if (rc) kind = "corrupt";
    else
      mr_log(MR_LOG_INFO, "weight cache: verified %u segment(s), %.3f GB in %.2f s (--verify-cache)",
             n, bytes / 1e9, (double)(mr_now_ns() - tv) / 1e9);
  }
  /* Adopt: no copy, the layers borrow the mapped blocks. */
  for (uint32_t l = 0; !rc && l < NL; l++) {
    if (!s->layers[l]) continue;
    for (uint32_t x = 0; !rc && x < E; x++) {
      if (!mr_idset_has(&s->owned_experts, x)) continue;
      es_cache_seg *g = &segs[which[(uint64_t)l * E + x]];
      uint64_t b = g->pos[(uint64_t)l * E + x];
      void *mem[ES_CACHE_MAX_SLICES];
      for (uint32_t i = 0; i < c->n_slices; i++) mem[i] = g->map[i] ? g->map[i] + b * c->slice_bytes[i] : NULL;
      rc = kn_layer_adopt_expert(s->layers[l], x, mem, &e);
      s->n_experts_loaded++;
    }
  }
  mr_free(which);
  if (rc) {
    /* A miss: nothing of the cache is used; the layers are emptied and packed as usual. */
    for (uint32_t l = 0; l < NL; l++) {
      if (!s->layers[l]) continue;
      kn_layer *fresh = NULL;
      mr_err e2;
      if (kn_layer_new(&fresh, s->eng, kn_layer_get_desc(s->layers[l]), &e2) == 0) {
        kn_layer_free(s->layers[l]);
        s->layers[l] = fresh;
      }
    }
    s->n_experts_loaded = 0;
    es__segs_free(segs, n);
    mr_log(strcmp(kind, "corrupt") == 0 ? MR_LOG_WARN : MR_LOG_INFO, "weight cache: %s: %s; packing from the model, "
           "the cache is rewritten once serving", kind, e.msg);
    c->write_needed = true;
    return false;
  }
  /* Fault the pages in, each slice's file by its node's workers. */
  const uint64_t tp = mr_now_ns();
  uint64_t populated = 0;
  for (uint32_t k = 0; k < n; k++) {
    const void *base[ES_CACHE_MAX_SLICES];
    for (uint32_t i = 0; i < c->n_slices; i++) base[i] = segs[k].map[i];
    populated += kn_engine_populate(s->eng, base, segs[k].bytes, c->n_slices);
  }
  c->segs = segs;
  c->n_segs = n;
  c->hit = true;
  atomic_store(&s->load_tensors_done, s->load_tensors_total);
  atomic_store(&s->load_bytes_done, s->load_bytes_total);
  for (uint32_t l = 0; l < NL; l++)
    if (s->layers[l]) s->weight_bytes += kn_layer_bytes(s->layers[l]);
  mr_log(MR_LOG_INFO, "weight cache: hit %s: %u experts mapped from %u segment(s), %.3f GB in "
         "%.3f s (faulted in %.3f GB in %.3f s); checksums %s", c->dir, s->n_experts_loaded, n,
         bytes / 1e9, (double)(mr_now_ns() - t0) / 1e9, populated / 1e9,
         (double)(mr_now_ns() - tp) / 1e9,
         s->opts.verify_cache ? "verified" : "verified in the background once serving");
  return true;
}

bool es__cache_adopt(es_server *s, kn_layer *L, uint32_t layer, uint32_t x) {
  es_cache *c = s->cache;
  if (!c || !c->identity_set || kn_layer_slices(L) != c->n_slices) return false;
  const uint64_t p = (uint64_t)layer * s->cfg.num_experts + x;
  bool ok = false;
  /* Never wait for a write or a background check (tens of seconds on a large cache): a
   * load meanwhile packs from the model instead. */
  if (pthread_mutex_trylock(&c->lock) != 0) return false;
  for (uint32_t k = c->n_segs; k-- > 0 && !ok;) {
    es_cache_seg *g = &c->segs[k];
    if (!g->pairs[p]) continue;
    void *mem[ES_CACHE_MAX_SLICES];
    bool mapped = true;
    for (uint32_t i = 0; i < c->n_slices; i++) {
      mem[i] = g->map[i] ? g->map[i] + g->pos[p] * c->slice_bytes[i] : NULL;
      if (c->slice_bytes[i] && !mem[i]) mapped = false;
    }
    mr_err e;
    ok = mapped && g->verified && kn_layer_adopt_expert(L, x, mem, &e) == 0;
  }
  pthread_mutex_unlock(&c->lock);
  return ok;
}

void es__cache_extend(es_server *s, const uint8_t *want) {
  es_cache *c = s->cache;
  if (!c || !c->identity_set) return;
  const uint64_t NP = (uint64_t)s->cfg.num_layers * s->cfg.num_experts;
  pthread_mutex_lock(&c->lock);
  uint8_t *add = mr_malloc(NP);
  if (add) {
    /* Only pairs no segment holds yet. */
    for (uint64_t p = 0; p < NP; p++) {
      add[p] = want[p];
      for (uint32_t k = 0; k < c->n_segs && add[p]; k++) add[p] = !c->segs[k].pairs[p];
    }
    es_table *t = es__tab_get(s);
    mr_err e;
    mr_err_clear(&e);
    int rc = es__seg_write(s, t, add, c->n_segs == 0, &e);
    es__tab_put(t);
    if (rc) mr_log(MR_LOG_WARN, "weight cache: extending it after a load failed: %s (the cache "
                   "stays as it was)", e.msg);
  }
  mr_free(add);
  pthread_mutex_unlock(&c->lock);
}

/* es-cache after a corrupt file: the server stops serving the weights mapped from the
 * cache, repacks every owned pair from the model, serves again and writes a fresh cache. */
static void es__cache_repair(es_server *s, const mr_err *why) {
  es_cache *c = s->cache;
  mr_log(MR_LOG_ERROR, "weight cache: %s: the weights mapped from it are not served from now on "
         "(readiness NOT_SERVING, Forward UNAVAILABLE); repacking every owned pair from the model",
         why->msg);
  es__tab_mark_bad(s);
  char path[4200];
  es__path(c, ES_CACHE_MANIFEST, path, sizeof path);
  unlink(path); /* never used again, by this process or the next */
  es__fsync_dir(c->dir);
  mr_err e;
  mr_err_clear(&e);
  const uint64_t t0 = mr_now_ns();
  int rc = s->cache_repack(s, &e); /* es__control_repack_all */
  if (rc) {
    mr_log(MR_LOG_ERROR, "weight cache: repacking failed: %s; the server stays NOT_SERVING", e.msg);
    return;
  }
  mr_log(MR_LOG_INFO, "weight cache: repacked from the model in %.1f s; serving again",
         (double)(mr_now_ns() - t0) / 1e9);
  es__tab_serve_again(s);
  pthread_mutex_lock(&c->lock);
  es_table *t = es__tab_get(s);
  uint8_t *all = mr_malloc((uint64_t)s->cfg.num_layers * s->cfg.num_experts);
  if (all) {
    memset(all, 1, (uint64_t)s->cfg.num_layers * s->cfg.num_experts);
    rc = es__seg_write(s, t, all, true, &e);
    if (rc) mr_log(MR_LOG_WARN, "weight cache: rewriting it failed: %s", e.msg);
  }
  mr_free(all);
  es__tab_put(t);
  pthread_mutex_unlock(&c->lock);
}

static void *es__cache_main(void *arg) {
  es_server *s = arg;
  es_cache *c = s->cache;
  pthread_setname_np(pthread_self(), "es-cache");
  mr_err e;
  mr_err_clear(&e);
  if (c->write_needed) {
    pthread_mutex_lock(&c->lock);
    es_table *t = es__tab_get(s);
    uint8_t *all = mr_malloc((uint64_t)s->cfg.num_layers * s->cfg.num_experts);
    int rc = all ? 0 : mr_err_set(&e, MR_ENOMEM, "out of memory");
    if (all) {
      memset(all, 1, (uint64_t)s->cfg.num_layers * s->cfg.num_experts);
      rc = es__seg_write(s, t, all, true, &e);
    }
    mr_free(all);
    es__tab_put(t);
    pthread_mutex_unlock(&c->lock);
    if (rc && rc != MR_ECANCELED)
      mr_log(MR_LOG_WARN, "weight cache: writing it failed: %s (the next start packs from the "
             "model again)", e.msg);
    return NULL;
  }
  if (!c->hit) return NULL;
  const uint64_t t0 = mr_now_ns();
  uint64_t bytes = 0;
  int rc = 0;
  pthread_mutex_lock(&c->lock);
  es_crc_progress prog = {.t0_ns = t0, .last_ns = t0};
  for (uint32_t k = 0; k < c->n_segs; k++)
    for (uint32_t i = 0; !c->segs[k].verified && i < c->n_slices; i++) prog.total += c->segs[k].bytes[i];
  for (uint32_t k = 0; k < c->n_segs && !rc && !atomic_load(&c->stop); k++) {
    if (c->segs[k].verified) continue;
    rc = es__seg_verify(c, &c->segs[k], NULL, &c->stop, &prog, &e);
    for (uint32_t i = 0; i < c->n_slices; i++) bytes += c->segs[k].bytes[i];
  }
  pthread_mutex_unlock(&c->lock);
  if (atomic_load(&c->stop)) return NULL;
  if (rc) {
    es__cache_repair(s, &e);
    return NULL;
  }
  if (bytes)
    mr_log(MR_LOG_INFO, "weight cache: verified in the background: %.3f GB in %.2f s, all "
           "checksums match", bytes / 1e9, (double)(mr_now_ns() - t0) / 1e9);
  return NULL;
}

void es__cache_start(es_server *s) {
  es_cache *c = s->cache;
  if (!c || (!c->write_needed && !c->hit)) return;
  if (pthread_create(&c->thread, NULL, es__cache_main, s) == 0) c->thread_started = true;
  else mr_log(MR_LOG_WARN, "weight cache: cannot start the thread es-cache: nothing is written or verified");
}

void es__cache_stop(es_server *s) {
  es_cache *c = s->cache;
  if (!c) return;
  atomic_store(&c->stop, true);
  atomic_store(&s->load_abort, true); /* a repack stops after its expert */
  if (c->thread_started) pthread_join(c->thread, NULL);
  c->thread_started = false;
}

void es__cache_close(es_server *s) {
  es_cache *c = s->cache;
  if (!c) return;
  es__cache_stop(s);
  es__segs_free(c->segs, c->n_segs);
  es__segs_free(c->old, c->n_old);
  pthread_mutex_destroy(&c->lock);
  mr_free(c->dir);
  mr_free(c);
  s->cache = NULL;
}
