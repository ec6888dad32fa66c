"""One source of defaults: the CLI flags and the `LLM(...)` keyword arguments come from the config
dataclasses' option fields, so an unset flag or keyword leaves exactly the dataclass default."""
import argparse
import dataclasses

import pytest

from nanoserve.config import (CacheConfig, EngineConfig, SchedulerConfig, ServerConfig, add_option_args,
                              kwargs_from_args, option_fields)


def parser(classes=None):
    ap = argparse.ArgumentParser()
    add_option_args(ap, *(() if classes is None else (classes,)))
    return ap


def test_unset_flags_keep_the_dataclass_defaults():
    assert kwargs_from_args(parser().parse_args([])) == {}
    assert EngineConfig.from_kwargs("m") == EngineConfig(model="m")
    server = ServerConfig(**kwargs_from_args(parser((ServerConfig,)).parse_args([]), (ServerConfig,)))
    assert server == ServerConfig()


def test_every_option_has_a_flag_and_a_keyword():
    ap = parser()
    for cls in (EngineConfig, CacheConfig, SchedulerConfig):
        for f in option_fields(cls):
            assert any(a.dest == f.name for a in ap._actions), f.name
            assert f.metadata["help"], f.name
    args = ap.parse_args(["--kv-cache-memory", "0.5", "--no-prefix-caching", "--num-kv-blocks", "7", "--kernels",
                          "torch", "--max-num-seqs", "3", "--activation-dtype", "float32"])
    config = EngineConfig.from_kwargs("m", **kwargs_from_args(args))
    assert config.cache == dataclasses.replace(CacheConfig(), kv_cache_memory=1 << 29, enable_prefix_caching=False,
                                               num_kv_blocks=7)
    assert config.scheduler.max_num_seqs == 3 and config.kernels == "torch" and config.activation_dtype == "float32"
    with pytest.raises(SystemExit):
        ap.parse_args(["--kernels", "gpu"])  # choices come from the field
    with pytest.raises(TypeError, match="unknown engine option 'num_blocks'"):
        EngineConfig.from_kwargs("m", num_blocks=3)


def test_server_flags_repeat_and_default(monkeypatch):
    ap = parser((ServerConfig,))
    args = ap.parse_args(["--api-key", "a", "--api-key", "b", "--port", "9", "--drain-timeout", "1.5"])
    server = ServerConfig(**kwargs_from_args(args, (ServerConfig,)))
    assert server.api_keys == ["a", "b"] and server.port == 9 and server.drain_timeout == 1.5
    assert server.host == ServerConfig().host


def test_kernels_default_follows_the_environment(monkeypatch):
    monkeypatch.setenv("NANOSERVE_NO_KERNELS", "1")
    assert EngineConfig(model="m").kernels == "torch"
    monkeypatch.delenv("NANOSERVE_NO_KERNELS")
    monkeypatch.setenv("NANOSERVE_KERNELS", "c")
    assert EngineConfig(model="m").kernels == "c"
