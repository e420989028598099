"""The checks of tests/checkpoint/test_restore_across_meshes.py, in one process with 8 CPU devices.

Run with `XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu` and the
checkpoint backend's name as the argument. `Trainer.run` trains the tiny decoder 4 steps
on a (data=2, fsdp=2, tensor=2) mesh and checkpoints; then the run directory is resumed
by trainers on 1 device and on a (fsdp=4, tensor=2) mesh, each restoring the step-4 state
into its own shardings and training 2 more steps. Prints one JSON object on the last line:

    {"restored_equal": {"1": bool, "fsdp4_tensor2": bool},
     "restored_shardings": {"1": [...], "fsdp4_tensor2": [...]},
     "losses": {"1": [l5, l6], "fsdp4_tensor2": [l5, l6]}}
"""

from __future__ import annotations

import io
import json
import math
import os
import shutil
import sys
import tempfile

import jax
import numpy as np

from axcore.experiment import load_experiment
from axcore.placement.backend import make_checkpoint_backend
from axcore.testing import TINY_OVERRIDES
from axcore.trainer.trainer import Trainer

MESHES = {"2x2x2": {"data": 2, "fsdp": 2, "tensor": 2}, "1": {"data": 1}, "fsdp4_tensor2": {"fsdp": 4, "tensor": 2}}


def trainer(run_dir: str, backend: str, mesh: dict[str, int], steps: int) -> Trainer:
    overrides = [
        *TINY_OVERRIDES,
        f"trainer.run_dir={run_dir}",
        f"trainer.max_steps={steps}",
        "trainer.log_every=1",
        "trainer.eval_every=0",
        "trainer.checkpoint.every_n_steps=4",
        f"trainer.checkpoint.backend={backend}",
        "trainer.sample.num_tokens=0",
        f"mesh.mesh_shape=[{','.join(map(str, mesh.values()))}]",
        f"mesh.mesh_axis_names=[{','.join(mesh)}]",
    ]
    devices = jax.devices()[: math.prod(mesh.values())]
    return Trainer(load_experiment(None, overrides), devices=devices, stream=io.StringIO(), out=io.StringIO())


def restored(run: Trainer, backend: str, step: int):
    """The state of checkpoint `step` restored into `run`'s shardings."""
    store = make_checkpoint_backend(run.cfg.trainer.checkpoint, run.experiment.registries, run.run_dir / "checkpoints")
    try:
        state, _ = store.restore(run.step.abstract_state(), step)
    finally:
        store.close()
    return state


def main() -> None:
    backend = sys.argv[1]
    root = tempfile.mkdtemp()
    try:
        source = os.path.join(root, "source")
        first = trainer(source, backend, MESHES["2x2x2"], 4)
        first.run()
        saved = jax.device_get(restored(first, backend, 4)["params"])
        out = {"restored_equal": {}, "restored_shardings": {}, "losses": {}}
        for name in ("1", "fsdp4_tensor2"):
            run_dir = os.path.join(root, name)
            shutil.copytree(source, run_dir)
            run = trainer(run_dir, backend, MESHES[name], 6)
            state = restored(run, backend, 4)
            host = jax.device_get(state["params"])
            out["restored_equal"][name] = all(
                np.array_equal(a, b) for a, b in zip(jax.tree.leaves(host), jax.tree.leaves(saved))
            )
            out["restored_shardings"][name] = sorted(
                {str(leaf.sharding.spec) for leaf in jax.tree.leaves(state["params"])}
            )
            run.run()  # Resumes from step 4 on this mesh.
            records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
            out["losses"][name] = [r["train/loss"] for r in records if r["step"] > 4]
        print(json.dumps(out))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
