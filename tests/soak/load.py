#!/usr/bin/env python3
"""tests/soak/load.py - the chaos soak's load: greedy streamed /v1/completions against
`moerpc-client serve`, each answer compared with the all-local one. Standard library only.

  load.py ref --url URL --model NAME --max-tokens N --out REF.json PROMPT...
      One streamed greedy completion per prompt, one after another (the reference, made
      against an all-local serve before the soak); writes {"max_tokens", "answers": {prompt:
      text}}. Exit 1 if any request fails or ends short.

  load.py run --url URL --model NAME --ref REF.json --workers K --log OUT.jsonl
              --stop-file F [--request-timeout S] [--seed S]
      K threads, each sending one streamed request at a time, prompts in a seeded order,
      until the file F exists (each finishes the request it has begun). One JSON line per
      request in OUT.jsonl: {"t": start (s since the run began), "end", "worker", "prompt",
      "ok", "match", "tokens", "error"}. At the end one JSON line on stdout: requests, ok,
      failed, mismatched, max_ms, the longest time with no request finishing (stall_s).

A request is ok when the stream ends with finish_reason "length", max_tokens completion
tokens (usage) and "data: [DONE]"; anything else (an HTTP error, an error event, a broken
or timed-out connection) is failed, with the reason. "match": the text equals the
reference's for the prompt (greedy, reference kernels, fp32 wire: bit-exact, section 22 of
docs/DESIGN.md); a failed request is not compared.
"""
import argparse
import http.client
import json
import os
import random
import sys
import threading
import time
import urllib.parse


def complete(url, model, prompt, max_tokens, timeout):
    """One streamed greedy completion. Returns (text, error): error is None on success."""
    u = urllib.parse.urlsplit(url)
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0, "stream": True, "ignore_eos": True,
                       "stream_options": {"include_usage": True}})
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    text, finish, usage, done = [], None, None, False
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            return "", f"HTTP {r.status}: {r.read().decode(errors='replace')[:300]}"
        for raw in r:
            line = raw.decode(errors="replace").strip()
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                break
            ev = json.loads(data)
            if "error" in ev:
                return "".join(text), f"error event: {json.dumps(ev['error'])[:300]}"
            for ch in ev.get("choices") or []:
                text.append(ch.get("text") or "")
                finish = ch.get("finish_reason") or finish
            if ev.get("usage"):
                usage = ev["usage"]
    except (OSError, http.client.HTTPException, ValueError) as e:
        return "".join(text), f"{type(e).__name__}: {e}"
    finally:
        conn.close()
    got = (usage or {}).get("completion_tokens")
    if not done:
        return "".join(text), "the stream ended without [DONE]"
    if finish != "length" or got != max_tokens:
        return "".join(text), f"finish_reason {finish}, {got} completion tokens (expected length, {max_tokens})"
    return "".join(text), None


def cmd_ref(a):
    answers = {}
    for p in a.prompts:
        text, err = complete(a.url, a.model, p, a.max_tokens, a.request_timeout)
        if err:
            print(f"load: reference for {p!r} failed: {err}", file=sys.stderr)
            return 1
        answers[p] = text
    with open(a.out, "w") as f:
        json.dump({"max_tokens": a.max_tokens, "answers": answers}, f, indent=1)
    return 0


def cmd_run(a):
    ref = json.load(open(a.ref))
    answers, max_tokens = ref["answers"], ref["max_tokens"]
    prompts = sorted(answers)
    t0 = time.monotonic()
    lock = threading.Lock()
    log = open(a.log, "a", buffering=1)
    st = {"requests": 0, "ok": 0, "failed": 0, "mismatched": 0, "max_ms": 0.0,
          "last_end": 0.0, "stall_s": 0.0}

    def worker(w):
        rng = random.Random(a.seed * 1000 + w)
        while not os.path.exists(a.stop_file):
            p = rng.choice(prompts)
            ts = time.monotonic() - t0
            text, err = complete(a.url, a.model, p, max_tokens, a.request_timeout)
            te = time.monotonic() - t0
            match = err is None and text == answers[p]
            rec = {"t": round(ts, 3), "end": round(te, 3), "worker": w, "prompt": prompts.index(p),
                   "ok": err is None, "match": match if err is None else None, "error": err}
            if err is None and not match:
                rec["text"], rec["want"] = text, answers[p]
            with lock:
                st["requests"] += 1
                st["ok" if err is None else "failed"] += 1
                st["mismatched"] += err is None and not match
                st["max_ms"] = max(st["max_ms"], (te - ts) * 1000)
                st["stall_s"] = max(st["stall_s"], te - st["last_end"])
                st["last_end"] = te
                log.write(json.dumps(rec) + "\n")
            if err is not None:
                time.sleep(0.2)  # a failing serve is not hammered

    threads = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(a.workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    st["stall_s"] = round(max(st["stall_s"], time.monotonic() - t0 - st["last_end"]), 3)
    st["max_ms"] = round(st["max_ms"], 1)
    st["seconds"] = round(time.monotonic() - t0, 3)
    del st["last_end"]
    print(json.dumps(st), flush=True)
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("ref", "run"):
        s = sub.add_parser(name)
        s.add_argument("--url", required=True)
        s.add_argument("--model", required=True)
        s.add_argument("--request-timeout", type=float, default=60)
    r = sub.choices["ref"]
    r.add_argument("--max-tokens", type=int, required=True)
    r.add_argument("--out", required=True)
    r.add_argument("prompts", nargs="+")
    r = sub.choices["run"]
    r.add_argument("--ref", required=True)
    r.add_argument("--workers", type=int, default=3)
    r.add_argument("--log", required=True)
    r.add_argument("--stop-file", required=True)
    r.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    return cmd_ref(a) if a.cmd == "ref" else cmd_run(a)


if __name__ == "__main__":
    sys.exit(main())
