"""The kernel layer's safety: a cached library built from other sources, flags or for another CPU is
never called; a build error is reported in full, and `--kernels c` then fails at start; a kernel called
with swapped or mistyped arguments raises instead of corrupting memory; explicit engine options that
cannot run fail at start with a message naming the option."""
import ctypes
import logging
import os
import subprocess
import sys
import time

import pytest
import torch

from backends import C, TORCH, requires_kernels
from nanoserve.kernels import abi, build, select_backend
from nanoserve.kernels.quant import random_weight
from nanoserve.kernels.abi import KernelArgumentError


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path))
    return tmp_path


def fake_library(path, key: str, features: str) -> None:
    """A shared library that answers the loader's identity questions with `key` and `features`."""
    src = path.with_suffix(".c")
    src.write_text('const char *ns_build_key(void) { return "%s"; }\n'
                   'const char *ns_isa_features(void) { return "%s"; }\n' % (key, features))
    subprocess.run(["cc", "-shared", "-fPIC", str(src), "-o", str(path)], check=True)


@requires_kernels
def test_a_foreign_library_in_the_cache_is_replaced_not_loaded(empty_cache, caplog):
    """A library planted under this machine's cache name, built for another key (other sources, compiler,
    flags or target: what a shared cache can hold), is refused and rebuilt; so is one whose key matches
    but that was compiled for CPU features this CPU lacks (AVX-512 on an AVX2 host)."""
    target = build.choose_target()
    key = build.build_key(build.find_toolchain(), target)
    path = build.library_path(key, target)
    os.makedirs(os.path.dirname(path))
    fake_library(empty_cache / "foreign.so", "0123456789abcdef0123", "avx2 fma")
    os.replace(empty_cache / "foreign.so", path)
    with caplog.at_level(logging.WARNING, logger="nanoserve.kernels.build"):
        lib, loaded_key, _ = build.load_library()
    assert loaded_key == key and lib.ns_build_key() == key.encode()
    assert "built for key 0123456789abcdef0123" in caplog.text
    abi.bind(lib)  # the real library: ABI version and struct sizes agree

    if "avx512f" in build.cpu_features():
        return  # this CPU could run the next library
    fake_library(empty_cache / "wide.so", key, "avx2 fma avx512f avx512bw")
    with pytest.raises(build.KernelBuildError, match="avx512bw, avx512f"):
        build.verify_library(ctypes.CDLL(str(empty_cache / "wide.so")), key)


def test_the_build_key_covers_compiler_flags_and_target(monkeypatch):
    tools, v3 = build.Toolchain(["gcc"], "gcc 12.2.0"), build.X86_64_V3
    key = build.build_key(tools, v3)
    assert build.build_key(build.Toolchain(["gcc"], "gcc 13.1.0"), v3) != key
    assert build.build_key(build.Toolchain(["clang"], "gcc 12.2.0"), v3) != key
    assert build.build_key(tools, build.PORTABLE) != key
    assert build.build_key(tools, build.Target("x86-64-v3", ("-march=x86-64-v4",), v3.features)) != key
    monkeypatch.setattr(build, "FLAGS", build.FLAGS + ("-mavx512f",))
    assert build.build_key(tools, v3) != key


def test_targets_are_chosen_by_what_the_cpu_has(monkeypatch):
    monkeypatch.setattr(build, "cpu_features", lambda: {"sse2", "avx"})  # an x86 CPU without AVX2
    if build.platform.machine() in ("x86_64", "AMD64"):
        assert build.choose_target() is build.PORTABLE
        with pytest.raises(build.KernelBuildError, match="target x86-64-v3 needs .*avx2"):
            build.choose_target("x86-64-v3")
    with pytest.raises(build.KernelBuildError, match="unknown kernel target"):
        build.choose_target("avx1024")
    assert build.choose_target("portable") is build.PORTABLE
    with pytest.raises(ValueError, match="--kernel-target portable: the PyTorch backend"):
        select_backend("torch", 1, "portable")  # an explicit target that nothing would use


