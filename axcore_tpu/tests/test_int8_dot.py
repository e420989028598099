"""The int8 `dot` kernel (axcore_tpu.int8_dot) on CPU: numerics against an independent NumPy int8
implementation and against float32, its declines, its installation, and a short training run.

Error bounds, derived. Rounding to the int8 grid of step s adds an error uniform in
[-s/2, s/2] (variance s^2 / 12) to each quantized value. For y[m, n] = sum_k x[m, k] w[k, n],
the independent errors of x (step s_x[m], per token) and w (step s_w[n], per channel) give

    E ||y_int8 - y||^2 = sum_{m,n} [ s_x[m]^2 / 12 * sum_k w[k,n]^2 + s_w[n]^2 / 12 * sum_k x[m,k]^2 ],

computed from the data below (about 0.82% of ||y|| for Gaussian data with K = 64: s = amax/127
and amax is about 2.4 standard deviations). The tests ask for the measured relative error within
15% of that prediction (measured: within 1.2%); the lower bound fails if a side is not quantized.
Gradients: both operands rounded to bfloat16 (8 significant bits) have an RMS relative error of
0.212 * 2**-7 = 0.166% each (see axcore_gpu/tests/test_fp8_dot.py for the formula), so a product of two
about sqrt(2) * 0.166% = 0.234%; measured 0.23-0.24%; the bounds are 0.18% < error < 0.30%
(the lower bound fails if the gradient matmuls ran in float32).
"""

import os
import pathlib
import re
import subprocess
import sys
import tomllib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axcore.data import Split
from axcore.experiment import load_experiment
from axcore.experiment.builtins import create_plugin_manager
from axcore.kernels import dot_problem, record_kernel_choices
from axcore.testing import TINY_OVERRIDES
from axcore.trainer.trainer import Trainer

import axcore_tpu.int8_plugin
import axcore_tpu.plugin
from axcore_tpu.int8_dot import MAX_CONTRACTED, Int8Dot

PACKAGE_ROOT = pathlib.Path(__file__).resolve().parents[1]
# Weight layouts: (w shape, contract): a Linear, a q projection, an output projection, a tied head.
LAYOUTS = [((64, 48), (0,)), ((64, 4, 16), (0,)), ((4, 16, 48), (0, 1)), ((48, 64), (1,))]


# -- NumPy reference (independent of JAX) -------------------------------------------------------


def np_matrices(x, w, contract):
    """x as `[M, K]`, w as `[K, N]` (contracted dims first, in `contract` order), and how to undo w's."""
    free = [a for a in range(w.ndim) if a not in contract]
    k = len(contract)
    x2 = x.reshape(-1, int(np.prod(x.shape[x.ndim - k:])))
    perm = [*contract, *free]
    w2 = np.transpose(w, perm).reshape(x2.shape[1], -1)
    moved = tuple(w.shape[a] for a in perm)
    return x2, w2, lambda dw2: np.transpose(dw2.reshape(moved), np.argsort(perm))


def np_quantize(v, axis):
    """int8 values (as int64) and float32 scales, by the kernel's recipe, in NumPy float32."""
    v = np.asarray(v, np.float32)
    amax = np.max(np.abs(v), axis=axis, keepdims=True)
    scale = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
    return np.clip(np.round(v / scale), -127, 127).astype(np.int64), scale


def np_int8_dot(x, w, contract):
    """y of the int8 recipe: an exact integer product, dequantized in float64."""
    x2, w2, _ = np_matrices(np.asarray(x, np.float32), np.asarray(w, np.float32), contract)
    (xq, sx), (wq, sw) = np_quantize(x2, 1), np_quantize(w2, 0)
    y2 = (xq @ wq).astype(np.float64) * (sx.astype(np.float64) * sw.astype(np.float64))
    out = tuple(d for a, d in enumerate(w.shape) if a not in contract)
    return y2.reshape(*x.shape[: x.ndim - len(contract)], *out)


def predicted_error(x, w, contract):
    """The expected relative Frobenius error of the int8 product against float (module docstring)."""
    x2, w2, _ = np_matrices(np.float64(x), np.float64(w), contract)
    sx, sw = np.abs(x2).max(1) / 127, np.abs(w2).max(0) / 127
    variance = (sx[:, None] ** 2 / 12 * (w2**2).sum(0)[None, :]).sum()
    variance += (sw[None, :] ** 2 / 12 * (x2**2).sum(1)[:, None]).sum()
    return float(np.sqrt(variance) / np.linalg.norm(x2 @ w2))


def rel_error(actual, expected):
    return float(np.linalg.norm(np.float64(actual) - expected) / np.linalg.norm(expected))


