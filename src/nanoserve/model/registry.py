"""Builds a ready-to-run model (config, weights, dtype) from a path; the one entry point the engine
uses, which maps every loading failure to `ModelLoadError`."""
from __future__ import annotations

import os

import torch

from nanoserve.cache import cache_dir, file_key
from nanoserve.config import WEIGHT_DTYPES, ModelConfig
from nanoserve.kernels.blocks import BlockWeight, quantize_q4, quantize_q8
from nanoserve.model.layers import Linear, RotaryEmbedding
from nanoserve.model.llama import LlamaForCausalLM
from nanoserve.model.loader import ModelLoadError, load_model_weights

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# "auto": float32, plus 4-bit or 8-bit blocks on every matrix they represent exactly (a GGUF Q4_1 / Q8_0
# model's). "q4": every matrix rounded to 4-bit blocks, which then define its values on every backend.
Q4_EXACT_TOLERANCE = 1e-5  # relative to the matrix's largest weight


def build_model(path: str, dtype: str, max_positions: int = 0) -> tuple[ModelConfig, LlamaForCausalLM]:
    if dtype not in WEIGHT_DTYPES:
        raise ModelLoadError(f"{path}: unsupported dtype {dtype!r} (choose one of {', '.join(WEIGHT_DTYPES)})")
    config, state = load_model_weights(path)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, 1)
    model = model.to_empty(device="cpu")
    try:
        model.load_hf_state_dict(state)
    except KeyError as exc:
        raise ModelLoadError(f"{path}: weight {exc.args[0]} is missing") from None
    except RuntimeError as exc:  # shape mismatch
        raise ModelLoadError(f"{path}: weights do not match the config ({str(exc).splitlines()[0]})") from None
    # Only the big matrices take the chosen dtype; norms, biases, activations and KV stay float32.
    weight_dtype = DTYPES.get(dtype, torch.float32)
    for module in model.modules():
        if isinstance(module, (Linear, torch.nn.Embedding)):
            module.weight.data = module.weight.data.to(weight_dtype)
    if dtype in ("auto", "q4"):
        attach_cached_weight_blocks(path, model, exact_only=dtype == "auto")
    if weight_dtype == torch.float32:
        for module in model.modules():
            if isinstance(module, Linear):
                module.attach_onednn_weight()
    # cos/sin tables stay float32, sized for the context we will actually serve.
    model.rope = RotaryEmbedding(config.head_dim, max_positions or config.max_position_embeddings,
                                 config.rope_theta, config.rope_scaling)
    return config, model.eval()


BLOCKS_VERSION = "3"  # bump when the block layout changes


def attach_cached_weight_blocks(path: str, model: LlamaForCausalLM, exact_only: bool) -> None:
    """`attach_weight_blocks`, with the result of a model file cached on disk: checking and building
    the blocks takes ~4 s for the default model, loading them back ~0.1 s."""
    from safetensors.torch import load_file, save_file

    if not os.path.isfile(path):  # a Hugging Face directory: build every time
        attach_weight_blocks(model, exact_only)
        return
    mode = "exact" if exact_only else "all"
    cached = os.path.join(cache_dir("weight-blocks"),
                          f"{os.path.basename(path)}-{file_key(path, BLOCKS_VERSION + mode)}.safetensors")
    linears = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
    if os.path.isfile(cached):
        try:
            tensors = load_file(cached)
            for name, module in linears.items():
                parts = [tensors[f"{name}.{i}"] for i in range(3) if f"{name}.{i}" in tensors]
                module.blocks = BlockWeight(*parts) if parts else None
            match_weights_to_blocks(model)
            return
        except Exception:  # a damaged cache entry is rebuilt below
            pass
    attach_weight_blocks(model, exact_only)
    tensors = {f"{name}.{i}": t for name, m in linears.items() if m.blocks is not None
               for i, t in enumerate(m.blocks.tensors())}
    try:
        os.makedirs(os.path.dirname(cached), exist_ok=True)
        tmp = f"{cached}.{os.getpid()}.tmp"
        save_file(tensors, tmp)
        os.replace(tmp, cached)
    except OSError:
        pass  # no writable cache: the next start builds them again


def attach_weight_blocks(model: LlamaForCausalLM, exact_only: bool) -> int:
    """Gives Linear layers a 4-bit (or else 8-bit) block copy of their weight; with `exact_only`, only
    a copy that reproduces the weight exactly. Returns how many layers got one."""
    count = 0
    for module in model.modules():
        if not isinstance(module, Linear) or module.weight.shape[1] % 32:
            continue
        w = module.weight.data.float()
        limit = Q4_EXACT_TOLERANCE * float(w.abs().max())
        q4 = quantize_q4(w)
        if not exact_only or float((q4.dequantize() - w).abs().max()) <= limit:
            module.blocks = q4
        else:
            q8 = quantize_q8(w)
            if float((q8.dequantize() - w).abs().max()) <= limit:
                module.blocks = q8
        count += module.blocks is not None
    match_weights_to_blocks(model)
    return count


def match_weights_to_blocks(model: LlamaForCausalLM) -> None:
    """Every layer with blocks gets the blocks' own values as its float weight (a no-op for exact blocks,
    the rounding for `--dtype q4`), so that every product of the layer, on any backend and at any step
    size, multiplies the same numbers."""
    for module in model.modules():
        if isinstance(module, Linear) and module.blocks is not None:
            module.weight.data = module.blocks.dequantize().to(module.weight.dtype)
