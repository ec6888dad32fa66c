"""Tool-call parsers (`--tool-call-parser`): `hermes` (`<tool_call>{json}</tool_call>`), `llama3_json`
(Llama 3.1/3.2 JSON calls, `;`-separated), `mistral` (`[TOOL_CALLS]` with a JSON list, or `name[ARGS]{...}`) and
`pythonic` (`[f(x=1), g()]`). Each parses the text so far into content and calls; `ToolCallStream` makes deltas."""
from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field
from typing import Optional

# A call object as models write it, name first: `{"name": "f", "arguments": ` (or "parameters").
_CALL_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_SPACE = re.compile(r"\s*")


@dataclass
class ParsedCall:
    name: str
    arguments: str  # the arguments' JSON text, as generated; a prefix of it while the call is open
    done: bool = True


@dataclass
class Parsed:
    content: str  # text that is not part of a call (and, mid-stream, cannot become one)
    calls: list[ParsedCall] = field(default_factory=list)


def json_value_end(text: str, start: int) -> Optional[int]:
    """The end of the JSON object or array that starts at `start` (balanced, strings skipped), or None
    while it is still open."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def held_back(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag` (kept back from content)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def parse_call(text: str, start: int, final: bool) -> tuple[Optional[ParsedCall], Optional[int], bool]:
    """The call object at `start` (a `{`): (call or None, end index or None, malformed). A call whose name
    and arguments key are written is returned open (done False, end None) while its arguments grow."""
    head = _CALL_HEAD.match(text, start)
    if head is not None:
        name = json.loads(f'"{head.group(1)}"')
        args_start = head.end()
        if args_start < len(text) and text[args_start] != "{":
            return None, None, True
        args_end = json_value_end(text, args_start)
        if args_end is None:
            return (None, None, True) if final else (ParsedCall(name, text[args_start:], done=False), None, False)
        close = _SPACE.match(text, args_end).end()
        if close < len(text) and text[close] == "}":
            return ParsedCall(name, text[args_start:args_end]), close + 1, False
        if close < len(text) or final:
            return None, None, True
        return ParsedCall(name, text[args_start:args_end], done=False), None, False
    end = json_value_end(text, start)
    if end is None:
        return None, None, final
    try:  # keys in another order: the call whole, its arguments re-serialized
        obj = json.loads(text[start:end])
    except json.JSONDecodeError:
        return None, None, True
    args = obj.get("arguments", obj.get("parameters")) if isinstance(obj, dict) else None
    if not isinstance(obj.get("name") if isinstance(obj, dict) else None, str) or not isinstance(args, dict):
        return None, None, True
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False)), end, False


def json_list_calls(text: str, final: bool, pos: int = 0) -> Optional[list[ParsedCall]]:
    """A JSON list of call objects at `pos` (after whitespace): `[{"name": ..., "arguments": {...}}, ...]`
    (Mistral's, and what `tool_choice: required` generates). None when malformed; mid-stream, the calls so far."""
    pos = _SPACE.match(text, pos).end()
    if pos == len(text):
        return None if final else []
    if text[pos] != "[":
        return None
    calls, pos = [], _SPACE.match(text, pos + 1).end()
    while pos < len(text):
        if text[pos] == "]" and calls:
            return calls if _SPACE.match(text, pos + 1).end() == len(text) else None
        if text[pos] != "{":
            return None
        call, end, malformed = parse_call(text, pos, final)
        if malformed:
            return None
        if call is not None:
            calls.append(call)
        if end is None:
            return calls
        pos = _SPACE.match(text, end).end()
        if pos < len(text) and text[pos] == ",":
            pos = _SPACE.match(text, pos + 1).end()
    return None if final else calls


def call_list_schema(functions: dict[str, dict], parallel: bool, args_key: str) -> dict:
    """The JSON schema of a list of calls `[{"name": ..., args_key: {...}}, ...]` of these tools (name ->
    parameters schema): one or more calls, at most one unless parallel."""
    items = [{"type": "object", "properties": {"name": {"const": name}, args_key: params},
              "required": ["name", args_key], "additionalProperties": False} for name, params in functions.items()]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


class ToolParser:
    name = ""
    start_tag = ""  # the text that opens tool calls
    trigger = ""  # the text on which the lazy grammar engages ("" for none)

    def call_tag(self, name: str) -> tuple[str, str]:
        """The text around the arguments of a call of `name` (a structural tag's begin and end)."""
        raise NotImplementedError

    def lazy_grammar(self, functions: dict[str, dict], parallel: bool) -> Optional[dict]:
        """xgrammar's triggered-tags format for `tool_choice: auto`: free text until the trigger, then a call of
        a known tool with arguments valid for its schema; one call per trigger. None where there is no trigger."""
        if not self.trigger:
            return None
        tags = []
        for name, params in functions.items():
            begin, end = self.call_tag(name)
            tags.append({"type": "tag", "begin": begin, "end": end,
                         "content": {"type": "json_schema", "json_schema": params}})
        # parallel_tool_calls false: the answer ends with its first call
        return {"type": "triggered_tags", "triggers": [self.trigger], "tags": tags, "stop_after_first": not parallel}

    def parse(self, text: str, final: bool) -> Parsed:
        raise NotImplementedError


class HermesToolParser(ToolParser):
    """`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, any number, with content around them
    (Hermes 2 Pro, Qwen2.5, Qwen3)."""
    name, start_tag, end_tag, trigger = "hermes", "<tool_call>", "</tool_call>", "<tool_call>"

    def call_tag(self, name: str) -> tuple[str, str]:
        return f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": ', "}\n</tool_call>"

    def parse(self, text: str, final: bool) -> Parsed:
        out, pos = Parsed(""), 0
        while True:
            k = text.find(self.start_tag, pos)
            if k < 0:
                rest = text[pos:]
                out.content += rest if final else rest[:len(rest) - held_back(rest, self.start_tag)]
                return out
            out.content += text[pos:k]
            j = _SPACE.match(text, k + len(self.start_tag)).end()
            if j == len(text) and not final:
                return out
            call, end, malformed = (None, None, True) if j == len(text) or text[j] != "{" else parse_call(text, j, final)
            if malformed:
                out.content += text[k:] if final else ""
                return out
            if call is not None:
                out.calls.append(call)
            if end is None:
                return out
            pos = _SPACE.match(text, end).end()
            if text.startswith(self.end_tag, pos):
                pos = _SPACE.match(text, pos + len(self.end_tag)).end()  # whitespace between calls is not content
            elif not final and self.end_tag.startswith(text[pos:]):  # the end tag is being written
                return out
            elif pos < len(text):  # the call was not closed by its tag: leave it as it was written
                out.calls.pop()
                out.content += text[k:] if final else ""
                return out


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1/3.2: the answer is one or more `{"name": ..., "parameters": {...}}` objects separated by `;`,
    optionally after `<|python_tag|>`; an answer that does not start so is content."""
    name, start_tag, trigger = "llama3_json", "<|python_tag|>", '{"name": "'

    def call_tag(self, name: str) -> tuple[str, str]:
        return f'{{"name": {json.dumps(name)}, "parameters": ', "}"

    def parse(self, text: str, final: bool) -> Parsed:
        body = text.lstrip()
        if body.startswith(self.start_tag):
            body = body[len(self.start_tag):]
        elif not final and (not body or self.start_tag.startswith(body)):
            return Parsed("")
        pos = _SPACE.match(body).end()
        if pos == len(body) and not final:
            return Parsed("")
        if not body.startswith("{", pos):
            return Parsed(text)
        out = Parsed("")
        while True:
            call, end, malformed = parse_call(body, pos, final)
            if malformed:
                return Parsed(text if final else "")
            if call is not None:
                out.calls.append(call)
            if end is None:
                return out
            pos = _SPACE.match(body, end).end()
            if pos < len(body) and body[pos] == ";":
                pos = _SPACE.match(body, pos + 1).end()
            if pos == len(body):
                return out
            if body[pos] != "{":
                return Parsed(text if final else "")


class MistralToolParser(ToolParser):
    """Mistral: content, then `[TOOL_CALLS]` and a JSON list of `{"name", "arguments"}` objects (v0.3), or
    `[TOOL_CALLS]name[ARGS]{...}` for each call (v11 tokenizers)."""
    name, start_tag, args_tag, trigger = "mistral", "[TOOL_CALLS]", "[ARGS]", "[TOOL_CALLS]"

    def lazy_grammar(self, functions: dict[str, dict], parallel: bool) -> dict:
        """After `[TOOL_CALLS]` (and an optional space), one JSON list of calls (v0.3's form), which ends the answer."""
        calls = {"type": "json_schema", "json_schema": call_list_schema(functions, parallel, "arguments")}
        tag = {"type": "tag", "begin": self.trigger, "end": "",
               "content": {"type": "sequence", "elements": [{"type": "regex", "pattern": " ?"}, calls]}}
        return {"type": "triggered_tags", "triggers": [self.trigger], "tags": [tag], "stop_after_first": True}

    def parse(self, text: str, final: bool) -> Parsed:
        k = text.find(self.start_tag)
        if k < 0:
            return Parsed(text if final else text[:len(text) - held_back(text, self.start_tag)])
        out = Parsed(text[:k])
        pos = _SPACE.match(text, k + len(self.start_tag)).end()
        if pos == len(text):
            return out if not final else Parsed(text)
        calls = json_list_calls(text, final, pos) if text[pos] == "[" else self._named(text, pos, final)
        if calls is None:
            return Parsed(text) if final else out
        out.calls = calls
        return out

    def _named(self, text: str, pos: int, final: bool) -> Optional[list[ParsedCall]]:
        calls = []
        while pos < len(text):
            a = text.find(self.args_tag, pos)
            if a < 0:
                return None if final or not re.fullmatch(r"[\w.-]*\[?[A-Z]*", text[pos:]) else calls
            name = text[pos:a].strip()
            start = _SPACE.match(text, a + len(self.args_tag)).end()
            if not re.fullmatch(r"[\w.-]+", name) or (start < len(text) and text[start] != "{"):
                return None
            end = json_value_end(text, start) if start < len(text) else None
            if end is None:
                if final:
                    return None
                calls.append(ParsedCall(name, text[start:], done=False))
                return calls
            calls.append(ParsedCall(name, text[start:end]))
            pos = _SPACE.match(text, end).end()
            if text.startswith(self.start_tag, pos):
                pos = _SPACE.match(text, pos + len(self.start_tag)).end()
            elif pos < len(text):
                return None
        return calls


def _python_value_end(text: str, start: int, closer: str) -> Optional[int]:
    """The index of the `closer` that ends the bracketed Python expression opened just before `start`
    (brackets balanced, '...' and "..." strings skipped), -1 if another bracket closes it, or None while
    it is still open."""
    depth, quote, escaped = 0, "", False
    for i in range(start, len(text)):
        ch = text[i]
        if quote:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:
                return i if ch == closer else -1
            depth -= 1
    return None


_PY_CALL_HEAD = re.compile(r"\s*([A-Za-z_][\w.]*)\s*\(")
_PY_NAME = re.compile(r"[A-Za-z_][\w.]*")


def _python_call(source: str) -> Optional[ParsedCall]:
    """`name(key=literal, ...)` as a call with JSON arguments; None when it is not one (positional arguments,
    values that are not literals)."""
    try:
        node = ast.parse(source.strip(), mode="eval").body
        if not isinstance(node, ast.Call) or node.args or any(kw.arg is None for kw in node.keywords):
            return None
        args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
        return ParsedCall(ast.unparse(node.func), json.dumps(args, ensure_ascii=False))
    except (SyntaxError, ValueError, TypeError, RecursionError):
        return None


class PythonicToolParser(ToolParser):
    """Llama 3.2 / Llama 4 pythonic calls: the whole answer is a Python list of calls with keyword arguments,
    `[get_weather(city="Paris"), get_time()]`, optionally between `<|python_start|>` and `<|python_end|>`.
    Argument values are Python literals, returned as JSON; an answer that is not such a list is content."""
    name, start_tag, end_tag = "pythonic", "<|python_start|>", "<|python_end|>"

    def parse(self, text: str, final: bool) -> Parsed:
        body = text.lstrip()
        if body.startswith(self.start_tag):
            body = body[len(self.start_tag):]
        elif not final and (not body or self.start_tag.startswith(body)):
            return Parsed("")
        pos = _SPACE.match(body).end()
        if pos == len(body) and not final:
            return Parsed("")
        if not body.startswith("[", pos):
            return Parsed(text)
        calls, pos = [], pos + 1
        while True:  # at the start of a call
            head = _PY_CALL_HEAD.match(body, pos)
            if head is None:
                rest = body[pos:].strip()
                if not final and (not rest or _PY_NAME.fullmatch(rest)):  # a name being written
                    return Parsed("", calls)
                # `[` then not a call: content (held while calls were already streamed, as it cannot be undone)
                return Parsed(text) if final or not calls else Parsed("", calls)
            close = _python_value_end(body, head.end(), ")")
            call = _python_call(body[pos:close + 1]) if close is not None and close >= 0 else None
            if call is None:
                return Parsed(text) if final else Parsed("", calls)
            calls.append(call)
            pos = _SPACE.match(body, close + 1).end()
            if body.startswith(",", pos):
                pos += 1
            elif body.startswith("]", pos):
                tail = body[pos + 1:].strip()
                if tail in ("", self.end_tag) or (not final and self.end_tag.startswith(tail)):
                    return Parsed("", calls)
                return Parsed(text) if final else Parsed("", calls)
            elif pos == len(body) and not final:
                return Parsed("", calls)
            else:
                return Parsed(text) if final else Parsed("", calls)


TOOL_PARSERS = {p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, PythonicToolParser)}


