"""Metrics writers: JSONL round trip, TensorBoard files read by TensorBoard itself, fan-out."""

import importlib.util
import json
import math
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

from axcore.errors import AxcoreError
from axcore.observe import (
    JsonlWriter,
    MetricsError,
    MetricsWriter,
    MultiWriter,
    TensorBoardWriter,
    read_jsonl_metrics,
)

# Train metrics every step, eval metrics only at some steps.
STEPS = [
    (1, {"train/loss": 3.25, "train/lr": 1e-4}),
    (2, {"train/loss": 2.875, "train/lr": 2e-4}),
    (3, {"train/loss": 2.5, "train/lr": 3e-4, "eval/loss": 2.75}),
    (4, {"train/loss": 2.125, "train/lr": 4e-4}),
    (6, {"train/loss": 1.9, "train/lr": 5e-4, "eval/loss": 2.0}),
]


def _lines_are_valid_jsonl(path):
    text = path.read_text()
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


def test_jsonl_round_trip_with_keys_at_some_steps(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"  # parent folder is created
    writer = JsonlWriter(path)
    for i, (step, metrics) in enumerate(STEPS, start=1):
        writer.write(step, metrics)
        # Flushed at every write: the file is complete valid JSONL while still open.
        assert len(_lines_are_valid_jsonl(path)) == i
    writer.close()

    records = read_jsonl_metrics(path)
    assert [r["step"] for r in records] == [s for s, _ in STEPS]
    for record, (_, metrics) in zip(records, STEPS):
        assert set(record) == {"step", "time", *metrics}
        assert {k: record[k] for k in metrics} == metrics
        assert isinstance(record["time"], float) and record["time"] > 1.6e9
    assert [r["step"] for r in records if "eval/loss" in r] == [3, 6]


def test_jsonl_converts_numpy_scalars_and_spells_non_finite_as_strings(tmp_path):
    path = tmp_path / "m.jsonl"
    with JsonlWriter(path) as writer:
        writer.write(np.int64(7), {"a": np.float32(0.5), "b": np.array(2), "n": math.nan,
                                   "p": np.float32("inf"), "m": -math.inf})
    raw = json.loads(path.read_text())  # strict JSON: no bare NaN/Infinity tokens
    assert raw["step"] == 7 and raw["a"] == 0.5 and raw["b"] == 2.0
    assert (raw["n"], raw["p"], raw["m"]) == ("NaN", "Infinity", "-Infinity")
    (record,) = read_jsonl_metrics(path)
    assert math.isnan(record["n"]) and record["p"] == math.inf and record["m"] == -math.inf


def test_jsonl_rejects_non_scalars_and_reserved_names(tmp_path):
    with JsonlWriter(tmp_path / "m.jsonl") as writer:
        with pytest.raises(TypeError, match="'train/loss' at step 3 is not a scalar"):
            writer.write(3, {"train/loss": np.ones(4)})
        with pytest.raises(ValueError, match="reserved"):
            writer.write(3, {"step": 1.0})


def test_jsonl_appends_on_resume_and_cuts_a_torn_last_line(tmp_path):
    path = tmp_path / "m.jsonl"
    with JsonlWriter(path) as writer:
        writer.write(1, {"train/loss": 1.0})
    with open(path, "a") as f:
        f.write('{"step": 2, "train/lo')  # a crash in the middle of a write
    with pytest.warns(UserWarning, match="incomplete last line"):
        assert [r["step"] for r in read_jsonl_metrics(path)] == [1]
    with pytest.warns(UserWarning, match="incomplete last line"):
        writer = JsonlWriter(path)
    writer.write(2, {"train/loss": 0.5})
    writer.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [r["train/loss"] for r in read_jsonl_metrics(path)] == [1.0, 0.5]


def test_read_jsonl_errors_name_the_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(MetricsError, match=r"bad.jsonl:2: not a JSON line") as info:
        read_jsonl_metrics(path)
    assert isinstance(info.value, AxcoreError)
    with pytest.raises(MetricsError, match="cannot read metrics file"):
        read_jsonl_metrics(tmp_path / "missing.jsonl")


def test_tensorboard_event_files_read_back_by_tensorboard(tmp_path):
    from tensorboard.backend.event_processing import event_accumulator

    logdir = tmp_path / "tb"
    writer = TensorBoardWriter(logdir)
    assert isinstance(writer, MetricsWriter)
    for step, metrics in STEPS:
        writer.write(step, metrics)
    writer.write(7, {"train/loss": math.nan})
    writer.close()

    acc = event_accumulator.EventAccumulator(
        str(logdir), size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"train/loss", "train/lr", "eval/loss"}
    for tag in ("train/loss", "train/lr", "eval/loss"):
        expected = [(s, m[tag]) for s, m in STEPS if tag in m]
        events = acc.Scalars(tag)[: len(expected)]
        assert [e.step for e in events] == [s for s, _ in expected]
        np.testing.assert_allclose(
            [e.value for e in events], [v for _, v in expected], rtol=1e-6)
    last = acc.Scalars("train/loss")[-1]
    assert last.step == 7 and math.isnan(last.value)


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs PyTorch installed (the test extra has it)")
def test_tensorboard_writer_does_not_import_torch_and_torch_still_imports_after(tmp_path):
    # tensorboardX imports torch when it is installed (3-4 CPU seconds of every run's start);
    # the writer imports it with torch marked absent, and leaves torch importable afterwards.
    code = textwrap.dedent(f"""
        import sys
        from axcore.observe import TensorBoardWriter
        writer = TensorBoardWriter({str(tmp_path / "tb")!r})
        writer.write(1, {{"train/loss": 2.5}})
        writer.close()
        assert "torch" not in sys.modules, "tensorboardX imported torch"
        import torch, tensorboardX.writer
        assert tensorboardX.writer.numpy_compatible is __import__("numpy").ndarray
        assert torch.ones(2).sum().item() == 2.0
    """)
    subprocess.run([sys.executable, "-c", code], check=True)
    from tensorboard.backend.event_processing import event_accumulator

    acc = event_accumulator.EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(1, 2.5)]


