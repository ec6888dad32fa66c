"""Frozen configuration dataclasses: the model's shape (`ModelConfig`), the KV cache, the scheduler,
and the root `EngineConfig` that is built once and handed to every component."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder; filled from a GGUF header or a Hugging Face config.json."""
    architecture: str  # "llama", "qwen2" or "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    qk_norm: bool = False
    rope_scaling: Optional[dict] = None
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # Either a fixed number of blocks or a byte budget; the block count wins when both are given.
    num_blocks: Optional[int] = None
    kv_cache_memory: int = 2 << 30
    enable_prefix_caching: bool = True
    # "float32": keys and values as computed; "float16": half the memory and half the bytes each decode
    # step reads, at float16 precision (llama.cpp's default cache type); "auto": float16 where the C
    # kernels run, else float32 (engine.model_runner.kv_cache_dtype).
    kv_cache_dtype: str = "auto"


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int = 0  # 0: the model's own context length


@dataclass(frozen=True)
class EngineConfig:
    model: str  # path to a .gguf file or a Hugging Face model directory
    dtype: str = "auto"  # see model.registry.WEIGHT_MODES
    # "int8": activations quantized to 8 bits per block of 32 before the 4-bit layer matrices, as
    # llama.cpp runs them (faster, ~0.5% error per product); "float32": exact; "auto": int8 for a model
    # with 4-bit blocks, else float32 (engine.model_runner.use_int8_activations).
    activation_dtype: str = "auto"
    seed: int = 0
    num_threads: Optional[int] = None
    # "raw": logprobs of the model's distribution (vLLM V1's default); "processed": of the distribution
    # actually sampled from (after penalties, temperature, min_p, top-k/top-p).
    logprobs_mode: str = "raw"
    max_logprobs: int = 20  # cap on logprobs / prompt_logprobs per request
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
