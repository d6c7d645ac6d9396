#!/usr/bin/env bash
# tests/gpu/run.sh - the checks of the CUDA backend that need a GPU, in two steps:
#
#   tests/gpu/run.sh bundle   (on the build host, after make) copies what a GPU machine needs
#                             into build/gpu-bundle/: the binaries, test_gc_cuda,
#                             libmoerpc-cuda.so, libmoerpc-client.so, every non-system shared
#                             library ldd names for them, and a small Mixtral checkpoint made
#                             by transformers (tests/gpu/mk_mixtral.py, with .venv-conf when it
#                             is there); prints the bundle's size. The other models are made
#                             on the GPU machine by the bundled moerpc-mkmodel.
#   tests/gpu/run.sh run      (on the GPU machine, from the repository root) prints the GPU,
#                             the CPU and where the CUDA libraries resolve, then runs
#                               1. test_gc_cuda (every op vs the CPU backend; must not skip);
#                               2. per model (Qwen3-MoE bf16, Mixtral bf16, DeepSeek-V3 fp8):
#                                  logits cuda vs cpu (relative L2 <= 1e-3), 32 greedy tokens
#                                  identical, cuda vs cpu with the cold experts on two CPU
#                                  expert servers (identical tokens). The CPU side runs at
#                                  MOERPC_ISA=avx2, its fp32-activation paths, against the
#                                  GPU's default split activations (about fp32): the AMX and
#                                  AVX-512 BF16 paths round activations to bf16, 4e-3 over a
#                                  model, and greedy tokens then part at a near-tie. The CPU
#                                  holds hot experts in the GPU's format (--format bf16: the
#                                  GPU dequantizes fp8 experts to bf16); the distance to the
#                                  CPU's exact fp8-b128 experts is reported beside it;
#                               3. decode on a 4-layer Qwen3-30B-A3B-shaped model: cuda
#                                  all-local (split and bf16 activations), cuda + two pinned
#                                  expert servers (K = 0, 2; K = 2 with 32 hot experts per
#                                  layer on the GPU), cpu all-local, cpu + the servers (K = 2);
#                                  the servers at their default (fastest) ISA;
#                               4. the SGLang adapter's CUDA-tensor path
#                                  (tests/gpu/test_wrapper_cuda.py: stream order, deferral,
#                                  graph capture) under the image's torch;
#                               4b. serve (OpenAI API) on cuda vs cpu: six greedy completions
#                                  at once into 4 KV slots, 16-token steps, and a streamed
#                                  chat, the same texts on both (serve_check);
#                               5. compute-sanitizer memcheck on a short generate (API errors
#                                  reported too) and on test_gc_cuda (API errors not reported:
#                                  NCCL's init probes kernels it has no image for and handles
#                                  the error itself; every CUDA call of ours is checked);
#                               6. with two GPUs or more: --tp 2 over NCCL vs --tp 1 (logits);
#                             and writes JSON lines to $OUT/gpu.jsonl when OUT is set.
#                             Budget: GPU_BUDGET_S seconds in all (default 450); a step that
#                             would start past it is reported as skipped. GPU_STEPS picks
#                             steps (unit models bench wrapper serve memcheck tp; default
#                             all), e.g. GPU_STEPS="unit serve" to re-check a fix.
#
# cuBLAS (libcublasLt alone is ~540 MB) and NCCL (~220 MB) are not bundled: the GPU image's
# CUDA 13 libraries are used (found under /usr/local/cuda or the image's Python packages).
# The model commands use `moerpc-client ... --backend cpu|cuda` (gpu_client/runner/main.c).
set -u
MODE=${1:-}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)

