"""The data-parallel request router (least-loaded with prefix affinity) and the launcher's CPU split,
without engines."""
import pytest

from nanoserve.entrypoints.openai.launcher import engine_cpu_sets
from nanoserve.frontend.router import EngineRouter, RouterConfig, prefix_block_hashes


def prompt(tag: int, blocks: int = 4, tail: int = 5) -> list[int]:
    return [tag * 1000 + i for i in range(blocks * 16)] + list(range(tail))


def test_prefix_block_hashes_are_chained_and_cover_full_blocks_only():
    a = prefix_block_hashes(list(range(40)), 16, 128)
    assert len(a) == 2
    b = prefix_block_hashes([99] + list(range(1, 40)), 16, 128)
    assert a[0] != b[0] and a[1] != b[1]  # a change in block 0 changes every later hash
    assert prefix_block_hashes(list(range(40)), 16, 1) == a[:1]


def test_a_repeated_prefix_goes_back_to_its_engine():
    router = EngineRouter(2)
    first = router.choose(prompt(1))
    router.add(first, 69)
    other = router.choose(prompt(2))
    assert other != first  # least loaded
    router.add(other, 69)
    for _ in range(4):  # same system prompt, different user turns
        assert router.choose(prompt(1, tail=9)) == first
        assert router.choose(prompt(2, tail=7)) == other
    assert router.num_affinity_routed == 8


def test_affinity_yields_when_the_load_difference_outweighs_the_cached_prefill():
    router = EngineRouter(2, RouterConfig(cached_token_weight=2.0))
    home = router.choose(prompt(1))  # 4 blocks: 64 tokens cached there, worth 128 of load
    router.add(home, 120)
    assert router.choose(prompt(1)) == home  # 120 more tokens of load than the other
    router.add(home, 10)
    other = router.choose(prompt(1))
    assert other != home  # 130 more: the other engine, which now caches it too
    router.add(other, 140)
    assert router.choose(prompt(1)) == home  # both cache it: the least loaded


def test_least_loaded_without_affinity_and_ties_take_turns():
    router = EngineRouter(3, RouterConfig(affinity=False))
    assert [router.choose(prompt(1)) for _ in range(3)] == [0, 1, 2]  # equal loads: in turn
    router.add(0, 10)
    router.add(2, 5)
    assert router.choose(prompt(1)) == 1
    router.report(1, 50)  # another API server's requests, reported by the engine
    assert router.choose(prompt(1)) == 2


def test_prefix_memory_is_bounded():
    router = EngineRouter(2, RouterConfig(capacity=8))
    for tag in range(10):
        router.choose(prompt(tag))
    assert len(router.prefixes) == 8


def test_one_engine_is_always_chosen():
    router = EngineRouter(1)
    assert router.choose(prompt(1)) == 0 and not router.prefixes


def test_engine_cpu_sets():
    assert engine_cpu_sets(1, 0, [0, 1]) == [None]
    assert engine_cpu_sets(2, 0, [0, 1]) == [[0], [1]]
    assert engine_cpu_sets(2, 0, [0, 1, 2, 3, 4]) == [[0, 1], [2, 3]]
    assert engine_cpu_sets(1, 1, [4, 5]) == [[4]]
    assert engine_cpu_sets(3, 2, list(range(8))) == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(ValueError, match="needs 3 CPUs; this process may use 2"):
        engine_cpu_sets(3, 0, [0, 1])
    with pytest.raises(ValueError, match="needs 4 CPUs"):
        engine_cpu_sets(2, 2, [0, 1])
    with pytest.raises(ValueError, match="data-parallel-size"):
        engine_cpu_sets(0, 0, [0, 1])
