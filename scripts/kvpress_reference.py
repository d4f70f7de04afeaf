#!/usr/bin/env python3
"""A second implementation for issue 18's comparison: kvpress 0.5.5's presses (SnapKV,
StreamingLLM, KNorm, KeyDiff: per layer, per KV head, at prefill only, as
`ScorerPress.compress` does) over a plain NumPy Llama forward pass on the same GGUF
weights (dequantised by the `gguf` package) and the same token spans that `pagekeeper eval`
scored (its `OUT/text-kl-tokens.jsonl`). It prints top-1 agreement and KL against the full
cache with pagekeeper's metric (rows 1.. of the teacher-forced continuation), so the two
implementations are compared on identical text and weights; only the arithmetic differs
(f32 activations here, 8-bit quantised activations in pagekeeper's kernels).

    python3 -m venv /tmp/refvenv && /tmp/refvenv/bin/pip install numpy gguf
    /tmp/refvenv/bin/python scripts/kvpress_reference.py MODEL.gguf OUT/text-kl-tokens.jsonl \
        --ratios 0.5,0.75,0.875 --presses snapkv,streaming-llm,knorm,keydiff

KVzip (issue 37; kvpress's `KVzipPress`, query-agnostic by construction): presses `kvzip`
(one threshold over all scores, kvpress's default), `kvzip:layer` (kvpress's layerwise) and
`kvzip:uniform` (the same count per KV head), with `--kvzip-ids FILE`, the token ids of
the reconstruction prompts in the model's vocabulary (`scripts/kvzip_ids.sh MODEL`).

Llama (SmolLM2) only: RoPE as GGUF stores Q/K (adjacent pairs), tied or separate output.
"""

import argparse
import json
import math

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


