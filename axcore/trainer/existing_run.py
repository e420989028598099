"""An existing run directory met by `axcore train`: whose run it holds, whether it is finished, what a kill left.

The trainer locks the run directory before it compiles or writes anything
(`lock_run_directory`, with `axcore.trainer.run_dir`), then asks three questions
here, reading only:

- **Is it this experiment's run?** `run_differences` compares the directory's saved
  `config.yaml` with the experiment about to train. Two things make it another run:
  a different plugin list (names, in order; version specifiers aside), and a model
  whose parameters differ (tree paths, shapes or dtypes), i.e. whose checkpoints the
  model being trained could not restore. The refusal names the differing `model.*`
  settings. Model settings that leave the parameters as they are (rematerialization,
  kernels, compute dtype, the changes a mesh rule makes on another machine) may
  change on resume and are listed in a note; everything outside `model` and
  `plugins` (`trainer.max_steps`, logging and checkpoint cadence, the learning rate,
  the data, a plugin's own settings) may change silently, as before. A directory
  without a `config.yaml` has nothing to compare. Known limit: a plugin setting that
  changes the parameters without changing `model.*` is not seen here; restoring
  then fails with the checkpoint's own mismatch error.
- **Is it finished?** `finished_step` is the step a resume would start from (the
  latest committed step, or `trainer.checkpoint.restore_step`) when that is already
  `trainer.max_steps` or more and restores (verified): nothing is left to train.
  Raising `max_steps` trains on; a damaged last step is left to the trainer's restore,
  which sets it aside and trains it again.
- **Did a kill interrupt pruning?** Pruning (`keep_last_n`) uncommits an old step
  before deleting it; a kill in between leaves a step directory without a commit
  marker, older than the latest committed step, which no backend lists, restores or
  prunes again. `remove_interrupted_pruning` deletes such directories (through the
  backend's optional `discard_incomplete(step)`); an interrupted save of a step newer
  than the latest committed one is left alone (it is reported at restore and replaced
  when that step is saved again).
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from typing import Any, TextIO

import jax
import numpy as np
import yaml
from jax.experimental import multihost_utils

from axcore.checkpoint import CheckpointError
from axcore.config.serialize import from_dict, safe_load
from axcore.errors import AxcoreError, one_line
from axcore.placement.backend import make_checkpoint_backend
from axcore.placement.layout import CONFIG_FILE, checkpoints_path
from axcore.platform.distributed import is_primary
from axcore.trainer.run_dir import RunDirectory, RunDirectoryError

# Its marker of what resolved it, listing the plugin names (axcore.experiment.saved; a layer above this one).
RESOLVED_KEY = "resolved_by"
# Differing model settings named in one refusal; the rest are counted.
_SHOWN = 6


def lock_run_directory(path: pathlib.Path, experiment: Any, step: Any, stream: TextIO) -> tuple[RunDirectory, int | None]:
    """The run directory at `path`, created if needed and locked (process 0 holds the lock for the whole job),
    not yet claimed; with the step it is already finished at (`finished_step`; None: there is training to do).

    `step`: the run's `TrainStep` (its `op_environment()` and `abstract_state()`). Process
    0 locks and compares the saved config (`run_differences`; model settings that changed
    without changing the parameters are noted on `stream`); every process then reads the
    checkpoint directory alike (`finished_step`), since a backend's constructor and
    restore may be collectives (orbax's are); the run is finished only where every
    process found it so. A finished directory is returned unlocked.

    Raises:
        RunDirectoryError: another run holds the directory, or it holds another run (a
            different plugin list or model parameters); nothing but `.lock` is written to it.
    """
    run_dir = RunDirectory(path)
    error, checkpoints = None, False
    if is_primary():
        try:
            run_dir.lock()
            if not run_dir.created:
                refused, noted = run_differences(run_dir.path, experiment, step.op_environment)
                if refused:
                    raise refusal(run_dir.path, refused)
                if noted:
                    print(f"Model settings changed from the run's saved config (its parameters are the same): "
                          f"{'; '.join(noted)}", file=stream)
        except BaseException as e:
            run_dir.abandon()
            if not isinstance(e, RunDirectoryError):
                raise
            error = e
        checkpoints = not run_dir.created and checkpoints_path(run_dir.path).is_dir()
    if jax.process_count() > 1:  # Every process stops when process 0 could not lock; all read checkpoints/.
        status = int(multihost_utils.broadcast_one_to_all(np.int32(-1 if error is not None else checkpoints)))
        if status == -1 and error is None:
            error = RunDirectoryError(f"Process 0 could not lock the run directory '{path}'; see its log.")
        checkpoints = status == 1
    if error is not None:
        raise error
    try:
        finished = None
        if checkpoints:
            finished = finished_step(run_dir.path, experiment.config.trainer, experiment.registries,
                                     step.abstract_state())
        if jax.process_count() > 1:  # Finished only where every process restored the same step.
            answers = np.asarray(multihost_utils.process_allgather(np.int32(-1 if finished is None else finished)))
            finished = int(answers[0]) if answers.min() >= 0 and answers.min() == answers.max() else None
    except BaseException:
        run_dir.abandon()
        raise
    if finished is not None:
        run_dir.abandon()
    return run_dir, finished


def run_differences(run_dir: pathlib.Path, experiment: Any, op_environment: Callable[[], Any]) -> tuple[list[str], list[str]]:
    """`(refused, noted)`: what makes `run_dir`'s saved run another run than `experiment`'s, and what
    merely changed in its model settings; each a list of `path: saved X vs now Y` entries.

    `op_environment()`: the context the model's parameters are declared in (the train
    step's), so both models' parameters are those of this machine's kernels.

    Raises:
        RunDirectoryError: the saved config.yaml cannot be read (naming it).
    """
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        return [], []
    try:
        saved = safe_load(path.read_bytes(), str(path))
    except (OSError, AxcoreError) as e:
        raise RunDirectoryError(
            f"Run directory '{run_dir}' holds a {CONFIG_FILE} that cannot be read ({one_line(e)}); it is not "
            f"this experiment's run: set trainer.run_dir to a new directory."
        ) from None
    saved = saved if isinstance(saved, dict) else {}
    now = _plain(experiment.resolved_dict())
    refused = []
    saved_plugins, plugins = _plugin_names(saved), _plugin_names(now)
    if saved_plugins != plugins:
        refused.append(f"plugins: saved [{', '.join(saved_plugins)}] vs now [{', '.join(plugins)}]")
    changed = _flat_differences("model", _plain(saved.get("model")), now.get("model"))
    if not changed:
        return refused, []
    if refused or not _same_parameters(saved.get("model"), experiment, op_environment):
        return refused + changed, []
    return refused, changed


def refusal(run_dir: pathlib.Path, differences: list[str]) -> RunDirectoryError:
    """The one-line error for a run directory holding another run (`run_differences`' `refused`)."""
    shown = "; ".join(differences[:_SHOWN]) + (f"; and {len(differences) - _SHOWN} more" if len(differences) > _SHOWN else "")
    return RunDirectoryError(
        f"Run directory '{run_dir}' holds another run ({shown}); nothing was written to it. To train this "
        f"experiment, set trainer.run_dir to a new directory (with init_from={run_dir} to start from that run's "
        f"parameters; a plugin may have its own command that prepares such a run, see 'axcore --help')."
    )


def finished_step(run_dir: pathlib.Path, trainer_cfg: Any, registries: Any, abstract_state: Any) -> int | None:
    """The step a resume would start from if it is already `trainer_cfg.max_steps` or more and restores, else None.

    Reads the checkpoint directory with a read-only backend (nothing saved, moved or
    deleted). That step counts only if it restores into `abstract_state` (the train
    state's ShapeDtypeStructs with their shardings) and verifies: a damaged one is left
    to the trainer's own restore, which falls back past it and trains again. None when
    resuming is off or nothing is committed. With several processes every process calls
    it (a backend's constructor and restore may be collectives).
    """
    checkpoint = trainer_cfg.checkpoint
    directory = checkpoints_path(run_dir)
    if (not checkpoint.resume and checkpoint.restore_step is None) or not directory.is_dir():
        return None
    backend = make_checkpoint_backend(checkpoint.set(keep_last_n=None, async_save=False), registries, directory)
    try:
        start = checkpoint.restore_step if checkpoint.restore_step is not None else backend.latest_step()
        if start is None or start < trainer_cfg.max_steps:
            return None
        try:
            state, _ = backend.restore(abstract_state, start)
        except CheckpointError:
            return None
        jax.tree.map(lambda x: x.delete() if isinstance(x, jax.Array) else None, state)  # Only checked: freed now.
        return start
    finally:
        backend.close()


def remove_interrupted_pruning(backend: Any, report: Callable[[str], None]) -> list[int]:
    """Deletes step directories without a commit marker older than the latest committed step; returns their steps.

    Only for the run that holds the directory, before it restores. A backend without
    `incomplete_steps()` and `discard_incomplete(step)` (both optional) is left as it is.
    """
    discard = getattr(backend, "discard_incomplete", None)
    incomplete = getattr(backend, "incomplete_steps", None)
    latest = backend.latest_step()
    if discard is None or incomplete is None or latest is None:
        return []
    removed = []
    for step in incomplete():
        if step < latest:
            try:
                discard(step)
            except (OSError, CheckpointError) as e:
                report(f"Could not remove checkpoint step {step} (left by interrupted pruning): {one_line(e)}")
                continue
            removed.append(step)
    if removed:
        steps = ", ".join(map(str, removed))
        report(f"Removed checkpoint step(s) {steps}: left uncommitted by pruning that a kill interrupted.")
    return removed


def _plugin_names(resolved: dict) -> list[str]:
    """The plugin names of a resolved config: its `resolved_by` marker's (version specifiers dropped), else its
    `plugins:` as written (a config saved without the marker)."""
    marker = resolved.get(RESOLVED_KEY)
    names = marker.get("plugins") if isinstance(marker, dict) else None
    names = names if isinstance(names, list) else resolved.get("plugins")
    return [str(name) for name in names] if isinstance(names, list) else []


def _plain(data: Any) -> Any:
    """`data` as YAML writes and reads it back (tuples as lists, the same scalars `config.yaml` holds)."""
    return yaml.safe_load(yaml.safe_dump(data, sort_keys=False))


def _flat_differences(path: str, saved: Any, now: Any) -> list[str]:
    """`path: saved X vs now Y` for every leaf where two plain trees differ (a missing entry reads `absent`)."""
    if isinstance(saved, dict) and isinstance(now, dict) and saved.get("type") == now.get("type"):
        keys = list(now) + [k for k in saved if k not in now]
        return [d for k in keys for d in _flat_differences(f"{path}.{k}", saved.get(k, _ABSENT), now.get(k, _ABSENT))]
    if saved == now:
        return []
    return [f"{path}: saved {_show(saved)} vs now {_show(now)}"]


_ABSENT = object()


def _show(value: Any) -> str:
    if value is _ABSENT:
        return "absent"
    if isinstance(value, dict):
        return f"{{type: {value['type']}, ...}}" if "type" in value else "{...}"
    return "null" if value is None else str(value)


def _same_parameters(saved_model: Any, experiment: Any, op_environment: Callable[[], Any]) -> bool:
    """Whether the saved model config declares the parameters (paths, shapes, dtypes) the experiment's model does.

    A saved model config that does not build here counts as different.
    """
    registries = experiment.registries
    try:
        saved_cfg = from_dict(saved_model, registries, path="model")
        with op_environment():
            saved = saved_cfg.instantiate(name="model", registries=registries).abstract_parameters()
            now = experiment.config.model.instantiate(name="model", registries=registries).abstract_parameters()
    except (AxcoreError, TypeError, ValueError):
        return False
    describe = lambda tree: {  # noqa: E731
        jax.tree_util.keystr(p): (tuple(x.shape), str(x.dtype)) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
    }
    return describe(saved) == describe(now)
