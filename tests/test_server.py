"""End to end: `nanoserve serve` on the real SmolLM2 model as a subprocess (two API-server processes),
driven by the official `openai` client (sync and async) and by raw HTTP. Tests that share a server
assert only on their own traffic (metrics as differences); a test that stops or kills its server
starts its own, so no test depends on another's traffic or on running order."""
import asyncio
import json
import os
import re
import signal
import threading
import time

import httpx
import openai
import pytest

from server_process import ServerProcess

GREEDY = dict(temperature=0, max_tokens=16)


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess("--api-server-count", "2", "--max-model-len", "256", "--body-read-timeout", "2",
                         "--allowed-origins", "http://example.com", "--served-model-name", "smol")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_completions_and_chat_with_the_openai_client(client):
    out = client.completions.create(model="smol", prompt="The capital of France is", **GREEDY)
    assert "Paris" in out.choices[0].text and out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == 5 and out.usage.completion_tokens == 16
    assert out.usage.total_tokens == 21 and out.usage.prompt_tokens_details.cached_tokens >= 0
    chat = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Say hi"}],
                                          **GREEDY)
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content
    assert chat.object == "chat.completion" and chat.usage.completion_tokens > 0
    models = client.models.list()
    assert [m.id for m in models.data] == ["smol"]


