"""Building blocks of a Llama-family decoder: linear layers with float32 or bfloat16 weights, RMSNorm,
rotary embeddings (default, linear, llama3 scaling), and attention that writes to and reads from the
paged KV cache (float32 or float16) through block tables. Activations are float32, optionally
quantized to 8 bits right before a 4-bit weight's product (`Linear.int8_activations`)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve import kernels


class Linear(nn.Module):
    """y = x W^T (+ b) on float32 activations; the weight is stored in float32 or bfloat16, and may
    also carry a copy in 4-bit or 8-bit blocks (`blocks`, see `kernels.quantize_q4` / `quantize_q8`)
    and a oneDNN copy of a float32 weight (`onednn_weight`).

    With blocks, a step of up to 5 rows streams them through a kernel bound by memory (4-bit blocks are
    6x fewer bytes than float32), and a step of up to 64 rows through a small GEMM that dequantizes
    groups of weight rows into cache once (measured in a 32-request decode: 1.4x oneDNN's float32
    GEMM over all layers). Larger steps (prefill) use oneDNN's float32 GEMM on its own copy of the
    weight (1.4x PyTorch's default MKL call, 2x on the vocabulary matrix), else PyTorch's. On CPUs
    without native bfloat16 arithmetic (AVX2) the bfloat16 GEMM is several times slower than float32.

    `int8_activations` (4-bit blocks only) replaces all of these with integer dot products on x
    quantized to 8 bits per block of 32, as llama.cpp does: 1.2x faster at 32 rows and in prefill,
    ~0.5% error per product, and a row's result that does not depend on the step's other rows."""

    SMALL_STEP_ROWS = 4
    BLOCKS_MAX_ROWS = 5  # block_linear up to here (measured: the GEMM is as fast at 5 rows, faster from 6)
    BLOCK_GEMM_MAX_ROWS = 64  # block_gemm up to here

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.blocks: Optional[tuple[torch.Tensor, ...]] = None
        self.onednn_weight: Optional[torch.Tensor] = None
        # With 4-bit blocks: x quantized to 8 bits per block of 32 for every step (kernels/int8_gemm.c).
        self.int8_activations = False

    def attach_onednn_weight(self) -> None:
        """Adds the oneDNN copy of a float32 weight, where PyTorch was built with oneDNN."""
        if (self.weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()
                and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
            self.onednn_weight = self.weight.detach().to_mkldnn()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self.int8_activations and self.blocks is not None and len(self.blocks) == 3 and x.dim() == 2:
            y = kernels.q4_gemm_i8(kernels.load(), x, self.blocks)
            return y if self.bias is None else y + self.bias
        if self.blocks is not None and rows <= self.BLOCK_GEMM_MAX_ROWS:
            small = rows <= self.BLOCKS_MAX_ROWS
            y = (kernels.block_linear if small else kernels.block_gemm)(kernels.load(), x, self.blocks)
            return y if self.bias is None else y + self.bias
        if self.onednn_weight is not None and x.dim() == 2 and x.dtype == torch.float32:
            bias = None if self.bias is None else self.bias.detach()
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.onednn_weight, bias, "none", [], "")
        w = self.weight
        if w.dtype == x.dtype:
            return F.linear(x, w, self.bias)
        if rows <= self.SMALL_STEP_ROWS:
            y = F.linear(x.to(w.dtype), w).to(x.dtype)
        else:
            y = F.linear(x, w.to(x.dtype))
        return y if self.bias is None else y + self.bias


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One C call: 3x faster than PyTorch's composite op at 16 rows, 17x at 2048 (measured here).
        if x.dim() == 2 and x.dtype == torch.float32:
            lib = kernels.load()
            if lib is not None:
                return kernels.rms_norm(lib, x, self.weight, self.eps)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: Optional[dict]) -> torch.Tensor:
    """Inverse frequencies of the rotary embedding, with Hugging Face's `rope_scaling` rules."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling or scaling.get("rope_type", "default") == "default":
        return inv_freq
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_scaling type {kind!r}")


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin for every position, in Hugging Face's `rotate_half` convention (the two
    halves of each head are the pair that rotates). `lookup` runs once per step; `apply` per layer."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: Optional[dict]):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)  # (P, D)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, 1, D) cos and sin for the step's positions."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: (T, heads, D); q and k heads may be rotated together in one call."""
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin


@dataclass
class PrefillSeq:
    """One sequence computing `q_len` new tokens (starting at row `q_start` of the flat batch) on top
    of `ctx_len - q_len` tokens already in its KV blocks."""
    q_start: int
    q_len: int
    ctx_len: int
    slots: torch.Tensor  # (ctx_len,) KV-cache slot of every position 0..ctx_len-1
    mask: Optional[torch.Tensor]  # (q_len, ctx_len) bool, None when plain causal from position 0
    # (q_len,) context length of each row, when the rows attend as decodes of their own positions
    # through the decode kernel, reading keys and values from the cache: a token's attention is then
    # the same whether it was computed in a decode step, a prompt, a chunk or a recomputation after
    # preemption (the runner asks for it with int8 activations, which would amplify the last-bit
    # differences between the two paths).
    row_ctx_lens: Optional[torch.Tensor] = None


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step, built once by the model runner and shared by all
    layers. Rows of the flat batch are ordered: decode tokens first (one per sequence), then prefills."""
    positions: torch.Tensor  # (T,) position of every token
    slot_mapping: torch.Tensor  # (T,) KV-cache slot each token's K/V is written to
    num_decodes: int = 0
    decode_slots: Optional[torch.Tensor] = None  # (Bd, Tmax) cache slots of each decode's context
    decode_bias: Optional[torch.Tensor] = None  # (1, Bd, 1, Tmax) 0 / -inf padding mask
    decode_ctx_lens: Optional[torch.Tensor] = None  # (Bd,) context length of each decode
    kernel_lib: Any = None  # the compiled C kernels (decode attention, fused steps), when available
    prefills: list[PrefillSeq] = field(default_factory=list)
    rope_cos: Optional[torch.Tensor] = None  # (T, 1, D), filled by the model once per step
    rope_sin: Optional[torch.Tensor] = None


