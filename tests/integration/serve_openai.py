#!/usr/bin/env python3
"""serve_openai.py - `moerpc-client serve` against real clients (the `openai` package, raw
sockets for what a library will not send), with its cold experts on two expert servers.

Run by serve_openai.sh in the venv of deploy/py-env.sh (openai, transformers):

  python3 serve_openai.py BUILD_DIR

Processes it starts, on loopback, all with the reference kernels (MOERPC_ISA=ref):
  A  serve --cluster (two moerpc-server, half the experts each), --wire f32, 8 KV slots:
     the OpenAI surface, 16 concurrent streams, dropped clients, hostile HTTP, then an
     expert server killed mid-stream and restarted;
  B  serve all-local, 1 KV slot, --max-queue 2, --api-key-file, --drain-timeout 2: 429,
     401, SIGTERM cutting a stream (exit 1);
  C  serve all-local: SIGTERM with a short request running drains it (exit 0);
  D  serve --cluster pointing at a closed port: 503 "loading", then exit 1 naming it.

Each case prints "ok   serve_openai.NAME" or "FAIL serve_openai.NAME: why"; the last line
is "serve_openai: N passed, M failed, 0 skipped".
"""
import json
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

import openai

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "build"))
BIN = os.path.join(BUILD, "bin")
ENV = dict(os.environ, MOERPC_ISA="ref")
TMP = tempfile.mkdtemp(prefix="moerpc-serve-")
procs = []
passed = failed = 0


def ok(name):
    global passed
    passed += 1
    print(f"ok   serve_openai.{name}", flush=True)


def bad(name, why):
    global failed
    failed += 1
    print(f"FAIL serve_openai.{name}: {why}", flush=True)


