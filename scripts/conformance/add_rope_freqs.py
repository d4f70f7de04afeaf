#!/usr/bin/env python3
"""A copy of a Llama-architecture GGUF with a `rope_freqs.weight` tensor added, as
llama.cpp's converter writes for Llama 3.1/3.2: the low-frequency half of the factors set
to 8, the rest 1 (issue 33's measurement on SmolLM2). Metadata and every other tensor are
copied byte for byte, so the only difference from the source is the factors.

Usage: add_rope_freqs.py SRC.gguf OUT.gguf
"""

import os
import sys

import numpy as np
import gguf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from add_tensor import copy_with_extra  # noqa: E402


def main():
    src, out = sys.argv[1], sys.argv[2]
    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    if arch != "llama":
        sys.exit(f"{src}: architecture {arch!r}; llama.cpp reads rope_freqs only for llama")
    head_dim = r.fields["llama.embedding_length"].contents() // r.fields["llama.attention.head_count"].contents()
    half = head_dim // 2
    factors = np.ones(half, dtype=np.float32)
    factors[half // 2:] = 8.0
    copy_with_extra(src, out, "rope_freqs.weight", factors)


if __name__ == "__main__":
    main()
