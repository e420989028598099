"""The trainer's input checks: data_wait and its warning, the batch schema against the model, data paths
checked by `axcore config` and refused by `axcore train` in one line."""

import io
import os

import pytest

from axcore import cli
from axcore.data import DataError
from axcore.experiment import load_experiment
from axcore.layers import CausalLM
from axcore.placement.inputs import DataWaitMeter
from axcore.testing import TINY_OVERRIDES
from axcore.trainer.trainer import Trainer


def test_data_wait_is_per_step_and_a_share_of_the_step_and_warns_once_after_the_first_interval():
    stream = io.StringIO()
    meter = DataWaitMeter(stream, threshold=0.1, skip_intervals=1)
    # First interval (compilation, first reads): a slow loader is not judged.
    assert meter.interval(0.5, 10, 0.1, 1, 10) == {"train/data_wait": 0.05, "train/data_wait_fraction": 0.5}
    assert stream.getvalue() == ""
    first = meter.interval(0.05, 10, 0.1, 11, 20)  # 5 ms of 100 ms: the step is the bottleneck.
    assert first["train/data_wait"] == pytest.approx(0.005) and first["train/data_wait_fraction"] == pytest.approx(0.05)
    assert stream.getvalue() == ""
    meter.interval(0.3, 10, 0.1, 21, 30)  # 30 ms of 100 ms.
    meter.interval(0.3, 10, 0.1, 31, 40)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "Warning: the input pipeline is the bottleneck: steps 21..30 waited 30.0 ms per step for data (30% of 100.0 ms)"
    )


def test_a_batch_field_the_model_does_not_accept_is_an_error_naming_it(monkeypatch):
    accepted = CausalLM.accepted_batch_fields
    monkeypatch.setattr(CausalLM, "accepted_batch_fields", lambda self: accepted(self) - {"segment_ids"})
    with pytest.raises(DataError, match=r"The batch carries \['segment_ids'\], which model \(CausalLM\) does not accept"):
        Trainer(load_experiment(None, TINY_OVERRIDES))


def test_config_checks_data_paths_and_train_refuses_them_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("XLA_FLAGS", raising=False)  # `axcore train` echoes it on stderr first.
    missing = ["--set", "input.source={type: prepared, paths: [data/shards]}"]
    assert cli.main(["config", "default", *missing]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("# data check: input.source.paths[0]: 'data/shards' is not a prepared-shard directory")
    assert cli.main(["config", "default"]) == 0 and capsys.readouterr().out.endswith("# data check: ok\n")
    argv = ["train", "default", *missing, *[a for o in [*TINY_OVERRIDES, "trainer.max_steps=1"] for a in ("--set", o)]]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("axcore: error: input.source.paths[0]: 'data/shards' is not a prepared")
    assert os.listdir(tmp_path) == []  # Refused before the run directory exists.
