"""End-to-end test of `pagekeeper serve` with the official `openai` Python client.

Run by crates/cli/tests/server_e2e.rs against a live server: python3 openai_client.py BASE_URL
Every check is an assert; the process exits non-zero on the first failure.
"""
import concurrent.futures
import json
import sys
import time
import urllib.error
import urllib.request

import openai

base = sys.argv[1]
client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)

models = client.models.list()
model = models.data[0].id
assert len(models.data) == 1 and model, models

# Chat, non-streaming, greedy.
chat = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=12, temperature=0
)
assert chat.object == "chat.completion"
assert chat.choices[0].message.role == "assistant"
assert chat.choices[0].message.content, chat
assert chat.choices[0].finish_reason in ("stop", "length")
assert chat.usage.prompt_tokens == 37, chat.usage  # the golden chat_capital prompt has 37 tokens
assert chat.usage.completion_tokens <= 12

# Chat streaming must give the same text as non-streaming (greedy), ending in [DONE].
pieces, finish, usage = [], None, None
stream = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "What is the capital of France?"}],
    max_tokens=12,
    temperature=0,
    stream=True,
    stream_options={"include_usage": True},
)
for ch in stream:
    if ch.usage is not None:
        usage = ch.usage
    for c in ch.choices:
        if c.delta.content:
            pieces.append(c.delta.content)
        if c.finish_reason:
            finish = c.finish_reason
assert "".join(pieces) == chat.choices[0].message.content, (pieces, chat.choices[0].message.content)
assert finish == chat.choices[0].finish_reason
# The second identical request reuses the first one's full blocks (37 tokens -> 2 blocks of 16).
assert usage is not None and usage.prompt_tokens_details.cached_tokens == 32, usage

# Completions with a stop string.
comp = client.completions.create(model=model, prompt="The planets of the solar system, in order from the Sun, are", max_tokens=32, temperature=0, stop=["\n"])
assert comp.object == "text_completion"
assert "\n" not in comp.choices[0].text
assert comp.usage.prompt_tokens > 0

# Streaming completions.
text = "".join(c.choices[0].text for c in client.completions.create(model=model, prompt="Once upon a time", max_tokens=8, temperature=0, stream=True) if c.choices)
assert len(text) > 0

# pagekeeper extensions pass through extra_body; cache_salt separates prefix caches.
salted = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=2, temperature=0,
    extra_body={"cache_salt": "tenant-a", "kv_policy": "full"},
)
assert salted.usage.prompt_tokens_details.cached_tokens == 0, salted.usage

# A request with an eviction policy and budget: pruned prompt tokens show up per policy.
long_prompt = " ".join(["The quick brown fox jumps over the lazy dog."] * 40)
ev = client.completions.create(model=model, prompt=long_prompt, max_tokens=8, temperature=0,
                               extra_body={"kv_policy": "paged-eviction", "kv_budget": 128})
assert ev.usage.completion_tokens == 8 or ev.choices[0].finish_reason == "stop", ev
# The same per KV head (kvpress's granularity).
ev = client.completions.create(model=model, prompt=long_prompt, max_tokens=8, temperature=0,
                               extra_body={"kv_policy": "snapkv", "kv_budget": 128, "kv_granularity": "head"})
assert ev.usage.completion_tokens == 8 or ev.choices[0].finish_reason == "stop", ev
# KVzip: its reconstruction passes run (a piece a step) before the prompt is pruned.
ev = client.completions.create(model=model, prompt=long_prompt, max_tokens=8, temperature=0,
                               extra_body={"kv_policy": "kvzip:global", "kv_budget": 128, "kv_granularity": "head"})
assert ev.usage.completion_tokens == 8 or ev.choices[0].finish_reason == "stop", ev

# logprobs: the chosen token's and 5 alternatives', in OpenAI's shape; greedy picks the most
# likely, the alternatives' probabilities sum to at most 1, and the streamed values are the
# same as the non-streamed ones.
lp = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=6, temperature=0,
    logprobs=True, top_logprobs=5,
)
content = lp.choices[0].logprobs.content
assert len(content) == lp.usage.completion_tokens, (len(content), lp.usage)
assert "".join(t.token for t in content) == lp.choices[0].message.content
for t in content:
    assert len(t.top_logprobs) == 5, t
    assert t.logprob <= 0 and t.top_logprobs[0].logprob == t.logprob and t.top_logprobs[0].token == t.token, t
    assert sum(2.718281828 ** a.logprob for a in t.top_logprobs) <= 1 + 1e-5, t
    assert all(x.logprob >= y.logprob for x, y in zip(t.top_logprobs, t.top_logprobs[1:])), t
    assert bytes(t.bytes).decode("utf-8", "replace") == t.token
streamed = []
for ch in client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=6, temperature=0,
    logprobs=True, top_logprobs=5, stream=True,
):
    for c in ch.choices:
        if c.logprobs and c.logprobs.content:
            streamed.extend(c.logprobs.content)
