#!/usr/bin/env bash
# place_stats.sh - routing statistics end to end (issue #10, docs/DESIGN.md section 13), with
# two real servers on loopback:
#   client_counts_exact          generate --routing-stats: every MoE layer's row sums to
#                                tokens x top_k (tokens from generate's own timing line)
#   deferred_counted             --max-deferred 1: the deferred part is counted once and is
#                                no extra step (same rows and steps as without)
#   server_only_merge            moerpc-place stats without --client = the servers' counts,
#                                equal to the client's when no expert is local; --reset
#   local_experts_counted        --local-experts 2: the client counts the hot slots too, the
#                                servers see exactly the others
#   live_routing_and_client_merge  GET /routing while generating (window kind "steps",
#                                bounded window), moerpc-place stats --client merges it
#   fingerprint_mismatch         a server of another model: an error naming both servers and
#                                both fingerprints
#   from_files                   --from FILE merges --routing-stats files (alone, or with
#                                a cluster, counted like clients); another model's file is
#                                refused naming both fingerprints
#   cluster_local_section        a cluster file whose "local" section covers experts no server
#                                owns: stats opens it (with the local experts) and counts the
#                                servers'; generate counts the local slots
#   bad_client_and_usage         an unreachable --client is a runtime error naming it; bad
#                                flags exit 2
#   reset_output_full_keeps_counts  --reset with -o on a full 16 KiB tmpfs (SKIP with the
#                                reason where it cannot be mounted) and -o /dev/full: exit 1,
#                                the error names a recovery file that holds the servers'
#                                counts exactly (they were reset: a second read is all zero)
set -uo pipefail
cd "$(dirname "$0")/../.."
BIN=${MOERPC_BIN:-$PWD/build/bin}
passed=0; failed=0; skipped=0
# shellcheck source=deploy/local-cluster.sh
. deploy/local-cluster.sh   # first: it sets an EXIT trap of its own, which finish replaces
tmp=$(mktemp -d /tmp/moerpc-pst.XXXXXX)
finish() {
  [ -n "${full:-}" ] && umount "$full" 2>/dev/null
  [ -n "${gen:-}" ] && kill "$gen" 2>/dev/null
  [ -n "${other:-}" ] && kill "$other" 2>/dev/null
  lc_stop >/dev/null 2>&1
  lc__cleanup
  rm -rf "$tmp"
  echo "place_stats: $passed passed, $failed failed, $skipped skipped"
}
trap finish EXIT
ok() { echo "ok   place_stats.$1"; passed=$((passed + 1)); }
bad() { echo "FAIL place_stats.$1: $2"; failed=$((failed + 1)); }
skip() { echo "skip place_stats.$1: $2"; skipped=$((skipped + 1)); }

"$BIN/moerpc-mkmodel" --out "$tmp/m" --seed 1 >/dev/null 2>&1 &&
  "$BIN/moerpc-mkmodel" --out "$tmp/m2" --seed 2 >/dev/null 2>&1 || { bad setup "moerpc-mkmodel failed"; exit 1; }
lc_start "$tmp/c" "$tmp/m" 2 --threads 1 >/dev/null 2>&1 || { bad setup "servers did not start"; exit 1; }
cl=$tmp/c/cluster.json
gen_run() { # out-prefix, extra flags...: generate, keep stdout and stderr
  local o=$1; shift
  "$BIN/moerpc-client" generate --model "$tmp/m" --cluster "$cl" --prompt-ids '1,2,3;4,5' \
      --max-new 6 --threads 1 --quiet "$@" >"$tmp/$o.out" 2>"$tmp/$o.err"
}
# check.py MODE FILES...: the properties, in Python (exact integers).
cat >"$tmp/check.py" <<'PY'
import json, re, sys
mode, args = sys.argv[1], sys.argv[2:]
def load(p): return json.load(open(p))
def tokens_of(out):  # generate's timing line: prefill P tokens ..., decode D tokens ...
    m = re.search(r'prefill (\d+) tokens .* decode (\d+) tokens', open(out).read())
    return int(m[1]) + int(m[2])
