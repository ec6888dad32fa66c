"""The C backend's kernels (paged decode attention, matrix products on every weight type, fused layer
steps) against the PyTorch backend, which defines them, and the model's output on either backend."""
import pytest
import torch

from backends import C, TORCH, requires_kernels
from nanoserve.kernels import quantize_activations
from nanoserve.kernels.quant import BLOCK_TYPES, GGML_TYPES, K_TYPES
from nanoserve.model.layers import KVCache, Linear, TokenEmbedding
from runner_driver import RunnerDriver
from nanoserve.kernels.quant import random_weight

pytestmark = requires_kernels


def cache_of(k: torch.Tensor, v: torch.Tensor) -> KVCache:
    cache = KVCache(k.shape[0], k.shape[1], k.shape[2], k.dtype)
    cache.k, cache.v = k, v
    return cache


def layer_of(*parts) -> Linear:
    """A Linear holding `parts` (stacked), with the PyTorch backend's float32 copy made."""
    layer = Linear(parts[0].k, sum(p.shape[0] for p in parts))
    layer.set_weight(list(parts))
    layer.dense = torch.cat([p.dequantize() for p in layer.parts])
    return layer


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


ALL_TYPES = list(GGML_TYPES)
FLOAT_TYPES_ODD = ("F32", "F16", "BF16")
# streaming (<= 5 rows; int8 on block types <= 8), the GEMM's 8-row and 16-row panels, a 128-row chunk and a
# 2-row tail (K types: streamed on its own), a prompt
ROW_COUNTS = [1, 2, 5, 8, 16, 64, 130, 300]


@pytest.mark.parametrize("qtype", ALL_TYPES)
def test_float_activation_product_matches_reference(qtype):
    """Every weight type, at every row count: the product on float32 x (the streaming kernel up to 5 rows,
    the dequantizing GEMM beyond) agrees with the float64 product of the dequantized weight to float32
    summation error (1e-5 of the output scale)."""
    width = 512 if qtype not in FLOAT_TYPES_ODD else 520  # float types need no whole blocks: a tail of 8
    w = random_weight(qtype, 70, width, seed=3)  # 70 weight rows: groups of 24, tiles of 6 and 12, tails
    exact = w.dequantize().double()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(max(ROW_COUNTS), width, generator=g)
    for rows in ROW_COUNTS:
        ref = (x[:rows].double() @ exact.T).float()
        out = C.weight_linear(x[:rows], w, int8=False)
        scale = ref.abs().max().item()
        torch.testing.assert_close(out, ref, atol=1e-5 * scale, rtol=0, msg=f"{qtype}, {rows} rows")
        torch.testing.assert_close(TORCH.linear(x[:rows], layer_of(w), int8=False), ref, atol=1e-5 * scale, rtol=0)


@pytest.mark.parametrize("qtype", ALL_TYPES)
def test_embedding_gather_equals_dequantize_bit_for_bit(qtype):
    """The token embedding lookup (ns_gather_rows) gives the rows' values as gguf-py dequantizes them
    (test_quant compares dequantize with gguf-py), repeated ids included; an id outside the vocabulary
    raises instead of reading past the matrix."""
    width = 512 if qtype not in FLOAT_TYPES_ODD else 520
    embedding = TokenEmbedding()
    embedding.weight = random_weight(qtype, 40, width, seed=4)
    ids = torch.tensor([7, 0, 39, 7, 21])
    out = C.embedding(embedding, ids)
    assert torch.equal(out, embedding.weight.dequantize(ids))
    assert torch.equal(out, TORCH.embedding(embedding, ids))
    for bad in (40, -1):
        with pytest.raises(IndexError, match="outside the vocabulary"):
            C.embedding(embedding, torch.tensor([3, bad]))


@pytest.mark.parametrize("qtype, width", [(q, 512) for q in BLOCK_TYPES] +
                         [(q, w) for q in BLOCK_TYPES if q not in K_TYPES for w in (96, 576, 608)])
def test_int8_activation_product_is_the_product_with_quantized_x(qtype, width):
    """On block types, int8 activations: equals x quantized per block (quant.quantize_activations) times
    the dequantized weight, to float32 summation error, at every row count; stays within ~2% of the
    exact product (5% on the K types, whose x takes one scale per 256 values as llama.cpp's Q8_K: the
    outlier channel coarsens its whole super-block, measured 3.7%); and each output row does not depend
    on the rows around it. Widths: whole groups of 8 blocks, rows that end 2 (SmolLM2's 576) or 3
    blocks past one, and rows of fewer than 8 blocks (96)."""
    w = random_weight(qtype, 70, width, seed=4)
    exact = w.dequantize().double()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(max(ROW_COUNTS), width, generator=g)
    x[:, 7] *= 40  # an outlier channel, as real activations have
    full = C.weight_linear(x, w, int8=True)
    for rows in ROW_COUNTS:
        ref = (quantize_activations(x[:rows], qtype).double() @ exact.T).float()
        out = C.weight_linear(x[:rows], w, int8=True)
        scale = ref.abs().max().item()
        torch.testing.assert_close(out, ref, atol=1e-5 * scale, rtol=0, msg=f"{qtype}, {rows} rows")
        torch.testing.assert_close(TORCH.linear(x[:rows], layer_of(w), int8=True), ref, atol=1e-5 * scale, rtol=0)
        truth = (x[:rows].double() @ exact.T).float()
        assert ((out - truth).norm() / truth.norm()).item() < (0.05 if qtype in K_TYPES else 0.02)
        assert torch.equal(out, full[:rows]), f"{qtype}: row results depend on the batch ({rows} rows)"
    assert torch.equal(C.weight_linear(torch.zeros(3, width), w, int8=True), torch.zeros(3, 70))


