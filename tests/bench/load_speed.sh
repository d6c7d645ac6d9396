#!/usr/bin/env bash
# tests/bench/load_speed.sh - weight loading speed over a plain read of the same files, in
# the same run (issue 24 item 1, docs/DESIGN.md section 6.6). JSON lines on stdout, one
# per measurement, medians of RUNS runs; progress on stderr.
#
#   tests/bench/load_speed.sh                 # Qwen3-30B-A3B expert shapes, 2 layers x 128
#                                             # experts: 2.4 GB bf16 (and an fp8 twin)
#   RUNS=5 COLD=1 tests/bench/load_speed.sh   # also from a cold page cache (drop_caches,
#                                             # root; one run each, slow on a slow disk)
#   SCALAR=0 THREADS=16 tests/bench/load_speed.sh   # without the scalar-converter baselines
#
# What is timed:
#   read            cat of the model's safetensors to /dev/null (the plain read);
#   fresh_memory    writing as many bytes of new memory (dd to /dev/shm): what a loader
#                   that owns a private copy cannot go below, on hosts (VMs) where first
#                   touch of memory is slower than the read itself;
#   server FORMAT   moerpc-server's packing phase ("loading: done ... in S s") for the
#                   stored format (bf16 / fp8: copied; bf16 or fp8 with pack = map: --map-weights,
#                   served in place from the files after a finite check) and online int8 / int4, with the
#                   row converters kn__pack picks for this CPU (pack = auto: AVX2 where present, with
#                   the AVX-512 quantizers where that is too; pack = avx2: MOERPC_PACK=avx2, the AVX2
#                   quantizers, on a CPU with AVX-512) and the scalar ones
#                   (MOERPC_PACK=scalar, the converters before this change, as a baseline);
#                   ready_s is exec to readiness;
#   client          moerpc-client bench's load of everything (dense layers and every expert
#                   local; bf16, and the fp8 twin: FP8 experts, bf16 dense weights), its
#                   "model: loaded ..." line; pack = map: --map-weights (the experts, dense
#                   weights and embeddings served in place; cold too).
# ratio = load GB/s / read GB/s of the same files in the same run.
#
# Reused memory: each timed load runs right after an untimed load of the same size, so that
# it gets memory a process just gave back. On this project's VMs, memory the guest has not
# touched lately is backed by the host only at first touch, which costs more than the
# loader's own work (the fresh_memory line); a load that follows a smaller one pays that for
# the difference, so that load order alone moved a bf16 load between 1.4 and 3.2 GB/s.
set -euo pipefail
BUILD=${BUILD:-build}
BIN=${BIN:-$BUILD/bin}
LAYERS=${LAYERS:-2}
RUNS=${RUNS:-3}
THREADS=${THREADS:-2}
COLD=${COLD:-0}
SCALAR=${SCALAR:-1}
MODEL=${MODEL:-$BUILD/bench/qwen3-30b-a3b-l$LAYERS}
FP8=${FP8:-$BUILD/bench/qwen3-30b-a3b-l$LAYERS-fp8}
DIR=$(mktemp -d)
trap 'rm -rf "$DIR" /dev/shm/moerpc-load-speed.$$' EXIT
CPU=$(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //')
DATE=$(date -u +%Y-%m-%dT%H:%MZ)

mk() { # dir dtype
  [ -f "$1/config.json" ] && return 0
  echo "load_speed: making $1 (Qwen3-30B-A3B expert shapes, $LAYERS layers, $2)" >&2
  "$BIN/moerpc-mkmodel" --out "$1" --layers "$LAYERS" --hidden 2048 --inter 768 --experts 128 \
      --topk 8 --heads 32 --kv-heads 4 --head-dim 128 --vocab 32000 --seed 1 --dtype "$2" >/dev/null
}
mk "$MODEL" bf16
mk "$FP8" fp8

median() { sort -n | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2}'; }
now() { date +%s.%N; }
drop() { sync; echo 3 > /proc/sys/vm/drop_caches; }
gb_of() { du -cb "$1"/*.safetensors | tail -1 | awk '{printf "%.3f", $1 / 1e9}'; }

read_s() { # dir: seconds of a plain read
  local t0 t1
  t0=$(now); cat "$1"/*.safetensors >/dev/null; t1=$(now)
  echo "$t0 $t1" | awk '{printf "%.4f\n", $2 - $1}'
}

fresh_s() { # bytes: seconds to write that much new memory
  local t0 t1 f=/dev/shm/moerpc-load-speed.$$
  t0=$(now); dd if=/dev/zero of="$f" bs=1M count=$(( $1 / 1048576 )) status=none; t1=$(now)
  rm -f "$f"
  echo "$t0 $t1" | awk '{printf "%.4f\n", $2 - $1}'
}

server_s() { # model env extra...: prints "load_s ready_s"
  local model=$1 env=$2; shift 2
  local log="$DIR/server.log" t0 t1
  t0=$(now)
  env $env "$BIN/moerpc-server" --model "$model" --listen 127.0.0.1:0 --experts all \
      --threads "$THREADS" "$@" >"$log" 2>&1 &
  local pid=$!
  until grep -q 'serving:' "$log" 2>/dev/null; do
    kill -0 $pid 2>/dev/null || { echo "load_speed: server died" >&2; tail -5 "$log" >&2; exit 1; }
    sleep 0.01
  done
  t1=$(now)
  kill -TERM $pid; wait $pid || true
  local load
  load=$(sed -n 's/.*loading: done, .* GB in \([0-9.]*\) s.*/\1/p' "$log" | tail -1)
  echo "$load $(echo "$t0 $t1" | awk '{printf "%.3f", $2 - $1}')"
}

client_s() { # model env [flags...]: seconds of the client's model load
  local log="$DIR/client.log" model=$1 env=$2
  shift 2
  env $env "$BIN/moerpc-client" bench --model "$model" --threads "$THREADS" --decode 1 \
      --prompt-len 2 --repeats 1 "$@" >"$log" 2>&1 || { tail -5 "$log" >&2; exit 1; }
  # "model: loaded N/N tensors, A/B GB, R GB/s, took S s"
  sed -n 's/.*model: loaded .* took \([0-9.]*\) s.*/\1/p' "$log" | tail -1
}

emit() { # what format pack cache gb seconds read_seconds [ready]
  awk -v w="$1" -v f="$2" -v p="$3" -v c="$4" -v gb="$5" -v s="$6" -v rs="$7" -v ready="${8:-}" \
      -v cpu="$CPU" -v date="$DATE" -v th="$THREADS" 'BEGIN {
    printf "{\"bench\":\"load\",\"what\":\"%s\",\"format\":\"%s\",\"pack\":\"%s\",\"cache\":\"%s\",", w, f, p, c
    printf "\"gb\":%.3f,\"seconds\":%.3f,\"gbps\":%.3f,\"read_gbps\":%.3f,\"ratio\":%.3f,", gb, s, gb / s, gb / rs, rs / s
    if (ready != "") printf "\"ready_s\":%s,", ready
    printf "\"threads\":%s,\"cpu\":\"%s\",\"date\":\"%s\"}\n", th, cpu, date }'
}

