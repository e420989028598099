"""`axcore compile`: lower and compile the train step ahead of time, without training."""

from __future__ import annotations

import math
import time
from typing import Any

import jax

from axcore.experiment import Experiment


def compile_report(experiment: Experiment) -> dict[str, Any]:
    """Compiles the experiment's train step on abstract inputs and reports its cost.

    Nothing is allocated for parameters: the state is described by its abstract
    shapes and shardings (from the parameter specs).
    """
    from axcore.trainer.trainer import Trainer  # Deferred: heavy imports.

    trainer = Trainer(experiment)
    cfg = experiment.config
    state = trainer.abstract_state()
    batch_shape = (cfg.input.batch_size, cfg.input.seq_len)
    batch = {
        key: jax.ShapeDtypeStruct(batch_shape, "int32", sharding=trainer.batch_sharding)
        for key in ("input_ids", "target_labels")
    }
    t0 = time.perf_counter()
    lowered = trainer.compiled_train_step().lower(state, batch)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    num_params = sum(math.prod(a.shape) for a in jax.tree.leaves(state["params"]))
    report: dict[str, Any] = {
        "experiment": experiment.source,
        "instance_type": cfg.mesh.instance_type,
        "mesh": dict(zip(cfg.mesh.mesh_axis_names, trainer.mesh.devices.shape)),
        "parameters": num_params,
        "lower_seconds": round(t1 - t0, 3),
        "compile_seconds": round(t2 - t1, 3),
    }
    cost = compiled.cost_analysis()
    if isinstance(cost, list):  # Older JAX returned one dict per device.
        cost = cost[0] if cost else {}
    if cost and "flops" in cost:
        report["flops_per_step"] = int(cost["flops"])
    memory = compiled.memory_analysis()
    if memory is not None:
        for field in ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes"):
            if hasattr(memory, field):
                report[field.replace("_size_in_bytes", "_bytes")] = int(getattr(memory, field))
    return report
