"""Tool calling on chat: `ToolRequest` checks `tools`, `tool_choice` and `parallel_tool_calls`, turns `required`
and a named function into structured outputs (arguments valid by construction, as vLLM does), and builds
OpenAI's `tool_calls` from each choice's text: whole for a response, as deltas for a stream."""
from __future__ import annotations

import re
import uuid
from typing import Any, Optional

from nanoserve.frontend.tool_parsers import (CallDelta, Parsed, ParsedCall, ToolCallStream, ToolParser,
                                             call_list_schema, json_list_calls, make_tool_parser)
from nanoserve.structured import StructuredOutputs

FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


class ToolError(ValueError):
    """A 400 naming its request field."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


def _functions(tools: Optional[list[dict[str, Any]]]) -> dict[str, dict]:
    """name -> parameters schema of each tool; ToolError for a malformed one."""
    out = {}
    for i, tool in enumerate(tools or []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise ToolError("tools", f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
            raise ToolError("tools", f"tools[{i}].function.name must be 1-64 letters, digits, '_', '.' or '-', "
                                     f"got {name!r}")
        if name in out:
            raise ToolError("tools", f"tools[{i}]: two tools are named {name!r}")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ToolError("tools", f"tools[{i}].function.parameters must be a JSON schema object")
        out[name] = params
    return out


class ToolRequest:
    """What one chat request asks of tools: mode is none, auto (the parser finds calls the model writes),
    required (one or more calls) or named (a call of that function)."""

    def __init__(self, tools, tool_choice, parallel_tool_calls: Optional[bool], parser_name: Optional[str]):
        self.functions = _functions(tools)
        self.parallel = parallel_tool_calls is not False
        self.parser: Optional[ToolParser] = None
        self.named: Optional[str] = None
        if tool_choice is not None and tool_choice != "none" and not self.functions:
            raise ToolError("tool_choice", "tool_choice needs tools")
        if isinstance(tool_choice, dict):
            fn = tool_choice.get("function")
            name = fn.get("name") if isinstance(fn, dict) else None
            if tool_choice.get("type") != "function" or not isinstance(name, str):
                raise ToolError("tool_choice", 'a named tool_choice is {"type": "function", "function": {"name": ...}}')
            if name not in self.functions:
                raise ToolError("tool_choice", f"no tool is named {name!r} (tools: {', '.join(self.functions)})")
            self.mode, self.named = "named", name
        elif tool_choice in ("none", "required"):
            self.mode = tool_choice
        elif tool_choice == "auto" or (tool_choice is None and self.functions and parser_name):
            if not parser_name:
                raise ToolError("tool_choice", '"auto" tool choice needs a server started with --tool-call-parser')
            self.mode, self.parser = "auto", make_tool_parser(parser_name)
        elif tool_choice is None:  # tools without a parser: rendered for the model, its answer stays text
            self.mode = "none"
        else:
            raise ToolError("tool_choice", f'tool_choice must be "none", "auto", "required" or a named function, '
                                           f"got {tool_choice!r}")

    @property
    def active(self) -> bool:
        return self.mode != "none"

    def structured(self) -> Optional[StructuredOutputs]:
        """The constraint of `required` and named choices: the call's arguments, or a list of calls, follow
        the tools' parameter schemas. For `auto`, a lazy grammar: the text is free until the parser's trigger,
        then the call is held to a known tool and its schema, as llama.cpp does."""
        if self.mode == "auto":
            lazy = self.parser.lazy_grammar(self.functions, self.parallel)
            return None if lazy is None else StructuredOutputs(structural_tag={"type": "structural_tag", "format": lazy})
        if self.mode == "named":
            return StructuredOutputs(json=self.functions[self.named])
        if self.mode != "required":
            return None
        return StructuredOutputs(json=call_list_schema(self.functions, self.parallel, "parameters"))

    def split(self, text: str) -> tuple[Optional[str], list[ParsedCall]]:
        """A whole answer as (content, calls); content None when the answer is only calls."""
        if self.mode == "named":
            return None, [ParsedCall(self.named, text)]
        if self.mode == "required":
            calls = json_list_calls(text, final=True) or []
            return (None, calls) if calls else (text, [])
        parsed = self.parser.parse(text, final=True)
        calls = parsed.calls if self.parallel else parsed.calls[:1]
        return (parsed.content or None) if calls else parsed.content, calls

    def stream(self) -> "ChoiceToolStream":
        return ChoiceToolStream(self)


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_calls_message(calls: list[ParsedCall]) -> list[dict]:
    return [{"id": call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls]


class _RequiredParser(ToolParser):
    name = "required"

    def parse(self, text: str, final: bool) -> Parsed:
        return Parsed("", json_list_calls(text, final) or [])


class ChoiceToolStream:
    """One streamed choice: its text deltas in, OpenAI's `content` and `tool_calls` delta fields out."""

    def __init__(self, request: ToolRequest):
        self.request, self.ids = request, {}
        self.named_started = False
        parser = _RequiredParser() if request.mode == "required" else request.parser
        self.inner = ToolCallStream(parser) if parser is not None else None

    def feed(self, text: str, finished: bool) -> tuple[str, list[dict]]:
        if self.request.mode == "named":
            deltas = [] if self.named_started else [CallDelta(0, self.request.named, "")]
            self.named_started = True
            if text:
                deltas.append(CallDelta(0, None, text))
            return "", self._wire(deltas)
        content, deltas = self.inner.feed(text)
        if finished:
            more_content, more = self.inner.finish()
            content, deltas = content + more_content, deltas + more
        if not self.request.parallel:
            deltas = [d for d in deltas if d.index == 0]
        return content, self._wire(deltas)

    @property
    def has_calls(self) -> bool:
        return self.named_started or bool(self.inner and self.inner.has_calls)

    def _wire(self, deltas: list[CallDelta]) -> list[dict]:
        out = []
        for d in deltas:
            if d.name is not None:
                self.ids[d.index] = call_id()
                out.append({"index": d.index, "id": self.ids[d.index], "type": "function",
                            "function": {"name": d.name, "arguments": ""}})
            else:
                out.append({"index": d.index, "function": {"arguments": d.arguments}})
        return out

