"""The fp8 `dot` kernel (axcore_gpu.fp8_dot) on CPU: numerics against an independent NumPy
implementation (ml_dtypes float8 casts), delayed scaling, its declines, and a short training run.

Error bounds. Rounding to nearest with p mantissa bits has a relative error of at most
2**-(p+1) per element (e4m3: p=3, 2**-4; e5m2: p=2, 2**-3) and, for values spread over
their binades, an RMS relative error of 2**-p / sqrt(12) * sqrt(E[1/m^2]) = 0.212 * 2**-p
(m the mantissa in [1, 2), log-uniform): 2.65% for e4m3, 5.3% for e5m2. A dot sums
products whose two factors carry independent errors, so its relative Frobenius error is
about sqrt(d_a^2 + d_b^2): forward (e4m3 x e4m3) 3.75%, gradients (e5m2 x e4m3) 5.9%.
Measured on the Gaussian data below (every layout, float32 or bfloat16 compute): forward
3.8-3.9%, dx and dw 5.8-6.2%. The bounds are 3% < error < 4.5% forward and 4.5% < error < 7%
for gradients; the lower bounds fail if a tensor is not quantized at all.
"""

import os
import pathlib
import re
import subprocess
import sys
import tomllib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from axcore.data import Split
from axcore.experiment import load_experiment
from axcore.kernels import dot_problem, record_kernel_choices
from axcore.testing import TINY_OVERRIDES
from axcore.trainer.trainer import Trainer

import axcore_gpu.fp8_plugin
from axcore_gpu.fp8_dot import Fp8Dot

PACKAGE_ROOT = pathlib.Path(__file__).resolve().parents[1]
E4M3, E5M2 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2
# Weight layouts: (w shape, contract): a Linear, a q projection, an output projection, a tied head.
LAYOUTS = [((64, 48), (0,)), ((64, 4, 16), (0,)), ((4, 16, 48), (0, 1)), ((48, 64), (1,))]


# -- NumPy reference (independent of JAX) -------------------------------------------------------


def np_scale(history, fp8, margin=0):
    amax = float(np.max(history))
    return np.float32(amax / float(ml_dtypes.finfo(fp8).max) * 2.0**margin) if amax > 0 else np.float32(1.0)


def np_qdq(v, scale, fp8):
    fmax = np.float32(ml_dtypes.finfo(fp8).max)
    q = np.clip(np.asarray(v, np.float32) / scale, -fmax, fmax).astype(fp8)
    return q.astype(np.float32) * scale


def np_matrices(x, w, contract):
    """x as `[M, K]`, w as `[K, N]` (contracted dims first, in `contract` order), and how to undo it."""
    free = [a for a in range(w.ndim) if a not in contract]
    k = len(contract)
    x2 = x.reshape(-1, int(np.prod(x.shape[x.ndim - k:])))
    w_perm = [*contract, *free]
    w2 = np.transpose(w, w_perm).reshape(x2.shape[1], -1)
    out_shape = (*x.shape[: x.ndim - k], *(w.shape[a] for a in free))
    w_moved_shape = tuple(w.shape[a] for a in w_perm)
    return x2, w2, out_shape, lambda dw2: np.transpose(dw2.reshape(w_moved_shape), np.argsort(w_perm))


def np_fp8_dot(x, w, contract, histories, g=None):
    """(y, dx, dw) of the fp8 recipe in float64 sums of float32 quantized values (dx, dw None without g)."""
    xq = np_qdq(x, np_scale(histories["x"], E4M3), E4M3).astype(np.float64)
    wq = np_qdq(w, np_scale(histories["w"], E4M3), E4M3).astype(np.float64)
    x2, w2, out_shape, w_back = np_matrices(xq, wq, contract)
    y = (x2 @ w2).reshape(out_shape)
    if g is None:
        return y, None, None
    gq = np_qdq(g, np_scale(histories["g"], E5M2), E5M2).astype(np.float64).reshape(x2.shape[0], -1)
    return y, (gq @ w2.T).reshape(x.shape), w_back(x2.T @ gq)