class KVCache:
    """One layer's paged keys and values, laid out (KVH, num_slots, D) so that gathering the slots of a
    batch of sequences yields (KVH, B, T, D), ready for batched matmuls without another copy. Stored as
    float32 or float16; attention always computes in float32."""

    def __init__(self, num_kv_heads: int, num_slots: int, head_dim: int, dtype: torch.dtype):
        self.k = torch.zeros(num_kv_heads, num_slots, head_dim, dtype=dtype)
        self.v = torch.zeros(num_kv_heads, num_slots, head_dim, dtype=dtype)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
                    meta: AttentionMetadata, scale: float, cached: bool = False) -> torch.Tensor:
    """q: (T, H, D); k, v: (T, KVH, D) for the new tokens. Writes k, v into the cache (unless `cached`:
    already written), then attends each token to its sequence's context. Returns (T, H * D)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    # NOTE: index_copy_/index_select on a flat index are several times faster than advanced indexing.
    if not cached:
        cache.k.index_copy_(1, meta.slot_mapping, k.transpose(0, 1).to(cache.k.dtype))
        cache.v.index_copy_(1, meta.slot_mapping, v.transpose(0, 1).to(cache.v.dtype))
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype)

    nd = meta.num_decodes
    if nd and meta.kernel_lib is not None and (cache.k.dtype == torch.float32 or head_dim % 8 == 0):
        out[:nd] = kernels.decode_attention(meta.kernel_lib, q[:nd], cache.k, cache.v,
                                            meta.decode_slots, meta.decode_ctx_lens, scale)
    elif nd:
        # (KVH, Bd, G, D): heads of one KV group are consecutive in HF's layout.
        qd = q[:nd].reshape(nd, num_kv_heads, group, head_dim).transpose(0, 1)
        shape = (num_kv_heads, nd, meta.decode_slots.shape[1], head_dim)
        flat = meta.decode_slots.view(-1)
        keys = torch.index_select(cache.k, 1, flat).view(shape).float()  # (KVH, Bd, Tmax, D)
        values = torch.index_select(cache.v, 1, flat).view(shape).float()
        scores = torch.matmul(qd, keys.transpose(-1, -2)).float() * scale  # (KVH, Bd, G, Tmax)
        probs = torch.softmax(scores + meta.decode_bias, dim=-1).to(values.dtype)
        out[:nd] = torch.matmul(probs, values).transpose(0, 1).reshape(nd, num_heads, head_dim)

    decode_kernel = meta.kernel_lib is not None and (cache.k.dtype == torch.float32 or head_dim % 8 == 0)
    for seq in meta.prefills:
        rows = slice(seq.q_start, seq.q_start + seq.q_len)
        if seq.row_ctx_lens is not None and decode_kernel:
            slots = seq.slots if seq.slots is not None else meta.slot_mapping[rows]  # positions 0..ctx_len-1
            out[rows] = kernels.decode_attention(meta.kernel_lib, q[rows], cache.k, cache.v,
                                                 slots.unsqueeze(0).expand(seq.q_len, -1), seq.row_ctx_lens, scale)
            continue
        qp = q[rows].transpose(0, 1).unsqueeze(0)  # (1, H, n, D)
        if seq.mask is None:  # a fresh prompt: its keys are exactly the new ones
            kp = k[rows].transpose(0, 1).unsqueeze(0)
            vp = v[rows].transpose(0, 1).unsqueeze(0)
        else:
            kp = torch.index_select(cache.k, 1, seq.slots).unsqueeze(0).float()  # (1, KVH, ctx, D)
            vp = torch.index_select(cache.v, 1, seq.slots).unsqueeze(0).float()
        o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=seq.mask, is_causal=seq.mask is None,
                                           scale=scale, enable_gqa=group > 1)
        out[rows] = o[0].transpose(0, 1)
    return out.view(num_tokens, num_heads * head_dim)
