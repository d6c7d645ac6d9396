#!/usr/bin/env python3
"""serve_vs_llamacpp.py - serving: moerpc-client serve next to llama.cpp's server, streamed.

Three servers on the same checkpoint and thread count (--threads, default 2), started one
at a time, each answering the same requests:

  llama.cpp       python -m llama_cpp.server (llama-cpp-python[server], in --venv) on the
                  checkpoint converted to GGUF bf16 by vs_llamacpp.py's converter, with the
                  checkpoint's own tokenizer (so text gives the same ids on both sides):
                  --n_threads T --n_threads_batch T --n_ctx --n_ctx --interrupt_requests
                  False; its other settings are its defaults: one Llama object behind a
                  lock, so it runs one request at a time and queues the others (it has no
                  batching of sequences; --interrupt_requests False keeps a waiting
                  request from cutting the running stream short, which its default True
                  does)
  moerpc-local    moerpc-client serve --model DIR --threads T --max-batch 16 (every expert
                  in the client, continuous batching)
  moerpc-2servers moerpc-client serve --model DIR --cluster C/cluster.json --threads T
                  --max-batch 16, two moerpc-server --threads 1 on loopback owning half
                  the experts each (deploy/local-cluster.sh); the servers and the client
                  share the same cores

Load: for each concurrency level (--levels, default 1,4,16) --requests N requests
(default max(8, level)) to POST /v1/completions, level threads each sending its next
request as soon as the last one ended; one untimed, non-streamed warm-up request per
server first (its usage is checked too). Each request: a text prompt of --prompt-tokens
(256) tokens with the model's tokenizer (common words drawn at random, a different first
word for each request so that no server reuses the previous prompt's KV cache), max_tokens
--max-tokens (128), temperature 0, stream true with stream_options.include_usage, and
ignore_eos true (moerpc); llama.cpp has no ignore_eos, so it gets logit_bias -100 on the
stop ids and the other special tokens instead (and repeat_penalty 1.0, its default being
1.1). Every answer's prompt_tokens and completion_tokens are checked and reported: from
the usage chunk, or, where the server sends none (llama-cpp-python ignores
stream_options), max_tokens when finish_reason is "length" (llama-cpp-python sets it only
when max_tokens tokens were sampled; its chunks are about one per token, not exactly, and
are reported as stream_chunks); each server's non-streamed warm-up answer reports its
usage. The prompts' ids are compared between
moerpc-client tokenize and llama.cpp's /extras/tokenize before the first request.

Figures per (server, level): output tok/s = completion tokens of the level / its wall time
(first request sent to last stream ended); time to first token (request sent -> first SSE
chunk with non-empty text) p50 / p99 over the level's requests; inter-token latency
(between consecutive non-empty text chunks of one stream) p50 / p99 over all its gaps.
The whole set runs --rounds times (default 3), each round every server once, the order
rotated round by round (the host drifts +-30 %); the printed figures are medians over the
rounds, and the ratios moerpc / llama.cpp are taken within each round, then the median.
For moerpc, /metrics is read around each level: model steps, tokens per step, step time,
the share of the level's wall time inside steps, RPC time per step; for llama.cpp its
own timings (llama_perf lines of its log): prefill tok/s, decode ms per token, busy share.
The host is shared: --quiet-wait S waits (at most S s) before each server start until the
other processes use under 25 % of the CPUs (host_busy in the records).

Output: one JSON line per (server, level), then one per (moerpc server, level) with the
ratio, then one summary line; a table on stderr. Validation of the converter (vs_llamacpp's,
needs the conformance venv) runs first unless --skip-validate.

usage: tests/bench/serve_vs_llamacpp.py [--model DIR | --mkmodel-args "..."] [--threads 2]
         [--levels 1,4,16] [--requests N] [--rounds 3] [--prompt-tokens 256]
         [--max-tokens 128] [--servers llama.cpp,moerpc-local,moerpc-2servers]
         [--venv DIR] [--work DIR] [--skip-validate] [--json FILE]
"""
import argparse
import http.client
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vs_llamacpp as vl  # noqa: E402  the converter, the venv, the model, cpu_model

