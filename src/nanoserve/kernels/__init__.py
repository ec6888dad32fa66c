"""Small C kernels for the CPU hot spots PyTorch has no fused op for (paged decode attention, matrix
products on 4/8-bit weight blocks with float32 or int8 activations, fused elementwise layer steps, the
sampler's whole chain), compiled with the system C compiler on first use into a per-user cache and
loaded with ctypes. When no compiler is available, callers fall back to PyTorch."""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
import sysconfig
from typing import Optional

import torch

from nanoserve.cache import cache_dir

logger = logging.getLogger(__name__)
_DIR = os.path.dirname(__file__)
_SOURCES = [os.path.join(_DIR, name)
            for name in ("decode_attention.c", "block_linear.c", "int8_gemm.c", "elementwise.c", "sampling.c",
                         "decode_layer.c")]
_HEADERS = [os.path.join(_DIR, "vec_math.h")]
_i64, _ptr, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
# Every exported kernel (all return void) and its arguments: pointers, int64 sizes, float scalars.
_SIGNATURES = {
    "decode_attention_f32": [_ptr] * 6 + [_i64] * 7 + [_f32],  # ..., num_slots, slot_stride, kv_f16, scale
    "q4_linear_f32": [_ptr] * 5 + [_i64] * 3,
    "q8_linear_f32": [_ptr] * 4 + [_i64] * 3,
    "block_gemm_f32": [_ptr] * 5 + [_i64] * 3,
    "q4_gemm_i8": [_ptr] * 5 + [_i64] * 3,
    "rms_norm_f32": [_ptr] * 3 + [_i64] * 2 + [_f32],
    "silu_mul_f32": [_ptr] * 2 + [_i64] * 2,
    "rope_write_kv_f32": [_ptr, _i64, _ptr, _i64] + [_ptr] * 5 + [_i64] * 6,
    "sample_rows": [_ptr, _ptr, _i64, _i64, _i64] + [_ptr] * 14 + [_i64] + [_ptr] * 6,
    "decode_layer_f32": [_ptr] + [_i64] * 6 + [_ptr] * 2 + [_f32] + [_ptr] * 5 + [_i64] * 2 + [_ptr] * 3
                        + [_i64, _f32, _i64, _ptr],
}
_lib: Optional[ctypes.CDLL] = None
_tried = False


def load() -> Optional[ctypes.CDLL]:
    """The compiled kernel library, or None when it cannot be built (disable: NANOSERVE_NO_KERNELS=1)."""
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    if os.environ.get("NANOSERVE_NO_KERNELS"):
        return None
    digest = hashlib.sha256(os.uname().machine.encode())
    for source in _SOURCES + _HEADERS:
        with open(source, "rb") as f:
            digest.update(f.read())
    path = os.path.join(cache_dir("kernels"), f"nanoserve-kernels-{digest.hexdigest()[:16]}.so")
    try:
        if not os.path.isfile(path):
            os.makedirs(cache_dir("kernels"), exist_ok=True)
            cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
            tmp = f"{path}.{os.getpid()}.tmp"
            subprocess.run([*cc.split(), "-O3", "-march=native", "-fassociative-math", "-fno-signed-zeros",
                            "-fno-trapping-math", "-fopenmp", "-shared",
                            "-fPIC", *_SOURCES, "-o", tmp, "-lm"], check=True, capture_output=True, timeout=120)
            os.replace(tmp, path)
        lib = ctypes.CDLL(path)
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("C kernels unavailable, using the PyTorch attention path: %s", exc)
        return None
    for name, argtypes in _SIGNATURES.items():
        getattr(lib, name).argtypes = argtypes
        getattr(lib, name).restype = None
    _lib = lib
    return lib