K = load(args[0] + '/config.json')['num_experts_per_tok']
def fail(msg): print(msg); sys.exit(1)
if mode == 'exact':            # model, client stats, generate stdout
    s, T = load(args[1]), tokens_of(args[2])
    if s['format'] != 'moerpc-stats' or s['window']['kind'] != 'steps': fail('header: %r' % s['window'])
    if s['window']['tokens'] != T: fail('window.tokens %d, generate says %d' % (s['window']['tokens'], T))
    sums = [sum(r) for r in s['counts']]
    if sums != [T * K] * len(sums): fail('row sums %s, want %d x %d each' % (sums, T, K))
elif mode == 'equal':          # model, a, b: same counts
    a, b = load(args[1]), load(args[2])
    if a['counts'] != b['counts']: fail('counts differ:\n%s\n%s' % (a['counts'], b['counts']))
    if a['model_fingerprint'] != b['model_fingerprint']: fail('fingerprints differ')
elif mode == 'servers':        # model, stats: server-only sources and kind
    s = load(args[1])
    if s['sources'] != ['s0', 's1'] or s['window']['kind'] != 'since_reset': fail('%r %r' % (s['sources'], s['window']))
elif mode == 'zero':           # model, stats: every count 0
    if any(any(r) for r in load(args[1])['counts']): fail('not all zero after --reset')
elif mode == 'local':          # model, client stats, server stats, generate stdout, N hot
    c, s, T, N = load(args[1]), load(args[2]), tokens_of(args[3]), int(args[4])
    E = c['num_experts']
    if [sum(r) for r in c['counts']] != [T * K] * c['num_layers']: fail('client row sums %s' % [sum(r) for r in c['counts']])
    hot_slots = 0
    for l in range(c['num_layers']):
        hot = {(l * N + i) % E for i in range(N)} if N else {0, 1}  # gc_model_local_rule, or 0-1
        for x in range(E):
            want = 0 if x in hot else c['counts'][l][x]
            if s['counts'][l][x] != want: fail('layer %d expert %d: server %d, want %d' % (l, x, s['counts'][l][x], want))
            hot_slots += c['counts'][l][x] if x in hot else 0
    if hot_slots == 0: fail('no slot went to a hot expert: the test shows nothing')
    print('  %d of %d slots on hot experts, counted by the client only' % (hot_slots, T * K * c['num_layers']))
elif mode == 'double':         # model, a, b: b's counts are twice a's
    a, b = load(args[1]), load(args[2])
    if [[2 * v for v in r] for r in a['counts']] != b['counts']: fail('not twice the counts')
    if b['model_fingerprint'] != a['model_fingerprint']: fail('fingerprint lost')
