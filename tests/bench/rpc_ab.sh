#!/usr/bin/env bash
# rpc_ab.sh - A/B of the transport between two builds, interleaved in one run:
#   tests/bench/rpc_ab.sh OLD_REPO NEW_REPO [ROUNDS]
# Each repo must be built (make all). For every round and build: one server of that build
# (deploy/local-cluster.sh) on the default demo model, `moerpc-client bench-rpc --iters 2000
# --json`; prints, per T, the median over rounds of gRPC p50, TCP p50 and grpc - compute p50.
# Timings on shared VMs drift +-30 % between runs: compare builds only within one run.
set -euo pipefail
old=$(cd "$1" && pwd); new=$(cd "$2" && pwd); rounds=${3:-4}
dir=$(mktemp -d /tmp/moerpc-rpc-ab.XXXXXX)
trap 'rm -rf "$dir"' EXIT
"$new/build/bin/moerpc-mkmodel" --out "$dir/model" --seed 1 >/dev/null 2>&1
for round in $(seq 1 "$rounds"); do
  for ver in old new; do
    repo=$old; [ "$ver" = new ] && repo=$new
    (
      cd "$repo"
      BIN=$repo/build/bin
      # local-cluster.sh keeps an EXIT trap it finds and runs it when this subshell ends:
      # the parent's would delete the run's directory (the model) after the first server.
      trap - EXIT
      . deploy/local-cluster.sh
      lc_start "$dir/$ver$round" "$dir/model" 1 >/dev/null 2>&1
      "$BIN/moerpc-client" bench-rpc --cluster "$dir/$ver$round/cluster.json" --iters 2000 \
          --json 2>/dev/null | sed "s/^/$ver $round /" >>"$dir/out.txt"
      lc_stop >/dev/null 2>&1
    )
  done
done
python3 - "$dir/out.txt" <<'PY'
import statistics as st, sys
rows = {}
for line in open(sys.argv[1]):
    f = line.split()
    if len(f) < 13 or not f[2].isdigit():
        continue
    rows.setdefault((f[0], int(f[2])), []).append((float(f[5]), float(f[8]), float(f[12])))
for (ver, T), v in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0] != "old")):
    print('{"build": "%s", "T": %d, "rounds": %d, "grpc_p50_us": %.1f, "tcp_p50_us": %.1f, '
          '"grpc_minus_compute_p50_us": %.1f}' % (ver, T, len(v), st.median(x[0] for x in v),
          st.median(x[1] for x in v), st.median(x[2] for x in v)))
PY
