#!/usr/bin/env python3
"""llama.cpp's side of `pagekeeper bench perf --compare-llamacpp`.

Measures what `bench perf` measures, through llama.cpp (the PyPI package
`llama-cpp-python`): the prefill speed of a given prompt, then greedy decode of the next
tokens, one `Llama.eval` call per token. The CLI runs this once per context length, right
after its own run of that length, so both see the same host load; it passes the model
file, the thread count and the exact prompt token ids in a JSON request file, and reads
one JSON object from stdout:

  {"llama_cpp_python": str, "system_info": str,
   "runs": [{"context_tokens", "prefill_tok_s", "decode_tokens", "decode_tok_s"}]}

`decode_tokens` counts generated tokens as `bench perf` does: the first comes from the
prompt's logits, so `decode_tok_s` is `(decode_tokens - 1)` timed steps over their time.
Batch sizes follow llama-bench's defaults (n_batch 2048, n_ubatch 512), so a prompt of up
to 2048 tokens is one `llama_decode` call.

Usage: llamacpp_bench.py REQUEST.json, where REQUEST is
  {"model": path, "threads": int, "decode_tokens": int, "n_ctx": int,
   "runs": [{"context_tokens": int, "prompt": [int, ...]}]}
"""

import json
import sys
import time


def main() -> int:
    try:
        import llama_cpp
        import numpy as np
    except ImportError as e:
        print(f"llama-cpp-python is not importable by {sys.executable}: {e}", file=sys.stderr)
        return 3
    with open(sys.argv[1]) as f:
        req = json.load(f)
    threads = int(req["threads"])
    llm = llama_cpp.Llama(
        model_path=req["model"],
        n_ctx=int(req["n_ctx"]),
        n_batch=2048,
        n_ubatch=512,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )
    n_vocab = llm.n_vocab()
    runs = []
    for run in req["runs"]:
        prompt = run["prompt"]
        n_decode = int(req["decode_tokens"])
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        prefill = time.perf_counter() - t0

        def next_token() -> int:
            logits = np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(n_vocab,))
            return int(np.argmax(logits))

        tok = next_token()
        generated = 1
        t0 = time.perf_counter()
        while generated < n_decode:
            llm.eval([tok])
            tok = next_token()
            generated += 1
        decode = time.perf_counter() - t0
        runs.append(
            {
                "context_tokens": len(prompt),
                "prefill_tok_s": len(prompt) / prefill,
                "decode_tokens": generated,
                "decode_tok_s": (generated - 1) / max(decode, 1e-9),
            }
        )
    print(
        json.dumps(
            {
                "llama_cpp_python": getattr(llama_cpp, "__version__", "unknown"),
                "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
                "runs": runs,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
