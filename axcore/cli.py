"""The `axcore` command.

    axcore train [EXPERIMENT] [--set PATH=VALUE ...]   train (default: built-in experiment)
    axcore config EXPERIMENT [--set ...]               resolved config, one `path: value` per line
                              [--shardings]            instead: each array's sharding on the mesh
                              [--kernels]              instead: each op call's kernel and the declines
    axcore plugins [EXPERIMENT] [--all] [--json] [--hook NAME]
                                                       installed plugins, their hooks and components
    axcore compile EXPERIMENT [--set ...] [--device-memory BYTES]
                                                       ahead-of-time compile report, no training
    axcore loc                                         integration cost of each installed plugin
    axcore new-plugin NAME [--kind feature|hardware|kernel|checkpoint] [--directory DIR]
                                                       write a plugin package with hooks and tests
    axcore eval RUN_OR_CKPT [--data PATH ...] [--split validation] [--batch-size N] [--seq-len T]
                [--max-batches N] [--step S] [--json]  held-out loss and perplexity of a checkpoint
    axcore generate RUN_OR_CKPT --prompt TEXT [--max-new-tokens N] [--temperature T] [--top-k K] [--top-p P]
                                                       continue prompts with a run's model (KV-cache decoding)
    axcore NAME [ARGS ...]                             a command added by a plugin

Only argparse (and the names of the built-in commands) is imported at module level,
so `axcore --help` never imports JAX. Plugin commands (`axcore_register_commands`)
are run by building plugin managers, only when the first argument is not a built-in
command; `axcore --help` lists them without loading any plugin, read from the
plugins' sources (`axcore.plugin.commands.listed_plugin_commands`). Bad input (an
AxcoreError) prints one line and exits with status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from axcore.errors import one_line
from axcore.plugin.commands import BUILTIN_COMMANDS, listed_plugin_commands

EXIT_USAGE = 2
# After Ctrl-C (128 + SIGINT), as shells report it; axcore/trainer/interrupt.py's EXIT_INTERRUPTED.
EXIT_INTERRUPTED = 130
PLUGIN_COMMANDS_HELP = (
    "Installed plugins can add commands (hook axcore_register_commands); 'axcore plugins' lists them."
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # One line, exit 2 (argparse prints usage too).
        self.exit(EXIT_USAGE, f"axcore: error: {message} (see '{self.prog} --help')\n")


def plugin_commands_help() -> str:
    """The `axcore --help` section on plugin commands: one line per command, then one per unreadable plugin."""
    listing = listed_plugin_commands()
    if listing.skipped:
        return f"Plugin commands: not listed ({listing.skipped}). {PLUGIN_COMMANDS_HELP}"
    lines = ["plugin commands (added by installed plugins; 'axcore NAME --help' for each):"]
    width = max([len(c.name) for c in listing.commands] + [8])
    for c in listing.commands:
        lines.append(f"  {c.name.ljust(width)}  {c.help or '(no description)'} [plugin {c.plugin}, {c.distribution}]")
    if not listing.commands:
        lines.append("  (none installed)")
    for plugin, why in sorted(listing.unreadable.items()):
        lines.append(f"Plugin '{plugin}': its commands could not be listed ({why}); 'axcore plugins' loads it and tells more.")
    return "\n".join([*lines, PLUGIN_COMMANDS_HELP])


class _MainParser(_Parser):
    """The `axcore` parser: its help ends with the installed plugins' commands, read only when help is shown."""

    def format_help(self) -> str:
        self.epilog = plugin_commands_help()
        return super().format_help()



def _add_experiment(parser: argparse.ArgumentParser, *, required: bool) -> None:
    parser.add_argument(
        "experiment",
        nargs=None if required else "?",
        help="experiment YAML file or built-in experiment name" + ("" if required else " (default: default)"),
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="PATH=VALUE",
        help="override a config value, e.g. --set trainer.max_steps=50 (repeatable; YAML-typed)",
    )
    parser.add_argument(
        "--mesh-selector",
        metavar="INSTANCE_TYPE",
        help="lay the run out for this instance type (e.g. gpu-h100-8, tpu-v5p-64) instead of the detected "
        "one; its hardware plugin is loaded if installed (same as --set mesh.instance_type=...)",
    )


