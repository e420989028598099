"""Typed config trees: declaration, traversal and replacement, YAML, flat dumps, overrides.

The public names are those of the `__all__` of `base`, `constraints`, `serialize` and
`traversal`, re-exported lazily (`lazy`, the re-export helper every package uses), so that
`import axcore` and `axcore --help` import neither NumPy nor YAML.
"""

from __future__ import annotations

from axcore.config.lazy import lazy_exports, module_exports

_WHERE = module_exports(globals(), ["base", "constraints", "serialize", "traversal"])
__all__ = sorted(_WHERE)

__getattr__, __dir__ = lazy_exports(globals(), _WHERE)
