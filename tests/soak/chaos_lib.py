#!/usr/bin/env python3
"""tests/soak/chaos_lib.py - the chaos soak's helpers (tests/soak/chaos.sh). Standard
library only. Subcommands:

  plan --out F --layers L --experts E --servers N (--initial | --seed S)
      A placement file with two copies of every (layer, expert) pair on the servers
      s0..s<N-1>. --initial: the layout of deploy/netns/cluster.sh "replicas" (server j holds
      shares j and j + 1 mod N, every layer alike); --seed: per layer, each expert on two
      distinct servers drawn at random, no server holding more than twice its share.
  spec --server J PLAN...
      The experts server sJ holds in any layer of any PLAN, as moerpc-server --experts
      wants them ("0-3,7"): a server restarted after applies comes back with every pair it
      may have held (the union over layers and plans: --experts is one set for every
      layer, and the client refuses a returning server that no longer announces a pair its
      last Hello did; chaos.sh passes every plan since the start).
  schedule --seed S --servers N --kinds K1,K2,... [--count C]
      The seeded event schedule, one event a line: "GAP KIND ARGS..." (GAP: seconds of calm
      before it). Kinds come in rounds, each a shuffled permutation of --kinds, so that
      every kind happens in each round:
        kill9 J DOWN      SIGKILL of sJ, DOWN s away, started again
        term J DOWN       SIGTERM of sJ under traffic (it drains), DOWN s away, started again
        apply SEED        moerpc-place apply of `plan --seed SEED`
        flap J MODE HOLD A B   sJ's link changed for HOLD s, then back: MODE rate (A =
                          tbf rate, B unused) or lossy (A = one-way delay us per link
                          direction, B = loss per direction)
  sample --url URL --out F --stop-file S [--interval T]
      Scrapes URL/metrics and URL/placement every T s (0.5) until S exists, and once more
      then (the final counts); one JSON line a scrape (serve's steps and failed steps,
      requests, the client's step histogram and per-server counters, the placement
      generation).
  rss --out F --name NAME -- CMD...
      Runs CMD, then appends its peak RSS (the children's ru_maxrss) to F as an rss.jsonl
      line; exits with CMD's status (for the short-lived moerpc-place apply).
  report --dir D --seed S --seconds N --kinds K --replay CMD
      Reads D/{samples,events,load,rss}.jsonl and D/load-summary.json; prints the report as
      JSON lines, the human summary, and one verdict line per case
      ("ok   chaos_soak.NAME" / "FAIL chaos_soak.NAME: why").
"""
import argparse
import json
import os
import random
import re
import sys
import time
import urllib.request

SAMPLE_RE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$')


def ids_to_spec(ids):
    ids = sorted(set(ids))
    out, i = [], 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(out)


def spec_to_ids(spec):
    out = []
    for part in spec.split(","):
        if "-" in part:
            a, b = part.split("-")
            out.extend(range(int(a), int(b) + 1))
        elif part:
            out.append(int(part))
    return out


