"""Reinforcement learning from verifiable rewards for axcore: the `grpo` objective (`axcore_rl.objective`),
rewards as registered components (`axcore_rl.rewards`, hook `axcore_register_rewards`), generated tasks
(`axcore_rl.tasks`), rollouts on the engine (`axcore_rl.rollout`), a training loop (`axcore_rl.loop`), the recipe over a
prompt file (`axcore_rl.recipe`) and, under `axcore train`, the `prompts` source (`axcore_rl.prompts`), the `rl:`
settings (`axcore_rl.settings`) and the rollout stage (`axcore_rl.stage`); docs/rl.md."""

from axcore_rl.loop import GrpoLoop, LoopSettings
from axcore_rl.objective import GRPO, GrpoError, group_advantages, grpo_loss, token_log_probs
from axcore_rl.prompts import PromptFileError, PromptFiles, load_prompts
from axcore_rl.recipe import train_grpo, train_grpo_run
from axcore_rl.rewards import ExactMatch, FormatCheck, PythonReward, Reward, RewardError, score
from axcore_rl.rollout import Rollout, preference_batch, rollout_batch, sample_rollouts
from axcore_rl.settings import RlSettings
from axcore_rl.stage import RolloutStage
from axcore_rl.tasks import TaskError, generate_tasks, write_jsonl

__all__ = ["GRPO", "ExactMatch", "FormatCheck", "GrpoError", "GrpoLoop", "LoopSettings", "PromptFileError", "PromptFiles", "PythonReward",
           "Reward", "RewardError", "RlSettings", "Rollout", "RolloutStage", "TaskError", "generate_tasks", "group_advantages", "grpo_loss", "load_prompts", "preference_batch", "rollout_batch",
           "sample_rollouts", "score", "token_log_probs", "train_grpo", "train_grpo_run", "write_jsonl"]
