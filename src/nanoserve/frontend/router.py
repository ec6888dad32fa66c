"""`EngineRouter`: which of N data-parallel engine cores gets a request. Least-loaded (tokens waiting
and running there), with prefix affinity: a prompt whose first blocks were recently sent to one engine
goes there again, where they are cached, unless that engine is overloaded."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class RouterConfig:
    affinity: bool = True  # False: least-loaded only
    block_size: int = 16  # tokens per hashed prefix block (the engine's KV block size)
    max_blocks: int = 128  # prefix blocks hashed per prompt (2048 tokens at 16)
    capacity: int = 1 << 16  # prefix blocks remembered, least recently routed forgotten first
    # Affinity yields when the cached engine's load exceeds the least-loaded one's by both margins:
    # `balance_rel` times it and `balance_abs_tokens` more (SGLang's cache-aware router has the same two).
    balance_rel: float = 1.5
    balance_abs_tokens: int = 4096


def prefix_block_hashes(token_ids: list[int], block_size: int, max_blocks: int) -> list[int]:
    """One chained hash per full block of the prompt's start: hash k covers tokens [0, (k+1) * block_size)."""
    hashes, h = [], 0
    for k in range(min(len(token_ids) // block_size, max_blocks)):
        h = hash((h, tuple(token_ids[k * block_size:(k + 1) * block_size])))
        hashes.append(h)
    return hashes


class EngineRouter:
    """Load: tokens (prompt + generated so far) of the requests this API server has in flight on each
    engine, fresh; and each engine's own report (every API server's requests), one step old. The larger
    of the two counts, so that a burst routed between two reports is seen and so is other API servers' load."""

    def __init__(self, num_engines: int, config: RouterConfig = RouterConfig()):
        self.num_engines, self.config = num_engines, config
        self.own_load = [0] * num_engines
        self.reported_load = [0] * num_engines
        self.prefix_owner: OrderedDict[int, int] = OrderedDict()  # block hash -> engine, LRU order
        self.next_tie = 0  # equal loads take turns
        self.num_affinity_routed = 0

    def load(self, engine: int) -> int:
        return max(self.own_load[engine], self.reported_load[engine])

    def least_loaded(self) -> int:
        loads = [self.load(i) for i in range(self.num_engines)]
        low = min(loads)
        ties = [i for i, x in enumerate(loads) if x == low]
        choice = ties[self.next_tie % len(ties)]
        self.next_tie += 1
        return choice

    def cached_engine(self, hashes: list[int]) -> Optional[int]:
        """The engine that was sent the longest of these prefixes most recently; None if none is known."""
        for h in reversed(hashes):
            engine = self.prefix_owner.get(h)
            if engine is not None:
                return engine
        return None

    def choose(self, prompt_token_ids: list[int]) -> int:
        """The engine for a new request; remembers its prefix blocks as sent there."""
        if self.num_engines == 1:
            return 0
        cfg = self.config
        hashes = prefix_block_hashes(prompt_token_ids, cfg.block_size, cfg.max_blocks) if cfg.affinity else []
        engine = self.least_loaded()
        cached = self.cached_engine(hashes)
        if cached is not None and cached != engine:
            low, mine = self.load(engine), self.load(cached)
            if not (mine > cfg.balance_rel * low and mine > low + cfg.balance_abs_tokens):
                engine = cached
        if cached == engine:
            self.num_affinity_routed += 1
        for h in hashes:
            self.prefix_owner[h] = engine
            self.prefix_owner.move_to_end(h)
        while len(self.prefix_owner) > cfg.capacity:
            self.prefix_owner.popitem(last=False)
        return engine

    def add(self, engine: int, tokens: int) -> None:
        self.own_load[engine] += tokens

    def report(self, engine: int, load_tokens: int) -> None:
        self.reported_load[engine] = load_tokens
