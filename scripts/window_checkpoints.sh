#!/usr/bin/env bash
# The chunk tiers' window checkpoints on Gemma-3-270M (KV cache groups on): for each
# --tier-window-checkpoint-tokens, the bytes a disk tier holds after one ~8K-token prompt of
# the bundled book, and the tokens a second prompt that shares only its first ~6,000 tokens
# finds cached. Each setting gets a fresh directory; the second prompt runs in a second
# process (a restart), so its hit comes from the disk tier.
#
#   scripts/window_checkpoints.sh            # CHECKPOINTS="1024 2048 4096 8192" by default
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-target/release/pagekeeper}
BOOK=tests/fixtures/around-the-world-in-80-days.txt
# About 8,200 Gemma tokens, and about 6,000 of the same text followed by other text.
FULL=$(head -c 29500 "$BOOK")
SHARED="$(head -c 21600 "$BOOK") $(tail -c 4000 "$BOOK")"
echo "checkpoint_tokens  prompt_tokens  disk_bytes  shared_prompt_tokens  shared_cached"
for cp in ${CHECKPOINTS:-1024 2048 4096 8192}; do
  dir=$(mktemp -d)
  run() { "$BIN" generate --model gemma3-270m --max-tokens 1 --tier-disk "$dir/kv:4GiB" \
      --tier-window-checkpoint-tokens "$cp" --prompt "$1" 2>&1 >/dev/null | grep '^prompt:'; }
  first=$(run "$FULL")
  bytes=$(du -sb "$dir/kv" | cut -f1)
  second=$(run "$SHARED")
  rm -rf "$dir"
  tokens() { sed -E 's/^prompt: ([0-9]+) tokens \(([0-9]+) cached\).*/\1 \2/' <<<"$1"; }
  read -r p1 _ <<<"$(tokens "$first")"
  read -r p2 c2 <<<"$(tokens "$second")"
  printf '%17s  %13s  %10s  %20s  %13s\n' "$cp" "$p1" "$bytes" "$p2" "$c2"
done
