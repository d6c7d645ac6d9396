#!/usr/bin/env bash
# tests/gpu/run.sh - the checks of the CUDA backend that need a GPU, in two steps:
#
#   tests/gpu/run.sh bundle   (on the build host) copies what a GPU machine needs into
#                             build/gpu-bundle/: the binaries, test_gc_cuda, libmoerpc-cuda.so,
#                             every non-system shared library ldd names for them, and two
#                             small models made with moerpc-mkmodel; prints the bundle's size.
#   tests/gpu/run.sh run      (on the GPU machine, from the repository root or the bundle)
#                             prints the GPU and CPU, then runs
#                               1. test_gc_cuda (every op vs the CPU backend; must not skip);
#                               2. per model: logits cuda vs cpu (relative L2 <= 1e-3) and 32
#                                  greedy tokens identical, cuda all-local vs cuda with two CPU
#                                  expert servers (identical tokens);
#                               3. decode tok/s and overlap (moerpc-client bench --json) on cuda;
#                               4. with two GPUs or more: --tp 2 over NCCL vs --tp 1 (logits);
#                             and writes JSON lines to $OUT/gpu.jsonl when OUT is set.
#                             Budget: well under 8 minutes (each step has a timeout).
#
# cuBLAS (libcublasLt alone is ~540 MB) and NCCL (~220 MB) are not bundled: the bundle would
# be far past 60 MiB. The GPU machine's CUDA 13 libraries are used (its image must carry
# libcublas.so.13, libcublasLt.so.13 and libnccl.so.2, and a driver for CUDA 13).
#
# The model commands use `moerpc-client ... --backend cpu|cuda` (gpu_client/runner/main.c).
set -u
MODE=${1:-}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)

