"""`EngineCore`: tokens in, tokens out. Chooses the compute backend and the numeric formats once,
loads the model, sizes the KV block pool, and runs the step loop `schedule -> execute -> update` for
`add_request` / `abort` / `step` callers (the offline `LLM` in-process, the engine-core process behind
ZMQ)."""
from __future__ import annotations

import ctypes
import logging
import os
from typing import Optional

import torch

from nanoserve.structured import GrammarBackend, GrammarState
from nanoserve.config import EngineConfig
from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.ngram import drafts_per_request, propose_ngram
from nanoserve.engine.model_runner import ModelRunner, kv_bytes_per_block, kv_cache_dtype, use_int8_activations
from nanoserve.engine.request import Request
from nanoserve.engine.scheduler import Scheduler
from nanoserve.model.registry import build_model, describe_weights, weight_bytes
from nanoserve.kernels.backend import select_backend
from nanoserve.protocol import ComputeInfo, EngineCoreOutput, EngineCoreRequest, SchedulerStats

logger = logging.getLogger(__name__)


def resident_bytes() -> int:
    """This process's resident memory (VmRSS), 0 where /proc is not there."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def keep_freed_memory() -> None:
    """NOTE: glibc gives every large allocation its own mmap and returns it to the kernel on free, so
    each step's big temporaries (logits, sampler rows, activations) page-fault in freshly zeroed pages:
    a 10 MB copy took 20 ms instead of 3. Raising the mmap and trim thresholds keeps freed memory in
    the heap for reuse. The process only holds on to what it has already used."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return  # not glibc: nothing to tune
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    libc.mallopt(M_MMAP_THRESHOLD, 1 << 30)
    libc.mallopt(M_TRIM_THRESHOLD, (1 << 31) - 1)


class PromptTooLongError(ValueError):
    """The prompt does not fit in the model's context (or the KV pool)."""


