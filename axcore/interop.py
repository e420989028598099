"""Compatibility path: `axcore.interop` is `axcore.checkpoint.interop`.

It is named for converter authors in docs/hooks.md and docs/huggingface.md.
Plugins written against the flat layout keep importing from here; new code imports
`axcore.checkpoint.interop`. Nothing inside `axcore` imports this module (the import contracts say so).
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