elif mode == 'live':           # model, /routing, merged, window
    r, m, W = load(args[1]), load(args[2]), int(args[3])
    w = r['window']
    if w['kind'] != 'steps' or r['sources'] != ['client']: fail('/routing header %r %r' % (w, r['sources']))
    if not (0 < w['steps'] <= W + W // 16): fail('window steps %d, want 1..%d' % (w['steps'], W + W // 16))
    last = [sum(x) for x in r['counts']][-1]
    if last != w['tokens'] * K: fail('last layer %d slots, want tokens %d x %d' % (last, w['tokens'], K))
    if m['sources'][:1] != ['client'] or 's0' not in m['sources']: fail('merged sources %r' % m['sources'])
    wm = m['window']
    if wm['kind'] != 'steps' or not (0 < wm['steps'] <= W + W // 16): fail('merged window %r' % wm)
    if [sum(x) for x in m['counts']][-1] != wm['tokens'] * K: fail('merged last layer != tokens x k')
    for l, row in enumerate(m['counts']):
        if not (wm['tokens'] * K <= sum(row) <= (wm['tokens'] + 2) * K): fail('merged layer %d: %d slots' % (l, sum(row)))
PY

c=client_counts_exact
if gen_run g1 --routing-stats "$tmp/client1.json" && out=$(python3 "$tmp/check.py" exact "$tmp/m" "$tmp/client1.json" "$tmp/g1.out"); then ok $c
else bad $c "${out:-generate failed: $(tail -n 3 "$tmp/g1.err")}"; fi

c=server_only_merge
if "$BIN/moerpc-place" stats --cluster "$cl" --reset -o "$tmp/srv1.json" 2>"$tmp/p1.err" &&
   grep -q 'no --client: counts are the servers' "$tmp/p1.err" &&
   out=$(python3 "$tmp/check.py" equal "$tmp/m" "$tmp/client1.json" "$tmp/srv1.json") &&
   out=$(python3 "$tmp/check.py" servers "$tmp/m" "$tmp/srv1.json") &&
   "$BIN/moerpc-place" stats --cluster "$cl" >"$tmp/srv0.json" 2>/dev/null &&
   out=$(python3 "$tmp/check.py" zero "$tmp/m" "$tmp/srv0.json"); then ok $c
else bad $c "${out:-moerpc-place stats failed: $(tail -n 3 "$tmp/p1.err")}"; fi

c=local_experts_counted
if gen_run g2 --local-experts 2 --routing-stats "$tmp/client2.json" &&
   "$BIN/moerpc-place" stats --cluster "$cl" --reset -o "$tmp/srv2.json" 2>/dev/null &&
   out=$(python3 "$tmp/check.py" local "$tmp/m" "$tmp/client2.json" "$tmp/srv2.json" "$tmp/g2.out" 2); then
  [ -n "$out" ] && echo "$out"; ok $c
else bad $c "${out:-a run failed: $(tail -n 3 "$tmp/g2.err")}"; fi

c=deferred_counted
if gen_run g4 --max-deferred 1 --routing-stats "$tmp/client4.json" && out=$(python3 "$tmp/check.py" exact "$tmp/m" "$tmp/client4.json" "$tmp/g4.out") &&
   out=$(python3 -c 'import json,sys; a,b=(json.load(open(p))["window"]["steps"] for p in sys.argv[1:]); print("" if a==b else "steps %d with deferral, %d without" % (b, a)); sys.exit(a!=b)' "$tmp/client1.json" "$tmp/client4.json"); then ok $c
else bad $c "${out:-generate failed: $(tail -n 3 "$tmp/g4.err")}"; fi

c=live_routing_and_client_merge
port=$(lc__free_port)
"$BIN/moerpc-client" generate --model "$tmp/m" --cluster "$cl" --prompt-ids 1,2,3 --max-new 3000 \
    --threads 1 --quiet --routing-window 64 --metrics-listen "127.0.0.1:$port" >/dev/null 2>"$tmp/g3.err" &
gen=$!
why=""
for _ in $(seq 1 100); do # until the window is full (64 steps and more)
  python3 - "$port" "$tmp/routing.json" <<'PY' && break
import json, sys, urllib.request
b = urllib.request.urlopen('http://127.0.0.1:%s/routing' % sys.argv[1], timeout=2).read()
open(sys.argv[2], 'wb').write(b)
sys.exit(0 if json.loads(b)['window']['steps'] >= 64 else 1)
PY
  sleep 0.1
done
"$BIN/moerpc-place" stats --cluster "$cl" --client "http://127.0.0.1:$port/routing" -o "$tmp/merged.json" 2>"$tmp/p3.err" ||
  why="moerpc-place stats --client failed: $(tail -n 2 "$tmp/p3.err")"
kill "$gen" 2>/dev/null; wait "$gen" 2>/dev/null; gen=
[ -z "$why" ] && ! grep -q 'counts from 1 client' "$tmp/p3.err" && why="no merge log line: $(cat "$tmp/p3.err")"
[ -z "$why" ] && ! out=$(python3 "$tmp/check.py" live "$tmp/m" "$tmp/routing.json" "$tmp/merged.json" 64) && why=$out
if [ -z "$why" ]; then ok $c; else bad $c "$why"; fi

c=fingerprint_mismatch
p2=$(lc__free_port)
"$BIN/moerpc-server" --model "$tmp/m2" --listen "127.0.0.1:$p2" --experts all --threads 1 >"$tmp/other.log" 2>&1 &
other=$!
for _ in $(seq 1 300); do grep -q serving "$tmp/other.log" && break; sleep 0.1; done
a0=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["servers"][0]["address"])' "$cl")
printf '{"deadline_ms": 5000, "servers": [{"name": "s0", "address": "%s"}, {"name": "other", "address": "127.0.0.1:%s"}]}\n' \
  "$a0" "$p2" >"$tmp/mixed.json"
"$BIN/moerpc-place" stats --cluster "$tmp/mixed.json" >/dev/null 2>"$tmp/p4.err"
rc=$?
fp1=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["model_fingerprint"])' "$tmp/client1.json")
if [ $rc -eq 1 ] && grep -q 'model_fingerprint' "$tmp/p4.err" && grep -q "$fp1" "$tmp/p4.err" &&
   grep -q 'other' "$tmp/p4.err" && grep -q 's0' "$tmp/p4.err"; then ok $c
