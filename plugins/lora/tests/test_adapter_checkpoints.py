"""Adapter-only checkpoints (`axcore lora init --adapters-only`, `lora.checkpoint: adapters`) on the tiny model.

A float base run (the tiny model's parameters, as an import would be) gets fresh adapters;
the LoRA run's checkpoints then hold the adapters and the optimizer state only, the
frozen parameters come back from the base run (float) or from the quantized copy
`OUT/base` (QLoRA, nf4), and a run restored from step 3 continues bit for bit like the
one that never stopped.
"""

import jax
import numpy as np
import pytest

from axcore.checkpoint.plugin import BACKENDS
from axcore.cli import main
from axcore.data import Split
from axcore.experiment import load_experiment
from axcore.inference.run_loading import save_model
from axcore.placement.backend import make_checkpoint_backend
from axcore.testing import TINY_OVERRIDES
from axcore.trainer.resume import restore_train_state
from axcore.trainer.step import TrainStep

from axcore_lora import LoraConfigError


def _flat(tree):
    return {jax.tree_util.keystr(p, simple=True, separator="/"): np.asarray(v)
            for p, v in jax.tree_util.tree_flatten_with_path(jax.device_get(tree))[0]}


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    exp = load_experiment(None, [*TINY_OVERRIDES, f"trainer.run_dir={root / 'base'}"])
    model = exp.config.model.instantiate(name="model", registries=exp.registries)
    save_model(exp, jax.jit(model.initialize)(jax.random.key(7)), root / "base")
    return root


def test_a_float_base_is_read_back_from_the_base_run(base_run):
    """`lora init --adapters-only` (float base): step 0 holds the adapters only; restored, the frozen
    parameters are the base run's, bit for bit."""
    run = base_run / "lora_float"
    assert main(["lora", "init", str(base_run / "base"), str(run), "--rank", "4", "--adapters-only"]) == 0
    exp = load_experiment(run / "config.yaml")
    assert exp.config.trainer.checkpoint.backend_settings["base_run"] == str(base_run / "base")
    plain = BACKENDS["orbax"](base_run / "base" / "checkpoints")
    base_exp = load_experiment(base_run / "base" / "config.yaml")
    base = _flat(plain.restore({"params": TrainStep(base_exp).abstract_state()["params"]}, partial=True)[0]["params"])
    plain.close()
    backend = make_checkpoint_backend(exp.config.trainer.checkpoint, exp.registries, run / "checkpoints")
    restored, metadata = backend.restore({"params": TrainStep(exp).abstract_state()["params"]}, partial=True)
    backend.close()
    assert metadata["lora_adapters_only"]
    params = _flat(restored["params"])
    assert sorted(k for k in params if "/lora_" not in k) == sorted(base)
    for name, value in base.items():
        np.testing.assert_array_equal(params[name], value, err_msg=name)
    assert sum("/lora_b" in k and not v.any() for k, v in params.items()) == 12  # Fresh B = 0 at 12 sites.


def test_checkpoints_hold_the_adapters_only_and_resume_exactly(base_run):
    """QLoRA (nf4): the quantized base goes to OUT/base once; step 3 holds the adapters only and resumes bit for bit."""
    fmt = "nf4"
    run = base_run / f"lora_{fmt}"
    assert main(["lora", "init", str(base_run / "base"), str(run), "--rank", "4", "--base-format", fmt,
                 "--adapters-only"]) == 0
    exp = load_experiment(run / "config.yaml", ["trainer.learner.learning_rate=0.01",
                                                "trainer.learner.schedule.warmup_steps=0"])
    settings = exp.config.trainer.checkpoint.backend_settings
    assert exp.config.trainer.checkpoint.backend == "lora_adapters"
    assert settings["base_run"] == str(run / "base")
    step = TrainStep(exp)
    backend = make_checkpoint_backend(exp.config.trainer.checkpoint, exp.registries, run / "checkpoints")
    state, _, params_only = restore_train_state(step, backend, None, lambda line: None)
    assert params_only  # lora init wrote step 0: adapters only, parameters only.

    initial = _flat(state["params"])
    stored = {k for k, v in initial.items() if v.dtype == np.uint8}
    assert len(stored) == 12  # Six targeted weights in each of two layers.

    train = step.compiled_train_step()
    batch = next(exp.config.input.make_iterator(Split.TRAIN))
    for _ in range(3):
        state, _ = train(state, batch)
    backend.save(3, state, {"step": 3, "input": None})
    backend.wait()
    saved = _flat(state)

    # On disk (read by the plain backend): params are exactly the 24 adapters (A and B at 6 sites x 2 layers).
    plain = BACKENDS["orbax"](run / "checkpoints")
    adapters = _nested(saved, "params/")
    on_disk = plain.restore({"params": jax.tree.map(jax.numpy.asarray, adapters)}, 3, partial=True)[0]["params"]
    plain.close()
    assert len(_flat(on_disk)) == 24
    for name, value in _flat(on_disk).items():
        np.testing.assert_array_equal(value, saved[f"params/{name}"], err_msg=name)

    restored, metadata, params_only = restore_train_state(step, backend, None, lambda line: None)
    assert not params_only and metadata["lora_adapters_only"] and int(restored["step"]) == 3
    for name, value in _flat(restored).items():
        np.testing.assert_array_equal(value, saved[name], err_msg=name)
    for name in initial:
        if "/lora_" not in name:  # The frozen base came back from the base run, as it was.
            np.testing.assert_array_equal(saved[f"params/{name}"], initial[name], err_msg=name)
    a, b = restored, state
    for _ in range(2):
        a, metrics_a = train(a, batch)
        b, metrics_b = train(b, batch)
        assert float(metrics_a["loss"]) == float(metrics_b["loss"])
    for name, value in _flat(a).items():
        np.testing.assert_array_equal(value, _flat(b)[name], err_msg=name)
    backend.close()


def _nested(flat, prefix):
    out = {}
    for key, value in flat.items():
        if not key.startswith(prefix) or "/lora_" not in key:
            continue
        node = out
        *parents, leaf = key.removeprefix(prefix).split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def test_adapters_only_needs_a_base_run():
    with pytest.raises(LoraConfigError, match=r"'lora\.checkpoint' is adapters but 'lora\.base_run' is not set"):
        load_experiment(None, [*TINY_OVERRIDES, "plugins=[lora]", "lora.checkpoint=adapters"])
