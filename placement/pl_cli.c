/*
 * placement/pl_cli.c - what the subcommands of moerpc-place share: the --log flag and the
 * byte figures of their messages (placement/internal.h).
 */
#include "placement/internal.h"

#include <stdio.h>

void pl__bytes_human(uint64_t b, char *buf, size_t n) {
  static const char *u[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double v = (double)b;
  int i = 0;
  while (v >= 1024 && i < 5) {
    v /= 1024;
    i++;
  }
  if (i == 0) snprintf(buf, n, "%llu B", (unsigned long long)b);
  else snprintf(buf, n, "%.2f %s", v, u[i]);
}

int pl__log_level_set(const char *prog, const char *level) {
  int lvl;
  if (mr_log_parse_level(level, &lvl) != 0) {
    fprintf(stderr, "%s: --log = \"%s\", must be error, warn, info or debug\n", prog, level);
    return 2;
  }
  mr_log_set_level(lvl);
  return 0;
}
