#!/usr/bin/env bash
# place_plan.sh - `moerpc-place plan` and `diff` end to end (issue #10, docs/DESIGN.md
# section 14), on the skewed model (moerpc-mkmodel --router-skew 2) and two real servers on
# loopback that both hold every expert:
#   plan_is_accepted_and_routed  the client's own routing statistics -> plan balanced
#                                --replicas 2 --gpu-bytes: the file loads in the client
#                                (generate --placement runs, same tokens as without), and
#                                the servers' Stats show every single-copy pair computed on
#                                its planned server only, no local pair on any server
#   current_moves_nothing        plan --current (its own output, same stats): 0 bytes to
#                                load or drop on every host; diff says "identical"
#   diff_counts_moves            diff uniform -> balanced: exit 0, per-server lines, a
#                                summary naming the bytes (--model)
#   output_in_place              -o onto a symlink writes through it (no rename over it)
#   bad_inputs                   stats of another shape, a cluster without servers, a
#                                --current naming a server not in the cluster or of another
#                                model (fingerprint), a plan that
#                                cannot fit (bytes needed and available named), placements
#                                of two shapes: exit 1 with the field named; bad flags exit 2
set -uo pipefail
cd "$(dirname "$0")/../.."
BIN=${MOERPC_BIN:-$PWD/build/bin}
passed=0; failed=0
tmp=$(mktemp -d /tmp/moerpc-pplan.XXXXXX)
finish() {
  lc_stop >/dev/null 2>&1
  lc__cleanup
  rm -rf "$tmp"
  echo "place_plan: $passed passed, $failed failed, 0 skipped"
}
ok() { echo "ok   place_plan.$1"; passed=$((passed + 1)); }
bad() { echo "FAIL place_plan.$1: $2"; failed=$((failed + 1)); }
# shellcheck source=deploy/local-cluster.sh
. deploy/local-cluster.sh   # first: it sets an EXIT trap of its own, which finish replaces
trap finish EXIT
P="$BIN/moerpc-place"

"$BIN/moerpc-mkmodel" --out "$tmp/m" --seed 1 --router-skew 2 >/dev/null 2>&1 ||
  { bad setup "moerpc-mkmodel failed"; exit 1; }
lc_start "$tmp/c" "$tmp/m" 2 --threads 1 --experts all >/dev/null 2>&1 ||
  { bad setup "servers did not start"; exit 1; }
cl=$tmp/c/cluster.json
# --wire f32: the tokens with and without the placement are compared exactly, and a
# placement moves hot experts from the servers (whose replies a bf16 wire rounds) to the
# client (fp32); on a near-tie that rounding alone can flip an argmax (it did at token 14
# of sequence 0 on an AVX2-only EPYC, 2026-12-06), which is not what this case tests.
gen() { # out, extra flags...
  local o=$1; shift
  "$BIN/moerpc-client" generate --model "$tmp/m" --cluster "$cl" --threads 1 --quiet --wire f32 \
      --prompt-ids '1,2,3;7,8,9;20,21;40,41,42,43' --max-new 24 "$@" >"$tmp/$o.out" 2>"$tmp/$o.err"
}

# --- plan_is_accepted_and_routed
eb=$(( (3 * 256 * 128 * 2 + 63) / 64 * 64 ))   # one bf16 expert of H 256, I 128
if gen base --routing-stats "$tmp/stats.json" &&
   "$P" plan --model "$tmp/m" --cluster "$cl" --stats "$tmp/stats.json" --replicas 2 \
       --gpu-bytes $((8 * eb)) -o "$tmp/bal.json" 2>"$tmp/plan.err" &&
   "$BIN/moerpc-client" stats --cluster "$cl" --reset >/dev/null 2>&1 &&
   gen placed --placement "$tmp/bal.json" &&
   "$BIN/moerpc-client" stats --cluster "$cl" --all >"$tmp/st.txt" 2>&1; then
  if python3 - "$tmp/bal.json" "$tmp/st.txt" "$tmp/base.out" "$tmp/placed.out" "$tmp/plan.err" <<'PY'
import json, re, sys
plan = json.load(open(sys.argv[1])); st = open(sys.argv[2]).read()
def ids(spec):
    out = set()
    for part in filter(None, spec.split(',')):
        a, _, b = part.partition('-'); out.update(range(int(a), int(b or a) + 1))
    return out
where = {}   # (layer, expert) -> set of servers
local = set()
for L in plan['layers']:
    local |= {(L['layer'], x) for x in ids(L.get('local', ''))}
    for s, spec in L.get('remote', {}).items():
        for x in ids(spec): where.setdefault((L['layer'], x), set()).add(s)
