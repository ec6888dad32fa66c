"""Builds a ready-to-run model (config, weights in their chosen form) from a path; the one entry point
the engine uses, which maps every loading failure to `ModelLoadError`. Weights stay as the file holds
them unless `--dtype` converts or `--quantization` quantizes them (the latter cached on disk)."""
from __future__ import annotations

import os


from nanoserve.cache import cache_dir, file_key
from nanoserve.config import QUANTIZATIONS, WEIGHT_DTYPES, ModelConfig
from nanoserve.kernels.quant import FLOAT_TYPES, QuantWeight, from_float, pack_weights, quantized_type
from nanoserve.model.layers import RotaryEmbedding
from nanoserve.model.llama import LlamaForCausalLM
from nanoserve.model.loader import ModelLoadError, load_model_weights

DTYPE_TYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
QUANTIZED_VERSION = "2"  # bump when a quantizer's output changes, so that cached results are rebuilt


def build_model(path: str, dtype: str = "auto", max_positions: int = 0,
                quantization: str = "none") -> tuple[ModelConfig, LlamaForCausalLM]:
    if dtype not in WEIGHT_DTYPES:
        raise ModelLoadError(f"{path}: unsupported dtype {dtype!r} (choose one of {', '.join(WEIGHT_DTYPES)})")
    if quantization not in QUANTIZATIONS:
        raise ModelLoadError(f"{path}: unsupported quantization {quantization!r} "
                             f"(choose one of {', '.join(QUANTIZATIONS)})")
    config, state = load_model_weights(path)
    if dtype != "auto":
        qtype = DTYPE_TYPES[dtype]
        state = {k: _convert(v, qtype) if isinstance(v, QuantWeight) else v for k, v in state.items()}
    if quantization != "none":
        state = quantize_state(path, state, quantization.upper(), salt=dtype)
    model = LlamaForCausalLM(config, 1)
    try:
        model.load_weights(state)
    except KeyError as exc:
        raise ModelLoadError(f"{path}: weight {exc.args[0]} is missing") from None
    except ValueError as exc:  # shape mismatch
        raise ModelLoadError(f"{path}: weights do not match the config ({exc})") from None
    state = None  # the loader's matrices, some stacked into fused projections since: freed as they are packed
    pack_weights(matrices(model))
    # cos/sin tables stay float32, sized for the context we will actually serve.
    model.rope = RotaryEmbedding(config.head_dim, max_positions or config.max_position_embeddings,
                                 config.rope_theta, config.rope_scaling)
    return config, model.eval()


def _convert(w: QuantWeight, qtype: str) -> QuantWeight:
    return w if w.qtype == qtype else from_float(w.dequantize(), qtype)


def quantize_state(path: str, state: dict, qtype: str, salt: str) -> dict:
    """The float matrices of `state` quantized to `qtype`, from the disk cache when this file was
    quantized the same way before (the quantizers take ~1 s per 10M weights here). A matrix whose rows
    do not divide into `qtype`'s blocks takes its fallback type, or stays as it is (quantized_type)."""
    from safetensors.torch import load_file, save_file

    types = {k: quantized_type(qtype, v.k) for k, v in state.items()
             if isinstance(v, QuantWeight) and v.qtype in FLOAT_TYPES}
    names = [k for k, t in types.items() if t is not None]
    key_path = path if os.path.isfile(path) else os.path.join(path, "config.json")
    cached = os.path.join(cache_dir("quantized"), f"{os.path.basename(os.path.abspath(path))}-"
                          f"{file_key(key_path, f'{QUANTIZED_VERSION}:{qtype}:{salt}:{_dir_stamp(path)}')}"
                          ".safetensors")
    out = dict(state)
    if os.path.isfile(cached):
        try:
            tensors = load_file(cached)
            for name in names:
                out[name] = QuantWeight(types[name], tensors[name], state[name].k)
            return out
        except Exception:  # damaged or stale: quantized again below
            out = dict(state)
    for name in names:
        out[name] = from_float(state[name].dequantize(), types[name])
    try:
        os.makedirs(os.path.dirname(cached), exist_ok=True)
        tmp = f"{cached}.{os.getpid()}.tmp"
        save_file({name: out[name].data for name in names}, tmp)
        os.replace(tmp, cached)
    except OSError:
        pass  # no writable cache: the next start quantizes again
    return out


def _dir_stamp(path: str) -> str:
    """For a model directory: the names, sizes and times of its weight files (they key the cache)."""
    if os.path.isfile(path):
        return ""
    parts = []
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            st = os.stat(os.path.join(path, name))
            parts.append(f"{name}:{st.st_size}:{st.st_mtime_ns}")
    return ",".join(parts)


def matrices(model: LlamaForCausalLM) -> list[QuantWeight]:
    """Every weight matrix once, in the order a step uses them (a tied output projection is the embedding)."""
    seen: dict[int, QuantWeight] = {}
    for layer in model.linears():
        for p in layer.parts:
            seen.setdefault(id(p), p)
    seen.setdefault(id(model.embed_tokens.weight), model.embed_tokens.weight)
    return list(seen.values())


def describe_weights(model: LlamaForCausalLM) -> str:
    """The matrices' types, counted, and their size, e.g. "Q4_K x150, Q6_K x31 (98.3 MiB)"."""
    counts: dict[str, int] = {}
    in_linears = {id(p) for layer in model.linears() for p in layer.parts}
    weights = matrices(model)
    for w in weights:
        key = w.qtype if id(w) in in_linears else f"{w.qtype} (embedding)"  # an untied embedding
        counts[key] = counts.get(key, 0) + 1
    total = sum(w.nbytes for w in weights)
    return ", ".join(f"{k} x{v}" for k, v in sorted(counts.items())) + f" ({total / 2**20:.1f} MiB)"


def weight_bytes(model: LlamaForCausalLM) -> int:
    """Bytes of every weight matrix (each shared matrix once) plus the float vectors."""
    return sum(w.nbytes for w in matrices(model)) + sum(t.numel() * t.element_size() for t in model.parameters())