def test_streamed_text_equals_non_streamed_text(client):
    prompt = "Write one sentence about the sea."
    whole = client.completions.create(model="smol", prompt="The sea is", **GREEDY)
    chunks = list(client.completions.create(model="smol", prompt="The sea is", stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    messages = [{"role": "user", "content": prompt}]
    full = client.chat.completions.create(model="smol", messages=messages, **GREEDY).choices[0].message.content
    chunks = list(client.chat.completions.create(model="smol", messages=messages, stream=True, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full
    assert chunks[-1].choices[0].finish_reason == "length"


def test_async_client_n_seed_and_logprobs(server):
    async def main():
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        kw = dict(model="smol", messages=[{"role": "user", "content": "Name a fruit."}], n=3, seed=7,
                  temperature=1.0, max_tokens=8)
        first, second = await asyncio.gather(client.chat.completions.create(**kw),
                                             client.chat.completions.create(**kw))
        assert len(first.choices) == 3 and [c.index for c in first.choices] == [0, 1, 2]
        assert [c.message.content for c in first.choices] == [c.message.content for c in second.choices]
        lp = await client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Hi"}],
                                                  logprobs=True, top_logprobs=2, **GREEDY)
        content = lp.choices[0].logprobs.content
        assert len(content) == lp.usage.completion_tokens and all(len(t.top_logprobs) == 2 for t in content)
        assert content[0].top_logprobs[0].logprob >= content[0].top_logprobs[1].logprob
        assert content[0].bytes == list(content[0].token.encode())
        cl = await client.completions.create(model="smol", prompt="One, two,", logprobs=3, **GREEDY)
        logprobs = cl.choices[0].logprobs
        assert len(logprobs.tokens) == 16 and len(logprobs.top_logprobs[0]) >= 3
        assert "".join(logprobs.tokens) == cl.choices[0].text and logprobs.text_offset[0] == 0
        # n > 1 streamed: chunks interleave by index, each choice ends with its own finish_reason.
        stream = await client.completions.create(model="smol", prompt="Once upon a time", n=2, seed=1,
                                                 temperature=0.8, max_tokens=6, stream=True)
        finished = {}
        async for chunk in stream:
            for c in chunk.choices:
                if c.finish_reason:
                    finished[c.index] = c.finish_reason
        assert finished == {0: "length", 1: "length"}
        await client.close()

    asyncio.run(main())


def test_stop_strings_and_extra_body(client):
    base = client.completions.create(model="smol", prompt="Count: one, two, three,", max_tokens=24,
                                     temperature=0, extra_body={"ignore_eos": True}).choices[0].text
    after_comma = base.index(",") + 1
    stop = base[after_comma:after_comma + 4]  # the next item's first characters, e.g. " five"
    assert len(stop.strip()) >= 2, base
    out = client.completions.create(model="smol", prompt="Count: one, two, three,", max_tokens=24, temperature=0,
                                    stop=[stop], extra_body={"ignore_eos": True})
    choice = out.choices[0]
    assert choice.text == base[:base.index(stop)] and choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == stop
    kept = client.completions.create(model="smol", prompt="Count: one, two, three,", max_tokens=24, temperature=0,
                                     stop=stop, extra_body={"include_stop_str_in_output": True,
                                                            "return_token_ids": True})
    assert kept.choices[0].text.endswith(stop) and kept.choices[0].model_extra["token_ids"]
    extras = client.completions.create(
        model="smol", prompt="Hello", max_tokens=8, temperature=0.7, seed=3,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.2, "min_tokens": 8, "ignore_eos": True,
                    "stop_token_ids": [2], "skip_special_tokens": True, "unknown_field": 1})
    assert extras.usage.completion_tokens == 8
    chat = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Say yes"}],
                                          max_completion_tokens=3, temperature=0,
                                          extra_body={"chat_template_kwargs": {}, "add_generation_prompt": True})
    assert chat.usage.completion_tokens <= 3
    scored = client.completions.create(model="smol", prompt="One two three", max_tokens=1,
                                       extra_body={"prompt_logprobs": 1, "bad_words": ["four"]})
    prompt_lp = scored.choices[0].model_extra["prompt_logprobs"]
    assert prompt_lp[0] is None and len(prompt_lp) == 3 and all(v["logprob"] <= 0 for v in prompt_lp[1].values())
    echo = client.completions.create(model="smol", prompt="Hello there", echo=True, max_tokens=2, temperature=0)
    assert echo.choices[0].text.startswith("Hello there") and len(echo.choices[0].text) > len("Hello there")
    assert echo.choices[0].logprobs is None


def test_echo_with_logprobs_scores_the_prompt(server, client):
    """How evaluation harnesses score text: echo + logprobs returns the prompt's tokens first (the first
    with a None logprob, nothing predicts it), then the generated ones, in one list; streamed alike."""
    prompt = "The capital of France is Paris"
    ids = httpx.post(f"{server.url}/tokenize", json={"model": "smol", "prompt": prompt}).json()["tokens"]
    out = client.completions.create(model="smol", prompt=prompt, echo=True, logprobs=2, max_tokens=2,
                                    temperature=0)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 2 and "".join(lp.tokens) == out.choices[0].text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:]) and all(len(t) >= 1 for t in lp.top_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert out.choices[0].model_extra.get("prompt_logprobs") is None  # only when asked for
    # The prompt part equals the engine's prompt logprobs.
    scored = client.completions.create(model="smol", prompt=prompt, max_tokens=1,
                                       extra_body={"prompt_logprobs": 2})
    expected = [None] + [entry[str(t)]["logprob"] for t, entry in
                         zip(ids[1:], scored.choices[0].model_extra["prompt_logprobs"][1:])]
    assert lp.token_logprobs[:len(ids)] == expected
    chunks = list(client.completions.create(model="smol", prompt=prompt, echo=True, logprobs=2, max_tokens=2,
                                            temperature=0, stream=True))
    streamed = [v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == lp.token_logprobs
    # max_tokens 0: the prompt alone, with its logprobs (what lm-eval-harness sends to score text).
    only = client.completions.create(model="smol", prompt=prompt, echo=True, logprobs=1, max_tokens=0)
    assert only.choices[0].text == prompt and only.usage.completion_tokens == 0
    assert only.choices[0].logprobs.token_logprobs == expected and only.choices[0].finish_reason == "length"
    chunks = list(client.completions.create(model="smol", prompt=prompt, echo=True, logprobs=1, max_tokens=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == prompt
    error_of(httpx.post(f"{server.url}/v1/completions", json={"model": "smol", "prompt": "x", "max_tokens": 0}),
             400)  # without echo, max_tokens must be at least 1


def test_chat_history_with_reasoning_content(client):
    history = [{"role": "user", "content": "Hi"},
               {"role": "assistant", "content": "Hello!", "reasoning_content": "greet back"},
               {"role": "user", "content": "Bye"}]
    assert client.chat.completions.create(model="smol", messages=history, max_tokens=2).choices


def test_raw_sse_framing(server):
    body = {"model": "smol", "messages": [{"role": "user", "content": "Hi"}], "stream": True, "max_tokens": 4,
            "temperature": 0, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = "".join(r.iter_text())
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e[len("data: "):]) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert payloads[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] == 4
    assert all("usage" in p for p in payloads)
    assert payloads[-2]["choices"][0]["finish_reason"] == "length"
    # Completions: no role chunk, same ending.
    body = {"model": "smol", "prompt": "Hi", "stream": True, "max_tokens": 3, "temperature": 0}
    raw = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).text
    assert raw.endswith("data: [DONE]\n\n") and '"role"' not in raw


def error_of(response, status):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "temperature": 5}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": 129, "temperature": 1}, "n"),
    ({"prompt": "x", "logprobs": 50}, "logprobs"),
    ({"prompt": "x", "max_tokens": "lots"}, "max_tokens"),
    ({"prompt": "x", "logit_bias": {"999999": 5}}, None),
    ({"temperature": 0.5}, "prompt"),
    ({"prompt": "x", "stream": True, "top_k": -5}, "top_k"),
    # integers beyond 64 bits and negative token ids: named, never a 500
    ({"prompt": "x", "seed": 2**64}, "seed"),
    ({"prompt": "x", "max_tokens": 10**23}, "max_tokens"),
    ({"prompt": "x", "top_k": 2**64}, "top_k"),
    ({"prompt": "x", "logprobs": 2**64}, "logprobs"),
    ({"prompt": "x", "logit_bias": {str(2**64): 1}}, "logit_bias"),
    ({"prompt": [2**64]}, "prompt"),
    ({"prompt": [-1, 5, 6]}, "prompt"),
    ({"prompt": [[1, 2], [3, -4]]}, "prompt"),
    ({"prompt": [4294967296.0]}, "prompt"),  # found by the property test: the tokenizer's decode overflowed
])
def test_invalid_parameters_are_400(server, body, param):
    error = error_of(httpx.post(f"{server.url}/v1/completions", json=body, timeout=30), 400)
    if param:
        assert param in error["message"] and error["param"] == param


