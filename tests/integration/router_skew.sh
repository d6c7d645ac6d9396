#!/usr/bin/env bash
# router_skew.sh - `moerpc-mkmodel --router-skew S` makes some experts popular (issue #10's
# realistic routing to plan on): the same prompts through a real server route a larger share
# of slots to each layer's busiest quarter of experts than on the plain model; S = 0 writes
# the plain model byte for byte; bad values are usage errors.
set -uo pipefail
cd "$(dirname "$0")/../.."
BIN=${MOERPC_BIN:-$PWD/build/bin}
passed=0; failed=0
tmp=$(mktemp -d /tmp/moerpc-skew.XXXXXX)
trap 'lc_stop >/dev/null 2>&1; rm -rf "$tmp"; echo "router_skew: $passed passed, $failed failed, 0 skipped"' EXIT
ok() { echo "ok   router_skew.$1"; passed=$((passed + 1)); }
bad() { echo "FAIL router_skew.$1: $2"; failed=$((failed + 1)); }
# shellcheck source=deploy/local-cluster.sh
. deploy/local-cluster.sh

mk() { "$BIN/moerpc-mkmodel" --out "$tmp/$1" --seed 1 "${@:2}" >"$tmp/$1.log" 2>&1; }
mk plain && mk s0 --router-skew 0 && mk s2 --router-skew 2 || { bad setup "moerpc-mkmodel failed"; exit 1; }
if cmp -s "$tmp/plain/model.safetensors" "$tmp/s0/model.safetensors" &&
   cmp -s "$tmp/plain/config.json" "$tmp/s0/config.json"; then ok skew_0_is_the_plain_model
else bad skew_0_is_the_plain_model "files differ"; fi

share() { # model -> the busiest-quarter share of every layer, space separated
  local m=$1
  lc_start "$tmp/c-$m" "$tmp/$m" 1 --threads 1 >/dev/null 2>&1 || return 1
  "$BIN/moerpc-client" generate --model "$tmp/$m" --cluster "$tmp/c-$m/cluster.json" --threads 1 \
      --prompt-ids '1,2,3;7,8,9;20,21;40,41,42,43' --max-new 48 >/dev/null 2>&1 || return 1
  "$BIN/moerpc-client" stats --cluster "$tmp/c-$m/cluster.json" --all 2>/dev/null >"$tmp/st-$m.txt"
  lc_stop >/dev/null 2>&1
  python3 - "$tmp/st-$m.txt" <<'PY'
import collections, re, sys
c = collections.defaultdict(dict)
for l in open(sys.argv[1]):
    m = re.match(r'\s+count layer (\d+) expert (\d+) tokens (\d+)', l)
    if m: c[int(m[1])][int(m[2])] = int(m[3])
out = []
for layer, d in sorted(c.items()):
    v = sorted(d.values(), reverse=True) + [0] * 16
    out.append("%.3f" % (sum(v[:4]) / max(1, sum(v))))
print(" ".join(out))
PY
}
a=$(share plain) || { bad popular_experts "plain model run failed"; exit 1; }
b=$(share s2) || { bad popular_experts "skewed model run failed"; exit 1; }
echo "  slots on the 4 busiest of 16 experts, per layer: plain $a, --router-skew 2: $b"
if python3 -c 'import sys; a=[float(x) for x in sys.argv[1].split()]; b=[float(x) for x in sys.argv[2].split()]; sys.exit(not (len(a)==len(b)==4 and sum(b)/4 >= sum(a)/4 + 0.08))' "$a" "$b"
then ok popular_experts; else bad popular_experts "mean share did not grow by 0.08: $a -> $b"; fi

all=1
for v in -1 9 x 1.5z ''; do
  "$BIN/moerpc-mkmodel" --out "$tmp/bad" --router-skew "$v" >"$tmp/bad.log" 2>&1
  rc=$?
  if [ $rc -ne 2 ] || ! grep -q -- '--router-skew' "$tmp/bad.log"; then all=0; bad bad_values "\"$v\": exit $rc: $(cat "$tmp/bad.log")"; fi
done
[ $all = 1 ] && ok bad_values
[ $failed -eq 0 ]
