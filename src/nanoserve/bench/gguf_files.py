"""Writes GGUF files as llama.cpp's converter does (tensor names, q/k row order, metadata) from a state
dict under Hugging Face names: the test models and benchmark files in other block types, and the
random-weight Llama-shaped models (`python -m nanoserve.bench.gguf_files --help`)."""
from __future__ import annotations

import argparse
import functools
from typing import Optional

import numpy as np
import torch

from nanoserve.config import ModelConfig
from nanoserve.kernels.quant import FLOAT_TYPES, QUANTIZATIONS, QuantWeight, from_float
from nanoserve.model.loader import _GGUF_LAYER_NAMES, _GGUF_TOP_NAMES, default_model_path, unpermute_rows

_HF_LAYER = {hf: gg for gg, hf in _GGUF_LAYER_NAMES.items()}
_HF_TOP = {hf: gg for gg, hf in _GGUF_TOP_NAMES.items()}


def gguf_name(hf_name: str) -> str:
    stem, _, suffix = hf_name.rpartition(".")
    if stem.startswith("model.layers."):
        _, _, layer, part = stem.split(".", 3)
        return f"blk.{layer}.{_HF_LAYER[part]}.{suffix}"
    return f"{_HF_TOP[stem]}.{suffix}"


@functools.lru_cache(maxsize=4)
def _tokenizer_fields(path: str) -> tuple:
    """The tokenizer.* fields of a GGUF as (key, value, type, array item type); parsing a 49k-token
    vocabulary with gguf-py takes ~10 s, so each file is read once per process."""
    import gguf

    out = []
    for key, field in gguf.GGUFReader(path).fields.items():
        if key.startswith("tokenizer."):
            sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            out.append((key, field.contents(), field.types[0], sub))
    return tuple(out)


def write_gguf(path: str, config: ModelConfig, state: dict, tokenizer_from: Optional[str] = None,
               rope_factors: Optional[torch.Tensor] = None) -> str:
    """state: HF names -> QuantWeight (matrices, in any type) or float tensors (vectors, written F32).
    tokenizer_from: a GGUF whose tokenizer.* fields are copied (by default none are written).
    rope_factors: Llama 3's per-frequency divisors, written as rope_freqs.weight."""
    import gguf

    arch = config.architecture
    writer = gguf.GGUFWriter(path, arch)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_vocab_size(config.vocab_size)
    if tokenizer_from:
        for key, value, vtype, sub in _tokenizer_fields(tokenizer_from):
            writer.add_key_value(key, value, vtype, sub_type=sub)
    for eos in config.eos_token_ids[:1]:
        if not tokenizer_from:
            writer.add_eos_token_id(eos)
    if rope_factors is not None:
        writer.add_tensor("rope_freqs.weight", rope_factors.float().numpy())
    for name, value in state.items():
        if isinstance(value, QuantWeight):
            data = value.data
            if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = config.num_heads if "q_proj" in name else config.num_kv_heads
                data = data.index_select(0, torch.argsort(unpermute_rows(data.shape[0], heads)))
            array = data.contiguous().view(torch.uint8).numpy() if value.qtype == "BF16" else data.numpy()
            writer.add_tensor(gguf_name(name), array, raw_dtype=gguf.GGMLQuantizationType[value.qtype])
        else:
            writer.add_tensor(gguf_name(name), value.float().contiguous().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def random_llama_state(config: ModelConfig, qtype: str, seed: int = 0) -> dict:
    """Random weights of a Llama-shaped model (std 0.02 matrices, norms near 1), each matrix in `qtype`
    (a K type falls back as llama-quantize does where rows are not a multiple of 256)."""
    from nanoserve.kernels.quant import quantized_type

    g = torch.Generator().manual_seed(seed)
    h, inter, hd = config.hidden_size, config.intermediate_size, config.head_dim

    def matrix(rows: int, cols: int) -> QuantWeight:
        t = quantized_type(qtype, cols)
        if t is None:
            raise ValueError(f"rows of {cols} weights do not divide into {qtype} blocks")
        return from_float(torch.randn(rows, cols, generator=g) * 0.02, t)

    def norm(n: int) -> torch.Tensor:
        return 1 + 0.1 * torch.randn(n, generator=g)

    state = {"model.embed_tokens.weight": matrix(config.vocab_size, h), "model.norm.weight": norm(h)}
    if not config.tie_word_embeddings:
        state["lm_head.weight"] = matrix(config.vocab_size, h)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        state.update({
            p + "input_layernorm.weight": norm(h), p + "post_attention_layernorm.weight": norm(h),
            p + "self_attn.q_proj.weight": matrix(config.num_heads * hd, h),
            p + "self_attn.k_proj.weight": matrix(config.num_kv_heads * hd, h),
            p + "self_attn.v_proj.weight": matrix(config.num_kv_heads * hd, h),
            p + "self_attn.o_proj.weight": matrix(h, config.num_heads * hd),
            p + "mlp.gate_proj.weight": matrix(inter, h), p + "mlp.up_proj.weight": matrix(inter, h),
            p + "mlp.down_proj.weight": matrix(h, inter),
        })
    return state


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description="Write a random-weight Llama-shaped GGUF with SmolLM2's "
                                     "tokenizer (for benchmarks: 1B class by default, like TinyLlama-1.1B)")
    parser.add_argument("output")
    parser.add_argument("--type", default="F16", help="GGUF type of the matrices (F16, Q8_0, Q4_K, ...)")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    source = default_model_path()
    from nanoserve.model.loader import gguf_header

    tok_config, _ = gguf_header(source)
    config = ModelConfig(architecture="llama", vocab_size=tok_config.vocab_size, hidden_size=args.hidden,
                         intermediate_size=args.intermediate, num_layers=args.layers, num_heads=args.heads,
                         num_kv_heads=args.kv_heads, head_dim=args.hidden // args.heads, rms_norm_eps=1e-5,
                         rope_theta=10000.0, max_position_embeddings=2048, tie_word_embeddings=False,
                         attention_bias=False, qk_norm=False, rope_scaling=None,
                         bos_token_id=tok_config.bos_token_id, eos_token_ids=tok_config.eos_token_ids)
    qtype = args.type.upper()
    if qtype not in FLOAT_TYPES and qtype.lower() not in QUANTIZATIONS:
        parser.error(f"--type {args.type}: not a type nanoserve can write")
    write_gguf(args.output, config, random_llama_state(config, qtype, args.seed), tokenizer_from=source)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
