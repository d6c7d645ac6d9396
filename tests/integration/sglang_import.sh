#!/usr/bin/env bash
# sglang_import.sh - placement/sglang_dump.py on files saved the way SGLang saves them
# (torch.save of the recorder's dict, python/sglang/srt/eplb/expert_distribution.py), with
# the torch of .venv-conf (a SKIP naming it when it is missing):
#   stat_dump            {"rank", "logical_count" [B, L, E] int32, "average_utilization_..."}
#                        -> moerpc-stats: counts summed over B, steps = non-empty rows, kind
#                        "import"; read back by the C reader (moerpc-place stats --from)
#   per_token_dump       {"records": [{"global_physical_count" [L, P]}], "last_physical_to_
#                        logical_map" [L, P]}: physical slots mapped to logical experts
#   reverse              moerpc-stats -> --init-expert-location .pt (torch.load weights_only)
#                        and .json, both {"logical_count"}
#   bad_inputs           float counts, a non-dict, a foreign file, negative counts, unknown
#                        keys: exit 1 naming the file and the field
set -uo pipefail
cd "$(dirname "$0")/../.."
BIN=${MOERPC_BIN:-$PWD/build/bin}
VENV=${MOERPC_CONF_VENV:-.venv-conf}
PY=$VENV/bin/python
passed=0; failed=0; skipped=0
if [ -n "${SANITIZER:-}" ]; then # pure Python: no C code of ours runs here
  echo "skip sglang_import.all: SANITIZER=$SANITIZER: the converter is Python only (run in the plain make test)"
  echo "sglang_import: 0 passed, 0 failed, 1 skipped"; exit 0
fi
tmp=$(mktemp -d /tmp/moerpc-sgl.XXXXXX)
trap 'rm -rf "$tmp"; echo "sglang_import: $passed passed, $failed failed, $skipped skipped"' EXIT
ok() { echo "ok   sglang_import.$1"; passed=$((passed + 1)); }
bad() { echo "FAIL sglang_import.$1: $2"; failed=$((failed + 1)); }
if ! [ -x "$PY" ] || ! "$PY" -c 'import torch' 2>/dev/null; then
  for c in stat_dump per_token_dump reverse bad_inputs; do
    echo "skip sglang_import.$c: no torch in $VENV (deploy/py-env.sh makes it; MOERPC_CONF_VENV=DIR)"
  done
  skipped=4; exit 0
fi
CONV=placement/sglang_dump.py

# The dumps, saved as SGLang's _dump_to_file does: torch.save(dict, path).
"$PY" - "$tmp" <<'PY'
import sys, torch
d = sys.argv[1]
g = torch.Generator().manual_seed(7)
lc = torch.randint(0, 50, (3, 4, 16), generator=g, dtype=torch.int32)
lc[0, 0] = 0                         # a dense layer: a row of zeros in every pass
lc[1] = 0                            # an unused slot of the circular buffer
torch.save(dict(rank=0, logical_count=lc, average_utilization_rate_over_window=None),
           d + "/expert_distribution_recorder_1733000000.0.pt")
torch.save(lc.sum(0).tolist(), d + "/want_stat.pt")
# per_token: 18 physical slots of 16 logical experts (2 redundant: physical 16 -> 3, 17 -> 9)
p2l = torch.tensor([list(range(16)) + [3, 9]] * 4)
recs = [dict(forward_pass_id=i, rank=0, gatherer_key="primary",
             global_physical_count=torch.randint(0, 9, (4, 18), generator=g)) for i in range(5)]
torch.save(dict(records=recs, last_physical_to_logical_map=p2l),
           d + "/expert_distribution_recorder_1733000001.0_0.pt")
want = torch.zeros(4, 16, dtype=torch.int64)
for r in recs:
    want.scatter_add_(1, p2l, r["global_physical_count"].long())
torch.save(want.tolist(), d + "/want_tok.pt")
torch.save(dict(rank=0, logical_count=lc.float()), d + "/bad_float.pt")
torch.save([1, 2, 3], d + "/bad_list.pt")
torch.save(dict(rank=0, logical_count=lc - 100), d + "/bad_negative.pt")
torch.save(dict(rank=0, counts=lc), d + "/bad_keys.pt")
open(d + "/bad_foreign.pt", "wb").write(b"not a torch file at all")
PY

c=stat_dump
why=""
"$PY" $CONV "$tmp/expert_distribution_recorder_1733000000.0.pt" --fingerprint 82b588760883d3dc -o "$tmp/stat.json" 2>"$tmp/c1.err" ||
  why="convert: $(cat "$tmp/c1.err")"
