"""The Pallas flash-attention kernel: against the reference in interpret mode, its decisions, its GPU lowering.

The kernels run in Pallas interpret mode on CPU (`PallasAttention(interpret=True)`)
and are checked against axcore's `XlaAttention` (an independent jax.numpy
implementation), output and the gradients of q, k and v. Without a GPU, the Triton
path is checked by lowering it for CUDA (Pallas -> Triton IR, which rejects e.g.
non-power-of-two tiles). The sharded path runs in a subprocess with 4 CPU devices.
"""

import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, PartitionSpec

from axcore.kernels import ATTENTION, AttentionProblem, KernelRegistry, XlaAttention
from axcore.registry import Provenance

from axcore_gpu.cudnn_attention import CudnnAttention
from axcore_gpu.pallas_attention import PallasAttention

GPU_PACKAGE_ROOT = pathlib.Path(__file__).resolve().parents[1]
# Float32 inputs (float32 softmax and matmuls in both): float32 rounding only; observed ~5e-7.
F32_TOL = 1e-5
# bfloat16 inputs and output; probabilities and dS rounded to bfloat16 before the matmuls
# in a different order than the reference: a few bfloat16 ulps; observed up to ~1e-2.
BF16_TOL = 3e-2
KERNEL = PallasAttention()
# Interpret mode's grid loops make compiling, not running, the cost of each case: halve it.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def gpu_problem(**fields):
    """A bfloat16 GPU problem, causal self-attention over 128 positions, 4 heads of 64, changed by `fields`."""
    base = dict(
        platform="gpu", batch=2, q_len=128, kv_len=128, num_heads=4, num_kv_heads=4, head_dim=64,
        dtype=np.dtype(jnp.bfloat16), scale=0.125, causal=True,
    )
    return AttentionProblem(**{**base, **fields})


# (fields, kernel, None if supported else a phrase the reason must contain)
DECISIONS = {
    "causal": ({}, KERNEL, None),
    "float16": ({"dtype": np.dtype(np.float16)}, KERNEL, None),
    "float32": ({"dtype": np.dtype(np.float32)}, KERNEL, None),
    "gqa": ({"num_heads": 8, "num_kv_heads": 2}, KERNEL, None),
    "mqa": ({"num_heads": 8, "num_kv_heads": 1}, KERNEL, None),
    "causal, fewer queries (end-aligned)": ({"q_len": 100}, KERNEL, None),
    "odd lengths (padded)": ({"q_len": 77, "kv_len": 131}, KERNEL, None),
    "head_dim 80 (padded to 128)": ({"head_dim": 80}, KERNEL, None),
    "head_dim 256": ({"head_dim": 256}, KERNEL, None),
    "head_dim 8 (padded to 16)": ({"head_dim": 8}, KERNEL, None),
    "sliding window": ({"sliding_window": 32}, KERNEL, None),
    "non-causal window": ({"causal": False, "sliding_window": 32}, KERNEL, None),
    "segment ids": ({"has_segment_ids": True}, KERNEL, None),
    "softcap": ({"softcap": 30.0}, KERNEL, None),
    "kv mask": ({"has_kv_mask": True}, KERNEL, None),
    "cpu with interpret": ({"platform": "cpu"}, PallasAttention(interpret=True), None),
    "cpu": ({"platform": "cpu"}, KERNEL, "platform is 'cpu'"),
    "tpu": ({"platform": "tpu"}, KERNEL, "platform is 'tpu'"),
    "float64": ({"dtype": np.dtype(np.float64)}, KERNEL, "dtype float64"),
    "int8": ({"dtype": np.dtype(np.int8)}, KERNEL, "dtype int8"),
    "head_dim 512": ({"head_dim": 512}, KERNEL, "head_dim 512"),
    "empty": ({"q_len": 0}, KERNEL, "empty sequence"),
    "heads not a multiple": ({"num_heads": 6, "num_kv_heads": 4}, KERNEL, "not a multiple of num_kv_heads"),
    "window 0": ({"sliding_window": 0}, KERNEL, "sliding_window 0"),
    "dropout": ({"dropout_rate": 0.1}, KERNEL, "dropout"),
    "alibi": ({"bias_slopes": (0.5, 0.25, 0.125, 0.0625)}, KERNEL, "ALiBi"),
    "bias fn": ({"bias_fn": lambda q_pos, kv_pos: 0.0}, KERNEL, "position-bias function"),
    "dense bias": ({"has_bias": True}, KERNEL, "dense bias"),
    "unknown extras": ({"extras": {"my_feature": 1}}, KERNEL, "extras ['my_feature']"),
}