ROOT = vl.ROOT
SERVERS = ("llama.cpp", "moerpc-local", "moerpc-2servers")
# Qwen3-30B-A3B's layer shapes as vs_llamacpp.py's DEFAULT_MK, 2 layers instead of 4: three
# servers x three levels x three rounds in ~15 min on 2 cores
SERVE_MK = vl.DEFAULT_MK.replace("--layers 4", "--layers 2")
SERVER_PKGS = ["numpy", "gguf", "llama-cpp-python[server]"]
SERVER_IMPORTS = "numpy, gguf, llama_cpp, llama_cpp.server.app"
# Words of one token each with moerpc-mkmodel's tokenizer (with their leading space); other
# tokenizers split some, which the calibration below absorbs.
WORDS = ("the of and to in is that for it as was with be by on not he this are or his from "
         "at which but have an had they you were their one all we can her has there been if "
         "more when will would who so no what up out about into than them time only could "
         "new some other these may like then first any now such over").split()


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def pct(xs, q):
    """q-th percentile (0..100) of xs, linear between the closest ranks; None if empty."""
    xs = sorted(xs)
    if not xs:
        return None
    k = (len(xs) - 1) * q / 100.0
    i = int(k)
    return xs[i] if i + 1 >= len(xs) else xs[i] + (xs[i + 1] - xs[i]) * (k - i)


def host_busy(seconds=2.0):
    """Share of all CPUs busy over `seconds` (/proc/stat): other jobs, when ours are idle."""
    def snap():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + v[4]                      # total, idle + iowait
    try:
        t0, i0 = snap()
        time.sleep(seconds)
        t1, i1 = snap()
    except OSError:
        return None
    return round(1 - (i1 - i0) / max(1, t1 - t0), 3)


def wait_quiet(limit_s):
    busy = host_busy()
    t0 = time.time()
    while busy is not None and busy > 0.25 and time.time() - t0 < limit_s:
        log(f"serve_vs_llamacpp: host {busy:.0%} busy with other work; waiting")
        time.sleep(10)
        busy = host_busy()
    return busy


def rnd(x, n=3):
    return None if x is None else round(x, n)


# ---------------------------------------------------------------------------------------
# prompts: the same texts for every server, each ~--prompt-tokens with the model's tokenizer

