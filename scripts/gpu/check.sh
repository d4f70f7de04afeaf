#!/usr/bin/env bash
# Runs on the GPU machine (the `run` device tool), over binaries built and packed here by
# scripts/gpu/prepare.sh; logs go to $OUT. Two calls, because the default model (94 MiB)
# does not fit in one call's 64 MiB (scripts/gpu/README.md has the exact calls):
#
#   check.sh 1   unpack .gpu1 (binaries, model half A) into $STASH; pk-cuda's tests with
#                --include-ignored (the GPU tests are #[ignore]d for machines without one,
#                and fail here if the device cannot be opened), but those of the real model
#                (test-backend's real_model_*, run by call 2); bench perf on
#                random Llama-3.1-8B weights (batch-1 decode at 512 and 2048 tokens, then a
#                batched-decode sweep 1..64); the bulk KV transfer bench
#   check.sh 2   join half A (left in $STASH by call 1 on the still-warm machine) with .gpu2's
#                half B, check the SHA-256, and compare perplexity on the GPU with the CPU's
#                golden value (within 1 %), plus the CPU's own value on this machine; then
#                the engine on a CudaBackend against the CPU engine (test-backend real_model)
#
# Each step has its own timeout, so one hang cannot eat the device time; a failed step is
# reported and the others still run. The exit status is the number of failed steps.
set -uo pipefail
cd "$(dirname "$0")/../.."
PART=${1:?usage: check.sh 1|2}
OUT=${OUT:-/tmp/pk-gpu-out}
STASH=/root/pk-gpu
MODEL_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
# The CPU's perplexity over the first 20 chunks of 512 tokens: crates/engine/tests/golden_perplexity.rs.
CPU_GOLDEN_PPL_512_20=19.80
mkdir -p "$OUT" "$STASH"
exec > >(tee -a "$OUT/check$PART.log") 2>&1
FAILED=0
# The device tool stops a command after 600 s, and a session has 15 minutes of device time
# in all (the machine's start included): steps are cut to end before this deadline.
if [ "$PART" = 1 ]; then DEADLINE_S=${CHECK_DEADLINE_S:-420}; else DEADLINE_S=${CHECK_DEADLINE_S:-220}; fi
step() { # step NAME TIMEOUT_S COMMAND...: runs it, logs its status and time
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS left=$((DEADLINE_S - SECONDS))
  [ "$limit" -le "$left" ] || limit=$left
  if [ "$limit" -le 5 ]; then
    echo "== $name: SKIPPED, past the deadline"
    FAILED=$((FAILED + 1))
    return
  fi
  echo "== $name (limit ${limit}s)"
  timeout "$limit" "$@"
  local rc=$?
  echo "== $name: exit $rc after $((SECONDS - t0)) s"
  [ $rc -eq 0 ] || FAILED=$((FAILED + 1))
}

# libcuda comes with the driver; libnvrtc.so.13 and libcublas.so.13 with the CUDA toolkit
# or PyTorch's pip packages. cudarc opens them by name, so their folders go on the path.
find_lib_dir() {
  local name=$1 hit
  hit=$(ldconfig -p 2>/dev/null | awk -v n="$name" '$1 ~ "^"n {print $NF; exit}')
  # Never a toolkit's stubs/libcuda.so (it only returns CUDA_ERROR_STUB_LIBRARY), which a
  # search of /usr/local would otherwise find before the driver's copy in /usr/lib.
  [ -n "$hit" ] || hit=$(find /usr/local /usr/lib /usr/lib64 /opt -name "$name*" -not -name '*.alt.*' -not -path '*/stubs/*' 2>/dev/null | head -1)
  [ -n "$hit" ] && dirname "$hit"
}
for lib in libcuda.so libnvrtc.so.13 libcublas.so.13 libcublasLt.so.13; do
  dir=$(find_lib_dir "$lib") || true
  if [ -z "$dir" ] && [ "$lib" != libcuda.so ]; then
    # cudarc also opens a CUDA 12 library when no .so.13 is found.
    dir=$(find_lib_dir "${lib%.13}.12") || true
    [ -n "$dir" ] && lib=${lib%.13}.12 || lib="$lib (or .12)"
  fi
  echo "$lib: ${dir:-NOT FOUND}"
  [ -n "$dir" ] && case ":${LD_LIBRARY_PATH:-}:" in *":$dir:"*) ;; *) LD_LIBRARY_PATH="$dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ;; esac
done
# PK_CUDA_REQUIRE=1: transfer_bench (an example, not a test) fails instead of printing
# "skipped" when it cannot open the device.
export LD_LIBRARY_PATH PK_CUDA_REQUIRE=1 RUST_BACKTRACE=1
export PAGEKEEPER_HOME=$STASH/home
BIN=$STASH/bin

