/*
 * test_safetensors.c - the safetensors reader and writer, and the model fingerprint:
 * round trips, each kind of malformed file (checking the code AND that the message names
 * the file/tensor/field), sharded models, and allocation failure at every step.
 */
#include "common/internal.h"
#include "tests/unit/mt.h"

#include <fcntl.h>
#include <sys/stat.h>

/* ---- temp dir helpers (each test runs in its own process; atexit cleans up even when an
 * assert fails, since MT__FAIL exits) ------------------------------------------------- */

static char tdir[256];

static void tdir_cleanup(void) {
  if (!tdir[0]) return;
  char cmd[300];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", tdir);
  if (system(cmd) != 0) fprintf(stderr, "cleanup of %s failed\n", tdir);
  tdir[0] = '\0';
}

static const char *tdir_make(void) {
  snprintf(tdir, sizeof tdir, "/tmp/mr-test-st-XXXXXX");
  MT_TRUE(mkdtemp(tdir) != NULL);
  mt_defer(tdir_cleanup);
  return tdir;
}

static const char *tpath(const char *name) {
  static char p[4][512];
  static int k;
  k = (k + 1) % 4;
  snprintf(p[k], sizeof p[k], "%s/%s", tdir, name);
  return p[k];
}

static void write_bytes(const char *path, const void *buf, size_t n) {
  FILE *f = fopen(path, "wb");
  MT_TRUE(f != NULL);
  MT_EQ_U64(fwrite(buf, 1, n, f), n);
  MT_EQ_INT(fclose(f), 0);
}

/* Builds a safetensors image: u64 header length, header text, then data_len bytes where
 * byte i = i & 0xff. Caller frees. */
static uint8_t *make_image(const char *header, uint64_t declared_len, size_t data_len,
                           size_t *total) {
  size_t hl = strlen(header);
  *total = 8 + hl + data_len;
  uint8_t *b = malloc(*total);
  MT_TRUE(b != NULL);
  for (int i = 0; i < 8; i++) b[i] = (uint8_t)(declared_len >> (8 * i));
  memcpy(b + 8, header, hl);
  for (size_t i = 0; i < data_len; i++) b[8 + hl + i] = (uint8_t)i;
  return b;
}

/* Parses header + data_len bytes from memory; returns the code and fills e. */
static int parse_hdr(const char *header, size_t data_len, mr_err *e) {
  size_t n;
  uint8_t *b = make_image(header, strlen(header), data_len, &n);
  mr_st *st = NULL;
  mr_err_clear(e);
  int rc = mr_st_parse_buffer(&st, b, n, "mem.safetensors", e);
  if (rc == 0) MT_TRUE(st != NULL);
  else MT_TRUE(st == NULL);
  mr_st_close(st);
  free(b);
  return rc;
}

static void write_st(const char *path, const char *header, size_t data_len) {
  size_t n;
  uint8_t *b = make_image(header, strlen(header), data_len, &n);
  write_bytes(path, b, n);
  free(b);
}

/* ---- reader: good files --------------------------------------------------------------- */

MT_TEST(parse_good_buffer) {
  const char *h =
      "{\"__metadata__\":{\"format\":\"pt\"},"
      "\"b\":{\"dtype\":\"BF16\",\"shape\":[2,3],\"data_offsets\":[16,28]},"
      "\"a\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]},"
      "\"ids\":{\"dtype\":\"I64\",\"shape\":[1],\"data_offsets\":[28,36]},"
      "\"empty\":{\"dtype\":\"F16\",\"shape\":[0,5],\"data_offsets\":[36,36]},"
      "\"scalar\":{\"dtype\":\"F16\",\"shape\":[],\"data_offsets\":[36,38]}}";
  size_t n;
  uint8_t *b = make_image(h, strlen(h), 38, &n);
  mr_st *st = NULL;
  mr_err e = {0};
  MT_OK(mr_st_parse_buffer(&st, b, n, "mem", &e), &e);
  MT_EQ_U64(mr_st_count(st), 5);
  /* Sorted by name. */
  MT_EQ_STR(mr_st_at(st, 0)->name, "a");
  MT_EQ_STR(mr_st_at(st, 1)->name, "b");
  MT_TRUE(mr_st_at(st, 5) == NULL);
  const mr_st_tensor *t = mr_st_find(st, "b");
  MT_TRUE(t != NULL);
  MT_EQ_INT(t->dtype, MR_DTYPE_BF16);
  MT_EQ_STR(t->dtype_name, "BF16");
  MT_EQ_INT(t->ndim, 2);
  MT_EQ_U64(t->shape[0], 2);
  MT_EQ_U64(t->shape[1], 3);
  MT_EQ_U64(t->nbytes, 12);
  MT_TRUE((const uint8_t *)t->data == b + 8 + strlen(h) + 16);
  MT_EQ_INT(((const uint8_t *)t->data)[0], 16);
  t = mr_st_find(st, "ids");
  MT_EQ_INT(t->dtype, MR_DTYPE_UNSPECIFIED);
  MT_EQ_STR(t->dtype_name, "I64");
  MT_EQ_U64(mr_st_find(st, "empty")->nbytes, 0);
  MT_EQ_INT(mr_st_find(st, "scalar")->ndim, 0);
  MT_EQ_U64(mr_st_find(st, "scalar")->nbytes, 2);
  MT_TRUE(mr_st_find(st, "c") == NULL);
  MT_TRUE(mr_st_find(st, "") == NULL);
  mr_st_close(st);
  free(b);
}

MT_TEST(parse_allows_trailing_spaces_and_gaps) {
  mr_err e;
  /* HF pads the header with spaces; gaps between tensors are tolerated. */
  MT_OK(parse_hdr("{\"a\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[4,6]}}      ", 8,
                  &e),
        &e);
  MT_OK(parse_hdr("{}", 0, &e), &e);
}

/* ---- reader: malformed files ---------------------------------------------------------- */

MT_TEST(truncated_file) {
  uint8_t b[5] = {1, 0, 0, 0, 0};
  mr_st *st = NULL;
  mr_err e = {0};
  MT_EQ_INT(mr_st_parse_buffer(&st, b, sizeof b, "short.safetensors", &e), MR_EFORMAT);
  MT_CONTAINS(e.msg, "short.safetensors");
  MT_CONTAINS(e.msg, "5 bytes");
  MT_EQ_INT(mr_st_parse_buffer(&st, b, 0, "empty.safetensors", &e), MR_EFORMAT);
  MT_CONTAINS(e.msg, "0 bytes");
}

MT_TEST(header_length_past_eof) {
  const char *h = "{}";
  size_t n;
  uint8_t *b = make_image(h, 1000, 0, &n);
  mr_st *st = NULL;
  mr_err e = {0};
  MT_EQ_INT(mr_st_parse_buffer(&st, b, n, "x.safetensors", &e), MR_EFORMAT);
  MT_CONTAINS(e.msg, "header length = 1000");
  MT_CONTAINS(e.msg, "past the end");
  free(b);
  b = make_image(h, (uint64_t)1 << 40, 0, &n);
  MT_EQ_INT(mr_st_parse_buffer(&st, b, n, "x.safetensors", &e), MR_EFORMAT);
  MT_CONTAINS(e.msg, "exceeds the limit");
  free(b);
  b = make_image(h, UINT64_MAX, 0, &n);
  MT_EQ_INT(mr_st_parse_buffer(&st, b, n, "x.safetensors", &e), MR_EFORMAT);
  free(b);
}

MT_TEST(bad_json) {
  mr_err e;
  MT_EQ_INT(parse_hdr("{\"a\":{\"dtype\":", 0, &e), MR_EFORMAT);
  MT_CONTAINS(e.msg, "mem.safetensors: header");
  MT_CONTAINS(e.msg, "invalid JSON");
  MT_EQ_INT(parse_hdr("", 0, &e), MR_EFORMAT);
  MT_EQ_INT(parse_hdr("{} x", 0, &e), MR_EFORMAT);
  MT_CONTAINS(e.msg, "trailing data");
  MT_EQ_INT(parse_hdr("[1,2]", 0, &e), MR_EFORMAT);
  MT_CONTAINS(e.msg, "must be a JSON object");
  MT_EQ_INT(parse_hdr("{\"a\":5}", 0, &e), MR_EFORMAT);
  MT_CONTAINS(e.msg, "tensor \"a\"");
  MT_EQ_INT(parse_hdr("{\"__metadata__\":{\"format\":1}}", 0, &e), MR_EFORMAT);
  MT_CONTAINS(e.msg, "__metadata__");
}

MT_TEST(bad_dtype) {
  mr_err e;
  MT_EQ_INT(parse_hdr("{\"w\":{\"dtype\":\"Q4_K\",\"shape\":[2],\"data_offsets\":[0,2]}}", 2, &e),
            MR_EFORMAT);
  MT_CONTAINS(e.msg, "tensor \"w\"");
  MT_CONTAINS(e.msg, "dtype = \"Q4_K\"");
  MT_EQ_INT(parse_hdr("{\"w\":{\"dtype\":7,\"shape\":[2],\"data_offsets\":[0,2]}}", 2, &e),
            MR_EFORMAT);
  MT_CONTAINS(e.msg, "dtype = 7");
  MT_EQ_INT(parse_hdr("{\"w\":{\"shape\":[2],\"data_offsets\":[0,2]}}", 2, &e), MR_EFORMAT);
  MT_CONTAINS(e.msg, "dtype = (missing)");
}

