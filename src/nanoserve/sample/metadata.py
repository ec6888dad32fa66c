"""`SamplingMetadata`: the per-batch tensors the sampler needs, built once per step from the rows'
`SamplingParams`. Stages no row uses are left as None so that the sampler skips them."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from nanoserve.sampling_params import SamplingParams


@dataclass
class SamplingMetadata:
    temperature: Optional[torch.Tensor]  # (B,) float32; None when every row is greedy
    greedy_mask: Optional[torch.Tensor]  # (B,) bool; None when no row is greedy
    all_greedy: bool
    top_k: Optional[torch.Tensor] = None  # (B,) int64, vocab size where disabled; None if no row uses it
    top_p: Optional[torch.Tensor] = None  # (B,) float32, 1.0 where disabled
    min_p: Optional[torch.Tensor] = None  # (B,) float32, 0.0 where disabled
    # Row index -> that request's own generator; rows without one use the engine's generator.
    generators: dict[int, torch.Generator] = field(default_factory=dict)

    @classmethod
    def build(cls, params: list[SamplingParams], generators: dict[int, torch.Generator],
              vocab_size: int) -> "SamplingMetadata":
        greedy = [p.greedy for p in params]
        if all(greedy):
            return cls(None, None, True)
        temperature = torch.tensor([1.0 if g else p.temperature for p, g in zip(params, greedy)],
                                   dtype=torch.float32)
        mask = torch.tensor(greedy) if any(greedy) else None
        top_k = top_p = min_p = None
        if any(p.top_k > 0 for p in params):
            top_k = torch.tensor([min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params])
        if any(p.top_p < 1.0 for p in params):
            top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
        if any(p.min_p > 0.0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32)
        return cls(temperature, mask, False, top_k, top_p, min_p, generators)