def share(e, n, i):
    return list(range(e * i // n, e * (i + 1) // n))


def cmd_plan(a):
    layers = []
    n, e = a.servers, a.experts
    rng = random.Random(a.seed)
    cap = 2 * ((2 * e + n - 1) // n)  # at most twice a server's even share of the copies
    for layer in range(a.layers):
        hold = {j: [] for j in range(n)}
        if a.initial:
            for j in range(n):
                hold[j] = share(e, n, j) + share(e, n, (j + 1) % n)
        else:
            for x in range(e):
                room = [j for j in range(n) if len(hold[j]) < cap]
                for j in rng.sample(room, 2):
                    hold[j].append(x)
        layers.append({"layer": layer,
                       "remote": {f"s{j}": ids_to_spec(hold[j]) for j in range(n) if hold[j]}})
    doc = {"format": "moerpc-placement", "version": 1, "num_layers": a.layers,
           "num_experts": e, "layers": layers}
    tmp = a.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, a.out)
    return 0


def cmd_spec(a):
    ids = set()
    for plan in a.plans:
        for layer in json.load(open(plan))["layers"]:
            ids.update(spec_to_ids(layer.get("remote", {}).get(f"s{a.server}", "")))
    print(ids_to_spec(ids))
    return 0


def cmd_schedule(a):
    rng = random.Random(a.seed)
    kinds = [k for k in a.kinds.split(",") if k]
    out = 0
    while out < a.count:
        for kind in rng.sample(kinds, len(kinds)):
            gap = round(rng.uniform(1.0, 3.0), 2)
            j = rng.randrange(a.servers)
            if kind == "kill9":
                ev = f"kill9 {j} {rng.uniform(0.2, 2.0):.2f}"
            elif kind == "term":
                ev = f"term {j} {rng.uniform(0.2, 1.5):.2f}"
            elif kind == "apply":
                ev = f"apply {rng.randrange(1, 1 << 30)}"
            elif kind == "flap":
                if rng.random() < 0.5:
                    ev = f"flap {j} rate {rng.uniform(2.0, 5.0):.2f} {rng.choice([5, 10, 20, 50])}mbit 0"
                else:
                    ev = (f"flap {j} lossy {rng.uniform(2.0, 5.0):.2f} {rng.choice([500, 1000, 2500])} "
                          f"{rng.choice([0.01, 0.02, 0.05])}")
            else:
                raise SystemExit(f"chaos_lib: unknown event kind {kind!r}")
            print(f"{gap} {ev}")
            out += 1
    return 0


def get(url, timeout=2.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def parse_metrics(text):
    """{name: [(labels dict, value)]} of a Prometheus text page."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = SAMPLE_RE.match(line)
        if not m:
            continue
        labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        try:
            v = float(m.group(3))
        except ValueError:
            continue
        out.setdefault(m.group(1), []).append((labels, v))
    return out


def one(mx, name, default=0.0):
    v = mx.get(name)
    return v[0][1] if v else default


def cmd_sample(a):
    out = open(a.out, "a", buffering=1)
    t0 = float(a.t0) if a.t0 else time.time()
    last = False
    while not last:
        last = os.path.exists(a.stop_file)  # one more scrape after it appears: the final counts
        t = time.time()
        try:
            mx = parse_metrics(get(a.url + "/metrics"))
            pl = json.loads(get(a.url + "/placement"))
        except (OSError, ValueError) as e:
            out.write(json.dumps({"t": round(t - t0, 3), "error": str(e)}) + "\n")
            if not last:
                time.sleep(a.interval)
            continue
        servers = {}
        for key, short in (("failovers", "failovers"), ("resent", "resent"), ("returns", "returns"),
                           ("errors", "errors"), ("timeouts", "timeouts"), ("requests", "requests")):
            for labels, v in mx.get(f"moerpc_client_server_{key}_total", []):
                servers.setdefault(labels.get("server", "?"), {})[short] = v
        for labels, v in mx.get("moerpc_client_server_down", []):
            servers.setdefault(labels.get("server", "?"), {})["down"] = v
        hist = {labels["le"]: v for labels, v in mx.get("moerpc_client_step_seconds_bucket", [])}
        rec = {"t": round(t - t0, 3),
               "steps": one(mx, "moerpc_serve_steps_total"),
               "failed_steps": one(mx, "moerpc_serve_failed_steps_total", None),
               "client_steps": one(mx, "moerpc_client_steps_total"),
               "generation": pl.get("generation"), "rejected": pl.get("rejected"),
               "finished": {l.get("reason"): v for l, v in mx.get("moerpc_serve_requests_finished_total", [])},
               "http": {l.get("code"): v for l, v in mx.get("moerpc_serve_http_requests_total", [])},
               "step_hist": hist, "step_count": one(mx, "moerpc_client_step_seconds_count"),
               "servers": servers}
        out.write(json.dumps(rec) + "\n")
        if not last:
            time.sleep(max(0.0, a.interval - (time.time() - t)))
    return 0


def cmd_rss(a):
    import resource
    import subprocess
    cmd = a.argv[1:] if a.argv and a.argv[0] == "--" else a.argv
    rc = subprocess.call(cmd)
    kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # KiB on Linux
    with open(a.out, "a") as f:
        f.write(json.dumps({"proc": a.name, "pid": 0, "vmhwm_kb": kb}) + "\n")
    return rc


def quantile(hist, q):
    """(upper bound, linear estimate) of quantile q of a cumulative histogram {le: count}."""
    pts = sorted(((float("inf") if le == "+Inf" else float(le)), c) for le, c in hist.items())
    if not pts or pts[-1][1] == 0:
        return None, None
    want = q * pts[-1][1]
    lo_b, lo_c = 0.0, 0.0
    for b, c in pts:
        if c >= want:
            if b == float("inf"):
                return b, lo_b
            est = lo_b + (b - lo_b) * ((want - lo_c) / (c - lo_c) if c > lo_c else 1.0)
            return b, est
        lo_b, lo_c = b, c
    return None, None


def read_jsonl(path):
    out = []
    if os.path.exists(path):
        for line in open(path):
            line = line.strip()
            if line:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
    return out


def failover_totals(samples):
    """Per server counters summed over the client's cluster generations: a placement switch
    opens a new cluster whose counters start at 0 (a new generation, or a value that went
    down, is a reset; the increase then is the new value)."""
    tot, prev, gen = {}, {}, None
    for s in samples:
        if "servers" not in s:
            continue
        reset = gen is not None and s.get("generation") != gen
        gen = s.get("generation")
        for name, c in s["servers"].items():
            for k in ("failovers", "resent", "returns", "errors", "timeouts"):
                v = c.get(k, 0.0)
                p = prev.get((name, k))
                inc = v if p is None or reset or v < p else v - p
                tot.setdefault(name, {}).setdefault(k, 0.0)
                tot[name][k] += inc
                prev[(name, k)] = v
    return {n: {k: int(v) for k, v in c.items()} for n, c in sorted(tot.items())}


def cmd_report(a):
    d = a.dir
    samples = [s for s in read_jsonl(os.path.join(d, "samples.jsonl")) if "steps" in s]
    events = read_jsonl(os.path.join(d, "events.jsonl"))
    reqs = read_jsonl(os.path.join(d, "load.jsonl"))
    rss = read_jsonl(os.path.join(d, "rss.jsonl"))
    summ = {}
    if os.path.exists(os.path.join(d, "load-summary.json")):
        try:
            summ = json.load(open(os.path.join(d, "load-summary.json")))
        except ValueError:
            summ = {}
    last = samples[-1] if samples else {}
    fo = failover_totals(samples)
    b99, e99 = quantile(last.get("step_hist", {}), 0.99)
    b50, e50 = quantile(last.get("step_hist", {}), 0.50)
    peak = {}
    for r in rss:
        peak[r["proc"]] = max(peak.get(r["proc"], 0), r["vmhwm_kb"])
    ok = sum(1 for r in reqs if r.get("ok"))
    failed = [r for r in reqs if not r.get("ok")]
    mism = [r for r in reqs if r.get("ok") and not r.get("match")]
    crashes = [e for e in events if e.get("kind") == "crash"]
    bad_events = [e for e in events if e.get("ok") is False and e.get("kind") != "crash"]
    fsteps = last.get("failed_steps")
    counts = {}
    for e in events:
        if e.get("kind") in ("kill9", "term", "apply", "flap"):
            counts[e["kind"]] = counts.get(e["kind"], 0) + 1
    rep = {"seed": a.seed, "seconds": a.seconds, "kinds": a.kinds,
           "steps": int(last.get("steps", 0)), "client_steps": int(last.get("client_steps", 0)),
           "failed_steps": None if fsteps is None else int(fsteps), "crashes": len(crashes),
           "requests": len(reqs), "ok": ok, "failed": len(failed), "mismatched": len(mism),
           "longest_no_answer_s": summ.get("stall_s"), "slowest_request_ms": summ.get("max_ms"),
           "events": counts, "events_failed": len(bad_events),
           "failovers": fo, "failovers_total": sum(c.get("failovers", 0) for c in fo.values()),
           "step_p50_s": e50, "step_p99_s": e99, "step_p99_bucket_le_s": b99,
           "placement_generation": last.get("generation"), "placement_rejected": last.get("rejected"),
           "finished": last.get("finished"), "http": last.get("http"),
           "peak_rss_kb": dict(sorted(peak.items()))}
    print(json.dumps({"report": rep}))
    for e in events:
        print(json.dumps({"event": e}))
    for r in failed[:20]:
        print(json.dumps({"failed_request": r}))
    for r in mism[:20]:
        print(json.dumps({"mismatched_request": r}))

    def fmt(x, unit="s"):
        return "n/a" if x is None else f"{x * 1000:.1f} ms" if unit == "s" else str(x)

    print()
    print(f"chaos soak, seed {a.seed}: {a.seconds} s, events {a.kinds}")
    print(f"  steps {rep['steps']}, failed steps {rep['failed_steps']}; requests {len(reqs)}: {ok} ok, "
          f"{len(failed)} failed, {len(mism)} answers differ from the all-local reference")
    print(f"  events run: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) +
          f"; {len(bad_events)} did not complete as expected")
    print(f"  failovers {rep['failovers_total']} (client, summed over placement switches): " +
          ", ".join(f"{n} {c.get('failovers', 0)} (resent {c.get('resent', 0)}, returns {c.get('returns', 0)})"
                    for n, c in fo.items()))
    print(f"  step time p50 {fmt(e50)}, p99 {fmt(e99)} (histogram bucket <= {fmt(b99)}); "
          f"slowest request {summ.get('max_ms')} ms; longest time without an answer {summ.get('stall_s')} s")
    print(f"  peak RSS (VmHWM): " + ", ".join(f"{p} {v / 1024:.1f} MiB" for p, v in sorted(peak.items())))
    print(f"  replay: {a.replay}")
    print()

    def verdict(name, good, why):
        print(f"ok   chaos_soak.{name}" if good else f"FAIL chaos_soak.{name}: {why}")

    verdict("load_ran", ok > 0 and rep["steps"] > 0 and samples,
            f"{ok} requests ok, {rep['steps']} steps, {len(samples)} metrics samples")
    # The schedule never takes both copies of an expert away (one event at a time, each
    # undone before the next), so every step ran while every expert had a live replica.
    verdict("no_failed_steps", fsteps == 0,
            f"{rep['failed_steps']} of {rep['steps']} steps failed while every expert had a live replica "
            f"(moerpc_serve_failed_steps_total; serve.log names the server)" if fsteps is not None
            else "no final scrape of moerpc_serve_failed_steps_total")
    f0 = failed[0] if failed else {}
    verdict("no_failed_requests", not failed,
            f"{len(failed)} of {len(reqs)} requests failed while every expert had a live replica; "
            f"first at t={f0.get('t')} s: {f0.get('error')}")
    m0 = mism[0] if mism else {}
    verdict("answers_match_reference", not mism,
            f"{len(mism)} answers differ from the all-local ones; first: prompt {m0.get('prompt')} "
            f"at t={m0.get('t')} s")
    stall = summ.get("stall_s")
    verdict("no_hang", stall is not None and stall < a.hang_s,
            f"{stall} s without any request finishing (limit {a.hang_s} s)")
    c0 = crashes[0] if crashes else {}
    verdict("no_crash", not crashes,
            f"{len(crashes)} processes exited by themselves; first at t={c0.get('t')} s: "
            f"{c0.get('server', '')} {c0.get('detail', '')}")
    be = bad_events[0] if bad_events else {}
    verdict("events_completed", not bad_events and counts,
            f"{len(bad_events)} events failed; first at t={be.get('t')} s: {be.get('kind')} "
            f"{be.get('server', '')} {be.get('detail', '')}" if bad_events else "no event ran")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("plan")
    s.add_argument("--out", required=True)
    s.add_argument("--layers", type=int, required=True)
    s.add_argument("--experts", type=int, required=True)
    s.add_argument("--servers", type=int, required=True)
    s.add_argument("--initial", action="store_true")
    s.add_argument("--seed", type=int, default=0)
    s = sub.add_parser("spec")
    s.add_argument("--server", type=int, required=True)
    s.add_argument("plans", nargs="+")
    s = sub.add_parser("schedule")
    s.add_argument("--seed", type=int, required=True)
    s.add_argument("--servers", type=int, required=True)
    s.add_argument("--kinds", required=True)
    s.add_argument("--count", type=int, default=400)
    s = sub.add_parser("sample")
    s.add_argument("--url", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--stop-file", required=True)
    s.add_argument("--interval", type=float, default=0.5)
    s.add_argument("--t0", default="")
    s = sub.add_parser("rss")
    s.add_argument("--out", required=True)
    s.add_argument("--name", required=True)
    s.add_argument("argv", nargs=argparse.REMAINDER)
    s = sub.add_parser("report")
    s.add_argument("--dir", required=True)
    s.add_argument("--seed", type=int, required=True)
    s.add_argument("--seconds", type=int, required=True)
    s.add_argument("--kinds", required=True)
    s.add_argument("--hang-s", type=float, default=30.0)
    s.add_argument("--replay", required=True)
    a = ap.parse_args()
    return {"plan": cmd_plan, "spec": cmd_spec, "schedule": cmd_schedule, "sample": cmd_sample,
            "rss": cmd_rss, "report": cmd_report}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
