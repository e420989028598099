"""`cpu_paged_decode`: the `paged_attention` op's kernel for the engine's decode steps on the CPU, in C++.

XLA has no way to read a row's KV blocks where they lie: the XLA kernels (`xla`,
`xla_cpu_decode`) first gather every row's padded block table into a new array (the
cost grows with the table's width, not with the tokens there), then multiply. This one,
an XLA FFI call into axcore-cpu's library, reads each row's keys and values in place
through its block table, only the slots its new token may see, with the softmax in
float32, split over (row, kv head) on XLA's own threads.

Decode steps only (one new token per row), float32, GQA/MQA, sliding window and soft-cap;
it declines position biases (ALiBi, `bias_fn`), other dtypes and platforms, meshes of more
than one device, and unknown extras, in one line each, and the XLA kernels take those.
"""

from __future__ import annotations

import jax
import numpy as np

from axcore.kernels import PagedAttentionProblem, Support, unknown_extras

from axcore_cpu import native


class CpuPagedDecode:
    """Paged attention of one new token per row, reading blocks in place (module docstring).

    q `[batch, 1, heads, head_dim]`, the cache `[num_blocks, block_size, kv_heads, head_dim]`,
    block tables `[batch, max_blocks]`, positions `[batch, 1]` -> `[batch, 1, heads, head_dim]`.
    """

    name = "cpu_paged_decode"
    # Above axcore's `xla_cpu_decode` (10): on the CPU, the decode steps it supports run here.
    priority = 20
    # Reads each row's blocks through its table up to its position: a wide table costs nothing (the
    # engine then runs its steps ragged, `axcore.kernels.paged_attention`).
    reads_blocks_in_place = True

    def is_supported(self, problem: PagedAttentionProblem) -> Support:
        if (unsupported := native.ffi_call_unsupported(problem)) is not None:
            return unsupported
        if problem.q_len != 1:
            return Support(False, f"decode steps only (one new token per row), not q_len {problem.q_len}")
        if np.dtype(problem.dtype) != np.dtype(np.float32):
            return Support(False, f"float32 only, not {np.dtype(problem.dtype).name}")
        if problem.num_heads % problem.num_kv_heads:
            return Support(False, "num_heads must be a multiple of num_kv_heads")
        if problem.bias_slopes is not None or problem.bias_fn is not None:
            return Support(False, "no position biases (ALiBi slopes, bias_fn)")
        return unknown_extras(problem)

    def __call__(self, problem: PagedAttentionProblem, q, key, value, block_tables, positions, num_new):
        del num_new  # Padding rows attend at their (ignored) positions: finite garbage, as the reference.
        native.load()
        batch, _, heads, head_dim = q.shape
        call = jax.ffi.ffi_call(native.PAGED_DECODE_TARGET, jax.ShapeDtypeStruct((batch, heads, head_dim), q.dtype),
                                vmap_method="sequential")  # Under vmap: one call per batch element.
        out = call(
            q[:, 0], key, value, block_tables.astype(np.int32), positions[:, 0].astype(np.int32),
            scale=np.float32(problem.scale),
            softcap=np.float32(problem.softcap or 0.0),
            window=np.int64(problem.sliding_window or 0),
        )
        return out[:, None]
