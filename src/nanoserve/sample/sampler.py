"""`Sampler`: samples one token for every row of a batch in one chain of tensor operations. Greedy rows
take the argmax; the others are scaled by their own temperature and drawn by the exponential race
`argmax(p / q)`, `q ~ Exp(1)`, which picks token i with probability p_i and lets seeded rows draw their
noise from their own generator."""
from __future__ import annotations

from typing import Optional

import torch

from nanoserve.sample.metadata import SamplingMetadata


class Sampler:
    def __init__(self, generator: Optional[torch.Generator] = None):
        self.generator = generator or torch.Generator().manual_seed(0)

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """logits: (B, V) float32. Returns (B,) int64 token ids."""
        if md.all_greedy:
            return logits.argmax(dim=-1)
        probs = torch.softmax(logits / md.temperature.unsqueeze(1), dim=-1)
        sampled = (probs / self.exponential_noise(probs, md)).argmax(dim=-1)
        if md.greedy_mask is not None:
            sampled = torch.where(md.greedy_mask, logits.argmax(dim=-1), sampled)
        return sampled

    def exponential_noise(self, probs: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        q = torch.empty_like(probs)
        if len(md.generators) < probs.shape[0]:
            q.exponential_(generator=self.generator)
        for row, gen in md.generators.items():  # seeded rows: their own stream, whatever the batch
            q[row].exponential_(generator=gen)
        return q
