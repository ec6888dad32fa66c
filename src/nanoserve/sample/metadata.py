"""`SamplingMetadata`: the per-batch tensors the sampler needs, built once per step from the rows'
`SamplingParams` (temperatures, which rows are greedy, per-request generators for seeded rows)."""
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
    # Row index -> that request's own generator; rows without one use the engine's generator.
    generators: dict[int, torch.Generator] = field(default_factory=dict)

    @classmethod
    def build(cls, params: list[SamplingParams], generators: dict[int, torch.Generator]) -> "SamplingMetadata":
        greedy = [p.greedy for p in params]
        if all(greedy):
            return cls(None, None, True)
        temperature = torch.tensor([1.0 if g else p.temperature for p, g in zip(params, greedy)],
                                   dtype=torch.float32)
        mask = torch.tensor(greedy) if any(greedy) else None
        return cls(temperature, mask, False, generators)
