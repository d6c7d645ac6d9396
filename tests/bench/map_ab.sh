#!/usr/bin/env bash
# tests/bench/map_ab.sh - experts served in place from the model's files (--map-weights) against
# the packed copy, in the same run (docs/DESIGN.md section 6.6): the time to ready and the
# server's own compute per layer call on the same weights.
#
#   tests/bench/map_ab.sh [ROUNDS]          # default 3 rounds; Qwen3-30B-A3B expert shapes,
#                                           # 2 layers x 128 experts, bf16 (build/bench/...)
#   THREADS=8 TOKENS=1,16,128 ITERS=500 MODEL=DIR tests/bench/map_ab.sh 5
#
# Each round starts one moerpc-server packed, then one with --map-weights (the page cache
# warm for both), and times `moerpc-client bench-rpc --top-k 8` against each. Prints one
# JSON line per (round, mode, T) and then, per T, the medians: compute p50 (the kernels on
# packed memory vs on the file's pages), round trip p50, and ready seconds, with the ratios
# map / packed.
set -euo pipefail
BUILD=${BUILD:-build}
BIN=${BIN:-$BUILD/bin}
ROUNDS=${1:-3}
THREADS=${THREADS:-2}
TOKENS=${TOKENS:-1,16,128}
ITERS=${ITERS:-500}
MODEL=${MODEL:-$BUILD/bench/qwen3-30b-a3b-l2}
DIR=$(mktemp -d)
spid=
cleanup() { [ -n "$spid" ] && kill -9 "$spid" 2>/dev/null; rm -rf "$DIR"; }
trap cleanup EXIT
if [ ! -f "$MODEL/config.json" ]; then
  echo "map_ab: making $MODEL (Qwen3-30B-A3B expert shapes, 2 layers)" >&2
  "$BIN/moerpc-mkmodel" --out "$MODEL" --layers 2 --hidden 2048 --inter 768 --experts 128 \
      --topk 8 --heads 32 --kv-heads 4 --head-dim 128 --vocab 32000 --seed 1 >/dev/null 2>&1
fi
CPU=$(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //')
echo "map_ab: $MODEL, $ROUNDS rounds, --threads $THREADS, T = $TOKENS, $CPU" >&2
cat "$MODEL"/*.safetensors >/dev/null
for round in $(seq 1 "$ROUNDS"); do
  for mode in packed map; do
    port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
    printf '{"model": "%s", "deadline_ms": 30000, "servers": [{"name": "s0", "address": "127.0.0.1:%s"}]}\n' \
        "$MODEL" "$port" >"$DIR/cluster.json"
    flags=()
    [ "$mode" = map ] && flags=(--map-weights)
    t0=$(date +%s.%N)
    "$BIN/moerpc-server" --model "$MODEL" --listen "127.0.0.1:$port" --experts all \
        --threads "$THREADS" "${flags[@]}" >"$DIR/server.log" 2>&1 &
    spid=$!
    until grep -q 'serving:' "$DIR/server.log" 2>/dev/null; do
      kill -0 "$spid" 2>/dev/null || { tail -5 "$DIR/server.log" >&2; exit 1; }
      sleep 0.005
    done
    ready=$(echo "$t0 $(date +%s.%N)" | awk '{printf "%.3f", $2 - $1}')
    "$BIN/moerpc-client" bench-rpc --cluster "$DIR/cluster.json" --iters "$ITERS" \
        --tokens "$TOKENS" --top-k 8 --json 2>"$DIR/client.log" | grep '^{' |
      sed "s/^{/{\"round\":$round,\"mode\":\"$mode\",\"ready_s\":$ready,/" | tee -a "$DIR/out.jsonl"
    kill -TERM "$spid"
    wait "$spid" || true
    spid=
  done
done
python3 - "$DIR/out.jsonl" "$CPU" "$THREADS" <<'PY'
import json, statistics as st, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
for T in sorted({r["tokens"] for r in rows}):
    m = lambda mode, k: st.median(r[k] for r in rows if r["tokens"] == T and r["mode"] == mode)
    out = {"bench": "map_ab", "tokens": T, "rounds": len(rows) // 2 // len({r["tokens"] for r in rows})}
    for k in ("server_compute_us_p50", "grpc_p50_us", "ready_s"):
        out[k + "_packed"], out[k + "_map"] = m("packed", k), m("map", k)
        out[k + "_ratio"] = round(out[k + "_map"] / out[k + "_packed"], 3) if out[k + "_packed"] else None
    out["threads"], out["cpu"] = int(sys.argv[3]), sys.argv[2]
    print(json.dumps(out))
PY
