"""plot_loss_curve: a real PNG with one coloured line per metric present."""

import math

import numpy as np
import pytest

from axcore.observe import JsonlWriter, MetricsError, plot_loss_curve

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
