"""Commands that plugins add to the `axcore` command (`axcore_register_commands`).

A plugin registers `register(name, run, *, add_arguments=None, help="")`; then
`axcore NAME [ARGS...]` parses ARGS with a parser that `add_arguments(parser)`
filled and calls `run(args)`, whose return value (an int, or None for 0) is the exit
status. Built-in command names are reserved.

This file imports neither hookspecs nor the plugin manager (hookspecs declare the
family with `command_callback` and `command_validator`), and no JAX, so the CLI can
import it for free.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

from axcore.registry import Provenance, Registry

# The `axcore` command's own sub-commands; plugins may not register these names.
BUILTIN_COMMANDS = ("train", "config", "plugins", "compile", "loc", "new-plugin", "eval", "generate")


@dataclasses.dataclass(frozen=True)
class Command:
    """A plugin's `axcore` sub-command."""

    # Runs the command with the parsed arguments; returns the exit status (None = 0).
    run: Callable[[argparse.Namespace], int | None]
    # Adds the command's arguments to its parser; None = it takes none.
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None
    # One line for `axcore --help` listings and the command's own help.
    help: str = ""


def command_validator(name: str, value: Any) -> str | None:
    """Accepts a `Command` under a name that is not a built-in command and can be typed."""
    if name in BUILTIN_COMMANDS:
        return f"'{name}' is a built-in command of axcore; choose another name"
    if name.startswith("-") or any(c.isspace() for c in name):
        return "a command name may not start with '-' or contain spaces"
    if not isinstance(value, Command) or not callable(value.run):
        return f"expected a Command with a callable run, got {value!r}"
    if value.add_arguments is not None and not callable(value.add_arguments):
        return f"add_arguments must be callable or None, got {value.add_arguments!r}"
    return None


def command_callback(registry: Registry, provenance: Provenance) -> Callable[..., None]:
    """The `register` argument of `axcore_register_commands`."""

    def register(
        name: str,
        run: Callable[[argparse.Namespace], int | None],
        *,
        add_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
        help: str = "",  # noqa: A002 - argparse's name for it.
        override: bool = False,
    ) -> None:
        registry.register(name, Command(run, add_arguments, help), provenance, override)

    return register
