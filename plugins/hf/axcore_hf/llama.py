"""The Llama family (`llama`, and `mistral` = Llama + sliding-window attention) <-> axcore.

Architecture (Hugging Face `LlamaForCausalLM`): token embedding, `num_hidden_layers`
pre-norm layers (RMSNorm, grouped-query attention with rotate-half RoPE, RMSNorm,
SwiGLU MLP), final RMSNorm, output head (tied to the embedding when
`tie_word_embeddings`). In axcore: `plugins: [rope, swiglu]`, a causal LM without
learned positions, rms_norm everywhere, bias-free projections.

Tensors, with d = hidden_size, n/k = query/key-value heads, h = head_dim,
I = intermediate_size, V = vocab_size (HF `[out, in]` weights; axcore `[in, ...]`):

| Hugging Face                                    | axcore (per layer under decoder/layer{i}, or decoder/layer with a leading layer axis) |
|-------------------------------------------------|------------------------------------------------|
| model.embed_tokens.weight `[V, d]`              | embedding/weight `[V, d]`                      |
| model.layers.i.input_layernorm.weight `[d]`     | attention_norm/scale `[d]`                     |
| model.layers.i.self_attn.q_proj.weight `[n*h, d]` | self_attention/wq `[d, n, h]` (transpose, split heads) |
| model.layers.i.self_attn.k_proj / v_proj `[k*h, d]` | self_attention/wk, wv `[d, k, h]`          |
| model.layers.i.self_attn.o_proj.weight `[d, n*h]` | self_attention/wo `[n, h, d]`               |
| model.layers.i.post_attention_layernorm.weight `[d]` | ffn_norm/scale `[d]`                      |
| model.layers.i.mlp.gate_proj / up_proj `[I, d]` | feed_forward/gate_proj, up_proj/weight `[d, I]` |
| model.layers.i.mlp.down_proj.weight `[d, I]`    | feed_forward/down_proj/weight `[I, d]`         |
| model.norm.weight `[d]`                         | final_norm/scale `[d]`                         |
| lm_head.weight `[V, d]` (absent when tied)      | lm_head/weight `[d, V]`                        |

Both sides use the same head order and the rotate-half RoPE pairing, so no
permutation is needed; every mapping is a transpose and a reshape (exact).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from axcore.checkpoint.interop import ConversionError

# Per-layer tensors: HF suffix -> (axcore path inside a layer, layout kind).
LAYER_TENSORS = {
    "input_layernorm.weight": (("attention_norm", "scale"), "copy"),
    "self_attn.q_proj.weight": (("self_attention", "wq"), "in_proj"),
    "self_attn.k_proj.weight": (("self_attention", "wk"), "in_proj"),
    "self_attn.v_proj.weight": (("self_attention", "wv"), "in_proj"),
    "self_attn.o_proj.weight": (("self_attention", "wo"), "out_proj"),
    "post_attention_layernorm.weight": (("ffn_norm", "scale"), "copy"),
    "mlp.gate_proj.weight": (("feed_forward", "gate_proj", "weight"), "linear"),
    "mlp.up_proj.weight": (("feed_forward", "up_proj", "weight"), "linear"),
    "mlp.down_proj.weight": (("feed_forward", "down_proj", "weight"), "linear"),
}
# QK-norm (the core's `q_norm` / `k_norm` slots), for families that have it: one RMSNorm scale per head dim.
QK_NORM_TENSORS = {
    "self_attn.q_norm.weight": (("self_attention", "q_norm", "scale"), "copy"),
    "self_attn.k_norm.weight": (("self_attention", "k_norm", "scale"), "copy"),
}
# Tensors outside the layers: HF name -> (axcore path, layout kind).
GLOBAL_TENSORS = {
    "model.embed_tokens.weight": (("embedding", "weight"), "copy"),
    "model.norm.weight": (("final_norm", "scale"), "copy"),
    "lm_head.weight": (("lm_head", "weight"), "linear"),
}
# RoPE types of `rope_scaling` / `rope_parameters` that the rope plugin computes identically.
ROPE_TYPES = {"default": "none", "llama3": "llama3", "yarn": "yarn"}


def hf_shape(kind: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The HF tensor shape holding an axcore parameter of `shape` in layout `kind`."""
    if kind == "in_proj":  # [d, n, h] <- [n*h, d]
        return (shape[1] * shape[2], shape[0])
    if kind == "out_proj":  # [n, h, d] <- [d, n*h]
        return (shape[2], shape[0] * shape[1])
    if kind == "linear":  # [in, out] <- [out, in]
        return (shape[1], shape[0])
    if kind == "flat":  # [n, h] <- [n*h] (a projection's bias)
        return (math.prod(shape),)
    return tuple(shape)


