"""`Sampler`: samples one token for every row of a batch in one chain of tensor operations, in vLLM's
order: allowed tokens -> min_tokens (EOS and stop tokens banned) and logit_bias -> repetition,
frequency and presence penalties -> greedy rows take the argmax; the others are scaled by their own
temperature, filtered by min_p, then by top-k and top-p (one sort for the whole batch, each row its
own thresholds), and drawn by the exponential race `argmax(p / q)`, `q ~ Exp(1)`, which picks token i
with probability p_i. The noise is a counter-based hash of the row's key and the token id; a seeded
row's key comes from (seed, output position), so its draws never depend on the batch. The chain runs
in one C call (kernels/sampling.c) on the C backend, else as the PyTorch code below."""
from __future__ import annotations

from typing import Optional

import torch

from nanoserve.kernels.backend import TorchBackend
from nanoserve.sample.metadata import SamplingMetadata, small_tensor, unpack_bits
from nanoserve.sample.penalties import PenaltyState, apply_penalties


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Masks tokens whose probability is below min_p times the row's top probability."""
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


TOP_CANDIDATES = 1024  # top-k/top-p look at this many best tokens per row before any full sort


def apply_top_k_top_p(logits: torch.Tensor, top_k: Optional[torch.Tensor],
                      top_p: Optional[torch.Tensor]) -> torch.Tensor:
    """top-k keeps tokens whose logit is at least the row's k-th largest; top-p then keeps each token
    while the probability of the tokens ranked above it is below p (so at least the best one).
    Returns the whole (B, V) logits with dropped tokens at -inf; rows using neither are untouched."""
    if top_k is None and top_p is None:
        return logits
    batch, vocab = logits.shape
    k = top_k if top_k is not None else torch.full((batch,), vocab)
    p = top_p if top_p is not None else torch.ones(batch)
    rows = ((k < vocab) | (p < 1.0)).nonzero().squeeze(1)
    if rows.numel() == 0:
        return logits
    out = logits.clone()
    values, order, full = top_k_top_p_candidates(logits[rows], k[rows], p[rows])
    out[rows[~full]] = scatter_candidates(values[~full], order[~full], vocab)
    out[rows[full]] = truncate_full(logits[rows[full]], k[rows[full]], p[rows[full]])
    return out


def top_k_top_p_candidates(sub: torch.Tensor, k: torch.Tensor, p: torch.Tensor):
    """Filters rows by top-k and top-p looking only at each row's best TOP_CANDIDATES tokens (one
    `topk` for the batch instead of a full sort). Returns the candidates' filtered logits (-inf where
    dropped), their token ids, and which rows need the full vocabulary to be exact: the candidates hold
    less than p of the mass, or a tie at the k-th value spans the candidate boundary."""
    vocab = sub.shape[-1]
    cand = min(vocab, max(TOP_CANDIDATES, int(k[k < vocab].max()) if bool((k < vocab).any()) else 0))
    values, order, needs_full = _truncate_sorted(sub, k, p, cand)
    return values, order, needs_full


