#!/usr/bin/env python3
"""Inter-token latency of running streams while structured-output requests arrive.

For each server binary given (`--server NAME=PATH`, e.g. a build before and one after a
change), and for each round, it starts `PATH serve` on a fresh port and runs two arms on
that server, one after the other:

  plain    `--streams` streaming completions (greedy, `ignore_eos`, `--tokens` each);
  chats    the same streams, and once every stream has its first token, `--schemas` chat
           requests without a grammar, one every `--schema-interval-s` (what arriving
           requests cost the streams whatever they ask: their prefill, a larger batch);
  schemas  the same as chats, each request with `response_format: json_schema`, every
           schema distinct (so none is compiled before).

It reports p50, p99 and the largest of the gaps between consecutive tokens of the streams
once all of them run (the arriving requests are not timed), and the ratios of p99 to the
plain arm's, with `shared/tools/host-quiet` run before and after each arm
(`before-after`); before each arm it waits up to `--quiet-wait-s` for a reading below
`--quiet-below`. The server is fresh for each round, so the first schema request of the
`schemas` arm also pays for whatever the server builds on a grammar's first use.
Binaries alternate within a round, so each pair sees the same load.

Usage:
  scripts/bench_grammar_itl.py --server before=target/baseline/pagekeeper-82613d6 \
      --server after=target/release/pagekeeper [--rounds 2] [--json]

Standard library only.
"""

import argparse
import http.client
import json
import os
import subprocess
import sys
import threading
import time

ARMS = ("plain", "chats", "schemas")
PROMPT = "Write a long story about a lighthouse keeper who finds a map in a bottle."


def schema(i: int) -> dict:
    """A schema of the kind clients send (an object with an enum, bounds, an array and a
    nested object), made distinct by its property names and limits."""
    k = i % 50
    return {
        "type": "object",
        "properties": {
            f"title_{i}": {"type": "string", "maxLength": 40 + k},
            f"year_{i}": {"type": "integer", "minimum": 1800 + k, "maximum": 2100},
            f"genre_{i}": {"enum": [f"mystery_{i}", f"drama_{i}", f"comedy_{i}"]},
            f"tags_{i}": {"type": "array", "items": {"type": "string"}, "maxItems": 3 + k % 5},
            f"author_{i}": {
                "type": "object",
                "properties": {f"name_{i}": {"type": "string"}, f"born_{i}": {"type": "integer"}},
                "required": [f"name_{i}"],
            },
        },
        "required": [f"title_{i}", f"year_{i}", f"genre_{i}", f"tags_{i}", f"author_{i}"],
        "additionalProperties": False,
    }


def host_quiet(path: str) -> float:
    """The host's worst stalled fraction over 2 s (NaN without the tool)."""
    if not path or not os.path.exists(path):
        return float("nan")
    out = subprocess.run([path, "2"], capture_output=True, text=True).stdout
    return float(out.strip().split()[0].split("=")[-1]) if out.strip() else float("nan")


def wait_quiet(path: str, below: float, max_wait_s: float) -> float:
    """host-quiet, repeated until it reads below `below` or `max_wait_s` passed; the last
    reading (an arm may still start on a busy host, and says so)."""
    deadline = time.time() + max_wait_s
    quiet = host_quiet(path)
    while not quiet < below and time.time() < deadline:
        time.sleep(3)
        quiet = host_quiet(path)
    return quiet


def start(binary: str, model: str, port: int) -> subprocess.Popen:
    cmd = [binary, "serve", "--port", str(port), "--max-running-seqs", "64"]
    if model:
        cmd += ["--model", model]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                return proc
        except OSError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"{binary} serve exited with {proc.returncode}")
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"{binary} serve not healthy after 120 s")


def post(port: int, path: str, body: dict) -> http.client.HTTPResponse:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    return c.getresponse()


