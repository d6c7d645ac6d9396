#!/usr/bin/env bash
# tests/run.sh - runs the moerpc test suite: unit tests, fuzz-corpus replay, integration,
# the short chaos soak.
#   tests/run.sh [unit|fuzz|integration|soak|conformance|all] [filter]
# Each test binary runs its cases in forked processes with a timeout (tests/unit/mt.h);
# each binary or script also runs under an outer timeout here. The last line is the total,
# "N passed, N failed, N skipped" (a case that found nothing to test here, e.g. no fast
# path on this CPU, is skipped, never passed). Logs of failures are printed; all logs stay
# in $BUILD/test-logs.
set -u
BUILD=${BUILD:-build}
what=${1:-all}
filter=${2:-}
export MOERPC_BIN="$PWD/$BUILD/bin"
export MOERPC_BUILD="$PWD/$BUILD"
export MOERPC_SRC="$PWD"
logs="$BUILD/test-logs"
# gRPC and abseil are not TSan-instrumented: see tests/tsan.supp.
export TSAN_OPTIONS="suppressions=$PWD/tests/tsan.supp second_deadlock_stack=1 ${TSAN_OPTIONS:-}"
# A system library's own lifetime allocations: see tests/lsan.supp.
export LSAN_OPTIONS="suppressions=$PWD/tests/lsan.supp print_suppressions=0 ${LSAN_OPTIONS:-}"
mkdir -p "$logs"
passed=0; failed=0; skipped=0; failed_names=()
last_skipped=0

# Counts one test binary or script from its log: its own summary line, the LAST line that
# reads exactly "<name>: N passed, N failed[, N skipped]" with <name> its own name. Lines
# of other programs (a child it ran, a server's log, a forked copy of itself) never count,
# even when they look alike. No such line: the whole run counts as one case, failed unless
# it exited 0; a line with 0 failed from a run that exited non-zero adds one failure.
count_from_log() { # log rc name summary-name
  local log=$1 rc=$2 name=$3 who=$4
  local line p=0 f=0 s=0
  line=$(grep -E "^${who}: [0-9]+ passed, [0-9]+ failed(, [0-9]+ skipped)?\$" "$log" | tail -n 1)
  last_skipped=0
  if [ -n "$line" ]; then
    line=${line#"$who: "}
    p=${line%% passed*}
    f=${line#*passed, }; f=${f%% failed*}
    [[ $line == *skipped ]] && { s=${line##*failed, }; s=${s%% skipped}; }
    last_skipped=$s
    passed=$((passed + p)); failed=$((failed + f)); skipped=$((skipped + s))
    if [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then failed=$((failed + 1)); fi
  elif [ "$rc" -eq 0 ]; then
    passed=$((passed + 1))
  else
    failed=$((failed + 1))
  fi
  if [ "$rc" -ne 0 ]; then failed_names+=("$name"); fi
}

run_one() { # name timeout_s cmd... (the summary line is the one of basename(name))
  local name=$1 tmo=$2; shift 2
  local who=${name##*/}
  [ -n "$filter" ] && [[ "$name" != *"$filter"* ]] && return 0
  local log="$logs/$name.log"
  mkdir -p "$(dirname "$log")"
  local t0=$(date +%s.%N)
  timeout --kill-after=10 "$tmo" "$@" >"$log" 2>&1
  local rc=$?
  local dt=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}')
  count_from_log "$log" $rc "$name" "$who"
  if [ $rc -eq 0 ]; then
    local skips=""
    [ "$last_skipped" -gt 0 ] && skips=", $last_skipped skipped: $(grep -hE '^skip ' "$log" | cut -c6- | sed 's/^[^.]*\.//' | tr '\n' ' ' | sed 's/ $//')"
    echo "ok   $name (${dt}s$skips)"
  else
    [ $rc -eq 124 ] && echo "  (timed out after ${tmo}s)" >>"$log"
    echo "FAIL $name (rc=$rc, ${dt}s) -- last lines of $log:"
    tail -n 40 "$log" | sed 's/^/    /'
  fi
}

if [ "$what" = all ] || [ "$what" = unit ]; then
  for t in "$BUILD"/tests/test_*; do
    [ -x "$t" ] || continue
    run_one "unit/$(basename "$t")" 600 "$t"
  done
fi

if [ "$what" = all ] || [ "$what" = fuzz ]; then
  for r in "$BUILD"/tests/replay_fuzz_*; do
    [ -x "$r" ] || continue
    n=$(basename "$r"); n=${n#replay_fuzz_}
    corpus="tests/fuzz/corpus/$n"
    run_one "fuzz-replay/$n" 300 "$r" "$corpus"
  done
fi

if [ "$what" = all ] || [ "$what" = integration ]; then
  for t in "$BUILD"/tests/itest_*; do
    [ -x "$t" ] || continue
    run_one "integration/$(basename "$t")" 900 "$t"
  done
  for s in tests/integration/*.sh; do
    [ -f "$s" ] || continue
    run_one "integration/$(basename "$s" .sh)" 900 bash "$s"
  done
fi

# The chaos soak, short (tests/soak/README.md): after integration, before conformance; not in
# the integration group, so the TSan pass of CI (make test-integration) does not run it.
if [ "$what" = all ] || [ "$what" = soak ]; then
  run_one "soak/chaos_soak" 300 bash tests/soak/chaos.sh
fi

if [ "$what" = all ] || [ "$what" = conformance ]; then
  run_one "conformance/conformance" 900 bash tests/conformance/run.sh
fi

echo
if [ ${#failed_names[@]} -gt 0 ]; then echo "failed: ${failed_names[*]}"; fi
echo "$passed passed, $failed failed, $skipped skipped"
[ "$failed" -eq 0 ]