def tokenize(client, model, texts):
    """moerpc-client tokenize, one JSON array of ids per text (texts hold no newline)."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write("\n".join(texts) + "\n")
        path = f.name
    try:
        r = subprocess.run([client, "tokenize", "--model", model, "--file", path, "--json"],
                           capture_output=True, text=True, check=True)
    finally:
        os.unlink(path)
    return [json.loads(line) for line in r.stdout.splitlines() if line.startswith("[")]


def make_prompts(args, n):
    """n prompts of args.prompt_tokens tokens (as close as words allow): request i starts
    with word i mod len(WORDS), the rest drawn with seed i. Returns (texts, ids)."""
    words = []
    for i in range(n):
        r = random.Random(1000 + i)
        words.append([WORDS[i % len(WORDS)]] + [r.choice(WORDS) for _ in range(4 * args.prompt_tokens)])
    nw = [args.prompt_tokens] * n                      # words per prompt, calibrated below
    for _ in range(8):
        texts = ["".join(" " + w for w in ws[:k]) for ws, k in zip(words, nw)]
        ids = tokenize(args.client, args.model, texts)
        if all(len(x) == args.prompt_tokens for x in ids):
            break
        for i, x in enumerate(ids):
            if len(x) != args.prompt_tokens:
                k = round(nw[i] * args.prompt_tokens / len(x))
                if k == nw[i]:
                    k += 1 if len(x) < args.prompt_tokens else -1
                nw[i] = max(1, min(k, len(words[i])))
    return texts, ids


# ---------------------------------------------------------------------------------------
# the load generator: one HTTP/1.1 connection per request, SSE read line by line

def http_json(port, method, path, body=None, timeout=600):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request(method, path, body=None if body is None else json.dumps(body),
                  headers={"Content-Type": "application/json"})
        r = c.getresponse()
        data = r.read()
        return r.status, (json.loads(data) if data[:1] in (b"{", b"[") else data.decode())
    finally:
        c.close()


def stream_request(port, body, timeout):
    """POSTs body (stream true) to /v1/completions. Returns a dict: t0 / t_end (perf_counter),
    the times of the non-empty text chunks, the chunks without finish_reason, usage,
    finish_reason, error."""
    res = {"text_times": [], "token_chunks": 0, "usage": None, "finish": None, "error": None}
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        payload = json.dumps(body)
        res["t0"] = time.perf_counter()
        c.request("POST", "/v1/completions", body=payload,
                  headers={"Content-Type": "application/json", "Accept": "text/event-stream"})
        r = c.getresponse()
        if r.status != 200:
            res["error"] = f"HTTP {r.status}: {r.read()[:500].decode(errors='replace')}"
            return res
        while True:
            line = r.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue                                  # blank separators, ": ping"
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            now = time.perf_counter()
            ev = json.loads(data)
            if "error" in ev:
                res["error"] = json.dumps(ev["error"])[:500]
                break
            for ch in ev.get("choices") or []:
                if ch.get("text"):
                    res["text_times"].append(now)
                if ch.get("finish_reason"):
                    res["finish"] = ch["finish_reason"]
                else:
                    res["token_chunks"] += 1
            if ev.get("usage"):
                res["usage"] = ev["usage"]
    except (OSError, http.client.HTTPException, ValueError) as ex:
        res["error"] = f"{type(ex).__name__}: {ex}"
    finally:
        res["t_end"] = time.perf_counter()
        c.close()
    return res


def run_level(port, bodies, conc, timeout):
    """Sends bodies with conc threads, each taking the next body when its last ended."""
    out = [None] * len(bodies)
    nxt = [0]
    lock = threading.Lock()

    def worker():
        while True:
            with lock:
                i = nxt[0]
                nxt[0] += 1
            if i >= len(bodies):
                return
            out[i] = stream_request(port, bodies[i], timeout)

    ths = [threading.Thread(target=worker, daemon=True) for _ in range(conc)]
    t0 = time.perf_counter()
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    return out, time.perf_counter() - t0


def level_figures(results, wall, max_tokens):
    """tok/s, TTFT and ITL percentiles, and the checks of one level's answers."""
    ttft, itl, comp, prompt_toks, fins, errs, chunks = [], [], [], [], {}, [], []
    for r in results:
        if r["error"]:
            errs.append(r["error"])
            continue
        tt = r["text_times"]
        if tt:
            ttft.append(tt[0] - r["t0"])
            itl += [b - a for a, b in zip(tt, tt[1:])]
        u = r["usage"] or {}
        chunks.append(r["token_chunks"])
        if "completion_tokens" in u:
            comp.append(u["completion_tokens"])
        else:
            # no usage chunk (llama-cpp-python): its finish_reason "length" means exactly
            # max_tokens sampled; its chunks are about one per token, not exactly (tokens
            # that end inside a UTF-8 character are held and sent with a later one)
            comp.append(max_tokens if r["finish"] == "length" else r["token_chunks"])
        if "prompt_tokens" in u:
            prompt_toks.append(u["prompt_tokens"])
        fins[r["finish"]] = fins.get(r["finish"], 0) + 1
    return {
        "tok_s": sum(comp) / wall if wall > 0 else None, "wall_s": wall,
        "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
        "itl_p50_ms": None if not itl else pct(itl, 50) * 1e3,
        "itl_p99_ms": None if not itl else pct(itl, 99) * 1e3,
        "completion_tokens": sorted(set(comp)), "prompt_tokens": sorted(set(prompt_toks)),
        "usage_counted": all(r["usage"] for r in results if not r["error"]),
        "stream_chunks": [min(chunks), max(chunks)] if chunks else None,
        "finish_reasons": fins, "errors": len(errs), "first_error": errs[0] if errs else None,
        "requests": len(results)}


# ---------------------------------------------------------------------------------------
# moerpc's /metrics around a level: where the time goes