MT_TEST(bad_shape) {
  mr_err e;
  MT_EQ_INT(parse_hdr("{\"w\":{\"dtype\":\"U8\",\"shape\":[-1],\"data_offsets\":[0,0]}}", 0, &e),
            MR_ERANGE);
  MT_CONTAINS(e.msg, "tensor \"w\": shape[0] = -1");
  MT_EQ_INT(parse_hdr("{\"w\":{\"dtype\":\"U8\",\"shape\":[1.5],\"data_offsets\":[0,0]}}", 0, &e),
            MR_ERANGE);
  MT_EQ_INT(parse_hdr("{\"w\":{\"dtype\":\"U8\",\"shape\":[\"2\"],\"data_offsets\":[0,2]}}", 2, &e),
            MR_EFORMAT);
  MT_CONTAINS(e.msg, "shape[0]");
  MT_EQ_INT(parse_hdr("{\"w\":{\"dtype\":\"U8\",\"shape\":3,\"data_offsets\":[0,3]}}", 3, &e),
            MR_EFORMAT);
  MT_CONTAINS(e.msg, "shape = 3");
  MT_EQ_INT(parse_hdr("{\"w\":{\"dtype\":\"U8\",\"shape\":[1,1,1,1,1,1,1,1,1],"
                      "\"data_offsets\":[0,1]}}",
                      1, &e),
            MR_ERANGE);
  MT_CONTAINS(e.msg, "9 dimensions");
  /* 2^40 * 2^40 elements overflow 64 bits. */
  MT_EQ_INT(parse_hdr("{\"w\":{\"dtype\":\"F32\",\"shape\":[1099511627776,1099511627776],"
                      "\"data_offsets\":[0,0]}}",
                      0, &e),
            MR_ERANGE);
  MT_CONTAINS(e.msg, "overflows");
  /* 2^62 elements of 4 bytes overflow too (in the byte count). */
  MT_EQ_INT(parse_hdr("{\"w\":{\"dtype\":\"F32\",\"shape\":[2147483648,2147483648],"
                      "\"data_offsets\":[0,0]}}",
                      0, &e),
            MR_ERANGE);
  /* Beyond 2^53 a double is not exact: refused rather than misread. */
  MT_EQ_INT(parse_hdr("{\"w\":{\"dtype\":\"U8\",\"shape\":[18014398509481985],"
                      "\"data_offsets\":[0,0]}}",
                      0, &e),
            MR_ERANGE);
  /* A zero dimension makes the tensor empty whatever the others. */
  MT_OK(parse_hdr("{\"w\":{\"dtype\":\"F32\",\"shape\":[0,4503599627370496,4503599627370496],"
                  "\"data_offsets\":[0,0]}}",
                  0, &e),
        &e);
}

MT_TEST(shape_offset_mismatch) {
  mr_err e;
  MT_EQ_INT(parse_hdr("{\"w\":{\"dtype\":\"BF16\",\"shape\":[2,3],\"data_offsets\":[0,10]}}", 12,
                      &e),
            MR_EFORMAT);
  MT_CONTAINS(e.msg, "tensor \"w\"");
  MT_CONTAINS(e.msg, "[0, 10] hold 10 bytes");
  MT_CONTAINS(e.msg, "needs 12");
  MT_EQ_INT(parse_hdr("{\"w\":{\"dtype\":\"BF16\",\"shape\":[2],\"data_offsets\":[0]}}", 4, &e),
            MR_EFORMAT);
  MT_CONTAINS(e.msg, "data_offsets");
  MT_EQ_INT(parse_hdr("{\"w\":{\"dtype\":\"BF16\",\"shape\":[2],\"data_offsets\":[4,0]}}", 4, &e),
            MR_EFORMAT);
  MT_CONTAINS(e.msg, "begin > end");
  MT_EQ_INT(parse_hdr("{\"w\":{\"dtype\":\"F4\",\"shape\":[3],\"data_offsets\":[0,2]}}", 4, &e),
            MR_EFORMAT);
  MT_CONTAINS(e.msg, "whole number of bytes");
}

MT_TEST(offsets_past_eof) {
  mr_err e;
  MT_EQ_INT(parse_hdr("{\"w\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[8,24]}}", 16, &e),
            MR_EFORMAT);
  MT_CONTAINS(e.msg, "tensor \"w\"");
  MT_CONTAINS(e.msg, "[8, 24] run past the end of the data region (16 bytes)");
  MT_EQ_INT(parse_hdr("{\"w\":{\"dtype\":\"U8\",\"shape\":[0],"
                      "\"data_offsets\":[1000000,1000000]}}",
                      16, &e),
            MR_EFORMAT);
}

MT_TEST(overlapping_tensors) {
  mr_err e;
  MT_EQ_INT(parse_hdr("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                      "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}",
                      12, &e),
            MR_EFORMAT);
  MT_CONTAINS(e.msg, "overlaps");
  MT_CONTAINS(e.msg, "\"a\"");
  MT_CONTAINS(e.msg, "\"b\"");
  /* Same range twice. */
  MT_EQ_INT(parse_hdr("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                      "\"b\":{\"dtype\":\"U8\",\"shape\":[8],\"data_offsets\":[0,8]}}",
                      8, &e),
            MR_EFORMAT);
  /* Touching is fine, and an empty tensor inside another owns no bytes. */
  MT_OK(parse_hdr("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                  "\"z\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[4,4]},"
                  "\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,12]}}",
                  12, &e),
        &e);
}

MT_TEST(duplicate_name_in_header) {
  mr_err e;
  MT_EQ_INT(parse_hdr("{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},"
                      "\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[1,2]}}",
                      2, &e),
            MR_EFORMAT);
  MT_CONTAINS(e.msg, "tensor \"a\" appears twice");
}

/* ---- files, directories and shards --------------------------------------------------- */

