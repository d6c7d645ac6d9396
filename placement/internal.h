/*
 * placement/internal.h - internals shared between the files of placement/ (prefix pl__).
 *
 * Nothing here is part of the public contract (pl.h); other folders must not include it
 * (tests/check_layers.sh refuses another room's internal.h).
 */
#ifndef PL_INTERNAL_H
#define PL_INTERNAL_H

#include "placement/pl.h"

/* splitmix64 (Steele, Lea and Flood, 2014): advances *s and returns the next 64 random bits.
 * The planner's "random" strategy (a seeded Fisher-Yates shuffle) and the simulator's routing
 * draws use it: small, fast, the same sequence on every platform for a seed, and good enough
 * for draws whose only requirement is to be reproducible and unbiased at a glance. */
static inline uint64_t pl__splitmix64(uint64_t *s) {
  uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/* b bytes for a human, in buf (n bytes, NUL-terminated): "512 B" below 1 KiB, else two
 * decimals of the largest binary unit that keeps the figure >= 1 ("1.50 MiB", up to PiB).
 * The messages print it beside the exact byte count. Defined in pl_cli.c. */
void pl__bytes_human(uint64_t b, char *buf, size_t n);

/* A subcommand's --log LEVEL: sets the log level and returns 0, or prints
 * `PROG: --log = "LEVEL", must be error, warn, info or debug` (prog is the subcommand's
 * name, "moerpc-place plan") on stderr and returns 2 (the usage-error exit status). */
int pl__log_level_set(const char *prog, const char *level);

#endif /* PL_INTERNAL_H */
