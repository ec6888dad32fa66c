"""Small C kernels for the CPU hot spots PyTorch has no fused op for (paged decode attention, matrix
products straight on weights in their file's form (GGUF block types, 16-bit floats) with float32 or
int8 activations, fused elementwise layer steps, whole decode layers, the sampler's chain), and the
backend objects that run them.

`build.py` compiles them for one named target (x86-64-v3, or the portable plain-C build of the same
sources through simd.h) and refuses any other build; `abi.py` is the typed, checked boundary (one struct
per call, defined once in abi.h); `quant.py` holds the weight type and its PyTorch references
(quant_blocks.h is the kernels' decoder of the same layouts); `backend.py` has `TorchBackend` (the
reference) and `CKernelBackend`, one of which `select_backend` picks per engine."""
from nanoserve.kernels.backend import CKernelBackend, TorchBackend, select_backend
from nanoserve.kernels.quant import QuantWeight, quantize_activations

__all__ = ["CKernelBackend", "QuantWeight", "TorchBackend", "quantize_activations", "select_backend"]