class Model:
    def __init__(self, path):
        r = GGUFReader(path)
        f = {k: v.parts[v.data[0]] for k, v in r.fields.items() if v.data}
        self.n_layers = int(f["llama.block_count"][0])
        self.n_heads = int(f["llama.attention.head_count"][0])
        self.n_kv = int(f["llama.attention.head_count_kv"][0])
        self.dim = int(f["llama.embedding_length"][0])
        self.hd = self.dim // self.n_heads
        self.eps = float(f["llama.attention.layer_norm_rms_epsilon"][0])
        self.theta = float(f["llama.rope.freq_base"][0])
        t = {x.name: x for x in r.tensors}

        def w(name):
            x = t[name]
            return np.ascontiguousarray(dequantize(x.data, x.tensor_type).reshape(*reversed([int(s) for s in x.shape])).astype(np.float32))

        self.embd = w("token_embd.weight")
        self.out = w("output.weight") if "output.weight" in t else self.embd
        self.out_norm = w("output_norm.weight")
        self.layers = []
        for i in range(self.n_layers):
            p = f"blk.{i}."
            self.layers.append({k: w(p + k + ".weight") for k in ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"]})

    def rms(self, x, g):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + self.eps) * g

    def rope(self, x, pos):
        # x: [n, heads, hd]; GGUF's Llama Q/K use adjacent pairs (llama.cpp's "normal" RoPE).
        inv = self.theta ** (-np.arange(0, self.hd, 2, dtype=np.float64) / self.hd)
        ang = np.outer(pos, inv)
        cos, sin = np.cos(ang).astype(np.float32)[:, None, :], np.sin(ang).astype(np.float32)[:, None, :]
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = a * cos - b * sin
        out[..., 1::2] = a * sin + b * cos
        return out

    def forward(self, tokens, pos, cache, press=None, hook=None):
        """Runs `tokens` at positions `pos` after `cache` (per layer (K, V) or (K, V, keep),
        [kv, n, hd], post-RoPE; `keep` [kv, n] masks pruned keys per KV head, as kvpress's
        masked_key_indices do). Returns logits and the new cache; `press(q, K, V)` compresses a
        layer's K/V after its (exact) attention, as kvpress's forward hook does, and
        `hook(layer, q, K)` sees every layer's post-RoPE queries and keys."""
        x = self.embd[tokens]
        n = len(tokens)
        g = self.n_heads // self.n_kv
        new_cache = []
        for li, L in enumerate(self.layers):
            h = self.rms(x, L["attn_norm"])
            q = self.rope((h @ L["attn_q"].T).reshape(n, self.n_heads, self.hd), pos)
            k = self.rope((h @ L["attn_k"].T).reshape(n, self.n_kv, self.hd), pos)
            v = (h @ L["attn_v"].T).reshape(n, self.n_kv, self.hd)
            k, v = k.transpose(1, 0, 2), v.transpose(1, 0, 2)
            entry = cache[li] if cache else (np.zeros((self.n_kv, 0, self.hd), np.float32),) * 2
            pk, pv = entry[0], entry[1]
            K, V = np.concatenate([pk, k], 1), np.concatenate([pv, v], 1)
            m = K.shape[1] - n
            qh = q.transpose(1, 0, 2)  # [heads, n, hd]
            att = np.einsum("hnd,hmd->hnm", qh, np.repeat(K, g, 0)) / math.sqrt(self.hd)
            mask = np.triu(np.ones((n, n), bool), 1)
            att[:, :, m:][:, mask] = -np.inf
            keep = None
            if len(entry) == 3:
                keep = np.concatenate([entry[2], np.ones((self.n_kv, n), bool)], 1)
                att[:, :, :m] += np.where(np.repeat(entry[2], g, 0)[:, None, :], 0.0, -np.inf).astype(np.float32)
            if hook is not None:
                hook(li, qh, K)
            att = np.exp(att - att.max(-1, keepdims=True))
            att /= att.sum(-1, keepdims=True)
            o = np.einsum("hnm,hmd->hnd", att, np.repeat(V, g, 0)).transpose(1, 0, 2).reshape(n, self.dim)
            x = x + o @ L["attn_output"].T
            h = self.rms(x, L["ffn_norm"])
            a = h @ L["ffn_gate"].T
            x = x + ((a / (1 + np.exp(-a))) * (h @ L["ffn_up"].T)) @ L["ffn_down"].T
            if press is not None:
                K, V = press(qh, K, V)
            new_cache.append((K, V) if keep is None else (K, V, keep))
        return self.rms(x, self.out_norm) @ self.out.T, new_cache


def n_kept(k_len, ratio):
    return int(k_len * (1 - ratio))  # kvpress.utils.compute_n_kept


def snapkv_scores(q, K, window=64, kernel=5):
    # kvpress SnapKVPress.score: window queries over every key (causal inside the window),
    # softmax, the non-window part, mean over the window, avg_pool1d (padding counted),
    # mean over the GQA group; window tokens get max + 1.
    heads, k_len = q.shape[0], K.shape[1]
    g = heads // K.shape[0]
    qw = q[:, -window:]
    att = np.einsum("hnd,hmd->hnm", qw, np.repeat(K, g, 0)) / math.sqrt(K.shape[2])
    att += np.triu(np.full((window, k_len), -np.inf, np.float32), k_len - window + 1)
    att = np.exp(att - att.max(-1, keepdims=True))
    att /= att.sum(-1, keepdims=True)
    s = att[..., :-window].mean(-2)
    pad = np.pad(s, ((0, 0), (kernel // 2, kernel // 2)))
    s = np.stack([pad[:, i : i + s.shape[1]] for i in range(kernel)]).sum(0) / kernel
    s = s.reshape(K.shape[0], g, -1).mean(1)
    return np.pad(s, ((0, 0), (0, window)), constant_values=s.max() + 1)


def press_for(name, ratio):
    def press(q, K, V):
        kv, k_len, _ = K.shape
        keep = n_kept(k_len, ratio)
        if name == "snapkv":
            s = snapkv_scores(q, K)
        elif name == "streaming-llm":
            s = np.ones((kv, k_len), np.float32)
            s[:, 4 : k_len - keep + 4] = 0
        elif name == "knorm":
            s = -np.linalg.norm(K, axis=-1)
        elif name == "keydiff":
            kn = K / np.maximum(np.linalg.norm(K, axis=-1, keepdims=True), 1e-12)
            anchor = kn.mean(1, keepdims=True)
            s = -(K * anchor).sum(-1) / np.maximum(np.linalg.norm(K, axis=-1) * np.linalg.norm(anchor, axis=-1), 1e-8)
        else:
            raise SystemExit(f"unknown press {name}")
        # Stable order: topk keeps the highest scores; attention is order-independent.
        idx = np.argsort(-s, axis=-1, kind="stable")[:, :keep]
        idx.sort(-1)
        return np.take_along_axis(K, idx[..., None], 1), np.take_along_axis(V, idx[..., None], 1)

    return press


KVZIP_SINKS = 4
KVZIP_CHUNK_TOKENS = 2048
KVZIP_PREV_POSTFIX_TOKENS = 8


def kvzip_layer_scores(q, K, sink, start, end, r):
    """One layer's scores of context tokens start..end from a pass of `r` tokens: `q`
    [heads, r, hd] post-RoPE, `K` [kv, n + r, hd] (the pass's keys last). Returns [kv, end - start]."""
    n_kv, hd = K.shape[0], K.shape[2]
    g = q.shape[0] // n_kv
    sub = np.concatenate([K[:, :sink], K[:, start:end], K[:, -r:]], 1)
    att = np.einsum("hnd,hmd->hnm", q, np.repeat(sub, g, 0)) / math.sqrt(hd)
    att[:, :, -r:] += np.triu(np.full((r, r), -np.inf, np.float32), 1)
    att = np.exp(att - att.max(-1, keepdims=True))
    att /= att.sum(-1, keepdims=True)
    part = att[:, :, sink : sink + end - start].reshape(n_kv, g, r, end - start)
    return part.max(axis=(1, 2))


def kvzip_scores(m, ctx, cache, ids):
    """kvpress 0.5.5's KVzipPress.score_kvzip over the context `ctx` (no template prefix: the
    text-kl protocol's prefix is plain text) already in `cache`: per chunk of 2,048 tokens,
    the reconstruction prompt `ids["first"]` (later chunks: `ids["later"]` and the previous
    chunk's last 8 tokens), then `ids["suffix"]` (the chat template's end of the user turn
    and start of the assistant's), then the chunk, teacher-forced after the whole context;
    a context token's score per (layer, KV head) is the largest attention any query of that
    pass and any query head of its group gives it, the softmax taken over the sinks, the
    chunk and the pass's own tokens only. The pass's KV is discarded. Returns [layer, kv, n]."""
    n = len(ctx)
    scores = np.zeros((m.n_layers, m.n_kv, n), np.float32)
    scores[..., :KVZIP_SINKS] = 1.0
    chunks = [ctx[i : i + KVZIP_CHUNK_TOKENS] for i in range(0, n, KVZIP_CHUNK_TOKENS)]
    for c, chunk in enumerate(chunks):
        start, end = c * KVZIP_CHUNK_TOKENS, c * KVZIP_CHUNK_TOKENS + len(chunk)
        prompt = ids["first"] if c == 0 else ids["later"] + list(chunks[c - 1][-KVZIP_PREV_POSTFIX_TOKENS:])
        repeat = np.array(prompt + ids["suffix"] + list(chunk))
        r = len(repeat)
        sink = min(KVZIP_SINKS, start)

        def hook(li, q, K):
            scores[li, :, start:end] = kvzip_layer_scores(q, K, sink, start, end, r)

        m.forward(repeat, np.arange(n, n + r), cache, hook=hook)
    return scores


def kvzip_compress(cache, scores, ratio, budget):
    """The context's cache with `ratio` of its (layer, KV head, token) entries masked:
    `global` (kvpress's default: one threshold over every score), `layer` (kvpress's
    `layerwise`: the same count per layer, heads free) or `uniform` (the same count per KV
    head, what a paged cache with one table per head holds)."""
    n_layers, n_kv, n = scores.shape
    keep = np.ones(scores.shape, bool)
    flat = scores.reshape(-1)
    if budget == "global":
        pruned = np.argsort(flat, kind="stable")[: int(flat.size * ratio)]
        keep.reshape(-1)[pruned] = False
    elif budget == "layer":
        for li in range(n_layers):
            s = scores[li].reshape(-1)
            keep[li].reshape(-1)[np.argsort(s, kind="stable")[: int(s.size * ratio)]] = False
    elif budget == "uniform":
        for li in range(n_layers):
            for h in range(n_kv):
                keep[li, h, np.argsort(scores[li, h], kind="stable")[: int(n * ratio)]] = False
    else:
        raise SystemExit(f"unknown kvzip budget {budget}")
    return [(K, V, keep[li]) for li, (K, V, *_) in enumerate(cache)]


def log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("tokens")
    ap.add_argument("--ratios", default="0.5,0.75,0.875")
    ap.add_argument("--presses", default="snapkv,streaming-llm,knorm,keydiff")
    ap.add_argument("--samples", type=int, default=99, help="only samples below this")
    ap.add_argument("--first-sample", type=int, default=0, help="only samples from this on")
    ap.add_argument(
        "--kvzip-ids",
        help="JSON {first, later, suffix}: token ids of the reconstruction prompts and the chat template's turn change (kvzip presses)",
    )
    ap.add_argument(
        "--dump-kept",
        help="JSON lines: for each kvzip press, sample and ratio, the token indices each (layer, KV head) keeps (to compare kept sets with pagekeeper's)",
    )
    a = ap.parse_args()
    dump = open(a.dump_kept, "a") if a.dump_kept else None
    kvzip_ids = json.load(open(a.kvzip_ids)) if a.kvzip_ids else None
    if "kvzip" in a.presses and kvzip_ids is None:
        raise SystemExit("kvzip presses need --kvzip-ids")
    m = Model(a.model)
    seen = set()
    for line in open(a.tokens):
        s = json.loads(line)
        key = (s["context_tokens"], s["sample"])
        if key in seen or not a.first_sample <= s["sample"] < a.samples:
            continue
        seen.add(key)
        pre, cont = np.array(s["prefix"]), np.array(s["continuation"])
        pp, cp = np.arange(len(pre)), np.arange(len(pre), len(pre) + len(cont))
        full_last, full_cache = m.forward(pre, pp, None)
        # Row i predicts continuation[i]: row 0 is the prefix's last position.
        full = np.concatenate([full_last[-1:], m.forward(cont[:-1], cp[:-1], full_cache)[0]])
        lf = log_softmax(full)
        zip_scores = None
        for name in a.presses.split(","):
            for r in [float(x) for x in a.ratios.split(",")]:
                if name.startswith("kvzip"):
                    # Query-agnostic: the context alone is scored, then compressed, then the
                    # continuation is read after it (kvpress's protocol, as for the others).
                    if zip_scores is None:
                        zip_scores = kvzip_scores(m, pre, full_cache, kvzip_ids)
                    budget = name.split(":")[1] if ":" in name else "global"
                    last, cache = full_last, kvzip_compress(full_cache, zip_scores, r, budget)
                    if dump:
                        kept = [[np.flatnonzero(keep[h]).tolist() for h in range(m.n_kv)] for _, _, keep in cache]
                        dump.write(json.dumps({"sample": s["sample"], "press": name, "ratio": r, "kept": kept}) + "\n")
                        dump.flush()
                else:
                    last, cache = m.forward(pre, pp, None, press_for(name, r))
                pol = np.concatenate([last[-1:], m.forward(cont[:-1], cp[:-1], cache)[0]])
                lp = log_softmax(pol)
                kl = (np.exp(lf[1:]) * (lf[1:] - lp[1:])).sum(-1).mean()
                top1 = (full[1:].argmax(-1) == pol[1:].argmax(-1)).mean()
                print(json.dumps({"sample": s["sample"], "press": name, "ratio": r, "kept": n_kept(len(pre), r), "top1_agreement": round(float(top1), 4), "kl_mean": round(float(kl), 4)}), flush=True)


if __name__ == "__main__":
    main()