@pytest.mark.parametrize("case", DECISIONS)
def test_is_supported_decisions_and_reasons(case):
    fields, kernel, reason = DECISIONS[case]
    support = kernel.is_supported(gpu_problem(**fields))
    if reason is None:
        assert support, support.reason
    else:
        assert not support and reason in support.reason, support.reason


MESH = AbstractMesh((2, 2), ("data", "model"))
HEADS = PartitionSpec("data", None, "model", None)
# (input_specs, None if supported else a phrase the reason must contain), under a 2x2 mesh.
SHARDINGS = {
    "batch and heads": ((HEADS,) * 3, None),
    "batch": ((PartitionSpec("data"),) * 3, None),
    "replicated": ((PartitionSpec(),) * 3, None),
    "sequence": ((PartitionSpec("data", "model"),) * 3, "sequence dim is sharded over mesh axis model"),
    "q heads only": ((HEADS, PartitionSpec("data"), PartitionSpec("data")), "query heads are sharded"),
    "unknown": ((None, None, None), "unknown under a multi-device mesh"),
}


@pytest.mark.parametrize("case", SHARDINGS)
def test_sharding_decisions_under_a_mesh(case):
    specs, reason = SHARDINGS[case]
    support = KERNEL.is_supported(gpu_problem(mesh=MESH, input_specs=specs))
    if reason is None:
        assert support, support.reason
    else:
        assert not support and reason in support.reason, support.reason


@pytest.mark.parametrize("block", [8, 48, 0])
def test_block_sizes_must_be_powers_of_two_of_at_least_16(block):
    with pytest.raises(ValueError, match="powers of two"):
        PallasAttention(block_k=block)


def test_priority_between_cudnn_and_xla_picks_pallas_where_cudnn_declines():
    assert CudnnAttention.priority > PallasAttention.priority > XlaAttention.priority
    assert (PallasAttention.name, PallasAttention.priority) == ("pallas", 90)
    registry = KernelRegistry()
    for kernel in (CudnnAttention(compute_capability=(9, 0)), PallasAttention()):
        registry.register(ATTENTION, kernel, Provenance("test", "test"))
    assert [k.name for k in registry.candidates(ATTENTION)] == ["cudnn", "pallas", "xla"]
    assert registry.select(ATTENTION, gpu_problem()).name == "cudnn"
    for fields in ({"has_segment_ids": True}, {"softcap": 30.0}, {"dtype": np.dtype(np.float32)}, {"q_len": 100}):
        assert not CudnnAttention(compute_capability=(9, 0)).is_supported(gpu_problem(**fields))
        assert registry.select(ATTENTION, gpu_problem(**fields)).name == "pallas", fields
    assert registry.select(ATTENTION, gpu_problem(dropout_rate=0.1)).name == "xla"
    assert registry.select(ATTENTION, gpu_problem(platform="cpu")).name == "xla"


def test_unexpected_inputs_are_refused():
    q = jnp.zeros((1, 16, 2, 16), jnp.float32)
    problem = AttentionProblem.of(q, q, platform="cpu")
    kernel = PallasAttention(interpret=True)
    with pytest.raises(ValueError, match="q_positions"):
        kernel(problem, q, q, q, q_positions=jnp.zeros((1, 16), jnp.int32))
    with pytest.raises(ValueError, match="together"):
        kernel(problem, q, q, q, q_segment_ids=jnp.zeros((1, 16), jnp.int32))


# -- Against the reference, in interpret mode --------------------------------------------------


def _packed(lengths):
    """Segment ids `[len(lengths), sum]` of packed sequences with the given lengths per row."""
    return jnp.asarray([np.repeat(np.arange(len(row)), row) for row in lengths], jnp.int32)


