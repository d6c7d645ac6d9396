#!/usr/bin/env python3
"""sglang_dump.py - SGLang's expert-distribution dump <-> moerpc-stats (placement/README.md).

  sglang_dump.py DUMP.pt -o stats.json [--fingerprint FP]
  sglang_dump.py --reverse stats.json -o init.pt|init.json

What SGLang writes (python/sglang/srt/eplb/expert_distribution.py, as read for this tool):
  * --expert-distribution-recorder-mode stat (the default recorder): on
    /dump_expert_distribution_record, rank 0 writes
    $SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR/expert_distribution_recorder_<time>.pt with
    torch.save of a dict {"rank": int, "logical_count": int tensor [B, L, E],
    "average_utilization_rate_over_window": float or None}: B buffered forward passes
    (a circular buffer, rows of zeros where unused), L the model's layers (dense ones are
    rows of zeros), E its logical (routed) experts; counts are tokens per (layer, expert),
    all-reduced over the ranks.
  * mode per_token: {"records": [{..., "global_physical_count": [L, P]}, ...],
    "last_physical_to_logical_map": [L, P]} - physical slots, mapped back to logical
    experts here with that map.
  * --init-expert-location reads (expert_location.py) "trivial", a .pt (torch.load,
    weights_only=True) or .json file, or inline JSON, holding a dict with either
    "physical_to_logical_map" [L, P] or "logical_count" [L, E] or [B, L, E] (then EPLB
    plans from it). So the stat dump is itself an --init-expert-location file, and --reverse
    writes {"logical_count": [L, E]} (JSON, or a .pt of an int64 tensor [1, L, E]). The
    sglang-kt fork (kt-kernel's) reads the same argument through the same loader.

Output: moerpc-stats version 1 with window kind "import", steps = the forward passes with any
count (B minus the unused rows), tokens 0 (SGLang does not record them), sources
["sglang"], counts = logical_count summed over B. Limits as the C reader's (pl.h): layers
1..1024, experts 1..65536, at most 2^22 pairs, integers 0..2^53. Exit status 0 ok, 1 a bad
input (named, with the field and the limit), 2 usage.
"""
import argparse
import json
import os
import sys

MAX_LAYERS, MAX_EXPERTS, MAX_PAIRS, MAX_COUNT = 1024, 65536, 1 << 22, 1 << 53


class BadInput(Exception):
    pass


def _torch():
    try:
        import torch
    except ImportError as e:  # the converter needs torch only for .pt files
        raise BadInput("reading or writing a .pt file needs torch (%s)" % e)
    return torch


def _matrix(rows, what):
    """A list of L lists of E non-negative integers, checked against the limits."""
    if not isinstance(rows, list) or not rows:
        raise BadInput("%s: must be a non-empty [L][E] array of integers" % what)
    L, E = len(rows), len(rows[0]) if isinstance(rows[0], list) else -1
    if not 1 <= L <= MAX_LAYERS:
        raise BadInput("%s: %d layers, must be 1..%d" % (what, L, MAX_LAYERS))
    if not 1 <= E <= MAX_EXPERTS:
        raise BadInput("%s: %d experts, must be 1..%d" % (what, E, MAX_EXPERTS))
    if L * E > MAX_PAIRS:
        raise BadInput("%s: %d x %d = %d pairs, at most %d" % (what, L, E, L * E, MAX_PAIRS))
    for l, r in enumerate(rows):
        if not isinstance(r, list) or len(r) != E:
            raise BadInput("%s[%d]: must have %d numbers (as row 0)" % (what, l, E))
        for x, v in enumerate(r):
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_COUNT:
                raise BadInput("%s[%d][%d] = %r, must be an integer in 0..%d" % (what, l, x, v, MAX_COUNT))
    return rows


