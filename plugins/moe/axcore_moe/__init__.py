"""axcore-moe: mixture-of-experts feed-forward layers (GShard / Switch style).

Enable with `plugins: [moe]`; settings live under `moe:` (see `MoESettings`).
Importing this package registers nothing; axcore calls the hooks in `plugin`.
"""

from axcore_moe.layer import Gates, MixtureOfExperts, Routing
from axcore_moe.plugin import MoESettings

__all__ = ["Gates", "MixtureOfExperts", "MoESettings", "Routing"]
