"""Backward kernels of the Pallas flash attention (`pallas_attention`): FlashAttention-2.

With `p = exp(c - lse)` recomputed from the saved logsumexp (c the soft-capped
logits, masked probabilities 0) and `delta = rowsum(dO * O)`:

    dv = p^T dO                 dp = dO v^T             dc = p * (dp - delta)
    ds = dc * (1 - (c / softcap)^2)   (the soft-cap's derivative; ds = dc without it)
    dq = scale * ds k           dk = scale * ds^T q

Two kernels: one per (batch, query head, query block) for dq, looping over the key
blocks the masks leave visible, which also writes delta; one per (batch, kv head,
key block) for dk and dv, looping over the kv head's group of query heads and over
the visible query blocks (so GQA sums the group's contributions on chip).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from axcore_gpu.pallas_common import (
    FlashConfig,
    dot,
    key_block_range,
    logits_and_mask,
    optional_inputs,
    out_struct,
    query_block_range,
    split_refs,
    within_segments,
)
from axcore_gpu.pallas_segment_ranges import visible_block_ranges


def _score_gradient(cfg: FlashConfig, s, mask, lse, delta, do, v):
    """(p, ds): the probabilities and the gradient of the loss w.r.t. the uncapped scaled logits."""
    p = jnp.exp(s - lse[:, None])  # lse is +inf on rows without a visible key: p = 0.
    if mask is not None:
        p = jnp.where(mask, p, 0.0)
    dp = dot(cfg, do, v, trans_b=True)
    ds = p * (dp - delta[:, None])
    if cfg.softcap is not None:  # d(softcap * tanh(x / softcap))/dx = 1 - tanh^2.
        ds = ds * (1.0 - jnp.square(s / cfg.softcap))
    return p, ds


def _dq_kernel(*refs, cfg: FlashConfig):
    (q_ref, k_ref, v_ref, q_seg_ref, kv_seg_ref, keep_ref), range_ref, rest = split_refs(cfg, refs)
    o_ref, do_ref, lse_ref, dq_ref, delta_ref = rest
    bq, bk = cfg.block_q_bwd, cfg.block_k_bwd
    q_block = pl.program_id(2)
    q, do, lse = q_ref[...], do_ref[...], lse_ref[...]
    delta = jnp.sum(o_ref[...].astype(jnp.float32) * do.astype(jnp.float32), axis=1)
    rows = q_block * bq + jnp.arange(bq)
    q_seg = None if q_seg_ref is None else q_seg_ref[...]

    def body(kb, dq):
        start = pl.multiple_of(kb * bk, bk)
        keys = pl.ds(start, bk)
        k, v = k_ref[keys, :], v_ref[keys, :]
        kv_seg = None if kv_seg_ref is None else kv_seg_ref[keys]
        kv_keep = None if keep_ref is None else keep_ref[keys]
        s, mask = logits_and_mask(cfg, q, k, rows, start + jnp.arange(bk), q_seg, kv_seg, kv_keep)
        _, ds = _score_gradient(cfg, s, mask, lse, delta, do, v)
        return dq + dot(cfg, ds.astype(k.dtype), k)

    lo, hi = within_segments(range_ref, *key_block_range(cfg, q_block, bq, bk))
    dq = lax.fori_loop(lo, hi, body, jnp.zeros((bq, q_ref.shape[-1]), jnp.float32))
    dq_ref[...] = (dq * cfg.scale).astype(dq_ref.dtype)
    delta_ref[...] = delta


def _dkdv_kernel(*refs, cfg: FlashConfig):
    (q_ref, k_ref, v_ref, q_seg_ref, kv_seg_ref, keep_ref), range_ref, rest = split_refs(cfg, refs)
    do_ref, lse_ref, delta_ref, dk_ref, dv_ref = rest
    bq, bk = cfg.block_q_bwd, cfg.block_k_bwd
    k_block = pl.program_id(2)
    k, v = k_ref[...], v_ref[...]
    cols = k_block * bk + jnp.arange(bk)
    kv_seg = None if kv_seg_ref is None else kv_seg_ref[...]
    kv_keep = None if keep_ref is None else keep_ref[...]
    lo, hi = within_segments(range_ref, *query_block_range(cfg, k_block, bq, bk))

    def one_head(g, carry):  # Query head g of this kv head's group.
        def body(qb, carry):
            dk, dv = carry
            start = pl.multiple_of(qb * bq, bq)
            rows = pl.ds(start, bq)
            q, do = q_ref[rows, g, :], do_ref[rows, g, :]
            lse, delta = lse_ref[g, rows], delta_ref[g, rows]
            q_seg = None if q_seg_ref is None else q_seg_ref[rows]
            s, mask = logits_and_mask(cfg, q, k, start + jnp.arange(bq), cols, q_seg, kv_seg, kv_keep)
            p, ds = _score_gradient(cfg, s, mask, lse, delta, do, v)
            dv = dv + dot(cfg, p.astype(do.dtype), do, trans_a=True)
            dk = dk + dot(cfg, ds.astype(q.dtype), q, trans_a=True)
            return dk, dv

        return lax.fori_loop(lo, hi, body, carry)

    zeros = jnp.zeros((bk, k_ref.shape[-1]), jnp.float32)
    if cfg.group == 1:
        dk, dv = one_head(0, (zeros, zeros))
    else:
        dk, dv = lax.fori_loop(0, cfg.group, one_head, (zeros, zeros))
    dk_ref[...] = (dk * cfg.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def flash_backward(cfg: FlashConfig, q, k, v, q_seg, kv_seg, kv_keep, out, lse, d_out):
    """(dq, dk, dv) of padded inputs, given the forward's output and logsumexp and the output's cotangent."""
    batch, q_pad, heads, head_dim = q.shape
    kv_pad, kv_heads = k.shape[1], k.shape[2]
    bq, bk, group = cfg.block_q_bwd, cfg.block_k_bwd, cfg.group
    d_out = d_out.astype(q.dtype)
    common = dict(compiler_params=cfg.compiler_params(), interpret=cfg.interpret)

    q_rows = pl.BlockSpec((None, bq, None, head_dim), lambda b, n, i: (b, i, n, 0))
    all_keys = pl.BlockSpec((None, kv_pad, None, head_dim), lambda b, n, i: (b, 0, n // group, 0))
    row_stats = pl.BlockSpec((None, None, bq), lambda b, n, i: (b, n, i))
    in_specs = [q_rows, all_keys, all_keys]
    if cfg.has_segments:
        in_specs += [pl.BlockSpec((None, bq), lambda b, n, i: (b, i)),
                     pl.BlockSpec((None, kv_pad), lambda b, n, i: (b, 0))]
    if cfg.has_kv_mask:
        in_specs.append(pl.BlockSpec((None, kv_pad), lambda b, n, i: (b, 0)))
    key_ranges = query_ranges = None
    if cfg.has_segments and cfg.segment_ranges:  # Visible key blocks per query block, and query blocks per key block.
        key_ranges = visible_block_ranges(q_seg, kv_seg, bq, bk)
        query_ranges = visible_block_ranges(kv_seg, q_seg, bk, bq)
        in_specs.append(pl.BlockSpec((None, None, 2), lambda b, n, i: (b, i, 0)))
    dq, delta = pl.pallas_call(
        functools.partial(_dq_kernel, cfg=cfg),
        grid=(batch, heads, q_pad // bq),
        in_specs=in_specs + [q_rows, q_rows, row_stats],
        out_specs=[q_rows, row_stats],
        out_shape=[out_struct(q, q.shape, q.dtype), out_struct(q, lse.shape, jnp.float32)],
        name="axcore_flash_backward_dq",
        **common,
    )(q, k, v, *optional_inputs(cfg, q_seg, kv_seg, kv_keep, key_ranges), out, d_out, lse)

    # One program per kv head and key block; q, dO and the row statistics of its group of query heads.
    group_rows = pl.BlockSpec((None, q_pad, group, head_dim), lambda b, h, j: (b, 0, h, 0))
    key_rows = pl.BlockSpec((None, bk, None, head_dim), lambda b, h, j: (b, j, h, 0))
    group_stats = pl.BlockSpec((None, group, q_pad), lambda b, h, j: (b, h, 0))
    in_specs = [group_rows, key_rows, key_rows]
    if cfg.has_segments:
        in_specs += [pl.BlockSpec((None, q_pad), lambda b, h, j: (b, 0)),
                     pl.BlockSpec((None, bk), lambda b, h, j: (b, j))]
    if cfg.has_kv_mask:
        in_specs.append(pl.BlockSpec((None, bk), lambda b, h, j: (b, j)))
    if query_ranges is not None:
        in_specs.append(pl.BlockSpec((None, None, 2), lambda b, h, j: (b, j, 0)))
    dk, dv = pl.pallas_call(
        functools.partial(_dkdv_kernel, cfg=cfg),
        grid=(batch, kv_heads, kv_pad // bk),
        in_specs=in_specs + [group_rows, group_stats, group_stats],
        out_specs=[key_rows, key_rows],
        out_shape=[out_struct(k, k.shape, k.dtype), out_struct(k, v.shape, v.dtype)],
        name="axcore_flash_backward_dkdv",
        **common,
    )(q, k, v, *optional_inputs(cfg, q_seg, kv_seg, kv_keep, query_ranges), d_out, lse, delta)
    return dq, dk, dv
