"""axcore-gemma: the Gemma families (`gemma2`, `gemma3_text`) for `axcore convert`.

Importing this package registers nothing; axcore calls the hook in `axcore_gemma.plugin`.
"""

from axcore_gemma.gemma import GEMMA2, GEMMA3, GemmaConverter

__all__ = ["GEMMA2", "GEMMA3", "GemmaConverter"]
