"""Context-parallel attention: the sequence split over the `context` mesh axis (`CONTEXT_AXIS`).

Under a mesh whose `context` axis shards the sequence dim of q, k and v, each device
holds `T / N` consecutive *stored* positions (N = the axis size) and attention must not
gather the whole sequence's scores. Two kernels of the `attention` op do it, chosen by
the registry like any attention kernel (tried by priority, the first whose `is_supported`
accepts runs). The all-gather threshold below is a guess, not yet measured on GPU or TPU:

- `context_all_gather` (priority 30): gathers K and V (and their segment ids and key
  mask) over the axis, keeps the local queries: memory `[t_local, T]` scores per
  device; supported up to `ALL_GATHER_MAX_KV_LEN[platform]` keys (short contexts,
  where one gather beats N latency-bound ring steps).
- `context_ring` (priority 20, any length): K/V blocks travel around the axis with
  `jax.lax.ppermute` (N - 1 hops), each step's block folded into a float32 online
  softmax (running max, sum, output); blocks that causality (or the sliding window)
  hides entirely are skipped with `lax.cond`; each block update is rematerialized
  in the backward pass, so no `[t_local, T]` scores are kept. A device's queries are
  folded `block_q` (default 2048) at a time, so one update holds `[block_q, T / 2N]`
  scores per head rather than `[T / N, T / 2N]`: at 131,072 tokens on 8 devices, 2 GB
  instead of 8.6 GB per buffer (benchmarks/README.md, "Long context").

Both group query heads over kv heads (GQA without repeating keys), honour segment ids
(which travel with their K/V block), the key mask, causal and sliding-window masks and
the soft-cap; they decline dropout, position biases and dense biases (the `xla`
reference then runs under GSPMD).

Causal load balancing ("zigzag"): with a causal mask the late positions see many more
keys. The sequence is split into 2N chunks and stored so that device i holds chunks i
and 2N-1-i (`zigzag_permutation`); `axcore.layers.lm.CausalLM` reorders its batch once
at the model input (labels and weights too, so the loss is unchanged; positions for
RoPE travel explicitly) and runs the decoder inside `zigzag_layout(N)`; the attention
layer then puts `extras[ZIGZAG_EXTRA] = N` on its problems, and every kernel that
knows it (these two and `xla`) masks by the tokens' original indices.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from axcore.kernels.attention import ZIGZAG_EXTRA, AttentionProblem, zigzag_permutation
from axcore.kernels.attention_sharding import _names, _padded
from axcore.kernels.registry import SUPPORTED, Support, unknown_extras

# The mesh axis whose sharding of the sequence the context kernels handle.
CONTEXT_AXIS = "context"
# Most keys (the full kv_len) `context_all_gather` gathers on each platform; above it the ring runs.
ALL_GATHER_MAX_KV_LEN = {"cpu": 8192, "gpu": 8192, "tpu": 16384}
DEFAULT_ALL_GATHER_MAX_KV_LEN = 8192

_ZIGZAG: contextvars.ContextVar[int] = contextvars.ContextVar("axcore_zigzag_shards", default=1)


@contextlib.contextmanager
def zigzag_layout(shards: int) -> Iterator[None]:
    """While active, sequences traced are stored in zigzag order for `shards` (`zigzag_permutation`)."""
    token = _ZIGZAG.set(shards)
    try:
        yield
    finally:
        _ZIGZAG.reset(token)


def current_zigzag_shards() -> int:
    """The innermost `zigzag_layout`'s shards, 1 outside one (natural order)."""
    return _ZIGZAG.get()


def context_layout(problem: AttentionProblem) -> tuple[Support, tuple[PartitionSpec, PartitionSpec] | None]:
    """Whether the problem's sequence is split over the context axis alone, and the `(q_spec, kv_spec)`."""
    mesh = problem.mesh
    if mesh is None or CONTEXT_AXIS not in mesh.axis_names or mesh.shape[CONTEXT_AXIS] == 1:
        return Support(False, f"no '{CONTEXT_AXIS}' mesh axis of size > 1"), None
    specs = tuple(problem.input_specs[:3])
    if len(specs) < 3 or any(spec is None for spec in specs):
        return Support(False, "input_specs of q, k, v are unknown"), None
    q_spec, k_spec, v_spec = (_padded(spec) for spec in specs)
    if k_spec != v_spec or q_spec[0] != k_spec[0] or q_spec[1] != k_spec[1]:
        return Support(False, f"q, k and v are sharded differently ({q_spec}, {k_spec}, {v_spec})"), None
    if _names(q_spec[1]) != (CONTEXT_AXIS,):
        return Support(False, f"the sequence dim is sharded over {_names(q_spec[1]) or 'nothing'}, not '{CONTEXT_AXIS}' alone"), None
    if q_spec[3] is not None or k_spec[3] is not None:
        return Support(False, "head_dim is sharded"), None
    if q_spec[2] != k_spec[2]:
        return Support(False, f"query heads are sharded over {q_spec[2]} but kv heads over {k_spec[2]}"), None
    return SUPPORTED, (PartitionSpec(*q_spec), PartitionSpec(*k_spec))


