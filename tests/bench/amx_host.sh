#!/usr/bin/env bash
# tests/bench/amx_host.sh - the one script to run on an AMX host (Intel Sapphire / Emerald /
# Granite Rapids) to verify and measure the AMX kernels (kernels/x86/moe_amx.c), which
# were written and tested on a CPU without AMX (emulated tiles only). Finishes in < 8 min.
#
#   1. the CPU: /proc/cpuinfo model name and its amx* flags;
#   2. builds the AMX test, the kernel benchmark and test_kn_fast (make -j nproc);
#   3. build/tests/test_kn_amx: the real-instruction cases (tiles vs kn_ref for every
#      format and edge, row ranges, dispatch, layers, the self-test gate) must PASS here,
#      not skip; then test_kn_fast (the AVX-512 kernels, unchanged);
#   4. moerpc-bench-kernels --isa amx,avx512 --format bf16,int8,int4 --tokens 256,1024
#      (qwen3-30b-a3b shape: 16 and 64 tokens per expert), then the crossover scans (MoE
#      T = 64..2048, ~4..128 tokens per expert; a dense 4096x2048 layer at 8..64 tokens);
#      prints avx512/amx time ratios per (format, T).
# Output: a log on stdout; with $OUT set, JSON lines in $OUT/amx_bench.jsonl (one per
# case, moerpc-bench-kernels --json) and $OUT/amx_host.txt (the whole log), so that a
# remote runner can bring them back.
# Environment: BUILD (default build-amx), THREADS (bench threads, default all cores),
# MAX_GB (expert memory cap of the benchmark, default 16).
# Exit status: non-zero if the CPU has no AMX, the test fails, or a benchmark case fails.
set -uo pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build-amx}
MAX_GB=${MAX_GB:-16}
START=$(date +%s)
OUTDIR=${OUT:-}
if [ -n "$OUTDIR" ]; then mkdir -p "$OUTDIR"; exec > >(tee "$OUTDIR/amx_host.txt") 2>&1; fi
JSONL=${OUTDIR:+$OUTDIR/amx_bench.jsonl}
JSONL=${JSONL:-$BUILD/amx_bench.jsonl}
# seconds left for a step: at most $1, and never past 470 s since the start
budget() { local l=$(( 470 - ($(date +%s) - START) )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
step() { printf '\n==> [%3ss] %s\n' "$(( $(date +%s) - START ))" "$*"; }
rc=0

step "cpu"
grep -m1 'model name' /proc/cpuinfo || true
flags=$(grep -o 'amx[a-z_0-9]*' /proc/cpuinfo | sort -u | tr '\n' ' ')
echo "amx flags: ${flags:-none}"
echo "kernel: $(uname -r); gcc: $(${CC:-gcc} -dumpfullversion 2>/dev/null)"
case "$flags" in *amx_tile*) ;; *) echo "no amx_tile flag: not an AMX host (the test would only skip)"; rc=1 ;; esac

step "build ($BUILD)"
mkdir -p "$BUILD"
if ! timeout $(budget 150) make -j"$(nproc)" BUILD="$BUILD" "$BUILD/tests/test_kn_amx" "$BUILD/tests/test_kn_fast" \
    "$BUILD/bin/moerpc-bench-kernels" >"$BUILD/amx_build.log" 2>&1; then
  tail -40 "$BUILD/amx_build.log"; echo "BUILD FAILED"; exit 1
fi
grep -i warning "$BUILD/amx_build.log" || echo "no warnings"

step "test_kn_amx (real AMX instructions vs kn_ref; must pass, not skip)"
timeout $(budget 120) "$BUILD/tests/test_kn_amx"; t=$?
[ $t -eq 0 ] || { echo "test_kn_amx FAILED (rc $t)"; rc=1; }
if "$BUILD/tests/test_kn_amx" real_tiles_match_ref_every_format_and_edge 2>&1 | grep -q 'skipped'; then
  echo "the real-instruction cases SKIPPED: kn__cpu.best is not amx here (XCR0 / arch_prctl?)"; rc=1
fi

step "test_kn_fast (AVX-512 kernels, unchanged)"
timeout $(budget 60) "$BUILD/tests/test_kn_fast" | tail -1 || rc=1

: >"$JSONL"
BENCH="$BUILD/bin/moerpc-bench-kernels --shape qwen3-30b-a3b --max-gb $MAX_GB --json ${THREADS:+--threads $THREADS}"
step "bench: prefill, amx vs avx512, bf16/int8/int4 at T = 256, 1024"
timeout $(budget 150) $BENCH --isa amx,avx512 --format bf16,int8,int4 --tokens 256,1024 --repeats 5 >>"$JSONL" || rc=1
step "bench: crossover scan (KN_AMX_MIN_TOKENS): T = 64..2048 = ~4..128 tokens per expert"
left=$(budget 200)
if [ "$left" -gt 30 ]; then
  timeout "$left" $BENCH --isa amx,avx512 --format bf16,int8,int4 --tokens 64,128,512,2048 --repeats 3 >>"$JSONL" || rc=1
else
  echo "skipped: out of time"
fi
step "bench: dense layer 4096x2048 (kn_linear: down kernels, tokens = tokens per call), T = 8..64"
left=$(budget 60)
[ "$left" -gt 15 ] && { timeout "$left" $BENCH --isa amx,avx512 --linear 4096x2048 --format bf16,int8,int4 \
    --tokens 8,16,32,64 --repeats 3 >>"$JSONL" || rc=1; }

step "ratios: avx512 us / amx us per (format, tokens) (> 1: AMX faster)"
python3 - "$JSONL" <<'EOF' || true
import json, sys
rows = [r for r in (json.loads(l) for l in open(sys.argv[1]) if l.startswith('{')) if 'mode' not in r]
t = {}
for r in rows:
    t.setdefault((r.get('shape', r.get('linear', '?')), r['format'], r['tokens']), {})[r['isa']] = r
print('%-14s %-6s %6s %-20s %10s %-20s %10s %7s' % ('shape', 'format', 'T', 'amx-engine kernel', 'us', 'avx512 kernel', 'us', 'ratio'))
for (sh, f, T), d in sorted(t.items(), key=lambda kv: (str(kv[0][0]), kv[0][1], kv[0][2])):
    a, b = d.get('amx'), d.get('avx512')
    if a and b:
        print('%-14s %-6s %6d %-20s %10.1f %-20s %10.1f %7.2f' % (sh, f, T, a['kernel'], a['us'], b['kernel'], b['us'], b['us'] / a['us']))
EOF
echo "(below a format's crossover, logged at start-up as 'kn: F on AMX tiles from N"
echo " tokens per expert', the amx engine runs the AVX-512 kernels: ratio ~1; at T tokens and"
echo " top-k 8 of 128 experts, tokens per expert ~ T * 8 / 128)"
step "done: rc $rc, $(( $(date +%s) - START )) s; JSON lines in $JSONL"
exit $rc
