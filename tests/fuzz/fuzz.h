/*
 * fuzz.h - what a fuzz target tells the corpus replayer (replay_main.c) besides "no crash":
 * whether it accepted the input. The replayer checks that against the file's name: an
 * ok_* input must be accepted and a bad_* input refused, so that a corpus cannot pass by
 * exercising nothing (a seed that stopped parsing, a bad case that started to pass). Other
 * names (inputs libFuzzer found, named by their hash) only must not crash. In a libFuzzer
 * build the verdict is set and never read.
 */
#ifndef FUZZ_H
#define FUZZ_H

#include <stdbool.h>

enum { FUZZ_NO_VERDICT = 0, FUZZ_ACCEPTED = 1, FUZZ_REFUSED = 2 };

/* The verdict on the current input. Weak, so that there is one definition whether or not
 * replay_main.c is linked in. */
__attribute__((weak)) int fuzz_verdict;

/* Records the verdict on the current input: accepted, or refused with an error. */
static inline void fuzz_verdict_set(bool accepted) {
  fuzz_verdict = accepted ? FUZZ_ACCEPTED : FUZZ_REFUSED;
}

#endif /* FUZZ_H */
