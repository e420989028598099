"""Commands that plugins add to the `axcore` command (`axcore_register_commands`).

A plugin registers `register(name, run, *, add_arguments=None, help="")`; then
`axcore NAME [ARGS...]` parses ARGS with a parser that `add_arguments(parser)`
filled and calls `run(args)`, whose return value (an int, or None for 0) is the exit
status. Built-in command names are reserved.

This file imports neither hookspecs nor the plugin manager (hookspecs declare the
family with `command_callback` and `command_validator`), and no JAX, so the CLI can
import it for free.

`axcore --help` lists installed plugins' commands without importing any plugin
(`listed_plugin_commands`): it reads each entry-point module's source and takes the
`register("NAME", ..., help="...")` calls of its `axcore_register_commands` whose
name and help are string literals. A plugin whose commands cannot be read so (a
computed name, a hook defined elsewhere, a missing or unparsable module) is named
in one line instead; `axcore plugins` loads plugins and lists every command.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import sys
from collections.abc import Callable
from typing import Any

from axcore.errors import one_line
from axcore.plugin.entry_points import autoload_disabled, distribution_of, installed_entry_points
from axcore.registry import Provenance, Registry

# The `axcore` command's own sub-commands; plugins may not register these names.
BUILTIN_COMMANDS = ("train", "config", "plugins", "compile", "loc", "new-plugin", "eval", "generate", "prepare", "serve")


def add_experiment(parser: argparse.ArgumentParser, *, required: bool) -> None:
    """Adds the experiment argument (a file or built-in name; optional unless `required`), `--set` and `--mesh-selector`.

    What `axcore train` takes; a plugin's command adds the same with this and reads them
    back with `overrides(args)` for `load_experiment(args.experiment, overrides(args))`.
    """
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


def overrides(args) -> list[str]:
    """The `--set` overrides, with `--mesh-selector` as `mesh.instance_type`."""
    selector = getattr(args, "mesh_selector", None)
    return [*args.overrides, *([f"mesh.instance_type={selector}"] if selector else [])]


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
        help: str = "",  # argparse's name for it.
        override: bool = False,
    ) -> None:
        registry.register(name, Command(run, add_arguments, help), provenance, override)

    return register


HOOK = "axcore_register_commands"


@dataclasses.dataclass(frozen=True)
class ListedCommand:
    """A command an installed plugin registers, as read from its source (for `axcore --help`)."""

    name: str
    # The plugin (entry-point name) and its distribution.
    plugin: str
    distribution: str
    help: str = ""


@dataclasses.dataclass(frozen=True)
class CommandListing:
    """What `listed_plugin_commands` found."""

    commands: list[ListedCommand]
    # Plugin -> why its commands could not be read from its source.
    unreadable: dict[str, str]
    # Why no installed plugin was read (AXCORE_DISABLE_PLUGIN_AUTOLOAD), or "".
    skipped: str = ""


def _find_spec(name: str, path: list[str] | None) -> Any:
    """The spec the import system would use for `name` (in package `path`), from `sys.meta_path`'s finders.

    Asks each finder in turn, as `import` does, so an editable install's finder (which
    setuptools appends after the path finder) resolves the submodules it maps, even
    where a directory of the same name on `sys.path` (the distribution's own folder,
    from the current directory) made the package a namespace. Runs no module.
    """
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        spec = find(name, path) if find is not None else None
        if spec is not None:
            return spec
    return None


def _module_source(module: str) -> str:
    """Path of `module`'s source file, found without importing it or its packages (ValueError if none)."""
    parts = module.split(".")
    spec = _find_spec(parts[0], None)
    for depth in range(1, len(parts) + 1):
        if spec is None:
            raise ValueError(f"module {'.'.join(parts[:depth])} is not installed")
        if depth == len(parts):
            break
        if spec.submodule_search_locations is None:
            raise ValueError(f"module {'.'.join(parts[:depth])} is not a package")
        spec = _find_spec(".".join(parts[: depth + 1]), list(spec.submodule_search_locations))
    if spec.origin is None or not spec.origin.endswith(".py"):
        raise ValueError(f"module {module} has no Python source")
    return spec.origin


def _literal(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _registered(source: str, filename: str) -> list[tuple[str, str]] | None:
    """`(name, help)` of each `register(...)` call in the source's `axcore_register_commands` functions.

    Returns [] when the source defines no such function, and None when a call's name or
    help is not a string literal (or the hook is only imported here), i.e. when only
    loading the plugin can tell.
    """
    tree = ast.parse(source, filename)
    found: list[tuple[str, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == HOOK for a in node.names):
            return None
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name != HOOK:
            continue
        params = [a.arg for a in node.args.posonlyargs + node.args.args if a.arg not in ("self", "cls")]
        register = params[0] if params else "register"
        for call in ast.walk(node):
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == register):
                continue
            name = _literal(call.args[0]) if call.args else None
            helps = [k.value for k in call.keywords if k.arg == "help"]
            help_ = _literal(helps[0]) if helps else ""
            if name is None or help_ is None:
                return None
            found.append((name, help_))
    return found


def listed_plugin_commands() -> CommandListing:
    """Commands of the installed plugins that may load, read from their sources; no plugin is imported.

    Follows AXCORE_LOAD_PLUGINS (only listed plugins) and AXCORE_DISABLE_PLUGIN_AUTOLOAD
    (none: their commands cannot run either). Never raises for a broken plugin: it is
    put in `unreadable` with the reason.
    """
    if autoload_disabled():
        return CommandListing([], {}, "AXCORE_DISABLE_PLUGIN_AUTOLOAD is set")
    commands, unreadable = [], {}
    for plugin, eps in sorted(installed_entry_points().items()):
        distribution, _ = distribution_of(eps[0])
        module = eps[0].value.split(":", 1)[0].strip()
        try:
            path = _module_source(module)
            with open(path, encoding="utf-8") as f:
                registered = _registered(f.read(), path)
        except (ValueError, ImportError, OSError, SyntaxError, UnicodeDecodeError) as e:
            unreadable[plugin] = f"{module}: {one_line(e) or type(e).__name__}"
            continue
        if registered is None:
            unreadable[plugin] = f"{module} registers commands that only loading it can name"
            continue
        commands += [ListedCommand(name, plugin, distribution, help_) for name, help_ in registered]
    return CommandListing(sorted(commands, key=lambda c: c.name), unreadable)

