"""Small C kernels for the CPU hot spots PyTorch has no fused op for (paged decode attention, matrix
products on 4/8-bit weight blocks with float32 or int8 activations, fused elementwise layer steps, whole
decode layers, the sampler's chain), and the backend objects that run them.

`build.py` compiles them for one named target (x86-64-v3, or the portable plain-C build of the same
sources through simd.h) and refuses any other build; `abi.py` is the typed,
checked boundary (one struct per call, defined once in abi.h); `blocks.py` holds the weight blocks and
their PyTorch references; `backend.py` has `TorchBackend` (the reference) and `CKernelBackend`, one of
which `select_backend` picks per engine."""
from nanoserve.kernels.backend import CKernelBackend, TorchBackend, select_backend
from nanoserve.kernels.blocks import BlockWeight, quantize_activations, quantize_q4, quantize_q8

__all__ = ["BlockWeight", "CKernelBackend", "TorchBackend", "quantize_activations", "quantize_q4",
           "quantize_q8", "select_backend"]