def _add_distributed(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "multi-process", "join a multi-process job (all three; or AXCORE_COORDINATOR_ADDRESS, "
        "AXCORE_NUM_PROCESSES, AXCORE_PROCESS_ID; Slurm and JobSet variables are detected)"
    )
    group.add_argument("--coordinator", metavar="HOST:PORT", help="address of process 0's coordinator")
    group.add_argument("--num-processes", type=int, metavar="N", help="processes in the job")
    group.add_argument("--process-id", type=int, metavar="I", help="this process's index, 0 .. N-1")


def _overrides(args) -> list[str]:
    """The `--set` overrides, with `--mesh-selector` as `mesh.instance_type`."""
    selector = getattr(args, "mesh_selector", None)
    return [*args.overrides, *([f"mesh.instance_type={selector}"] if selector else [])]


def build_parser() -> argparse.ArgumentParser:
    parser = _MainParser(
        prog="axcore", description="Plugin-based large-model training on JAX.", epilog=PLUGIN_COMMANDS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="COMMAND")
    train = sub.add_parser("train", help="train a model from an experiment")
    _add_experiment(train, required=False)
    _add_distributed(train)
    config = sub.add_parser("config", help="print the resolved config (one 'path: value' per line)")
    _add_experiment(config, required=True)
    config.add_argument(
        "--shardings",
        action="store_true",
        help="print instead how the batch, each parameter and the optimizer state are sharded on the "
        "experiment's mesh (abstract: nothing allocated, any --mesh-selector size)",
    )
    config.add_argument(
        "--kernels",
        action="store_true",
        help="print instead which kernel each op call of each layer uses for the experiment's instance type "
        "(e.g. --mesh-selector gpu-h100-8) and why the kernels tried before it declined",
    )
    plugins = sub.add_parser(
        "plugins",
        help="list installed plugins",
        description="List installed plugins: distribution, version, whether the experiment enables them, the "
        "hooks they implement and the components they register.",
        epilog="Environment: AXCORE_LOAD_PLUGINS=rope,moe lets only the listed installed plugins load (empty: "
        "none; others are listed as excluded and may not appear in `plugins:`); AXCORE_DISABLE_PLUGIN_AUTOLOAD=1 "
        "loads only plugins named explicitly (an experiment's `plugins:`), the way out when a broken plugin "
        "crashes axcore.",
    )
    plugins.add_argument("experiment", nargs="?", help="mark the plugins this experiment enables")
    plugins.add_argument("--all", action="store_true", help="list the built-in plugins too")
    plugins.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object: plugin_api_version, experiment, hook, load_plugins, autoload_disabled, "
        "plugins (each: name, distribution, version, source, enabled, status, detail, plugin_api, hooks, "
        "components [{family, kind, name, override}])",
    )
    plugins.add_argument(
        "--hook",
        metavar="NAME",
        help="list only the plugins, built-ins included, that implement hook NAME (e.g. axcore_register_layers)",
    )
    compile_ = sub.add_parser(
        "compile",
        help="compile the train step ahead of time on abstract inputs (nothing allocated) and report "
        "parameters, per-device bytes and FLOPs",
    )
    _add_experiment(compile_, required=True)
    compile_.add_argument(
        "--device-memory",
        metavar="BYTES",
        help="fail (exit 2) if the estimated per-device peak exceeds this, e.g. 80GB, 80GiB, 96e9",
    )
    sub.add_parser("loc", help="integration lines of code of each installed plugin (Markdown table)")
    _add_eval(sub)
    from axcore import generate_command

    generate_command.add_arguments(
        sub.add_parser("generate", help="continue prompts with a run's model (KV-cache decoding)")
    )
    from axcore import prepare_command

    prepare_command.add_arguments(
        sub.add_parser("prepare", help="tokenize a corpus once into prepared token shards (training reads those)")
    )
    new_plugin = sub.add_parser("new-plugin", help="write a new plugin package (entry point, hooks, README, tests)")
    new_plugin.add_argument("name", help="plugin (entry-point) name, a lowercase identifier, e.g. my_feature")
    new_plugin.add_argument("--kind", choices=("feature", "hardware", "kernel", "checkpoint"), default="feature")
    new_plugin.add_argument("--directory", help="where to write it (default: ./axcore-NAME); must not exist")
    return parser


