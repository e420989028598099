"""Reinforcement learning from verifiable rewards for axcore: the `grpo` objective (`axcore_rl.objective`),
rewards as registered components (`axcore_rl.rewards`, hook `axcore_register_rewards`), generated tasks
(`axcore_rl.tasks`), rollouts on the engine (`axcore_rl.rollout`) and a training loop (`axcore_rl.loop`)."""

from axcore_rl.loop import GrpoLoop, LoopSettings
from axcore_rl.objective import GRPO, GrpoError, group_advantages, grpo_loss, token_log_probs
from axcore_rl.rewards import ExactMatch, FormatCheck, PythonReward, Reward, RewardError, score
from axcore_rl.rollout import Rollout, rollout_batch, sample_rollouts
from axcore_rl.tasks import TaskError, generate_tasks, write_jsonl

__all__ = ["GRPO", "ExactMatch", "FormatCheck", "GrpoError", "GrpoLoop", "LoopSettings", "PythonReward", "Reward",
           "RewardError", "Rollout", "TaskError", "generate_tasks", "group_advantages", "grpo_loss", "rollout_batch",
           "sample_rollouts", "score", "token_log_probs", "write_jsonl"]
