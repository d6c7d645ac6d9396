#!/usr/bin/env bash
# tests/bench/many_cores.sh - issue 24's figures on a host with many cores (loading over every
# core, restart from the weight cache, the RPC with client and server on cores of their own,
# one server against all-local on the same two cores), in one call, for a machine that is
# lent for minutes (the device tool's 16-core H200 host) or any host with >= 8 CPUs.
#
#   tests/bench/many_cores.sh                                  # build/bin
#   BIN=build/gpu-bundle/bin OUT=$OUT tests/bench/many_cores.sh   # a bundle (tests/gpu/run.sh)
#   STEPS="load rpc" ...                                       # a subset of: load cache rpc map model
#
# Steps (each under its own time limit; JSON lines of every step in $OUT/many_cores.jsonl):
#   load   tests/bench/load_speed.sh, --threads = every CPU, warm (RUNS=3, no scalar
#          baselines) and cold (page cache dropped, where root may);
#   cache  tests/bench/cache_restart.sh, --threads = every CPU, 3 runs each way;
#   rpc    tests/bench/rpc_pinned.sh 3 (T = 1, 16): server pinned to the last CPU, client to
#          the first, each a physical core of its own here; rpc_wide: each on half the CPUs;
#   map    tests/bench/map_ab.sh 3: --map-weights against packed (ready, compute at T = 1, 16);
#   model  tests/bench/model_bench.sh, all-local vs one server, 5 rounds, 64 decode steps:
#          (a) client and server on the same CPUs 0,1 (the 2-core target of issue 24),
#          (b) the client on CPUs 0,1 and the server on CPUs 2,3 (cores of its own).
# Models (Qwen3-30B-A3B expert shapes: 2 layers bf16 and fp8, 4 layers bf16 with vocab
# 32000) are made in $WORK/bench first, in parallel (about 30 s at 0.2 GB/s each).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BIN=$(cd "${BIN:-$ROOT/build/bin}" && pwd)
OUT=${OUT:-$ROOT/build/bench/many_cores}
STEPS=${STEPS:-load cache rpc map model}
W=${WORK:-$(mktemp -d /tmp/moerpc-many.XXXXXX)}
mkdir -p "$OUT" "$W/b/bench"
ln -sfn "$BIN" "$W/b/bin"
[ -d "$BIN/../lib" ] && export LD_LIBRARY_PATH="$BIN/../lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
J=$OUT/many_cores.jsonl
: >"$J"
ncpu=$(nproc)
CPU=$(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //')
AMX=$(grep -o 'amx[a-z_0-9]*' /proc/cpuinfo | sort -u | tr '\n' ' ')
NODES=$(ls -d /sys/devices/system/node/node* 2>/dev/null | wc -l)
echo "{\"bench\": \"many_cores\", \"cpu\": \"$CPU\", \"cpus\": $ncpu, \"numa_nodes\": $NODES, \"amx\": \"$AMX\", \"date\": \"$(date -u +%FT%H:%MZ)\", \"mem_gb\": $(awk '/MemTotal/ {printf "%.0f", $2 / 1e6}' /proc/meminfo), \"thp\": \"$(cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null)\"}" | tee -a "$J"
want() { case " $STEPS " in *" $1 "*) return 0 ;; esac; return 1; }
step() { # name limit cmd...: runs one step, its JSON lines into $J, its log into $OUT
  local n=$1 l=$2 t0=$SECONDS rc; shift 2
  echo "== $n (limit $l s)"
  timeout "$l" "$@" >"$OUT/$n.log" 2>&1
  rc=$?
  grep -h '^{' "$OUT/$n.log" | sed "s/^{/{\"step\": \"$n\", /" >>"$J"
  grep -v '^{' "$OUT/$n.log" | tail -n 12
  echo "{\"step\": \"$n\", \"rc\": $rc, \"s\": $((SECONDS - t0))}" | tee -a "$J"
}

M2=$W/b/bench/qwen3-30b-a3b-l2 M8=$W/b/bench/qwen3-30b-a3b-l2-fp8 M4=$W/b/bench/qwen3-30b-a3b-4l
mk() { # out layers dtype
  [ -f "$1/config.json" ] || "$BIN/moerpc-mkmodel" --out "$1" --layers "$2" --hidden 2048 --inter 768 \
      --experts 128 --topk 8 --heads 32 --kv-heads 4 --head-dim 128 --vocab 32000 --seed 1 \
      --dtype "$3" >"$W/mk.$(basename "$1").log" 2>&1
}
t0=$SECONDS
{ want load || want cache || want map; } && { mk "$M2" 2 bf16 & mk "$M8" 2 fp8 & }
want model && mk "$M4" 4 bf16 &
wait
echo "(models made in $((SECONDS - t0)) s: $(du -sh "$W/b/bench" | cut -f1))"

want load && step load 150 env BUILD="$W/b" MODEL="$M2" FP8="$M8" THREADS="$ncpu" RUNS=3 SCALAR=0 COLD=1 \
    bash "$ROOT/tests/bench/load_speed.sh"
want cache && step cache 60 env BUILD="$W/b" MODEL="$M2" THREADS="$ncpu" RUNS=3 \
    bash "$ROOT/tests/bench/cache_restart.sh"
want rpc && step rpc 60 env BIN="$BIN" TOKENS=1,16 ITERS=2000 bash "$ROOT/tests/bench/rpc_pinned.sh" 3
# the same with each side on half the CPUs (its gRPC threads on cores of their own)
want rpc && step rpc_wide 60 env BIN="$BIN" TOKENS=1,16 ITERS=2000 CLIENT_CPUS=0-$((ncpu / 2 - 1)) \
    SERVER_CPUS=$((ncpu / 2))-$((ncpu - 1)) bash "$ROOT/tests/bench/rpc_pinned.sh" 3
want map && step map 120 env BUILD="$W/b" MODEL="$M2" THREADS="$ncpu" TOKENS=1,16 ITERS=300 \
    bash "$ROOT/tests/bench/map_ab.sh" 3
if want model; then
  step model_same_2cpus 80 env BUILD="$W/b" MODEL="$M4" OUT="$W/mb1.jsonl" THREADS=2 ROUNDS=5 DECODE=64 \
      PIN_CLIENT=0,1 PIN_SERVER=0,1 CONFIGS="all-local 1-server" bash "$ROOT/tests/bench/model_bench.sh"
  sed 's/^{/{"step": "model_same_2cpus", /' "$W/mb1.jsonl" >>"$J" 2>/dev/null
  step model_own_2cpus 80 env BUILD="$W/b" MODEL="$M4" OUT="$W/mb2.jsonl" THREADS=2 ROUNDS=5 DECODE=64 \
      PIN_CLIENT=0,1 PIN_SERVER=2,3 CONFIGS="all-local 1-server" bash "$ROOT/tests/bench/model_bench.sh"
  sed 's/^{/{"step": "model_own_2cpus", /' "$W/mb2.jsonl" >>"$J" 2>/dev/null
fi
[ -n "${WORK:-}" ] || rm -rf "$W"
echo "many_cores: $SECONDS s; $J"
grep -h '"ratio\|ready\|rpc_pinned\|"rc"' "$J" | cut -c1-220
