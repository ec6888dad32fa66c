"""The compute backend: chosen once per engine (`select_backend`) and passed down to the layers, the
attention and the sampler, which never look anything up themselves. `TorchBackend` is plain PyTorch
and defines what every kernel must compute; `CKernelBackend` runs the C kernels where they fit the
shapes (it alone answers "can this kernel run this shape") and the reference elsewhere. Both compute
the same numbers up to float32 rounding: formats (int8 activations, float16 KV, 4-bit weights) are
decided by the engine, not by which backend runs them."""
from __future__ import annotations

import ctypes
import logging
from typing import Optional

import torch
import torch.nn.functional as F

from nanoserve.config import KERNEL_CHOICES
from nanoserve.kernels import abi
from nanoserve.kernels.abi import check
from nanoserve.kernels.quant import FLOAT_TYPES, K_TYPES, QuantWeight, quantize_activations

logger = logging.getLogger(__name__)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in Hugging Face's `rotate_half` convention; x (T, heads, D), cos/sin (T, D)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


class TorchBackend:
    """Every operation in PyTorch: the reference the C kernels are tested against."""
    name = "torch"
    isa: Optional[str] = None
    SMALL_STEP_ROWS = 4  # bfloat16 weights: below this many rows, multiply in bfloat16

    # ---------------------------------------------------------------------------- matrix products
    def prepare(self, model) -> int:
        """Gives every Linear a float32 copy of its weight (`dense`, a oneDNN one where PyTorch has it):
        the reference multiplies float32 matrices. Returns the bytes these copies take."""
        total = 0
        for layer in model.linears():
            if layer.dense is not None:
                continue  # prepared already (a model shared between runners)
            dense = torch.cat([p.dequantize() for p in layer.parts])
            total += dense.numel() * 4
            if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
                dense = dense.to_mkldnn()
            layer.dense = dense
        return total

    def linear(self, x: torch.Tensor, layer, int8: bool) -> torch.Tensor:
        """x (M, K) float32 times `layer`'s weight (no bias). int8: x quantized per block first (the
        kernels' scheme, quant.quantize_activations) for the products on block-type parts."""
        # what each part multiplies: x, or x quantized as the products with its type quantize it
        kinds = ["float" if p.qtype in FLOAT_TYPES else "k" if p.qtype in K_TYPES else "block" for p in layer.parts]
        if not int8 or all(k == "float" for k in kinds):
            return self._dense(x, layer.dense)
        inputs = {"float": x}
        for kind, part in zip(kinds, layer.parts):
            if kind not in inputs:
                inputs[kind] = quantize_activations(x, part.qtype)
        if len(set(kinds)) == 1:
            return self._dense(inputs[kinds[0]], layer.dense)
        out, row = [], 0
        dense = layer.dense.to_dense() if layer.dense.is_mkldnn else layer.dense
        for part, kind in zip(layer.parts, kinds):
            n = part.shape[0]
            out.append(F.linear(inputs[kind], dense[row:row + n]))
            row += n
        return torch.cat(out, dim=-1)

    @staticmethod
    def _dense(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if w.is_mkldnn:
            if x.dim() == 2:
                return torch.ops.mkldnn._linear_pointwise(x.contiguous(), w, None, "none", [], "")
            w = w.to_dense()
        return F.linear(x, w)

    def embedding(self, embedding, ids: torch.Tensor) -> torch.Tensor:
        """The rows ids (T,) of a TokenEmbedding's weight as float32 (T, K): the values gguf-py
        dequantizes to."""
        return embedding.weight.dequantize(ids)

    # ------------------------------------------------------------------------- elementwise steps
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return F.rms_norm(x, weight.shape, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rope_write_kv(self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                      cos: torch.Tensor, sin: torch.Tensor, cache, slots: torch.Tensor) -> None:
        """qkv (T, (H + 2 KVH) D), rows contiguous: rotates q and k in place, writes k and v to the cache."""
        n, qk_width = qkv.shape[0], (num_heads + num_kv_heads) * head_dim
        qk = qkv[:, :qk_width].view(n, num_heads + num_kv_heads, head_dim)
        qk.copy_(rotate(qk, cos, sin))
        v = qkv[:, qk_width:].view(n, num_kv_heads, head_dim)
        cache.k.index_copy_(1, slots, qk[:, num_heads:].transpose(0, 1).to(cache.k.dtype))
        cache.v.index_copy_(1, slots, v.transpose(0, 1).to(cache.v.dtype))

    # ----------------------------------------------------------------------------------- attention
    attends_prompts_as_decodes = False  # see PrefillSeq.row_ctx_lens

    def decode_attention(self, q: torch.Tensor, cache, slots: torch.Tensor, ctx_lens: torch.Tensor,
                         scale: float) -> torch.Tensor:
        """q (B, H, D): row b attends to the first ctx_lens[b] of its cache slots (B, T). -> (B, H, D)."""
        batch, num_heads, head_dim = q.shape
        num_kv_heads, max_ctx = cache.k.shape[0], slots.shape[1]
        qd = q.reshape(batch, num_kv_heads, num_heads // num_kv_heads, head_dim).transpose(0, 1)
        flat = slots.reshape(-1)
        shape = (num_kv_heads, batch, max_ctx, head_dim)
        keys = torch.index_select(cache.k, 1, flat).view(shape).float()  # (KVH, B, T, D)
        values = torch.index_select(cache.v, 1, flat).view(shape).float()
        scores = torch.matmul(qd, keys.transpose(-1, -2)) * scale  # (KVH, B, G, T)
        padding = torch.arange(max_ctx).unsqueeze(0) >= ctx_lens.unsqueeze(1)  # (B, T)
        scores.masked_fill_(padding.view(1, batch, 1, max_ctx), float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1), values)  # (KVH, B, G, D)
        return out.transpose(0, 1).reshape(batch, num_heads, head_dim)

    # ------------------------------------------------------------------------- whole decode layers
    def fused_decode_layers(self, model, x: torch.Tensor, caches, meta) -> bool:
        """Runs every layer of a decode-only step in one kernel call each, updating x in place; False
        (nothing done) where this backend or the step cannot."""
        return False

    # ------------------------------------------------------------------------------------ sampling
    has_sampler_kernel = False


class CKernelBackend(TorchBackend):
    """The C kernels (kernels/*.c) for the shapes they run; the reference for the others."""
    name = "c"
    FUSED_DECODE_MAX_ROWS = 64  # decode steps up to this many rows run each layer as one kernel call

    def __init__(self, lib: ctypes.CDLL, build_key: str, isa: str, num_threads: int):
        self.lib, self.build_key, self.isa = lib, build_key, isa
        lib.ns_set_num_threads(num_threads)
        self._layers: dict[int, tuple] = {}  # id(DecoderLayer) -> (its block weights, C struct), built once
        # the model whose layers' structs (None where one cannot run fused) were gathered last, and them: looked
        # up once per model, not per step (30 layers' Module attribute lookups were ~0.2 ms of a decode step)
        self._model_layers: tuple = (None, [])
        self._caches: dict[int, tuple] = {}  # id(KVCache) -> (k, v, KVCacheRef)

    # ---------------------------------------------------------------------------- matrix products
    def prepare(self, model) -> int:
        """Nothing to copy: the kernels multiply the weights in their file's form."""
        return 0

    def linear(self, x, layer, int8):
        x = x.contiguous()
        out = torch.empty(x.shape[0], layer.out_features)
        args = abi.LinearArgs(check("linear", "x", x, torch.float32, ("M", layer.in_features), {}), out.data_ptr(),
                              ctypes.addressof(self.weight_chain(layer)), x.shape[0], int(int8))
        self.lib.ns_linear(args)
        return out

    @staticmethod
    def block_weight(part: QuantWeight, out_col: int, out_stride: int):
        """One matrix as the BlockWeight struct the kernels read (its data pointer checked)."""
        data = check("BlockWeight", "data", part.data, part.data.dtype, (part.shape[0], None), {})
        return abi.BlockWeight(data, None, part.type_code, part.shape[0], part.k,
                               part.data.shape[1] * part.data.element_size(), out_col, out_stride)

    def weight_chain(self, layer):
        """The layer's parts as linked BlockWeight structs (the first returned), built once per layer."""
        if layer.c_struct is None:
            structs, col = [], 0
            for part in layer.parts:
                structs.append(self.block_weight(part, col, layer.out_features))
                col += part.shape[0]
            for a, b in zip(structs, structs[1:]):
                a.next = ctypes.addressof(b)
            layer.c_struct = structs
        return layer.c_struct[0]

    def weight_linear(self, x: torch.Tensor, w: QuantWeight, int8: bool) -> torch.Tensor:
        """x (M, K) float32 times one QuantWeight (N, K) -> (M, N) (kernel tests)."""
        from nanoserve.model.layers import Linear

        layer = Linear(w.k, w.shape[0])
        layer.set_weight([w])
        return self.linear(x, layer, int8)

    def embedding(self, embedding, ids):
        w = embedding.weight
        if embedding.c_struct is None or embedding.c_struct[0] is not w:  # built once per weight
            embedding.c_struct = (w, self.block_weight(w, 0, w.k))
        out = torch.empty(ids.shape[0], w.k)
        outside = self.lib.ns_gather_rows(abi.GatherRowsArgs(
            ctypes.addressof(embedding.c_struct[1]), check("gather_rows", "ids", ids, torch.int64, ("T",), {}),
            out.data_ptr(), ids.shape[0]))
        if outside:
            raise IndexError(f"embedding: {outside} token ids outside the vocabulary 0..{w.shape[0] - 1}")
        return out

    # ------------------------------------------------------------------------- elementwise steps
    def rms_norm(self, x, weight, eps):
        if x.dim() != 2 or x.dtype != torch.float32:
            return super().rms_norm(x, weight, eps)
        x = x.contiguous()
        sizes: dict = {}
        out = torch.empty_like(x)
        self.lib.ns_rms_norm(abi.RmsNormArgs(
            check("rms_norm", "x", x, torch.float32, ("rows", "dim"), sizes),
            check("rms_norm", "weight", weight, torch.float32, ("dim",), sizes), out.data_ptr(),
            x.shape[0], x.shape[1], eps))
        return out

    def silu_mul(self, gate_up):
        if gate_up.dim() != 2 or gate_up.dtype != torch.float32 or gate_up.shape[1] % 2:
            return super().silu_mul(gate_up)
        gate_up = gate_up.contiguous()
        rows, width = gate_up.shape
        out = torch.empty(rows, width // 2)
        self.lib.ns_silu_mul(abi.SiluMulArgs(check("silu_mul", "gate_up", gate_up, torch.float32, (rows, width), {}),
                                             out.data_ptr(), rows, width // 2))
        return out

    def cache_ref(self, cache):
        """The KVCacheRef of one layer's cache, built once (the cache tensors live as long as the runner)."""
        found = self._caches.get(id(cache))
        if found is None or found[0] is not cache.k or found[1] is not cache.v:
            sizes: dict = {}
            kv = (torch.float32, torch.float16)
            ref = abi.KVCacheRef(check("kv_cache", "k", cache.k, kv, ("KVH", "S", "D"), sizes),
                                 check("kv_cache", "v", cache.v, cache.k.dtype, ("KVH", "S", "D"), sizes),
                                 cache.k.shape[1], int(cache.k.dtype == torch.float16))
            found = self._caches[id(cache)] = (cache.k, cache.v, ref)
        return found[2]

    def rope_write_kv(self, qkv, num_heads, num_kv_heads, head_dim, cos, sin, cache, slots):
        if qkv.dtype != torch.float32 or qkv.stride(1) != 1:
            return super().rope_write_kv(qkv, num_heads, num_kv_heads, head_dim, cos, sin, cache, slots)
        s = {"T": qkv.shape[0], "D": head_dim}
        check("rope_write_kv", "qkv", qkv, torch.float32, ("T", (num_heads + 2 * num_kv_heads) * head_dim), s,
              contiguous=False)
        cache_ref = self.cache_ref(cache)
        if cache.k.shape[2] != head_dim:
            raise abi.KernelArgumentError(f"rope_write_kv: cache head_dim {cache.k.shape[2]} != {head_dim}")
        self.lib.ns_rope_write_kv(abi.RopeWriteKVArgs(
            qkv.data_ptr(), check("rope_write_kv", "cos", cos, torch.float32, ("T", "D"), s),
            check("rope_write_kv", "sin", sin, torch.float32, ("T", "D"), s),
            check("rope_write_kv", "slots", slots, torch.int64, ("T",), s), ctypes.addressof(cache_ref),
            qkv.stride(0), qkv.shape[0], num_heads, num_kv_heads, head_dim))

    # ----------------------------------------------------------------------------------- attention
    attends_prompts_as_decodes = True

    def decode_attention_fits(self, cache_dtype: torch.dtype, head_dim: int) -> bool:
        """The C decode attention reads a float32 cache, or a float16 one with head_dim a multiple of 8."""
        return cache_dtype == torch.float32 or (cache_dtype == torch.float16 and head_dim % 8 == 0)

    def decode_attention(self, q, cache, slots, ctx_lens, scale):
        batch, num_heads, head_dim = q.shape
        if not self.decode_attention_fits(cache.k.dtype, head_dim):
            return super().decode_attention(q, cache, slots, ctx_lens, scale)
        q = q.contiguous()
        s = {"B": batch, "D": head_dim}
        check("decode_attention", "slots", slots, torch.int64, ("B", None), s, contiguous=False)
        if slots.stride(1) != 1 or slots.stride(0) not in (0, slots.shape[1]):
            slots = slots.contiguous()  # rows one after the other, or one row for all (stride 0)
        cache_ref = self.cache_ref(cache)
        if cache.k.shape[2] != head_dim or num_heads % cache.k.shape[0]:
            raise abi.KernelArgumentError(f"decode_attention: q {tuple(q.shape)} does not fit the cache "
                                          f"{tuple(cache.k.shape)}")
        out = torch.empty_like(q)
        self.lib.ns_decode_attention(abi.DecodeAttentionArgs(
            check("decode_attention", "q", q, torch.float32, ("B", num_heads, "D"), s), out.data_ptr(),
            slots.data_ptr(), check("decode_attention", "ctx_lens", ctx_lens, torch.int64, ("B",), s),
            ctypes.addressof(cache_ref), batch, num_heads, cache.k.shape[0], head_dim, slots.stride(0), scale))
        return out

    # ------------------------------------------------------------------------- whole decode layers
    def layer_struct(self, layer):
        """The layer's weights as one DecodeLayerWeights, built once, or None when the layer cannot run as
        one call: a projection with a bias, q/k norms."""
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if attn.qk_norm or any(p.bias is not None for p in linears):
            return None
        found = self._layers.get(id(layer))
        if found is None or found[0] is not layer:
            s = {"hidden": layer.input_layernorm.weight.shape[0]}
            ln1 = check("decode_layer", "ln1", layer.input_layernorm.weight, torch.float32, ("hidden",), s)
            ln2 = check("decode_layer", "ln2", layer.post_attention_layernorm.weight, torch.float32, ("hidden",), s)
            struct = abi.DecodeLayerWeights(
                ln1, ln2, *[ctypes.addressof(self.weight_chain(p)) for p in linears], s["hidden"], mlp.intermediate,
                attn.num_heads, attn.num_kv_heads, attn.head_dim, layer.input_layernorm.eps, attn.scale)
            found = self._layers[id(layer)] = (layer, struct)
        return found[1]

    def fused_decode_layers(self, model, x, caches, meta):
        """Decode rows only, few enough for the block kernels, a cache the decode attention reads,
        head_dim a multiple of 8, and every layer on blocks without biases or q/k norms."""
        rows, head_dim = x.shape[0], model.config.head_dim
        if not (meta.num_decodes == rows and not meta.prefills and 0 < rows <= self.FUSED_DECODE_MAX_ROWS
                and head_dim % 8 == 0 and self.decode_attention_fits(caches[0].k.dtype, head_dim)):
            return False
        if self._model_layers[0] is not model:
            self._model_layers = (model, [self.layer_struct(layer) for layer in model.layers])
        layers = self._model_layers[1]
        if any(w is None for w in layers):
            return False
        cfg = model.config
        s = {"M": rows, "D": head_dim}
        work = torch.empty(self.lib.ns_decode_layer_work_floats(layers[0], rows))
        step = abi.DecodeStep(
            check("decode_layer", "x", x, torch.float32, ("M", cfg.hidden_size), s),
            check("decode_layer", "cos", meta.rope_cos, torch.float32, ("M", "D"), s),
            check("decode_layer", "sin", meta.rope_sin, torch.float32, ("M", "D"), s),
            check("decode_layer", "slot_mapping", meta.slot_mapping, torch.int64, ("M",), s),
            check("decode_layer", "decode_slots", meta.decode_slots, torch.int64, ("M", "T"), s),
            check("decode_layer", "ctx_lens", meta.decode_ctx_lens, torch.int64, ("M",), s),
            work.data_ptr(), rows, s["T"], int(meta.int8_activations))
        for weights, cache in zip(layers, caches):
            self.lib.ns_decode_layer(weights, self.cache_ref(cache), step)
        return True

    # ------------------------------------------------------------------------------------ sampling
    has_sampler_kernel = True

    def sample_rows(self, logits, work, tokens, *, temperature, min_p, top_k, top_p, keys, allowed, allowed_row,
                    ban_offsets, ban_tokens, bias_offsets, bias_tokens, bias_values, seen_tokens, num_seen,
                    output_counts, penalty_row, repetition, frequency, presence, write_work: bool) -> None:
        """The sampler's chain (kernels/sampling.c) for logits (B, V); see abi.h's SampleArgs."""
        k = "sample_rows"
        s = {"B": logits.shape[0], "V": logits.shape[1], "B+1": logits.shape[0] + 1}
        f32, i64, i32 = torch.float32, torch.int64, torch.int32
        args = abi.SampleArgs(
            check(k, "logits", logits, f32, ("B", "V"), s),
            check(k, "work", work, f32, ("B", "V") if write_work else (None,), s),
            check(k, "temperature", temperature, f32, ("B",), s), check(k, "min_p", min_p, f32, ("B",), s),
            check(k, "top_k", top_k, i64, ("B",), s), check(k, "top_p", top_p, f32, ("B",), s),
            check(k, "keys", keys, i64, ("B", 2), s), check(k, "allowed", allowed, i32, (None, None), s),
            check(k, "allowed_row", allowed_row, i64, ("B",), s),
            check(k, "ban_offsets", ban_offsets, i64, ("B+1",), s), check(k, "ban_tokens", ban_tokens, i64, (None,), s),
            check(k, "bias_offsets", bias_offsets, i64, ("B+1",), s),
            check(k, "bias_tokens", bias_tokens, i64, ("NB",), s), check(k, "bias_values", bias_values, f32, ("NB",), s),
            check(k, "seen_tokens", seen_tokens, i32, ("R", None), s), check(k, "num_seen", num_seen, i64, ("R",), s),
            check(k, "output_counts", output_counts, i32, (None, None), s),
            check(k, "penalty_row", penalty_row, i64, ("B",), s), check(k, "repetition", repetition, f32, ("B",), s),
            check(k, "frequency", frequency, f32, ("B",), s), check(k, "presence", presence, f32, ("B",), s),
            check(k, "tokens", tokens, i64, ("B",), s), int(write_work), s["B"], s["V"], seen_tokens.shape[1])
        if bool((allowed_row >= 0).any()) and allowed.shape[1] != (s["V"] + 31) // 32:
            raise abi.KernelArgumentError(f"{k}: allowed must be packed masks of {(s['V'] + 31) // 32} words "
                                          f"(one bit per token), got {allowed.shape[1]}")
        if bool((allowed_row >= allowed.shape[0]).any()):
            raise abi.KernelArgumentError(f"{k}: allowed_row past the {allowed.shape[0]} masks")
        if bool((penalty_row >= 0).any()) and output_counts.shape[1] != s["V"]:
            raise abi.KernelArgumentError(f"{k}: output_counts must have one column per token ({s['V']})")
        self.lib.ns_sample_rows(args)


def select_backend(choice: str, num_threads: int, target: Optional[str] = None):
    """The backend for `--kernels choice`: "c" must build and load (the vector build where the CPU runs
    it, else the portable one) or raises `RuntimeError` naming the option and the reason; "torch" is
    PyTorch; "auto" is the vector C build where it can run, else "torch", with the reason logged once
    (in full for a compile error). `target`: a kernel build target by name (tests of the portable
    build); by default the fastest this CPU runs."""
    from nanoserve.kernels.build import X86_64_V3, KernelBuildError, fits, load_library

    if choice not in KERNEL_CHOICES:
        raise ValueError(f"kernels must be one of {list(KERNEL_CHOICES)}, got {choice!r}")
    if choice == "torch":
        if target is not None:
            raise ValueError(f"--kernel-target {target}: the PyTorch backend (--kernels torch) runs no C kernels")
        return TorchBackend()
    missing = fits(X86_64_V3)
    if choice == "auto" and target is None and missing:
        # NOTE: the portable build is correct everywhere but slow (docs/benchmarks.md, "Backends": batch-1
        # decode 7.3 tok/s against PyTorch's 11.9, 16 prompts 6.0 against 85.6), so auto prefers PyTorch.
        logger.warning("C kernels: this CPU lacks %s (the vector kernels need %s); running on the PyTorch "
                       "backend, faster here than the portable C build (--kernels c runs that one)",
                       ", ".join(missing), X86_64_V3.name)
        return TorchBackend()
    try:
        lib, key, built_for = load_library(target)
        abi.bind(lib)
    except (KernelBuildError, RuntimeError, OSError) as exc:
        if choice == "c":
            raise RuntimeError(f"--kernels c: the C kernels cannot run here: {exc}") from None
        logger.warning("C kernels unavailable, running on the PyTorch backend: %s\n(choose it on purpose, and "
                       "silence this, with --kernels torch or NANOSERVE_KERNELS=torch)", exc)
        return TorchBackend()
    return CKernelBackend(lib, key, built_for.name, num_threads)
