"""Checkpoint blocking time: how long `save()` holds the training thread (issue 21).

State: an AdamW-like train state of a small transformer, all float32 on the first
local device: `params` (a d=768, 12-layer decoder: a 32000x768 embedding, per layer
four 768x768 attention projections, a 768x3072 + 3072x768 FFN and two norm scales,
and a final norm; 109.9M values) plus `opt_state` {`mu`, `nu`} of the same shapes
and an int32 `step`: 329.8M values, 1.32 GB, 295 leaves. Values are random.
Smoke mode: d=64, 2 layers, a 512-word vocabulary (~0.3 MB, 55 leaves).

Contenders, each one object kept for the whole run (as a trainer keeps its
backend), saving step 1, 2, 3, ... with `keep_last_n=2` (orbax: `max_to_keep=2`),
alternated round by round (the order below, rotated by one each round):

- `orbax_raw`, the reference: orbax's own `CheckpointManager` with the options
  axcore's backend uses (async, commit-file atomicity, no compression) saving what a
  trainer must save, without checksums: the arrays and the metadata as orbax's JSON
  item (`Composite(state=PyTreeSave(state), meta=JsonSave(metadata))`).
- `orbax_arrays_only`: the same manager saving only the arrays (one item fewer; for
  scale, no target).
- `orbax`, `tensorstore`: axcore's backends through `axcore.checkpoint.plugin`
  (`factory(dir, keep_last_n=2, async_save=True)`), which also write the tree index
  and the checksums of every saved shard.

Before each save `os.sync()` writes back the previous one's dirty pages (untimed),
as the minutes of training between two saves would. Per save: *blocking* = the time
`save()` takes to return (on this machine the
"device" is the CPU, so that is all the training thread waits for; the device work
a save dispatches runs afterwards); *committed* = `save()` + `wait()`, until the
step's commit marker is written. Each contender's first save is a warm-up, reported
apart (`first_save_blocking_s`: it includes one-time costs such as compiling the
checksum program) and not in the medians. Ratios are per round, contender / raw.
After the last round both axcore backends restore their latest step, which must
verify and equal the state (every byte checksummed again).
Target: blocking within 10% of raw orbax's (median of per-round ratios <= 1.10).
"""

from __future__ import annotations

import os
import pathlib
import shutil
import sys
import tempfile
import time
from typing import Any

if __package__ in (None, ""):
    sys.path.append(str(pathlib.Path(__file__).resolve().parent.parent))

from benchmarks.common import adamw_like_state, decoder_param_shapes, pairwise_ratio, summarize, write_result

NAME = "checkpoint_blocking"
CONTENDERS = ("orbax_raw", "orbax_arrays_only", "orbax", "tensorstore")
AXCORE = ("orbax", "tensorstore")
BLOCKING_RATIO_TARGET = 1.10


def param_shapes(smoke: bool) -> dict[str, tuple[int, ...]]:
    """Parameter shapes of the benchmark state (see the module docstring)."""
    return decoder_param_shapes(*((64, 512, 2) if smoke else (768, 32000, 12)))


def make_state(smoke: bool, seed: int = 0) -> dict[str, Any]:
    """params + mu + nu (float32, random) and an int32 step, on the first local device."""
    return adamw_like_state(param_shapes(smoke), seed)


class RawOrbax:
    """orbax's CheckpointManager with axcore's orbax options: the arrays and (`with_metadata`) a JSON item."""

    def __init__(self, directory: str, keep_last_n: int, with_metadata: bool = True):
        import orbax.checkpoint as ocp
        from orbax.checkpoint import options as ocp_options

        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep_last_n,
            enable_async_checkpointing=True,
            create=True,
            atomicity_options=ocp_options.AtomicityOptions(mode=ocp_options.AtomicityMode.COMMIT_FILE),
        )
        handlers = {"state": ocp.PyTreeCheckpointHandler(use_compression=False)}
        if with_metadata:
            handlers["meta"] = ocp.JsonCheckpointHandler()
        self._with_metadata = with_metadata
        self._ocp = ocp
        self._manager = ocp.CheckpointManager(directory, options=options, item_handlers=handlers)

    def save(self, step: int, state: Any, metadata: dict) -> None:
        items = {"state": self._ocp.args.PyTreeSave(state)}
        if self._with_metadata:
            items["meta"] = self._ocp.args.JsonSave(metadata)
        self._manager.save(step, args=self._ocp.args.Composite(**items), force=True)

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self.wait()
        self._manager.close()


