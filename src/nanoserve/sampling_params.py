"""`SamplingParams`: what one request asks of the sampler, the stop logic and the detokenizer,
validated on construction with a `ValueError` that names the offending field. Text-valued fields
(stop strings, bad words) are the frontend's; `for_engine()` strips them before a request crosses."""
from __future__ import annotations

import math
from typing import Optional

import msgspec

from nanoserve.structured import StructuredOutputs

# Stop strings per request: OpenAI takes 4, vLLM any number; each one is matched against every step's
# text, so the count is bounded (a 1,000-string list was accepted before).
MAX_STOP_STRINGS = 64


def field_of_error(message: str) -> Optional[str]:
    """The field a validation message names: by convention its first word ("top_p must be ...")."""
    first = message.split(" ", 1)[0].removesuffix(":")
    return first if first.isidentifier() else None


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Optional[dict[int, float]] = None  # token id -> bias, clamped to [-100, 100]
    allowed_token_ids: Optional[list[int]] = None
    logprobs: Optional[int] = None  # top-N alternatives per generated token (0: the chosen one only)
    prompt_logprobs: Optional[int] = None  # the same for every prompt position after the first
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    # Strings banned from the output; the frontend turns them into `bad_words_token_ids`.
    bad_words: list[str] = []
    bad_words_token_ids: list[list[int]] = []
    # A JSON schema, regex, choice or grammar the output must follow (nanoserve.structured).
    structured_outputs: Optional[StructuredOutputs] = None
    # Frontend only: stop strings and detokenization.
    stop: list[str] = []
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> None:
            raise ValueError(f"{name} {why}, got {getattr(self, name)!r}")

        if not isinstance(self.n, int) or self.n < 1:
            bad("n", "must be an integer >= 1")
        if not 0.0 <= self.temperature <= 2.0:
            bad("temperature", "must be in [0, 2]")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", "must be in (0, 1]")
        if self.top_k < -1:
            bad("top_k", "must be -1 or 0 (disabled) or >= 1")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must be in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", "must be in [-2, 2]")
        if not self.repetition_penalty > 0.0:
            bad("repetition_penalty", "must be > 0")
        if self.logit_bias is not None:
            if any(not isinstance(t, int) or t < 0 for t in self.logit_bias):
                bad("logit_bias", "keys must be non-negative token ids")
            if any(not isinstance(b, (int, float)) or not math.isfinite(b) for b in self.logit_bias.values()):
                bad("logit_bias", "values must be finite numbers (clamped to [-100, 100])")
            self.logit_bias = {t: min(100.0, max(-100.0, float(b))) for t, b in self.logit_bias.items()}
        if self.allowed_token_ids is not None and (
                not self.allowed_token_ids or any(not isinstance(t, int) or t < 0 for t in self.allowed_token_ids)):
            bad("allowed_token_ids", "must be a non-empty list of token ids")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                bad(name, "must be an integer >= 0")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "must be a non-empty string or a list of them")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop must hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        if any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            bad("bad_words", "must be a list of non-blank strings")
        if any(not seq or any(not isinstance(t, int) or t < 0 for t in seq) for seq in self.bad_words_token_ids):
            bad("bad_words_token_ids", "must be non-empty lists of token ids")
        if self.structured_outputs is not None:
            self.structured_outputs.kind()
        if self.n > 1 and self.greedy:
            bad("n", "must be 1 with greedy sampling (temperature 0): every sample would be the same")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad("max_tokens", "must be >= 1")
        if self.min_tokens < 0:
            bad("min_tokens", "must be >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative token ids")

    def for_engine(self) -> "SamplingParams":
        """A copy without the text-valued fields, which never cross to the engine core."""
        if not (self.stop or self.bad_words):
            return self
        return msgspec.structs.replace(self, stop=[], bad_words=[])

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5
