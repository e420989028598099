"""GRPO with LoRA on a SmolLM-135M-shaped Llama (issue 37): reward curve and time per step against TRL's
GRPOTrainer, the rollout's overhead against the engine alone, and peak memory with and without a reference model.

    python -m benchmarks.rl_135m prepare --work W [--layers 30]       # the model, import, LoRA run, prompts
    python -m benchmarks.rl_135m axcore --work W [--steps 50]         # GRPO on axcore, rollout vs engine alone
    python -m benchmarks.rl_135m trl --work W [--steps 50] [--python /work/trl-venv/bin/python]
    python -m benchmarks.rl_135m memory --work W [--steps 2]          # one subprocess per reference variant
    python -m benchmarks.rl_135m report --work W                      # results/rl_135m.json from the parts

The model: the SmolLM-135M shape of `benchmarks.generate_load` with RANDOM weights (no
checkpoint of the real model is on this machine, and nothing is downloaded), saved by
transformers as safetensors with a word-level tokenizer (`<unk> <s> </s> <pad>`, the
characters `0-9 + =` and words `w16 ... w49151`, decoded with spaces), imported with
`axcore convert hf-to-axcore` and given LoRA adapters with `axcore lora init` (rank 16,
alpha 32 on q|k|v|o|gate|up|down, the same as PEFT's `target_modules` for TRL).

The task: the seeded arithmetic prompts of `axcore_rl.tasks` ("3+4=", plain text, no chat
template), `prompts_per_step` x G completions per step. A random-weight model never
answers them, so exact match would score 0 everywhere and give no gradient. The reward is
instead one a random model gets signal from and LoRA can learn: the share of the
completion's tokens in a fixed half of the vocabulary, the words whose (tied) embedding
has a positive dot product with a seeded random direction (`good_words.json`; chance
level ~0.5; raising it means turning the last hidden state towards that direction).
`benchmarks.rl_trl.aligned_fraction` scores it on both sides.

- `axcore`: `axcore_rl.GrpoLoop` on the LoRA run (`trainable: lora_`, Adam, GRPO
  sequence loss, `beta` with `reference: lora_b`, the base as reference, no copy). After each
  training step the same prompts, G, max tokens, temperature and seed go through a second
  `Engine` built on the initial parameters and never updated (`Engine.generate` alone,
  what serving does); the two are alternated step by step, and the medians after the first
  `--skip` steps (compilation) give the rollout's overhead inside training.
- `trl`: `benchmarks/rl_trl.py` in TRL's own venv on the same model directory and
  settings; the prompts in the axcore loop's order (`trl_prompts.jsonl`, `shuffle_dataset`
  off), so step k of both sees the same prompts.
- `memory`: a fresh process per variant runs `--steps` GRPO steps and reports its peak RSS
  (`ru_maxrss`) and XLA's `memory_analysis()` of the compiled update (and reference pass):
  `beta_0` (no reference), `lora_b` (the base as reference), `frozen_copy`
  (`reference: null`, the initial parameters kept as objective state).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from benchmarks.common import machine_info, write_result
from benchmarks.rl_trl import aligned_fraction

ROOT = pathlib.Path(__file__).resolve().parent.parent
SPECIALS = ("<unk>", "<s>", "</s>", "<pad>")
CHARS = "0123456789+="
SETTINGS = dict(prompts_per_step=4, group_size=4, max_tokens=16, seq_len=32, learning_rate=5e-4, lora_rank=16,
                lora_alpha=32.0, lora_targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                               "down_proj"], beta=0.04, temperature=1.0, seed=0, max_steps=50)
VARIANTS = {"beta_0": (0.0, None), "lora_b": (0.04, "lora_b"), "frozen_copy": (0.04, None)}


def _axcore(*args: str) -> None:
    from benchmarks.common import axcore_command

    subprocess.run([*axcore_command(), *args], check=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))


def prepare(work: pathlib.Path, layers: int) -> None:
    """Writes the HF model and tokenizer, the import, the LoRA run, the prompts and the settings under `work`."""
    import numpy as np
    import tokenizers
    import torch
    import transformers

    from benchmarks.generate_load import SMOLLM_135M

    from axcore_rl import generate_tasks, write_jsonl

    work.mkdir(parents=True, exist_ok=True)
    shape = dict(SMOLLM_135M, num_hidden_layers=layers, bos_token_id=1, eos_token_id=2, pad_token_id=3)
    hf = work / "hf"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape))
    model.save_pretrained(hf, safe_serialization=True)
    words = [*SPECIALS, *CHARS]
    words += [f"w{i}" for i in range(len(words), shape["vocab_size"])]
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, "<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split(tokenizers.Regex(r"w\d+|\S"), "isolated")
    tok.add_special_tokens(list(SPECIALS))
    tok.save(str(hf / "tokenizer.json"))
    (hf / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>",
        "pad_token": "<pad>", "model_max_length": 2048}), "utf-8")
    embedding = model.get_input_embeddings().weight.detach().numpy()
    direction = np.random.default_rng(1).standard_normal(embedding.shape[1])
    good = [w for i, w in enumerate(words) if i >= len(SPECIALS) + len(CHARS) and embedding[i] @ direction > 0]
    (work / "good_words.json").write_text(json.dumps(good), "utf-8")
    samples = generate_tasks("arithmetic", 256, seed=0)
    write_jsonl(str(work / "prompts.jsonl"), samples)
    rng_order = [samples[i] for step in range(SETTINGS["max_steps"])
                 for i in np.random.default_rng([SETTINGS["seed"], step]).choice(
                     len(samples), SETTINGS["prompts_per_step"], replace=False)]
    write_jsonl(str(work / "trl_prompts.jsonl"), rng_order)
    (work / "settings.json").write_text(json.dumps({**SETTINGS, "layers": layers}, indent=1), "utf-8")
    _axcore("convert", "hf-to-axcore", str(hf), str(work / "import"))
    _axcore("lora", "init", str(work / "import"), str(work / "lora"), "--rank", str(SETTINGS["lora_rank"]),
            "--alpha", str(SETTINGS["lora_alpha"]))


class Reward:
    """`aligned_fraction` as an axcore_rl reward (built lazily: axcore_rl is imported inside functions)."""

    @staticmethod
    def make(good: frozenset[str]):
        from axcore_rl import Reward as Base

        class Aligned(Base):
            def __call__(self, completion, sample):
                return aligned_fraction(completion, good)

        return Aligned.default_config().instantiate()


def build(work: pathlib.Path, variant: str = "lora_b") -> dict[str, Any]:
    """The LoRA run's model, parameters, tokenizer, engine configuration and a `GrpoLoop` for `variant`."""
    import jax
    import jax.numpy as jnp
    import optax

    from axcore.engine import Engine, EngineConfig
    from axcore.inference.run_loading import load_model

    from axcore_rl import GRPO, GrpoLoop, LoopSettings
    from axcore_rl.recipe import load_prompts, prompt_encoder, trainable_optimizer

    s = json.loads((work / "settings.json").read_text("utf-8"))
    beta, reference = VARIANTS[variant]
    loaded = load_model(work / "lora")
    # The restored leaves carry PartitionSpec(None, None); a jitted update returns the equivalent P(), which
    # `Engine.update_weights` refuses as a different sharding. One jitted copy gives the update's own shardings.
    loaded = dataclasses.replace(loaded, params=jax.jit(lambda tree: jax.tree.map(jnp.copy, tree))(loaded.params))
    tokenizer = loaded.experiment.config.tokenizer.instantiate()
    rows = s["prompts_per_step"] * s["group_size"]
    engine_config = EngineConfig(block_size=16, num_blocks=2 * rows + 4, max_seqs=rows, max_tokens_per_step=rows * s["seq_len"],
                                 max_model_len=s["seq_len"], batch_buckets=(rows,), token_buckets=(1, rows, s["seq_len"]),
                                 split_mixed_steps=False, kernels={"paged_attention": "xla"})
    eos = (tokenizer.eos_id,)
    engine = Engine(loaded.model, loaded.params, tokenizer, config=engine_config, eos_token_ids=eos)
    objective = GRPO.default_config().set(beta=beta, reference=reference, temperature=s["temperature"],
                                          loss_type="sequence").instantiate()
    optimizer = trainable_optimizer(optax.adam(s["learning_rate"]), loaded.params, "lora_")
    good = frozenset(json.loads((work / "good_words.json").read_text("utf-8")))
    settings = LoopSettings(prompts_per_step=s["prompts_per_step"], group_size=s["group_size"],
                            max_tokens=s["max_tokens"], temperature=s["temperature"], seq_len=s["seq_len"],
                            seed=s["seed"])
    encode = prompt_encoder(tokenizer, chat=False)
    loop = GrpoLoop(loaded.model, loaded.params, objective, optimizer, engine, load_prompts(str(work / "prompts.jsonl")),
                    encode, lambda ids: tokenizer.decode([t for t in ids if t not in eos]), [Reward.make(good)],
                    settings)
    return {"loaded": loaded, "tokenizer": tokenizer, "engine_config": engine_config, "eos": eos, "loop": loop,
            "settings": s, "encode": encode}


