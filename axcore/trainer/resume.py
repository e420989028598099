"""Resuming training from a checkpoint: a full train state, or parameters only (an import).

A *parameters-only* checkpoint holds the tree `{"params": ...}` and the metadata
`axcore.placement.backend.params_only_metadata(step, seed)`: `{"params_only": true, "step": N, "seed": S, "input":
null}` (no input position: training from it reads its data from the beginning; older
imports' `{"epoch": 0, "position": 0}` is ignored the same way). It is what `axcore.inference.run_loading.save_model` (and so
`axcore convert hf-to-axcore`) writes: no optimizer moments, which are a fresh optimizer's
zeros anyway, so the checkpoint is a third of a train state's size and loading it for
inference reads nothing but the weights.

`restore_train_state` restores the full train state; when that fails and the step is a
parameters-only checkpoint, it restores the parameters (checksums verified as always)
and builds the rest as a fresh run would: the optimizer state of `optimizer.init(params)`
(its step count at 0), `step` from the metadata and the PRNG key of the metadata's seed.
The first save after that writes a full train state. A train state whose optimizer state
does not match (a changed optimizer config) still fails with its own error: only a step
whose metadata says `params_only` is resumed without its optimizer state.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from axcore.checkpoint import CheckpointError, CheckpointNotFoundError, restore_verified
from axcore.placement.backend import PARAMS_ONLY, make_checkpoint_backend
from axcore.placement.layout import CHECKPOINTS_DIR, checkpoints_path
from axcore.trainer.step import OBJECTIVE_STATE


def restore_train_state(
    trainer: Any, backend: Any, step: int | None, report: Callable[[str], None]
) -> tuple[dict, dict, bool]:
    """`(state, metadata, params_only)`: the train state of `step` (None: the latest that verifies).

    `trainer` is the `TrainStep` resuming (its `abstract_state()`, `optimizer`,
    `objective` and `state_shardings`). Lines from `restore_verified` (steps skipped) go to `report`,
    only for the attempt that succeeds.

    Raises:
        CheckpointNotFoundError: no committed step (or not `step`).
        CheckpointError: the full train state does not restore and the step is not a
            parameters-only checkpoint (that error), or it is one whose parameters do
            not match the model or fail verification (the parameters' error).
    """
    abstract = trainer.abstract_state()
    held: list[str] = []
    try:
        state, metadata, _ = restore_verified(backend, abstract, step, report=held.append, set_aside=True)
    except CheckpointNotFoundError:
        raise
    except CheckpointError as full_error:
        held = []
        restored, metadata, restored_step = restore_verified(
            backend, {"params": abstract["params"]}, step, report=held.append, partial=True
        )
        if not metadata.get(PARAMS_ONLY):
            raise full_error from None  # A train state that does not fit (e.g. another optimizer).
        seed = metadata.get("seed", trainer.cfg.trainer.seed)
        state = fresh_train_state(trainer, restored["params"], metadata.get("step", restored_step), seed)
        for line in held:
            report(line)
        return state, metadata, True
    for line in held:
        report(line)
    return state, metadata, False


def fresh_train_state(trainer: Any, params: Any, step: int, seed: int) -> dict:
    """The train state of `params` with a fresh optimizer state (and objective state), `step` and the key of `seed`."""
    shardings = trainer.state_shardings
    key = jax.random.key_data(jax.random.key(seed))
    state = {
        "params": params,
        "opt_state": jax.jit(trainer.optimizer.init, out_shardings=shardings["opt_state"])(params),
        "step": jax.device_put(jnp.asarray(step, jnp.int32), shardings["step"]),
        "prng_key": jax.device_put(key, shardings["prng_key"]),
    }
    if OBJECTIVE_STATE in shardings:  # E.g. a frozen reference model: a copy of the imported parameters.
        init = jax.jit(trainer.objective.init_state, out_shardings=shardings[OBJECTIVE_STATE])
        state[OBJECTIVE_STATE] = init(params)
    return state


def init_from_run(trainer: Any, base: str, report: Callable[[str], None]) -> dict:
    """A fresh train state (step 0, fresh optimizer) whose parameters are run `base`'s latest that verify.

    Used for `init_from` (fine-tuning a run, typically an import) when the run has no
    checkpoint of its own. Only `{"params": ...}` is read (a partial restore, checksums
    verified), whether the base step is a full train state or parameters only. The base
    run's checkpoints are read with this run's checkpoint backend, never written.

    Raises:
        CheckpointError: the base has no committed step, or its parameters do not fit
            the model (the message names `init_from` and the base run).
    """
    directory = checkpoints_path(os.path.expanduser(base))
    cfg = trainer.cfg.trainer
    if not directory.is_dir():  # Checked first: a backend would create the directory.
        raise CheckpointNotFoundError(f"init_from: run '{base}' has no {CHECKPOINTS_DIR}/ directory; point it at a "
                                      f"trained or imported run.")
    settings = cfg.checkpoint.set(keep_last_n=None, async_save=False)  # Read only: nothing is saved or deleted.
    backend = make_checkpoint_backend(settings, trainer.experiment.registries, directory)
    try:
        abstract = {"params": trainer.abstract_state()["params"]}
        try:
            restored, _, step = restore_verified(backend, abstract, None, report=report, partial=True)
        except CheckpointError as e:
            raise CheckpointError(
                f"init_from: the parameters of run '{base}' do not restore into this model "
                f"({' '.join(str(e).split())}); point init_from at a run of the same model (its parameters as "
                f"this experiment declares them)."
            ) from None
    finally:
        backend.close()
    report(f"Initialized from step {step} of {base} (parameters only, optimizer state fresh, step 0)")
    return fresh_train_state(trainer, restored["params"], 0, cfg.seed)
