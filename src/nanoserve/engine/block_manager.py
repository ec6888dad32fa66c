"""`BlockManager`: the pool of fixed-size KV-cache blocks. Free list with LRU eviction, reference
counts, and prefix caching keyed by a SHA-256 chain over each full block's token ids, every hit checked
against the cached block's own tokens and parent. Knows nothing of the KV tensors themselves, only
block ids."""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Optional

from nanoserve.engine.request import Request

NO_CACHED_PARENT = -1  # Request.cache_parent once a block of its chain could not be cached


def hash_block(parent: Optional[bytes], token_ids: tuple[int, ...]) -> bytes:
    """Chained SHA-256 over the parent block's key and this block's tokens (8 bytes each): a block's key
    covers every token before it, and no one can craft two prefixes with one key, as they can with
    Python's hash() of ints (vLLM's CVE-2025-25183)."""
    h = hashlib.sha256(parent if parent is not None else b"")
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[Optional[bytes]] = [None] * num_blocks
        # What a cached block holds, checked on every hit: its tokens and the cached block before it.
        self.block_tokens: list[Optional[tuple[int, ...]]] = [None] * num_blocks
        self.block_parent: list[Optional[int]] = [None] * num_blocks
        # Blocks with ref count 0, oldest-freed first; cached ones stay findable until reused.
        self.free_blocks: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached_blocks: dict[bytes, int] = {}  # block hash -> block id
        # Prefix-cache statistics, in tokens.
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    # ------------------------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, req: Request, num_new_tokens: int, num_new_computed: int = 0) -> int:
        total = req.num_computed_tokens + num_new_computed + num_new_tokens
        return max(0, -(-total // self.block_size) - len(req.block_ids))

    # --------------------------------------------------------------------------------- prefix hits
    def update_block_hashes(self, req: Request) -> None:
        """Extends the request's hash chain over every full block of its known tokens."""
        bs = self.block_size
        while (len(req.block_hashes) + 1) * bs <= req.num_tokens:
            i = len(req.block_hashes)
            parent = req.block_hashes[-1] if req.block_hashes else None
            req.block_hashes.append(hash_block(parent, tuple(req.all_token_ids[i * bs:(i + 1) * bs])))

    def _block_tokens(self, req: Request, i: int) -> tuple[int, ...]:
        return tuple(req.all_token_ids[i * self.block_size:(i + 1) * self.block_size])

    def _cached_match(self, key: bytes, tokens: tuple[int, ...], parent: Optional[int]) -> Optional[int]:
        """The cached block under `key`, if it holds `tokens` after `parent` (the cached block matched
        for the tokens before): a hit is never taken on the key alone, so even a collision of keys
        cannot hand one request another's blocks."""
        block = self.cached_blocks.get(key)
        if block is None or self.block_tokens[block] != tokens or self.block_parent[block] != parent:
            return None
        return block

    def find_cached_prefix(self, req: Request) -> list[int]:
        """Block ids of the longest cached prefix of a request that has nothing computed yet. At least
        one token is always left to compute, since the model must produce logits for the last one."""
        if not self.enable_prefix_caching or req.params.prompt_logprobs is not None:
            return []  # prompt logprobs need every prompt position computed
        self.update_block_hashes(req)
        max_blocks = (req.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for i, h in enumerate(req.block_hashes[:max_blocks]):
            block = self._cached_match(h, self._block_tokens(req, i), hits[-1] if hits else None)
            if block is None:
                break
            hits.append(block)
        return hits

    # ---------------------------------------------------------------------------- allocation
    def allocate(self, req: Request, num_new_tokens: int, cached_prefix: list[int] = ()) -> bool:
        """Reserves blocks for `num_new_tokens` more tokens (after taking `cached_prefix`, when
        given); returns False and changes nothing when the pool cannot hold them."""
        # Cached blocks with ref count 0 sit in the free list; taking them shrinks the free pool.
        reused_free = sum(1 for b in cached_prefix if self.ref_counts[b] == 0)
        # The cached prefix's blocks join the table as they are: only the blocks past them are new.
        need = max(0, self.blocks_needed(req, num_new_tokens, len(cached_prefix) * self.block_size)
                   - len(cached_prefix))
        if need > self.num_free_blocks - reused_free:
            return False
        for b in cached_prefix:
            if self.ref_counts[b] == 0:
                del self.free_blocks[b]
            self.ref_counts[b] += 1
        req.block_ids.extend(cached_prefix)
        for _ in range(need):
            b, _ = self.free_blocks.popitem(last=False)  # least recently freed
            if self.block_hash[b] is not None:  # evict its cached content
                if self.cached_blocks.get(self.block_hash[b]) == b:
                    del self.cached_blocks[self.block_hash[b]]
                self.block_hash[b] = self.block_tokens[b] = self.block_parent[b] = None
            self.ref_counts[b] = 1
            req.block_ids.append(b)
        return True

    def record_prefix_query(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.num_queried_tokens += num_prompt_tokens
        self.num_hit_tokens += num_hit_tokens

    def cache_full_blocks(self, req: Request) -> None:
        """Registers the request's newly computed full blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        self.update_block_hashes(req)
        num_full = min(req.num_computed_tokens // self.block_size, len(req.block_hashes))
        for i in range(req.num_registered_blocks, num_full):
            if req.cache_parent == NO_CACHED_PARENT:
                break
            b, h, tokens = req.block_ids[i], req.block_hashes[i], self._block_tokens(req, i)
            if self.block_hash[b] is None and h not in self.cached_blocks:
                self.cached_blocks[h] = b
                self.block_hash[b], self.block_tokens[b], self.block_parent[b] = h, tokens, req.cache_parent
            # The cached block with these tokens (b itself, a prefix hit, or an equal block cached by
            # another request, b then staying private) is the parent of the next one.
            found = self._cached_match(h, tokens, req.cache_parent)
            req.cache_parent = NO_CACHED_PARENT if found is None else found
        req.num_registered_blocks = max(req.num_registered_blocks, num_full)

    def free(self, req: Request) -> None:
        """Releases a request's blocks. Tail blocks go to the free list first so that they are
        evicted before the prefix blocks other requests are more likely to share."""
        for b in reversed(req.block_ids):
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free_blocks[b] = None
        req.block_ids = []
        req.num_registered_blocks = 0
        req.cache_parent = None
