#!/usr/bin/env python3
"""Kept sets of pagekeeper against a second implementation, per (layer, KV head).

ENGINE: lines of `cargo run --release -p pk-engine --example kept_sets` (units with one
layer and one KV head each). REFERENCE: lines of `scripts/kvpress_reference.py
--dump-kept` (`kept[layer][head]`). Budgets pair with ratios by
`budget = prompt_tokens * (1 - ratio)`.

Overlap of a (layer, head): |E ∩ R| / max(|E|, |R|), so that keeping more or fewer tokens
than the reference counts against it as much as keeping other ones. Prints, per ratio,
the mean, 10th percentile and minimum overlap over every (sample, layer, head), the share
of heads at or above 0.9, and the mean counts kept; then the same share over the heads
where the reference keeps at least `--floor` tokens (default 16). Over a handful of tokens
one differing token moves a head's overlap by 0.1 or more, and pagekeeper always keeps a
head's 4 sinks where kvpress, on a context without a chat-template prefix, scores them as
any other token of the first chunk.

Usage: compare_kept_sets.py ENGINE.jsonl REFERENCE.jsonl [--press kvzip]
"""
import argparse
import json
import statistics


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("engine")
    ap.add_argument("reference")
    ap.add_argument("--press", default="kvzip")
    ap.add_argument("--floor", type=int, default=16)
    a = ap.parse_args()
    ref = {}
    for line in open(a.reference):
        r = json.loads(line)
        if r["press"] == a.press:
            ref[(r["sample"], round(r["ratio"], 4))] = r["kept"]
    per_ratio = {}
    for line in open(a.engine):
        e = json.loads(line)
        ratio = round(1 - e["budget"] / e["prompt_tokens"], 4)
        kept = ref.get((e["sample"], ratio))
        if kept is None:
            continue
        for u in e["units"]:
            assert len(u["layers"]) == 1 and u["kv_head"] is not None, "one (layer, head) per unit"
            mine, theirs = set(u["kept"]), set(kept[u["layers"][0]][u["kv_head"]])
            overlap = len(mine & theirs) / max(len(mine), len(theirs), 1)
            per_ratio.setdefault(ratio, []).append((overlap, len(mine), len(theirs), e["sample"]))
    print("| removed | samples | heads | mean overlap | p10 | min | heads >= 0.9 | reference keeps < floor | heads >= 0.9 of the rest | mean kept, ours | mean kept, reference |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for ratio, rows in sorted(per_ratio.items()):
        ov = sorted(r[0] for r in rows)
        p10 = ov[len(ov) // 10]
        share = sum(o >= 0.9 for o in ov) / len(ov)
        rest = [r[0] for r in rows if r[2] >= a.floor]
        rest_share = sum(o >= 0.9 for o in rest) / max(len(rest), 1)
        print(
            f"| {ratio * 100:.1f} % | {len({r[3] for r in rows})} | {len(rows)} | {statistics.mean(ov):.3f} | {p10:.3f} | {ov[0]:.3f} "
            f"| {share * 100:.0f} % | {len(rows) - len(rest)} | {rest_share * 100:.0f} % "
            f"| {statistics.mean(r[1] for r in rows):.0f} | {statistics.mean(r[2] for r in rows):.0f} |"
        )


if __name__ == "__main__":
    main()
