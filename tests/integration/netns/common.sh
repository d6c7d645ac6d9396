#!/usr/bin/env bash
# tests/integration/netns/common.sh - sourced by tests/integration/netns_*.sh: the
# multi-host tests on hosts made of network namespaces (deploy/netns/). Not a test itself
# (tests/run.sh runs tests/integration/*.sh only).
#
#   nt_init NAME          sources deploy/netns/{netns,cluster}.sh, makes the test model in a
#                         temp dir ($NT_TMP/model); if namespaces cannot be made here, every
#                         case of the script is reported skipped with the reason (nt_done)
#   nt_pass CASE | nt_fail CASE WHY | nt_skip CASE WHY    one verdict per case
#   nt_done               the "NAME: N passed, N failed, N skipped" line; exits 0 unless a
#                         case failed
#   nt_local_tokens PROMPT N    greedy tokens of the all-local runner (reference kernels)
#   nt_tokens FILE        the ids of a `generate --json` output, sequences joined by ';'
# Every client and server runs on the reference kernels (MOERPC_ISA=ref) with an fp32
# wire, so distributed and all-local results may be compared at 1e-5.
set -u
NT_SRC=${MOERPC_SRC:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)}
BIN=${MOERPC_BIN:-$NT_SRC/build/bin}
# shellcheck disable=SC2034
NT_GEN=${MOERPC_BUILD:-$NT_SRC/build}/tests/netns_gen   # the long-lived client
NT_SHAPE="--layers 4 --experts 8 --topk 4 --hidden 64 --inter 32 --vocab 96 --heads 4 --kv-heads 2 --head-dim 16"
export MOERPC_ISA=ref
# shellcheck disable=SC2034 # read by the scripts that source this
NT_NAME='' NT_TMP='' NT_CAN=1 NT_WHY=''
nt_passed=0; nt_failed=0; nt_skipped=0

nt_pass() { echo "ok   $NT_NAME.$1"; nt_passed=$((nt_passed + 1)); }
nt_fail() { echo "FAIL $NT_NAME.$1: $2"; nt_failed=$((nt_failed + 1)); }
nt_skip() { echo "skip $NT_NAME.$1: $2"; nt_skipped=$((nt_skipped + 1)); }
nt_done() {
  echo "$NT_NAME: $nt_passed passed, $nt_failed failed, $nt_skipped skipped"
  [ -n "$NT_TMP" ] && [ "${NT_KEEP:-0}" != 1 ] && rm -rf "$NT_TMP"
  [ "$nt_failed" -eq 0 ]
  exit $?
}

nt_init() {
  NT_NAME=$1
  # shellcheck source=deploy/netns/netns.sh
  . "$NT_SRC/deploy/netns/netns.sh"
  # shellcheck source=deploy/netns/cluster.sh
  . "$NT_SRC/deploy/netns/cluster.sh"
  if ! nn_check; then
    # shellcheck disable=SC2034
    NT_CAN=0
    # shellcheck disable=SC2034
    NT_WHY="cannot create network namespaces here: $NN_WHY"
    return 0
  fi
  NT_TMP=$(mktemp -d "${TMPDIR:-/tmp}/netns-test.XXXXXX")
  # shellcheck disable=SC2086 # NT_SHAPE is a list of flags
  "$BIN/moerpc-mkmodel" --out "$NT_TMP/model" $NT_SHAPE --seed 21 >/dev/null 2>&1 || {
    echo "FAIL: moerpc-mkmodel"; exit 1; }
  echo "latency and loss by: $(nn_netem_available && echo "netem" || echo "moerpc-relay (no netem in this kernel)")"
}

nt_tokens() {
  python3 -c '
import json, sys
seqs = [json.loads(l)["ids"] for l in open(sys.argv[1]) if l.startswith("{\"seq\"")]
print(";".join(",".join(map(str, s)) for s in seqs))' "$1"
}

nt_local_tokens() {
  "$BIN/moerpc-client" generate --model "$NT_TMP/model" --prompt-ids "$1" --max-new "$2" \
      --threads 1 --json --quiet --log warn >"$NT_TMP/local.jsonl" || return 1
  nt_tokens "$NT_TMP/local.jsonl"
}
