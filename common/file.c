/*
 * common/file.c - whole-file reads, the regular-file check every reader of a user-named file
 * goes through (and the mode check of a secret's file), atomic writes, and path joins for
 * the JSON readers of common/.
 */
#include "common/internal.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* What a file that is not a regular file is, for the error message. */
static const char *file_kind(mode_t m) {
  if (S_ISFIFO(m)) return "a FIFO";
  if (S_ISCHR(m)) return "a character device";
  if (S_ISBLK(m)) return "a block device";
  if (S_ISDIR(m)) return "a directory";
  if (S_ISSOCK(m)) return "a socket";
  return "not a plain file";
}

/* Whether the mode bits of sb let someone other than its owner read a secret (see
 * mr_file_read_private in mr.h): any access for others is refused; access for the group only
 * when root owns the file and the group may read and nothing more (a root-owned key in a
 * dedicated group, as Debian's ssl-cert group or a Kubernetes secret volume with fsGroup
 * lays it out; PostgreSQL accepts its key file on the same terms). */
static int file_private_check(const struct stat *sb, const char *path, mr_err *e) {
  const mode_t m = sb->st_mode & 0777;
  const bool root_group_read = sb->st_uid == 0 && (m & S_IRWXG) == S_IRGRP;
  if (!(m & S_IRWXO) && (!(m & S_IRWXG) || root_group_read)) return 0;
  return mr_err_set(e, MR_EINVAL, "%s: mode %04o, must not be readable by group or others "
                    "(chmod 600%s)", path, (unsigned)m,
                    (m & S_IRWXO) ? "" : "; a group may read it only when root owns the file");
}

/* mr_file_open_regular, with the secret-file check of mr_file_read_private when private. */
static int file_open(const char *path, bool private, int *fd_out, uint64_t *size, mr_err *e) {
  *fd_out = -1;
  if (size) *size = 0;
  /* O_NONBLOCK: opening a FIFO without a writer (or some devices) would otherwise block
   * before fstat could tell what it is. O_NOCTTY: a terminal named by mistake does not
   * become our controlling terminal. */
  int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (fd < 0) {
    int err = errno;
    return mr_err_set(e, err == ENOENT ? MR_ENOTFOUND : MR_EIO, "%s: cannot open: %s", path,
                      strerror(err));
  }
  int rc = 0;
  struct stat sb;
  if (fstat(fd, &sb) != 0) {
    rc = mr_err_set(e, MR_EIO, "%s: fstat: %s", path, strerror(errno));
    goto out_close_fd;
  }
  if (!S_ISREG(sb.st_mode)) {
    rc = mr_err_set(e, MR_EINVAL, "%s: not a regular file (%s)", path, file_kind(sb.st_mode));
    goto out_close_fd;
  }
  /* The descriptor's own mode: a file swapped after a check by name cannot slip through. */
  if (private && (rc = file_private_check(&sb, path, e))) goto out_close_fd;
  /* A regular file: reads block as usual from here on. */
  int fl = fcntl(fd, F_GETFL);
  if (fl < 0 || fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) != 0) {
    rc = mr_err_set(e, MR_EIO, "%s: fcntl: %s", path, strerror(errno));
    goto out_close_fd;
  }
  if (size) *size = (uint64_t)sb.st_size;
  *fd_out = fd;
  return 0;
out_close_fd:
  close(fd);
  return rc;
}

int mr_file_open_regular(const char *path, int *fd_out, uint64_t *size, mr_err *e) {
  return file_open(path, false, fd_out, size, e);
}

