#!/usr/bin/env bash
# tests/integration/runner_check.sh - the test harness cannot lose or double-count cases:
#   - mt.h: more MT_TESTs than MT_MAX_CASES fail the binary before any case runs (no case
#     is dropped silently);
#   - a test that runs another test program (whose summary line lands in the same log)
#     counts once;
#   - tests/run.sh counts one summary line per test, its own ("<name>: ..."), the last one:
#     a child's look-alike line before it, or a line of another name, does not count.
set -u
cd "$(dirname "$0")/../.."
CC=${CC:-gcc}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"; echo "runner_check: $passed passed, $failed failed, 0 skipped"' EXIT
passed=0 failed=0
ok() { echo "ok   runner_check.$1"; passed=$((passed + 1)); }
bad() { echo "FAIL runner_check.$1: $2"; failed=$((failed + 1)); }

# tests/run.sh's own counting function, sourced in a subshell.
count() { # log rc name -> "passed failed skipped"
  (
    eval "$(sed -n '/^count_from_log() {/,/^}/p' tests/run.sh)"
    passed=0 failed=0 skipped=0 failed_names=() last_skipped=0
    count_from_log "$1" "$2" "$3" "${3##*/}"
    echo "$passed $failed $skipped"
  )
}

# 1. MT_MAX_CASES + 1 cases.
{
  echo '#include "tests/unit/mt.h"'
  for i in $(seq 0 256); do echo "MT_TEST(t$i) { MT_TRUE(1); }"; done
  echo 'MT_MAIN()'
} >"$tmp/many.c"
if $CC -std=gnu11 -I. -o "$tmp/many" "$tmp/many.c" 2>"$tmp/cc.log"; then
  "$tmp/many" >"$tmp/many.out" 2>&1; rc=$?
  if [ $rc -ne 0 ] && grep -q 'cases more than MT_MAX_CASES = 256 would not run' "$tmp/many.out" &&
     grep -q '^many: 0 passed, 257 failed, 0 skipped$' "$tmp/many.out" && ! grep -q '^ok ' "$tmp/many.out"; then
    ok overflow_is_an_error
  else
    bad overflow_is_an_error "exit $rc: $(tr '\n' '|' <"$tmp/many.out" | cut -c1-300)"
  fi
else
  bad overflow_is_an_error "does not compile: $(head -3 "$tmp/cc.log")"
fi

# 2. A test that runs another test program: the child's summary line is in the log, and
#    only the parent's own line counts (the old runner added both).
cat >"$tmp/kid.c" <<'EOF'
#include "tests/unit/mt.h"
MT_TEST(a) { MT_TRUE(1); }
MT_TEST(b) { MT_TRUE(1); }
MT_TEST(c) { MT_TRUE(1); }
MT_MAIN()
EOF
cat >"$tmp/parent.c" <<'EOF'
#include "tests/unit/mt.h"
MT_TEST(runs_a_child_suite) { MT_EQ_INT(system(getenv("KID")), 0); }
MT_MAIN()
EOF
if $CC -std=gnu11 -I. -o "$tmp/kid" "$tmp/kid.c" 2>"$tmp/cc.log" &&
   $CC -std=gnu11 -I. -o "$tmp/parent" "$tmp/parent.c" 2>>"$tmp/cc.log"; then
  KID="$tmp/kid" "$tmp/parent" >"$tmp/parent.log" 2>&1; rc=$?
  got=$(count "$tmp/parent.log" $rc unit/parent)
  if grep -q '^kid: 3 passed' "$tmp/parent.log" && [ "$got" = "1 0 0" ]; then
    ok child_suite_line_not_counted
  else
    bad child_suite_line_not_counted "got $got, want 1 0 0: $(tr '\n' '|' <"$tmp/parent.log")"
  fi
else
  bad child_suite_line_not_counted "does not compile: $(head -3 "$tmp/cc.log")"
fi

# 3. tests/run.sh's counting, on logs written here (its function, sourced in a subshell).
printf 'child: 5 passed, 0 failed, 0 skipped\nfoo: 5 passed, 0 failed, 0 skipped\n  foo: 9 passed, 0 failed\nfoo: 3 passed, 1 failed, 2 skipped\n' >"$tmp/a.log"
got=$(count "$tmp/a.log" 1 unit/foo)
[ "$got" = "3 1 2" ] && ok run_sh_counts_its_own_last_line || bad run_sh_counts_its_own_last_line "got $got, want 3 1 2"
printf 'foo: 4 passed, 0 failed, 0 skipped\nbar: 4 passed, 0 failed, 0 skipped\n' >"$tmp/b.log"
got=$(count "$tmp/b.log" 0 unit/bar)
[ "$got" = "4 0 0" ] && ok run_sh_ignores_other_names || bad run_sh_ignores_other_names "got $got, want 4 0 0"
printf 'other: 7 passed, 0 failed, 0 skipped\n' >"$tmp/c.log"
got=$(count "$tmp/c.log" 139 unit/crashed)
[ "$got" = "0 1 0" ] && ok run_sh_crash_without_summary_is_one_failure || bad run_sh_crash_without_summary_is_one_failure "got $got, want 0 1 0"
printf 'zed: 2 passed, 0 failed, 0 skipped\n' >"$tmp/d.log"
got=$(count "$tmp/d.log" 1 unit/zed)
[ "$got" = "2 1 0" ] && ok run_sh_nonzero_exit_adds_a_failure || bad run_sh_nonzero_exit_adds_a_failure "got $got, want 2 1 0"
[ $failed -eq 0 ]