bundle() {
  local B=${BUILD:-$ROOT/build} D
  D=$B/gpu-bundle
  for f in bin/moerpc-client bin/moerpc-server bin/moerpc-mkmodel tests/test_gc_cuda \
           lib/libmoerpc-cuda.so lib/libmoerpc-client.so lib/libmoerpc-test.so; do
    [ -x "$B/$f" ] || [ -f "$B/$f" ] || { echo "gpu bundle: $B/$f is missing: run make -j2 all (with nvcc)"; exit 1; }
  done
  rm -rf "$D"
  mkdir -p "$D/bin" "$D/lib" "$D/tests" "$D/models"
  cp "$B/bin/moerpc-client" "$B/bin/moerpc-server" "$B/bin/moerpc-mkmodel" "$D/bin/"
  cp "$B/tests/test_gc_cuda" "$D/tests/"
  cp "$B/lib/libmoerpc-cuda.so" "$B/lib/libmoerpc-client.so" "$B/lib/libmoerpc-test.so" "$D/lib/"
  # non-system libraries: everything ldd resolves outside the C runtime and the CUDA
  # toolkit (grpc, protobuf-c, libuv, cjson, hwloc, numa and what they pull in)
  ldd "$D"/bin/* "$D"/tests/* "$D"/lib/*.so 2>/dev/null |
    awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' | sort -u |
    while read -r name path; do
      case $name in
        libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|ld-linux*|libgcc_s.so*|libstdc++.so*) ;;
        libcublas*|libcublasLt*|libnccl*|libcudart*|libcuda.so*) ;;
        libmoerpc*) ;;
        *) [ -e "$D/lib/$name" ] || cp -L "$path" "$D/lib/$name" ;;
      esac
    done
  # debug info is most of their size; the GPU run needs none of it
  if command -v strip >/dev/null; then
    for f in "$D"/bin/* "$D"/tests/* "$D"/lib/*; do strip --strip-debug "$f" 2>/dev/null; done
  fi
  local py=$ROOT/.venv-conf/bin/python
  if [ -x "$py" ] && "$py" "$ROOT/tests/gpu/mk_mixtral.py" "$D/models/mixtral" >/dev/null 2>&1; then
    echo "gpu bundle: Mixtral checkpoint made by transformers ($D/models/mixtral)"
  else
    echo "gpu bundle: no Mixtral checkpoint (needs .venv-conf with transformers: tests/conformance/run.sh)"
  fi
  echo "gpu bundle: $D, $(du -sh "$D" | cut -f1) ($(du -sb "$D" | cut -f1) bytes)"
  echo "gpu bundle: not bundled (from the GPU image): libcublas.so.13, libcublasLt.so.13, libnccl.so.2"
}

# ---- run ------------------------------------------------------------------------------------
FAILS=0
JSONL=
emit() { # a JSON line to stdout and to $OUT/gpu.jsonl
  echo "$1"
  if [ -n "$JSONL" ]; then echo "$1" >>"$JSONL"; fi
}
fail() { FAILS=$((FAILS + 1)); emit "{\"check\": \"$1\", \"ok\": false, \"why\": \"$2\"}"; }
pass() { emit "{\"check\": \"$1\", \"ok\": true${2:+, $2}}"; }
# budget: the seconds a step may take, at most what is left of GPU_BUDGET_S (0: skip it)
tlimit() { local left=$((BUDGET - SECONDS)); [ "$left" -gt "$1" ] && left=$1; [ "$left" -lt 5 ] && left=0; echo "$left"; }
# GPU_STEPS: the steps to run (unit models bench wrapper serve memcheck tp; default all)
want() { case " ${GPU_STEPS:-all} " in *" all "*|*" $1 "*) return 0 ;; esac; return 1; }
skipped() { emit "{\"check\": \"$1\", \"ok\": null, \"why\": \"skipped: the run's budget (GPU_BUDGET_S=$BUDGET) is spent\"}"; }

# the directory of a CUDA library the GPU image carries, for LD_LIBRARY_PATH
cuda_lib_dir() {
  local f
  for f in /usr/local/cuda/lib64/"$1" /usr/local/cuda/targets/x86_64-linux/lib/"$1" \
           /usr/lib/x86_64-linux-gnu/"$1"; do
    [ -e "$f" ] && { dirname "$f"; return; }
  done
  f=$(find /opt /usr/local /usr/lib -name "$1" 2>/dev/null | head -n 1)
  [ -n "$f" ] && dirname "$f"
}

experts_of() { # the model's expert count
  sed -n 's/.*"\(num_experts\|n_routed_experts\|num_local_experts\)": *\([0-9]*\).*/\2/p' "$1/config.json" | head -n 1
}

