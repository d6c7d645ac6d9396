#!/usr/bin/env bash
# deploy/netns/demo-multihost.sh (make demo-multihost) - expert servers on hosts made of
# network namespaces on this machine:
#   1. checks that namespaces can be made here (root or CAP_NET_ADMIN; else says why and
#      exits 1: a demo is not a test), builds, makes the small default model,
#   2. the baseline: the same servers on loopback (deploy/local-cluster.sh), `generate`,
#   3. for each profile in PROFILES (default 25gbe): N servers each in its own namespace,
#      the experts split across them, the client in another namespace, `generate` over the
#      profile's links (latency by netem, or by moerpc-relay where the kernel has no netem);
#      then the same with every expert on two servers (replicas),
#   4. one line per configuration: decode tokens/s, the ratio to loopback, greedy tokens
#      identical to loopback, and which mechanism made the latency; tears everything down.
# Environment: DEMO_DIR (default build/demo-multihost), SERVERS (default 3), PROFILES
# (default "25gbe"; see deploy/netns/netns.sh profiles; "none:relay" = bare links with a
# relay of zero delay in front of every server, what the relay itself costs), LAYOUTS
# (default "split replicas"), MAX_NEW (default 64), BATCH
# (sequences, default 1), ROUNDS (runs of each configuration, the median is printed;
# default 1), MKMODEL_FLAGS, NN_LATENCY (auto|netem|relay), NO_BUILD=1 (skip make).
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
BIN=$PWD/$BUILD/bin
DEMO_DIR=${DEMO_DIR:-$BUILD/demo-multihost}
SERVERS=${SERVERS:-3}
PROFILES=${PROFILES:-25gbe}
LAYOUTS=${LAYOUTS:-split replicas}
MAX_NEW=${MAX_NEW:-64}
BATCH=${BATCH:-1}
ROUNDS=${ROUNDS:-1}
PROMPTS="1,17,42,99,7,256,3"

step() { printf '\n==> %s\n' "$*"; }

# shellcheck source=deploy/netns/netns.sh
. deploy/netns/netns.sh
# shellcheck source=deploy/netns/cluster.sh
. deploy/netns/cluster.sh

step "network namespaces"
if ! nn_check; then
  echo "demo-multihost: cannot run here: $NN_WHY" >&2
  exit 1
fi
if nn_netem_available && [ "${NN_LATENCY:-auto}" != relay ]; then
  echo "ok; this kernel has netem: latency and loss by netem"
else
  echo "ok; latency and loss by moerpc-relay (${NN_LATENCY:+NN_LATENCY=$NN_LATENCY, }kernel netem: $(nn_netem_available && echo yes || echo no))"
fi

if [ "${NO_BUILD:-0}" != 1 ]; then
  step "build"
  make -j"$(nproc)" all >/dev/null
fi
rm -rf "$DEMO_DIR"; mkdir -p "$DEMO_DIR"
step "model"
# shellcheck disable=SC2086 # MKMODEL_FLAGS is a list of flags
"$BIN/moerpc-mkmodel" --out "$DEMO_DIR/model" --seed 1 ${MKMODEL_FLAGS:-}

results=$DEMO_DIR/results.txt
: >"$results"
GEN=(generate --model "$DEMO_DIR/model" --prompt-ids "$PROMPTS" --batch "$BATCH"
     --max-new "$MAX_NEW" --threads 1 --json --quiet --log warn)

gen_rounds() { # name out-prefix cmd-prefix...: ROUNDS runs; one line to $results
  local name=$1 out=$2 r
  shift 2
  for ((r = 1; r <= ROUNDS; r++)); do
    "$@" "$BIN/moerpc-client" "${GEN[@]}" --cluster "$out.cluster.json" >"$out.r$r.jsonl" \
        2>"$out.r$r.log" || { echo "generate failed ($name):"; cat "$out.r$r.log"; return 1; }
  done
  python3 - "$name" "$out" "$ROUNDS" "$MECH" >>"$results" <<'PY'
import json, sys, statistics
name, out, rounds, mech = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
toks, ids = [], None
for r in range(1, rounds + 1):
    seqs = []
    for line in open("%s.r%d.jsonl" % (out, r)):
        j = json.loads(line)
        if "seq" in j: seqs.append(j["ids"])
        else: toks.append(j["decode_tok_s"])
    ids = ids or seqs
print(json.dumps({"name": name, "mech": mech, "decode_tok_s": statistics.median(toks),
                  "runs": toks, "ids": ids}))
PY
  tail -n 1 "$results" | python3 -c 'import json,sys; r=json.load(sys.stdin); print("    %s: decode %.1f tok/s (runs %s)" % (r["name"], r["decode_tok_s"], ", ".join("%.1f" % x for x in r["runs"])))'
}

. deploy/local-cluster.sh
step "baseline: $SERVERS servers on loopback, experts split"
lc_start "$DEMO_DIR/loopback" "$DEMO_DIR/model" "$SERVERS" --threads 1 >/dev/null
cp "$DEMO_DIR/loopback/cluster.json" "$DEMO_DIR/loopback.cluster.json"
MECH=none
gen_rounds "loopback, split" "$DEMO_DIR/loopback"
lc_stop >/dev/null

for entry in $PROFILES; do
  prof=${entry%%:*}
  MH_FORCE_RELAY=0
  [ "$entry" != "$prof" ] && MH_FORCE_RELAY=1   # "none:relay": a relay with no delay
  export MH_FORCE_RELAY
  for layout in $LAYOUTS; do
    step "$SERVERS servers in namespaces, experts $layout, profile $entry, client in its own namespace"
    tag=$prof
    [ "$MH_FORCE_RELAY" = 1 ] && tag=$prof-relay
    d="$DEMO_DIR/$tag-$layout"
    mh_start "$d" "$DEMO_DIR/model" "$SERVERS" "$layout" "$prof" --threads 1
    nn_describe
    cp "$d/cluster.json" "$d.cluster.json"
    MECH=$MH_MECH
    gen_rounds "$entry, $layout" "$d" ip netns exec "$(nn_ns 0)"
    mh_stop
  done
done

step "summary (decode tokens/s, median of $ROUNDS; model $DEMO_DIR/model, $SERVERS servers, batch $BATCH, $MAX_NEW new tokens)"
python3 - "$results" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
base = rows[0]
for r in rows:
    same = sum(a == b for s, t in zip(r["ids"], base["ids"]) for a, b in zip(s, t))
    total = sum(len(s) for s in base["ids"])
    print("  %-22s %8.1f tok/s  x%.2f of loopback  tokens identical %d/%d  latency by %s"
          % (r["name"], r["decode_tok_s"], r["decode_tok_s"] / base["decode_tok_s"], same, total,
             r["mech"]))
PY
echo "logs: $DEMO_DIR/*/s*.log, relays $DEMO_DIR/*/relay-s*.log"
echo "demo-multihost: ok"
