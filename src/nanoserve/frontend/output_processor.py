"""`OutputProcessor`: the API-server side of every request. Turns the engine core's token-id outputs
into per-completion deltas of text (incremental detokenizer, stop strings, reasoning split) and
says which requests the engine must finish early because a stop string ended them."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

from nanoserve.frontend.detokenizer import IncrementalDetokenizer
from nanoserve.frontend.reasoning import ReasoningParser
from nanoserve.protocol import EngineCoreOutput, TokenLogprobs
from nanoserve.sampling_params import SamplingParams


@dataclass
class CompletionDelta:
    """What one engine output adds to one completion (choice `index` of request `request_id`)."""
    request_id: str
    index: int
    text: str = ""
    reasoning: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: Optional[list[TokenLogprobs]] = None  # one per token in token_ids, when asked for
    prompt_logprobs: Optional[list[TokenLogprobs]] = None
    finish_reason: Optional[str] = None  # "stop", "length", "abort" or "error"
    stop_reason: Union[int, str, None] = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class CompletionState:
    def __init__(self, request_id: str, index: int, params: SamplingParams, tokenizer,
                 reasoning: Optional[ReasoningParser]):
        self.request_id = request_id
        self.index = index
        self.params = params
        self.detokenizer = IncrementalDetokenizer(tokenizer, params)
        self.reasoning = reasoning


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.states: dict[str, CompletionState] = {}  # engine request id -> its completion

    def add_request(self, engine_request_id: str, request_id: str, index: int, params: SamplingParams,
                    reasoning: Optional[ReasoningParser] = None) -> None:
        self.states[engine_request_id] = CompletionState(request_id, index, params, self.tokenizer, reasoning)

    def remove(self, engine_request_id: str) -> None:
        self.states.pop(engine_request_id, None)

    def has(self, engine_request_id: str) -> bool:
        return engine_request_id in self.states

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[CompletionDelta], list[str]]:
        """Returns the deltas, and the engine request ids a stop string finished (to abort in the
        engine so their KV blocks are freed at once)."""
        deltas, to_abort = [], []
        for out in outputs:
            state = self.states.get(out.request_id)
            if state is None:  # already finished here (stop string) or aborted
                continue
            seen = len(state.detokenizer.token_ids)
            stop = state.detokenizer.update(out.new_token_ids)
            used = len(state.detokenizer.token_ids) - seen  # fewer when a stop string ended the text early
            delta = CompletionDelta(state.request_id, state.index, token_ids=list(out.new_token_ids[:used]),
                                    logprobs=out.new_logprobs[:used] if out.new_logprobs is not None else None,
                                    prompt_logprobs=out.prompt_logprobs, num_cached_tokens=out.num_cached_tokens)
            if stop is not None:
                delta.finish_reason, delta.stop_reason = "stop", stop
                if not out.finished:
                    to_abort.append(out.request_id)
            elif out.finished:
                delta.finish_reason, delta.stop_reason = str(out.finish_reason), out.stop_reason
            text = state.detokenizer.get_delta(delta.finished)
            if state.reasoning is not None:
                delta.reasoning, delta.text = state.reasoning.feed(text, final=delta.finished)
            else:
                delta.text = text
            if delta.finished:
                del self.states[out.request_id]
            deltas.append(delta)
        return deltas, to_abort
