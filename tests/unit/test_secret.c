/*
 * test_secret.c - common/secret.c: token files (trim, limits, refusals that never quote the
 * token, FIFOs, modes that let group or others read), the constant-time compare, and the
 * log escaper.
 */
#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/mr.h"
#include "tests/unit/mt.h"

static char dir[64];

static void dir_cleanup(void) {
  char cmd[96];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  if (dir[0] && system(cmd) != 0) fprintf(stderr, "cleanup of %s failed\n", dir);
  dir[0] = '\0';
}

static const char *write_file(const char *name, const void *data, size_t n) {
  static char path[4][128];
  static int k;
  if (!dir[0]) {
    snprintf(dir, sizeof dir, "/tmp/mr-test-secret-XXXXXX");
    MT_TRUE(mkdtemp(dir) != NULL);
    mt_defer(dir_cleanup);
  }
  char *p = path[k++ & 3];
  snprintf(p, sizeof path[0], "%s/%s", dir, name);
  FILE *f = fopen(p, "wb");
  MT_TRUE(f != NULL);
  MT_EQ_U64(fwrite(data, 1, n, f), n);
  fclose(f);
  MT_EQ_INT(chmod(p, 0600), 0); /* a secret's file readable by others is refused */
  return p;
}

static int rd(const char *path, char *buf, size_t *len, mr_err *e) {
  mr_err_clear(e);
  return mr_secret_read(path, "--auth-token-file", buf, MR_SECRET_MAX_BYTES + 1, len, e);
}

MT_TEST(token_read_trims_one_newline) {
  char buf[MR_SECRET_MAX_BYTES + 1];
  size_t n;
  mr_err e;
  MT_OK(rd(write_file("t1", "s3cr3t-Token_value\n", 19), buf, &n, &e), &e);
  MT_EQ_STR(buf, "s3cr3t-Token_value");
  MT_EQ_U64(n, 18);
  MT_OK(rd(write_file("t2", "abc\r\n", 5), buf, &n, &e), &e);
  MT_EQ_STR(buf, "abc");
  MT_OK(rd(write_file("t3", "abc", 3), buf, &n, &e), &e);
  MT_EQ_U64(n, 3);
  /* Two newlines: the second one is part of the token, and not printable. */
  MT_EQ_INT(rd(write_file("t4", "abc\n\n", 5), buf, &n, &e), MR_EINVAL);
  MT_CONTAINS(e.msg, "byte 3 of the token is 0x0a");
}

MT_TEST(token_read_refusals_name_file_and_limit) {
  char buf[MR_SECRET_MAX_BYTES + 1];
  size_t n;
  mr_err e;
  const char *p = write_file("empty", "\n", 1);
  MT_EQ_INT(rd(p, buf, &n, &e), MR_EINVAL);
  MT_CONTAINS(e.msg, "--auth-token-file");
  MT_CONTAINS(e.msg, p);
  MT_CONTAINS(e.msg, "the token is empty");
  MT_CONTAINS(e.msg, "4096");
  static char big[MR_SECRET_MAX_BYTES + 2];
  memset(big, 'k', sizeof big);
  p = write_file("big", big, MR_SECRET_MAX_BYTES + 1);
  MT_EQ_INT(rd(p, buf, &n, &e), MR_ERANGE);
  MT_CONTAINS(e.msg, "the token is 4097 bytes, at most 4096");
  p = write_file("huge", big, sizeof big + 0);
  MT_EQ_INT(rd(p, buf, &n, &e), MR_ERANGE); /* 4098 bytes, no newline at the end */
  static char huger[10000];
  memset(huger, 'k', sizeof huger);
  p = write_file("huger", huger, sizeof huger);
  MT_EQ_INT(rd(p, buf, &n, &e), MR_ERANGE);
  MT_CONTAINS(e.msg, "larger than a token of at most 4096 bytes");
  MT_EQ_INT(rd(write_file("max", big, MR_SECRET_MAX_BYTES), buf, &n, &e), 0);
  MT_EQ_U64(n, MR_SECRET_MAX_BYTES);
  /* A space or a control byte: refused by position and value, the token is not quoted. */
  p = write_file("space", "Bearer hunter2", 14);
  MT_EQ_INT(rd(p, buf, &n, &e), MR_EINVAL);
  MT_CONTAINS(e.msg, "byte 6 of the token is 0x20");
  MT_TRUE(strstr(e.msg, "hunter2") == NULL);
  MT_EQ_STR(buf, "");
  p = write_file("nul", "ab\0cd", 5);
  MT_EQ_INT(rd(p, buf, &n, &e), MR_EINVAL);
  MT_CONTAINS(e.msg, "0x00");
  MT_EQ_INT(rd("/nonexistent/token", buf, &n, &e), MR_ENOTFOUND);
  MT_CONTAINS(e.msg, "--auth-token-file: /nonexistent/token: cannot open");
}