def from_hf(kind: str, tensor: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """An HF tensor -> the axcore parameter of `shape` (float32; exact for bf16/fp16 sources)."""
    t = np.asarray(tensor).astype(np.float32)
    return t.T.reshape(shape) if kind != "copy" else t.reshape(shape)


def to_hf(kind: str, param: np.ndarray) -> np.ndarray:
    """An axcore parameter -> the HF tensor (inverse of `from_hf`), float32."""
    p = np.asarray(param, np.float32)
    if kind == "in_proj":
        return np.ascontiguousarray(p.reshape(p.shape[0], -1).T)
    if kind == "out_proj":
        return np.ascontiguousarray(p.reshape(-1, p.shape[-1]).T)
    if kind == "flat":
        return np.ascontiguousarray(p.reshape(-1))
    return np.ascontiguousarray(p.T) if kind == "linear" else p


def _get(tree: Mapping, path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _set(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def unplaced_tensors(tensors: Mapping[str, Any], used: set[str], tied: bool) -> str:
    """The checkpoint tensors an import left unused, listed for an error ('' when none).

    RoPE's stored `inv_freq` buffers are ignored, and so is `lm_head.weight` of a `tied`
    model (tied checkpoints sometimes store the head too; it equals the table). At most
    five names are listed, then ' ...'.
    """
    extra = sorted(set(tensors) - used - {n for n in tensors if n.endswith("rotary_emb.inv_freq")})
    if tied and "lm_head.weight" in extra:
        extra.remove("lm_head.weight")
    return f"{', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''}"


def layer_slots(decoder: Mapping, num_layers: int) -> list[tuple[tuple[str, ...], int | None]]:
    """Where layer i's parameters live in a decoder tree: `(path, index on the leading axis or None)`.

    Unrolled stacks hold `layer{i}`; scanned ones (`repeated_transformer`) hold `layer`
    with a leading `[repeats]` axis, its unit either one layer or a block `layer{j}`.
    """
    if "layer0" in decoder:
        return [(("decoder", f"layer{i}"), None) for i in range(num_layers)]
    unit = decoder["layer"]
    if "layer0" in unit:
        per = sum(1 for key in unit if key.startswith("layer"))
        return [(("decoder", "layer", f"layer{i % per}"), i // per) for i in range(num_layers)]
    return [(("decoder", "layer"), i) for i in range(num_layers)]


@dataclasses.dataclass(frozen=True)
class LlamaConverter:
    """Converts `LlamaForCausalLM` checkpoints (and, with `sliding_window`, `MistralForCausalLM`)."""

    # The Hugging Face model_type this instance is registered under.
    model_type: str = "llama"
    # The HF architecture name written to an exported config.json.
    architecture: str = "LlamaForCausalLM"
    # Whether config.json's `sliding_window` maps to the attention's sliding_window (Mistral).
    sliding_window: bool = False

    # -- Configs ----------------------------------------------------------------------

    def example_config(self) -> dict[str, Any]:
        """A tiny config.json of this family (the model `axcore loc` runs to see which core lines it uses)."""
        config = {
            "model_type": self.model_type, "vocab_size": 256, "hidden_size": 32, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64, "rms_norm_eps": 1e-6,
            "max_position_embeddings": 64, "rope_theta": 10000.0, "tie_word_embeddings": False,
        }
        return {**config, "sliding_window": 4} if self.sliding_window else config

    def experiment(self, config: Mapping[str, Any], where: str) -> dict[str, Any]:
        """config.json data -> experiment data (`plugins: [rope, swiglu]`, `rope:`, `swiglu:`, `model:`)."""
        field = ConfigFields(config, where)
        for name in ("attention_bias", "mlp_bias"):
            if field.get(name, False):
                raise ConversionError(
                    f"{where}: '{name}' is true, but axcore's attention and SwiGLU projections have no biases; "
                    f"this checkpoint cannot be imported (only bias-free Llama-family models are)."
                )
        act = field.get("hidden_act", "silu")
        if act != "silu":
            raise ConversionError(f"{where}: 'hidden_act' is {act!r}; only 'silu' (SwiGLU) is supported.")
        heads = field.int("num_attention_heads")
        dim = field.int("hidden_size")
        attention = {
            "num_heads": heads,
            "num_kv_heads": field.int("num_key_value_heads", heads),
            "head_dim": field.int("head_dim", dim // heads),
            "causal": True,
            "dropout_rate": float(field.get("attention_dropout", 0.0) or 0.0),
        }
        window = field.get("sliding_window", None)
        if window is not None and (self.sliding_window or field.get("use_sliding_window", True)):
            if not self.sliding_window:
                raise ConversionError(
                    f"{where}: 'sliding_window' is {window!r}, which model_type '{self.model_type}' does not use; "
                    f"set it to null (or use model_type mistral)."
                )
            attention["sliding_window"] = field.int("sliding_window")
        eps = float(field.get("rms_norm_eps", 1e-6))
        model = {
            "param_dtype": "float32",  # Master weights: exact for bf16/fp16 checkpoints.
            "compute_dtype": "float32",
            "vocab_size": field.int("vocab_size"),
            "dim": dim,
            "num_layers": field.int("num_hidden_layers"),
            "position_embedding": None,  # RoPE acts inside attention.
            "decoder": {
                "type": "stacked_transformer",
                "layer": {
                    "norm": {"type": "rms_norm", "eps": eps},
                    "self_attention": attention,
                    "feed_forward": {"hidden_dim": field.int("intermediate_size")},
                },
            },
            "final_norm": {"type": "rms_norm", "eps": eps},
            "lm_head": None if field.get("tie_word_embeddings", False) else {"type": "linear", "bias": False},
        }
        rope = rope_settings(field)
        return {"plugins": ["rope", "swiglu"], "rope": rope, "swiglu": {"activation": "silu"}, "model": model}

    def outside_config(self, experiment: Any, base: Mapping[str, Any], where: str) -> dict[str, Any]:
        """The resolved experiment -> config.json data (architecture fields over `base`)."""
        data = experiment.to_dict()
        model = data["model"]
        layer = first_layer(model["decoder"], where)
        attention, ffn = layer["self_attention"], layer["feed_forward"]
        rope = attention.get("position_embedding") or {}
        if rope.get("type") != "rotary":
            raise ConversionError(
                f"{where}: model.decoder...self_attention.position_embedding is {rope.get('type')!r}; a "
                f"{self.architecture} needs rotary position embeddings (plugins: [rope])."
            )
        heads = attention["num_heads"]
        out = dict(base)
        for stale in ("rope_scaling", "rope_parameters", "rope_theta", "torch_dtype", "dtype", "transformers_version"):
            out.pop(stale, None)
        out.update(
            architectures=[self.architecture],
            model_type=self.model_type,
            vocab_size=model["vocab_size"],
            hidden_size=model["dim"],
            num_hidden_layers=model["num_layers"],
            num_attention_heads=heads,
            num_key_value_heads=attention["num_kv_heads"] or heads,
            head_dim=attention["head_dim"] or model["dim"] // heads,
            intermediate_size=ffn["hidden_dim"],
            hidden_act="silu",
            rms_norm_eps=layer["norm"]["eps"],
            attention_bias=False,
            mlp_bias=False,
            attention_dropout=attention["dropout_rate"],
            tie_word_embeddings=model["lm_head"] is None,
        )
        scaling = hf_rope_scaling(rope, where)
        if "rope_parameters" in base:  # transformers 5's form, kept when the source used it.
            out["rope_parameters"] = {"rope_type": "default", **(scaling or {}), "rope_theta": rope["theta"]}
        else:  # The form every transformers release reads (5 converts it).
            out.update(rope_theta=rope["theta"], rope_scaling=scaling)
        out.setdefault("max_position_embeddings", data["input"]["seq_len"])
        if self.sliding_window:
            out["sliding_window"] = attention["sliding_window"]
        return out

    # -- Parameters -------------------------------------------------------------------

    def layer_tensors(self, config: Mapping[str, Any]) -> dict[str, tuple[tuple[str, ...], str]]:
        """Per-layer tensors of a checkpoint with this config.json: HF suffix -> (axcore path, layout kind).

        `LAYER_TENSORS`; families that add tensors (biases, q/k norms) extend it.
        """
        del config
        return LAYER_TENSORS

    def params_from_outside(self, tensors: Mapping[str, Any], config: Mapping[str, Any], template: Any, where: str) -> dict:
        """HF tensors -> axcore params (float32 NumPy) shaped like `template` (a tree with `.shape` leaves)."""
        shapes = _shapes(template)
        params: dict = {}
        used: set[str] = set()

        def take(name: str, kind: str, shape: tuple[int, ...]) -> np.ndarray:
            if name not in tensors:
                raise ConversionError(
                    f"{where}: tensor '{name}' is missing from the safetensors files; re-download the model."
                )
            tensor = tensors[name]
            if tuple(tensor.shape) != hf_shape(kind, shape):
                raise ConversionError(
                    f"{where}: tensor '{name}' has shape {list(tensor.shape)} but config.json implies "
                    f"{list(hf_shape(kind, shape))}; the config and the weights disagree."
                )
            used.add(name)
            return from_hf(kind, tensor, shape)

        for name, (path, kind) in GLOBAL_TENSORS.items():
            if path[0] in shapes:
                _set(params, path, take(name, kind, _get(shapes, path)))
        for i, (prefix, index) in enumerate(layer_slots(shapes["decoder"], _num_layers(config, where))):
            for suffix, (path, kind) in self.layer_tensors(config).items():
                full = _get(shapes, prefix + path)
                if index is None:
                    _set(params, prefix + path, take(f"model.layers.{i}.{suffix}", kind, full))
                    continue
                stacked = _get_or_none(params, prefix + path)
                if stacked is None:
                    stacked = np.empty(full, np.float32)
                    _set(params, prefix + path, stacked)
                stacked[index] = take(f"model.layers.{i}.{suffix}", kind, full[1:])
        extra = unplaced_tensors(tensors, used, tied="lm_head" not in shapes)
        if extra:
            raise ConversionError(
                f"{where}: tensors {extra} have no place in "
                f"the {self.architecture} model config.json describes (e.g. biases); they cannot be imported."
            )
        return params

    def params_to_outside(self, params: Any, config: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """axcore params -> HF tensors (float32), by the table in the module docstring."""
        out: dict[str, np.ndarray] = {}
        for name, (path, kind) in GLOBAL_TENSORS.items():
            if path[0] in params:
                out[name] = to_hf(kind, _get(params, path))
        for i, (prefix, index) in enumerate(layer_slots(params["decoder"], _num_layers(config, "config.json"))):
            for suffix, (path, kind) in self.layer_tensors(config).items():
                value = np.asarray(_get(params, prefix + path))
                out[f"model.layers.{i}.{suffix}"] = to_hf(kind, value if index is None else value[index])
        return out


class ConfigFields:
    """Typed reads of config.json fields; errors name the file and the field.

    Public for the family plugins (qwen, gemma) that read their own fields the same way:
    `ConfigFields(config, "HF_DIR/config.json").int("num_hidden_layers")`.
    """

    def __init__(self, config: Mapping[str, Any], where: str):
        self.config, self.where = config, where

    def get(self, name: str, default: Any) -> Any:
        value = self.config.get(name, default)
        return default if value is None and default is not None else value

    def int(self, name: str, default: int | None = None) -> int:
        value = self.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            need = "is missing" if value is None else f"is {value!r}"
            raise ConversionError(f"{self.where}: '{name}' {need}; it must be a positive integer.")
        return value


def _shapes(tree: Any) -> Any:
    return {k: _shapes(v) for k, v in tree.items()} if isinstance(tree, Mapping) else tuple(tree.shape)


def _get_or_none(tree: Mapping, path: tuple[str, ...]) -> Any:
    try:
        return _get(tree, path)
    except KeyError:
        return None


def _num_layers(config: Mapping[str, Any], where: str) -> int:
    return ConfigFields(config, where).int("num_hidden_layers")


def rope_settings(field: ConfigFields) -> dict[str, Any]:
    """The `rope:` section for config.json's `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling`."""
    params = {**(field.get("rope_scaling", None) or {}), **(field.get("rope_parameters", None) or {})}
    theta = params.get("rope_theta", field.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ConversionError(
            f"{field.where}: rope type {rope_type!r} (rope_scaling/rope_parameters.rope_type) is not supported; "
            f"supported: {', '.join(ROPE_TYPES)}."
        )
    settings: dict[str, Any] = {"theta": float(theta), "scaling": ROPE_TYPES[rope_type]}
    fraction = params.get("partial_rotary_factor", field.get("partial_rotary_factor", 1.0))
    if fraction != 1.0:  # Llama's attention rotates whole heads.
        raise ConversionError(
            f"{field.where}: 'partial_rotary_factor' is {fraction!r}; Llama models rotate whole heads (1.0)."
        )
    if rope_type == "yarn":
        settings.update(yarn_settings(params, field))
    if rope_type == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        missing = [k for k in keys if params.get(k) is None]
        if missing:
            raise ConversionError(f"{field.where}: llama3 rope scaling lacks {', '.join(missing)}; add them.")
        settings.update(
            scaling_factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_len=int(params["original_max_position_embeddings"]),
        )
    return settings


def yarn_settings(params: Mapping[str, Any], field: ConfigFields) -> dict[str, Any]:
    """The rope plugin's yarn settings for HF yarn parameters (transformers' `_compute_yarn_parameters`)."""
    original = params.get("original_max_position_embeddings") or field.get("max_position_embeddings", None)
    factor = params.get("factor") or (field.int("max_position_embeddings") / original if original else None)
    if not original or not factor:
        raise ConversionError(f"{field.where}: yarn rope scaling needs 'factor' and 'original_max_position_embeddings'.")
    default_attention = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    attention = params.get("attention_factor")
    if (attention is not None and not math.isclose(attention, default_attention)) or (
        params.get("mscale") and params.get("mscale_all_dim")
    ) or params.get("truncate", True) is False:
        raise ConversionError(
            f"{field.where}: yarn's attention_factor/mscale/mscale_all_dim/truncate differ from the paper's defaults "
            f"(attention factor 0.1 ln(factor) + 1, truncated ramp), which is all the rope plugin computes."
        )
    return {
        "scaling_factor": float(factor),
        "original_max_len": int(original),
        "beta_fast": float(params.get("beta_fast") or 32.0),
        "beta_slow": float(params.get("beta_slow") or 1.0),
    }


def hf_rope_scaling(rope: Mapping[str, Any], where: str) -> dict[str, Any] | None:
    """config.json's `rope_scaling` for a resolved rotary config (None: plain RoPE)."""
    if rope["scaling"] == "none":
        return None
    if rope["scaling"] == "yarn":
        return {"rope_type": "yarn", "factor": rope["scaling_factor"], "beta_fast": rope["beta_fast"],
                "beta_slow": rope["beta_slow"], "original_max_position_embeddings": rope["original_max_len"]}
    return {
        "rope_type": "llama3",
        "factor": rope["scaling_factor"],
        "low_freq_factor": rope["low_freq_factor"],
        "high_freq_factor": rope["high_freq_factor"],
        "original_max_position_embeddings": rope["original_max_len"],
    }


def first_layer(decoder: Mapping[str, Any], where: str) -> Mapping[str, Any]:
    """The first transformer layer's config data of a decoder (unrolled, per-layer list, or scanned unit)."""
    layer = decoder["layer"]
    if isinstance(layer, list):
        layer = layer[0]
    if layer.get("type") == "stacked_transformer":  # A scanned block of layers.
        return first_layer(layer, where)
    if layer.get("type") != "transformer_layer":
        raise ConversionError(f"{where}: model.decoder.layer is {layer.get('type')!r}; only transformer_layer converts.")
    return layer