def decode_attention(lib: ctypes.CDLL, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slots: torch.Tensor, ctx_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q: (B, H, D) float32; caches (KVH, S, D) float32, or float16 with D a multiple of 8; slots (B, T)
    int64 with contiguous rows, or one (T,) list expanded to (B, T) (stride 0) for rows of one sequence;
    ctx_lens (B,) int64."""
    f16 = k_cache.dtype == torch.float16
    assert k_cache.dtype in (torch.float32, torch.float16) and (not f16 or q.shape[-1] % 8 == 0)
    assert slots.stride(1) == 1
    q = q.contiguous()
    batch, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    lib.decode_attention_f32(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(),
                             ctx_lens.data_ptr(), out.data_ptr(), batch, num_heads, k_cache.shape[0],
                             head_dim, k_cache.shape[1], slots.stride(0), int(f16), scale)
    return out


def quantize_q4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(N, K) float weights -> 4-bit blocks of 32 along K: packed nibbles (N, K/2) uint8, scales d and
    minimums m (N, K/32) float16, with w ~= d * q + m. Weights that came from a GGUF Q4_1 block
    (float16 d and m; a block uses both ends of its 0..15 range) come back exactly."""
    n, k = w.shape
    blocks = w.float().reshape(n, k // 32, 32)
    lo = blocks.amin(dim=-1).half().float()
    d = ((blocks.amax(dim=-1) - lo) / 15).half().float()
    q = torch.where(d.unsqueeze(-1) > 0, (blocks - lo.unsqueeze(-1)) / d.clamp(min=1e-30).unsqueeze(-1),
                    torch.zeros_like(blocks)).round_().clamp_(0, 15).to(torch.uint8)
    packed = q[..., :16] | (q[..., 16:] << 4)  # byte j: weight j (low nibble), weight j + 16 (high)
    return packed.reshape(n, k // 2).contiguous(), d.half().contiguous(), lo.half().contiguous()


def dequantize_q4(packed: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    n, nb = d.shape
    nibbles = packed.reshape(n, nb, 16)
    q = torch.cat([nibbles & 15, nibbles >> 4], dim=-1).float()  # (N, nb, 32)
    return (q * d.float().unsqueeze(-1) + m.float().unsqueeze(-1)).reshape(n, nb * 32)


def quantize_q8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float weights -> 8-bit blocks of 32 along K: q (N, K) int8 and float16 scales d (N, K/32),
    with w ~= d * q. Exact for weights from a GGUF Q8_0 tensor."""
    n, k = w.shape
    blocks = w.float().reshape(n, k // 32, 32)
    d = (blocks.abs().amax(dim=-1) / 127).half().float()
    q = (blocks / d.clamp(min=1e-30).unsqueeze(-1)).round_().clamp_(-127, 127).to(torch.int8)
    return q.reshape(n, k).contiguous(), d.half().contiguous()


def dequantize_q8(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    n, nb = d.shape
    return (q.reshape(n, nb, 32).float() * d.float().unsqueeze(-1)).reshape(n, nb * 32)


def block_linear(lib: ctypes.CDLL, x: torch.Tensor, blocks: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """x (M, K) float32 -> (M, N) with a weight from `quantize_q4` (3 tensors) or `quantize_q8` (2)."""
    x = x.contiguous()
    n = blocks[0].shape[0]
    out = torch.empty(x.shape[0], n, dtype=torch.float32)
    if len(blocks) == 3:
        packed, d, m = blocks
        lib.q4_linear_f32(x.data_ptr(), packed.data_ptr(), d.data_ptr(), m.data_ptr(), out.data_ptr(),
                          x.shape[0], x.shape[1], n)
    else:
        q, d = blocks
        lib.q8_linear_f32(x.data_ptr(), q.data_ptr(), d.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], n)
    return out


def block_gemm(lib: ctypes.CDLL, x: torch.Tensor, blocks: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """`block_linear` for steps with more rows: dequantizes groups of weight rows once per call and
    multiplies every row of x against them (see block_gemm_f32 in block_linear.c)."""
    x = x.contiguous()
    n = blocks[0].shape[0]
    out = torch.empty(x.shape[0], n, dtype=torch.float32)
    mins = blocks[2].data_ptr() if len(blocks) == 3 else None
    lib.block_gemm_f32(x.data_ptr(), blocks[0].data_ptr(), blocks[1].data_ptr(), mins, out.data_ptr(),
                       x.shape[0], x.shape[1], n)
    return out


def q4_gemm_i8(lib: ctypes.CDLL, x: torch.Tensor, blocks: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """`block_gemm` for a 4-bit weight with x quantized to 8 bits per block of 32 (llama.cpp's way):
    faster, and lossy (see int8_gemm.c)."""
    x = x.contiguous()
    packed, d, m = blocks
    out = torch.empty(x.shape[0], packed.shape[0], dtype=torch.float32)
    lib.q4_gemm_i8(x.data_ptr(), packed.data_ptr(), d.data_ptr(), m.data_ptr(), out.data_ptr(), x.shape[0],
                   x.shape[1], packed.shape[0])
    return out


def silu_mul(lib: ctypes.CDLL, gate_up: torch.Tensor) -> torch.Tensor:
    """(T, 2I) float32, gate then up -> (T, I) silu(gate) * up."""
    gate_up = gate_up.contiguous()
    rows, width = gate_up.shape
    out = torch.empty(rows, width // 2, dtype=torch.float32)
    lib.silu_mul_f32(gate_up.data_ptr(), out.data_ptr(), rows, width // 2)
    return out


def rope_write_kv(lib: ctypes.CDLL, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                  cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slots: torch.Tensor) -> None:
    """qkv: (T, (H + 2 KVH) D) float32 with contiguous rows (q heads, k heads, v heads): rotates q and k
    in place with cos, sin (T, D) and writes k and v into the caches (KVH, num_slots, D) at `slots`, float32
    or float16."""
    assert qkv.stride(1) == 1 and cos.is_contiguous() and sin.is_contiguous() and slots.is_contiguous()
    v_offset = (num_heads + num_kv_heads) * head_dim * qkv.element_size()
    lib.rope_write_kv_f32(qkv.data_ptr(), qkv.stride(0), qkv.data_ptr() + v_offset, qkv.stride(0), cos.data_ptr(),
                          sin.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), qkv.shape[0],
                          num_heads, num_kv_heads, head_dim, k_cache.shape[1], int(k_cache.dtype == torch.float16))


def rms_norm(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of a contiguous float32 (rows, dim) tensor."""
    x = x.contiguous()
    out = torch.empty_like(x)
    lib.rms_norm_f32(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[-1], eps)
    return out
