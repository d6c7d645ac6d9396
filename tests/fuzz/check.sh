#!/usr/bin/env bash
# tests/fuzz/check.sh - `make fuzz-check`: runs every libFuzzer target (build/fuzz/fuzz_*,
# built by `make fuzz`) for FUZZ_SECONDS (default 20) on a copy of its corpus, so that the
# corpus in git is never changed by a run. Prints one line per target with the executions
# done and the corpus growth; fails if any target crashed, leaked, hit UB or timed out on
# an input (the input is kept in $BUILD/fuzz-artifacts/<target>/, the log beside it).
# Targets run FUZZ_JOBS at a time (default: one per core).
#   FUZZ_SECONDS=10 FUZZ_TARGETS="hello_reply stats_reply" FUZZ_JOBS=1 tests/fuzz/check.sh
set -u
BUILD=${BUILD:-build}
secs=${FUZZ_SECONDS:-20}
work=$(mktemp -d "${TMPDIR:-/tmp}/moerpc-fuzz.XXXXXX")
trap 'rm -rf "$work"' EXIT
art="$BUILD/fuzz-artifacts"
mkdir -p "$art"
jobs=${FUZZ_JOBS:-$(nproc)}   # targets fuzzed at once (each libFuzzer run is one thread)
targets=()
for bin in "$BUILD"/fuzz/fuzz_*; do
  [ -x "$bin" ] || continue
  t=$(basename "$bin"); t=${t#fuzz_}
  if [ -n "${FUZZ_TARGETS:-}" ] && [[ " $FUZZ_TARGETS " != *" $t "* ]]; then continue; fi
  targets+=("$t")
done

run_target() { # t: fuzzes it, writes its report line(s) to $work/$t.out, status to .rc
  local t=$1 bin="$BUILD/fuzz/fuzz_$1" seeds=0 log rc execs now
  mkdir -p "$work/$t" "$art/$t"
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
    printf 'FAIL fuzz/%-16s rc=%d after %s execs; input and log in %s/%s/:\n' "$t" $rc "${execs:-?}" "$art" "$t"
    grep -E 'ERROR|SUMMARY|fuzz_[a-z_]+: |==[0-9]+==' "$log" | head -n 12 | sed 's/^/    /'
  fi >"$work/$t.out"
  echo $rc >"$work/$t.rc"
}

running=0
for t in "${targets[@]}"; do
  if [ $running -ge "$jobs" ]; then wait -n; running=$((running - 1)); fi
  run_target "$t" &
  running=$((running + 1))
done
wait
fail=0; n=0
for t in "${targets[@]}"; do
  n=$((n + 1))
  cat "$work/$t.out"
  [ "$(cat "$work/$t.rc" 2>/dev/null)" = 0 ] || fail=$((fail + 1))
done
echo "$n targets fuzzed for ${secs}s each ($jobs at a time), $fail failed"
[ "$n" -gt 0 ] && [ $fail -eq 0 ]