MOERPC_COUNTERS = ("moerpc_client_steps_total", "moerpc_client_step_tokens_total",
                   "moerpc_client_step_seconds_sum", "moerpc_client_layer_rpc_seconds_sum",
                   "moerpc_serve_queue_length")


def scrape(port):
    try:
        st, text = http_json(port, "GET", "/metrics", timeout=10)
    except OSError:
        return {}
    vals = {}
    for line in (text if isinstance(text, str) else "").splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] in MOERPC_COUNTERS:
            vals[parts[0]] = float(parts[1])
    return vals


def step_figures(before, after, wall):
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in MOERPC_COUNTERS}
    steps = d["moerpc_client_steps_total"]
    if not steps:
        return {}
    return {"steps": int(steps),
            "tokens_per_step": round(d["moerpc_client_step_tokens_total"] / steps, 2),
            "step_ms_mean": round(d["moerpc_client_step_seconds_sum"] / steps * 1e3, 2),
            "step_busy": round(d["moerpc_client_step_seconds_sum"] / wall, 3),
            "rpc_ms_per_step": round(d["moerpc_client_layer_rpc_seconds_sum"] / steps * 1e3, 2)}


def llama_perf(logf, offset, wall):
    """llama.cpp's own timings of the requests logged since offset (its llama_perf lines):
    prefill tok/s, decode ms per token, and the share of the level's wall time in them."""
    with open(logf, errors="replace") as f:
        f.seek(offset)
        text = f.read()
    pms = ptok = ems = eruns = 0.0
    for m in re.finditer(r"(prompt eval|\s eval) time =\s*([\d.]+) ms /\s*(\d+) (tokens|runs)", text):
        if m.group(1) == "prompt eval":
            pms, ptok = pms + float(m.group(2)), ptok + int(m.group(3))
        else:
            ems, eruns = ems + float(m.group(2)), eruns + int(m.group(3))
    if not eruns:
        return {}
    return {"prefill_tok_s": round(ptok / pms * 1e3, 1) if pms else None,
            "decode_ms_per_token": round(ems / eruns, 2),
            "busy": round((pms + ems) / 1e3 / wall, 3)}


# ---------------------------------------------------------------------------------------
# the servers, one at a time

class Server:
    def __init__(self, name, args, gguf, llama_py):
        self.name, self.args, self.gguf, self.py = name, args, gguf, llama_py
        self.procs, self.cluster = [], None
        self.port = free_port()
        self.logf = os.path.join(args.work, f"serve-{name}.log")

    def start(self):
        a = self.args
        self.log_fh = log_fh = open(self.logf, "w")
        if self.name == "llama.cpp":
            cmd = [self.py, "-m", "llama_cpp.server", "--model", self.gguf,
                   "--n_threads", str(a.threads), "--n_threads_batch", str(a.threads),
                   "--n_ctx", str(a.n_ctx), "--interrupt_requests", "False",
                   "--host", "127.0.0.1", "--port", str(self.port)]
            ready = "/v1/models"
        else:
            cmd = [a.client, "serve", "--model", a.model, "--threads", str(a.threads),
                   "--max-batch", str(a.max_batch), "--listen", f"127.0.0.1:{self.port}",
                   "--quiet", "--log", "warn"]
            if self.name == "moerpc-2servers":
                cdir = os.path.join(a.work, "serve-cluster")
                # a bash that sources the cluster helper: lc_start, "ready", then lc_stop
                # when its stdin closes
                sh = ('set -e; BIN="$1"; . deploy/local-cluster.sh; '
                      'lc_start "$2" "$3" 2 --threads "$4" >&2; echo ready; read -r _ || true; '
                      'lc_stop >&2')
                self.cluster = subprocess.Popen(
                    ["bash", "-c", sh, "lc", os.path.dirname(a.client), cdir, a.model,
                     str(a.server_threads)], cwd=ROOT, stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE, stderr=log_fh, text=True)
                if self.cluster.stdout.readline().strip() != "ready":
                    raise RuntimeError(f"local cluster did not start: see {self.logf}")
                cmd += ["--cluster", os.path.join(cdir, "cluster.json")]
            ready = "/health"
        self.cmd = cmd
        t0 = time.time()
        self.procs = [subprocess.Popen(cmd, stdout=log_fh, stderr=subprocess.STDOUT)]
        while True:
            if self.procs[0].poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.procs[0].returncode}: see {self.logf}")
            try:
                if http_json(self.port, "GET", ready, timeout=5)[0] == 200:
                    break
            except OSError:
                pass
            if time.time() - t0 > self.args.start_timeout:
                raise RuntimeError(f"{self.name} not ready after {self.args.start_timeout} s")
            time.sleep(0.5)
        self.load_s = time.time() - t0
        log(f"serve_vs_llamacpp: {self.name} ready on :{self.port} in {self.load_s:.1f} s")

    def stop(self):
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        if self.cluster:
            try:
                self.cluster.stdin.close()
                self.cluster.wait(timeout=120)
            except (OSError, subprocess.TimeoutExpired):
                self.cluster.kill()
            self.cluster = None
        self.procs = []
        self.log_fh.close()

    def body(self, prompt, stream=True):
        b = {"prompt": prompt, "max_tokens": self.args.max_tokens, "temperature": 0,
             "seed": 0, "stream": stream}
        if stream:
            b["stream_options"] = {"include_usage": True}
        if self.name == "llama.cpp":
            # no ignore_eos in llama-cpp-python: the stop ids and the special tokens can
            # not be sampled (greedy over logits + bias)
            b["logit_bias"] = {str(t): -100.0 for t in self.args.banned_ids}
            b["repeat_penalty"] = 1.0                  # its default 1.1; OpenAI's none
        else:
            b["ignore_eos"] = True
        return b


