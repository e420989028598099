"""Hugging Face `layer_types` <-> axcore per-layer attention patterns.

Families with local (sliding-window) and global layers (Qwen2 with
`use_sliding_window`, Qwen3, Gemma 2/3) list each layer's type in config.json's
`layer_types` (`full_attention` or `sliding_attention`). In axcore the decoder
(`stacked_transformer`) holds the same list in `layer_types`, and `attention_types`
maps each type to the self-attention fields its layers set (`sliding_window`, and a
RoPE base per type, `position_embedding.theta`, where the family has one).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from axcore.checkpoint.interop import ConversionError

FULL, SLIDING = "full_attention", "sliding_attention"
# The HF layer types axcore computes.
HF_LAYER_TYPES = (FULL, SLIDING)


def check_layer_types(types: Any, num_layers: int, window: int | None, where: str) -> list[str]:
    """config.json's `layer_types`, checked: one known type per layer, a window where a layer slides."""
    if not isinstance(types, Sequence) or isinstance(types, str) or len(types) != num_layers:
        raise ConversionError(
            f"{where}: 'layer_types' is {types!r}; it must list one type per layer ({num_layers})."
        )
    for i, name in enumerate(types):
        if name not in HF_LAYER_TYPES:
            raise ConversionError(
                f"{where}: 'layer_types' entry {i} is {name!r}; supported: {', '.join(HF_LAYER_TYPES)}."
            )
    if SLIDING in types and window is None:
        raise ConversionError(
            f"{where}: 'layer_types' lists sliding_attention but 'sliding_window' is null (or "
            f"'use_sliding_window' false); set the window or make every layer full_attention."
        )
    return list(types)


def decoder_pattern(types: Sequence[str], settings: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The decoder fields for HF `types` with `settings[type]` (self-attention fields per type).

    Every layer alike: `{}` when its settings are empty, else `{"same": settings}` for the
    caller to set on the layer's attention directly (the model then scans too). Otherwise
    `{"layer_types": types, "attention_types": {type: settings}}` for the types used.
    """
    used = list(dict.fromkeys(types))
    if len(used) == 1:
        return {"same": dict(settings[used[0]])} if settings[used[0]] else {}
    return {"layer_types": list(types), "attention_types": {name: dict(settings[name]) for name in used}}


def scanned_decoder(decoder: Mapping[str, Any], num_layers: int, where: str) -> dict[str, Any]:
    """A converter's decoder data as a `repeated_transformer` (lax.scan over the layers).

    Without `layer_types` the unit is the layer; with them it is a `stacked_transformer`
    block of one period of the pattern (its shortest repeating prefix), scanned
    `num_layers / period` times. A pattern that does not repeat is refused.
    """
    types = decoder.get("layer_types")
    if types is None:
        return {**decoder, "type": "repeated_transformer"}
    period = next(p for p in range(1, num_layers + 1) if num_layers % p == 0 and types == types[:p] * (num_layers // p))
    if period == num_layers and num_layers > 1:
        raise ConversionError(
            f"{where}: --scan repeats one block of layers, but 'layer_types' ({num_layers} layers) is no repetition "
            f"of a shorter pattern; import without --scan."
        )
    block = {"type": "stacked_transformer", "num_layers": period, "layer": decoder["layer"],
             "layer_types": list(types[:period]), "attention_types": decoder["attention_types"]}
    return {"type": "repeated_transformer", "layer": block}


def pattern_of(decoder: Mapping[str, Any], num_layers: int) -> tuple[list[str] | None, dict[str, Any]]:
    """A resolved decoder's per-layer types (None: every layer alike) and its `attention_types`.

    Reads an unrolled `stacked_transformer`, or a `repeated_transformer` whose unit is a
    `stacked_transformer` block (its types repeated over the depth).
    """
    stack = decoder
    unit = decoder.get("layer")
    if decoder.get("type") == "repeated_transformer" and isinstance(unit, Mapping) and unit.get("type") == "stacked_transformer":
        stack = unit
    types = stack.get("layer_types")
    if types is None:
        return None, {}
    return list(types) * (num_layers // len(types)), dict(stack.get("attention_types") or {})


def hf_layer_types(decoder: Mapping[str, Any], num_layers: int, base_window: int | None, where: str) -> tuple[list[str], int | None]:
    """A resolved decoder -> (HF `layer_types`, the one sliding window or None).

    A layer slides when its type (or, without types, the layer config) sets a window;
    HF configs have a single `sliding_window`, so two different windows are refused.
    """
    types, settings = pattern_of(decoder, num_layers)
    if types is None:
        return [SLIDING if base_window is not None else FULL] * num_layers, base_window
    windows = {name: settings.get(name, {}).get("sliding_window", base_window) for name in set(types)}
    found = {w for w in windows.values() if w is not None}
    if len(found) > 1:
        raise ConversionError(
            f"{where}: model.decoder.attention_types sets sliding windows {sorted(found)}; a Hugging Face "
            f"config.json has one sliding_window."
        )
    return [SLIDING if windows[name] is not None else FULL for name in types], (found.pop() if found else None)
