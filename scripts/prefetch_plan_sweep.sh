#!/usr/bin/env bash
# Decode's three weight-prefetch plans (`PK_PREFETCH_PLAN=far|near|l2`, and `none` for the
# hardware prefetchers alone when named; `kernels/x86.rs`
# `PrefetchPlan`) side by side on this host: each round runs `decode_bench --vs-stream` once
# per plan, in turn, and prints the median share of the DRAM read bound per step at one and
# two threads, with host-quiet's figure before each run. `l2` took the AMD Zen 3 host from
# 83 % to over 100 %; on AMD Zen 4 the L2 distance, not the plan, was the limit (4 KiB held
# one thread at 58–61 % of the bound, 8 KiB gave 79–84 %); on the Intel AMX host of
# 2026-12-08 `far` beat `l2` by 4–6 points once each line was asked for once, and 8 KiB
# beat 4 KiB (BENCHMARKS.md). On a new host kind run it with DISTANCES="4096 8192 16384".
#
# Usage: scripts/prefetch_plan_sweep.sh [ROUNDS] [PLANS...]   (default: 3 rounds; far near l2)
# Env:   PK_MODEL (default: the fetched Qwen2.5-Coder-1.5B-Instruct Q4_K_M),
#        DISTANCES (e.g. "4096 8192": also sweep the `far` and `l2` plans' L2 distance,
#        `PK_PREFETCH_FAR_BYTES`, each plan once per distance; default: the host's own,
#        which the first line names),
#        DECODE_BENCH (default target/release/examples/decode_bench; built if missing).
set -euo pipefail

rounds=${1:-3}
shift || true
plans=("${@:-far near l2}")
[ ${#plans[@]} -eq 1 ] && read -r -a plans <<< "${plans[0]}"
if ! [[ "$rounds" =~ ^[1-9][0-9]*$ ]]; then
    echo "ROUNDS=$rounds: expected a positive whole number" >&2
    exit 2
fi
for p in "${plans[@]}"; do
    case "$p" in
        far | near | l2 | none) ;;
        *) echo "plan $p: expected far, near, l2 or none" >&2; exit 2 ;;
    esac
done
model=${PK_MODEL:-$HOME/.cache/pagekeeper/Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf}
[ -f "$model" ] || { echo "$model is missing: run \`pagekeeper fetch-model --name qwen2.5-coder-1.5b\`" >&2; exit 2; }
bench=${DECODE_BENCH:-target/release/examples/decode_bench}
if [ ! -x "$bench" ]; then
    cargo build --release -p pk-model --example decode_bench
fi
quiet=../shared/tools/host-quiet
[ -x "$quiet" ] || quiet=/work/shared/tools/host-quiet

grep -o -w -E 'avx2|avx512f|avx512_vnni|amx_int8' /proc/cpuinfo | sort -u | tr '\n' ' ' | sed 's/^/CPU flags: /'; echo
grep -m1 'model name' /proc/cpuinfo
read -r -a distances <<< "${DISTANCES:-default}"
for d in "${distances[@]}"; do
    if [ "$d" != default ] && ! [[ "$d" =~ ^[1-9][0-9]*$ ]]; then
        echo "DISTANCES: $d is not a number of bytes" >&2
        exit 2
    fi
done
printf '%-6s %-5s %-8s %-11s %-10s %-10s\n' round plan distance host-quiet "1 thread" "2 threads"
for round in $(seq "$rounds"); do
    for plan in "${plans[@]}"; do
    for d in "${distances[@]}"; do
        # `near` has no L2 distance: it runs once, under the first distance's turn.
        far_plan=1
        case "$plan" in near | none) far_plan=0 ;; esac
        [ "$far_plan" = 0 ] && [ "$d" != "${distances[0]}" ] && continue
        env_far=()
        [ "$d" != default ] && [ "$far_plan" = 1 ] && env_far=(PK_PREFETCH_FAR_BYTES="$d")
        q=$("$quiet" 2>/dev/null) || true
        q=${q#stalled_fraction_max=}
        q=${q%% *}
        out=$(env "${env_far[@]}" PK_PREFETCH_PLAN="$plan" "$bench" --model "$model" --reps 1 --context 16 --compare 1,2 --vs-stream 2>&1)
        if [ "$round$plan$d" = "1${plans[0]}${distances[0]}" ]; then
            echo "(${plan}: $(grep -m1 'decode weight prefetch' <<< "$out"))"
        fi
        # "threads N vs stream (...): share of the DRAM bound per step median X % (...)"
        share() {
            grep -E "^threads $1 vs stream" <<< "$out" | sed -E 's/.*per step median ([0-9.]+) %.*/\1 %/'
        }
        shown=$d
        [ "$far_plan" = 0 ] && shown=-
        printf '%-6s %-5s %-8s %-11s %-10s %-10s\n' "$round" "$plan" "$shown" "${q:-n/a}" "$(share 1)" "$(share 2)"
    done
    done
done
