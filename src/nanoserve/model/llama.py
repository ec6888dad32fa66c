"""Our forward pass for Llama-family decoders (Llama, Qwen2 with q/k/v bias, Qwen3 with q/k RMSNorm):
a flat batch of tokens from many sequences in, hidden states of the positions to sample out."""
from __future__ import annotations

import torch
from torch import nn

from nanoserve.config import ModelConfig
from nanoserve.kernels.backend import rotate
from nanoserve.kernels.quant import QuantWeight
from nanoserve.model.layers import (AttentionMetadata, KVCache, Linear, RMSNorm, RotaryEmbedding, TokenEmbedding,
                                   paged_attention)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        # q, k and v projections fused into one matmul.
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.scale = cfg.head_dim ** -0.5

    def forward(self, x: torch.Tensor, cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        n, backend, int8 = x.shape[0], meta.backend, meta.int8_activations
        qkv = self.qkv_proj(x, backend, int8)
        if not self.qk_norm:
            # One pass: rotary on q and k in place, k and v written to the cache.
            backend.rope_write_kv(qkv, self.num_heads, self.num_kv_heads, self.head_dim, meta.rope_cos,
                                  meta.rope_sin, cache, meta.slot_mapping)
            q, k, v = (t.view(n, -1, self.head_dim)
                       for t in qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1))
            return self.o_proj(paged_attention(q, k, v, cache, meta, self.scale, cached=True), backend, int8)
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = qk.reshape(n, self.num_heads + self.num_kv_heads, self.head_dim)
        qk = torch.cat([self.q_norm(qk[:, :self.num_heads], backend), self.k_norm(qk[:, self.num_heads:], backend)], 1)
        qk = rotate(qk, meta.rope_cos, meta.rope_sin)  # q and k heads rotated together
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        return self.o_proj(paged_attention(q, k, v, cache, meta, self.scale), backend, int8)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        backend, int8 = meta.backend, meta.int8_activations
        return self.down_proj(backend.silu_mul(self.gate_up_proj(x, backend, int8)), backend, int8)


class DecoderLayer(nn.Module):
    """A decode-only step may instead run the whole layer as one kernel call, with the same kernels in
    the same order (`backend.fused_decode_layers`, kernels/entry.c)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cache, meta):
        x = x + self.self_attn(self.input_layernorm(x, meta.backend), cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x, meta.backend), meta)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        self.config = cfg
        self.embed_tokens = TokenEmbedding()
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)

    fuse_decode_layers = True  # tests turn it off to compare with the layer-by-layer path

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, caches: list[KVCache],
                logits_indices: torch.Tensor) -> torch.Tensor:
        """input_ids: (T,). Returns float32 logits (len(logits_indices), vocab). With `meta.int8_activations`
        the vocabulary projection quantizes its input too, as llama.cpp does for a block-type output
        matrix: it halves that product's time at batch 1 (SmolLM2's Q8_0 head: 1.14-1.24 -> 0.63-0.66 ms)."""
        meta.rope_cos, meta.rope_sin = self.rope.lookup(meta.positions)
        x = self.embed_tokens(input_ids, meta.backend).contiguous()
        if not (self.fuse_decode_layers and meta.backend.fused_decode_layers(self, x, caches, meta)):
            for layer, cache in zip(self.layers, caches):
                x = layer(x, cache, meta)
        x = self.norm(x[logits_indices], meta.backend)
        return self.lm_head(x, meta.backend, meta.int8_activations).float()

    def load_weights(self, state: dict) -> None:
        """Takes weights under Hugging Face names: matrices as QuantWeight (kept as they are, q/k/v and
        gate/up stacked), norms and biases as float tensors. Raises KeyError naming the first missing
        tensor, ValueError for a shape that does not fit the config."""
        cfg = self.config

        def matrix(name: str, rows: int, cols: int) -> QuantWeight:
            w = state[name]
            if not isinstance(w, QuantWeight) or w.shape != (rows, cols):
                shape = w.shape if isinstance(w, QuantWeight) else tuple(w.shape)
                raise ValueError(f"{name} has shape {tuple(shape)}, the config needs {(rows, cols)}")
            return w

        def vector(name: str, size: int) -> torch.Tensor:
            v = state[name]
            if isinstance(v, QuantWeight) or tuple(v.shape) != (size,):
                raise ValueError(f"{name} has shape {tuple(v.shape)}, the config needs ({size},)")
            return v.float().contiguous()

        h, d = cfg.hidden_size, cfg.head_dim
        q, kv, inter = cfg.num_heads * d, cfg.num_kv_heads * d, cfg.intermediate_size
        self.embed_tokens.weight = matrix("model.embed_tokens.weight", cfg.vocab_size, h)
        self.norm.weight.data = vector("model.norm.weight", h)
        head = self.embed_tokens.weight if cfg.tie_word_embeddings else matrix("lm_head.weight", cfg.vocab_size, h)
        self.lm_head.set_weight([head])
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            attn.qkv_proj.set_weight([matrix(p + f"self_attn.{x}_proj.weight", n, h)
                                      for x, n in (("q", q), ("k", kv), ("v", kv))])
            if cfg.attention_bias:
                attn.qkv_proj.bias.data = torch.cat([vector(p + f"self_attn.{x}_proj.bias", n)
                                                     for x, n in (("q", q), ("k", kv), ("v", kv))])
            attn.o_proj.set_weight([matrix(p + "self_attn.o_proj.weight", h, q)])
            if cfg.qk_norm:
                attn.q_norm.weight.data = vector(p + "self_attn.q_norm.weight", d)
                attn.k_norm.weight.data = vector(p + "self_attn.k_norm.weight", d)
            mlp.gate_up_proj.set_weight([matrix(p + "mlp.gate_proj.weight", inter, h),
                                         matrix(p + "mlp.up_proj.weight", inter, h)])
            mlp.down_proj.set_weight([matrix(p + "mlp.down_proj.weight", h, inter)])
            layer.input_layernorm.weight.data = vector(p + "input_layernorm.weight", h)
            layer.post_attention_layernorm.weight.data = vector(p + "post_attention_layernorm.weight", h)

    def linears(self) -> list[Linear]:
        return [m for m in self.modules() if isinstance(m, Linear)]
