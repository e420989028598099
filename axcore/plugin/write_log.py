"""Which plugin wrote which config value, so that no transform silently overwrites another's.

The plugin manager runs the config transforms of the listed plugins in order and
records each one's writes in a `WriteLog`; a transform that takes away a value an
earlier plugin wrote raises PluginConflictError naming both plugins.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from axcore.config import ConfigBase, Resolver, flatten
from axcore.errors import PluginConflictError


class WriteLog:
    """Owners of config values across a sequence of transforms (one log per `transform_config`)."""

    def __init__(self, resolver: Resolver):
        self._resolver = resolver
        # (flat config path without list indices, value) -> plugin that wrote it.
        self._owners: dict[tuple[str, Any], str] = {}

    def record(self, plugin: str, old: ConfigBase, new: ConfigBase) -> None:
        """Records what `plugin` wrote; raises if it overwrote another plugin's write.

        Paths are compared with list indices dropped, so turning a layer template
        into per-layer copies is not a change; a path holds the set of values of its
        instances, and self._ownership is per (path, value). A plugin owns the values it
        put at a path, the `type` of every component it added, and every slot it
        emptied; values inside a component another plugin added stay open to edits
        (composition). Taking an owned value away from a path is a conflict unless the
        value moved deeper into the tree (a layer wrapped into a block, or a config
        kept as the template of the component that replaced it), where it keeps its
        owner. Adding a value beside an owned one is not: e.g. swiglu's feed-forward
        replaced by an MoE in every other layer, with the replaced one as its expert.
        """
        before, after = _value_sets(flatten(old, self._resolver)), _value_sets(flatten(new, self._resolver))

        def conflict(path: str, owner: str) -> PluginConflictError:
            was, now = before[path], after.get(path)
            if now:
                change = str(sorted(now, key=repr))
            elif any(q.startswith(f"{path}.") for q in after):  # An emptied slot filled with a component.
                change = "given a component"
            else:
                change = "removed"
            return PluginConflictError(
                f"Plugins '{owner}' and '{plugin}' both set config '{path}' ({sorted(was, key=repr)} "
                f"by '{owner}', then {change} by '{plugin}'); "
                f"enable only one of them, or configure the second through the first's settings."
            )

        new_at = {q: v - before.get(q, frozenset()) for q, v in after.items()}  # Values new at each path.
        moved: dict[tuple[str, Any], str] = {}  # (new path, value) -> the owner it keeps.
        for path, values in before.items():
            for value in values - after.get(path, frozenset()):
                owner = self._owners.pop((path, value), None)
                targets = [q for q, v in new_at.items() if value in v and _moved(path, q)]
                if owner is not None and owner != plugin and not targets:
                    raise conflict(path, owner)
                moved.update({(target, value): owner for target in targets if owner is not None})
        for path, values in new_at.items():
            for value in values:
                if (path, value) in moved:
                    self._owners[(path, value)] = moved[(path, value)]
                elif path in before:
                    self._owners[(path, value)] = plugin  # A value it changed.
                elif any(value in v and _kept_deeper(p, path, after) for p, v in before.items()):
                    continue  # The value of a config kept deeper (e.g. as a template), not a new write.
                elif path.endswith(".type") or (value is None and any(p.startswith(f"{path}.") for p in before)):
                    self._owners[(path, value)] = plugin  # A component it added, or a slot it emptied.


def _moved(source: str, target: str) -> bool:
    """Whether `target` is `source` with extra path components inserted (same last one)."""
    src, dst = source.split("."), target.split(".")
    if len(dst) <= len(src) or src[-1] != dst[-1]:
        return False
    it = iter(dst)
    return all(part in it for part in src)


def _kept_deeper(source: str, target: str, after: Mapping[str, Any]) -> bool:
    """Whether `target` may hold `source`'s value moved (`source` is gone) or kept inside its replacement."""
    return _moved(source, target) and (source not in after or target.startswith(source.rpartition(".")[0] + "."))


def _value_sets(flat: list[tuple[str, Any]]) -> dict[str, frozenset]:
    """Flat config entries keyed by path without list indices -> set of values there."""
    out: dict[str, set] = {}
    for path, value in flat:
        out.setdefault(re.sub(r"\[\d+\]", "", path), set()).add(repr(value) if isinstance(value, (list, dict)) else value)
    return {p: frozenset(v) for p, v in out.items()}
