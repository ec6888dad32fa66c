"""The typed boundary to the C kernels: ctypes mirrors of abi.h's argument structs, built by reading
that header (one definition of each layout, checked against the library's own sizeof() at load), and
`check`, which validates every tensor before its pointer goes into a struct.

Why ctypes structs and not `torch.library` custom ops: a custom op costs ~10-30 us of dispatch per call
and checks only that an argument is a tensor, not its dtype, rank or shape; the decode path makes
hundreds of calls per step. Here each kernel takes one struct pointer, the wrapper checks dtypes and
shapes (a swapped argument raises `KernelArgumentError`), and the ABI version is compared at load."""
from __future__ import annotations

import ctypes
import os
import re
from typing import Optional

import torch

ABI_HEADER = os.path.join(os.path.dirname(__file__), "abi.h")
_CTYPES = {"int64_t": ctypes.c_int64, "float": ctypes.c_float}


class KernelArgumentError(TypeError):
    """A kernel was called with a tensor of the wrong dtype, rank, shape or layout."""


def _parse_header(text: str) -> tuple[int, dict[str, type]]:
    """NS_ABI_VERSION and one ctypes.Structure per `typedef struct {...} Name;` of abi.h."""
    version = int(re.search(r"#define NS_ABI_VERSION (\d+)", text).group(1))
    structs: dict[str, type] = {}
    for body, name in re.findall(r"^typedef struct \{(.*?)^\} (\w+);", text, re.S | re.M):
        fields = []
        for line in body.strip().splitlines():
            decl = re.fullmatch(r"\s*(?:const )?(\w+) (\*?)(\w+);", line)
            if decl is None or (not decl.group(2) and decl.group(1) not in _CTYPES):
                raise ValueError(f"abi.h: cannot read the field {line.strip()!r} of {name}")
            ctype, pointer, field = decl.groups()
            fields.append((field, ctypes.c_void_p if pointer else _CTYPES[ctype]))
        structs[name] = type(name, (ctypes.Structure,), {"_fields_": fields})
    return version, structs


with open(ABI_HEADER) as _f:
    ABI_VERSION, STRUCTS = _parse_header(_f.read())
BlockWeight = STRUCTS["BlockWeight"]
LinearArgs = STRUCTS["LinearArgs"]
GatherRowsArgs = STRUCTS["GatherRowsArgs"]
RmsNormArgs = STRUCTS["RmsNormArgs"]
SiluMulArgs = STRUCTS["SiluMulArgs"]
KVCacheRef = STRUCTS["KVCacheRef"]
RopeWriteKVArgs = STRUCTS["RopeWriteKVArgs"]
DecodeAttentionArgs = STRUCTS["DecodeAttentionArgs"]
DecodeLayerWeights = STRUCTS["DecodeLayerWeights"]
DecodeStep = STRUCTS["DecodeStep"]
SampleArgs = STRUCTS["SampleArgs"]

# Exported kernels: name -> (argument struct types (passed by pointer), return type).
_P = ctypes.POINTER
ENTRY_POINTS = {
    "ns_linear": ([LinearArgs], None),
    "ns_gather_rows": ([GatherRowsArgs], ctypes.c_int64),
    "ns_rms_norm": ([RmsNormArgs], None),
    "ns_silu_mul": ([SiluMulArgs], None),
    "ns_rope_write_kv": ([RopeWriteKVArgs], None),
    "ns_decode_attention": ([DecodeAttentionArgs], None),
    "ns_decode_layer": ([DecodeLayerWeights, KVCacheRef, DecodeStep], None),
    "ns_decode_layer_work_floats": ([DecodeLayerWeights, ctypes.c_int64], ctypes.c_int64),
    "ns_sample_rows": ([SampleArgs], None),
    "ns_set_num_threads": ([ctypes.c_int64], None),
    "ns_num_threads": ([], ctypes.c_int64),
}


def bind(lib: ctypes.CDLL) -> None:
    """Checks the library's ABI version and struct sizes against this module's, and types its entry
    points; raises `RuntimeError` on any mismatch (a library built from other sources)."""
    lib.ns_abi_version.restype = ctypes.c_int64
    found = lib.ns_abi_version()
    if found != ABI_VERSION:
        raise RuntimeError(f"kernel library ABI version {found}, expected {ABI_VERSION}")
    lib.ns_struct_size.restype = ctypes.c_int64
    lib.ns_struct_size.argtypes = [ctypes.c_char_p]
    for name, struct in STRUCTS.items():
        size = lib.ns_struct_size(name.encode())
        if size != ctypes.sizeof(struct):
            raise RuntimeError(f"kernel struct {name}: {size} bytes in C, {ctypes.sizeof(struct)} in Python")
    for name, (args, restype) in ENTRY_POINTS.items():
        fn = getattr(lib, name)
        fn.argtypes = [a if a is ctypes.c_int64 else _P(a) for a in args]
        fn.restype = restype


def check(kernel: str, name: str, t: torch.Tensor, dtype, shape: tuple, sizes: dict,
          contiguous: bool = True) -> int:
    """Validates argument `name` of `kernel` and returns its data pointer. `dtype` is a torch dtype or
    a tuple of them; `shape` lists ints or symbol names, bound in `sizes` on first sight and compared
    after (None: any size)."""
    if not isinstance(t, torch.Tensor):
        raise KernelArgumentError(f"{kernel}: {name} must be a tensor, got {type(t).__name__}")
    if t.dtype != dtype and not (isinstance(dtype, tuple) and t.dtype in dtype):
        raise KernelArgumentError(f"{kernel}: {name} must be {dtype}, got {t.dtype}")
    if t.dim() != len(shape):
        raise KernelArgumentError(f"{kernel}: {name} must have {len(shape)} dimensions {shape}, got {tuple(t.shape)}")
    for axis, (want, got) in enumerate(zip(shape, t.shape)):
        if isinstance(want, str):
            want = sizes.setdefault(want, got)
        if want is not None and want != got:
            raise KernelArgumentError(f"{kernel}: {name} has shape {tuple(t.shape)}; dimension {axis} must be "
                                      f"{want} ({shape})")
    if contiguous and not t.is_contiguous():
        raise KernelArgumentError(f"{kernel}: {name} must be contiguous")
    if t.device.type != "cpu":
        raise KernelArgumentError(f"{kernel}: {name} must be on the CPU")
    return t.data_ptr()


def pointer(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()
