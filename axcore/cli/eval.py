"""`axcore eval RUN_OR_CKPT`: held-out loss and perplexity of a run's checkpoint (`axcore.inference.evaluation`)."""

from __future__ import annotations

from axcore.cli.common import one_run


def run(args) -> int:
    from axcore.inference.evaluation import evaluate_run, print_result

    args.run = one_run(args)
    result = evaluate_run(
        args.run, data=args.data, split=args.split, batch_size=args.batch_size, seq_len=args.seq_len,
        max_batches=args.max_batches, step=args.step, overrides=args.overrides, objects=args.objects,
    )
    print_result(result, args.json)
    return 0
