"""Weights of every type for the tests: random blocks with valid scales in any GGUF block layout."""
import numpy as np
import torch

from nanoserve.kernels.quant import FLOAT_TYPES, GGML_TYPES, QuantWeight, from_float

# Byte offsets of the float16 scales in each block type (the rest of a block is codes, any bytes valid).
F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "IQ4_NL": (0,),
              "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(qtype: str, rows: int, k: int, seed: int = 0) -> QuantWeight:
    """Random codes and scales in `qtype`'s layout: (rows, k) weights of ordinary magnitudes."""
    rng = np.random.default_rng(seed)
    _, block, nbytes = GGML_TYPES[qtype]
    data = rng.integers(0, 256, size=(rows, k // block, nbytes), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        scale = (rng.standard_normal((rows, k // block)) * 0.01).astype(np.float16)
        data[:, :, off:off + 2] = scale.view(np.uint8).reshape(rows, k // block, 2)
    if qtype == "Q8_0":  # -128 is not a code Q8_0 writes
        data[:, :, 2:] = np.clip(data[:, :, 2:].view(np.int8), -127, 127).view(np.uint8)
    return QuantWeight(qtype, torch.from_numpy(data.reshape(rows, -1)), k)


def random_weight(qtype: str, rows: int, k: int, seed: int = 0) -> QuantWeight:
    """A (rows, k) weight of any type: random blocks, or a random float matrix converted."""
    if qtype in FLOAT_TYPES:
        g = torch.Generator().manual_seed(seed)
        return from_float(torch.randn(rows, k, generator=g) * 0.05, qtype)
    return random_blocks(qtype, rows, k, seed)
