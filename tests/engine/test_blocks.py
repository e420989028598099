"""BlockAllocator: the null block, reference counts, prefix-cache revival and LRU eviction."""

import pytest

from axcore.engine.blocks import BlockAllocator, prefix_hash


def test_hands_out_every_block_but_the_null_one_once_then_refuses():
    alloc = BlockAllocator(6, 4)
    got = [alloc.allocate() for _ in range(5)]
    assert sorted(got) == [1, 2, 3, 4, 5]
    assert (alloc.num_used, alloc.num_free) == (5, 0)
    with pytest.raises(RuntimeError, match="no free KV block"):
        alloc.allocate()
    alloc.free(got[2])
    assert (alloc.num_used, alloc.num_free) == (4, 1)
    assert alloc.allocate() == got[2]


@pytest.mark.parametrize("block", [0, 7, -1, "1", True])
def test_the_null_block_and_unknown_ids_are_refused(block):
    alloc = BlockAllocator(7, 2)
    with pytest.raises(RuntimeError, match="no KV block"):
        alloc.free(block)


def test_a_double_free_and_registering_a_free_block_are_programming_errors():
    alloc = BlockAllocator(4, 2)
    block = alloc.allocate()
    alloc.free(block)
    with pytest.raises(RuntimeError, match="freed twice"):
        alloc.free(block)
    with pytest.raises(RuntimeError, match="while free"):
        alloc.register(block, 123)


def test_a_shared_block_is_free_only_after_its_last_reference_goes():
    alloc = BlockAllocator(3, 2)
    block = alloc.allocate()
    key = prefix_hash(None, [5, 6], None)
    assert alloc.register(block, key)
    assert alloc.lookup(key) == block and alloc.lookup(key) == block
    assert alloc.refcount(block) == 3
    for left in (2, 1):
        alloc.free(block)
        assert (alloc.refcount(block), alloc.num_used) == (left, 1)
    alloc.free(block)
    assert (alloc.num_used, alloc.num_free) == (0, 2)
    # Free but still findable: a lookup revives it without allocating.
    assert alloc.lookup(key) == block
    assert (alloc.refcount(block), alloc.num_used, alloc.queries, alloc.hits) == (1, 1, 3, 3)
    assert alloc.allocate() != block


def test_plain_free_blocks_go_first_then_cached_ones_least_recently_freed_first():
    alloc = BlockAllocator(6, 2)
    blocks = [alloc.allocate() for _ in range(5)]
    keys = {block: prefix_hash(None, [block, block], "lora-a") for block in blocks[:3]}
    for block, key in keys.items():
        alloc.register(block, key)
    order = [blocks[1], blocks[0], blocks[2]]
    for block in order + blocks[3:]:
        alloc.free(block)
    assert alloc.num_cached == 3
    # The two plain blocks first, then the cached ones in the order they were freed.
    assert [alloc.allocate() for _ in range(2)] == blocks[3:]
    evicted = []
    for _ in range(3):
        evicted.append(alloc.allocate())
        gone = [b for b in order if b in evicted]
        assert [alloc.cached(keys[b]) for b in order] == [None if b in gone else b for b in order]
    assert evicted == order and alloc.num_cached == 0


def test_reviving_a_block_keeps_it_from_eviction_and_refreshes_its_age():
    alloc = BlockAllocator(3, 1)
    first, second = alloc.allocate(), alloc.allocate()
    alloc.register(first, 1)
    alloc.register(second, 2)
    alloc.free(first)
    alloc.free(second)
    assert alloc.lookup(1) == first
    assert alloc.allocate() == second
    alloc.free(first)
    assert alloc.allocate() == first and alloc.cached(1) is None


def test_a_key_keeps_its_first_block_and_a_block_keeps_its_key():
    alloc = BlockAllocator(4, 2)
    one, two = alloc.allocate(), alloc.allocate()
    assert alloc.register(one, 9) and not alloc.register(two, 9)
    assert alloc.register(one, 9)
    with pytest.raises(RuntimeError, match="two keys"):
        alloc.register(one, 10)
    alloc.free(two)
    alloc.free(one)
    # The unregistered duplicate went back as plain: it is handed out before the cached block.
    assert [alloc.allocate(), alloc.allocate()] == [3, two] and alloc.cached(9) == one
    assert alloc.allocate() == one and alloc.cached(9) is None


def test_match_prefix_counts_every_key_and_takes_only_the_leading_hits():
    alloc = BlockAllocator(8, 2)
    tokens = [3, 1, 4, 1, 5, 9, 2, 6]
    keys, parent = [], None
    for i in range(4):
        parent = prefix_hash(parent, tokens[2 * i:2 * i + 2], None)
        keys.append(parent)
    held = [alloc.allocate() for _ in range(4)]
    for block, key in zip(held[:2], keys[:2]):
        alloc.register(block, key)
    alloc.register(held[3], keys[3])
    assert alloc.match_prefix(keys) == held[:2]
    assert (alloc.queries, alloc.hits) == (4, 2)
    # The adapter and the parent are part of the key.
    assert prefix_hash(None, [3, 1], "lora") != keys[0] and prefix_hash(keys[1], [3, 1], None) != keys[0]


def test_clearing_the_prefix_cache_forgets_every_key_and_keeps_the_free_count():
    alloc = BlockAllocator(4, 2)
    key = prefix_hash(None, [1, 2], None)
    block = alloc.allocate()
    alloc.register(block, key)
    with pytest.raises(RuntimeError, match="in use"):
        alloc.clear_prefix_cache()
    alloc.free(block)
    assert alloc.cached(key) == block
    alloc.clear_prefix_cache()
    assert (alloc.cached(key), alloc.num_cached, alloc.num_free) == (None, 0, 3)
    assert sorted(alloc.allocate() for _ in range(3)) == [1, 2, 3]
