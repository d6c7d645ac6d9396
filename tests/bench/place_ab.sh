#!/usr/bin/env bash
# tests/bench/place_ab.sh - decode tokens/s and host-load imbalance of `moerpc-place plan
# --strategy balanced` vs `uniform` on the skewed model (moerpc-mkmodel --router-skew 2), two
# servers on loopback that both hold every expert (so that the placement alone decides who
# computes what), the client running with each plan's --placement.
#
#   1. statistics: a `moerpc-client bench` run with no placement, then `moerpc-place stats`
#      (the servers' counts: nothing is local, so they are complete);
#   2. both plans from them (same --gpu-bytes: GPU_EXPERTS hot experts a layer's worth);
#   3. ROUNDS rounds of A then B (interleaved, so that the other agents' load hits both):
#      reset the servers' Stats, `moerpc-client bench --placement`, then Stats --all: the
#      measured imbalance is max / mean over the servers of their tokens (every expert has
#      the same bytes and the hosts the same speed), and the measured step load the sum over
#      layers of the busier server's tokens, next to the planner's expected figures.
#
# JSON lines (one per run, then one summary per strategy with medians) on stdout; the table
# on stderr. Environment: BUILD (default build), ROUNDS (5), BATCH (8), DECODE (32),
# GPU_EXPERTS (2), SHAPE (mkmodel flags; default 6 layers, 32 experts, H 512, I 256, top-4).
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
BIN=$BUILD/bin
ROUNDS=${ROUNDS:-5}
BATCH=${BATCH:-8}
DECODE=${DECODE:-32}
GPU_EXPERTS=${GPU_EXPERTS:-2}
SHAPE=${SHAPE:---layers 6 --experts 32 --topk 4 --hidden 512 --inter 256}
tmp=$(mktemp -d /tmp/moerpc-pab.XXXXXX)
# shellcheck source=deploy/local-cluster.sh
. deploy/local-cluster.sh
trap 'lc_stop >/dev/null 2>&1 || true; rm -rf "$tmp"' EXIT
say() { echo "$*" >&2; }

# shellcheck disable=SC2086
"$BIN/moerpc-mkmodel" --out "$tmp/m" --seed 1 --router-skew 2 $SHAPE >/dev/null
lc_start "$tmp/c" "$tmp/m" 2 --threads 1 --experts all >/dev/null
cl=$tmp/c/cluster.json
bench() { # extra flags...: one bench run, its summary JSON line on stdout
  "$BIN/moerpc-client" bench --model "$tmp/m" --cluster "$cl" --threads 1 --batch "$BATCH" \
      --decode "$DECODE" --repeats 1 --json "$@" 2>/dev/null | grep '"bench": "model"'
}
say "==> statistics: a bench run without placement, then moerpc-place stats"
"$BIN/moerpc-client" stats --cluster "$cl" --reset >/dev/null 2>&1
bench --seed 7 >/dev/null
"$BIN/moerpc-place" stats --cluster "$cl" -o "$tmp/stats.json" 2>/dev/null
read -r H I < <(python3 -c 'import json,sys; c=json.load(open(sys.argv[1])); print(c["hidden_size"], c["moe_intermediate_size"])' "$tmp/m/config.json")
EB=$(( (3 * H * I * 2 + 63) / 64 * 64 ))  # one bf16 expert, unsplit (pl_expert_bytes)
NMOE=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["num_hidden_layers"])' "$tmp/m/config.json")
GPU=$((GPU_EXPERTS * NMOE * EB))
for s in uniform balanced; do
  "$BIN/moerpc-place" plan --model "$tmp/m" --cluster "$cl" --stats "$tmp/stats.json" \
      --strategy $s --gpu-bytes $GPU -o "$tmp/$s.json" 2>"$tmp/$s.plan"
  grep '^plan: expected' "$tmp/$s.plan" | sed "s/^/  $s: /" >&2
