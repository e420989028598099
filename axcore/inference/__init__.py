"""Inference: a finished (or running) run directory loaded back for generation and evaluation.

It owns loading a run's saved, resolved config and a step's parameters through the
run's checkpoint backend (`run_loading`: `load_model`, `save_model`, and `load_engine`: an
`axcore.engine.Engine` on a run's parameters), and held-out evaluation of a run (`evaluation`: `evaluate_run`, through the objective's eval step on
the run's placement, as the trainer evaluates), and lm-evaluation-harness's `axcore` model
(`lm_eval_model`, run on a run's checkpoint by `lm_eval_tasks`; lm-eval is imported only when
one of them is used). It builds an `axcore.placement.Placement`,
never a train step, learner or optimizer state: it may import `experiment/`,
`placement/`, `engine/`, `checkpoint/`, `data/`, `platform/` and everything below them, but nothing
from `trainer/` (an import-linter contract of its own); only `cli/` and `tools/` import it. The names below are
re-exported lazily, so importing this package does not import JAX.
"""

from __future__ import annotations

from axcore.config.lazy import lazy_exports

_EXPORTS = {
    "axcore.inference.run_loading": [
        "LoadedModel", "RunLoadError", "load_adapters", "load_engine", "load_model", "save_model",
    ],
    "axcore.inference.evaluation": ["EvalError", "EvalResult", "evaluate_run"],
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)

__getattr__, __dir__ = lazy_exports(globals(), _WHERE)
