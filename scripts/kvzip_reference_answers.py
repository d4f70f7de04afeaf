#!/usr/bin/env python3
"""KVzip's answers on `pagekeeper eval`'s generated tasks, from the NumPy second
implementation (issue 37): the same prompt and question ids (`OUT/generative-tokens.jsonl`,
written by every generative sweep), the same GGUF weights, query-agnostic as kvpress runs
it. For each sample: the prompt is prefilled, KVzip scores it by context reconstruction
(`kvpress_reference.kvzip_scores`), a share of its (layer, KV head, token) entries is
masked, then the question is read and the answer decoded greedily, and scored as
`pagekeeper eval` scores it (lower case, words of letters and digits, each expected
answer's words a contiguous run of the answer's).

    python3 scripts/kvzip_reference_answers.py MODEL.gguf OUT/generative-tokens.jsonl \
        --kvzip-ids IDS.json --ratios 0.5,0.75 --budgets global,floor=48 --prefix kvpress

`IDS.json` from `cargo run --release -p pk-tokenizer --example kvzip_ids -- MODEL.gguf`.
`--prefix`: how the chat template's prefix (the system turn and the user header, which
every prompt of a chat task starts with) is treated. `kvpress`: it is not repeated, its
first 4 tokens are the passes' sinks and the rest are scored 0, so a global budget drops
them first (kvpress 0.5.5). `kept`: it is not repeated, it is kept whole and all of it is
the passes' sinks (the authors' `attention/score.py`). `context`: the whole prompt is
repeated and scored, its first 4 tokens sinks (pagekeeper's `kvzip` before `prefix=`).
One JSON line per (sample, budget, ratio) and one for the full cache.
"""

import argparse
import json
import re

import numpy as np
from gguf import GGUFReader

import kvpress_reference as ref


def byte_decoder():
    """GPT-2's byte-level BPE alphabet, inverted: a vocabulary string back to bytes."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class Detokenizer:
    def __init__(self, path):
        r = GGUFReader(path)
        f = r.fields["tokenizer.ggml.tokens"]
        self.tokens = [bytes(f.parts[i]).decode("utf-8") for i in f.data]
        self.eos = {int(r.fields[k].parts[r.fields[k].data[0]][0]) for k in ["tokenizer.ggml.eos_token_id"] if k in r.fields}
        self.eos |= {i for i, t in enumerate(self.tokens) if t in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>")}
        self.dec = byte_decoder()

    def text(self, ids):
        out = bytearray()
        for i in ids:
            t = self.tokens[i]
            if t.startswith("<|") and t.endswith("|>"):
                continue
            out += bytes(self.dec.get(c, ord("?")) for c in t)
        return out.decode("utf-8", errors="replace")


def words(text):
    return re.sub(r"[^0-9a-z]", " ", text.lower()).split()


def match_score(answer, expected):
    a = words(answer)
    hit = 0
    for e in expected:
        w = words(e)
        hit += any(a[i : i + len(w)] == w for i in range(len(a) - len(w) + 1)) if w else 0
    return hit / len(expected) if expected else 1.0


def answer(m, cache, n_prompt, question, max_tokens, eos):
    """Reads `question` after the (possibly masked) prompt cache, then decodes greedily."""
    pos = np.arange(n_prompt, n_prompt + len(question))
    logits, cache = m.forward(np.array(question), pos, cache, logit_rows=slice(-1, None))
    out, at = [], n_prompt + len(question)
    for _ in range(max_tokens):
        t = int(logits[-1].argmax())
        if t in eos:
            break
        out.append(t)
        logits, cache = m.forward(np.array([t]), np.array([at]), cache)
        at += 1
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("tokens", help="OUT/generative-tokens.jsonl of a pagekeeper eval sweep")
    ap.add_argument("--kvzip-ids", required=True)
    ap.add_argument("--ratios", default="0.5,0.75")
    ap.add_argument("--budgets", default="global", help="global (kvpress), floor=N (pagekeeper's kvzip:global), uniform, layer")
    ap.add_argument("--prefix", default="kvpress", choices=["kvpress", "kept", "context"])
    ap.add_argument("--tasks", default="", help="only these tasks (comma-separated)")
    ap.add_argument("--samples", default="", help="only these samples (comma-separated)")
    a = ap.parse_args()
    ids = json.load(open(a.kvzip_ids))
    m, detok = ref.Model(a.model), Detokenizer(a.model)
    tasks = set(filter(None, a.tasks.split(",")))
    samples = {int(x) for x in a.samples.split(",") if x}
    seen = set()
    for line in open(a.tokens):
        s = json.loads(line)
        key = (s["task"], s["context_tokens"], s["sample"])
        if key in seen or (tasks and s["task"] not in tasks) or (samples and s["sample"] not in samples):
            continue
        seen.add(key)
        prompt, question = s["prompt"], s["question"]
        if not question:
            raise SystemExit(f"{key}: no question ids; run the sweep with --query-agnostic")
        prefix = len(ids["prefix"]) if a.prefix != "context" and prompt[: len(ids["prefix"])] == ids["prefix"] else 0
        base = {"task": s["task"], "context_tokens": s["context_tokens"], "sample": s["sample"], "prefix": a.prefix, "prefix_tokens": prefix}
        _, full_cache = m.forward(np.array(prompt), np.arange(len(prompt)), None, logit_rows=slice(-1, None))
        full = detok.text(answer(m, full_cache, len(prompt), question, s["max_answer_tokens"], detok.eos))
        print(json.dumps(base | {"policy": "full", "score": match_score(full, s["expected"]), "answer": full}), flush=True)
        scores = ref.kvzip_scores(m, prompt, full_cache, ids, prefix=prefix, keep_prefix=a.prefix == "kept")
        for budget in a.budgets.split(","):
            for r in [float(x) for x in a.ratios.split(",")]:
                cache = ref.kvzip_compress(full_cache, scores, r, budget)
                text = detok.text(answer(m, cache, len(prompt), question, s["max_answer_tokens"], detok.eos))
                row = {"policy": f"kvzip:{budget}", "ratio": r, "score": match_score(text, s["expected"]), "answer": text}
                print(json.dumps(base | row), flush=True)


if __name__ == "__main__":
    main()
