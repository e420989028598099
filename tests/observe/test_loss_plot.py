"""plot_loss_curve: a real PNG with one coloured line per metric present."""

import math

import numpy as np
import pytest

from axcore.data.tokenizer import ByteTokenizer
from axcore.observe import JsonlWriter, MetricsError, plot_loss_curve
from axcore.observe.plot import ema, loss_figure, save_figure

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# matplotlib's first two default line colours ("C0", "C1"), as RGB in [0, 1].
C0 = np.array([0x1F, 0x77, 0xB4]) / 255
C1 = np.array([0xFF, 0x7F, 0x0E]) / 255


def _records():
    records = []
    for step in range(1, 201):
        record = {"step": step, "train/loss": 4.0 * math.exp(-step / 60) + 1.0}
        if step % 25 == 0:
            record["eval/loss"] = 4.2 * math.exp(-step / 60) + 1.1
        records.append(record)
    return records


def _has_colour(image, rgb, tol=0.04):
    return bool(np.any(np.all(np.abs(image[..., :3] - rgb) < tol, axis=-1)))


def test_plot_from_a_jsonl_file_writes_a_png_with_both_lines(tmp_path):
    import matplotlib.image

    path = tmp_path / "metrics.jsonl"
    with JsonlWriter(path) as writer:
        for record in _records():
            writer.write(record["step"], {k: v for k, v in record.items() if k != "step"})
        writer.write(201, {"train/loss": math.nan})  # a diverged step leaves a gap

    out = plot_loss_curve(path, tmp_path / "plots" / "loss.png")
    assert out == tmp_path / "plots" / "loss.png"
    assert out.read_bytes()[:8] == PNG_SIGNATURE
    image = matplotlib.image.imread(out)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    assert len(np.unique(image[..., :3].reshape(-1, 3), axis=0)) > 10
    assert _has_colour(image, C0) and _has_colour(image, C1)


def test_plot_draws_only_keys_present(tmp_path):
    import matplotlib.image

    only_train = [{k: v for k, v in r.items() if k != "eval/loss"} for r in _records()]
    out = plot_loss_curve(only_train, tmp_path / "loss.png")
    image = matplotlib.image.imread(out)
    assert _has_colour(image, C0) and not _has_colour(image, C1)


def test_plot_with_no_requested_key_is_an_error(tmp_path):
    with pytest.raises(MetricsError, match=r"none of the metrics \['train/loss', 'eval/loss'\]"):
        plot_loss_curve([{"step": 1, "train/acc": 0.5}], tmp_path / "loss.png")
    assert not (tmp_path / "loss.png").exists()


def _numpy_ema(values, smoothing):
    """The bias-corrected moving average in closed form, written independently of axcore's loop: NaNs skipped.

    m_t = a m_(t-1) + (1 - a) x_t from m_0 = 0 is m_t = (1 - a) sum_{1<=j<=t} a^(t-j) x_j; shown m_t / (1 - a^t).
    """
    values = np.asarray(values, float)
    out = np.full_like(values, np.nan)
    finite = np.flatnonzero(np.isfinite(values))
    x = values[finite]
    t = np.arange(1, len(x) + 1)
    weights = (1 - smoothing) * smoothing ** (t[:, None] - t[None, :]) * (t[:, None] >= t[None, :])
    out[finite] = weights @ x / (1 - smoothing**t)
    return out


def test_the_moving_average_is_bias_corrected():
    # By hand: m_1 = 0.5, shown 0.5 / 0.5 = 1; m_2 = 0.25 + 1 = 1.25, shown 1.25 / 0.75.
    np.testing.assert_allclose(ema([1.0, 2.0], 0.5), [1.0, 1.25 / 0.75], rtol=1e-15)
    # A loss that falls at once and plateaus: the average reaches the plateau, not the first value's shadow.
    values = [5.0, *[2.5] * 9, math.nan, 2.5]
    got = ema(values, 0.9)
    np.testing.assert_allclose(got, _numpy_ema(values, 0.9), rtol=1e-12, equal_nan=True)
    assert abs(got[9] - 2.5) < 0.2 and math.isnan(got[10])  # Uncorrected (started at 5.0): 3.47.
    assert ema(values, 0.0) == pytest.approx(values, nan_ok=True)


def test_the_figure_names_its_units_and_run_and_draws_the_moving_average_over_the_raw_curve(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "metrics.jsonl"
    raw = {}
    with JsonlWriter(path) as writer:
        for record in _records():
            noisy = record["train/loss"] + float(rng.normal(0, 0.3))  # One batch's loss: noisy.
            raw[record["step"]] = noisy
            writer.write(record["step"], {**{k: v for k, v in record.items() if k != "step"}, "train/loss": noisy})
        writer.write(201, {"train/loss": math.nan})
    raw[201] = math.nan

    fig = loss_figure(path, run_name="default-20260101-000000", experiment="default", token_unit="byte")
    [ax] = fig.axes
    assert ax.get_xlabel() == "step"
    assert ax.get_ylabel() == "loss (nats per token; 1 token = 1 byte)"
    assert "default-20260101-000000" in ax.get_title() and "default" in ax.get_title()
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert set(lines) == {"train/loss (raw)", "train/loss (moving average, smoothing 0.9)", "eval/loss"}
    assert [t.get_text() for t in ax.get_legend().get_texts()] == list(lines)
    steps = sorted(raw)
    raw_line, smooth = lines["train/loss (raw)"], lines["train/loss (moving average, smoothing 0.9)"]
    np.testing.assert_array_equal(raw_line.get_xdata(), steps)
    np.testing.assert_allclose(raw_line.get_ydata(), [raw[s] for s in steps])
    expected = _numpy_ema([raw[s] for s in steps], 0.9)
    np.testing.assert_allclose(np.asarray(smooth.get_ydata(), float), expected, rtol=1e-12, equal_nan=True)
    assert raw_line.get_alpha() < 1 and smooth.get_linewidth() > raw_line.get_linewidth()
    # The average is smoother than the raw curve: its step-to-step changes are much smaller.
    assert np.nanstd(np.diff(expected)) < 0.3 * np.nanstd(np.diff([raw[s] for s in steps]))
    evals = lines["eval/loss"]
    assert evals.get_marker() == "o" and list(evals.get_xdata()) == list(range(25, 201, 25))

    out = save_figure(fig, tmp_path / "loss.png")
    assert out.read_bytes()[:8] == PNG_SIGNATURE


def test_a_default_tokenizer_run_labels_its_tokens_as_bytes(tmp_path):
    """The trainer's loss.png: title with the run directory and experiment, tokens are bytes (the default)."""
    assert ByteTokenizer().token_unit == "byte"
    fig = loss_figure(_records(), run_name="r", token_unit=ByteTokenizer().token_unit)
    assert fig.axes[0].get_ylabel() == "loss (nats per token; 1 token = 1 byte)"
    assert fig.axes[0].get_title() == "r"
    assert loss_figure(_records()).axes[0].get_ylabel() == "loss (nats per token)"