def test_gemm_row_does_not_depend_on_its_panel():
    """A step of 16p + r rows (r <= 8) runs its last panel through 8-row tiles: each output still sums
    over k in the same order as in a full 16-row panel, so results are identical."""
    w = random_weight("Q4_K", 130, 512, seed=2)
    x = torch.randn(40, 512, generator=torch.Generator().manual_seed(2))
    full = C.weight_linear(x, w, int8=False)
    for rows in (6, 8, 9, 17, 24, 33):  # the GEMM runs from 6 rows
        assert torch.equal(C.weight_linear(x[:rows], w, int8=False), full[:rows]), rows


@pytest.mark.parametrize("qtype, int8", [("Q4_K", True), ("Q8_0", True), ("Q4_1", False), ("F16", False)])
def test_streaming_rows_shared_between_threads(qtype, int8):
    """The streaming kernels hand out weight rows in chunks (each thread's own share from the front, then
    others' from the back, RowShares in quant_blocks.h): on 12000 weight rows, several chunks a share,
    every output is written once and is the one its row gives alone, at 1 and 3 rows of x."""
    w = random_weight(qtype, 12000, 256, seed=5)
    exact = w.dequantize().double()
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(5))
    for rows in (1, 3):
        out = C.weight_linear(x[:rows], w, int8)
        xr = quantize_activations(x[:rows], qtype).double() if int8 else x[:rows].double()
        ref = (xr @ exact.T).float()
        torch.testing.assert_close(out, ref, atol=1e-5 * ref.abs().max().item(), rtol=0, msg=f"{rows} rows")
        for n0 in (0, 5999, 6000, 11999):  # the first and last rows of each share: each equal to its weight row alone
            one = C.weight_linear(x[:rows], w.rows(n0, n0 + 1), int8)
            assert torch.equal(out[:, n0:n0 + 1], one), n0


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("rows", [1, 7])
def test_stacked_parts_of_mixed_types(int8, rows):
    """A fused projection whose matrices differ in type (Q4_K_M files: q and k Q4_K, v Q6_K) runs as a
    chain of parts, each writing its own output columns; neighbours of one type are joined."""
    parts = [random_weight("Q4_K", 40, 256, 1), random_weight("Q4_K", 8, 256, 2), random_weight("Q6_K", 8, 256, 3),
             random_weight("F16", 16, 256, 4)]
    layer = layer_of(*parts)
    assert [p.qtype for p in layer.parts] == ["Q4_K", "Q6_K", "F16"]
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
    out = C.linear(x, layer, int8)
    each = torch.cat([C.weight_linear(x, p, int8) for p in parts], dim=1)
    assert torch.equal(out, each)
    torch.testing.assert_close(out, TORCH.linear(x, layer, int8), atol=1e-5 * out.abs().max().item(), rtol=0)


def test_default_weights_stay_in_the_files_form(smollm_llm):
    model = smollm_llm.engine.runner.model
    types = [p.qtype for layer in model.linears() for p in layer.parts]
    assert types.count("Q4_1") == 120 and types[-1] == "Q8_0"  # every layer's Q4_1 matrices; the tied Q8_0 head
    assert model.lm_head.parts[0] is model.embed_tokens.weight
    assert all(layer.dense is None for layer in model.linears())  # no float32 copy on the C backend


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


@requires_kernels
def test_bench_kernels_measures_each_type(capsys):
    """`nanoserve bench kernels` (small shapes here): one table row per type and row count."""
    from nanoserve.bench import kernels

    kernels.main(["--types", "Q4_K,Q8_0,F16", "--rows", "1,3", "--n", "64", "--k", "512", "--repeats", "1",
                  "--copies-mib", "1"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| Q") or line.startswith("| F")]
    assert [line.split("|")[1:3] for line in lines] == [[f" {t} ", f" {r} "] for t in ("Q4_K", "Q8_0", "F16")
                                                         for r in (1, 3)]


def test_bench_kernels_cycles_through_copies_of_the_weights():
    """Each product of `bench kernels` reads its own copy (so that its weights come from memory, not the
    L3): copies of the same values in separate memory, together at least the bytes asked for."""
    from nanoserve.bench.kernels import weight_copies
    from nanoserve.kernels.quant import random_blocks

    w = random_blocks("Q4_K", 64, 512)
    layers = weight_copies(w, 5 * w.nbytes - 1)
    assert len(layers) == 5
    assert len({layer.parts[0].data.data_ptr() for layer in layers} | {w.data.data_ptr()}) == 6
    assert all(torch.equal(layer.parts[0].data, w.data) for layer in layers)


@requires_kernels
def test_bench_kernels_times_decode_attention(capsys):
    """`nanoserve bench kernels --attention` (a small cache here): one line with the time per layer."""
    from nanoserve.bench import kernels

    kernels.main(["--attention", "8,2,64", "--batch", "3", "--ctx", "40", "--layers", "2", "--repeats", "1"])
    out = capsys.readouterr().out
    assert "decode attention, 8 heads / 2 KV heads x 64, 3 rows of ~40 positions" in out
    assert float(out.split(" us per layer")[0].rsplit(" ", 1)[1]) > 0
