"""LoRA and QLoRA training on a scanned layer stack (`repeated_transformer`) equals the unrolled stack.

The unrolled tiny LoRA model's initial parameters (non-zero B, so the adapters act from
step 1) are stacked on a leading layer axis for the scanned model; both train 3 steps
of AdamW on one batch: the losses agree to float32 rounding and so do the trained
adapters, the frozen base (quantized bytes included) untouched in both.
"""

import jax
import numpy as np

from axcore.data import Split
from axcore.experiment import load_experiment
from axcore.testing import TINY_OVERRIDES
from axcore.trainer.resume import fresh_train_state
from axcore.trainer.step import TrainStep

SCAN = ["model.decoder.type=repeated_transformer", "model.decoder.layer.self_attention.causal=true",
        "model.decoder.layer.self_attention.num_heads=2", "model.decoder.layer.feed_forward.hidden_dim=64"]


def _stacked(params):
    """The unrolled tree with `decoder.layer{i}` stacked as `decoder.layer` (the scanned layout)."""
    layers = [params["decoder"][f"layer{i}"] for i in range(2)]
    return {**params, "decoder": {"layer": jax.tree.map(lambda *xs: np.stack(xs), *layers)}}


def _train(exp, params, batch, steps=3):
    step = TrainStep(exp)
    state = fresh_train_state(step, jax.device_put(params), 0, 0)
    train, losses = step.compiled_train_step(), []
    for _ in range(steps):
        state, metrics = train(state, batch)
        losses.append(float(metrics["loss"]))
    return losses, jax.device_get(state["params"])


def test_scanned_qlora_trains_like_the_unrolled_stack():
    """NF4 base (the float LoRA path is the same kernel with the reference dot for the base)."""
    common = [*TINY_OVERRIDES, "plugins=[lora]", "lora.rank=4", "lora.base_format=nf4",
              "trainer.learner.learning_rate=0.01", "trainer.learner.schedule.warmup_steps=0"]
    unrolled_exp, scanned_exp = load_experiment(None, common), load_experiment(None, [*common, *SCAN])
    model = unrolled_exp.config.model.instantiate(name="model", registries=unrolled_exp.registries)
    params = jax.device_get(jax.jit(model.initialize)(jax.random.key(0)))
    rng = np.random.default_rng(0)
    params = jax.tree_util.tree_map_with_path(  # B != 0: the adapters change the logits from the first step.
        lambda p, x: rng.normal(0, 0.05, x.shape).astype(x.dtype) if "lora_b" in jax.tree_util.keystr(p) else x, params)
    batch = next(unrolled_exp.config.input.make_iterator(Split.TRAIN))
    losses, trained = _train(unrolled_exp, params, batch)
    scan_losses, scan_trained = _train(scanned_exp, _stacked(params), batch)
    np.testing.assert_allclose(scan_losses, losses, rtol=2e-5)
    assert losses[-1] < losses[0]
    expected = jax.tree_util.tree_flatten_with_path(_stacked(trained))[0]
    got = dict(jax.tree_util.tree_flatten_with_path(scan_trained)[0])
    initial = dict(jax.tree_util.tree_flatten_with_path(_stacked(params))[0])
    assert len(got) == len(expected)
    for path, value in expected:
        name = jax.tree_util.keystr(path)
        if value.dtype == np.uint8 or "lora_" not in name:  # Frozen: bit-identical (and the same in both).
            np.testing.assert_array_equal(got[path], initial[path], err_msg=name)
            np.testing.assert_array_equal(value, initial[path], err_msg=name)
        else:
            assert not np.array_equal(value, initial[path]), name  # Trained.
            np.testing.assert_allclose(got[path], value, rtol=1e-4, atol=1e-6, err_msg=name)