static int file_read(const char *path, bool private, size_t max_bytes, char **out, size_t *len,
                     mr_err *e) {
  int rc = 0;
  char *buf = NULL;
  uint64_t fsize = 0;
  int fd = -1;
  *out = NULL;
  if (len) *len = 0;
  rc = file_open(path, private, &fd, &fsize, e);
  if (rc) return rc;
  if (fsize > (uint64_t)max_bytes) {
    rc = mr_err_set(e, MR_ERANGE, "%s: size %llu bytes exceeds the limit of %zu bytes", path,
                    (unsigned long long)fsize, max_bytes);
    goto out_close_fd;
  }
  size_t size = (size_t)fsize;
  buf = mr_malloc(size + 1);
  if (!buf) {
    rc = mr_err_set(e, MR_ENOMEM, "%s: cannot allocate %zu bytes", path, size + 1);
    goto out_close_fd;
  }
  /* Read until EOF rather than trusting st_size alone: the file may shrink under us, and
   * it must never grow past the buffer. */
  size_t got = 0;
  for (;;) {
    ssize_t n = read(fd, buf + got, size - got);
    if (n < 0) {
      if (errno == EINTR) continue;
      rc = mr_err_set(e, MR_EIO, "%s: read: %s", path, strerror(errno));
      goto out_free_buf;
    }
    if (n == 0) break;
    got += (size_t)n;
    if (got == size) break;
  }
  buf[got] = '\0';
  *out = buf;
  if (len) *len = got;
  buf = NULL;
out_free_buf:
  mr_free(buf);
out_close_fd:
  close(fd);
  return rc;
}

int mr_file_read(const char *path, size_t max_bytes, char **out, size_t *len, mr_err *e) {
  return file_read(path, false, max_bytes, out, len, e);
}

int mr_file_parse(const char *path, size_t max_bytes, mr_file_parse_fn parse, void *ctx, mr_err *e) {
  char *text = NULL;
  size_t len = 0;
  int rc = mr_file_read(path, max_bytes, &text, &len, e);
  if (!rc) rc = parse(ctx, text, len, path, e);
  mr_free(text);
  return rc;
}

int mr_file_read_private(const char *path, size_t max_bytes, char **out, size_t *len, mr_err *e) {
  return file_read(path, true, max_bytes, out, len, e);
}

int mr__path_join(char *buf, size_t len, const char *dir, const char *name) {
  size_t dl = strlen(dir);
  /* "dir/" + name; a dir that already ends in '/' gets no second one. */
  const char *sep = (dl > 0 && dir[dl - 1] == '/') ? "" : "/";
  int n = snprintf(buf, len, "%s%s%s", dir, sep, name);
  if (n < 0 || (size_t)n >= len) return MR_ERANGE;
  return 0;
}

static int file_write_all(FILE *f, const void *data, size_t len, bool sync) {
  bool ok = fwrite(data, 1, len, f) == len;
  ok = fflush(f) == 0 && ok;
  if (sync) ok = fsync(fileno(f)) == 0 && ok;
  int saved = errno;
  ok = fclose(f) == 0 && ok;
  if (!ok && saved) errno = saved;
  return ok ? 0 : -1;
}

int mr_file_write_atomic(const char *path, const void *data, size_t len, mr_err *e) {
  struct stat sb;
  if (lstat(path, &sb) == 0 && !S_ISREG(sb.st_mode)) {
    FILE *f = fopen(path, "w");
    if (!f) return mr_err_set(e, MR_EIO, "%s: cannot open: %s", path, strerror(errno));
    if (file_write_all(f, data, len, false) != 0)
      return mr_err_set(e, MR_EIO, "%s: write failed: %s", path, strerror(errno));
    return 0;
  }
  char tmp[4200];
  if (snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid()) >= (int)sizeof tmp)
    return mr_err_set(e, MR_ERANGE, "%s: path of %zu bytes too long (most %zu)", path,
                      strlen(path), sizeof tmp - 24);
  FILE *f = fopen(tmp, "w");
  if (!f) return mr_err_set(e, MR_EIO, "%s: cannot create: %s", tmp, strerror(errno));
  if (file_write_all(f, data, len, true) != 0) {
    int rc = mr_err_set(e, MR_EIO, "%s: write failed: %s", tmp, strerror(errno));
    unlink(tmp);
    return rc;
  }
  if (rename(tmp, path) != 0) {
    int rc = mr_err_set(e, MR_EIO, "%s: rename from %s failed: %s", path, tmp, strerror(errno));
    unlink(tmp);
    return rc;
  }
  return 0;
}
