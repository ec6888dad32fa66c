"""Tool calling on the real server (SmolLM2, `--tool-call-parser hermes --chat-template chatml-tools`) with the official openai SDK:
named and `required` choices give arguments that validate against the tool's schema over several seeds,
streamed deltas accumulate to the whole answer, a round trip through a `tool` message, and the 400s."""
import json

import httpx
import jsonschema
import openai
import pytest

from server_process import ServerProcess

pytestmark = [pytest.mark.model, pytest.mark.server]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 16}},
                                       "required": ["tz"], "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess("--max-model-len", "1024", "--tool-call-parser", "hermes", "--chat-template", "chatml-tools")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)


def _accumulate(stream):
    """The stream put together as the OpenAI SDK does: content, and each call by its index."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            if d.id is not None:  # a call's first delta: id, type, name, empty arguments
                assert d.index not in calls and d.type == "function" and d.function.arguments == ""
                calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
            else:
                calls[d.index]["arguments"] += d.function.arguments
        finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def test_named_choice_arguments_validate_streamed_and_not(client):
    model = client.models.list().data[0].id
    choice = {"type": "function", "function": {"name": "get_weather"}}
    for seed in (1, 2, 3):
        kw = dict(model=model, messages=MESSAGES, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=60,
                  temperature=1.0, seed=seed)
        whole = client.chat.completions.create(**kw).choices[0]
        assert whole.finish_reason == "tool_calls" and not whole.message.content
        (call,) = whole.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_weather"])
        content, calls, finish = _accumulate(client.chat.completions.create(**kw, stream=True))
        assert finish == "tool_calls" and content == ""
        assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", call.function.arguments)]


def test_required_choice_calls_known_tools_and_parallel_false_makes_one(client):
    model = client.models.list().data[0].id
    for seed, parallel in ((1, True), (2, True), (3, False)):
        kw = dict(model=model, messages=MESSAGES, tools=[WEATHER, TIME], tool_choice="required", max_tokens=120,
                  temperature=1.0, seed=seed, parallel_tool_calls=parallel)
        whole = client.chat.completions.create(**kw).choices[0]
        if whole.finish_reason == "length":
            continue
        assert whole.finish_reason == "tool_calls" and whole.message.tool_calls
        if not parallel:
            assert len(whole.message.tool_calls) == 1
        for call in whole.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        content, calls, finish = _accumulate(client.chat.completions.create(**kw, stream=True))
        assert finish == "tool_calls"
        assert [(c["name"], c["arguments"]) for c in calls] == [
            (c.function.name, c.function.arguments) for c in whole.message.tool_calls]


def test_round_trip_through_a_tool_result(client):
    model = client.models.list().data[0].id
    first = client.chat.completions.create(model=model, messages=MESSAGES, tools=[WEATHER], max_tokens=60,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                           temperature=0).choices[0].message
    call = first.tool_calls[0]
    history = MESSAGES + [first.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp": 18})}]
    final = client.chat.completions.create(model=model, messages=history, tools=[WEATHER], max_tokens=20,
                                           temperature=0).choices[0]
    # tool_choice auto (the default with --tool-call-parser): SmolLM2 answers in words, which stay content
    assert final.message.content and not final.message.tool_calls and final.finish_reason in ("stop", "length")
    streamed = client.chat.completions.create(model=model, messages=history, tools=[WEATHER], max_tokens=20,
                                              temperature=0, stream=True)
    assert _accumulate(streamed)[0] == final.message.content


@pytest.mark.parametrize("body,param", [
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "wat"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_tool_requests_are_400_naming_the_field(server, body, param):
    for stream in (False, True):
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=30,
                       json={"messages": MESSAGES, "max_tokens": 4, "stream": stream, **body})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param, r.text


# The llama.cpp server suite's tool tests that need no particular model (test_tool_call.py,
# test_completion_without_tool_call_fast): no tools, tools with tool_choice null, tool_choice "none".
TEST_TOOL = {"type": "function", "function": {"name": "test", "description": "", "parameters": {
    "type": "object", "properties": {"success": {"type": "boolean", "const": True}}, "required": ["success"]}}}
PYTHON_TOOL = {"type": "function", "function": {
    "name": "python", "description": "Runs code in an ipython interpreter and returns the result of the execution.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string", "description": "The code to run."}},
                   "required": ["code"]}}}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tools,tool_choice", [([], None), ([TEST_TOOL], None), ([PYTHON_TOOL], "none")])
def test_completion_without_tool_call(server, tools, tool_choice, stream):
    body = {"max_tokens": 128, "stream": stream, "tools": tools or None, "tool_choice": tool_choice,
            "messages": [{"role": "system", "content": "You are a coding assistant."},
                         {"role": "user", "content": "say hello world with python"}]}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    if not stream:
        (choice,) = r.json()["choices"]
        assert choice["message"].get("tool_calls") is None and choice["message"]["content"]
        assert choice["finish_reason"] in ("stop", "length")
        return
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    deltas = [c["choices"][0] for c in chunks if c["choices"]]
    assert not any(d["delta"].get("tool_calls") for d in deltas)
    assert "".join(d["delta"].get("content") or "" for d in deltas)
    assert deltas[-1]["finish_reason"] in ("stop", "length")


def _few_shot_history():
    """Three earlier turns in which the assistant called get_weather: SmolLM2 then writes a call itself."""
    history = []
    for i, city in enumerate(["Rome", "Berlin", "Madrid"]):
        call = {"id": f"c{i}", "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps({"city": city, "unit": "celsius"})}}
        history += [{"role": "user", "content": f"What is the weather in {city}?"},
                    {"role": "assistant", "content": "", "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": f"c{i}", "content": "sunny"},
                    {"role": "assistant", "content": f"It is sunny in {city}."}]
    return history + [{"role": "user", "content": "What is the weather in Paris?"}]


def test_auto_choice_calls_the_model_writes_are_well_formed_by_the_lazy_grammar(client):
    """tool_choice auto (the default with --tool-call-parser): the text is free until `<tool_call>`, then a
    grammar holds the call to a known tool and its schema; streamed, the deltas add up to the same call."""
    model = client.models.list().data[0].id
    history, made = _few_shot_history(), 0
    for seed in (0, 1, 2, 3, 4):
        kw = dict(model=model, messages=history, tools=[WEATHER, TIME], max_tokens=60, seed=seed,
                  temperature=0 if seed == 0 else 1.0, parallel_tool_calls=seed != 4)
        whole = client.chat.completions.create(**kw).choices[0]
        if seed == 4:  # parallel_tool_calls false: the grammar ends the answer after its first call
            assert len(whole.message.tool_calls or []) <= 1
        for call in whole.message.tool_calls or []:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        if whole.message.tool_calls:
            made += 1
            assert whole.finish_reason == "tool_calls" and "<tool_call>" not in (whole.message.content or "")
            content, calls, finish = _accumulate(client.chat.completions.create(**kw, stream=True))
            assert finish == "tool_calls" and content == (whole.message.content or "")
            assert [(c["name"], c["arguments"]) for c in calls] == [
                (c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert made >= 2


def test_parallel_calls_under_auto_are_all_returned(client):
    """Two calls in one answer (the model continues a two-call pattern it was shown): both come back, in order,
    streamed and not; with parallel_tool_calls false only the first is made."""
    model = client.models.list().data[0].id
    history = []
    for i, (a, b) in enumerate([("Rome", "Berlin"), ("Madrid", "Oslo"), ("Lima", "Quito")]):
        calls = [{"id": f"c{i}{j}", "type": "function",
                  "function": {"name": "get_weather", "arguments": json.dumps({"city": c, "unit": "celsius"})}}
                 for j, c in enumerate((a, b))]
        history += [{"role": "user", "content": f"What is the weather in {a} and in {b}?"},
                    {"role": "assistant", "content": "", "tool_calls": calls}]
    history.append({"role": "user", "content": "What is the weather in Paris and in Vienna?"})
    kw = dict(model=model, messages=history, tools=[WEATHER, TIME], max_tokens=90, temperature=0)
    whole = client.chat.completions.create(**kw).choices[0]
    calls = whole.message.tool_calls or []
    assert len(calls) == 2 and whole.finish_reason == "tool_calls", whole.message
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert len({c.id for c in calls}) == 2
    content, streamed, finish = _accumulate(client.chat.completions.create(**kw, stream=True))
    assert finish == "tool_calls" and [(c["name"], c["arguments"]) for c in streamed] == [
        (c.function.name, c.function.arguments) for c in calls]
    one = client.chat.completions.create(**kw, parallel_tool_calls=False).choices[0]
    assert [c.function.arguments for c in one.message.tool_calls] == [calls[0].function.arguments]


def test_bench_serve_chat_and_tool_requests(server):
    """`bench serve --chat-tools none|required` against this server: every request streams its full output
    (as content, or as the arguments of its call)."""
    import asyncio

    from nanoserve.bench.serve import run

    for mode in ("none", "required"):
        report = asyncio.run(run(server.url, None, concurrency=2, num_prompts=2, input_len=10, output_len=8,
                                 ban={0: -100, 2: -100}, chat_tools=mode))
        assert report["failed"] == 0, report["errors"]
        assert report["output_tok_per_s"] * report["wall_s"] == pytest.approx(2 * 8)
