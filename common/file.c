/*
 * common/file.c - whole-file reads and path joins for the JSON readers of common/.
 */
#include "common/internal.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

int mr_file_read(const char *path, size_t max_bytes, char **out, size_t *len, mr_err *e) {
  int rc = 0;
  char *buf = NULL;
  *out = NULL;
  if (len) *len = 0;
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    int err = errno;
    return mr_err_set(e, err == ENOENT ? MR_ENOTFOUND : MR_EIO, "%s: cannot open: %s", path,
                      strerror(err));
  }
  struct stat sb;
  if (fstat(fd, &sb) != 0) {
    rc = mr_err_set(e, MR_EIO, "%s: fstat: %s", path, strerror(errno));
    goto out_close_fd;
  }
  if (!S_ISREG(sb.st_mode)) {
    rc = mr_err_set(e, MR_EINVAL, "%s: not a regular file", path);
    goto out_close_fd;
  }
  if ((uint64_t)sb.st_size > (uint64_t)max_bytes) {
    rc = mr_err_set(e, MR_ERANGE, "%s: size %lld bytes exceeds the limit of %zu bytes", path,
                    (long long)sb.st_size, max_bytes);
    goto out_close_fd;
  }
  size_t size = (size_t)sb.st_size;
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

int mr__path_join(char *buf, size_t len, const char *dir, const char *name) {
  size_t dl = strlen(dir);
  /* "dir/" + name; a dir that already ends in '/' gets no second one. */
  const char *sep = (dl > 0 && dir[dl - 1] == '/') ? "" : "/";
  int n = snprintf(buf, len, "%s%s%s", dir, sep, name);
  if (n < 0 || (size_t)n >= len) return MR_ERANGE;
  return 0;
}