bundle() {
  local B=${BUILD:-$ROOT/build} D
  D=$B/gpu-bundle
  for f in bin/moerpc-client bin/moerpc-server bin/moerpc-mkmodel tests/test_gc_cuda \
           lib/libmoerpc-cuda.so; do
    [ -x "$B/$f" ] || [ -f "$B/$f" ] || { echo "gpu bundle: $B/$f is missing: run make -j2 all (with nvcc)"; exit 1; }
  done
  rm -rf "$D"
  mkdir -p "$D/bin" "$D/lib" "$D/tests" "$D/models"
  cp "$B/bin/moerpc-client" "$B/bin/moerpc-server" "$B/bin/moerpc-mkmodel" "$D/bin/"
  cp "$B/tests/test_gc_cuda" "$D/tests/"
  cp "$B/lib/libmoerpc-cuda.so" "$D/lib/"
  cp "$ROOT/tests/gpu/run.sh" "$D/run.sh"
  # non-system libraries: everything ldd resolves outside the C runtime and the CUDA
  # toolkit (grpc, protobuf-c, libuv, cjson, hwloc, numa and what they pull in)
  ldd "$D"/bin/* "$D"/tests/* "$D"/lib/libmoerpc-cuda.so 2>/dev/null |
    awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' | sort -u |
    while read -r name path; do
      case $name in
        libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|ld-linux*|libgcc_s.so*|libstdc++.so*) ;;
        libcublas*|libcublasLt*|libnccl*|libcudart*|libcuda.so*) ;;
        *) cp -L "$path" "$D/lib/$name" ;;
      esac
    done
  # debug info is most of their size; the GPU run needs none of it
  if command -v strip >/dev/null; then
    for f in "$D"/bin/* "$D"/tests/* "$D"/lib/*; do strip --strip-debug "$f" 2>/dev/null; done
  fi
  # two small models: a Qwen3-MoE (GQA) and a DeepSeek-V3 (MLA, noaux_tc groups)
  "$D/bin/moerpc-mkmodel" --out "$D/models/qwen" --layers 3 --experts 16 --topk 4 --hidden 256 \
      --inter 128 --vocab 512 --heads 8 --kv-heads 2 --head-dim 64 --seed 7 >/dev/null || exit 1
  "$D/bin/moerpc-mkmodel" --out "$D/models/dsv3" --arch deepseek-v3 --layers 3 --experts 16 \
      --topk 4 --hidden 256 --inter 128 --vocab 512 --seed 7 >/dev/null || exit 1
  echo "gpu bundle: $D, $(du -sh "$D" | cut -f1) ($(du -sb "$D" | cut -f1) bytes)"
  echo "gpu bundle: not bundled (from the GPU image): libcublas.so.13, libcublasLt.so.13, libnccl.so.2"
}

# ---- run ------------------------------------------------------------------------------------
FAILS=0
JSONL=
emit() { # a JSON line to stdout and to $OUT/gpu.jsonl
  echo "$1"
  [ -n "$JSONL" ] && echo "$1" >>"$JSONL"
}
fail() { FAILS=$((FAILS + 1)); emit "{\"check\": \"$1\", \"ok\": false, \"why\": \"$2\"}"; }
pass() { emit "{\"check\": \"$1\", \"ok\": true${2:+, $2}}"; }

run() {
  local D
  if [ -x "$ROOT/bin/moerpc-client" ]; then D=$ROOT; else D=${BUILD:-$ROOT/build}/gpu-bundle; fi
  [ -x "$D/bin/moerpc-client" ] || { echo "gpu run: no bundle at $D (tests/gpu/run.sh bundle)"; exit 1; }
  export LD_LIBRARY_PATH="$D/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export MOERPC_CUDA_LIB="$D/lib/libmoerpc-cuda.so"
  if [ -n "${OUT:-}" ]; then mkdir -p "$OUT"; JSONL=$OUT/gpu.jsonl; : >"$JSONL"; fi
  W=$(mktemp -d)
  pids=()
  trap 'for p in "${pids[@]:-}"; do [ -n "$p" ] && kill "$p" 2>/dev/null; done; rm -rf "$W"' EXIT
  echo "== machine"
  nvidia-smi -L 2>&1 || echo "(no nvidia-smi)"
  grep -m1 'model name' /proc/cpuinfo
  echo "amx: $(grep -o 'amx[a-z_]*' /proc/cpuinfo | sort -u | tr '\n' ' ')"
  local C="$D/bin/moerpc-client" S="$D/bin/moerpc-server"

  echo "== test_gc_cuda"
  (cd "$W" && timeout 180 "$D/tests/test_gc_cuda") >"$W/unit.log" 2>&1
  local rc=$?
  cat "$W/unit.log"
  if [ $rc -ne 0 ]; then fail test_gc_cuda "exit $rc"
  elif grep -q 'skipped: no CUDA device' "$W/unit.log"; then fail test_gc_cuda "skipped: no CUDA device"
  else pass test_gc_cuda; fi

  local ids="1,5,9,13,17,21,25,29,33,37,41,45,49,53,57,61,65,69,73,77,81,85,89,93,97,101,105,109,113,117,121,125,129,133,137,141,145"
  for m in qwen dsv3; do
    local M="$D/models/$m"
    echo "== model $m: logits cuda vs cpu"
    timeout 60 "$C" logits --model "$M" --ids "$ids" --out "$W/$m.cpu.f32" --backend cpu >"$W/l.log" 2>&1 ||
      { cat "$W/l.log"; fail "logits_$m" "cpu run failed"; continue; }
    timeout 60 "$C" logits --model "$M" --ids "$ids" --out "$W/$m.cuda.f32" --backend cuda \
        --compare "$W/$m.cpu.f32" >"$W/l.log" 2>&1 || { cat "$W/l.log"; fail "logits_$m" "cuda run failed"; continue; }
    cat "$W/l.log"
    local rel
    rel=$(sed -n 's/.*relative L2 \([0-9.e+-]*\).*/\1/p' "$W/l.log" | tail -n 1)
    if [ -n "$rel" ] && awk -v r="$rel" 'BEGIN { exit !(r <= 1e-3) }'; then pass "logits_$m" "\"rel_l2\": $rel"
    else fail "logits_$m" "relative L2 ${rel:-?} > 1e-3"; fi

    echo "== model $m: 32 greedy tokens cuda vs cpu"
    local gen=(generate --model "$M" --prompt-ids "1,2,3,4,5;7,8,9" --max-new 32 --json)
    timeout 60 "$C" "${gen[@]}" --backend cpu 2>"$W/g.err" | grep '"seq"' >"$W/$m.gen.cpu"
    timeout 60 "$C" "${gen[@]}" --backend cuda 2>>"$W/g.err" | grep '"seq"' >"$W/$m.gen.cuda"
    if [ -s "$W/$m.gen.cpu" ] && cmp -s "$W/$m.gen.cpu" "$W/$m.gen.cuda"; then pass "greedy_$m"
    else cat "$W/g.err" "$W/$m.gen.cpu" "$W/$m.gen.cuda"; fail "greedy_$m" "tokens differ"; fi

    echo "== model $m: cuda all-local vs two CPU expert servers"
    local p0=$((50551 + RANDOM % 2000)) p1
    p1=$((p0 + 1))
    "$S" --model "$M" --listen "127.0.0.1:$p0" --experts 0-7 --threads 4 >"$W/s0.log" 2>&1 &
    pids+=($!)
    "$S" --model "$M" --listen "127.0.0.1:$p1" --experts 8-15 --threads 4 >"$W/s1.log" 2>&1 &
    pids+=($!)
    for _ in $(seq 1 240); do
      grep -q serving "$W/s0.log" 2>/dev/null && grep -q serving "$W/s1.log" 2>/dev/null && break
      sleep 0.25
    done
    printf '{"deadline_ms": 60000, "servers": [{"name": "s0", "address": "127.0.0.1:%s"}, {"name": "s1", "address": "127.0.0.1:%s"}]}\n' \
        "$p0" "$p1" >"$W/two.json"
    timeout 60 "$C" "${gen[@]}" --backend cuda --cluster "$W/two.json" --local-experts 0 \
        2>"$W/g.err" | grep '"seq"' >"$W/$m.gen.servers"
    if [ -s "$W/$m.gen.servers" ] && cmp -s "$W/$m.gen.cuda" "$W/$m.gen.servers"; then pass "servers_$m"
    else cat "$W/g.err" "$W/s0.log" "$W/$m.gen.servers"; fail "servers_$m" "tokens differ from all-local"; fi

    echo "== model $m: bench (cuda, two servers)"
    local line
    line=$(timeout 90 "$C" bench --model "$M" --backend cuda --cluster "$W/two.json" --local-experts 0 \
           --prompt-len 32 --decode 32 --repeats 1 --json --quiet --log warn 2>"$W/b.err" | head -n 1)
    if [ -n "$line" ]; then emit "{\"check\": \"bench_$m\", \"ok\": true, \"config\": \"cuda-2-servers\", \"result\": $line}"
    else cat "$W/b.err"; fail "bench_$m" "no result"; fi
    line=$(timeout 90 "$C" bench --model "$M" --backend cuda --prompt-len 32 --decode 32 --repeats 1 \
           --json --quiet --log warn 2>"$W/b.err" | head -n 1)
    if [ -n "$line" ]; then emit "{\"check\": \"bench_$m\", \"ok\": true, \"config\": \"cuda-all-local\", \"result\": $line}"
    else cat "$W/b.err"; fail "bench_$m" "no result"; fi
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
    wait 2>/dev/null
    pids=()
  done
  local ngpu
  ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
  echo "== NCCL: test_gc_cuda's one-rank all-reduce above; tensor parallelism on the $ngpu GPU(s) present"
  if [ "$ngpu" -ge 2 ]; then
    for m in qwen dsv3; do
      timeout 90 "$C" logits --model "$D/models/$m" --ids "$ids" --out "$W/$m.tp2.f32" --backend cuda \
          --tp 2 --compare "$W/$m.cuda.f32" >"$W/l.log" 2>&1 || { cat "$W/l.log"; fail "tp2_$m" "run failed"; continue; }
      cat "$W/l.log"
      rel=$(sed -n 's/.*relative L2 \([0-9.e+-]*\).*/\1/p' "$W/l.log" | tail -n 1)
      if [ -n "$rel" ] && awk -v r="$rel" 'BEGIN { exit !(r <= 1e-3) }'; then pass "tp2_$m" "\"rel_l2\": $rel"
      else fail "tp2_$m" "--tp 2 vs --tp 1 relative L2 ${rel:-?} > 1e-3"; fi
    done
  else
    echo "(one GPU: --tp 2 over NCCL needs two; the decomposition itself is tested on the CPU in make test)"
  fi
  echo "gpu run: $FAILS check(s) failed"
  [ $FAILS -eq 0 ]
}

case $MODE in
  bundle) bundle ;;
  run) run ;;
  *) echo "usage: tests/gpu/run.sh bundle|run"; exit 2 ;;
esac
