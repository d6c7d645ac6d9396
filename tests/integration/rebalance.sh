#!/usr/bin/env bash
# rebalance.sh - `moerpc-place apply` with a client it was not told about (issue 23, item 6;
# docs/DESIGN.md 3.7 "Moved experts" and 15.3), real binaries on loopback: two servers
# with --auth-token-file, a top-1 model (any placement is bit-exact with an fp32 wire, as in
# apply.sh) and two clients generating greedily while apply moves experts 4-7 of every layer
# from s0 to s1. Client A watches its placement file and is given to apply (--client-placement,
# --client); client B runs on its own copy of the old placement and is not given to apply.
#
#   two_clients_one_told_same_tokens  apply exits 0 mid-run (the servers unload at once:
#                               --unload-grace 0); both clients exit 0 with tokens identical
#                               to a run without apply; B logged one re-Hello naming the
#                               "not served" reply that triggered it; apply's output names
#                               client B as not confirmed
#   grace_serves_until_streams_close  servers at the default --unload-grace (30 s): apply
#                               (--unload-without-clients) takes experts 4-7 out of s0's Hello
#                               at once (a dry run finds nothing left to unload), yet client B,
#                               running on the old placement, is served all along: no re-Hello,
#                               tokens identical; once B's stream closed, s0 frees them ("no open
#                               stream uses them") within a few housekeeping ticks
#   servers_drain_clean         every server exits 0 on SIGTERM; no sanitizer report in any
#                               server or client log (under make SANITIZER=...)
# (A request for an expert that no server serves any more fails naming the expert, the
# layer and the servers: itest_apply.unloaded_expert_gets_a_per_request_error.)
set -uo pipefail
cd "$(dirname "$0")/../.."
BIN=${MOERPC_BIN:-$PWD/build/bin}
passed=0; failed=0; skipped=0
tmp=$(mktemp -d /tmp/moerpc-rebal.XXXXXX)
pids=()
finish() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null; done
  [ "${keep:-0}" = 1 ] || rm -rf "$tmp"
  echo "rebalance: $passed passed, $failed failed, $skipped skipped"
}
trap finish EXIT
ok() { echo "ok   rebalance.$1"; passed=$((passed + 1)); }
fail() { echo "FAIL rebalance.$1: $2"; failed=$((failed + 1)); keep=1; echo "  (logs kept in $tmp)"; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
command -v curl >/dev/null || { echo "skip rebalance: curl missing (deploy/install-deps.sh)"; skipped=1; exit 0; }

"$BIN/moerpc-mkmodel" --out "$tmp/m" --seed 5 --topk 1 --layers 4 --experts 16 >/dev/null 2>&1 ||
  { fail setup "moerpc-mkmodel failed"; exit 1; }
printf 'rebalance-test-token-0123456789\n' >"$tmp/tok"
chmod 600 "$tmp/tok"

start_server() { # NAME PORT EXPERTS [flags...]
  local name=$1 port=$2 ex=$3; shift 3
  MOERPC_ISA=ref MOERPC_TEST_LOAD_DELAY_MS=20 "$BIN/moerpc-server" --model "$tmp/m" \
      --listen "127.0.0.1:$port" --experts "$ex" --threads 1 --auth-token-file "$tmp/tok" \
      "$@" >"$tmp/$name.log" 2>&1 &
  pids+=($!)
  eval "pid_$name=$!"
  for _ in $(seq 1 300); do
    grep -q 'serving' "$tmp/$name.log" 2>/dev/null && return 0
    kill -0 "$!" 2>/dev/null || break
    sleep 0.1
  done
  echo "server $name did not start: $(tail -n 3 "$tmp/$name.log")"; return 1
}
plan() { # OUT S0_EXPERTS S1_EXPERTS
  python3 - "$@" <<'PY'
import json, sys
out, a, b = sys.argv[1:4]
layers = [{"layer": l, "remote": {"s0": a, "s1": b}} for l in range(4)]
json.dump({"format": "moerpc-placement", "version": 1, "num_layers": 4, "num_experts": 16,
           "layers": layers}, open(out, "w"))
PY
}

p0=$(free_port); p1=$(free_port); while [ "$p1" = "$p0" ]; do p1=$(free_port); done
start_server s0 "$p0" 0-7 --unload-grace 0 || { fail setup "s0"; exit 1; }
start_server s1 "$p1" 8-15 --unload-grace 0 || { fail setup "s1"; exit 1; }
cat >"$tmp/cluster.json" <<JSON
{"model": "$tmp/m", "deadline_ms": 10000, "token_file": "$tmp/tok",
 "servers": [{"name": "s0", "address": "127.0.0.1:$p0"}, {"name": "s1", "address": "127.0.0.1:$p1"}]}
JSON
plan "$tmp/old.json" 0-7 8-15
plan "$tmp/new.json" 0-3 4-15
cp "$tmp/old.json" "$tmp/a.json"
cp "$tmp/old.json" "$tmp/b.json"
NEW=2000
case "$BIN" in *san-thread*) NEW=300 ;; *san-*) NEW=600 ;; esac
GEN=(generate --model "$tmp/m" --cluster "$tmp/cluster.json" --prompt-ids 4,5,6 --max-new "$NEW"
     --wire f32 --threads 1 --isa ref --quiet)