# ---------------------------------------------------------------------------------------

def check_tokenizers(srv, texts, ids):
    """moerpc's ids vs llama.cpp's /extras/tokenize for the same texts: (same, total)."""
    same = 0
    for t, want in zip(texts, ids):
        st, got = http_json(srv.port, "POST", "/extras/tokenize", {"input": t})
        if st == 200 and got.get("tokens") == want:
            same += 1
    return same, len(texts)


def run_server(srv, args, prompts, round_no, out):
    """One server: start, warm-up, every level, stop. Appends a record per level to out."""
    texts, ids = prompts
    busy = wait_quiet(args.quiet_wait)
    srv.start()
    try:
        if srv.name == "llama.cpp" and args.tok_check is None:
            args.tok_check = check_tokenizers(srv, texts, ids)
            log(f"serve_vs_llamacpp: token ids of the prompts, llama.cpp == moerpc: "
                f"{args.tok_check[0]}/{args.tok_check[1]}")
        st, w = http_json(srv.port, "POST", "/v1/completions",
                          srv.body(texts[0], stream=False), timeout=args.timeout)
        wu = (w.get("usage") or {}) if isinstance(w, dict) else {}
        if isinstance(w, dict) and w.get("choices"):
            args.warm_text.setdefault(srv.name, w["choices"][0].get("text", ""))
        log(f"serve_vs_llamacpp: {srv.name} warm-up: HTTP {st}, usage {wu}")
        k = 1
        for conc in args.levels:
            n = args.requests or max(8, conc)
            bodies = [srv.body(texts[k + i]) for i in range(n)]
            k += n
            m0 = scrape(srv.port) if srv.name != "llama.cpp" else {}
            log_off = os.path.getsize(srv.logf)
            res, wall = run_level(srv.port, bodies, conc, args.timeout)
            m1 = scrape(srv.port) if srv.name != "llama.cpp" else {}
            fig = level_figures(res, wall, args.max_tokens)
            fig.update(server=srv.name, concurrency=conc, round=round_no,
                       warmup_usage=wu, load_s=round(srv.load_s, 1), loadavg=vl.loadavg(),
                       host_busy=busy)
            if m0:
                fig["moerpc_steps"] = step_figures(m0, m1, wall)
            if srv.name == "llama.cpp":
                time.sleep(0.2)                            # its perf lines follow the stream
                fig["llama_perf"] = llama_perf(srv.logf, log_off, wall)
            out.append(fig)
            log(f"serve_vs_llamacpp: round {round_no} {srv.name} c={conc}: "
                f"{fig['tok_s']:.2f} tok/s, TTFT p50 {fig['ttft_p50_s']} s, ITL p50 "
                f"{rnd(fig['itl_p50_ms'], 1)} ms, completion {fig['completion_tokens']}, "
                f"prompt {fig['prompt_tokens']}, errors {fig['errors']}"
                + (f" ({fig['first_error']})" if fig["errors"] else "")
                + (f", steps {fig.get('moerpc_steps')}" if m0 else "")
                + (f", llama.cpp {fig.get('llama_perf')}" if "llama_perf" in fig else ""))
    finally:
        srv.stop()


