#!/usr/bin/env bash
# The EVICPRESS delay model's start-up prefill figure against `bench perf`'s prefill rate
# for the same model on the same machine, side by side in one run (issue 34's bar: within
# 30 %). Usage: scripts/delay_calibration_vs_bench.sh MODEL.gguf [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
model=$1
rounds=${2:-2}
bin=target/release/pagekeeper
port=$((20000 + RANDOM % 20000))
for round in $(seq "$rounds"); do
    # host-quiet exits non-zero on a busy host; its figure is printed either way.
    quiet=$(../shared/tools/host-quiet 2>/dev/null || true)
    "$bin" serve --model "$model" --port "$port" --tier-policy evicpress --tier-ram 256MiB \
        >/dev/null 2>&1 &
    pid=$!
    until served=$(curl -sf "localhost:$port/v1/kv/contexts"); do sleep 0.5; done
    kill "$pid"
    wait "$pid" 2>/dev/null || true
    calibrated=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["delay_model"]["model"]["prefill_tokens_per_s"])' "$served")
    # bench perf's first run pays for paging the weights in (the calibration warms up
    # first), so the second of two 512-token runs is the one to compare.
    bench=$("$bin" bench perf --model "$model" --contexts 512,512 --decode-tokens 4 --json 2>/dev/null |
        python3 -c 'import json,sys; print(json.load(sys.stdin)["runs"][1]["prefill_tok_s"])')
    python3 -c "import sys; c, b = map(float, sys.argv[1:3]); print(f'round $round: calibrated {c:.1f} tok/s, bench perf pp512 {b:.1f} tok/s, ratio {c / b:.3f}  [{sys.argv[3]}]')" \
        "$calibrated" "$bench" "$quiet"
done
