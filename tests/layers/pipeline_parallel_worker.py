"""The 8-device checks of tests/layers/test_pipeline_parallel.py, in one process (one JAX start-up).

Run with `XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu`. Trains the
tiny scanned decoder (8 layers) for `STEPS` steps on one device without a pipeline (the
reference) and with pipelines over several meshes (GPipe and circular; one circular run also
accumulates gradients over 2 microbatches and rematerializes every layer), all from the
reference's initial state on the same batches. A schedule a plugin object registers through
`axcore_register_pipeline_schedules` runs the forward pass on (stage 4, data 2). Then restores across a change of stage count: the
stage-4 run's final state is saved and restored on one device (no stage axis), trained
`MORE` steps there, saved, restored on the stage-4 mesh and trained `MORE` steps on both.
Prints one JSON object on the last line of stdout:

    {"runs": {name: {"losses": [...], "reference": name or null, "layer_spec": str, "log": [pipeline lines]}},
     "restore": {"to_1_equal": bool, "back_to_4_equal": bool, "spec_on_1": str, "spec_on_4": str,
                 "losses_1": [...], "losses_4": [...]},
     "plugin_schedule": {"max_abs_diff": float, "max_abs": float, "log": [plan]},
     "seconds": {name: float}}
"""

from __future__ import annotations

import io
import json
import math
import os
import shutil
import tempfile
import time

import jax
import numpy as np

from axcore.data import Split
from axcore.experiment import load_experiment
from axcore.layers import PipelineSchedule
from axcore.layers.pipeline import pipeline_plans
from axcore.markers import hookimpl
from axcore.module import functional
from axcore.placement.backend import make_checkpoint_backend
from axcore.testing import TINY_OVERRIDES
from axcore.trainer.trainer import Trainer

STEPS = 20
MORE = 2
BASE = [*TINY_OVERRIDES, "model.num_layers=8", "input.batch_size=8", f"trainer.max_steps={STEPS + 2 * MORE}",
        "trainer.learner.schedule.warmup_steps=2"]
GPIPE = ["model.decoder.pipeline={type: gpipe, microbatches: 4}"]
CIRCULAR = ["model.decoder.pipeline={type: circular, microbatches: 4, repeats: 2}"]
# Circular with gradient accumulation (2 accumulation steps of 4 rows, each 2 pipeline microbatches) and full remat.
CIRCULAR_ACCUMULATED = ["model.decoder.pipeline={type: circular, microbatches: 2, repeats: 2}", "trainer.microbatches=2",
                        "model.decoder.remat_policy=nothing_saveable"]
ONE_AT_A_TIME = ["plugins=[one_at_a_time]", "model.decoder.pipeline={type: one_at_a_time, microbatches: 2}"]


class OneAtATime(PipelineSchedule):
    """A further schedule: microbatch m enters stage 0 only after m - 1 left the last stage."""

    def table(self, num_stages):
        m = self.microbatches
        table = np.full((m * num_stages, num_stages, 2), -1, np.int32)
        for i in range(m):
            for s in range(num_stages):
                table[i * num_stages + s, s] = (i, 0)
        return table


class OneAtATimePlugin:
    @hookimpl
    def axcore_register_pipeline_schedules(self, register):
        register("one_at_a_time", OneAtATime)


def experiment(extra, shape):
    mesh = [f"mesh.mesh_shape=[{','.join(map(str, shape.values()))}]", f"mesh.mesh_axis_names=[{','.join(shape)}]"]
    return load_experiment("scan", [*BASE, *extra, *mesh], objects={"one_at_a_time": OneAtATimePlugin()})


class Run:
    """A trainer on a mesh of `shape` with its compiled step."""

    def __init__(self, extra, shape):
        self.log = io.StringIO()
        self.trainer = Trainer(experiment(extra, shape), devices=jax.devices()[: math.prod(shape.values())],
                               stream=self.log)
        # Compiled ahead as `Trainer.run` does (its log names the pipeline); the first call hits JAX's cache.
        self.step = self.trainer._compile_train_step()

    def train(self, state, batches):
        losses = []
        for batch in batches:
            state, metrics = self.step(state, jax.device_put(batch, self.trainer.step.batch_sharding))
            losses.append(metrics["loss"])
        return state, [float(x) for x in jax.device_get(losses)]

    def place(self, host_state):
        return jax.device_put(host_state, self.trainer.step.state_shardings)


def logits(trainer: Trainer, params, batch):
    """The model's float32 logits `[batch, seq, vocab]` of `batch` (forward only, jitted under the run's mesh)."""

    def fn(params, input_ids, positions, segment_ids):
        with trainer.step.op_environment():
            inputs = {"input_ids": input_ids, "positions": positions, "segment_ids": segment_ids}
            return functional(trainer.step.model, params, inputs, None, False, method="logits")[0]

    fields = [jax.device_put(batch[k], trainer.step.batch_sharding) for k in ("input_ids", "positions", "segment_ids")]
    return np.asarray(jax.jit(fn)(params, *fields))


