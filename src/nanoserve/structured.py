"""Structured outputs: what a request asks for (`StructuredOutputs`: a JSON schema, JSON, a regex, a choice
or an EBNF/GBNF grammar), and xgrammar on the engine side: `GrammarBackend` compiles each request's grammar
(cached by its text) and `GrammarState` follows it; the sampler applies its packed allowed-token bitmask first."""
from __future__ import annotations

import json
import re
from typing import Any, Optional

import msgspec

STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
GRAMMAR_CACHE_BYTES = 256 << 20  # compiled grammars kept by xgrammar's compiler, by their text


class StructuredOutputs(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """vLLM's `structured_outputs` (and what `response_format` and the `guided_*` fields become): exactly
    one of the kinds. `json` is a schema (a dict, or its JSON text)."""
    json: Any = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: bool = False
    # xgrammar's structural tag (a dict or its JSON text): free text in which each trigger starts a tag whose
    # content follows a schema; tool calling's lazy grammar for tool_choice auto.
    structural_tag: Any = None
    disable_any_whitespace: bool = False
    whitespace_pattern: Optional[str] = None
    # The output is free text until this text has been generated (a reasoning parser's end tag): the
    # constraint starts after it, so that the thinking stays free.
    start_after: Optional[str] = None

    def kind(self) -> str:
        """The one kind asked for, after the checks that need no grammar engine; ValueError naming the problem
        (the grammar itself is compiled, and its errors found, in the engine)."""
        given = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if self.start_after is not None and not (isinstance(self.start_after, str) and self.start_after):
            raise ValueError("structured_outputs.start_after must be a non-empty string")
        if len(given) != 1:
            raise ValueError(f"structured outputs take exactly one of {', '.join(STRUCTURED_KINDS)}; got "
                             f"{', '.join(given) or 'none'}")
        if self.whitespace_pattern is not None:
            raise ValueError("whitespace_pattern is not supported by the grammar engine (xgrammar); "
                             "disable_any_whitespace gives compact JSON")
        kind = given[0]
        if kind == "json":
            self.schema()
        elif kind == "choice" and not all(isinstance(c, str) and c for c in self.choice):
            raise ValueError("choice must be a non-empty list of non-empty strings")
        elif kind == "structural_tag" and not isinstance(self.structural_tag, (dict, str)):
            raise ValueError("structural_tag must be an object or its JSON text")
        elif kind in ("regex", "grammar") and not isinstance(getattr(self, kind), str):
            raise ValueError(f"{kind} must be a string")
        return kind

    def schema(self) -> dict:
        schema = self.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ValueError(f"json: not a JSON schema: {exc}") from None
        if not isinstance(schema, dict):
            raise ValueError("json: a JSON schema must be an object")
        return schema

    def cache_key(self) -> bytes:
        return msgspec.json.encode(msgspec.structs.replace(self, start_after=None))


_XGRAMMAR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


class GrammarBackend:
    """The engine's grammar side: xgrammar's view of the vocabulary and its compiler (built once, on the
    first structured-outputs request), and `state()`, a request's grammar compiled (or found in the cache)."""

    def __init__(self, model_path: str, vocab_size: int, stop_token_ids: tuple[int, ...]):
        import xgrammar

        from nanoserve.frontend.tokenizer import load_tokenizer
        self.xgrammar = xgrammar
        self.info = xgrammar.TokenizerInfo.from_huggingface(load_tokenizer(model_path), vocab_size=vocab_size,
                                                            stop_token_ids=list(stop_token_ids))
        self.compiler = xgrammar.GrammarCompiler(self.info, max_threads=1, cache_limit_bytes=GRAMMAR_CACHE_BYTES)
        self.decoded_vocab = self.info.decoded_vocab

    def compile(self, spec: StructuredOutputs):
        """The compiled grammar; ValueError naming the kind when it does not compile."""
        kind, c = spec.kind(), self.compiler
        try:
            if kind in ("json", "json_object"):  # json_object: a JSON object, as OpenAI's JSON mode gives
                schema = spec.schema() if kind == "json" else {"type": "object"}
                compact = {"any_whitespace": False, "separators": (",", ":")} if spec.disable_any_whitespace else {}
                return c.compile_json_schema(json.dumps(schema), **compact)
            if kind == "regex":
                return c.compile_regex(spec.regex)
            if kind == "structural_tag":
                tag = spec.structural_tag
                return c.compile_structural_tag(tag if isinstance(tag, str) else json.dumps(tag))
            if kind == "choice":
                return c.compile_grammar("root ::= " + " | ".join(json.dumps(s, ensure_ascii=False) for s in spec.choice))
            return c.compile_grammar(spec.grammar)
        except (RuntimeError, ValueError, TypeError) as exc:
            message = _XGRAMMAR_PREFIX.sub("", str(exc).strip())
            raise ValueError(f"{kind}: {message}") from None

    def state(self, spec: StructuredOutputs) -> "GrammarState":
        return GrammarState(self.xgrammar.GrammarMatcher(self.compile(spec)), self.decoded_vocab, spec.start_after)


class GrammarState:
    """One request's grammar: its matcher, engaged from the first token or once `start_after` has been
    generated; it advances with every output token after that (and is kept across preemption, like them)."""

    def __init__(self, matcher, decoded_vocab: list[bytes], start_after: Optional[str] = None):
        self.matcher, self.decoded_vocab = matcher, decoded_vocab
        self.waiting_for = start_after.encode() if start_after else None
        self.tail = b""
        self.rejected = False

    @property
    def active(self) -> bool:
        return self.waiting_for is None

    def accept(self, token: int) -> None:
        if self.waiting_for is None:
            # False only for a token the mask did not allow (every allowed one banned by bad_words or
            # logit_bias): the request then ends rather than go on outside its grammar.
            self.rejected = self.rejected or not self.matcher.accept_token(token)
            return
        self.tail = (self.tail + self.decoded_vocab[token])[-(len(self.waiting_for) + 64):]
        if self.waiting_for in self.tail:
            self.waiting_for = None

    @property
    def complete(self) -> bool:
        """The grammar has ended: it matched and its stop token (EOS) was accepted."""
        return self.waiting_for is None and (self.matcher.is_terminated() or self.rejected)
