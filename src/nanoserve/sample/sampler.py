"""`Sampler`: samples one token for every row of a batch in one chain of tensor operations, in vLLM's
order: allowed tokens -> min_tokens (EOS and stop tokens banned) and logit_bias -> repetition,
frequency and presence penalties -> greedy rows take the argmax; the others are scaled by their own
temperature, filtered by min_p, then by top-k and top-p (one sort for the whole batch, each row its
own thresholds), and drawn by the exponential race `argmax(p / q)`, `q ~ Exp(1)`, which picks token i
with probability p_i and lets seeded rows draw their noise from their own generator. Stages no row
uses are skipped."""
from __future__ import annotations

from typing import Optional

import torch

from nanoserve.sample.metadata import SamplingMetadata
from nanoserve.sample.penalties import PenaltyState, apply_penalties


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Masks tokens whose probability is below min_p times the row's top probability."""
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: Optional[torch.Tensor],
                      top_p: Optional[torch.Tensor]) -> torch.Tensor:
    """One ascending sort for the whole batch. top-k keeps tokens whose logit is at least the row's
    k-th largest (ties at the threshold are kept); top-p then drops the least likely tokens while the
    mass dropped stays at most 1 - p, always keeping the most likely one."""
    if top_k is None and top_p is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1)  # ascending
    vocab = logits.shape[-1]
    if top_k is not None:
        kth = sorted_logits.gather(1, (vocab - top_k).clamp(min=0).unsqueeze(1))  # (B, 1)
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop = cumulative <= (1.0 - top_p).unsqueeze(1)
        drop[:, -1] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_processors(logits: torch.Tensor, md: SamplingMetadata,
                     penalties: Optional[PenaltyState]) -> torch.Tensor:
    """The logits processors that also apply to greedy rows, in vLLM's order."""
    logits = logits.clone()
    if md.allowed_rows is not None:
        rows = logits[md.allowed_rows]
        logits[md.allowed_rows] = rows.masked_fill(~md.allowed_mask, float("-inf"))
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


class Sampler:
    def __init__(self, generator: Optional[torch.Generator] = None):
        self.generator = generator or torch.Generator().manual_seed(0)

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata,
                 penalties: Optional[PenaltyState] = None) -> torch.Tensor:
        """logits: (B, V) float32. Returns (B,) int64 token ids."""
        return self.sample(logits, md, penalties)[0]

    def sample(self, logits: torch.Tensor, md: SamplingMetadata, penalties: Optional[PenaltyState] = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns the sampled ids and the processed logits they were drawn from (greedy rows: after
        the processors, without temperature or truncation)."""
        if md.has_processors:
            logits = apply_processors(logits, md, penalties)
        if md.all_greedy:
            return logits.argmax(dim=-1), logits
        greedy = logits.argmax(dim=-1) if md.greedy_mask is not None else None
        processed = logits / md.temperature.unsqueeze(1)
        if md.min_p is not None:
            processed = apply_min_p(processed, md.min_p)
        processed = apply_top_k_top_p(processed, md.top_k, md.top_p)
        probs = torch.softmax(processed, dim=-1)
        sampled = (probs / self.exponential_noise(probs, md)).argmax(dim=-1)
        if greedy is not None:
            sampled = torch.where(md.greedy_mask, greedy, sampled)
            processed = torch.where(md.greedy_mask.unsqueeze(1), logits, processed)
        return sampled, processed

    def exponential_noise(self, probs: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        q = torch.empty_like(probs)
        if len(md.generators) < probs.shape[0]:
            q.exponential_(generator=self.generator)
        for row, gen in md.generators.items():  # seeded rows: their own stream, whatever the batch
            q[row].exponential_(generator=gen)
        # NOTE: exponential_ can return exactly 0 (about once per 2^24 draws); 0/0 would be NaN and
        # argmax picks NaN, i.e. a token of probability zero.
        return q.clamp_(min=torch.finfo(q.dtype).tiny)
