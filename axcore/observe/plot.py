"""Loss curves as PNG files, drawn with matplotlib's Agg canvas (no pyplot, no global state).

`loss_figure` builds the figure (so what it draws can be read back), `save_figure`
writes it, `plot_loss_curve` does both; the trainer calls it at the end of a run for
`<run_dir>/loss.png`. The y axis is the loss in nats per token, naming what one token
is (`Tokenizer.token_unit`: a UTF-8 byte for the built-in `bytes` tokenizer); the
title names the run (and its experiment). A training curve is one batch's loss per
logged step, so it is noisy: it is drawn faint, under its bias-corrected exponential
moving average (`ema`); evaluation losses are drawn as markers joined by a line.
"""

from __future__ import annotations

import math
import os
import pathlib
from collections.abc import Sequence
from typing import Any

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


def ema(values: Sequence[float], smoothing: float) -> list[float]:
    """Bias-corrected exponential moving average, as TensorBoard's smoothing and Adam's moments.

    `m_0 = 0`, `m_t = smoothing * m_(t-1) + (1 - smoothing) * x_t`, shown as
    `m_t / (1 - smoothing**t)`: a weighted mean of the values so far, whose weights sum
    to 1 from the first value on. Without the correction (an average started at `x_0`)
    the first logged loss, the highest of a run, keeps weight `smoothing**t` and holds the
    curve far above the raw losses for the whole run.

    One value per record (logged steps, whatever their spacing). A NaN value (a diverged
    step) gives NaN at its position and is skipped: it neither moves the average nor
    counts in `t`. `smoothing` in [0, 1): 0 returns the values unchanged.
    """
    if not 0.0 <= smoothing < 1.0:
        raise ValueError(f"smoothing must be in [0, 1), got {smoothing}")
    out, average, t = [], 0.0, 0
    for value in values:
        if math.isnan(value):
            out.append(math.nan)
            continue
        t += 1
        average = smoothing * average + (1.0 - smoothing) * value
        out.append(average / (1.0 - smoothing**t))
    return out


def _title(run_name: str | None, experiment: str | None) -> str:
    if run_name and experiment:
        return f"{run_name} (experiment {experiment})"
    return run_name or (f"experiment {experiment}" if experiment else "Loss")


def _y_label(series_keys: Sequence[str], token_unit: str) -> str:
    if not all(k.endswith("loss") for k in series_keys):
        return "value"
    unit = "" if token_unit == "token" else f"; 1 token = 1 {token_unit}"
    return f"loss (nats per token{unit})"


def loss_figure(
    metrics: Sequence[dict] | str | os.PathLike[str],
    *,
    keys: Sequence[str] = ("train/loss", "eval/loss"),
    run_name: str | None = None,
    experiment: str | None = None,
    token_unit: str = "token",
    smoothing: float = 0.9,
    title: str | None = None,
):
    """A matplotlib `Figure` (Agg canvas) of the loss curves in `metrics`, not yet saved.

    Args:
        metrics: records as returned by `read_jsonl_metrics` (each with a "step"),
            or the path of a JSONL file written by `JsonlWriter`.
        keys: metric names to draw. Keys whose first path part starts with "eval"
            (e.g. "eval/loss") are drawn as markers joined by a line; any other key
            (a per-batch training value) faint as logged, and its `ema` over it.
        run_name: the run directory's name, in the title.
        experiment: the experiment's name, in the title.
        token_unit: what one token is (`Tokenizer.token_unit`), in the y label.
        smoothing: the `ema` factor of the training curves.
        title: the figure's title instead of the run and experiment names.

    The lines carry legend labels: `key` for an eval line; `key + " (raw)"` for a
    faint training line and `key + " (moving average, smoothing S)"` for its average.

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
    for i, (key, (steps, values)) in enumerate(series.items()):
        colour = f"C{i}"
        if _is_eval(key) or len(steps) == 1:
            ax.plot(steps, values, color=colour, marker="o", markersize=5, linewidth=1.2, label=key)
        else:
            ax.plot(steps, values, color=colour, linewidth=0.8, alpha=0.3, label=f"{key} (raw)")
            ax.plot(steps, ema(values, smoothing), color=colour, linewidth=1.8,
                    label=f"{key} (moving average, smoothing {smoothing:g})")
    ax.set_xlabel("step")
    ax.set_ylabel(_y_label(list(series), token_unit))
    ax.set_title(title if title is not None else _title(run_name, experiment))
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def save_figure(fig, out_png: str | os.PathLike[str]) -> pathlib.Path:
    """Writes `fig` as a PNG to `out_png` (parent folders created); returns its path."""
    out = pathlib.Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out


def plot_loss_curve(
    metrics: Sequence[dict] | str | os.PathLike[str],
    out_png: str | os.PathLike[str],
    **figure: Any,
) -> pathlib.Path:
    """`loss_figure(metrics, **figure)` saved as a PNG at `out_png`; returns its path.

    Raises:
        MetricsError: none of the keys occurs in `metrics` (nothing is written).
    """
    return save_figure(loss_figure(metrics, **figure), out_png)
