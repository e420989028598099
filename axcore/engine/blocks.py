"""The paged KV cache's block allocator: a free list, reference counts, and prefix caching.

The cache of every attention layer is `[num_blocks, block_size, kv_heads, head_dim]`; this
allocator hands out block ids, never the arrays. Block 0 is the NULL block: it is never
handed out (padding tokens write there). A block is *used* while at least one live block
table holds it (its reference count); at count 0 it is *free*.

Prefix caching: a FULL block (all `block_size` tokens computed) may be registered under the
hash chain of its contents, `prefix_hash(parent_hash, tokens, adapter)`, where `parent_hash`
is the previous block's hash (None for a sequence's first block) and `adapter` the LoRA
adapter's name (None for the base model: an adapter's keys and values differ from the
base's). Freeing a registered block leaves it findable by `lookup` until it is reused;
`allocate` hands out never-registered free blocks first, then evicts registered free blocks
in least-recently-freed order (LRU). Two sequences that compute the same prefix at once
keep one registered copy; the other block is freed as plain.

Known limit: a key is a 64-bit Python hash (salted per process for strings), so two
different prefixes colliding would share a block; the chance is about n^2 / 2^64 for n
cached blocks. Misuse (freeing a free block, an id out of range, allocating from an empty
pool) is a programming error and raises RuntimeError, never a user error.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

NULL_BLOCK = 0


def prefix_hash(parent_hash: int | None, tokens: Sequence[int], adapter: str | None) -> int:
    """The key of a full block: its tokens, the key of the block before it, and the adapter."""
    return hash((parent_hash, tuple(tokens), adapter))


class BlockAllocator:
    """Block ids 1..num_blocks-1 with reference counts, a free list and an LRU prefix cache.

    Counters: `queries` (blocks looked up in the prefix cache) and `hits` (found), both since
    construction; gauges `num_used` (blocks with a reference) and `num_free` (the rest but
    block 0, cached-but-unused blocks included).
    """

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 2 or block_size < 1:
            raise RuntimeError(f"need num_blocks >= 2 and block_size >= 1, got {num_blocks}, {block_size}")
        # Blocks in the cache (block 0, the null block, included) and tokens per block.
        self.num_blocks, self.block_size = num_blocks, block_size
        self._refs = [0] * num_blocks
        # Free blocks that hold no registered prefix, reused first (FIFO).
        self._plain: collections.deque[int] = collections.deque(range(1, num_blocks))
        # Free blocks that hold a registered prefix: block -> key, least recently freed first.
        self._evictable: collections.OrderedDict[int, int] = collections.OrderedDict()
        self._key_of: dict[int, int] = {}
        self._block_of: dict[int, int] = {}
        self._used = 0
        # Prefix-cache blocks looked up, and found, since construction.
        self.queries = 0
        self.hits = 0

    @property
    def num_used(self) -> int:
        """Blocks held by at least one block table."""
        return self._used

    @property
    def num_free(self) -> int:
        """Blocks `allocate` can still hand out (plain free ones plus cached-but-unused ones)."""
        return self.num_blocks - 1 - self._used

    @property
    def num_cached(self) -> int:
        """Blocks registered in the prefix cache, used or not."""
        return len(self._key_of)

    def refcount(self, block: int) -> int:
        """How many block tables hold `block`."""
        self._check(block)
        return self._refs[block]

    def allocate(self) -> int:
        """A block with reference count 1: a plain free one, else the LRU cached free one (evicted)."""
        if self._plain:
            block = self._plain.popleft()
        elif self._evictable:
            block, key = self._evictable.popitem(last=False)
            del self._key_of[block], self._block_of[key]
        else:
            raise RuntimeError("no free KV block left (the scheduler checks `num_free` before allocating)")
        self._refs[block] = 1
        self._used += 1
        return block

    def free(self, block: int) -> None:
        """Drop one reference; at zero the block is free (and, if registered, evictable, most recent last)."""
        self._check(block)
        if self._refs[block] == 0:
            raise RuntimeError(f"KV block {block} freed twice")
        self._refs[block] -= 1
        if self._refs[block] == 0:
            self._used -= 1
            if block in self._key_of:
                self._evictable[block] = self._key_of[block]
            else:
                self._plain.append(block)

    def register(self, block: int, key: int) -> bool:
        """Make the full, used `block` findable under `key`; False if `key` already has a block.

        A block is registered at most once (its contents never change while it is held).
        """
        self._check(block)
        if self._refs[block] == 0:
            raise RuntimeError(f"KV block {block} registered while free")
        if block in self._key_of:
            if self._key_of[block] != key:
                raise RuntimeError(f"KV block {block} registered under two keys")
            return True
        if key in self._block_of:
            return False
        self._key_of[block], self._block_of[key] = key, block
        return True

    def cached(self, key: int) -> int | None:
        """The block registered under `key`, or None; no counter or state changes."""
        return self._block_of.get(key)

    def lookup(self, key: int) -> int | None:
        """Take one reference to the block cached under `key` (reviving it if free), or None.

        Counts one query, and one hit when found.
        """
        self.queries += 1
        block = self._block_of.get(key)
        if block is None:
            return None
        self.hits += 1
        if self._refs[block] == 0:
            del self._evictable[block]
            self._used += 1
        self._refs[block] += 1
        return block

    def match_prefix(self, keys: Sequence[int]) -> list[int]:
        """Take the blocks of the longest cached prefix of `keys` (one reference each).

        Every key counts as a query (the ones after the first miss are misses too).
        """
        blocks: list[int] = []
        for key in keys:
            block = self.lookup(key)
            if block is None:
                self.queries += len(keys) - len(blocks) - 1
                break
            blocks.append(block)
        return blocks

    def clear_prefix_cache(self) -> None:
        """Forget every registered prefix (the cache's contents are stale, e.g. new weights); needs no block used."""
        if self._used:
            raise RuntimeError(f"the prefix cache cleared while {self._used} KV blocks are in use")
        self._plain.extend(self._evictable)
        self._evictable.clear()
        self._key_of.clear()
        self._block_of.clear()

    def _check(self, block: int) -> None:
        if isinstance(block, bool) or not isinstance(block, int) or not NULL_BLOCK < block < self.num_blocks:
            raise RuntimeError(f"no KV block {block!r} (ids 1..{self.num_blocks - 1}; 0 is the null block)")