assert [(t.token, round(t.logprob, 4)) for t in streamed] == [(t.token, round(t.logprob, 4)) for t in content], (streamed, content)
# Completions: logprobs=N gives the legacy parallel lists with text offsets.
clp = client.completions.create(model=model, prompt="Once upon a time", max_tokens=5, temperature=0, logprobs=3)
l = clp.choices[0].logprobs
assert len(l.tokens) == len(l.token_logprobs) == len(l.top_logprobs) == len(l.text_offset) == clp.usage.completion_tokens, l
assert "".join(l.tokens) == clp.choices[0].text and l.text_offset[0] == 0
assert all(len(t) <= 3 and max(t.values()) == lp_ for t, lp_ in zip(l.top_logprobs, l.token_logprobs)), l

# Sampling controls change the output as defined: a logit bias of +100 makes its token the
# greedy choice, with a logprob of about 0 (logprobs are of the processed logits); min_tokens
# makes a request that would stop early generate; penalties change a repetitive answer.
forced = []
for tid in ("1000", "1001"):
    r = client.completions.create(model=model, prompt="The capital of France is", max_tokens=1, temperature=0,
                                  logprobs=1, logit_bias={tid: 100})
    assert r.choices[0].logprobs.token_logprobs[0] > -0.01, r
    forced.append(r.choices[0].logprobs.tokens[0])
unbiased = client.completions.create(model=model, prompt="The capital of France is", max_tokens=1, temperature=0, logprobs=1)
assert len({forced[0], forced[1], unbiased.choices[0].logprobs.tokens[0]}) == 3, (forced, unbiased)
pen = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hello five times."}], max_tokens=24, temperature=0,
                                     presence_penalty=1.5, frequency_penalty=1.0, extra_body={"repetition_penalty": 1.3, "min_p": 0.05})
plain = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hello five times."}], max_tokens=24, temperature=0)
assert pen.choices[0].message.content != plain.choices[0].message.content, (pen, plain)
# SmolLM2's end-of-generation tokens (<|endoftext|> 0, <|im_end|> 2) biased up end a reply at
# once; min_tokens bans them for its first tokens, then the bias ends it.
eos = {"0": 100, "2": 100}
short = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=16, temperature=0, logit_bias=eos)
assert short.usage.completion_tokens == 0 and short.choices[0].finish_reason == "stop", short
longer = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=16, temperature=0, logit_bias=eos,
                                        extra_body={"min_tokens": 5})
assert longer.usage.completion_tokens == 5 and longer.choices[0].finish_reason == "stop", longer

# n = 3: three choices from one prompt, counted once in the usage; greedy choices agree,
# seeded sampled ones differ; streamed choices arrive by index, each with its finish.
q = [{"role": "user", "content": "What is the capital of France?"}]
three = client.chat.completions.create(model=model, messages=q, max_tokens=8, temperature=0, n=3)
assert [c.index for c in three.choices] == [0, 1, 2], three
assert three.usage.prompt_tokens == 37, three.usage
single = client.chat.completions.create(model=model, messages=q, max_tokens=8, temperature=0)
assert three.usage.completion_tokens == 3 * single.usage.completion_tokens, (three.usage, single.usage)
assert len({c.message.content for c in three.choices}) == 1, three
sampled = client.completions.create(model=model, prompt="My favourite animal is the", max_tokens=12, temperature=1.0, seed=5, n=3)
assert len({c.text for c in sampled.choices}) == 3, sampled
assert sampled.usage.completion_tokens == 36 or any(c.finish_reason == "stop" for c in sampled.choices), sampled.usage
by_index, finishes = {}, {}
for ch in client.chat.completions.create(model=model, messages=q, max_tokens=8, temperature=0, n=2, stream=True):
    for c in ch.choices:
        by_index.setdefault(c.index, []).append(c.delta.content or "")
        if c.finish_reason:
            finishes[c.index] = c.finish_reason
assert sorted(by_index) == [0, 1] and sorted(finishes) == [0, 1], (by_index, finishes)
assert "".join(by_index[0]) == "".join(by_index[1]) == three.choices[0].message.content, by_index

# Structured output: 20 prompts of different kinds, each with a JSON schema; every answer
# parses and validates, whatever the (small) model would have said. Strings, numbers and
# arrays are bounded so that a greedy loop inside a value (a small model's habit) cannot
# run past max_tokens on a CPU whose logits differ in the last bits.
def validate(v, schema, path="$"):
    t = schema.get("type")
    kinds = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}
    if t == "integer":
        assert isinstance(v, int) and not isinstance(v, bool), (path, v)
    elif t == "number":
        assert isinstance(v, (int, float)) and not isinstance(v, bool), (path, v)
    elif t:
        assert isinstance(v, kinds[t]), (path, v, t)
    if "enum" in schema:
        assert v in schema["enum"], (path, v)
    if "minimum" in schema:
        assert v >= schema["minimum"], (path, v)
    if "maximum" in schema:
        assert v <= schema["maximum"], (path, v)
    if "maxLength" in schema:
        assert len(v) <= schema["maxLength"], (path, v)
    if t == "object":
        for k in schema.get("required", []):
            assert k in v, (path, k, v)
        props = schema.get("properties", {})
        if schema.get("additionalProperties") is False:
            assert set(v) <= set(props), (path, v)
        for k, sub in props.items():
            if k in v:
                validate(v[k], sub, f"{path}.{k}")
    if t == "array":
        assert schema.get("minItems", 0) <= len(v) <= schema.get("maxItems", 10**9), (path, v)
        for i, x in enumerate(v):
            validate(x, schema["items"], f"{path}[{i}]")