def run(smoke: bool = False, results_dir: pathlib.Path | None = None, *, rounds: int | None = None) -> dict[str, Any]:
    """Alternates the contenders' saves; writes checkpoint_blocking.json."""
    import jax
    import numpy as np

    import axcore
    from axcore.checkpoint.plugin import BACKENDS

    rounds = rounds or (2 if smoke else 7)
    state = make_state(smoke)
    leaves = jax.tree.leaves(state)
    nbytes = sum(x.nbytes for x in leaves)
    root = tempfile.mkdtemp(prefix="axcore-ckpt-blocking-")
    backends: dict[str, Any] = {}
    blocking: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    committed: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    first: dict[str, float] = {}
    verified: dict[str, bool] = {}
    try:
        for name in CONTENDERS:
            directory = os.path.join(root, name)
            if name in AXCORE:
                backends[name] = BACKENDS[name](directory, keep_last_n=2)
            else:
                backends[name] = RawOrbax(directory, 2, with_metadata=name == "orbax_raw")

        def save(name: str, step: int) -> tuple[float, float]:
            backend = backends[name]
            os.sync()  # The previous save's dirty pages written back first, as between two saves in training.
            t0 = time.perf_counter()
            backend.save(step, state, {"input": {"position": step}, "step": step})
            t1 = time.perf_counter()
            backend.wait()
            return t1 - t0, time.perf_counter() - t0

        for name in CONTENDERS:  # Warm-up: imports, thread pools, the checksum program's compile.
            first[name] = save(name, 1)[0]
        for step in range(2, rounds + 2):
            shift = step % len(CONTENDERS)  # Rotated: no contender always follows the same one.
            for name in CONTENDERS[shift:] + CONTENDERS[:shift]:
                b, c = save(name, step)
                blocking[name].append(b)
                committed[name].append(c)
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
        for name in AXCORE:
            restored, metadata = backends[name].restore(target)
            verified[name] = metadata == {"input": {"position": rounds + 1}, "step": rounds + 1} and all(
                np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(jax.tree.leaves(restored), leaves)
            )
            del restored
    finally:
        for backend in backends.values():
            backend.close()
        shutil.rmtree(root, ignore_errors=True)

    results = {
        name: {"blocking_s": summarize(blocking[name]), "committed_s": summarize(committed[name]), "first_save_blocking_s": first[name]}
        for name in CONTENDERS
    }
    ratios = {
        f"{name}/blocking_vs_orbax_raw": pairwise_ratio(blocking[name], blocking["orbax_raw"]) for name in CONTENDERS[1:]
    }
    ratios.update(
        {f"{name}/committed_vs_orbax_raw": pairwise_ratio(committed[name], committed["orbax_raw"]) for name in CONTENDERS[1:]}
    )
    targets = {
        f"{name}/blocking_vs_orbax_raw": {
            "target": f"<= {BLOCKING_RATIO_TARGET}",
            "value": ratios[f"{name}/blocking_vs_orbax_raw"]["median"],
            "met": ratios[f"{name}/blocking_vs_orbax_raw"]["median"] <= BLOCKING_RATIO_TARGET,
            "metric": "median over rounds of save() time / raw orbax save() time",
        }
        for name in AXCORE
    }
    targets["restored_state_verifies"] = {"target": "True", "value": all(verified.values()), "met": all(verified.values())}
    data = {
        "smoke": smoke,
        "setup": {
            "state": "AdamW-like train state: params + mu + nu of a "
            f"d={param_shapes(smoke)['final_norm'][0]} decoder, float32, plus an int32 step",
            "values": int(sum(x.size for x in leaves)),
            "bytes": int(nbytes),
            "leaves": len(leaves),
            "rounds": rounds,
            "order": "one warm-up save each, then per round (rotated by one each round): "
            + ", ".join(CONTENDERS) + " (os.sync, then save + wait)",
            "directory": os.path.dirname(root),
            "axcore": os.path.dirname(axcore.__file__),
        },
        "results": results,
        "ratios": ratios,
        "targets": targets,
        "raw": {"blocking_s": blocking, "committed_s": committed},
    }
    write_result(NAME, data, results_dir=results_dir)
    return data


if __name__ == "__main__":
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="python -m benchmarks.checkpoint_blocking", description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny state; the numbers mean nothing")
    parser.add_argument("--rounds", type=int, help="saves per contender after the warm-up (default 7; smoke 2)")
    parser.add_argument("--results-dir", type=pathlib.Path, help="where checkpoint_blocking.json goes")
    args = parser.parse_args()
    out = run(args.smoke, args.results_dir, rounds=args.rounds)
    print(json.dumps({"results": out["results"], "ratios": out["ratios"], "targets": out["targets"]}, indent=1))
