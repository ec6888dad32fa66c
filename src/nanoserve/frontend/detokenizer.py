"""`IncrementalDetokenizer`: one per request, on the API-server side. Turns generated token ids into
text deltas that never hold half a character, finds stop strings as they form (holding back the
characters that could still begin one), and says when the request must stop."""
from __future__ import annotations

import logging
from typing import Optional

from tokenizers.decoders import DecodeStream

from nanoserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, params: SamplingParams, use_decode_stream: Optional[bool] = None):
        """`use_decode_stream`: None picks `tokenizers`' `DecodeStream` whenever the tokenizer is a
        fast one, and the prefix/read-offset algorithm otherwise (False forces the latter)."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.spaces_between_special_tokens = params.spaces_between_special_tokens
        self.stop = list(params.stop)
        self.include_stop = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        # Characters held back while a stop string could still be forming at the end of the text.
        self.holdback = 0 if self.include_stop or not self.stop else max(map(len, self.stop)) - 1
        self.token_ids: list[int] = []
        self.output_text = ""
        self.num_sent = 0  # characters of output_text already returned as deltas
        self.stop_reason: Optional[str] = None  # the stop string that ended the text
        fast = getattr(tokenizer, "is_fast", False) and hasattr(tokenizer, "_tokenizer")
        if use_decode_stream is None:
            use_decode_stream = fast
        self.stream = DecodeStream(skip_special_tokens=self.skip_special_tokens) if use_decode_stream else None
        # Prefix/read-offset fallback: text of tokens [prefix_offset, read_offset) was already emitted.
        self.prefix_offset = 0
        self.read_offset = 0

    @property
    def stopped(self) -> bool:
        return self.stop_reason is not None

    def update(self, new_token_ids: list[int]) -> Optional[str]:
        """Decodes new tokens one at a time and checks stop strings after each; returns the stop
        string when one matched (later tokens are then ignored), else None."""
        for token in new_token_ids:
            if self.stopped:
                break
            self.token_ids.append(token)
            previous_len = len(self.output_text)
            self.output_text += self._decode_next(token)
            if self.stop and len(self.token_ids) > self.min_tokens and len(self.output_text) > previous_len:
                self._check_stop(previous_len)
        return self.stop_reason

    def get_delta(self, finished: bool = False) -> str:
        """Text not yet returned; while unfinished, the last `holdback` characters stay back."""
        end = len(self.output_text)
        if not finished and not self.stopped:
            end = max(self.num_sent, end - self.holdback)
        delta = self.output_text[self.num_sent:end]
        self.num_sent = end
        return delta

    # ------------------------------------------------------------------------------ internals
    def _check_stop(self, previous_len: int) -> None:
        """Finds stop strings that end in the new text (searching only it plus the overlap each stop
        string could span); the earliest match wins, and of two starting at the same character (one is
        a prefix of the other) the shorter, which a character-by-character stream would complete first."""
        best: Optional[tuple[int, str]] = None
        for stop in self.stop:
            i = self.output_text.find(stop, max(0, previous_len - len(stop) + 1))
            if i >= 0 and (best is None or (i, len(stop)) < (best[0], len(best[1]))):
                best = (i, stop)
        if best is None:
            return
        i, stop = best
        self.output_text = self.output_text[:i + len(stop) if self.include_stop else i]
        self.stop_reason = stop
        self.num_sent = min(self.num_sent, len(self.output_text))

    def _decode_next(self, token: int) -> str:
        try:
            if self.stream is not None:
                return self.stream.step(self.tokenizer._tokenizer, token) or ""
            return self._decode_with_offsets()
        except Exception as exc:  # a bad id must not kill the request: log it and go on
            logger.warning("cannot decode token id %r: %s", token, exc)
            if self.stream is None:
                self.token_ids.pop()
            return ""

    def _decode_with_offsets(self) -> str:
        """The classic algorithm: decode a short window of recent tokens with and without the new
        ones and emit the difference once it no longer ends in an incomplete character. The window
        is bounded, so the cost per token does not grow with the output."""
        ids = self.token_ids
        prefix = self._convert(ids[self.prefix_offset:self.read_offset])
        full = self._convert(ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith(REPLACEMENT):
            self.prefix_offset, self.read_offset = self.read_offset, len(ids)
            return full[len(prefix):]
        return ""

    def _convert(self, ids: list[int]) -> str:
        tok = self.tokenizer
        tokens = tok.convert_ids_to_tokens(ids, skip_special_tokens=self.skip_special_tokens)
        special = set(tok.all_special_tokens)
        parts, current = [], []
        for t in tokens:
            if t in special:
                if current:
                    parts.append(tok.convert_tokens_to_string(current))
                    current = []
                parts.append(t)
            else:
                current.append(t)
        if current:
            parts.append(tok.convert_tokens_to_string(current))
        return (" " if self.spaces_between_special_tokens else "").join(parts)
