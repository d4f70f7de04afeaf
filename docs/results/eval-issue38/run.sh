#!/usr/bin/env bash
# Issue 38's comparison on Qwen2.5-Coder-1.5B: PagedEviction's authors' configurations
# (v-norm × layer/head × local=3/global) beside today's default (ratio, shared), the ratio
# per head, inverse-key-L2 in the block framework, StreamingLLM, KeyDiff and SnapKV.
# Resumable: results.jsonl in this directory is kept and only missing cells run.
# PK=path/to/pagekeeper (default target/release/pagekeeper), LENGTHS (default 2048,4096,8192),
# TASKS (default: all five; the order is the order they run in).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
pk=${PK:-target/release/pagekeeper}
model=${MODEL:-$HOME/.cache/pagekeeper/Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf}
"$pk" eval --model "$model" \
  --tasks "${TASKS:-code-completion,niah-multikey,kv-retrieval,text-kl,passage-count}" \
  --lengths "${LENGTHS:-2048,4096,8192}" --samples 4 --budgets 12.5%,25%,50% \
  --policies paged-eviction/shared,paged-eviction/head,paged-eviction:v-norm/layer,paged-eviction:v-norm/head,paged-eviction:v-norm:local=3/shared,paged-eviction:v-norm:local=3/layer,paged-eviction:v-norm:local=3/head,paged-eviction:inv-k-norm/head,streaming-llm/shared,keydiff/head,snapkv/head \
  --no-progress --out "$here" "$@"