USER = {"role": "user", "content": "hi"}


@pytest.mark.parametrize("body,param", [
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
     "messages.0.content"),
    ({"messages": [USER, {"role": "tool", "content": "42"}]}, "messages.1"),
    ({"messages": [USER], "response_format": {"type": "xml"}}, "response_format"),
    ({"messages": [USER], "response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                                     "schema": {"type": "nope"}}}},
     "response_format"),
    ({"messages": [USER], "guided_regex": "(("}, "guided_regex"),
    ({"messages": [USER], "structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs"),
    ({"messages": [USER], "structured_outputs": {"choice": ["a"], "regex": "b"}}, "structured_outputs"),
    ({"messages": [USER], "structured_outputs": {"shape": "round"}}, "structured_outputs"),
    ({"messages": [USER], "guided_choice": ["yes"], "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": [USER], "stop": [f"s{i}" for i in range(1000)]}, "stop"),
    # SmolLM2's own template never shows tools to the model (--chat-template chatml-tools does)
    ({"messages": [USER], "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
])
def test_chat_requests_openai_refuses_are_400(server, body, param):
    """What OpenAI answers with 400 is not accepted (and, for images, silently ignored); a structured-outputs
    request the grammar engine cannot compile is a 400 naming its field."""
    error = error_of(httpx.post(f"{server.url}/v1/chat/completions", json={**body, "max_tokens": 2}, timeout=30), 400)
    assert error["param"] == param


def test_nan_logit_bias_is_400_and_plain_forms_still_work(server):
    for value in (b"NaN", b"1e999"):  # not JSON numbers (Python's json took them): a malformed body
        r = httpx.post(f"{server.url}/v1/completions", timeout=30,
                       content=b'{"prompt": "x", "max_tokens": 2, "logit_bias": {"5": %s}}' % value,
                       headers={"content-type": "application/json"})
        assert "malformed JSON body" in error_of(r, 400)["message"]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                {"role": "assistant", "content": "Hello"}, {"role": "tool", "content": "1", "tool_call_id": "c1"}]
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                   json={"messages": messages, "max_tokens": 2, "response_format": {"type": "text"}})
    assert r.status_code == 200, r.text


def test_huge_prompt_is_refused_before_tokenizing_while_health_answers(server):
    """A 20 MB prompt cannot fit any context: refused by its length, not after tokenizing it on the event
    loop (which held /health for 11 s); the chat path the same way."""
    body = json.dumps({"prompt": "hello world " * 1_700_000, "max_tokens": 2}).encode()
    result = {}

    def send():
        result["r"] = httpx.post(f"{server.url}/v1/completions", content=body, timeout=120,
                                 headers={"content-type": "application/json"})

    sender = threading.Thread(target=send)
    sender.start()
    while sender.is_alive():
        assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
        time.sleep(0.01)
    sender.join()
    error = error_of(result["r"], 400)
    assert error["param"] == "prompt" and "20400000 characters" in error["message"]
    error = error_of(httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "hi " * 1_000_000}]}), 400)
    assert error["param"] == "messages"


def raw_http(server, request: bytes) -> tuple[int, dict]:
    """Sends bytes as they are (what no well-behaved client would) and returns the status and JSON body."""
    import socket

    host, port = server.url.split("//")[1].split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, json.loads(data[data.index(b"{"):])


