/*
 * itest_cache.c - the packed-weight cache (--weight-cache, docs/DESIGN.md section 23)
 * against real moerpc-server processes:
 *
 *   hit_is_bit_identical_to_packing: bf16 and int4; a miss writes the cache once serving,
 *     the next start maps it ("hit") and checks it in the background; Forward outputs with
 *     the cache (written and mapped) are bit-identical to a server without one;
 *   every_mismatch_is_refused_and_rebuilt: another model, format, ISA, owned set (not
 *     covered), layout version and manifest version are each refused naming the field, the
 *     cache is rebuilt for the new server and its next start is a hit (also a model whose
 *     files were rewritten: same fingerprint, other mtimes); a smaller owned set
 *     is covered and served from the cache;
 *   numa_split_mismatch_is_refused: a cache of 1 slice per expert under a forced 2-node split
 *     (MOERPC_TEST_FORCE_SPLIT) and back are refused and rebuilt; the 2-slice cache hits and
 *     serves what a 2-slice server without cache serves;
 *   truncated_and_flipped_are_detected: a truncated file at the start (size check), a
 *     flipped byte before readiness (--verify-cache), and a flipped byte after readiness
 *     (background check: NOT_SERVING, Forward UNAVAILABLE naming the checksum, repacked,
 *     SERVING again with the right outputs, cache rewritten);
 *   kill9_during_write_leaves_no_usable_cache: SIGKILL while the first cache is written
 *     leaves no manifest (the next start misses and writes it, no temporary left behind);
 *     SIGKILL while a new cache replaces an old one leaves the old one, still valid;
 *   load_experts_uses_and_extends_the_cache: a LoadExperts of pairs the cache lacks adds a
 *     segment; after a restart the same LoadExperts maps them from the cache, same outputs.
 */
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "gpu_client/rpc/moerpc_client.h"
#include "tests/integration/util.h"
#include "tests/unit/mt.h"

#define H 64u
#define T 3u
#define MODEL_FLAGS "--layers 2 --experts 8 --topk 2 --hidden 64 --inter 64 --vocab 64 " \
                    "--heads 2 --kv-heads 1 --head-dim 32"
#define TOKEN "itest-cache-token-0123456789"

static char *tmp;
static char model[600], model2[600], cache[600], tok[700];

static void setup(void) {
  grpc_init();
  tmp = itu_tmpdir();
  snprintf(model, sizeof model, "%s/m", tmp);
  snprintf(model2, sizeof model2, "%s/m2", tmp);
  snprintf(cache, sizeof cache, "%s/cache", tmp);
  MT_EQ_INT(itu_make_model(model, MODEL_FLAGS " --seed 1"), 0);
  MT_EQ_INT(itu_make_model(model2, MODEL_FLAGS " --seed 2"), 0);
  snprintf(tok, sizeof tok, "%s/tok", tmp);
  FILE *f = fopen(tok, "w");
  MT_TRUE(f != NULL);
  fputs(TOKEN "\n", f);
  MT_EQ_INT(fclose(f), 0);
  MT_EQ_INT(chmod(tok, 0600), 0);
}

static void teardown(void) {
  unsetenv("MOERPC_TEST_FORCE_SPLIT");
  unsetenv("MOERPC_TEST_CACHE_WRITE_DELAY_MS");
  unsetenv("MOERPC_TEST_LOAD_DELAY_MS");
  itu_server_isa(NULL);
  itu_client_security(NULL, NULL, NULL, NULL, NULL);
  itu_rm_rf(tmp);
  grpc_shutdown();
}


/* Waits up to ms for needle in s's log; true when it appeared. */
static bool wait_log(const itu_server *s, const char *needle, int ms) {
  for (int t = 0; t <= ms; t += 10) {
    if (strstr(itu_log_text(s), needle)) return true;
    usleep(10000);
  }
  fprintf(stderr, "itest_cache: \"%s\" not in %s after %d ms; log:\n%s\n", needle, s->log, ms, itu_log_text(s));
  return false;
}

static void start(itu_server *s, const char *m, const char *extra) {
  char args[2000];
  snprintf(args, sizeof args, "--threads 2 --experts 0-7 --weight-cache %s %s", cache, extra ? extra : "");
  MT_EQ_INT(itu_server_start(s, m, args, tmp, 20000), 0);
}

static void stop(itu_server *s) {
  int st = 0;
  MT_EQ_INT(itu_server_stop(s, SIGTERM, 10000, &st), 0);
  MT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0);
}