S = lambda n=24: {"type": "string", "maxLength": n}
def obj(props, required=None):
    return {"type": "object", "properties": props, "required": list(required if required is not None else props), "additionalProperties": False}
cases = [
    ("Describe a person named Alice who is 30.", obj({"name": S(), "age": {"type": "integer", "minimum": 0, "maximum": 150}})),
    ("What is the weather in Paris?", obj({"city": S(), "temperature_c": {"type": "number", "minimum": -90, "maximum": 60}, "sunny": {"type": "boolean"}})),
    ("List three fruits.", obj({"fruits": {"type": "array", "items": S(16), "minItems": 3, "maxItems": 3}})),
    ("Is the sky blue? Answer yes or no.", obj({"answer": {"type": "string", "enum": ["yes", "no"]}})),
    ("Give a book title and its author.", obj({"title": S(40), "author": S()})),
    ("Rate the movie Titanic from 1 to 5.", obj({"rating": {"type": "integer", "minimum": 1, "maximum": 5}, "reason": S(60)})),
    ("Convert 3 km to metres.", obj({"metres": {"type": "number", "minimum": 0, "maximum": 1000000}})),
    ("Name a colour and its hex code.", obj({"colour": S(), "hex": {"type": "string", "maxLength": 7}})),
    ("What is 2 + 2?", obj({"result": {"type": "integer", "minimum": -1000, "maximum": 1000}})),
    ("Describe a cat.", obj({"name": S(), "legs": {"type": "integer", "minimum": 0, "maximum": 8}, "indoor": {"type": "boolean"}})),
    ("Give me a to-do list with two items.", obj({"todo": {"type": "array", "items": obj({"task": S(30), "done": {"type": "boolean"}}), "minItems": 2, "maxItems": 2}})),
    ("Which planet is largest?", obj({"planet": {"type": "string", "enum": ["Mercury", "Venus", "Earth", "Mars", "Jupiter", "Saturn", "Uranus", "Neptune"]}})),
    ("Write a short greeting.", obj({"greeting": S(40)})),
    ("Give the coordinates of London.", obj({"lat": {"type": "number", "minimum": -90, "maximum": 90}, "lon": {"type": "number", "minimum": -180, "maximum": 180}})),
    ("Classify the sentiment of: I love this!", obj({"sentiment": {"type": "string", "enum": ["positive", "negative", "neutral"]}, "confidence": {"type": "number", "minimum": 0, "maximum": 1}})),
    ("Summarise: The cat sat on the mat.", obj({"summary": S(50), "words": {"type": "integer", "minimum": 0, "maximum": 100}})),
    ("Make an address.", obj({"street": S(), "city": S(), "zip": S(10), "country": S(20)})),
    ("Give a recipe name and up to three ingredients.", obj({"recipe": S(30), "ingredients": {"type": "array", "items": S(16), "maxItems": 3}})),
    ("Tell me about the number seven.", obj({"number": {"type": "integer", "minimum": -1000, "maximum": 1000}, "prime": {"type": "boolean"}, "name": S(10)})),
    ("Nested: a company with a CEO.", obj({"company": S(), "ceo": obj({"name": S(), "age": {"type": "integer", "minimum": 18, "maximum": 99}})})),
]
for i, (prompt, schema) in enumerate(cases):
    kwargs = dict(response_format={"type": "json_schema", "json_schema": {"name": f"case{i}", "schema": schema, "strict": True}})
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}], max_tokens=300, temperature=0, **kwargs)
    assert r.choices[0].finish_reason == "stop", (prompt, r)
    validate(json.loads(r.choices[0].message.content), schema)
# json_object: any JSON object; guided_choice and guided_regex (vLLM's).
r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Describe Paris."}], max_tokens=400, temperature=0,
                                   response_format={"type": "json_object"})
assert isinstance(json.loads(r.choices[0].message.content), dict), r
r = client.completions.create(model=model, prompt="The best season is", max_tokens=8, temperature=0, extra_body={"guided_choice": ["spring", "summer", "autumn", "winter"]})
assert r.choices[0].text in ("spring", "summer", "autumn", "winter"), r
r = client.completions.create(model=model, prompt="A phone number:", max_tokens=20, temperature=0, extra_body={"guided_regex": r"[0-9]{3}-[0-9]{4}"})
import re as _re
assert _re.fullmatch(r"[0-9]{3}-[0-9]{4}", r.choices[0].text), r
for bad, param in [({"response_format": {"type": "json_schema"}}, "response_format"),
                   ({"response_format": {"type": "xml"}}, "response_format"),
                   ({"guided_regex": "(unclosed"}, "guided_regex"),
                   ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice")]:
    try:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4, extra_body=bad)
        raise AssertionError(f"expected a 400 for {bad}")
    except openai.BadRequestError as e:
        assert e.body.get("param") == param, (bad, e.body)