def case(fn):
    """Runs one case; an exception is its failure, never the suite's."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - a case's failure, reported with its name
        bad(fn.__name__, f"{type(e).__name__}: {e}")
    return fn


def check(name, cond, why):
    if cond:
        ok(name)
    else:
        bad(name, why)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def start(args, log, env=ENV):
    f = open(log, "w")
    p = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, env=env)
    procs.append(p)
    return p


def wait_log(path, pattern, proc, timeout=60):
    t0 = time.time()
    while time.time() - t0 < timeout:
        with open(path) as f:
            m = re.search(pattern, f.read())
        if m:
            return m
        if proc.poll() is not None:
            raise RuntimeError(f"{path}: exited {proc.returncode} before /{pattern}/: {tail(path)}")
        time.sleep(0.05)
    raise RuntimeError(f"{path}: no /{pattern}/ after {timeout} s: {tail(path)}")


def tail(path, n=5):
    with open(path) as f:
        return " | ".join(f.read().splitlines()[-n:])


def start_expert(model, port, experts, name):
    log = os.path.join(TMP, f"{name}.log")
    p = start([f"{BIN}/moerpc-server", "--model", model, "--listen", f"127.0.0.1:{port}", "--experts", experts], log)
    wait_log(log, "serving", p)
    return p


def start_serve(name, *args):
    """A serve process on a free port; returns (proc, base_url, log)."""
    log = os.path.join(TMP, f"{name}.log")
    p = start([f"{BIN}/moerpc-client", "serve", "--listen", "127.0.0.1:0", *args], log)
    m = wait_log(log, r"listening on http://127\.0\.0\.1:(\d+)", p)
    url = f"http://127.0.0.1:{m.group(1)}"
    return p, url, log


def wait_ready(p, url, log, timeout=60):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if http(url + "/health")[0] == 200:
            return
        if p.poll() is not None:
            raise RuntimeError(f"serve exited {p.returncode}: {tail(log)}")
        time.sleep(0.05)
    raise RuntimeError(f"serve not ready after {timeout} s: {tail(log)}")


def http(url, body=None, headers=None, timeout=10):
    req = urllib.request.Request(url, data=body, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def metric(url, name):
    _, text = http(url + "/metrics")
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


def metric_label(url, name, label):
    _, text = http(url + "/metrics")
    for line in text.splitlines():
        if line.startswith(f"{name}{{{label}}}"):
            return float(line.rsplit(" ", 1)[1])
    return None


# ---- set-up ------------------------------------------------------------------------------------

model = os.path.join(TMP, "model")
subprocess.run([f"{BIN}/moerpc-mkmodel", "--out", model, "--layers", "2", "--experts", "8", "--seed", "7"],
               check=True, capture_output=True)
NAME = "model"
ports = [free_port(), free_port()]
experts = []
for i, rng in enumerate(["0-3", "4-7"]):
    experts.append(start_expert(model, ports[i], rng, f"s{i}"))
cluster = os.path.join(TMP, "cluster.json")
with open(cluster, "w") as f:
    json.dump({"model": model, "deadline_ms": 5000,
               "servers": [{"name": f"s{i}", "address": f"127.0.0.1:{p}"} for i, p in enumerate(ports)]}, f)

A, URL, ALOG = start_serve("serveA", "--model", model, "--cluster", cluster, "--wire", "f32", "--max-batch", "8",
                           "--max-queue", "64", "--quiet")
wait_ready(A, URL, ALOG)
cl = openai.OpenAI(base_url=URL + "/v1", api_key="unused", max_retries=0, timeout=60)

from transformers import AutoTokenizer  # noqa: E402 - slow to import: after the servers start

hf = AutoTokenizer.from_pretrained(model)
MSGS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "What is a mixture of experts?"}]
PROMPT = "Once upon a time, in a land of many experts,"

# ---- the OpenAI surface (A) --------------------------------------------------------------------


@case
def health_and_models():
    st, body = http(URL + "/health")
    models = [m.id for m in cl.models.list().data]
    check("health_and_models", st == 200 and json.loads(body)["status"] == "ok" and models == [NAME],
          f"/health {st} {body}, models {models}")


CHAT = {}


@case
def chat_usage_counts_template_tokens():
    r = cl.chat.completions.create(model=NAME, messages=MSGS, max_tokens=12, temperature=0)
    CHAT["r"] = r
    want = len(hf.apply_chat_template(MSGS, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
    u = r.usage
    check("chat_usage_counts_template_tokens",
          r.choices[0].finish_reason == "length" and u.completion_tokens == 12 and u.prompt_tokens == want
          and u.total_tokens == want + 12 and r.choices[0].message.role == "assistant" and r.object == "chat.completion",
          f"finish {r.choices[0].finish_reason}, usage {u}, template tokens {want}")


@case
def chat_stream_equals_answer():
    r = CHAT["r"]
    chunks = list(cl.chat.completions.create(model=NAME, messages=MSGS, max_tokens=12, temperature=0, stream=True,
                                             stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    first, last = chunks[0], chunks[-1]
    fins = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    check("chat_stream_equals_answer",
          text == r.choices[0].message.content and first.choices[0].delta.role == "assistant"
          and fins == ["length"] and last.choices == [] and last.usage.completion_tokens == 12
          and last.usage.prompt_tokens == r.usage.prompt_tokens and len(chunks) >= 4,
          f"stream {text!r} vs {r.choices[0].message.content!r}, finishes {fins}, last {last}")


@case
def completion_stream_and_answer():
    r = cl.completions.create(model=NAME, prompt=PROMPT, max_tokens=10, temperature=0)
    s = list(cl.completions.create(model=NAME, prompt=PROMPT, max_tokens=10, temperature=0, stream=True))
    text = "".join(c.choices[0].text for c in s)
    want = len(hf(PROMPT)["input_ids"])
    check("completion_stream_and_answer",
          r.usage.prompt_tokens == want and r.usage.completion_tokens == 10 and text == r.choices[0].text
          and s[-1].choices[0].finish_reason == "length" and r.object == "text_completion",
          f"usage {r.usage} (tokenizer: {want}), stream {text!r} vs {r.choices[0].text!r}")


@case
def max_completion_tokens_and_token_ids():
    ids = hf(PROMPT)["input_ids"]
    r = cl.completions.create(model=NAME, prompt=ids, max_tokens=5, temperature=0)
    t = cl.completions.create(model=NAME, prompt=PROMPT, max_tokens=5, temperature=0)
    c = cl.chat.completions.create(model=NAME, messages=MSGS, max_completion_tokens=3, temperature=0)
    check("max_completion_tokens_and_token_ids",
          r.choices[0].text == t.choices[0].text and r.usage.prompt_tokens == len(ids)
          and c.usage.completion_tokens == 3,
          f"ids {r.choices[0].text!r} vs text {t.choices[0].text!r}; chat {c.usage}")


@case
def stop_strings():
    full = cl.completions.create(model=NAME, prompt=PROMPT, max_tokens=24, temperature=0,
                                 extra_body={"ignore_eos": True}).choices[0].text
    mid = len(full) // 2
    stop = full[mid:mid + 3]
    if len(stop) < 3:
        return bad("stop_strings", f"no text to cut a stop string from: {full!r}")
    want = full[:full.index(stop)]
    r = cl.completions.create(model=NAME, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop, "\u2603never"],
                              extra_body={"ignore_eos": True})
    s = list(cl.completions.create(model=NAME, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop, stream=True,
                                   extra_body={"ignore_eos": True}))
    stext = "".join(c.choices[0].text for c in s)
    check("stop_strings",
          r.choices[0].text == want and r.choices[0].finish_reason == "stop" and stext == want
          and s[-1].choices[0].finish_reason == "stop",
          f"stop {stop!r}: got {r.choices[0].text!r} ({r.choices[0].finish_reason}), stream {stext!r}, want {want!r}")


@case
def seed_reproducible():
    def run(seed):
        return cl.completions.create(model=NAME, prompt=PROMPT, max_tokens=16, temperature=1.0, seed=seed,
                                     extra_body={"ignore_eos": True}).choices[0].text
    a, b, c = run(1234), run(1234), run(4321)
    check("seed_reproducible", a == b and a != c, f"seed 1234: {a!r} / {b!r}; seed 4321: {c!r}")


@case
def logprobs():
    r = cl.chat.completions.create(model=NAME, messages=MSGS, max_tokens=6, temperature=0, logprobs=True,
                                   top_logprobs=3)
    lp = r.choices[0].logprobs.content
    good = len(lp) == 6
    for e in lp:
        tops = [t.logprob for t in e.top_logprobs]
        good = good and len(tops) == 3 and tops == sorted(tops, reverse=True) and abs(tops[0] - e.logprob) < 1e-6 \
            and e.logprob <= 0 and e.token == e.top_logprobs[0].token
    joined = "".join(e.token for e in lp)
    c = cl.completions.create(model=NAME, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2)
    cl_ = c.choices[0].logprobs
    good_c = len(cl_.tokens) == 4 and len(cl_.token_logprobs) == 4 and all(len(t) <= 2 for t in cl_.top_logprobs)
    check("logprobs", good and joined == r.choices[0].message.content and good_c,
          f"chat {lp[:2]}..., text {r.choices[0].message.content!r} vs tokens {joined!r}; completions {cl_}")


@case
def concurrent_streams_match_alone():
    prompts = [f"Request number {i}: " + "tell me about experts " * (1 + i % 5) for i in range(16)]
    alone = [cl.completions.create(model=NAME, prompt=p, max_tokens=20, temperature=0,
                                   extra_body={"ignore_eos": True}).choices[0].text for p in prompts]
    together = [None] * 16
    errs = []

    def one(i):
        try:
            s = cl.completions.create(model=NAME, prompt=prompts[i], max_tokens=20, temperature=0, stream=True,
                                      extra_body={"ignore_eos": True})
            together[i] = "".join(c.choices[0].text for c in s)
        except Exception as e:  # noqa: BLE001
            errs.append(f"{i}: {e}")
    ts = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    diff = [i for i in range(16) if together[i] != alone[i]]
    check("concurrent_streams_match_alone", not errs and not diff,
          f"errors {errs}; differ at {diff}: {[(alone[i], together[i]) for i in diff[:2]]}")


def raw_request(path, body, read_bytes=0):
    """Sends a POST by hand; reads read_bytes of the answer (0: none); returns the socket."""
    s = socket.create_connection(("127.0.0.1", int(URL.rsplit(":", 1)[1])))
    data = json.dumps(body).encode()
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    got = b""
    while len(got) < read_bytes:
        b = s.recv(65536)
        if not b:
            break
        got += b
    return s


def wait_metric(url, name, pred, timeout=5.0):
    t0 = time.time()
    v = None
    while time.time() - t0 < timeout:
        v = metric(url, name)
        if v is not None and pred(v):
            return True, v, time.time() - t0
        time.sleep(0.02)
    return False, v, time.time() - t0


@case
def dropped_clients_free_their_slots():
    before = metric_label(URL, "moerpc_serve_requests_finished_total", 'reason="cancelled"') or 0
    body = {"prompt": PROMPT, "max_tokens": 3000, "stream": True, "ignore_eos": True}
    s1 = raw_request("/v1/completions", body, read_bytes=600)  # a stream under way
    s2 = raw_request("/v1/completions", dict(body, stream=False))  # an answer awaited
    up, n, _ = wait_metric(URL, "moerpc_serve_running_sequences", lambda v: v == 2)
    s1.close()
    s2.close()
    freed, v, secs = wait_metric(URL, "moerpc_serve_running_sequences", lambda v: v == 0)
    after = metric_label(URL, "moerpc_serve_requests_finished_total", 'reason="cancelled"') or 0
    check("dropped_clients_free_their_slots", up and freed and after - before == 2 and secs < 2,
          f"running {n} while both ran, {v} after {secs:.2f} s; cancelled {before} -> {after}")


@case
def errors_in_openai_shape():
    probs = []
    try:
        cl.chat.completions.create(model="not-this-one", messages=MSGS, max_tokens=2)
        probs.append("unknown model answered")
    except openai.NotFoundError as e:
        if e.body.get("code") != "model_not_found" or e.body.get("param") != "model":
            probs.append(f"404 body {e.body}")
    try:
        cl.chat.completions.create(model=NAME, messages=MSGS, max_tokens=10 ** 6)
        probs.append("max_tokens over the context answered")
    except openai.BadRequestError as e:
        if e.body.get("param") != "max_tokens" or "--max-seq" not in e.body.get("message", ""):
            probs.append(f"context 400 body {e.body}")
    try:
        cl.chat.completions.create(model=NAME, messages=MSGS, extra_body={"temperature": "hot"})
        probs.append("a string temperature answered")
    except openai.BadRequestError as e:
        if e.body.get("param") != "temperature":
            probs.append(f"temperature 400 body {e.body}")
    try:
        cl.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x" * 20000}], max_tokens=2)
        probs.append("a prompt over --max-seq answered")
    except openai.BadRequestError as e:
        if e.body.get("code") != "context_length_exceeded":
            probs.append(f"long prompt body {e.body}")
    st, body = http(URL + "/v1/chat/completions", b'{"messages": [', {"Content-Type": "application/json"})
    if st != 400 or "invalid JSON" not in json.loads(body)["error"]["message"]:
        probs.append(f"malformed JSON: {st} {body}")
    check("errors_in_openai_shape", not probs, "; ".join(probs))


# ---- hostile HTTP (A) --------------------------------------------------------------------------

def served_quickly():
    """/health and a short chat, each answered within a second."""
    t0 = time.time()
    st, _ = http(URL + "/health", timeout=2)
    t1 = time.time()
    r = cl.chat.completions.create(model=NAME, messages=MSGS, max_tokens=2, temperature=0, timeout=5)
    t2 = time.time()
    return st == 200 and r.usage.completion_tokens == 2 and t1 - t0 < 1 and t2 - t1 < 1, \
        f"/health {st} in {t1 - t0:.3f} s, chat in {t2 - t1:.3f} s"


@case
def oversized_body_413():
    big = b'{"prompt": "' + b"x" * (9 << 20) + b'"}'
    try:
        st, body = http(URL + "/v1/completions", big, {"Content-Type": "application/json"})
    except (ConnectionError, urllib.error.URLError) as e:  # the server may close while we still send
        st, body = 413, f"(connection closed while sending: {e})"
    good, why = served_quickly()
    check("oversized_body_413", st == 413 and good, f"{st} {body[:200]}; then {why}")


@case
def slowloris_heads_do_not_stall_others():
    port = int(URL.rsplit(":", 1)[1])
    socks = []
    for _ in range(64):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        socks.append(s)
    results = []
    for _ in range(3):
        for s in socks:
            try:
                s.sendall(b"X-Slow: 1\r\n")
            except OSError:
                pass
        results.append(served_quickly())
        time.sleep(0.3)
    for s in socks:
        s.close()
    check("slowloris_heads_do_not_stall_others", all(g for g, _ in results), str([w for _, w in results]))


@case
def ten_thousand_idle_connections():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 10000
    if hard < want + 500:
        return bad("ten_thousand_idle_connections", f"this process may open {hard} files, the case needs {want + 500}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    port = int(URL.rsplit(":", 1)[1])
    socks = []
    try:
        for _ in range(want):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            s.connect(("127.0.0.1", port))
            socks.append(s)
        time.sleep(0.5)
        good, why = served_quickly()
    finally:
        for s in socks:
            s.close()
    good2, why2 = served_quickly()
    check("ten_thousand_idle_connections", good and good2, f"with {len(socks)} idle: {why}; after: {why2}")


# ---- an expert server killed mid-stream, then restarted (A) ------------------------------------

@case
def killed_expert_server_ends_streams_with_an_error_naming_it():
    stream = cl.completions.create(model=NAME, prompt=PROMPT, max_tokens=3000, temperature=0, stream=True,
                                   extra_body={"ignore_eos": True})
    got, err = 0, None
    try:
        for c in stream:
            got += 1
            if got == 5:
                experts[1].kill()
                experts[1].wait()
    except openai.APIError as e:
        err = str(e)
    name_ok = err is not None and "s1" in err and f"127.0.0.1:{ports[1]}" in err
    st, body = http(URL + "/v1/completions", json.dumps({"prompt": PROMPT, "max_tokens": 2}).encode(),
                    {"Content-Type": "application/json"})
    down_ok = st == 502 and "s1" in body
    experts[1] = start_expert(model, ports[1], "4-7", "s1-restarted")
    t0, back = time.time(), None
    while time.time() - t0 < 30:
        st2, body2 = http(URL + "/v1/completions", json.dumps({"prompt": PROMPT, "max_tokens": 2}).encode(),
                          {"Content-Type": "application/json"})
        if st2 == 200:
            back = time.time() - t0
            break
        time.sleep(0.2)
    check("killed_expert_server_ends_streams_with_an_error_naming_it", name_ok and down_ok and back is not None,
          f"after {got} chunks: {err!r}; while down: {st} {body[:160]}; back after {back} s")


# ---- B: queue, key, drain ----------------------------------------------------------------------

keyfile = os.path.join(TMP, "key")
with open(os.open(keyfile, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
    f.write("sk-moerpc-test\n")  # 0600: a key file readable by others is refused
B, BURL, BLOG = start_serve("serveB", "--model", model, "--max-batch", "1", "--max-queue", "2", "--api-key-file",
                            keyfile, "--drain-timeout", "2", "--quiet")
wait_ready(B, BURL, BLOG)
bc = openai.OpenAI(base_url=BURL + "/v1", api_key="sk-moerpc-test", max_retries=0, timeout=120)


@case
def api_key():
    probs = []
    c = openai.OpenAI(base_url=BURL + "/v1", api_key="wrong", max_retries=0)
    try:
        c.completions.create(model=NAME, prompt="x", max_tokens=1)
        probs.append("a wrong key answered")
    except openai.AuthenticationError as e:
        if e.body.get("code") != "invalid_api_key":
            probs.append(f"401 body {e.body}")
    st, body = http(BURL + "/v1/completions", b'{"prompt": "x"}', {"Content-Type": "application/json"})
    if st != 401 or json.loads(body)["error"]["code"] != "invalid_api_key":
        probs.append(f"without a key: {st} {body}")
    st, body = http(BURL + "/v1/models")
    if st != 401:
        probs.append(f"/v1/models without a key: {st}")
    r = bc.completions.create(model=NAME, prompt="x", max_tokens=1)
    st, _ = http(BURL + "/health")
    check("api_key", not probs and r.usage.completion_tokens == 1 and st == 200, f"{probs}; /health {st}")


@case
def overload_429_and_the_rest_served():
    out = []

    def one(i):
        try:
            r = bc.completions.create(model=NAME, prompt=f"{i} {PROMPT}", max_tokens=150, temperature=0,
                                      extra_body={"ignore_eos": True})
            out.append(("ok", r.usage.completion_tokens))
        except openai.RateLimitError as e:
            out.append(("429", e.body.get("code")))
        except Exception as e:  # noqa: BLE001
            out.append(("other", str(e)))
    ts = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in ts:
        t.start()
        time.sleep(0.01)
    for t in ts:
        t.join()
    oks = [x for x in out if x[0] == "ok"]
    limited = [x for x in out if x[0] == "429"]
    after = bc.completions.create(model=NAME, prompt="x", max_tokens=2).usage.completion_tokens
    n429 = metric_label(BURL, "moerpc_serve_http_requests_total", 'code="429"')
    check("overload_429_and_the_rest_served",
          len(oks) >= 3 and all(n == 150 for _, n in oks) and limited and all(c == "queue_full" for _, c in limited)
          and len(oks) + len(limited) == 8 and after == 2 and n429 == len(limited),
          f"{out}; then {after} tokens; 429s counted {n429}")


@case
def sigterm_cuts_a_stream_past_the_drain_timeout():
    stream = bc.completions.create(model=NAME, prompt=PROMPT, max_tokens=4000, temperature=0, stream=True,
                                   extra_body={"ignore_eos": True})
    got, err, health = 0, None, None
    try:
        for c in stream:
            got += 1
            if got == 3:
                B.send_signal(signal.SIGTERM)
                time.sleep(0.1)
                health = http(BURL + "/health")
    except openai.APIError as e:
        err = str(e)
    rc = B.wait(timeout=20)
    check("sigterm_cuts_a_stream_past_the_drain_timeout",
          err is not None and "shutting down" in err and rc == 1 and health and health[0] == 503
          and "draining" in health[1],
          f"after {got} chunks: {err!r}; /health during the drain {health}; exit {rc}: {tail(BLOG, 3)}")


@case
def sigterm_drains_a_short_request():
    C, CURL, CLOG = start_serve("serveC", "--model", model, "--drain-timeout", "30", "--quiet")
    wait_ready(C, CURL, CLOG)
    cc = openai.OpenAI(base_url=CURL + "/v1", api_key="x", max_retries=0)
    stream = cc.completions.create(model=NAME, prompt=PROMPT, max_tokens=60, temperature=0, stream=True,
                                   extra_body={"ignore_eos": True})
    text, fin = "", None
    for i, c in enumerate(stream):
        if i == 2:
            C.send_signal(signal.SIGTERM)
        text += c.choices[0].text
        fin = c.choices[0].finish_reason or fin
    rc = C.wait(timeout=30)
    check("sigterm_drains_a_short_request", fin == "length" and rc == 0, f"finish {fin}, exit {rc}: {tail(CLOG, 3)}")


@case
def loading_answers_503_and_an_unreachable_cluster_exits_1():
    dead = os.path.join(TMP, "dead.json")
    port = free_port()
    with open(dead, "w") as f:
        json.dump({"model": model, "servers": [{"name": "gone", "address": f"127.0.0.1:{port}"}]}, f)
    D, DURL, DLOG = start_serve("serveD", "--model", model, "--cluster", dead, "--connect-timeout-ms", "3000")
    st, body = http(DURL + "/health")
    st2, body2 = http(DURL + "/v1/completions", b'{"prompt": "x"}', {"Content-Type": "application/json"})
    rc = D.wait(timeout=30)
    log = open(DLOG).read()
    check("loading_answers_503_and_an_unreachable_cluster_exits_1",
          st == 503 and "loading" in body and st2 == 503 and "loading" in body2 and rc == 1
          and ("gone" in log or str(port) in log),
          f"/health {st} {body}; completion {st2} {body2}; exit {rc}: {tail(DLOG, 3)}")


# ---- the end -----------------------------------------------------------------------------------

A.send_signal(signal.SIGTERM)
try:
    rc = A.wait(timeout=30)
    check("serve_exits_0_after_a_clean_drain", rc == 0, f"exit {rc}: {tail(ALOG, 3)}")
except subprocess.TimeoutExpired:
    bad("serve_exits_0_after_a_clean_drain", "still running 30 s after SIGTERM")
for p in procs:
    if p.poll() is None:
        p.kill()
        p.wait()
subprocess.run(["rm", "-rf", TMP])
print(f"serve_openai: {passed} passed, {failed} failed, 0 skipped")
sys.exit(1 if failed else 0)