def np_float_dot(x, w, contract, g):
    x2, w2, out_shape, w_back = np_matrices(np.float64(x), np.float64(w), contract)
    g2 = np.float64(g).reshape(x2.shape[0], -1)
    return (x2 @ w2).reshape(out_shape), (g2 @ w2.T).reshape(x.shape), w_back(x2.T @ g2)


def rel_error(actual, expected):
    return float(np.linalg.norm(np.float64(actual) - expected) / np.linalg.norm(expected))


# -- Helpers ------------------------------------------------------------------------------------


def data(w_shape, contract, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, 24, *(w_shape[a] for a in contract))).astype(np.float32)
    w = (rng.standard_normal(w_shape) / 8).astype(np.float32)
    out = tuple(d for a, d in enumerate(w_shape) if a not in contract)
    g = (rng.standard_normal((2, 24, *out)) * 1e-3).astype(np.float32)  # Loss gradients are small.
    return x, w, g


def run(kernel, problem, x, w, state, g):
    """The kernel's (y, new_state) and, for cotangent g, (dx, dw, new g history)."""

    def f(x_, w_, g_history):
        return kernel(problem, x_, w_, state=dict(state, g_amax_history=g_history))

    (y, new_state), vjp = jax.vjp(f, x, w, state["g_amax_history"])
    zeros = jax.tree.map(jnp.zeros_like, new_state)
    dx, dw, g_history = vjp((jnp.asarray(g, y.dtype), zeros))
    return y, new_state, dx, dw, g_history


def histories(x_amax, w_amax, g_amax, length=4):
    """State whose histories hold one value each (at index 1, as if pushed a step ago)."""
    return {name: jnp.zeros(length, jnp.float32).at[1].set(value)
            for name, value in (("x_amax_history", x_amax), ("w_amax_history", w_amax), ("g_amax_history", g_amax))}


# -- Numerics -----------------------------------------------------------------------------------


@pytest.mark.parametrize("w_shape, contract", LAYOUTS)
def test_forward_and_gradients_match_numpy_fp8_and_stay_near_float32(w_shape, contract):
    x, w, g = data(w_shape, contract)
    # Scales from histories below the current amaxes (x's and g's clip their largest values) and above (w's).
    state = histories(0.8 * np.abs(x).max(), 1.5 * np.abs(w).max(), 0.5 * np.abs(g).max())
    problem = dot_problem(x, w, contract, compute_dtype=jnp.float32, platform="cpu")
    assert Fp8Dot().is_supported(problem)
    y, _, dx, dw, _ = run(Fp8Dot(history_length=4), problem, x, w, state, g)
    numpy_histories = {"x": state["x_amax_history"], "w": state["w_amax_history"], "g": state["g_amax_history"]}
    y_ref, dx_ref, dw_ref = np_fp8_dot(x, w, contract, numpy_histories, g)
    for name, actual, expected in (("y", y, y_ref), ("dx", dx, dx_ref), ("dw", dw, dw_ref)):
        assert actual.shape == expected.shape and actual.dtype == np.float32, name
        # The same quantized values: only float32 accumulation order differs.
        np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max(), err_msg=name)
    # Near float32 results at the steady state of delayed scaling (histories at the current amaxes).
    state = histories(np.abs(x).max(), np.abs(w).max(), np.abs(g).max())
    y, _, dx, dw, _ = run(Fp8Dot(history_length=4), problem, x, w, state, g)
    y32, dx32, dw32 = np_float_dot(x, w, contract, g)
    assert 0.03 < rel_error(y, y32) < 0.045
    assert 0.045 < rel_error(dx, dx32) < 0.07 and 0.045 < rel_error(dw, dw32) < 0.07


