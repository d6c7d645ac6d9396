#!/usr/bin/env bash
# deploy/demo.sh (make demo) - the main job on a small built-in default:
#   1. installs dependencies and builds,
#   2. makes a small random Qwen3-MoE model (moerpc-mkmodel),
#   3. starts two expert servers on loopback, each owning half of the experts,
#   4. runs `moerpc-client verify` (every MoE layer through the cluster vs a local kn_ref)
#      and `moerpc-client bench-rpc` (gRPC round trip vs raw TCP ping-pong),
#   5. stops the servers with SIGTERM (they drain and exit 0) and prints a summary.
# Environment: DEMO_DIR (default build/demo), MKMODEL_FLAGS (extra flags for the model),
# SERVER_FLAGS (extra flags for both servers), BENCH_ITERS (default 200).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
DEMO_DIR=${DEMO_DIR:-$BUILD/demo}
BIN=$BUILD/bin
BENCH_ITERS=${BENCH_ITERS:-200}

step() { printf '\n==> %s\n' "$*"; }

step "dependencies"
bash deploy/install-deps.sh --no-python
step "build"
make -j"$(nproc)" all >/dev/null
echo "built $(ls $BIN | tr '\n' ' ')"

rm -rf "$DEMO_DIR"; mkdir -p "$DEMO_DIR"
step "model"
"$BIN/moerpc-mkmodel" --out "$DEMO_DIR/model" --seed 1 ${MKMODEL_FLAGS:-}
E=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["num_experts"])' "$DEMO_DIR/model/config.json")
half=$((E / 2))

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
P0=$(free_port); P1=$(free_port)
while [ "$P1" = "$P0" ]; do P1=$(free_port); done

step "servers: s0 owns experts 0-$((half-1)) on 127.0.0.1:$P0, s1 owns $half-$((E-1)) on 127.0.0.1:$P1"
pids=()
cleanup() { for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done; }
trap cleanup EXIT
"$BIN/moerpc-server" --model "$DEMO_DIR/model" --listen "127.0.0.1:$P0" --experts "0-$((half-1))" \
    ${SERVER_FLAGS:-} >"$DEMO_DIR/s0.log" 2>&1 & pids+=($!)
"$BIN/moerpc-server" --model "$DEMO_DIR/model" --listen "127.0.0.1:$P1" --experts "$half-$((E-1))" \
    ${SERVER_FLAGS:-} >"$DEMO_DIR/s1.log" 2>&1 & pids+=($!)

cat >"$DEMO_DIR/cluster.json" <<JSON
{
  "model": "$PWD/$DEMO_DIR/model",
  "deadline_ms": 10000,
  "servers": [
    {"name": "s0", "address": "127.0.0.1:$P0"},
    {"name": "s1", "address": "127.0.0.1:$P1"}
  ]
}
JSON

# Wait until both servers say they are serving (or one dies).
for i in $(seq 1 600); do
  ok=0
  for s in s0 s1; do grep -q 'serving' "$DEMO_DIR/$s.log" 2>/dev/null && ok=$((ok+1)); done
  [ $ok -eq 2 ] && break
  for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null || { echo "a server died:"; tail -n 20 "$DEMO_DIR"/s*.log; exit 1; }; done
  sleep 0.1
done
grep -h -E 'loaded|serving' "$DEMO_DIR"/s0.log "$DEMO_DIR"/s1.log | sed 's/^/    /'

step "moerpc-client info"
"$BIN/moerpc-client" info --cluster "$DEMO_DIR/cluster.json"

step "moerpc-client verify (cluster vs local kn_ref, f32 and bf16 wire)"
"$BIN/moerpc-client" verify --cluster "$DEMO_DIR/cluster.json" --tokens 16 --dtype f32 | tee "$DEMO_DIR/verify-f32.txt"
"$BIN/moerpc-client" verify --cluster "$DEMO_DIR/cluster.json" --tokens 16 --dtype bf16 | tee "$DEMO_DIR/verify-bf16.txt"

step "moerpc-client bench-rpc (gRPC round trip vs raw TCP ping-pong, same bytes, same run)"
"$BIN/moerpc-client" bench-rpc --cluster "$DEMO_DIR/cluster.json" --iters "$BENCH_ITERS" --json \
    >"$DEMO_DIR/bench-rpc.jsonl" 2>"$DEMO_DIR/bench-rpc.log" || { cat "$DEMO_DIR/bench-rpc.log"; exit 1; }
cat "$DEMO_DIR/bench-rpc.log"

step "stop servers (SIGTERM: drain, exit 0)"
rc=0
for i in 0 1; do
  kill -TERM "${pids[$i]}"
  if wait "${pids[$i]}"; then echo "    s$i exited 0"; else rc=$?; echo "    s$i exited $rc"; fi
done
pids=()
grep -h -E 'draining|stopped' "$DEMO_DIR"/s0.log "$DEMO_DIR"/s1.log | sed 's/^/    /'
[ $rc -eq 0 ] || exit $rc

step "summary"
echo "model:        $DEMO_DIR/model ($(du -sh "$DEMO_DIR/model" | cut -f1), $E experts)"
echo "verify:       $(tail -n 1 "$DEMO_DIR/verify-f32.txt")"
echo "              $(tail -n 1 "$DEMO_DIR/verify-bf16.txt")"
echo "bench-rpc:    $DEMO_DIR/bench-rpc.jsonl"
python3 - "$DEMO_DIR/bench-rpc.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    line = line.strip()
    if not line.startswith("{"): continue
    r = json.loads(line)
    print("              T=%-4s grpc p50 %8.1f us   tcp p50 %7.1f us   ratio %.2f" % (
        r.get("tokens"), r.get("grpc_p50_us", 0), r.get("tcp_p50_us", 0), r.get("ratio_p50", 0)))
PY
echo "logs:         $DEMO_DIR/s0.log $DEMO_DIR/s1.log"
echo "demo: ok"