if [ -z "$why" ]; then
  why=$("$PY" - "$tmp" <<'PY'
import json, sys, torch
d = sys.argv[1]
s, want = json.load(open(d + "/stat.json")), torch.load(d + "/want_stat.pt")
w = s["window"]
if s["counts"] != want: print("counts are not logical_count summed over B")
elif (w["kind"], w["steps"], s["num_layers"], s["num_experts"]) != ("import", 2, 4, 16): print("header %r" % s)
elif s["model_fingerprint"] != "82b588760883d3dc" or s["sources"] != ["sglang"]: print("fingerprint/sources %r" % s)
PY
)
fi
# The C reader takes it (and merges it like a client's file).
[ -z "$why" ] && { "$BIN/moerpc-place" stats --from "$tmp/stat.json" -o "$tmp/stat2.json" 2>"$tmp/c1b.err" || why="C reader: $(cat "$tmp/c1b.err")"; }
[ -z "$why" ] && ! cmp -s "$tmp/stat.json" "$tmp/stat2.json" && ! python3 -c 'import json,sys; a,b=(json.load(open(p)) for p in sys.argv[1:]); sys.exit(a["counts"]!=b["counts"])' "$tmp/stat.json" "$tmp/stat2.json" && why="C round trip changed the counts"
if [ -z "$why" ]; then ok $c; else bad $c "$why"; fi

c=per_token_dump
why=""
"$PY" $CONV "$tmp/expert_distribution_recorder_1733000001.0_0.pt" -o "$tmp/tok.json" 2>"$tmp/c2.err" || why="convert: $(cat "$tmp/c2.err")"
[ -z "$why" ] && why=$("$PY" -c '
import json, sys, torch
s, want = json.load(open(sys.argv[1])), torch.load(sys.argv[2])
if s["counts"] != want or s["window"]["steps"] != 5 or s["model_fingerprint"] != "": print("per_token: %r" % s["window"])
' "$tmp/tok.json" "$tmp/want_tok.pt")
[ -z "$why" ] && { "$BIN/moerpc-place" stats --from "$tmp/tok.json" >/dev/null 2>"$tmp/c2b.err" || why="C reader: $(cat "$tmp/c2b.err")"; }
if [ -z "$why" ]; then ok $c; else bad $c "$why"; fi

c=reverse
why=""
"$PY" $CONV --reverse "$tmp/stat.json" -o "$tmp/init.pt" 2>"$tmp/c3.err" &&
  "$PY" $CONV --reverse "$tmp/stat.json" -o "$tmp/init.json" 2>>"$tmp/c3.err" || why="convert: $(cat "$tmp/c3.err")"
[ -z "$why" ] && why=$("$PY" -c '
import json, sys, torch
d = sys.argv[1]
want = torch.load(d + "/want_stat.pt")
p = torch.load(d + "/init.pt", weights_only=True)   # as --init-expert-location loads it
j = json.load(open(d + "/init.json"))
if sorted(p) != ["logical_count"] or p["logical_count"].shape != (1, 4, 16) or p["logical_count"][0].tolist() != want: print("init.pt %r" % p)
elif j != {"logical_count": want}: print("init.json")
' "$tmp")
# And back again: the .pt is itself a stat dump.
[ -z "$why" ] && { "$PY" $CONV "$tmp/init.pt" -o "$tmp/again.json" 2>/dev/null &&
  python3 -c 'import json,sys; a,b=(json.load(open(p)) for p in sys.argv[1:]); sys.exit(a["counts"]!=b["counts"])' "$tmp/stat.json" "$tmp/again.json" || why="init.pt -> stats lost counts"; }
if [ -z "$why" ]; then ok $c; else bad $c "$why"; fi

c=bad_inputs
why=""
for f in bad_float:dtype bad_list:"top level is list" bad_negative:"must be an integer in 0.." bad_keys:"neither" bad_foreign:"not a torch file"; do
  n=${f%%:*}; want=${f#*:}
  "$PY" $CONV "$tmp/$n.pt" -o "$tmp/x.json" 2>"$tmp/b.err"
  rc=$?
  { [ $rc -eq 1 ] && grep -q "$n.pt" "$tmp/b.err" && grep -q -- "$want" "$tmp/b.err"; } || why="${why:+$why; }$n: exit $rc: $(head -c 300 "$tmp/b.err")"
done
[ -e "$tmp/x.json" ] && why="${why:+$why; }a refused input left an output file"
"$PY" $CONV --reverse "$tmp/want_stat.pt" -o "$tmp/x.json" 2>"$tmp/b.err"; [ $? -eq 1 ] || why="${why:+$why; }--reverse of a non-stats file: not exit 1"
"$PY" $CONV "$tmp/stat.json" 2>/dev/null; [ $? -eq 2 ] || why="${why:+$why; }no -o: not exit 2"
if [ -z "$why" ]; then ok $c; else bad $c "$why"; fi
[ $failed -eq 0 ]