def test_bfloat16_compute_stays_within_the_bounds_of_float32_results():
    w_shape, contract = LAYOUTS[1]
    x, w, g = data(w_shape, contract, seed=1)
    g = g / np.abs(g).max()  # Representable in bfloat16 without much loss, like a real cotangent.
    state = histories(np.abs(x).max(), np.abs(w).max(), np.abs(g).max())
    problem = dot_problem(x, w, contract, compute_dtype=jnp.bfloat16, platform="cpu")
    y, _, dx, dw, _ = run(Fp8Dot(history_length=4), problem, x, w, state, g)
    assert y.dtype == jnp.bfloat16 and dx.dtype == np.float32 and dw.dtype == np.float32  # Float32 master weights.
    y32, dx32, dw32 = np_float_dot(x, w, contract, np.asarray(jnp.asarray(g, jnp.bfloat16), np.float32))
    assert 0.03 < rel_error(y, y32) < 0.045
    assert 0.045 < rel_error(dx, dx32) < 0.07 and 0.045 < rel_error(dw, dw32) < 0.07


@pytest.mark.parametrize("compute_dtype", [jnp.bfloat16, jnp.float32])
def test_every_product_of_forward_and_backward_takes_fp8_operands(compute_dtype):
    """The program's dots themselves take fp8 operands, so no compiler pass can drop the quantization.

    (A dequantize-then-dot form compiled, on an H200 with JAX 0.11.2, into bf16 GEMMs without the
    fp8 round trip: `benchmarks/gpu_probes.py`.)
    """
    w_shape, contract = LAYOUTS[1]
    x, w, g = data(w_shape, contract)
    kernel = Fp8Dot(history_length=4)
    problem = dot_problem(x, w, contract, compute_dtype=compute_dtype, platform="cpu")
    state = histories(np.abs(x).max(), np.abs(w).max(), np.abs(g).max())
    cast = [jnp.asarray(a, compute_dtype) for a in (x, w, g)]
    text = jax.jit(lambda *a: run(kernel, problem, *a)).lower(*cast[:2], state, cast[2]).as_text()
    operand_types = re.findall(r"stablehlo\.dot_general.*?: \(tensor<[^>]*x(\w+)>, tensor<[^>]*x(\w+)>\)", text)
    # Forward e4m3 x e4m3; dx = g . w^T is e5m2 x e4m3; dw = x^T . g is e4m3 x e5m2.
    assert sorted(operand_types) == sorted([("f8E4M3FN", "f8E4M3FN"), ("f8E5M2", "f8E4M3FN"), ("f8E4M3FN", "f8E5M2")])


# -- Delayed scaling ----------------------------------------------------------------------------


def test_delayed_scaling_uses_the_history_before_each_step_and_rolls_it():
    w_shape, contract = LAYOUTS[0]
    x, w, _ = data(w_shape, contract, seed=2)
    kernel = Fp8Dot(history_length=3)
    problem = dot_problem(x, w, contract, compute_dtype=jnp.float32, platform="cpu")
    state = {name: s.initializer(None, s.shape, s.dtype) for name, s in kernel.state_specs(problem).items()}
    expected_x, expected_w = [0.0] * 3, [0.0] * 3
    for step, factor in enumerate([300.0, 1.0, 2.0, 0.5]):  # Step 0: x up to ~1300, clipped at 448 by scale 1.
        xs = x * factor
        rng = np.random.default_rng(step)
        g = rng.standard_normal((*xs.shape[:-1], 48)).astype(np.float32) * 10.0 ** -step

        def loss(x_, w_, g_history, state=state, g=g):  # This step's state and g, bound here.
            y, new = kernel(problem, x_, w_, state=dict(state, g_amax_history=g_history))
            return jnp.sum(y * g), (y, new)  # dL/dy = g exactly.

        (_, (y, new_state)), (dx, dw, g_history) = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(
            xs, w, state["g_amax_history"]
        )
        current = {"x": np.array(expected_x), "w": np.array(expected_w), "g": np.asarray(state["g_amax_history"])}
        if step == 0:
            assert all(np_scale(h, E4M3) == 1.0 for h in current.values())  # Empty history: scale 1.
            assert np.abs(xs).max() > 448  # So x's largest values clip at the e4m3 maximum.
        y_ref, dx_ref, dw_ref = np_fp8_dot(xs, w, contract, current, g)
        np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5 * np.abs(y_ref).max())
        np.testing.assert_allclose(dx, dx_ref, rtol=1e-5, atol=1e-5 * np.abs(dx_ref).max())
        np.testing.assert_allclose(dw, dw_ref, rtol=1e-5, atol=1e-5 * np.abs(dw_ref).max())
        # The histories roll: this step's amax at index 0, the oldest dropped.
        expected_x = [float(np.abs(xs).max()), *expected_x[:2]]
        expected_w = [float(np.abs(w).max()), *expected_w[:2]]
        np.testing.assert_allclose(new_state["x_amax_history"], expected_x, rtol=1e-6)
        np.testing.assert_allclose(new_state["w_amax_history"], expected_w, rtol=1e-6)
        # g's new history is its cotangent: the amax of the true output gradient pushed.
        previous_g = np.asarray(state["g_amax_history"])
        np.testing.assert_allclose(g_history, [np.abs(g).max(), *previous_g[:2]], rtol=1e-6)
        state = {"x_amax_history": new_state["x_amax_history"], "w_amax_history": new_state["w_amax_history"],
                 "g_amax_history": g_history}
    assert set(new_state) == {"x_amax_history", "w_amax_history"}  # g's comes only as a cotangent.


