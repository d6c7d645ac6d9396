#!/usr/bin/env bash
# apply_live.sh - what a live apply costs (docs/DESIGN.md section 15): two servers with
# --auth-token-file on a demo-sized model, a client decoding greedily with
# --watch-placement; `moerpc-place apply` moves half of s0's experts of every layer to s1
# mid-run. Prints: the load's GB and GB/s (s1's log), apply's wall time, the client's switch
# time (its log), decode tok/s of a run without apply and of the run with it (same run of
# this script: compare them, not absolute figures), and the servers' error count.
#   tests/bench/apply_live.sh [TOKENS]
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${MOERPC_BIN:-$PWD/build/bin}
N=${1:-1500}
dir=$(mktemp -d /tmp/moerpc-apply-bench.XXXXXX)
pids=()
trap 'for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$dir"' EXIT
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
"$BIN/moerpc-mkmodel" --out "$dir/m" --seed 5 --layers 4 --experts 32 --topk 4 --hidden 1024 \
    --inter 512 --vocab 1024 >/dev/null 2>&1
echo "apply-bench-token-0123456789" >"$dir/tok"; chmod 600 "$dir/tok"
p0=$(port); p1=$(port); m0=$(port); m1=$(port); mc=$(port)
"$BIN/moerpc-server" --model "$dir/m" --listen 127.0.0.1:$p0 --experts 0-15 --threads 1 \
    --auth-token-file "$dir/tok" --metrics-listen 127.0.0.1:$m0 >"$dir/s0.log" 2>&1 & pids+=($!)
"$BIN/moerpc-server" --model "$dir/m" --listen 127.0.0.1:$p1 --experts 16-31 --threads 1 \
    --auth-token-file "$dir/tok" --metrics-listen 127.0.0.1:$m1 >"$dir/s1.log" 2>&1 & pids+=($!)
for _ in $(seq 1 600); do grep -q serving "$dir/s0.log" && grep -q serving "$dir/s1.log" && break; sleep 0.1; done
cat >"$dir/cluster.json" <<JSON
{"model": "$dir/m", "token_file": "$dir/tok", "deadline_ms": 10000,
 "servers": [{"name": "s0", "address": "127.0.0.1:$p0"}, {"name": "s1", "address": "127.0.0.1:$p1"}]}
JSON
mk() { python3 -c 'import json,sys; json.dump({"format":"moerpc-placement","version":1,"num_layers":4,"num_experts":32,"layers":[{"layer":l,"remote":{"s0":sys.argv[2],"s1":sys.argv[3]}} for l in range(4)]}, open(sys.argv[1],"w"))' "$@"; }
mk "$dir/old.json" 0-15 16-31; mk "$dir/new.json" 0-7 8-31
cp "$dir/old.json" "$dir/active.json"
GEN=(generate --model "$dir/m" --cluster "$dir/cluster.json" --placement "$dir/active.json"
     --prompt-ids 1,2,3 --max-new "$N" --threads 1 --quiet)
"$BIN/moerpc-client" "${GEN[@]}" >"$dir/base.out" 2>/dev/null
"$BIN/moerpc-client" "${GEN[@]}" --watch-placement --metrics-listen 127.0.0.1:$mc >"$dir/live.out" 2>"$dir/live.log" &
g=$!
for _ in $(seq 1 100); do curl -sf http://127.0.0.1:$mc/placement >/dev/null 2>&1 && break; sleep 0.05; done
sleep 0.5
t0=$(date +%s.%N)
"$BIN/moerpc-place" apply --cluster "$dir/cluster.json" "$dir/new.json" \
    --client-placement "$dir/active.json" --client http://127.0.0.1:$mc >"$dir/apply.out" 2>&1
t1=$(date +%s.%N)
wait $g
errs=0
for m in $m0 $m1; do
  e=$(curl -sf http://127.0.0.1:$m/metrics | awk '$1 ~ /^moerpc_errors_total/ {s += $2} END {print s + 0}')
  errs=$((errs + e))
done
echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')"
grep -h 'placement: load 1 done' "$dir/s1.log" | sed 's/.*placement: /s1: /'
awk -v a="$t0" -v b="$t1" 'BEGIN{printf "apply wall time: %.2f s\n", b - a}'
grep -h 'placement: switched' "$dir/live.log" | sed 's/.*placement: /client: /'
echo "decode without apply: $(grep -o 'decode [0-9]* tokens in [0-9.]* s ([0-9.]* tok/s)' "$dir/base.out")"
echo "decode with apply:    $(grep -o 'decode [0-9]* tokens in [0-9.]* s ([0-9.]* tok/s)' "$dir/live.out")"
echo "server errors: $errs"
