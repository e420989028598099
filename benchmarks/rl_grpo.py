"""GRPO on the engine (plugins/rl) on a small model from scratch: reward curve, sampler-learner mismatch, rollout
time against the engine serving the same requests, learner time.

    python -m benchmarks.rl_grpo [--steps 40] [--compute-dtype bfloat16] [--dim 32] [--layers 2]

The task: one-digit addition with answers 0..`--max-sum` (one token of a 12-token
character vocabulary, `axcore_rl.tasks`), exact-match reward, `--prompts` prompts x
`--group` completions per step, Adam at `--lr`. Per step it records the mean reward,
`logprob_mismatch` (the largest |sampler - learner| log-probability of a sampled token on
the rollout's own parameters, in the model's compute dtype) and the rollout and learn
times. After training it replays the last step's requests on the final (frozen)
parameters through `Engine.generate` alone (`--rounds` times, after a warm-up) to give
the engine's own time for the same batch: the rollout's overhead is the difference.
Prints one JSON object. The 135M-shaped Llama with LoRA against TRL, and peak memory with
and without a reference model, are `benchmarks.rl_135m`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

CHARS = "0123456789+="


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.rl_grpo", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="GRPO steps")
    parser.add_argument("--compute-dtype", default="float32", help="model.compute_dtype (float32, bfloat16)")
    parser.add_argument("--dim", type=int, default=32, help="model width")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt (G)")
    parser.add_argument("--max-sum", type=int, default=5, help="largest answer")
    parser.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate")
    parser.add_argument("--rounds", type=int, default=3, help="timed engine-only replays of the last step")
    args = parser.parse_args(argv)

    import jax
    import numpy as np
    import optax

    from axcore.engine import Engine, EngineConfig
    from axcore.testing import load_tiny_experiment

    import axcore_rl.plugin
    from axcore_rl import GrpoLoop, LoopSettings, generate_tasks, sample_rollouts

    exp = load_tiny_experiment(["rl"], [f"model.dim={args.dim}", f"model.num_layers={args.layers}",
                                        f"model.compute_dtype={args.compute_dtype}"],
                               objects={"rl": axcore_rl.plugin})
    model = exp.config.model.clone(vocab_size=len(CHARS)).instantiate(name="model", registries=exp.registries)
    params = model.initialize(jax.random.key(0))
    rows = args.prompts * args.group
    engine = Engine(model, params, None, config=EngineConfig(
        block_size=4, num_blocks=2 * rows + 8, max_seqs=rows, max_tokens_per_step=rows, max_model_len=8,
        batch_buckets=(rows,), token_buckets=(1, 8)))
    samples = generate_tasks("arithmetic", 256, seed=0, max_sum=args.max_sum)
    encode = lambda text: [CHARS.index(c) for c in text]  # noqa: E731
    loop = GrpoLoop(model, params, axcore_rl.GRPO.default_config().instantiate(), optax.adam(args.lr), engine, samples, encode,
                    lambda ids: "".join(CHARS[i] for i in ids),
                    [exp.registries.rewards["exact_match"].default_config().instantiate()],
                    LoopSettings(prompts_per_step=args.prompts, group_size=args.group, max_tokens=1, seq_len=8,
                                 updates_per_rollout=2))
    start = time.perf_counter()
    history = [loop.step() for _ in range(args.steps)]
    total = time.perf_counter() - start
    prompts = [encode(s["prompt"]) for s in samples[:args.prompts]]
    sample_rollouts(engine, prompts, args.group, max_tokens=1, seed=10**6)  # Warm-up: nothing left to compile.
    engine_only = []
    for r in range(args.rounds):
        engine_only.append(sample_rollouts(engine, prompts, args.group, max_tokens=1, seed=10**6 + r + 1).seconds)
    steady = history[min(5, len(history) - 1):]  # Past the first steps' compilation.
    result = {
        "compute_dtype": args.compute_dtype, "steps": args.steps, "rows_per_step": rows,
        "reward_curve": [round(m["reward_mean"], 3) for m in history],
        "logprob_mismatch_max": max(m["logprob_mismatch"] for m in history),
        "rollout_seconds_median": statistics.median(m["rollout_seconds"] for m in steady),
        "engine_only_seconds_median": statistics.median(engine_only),
        "learn_seconds_median": statistics.median(m["learn_seconds"] for m in steady),
        "wall_seconds": round(total, 1), "backend": jax.default_backend(),
        "mean_reward_last_10": float(np.mean([m["reward_mean"] for m in history[-10:]])),
    }
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
