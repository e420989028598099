"""TRL's GRPOTrainer on the task of `benchmarks.rl_135m` (run in a venv with trl, peft, transformers, torch).

    /work/trl-venv/bin/python benchmarks/rl_trl.py --work WORK [--steps 50] [--out trl.json]

WORK is the directory `python -m benchmarks.rl_135m prepare` wrote: `hf/` (the random-weight
SmolLM-135M-shaped Llama and its tokenizer), `trl_prompts.jsonl` (the seeded arithmetic prompts,
plain text, in the order the axcore loop draws them), `good_words.json` (the reward's vocabulary half) and `settings.json` (prompts
per step, G, max completion tokens, learning rate, LoRA rank/alpha/targets, beta,
temperature, seed), which both contenders read. One GRPO step = one generation of
`prompts_per_step` x G completions and one optimiser step on them (`num_iterations=1`,
`steps_per_generation=1`), sequence-level loss (`loss_type="grpo"`), group std scaling,
constant learning rate, no gradient clipping, no weight decay (Adam as `optax.adam`), no
gradient checkpointing (axcore's loop has none),
the LoRA base as the KL reference (TRL's default under PEFT). Writes one JSON object:
each step's reward mean and wall seconds (the trainer's own step time: generation,
reference, update), and the totals; each step is also appended to WORK/trl_steps.jsonl as it ends.

This module imports nothing of axcore: `aligned_fraction` (the reward) is imported by the
axcore side too, so both score completions with the same code.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time


def aligned_fraction(text: str, good: frozenset[str]) -> float:
    """The share of the completion's whitespace-separated tokens that are in `good` (0 for an empty completion).

    The tokenizer of the benchmark is word-level and decodes with spaces, so each piece is one token.
    """
    pieces = text.split()
    return sum(p in good for p in pieces) / len(pieces) if pieces else 0.0


def _load(work: pathlib.Path) -> tuple[dict, list[dict], frozenset[str]]:
    settings = json.loads((work / "settings.json").read_text("utf-8"))
    prompts = [json.loads(line) for line in (work / "trl_prompts.jsonl").read_text("utf-8").splitlines() if line.strip()]
    good = frozenset(json.loads((work / "good_words.json").read_text("utf-8")))
    return settings, prompts, good


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", required=True, help="directory written by `benchmarks.rl_135m prepare`")
    parser.add_argument("--steps", type=int, default=50, help="GRPO steps")
    parser.add_argument("--out", default=None, help="write the JSON result here too")
    args = parser.parse_args(argv)
    work = pathlib.Path(args.work)
    s, prompts, good = _load(work)

    import datasets
    import peft
    import torch
    import transformers
    import trl

    torch.manual_seed(s["seed"])
    tokenizer = transformers.AutoTokenizer.from_pretrained(work / "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(work / "hf", dtype=torch.float32)
    rows = s["prompts_per_step"] * s["group_size"]

    def reward(completions, **_):
        return [aligned_fraction(c, good) for c in completions]

    config = trl.GRPOConfig(
        output_dir=str(work / "trl-out"), max_steps=args.steps, learning_rate=s["learning_rate"],
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=0.0,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
        per_device_train_batch_size=rows, gradient_accumulation_steps=1, num_generations=s["group_size"],
        steps_per_generation=1, num_iterations=1, max_completion_length=s["max_tokens"],
        temperature=s["temperature"], top_p=1.0, top_k=0, beta=s["beta"], epsilon=0.2, loss_type="grpo",
        scale_rewards="group", use_cpu=True, bf16=False, fp16=False, seed=s["seed"], logging_steps=1,
        report_to=[], save_strategy="no", dataloader_num_workers=0, shuffle_dataset=True,
        disable_dropout=True, gradient_checkpointing=False,
    )
    lora = peft.LoraConfig(r=s["lora_rank"], lora_alpha=s["lora_alpha"], lora_dropout=0.0,
                           target_modules=s["lora_targets"], task_type="CAUSAL_LM")
    steps: list[dict] = []
    (work / "trl_steps.jsonl").unlink(missing_ok=True)

    class Timer(transformers.TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.start = time.perf_counter()

        def on_step_end(self, *_, **__):
            steps.append({"seconds": time.perf_counter() - self.start})

        def on_log(self, _args, _state, _control, logs=None, **__):
            if logs and "reward" in logs and steps:
                steps[-1].update(reward_mean=logs["reward"], reward_std=logs.get("reward_std"),
                                 kl=logs.get("kl"), completion_length=logs.get("completions/mean_length"))
                with open(work / "trl_steps.jsonl", "a", encoding="utf-8") as f:  # Kept if the run is cut short.
                    f.write(json.dumps({"step": len(steps), **steps[-1]}) + "\n")

    dataset = datasets.Dataset.from_list([{"prompt": p["prompt"], "answer": p["answer"]} for p in prompts])
    trainer = trl.GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                              processing_class=tokenizer, peft_config=lora, callbacks=[Timer()])
    start = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - start
    result = {"contender": "trl", "trl": trl.__version__, "torch": torch.__version__,
              "transformers": transformers.__version__, "peft": peft.__version__, "threads": torch.get_num_threads(),
              "steps": len(steps), "wall_seconds": total, "per_step": steps,
              "reward_curve": [round(x.get("reward_mean", float("nan")), 4) for x in steps]}
    text = json.dumps(result, indent=1)
    if args.out:
        pathlib.Path(args.out).write_text(text + "\n", "utf-8")
    print(text)
    return result


if __name__ == "__main__":
    main()