c=two_clients_one_told_same_tokens
MOERPC_ISA=ref "$BIN/moerpc-client" "${GEN[@]}" --placement "$tmp/old.json" >"$tmp/base.out" 2>"$tmp/base.log" ||
  fail setup "baseline generate failed: $(tail -n 2 "$tmp/base.log")"
mp=$(free_port)
MOERPC_ISA=ref "$BIN/moerpc-client" "${GEN[@]}" --placement "$tmp/a.json" --watch-placement \
    --metrics-listen "127.0.0.1:$mp" >"$tmp/a.out" 2>"$tmp/a.log" &
apid=$!; pids+=($apid)
MOERPC_ISA=ref "$BIN/moerpc-client" "${GEN[@]}" --placement "$tmp/b.json" \
    >"$tmp/b.out" 2>"$tmp/b.log" &
bpid=$!; pids+=($bpid)
for _ in $(seq 1 100); do curl -sf "http://127.0.0.1:$mp/placement" >/dev/null 2>&1 && break; sleep 0.05; done
sleep 0.3
out=$("$BIN/moerpc-place" apply --cluster "$tmp/cluster.json" "$tmp/new.json" \
      --client-placement "$tmp/a.json" --client "http://127.0.0.1:$mp" 2>&1); rc=$?
bstill=0; kill -0 "$bpid" 2>/dev/null && bstill=1
grep -E '^clients?[: ]' <<<"$out" | sed 's/^/  apply: /'
wait $apid; arc=$?
wait $bpid; brc=$?
why=""
[ $rc -eq 0 ] || why="apply rc $rc: $out"
[ -z "$why" ] && [ $bstill -eq 0 ] && why="client B ended before apply did: the test proves nothing (raise NEW)"
[ -z "$why" ] && [ $arc -ne 0 ] && why="client A rc $arc: $(tail -n 3 "$tmp/a.log")"
[ -z "$why" ] && [ $brc -ne 0 ] && why="client B rc $brc: $(tail -n 3 "$tmp/b.log")"
[ -z "$why" ] && ! cmp -s <(head -n 1 "$tmp/base.out") <(head -n 1 "$tmp/a.out") && why="client A's tokens differ from the run without apply"
[ -z "$why" ] && ! cmp -s <(head -n 1 "$tmp/base.out") <(head -n 1 "$tmp/b.out") && why="client B's tokens differ from the run without apply"
[ -z "$why" ] && [ "$(grep -c 're-Hello of .* after a "not served" reply' "$tmp/b.log")" -lt 1 ] &&
  why="client B logged no re-Hello naming its trigger: $(grep -i hello "$tmp/b.log" | tail -n 3)"
[ -z "$why" ] && ! grep -q 'placement: unload' "$tmp/s0.log" && why="s0 never unloaded (the move did not happen)"
# The runner's Hello names it "moerpc-client model pid=N": apply reports B by that name.
[ -z "$why" ] && ! grep -q "pid=$bpid" <<<"$out" && why="apply's output does not name client B (pid=$bpid): $out"
[ -z "$why" ] && ! grep "pid=$bpid" <<<"$out" | grep -q 'not confirmed' && why="apply does not report client B as not confirmed: $out"
[ -z "$why" ] && ! grep "pid=$apid" <<<"$out" | grep -q "confirmed: http" && why="apply does not report client A as confirmed: $out"
if [ -z "$why" ]; then ok $c; else fail $c "$why"; fi

