"""Whole models from the files people download: random-weight Llama/Qwen2/Qwen3 written as GGUF and as
safetensors in F32/F16/BF16 against transformers, SmolLM2 requantized into every common block type
(perplexity against a float32 reference of the same weights), and a K-quant file under batching and
preemption."""
from __future__ import annotations

import math
import os

import pytest
import torch

from backends import requires_kernels
from conftest import TINY_ARCHS, hf_logits
from runner_driver import RunnerDriver
from test_smollm2 import RAW_PROMPTS, _batch_prompts, _run
from nanoserve import SamplingParams
from nanoserve.bench.gguf_files import write_gguf
from nanoserve.config import EngineConfig
from nanoserve.engine.core import EngineCore
from nanoserve.kernels.quant import QuantWeight, from_float
from nanoserve.model.loader import load_model_weights

def _weight_types(model) -> list[tuple[str, str]]:
    """(layer name, block type) of every matrix part of every projection, and of the embedding."""
    from nanoserve.model.layers import Linear
    parts = [(name, p.qtype) for name, m in model.named_modules() if isinstance(m, Linear) for p in m.parts]
    return parts + [("embed_tokens", model.embed_tokens.weight.qtype)]


TORCH_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def _llama3_rope_factors(config) -> torch.Tensor:
    """What llama.cpp's converter writes as rope_freqs.weight for Llama 3's scaling: base / scaled
    inverse frequencies (the logits test checks the result against transformers' own scaling)."""
    from nanoserve.model.layers import rope_inv_freq

    base = rope_inv_freq(config.head_dim, config.rope_theta, None)
    return base / rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)


