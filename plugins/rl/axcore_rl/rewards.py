"""Rewards: registered components that score one completion of one sample (`axcore_register_rewards`).

A reward is a `Reward` subclass; `reward(completion, sample)` returns a float for the
completion's text and the sample it answers (a dict with at least `prompt`; the tasks
add `answer`). Built-ins (registered by this plugin):

- `exact_match`: 1.0 if the answer extracted from the completion equals `sample[field]`
  (both stripped), else 0.0. `extract: final_number` takes the last number in the text
  (`-?\\d+(\\.\\d+)?`, commas dropped, compared as numbers); `extract: regex` takes
  group 1 of the first match of `pattern` (the whole match without groups).
- `format`: `score` if the completion matches `pattern` (`re.fullmatch`, DOTALL), else 0.0.
- `python`: the callable `function` ("module:attribute") called as `fn(completion, sample)`.

`score(rewards, completions, samples)` sums the rewards' weighted scores per completion.
A reward that raises (or returns something not a finite number) scores 0 for that
completion and logs ONE line naming the reward and the sample index; the run goes on.
With `workers` > 1 the completions are scored in a thread pool (rewards must then be
thread-safe; the built-ins are).
"""

from __future__ import annotations

import importlib
import logging
import math
import re
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import numpy as np

from axcore import AxcoreError
from axcore.config import Configurable

logger = logging.getLogger(__name__)

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


class RewardError(AxcoreError):
    """A reward's settings cannot work (names the field and what to do)."""


class Reward(Configurable):
    """Base of registered rewards: `__call__(completion, sample) -> float` (module docstring)."""

    class Config(Configurable.Config):
        """Configures Reward."""

        # Multiplies this reward's score in the sum over rewards.
        weight: float = 1.0

    def __call__(self, completion: str, sample: dict[str, Any]) -> float:
        raise NotImplementedError(f"{type(self).__name__} must implement __call__(completion, sample).")


def final_number(text: str) -> float | None:
    """The last number in `text` (commas dropped), or None.

    >>> final_number("so 12 + 30 = 42."), final_number("none")
    (42.0, None)
    """
    found = NUMBER.findall(text)
    return float(found[-1].replace(",", "")) if found else None


class ExactMatch(Reward):
    """1.0 if the answer extracted from the completion equals the sample's answer, else 0.0."""

    class Config(Reward.Config):
        """Configures ExactMatch."""

        # How the answer is found: the last number in the text, or `pattern`'s group 1 (or whole match).
        extract: Literal["final_number", "regex"] = "final_number"
        # The regex of `extract: regex` (searched; group 1 if it has groups).
        pattern: str | None = None
        # The sample's field holding the expected answer.
        field: str = "answer"

    def __init__(self, cfg):
        super().__init__(cfg)
        cfg = self._config
        if cfg.extract == "regex" and not cfg.pattern:
            raise RewardError("exact_match reward: 'extract' is regex but 'pattern' is unset; give a pattern "
                              "(e.g. 'answer: (\\S+)') or use extract: final_number.")
        self._regex = re.compile(cfg.pattern) if cfg.pattern else None

    def __call__(self, completion: str, sample: dict[str, Any]) -> float:
        expected = str(sample[self._config.field]).strip()
        if self._config.extract == "final_number":
            got, want = final_number(completion), final_number(expected)
            return float(got is not None and want is not None and got == want)
        match = self._regex.search(completion)
        if match is None:
            return 0.0
        return float((match.group(1) if match.groups() else match.group(0)).strip() == expected)


class FormatCheck(Reward):
    """`score` if the completion fully matches `pattern`, else 0.0."""

    class Config(Reward.Config):
        """Configures FormatCheck."""

        # The regex the whole completion must match (re.fullmatch with DOTALL).
        pattern: str = r".*"
        # The score of a completion that matches.
        score: float = 1.0

    def __init__(self, cfg):
        super().__init__(cfg)
        self._regex = re.compile(self._config.pattern, re.DOTALL)

    def __call__(self, completion: str, sample: dict[str, Any]) -> float:
        return self._config.score if self._regex.fullmatch(completion) else 0.0


def load_callable(spec: str, where: str) -> Callable[..., Any]:
    """The object named by "module:attribute" (dots allowed in both); RewardError naming `where` otherwise."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise RewardError(f"{where}: {spec!r} is not 'module:attribute'; name the function as e.g. "
                          f"'my_rewards:score'.")
    try:
        value: Any = importlib.import_module(module_name)
        for part in attribute.split("."):
            value = getattr(value, part)
    except (ImportError, AttributeError) as e:
        raise RewardError(f"{where}: cannot load {spec!r} ({type(e).__name__}: {e}); check the module is "
                          f"importable (PYTHONPATH) and defines it.") from None
    if not callable(value):
        raise RewardError(f"{where}: {spec!r} is not callable; name a function (completion, sample) -> float.")
    return value


class PythonReward(Reward):
    """The score of a Python callable named in the config: `fn(completion, sample) -> float`."""

    class Config(Reward.Config):
        """Configures PythonReward."""

        # "module:attribute" of the function (completion: str, sample: dict) -> float.
        function: str = ""

    def __init__(self, cfg):
        super().__init__(cfg)
        self._fn = load_callable(self._config.function, "python reward 'function'")

    def __call__(self, completion: str, sample: dict[str, Any]) -> float:
        return self._fn(completion, sample)


# The built-in rewards by registered name (registered by `axcore_rl.plugin`).
REWARDS = {"exact_match": ExactMatch, "format": FormatCheck, "python": PythonReward}


def reward_name(reward: Reward) -> str:
    """The name a reward is known by in messages: its registered name, else its class name."""
    names = {klass: name for name, klass in REWARDS.items()}
    return names.get(type(reward), type(reward).__name__)


def _score_one(rewards: Sequence[tuple[Reward, float]], completion: str, sample: dict, index: int) -> float:
    total = 0.0
    for reward, weight in rewards:
        try:
            value = float(reward(completion, sample))
            if not math.isfinite(value):
                raise ValueError(f"returned {value}")
        except Exception as e:  # A reward's failure is one line and a 0, never a crashed run.
            prompt = str(sample.get("prompt", ""))[:40]
            logger.warning("reward '%s' failed on sample %d (prompt %r): %s: %s; scored 0",
                           reward_name(reward), index, prompt, type(e).__name__, str(e).splitlines()[0] if str(e)
                           else "")
            value = 0.0
        total += weight * value
    return total


def score(rewards: Sequence[Reward], completions: Sequence[str], samples: Sequence[dict], *,
          workers: int = 1) -> np.ndarray:
    """`[n]` float32: the weighted sum of `rewards` for each (completion, sample) pair (module docstring)."""
    if len(completions) != len(samples):
        raise RewardError(f"score: {len(completions)} completions for {len(samples)} samples; give one sample each.")
    weighted = [(reward, reward.config.weight) for reward in rewards]
    jobs = [(weighted, c, s, i) for i, (c, s) in enumerate(zip(completions, samples))]
    if workers > 1:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            values = list(pool.map(lambda job: _score_one(*job), jobs))
    else:
        values = [_score_one(*job) for job in jobs]
    return np.asarray(values, np.float32)


__all__ = ["REWARDS", "ExactMatch", "FormatCheck", "PythonReward", "Reward", "RewardError", "final_number",
           "load_callable", "score"]
