"""Wire types between the frontend and the engine core: msgspec Structs carrying token ids and
numbers only, so the same objects work in-process and over ZMQ/msgpack."""
from __future__ import annotations

import enum
from typing import Optional, Union

import msgspec

from nanoserve.sampling_params import SamplingParams


class FinishReason(enum.IntEnum):
    STOP = 0
    LENGTH = 1
    ABORT = 2

    def __str__(self) -> str:
        return self.name.lower()


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    # n > 1: the completions of one prompt share a parent id; the first one added computes the
    # prompt, the others wait and take its KV blocks from the prefix cache.
    parent_id: Optional[str] = None


class TokenLogprobs(msgspec.Struct, array_like=True, gc=False):
    """Log-probability of one generated token, its rank (1 = most likely), and the top-N tokens."""
    logprob: float
    rank: int
    top_token_ids: list[int] = []
    top_logprobs: list[float] = []


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    new_token_ids: list[int]
    finish_reason: Optional[FinishReason] = None
    # The stop token id that ended the request, when one did.
    stop_reason: Union[int, None] = None
    num_cached_tokens: int = 0
    new_logprobs: Optional[list[TokenLogprobs]] = None  # one per new token, when requested
    # With the first token, when requested: one entry per prompt token after the first.
    prompt_logprobs: Optional[list[TokenLogprobs]] = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, array_like=True, gc=False):
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of KV blocks in use
    prefix_queried_tokens: int  # totals since start
    prefix_hit_tokens: int
    num_preemptions: int
    idle_seconds: float = 0.0  # engine loop time spent waiting for input with nothing to run
    spec_draft_tokens: int = 0  # --speculative-ngram: drafts verified and accepted since start
    spec_accepted_tokens: int = 0
    load_tokens: int = 0  # tokens (prompt + output so far) of the running and waiting requests: the router's load


class Rejection(msgspec.Struct, array_like=True, gc=False):
    """A request the engine core refused; `status` is the HTTP status the frontend should answer."""
    request_id: str
    status: int
    message: str
    param: Optional[str] = None


class ComputeInfo(msgspec.Struct, gc=False):
    """What the engine decided once at start: backend ("c" or "torch"), the kernels' instruction-set
    target, the layer matrices' storage, the activation and KV-cache formats, and compute threads."""
    backend: str
    isa: Optional[str]
    weights: str
    activations: str
    kv_cache_dtype: str
    num_threads: int

    def summary(self) -> str:
        isa = f" ({self.isa})" if self.isa else ""
        return (f"backend {self.backend}{isa}, {self.num_threads} threads; weights: {self.weights}; "
                f"activations: {self.activations}; KV cache: {self.kv_cache_dtype}")


class ModelInfo(msgspec.Struct, array_like=True, gc=False):
    """Sent with the engine core's ready message: what the frontend needs to know of the model."""
    max_model_len: int
    vocab_size: int
    max_logprobs: int
    pid: int
    compute: ComputeInfo
    block_size: int = 16  # tokens per KV-cache block (prefix-cache granularity)


# Frontend -> engine core: one message per frame, tagged by type.
class AddRequest(msgspec.Struct, tag="add", gc=False):
    request: EngineCoreRequest


class AbortRequests(msgspec.Struct, tag="abort", gc=False):
    request_ids: list[str]


class Hello(msgspec.Struct, tag="hello", gc=False):
    pass


CoreInput = Union[AddRequest, AbortRequests, Hello]


class EngineCoreOutputs(msgspec.Struct, omit_defaults=True, gc=False):
    """Engine core -> one frontend: new tokens, accepted and rejected requests, scheduler stats, and
    the ready / fatal-error notices."""
    outputs: list[EngineCoreOutput] = []
    accepted: list[str] = []
    rejected: list[Rejection] = []
    stats: Optional[SchedulerStats] = None
    ready: Optional[ModelInfo] = None
    dead: Optional[str] = None  # the engine core failed: every in-flight request must end
