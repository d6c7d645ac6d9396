#!/usr/bin/env bash
# host_check.sh - the host's latency settings as operators see them (common/host.c,
# docs/deploy.md "Host tuning"):
#   - `moerpc-server --check-host` on this host: exit 0 with "nothing to change" exactly when
#     it prints no advice line, 1 with one "host: " line per piece of advice otherwise; a
#     DIR that is not a directory is a usage error (exit 2); a made-up tree of a bare-metal
#     host gets nothing, one of a KVM guest that halts at once gets the halt-poll line;
#   - `moerpc-client check-host [DIR]`: the same report and exit codes as the server's;
#   - `moerpc-bench-wake`: one JSON line per gap with ordered percentiles and the host's
#     record; bad flags exit 2 naming the flag.
set -uo pipefail
cd "$(dirname "$0")/../.."
BIN=${MOERPC_BIN:-$PWD/build/bin}
passed=0; failed=0
tmp=$(mktemp -d /tmp/moerpc-host.XXXXXX)
trap 'rm -rf "$tmp"; echo "host_check: $passed passed, $failed failed, 0 skipped"' EXIT
ok() { echo "ok   host_check.$1"; passed=$((passed + 1)); }
bad() { echo "FAIL host_check.$1: $2"; failed=$((failed + 1)); }

out=$("$BIN/moerpc-server" --check-host 2>&1); rc=$?
n=$(grep -c '^host: ' <<<"$out")   # the summary line + one per piece of advice
if { [ $rc -eq 0 ] && [ "$n" -eq 1 ] && [[ $out == *"nothing to change"* ]]; } ||
   { [ $rc -eq 1 ] && [ "$n" -ge 2 ] && [[ $out == *"to change:"* ]]; }; then ok this_host
else bad this_host "rc $rc, $n lines: $out"; fi

"$BIN/moerpc-server" --check-host="$tmp/none" >"$tmp/o" 2>&1; rc=$?
if [ $rc -eq 2 ] && grep -q -- '--check-host=.*not a directory' "$tmp/o"; then ok not_a_directory
else bad not_a_directory "rc $rc: $(cat "$tmp/o")"; fi

mk() { mkdir -p "$(dirname "$tmp/$1")"; printf '%s\n' "$2" >"$tmp/$1"; }
mk bare/proc/cpuinfo "model name	: AMD EPYC 9654 96-Core Processor"
mk bare/sys/devices/system/cpu/cpuidle/current_governor_ro menu
mk bare/sys/kernel/mm/transparent_hugepage/enabled "[always] madvise never"
mk bare/proc/sys/kernel/numa_balancing 0
mk bare/sys/devices/system/node/online 0-1
out=$("$BIN/moerpc-server" --check-host="$tmp/bare" 2>&1); rc=$?
if [ $rc -eq 0 ] && [[ $out == "host: cpu AMD EPYC 9654 96-Core Processor;"*"transparent huge pages always; NUMA balancing 0 on 2 nodes: nothing to change" ]]
then ok bare_metal_tree; else bad bare_metal_tree "rc $rc: $out"; fi

cp -r "$tmp/bare" "$tmp/kvm"
mk kvm/sys/devices/system/cpu/cpuidle/current_governor haltpoll
mk kvm/sys/module/haltpoll/parameters/guest_halt_poll_ns 0
out=$("$BIN/moerpc-server" --check-host="$tmp/kvm" 2>&1); rc=$?
if [ $rc -eq 1 ] && [ "$(wc -l <<<"$out")" -eq 2 ] &&
   grep -q '^host: the idle CPUs of this KVM guest halt without polling first (/sys/module/haltpoll/parameters/guest_halt_poll_ns = 0, below 200000)' <<<"$out"
then ok kvm_guest_tree; else bad kvm_guest_tree "rc $rc: $out"; fi

