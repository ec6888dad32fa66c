"""Turns a model on disk (a GGUF file or a Hugging Face safetensors directory) into a `ModelConfig`
and one state dict under Hugging Face tensor names: matrices as `QuantWeight` in the file's own form
(read straight from the file, never widened), norms and biases as float32. Every failure is a
`ModelLoadError` that names the file and the problem."""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

import torch

from nanoserve.cache import cache_dir, file_key
from nanoserve.config import ModelConfig
from nanoserve.kernels.quant import FLOAT_TYPES, GGML_TYPES, QuantWeight, huge_page_buffer
from nanoserve.errors import ModelLoadError  # noqa: F401  (raised here, imported from here by callers)
from nanoserve.model.default import default_model_path  # noqa: F401  (imported from here by callers)


# Architectures we can run, by GGUF name and by Hugging Face class name.
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
HF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                    "Qwen3ForCausalLM": "qwen3"}
# GGUF tensor types we run: those the kernels read (kernels/quant.py).
SUPPORTED_GGUF_TYPES = set(GGML_TYPES)
SUPPORTED_ROPE_TYPES = {"default", "linear", "llama3"}  # and GGUF rope_freqs factors

# llama.cpp tensor names (per layer, after "blk.N.") -> Hugging Face names (after "model.layers.N.").
_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GGUF_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def load_model_weights(path: str) -> tuple[ModelConfig, dict]:
    """Reads config and weights (HF names; matrices as QuantWeight, vectors float32) from a GGUF file or
    a HF model directory."""
    if not os.path.exists(path):
        raise ModelLoadError(f"{path}: no such file or directory")
    if os.path.isdir(path):
        return _load_hf_dir(path)
    return _load_gguf(path)


# --------------------------------------------------------------------------------------------- GGUF