def _add_eval(sub) -> None:
    eval_ = sub.add_parser(
        "eval",
        help="held-out loss and perplexity of a checkpoint on a dataset",
        description="Loss (mean cross-entropy, nats per token) and perplexity (exp(loss)) of a run's checkpoint; "
        "every target token counted once (see axcore/inference/evaluation.py).",
    )
    eval_.add_argument("run", metavar="RUN_OR_CKPT", help="run directory, its checkpoints/ or one step's directory")
    # More paths (a shell glob matching several runs): refused with one line naming them (`_one_run`).
    eval_.add_argument("more_runs", nargs="*", help=argparse.SUPPRESS)
    eval_.add_argument(
        "--data", action="append", default=[], metavar="PATH",
        help="text, JSONL (.jsonl) or token (.bin) file tokenized with the run's tokenizer (repeatable); "
        "default: the run's input source",
    )
    eval_.add_argument("--split", default="validation", help="split of the run's input source: validation (default) or train")
    eval_.add_argument("--batch-size", type=int, metavar="N", help="rows per batch (default: the run's input.batch_size)")
    eval_.add_argument("--seq-len", type=int, metavar="T", help="tokens per row (default: the run's input.seq_len)")
    eval_.add_argument("--max-batches", type=int, metavar="N", help="stop after N batches (default: all the data)")
    eval_.add_argument("--step", type=int, metavar="S", help="checkpoint step (default: the latest committed)")
    eval_.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE",
                       help="override a value of the run's config, e.g. --set mesh.mesh_shape=[-1]")
    eval_.add_argument("--json", action="store_true", help="print one JSON object instead of a line")


def _one_run(args) -> str:
    """The one run path of `eval` or `generate`; several (e.g. `runs/default-*`) are an AxcoreError naming them.

    The error suggests the newest of them (latest modification time) as the one to name.
    """
    paths = [args.run, *args.more_runs]
    if len(paths) == 1:
        return args.run
    from axcore.errors import AxcoreError

    def modified(path: str) -> float:
        try:
            return os.stat(path).st_mtime
        except OSError:
            return float("-inf")

    newest = max(paths, key=lambda p: (modified(p), p))
    raise AxcoreError(
        f"{len(paths)} run directories given ({', '.join(paths)}); axcore {args.command} reads one: name one, "
        f"e.g. the newest: {newest}"
    )


def _cmd_eval(args) -> int:
    from axcore.inference.evaluation import evaluate_run, print_result

    args.run = _one_run(args)
    result = evaluate_run(
        args.run, data=args.data, split=args.split, batch_size=args.batch_size, seq_len=args.seq_len,
        max_batches=args.max_batches, step=args.step, overrides=args.overrides, objects=args.objects,
    )
    print_result(result, args.json)
    return 0


def _cmd_generate(args) -> int:
    from axcore import generate_command

    args.run = _one_run(args)
    return generate_command.run(args)


def _cmd_prepare(args) -> int:
    from axcore import prepare_command

    return prepare_command.run(args)


