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

Llama (SmolLM2: RoPE on adjacent pairs, as GGUF stores its Q/K) and Qwen2 (Qwen2.5-Coder:
Q/K/V biases, RoPE on the halves of each head, llama.cpp's NEOX), tied or separate output.
Attention runs as batched matrix products (BLAS), and logits only for the rows a caller
reads, so the 1.5B model at 4K tokens takes minutes, not hours.
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
        arch = bytes(f["general.architecture"]).decode()
        if arch not in ("llama", "qwen2"):
            raise SystemExit(f"{path}: architecture {arch!r}; this reference runs llama and qwen2")
        self.neox = arch == "qwen2"
        self.n_layers = int(f[f"{arch}.block_count"][0])
        self.n_heads = int(f[f"{arch}.attention.head_count"][0])
        self.n_kv = int(f[f"{arch}.attention.head_count_kv"][0])
        self.dim = int(f[f"{arch}.embedding_length"][0])
        self.hd = self.dim // self.n_heads
        self.eps = float(f[f"{arch}.attention.layer_norm_rms_epsilon"][0])
        self.theta = float(f[f"{arch}.rope.freq_base"][0])
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
            L = {k: w(p + k + ".weight") for k in ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"]}
            for k in ["attn_q", "attn_k", "attn_v"]:
                L[k + ".bias"] = w(p + k + ".bias") if p + k + ".bias" in t else np.zeros(L[k].shape[0], np.float32)
            self.layers.append(L)

    def rms(self, x, g):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + self.eps) * g

    def rope(self, x, pos):
        # x: [n, heads, hd]; GGUF's Llama Q/K use adjacent pairs (llama.cpp's "normal" RoPE),
        # Qwen2's the two halves of each head (NEOX).
        inv = self.theta ** (-np.arange(0, self.hd, 2, dtype=np.float64) / self.hd)
        ang = np.outer(pos, inv)
        cos, sin = np.cos(ang).astype(np.float32)[:, None, :], np.sin(ang).astype(np.float32)[:, None, :]
        half = self.hd // 2
        ia, ib = (np.arange(half), np.arange(half, self.hd)) if self.neox else (np.arange(0, self.hd, 2), np.arange(1, self.hd, 2))
        a, b = x[..., ia], x[..., ib]
        out = np.empty_like(x)
        out[..., ia] = a * cos - b * sin
        out[..., ib] = a * sin + b * cos
        return out

    def forward(self, tokens, pos, cache, press=None, hook=None, logit_rows=None):
        """Runs `tokens` at positions `pos` after `cache` (per layer (K, V) or (K, V, keep),
        [kv, n, hd], post-RoPE; `keep` [kv, n] masks pruned keys per KV head, as kvpress's
        masked_key_indices do). Returns logits and the new cache; `press(q, K, V)` compresses a
        layer's K/V after its (exact) attention, as kvpress's forward hook does, and
        `hook(layer, q, K)` sees every layer's post-RoPE queries and keys. `logit_rows`: the
        rows whose logits are computed (all by default; the vocabulary is large)."""
        x = self.embd[tokens]
        n = len(tokens)
        g = self.n_heads // self.n_kv
        new_cache = []
        for li, L in enumerate(self.layers):
            h = self.rms(x, L["attn_norm"])
            q = self.rope((h @ L["attn_q"].T + L["attn_q.bias"]).reshape(n, self.n_heads, self.hd), pos)
            k = self.rope((h @ L["attn_k"].T + L["attn_k.bias"]).reshape(n, self.n_kv, self.hd), pos)
            v = (h @ L["attn_v"].T + L["attn_v.bias"]).reshape(n, self.n_kv, self.hd)
            k, v = k.transpose(1, 0, 2), v.transpose(1, 0, 2)
            entry = cache[li] if cache else (np.zeros((self.n_kv, 0, self.hd), np.float32),) * 2
            pk, pv = entry[0], entry[1]
            K, V = np.concatenate([pk, k], 1), np.concatenate([pv, v], 1)
            m = K.shape[1] - n
            qh = q.transpose(1, 0, 2)  # [heads, n, hd]
            att = np.matmul(qh, np.repeat(K, g, 0).transpose(0, 2, 1)) / np.float32(math.sqrt(self.hd))
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
            o = np.matmul(att, np.repeat(V, g, 0)).transpose(1, 0, 2).reshape(n, self.dim)
            del att
            x = x + o @ L["attn_output"].T
            h = self.rms(x, L["ffn_norm"])
            a = h @ L["ffn_gate"].T
            x = x + ((a / (1 + np.exp(-a))) * (h @ L["ffn_up"].T)) @ L["ffn_down"].T
            if press is not None:
                K, V = press(qh, K, V)
            new_cache.append((K, V) if keep is None else (K, V, keep))
        if logit_rows is not None:
            x = x[logit_rows]
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
    att = np.matmul(q, np.repeat(sub, g, 0).transpose(0, 2, 1)) / np.float32(math.sqrt(hd))
    att[:, :, -r:] += np.triu(np.full((r, r), -np.inf, np.float32), 1)
    att = np.exp(att - att.max(-1, keepdims=True))
    att /= att.sum(-1, keepdims=True)
    part = att[:, :, sink : sink + end - start].reshape(n_kv, g, r, end - start)
    return part.max(axis=(1, 2))


def kvzip_scores(m, ctx, cache, ids, prefix=0, keep_prefix=False):
    """kvpress 0.5.5's KVzipPress.score_kvzip over the context `ctx` already in `cache`:
    per chunk of 2,048 tokens of the context after its template prefix (`prefix` tokens; 0
    for plain text, as in the text-kl protocol), the reconstruction prompt `ids["first"]`
    (later chunks: `ids["later"]` and the previous chunk's last 8 tokens), then
    `ids["suffix"]` (the chat template's end of the user turn and start of the assistant's),
    then the chunk, teacher-forced after the whole context; a context token's score per
    (layer, KV head) is the largest attention any query of that pass and any query head of
    its group gives it, the softmax taken over the sinks, the chunk and the pass's own
    tokens only. The pass's KV is discarded. The sinks are the first 4 tokens and the rest
    of the prefix scores 0 (kvpress); with `keep_prefix` the whole prefix is the sinks and
    scores 1 (the authors' `attention/score.py`). Returns [layer, kv, n]."""
    n = len(ctx)
    scores = np.zeros((m.n_layers, m.n_kv, n), np.float32)
    scores[..., : (prefix if keep_prefix else KVZIP_SINKS)] = 1.0
    starts = range(prefix, n, KVZIP_CHUNK_TOKENS)
    chunks = [ctx[i : i + KVZIP_CHUNK_TOKENS] for i in starts]
    for c, (start, chunk) in enumerate(zip(starts, chunks)):
        end = start + len(chunk)
        prompt = ids["first"] if c == 0 else ids["later"] + list(chunks[c - 1][-KVZIP_PREV_POSTFIX_TOKENS:])
        repeat = np.array(prompt + ids["suffix"] + list(chunk))
        r = len(repeat)
        sink = prefix if keep_prefix else min(KVZIP_SINKS, start)

        def hook(li, q, K):
            scores[li, :, start:end] = kvzip_layer_scores(q, K, sink, start, end, r)

        m.forward(repeat, np.arange(n, n + r), cache, hook=hook, logit_rows=slice(-1, None))
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
    elif budget.startswith("floor="):
        # pagekeeper's `kvzip:global:floor=N`: each head first keeps its best N, then one
        # threshold over the rest shares out what is left of the budget (exactly the budget).
        floor = int(budget.split("=")[1])
        total = flat.size - int(flat.size * ratio)
        floor = min(floor, total // (n_layers * n_kv))
        order = np.argsort(-scores, axis=-1, kind="stable")
        rank = np.empty_like(order)
        np.put_along_axis(rank, order, np.arange(n)[None, None, :].repeat(n_layers, 0).repeat(n_kv, 1), -1)
        forced = rank < floor
        rest = np.where(forced, -np.inf, scores).reshape(-1)
        extra = total - int(forced.sum())
        chosen = forced.reshape(-1).copy()
        if extra > 0:
            chosen[np.argsort(-rest, kind="stable")[:extra]] = True
        keep = chosen.reshape(scores.shape)
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
        full_last, full_cache = m.forward(pre, pp, None, logit_rows=slice(-1, None))
        # Row i predicts continuation[i]: row 0 is the prefix's last position.
        full = np.concatenate([full_last[-1:], m.forward(cont[:-1], cp[:-1], full_cache)[0]])
        lf = log_softmax(full)
        # The full cache's perplexity of the continuation (rows 1..), to set beside the
        # engine's `ppl_full` for the same span: a check of this forward pass itself.
        ppl_full = float(np.exp(-lf[np.arange(1, len(cont)), cont[1:]].mean()))
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
                    last, cache = m.forward(pre, pp, None, press_for(name, r), logit_rows=slice(-1, None))
                pol = np.concatenate([last[-1:], m.forward(cont[:-1], cp[:-1], cache)[0]])
                lp = log_softmax(pol)
                kl = (np.exp(lf[1:]) * (lf[1:] - lp[1:])).sum(-1).mean()
                top1 = (full[1:].argmax(-1) == pol[1:].argmax(-1)).mean()
                print(json.dumps({"sample": s["sample"], "press": name, "ratio": r, "kept": n_kept(len(pre), r), "top1_agreement": round(float(top1), 4), "kl_mean": round(float(kl), 4), "ppl_full": round(ppl_full, 4)}), flush=True)


if __name__ == "__main__":
    main()
