#!/usr/bin/env python3
"""test_tokenizer_hf.py - the C tokenizer (gpu_client/runner/tokenizer.h, through
tests/conformance/tok_cli) against the `tokenizers` package on a generated corpus.

  test_tokenizer_hf.py --cli build/tests/tok_cli [--keep DIR] [--families qwen,kimi]
                       [--corpus-mb 1.0] [--verbose] [--write-corpus FILE]

1. A corpus of >= 1 MB (seeded, no network): prose in several scripts (CJK, Hangul, Arabic,
   Devanagari, Thai, Cyrillic, Greek, accented Latin), emoji with ZWJ sequences, skin tones,
   flags and keycaps, combining marks (NFC-sensitive, decomposed Hangul), source code from
   the Python stdlib on disk, runs of spaces / tabs / newlines / exotic whitespace, long
   digit strings, text that spells special tokens ("<|im_start|>", "<s>", near misses),
   invalid UTF-8 (bytes the C API gets raw, HF the same bytes decoded with
   errors="replace", the documented equivalent), empty records. Records are NUL-separated,
   so they may hold newlines.
2. Tokenizers trained by `tokenizers` itself on the corpus with each family's exact
   configuration: qwen (Qwen2/3), deepseek (DeepSeek-V3), mixtral-legacy (Prepend+Replace
   normalizer, byte_fallback), mixtral (Metaspace "first" pre-tokenizer), metaspace
   (Metaspace always + Digits + Metaspace decoder), gpt2 (ByteLevel with its own regex and
   add_prefix_space, legacy "a b" merges, continuing-prefix-free), and kimi: a
   tiktoken.model written from a trained byte-level model with Kimi's tokenizer_config.json;
   its oracle is transformers' own TikTokenConverter (tokenizers, with Kimi's pat_str),
   cross-checked on a sample against a direct port of tiktoken's rank merge, and the
   reference for tokenization_kimi.py's long-run cutting.
3. For every record: ids == encode(x, add_special_tokens=False) and (=True); decode with and
   without skip_special_tokens equal; the streaming decoder's concatenation == decode.
   Round trips (decode(encode(x)) == x) are counted where HF round-trips.
4. Last line: "test_tokenizer_hf: N passed, N failed" (one check = one family x record).

The corpus is the same in every run; the trained tokenizers may differ slightly between
runs (the BPE trainer breaks ties in hash order). --keep DIR keeps what a run used.
"""
import argparse
import base64
import glob
import json
import os
import random
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import unicodedata

import tokenizers
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
from tokenizers import pre_tokenizers, processors, trainers

SEED = 20260611

QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
DS_PATTERNS = [
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
]
# Kimi-K2's pat_str (tokenization_kimi.py), as gpu_client/runner/tok_json.c has it.
KIMI_PATTERN = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])

SPECIALS_IN_TEXT = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<s>", "</s>", "<unk>",
                    "<think>", "</think>", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>",
                    "<｜User｜>", "[BOS]", "[EOS]", "<|im_user|>", "<|im_middle|>",
                    "<|im_start", "<s", "< s>", "<|im_end|", "s>", "<<s>>", "<s><s>"]

# ---------------------------------------------------------------------------------------
# Corpus.

WORDS_EN = ("the of and to in is you that it he was for on are as with his they at be this have "
            "from or one had by word but not what all were we when your can said there use an each "
            "which she do how their if will up other about out many then them these so some her "
            "would make like him into time has look two more write go see number no way could people "
            "my than first water been call who oil its now find long down day did get come made may "
            "part tokenizer encoder decoder merge byte-level NFC Qwen DeepSeek Mixtral Kimi").split()
WORDS_LATIN = ("café naïve résumé jalapeño façade coöperate Müller Straße größer Ångström "
               "señor mañana élève où déjà garçon crème brûlée Dvořák Łódź Ærøskøbing "
               "Tiếng Việt có dấu Nguyễn Thị Minh Khai").split()
WORDS_CYR = "съешь же ещё этих мягких французских булок да выпей чаю Привет мир Ёлка".split()
WORDS_GREEK = "Ξεσκεπάζω την ψυχοφθόρα βδελυγμία Γειά σου Κόσμε ΣΊΣΥΦΟΣ σοφός".split()


def rand_range(rng, lo, hi, n):
    return "".join(chr(rng.randint(lo, hi)) for _ in range(n))