def layer_spec(state) -> str:
    return str(state["params"]["decoder"]["layer"]["feed_forward"]["up_proj"]["weight"].sharding.spec)


def save(run: Run, state, directory: str, step: int) -> None:
    store = make_checkpoint_backend(run.trainer.cfg.trainer.checkpoint, run.trainer.experiment.registries, directory)
    try:
        store.save(step, state, {})
        store.wait()
    finally:
        store.close()


def restore(run: Run, directory: str, step: int):
    store = make_checkpoint_backend(run.trainer.cfg.trainer.checkpoint, run.trainer.experiment.registries, directory)
    try:
        return store.restore(run.trainer.step.abstract_state(), step)[0]
    finally:
        store.close()


def equal(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(jax.device_get(a)), jax.tree.leaves(b)))


def main() -> None:
    assert len(jax.devices()) == 8, jax.devices()
    cases = [
        ("single", [], {"data": 1}, None),
        ("stage4_data2_gpipe", GPIPE, {"stage": 4, "data": 2}, "single"),
        ("stage4_data2_circular", CIRCULAR, {"stage": 4, "data": 2}, "single"),
        ("stage2_fsdp2_tensor2_gpipe", GPIPE, {"stage": 2, "fsdp": 2, "tensor": 2}, "single"),
        ("stage2_fsdp2_tensor2_circular_accumulated_remat", CIRCULAR_ACCUMULATED, {"stage": 2, "fsdp": 2, "tensor": 2},
         "single"),
    ]
    runs, seconds, trained = {}, {}, {}
    single = Run([], {"data": 1})
    init = jax.device_get(single.trainer.step.init_state())
    iterator = single.trainer.cfg.input.make_iterator(Split.TRAIN, single.trainer.step.tokenizer)
    batches = [next(iterator) for _ in range(STEPS + 2 * MORE)]
    for name, extra, shape, reference in cases:
        t0 = time.perf_counter()
        run = single if name == "single" else Run(extra, shape)
        state, losses = run.train(run.place(init), batches[:STEPS])
        seconds[name] = round(time.perf_counter() - t0, 2)
        runs[name] = {"mesh": shape, "losses": losses, "reference": reference, "layer_spec": layer_spec(state),
                      "log": [line for line in run.log.getvalue().splitlines() if line.startswith("Pipeline")]}
        trained[name] = (run, state)
    # A schedule a plugin registered, forward only (a cheaper compile than a train step): the same logits.
    t0 = time.perf_counter()
    plugged = Trainer(experiment(ONE_AT_A_TIME, {"stage": 4, "data": 2}), devices=jax.devices())
    want = logits(single.trainer, single.place(init)["params"], batches[0])
    got = logits(plugged, jax.device_put(init["params"], plugged.step.state_shardings["params"]), batches[0])
    plugin = {"max_abs_diff": float(np.max(np.abs(got - want))), "max_abs": float(np.max(np.abs(want))),
              "log": [p.describe() for p in pipeline_plans(plugged.cfg.model, {"stage": 4, "data": 2})]}
    seconds["plugin_schedule"] = round(time.perf_counter() - t0, 2)
    # Restore across stage counts: 4 -> 1 -> 4 (the unsplit stacked layout in the checkpoint).
    t0 = time.perf_counter()
    four, state4 = trained["stage4_data2_gpipe"]
    root = tempfile.mkdtemp()
    try:
        saved = jax.device_get(state4)
        save(four, state4, os.path.join(root, "four"), STEPS)
        on_one = restore(single, os.path.join(root, "four"), STEPS)
        out = {"to_1_equal": equal(on_one, saved), "spec_on_1": layer_spec(on_one)}
        on_one, out["losses_1"] = single.train(on_one, batches[STEPS:STEPS + MORE])
        saved = jax.device_get(on_one)
        save(single, on_one, os.path.join(root, "one"), STEPS + MORE)
        back = restore(four, os.path.join(root, "one"), STEPS + MORE)
        out.update(back_to_4_equal=equal(back, saved), spec_on_4=layer_spec(back))
        _, out["losses_4"] = four.train(back, batches[STEPS + MORE:])
        _, out["losses_1_continued"] = single.train(single.place(saved), batches[STEPS + MORE:])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    seconds["restore"] = round(time.perf_counter() - t0, 2)
    print(json.dumps({"runs": runs, "restore": out, "plugin_schedule": plugin, "seconds": seconds}))


if __name__ == "__main__":
    main()
