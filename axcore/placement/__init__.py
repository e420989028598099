"""Placement: an experiment's model on its mesh, below both the trainer and inference.

It owns the placement object (`placement`: `Placement`, the mesh, axis rules, model,
tokenizer, parameter and batch shardings, op environment, and parameter loading from a
checkpoint or an init), held-out evaluation of a placed model (`evaluate`: `Evaluator`,
the loops, mixtures), the input pipelines of a process's data shards (`inputs`), the
checkpoint backend of a run (`backend`: `CheckpointConfig`, `make_checkpoint_backend`)
and the run directory's layout (`layout`: `config.yaml`, `checkpoints/`, the markers).
It may import `layers/`, `learning/` and everything below them; the
trainer (whose `TrainStep` owns a `Placement` and adds the optimizer, the objective and
the compiled steps), inference and the layers above import it (the inference engine,
`engine/`, just above it, does not need it). The names below are
re-exported lazily, so importing this package does not import JAX.
"""

from __future__ import annotations

from axcore.config.lazy import lazy_exports

_EXPORTS = {
    "axcore.placement.placement": ["Placement"],
    "axcore.placement.evaluate": ["Evaluator"],
    "axcore.placement.backend": ["CheckpointConfig", "make_checkpoint_backend"],
    "axcore.placement.layout": ["CHECKPOINTS_DIR", "CONFIG_FILE", "checkpoints_path", "config_path"],
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)

__getattr__, __dir__ = lazy_exports(globals(), _WHERE)
