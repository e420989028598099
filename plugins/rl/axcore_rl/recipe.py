"""The GRPO recipe over a prompt file: `train_grpo(model, params, tokenizer, prompts, ...)` or, from a run
directory, `train_grpo_run(path, prompts, ...)` (the run's model, parameters, tokenizer and end-of-sequence token).

The prompt source is JSONL, one object per line with a prompt and an answer field
(`load_prompts`, `axcore_rl.prompts`; `axcore_rl.tasks.write_jsonl` writes generated tasks in that form).
With `chat=True` each prompt is a user message rendered with the tokenizer's chat
template and a generation prompt (`axcore.data.chat.render_prompt`, what `axcore
generate --chat` feeds), else the prompt text is encoded as is. `trainable` (a regex over
'/'-joined parameter paths) limits the optimiser to matching leaves, e.g. `lora_` under
the lora plugin; the others stay as they are (None: every leaf trains). Each step's
metrics (`axcore_rl.loop`) are appended as one JSON line `{"step": k, ...}` to
`metrics_path` when it is given, and returned.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

import jax
import optax

from axcore import AxcoreError
from axcore.data.tokenizer import Tokenizer
from axcore.engine import Engine, EngineConfig

from axcore_rl.loop import GrpoLoop, LoopSettings
from axcore_rl.objective import GRPO
from axcore_rl.prompts import PromptFileError, load_prompts, prompt_encoder
from axcore_rl.rewards import Reward


def trainable_optimizer(optimizer: optax.GradientTransformation, params: Any,
                        trainable: str | None) -> optax.GradientTransformation:
    """`optimizer` on the leaves whose '/'-joined path matches `trainable` (all if None); zero updates elsewhere."""
    if trainable is None:
        return optimizer
    regex = re.compile(trainable)
    labels = jax.tree_util.tree_map_with_path(
        lambda path, _: "train" if regex.search("/".join(str(getattr(k, "key", k)) for k in path)) else "freeze",
        params)
    if "train" not in jax.tree.leaves(labels):
        raise AxcoreError(f"trainable {trainable!r} matches no parameter; name leaves of the model (e.g. 'lora_').")
    return optax.multi_transform({"train": optimizer, "freeze": optax.set_to_zero()}, labels)


def train_grpo(model: Any, params: Any, tokenizer: Tokenizer, samples: Sequence[dict], rewards: Sequence[Reward], *,
               steps: int, objective: GRPO | None = None, settings: LoopSettings | None = None,
               learning_rate: float = 1e-5, trainable: str | None = None, chat: bool = True,
               engine_config: EngineConfig | None = None, eos_token_ids: Sequence[int] = (),
               metrics_path: str | None = None) -> tuple[Any, list[dict[str, float]]]:
    """`steps` GRPO steps (module docstring); returns (the final parameters, each step's metrics)."""
    settings = settings or LoopSettings()
    objective = objective or GRPO.default_config().set(temperature=settings.temperature).instantiate()
    engine = Engine(model, params, tokenizer, config=engine_config, eos_token_ids=eos_token_ids)
    optimizer = trainable_optimizer(optax.adam(learning_rate), params, trainable)
    loop = GrpoLoop(model, params, objective, optimizer, engine, samples, prompt_encoder(tokenizer, chat=chat),
                    lambda ids: tokenizer.decode([t for t in ids if t not in eos_token_ids]), rewards, settings)
    history = []
    try:
        for step in range(steps):
            history.append(loop.step())
            if metrics_path is not None:
                with open(metrics_path, "a", encoding="utf-8") as f:
                    f.write(json.dumps({"step": step + 1, **history[-1]}) + "\n")
    finally:
        engine.close()
    return loop.params, history


def train_grpo_run(path: str, samples: Sequence[dict], rewards: Sequence[Reward], **kwargs: Any):
    """`train_grpo` on the model of the run directory `path` (its parameters, tokenizer and end-of-sequence token)."""
    from axcore.inference.run_loading import load_model

    loaded = load_model(path)
    tokenizer = loaded.experiment.config.tokenizer.instantiate()
    eos = () if tokenizer.eos_id is None else (tokenizer.eos_id,)
    return train_grpo(loaded.model, loaded.params, tokenizer, samples, rewards, eos_token_ids=eos, **kwargs)


__all__ = ["PromptFileError", "load_prompts", "prompt_encoder", "train_grpo", "train_grpo_run",
           "trainable_optimizer"]