@pytest.fixture(scope="module")
def tiny_files(tiny_models, tmp_path_factory):
    """{(arch, type): (safetensors dir, GGUF file)} with the same weights, rounded to the type."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("tiny_files")
    files = {}
    for arch in TINY_ARCHS:
        hf = AutoModelForCausalLM.from_pretrained(tiny_models[arch], dtype=torch.float32)
        for qtype, dtype in TORCH_DTYPES.items():
            hf_dir = str(root / f"{arch}-{qtype}")
            hf.to(dtype).save_pretrained(hf_dir, safe_serialization=True)
            config, state = load_model_weights(hf_dir)
            assert {v.qtype for v in state.values() if isinstance(v, QuantWeight)} == {qtype}
            factors = _llama3_rope_factors(config) if arch == "llama" else None
            files[arch, qtype] = hf_dir, write_gguf(str(root / f"{arch}-{qtype}.gguf"), config, state,
                                                    rope_factors=factors)
            hf.to(torch.float32)
    return files


def _sequences(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (6, 29, 50)]


@pytest.mark.parametrize("qtype", list(TORCH_DTYPES))
@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_gguf_and_safetensors_logits_match_transformers(tiny_files, arch, qtype):
    """Float32 activations on F32/F16/BF16 weights kept in their file's form: the same logits as
    transformers (which widens the same weights to float32), from the GGUF file and from safetensors."""
    hf_dir, gguf_path = tiny_files[arch, qtype]
    seqs = _sequences(320)
    ref = hf_logits(hf_dir, seqs)
    for path in (hf_dir, gguf_path):
        driver = RunnerDriver(path, dtype="auto", num_blocks=256)
        assert {t for _, t in _weight_types(driver.runner.model)} == {qtype}
        ours = driver.run(seqs, prefill_chunk=1000, prefill_len=[max(1, 2 * len(s) // 3) for s in seqs])
        for r, o in zip(ref, ours):
            assert r.abs().max() > 0.1
            torch.testing.assert_close(o, r, atol=1e-4, rtol=0)


@pytest.mark.parametrize("qtype", list(TORCH_DTYPES))
@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_gguf_greedy_tokens_equal_transformers_generate(tiny_files, arch, qtype):
    from transformers import AutoModelForCausalLM

    hf_dir, gguf_path = tiny_files[arch, qtype]
    prompts = _sequences(320)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    engine = EngineCore(EngineConfig.from_kwargs(gguf_path, activation_dtype="float32", kv_cache_dtype="float32",
                                                 num_kv_blocks=64, block_size=16))
    ours = _run(engine, prompts, params)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    for prompt, tokens in zip(prompts, ours):
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                          pad_token_id=0, eos_token_id=None)
        assert tokens == out[0, len(prompt):].tolist()


# SmolLM2 requantized as a user's file would be. Its hidden size (576) is not a multiple of 256, so in a
# K-type file only ffn_down (rows of 1536) is K blocks and the rest takes llama-quantize's fallback type.
# The tied embedding/output matrix keeps its Q8_0 blocks, as llama-quantize keeps it at higher precision.
QUANT_FILES = ["Q8_0", "Q5_1", "Q4_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]


@pytest.fixture(scope="module")
def smollm_files(smollm_path, tmp_path_factory):
    from nanoserve.kernels.quant import quantized_type

    root = tmp_path_factory.mktemp("smollm_files")
    config, state = load_model_weights(smollm_path)
    floats = {k: v.dequantize() for k, v in state.items()
              if isinstance(v, QuantWeight) and k != "model.embed_tokens.weight"}

    def make(qtype: str) -> str:
        typed = dict(state, **{k: from_float(v, quantized_type(qtype, v.shape[1])) for k, v in floats.items()})
        return write_gguf(str(root / f"smollm2-{qtype}.gguf"), config, typed, tokenizer_from=smollm_path)
    return make


PROSE = os.path.join(os.path.dirname(__file__), "data", "prose.txt")


def _text_ids(tokenizer, length=200) -> list[list[int]]:
    """Non-overlapping windows of a fixed English text (five short essays, 834 tokens)."""
    with open(PROSE) as f:
        ids = tokenizer.encode(f.read())
    return [ids[i:i + length] for i in range(0, len(ids) - length + 1, length)]


def _perplexity(driver: RunnerDriver, seqs: list[list[int]]) -> float:
    """Over prefill (the first 150 tokens, in one chunk) and batched decode positions."""
    logits = driver.run(seqs, prefill_chunk=1000, prefill_len=[150] * len(seqs))
    nll = [torch.nn.functional.cross_entropy(lg[:-1].float(), torch.tensor(s[1:]), reduction="sum")
           for lg, s in zip(logits, seqs)]
    return math.exp(sum(x.item() for x in nll) / sum(len(s) - 1 for s in seqs))


@requires_kernels  # the products on the blocks; the PyTorch backend multiplies a float32 copy
@pytest.mark.parametrize("qtype", QUANT_FILES)
def test_quantized_file_perplexity_against_float32_of_the_same_weights(smollm_files, smollm_tokenizer, qtype):
    """Products on the blocks against float32 products on the file's weights dequantized to float32:
    with float32 activations perplexity is within 0.5% (it is exact up to summation order); with int8
    activations (llama.cpp's numerics, `auto` for block types) it rises by the rounding of the
    activations, measured +0.3% to +1.0% on this 135M model (docs/benchmarks.md), bounded here at 1.5%."""
    path = smollm_files(qtype)
    seqs = _text_ids(smollm_tokenizer)
    exact = RunnerDriver(path, dtype="auto", num_blocks=128)
    kinds = {t for _, t in _weight_types(exact.runner.model)}
    assert qtype in kinds and "F32" not in kinds
    ref = _perplexity(RunnerDriver(path, dtype="float32", num_blocks=128), seqs)
    # the requantized model still reads English (2-bit Q2_K ffn_down, which llama-quantize's Q2_K files
    # avoid by writing it as Q3_K, costs a 135M model most of its sense: 152, where every other type stays under 40)
    assert ref < (200 if qtype == "Q2_K" else 40)
    assert abs(_perplexity(exact, seqs) / ref - 1) < 0.005
    int8 = _perplexity(RunnerDriver("", model=exact.runner.model, num_blocks=128, kv_dtype=torch.float16,
                                    int8_activations=True), seqs)
    assert abs(int8 / ref - 1) < 0.015, (int8, ref)


@requires_kernels  # a C-kernel property: PyTorch's float GEMMs round differently by batch size
def test_k_quant_file_same_output_alone_batched_and_preempted(smollm_files, smollm_tokenizer):
    path = smollm_files("Q4_K")
    prompts = _batch_prompts(smollm_tokenizer)
    prompts[3] = prompts[3] * 30  # prefilled in chunks under the 256-token budget
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    def engine(blocks):
        return EngineCore(EngineConfig.from_kwargs(path, activation_dtype="int8", max_num_batched_tokens=256,
                                                   num_kv_blocks=blocks, block_size=16))
    ref = _run(engine(512), prompts, params)
    small = engine(40)
    assert _run(small, prompts, params) == ref
    assert small.scheduler.num_preemptions > 0
    assert small.block_manager.num_free_blocks == 40
    for i in (0, 3):
        assert _run(engine(64), [prompts[i]], params)[0] == ref[i]


def test_quantization_on_load_of_a_float_file(smollm_path, smollm_tokenizer, tmp_path):
    """`--quantization q4_k` on a 16-bit file: K blocks where rows allow, llama-quantize's fallback
    elsewhere, cached on disk, and the model still reads English (measured +12% perplexity over the
    16-bit file on this 135M model, whose weights are mostly Q5_0 then)."""
    from nanoserve.model.registry import build_model

    config, state = load_model_weights(smollm_path)
    f16 = {k: from_float(v.dequantize(), "F16") if isinstance(v, QuantWeight) else v for k, v in state.items()}
    path = write_gguf(str(tmp_path / "smollm2-F16.gguf"), config, f16, tokenizer_from=smollm_path)
    seqs = _text_ids(smollm_tokenizer)[:2]
    base = _perplexity(RunnerDriver(path, dtype="auto", num_blocks=64), seqs)
    _, model = build_model(path, quantization="q4_k")
    types = _weight_types(model)
    assert {t for n, t in types if "down_proj" in n} == {"Q4_K"}
    assert {t for n, t in types if "down_proj" not in n} == {"Q5_0"}
    ppl = _perplexity(RunnerDriver("", model=model, num_blocks=64), seqs)
    assert base < ppl < base * 1.25, (base, ppl)
    again = build_model(path, quantization="q4_k")[1]  # from the cache: the same blocks
    from nanoserve.model.layers import Linear
    for a, b in zip(model.modules(), again.modules()):
        if isinstance(a, Linear):
            assert all(torch.equal(x.data, y.data) for x, y in zip(a.parts, b.parts))


def test_mistral_checkpoint_is_served_as_llama(tiny_models, tmp_path):
    """MistralForCausalLM is Llama's layout; a sliding window caps the served context to it."""
    import json
    import shutil

    from nanoserve.model.loader import load_model_weights as load

    path = str(tmp_path / "mistral")
    shutil.copytree(tiny_models["llama"], path)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=256)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    config, _ = load(path)
    assert config.architecture == "llama" and config.max_position_embeddings == 256
