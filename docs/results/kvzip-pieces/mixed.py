"""A plain stream decoding beside KVzip requests: the stream's inter-token gaps show
whether the KVzip passes stall it. Usage: mixed.py PAGEKEEPER_BINARY PORT OUT_JSON"""
import json, os, subprocess, sys, threading, time, statistics
from openai import OpenAI

binary, port, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
PLAIN_TOKENS = 6000
book = open(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                         '../../../../shared/data/around-the-world-in-80-days.txt')).read()
server = subprocess.Popen([binary, 'serve', '--port', str(port), '--threads', '2'],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
client = OpenAI(base_url=f'http://127.0.0.1:{port}/v1', api_key='x')
for _ in range(600):
    try:
        MODEL = client.models.list().data[0].id; break
    except Exception:
        time.sleep(0.2)

def stream_gaps(prompt, max_tokens, extra):
    times = []
    s = client.chat.completions.create(model=MODEL, messages=[{'role': 'user', 'content': prompt}],
        max_tokens=max_tokens, stream=True, temperature=0, extra_body=extra)
    for chunk in s:
        if chunk.choices and chunk.choices[0].delta.content:
            times.append(time.monotonic())
    return times

result = {}
first_token = threading.Event()
def plain():
    times = []
    s = client.chat.completions.create(model=MODEL, messages=[{'role': 'user', 'content': 'Write a long story about a sailor.'}],
        max_tokens=PLAIN_TOKENS, stream=True, temperature=0, extra_body={'ignore_eos': True})
    for chunk in s:
        if chunk.choices and chunk.choices[0].delta.content:
            times.append(time.monotonic())
            first_token.set()
    result['plain'] = times

kvzip_times = []
def kvzip(i):
    start = time.monotonic()
    ctx = book[20000 + 6000 * i: 20000 + 6000 * i + 4500]
    t = stream_gaps(ctx + '\n\nWho is the main character?', 8,
                    {'kv_policy': 'kvzip', 'kv_budget': 256, 'ignore_eos': True})
    kvzip_times.append({'ttft_s': t[0] - start, 'e2e_s': t[-1] - start, 'tokens': len(t)})

a = threading.Thread(target=plain); a.start()
first_token.wait()
time.sleep(0.5)
for i in range(3):
    k = threading.Thread(target=kvzip, args=(i,)); k.start(); k.join()
kvzip_done = time.monotonic()
a.join()
server.terminate(); server.wait()
t = result['plain']
# Only the gaps while KVzip requests ran beside the stream.
gaps = [b - a for a, b in zip(t, t[1:]) if b <= kvzip_done]
gaps_sorted = sorted(gaps)
summary = {
    'binary': binary, 'plain_tokens': len(t), 'gap_p50_s': statistics.median(gaps),
    'gap_p99_s': gaps_sorted[int(0.99 * (len(gaps) - 1))], 'gap_max_s': max(gaps),
    'gaps_beside_kvzip': len(gaps), 'gaps_over_0_1_s': sum(g > 0.1 for g in gaps), 'plain_done_after_kvzip': t[-1] > kvzip_done, 'kvzip': kvzip_times,
}
json.dump(summary, open(out, 'w'), indent=1)
print(json.dumps(summary))
