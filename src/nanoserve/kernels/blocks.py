"""`BlockWeight`: a weight matrix held as blocks of 32 along its input dimension, 4-bit (`q4`: w = d * q
+ m, GGUF Q4_1's numbers) or 8-bit (`q8`: w = d * q, GGUF Q8_0's), with the PyTorch references for
making, undoing and multiplying them, and for the 8-bit activations the int8 products run on."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

BLOCK = 32  # weights per block, along K


@dataclass(eq=False)
class BlockWeight:
    """q4: quants (N, K/2) uint8 (byte j: weight j in the low nibble, weight j + 16 in the high one),
    scales and mins (N, K/32) float16. q8: quants (N, K) int8, scales (N, K/32) float16, no mins."""
    quants: torch.Tensor
    scales: torch.Tensor
    mins: Optional[torch.Tensor] = None

    def __post_init__(self):
        n, nb = self.scales.shape
        want = (torch.uint8, (n, nb * 16)) if self.mins is not None else (torch.int8, (n, nb * BLOCK))
        if (self.quants.dtype, tuple(self.quants.shape)) != want or self.scales.dtype != torch.float16:
            raise ValueError(f"inconsistent block weight: quants {self.quants.dtype} {tuple(self.quants.shape)}, "
                             f"scales {self.scales.dtype} {tuple(self.scales.shape)}")
        if self.mins is not None and (self.mins.shape != self.scales.shape or self.mins.dtype != torch.float16):
            raise ValueError("block weight mins must match its scales")
        self.c_struct = None  # the kernels' BlockWeight, built by the C backend on first use

    @property
    def kind(self) -> str:
        return "q4" if self.mins is not None else "q8"

    @property
    def shape(self) -> tuple[int, int]:
        return self.scales.shape[0], self.scales.shape[1] * BLOCK

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.quants, self.scales) if self.mins is None else (self.quants, self.scales, self.mins)

    def dequantize(self) -> torch.Tensor:
        """(N, K) float32."""
        n, nb = self.scales.shape
        d = self.scales.float().unsqueeze(-1)
        if self.mins is None:
            return (self.quants.reshape(n, nb, BLOCK).float() * d).reshape(n, nb * BLOCK)
        nibbles = self.quants.reshape(n, nb, 16)
        q = torch.cat([nibbles & 15, nibbles >> 4], dim=-1).float()  # (N, nb, 32)
        return (q * d + self.mins.float().unsqueeze(-1)).reshape(n, nb * BLOCK)


def quantize_q4(w: torch.Tensor) -> BlockWeight:
    """(N, K) float weights -> 4-bit blocks. Weights that came from a GGUF Q4_1 block (float16 d and m;
    a block uses both ends of its 0..15 range) come back exactly."""
    n, k = w.shape
    blocks = w.float().reshape(n, k // BLOCK, BLOCK)
    lo = blocks.amin(dim=-1).half().float()
    d = ((blocks.amax(dim=-1) - lo) / 15).half().float()
    q = torch.where(d.unsqueeze(-1) > 0, (blocks - lo.unsqueeze(-1)) / d.clamp(min=1e-30).unsqueeze(-1),
                    torch.zeros_like(blocks)).round_().clamp_(0, 15).to(torch.uint8)
    packed = q[..., :16] | (q[..., 16:] << 4)
    return BlockWeight(packed.reshape(n, k // 2).contiguous(), d.half().contiguous(), lo.half().contiguous())


def quantize_q8(w: torch.Tensor) -> BlockWeight:
    """(N, K) float weights -> 8-bit blocks. Exact for weights from a GGUF Q8_0 tensor."""
    n, k = w.shape
    blocks = w.float().reshape(n, k // BLOCK, BLOCK)
    d = (blocks.abs().amax(dim=-1) / 127).half().float()
    q = (blocks / d.clamp(min=1e-30).unsqueeze(-1)).round_().clamp_(-127, 127).to(torch.int8)
    return BlockWeight(q.reshape(n, k).contiguous(), d.half().contiguous())


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """x (M, K) as the int8 products see it, back in float32: per block of 32, q = round(x / (s * dx))
    in -127..127, with dx the row's largest |x| / (127 * 32767) and s the block's integer scale in
    1..32767 (kernels/int8_gemm.c). The product of this with the dequantized weight is the reference
    for `--activation-dtype int8`."""
    rows, width = x.shape
    blocks = x.float().reshape(rows, width // BLOCK, BLOCK)
    amax = blocks.abs().amax(-1)  # (M, nb)
    # An all-zero row keeps q = 0 (the tiny floor only avoids 0 / 0).
    dx = (amax.amax(-1, keepdim=True) / (127.0 * 32767.0)).clamp(min=torch.finfo(torch.float32).tiny)
    s = torch.ceil(amax / (127.0 * dx)).clamp(1, 32767)
    step = (s * dx).unsqueeze(-1)
    q = torch.round(blocks * (1.0 / step))
    return (q * step).reshape(rows, width)
