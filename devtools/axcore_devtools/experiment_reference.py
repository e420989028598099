"""The experiment file reference (docs/experiments.md), generated from the config classes.

    python -m axcore_devtools.experiment_reference > docs/experiments.md

Every key of an experiment file is a field of `ExperimentConfig` or of a config
below it; each field's meaning is its one-line comment in the source (the AXLearn
habit: every config field has one). `tests/test_docs.py` checks that
docs/experiments.md equals `experiment_reference()`.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import typing
from functools import cache

from axcore.config import REQUIRED, ConfigBase, InstantiableConfig
from axcore.config.serialize import format_value, to_dict
from axcore.experiment.builtins import builtin_registries
from axcore.experiment.schema import ExperimentConfig

_HEADER = """\
# Experiment file reference

An experiment file is YAML, merged onto the built-in default experiment: a key you
leave out keeps the default below. Generated from the config classes' field comments
by `python -m axcore_devtools.experiment_reference > docs/experiments.md`. For the whole resolved
tree of a given experiment (every layer's fields, after plugins and mesh rules), run
`axcore config EXP`; how experiments are written and run:
[getting-started.md](getting-started.md).

Besides these keys, an experiment may hold one top-level key per plugin listed in
`plugins:`, named after it, with that plugin's settings (e.g. `rope: {theta: 500000}`;
see the plugin's README). Any key can also be set from the command line,
`--set PATH=VALUE` (`--set trainer.learner.learning_rate=1e-3`); an unknown key is an
error with a "did you mean".

A field whose default is `{type: NAME}` is a registered component: `type:` picks
another one (an optimizer, a data source, a layer, ...; `axcore plugins --all` lists
the registered names), and its other keys are that component's fields. The fields
listed for such a field are those of its default component.
"""


@cache
def _comments(cls: type) -> dict[str, str]:
    """Field name -> the comment lines right above its declaration in `cls`'s own body."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    lines = source.splitlines()
    found = {}
    for node in ast.parse(source).body[0].body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            above, i = [], node.lineno - 2
            while i >= 0 and lines[i].strip().startswith("#"):
                above.insert(0, lines[i].strip().lstrip("#").strip())
                i -= 1
            found[node.target.id] = " ".join(above)
    return found


def field_comment(cls: type, name: str) -> str:
    """The comment of field `name` of config class `cls` (from the class in its MRO that declares it)."""
    for klass in cls.__mro__:
        if name in klass.__dict__.get("__annotations__", {}):
            return _comments(klass).get(name, "")
    return ""


def _default(value, plain) -> str:
    """A field's default as YAML (`plain` is its value from `to_dict`)."""
    if value is REQUIRED:
        return "required"
    if isinstance(value, InstantiableConfig):
        return "`{type: " + plain["type"] + "}`"
    if isinstance(value, ConfigBase):
        return "(section below)"
    return f"`{format_value(plain)}`"


def _list_item_class(cls: type, name: str) -> type | None:
    """The ConfigBase class of a `list[SomeConfig]` field, if it is one."""
    tp = cls.field_types()[name]
    for arg in typing.get_args(tp):
        if inspect.isclass(arg) and issubclass(arg, ConfigBase) and not issubclass(arg, InstantiableConfig):
            return arg
    return None


def _section(path: str, cfg: ConfigBase, registries, out: list[str], expand_components: bool) -> None:
    """Appends a table of `cfg`'s fields, then sections for its sub-configs."""
    cls = type(cfg)
    title = f"`{path}`" if path else "Top-level keys"
    what = inspect.getdoc(cls).splitlines()[0] if path else "The keys of an experiment file."
    if isinstance(cfg, InstantiableConfig):
        what = f"Default component `{to_dict(cfg, registries).get('type')}`: " + (
            inspect.getdoc(cfg.klass) or what
        ).splitlines()[0]
    out.append(f"\n## {title}\n\n{what}\n")
    if not cfg.keys():
        out.append("\nIt has no fields.\n")
        return
    out.append("\n| key | default | meaning |\n|---|---|---|\n")
    below = []
    plain = to_dict(cfg, registries)
    for name, value in cfg.items():
        comment = field_comment(cls, name).replace("|", "\\|")
        default = _default(value, plain.get(name)).replace("|", "\\|")
        out.append(f"| `{name}` | {default} | {comment} |\n")
        child = f"{path}.{name}" if path else name
        if isinstance(value, ConfigBase) and (expand_components or not isinstance(value, InstantiableConfig)):
            below.append((child, value, not isinstance(value, InstantiableConfig)))
        item = _list_item_class(cls, name) if isinstance(value, list) else None
        if item is not None:
            below.append((f"{child}[i]", item(), True))
    for child, value, expand in below:
        _section(child, value, registries, out, expand)


def experiment_reference() -> str:
    """The markdown text of docs/experiments.md."""
    out = [_HEADER]
    _section("", ExperimentConfig(), builtin_registries(), out, True)
    return "".join(out)


if __name__ == "__main__":
    print(experiment_reference(), end="")
