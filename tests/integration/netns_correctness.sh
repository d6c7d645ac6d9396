#!/usr/bin/env bash
# tests/integration/netns_correctness.sh - distributed == all-local across hosts: three
# servers, each in its own network namespace (deploy/netns/), the client in a fourth, over
# the 25gbe profile (rate by tbf, 0.05 ms one-way by netem or moerpc-relay). For the experts
# split across the servers and for every expert on two servers (replicas): the prompt's
# logits within relative L2 1e-5 of all-local (fp32 wire, reference kernels), the same
# 32 greedy tokens, every server that owns a share answered requests, and every server
# drains and exits 0. SKIPs (with the reason) where namespaces cannot be made.
# shellcheck source=tests/integration/netns/common.sh
. "$(dirname "$0")/netns/common.sh"
nt_init netns_correctness
if [ "$NT_CAN" = 0 ]; then
  nt_skip split_equals_local "$NT_WHY"; nt_skip replicas_equal_local "$NT_WHY"; nt_done
fi
P="3,14,15,92,65,35,89,79,32,38"
M=$NT_TMP/model
ref=$(nt_local_tokens "$P" 32) || { nt_fail setup "all-local generate failed"; nt_done; }
"$BIN/moerpc-client" logits --model "$M" --ids "$P" --out "$NT_TMP/local.bin" --threads 1 \
    --quiet --log warn || { nt_fail setup "all-local logits failed"; nt_done; }
echo "all-local tokens: $ref"

for layout in split replicas; do
  c=${layout}_equals_local
  [ $layout = replicas ] && c=replicas_equal_local
  d=$NT_TMP/$layout
  if ! mh_start "$d" "$M" 3 "$layout" 25gbe --threads 1; then nt_fail "$c" "servers did not start"; continue; fi
  nn_describe
  why=
  if mh_client "$BIN/moerpc-client" generate --model "$M" --cluster "$d/cluster.json" --prompt-ids "$P" \
      --max-new 32 --wire f32 --threads 1 --json --quiet --log warn >"$d/gen.jsonl" 2>"$d/gen.log"; then
    got=$(nt_tokens "$d/gen.jsonl")
    echo "$layout tokens:   $got"
    [ "$got" = "$ref" ] || why="greedy tokens differ from all-local: $got"
  else
    why="generate failed: $(tail -n 3 "$d/gen.log")"
  fi
  cmp=$(mh_client "$BIN/moerpc-client" logits --model "$M" --cluster "$d/cluster.json" --ids "$P" \
      --wire f32 --threads 1 --out "$d/remote.bin" --compare "$NT_TMP/local.bin" --quiet --log warn 2>&1)
  echo "$layout logits: $cmp (latency by $MH_MECH)"
  rel=$(echo "$cmp" | sed -n 's/.*relative L2 \([0-9.e+-]*\).*/\1/p')
  if [ -z "$rel" ] || ! awk -v r="$rel" 'BEGIN{exit !(r <= 1e-5)}'; then why="${why:+$why; }logits: ${cmp:-none} (limit 1e-5)"; fi
  stats=$(mh_client "$BIN/moerpc-client" stats --cluster "$d/cluster.json" --log warn 2>&1)
  echo "$stats" | grep '^server'
  # Split: every server owns a share, so each must have served. Replicas: today's routing
  # sends each pair to its first owner in the file, so only the servers that are first
  # owners of something are checked (s0 and s1); a client that spreads over replicas
  # passes too.
  for s in s0 s1 $([ $layout = split ] && echo s2); do
    n=$(echo "$stats" | sed -n "s/^server $s .*requests \([0-9]*\),.*/\1/p")
    [ "${n:-0}" -gt 0 ] || why="${why:+$why; }server $s answered no request"
  done
  mh_stop || why="${why:+$why; }a server did not drain and exit 0"
  if [ -z "$why" ]; then nt_pass "$c"; else nt_fail "$c" "$why"; fi
done
nt_done