start_servers() { # model name-prefix cpus0 cpus1 threads: starts two servers, half the experts each
  local M=$1 n=$2 E half p0 p1
  E=$(experts_of "$M")
  half=$((E / 2))
  p0=$((40000 + RANDOM % 20000)); p1=$((p0 + 1))
  $PIN0 env ${SRV_ISA:+MOERPC_ISA=$SRV_ISA} "$S" --model "$M" --listen "127.0.0.1:$p0" --experts "0-$((half - 1))" --threads "$SRV_T" >"$W/$n.s0.log" 2>&1 &
  pids+=($!)
  $PIN1 env ${SRV_ISA:+MOERPC_ISA=$SRV_ISA} "$S" --model "$M" --listen "127.0.0.1:$p1" --experts "$half-$((E - 1))" --threads "$SRV_T" >"$W/$n.s1.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 1 600); do
    grep -q serving "$W/$n.s0.log" 2>/dev/null && grep -q serving "$W/$n.s1.log" 2>/dev/null && break
    sleep 0.1
  done
  printf '{"deadline_ms": 60000, "servers": [{"name": "s0", "address": "127.0.0.1:%s"}, {"name": "s1", "address": "127.0.0.1:%s"}]}\n' \
      "$p0" "$p1" >"$W/$n.cluster.json"
}
stop_servers() { for p in "${pids[@]:-}"; do [ -n "$p" ] && kill "$p" 2>/dev/null; done; wait 2>/dev/null; pids=(); }

# serve on each backend in turn (the CPU at its fp32-activation paths and the GPU's expert
# format), six completions at once (prompts of 7..42 words, greedy, 24 tokens) into 4 KV
# slots with 16-token steps (queueing, joining at step boundaries, chunked prefill) and one
# streamed chat; the texts must be the same on both backends.
serve_check() {
  local tl=$1 bk port sp i n
  for bk in cpu cuda; do
    port=$((40000 + RANDOM % 20000))
    local flags=(--backend "$bk")
    [ "$bk" = cpu ] && flags+=(--isa avx2 --format bf16)
    timeout "$tl" "$C" serve --model "$W/qwen" "${flags[@]}" --max-batch 4 --step-tokens 16 \
        --listen "127.0.0.1:$port" --quiet >"$W/serve.$bk.log" 2>&1 &
    sp=$!
    for _ in $(seq 1 300); do
      curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break
      kill -0 "$sp" 2>/dev/null || break
      sleep 0.1
    done
    local cp=()
    for i in 1 2 3 4 5 6; do
      n=$((i * 7))
      curl -s -m 60 "http://127.0.0.1:$port/v1/completions" -H 'Content-Type: application/json' \
          -d "{\"model\": \"qwen\", \"prompt\": \"$(printf 'word%d ' $(seq 1 $n))\", \"max_tokens\": 24, \"temperature\": 0}" \
          >"$W/serve.$bk.$i.json" 2>/dev/null &
      cp+=($!)
    done
    curl -sN -m 60 "http://127.0.0.1:$port/v1/chat/completions" -H 'Content-Type: application/json' \
        -d '{"model": "qwen", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 16, "temperature": 0, "stream": true}' \
        >"$W/serve.$bk.stream" 2>/dev/null &
    cp+=($!)
    wait "${cp[@]}"
    kill -TERM "$sp" 2>/dev/null
    wait "$sp" 2>/dev/null
  done
  local out
  if out=$(python3 - "$W" 2>&1 <<'PY'
import json, sys
w = sys.argv[1]
def texts(bk):
    t = []
    for i in range(1, 7):
        r = json.load(open(f"{w}/serve.{bk}.{i}.json"))
        t.append(r["choices"][0]["text"])
    s = open(f"{w}/serve.{bk}.stream").read()
    if "data: [DONE]" not in s:
        raise SystemExit(f"{bk}: the stream did not end with [DONE]")
    parts = [json.loads(l[6:]) for l in s.splitlines() if l.startswith("data: {")]
    t.append("".join(c["delta"].get("content") or "" for p in parts for c in p["choices"]))
    return t
a, b = texts("cpu"), texts("cuda")
if not all(a):
    raise SystemExit("an empty text on cpu")
diff = [i for i in range(len(a)) if a[i] != b[i]]
if diff:
    raise SystemExit(f"texts differ for requests {diff}: cpu {a[diff[0]]!r} cuda {b[diff[0]]!r}")
print(f"{len(a)} texts equal, {sum(len(x) for x in a)} chars")
PY
  ); then pass serve "\"what\": \"$out\""
  else echo "$out"; tail -n 5 "$W/serve.cuda.log" "$W/serve.cpu.log"; fail serve "$(echo "$out" | tail -n 1 | tr -d '"' | cut -c1-200)"; fi
}

