"""`ModelRunner`: owns the model and its paged KV tensors; turns a `SchedulerOutput` into flat input
tensors and attention metadata, runs the forward pass and the sampler, and returns the sampled tokens
of each request that reached the end of its known tokens (one, or one per row of a decode with drafts)."""
from __future__ import annotations

import torch

from nanoserve.config import ACTIVATION_DTYPES, KV_CACHE_DTYPES, ModelConfig
from nanoserve.engine.request import Request
from nanoserve.engine.scheduler import SchedulerOutput
from nanoserve.kernels.backend import TorchBackend
from nanoserve.model.layers import AttentionMetadata, KVCache, Linear, PrefillSeq
from nanoserve.model.llama import LlamaForCausalLM
from nanoserve.sample.metadata import GrammarMasks, SamplingMetadata, allowed_token_mask
from nanoserve.protocol import TokenLogprobs
from nanoserve.sample.penalties import PenaltyState
from nanoserve.sample.sampler import Sampler


KV_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16}


def kv_cache_dtype(name: str, cfg: ModelConfig) -> torch.dtype:
    """"auto" is float16 where head_dim is a multiple of 8 (the C attention kernel reads such a cache
    directly): half the memory and half the bytes per decode step, with logits within a KL of ~1e-7 of a
    float32 cache's on the default model (docs/benchmarks.md). Otherwise float32. The same on every
    backend."""
    if name == "auto":
        return torch.float16 if cfg.head_dim % 8 == 0 else torch.float32
    if name not in KV_TORCH_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {name!r}")
    return KV_TORCH_DTYPES[name]



def use_int8_activations(name: str, model: LlamaForCausalLM) -> bool:
    """Whether products on block-type weights (GGUF Q4_K, Q8_0, ...) run on activations quantized to 8
    bits: "auto" does for a model with such weights (as llama.cpp does; float-type matrices always
    multiply float32 activations), on every backend; "int8" must find some or raises `ValueError`;
    "float32" never does."""
    if name not in ACTIVATION_DTYPES:
        raise ValueError(f"activation_dtype must be one of {list(ACTIVATION_DTYPES)}, got {name!r}")
    has_blocks = any(layer.has_blocks for layer in model.linears())
    if name == "int8" and not has_blocks:
        raise ValueError("--activation-dtype int8: this model's matrices are all float (F32/F16/BF16), and int8 "
                         "activations run only before products on quantized blocks; quantize it on load "
                         "(--quantization q8_0, ...), or use float32 or auto")
    return name != "float32" and has_blocks


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype = torch.float32) -> int:
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * block_size * dtype.itemsize


