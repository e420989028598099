"""ProgressLog: one line per metrics fetch (terminal or not), ETA."""

import io

import pytest

from axcore.observe import ProgressLog, format_duration


class FakeTTY(io.StringIO):
    """A stream that says it is a terminal and keeps everything written to it."""

    def isatty(self):
        return True


def test_format_duration():
    assert format_duration(50) == "0:00:50"
    assert format_duration(3725.4) == "1:02:05"
    assert format_duration(90000) == "25:00:00"
    assert format_duration(-3) == "0:00:00"


def test_eta_from_a_known_step_time():
    bar = ProgressLog(total_steps=200, stream=io.StringIO())
    bar.update(100, loss=2.0, tokens_per_sec=1000.0, step_time=0.5)
    assert bar.eta_seconds(100) == pytest.approx(50.0)
    assert "ETA 0:00:50" in bar.format_line(100, 2.0, 1000.0, 0.5)


def test_eta_uses_the_median_so_a_slow_compile_step_does_not_skew_it():
    bar = ProgressLog(total_steps=110, stream=io.StringIO(), window=5)
    for step, step_time in enumerate([30.0, 0.5, 0.5, 0.5, 0.5], start=1):
        bar.update(step, 2.0, 1000.0, step_time)
    assert bar.eta_seconds(10) == pytest.approx(0.5 * 100)


def test_a_terminal_gets_the_same_lines_as_a_log_file():
    lines = {}
    for kind, stream in (("terminal", FakeTTY()), ("file", io.StringIO())):
        progress = ProgressLog(total_steps=30, stream=stream, log_every=10)
        for step in range(1, 31):
            progress.update(step, loss=2.51349, tokens_per_sec=10_900.0, step_time=0.19)
        progress.close()
        lines[kind] = stream.getvalue()
    assert "\r" not in lines["terminal"] and lines["terminal"] == lines["file"]
    assert lines["file"].splitlines() == [
        f"step {n}/30 | loss 2.513 | 10.9k tok/s | 0.19 s/step | ETA 0:00:{round(0.19 * (30 - n)):02d}" for n in (10, 20, 30)
    ]


def test_logs_every_log_every_steps_and_the_last():
    stream = io.StringIO()
    bar = ProgressLog(total_steps=35, stream=stream, log_every=10, start_step=3)  # resumed
    for step in range(4, 36):
        bar.update(step, loss=1.0, tokens_per_sec=500.0, step_time=0.5)
    bar.close()
    out = stream.getvalue()
    assert "\r" not in out and out.endswith("\n")
    lines = out.splitlines()
    assert [line.split(" |")[0] for line in lines] == [
        "step 10/35", "step 20/35", "step 30/35", "step 35/35"]
    assert lines[0] == "step 10/35 | loss 1 | 500 tok/s | 0.50 s/step | ETA 0:00:12"
    assert lines[-1].endswith("ETA 0:00:00")


def test_close_logs_an_unlogged_final_step_once():
    stream = io.StringIO()
    bar = ProgressLog(total_steps=100, stream=stream, log_every=10)
    for step in range(1, 14):
        bar.update(step, loss=None, tokens_per_sec=None, step_time=0.5)
    bar.close()
    bar.close()
    assert stream.getvalue().splitlines() == [
        "step 10/100 | loss - | - tok/s | 0.50 s/step | ETA 0:00:45",
        "step 13/100 | loss - | - tok/s | 0.50 s/step | ETA 0:00:44",
    ]


def test_bad_arguments():
    with pytest.raises(ValueError, match="start_step"):
        ProgressLog(total_steps=10, start_step=11, stream=io.StringIO())
    with pytest.raises(ValueError, match="log_every"):
        ProgressLog(total_steps=10, log_every=0, stream=io.StringIO())
