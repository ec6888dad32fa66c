"""Structured outputs: what a request asks for (`StructuredOutputs`: a JSON schema, JSON, a regex, a choice
or a Lark/GBNF grammar), its grammar for llguidance, and `GrammarBackend`, which builds each request's
matcher in the engine core. The sampler applies the matcher's allowed-token mask before everything else."""
from __future__ import annotations

import json
import threading
from typing import Any, Optional

import msgspec

STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


class StructuredOutputs(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """vLLM's `structured_outputs` (and what `response_format` and the `guided_*` fields become): exactly
    one of the kinds. `json` is a schema (a dict, or its JSON text)."""
    json: Any = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: bool = False
    disable_any_whitespace: bool = False
    whitespace_pattern: Optional[str] = None
    # The output is free text until this text has been generated (a reasoning parser's end tag): the
    # constraint starts after it, so that the thinking stays free.
    start_after: Optional[str] = None

    def kind(self) -> str:
        given = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if self.start_after is not None and not (isinstance(self.start_after, str) and self.start_after):
            raise ValueError("structured_outputs.start_after must be a non-empty string")
        if len(given) != 1:
            raise ValueError(f"structured outputs take exactly one of {', '.join(STRUCTURED_KINDS)}; got "
                             f"{', '.join(given) or 'none'}")
        return given[0]

    def grammar_text(self) -> str:
        """The llguidance grammar (its JSON form, or Lark) for this request; raises ValueError for a bad spec."""
        import llguidance

        kind = self.kind()
        if kind in ("json", "json_object"):
            schema = {"type": "object"} if kind == "json_object" else self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"json: not a JSON schema: {exc}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("json: a JSON schema must be an object")
            defaults: dict[str, Any] = {"whitespace_flexible": not self.disable_any_whitespace}
            if self.whitespace_pattern is not None:
                defaults = {"whitespace_pattern": self.whitespace_pattern}
            try:
                return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=defaults)
            except ValueError as exc:
                raise ValueError(f"json: {exc}") from None
        if kind == "regex":
            return llguidance.grammar_from("regex", self.regex)
        if kind == "choice":
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("choice must be a non-empty list of non-empty strings")
            return llguidance.grammar_from("choice", json.dumps(self.choice))
        try:  # GBNF (llama.cpp's, `root ::= ...`) or Lark (`start: ...`)
            return llguidance.grammar_from("grammar", self.grammar)
        except ValueError as exc:
            raise ValueError(f"grammar: {exc}") from None

    def check(self) -> str:
        """The grammar text once llguidance accepts it (no tokenizer needed); ValueError naming the problem."""
        import llguidance

        grammar = self.grammar_text()
        ok, error = _validate(llguidance, grammar)
        if not ok:
            raise ValueError(f"{self.kind()}: {error}")
        return grammar


def _validate(llguidance, grammar: str) -> tuple[bool, str]:
    try:
        error = llguidance.LLMatcher.validate_grammar(grammar, None)
    except ValueError as exc:
        return False, str(exc)
    return not error, error


class GrammarBackend:
    """The engine's grammar side: llguidance's view of the vocabulary (built once, from the model's tokenizer,
    on first use: about a second) and a cache of checked grammars by their text."""

    def __init__(self, model_path: str, vocab_size: int):
        self.model_path, self.vocab_size = model_path, vocab_size
        self._tokenizer = None
        self._lock = threading.Lock()
        self._grammars: dict[bytes, str] = {}

    def tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                from nanoserve.frontend.tokenizer import load_tokenizer
                self._tokenizer = llguidance.hf.from_tokenizer(load_tokenizer(self.model_path),
                                                               n_vocab=self.vocab_size)
            return self._tokenizer

    def state(self, spec: StructuredOutputs) -> "GrammarState":
        return GrammarState(self.matcher(spec), self.tokenizer(), spec.start_after)

    def matcher(self, spec: StructuredOutputs):
        """A fresh matcher for one request; ValueError when the grammar does not compile."""
        import llguidance

        key = msgspec.json.encode(msgspec.structs.replace(spec, start_after=None))
        grammar = self._grammars.get(key)
        if grammar is None:
            grammar = spec.check()
            if len(self._grammars) < 4096:
                self._grammars[key] = grammar
        matcher = llguidance.LLMatcher(self.tokenizer(), grammar)
        if matcher.is_error():
            raise ValueError(f"{spec.kind()}: {matcher.get_error()}")
        return matcher


class GrammarState:
    """One request's grammar: its matcher, engaged from the first token or once `start_after` has been
    generated; it advances with every output token after that (and is kept across preemption, like them)."""

    def __init__(self, matcher, tokenizer, start_after: Optional[str] = None):
        self.matcher, self.tokenizer = matcher, tokenizer
        self.waiting_for = start_after.encode() if start_after else None
        self.tail = b""

    @property
    def active(self) -> bool:
        return self.waiting_for is None

    def accept(self, token: int) -> None:
        if self.waiting_for is None:
            self.matcher.consume_token(token)
            return
        self.tail = (self.tail + self.tokenizer.decode_bytes([token]))[-(len(self.waiting_for) + 64):]
        if self.waiting_for in self.tail:
            self.waiting_for = None

    @property
    def complete(self) -> bool:
        return self.waiting_for is None and self.matcher.is_stopped()
