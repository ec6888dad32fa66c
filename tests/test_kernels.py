"""The C backend's kernels (paged decode attention, 4-bit and 8-bit block matrix products, fused layer
steps) against the PyTorch backend, which defines them, and the model's output on either backend."""
import pytest
import torch

from backends import C, TORCH, requires_kernels
from nanoserve.kernels import quantize_activations, quantize_q4, quantize_q8
from nanoserve.model.layers import KVCache
from runner_driver import RunnerDriver

pytestmark = requires_kernels


def cache_of(k: torch.Tensor, v: torch.Tensor) -> KVCache:
    cache = KVCache(k.shape[0], k.shape[1], k.shape[2], k.dtype)
    cache.k, cache.v = k, v
    return cache


class BlockLayer:
    """What a backend's `linear` reads of a layer: blocks and the float weight they define."""

    def __init__(self, blocks):
        self.blocks, self.weight, self.onednn_weight = blocks, blocks.dequantize(), None


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (4, 4, 16), (8, 2, 24), (16, 2, 40)])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_decode_attention_matches_reference(num_heads, num_kv_heads, head_dim, cache_dtype):
    g = torch.Generator().manual_seed(0)
    batch, num_slots, max_ctx = 6, 500, 90
    q = torch.randn(batch, num_heads, head_dim, generator=g)
    k = torch.randn(num_kv_heads, num_slots, head_dim, generator=g).to(cache_dtype)
    v = torch.randn(num_kv_heads, num_slots, head_dim, generator=g).to(cache_dtype)
    slots = torch.randint(0, num_slots, (batch, max_ctx), generator=g)
    ctx = torch.tensor([1, 90, 17, 64, 2, 33])
    out = C.decode_attention(q, cache_of(k, v), slots, ctx, 0.3)
    torch.testing.assert_close(out, TORCH.decode_attention(q, cache_of(k, v), slots, ctx, 0.3), atol=1e-5, rtol=1e-5)
    k, v = k.float(), v.float()  # an independent reference computes on the stored values
    group = num_heads // num_kv_heads
    for b in range(batch):
        n = int(ctx[b])
        keys, values = k[:, slots[b, :n]], v[:, slots[b, :n]]  # (KVH, n, D)
        qb = q[b].view(num_kv_heads, group, head_dim)
        ref = (torch.softmax(qb @ keys.transpose(-1, -2) * 0.3, -1) @ values).reshape(num_heads, head_dim)
        torch.testing.assert_close(out[b], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_model_output_same_with_and_without_kernel(tiny_models, kv_dtype):
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (9, 30, 45)]
    plen = [4, 20, 30]
    with_kernel = RunnerDriver(tiny_models["llama"], block_size=4, num_blocks=128, backend=C,
                               kv_dtype=kv_dtype).run(seqs, 1000, plen)
    without = RunnerDriver(tiny_models["llama"], block_size=4, num_blocks=128, backend=TORCH,
                           kv_dtype=kv_dtype).run(seqs, 1000, plen)
    # float16: a key one float32 ulp away (C rotary vs PyTorch's) can round to the next float16
    tolerance = 1e-5 if kv_dtype == torch.float32 else 2e-4
    for a, b in zip(with_kernel, without):
        torch.testing.assert_close(a, b, atol=tolerance, rtol=0)
    if kv_dtype == torch.float16:  # close to the float32 cache's logits, not equal
        exact = RunnerDriver(tiny_models["llama"], block_size=4, num_blocks=128, backend=C).run(seqs, 1000, plen)
        for a, b in zip(with_kernel, exact):
            assert not torch.equal(a, b) or a.shape[0] <= 4
            torch.testing.assert_close(a, b, atol=2e-2, rtol=0)


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 16, 17, 33, 64])
@pytest.mark.parametrize("width", [96, 448])  # 448: the GEMM's slices of K (192) with a tail
def test_block_linear_matches_dequantized_reference(rows, width):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(200, width, generator=g)  # 200 weight rows: groups of 24 and tiles of 6 with tails
    x = torch.randn(rows, width, generator=g)
    for blocks in (quantize_q4(w), quantize_q8(w)):
        ref = TORCH.linear(x, BlockLayer(blocks), int8=False)
        torch.testing.assert_close(ref, x @ blocks.dequantize().T)
        out = C.block_linear(x, blocks, int8=False)  # the streaming kernel up to 5 rows, else the GEMM
        assert torch.allclose(out, ref, atol=1e-4, rtol=1e-5)
        assert torch.equal(C.linear(x, BlockLayer(blocks), int8=False), out)
        assert (blocks.dequantize() - w).abs().max() < w.abs().max() / (14 if blocks.kind == "q4" else 250)