done
load=$(cut -d' ' -f1-3 /proc/loadavg)
cpu=$(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //')
say "==> $ROUNDS rounds of uniform then balanced (batch $BATCH, decode $DECODE; load average $load)"
for r in $(seq 1 "$ROUNDS"); do
  for s in uniform balanced; do
    "$BIN/moerpc-client" stats --cluster "$cl" --reset >/dev/null 2>&1
    line=$(bench --placement "$tmp/$s.json" --seed "$r")
    "$BIN/moerpc-client" stats --cluster "$cl" --all >"$tmp/st.txt" 2>/dev/null
    python3 - "$s" "$r" "$line" "$tmp/st.txt" "$tmp/$s.plan" <<'PY'
import json, re, sys
s, r, line, st, plan = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4], sys.argv[5]
tot, lay, cur = {}, {}, None
for l in open(st):
    m = re.match(r'server (\S+) \(', l)
    if m: cur = m[1]; tot.setdefault(cur, 0)
    m = re.match(r'\s+count layer (\d+) expert (\d+) tokens (\d+)', l)
    if m and cur:
        n = int(m[3]); tot[cur] += n
        lay.setdefault(int(m[1]), {}).setdefault(cur, 0); lay[int(m[1])][cur] += n
mean = sum(tot.values()) / max(1, len(tot))
imb = max(tot.values()) / mean if mean else 1.0
step = sum(max(v.values()) for v in lay.values())
mean_step = sum(sum(v.values()) / max(1, len(tot)) for v in lay.values())
m = re.search(r'before ([\d.]+) .*after ([\d.]+)', open(plan).read())
print(json.dumps({"bench": "place_ab", "strategy": s, "round": r,
                  "decode_tok_s": line["decode_tok_s"], "prefill_tok_s": line["prefill_tok_s"],
                  "server_tokens": tot, "measured_imbalance": round(imb, 4),
                  "measured_step_imbalance": round(step / mean_step, 4) if mean_step else 1.0,
                  "expected_imbalance": float(m[2]) if m else None}))
PY
  done
done >"$tmp/runs.jsonl"
cat "$tmp/runs.jsonl"
python3 - "$tmp/runs.jsonl" "$load" "$cpu" "$ROUNDS" "$BATCH" "$DECODE" "$GPU_EXPERTS" <<'PY'
import json, statistics as st, sys
runs = [json.loads(l) for l in open(sys.argv[1])]
load, cpu = sys.argv[2], sys.argv[3]
out = {}
for s in ("uniform", "balanced"):
    rs = [r for r in runs if r["strategy"] == s]
    out[s] = {"bench": "place_ab_summary", "strategy": s, "rounds": len(rs),
              "decode_tok_s_median": st.median(r["decode_tok_s"] for r in rs),
              "measured_imbalance_median": st.median(r["measured_imbalance"] for r in rs),
              "measured_step_imbalance_median": st.median(r["measured_step_imbalance"] for r in rs),
              "expected_imbalance": rs[0]["expected_imbalance"], "batch": int(sys.argv[5]),
              "decode": int(sys.argv[6]), "gpu_experts_per_layer": int(sys.argv[7]),
              "loadavg": load, "cpu": cpu}
    print(json.dumps(out[s]))
u, b = out["uniform"], out["balanced"]
ratios = [rb["decode_tok_s"] / ru["decode_tok_s"] for ru, rb in zip(
    [r for r in runs if r["strategy"] == "uniform"], [r for r in runs if r["strategy"] == "balanced"])]
print(json.dumps({"bench": "place_ab_ratio", "decode_balanced_over_uniform_median": round(st.median(ratios), 4),
                  "per_round": [round(x, 3) for x in ratios]}))
sys.stderr.write("strategy   decode tok/s (median)  imbalance measured (expected)  per-layer measured\n")
for s in ("uniform", "balanced"):
    o = out[s]
    sys.stderr.write("%-10s %12.1f           %6.3f (%.3f)                %6.3f\n" % (s, o["decode_tok_s_median"],
        o["measured_imbalance_median"], o["expected_imbalance"], o["measured_step_imbalance_median"]))
sys.stderr.write("balanced / uniform decode, median of per-round ratios: %.3f; load average %s; CPU %s\n" % (st.median(ratios), load, cpu))
PY
