"""The training loop end to end on a tiny model: artifacts, fetch cadence, resume, non-finite loss,
kernel state, mixed precision."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

import axcore
from axcore.checkpoint import CheckpointNotFoundError  # noqa: F401  (the backend's error types exist)
from axcore.experiment import load_experiment
from axcore.kernels import SUPPORTED, reference_dot
from axcore.observe import read_jsonl_metrics
from axcore.params import ParameterSpec, constant
from axcore.testing import TINY_OVERRIDES
from axcore.trainer.trainer import NonFiniteLossError, Trainer

TINY = [*TINY_OVERRIDES, "trainer.eval_batches=2", "trainer.sample.num_tokens=8", "trainer.learner.schedule.warmup_steps=2"]


def _run(run_dir, *extra, stream=None, objects=None):
    exp = load_experiment(None, [*TINY, f"trainer.run_dir={run_dir}", *extra], objects=objects)
    return Trainer(exp, stream=stream).run()


def _restore(run_dir, backend, *extra, objects=None):
    exp = load_experiment(
        None, [*TINY, f"trainer.run_dir={run_dir}", f"trainer.checkpoint.backend={backend}", *extra], objects=objects
    )
    trainer = Trainer(exp)
    store = exp.registries.checkpoint_backends[backend](run_dir / "checkpoints")
    state, metadata = store.restore(trainer.step.abstract_state())
    store.close()
    return jax.device_get(state), metadata


def _params(run_dir, backend, *extra):
    state, metadata = _restore(run_dir, backend, *extra)
    return state["params"], metadata


def test_training_writes_every_artifact_and_loss_falls(tmp_path, capsys):
    run = tmp_path / "run"
    result = _run(run, "trainer.max_steps=30", "trainer.eval_every=15", "trainer.checkpoint.every_n_steps=10",
                  "trainer.log_every=2")
    assert result.step == 30
    records = read_jsonl_metrics(run / "metrics.jsonl")
    # One record per fetch: every log_every steps (eval and checkpoint steps are among them here).
    assert [r["step"] for r in records] == sorted({*range(2, 31, 2), 15})
    losses = [r["train/loss"] for r in records]
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.3
    evals = [(r["step"], r["eval/loss"]) for r in records if "eval/loss" in r]
    assert [s for s, _ in evals] == [15, 30] and result.eval_loss == pytest.approx(evals[-1][1])
    assert result.train_loss == pytest.approx(records[-1]["train/loss"])
    assert {"train/grad_norm", "train/learning_rate", "train/tokens_per_sec", "train/step_time",
            "train/aux_loss"} <= set(records[-1])
    for record in records:  # tokens/s is the tokens of a step over the average step time of the interval.
        assert record["train/tokens_per_sec"] == pytest.approx(4 * 32 / record["train/step_time"])
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert (run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["model"]["dim"] == 32 and saved["trainer"]["max_steps"] == 30
    assert "model.dim: 32" in (run / "config.txt").read_text()
    assert result.sample.startswith("The ") and len(result.sample.encode()) >= 4 + 8 - 3
    captured = capsys.readouterr()
    assert "Sample:" in captured.out
    # Each phase of seconds says what it does before it starts (no silence after the compile line), in order.
    phases = ["Compiled the train step", "Opening the metrics writers (2)...", "Initialising the parameters...",
              "Input: process 0 reads", "step 2/30", "Waiting for the checkpoint writes...", "Input: process 0 read ",
              "Sampling 8 tokens from the trained model..."]
    positions = [captured.err.find(phase) for phase in phases]
    assert -1 not in positions and positions == sorted(positions), captured.err
    # The eval loss is on the console with the tokens it covers (2 batches of 4 x 32, padding excluded).
    for step, loss in evals:
        tokens = next(r["eval/tokens"] for r in records if r["step"] == step)
        assert 0 < tokens <= 2 * 4 * 32
        assert f"eval at step {step}: held-out loss {loss:.4f} over {int(tokens):,} tokens (2 batches)" in captured.err
    # The time the loop waited for data, per step and as a share of the step time.
    for record in records:
        assert 0 <= record["train/data_wait"] <= record["train/step_time"]
        assert record["train/data_wait_fraction"] == pytest.approx(record["train/data_wait"] / record["train/step_time"])
    _, metadata = _params(run, "orbax")
    # One process, one data shard: the checkpoint holds its pipeline state under "input".
    assert metadata["step"] == 30 and metadata["input"]["num_shards"] == 1 and list(metadata["input"]["shards"]) == ["0"]


def test_metrics_are_fetched_only_at_log_eval_checkpoint_and_last_steps(tmp_path):
    run = tmp_path / "run"
    _run(run, "trainer.max_steps=13", "trainer.log_every=5", "trainer.eval_every=7",
         "trainer.checkpoint.every_n_steps=4", "trainer.sample.num_tokens=0", "trainer.metrics_writers=[{type: jsonl}]")
    steps = [r["step"] for r in read_jsonl_metrics(run / "metrics.jsonl")]
    assert steps == [4, 5, 7, 8, 10, 12, 13]
    assert not (run / "tensorboard").exists()  # Only the writers listed are built.


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["orbax", "tensorstore"])
def test_resume_is_bit_identical(tmp_path, backend):
    common = [f"trainer.checkpoint.backend={backend}", "trainer.eval_every=0", "trainer.sample.num_tokens=0",
              "trainer.checkpoint.every_n_steps=20", "model.decoder.layer.dropout_rate=0.1",
              "trainer.learner.schedule.total_steps=40"]  # The same schedule whether the run stops at 20 or 40.
    straight, split = tmp_path / "straight", tmp_path / "split"
    _run(straight, "trainer.max_steps=40", *common)
    _run(split, "trainer.max_steps=20", *common)
    resumed = _run(split, "trainer.max_steps=40", *common)
    assert resumed.step == 40
    a, meta_a = _params(straight, backend)
    b, meta_b = _params(split, backend)
    assert meta_a == meta_b
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y)
    steps = [r["step"] for r in read_jsonl_metrics(split / "metrics.jsonl")]
    assert steps == list(range(10, 41, 10))  # The resumed run continued the same log.


# The largest peak a config accepts (10), with plain SGD and no clipping: NaN at step 8 of the tiny model.
DIVERGING = ["trainer.learner.learning_rate=10", "trainer.learner.optimizer={type: sgd}",
             "trainer.learner.max_grad_norm=null", "trainer.learner.schedule.warmup_steps=0", "trainer.eval_every=0"]


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
    run = tmp_path / "run"
    with pytest.raises(NonFiniteLossError, match=r"diverged at step (\d+).*last good checkpoint is step") as info:
        _run(run, "trainer.max_steps=50", *DIVERGING, "trainer.checkpoint.every_n_steps=1")
    bad_step = int(re.search(r"at step (\d+)", str(info.value)).group(1))
    params, metadata = _params(run, "orbax", *DIVERGING)
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(params))
    assert metadata["step"] == bad_step - 1


def test_divergence_between_fetches_names_its_step_and_saves_nothing_after_it(tmp_path):
    run = tmp_path / "run"
    with pytest.raises(NonFiniteLossError, match=r"diverged at step (\d+)") as info:
        _run(run, "trainer.max_steps=50", *DIVERGING, "trainer.log_every=50", "trainer.checkpoint.every_n_steps=25")
    bad_step = int(re.search(r"at step (\d+)", str(info.value)).group(1))
    assert 1 < bad_step < 25  # Found among the steps since the last fetch, not at the fetch itself.
    assert "No checkpoint was saved before it" in str(info.value)  # The state at step 25 was not saved.


class SpyDot:
    """A stateful `dot` kernel: counts its calls in non-trainable state and records the mesh it sees."""

    name = "spy_dot"
    priority = 100

    def __init__(self):
        self.meshes = []

    def is_supported(self, problem):
        return SUPPORTED

    def state_specs(self, problem):
        return {
            # Updated by the kernel every call.
            "calls": ParameterSpec((), jnp.float32, constant(0.0), trainable=False),
            # Never updated, but used in the forward and declared with weight decay: the optimizer must not touch it.
            "gain": ParameterSpec((), jnp.float32, constant(2.0), weight_decay_scale=1.0, trainable=False),
        }

    def __call__(self, problem, x, w, *, state):
        self.meshes.append(problem.mesh)
        y = reference_dot(problem, x, w)
        return y * (state["gain"] / 2.0).astype(y.dtype), {"calls": state["calls"] + 1.0}


class SpyPlugin:
    def __init__(self):
        self.kernel = SpyDot()

    @axcore.hookimpl
    def axcore_register_kernels(self, register):
        register("dot", self.kernel)


def _leaves_with_path(tree):
    """[("a/b/c", leaf), ...] of a nested dict."""
    return [
        ("/".join(str(getattr(k, "key", k)) for k in path), leaf)
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
    ]


def test_kernel_state_comes_from_state_updates_and_checkpoints_are_float32_under_bfloat16(tmp_path):
    run, spy = tmp_path / "run", SpyPlugin()
    extra = ["plugins=[spy]", "model.compute_dtype=bfloat16"]
    _run(run, *extra, "trainer.max_steps=3", "trainer.eval_every=0", "trainer.sample.num_tokens=0",
         objects={"spy": spy})
    state, _ = _restore(run, "orbax", *extra, objects={"spy": SpyPlugin()})
    kernel_state = [(p, x) for p, x in _leaves_with_path(state["params"]) if "kernel_state" in p]
    assert kernel_state, "the spy kernel's state is among the parameters"
    calls = {path: float(value) for path, value in kernel_state if path.endswith("calls")}
    # One forward per step, no optimizer update (a declared site the forward never uses, like the
    # embedding's `attend` of an untied head, keeps its initial 0).
    assert set(calls.values()) <= {0.0, 3.0} and calls["decoder/layer0/self_attention/kernel_state/q_proj/calls"] == 3.0
    assert calls["lm_head/kernel_state/dot/calls"] == 3.0
    for path, value in kernel_state:
        if path.endswith("gain"):
            np.testing.assert_array_equal(value, 2.0, err_msg=path)  # Untouched: no gradient, no weight decay.
    # Float32 master weights and optimizer state, although the model computes in bfloat16.
    for path, value in _leaves_with_path({"params": state["params"], "opt_state": state["opt_state"]}):
        if jnp.issubdtype(value.dtype, jnp.floating):
            assert value.dtype == np.float32, path
    # Kernels were traced inside op_environment: they saw the trainer's mesh.
    assert spy.kernel.meshes and all(m is not None and m.axis_names == ("data",) for m in spy.kernel.meshes)
