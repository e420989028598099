"""The hook reference (docs/hooks.md), generated from the hookspecs' signatures and docstrings.

    python -m axcore_devtools.hook_reference > docs/hooks.md

`tests/test_docs.py` checks that docs/hooks.md equals `hook_reference()`, so the
reference never goes stale: edit a docstring in `axcore/plugin/specs/`, then rerun
the command above.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from axcore.plugin import hookspecs
from axcore.registry import family_hook

_HEADER = """\
# Hook reference

Every hook a plugin can implement, generated from `axcore/plugin/hookspecs.py` (the phase modules of
`axcore/plugin/specs/`) by
`python -m axcore_devtools.hook_reference > docs/hooks.md` (plugin API {version}). Implement one
with `@axcore.hookimpl` on a module-level function (or a method of a plugin object) of
the same name; it may take any subset of the arguments, by name. How to package and
enable a plugin: [writing-a-plugin.md](writing-a-plugin.md).

"""


def hook_names() -> list[str]:
    """Names of every hookspec of `axcore.plugin.hookspecs`, in source order."""
    return [name for name, fn in vars(hookspecs).items() if name.startswith("axcore_") and inspect.isfunction(fn)]


def signature_text(fn: Callable) -> str:
    """`name(arg: Type, ...) -> Return`: `inspect.signature` with the postponed annotations unquoted."""
    signature = inspect.signature(fn)
    text = str(signature.replace(
        parameters=[p.replace(annotation=_Text(p.annotation)) for p in signature.parameters.values()],
        return_annotation=_Text(signature.return_annotation),
    ))
    return f"{fn.__name__}{text}"


class _Text:
    """An annotation shown as its source text (`inspect` quotes string annotations)."""

    def __init__(self, annotation):
        self.text = annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)

    def __repr__(self) -> str:
        return self.text


def _phases() -> dict[str, str]:
    """Hook name -> the `# -- Phase ...` heading above it in its phase module (`hookspecs.PHASES`)."""
    heading, found = "", {}
    for module in hookspecs.PHASES:
        lines, _ = inspect.getsourcelines(module)
        for line in lines:
            if line.startswith("# -- "):
                heading = line[5:].rstrip().rstrip("-").strip()
            elif line.startswith("def axcore_"):
                found[line[4:].split("(", 1)[0]] = heading
    return found


def hook_reference() -> str:
    """The markdown text of docs/hooks.md."""
    overview = inspect.getdoc(hookspecs).split("\n\n", 1)[1]
    out = [_HEADER.format(version=hookspecs.PLUGIN_API_VERSION), "## Calling convention and phases\n\n", overview, "\n"]
    phases = _phases()
    current = None
    for name in hook_names():
        fn = getattr(hookspecs, name)
        if phases[name] != current:
            current = phases[name]
            out.append(f"\n## {current}\n")
        out.append(f"\n### `{name}`\n\n```python\n{signature_text(fn)}\n```\n\n")
        declared = family_hook(fn)
        if declared is not None:
            family = declared.family
            named = " (configs name entries with `type: <name>`)" if family.config_names else ""
            out.append(f"Fills the registry family `registries.{family.name}` ({family.kind}){named}.\n\n")
        out.append(inspect.getdoc(fn) + "\n")
    return "".join(out)


if __name__ == "__main__":
    print(hook_reference(), end="")
