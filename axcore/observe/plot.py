"""Loss curves as PNG files, drawn with matplotlib's Agg canvas (no pyplot, no global state)."""

from __future__ import annotations

import math
import os
import pathlib
from collections.abc import Sequence

from axcore.observe.writers import MetricsError, read_jsonl_metrics


def _series(records: Sequence[dict], key: str) -> tuple[list[int], list[float]]:
    """Steps and values of `key`, sorted by step; a repeated step keeps its last value.

    A resumed run appends to the same JSONL file and may log some steps again; the
    later values are the ones that belong to the run's final history.
    """
    by_step: dict[int, float] = {}
    for record in records:
        if key in record:
            value = record[key]
            value = math.nan if value is None else float(value)
            by_step[int(record["step"])] = value if math.isfinite(value) else math.nan
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def _is_eval(key: str) -> bool:
    return key.split("/", 1)[0].startswith("eval")


def plot_loss_curve(
    metrics: Sequence[dict] | str | os.PathLike[str],
    out_png: str | os.PathLike[str],
    *,
    keys: Sequence[str] = ("train/loss", "eval/loss"),
    title: str = "Loss",
) -> pathlib.Path:
    """Draws one line per key of `keys` present in `metrics` (x = step) into a PNG.

    Args:
        metrics: records as returned by `read_jsonl_metrics` (each with a "step"),
            or the path of a JSONL file written by `JsonlWriter`.
        out_png: where to write the PNG; parent folders are created.
        keys: metric names to draw. Keys whose first path part starts with "eval"
            (e.g. "eval/loss") are drawn with markers at each evaluated step.
        title: the figure title.

    Returns:
        The path of the written PNG.

    Raises:
        MetricsError: none of `keys` occurs in `metrics`.
    """
    if isinstance(metrics, (str, os.PathLike)):
        source = str(metrics)
        records = read_jsonl_metrics(metrics)
    else:
        source = "the given records"
        records = list(metrics)
    series = {key: _series(records, key) for key in keys}
    series = {key: xy for key, xy in series.items() if xy[0]}
    if not series:
        found = sorted({k for r in records for k in r} - {"step", "time"})
        raise MetricsError(
            f"{source} has none of the metrics {list(keys)} to plot (it has {found})"
        )

    # Imported here so that importing axcore never imports matplotlib; the Agg canvas
    # is used directly, so no global backend is chosen and no pyplot state is created.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for key, (steps, values) in series.items():
        if _is_eval(key) or len(steps) == 1:
            ax.plot(steps, values, marker="o", markersize=5, linewidth=1.2, label=key)
        else:
            ax.plot(steps, values, linewidth=1.5, label=key)
    ax.set_xlabel("step")
    ax.set_ylabel("loss" if all(k.endswith("loss") for k in series) else "value")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()

    out = pathlib.Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out
