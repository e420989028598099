"""Hookspecs of what a plugin adds to axcore itself: hooks of its own, experiments, commands.

The calling convention, the phases and the evolution policy: `axcore.plugin.hookspecs`.
"""

from __future__ import annotations

from typing import Any

from axcore.experiments import experiment_source_validator
from axcore.markers import hookspec
from axcore.plugin.commands import command_callback, command_validator
from axcore.plugin.register_callbacks import RegisterCommand, RegisterComponent
from axcore.registry import Family, registers

# -- Phase 0: hookspecs ----------------------------------------------------------------


@hookspec
def axcore_add_hookspecs(add_hookspecs: Any) -> None:
    """Add hookspecs of this plugin's own (a new registry family, a hook for other plugins).

    Args:
        add_hookspecs: `add_hookspecs(module_or_class)`; every `axcore_*` function in
            it marked with `@axcore.hookspec` becomes a hook. A registration spec
            decorated with `@axcore.registry.registers(Family(...))` adds registry
            family `registries.<name>`, filled by the plugins implementing it.

    Returns nothing. Called once, right after this plugin is registered with a plugin
    manager, before any registration hook; other plugins may implement the new hooks
    whether they were registered before or after (check_pending runs after all).
    """


# -- Phase 1: registration: experiments and commands -----------------------------------


@registers(Family("experiments", "experiment", experiment_source_validator))
@hookspec
def axcore_register_experiments(register: RegisterComponent) -> None:
    """Ship experiments that `axcore train NAME` and `load_experiment(NAME)` find by name.

    Args:
        register: `register(name, source, *, override=False)`; `source` is the
            experiment's YAML text (a str) or its file (a `pathlib.Path` or an
            `importlib.resources` file). The YAML lists the plugins it needs under
            `plugins:` like any experiment file.

    Returns nothing. Called like the other registration hooks. A name is looked up
    among the built-in plugins (which ship axcore/experiments/*.yaml), then plugins
    given as objects, then installed plugins, each loaded on its own (unless
    AXCORE_DISABLE_PLUGIN_AUTOLOAD is set); one name from two plugins is an error
    naming both unless exactly one says override=True, and an unknown name lists
    the available ones.
    """


@registers(Family("commands", "command", command_validator), command_callback)
@hookspec
def axcore_register_commands(register: RegisterCommand) -> None:
    """Add sub-commands to the `axcore` command line (`axcore NAME [ARGS...]`).

    Args:
        register: `register(name, run, *, add_arguments=None, help="", override=False)`;
            `add_arguments(parser)` adds the command's arguments to an argparse parser,
            `run(args)` runs it and returns the exit status (None for 0). Raise an
            `axcore.AxcoreError` for bad input: it is printed as one line, exit 2.

    Returns nothing. Called like the other registration hooks. The CLI looks a
    command up only when the first argument of `axcore` is not a built-in command
    (so `axcore --help` loads no plugin): built-in plugins first, then installed
    plugins, each loaded on its own (unless AXCORE_DISABLE_PLUGIN_AUTOLOAD is set).
    Built-in command names may not be registered; one name from two plugins is an
    error naming both unless exactly one says override=True.
    """
