"""Train-state memory of an experiment from abstract shapes (`axcore lora memory`; nothing allocated).

    params     every parameter as stored: adapters, other trainable ones, the frozen float
               base, and the QLoRA base (uint8: codes and scales, `axcore_lora.quant`)
    optimizer  the optimizer's state (`TrainStep.abstract_state()['opt_state']`; frozen
               parameters have none)
    gradients  one gradient per trainable parameter, in its dtype (what the update consumes;
               frozen ones are gradient-stopped, XLA keeps no buffer for their zeros)

Bytes are whole-model totals (divide by the devices a parameter is sharded over for a
per-device figure); activations and temporaries are not counted (`axcore compile` reports
those per device for a concrete batch).
"""

from __future__ import annotations

import math
import re
from typing import Any

import jax
import numpy as np

from axcore.params import ParameterSpec
from axcore.trainer.learner import restrict_trainable
from axcore.trainer.step import TrainStep

from axcore_lora.quant import quantized_init

# The adapter parameters (the lora plugin's `trainer.learner.trainable`).
ADAPTER = re.compile(r"/lora_[ab]$")
# The report's rows in order, each `(key, explanation)`.
ROWS = [
    ("parameters", "model parameters (a quantized weight counts its declared elements)"),
    ("trainable_parameters", "parameters the optimizer updates"),
    ("adapter_bytes", "LoRA adapters (A, B)"),
    ("trainable_other_bytes", "other trainable parameters"),
    ("frozen_float_bytes", "frozen parameters stored as floats"),
    ("quantized_base_bytes", "frozen base stored quantized (codes + scales)"),
    ("params_bytes", "all parameters"),
    ("optimizer_bytes", "optimizer state"),
    ("gradient_bytes", "gradients of the trainable parameters"),
    ("train_state_bytes", "params + optimizer + gradients"),
    ("base_bytes_per_parameter", "bytes per quantized base parameter"),
]


def _nbytes(shape: tuple[int, ...], dtype: Any) -> int:
    return math.prod(shape) * np.dtype(dtype).itemsize


def train_state_memory(experiment: Any) -> dict[str, Any]:
    """The figures of the module docstring (`ROWS` keys) for `experiment`; nothing is allocated."""
    step = TrainStep(experiment)
    specs = restrict_trainable(step.model.parameter_specs(), experiment.config.trainer.learner.trainable)
    flat = jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, ParameterSpec))[0]
    out = dict.fromkeys(k for k, _ in ROWS if k != "base_bytes_per_parameter")
    out.update({k: 0 for k in out})
    quantized_elements = 0
    for path, spec in flat:
        name = jax.tree_util.keystr(path, simple=True, separator="/")
        size = _nbytes(spec.shape, spec.dtype)
        quantized = quantized_init(spec)
        if quantized is not None:  # A scanned stack's leading axes times the declared weight.
            elements = math.prod(spec.shape[: quantized[1]]) * math.prod(quantized[0].w_shape)
            quantized_elements += elements
            out["quantized_base_bytes"] += size
        else:
            elements = math.prod(spec.shape)
            key = ("adapter_bytes" if ADAPTER.search("/" + name) else "trainable_other_bytes") if spec.trainable \
                else "frozen_float_bytes"
            out[key] += size
        out["parameters"] += elements
        if spec.trainable:
            out["trainable_parameters"] += elements
            out["gradient_bytes"] += size
    out["params_bytes"] = sum(out[k] for k in ("adapter_bytes", "trainable_other_bytes", "frozen_float_bytes",
                                               "quantized_base_bytes"))
    out["optimizer_bytes"] = sum(_nbytes(x.shape, x.dtype) for x in jax.tree.leaves(step.abstract_state()["opt_state"]))
    out["train_state_bytes"] = out["params_bytes"] + out["optimizer_bytes"] + out["gradient_bytes"]
    out["base_bytes_per_parameter"] = (
        round(out["quantized_base_bytes"] / quantized_elements, 4) if quantized_elements else None
    )
    return out


def format_memory(report: dict[str, Any]) -> str:
    """One `key: value  (explanation)` line per figure, bytes also in MiB."""
    lines = []
    for key, doc in ROWS:
        value = report[key]
        if value is None:
            continue
        mib = f"{value / 2**20:.1f} MiB; " if key.endswith("_bytes") else ""
        lines.append(f"{key}: {value}  ({mib}{doc})")
    return "\n".join(lines) + "\n"
