"""axcore-remat: a rematerialization policy on every scanned layer stack.

Enable with `plugins: [remat]`; settings live under `remat:` (see `RematSettings`).
Importing this package registers nothing; axcore calls the hooks in `plugin`.
"""

from axcore_remat.plugin import RematSettings

__all__ = ["RematSettings"]
