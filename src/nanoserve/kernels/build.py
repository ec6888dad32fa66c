"""Compiles the C kernels for one named instruction-set target (x86-64-v3, or a portable build of the
same sources for any other CPU) and loads the result, never a library built from other sources, by
another compiler, with other flags, or for a CPU this one is not.

The build key hashes everything that shapes the code: the sources, the compiler's path and version,
the flags and the target. The library carries its key and the ISA features it was compiled for
(entry.c); a cached file whose key differs, or that needs a feature this CPU lacks, is removed and
rebuilt, never called. Builds not used for `PRUNE_AFTER_DAYS` are pruned."""
from __future__ import annotations

import ctypes
import glob
import hashlib
import logging
import os
import platform
import subprocess
import sysconfig
import time
from dataclasses import dataclass
from typing import Optional

from nanoserve.cache import cache_dir

logger = logging.getLogger(__name__)
KERNEL_DIR = os.path.dirname(__file__)
SOURCES = ["entry.c", "decode_attention.c", "weight_linear.c", "int8_gemm.c", "k_quant_i8.c", "elementwise.c", "sampling.c"]
HEADERS = ["abi.h", "vec_math.h", "simd.h", "vec_portable.h", "quant_blocks.h", "quantized_rows.h"]



@dataclass(frozen=True)
class Target:
    """One instruction-set target: its compiler flags and the CPU features (/proc/cpuinfo names) a
    host needs to run it."""
    name: str
    flags: tuple[str, ...]
    features: tuple[str, ...] = ()


# The vector code is written for x86-64-v3 (AVX2, FMA, F16C), named explicitly instead of
# -march=native so that a build never holds instructions of the CPU that built it (AVX-512 on a build
# host) and one build serves every AVX2 machine sharing a cache. Elsewhere the same sources compile
# with plain-C definitions of those intrinsics (vec_portable.h) for the architecture's baseline.
X86_64_V3 = Target("x86-64-v3", ("-march=x86-64-v3", "-mtune=generic"),
                   ("avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe"))
_BASELINE = {"x86_64": ("-march=x86-64", "-mtune=generic"), "aarch64": ("-march=armv8-a",)}
PORTABLE = Target("portable", _BASELINE.get(platform.machine().lower().replace("amd64", "x86_64"), ()))
TARGETS = {t.name: t for t in (X86_64_V3, PORTABLE)}
FLAGS = ("-O3", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math", "-fopenmp",
         "-fvisibility=hidden", "-shared", "-fPIC")
PRUNE_AFTER_DAYS = 14


class KernelBuildError(RuntimeError):
    """The kernels cannot be used on this machine; the message says why (in full for a compile error)."""


@dataclass(frozen=True)
class Toolchain:
    compiler: list[str]  # argv prefix, e.g. ["gcc"] or ["ccache", "gcc"]
    version: str  # the compiler's own `--version` first line