def test_margin_scales_by_powers_of_two():
    w_shape, contract = LAYOUTS[0]
    x, w, _ = data(w_shape, contract, seed=3)
    problem = dot_problem(x, w, contract, compute_dtype=jnp.float32, platform="cpu")
    state = histories(np.abs(x).max(), np.abs(w).max(), 1.0)
    y, *_ = run(Fp8Dot(history_length=4, margin=2), problem, x, w, state, np.zeros((2, 24, 48), np.float32))
    xq = np_qdq(x, np_scale(state["x_amax_history"], E4M3, margin=2), E4M3)
    wq = np_qdq(w, np_scale(state["w_amax_history"], E4M3, margin=2), E4M3)
    ref = np.float64(xq) @ np.float64(wq)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_state_specs_are_frozen_float32_histories_and_g_is_overwrite_with_gradient():
    problem = dot_problem(np.zeros((2, 64), np.float32), np.zeros((64, 32), np.float32), (0,),
                          compute_dtype=jnp.bfloat16, platform="cpu")
    specs = Fp8Dot(history_length=8).state_specs(problem)
    assert set(specs) == {"x_amax_history", "w_amax_history", "g_amax_history"}
    for name, spec in specs.items():
        assert spec.shape == (8,) and np.dtype(spec.dtype) == np.float32 and not spec.trainable, name
        assert spec.mesh_axes == (None,) and spec.weight_decay_scale == 0.0, name
        np.testing.assert_array_equal(spec.initializer(None, spec.shape, spec.dtype), np.zeros(8))
        assert spec.overwrite_with_gradient == (name == "g_amax_history"), name


# -- Declines -----------------------------------------------------------------------------------


def _problem(w_shape=(64, 32), contract=(0,), compute="bfloat16", output=None, platform="cpu", extras=None,
             mesh=None):
    w = np.zeros(w_shape, np.float32)
    return dot_problem(jax.ShapeDtypeStruct((), compute), w, contract, compute_dtype=compute, output_dtype=output,
                       platform=platform, extras=extras, mesh=mesh)


# A mesh of CPU devices, which have no CUDA compute capability (on any host).
CPU_MESH = jax.sharding.Mesh(np.array(jax.devices("cpu")[:1]), ("data",))


