/*
 * st_poke.h - rewriting bytes of one tensor in a one-file safetensors checkpoint, for tests
 * that make a model file bad (a NaN weight) or different (other block scales) in place.
 */
#ifndef MOERPC_TESTS_UNIT_ST_POKE_H
#define MOERPC_TESTS_UNIT_ST_POKE_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/unit/mt.h"

/* Writes n bytes of src over tensor name's data from byte `at` on, in the checkpoint file
 * path (the header's data_offsets, found after the name). */
static inline void st_poke(const char *path, const char *name, uint64_t at, const void *src, size_t n) {
  FILE *f = fopen(path, "r+b");
  MT_TRUE(f != NULL);
  uint64_t hn = 0;
  MT_EQ_INT(fread(&hn, 8, 1, f), 1);
  char *h = calloc(1, hn + 1);
  MT_TRUE(h != NULL);
  MT_EQ_INT(fread(h, 1, hn, f), hn);
  char key[300];
  snprintf(key, sizeof key, "\"%s\"", name);
  const char *k = strstr(h, key), *off = k ? strstr(k, "\"data_offsets\"") : NULL;
  MT_TRUE(off != NULL);
  unsigned long long b0 = 0;
  MT_EQ_INT(sscanf(strchr(off, '[') + 1, "%llu", &b0), 1);
  MT_EQ_INT(fseek(f, (long)(8 + hn + b0 + at), SEEK_SET), 0);
  MT_EQ_INT(fwrite(src, 1, n, f), n);
  MT_EQ_INT(fclose(f), 0);
  free(h);
}

#endif
