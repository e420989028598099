"""`visible_block_ranges`: the key (query) blocks packed documents leave visible, against a brute-force count."""

import jax.numpy as jnp
import numpy as np
import pytest

from axcore_gpu.pallas_segment_ranges import visible_block_ranges


def _brute_force(own, other, own_block, other_block):
    """Per own block: the sorted other-block indices holding a position with an id of the block's rows."""
    out = []
    for row_own, row_other in zip(own, other):
        blocks = []
        for start in range(0, len(row_own), own_block):
            ids = set(row_own[start:start + own_block].tolist())
            blocks.append(sorted({j // other_block for j, x in enumerate(row_other.tolist()) if x in ids}))
        out.append(blocks)
    return out


def _packed(lengths, total):
    """1-based segment ids of documents of `lengths`, then 0 (padding) up to `total`."""
    ids = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)] + [np.zeros(total - sum(lengths))])
    return ids.astype(np.int32)


@pytest.mark.parametrize("own_block, other_block", [(16, 16), (32, 16), (16, 64)])
def test_contiguous_documents_give_exactly_the_visible_blocks(own_block, other_block):
    seg = np.stack([_packed([9, 40, 15, 50], 128), _packed([128], 128), _packed([3, 3, 100], 128)])
    got = np.asarray(visible_block_ranges(jnp.asarray(seg), jnp.asarray(seg), own_block, other_block))
    for row, blocks in enumerate(_brute_force(seg, seg, own_block, other_block)):
        for i, visible in enumerate(blocks):
            # Contiguous documents: the visible blocks are one run, and the range is exactly that run.
            assert visible == list(range(visible[0], visible[-1] + 1))
            assert tuple(got[row, i]) == (visible[0], visible[-1] + 1), (row, i)


def test_scattered_ids_and_ids_past_the_length_stay_conservative():
    rng = np.random.default_rng(0)
    own = rng.integers(0, 5, (2, 64)).astype(np.int32)
    other = rng.integers(0, 5, (2, 96)).astype(np.int32)
    own[0, :16] = 1000  # Past the table: clipped, so it may merge with other ids but never loses a key.
    other[0, 50] = 1000
    got = np.asarray(visible_block_ranges(jnp.asarray(own), jnp.asarray(other), 16, 32))
    for row, blocks in enumerate(_brute_force(own, other, 16, 32)):
        for i, visible in enumerate(blocks):
            lo, hi = got[row, i]
            assert all(lo <= b < hi for b in visible), (row, i, visible, (lo, hi))


def test_a_segment_without_keys_gives_an_empty_range():
    own = np.array([[7] * 16 + [1] * 16], np.int32)
    other = np.array([[1] * 32], np.int32)
    got = np.asarray(visible_block_ranges(jnp.asarray(own), jnp.asarray(other), 16, 16))
    assert got[0, 0, 0] >= got[0, 0, 1]  # Block of id 7 only: nothing to visit.
    assert tuple(got[0, 1]) == (0, 2)