# moerpc-client stats --all: a "server NAME" header line, then "count layer L expert X tokens N"
counts, cur = {}, None
for line in st.splitlines():
    m = re.match(r'server (\S+) \(', line)
    if m: cur = m[1]
    m = re.match(r'\s+count layer (\d+) expert (\d+) tokens (\d+)', line)
    if m and cur: counts[(cur, int(m[1]), int(m[2]))] = int(m[3])
if not counts: print('no counts parsed from stats output:\n' + st[:800]); sys.exit(1)
errs = []
for (s, l, x), n in counts.items():
    if n == 0: continue
    if (l, x) in local: errs.append('local pair %d/%d computed on %s' % (l, x, s))
    elif s not in where.get((l, x), set()): errs.append('pair %d/%d on %s, planned on %s' % (l, x, s, where.get((l, x))))
if errs: print('\n'.join(errs[:10])); sys.exit(1)
reps = sum(1 for v in where.values() if len(v) > 1)
toks = lambda f: [l for l in open(f) if not l.startswith('prefill ')]  # not the timing line
if toks(sys.argv[3]) != toks(sys.argv[4]) or not toks(sys.argv[3]): print('tokens differ with the placement'); sys.exit(1)
print('  %d local pairs, %d remote pairs, %d replicated; %d server counts checked' % (len(local), len(where), reps, len(counts)))
if 'expected imbalance' not in open(sys.argv[5]).read(): print('no imbalance line'); sys.exit(1)
PY
  then ok plan_is_accepted_and_routed; else bad plan_is_accepted_and_routed "see above"; fi
else
  bad plan_is_accepted_and_routed "a step failed: $(tail -n 3 "$tmp"/plan.err "$tmp"/placed.err 2>/dev/null)"
fi
grep '^plan:' "$tmp/plan.err" | sed 's/^/  /'

# --- current_moves_nothing
if "$P" plan --model "$tmp/m" --cluster "$cl" --stats "$tmp/stats.json" --replicas 2 \
       --gpu-bytes $((8 * eb)) --current "$tmp/bal.json" -o "$tmp/bal2.json" 2>"$tmp/plan2.err" &&
   [ "$(grep -c 'to load 0 bytes (0 B), to drop 0 bytes' "$tmp/plan2.err")" = 2 ] &&
   "$P" diff "$tmp/bal.json" "$tmp/bal2.json" | grep -q 'diff: identical placements'; then
  ok current_moves_nothing
else bad current_moves_nothing "$(grep '^plan:' "$tmp/plan2.err")"; fi

# --- diff_counts_moves
"$P" plan --model "$tmp/m" --cluster "$cl" --stats "$tmp/stats.json" --strategy uniform \
    --gpu-bytes $((8 * eb)) -o "$tmp/uni.json" 2>/dev/null
"$P" diff "$tmp/uni.json" "$tmp/bal.json" --model "$tmp/m" >"$tmp/diff.out" 2>&1; rc=$?
if [ $rc -eq 0 ] && grep -q '^server s0: +[0-9]* pairs' "$tmp/diff.out" &&
   grep -q '^local: +' "$tmp/diff.out" && grep -Eq '^diff: [1-9][0-9]* server copies added on [12] servers, [0-9]+ bytes to load' "$tmp/diff.out"
then ok diff_counts_moves; else bad diff_counts_moves "exit $rc: $(tail -n 3 "$tmp/diff.out")"; fi

# --- output_in_place: -o onto a symlink writes through it (a rename would replace the
# link; the same rule keeps "-o /dev/null" a device)
ln -s "$tmp/target.json" "$tmp/link.json"
if "$P" plan --model "$tmp/m" --cluster "$cl" -o "$tmp/link.json" 2>/dev/null && [ -L "$tmp/link.json" ] &&
   grep -q '"moerpc-placement"' "$tmp/target.json"; then ok output_in_place
else bad output_in_place "link replaced or target not written"; fi

# --- speed_from_benches: --speed-from reads each server's bench-kernels lines; a server
# three times as fast gets the larger share of the cold experts
for sp in s0:10 s1:30; do
  printf '{"shape":"t","format":"bf16","group":0,"isa":"avx512","tokens":1,"top_k":2,"experts_pool":16,"threads":1,"weight_gbps":%s}\n' \
    "${sp#*:}" >"$tmp/k-${sp%%:*}.jsonl"
done
"$P" plan --model "$tmp/m" --cluster "$cl" --speed-from "s0=$tmp/k-s0.jsonl" \
    --speed-from "s1=$tmp/k-s1.jsonl" -o "$tmp/speed.json" 2>"$tmp/speed.err"; rc=$?
