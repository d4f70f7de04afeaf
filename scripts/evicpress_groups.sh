#!/usr/bin/env bash
# The EVICPRESS store on Gemma-3-270M with KV cache groups against one table for every
# layer (--disable-hybrid-kv-cache-manager), side by side: an 8K-token prompt from the book
# stored by a first `generate` (cold), then served from the disk tier to a second process
# (a restart: RAM empty, the page cache warm). Prints each run's prompt time, cached tokens
# and the bytes the store wrote to disk. Usage: scripts/evicpress_groups.sh [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-2}
bin=target/release/pagekeeper
cargo build --release -q -p pagekeeper
# ~8,300 Gemma tokens of the book (about 4.1 characters a token).
text=$(head -c 34000 tests/fixtures/around-the-world-in-80-days.txt)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "host-quiet: $(../shared/tools/host-quiet 2>/dev/null || echo unavailable)"
for round in $(seq "$rounds"); do
    for layout in groups one-table; do
        flag=()
        [ "$layout" = one-table ] && flag=(--disable-hybrid-kv-cache-manager)
        dir="$work/$layout-$round"
        for run in cold hit; do
            line=$("$bin" generate --model gemma3-270m --threads 2 --tier-policy evicpress \
                --tier-disk "$dir:4GiB" --evicpress-alpha 1000 "${flag[@]}" \
                --prompt "$text" --max-tokens 4 2>&1 | grep '^prompt:')
            bytes=$(du -sb "$dir" | cut -f1)
            echo "round $round $layout $run: $line; disk $bytes bytes"
        done
    done
done
