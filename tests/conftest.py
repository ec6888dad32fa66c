"""Shared fixtures: the real SmolLM2 model (ours and transformers' reference), tiny random-weight
Llama/Qwen2/Qwen3 directories, and helpers that drive the model runner step by step."""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch

torch.set_num_threads(os.cpu_count() or 1)


@pytest.fixture(scope="session")
def smollm_path() -> str:
    from nanoserve.model.loader import default_model_path
    return default_model_path()


@pytest.fixture(scope="session")
def smollm_llm(smollm_path):
    from nanoserve import LLM
    # The default weights (float32 + exact 4/8-bit blocks) computed exactly, to compare with transformers
    # (the default int8 activations and float16 KV cache have their own tests).
    return LLM(smollm_path, seed=0, activation_dtype="float32", kv_cache_dtype="float32")


@pytest.fixture(scope="session")
def smollm_tokenizer(smollm_llm):
    return smollm_llm.get_tokenizer()


@pytest.fixture(scope="session")
def smollm_hf(smollm_path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(smollm_path),
                                                gguf_file=os.path.basename(smollm_path),
                                                dtype=torch.float32).eval()


TINY_ARCHS = ["llama", "qwen2", "qwen3"]


def make_tiny_model(arch: str, path: str) -> str:
    """Saves a small random-weight model of the given architecture as a safetensors directory."""
    import transformers

    torch.manual_seed({"llama": 1, "qwen2": 2, "qwen3": 3}[arch])
    common = dict(vocab_size=320, hidden_size=64, intermediate_size=112, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  initializer_range=0.08, rms_norm_eps=1e-6)
    if arch == "llama":
        cfg = transformers.LlamaConfig(**common, rope_theta=10000.0, tie_word_embeddings=False,
                                       rope_scaling={"rope_type": "llama3", "factor": 4.0,
                                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                     "original_max_position_embeddings": 64})
        model = transformers.LlamaForCausalLM(cfg)
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(**common, rope_theta=1e6, tie_word_embeddings=True)
        model = transformers.Qwen2ForCausalLM(cfg)
    else:
        cfg = transformers.Qwen3Config(**common, head_dim=24, rope_theta=1e6, tie_word_embeddings=False)
        model = transformers.Qwen3ForCausalLM(cfg)
    with torch.no_grad():  # give norms and biases non-trivial values so that mistakes show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    model.config.eos_token_id = 2
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_model(arch, str(root / arch)) for arch in TINY_ARCHS}


def hf_logits(path: str, sequences: list[list[int]]) -> list[torch.Tensor]:
    """transformers' logits at every position of each sequence, run one sequence at a time."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [model(torch.tensor([s])).logits[0].float() for s in sequences]


# Test tiers (Makefile): `make test-fast` runs neither tier below; `make test` runs everything, then
# the model tier again with the C kernels off (the PyTorch backend must give the same results).
MODEL_FIXTURES = {"smollm_path", "smollm_llm", "smollm_tokenizer", "smollm_hf"}


def pytest_configure(config):
    config.addinivalue_line("markers", "model: uses the real SmolLM2 model")
    config.addinivalue_line("markers", "server: starts `nanoserve serve` as a subprocess")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.module.__name__ == "test_server":
            item.add_marker(pytest.mark.server)
        elif MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.model)
