"""`axcore train [EXPERIMENT] [--set PATH=VALUE ...]`: load the experiment (XLA flags set and the job joined
first), then run the trainer. A run directory already finished (at `trainer.max_steps`) exits 0 after the
trainer's one line saying so.
"""

from __future__ import annotations

import os
import sys

from axcore.plugin.commands import overrides


def run(args) -> int:
    from axcore.experiment.loading import load_experiment
    from axcore.platform.distributed import distributed_settings
    from axcore.trainer.trainer import Trainer

    distributed = distributed_settings(args.coordinator, args.num_processes, args.process_id)
    # XLA flags are set, and the job joined, before anything starts JAX's backend.
    experiment = load_experiment(
        args.experiment, overrides(args), objects=args.objects, apply_xla_flags=True, distributed=distributed
    )
    if os.environ.get(experiment.flags_variable):
        print(f"{experiment.flags_variable}: {os.environ[experiment.flags_variable]}", file=sys.stderr)
    result = Trainer(experiment, command=train_command(args)).run()
    if result.already_finished:  # The trainer said so; nothing was compiled, trained or sampled.
        return 0
    eval_text = f", held-out loss {result.eval_loss:.3f}" if result.eval_loss is not None else ""
    print(f"Finished step {result.step}{eval_text}; run directory: {result.run_dir}", file=sys.stderr)
    return 0


def train_command(args) -> list[str]:
    """The `axcore train` command as given (experiment, `--set`, `--mesh-selector`, multi-process flags),
    for the line that says how to resume an interrupted run."""
    words = ["axcore", "train", *([args.experiment] if args.experiment else [])]
    words += [w for override in args.overrides for w in ("--set", override)]
    if args.mesh_selector:
        words += ["--mesh-selector", args.mesh_selector]
    for flag, value in (("--coordinator", args.coordinator), ("--num-processes", args.num_processes),
                        ("--process-id", args.process_id)):
        words += [flag, str(value)] if value is not None else []
    return words
