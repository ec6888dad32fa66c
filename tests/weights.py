"""Weights of every type for the tests: random blocks with valid scales in any GGUF block layout."""
import torch

from nanoserve.kernels.quant import FLOAT_TYPES, QuantWeight, from_float, random_blocks

def random_weight(qtype: str, rows: int, k: int, seed: int = 0) -> QuantWeight:
    """A (rows, k) weight of any type: random blocks, or a random float matrix converted."""
    if qtype in FLOAT_TYPES:
        g = torch.Generator().manual_seed(seed)
        return from_float(torch.randn(rows, k, generator=g) * 0.05, qtype)
    return random_blocks(qtype, rows, k, seed)
