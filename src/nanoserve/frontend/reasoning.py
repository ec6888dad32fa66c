"""Reasoning parsers: split a streamed answer into `reasoning` (between `<think>` and `</think>`) and
`content`, on text deltas where a tag may be split across chunks, never emitting part of a tag.
`--reasoning-parser qwen3|deepseek_r1` picks one from `REASONING_PARSERS`."""
from __future__ import annotations

from typing import Optional


class ReasoningParser:
    """One per request. The start tag counts only at the very beginning of the output (after optional
    whitespace); the first end tag closes the reasoning and everything after it is content.

    `starts_in_reasoning`: the output begins inside the reasoning (the chat template already wrote
    the start tag, or the model never writes it). `strip_answer_newlines`: leading blank lines of
    the answer are dropped."""

    start_tag = "<think>"
    end_tag = "</think>"

    def __init__(self, starts_in_reasoning: bool = False, strip_answer_newlines: bool = False):
        self.in_reasoning = starts_in_reasoning
        self.strip_answer_newlines = strip_answer_newlines
        self.at_start = True  # the start tag may still come
        self.done = False  # the end tag was seen
        self.strip_pending = False
        self.buffer = ""

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        """Returns the (reasoning, content) text this delta releases; `final` flushes what was held."""
        self.buffer += delta
        reasoning, content = [], []
        while self.buffer:
            if self.done:
                content.append(self.buffer)
                self.buffer = ""
                break
            if self.at_start:
                stripped = self.buffer.lstrip()
                if stripped.startswith(self.start_tag):
                    self.buffer = stripped[len(self.start_tag):]
                    self.in_reasoning, self.at_start = True, False
                    continue
                if not final and (not stripped or self.start_tag.startswith(stripped)):
                    break  # could still become the start tag
                self.at_start = False
            if not self.in_reasoning:
                content.append(self.buffer)
                self.buffer = ""
                break
            i = self.buffer.find(self.end_tag)
            if i >= 0:
                reasoning.append(self.buffer[:i])
                self.buffer = self.buffer[i + len(self.end_tag):]
                self.in_reasoning, self.done = False, True
                self.strip_pending = self.strip_answer_newlines
                continue
            keep = 0 if final else _partial_suffix(self.buffer, self.end_tag)
            reasoning.append(self.buffer[:len(self.buffer) - keep])
            self.buffer = self.buffer[len(self.buffer) - keep:]
            break
        content_text = "".join(content)
        if self.strip_pending and content_text:
            content_text = content_text.lstrip("\r\n")
            self.strip_pending = not content_text
        return "".join(reasoning), content_text


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3 writes `<think>` itself when thinking; with `enable_thinking=False` its template puts an
    empty think block in the prompt and the output is all content."""

    def __init__(self, starts_in_reasoning: bool = False):
        super().__init__(starts_in_reasoning, strip_answer_newlines=True)


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1's template ends the prompt with `<think>\\n`: the output starts inside the reasoning
    whether or not the model repeats the tag."""

    def __init__(self, starts_in_reasoning: bool = True):
        super().__init__(True, strip_answer_newlines=True)


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "qwen3": Qwen3ReasoningParser,
    "deepseek_r1": DeepSeekR1ReasoningParser,
}


def make_reasoning_parser(name: Optional[str], prompt_text: str = "",
                          chat_template_kwargs: Optional[dict] = None) -> Optional[ReasoningParser]:
    """The parser for one request, or None when no reasoning is expected (no parser configured, or
    `enable_thinking=False`). A prompt that ends inside an open think block starts in reasoning."""
    if name is None:
        return None
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {sorted(REASONING_PARSERS)}")
    if (chat_template_kwargs or {}).get("enable_thinking") is False:
        return None
    tail = prompt_text.rstrip()
    opened = tail.endswith(ReasoningParser.start_tag)
    return REASONING_PARSERS[name](starts_in_reasoning=opened) if opened else REASONING_PARSERS[name]()