def test_auto_prefers_pytorch_to_the_portable_build(monkeypatch, caplog):
    """Where the vector build cannot run, auto takes the PyTorch backend (faster than the portable C
    build) and says why; `--kernels c` would run the portable build."""
    monkeypatch.setattr(build, "cpu_features", lambda: {"sse2"})
    with caplog.at_level(logging.WARNING, logger="nanoserve.kernels.backend"):
        assert select_backend("auto", 1).name == "torch"
    assert "lacks" in caplog.text and "--kernels c" in caplog.text


def test_old_builds_are_pruned(empty_cache):
    folder = empty_cache / "kernels"
    folder.mkdir()
    old, recent, keep = (folder / f"nanoserve-kernels-{n}.so" for n in ("old", "recent", "keep"))
    for f in (old, recent, keep):
        f.write_bytes(b"x")
    month_ago = time.time() - 30 * 86400
    os.utime(old, (month_ago, month_ago))
    os.utime(keep, (month_ago, month_ago))
    build.prune_old_builds(keep=str(keep))
    assert not old.exists() and recent.exists() and keep.exists()


@pytest.fixture
def broken_compiler(tmp_path, monkeypatch, empty_cache):
    cc = tmp_path / "brokencc"
    cc.write_text('#!/bin/sh\nif [ "$1" = --version ]; then echo "brokencc 1.0"; exit 0; fi\n'
                  'echo "entry.c:1: error: this compiler is broken on purpose" >&2\nexit 1\n')
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))


def test_a_build_error_is_shown_in_full_and_explicit_c_kernels_fail(broken_compiler, caplog):
    if not build.fits(build.X86_64_V3):  # else auto takes PyTorch before compiling anything
        with caplog.at_level(logging.WARNING, logger="nanoserve.kernels.backend"):
            assert select_backend("auto", 1).name == "torch"
        assert "this compiler is broken on purpose" in caplog.text and "--kernels torch" in caplog.text
    with pytest.raises(RuntimeError, match="(?s)--kernels c: .*broken on purpose"):
        select_backend("c", 1)


def test_cli_fails_at_start_for_options_that_cannot_run(broken_compiler, tiny_models):
    """`--kernels c` without working kernels, and `--activation-dtype int8` on a model without 4-bit
    weights: a one-line error naming the option, exit status 2, no traceback."""
    for flags, message in [(["--kernels", "c"], "--kernels c"),
                           (["--kernels", "torch", "--activation-dtype", "int8"], "--activation-dtype int8")]:
        out = subprocess.run([sys.executable, "-m", "nanoserve", "generate", "hi", "--model", tiny_models["llama"],
                              "--max-tokens", "1", *flags], capture_output=True, text=True, timeout=300)
        assert out.returncode == 2, out.stderr
        assert message in out.stderr and "Traceback" not in out.stderr


def test_kv_cache_memory_below_one_block_fails_at_start(tiny_models):
    """A budget that holds no block (0.25 given as if in GiB to the Python API, which takes bytes) fails
    at start, naming the option, instead of running with a one-block pool."""
    from nanoserve.config import EngineConfig
    from nanoserve.engine.core import EngineCore

    with pytest.raises(ValueError, match="--kv-cache-memory holds no KV block: 0 bytes"):
        EngineCore(EngineConfig.from_kwargs(tiny_models["llama"], kernels="torch", kv_cache_memory=0))
    core = EngineCore(EngineConfig.from_kwargs(tiny_models["llama"], kernels="torch", kv_cache_memory=1 << 20))
    assert core.capacity_tokens > 0


def test_int8_activations_without_block_weights_fail_at_start(tiny_models):
    from nanoserve.config import EngineConfig
    from nanoserve.engine.core import EngineCore

    def engine(**kw):
        return EngineCore(EngineConfig.from_kwargs(tiny_models["llama"], kernels="torch", num_kv_blocks=8, **kw))
    with pytest.raises(ValueError, match="--activation-dtype int8: this model's matrices are all float"):
        engine(dtype="float32", activation_dtype="int8")
    # Quantized on load, it runs, on either backend.
    compute = engine(quantization="q4_0", activation_dtype="int8").compute
    assert compute.activations == "int8" and compute.backend == "torch" and "Q4_0 x" in compute.weights


