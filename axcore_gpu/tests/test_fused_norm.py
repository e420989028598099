"""The gpu plugin's `rms_norm` kernels (`fused_vjp`, `pallas`): against the float64 NumPy formula, their
decisions, the Triton lowering, and a model whose norms are forced onto them.

`fused_vjp` is jax.numpy and runs here as it would on a GPU; the Pallas kernels run in
interpret mode (`PallasRMSNorm(interpret=True)`), and their Triton path is checked by
lowering for CUDA (Pallas -> Triton IR) without a GPU.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh

import axcore
from axcore.experiment import load_experiment
from axcore.kernels import RMSNormProblem, record_kernel_choices, rms_norm_problem
from axcore.testing import (  # The op's oracle, one copy
    RMS_NORM_CASES,
    RMS_NORM_EPS,
    TINY_OVERRIDES,
    check_rms_norm,
    train_params,
)

import axcore_gpu.plugin
from axcore_gpu.fused_norm import MAX_DIM, FusedVjpRMSNorm, PallasRMSNorm

BF16 = np.dtype(jnp.bfloat16)


def gpu_problem(shape=(8, 2048, 2048), dtype=BF16, **fields):
    """A GPU problem: bfloat16 x of `shape` with a float32 scale, changed by `fields`."""
    base = dict(platform="gpu", shape=shape, dtype=np.dtype(dtype), scale_dtype=np.dtype(np.float32), eps=RMS_NORM_EPS)
    return RMSNormProblem(**{**base, **fields})


# name -> (problem, kernel, None if supported else a phrase the reason must contain)
DECISIONS = {
    "pallas, the 0.89B model's norms": (gpu_problem(), PallasRMSNorm(), None),
    "pallas, dim 96, float32": (gpu_problem((7, 96), np.float32), PallasRMSNorm(), None),
    "pallas, float16": (gpu_problem(dtype=np.float16), PallasRMSNorm(), None),
    "pallas, one-device mesh": (gpu_problem(mesh=AbstractMesh((1,), ("data",))), PallasRMSNorm(), None),
    "pallas on cpu": (gpu_problem(platform="cpu"), PallasRMSNorm(), "platform is 'cpu'"),
    "pallas on cpu, interpret": (gpu_problem(platform="cpu"), PallasRMSNorm(interpret=True), None),
    "pallas, float64": (gpu_problem(dtype=np.float64), PallasRMSNorm(), "dtype float64"),
    "pallas, dim too wide": (gpu_problem((4, 2 * MAX_DIM)), PallasRMSNorm(), f"dim {2 * MAX_DIM}"),
    "pallas, no rows": (gpu_problem((0, 64)), PallasRMSNorm(), "no rows"),
    "pallas, multi-device mesh": (gpu_problem(mesh=AbstractMesh((2,), ("data",))), PallasRMSNorm(), "multi-device"),
    "pallas, unknown extras": (gpu_problem(extras={"fp8": True}), PallasRMSNorm(), "extras ['fp8']"),
    "fused_vjp, cpu float64": (gpu_problem(platform="cpu", dtype=np.float64), FusedVjpRMSNorm(), None),
    "fused_vjp, multi-device mesh": (gpu_problem(mesh=AbstractMesh((2,), ("data",))), FusedVjpRMSNorm(), None),
    "fused_vjp, unknown extras": (gpu_problem(extras={"fp8": True}), FusedVjpRMSNorm(), "extras ['fp8']"),
}


@pytest.mark.parametrize("case", DECISIONS)
def test_decisions(case):
    problem, kernel, phrase = DECISIONS[case]
    support = kernel.is_supported(problem)
    if phrase is None:
        assert support, support.reason
    else:
        assert not support and phrase in support.reason, support.reason


def test_block_rows_must_be_a_power_of_two():
    with pytest.raises(ValueError, match="block_rows 3"):
        PallasRMSNorm(block_rows=3)


def _through(kernel):
    """fn(x, scale) running `kernel` on the problem of its arguments (jitted)."""

    def fn(x, scale):
        problem = rms_norm_problem(x, scale, eps=RMS_NORM_EPS)
        assert kernel.is_supported(problem), kernel.is_supported(problem).reason
        return kernel(problem, x, scale)

    return jax.jit(fn)


@pytest.mark.parametrize("case", RMS_NORM_CASES)
def test_fused_vjp_matches_numpy(case):
    check_rms_norm(_through(FusedVjpRMSNorm()), *RMS_NORM_CASES[case])


# Row tiles of 4 (and 2): row counts off the tile grid (9 * 4 = 36 rows, 33, 5); at most 3
# backward programs, so each loops over several tiles and the last one's tail is masked.
PALLAS = {
    "default tiles": PallasRMSNorm(interpret=True),
    "4-row tiles, 3 programs": PallasRMSNorm(interpret=True, block_rows=4, max_programs=3),
    "2-row tiles, 1 program": PallasRMSNorm(interpret=True, block_rows=2, max_programs=1),
}


@pytest.mark.parametrize("kernel", PALLAS)
@pytest.mark.parametrize("case", RMS_NORM_CASES)
def test_pallas_interpret_matches_numpy(case, kernel):
    check_rms_norm(_through(PALLAS[kernel]), *RMS_NORM_CASES[case])


# name -> (shape of x, dtype)
LOWERINGS = {
    "the 0.89B model's norms: [8, 2048, 2048] bf16": ((8, 2048, 2048), jnp.bfloat16),
    "[77, 96] f32": ((77, 96), jnp.float32),
    "[3, 5, 8192] f16": ((3, 5, 8192), jnp.float16),
}


@pytest.mark.parametrize("case", LOWERINGS)
def test_forward_and_backward_lower_to_triton_for_cuda(case):
    shape, dtype = LOWERINGS[case]
    x, scale = jax.ShapeDtypeStruct(shape, dtype), jax.ShapeDtypeStruct(shape[-1:], jnp.float32)
    kernel = PallasRMSNorm()
    problem = rms_norm_problem(x, scale, eps=RMS_NORM_EPS, platform="gpu")

    def loss(x, scale):
        return jnp.sum(kernel(problem, x, scale).astype(jnp.float32))

    lowered = jax.jit(jax.grad(loss, argnums=(0, 1))).trace(x, scale).lower(lowering_platforms=("cuda",))
    assert lowered.as_text().count("__gpu$xla.gpu.triton") == 2  # Forward; backward (dx, partial dscale).


# -- In a model ----------------------------------------------------------------------------------

NORM_SITES = sorted([f"model.decoder.layer{i}.{n}" for i in range(2) for n in ("attention_norm", "ffn_norm")]
                    + ["model.final_norm"])
# The overrides that force every norm of the model onto a kernel (the final norm is not under the decoder).
FORCE_PALLAS = ["model.decoder.layer.norm.kernels={rms_norm: pallas}", "model.final_norm.kernels={rms_norm: pallas}"]


@pytest.mark.parametrize("overrides", [FORCE_PALLAS, ["model.kernels={rms_norm: pallas}"]], ids=["per norm", "model"])
def test_overrides_route_every_norm_of_a_gpu_experiment_to_pallas(overrides):
    gpu = [*TINY_OVERRIDES, "mesh.instance_type=gpu-h100-8"]
    exp = load_experiment(None, [*gpu, *overrides], objects={"gpu": axcore_gpu.plugin})
    assert {k: sorted(v) for k, v in exp.kernel_choices()["rms_norm"].items()} == {"pallas": NORM_SITES}
    unforced = load_experiment(None, gpu, objects={"gpu": axcore_gpu.plugin})
    assert set(unforced.kernel_choices()["rms_norm"]) == {"xla"}  # Both kernels rank below the reference.


class InterpretPallas:
    """Registers the Pallas norm kernels in interpret mode, so a CPU model can run them (over the gpu
    plugin's, which a GPU machine loads for its platform)."""

    @axcore.hookimpl
    def axcore_register_kernels(self, register):
        register("rms_norm", PallasRMSNorm(interpret=True, block_rows=16, priority=-10), override=True)


@pytest.mark.parametrize("kernel", ["fused_vjp", "pallas"])
def test_a_model_forced_onto_a_kernel_trains_like_the_reference(kernel):
    objects = {"gpu": axcore_gpu.plugin} if kernel == "fused_vjp" else {"interpret": InterpretPallas()}
    plugin = next(iter(objects))
    overrides = [*TINY_OVERRIDES, f"plugins=[{plugin}]", f"model.kernels={{rms_norm: {kernel}}}"]
    forced = load_experiment(None, overrides, objects=objects)
    with record_kernel_choices() as choices:
        _, losses = train_params(forced, steps=2)
    # A site is recorded once per trace (a GPU run traces the step more than once): compare the sites.
    assert {k: sorted(set(v)) for k, v in choices["rms_norm"].items()} == {kernel: NORM_SITES}
    _, want = train_params(load_experiment(None, TINY_OVERRIDES), steps=2)
    np.testing.assert_allclose(losses, want, rtol=1e-5)