MT_TEST(token_fifo_refused_without_blocking) {
  char path[128];
  write_file("x", "x", 1);
  snprintf(path, sizeof path, "%s/fifo", dir);
  MT_EQ_INT(mkfifo(path, 0600), 0);
  alarm(10); /* blocking in open() would end the test here instead of hanging it */
  char buf[MR_SECRET_MAX_BYTES + 1];
  size_t n;
  mr_err e;
  int rc = rd(path, buf, &n, &e);
  alarm(0);
  unlink(path);
  MT_EQ_INT(rc, MR_EINVAL);
  MT_CONTAINS(e.msg, "--auth-token-file");
  MT_CONTAINS(e.msg, "not a regular file (a FIFO)");
}

/* A secret's file that group or others may read is refused, naming the path and the mode;
 * a root-owned file that its group may only read is the one exception (Debian's ssl-cert
 * group, a Kubernetes secret with fsGroup). */
MT_TEST(token_file_mode_refused_when_others_may_read) {
  char buf[MR_SECRET_MAX_BYTES + 1];
  size_t n;
  mr_err e;
  const char *p = write_file("mode", "s3cr3t\n", 7);
  MT_OK(rd(p, buf, &n, &e), &e);
  MT_EQ_INT(chmod(p, 0400), 0);
  MT_OK(rd(p, buf, &n, &e), &e);
  static const unsigned bad[] = {0644, 0604, 0602, 0601, 0660, 0620, 0610, 0444};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    MT_EQ_INT(chmod(p, bad[i]), 0);
    bool root_group_read = geteuid() == 0 && (bad[i] & 070) == 040 && !(bad[i] & 07);
    if (root_group_read) continue; /* the exception, checked below */
    MT_EQ_INT(rd(p, buf, &n, &e), MR_EINVAL);
    char want[64];
    snprintf(want, sizeof want, ": mode %04o, must not be readable by group or others", bad[i]);
    MT_CONTAINS(e.msg, "--auth-token-file");
    MT_CONTAINS(e.msg, p);
    MT_CONTAINS(e.msg, want);
    MT_CONTAINS(e.msg, "chmod 600");
    MT_TRUE(strstr(e.msg, "s3cr3t") == NULL);
    MT_EQ_STR(buf, "");
  }
  /* Group-readable: accepted only when root owns the file and the group may only read. */
  MT_EQ_INT(chmod(p, 0640), 0);
  if (geteuid() != 0) {
    MT_EQ_INT(rd(p, buf, &n, &e), MR_EINVAL);
    MT_CONTAINS(e.msg, "a group may read it only when root owns the file");
    return;
  }
  MT_OK(rd(p, buf, &n, &e), &e);
  MT_EQ_INT(chmod(p, 0440), 0);
  MT_OK(rd(p, buf, &n, &e), &e);
  MT_EQ_INT(chown(p, 65534, (gid_t)-1), 0); /* owned by nobody: no exception */
  MT_EQ_INT(rd(p, buf, &n, &e), MR_EINVAL);
  MT_CONTAINS(e.msg, ": mode 0440, must not be readable by group or others");
  MT_EQ_INT(chmod(p, 0400), 0);
  MT_OK(rd(p, buf, &n, &e), &e); /* root reads a 0400 file of another owner */
  /* mr_file_read_private alone (the TLS key reader) says the same, without a flag name. */
  char *t = NULL;
  MT_EQ_INT(chmod(p, 0644), 0);
  mr_err_clear(&e);
  MT_EQ_INT(mr_file_read_private(p, 100, &t, NULL, &e), MR_EINVAL);
  MT_TRUE(t == NULL);
  MT_CONTAINS(e.msg, ": mode 0644, must not be readable by group or others (chmod 600)");
  MT_OK(mr_file_read(p, 100, &t, NULL, &e), &e); /* a plain read does not care */
  mr_free(t);
}