def _cmd_train(args) -> int:
    from axcore.experiment.loading import load_experiment
    from axcore.platform.distributed import distributed_settings
    from axcore.trainer.trainer import Trainer

    distributed = distributed_settings(args.coordinator, args.num_processes, args.process_id)
    # XLA flags are set, and the job joined, before anything starts JAX's backend.
    experiment = load_experiment(
        args.experiment, _overrides(args), objects=args.objects, apply_xla_flags=True, distributed=distributed
    )
    if os.environ.get(experiment.flags_variable):
        print(f"{experiment.flags_variable}: {os.environ[experiment.flags_variable]}", file=sys.stderr)
    result = Trainer(experiment, command=_train_command(args)).run()
    eval_text = f", held-out loss {result.eval_loss:.3f}" if result.eval_loss is not None else ""
    print(f"Finished step {result.step}{eval_text}; run directory: {result.run_dir}", file=sys.stderr)
    return 0


def _train_command(args) -> list[str]:
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


def _cmd_config(args) -> int:
    from axcore.experiment.loading import load_experiment
    from axcore.kernels import describe_kernel_choices

    experiment = load_experiment(args.experiment, _overrides(args), objects=args.objects)
    if getattr(args, "shardings", False):
        from axcore.sharding_report import format_sharding_report, sharding_report

        sys.stdout.write(format_sharding_report(sharding_report(experiment)))
        return 0
    if getattr(args, "kernels", False):
        from axcore.kernels import format_kernel_decisions

        sys.stdout.write(format_kernel_decisions(experiment.kernel_decisions()))
        return 0
    sys.stdout.write(experiment.flat())
    for op, kernels in describe_kernel_choices(experiment.kernel_choices()).items():
        sys.stdout.write(f"# kernel {op}: {kernels}\n")
    sys.stdout.write(f"# data check: {_data_check(experiment)}\n")
    return 0


def _data_check(experiment) -> str:
    """"ok", or the one-line error of the input sources' cheap checks (paths exist, shard indexes and their
    tokenizer match; `InputConfig.check`), naming the config path such as input.source.paths[0]."""
    from axcore.errors import AxcoreError

    config = experiment.config
    try:
        config.input.check(config.tokenizer.instantiate())
    except AxcoreError as e:
        return one_line(e)
    return "ok"


def _cmd_plugins(args) -> int:
    import json

    from axcore.plugin_listing import describe_plugins, plugins_json

    enabled = []
    if args.experiment:
        from axcore.experiment.loading import read_experiment_file

        enabled = read_experiment_file(args.experiment, objects=args.objects)[0].get("plugins") or []
    everything = describe_plugins(enabled, objects=args.objects, hook=args.hook)
    shown = [d for d in everything if args.all or args.hook or d.source != "builtin"]
    if args.json:
        print(json.dumps(plugins_json(shown, experiment=args.experiment, hook=args.hook), indent=2))
        return 0
    rows = [
        (d.name, d.distribution, d.version, "built-in" if d.source == "builtin" else "yes" if d.enabled else "no",
         ", ".join(d.hooks) if d.status == "ok" else f"({d.status}: {d.detail})")
        for d in shown
    ]
    header = ("name", "distribution", "version", "enabled", "hooks")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(4)]
    for row, description in zip([header, *rows], [None, *shown]):
        print("  ".join([*(str(c).ljust(w) for c, w in zip(row[:4], widths)), row[4]]))
        kinds: dict[str, list[str]] = {}
        for component in description.components if description else ():
            kinds.setdefault(component.kind, []).append(component.name)
        if kinds:
            print("    registers: " + "; ".join(f"{kind} {', '.join(names)}" for kind, names in kinds.items()))
    if not shown:
        print(f"No plugin implements {args.hook}." if args.hook else "No plugins installed; --all lists the built-ins.")
    if args.hook:
        return 0
    commands = sorted(
        (c.name, d.name, c.value.help) for d in everything for c in d.components if c.family == "commands"
    )
    print("\nCommands added by plugins:" if commands else "\nNo plugin adds commands.")
    for name, plugin, help_ in commands:
        print(f"  axcore {name}  (plugin {plugin}) {help_}".rstrip())
    return 0


