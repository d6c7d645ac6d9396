#!/usr/bin/env bash
# tests/bench/model_bench.sh - whole-model decode/prefill on Qwen3-30B-A3B's real layer shapes
# (fewer layers): all-local vs 1 and 2 expert servers, max_deferred 0 and 2, on the same
# cores, rounds interleaved (every configuration once per round), medians over rounds.
#
#   tests/bench/model_bench.sh                   makes build/bench/qwen3-30b-a3b-4l if missing
#   MODEL=DIR ROUNDS=3 THREADS=2 PROMPT=32 DECODE=32 tests/bench/model_bench.sh
#   CONFIGS="all-local 2-servers" ...        a subset of the five configurations (only the
#                                            server sets they use are started); also
#                                            1-server-spin: 1-server with the client's
#                                            --wait-spin-us $SPIN_US (default 100);
#                                            all-local-dense-bf16: all-local with the dense
#                                            weights in bf16 (an FP8 checkpoint's are kept
#                                            as fp8-b128 by default)
#   PIN_CLIENT=0,1 PIN_SERVER=2,3 ...        taskset CPU lists for the client and the servers
#                                            (default: unpinned, the same cores for all)
#
# Writes JSON lines (one per run: moerpc-client bench --json summary + "config" and
# "round") to $OUT (default build/bench/model_bench.jsonl) and prints a table of medians:
# decode tok/s, prefill tok/s, overlap, decode_bw_ratio, and remote / all-local (the ratio
# taken within each round, then the median: the host's bandwidth drifts between rounds).
# The servers run on loopback on the same cores as the client: the one server of the
# 1-server set has --threads $THREADS, each of the two of the 2-server set $THREADS / 2
# (at least 1), so that no set has more kernel threads than cores. Memory: the model file (5.3 GB) is held by the all-local client and, in
# total, by each server set (about 16 GB with the page cache).
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
BIN=$BUILD/bin
MODEL=${MODEL:-$BUILD/bench/qwen3-30b-a3b-4l}
ROUNDS=${ROUNDS:-3}
THREADS=${THREADS:-2}
PROMPT=${PROMPT:-32}
DECODE=${DECODE:-32}
OUT=${OUT:-$BUILD/bench/model_bench.jsonl}
PIN_CLIENT=${PIN_CLIENT:-}
PIN_SERVER=${PIN_SERVER:-}
CONFIGS=${CONFIGS:-all-local 1-server 1-server-K2 2-servers 2-servers-K2}
DIR=$(mktemp -d)
mkdir -p "$(dirname "$OUT")"
: >"$OUT"

if [ ! -f "$MODEL/config.json" ]; then
  echo "model_bench: making $MODEL (Qwen3-30B-A3B layer shapes, 4 layers, vocab 32000)"
  "$BIN/moerpc-mkmodel" --out "$MODEL" --layers 4 --hidden 2048 --inter 768 --experts 128 \
      --topk 8 --heads 32 --kv-heads 4 --head-dim 128 --vocab 32000 --seed 1
fi
E=$(python3 -c 'import json,sys; c=json.load(open(sys.argv[1])); print(c.get("num_experts") or c.get("n_routed_experts") or c["num_local_experts"])' "$MODEL/config.json")
half=$((E / 2))