/* T tokens of `layer` through experts of ids (top-2, weights 0.75 / 0.25) on the server at
 * address; 0 or the error. */
static int forward_at(const char *address, uint32_t layer, const int32_t *ids, float *out, mr_err *e) {
  char cluster[700];
  snprintf(cluster, sizeof cluster, "%s/cluster-%s.json", tmp, strchr(address, ':') + 1);
  FILE *f = fopen(cluster, "w");
  MT_TRUE(f != NULL);
  fprintf(f, "{\"token_file\": \"%s\", \"servers\": [{\"name\": \"s0\", \"address\": \"%s\"}]}\n",
          tok, address);
  MT_EQ_INT(fclose(f), 0);
  gc_cluster *c = NULL;
  int rc = gc_cluster_open(&c, cluster, NULL, e);
  if (rc) return rc;
  static float in[T * H];
  for (uint32_t i = 0; i < T * H; i++) in[i] = (float)((int)(i % 11) - 5) * 0.0625f;
  float w[T * 2];
  for (uint32_t t = 0; t < T; t++) {
    w[2 * t] = 0.75f;
    w[2 * t + 1] = 0.25f;
  }
  gc_layer_req q = {.layer = layer, .n_tokens = T, .top_k = 2, .ids = ids, .weights = w, .x = in,
                    .dtype = MR_DTYPE_F32};
  rc = gc_layer_forward(c, &q, out, e);
  gc_cluster_close(c);
  return rc;
}

static const int32_t ids_a[T * 2] = {0, 1, 2, 3, 1, 3};
static const int32_t ids_b[T * 2] = {4, 5, 5, 0, 4, 1};

/* Outputs of both layers for ids_a: out[2 * T * H]. */
static void forward2(const itu_server *s, float *out) {
  mr_err e;
  MT_OK(forward_at(s->address, 0, ids_a, out, &e), &e);
  MT_OK(forward_at(s->address, 1, ids_a, out + T * H, &e), &e);
}

/* The one data file of the cache whose name contains part (first found), in path. */
static bool cache_file(const char *part, char *path, size_t len) {
  char name[300];
  DIR *d = opendir(cache);
  if (!d) return false;
  struct dirent *de;
  bool found = false;
  while (!found && (de = readdir(d)))
    if (de->d_name[0] == 'w' && strstr(de->d_name, part)) {
      snprintf(name, sizeof name, "%s", de->d_name);
      char full[1000];
      snprintf(full, sizeof full, "%s/%s", cache, name);
      size_t n = strlen(full) < len ? strlen(full) : len - 1;
      memcpy(path, full, n);
      path[n] = '\0';
      found = true;
    }
  closedir(d);
  return found;
}

static bool exists(const char *name) {
  char p[800];
  snprintf(p, sizeof p, "%s/%s", cache, name);
  return access(p, F_OK) == 0;
}

static void flip_byte(const char *path, long off) {
  int fd = open(path, O_RDWR);
  MT_TRUE(fd >= 0);
  unsigned char b;
  MT_EQ_INT((int)pread(fd, &b, 1, off), 1);
  b ^= 0x10;
  MT_EQ_INT((int)pwrite(fd, &b, 1, off), 1);
  close(fd);
}

/* Replaces the first `from` in the manifest by `to`. */
static void edit_manifest(const char *from, const char *to) {
  char p[800];
  snprintf(p, sizeof p, "%s/manifest.json", cache);
  char *text = NULL;
  size_t len = 0;
  mr_err e;
  MT_OK(mr_file_read(p, 1 << 20, &text, &len, &e), &e);
  char *at = strstr(text, from);
  MT_TRUE(at != NULL);
  FILE *f = fopen(p, "w");
  MT_TRUE(f != NULL);
  fwrite(text, 1, (size_t)(at - text), f);
  fputs(to, f);
  fputs(at + strlen(from), f);
  MT_EQ_INT(fclose(f), 0);
  mr_free(text);
}

