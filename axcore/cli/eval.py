"""`axcore eval RUN_OR_CKPT`: held-out loss and perplexity of a run's checkpoint (`axcore.inference.evaluation`);
with `--tasks A,B`, lm-evaluation-harness's tasks on it instead (`axcore.inference.lm_eval_tasks`)."""

from __future__ import annotations

import os
import sys

from axcore.cli.common import one_run


def run(args) -> int:
    args.run = one_run(args)
    if args.tasks is not None:
        return run_tasks(args)
    from axcore.inference.evaluation import evaluate_run, print_result

    result = evaluate_run(
        args.run, data=args.data, split=args.split, batch_size=args.batch_size, seq_len=args.seq_len,
        max_batches=args.max_batches, step=args.step, overrides=args.overrides, objects=args.objects,
    )
    print_result(result, args.json)
    return 0


# The held-out loss's options, which mean nothing to lm-eval's tasks (name, value when not given).
LOSS_ONLY = (("--data", "data", []), ("--split", "split", "validation"), ("--seq-len", "seq_len", None),
             ("--max-batches", "max_batches", None))


def run_tasks(args) -> int:
    """Runs lm-eval's `--tasks` on the checkpoint; prints lm-eval's table (`--json`: its results), writes
    `--output`. Raises LmEvalError (exit 2) without lm-eval, for an unknown task or a held-out loss option."""
    from axcore.inference.lm_eval_model import LmEvalError, import_lm_eval

    for flag, name, unset in LOSS_ONLY:
        if getattr(args, name) != unset:
            raise LmEvalError(f"{flag} sets the held-out loss evaluation, not lm-eval's --tasks; drop one of them.")
    if args.output and not os.path.isdir(os.path.dirname(os.path.abspath(args.output))):
        raise LmEvalError(f"--output '{args.output}': its directory does not exist; create it or pass another path.")
    import_lm_eval()
    from axcore.inference.lm_eval_tasks import evaluate_tasks, results_json, results_table, split_tasks

    results = evaluate_tasks(
        args.run, split_tasks(args.tasks), num_fewshot=args.num_fewshot, limit=args.limit,
        include_path=args.include_path, batch_size=args.batch_size, step=args.step, overrides=args.overrides,
    )
    if args.output:
        try:
            with open(args.output, "w", encoding="utf-8") as f:
                f.write(results_json(results) + "\n")
        except OSError as e:
            raise LmEvalError(f"Cannot write --output '{args.output}': {e}.") from None
        print(f"Wrote lm-eval's results to {args.output}", file=sys.stderr)
    results.pop("samples", None)
    print(results_json(results) if args.json else results_table(results))
    return 0