def data(w_shape, contract, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, 24, *(w_shape[a] for a in contract))).astype(np.float32)
    w = (rng.standard_normal(w_shape) / 8).astype(np.float32)
    out = tuple(d for a, d in enumerate(w_shape) if a not in contract)
    g = rng.standard_normal((2, 24, *out)).astype(np.float32)
    return x, w, g


def run(problem, x, w, g):
    y, vjp = jax.vjp(lambda x_, w_: Int8Dot()(problem, x_, w_), jnp.asarray(x), jnp.asarray(w))
    dx, dw = vjp(jnp.asarray(g, y.dtype))
    return y, dx, dw


# -- Numerics -----------------------------------------------------------------------------------


@pytest.mark.parametrize("w_shape, contract", LAYOUTS)
def test_forward_matches_numpy_int8_and_the_derived_float32_bound(w_shape, contract):
    x, w, g = data(w_shape, contract)
    problem = dot_problem(x, w, contract, compute_dtype=jnp.float32, platform="cpu")
    assert Int8Dot().is_supported(problem)
    y, dx, dw = run(problem, x, w, g)
    assert y.shape == g.shape and y.dtype == np.float32
    # The same integers and scales: only the float32 rounding of the dequantization differs.
    reference = np_int8_dot(x, w, contract)
    np.testing.assert_allclose(y, reference, rtol=1e-6, atol=1e-6 * np.abs(reference).max())
    x2, w2, w_back = np_matrices(np.float64(x), np.float64(w), contract)
    error, predicted = rel_error(y, (x2 @ w2).reshape(y.shape)), predicted_error(x, w, contract)
    assert 0.85 * predicted < error < 1.15 * predicted, (error, predicted)
    # Gradients: straight-through, bfloat16 operands, float32 accumulation.
    g2 = np.float64(g).reshape(x2.shape[0], -1)
    dx32, dw32 = (g2 @ w2.T).reshape(x.shape), w_back(x2.T @ g2)
    assert dx.dtype == np.float32 and dw.dtype == np.float32  # x's and the master weight's dtypes.
    assert 0.0018 < rel_error(dx, dx32) < 0.003 and 0.0018 < rel_error(dw, dw32) < 0.003


def test_gradients_equal_bfloat16_matmuls_exactly():
    w_shape, contract = LAYOUTS[0]
    x, w, g = data(w_shape, contract, seed=1)
    _, dx, dw = run(dot_problem(x, w, contract, compute_dtype=jnp.float32, platform="cpu"), x, w, g)
    bf16 = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16), np.float64)  # noqa: E731
    x2, w2 = bf16(x).reshape(-1, 64), bf16(w)
    g2 = bf16(g).reshape(-1, 48)
    np.testing.assert_allclose(dx, (g2 @ w2.T).reshape(x.shape), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, x2.T @ g2, rtol=1e-5, atol=1e-5)


def test_bfloat16_compute_quantizes_the_float32_master_weight():
    w_shape, contract = LAYOUTS[1]
    x, w, g = data(w_shape, contract, seed=2)
    xb = np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32)  # What a bfloat16 model feeds the kernel.
    problem = dot_problem(xb, w, contract, compute_dtype=jnp.bfloat16, platform="cpu")
    y, dx, dw = run(problem, jnp.asarray(xb, jnp.bfloat16), w, g)
    assert y.dtype == jnp.bfloat16 and dx.dtype == jnp.bfloat16 and dw.dtype == np.float32
    reference = np_int8_dot(xb, w, contract)  # The weight quantized from float32, not bfloat16.
    # Equal up to the bfloat16 rounding of the output (2**-9 relative).
    np.testing.assert_allclose(np.float32(y), reference, rtol=2**-8, atol=2**-8 * np.abs(reference).max())


def test_all_zero_rows_and_channels_stay_zero():
    x = np.zeros((3, 64), np.float32)
    x[1] = np.linspace(-1, 1, 64)
    w = np.zeros((64, 32), np.float32)
    w[:, 5] = 0.5
    y = Int8Dot()(dot_problem(x, w, (0,), compute_dtype=jnp.float32, platform="cpu"), x, w)
    assert np.all(np.isfinite(y)) and np.all(y[0] == 0) and np.all(np.delete(np.asarray(y), 5, axis=1) == 0)


# -- Declines -----------------------------------------------------------------------------------


def _problem(w_shape=(256, 128), contract=(0,), compute="bfloat16", output=None, platform="tpu", extras=None):
    w = np.zeros(w_shape, np.float32)
    return dot_problem(jax.ShapeDtypeStruct((), compute), w, contract, compute_dtype=compute, output_dtype=output,
                       platform=platform, extras=extras)


