"""The TPU attention kernels (splash, pallas_tpu): their decisions, their masks, and their numerics
in Pallas interpret mode on CPU against axcore's XLA reference (output and gradients).

Interpret mode runs the real kernels (JAX's Pallas TPU ops, the forward and the backward
kernels of their custom VJPs) with the TPU lowering replaced by Pallas's interpreter:
splash through its own `interpret=True`, pallas_tpu under `force_tpu_interpret_mode(True)`.
What interpret mode cannot check is the Mosaic compilation and the speed on a TPU; the
kernels are lowered to Mosaic custom calls for a TPU target here, which checks everything
up to the TPU compiler (libtpu, absent here).
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

from axcore.kernels import (
    ATTENTION,
    AttentionProblem,
    KernelRegistry,
    Support,
    XlaAttention,
    causal_mask,
    sliding_window_mask,
)
from axcore.registry import Provenance

from axcore_tpu.flash_attention import PallasTpuAttention
from axcore_tpu.splash_attention import SplashAttention, segment_ids_with_mask, splash_mask

TPU_PACKAGE_ROOT = pathlib.Path(__file__).resolve().parents[1]
# Float32 inputs: float32 rounding only (the kernels' online softmax sums in another order, and
# splash's q is pre-scaled); observed up to 3e-6 relative to the largest value.
F32_TOL = 2e-5
# bfloat16 inputs and output, probabilities rounded to bfloat16 before the p.v matmul in another
# order than the reference, and splash's q * scale rounded to bfloat16: observed up to 7e-3.
BF16_TOL = 3e-2
SPLASH, FLASH = SplashAttention(), PallasTpuAttention()
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def tpu_problem(**fields):
    """A bfloat16 TPU problem, causal self-attention over 256 positions, 4 heads of 128, changed by `fields`."""
    base = dict(
        platform="tpu", batch=2, q_len=256, kv_len=256, num_heads=4, num_kv_heads=4, head_dim=128,
        dtype=np.dtype(jnp.bfloat16), scale=0.125, causal=True,
    )
    return AttentionProblem(**{**base, **fields})


# (fields, kernel, None if supported else a phrase the reason must contain)
DECISIONS = {
    "splash causal": ({}, SPLASH, None),
    "splash float32": ({"dtype": np.dtype(np.float32)}, SPLASH, None),
    "splash gqa": ({"num_heads": 8, "num_kv_heads": 2}, SPLASH, None),
    "splash mqa": ({"num_heads": 8, "num_kv_heads": 1}, SPLASH, None),
    "splash end-aligned causal, q_len < kv_len": ({"q_len": 128}, SPLASH, None),
    "splash window": ({"sliding_window": 100}, SPLASH, None),
    "splash non-causal window": ({"causal": False, "sliding_window": 100}, SPLASH, None),
    "splash segment ids, kv mask, softcap": (
        {"has_segment_ids": True, "has_kv_mask": True, "softcap": 50.0}, SPLASH, None,
    ),
    "splash head_dim 64 (padded)": ({"head_dim": 64}, SPLASH, None),
    "splash cpu with interpret": ({"platform": "cpu"}, SplashAttention(interpret=True), None),
    "splash cpu": ({"platform": "cpu"}, SPLASH, "platform is 'cpu'"),
    "splash gpu": ({"platform": "gpu"}, SPLASH, "platform is 'gpu'"),
    "splash float16": ({"dtype": np.dtype(np.float16)}, SPLASH, "dtype float16"),
    "splash q_len 200": ({"q_len": 200, "causal": False}, SPLASH, "multiples of 128"),
    "splash causal q_len > kv_len": ({"q_len": 512}, SPLASH, "q_len 512 > kv_len 256"),
    "splash heads not a multiple": ({"num_heads": 6, "num_kv_heads": 4}, SPLASH, "not a multiple of num_kv_heads"),
    "splash window 0": ({"sliding_window": 0}, SPLASH, "sliding_window 0"),
    "splash dropout": ({"dropout_rate": 0.1}, SPLASH, "dropout"),
    "splash alibi": ({"bias_slopes": (0.5, 0.25, 0.125, 0.0625)}, SPLASH, "ALiBi"),
    "splash bias fn": ({"bias_fn": lambda q_pos, kv_pos: 0.0}, SPLASH, "position-bias function"),
    "splash dense bias": ({"has_bias": True}, SPLASH, "dense bias"),
    "splash unknown extras": ({"extras": {"my_feature": 1}}, SPLASH, "extras ['my_feature']"),
    "pallas_tpu causal": ({}, FLASH, None),
    "pallas_tpu gqa (k, v repeated)": ({"num_heads": 8, "num_kv_heads": 2}, FLASH, None),
    "pallas_tpu segment ids, kv mask": ({"has_segment_ids": True, "has_kv_mask": True}, FLASH, None),
    "pallas_tpu window as wide as kv_len": ({"sliding_window": 256}, FLASH, None),
    "pallas_tpu causal q_len != kv_len": ({"q_len": 128}, FLASH, "top-left aligned"),
    "pallas_tpu window": ({"sliding_window": 100}, FLASH, "sliding window"),
    "pallas_tpu softcap": ({"softcap": 50.0}, FLASH, "soft-cap"),
    "pallas_tpu cpu": ({"platform": "cpu"}, FLASH, "platform is 'cpu'"),
    "pallas_tpu kv_len 130": ({"kv_len": 130, "causal": False}, FLASH, "multiples of 128"),
}


@pytest.mark.parametrize("case", DECISIONS)
def test_is_supported_decisions_and_reasons(case):
    fields, kernel, reason = DECISIONS[case]
    support = kernel.is_supported(tpu_problem(**fields))
    if reason is None:
        assert support, support.reason
    else:
        assert not support and reason in support.reason, support.reason


MESH = AbstractMesh((2, 2), ("data", "model"))
HEADS = PartitionSpec("data", None, "model", None)
SHARDINGS = {
    "batch and heads": ((HEADS,) * 3, None),
    "batch": ((PartitionSpec("data"),) * 3, None),
    "replicated": ((PartitionSpec(),) * 3, None),
    "sequence": ((PartitionSpec("data", "model"),) * 3, "sequence dim is sharded"),
    "q heads only": ((HEADS, PartitionSpec("data"), PartitionSpec("data")), "query heads are sharded"),
    "unknown": ((None, None, None), "unknown under a multi-device mesh"),
}


@pytest.mark.parametrize("case", SHARDINGS)
def test_sharding_decisions_under_a_mesh(case):
    specs, reason = SHARDINGS[case]
    for kernel in (SPLASH, FLASH):
        support = kernel.is_supported(tpu_problem(mesh=MESH, input_specs=specs))
        if reason is None:
            assert support, support.reason
        else:
            assert not support and reason in support.reason, support.reason


def test_priorities_pick_splash_then_pallas_tpu_then_the_reference():
    registry = KernelRegistry()
    for kernel in (SPLASH, FLASH):
        registry.register(ATTENTION, kernel, Provenance("test", "test"))
    assert [k.name for k in registry.candidates(ATTENTION)] == ["splash", "pallas_tpu", "xla"]
    assert registry.select(ATTENTION, tpu_problem()).name == "splash"
    assert registry.select(ATTENTION, tpu_problem(q_len=200, kv_len=200)).name == "xla"
    assert registry.select(ATTENTION, tpu_problem(platform="cpu")).name == "xla"

    class DecliningSplash(SplashAttention):
        def is_supported(self, problem):
            return Support(False, "declines everything")

    # Where splash declines, the fallback runs what it supports.
    fallback = KernelRegistry()
    for kernel in (DecliningSplash(), FLASH):
        fallback.register(ATTENTION, kernel, Provenance("test", "test"))
    assert fallback.select(ATTENTION, tpu_problem()).name == "pallas_tpu"
    assert fallback.select(ATTENTION, tpu_problem(softcap=30.0)).name == "xla"


@pytest.mark.parametrize("block", [64, 100, 0])
def test_splash_blocks_are_multiples_of_128(block):
    with pytest.raises(ValueError, match="multiples of 128"):
        SplashAttention(block_q=block)


# -- The masks: splash's against axcore's, exactly ------------------------------------------------


@pytest.mark.parametrize(
    "q_len, kv_len, causal, window",
    [(256, 256, True, None), (128, 384, True, None), (256, 256, True, 100), (128, 384, True, 7),
     (128, 384, False, 100), (256, 256, False, None), (128, 256, False, 1)],
)
def test_splash_masks_equal_axcores_end_aligned_masks(q_len, kv_len, causal, window):
    mask = splash_mask(q_len, kv_len, causal=causal, window=window)[:, :]
    expected = np.ones((q_len, kv_len), bool)
    if causal:
        expected &= np.asarray(causal_mask(q_len, kv_len))
    if window is not None:
        expected &= np.asarray(sliding_window_mask(q_len, kv_len, window))
    np.testing.assert_array_equal(mask, expected)


def test_kv_mask_folds_into_segment_ids_exactly():
    rng = np.random.default_rng(0)
    segments = jnp.asarray(rng.integers(0, 3, (2, 8)), jnp.int32)
    keep = jnp.asarray(rng.random((2, 8)) < 0.7)
    q_ids, kv_ids = segment_ids_with_mask(2, 8, 8, segments, segments, keep)
    expected = (segments[:, :, None] == segments[:, None, :]) & keep[:, None, :]
    np.testing.assert_array_equal(q_ids[:, :, None] == kv_ids[:, None, :], expected)
    q_ids, kv_ids = segment_ids_with_mask(2, 8, 8, kv_mask=keep)
    np.testing.assert_array_equal(q_ids[:, :, None] == kv_ids[:, None, :], np.broadcast_to(keep[:, None, :], (2, 8, 8)))
    assert segment_ids_with_mask(2, 8, 8) is None


def test_unexpected_inputs_are_refused():
    q = jnp.zeros((1, 128, 2, 16), jnp.float32)
    problem = AttentionProblem.of(q, q, platform="cpu")
    for kernel in (SplashAttention(interpret=True), PallasTpuAttention(interpret=True)):
        with pytest.raises(ValueError, match="q_positions"):
            kernel(problem, q, q, q, q_positions=jnp.zeros((1, 128), jnp.int32))
        with pytest.raises(ValueError, match="together"):
            kernel(problem, q, q, q, q_segment_ids=jnp.zeros((1, 128), jnp.int32))


# -- Against the reference, in interpret mode -----------------------------------------------------


def _packed(lengths):
    """Segment ids `[len(lengths), sum]` of packed sequences with the given lengths per row."""
    return jnp.asarray([np.repeat(np.arange(len(row)), row) for row in lengths], jnp.int32)


# name -> (problem flags, q_len, kv_len, num_heads, num_kv_heads, head_dim, inputs): inputs of
# "segments" (q_len == kv_len, both sides the same ids) and "kv_mask" (keys kept per row). No
# query loses every key (the reference averages all keys for such rows; see the modules).
CASES = {
    "causal": (dict(causal=True), 128, 128, 2, 2, 128, {}),
    "causal, q_len < kv_len (end-aligned), mqa": (dict(causal=True), 128, 256, 2, 1, 64, {}),
    "causal window": (dict(causal=True, sliding_window=40), 256, 256, 2, 2, 64, {}),
    "non-causal window, q_len < kv_len": (dict(sliding_window=40), 128, 256, 2, 2, 64, {}),
    "segment ids and kv mask": (
        dict(causal=True), 128, 128, 2, 2, 64, {"segments": [[50, 78], [128]], "kv_mask": [128, 100]},
    ),
    "gqa, softcap": (dict(causal=True, softcap=2.0), 128, 128, 4, 2, 64, {}),
    "gqa, kv mask": (dict(), 128, 256, 4, 2, 64, {"kv_mask": [256, 200]}),
    "everything": (
        dict(causal=True, sliding_window=50, softcap=3.0), 256, 256, 4, 2, 64,
        {"segments": [[100, 156], [256]], "kv_mask": [256, 230]},
    ),
}
SPLASH_CASES = [c for c in CASES if c not in ("gqa, kv mask", "everything")]
FLASH_CASES = ["causal", "segment ids and kv mask", "gqa, kv mask"]


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


@pytest.mark.parametrize("case", SPLASH_CASES)
def test_splash_matches_reference_float32(case):
    _check_against_reference(case, jnp.float32, F32_TOL, SplashAttention(interpret=True, block_q=128, block_kv=128))


def test_splash_matches_reference_bfloat16_with_everything():
    # Blocks of 256 rows and keys: the default blocks (512), fit to the lengths.
    _check_against_reference("everything", jnp.bfloat16, BF16_TOL, SplashAttention(interpret=True))


@pytest.mark.parametrize("case", FLASH_CASES)
def test_pallas_tpu_matches_reference_float32(case):
    _check_against_reference(case, jnp.float32, F32_TOL, PallasTpuAttention(interpret=True))


# -- Lowered for a TPU (Mosaic), without a TPU ----------------------------------------------------


@pytest.mark.parametrize("kernel", [SPLASH, FLASH], ids=["splash", "pallas_tpu"])
def test_forward_and_backward_lower_to_mosaic_for_tpu(kernel):
    q = jax.ShapeDtypeStruct((2, 512, 8, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, 512, 2, 128), jnp.bfloat16)
    rows = jax.ShapeDtypeStruct((2, 512), jnp.int32)
    problem = AttentionProblem.of(q, k, platform="tpu", causal=True, has_segment_ids=True)
    assert kernel.is_supported(problem)

    def loss(q, k, v, segments):
        out = kernel(problem, q, k, v, q_segment_ids=segments, kv_segment_ids=segments)
        return jnp.sum(out.astype(jnp.float32))

    lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, k, k, rows).lower(lowering_platforms=("tpu",))
    # Forward, dq and dkv kernels (splash's three, the fallback's three).
    assert lowered.as_text().count("tpu_custom_call") == 3


# -- Under a 4-device mesh (subprocess) -----------------------------------------------------------


@pytest.mark.slow
def test_sharded_kernels_match_reference_on_4_cpu_devices():
    """Batch/heads-sharded inputs under jax.shard_map, forward and gradients, in a 4-device subprocess."""
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS="--xla_force_host_platform_device_count=4",
        PYTHONPATH=os.pathsep.join([str(TPU_PACKAGE_ROOT), os.environ.get("PYTHONPATH", "")]),
    )
    worker = pathlib.Path(__file__).with_name("sharded_attention_worker.py")
    proc = subprocess.run([sys.executable, str(worker)], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    errors = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(errors) == {"splash", "pallas_tpu"}
    for kernel, error in errors.items():
        assert error < F32_TOL, (kernel, error)