def test_request_limits(server):
    """Documented limits, each answered in OpenAI's shape before any handler runs: body size (413),
    header count and size and X-Request-Id length (431), a body that arrives too slowly (408)."""
    post = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    status, body = raw_http(server, post + b"Content-Length: 200000000\r\n\r\n")
    assert status == 413 and "33554432" in body["error"]["message"]
    many = b"".join(b"X-H%d: v\r\n" % i for i in range(200))
    status, body = raw_http(server, b"GET /health HTTP/1.1\r\nHost: x\r\n" + many + b"\r\n")
    assert status == 431 and "at most 100" in body["error"]["message"]
    status, body = raw_http(server, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 40000 + b"\r\n\r\n")
    assert status == 431 and "32768" in body["error"]["message"]
    status, body = raw_http(server, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Request-Id: " + b"r" * 1000 + b"\r\n\r\n")
    assert status == 431 and "X-Request-Id" in body["error"]["message"]
    nested = json.dumps({"prompt": [[1]] * 300_000}).encode()  # 2.1 MiB, 300k lists: parsing alone would block
    status, body = raw_http(server, post + b"Content-Length: %d\r\n\r\n" % len(nested) + nested)
    assert status == 413 and "JSON nodes" in body["error"]["message"]
    for many, message in ((json.dumps({"prompt": [1] * (2**20 + 1)}), "token ids"),
                          (json.dumps({"prompt": ["a"] * 4097}), "4096 prompts"),
                          (json.dumps({"messages": [USER] * 4097}), "4096 items")):
        path = "/v1/chat/completions" if "messages" in many else "/v1/completions"
        error = error_of(httpx.post(f"{server.url}{path}", content=many, timeout=30,
                                    headers={"content-type": "application/json"}), 400)
        assert message in error["message"], error
    status, body = raw_http(server, post + b'Content-Length: 40\r\n\r\n{"prompt": ')  # and then nothing
    assert status == 408 and body["error"]["type"] == "RequestTimeout"
    assert httpx.get(f"{server.url}/health", headers={"X-Request-Id": "r" * 128}).headers["x-request-id"] == "r" * 128


def test_request_chat_templates_are_refused_by_default(server):
    body = {"messages": [USER], "max_tokens": 2,
            "chat_template_kwargs": {"chat_template": "{% for i in range(50000) %}x{% endfor %}"}}
    error = error_of(httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30), 400)
    assert "--trust-request-chat-template" in error["message"] and error["param"] == "chat_template_kwargs"


def test_errors_the_framework_answers_are_in_openais_shape(server):
    """No such route, a wrong method, a body that is not UTF-8 JSON or nests or numbers too deep: 404 /
    405 / 400 with {"error": {...}}, like every other error; the out-of-range token id is named."""
    url = server.url
    error = error_of(httpx.get(f"{url}/v1/completions", timeout=30), 405)
    assert "GET" in error["message"]
    assert httpx.get(f"{url}/v1/completions", timeout=30).headers["allow"] == "POST"
    assert "/nope" in error_of(httpx.get(f"{url}/nope", timeout=30), 404)["message"]
    for body in (b'{"prompt": "\xff\xfe"}',
                 b'{"prompt": ' + b"[" * 10000 + b"]" * 10000 + b"}",
                 b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}"):
        error = error_of(httpx.post(f"{url}/v1/completions", content=body, timeout=30,
                                    headers={"content-type": "application/json"}), 400)
        assert "body" in error["message"]
    error = error_of(httpx.post(f"{url}/v1/completions", json={"prompt": "x", "logit_bias": {"999999": 1}},
                                timeout=30), 400)
    assert "999999" in error["message"] and error["param"] == "logit_bias"
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200


def test_models_retrieve(client):
    assert client.models.retrieve("smol").id == "smol"
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-4")
    assert "gpt-4" in str(info.value) and "does not exist" in str(info.value)


def test_error_cases(server):
    url = server.url
    error = error_of(httpx.post(f"{url}/v1/completions", content=b"{not json", timeout=30,
                                headers={"content-type": "application/json"}), 400)
    assert "JSON" in error["message"]
    long_prompt = list(range(1000, 1300))
    error = error_of(httpx.post(f"{url}/v1/completions", json={"prompt": long_prompt}, timeout=30), 400)
    assert "256" in error["message"] and "300" in error["message"]
    # Streaming requests are validated before the stream starts: a plain HTTP error.
    r = httpx.post(f"{url}/v1/chat/completions", timeout=30, json={
        "messages": [{"role": "user", "content": "x" * 2000}], "stream": True})
    error_of(r, 400)
    error = error_of(httpx.post(f"{url}/v1/completions", json={"prompt": "x", "model": "gpt-9"}, timeout=30), 404)
    assert "gpt-9" in error["message"]
    # max_tokens beyond the context is clamped, not rejected.
    r = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "prompt": list(range(1000, 1250)), "max_tokens": 10_000, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6
    assert r.json()["choices"][0]["finish_reason"] == "length"