class EngineCore:
    def __init__(self, config: EngineConfig, loaded_model=None):
        """`loaded_model`: an already built `(ModelConfig, model)` to share weights between engines
        (tests); by default the model is loaded from `config.model`. Raises `ValueError` (or
        `RuntimeError` for `--kernels c` where they cannot run) for an explicit option that cannot run."""
        self.config = config
        num_threads = config.num_threads or len(os.sched_getaffinity(0)) or 1
        torch.set_num_threads(num_threads)
        torch.manual_seed(config.seed)
        self.backend = select_backend(config.kernels, num_threads,
                                      None if config.kernel_target == "auto" else config.kernel_target)
        sched_cfg = config.scheduler
        self.model_config, model = loaded_model or build_model(config.model, config.dtype,
                                                               sched_cfg.max_model_len, config.quantization)
        self.max_model_len = sched_cfg.max_model_len or self.model_config.max_position_embeddings
        keep_freed_memory()  # after loading: the loader's freed temporaries go back to the system
        cache = config.cache
        kv_dtype = kv_cache_dtype(cache.kv_cache_dtype, self.model_config)
        per_block = kv_bytes_per_block(self.model_config, cache.block_size, kv_dtype)
        # The KV pool: --num-kv-blocks, else the smaller of --kv-cache-memory and what max_num_seqs
        # requests of max_model_len tokens can fill.
        usable = -(-sched_cfg.max_num_seqs * self.max_model_len // cache.block_size)
        if not cache.num_kv_blocks and cache.kv_cache_memory < per_block:
            raise ValueError(f"--kv-cache-memory holds no KV block: {cache.kv_cache_memory} bytes, where one block of "
                             f"{cache.block_size} tokens takes {per_block} (the CLI's value is in GiB, the Python "
                             f"API's kv_cache_memory in bytes)")
        num_blocks = cache.num_kv_blocks or min(cache.kv_cache_memory // per_block, usable)
        self.block_manager = BlockManager(num_blocks, cache.block_size, cache.enable_prefix_caching)
        self.scheduler = Scheduler(sched_cfg, self.block_manager)
        int8 = use_int8_activations(config.activation_dtype, model)
        self.runner = ModelRunner(model, num_blocks, cache.block_size, self.backend, config.seed,
                                  logprobs_mode=config.logprobs_mode, kv_dtype=kv_dtype, int8_activations=int8)
        self.capacity_tokens = num_blocks * cache.block_size
        self.grammars: Optional[GrammarBackend] = None  # built with the first structured-outputs request
        widened = self.runner.widened_bytes
        self.compute = ComputeInfo(self.backend.name, self.backend.isa, describe_weights(model),
                                   "int8" if int8 else "float32", str(kv_dtype).replace("torch.", ""), num_threads)
        logger.info("compute: %s", self.compute.summary())
        logger.info("memory: weights %.1f MiB%s, KV cache %.1f MiB (%d blocks of %d tokens), process resident "
                    "%.1f MiB", weight_bytes(model) / 2**20,
                    f" + {widened / 2**20:.1f} MiB float32 copies for the PyTorch backend" if widened else "",
                    num_blocks * per_block / 2**20, num_blocks, cache.block_size, resident_bytes() / 2**20)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.model_config.eos_token_ids

    def add_request(self, request: EngineCoreRequest, max_tokens: Optional[int] = None, grammar=None) -> None:
        """Queues a request; raises `PromptTooLongError` when its prompt cannot fit and `ValueError`
        for parameters this model cannot honour. `max_tokens` and `grammar`: the results of an earlier
        `check_request` and `grammar_state` (the engine-core process runs both on its IO thread, so
        grammars compile off the engine loop), which skips them here."""
        if max_tokens is None:
            max_tokens = self.check_request(request)
            grammar = self.grammar_state(request)
        req = Request(request.request_id, request.prompt_token_ids, request.sampling_params, max_tokens,
                      self.eos_token_ids, request.arrival_time, request.parent_id)
        req.grammar = grammar
        self.scheduler.add_request(req)

    def grammar_state(self, request: EngineCoreRequest) -> Optional[GrammarState]:
        """The request's grammar (None without structured outputs); ValueError for a bad grammar."""
        spec = request.sampling_params.structured_outputs
        if spec is None:
            return None
        if self.grammars is None:
            self.grammars = GrammarBackend(self.config.model, self.model_config.vocab_size, self.eos_token_ids)
        return self.grammars.state(spec)

    def check_request(self, request: EngineCoreRequest) -> int:
        """Validates a request against the model and the pool without changing anything; returns its
        max_tokens clamped to the room left in the context."""
        prompt_len = len(request.prompt_token_ids)
        if prompt_len == 0:
            raise ValueError("the prompt must contain at least one token")
        limit = min(self.max_model_len, self.capacity_tokens)
        if prompt_len >= limit:
            raise PromptTooLongError(
                f"this model's maximum context length is {limit} tokens, but the prompt has "
                f"{prompt_len} tokens (at least one more is needed to generate)")
        vocab = self.model_config.vocab_size
        bad = next((t for t in request.prompt_token_ids if t < 0 or t >= vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token ids must be in [0, {vocab}), got {bad}")
        params = request.sampling_params
        for name in ("stop_token_ids", "logit_bias", "allowed_token_ids", "bad_words_token_ids"):
            ids = getattr(params, name) or ()
            if name == "bad_words_token_ids":
                ids = [t for seq in ids for t in seq]
            bad = next((t for t in ids if t < 0 or t >= vocab), None)
            if bad is not None:
                raise ValueError(f"{name} must hold token ids in [0, {vocab}), got {bad}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.config.max_logprobs:
                raise ValueError(f"{name} must be in [0, {self.config.max_logprobs}], got {value}")
        room = limit - prompt_len
        return room if params.max_tokens is None else min(params.max_tokens, room)

    def stats(self) -> SchedulerStats:
        bm = self.block_manager
        sched = self.scheduler
        return SchedulerStats(len(sched.running), len(sched.waiting), bm.usage, bm.num_queried_tokens,
                              bm.num_hit_tokens, sched.num_preemptions, spec_draft_tokens=sched.num_draft_tokens,
                              spec_accepted_tokens=sched.num_accepted_tokens,
                              load_tokens=sum(r.num_tokens for r in sched.running)
                              + sum(r.num_tokens for r in sched.waiting))

    def abort(self, request_id: str) -> bool:
        """Removes a request and frees its blocks at once; False when it is unknown or finished."""
        req = self.scheduler.abort(request_id)
        self.runner.remove_request(request_id)
        return req is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[EngineCoreOutput]:
        if not self.scheduler.has_unfinished():
            return []
        sched = self.scheduler.schedule()
        if not sched.requests:
            return []
        sampled, logprobs = self.runner.execute(sched)
        by_id = {sched.requests[i].request_id: lps for i, lps in logprobs.items()}
        outputs = []
        num_draft = drafts_per_request(self.config.scheduler.speculative_ngram,
                                       self.config.scheduler.speculative_max_rows, len(self.scheduler.running))
        for req in self.scheduler.update_from_output(sched, sampled):
            finished = req.is_finished
            if finished:
                self.runner.remove_request(req.request_id)
            elif num_draft > 0 and req.can_speculate:
                room = req.max_tokens - req.num_output_tokens - 1  # the step's own token comes on top
                req.spec_token_ids = propose_ngram(req.all_token_ids, min(num_draft, room))
            prompt_logprobs = None
            new = req.num_step_tokens
            if req.params.prompt_logprobs is not None and req.num_output_tokens == new:
                prompt_logprobs = req.prompt_logprobs  # complete once the first token is out
            lps = by_id.get(req.request_id)
            outputs.append(EngineCoreOutput(
                req.request_id, req.output_token_ids[-new:], req.finish_reason if finished else None,
                req.stop_reason, max(req.num_cached_tokens, 0), lps[:new] if lps is not None else None,
                prompt_logprobs))
        return outputs