def test_block_gemm_row_does_not_depend_on_its_panel():
    """A step of 16p + r rows (r <= 8) runs its last panel through 8-row tiles: each output still sums
    over k in the same order as in a full 16-row panel, so results are identical."""
    g = torch.Generator().manual_seed(2)
    blocks = quantize_q4(torch.randn(130, 448, generator=g))
    x = torch.randn(40, 448, generator=g)
    full = C.block_linear(x, blocks, int8=False)
    for rows in (6, 8, 9, 17, 24, 33):  # the GEMM runs from 6 rows
        assert torch.equal(C.block_linear(x[:rows], blocks, int8=False), full[:rows]), rows


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 13, 64, 70])
@pytest.mark.parametrize("width", [64, 576])
def test_int8_activation_gemm_is_the_product_with_quantized_x(rows, width):
    """q4_gemm_i8 (kernels/int8_gemm.c) equals x quantized to 8 bits per block times the dequantized
    4-bit weight, up to float32 summation, and stays within ~1% of the exact product."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(101, width, generator=g) * 0.05 + 0.01  # 101 rows: groups of 24, tiles of 2 with tails
    x = torch.randn(rows, width, generator=g)
    x[:, 7] *= 40  # an outlier channel, as real activations have
    blocks = quantize_q4(w)
    weight = blocks.dequantize().double()
    out = C.block_linear(x, blocks, int8=True)
    ref = (quantize_activations(x).double() @ weight.T).float()
    torch.testing.assert_close(out, ref, atol=1e-4 * ref.abs().max().item(), rtol=1e-4)
    torch.testing.assert_close(out, TORCH.linear(x, BlockLayer(blocks), int8=True),
                               atol=1e-4 * ref.abs().max().item(), rtol=1e-4)
    exact = (x.double() @ weight.T).float()
    assert ((out - exact).norm() / exact.norm()).item() < 0.02
    assert torch.equal(C.block_linear(torch.zeros(rows, width), blocks, int8=True), torch.zeros(rows, 101))
    assert torch.equal(quantize_activations(torch.zeros(rows, width)), torch.zeros(rows, width))


def test_int8_activation_gemm_row_does_not_depend_on_its_batch():
    """Each output comes from the same operations in the same order whether the call has 1 row (the
    streaming kernel), a few, or more than one 64-row pass of the GEMM."""
    g = torch.Generator().manual_seed(0)
    blocks = quantize_q4(torch.randn(130, 576, generator=g))
    x = torch.randn(150, 576, generator=g)
    full = C.block_linear(x, blocks, int8=True)
    for rows in (1, 2, 3, 8, 9, 64, 65, 100):
        assert torch.equal(C.block_linear(x[-rows:], blocks, int8=True), full[-rows:]), rows


def test_gguf_style_blocks_round_trip_exactly():
    """A weight made of Q4_1 blocks (d * q + m, q in 0..15) or Q8_0 blocks (d * q, |q| <= 127) comes
    back exactly, which is what lets the default weights use the kernels without changing results."""
    g = torch.Generator().manual_seed(1)
    n, nb = 64, 6
    q = torch.randint(0, 16, (n, nb, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15  # the quantizer put the block's min and max at the ends of the range
    # GGUF stores d and m as float16.
    d = (torch.rand(n, nb, 1, generator=g) * 0.1).half().float()
    m = (torch.randn(n, nb, 1, generator=g) * 0.1).half().float()
    w = (q * d + m).reshape(n, nb * 32)
    assert (quantize_q4(w).dequantize() - w).abs().max() < 1e-6
    q8 = torch.randint(-127, 128, (n, nb, 32), generator=g).float()
    q8[..., 0] = 127
    w8 = (q8 * d).reshape(n, nb * 32)
    assert (quantize_q8(w8).dequantize() - w8).abs().max() < 1e-6


def test_default_weights_put_every_smollm2_matrix_on_exact_blocks(smollm_llm):
    from nanoserve.model.layers import Linear

    layers = [m for m in smollm_llm.engine.runner.model.modules() if isinstance(m, Linear)]
    kinds = [m.blocks.kind if m.blocks is not None else None for m in layers]
    assert kinds.count("q4") == 120 and kinds[-1] == "q8"  # Q4_1 layers on 4-bit blocks, the Q8_0 lm_head on 8-bit


@pytest.mark.parametrize("rows,dim", [(1, 576), (5, 64), (3, 100)])
def test_rms_norm_kernel_matches_pytorch(rows, dim):
    g = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, dim, generator=g) * 3, torch.randn(dim, generator=g)
    ref = torch.nn.functional.rms_norm(x, (dim,), w, 1e-6)
    torch.testing.assert_close(TORCH.rms_norm(x, w, 1e-6), ref)
    assert torch.allclose(C.rms_norm(x, w, 1e-6), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 40])
def test_silu_mul_kernel_matches_pytorch(rows):
    g = torch.Generator().manual_seed(rows)
    gate_up = torch.randn(rows, 2 * 1536, generator=g) * 6  # wide range: exp over- and underflow
    gate, up = gate_up.split(1536, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(TORCH.silu_mul(gate_up), ref)
    assert torch.allclose(C.silu_mul(gate_up), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_rope_write_kv_kernel_matches_pytorch(cache_dtype):
    from nanoserve.kernels.backend import rotate
    from nanoserve.model.layers import RotaryEmbedding

    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, tokens, num_slots = 9, 3, 64, 7, 50
    rope = RotaryEmbedding(dim, 128, 10000.0, None)
    positions = torch.tensor([0, 5, 17, 3, 90, 91, 127])
    cos, sin = rope.lookup(positions)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g)
    slots = torch.tensor([4, 9, 0, 49, 20, 21, 33])
    qk, v = qkv[:, :(heads + kv_heads) * dim], qkv[:, (heads + kv_heads) * dim:]
    ref = rotate(qk.reshape(tokens, heads + kv_heads, dim), cos, sin)
    k_cache = torch.zeros(kv_heads, num_slots, dim, dtype=cache_dtype)
    v_cache = torch.zeros(kv_heads, num_slots, dim, dtype=cache_dtype)
    v_ref = v.reshape(tokens, kv_heads, dim).clone().to(cache_dtype)
    reference = cache_of(k_cache.clone(), v_cache.clone())
    qkv_ref = qkv.clone()
    TORCH.rope_write_kv(qkv_ref, heads, kv_heads, dim, cos, sin, reference, slots)
    C.rope_write_kv(qkv, heads, kv_heads, dim, cos, sin, cache_of(k_cache, v_cache), slots)
    torch.testing.assert_close(qkv, qkv_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_cache.float(), reference.k.float(), atol=1e-3, rtol=1e-3)
    assert torch.equal(v_cache, reference.v)
    rotated = qkv[:, :(heads + kv_heads) * dim].reshape(tokens, heads + kv_heads, dim)
    assert torch.allclose(rotated, ref, atol=1e-5, rtol=1e-5)
    # float16: rounded to nearest, exactly as PyTorch's conversion
    assert torch.allclose(k_cache[:, slots].transpose(0, 1).float(), ref[:, heads:].to(cache_dtype).float(),
                          atol=1e-5, rtol=1e-5)
    assert torch.equal(v_cache[:, slots].transpose(0, 1), v_ref)
    untouched = torch.ones(num_slots, dtype=torch.bool)
    untouched[slots] = False
    assert not k_cache[:, untouched].any() and not v_cache[:, untouched].any()
