"""The Pallas paged decode kernel: against the XLA reference in interpret mode, its decisions, its Triton lowering.

The reference (`axcore.kernels.XlaPagedAttention`) gathers each row's blocks and masks by
position in jax.numpy; the kernel reads the blocks in place with an online softmax.
Block tables are shuffled (a row's blocks are anywhere in the cache) and lengths end
mid-block, on a block's last slot and on its first.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axcore.experiment.builtins import create_plugin_manager
from axcore.kernels import PagedAttentionProblem, XlaPagedAttention

import axcore_gpu.plugin
from axcore_gpu.pallas_paged_attention import PallasPagedDecode

# Float32: float32 rounding only (observed ~2e-7). bfloat16 inputs and output: a few bfloat16 ulps.
F32_TOL = 1e-5
BF16_TOL = 3e-2
BLOCK = 16


def _inputs(rng, lengths, heads, kv_heads, head_dim, dtype, num_blocks=12, max_blocks=4):
    """q, cache, shuffled block tables and positions for rows of `lengths` tokens (the new one included)."""
    batch = len(lengths)
    q = jnp.asarray(rng.normal(size=(batch, 1, heads, head_dim)), dtype)
    key = jnp.asarray(rng.normal(size=(num_blocks, BLOCK, kv_heads, head_dim)), dtype)
    value = jnp.asarray(rng.normal(size=(num_blocks, BLOCK, kv_heads, head_dim)), dtype)
    tables = np.zeros((batch, max_blocks), np.int32)
    free = list(rng.permutation(np.arange(1, num_blocks)))  # Block 0 is the null block.
    for b, length in enumerate(lengths):
        for i in range(-(-length // BLOCK)):
            tables[b, i] = free.pop()
    positions = np.asarray(lengths, np.int32)[:, None] - 1
    return q, key, value, jnp.asarray(tables), jnp.asarray(positions), jnp.ones((batch,), jnp.int32)


# name -> (lengths, heads, kv_heads, head_dim, dtype, problem flags, splits)
CASES = {
    "gqa float32, window and soft-cap, 3 splits": ([5, 16, 17, 64], 4, 2, 16, jnp.float32,
                                                   dict(sliding_window=20, softcap=5.0), 3),
    "mha float32, one split": ([1, 33, 48], 2, 2, 32, jnp.float32, {}, 1),
    "mqa bfloat16, automatic splits": ([40, 7], 8, 1, 16, jnp.bfloat16, {}, None),
}


@pytest.mark.parametrize("case", CASES)
def test_decode_matches_the_reference(case):
    lengths, heads, kv_heads, head_dim, dtype, flags, splits = CASES[case]
    args = _inputs(np.random.default_rng(0), lengths, heads, kv_heads, head_dim, dtype)
    problem = PagedAttentionProblem.of(args[0], args[1], args[3], platform="cpu", **flags)
    kernel = PallasPagedDecode(interpret=True, splits=splits)
    assert kernel.is_supported(problem)
    want = np.asarray(XlaPagedAttention()(problem, *args), np.float32)
    got = np.asarray(kernel(problem, *args), np.float32)
    assert got.shape == want.shape == (len(lengths), 1, heads, head_dim)
    tol = F32_TOL if dtype == jnp.float32 else BF16_TOL
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol)


def _problem(**fields):
    base = dict(platform="gpu", batch=4, q_len=1, num_heads=8, num_kv_heads=2, head_dim=64, num_blocks=100,
                block_size=16, max_blocks=8, dtype=np.dtype(jnp.bfloat16), scale=0.125)
    return PagedAttentionProblem(**{**base, **fields})


# (fields, None if supported else a phrase the reason must contain)
DECISIONS = {
    "decode, gqa, bfloat16": ({}, None),
    "window and soft-cap": ({"sliding_window": 64, "softcap": 30.0}, None),
    "float32, head_dim 256, block 32": ({"dtype": np.dtype(np.float32), "head_dim": 256, "block_size": 32}, None),
    "a prefill chunk": ({"q_len": 7}, "7 new tokens per row"),
    "cpu without interpret": ({"platform": "cpu"}, "platform is 'cpu'"),
    "head_dim 80": ({"head_dim": 80}, "head_dim 80"),
    "block_size 8": ({"block_size": 8}, "block_size 8"),
    "alibi": ({"bias_slopes": (0.5,) * 8}, "position biases"),
    "float64": ({"dtype": np.dtype(np.float64)}, "dtype float64"),
}


@pytest.mark.parametrize("case", DECISIONS)
def test_decisions_name_their_reason(case):
    fields, phrase = DECISIONS[case]
    support = PallasPagedDecode().is_supported(_problem(**fields))
    if phrase is None:
        assert support, support.reason
    else:
        assert not support and phrase in support.reason, support.reason


def test_lowers_to_one_triton_call_for_cuda():
    q = jax.ShapeDtypeStruct((8, 1, 32, 64), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((1000, 16, 8, 64), jnp.bfloat16)
    tables = jax.ShapeDtypeStruct((8, 100), jnp.int32)
    rows = jax.ShapeDtypeStruct((8, 1), jnp.int32)
    problem = PagedAttentionProblem.of(q, cache, tables, platform="gpu", sliding_window=512, softcap=30.0)
    kernel = PallasPagedDecode()
    assert kernel.is_supported(problem)
    lowered = jax.jit(lambda *a: kernel(problem, *a)).trace(
        q, cache, cache, tables, rows, jax.ShapeDtypeStruct((8,), jnp.int32)).lower(lowering_platforms=("cuda",))
    assert lowered.as_text().count("__gpu$xla.gpu.triton") == 1


def test_plugin_registers_it_below_the_reference_until_timed():
    kernels = create_plugin_manager(["gpu"], objects={"gpu": axcore_gpu.plugin}).registries.kernels
    # Core's CPU decode kernel (priority 10, CPU only) first, then the reference, then this one.
    assert [kernel.name for kernel in kernels.candidates("paged_attention")] == ["xla_cpu_decode", "xla", "pallas_decode"]
    assert kernels.select("paged_attention", _problem()).name == "xla"
    with pytest.raises(ValueError, match="splits 0"):
        PallasPagedDecode(splits=0)