def run_axcore(work: pathlib.Path, steps: int, skip: int) -> dict[str, Any]:
    """`steps` GRPO steps, each followed by the same rollout on a standalone engine; per-step metrics and medians."""
    import numpy as np

    from axcore.engine import Engine

    from axcore_rl import sample_rollouts

    built = build(work)
    loop, s = built["loop"], built["settings"]
    (work / "axcore_steps.jsonl").unlink(missing_ok=True)
    alone = Engine(built["loaded"].model, built["loaded"].params, built["tokenizer"], config=built["engine_config"],
                   eos_token_ids=built["eos"])
    history, engine_only = [], []
    start = time.perf_counter()
    for step in range(steps):
        metrics = loop.step()
        rng = np.random.default_rng([s["seed"], step])  # The loop's own choice of prompts for this step.
        chosen = [loop.samples[i] for i in rng.choice(len(loop.samples), s["prompts_per_step"], replace=False)]
        replay = sample_rollouts(alone, [built["encode"](x["prompt"]) for x in chosen], s["group_size"],
                                 max_tokens=s["max_tokens"], temperature=s["temperature"],
                                 seed=s["seed"] * 1000003 + step, stop_token_ids=())
        metrics.update(engine_only_seconds=replay.seconds, engine_only_tokens=replay.num_tokens,
                       step_seconds=time.perf_counter() - start - sum(m["step_seconds"] for m in history)
                       - sum(engine_only) - replay.seconds)
        engine_only.append(replay.seconds)
        history.append(metrics)
        print(json.dumps({"step": step + 1, **{k: round(v, 4) for k, v in metrics.items()}}), flush=True)
        with open(work / "axcore_steps.jsonl", "a", encoding="utf-8") as f:  # Kept if the run is cut short.
            f.write(json.dumps({"step": step + 1, **metrics}) + "\n")
    alone.close()
    loop.engine.close()
    return {**summarize_axcore(history, skip), "wall_seconds": time.perf_counter() - start}


