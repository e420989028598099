"""Observability for a training run: metrics writers, a progress display, loss plots.

Importing this package is cheap: tensorboardX and matplotlib are imported only
when a `TensorBoardWriter` is created or `plot_loss_curve` is called, and the
registered writer factories (which need the config system) only when first used.
The built-in plugin `axcore.observe.plugin` registers the `jsonl` and `tensorboard`
writers.
"""

from axcore.config.lazy import lazy_exports
from axcore.observe.plot import plot_loss_curve
from axcore.observe.progress import ProgressLog, format_duration
from axcore.observe.writers import (
    JsonlWriter,
    MetricsError,
    MetricsWriter,
    MultiWriter,
    TensorBoardWriter,
    read_jsonl_metrics,
)

_FACTORIES = ("JsonlWriterFactory", "MetricsWriterFactory", "TensorBoardWriterFactory")
__getattr__, __dir__ = lazy_exports(globals(), {name: "axcore.observe.factories" for name in _FACTORIES})

__all__ = [
    "JsonlWriter",
    "JsonlWriterFactory",
    "MetricsError",
    "MetricsWriter",
    "MetricsWriterFactory",
    "MultiWriter",
    "ProgressLog",
    "TensorBoardWriter",
    "TensorBoardWriterFactory",
    "format_duration",
    "plot_loss_curve",
    "read_jsonl_metrics",
]
