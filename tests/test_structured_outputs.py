"""Structured outputs on SmolLM2 (offline engine and the real server): JSON schemas, regex, choice and
grammars always hold, greedy and sampled, streamed and not; an unconstrained neighbour is unchanged."""
import json
import re

import httpx
import jsonschema
import openai
import pydantic
import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.structured import StructuredOutputs
from backends import KERNELS_ON, requires_kernels
from server_process import ServerProcess

pytestmark = pytest.mark.model

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
SCHEMAS = [
    PERSON,
    {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "integer"}, "minItems": 1,
                                                "maxItems": 3}}, "required": ["items"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"x": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}, "required": ["x"]},
    {"$defs": {"p": PERSON}, "type": "object", "properties": {"owner": {"$ref": "#/$defs/p"}}, "required": ["owner"],
     "additionalProperties": False},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
     "required": ["code"], "additionalProperties": False},
    {"type": "object", "properties": {"day": {"type": "string", "format": "date"}}, "required": ["day"],
     "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "score": {"type": "number", "minimum": 0}},
     "required": ["ok", "score"], "additionalProperties": False},
    {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 2, "maxItems": 2},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
                                      "meta": {"type": "object", "properties": {"n": {"type": "integer"}},
                                               "required": ["n"], "additionalProperties": False}},
     "required": ["tags", "meta"], "additionalProperties": False},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": -5, "maximum": 5}}, "required": ["n"],
     "additionalProperties": False},
    {"type": "object", "properties": {"id": {"type": "string", "format": "uuid"}}, "required": ["id"],
     "additionalProperties": False},
    {"type": "object", "properties": {"mail": {"type": "string", "format": "email"}}, "required": ["mail"],
     "additionalProperties": False},
    {"type": "object", "properties": {"pet": {"oneOf": [
        {"type": "object", "properties": {"kind": {"const": "cat"}, "lives": {"type": "integer", "minimum": 1,
                                                                            "maximum": 9}},
         "required": ["kind", "lives"], "additionalProperties": False},
        {"type": "object", "properties": {"kind": {"const": "dog"}, "good": {"type": "boolean"}},
         "required": ["kind", "good"], "additionalProperties": False}]}}, "required": ["pet"],
     "additionalProperties": False},
    {"type": "object", "properties": {"matrix": {"type": "array", "minItems": 2, "maxItems": 2, "items": {
        "type": "array", "items": {"type": "number"}, "minItems": 2, "maxItems": 2}}}, "required": ["matrix"],
     "additionalProperties": False},
    {"type": "object", "properties": {"a": {"type": "string", "minLength": 2, "maxLength": 5},
                                      "b": {"type": ["integer", "null"]}}, "required": ["a", "b"],
     "additionalProperties": False},
    {"type": "object", "properties": {"level": {"enum": [1, 2, 3, "max"]}, "note": {"type": "string", "maxLength": 20}},
     "required": ["level"], "additionalProperties": False},
    {"$defs": {"item": {"type": "object", "properties": {"sku": {"type": "string", "pattern": "^[0-9]{4}$"},
                                                         "qty": {"type": "integer", "minimum": 1}},
                        "required": ["sku", "qty"], "additionalProperties": False}},
     "type": "object", "properties": {"order": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1,
                                                "maxItems": 2}}, "required": ["order"], "additionalProperties": False},
    {"type": "object", "properties": {"when": {"type": "string", "format": "date-time"},
                                      "ok": {"const": True}}, "required": ["when", "ok"], "additionalProperties": False},
    {"type": "string", "enum": ["alpha", "beta", "gamma delta"]},
]
PROMPT = "Answer in JSON. Describe a person you like:"


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=512)


def test_json_schemas_hold_greedy_and_sampled(llm):
    params = []
    for schema in SCHEMAS:
        params.append(SamplingParams(temperature=0, max_tokens=120, structured_outputs=StructuredOutputs(json=schema)))
        for seed in (1, 2):
            params.append(SamplingParams(temperature=1.0, seed=seed, max_tokens=120,
                                         structured_outputs=StructuredOutputs(json=schema)))
    outs = llm.generate([PROMPT] * len(params), params, use_tqdm=False)
    for out, p in zip(outs, params):
        o = out.outputs[0]
        if o.finish_reason == "length":  # cut by max_tokens: OpenAI answers length, the JSON is unfinished
            continue
        assert o.finish_reason == "stop", o
        jsonschema.validate(json.loads(o.text), p.structured_outputs.json)
    assert sum(out.outputs[0].finish_reason == "stop" for out in outs) >= len(outs) * 0.8


