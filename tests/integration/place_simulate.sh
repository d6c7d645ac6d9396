#!/usr/bin/env bash
# place_simulate.sh - `moerpc-place simulate` on real inputs: a moerpc-mkmodel checkpoint, real
# moerpc-bench-kernels and all-local moerpc-client bench JSON lines; a placement and skewed
# stats put the bottleneck on the named server; bad input files exit 1 naming the field, bad
# flags exit 2. (The check against real runs with servers is tests/bench/simulate_check.sh.)
set -uo pipefail
cd "$(dirname "$0")/../.."
BIN=${MOERPC_BIN:-$PWD/build/bin}
passed=0; failed=0
if [ "${SANITIZER:-}" = thread ]; then # single-threaded code; ASan + UBSan run it in full
  echo "skip place_simulate.all: SANITIZER=thread: simulate and its inputs' readers run on one thread (the ASan + UBSan run covers them; instrumented bench-kernels takes ~50 s)"
  echo "place_simulate: 0 passed, 0 failed, 1 skipped"; exit 0
fi
tmp=$(mktemp -d /tmp/moerpc-sim.XXXXXX)
trap 'rm -rf "$tmp"; echo "place_simulate: $passed passed, $failed failed, 0 skipped"' EXIT
ok() { echo "ok   place_simulate.$1"; passed=$((passed + 1)); }
bad() { echo "FAIL place_simulate.$1: $2"; failed=$((failed + 1)); }

M=$tmp/model
"$BIN/moerpc-mkmodel" --out "$M" --layers 2 --experts 16 --topk 4 --hidden 256 --inter 128 \
    --seed 1 >"$tmp/mk.log" 2>&1 || { bad setup "moerpc-mkmodel failed"; exit 1; }
"$BIN/moerpc-bench-kernels" --format bf16 --tokens 1,16 --repeats 3 --threads 1 --json \
    >"$tmp/k.jsonl" 2>"$tmp/k.log" || { bad setup "bench-kernels failed: $(tail -1 "$tmp/k.log")"; exit 1; }
"$BIN/moerpc-client" bench --model "$M" --threads 1 --prompt-len 8 --decode 8 --repeats 1 --json \
    --quiet --log warn >"$tmp/c.jsonl" 2>"$tmp/c.log" || { bad setup "client bench failed: $(tail -1 "$tmp/c.log")"; exit 1; }
printf '{"bench":"rpc","tokens":1,"req_bytes":600,"reply_bytes":520,"grpc_p50_us":110,"server_compute_us_p50":30}\n{"bench":"rpc","tokens":16,"req_bytes":8600,"reply_bytes":8200,"grpc_p50_us":190,"server_compute_us_p50":80}\n' >"$tmp/rpc.jsonl"

sim() { "$BIN/moerpc-place" simulate --model "$M" --kernels "$tmp/k.jsonl" --client-bench "$tmp/c.jsonl" \
          --rpc "$tmp/rpc.jsonl" --json "$@"; }
field() { python3 -c 'import json,sys; r=json.loads(sys.stdin.readline()); print(r[sys.argv[1]])' "$1"; }

# 1. real inputs, 1 and 4 hosts: positive, finite figures; more hosts not slower
out1=$(sim --hosts 1 2>"$tmp/e1") && out4=$(sim --hosts 4 2>"$tmp/e4") &&
  d1=$(field decode_tok_s <<<"$out1") && d4=$(field decode_tok_s <<<"$out4") &&
  p1=$(field prefill_tok_s <<<"$out1") &&
  python3 -c 'import sys; a,b,p=map(float,sys.argv[1:]); sys.exit(0 if 0<a<=b*1.001 and p>0 else 1)' "$d1" "$d4" "$p1" \
  && ok real_inputs_more_hosts_not_slower || bad real_inputs_more_hosts_not_slower "1 host $d1, 4 hosts $d4 tok/s, prefill $p1 ($(cat "$tmp/e1" "$tmp/e4" | tail -2))"

# 2. a placement naming two servers, stats skewed to s0's experts: s0 is the bottleneck host
python3 - "$tmp" <<'PY'
import json, sys
d = sys.argv[1]
json.dump({"format": "moerpc-placement", "version": 1, "num_layers": 2, "num_experts": 16,
           "layers": [{"layer": l, "remote": {"s0": "0-7", "s1": "8-15"}} for l in range(2)]},
          open(d + "/p.json", "w"))
json.dump({"format": "moerpc-stats", "version": 1, "num_layers": 2, "num_experts": 16,
           "window": {"kind": "steps", "steps": 100, "tokens": 100},
           "counts": [[50 if x < 8 else 1 for x in range(16)] for l in range(2)]},
          open(d + "/s.json", "w"))
json.dump({"format": "moerpc-stats", "version": 1, "num_layers": 3, "num_experts": 16,
           "window": {"kind": "steps"}, "counts": [[1] * 16] * 3}, open(d + "/s3.json", "w"))
