#!/usr/bin/env bash
# llama.cpp's own llama-bench and `pagekeeper bench perf`, alternating on the same GGUF with
# the same thread count, so that both see the same host load (issue 3's reference numbers
# were llama-bench's pp512 and tg128).
#
# llama-bench is built from the newest llama.cpp on PyPI: the source that llama-cpp-python
# 0.3.36 vendors in its sdist (llama.cpp 0c1e570, 2026-10-01; `-DGGML_NATIVE=ON`, Release,
# OpenMP), since nothing but PyPI and crates.io can be reached here. Optional: no test
# needs it.
#
# Usage: scripts/llama_bench_side_by_side.sh [ROUNDS] [THREADS...]   (default: 2 rounds, 1 2)
# Env:   PK_BIN (default target/release/pagekeeper), PK_MODEL (default: the fetched
#        SmolLM2-135M-Instruct Q4_1), LLAMA_WORK (build folder, default /tmp/llama-bench),
#        LLAMA_BENCH (a llama-bench binary to use instead of building one),
#        LONG_PROMPTS (e.g. "4096 8192": also prefill of those lengths, llama.cpp with
#        `-fa 0` and `-fa 1`, one repetition each; default none),
#        REPS (default 3): repetitions of pp512 and tg128 for both engines, each after one
#        warm-up run, as llama-bench's `-r 3`; both print the mean of the reps' tokens/s
#        (before 2026-12-07 ours was a single run without a warm-up),
#        LONG_WARMUP (1, the default: llama-bench's warm-up run of the whole long prompt
#        before the timed one; 0 passes `--no-warmup`, halving a 16K row's half hour: the
#        warm-up only touches pages first, under a second against minutes, and
#        `bench perf` runs none either),
#        AS_AVX2=1 (on a CPU with AVX-512: both engines as on an AVX2-only host, llama.cpp
#        built with AVX2/FMA/F16C and nothing wider in $LLAMA_WORK/.../build-avx2, ours with
#        PK_ISA=avx2, which narrows every kernel; a proxy for the AMD AVX2 hosts' figures,
#        not a substitute: the cores differ).
set -euo pipefail

rounds=${1:-2}
shift || true
threads=("${@:-1 2}")
[ ${#threads[@]} -eq 1 ] && read -r -a threads <<< "${threads[0]}"
work=${LLAMA_WORK:-/tmp/llama-bench}
pk=${PK_BIN:-target/release/pagekeeper}
model=${PK_MODEL:-$HOME/.cache/pagekeeper/SmolLM2-135M-Instruct.Q4_1.gguf}
quiet=../shared/tools/host-quiet
[ -x "$quiet" ] || quiet=/work/shared/tools/host-quiet
as_avx2=${AS_AVX2:-0}
case "$as_avx2" in
    0 | 1) ;;
    *) echo "AS_AVX2=$as_avx2: expected 0 or 1" >&2; exit 2 ;;
esac
build_dir=build
[ "$as_avx2" = 1 ] && build_dir=build-avx2
lb=${LLAMA_BENCH:-$work/src/vendor/llama.cpp/$build_dir/bin/llama-bench}
long_prompts=${LONG_PROMPTS:-}
reps=${REPS:-3}
if ! [[ "$reps" =~ ^[1-9][0-9]*$ ]]; then
    echo "REPS=$reps: expected a positive whole number" >&2
    exit 2
fi
long_warmup=()
case "${LONG_WARMUP:-1}" in
    1) ;;
    0) long_warmup=(--no-warmup) ;;
    *) echo "LONG_WARMUP=$LONG_WARMUP: expected 0 or 1" >&2; exit 2 ;;
esac
# The sdist has no git history: the commit is the one its release vendors.
LCP_VERSION=0.3.36
LCP_COMMIT="0c1e570 (llama-cpp-python $LCP_VERSION)"

if [ ! -x "$lb" ]; then
    if [ ! -d "$work/src/vendor/llama.cpp" ]; then
        mkdir -p "$work"
        python3 -m venv "$work/venv"
        "$work/venv/bin/pip" install -q cmake ninja scikit-build-core
        # --no-build-isolation: only the sdist is wanted, not a wheel built in an isolated env.
        "$work/venv/bin/pip" download -q --no-deps --no-binary llama-cpp-python --no-build-isolation "llama-cpp-python==$LCP_VERSION" -d "$work"
        rm -rf "$work/src" && mkdir -p "$work/src"
        tar xzf "$work/llama_cpp_python-$LCP_VERSION.tar.gz" -C "$work/src" --strip-components=1
    fi
    # On a CPU with AMX, GGML_NATIVE compiles llama.cpp's AMX kernels, and 0c1e570's
    # llama-bench then dies of SIGILL in `tinygemm_kernel_amx` at the first prompt (a
    # `tileloadd` with no tile configuration loaded; granting the tile permission first
    # does not help). Such hosts build without AMX, keeping everything else native
    # (AVX-512 VNNI and llama.cpp's CPU repacking), which is the best llama.cpp that runs.
    no_amx=()
    if grep -q -w amx_int8 /proc/cpuinfo; then
        flags="-mno-amx-int8 -mno-amx-tile -mno-amx-bf16"
        no_amx=(-DCMAKE_C_FLAGS="$flags" -DCMAKE_CXX_FLAGS="$flags")
    fi
    isa=(-DGGML_NATIVE=ON "${no_amx[@]}")
    if [ "$as_avx2" = 1 ]; then
        # What `-DGGML_NATIVE=ON` gives on an AMD EPYC with AVX2 only (Zen 2/3).
        isa=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
             -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF)
    fi
    (cd "$work/src/vendor/llama.cpp" && PATH=$work/venv/bin:$PATH cmake -B "$build_dir" -G Ninja -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release "${isa[@]}" >/dev/null \
        && PATH=$work/venv/bin:$PATH ninja -C "$build_dir" llama-bench >/dev/null)
