#!/usr/bin/env bash
# client_bench.sh - `moerpc-client bench --json` all-local and against one real server: the
# per-step figures (step_ms_p50 <= step_ms_p90, both near the mean step) and, with a server,
# the server's side of the decode's replies (compute <= arrival-to-reply <= submit-to-reply);
# all-local reports no server time; both records state the host's cpuidle governor,
# guest_halt_poll_ns and THP mode as sysfs has them (docs/deploy.md "Host tuning").
# tests/bench/model_bench.sh builds its tables from these.
set -uo pipefail
cd "$(dirname "$0")/../.."
BIN=${MOERPC_BIN:-$PWD/build/bin}
passed=0; failed=0
tmp=$(mktemp -d /tmp/moerpc-cb.XXXXXX)
finish() {
  lc_stop >/dev/null 2>&1
  rm -rf "$tmp"
  echo "client_bench: $passed passed, $failed failed, 0 skipped"
}
trap finish EXIT
ok() { echo "ok   client_bench.$1"; passed=$((passed + 1)); }
bad() { echo "FAIL client_bench.$1: $2"; failed=$((failed + 1)); }

"$BIN/moerpc-mkmodel" --out "$tmp/model" --seed 1 >/dev/null 2>&1 || { bad setup "moerpc-mkmodel failed"; exit 1; }
# shellcheck source=deploy/local-cluster.sh
. deploy/local-cluster.sh
lc_start "$tmp/c" "$tmp/model" 1 --threads 1 >/dev/null 2>&1 || { bad setup "the server did not start"; exit 1; }
# The first JSON line; none when the bench exits non-zero (a sanitizer's report included).
bench() { "$BIN/moerpc-client" bench --model "$tmp/model" --threads 1 --prompt-len 8 --decode 24 \
            --repeats 2 --json --quiet --log warn "$@" >"$tmp/out.jsonl" 2>>"$tmp/err.log" &&
            head -n 1 "$tmp/out.jsonl"; }

check() { # name json-line want-server(0|1)
  python3 - "$2" "$3" <<'PY'
import json, sys
r = json.loads(sys.argv[1]); srv = sys.argv[2] == "1"
p50, p90, mean = r["step_ms_p50"], r["step_ms_p90"], r["step_ms"]
c, s, rtt = r["server_compute_us"], r["server_us"], r["server_rtt_us"]
why = []
if not 0 < p50 <= p90: why.append("steps: p50 %.3f, p90 %.3f" % (p50, p90))
if not 0.2 * mean < p50 < 5 * mean: why.append("p50 %.3f ms against a mean step of %.3f ms" % (p50, mean))
if srv:
    if r["servers"] != 1: why.append("servers %s" % r["servers"])
    if not 0 < c <= s <= rtt: why.append("server compute %.1f, server %.1f, round trip %.1f us" % (c, s, rtt))
    if rtt > 1000 * mean: why.append("round trip %.1f us longer than a step (%.3f ms)" % (rtt, mean))
elif (c, s, rtt) != (0, 0, 0):
    why.append("all-local reports server time: %.1f %.1f %.1f" % (c, s, rtt))
# The host's idle settings as the record states them, against sysfs read here.
def sysfs(path, default):
    try:
        v = open(path).read().strip()
        return v if v else default
    except OSError:
        return default
gov = sysfs("/sys/devices/system/cpu/cpuidle/current_governor", None) or \
      sysfs("/sys/devices/system/cpu/cpuidle/current_governor_ro", "")
hp = sysfs("/sys/module/haltpoll/parameters/guest_halt_poll_ns", "-1")
thp = sysfs("/sys/kernel/mm/transparent_hugepage/enabled", "")
thp = thp[thp.find("[") + 1:thp.find("]")] if "[" in thp else thp
if (r.get("cpuidle"), str(r.get("guest_halt_poll_ns")), r.get("thp")) != (gov, hp, thp):
    why.append("host record cpuidle %r guest_halt_poll_ns %r thp %r, sysfs says %r %r %r" % (
        r.get("cpuidle"), r.get("guest_halt_poll_ns"), r.get("thp"), gov, hp, thp))
print("; ".join(why))
sys.exit(1 if why else 0)
PY
}

line=$(bench)
if [ -z "$line" ]; then bad all_local_steps_and_no_server_time "no JSON line: $(tail -n 2 "$tmp/err.log")"
elif why=$(check all_local "$line" 0); then ok all_local_steps_and_no_server_time
else bad all_local_steps_and_no_server_time "$why: $line"; fi

line=$(bench --cluster "$tmp/c/cluster.json" --local-experts 0)
if [ -z "$line" ]; then bad one_server_steps_and_reply_times_in_order "no JSON line: $(tail -n 2 "$tmp/err.log")"
elif why=$(check one_server "$line" 1); then ok one_server_steps_and_reply_times_in_order
else bad one_server_steps_and_reply_times_in_order "$why: $line"; fi
[ "$failed" -eq 0 ]
