#!/usr/bin/env python3
"""Writes tests/fixtures/kvzip-scores.json, the second implementation's KVzip scores and
kept sets for `crates/kv/tests/kvzip.rs`: random keys and pass queries of a small shape
(2 layers, 2 KV heads, 4 query heads, head_dim 8; a 40-token context in chunks of 20,
passes of 12 tokens), scored by `kvpress_reference.kvzip_layer_scores` (kvpress 0.5.5's
KVzipPress arithmetic in NumPy) and budgeted by `kvzip_compress`.

    python3 scripts/kvzip_fixture.py   # needs numpy
"""

import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from kvpress_reference import KVZIP_SINKS, kvzip_compress, kvzip_layer_scores  # noqa: E402

L, KV, H, D, N, CHUNK, R = 2, 2, 4, 8, 40, 20, 12
rng = np.random.default_rng(7)
# Context keys, then each pass's own keys after them (as the pool holds them).
keys = rng.standard_normal((L, KV, N + 2 * R, D)).astype(np.float32)
queries = rng.standard_normal((2, L, H, R, D)).astype(np.float32)  # [pass][layer][head][q][d]
scores = np.zeros((L, KV, N), np.float32)
scores[..., :KVZIP_SINKS] = 1.0
for c in range(2):
    start, end = c * CHUNK, (c + 1) * CHUNK
    sink = min(KVZIP_SINKS, start)
    for li in range(L):
        K = np.concatenate([keys[li, :, :N], keys[li, :, N + c * R : N + (c + 1) * R]], 1)
        scores[li, :, start:end] = kvzip_layer_scores(queries[c, li], K, sink, start, end, R)
cache = [(keys[li, :, :N], keys[li, :, :N]) for li in range(L)]
kept = {}
for budget in ["global", "layer", "uniform"]:
    masks = kvzip_compress(cache, scores, 0.5, budget)
    kept[budget] = [[int(t) for t in np.nonzero(masks[li][2][h])[0]] for li in range(L) for h in range(KV)]
out = {
    "shape": {"layers": L, "kv_heads": KV, "heads": H, "head_dim": D, "context": N, "chunk": CHUNK, "pass": R},
    "keys": keys.reshape(-1).tolist(),
    "queries": queries.reshape(-1).tolist(),
    "scores": scores.reshape(-1).tolist(),
    "kept_at_half": kept,
}
path = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "kvzip-scores.json")
with open(path, "w") as f:
    json.dump(out, f)
print(path)