def cjk_sentence(rng):
    parts = []
    for _ in range(rng.randint(2, 6)):
        kind = rng.random()
        if kind < 0.5:
            parts.append(rand_range(rng, 0x4E00, 0x9FA5, rng.randint(2, 12)))
        elif kind < 0.7:
            parts.append(rand_range(rng, 0x3041, 0x3096, rng.randint(2, 8)))
        elif kind < 0.85:
            parts.append(rand_range(rng, 0x30A1, 0x30FA, rng.randint(2, 8)))
        else:
            parts.append(rand_range(rng, 0xAC00, 0xD7A3, rng.randint(2, 8)))
        parts.append(rng.choice(["，", "。", "、", "！", "？", "：", " ", "「", "」", ""]))
    return "".join(parts)


def arabic_sentence(rng):
    words = []
    for _ in range(rng.randint(3, 10)):
        w = rand_range(rng, 0x0621, 0x064A, rng.randint(2, 7))
        if rng.random() < 0.3:  # harakat
            w = "".join(c + (chr(rng.randint(0x064B, 0x0652)) if rng.random() < 0.5 else "") for c in w)
        words.append(w)
    return " ".join(words) + rng.choice(["؟", "،", ".", ""])


def devanagari_sentence(rng):
    words = []
    for _ in range(rng.randint(3, 9)):
        w = ""
        for _ in range(rng.randint(1, 4)):
            w += chr(rng.randint(0x0915, 0x0939))
            r = rng.random()
            if r < 0.4:
                w += chr(rng.randint(0x093E, 0x094C))
            elif r < 0.5:
                w += "\u094d"  # virama
        words.append(w)
    return " ".join(words) + rng.choice(["।", "", " ॥"])


def thai_sentence(rng):
    s = ""
    for _ in range(rng.randint(5, 25)):
        s += chr(rng.randint(0x0E01, 0x0E2E))
        if rng.random() < 0.3:
            s += rng.choice(["\u0e31", "\u0e34", "\u0e35", "\u0e36", "\u0e37", "\u0e38", "\u0e48", "\u0e49"])
        if rng.random() < 0.08:
            s += " "
    return s


EMOJI = ["😀", "🎉", "👍", "❤️", "🔥", "🚀", "🤖", "🐍", "✅", "⭐", "🇫🇷", "🇯🇵", "🏳️‍🌈",
         "👨‍👩‍👧‍👦", "👩🏽‍💻", "🧑🏿‍🚀", "👋🏻", "👋🏼", "👋🏽", "👋🏾", "👋🏿", "1️⃣", "#️⃣", "🫠",
         "👩‍❤️‍💋‍👨", "🏃‍♀️", "©️", "™", "☺︎"]


def emoji_sentence(rng):
    out = []
    for _ in range(rng.randint(2, 8)):
        out.append(rng.choice(EMOJI) * rng.choice([1, 1, 1, 2, 3]))
        if rng.random() < 0.5:
            out.append(" " + " ".join(rng.choice(WORDS_EN) for _ in range(rng.randint(1, 3))) + " ")
    return "".join(out)


def combining_sentence(rng):
    out = []
    for _ in range(rng.randint(3, 10)):
        w = ""
        for _ in range(rng.randint(1, 6)):
            w += rng.choice("aeiouAEIOUnNcCyYzZsS")
            for _ in range(rng.choice([0, 0, 1, 1, 2, 3])):
                w += chr(rng.randint(0x0300, 0x036F))
        out.append(w)
    extra = ["\u212b", "\u2126", "A\u030a", "\u1100\u1161\u11a8", "\u1112\u1161\u11ab\u1100\u1173\u11af",
             "e\u0301\u0301", "\u0915\u093c", "\ufb01", "\u2460", "x\u20dd", "ﬀ", "Ⅻ", "²"]
    out.append(rng.choice(extra))
    rng.shuffle(out)
    return " ".join(out)


def prose(rng, words):
    s = " ".join(rng.choice(words) for _ in range(rng.randint(4, 25)))
    if rng.random() < 0.3:
        s = s[0].upper() + s[1:]
    return s + rng.choice([".", "!", "?", ",", "", "...", ";", " :)"])


def english(rng):
    s = prose(rng, WORDS_EN)
    tweaks = [lambda x: x.upper(), lambda x: x.title(), lambda x: x.replace(" ", "  "),
              lambda x: x + " don't I'LL we've they'RE it's", lambda x: "HelloWorld CamelCase " + x,
              lambda x: x.replace(" ", "\t"), lambda x: x + "\n" + x, lambda x: "  " + x + "  ",
              lambda x: x]
    return rng.choice(tweaks)(s)


