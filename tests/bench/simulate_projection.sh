#!/usr/bin/env bash
# tests/bench/simulate_projection.sh - DeepSeek-V3 on 1/2/4/8/16 expert hosts: a projection
# by `moerpc-place simulate` from stated assumptions (not a measurement; docs/BENCHMARKS.md,
# "Placement simulation"). Every assumption is a variable here:
#
#   HOST_GBPS=250   a host's expert-weight read rate at decode, GB/s (a 1-socket 64-core Zen 4
#                   with 12 channels of DDR5-4800, 460 GB/s peak, ~270 GB/s by a plain read;
#                   the kernels here read at 0.9-1.0 of a plain read: docs/DESIGN.md 6)
#   HOST_TOPS=20    its int8 (VNNI) compute at prefill, Tops (~40 peak on 64 cores, half of it)
#   LINK_GBPS=100   each host's link, Gbit/s;  LATENCY_US=10  one-way
#   CLIENT_LINK_GBPS=200  the client's own link, crossed by every host's bytes
#   RPC_FIXED_US=100      per request (what bench-rpc measures for gRPC on loopback here, 70-110)
#   CLIENT_STEP_US=6000   the GPU client's decode step besides the routed experts (16.5 G
#                   non-routed parameters incl. the shared expert, fp8, at ~3 TB/s + attention)
#   CLIENT_PREFILL_US=40000  its prefill of PROMPT tokens (2 x 16.5 G x 1024 FLOP at ~850 TFLOP/s)
#   PROMPT=1024  BATCHES="1 32"  HOSTS="1 2 4 8 16"  FORMATS="int4 fp8"
#
# The host's rate table is written as moerpc-bench-kernels lines: at T tokens per call over
# the 256 experts, top-8, weight GB/s = min(HOST_GBPS, HOST_TOPS x bytes per weight / (2 u)),
# u = tokens per activated expert. Routing uniform (DeepSeek-V3's bias-balanced router), the
# experts split in contiguous ranges (--hosts N), nothing on the GPU but the shared expert.
# Writes JSON lines to $OUT (default build/bench/simulate_projection.jsonl) and a table.
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
BIN=$BUILD/bin
HOST_GBPS=${HOST_GBPS:-250}
HOST_TOPS=${HOST_TOPS:-20}
LINK_GBPS=${LINK_GBPS:-100}
LATENCY_US=${LATENCY_US:-10}
CLIENT_LINK_GBPS=${CLIENT_LINK_GBPS:-200}
RPC_FIXED_US=${RPC_FIXED_US:-100}
CLIENT_STEP_US=${CLIENT_STEP_US:-6000}
CLIENT_PREFILL_US=${CLIENT_PREFILL_US:-40000}
PROMPT=${PROMPT:-1024}
BATCHES=${BATCHES:-1 32}
HOSTS=${HOSTS:-1 2 4 8 16}
FORMATS=${FORMATS:-int4 fp8}
OUT=${OUT:-$BUILD/bench/simulate_projection.jsonl}
DIR=$(mktemp -d)
trap 'rm -rf "$DIR"' EXIT
mkdir -p "$(dirname "$OUT")"
: >"$OUT"
[ -x "$BIN/moerpc-place" ] || { echo "simulate_projection: $BIN/moerpc-place missing (make all)"; exit 1; }

# int4 (group 64: 0.5625 bytes per weight) and int8 (the rates of fp8: one byte per weight)
python3 - "$DIR" "$HOST_GBPS" "$HOST_TOPS" <<'PY'
import json, sys
d, bw, tops = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
E, k = 256, 8
for fmt, group, bpw in (("int4", 64, 0.5 + 4 / 64), ("int8", 0, 1.0 + 8 / 7168)):
    with open("%s/host.%s.jsonl" % (d, fmt), "w") as f:
        for T in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384):
            u = T * k / (E * (1 - (1 - k / E) ** T))
            gbps = min(bw, tops * 1e3 * bpw / (2 * u))
            f.write(json.dumps({"shape": "deepseek-v3", "format": fmt, "group": group,
                                "isa": "projection", "tokens": T, "top_k": k, "threads": 64,
                                "experts_pool": E, "weight_gbps": round(gbps, 3)}) + "\n")
PY

printf '| format | hosts | batch | decode tok/s | decode: bottleneck (share); all hosts, link | prefill tok/s (%s tokens) | prefill: bottleneck (share); all hosts, link | expert memory per host |\n' "$PROMPT"
printf '|---|---|---|---|---|---|---|---|\n'
for fmt in $FORMATS; do
  rf=$fmt; [ "$fmt" = fp8 ] && rf=int8
  for n in $HOSTS; do
    for b in $BATCHES; do
      plen=$PROMPT; [ "$b" = 1 ] || plen=0   # prefill: one prompt (CLIENT_PREFILL_US is for one)
      line=$("$BIN/moerpc-place" simulate --shape deepseek-v3 --hosts "$n" --format "$fmt" \
          --rates-format "$rf" --kernels "$DIR/host.$rf.jsonl" --rpc-fixed-us "$RPC_FIXED_US" \
          --link-gbps "$LINK_GBPS" --link-latency-us "$LATENCY_US" \
          --client-link-gbps "$CLIENT_LINK_GBPS" --client-step-us "$CLIENT_STEP_US" \
          --client-prefill-us "$CLIENT_PREFILL_US" --batch "$b" --prompt-len "$plen" \
          --samples 128 --json 2>/dev/null)
      python3 - "$line" "$n" "$OUT" "$HOST_GBPS $HOST_TOPS $LINK_GBPS $LATENCY_US $CLIENT_LINK_GBPS $RPC_FIXED_US $CLIENT_STEP_US $CLIENT_PREFILL_US" <<'PY'
import json, sys
r = json.loads(sys.argv[1]); n = int(sys.argv[2])
a = dict(zip("host_gbps host_tops link_gbps latency_us client_link_gbps rpc_fixed_us client_step_us client_prefill_us".split(),
             map(float, sys.argv[4].split())))
r["projection"] = True
r["assumptions"] = a
open(sys.argv[3], "a").write(json.dumps(r) + "\n")
mem = r["expert_bytes"] * 256 * 58 / n / 1e9
hosts = lambda p: sum(v for k, v in r[p + "_shares"].items() if k not in ("client", "link"))
pf = ("%.0f | %s (%.2f); hosts %.2f, link %.2f" % (
    r["prefill_tok_s"], r["prefill_bottleneck"], r["prefill_bottleneck_share"], hosts("prefill"),
    r["prefill_shares"]["link"])) if r.get("prefill_tok_s") else "- | -"
print("| %s | %d | %d | %.1f | %s (%.2f); hosts %.2f, link %.2f | %s | %.0f GB |" % (
    r["format"], n, r["batch"], r["decode_tok_s"], r["decode_bottleneck"], r["decode_bottleneck_share"],
    hosts("decode"), r["decode_shares"]["link"], pf, mem))
PY
    done
  done
done
