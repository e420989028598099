"""The 8-device checks of tests/trainer/test_multi_device.py, in one process (one JAX start-up, one compile per mesh).

Run with `XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu`. Trains the
tiny default decoder (axcore.testing.TINY_OVERRIDES) for `STEPS` steps with the Trainer's own shardings
and jitted step on several meshes, and on one device (same seed, same batches), and
checks the train state's layout on a (data=2, fsdp=2, tensor=2) mesh. Prints one JSON
object on the last line of stdout:

    {"runs": {name: {"mesh": {...}, "losses": [...], "reference": name or null}},
     "layout": {"param_mismatches": [...], "opt_mismatches": [...], "opt_like_params": int, ...},
     "seconds": {name: float}}

The expected PartitionSpecs are computed here from each parameter's logical axes with
a table of the default rules written out independently of `axcore.platform.sharding`.
"""

from __future__ import annotations

import json
import math
import time

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from axcore.cli.shardings import sharding_report
from axcore.data import Split
from axcore.experiment import load_experiment
from axcore.params import ParameterSpec
from axcore.platform.sharding import path_name
from axcore.testing import TINY_OVERRIDES
from axcore.trainer.trainer import Trainer

STEPS = 20
BASE = [*TINY_OVERRIDES, f"trainer.max_steps={STEPS}", "trainer.learner.schedule.warmup_steps=2"]
MOE = ["plugins=[moe]", "moe.num_experts=4"]

# Logical axis -> mesh axes of the default rules on a mesh that has every axis (written out independently).
EXPECTED_RULES = {
    "batch": ("data", "fsdp"), "embed": ("fsdp",), "heads": ("tensor",), "kv_heads": ("tensor",),
    "mlp": ("tensor",), "vocab": ("tensor",), "expert": ("expert",), "seq": ("sequence",),
}


def mesh_overrides(shape: dict[str, int]) -> list[str]:
    return [f"mesh.mesh_shape=[{','.join(map(str, shape.values()))}]", f"mesh.mesh_axis_names=[{','.join(shape)}]"]


def train(extra: list[str], shape: dict[str, int], initial: dict | None = None):
    """(trainer, initial state on the host, final state, losses) of STEPS steps on a mesh of `shape`.

    `initial` (a host copy of the reference run's initial state) is placed with the
    trainer's state shardings instead of compiling `init_state` again for each mesh
    (the slowest compile here); without it, `init_state` runs.
    """
    exp = load_experiment(None, [*BASE, *extra, *mesh_overrides(shape)])
    devices = jax.devices()[: math.prod(shape.values())]
    trainer = Trainer(exp, devices=devices)
    state = trainer.step.init_state() if initial is None else jax.device_put(initial, trainer.step.state_shardings)
    init = jax.device_get(state)  # Before the first step donates it.
    step = trainer.step.compiled_train_step()
    batches = exp.config.input.make_iterator(Split.TRAIN, trainer.step.tokenizer)
    losses = []
    for _ in range(STEPS):
        state, metrics = step(state, jax.device_put(next(batches), trainer.step.batch_sharding))
        losses.append(metrics["loss"])
    return trainer, init, state, [float(x) for x in jax.device_get(losses)]


def expected_spec(spec: ParameterSpec, mesh_names) -> P:
    if spec.mesh_axes is None:
        return P()
    entries = []
    for logical in spec.mesh_axes:
        names = tuple(n for n in EXPECTED_RULES.get(logical, ()) if n in mesh_names)
        entries.append(None if not names else names[0] if len(names) == 1 else names)
    return P(*entries)


def _key(path) -> str:
    return jax.tree_util.keystr(path)


