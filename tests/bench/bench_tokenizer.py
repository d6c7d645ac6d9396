#!/usr/bin/env python3
"""bench_tokenizer.py - encode throughput of the runner's tokenizer (gpu_client/runner,
through tests/conformance/tok_cli's bench mode) next to the `tokenizers` package, in the
same run, on the conformance corpus (tests/conformance/test_tokenizer_hf.py: 1 MB, seeded),
single thread, one call per record.

  .venv-conf/bin/python tests/bench/bench_tokenizer.py --cli build/tests/tok_cli
      [--families qwen,deepseek,mixtral,kimi] [--repeats 5] [--corpus-mb 1.0]

For each family the tokenizer is trained as the conformance test trains it; then
  - HF: `tok.encode(record, add_special_tokens=False)` for every record in a Python loop,
    TOKENIZERS_PARALLELISM=false (encode_batch is not used for this figure);
  - moerpc: gc_tok_encode for every record in a C loop (tok_cli bench: the records are read
    first, only the encode calls are timed);
rounds alternate the two, best round of --repeats for each (word caches warm). For information also
HF's encode_batch of all records on one thread (TOKENIZERS_PARALLELISM=false), which saves
the per-call Python overhead. Kimi's HF side is transformers' TikTokenConverter output (the
tokenizers equivalent of its tiktoken.model). One JSON line per family on stdout, with the
CPU model and the date; a table on stderr.
"""
import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

os.environ["TOKENIZERS_PARALLELISM"] = "false"

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "conformance"))
import test_tokenizer_hf as conf  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402


def cpu_model():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cli", default="build/tests/tok_cli")
    ap.add_argument("--families", default="qwen,deepseek,mixtral,kimi")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--corpus-mb", type=float, default=1.0)
    a = ap.parse_args()
    recs = conf.make_corpus(int(a.corpus_mb * 1e6))
    texts = [conf.as_text(r) for r in recs]
    nbytes = sum(len(r) for r in recs)
    train = texts[: len(texts) // 2]
    work = tempfile.mkdtemp(prefix="tok-bench-")
    cpu, date = cpu_model(), datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    llama = None
    print(f"{'family':10s} {'records':>8s} {'MB':>6s} {'HF MB/s':>9s} {'moerpc MB/s':>12s} {'ratio':>6s}"
          f" {'HF batch MB/s':>14s}", file=sys.stderr)
    for fam in a.families.split(","):
        d = os.path.join(work, fam)
        os.makedirs(d)
        if fam == "kimi":
            hf, _, cfg = conf.build_kimi(train, d)
        else:
            if fam in ("mixtral", "mixtral-legacy") and llama is None:
                llama = conf.build_llama_vocab(train)
            tj, cfg = {"qwen": lambda: conf.build_qwen(train), "deepseek": lambda: conf.build_deepseek(train),
                       "mixtral": lambda: conf.build_mixtral(llama),
                       "mixtral-legacy": lambda: conf.build_mixtral_legacy(llama)}[fam]()
            with open(os.path.join(d, "tokenizer.json"), "w") as f:
                json.dump(tj, f, ensure_ascii=False)
            hf = Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
        if cfg:
            with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
                json.dump(cfg, f, ensure_ascii=False)
        # Rounds alternate HF and moerpc, so that a load change on a shared machine hits
        # both; each side's best round counts (its word cache is warm from the second pass:
        # tok_cli bench makes two passes per process and reports the faster).
        data = b"".join(r + b"\0" for r in recs)
        best, hf_tokens, ours = 1e30, 0, None
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            n = 0
            for x in texts:
                n += len(hf.encode(x, add_special_tokens=False).ids)
            best = min(best, time.perf_counter() - t0)
            hf_tokens = n
            p = subprocess.run([a.cli, "-0", d, "bench", "2"], input=data, capture_output=True, check=True)
            o = json.loads(p.stdout)
            if ours is None or o["seconds"] < ours["seconds"]:
                ours = o
        hf_mbs = nbytes / 1e6 / best
        best_b = 1e30
        for _ in range(max(1, a.repeats // 2)):
            t0 = time.perf_counter()
            hf.encode_batch(texts, add_special_tokens=False)
            best_b = min(best_b, time.perf_counter() - t0)
        row = {"bench": "tokenizer_encode", "family": fam, "records": len(recs), "bytes": nbytes,
               "hf_tokenizers": conf.tokenizers.__version__, "hf_mb_per_s": round(hf_mbs, 3),
               "moerpc_mb_per_s": ours["mb_per_s"], "ratio": round(ours["mb_per_s"] / hf_mbs, 3),
               "hf_batch_1thread_mb_per_s": round(nbytes / 1e6 / best_b, 3),
               "tokens_hf": hf_tokens, "tokens_moerpc": ours["tokens"],
               "same_token_count": hf_tokens == ours["tokens"], "repeats": a.repeats, "cpu": cpu,
               "date": date}
        print(json.dumps(row))
        sys.stdout.flush()
        print(f"{fam:10s} {len(recs):8d} {nbytes / 1e6:6.2f} {hf_mbs:9.2f} {ours['mb_per_s']:12.2f} "
              f"{row['ratio']:6.2f} {row['hf_batch_1thread_mb_per_s']:14.2f}", file=sys.stderr)
    print(f"cpu: {cpu}; {date}; tokenizers {conf.tokenizers.__version__}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
