"""Which of axcore-cpu's dot kernels serves: `cpu_rows` on CPUs with AVX-512, `openblas` on others, each only in
forward-only float32 CPU programs; and the engine's programs with either agree with the XLA reference kernels."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axcore.kernels import dot_problem, forward_only_programs, record_kernel_choices

from axcore_cpu import CpuRowsDot, OpenBlasDot, openblas_dot

# (kernel, whether this CPU has AVX-512 as the test pins it, the dot kernel the engine then chooses).
SERVING = [(OpenBlasDot(), False, "openblas"), (CpuRowsDot(), True, "cpu_rows")]


@pytest.mark.parametrize(("kernel", "avx512", "name"), SERVING)
def test_each_serves_only_forward_only_float32_cpu_programs_on_its_cpus(kernel, avx512, name, monkeypatch):
    monkeypatch.setattr(openblas_dot, "xla_dot_is_faster", lambda: avx512)
    base = dot_problem(jnp.zeros((4, 8)), jnp.zeros((8, 3)), (0,), compute_dtype=np.float32, platform="cpu")
    assert kernel.name == name
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
        monkeypatch.setattr(openblas_dot, "xla_dot_is_faster", lambda: not avx512)  # The other kind of CPU.
        support = kernel.is_supported(base)
    assert not support and "AVX-512" in support.reason


@pytest.mark.parametrize(("kernel", "avx512", "name"), SERVING)
def test_the_engine_s_programs_use_it_and_agree_with_the_reference_kernels(kernel, avx512, name, monkeypatch):
    """A tiny model's engine with axcore-cpu's kernels (the default here) gives the greedy tokens and, within
    float32 rounding, the log-probabilities of an engine forced onto the XLA reference kernels."""
    from axcore.engine import Engine, EngineConfig
    from axcore.engine.requests import GenerationRequest, SamplingParams
    from axcore.experiment import load_experiment
    from axcore.testing import TINY_OVERRIDES

    monkeypatch.setattr(openblas_dot, "xla_dot_is_faster", lambda: avx512)
    exp = load_experiment(None, [*TINY_OVERRIDES, "model.compute_dtype=float32"])
    model = exp.config.model.instantiate(name="model", registries=exp.registries)
    params = model.initialize(jax.random.key(0))
    prompts = [[5, 9, 2, 7, 1, 3, 8], [4, 4, 6], [11, 2, 9, 9, 1, 5, 3, 2, 6, 7, 1]]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, logprobs=0)

    def generate(kernels):
        engine = Engine(model, params, None, config=EngineConfig(max_seqs=4, num_blocks=64, kernels=kernels))
        with record_kernel_choices() as choices:
            outs = engine.generate([GenerationRequest(request_id=str(i), prompt_token_ids=tuple(p), params=greedy)
                                    for i, p in enumerate(prompts)])
        return outs, {op: sorted(choices.get(op, {})) for op in ("dot", "paged_attention")}

    fast, fast_kernels = generate(None)
    slow, slow_kernels = generate({"dot": "xla", "paged_attention": "xla"})
    assert name in fast_kernels["dot"] and fast_kernels["paged_attention"] == ["cpu_paged_decode"]
    assert slow_kernels == {"dot": ["xla"], "paged_attention": ["xla"]}
    for a, b in zip(fast, slow):
        assert a.choices[0].token_ids == b.choices[0].token_ids and len(a.choices[0].token_ids) == 12
        np.testing.assert_allclose(a.choices[0].logprobs, b.choices[0].logprobs, atol=1e-5)
