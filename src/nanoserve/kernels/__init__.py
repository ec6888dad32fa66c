"""Small C kernels for the CPU hot spots PyTorch has no fused op for (paged decode attention),
compiled with the system C compiler on first use into a per-user cache and loaded with ctypes.
When no compiler is available, callers fall back to the pure PyTorch path."""
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
_SOURCE = os.path.join(os.path.dirname(__file__), "decode_attention.c")
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
    with open(_SOURCE, "rb") as f:
        digest = hashlib.sha256(f.read() + os.uname().machine.encode()).hexdigest()[:16]
    path = os.path.join(cache_dir("kernels"), f"decode_attention-{digest}.so")
    try:
        if not os.path.isfile(path):
            os.makedirs(cache_dir("kernels"), exist_ok=True)
            cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
            tmp = f"{path}.{os.getpid()}.tmp"
            subprocess.run([*cc.split(), "-O3", "-march=native", "-fassociative-math", "-fno-signed-zeros",
                            "-fno-trapping-math", "-fopenmp", "-shared",
                            "-fPIC", _SOURCE, "-o", tmp, "-lm"], check=True, capture_output=True, timeout=120)
            os.replace(tmp, path)
        lib = ctypes.CDLL(path)
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("C kernels unavailable, using the PyTorch attention path: %s", exc)
        return None
    i64, f32p = ctypes.c_int64, ctypes.c_void_p
    lib.decode_attention_f32.argtypes = [f32p] * 6 + [i64] * 6 + [ctypes.c_float]
    lib.decode_attention_f32.restype = None
    _lib = lib
    return lib


def decode_attention(lib: ctypes.CDLL, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slots: torch.Tensor, ctx_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q: (B, H, D) float32; caches (KVH, S, D); slots (B, T) int64; ctx_lens (B,) int64."""
    q = q.contiguous()
    batch, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    lib.decode_attention_f32(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(),
                             ctx_lens.data_ptr(), out.data_ptr(), batch, num_heads, k_cache.shape[0],
                             head_dim, k_cache.shape[1], slots.shape[1], scale)
    return out