@requires_kernels
def test_swapped_or_mistyped_kernel_arguments_raise():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 64, generator=g), torch.randn(64, generator=g)
    with pytest.raises(KernelArgumentError, match="rms_norm: weight"):
        C.rms_norm(w.expand(3, 64).contiguous(), x, 1e-6)  # x and weight swapped
    from nanoserve.model.layers import KVCache

    cache = KVCache(2, 50, 16, torch.float16)
    q = torch.randn(4, 4, 16, generator=g)
    slots, ctx = torch.randint(0, 50, (4, 9), generator=g), torch.tensor([9, 3, 1, 5])
    with pytest.raises(KernelArgumentError, match="decode_attention"):
        C.decode_attention(q, cache, ctx, slots, 0.25)  # slots and ctx_lens swapped
    with pytest.raises(KernelArgumentError, match="decode_attention: ctx_lens must be torch.int64"):
        C.decode_attention(q, cache, slots, ctx.int(), 0.25)
    with pytest.raises(KernelArgumentError, match="linear: x"):  # K does not match the weight
        C.weight_linear(torch.randn(3, 96, generator=g), random_weight("Q4_0", 32, 64), int8=False)
    with pytest.raises(KernelArgumentError, match="sample_rows: temperature"):
        logits = torch.randn(2, 10, generator=g)
        z = torch.zeros(2)
        C.sample_rows(logits, torch.empty(1), torch.empty(2, dtype=torch.int64), temperature=torch.zeros(3),
                      min_p=z, top_k=torch.full((2,), 10), top_p=torch.ones(2), keys=torch.zeros(2, 2, dtype=torch.int64),
                      allowed=torch.zeros(1, 1, dtype=torch.int32), allowed_row=torch.full((2,), -1),
                      ban_offsets=torch.zeros(3, dtype=torch.int64), ban_tokens=torch.zeros(1, dtype=torch.int64),
                      bias_offsets=torch.zeros(3, dtype=torch.int64), bias_tokens=torch.zeros(1, dtype=torch.int64),
                      bias_values=torch.zeros(1), seen_tokens=torch.zeros(1, 1, dtype=torch.int32),
                      num_seen=torch.zeros(1, dtype=torch.int64), output_counts=torch.zeros(1, 1, dtype=torch.int32),
                      penalty_row=torch.full((2,), -1), repetition=torch.ones(2), frequency=z, presence=z,
                      write_work=False)
    # The same calls with the arguments in place run, and agree with the reference backend.
    torch.testing.assert_close(C.decode_attention(q, cache, slots, ctx, 0.25),
                               TORCH.decode_attention(q, cache, slots, ctx, 0.25), atol=1e-5, rtol=1e-5)


def test_abi_structs_are_read_from_the_header():
    """abi.py builds its ctypes mirrors from abi.h itself (one definition); `bind` compares their sizes
    with the compiled library's (test_a_foreign_library_in_the_cache_is_replaced_not_loaded)."""
    fields = [name for name, _ in abi.SampleArgs._fields_]
    assert fields[:3] == ["logits", "work", "temperature"] and fields[-1] == "seen_stride"
    assert ctypes.sizeof(abi.BlockWeight) == 8 * 8 and abi.ABI_VERSION >= 3
    with pytest.raises(ValueError, match="cannot read the field"):
        abi._parse_header("#define NS_ABI_VERSION 9\ntypedef struct {\n    int64_t a;\n    unsigned b;\n} Bad;\n")


@requires_kernels
def test_kernel_threads_follow_num_threads():
    """The kernels' OpenMP pool takes the engine's thread count (it is process-wide: restored after)."""
    before = C.lib.ns_num_threads()
    try:
        assert select_backend("c", 1).lib.ns_num_threads() == 1
    finally:
        C.lib.ns_set_num_threads(before)
    assert C.lib.ns_num_threads() == before
