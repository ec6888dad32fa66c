"""Building blocks of a Llama-family decoder: linear layers and the token embedding on weights in their
file's form (kernels/quant.py), RMSNorm, rotary embeddings (default, linear, llama3 scaling), and
attention that writes to and reads from the paged KV cache (float32 or float16) through block tables.
Activations are float32, optionally quantized to 8 bits right before a product on a block-type weight
(`AttentionMetadata.int8_activations`)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.kernels.backend import TorchBackend
from nanoserve.kernels.quant import FLOAT_TYPES, QuantWeight, huge_page_buffer, stack_rows


class Linear(nn.Module):
    """y = x W^T (+ b) on float32 activations. W is held in its file's form as parts stacked along the
    output dimension (`parts`: one QuantWeight, or several for a fused q/k/v or gate/up projection whose
    matrices differ in type). The backend runs the product (kernels/backend.py); the PyTorch backend
    multiplies a float32 copy it makes at start (`dense`), the C backend the parts themselves."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.parts: list[QuantWeight] = []
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.dense: Optional[torch.Tensor] = None
        self.c_struct = None  # the C backend's chain of BlockWeight parts, built on first use

    def set_weight(self, parts: list[QuantWeight]) -> None:
        """Stacks `parts` (each (n_i, in_features)); neighbours of one type are joined into one part."""
        merged: list[QuantWeight] = []
        for p in parts:
            if p.k != self.in_features:
                raise ValueError(f"weight of {p.k} columns for a layer of {self.in_features} inputs")
            if merged and merged[-1].qtype == p.qtype:
                merged[-1] = QuantWeight(p.qtype, stack_rows([merged[-1].data, p.data]), p.k)
            else:
                merged.append(p)
        if sum(p.shape[0] for p in merged) != self.out_features:
            raise ValueError(f"weights of {sum(p.shape[0] for p in merged)} rows for a layer of "
                             f"{self.out_features} outputs")
        self.parts, self.dense, self.c_struct = merged, None, None

    @property
    def has_blocks(self) -> bool:
        """Whether some part is of a block type (the products int8 activations apply to)."""
        return any(p.qtype not in FLOAT_TYPES for p in self.parts)

    def forward(self, x: torch.Tensor, backend: TorchBackend, int8: bool = False) -> torch.Tensor:
        """int8: x quantized to 8 bits per block of 32 before the products on block-type parts."""
        y = backend.linear(x, self, int8)
        return y if self.bias is None else y + self.bias


class TokenEmbedding(nn.Module):
    """The vocabulary matrix in its file's form; a lookup dequantizes the rows of the step's tokens. A
    tied output projection multiplies the same QuantWeight."""

    def __init__(self):
        super().__init__()
        self.weight: Optional[QuantWeight] = None
        self.c_struct = None  # (weight, its struct) for the C kernels, built on first use

    def forward(self, ids: torch.Tensor, backend: TorchBackend) -> torch.Tensor:
        return backend.embedding(self, ids)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, backend: TorchBackend) -> torch.Tensor:
        return backend.rms_norm(x, self.weight, self.eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: Optional[dict]) -> torch.Tensor:
    """Inverse frequencies of the rotary embedding, with Hugging Face's `rope_scaling` rules."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling or scaling.get("rope_type", "default") == "default":
        return inv_freq
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "freq_factors":  # a GGUF's rope_freqs tensor (llama.cpp writes Llama 3's scaling so)
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
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
        """(T, D) cos and sin for the step's positions."""
        return self.cos[positions], self.sin[positions]


