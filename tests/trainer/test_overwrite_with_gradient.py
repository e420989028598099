"""Kernel state declared `overwrite_with_gradient`: the train step's gradient of it is its new value.

A spy `dot` kernel keeps, per site, a history whose cotangent (from its custom VJP) is the
history rolled by one with `max |dL/dw|` of the site's weight pushed at index 0. After
Trainer steps the history must hold those maxima, computed independently with `jax.grad`
of the plain model (no plugin); the logged gradient norm and the trainable parameters
must be those of a run without the plugin (the history's "gradient" reaches neither the
norm, the clipping nor the optimizer).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import axcore
from axcore.data import Split
from axcore.experiment import load_experiment
from axcore.kernels import SUPPORTED, reference_dot
from axcore.params import ParameterSpec, constant
from axcore.testing import TINY_OVERRIDES
from axcore.trainer.trainer import Trainer

HISTORY = 3
# Default learner: AdamW with global-norm clipping at 1.0 (which the tiny model's first gradients exceed).
COMMON = [*TINY_OVERRIDES, "trainer.eval_batches=1", "trainer.sample.num_tokens=0", "trainer.eval_every=0",
          "trainer.learner.schedule.warmup_steps=0", "trainer.learner.learning_rate=1e-2"]


class WeightGradAmaxDot:
    """The reference dot whose VJP hands its OWG state the history with `max |dw|` pushed."""

    name = "grad_amax"
    priority = 100

    def is_supported(self, problem):
        return SUPPORTED

    def state_specs(self, problem):
        return {
            "dw_amax": ParameterSpec((HISTORY,), jnp.float32, constant(0.0), (None,), 0.0, trainable=False,
                                     overwrite_with_gradient=True),
            "calls": ParameterSpec((), jnp.float32, constant(0.0), trainable=False),
        }

    def __call__(self, problem, x, w, *, state):
        def plain(x_, w_):
            return reference_dot(problem, x_, w_)

        @jax.custom_vjp
        def dot(x_, w_, history):
            del history
            return plain(x_, w_)

        def fwd(x_, w_, history):
            return plain(x_, w_), (x_, w_, history)

        def bwd(residuals, g):
            x_, w_, history = residuals
            dx, dw = jax.vjp(plain, x_, w_)[1](g)
            new = jnp.roll(history, 1).at[0].set(jnp.max(jnp.abs(dw.astype(jnp.float32))))
            return dx, dw, new

        dot.defvjp(fwd, bwd)
        y = dot(x, w, state["dw_amax"])
        # A forward state update of the OWG leaf too: the gradient must win (it is applied last).
        return y, {"calls": state["calls"] + 1.0, "dw_amax": jnp.full((HISTORY,), -7.0)}


class Plugin:
    @axcore.hookimpl
    def axcore_register_kernels(self, register):
        register("dot", WeightGradAmaxDot())


def _leaves(tree):
    return {"/".join(str(getattr(k, "key", k)) for k in path): leaf
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def _strip(tree):
    if not isinstance(tree, dict):
        return tree
    return {k: _strip(v) for k, v in tree.items() if k != "kernel_state"}


def _steps(trainer, batch, steps):
    """[(params before the step, metrics)] for `steps` train steps, and the final params (host copies)."""
    state, step = trainer.step.init_state(), trainer.step.compiled_train_step()
    batch = jax.device_put(batch, trainer.step.batch_sharding)
    history = []
    for _ in range(steps):
        before = jax.device_get(state)
        state, metrics = step(state, batch)  # Donates `state`.
        history.append((before, jax.device_get(metrics)))
    return history, jax.device_get(state["params"])


def test_owg_state_is_its_gradient_and_stays_out_of_grad_norm_and_optimizer(tmp_path):
    owg = Trainer(load_experiment(None, [*COMMON, f"trainer.run_dir={tmp_path / 'a'}", "plugins=[spy]"],
                                  objects={"spy": Plugin()}))
    plain = Trainer(load_experiment(None, [*COMMON, f"trainer.run_dir={tmp_path / 'b'}"]))
    batch = next(owg.cfg.input.make_iterator(Split.TRAIN, owg.step.tokenizer))
    owg_steps, owg_final = _steps(owg, batch, 2)
    plain_steps, plain_final = _steps(plain, batch, 2)

    def independent_grads(state):  # jax.grad of the plain model at the pre-step parameters.
        key = jax.random.fold_in(jax.random.wrap_key_data(state["prng_key"]), state["step"])
        loss = lambda p: axcore.functional(plain.step.model, p, (batch,), key, True)[0][0]  # noqa: E731
        return jax.jit(jax.grad(loss))(_strip(state["params"]))

    grads = [_leaves(independent_grads(state)) for state, _ in owg_steps]
    for g, (_, metrics), (_, plain_metrics) in zip(grads, owg_steps, plain_steps):
        # The gradient norm is that of the trainable parameters only, as without the plugin.
        np.testing.assert_allclose(metrics["grad_norm"], np.sqrt(sum(np.sum(np.square(v)) for v in g.values())),
                                   rtol=1e-5)
        np.testing.assert_allclose(metrics["grad_norm"], plain_metrics["grad_norm"], rtol=1e-5)
        np.testing.assert_allclose(metrics["loss"], plain_metrics["loss"], rtol=1e-5)
    # Both steps' weight-gradient maxima, newest first, then the initial zero.
    first, second = grads
    params = _leaves(owg_final)
    weight_of_site = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo", "dot": "weight"}
    checked = 0
    for path, value in params.items():
        if not path.endswith("/dw_amax"):
            continue
        layer, site = path.removesuffix("/dw_amax").split("/kernel_state/")
        weight = f"{layer}/{weight_of_site[site]}"
        expected = [np.abs(second[weight]).max(), np.abs(first[weight]).max(), 0.0]
        np.testing.assert_allclose(value, expected, rtol=1e-5, err_msg=path)
        checked += 1
    assert checked == 13  # 4 attention and 2 feed-forward projections in each of 2 layers, and the head.
    for path, value in params.items():  # The ordinary (forward) state path still works alongside.
        if path.endswith("/calls"):
            assert float(value) == 2.0, path
    # The trainable parameters are those of the run without the plugin: no leak into clipping or the optimizer.
    for path, value in _leaves(_strip(owg_final)).items():
        np.testing.assert_allclose(value, _leaves(plain_final)[path], rtol=1e-4, atol=1e-6, err_msg=path)


def test_overwrite_with_gradient_needs_trainable_false():
    with pytest.raises(ValueError, match="overwrite_with_gradient=True needs trainable=False"):
        ParameterSpec((3,), jnp.float32, constant(0.0), overwrite_with_gradient=True)
    spec = ParameterSpec((3,), jnp.float32, constant(0.0), trainable=False, overwrite_with_gradient=True)
    assert spec.overwrite_with_gradient and not spec.trainable
    assert not ParameterSpec((3,), jnp.float32, constant(0.0)).overwrite_with_gradient
