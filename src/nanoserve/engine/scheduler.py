"""`Scheduler`: decides each step which requests run and how many tokens each computes. No phases:
every request's `num_computed_tokens` catches up with its `num_tokens` under a per-step token budget,
which gives chunked prefill mixed with decodes; when blocks run out the newest running request is
preempted and recomputed later. Pure Python, no tensors."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from nanoserve.config import SchedulerConfig
from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.request import Request, RequestStatus
from nanoserve.protocol import FinishReason


@dataclass
class SchedulerOutput:
    """One step's work, decodes (1 new token) listed before prefill chunks."""
    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.requests)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order; the last is preempted first
        self.requests: dict[str, Request] = {}
        self.prefill_leaders: dict[str, Request] = {}  # parent id -> the sibling that computes the prompt
        self.num_preemptions = 0  # since start, for tests and metrics
        self.num_draft_tokens = 0  # speculative drafts verified, and those accepted, since start
        self.num_accepted_tokens = 0

    # ---------------------------------------------------------------------------- bookkeeping
    def add_request(self, req: Request) -> None:
        self.requests[req.request_id] = req
        if req.parent_id is not None and self.block_manager.enable_prefix_caching:
            leader = self.prefill_leaders.setdefault(req.parent_id, req)
            if leader is not req:
                req.prefill_leader = leader
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is None:
            return None
        self._finish(req, FinishReason.ABORT)
        return req

    def _finish(self, req: Request, reason: FinishReason) -> None:
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = req.finish_reason or reason
        self.block_manager.free(req)
        del self.requests[req.request_id]
        if req.parent_id is not None and self.prefill_leaders.get(req.parent_id) is req:
            del self.prefill_leaders[req.parent_id]

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.block_manager.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # -------------------------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []

        # 1. Running requests, oldest first: decodes (with their drafts, where they fit) and unfinished
        # prefill chunks.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if req.spec_token_ids:
                drafts = req.spec_token_ids[:budget - 1] if n == 1 else []
                if drafts and self.block_manager.allocate(req, 1 + len(drafts)):
                    req.spec_token_ids = drafts
                    scheduled.append((req, 1 + len(drafts)))
                    budget -= 1 + len(drafts)
                    i += 1
                    continue
                req.spec_token_ids = []  # no room for them this step: a plain decode
            while not self.block_manager.allocate(req, n):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                scheduled.append((req, n))
                budget -= n
                i += 1
                continue
            break  # the request itself was preempted: nothing after it is still running

        # 2. Waiting requests, first come first served, unless we just had to preempt. A sibling of
        # an n > 1 request waits until its leader has computed the shared prompt.
        for req in list(self.waiting):
            if budget <= 0 or out.preempted or len(self.running) >= self.config.max_num_seqs:
                break
            if req.waits_for_leader:
                continue
            cached = self.block_manager.find_cached_prefix(req)
            num_cached = len(cached) * self.block_manager.block_size
            n = min(req.num_tokens - num_cached, budget)
            if not self.block_manager.allocate(req, n, cached):
                break
            self.waiting.remove(req)
            if req.num_cached_tokens < 0:  # first admission, not a resume after preemption
                req.num_cached_tokens = num_cached
                self.block_manager.record_prefix_query(req.num_prompt_tokens, num_cached)
            req.num_computed_tokens = num_cached
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append((req, n))
            budget -= n

        # Decodes first: the model runner batches them together.
        scheduled.sort(key=lambda item: item[0].num_tokens - item[0].num_computed_tokens != 1)
        out.requests = [r for r, _ in scheduled]
        out.num_new_tokens = [n for _, n in scheduled]
        return out

    # ------------------------------------------------------------------------------ update
    def update_from_output(self, out: SchedulerOutput, sampled: list) -> list[Request]:
        """Advances counters after the model ran. `sampled[i]` is the new token of request i (a token, or
        one per row for a decode with drafts: the token after the last token, then after each draft), or
        None for a prefill chunk that did not reach the end of its prompt. Drafts are accepted while they
        equal the token sampled before them, and the token after the last accepted one is appended too.
        Returns requests that got new tokens or finished, in scheduling order."""
        touched = []
        for req, n, tokens in zip(out.requests, out.num_new_tokens, sampled):
            if req.is_finished:  # aborted while the step ran
                continue
            if tokens is None:
                req.num_computed_tokens += n
                self.block_manager.cache_full_blocks(req)
                continue
            tokens = [tokens] if isinstance(tokens, int) else tokens
            drafts, req.spec_token_ids = req.spec_token_ids, []
            accepted = 0
            while accepted < len(drafts) and tokens[accepted] == drafts[accepted]:
                accepted += 1
            self.num_draft_tokens += len(drafts)
            self.num_accepted_tokens += accepted
            start, stopped = req.num_computed_tokens, False
            req.num_step_tokens = 0
            for token in tokens[:accepted + 1]:
                req.append_token(token)
                req.num_step_tokens += 1
                if req.check_stop():
                    stopped = True
                    break
            # The KV cache holds the tokens fed this step up to the last accepted draft (what follows it
            # was computed on rejected drafts and is overwritten by the next steps).
            req.num_computed_tokens = min(start + n - len(drafts) + accepted, req.num_tokens - 1)
            self.block_manager.cache_full_blocks(req)
            touched.append(req)
            if stopped:
                self._finish(req, req.finish_reason)
        return touched