def stream(port: int, tokens: int, first: threading.Barrier, gaps_s: list, errors: list):
    """One streaming completion; appends its inter-token gaps (seconds) to `gaps_s`."""
    body = {"prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    resp = post(port, "/v1/completions", body)
    if resp.status != 200:
        errors.append(f"stream: HTTP {resp.status} {resp.read()[:200]!r}")
        first.abort()
        return
    last, mine, arrived = None, [], False
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if not any(c.get("text") for c in chunk.get("choices", [])):
            continue
        now = time.perf_counter()
        if last is not None:
            mine.append(now - last)
        last = now
        if not arrived:
            arrived = True
            try:
                first.wait()
            except threading.BrokenBarrierError:
                pass
            # Gaps count from the first token after every stream has started: before
            # that, the other streams' prefills run and no request has arrived yet.
            last = None
    gaps_s.extend(mine)


def arriving(port: int, i: int, max_tokens: int, with_schema: bool, errors: list):
    body = {"messages": [{"role": "user", "content": f"Describe book number {i} as JSON."}],
            "max_tokens": max_tokens, "temperature": 0}
    if with_schema:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": f"book{i}", "schema": schema(i)}}
    resp = post(port, "/v1/chat/completions", body)
    data = resp.read()
    if resp.status != 200:
        errors.append(f"request {i}: HTTP {resp.status} {data[:200]!r}")


def arm(port: int, a, kind: str, seed: int) -> dict:
    gaps_s, errors = [], []
    # The streams' first tokens, plus this thread: schemas start once every stream runs.
    first = threading.Barrier(a.streams + 1)
    threads = [threading.Thread(target=stream, args=(port, a.tokens, first, gaps_s, errors))
               for _ in range(a.streams)]
    for t in threads:
        t.start()
    try:
        first.wait(timeout=300)
    except threading.BrokenBarrierError:
        pass
    side = []
    if kind != "plain":
        for k in range(a.schemas):
            t = threading.Thread(target=arriving, args=(port, seed + k, a.schema_max_tokens,
                                                        kind == "schemas", errors))
            t.start()
            side.append(t)
            time.sleep(a.schema_interval_s)
    for t in threads + side:
        t.join()
    gaps_s.sort()
    pick = lambda p: gaps_s[round((len(gaps_s) - 1) * p)] * 1e3 if gaps_s else float("nan")
    return {"gaps": len(gaps_s), "itl_p50_ms": pick(0.50), "itl_p99_ms": pick(0.99),
            "itl_max_ms": pick(1.0), "errors": errors}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--server", action="append", required=True, help="NAME=PATH of a pagekeeper binary")
    p.add_argument("--model", default="", help="GGUF path (default: the server's default model)")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--schemas", type=int, default=8)
    p.add_argument("--schema-interval-s", type=float, default=0.5)
    p.add_argument("--schema-max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--port", type=int, default=8493)
    p.add_argument("--host-quiet", default=os.environ.get("HOST_QUIET", "/work/shared/tools/host-quiet"))
    p.add_argument("--quiet-below", type=float, default=0.05,
                   help="wait (at most --quiet-wait-s) for host-quiet below this before each arm")
    p.add_argument("--quiet-wait-s", type=float, default=120)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    servers = [s.split("=", 1) for s in a.server]
    rows = []
    for r in range(a.rounds):
        for name, binary in servers:
            proc = start(binary, a.model, a.port)
            try:
                # One short request first, so that neither arm pays for the first step.
                post(a.port, "/v1/completions", {"prompt": "Hi", "max_tokens": 4}).read()
                for kind in ARMS:
                    quiet = wait_quiet(a.host_quiet, a.quiet_below, a.quiet_wait_s)
                    res = arm(a.port, a, kind, seed=1000 * r + 100 * len(rows))
                    quiet_after = host_quiet(a.host_quiet)
                    res.update(round=r, server=name, arm=kind,
                               host_quiet=f"{quiet:.3f}-{quiet_after:.3f}")
                    rows.append(res)
                    if not a.json:
                        print(f"round {r} {name:>8} {kind:>7}: host-quiet {res['host_quiet']}, "
                              f"{res['gaps']} gaps, ITL p50 {res['itl_p50_ms']:.1f} ms, "
                              f"p99 {res['itl_p99_ms']:.1f} ms, max {res['itl_max_ms']:.1f} ms"
                              + (f", errors {res['errors']}" if res["errors"] else ""),
                              flush=True)
            finally:
                proc.terminate()
                proc.wait()
    if a.json:
        print(json.dumps(rows, indent=1))
        return 0
    print("\n| round | server | host-quiet before-after: plain / chats / schemas "
          "| ITL p50 plain / chats / schemas (ms) | ITL p99 plain / chats / schemas (ms) "
          "| largest gap plain / chats / schemas (ms) | p99 chats / plain | p99 schemas / plain |")
    print("|---|---|---|---|---|---|---|---|")
    cell = lambda rs, key, fmt: " / ".join(format(r[key], fmt) for r in rs)
    for i in range(0, len(rows), len(ARMS)):
        rs = rows[i:i + len(ARMS)]
        print(f"| {rs[0]['round']} | {rs[0]['server']} | {cell(rs, 'host_quiet', 's')} "
              f"| {cell(rs, 'itl_p50_ms', '.1f')} | {cell(rs, 'itl_p99_ms', '.1f')} "
              f"| {cell(rs, 'itl_max_ms', '.0f')} "
              f"| {rs[1]['itl_p99_ms'] / rs[0]['itl_p99_ms']:.2f}× "
              f"| {rs[2]['itl_p99_ms'] / rs[0]['itl_p99_ms']:.2f}× |")
    return 1 if any(r["errors"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
