#!/usr/bin/env bash
# tests/bench/load_ab.sh - two moerpc-server builds' loading time on the same files, in the
# same run, rounds alternating (docs/DESIGN.md section 6.6): for a change to the loader,
# the build before it against the build after it, next to a plain read of the files.
#
#   tests/bench/load_ab.sh OLD_BIN_DIR [NEW_BIN_DIR] [ROUNDS]   # NEW default build/bin, 5 rounds
#   FORMATS="bf16 int8 int4" THREADS=2 MODEL=DIR tests/bench/load_ab.sh /tmp/old/build/bin
#
# FORMATS: bf16 (the stored format, fp8 for an FP8 checkpoint), int8, int4 (--quant) for
# the server; client, client-map (--map-weights), client-bf16 (--dense-format bf16) for
# moerpc-client's load of the whole model (dense layers and every expert local: `bench`,
# its "model: loaded ... took S s"), e.g. on the DeepSeek-V3-shaped FP8 model:
#   MODEL=build/bench/deepseek-v3-3l-fp8-e64 FORMATS="client client-map client-bf16" ...
#
# An old build: git worktree add /tmp/old REV && make -C /tmp/old build/bin/moerpc-server.
# Each round: `cat` of the files (the plain read), then for each format and build an
# untimed load and a timed one (the timed load then gets memory a process just gave back;
# see "Reused memory" in load_speed.sh). Timed: the server's "loading: done ... in S s".
# The files' pages are dropped and read once first (as load_speed.sh: a read from disk
# leaves large folios). Prints one JSON line per timed load, then per (format, build) the
# median and the fastest seconds, GB/s of the files and the ratio to the read (median to
# median, fastest to fastest), and per format new / old both ways. Both, because on a VM
# whose host takes back memory a process gave up, some loads pay for new memory again
# (2-4x slower at random): the fastest is then the loader's own cost, the median what a
# restart met that hour.
set -euo pipefail
OLD=${1:?usage: load_ab.sh OLD_BIN_DIR [NEW_BIN_DIR] [ROUNDS]}
NEW=${2:-build/bin}
ROUNDS=${3:-5}
THREADS=${THREADS:-2}
FORMATS=${FORMATS:-bf16 int8 int4}
MODEL=${MODEL:-build/bench/qwen3-30b-a3b-l2}
for b in "$OLD" "$NEW"; do
  [ -x "$b/moerpc-server" ] && [ -x "$b/moerpc-client" ] ||
    { echo "load_ab: no $b/moerpc-server or moerpc-client" >&2; exit 2; }
done
[ -f "$MODEL/config.json" ] || { echo "load_ab: no model at $MODEL (tests/bench/load_speed.sh makes it)" >&2; exit 2; }
DIR=$(mktemp -d)
spid=
cleanup() { [ -n "$spid" ] && kill -9 "$spid" 2>/dev/null; rm -rf "$DIR"; }
trap cleanup EXIT
CPU=$(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //')
DATE=$(date -u +%Y-%m-%dT%H:%MZ)
now() { date +%s.%N; }

load_s() { # bin_dir format: seconds of the load
  local extra=()
  case $2 in
    client*)
      case $2 in client-map) extra=(--map-weights) ;; client-bf16) extra=(--dense-format bf16) ;; esac
      "$1/moerpc-client" bench --model "$MODEL" --threads "$THREADS" --decode 1 --prompt-len 2 \
          --repeats 1 "${extra[@]}" >"$DIR/client.log" 2>&1 ||
        { echo "load_ab: client failed" >&2; tail -5 "$DIR/client.log" >&2; exit 1; }
      sed -n 's/.*model: loaded .* took \([0-9.]*\) s.*/\1/p' "$DIR/client.log" | tail -1
      return ;;
  esac
  [ "$2" = bf16 ] || extra=(--quant "$2")
  "$1/moerpc-server" --model "$MODEL" --listen 127.0.0.1:0 --experts all --threads "$THREADS" \
      "${extra[@]}" >"$DIR/server.log" 2>&1 &
  spid=$!
  until grep -q 'loading: done' "$DIR/server.log" 2>/dev/null; do
    kill -0 "$spid" 2>/dev/null || { echo "load_ab: server died" >&2; tail -5 "$DIR/server.log" >&2; exit 1; }
    sleep 0.01
  done
  kill -TERM "$spid"; wait "$spid" || true; spid=
  sed -n 's/.*loading: done, .* GB in \([0-9.]*\) s.*/\1/p' "$DIR/server.log" | tail -1
}

echo "load_ab: $MODEL, old $OLD, new $NEW, $ROUNDS rounds, --threads $THREADS, $CPU" >&2
for f in "$MODEL"/*.safetensors; do dd if="$f" iflag=nocache count=0 status=none; done
cat "$MODEL"/*.safetensors >/dev/null
GB=$(du -cb "$MODEL"/*.safetensors | tail -1 | awk '{printf "%.3f", $1 / 1e9}')
: >"$DIR/runs"
for round in $(seq 1 "$ROUNDS"); do
  echo "load_ab: round $round/$ROUNDS" >&2
  t0=$(now); cat "$MODEL"/*.safetensors >/dev/null; t1=$(now)
  echo "read - $(echo "$t0 $t1" | awk '{printf "%.4f", $2 - $1}')" >>"$DIR/runs"
  for fmt in $FORMATS; do
    for build in old new; do
      bin=$OLD; [ $build = new ] && bin=$NEW
      load_s "$bin" "$fmt" >/dev/null
      echo "$fmt $build $(load_s "$bin" "$fmt")" >>"$DIR/runs"
    done
  done
done
awk -v gb="$GB" -v cpu="$CPU" -v date="$DATE" -v th="$THREADS" '
  { printf "{\"bench\":\"load_ab\",\"format\":\"%s\",\"build\":\"%s\",\"seconds\":%s,\"threads\":%s,\"cpu\":\"%s\",\"date\":\"%s\"}\n", $1, $2, $3, th, cpu, date }' "$DIR/runs"
python3 - "$DIR/runs" "$GB" "$CPU" "$DATE" "$THREADS" <<'EOF'
import collections, json, statistics, sys
runs, gb, cpu, date, th = sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
t = collections.defaultdict(list)
for line in open(runs):
    f, b, s = line.split()
    t[(f, b)].append(float(s))
read = statistics.median(t[("read", "-")])
read_min = min(t[("read", "-")])
print(json.dumps({"bench": "load_ab", "what": "read", "gb": gb, "median_s": round(read, 4),
                  "min_s": round(read_min, 4), "gbps": round(gb / read, 2), "cpu": cpu, "date": date}))
for f in dict.fromkeys(k[0] for k in t if k[0] != "read"):
    med = {b: statistics.median(t[(f, b)]) for b in ("old", "new")}
    low = {b: min(t[(f, b)]) for b in ("old", "new")}
    for b in ("old", "new"):
        print(json.dumps({"bench": "load_ab", "format": f, "build": b, "median_s": round(med[b], 3),
                          "min_s": low[b], "gbps": round(gb / med[b], 2),
                          "ratio_to_read": round(read / med[b], 3),
                          "ratio_to_read_min": round(read_min / low[b], 3), "runs": len(t[(f, b)]),
                          "threads": th, "cpu": cpu, "date": date}))
    print(json.dumps({"bench": "load_ab", "format": f, "speedup_median": round(med["old"] / med["new"], 2),
                      "speedup_min": round(low["old"] / low["new"], 2), "cpu": cpu, "date": date}))
EOF