def _common_support(problem: AttentionProblem) -> Support:
    known = unknown_extras(problem, (ZIGZAG_EXTRA,))
    if not known:
        return known
    if problem.num_heads % problem.num_kv_heads:
        return Support(False, "num_heads must be a multiple of num_kv_heads")
    if problem.q_len != problem.kv_len:
        return Support(False, "context parallelism is for self-attention (q_len == kv_len)")
    if problem.dropout_rate > 0 or problem.bias_slopes is not None or problem.bias_fn is not None or problem.has_bias:
        return Support(False, "dropout and position or dense biases are not implemented")
    support, _ = context_layout(problem)
    if not support:
        return support
    shards = problem.mesh.shape[CONTEXT_AXIS]
    zigzag = problem.extras.get(ZIGZAG_EXTRA, 1)
    if zigzag not in (1, shards):
        return Support(False, f"the sequence is in zigzag order for {zigzag} shards but the context axis has {shards}")
    if problem.q_len % (2 * shards if zigzag > 1 else shards):
        return Support(False, f"q_len {problem.q_len} does not split into the context axis's {shards} shards")
    return SUPPORTED


def _stored_chunks(device, local_len: int, shards: int, zigzag: bool) -> list[tuple[Any, int]]:
    """(first original index, length) of each contiguous run of device `device`'s stored positions."""
    if not zigzag:
        return [(device * local_len, local_len)]
    half = local_len // 2
    return [(device * half, half), ((2 * shards - 1 - device) * half, half)]


def _indices(chunks: list[tuple[Any, int]]) -> jax.Array:
    return jnp.concatenate([start + jnp.arange(length) for start, length in chunks])


def _block_mask(problem: AttentionProblem, q_idx, k_idx, q_seg, k_seg, k_mask):
    """`[b|1, 1, 1, tq, tk]` bool: which keys (original indices k_idx) each query (q_idx) may see."""
    allowed = jnp.ones((1, q_idx.shape[0], k_idx.shape[0]), bool)
    if problem.causal:
        allowed = allowed & (k_idx[None, None, :] <= q_idx[None, :, None])
    if problem.sliding_window is not None:
        allowed = allowed & (q_idx[None, :, None] - k_idx[None, None, :] < problem.sliding_window)
    if q_seg is not None:
        allowed = allowed & (q_seg[:, :, None] == k_seg[:, None, :])
    if k_mask is not None:
        allowed = allowed & k_mask[:, None, :].astype(bool)
    return allowed[:, None, None]


def _fold_block(problem: AttentionProblem, acc, q5, k, v, allowed):
    """Online-softmax update of `acc = (out [b,kv,g,tq,h], max [b,kv,g,tq], sum [b,kv,g,tq])` (float32)
    with one key block k, v `[b, tk, kv, h]`; q5 `[b, tq, kv, g, h]`."""
    out, run_max, run_sum = acc
    logits = jnp.einsum("btkgh,bskh->bkgts", q5, k, preferred_element_type=jnp.float32) * problem.scale
    if problem.softcap is not None:
        logits = problem.softcap * jnp.tanh(logits / problem.softcap)
    floor = jnp.finfo(jnp.float32).min
    logits = jnp.where(allowed, logits, floor)
    new_max = jnp.maximum(run_max, jnp.max(logits, axis=-1))
    probs = jnp.where(allowed, jnp.exp(logits - new_max[..., None]), 0.0)
    correction = jnp.exp(run_max - new_max)
    new_sum = run_sum * correction + jnp.sum(probs, axis=-1)
    pv = jnp.einsum("bkgts,bskh->bkgth", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out * correction[..., None] + pv, new_max, new_sum


def _empty_acc(q5):
    b, t, kv, g, h = q5.shape
    floor = jnp.finfo(jnp.float32).min
    return jnp.zeros((b, kv, g, t, h), jnp.float32), jnp.full((b, kv, g, t), floor), jnp.zeros((b, kv, g, t), jnp.float32)


def _finish(acc, dtype):
    """`[b, tq, n, h]` in `dtype` from an accumulator; rows that saw no key give zeros (never NaN)."""
    out, _, run_sum = acc
    out = out / jnp.maximum(run_sum, jnp.finfo(jnp.float32).tiny)[..., None]
    b, kv, g, t, h = out.shape
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, kv * g, h).astype(dtype)


