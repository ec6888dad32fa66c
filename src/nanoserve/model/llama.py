"""Our forward pass for Llama-family decoders (Llama, Qwen2 with q/k/v bias, Qwen3 with q/k RMSNorm):
a flat batch of tokens from many sequences in, hidden states of the positions to sample out."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve import kernels
from nanoserve.config import ModelConfig
from nanoserve.model.layers import AttentionMetadata, KVCache, Linear, RMSNorm, RotaryEmbedding, paged_attention


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

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        if meta.kernel_lib is not None and not self.qk_norm and cache.k.dtype in (torch.float32, torch.float16):
            # One C pass: rotary on q and k in place, k and v written to the cache.
            kernels.rope_write_kv(meta.kernel_lib, qkv, self.num_heads, self.num_kv_heads, self.head_dim,
                                  meta.rope_cos, meta.rope_sin, cache.k, cache.v, meta.slot_mapping)
            q, k, v = (t.view(n, -1, self.head_dim)
                       for t in qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1))
            return self.o_proj(paged_attention(q, k, v, cache, meta, self.scale, cached=True))
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = qk.reshape(n, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            qk = torch.cat([self.q_norm(qk[:, :self.num_heads]), self.k_norm(qk[:, self.num_heads:])], 1)
        qk = rope.apply(qk, meta.rope_cos, meta.rope_sin)  # q and k heads rotated together
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        return self.o_proj(paged_attention(q, k, v, cache, meta, self.scale))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, lib=None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if lib is not None:
            return self.down_proj(kernels.silu_mul(lib, gate_up))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, rope, cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), rope, cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x), meta.kernel_lib)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, caches: list[KVCache],
                logits_indices: torch.Tensor) -> torch.Tensor:
        """input_ids: (T,). Returns float32 logits (len(logits_indices), vocab)."""
        meta.rope_cos, meta.rope_sin = self.rope.lookup(meta.positions)
        x = self.embed_tokens(input_ids).float()
        for layer, cache in zip(self.layers, caches):
            x = layer(x, self.rope, cache, meta)
        x = self.norm(x[logits_indices])
        return self.lm_head(x).float()

    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Copies weights under Hugging Face names, fusing q/k/v and gate/up; raises KeyError naming
        the first missing tensor."""
        cfg = self.config
        own: dict[str, torch.Tensor] = {
            "embed_tokens.weight": state["model.embed_tokens.weight"],
            "norm.weight": state["model.norm.weight"],
            "lm_head.weight": state["model.embed_tokens.weight"] if cfg.tie_word_embeddings
            else state["lm_head.weight"],
        }
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            own[f"layers.{i}.self_attn.qkv_proj.weight"] = torch.cat(
                [state[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
            if cfg.attention_bias:
                own[f"layers.{i}.self_attn.qkv_proj.bias"] = torch.cat(
                    [state[p + f"self_attn.{x}_proj.bias"] for x in "qkv"])
            own[f"layers.{i}.self_attn.o_proj.weight"] = state[p + "self_attn.o_proj.weight"]
            if cfg.qk_norm:
                own[f"layers.{i}.self_attn.q_norm.weight"] = state[p + "self_attn.q_norm.weight"]
                own[f"layers.{i}.self_attn.k_norm.weight"] = state[p + "self_attn.k_norm.weight"]
            own[f"layers.{i}.mlp.gate_up_proj.weight"] = torch.cat(
                [state[p + "mlp.gate_proj.weight"], state[p + "mlp.up_proj.weight"]])
            own[f"layers.{i}.mlp.down_proj.weight"] = state[p + "mlp.down_proj.weight"]
            own[f"layers.{i}.input_layernorm.weight"] = state[p + "input_layernorm.weight"]
            own[f"layers.{i}.post_attention_layernorm.weight"] = state[p + "post_attention_layernorm.weight"]
        self.load_state_dict(own, strict=True)
        if cfg.tie_word_embeddings:  # one tensor, not two copies of the vocabulary matrix
            self.lm_head.weight = self.embed_tokens.weight
