"""`axcore config EXPERIMENT`: the resolved config, one `path: value` per line, then the kernel choices and
the data check; `--shardings` and `--kernels` print those reports instead.
"""

from __future__ import annotations

import sys

from axcore.errors import one_line
from axcore.plugin.commands import overrides


def run(args) -> int:
    from axcore.experiment.loading import load_experiment
    from axcore.kernels import describe_kernel_choices

    experiment = load_experiment(args.experiment, overrides(args), objects=args.objects)
    if getattr(args, "shardings", False):
        from axcore.cli.shardings import format_sharding_report, sharding_report

        sys.stdout.write(format_sharding_report(sharding_report(experiment)))
        return 0
    if getattr(args, "kernels", False):
        from axcore.kernels import format_kernel_decisions

        sys.stdout.write(format_kernel_decisions(experiment.kernel_decisions()))
        return 0
    sys.stdout.write(experiment.flat())
    for op, kernels in describe_kernel_choices(experiment.kernel_choices()).items():
        sys.stdout.write(f"# kernel {op}: {kernels}\n")
    sys.stdout.write(f"# data check: {data_check(experiment)}\n")
    return 0


def data_check(experiment) -> str:
    """"ok", or the one-line error of the input sources' cheap checks (paths exist, shard indexes and their
    tokenizer match; `InputConfig.check`), naming the config path such as input.source.paths[0], and of
    the eval split (`axcore.placement.evaluate.check_evaluable`: evaluations would find held-out documents)."""
    from axcore.errors import AxcoreError
    from axcore.placement.evaluate import check_evaluable

    config = experiment.config
    try:
        tokenizer = config.tokenizer.instantiate()
        config.input.check(tokenizer)
        check_evaluable(config, tokenizer)
    except AxcoreError as e:
        return one_line(e)
    return "ok"
