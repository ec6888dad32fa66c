"""Attention through the block table: the same logits for one block or many, one chunk or many, and a
prefix-cache hit or a cold start."""
import torch

from runner_driver import RunnerDriver


def _seqs():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 320, (n,), generator=g).tolist() for n in (37, 50, 64)]


def test_block_size_and_chunking_do_not_change_logits(tiny_models):
    path = tiny_models["llama"]
    seqs = _seqs()
    plen = [len(s) - 5 for s in seqs]
    # One block holds a whole sequence / many small blocks; one prefill chunk / many chunks.
    base = RunnerDriver(path, block_size=128, num_blocks=8).run(seqs, 1000, plen)
    for block_size, chunk in [(1, 1000), (4, 1000), (16, 5), (3, 11), (128, 1)]:
        other = RunnerDriver(path, block_size=block_size, num_blocks=512).run(seqs, chunk, plen)
        for a, b in zip(base, other):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_prefix_cache_hit_equals_cold(tiny_models):
    path = tiny_models["qwen3"]
    prefix = list(range(10, 10 + 48))  # three full blocks of 16
    a = prefix + [100, 101, 102, 103, 104]
    b = prefix + [200, 201, 202]
    cold = RunnerDriver(path, block_size=16, num_blocks=64).run([b], 1000, [len(b)])[0]

    driver = RunnerDriver(path, block_size=16, num_blocks=64)
    driver.run([a], 1000, [len(a)])  # fills the prefix cache
    req = driver.new_request(b)
    hit = driver.bm.find_cached_prefix(req)
    assert len(hit) == 3
    assert driver.bm.allocate(req, len(b) - 48, hit)
    req.num_computed_tokens = 48
    warm = driver.step([(req, len(b) - 48)])[0]
    torch.testing.assert_close(warm, cold[48:], atol=1e-5, rtol=0)


def test_decode_with_mixed_context_lengths(tiny_models):
    """Batched decode pads contexts to the longest; padding must not leak into shorter rows."""
    path = tiny_models["qwen2"]
    seqs = _seqs()
    together = RunnerDriver(path, block_size=4, num_blocks=256).run(seqs, 1000, [3, 20, 40])
    for s, t, p in zip(seqs, together, [3, 20, 40]):
        alone = RunnerDriver(path, block_size=4, num_blocks=256).run([s], 1000, [p])[0]
        torch.testing.assert_close(alone, t, atol=1e-5, rtol=0)
