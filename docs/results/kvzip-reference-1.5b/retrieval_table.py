#!/usr/bin/env python3
"""Per-sample kv-retrieval answers at 50 / 75 % removed: the engine's `kvzip:global` with
each prefix treatment against the NumPy reference's. Run from this directory."""
import json
from collections import defaultdict


def engine(path, label, task="kv-retrieval"):
    rows = {}
    for line in open(path):
        r = json.loads(line)
        if r["task"] == task and r["policy"].startswith("kvzip:global"):
            removed = {2048: "50 %", 1024: "75 %"}[r["kv_budget"]]
            rows[(label, removed, r["sample"])] = (r["score"], r["answer"].strip())
    return rows


def numpy(path):
    rows = {}
    for line in open(path):
        r = json.loads(line)
        if r["policy"] != "full":
            removed = f"{round(r['ratio'] * 100)} %"
            rows[(f"NumPy {r['policy']} (prefix={r['prefix']})", removed, r["sample"])] = (r["score"], r["answer"].strip())
    return rows


rows = {}
rows |= engine("../kvzip-retrieval-4k-8samples/results.jsonl", "engine kvzip:global (prefix=context)")
rows |= engine("retrieval-engine-prefix-kept-experiment.jsonl", "engine kvzip:global (prefix=kept)")
rows |= engine("retrieval-engine-prefix-kvpress.jsonl", "engine kvzip:global:prefix=kvpress")
rows |= numpy("retrieval-numpy.jsonl")
table = defaultdict(dict)
for (label, removed, sample), (score, _) in rows.items():
    table[(label, removed)][sample] = score
samples = sorted({s for v in table.values() for s in v})
print("| implementation | removed | " + " | ".join(f"s{s}" for s in samples) + " | correct |")
print("|---|---|" + "---|" * len(samples) + "---|")
for (label, removed), by in sorted(table.items(), key=lambda kv: (kv[0][1], kv[0][0])):
    cells = [("✓" if by[s] == 1.0 else "✗") if s in by else "–" for s in samples]
    print(f"| {label} | {removed} | " + " | ".join(cells) + f" | {sum(by.values()):.0f} of {len(by)} |")
# Where both miss at 75 %, the wrong answers side by side.
wrong = defaultdict(dict)
for (label, removed, sample), (score, answer) in rows.items():
    if removed == "75 %" and score < 1.0:
        wrong[sample][label] = answer
print()
for s in sorted(wrong):
    print(f"- sample {s}: " + "; ".join(f"{l}: {a}" for l, a in sorted(wrong[s].items())))
