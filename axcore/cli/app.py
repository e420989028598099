"""The `axcore` command: its parser and the dispatch to each command's module (`axcore.cli.<command>.run`).

    axcore train [EXPERIMENT] [--set PATH=VALUE ...]   train (default: built-in experiment)
    axcore config EXPERIMENT [--set ...]               resolved config, one `path: value` per line
                              [--shardings]            instead: each array's sharding on the mesh
                              [--kernels]              instead: each op call's kernel and the declines
    axcore plugins [EXPERIMENT] [--all] [--json] [--hook NAME]
                                                       installed plugins, their hooks and components
    axcore compile EXPERIMENT [--set ...] [--device-memory BYTES]
                                                       ahead-of-time compile report, no training
    axcore loc                                         integration cost of each installed plugin
    axcore new-plugin NAME [--kind feature|hardware|kernel|checkpoint|objective|data_source] [--directory DIR]
                                                       write a plugin package with hooks and tests
    axcore eval RUN_OR_CKPT [--data PATH ...] [--split validation] [--batch-size N] [--seq-len T]
                [--max-batches N] [--step S] [--json]  held-out loss and perplexity of a checkpoint
                [--tasks A,B [--num-fewshot K] [--limit N] [--include-path DIR] [--output FILE.json]]
                                                       instead: lm-evaluation-harness tasks
    axcore generate RUN_OR_CKPT --prompt TEXT [--max-new-tokens N] [--temperature T] [--top-k K] [--top-p P]
                                                       continue prompts with a run's model (KV-cache decoding)
    axcore serve RUN_OR_HF_DIR [--host H] [--port P] [--api-key KEY] [--max-waiting N]
                                                       an OpenAI-compatible HTTP server over a run's model
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
import importlib
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from axcore.cli.common import EXIT_USAGE, Parser, add_distributed
from axcore.errors import one_line
from axcore.plugin.commands import BUILTIN_COMMANDS, add_experiment, listed_plugin_commands

# After Ctrl-C (128 + SIGINT), as shells report it; axcore/trainer/interrupt.py's EXIT_INTERRUPTED.
EXIT_INTERRUPTED = 130
PLUGIN_COMMANDS_HELP = (
    "Installed plugins can add commands (hook axcore_register_commands); 'axcore plugins' lists them."
)


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


class _MainParser(Parser):
    """The `axcore` parser: its help ends with the installed plugins' commands, read only when help is shown."""

    def format_help(self) -> str:
        self.epilog = plugin_commands_help()
        return super().format_help()



def build_parser() -> argparse.ArgumentParser:
    parser = _MainParser(
        prog="axcore", description="Plugin-based large-model training on JAX.", epilog=PLUGIN_COMMANDS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser, metavar="COMMAND")
    train = sub.add_parser("train", help="train a model from an experiment")
    add_experiment(train, required=False)
    add_distributed(train)
    config = sub.add_parser("config", help="print the resolved config (one 'path: value' per line)")
    add_experiment(config, required=True)
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
    _add_plugins(sub)
    compile_ = sub.add_parser(
        "compile",
        help="compile the train step ahead of time on abstract inputs (nothing allocated) and report "
        "parameters, per-device bytes and FLOPs",
    )
    add_experiment(compile_, required=True)
    compile_.add_argument(
        "--device-memory",
        metavar="BYTES",
        help="fail (exit 2) if the estimated per-device peak exceeds this, e.g. 80GB, 80GiB, 96e9",
    )
    sub.add_parser("loc", help="integration lines of code of each installed plugin (Markdown table)")
    _add_eval(sub)
    from axcore.cli import generate

    generate.add_arguments(
        sub.add_parser("generate", help="continue prompts with a run's model (KV-cache decoding)")
    )
    from axcore.cli import prepare, serve

    serve.add_arguments(sub.add_parser("serve", help="an OpenAI-compatible HTTP server over a run's model"))

    prepare.add_arguments(
        sub.add_parser("prepare", help="tokenize a corpus once into prepared token shards (training reads those)")
    )
    new_plugin = sub.add_parser("new-plugin", help="write a new plugin package (entry point, hooks, README, tests)")
    new_plugin.add_argument("name", help="plugin (entry-point) name, a lowercase identifier, e.g. my_feature")
    new_plugin.add_argument(
        "--kind", choices=("feature", "hardware", "kernel", "checkpoint", "objective", "data_source"), default="feature"
    )
    new_plugin.add_argument(
        "--directory",
        help="where to write it; must not exist (default: the distribution's name, ./axcore-NAME with each '_' "
        "written '-', e.g. ./axcore-my-feature for my_feature)",
    )
    return parser


def _add_plugins(sub) -> None:
    """The `plugins` command's arguments."""
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
    harness = eval_.add_argument_group(
        "lm-evaluation-harness", "with --tasks: lm-eval's tasks on the checkpoint (pip install 'axcore[lm-eval]'), "
        "--batch-size rows per forward pass (default 8)")
    harness.add_argument("--tasks", metavar="A,B", help="lm-eval task, group or tag names, separated by commas")
    harness.add_argument("--num-fewshot", type=int, metavar="K", help="examples in each prompt (default: each task's)")
    harness.add_argument("--limit", type=float, metavar="N", help="documents per task (below 1: a fraction of them)")
    harness.add_argument("--include-path", metavar="DIR", help="a directory of task YAMLs added to lm-eval's own")
    harness.add_argument("--output", metavar="FILE.json", help="write lm-eval's results as JSON")


# Each built-in command's module, imported only when the command runs (its `run(args)` returns the exit status).
COMMANDS = {
    "train": "axcore.cli.train",
    "config": "axcore.cli.config",
    "plugins": "axcore.cli.plugins",
    "compile": "axcore.cli.compile",
    "loc": "axcore.cli.loc",
    "new-plugin": "axcore.cli.new_plugin",
    "eval": "axcore.cli.eval",
    "generate": "axcore.cli.generate",
    "prepare": "axcore.cli.prepare",
    "serve": "axcore.cli.serve",
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
    parser = Parser(prog=f"axcore {name}", description=command.help or None)
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
        return importlib.import_module(COMMANDS[args.command]).run(args)
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