# a FIFO or a device where a settings file should be is skipped, not read (it would block)
cp -r "$tmp/bare" "$tmp/fifo"
rm "$tmp/fifo/proc/cpuinfo" "$tmp/fifo/sys/kernel/mm/transparent_hugepage/enabled"
mkfifo "$tmp/fifo/proc/cpuinfo"
ln -s /dev/zero "$tmp/fifo/sys/kernel/mm/transparent_hugepage/enabled"
out=$(timeout 10 "$BIN/moerpc-server" --check-host="$tmp/fifo" 2>&1); rc=$?
if [ $rc -eq 0 ] && [[ $out == "host: cpu unknown;"*"transparent huge pages unknown;"* ]]; then ok fifo_and_device_skipped
else bad fifo_and_device_skipped "rc $rc: $out"; fi

# the client's check-host: the same report as the server's, the same exit codes
for tree in bare kvm; do
  s=$("$BIN/moerpc-server" --check-host="$tmp/$tree" 2>&1); src=$?
  c=$("$BIN/moerpc-client" check-host "$tmp/$tree" 2>&1); crc=$?
  if [ "$s" = "$c" ] && [ $src -eq $crc ]; then ok "client_check_host_$tree"
  else bad "client_check_host_$tree" "server rc $src [$s] client rc $crc [$c]"; fi
done
"$BIN/moerpc-client" check-host "$tmp/none" >"$tmp/o" 2>&1; rc1=$?
"$BIN/moerpc-client" check-host --frob >>"$tmp/o" 2>&1; rc2=$?
"$BIN/moerpc-client" check-host --help >"$tmp/h" 2>&1; rc3=$?
if [ $rc1 -eq 2 ] && [ $rc2 -eq 2 ] && [ $rc3 -eq 0 ] && grep -q "not a directory" "$tmp/o" &&
   grep -q 'unexpected argument "--frob"' "$tmp/o" && grep -q '^usage: moerpc-client check-host' "$tmp/h"
then ok client_check_host_usage; else bad client_check_host_usage "rc $rc1 $rc2 $rc3: $(cat "$tmp/o")"; fi

"$BIN/moerpc-bench-wake" --iters 20 --gaps 0,100 >"$tmp/wake.jsonl" 2>"$tmp/wake.err"; rc=$?
if why=$(python3 - "$tmp/wake.jsonl" "$rc" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
why = []
if sys.argv[2] != "0": why.append("exit %s" % sys.argv[2])
if [r["gap_us"] for r in rows] != [0, 100]: why.append("gaps %s" % [r["gap_us"] for r in rows])
for r in rows:
    if not 0 <= r["wake_call_p50_us"] <= r["wake_call_p90_us"]: why.append("wake call %s" % r)
    if not 0 < r["wake_to_run_p50_us"] <= r["wake_to_run_p90_us"] < 1e6: why.append("wake to run %s" % r)
    if r["iters"] != 20 or not r["cpu"] or "guest_halt_poll_ns" not in r or "cpuidle" not in r:
        why.append("record %s" % r)
print("; ".join(why)); sys.exit(1 if why else 0)
PY
); then ok bench_wake_records; else bad bench_wake_records "$why ($(tail -n 2 "$tmp/wake.err"))"; fi

bad_flags=0
for args in "--gaps 5,x" "--gaps 2000000" "--iters 5" "--cpus 1,1" "--cpus 3" "--frobnicate 1"; do
  # shellcheck disable=SC2086
  "$BIN/moerpc-bench-wake" $args >/dev/null 2>"$tmp/err"; rc=$?
  flag=${args%% *}
  if [ $rc -ne 2 ] || ! grep -q -- "$flag" "$tmp/err"; then
    bad_flags=1; bad bench_wake_flags "$args: rc $rc: $(head -n 1 "$tmp/err")"
  fi
done
[ $bad_flags -eq 0 ] && ok bench_wake_flags
[ "$failed" -eq 0 ]
