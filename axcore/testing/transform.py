"""Conformance checks of a plugin's config transform (`axcore_transform_config`).

Given the config before the transform, the plugin manager (built-ins + the plugin) and
the nodes the transform targets (a class or a predicate `(path, node) -> bool`, as for
`axcore.config.find`):

- applies to every target: each target node's subtree changes;
- idempotent or refusing: applied to its own output it gives the same config, or
  raises an `AxcoreError`;
- touches nothing else: every `path: value` line that changes lies under a target or
  under a node the author allows (`also_touches`, e.g. an input embedding it removes).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from axcore.config import ConfigBase, find, flatten, get_path
from axcore.errors import AxcoreError


def flat(config: Any, resolver: Any) -> dict[str, Any]:
    """`{path: plain value}` of a config (or subtree); None and leaves give one entry."""
    if not isinstance(config, ConfigBase):
        return {"": repr(config)}
    return {path: repr(value) for path, value in flatten(config, resolver)}


def _under(path: str, prefixes: Sequence[str]) -> bool:
    return any(p == "" or path == p or path.startswith(p + ".") or path.startswith(p + "[") for p in prefixes)


def target_paths(config: ConfigBase, targets: Any) -> list[str]:
    """Paths of the nodes matching `targets` (a class, a predicate, or a tuple of them), outermost only."""
    matches = targets if isinstance(targets, (tuple, list)) else (targets,)
    paths = sorted({p for m in matches for p, _ in find(config, m)})
    return [p for p in paths if not _under(p, [q for q in paths if q != p])]


def transform(manager: Any, config: ConfigBase, settings: Mapping[str, Any] | None) -> ConfigBase:
    """Runs the enabled plugins' transforms through the manager (pluggy calls them)."""
    return manager.transform_config(config, settings)


def check_applies_to_every_target(before: ConfigBase, after: ConfigBase, targets: Any, resolver: Any) -> list[str]:
    """Every target node's subtree changed; returns the target paths (there must be some)."""
    paths = target_paths(before, targets)
    assert paths, f"the config before the transform has no node matching {targets!r}; choose an experiment that has some"
    untouched = [p for p in paths if flat(get_path(before, p), resolver) == flat(get_path(after, p), resolver)]
    assert not untouched, f"the transform left these targets unchanged: {', '.join(untouched)}"
    return paths


def check_touches_nothing_else(
    before: ConfigBase, after: ConfigBase, allowed: Sequence[str], resolver: Any
) -> None:
    """Every changed, added or removed `path: value` line lies under an allowed path."""
    a, b = flat(before, resolver), flat(after, resolver)
    changed = sorted(p for p in set(a) | set(b) if a.get(p) != b.get(p))
    outside = [p for p in changed if not _under(p, allowed)]
    assert not outside, (
        f"the transform changed paths outside its targets: {', '.join(outside[:8])}"
        + (f" (and {len(outside) - 8} more)" if len(outside) > 8 else "")
    )


def check_idempotent_or_refuses(manager: Any, after: ConfigBase, settings: Any, resolver: Any) -> str:
    """Applied to its own output the transform gives the same config, or raises an AxcoreError.

    Returns "idempotent" or "refuses".
    """
    try:
        again = transform(manager, after, settings)
    except AxcoreError as e:
        assert str(e).strip(), "the transform refused a second application without a message"
        return "refuses"
    a, b = flat(after, resolver), flat(again, resolver)
    diff = sorted(p for p in set(a) | set(b) if a.get(p) != b.get(p))
    assert not diff, (
        f"applying the transform twice changes {', '.join(diff[:8])}; make it idempotent (leave installed "
        f"nodes as they are) or raise an AxcoreError on a second application"
    )
    return "idempotent"