else bad $c "exit $rc: $(tail -n 2 "$tmp/p4.err")"; fi
kill "$other" 2>/dev/null; wait "$other" 2>/dev/null; other=

c=from_files
why=""
"$BIN/moerpc-place" stats --from "$tmp/client1.json" --from "$tmp/client1.json" -o "$tmp/two.json" 2>"$tmp/p6.err" ||
  why="files only: $(tail -n 1 "$tmp/p6.err")"
[ -z "$why" ] && ! out=$(python3 "$tmp/check.py" double "$tmp/m" "$tmp/client1.json" "$tmp/two.json") && why="files only: $out"
if [ -z "$why" ]; then
  "$BIN/moerpc-place" stats --cluster "$cl" --from "$tmp/client1.json" >"$tmp/cf.json" 2>"$tmp/p7.err" || why="with a cluster: $(tail -n 1 "$tmp/p7.err")"
  [ -z "$why" ] && ! out=$(python3 "$tmp/check.py" equal "$tmp/m" "$tmp/client1.json" "$tmp/cf.json") && why="with a cluster: $out"
fi
if [ -z "$why" ]; then # a file of another model
  python3 -c 'import json,sys; s=json.load(open(sys.argv[1])); s["model_fingerprint"]="0000000000000000"; json.dump(s, open(sys.argv[2],"w"))' \
    "$tmp/client1.json" "$tmp/other.json"
  "$BIN/moerpc-place" stats --cluster "$cl" --from "$tmp/other.json" >/dev/null 2>"$tmp/p8.err"
  rc=$?
  { [ $rc -eq 1 ] && grep -q 0000000000000000 "$tmp/p8.err" && grep -q "$fp1" "$tmp/p8.err"; } || why="other model's file: exit $rc: $(tail -n 1 "$tmp/p8.err")"
fi
if [ -z "$why" ]; then ok $c; else bad $c "$why"; fi

c=cluster_local_section
why=""
p3=$(lc__free_port)
"$BIN/moerpc-server" --model "$tmp/m" --listen "127.0.0.1:$p3" --experts 2-15 --threads 1 >"$tmp/part.log" 2>&1 &
other=$!
for _ in $(seq 1 300); do grep -q serving "$tmp/part.log" && break; sleep 0.1; done
printf '{"model": "%s", "deadline_ms": 10000, "local": {"layers": "all", "experts": "0-1"}, "servers": [{"name": "part", "address": "127.0.0.1:%s"}]}\n' \
  "$tmp/m" "$p3" >"$tmp/local.json"
if gen_run g5 --cluster "$tmp/local.json" --routing-stats "$tmp/client5.json" &&
   "$BIN/moerpc-place" stats --cluster "$tmp/local.json" -o "$tmp/srv5.json" 2>"$tmp/p9.err"; then
  out=$(python3 "$tmp/check.py" local "$tmp/m" "$tmp/client5.json" "$tmp/srv5.json" "$tmp/g5.out" 0 2>&1) || why=$out
else why="a run failed: $(tail -n 2 "$tmp/g5.err" "$tmp/p9.err")"; fi
kill "$other" 2>/dev/null; wait "$other" 2>/dev/null; other=
if [ -z "$why" ]; then ok $c; else bad $c "$why"; fi

c=bad_client_and_usage
why=""
dead=$(lc__free_port)
"$BIN/moerpc-place" stats --cluster "$cl" --client "http://127.0.0.1:$dead" --timeout-ms 2000 >/dev/null 2>"$tmp/p5.err"
rc=$?
{ [ $rc -eq 1 ] && grep -q "127.0.0.1:$dead" "$tmp/p5.err"; } || why="unreachable client: exit $rc: $(tail -n 1 "$tmp/p5.err")"
for args in "" "--cluster" "--cluster $cl --timeout-ms 0" "--cluster $cl extra" "--nope" "--from $tmp/two.json --reset"; do
  # shellcheck disable=SC2086
  "$BIN/moerpc-place" stats $args >/dev/null 2>&1
  rc=$?
  [ $rc -eq 2 ] || why="${why:+$why; }stats $args: exit $rc, want 2"