PY
out=$("$BIN/moerpc-place" simulate --model "$M" --kernels "$tmp/k.jsonl" --rpc-fixed-us 0 \
      --placement "$tmp/p.json" --stats "$tmp/s.json" --batch 4 --client-step-us 10 \
      --prompt-len 0 --json 2>"$tmp/e2")
python3 - "$out" <<'PY' && ok skewed_stats_name_the_busy_server || bad skewed_stats_name_the_busy_server "$out $(tail -1 "$tmp/e2")"
import json, sys
r = json.loads(sys.argv[1])
b = r["decode_host_busy_us"]
sys.exit(0 if r["decode_bottleneck"] == "s0" and b["s0"] > 1.5 * b["s1"] and r["decode_imbalance"] > 1.2
         and r["prefill_tok_s"] is None else 1)
PY

# 2b. the cluster file's speed keys, and replicas: the same skewed stats with s0 twice as
# fast (from --cluster) halve s0's busy time; the hot experts 0-7 replicated on s0 and s1
# go to those two only, never to s2 (which holds only cold ones).
cat >"$tmp/c.json" <<'EOF2'
{"servers": [{"name": "s0", "address": "127.0.0.1:1", "speed": 2},
             {"name": "s1", "address": "127.0.0.1:2"}]}
EOF2
python3 - "$tmp" <<'PY'
import json, sys
d = sys.argv[1]
json.dump({"format": "moerpc-placement", "version": 1, "num_layers": 2, "num_experts": 16,
           "layers": [{"layer": l, "remote": {"s0": "0-7", "s1": "0-11", "s2": "12-15"}}
                      for l in range(2)]},
          open(d + "/prep.json", "w"))
PY
sim2() { "$BIN/moerpc-place" simulate --model "$M" --kernels "$tmp/k.jsonl" --rpc-fixed-us 0 \
           --stats "$tmp/s.json" --batch 4 --client-step-us 10 --prompt-len 0 --json "$@" 2>>"$tmp/e2"; }
fast=$(sim2 --placement "$tmp/p.json" --cluster "$tmp/c.json")
rep=$(sim2 --placement "$tmp/prep.json")
python3 - "$out" "$fast" "$rep" <<'PY' && ok cluster_speed_and_replicas || bad cluster_speed_and_replicas "$fast / $rep $(tail -1 "$tmp/e2")"
import json, sys
base, fast, rep = (json.loads(a) for a in sys.argv[1:])
b, f, r = base["decode_host_busy_us"], fast["decode_host_busy_us"], rep["decode_host_busy_us"]
ok = 0.4 < f["s0"] / b["s0"] < 0.6 and r["s2"] < 0.5 * min(r["s0"], r["s1"])
sys.exit(0 if ok else 1)
PY

# 3. bad files exit 1 naming the field; bad flags exit 2
expect() { # name want-status want-text args...
  local name=$1 st=$2 want=$3; shift 3
  "$BIN/moerpc-place" simulate "$@" >"$tmp/o" 2>"$tmp/e"; local rc=$?
  if [ $rc -eq "$st" ] && grep -qF -- "$want" "$tmp/e"; then ok "$name"
  else bad "$name" "exit $rc (want $st), stderr: $(head -c 300 "$tmp/e")"; fi
}
grep -v -e '"tokens":16' -e '"mode"' "$tmp/k.jsonl" | sed 's/"weight_gbps":[0-9.]*,//' >"$tmp/k_bad.jsonl"
expect kernels_missing_field 1 'line 1: weight_gbps = (missing)' --model "$M" --hosts 2 \
    --kernels "$tmp/k_bad.jsonl" --client-step-us 100
sed 's/"req_bytes":600/"req_bytes":-600/' "$tmp/rpc.jsonl" >"$tmp/rpc_bad.jsonl"
expect rpc_negative 1 'line 1: req_bytes = -600, must be a finite number >= 0' --model "$M" --hosts 2 \
    --kernels "$tmp/k.jsonl" --rpc "$tmp/rpc_bad.jsonl" --client-step-us 100
expect stats_shape 1 '3 layers x 16 experts, the model has 2 x 16' --model "$M" --hosts 2 \
    --kernels "$tmp/k.jsonl" --stats "$tmp/s3.json" --client-step-us 100
expect no_kernels 1 'host h0 has no kernel rates' --model "$M" --hosts 2 --client-step-us 100
expect no_model 2 'give exactly one of --model DIR and --shape NAME' --hosts 2 --client-step-us 100
expect unknown_host 2 '--speed s9=...: no host of that name' --model "$M" --placement "$tmp/p.json" \
    --kernels "$tmp/k.jsonl" --client-step-us 100 --speed s9=2
expect bad_speed 2 '--speed = "-1", must be a number' --model "$M" --placement "$tmp/p.json" \
    --kernels "$tmp/k.jsonl" --client-step-us 100 --speed s0=-1
expect bad_format 2 '--format = "q4"' --model "$M" --hosts 1 --format q4 --client-step-us 1
expect no_client_time 2 "the client's own step time is needed" --model "$M" --hosts 1
"$BIN/moerpc-place" simulate --help | grep -q -- '--shared-cores' && ok help || bad help "no --shared-cores in --help"
[ "$failed" -eq 0 ]
