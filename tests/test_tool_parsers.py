"""Tool-call parsers on transcripts of each format: one call, parallel calls, calls after content, malformed
calls that stay content; streamed in any chunking, the deltas add up to the whole-text parse and no piece
of a start tag ever shows in the content."""
import json
import random
import re

import pytest

from nanoserve.frontend.tool_parsers import ToolCallStream, make_tool_parser

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
TIME = '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}'

# (parser, generated text, expected content, expected [(name, arguments)])
CASES = [
    ("hermes", f"<tool_call>\n{WEATHER}\n</tool_call>", "", [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    ("hermes", f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>",
     "Let me check.\n", [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"tz": "Europe/Paris"})]),
    ("hermes", '<tool_call>\n{"arguments": {"q": "a}b"}, "name": "search"}\n</tool_call>', "",
     [("search", {"q": "a}b"})]),
    ("hermes", "No tools needed: 2 < 3 and <tool> is not a tag.", "No tools needed: 2 < 3 and <tool> is not a tag.", []),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"x": 1}\n</tool_call>',
     '<tool_call>\n{"name": "f", "arguments": {"x": 1}\n</tool_call>', []),  # the object never closes
    ("hermes", "<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    ("hermes", f"<tool_call>\n{WEATHER}", "", [("get_weather", {"city": "Paris", "unit": "celsius"})]),  # EOS before the end tag
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [("get_weather", {"city": "Paris"})]),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"n": [1, 2]}}', "",
     [("a", {}), ("b", {"n": [1, 2]})]),
    ("llama3_json", "The weather in Paris is mild.", "The weather in Paris is mild.", []),
    ("llama3_json", '{"name": "a", "parameters": {"x": }', '{"name": "a", "parameters": {"x": }', []),
    ("mistral", f"[TOOL_CALLS][{WEATHER}, {TIME}]", "",
     [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"tz": "Europe/Paris"})]),
    ("mistral", 'Sure. [TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}[TOOL_CALLS]get_time[ARGS]{}', "Sure. ",
     [("get_weather", {"city": "Rome"}), ("get_time", {})]),
    ("mistral", "Plain [TOOL answer.", "Plain [TOOL answer.", []),
    ("mistral", "[TOOL_CALLS][oops", "[TOOL_CALLS][oops", []),
    ("pythonic", '[get_weather(city="Paris", unit="celsius")]', "",
     [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    ("pythonic", "<|python_start|>[get_weather(city='Rome (IT)', days=[1, 2], opts={'x': None, 'y': True}), "
                 "get_time()]<|python_end|>", "",
     [("get_weather", {"city": "Rome (IT)", "days": [1, 2], "opts": {"x": None, "y": True}}), ("get_time", {})]),
    ("pythonic", "[1, 2, 3] are the first numbers.", "[1, 2, 3] are the first numbers.", []),
    ("pythonic", "I would call get_weather(city='Paris').", "I would call get_weather(city='Paris').", []),
    ("pythonic", "[get_weather('Paris')]", "[get_weather('Paris')]", []),  # positional: not a call
    ("pythonic", "[get_weather(city=input())]", "[get_weather(city=input())]", []),  # not a literal
    ("pythonic", "[get_weather(city='Paris')", "[get_weather(city='Paris')", []),  # the list never closes
]


def _stream(parser_name: str, text: str, chunks: list[int]):
    stream = ToolCallStream(make_tool_parser(parser_name))
    content, calls, pieces, pos = "", {}, [], 0
    for size in chunks + [len(text)]:
        piece, pos = text[pos:pos + size], pos + size
        pieces.append(stream.feed(piece))
        if pos >= len(text):
            break
    pieces.append(stream.finish())
    for c, deltas in pieces:
        content += c
        for d in deltas:
            if d.name is not None:  # a call's first delta: its name and empty arguments
                assert d.index not in calls and d.arguments == ""
                calls[d.index] = [d.name, ""]
            else:
                calls[d.index][1] += d.arguments
    return content, [tuple(calls[i]) for i in sorted(calls)], [c for c, _ in pieces]


@pytest.mark.parametrize("parser_name,text,content,calls", CASES)
def test_whole_text_parse(parser_name, text, content, calls):
    parsed = make_tool_parser(parser_name).parse(text, final=True)
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == calls
    assert all(c.done for c in parsed.calls)


# A stream commits to a call once its name and arguments key are written (its first delta has gone out), so
# the malformed cases that get that far (a pythonic call closed, then the list broken) are left out here (a grammar that engages at the start tag is
# what will keep a started call well-formed: issue 17, item 4).
STREAMED = [c for c in CASES if c[3] or not re.search(r'"name": "\w+", "(arguments|parameters)"|^\[\w+\(\w+=.*\)', c[1])]


@pytest.mark.parametrize("parser_name,text,content,calls", STREAMED)
def test_streamed_deltas_add_up_to_the_whole_parse(parser_name, text, content, calls):
    whole = make_tool_parser(parser_name).parse(text, final=True)
    rng = random.Random(0)
    for chunking in ([1] * len(text), [3] * len(text), [rng.randint(1, 9) for _ in text]):
        got_content, got_calls, content_pieces = _stream(parser_name, text, chunking)
        if calls:  # well-formed calls: the stream equals the whole parse
            assert got_content == whole.content
            assert got_calls == [(c.name, c.arguments) for c in whole.calls]
            tag = make_tool_parser(parser_name).start_tag
            assert not any(tag[:4] in piece for piece in content_pieces if tag)  # no piece of a start tag leaks
        else:
            assert got_content == content and got_calls == []


def test_unknown_parser_is_a_clear_error():
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral, pythonic"):
        make_tool_parser("qwen9")


GET_WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}}}


@pytest.mark.parametrize("parser_name,parallel,text,accepted", [
    ("hermes", True, 'Let me see.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\n'
                     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>', True),
    ("hermes", True, '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', False),  # unknown tool
    ("hermes", True, '<tool_call>\n{"name": "get_weather", "arguments": {"town": "Rome"}}\n</tool_call>', False),
    ("hermes", False, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\n<tool_call>',
     False),  # parallel_tool_calls false: nothing after the first call
    ("llama3_json", True, '{"name": "get_weather", "parameters": {"city": "Rome"}}', True),
    ("mistral", True, 'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Rome"}}, '
                      '{"name": "get_weather", "arguments": {"city": "Oslo"}}]', True),
    ("mistral", False, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}, '
                       '{"name": "get_weather", "arguments": {"city": "Oslo"}}]', False),
    ("mistral", True, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": 3}}]', False),
    ("mistral", True, "Plain text with no call.", True),
])
def test_lazy_grammar_holds_a_started_call_to_known_tools(parser_name, parallel, text, accepted):
    """tool_choice auto: xgrammar compiles each parser's triggered tags; text before the trigger is free and
    a call after it must name a known tool with arguments valid for its schema."""
    import xgrammar

    from nanoserve.entrypoints.openai.tools import ToolRequest

    spec = ToolRequest([GET_WEATHER], "auto", parallel, parser_name).structured()
    grammar = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo([])).compile_structural_tag(
        json.dumps(spec.structural_tag))
    assert xgrammar.GrammarMatcher(grammar).accept_string(text) == accepted


def test_pythonic_has_no_lazy_grammar():
    from nanoserve.entrypoints.openai.tools import ToolRequest

    assert ToolRequest([GET_WEATHER], "auto", True, "pythonic").structured() is None
