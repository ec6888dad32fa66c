"""Our forward pass for Llama-family decoders (Llama, Qwen2 with q/k/v bias, Qwen3 with q/k RMSNorm):
a flat batch of tokens from many sequences in, hidden states of the positions to sample out."""
from __future__ import annotations

import ctypes

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
        self._block_pointers = None

    def forward(self, x, rope, cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), rope, cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x), meta.kernel_lib)

    def block_pointers(self):
        """The 4 projections' block tensors as a C array of 12 pointers, or None when the layer cannot
        run as one C call (a projection without blocks or with a bias, q/k norms)."""
        attn, mlp = self.self_attn, self.mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if attn.qk_norm or any(p.blocks is None or p.bias is not None for p in linears):
            return None
        blocks = tuple(p.blocks for p in linears)  # kept with the pointers: rebuilt if any is replaced
        if self._block_pointers is None or any(a is not b for a, b in zip(self._block_pointers[0], blocks)):
            ptrs = []
            for b in blocks:
                ptrs += [b[0].data_ptr(), b[1].data_ptr(), b[2].data_ptr() if len(b) == 3 else None]
            self._block_pointers = (blocks, (ctypes.c_void_p * 12)(*ptrs))
        return self._block_pointers[1]

    def forward_decode(self, x: torch.Tensor, cache: KVCache, meta: AttentionMetadata, work: torch.Tensor) -> None:
        """The whole layer for a decode-only step in one C call (kernels/decode_layer.c), updating the
        residual stream x in place; the same kernels in the same order as `forward`."""
        attn, rows_hidden_inter = self.self_attn, (x.shape[0], x.shape[1], self.mlp.intermediate)
        meta.kernel_lib.decode_layer_f32(
            x.data_ptr(), *rows_hidden_inter, attn.num_heads, attn.num_kv_heads, attn.head_dim,
            self.input_layernorm.weight.data_ptr(), self.post_attention_layernorm.weight.data_ptr(),
            self.input_layernorm.eps, self.block_pointers(), meta.rope_cos.data_ptr(), meta.rope_sin.data_ptr(),
            cache.k.data_ptr(), cache.v.data_ptr(), cache.k.shape[1], int(cache.k.dtype == torch.float16),
            meta.slot_mapping.data_ptr(), meta.decode_slots.data_ptr(), meta.decode_ctx_lens.data_ptr(),
            meta.decode_slots.shape[1], attn.scale, int(attn.qkv_proj.int8_activations), work.data_ptr())


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
        if self._fused_decode(meta, x, caches):
            cfg = self.config
            width = (cfg.hidden_size + (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
                     + 2 * cfg.num_heads * cfg.head_dim + 3 * cfg.intermediate_size)
            work = torch.empty(x.shape[0] * width)  # the layer's scratch, as decode_layer_f32 lays it out
            x = x.contiguous()
            for layer, cache in zip(self.layers, caches):
                layer.forward_decode(x, cache, meta, work)
        else:
            for layer, cache in zip(self.layers, caches):
                x = layer(x, self.rope, cache, meta)
        x = self.norm(x[logits_indices])
        return self.lm_head(x).float()

    fuse_decode_layers = True  # tests turn it off to compare with the layer-by-layer path

    int8_activations = False

    def set_int8_activations(self, enabled: bool) -> None:
        """Activations quantized to 8 bits before every layer matrix held in 4-bit blocks, in every
        step (kernels/int8_gemm.c); the vocabulary projection stays float32."""
        self.int8_activations = enabled
        for layer in self.layers:
            for module in layer.modules():
                if isinstance(module, Linear):
                    module.int8_activations = enabled

    def _fused_decode(self, meta: AttentionMetadata, x: torch.Tensor, caches: list[KVCache]) -> bool:
        """Whether this step runs each layer as one C call: decode rows only, few enough for the block
        kernels, every layer on blocks, a float32 or float16 cache and head_dim a multiple of 8."""
        rows = x.shape[0]
        return (self.fuse_decode_layers and meta.kernel_lib is not None and meta.num_decodes == rows
                and 0 < rows <= Linear.BLOCK_GEMM_MAX_ROWS and not meta.prefills
                and self.config.head_dim % 8 == 0 and caches[0].k.dtype in (torch.float32, torch.float16)
                and all(layer.block_pointers() is not None for layer in self.layers))

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