def digits(rng):
    k = rng.random()
    if k < 0.3:
        return "".join(rng.choice("0123456789") for _ in range(rng.randint(20, 200)))
    if k < 0.6:
        return " ".join(str(rng.randint(0, 10 ** rng.randint(1, 12))) for _ in range(rng.randint(2, 10)))
    if k < 0.8:
        return f"{rng.randint(0, 10**9):,}.{rng.randint(0, 99):02d} ٣٤٥ ४५६ ๓๔๕ ①②③ 1e-9 0x{rng.randint(0, 2**32):08X}"
    return f"v{rng.randint(0, 9)}.{rng.randint(0, 99)}.{rng.randint(0, 999)} 2026-11-30T06:10:00.123Z"


def whitespace(rng):
    pool = [" ", "  ", "\t", "\n", "\r\n", "\r", "\u00a0", "\u3000", "\u2028", "\u2003", "\x0b",
            "\x0c", "\u200b", "\ufeff", "\u0085", "\u1680", "\u202f"]
    out = ""
    for _ in range(rng.randint(2, 12)):
        out += "".join(rng.choice(pool) for _ in range(rng.randint(1, 6)))
        if rng.random() < 0.7:
            out += rng.choice(WORDS_EN)
    return out


def specials(rng):
    out = []
    for _ in range(rng.randint(2, 8)):
        r = rng.random()
        if r < 0.5:
            out.append(rng.choice(SPECIALS_IN_TEXT))
        else:
            out.append(prose(rng, WORDS_EN))
        out.append(rng.choice(["", " ", "\n", "  ", "\t"]))
    if rng.random() < 0.3:
        return "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n" + \
            prose(rng, WORDS_EN) + "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    return "".join(out)


INVALID = [b"\xff", b"\xfe\xff", b"\xc3(", b"\xe4\xb8", b"\xed\xa0\x80", b"\xc0\xaf", b"\xf4\x90\x80\x80",
           b"\xf0\x9f\x98", b"\x80\x80\x80", b"\xe2\x82", b"\xf8\x88\x80\x80\x80", b"\xc2"]


def invalid(rng):
    parts = []
    for _ in range(rng.randint(1, 6)):
        parts.append(prose(rng, WORDS_EN + WORDS_LATIN).encode())
        parts.append(rng.choice(INVALID))
        if rng.random() < 0.3:
            parts.append(cjk_sentence(rng).encode()[: rng.randint(1, 10)])  # cut inside a char
    return b"".join(parts)


def stdlib_code(rng, limit):
    root = sysconfig.get_paths()["stdlib"]
    names = ["textwrap.py", "heapq.py", "difflib.py", "json/decoder.py", "argparse.py", "string.py",
             "tokenize.py", "ast.py", "functools.py", "inspect.py"]
    out, size = [], 0
    for n in names:
        p = os.path.join(root, n)
        if not os.path.isfile(p):
            continue
        lines = open(p, encoding="utf-8", errors="replace").read().split("\n")
        i = 0
        while i < len(lines) and size < limit:
            k = rng.randint(1, 12)
            rec = "\n".join(lines[i:i + k])
            out.append(rec)
            size += len(rec.encode())
            i += k
        if size >= limit:
            break
    # Synthetic code if the stdlib is not where expected, so the corpus keeps its size.
    while size < limit:
        rec = "    " * rng.randint(0, 3) + f"def f_{rng.randint(0, 999)}(x, y=None):\n\treturn x + {rng.randint(0, 99)}  # note"
        out.append(rec)
        size += len(rec.encode())
    return out