# name -> (problem flags, q_len, kv_len, num_heads, num_kv_heads, head_dim, inputs), inputs of
# "segments" (q_len == kv_len: both sides use the same ids) and "kv_mask" (True = key kept).
# No query loses every key (the reference averages all keys for such rows; see the module).
CASES = {
    "plain": (dict(), 64, 64, 2, 2, 32, {}),
    "causal": (dict(causal=True), 64, 64, 2, 2, 16, {}),
    "causal, q_len < kv_len": (dict(causal=True), 40, 72, 2, 2, 16, {}),
    "sliding window": (dict(causal=True, sliding_window=10), 64, 64, 2, 2, 16, {}),
    "segment ids": (dict(causal=True), 64, 64, 2, 2, 16, {"segments": [[20, 30, 14], [7, 57]]}),
    # Non-causal: the segments alone bound the key blocks on both sides (blocks skipped before and after).
    "segment ids, non-causal": (dict(), 64, 64, 2, 2, 16, {"segments": [[9, 40, 15], [33, 31]]}),
    "gqa": (dict(causal=True), 32, 32, 8, 2, 16, {}),
    "softcap": (dict(softcap=2.0), 32, 48, 4, 4, 16, {}),
    "kv mask, non-causal window": (dict(sliding_window=12), 24, 48, 2, 2, 16, {"kv_mask": [48, 41]}),
    "combined": (
        dict(causal=True, sliding_window=13, softcap=3.0), 52, 52, 4, 2, 24,
        {"segments": [[20, 19, 13], [52]], "kv_mask": [52, 47]},
    ),
}


def _inputs(case, dtype, seed=0):
    flags, q_len, kv_len, heads, kv_heads, head_dim, extra = CASES[case]
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(2, q_len, heads, head_dim)), dtype)
    k = jnp.asarray(rng.normal(size=(2, kv_len, kv_heads, head_dim)), dtype)
    v = jnp.asarray(rng.normal(size=(2, kv_len, kv_heads, head_dim)), dtype)
    cotangent = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    inputs = {}
    if "segments" in extra:
        inputs["q_segment_ids"] = inputs["kv_segment_ids"] = _packed(extra["segments"])
    if "kv_mask" in extra:
        inputs["kv_mask"] = jnp.arange(kv_len)[None, :] < jnp.asarray(extra["kv_mask"])[:, None]
    problem = AttentionProblem.of(
        q, k, platform="cpu", scale=0.3, has_segment_ids="segments" in extra, has_kv_mask="kv_mask" in extra, **flags
    )
    return problem, (q, k, v), cotangent, inputs


def _value_and_grads(kernel, problem, arrays, cotangent, inputs):
    def loss(q, k, v):
        out = kernel(problem, q, k, v, **inputs)
        return jnp.sum(out.astype(jnp.float32) * cotangent), out

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True), compiler_options=FAST_COMPILE)
    (_, out), grads = step(*arrays)
    assert out.dtype == arrays[0].dtype and all(g.dtype == a.dtype for g, a in zip(grads, arrays))
    return [np.asarray(x, np.float32) for x in (out, *grads)]


def _check_against_reference(case, dtype, tol, kernel):
    problem, arrays, cotangent, inputs = _inputs(case, dtype)
    assert kernel.is_supported(problem), kernel.is_supported(problem).reason
    expected = _value_and_grads(XlaAttention(), problem, arrays, cotangent, inputs)
    actual = _value_and_grads(kernel, problem, arrays, cotangent, inputs)
    for name, want, got in zip(("output", "dq", "dk", "dv"), expected, actual):
        scale = max(1.0, float(np.abs(want).max()))
        np.testing.assert_allclose(got, want, atol=tol * scale, rtol=tol, err_msg=f"{case}: {name}")


@pytest.mark.parametrize("case", CASES)
def test_matches_reference_float32(case):
    # Uneven blocks: 32 query rows by 16 keys forward, 16 by 32 backward.
    kernel = PallasAttention(interpret=True, block_q=32, block_k=16, block_q_backward=16, block_k_backward=32)
    _check_against_reference(case, jnp.float32, F32_TOL, kernel)


@pytest.mark.parametrize("case", ["gqa", "combined"])
def test_matches_reference_bfloat16(case):
    _check_against_reference(case, jnp.bfloat16, BF16_TOL, PallasAttention(interpret=True, block_q=16, block_k=16))