GB=$(gb_of "$MODEL"); GB8=$(gb_of "$FP8")
BYTES=$(du -cb "$MODEL"/*.safetensors | tail -1 | cut -f1)
echo "load_speed: $MODEL ($GB GB), $FP8 ($GB8 GB), $RUNS runs, $THREADS threads, $CPU" >&2

# Warm: every file read once first, then the runs alternate so that drift hits all alike.
# The files' pages are dropped before that read (dd iflag=nocache count=0 drops one file's
# page cache; no root needed), so that the cache holds them as a read from disk leaves
# them, in large folios that map 2 MiB at a time, and not as moerpc-mkmodel's writes left
# them (4 KiB pages, a fault per 64 KiB): a served model reaches the page cache by a read.
for f in "$MODEL"/*.safetensors "$FP8"/*.safetensors; do dd if="$f" iflag=nocache count=0 status=none; done
cat "$MODEL"/*.safetensors "$FP8"/*.safetensors >/dev/null
declare -A T R
cases=("bf16|auto|$MODEL|X=1|" "bf16|scalar|$MODEL|MOERPC_PACK=scalar|" "bf16|map|$MODEL|X=1|--map-weights"
       "int8|auto|$MODEL|X=1|--quant int8" "int8|scalar|$MODEL|MOERPC_PACK=scalar|--quant int8"
       "int4|auto|$MODEL|X=1|--quant int4" "int4|scalar|$MODEL|MOERPC_PACK=scalar|--quant int4"
       "fp8|auto|$FP8|X=1|" "fp8|scalar|$FP8|MOERPC_PACK=scalar|" "fp8|map|$FP8|X=1|--map-weights")
if [ "$SCALAR" = 0 ]; then
  cases=("bf16|auto|$MODEL|X=1|" "bf16|map|$MODEL|X=1|--map-weights" "int8|auto|$MODEL|X=1|--quant int8"
         "int4|auto|$MODEL|X=1|--quant int4" "fp8|auto|$FP8|X=1|" "fp8|map|$FP8|X=1|--map-weights")
fi
# The AVX2 quantizers where the CPU also has AVX-512 (auto then uses the AVX-512 ones).
if grep -q avx512bw /proc/cpuinfo; then
  cases+=("int8|avx2|$MODEL|MOERPC_PACK=avx2|--quant int8" "int4|avx2|$MODEL|MOERPC_PACK=avx2|--quant int4")
fi
# One untimed load of each kind first: the first process to touch that much memory pays
# for it (on a VM, the host backing it) more than the ones after.
echo "load_speed: warm-up loads" >&2
for c in "bf16|auto|$MODEL|X=1|" "int8|auto|$MODEL|X=1|--quant int8" "fp8|auto|$FP8|X=1|"; do
  IFS='|' read -r f p m env extra <<<"$c"
  # shellcheck disable=SC2086
  server_s "$m" "$env" $extra >/dev/null
done
client_s "$MODEL" X=1 >/dev/null
for i in $(seq 1 "$RUNS"); do
  echo "load_speed: warm run $i/$RUNS" >&2
  T[read]+="$(read_s "$MODEL") "; T[read8]+="$(read_s "$FP8") "
  T[fresh]+="$(fresh_s "$BYTES") "
  for c in "${cases[@]}"; do
    IFS='|' read -r f p m env extra <<<"$c"
    # Each timed load right after an untimed one of the same size (see "reused" at the top).
    # shellcheck disable=SC2086
    server_s "$m" "$env" $extra >/dev/null
    # shellcheck disable=SC2086
    set -- $(server_s "$m" "$env" $extra)
    T["$f/$p"]+="$1 "; R["$f/$p"]+="$2 "
  done
  client_s "$MODEL" X=1 >/dev/null; T[client/auto]+="$(client_s "$MODEL" X=1) "
  client_s "$MODEL" X=1 --map-weights >/dev/null; T[client/map]+="$(client_s "$MODEL" X=1 --map-weights) "
  client_s "$FP8" X=1 >/dev/null; T[client8/auto]+="$(client_s "$FP8" X=1) "
  client_s "$FP8" X=1 --map-weights >/dev/null; T[client8/map]+="$(client_s "$FP8" X=1 --map-weights) "
  if [ "$SCALAR" != 0 ]; then
    client_s "$MODEL" MOERPC_PACK=scalar >/dev/null
    T[client/scalar]+="$(client_s "$MODEL" MOERPC_PACK=scalar) "
  fi
done
med() { tr ' ' '\n' <<<"$1" | grep . | median; }
rd=$(med "${T[read]}"); rd8=$(med "${T[read8]}")
emit read bf16 - warm "$GB" "$rd" "$rd"
emit fresh_memory - - warm "$GB" "$(med "${T[fresh]}")" "$rd"
for c in "${cases[@]}"; do
  IFS='|' read -r f p m env extra <<<"$c"
  if [ "$f" = fp8 ]; then emit server "$f" "$p" warm "$GB8" "$(med "${T[$f/$p]}")" "$rd8" "$(med "${R[$f/$p]}")"
  else emit server "$f" "$p" warm "$GB" "$(med "${T[$f/$p]}")" "$rd" "$(med "${R[$f/$p]}")"; fi
done
emit client bf16 auto warm "$GB" "$(med "${T[client/auto]}")" "$rd"
emit client bf16 map warm "$GB" "$(med "${T[client/map]}")" "$rd"
emit client fp8 auto warm "$GB8" "$(med "${T[client8/auto]}")" "$rd8"
emit client fp8 map warm "$GB8" "$(med "${T[client8/map]}")" "$rd8"
[ "$SCALAR" = 0 ] || emit client bf16 scalar warm "$GB" "$(med "${T[client/scalar]}")" "$rd"

if [ "$COLD" = 1 ]; then
  if ! (sync; echo 3 > /proc/sys/vm/drop_caches) 2>/dev/null; then
    echo "load_speed: cold: cannot drop the page cache (not root?): skipped" >&2
    exit 0
  fi
  echo "load_speed: cold runs (page cache dropped before each)" >&2
  drop; crd=$(read_s "$MODEL")
  emit read bf16 - cold "$GB" "$crd" "$crd"
  for f in bf16 bf16-map int8; do
    extra=""; [ "$f" = int8 ] && extra="--quant int8"
    [ "$f" = bf16-map ] && extra="--map-weights"
    drop
    # shellcheck disable=SC2086
    set -- $(server_s "$MODEL" X=1 $extra)
    if [ "$f" = bf16-map ]; then emit server bf16 map cold "$GB" "$1" "$crd" "$2"
    else emit server "$f" auto cold "$GB" "$1" "$crd" "$2"; fi
  done
  drop; crd8=$(read_s "$FP8")
  emit read fp8 - cold "$GB8" "$crd8" "$crd8"
  drop
  set -- $(server_s "$FP8" X=1)
  emit server fp8 auto cold "$GB8" "$1" "$crd8" "$2"
  drop
  set -- $(server_s "$FP8" X=1 --map-weights)
  emit server fp8 map cold "$GB8" "$1" "$crd8" "$2"
  drop; emit client bf16 map cold "$GB" "$(client_s "$MODEL" X=1 --map-weights)" "$crd"
  drop; emit client fp8 map cold "$GB8" "$(client_s "$FP8" X=1 --map-weights)" "$crd8"
fi