def make_corpus(target_bytes, seed=SEED):
    """Records as bytes (some invalid UTF-8). Deterministic for a seed and Python version."""
    rng = random.Random(seed)
    makers = [(cjk_sentence, 10), (arabic_sentence, 5), (devanagari_sentence, 5), (thai_sentence, 4),
              (emoji_sentence, 6), (combining_sentence, 5), (english, 20), (digits, 5),
              (whitespace, 5), (specials, 8), (lambda r: prose(r, WORDS_LATIN), 6),
              (lambda r: prose(r, WORDS_CYR), 4), (lambda r: prose(r, WORDS_GREEK), 3)]
    total = sum(w for _, w in makers)
    recs = [b"", b"", b" ", b"\n", b"\t\t", "<s>".encode(), "<|im_start|>".encode(), b"a",
            "\u00e9".encode(), "e\u0301".encode(), b"\r\n\r\n", "▁".encode(), "<0x41>".encode(),
            " ▁▁ x".encode(), "   leading and trailing   ".encode(), "\u0130stanbul".encode()]
    code = stdlib_code(rng, target_bytes // 5)
    size = sum(len(r) for r in recs)
    ci = 0
    while size < target_bytes:
        r = rng.random()
        if r < 0.18 and ci < len(code):
            rec = code[ci].encode()
            ci += 1
        elif r < 0.24:
            rec = invalid(rng)
        elif r < 0.25:
            rec = b""
        else:
            x = rng.uniform(0, total)
            for f, w in makers:
                x -= w
                if x <= 0:
                    break
            s = f(rng)
            if rng.random() < 0.15:  # mixed scripts in one record
                g = rng.choice(makers)[0]
                s = s + rng.choice([" ", "\n", ""]) + g(rng)
            rec = s.encode()
        rec = rec.replace(b"\x00", b"")
        recs.append(rec)
        size += len(rec)
    return recs


def as_text(rec):
    return rec.decode("utf-8", "replace")


# ---------------------------------------------------------------------------------------
# Tokenizers, trained by `tokenizers` with each family's configuration.

def train_bpe(texts, vocab_size, pre, norm, specials, alphabet=None, limit_alphabet=None):
    tok = Tokenizer(models.BPE())
    if norm is not None:
        tok.normalizer = norm
    tok.pre_tokenizer = pre
    kw = dict(vocab_size=vocab_size, special_tokens=specials, show_progress=False)
    if alphabet is not None:
        kw["initial_alphabet"] = alphabet
    if limit_alphabet is not None:
        kw["limit_alphabet"] = limit_alphabet
    tok.train_from_iterator(texts, trainers.BpeTrainer(**kw))
    return tok


def with_added(tj, specs):
    """Sets the added_tokens of a tokenizer.json dict: (content, special, normalized, lstrip,
    rstrip, single_word); ids as HF assigns them (the vocab's id or the next one)."""
    vocab = tj["model"]["vocab"]
    nxt = len(vocab)
    out = []
    for content, special, normalized, lstrip, rstrip, single in specs:
        if content in vocab:
            i = vocab[content]
        else:
            i = nxt
            nxt += 1
        out.append({"id": i, "content": content, "single_word": single, "lstrip": lstrip,
                    "rstrip": rstrip, "normalized": normalized, "special": special})
    tj["added_tokens"] = out
    return tj


def bl(decoder=False):
    d = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return d


def build_qwen(texts):
    tok = train_bpe(texts, 6000,
                    pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN_PATTERN), "isolated"),
                                             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
                    normalizers.NFC(), ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                    alphabet=pre_tokenizers.ByteLevel.alphabet())
    tj = json.loads(tok.to_str())
    tj["model"].update({"continuing_subword_prefix": "", "end_of_word_suffix": "", "fuse_unk": False,
                        "byte_fallback": False, "ignore_merges": False, "dropout": None})
    tj["normalizer"] = {"type": "NFC"}
    tj["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": QWEN_PATTERN}, "behavior": "Isolated", "invert": False},
        bl()]}
    tj["post_processor"] = bl()
    tj["decoder"] = bl()
    with_added(tj, [("<|endoftext|>", True, False, False, False, False),
                    ("<|im_start|>", True, False, False, False, False),
                    ("<|im_end|>", True, False, False, False, False),
                    ("<think>", False, False, False, False, False),
                    ("</think>", False, False, False, False, False),
                    ("<tool_call>", False, False, False, False, False)])
    cfg = {"bos_token": None, "eos_token": "<|im_end|>", "add_bos_token": False}
    return tj, cfg