def summarize_axcore(history: list[dict[str, float]], skip: int, stopped_early: bool = False) -> dict[str, Any]:
    """The axcore contender's result from its per-step metrics: medians after the first `skip` steps."""
    steady = history[skip:] or history
    rollout = [m["rollout_seconds"] for m in steady]
    alone_s = [m["engine_only_seconds"] for m in steady]
    return {
        "contender": "axcore", "steps": len(history), "skip": skip, "stopped_early": stopped_early,
        "per_step": history, "reward_curve": [round(m["reward_mean"], 4) for m in history],
        "rollout_seconds_median": statistics.median(rollout),
        "engine_only_seconds_median": statistics.median(alone_s),
        "rollout_over_engine_only": statistics.median(a / b for a, b in zip(rollout, alone_s)),
        "step_seconds_median": statistics.median(m["step_seconds"] for m in steady),
        "learn_seconds_median": statistics.median(m["learn_seconds"] for m in steady),
        "logprob_mismatch_max": max(m["logprob_mismatch"] for m in history),
    }


def memory_variant(work: pathlib.Path, variant: str, steps: int) -> dict[str, Any]:
    """In this process: `steps` GRPO steps of `variant`; peak RSS and the compiled update's memory analysis."""
    import jax

    built = build(work, variant)
    loop = built["loop"]
    for _ in range(steps):
        loop.step()
    import numpy as np

    from axcore_rl.rollout import rollout_batch, sample_rollouts  # A batch of the right shapes for lowering.

    s = built["settings"]
    rollout = sample_rollouts(loop.engine, [built["encode"]("1+2=")] * s["prompts_per_step"], s["group_size"],
                              max_tokens=s["max_tokens"], temperature=s["temperature"])
    batch = rollout_batch(rollout, np.zeros(len(rollout.completions), np.float32), s["seq_len"])
    if VARIANTS[variant][0] > 0:
        batch["ref_logprobs"] = np.zeros(batch["target_labels"].shape, np.float32)

    def analysis(fn, *args):
        stats = fn.lower(*args).compile().memory_analysis()
        keys = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "alias_size_in_bytes")
        return {k: int(getattr(stats, k)) for k in keys}

    update = analysis(loop._update, loop.params, loop.opt_state, batch, loop.objective_state)
    reference = analysis(loop._reference, loop.params, batch, loop.objective_state) if VARIANTS[variant][0] else None
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(loop.objective_state)) if loop.objective_state else 0
    return {"variant": variant, "beta": VARIANTS[variant][0], "reference": VARIANTS[variant][1], "steps": steps,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "objective_state_bytes": state_bytes,
            "param_bytes": sum(x.nbytes for x in jax.tree.leaves(loop.params)),
            "update_compiled": update, "reference_compiled": reference}