# Completions: echo puts the prompt before the text (streamed too); a list of prompts gives
# prompts x n choices numbered prompt-major, with the prompts' tokens summed in the usage.
e = client.completions.create(model=model, prompt="Once upon a time", max_tokens=4, temperature=0, echo=True)
plain4 = client.completions.create(model=model, prompt="Once upon a time", max_tokens=4, temperature=0)
assert e.choices[0].text == "Once upon a time" + plain4.choices[0].text, (e, plain4)
streamed_echo = "".join(c.choices[0].text for c in client.completions.create(model=model, prompt="Once upon a time", max_tokens=4, temperature=0, echo=True, stream=True) if c.choices)
assert streamed_echo == e.choices[0].text, streamed_echo
batch = client.completions.create(model=model, prompt=["Once upon a time", "The quick brown fox"], max_tokens=4, temperature=0, n=2)
assert [c.index for c in batch.choices] == [0, 1, 2, 3], batch
assert batch.choices[0].text == batch.choices[1].text == plain4.choices[0].text, batch
single_fox = client.completions.create(model=model, prompt="The quick brown fox", max_tokens=4, temperature=0)
assert batch.choices[2].text == single_fox.choices[0].text, (batch, single_fox)
assert batch.usage.prompt_tokens == plain4.usage.prompt_tokens + single_fox.usage.prompt_tokens, batch.usage
ids_batch = client.completions.create(model=model, prompt=[[504, 3458, 253], [504, 2365]], max_tokens=2, temperature=0)
assert len(ids_batch.choices) == 2 and ids_batch.usage.prompt_tokens == 5, ids_batch
for kwargs, param in [(dict(suffix="return x"), "suffix"),  # SmolLM2 has no FIM tokens
                      (dict(echo=True, logprobs=2), "echo"),
                      (dict(best_of=3), "best_of")]:
    try:
        client.completions.create(model=model, prompt="def f(x):", max_tokens=4, **kwargs)
        raise AssertionError(f"expected a 400 for {kwargs}")
    except openai.BadRequestError as err:
        assert err.body.get("param") == param, (kwargs, err.body)

# Tools: a named tool_choice always yields a call of that function whose arguments validate
# against its parameters (grammar-constrained), streamed as a tool_calls delta too; required
# picks one of the tools; a tool message answering the call is accepted. SmolLM2's template
# cannot describe tools, so tool_choice auto is refused for it by name.
weather = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
           "parameters": obj({"city": S(30), "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}})}}
clock = {"type": "function", "function": {"name": "get_time", "description": "Current time in a timezone",
         "parameters": obj({"timezone": S(30)})}}
ask = [{"role": "user", "content": "What is the weather in Paris?"}]
named = client.chat.completions.create(model=model, messages=ask, max_tokens=80, temperature=0, tools=[weather, clock],
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
call = named.choices[0].message.tool_calls[0]
assert named.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather", named
validate(json.loads(call.function.arguments), weather["function"]["parameters"])
req = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "What time is it in Tokyo?"}], max_tokens=80,
                                     temperature=0, tools=[weather, clock], tool_choice="required", parallel_tool_calls=False)
calls = req.choices[0].message.tool_calls
assert len(calls) == 1 and calls[0].function.name in ("get_weather", "get_time"), req
params_of = {"get_weather": weather, "get_time": clock}[calls[0].function.name]["function"]["parameters"]
validate(json.loads(calls[0].function.arguments), params_of)
deltas, finish = [], None
for ch in client.chat.completions.create(model=model, messages=ask, max_tokens=80, temperature=0, tools=[weather],
                                         tool_choice={"type": "function", "function": {"name": "get_weather"}}, stream=True):
    for c in ch.choices:
        deltas.extend(c.delta.tool_calls or [])
        finish = c.finish_reason or finish
