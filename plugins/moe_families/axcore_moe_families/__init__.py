"""axcore-moe-families: Mixtral and Qwen3-MoE checkpoints to and from axcore.

`axcore convert hf-to-axcore` / `axcore-to-hf` (plugin `hf`) find these converters by
`model_type` (`mixtral`, `qwen3_moe`). Importing this package registers nothing;
axcore calls the hook in `axcore_moe_families.plugin`.
"""

from axcore_moe_families.converter import MIXTRAL, QWEN3_MOE, MoEConverter, MoEFamily

__all__ = ["MIXTRAL", "QWEN3_MOE", "MoEConverter", "MoEFamily"]