MT_TEST(hit_is_bit_identical_to_packing) {
  setup();
  static const char *const quants[] = {"", "--quant int4 --group 32"};
  for (int q = 0; q < 2; q++) {
    itu_server s;
    static float ref[2 * T * H], out[2 * T * H];
    char plain[200];
    snprintf(plain, sizeof plain, "--threads 2 --experts 0-7 %s", quants[q]);
    MT_EQ_INT(itu_server_start(&s, model, plain, tmp, 20000), 0); /* no cache */
    forward2(&s, ref);
    stop(&s);
    itu_rm_rf(cache);
    start(&s, model, quants[q]);
    MT_CONTAINS(itu_log_text(&s), "weight cache: miss");
    MT_TRUE(wait_log(&s, "weight cache: written", 10000));
    forward2(&s, out);
    MT_TRUE(memcmp(out, ref, sizeof out) == 0);
    stop(&s);
    MT_TRUE(exists("manifest.json"));
    start(&s, model, quants[q]);
    MT_CONTAINS(itu_log_text(&s), "weight cache: hit");
    MT_CONTAINS(itu_log_text(&s), "mapped from the weight cache");
    MT_TRUE(wait_log(&s, "all checksums match", 10000));
    forward2(&s, out);
    MT_TRUE(memcmp(out, ref, sizeof out) == 0); /* bit-identical */
    stop(&s);
  }
  teardown();
}

/* Starts the baseline (model, bf16, experts 0-3) until its cache is written or hit. */
static void baseline(void) {
  itu_server s;
  start(&s, model, "--experts 0-3");
  if (!strstr(itu_log_text(&s), "weight cache: hit")) MT_TRUE(wait_log(&s, "weight cache: written", 10000));
  stop(&s);
}

/* Starts m with extra: the cache must be refused naming why, then rebuilt; the next start
 * with the same flags hits. */
static void expect_refused(const char *m, const char *extra, const char *why) {
  itu_server s;
  start(&s, m, extra);
  MT_CONTAINS(itu_log_text(&s), "weight cache: refused (made for another server)");
  MT_CONTAINS(itu_log_text(&s), why);
  MT_TRUE(wait_log(&s, "weight cache: written", 10000));
  stop(&s);
  start(&s, m, extra);
  MT_CONTAINS(itu_log_text(&s), "weight cache: hit");
  stop(&s);
}

MT_TEST(every_mismatch_is_refused_and_rebuilt) {
  setup();
  itu_server s;
  baseline();
  expect_refused(model2, "--experts 0-3", "model_fingerprint = ");
  baseline();
  expect_refused(model, "--experts 0-3 --quant int8", "format = bf16, this server packs int8");
  baseline();
  /* The ISA: forcing the reference kernels (where this CPU has a fast bf16 path). */
  start(&s, model, "--experts 0-3");
  bool fast = strstr(itu_log_text(&s), "isa ref for bf16") == NULL;
  stop(&s);
  if (fast) {
    itu_server_isa("ref");
    expect_refused(model, "--experts 0-3", "this server's bf16 kernels run on ref");
    itu_server_isa(NULL);
    baseline();
  }
  /* The owned set: experts 4-5 are in no segment. */
  expect_refused(model, "--experts 0-5", "owned set: layer 0 expert 4 is not in the cache");
  /* A subset of the cached pairs is covered: served from the cache. */
  start(&s, model, "--experts 1-2");
  MT_CONTAINS(itu_log_text(&s), "weight cache: hit");
  stop(&s);
  baseline();
  /* The same bytes, rewritten (mtime): the fingerprint samples only the shards' ends. */
  char shard[700];
  snprintf(shard, sizeof shard, "%s/model.safetensors", model);
  struct timespec ts[2] = {{.tv_nsec = UTIME_NOW}, {.tv_nsec = UTIME_NOW}};
  MT_EQ_INT(utimensat(AT_FDCWD, shard, ts, 0), 0);
  expect_refused(model, "--experts 0-3", "model_files = ");
  edit_manifest("\"layout_version\":\t1", "\"layout_version\":\t2");
  expect_refused(model, "--experts 0-3", "layout_version = 2, this server packs layout 1");
  edit_manifest("\"version\":\t1", "\"version\":\t7");
  expect_refused(model, "--experts 0-3", "version = 7, this server reads 1");
  teardown();
}