n=$(python3 -c '
import json, sys
from collections import Counter
c = Counter()
def size(spec):
    n = 0
    for part in spec.split(","):
        a, _, b = part.partition("-")
        n += int(b or a) - int(a) + 1 if part else 0
    return n
for l in json.load(open(sys.argv[1]))["layers"]:
    for srv, spec in l.get("remote", {}).items():
        c[srv] += size(spec)
print(c["s0"], c["s1"])' "$tmp/speed.json" 2>&1)
if [ $rc -eq 0 ] && grep -q 'host s0: 10.00 GB/s decode (bf16) -> speed 0.500' "$tmp/speed.err" &&
   grep -q 'host s1: 30.00 GB/s decode (bf16) -> speed 1.500' "$tmp/speed.err" &&
   [ "${n% *}" -lt "${n#* }" ]; then ok speed_from_benches
else bad speed_from_benches "exit $rc, pairs s0 s1 = $n: $(grep -E 'speed|error' "$tmp/speed.err" | head -3)"; fi

# --- bad_inputs
all=1
expect() { # name, exit status, text, command...
  local name=$1 want=$2 text=$3; shift 3
  "$@" >"$tmp/x.out" 2>"$tmp/x.err"; local rc=$?
  if [ $rc -ne "$want" ] || ! grep -qF -- "$text" "$tmp/x.err"; then
    all=0; bad bad_inputs "$name: exit $rc (want $want), stderr: $(head -c 300 "$tmp/x.err")"
  fi
}
python3 - "$tmp/stats.json" "$tmp/stats3.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1])); s['num_layers'] = 3; s['counts'] = s['counts'][:3]
json.dump(s, open(sys.argv[2], 'w'))
PY
echo '{"servers": []}' >"$tmp/empty.json"
python3 - "$cl" "$tmp/tiny.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
for s in c['servers']: s['expert_memory'] = '1M'
json.dump(c, open(sys.argv[2], 'w'))
PY
sed 's/"s1"/"zz"/' "$tmp/bal.json" >"$tmp/zz.json"
sed 's/"model_fingerprint":[^,]*,/"model_fingerprint": "00000000deadbeef",/' "$tmp/bal.json" >"$tmp/fp.json"
"$BIN/moerpc-mkmodel" --out "$tmp/m8" --seed 1 --experts 8 --topk 2 >/dev/null 2>&1
"$P" plan --model "$tmp/m8" --cluster "$cl" -o "$tmp/p8.json" 2>/dev/null
expect shape 1 "num_layers = 3, num_experts = 16, the model" "$P" plan --model "$tmp/m" --cluster "$cl" --stats "$tmp/stats3.json"
expect no_servers 1 "servers has 0 entries, must have 1..256" "$P" plan --model "$tmp/m" --cluster "$tmp/empty.json"
expect unknown_server 1 "server \"zz\" is not in the cluster" "$P" plan --model "$tmp/m" --cluster "$cl" --current "$tmp/zz.json"
expect current_other_model 1 "a placement of another model" "$P" plan --model "$tmp/m" --cluster "$cl" --current "$tmp/fp.json"
expect no_fit 1 "plan does not fit: 64 cold experts" "$P" plan --model "$tmp/m" --cluster "$tmp/tiny.json"
expect no_fit_bytes 1 "the hosts' expert_memory is 2097152 bytes" "$P" plan --model "$tmp/m" --cluster "$tmp/tiny.json"
expect diff_shapes 1 "not the same model" "$P" diff "$tmp/bal.json" "$tmp/p8.json"
expect diff_unknown_server 1 "server \"zz\" is not in the cluster file" "$P" diff "$tmp/bal.json" "$tmp/zz.json" --model "$tmp/m" --cluster "$cl"
expect bad_format 2 "--format = \"int3\"" "$P" plan --model "$tmp/m" --cluster "$cl" --format int3
expect bad_replicas 2 "--replicas = \"0\"" "$P" plan --model "$tmp/m" --cluster "$cl" --replicas 0
expect no_model 2 "--model DIR is required" "$P" plan --cluster "$cl"
expect bad_gpu 2 "--gpu-bytes = \"12Q\"" "$P" plan --model "$tmp/m" --cluster "$cl" --gpu-bytes 12Q
expect diff_one_file 2 "needs two placement files" "$P" diff "$tmp/bal.json"
expect speed_from_unknown 1 'no server "zz" in the cluster file' "$P" plan --model "$tmp/m" --cluster "$cl" --speed-from "zz=$tmp/k-s0.jsonl"
expect speed_from_no_file 2 '--speed-from = "s0", must be NAME=FILE' "$P" plan --model "$tmp/m" --cluster "$cl" --speed-from s0
expect speed_from_no_lines 1 'no moerpc-bench-kernels line of format int8' "$P" plan --model "$tmp/m" --cluster "$cl" --format int8 --speed-from "s0=$tmp/k-s0.jsonl"
[ $all = 1 ] && ok bad_inputs
[ $failed -eq 0 ]
