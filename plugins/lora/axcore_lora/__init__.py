"""LoRA for axcore: low-rank adapters on chosen `dot` call sites, the base frozen (plugin `lora`).

`axcore_lora.kernel` holds the adapter arithmetic (a `dot` kernel with the adapters as its
per-site state), `axcore_lora.plugin` the settings and config transform, and
`axcore_lora.peft` the PEFT adapter directory export/import and the merged export
(`axcore_lora.peft_files` checks an adapter directory before an import writes anything).
"""

from axcore_lora.kernel import LoraConfigError, LoraDot, LoraSettings, lora_sites

__all__ = ["LoraConfigError", "LoraDot", "LoraSettings", "lora_sites"]
