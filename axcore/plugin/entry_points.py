"""Installed plugins' entry points and the variables that restrict them, read without importing any plugin.

The `axcore` entry-point group names each installed plugin and its module. This file
only reads distribution metadata (no plugin, no hookspecs, no JAX), so the CLI's
help can use it for free; `axcore.plugin.loading` re-exports these names.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys

from packaging.utils import canonicalize_name

ENTRY_POINT_GROUP = "axcore"
DISABLE_AUTOLOAD_ENV = "AXCORE_DISABLE_PLUGIN_AUTOLOAD"
# Comma-separated names of the installed plugins that may load; unset = all, empty = none.
LOAD_PLUGINS_ENV = "AXCORE_LOAD_PLUGINS"


def autoload_disabled() -> bool:
    return bool(os.environ.get(DISABLE_AUTOLOAD_ENV, "").strip())


def load_allow_list() -> frozenset[str] | None:
    """Canonical names of the installed plugins AXCORE_LOAD_PLUGINS lets load; None when it is unset (all may)."""
    value = os.environ.get(LOAD_PLUGINS_ENV)
    if value is None:
        return None
    return frozenset(canonicalize_name(n.strip()) for n in value.split(",") if n.strip())


def allowed_to_load(name: str, allowed: frozenset[str] | None = None) -> bool:
    """Whether installed plugin `name` may load: it is in `allowed` (default: AXCORE_LOAD_PLUGINS's list), or no list is set."""
    allowed = load_allow_list() if allowed is None else allowed
    return allowed is None or canonicalize_name(name) in allowed


def _path_fingerprint() -> tuple:
    """`sys.path` with each directory's modification time: changes when a distribution is installed or removed."""
    stamps = []
    for entry in sys.path:
        try:
            stamps.append((entry, os.stat(entry or ".").st_mtime_ns))
        except OSError:
            stamps.append((entry, None))
    return tuple(stamps)


_ENTRY_POINTS_CACHE: dict[str, tuple[tuple, tuple[importlib.metadata.EntryPoint, ...]]] = {}


def installed_entry_points() -> dict[str, list[importlib.metadata.EntryPoint]]:
    """Plugin name -> entry points of that name in the `axcore` group (not imported).

    Only plugins that may load: those AXCORE_LOAD_PLUGINS leaves out are in
    `excluded_entry_points()` instead.
    """
    allowed = load_allow_list()
    return {name: eps for name, eps in installed_plugins().items() if allowed_to_load(name, allowed)}


def excluded_entry_points() -> dict[str, list[importlib.metadata.EntryPoint]]:
    """Installed plugins that AXCORE_LOAD_PLUGINS leaves out (empty when it is unset)."""
    allowed = load_allow_list()
    return {name: eps for name, eps in installed_plugins().items() if not allowed_to_load(name, allowed)}


def installed_plugins() -> dict[str, list[importlib.metadata.EntryPoint]]:
    """Plugin name -> entry points of every installed plugin, allowed to load or not (none imported).

    `allowed_to_load(name)` says which AXCORE_LOAD_PLUGINS lets load;
    `installed_entry_points()` holds only those.

    Scanning every distribution's metadata is the slow part of resolving an
    experiment; the scan is reused while `sys.path` and its directories are unchanged
    (installing or removing a distribution changes its directory's modification time).
    """
    fingerprint = _path_fingerprint()
    cached = _ENTRY_POINTS_CACHE.get(ENTRY_POINT_GROUP)
    if cached is None or cached[0] != fingerprint:
        cached = (fingerprint, tuple(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)))
        _ENTRY_POINTS_CACHE[ENTRY_POINT_GROUP] = cached
    found: dict[str, list[importlib.metadata.EntryPoint]] = {}
    for ep in cached[1]:
        found.setdefault(ep.name, []).append(ep)
    return found


def distribution_of(ep: importlib.metadata.EntryPoint) -> tuple[str, str]:
    """(distribution name, version) that provides entry point `ep`; ("<unknown distribution>", "0") when unknown."""
    dist = getattr(ep, "dist", None)
    if dist is None:
        return "<unknown distribution>", "0"
    return dist.metadata["Name"], dist.version