MT_TEST(secret_equal) {
  MT_TRUE(mr_secret_equal("abc", 3, "abc", 3));
  MT_FALSE(mr_secret_equal("abc", 3, "abd", 3));
  MT_FALSE(mr_secret_equal("abc", 3, "abc\0", 4));
  MT_FALSE(mr_secret_equal("", 0, "a", 1));
  MT_TRUE(mr_secret_equal("", 0, "", 0));
  static char a[MR_SECRET_MAX_BYTES + 100], b[MR_SECRET_MAX_BYTES + 100];
  memset(a, 'x', sizeof a);
  memset(b, 'x', sizeof b);
  MT_TRUE(mr_secret_equal(a, MR_SECRET_MAX_BYTES + 7, b, MR_SECRET_MAX_BYTES + 7));
  b[MR_SECRET_MAX_BYTES + 6] = 'y'; /* the last byte differs */
  MT_FALSE(mr_secret_equal(a, MR_SECRET_MAX_BYTES + 7, b, MR_SECRET_MAX_BYTES + 7));
  /* Longer than the bound: never equal, even when identical. */
  MT_FALSE(mr_secret_equal(a, sizeof a, a, sizeof a));
}

static const char *esc(const char *s, size_t n, size_t cap) {
  static char out[512];
  size_t len = mr_log_escape(out, cap, s, n);
  MT_EQ_U64(len, strlen(out));
  MT_TRUE(len < cap);
  return out;
}

MT_TEST(log_escape_controls_and_utf8) {
  MT_EQ_STR(esc("plain name-1.2", 14, 64), "plain name-1.2");
  MT_EQ_STR(esc("a\nb\rc\td\\e", 9, 64), "a\\nb\\rc\\td\\\\e");
  MT_EQ_STR(esc("\x01\x1b[31m\x7f", 7, 64), "\\x01\\x1b[31m\\x7f");
  MT_EQ_STR(esc("nul\0x", 5, 64), "nul\\x00x");
  /* Valid UTF-8 passes; invalid bytes are escaped one by one. */
  MT_EQ_STR(esc("caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80", 14, 64),
            "caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80");
  MT_EQ_STR(esc("\xff\xc3", 2, 64), "\\xff\\xc3");              /* bad lead, cut sequence */
  MT_EQ_STR(esc("\xc0\xaf", 2, 64), "\\xc0\\xaf");              /* overlong '/' */
  MT_EQ_STR(esc("\xed\xa0\x80", 3, 64), "\\xed\\xa0\\x80");     /* a surrogate */
  MT_EQ_STR(esc("\xf4\x90\x80\x80", 4, 64), "\\xf4\\x90\\x80\\x80"); /* above U+10FFFF */
  MT_EQ_STR(esc(NULL, 5, 64), "");
}

MT_TEST(log_escape_truncates_with_marker) {
  MT_EQ_STR(esc("abcdefghij", 10, 11), "abcdefghij"); /* fits exactly: no marker */
  MT_EQ_STR(esc("abcdefghijk", 11, 11), "abcdefg...");
  /* Never half an escape or half a UTF-8 character before the marker. */
  MT_EQ_STR(esc("abcde\nfgh", 9, 10), "abcde...");
  MT_EQ_STR(esc("abcd\xc3\xa9xyz", 9, 9), "abcd...");
  MT_EQ_STR(esc("abc\xc3\xa9xyzw", 9, 9), "abc\xc3\xa9...");
  MT_EQ_STR(esc("abcde\xc3\xa9xyz", 10, 10), "abcde...");
  MT_EQ_STR(esc("abcdef", 6, 3), "..");
  char one[1] = {'z'};
  MT_EQ_U64(mr_log_escape(one, 1, "abc", 3), 0);
  MT_EQ_INT(one[0], '\0');
  MT_EQ_U64(mr_log_escape(one, 0, "abc", 3), 0);
  MT_EQ_INT(one[0], '\0');
  /* A long hostile name: bounded, one line. */
  static char evil[4000];
  for (size_t i = 0; i < sizeof evil; i++) evil[i] = i % 7 ? 'A' : '\n';
  const char *o = esc(evil, sizeof evil, MR_LOG_ESC_MAX);
  MT_TRUE(strlen(o) == MR_LOG_ESC_MAX - 1);
  MT_TRUE(strchr(o, '\n') == NULL);
  MT_CONTAINS(o, "...");
}

MT_MAIN()
