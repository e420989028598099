"""The inference engine: continuous batching over a paged KV cache, on the training layers.

Requests (`requests`: `SamplingParams`, `GenerationRequest`, `RequestOutput`) join and
leave a running batch between decode steps; the scheduler chooses each step's chunks
and owns the KV block allocator; one compiled model call per step runs the same layers
and kernels as training, on the caller's parameters. It sits below the trainer (whose
end-of-run sample decodes with it) and imports only the layers, kernels, data and what
lies below them; a run directory is loaded into an engine from above
(`axcore.inference.load_engine`). `offline` runs a fixed list of prompts to the end
(`axcore generate`, the end-of-run sample, lm-eval's `generate_until`).

    from axcore.engine import Engine, EngineConfig

The names below are re-exported lazily, so importing this package (e.g. for `requests`'
plain data) does not import JAX.
"""

from __future__ import annotations

from axcore.config.lazy import lazy_exports

_EXPORTS = {
    "axcore.engine.config": ["EngineConfig", "EngineError"],
    "axcore.engine.engine": ["Engine"],
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)

__getattr__, __dir__ = lazy_exports(globals(), _WHERE)
