"""The checkpoint backend of a run: its config and the factory call, below the trainer and run loading.

`make_checkpoint_backend(cfg, registries, directory)` builds the registered backend
`cfg.backend` (orbax, tensorstore, or a plugin's) on `directory` (a run's
`layout.checkpoints_path`), with `keep_last_n`, `async_save` and the checked
`backend_settings`. The trainer saves and resumes through it; run loading, `axcore eval`,
`axcore generate` and the importers restore and write through it.
"""

from __future__ import annotations

import inspect
import os
import typing
from typing import Annotated, Any

from axcore.config import ConfigBase, NonNegative, Positive
from axcore.config.base import coerce
from axcore.errors import ConfigError, UnknownFieldError, did_you_mean
from axcore.registry import Registries

# Metadata key marking a parameters-only checkpoint (`params_only_metadata`; `axcore.trainer.resume` reads it).
PARAMS_ONLY = "params_only"
# Factory arguments the trainer sets itself (from CheckpointConfig fields of the same names).
_TRAINER_BACKEND_ARGUMENTS = ("keep_last_n", "async_save")


class CheckpointConfig(ConfigBase):
    """When and how the train state is saved."""

    # Checkpoint backend by registered name (orbax, tensorstore, or a plugin's).
    backend: str = "orbax"
    # The backend's own settings, passed to its factory as keyword arguments (e.g. orbax's compress: true).
    backend_settings: dict[str, Any] = {}
    # Save every N steps (and always at the end); 0 = only at the end.
    every_n_steps: Annotated[int, NonNegative] = 100
    # Number of committed checkpoints kept; None keeps all.
    keep_last_n: Annotated[int, Positive] | None = 3
    # Write in the background while training continues.
    async_save: bool = True
    # Resume from the latest committed checkpoint in the run directory, if there is one.
    resume: bool = True
    # Restore exactly this step (fail if it does not verify); None: the latest step that verifies.
    restore_step: Annotated[int, NonNegative] | None = None


def backend_arguments(cfg: CheckpointConfig, registries: Registries, path: str = "trainer.checkpoint") -> dict[str, Any]:
    """Keyword arguments of the checkpoint backend's factory, checked against its signature.

    `backend_settings` may name any keyword argument of the factory except the
    directory and the ones the trainer sets (`keep_last_n`, `async_save`); values are
    checked against the factory's annotations.

    Raises:
        UnknownComponentError: no backend of that name (the message lists them).
        UnknownFieldError / ConfigTypeError: a setting the factory does not take, or
            of the wrong type, naming `<path>.backend_settings.<key>`.
    """
    factory = registries.checkpoint_backends[cfg.backend]
    parameters = list(inspect.signature(factory).parameters.values())
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    # The first parameter is the checkpoint directory.
    accepted = [p.name for p in parameters[1:] if p.kind in keyword and p.name not in _TRAINER_BACKEND_ARGUMENTS]
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
    try:
        hints = typing.get_type_hints(factory)
    except (NameError, TypeError):  # Unresolvable annotations in a plugin's factory: values go unchecked.
        hints = {}
    settings = {}
    for key, value in cfg.backend_settings.items():
        where = f"{path}.backend_settings.{key}"
        if key in _TRAINER_BACKEND_ARGUMENTS:
            raise ConfigError(f"'{where}' is set by the trainer; set '{path}.{key}' instead.")
        if key not in accepted and not takes_any:
            raise UnknownFieldError(
                f"Checkpoint backend '{cfg.backend}' takes no setting '{key}' ('{where}'){did_you_mean(key, accepted)}; "
                f"its settings are: {', '.join(accepted) or 'none'}."
            )
        settings[key] = coerce(value, hints[key], where) if key in hints else value
    return settings


def make_checkpoint_backend(cfg: CheckpointConfig, registries: Registries, directory: str | os.PathLike) -> Any:
    """The configured checkpoint backend, writing to `directory`."""
    factory = registries.checkpoint_backends[cfg.backend]
    settings = backend_arguments(cfg, registries)
    return factory(directory, keep_last_n=cfg.keep_last_n, async_save=cfg.async_save, **settings)



def params_only_metadata(step: int, seed: int) -> dict:
    """The metadata of a parameters-only checkpoint of `step` whose PRNG key comes from `seed` (an import, or
    `axcore.inference.run_loading.save_model`'s output; resuming from it builds a fresh optimizer state)."""
    return {PARAMS_ONLY: True, "step": int(step), "seed": int(seed), "input": None}


__all__ = ["PARAMS_ONLY", "CheckpointConfig", "backend_arguments", "make_checkpoint_backend", "params_only_metadata"]