def truncate_full(sub: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The exact filter over the whole vocabulary (one full sort), as (B, V) logits."""
    vocab = sub.shape[-1]
    values, order, _ = _truncate_sorted(sub, k, p, vocab)
    return scatter_candidates(values, order, vocab)


def scatter_candidates(values: torch.Tensor, order: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.full((values.shape[0], vocab), float("-inf")).scatter_(1, order, values)


def _truncate_sorted(sub: torch.Tensor, k: torch.Tensor, p: torch.Tensor, cand: int):
    vocab = sub.shape[-1]
    values, order = sub.topk(cand, dim=-1)  # descending
    k_on = k < vocab
    kth = values.gather(1, (k - 1).clamp(max=cand - 1).unsqueeze(1))
    kth = torch.where(k_on.unsqueeze(1), kth, torch.full_like(kth, float("-inf")))
    # Normaliser over the whole row after top-k (ties at the k-th value are kept).
    lse = torch.logsumexp(sub.masked_fill(sub < kth, float("-inf")), dim=-1, keepdim=True)
    values = values.masked_fill(values < kth, float("-inf"))
    probs = torch.exp(values - lse)
    above = probs.cumsum(dim=-1) - probs
    keep = (above < p.unsqueeze(1)) & (values > float("-inf"))
    keep[:, 0] = True
    needs_full = torch.zeros(sub.shape[0], dtype=torch.bool)
    if cand < vocab:
        tie_beyond = k_on & (values[:, -1] >= kth.squeeze(1))
        # Without top-k the tokens past the candidates are live; they matter if the candidates hold < p.
        mass_beyond = ~k_on & (probs.sum(dim=-1) < p)
        needs_full = tie_beyond | mass_beyond
    return values.masked_fill(~keep, float("-inf")), order, needs_full


def apply_processors(logits: torch.Tensor, md: SamplingMetadata,
                     penalties: Optional[PenaltyState]) -> torch.Tensor:
    """The logits processors that also apply to greedy rows, in vLLM's order."""
    logits = logits.clone()
    if md.allowed_rows is not None:
        rows = logits[md.allowed_rows]
        logits[md.allowed_rows] = rows.masked_fill(~unpack_bits(md.allowed_mask, logits.shape[1]), float("-inf"))
    if md.banned is not None:
        logits[md.banned] = float("-inf")
    if md.bias is not None:
        rows, tokens, values = md.bias
        logits.index_put_((rows, tokens), values, accumulate=True)
    if md.penalty_rows is not None:
        state_rows = md.penalty_state_rows
        logits[md.penalty_rows] = apply_penalties(
            logits[md.penalty_rows], penalties.prompt_mask[state_rows], penalties.output_counts[state_rows],
            md.repetition, md.frequency, md.presence)
    return logits


MASK32 = 0xFFFFFFFF
MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def noise_keys(seeds: list[Optional[int]], positions: list[int], generator: torch.Generator) -> torch.Tensor:
    """(B, 2) int64 keys (two 32-bit halves) of each row's noise for this step: from (seed, output
    position) for a seeded row, so it draws the same numbers alone, in any batch, at any row and after
    a preemption; from the engine's generator otherwise."""
    keys = torch.randint(0, 1 << 32, (len(seeds), 2), generator=generator, dtype=torch.int64)
    rows, seeded = [], []
    for row, (seed, position) in enumerate(zip(seeds, positions)):
        if seed is not None:
            key = _splitmix64((seed & MASK64) ^ _splitmix64(position))
            rows.append(row)
            seeded += (key & MASK32, key >> 32)
    if rows:  # one scatter for all seeded rows
        keys[rows] = small_tensor(seeded, torch.int64).view(-1, 2)
    return keys


def _mix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & MASK32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & MASK32
    return h ^ (h >> 16)


def noise_uniform(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """U(0, 1) with 23 random bits (never 0 or 1) for each (row key, token id): the numbers the C
    kernel draws. keys (R, 2) int64, token_ids (R, W) int64 -> (R, W) float32."""
    h = _mix32(((token_ids * 0x9E3779B9) + keys[:, :1]) & MASK32)
    h = _mix32(h ^ keys[:, 1:])
    return ((h >> 9).to(torch.float32) + 0.5) / 8388608.0


def race(x: torch.Tensor, keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """The exponential race in log space: argmax(x - log q), q = -log(U), for logits x (R, W) whose
    columns are the tokens `token_ids`; returns column indices (R,)."""
    q = noise_uniform(keys, token_ids).log_().neg_()
    return (x - q.log_()).argmax(dim=-1)


def _offsets(rows: torch.Tensor, batch: int) -> torch.Tensor:
    out = torch.zeros(batch + 1, dtype=torch.int64)
    out[1:] = torch.bincount(rows, minlength=batch).cumsum(0)
    return out


# Rows from which an all-greedy batch takes the sampler kernel's argmax (rows in parallel, vectorized; the
# same first index of the maximum) rather than torch.argmax (one thread, ~25 us per 49k-token row). The
# kernel's arguments cost ~70 us: measured on 49152 tokens, 1 row 73 vs 43 us, 2 rows 78 vs 88, 8 rows
# 127 vs 316, 32 rows 166 vs 801.
GREEDY_KERNEL_MIN_ROWS = 2


class Sampler:
    def __init__(self, backend: TorchBackend, generator: Optional[torch.Generator] = None):
        self.generator = generator or torch.Generator().manual_seed(0)
        self.backend = backend

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata,
                 penalties: Optional[PenaltyState] = None) -> torch.Tensor:
        """logits: (B, V) float32. Returns (B,) int64 token ids."""
        return self.sample(logits, md, penalties)[0]

    def sample(self, logits: torch.Tensor, md: SamplingMetadata, penalties: Optional[PenaltyState] = None
               ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Returns the sampled ids and, when `md.need_processed`, the processed logits they were drawn
        from (greedy rows: after the processors, without temperature or truncation)."""
        if md.all_greedy and not md.has_processors:
            if self.backend.has_sampler_kernel and logits.shape[0] >= GREEDY_KERNEL_MIN_ROWS:
                return self._sample_kernel(logits.contiguous(), md, penalties, None)[0], logits
            return logits.argmax(dim=-1), logits
        keys = None if md.all_greedy else noise_keys(md.seeds, md.positions, self.generator)
        if self.backend.has_sampler_kernel:
            return self._sample_kernel(logits.contiguous(), md, penalties, keys)
        if md.has_processors:
            logits = apply_processors(logits, md, penalties)
        if md.all_greedy:
            return logits.argmax(dim=-1), logits
        return self._sample_torch(logits, md, keys)

    def _sample_kernel(self, logits, md, penalties, keys):
        batch, vocab = logits.shape
        # The processed logits are written out only when the caller wants them (logprobs_mode processed).
        work = torch.empty_like(logits) if md.need_processed else torch.empty(1)
        tokens = torch.empty(batch, dtype=torch.int64)
        none = torch.full((batch,), -1, dtype=torch.int64)
        temperature = torch.zeros(batch) if md.all_greedy else md.temperature.clone()
        if md.greedy_mask is not None:
            temperature[md.greedy_mask] = 0.0
        top_k = md.top_k if md.top_k is not None else torch.full((batch,), vocab)
        top_p = md.top_p if md.top_p is not None else torch.ones(batch)
        min_p = md.min_p if md.min_p is not None else torch.zeros(batch)
        allowed, allowed_row = torch.zeros(1, 1, dtype=torch.int32), none
        if md.allowed_rows is not None:
            allowed, allowed_row = md.allowed_mask.contiguous(), none.clone()
            allowed_row[md.allowed_rows] = torch.arange(len(md.allowed_rows))
        empty_i, empty_f = torch.zeros(1, dtype=torch.int64), torch.zeros(1)
        ban_tokens, ban_offsets = empty_i, torch.zeros(batch + 1, dtype=torch.int64)
        if md.banned is not None:
            ban_tokens, ban_offsets = md.banned[1], _offsets(md.banned[0], batch)
        bias_tokens, bias_values, bias_offsets = empty_i, empty_f, torch.zeros(batch + 1, dtype=torch.int64)
        if md.bias is not None:
            bias_tokens, bias_values, bias_offsets = md.bias[1], md.bias[2], _offsets(md.bias[0], batch)
        seen, num_seen = torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, dtype=torch.int64)
        counts = torch.zeros(1, 1, dtype=torch.int32)
        penalty_row, rep, freq, pres = none, torch.ones(batch), torch.zeros(batch), torch.zeros(batch)
        if md.penalty_rows is not None:
            seen, num_seen, counts = penalties.seen_tokens, penalties.num_seen, penalties.output_counts
            penalty_row = none.clone()
            penalty_row[md.penalty_rows] = md.penalty_state_rows
            rep[md.penalty_rows] = md.repetition
            freq[md.penalty_rows] = md.frequency
            pres[md.penalty_rows] = md.presence
        keys = keys if keys is not None else torch.zeros(batch, 2, dtype=torch.int64)
        self.backend.sample_rows(
            logits, work, tokens, temperature=temperature, min_p=min_p, top_k=top_k.to(torch.int64), top_p=top_p,
            keys=keys, allowed=allowed, allowed_row=allowed_row, ban_offsets=ban_offsets, ban_tokens=ban_tokens,
            bias_offsets=bias_offsets, bias_tokens=bias_tokens, bias_values=bias_values, seen_tokens=seen,
            num_seen=num_seen, output_counts=counts, penalty_row=penalty_row, repetition=rep, frequency=freq,
            presence=pres, write_work=md.need_processed)
        return tokens, work if md.need_processed else None

    def _sample_torch(self, logits, md, keys):
        batch, vocab = logits.shape
        rows = md.sample_rows if md.sample_rows is not None else torch.arange(batch)
        tokens = torch.empty(batch, dtype=torch.long)
        if md.greedy_mask is not None:
            greedy = md.greedy_mask.nonzero().squeeze(1)
            tokens[greedy] = logits.index_select(0, greedy).argmax(dim=-1)
        x = logits.index_select(0, rows) if md.sample_rows is not None else logits.clone()
        x.div_(md.temperature[rows].unsqueeze(1))
        if md.min_p is not None:
            on = (md.min_p[rows] > 0).nonzero().squeeze(1)
            x[on] = apply_min_p(x[on], md.min_p[rows][on])
        processed = logits.clone() if md.need_processed else None
        # Rows without top-k/top-p race over the whole vocabulary; the others over their candidates only.
        whole = torch.ones(len(rows), dtype=torch.bool)
        if md.truncated is not None:
            t = md.truncated
            k = md.top_k[rows[t]] if md.top_k is not None else torch.full((len(t),), vocab)
            p = md.top_p[rows[t]] if md.top_p is not None else torch.ones(len(t))
            values, order, full = top_k_top_p_candidates(x[t], k, p)
            ok = (~full).nonzero().squeeze(1)
            if ok.numel():
                won = race(values[ok], keys[rows[t[ok]]], order[ok])
                tokens[rows[t[ok]]] = order[ok].gather(1, won.unsqueeze(1)).squeeze(1)
                if processed is not None:
                    processed[rows[t[ok]]] = scatter_candidates(values[ok], order[ok], vocab)
            whole[t[ok]] = False
            redo = t[full]
            if redo.numel():
                x[redo] = truncate_full(x[redo], k[full], p[full])
        whole = whole.nonzero().squeeze(1)
        if whole.numel():
            ids = torch.arange(vocab).expand(len(whole), vocab)
            tokens[rows[whole]] = race(x[whole], keys[rows[whole]], ids)
            if processed is not None:
                processed[rows[whole]] = x[whole]
        return tokens, processed
