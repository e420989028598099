"""Compatibility path: `axcore.interop` is `axcore.checkpoint.interop`.

The flat layout's path that docs/hooks.md and docs/huggingface.md gave converter authors.
Plugins written against the flat layout keep importing from here; new code imports
`axcore.checkpoint.interop`. Nothing inside `axcore` imports this module (the import
contracts say so).
"""

from axcore.checkpoint.interop import (
    ConversionError,
    ModelConverter,
    converter_validator,
)

__all__ = [
    "ConversionError",
    "ModelConverter",
    "converter_validator",
]
