#!/usr/bin/env python3
"""Issue 37's retrieval table from results.jsonl (this folder's, or that of the folder given
as the argument): mean exact-match score per task, policy and
share of the context removed (4,096-token contexts, query-agnostic), each with its sample
count, and every policy's mean over the tasks as a fraction of the full cache's."""
import collections
import json
import pathlib
import statistics
import sys

here = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else pathlib.Path(__file__).parent
rows = [json.loads(l) for l in open(here / "results.jsonl")]
cells = collections.defaultdict(list)
for r in rows:
    cells[(r["task"], r["policy"], r["kv_budget"])].append(r["score"])
tasks = sorted({r["task"] for r in rows})
policies = [p for p in ["kvzip:global", "kvzip:global:floor=4", "kvzip", "keydiff", "snapkv",
                        "streaming-llm", "expected-attention", "paged-eviction"]
            if any(k[1] == p for k in cells)]
budgets = sorted({r["kv_budget"] for r in rows if r["kv_budget"]}, reverse=True)
context = 4096


def mean(v):
    return statistics.mean(v) if v else float("nan")


print("| policy | removed | " + " | ".join(tasks) + " | mean | of full |")
print("|---|---|" + "---|" * len(tasks) + "---|---|")
full = {t: mean(cells[(t, "full", None)]) for t in tasks}
full_mean = mean(list(full.values()))
print("| full | 0 % | " + " | ".join(f"{full[t]:.2f} (n={len(cells[(t, 'full', None)])})" for t in tasks)
      + f" | {full_mean:.2f} | 100 % |")
for p in policies:
    for b in budgets:
        per = [mean(cells[(t, p, b)]) for t in tasks]
        m = mean([x for x in per if x == x])
        removed = 100 * (1 - b / context)
        print(f"| {p} | {removed:.0f} % | "
              + " | ".join(f"{x:.2f} (n={len(cells[(t, p, b)])})" for t, x in zip(tasks, per))
              + f" | {m:.2f} | {100 * m / full_mean:.0f} % |")


# Samples the full cache answers: a policy can only lose those, so the share of them it
# keeps is the cleaner measure where the full cache misses some.
print()
print("| policy | removed | of the samples full answers |")
print("|---|---|---|")
answered = {(r["task"], r["sample"]) for r in rows if r["policy"] == "full" and r["score"] == 1.0}
for p in policies:
    for b in budgets:
        kept = [r["score"] for r in rows
                if r["policy"] == p and r["kv_budget"] == b and (r["task"], r["sample"]) in answered]
        removed = 100 * (1 - b / context)
        print(f"| {p} | {removed:.0f} % | {sum(kept):.1f} of {len(kept)} ({100 * mean(kept):.0f} %) |")