def _cmd_compile(args) -> int:
    """Prints the compile report; with --device-memory, then an AxcoreError (exit 2) if the peak exceeds it."""
    from axcore import compile_report as cr
    from axcore.experiment.loading import load_experiment

    limit = None if args.device_memory is None else cr.parse_bytes(args.device_memory, cr.DEVICE_MEMORY_FLAG)
    experiment = load_experiment(args.experiment, _overrides(args), objects=args.objects, apply_xla_flags=True)
    report = cr.compile_report(experiment)
    sys.stdout.write(cr.format_report(report))
    sys.stdout.flush()
    if limit is not None:
        cr.check_device_memory(report, limit)
    return 0


def _cmd_loc(args) -> int:
    from axcore.tools.loc_report import format_table, loc_report

    sys.stdout.write(format_table(loc_report()))
    return 0


def _cmd_new_plugin(args) -> int:
    from axcore.scaffold import new_plugin

    for path in new_plugin(args.name, args.kind, args.directory):
        print(path)
    return 0


COMMANDS = {
    "train": _cmd_train,
    "config": _cmd_config,
    "plugins": _cmd_plugins,
    "compile": _cmd_compile,
    "loc": _cmd_loc,
    "new-plugin": _cmd_new_plugin,
    "eval": _cmd_eval,
    "generate": _cmd_generate,
    "prepare": _cmd_prepare,
}


def _plugin_commands(objects: Mapping[str, Any] | None, name: str | None = None):
    """Commands registered by built-in plugins, `objects` and installed plugins (see `search_plugins`)."""
    from axcore.experiment.loading import search_plugins

    return search_plugins("commands", objects=objects, name=name)


def _run_plugin_command(name: str, argv: Sequence[str], objects: Mapping[str, Any] | None) -> int:
    """Runs plugin command `name` with its arguments `argv`."""
    from axcore.errors import AxcoreError, did_you_mean

    search = _plugin_commands(objects, name)
    entry = search.found.get(name)
    if entry is None:
        plugin_commands = sorted(search.found)
        hint = did_you_mean(name, [*BUILTIN_COMMANDS, *plugin_commands])
        broken = f"; plugins that could not be searched: {', '.join(sorted(search.broken))}" if search.broken else ""
        print(
            f"axcore: error: argument COMMAND: invalid choice: '{name}'{hint}; commands: "
            f"{', '.join(BUILTIN_COMMANDS)}; plugin commands: {', '.join(plugin_commands) or 'none'}{broken} "
            f"(see 'axcore --help')",
            file=sys.stderr,
        )
        return EXIT_USAGE
    command = entry.value
    parser = _Parser(prog=f"axcore {name}", description=command.help or None)
    if command.add_arguments is not None:
        command.add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        status = command.run(args)
    except AxcoreError as e:
        print(f"axcore: error: {name} (plugin '{entry.provenance.plugin}'): {one_line(e)}", file=sys.stderr)
        return EXIT_USAGE
    return 0 if status is None else int(status)


def main(argv: Sequence[str] | None = None, *, objects: Mapping[str, Any] | None = None) -> int:
    """Runs the `axcore` command; returns its exit status.

    Args:
        argv: the arguments after `axcore`; None = `sys.argv[1:]`.
        objects: plugin objects by name, searched for commands before installed
            plugins and given to the experiment the command loads (tests, notebooks).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    plugin_command = bool(argv) and not argv[0].startswith("-") and argv[0] not in COMMANDS
    args = None if plugin_command else build_parser().parse_args(argv)
    from axcore.errors import AxcoreError

    try:
        if plugin_command:
            return _run_plugin_command(argv[0], argv[1:], objects)
        args.objects = objects
        return COMMANDS[args.command](args)
    except AxcoreError as e:
        for problem in getattr(e, "problems", None) or [e]:  # ConfigValidationError: one line per problem.
            print(f"axcore: error: {one_line(problem)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt as e:  # Exit 130, the SIGINT convention; `axcore train` says how to resume.
        # A RunInterrupted (its line names the resume command) exists only if its module was imported.
        interrupt = sys.modules.get("axcore.trainer.interrupt")
        resumable = interrupt is not None and isinstance(e, interrupt.RunInterrupted) and str(e)
        print(str(e) if resumable else "axcore: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
