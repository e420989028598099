"""The Gemma families (`gemma2`, `gemma3_text` for Gemma 3 text models) <-> axcore.

The Llama layout (`axcore_hf.LlamaConverter`: GQA, rotate-half RoPE, a gated MLP)
with, in axcore's generic switches:

| Hugging Face | axcore |
|---|---|
| Gemma RMSNorm `x * (1 + w)` in float32 (every norm) | `rms_norm` with `scale_offset: 1.0` |
| input / post_attention / pre_feedforward / post_feedforward layernorms | `attention_norm`, `post_attention_norm`, `ffn_norm`, `post_ffn_norm` (`post_norms: true`) |
| embeddings times sqrt(hidden_size) | `model.scale_embeddings: true` (the table is stored unscaled) |
| `hidden_activation: gelu_pytorch_tanh` (GeGLU) | `swiglu: {activation: gelu_tanh}` |
| `query_pre_attn_scalar` | `self_attention.scale: query_pre_attn_scalar ** -0.5` |
| `attn_logit_softcapping`, `final_logit_softcapping` (Gemma 2) | `self_attention.softcap`, `model.logits_softcap` |
| `layer_types` (Gemma 2: alternating; Gemma 3: 5 local to 1 global), `sliding_window` | the decoder's `layer_types` / `attention_types` |
| Gemma 3: `q_norm`, `k_norm` (Gemma RMSNorm over each head) | `self_attention.q_norm`, `k_norm` |
| Gemma 3: a RoPE base per layer type (`rope_parameters.{full,sliding}_attention`, or `rope_theta` and `rope_local_base_freq`) | `rope.theta` (global layers) and `attention_types.sliding_attention.position_embedding.theta` |

Per-layer tensors (`model.layers.i.` prefix): `post_attention_layernorm.weight` ->
`post_attention_norm/scale`, `pre_feedforward_layernorm.weight` -> `ffn_norm/scale`,
`post_feedforward_layernorm.weight` -> `post_ffn_norm/scale`, and Gemma 3's
`self_attn.q_norm.weight` / `k_norm.weight` -> `self_attention/q_norm/scale`, `k_norm/scale`;
the rest as Llama. Every tensor is copied as stored (the norms' `w`, not `1 + w`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from axcore.checkpoint.interop import ConversionError

from axcore_hf.llama import LAYER_TENSORS, QK_NORM_TENSORS, ConfigFields, LlamaConverter, first_layer, hf_rope_scaling
from axcore_hf.patterns import FULL, SLIDING, check_layer_types, decoder_pattern, hf_layer_types, pattern_of

# config.json fields read here (hidden from LlamaConverter, which reads or refuses some of them).
OWN_FIELDS = (
    "attention_bias", "mlp_bias", "sliding_window", "layer_types", "hidden_activation", "hidden_act",
    "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping", "use_bidirectional_attention",
    "sliding_window_pattern", "rope_local_base_freq", "rope_parameters", "rope_theta", "rope_scaling",
)
# HF activations of the gated MLP -> the swiglu plugin's `activation`.
ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
# Gemma 3's default RoPE bases (transformers' Gemma3TextConfig.default_theta).
GEMMA3_THETA = {FULL: 1_000_000.0, SLIDING: 10_000.0}


@dataclasses.dataclass(frozen=True)
class GemmaConverter(LlamaConverter):
    """Converts `Gemma2ForCausalLM` (default) and `Gemma3ForCausalLM` (`gemma3=True`, model_type gemma3_text)."""

    model_type: str = "gemma2"
    architecture: str = "Gemma2ForCausalLM"
    # Gemma 3: QK-norm, a RoPE base per layer type, a 5:1 default pattern, no soft-caps by default.
    gemma3: bool = False

    def example_config(self) -> dict[str, Any]:
        """A tiny config.json (for `axcore loc`): two layers, one local and one global."""
        config = {**super().example_config(), "head_dim": 8, "query_pre_attn_scalar": 8, "sliding_window": 4,
                  "tie_word_embeddings": True, "layer_types": [SLIDING, FULL]}
        if self.gemma3:
            return {**config, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0}
        return {**config, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}

    def _default_types(self, field: ConfigFields, num_layers: int) -> list[str]:
        period = field.int("sliding_window_pattern", 6) if self.gemma3 else 2
        return [SLIDING if (i + 1) % period else FULL for i in range(num_layers)]

    def _ropes(self, config: Mapping[str, Any], where: str) -> tuple[dict[str, Any], float | None]:
        """(the global layers' RoPE fields for LlamaConverter, the local layers' base or None)."""
        params = config.get("rope_parameters")
        if isinstance(params, Mapping) and (FULL in params or SLIDING in params):
            full, local = dict(params.get(FULL) or {}), dict(params.get(SLIDING) or {})
            if local.get("rope_type", "default") != "default" or local.get("factor", 1.0) != 1.0:
                raise ConversionError(
                    f"{where}: 'rope_parameters.sliding_attention' has rope_type {local.get('rope_type')!r}; local "
                    f"layers must use plain RoPE (rope_type default)."
                )
            full.setdefault("rope_theta", GEMMA3_THETA[FULL])
            return {"rope_parameters": full}, float(local.get("rope_theta", GEMMA3_THETA[SLIDING]))
        ropes = {k: config[k] for k in ("rope_parameters", "rope_theta", "rope_scaling") if config.get(k) is not None}
        if not self.gemma3:
            return ropes, None
        ropes.setdefault("rope_theta", GEMMA3_THETA[FULL])
        return ropes, float(config.get("rope_local_base_freq") or GEMMA3_THETA[SLIDING])

    def experiment(self, config: Mapping[str, Any], where: str) -> dict[str, Any]:
        """config.json data -> experiment data: the Llama experiment with Gemma's norms, scales, caps and pattern."""
        field = ConfigFields(config, where)
        for name in ("attention_bias", "mlp_bias", "use_bidirectional_attention"):
            if field.get(name, False):
                raise ConversionError(f"{where}: '{name}' is true, which {self.architecture} import does not support.")
        act = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in ACTIVATIONS:
            raise ConversionError(
                f"{where}: 'hidden_activation' is {act!r}; supported: {', '.join(ACTIVATIONS)}."
            )
        ropes, local_theta = self._ropes(config, where)
        data = super().experiment({**{k: v for k, v in config.items() if k not in OWN_FIELDS}, **ropes}, where)
        model = data["model"]
        layer = model["decoder"]["layer"]
        attention = layer["self_attention"]
        norm = {"type": "rms_norm", "eps": layer["norm"]["eps"], "scale_offset": 1.0}
        layer.update(norm=norm, post_norms=True)
        model.update(final_norm=dict(norm), scale_embeddings=True)
        data["swiglu"] = {"activation": ACTIVATIONS[act]}
        scalar = config.get("query_pre_attn_scalar", attention["head_dim"])
        if isinstance(scalar, bool) or not isinstance(scalar, (int, float)) or scalar <= 0:
            raise ConversionError(f"{where}: 'query_pre_attn_scalar' is {scalar!r}; it must be a positive number.")
        attention["scale"] = float(scalar) ** -0.5
        caps = {"attn_logit_softcapping": (attention, "softcap"), "final_logit_softcapping": (model, "logits_softcap")}
        for name, (target, key) in caps.items():
            value = config.get(name)
            if value is not None:
                if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                    raise ConversionError(f"{where}: '{name}' is {value!r}; it must be a positive number or null.")
                target[key] = float(value)
        if self.gemma3:
            attention["q_norm"], attention["k_norm"] = dict(norm), dict(norm)
        num_layers = field.int("num_hidden_layers")
        types = field.get("layer_types", None) or self._default_types(field, num_layers)
        window = field.int("sliding_window") if SLIDING in (types or []) else None
        types = check_layer_types(types, num_layers, window, where)
        local = {"sliding_window": window}
        if local_theta is not None:
            local["position_embedding.theta"] = local_theta
        pattern = decoder_pattern(types, {FULL: {}, SLIDING: local})
        same = pattern.pop("same", {})
        if "position_embedding.theta" in same:  # Every layer local: the rope plugin's theta is theirs.
            data["rope"]["theta"] = same.pop("position_embedding.theta")
        attention.update(same)
        model["decoder"].update(pattern)
        return data

    def outside_config(self, experiment: Any, base: Mapping[str, Any], where: str) -> dict[str, Any]:
        """The resolved experiment -> config.json data (the Llama fields, then Gemma's)."""
        out = super().outside_config(experiment, {k: v for k, v in base.items() if k not in OWN_FIELDS}, where)
        model = experiment.to_dict()["model"]
        layer = first_layer(model["decoder"], where)
        attention, rope = layer["self_attention"], layer["self_attention"]["position_embedding"]
        for stale in ("hidden_act", "mlp_bias", "rope_theta", "rope_scaling", "rope_parameters"):
            out.pop(stale, None)
        activation = {v: k for k, v in ACTIVATIONS.items()}.get(layer["feed_forward"].get("activation"), "gelu_pytorch_tanh")
        scalar = attention["scale"] ** -2 if attention.get("scale") else attention["head_dim"]
        types, window = hf_layer_types(model["decoder"], model["num_layers"], attention.get("sliding_window"), where)
        out.update(
            hidden_activation=activation,
            query_pre_attn_scalar=round(scalar) if abs(scalar - round(scalar)) < 1e-6 else scalar,
            attn_logit_softcapping=attention.get("softcap"),
            final_logit_softcapping=model.get("logits_softcap"),
            sliding_window=window if window is not None else base.get("sliding_window", 4096),
            layer_types=types,
        )
        full = {**(hf_rope_scaling(rope, where) or {"rope_type": "default"}), "rope_theta": rope["theta"]}
        if self.gemma3:
            settings = pattern_of(model["decoder"], model["num_layers"])[1]
            local = (settings.get(SLIDING) or {}).get("position_embedding.theta", rope["theta"])
            out["rope_parameters"] = {FULL: full, SLIDING: {"rope_type": "default", "rope_theta": local}}
        else:
            out["rope_parameters"] = full
        return out

    def layer_tensors(self, config: Mapping[str, Any]) -> dict[str, tuple[tuple[str, ...], str]]:
        """Llama's per-layer tensors with Gemma's four norms, plus Gemma 3's q/k norms."""
        table = dict(LAYER_TENSORS)
        table["post_attention_layernorm.weight"] = (("post_attention_norm", "scale"), "copy")
        table["pre_feedforward_layernorm.weight"] = (("ffn_norm", "scale"), "copy")
        table["post_feedforward_layernorm.weight"] = (("post_ffn_norm", "scale"), "copy")
        if self.gemma3:
            table.update(QK_NORM_TENSORS)
        return table


GEMMA2 = GemmaConverter()
GEMMA3 = GemmaConverter(model_type="gemma3_text", architecture="Gemma3ForCausalLM", gemma3=True)
