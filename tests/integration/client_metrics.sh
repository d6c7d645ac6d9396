#!/usr/bin/env bash
# client_metrics.sh - `moerpc-client generate --metrics-listen` against two real servers:
# a scrape taken while it generates passes `promtool check metrics`, counts steps, and has
# the per-server and failover families with a `server` label. A missing tool is a SKIP.
set -uo pipefail
cd "$(dirname "$0")/../.."
BIN=${MOERPC_BIN:-$PWD/build/bin}
passed=0; failed=0; skipped=0
tmp=$(mktemp -d /tmp/moerpc-cm.XXXXXX)
finish() {
  [ -n "${gen:-}" ] && kill "$gen" 2>/dev/null
  lc_stop >/dev/null 2>&1
  rm -rf "$tmp"
  echo "client_metrics: $passed passed, $failed failed, $skipped skipped"
}
trap finish EXIT
c=scrape_during_generate_passes_promtool
if ! command -v promtool >/dev/null || ! command -v curl >/dev/null; then
  echo "skip client_metrics.$c: promtool or curl missing (deploy/install-deps.sh)"; skipped=1; exit 0
fi
"$BIN/moerpc-mkmodel" --out "$tmp/model" --seed 1 >/dev/null 2>&1
# shellcheck source=deploy/local-cluster.sh
. deploy/local-cluster.sh
lc_start "$tmp/c" "$tmp/model" 2 --threads 1 >/dev/null 2>&1 || { echo "FAIL client_metrics.$c: servers did not start"; failed=1; exit 1; }
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
"$BIN/moerpc-client" generate --model "$tmp/model" --cluster "$tmp/c/cluster.json" --prompt-ids 1,2,3 \
    --max-new 4000 --threads 1 --metrics-listen "127.0.0.1:$port" >/dev/null 2>"$tmp/gen.log" &
gen=$!
why=""
for _ in $(seq 1 100); do
  curl -sf "http://127.0.0.1:$port/metrics" >"$tmp/m1.txt" 2>/dev/null && grep -q '^moerpc_client_steps_total [1-9]' "$tmp/m1.txt" && break
  sleep 0.1
done
sleep 0.3
curl -sf "http://127.0.0.1:$port/metrics" >"$tmp/m2.txt" || why="no scrape: $(tail -n 3 "$tmp/gen.log")"
if [ -z "$why" ]; then
  out=$(promtool check metrics <"$tmp/m2.txt" 2>&1) || why="promtool: $out"
fi
if [ -z "$why" ]; then
  s1=$(awk '$1=="moerpc_client_steps_total"{print $2}' "$tmp/m1.txt")
  s2=$(awk '$1=="moerpc_client_steps_total"{print $2}' "$tmp/m2.txt")
  awk -v a="${s1:-0}" -v b="${s2:-0}" 'BEGIN{exit !(b > a && a > 0)}' || why="steps did not grow between scrapes: ${s1:-none} -> ${s2:-none}"
fi
for fam in 'moerpc_client_server_requests_total{server="s0"}' 'moerpc_client_server_failovers_total{server="s1"}' \
           'moerpc_client_server_down{server="s0"} 0' 'moerpc_client_step_seconds_bucket' \
           'moerpc_host_advice ' 'moerpc_host_info{cpuidle_governor='; do
  [ -z "$why" ] && ! grep -qF "$fam" "$tmp/m2.txt" && why="no $fam in the scrape"
done
if [ -z "$why" ]; then
  # One layer call at a time (no deferral): after each stream's first request, every request
  # finds its stream idle and is sent in one batch with its reply's receive.
  rq=$(awk '$1=="moerpc_client_server_requests_total{server=\"s0\"}"{print $2}' "$tmp/m2.txt")
  pr=$(awk '$1=="moerpc_client_server_paired_total{server=\"s0\"}"{print $2}' "$tmp/m2.txt")
  awk -v r="${rq:-0}" -v p="${pr:-0}" 'BEGIN{exit !(p > 0 && p < r)}' ||
    why="paired sends: ${pr:-none} of ${rq:-none} requests to s0, want some but not all"
fi
if [ -z "$why" ]; then echo "ok   client_metrics.$c"; passed=1; else echo "FAIL client_metrics.$c: $why"; failed=1; exit 1; fi
