"""Load a trained (or imported) model from a run directory: its resolved experiment and a checkpoint's parameters.

    loaded = load_model("runs/default-20260101-120000")          # the latest committed step
    loaded = load_model("runs/x/checkpoints/200")                 # one step's directory (orbax)
    loaded = load_model("runs/x", step=100, overrides=["mesh.mesh_shape=[-1]"])
    (loss, metrics), _ = axcore.functional(loaded.model, loaded.params, (batch,), None, False)

A run directory is what `axcore train` leaves: `config.yaml` (the resolved experiment,
which loads back without running plugin transforms or mesh modifiers again, see
`axcore.experiment.loading`) and `checkpoints/` (one directory per committed step, written by
the run's configured backend, `trainer.checkpoint.backend`). `path` may name the run
directory, its `checkpoints/` directory, or one step's directory inside it (`200/`
for orbax, `step_00000200/` for tensorstore), which also picks the step.

Restoring goes through the pieces training uses, not a copy of them: the experiment's
placement (`axcore.placement.Placement`: the model, its abstract parameters and their
shardings on the experiment's mesh; the train step owns the same object, but no learner,
objective or optimizer state is built here), the configured backend
(`axcore.placement.backend.make_checkpoint_backend`, which also parses a step directory's
name, `step_of`) and `restore_verified` (checksums checked; with no step given, a step
that fails verification falls back to the newest one that verifies, reported through
`report`). The run directory's names come from `axcore.placement.layout`.
Only the parameters are read, as a partial restore of `{"params": ...}`: from a train
state checkpoint the optimizer state is never read (nor held in memory), and a
parameters-only checkpoint (see `save_model`, or an importer's output) restores the
same way.

`save_model` writes the other direction: an experiment and a parameter tree as a run
directory (config.yaml plus a committed parameters-only step, see
`axcore.placement.backend.params_only_metadata`), so a converted model can be evaluated, sampled, or
fine-tuned by resuming it with `axcore train RUN/config.yaml --set trainer.run_dir=RUN`
(which initializes the optimizer state on that first resume).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from axcore.checkpoint import CheckpointError, CheckpointMismatchError, CheckpointNotFoundError
from axcore.errors import AxcoreError
from axcore.experiment.loading import Experiment, load_experiment
from axcore.placement.backend import make_checkpoint_backend, params_only_metadata
from axcore.placement.layout import CHECKPOINTS_DIR, CONFIG_FILE, checkpoints_path, config_path
from axcore.placement.placement import Placement


class RunLoadError(AxcoreError):
    """A run directory or checkpoint cannot be loaded (the message names the path and what to do)."""


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """A model restored from a run directory."""

    # The run's resolved experiment (from its config.yaml, with the overrides applied).
    experiment: Experiment
    # The built model (`experiment.config.model` instantiated as "model").
    model: Any
    # The checkpoint's parameter tree, placed with the shardings of the experiment's mesh.
    params: Any
    # The restored step.
    step: int
    # The run directory.
    source: pathlib.Path


@dataclasses.dataclass(frozen=True)
class RunLocation:
    """Where `path` points: its run directory and the step directory it names (None: not a step directory).

    The step a step directory holds is the run's checkpoint backend's to parse (`step_of`), so
    `load_model` reads it once the backend is built.
    """

    run_dir: pathlib.Path
    # The name of the step directory `path` names inside checkpoints/ (e.g. "200", "step_00000200"), or None.
    step_dir: str | None


def locate_run(path: str | os.PathLike) -> RunLocation:
    """Resolves a run directory, its `checkpoints/` directory or one step's directory to the run and step.

    Raises:
        RunLoadError: `path` does not exist, or is none of the three (no config.yaml found).
    """
    given = pathlib.Path(os.path.expanduser(os.fspath(path)))
    if not given.exists():
        raise RunLoadError(f"Run '{given}' does not exist; pass a run directory (holding {CONFIG_FILE} and "
                           f"{CHECKPOINTS_DIR}/), its {CHECKPOINTS_DIR}/ directory or one step's directory.")
    resolved = given.resolve()
    if (resolved / CONFIG_FILE).is_file():
        return RunLocation(resolved, None)
    if resolved.name == CHECKPOINTS_DIR and (resolved.parent / CONFIG_FILE).is_file():
        return RunLocation(resolved.parent, None)
    parent = resolved.parent
    if parent.name == CHECKPOINTS_DIR and (parent.parent / CONFIG_FILE).is_file():
        return RunLocation(parent.parent, resolved.name)
    raise RunLoadError(f"'{given}' holds no {CONFIG_FILE}: it is not a run directory written by `axcore train` "
                       f"(nor its {CHECKPOINTS_DIR}/ or a step directory in it); pass the run directory.")


def load_run_experiment(path: str | os.PathLike, overrides: Sequence[str] = (), **kwargs: Any) -> tuple[Experiment, RunLocation]:
    """The resolved experiment of the run at `path` (see `locate_run`) and where it is.

    `overrides` are `--set` style (`PATH=VALUE`), e.g. `mesh.mesh_shape=[-1]` to lay a
    run from more devices out on this machine's. `kwargs` go to `load_experiment`.
    """
    location = locate_run(path)
    experiment = load_experiment(config_path(location.run_dir), list(overrides), **kwargs)
    return experiment, location


def load_model(
    path: str | os.PathLike,
    *,
    step: int | None = None,
    overrides: Sequence[str] = (),
    report: Callable[[str], None] | None = None,
    objects: dict[str, Any] | None = None,
) -> LoadedModel:
    """Loads the run at `path` and restores the parameters of one committed checkpoint.

    Args:
        path: a run directory, its `checkpoints/` directory, or one step's directory.
        step: the step to restore; None = the step `path` names, else the latest
            committed step that verifies.
        overrides: `PATH=VALUE` overrides applied to the saved config (e.g. the mesh).
        report: receives one line per checkpoint step skipped because it failed
            verification (default: printed to stderr).
        objects: plugin objects by name (tests), as for `load_experiment`.

    Returns:
        A LoadedModel; `params` has the model's parameter tree with each leaf placed
        on the experiment's mesh (`[vocab, dim]` embeddings etc., as `model.initialize`).

    Raises:
        RunLoadError: no config.yaml, no checkpoints/ directory, no committed step (or
            not `step`), or parameters whose shapes/dtypes differ from the config's model.
        CheckpointError: a step fails verification (checksums, unreadable files).
        AxcoreError subclasses: the saved config does not load (e.g. a plugin is missing).
    """
    return load_model_and_placement(path, step=step, overrides=overrides, report=report, objects=objects)[0]


def load_model_and_placement(
    path: str | os.PathLike,
    *,
    step: int | None = None,
    overrides: Sequence[str] = (),
    report: Callable[[str], None] | None = None,
    objects: dict[str, Any] | None = None,
) -> tuple[LoadedModel, Placement]:
    """`load_model`, plus the `Placement` whose mesh and shardings restored it (for evaluation and
    generation: its `tokenizer`, `op_environment()`, `loader()`; `axcore.placement.Evaluator` adds the
    eval step). No learner, objective or optimizer state is built."""
    experiment, location = load_run_experiment(path, overrides, objects=objects)
    checkpoints = checkpoints_path(location.run_dir)
    if not checkpoints.is_dir():  # Checked first: a backend would create the directory.
        raise RunLoadError(f"Run {location.run_dir} has no {CHECKPOINTS_DIR}/ directory, so no trained "
                           f"parameters; train it (axcore train {config_path(location.run_dir)}) or pass another run.")
    report = report or (lambda line: print(line, file=sys.stderr))
    backend = make_checkpoint_backend(experiment.config.trainer.checkpoint, experiment.registries, checkpoints)
    where = f"run {location.run_dir} ({experiment.config.trainer.checkpoint.backend} checkpoints)"
    try:
        step = _chosen_step(path, step, location, backend)
        placement = Placement(experiment)
        if not backend.all_steps():
            raise RunLoadError(f"No committed checkpoint in {checkpoints} ({where}); wait for or rerun the training "
                               f"(a step without its commit marker is an interrupted save).")
        try:
            params, restored = placement.restore_params(backend, step, report)  # Only {"params": ...} is read.
        except CheckpointNotFoundError as e:
            raise RunLoadError(f"{e} ({where}); pass one of the committed steps or omit the step.") from None
        except CheckpointError as e:
            if isinstance(e, CheckpointMismatchError):
                raise _mismatch(e, location.run_dir) from None
            raise
    finally:
        backend.close()
    return LoadedModel(experiment, placement.model, params, restored, location.run_dir), placement


def load_engine(path: str | os.PathLike, *, step: int | None = None, overrides: Sequence[str] = (),
                name: str | None = None, config: Any = None, objects: dict[str, Any] | None = None,
                adapters: Mapping[str, str] | None = None) -> Any:
    """An `axcore.engine.Engine` serving the model of the run at `path` (`load_model`: its parameters
    only, never an optimizer state) with the run's tokenizer and its end-of-sequence token.

    `name` (the served model's name) defaults to the run directory's name; `config` is an
    `EngineConfig` (None: the defaults); `objects` are plugin objects by name (tests). `adapters`
    (`{name: adapter run dir}`, e.g. LoRA runs of this base) are held resident and chosen per
    request (`load_adapters`; AdapterLoadError if one cannot be).
    """
    from axcore.engine import Engine, EngineConfig
    from axcore.engine.adapters import check_names

    loaded = load_model(path, step=step, overrides=overrides, objects=objects)
    tokenizer = loaded.experiment.config.tokenizer.instantiate()
    eos = () if tokenizer.eos_id is None else (tokenizer.eos_id,)
    name = name or loaded.source.name
    model, params = loaded.model, loaded.params
    if adapters:
        check_names(name, adapters)
        model, params = load_adapters(loaded, adapters, objects=objects)
    return Engine(model, params, tokenizer, config=config or EngineConfig(), eos_token_ids=eos, name=name,
                  adapters=tuple(adapters or ()))


def load_adapters(base: LoadedModel, adapters: Mapping[str, str], *,
                  objects: dict[str, Any] | None = None) -> tuple[Any, Any]:
    """`(model, params)` serving `base` plus each adapter run of `adapters` (`{name: run dir}`), stacked
    by the kernel an adapter run's plugins register for it (`axcore.engine.adapters`).

    Raises:
        AdapterLoadError: a path is no run directory (a PEFT adapter directory must first be imported into one),
            or no adapter run's plugins can stack adapters.
    """
    from axcore.engine.adapters import STACK, AdapterLoadError, find_stacker

    loaded, stacker = {}, None
    for name, path in adapters.items():
        where = pathlib.Path(path)
        if (where / "adapter_config.json").is_file() and not (where / "config.yaml").is_file():
            raise AdapterLoadError(f"--lora {name}={path}: a PEFT adapter directory, not a run; import it onto the "
                                   f"base first (axcore lora import-peft BASE_RUN {path} OUT) and pass OUT.")
        loaded[name] = load_model(path, objects=objects)
        stacker = stacker or find_stacker(loaded[name].experiment.registries)
    if stacker is None:
        raise AdapterLoadError(f"--lora {', '.join(f'{n}={p}' for n, p in adapters.items())}: none of these runs uses a "
                               "plugin that serves adapters per request (e.g. lora); pass adapter runs.")
    return getattr(stacker, STACK)(base, loaded)


def _chosen_step(path: str | os.PathLike, step: int | None, location: RunLocation, backend: Any) -> int | None:
    """`step`, or the step of the step directory `path` names (parsed by the backend); None: the latest.

    Raises:
        RunLoadError: the directory's name is no step of the backend, or names another step than `step`.
    """
    if location.step_dir is None:
        return step
    step_of = getattr(backend, "step_of", None)
    named = step_of(location.step_dir) if step_of is not None else None
    if named is None:
        raise RunLoadError(f"'{path}' is not a step directory of {checkpoints_path(location.run_dir)} (names look "
                           f"like 200 or step_00000200); pass the run directory, with --step to pick a step.")
    if step is not None and step != named:
        raise RunLoadError(f"'{path}' is the directory of step {named} but step {step} was asked for; "
                           f"pass the run directory {location.run_dir} to choose a step.")
    return named


def _mismatch(error: CheckpointError, run_dir: pathlib.Path) -> RunLoadError:
    return RunLoadError(
        f"The checkpoints of run {run_dir} do not fit the model of its {CONFIG_FILE} ({' '.join(error.reason.split())}); "
        f"if the config was edited or overridden after training, use the config the run was trained with."
    )


def save_model(
    experiment: Experiment, params: Any, run_dir: str | os.PathLike, *, step: int = 0, seed: int | None = None
) -> pathlib.Path:
    """Writes `params` of `experiment`'s model as a run directory that `load_model` and `axcore train` read.

    Writes `config.yaml`/`config.txt` (`Experiment.save`) and commits checkpoint `step`
    through the experiment's backend, holding `{"params": params}` only (cast to the
    model's parameter dtypes and placed on the experiment's mesh) and the metadata of
    a parameters-only checkpoint (`axcore.placement.backend.params_only_metadata`: the
    step, `seed` (default `trainer.seed`) for the PRNG key, and the input position at
    the start of the data). No optimizer state is written: training initializes it
    when it first resumes from this step.

    Raises:
        RunLoadError: `run_dir` already holds checkpoints, or `params` does not fit the
            model (naming every differing parameter path).
    """
    run_dir = pathlib.Path(run_dir)
    checkpoints = checkpoints_path(run_dir)
    if checkpoints.is_dir() and any(checkpoints.iterdir()):
        raise RunLoadError(f"'{checkpoints}' already holds checkpoints; save into a new run directory.")
    abstract = Placement(experiment).abstract_params()
    _check_params(params, abstract, run_dir)
    params = jax.tree.map(lambda x, a: jax.device_put(jnp.asarray(x, a.dtype), a.sharding), params, abstract)
    metadata = params_only_metadata(step, experiment.config.trainer.seed if seed is None else seed)
    experiment.save(run_dir)
    backend = make_checkpoint_backend(experiment.config.trainer.checkpoint, experiment.registries, checkpoints)
    try:
        backend.save(step, {"params": params}, metadata)
        backend.wait()
    finally:
        backend.close()
    return run_dir


def _check_params(params: Any, abstract: Any, run_dir: pathlib.Path) -> None:
    """Raises RunLoadError listing every path whose presence or shape differs from the model's."""
    flat = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    want = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(abstract)[0]}
    problems = [f"{p} missing" for p in want if p not in flat]
    problems += [f"{p} is not a parameter of the model" for p in flat if p not in want]
    problems += [
        f"{p} has shape {tuple(jnp.shape(flat[p]))}, the model's is {want[p].shape}"
        for p in want
        if p in flat and tuple(jnp.shape(flat[p])) != tuple(want[p].shape)
    ]
    if problems:
        shown = "; ".join(problems[:10]) + (f"; ... and {len(problems) - 10} more" if len(problems) > 10 else "")
        raise RunLoadError(f"Parameters for {run_dir} do not fit the experiment's model: {shown}. "
                           f"Convert them to the model's parameter tree (model.parameter_specs()).")
