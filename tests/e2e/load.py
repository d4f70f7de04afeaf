"""Bounded load on loopback against a live `pagekeeper serve`: 32 concurrent streaming
clients, 128 requests in all, then one client that disconnects mid-stream. Afterwards the
server must report no running or waiting requests and zero KV usage (no leaked blocks).

Run by crates/cli/tests/server_e2e.rs: python3 load.py BASE_URL
"""
import concurrent.futures
import http.client
import json
import sys
import time
import urllib.parse
import urllib.request

import openai

base = sys.argv[1]
client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300)
model = client.models.list().data[0].id

def stream_one(i):
    n = 0
    for ch in client.completions.create(model=model, prompt=f"Request {i}: the weather today is", max_tokens=6,
                                         temperature=0.7, seed=i, stream=True):
        n += sum(len(c.text) for c in ch.choices)
    return n

t0 = time.time()
with concurrent.futures.ThreadPoolExecutor(32) as ex:
    results = list(ex.map(stream_one, range(128)))
assert len(results) == 128 and all(r >= 0 for r in results)
print(f"load: 128 streaming requests from 32 clients in {time.time() - t0:.1f} s")

# A client that disconnects mid-stream: read one chunk of a long generation, then close.
u = urllib.parse.urlparse(base)
conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
body = json.dumps({"prompt": "Tell me a very long story.", "max_tokens": 2000, "stream": True, "ignore_eos": True})
conn.request("POST", "/v1/completions", body, {"content-type": "application/json"})
resp = conn.getresponse()
assert resp.status == 200
resp.fp.readline()
conn.close()

def metric(name):
    text = urllib.request.urlopen(base + "/metrics").read().decode()
    vals = [float(l.split()[-1]) for l in text.splitlines() if l.startswith(name + "{")]
    return vals[0] if vals else None

deadline = time.time() + 60
while time.time() < deadline:
    if metric("vllm:num_requests_running") == 0 and metric("vllm:num_requests_waiting") == 0 and metric("vllm:kv_cache_usage_perc") == 0:
        break
    time.sleep(0.2)
else:
    raise AssertionError(f"blocks leaked: running={metric('vllm:num_requests_running')} usage={metric('vllm:kv_cache_usage_perc')}")
gen = metric("vllm:generation_tokens_total")
assert gen is not None and gen < 2000 + 128 * 6 + 500, f"the disconnected request kept generating: {gen} tokens"
print("load: all checks passed")
