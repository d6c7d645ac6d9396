#!/usr/bin/env bash
# tests/bench/cache_restart.sh - restart-to-ready of moerpc-server with and without the
# packed-weight cache (--weight-cache, docs/DESIGN.md section 23), from the page cache.
#
#   tests/bench/cache_restart.sh            # Qwen3-30B-A3B expert shapes, 2 layers x 128
#                                           # experts, bf16: 2.4 GB of expert weights
#   LAYERS=1 RUNS=5 tests/bench/cache_restart.sh
#
# Runs alternate (no cache, cache, no cache, ...) after one untimed warm-up of each, so that
# both read their files from the page cache and the shared machine's noise hits both alike;
# prints each run and the medians. "Ready" is the wall time from the exec to the log line
# "serving:" (readiness SERVING), polled every 5 ms.
set -euo pipefail
BUILD=${BUILD:-build}
BIN=${BIN:-$BUILD/bin}
LAYERS=${LAYERS:-2}
RUNS=${RUNS:-5}
THREADS=${THREADS:-2}
MODEL=${MODEL:-$BUILD/bench/qwen3-30b-a3b-l$LAYERS}
DIR=$(mktemp -d)
trap 'rm -rf "$DIR"' EXIT

if [ ! -f "$MODEL/config.json" ]; then
  echo "cache_restart: making $MODEL (Qwen3-30B-A3B expert shapes, $LAYERS layers)"
  "$BIN/moerpc-mkmodel" --out "$MODEL" --layers "$LAYERS" --hidden 2048 --inter 768 --experts 128 \
      --topk 8 --heads 32 --kv-heads 4 --head-dim 128 --vocab 32000 --seed 1 >/dev/null 2>&1
fi

run() { # label extra-args... ; prints the seconds to ready
  local log="$DIR/$1.log"; shift
  local t0 t1
  t0=$(date +%s.%N)
  "$BIN/moerpc-server" --model "$MODEL" --listen 127.0.0.1:0 --experts all --threads "$THREADS" \
      "$@" >"$log" 2>&1 &
  local pid=$!
  until grep -q 'serving:' "$log" 2>/dev/null; do
    kill -0 $pid 2>/dev/null || { echo "cache_restart: server died" >&2; tail -5 "$log" >&2; exit 1; }
    sleep 0.005
  done
  t1=$(date +%s.%N)
  # Let a background write or check finish (it is not part of ready), then stop.
  if [[ " $* " == *" --weight-cache "* ]]; then
    for _ in $(seq 1 600); do
      grep -q 'weight cache: written\|all checksums match' "$log" && break
      sleep 0.1
    done
  fi
  kill -TERM $pid; wait $pid || true
  echo "$t0 $t1" | awk '{printf "%.3f\n", $2 - $1}'
}

median() { sort -n | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2}'; }

rm -rf "$DIR/cache"
run warm-plain >/dev/null
run warm-cache --weight-cache "$DIR/cache" >/dev/null # writes the cache
grep -h 'weight cache: written' "$DIR/warm-cache.log" | sed 's/^/  /'
plain=() cached=()
for i in $(seq 1 "$RUNS"); do
  p=$(run "plain-$i"); c=$(run "cache-$i" --weight-cache "$DIR/cache")
  plain+=("$p"); cached+=("$c")
  echo "run $i: no cache ${p} s, cache ${c} s"
done
grep -h 'weight cache: hit\|loaded:' "$DIR/cache-1.log" | sed 's/^/  /'
grep -h 'loaded:' "$DIR/plain-1.log" | sed 's/^/  /'
grep -h 'verified in the background' "$DIR/cache-1.log" | sed 's/^/  /' || true
gb=$(du -sb "$DIR/cache" | awk '{printf "%.2f", $1 / 1e9}')
echo "median restart-to-ready: no cache $(printf '%s\n' "${plain[@]}" | median) s, cache $(printf '%s\n' "${cached[@]}" | median) s ($gb GB cache, $RUNS runs each, interleaved)"
