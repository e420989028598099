"""Block ranges that packed documents leave visible, so the Pallas attention kernels skip the rest.

With segment ids (packed documents), a query sees only keys of its own segment. For
each tile of query rows the forward and dq kernels loop over key blocks; for each tile
of keys the dk/dv kernel loops over query blocks. The causal mask and the window already
bound those loops (`key_block_range`, `query_block_range`); this module adds the bound
the segments give, computed once per call outside the kernels (two scatters and gathers
over `[batch, length]`, no `[t, s]` array):

    key blocks of query block i:  [min over its rows r of first(r) // block_k,
                                   ceil(max over its rows r of (last(r) + 1) / block_k))
    first(r), last(r): the first and last key index whose segment id equals row r's

and symmetrically the query blocks of each key block. Ranges are conservative: ids are
clipped into a table of `length + 1` slots, so ids that collide (only ids above the
length can) merge their ranges, which widens a loop but never hides a visible key; the
kernels still apply the exact segment mask inside every block. A row whose segment has
no key gets an empty range (the kernels output 0 for it, as without the bound).

Result layout: int32 `[batch, num_blocks, 2]` holding `[lo, hi)` per block, read by the
kernels through a `(None, None, 2)` block.
"""

from __future__ import annotations

import jax.numpy as jnp


def _first_last(seg, slots: int):
    """Per batch row: first and last index of each (clipped) id in `seg` `[b, n]`; `n` and -1 where absent."""
    batch, length = seg.shape
    ids = jnp.clip(seg, 0, slots - 1)
    rows = jnp.arange(batch)[:, None]
    index = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), seg.shape)
    first = jnp.full((batch, slots), length, jnp.int32).at[rows, ids].min(index)
    last = jnp.full((batch, slots), -1, jnp.int32).at[rows, ids].max(index)
    return first, last


def visible_block_ranges(own, other, own_block: int, other_block: int):
    """`[b, len(own) // own_block, 2]`: per block of `own` positions, the `[lo, hi)` blocks of `other`
    positions holding any position with the same segment id (module docstring).

    own, other: int32 segment ids `[b, n_own]`, `[b, n_other]` (padded lengths, multiples of the blocks).
    """
    batch, n_own = own.shape
    slots = max(n_own, other.shape[1]) + 1
    first, last = _first_last(other, slots)
    ids = jnp.clip(own, 0, slots - 1)
    lo_pos = jnp.take_along_axis(first, ids, axis=1).reshape(batch, n_own // own_block, own_block)
    hi_pos = (jnp.take_along_axis(last, ids, axis=1) + 1).reshape(batch, n_own // own_block, own_block)
    lo = jnp.min(lo_pos, axis=2) // other_block
    hi = (jnp.max(hi_pos, axis=2) + other_block - 1) // other_block
    return jnp.stack([lo, hi], axis=-1).astype(jnp.int32)
