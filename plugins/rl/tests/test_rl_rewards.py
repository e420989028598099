"""Rewards as registered components (the rl plugin's own hook) and the seeded task generator."""

import logging
import operator
import re

import numpy as np
import pytest

import axcore
from axcore.plugin.loading import create_plugin_manager

import axcore_rl.plugin
from axcore_rl import ExactMatch, FormatCheck, PythonReward, Reward, RewardError, generate_tasks, score
from axcore_rl.tasks import TaskError


def _reward(klass, **fields):
    return klass.default_config().set(**fields).instantiate()


class Length(Reward):
    """A reward another plugin ships: minus the completion's length."""

    def __call__(self, completion, sample):
        return -float(len(completion))


class OtherPlugin:
    @axcore.hookimpl
    def axcore_register_rewards(self, register):
        register("length", Length)


def test_rewards_register_through_the_plugins_own_hook():
    manager = create_plugin_manager(["rl", "other"], objects={"rl": axcore_rl.plugin, "other": OtherPlugin()})
    rewards = manager.registries.rewards
    assert {"exact_match", "format", "python", "length"} <= set(rewards.names())
    assert rewards["length"] is Length and rewards["exact_match"] is ExactMatch


def test_exact_match_final_number_and_regex():
    final = _reward(ExactMatch)
    assert final("3+4 makes 7.", {"answer": "7"}) == 1.0
    assert final("7 or maybe 8", {"answer": "7"}) == 0.0  # The LAST number counts.
    assert final("1,234", {"answer": "1234"}) == 1.0 and final("no number", {"answer": "0"}) == 0.0
    tagged = _reward(ExactMatch, extract="regex", pattern=r"<answer>(.*?)</answer>")
    assert tagged("think <answer> 42 </answer>", {"answer": "42"}) == 1.0
    assert tagged("42", {"answer": "42"}) == 0.0
    with pytest.raises(RewardError, match="'pattern' is unset"):
        _reward(ExactMatch, extract="regex")


def test_format_check_matches_the_whole_completion():
    fmt = _reward(FormatCheck, pattern=r"<think>.*</think><answer>\d+</answer>", score=0.5)
    assert fmt("<think>a\nb</think><answer>3</answer>", {}) == 0.5
    assert fmt("<think>a</think><answer>3</answer> extra", {}) == 0.0


def test_a_python_callable_named_in_the_config(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text("def brevity(completion, sample):\n    return 1.0 / (1 + len(completion))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    reward = _reward(PythonReward, function="my_rewards:brevity")
    assert reward("abc", {}) == 0.25
    with pytest.raises(RewardError, match="python reward 'function': cannot load 'my_rewards:missing'"):
        _reward(PythonReward, function="my_rewards:missing")
    with pytest.raises(RewardError, match="is not 'module:attribute'"):
        _reward(PythonReward, function="brevity")


FAILS_ON_SEVEN = """
def score(completion, sample):
    if "7" in completion:
        raise ZeroDivisionError("no sevens\\nsecond line")
    return 1.0
"""


def test_a_reward_that_raises_is_one_line_naming_it_and_the_sample_and_scores_zero(caplog, tmp_path, monkeypatch):
    (tmp_path / "sevens.py").write_text(FAILS_ON_SEVEN)
    monkeypatch.syspath_prepend(str(tmp_path))
    rewards = [_reward(PythonReward, function="sevens:score"), _reward(ExactMatch, weight=2.0)]
    samples = [{"prompt": "3+4=", "answer": "7"}, {"prompt": "1+1=", "answer": "2"}]
    with caplog.at_level(logging.WARNING):
        got = score(rewards, ["7", "2"], samples)
    np.testing.assert_array_equal(got, [0.0 + 2.0, 1.0 + 2.0])
    [record] = caplog.records
    message = record.getMessage()
    assert "\n" not in message
    assert re.fullmatch(r"reward 'python' failed on sample 0 \(prompt '3\+4='\): ZeroDivisionError: no sevens; "
                        r"scored 0", message), message
    # A thread pool gives the same scores.
    np.testing.assert_array_equal(score(rewards, ["7", "2"] * 4, samples * 4, workers=3), np.tile(got, 4))


def test_tasks_are_seeded_and_their_answers_are_right():
    for kind in ("arithmetic", "sorting", "counting"):
        assert generate_tasks(kind, 20, seed=3, difficulty=3) == generate_tasks(kind, 20, seed=3, difficulty=3)
        assert generate_tasks(kind, 20, seed=3) != generate_tasks(kind, 20, seed=4)
    for s in generate_tasks("arithmetic", 50, seed=1, difficulty=3):
        a, op, b = re.fullmatch(r"(\d+)([-+*])(\d+)=", s["prompt"]).groups()
        assert int(s["answer"]) == {"+": operator.add, "-": operator.sub, "*": operator.mul}[op](int(a), int(b))
    one_digit = generate_tasks("arithmetic", 400, seed=0, max_sum=9)
    answers = [int(s["answer"]) for s in one_digit]
    assert set(answers) == set(range(10)) and max(np.bincount(answers)) < 60  # Uniform-ish: no safe guess.
    for s in generate_tasks("sorting", 20, seed=2, difficulty=2):
        numbers = [int(x) for x in s["prompt"].removeprefix("sort ").rstrip(":").split()]
        assert len(numbers) == 4 and s["answer"] == " ".join(str(x) for x in sorted(numbers))
    for s in generate_tasks("counting", 20, seed=2, difficulty=2):
        letter, text = re.fullmatch(r"count (\w) in (\w+):", s["prompt"]).groups()
        assert len(text) == 8 and int(s["answer"]) == text.count(letter)
    with pytest.raises(TaskError, match="use one of arithmetic, sorting, counting"):
        generate_tasks("chess", 1)
