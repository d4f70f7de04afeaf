#!/usr/bin/env bash
# Issue 38's comparison on Qwen2.5-Coder-1.5B: PagedEviction's authors' configurations
# (v-norm × shared/layer/head × local=3/global; `paged-eviction` is v-norm with local=3
# since commit 0033120) beside the default before it (`paged-eviction:ratio:global`, shared
# and per head), inverse-key-L2 in the block framework, StreamingLLM, KeyDiff and SnapKV.
# Rows written before 0033120 were relabelled with today's names (the mapping is in NOTE.md).
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
  --policies paged-eviction:ratio:global/shared,paged-eviction:ratio:global/head,paged-eviction:global/layer,paged-eviction:global/head,paged-eviction/shared,paged-eviction/layer,paged-eviction/head,paged-eviction:inv-k-norm:global/head,streaming-llm/shared,keydiff/head,snapkv/head \
  --no-progress --out "$here" "$@"
