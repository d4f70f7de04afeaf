#!/usr/bin/env bash
# `bench serve` of two builds, alternating on one host, so that both see the same load
# (issue 35's bar: throughput and ITL p50/p99 within 10 % of the previous main).
#
# Usage: scripts/serve_side_by_side.sh BASE_BIN NEW_BIN [ROUNDS] [-- BENCH SERVE ARGS...]
#        (default: 3 rounds, `--concurrency 16,64 --max-tokens 64 --threads 2`)
# Prints one line per (round, build, level) with host-quiet's figure taken before the run.
set -euo pipefail
base=$1 new=$2
rounds=${3:-3}
shift 2; [ $# -gt 0 ] && shift
[ "${1:-}" = "--" ] && shift
args=("$@")
[ ${#args[@]} -eq 0 ] && args=(--concurrency 16,64 --max-tokens 64 --threads 2)
quiet=../shared/tools/host-quiet
[ -x "$quiet" ] || quiet=/work/shared/tools/host-quiet
printf '%-5s %-4s %7s %9s %9s %9s %9s  %s\n' round bin clients "tok/s" "ITL p50" "ITL p99" "TTFT p50" "host-quiet"
for round in $(seq "$rounds"); do
    for which in base new; do
        bin=$base; [ "$which" = new ] && bin=$new
        q=$("$quiet" 2>/dev/null | tr '\n' ' ') || true
        "$bin" bench serve "${args[@]}" --json 2>/dev/null | python3 -c '
import json, sys
round, which, quiet = sys.argv[1:4]
doc = json.load(sys.stdin)
levels = doc["levels"] if isinstance(doc, dict) and "levels" in doc else doc
for l in levels:
    print("%-5s %-4s %7d %9.1f %7.1fms %7.1fms %8.2fs  %s" % (round, which, l["concurrency"],
          l["decode_tok_s"], 1e3 * l["itl_p50_s"], 1e3 * l["itl_p99_s"], l["ttft_p50_s"], quiet))
' "$round" "$which" "$q"
    done
done