def _check_inputs(name, kv_mask, q_segment_ids, kv_segment_ids, declined):
    unexpected = sorted(k for k, v in declined.items() if v is not None)
    if unexpected:
        raise ValueError(f"{name} attention was given {unexpected}, which is_supported declines.")
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError(f"{name} attention needs q_segment_ids and kv_segment_ids together.")


class _ContextAttention:
    """Shared `is_supported` and shard_map wrapping; subclasses define `_local`."""

    name = ""
    priority = 0

    def is_supported(self, problem: AttentionProblem) -> Support:
        return _common_support(problem)

    def __call__(self, problem, q, k, v, *, kv_mask=None, q_segment_ids=None, kv_segment_ids=None, **declined):
        _check_inputs(self.name, kv_mask, q_segment_ids, kv_segment_ids, declined)
        support = self.is_supported(problem)
        if not support:
            raise ValueError(f"{self.name} attention cannot run this problem: {support.reason}.")
        _, (q_spec, kv_spec) = context_layout(problem)
        shards = problem.mesh.shape[CONTEXT_AXIS]
        zigzag = problem.extras.get(ZIGZAG_EXTRA, 1) > 1
        q_rows, k_rows = PartitionSpec(q_spec[0], q_spec[1]), PartitionSpec(kv_spec[0], kv_spec[1])
        has_seg, has_mask = q_segment_ids is not None, kv_mask is not None
        local = functools.partial(self._local, problem, shards, zigzag, has_seg, has_mask)
        args = [q, k, v]
        in_specs = [q_spec, kv_spec, kv_spec]
        if has_seg:
            args += [q_segment_ids, kv_segment_ids]
            in_specs += [q_rows, k_rows]
        if has_mask:
            args.append(kv_mask)
            in_specs.append(k_rows)
        sharded = jax.shard_map(local, mesh=problem.mesh, in_specs=tuple(in_specs), out_specs=q_spec, check_vma=False)
        return sharded(*args)

    def _local(self, problem, shards, zigzag, has_seg, has_mask, q, k, v, *rest):
        raise NotImplementedError


def _unpack(has_seg, has_mask, rest):
    rest = list(rest)
    q_seg, k_seg = (rest.pop(0), rest.pop(0)) if has_seg else (None, None)
    k_mask = rest.pop(0) if has_mask else None
    return q_seg, k_seg, k_mask