def cpu_features() -> set[str]:
    """The host CPU's feature flags as /proc/cpuinfo names them (empty where there is no such file)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def fits(target: Target) -> list[str]:
    """The features `target` needs that this CPU lacks (empty: it runs here)."""
    if target is X86_64_V3 and platform.machine().lower() not in ("x86_64", "amd64"):
        return [f"an x86-64 CPU (this one is {platform.machine()})"]
    return sorted(set(target.features) - cpu_features())


def choose_target(name: Optional[str] = None) -> Target:
    """The named target (`KernelBuildError` if this CPU cannot run it), or the fastest that fits."""
    if name is not None:
        if name not in TARGETS:
            raise KernelBuildError(f"unknown kernel target {name!r} (targets: {', '.join(TARGETS)})")
        missing = fits(TARGETS[name])
        if missing:
            raise KernelBuildError(f"target {name} needs {', '.join(missing)}, which this CPU lacks")
        return TARGETS[name]
    return X86_64_V3 if not fits(X86_64_V3) else PORTABLE


def find_toolchain() -> Toolchain:
    compiler = (os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc").split()
    try:
        out = subprocess.run([*compiler, "--version"], capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelBuildError(f"no working C compiler ({' '.join(compiler)}: {exc})") from None
    return Toolchain(compiler, out.stdout.splitlines()[0].strip() if out.stdout else "unknown")


def build_key(toolchain: Toolchain, target: Target, source_dir: str = KERNEL_DIR) -> str:
    digest = hashlib.sha256()
    for part in (target.name, " ".join(target.flags + FLAGS), " ".join(toolchain.compiler), toolchain.version):
        digest.update(part.encode() + b"\0")
    for name in SOURCES + HEADERS:
        with open(os.path.join(source_dir, name), "rb") as f:
            digest.update(name.encode() + b"\0" + f.read())
    return digest.hexdigest()[:20]


def library_path(key: str, target: Target) -> str:
    return os.path.join(cache_dir("kernels"), f"nanoserve-kernels-{target.name}-{key}.so")


def compile_library(toolchain: Toolchain, target: Target, key: str, path: str, source_dir: str = KERNEL_DIR) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    cmd = [*toolchain.compiler, *target.flags, *FLAGS, f'-DNS_BUILD_KEY="{key}"', *[os.path.join(source_dir, s) for s in SOURCES],
           "-o", tmp, "-lm"]
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelBuildError(f"compiling the C kernels failed: {exc}") from None
    if result.returncode != 0:
        raise KernelBuildError(f"compiling the C kernels failed (exit {result.returncode}):\n$ {' '.join(cmd)}\n"
                               f"{result.stderr.strip()}")
    os.replace(tmp, path)


def verify_library(lib: ctypes.CDLL, key: str) -> None:
    """Raises `KernelBuildError` unless `lib` is the build of `key` and this CPU has every feature it
    was compiled for. Only these two identity functions of the library run before the check."""
    try:
        lib.ns_build_key.restype = ctypes.c_char_p
        lib.ns_isa_features.restype = ctypes.c_char_p
        found = lib.ns_build_key().decode()
        needed = set(lib.ns_isa_features().decode().split())
    except AttributeError:
        raise KernelBuildError("not a nanoserve kernel library") from None
    if found != key:
        raise KernelBuildError(f"built for key {found}, this machine needs {key}")
    missing = sorted(needed - cpu_features())
    if missing:
        raise KernelBuildError(f"compiled for CPU features this CPU lacks: {', '.join(missing)}")


def unload(lib: Optional[ctypes.CDLL]) -> None:
    """dlclose: without it, loading the rebuilt file at the same path would return the old mapping."""
    if lib is not None:
        import _ctypes
        _ctypes.dlclose(lib._handle)


def prune_old_builds(keep: str) -> None:
    """Removes other builds and leftovers not used (loaded) for PRUNE_AFTER_DAYS days."""
    cutoff = time.time() - PRUNE_AFTER_DAYS * 86400
    for path in glob.glob(os.path.join(cache_dir("kernels"), "nanoserve-kernels-*")):
        try:
            if path != keep and os.path.getmtime(path) < cutoff:
                os.remove(path)
        except OSError:
            pass


def load_library(target_name: Optional[str] = None, source_dir: str = KERNEL_DIR) -> tuple[ctypes.CDLL, str, Target]:
    """The compiled kernels for this machine (built on first use), their build key and target (the
    named one, or the fastest that fits this CPU). Raises `KernelBuildError` with the reason when they
    cannot be used here. `source_dir`: where the sources are (another revision's, for
    scripts/kernels_ab.py); the engine's are this package's."""
    target = choose_target(target_name)
    toolchain = find_toolchain()
    key = build_key(toolchain, target, source_dir)
    path = library_path(key, target)
    if os.path.isfile(path):
        lib = None
        try:
            lib = ctypes.CDLL(path)
            verify_library(lib, key)
            os.utime(path)  # marks it used, for pruning
            return lib, key, target
        except (OSError, KernelBuildError) as exc:
            logger.warning("ignoring the cached kernel library %s (%s); rebuilding it", path, exc)
            unload(lib)
            os.remove(path)
    compile_library(toolchain, target, key, path, source_dir)
    lib = ctypes.CDLL(path)
    verify_library(lib, key)
    prune_old_builds(keep=path)
    return lib, key, target

