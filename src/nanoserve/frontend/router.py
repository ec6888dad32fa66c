"""`EngineRouter`: which of N data-parallel engine cores gets a request. Least-loaded (tokens waiting
and running there), with prefix affinity: a prompt whose first blocks were recently sent to one engine
goes there again, where they are cached, unless that engine is loaded by more than what the cache saves."""
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
    # What a prompt token already in an engine's cache is worth against a token of load elsewhere: a miss
    # costs its prefill and keeps a second copy of the prefix in another cache (scripts/dp_compare.sh).
    cached_token_weight: float = 4.0


def prefix_block_hashes(seq, block_size: int, max_blocks: int) -> list[int]:
    """One chained hash per full block of a prompt's start (token ids, or text for a router that sees no
    tokens): hash k covers items [0, (k+1) * block_size)."""
    hashes, h = [], 0
    for k in range(min(len(seq) // block_size, max_blocks)):
        piece = seq[k * block_size:(k + 1) * block_size]
        h = hash((h, piece if isinstance(piece, str) else tuple(piece)))
        hashes.append(h)
    return hashes


class PrefixMemory:
    """Which routing targets (engines, replicas) each prefix block was sent to; the least recently routed
    blocks are forgotten first, beyond `capacity`."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.blocks: OrderedDict[int, set] = OrderedDict()

    def __len__(self) -> int:
        return len(self.blocks)

    def matched(self, hashes: list[int], num_targets: int) -> dict:
        """Target -> how many of these leading blocks it was sent (its longest prefix of them)."""
        found: dict = {}
        for k in range(len(hashes) - 1, -1, -1):
            for target in self.blocks.get(hashes[k], ()):
                found.setdefault(target, k + 1)
            if len(found) >= num_targets:
                break
        return found

    def record(self, hashes: list[int], target) -> None:
        blocks = self.blocks
        for h in hashes:
            blocks.setdefault(h, set()).add(target)
            blocks.move_to_end(h)
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)

    def forget(self, target) -> None:
        """A target that went away: no prefix is cached there any more."""
        for targets in self.blocks.values():
            targets.discard(target)


class EngineRouter:
    """Load: tokens (prompt + generated so far) of the requests this API server has in flight on each
    engine, fresh; and each engine's own report (every API server's requests), one step old. The larger
    of the two counts, so that a burst routed between two reports is seen and so is other API servers' load."""

    def __init__(self, num_engines: int, config: RouterConfig = RouterConfig()):
        self.num_engines, self.config = num_engines, config
        self.own_load = [0] * num_engines
        self.reported_load = [0] * num_engines
        self.prefixes = PrefixMemory(config.capacity)
        self.next_tie = 0  # equal loads take turns
        self.num_affinity_routed = 0

    def load(self, engine: int) -> int:
        return max(self.own_load[engine], self.reported_load[engine])

    def choose(self, prompt_token_ids: list[int]) -> int:
        """The engine for a new request: the least (load - weight x prompt tokens it has cached), that is
        the least loaded unless another's cache is worth more than the difference in load; equal ones
        take turns. Remembers the request's prefix blocks as sent there (a prefix that spilled over is then
        cached on both, and later requests may go to either)."""
        if self.num_engines == 1:
            return 0
        cfg = self.config
        hashes = prefix_block_hashes(prompt_token_ids, cfg.block_size, cfg.max_blocks) if cfg.affinity else []
        cached = {engine: blocks * cfg.block_size
                  for engine, blocks in self.prefixes.matched(hashes, self.num_engines).items()}
        costs = [self.load(i) - cfg.cached_token_weight * cached.get(i, 0) for i in range(self.num_engines)]
        low = min(costs)
        ties = [i for i, c in enumerate(costs) if c == low]
        engine = ties[self.next_tie % len(ties)]
        self.next_tie += 1
        if cached.get(engine, 0) == max(cached.values(), default=-1):
            self.num_affinity_routed += 1
        self.prefixes.record(hashes, engine)
        return engine

    def add(self, engine: int, tokens: int) -> None:
        self.own_load[engine] += tokens

    def report(self, engine: int, load_tokens: int) -> None:
        self.reported_load[engine] = load_tokens
