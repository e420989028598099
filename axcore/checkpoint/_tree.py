"""Helpers shared by the backends: tree index, restore targets, metadata, checks.

A checkpoint's *index* has one entry per array leaf, `{"path", "shape", "dtype"}`,
and one per empty subtree (None, `optax.EmptyState()`, `{}`), `{"path", "empty"}`,
where `path` is `jax.tree_util.keystr` of the tree path (e.g. `['opt'][0].mu['w']`).
Both backends store it and compare it with the restore target before reading any
array, so a mismatch names every offending path (an optimizer with one more
`EmptyState` is a mismatch too, as the tree differs).
"""

from __future__ import annotations

import json
import operator
import os
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from axcore.checkpoint.base import CheckpointError, CheckpointMismatchError, CheckpointNotFoundError, PyTree

# How many paths of one kind a mismatch message lists before "... and N more".
_MAX_LISTED = 20


def check_keep_last_n(keep_last_n: int | None) -> int | None:
    if keep_last_n is not None and (isinstance(keep_last_n, bool) or not isinstance(keep_last_n, int) or keep_last_n < 1):
        raise CheckpointError(f"keep_last_n must be a positive integer or None (keep all), got {keep_last_n!r}.")
    return keep_last_n


def check_step(step: Any) -> int:
    try:
        value = operator.index(step)  # int, numpy or JAX integer scalars.
    except TypeError:
        value = -1
    if isinstance(step, bool) or value < 0:
        raise CheckpointError(f"A checkpoint step must be a non-negative integer, got {step!r}.")
    return value


def dtype_name(dtype: Any) -> str:
    return np.dtype(dtype).name


def check_state(state: PyTree, where: str) -> None:
    """Raises if a leaf of `state` cannot be checkpointed (not an array, or a typed PRNG key)."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        path = jax.tree_util.keystr(path)
        dtype = getattr(leaf, "dtype", None)
        if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
            raise CheckpointError(
                f"Cannot save {where}: leaf {path} is a typed PRNG key array; store "
                f"jax.random.key_data(key) (uint32) instead."
            )
        if not isinstance(leaf, (jax.Array, np.ndarray, np.generic, int, float, bool)):
            raise CheckpointError(
                f"Cannot save {where}: leaf {path} is a {type(leaf).__name__}, not an array; "
                f"checkpoint state must be a pytree of arrays (metadata goes in `metadata`)."
            )


def index_of(tree: PyTree) -> list[dict]:
    """The index entries of every array leaf and every empty subtree of `tree`."""
    entries = []
    for path, x in jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_empty)[0]:
        path = jax.tree_util.keystr(path)
        if _is_empty(x):
            entries.append({"path": path, "empty": type(x).__name__})
        else:
            entries.append({"path": path, "shape": [int(d) for d in np.shape(x)], "dtype": dtype_name(_dtype(x))})
    return entries


def _is_empty(x: Any) -> bool:
    return x is None or (not hasattr(x, "shape") and jax.tree.structure(x).num_leaves == 0)


def _dtype(x: Any) -> Any:
    return x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype


def json_copy(metadata: dict, where: str) -> dict:
    """A deep copy of `metadata` through JSON; raises if it is not JSON-serializable."""
    if not isinstance(metadata, dict):
        raise CheckpointError(f"Checkpoint metadata for {where} must be a dict, got {type(metadata).__name__}.")
    try:
        return json.loads(json.dumps(metadata, allow_nan=True))
    except (TypeError, ValueError) as e:
        raise CheckpointError(
            f"Checkpoint metadata for {where} is not JSON-serializable ({e}); pass only "
            f"dicts, lists, strings, numbers, booleans and None (convert arrays with .tolist())."
        ) from None


def abstract_target(target: PyTree) -> PyTree:
    """The target with `jax.ShapeDtypeStruct` leaves that all carry a sharding.

    Leaves may be ShapeDtypeStructs or arrays; a leaf without a sharding is placed on
    the first local device.
    """

    def one(leaf):
        sharding = getattr(leaf, "sharding", None)
        if sharding is None:
            sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        return jax.ShapeDtypeStruct(np.shape(leaf), _dtype(leaf), sharding=sharding)

    return jax.tree.map(one, target)


def check_matches(saved: Sequence[dict], target: PyTree, where: str, *, partial: bool = False) -> None:
    """Raises CheckpointMismatchError listing every path that differs from the checkpoint.

    With `partial`, the target may leave out top-level entries of the saved tree (e.g.
    `{"params": ...}` of a saved `{"params", "opt_state", "step", "prng_key"}`); the
    entries it names must match the saved ones exactly, so a checkpoint parameter the
    target lacks is still a mismatch.
    """
    want = {e["path"]: e for e in index_of(target)}
    have = {e["path"]: e for e in saved}
    if partial:
        tops = {jax.tree_util.keystr(path[:1]) for path, _ in jax.tree_util.tree_flatten_with_path(target, is_leaf=_is_empty)[0]}
        have = {p: e for p, e in have.items() if any(_under(p, top) for top in tops)}
    missing = [p for p in want if p not in have]
    extra = [p for p in have if p not in want]
    differ = [
        f"{p} (checkpoint {_describe(have[p])}, target {_describe(want[p])})"
        for p in want
        if p in have and _describe(have[p]) != _describe(want[p])
    ]
    if not (missing or extra or differ):
        return
    parts = []
    if missing:
        parts.append(f"in the target but not in the checkpoint: {_listing(missing)}")
    if extra:
        parts.append(f"in the checkpoint but not in the target: {_listing(extra)}")
    if differ:
        parts.append(f"shape/dtype differs: {_listing(differ)}")
    first = (differ or [f"{p} (missing from the checkpoint)" for p in missing] or [f"{p} (not in the target)" for p in extra])[0]
    raise CheckpointMismatchError(
        f"Checkpoint {where} does not match the restore target; " + "; ".join(parts) + ". "
        "Restore with the model and optimizer config that wrote it, or start from a fresh "
        "checkpoint directory.",
        reason=f"a checkpoint of another model: {first}",
    )


def _under(path: str, top: str) -> bool:
    """Whether the keystr `path` is `top` or lies inside it (`['params']` holds `['params']['w']`, not `['params2']`)."""
    return path == top or (path.startswith(top) and path[len(top)] in "[.")


def _describe(entry: dict) -> str:
    if "empty" in entry:
        return f"empty {entry['empty']}"
    return f"{entry['dtype']}[{','.join(str(d) for d in entry['shape'])}]"


def _listing(items: Sequence[str]) -> str:
    shown = ", ".join(items[:_MAX_LISTED])
    return shown + (f", ... and {len(items) - _MAX_LISTED} more" if len(items) > _MAX_LISTED else "")


def resolve_step(step: int | None, committed: Sequence[int], directory: os.PathLike | str) -> int:
    """The step to restore: `step` if committed, else the latest; raises if none."""
    if not committed:
        raise CheckpointNotFoundError(
            f"No committed checkpoint in {directory}; check the path, or start without "
            f"restoring (a step without its commit marker is an interrupted save and is ignored)."
        )
    if step is None:
        return committed[-1]
    step = check_step(step)
    if step not in committed:
        raise CheckpointNotFoundError(
            f"No committed checkpoint for step {step} in {directory}; committed steps: "
            f"{', '.join(str(s) for s in committed)}."
        )
    return step
