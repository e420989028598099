"""axcore-cpu's `openblas` dot kernel against NumPy, when it serves, and in the engine's programs."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axcore.kernels import dot_problem, forward_only_programs, record_kernel_choices

from axcore_cpu import OpenBlasDot, openblas_dot
from axcore_cpu.openblas_dot import sgemm, xla_dot_is_faster


@pytest.fixture(autouse=True)
def serving_here(monkeypatch):
    """The kernel as it serves on a CPU without AVX-512 (on one with, it declines every problem: tested below)."""
    monkeypatch.setattr(openblas_dot, "xla_dot_is_faster", lambda: False)


def run(x, w, contract):
    problem = dot_problem(x, w, contract, compute_dtype=np.float32, platform="cpu")
    kernel = OpenBlasDot()
    with forward_only_programs():
        assert kernel.is_supported(problem), kernel.is_supported(problem).reason
        return np.asarray(jax.jit(lambda a, b: kernel(problem, a, b))(jnp.asarray(x), jnp.asarray(w)))


@pytest.mark.parametrize(
    ("x_shape", "w_shape", "contract", "numpy_dot"),
    [
        ((5, 7), (7, 3), (0,), lambda x, w: x @ w),  # A Linear.
        ((2, 3, 8), (8, 4, 6), (0,), lambda x, w: np.einsum("abi,ijk->abjk", x, w)),  # q projection [dim, heads, hd].
        ((4, 2, 3), (2, 3, 5), (0, 1), lambda x, w: np.einsum("bhd,hdo->bo", x, w)),  # Output projection.
        ((3, 6), (11, 6), (1,), lambda x, w: x @ w.T),  # A tied output head [vocab, dim].
        ((1, 9), (9, 4), (0,), lambda x, w: x @ w),  # One row: XLA's matrix-vector product.
        ((0, 9), (9, 4), (0,), lambda x, w: x @ w),  # No rows.
    ],
)
def test_matches_numpy(x_shape, w_shape, contract, numpy_dot):
    rng = np.random.default_rng(len(x_shape) + len(w_shape))
    x, w = rng.standard_normal(x_shape).astype(np.float32), rng.standard_normal(w_shape).astype(np.float32)
    want = numpy_dot(x.astype(np.float64), w.astype(np.float64))
    np.testing.assert_allclose(run(x, w, contract), want, rtol=1e-5, atol=1e-5)


def test_sgemm_splits_wide_products_over_threads_exactly():
    """A product wide enough to be cut into column parts (run on XLA's threads) equals NumPy's everywhere."""
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((33, 70)).astype(np.float32), rng.standard_normal((70, 1000)).astype(np.float32)
    got = np.asarray(jax.jit(lambda a, b: sgemm(a, b, trans_w=False))(x, w))
    np.testing.assert_allclose(got, x.astype(np.float64) @ w.astype(np.float64), rtol=1e-5, atol=1e-4)
    got_t = np.asarray(jax.jit(lambda a, b: sgemm(a, b, trans_w=True))(x, w.T.copy()))
    np.testing.assert_array_equal(got_t.shape, (33, 1000))
    np.testing.assert_allclose(got_t, got, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [2, 3, 7, 8, 9, 16, 17])
def test_products_of_few_and_many_rows_agree_with_numpy(rows):
    """A decode step's few rows and more, both layouts, 1000 columns cut into parts over threads, a contraction
    of 75: within float32 rounding of NumPy's float64."""
    rng = np.random.default_rng(rows)
    x, w = rng.standard_normal((rows, 75)).astype(np.float32), rng.standard_normal((75, 1000)).astype(np.float32)
    want = x.astype(np.float64) @ w.astype(np.float64)
    got = np.asarray(jax.jit(lambda a, b: sgemm(a, b, trans_w=False))(x, w))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    got_t = np.asarray(jax.jit(lambda a, b: sgemm(a, b, trans_w=True))(x, w.T.copy()))
    np.testing.assert_allclose(got_t, want, rtol=1e-5, atol=1e-4)


def test_serves_only_forward_only_float32_cpu_programs():
    x, w = jnp.zeros((4, 8)), jnp.zeros((8, 3))
    base = dot_problem(x, w, (0,), compute_dtype=np.float32, platform="cpu")
    kernel = OpenBlasDot()
    assert not kernel.is_supported(base), "outside forward_only_programs it must decline (no backward pass)"
    with forward_only_programs():
        assert kernel.is_supported(base)
        declines = {
            "platform": dataclasses.replace(base, platform="gpu"),
            "bf16 compute": dataclasses.replace(base, compute_dtype=np.dtype(jnp.bfloat16)),
            "int8 weights": dataclasses.replace(base, w_dtype=np.dtype(np.int8)),
            "middle contract": dataclasses.replace(base, w_shape=(3, 8, 5), contract=(1,)),
            "extras": dataclasses.replace(base, extras={"lora": 1}),
        }
        for what, problem in declines.items():
            assert not kernel.is_supported(problem), what


def test_declines_everything_on_a_cpu_with_avx512(monkeypatch):
    x, w = jnp.zeros((4, 8)), jnp.zeros((8, 3))
    problem = dot_problem(x, w, (0,), compute_dtype=np.float32, platform="cpu")
    monkeypatch.setattr(openblas_dot, "xla_dot_is_faster", lambda: True)
    with forward_only_programs():
        support = OpenBlasDot().is_supported(problem)
    assert not support and "AVX-512" in support.reason


def test_reads_avx512_from_the_cpu_s_flags():
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        flags = next((line for line in f if line.startswith("flags")), "").split()  # No such line off x86.
    assert xla_dot_is_faster() == ("avx512f" in flags)  # The real function (the fixture patches the module's name).


def test_the_engine_s_programs_use_both_kernels_and_agree_with_the_reference_kernels():
    """A tiny model's engine with axcore-cpu's kernels (the default here) gives the greedy tokens and, within
    float32 rounding, the log-probabilities of an engine forced onto the XLA reference kernels."""
    from axcore.engine import Engine, EngineConfig
    from axcore.engine.requests import GenerationRequest, SamplingParams
    from axcore.experiment import load_experiment
    from axcore.testing import TINY_OVERRIDES

    exp = load_experiment(None, [*TINY_OVERRIDES, "model.compute_dtype=float32"])
    model = exp.config.model.instantiate(name="model", registries=exp.registries)
    params = model.initialize(jax.random.key(0))
    prompts = [[5, 9, 2, 7, 1, 3, 8], [4, 4, 6], [11, 2, 9, 9, 1, 5, 3, 2, 6, 7, 1]]
    params_greedy = SamplingParams(max_tokens=12, temperature=0.0, logprobs=0)

    def generate(kernels):
        engine = Engine(model, params, None, config=EngineConfig(max_seqs=4, num_blocks=64, kernels=kernels))
        with record_kernel_choices() as choices:
            outs = engine.generate([GenerationRequest(request_id=str(i), prompt_token_ids=tuple(p), params=params_greedy)
                                    for i, p in enumerate(prompts)])
        return outs, {op: sorted(choices.get(op, {})) for op in ("dot", "paged_attention")}

    fast, fast_kernels = generate(None)
    slow, slow_kernels = generate({"dot": "xla", "paged_attention": "xla"})
    assert "openblas" in fast_kernels["dot"] and "cpu_paged_decode" in fast_kernels["paged_attention"]
    assert slow_kernels == {"dot": ["xla"], "paged_attention": ["xla"]}
    for a, b in zip(fast, slow):
        assert a.choices[0].token_ids == b.choices[0].token_ids and len(a.choices[0].token_ids) == 12
        np.testing.assert_allclose(a.choices[0].logprobs, b.choices[0].logprobs, atol=1e-5)


def test_vmapped_over_stacked_weights_as_a_mixture_of_experts_does():
    """vmap over a leading expert axis of x and w (one sgemm per expert) equals NumPy's batched product."""
    rng = np.random.default_rng(5)
    x, w = rng.standard_normal((3, 6, 8)).astype(np.float32), rng.standard_normal((3, 8, 5)).astype(np.float32)
    problem = dot_problem(x[0], w[0], (0,), compute_dtype=np.float32, platform="cpu")
    with forward_only_programs():
        got = jax.jit(jax.vmap(lambda a, b: OpenBlasDot()(problem, a, b)))(jnp.asarray(x), jnp.asarray(w))
    np.testing.assert_allclose(np.asarray(got), np.einsum("eti,eio->eto", x.astype(np.float64), w), rtol=1e-5, atol=1e-5)