c=grace_serves_until_streams_close
q0=$(free_port); q1=$(free_port)
start_server g0 "$q0" 0-7 || fail $c "server g0"
start_server g1 "$q1" 8-15 || fail $c "server g1"
sed -e "s/:$p0\"/:$q0\"/" -e "s/:$p1\"/:$q1\"/" "$tmp/cluster.json" >"$tmp/cluster-g.json"
GENG=("${GEN[@]}"); GENG[4]="$tmp/cluster-g.json"
cp "$tmp/old.json" "$tmp/c.json"
MOERPC_ISA=ref "$BIN/moerpc-client" "${GENG[@]}" --placement "$tmp/c.json" >"$tmp/c.out" 2>"$tmp/c.log" &
cpid=$!; pids+=($cpid)
sleep 0.5
out=$("$BIN/moerpc-place" apply --cluster "$tmp/cluster-g.json" "$tmp/new.json" --unload-without-clients 2>&1); rc=$?
dry=$("$BIN/moerpc-place" apply --cluster "$tmp/cluster-g.json" "$tmp/new.json" --dry-run 2>/dev/null |
      sed -n 's/^dry run: \([0-9]*\) experts to load, \([0-9]*\) to unload.*/\1 \2/p')
cstill=0; kill -0 "$cpid" 2>/dev/null && cstill=1
left_early=$(grep -c 'leaving pairs\? freed' "$tmp/g0.log")
wait $cpid; crc=$?
for _ in $(seq 1 30); do grep -q 'leaving pairs freed (no open stream uses them)' "$tmp/g0.log" && break; sleep 0.1; done
why=""
[ $rc -eq 0 ] || why="apply rc $rc: $out"
[ -z "$why" ] && [ $cstill -eq 0 ] && why="client ended before apply did: the test proves nothing (raise NEW)"
[ -z "$why" ] && [ "$dry" != "0 0" ] && why="dry run right after apply: \"$dry\", expected \"0 0\" (leaving pairs must leave Hello)"
[ -z "$why" ] && [ "$left_early" -ne 0 ] && why="g0 freed the pairs while the client's stream was open: $(grep freed "$tmp/g0.log")"
[ -z "$why" ] && [ $crc -ne 0 ] && why="client rc $crc: $(tail -n 3 "$tmp/c.log")"
[ -z "$why" ] && ! cmp -s <(head -n 1 "$tmp/base.out") <(head -n 1 "$tmp/c.out") && why="tokens differ from the run without apply"
[ -z "$why" ] && grep -q 're-Hello' "$tmp/c.log" && why="the client re-Hello'd: the pairs were not served in their grace: $(grep re-Hello "$tmp/c.log")"
[ -z "$why" ] && ! grep -q 'leave Hello' "$tmp/g0.log" && why="g0 did not log the unload's grace"
[ -z "$why" ] && ! grep -q 'leaving pairs freed (no open stream uses them)' "$tmp/g0.log" &&
  why="g0 did not free the pairs after the stream closed: $(grep placement "$tmp/g0.log" | tail -n 2)"
if [ -z "$why" ]; then ok $c; else fail $c "$why"; fi
c=servers_drain_clean
why=""
for n in s0 s1 g0 g1; do
  pid=$(eval echo "\${pid_$n:-}")
  [ -n "$pid" ] || continue
  kill -TERM "$pid" 2>/dev/null
  wait "$pid"; st=$?
  [ $st -eq 0 ] || why="$why $n exited $st ($(tail -n 2 "$tmp/$n.log" | tr '\n' ' '));"
done
san=$(grep -l -E 'WARNING: ThreadSanitizer|ERROR: AddressSanitizer|ERROR: LeakSanitizer|runtime error:' "$tmp"/*.log 2>/dev/null | tr '\n' ' ')
[ -n "$san" ] && why="$why sanitizer reports in: $san"
if [ -z "$why" ]; then ok $c; else fail $c "$why"; fi
[ "$failed" -eq 0 ]
