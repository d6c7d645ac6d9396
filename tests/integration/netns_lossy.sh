#!/usr/bin/env bash
# tests/integration/netns_lossy.sh - a link with latency and loss gives the same results:
# three servers in namespaces, every host link on the "lossy" profile (1 Gbit/s, 0.5 ms
# one-way, 1% loss host to host). With netem the loss is real packet loss (TCP
# retransmits); with moerpc-relay it is what loss costs TCP, a chunk held 200 ms (the
# relays must report stalls, or the test proves nothing). Checks: the same 16 greedy
# tokens as all-local, logits within 1e-5 (fp32 wire), no request failed.
# shellcheck source=tests/integration/netns/common.sh
. "$(dirname "$0")/netns/common.sh"
nt_init netns_lossy
if [ "$NT_CAN" = 0 ]; then nt_skip lossy_link_same_tokens "$NT_WHY"; nt_done; fi
P="3,14,15,92,65,35,89,79,32,38"
M=$NT_TMP/model
ref=$(nt_local_tokens "$P" 16) || { nt_fail setup "all-local generate failed"; nt_done; }
"$BIN/moerpc-client" logits --model "$M" --ids "$P" --out "$NT_TMP/local.bin" --threads 1 \
    --quiet --log warn || { nt_fail setup "all-local logits failed"; nt_done; }
d=$NT_TMP/lossy
why=
mh_start "$d" "$M" 3 split lossy --threads 1 || { nt_fail lossy_link_same_tokens "servers did not start"; nt_done; }
nn_describe
t0=$(date +%s.%N)
if mh_client "$BIN/moerpc-client" generate --model "$M" --cluster "$d/cluster.json" --prompt-ids "$P" \
    --max-new 16 --wire f32 --threads 1 --json --quiet --log warn >"$d/gen.jsonl" 2>"$d/gen.log"; then
  got=$(nt_tokens "$d/gen.jsonl")
  echo "tokens: all-local $ref"
  echo "        lossy     $got"
  [ "$got" = "$ref" ] || why="greedy tokens differ from all-local"
else
  why="generate failed over the lossy link: $(tail -n 3 "$d/gen.log")"
fi
echo "generate took $(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}') s (latency and loss by $MH_MECH)"
cmp=$(mh_client "$BIN/moerpc-client" logits --model "$M" --cluster "$d/cluster.json" --ids "$P" \
    --wire f32 --threads 1 --out "$d/remote.bin" --compare "$NT_TMP/local.bin" --quiet --log warn 2>&1)
echo "logits: $cmp"
rel=$(echo "$cmp" | sed -n 's/.*relative L2 \([0-9.e+-]*\).*/\1/p')
if [ -z "$rel" ] || ! awk -v r="$rel" 'BEGIN{exit !(r <= 1e-5)}'; then why="${why:+$why; }logits: ${cmp:-none} (limit 1e-5)"; fi
mh_stop || why="${why:+$why; }a server did not drain and exit 0"
if [ "$MH_MECH" = relay ]; then
  grep -h stopping "$d"/relay-s*.log
  stalls=$(grep -h stopping "$d"/relay-s*.log | sed -n 's/.* \([0-9]*\) stalls$/\1/p' | awk '{s += $1} END {print s + 0}')
  [ "$stalls" -gt 0 ] || why="${why:+$why; }the relays stalled no chunk: the loss was not exercised"
  echo "relays: $stalls chunks stalled 200 ms"
fi
if [ -z "$why" ]; then nt_pass lossy_link_same_tokens; else nt_fail lossy_link_same_tokens "$why"; fi
nt_done
