#!/usr/bin/env python3
"""The NOTE's tables from results.jsonl: per task and length, each policy/granularity's
mean over samples at each budget (score, or mean KL for text-kl), full cache in the title.
Usage: python3 tables.py [results.jsonl] > tables.md"""
import collections
import json
import os
import sys

ORDER = [
    "paged-eviction:ratio:global/shared", "paged-eviction:ratio:global/head",
    "paged-eviction:global/layer", "paged-eviction:global/head",
    "paged-eviction/shared", "paged-eviction/layer", "paged-eviction/head",
    "paged-eviction:inv-k-norm:global/head",
    "streaming-llm/shared", "keydiff/head", "snapkv/head",
]
TASKS = ["code-completion", "niah-multikey", "kv-retrieval", "passage-count", "text-kl"]
path = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "results.jsonl")
rows = [json.loads(line) for line in open(path)]
cells = collections.defaultdict(list)
full = collections.defaultdict(list)
for r in rows:
    value = r["kl_mean"] if r["task"] == "text-kl" else r["score"]
    if r["policy"] == "full":
        full[(r["task"], r["context_tokens"])].append(r["score"])
        continue
    frac = r["kv_budget"] / r["context_tokens"]
    cells[(r["task"], r["context_tokens"], f'{r["policy"]}/{r["kv_granularity"]}', frac)].append(value)
budgets = [0.125, 0.25, 0.5]
for task in TASKS:
    for length in sorted({k[1] for k in full if k[0] == task}):
        f = full[(task, length)]
        what = "mean KL (nats, lower is better)" if task == "text-kl" else f"score; full cache {sum(f) / len(f):.3f}"
        print(f"### {task}, {length} tokens ({what}, n={len(f)})\n")
        print("| policy | 12.5 % | 25 % | 50 % |\n|---|---|---|---|")
        for name in ORDER:
            vals = [cells.get((task, length, name, b)) for b in budgets]
            if not any(vals):
                continue
            text = [f"{sum(v) / len(v):.3f}" + ("" if len(v) == len(f) else f" (n={len(v)})") if v else "-" for v in vals]
            print(f"| {name} | " + " | ".join(text) + " |")
        print()