def make_tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"--tool-call-parser must be one of {', '.join(TOOL_PARSERS)}, got {name!r}") from None


@dataclass
class CallDelta:
    index: int
    name: Optional[str]  # set on a call's first delta only
    arguments: str


class ToolCallStream:
    """Deltas of one streamed answer: content that can no longer become a call, each call's name once
    (its first delta, empty arguments), then its argument text as it grows. `finish()` flushes the rest."""

    def __init__(self, parser: ToolParser):
        self.parser, self.text = parser, ""
        self.content_sent, self.args_sent = 0, []

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[CallDelta]]:
        self.text += delta
        parsed = self.parser.parse(self.text, final)
        content = parsed.content[self.content_sent:] if len(parsed.content) > self.content_sent else ""
        self.content_sent += len(content)
        deltas = []
        for i, call in enumerate(parsed.calls):
            if i == len(self.args_sent):
                self.args_sent.append(0)
                deltas.append(CallDelta(i, call.name, ""))
            new = call.arguments[self.args_sent[i]:]
            if new:
                self.args_sent[i] += len(new)
                deltas.append(CallDelta(i, None, new))
        return content, deltas

    def finish(self) -> tuple[str, list[CallDelta]]:
        return self.feed("", final=True)

    @property
    def has_calls(self) -> bool:
        return bool(self.args_sent)