run() {
  local D
  D=${BUILD:-$ROOT/build}/gpu-bundle
  [ -x "$D/bin/moerpc-client" ] || { echo "gpu run: no bundle at $D (tests/gpu/run.sh bundle)"; exit 1; }
  BUDGET=${GPU_BUDGET_S:-450}
  SECONDS=0
  local L d
  L="$D/lib"
  for lib in libcublas.so.13 libcublasLt.so.13 libnccl.so.2; do
    d=$(cuda_lib_dir "$lib")
    [ -n "$d" ] && case ":$L:" in *":$d:"*) ;; *) L="$L:$d" ;; esac
  done
  export LD_LIBRARY_PATH="$L${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export MOERPC_CUDA_LIB="$D/lib/libmoerpc-cuda.so" MOERPC_LIB="$D/lib/libmoerpc-client.so"
  if [ -n "${OUT:-}" ]; then mkdir -p "$OUT"; JSONL=$OUT/gpu.jsonl; : >"$JSONL"; fi
  W=$(mktemp -d)
  pids=()
  trap 'stop_servers; rm -rf "$W"' EXIT
  C="$D/bin/moerpc-client"; S="$D/bin/moerpc-server"
  local ncpu
  ncpu=$(nproc)
  # pinning: client on the first half of the cores, the two servers a quarter each
  if [ "$ncpu" -ge 8 ] && command -v taskset >/dev/null; then
    local q=$((ncpu / 4))
    PINC="taskset -c 0-$((2 * q - 1))"; PIN0="taskset -c $((2 * q))-$((3 * q - 1))"
    PIN1="taskset -c $((3 * q))-$((4 * q - 1))"; SRV_T=$q; CLI_T=$((2 * q))
  else
    PINC=""; PIN0=""; PIN1=""; SRV_T=1; CLI_T=0
  fi

  echo "== machine"
  nvidia-smi 2>&1 | head -n 20 || echo "(no nvidia-smi)"
  local gpu cpu
  gpu=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -n 1)
  cpu=$(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //')
  echo "cpu: $cpu, $ncpu cores; amx: $(grep -o 'amx[a-z_0-9]*' /proc/cpuinfo | sort -u | tr '\n' ' ')"
  ldd "$MOERPC_CUDA_LIB" | grep -E 'cublas|nccl|not found'
  emit "{\"check\": \"machine\", \"gpu\": \"$gpu\", \"cpu\": \"$cpu\", \"cores\": $ncpu, \"amx\": \"$(grep -o 'amx[a-z_0-9]*' /proc/cpuinfo | sort -u | tr '\n' ' ')\", \"pin_client\": \"$PINC\", \"pin_servers\": \"$PIN0 / $PIN1\"}"

  local rc t0
  if want unit; then
    echo "== test_gc_cuda"
    t0=$SECONDS
    (cd "$W" && timeout "$(tlimit 180)" "$D/tests/test_gc_cuda") >"$W/unit.log" 2>&1
    rc=$?
    cat "$W/unit.log"
    if [ $rc -ne 0 ]; then fail test_gc_cuda "exit $rc"
    elif grep -q 'skipped: no CUDA device' "$W/unit.log"; then fail test_gc_cuda "skipped: no CUDA device"
    else pass test_gc_cuda "\"s\": $((SECONDS - t0))"; fi
  fi

  echo "== models"
  "$D/bin/moerpc-mkmodel" --out "$W/qwen" --layers 3 --experts 16 --topk 4 --hidden 256 \
      --inter 128 --vocab 512 --heads 8 --kv-heads 2 --head-dim 64 --seed 7 >/dev/null 2>&1
  "$D/bin/moerpc-mkmodel" --out "$W/dsv3-fp8" --arch deepseek-v3 --dtype fp8 --layers 3 \
      --experts 16 --topk 4 --hidden 256 --inter 128 --vocab 512 --seed 7 >/dev/null 2>&1
  local models="$W/qwen $W/dsv3-fp8"
  [ -f "$D/models/mixtral/config.json" ] && models="$W/qwen $D/models/mixtral $W/dsv3-fp8"
  [ -f "$D/models/mixtral/config.json" ] || fail mixtral "no Mixtral checkpoint in the bundle"
  local ids="1,5,9,13,17,21,25,29,33,37,41,45,49,53,57,61,65,69,73,77,81,85,89,93,97,101,105,109,113,117,121,125,129,133,137,141,145"
  local gen=(generate --prompt-ids "1,2,3,4,5;7,8,9" --max-new 32 --json)
  local M m rel tl
  want models || models=""
  for M in $models; do
    m=$(basename "$M")
    tl=$(tlimit 60); [ "$tl" -eq 0 ] && { skipped "model_$m"; continue; }
    echo "== model $m: logits cuda vs cpu"
    timeout "$tl" "$C" logits --model "$M" --ids "$ids" --out "$W/$m.cpu.f32" --backend cpu --isa avx2 \
        --format bf16 >"$W/l.log" 2>&1 ||
      { cat "$W/l.log"; fail "logits_$m" "cpu run failed"; continue; }
    if timeout "$tl" "$C" logits --model "$M" --ids "$ids" --out "$W/$m.cuda.f32" --backend cuda \
        --compare "$W/$m.cpu.f32" >"$W/l.log" 2>&1; then
      grep -v ' INFO ' "$W/l.log"
      rel=$(sed -n 's/.*relative L2 \([0-9.e+-]*\).*/\1/p' "$W/l.log" | tail -n 1)
      if [ -n "$rel" ] && awk -v r="$rel" 'BEGIN { exit !(r <= 1e-3) }'; then pass "logits_$m" "\"rel_l2\": $rel"
      else fail "logits_$m" "relative L2 ${rel:-?} > 1e-3"; fi
    else
      tail -n 20 "$W/l.log"; fail "logits_$m" "cuda run failed"
    fi
    if grep -q '"quantization_config"' "$M/config.json" &&
       timeout "$tl" "$C" logits --model "$M" --ids "$ids" --out "$W/$m.cpu8.f32" --backend cpu \
           --isa avx2 --compare "$W/$m.cuda.f32" >"$W/l.log" 2>&1; then
      rel=$(sed -n 's/.*relative L2 \([0-9.e+-]*\).*/\1/p' "$W/l.log" | tail -n 1)
      emit "{\"check\": \"logits_${m}_vs_cpu_stored_format\", \"ok\": null, \"rel_l2\": ${rel:-null}, \"note\": \"cuda (bf16 hot experts) vs cpu holding the fp8 experts exactly\"}"
    fi

    echo "== model $m: 32 greedy tokens cuda vs cpu"
    timeout "$tl" "$C" "${gen[@]}" --model "$M" --backend cpu --isa avx2 --format bf16 2>"$W/g.err" | grep '"seq"' >"$W/$m.gen.cpu"
    timeout "$tl" "$C" "${gen[@]}" --model "$M" --backend cuda 2>>"$W/g.err" | grep '"seq"' >"$W/$m.gen.cuda"
    if [ -s "$W/$m.gen.cpu" ] && cmp -s "$W/$m.gen.cpu" "$W/$m.gen.cuda"; then pass "greedy_$m"
    else tail -n 20 "$W/g.err"; cat "$W/$m.gen.cpu" "$W/$m.gen.cuda"; fail "greedy_$m" "tokens differ"; fi

    echo "== model $m: cuda vs cpu, the experts on two CPU expert servers"
    SRV_ISA=avx2 start_servers "$M" "$m"
    timeout "$tl" "$C" "${gen[@]}" --model "$M" --backend cuda --cluster "$W/$m.cluster.json" \
        --local-experts 0 2>"$W/g.err" | grep '"seq"' >"$W/$m.gen.servers"
    timeout "$tl" "$C" "${gen[@]}" --model "$M" --backend cpu --isa avx2 --cluster "$W/$m.cluster.json" \
        --local-experts 0 2>>"$W/g.err" | grep '"seq"' >"$W/$m.gen.servers.cpu"
    if [ -s "$W/$m.gen.servers" ] && cmp -s "$W/$m.gen.servers.cpu" "$W/$m.gen.servers"; then
      if cmp -s "$W/$m.gen.cuda" "$W/$m.gen.servers"; then pass "servers_$m" "\"same_as_all_local\": true"
      else pass "servers_$m" "\"same_as_all_local\": false"; fi
    else tail -n 20 "$W/g.err"; tail -n 5 "$W/$m.s0.log"; cat "$W/$m.gen.servers.cpu" "$W/$m.gen.servers"; fail "servers_$m" "cuda and cpu tokens differ with the servers"; fi
    stop_servers
  done

  echo "== decode: Qwen3-30B-A3B layer shapes, 4 layers"
  local B="$W/q30" line cfg
  if ! want bench; then :
  elif [ "$(tlimit 200)" -lt 120 ]; then skipped bench
  else
    t0=$SECONDS
    $PINC "$D/bin/moerpc-mkmodel" --out "$B" --layers 4 --hidden 2048 --inter 768 --experts 128 \
        --topk 8 --heads 32 --kv-heads 4 --head-dim 128 --vocab 32000 --seed 1 >/dev/null 2>&1
    echo "(model made in $((SECONDS - t0)) s)"
    # the bench's cores: the client a quarter (the GPU does its compute), the two servers
    # three eighths each; cpu-all-local has every core
    if [ -n "$PINC" ]; then
      local o=$((ncpu / 8))
      PINC="taskset -c 0-$((2 * o - 1))"; PIN0="taskset -c $((2 * o))-$((5 * o - 1))"
      PIN1="taskset -c $((5 * o))-$((8 * o - 1))"; SRV_T=$((3 * o)); CLI_T=$((2 * o))
    fi
    emit "{\"check\": \"bench_pinning\", \"client\": \"$PINC\", \"servers\": \"$PIN0 / $PIN1\", \"server_threads\": $SRV_T}"
    start_servers "$B" q30
    local common=(bench --model "$B" --prompt-len 32 --decode 64 --repeats 3 --json --quiet --log warn)
    local round
    for round in 1 2; do
    for cfg in cuda-all-local cuda-all-local-bf16act cuda-2-servers-K0 cuda-2-servers-K2 \
               cuda-2-servers-K2-hot32 cpu-all-local cpu-2-servers-K2; do
      tl=$(tlimit 90); [ "$tl" -eq 0 ] && { skipped "bench_$cfg"; continue; }
      local extra=()
      case $cfg in
        cuda-all-local|cuda-all-local-bf16act) extra=(--backend cuda) ;;
        cuda-2-servers-K0) extra=(--backend cuda --cluster "$W/q30.cluster.json" --local-experts 0) ;;
        cuda-2-servers-K2) extra=(--backend cuda --cluster "$W/q30.cluster.json" --local-experts 0 --max-deferred 2) ;;
        cuda-2-servers-K2-hot32) extra=(--backend cuda --cluster "$W/q30.cluster.json" --local-experts 32 --max-deferred 2) ;;
        cpu-all-local) extra=(--backend cpu --threads "$ncpu") ;;
        cpu-2-servers-K2) extra=(--backend cpu --threads "$CLI_T" --cluster "$W/q30.cluster.json" --local-experts 0 --max-deferred 2) ;;
      esac
      local pin=$PINC
      [ "$cfg" = cpu-all-local ] && pin=""
      t0=$SECONDS
      local act=split
      [ "$cfg" = cuda-all-local-bf16act ] && act=bf16
      timeout "$tl" env MOERPC_CUDA_ACT=$act $pin "$C" "${common[@]}" "${extra[@]}" >"$W/b.out" 2>"$W/b.err"
      line=$(head -n 1 "$W/b.out")
      # the per-layer lines of the configurations with servers (where the RPC time goes)
      case $cfg in *servers*) [ -n "$JSONL" ] && sed "s/^/{\"config\": \"$cfg\", \"round\": $round, \"layer_line\": /; s/\$/}/" "$W/b.out" | tail -n +2 >>"$JSONL" ;; esac
      if [ -n "$line" ]; then emit "{\"check\": \"bench\", \"ok\": true, \"config\": \"$cfg\", \"round\": $round, \"s\": $((SECONDS - t0)), \"result\": $line}"
      else tail -n 20 "$W/b.err"; fail "bench_$cfg" "no result"; fi
    done
    done
    stop_servers
    rm -rf "$B"
  fi

  echo "== the SGLang adapter's CUDA-tensor path"
  tl=$(tlimit 150)
  if ! want wrapper; then :
  elif [ "$tl" -eq 0 ]; then skipped wrapper_cuda
  else
    t0=$SECONDS
    PYTHONUNBUFFERED=1 MOERPC_BIN="$D/bin" PYTHONPATH="$ROOT/gpu_client/python${PYTHONPATH:+:$PYTHONPATH}" \
        timeout "$tl" python3 "$ROOT/tests/gpu/test_wrapper_cuda.py" >"$W/py.log" 2>&1
    rc=$?
    grep -v ' INFO ' "$W/py.log" | tail -n 60
    if [ $rc -eq 0 ]; then pass wrapper_cuda "\"s\": $((SECONDS - t0))"; else fail wrapper_cuda "exit $rc"; fi
  fi

  echo "== serve: the OpenAI-compatible server, cuda vs cpu (continuous batching)"
  tl=$(tlimit 90)
  if ! want serve; then :
  elif [ "$tl" -eq 0 ]; then skipped serve
  else
    serve_check "$tl"
  fi

  echo "== compute-sanitizer memcheck"
  local csan
  csan=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer /opt/nvidia/*/compute-sanitizer 2>/dev/null | head -n 1)
  if ! want memcheck; then :
  elif [ -z "$csan" ]; then fail memcheck "compute-sanitizer not found"
  else
    tl=$(tlimit 90)
    if [ "$tl" -eq 0 ]; then skipped memcheck_generate
    else
      timeout "$tl" "$csan" --tool memcheck --error-exitcode 86 "$C" generate --model "$W/qwen" \
          --prompt-ids "1,2,3,4,5;7,8,9" --max-new 4 --backend cuda --quiet >"$W/cs.log" 2>&1
      rc=$?
      grep -E 'ERROR SUMMARY|Invalid|========= ' "$W/cs.log" | head -n 30
      if [ $rc -eq 0 ] && grep -q 'ERROR SUMMARY: 0 errors' "$W/cs.log"; then pass memcheck_generate
      else fail memcheck_generate "exit $rc"; fi
    fi
    tl=$(tlimit 240)
    if [ "$tl" -eq 0 ]; then skipped memcheck_test_gc_cuda
    else
      (cd "$W" && timeout "$tl" "$csan" --tool memcheck --report-api-errors no --error-exitcode 86 \
          "$D/tests/test_gc_cuda") >"$W/cs.log" 2>&1
      rc=$?
      grep -E 'ERROR SUMMARY|Invalid|========= |passed|failed' "$W/cs.log" | head -n 30
      if [ $rc -eq 0 ] && grep -q 'ERROR SUMMARY: 0 errors' "$W/cs.log"; then pass memcheck_test_gc_cuda
      else fail memcheck_test_gc_cuda "exit $rc"; fi
    fi
  fi

  local ngpu
  ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
  echo "== NCCL: test_gc_cuda's one-rank all-reduce above; tensor parallelism on the $ngpu GPU(s) present"
  if want tp && [ "$ngpu" -ge 2 ]; then
    for m in qwen dsv3-fp8; do
      timeout "$(tlimit 90)" "$C" logits --model "$W/$m" --ids "$ids" --out "$W/$m.tp2.f32" --backend cuda \
          --tp 2 --compare "$W/$m.cuda.f32" >"$W/l.log" 2>&1 || { cat "$W/l.log"; fail "tp2_$m" "run failed"; continue; }
      cat "$W/l.log"
      rel=$(sed -n 's/.*relative L2 \([0-9.e+-]*\).*/\1/p' "$W/l.log" | tail -n 1)
      if [ -n "$rel" ] && awk -v r="$rel" 'BEGIN { exit !(r <= 1e-3) }'; then pass "tp2_$m" "\"rel_l2\": $rel"
      else fail "tp2_$m" "--tp 2 vs --tp 1 relative L2 ${rel:-?} > 1e-3"; fi
    done
  else
    echo "(one GPU: --tp 2 over NCCL needs two; the decomposition itself is tested on the CPU in make test)"
  fi
  echo "gpu run: $FAILS check(s) failed, $SECONDS s"
  grep -h '"check"' "${JSONL:-/dev/null}" 2>/dev/null | cut -c1-160
  [ $FAILS -eq 0 ]
}

case $MODE in
  bundle) bundle ;;
  run) run ;;
  *) echo "usage: tests/gpu/run.sh bundle|run"; exit 2 ;;
esac
