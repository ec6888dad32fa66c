"""A missing or corrupt model file, an unsupported architecture or quantization type: one clear error
naming the file and the problem, never a traceback from inside a library."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from nanoserve.model.loader import ModelLoadError, load_model_weights
from nanoserve.model.registry import build_model


def _error(path) -> str:
    with pytest.raises(ModelLoadError) as info:
        build_model(str(path), "float32")
    msg = str(info.value)
    assert str(path) in msg
    return msg


def test_missing_path(tmp_path):
    assert "no such file" in _error(tmp_path / "nope.gguf")


def test_garbage_file(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"this is not a gguf file at all" * 10)
    assert "not a readable GGUF" in _error(bad)


def test_truncated_gguf(tmp_path, smollm_path):
    cut = tmp_path / "cut.gguf"
    with open(smollm_path, "rb") as src:
        cut.write_bytes(src.read(3_000_000))
    assert "GGUF" in _error(cut)


def _tiny_gguf(path, arch="llama", qtype=None):
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(16)
    if qtype is None:
        w.add_tensor("token_embd.weight", np.zeros((16, 32), dtype=np.float32))
    else:  # one block per row in the given quantized format
        nbytes = gguf.GGML_QUANT_SIZES[qtype][1]
        w.add_tensor("token_embd.weight", np.zeros((16, nbytes), dtype=np.uint8), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_unsupported_gguf_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    _tiny_gguf(path, arch="gpt2")
    msg = _error(path)
    assert "unsupported architecture 'gpt2'" in msg


def test_unsupported_quantization_type(tmp_path):
    import gguf

    path = tmp_path / "iq2_xxs.gguf"
    _tiny_gguf(path, qtype=gguf.GGMLQuantizationType.IQ2_XXS)
    msg = _error(path)
    assert "tensor token_embd.weight has type IQ2_XXS, which nanoserve does not run" in msg


def test_gguf_missing_weights(tmp_path):
    path = tmp_path / "partial.gguf"
    _tiny_gguf(path)
    assert "is missing" in _error(path)


def test_unsupported_hf_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Gemma2ForCausalLM"]}))
    assert "unsupported architecture" in _error(tmp_path) and "Gemma2ForCausalLM" in _error(tmp_path)


def test_hf_dir_without_weights_or_config(tmp_path, tiny_models):
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model_weights(str(tmp_path))
    d = tmp_path / "noweights"
    d.mkdir()
    shutil.copy(os.path.join(tiny_models["llama"], "config.json"), d)
    assert "safetensors" in _error(d)
    (d / "model.safetensors").write_bytes(b"\x00" * 64)
    assert "cannot read safetensors" in _error(d)


def test_unsupported_rope_scaling(tmp_path, tiny_models):
    d = tmp_path / "yarn"
    shutil.copytree(tiny_models["llama"], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    (d / "config.json").write_text(json.dumps(cfg))
    assert "unsupported rope_scaling type 'yarn'" in _error(d)


def test_cli_reports_one_line(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"garbage")
    proc = subprocess.run([sys.executable, "-m", "nanoserve", "generate", "hi", "--model", str(bad)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"nanoserve: error: {bad}: not a readable GGUF file "
                                                "(GGUF magic invalid)"]


def test_gguf_header_cache_round_trip(tmp_path, monkeypatch, smollm_path):
    """The cached GGUF header gives the same config and tensors; a damaged entry is parsed again."""
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path))
    fresh_cfg, fresh = load_model_weights(smollm_path)
    (entry,) = (tmp_path / "gguf-headers").iterdir()
    cached_cfg, cached = load_model_weights(smollm_path)
    assert cached_cfg == fresh_cfg and cached.keys() == fresh.keys()
    for name in ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                 "model.layers.29.mlp.down_proj.weight"]:
        assert cached[name].qtype == fresh[name].qtype and torch.equal(cached[name].data, fresh[name].data)
    entry.write_bytes(b"damaged")
    again_cfg, again = load_model_weights(smollm_path)
    assert again_cfg == fresh_cfg and torch.equal(again["model.norm.weight"], fresh["model.norm.weight"])


def test_gguf_weights_are_the_files_blocks(smollm_path):
    """Matrices keep the file's type and bytes (q and k rows put back in Hugging Face's order), and
    dequantize to exactly what gguf-py reads."""
    import gguf
    import numpy as np

    from nanoserve.model.loader import unpermute_rows

    _, state = load_model_weights(smollm_path)
    reader = gguf.GGUFReader(smollm_path)
    tensors = {t.name: t for t in reader.tensors}
    for gguf_name, hf_name, heads in [("blk.3.ffn_down.weight", "model.layers.3.mlp.down_proj.weight", None),
                                      ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight", 9),
                                      ("token_embd.weight", "model.embed_tokens.weight", None)]:
        t, ours = tensors[gguf_name], state[hf_name]
        assert ours.qtype == t.tensor_type.name
        ref = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
        if heads:
            ref = ref[unpermute_rows(ref.shape[0], heads)]
        assert torch.equal(ours.dequantize(), ref)