def gather_logprobs(logits: torch.Tensor, chosen: torch.Tensor, num_top: list[int]) -> list[TokenLogprobs]:
    """For each row of `logits` (L, V): the logprob and rank of its `chosen` token and its top-N
    alternatives, in one batched pass."""
    logprobs = torch.log_softmax(logits, dim=-1)  # (L, V)
    chosen_lp = logprobs.gather(1, chosen.unsqueeze(1))  # (L, 1)
    ranks = ((logprobs > chosen_lp).sum(dim=-1) + 1).tolist()
    top_values, top_ids = logprobs.topk(max(num_top), dim=-1)
    chosen_lp, top_values, top_ids = chosen_lp.squeeze(1).tolist(), top_values.tolist(), top_ids.tolist()
    return [TokenLogprobs(chosen_lp[j], ranks[j], top_ids[j][:n], top_values[j][:n])
            for j, n in enumerate(num_top)]


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int, backend: TorchBackend,
                 seed: int = 0, logprobs_mode: str = "raw", kv_dtype: torch.dtype = torch.float32,
                 int8_activations: bool = False):
        if logprobs_mode not in ("raw", "processed"):
            raise ValueError(f"logprobs_mode must be 'raw' or 'processed', got {logprobs_mode!r}")
        self.logprobs_mode = logprobs_mode
        self.model = model
        self.backend = backend
        self.widened_bytes = backend.prepare(model)  # float32 copies the backend made (PyTorch only)
        self.int8_activations = int8_activations
        self.config = model.config
        self.block_size = block_size
        cfg = self.config
        self.kv_caches = [KVCache(cfg.num_kv_heads, num_blocks * block_size, cfg.head_dim, kv_dtype)
                          for _ in range(cfg.num_layers)]
        self.sampler = Sampler(backend, torch.Generator().manual_seed(seed))
        self.penalties = PenaltyState(cfg.vocab_size)
        self.allowed_masks: dict[str, torch.Tensor] = {}  # request id -> packed mask, built once
        self.grammar_masks: GrammarMasks | None = None  # with the first structured-outputs row

    def run_model(self, input_ids: torch.Tensor, meta: AttentionMetadata, logits_rows: torch.Tensor) -> torch.Tensor:
        """The model's forward on this runner's KV cache."""
        return self.model(input_ids, meta, self.kv_caches, logits_rows)

    def remove_request(self, request_id: str) -> None:
        self.allowed_masks.pop(request_id, None)
        self.penalties.remove(request_id)

    def _allowed_mask(self, req: Request) -> torch.Tensor:
        mask = self.allowed_masks.get(req.request_id)
        if mask is None:
            mask = self.allowed_masks[req.request_id] = allowed_token_mask(req.params, self.config.vocab_size)
        return mask

    def _slots(self, req: Request, start: int, end: int) -> list[int]:
        bs, table = self.block_size, req.block_ids
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def prepare(self, sched: SchedulerOutput):
        """Flat input ids, attention metadata and the rows whose logits we need. A decode's drafts
        (`spec_token_ids`) are extra decode rows after its last token, each attending to the positions
        before it: a draft's row is computed as the decode of that position would be."""
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        logits_rows: list[int] = []
        sample_reqs: list[int] = []  # index into sched.requests of each logits row
        # Prompt logprobs: (request index, flat rows, prompt positions they predict).
        prompt_rows: list[tuple[int, list[int], list[int]]] = []
        num_decode_reqs = 0  # decodes come first: one token to compute, and the drafts scheduled after it
        while num_decode_reqs < len(sched) and \
                sched.num_new_tokens[num_decode_reqs] == 1 + len(sched.requests[num_decode_reqs].spec_token_ids):
            num_decode_reqs += 1
        decode_rows: list[tuple[Request, int]] = []  # (request, context length) of each decode row
        prefills: list[PrefillSeq] = []
        for i, (req, n) in enumerate(zip(sched.requests, sched.num_new_tokens)):
            start = req.num_computed_tokens
            end = start + n
            q_start = len(input_ids)
            input_ids.extend(req.all_token_ids[start:end])
            drafts = req.spec_token_ids if i < num_decode_reqs else ()
            input_ids.extend(drafts)
            positions.extend(range(start, end))
            slot_mapping.extend(self._slots(req, start, end))
            if i < num_decode_reqs:
                decode_rows.extend((req, start + 1 + j) for j in range(n))
            if end == req.num_tokens + len(drafts):
                first = q_start + n - 1 - len(drafts)
                logits_rows.extend(range(first, q_start + n))
                sample_reqs.extend([i] * (1 + len(drafts)))
            if req.params.prompt_logprobs is not None:
                # Position p predicts prompt token p + 1; skip what an earlier run already gave.
                first = max(start, len(req.prompt_logprobs))
                last = min(end, req.num_prompt_tokens - 1)
                if first < last:
                    prompt_rows.append((i, [q_start + p - start for p in range(first, last)],
                                        list(range(first + 1, last + 1))))
            if i >= num_decode_reqs:
                if start == 0:
                    prefills.append(PrefillSeq(q_start, n, end, None, None))
                else:
                    # Query row r sits at position start + r and sees keys 0..start + r.
                    mask = torch.arange(end).unsqueeze(0) <= torch.arange(start, end).unsqueeze(1)
                    slots = torch.tensor(self._slots(req, 0, end), dtype=torch.long)
                    prefills.append(PrefillSeq(q_start, n, end, slots, mask))
                if self.int8_activations:  # rows attend as decodes of their positions (see PrefillSeq)
                    prefills[-1].row_ctx_lens = torch.arange(start + 1, end + 1)
        meta = AttentionMetadata(positions=torch.tensor(positions, dtype=torch.long),
                                 slot_mapping=torch.tensor(slot_mapping, dtype=torch.long),
                                 num_decodes=len(decode_rows), prefills=prefills, backend=self.backend,
                                 int8_activations=self.int8_activations)
        if decode_rows:
            self._decode_metadata(decode_rows, meta)
        return (torch.tensor(input_ids, dtype=torch.long), meta,
                torch.tensor(logits_rows, dtype=torch.long), sample_reqs, prompt_rows)

    def _decode_metadata(self, rows: list[tuple[Request, int]], meta: AttentionMetadata) -> None:
        """Cache slots of every decode row's context, padded to the longest, and the context lengths."""
        bs = self.block_size
        lens = [ctx_len for _, ctx_len in rows]
        max_ctx = max(lens)
        max_blocks = -(-max_ctx // bs)
        # each row's block table padded with block 0, then each block's bs slots (32 rows of ~900
        # positions: 160 us; indexing the table by position took 410)
        table = torch.tensor([(r.block_ids + [0] * max_blocks)[:max_blocks] for r, _ in rows], dtype=torch.long)
        slots = (table.unsqueeze(2) * bs + torch.arange(bs)).view(len(rows), -1)
        meta.decode_slots = slots if slots.shape[1] == max_ctx else slots[:, :max_ctx].contiguous()  # (Bd, Tmax)
        meta.decode_ctx_lens = torch.tensor(lens, dtype=torch.long)

    def execute(self, sched: SchedulerOutput) -> tuple[list, dict[int, list[TokenLogprobs]]]:
        """Runs one step; returns the sampled token of each scheduled request (a list of one per row for
        a decode with drafts; None for chunks that did not reach the end of the prompt) and, by request
        index, the logprobs of each of its rows where asked for."""
        input_ids, meta, logits_rows, sample_reqs, prompt_rows = self.prepare(sched)
        sampled: list = [None] * len(sched)
        num_sample = len(logits_rows)
        if prompt_rows:
            extra = [r for _, rows, _ in prompt_rows for r in rows]
            logits_rows = torch.cat([logits_rows, torch.tensor(extra, dtype=torch.long)])
        logits = self.run_model(input_ids, meta, logits_rows)
        if prompt_rows:
            self._prompt_logprobs(sched, logits[num_sample:], prompt_rows)
            logits = logits[:num_sample]
        if not sample_reqs:  # prefill chunks only: nothing to sample yet
            return sampled, {}
        reqs = [sched.requests[i] for i in sample_reqs]
        # Each row's tokens so far: a draft row's include the drafts before it (its position, for seeded
        # noise, min_tokens and bad words, is the one a plain decode of that token would have).
        outputs, draft_index = [], {}
        for row, (i, r) in enumerate(zip(sample_reqs, reqs)):
            j = draft_index[i] = draft_index.get(i, -1) + 1
            outputs.append(r.output_token_ids + r.spec_token_ids[:j] if j else r.output_token_ids)
        penalty_rows = {row: self.penalties.row(r.request_id, r.prompt_token_ids, r.output_token_ids)
                        for row, r in enumerate(reqs) if r.params.has_penalties}
        allowed = {row: self._allowed_mask(r) for row, r in enumerate(reqs) if r.params.allowed_token_ids}
        grammar_rows = [row for row, r in enumerate(reqs) if r.grammar is not None and r.grammar.active]
        if grammar_rows:
            if self.grammar_masks is None:
                self.grammar_masks = GrammarMasks(self.config.vocab_size)
            for row, mask in zip(grammar_rows, self.grammar_masks([reqs[row].grammar.matcher for row in grammar_rows])):
                allowed[row] = mask & allowed[row] if row in allowed else mask
        want = [row for row, r in enumerate(reqs) if r.params.logprobs is not None]
        md = SamplingMetadata.build([r.params for r in reqs], self.config.vocab_size,
                                    eos_token_ids=self.config.eos_token_ids, penalty_state_rows=penalty_rows,
                                    output_token_ids=outputs, allowed_masks=allowed,
                                    grammar_rows=frozenset(grammar_rows))
        md.need_processed = bool(want) and self.logprobs_mode == "processed"
        tokens, processed = self.sampler.sample(logits, md, self.penalties)
        if md.penalty_rows is not None:
            self.penalties.record(md.penalty_state_rows, tokens[md.penalty_rows])
        for i, token in zip(sample_reqs, tokens.tolist()):
            if sched.requests[i].spec_token_ids:
                sampled[i] = (sampled[i] or []) + [token]
            else:
                sampled[i] = token
        if not want:
            return sampled, {}
        source = logits if self.logprobs_mode == "raw" else processed
        index = torch.tensor(want)
        found = gather_logprobs(source[index], tokens[index], [reqs[row].params.logprobs for row in want])
        by_request: dict[int, list[TokenLogprobs]] = {}
        for row, lp in zip(want, found):
            by_request.setdefault(sample_reqs[row], []).append(lp)
        return sampled, by_request

    def _prompt_logprobs(self, sched: SchedulerOutput, logits: torch.Tensor,
                         prompt_rows: list[tuple[int, list[int], list[int]]]) -> None:
        """Appends to each request the raw logprobs of the prompt tokens this step's rows predict."""
        chosen, num_top = [], []
        for i, _, positions in prompt_rows:
            req = sched.requests[i]
            chosen += [req.prompt_token_ids[p] for p in positions]
            num_top += [req.params.prompt_logprobs] * len(positions)
        found = iter(gather_logprobs(logits, torch.tensor(chosen, dtype=torch.long), num_top))
        for i, _, positions in prompt_rows:
            sched.requests[i].prompt_logprobs.extend(next(found) for _ in positions)
