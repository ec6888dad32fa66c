"""The weight formats: every GGUF block type's PyTorch dequantization equals gguf-py's bit for bit, on
random blocks with valid scales (K types written from random codes and scales, which gguf-py cannot
quantize); the quantizers of --quantization round-trip."""
import gguf
import numpy as np
import pytest
import torch

from nanoserve.kernels.quant import BLOCK_TYPES, GGML_TYPES, QuantWeight, from_float
from nanoserve.kernels.quant import random_blocks

@pytest.mark.parametrize("qtype", BLOCK_TYPES)
def test_dequantize_equals_gguf_bit_for_bit(qtype):
    w = random_blocks(qtype, 7, 512)
    ours = w.dequantize().numpy()
    ref = gguf.quants.dequantize(w.data.numpy(), gguf.GGMLQuantizationType[qtype])
    assert ours.shape == ref.shape
    assert np.array_equal(ours.view(np.uint32), ref.astype(np.float32).view(np.uint32))
    rows = torch.tensor([5, 0, 5])
    assert torch.equal(w.dequantize(rows), torch.from_numpy(ref[[5, 0, 5]]))


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16"])
def test_float_types(qtype):
    w = torch.randn(6, 40)
    q = from_float(w, qtype)
    assert q.qtype == qtype and q.shape == (6, 40)
    assert torch.equal(q.dequantize(), w.to(q.data.dtype).float())


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_quantize_matches_gguf(qtype):
    w = torch.randn(8, 256)
    q = from_float(w, qtype)
    ref = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType[qtype])
    assert np.array_equal(q.data.numpy(), ref)
    err = (q.dequantize() - w).abs().max().item()
    assert err < {"Q8_0": 0.02, "Q5_0": 0.2, "Q5_1": 0.2}.get(qtype, 0.5)


@pytest.mark.parametrize("qtype,rival", [("Q2_K", None), ("Q3_K", "Q2_K"), ("Q4_K", "Q4_1"), ("Q5_K", "Q5_1"),
                                         ("Q6_K", "Q5_1")])
def test_k_quantizers(qtype, rival):
    """Our K quantizers write blocks gguf-py reads back as we do, and round at least as well as the
    32-weight type of the same or fewer bits (heavy-tailed rows, as real weights are; Q3_K against Q2_K,
    there being no 32-weight type of 2 or 3 bits)."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 1024, generator=g) * torch.rand(64, 1, generator=g)
    w[:, ::97] *= 6  # outliers
    q = from_float(w, qtype)
    assert q.qtype == qtype and q.data.shape == (64, 4 * GGML_TYPES[qtype][2])
    ref = gguf.quants.dequantize(q.data.numpy(), gguf.GGMLQuantizationType[qtype])
    assert torch.equal(q.dequantize(), torch.from_numpy(ref))
    rmse = (q.dequantize() - w).pow(2).mean().sqrt()
    if rival is not None:
        assert rmse < (from_float(w, rival).dequantize() - w).pow(2).mean().sqrt()
    assert rmse < {"Q2_K": 0.32, "Q3_K": 0.2, "Q4_K": 0.09, "Q5_K": 0.045, "Q6_K": 0.025}[qtype] * w.std()
    # Edge cases: a zero row, a constant row, a row of one sign, tiny values.
    odd = torch.stack([torch.zeros(256), torch.full((256,), 0.5), torch.rand(256, generator=g) + 1,
                       torch.randn(256, generator=g) * 1e-6])
    back = from_float(odd, qtype).dequantize()
    assert torch.isfinite(back).all() and back[0].abs().max() == 0
    # the largest error over 200 seeds of these rows, with a margin: two- and three-bit codes make a step of
    # a third of a sub-block's range (Q2_K, 0.23) or a quarter of its largest magnitude (Q3_K, 0.145:
    # symmetric, so a row of one sign uses half its codes); Q4_K 0.054, Q5_K 0.031, Q6_K 0.020
    bound = {"Q2_K": 0.25, "Q3_K": 0.16, "Q4_K": 0.06, "Q5_K": 0.04, "Q6_K": 0.025}[qtype]
    assert (back - odd).abs().max() < bound * odd.abs().max()


def test_inconsistent_shapes_are_refused():
    with pytest.raises(ValueError, match="inconsistent Q4_K"):
        QuantWeight("Q4_K", torch.zeros(2, 100, dtype=torch.uint8), 256)
    with pytest.raises(ValueError, match="unsupported"):
        QuantWeight("IQ2_XXS", torch.zeros(2, 66, dtype=torch.uint8), 256)


def test_stacked_weights_live_in_weight_memory():
    """A fused projection's parts are stacked (Linear.set_weight) into a huge_page_buffer as the loader's
    weights: from 2 MiB on, starting on a 2 MiB boundary (its pages advised as huge pages), the same values
    as torch.cat."""
    from nanoserve.kernels.quant import HUGE_PAGE, stack_rows
    from nanoserve.model.layers import Linear

    gate, up = (QuantWeight("F16", torch.randn(rows, 1024).half(), 1024) for rows in (1024, 1536))
    layer = Linear(1024, 2560)
    layer.set_weight([gate, up])
    (fused,) = layer.parts
    assert fused.data.data_ptr() % HUGE_PAGE == 0 and fused.nbytes >= HUGE_PAGE
    assert torch.equal(fused.data, torch.cat([gate.data, up.data]))
    small = stack_rows([torch.ones(2, 3), torch.zeros(1, 3)])
    assert torch.equal(small, torch.tensor([[1.0] * 3, [1.0] * 3, [0.0] * 3]))


def test_packed_weights_share_one_buffer():
    """pack_weights (build_model's last step) moves every matrix, in order, into one buffer on a 2 MiB
    boundary, each 64-byte aligned: the same values, a matrix two weights share (a tied output projection)
    moved once and still shared, the kernels' cached struct dropped."""
    from nanoserve.kernels.quant import HUGE_PAGE, pack_weights, random_weight

    a, b = random_weight("Q4_K", 8192, 512, seed=1), random_weight("F16", 7, 40, seed=2)  # 2.25 MiB, then 560 B
    tied = QuantWeight(a.qtype, a.data, a.k)
    before = [w.data.clone() for w in (a, b)]
    a.c_struct = "stale"
    size = pack_weights([a, b, tied])
    assert a.data.data_ptr() % HUGE_PAGE == 0 and tied.data is a.data and a.c_struct is None
    assert b.data.data_ptr() == a.data.data_ptr() + (a.nbytes + 63) // 64 * 64
    assert size == (a.nbytes + 63) // 64 * 64 + (b.nbytes + 63) // 64 * 64
    assert torch.equal(a.data, before[0]) and torch.equal(b.data, before[1]) and b.data.dtype == torch.float16