def test_tokenize_detokenize_version_health_cors_request_id(server):
    url = server.url
    tok = httpx.post(f"{url}/tokenize", json={"prompt": "Hello world", "add_special_tokens": False}).json()
    assert tok["count"] == len(tok["tokens"]) == 2 and tok["max_model_len"] == 256
    assert httpx.post(f"{url}/detokenize", json={"tokens": tok["tokens"]}).json() == {"prompt": "Hello world"}
    chat_tok = httpx.post(f"{url}/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat_tok["count"] > 5
    error_of(httpx.post(f"{url}/detokenize", json={"tokens": [10**7]}), 400)
    version = httpx.get(f"{url}/version").json()
    assert version["version"] and version["compute"]["backend"] in ("c", "torch")
    assert version["compute"]["activations"] == "int8" and version["compute"]["kv_cache_dtype"] == "float16"
    assert "Q4_1 x" in version["compute"]["weights"]
    assert "backend " + version["compute"]["backend"] in server.output()  # the one start-up line
    assert httpx.get(f"{url}/health").status_code == 200
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 1},
                   headers={"X-Request-Id": "my-id-42", "Origin": "http://example.com"})
    assert r.headers["x-request-id"] == "my-id-42"
    assert r.headers["access-control-allow-origin"] == "http://example.com"
    pre = httpx.options(f"{url}/v1/completions", headers={"Origin": "http://example.com",
                                                          "Access-Control-Request-Method": "POST"})
    assert pre.status_code == 200


def test_seeded_request_is_the_same_alone_and_under_load(server):
    seeded = {"model": "smol", "prompt": "My favourite colour is", "temperature": 1.0, "seed": 1234,
              "max_tokens": 24}

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as http:
            alone = (await http.post("/v1/completions", json=seeded)).json()["choices"][0]["text"]
            others = [http.post("/v1/completions", json={"prompt": f"Story number {i}:", "temperature": 0.9,
                                                          "max_tokens": 32, "ignore_eos": True})
                      for i in range(16)]
            results = await asyncio.gather(http.post("/v1/completions", json=seeded), *others)
            assert all(r.status_code == 200 for r in results)
            return alone, results[0].json()["choices"][0]["text"]

    alone, loaded = asyncio.run(main())
    assert alone == loaded