fi
if [ "$as_avx2" = 1 ]; then
    export PK_ISA=avx2
fi

# LLAMA_BENCH: a llama-bench built elsewhere (e.g. llama.cpp 0c1e570 from llama-cpp-python
# 0.3.36's sdist, scripts/conformance/README.md); its source tree names the commit.
src_dir=$(dirname "$(dirname "$(dirname "$(readlink -f "$lb")")")")
if [ -z "${LLAMA_BENCH:-}" ]; then
    echo "llama.cpp $LCP_COMMIT"
else
    echo "llama.cpp $(git -C "$src_dir" log -1 --format=%h 2>/dev/null || echo "at $src_dir (commit unknown)")"
fi
grep -o -w -E 'avx2|avx512f|avx512_vnni|amx_int8' /proc/cpuinfo | sort -u | tr '\n' ' ' | sed 's/^/CPU flags: /'; echo
if [ "$as_avx2" = 1 ]; then
    echo "AS_AVX2=1: llama.cpp built for AVX2/FMA/F16C only; pagekeeper with PK_ISA=avx2 (every kernel AVX2)"
elif grep -q -w amx_int8 /proc/cpuinfo; then
    echo "llama.cpp built without its AMX kernels (they crash here; see the build step); pagekeeper's matmul kernel: AMX unless PK_AMX=0"
fi
for round in $(seq "$rounds"); do
    for t in "${threads[@]}"; do
        # host-quiet exits non-zero when the host is busy; its figure is what matters.
        q=$("$quiet" 2>/dev/null) || true
        echo "== round $round, threads $t, ${q:-host-quiet unavailable}"
        "$lb" -m "$model" -t "$t" -p 512 -n 128 -r "$reps" -o csv 2>/dev/null | python3 -c '
import csv, sys
for r in csv.DictReader(sys.stdin):
    test = "pp%s" % r["n_prompt"] if r["n_prompt"] != "0" else "tg%s" % r["n_gen"]
    print("llama.cpp   %-6s %8.1f tok/s" % (test, float(r["avg_ts"])))'
        # As llama-bench measures (`-r 3` after one warm-up run of the test): one untimed
        # 512-token prompt, then $reps of them (pp512 and the decode after each), then $reps
        # 16-token prompts (decode at tg128's depth); each figure is the mean of the reps'
        # tokens/s, as llama-bench's avg_ts is. One process, so the warm-up also pages in the
        # model and the KV pool, which llama-bench's warm-up does for it.
        contexts=$(python3 -c 'import sys; r = int(sys.argv[1]); print(",".join(["512"] * (r + 1) + ["16"] * r))' "$reps")
        "$pk" bench perf --model "$model" --contexts "$contexts" --decode-tokens 128 --threads "$t" --json 2>/dev/null | python3 -c '
import json, sys
runs = json.load(sys.stdin)["runs"][1:]
mean = lambda xs: sum(xs) / len(xs)
long_runs = [r for r in runs if r["context_tokens"] == 512]
short_runs = [r for r in runs if r["context_tokens"] == 16]
print("pagekeeper  pp512  %8.1f tok/s   (decode after 512: %.1f tok/s; mean of %d after a warm-up)" % (
    mean([r["prefill_tok_s"] for r in long_runs]), mean([r["decode_tok_s"] for r in long_runs]), len(long_runs)))
print("pagekeeper  tg128  %8.1f tok/s   (after a 16-token prompt; mean of %d)" % (
    mean([r["decode_tok_s"] for r in short_runs]), len(short_runs)))'
    done
    for p in $long_prompts; do
        t=${threads[-1]}
        q=$("$quiet" 2>/dev/null) || true
        echo "== round $round, threads $t, prompt $p, llama-bench warm-up ${LONG_WARMUP:-1}, ${q:-host-quiet unavailable}"
        for fa in 0 1; do
            "$lb" -m "$model" -t "$t" -p "$p" -n 0 -r 1 -fa "$fa" "${long_warmup[@]}" -o csv 2>/dev/null | python3 -c '
import csv, sys
for r in csv.DictReader(sys.stdin):
    print("llama.cpp   pp%-5s fa=%s %8.1f tok/s" % (r["n_prompt"], sys.argv[1], float(r["avg_ts"])))' "$fa"
        done
        "$pk" bench perf --model "$model" --contexts "$p" --decode-tokens 1 --threads "$t" --json 2>/dev/null | python3 -c '
import json, sys
for r in json.load(sys.stdin)["runs"]:
    print("pagekeeper  pp%-5d      %8.1f tok/s" % (r["context_tokens"], r["prefill_tok_s"]))'
    done
done