assert finish == "tool_calls" and deltas[0].function.name == "get_weather", deltas
assert json.loads(deltas[0].function.arguments) == json.loads(call.function.arguments), (deltas, call)
answered = ask + [{"role": "assistant", "content": None, "tool_calls": [{"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
                  {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}]
final = client.chat.completions.create(model=model, messages=answered, max_tokens=8, temperature=0, tools=[weather], tool_choice="none")
assert final.choices[0].message.content is not None and not final.choices[0].message.tool_calls, final
for kwargs, param in [(dict(tools=[weather], tool_choice="auto"), "tool_choice"),
                      (dict(tool_choice="required"), "tool_choice"),
                      (dict(tools=[weather], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
                      (dict(tools=[{"type": "function", "function": {"name": "bad name"}}], tool_choice="required"), "tools")]:
    try:
        client.chat.completions.create(model=model, messages=ask, max_tokens=4, **kwargs)
        raise AssertionError(f"expected a 400 for {kwargs}")
    except openai.BadRequestError as err:
        assert err.body.get("param") == param, (kwargs, err.body)

# A forced call that max_tokens cuts short is still a call (as OpenAI's): the function's
# name, the arguments written so far, finish_reason "length"; never the raw template text.
short = client.chat.completions.create(model=model, messages=ask, max_tokens=12, temperature=0, tools=[weather],
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
c = short.choices[0]
assert c.finish_reason == "length" and c.message.tool_calls, c
assert c.message.tool_calls[0].function.name == "get_weather" and c.message.content is None, c

# The hostile-request suite: every field of OpenAI's request schema for both endpoints,
# with a value that asks for something and a malformed one. Each is honoured (200), or
# refused with a 400 naming it; never a 5xx, never a 200 for a field this server refuses.
def post(path, body):
    r = urllib.request.Request(base + path, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(r) as resp:
            resp.read()
            return resp.status, None
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read()).get("error", {})

chat_base = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
comp_base = {"model": model, "prompt": "hi", "max_tokens": 3}
honoured_chat = {
    "frequency_penalty": 0.5, "presence_penalty": 0.5, "logit_bias": {"11": 5}, "logprobs": True, "top_logprobs": None,
    "max_tokens": 2, "max_completion_tokens": 3, "n": 2, "response_format": {"type": "json_object"}, "seed": 1,
    "stop": ["\n"], "stream": False, "temperature": 0.5, "top_p": 0.9, "user": "u1",
    "tools": [weather], "tool_choice": "none", "parallel_tool_calls": False,
    "stream_options": None, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1, "min_tokens": 1,
    "guided_choice": ["a", "b"], "ignore_eos": False, "kv_policy": "full", "cache_salt": "s",
    "add_generation_prompt": False, "add_special_tokens": False, "skip_special_tokens": False, "prompt_logprobs": 1,
    "store": False, "metadata": {}, "best_of": 1,
}
refused_chat = {
    "store": True, "reasoning_effort": "high", "metadata": {"k": "v"}, "modalities": ["audio"], "prediction": {"type": "content", "content": "x"},
    "audio": {"voice": "alloy"}, "service_tier": "flex", "functions": [{"name": "f"}], "function_call": "auto",
    "web_search_options": {"search_context_size": "low"},
    # Values that look like defaults but ask for something are refused all the same.
    "include_stop_str_in_output": True, "spaces_between_special_tokens": False, "truncate_prompt_tokens": 0,
    "frobnicate": False, "echo": True, "continue_final_message": True, "stop_token_ids": [2],
}
malformed = {
    "frequency_penalty": "high", "presence_penalty": 9, "logit_bias": {"x": 1}, "logprobs": "yes", "top_logprobs": -1,
    "max_tokens": -5, "max_completion_tokens": "many", "n": 0, "response_format": {"type": "yaml"}, "seed": "s",
    "stop": 5, "temperature": -1, "top_p": 2, "tools": [{"type": "web"}], "tool_choice": "sometimes",
    "parallel_tool_calls": "yes", "stream_options": {"include_usage": "x"}, "top_k": -7, "min_p": 3,
    "repetition_penalty": -1, "min_tokens": -1, "guided_choice": [], "messages": "hi",
}
honoured_comp = {
    "best_of": 1, "echo": True, "frequency_penalty": 0.5, "logit_bias": {"11": 5}, "logprobs": 2, "max_tokens": 2, "n": 2,
    "presence_penalty": 0.5, "seed": 1, "stop": "\n", "stream": False, "suffix": None, "temperature": 0.5, "top_p": 0.9, "user": "u",
}
refused_comp = {"best_of": 3, "suffix": "x", "store": True, "metadata": {"k": "v"}, "frobnicate": "", "use_beam_search": True}
honoured_comp.update({"add_special_tokens": False, "skip_special_tokens": False, "prompt_logprobs": 0})
malformed_comp = {"best_of": "two", "echo": "yes", "logprobs": 99, "prompt": {"text": "hi"}, "suffix": 5, "n": 100}
for path, base_body, honoured, refused, bad in [
    ("/v1/chat/completions", chat_base, honoured_chat, refused_chat, malformed),
    ("/v1/completions", comp_base, honoured_comp, refused_comp, malformed_comp),
]:
    for field, value in honoured.items():
        body = {**base_body, field: value}
        if field == "tools":  # SmolLM2's template cannot describe tools: force the call
            body["tool_choice"] = "required"
        if field == "parallel_tool_calls":  # meaningful (and accepted) only with tools
            body.update(tools=[weather], tool_choice="required")
        status, err = post(path, body)
        assert status == 200, (path, field, value, status, err)
    for field, value in refused.items():
        status, err = post(path, {**base_body, field: value})
        assert status == 400 and err.get("param") == field, (path, field, status, err)
    for field, value in bad.items():
        status, err = post(path, {**base_body, field: value})
        # The error names the field (a nested one by its path: stream_options.include_usage).
        assert status == 400 and (err.get("param") or "").split(".")[0] == field, (path, field, value, status, err)

# Found by review (2026-12-07): each is refused naming its field, or honoured.
for body, param in [({**chat_base, "stop": ""}, "stop"), ({**chat_base, "stop": ["\n", ""]}, "stop"),
                    ({**chat_base, "response_format": {"type": "text", "foo": 1}}, "response_format.foo"),
                    ({**chat_base, "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object"}, "bar": 1}}},
                     "response_format.json_schema.bar"),
                    ({**chat_base, "max_completion_tokens": 0}, "max_completion_tokens"),
                    ({**chat_base, "temperature": "hot"}, "temperature"),
                    ({**comp_base, "prompt": [999999]}, "prompt")]:
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    status, err = post(path, body)
    assert status == 400 and err.get("param") == param, (body, status, err)
for body in [{**chat_base, "stream": None, "ignore_eos": None},
             {**chat_base, "response_format": {"type": "json_schema", "json_schema": {"name": "o", "description": "d", "strict": True,
                                                                                       "schema": {"type": "object"}}}}]:
    status, err = post("/v1/chat/completions", body)
    assert status == 200, (body, status, err)
try:
    urllib.request.urlopen(base + "/v1/chat/completions")
    raise AssertionError("a GET of a POST route must be refused")
except urllib.error.HTTPError as err:
    assert err.code == 405 and "does not accept GET" in json.loads(err.read())["error"]["message"]
# A temperature so small that its inverse overflows samples greedily, as temperature 0.
greedy = [client.chat.completions.create(model=model, messages=ask, max_tokens=8, temperature=t).choices[0].message.content
          for t in (0, 1e-40)]
assert greedy[0] == greedy[1], greedy
# A named function is one call, however long the reply may be.
named = client.chat.completions.create(model=model, messages=ask, max_tokens=300, temperature=0, tools=[weather],
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
assert len(named.choices[0].message.tool_calls) == 1, named
# SmolLM2's template never reads tool_calls: an earlier call is written into its turn, not dropped.
earlier = {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
           "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]}
answer = {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
with_call = client.chat.completions.create(model=model, messages=ask + [earlier, answer], max_tokens=1)
without = client.chat.completions.create(model=model, messages=ask + [{"role": "assistant", "content": ""}, answer], max_tokens=1)
assert with_call.usage.prompt_tokens > without.usage.prompt_tokens + 8, (with_call.usage, without.usage)

# Concurrent requests are batched and all complete.
def one(i):
    r = client.completions.create(model=model, prompt=f"Number {i} is", max_tokens=8, temperature=0)
    return r.usage.completion_tokens
with concurrent.futures.ThreadPoolExecutor(8) as ex:
    counts = list(ex.map(one, range(8)))
assert all(0 < c <= 8 for c in counts), counts

# Bad input: clear 4xx errors with messages.
for kwargs, needle in [
    (dict(max_tokens=10**6), "maximum context length"),
    (dict(temperature=-1), "temperature"),
    (dict(extra_body={"kv_policy": "nonsense"}), "eviction policy"),
    (dict(extra_body={"kv_policy": "paged-eviction", "kv_budget": 8}), "budget"),
    (dict(extra_body={"kv_policy": "knorm", "kv_budget": 128, "kv_granularity": "token"}), "granularity"),
    # Never a 200 that ignores a field: what is not built yet is refused by name.
    (dict(top_logprobs=5), "top_logprobs"),  # without logprobs: true
    (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(logit_bias={"notanid": 1}), "logit_bias"),
    (dict(logit_bias={"10": 101}), "logit_bias"),
    (dict(extra_body={"min_tokens": 9}), "min_tokens"),  # more than max_tokens
    (dict(extra_body={"repetition_penalty": 0}), "repetition_penalty"),
    (dict(extra_body={"frobnicate": 1}), "frobnicate"),
    # SmolLM2's template has no thinking switch: the kwarg would be ignored, so it is refused.
    (dict(extra_body={"chat_template_kwargs": {"enable_thinking": False}}), "enable_thinking"),
    (dict(extra_body={"chat_template_kwargs": {"messages": []}}), "messages"),
    # Two limits that disagree, and stream options without a stream, are refused (vLLM too).
    (dict(max_completion_tokens=5), "max_completion_tokens"),
    (dict(parallel_tool_calls=False), "parallel_tool_calls"),  # without tools, as OpenAI
    (dict(extra_body={"kv_granularity": "head"}), "kv_granularity"),  # nothing evicts
    (dict(stream_options={"include_usage": True}), "stream_options"),
    (dict(stream=True, stream_options={"include_usage": True, "per_chunk": True}), "per_chunk"),
    (dict(stream=True, extra_body={"prompt_logprobs": 1}), "prompt_logprobs"),
    (dict(extra_body={"prompt_logprobs": 21}), "prompt_logprobs"),
    (dict(extra_body={"continue_final_message": True, "add_generation_prompt": False}), "assistant"),
]:
    try:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], **{"max_tokens": 4, **kwargs})
        raise AssertionError(f"expected an error for {kwargs}")
    except openai.BadRequestError as e:
        assert needle in str(e), (needle, str(e))

# Errors name the field at fault.
for call, param in [
    (lambda: client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2, top_p=0), "top_p"),
    (lambda: client.completions.create(model=model, prompt="hi " * 20000, max_tokens=2), "prompt"),
    (lambda: client.completions.create(model=model, prompt="hi", max_tokens=2, extra_body={"kv_policy": "knorm", "kv_budget": 8}), "kv_budget"),
]:
    try:
        call()
        raise AssertionError(f"expected a 400 naming {param}")
    except openai.BadRequestError as e:
        assert e.body.get("param") == param, (param, e.body)
# Fields at their defaults (as some clients always send them) are accepted.
ok = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2, presence_penalty=0, frequency_penalty=0, logprobs=False, user="tester")
assert ok.choices, ok
try:
    client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    raise AssertionError("expected 404")
except openai.NotFoundError:
    pass

# Unknown paths -> a JSON 404.
try:
    urllib.request.urlopen(base + "/v1/no-such-path")
    raise AssertionError("expected 404")
except urllib.error.HTTPError as e:
    assert e.code == 404 and "no route" in json.loads(e.read())["error"]["message"], e.code

# Malformed JSON body -> 400 with an OpenAI error object.
req = urllib.request.Request(base + "/v1/completions", data=b'{"prompt": ', headers={"content-type": "application/json"})
try:
    urllib.request.urlopen(req)
    raise AssertionError("expected 400")
except urllib.error.HTTPError as e:
    assert e.code == 400, e.code
    assert "message" in json.loads(e.read())["error"]

# vLLM's request fields, each changing the answer as it does in vLLM.
question = [{"role": "user", "content": "What is the capital of France?"}]
def chat_usage(**extra):
    return client.chat.completions.create(model=model, messages=question, max_tokens=2, temperature=0, extra_body=extra).usage
with_header, without_header = chat_usage(), chat_usage(add_generation_prompt=False)
assert without_header.prompt_tokens < with_header.prompt_tokens, (with_header, without_header)
# continue_final_message: the assistant's open text is continued, not answered in a new turn.
started = question + [{"role": "assistant", "content": "The capital of France is"}]
cont = client.chat.completions.create(model=model, messages=started, max_tokens=6, temperature=0,
                                      extra_body={"continue_final_message": True, "add_generation_prompt": False})
new_turn = client.chat.completions.create(model=model, messages=started, max_tokens=6, temperature=0)
assert cont.usage.prompt_tokens < new_turn.usage.prompt_tokens, (cont.usage, new_turn.usage)
assert "Paris" in cont.choices[0].message.content, cont.choices[0].message.content
# skip_special_tokens: a control token forced by logit_bias is left out of the text by default.
im_start = "1"  # SmolLM2's <|im_start|>, a control token
forced = dict(model=model, prompt="Hello", max_tokens=2, temperature=0, logit_bias={im_start: 100})
hidden = client.completions.create(**forced)
shown = client.completions.create(**forced, extra_body={"skip_special_tokens": False})
assert hidden.usage.completion_tokens == 2 and "<|im_start|>" not in hidden.choices[0].text, hidden
assert shown.choices[0].text == "<|im_start|><|im_start|>", shown.choices[0].text
# prompt_logprobs: prompt token t's logprob given the tokens before it equals the logprob
# the same token had when it was generated after the same prefix.
prompt_ids = client.completions.create(model=model, prompt="The capital of France is", max_tokens=1, temperature=0,
                                       extra_body={"prompt_logprobs": 2})
plp = prompt_ids.choices[0].model_extra["prompt_logprobs"]
assert len(plp) == prompt_ids.usage.prompt_tokens and plp[0] is None, plp
assert all(len(e) >= 2 and all(v["rank"] >= 1 for v in e.values()) for e in plp[1:]), plp
ranks_one = [v for e in plp[1:] for v in e.values() if v["rank"] == 1]
assert len(ranks_one) >= len(plp) - 1, plp
# Asked twice, the second with the prompt cached: the same full list (nothing skipped).
again = client.completions.create(model=model, prompt="The capital of France is", max_tokens=1, temperature=0,
                                  extra_body={"prompt_logprobs": 2}).choices[0].model_extra["prompt_logprobs"]
assert len(again) == len(plp), (len(again), len(plp))
for a, b in zip(plp[1:], again[1:]):
    for k in a:
        assert abs(a[k]["logprob"] - b[k]["logprob"]) < 1e-3, (a, b)
# Teacher-forced agreement: generated tokens fed back as prompt text score as they were
# sampled (the same logits, computed by prefill instead of decode).
# Two tokens (" Paris", "."): later newlines would merge into one token when re-encoded.
gen = client.completions.create(model=model, prompt="The capital of France is", max_tokens=2, temperature=0, logprobs=0)
gen_tokens, gen_lps = gen.choices[0].logprobs.tokens, gen.choices[0].logprobs.token_logprobs
fed = client.completions.create(model=model, prompt="The capital of France is" + "".join(gen_tokens), max_tokens=1,
                                temperature=0, extra_body={"prompt_logprobs": 0}).choices[0].model_extra["prompt_logprobs"]
for entry, token, lp in zip(fed[-len(gen_tokens):], gen_tokens, gen_lps):
    own = next(iter(entry.values()))  # the prompt's own token comes first
    assert own["decoded_token"] == token and abs(own["logprob"] - lp) < 1e-3, (own, token, lp)
chat_lp = client.chat.completions.create(model=model, messages=question, max_tokens=1, temperature=0,
                                         extra_body={"prompt_logprobs": 0})
assert len(chat_lp.model_extra["prompt_logprobs"]) == chat_lp.usage.prompt_tokens, chat_lp.model_extra
# continuous_usage_stats: every chunk carries its choice's usage so far.
usages = []
for ch in client.chat.completions.create(model=model, messages=question, max_tokens=6, temperature=0, stream=True,
                                         stream_options={"include_usage": True, "continuous_usage_stats": True}):
    assert ch.usage is not None, ch
    usages.append(ch.usage.completion_tokens)
assert usages == sorted(usages) and usages[-1] == usages[-2] and usages[-1] >= 1, usages

# Found by review (2026-12-07, twenty-fourth session).
def prompt_ids(content):
    """The prompt's token ids as the server rendered a one-message chat (`prompt_logprobs` 0)."""
    r = client.chat.completions.create(model=model, max_tokens=1, temperature=0, messages=[{"role": "user", "content": content}],
                                       extra_body={"prompt_logprobs": 0})
    return [list(d.keys()) if d else None for d in r.model_extra["prompt_logprobs"]]
# Text parts are joined with newlines, as vLLM joins them for a template that takes a string.
parts = prompt_ids([{"type": "text", "text": "Say"}, {"type": "text", "text": "hi"}])
assert parts == prompt_ids("Say\nhi") and parts != prompt_ids("Sayhi"), parts
# Message fields are named by their path; tool_call_id belongs to tool messages only.
for message, param in [({"role": "user", "content": "hi", "tool_call_id": "c1"}, "messages[0].tool_call_id"),
                       ({"role": "user", "content": "hi", "name": "bob"}, "messages[0].name"),
                       ({"role": "wizard", "content": "hi"}, "messages[0].role"),
                       ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, "messages[0].content")]:
    status, err = post("/v1/chat/completions", {**chat_base, "messages": [message]})
    assert status == 400 and err.get("param") == param, (message, status, err)
# vllm:prompt_tokens_total counts the whole prompt, a prefix-cache hit included, as vLLM does.
def counter(name):
    for line in urllib.request.urlopen(base + "/metrics").read().decode().splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0
repeated = "The same prompt twice, so that the second is a prefix-cache hit: one two three four five six seven eight nine ten."
for _ in range(2):
    before = counter("vllm:prompt_tokens_total")
    r = client.completions.create(model=model, prompt=repeated, max_tokens=1)
    want = before + r.usage.prompt_tokens
    for _ in range(100):  # the engine thread exports its counters after the step
        if counter("vllm:prompt_tokens_total") >= want:
            break
        time.sleep(0.02)
    assert counter("vllm:prompt_tokens_total") == want, (before, r.usage, counter("vllm:prompt_tokens_total"))
assert r.usage.prompt_tokens_details and r.usage.prompt_tokens_details.cached_tokens > 0, r.usage

# Metrics with vLLM's names and a model_name label.
metrics = urllib.request.urlopen(base + "/metrics").read().decode()
for name in ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total",
             "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:num_preemptions_total",
             "vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds", "vllm:inter_token_latency_seconds"]:
    assert name in metrics, name
hits = [l for l in metrics.splitlines() if l.startswith("vllm:prefix_cache_hits_total{")]
assert hits and float(hits[0].split()[-1]) >= 32, hits
assert f'model_name="{model}"' in metrics
pruned = [l for l in metrics.splitlines() if l.startswith("pagekeeper:kv_pruned_prompt_tokens_total{") and 'policy="paged-eviction"' in l]
assert pruned and float(pruned[0].split()[-1]) > 0, pruned
passes = [l for l in metrics.splitlines() if l.startswith("pagekeeper:kv_reconstruction_us_total{") and 'policy="kvzip"' in l]
assert passes and float(passes[0].split()[-1]) > 0, passes
assert "pagekeeper:num_requests_kvzip_passes" in metrics
print("openai client e2e: all checks passed")
