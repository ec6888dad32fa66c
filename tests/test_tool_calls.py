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
    for seed in (0, 1, 2, 3):
        kw = dict(model=model, messages=history, tools=[WEATHER, TIME], max_tokens=60, seed=seed,
                  temperature=0 if seed == 0 else 1.0)
        whole = client.chat.completions.create(**kw).choices[0]
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