@dataclass
class PrefillSeq:
    """One sequence computing `q_len` new tokens (starting at row `q_start` of the flat batch) on top
    of `ctx_len - q_len` tokens already in its KV blocks."""
    q_start: int
    q_len: int
    ctx_len: int
    slots: torch.Tensor  # (ctx_len,) KV-cache slot of every position 0..ctx_len-1
    mask: Optional[torch.Tensor]  # (q_len, ctx_len) bool, None when plain causal from position 0
    # (q_len,) context length of each row, when the rows attend as decodes of their own positions,
    # reading keys and values from the cache (through the decode kernel on the C backend): a token's
    # attention is then the same whether it was computed in a decode step, a prompt, a chunk or a
    # recomputation after preemption (the runner asks for it with int8 activations, which would amplify
    # the last-bit differences between the two paths).
    row_ctx_lens: Optional[torch.Tensor] = None


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step, built once by the model runner and shared by all
    layers. Rows of the flat batch are ordered: decode tokens first (one per sequence), then prefills."""
    positions: torch.Tensor  # (T,) position of every token
    slot_mapping: torch.Tensor  # (T,) KV-cache slot each token's K/V is written to
    num_decodes: int = 0
    decode_slots: Optional[torch.Tensor] = None  # (Bd, Tmax) cache slots of each decode's context
    decode_ctx_lens: Optional[torch.Tensor] = None  # (Bd,) context length of each decode
    backend: TorchBackend = field(default_factory=TorchBackend)  # the engine's compute backend
    int8_activations: bool = False  # x quantized to 8 bits before every product on 4-bit blocks
    prefills: list[PrefillSeq] = field(default_factory=list)
    rope_cos: Optional[torch.Tensor] = None  # (T, D), filled by the model once per step
    rope_sin: Optional[torch.Tensor] = None


class KVCache:
    """One layer's paged keys and values, laid out (KVH, num_slots, D) so that gathering the slots of a
    batch of sequences yields (KVH, B, T, D), ready for batched matmuls without another copy. Stored as
    float32 or float16; attention always computes in float32."""

    def __init__(self, num_kv_heads: int, num_slots: int, head_dim: int, dtype: torch.dtype):
        # On 2 MiB pages: a sequence's blocks lie anywhere in the pool, and on 4 KiB pages nearly each
        # block (2 KiB a KV head) was another page walk (decode attention over a server-sized pool, 32 rows
        # of 130 positions: 1.107x as fast).
        shape, nbytes = (num_kv_heads, num_slots, head_dim), num_kv_heads * num_slots * head_dim * dtype.itemsize
        self.k = huge_page_buffer(nbytes).view(dtype).view(shape).zero_()
        self.v = huge_page_buffer(nbytes).view(dtype).view(shape).zero_()


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

    nd, backend = meta.num_decodes, meta.backend
    if nd:
        out[:nd] = backend.decode_attention(q[:nd], cache, meta.decode_slots, meta.decode_ctx_lens, scale)
    for seq in meta.prefills:
        rows = slice(seq.q_start, seq.q_start + seq.q_len)
        slots = seq.slots if seq.slots is not None else meta.slot_mapping[rows]  # positions 0..ctx_len-1
        if seq.row_ctx_lens is not None and backend.attends_prompts_as_decodes:
            out[rows] = backend.decode_attention(q[rows], cache, slots.unsqueeze(0).expand(seq.q_len, -1),
                                                 seq.row_ctx_lens, scale)
            continue
        qp = q[rows].transpose(0, 1).unsqueeze(0)  # (1, H, n, D)
        if seq.mask is None and seq.row_ctx_lens is None:  # a fresh prompt: its keys are exactly the new ones
            kp = k[rows].transpose(0, 1).unsqueeze(0)
            vp = v[rows].transpose(0, 1).unsqueeze(0)
        else:  # keys and values as the cache holds them (float16 included), as a decode reads them
            kp = torch.index_select(cache.k, 1, slots).unsqueeze(0).float()  # (1, KVH, ctx, D)
            vp = torch.index_select(cache.v, 1, slots).unsqueeze(0).float()
        o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=seq.mask, is_causal=seq.mask is None,
                                           scale=scale, enable_gqa=group > 1)
        out[rows] = o[0].transpose(0, 1)
    return out.view(num_tokens, num_heads * head_dim)