@pytest.mark.parametrize(
    "problem, reason",
    [
        (_problem(), None),
        (_problem((128, 4, 64), (0,)), None),  # Output [4, 64]: N = 256.
        (_problem((64, 48), platform="cpu", compute="float32"), None),  # Emulation: any size.
        (_problem(platform="gpu"), "not on gpu"),
        (_problem((256, 1024), output="float32"), "keeps logits in higher precision"),
        (_problem((256, 8)), "output size 8 must be multiples of 128"),  # A small MoE router.
        (_problem((200, 128)), "contracted size 200"),
        (_problem(compute="float16"), "compute dtype float16"),
        (_problem((MAX_CONTRACTED + 1, 16), platform="cpu"), "overflow int32"),
        (_problem(extras={"fp8": True}), "does not implement extras \\['fp8'\\]"),
    ],
)
def test_is_supported_decision_table(problem, reason):
    support = Int8Dot().is_supported(problem)
    if reason is None:
        assert support, support.reason
    else:
        assert not support and re.search(reason, support.reason), support.reason


# -- Installation -------------------------------------------------------------------------------


def test_entry_point_and_import_without_device():
    project = tomllib.loads((PACKAGE_ROOT / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["axcore"]["int8"] == "axcore_tpu.int8_plugin"
    code = (
        "import axcore_tpu.int8_plugin, axcore_tpu.plugin\n"
        "import jax\n"
        "try:\n"
        "    jax.devices()\n"
        "except RuntimeError:\n"
        "    print('no backend')\n"
    )
    env = dict(os.environ, JAX_PLATFORMS="axcore_no_such_platform", PYTHONPATH=str(PACKAGE_ROOT))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["no", "backend"]  # Importing touched no backend.


def _dot_kernels(plugins):
    objects = {"tpu": axcore_tpu.plugin, "int8": axcore_tpu.int8_plugin}
    kernels = create_plugin_manager(plugins, objects=objects).registries.kernels
    return {k.name: k.priority for k in kernels.candidates("dot")}


def test_tpu_plugin_registers_int8_by_name_and_the_int8_plugin_by_priority():
    assert _dot_kernels(["tpu"])["int8"] == axcore_tpu.plugin.INT8_BY_NAME_PRIORITY < 0
    assert _dot_kernels(["int8"])["int8"] == 50
    assert _dot_kernels(["tpu", "int8"])["int8"] == 50  # The int8 plugin's registration overrides.


def test_int8_dot_modifier_forces_int8_on_the_decoder_layers():
    rules = [
        "mesh_rules=[{name: int8, instance_type: 'cpu-.*', modifiers: [{type: int8_dot}]}]",
        "mesh.instance_type=cpu-1",
    ]
    config = load_experiment(None, ["plugins=[tpu]", *rules], objects={"tpu": axcore_tpu.plugin}).config
    assert config.model.decoder.layer.kernels == {"dot": "int8"}
    assert config.model.kernels is None  # The output head keeps its kernel.


def _leaves(tree):
    return {"/".join(str(getattr(k, "key", k)) for k in path): leaf
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def test_short_bfloat16_training_run_with_int8_reduces_the_loss(tmp_path):
    steps = 20
    exp = load_experiment(
        None,
        [*TINY_OVERRIDES, "model.compute_dtype=bfloat16", "plugins=[int8]", f"trainer.run_dir={tmp_path}",
         "trainer.learner.schedule.warmup_steps=2", "trainer.learner.learning_rate=1e-2",
         f"trainer.max_steps={steps}"],
        objects={"int8": axcore_tpu.int8_plugin},
    )
    trainer = Trainer(exp)
    state, step = trainer.step.init_state(), trainer.step.compiled_train_step()
    batches = trainer.cfg.input.make_iterator(Split.TRAIN, trainer.step.tokenizer)
    losses = []
    for i in range(steps):
        batch = jax.device_put(next(batches), trainer.step.batch_sharding)
        if i == 0:
            with record_kernel_choices() as choices:
                state, metrics = step(state, batch)
        else:
            state, metrics = step(state, batch)
        losses.append(metrics["loss"])
    losses = np.asarray(jax.device_get(losses))
    # int8 for every projection; the float32-logits head keeps a higher-precision kernel.
    projections = {f"model.decoder.layer{i}.{site}" for i in range(2) for site in (
        "self_attention.q_proj", "self_attention.k_proj", "self_attention.v_proj", "self_attention.o_proj",
        "feed_forward.up_proj.dot", "feed_forward.down_proj.dot")}
    assert set(choices["dot"]["int8"]) == projections
    assert "model.lm_head.dot" in {s for k, sites in choices["dot"].items() if k != "int8" for s in sites}
    assert np.all(np.isfinite(losses)), losses
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.3, losses
    params = _leaves(jax.device_get(state["params"]))
    assert not any("kernel_state" in p for p in params)  # Dynamic scales: no state.
    assert all(v.dtype == np.float32 for v in params.values())  # Float32 master weights.
