"""`Request`: one generation inside the engine core, with explicit counters that the scheduler and
the block manager advance (tokens computed so far, blocks held, hashes of its full blocks)."""
from __future__ import annotations

import enum
import time
from typing import Optional

from nanoserve.protocol import FinishReason, TokenLogprobs
from nanoserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 max_tokens: int, eos_token_ids: tuple[int, ...] = (), arrival_time: float = 0.0,
                 parent_id: Optional[str] = None):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.max_tokens = max_tokens  # already clamped to the room left in the context
        self.eos_token_ids = frozenset(eos_token_ids)
        self.stop_token_ids = frozenset(params.stop_token_ids)
        self.arrival_time = arrival_time or time.monotonic()
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # set when first scheduled
        self.block_ids: list[int] = []
        self.block_hashes: list[bytes] = []  # hash chain of this request's full blocks, grows as it runs
        self.num_registered_blocks = 0  # leading blocks already offered to the prefix cache
        # The cached block that holds the same tokens as its last offered block (None before the first;
        # NO_CACHED_PARENT once the chain is broken and later blocks cannot be offered).
        self.cache_parent: Optional[int] = None
        self.status = RequestStatus.WAITING
        self.finish_reason: Optional[FinishReason] = None
        self.stop_reason: Optional[int] = None
        self.num_preemptions = 0
        self.parent_id = parent_id
        # A sibling (same parent) whose prompt computation this request waits for, to share its blocks.
        self.prefill_leader: Optional[Request] = None
        # Logprobs of prompt tokens 1.. as they are computed (kept across preemption).
        self.prompt_logprobs: list[TokenLogprobs] = []
        # A structured-outputs request's GrammarState: its mask is applied before any other processor.
        self.grammar = None
        # Draft tokens (--speculative-ngram) to verify after the last token in the next step; the
        # scheduler trims them to what it schedules.
        self.spec_token_ids: list[int] = []
        self.num_step_tokens = 0  # tokens the last step appended (more than one when drafts were accepted)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def waits_for_leader(self) -> bool:
        leader = self.prefill_leader
        return leader is not None and not leader.is_finished and \
            leader.num_computed_tokens < leader.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def can_speculate(self) -> bool:
        """Drafts are verified as extra decode rows, which penalties and grammars (their state advances
        token by token) do not support yet."""
        return self.grammar is None and not self.params.has_penalties

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
        self.output_token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.accept(token_id)

    def check_stop(self) -> bool:
        """After a new token: decide whether the request is done, and why."""
        token = self.output_token_ids[-1]
        past_min = self.num_output_tokens >= self.params.min_tokens
        if past_min and not self.params.ignore_eos and token in self.eos_token_ids:
            self.finish_reason = FinishReason.STOP
        elif past_min and token in self.stop_token_ids:
            self.finish_reason, self.stop_reason = FinishReason.STOP, token
        elif self.grammar is not None and self.grammar.complete:
            self.finish_reason = FinishReason.STOP
        elif self.num_output_tokens >= self.max_tokens:
            self.finish_reason = FinishReason.LENGTH
        else:
            return False
        return True
