/*
 * common/fingerprint.c - a model's identity, compared between servers and clients.
 *
 * Every server of one model reports the same fingerprint in HelloReply, and the client
 * refuses a cluster whose servers disagree: a server started on a different checkpoint
 * would otherwise return plausible-looking garbage. The hash is FNV-1a 64 over, in order:
 *
 *   "moerpc-fp1"                                   version tag of this recipe
 *   len64 + bytes of config.json                    (len64 = 0 and no bytes if absent)
 *   for each shard, sorted by file name:
 *     len64 + bytes of the file name (not the directory: servers mount models anywhere)
 *     u64 file size
 *     len64 + bytes of the JSON header
 *     the first and the last 4 KiB of the data region (all of it if smaller)
 *
 * Each variable-length part is preceded by its length so that moving bytes between parts
 * cannot collide. It is an identity check against mistakes, not a security measure: a
 * changed weight in the middle of a shard goes unnoticed, and FNV is not collision
 * resistant. Reading the whole model (hundreds of GB) at every start-up would be too slow.
 */
#include "common/internal.h"

#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#define FP_SAMPLE 4096u

typedef struct fp_hash {
  uint64_t h;
} fp_hash;

static void fp_bytes(fp_hash *f, const void *p, size_t n) {
  const uint8_t *b = p;
  uint64_t h = f->h;
  for (size_t i = 0; i < n; i++) {
    h ^= b[i];
    h *= 0x100000001b3ull; /* FNV-1a 64 prime */
  }
  f->h = h;
}

static void fp_u64(fp_hash *f, uint64_t v) {
  uint8_t b[8];
  for (int i = 0; i < 8; i++) b[i] = (uint8_t)(v >> (8 * i));
  fp_bytes(f, b, 8);
}

static void fp_part(fp_hash *f, const void *p, size_t n) {
  fp_u64(f, n);
  fp_bytes(f, p, n);
}

int mr_model_fingerprint(const char *model_dir, const mr_st *st, char out[17], mr_err *e) {
  int rc = 0;
  mr_st *own = NULL;
  char *cfg = NULL;
  size_t cfg_len = 0;
  char path[4096];
  out[0] = '\0';

  if (!st) {
    rc = mr_st_open(&own, model_dir, e);
    if (rc) return rc;
    st = own;
  }
  /* config.json sits next to the weights; a single-file model given by its file path has
   * its directory's config.json, if any. */
  struct stat sb;
  const char *dir = model_dir;
  char dirbuf[4096];
  if (stat(model_dir, &sb) == 0 && !S_ISDIR(sb.st_mode)) {
    snprintf(dirbuf, sizeof dirbuf, "%s", model_dir);
    char *slash = strrchr(dirbuf, '/');
    if (slash) *slash = '\0';
    else snprintf(dirbuf, sizeof dirbuf, ".");
    dir = dirbuf;
  }
  if (mr__path_join(path, sizeof path, dir, "config.json") != 0) {
    rc = mr_err_set(e, MR_ERANGE, "%s: path too long", dir);
    goto out_close;
  }
  if (stat(path, &sb) == 0) {
    rc = mr_file_read(path, MR_JSON_MAX_BYTES, &cfg, &cfg_len, e);
    if (rc) goto out_close;
  }

  fp_hash f = {0xcbf29ce484222325ull}; /* FNV-1a 64 offset basis */
  static const char tag[] = "moerpc-fp1";
  fp_bytes(&f, tag, sizeof tag - 1);
  fp_part(&f, cfg ? cfg : "", cfg_len);
  size_t ns = mr__st_shard_count(st);
  for (size_t i = 0; i < ns; i++) {
    mr__st_shard_view v;
    mr__st_shard_get(st, i, &v);
    fp_part(&f, v.base, strlen(v.base));
    fp_u64(&f, v.file_size);
    fp_part(&f, v.header, (size_t)v.header_len);
    if (v.data_len <= 2 * FP_SAMPLE) {
      fp_part(&f, v.data, (size_t)v.data_len);
    } else {
      fp_part(&f, v.data, FP_SAMPLE);
      fp_part(&f, v.data + v.data_len - FP_SAMPLE, FP_SAMPLE);
    }
  }
  snprintf(out, 17, "%016llx", (unsigned long long)f.h);

out_close:
  mr_free(cfg);
  mr_st_close(own);
  return rc;
}