@pytest.mark.parametrize(
    "kernel, problem, reason",
    [
        (Fp8Dot(compute_capability=(9, 0)), _problem(platform="gpu"), None),
        (Fp8Dot(compute_capability=(8, 9)), _problem(platform="gpu"), None),
        (Fp8Dot(compute_capability=(10, 0)), _problem(platform="gpu"), None),
        (Fp8Dot(), _problem(platform="cpu"), None),  # Emulation.
        (Fp8Dot(), _problem((4, 16, 48), (0, 1), compute="float32"), None),
        (Fp8Dot(compute_capability=(8, 0)), _problem(platform="gpu"), "capability 8.9\\+ .*got 8.0"),
        (Fp8Dot(compute_capability=(8, 6)), _problem(platform="gpu"), "got 8.6"),
        (Fp8Dot(), _problem(platform="gpu", mesh=CPU_MESH), "no CUDA device"),  # Asked for a GPU on CPU devices.
        (Fp8Dot(), _problem(platform="tpu"), "not on tpu"),
        (Fp8Dot(), _problem((64, 256), output="float32"), "keeps logits in higher precision"),
        (Fp8Dot(), _problem((64, 8)), "output size 8 must be multiples of 16"),  # A small MoE router.
        (Fp8Dot(), _problem((40, 32)), "contracted size 40"),
        (Fp8Dot(), _problem((4, 10, 32), (0, 1)), "contracted size 40"),
        (Fp8Dot(), _problem((64, 2, 8)), None),  # Output [2, 8]: the GEMM's N is 16.
        (Fp8Dot(), _problem(compute="float64", output="float64"), "compute dtype float64"),
        (Fp8Dot(), _problem(extras={"int8": True}), "does not implement extras \\['int8'\\]"),
    ],
)
def test_is_supported_decision_table(kernel, problem, reason):
    support = kernel.is_supported(problem)
    if reason is None:
        assert support, support.reason
    else:
        assert not support
        assert re.search(reason, support.reason), support.reason


# -- The plugin -----------------------------------------------------------------------------------


def test_plugin_entry_point_and_import_without_device():
    project = tomllib.loads((PACKAGE_ROOT / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["axcore"]["fp8"] == "axcore_gpu.fp8_plugin"
    code = (
        "import axcore_gpu.fp8_plugin\n"
        "import jax\n"
        "try:\n"
        "    jax.devices()\n"
        "except RuntimeError:\n"
        "    print('no backend')\n"
    )
    env = dict(os.environ, JAX_PLATFORMS="axcore_no_such_platform", PYTHONPATH=os.pathsep.join([str(PACKAGE_ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["no", "backend"]  # Importing touched no backend.


def _leaves(tree):
    return {"/".join(str(getattr(k, "key", k)) for k in path): leaf
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def test_short_bfloat16_training_run_with_fp8_reduces_the_loss(tmp_path):
    steps = 25
    exp = load_experiment(
        None,
        [*TINY_OVERRIDES, "model.compute_dtype=bfloat16", "plugins=[fp8]", f"trainer.run_dir={tmp_path}",
         "trainer.learner.schedule.warmup_steps=2", "trainer.learner.learning_rate=1e-2",
         f"trainer.max_steps={steps}"],
        objects={"fp8": axcore_gpu.fp8_plugin},
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
    # fp8 for every projection; the float32-logits head keeps a higher-precision kernel.
    projections = {f"model.decoder.layer{i}.{site}" for i in range(2) for site in (
        "self_attention.q_proj", "self_attention.k_proj", "self_attention.v_proj", "self_attention.o_proj",
        "feed_forward.up_proj.dot", "feed_forward.down_proj.dot")}
    assert set(choices["dot"]["fp8"]) == projections
    assert "model.lm_head.dot" in {s for k, sites in choices["dot"].items() if k != "fp8" for s in sites}
    assert np.all(np.isfinite(losses)), losses
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.3, losses
    params = _leaves(jax.device_get(state["params"]))
    histories = {p: v for p, v in params.items() if "kernel_state" in p}
    assert len(histories) == 3 * len(projections)
    for path, value in histories.items():
        assert value.dtype == np.float32 and value.shape == (16,), path
        # Every step pushed a positive amax: a full history of 16 from 25 steps, gradients' included.
        assert np.all(value > 0), (path, value)
