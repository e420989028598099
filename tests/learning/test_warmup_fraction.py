"""`warmup_fraction`: a schedule's warmup as a share of the run, as the `sft` recipe sets it (3%), checked against
the formula (linear warmup to the peak, then half a cosine to `end_fraction` of it)."""

import math

import pytest

from axcore.errors import ConfigError
from axcore.experiment import load_experiment
from axcore.learning.schedules import Cosine
from axcore.trainer.learner import LearnerConfig, learning_rate_schedule


def _expected(step, warmup, total, peak, end_fraction):
    if step < warmup:
        return peak * step / warmup
    t = min((step - warmup) / (total - warmup), 1.0)
    return peak * (end_fraction + (1 - end_fraction) * 0.5 * (1 + math.cos(math.pi * t)))


@pytest.mark.parametrize("max_steps, warmup", [(1000, 30), (30, 1), (200, 6)])
def test_the_sft_recipes_warmup_fits_the_run(max_steps, warmup):
    """The recipe's 3%: 30 warmup steps of its 1000, 1 of a 30-step run (not all 30, as a fixed 30 gave)."""
    learner = load_experiment("sft", [f"trainer.max_steps={max_steps}"]).config.trainer.learner
    assert learner.schedule.warmup_fraction == 0.03 and learner.schedule.warmup_steps == 0
    schedule = learning_rate_schedule(learner, max_steps)
    peak = learner.learning_rate
    for step in sorted({0, warmup - 1, warmup, warmup + 1, max_steps // 2, max_steps - 1, max_steps}):
        assert float(schedule(step)) == pytest.approx(_expected(step, warmup, max_steps, peak, 0.0), abs=1e-6 * peak)
    assert float(schedule(warmup)) == pytest.approx(peak)  # The peak is reached, early in the run.


def test_warmup_fraction_of_a_fixed_length_and_both_settings_refused():
    def schedule(**fields):
        return learning_rate_schedule(LearnerConfig(learning_rate=1.0, schedule=Cosine.default_config().set(**fields)), 50)

    fifth = schedule(warmup_fraction=0.2, end_fraction=0.0)  # 10 of 50 steps.
    for step in [0, 5, 10, 30, 50]:
        assert float(fifth(step)) == pytest.approx(_expected(step, 10, 50, 1.0, 0.0), abs=1e-6), step
    assert float(schedule(warmup_fraction=0.001)(1)) == pytest.approx(1.0)  # Above 0: at least one step.
    with pytest.raises(ConfigError, match=r"sets both warmup_steps \(30\) and warmup_fraction \(0.1\)"):
        schedule(warmup_steps=30, warmup_fraction=0.1)


def test_both_warmups_are_refused_when_the_experiment_loads():
    """`--set ...warmup_steps=5` on the recipe (which sets the fraction): refused by `axcore config`, not in training."""
    with pytest.raises(ConfigError, match=r"'trainer.learner.schedule.warmup_fraction' is set \(0.03\) beside "
                                          r"warmup_steps \(5\); set one of them"):
        load_experiment("sft", ["trainer.learner.schedule.warmup_steps=5"])
    load_experiment("sft", ["trainer.learner.schedule.warmup_steps=5", "trainer.learner.schedule.warmup_fraction=null"])