def read_dump(path):
    """(counts [L][E], forward passes with any count) from an SGLang dump (.pt or .json)."""
    if path.endswith(".json"):
        try:
            d = json.load(open(path))
        except (OSError, ValueError) as e:
            raise BadInput("%s: %s" % (path, e))
    else:
        torch = _torch()
        try:
            d = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # a corrupt or foreign file: say so, do not trace back
            raise BadInput("%s: not a torch file SGLang wrote (%s)" % (path, str(e).splitlines()[0][:200]))
    if not isinstance(d, dict):
        raise BadInput("%s: top level is %s, must be a dict with \"logical_count\" or \"records\"" % (path, type(d).__name__))
    if "logical_count" in d:
        lc = d["logical_count"]
        if hasattr(lc, "tolist"):
            if lc.is_floating_point() or lc.is_complex():
                raise BadInput("%s: logical_count has dtype %s, must be an integer tensor" % (path, lc.dtype))
            lc = lc.tolist()
        if isinstance(lc, list) and lc and isinstance(lc[0], list) and lc[0] and not isinstance(lc[0][0], list):
            lc = [lc]  # [L, E], as --init-expert-location also takes
        if not isinstance(lc, list) or not lc:
            raise BadInput("%s: logical_count must be [B, L, E] or [L, E]" % path)
        steps = 0
        total = None
        for b, m in enumerate(lc):
            m = _matrix(m, "%s: logical_count[%d]" % (path, b))
            if total is None:
                total = [[0] * len(m[0]) for _ in m]
            if len(m) != len(total) or len(m[0]) != len(total[0]):
                raise BadInput("%s: logical_count[%d] is %d x %d, logical_count[0] %d x %d" % (path, b, len(m), len(m[0]), len(total), len(total[0])))
            steps += any(any(r) for r in m)
            for l, r in enumerate(m):
                t = total[l]
                for x, v in enumerate(r):
                    t[x] += v
        return _matrix(total, "%s: logical_count summed over B" % path), steps
    if "records" in d and "last_physical_to_logical_map" in d:
        torch = _torch()
        p2l = d["last_physical_to_logical_map"]
        p2l = p2l.tolist() if hasattr(p2l, "tolist") else p2l
        if not isinstance(p2l, list) or not p2l or not isinstance(p2l[0], list):
            raise BadInput("%s: last_physical_to_logical_map must be [L, P]" % path)
        L, P = len(p2l), len(p2l[0])
        for l, r in enumerate(p2l):
            if not isinstance(r, list) or len(r) != P or any(isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < MAX_EXPERTS for v in r):
                raise BadInput("%s: last_physical_to_logical_map[%d]: must be %d expert ids in 0..%d" % (path, l, P, MAX_EXPERTS - 1))
        E = 1 + max(max(r) for r in p2l)
        total = [[0] * E for _ in range(L)]
        steps = 0
        for i, rec in enumerate(d["records"]):
            g = rec.get("global_physical_count") if isinstance(rec, dict) else None
            if g is None:
                raise BadInput("%s: records[%d] has no global_physical_count" % (path, i))
            g = g.tolist() if isinstance(g, torch.Tensor) else g
            if len(g) != L or any(len(r) != P for r in g):
                raise BadInput("%s: records[%d].global_physical_count is not %d x %d" % (path, i, L, P))
            steps += 1
            for l in range(L):
                for p in range(P):
                    total[l][p2l[l][p]] += int(g[l][p])
        return _matrix(total, "%s: records summed" % path), steps
    raise BadInput("%s: keys %s: neither \"logical_count\" (stat mode) nor \"records\" (per_token mode)" % (path, sorted(d)[:8]))


def write_atomic(path, data, binary=False):
    tmp = "%s.tmp.%d" % (path, os.getpid())
    with open(tmp, "wb" if binary else "w") as f:
        f.write(data)
    os.replace(tmp, path)


def stats_text(counts, steps, fingerprint):
    """moerpc-stats v1 in the C writer's layout (placement/pl_stats.c)."""
    rows = ",\n".join("  [" + ",".join(str(v) for v in r) + "]" for r in counts)
    return ('{"format": "moerpc-stats", "version": 1,\n "model_fingerprint": %s, "num_layers": %d, '
            '"num_experts": %d,\n "window": {"kind": "import", "steps": %d, "tokens": 0, "seconds": 0},\n'
            ' "sources": ["sglang"],\n "counts": [\n%s]}\n'
            % (json.dumps(fingerprint), len(counts), len(counts[0]), steps, rows))


def read_stats(path):
    try:
        s = json.load(open(path))
    except (OSError, ValueError) as e:
        raise BadInput("%s: %s" % (path, e))
    if not isinstance(s, dict) or s.get("format") != "moerpc-stats" or s.get("version") != 1:
        raise BadInput("%s: format must be \"moerpc-stats\" version 1" % path)
    counts = _matrix(s.get("counts"), "%s: counts" % path)
    if len(counts) != s.get("num_layers") or len(counts[0]) != s.get("num_experts"):
        raise BadInput("%s: counts is %d x %d, num_layers x num_experts say %r x %r" % (path, len(counts), len(counts[0]), s.get("num_layers"), s.get("num_experts")))
    return counts


def main(argv):
    ap = argparse.ArgumentParser(prog="sglang_dump.py", description=__doc__.split("\n")[0],
                                 epilog="See the module text (head of this file) for the formats.")
    ap.add_argument("input", help="an SGLang dump (.pt, or .json); with --reverse a moerpc-stats file")
    ap.add_argument("-o", "--output", required=True, help="where to write (atomically)")
    ap.add_argument("--fingerprint", default="", help="model_fingerprint to record (default \"\": unknown)")
    ap.add_argument("--reverse", action="store_true",
                    help="moerpc-stats -> an --init-expert-location file (.pt or .json by -o's suffix)")
    a = ap.parse_args(argv)
    try:
        if len(a.fingerprint) > 63:
            raise BadInput("--fingerprint has %d characters, at most 63" % len(a.fingerprint))
        if a.reverse:
            counts = read_stats(a.input)
            if a.output.endswith(".pt"):
                torch = _torch()
                import io
                buf = io.BytesIO()
                torch.save({"logical_count": torch.tensor([counts], dtype=torch.int64)}, buf)
                write_atomic(a.output, buf.getvalue(), binary=True)
            else:
                write_atomic(a.output, json.dumps({"logical_count": counts}) + "\n")
            print("sglang_dump: wrote %s (%d layers x %d experts, logical_count for "
                  "--init-expert-location)" % (a.output, len(counts), len(counts[0])), file=sys.stderr)
        else:
            counts, steps = read_dump(a.input)
            write_atomic(a.output, stats_text(counts, steps, a.fingerprint))
            print("sglang_dump: wrote %s (%d layers x %d experts, %d slots over %d forward passes)"
                  % (a.output, len(counts), len(counts[0]), sum(map(sum, counts)), steps), file=sys.stderr)
    except BadInput as e:
        print("sglang_dump: %s" % e, file=sys.stderr)
        return 1
    except OSError as e:
        print("sglang_dump: %s" % e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
