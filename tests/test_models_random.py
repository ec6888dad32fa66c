"""Our forward pass against transformers on small random-weight Llama, Qwen2 and Qwen3 models saved as
safetensors directories: prefill, chunked prefill and batched decode, float32, within 1e-4."""
import pytest
import torch

from conftest import TINY_ARCHS, hf_logits
from runner_driver import RunnerDriver


def _sequences(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 23, 40, 71)]


@pytest.mark.parametrize("arch", TINY_ARCHS)
@pytest.mark.parametrize("block_size,chunk", [(16, 1000), (4, 7), (1, 16)])
def test_logits_match_transformers(tiny_models, arch, block_size, chunk):
    path = tiny_models[arch]
    seqs = _sequences(320)
    ref = hf_logits(path, seqs)
    driver = RunnerDriver(path, block_size=block_size, num_blocks=512)
    # Prefill roughly two thirds of each sequence (in chunks), then decode the rest batched.
    ours = driver.run(seqs, prefill_chunk=chunk, prefill_len=[max(1, 2 * len(s) // 3) for s in seqs])
    for r, o in zip(ref, ours):
        assert o.shape == r.shape
        assert r.abs().max() > 0.1  # logits are not trivially small
        torch.testing.assert_close(o, r, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_loader_reads_config(tiny_models, arch):
    from nanoserve.model.loader import load_model_weights

    cfg, state = load_model_weights(tiny_models[arch])
    assert cfg.architecture == arch
    assert cfg.qk_norm == (arch == "qwen3")
    assert cfg.attention_bias == (arch == "qwen2")
    assert cfg.tie_word_embeddings == (arch == "qwen2")
    assert (cfg.rope_scaling or {}).get("rope_type") == ("llama3" if arch == "llama" else None)
    assert cfg.head_dim == (24 if arch == "qwen3" else 16)
    assert 2 in cfg.eos_token_ids
    # Matrices as the checkpoint stores them (float32 here), vectors float32.
    from nanoserve.kernels.quant import QuantWeight
    assert all(v.qtype == "F32" if isinstance(v, QuantWeight) else v.dtype == torch.float32 for v in state.values())