def test_64_concurrent_mixed_requests_all_finish(server):
    async def one(http, i):
        kind = i % 4
        if kind in (0, 1):
            body = {"prompt": f"Request {i}: tell me about the number {i}.", "max_tokens": 12 + i % 7,
                    "temperature": 0 if kind == 0 else 0.8, "seed": i, "stop": ["\n\n", "zz"]}
            path = "/v1/completions"
        else:
            body = {"messages": [{"role": "user", "content": f"Question {i}: what is {i} + 1?"}],
                    "max_tokens": 10 + i % 5, "temperature": 0 if kind == 2 else 1.0, "stop": ["."]}
            path = "/v1/chat/completions"
        if i % 2:
            body["stream"] = True
            finish = None
            async with http.stream("POST", path, json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        for c in json.loads(line[6:])["choices"]:
                            finish = c.get("finish_reason") or finish
            return finish
        r = await http.post(path, json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["finish_reason"]

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=600,
                                     limits=httpx.Limits(max_connections=100)) as http:
            return await asyncio.gather(*(one(http, i) for i in range(64)))

    finishes = asyncio.run(main())
    assert len(finishes) == 64 and all(f in ("stop", "length") for f in finishes), finishes
    assert server.wait_metric("nanoserve:num_requests_running", 0) == 0


def test_client_disconnect_frees_kv_blocks(server):
    body = {"prompt": "Write a very long story.", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
        assert server.wait_until("nanoserve:num_requests_running", lambda v: v >= 1) >= 1
        assert server.wait_until("nanoserve:kv_cache_usage_perc", lambda v: v > 0) > 0
    assert server.wait_metric("nanoserve:num_requests_running", 0) == 0
    assert server.wait_metric("nanoserve:kv_cache_usage_perc", 0) == 0
    assert server.metric('nanoserve:request_success_total{finished_reason="abort"}') >= 1


def test_non_streaming_client_that_times_out_is_aborted(server):
    """A client that gives up on a non-streaming request frees it too (the handler must see the
    disconnect through the middleware)."""
    abort = 'nanoserve:request_success_total{finished_reason="abort"}'
    before = server.metric(abort, 0.0)
    for _ in range(3):
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{server.url}/v1/completions", timeout=0.5,
                       json={"prompt": "Write a very long story.", "max_tokens": 240, "ignore_eos": True})
    assert server.wait_metric(abort, before + 3) - before >= 3
    assert server.wait_metric("nanoserve:num_requests_running", 0) == 0


def test_metrics(server):
    before = {name: server.metric(name) for name in ("nanoserve:generation_tokens_total", "nanoserve:prefix_cache_hits")}
    for _ in range(2):  # the second run of a 40-token prompt hits the prefix cache
        httpx.post(f"{server.url}/v1/completions", timeout=120,
                   json={"prompt": "The metrics test prompt. " * 8, "max_tokens": 8, "ignore_eos": True})
    text = httpx.get(f"{server.url}/metrics").text
    for name in ["nanoserve:request_success_total", "nanoserve:prompt_tokens_total",
                 "nanoserve:generation_tokens_total", "nanoserve:time_to_first_token_seconds_bucket",
                 "nanoserve:inter_token_latency_seconds_bucket", "nanoserve:e2e_request_latency_seconds_bucket",
                 "nanoserve:num_requests_running", "nanoserve:num_requests_waiting",
                 "nanoserve:kv_cache_usage_perc", "nanoserve:prefix_cache_hit_rate"]:
        assert name in text, name
    assert server.metric("nanoserve:generation_tokens_total") - before["nanoserve:generation_tokens_total"] >= 16
    hits = before["nanoserve:prefix_cache_hits"]
    assert server.wait_until("nanoserve:prefix_cache_hits", lambda v: v > hits) > hits


def test_bench_serve_load_generator(server):
    """`nanoserve bench serve`'s client against this server: every request streams its full output."""
    from nanoserve.bench.serve import run

    report = asyncio.run(run(server.url, None, concurrency=3, num_prompts=4, input_len=20, output_len=8,
                             ban={0: -100, 2: -100}))
    assert report["requests"] == 4 and report["failed"] == 0, report["errors"]
    assert report["output_tok_per_s"] * report["wall_s"] == pytest.approx(4 * 8)
    assert 0 < report["ttft_p50"] <= report["ttft_p99"] and report["itl_p50"] > 0
    assert 0 <= report["engine_idle_share"] <= 1


@pytest.fixture
def own_server():
    """A server for one test that stops it."""
    proc = ServerProcess("--max-model-len", "256")
    yield proc
    proc.stop()


def test_sigterm_drains_in_flight_requests(own_server):
    server = own_server
    result = {}

    def request():
        result["r"] = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
            "prompt": "Tell a story.", "max_tokens": 48, "ignore_eos": True})

    t = threading.Thread(target=request)
    t.start()
    deadline = time.monotonic() + 30
    while server.metric("nanoserve:num_requests_running") < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.stop() == 0
    t.join()
    assert result["r"].status_code == 200, result["r"].text
    assert result["r"].json()["usage"]["completion_tokens"] == 48


def test_drain_timeout_ends_requests_with_an_error_not_a_cut():
    """SIGTERM with requests longer than --drain-timeout: the stream ends with an SSE error event and
    [DONE], the non-streaming request with a 503 in OpenAI's shape, and the server still exits 0."""
    server = ServerProcess("--max-model-len", "2048", "--drain-timeout", "2")
    try:
        body = {"prompt": "Tell a long story.", "max_tokens": 1900, "ignore_eos": True}
        result = {}

        def plain():
            result["plain"] = httpx.post(f"{server.url}/v1/completions", timeout=120, json=body)

        def streamed():
            with httpx.stream("POST", f"{server.url}/v1/completions", timeout=120, json={**body, "stream": True}) as r:
                result["lines"] = [line for line in r.iter_lines() if line]

        threads = [threading.Thread(target=plain), threading.Thread(target=streamed)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while server.metric("nanoserve:num_requests_running") < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.stop() == 0
    finally:
        server.stop()
    for t in threads:
        t.join()
    assert error_of(result["plain"], 503)["message"].startswith("the server is shutting down")
    assert result["lines"][-1] == "data: [DONE]"
    assert json.loads(result["lines"][-2][6:])["error"]["code"] == 503


GUARDED = ("--api-key", "k1", "--api-key", "k2", "--max-num-seqs", "1", "--max-waiting-requests", "1",
           "--reasoning-parser", "deepseek_r1", "--kv-cache-dtype", "float16",
           "--trust-request-chat-template", "--chat-template-timeout", "1")


@pytest.fixture(scope="module")
def guarded_server():
    proc = ServerProcess(*GUARDED, "--speculative-ngram", "4")  # one stream at a time: where drafts pay
    yield proc
    proc.stop()


def test_api_keys(guarded_server):
    url = guarded_server.url
    error_of(httpx.get(f"{url}/v1/models"), 401)
    error_of(httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer nope"}), 401)
    assert httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer k2"}).status_code == 200
    assert httpx.get(f"{url}/health").status_code == 200 and httpx.get(f"{url}/metrics").status_code == 200
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="k1", max_retries=0)
    assert client.completions.create(model=client.models.list().data[0].id, prompt="Hi", max_tokens=2).choices
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="bad", max_retries=0).models.list()
    # every route but /health and /metrics needs the key; the interactive docs are off without --enable-docs
    for path in ("/version", "/openapi.json"):
        error_of(httpx.get(f"{url}{path}"), 401)
        assert httpx.get(f"{url}{path}", headers={"Authorization": "Bearer k1"}).status_code == 200
    for path in ("/tokenize", "/detokenize"):
        error_of(httpx.post(f"{url}{path}", json={"prompt": "hi", "tokens": [1]}), 401)
    error_of(httpx.get(f"{url}/docs", headers={"Authorization": "Bearer k1"}), 404)


