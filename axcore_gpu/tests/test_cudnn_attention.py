"""The cuDNN attention kernel: `is_supported` decisions, and its argument mapping against the reference.

cuDNN itself needs a GPU; on CPU the same mapping runs through
`jax.nn.dot_product_attention(implementation="xla")` (`CudnnAttention(implementation="xla")`)
and is checked against axcore's `XlaAttention`, forward and gradients. The sharded
path runs in a subprocess with 4 CPU devices. The test marked for a GPU runs the real
cuDNN path against the reference.
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

from axcore.experiment.builtins import create_plugin_manager
from axcore.kernels import ATTENTION, AttentionProblem, XlaAttention

import axcore_gpu.plugin
from axcore_gpu import CudnnAttention, cuda_compute_capability, dot_product_attention_arguments

GPU_PACKAGE_ROOT = pathlib.Path(__file__).resolve().parents[1]
HOPPER = CudnnAttention(compute_capability=(9, 0))
AMPERE = CudnnAttention(compute_capability=(8, 0))
# Float32 on CPU: the mapping itself must be exact up to float32 rounding.
F32_TOL = 1e-5
# bfloat16 inputs and output (softmax in float32 in both): a few bfloat16 ulps.
BF16_TOL = 2e-2


def gpu_problem(**fields):
    """A bfloat16 GPU problem, causal self-attention over 8 positions, 4 heads of 64, changed by `fields`."""
    base = dict(
        platform="gpu", batch=2, q_len=8, kv_len=8, num_heads=4, num_kv_heads=4, head_dim=64,
        dtype=np.dtype(jnp.bfloat16), scale=0.125, causal=True,
    )
    return AttentionProblem(**{**base, **fields})


# (fields, kernel, None if supported else a phrase the reason must contain)
DECISIONS = {
    "causal": ({}, HOPPER, None),
    "float16": ({"dtype": np.dtype(np.float16)}, HOPPER, None),
    "gqa": ({"num_heads": 8, "num_kv_heads": 2}, HOPPER, None),
    "mqa": ({"num_heads": 8, "num_kv_heads": 1}, HOPPER, None),
    "non-causal cross attention": ({"causal": False, "q_len": 4, "kv_len": 12}, HOPPER, None),
    "head_dim 128 on ampere": ({"head_dim": 128}, AMPERE, None),
    "head_dim 256 on hopper": ({"head_dim": 256}, HOPPER, None),
    "sliding window": ({"sliding_window": 3}, HOPPER, None),
    "window covering every key": ({"causal": False, "sliding_window": 8}, HOPPER, None),
    "kv mask": ({"has_kv_mask": True}, HOPPER, None),
    "cpu": ({"platform": "cpu"}, HOPPER, "platform is 'cpu'"),
    "tpu": ({"platform": "tpu"}, HOPPER, "platform is 'tpu'"),
    "float32": ({"dtype": np.dtype(np.float32)}, HOPPER, "dtype float32"),
    "turing": ({}, CudnnAttention(compute_capability=(7, 5)), "compute capability 7.5"),
    "head_dim 256 on ampere": ({"head_dim": 256}, AMPERE, "head_dim 256"),
    "head_dim 264 on hopper": ({"head_dim": 264}, HOPPER, "head_dim 264"),
    "head_dim 36": ({"head_dim": 36}, HOPPER, "multiple of 8"),
    "heads not a multiple": ({"num_heads": 6, "num_kv_heads": 4}, HOPPER, "not a multiple of num_kv_heads"),
    "causal, fewer queries": ({"q_len": 4}, HOPPER, "top-left aligned"),
    "non-causal window": ({"causal": False, "sliding_window": 3}, HOPPER, "without causal"),
    "window 0": ({"sliding_window": 0}, HOPPER, "sliding_window 0"),
    "segment ids": ({"has_segment_ids": True}, HOPPER, "segment ids"),
    "softcap": ({"softcap": 30.0}, HOPPER, "soft-cap"),
    "dropout": ({"dropout_rate": 0.1}, HOPPER, "dropout"),
    "alibi": ({"bias_slopes": (0.5, 0.25, 0.125, 0.0625)}, HOPPER, "ALiBi"),
    "bias fn": ({"bias_fn": lambda q_pos, kv_pos: 0.0}, HOPPER, "position-bias function"),
    "dense bias": ({"has_bias": True}, HOPPER, "dense bias"),
    "kv mask, odd length": ({"has_kv_mask": True, "q_len": 7, "kv_len": 7}, HOPPER, "even sequence lengths"),
    "unknown extras": ({"extras": {"my_feature": 1}}, HOPPER, "extras ['my_feature']"),
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
Q, KV = PartitionSpec("data", None, "model", None), PartitionSpec("data", None, "model", None)
# (input_specs, None if supported else a phrase the reason must contain), under a 2x2 mesh.
SHARDINGS = {
    "batch and heads": ((Q, KV, KV), None),
    "batch over both axes": ((PartitionSpec(("data", "model")),) * 3, None),
    "replicated": ((PartitionSpec(),) * 3, None),
    "sequence": ((PartitionSpec("data", "model"),) * 3, "sequence dim is sharded over mesh axis model"),
    "head_dim": ((PartitionSpec(None, None, None, "model"),) * 3, "head_dim is sharded"),
    "q heads only": ((Q, PartitionSpec("data"), PartitionSpec("data")), "query heads are sharded"),
    "k and v differ": ((Q, KV, PartitionSpec("data")), "k and v are sharded differently"),
    "batch differs": ((PartitionSpec("data"), PartitionSpec("model"), PartitionSpec("model")), "q's batch"),
    "unknown": ((None, None, None), "unknown under a multi-device mesh"),
    "missing": ((), "unknown under a multi-device mesh"),
}


@pytest.mark.parametrize("case", SHARDINGS)
def test_sharding_decisions_under_a_mesh(case):
    specs, reason = SHARDINGS[case]
    support = HOPPER.is_supported(gpu_problem(mesh=MESH, input_specs=specs))
    if reason is None:
        assert support, support.reason
    else:
        assert not support and reason in support.reason, support.reason


def test_one_device_mesh_needs_no_specs():
    assert HOPPER.is_supported(gpu_problem(mesh=AbstractMesh((1,), ("data",)), input_specs=()))


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="a GPU is present")
def test_without_a_cuda_device_it_declines_and_axcore_falls_back_to_the_next_kernel():
    assert cuda_compute_capability() is None
    support = CudnnAttention().is_supported(gpu_problem())
    assert not support and "no CUDA device" in support.reason
    kernels = create_plugin_manager(["gpu"], objects={"gpu": axcore_gpu.plugin}).registries.kernels
    # By priority (the context-parallel kernels are built in; they decline unless a context axis splits the sequence).
    assert [k.name for k in kernels.candidates(ATTENTION)] == ["cudnn", "pallas", "context_all_gather", "context_ring", "xla"]
    assert kernels.select(ATTENTION, gpu_problem()).name == "pallas"
    assert kernels.select(ATTENTION, gpu_problem(platform="cpu")).name == "xla"


def test_priority_leaves_room_below_for_a_pallas_kernel():
    assert CudnnAttention.priority == 100 and XlaAttention.priority == 0


def test_unexpected_inputs_are_refused():
    q = jnp.zeros((2, 8, 4, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="q_segment_ids"):
        HOPPER(gpu_problem(), q, q, q, q_segment_ids=jnp.zeros((2, 8), jnp.int32))


def test_mapping_table():
    q = k = jnp.zeros((2, 8, 4, 64), jnp.bfloat16)
    assert dot_product_attention_arguments(gpu_problem(), q, k) == {"scale": 0.125, "is_causal": True}
    windowed = dot_product_attention_arguments(gpu_problem(sliding_window=3), q, k)
    assert windowed["local_window_size"] == (2, 0)  # Key j visible iff i - j <= 2, i.e. i - j < 3.
    assert "local_window_size" not in dot_product_attention_arguments(gpu_problem(sliding_window=8), q, k)
    masked = dot_product_attention_arguments(gpu_problem(has_kv_mask=True), q, k, jnp.ones((2, 8), bool))
    assert masked["mask"].shape == (2, 1, 8, 8) and masked["mask"].dtype == bool


# -- The mapping against the reference (implementation="xla") -------------------------------

# name -> (problem flags, q_len, kv_len, num_heads, num_kv_heads, with kv_mask)
CASES = {
    "causal": (dict(causal=True), 8, 8, 4, 4, False),
    "non-causal": (dict(causal=False), 8, 8, 4, 4, False),
    "causal, kv mask": (dict(causal=True), 8, 8, 4, 4, True),
    "cross attention, kv mask": (dict(causal=False), 4, 8, 4, 4, True),
    "gqa, causal": (dict(causal=True), 8, 8, 8, 2, False),
    "sliding window": (dict(causal=True, sliding_window=3), 8, 8, 4, 4, False),
    "sliding window, gqa, kv mask": (dict(causal=True, sliding_window=2), 8, 8, 4, 2, True),
    "window covering every key": (dict(causal=False, sliding_window=8), 8, 8, 4, 4, False),
}


def _inputs(q_len, kv_len, num_heads, num_kv_heads, with_mask, dtype, head_dim=16, pad=3, seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(2, q_len, num_heads, head_dim)), dtype)
    k = jnp.asarray(rng.normal(size=(2, kv_len, num_kv_heads, head_dim)), dtype)
    v = jnp.asarray(rng.normal(size=(2, kv_len, num_kv_heads, head_dim)), dtype)
    cotangent = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    # Right padding in the second row, short enough that every query keeps a visible key
    # inside the windows of CASES: rows with none are undefined for cuDNN (module docstring).
    kv_mask = jnp.arange(kv_len)[None, :] < jnp.asarray([[kv_len], [kv_len - pad]]) if with_mask else None
    return q, k, v, cotangent, kv_mask


def _value_and_grads(kernel, problem, q, k, v, cotangent, kv_mask):
    inputs = {} if kv_mask is None else {"kv_mask": kv_mask}

    def loss(q, k, v):
        out = kernel(problem, q, k, v, **inputs)
        return jnp.sum(out.astype(jnp.float32) * cotangent), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return [np.asarray(x, np.float32) for x in (out, *grads)]


def _check_against_reference(kernel, case, dtype, tol, head_dim=16, must_support=False):
    flags, q_len, kv_len, num_heads, num_kv_heads, with_mask = CASES[case]
    pad = 1 if flags.get("sliding_window") else 3
    q, k, v, cotangent, kv_mask = _inputs(q_len, kv_len, num_heads, num_kv_heads, with_mask, dtype, head_dim, pad)
    problem = AttentionProblem.of(q, k, platform=jax.default_backend(), scale=0.3, has_kv_mask=with_mask, **flags)
    assert XlaAttention().is_supported(problem)
    if must_support:
        assert kernel.is_supported(problem), kernel.is_supported(problem).reason
    expected = _value_and_grads(XlaAttention(), problem, q, k, v, cotangent, kv_mask)
    actual = _value_and_grads(kernel, problem, q, k, v, cotangent, kv_mask)
    for name, want, got in zip(("output", "dq", "dk", "dv"), expected, actual):
        scale = max(1.0, float(np.abs(want).max()))
        np.testing.assert_allclose(got, want, atol=tol * scale, rtol=tol, err_msg=f"{case}: {name}")


@pytest.mark.parametrize("case", CASES)
def test_mapping_matches_reference_float32(case):
    _check_against_reference(CudnnAttention(implementation="xla"), case, jnp.float32, F32_TOL)


@pytest.mark.parametrize("case", ["causal, kv mask", "sliding window, gqa, kv mask"])
def test_mapping_matches_reference_bfloat16(case):
    _check_against_reference(CudnnAttention(implementation="xla"), case, jnp.bfloat16, BF16_TOL)


@pytest.mark.slow
def test_sharded_mapping_matches_reference_on_4_cpu_devices():
    """batch/heads-sharded inputs under jax.shard_map, forward and gradients, in a 4-device subprocess."""
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS="--xla_force_host_platform_device_count=4",
        PYTHONPATH=os.pathsep.join([str(GPU_PACKAGE_ROOT), os.environ.get("PYTHONPATH", "")]),
    )
    worker = pathlib.Path(__file__).with_name("sharded_attention_worker.py")
    proc = subprocess.run([sys.executable, str(worker)], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    errors = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(errors) == {"batch", "batch+heads", "batch over both axes", "batch, kv mask"}
    for case, error in errors.items():
        assert error < F32_TOL, (case, error)


# -- The real cuDNN path (a GPU) -------------------------------------------------------------


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN attention needs a CUDA GPU")
@pytest.mark.parametrize("case", CASES)
def test_cudnn_matches_reference_on_gpu(case):
    _check_against_reference(CudnnAttention(), case, jnp.bfloat16, BF16_TOL, head_dim=64, must_support=True)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN attention needs a CUDA GPU")
def test_registry_selects_cudnn_on_gpu():
    kernels = create_plugin_manager(["gpu"], objects={"gpu": axcore_gpu.plugin}).registries.kernels
    q = jnp.zeros((2, 128, 8, 64), jnp.bfloat16)
    assert kernels.select(ATTENTION, AttentionProblem.of(q, q, causal=True)).name == "cudnn"
    # cuDNN declines float32; the compiled Pallas kernel (priority 90, IEEE float32 dots) takes it before XLA.
    assert kernels.select(ATTENTION, AttentionProblem.of(q.astype(jnp.float32), q, causal=True)).name == "pallas"
