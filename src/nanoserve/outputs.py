"""What the offline API returns, in vLLM's shape: one `RequestOutput` per prompt holding one
`CompletionOutput` per sample."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: Optional[str] = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: Optional[str] = None  # "stop", "length" or "abort"
    stop_reason: Union[int, str, None] = None
    # One dict per generated token: {token id: Logprob} for the chosen token and the top-N.
    logprobs: Optional[list[dict[int, Logprob]]] = None
    cumulative_logprob: Optional[float] = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    # With prompt_logprobs: None for the first prompt token, then one dict per prompt token.
    prompt_logprobs: Optional[list[Optional[dict[int, Logprob]]]] = None