def summarize(args, recs, cpu, date, shape):
    lines = []
    med = vl.med
    for name in args.servers:
        for conc in args.levels:
            rs = [r for r in recs if r["server"] == name and r["concurrency"] == conc]
            if not rs:
                continue
            d = {"bench": "serve", "server": name, "concurrency": conc,
                 "requests": rs[0]["requests"], "rounds": len(rs), "threads": args.threads,
                 "prompt_tokens_target": args.prompt_tokens, "max_tokens": args.max_tokens,
                 "cpu": cpu, "date": date, "model": args.model, "shape": shape}
            for k, nd in (("tok_s", 2), ("ttft_p50_s", 3), ("ttft_p99_s", 3),
                          ("itl_p50_ms", 2), ("itl_p99_ms", 2)):
                d[k] = rnd(med([r[k] for r in rs]), nd)
            d["tok_s_runs"] = [rnd(r["tok_s"], 2) for r in rs]
            d["prompt_tokens"] = sorted({p for r in rs for p in r["prompt_tokens"]})
            d["completion_tokens"] = sorted({p for r in rs for p in r["completion_tokens"]})
            d["usage_counted"] = all(r["usage_counted"] for r in rs)
            d["completion_tokens_from"] = ("usage" if d["usage_counted"] else
                                           "finish_reason length = max_tokens")
            sc = [r["stream_chunks"] for r in rs if r["stream_chunks"]]
            d["stream_chunks"] = [min(x[0] for x in sc), max(x[1] for x in sc)] if sc else None
            d["finish_reasons"] = sorted({f"{k}" for r in rs for k in r["finish_reasons"]})
            d["errors"] = sum(r["errors"] for r in rs)
            d["warmup_usage"] = rs[0]["warmup_usage"]
            d["load_s"] = med([r["load_s"] for r in rs])
            d["loadavg"] = [r["loadavg"] for r in rs]
            d["host_busy_before"] = [r["host_busy"] for r in rs]
            if name == "llama.cpp":
                d["setup"] = (f"llama_cpp.server --n_threads {args.threads} --n_threads_batch "
                              f"{args.threads} --n_ctx {args.n_ctx} --interrupt_requests False "
                              "(one request at a time); logit_bias -100 on stop/special ids")
                d["tokenize_same"] = (f"{args.tok_check[0]}/{args.tok_check[1]}"
                                      if args.tok_check else None)
                lp = [r.get("llama_perf") or {} for r in rs]
                d["llama_perf"] = {k: med([x.get(k) for x in lp])
                                   for k in ("prefill_tok_s", "decode_ms_per_token", "busy")}
            else:
                d["setup"] = (f"moerpc-client serve --threads {args.threads} --max-batch "
                              f"{args.max_batch}; ignore_eos")
                st = [r.get("moerpc_steps") or {} for r in rs]
                d["moerpc_steps"] = {k: med([s.get(k) for s in st])
                                     for k in ("steps", "tokens_per_step", "step_ms_mean",
                                               "step_busy", "rpc_ms_per_step")}
                ref, mine = args.warm_text.get("llama.cpp"), args.warm_text.get(name)
                if ref is not None and mine is not None:
                    n = 0
                    while n < min(len(ref), len(mine)) and ref[n] == mine[n]:
                        n += 1
                    # greedy on the same weights: how far the warm-up answers agree
                    d["warmup_text_same_as_llama"] = f"{n}/{max(len(ref), len(mine))} chars"
            if name == "moerpc-2servers":
                d["note"] = (f"2 moerpc-server --threads {args.server_threads} on loopback + the "
                             f"client (--threads {args.threads}) share the host's "
                             f"{os.cpu_count()} cores")
            lines.append(d)
    targets = {1: 1.0, 16: 2.0}
    for name in args.servers:
        if name == "llama.cpp" or "llama.cpp" not in args.servers:
            continue
        for conc in args.levels:
            ratios = []
            for rnd_no in range(args.rounds):
                a = [r["tok_s"] for r in recs if r["server"] == name and
                     r["concurrency"] == conc and r["round"] == rnd_no]
                b = [r["tok_s"] for r in recs if r["server"] == "llama.cpp" and
                     r["concurrency"] == conc and r["round"] == rnd_no]
                if a and b and b[0]:
                    ratios.append(a[0] / b[0])
            if not ratios:
                continue
            d = {"bench": "serve-ratio", "ratio": f"{name} / llama.cpp output tok/s",
                 "concurrency": conc, "tok_s_ratio": rnd(med(ratios), 3),
                 "runs": [rnd(x, 3) for x in ratios], "cpu": cpu, "date": date}
            if conc in targets:
                d["target"] = targets[conc]
                d["met"] = d["tok_s_ratio"] >= targets[conc]
            lines.append(d)
    return lines