def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def gguf_config(reader, path: str) -> ModelConfig:
    arch_name = _field(reader, "general.architecture")
    if arch_name not in GGUF_ARCHITECTURES:
        raise ModelLoadError(f"{path}: unsupported architecture {arch_name!r} "
                             f"(supported: {', '.join(sorted(GGUF_ARCHITECTURES))})")

    def req(key: str):
        value = _field(reader, f"{arch_name}.{key}")
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata is missing {arch_name}.{key}")
        return value

    hidden = int(req("embedding_length"))
    num_heads = int(req("attention.head_count"))
    num_kv_heads = int(_field(reader, f"{arch_name}.attention.head_count_kv", num_heads))
    head_dim = int(_field(reader, f"{arch_name}.attention.key_length", hidden // num_heads))
    vocab = _field(reader, f"{arch_name}.vocab_size")
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    names = {t.name for t in reader.tensors}
    rope_scaling = None
    scale_type = _field(reader, f"{arch_name}.rope.scaling.type")
    if scale_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(req("rope.scaling.factor"))}
    elif scale_type not in (None, "none"):
        raise ModelLoadError(f"{path}: unsupported rope scaling {scale_type!r}")
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:  # per-frequency divisors (Llama 3's scaling, as llama.cpp's converter writes it)
        if rope_scaling is not None or freqs.tensor_type.name != "F32" or int(freqs.n_elements) != head_dim // 2:
            raise ModelLoadError(f"{path}: rope_freqs.weight is not {head_dim // 2} F32 factors, or comes "
                                 f"with another rope scaling")
        rope_scaling = {"rope_type": "freq_factors", "factors": [float(v) for v in freqs.data]}
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    eot = _field(reader, "tokenizer.ggml.eot_token_id")
    eos_ids = tuple(sorted({int(t) for t in (eos, eot) if t is not None}))
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    return ModelConfig(
        architecture=GGUF_ARCHITECTURES[arch_name], vocab_size=int(vocab), hidden_size=hidden,
        intermediate_size=int(req("feed_forward_length")), num_layers=int(req("block_count")),
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        rms_norm_eps=float(req("attention.layer_norm_rms_epsilon")),
        rope_theta=float(_field(reader, f"{arch_name}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(req("context_length")),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names, qk_norm="blk.0.attn_q_norm.weight" in names,
        rope_scaling=rope_scaling, bos_token_id=None if bos is None else int(bos), eos_token_ids=eos_ids)


def _gguf_name_to_hf(name: str) -> Optional[str]:
    stem, _, suffix = name.rpartition(".")  # suffix: "weight" or "bias"
    if stem.startswith("blk."):
        _, layer, part = stem.split(".", 2)
        hf = _GGUF_LAYER_NAMES.get(part)
        return None if hf is None else f"model.layers.{layer}.{hf}.{suffix}"
    hf = _GGUF_TOP_NAMES.get(stem)
    return None if hf is None else f"{hf}.{suffix}"


def unpermute_rows(n_rows: int, n_head: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's converter, which interleaves the two rotary halves of each
    head's rows of q and k: new row i is old row perm[i]."""
    head_dim = n_rows // n_head
    return torch.arange(n_rows).reshape(n_head, head_dim // 2, 2).transpose(1, 2).reshape(n_rows)


# Bump when the cached GGUF header (config and tensor table) changes meaning.
GGUF_HEADER_VERSION = "3"


def gguf_header(path: str) -> tuple[ModelConfig, list[tuple[str, str, tuple[int, ...], int, int]]]:
    """The config and the tensor table (name, type, shape (rows first), file offset, bytes) of a GGUF
    file. gguf-py parses a header in ~5 s (the vocabulary, mostly); the result is cached as JSON."""
    cached = os.path.join(cache_dir("gguf-headers"),
                          f"{os.path.basename(path)}-{file_key(path, GGUF_HEADER_VERSION)}.json")
    try:
        with open(cached) as f:
            saved = json.load(f)
        fields = dict(saved["config"], eos_token_ids=tuple(saved["config"]["eos_token_ids"]))
        return ModelConfig(**fields), [(n, t, tuple(s), o, b) for n, t, s, o, b in saved["tensors"]]
    except (OSError, ValueError, KeyError, TypeError):
        pass  # absent or damaged: parsed below
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as exc:  # the gguf package raises ValueError, struct errors, etc.
        raise ModelLoadError(f"{path}: not a readable GGUF file ({exc})") from None
    config = gguf_config(reader, path)
    tensors = [(t.name, t.tensor_type.name, tuple(int(d) for d in reversed(t.shape)), int(t.data_offset),
                int(t.n_bytes)) for t in reader.tensors]
    try:
        os.makedirs(os.path.dirname(cached), exist_ok=True)
        tmp = f"{cached}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"config": dataclasses.asdict(config), "tensors": tensors}, f)
        os.replace(tmp, cached)
    except OSError:
        pass  # no writable cache: the next start parses again
    return config, tensors


def _read(f, offset: int, nbytes: int) -> torch.Tensor:
    """nbytes of the file at offset, into memory of our own (no mapping of the file stays behind)."""
    buf = huge_page_buffer(nbytes)
    f.seek(offset)
    if f.readinto(memoryview(buf.numpy())) != nbytes:
        raise ModelLoadError(f"{f.name}: file ends inside a tensor (truncated download?)")
    return buf


def _load_gguf(path: str) -> tuple[ModelConfig, dict]:
    config, tensors = gguf_header(path)
    state: dict = {}
    with open(path, "rb") as f:
        for name, qtype, shape, offset, nbytes in tensors:
            hf_name = _gguf_name_to_hf(name)
            if hf_name is None:
                continue  # rope_freqs is read into the config (gguf_config)
            if qtype not in SUPPORTED_GGUF_TYPES:
                raise ModelLoadError(f"{path}: tensor {name} has type {qtype}, which nanoserve does not run "
                                     f"(supported: {', '.join(GGML_TYPES)})")
            raw = _read(f, offset, nbytes)
            if len(shape) == 1:
                state[hf_name] = QuantWeight(qtype, _typed(raw, qtype, 1, shape[0]), shape[0]).dequantize()[0]
                continue
            if len(shape) != 2:
                raise ModelLoadError(f"{path}: tensor {name} has {len(shape)} dimensions, expected 1 or 2")
            try:
                weight = QuantWeight(qtype, _typed(raw, qtype, *shape), shape[1])
            except (ValueError, RuntimeError) as exc:
                raise ModelLoadError(f"{path}: tensor {name}: {exc}") from None
            if config.architecture == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = config.num_heads if "q_proj" in hf_name else config.num_kv_heads
                weight = QuantWeight(qtype, weight.data.index_select(0, unpermute_rows(shape[0], heads)), shape[1])
            state[hf_name] = weight
    return config, state


def _typed(raw: torch.Tensor, qtype: str, rows: int, cols: int) -> torch.Tensor:
    """A tensor's bytes as QuantWeight data: (rows, cols) of the float dtype, or (rows, row bytes) uint8."""
    if qtype in FLOAT_TYPES:
        return raw.view(FLOAT_TYPES[qtype]).reshape(rows, cols)
    _, block, nbytes = GGML_TYPES[qtype]
    if cols % block:
        raise ModelLoadError(f"a {qtype} tensor of {cols} columns is not whole blocks of {block}")
    return raw.reshape(rows, cols // block * nbytes)


# ------------------------------------------------------------------------------- Hugging Face dirs

def hf_config(cfg: dict, path: str) -> ModelConfig:
    archs = cfg.get("architectures") or []
    arch = next((HF_ARCHITECTURES[a] for a in archs if a in HF_ARCHITECTURES), None)
    if arch is None:
        raise ModelLoadError(f"{path}: unsupported architecture {archs or cfg.get('model_type')!r} "
                             f"(supported: {', '.join(HF_ARCHITECTURES)})")
    # transformers >= 5 writes `rope_parameters` (theta and scaling together); older configs write
    # `rope_theta` and `rope_scaling`.
    rope_params = cfg.get("rope_parameters") or {}
    rope_theta = cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0))
    rope_scaling = cfg.get("rope_scaling") or {k: v for k, v in rope_params.items() if k != "rope_theta"}
    if rope_scaling.get("rope_type", rope_scaling.get("type", "default")) == "default":
        rope_scaling = None
    if rope_scaling:
        rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ModelLoadError(f"{path}: unsupported rope_scaling type {rope_type!r}")
        rope_scaling = dict(rope_scaling, rope_type=rope_type)
    num_heads = cfg["num_attention_heads"]
    max_positions = cfg.get("max_position_embeddings", 2048)
    window = cfg.get("sliding_window") if "MistralForCausalLM" in archs else None
    if window:  # Mistral 7B v0.1: full attention is exact only within the window, so serve that much
        max_positions = min(max_positions, window)
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    return ModelConfig(
        architecture=arch, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
        num_heads=num_heads, num_kv_heads=cfg.get("num_key_value_heads", num_heads),
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=float(rope_theta),
        max_position_embeddings=max_positions,
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        attention_bias=cfg.get("attention_bias", arch == "qwen2"), qk_norm=arch == "qwen3",
        rope_scaling=rope_scaling or None, bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos_ids)


def _load_hf_dir(path: str) -> tuple[ModelConfig, dict]:
    config_path = os.path.join(path, "config.json")
    try:
        with open(config_path) as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise ModelLoadError(f"{config_path}: missing (a model directory needs config.json)") from None
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{config_path}: invalid JSON ({exc})") from None
    try:
        config = hf_config(raw, config_path)
    except KeyError as exc:
        raise ModelLoadError(f"{config_path}: missing field {exc}") from None
    gen_path = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path) as f:
            eos = json.load(f).get("eos_token_id")
        if eos is not None:
            extra = tuple(eos) if isinstance(eos, list) else (eos,)
            config = dataclasses.replace(config, eos_token_ids=tuple(sorted(set(config.eos_token_ids) | set(extra))))
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors weight files")
    from safetensors import safe_open

    kinds = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
    state: dict = {}
    for name in files:
        file = os.path.join(path, name)
        try:
            with safe_open(file, framework="pt") as f:
                for key in f.keys():
                    t = f.get_tensor(key)
                    if t.dtype not in kinds:
                        raise ModelLoadError(f"{file}: tensor {key} is {t.dtype}; nanoserve reads float32, "
                                             f"float16 and bfloat16 checkpoints")
                    state[key] = (QuantWeight(kinds[t.dtype], t.contiguous(), t.shape[1]) if t.dim() == 2
                                  else t.float())
        except ModelLoadError:
            raise
        except Exception as exc:
            raise ModelLoadError(f"{file}: cannot read safetensors ({exc})") from None
    return config, state