MT_TEST(open_file_and_dir) {
  tdir_make();
  write_st(tpath("model.safetensors"),
           "{\"x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8);
  mr_st *st = NULL;
  mr_err e = {0};
  MT_OK(mr_st_open(&st, tdir, &e), &e);
  MT_EQ_U64(mr_st_count(st), 1);
  MT_CONTAINS(mr_st_find(st, "x")->file, "model.safetensors");
  mr_st_close(st);
  MT_OK(mr_st_open(&st, tpath("model.safetensors"), &e), &e);
  mr_st_close(st);

  MT_EQ_INT(mr_st_open(&st, tpath("nope"), &e), MR_ENOTFOUND);
  MT_CONTAINS(e.msg, "nope");
  MT_TRUE(st == NULL);
  mkdir(tpath("emptydir"), 0755);
  MT_EQ_INT(mr_st_open(&st, tpath("emptydir"), &e), MR_ENOTFOUND);
  MT_CONTAINS(e.msg, "neither model.safetensors.index.json nor model.safetensors");
  write_bytes(tpath("tiny.safetensors"), "\x02\0\0", 3);
  MT_EQ_INT(mr_st_open(&st, tpath("tiny.safetensors"), &e), MR_EFORMAT);
  MT_CONTAINS(e.msg, "tiny.safetensors");
  write_bytes(tpath("zero.safetensors"), "", 0);
  MT_EQ_INT(mr_st_open(&st, tpath("zero.safetensors"), &e), MR_EFORMAT);
  MT_CONTAINS(e.msg, "zero.safetensors");
}

static void write_index(const char *body) { write_bytes(tpath("model.safetensors.index.json"), body, strlen(body)); }

static void make_two_shards(void) {
  write_st(tpath("model-00001-of-00002.safetensors"),
           "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
           "\"b\":{\"dtype\":\"BF16\",\"shape\":[2,2],\"data_offsets\":[8,16]}}",
           16);
  write_st(tpath("model-00002-of-00002.safetensors"),
           "{\"c\":{\"dtype\":\"F16\",\"shape\":[3],\"data_offsets\":[0,6]}}", 6);
}

MT_TEST(sharded_good) {
  tdir_make();
  make_two_shards();
  write_index("{\"metadata\":{\"total_size\":22},\"weight_map\":{"
              "\"c\":\"model-00002-of-00002.safetensors\","
              "\"a\":\"model-00001-of-00002.safetensors\","
              "\"b\":\"model-00001-of-00002.safetensors\"}}");
  mr_st *st = NULL;
  mr_err e = {0};
  MT_OK(mr_st_open(&st, tdir, &e), &e);
  MT_EQ_U64(mr_st_count(st), 3);
  MT_CONTAINS(mr_st_find(st, "c")->file, "model-00002-of-00002.safetensors");
  MT_CONTAINS(mr_st_find(st, "a")->file, "model-00001-of-00002.safetensors");
  MT_EQ_U64(mr__st_shard_count(st), 2);
  mr__st_shard_view v;
  mr__st_shard_get(st, 0, &v);
  MT_EQ_STR(v.base, "model-00001-of-00002.safetensors");
  MT_EQ_U64(v.data_len, 16);
  /* The index wins over a stale model.safetensors next to it. */
  const uint64_t shp[1] = {3};
  const mr_st_tensor *t = NULL;
  MT_OK(mr_st_expect(st, "c", 1, shp, &t, &e), &e);
  MT_EQ_INT(t->dtype, MR_DTYPE_F16);
  mr_st_close(st);
}

MT_TEST(sharded_missing_shard) {
  tdir_make();
  make_two_shards();
  write_index("{\"weight_map\":{\"a\":\"model-00001-of-00002.safetensors\","
              "\"x\":\"model-00003-of-00002.safetensors\"}}");
  mr_st *st = NULL;
  mr_err e = {0};
  MT_EQ_INT(mr_st_open(&st, tdir, &e), MR_ENOTFOUND);
  MT_CONTAINS(e.msg, "model.safetensors.index.json");
  MT_CONTAINS(e.msg, "model-00003-of-00002.safetensors");
}

MT_TEST(sharded_index_errors) {
  tdir_make();
  make_two_shards();
  mr_st *st = NULL;
  mr_err e = {0};
  /* A tensor the named shard does not have. */
  write_index("{\"weight_map\":{\"a\":\"model-00001-of-00002.safetensors\","
              "\"zz\":\"model-00002-of-00002.safetensors\"}}");
  MT_EQ_INT(mr_st_open(&st, tdir, &e), MR_ENOTFOUND);
  MT_CONTAINS(e.msg, "\"zz\"");
  MT_CONTAINS(e.msg, "model-00002-of-00002.safetensors");
  /* A tensor in the other shard than the index says. */
  write_index("{\"weight_map\":{\"a\":\"model-00002-of-00002.safetensors\","
              "\"c\":\"model-00002-of-00002.safetensors\"}}");
  MT_EQ_INT(mr_st_open(&st, tdir, &e), MR_ENOTFOUND);
  write_index("{\"weight_map\":{\"a\":\"model-00002-of-00002.safetensors\","
              "\"c\":\"model-00001-of-00002.safetensors\"}}");
  MT_EQ_INT(mr_st_open(&st, tdir, &e), MR_EFORMAT);
  MT_CONTAINS(e.msg, "weight_map puts tensor \"a\" in shard \"model-00002-of-00002.safetensors\", but it is in \"model-00001-of-00002.safetensors\"");
  /* Paths out of the directory. */
  write_index("{\"weight_map\":{\"a\":\"../model-00001-of-00002.safetensors\"}}");
  MT_EQ_INT(mr_st_open(&st, tdir, &e), MR_EFORMAT);
  MT_CONTAINS(e.msg, "weight_map[\"a\"]");
  write_index("{\"weight_map\":{\"a\":\"/etc/passwd\"}}");
  MT_EQ_INT(mr_st_open(&st, tdir, &e), MR_EFORMAT);
  /* Structure. */
  write_index("{\"weight_map\":[]}");
  MT_EQ_INT(mr_st_open(&st, tdir, &e), MR_EFORMAT);
  MT_CONTAINS(e.msg, "weight_map = an array");
  write_index("{\"weight_map\":{}}");
  MT_EQ_INT(mr_st_open(&st, tdir, &e), MR_EFORMAT);
  MT_CONTAINS(e.msg, "weight_map is empty");
  write_index("{\"weight_map\":{\"a\":5}}");
  MT_EQ_INT(mr_st_open(&st, tdir, &e), MR_EFORMAT);
  write_index("{\"weight_map\"");
  MT_EQ_INT(mr_st_open(&st, tdir, &e), MR_EFORMAT);
  MT_CONTAINS(e.msg, "invalid JSON");
  MT_TRUE(st == NULL);
}

MT_TEST(sharded_duplicate_across_shards) {
  tdir_make();
  write_st(tpath("s1.safetensors"), "{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}",
           1);
  write_st(tpath("s2.safetensors"), "{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}",
           1);
  write_index("{\"weight_map\":{\"a\":\"s1.safetensors\",\"b\":\"s2.safetensors\"}}");
  mr_st *st = NULL;
  mr_err e = {0};
  MT_EQ_INT(mr_st_open(&st, tdir, &e), MR_EFORMAT);
  MT_CONTAINS(e.msg, "duplicate tensor \"a\"");
  MT_CONTAINS(e.msg, "s1.safetensors");
  MT_CONTAINS(e.msg, "s2.safetensors");
}

MT_TEST(sharded_bad_shard_header) {
  tdir_make();
  write_st(tpath("s1.safetensors"), "{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}",
           1);
  write_st(tpath("s2.safetensors"), "{\"b\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4]}}",
           1);
  write_index("{\"weight_map\":{\"a\":\"s1.safetensors\",\"b\":\"s2.safetensors\"}}");
  mr_st *st = NULL;
  mr_err e = {0};
  MT_EQ_INT(mr_st_open(&st, tdir, &e), MR_EFORMAT);
  MT_CONTAINS(e.msg, "s2.safetensors");
  MT_CONTAINS(e.msg, "tensor \"b\"");
}

/* ---- mr_st_expect ----------------------------------------------------------------------- */

MT_TEST(expect) {
  const char *h = "{\"w\":{\"dtype\":\"BF16\",\"shape\":[4,2],\"data_offsets\":[0,16]},"
                  "\"i\":{\"dtype\":\"I32\",\"shape\":[2],\"data_offsets\":[16,24]}}";
  size_t n;
  uint8_t *b = make_image(h, strlen(h), 24, &n);
  mr_st *st = NULL;
  mr_err e = {0};
  MT_OK(mr_st_parse_buffer(&st, b, n, "m.safetensors", &e), &e);
  const mr_st_tensor *t = NULL;
  uint64_t ok[2] = {4, 2}, bad[2] = {2, 4}, bad3[3] = {4, 2, 1};
  MT_OK(mr_st_expect(st, "w", 2, ok, &t, &e), &e);
  MT_TRUE(t == mr_st_find(st, "w"));
  MT_EQ_INT(mr_st_expect(st, "w", 2, bad, &t, &e), MR_EMISMATCH);
  MT_TRUE(t == NULL);
  MT_CONTAINS(e.msg, "m.safetensors: tensor \"w\": shape = [4, 2], expected [2, 4]");
  MT_EQ_INT(mr_st_expect(st, "w", 3, bad3, NULL, &e), MR_EMISMATCH);
  MT_CONTAINS(e.msg, "expected [4, 2, 1]");
  MT_EQ_INT(mr_st_expect(st, "model.layers.0.mlp.gate.weight", 2, ok, &t, &e), MR_ENOTFOUND);
  MT_CONTAINS(e.msg, "\"model.layers.0.mlp.gate.weight\" not found");
  uint64_t two[1] = {2};
  MT_EQ_INT(mr_st_expect(st, "i", 1, two, &t, &e), MR_EFORMAT);
  MT_CONTAINS(e.msg, "dtype = I32");
  MT_EQ_INT(mr_st_expect(st, "w", 2, ok, NULL, NULL), 0); /* NULL out and err are allowed */
  mr_st_close(st);
  free(b);
}

/* ---- writer ------------------------------------------------------------------------- */

MT_TEST(writer_roundtrip) {
  tdir_make();
  mr_st_writer *w = NULL;
  MT_OK(mr_st_writer_new(&w), (mr_err *)NULL);
  float f32[6] = {1, -2, 3.5f, 4, 5, 6};
  uint16_t bf[3] = {0x3f80, 0xc000, 0x4040};
  uint16_t h16[5] = {1, 2, 3, 4, 5};
  float scalar = 42;
  uint64_t s23[2] = {2, 3}, s3[1] = {3}, s5[1] = {5}, s0[2] = {0, 7};
  MT_OK(mr_st_writer_add(w, "z.f32", MR_DTYPE_F32, 2, s23, f32), (mr_err *)NULL);
  MT_OK(mr_st_writer_add(w, "a.bf16", MR_DTYPE_BF16, 1, s3, bf), (mr_err *)NULL);
  MT_OK(mr_st_writer_add(w, "m.f16 \"quoted\"\\", MR_DTYPE_F16, 1, s5, h16), (mr_err *)NULL);
  MT_OK(mr_st_writer_add(w, "scalar", MR_DTYPE_F32, 0, NULL, &scalar), (mr_err *)NULL);
  MT_OK(mr_st_writer_add(w, "empty", MR_DTYPE_F32, 2, s0, f32), (mr_err *)NULL);
  /* Refusals. */
  MT_EQ_INT(mr_st_writer_add(w, "a.bf16", MR_DTYPE_BF16, 1, s3, bf), MR_EINVAL);
  MT_EQ_INT(mr_st_writer_add(w, "__metadata__", MR_DTYPE_BF16, 1, s3, bf), MR_EINVAL);
  MT_EQ_INT(mr_st_writer_add(w, "q", MR_DTYPE_UNSPECIFIED, 1, s3, bf), MR_EINVAL);
  MT_EQ_INT(mr_st_writer_add(w, "q", MR_DTYPE_F32, MR_ST_MAX_DIMS + 1, s3, bf), MR_EINVAL);
  MT_EQ_INT(mr_st_writer_add(w, "q", MR_DTYPE_F32, 1, s3, NULL), MR_EINVAL);
  mr_err e = {0};
  MT_OK(mr_st_writer_write(w, tpath("out.safetensors"), &e), &e);
  uint64_t predicted = mr__st_writer_file_size(w);
  mr_st_writer_free(w);

  struct stat sb;
  MT_EQ_INT(stat(tpath("out.safetensors"), &sb), 0);
  MT_EQ_U64((uint64_t)sb.st_size, predicted);
  /* No temp file left behind. */
  char cmd[600];
  snprintf(cmd, sizeof cmd, "ls '%s' | grep -q tmp", tdir);
  MT_TRUE(system(cmd) != 0);

  mr_st *st = NULL;
  MT_OK(mr_st_open(&st, tpath("out.safetensors"), &e), &e);
  MT_EQ_U64(mr_st_count(st), 5);
  mr__st_shard_view v;
  mr__st_shard_get(st, 0, &v);
  MT_EQ_U64((8 + v.header_len) % 8, 0); /* data region 8-aligned */
  MT_EQ_INT(v.header[v.header_len - 1] == ' ' || v.header[v.header_len - 1] == '}', 1);
  const mr_st_tensor *t = mr_st_find(st, "z.f32");
  MT_EQ_INT(t->dtype, MR_DTYPE_F32);
  MT_EQ_U64(t->shape[1], 3);
  MT_EQ_INT(memcmp(t->data, f32, sizeof f32), 0);
  MT_EQ_U64((uintptr_t)t->data % 4, 0);
  t = mr_st_find(st, "a.bf16");
  MT_EQ_INT(memcmp(t->data, bf, sizeof bf), 0);
  t = mr_st_find(st, "m.f16 \"quoted\"\\");
  MT_TRUE(t != NULL);
  MT_EQ_INT(memcmp(t->data, h16, sizeof h16), 0);
  t = mr_st_find(st, "scalar");
  MT_EQ_INT(t->ndim, 0);
  MT_NEAR(*(const float *)t->data, 42.0, 0);
  MT_EQ_U64(mr_st_find(st, "empty")->nbytes, 0);
  mr_st_close(st);
}

MT_TEST(writer_overwrites_atomically_and_reports_bad_path) {
  tdir_make();
  mr_st_writer *w = NULL;
  MT_OK(mr_st_writer_new(&w), (mr_err *)NULL);
  uint8_t d[4] = {1, 2, 3, 4};
  uint64_t s2[1] = {2};
  MT_OK(mr_st_writer_add(w, "t", MR_DTYPE_BF16, 1, s2, d), (mr_err *)NULL);
  mr_err e = {0};
  MT_OK(mr_st_writer_write(w, tpath("f.safetensors"), &e), &e);
  MT_OK(mr_st_writer_write(w, tpath("f.safetensors"), &e), &e);
  MT_EQ_INT(mr_st_writer_write(w, tpath("no/such/dir/f.safetensors"), &e), MR_EIO);
  MT_CONTAINS(e.msg, "no/such/dir/f.safetensors");
  mr_st_writer_free(w);
  mr_st_writer_free(NULL);
}

typedef struct fill_ctx {
  size_t calls;
  uint64_t next[2];
} fill_ctx;

static int fill_pattern(void *ctx, size_t index, uint64_t offset, size_t n, void *dst) {
  fill_ctx *c = ctx;
  MT_TRUE(index < 2);
  MT_EQ_U64(offset, c->next[index]);
  MT_LE(n, MR__ST_FILL_CHUNK);
  for (size_t i = 0; i < n; i++) ((uint8_t *)dst)[i] = (uint8_t)((offset + i) * 7 + index);
  c->next[index] = offset + n;
  c->calls++;
  return 0;
}

static int fill_fail(void *ctx, size_t index, uint64_t offset, size_t n, void *dst) {
  return offset > 0 ? MR_EIO : fill_pattern(ctx, index, offset, n, dst);
}

MT_TEST(writer_lazy_fill) {
  tdir_make();
  mr_st_writer *w = NULL;
  MT_OK(mr_st_writer_new(&w), (mr_err *)NULL);
  /* 3M bf16 elements: 6 MB, more than one 4 MiB chunk. */
  uint64_t big[2] = {1536, 2048}, small[1] = {5};
  MT_OK(mr__st_writer_add_lazy(w, "big", MR_DTYPE_BF16, 2, big), (mr_err *)NULL);
  MT_OK(mr__st_writer_add_lazy(w, "small", MR_DTYPE_F32, 1, small), (mr_err *)NULL);
  MT_EQ_U64(mr__st_writer_count(w), 2);
  mr_err e = {0};
  MT_EQ_INT(mr_st_writer_write(w, tpath("x.safetensors"), &e), MR_EINVAL);
  MT_CONTAINS(e.msg, "no data");
  fill_ctx c = {0};
  MT_OK(mr__st_writer_write_fill(w, tpath("x.safetensors"), fill_pattern, &c, &e), &e);
  MT_TRUE(c.calls >= 3);
  mr_st *st = NULL;
  MT_OK(mr_st_open(&st, tpath("x.safetensors"), &e), &e);
  const mr_st_tensor *t = mr_st_find(st, "big");
  MT_EQ_U64(t->nbytes, 1536ull * 2048 * 2);
  const uint8_t *p = t->data;
  for (uint64_t i = 0; i < t->nbytes; i += 4099) MT_EQ_INT(p[i], (uint8_t)(i * 7));
  p = mr_st_find(st, "small")->data;
  for (uint64_t i = 0; i < 20; i++) MT_EQ_INT(p[i], (uint8_t)(i * 7 + 1));
  mr_st_close(st);
  /* A failing fill aborts the write and leaves no file. */
  fill_ctx c2 = {0};
  MT_EQ_INT(mr__st_writer_write_fill(w, tpath("y.safetensors"), fill_fail, &c2, &e), MR_EIO);
  MT_CONTAINS(e.msg, "filling tensor");
  struct stat sb;
  MT_TRUE(stat(tpath("y.safetensors"), &sb) != 0);
  mr_st_writer_free(w);
}

MT_TEST(many_tensors_lookup) {
  /* Real models have ~100k tensors; lookups must stay fast and exact. */
  enum { N = 100000 };
  mr_st_writer *w = NULL;
  MT_OK(mr_st_writer_new(&w), (mr_err *)NULL);
  uint64_t s1[1] = {1};
  for (uint32_t i = 0; i < N; i++) {
    char name[64];
    uint16_t v = (uint16_t)i;
    snprintf(name, sizeof name, "model.layers.%u.mlp.experts.%u.up_proj.weight", i / 128, i % 128);
    MT_OK(mr_st_writer_add(w, name, MR_DTYPE_BF16, 1, s1, &v), (mr_err *)NULL);
  }
  tdir_make();
  mr_err e = {0};
  MT_OK(mr_st_writer_write(w, tpath("many.safetensors"), &e), &e);
  mr_st_writer_free(w);
  mr_st *st = NULL;
  MT_OK(mr_st_open(&st, tpath("many.safetensors"), &e), &e);
  MT_EQ_U64(mr_st_count(st), N);
  uint64_t t0 = mr_now_ns();
  for (uint32_t i = 0; i < N; i++) {
    char name[64];
    snprintf(name, sizeof name, "model.layers.%u.mlp.experts.%u.up_proj.weight", i / 128, i % 128);
    const mr_st_tensor *t = mr_st_find(st, name);
    MT_TRUE(t != NULL);
    MT_EQ_INT(*(const uint16_t *)t->data, (uint16_t)i);
  }
  double ms = (double)(mr_now_ns() - t0) / 1e6;
  MT_LE(ms, 2000); /* ~20 ms expected; a linear scan would take minutes */
  MT_TRUE(mr_st_find(st, "model.layers.9999.mlp.experts.0.up_proj.weight") == NULL);
  mr_st_close(st);
}

/* ---- allocation failure --------------------------------------------------------------- */

MT_TEST(alloc_failure_every_step) {
  tdir_make();
  make_two_shards();
  write_index("{\"weight_map\":{\"a\":\"model-00001-of-00002.safetensors\","
              "\"b\":\"model-00001-of-00002.safetensors\","
              "\"c\":\"model-00002-of-00002.safetensors\"}}");
  /* Fail the n-th allocation for growing n until the open succeeds: each failure must be a
   * clean MR_ENOMEM (no crash, no leak under ASan) and success must eventually come. */
  int succeeded_at = 0;
  for (long n = 1; n < 200 && !succeeded_at; n++) {
    mr_st *st = NULL;
    mr_err e = {0};
    mr_alloc_fail_after(n);
    int rc = mr_st_open(&st, tdir, &e);
    mr_alloc_fail_after(0);
    if (rc == 0) {
      MT_EQ_U64(mr_st_count(st), 3);
      succeeded_at = (int)n;
    } else {
      MT_EQ_INT(rc, MR_ENOMEM);
      MT_TRUE(st == NULL);
    }
    mr_st_close(st);
  }
  MT_TRUE(succeeded_at > 1);
  /* The writer too. */
  for (long n = 1; n < 100; n++) {
    mr_st_writer *w = NULL;
    uint64_t s[1] = {2};
    uint16_t d[2] = {1, 2};
    mr_err e = {0};
    mr_alloc_fail_after(n);
    int rc = mr_st_writer_new(&w);
    if (!rc) rc = mr_st_writer_add(w, "a", MR_DTYPE_BF16, 1, s, d);
    if (!rc) rc = mr_st_writer_write(w, tpath("w.safetensors"), &e);
    mr_alloc_fail_after(0);
    mr_st_writer_free(w);
    if (rc == 0) break;
    MT_EQ_INT(rc, MR_ENOMEM);
  }
}

/* ---- fingerprint ----------------------------------------------------------------------- */

static void write_fp_model(const char *path, const uint16_t *data, uint64_t n) {
  mr_st_writer *w = NULL;
  mr_err e = {0};
  MT_OK(mr_st_writer_new(&w), (mr_err *)NULL);
  MT_OK(mr_st_writer_add(w, "w", MR_DTYPE_BF16, 1, &n, data), (mr_err *)NULL);
  MT_OK(mr_st_writer_write(w, path, &e), &e);
  mr_st_writer_free(w);
}

MT_TEST(fingerprint) {
  tdir_make();
  mkdir(tpath("m1"), 0755);
  mkdir(tpath("m2"), 0755);
  enum { N = 20000 }; /* 40000 bytes: more than the 2 x 4 KiB sampled */
  static uint16_t data[N];
  for (int i = 0; i < N; i++) data[i] = (uint16_t)(i * 31);
  mr_err e = {0};
  write_fp_model(tpath("m1/model.safetensors"), data, N);
  write_fp_model(tpath("m2/model.safetensors"), data, N);
  write_bytes(tpath("m1/config.json"), "{\"a\":1}", 7);
  write_bytes(tpath("m2/config.json"), "{\"a\":1}", 7);

  char f1[17], f2[17], f3[17];
  MT_OK(mr_model_fingerprint(tpath("m1"), NULL, f1, &e), &e);
  MT_EQ_INT(strlen(f1), 16);
  for (int i = 0; i < 16; i++) MT_TRUE(strchr("0123456789abcdef", f1[i]) != NULL);
  /* Same files at another path: same fingerprint; with an already open mr_st too, and
   * given the file instead of the directory. */
  mr_st *st = NULL;
  MT_OK(mr_st_open(&st, tpath("m2"), &e), &e);
  MT_OK(mr_model_fingerprint(tpath("m2"), st, f2, &e), &e);
  mr_st_close(st);
  MT_EQ_STR(f1, f2);
  MT_OK(mr_model_fingerprint(tpath("m2/model.safetensors"), NULL, f2, &e), &e);
  MT_EQ_STR(f1, f2);
  /* A different config changes it. */
  write_bytes(tpath("m2/config.json"), "{\"a\":2}", 7);
  MT_OK(mr_model_fingerprint(tpath("m2"), NULL, f3, &e), &e);
  MT_TRUE(strcmp(f1, f3) != 0);
  write_bytes(tpath("m2/config.json"), "{\"a\":1}", 7);
  /* So does a weight in the sampled head or tail of the data ... */
  data[3] ^= 1;
  write_fp_model(tpath("m2/model.safetensors"), data, N);
  MT_OK(mr_model_fingerprint(tpath("m2"), NULL, f3, &e), &e);
  MT_TRUE(strcmp(f1, f3) != 0);
  data[3] ^= 1;
  data[N - 1] ^= 1;
  write_fp_model(tpath("m2/model.safetensors"), data, N);
  MT_OK(mr_model_fingerprint(tpath("m2"), NULL, f3, &e), &e);
  MT_TRUE(strcmp(f1, f3) != 0);
  data[N - 1] ^= 1;
  /* ... but, by design, not one in the middle, which is not read. */
  data[N / 2] ^= 1;
  write_fp_model(tpath("m2/model.safetensors"), data, N);
  MT_OK(mr_model_fingerprint(tpath("m2"), NULL, f3, &e), &e);
  MT_EQ_STR(f1, f3);
  data[N / 2] ^= 1;
  /* A missing config.json is allowed and hashes as empty (differs from "{a:1}"). */
  unlink(tpath("m2/config.json"));
  MT_OK(mr_model_fingerprint(tpath("m2"), NULL, f3, &e), &e);
  MT_TRUE(strcmp(f1, f3) != 0);
  /* A missing model is an error naming it. */
  MT_EQ_INT(mr_model_fingerprint(tpath("m9"), NULL, f3, &e), MR_ENOTFOUND);
  MT_CONTAINS(e.msg, "m9");
}

/* ---- moerpc-mkmodel end to end: its output must open, match its config and shard ------ */

/* The mkmodel binary next to this test: $MOERPC_BIN (set by tests/run.sh), else
 * <dir of this binary>/../bin. */
static const char *mkmodel_path(void) {
  static char p[1024];
  const char *bin = getenv("MOERPC_BIN");
  if (bin) {
    snprintf(p, sizeof p, "%s/moerpc-mkmodel", bin);
    return p;
  }
  char self[900];
  ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  MT_TRUE(n > 0);
  self[n] = '\0';
  char *slash = strrchr(self, '/');
  MT_TRUE(slash != NULL);
  *slash = '\0';
  snprintf(p, sizeof p, "%s/../bin/moerpc-mkmodel", self);
  return p;
}

static int run_cmd(const char *fmt, const char *a, const char *b) {
  char cmd[2048];
  snprintf(cmd, sizeof cmd, fmt, a, b);
  int st = system(cmd);
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static void check_model(const char *dir, uint32_t L, uint32_t E, uint32_t H, uint32_t I) {
  mr_model_config c;
  mr_err e = {0};
  MT_OK(mr_config_load(&c, dir, &e), &e);
  MT_EQ_INT(c.arch, MR_ARCH_QWEN3_MOE);
  MT_EQ_INT(c.num_layers, L);
  MT_EQ_INT(c.num_experts, E);
  MT_EQ_INT(c.hidden_size, H);
  MT_EQ_INT(c.moe_intermediate, I);
  MT_EQ_INT(mr_config_num_moe_layers(&c), L);
  mr_st *st = NULL;
  MT_OK(mr_st_open(&st, dir, &e), &e);
  MT_EQ_U64(mr_st_count(st), 3 + L * (9 + 3 * E));
  for (uint32_t l = 0; l < L; l++)
    for (uint32_t x = 0; x < E; x++)
      for (int p = 0; p < 3; p++) {
        char key[128];
        mr_config_expert_key(&c, l, x, (mr_proj)p, key, sizeof key);
        uint64_t shape[2] = {p == MR_PROJ_DOWN ? H : I, p == MR_PROJ_DOWN ? I : H};
        const mr_st_tensor *t = NULL;
        MT_OK(mr_st_expect(st, key, 2, shape, &t, &e), &e);
        MT_EQ_INT(t->dtype, MR_DTYPE_BF16);
      }
  /* The lookup the server and the client share finds the same tensors, and names the
   * expert and the projection when the config disagrees with the weights. */
  const mr_st_tensor *t3[3];
  MT_OK(mr_config_expert_tensors(&c, st, L - 1, E - 1, t3, &e), &e);
  MT_EQ_U64(t3[MR_PROJ_GATE]->shape[0], I);
  MT_EQ_U64(t3[MR_PROJ_DOWN]->shape[0], H);
  MT_CONTAINS(t3[MR_PROJ_UP]->name, "up_proj");
  mr_model_config bad = c;
  bad.moe_intermediate = I + 1;
  MT_EQ_INT(mr_config_expert_tensors(&bad, st, 0, 1, t3, &e), MR_EMISMATCH);
  MT_CONTAINS(e.msg, "layer 0 expert 1 gate: ");
  MT_CONTAINS(e.msg, "model.layers.0.mlp.experts.1.gate_proj.weight");
  MT_EQ_INT(mr_config_expert_tensors(&c, st, 0, E, t3, &e), MR_ENOTFOUND);
  uint64_t router[2] = {E, H};
  char key[64];
  snprintf(key, sizeof key, "model.layers.%u.mlp.gate.weight", L - 1);
  MT_OK(mr_st_expect(st, key, 2, router, NULL, &e), &e);
  mr_st_close(st);
}

MT_TEST(mkmodel_output_opens_and_matches_config) {
  tdir_make();
  const char *mk = mkmodel_path();
  if (access(mk, X_OK) != 0) MT__FAIL("%s not found: build it (make) or set MOERPC_BIN", mk);
  MT_EQ_INT(run_cmd("%s --out %s/one --seed 5 --layers 3 --experts 8 --topk 2 --hidden 128 "
                    "--inter 64 --vocab 2048 2>/dev/null",
                    mk, tdir),
            0);
  MT_EQ_INT(run_cmd("%s --out %s/sharded --seed 5 --shard-mb 1 --layers 3 --experts 8 --topk 2 "
                    "--hidden 128 --inter 64 --vocab 2048 2>/dev/null",
                    mk, tdir),
            0);
  check_model(tpath("one"), 3, 8, 128, 64);
  check_model(tpath("sharded"), 3, 8, 128, 64);
  struct stat sb;
  MT_EQ_INT(stat(tpath("sharded/model.safetensors.index.json"), &sb), 0);
  MT_EQ_INT(stat(tpath("sharded/model-00002-of-00003.safetensors"), &sb), 0);
  /* Same seed and shape: same bytes, whatever the sharding. */
  mr_st *a = NULL, *b = NULL;
  mr_err e = {0};
  MT_OK(mr_st_open(&a, tpath("one"), &e), &e);
  MT_OK(mr_st_open(&b, tpath("sharded"), &e), &e);
  for (size_t i = 0; i < mr_st_count(a); i++) {
    const mr_st_tensor *x = mr_st_at(a, i), *y = mr_st_find(b, x->name);
    MT_TRUE(y != NULL);
    MT_EQ_U64(x->nbytes, y->nbytes);
    MT_EQ_INT(memcmp(x->data, y->data, x->nbytes), 0);
  }
  mr_st_close(a);
  mr_st_close(b);
  /* Same flags twice: same fingerprint (deterministic); another seed: another one. */
  char f1[17], f2[17];
  MT_EQ_INT(run_cmd("%s --out %s/again --seed 5 --layers 3 --experts 8 --topk 2 --hidden 128 "
                    "--inter 64 --vocab 2048 2>/dev/null",
                    mk, tdir),
            0);
  MT_OK(mr_model_fingerprint(tpath("one"), NULL, f1, &e), &e);
  MT_OK(mr_model_fingerprint(tpath("again"), NULL, f2, &e), &e);
  MT_EQ_STR(f1, f2);
  MT_EQ_INT(run_cmd("%s --out %s/again --seed 6 --layers 3 --experts 8 --topk 2 --hidden 128 "
                    "--inter 64 --vocab 2048 2>/dev/null",
                    mk, tdir),
            0);
  MT_OK(mr_model_fingerprint(tpath("again"), NULL, f2, &e), &e);
  MT_TRUE(strcmp(f1, f2) != 0);
}

MT_TEST(mkmodel_rejects_bad_flags) {
  tdir_make();
  const char *mk = mkmodel_path();
  if (access(mk, X_OK) != 0) MT__FAIL("%s not found: build it (make) or set MOERPC_BIN", mk);
  struct {
    const char *args, *msg;
  } cases[] = {
      {"--experts 0", "--experts = \"0\", must be an integer in 1..65536"},
      {"--layers 1025", "--layers = \"1025\", must be an integer in 1..1024"},
      {"--hidden 12x", "--hidden = \"12x\""},
      {"--hidden -4", "--hidden = \"-4\""},
      {"--topk 17", "--topk = 17, must be in 1..--experts (16)"},
      {"--kv-heads 3", "--kv-heads = 3, must divide --heads (4)"},
      {"--seed 18446744073709551616", "--seed = \"18446744073709551616\""},
      {"--shard-mb 1048577", "--shard-mb = \"1048577\", must be an integer in 0..1048576"},
      {"--bogus 1", "unknown argument \"--bogus\""},
      {"--vocab", "--vocab needs a value"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    char cmd[2560], out[512] = {0};
    snprintf(cmd, sizeof cmd, "%s --out %s/bad %s 2>&1", mk, tdir, cases[i].args);
    FILE *p = popen(cmd, "r");
    MT_TRUE(p != NULL);
    size_t n = fread(out, 1, sizeof out - 1, p);
    out[n] = '\0';
    int st = pclose(p);
    MT_EQ_INT(WEXITSTATUS(st), 2);
    MT_CONTAINS(out, cases[i].msg);
  }
  /* --out is required, and nothing is written on a usage error. */
  MT_EQ_INT(run_cmd("%s --layers 2 %s 2>/dev/null", mk, ""), 2);
  struct stat sb;
  MT_TRUE(stat(tpath("bad"), &sb) != 0);
  MT_EQ_INT(run_cmd("%s --help %s >/dev/null", mk, ""), 0);
}

/* ---- float8_e4m3fn ------------------------------------------------------------------ */

/* F8_E4M3 tensors parse (1 byte per element), are flagged, found by mr_st_expect_as and
 * refused by mr_st_expect (no float mr_dtype); a wrong byte count is refused. */
MT_TEST(f8_e4m3_parse_and_expect) {
  const char *h = "{\"w\":{\"dtype\":\"F8_E4M3\",\"shape\":[4,3],\"data_offsets\":[0,12]},"
                  "\"s\":{\"dtype\":\"F32\",\"shape\":[1,1],\"data_offsets\":[12,16]},"
                  "\"v\":{\"dtype\":\"F8_E5M2\",\"shape\":[2],\"data_offsets\":[16,18]}}";
  size_t n;
  uint8_t *b = make_image(h, strlen(h), 18, &n);
  mr_st *st = NULL;
  mr_err e = {0};
  MT_OK(mr_st_parse_buffer(&st, b, n, "f8.safetensors", &e), &e);
  const mr_st_tensor *t = mr_st_find(st, "w");
  MT_TRUE(t && mr_st_is_f8e4m3(t) && t->nbytes == 12 && t->dtype == MR_DTYPE_UNSPECIFIED);
  MT_FALSE(mr_st_is_f8e4m3(mr_st_find(st, "v")));
  MT_FALSE(mr_st_is_f8e4m3(mr_st_find(st, "s")));
  uint64_t shp[2] = {4, 3}, one[2] = {1, 1}, v2[1] = {2};
  const mr_st_tensor *x = NULL;
  MT_OK(mr_st_expect_as(st, "w", "F8_E4M3", 2, shp, &x, &e), &e);
  MT_TRUE(x == t);
  MT_EQ_INT(mr_st_expect(st, "w", 2, shp, &x, &e), MR_EFORMAT);
  MT_CONTAINS(e.msg, "tensor \"w\": dtype = F8_E4M3, expected F32, F16 or BF16");
  MT_EQ_INT(mr_st_expect_as(st, "s", "F8_E4M3", 2, one, &x, &e), MR_EFORMAT);
  MT_CONTAINS(e.msg, "tensor \"s\": dtype = F32, expected F8_E4M3");
  MT_EQ_INT(mr_st_expect_as(st, "v", "F8_E4M3", 1, v2, &x, &e), MR_EFORMAT);
  MT_EQ_INT(mr_st_expect_as(st, "w", "F8_E4M3", 2, one, &x, &e), MR_EMISMATCH);
  MT_OK(mr_st_expect_as(st, "s", NULL, 2, one, &x, &e), &e); /* NULL: any float dtype */
  mr_st_close(st);
  free(b);
  MT_EQ_INT(parse_hdr("{\"w\":{\"dtype\":\"F8_E4M3\",\"shape\":[4,3],\"data_offsets\":[0,24]}}", 24, &e),
            MR_EFORMAT);
  MT_CONTAINS(e.msg, "hold 24 bytes, but shape [4, 3] of F8_E4M3 needs 12");
}

/* The writer writes F8_E4M3 (eager and lazy) after the wider dtypes, and reads back. */
MT_TEST(f8_e4m3_writer_roundtrip) {
  tdir_make();
  mr_st_writer *w = NULL;
  MT_EQ_INT(mr_st_writer_new(&w), 0);
  uint8_t q[6] = {0x38, 0xb8, 0x7e, 0x01, 0x80, 0x00};
  float sc = 0.25f;
  uint64_t shp[2] = {2, 3}, one[2] = {1, 1};
  MT_EQ_INT(mr_st_writer_add_f8e4m3(w, "a.weight", 2, shp, q), 0);
  MT_EQ_INT(mr_st_writer_add(w, "a.weight_scale_inv", MR_DTYPE_F32, 2, one, &sc), 0);
  MT_EQ_INT(mr_st_writer_add_f8e4m3(w, "a.weight", 2, shp, q), MR_EINVAL); /* duplicate */
  mr_err e = {0};
  MT_OK(mr_st_writer_write(w, tpath("f8.safetensors"), &e), &e);
  mr_st_writer_free(w);
  mr_st *st = NULL;
  MT_OK(mr_st_open(&st, tpath("f8.safetensors"), &e), &e);
  const mr_st_tensor *t = NULL, *s = NULL;
  MT_OK(mr_st_expect_as(st, "a.weight", "F8_E4M3", 2, shp, &t, &e), &e);
  MT_OK(mr_st_expect(st, "a.weight_scale_inv", 2, one, &s, &e), &e);
  MT_TRUE(memcmp(t->data, q, 6) == 0);
  MT_TRUE((const uint8_t *)t->data > (const uint8_t *)s->data); /* F32 first, F8 last */
  const float *tbl = mr_f8e4m3_table();
  MT_TRUE(tbl[((const uint8_t *)t->data)[0]] * *(const float *)s->data == 0.25f);
  mr_st_close(st);
}

/* mkmodel --dtype fp8: F8_E4M3 experts with F32 scale_inv [ceil(N/128), ceil(K/128)] that
 * mr_config_expert_tensors_q finds; a quantization_config; the rest bf16; the dequantized
 * values within an e4m3 step of the bf16 model's of the same seed. */
MT_TEST(mkmodel_fp8_checkpoint) {
  tdir_make();
  const char *mk = mkmodel_path();
  if (access(mk, X_OK) != 0) MT__FAIL("%s not found: build it (make) or set MOERPC_BIN", mk);
  const char *flags = "--seed 7 --layers 2 --experts 3 --topk 2 --hidden 200 --inter 136 --vocab 64";
  char cmd[512];
  snprintf(cmd, sizeof cmd, "%%s --out %%s/fp8 --dtype fp8 %s 2>/dev/null", flags);
  MT_EQ_INT(run_cmd(cmd, mk, tdir), 0);
  snprintf(cmd, sizeof cmd, "%%s --out %%s/bf16 %s 2>/dev/null", flags);
  MT_EQ_INT(run_cmd(cmd, mk, tdir), 0);
  MT_EQ_INT(run_cmd("%s --out %s/x --dtype fp16 2>/dev/null", mk, tdir), 2); /* usage error */
  mr_model_config c, cb;
  mr_err e = {0};
  MT_OK(mr_config_load(&c, tpath("fp8"), &e), &e);
  MT_OK(mr_config_load(&cb, tpath("bf16"), &e), &e);
  MT_TRUE(c.fp8 && c.fp8_block[0] == 128 && c.fp8_block[1] == 128 && !cb.fp8);
  mr_st *st = NULL, *sb = NULL;
  MT_OK(mr_st_open(&st, tpath("fp8"), &e), &e);
  MT_OK(mr_st_open(&sb, tpath("bf16"), &e), &e);
  MT_EQ_U64(mr_st_count(st), 3 + 2 * (9 + 6 * 3));
  const float *tbl = mr_f8e4m3_table();
  for (uint32_t l = 0; l < 2; l++)
    for (uint32_t x = 0; x < 3; x++) {
      const mr_st_tensor *t[3], *sc[3], *tb[3], *sb3[3];
      MT_OK(mr_config_expert_tensors_q(&c, st, l, x, t, sc, &e), &e);
      MT_OK(mr_config_expert_tensors_q(&cb, sb, l, x, tb, sb3, &e), &e);
      for (int p = 0; p < 3; p++) {
        MT_TRUE(mr_st_is_f8e4m3(t[p]) && sc[p] && sc[p]->dtype == MR_DTYPE_F32 && !sb3[p]);
        const uint64_t N = t[p]->shape[0], K = t[p]->shape[1], nkb = (K + 127) / 128;
        MT_EQ_U64(sc[p]->shape[0], (N + 127) / 128);
        MT_EQ_U64(sc[p]->shape[1], nkb);
        const uint8_t *q = t[p]->data;
        const float *s = sc[p]->data;
        const uint16_t *wb = tb[p]->data;
        for (uint64_t i = 0; i < N * K; i++) {
          float v = mr_bf16_to_f32(wb[i]), bs = s[(i / K / 128) * nkb + (i % K) / 128];
          float dq = tbl[q[i]] * bs;
          MT_TRUE(fabsf(dq - v) <= fmaxf(fabsf(v) / 16.0f, bs * 0.001f) * 1.001f);
        }
      }
    }
  const mr_st_tensor *r = mr_st_find(st, "model.layers.1.self_attn.q_proj.weight");
  MT_TRUE(r && r->dtype == MR_DTYPE_BF16);
  /* The fp8 checkpoint read as if it had no quantization_config: refused by name. */
  mr_model_config plain = c;
  plain.fp8 = false;
  const mr_st_tensor *t[3], *sc[3];
  MT_EQ_INT(mr_config_expert_tensors_q(&plain, st, 0, 0, t, sc, &e), MR_EFORMAT);
  MT_CONTAINS(e.msg, "model.layers.0.mlp.experts.0.gate_proj.weight\" is F8_E4M3");
  mr_st_close(st);
  mr_st_close(sb);
}

/* ---- moerpc-mkmodel --arch deepseek-v3 ---------------------------------------------- */

/* The DeepSeek-V3 layout of docs/ds-shared (transformers 5.24 DeepseekV3ForCausalLM),
 * restated here independently of mkmodel's tables: one expected tensor. */
typedef struct ds_want {
  char name[128];
  const char *dtype; /* "BF16", "F32", "F8_E4M3" */
  uint32_t ndim;
  uint64_t shape[2];
} ds_want;

typedef struct ds_shape {
  uint32_t L, E, H, I, V, nh, ql, kvl, nope, rope, vd, ns, dense, di;
  bool tie, fp8;
} ds_shape;

/* Appends a Linear [n, k] (and with fp8 its F32 scale_inv [ceil(n/128), ceil(k/128)]). */
static void ds_lin(ds_want *w, size_t *n, const ds_shape *d, const char *name, uint64_t rows,
                   uint64_t cols) {
  w[*n] = (ds_want){.dtype = d->fp8 ? "F8_E4M3" : "BF16", .ndim = 2, .shape = {rows, cols}};
  snprintf(w[*n].name, sizeof w[*n].name, "%s", name);
  (*n)++;
  if (!d->fp8) return;
  w[*n] = (ds_want){.dtype = "F32", .ndim = 2, .shape = {(rows + 127) / 128, (cols + 127) / 128}};
  snprintf(w[*n].name, sizeof w[*n].name, "%s_scale_inv", name);
  (*n)++;
}

static void ds_add(ds_want *w, size_t *n, const char *dtype, const char *name, uint32_t ndim,
                   uint64_t d0, uint64_t d1) {
  w[*n] = (ds_want){.dtype = dtype, .ndim = ndim, .shape = {d0, d1}};
  snprintf(w[*n].name, sizeof w[*n].name, "%s", name);
  (*n)++;
}

/* Every tensor a DeepSeek-V3 checkpoint of shape d holds; returns the count. */
static size_t ds_layout(const ds_shape *d, ds_want *w) {
  size_t n = 0;
  char k[128];
  ds_add(w, &n, "BF16", "model.embed_tokens.weight", 2, d->V, d->H);
  ds_add(w, &n, "BF16", "model.norm.weight", 1, d->H, 0);
  if (!d->tie) ds_add(w, &n, "BF16", "lm_head.weight", 2, d->V, d->H);
  const uint64_t qk = (uint64_t)d->nope + d->rope;
  for (uint32_t l = 0; l < d->L; l++) {
#define K(fmt, ...) (snprintf(k, sizeof k, "model.layers.%u." fmt, l, ##__VA_ARGS__), k)
    ds_add(w, &n, "BF16", K("input_layernorm.weight"), 1, d->H, 0);
    ds_add(w, &n, "BF16", K("post_attention_layernorm.weight"), 1, d->H, 0);
    if (d->ql) {
      ds_lin(w, &n, d, K("self_attn.q_a_proj.weight"), d->ql, d->H);
      ds_add(w, &n, "BF16", K("self_attn.q_a_layernorm.weight"), 1, d->ql, 0);
      ds_lin(w, &n, d, K("self_attn.q_b_proj.weight"), d->nh * qk, d->ql);
    } else {
      ds_lin(w, &n, d, K("self_attn.q_proj.weight"), d->nh * qk, d->H);
    }
    ds_lin(w, &n, d, K("self_attn.kv_a_proj_with_mqa.weight"), d->kvl + d->rope, d->H);
    ds_add(w, &n, "BF16", K("self_attn.kv_a_layernorm.weight"), 1, d->kvl, 0);
    ds_lin(w, &n, d, K("self_attn.kv_b_proj.weight"), (uint64_t)d->nh * (d->nope + d->vd), d->kvl);
    ds_lin(w, &n, d, K("self_attn.o_proj.weight"), d->H, (uint64_t)d->nh * d->vd);
    if (l < d->dense) {
      ds_lin(w, &n, d, K("mlp.gate_proj.weight"), d->di, d->H);
      ds_lin(w, &n, d, K("mlp.up_proj.weight"), d->di, d->H);
      ds_lin(w, &n, d, K("mlp.down_proj.weight"), d->H, d->di);
      continue;
    }
    ds_add(w, &n, "BF16", K("mlp.gate.weight"), 2, d->E, d->H);
    ds_add(w, &n, "F32", K("mlp.gate.e_score_correction_bias"), 1, d->E, 0);
    ds_lin(w, &n, d, K("mlp.shared_experts.gate_proj.weight"), (uint64_t)d->I * d->ns, d->H);
    ds_lin(w, &n, d, K("mlp.shared_experts.up_proj.weight"), (uint64_t)d->I * d->ns, d->H);
    ds_lin(w, &n, d, K("mlp.shared_experts.down_proj.weight"), d->H, (uint64_t)d->I * d->ns);
    for (uint32_t x = 0; x < d->E; x++) {
      ds_lin(w, &n, d, K("mlp.experts.%u.gate_proj.weight", x), d->I, d->H);
      ds_lin(w, &n, d, K("mlp.experts.%u.up_proj.weight", x), d->I, d->H);
      ds_lin(w, &n, d, K("mlp.experts.%u.down_proj.weight", x), d->H, d->I);
    }
#undef K
  }
  return n;
}

/* Writes a deepseek-v3 model with flags into tdir/name and checks, with the C reader, that
 * it holds exactly the tensors of d (names, dtypes, shapes), that its config says what d
 * says, and that the expert lookup the server uses finds every routed expert. */
static void ds_check(const char *name, const char *flags, const ds_shape *d) {
  const char *mk = mkmodel_path();
  if (access(mk, X_OK) != 0) MT__FAIL("%s not found: build it (make) or set MOERPC_BIN", mk);
  char cmd[1024];
  snprintf(cmd, sizeof cmd, "%%s --out %%s/%s --arch deepseek-v3 %s 2>/dev/null", name, flags);
  MT_EQ_INT(run_cmd(cmd, mk, tdir), 0);
  mr_model_config c;
  mr_err e = {0};
  MT_OK(mr_config_load(&c, tpath(name), &e), &e);
  MT_EQ_INT(c.arch, MR_ARCH_DEEPSEEK_V3);
  MT_EQ_INT(c.num_layers, d->L);
  MT_EQ_INT(c.num_experts, d->E);
  MT_EQ_INT(c.hidden_size, d->H);
  MT_EQ_INT(c.moe_intermediate, d->I);
  MT_EQ_INT(c.dense_intermediate, d->di);
  MT_EQ_INT(c.num_heads, d->nh);
  MT_EQ_INT(c.num_kv_heads, d->nh);
  MT_EQ_INT(c.tie_word_embeddings, d->tie);
  MT_EQ_INT(c.fp8, d->fp8);
  for (uint32_t l = 0; l < d->L; l++) MT_EQ_INT(c.is_moe[l], l >= d->dense);
  size_t cap = 64 + (size_t)d->L * (32 + 6 * d->E);
  ds_want *w = calloc(cap, sizeof *w);
  MT_TRUE(w != NULL);
  size_t n = ds_layout(d, w);
  MT_TRUE(n <= cap);
  mr_st *st = NULL;
  MT_OK(mr_st_open(&st, tpath(name), &e), &e);
  MT_EQ_U64(mr_st_count(st), n); /* nothing more than the layout */
  for (size_t i = 0; i < n; i++) {
    const mr_st_tensor *t = NULL;
    MT_OK(mr_st_expect_as(st, w[i].name, w[i].dtype, w[i].ndim, w[i].shape, &t, &e), &e);
    MT_EQ_STR(t->dtype_name, w[i].dtype);
  }
  for (uint32_t l = d->dense; l < d->L; l++)
    for (uint32_t x = 0; x < d->E; x++) {
      const mr_st_tensor *t3[3], *s3[3];
      MT_OK(mr_config_expert_tensors_q(&c, st, l, x, t3, s3, &e), &e);
      MT_TRUE((s3[MR_PROJ_DOWN] != NULL) == d->fp8);
    }
  mr_st_close(st);
  free(w);
}

/* The default shape, and the conformance case's: q_proj instead of the low-rank query, tied
 * head, yarn, groups, two shared experts, two dense layers; odd sizes; fp8. */
MT_TEST(mkmodel_deepseek_layout) {
  tdir_make();
  ds_shape def = {.L = 4, .E = 16, .H = 256, .I = 128, .V = 512, .nh = 4, .ql = 48, .kvl = 32,
                  .nope = 16, .rope = 8, .vd = 16, .ns = 1, .dense = 1, .di = 256};
  ds_check("def", "", &def);
  ds_shape b = def;
  b.ql = 0;
  b.tie = true;
  b.ns = 2;
  b.dense = 2;
  ds_check("b", "--q-lora-rank 0 --tie 1 --yarn 4 --groups 4 --topk-groups 2 --shared-experts 2 "
                "--dense-layers 2", &b);
  ds_shape odd = {.L = 3, .E = 6, .H = 200, .I = 136, .V = 64, .nh = 3, .ql = 129, .kvl = 33,
                  .nope = 7, .rope = 6, .vd = 9, .ns = 0, .dense = 0, .di = 300, .fp8 = true};
  ds_check("odd", "--layers 3 --experts 6 --topk 2 --hidden 200 --inter 136 --vocab 64 "
                  "--heads 3 --q-lora-rank 129 --kv-lora-rank 33 --qk-nope-dim 7 "
                  "--qk-rope-dim 6 --v-head-dim 9 --shared-experts 0 --dense-layers 0 "
                  "--dense-inter 300 --groups 3 --dtype fp8", &odd);
  ds_shape f = def;
  f.fp8 = true;
  ds_check("fp8", "--dtype fp8", &f);
  /* The config's routing and RoPE fields. */
  mr_model_config c;
  mr_err e = {0};
  MT_OK(mr_config_load(&c, tpath("def"), &e), &e);
  MT_NEAR(c.routed_scaling_factor, 2.5, 0);
  MT_TRUE(c.norm_topk_prob);
  MT_EQ_STR(c.rope_type, "default");
  MT_OK(mr_config_load(&c, tpath("b"), &e), &e);
  MT_EQ_STR(c.rope_type, "yarn");
  MT_EQ_INT(c.head_dim, 24); /* qk_nope + qk_rope */
  /* Float fields are written as floats even when integer-valued (transformers' strict
   * config refuses an int for routed_scaling_factor). */
  const char *mk = mkmodel_path();
  MT_EQ_INT(run_cmd("%s --out %s/f --arch deepseek-v3 --routed-scale 1 --yarn 4 2>/dev/null", mk,
                    tdir), 0);
  MT_EQ_INT(run_cmd("grep -q '\"routed_scaling_factor\": 1.0,' %s/f/config.json && "
                    "grep -q '\"factor\": 4.0,' %s/f/config.json", tdir, tdir), 0);
  MT_OK(mr_config_load(&c, tpath("f"), &e), &e);
  MT_NEAR(c.routed_scaling_factor, 1.0, 0);
}

/* Values: the same tensor name and shape draws the same values whatever the architecture
 * and the other flags (the embedding of a qwen3-moe and a deepseek-v3 model of one seed),
 * and sharded or not; --router-skew acts on the deepseek router;
 * the fp8 Linears are the block quantization of the bf16 model's values; the correction
 * biases are F32 within +-0.05, not all zero, the same in the bf16 and fp8 models. */
MT_TEST(mkmodel_deepseek_values) {
  tdir_make();
  const char *mk = mkmodel_path();
  if (access(mk, X_OK) != 0) MT__FAIL("%s not found: build it (make) or set MOERPC_BIN", mk);
  const char *f = "--seed 4 --layers 2 --experts 4 --topk 2 --hidden 160 --inter 40 --vocab 96";
  char cmd[512];
  snprintf(cmd, sizeof cmd, "%%s --out %%s/q %s 2>/dev/null", f);
  MT_EQ_INT(run_cmd(cmd, mk, tdir), 0);
  snprintf(cmd, sizeof cmd, "%%s --out %%s/d --arch deepseek-v3 %s 2>/dev/null", f);
  MT_EQ_INT(run_cmd(cmd, mk, tdir), 0);
  snprintf(cmd, sizeof cmd, "%%s --out %%s/d8 --arch deepseek-v3 --dtype fp8 %s 2>/dev/null", f);
  MT_EQ_INT(run_cmd(cmd, mk, tdir), 0);
  snprintf(cmd, sizeof cmd, "%%s --out %%s/ds --arch deepseek-v3 --shard-mb 1 %s 2>/dev/null", f);
  MT_EQ_INT(run_cmd(cmd, mk, tdir), 0);
  snprintf(cmd, sizeof cmd, "%%s --out %%s/dk --arch deepseek-v3 --router-skew 2 %s 2>/dev/null", f);
  MT_EQ_INT(run_cmd(cmd, mk, tdir), 0);
  mr_st *q = NULL, *d = NULL, *d8 = NULL, *ds = NULL, *dk = NULL;
  mr_err e = {0};
  MT_OK(mr_st_open(&q, tpath("q"), &e), &e);
  MT_OK(mr_st_open(&d, tpath("d"), &e), &e);
  MT_OK(mr_st_open(&d8, tpath("d8"), &e), &e);
  MT_OK(mr_st_open(&ds, tpath("ds"), &e), &e);
  const char *same[] = {"model.embed_tokens.weight", "lm_head.weight",
                        "model.layers.1.mlp.experts.3.down_proj.weight", "model.layers.1.mlp.gate.weight"};
  for (size_t i = 0; i < sizeof same / sizeof same[0]; i++) {
    const mr_st_tensor *a = mr_st_find(q, same[i]), *b = mr_st_find(d, same[i]);
    MT_TRUE(a && b && a->nbytes == b->nbytes);
    MT_EQ_INT(memcmp(a->data, b->data, a->nbytes), 0);
  }
  /* Sharded or not: the same bytes. */
  MT_EQ_U64(mr_st_count(ds), mr_st_count(d));
  for (size_t i = 0; i < mr_st_count(d); i++) {
    const mr_st_tensor *a = mr_st_at(d, i), *b = mr_st_find(ds, a->name);
    MT_TRUE(b && a->nbytes == b->nbytes);
    MT_EQ_INT(memcmp(a->data, b->data, a->nbytes), 0);
  }
  /* fp8 = the quantization of the bf16 values, for every kind of Linear. */
  const char *lin[] = {"model.layers.0.self_attn.q_b_proj.weight", "model.layers.0.mlp.down_proj.weight",
                       "model.layers.1.self_attn.kv_a_proj_with_mqa.weight",
                       "model.layers.1.mlp.shared_experts.up_proj.weight",
                       "model.layers.1.mlp.experts.2.gate_proj.weight"};
  const float *tbl = mr_f8e4m3_table();
  for (size_t i = 0; i < sizeof lin / sizeof lin[0]; i++) {
    char sk[160];
    snprintf(sk, sizeof sk, "%s_scale_inv", lin[i]);
    const mr_st_tensor *wb = mr_st_find(d, lin[i]), *w8 = mr_st_find(d8, lin[i]), *sc = mr_st_find(d8, sk);
    MT_TRUE(wb && w8 && sc && mr_st_is_f8e4m3(w8) && sc->dtype == MR_DTYPE_F32);
    const uint64_t N = wb->shape[0], K = wb->shape[1], nkb = (K + 127) / 128;
    const uint16_t *v = wb->data;
    const uint8_t *c8 = w8->data;
    const float *s = sc->data;
    for (uint64_t j = 0; j < N * K; j++) {
      float x = mr_bf16_to_f32(v[j]), bs = s[(j / K / 128) * nkb + (j % K) / 128];
      MT_TRUE(fabsf(tbl[c8[j]] * bs - x) <= fmaxf(fabsf(x) / 16.0f, bs * 0.001f) * 1.001f);
    }
  }
  /* Router, norms and embeddings stay bf16 with fp8. */
  MT_EQ_STR(mr_st_find(d8, "model.layers.1.mlp.gate.weight")->dtype_name, "BF16");
  MT_EQ_STR(mr_st_find(d8, "model.layers.1.self_attn.kv_a_layernorm.weight")->dtype_name, "BF16");
  MT_EQ_STR(mr_st_find(d8, "lm_head.weight")->dtype_name, "BF16");
  /* The correction bias. */
  const mr_st_tensor *b1 = mr_st_find(d, "model.layers.1.mlp.gate.e_score_correction_bias");
  MT_TRUE(b1 && b1->dtype == MR_DTYPE_F32 && b1->shape[0] == 4);
  const float *bv = b1->data;
  float amax = 0;
  for (int j = 0; j < 4; j++) {
    MT_TRUE(fabsf(bv[j]) <= 0.05f);
    amax = fmaxf(amax, fabsf(bv[j]));
  }
  MT_TRUE(amax > 0.001f);
  MT_TRUE(memcmp(bv, mr_st_find(d8, "model.layers.1.mlp.gate.e_score_correction_bias")->data, 16) == 0);
  /* --router-skew 2 scales router row e by (1 + rank)^-2, ranks a permutation: the ratios
   * of the skewed to the plain rows are 1, 1/4, 1/9, 1/16 in some order. */
  MT_OK(mr_st_open(&dk, tpath("dk"), &e), &e);
  const mr_st_tensor *rp = mr_st_find(d, "model.layers.1.mlp.gate.weight");
  const mr_st_tensor *rk = mr_st_find(dk, "model.layers.1.mlp.gate.weight");
  MT_TRUE(rp && rk && rp->nbytes == rk->nbytes && rp->shape[0] == 4);
  bool rank_seen[4] = {false};
  for (uint64_t r = 0; r < 4; r++) {
    double np = 0, nk = 0;
    for (uint64_t j = 0; j < rp->shape[1]; j++) {
      double a = mr_bf16_to_f32(((const uint16_t *)rp->data)[r * rp->shape[1] + j]);
      double b = mr_bf16_to_f32(((const uint16_t *)rk->data)[r * rp->shape[1] + j]);
      np += a * a;
      nk += b * b;
    }
    double ratio = sqrt(nk / np);
    int rank = (int)lround(sqrt(1.0 / ratio)) - 1;
    MT_TRUE(rank >= 0 && rank < 4 && !rank_seen[rank]);
    MT_NEAR(ratio, 1.0 / ((rank + 1.0) * (rank + 1.0)), 0.01);
    rank_seen[rank] = true;
  }
  /* Everything but the routers is as without the skew. */
  const mr_st_tensor *ek = mr_st_find(dk, "model.layers.1.mlp.experts.1.up_proj.weight");
  const mr_st_tensor *ep = mr_st_find(d, "model.layers.1.mlp.experts.1.up_proj.weight");
  MT_TRUE(ek && ep && memcmp(ek->data, ep->data, ep->nbytes) == 0);
  mr_st_close(q);
  mr_st_close(d);
  mr_st_close(d8);
  mr_st_close(ds);
  mr_st_close(dk);
}

/* Bad deepseek-v3 flags: exit 2, the message names the flag(s) and the limit, nothing
 * written. */
MT_TEST(mkmodel_deepseek_rejects_bad_flags) {
  tdir_make();
  const char *mk = mkmodel_path();
  if (access(mk, X_OK) != 0) MT__FAIL("%s not found: build it (make) or set MOERPC_BIN", mk);
  struct {
    const char *args, *msg;
  } cases[] = {
      {"--arch deepseek", "--arch \"deepseek\": must be qwen3-moe or deepseek-v3"},
      {"--arch deepseek-v3 --head-dim 64", "--head-dim does not apply to --arch deepseek-v3"},
      {"--head-dim 64 --arch deepseek-v3", "--qk-nope-dim + --qk-rope-dim"},
      {"--arch deepseek-v3 --kv-heads 2", "--kv-heads does not apply to --arch deepseek-v3"},
      {"--q-lora-rank 8", "--q-lora-rank applies to --arch deepseek-v3 only"},
      {"--yarn 4", "--yarn applies to --arch deepseek-v3 only"},
      {"--arch deepseek-v3 --qk-rope-dim 7", "--qk-rope-dim = 7, must be even"},
      {"--arch deepseek-v3 --qk-rope-dim 0", "--qk-rope-dim = \"0\", must be an integer in 2..4096"},
      {"--arch deepseek-v3 --kv-lora-rank 0", "--kv-lora-rank = \"0\", must be an integer in 1..65536"},
      {"--arch deepseek-v3 --q-lora-rank 65537", "--q-lora-rank = \"65537\", must be an integer in 0..65536"},
      {"--arch deepseek-v3 --qk-nope-dim 4000 --qk-rope-dim 100",
       "--qk-nope-dim + --qk-rope-dim = 4000 + 100, at most 4096"},
      {"--arch deepseek-v3 --shared-experts 17", "--shared-experts = \"17\", must be an integer in 0..16"},
      {"--arch deepseek-v3 --dense-layers 4", "--dense-layers = 4, must be in 0..--layers - 1 (3)"},
      {"--arch deepseek-v3 --layers 1 --dense-layers 1", "--dense-layers = 1, must be in 0..--layers - 1 (0)"},
      {"--arch deepseek-v3 --dense-inter 0", "--dense-inter = \"0\", must be an integer in 1..1048576"},
      {"--arch deepseek-v3 --groups 3", "--groups = 3, must divide --experts (16)"},
      {"--arch deepseek-v3 --groups 16", "--experts / --groups = 16 / 16, must be at least 2"},
      {"--arch deepseek-v3 --groups 4 --topk-groups 5", "--topk-groups = 5, must be in 1..--groups (4)"},
      {"--arch deepseek-v3 --groups 8 --topk-groups 1 --topk 3",
       "--topk = 3, more than the 2 experts of the --topk-groups (1) kept groups of --experts / --groups (2) each"},
      {"--arch deepseek-v3 --routed-scale 0", "--routed-scale \"0\": must be a number > 0 and <= 1000"},
      {"--arch deepseek-v3 --routed-scale x", "--routed-scale \"x\""},
      {"--arch deepseek-v3 --yarn 0.5", "--yarn \"0.5\": must be 0 (default RoPE) or a factor in 1..1024"},
      {"--arch deepseek-v3 --yarn 2000", "--yarn \"2000\": must be a number in 0..1024"},
      {"--arch deepseek-v3 --norm-topk 2", "--norm-topk = \"2\", must be an integer in 0..1"},
      {"--tie yes", "--tie = \"yes\", must be an integer in 0..1"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    char cmd[2560], out[512] = {0};
    snprintf(cmd, sizeof cmd, "%s --out %s/bad %s 2>&1", mk, tdir, cases[i].args);
    FILE *p = popen(cmd, "r");
    MT_TRUE(p != NULL);
    size_t n = fread(out, 1, sizeof out - 1, p);
    out[n] = '\0';
    int st = pclose(p);
    if (WEXITSTATUS(st) != 2 || !strstr(out, cases[i].msg))
      MT__FAIL("%s: exit %d, output \"%s\", expected exit 2 and \"%s\"", cases[i].args,
               WEXITSTATUS(st), out, cases[i].msg);
  }
  struct stat sb;
  MT_TRUE(stat(tpath("bad"), &sb) != 0);
  /* The help lists the deepseek flags. */
  char cmd[1100], out[8192] = {0};
  snprintf(cmd, sizeof cmd, "%s --help", mk);
  FILE *p = popen(cmd, "r");
  MT_TRUE(p != NULL);
  size_t n = fread(out, 1, sizeof out - 1, p);
  out[n] = '\0';
  MT_EQ_INT(WEXITSTATUS(pclose(p)), 0);
  const char *flags[] = {"--arch", "--q-lora-rank", "--kv-lora-rank", "--qk-nope-dim",
                         "--qk-rope-dim", "--v-head-dim", "--shared-experts", "--dense-layers",
                         "--dense-inter", "--groups", "--topk-groups", "--routed-scale", "--yarn",
                         "--norm-topk", "--tie"};
  for (size_t i = 0; i < sizeof flags / sizeof flags[0]; i++) MT_CONTAINS(out, flags[i]);
}

MT_MAIN()
