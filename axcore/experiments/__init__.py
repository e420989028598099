"""Built-in experiments, and what a registered experiment is.

Each `<name>.yaml` here is registered as experiment `<name>` by the built-in plugin
`axcore.experiments.plugin`, through `axcore_register_experiments` like a plugin's
own experiments, and is runnable as `axcore train <name>`.

A registered experiment is YAML text (a `str`) or a file: a `pathlib.Path` or an
`importlib.resources` resource (anything with `read_text()`). This file imports
neither hookspecs nor the plugin manager (hookspecs validate registrations with
`experiment_source_validator`).
"""

from __future__ import annotations

from typing import Any


def experiment_source_validator(name: str, value: Any) -> str | None:
    """Accepts YAML text or a file with `read_text()`; refuses a path given as a string."""
    if isinstance(value, str):
        text = value.strip()
        if "\n" not in text and text.endswith((".yaml", ".yml")):
            return f"{value!r} looks like a file name; register pathlib.Path({value!r}) for a file, or the YAML text"
        return None
    if callable(getattr(value, "read_text", None)):
        return None
    return f"expected YAML text (str) or a file (pathlib.Path, importlib.resources file), got {value!r}"


def experiment_text(value: Any) -> str:
    """The YAML text of a registered experiment."""
    return value if isinstance(value, str) else value.read_text(encoding="utf-8")
