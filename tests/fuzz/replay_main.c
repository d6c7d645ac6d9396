/*
 * replay_main.c - runs a libFuzzer target over a saved corpus without libFuzzer, so that
 * `make test` replays every corpus with any compiler (SQLite's fuzzcheck does the same).
 *
 *   replay_fuzz_x [-v] DIR_OR_FILE...
 *
 * Each input runs in its own forked process with a timeout, so that one crashing or
 * hanging input fails alone and the others still run. An input passes if
 * LLVMFuzzerTestOneInput returns without crashing and, for a named seed, with the verdict
 * its name promises (fuzz.h): ok_* accepted, bad_* refused. The input is copied into a
 * buffer of exactly its size so that an instrumented build catches a read past its end.
 * -v prints every input's verdict. Prints "<n> inputs replayed (<a> ok_ accepted, <r> bad_
 * refused)" and then "N passed, N failed" (the line tests/run.sh counts).
 */
#include <dirent.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tests/fuzz/fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define REPLAY_TIMEOUT_S 20
#define REPLAY_MAX_INPUT ((size_t)64 << 20)
/* The child's exit status carries the target's verdict back: REPLAY_EXIT_BASE + verdict. */
#define REPLAY_EXIT_BASE 40

static int passed, failed, replayed, ok_accepted, bad_refused;
static bool verbose;

/* What the file's name promises: FUZZ_ACCEPTED (ok_*), FUZZ_REFUSED (bad_*) or nothing. */
static int expected_verdict(const char *path) {
  const char *base = strrchr(path, '/');
  base = base ? base + 1 : path;
  if (strncmp(base, "ok_", 3) == 0) return FUZZ_ACCEPTED;
  if (strncmp(base, "bad_", 4) == 0) return FUZZ_REFUSED;
  return FUZZ_NO_VERDICT;
}

static const char *verdict_name(int v) {
  return v == FUZZ_ACCEPTED ? "accepted" : v == FUZZ_REFUSED ? "refused" : "no verdict";
}

static void replay_file(const char *path) {
  FILE *f = fopen(path, "rb");
  if (!f) {
    fprintf(stderr, "FAIL %s: cannot open\n", path);
    failed++;
    return;
  }
  struct stat sb;
  if (fstat(fileno(f), &sb) != 0 || (size_t)sb.st_size > REPLAY_MAX_INPUT) {
    fprintf(stderr, "FAIL %s: cannot stat or larger than %zu bytes\n", path, REPLAY_MAX_INPUT);
    fclose(f);
    failed++;
    return;
  }
  size_t size = (size_t)sb.st_size;
  uint8_t *buf = malloc(size ? size : 1);
  if (!buf || fread(buf, 1, size, f) != size) {
    fprintf(stderr, "FAIL %s: cannot read\n", path);
    free(buf);
    fclose(f);
    failed++;
    return;
  }
  fclose(f);
  replayed++;
  fflush(NULL);
  pid_t pid = fork();
  if (pid < 0) {
    perror("fork");
    free(buf);
    failed++;
    return;
  }
  if (pid == 0) {
    alarm(REPLAY_TIMEOUT_S);
    fuzz_verdict = FUZZ_NO_VERDICT;
    LLVMFuzzerTestOneInput(size ? buf : NULL, size);
    _exit(REPLAY_EXIT_BASE + fuzz_verdict);
  }
  free(buf);
  int st = 0;
  while (waitpid(pid, &st, 0) < 0) {
  }
  int code = WIFEXITED(st) ? WEXITSTATUS(st) - REPLAY_EXIT_BASE : -1;
  if (code >= FUZZ_NO_VERDICT && code <= FUZZ_REFUSED) {
    int want = expected_verdict(path);
    if (verbose) printf("%-8s %s\n", verdict_name(code), path);
    if (want != FUZZ_NO_VERDICT && code != want) {
      fprintf(stderr, "FAIL %s: %s by the target, but its name promises %s\n", path,
              verdict_name(code), verdict_name(want));
      failed++;
      return;
    }
    ok_accepted += want == FUZZ_ACCEPTED;
    bad_refused += want == FUZZ_REFUSED;
    passed++;
    return;
  }
  failed++;
  if (WIFSIGNALED(st))
    fprintf(stderr, "FAIL %s: killed by signal %d%s\n", path, WTERMSIG(st),
            WTERMSIG(st) == SIGALRM ? " (timeout)" : "");
  else
    fprintf(stderr, "FAIL %s: exit status %d\n", path, WEXITSTATUS(st));
}

static int name_cmp(const void *a, const void *b) {
  return strcmp(*(char *const *)a, *(char *const *)b);
}

static void replay_path(const char *path) {
  struct stat sb;
  if (stat(path, &sb) != 0) {
    fprintf(stderr, "FAIL %s: no such file or directory\n", path);
    failed++;
    return;
  }
  if (!S_ISDIR(sb.st_mode)) {
    replay_file(path);
    return;
  }
  DIR *d = opendir(path);
  if (!d) {
    fprintf(stderr, "FAIL %s: cannot open directory\n", path);
    failed++;
    return;
  }
  /* Sorted, so that runs are reproducible and logs comparable. */
  char **names = NULL;
  size_t n = 0, cap = 0;
  struct dirent *de;
  while ((de = readdir(d)) != NULL) {
    if (de->d_name[0] == '.') continue;
    if (n == cap) {
      cap = cap ? cap * 2 : 64;
      char **g = realloc(names, cap * sizeof *g);
      if (!g) break;
      names = g;
    }
    size_t len = strlen(path) + strlen(de->d_name) + 2;
    names[n] = malloc(len);
    if (!names[n]) break;
    snprintf(names[n], len, "%s/%s", path, de->d_name);
    n++;
  }
  closedir(d);
  qsort(names, n, sizeof *names, name_cmp);
  for (size_t i = 0; i < n; i++) {
    replay_path(names[i]);
    free(names[i]);
  }
  free(names);
}

int main(int argc, char **argv) {
  int first = 1;
  if (argc > 1 && strcmp(argv[1], "-v") == 0) {
    verbose = true;
    first = 2;
  }
  if (argc <= first) {
    fprintf(stderr, "usage: %s [-v] CORPUS_DIR_OR_FILE...\n", argv[0]);
    return 2;
  }
  for (int i = first; i < argc; i++) replay_path(argv[i]);
  printf("%d inputs replayed (%d ok_ accepted, %d bad_ refused)\n", replayed, ok_accepted,
         bad_refused);
  printf("%d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}
