"""Adapter-only checkpoints (`lora: {checkpoint: adapters, base_run: DIR}`): the checkpoint backend `lora_adapters`.

With `lora.checkpoint: adapters` the plugin's config transform sets
`trainer.checkpoint.backend: lora_adapters` with `backend_settings: {inner: <the backend
it replaces>, inner_settings: {...}, base_run: <absolute path>}`. Every save of the run
(the trainer's train states, `save_model`'s parameters-only steps) then writes, through
the inner backend, the state with `params` cut down to the adapters (`.../lora_a`,
`.../lora_b`): the optimizer state (the adapters' moments only), step, PRNG key and data
position are kept whole; the metadata gains `lora_adapters_only: true`. A restore reads
the adapters from the run and every other parameter (the frozen base) from the latest
committed step of `base_run` (a run directory or its `checkpoints/`), whose `params` must
be exactly those frozen parameters as this model stores them: the Hugging Face import a
LoRA run was made from, or, for QLoRA (`base_format` int8 / nf4), the `OUT/base` that
`axcore lora init --adapters-only` writes with the base already quantized. Each leaf is
placed with the target's sharding, so a resumed run continues bit for bit.
"""

from __future__ import annotations

import os
import pathlib
import re
from typing import Any

from axcore.checkpoint import restore_verified
from axcore.checkpoint.plugin import BACKENDS
from axcore.placement.layout import checkpoints_path
from axcore.plugin.loading import PluginRequest

# The backend's registered name, and the metadata key marking its steps.
NAME, MARK = "lora_adapters", "lora_adapters_only"
# A parameter path ('/'-joined) that is an adapter (the plugin's `trainer.learner.trainable`).
ADAPTER = re.compile(r"(^|/)lora_[ab]$")


def split_params(params: Any, path: str = "") -> tuple[Any, Any]:
    """`(adapters, frozen)`: the nested-dict parameter tree cut into its adapter leaves and all others
    (dicts left empty dropped; None for an empty side)."""
    if not isinstance(params, dict):
        return (params, None) if ADAPTER.search(path) else (None, params)
    adapters, frozen = {}, {}
    for key, value in params.items():
        a, f = split_params(value, f"{path}/{key}")
        if a is not None:
            adapters[key] = a
        if f is not None:
            frozen[key] = f
    return adapters or None, frozen or None


def merge_params(adapters: Any, frozen: Any) -> Any:
    """The inverse of `split_params`."""
    if adapters is None or frozen is None:
        return frozen if adapters is None else adapters
    return {k: merge_params(adapters.get(k), frozen.get(k)) for k in (*frozen, *(k for k in adapters if k not in frozen))}


def _without_base(state: Any) -> Any:
    if not isinstance(state, dict) or "params" not in state:
        return state
    adapters, _ = split_params(state["params"])
    return {**state, "params": adapters or {}}


def checkpoints_dir(run: str | os.PathLike) -> pathlib.Path:
    """`run/checkpoints` if `run` is a run directory, else `run` (a checkpoints directory)."""
    return checkpoints_path(run) if checkpoints_path(run).is_dir() else pathlib.Path(run)


class AdapterCheckpoints:
    """A checkpoint backend that saves the adapters only and restores the base from `base_run` (module docstring).

    Everything but `save` and `restore` is the inner backend's (`latest_step`, `all_steps`,
    `wait`, `close`, `incomplete_steps`, `set_aside`, `directory`).
    """

    def __init__(self, inner: Any, base_run: str, inner_factory: Any, inner_settings: dict):
        self.inner = inner
        # Where the frozen parameters are read from (a run directory or its checkpoints/).
        self.base_run = base_run
        self._base_factory = lambda: inner_factory(checkpoints_dir(base_run), keep_last_n=None, async_save=False,
                                                   **inner_settings)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["inner"], name)

    def save(self, step: int, state: Any, metadata: dict) -> None:
        self.inner.save(step, _without_base(state), {**metadata, MARK: True})

    def restore(self, target: Any, step: int | None = None, *, partial: bool = False) -> tuple[Any, dict]:
        options = {"partial": True} if partial else {}
        restored, metadata = self.inner.restore(_without_base(target), step, **options)
        if not isinstance(target, dict) or "params" not in target:
            return restored, metadata
        _, frozen = split_params(target["params"])
        if frozen is not None:
            base = self._base_factory()
            try:
                frozen, _, _ = restore_verified(base, {"params": frozen}, report=lambda _line: None, partial=True)
            finally:
                base.close()
            frozen = frozen["params"]
        adapters = restored["params"] or None
        return {**restored, "params": merge_params(adapters, frozen)}, metadata

    def __repr__(self) -> str:
        return f"AdapterCheckpoints({self.inner!r}, base_run={self.base_run!r})"


def lora_adapters(
    directory: str | os.PathLike,
    *,
    keep_last_n: int | None = 3,
    async_save: bool = True,
    base_run: str = "",
    inner: str = "orbax",
    inner_settings: dict | None = None,
) -> AdapterCheckpoints:
    """The `lora_adapters` backend over the built-in backend `inner` (orbax or tensorstore) with its settings."""
    if inner not in BACKENDS:
        from axcore_lora.kernel import LoraConfigError

        raise LoraConfigError(f"'trainer.checkpoint.backend_settings.inner' ({inner!r}) is not one of "
                              f"{', '.join(BACKENDS)}; adapter-only checkpoints wrap a built-in backend.")
    factory, settings = BACKENDS[inner], dict(inner_settings or {})
    backend = factory(directory, keep_last_n=keep_last_n, async_save=async_save, **settings)
    return AdapterCheckpoints(backend, base_run, factory, settings)


def plain_config(raw: dict) -> dict:
    """The experiment data `raw` of a LoRA run (its saved config.yaml) as that of the plain model it merges into.

    Without the lora plugin and settings, the adapters' `model.op_extras.dot.lora`, the
    `trainer.learner.trainable` the plugin set, and the `lora_adapters` checkpoint backend
    (its inner backend restored); and without `init_from`: a saved config is already merged
    onto its base run, so resolving it must not merge (and add the adapters) again.
    """
    raw = {k: v for k, v in raw.items() if k not in ("lora", "init_from", "resolved_by")}
    raw["plugins"] = [p for p in raw.get("plugins") or [] if PluginRequest.parse(p).name != "lora"]
    extras = (raw.get("model") or {}).get("op_extras") or {}
    (extras.get("dot") or {}).pop("lora", None)
    trainer = raw.get("trainer") or {}
    (trainer.get("learner") or {}).pop("trainable", None)
    checkpoint = trainer.get("checkpoint") or {}
    if checkpoint.get("backend") == NAME:
        settings = checkpoint.get("backend_settings") or {}
        checkpoint["backend"] = settings.get("inner", "orbax")
        checkpoint["backend_settings"] = settings.get("inner_settings") or {}
    return raw


def publish_run(out: str | os.PathLike, write: Any) -> pathlib.Path:
    """Calls `write(tmp)` on a new temporary directory beside `out`, then renames it to `out` (never half-written).

    Raises:
        ConversionError: `out` exists.
    """
    import shutil

    from axcore_hf import files

    out = pathlib.Path(out).absolute()
    tmp = files.fresh_dir(out)
    try:
        write(tmp)
        files.publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
