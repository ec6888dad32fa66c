"""Test helper: drives a `ModelRunner` through hand-made schedules (chunked prefill, decode) and returns
the logits of every computed position, so tests can compare them with a reference."""
from __future__ import annotations

import torch

from backends import DEFAULT
from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.model_runner import ModelRunner
from nanoserve.engine.request import Request
from nanoserve.engine.scheduler import SchedulerOutput
from nanoserve.model.registry import build_model
from nanoserve.sampling_params import SamplingParams


class RunnerDriver:
    def __init__(self, path: str, dtype: str = "float32", block_size: int = 16, num_blocks: int = 256,
                 prefix_caching: bool = True, model=None, backend=None,
                 kv_dtype: torch.dtype = torch.float32, int8_activations: bool = False):
        self.config, model = (model.config, model) if model is not None else build_model(path, dtype)
        self.runner = ModelRunner(model, num_blocks, block_size, backend or DEFAULT, kv_dtype=kv_dtype,
                                  int8_activations=int8_activations)
        self.bm = BlockManager(num_blocks, block_size, prefix_caching)
        self._n = 0

    def new_request(self, tokens: list[int]) -> Request:
        self._n += 1
        return Request(str(self._n), tokens, SamplingParams(temperature=0, max_tokens=1), 1)

    def step(self, work: list[tuple[Request, int]]) -> list[torch.Tensor]:
        """Computes `n` more tokens of each request; returns (n, vocab) logits per request."""
        for req, n in work:
            assert self.bm.allocate(req, n)
        sched = SchedulerOutput([r for r, _ in work], [n for _, n in work])
        input_ids, meta, *_ = self.runner.prepare(sched)
        rows = torch.arange(len(input_ids))
        logits = self.runner.run_model(input_ids, meta, rows)
        out, start = [], 0
        for req, n in work:
            out.append(logits[start:start + n])
            start += n
            req.num_computed_tokens += n
            self.bm.cache_full_blocks(req)
        return out

    def run(self, sequences: list[list[int]], prefill_chunk: int, prefill_len: list[int]) -> list[torch.Tensor]:
        """Prefills the first `prefill_len[i]` tokens of each sequence in chunks of `prefill_chunk`
        (all sequences in the same steps), then decodes the rest one token per step, batched."""
        reqs = [self.new_request(s) for s in sequences]
        logits: list[list[torch.Tensor]] = [[] for _ in reqs]
        while any(r.num_computed_tokens < p for r, p in zip(reqs, prefill_len)):
            work = [(r, min(prefill_chunk, p - r.num_computed_tokens)) for r, p in zip(reqs, prefill_len)
                    if r.num_computed_tokens < p]
            # Decodes (n == 1) must come first in a step, as the scheduler orders them.
            work.sort(key=lambda w: w[1] != 1)
            for (r, _), lg in zip(work, self.step(work)):
                logits[reqs.index(r)].append(lg)
        while any(r.num_computed_tokens < r.num_tokens for r in reqs):
            work = [(r, 1) for r in reqs if r.num_computed_tokens < r.num_tokens]
            for (r, _), lg in zip(work, self.step(work)):
                logits[reqs.index(r)].append(lg)
        for r in reqs:
            self.bm.free(r)
        return [torch.cat(lg) for lg in logits]