pids=()
cleanup() { for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done; rm -rf "$DIR"; }
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
start_server() { # name experts threads; sets PORT (not in a $(...) subshell: pids+= must stick)
  PORT=$(free_port)
  ${PIN_SERVER:+taskset -c "$PIN_SERVER"} "$BIN/moerpc-server" --model "$MODEL" --listen "127.0.0.1:$PORT" --experts "$2" \
      --threads "$3" >"$DIR/$1.log" 2>&1 &
  pids+=($!)
}
wait_serving() {
  for _ in $(seq 1 1200); do
    local ok=0
    for s in "$@"; do grep -q 'serving' "$DIR/$s.log" 2>/dev/null && ok=$((ok + 1)); done
    [ $ok -eq $# ] && return 0
    sleep 0.25
  done
  echo "model_bench: servers did not start"; tail -n 5 "$DIR"/*.log; exit 1
}
cluster() { # file name:port...
  local f=$1; shift
  { echo '{"deadline_ms": 60000, "servers": ['
    local first=1
    for np in "$@"; do
      [ $first = 1 ] || echo ','
      first=0
      echo "{\"name\": \"${np%%:*}\", \"address\": \"127.0.0.1:${np##*:}\"}"
    done
    echo ']}'; } >"$f"
}

T2=$((THREADS / 2)); [ "$T2" -ge 1 ] || T2=1
# only the server sets some configuration uses (each holds every expert once)
want=()
if [[ " $CONFIGS " == *" 1-server"* ]]; then
  start_server one all "$THREADS"; PA=$PORT; want+=(one)
  cluster "$DIR/one.json" "one:$PA"
fi
if [[ " $CONFIGS " == *" 2-servers"* ]]; then
  start_server s0 "0-$((half - 1))" "$T2"; P0=$PORT
  start_server s1 "$half-$((E - 1))" "$T2"; P1=$PORT; want+=(s0 s1)
  cluster "$DIR/two.json" "s0:$P0" "s1:$P1"
fi
[ ${#want[@]} -eq 0 ] || wait_serving "${want[@]}"

CPU=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')
echo "model_bench: $MODEL, cpu $CPU, threads $THREADS, prompt $PROMPT, decode $DECODE, $ROUNDS rounds ($(date -u +%F))${PIN_CLIENT:+, client on CPUs $PIN_CLIENT}${PIN_SERVER:+, servers on CPUs $PIN_SERVER}"
configs=()
for c in $CONFIGS; do
  case $c in
    all-local) configs+=("all-local||0") ;;
    all-local-dense-bf16) configs+=("all-local-dense-bf16||0|--dense-format bf16") ;;
    1-server) configs+=("1-server|$DIR/one.json|0") ;;
    1-server-K2) configs+=("1-server-K2|$DIR/one.json|2") ;;
    1-server-spin) configs+=("1-server-spin|$DIR/one.json|0|--wait-spin-us ${SPIN_US:-100}") ;;
    2-servers) configs+=("2-servers|$DIR/two.json|0") ;;
    2-servers-K2) configs+=("2-servers-K2|$DIR/two.json|2") ;;
    *) echo "model_bench: CONFIGS: unknown configuration $c" >&2; exit 2 ;;
  esac
done
for r in $(seq 1 "$ROUNDS"); do
  for c in "${configs[@]}"; do
    IFS='|' read -r name cl K more <<<"$c"
    args=(bench --model "$MODEL" --threads "$THREADS" --prompt-len "$PROMPT" --decode "$DECODE"
          --repeats 1 --max-deferred "$K" --json --quiet --log warn)
    # shellcheck disable=SC2206
    [ -n "$more" ] && args+=($more)
    [ -n "$cl" ] && args+=(--cluster "$cl" --local-experts 0)
    line=$(${PIN_CLIENT:+taskset -c "$PIN_CLIENT"} "$BIN/moerpc-client" "${args[@]}" | head -n 1)
    python3 -c 'import json,sys; r=json.loads(sys.argv[1]); r["config"]=sys.argv[2]; r["round"]=int(sys.argv[3]); print(json.dumps(r))' \
        "$line" "$name" "$r" >>"$OUT"
    echo "  round $r $name: $(python3 -c 'import json,sys; r=json.loads(sys.argv[1]); print("decode %.2f tok/s, prefill %.1f tok/s, overlap %.2f, bw_ratio %.2f" % (r["decode_tok_s"], r["prefill_tok_s"], r["overlap"], r["decode_bw_ratio"]))' "$line")"
  done
done

python3 - "$OUT" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
by, base, base50 = {}, {}, {}
for r in rows:
    by.setdefault(r["config"], []).append(r)
    if r["config"] == "all-local":
        base[r["round"]] = r["decode_tok_s"]
        base50[r["round"]] = r["step_ms_p50"]
med = lambda c, k: statistics.median(x[k] for x in by[c])
# the host's bandwidth drifts between rounds: the ratio to all-local is taken within each
# round (same minutes), then the median over rounds
ratio = lambda c: statistics.median(x["decode_tok_s"] / base[x["round"]] for x in by[c])
# The same ratio from each run's median step: what the configuration does step after step,
# without the few steps the host took away from it (a noisy VM stalls a step now and then).
ratio50 = lambda c: statistics.median(base50[x["round"]] / x["step_ms_p50"] for x in by[c])
print("| config | decode tok/s | prefill tok/s | overlap | decode_bw_ratio | decode / all-local (same round) | by median step | runs (decode tok/s) |")
print("|---|---|---|---|---|---|---|---|")
for c in by:
    print("| %s | %.2f | %.1f | %.2f | %.2f | %.2f | %.2f | %s |" % (c, med(c, "decode_tok_s"), med(c, "prefill_tok_s"),
          med(c, "overlap"), med(c, "decode_bw_ratio"), ratio(c), ratio50(c),
          ", ".join("%.2f" % x["decode_tok_s"] for x in by[c])))
PY
for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
wait 2>/dev/null || true
pids=()