MT_TEST(numa_split_mismatch_is_refused) {
  setup();
  itu_server s;
  static float ref2[2 * T * H], out[2 * T * H];
  setenv("MOERPC_TEST_FORCE_SPLIT", "2", 1);
  MT_EQ_INT(itu_server_start(&s, model, "--threads 2 --experts 0-7", tmp, 20000), 0); /* 2 slices, no cache */
  forward2(&s, ref2);
  stop(&s);
  unsetenv("MOERPC_TEST_FORCE_SPLIT");
  start(&s, model, "");
  MT_TRUE(wait_log(&s, "weight cache: written", 10000));
  stop(&s);
  setenv("MOERPC_TEST_FORCE_SPLIT", "2", 1);
  start(&s, model, "");
  MT_CONTAINS(itu_log_text(&s), "weight cache: refused (made for another server)");
  MT_CONTAINS(itu_log_text(&s), "slices: 1 NUMA slice(s) per expert, this server splits into 2");
  MT_TRUE(wait_log(&s, "(2 file(s), manifest last)", 10000));
  stop(&s);
  start(&s, model, "");
  MT_CONTAINS(itu_log_text(&s), "weight cache: hit");
  forward2(&s, out);
  MT_TRUE(memcmp(out, ref2, sizeof out) == 0);
  stop(&s);
  unsetenv("MOERPC_TEST_FORCE_SPLIT");
  start(&s, model, "");
  MT_CONTAINS(itu_log_text(&s), "slices: 2 NUMA slice(s) per expert, this server splits into 1");
  MT_TRUE(wait_log(&s, "weight cache: written", 10000));
  stop(&s);
  teardown();
}

MT_TEST(truncated_and_flipped_are_detected) {
  setup();
  itu_server s;
  static float ref[2 * T * H], out[2 * T * H];
  start(&s, model, "");
  MT_TRUE(wait_log(&s, "weight cache: written", 10000));
  forward2(&s, ref);
  stop(&s);
  char path[800];
  /* Truncated: the size check at start, whatever the flags. */
  MT_TRUE(cache_file(".n0.bin", path, sizeof path));
  struct stat st;
  MT_EQ_INT(stat(path, &st), 0);
  MT_EQ_INT(truncate(path, st.st_size - 64), 0);
  start(&s, model, "");
  MT_CONTAINS(itu_log_text(&s), "weight cache: corrupt");
  MT_CONTAINS(itu_log_text(&s), "(truncated or replaced)");
  MT_TRUE(wait_log(&s, "weight cache: written", 10000));
  forward2(&s, out);
  MT_TRUE(memcmp(out, ref, sizeof out) == 0);
  stop(&s);
  /* A flipped byte, checked before readiness. */
  MT_TRUE(cache_file(".n0.bin", path, sizeof path));
  flip_byte(path, 1000);
  start(&s, model, "--verify-cache");
  MT_CONTAINS(itu_log_text(&s), "weight cache: corrupt");
  MT_CONTAINS(itu_log_text(&s), "(corrupt)");
  MT_CONTAINS(itu_log_text(&s), "crc32");
  MT_TRUE(strstr(itu_log_text(&s), "mapped from the weight cache") == NULL);
  forward2(&s, out);
  MT_TRUE(memcmp(out, ref, sizeof out) == 0);
  MT_TRUE(wait_log(&s, "weight cache: written", 10000));
  stop(&s);
  /* A flipped byte found after readiness: the server stops serving those weights, repacks
   * them (slowly here: 100 ms an expert) and serves again. */
  MT_TRUE(cache_file(".n0.bin", path, sizeof path));
  flip_byte(path, 5000);
  setenv("MOERPC_TEST_LOAD_DELAY_MS", "100", 1);
  char args[1000];
  snprintf(args, sizeof args, "--threads 2 --experts 0-7 --weight-cache %s", cache);
  MT_EQ_INT(itu_server_spawn(&s, model, args, tmp), 0);
  MT_TRUE(wait_log(&s, "the weights mapped from it are not served from now on", 10000));
  MT_CONTAINS(itu_log_text(&s), "weight cache: hit");
  MT_EQ_INT(itu_health(s.address, 2000), 2); /* NOT_SERVING */
  mr_err e;
  MT_TRUE(forward_at(s.address, 0, ids_a, out, &e) != 0);
  MT_CONTAINS(e.msg, "weight cache failed its checksum");
  MT_TRUE(wait_log(&s, "serving again", 20000));
  MT_EQ_INT(itu_health(s.address, 2000), 1); /* SERVING */
  forward2(&s, out);
  MT_TRUE(memcmp(out, ref, sizeof out) == 0);
  MT_TRUE(wait_log(&s, "weight cache: written", 10000));
  stop(&s);
  unsetenv("MOERPC_TEST_LOAD_DELAY_MS");
  start(&s, model, "--verify-cache");
  MT_CONTAINS(itu_log_text(&s), "weight cache: hit");
  forward2(&s, out);
  MT_TRUE(memcmp(out, ref, sizeof out) == 0);
  stop(&s);
  teardown();
}