done
"$BIN/moerpc-place" nope >/dev/null 2>&1; [ $? -eq 2 ] || why="${why:+$why; }unknown command: not exit 2"
"$BIN/moerpc-place" --help | grep -q '^  stats' || why="${why:+$why; }--help does not list stats"
"$BIN/moerpc-place" stats --help | grep -q -- '--client URL' || why="${why:+$why; }stats --help"
if [ -z "$why" ]; then ok $c; else bad $c "$why"; fi

# --reset whose output cannot be written: the counts the servers gave up go to a recovery
# file named in the error. One run per way of failing: TARGET is the -o path.
reset_fail_check() { # label target: "" or why it failed
  local label=$1 target=$2
  gen_run "g-$label" || { echo "generate failed: $(tail -n 2 "$tmp/g-$label.err")"; return; }
  "$BIN/moerpc-place" stats --cluster "$cl" -o "$tmp/before-$label.json" 2>/dev/null ||
    { echo "the read before failed"; return; }
  TMPDIR=$tmp "$BIN/moerpc-place" stats --cluster "$cl" --reset -o "$target" 2>"$tmp/r-$label.err"
  local rc=$? rec
  [ $rc -eq 1 ] || { echo "exit $rc, want 1: $(tail -n 2 "$tmp/r-$label.err")"; return; }
  rec=$(grep -o "saved in $tmp/moerpc-stats-recovery-[^ ]*\.json" "$tmp/r-$label.err" | head -n 1)
  rec=${rec#saved in }
  [ -n "$rec" ] && [ -f "$rec" ] || { echo "no recovery file named: $(tail -n 2 "$tmp/r-$label.err")"; return; }
  python3 "$tmp/check.py" equal "$tmp/m" "$tmp/before-$label.json" "$rec" ||
    { echo "the recovery file $rec does not hold the counts"; return; }
  python3 "$tmp/check.py" servers "$tmp/m" "$rec" || { echo "recovery file header"; return; }
  "$BIN/moerpc-place" stats --cluster "$cl" -o "$tmp/after-$label.json" 2>/dev/null &&
    python3 "$tmp/check.py" zero "$tmp/m" "$tmp/after-$label.json" ||
    { echo "the servers were not reset"; return; }
  # It merges back: --from the recovery file gives the same counts.
  "$BIN/moerpc-place" stats --from "$rec" -o "$tmp/back-$label.json" 2>/dev/null &&
    python3 "$tmp/check.py" equal "$tmp/m" "$rec" "$tmp/back-$label.json" >/dev/null ||
    { echo "--from the recovery file failed"; return; }
  echo "  $label: $(grep -o 'reset [a-z]* counters.*' "$tmp/r-$label.err" | cut -c1-160)" >&2
}

c=reset_output_full_keeps_counts
why=""
full=$tmp/full
mkdir -p "$full"
if ! mount -t tmpfs -o size=16k tmpfs "$full" 2>"$tmp/mount.err"; then
  full=""
  skip ${c}_tmpfs "cannot mount a 16 KiB tmpfs here: $(head -c 200 "$tmp/mount.err") (needs root)"
else
  dd if=/dev/zero of="$full/fill" bs=4k >/dev/null 2>&1 # until the disk is full
  why=$(reset_fail_check tmpfs "$full/out.json")
  [ -z "$why" ] && [ -e "$full/out.json" ] && why="a partial output was left"
  [ -z "$why" ] && ls "$full" | grep -q '\.tmp\.' && why="a temporary file was left: $(ls "$full")"
  umount "$full"; full=""
  if [ -z "$why" ]; then ok ${c}_tmpfs; else bad ${c}_tmpfs "$why"; fi
fi
why=$(reset_fail_check devfull /dev/full)
if [ -z "$why" ]; then ok ${c}_dev_full; else bad ${c}_dev_full "$why"; fi

[ $failed -eq 0 ]
