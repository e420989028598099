"""axcore-qwen: the Qwen dense families (`qwen2`, `qwen3`) for `axcore convert`.

Importing this package registers nothing; axcore calls the hook in `axcore_qwen.plugin`.
"""

from axcore_qwen.qwen import QWEN2, QWEN3, QwenConverter

__all__ = ["QWEN2", "QWEN3", "QwenConverter"]
