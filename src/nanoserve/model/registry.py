"""Builds a ready-to-run model (config, weights, dtype) from a path; the one entry point the engine
uses, which maps every loading failure to `ModelLoadError`."""
from __future__ import annotations

import torch

from nanoserve.config import ModelConfig
from nanoserve.model.layers import Linear, RotaryEmbedding
from nanoserve.model.llama import LlamaForCausalLM
from nanoserve.model.loader import ModelLoadError, load_model_weights

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build_model(path: str, dtype: str, max_positions: int = 0) -> tuple[ModelConfig, LlamaForCausalLM]:
    if dtype not in DTYPES:
        raise ModelLoadError(f"{path}: unsupported dtype {dtype!r} (choose float32 or bfloat16)")
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
    weight_dtype = DTYPES[dtype]
    for module in model.modules():
        if isinstance(module, (Linear, torch.nn.Embedding)):
            module.weight.data = module.weight.data.to(weight_dtype)
    # cos/sin tables stay float32, sized for the context we will actually serve.
    model.rope = RotaryEmbedding(config.head_dim, max_positions or config.max_position_embeddings,
                                 config.rope_theta, config.rope_scaling)
    return config, model.eval()