/* Waits until the cache directory holds a temporary data file. */
static bool wait_tmp_file(int ms) {
  char path[800];
  for (int t = 0; t <= ms; t += 5) {
    if (cache_file(".bin.tmp", path, sizeof path)) return true;
    usleep(5000);
  }
  return false;
}

MT_TEST(kill9_during_write_leaves_no_usable_cache) {
  setup();
  itu_server s;
  static float ref[2 * T * H], out[2 * T * H];
  int st;
  /* The first cache, killed while its data file is written: no manifest. */
  setenv("MOERPC_TEST_CACHE_WRITE_DELAY_MS", "200", 1);
  start(&s, model, "");
  MT_TRUE(wait_tmp_file(10000));
  kill(s.pid, SIGKILL);
  MT_EQ_INT(waitpid(s.pid, &st, 0), s.pid);
  MT_FALSE(exists("manifest.json"));
  unsetenv("MOERPC_TEST_CACHE_WRITE_DELAY_MS");
  start(&s, model, "");
  MT_CONTAINS(itu_log_text(&s), "weight cache: miss");
  MT_CONTAINS(itu_log_text(&s), "no manifest");
  MT_TRUE(wait_log(&s, "weight cache: written", 10000));
  forward2(&s, ref);
  stop(&s);
  char path[800];
  MT_FALSE(cache_file(".tmp", path, sizeof path)); /* the killed write's file was swept */
  /* A new cache replacing a valid one, killed: the old one stays, whole and usable. */
  setenv("MOERPC_TEST_CACHE_WRITE_DELAY_MS", "200", 1);
  start(&s, model, "--quant int8");
  MT_CONTAINS(itu_log_text(&s), "weight cache: refused");
  MT_TRUE(wait_tmp_file(10000));
  kill(s.pid, SIGKILL);
  MT_EQ_INT(waitpid(s.pid, &st, 0), s.pid);
  unsetenv("MOERPC_TEST_CACHE_WRITE_DELAY_MS");
  start(&s, model, "--verify-cache");
  MT_CONTAINS(itu_log_text(&s), "weight cache: hit");
  forward2(&s, out);
  MT_TRUE(memcmp(out, ref, sizeof out) == 0);
  stop(&s);
  teardown();
}

/* Loads experts 4-7 of both layers through the control calls and waits for DONE. */
static void load_47(const itu_server *s) {
  static uint8_t m[2 * 8];
  memset(m, 0, sizeof m);
  for (int x = 4; x < 8; x++) m[x] = m[8 + x] = 1;
  uint64_t pairs = 0;
  mr_err e;
  MT_OK(itu_load_pairs(s->address, tok, tmp, m, 2, 8, 5000, &pairs, &e), &e);
  MT_EQ_U64(pairs, 8);
}

MT_TEST(load_experts_uses_and_extends_the_cache) {
  setup();
  itu_server s;
  itu_client_security(NULL, NULL, NULL, NULL, TOKEN);
  char extra[1000];
  snprintf(extra, sizeof extra, "--experts 0-3 --auth-token-file %s", tok);
  static float ref[T * H], out[T * H];
  mr_err e;
  start(&s, model, extra);
  MT_TRUE(wait_log(&s, "weight cache: written", 10000));
  load_47(&s);
  MT_CONTAINS(itu_log_text(&s), "placement: load 1 done");
  MT_TRUE(wait_log(&s, "8 pairs, 0.000 GB", 10000)); /* the segment of the loaded pairs */
  MT_TRUE(strstr(itu_log_text(&s), "mapped from the weight cache, the rest") == NULL);
  MT_OK(forward_at(s.address, 1, ids_b, ref, &e), &e);
  stop(&s);
  start(&s, model, extra);
  MT_CONTAINS(itu_log_text(&s), "weight cache: hit");
  MT_CONTAINS(itu_log_text(&s), "from 2 segment(s)");
  MT_TRUE(wait_log(&s, "all checksums match", 10000));
  load_47(&s);
  MT_CONTAINS(itu_log_text(&s), "placement: load 1: 8 of 8 pairs mapped from the weight cache");
  MT_OK(forward_at(s.address, 1, ids_b, out, &e), &e);
  MT_TRUE(memcmp(out, ref, sizeof out) == 0);
  stop(&s);
  teardown();
}

MT_MAIN()
