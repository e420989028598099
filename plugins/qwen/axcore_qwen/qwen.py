"""The Qwen dense families (`qwen2` for Qwen2/Qwen2.5, `qwen3`) <-> axcore.

Both are the Llama architecture (`axcore_hf.LlamaConverter`: RMSNorm, rotate-half
RoPE, GQA, SwiGLU, tied or untied head) plus, in axcore's generic switches:

| Hugging Face | axcore |
|---|---|
| Qwen2: q/k/v projections with biases (always), o without | `self_attention.qkv_bias: true` |
| Qwen3: `attention_bias` (q/k/v and o biases, default off) | `qkv_bias`, `output_bias` |
| Qwen3: `q_norm`, `k_norm` RMSNorm over each head, before RoPE | `self_attention.q_norm`, `k_norm` (`rms_norm`, `rms_norm_eps`) |
| `use_sliding_window`, `sliding_window`, `max_window_layers`, `layer_types` | the layer pattern (`axcore_hf.patterns`): per-layer `sliding_window` |

Extra tensors, per layer i (`model.layers.i.` prefix; n/k heads, h = head_dim):

| Hugging Face | axcore (under the layer) |
|---|---|
| self_attn.q_proj.bias `[n*h]` | self_attention/bq `[n, h]` |
| self_attn.k_proj.bias, v_proj.bias `[k*h]` | self_attention/bk, bv `[k, h]` |
| self_attn.o_proj.bias `[d]` (Qwen3 with attention_bias) | self_attention/bo `[d]` |
| self_attn.q_norm.weight, k_norm.weight `[h]` | self_attention/q_norm/scale, k_norm/scale `[h]` |

A config.json field these models do not have (`mlp_bias`, another `hidden_act`, another
rope type, an unknown `layer_types` entry) is refused in one line naming it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from axcore.checkpoint.interop import ConversionError

from axcore_hf.llama import LAYER_TENSORS, QK_NORM_TENSORS, ConfigFields, LlamaConverter, first_layer
from axcore_hf.patterns import FULL, SLIDING, check_layer_types, decoder_pattern, hf_layer_types

# config.json fields this module reads itself (hidden from LlamaConverter, which refuses some of them).
OWN_FIELDS = ("attention_bias", "sliding_window", "use_sliding_window", "max_window_layers", "layer_types")


@dataclasses.dataclass(frozen=True)
class QwenConverter(LlamaConverter):
    """Converts `Qwen2ForCausalLM` (`qk_norm=False`, biases always) and `Qwen3ForCausalLM` (`qk_norm=True`)."""

    model_type: str = "qwen2"
    architecture: str = "Qwen2ForCausalLM"
    # Qwen3: RMSNorm over each query and key head before RoPE; its biases follow `attention_bias`.
    qk_norm: bool = False

    def _biases(self, config: Mapping[str, Any]) -> tuple[bool, bool]:
        """(q/k/v biases, output bias) of a checkpoint with this config.json."""
        if not self.qk_norm:  # Qwen2: q/k/v always, o never.
            return True, False
        on = bool(config.get("attention_bias", False))
        return on, on

    def example_config(self) -> dict[str, Any]:
        """A tiny config.json (for `axcore loc`): Qwen2 with sliding layers after the first; Qwen3 as
        released (QK-norm, tied embeddings, no biases, no window)."""
        config = {**super().example_config(), "head_dim": 8}
        if self.qk_norm:
            return {**config, "tie_word_embeddings": True}
        return {**config, "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}

    def experiment(self, config: Mapping[str, Any], where: str) -> dict[str, Any]:
        """config.json data -> experiment data: the Llama experiment plus biases, QK-norm and the layer pattern."""
        field = ConfigFields(config, where)
        if field.get("mlp_bias", False):
            raise ConversionError(f"{where}: 'mlp_bias' is true, but {self.architecture} MLPs have no biases.")
        num_layers = field.int("num_hidden_layers")
        data = super().experiment({k: v for k, v in config.items() if k not in OWN_FIELDS}, where)
        layer = data["model"]["decoder"]["layer"]
        attention = layer["self_attention"]
        attention["qkv_bias"], attention["output_bias"] = self._biases(config)
        if self.qk_norm:
            eps = layer["norm"]["eps"]
            attention["q_norm"] = {"type": "rms_norm", "eps": eps}
            attention["k_norm"] = {"type": "rms_norm", "eps": eps}
        window = field.int("sliding_window") if field.get("use_sliding_window", False) else None
        types = field.get("layer_types", None)
        if types is None:  # transformers' default: layers from max_window_layers on slide.
            first = field.get("max_window_layers", num_layers)
            types = [SLIDING if window is not None and i >= first else FULL for i in range(num_layers)]
        types = check_layer_types(types, num_layers, window, where)
        pattern = decoder_pattern(types, {FULL: {}, SLIDING: {"sliding_window": window}})
        attention.update(pattern.pop("same", {}))
        data["model"]["decoder"].update(pattern)
        return data

    def outside_config(self, experiment: Any, base: Mapping[str, Any], where: str) -> dict[str, Any]:
        """The resolved experiment -> config.json data (the Llama fields, then Qwen's biases and layer types)."""
        out = super().outside_config(experiment, {k: v for k, v in base.items() if k not in OWN_FIELDS}, where)
        model = experiment.to_dict()["model"]
        attention = first_layer(model["decoder"], where)["self_attention"]
        out.pop("mlp_bias", None)
        out.pop("attention_bias", None)
        if self.qk_norm:
            out["attention_bias"] = bool(attention.get("qkv_bias"))
        types, window = hf_layer_types(model["decoder"], model["num_layers"], attention.get("sliding_window"), where)
        leading_full = next((i for i, t in enumerate(types) if t == SLIDING), len(types))
        out.update(
            use_sliding_window=window is not None,
            sliding_window=window,
            max_window_layers=leading_full,
            layer_types=types,
        )
        return out

    def layer_tensors(self, config: Mapping[str, Any]) -> dict[str, tuple[tuple[str, ...], str]]:
        """Llama's per-layer tensors plus the biases and q/k norms this config.json has."""
        table = dict(LAYER_TENSORS)
        qkv_bias, output_bias = self._biases(config)
        if qkv_bias:
            for name in ("q", "k", "v"):
                table[f"self_attn.{name}_proj.bias"] = (("self_attention", f"b{name}"), "flat")
        if output_bias:
            table["self_attn.o_proj.bias"] = (("self_attention", "bo"), "copy")
        if self.qk_norm:
            table.update(QK_NORM_TENSORS)
        return table


QWEN2 = QwenConverter()
QWEN3 = QwenConverter(model_type="qwen3", architecture="Qwen3ForCausalLM", qk_norm=True)