def test_regex_choice_and_grammar(llm):
    specs = [StructuredOutputs(regex=r"[0-9]{3}-[a-z]{2}"), StructuredOutputs(choice=["yes", "no", "maybe"]),
             StructuredOutputs(grammar='root ::= "cat" | "dog" | "bird" " " [0-9]'),
             StructuredOutputs(grammar='root ::= "x=" num\nnum ::= [0-9] | [0-9] [0-9] | [0-9] [0-9] [0-9]'),
             StructuredOutputs(json_object=True)]
    for temperature in (0.0, 1.0):
        outs = llm.generate(["Pick one:"] * len(specs), [SamplingParams(temperature=temperature, seed=3, max_tokens=40,
                                                                        structured_outputs=s) for s in specs],
                            use_tqdm=False)
        texts = [o.outputs[0].text for o in outs]
        assert [o.outputs[0].finish_reason for o in outs[:4]] == ["stop"] * 4
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", texts[0])
        assert texts[1] in ("yes", "no", "maybe")
        assert re.fullmatch(r"cat|dog|bird [0-9]", texts[2])
        assert re.fullmatch(r"x=[0-9]{1,3}", texts[3])
        if outs[4].outputs[0].finish_reason == "stop":  # else cut by max_tokens
            assert isinstance(json.loads(texts[4]), dict)
        else:
            assert texts[4].startswith("{")


@requires_kernels  # batch invariance is a C-kernel property: PyTorch's float GEMMs round by batch size
def test_a_constrained_neighbour_leaves_other_rows_unchanged(llm):
    plain = SamplingParams(temperature=0.8, seed=11, max_tokens=24)
    alone = llm.generate(["Tell me about cats."], [plain], use_tqdm=False)[0].outputs[0].text
    mixed = llm.generate(["Tell me about cats.", PROMPT],
                         [plain, SamplingParams(temperature=0, max_tokens=40,
                                                structured_outputs=StructuredOutputs(json=PERSON))],
                         use_tqdm=False)
    assert mixed[0].outputs[0].text == alone


@requires_kernels  # batch invariance is a C-kernel property: PyTorch's float GEMMs round by batch size
def test_seeded_structured_output_is_the_same_alone_and_batched(llm):
    p = SamplingParams(temperature=1.0, seed=5, max_tokens=80, structured_outputs=StructuredOutputs(json=PERSON))
    alone = llm.generate([PROMPT], [p], use_tqdm=False)[0].outputs[0].text
    batch = llm.generate([PROMPT, "Hello", PROMPT], [p, SamplingParams(temperature=0.7, seed=1, max_tokens=30), p],
                         use_tqdm=False)
    assert batch[0].outputs[0].text == alone == batch[2].outputs[0].text


def test_invalid_specs_are_value_errors(llm):
    with pytest.raises(ValueError, match="exactly one"):
        SamplingParams(structured_outputs=StructuredOutputs(regex="a", choice=["b"]))
    with pytest.raises(ValueError, match="regex"):
        llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputs(regex="((")), use_tqdm=False)


class Person(pydantic.BaseModel):
    name: str
    age: int


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess("--max-model-len", "512")
    yield proc
    proc.stop()


@pytest.mark.server
def test_server_response_format_streamed_and_sdk_parse(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "Give me a person as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    whole = client.chat.completions.create(model=model, messages=messages, max_tokens=100, temperature=0,
                                           response_format=fmt).choices[0]
    jsonschema.validate(json.loads(whole.message.content), PERSON)
    assert whole.finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=model, messages=messages, max_tokens=100, temperature=0, response_format=fmt, stream=True) if c.choices)
    assert streamed == whole.message.content
    parsed = client.chat.completions.parse(model=model, messages=messages, max_tokens=100, temperature=0.7, seed=2,
                                           response_format=Person).choices[0].message.parsed
    assert isinstance(parsed, Person)
    # JSON mode bounds nothing (any keys, any depth): a prompt whose greedy object closes within the budget.
    small = [{"role": "user", "content": "Give me a small JSON object."}]
    obj = client.chat.completions.create(model=model, messages=small, max_tokens=150, temperature=0,
                                         response_format={"type": "json_object"}).choices[0]
    assert obj.finish_reason == "stop" and isinstance(json.loads(obj.message.content), dict), obj.message.content
    for extra, check in (({"structured_outputs": {"choice": ["left", "right"]}}, lambda t: t in ("left", "right")),
                         ({"guided_regex": "[a-c]{4}"}, lambda t: re.fullmatch("[a-c]{4}", t)),
                         ({"guided_json": PERSON}, lambda t: jsonschema.validate(json.loads(t), PERSON) is None)):
        text = client.completions.create(model=model, prompt="Choose:", max_tokens=60, temperature=0,
                                         extra_body=extra).choices[0].text
        assert check(text), (extra, text)


