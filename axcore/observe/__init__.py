"""Observability for a training run: metrics writers, a progress display, loss plots.

Importing this package is cheap: tensorboardX and matplotlib are imported only
when a `TensorBoardWriter` is created or `plot_loss_curve` is called.
"""

from axcore.observe.plot import plot_loss_curve
from axcore.observe.progress import ProgressBar, format_duration
from axcore.observe.writers import (
    JsonlWriter,
    MetricsError,
    MetricsWriter,
    MultiWriter,
    TensorBoardWriter,
    read_jsonl_metrics,
)

__all__ = [
    "JsonlWriter",
    "MetricsError",
    "MetricsWriter",
    "MultiWriter",
    "ProgressBar",
    "TensorBoardWriter",
    "format_duration",
    "plot_loss_curve",
    "read_jsonl_metrics",
]