def test_multi_writer_fans_out_and_closes_all(tmp_path):
    class Recorder:
        def __init__(self, fail_on_close=False):
            self.writes, self.closed, self.fail_on_close = [], False, fail_on_close

        def write(self, step, metrics):
            self.writes.append((step, dict(metrics)))

        def close(self):
            self.closed = True
            if self.fail_on_close:
                raise OSError("disk gone")

    a, b = Recorder(fail_on_close=True), Recorder()
    jsonl = JsonlWriter(tmp_path / "m.jsonl")
    multi = MultiWriter([a, jsonl, b])
    assert isinstance(multi, MetricsWriter)
    multi.write(1, {"train/loss": 2.0})
    multi.write(2, {"eval/loss": 1.5})
    with pytest.raises(OSError, match="disk gone"):
        multi.close()
    assert a.closed and b.closed  # closed even though the first one failed
    assert a.writes == b.writes == [(1, {"train/loss": 2.0}), (2, {"eval/loss": 1.5})]
    assert [r["step"] for r in read_jsonl_metrics(tmp_path / "m.jsonl")] == [1, 2]


def test_importing_observe_pulls_in_no_heavy_library():
    # `import axcore` itself imports JAX, so load axcore.observe under a bare parent
    # package to see what this package alone imports.
    code = textwrap.dedent("""
        import sys, types, pathlib, importlib.util
        spec = importlib.util.find_spec("axcore")
        pkg = types.ModuleType("axcore")
        pkg.__path__ = list(spec.submodule_search_locations)
        sys.modules["axcore"] = pkg
        import axcore.observe
        heavy = {"jax", "matplotlib", "tensorboardX", "tensorboard", "numpy"} & set(sys.modules)
        assert not heavy, heavy
    """)
    subprocess.run([sys.executable, "-c", code], check=True)


def test_registered_factories_build_writers_in_the_run_directory(tmp_path, registries):
    from axcore.config import from_dict
    from axcore.observe import JsonlWriterFactory, MetricsWriterFactory, TensorBoardWriterFactory

    assert registries.metrics_writers["jsonl"] is JsonlWriterFactory
    assert registries.metrics_writers["tensorboard"] is TensorBoardWriterFactory
    cfg = from_dict({"type": "jsonl", "fsync": True}, registries)
    factory = cfg.instantiate()
    assert isinstance(factory, MetricsWriterFactory)
    with factory.create(tmp_path) as writer:
        writer.write(3, {"train/loss": 1.25})
    assert read_jsonl_metrics(tmp_path / "metrics.jsonl")[0]["train/loss"] == 1.25
    tb = from_dict({"type": "tensorboard", "flush_secs": 1}, registries).instantiate().create(tmp_path)
    assert isinstance(tb, MetricsWriter)
    tb.write(1, {"x": 1.0})
    tb.close()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