def _split_q(q, problem):
    b, t, n, h = q.shape
    return q.reshape(b, t, problem.num_kv_heads, n // problem.num_kv_heads, h)


class RingAttention(_ContextAttention):
    """K/V blocks passed around the context axis with ppermute; float32 online softmax (module docstring)."""

    name = "context_ring"
    priority = 20

    def __init__(self, block_q: int = 2048):
        # Most queries folded in one online-softmax update (the module docstring: memory per update).
        self.block_q = block_q

    def _local(self, problem, shards, zigzag, has_seg, has_mask, q, k, v, *rest):
        q_seg, k_seg, k_mask = _unpack(has_seg, has_mask, rest)
        device = jax.lax.axis_index(CONTEXT_AXIS)
        local_len = q.shape[1]
        q5 = _split_q(q, problem)
        q_chunks = [
            (start + offset, min(self.block_q, length - offset))
            for start, length in _stored_chunks(device, local_len, shards, zigzag)
            for offset in range(0, length, self.block_q)
        ]
        bounds = np.cumsum([0] + [length for _, length in q_chunks])
        accs = [_empty_acc(q5[:, bounds[i] : bounds[i + 1]]) for i in range(len(q_chunks))]
        fold = jax.checkpoint(functools.partial(_fold_block, problem))

        def fold_held(accs, block, step):
            """`accs` with the K/V block this device holds at ring step `step` folded in."""
            source = (device - step) % shards  # The device the block started on.
            k_blk, v_blk, k_seg_blk, k_mask_blk = block
            accs = list(accs)
            for a, (q_start, q_len) in enumerate(q_chunks):
                qs = slice(bounds[a], bounds[a + 1])
                for b_start, b_len, ks in _key_chunks(source, local_len, shards, zigzag):
                    allowed = _block_mask(
                        problem,
                        q_start + jnp.arange(q_len),
                        b_start + jnp.arange(b_len),
                        None if q_seg is None else q_seg[:, qs],
                        None if k_seg_blk is None else k_seg_blk[:, ks],
                        None if k_mask_blk is None else k_mask_blk[:, ks],
                    )
                    operands = (q5[:, qs], k_blk[:, ks], v_blk[:, ks], allowed)
                    visible = _any_visible(problem, q_start, q_len, b_start, b_len)
                    if visible is None:
                        accs[a] = fold(accs[a], *operands)
                    else:  # Causal block skipping: a block the mask hides entirely costs nothing.
                        accs[a] = jax.lax.cond(visible, fold, lambda acc, *_: acc, accs[a], *operands)
            return tuple(accs)

        perm = [(j, (j + 1) % shards) for j in range(shards)]

        def ring_step(carry, step):
            accs, block = carry
            # The next block's ppermute does not depend on this step's compute, so XLA may overlap them.
            following = jax.tree.map(lambda x: jax.lax.ppermute(x, CONTEXT_AXIS, perm), block)
            return (fold_held(accs, block, step), following), None

        # N - 1 steps that pass the block on, then the last block (one loop body, whatever N).
        (accs, block), _ = jax.lax.scan(ring_step, (tuple(accs), (k, v, k_seg, k_mask)), jnp.arange(shards - 1))
        accs = fold_held(accs, block, shards - 1)
        return jnp.concatenate([_finish(acc, q.dtype) for acc in accs], axis=1)


def _key_chunks(source, local_len, shards, zigzag):
    """(first original index, length, local slice) of each contiguous run of a K/V block from `source`."""
    out, offset = [], 0
    for start, length in _stored_chunks(source, local_len, shards, zigzag):
        out.append((start, length, slice(offset, offset + length)))
        offset += length
    return out


def _any_visible(problem: AttentionProblem, q_start, q_len: int, k_start, k_len: int):
    """Traced bool: may any query of the run see any key of the run (None: always, no mask hides blocks)."""
    visible = None
    if problem.causal:
        visible = k_start <= q_start + q_len - 1
    if problem.sliding_window is not None:
        near = q_start - (k_start + k_len - 1) < problem.sliding_window
        visible = near if visible is None else visible & near
    return visible


class AllGatherAttention(_ContextAttention):
    """K and V (with segment ids and key mask) gathered over the context axis; local queries attend them all."""

    name = "context_all_gather"
    priority = 30

    def is_supported(self, problem: AttentionProblem) -> Support:
        support = _common_support(problem)
        if not support:
            return support
        limit = ALL_GATHER_MAX_KV_LEN.get(problem.platform, DEFAULT_ALL_GATHER_MAX_KV_LEN)
        if problem.kv_len > limit:
            return Support(False, f"kv_len {problem.kv_len} > {limit}, the most keys it gathers on {problem.platform}")
        return SUPPORTED

    def _local(self, problem, shards, zigzag, has_seg, has_mask, q, k, v, *rest):
        q_seg, k_seg, k_mask = _unpack(has_seg, has_mask, rest)
        device = jax.lax.axis_index(CONTEXT_AXIS)
        local_len = q.shape[1]

        def gather(x):
            return None if x is None else jax.lax.all_gather(x, CONTEXT_AXIS, axis=1, tiled=True)

        k_all, v_all, k_seg_all, k_mask_all = (gather(x) for x in (k, v, k_seg, k_mask))
        total = local_len * shards
        k_idx = jnp.asarray(zigzag_permutation(total, shards) if zigzag else np.arange(total))
        q_idx = _indices(_stored_chunks(device, local_len, shards, zigzag))
        allowed = _block_mask(problem, q_idx, k_idx, q_seg, k_seg_all, k_mask_all)
        q5 = _split_q(q, problem)
        acc = _fold_block(problem, _empty_acc(q5), q5, k_all, v_all, allowed)
        return _finish(acc, q.dtype)


CONTEXT_KERNELS = (RingAttention(), AllGatherAttention())

__all__ = [
    "ALL_GATHER_MAX_KV_LEN",
    "CONTEXT_AXIS",
    "CONTEXT_KERNELS",
    "ZIGZAG_EXTRA",
    "AllGatherAttention",
    "RingAttention",
    "context_layout",
    "current_zigzag_shards",
    "zigzag_layout",
    "zigzag_permutation",
]
