"""ProgressBar: live '\\r' line on a terminal, plain log lines elsewhere, ETA."""

import io
import re

import pytest

from axcore.observe import ProgressBar, format_duration


class FakeTTY(io.StringIO):
    """A stream that says it is a terminal and keeps everything written to it."""

    def isatty(self):
        return True


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_format_duration():
    assert format_duration(50) == "0:00:50"
    assert format_duration(3725.4) == "1:02:05"
    assert format_duration(90000) == "25:00:00"
    assert format_duration(-3) == "0:00:00"


def test_eta_from_a_known_step_time():
    bar = ProgressBar(total_steps=200, stream=io.StringIO())
    bar.update(100, loss=2.0, tokens_per_sec=1000.0, step_time=0.5)
    assert bar.eta_seconds(100) == pytest.approx(50.0)
    assert "ETA 0:00:50" in bar.format_line(100, 2.0, 1000.0, 0.5)


def test_eta_uses_the_median_so_a_slow_compile_step_does_not_skew_it():
    bar = ProgressBar(total_steps=110, stream=io.StringIO(), window=5)
    for step, step_time in enumerate([30.0, 0.5, 0.5, 0.5, 0.5], start=1):
        bar.update(step, 2.0, 1000.0, step_time)
    assert bar.eta_seconds(10) == pytest.approx(0.5 * 100)


def test_tty_mode_rewrites_one_line_and_throttles():
    stream, clock = FakeTTY(), FakeClock()
    bar = ProgressBar(total_steps=300, stream=stream, start_step=100, clock=clock)
    for step in range(101, 301):
        clock.now += 0.01  # 100 updates a second: ~10 redraws a second get through
        bar.update(step, loss=2.51349, tokens_per_sec=10_900.0, step_time=0.19)
    bar.close()
    out = stream.getvalue()
    assert out.startswith("\r") and out.endswith("\n") and out.count("\n") == 1
    frames = out.rstrip("\n").split("\r")[1:]
    assert 15 <= len(frames) <= 25  # 2 s of updates at <= 10 redraws/s, plus the last
    assert frames[0].startswith("step 101/300 | loss 2.513 | 10.9k tok/s | 0.19 s/step | ETA 0:00:38")
    assert frames[-1].rstrip() == "step 300/300 | loss 2.513 | 10.9k tok/s | 0.19 s/step | ETA 0:00:00"
    for frame in frames:
        assert re.fullmatch(r"step \d+/300 \| loss \S+ \| \S+ tok/s \| \S+ s/step \| ETA \d+:\d\d:\d\d *", frame)


def test_tty_close_shows_a_throttled_final_status_and_pads_shorter_lines():
    stream, clock = FakeTTY(), FakeClock()
    bar = ProgressBar(total_steps=1000, stream=stream, clock=clock)
    bar.update(1, 123.456, 2.5e6, 12.0)  # drawn
    bar.update(2, 1.5, 950.0, 0.004)  # within 0.1 s: held back
    assert "step 2/" not in stream.getvalue()
    bar.close()  # run stopped early: the latest status is still shown
    frames = stream.getvalue().rstrip("\n").split("\r")[1:]
    assert frames[0] == "step 1/1000 | loss 123.5 | 2.5M tok/s | 12.00 s/step | ETA 3:19:48"
    assert frames[1].startswith("step 2/1000 | loss 1.5 | 950 tok/s | 4.00 ms/step | ETA")
    assert len(frames[1]) == len(frames[0])  # padded to wipe the longer previous line


def test_non_tty_mode_logs_every_log_every_steps_and_the_last():
    stream = io.StringIO()
    bar = ProgressBar(total_steps=35, stream=stream, log_every=10, start_step=3)  # resumed
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


def test_non_tty_close_logs_an_unlogged_final_step_once():
    stream = io.StringIO()
    bar = ProgressBar(total_steps=100, stream=stream, log_every=10)
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
        ProgressBar(total_steps=10, start_step=11, stream=io.StringIO())
    with pytest.raises(ValueError, match="log_every"):
        ProgressBar(total_steps=10, log_every=0, stream=io.StringIO())
