"""A PEFT adapter directory read and checked whole before anything is written (`axcore lora import-peft`).

`read_adapter(adapter_dir)` returns the `Adapter` (its checked config and its LoRA pairs)
or raises `PeftAdapterError` in one line naming the file and the key or tensor:

- `adapter_config.json` must be a JSON object that passes `check_config`: `peft_type` is
  `LORA`; `r` a positive integer and `lora_alpha` a positive number (both required, as
  PEFT's `save_pretrained` always writes them); `lora_dropout` in [0, 1); `target_modules`
  a non-empty list of module names or one regular expression (PEFT's two forms, with its
  `all-linear` shorthand); `bias` `none`. Every other key is either informational
  (`INFORMATIONAL`: PEFT's bookkeeping) or must be off (null, false, empty): an option
  that is on changes the arithmetic away from `y = x W^T + (lora_alpha / r) x A^T B^T`
  (DoRA, rsLoRA, fan_in_fan_out, modules_to_save, rank or alpha patterns, PiSSA-style
  initialisations that rewrite the base, ...) or is one axcore does not know.
- `adapter_model.safetensors` must be a readable safetensors file holding only
  `base_model.model.<module>.lora_A.weight` `[r, in]` and `.lora_B.weight` `[out, r]`,
  both of each module, floating point, every value finite. There is no flag to accept
  NaN or infinite weights: such an adapter gives NaN logits at every position.

Matching against the base model (which modules exist, their `in` / `out`) is the
importer's part (`axcore_lora.peft.import_peft`); `selects(config, module)` is PEFT's rule
for which modules a config adapts (`check_target_module_exists`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import re
from typing import Any

import numpy as np

from axcore import AxcoreError

CONFIG_NAME, WEIGHTS_NAME = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."
# A tensor of a plain LoRA adapter: PREFIX + module + one of these.
SUFFIXES = {"A": ".lora_A.weight", "B": ".lora_B.weight"}
# Keys that PEFT writes for its own bookkeeping; they do not change the arithmetic.
INFORMATIONAL = frozenset({
    "peft_type", "task_type", "base_model_name_or_path", "revision", "inference_mode", "auto_mapping",
    "peft_version", "runtime_config", "qalora_group_size", "megatron_core", "init_lora_weights",
})
# init_lora_weights values whose result is in the saved A and B alone (the others rewrite the base weights).
PLAIN_INITS = (True, False, "gaussian", "eva")
# Floating dtypes an adapter may be stored in (safetensors' names).
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
# PEFT's shorthand target: every linear module but the output head.
ALL_LINEAR = "all-linear"
OUTPUT_HEAD = "lm_head"


class PeftAdapterError(AxcoreError):
    """A PEFT adapter directory that does not fit (names the file or tensor and what to do)."""


@dataclasses.dataclass(frozen=True)
class Adapter:
    """A checked PEFT LoRA adapter: its config and `{module: (A [r, in], B [out, r])}` as float32."""

    config: dict[str, Any]
    pairs: dict[str, tuple[np.ndarray, np.ndarray]]


def read_adapter(adapter_dir: str | pathlib.Path) -> Adapter:
    """The adapter of `adapter_dir`, every check of the module docstring passed (else `PeftAdapterError`)."""
    adapter_dir = pathlib.Path(adapter_dir)
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        if not (adapter_dir / name).is_file():
            raise PeftAdapterError(f"'{adapter_dir / name}' is missing; pass a PEFT adapter directory (save_pretrained).")
    config = check_config(_read_json(adapter_dir / CONFIG_NAME), adapter_dir / CONFIG_NAME)
    return Adapter(config, _read_pairs(adapter_dir / WEIGHTS_NAME, config["r"]))


def _read_json(path: pathlib.Path) -> Any:
    try:
        return json.loads(path.read_text("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PeftAdapterError(f"'{path}' is not JSON ({e}); save the adapter again with PEFT's save_pretrained.") \
            from None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


def _is_targets(v: Any) -> bool:
    if isinstance(v, str):
        return bool(v)
    return isinstance(v, list) and bool(v) and all(isinstance(m, str) and m for m in v)


# key -> (required, whether a value fits, what fits). Missing optional keys take PEFT's defaults.
SCHEMA = {
    "peft_type": (True, lambda v: v == "LORA", "LORA (only LoRA adapters import)"),
    "r": (True, lambda v: _is_int(v) and v > 0, "a positive integer (the adapter rank)"),
    "lora_alpha": (True, lambda v: _is_number(v) and v > 0, "a positive number"),
    "target_modules": (True, _is_targets, "a non-empty list of module names or one regular expression"),
    "lora_dropout": (False, lambda v: v is None or (_is_number(v) and 0 <= v < 1), "a number in [0, 1)"),
    "bias": (False, lambda v: v in (None, "none"), "none (axcore adapters have no bias)"),
    "init_lora_weights": (False, lambda v: v in PLAIN_INITS,
                          f"one of {', '.join(map(str, PLAIN_INITS))} (the others rewrite the base weights)"),
}


def _off(value: Any) -> bool:
    return value is None or value is False or (isinstance(value, (list, dict, str)) and not value)


def check_config(config: Any, path: pathlib.Path) -> dict[str, Any]:
    """`config` (adapter_config.json's data) checked against `SCHEMA`, every other key informational or off."""
    if not isinstance(config, dict):
        raise PeftAdapterError(f"'{path}' holds a JSON {type(config).__name__}, not an object of LoRA settings.")
    for key, (required, fits, wanted) in SCHEMA.items():
        if key not in config:
            if required:
                raise PeftAdapterError(f"'{path}': key '{key}' is missing; it must be {wanted}.")
            continue
        if not fits(config[key]):
            raise PeftAdapterError(f"'{path}': key '{key}' is {json.dumps(config[key])}; it must be {wanted}.")
    for key, value in config.items():
        if key not in SCHEMA and key not in INFORMATIONAL and not _off(value):
            raise PeftAdapterError(
                f"'{path}': key '{key}' is {json.dumps(value)}, which axcore does not support (it imports plain LoRA: "
                f"no DoRA, rsLoRA, fan_in_fan_out, modules_to_save, layer or rank patterns); merge the adapter in PEFT "
                f"(merge_and_unload) and import the merged model with axcore convert hf-to-axcore instead."
            )
    if isinstance(config["target_modules"], str):
        try:
            re.compile(config["target_modules"])
        except re.error as e:
            raise PeftAdapterError(f"'{path}': key 'target_modules' ({config['target_modules']!r}) is not a regular "
                                   f"expression: {e}.") from None
    return config


def selects(config: dict[str, Any], module: str) -> bool:
    """PEFT's rule: whether `config`'s target_modules adapt `module` (a full name, `model.layers.0.self_attn.q_proj`)."""
    targets = config["target_modules"]
    if targets == ALL_LINEAR:
        return module.split(".")[-1] != OUTPUT_HEAD
    if isinstance(targets, str):
        return re.fullmatch(targets, module) is not None
    return any(module == t or module.endswith("." + t) for t in targets)


def _read_pairs(path: pathlib.Path, rank: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """`{module: (A, B)}` of the safetensors file `path`, each tensor checked (module docstring)."""
    from safetensors import SafetensorError, safe_open

    found: dict[str, dict[str, np.ndarray]] = {}
    try:
        with safe_open(str(path), framework="numpy") as f:
            dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118 (a safe_open handle)
            for key, dtype in dtypes.items():
                module, which = _parse_key(path, key)
                if dtype not in FLOAT_DTYPES:
                    raise PeftAdapterError(f"'{path}': tensor {key} is stored as {dtype}; LoRA weights are floating "
                                           f"point ({', '.join(FLOAT_DTYPES)}): the file is not a LoRA adapter's.")
                found.setdefault(module, {})[which] = np.asarray(f.get_tensor(key), np.float32)  # bf16: ml_dtypes
    except SafetensorError as e:
        raise PeftAdapterError(f"'{path}' is not a readable safetensors file ({e}); save the adapter again.") from None
    if not found:
        raise PeftAdapterError(f"'{path}' holds no tensors; save the adapter again with PEFT's save_pretrained.")
    pairs = {}
    for module, tensors in sorted(found.items()):
        for which, other in (("A", "B"), ("B", "A")):
            if which not in tensors:
                raise PeftAdapterError(f"'{path}': tensor {PREFIX}{module}{SUFFIXES[which]} is missing beside "
                                       f"{PREFIX}{module}{SUFFIXES[other]}; the file is incomplete, save it again.")
        a, b = tensors["A"], tensors["B"]
        for which, value, rank_axis, layout in (("A", a, 0, "[r, in]"), ("B", b, 1, "[out, r]")):
            if value.ndim != 2 or value.shape[rank_axis] != rank:
                raise PeftAdapterError(f"'{path}': tensor {PREFIX}{module}{SUFFIXES[which]} has shape "
                                       f"{list(value.shape)}; with r = {rank} ({CONFIG_NAME}) it must be {layout}.")
            bad = int(value.size - np.count_nonzero(np.isfinite(value)))
            if bad:
                raise PeftAdapterError(f"'{path}': tensor {PREFIX}{module}{SUFFIXES[which]} has {bad} NaN or infinite "
                                       f"values; the adapter diverged in training, export an earlier checkpoint.")
        pairs[module] = (a, b)
    return pairs


def _parse_key(path: pathlib.Path, key: str) -> tuple[str, str]:
    """`(module, "A" | "B")` of a tensor name, or `PeftAdapterError` for a tensor that is not a LoRA weight."""
    for which, suffix in SUFFIXES.items():
        if key.startswith(PREFIX) and key.endswith(suffix) and len(key) > len(PREFIX) + len(suffix):
            return key[len(PREFIX):-len(suffix)], which
    raise PeftAdapterError(f"'{path}': tensor {key} is not a LoRA weight ({PREFIX}<module>.lora_A.weight or "
                           f".lora_B.weight); axcore imports plain LoRA adapters only (no DoRA magnitudes, "
                           f"modules_to_save or embedding adapters).")