def test_rows_without_a_visible_key_output_zero():
    """Causal with q_len > kv_len: the first q_len - kv_len queries see no key (module docstring)."""
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.normal(size=(2, 40, 2, 16)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(2, 24, 2, 16)), jnp.float32) for _ in range(2))
    problem = AttentionProblem.of(q, k, platform="cpu", causal=True)
    empty = 40 - 24
    # Zero cotangent on the empty rows: the reference's gradients then match (its average of v
    # for those rows is the only difference).
    cotangent = jnp.asarray(rng.normal(size=q.shape), jnp.float32).at[:, :empty].set(0.0)
    kernel = PallasAttention(interpret=True, block_q=16, block_k=16)
    actual = _value_and_grads(kernel, problem, (q, k, v), cotangent, {})
    expected = _value_and_grads(XlaAttention(), problem, (q, k, v), cotangent, {})
    assert np.all(actual[0][:, :empty] == 0.0) and np.all(np.isfinite(actual[1]))
    np.testing.assert_allclose(actual[0][:, empty:], expected[0][:, empty:], atol=F32_TOL, rtol=F32_TOL)
    for name, want, got in zip(("dq", "dk", "dv"), expected[1:], actual[1:]):
        np.testing.assert_allclose(got, want, atol=F32_TOL, rtol=F32_TOL, err_msg=name)


# -- The Triton path, lowered for CUDA without a GPU ---------------------------------------------

# name -> (problem flags, head_dim, num_heads, num_kv_heads, dtype, with segment ids and kv_mask)
LOWERINGS = {
    "causal gqa, head_dim 64": (dict(causal=True), 64, 8, 2, jnp.bfloat16, False),
    "everything, head_dim 128": (dict(causal=True, sliding_window=100, softcap=30.0), 128, 8, 2, jnp.bfloat16, True),
    "float32, head_dim 80, group 3": (dict(), 80, 6, 2, jnp.float32, True),
}


@pytest.mark.parametrize("case", LOWERINGS)
def test_forward_and_backward_lower_to_triton_for_cuda(case):
    flags, head_dim, heads, kv_heads, dtype, with_extra = LOWERINGS[case]
    q = jax.ShapeDtypeStruct((2, 256, heads, head_dim), dtype)
    k = jax.ShapeDtypeStruct((2, 256, kv_heads, head_dim), dtype)
    rows = jax.ShapeDtypeStruct((2, 256), jnp.int32)
    problem = AttentionProblem.of(q, k, platform="gpu", has_segment_ids=with_extra, has_kv_mask=with_extra, **flags)
    kernel = PallasAttention(block_q=128, block_k=64, block_q_backward=64, block_k_backward=64)
    assert kernel.is_supported(problem)

    def loss(q, k, v, *extra):
        inputs = dict(q_segment_ids=extra[0], kv_segment_ids=extra[0], kv_mask=extra[1] != 0) if extra else {}
        return jnp.sum(kernel(problem, q, k, v, **inputs).astype(jnp.float32))

    args = (q, k, k) + ((rows, rows) if with_extra else ())
    lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(*args).lower(lowering_platforms=("cuda",))
    # Forward, dq (+ delta), dk/dv.
    assert lowered.as_text().count("__gpu$xla.gpu.triton") == 3


# -- Under a 4-device mesh (subprocess) ----------------------------------------------------------


@pytest.mark.slow
def test_sharded_kernel_matches_reference_on_4_cpu_devices():
    """Batch/heads-sharded inputs under jax.shard_map, forward and gradients, in a 4-device subprocess."""
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        # Lowering the compiled kernel for CUDA under a mesh of CPU devices works where no GPU is present;
        # with one present, JAX 0.11.2's Triton lowering looks for the mesh's GPU and refuses (seen on an H200).
        AXCORE_TEST_CUDA_LOWERING="0" if jax.default_backend() == "gpu" else "1",
        XLA_FLAGS="--xla_force_host_platform_device_count=4",
        PYTHONPATH=os.pathsep.join([str(GPU_PACKAGE_ROOT), os.environ.get("PYTHONPATH", "")]),
    )
    worker = pathlib.Path(__file__).with_name("pallas_sharded_worker.py")
    proc = subprocess.run([sys.executable, str(worker)], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(result["errors"]) == {"batch", "batch+heads, segments, kv mask"}
    for case, error in result["errors"].items():
        assert error < F32_TOL, (case, error)
    assert result["triton_calls"] == (3 if env["AXCORE_TEST_CUDA_LOWERING"] == "1" else None)