def table(lines):
    log("")
    log(f"{'server':<16} {'conc':>4} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'ITL p50':>8} {'ITL p99':>8}  prompt/completion tokens")
    for d in lines:
        if d["bench"] == "serve":
            log(f"{d['server']:<16} {d['concurrency']:>4} {d['tok_s']:>8} {d['ttft_p50_s']:>8}s "
                f"{d['ttft_p99_s']:>8}s {d['itl_p50_ms']:>6}ms {d['itl_p99_ms']:>6}ms  "
                f"{d['prompt_tokens']} / {d['completion_tokens']}")
    for d in lines:
        if d["bench"] == "serve-ratio":
            log(f"{d['ratio']} at concurrency {d['concurrency']}: {d['tok_s_ratio']} "
                f"(runs {d['runs']})" + (f", target >= {d['target']}: "
                                         f"{'met' if d['met'] else 'NOT met'}" if "target" in d else ""))


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--model", help="HF Qwen3-MoE checkpoint dir with tokenizer.json "
                    "(default: made by moerpc-mkmodel)")
    ap.add_argument("--mkmodel-args", default=SERVE_MK,
                    help=f"moerpc-mkmodel flags for the default model (default: {SERVE_MK})")
    ap.add_argument("--threads", type=int, default=2, help="threads of every server (2)")
    ap.add_argument("--server-threads", type=int, default=1,
                    help="--threads of each of the two moerpc-server (1)")
    ap.add_argument("--max-batch", type=int, default=16, help="moerpc serve --max-batch (16)")
    ap.add_argument("--levels", default="1,4,16", help="concurrency levels (1,4,16)")
    ap.add_argument("--requests", type=int, default=0,
                    help="requests per level (default max(8, level))")
    ap.add_argument("--rounds", type=int, default=3,
                    help="rounds, each running every server once; medians reported (3)")
    ap.add_argument("--prompt-tokens", type=int, default=256, help="prompt length (256)")
    ap.add_argument("--max-tokens", type=int, default=128, help="max_tokens (128)")
    ap.add_argument("--n-ctx", type=int, default=1024, help="llama.cpp --n_ctx (1024)")
    ap.add_argument("--servers", default=",".join(SERVERS), help=",".join(SERVERS))
    ap.add_argument("--client", default=os.path.join(ROOT, "build", "bin", "moerpc-client"))
    ap.add_argument("--venv", default=os.environ.get("MOERPC_BENCH_VENV",
                                                     os.path.join(ROOT, ".venv-bench")),
                    help="venv with llama-cpp-python[server] + gguf (made if missing)")
    ap.add_argument("--work", default=os.path.join(ROOT, "build", "bench"))
    ap.add_argument("--skip-validate", action="store_true",
                    help="skip vs_llamacpp's check of the GGUF converter against transformers")
    ap.add_argument("--validate-limit", type=float, default=0.02)
    ap.add_argument("--timeout", type=int, default=900, help="per request, s")
    ap.add_argument("--start-timeout", type=int, default=600, help="per server start, s")
    ap.add_argument("--quiet-wait", type=int, default=0,
                    help="before each server start, wait up to this many s for the host's "
                         "other work to drop under 25 %% CPU (default 0: no wait)")
    ap.add_argument("--json", help="also append the JSON lines to this file")
    args = ap.parse_args(argv)
    args.levels = [int(x) for x in args.levels.split(",") if x]
    args.servers = [s for s in args.servers.split(",") if s]
    for s in args.servers:
        if s not in SERVERS:
            ap.error(f"unknown server {s} ({', '.join(SERVERS)})")
    os.makedirs(args.work, exist_ok=True)
    py = vl.ensure_llama_venv(args.venv, SERVER_PKGS, SERVER_IMPORTS)
    cpu, date = vl.cpu_model(), time.strftime("%Y-%m-%d %H:%M %Z")
    if not args.skip_validate:
        args.formats = ["bf16"]
        if not vl.validate(args, py):
            log("serve_vs_llamacpp: the GGUF conversion does not reproduce transformers")
            return 1
    args.model = args.model or vl.mkmodel(args, os.path.join(args.work, "qwen3moe-serve-bench"),
                                          args.mkmodel_args)
    cfg = json.load(open(os.path.join(args.model, "config.json")))
    h = vl.hp(cfg)
    shape = (f"{h['L']} layers, H {h['H']}, {h['nh']}/{h['nkv']} heads of {h['hd']}, "
             f"{h['E']} experts top-{h['k']} of I {h['I']}, vocab {h['V']}, bf16")
    gguf = vl.gguf_for(args, py, args.model, "bf16", vocab="hf") \
        if "llama.cpp" in args.servers else None
    # what llama.cpp may not sample: the stop ids and every special (added) token
    tj = json.load(open(os.path.join(args.model, "tokenizer.json"), encoding="utf-8"))
    args.banned_ids = sorted(set(vl.stop_ids(args.model, cfg)) |
                             {a["id"] for a in tj.get("added_tokens") or [] if a.get("special")})
    n_req = 1 + sum(args.requests or max(8, c) for c in args.levels)
    prompts = make_prompts(args, n_req)
    lens = sorted({len(x) for x in prompts[1]})
    log(f"serve_vs_llamacpp: {n_req} prompts of {lens} tokens; model {args.model} ({shape}); "
        f"cpu {cpu}; {args.rounds} rounds of {', '.join(args.servers)}")
    args.tok_check, args.warm_text = None, {}
    recs = []
    for rnd_no in range(args.rounds):
        order = args.servers[rnd_no % len(args.servers):] + args.servers[:rnd_no % len(args.servers)]
        for name in order:
            run_server(Server(name, args, gguf, py), args, prompts, rnd_no, recs)
    lines = summarize(args, recs, cpu, date, shape)
    lines.append({"bench": "serve-summary", "cpu": cpu, "date": date, "threads": args.threads,
                  "nproc": os.cpu_count(), "model": args.model, "shape": shape,
                  "prompt_tokens_tokenizer": lens, "levels": args.levels,
                  "rounds": args.rounds, "tokenize_same": args.tok_check,
                  "llama_logit_bias_ids": args.banned_ids, "gguf": gguf})
    for d in lines:
        print(json.dumps(d), flush=True)
    if args.json:
        with open(args.json, "a") as f:
            f.write("".join(json.dumps(d) + "\n" for d in lines))
    table(lines)
    return 0


if __name__ == "__main__":
    # SIGTERM / SIGHUP unwind like Ctrl-C, so the finally blocks stop the servers started.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda n, f: sys.exit(128 + n))
    sys.exit(main(sys.argv[1:]))