@pytest.mark.server
def test_server_length_cut_is_length(server):
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "A person as JSON."}], "max_tokens": 3, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"


def test_constraint_starts_after_start_after_text(llm):
    """What a reasoning parser's end tag does: the text up to it is free, the rest follows the schema.
    A word of the free greedy output stands in for `</think>` (SmolLM2 does not think)."""
    prompt = "Once upon a time, there was a"
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0]
    head = llm.get_tokenizer().decode(free.token_ids[:4])  # whole tokens: the constraint starts at a boundary
    assert free.text.startswith(head) and head.strip()
    # Compact JSON: with free whitespace, greedy decoding of a 135M model can loop on newlines until the budget.
    spec = StructuredOutputs(json=PERSON, start_after=head, disable_any_whitespace=True)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=120, structured_outputs=spec),
                       use_tqdm=False)[0].outputs[0]
    assert out.text.startswith(head) and out.finish_reason == "stop"
    jsonschema.validate(json.loads(out.text[len(head):]), PERSON)


def test_min_tokens_and_preemption_keep_the_grammar(llm):
    """min_tokens does not hold a complete grammar open; a request preempted and recomputed (a pool of
    a few blocks) keeps its matcher, and its output still validates and equals the unpreempted one."""
    spec = StructuredOutputs(json=PERSON)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=120, min_tokens=100, structured_outputs=spec),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop"
    jsonschema.validate(json.loads(out.text), PERSON)
    small = LLM(max_model_len=256, num_kv_blocks=6, block_size=16)
    story = {"type": "object", "properties": {"story": {"type": "string", "minLength": 120, "maxLength": 160}},
             "required": ["story"], "additionalProperties": False}
    params = [SamplingParams(temperature=0.8, seed=s, max_tokens=100, structured_outputs=StructuredOutputs(json=story))
              for s in range(4)]
    batched = small.generate([PROMPT] * 4, params, use_tqdm=False)
    assert small.engine.scheduler.num_preemptions > 0
    for p, o in zip(params, batched):
        alone = small.generate([PROMPT], p, use_tqdm=False)[0].outputs[0]
        if KERNELS_ON:  # batch invariance is a C-kernel property (PyTorch's GEMMs round by batch size)
            assert o.outputs[0].text == alone.text
        if o.outputs[0].finish_reason == "stop":
            jsonschema.validate(json.loads(o.outputs[0].text), story)
        if alone.finish_reason == "stop":
            jsonschema.validate(json.loads(alone.text), story)


@pytest.mark.server
def test_server_streamed_schemas_validate_and_bad_ones_are_400_before_the_stream(server):
    """Every schema, streamed at temperature 1.0 with a seed, in one concurrent burst: the accumulated text
    validates. A schema the engine cannot compile is a 400 naming the field even with stream=true."""
    import asyncio

    async def one(http, i, schema):
        body = {"prompt": PROMPT, "max_tokens": 120, "temperature": 1.0, "seed": i, "stream": True,
                "response_format": {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}}}
        text, finish = "", None
        async with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    choice = json.loads(line[6:])["choices"][0]
                    text, finish = text + choice["text"], choice["finish_reason"] or finish
        return text, finish

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            return await asyncio.gather(*(one(http, i, s) for i, s in enumerate(SCHEMAS)))

    results = asyncio.run(main())
    for (text, finish), schema in zip(results, SCHEMAS):
        if finish == "stop":
            jsonschema.validate(json.loads(text), schema)
    assert sum(finish == "stop" for _, finish in results) >= len(SCHEMAS) * 0.8
    for body, param in (({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                            "type": "object", "properties": {"a": {"type": "string", "pattern": "(("}}}}}},
                         "response_format"),
                        ({"guided_regex": "[a-"}, "guided_regex"),
                        ({"structured_outputs": {"json": {"type": "wat"}}}, "structured_outputs"),
                        ({"guided_json": PERSON, "guided_whitespace_pattern": " ?"}, "guided_json")):
        r = httpx.post(f"{server.url}/v1/completions", timeout=30,
                       json={"prompt": "x", "max_tokens": 4, "stream": True, **body})
        assert r.status_code == 400 and r.headers["content-type"].startswith("application/json"), r.text
        assert r.json()["error"]["param"] == param, r.text