def run_memory(work: pathlib.Path, steps: int, rounds: int) -> dict[str, Any]:
    """Each variant in a fresh process, `rounds` times alternated; the per-variant results."""
    out: dict[str, list] = {v: [] for v in VARIANTS}
    for _ in range(rounds):
        for variant in VARIANTS:
            proc = subprocess.run([sys.executable, "-m", "benchmarks.rl_135m", "memory-variant", "--work", str(work),
                                   "--variant", variant, "--steps", str(steps)], capture_output=True, text=True,
                                  cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), check=False)
            if proc.returncode != 0:
                raise RuntimeError(f"memory variant {variant} failed:\n{proc.stderr[-3000:]}")
            out[variant].append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(variant, out[variant][-1]["peak_rss_bytes"] / 2**20, "MiB", flush=True)
    return out


def headlines(parts: dict[str, Any]) -> list[dict[str, Any]]:
    """benchmarks.run's summary rows: time per step of each contender, the rollout's overhead, peak memory."""
    rows = []
    for name in ("axcore", "trl"):
        if name in parts:
            rows.append({"metric": f"{name} seconds per GRPO step (median, {parts[name]['steps']} steps)",
                         "value": parts[name]["step_seconds_median_after_skip"]})
    if "axcore" in parts:
        rows.append({"metric": "rollout in training / engine alone (median of per-step ratios)",
                     "value": parts["axcore"]["rollout_over_engine_only"]})
    for variant, runs in parts.get("memory", {}).items():
        rows.append({"metric": f"peak RSS MiB, {variant}",
                     "value": statistics.median(r["peak_rss_bytes"] for r in runs) / 2**20})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.rl_135m", description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=["prepare", "axcore", "trl", "memory", "memory-variant", "report"])
    parser.add_argument("--work", required=True, type=pathlib.Path, help="work directory (model, runs, results)")
    parser.add_argument("--layers", type=int, default=30, help="decoder layers of the model (prepare)")
    parser.add_argument("--steps", type=int, default=50, help="GRPO steps (memory: steps before measuring)")
    parser.add_argument("--skip", type=int, default=3, help="first steps left out of the medians (compilation)")
    parser.add_argument("--rounds", type=int, default=1, help="memory: processes per variant")
    parser.add_argument("--variant", choices=list(VARIANTS), default="lora_b", help="memory-variant: which")
    parser.add_argument("--python", default="/work/trl-venv/bin/python", help="trl: the venv's interpreter")
    parser.add_argument("--result-name", default="rl_135m", help="report: results/<this>.json")
    args = parser.parse_args(argv)
    work = args.work.resolve()
    if args.part == "prepare":
        prepare(work, args.layers)
    elif args.part == "axcore":
        result = run_axcore(work, args.steps, args.skip)
        (work / "axcore.json").write_text(json.dumps(result, indent=1), "utf-8")
    elif args.part == "trl":
        subprocess.run([args.python, str(ROOT / "benchmarks" / "rl_trl.py"), "--work", str(work), "--steps",
                        str(args.steps), "--out", str(work / "trl.json")], check=True)
    elif args.part == "memory":
        (work / "memory.json").write_text(json.dumps(run_memory(work, args.steps, args.rounds), indent=1), "utf-8")
    elif args.part == "memory-variant":
        print(json.dumps(memory_variant(work, args.variant, args.steps)))
    else:
        # axcore_old_budget: an axcore run kept from before the rollout's token budget was raised (README).
        parts = {name: json.loads((work / f"{name}.json").read_text("utf-8"))
                 for name in ("axcore", "trl", "memory", "axcore_old_budget") if (work / f"{name}.json").exists()}
        if "axcore" not in parts and (work / "axcore_steps.jsonl").exists():  # Stopped early: its finished steps.
            steps = [json.loads(line) for line in (work / "axcore_steps.jsonl").read_text("utf-8").splitlines()]
            parts["axcore"] = summarize_axcore(steps, args.skip, stopped_early=True)
        if "trl" not in parts and (work / "trl_steps.jsonl").exists():  # A TRL run stopped early: its finished steps.
            steps = [json.loads(line) for line in (work / "trl_steps.jsonl").read_text("utf-8").splitlines()]
            parts["trl"] = {"contender": "trl", "steps": len(steps), "stopped_early": True, "per_step": steps,
                            "reward_curve": [round(x["reward_mean"], 4) for x in steps]}
        for name in ("axcore", "trl"):
            if name in parts:
                per_step = parts[name]["per_step"][args.skip:]
                key = "step_seconds" if name == "axcore" else "seconds"
                parts[name]["step_seconds_median_after_skip"] = statistics.median(x[key] for x in per_step)
        result = {"benchmark": "rl_135m", "settings": json.loads((work / "settings.json").read_text("utf-8")),
                  **parts, "headlines": headlines(parts), "load_average_at_report": os.getloadavg(),
                  "machine": machine_info()}
        print(write_result(args.result_name, result))


if __name__ == "__main__":
    main()
