#!/usr/bin/env bash
# tests/fuzz/check.sh - `make fuzz-check`: runs every libFuzzer target (build/fuzz/fuzz_*,
# built by `make fuzz`) for FUZZ_SECONDS (default 20) on a copy of its corpus, so that the
# corpus in git is never changed by a run. Prints one line per target with the executions
# done and the corpus growth; fails if any target crashed, leaked, hit UB or timed out on
# an input (the input is kept in $BUILD/fuzz-artifacts/<target>/, the log beside it).
#   FUZZ_SECONDS=10 FUZZ_TARGETS="hello_reply stats_reply" tests/fuzz/check.sh
set -u
BUILD=${BUILD:-build}
secs=${FUZZ_SECONDS:-20}
work=$(mktemp -d "${TMPDIR:-/tmp}/moerpc-fuzz.XXXXXX")
trap 'rm -rf "$work"' EXIT
art="$BUILD/fuzz-artifacts"
mkdir -p "$art"
fail=0; n=0
for bin in "$BUILD"/fuzz/fuzz_*; do
  [ -x "$bin" ] || continue
  t=$(basename "$bin"); t=${t#fuzz_}
  if [ -n "${FUZZ_TARGETS:-}" ] && [[ " $FUZZ_TARGETS " != *" $t "* ]]; then continue; fi
  n=$((n + 1))
  mkdir -p "$work/$t" "$art/$t"
  seeds=0
  if [ -d "tests/fuzz/corpus/$t" ]; then
    cp tests/fuzz/corpus/"$t"/* "$work/$t"/ 2>/dev/null
    seeds=$(ls "tests/fuzz/corpus/$t" | wc -l)
  fi
  log="$art/$t/fuzz.log"
  # -timeout: one input may take at most 10 s; -rss_limit_mb bounds a decoder that
  # allocates what the input asks for.
  timeout --kill-after=10 $((secs + 60)) "$bin" -max_total_time="$secs" -timeout=10 \
    -rss_limit_mb=2048 -print_final_stats=1 -artifact_prefix="$art/$t/" "$work/$t" >"$log" 2>&1
  rc=$?
  execs=$(grep -oE 'stat::number_of_executed_units: *[0-9]+' "$log" | grep -oE '[0-9]+$')
  now=$(ls "$work/$t" | wc -l)
  if [ $rc -eq 0 ]; then
    printf 'ok   fuzz/%-16s %10s execs in %ss, corpus %d -> %d\n' "$t" "${execs:-?}" "$secs" "$seeds" "$now"
  else
    fail=$((fail + 1))
    printf 'FAIL fuzz/%-16s rc=%d after %s execs; input and log in %s/%s/:\n' "$t" $rc "${execs:-?}" "$art" "$t"
    grep -E 'ERROR|SUMMARY|fuzz_[a-z_]+: |==[0-9]+==' "$log" | head -n 12 | sed 's/^/    /'
  fi
done
echo "$n targets fuzzed for ${secs}s each, $fail failed"
[ "$n" -gt 0 ] && [ $fail -eq 0 ]