def build_deepseek(texts):
    bos, eos = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
    pre = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(p), "isolated") for p in DS_PATTERNS] +
                                  [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok = train_bpe(texts, 7000, pre, None, [bos, eos, "<｜▁pad▁｜>"],
                    alphabet=pre_tokenizers.ByteLevel.alphabet())
    tj = json.loads(tok.to_str())
    tj["normalizer"] = {"type": "Sequence", "normalizers": []}
    tj["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": p}, "behavior": "Isolated", "invert": False} for p in DS_PATTERNS
    ] + [{"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
    tj["post_processor"] = {"type": "TemplateProcessing",
                            "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                            "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                                     {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
                            "special_tokens": {bos: {"id": bos, "ids": [tj["model"]["vocab"][bos]], "tokens": [bos]}}}
    tj["decoder"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
    with_added(tj, [(bos, True, True, False, False, False), (eos, True, True, False, False, False),
                    ("<｜▁pad▁｜>", True, True, False, False, False),
                    ("<｜User｜>", False, True, False, False, False),
                    ("<｜Assistant｜>", False, True, False, False, False),
                    ("<think>", False, True, False, False, False),
                    ("</think>", False, True, False, False, False)])
    cfg = {"bos_token": {"__type": "AddedToken", "content": bos}, "eos_token": {"content": eos},
           "add_bos_token": True, "add_eos_token": False}
    return tj, cfg


BYTE_TOKENS = ["<0x%02X>" % b for b in range(256)]


def build_llama_vocab(texts):
    tok = train_bpe(texts, 4000,
                    pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True), None,
                    ["<unk>", "<s>", "</s>"] + BYTE_TOKENS, limit_alphabet=300)
    tj = json.loads(tok.to_str())
    tj["model"].update({"unk_token": "<unk>", "fuse_unk": True, "byte_fallback": True,
                        "ignore_merges": False, "dropout": None})
    tj["post_processor"] = {"type": "TemplateProcessing",
                            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                            "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                                     {"SpecialToken": {"id": "<s>", "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
                            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}}
    tj["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"},
        {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    with_added(tj, [("<unk>", True, False, False, False, False), ("<s>", True, False, False, False, False),
                    ("</s>", True, False, False, False, False)])
    cfg = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True, "add_eos_token": False}
    return tj, cfg


def build_mixtral_legacy(base):
    tj = json.loads(json.dumps(base[0]))
    tj["normalizer"] = {"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "▁"}, {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]}
    tj["pre_tokenizer"] = None
    return tj, base[1]


def build_mixtral(base):
    tj = json.loads(json.dumps(base[0]))
    tj["normalizer"] = None
    tj["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": False}
    return tj, base[1]


def build_metaspace(base):
    """Metaspace "always" with split, Digits, a Metaspace decoder after ByteFallback, and a
    normalized added token that is also lstrip / rstrip / single_word."""
    tj = json.loads(json.dumps(base[0]))
    tj["normalizer"] = {"type": "Sequence", "normalizers": [{"type": "NFKC"}, {"type": "Strip", "strip_left": False, "strip_right": True}]}
    tj["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": True},
        {"type": "Digits", "individual_digits": True}]}
    tj["decoder"] = {"type": "Sequence", "decoders": [{"type": "ByteFallback"},
                                                      {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": True},
                                                      {"type": "Fuse"}]}
    tj["post_processor"] = {"type": "Sequence", "processors": [tj["post_processor"], {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]}
    base_added = [(a["content"], a["special"], a["normalized"], a["lstrip"], a["rstrip"], a["single_word"])
                  for a in tj["added_tokens"]]
    with_added(tj, base_added + [("<think>", True, False, True, True, False),
                                 ("tokenizer", False, True, False, False, True),
                                 ("Kimi", False, False, False, False, True)])
    return tj, base[1]


def build_gpt2(texts):
    tok = train_bpe(texts, 3000, pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True),
                    normalizers.Lowercase(), ["<|endoftext|>"], alphabet=pre_tokenizers.ByteLevel.alphabet())
    tj = json.loads(tok.to_str())
    tj["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
    tj["normalizer"] = {"type": "Lowercase"}
    tj["decoder"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
    tj["post_processor"] = None
    tj["model"]["merges"] = ["#version: 0.2"] + [" ".join(m) for m in tj["model"]["merges"]]
    tj["model"]["ignore_merges"] = True
    with_added(tj, [("<|endoftext|>", True, False, False, False, False),
                    ("  ", False, False, False, False, False)])
    return tj, None


def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


KIMI_NAMED = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
              5: "<|start_header_id|>", 6: "<|end_header_id|>", 7: "[EOT]", 8: "<|im_system|>",
              9: "<|im_middle|>", 10: "<|im_start|>", 255: "<think>"}


def build_kimi(texts, workdir):
    """A tiktoken.model from a trained byte-level BPE (ranks = merge order) and Kimi's
    tokenizer_config.json; the oracle is transformers' TikTokenConverter."""
    tok = train_bpe(texts, 5000,
                    pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(KIMI_PATTERN), "isolated"),
                                             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
                    None, [], alphabet=pre_tokenizers.ByteLevel.alphabet())
    vocab = json.loads(tok.to_str())["model"]["vocab"]
    dec = {c: b for b, c in bytes_to_unicode().items()}
    ranks = {}
    for s, i in sorted(vocab.items(), key=lambda kv: kv[1]):
        ranks[bytes(dec[c] for c in s)] = len(ranks)
    path = os.path.join(workdir, "tiktoken.model")
    with open(path, "w") as f:
        for b, r in ranks.items():
            f.write(f"{base64.b64encode(b).decode()} {r}\n")
    n = len(ranks)
    names = [KIMI_NAMED.get(k, f"<|reserved_token_{n + k}|>") for k in range(256)]
    cfg = {"bos_token": "[BOS]", "eos_token": "[EOS]", "add_bos_token": False,
           "added_tokens_decoder": {str(n + k): {"content": KIMI_NAMED[k], "lstrip": False, "normalized": False,
                                                 "rstrip": False, "single_word": False, "special": True}
                                    for k in KIMI_NAMED}}
    from transformers.convert_slow_tokenizer import TikTokenConverter
    conv = TikTokenConverter(vocab_file=path, pattern=KIMI_PATTERN, extra_special_tokens=names)
    conv.load_tiktoken_bpe = lambda _url: ranks  # no tiktoken package: the same dict, read here
    hf = conv.converted()
    return hf, ranks, cfg


def tiktoken_reference(ranks, specials, pre_split, text):
    """tokenization_kimi.py's encode with tiktoken's algorithm written out: the text cut into
    400,000-char chunks and runs of at most 25,000 (non-)whitespace chars, special tokens
    split out, the pre-token regex (HF's pre_tokenize_str: same Oniguruma pattern), then
    tiktoken's _byte_pair_merge (the lowest-ranked adjacent pair merges first, leftmost on
    ties) on each piece that is not a token itself."""
    def bpe_long(piece):
        # The same rule with a heap of (rank, start, end) candidates, for the 25,000-byte
        # pieces of the long-run records (the plain loop below is quadratic).
        import heapq
        n = len(piece)
        end = list(range(1, n + 1))
        nxt = list(range(1, n)) + [-1]
        prv = list(range(-1, n - 1))
        alive = [True] * n
        heap = [(ranks[piece[i:i + 2]], i, i + 2) for i in range(n - 1) if piece[i:i + 2] in ranks]
        heapq.heapify(heap)
        while heap:
            r, i, e = heapq.heappop(heap)
            if not alive[i] or nxt[i] < 0 or end[nxt[i]] != e:
                continue  # stale
            j = nxt[i]
            end[i], alive[j], nxt[i] = end[j], False, nxt[j]
            if nxt[i] >= 0:
                prv[nxt[i]] = i
            for a, b in ((prv[i], end[i]), (i, end[nxt[i]] if nxt[i] >= 0 else -1)):
                if a >= 0 and b >= 0 and piece[a:b] in ranks:
                    heapq.heappush(heap, (ranks[piece[a:b]], a, b))
        return [ranks[piece[i:end[i]]] for i in range(n) if alive[i]]

    def bpe(piece):
        if piece in ranks:
            return [ranks[piece]]
        if len(piece) > 256:
            return bpe_long(piece)
        parts = [piece[i:i + 1] for i in range(len(piece))]
        while True:
            best, at = None, -1
            for i in range(len(parts) - 1):
                r = ranks.get(parts[i] + parts[i + 1])
                if r is not None and (best is None or r < best):
                    best, at = r, i
            if best is None:
                break
            parts[at:at + 2] = [parts[at] + parts[at + 1]]
        return [ranks[p] for p in parts]

    def split_runs(s, m=25000):
        if not s:
            yield s
            return
        cur, run, start = s[0].isspace(), 0, 0
        for i, ch in enumerate(s):
            sp = ch.isspace()
            if cur ^ sp:
                run, cur = 1, sp
            else:
                run += 1
                if run > m:
                    yield s[start:i]
                    start, run = i, 1
        yield s[start:]

    import re
    special_re = re.compile("|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True)))
    out = []
    subs = [sub for i in range(0, len(text), 400000) for sub in split_runs(text[i:i + 400000])]
    for sub in subs:
        i = 0
        for m in list(special_re.finditer(sub)) + [None]:
            end = m.start() if m else len(sub)
            if end > i:
                for piece, _ in pre_split(sub[i:end]):
                    out.extend(bpe(piece.encode()))
            if m:
                out.append(specials[m.group()])
                i = m.end()
    return out


# ---------------------------------------------------------------------------------------
# Running and comparing.

def run_cli(cli, path, recs):
    data = b"".join(r + b"\0" for r in recs)
    p = subprocess.run([cli, "-0", path, "run"], input=data, capture_output=True, timeout=600)
    if p.returncode != 0:
        raise RuntimeError(f"tok_cli {path} failed ({p.returncode}): {p.stderr.decode(errors='replace')[-2000:]}")
    lines = p.stdout.decode("utf-8").split("\n")[:-1]
    if len(lines) != len(recs):
        raise RuntimeError(f"tok_cli gave {len(lines)} results for {len(recs)} records")
    return [json.loads(x) for x in lines]


def compare(name, hf, recs, outs, verbose, failures):
    passed = failed = rt = 0
    for k, (rec, o) in enumerate(zip(recs, outs)):
        text = as_text(rec)
        e0 = hf.encode(text, add_special_tokens=False).ids
        e1 = hf.encode(text, add_special_tokens=True).ids
        problems = []
        if o["ids"] != e0:
            problems.append(f"ids {o['ids'][:40]} != hf {e0[:40]}")
        if o["ids_sp"] != e1:
            problems.append(f"ids_sp {o['ids_sp'][:40]} != hf {e1[:40]}")
        d0 = hf.decode(e0, skip_special_tokens=False)
        d1 = hf.decode(e0, skip_special_tokens=True)
        if o["dec"] != d0:
            problems.append(f"decode {o['dec'][:80]!r} != hf {d0[:80]!r}")
        if o["dec_skip"] != d1:
            problems.append(f"decode(skip) {o['dec_skip'][:80]!r} != hf {d1[:80]!r}")
        if o["stream"] != o["dec"]:
            problems.append(f"stream {o['stream'][:80]!r} != decode {o['dec'][:80]!r}")
        if d0 == text:
            rt += 1
        if problems:
            failed += 1
            if len(failures) < 40:
                failures.append(f"{name} record {k} {text[:60]!r}: " + "; ".join(problems))
        else:
            passed += 1
    return passed, failed, rt


def check_unit_dump(path):
    """Replays the expectations tests/unit/test_tokenizer.c dumped (MT_TOK_DUMP=path)
    through HF: each encode's ids and each decode's text must be what HF gives."""
    ok = bad = 0
    cache = {}
    for line in open(path, encoding="utf-8"):
        c = json.loads(line)
        js = c["json"].encode("latin-1").decode("utf-8")
        if js not in cache:
            cache[js] = Tokenizer.from_str(js)
        hf = cache[js]
        if "text" in c:
            text = c["text"].encode("latin-1").decode("utf-8", "replace")
            got = hf.encode(text, add_special_tokens=c["sp"]).ids
            want = c["want"]
        else:
            # Python cannot pass a negative id; the C API skips them like unknown ids.
            got = hf.decode([i for i in c["ids"] if i >= 0], skip_special_tokens=c["skip"])
            want = c["want"].encode("latin-1").decode("utf-8")
        if got == want:
            ok += 1
        else:
            bad += 1
            print(f"  unit expectation differs from HF: {c.get('text', c.get('ids'))!r}: "
                  f"test says {want!r}, HF {got!r}")
    print(f"test_tokenizer_hf: {ok} passed, {bad} failed")
    return 0 if bad == 0 else 1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cli", default="build/tests/tok_cli")
    ap.add_argument("--keep", help="write the tokenizers and corpus here and keep them")
    ap.add_argument("--families", default="qwen,deepseek,mixtral-legacy,mixtral,metaspace,gpt2,kimi")
    ap.add_argument("--corpus-mb", type=float, default=1.0)
    ap.add_argument("--write-corpus", help="write the records (NUL-terminated) to this file and exit")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--check-unit-dump", help="replay tests/unit/test_tokenizer.c's MT_TOK_DUMP file")
    a = ap.parse_args()
    if a.check_unit_dump:
        return check_unit_dump(a.check_unit_dump)
    t0 = time.time()
    recs = make_corpus(int(a.corpus_mb * 1e6))
    nbytes = sum(len(r) for r in recs)
    if a.write_corpus:
        with open(a.write_corpus, "wb") as f:
            f.write(b"".join(r + b"\0" for r in recs))
        print(f"wrote {len(recs)} records, {nbytes} bytes to {a.write_corpus}")
        return 0
    n_invalid = sum(1 for r in recs if as_text(r).encode() != r)
    print(f"corpus: {len(recs)} records, {nbytes} bytes ({n_invalid} with invalid UTF-8), "
          f"tokenizers {tokenizers.__version__}")
    texts = [as_text(r) for r in recs]
    train = texts[: len(texts) // 2]  # trained on half, checked on all
    work = a.keep or tempfile.mkdtemp(prefix="tok-conf-")
    os.makedirs(work, exist_ok=True)
    fams = a.families.split(",")
    total_p = total_f = 0
    failures = []
    llama = build_llama_vocab(train) if any(f.startswith(("mixtral", "metaspace")) for f in fams) else None
    for fam in fams:
        t1 = time.time()
        d = os.path.join(work, fam)
        os.makedirs(d, exist_ok=True)
        extra_p = extra_f = 0
        if fam == "kimi":
            hf, ranks, cfg = build_kimi(train, d)
            with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
                json.dump(cfg, f, ensure_ascii=False)
            # The oracle itself against tiktoken's algorithm, on a sample and on long runs.
            n = len(ranks)
            names = {hf.id_to_token(n + k): n + k for k in range(256)}
            pre = pre_tokenizers.Split(Regex(KIMI_PATTERN), "isolated").pre_tokenize_str
            sample = texts[::25] + ["7" * 30001 + " b", " " * 30010 + "x", "Ab" * 13000 + "\n" * 25500,
                                    "<|im_end|>" * 3000]
            for t in sample[:-4]:
                ref = tiktoken_reference(ranks, names, pre, t)
                if ref == hf.encode(t, add_special_tokens=False).ids:
                    extra_p += 1
                else:
                    extra_f += 1
                    failures.append(f"kimi oracle != tiktoken reference on {t[:60]!r}")
            # Long runs: tokenization_kimi.py cuts them; HF's converted tokenizer does not.
            long_out = run_cli(a.cli, d, [t.encode() for t in sample[-4:]])
            cut_matters = 0
            for t, o in zip(sample[-4:], long_out):
                ref = tiktoken_reference(ranks, names, pre, t)
                cut_matters += ref != hf.encode(t, add_special_tokens=False).ids
                if o["ids"] == ref:
                    extra_p += 1
                else:
                    extra_f += 1
                    failures.append(f"kimi long run {t[:20]!r}... != tokenization_kimi.py reference")
            # The long runs must be ones the cutting changes, or this check proves nothing.
            if cut_matters:
                extra_p += 1
            else:
                extra_f += 1
                failures.append("kimi: no long-run record is changed by the 25,000-char cutting")
        else:
            builders = {"qwen": lambda: build_qwen(train), "deepseek": lambda: build_deepseek(train),
                        "mixtral-legacy": lambda: build_mixtral_legacy(llama), "mixtral": lambda: build_mixtral(llama),
                        "metaspace": lambda: build_metaspace(llama), "gpt2": lambda: build_gpt2(train)}
            tj, cfg = builders[fam]()
            with open(os.path.join(d, "tokenizer.json"), "w") as f:
                json.dump(tj, f, ensure_ascii=False)
            if cfg is not None:
                with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
                    json.dump(cfg, f, ensure_ascii=False)
            hf = Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
        outs = run_cli(a.cli, d, recs)
        p, f, rt = compare(fam, hf, recs, outs, a.verbose, failures)
        p += extra_p
        f += extra_f
        total_p += p
        total_f += f
        print(f"{'ok  ' if f == 0 else 'FAIL'} {fam:15s} {p} passed, {f} failed, round trips {rt}/{len(recs)}, "
              f"vocab {hf.get_vocab_size()}, {time.time() - t1:.1f}s")
    for x in failures[:40]:
        print("  " + x)
    if not a.keep:
        shutil.rmtree(work, ignore_errors=True)
    else:
        with open(os.path.join(work, "corpus.bin"), "wb") as f:
            f.write(b"".join(r + b"\0" for r in recs))
    print(f"{len(recs)} records, {nbytes} bytes, {len(fams)} families, {time.time() - t0:.1f}s")
    print(f"test_tokenizer_hf: {total_p} passed, {total_f} failed")
    return 0 if total_f == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