if [ "$PART" = 1 ]; then
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv | tee "$OUT/nvidia-smi.csv"
  rm -rf "$BIN" && xz -dc .gpu1/bins.tar.xz | tar -C "$STASH" -xf - || { echo "cannot unpack .gpu1/bins.tar.xz" >&2; exit 100; }
  cp .gpu1/model.part-a "$STASH/model.part-a"
  for t in "$BIN"/test-*; do
    # The real model is whole only in call 2. --include-ignored: every GPU test is
    # #[ignore]d so that machines without a GPU count it as ignored; here all of them run.
    step "$(basename "$t")" 120 "$t" --include-ignored --test-threads 4 --nocapture --skip real_model
  done
  # Each bench twice: eager launches, then decode steps replayed from CUDA graphs.
  for graphs in 0 1; do
    step "bench perf batch 1, graphs $graphs" 90 env PK_CUDA_GRAPHS=$graphs "$BIN/pagekeeper" bench perf --device cuda \
      --dummy llama-3.1-8b --contexts 512,2048 --decode-tokens 128
  done
  for graphs in 0 1; do
    step "bench perf batch sweep, graphs $graphs" 120 env PK_CUDA_GRAPHS=$graphs "$BIN/pagekeeper" bench perf --device cuda \
      --dummy llama-3.1-8b --contexts 512 --batch 1,2,4,8,16,32,64 --decode-tokens 32
  done
  # Bulk KV transfers (pinned staging + copy stream) vs the per-block copies, by GB/s.
  step "transfer bench" 60 "$BIN/transfer_bench" --repeats 3
elif [ "$PART" = 2 ]; then
  [ -x "$BIN/pagekeeper" ] && [ -f "$STASH/model.part-a" ] || {
    echo "call 1's files are gone (the machine was given back between the calls): run call 1 again, then call 2 at once" >&2
    exit 100
  }
  mkdir -p "$PAGEKEEPER_HOME"
  MODEL=$PAGEKEEPER_HOME/SmolLM2-135M-Instruct.Q4_1.gguf
  cat "$STASH/model.part-a" .gpu2/model.part-b > "$MODEL"
  echo "$MODEL_SHA256  $MODEL" | sha256sum -c || exit 101
  TEXT=tests/fixtures/around-the-world-in-80-days.txt
  step "perplexity cuda" 120 sh -c "'$BIN/pagekeeper' perplexity --device cuda --file $TEXT --ctx 512 --chunks 20 --json > '$OUT/ppl_cuda.json'"
  # The same with bf16 GEMM operands, for the record (8 significant bits instead of 11).
  step "perplexity cuda bf16" 120 sh -c "PK_CUDA_ACT=bf16 '$BIN/pagekeeper' perplexity --device cuda --file $TEXT --ctx 512 --chunks 20 --json > '$OUT/ppl_cuda_bf16.json'"
  step "perplexity cpu" 180 sh -c "'$BIN/pagekeeper' perplexity --file $TEXT --ctx 512 --chunks 20 --json > '$OUT/ppl_cpu.json'"
  step "perplexity within 1 %" 10 python3 - "$OUT/ppl_cuda.json" "$OUT/ppl_cpu.json" "$CPU_GOLDEN_PPL_512_20" <<'EOF'
import json, sys
def ppl(path):
    try:
        return json.load(open(path))["ppl"]
    except Exception as e:
        print(f"no perplexity in {path}: {e}")
        return None
gpu, cpu, golden = ppl(sys.argv[1]), ppl(sys.argv[2]), float(sys.argv[3])
print(f"cuda with bf16 operands: {ppl(sys.argv[1].replace('.json', '_bf16.json'))}")
# The reference: the CPU's value on this machine when it ran, else the golden test's.
ref = cpu if cpu is not None else golden
print(f"PPL n_ctx 512 x 20: cuda {gpu} | cpu here {cpu} | cpu golden {golden}")
if gpu is None:
    sys.exit(1)
print(f"cuda vs cpu reference {ref:.4f}: {100 * (gpu - ref) / ref:+.3f} %")
sys.exit(0 if abs(gpu - ref) / ref < 0.01 else 1)
EOF
  # The engine (scheduler, prefix cache, SnapKV eviction) over a CudaBackend against the
  # CPU engine: greedy tokens, and eviction with queries captured on the device. Last, so
  # that it can never crowd out the perplexity bar.
  step "engine on CudaBackend vs CPU" 60 "$BIN/test-backend" real_model --include-ignored --test-threads 2 --nocapture
else
  echo "usage: check.sh 1|2" >&2
  exit 2
fi
echo "== check $PART: $FAILED step(s) failed"
exit "$FAILED"