def test_reasoning_parser_fields(guarded_server):
    """deepseek_r1: the output starts inside the reasoning; SmolLM2 never closes it, so everything is
    reasoning, in both field names, streamed and not; enable_thinking=false turns the parser off."""
    client = openai.OpenAI(base_url=f"{guarded_server.url}/v1", api_key="k1", max_retries=0)
    model = client.models.list().data[0].id
    kw = dict(model=model, messages=[{"role": "user", "content": "Think about 1+1."}], max_tokens=8,
              temperature=0)
    message = client.chat.completions.create(**kw).choices[0].message
    assert message.model_extra["reasoning"] and message.model_extra["reasoning_content"] == message.model_extra["reasoning"]
    assert message.content == ""
    streamed = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or ""
                       for c in client.chat.completions.create(stream=True, **kw) if c.choices)
    assert streamed == message.model_extra["reasoning"]
    plain = client.chat.completions.create(extra_body={"chat_template_kwargs": {"enable_thinking": False}},
                                           **kw).choices[0].message
    assert plain.content == message.model_extra["reasoning"] and not plain.model_extra.get("reasoning")


def test_speculative_decoding_streams_what_it_answers(guarded_server):
    """--speculative-ngram 4 on a text SmolLM2 copies: drafts are accepted (/metrics), several tokens a step
    stream without a stop string's piece leaking, and the stream equals the whole answer, logprobs and
    usage included, greedy and seeded."""
    client = openai.OpenAI(base_url=f"{guarded_server.url}/v1", api_key="k1", max_retries=0)
    fruit = "apples, pears, plums, cherries, grapes, lemons, melons, figs, dates, limes"
    accepted = guarded_server.metric("nanoserve:spec_decode_num_accepted_tokens", 0.0)
    for extra in ({"temperature": 0}, {"temperature": 0.8, "seed": 5}, {"temperature": 0, "stop": ["melons"]}):
        kw = dict(model=client.models.list().data[0].id, prompt=f"List: {fruit}.\nThe same list again: {fruit}.\nAnd once more: ",
                  max_tokens=48, logprobs=2, **extra)
        whole = client.completions.create(**kw)
        chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
        choice = whole.choices[0]
        assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
        assert [t for c in chunks if c.choices for t in c.choices[0].logprobs.tokens] == choice.logprobs.tokens
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
            [choice.finish_reason]
        assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == len(choice.logprobs.tokens)
        if "stop" in extra:
            assert choice.finish_reason == "stop" and "melons" not in choice.text and "melo" not in choice.text[-6:]
        else:
            assert choice.finish_reason == "length" and whole.usage.completion_tokens == 48
    deadline = time.monotonic() + 10  # engine gauges arrive with its next stats
    while (now := guarded_server.metric("nanoserve:spec_decode_num_accepted_tokens")) - accepted < 20 \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    assert now - accepted >= 20 and guarded_server.metric("nanoserve:spec_decode_num_draft_tokens") >= now


