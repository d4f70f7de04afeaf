#!/usr/bin/env bash
# Prepares, on a machine WITHOUT a GPU, everything the GPU machine needs for
# scripts/gpu/check.sh (see scripts/gpu/README.md): builds the `cuda` binary and the pk-cuda
# test binaries, strips and packs them, splits the default model in two halves (one per
# device call: a call carries at most 64 MiB), runs the NVRTC compile check here, and
# prints what each call will carry. Nothing it writes is tracked by git.
#
#   .gpu1/bins.tar.xz    pagekeeper (--features cuda), the pk-cuda test binaries and
#                        its transfer_bench example
#   .gpu1/model.part-a   the model's first PART_A_BYTES
#   .gpu2/model.part-b   the rest
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/tmp/cuda-target}
# 44 MiB: call 1 carries this plus the binaries, call 2 the other ~50 MiB, each with the
# ~7 MiB working tree, so both stay under the 64 MiB a call may carry.
PART_A_BYTES=$((44 * 1024 * 1024))
MODEL_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
LIMIT_BYTES=$((62 * 1024 * 1024))

for d in /.gpu1/ /.gpu2/ /.nvrtc/; do
  grep -qxF "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude
done
rm -rf .gpu1 .gpu2 && mkdir -p .gpu1 .gpu2

echo "== build (target dir $CARGO_TARGET_DIR)"
cargo build --release -p pagekeeper --features cuda
cargo build --release -p pk-cuda --example transfer_bench
mapfile -t TESTS < <(cargo test --release -p pk-cuda --no-run --message-format=json 2>/dev/null \
  | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    # tests/emulated.rs runs the kernels on the CPU (it compiles C++ from this checkout):
    # nothing for the GPU machine to do.
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"] \
            and m["target"]["name"] != "emulated":
        print(m["target"]["name"] + " " + m["executable"])')
[ "${#TESTS[@]}" -ge 3 ] || { echo "expected the pk-cuda test binaries, got: ${TESTS[*]}" >&2; exit 1; }

STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
mkdir -p "$STAGE/bin"
cp "$CARGO_TARGET_DIR/release/pagekeeper" "$STAGE/bin/pagekeeper"
cp "$CARGO_TARGET_DIR/release/examples/transfer_bench" "$STAGE/bin/transfer_bench"
for t in "${TESTS[@]}"; do
  set -- $t
  cp "$2" "$STAGE/bin/test-$1"
done
strip "$STAGE"/bin/*
tar -C "$STAGE" -cf - bin | xz -T2 -6 > .gpu1/bins.tar.xz
echo "binaries: $(ls "$STAGE/bin" | tr '\n' ' ')"

echo "== model"
MODEL=${PAGEKEEPER_HOME:-$HOME/.cache/pagekeeper}/SmolLM2-135M-Instruct.Q4_1.gguf
[ -f "$MODEL" ] || "$CARGO_TARGET_DIR/release/pagekeeper" fetch-model
echo "$MODEL_SHA256  $MODEL" | sha256sum -c --quiet
head -c "$PART_A_BYTES" "$MODEL" > .gpu1/model.part-a
tail -c +$((PART_A_BYTES + 1)) "$MODEL" > .gpu2/model.part-b
cat .gpu1/model.part-a .gpu2/model.part-b | sha256sum | grep -q "$MODEL_SHA256" || { echo "split does not reassemble" >&2; exit 1; }

echo "== NVRTC compile check (no GPU needed)"
if [ ! -f .nvrtc/nvidia/cu13/lib/libnvrtc.so.13 ]; then
  (cd "$STAGE" && python3 -m pip download -q --no-deps "nvidia-cuda-nvrtc==13.0.*" -d wheel \
    && mkdir -p "$ROOT/.nvrtc" && unzip -q -o wheel/*.whl 'nvidia/cu13/lib/*' -d "$ROOT/.nvrtc")
fi
# The test fails (it never skips) if the library cannot be opened or a kernel does not compile.
LD_LIBRARY_PATH=$ROOT/.nvrtc/nvidia/cu13/lib cargo test --release -p pk-cuda --test nvrtc_compile -- --nocapture 2>&1 \
  | grep -E "kernels|panicked|error|test result"

echo "== what each call carries (limit 64 MiB; this script wants under $((LIMIT_BYTES >> 20)) MiB)"
TREE=$( { git ls-files -z; git ls-files -z --others --exclude-standard; } | xargs -0 -r du -cb 2>/dev/null | tail -1 | cut -f1)
C1=$((TREE + $(du -cb .gpu1 | tail -1 | cut -f1)))
C2=$((TREE + $(du -cb .gpu2 | tail -1 | cut -f1)))
python3 -c 'import sys; t, a, b = (int(x) / 2**20 for x in sys.argv[1:]); print(f"working tree {t:.1f} MiB | call 1 (.gpu1) {a:.1f} MiB | call 2 (.gpu2) {b:.1f} MiB")' "$TREE" "$C1" "$C2"
[ "$C1" -lt "$LIMIT_BYTES" ] && [ "$C2" -lt "$LIMIT_BYTES" ] || { echo "a call would carry too much: move PART_A_BYTES" >&2; exit 1; }
echo "ready: see scripts/gpu/README.md for the two device calls"
