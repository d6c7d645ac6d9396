#!/usr/bin/env bash
# tests/bench/run.sh (make bench) - a quick run of both benchmarks, a few minutes on 2 cores:
#   1. moerpc-bench-kernels on the qwen3-30b-a3b shape: bf16, int8 and int4 at T = 1, 16, 256
#      on the best ISA of this CPU, and the scalar reference at T = 1 (3 repeats);
#   2. moerpc-bench-place: the planner's time on a 61 x 256 x 16 problem (place.jsonl);
#   3. moerpc-bench-wake: a wake-up of a thread on an idle CPU after 50 / 300 / 3000 us idle,
#      with the host's cpuidle settings (wake.jsonl; docs/deploy.md "Host tuning");
#   4. moerpc-client bench-rpc against a local cluster of two servers (deploy/local-cluster.sh)
#      on a small mkmodel model: gRPC round trip vs raw TCP ping-pong, T = 1, 16, 256.
# JSON lines (one per case) go to $BUILD/bench/kernels.jsonl, kernels-ref.jsonl, wake.jsonl
# and rpc.jsonl (bench-rpc's own table is in rpc.jsonl too, its log in rpc.log); a summary of
# the same-run ratios to the terminal. Figures worth keeping go to
# docs/BENCHMARKS.md with the command and the date (tests/bench/README.md).
# Environment: BUILD (default build), BENCH_TOKENS (default 1,16,256), BENCH_FORMATS
# (default bf16,int8,int4), BENCH_ITERS (bench-rpc calls per T, default 200).
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
BIN=$BUILD/bin
OUT=$BUILD/bench
TOKENS=${BENCH_TOKENS:-1,16,256}
FORMATS=${BENCH_FORMATS:-bf16,int8,int4}
ITERS=${BENCH_ITERS:-200}

step() { printf '\n==> %s\n' "$*"; }
rm -rf "$OUT"; mkdir -p "$OUT"

step "kernels: $FORMATS at T = $TOKENS, best ISA"
"$BIN/moerpc-bench-kernels" --format "$FORMATS" --tokens "$TOKENS" --json >"$OUT/kernels.jsonl"
step "kernels: scalar reference, bf16 at T = 1"
"$BIN/moerpc-bench-kernels" --format bf16 --isa ref --tokens 1 --repeats 3 --json \
    >"$OUT/kernels-ref.jsonl"

step "place: the planner on 61 layers x 256 experts x 16 hosts (bound: 1 s)"
"$BIN/moerpc-bench-place" --repeats 3 >"$OUT/place.jsonl"

step "wake: a thread woken on an idle CPU (the host's share of every round trip)"
"$BIN/moerpc-bench-wake" --iters 300 >"$OUT/wake.jsonl"

step "rpc: two servers on loopback, small model"
"$BIN/moerpc-mkmodel" --out "$OUT/model" --seed 1 >/dev/null
. deploy/local-cluster.sh
lc_start "$OUT/cluster" "$OUT/model" 2
"$BIN/moerpc-client" bench-rpc --cluster "$OUT/cluster/cluster.json" --iters "$ITERS" \
    --tokens "$TOKENS" --json >"$OUT/rpc.jsonl" 2>"$OUT/rpc.log" || { cat "$OUT/rpc.log"; exit 1; }
lc_stop >/dev/null

step "results"
python3 - "$OUT" <<'PY'
import json, sys, os
out = sys.argv[1]
def rows(name):
    for line in open(os.path.join(out, name)):
        line = line.strip()
        if line.startswith("{"):
            yield json.loads(line)
print("kernels (same-run ratios: bw_ratio = weight GB/s / plain read GB/s, peak_ratio = of the register-only peak)")
for name in ("kernels.jsonl", "kernels-ref.jsonl"):
    for r in rows(name):
        if r.get("mode") == "selftest":
            print("  start-up self-test of %d fast kernels: %.2f ms on %s" % (r["kernels"], r["ms"], r["cpu"]))
            continue
        print("  %-9s %-18s T=%-5d %10.1f us  bw_ratio %.2f  peak_ratio %5.1f%%" % (
            r["format"] + ("-g%d" % r["group"] if r["group"] else ""), r["kernel"], r["tokens"],
            r["us"], r["bw_ratio"], 100 * r["peak_ratio"]))
print("place (planner wall time, median of 3; expected imbalance max/mean host load)")
for r in rows("place.jsonl"):
    print("  %-17s %8.1f ms  imbalance %.3f -> %.3f  %s" % (r["case"], r["ms"],
        r["imbalance_before"], r["imbalance_after"], "ok" if r["ms"] < 1000 else "OVER 1 s"))
print("wake (a thread on another, idle CPU: the FUTEX_WAKE call and wake-to-run, p50)")
for r in rows("wake.jsonl"):
    print("  after %5d us idle: wake call %6.1f us, to run %6.1f us  (cpuidle %s, guest_halt_poll_ns %d)" % (
        r["gap_us"], r["wake_call_p50_us"], r["wake_to_run_p50_us"], r["cpuidle"] or "?", r["guest_halt_poll_ns"]))
print("rpc (same-run ratio: gRPC p50 / raw TCP p50 of the same bytes)")
for r in rows("rpc.jsonl"):
    print("  T=%-5d grpc p50 %8.1f us  tcp p50 %7.1f us  ratio %.2f  (grpc - compute) / tcp %.2f" % (
        r["tokens"], r["grpc_p50_us"], r["tcp_p50_us"], r["ratio_p50"], r["ratio_minus_compute_p50"]))
PY
echo "JSON lines: $OUT/kernels.jsonl $OUT/kernels-ref.jsonl $OUT/place.jsonl $OUT/wake.jsonl $OUT/rpc.jsonl"