def cpu_seconds(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            total += sum(int(x) for x in f.read().rsplit(")", 1)[1].split()[11:13])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


def test_trusted_request_templates_run_and_are_stopped_at_their_deadline(guarded_server):
    """With --trust-request-chat-template a request's template renders the prompt; one that runs past
    --chat-template-timeout gets a 400 and is stopped (no core left burning), and serving goes on."""
    url, auth = guarded_server.url, {"Authorization": "Bearer k1"}
    body = {"messages": [USER], "max_tokens": 1, "return_token_ids": True,
            "chat_template_kwargs": {"chat_template": "{% for m in messages %}Q: {{ m.content }}\n{% endfor %}A:"}}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, headers=auth, timeout=30)
    assert r.status_code == 200, r.text
    prompt = httpx.post(f"{url}/detokenize", json={"tokens": r.json()["prompt_token_ids"]}, headers=auth).json()
    assert prompt["prompt"] == f"Q: {USER['content']}\nA:"
    endless = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    body["chat_template_kwargs"]["chat_template"] = endless
    error = error_of(httpx.post(f"{url}/v1/chat/completions", json=body, headers=auth, timeout=30), 400)
    assert "--chat-template-timeout" in error["message"]
    pids = guarded_server.children()
    before = cpu_seconds(pids)
    time.sleep(1.0)
    assert cpu_seconds(pids) - before < 0.5  # the rendering thread was stopped
    body["chat_template_kwargs"] = {}
    assert httpx.post(f"{url}/v1/chat/completions", json=body, headers=auth, timeout=30).status_code == 200


@pytest.fixture
def own_guarded_server():
    """A guarded server for one test that kills its engine."""
    proc = ServerProcess(*GUARDED)
    yield proc
    proc.stop()


def test_full_queue_is_503_and_a_dead_engine_ends_requests(own_guarded_server):
    guarded_server = own_guarded_server
    url, auth = guarded_server.url, {"Authorization": "Bearer k1"}
    long = {"prompt": "Go on forever.", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60, headers=auth) as http, \
            http.stream("POST", f"{url}/v1/completions", json=long) as running:
        lines = running.iter_lines()
        next(lines)
        waiting_result = {}

        def wait_in_queue():  # max-num-seqs 1: this one waits behind the running one
            with httpx.stream("POST", f"{url}/v1/completions", json=long, headers=auth, timeout=60) as r:
                waiting_result["body"] = "".join(r.iter_text())

        thread = threading.Thread(target=wait_in_queue)
        thread.start()
        deadline = time.monotonic() + 10
        while guarded_server.metric("nanoserve:num_requests_waiting") < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        error = error_of(httpx.post(f"{url}/v1/completions", json={"prompt": "x"}, headers=auth), 503)
        assert "overloaded" in error["message"]
        # Kill the engine core: in-flight streams end with an error event, the server exits non-zero.
        core_pid = int(re.search(r"engine-core\[(\d+)\]", guarded_server.output()).group(1))
        os.kill(core_pid, signal.SIGKILL)
        rest = "\n".join(lines)
        assert '"error"' in rest and rest.rstrip().endswith("data: [DONE]")
        thread.join(30)
        assert '"error"' in waiting_result["body"]
    assert guarded_server.proc.wait(30) != 0


def test_generated_requests_never_get_a_5xx(server):
    """Property: 500 generated request bodies (known fields with values of every JSON type, huge and
    negative numbers, NaN, nesting, unknown fields) to both generation endpoints: never a 5xx, every error in
    OpenAI's shape, and the server keeps serving."""
    from hypothesis import HealthCheck, given, settings, strategies as st

    scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.integers(-3, 300),
                        st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20))
    values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) |
                          st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=8)
    fields = ["prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "seed", "stop",
              "logit_bias", "logprobs", "top_logprobs", "echo", "stream", "stop_token_ids", "min_tokens",
              "presence_penalty", "frequency_penalty", "repetition_penalty", "response_format", "allowed_token_ids",
              "bad_words", "prompt_logprobs", "ignore_eos", "stream_options", "chat_template_kwargs", "x_unknown"]
    base = st.fixed_dictionaries({"max_tokens": st.integers(1, 3)}, optional={
        "prompt": st.one_of(st.text(max_size=30), st.lists(st.integers(-5, 60000), max_size=6), values),
        "messages": st.one_of(st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "x"]),
                                                             "content": st.one_of(st.text(max_size=20), values)}),
                                       max_size=3), values)})
    bodies = st.tuples(base, st.dictionaries(st.sampled_from(fields), values, max_size=4))
    statuses = {}

    @settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(bodies, st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
    def one(parts, path):
        body = {**parts[0], **parts[1]}
        if isinstance(body.get("max_tokens"), int) and 0 < body["max_tokens"] > 3:
            body["max_tokens"] = 3  # valid requests stay short
        r = httpx.post(f"{server.url}{path}", timeout=120, content=json.dumps(body).encode(),
                       headers={"content-type": "application/json"})
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        assert r.status_code < 500, (body, r.text)
        if r.status_code >= 400:
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}

    for _ in range(2):  # 2 x 250 examples
        one()
    assert sum(statuses.values()) >= 500 and statuses.get(200, 0) > 0 and any(s >= 400 for s in statuses)
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