def check_layout(trainer: Trainer, state: dict) -> dict:
    """Parameters, optimizer state and batch of a trained state vs. the rules; per-device bytes."""
    mesh = trainer.step.mesh
    specs = trainer.step.model.parameter_specs()
    flat_specs = jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, ParameterSpec))[0]
    params = dict((_key(p), leaf) for p, leaf in jax.tree_util.tree_flatten_with_path(state["params"])[0])
    expected = {}
    param_mismatches = []
    for path, spec in flat_specs:
        key = _key(path)
        want = NamedSharding(mesh, expected_spec(spec, mesh.axis_names))
        expected[key] = (want, spec.shape)
        got = params[key].sharding
        if not got.is_equivalent_to(want, len(spec.shape)):
            param_mismatches.append(f"{key}: {got.spec} != {want.spec}")
    # Optimizer state: a leaf whose path ends with a parameter's path and has its shape is sharded like it.
    opt_mismatches, like_params, other = [], 0, []
    replicated = NamedSharding(mesh, P())
    for path, leaf in jax.tree_util.tree_flatten_with_path(state["opt_state"])[0]:
        key = _key(path)
        match = next((k for k in expected if key.endswith(k) and expected[k][1] == leaf.shape), None)
        want = expected[match][0] if match else replicated
        like_params += match is not None
        if match is None:
            other.append(f"{key} {list(leaf.shape)}")
        if not leaf.sharding.is_equivalent_to(want, leaf.ndim):
            opt_mismatches.append(f"{key}: {leaf.sharding.spec} != {want.spec}")
    # Bytes: per device (device 0's shards) vs. one device holding everything.
    leaves = jax.tree.leaves(state)
    total = sum(x.nbytes for x in leaves)
    per_device = sum(x.addressable_shards[0].data.nbytes for x in leaves)
    replicated_bytes = sum(x.nbytes for x in leaves if x.sharding.is_fully_replicated)
    # The learned position table [max_len, dim] has no logical axis on max_len: embed -> fsdp splits it 2 ways.
    position = [x for k, x in params.items() if "position_embedding" in k]
    position_extra = 3 * sum(x.nbytes // 2 - x.nbytes // 4 for x in position)  # params, Adam's mu and nu.
    # The batch: split over data and fsdp, the same rows on the tensor axis.
    batch = jax.device_put(next(trainer.cfg.input.make_iterator(Split.TRAIN, trainer.step.tokenizer)), trainer.step.batch_sharding)
    ids = batch["input_ids"]
    rows = {}
    for shard in ids.addressable_shards:
        coords = {n: int(np.argwhere(mesh.devices == shard.device)[0][i]) for i, n in enumerate(mesh.axis_names)}
        rows[(coords["data"], coords["fsdp"], coords["tensor"])] = (shard.index[0].start, shard.index[0].stop)
    batch_ok = all(rows[(d, f, 0)] == rows[(d, f, 1)] for d in range(2) for f in range(2)) and len(
        {rows[(d, f, 0)] for d in range(2) for f in range(2)}
    ) == 4
    # The dump (`axcore config --shardings`, abstract mesh) says what the trainer did.
    report = sharding_report(trainer.experiment)
    actual = {path_name(p, "model"): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(state["params"])[0]}
    report_mismatches = [
        f"{row.path}: dump {row.spec} vs {actual[row.path].sharding.spec}"
        for row in report.params
        if not actual[row.path].sharding.is_equivalent_to(NamedSharding(mesh, row.spec), len(row.shape))
    ]
    report_bytes = sum(r.per_device_nbytes for r in report.params + report.opt_like_params + report.opt_other)
    return {
        "report_mismatches": report_mismatches,
        "report_rows": len(report.params),
        "report_state_bytes_per_device": report_bytes,
        "param_mismatches": param_mismatches,
        "opt_mismatches": opt_mismatches,
        "num_params": len(flat_specs),
        "opt_like_params": like_params,
        "opt_other": other,
        "total_bytes": total,
        "per_device_bytes": per_device,
        "replicated_bytes": replicated_bytes,
        "position_extra_bytes": position_extra,
        "batch_spec": str(ids.sharding.spec),
        "batch_shard_shape": list(ids.addressable_shards[0].data.shape),
        "batch_rows_by_coords_ok": batch_ok,
    }


def main() -> None:
    assert len(jax.devices()) == 8, jax.devices()
    runs, seconds, layout = {}, {}, None
    cases = [
        ("single", [], {"data": 1}, None),
        ("data2_fsdp2_tensor2", [], {"data": 2, "fsdp": 2, "tensor": 2}, "single"),
        ("fsdp2_sequence4", [], {"fsdp": 2, "sequence": 4}, "single"),
        # The loss in 4 chunks of 8 positions, each spread over the sequence shards; against the unchunked loss.
        ("fsdp2_sequence4_chunked_loss", ["model.loss_chunk_len=8"], {"fsdp": 2, "sequence": 4}, "single"),
        ("moe_single", MOE, {"data": 1}, None),
        ("moe_data2_fsdp2_expert2", MOE, {"data": 2, "fsdp": 2, "expert": 2}, "moe_single"),
        # A rule naming its own batch axes: the batch also split over the expert axis (GShard-style).
        ("moe_batch_over_data_expert", [*MOE, "mesh.axis_rules={batch: [data, expert]}"],
         {"data": 2, "expert": 2, "tensor": 2}, "moe_single"),
    ]
    inits = {}
    for name, extra, shape, reference in cases:
        t0 = time.perf_counter()
        trainer, init, state, losses = train(extra, shape, inits.get(reference))
        seconds[name] = round(time.perf_counter() - t0, 2)
        inits[name] = init
        runs[name] = {"mesh": shape, "losses": losses, "reference": reference}
        if name == "data2_fsdp2_tensor2":
            layout = check_layout(trainer, state)
        del state
    print(json.dumps({"runs": runs, "layout": layout, "seconds": seconds}))


if __name__ == "__main__":
    main()
