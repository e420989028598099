"""LoRA runs <-> PEFT adapter directories, and the merged model.

A PEFT adapter directory holds `adapter_config.json` (`peft_type: LORA`, `r`,
`lora_alpha`, `lora_dropout`, `target_modules`) and `adapter_model.safetensors` with,
per adapted module of the Hugging Face model (names from the `hf` plugin's Llama
mapping, `axcore_hf.llama`),

    base_model.model.<module>.lora_A.weight  [rank, in]   = axcore lora_a^T
    base_model.model.<module>.lora_B.weight  [out, rank]  = axcore lora_b reshaped to [rank, out], transposed

where `in` / `out` flatten the weight's contracted / other dims in axcore's order, which
is the Hugging Face order (`axcore_hf.llama` maps every weight by a transpose and a
reshape). PEFT adds `B @ A * lora_alpha / r` to each `[out, in]` weight, the same
product as `axcore_lora.kernel`.

- `export_peft(run, out)`: the adapters of a LoRA run's checkpoint -> `out/`.
- `import_peft(base_run, adapter_dir, out)`: a base run (e.g. `axcore convert
  hf-to-axcore`'s) plus a PEFT adapter -> a LoRA run directory `out` (parameters only, step
  0; `axcore train out/config.yaml` fine-tunes it further). Refused in one line
  (`PeftAdapterError`) when the adapter is not LoRA, or a tensor names a module the base
  has no projection for, or has another shape than the base's projection (an adapter
  trained for another base).
- `init(base_run, out, settings)`: a base run plus fresh adapters (B = 0: the base's logits)
  -> a LoRA run directory `out` to fine-tune with `axcore train out/config.yaml`.
- `merge(run, out)`: the base model with every adapter folded in,
  `w + (lora_a @ lora_b) * alpha / rank` in w's layout, as a plain run directory (no
  lora plugin), which `axcore convert axcore-to-hf` exports to Hugging Face.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import tempfile
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
import yaml

from axcore import AxcoreError
from axcore.experiment import load_experiment
from axcore.inference.run_loading import load_model, locate_run, save_model

from axcore_hf.kept import copy_kept
from axcore_lora.checkpoint import plain_config, publish_run
from axcore_lora.kernel import A, B
from axcore_lora.quant import dequantize_as, quantize_as, quantized_init

# A layer's weight name -> the dot site it feeds (attention's own sites; a Linear's `dot`).
SITE_OF_WEIGHT = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj", "weight": "dot"}
KERNEL_STATE = "kernel_state"
# The weight dims each Hugging Face layout kind (axcore_hf.llama) contracts.
CONTRACT = {"in_proj": (0,), "out_proj": (0, 1), "linear": (0,)}
CONFIG_NAME, WEIGHTS_NAME = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."


class PeftAdapterError(AxcoreError):
    """A PEFT adapter directory that does not fit (names the file or tensor and what to do)."""


def _get(tree: Any, path: tuple) -> Any:
    for key in path:
        if not isinstance(tree, dict) or key not in tree:
            return None
        tree = tree[key]
    return tree


def _modules(params: dict, num_layers: int) -> Iterator[tuple[str, tuple, int | None, tuple[str, ...], str]]:
    """`(hf_module, path of the lora pair's parent, layer index on a leading axis or None, weight path, layout
    kind)`
    for every Hugging Face projection (Llama mapping) of a parameter tree."""
    from axcore_hf.llama import GLOBAL_TENSORS, LAYER_TENSORS, layer_slots

    for i, (slot, index) in enumerate(layer_slots(params["decoder"], num_layers)):
        for hf_name, (path, kind) in LAYER_TENSORS.items():
            if kind != "copy":
                weight = (*slot, *path)
                state = (*slot, *path[:-1], KERNEL_STATE, SITE_OF_WEIGHT[path[-1]])
                yield f"model.layers.{i}.{hf_name.removesuffix('.weight')}", state, index, weight, kind
    for hf_name, (path, kind) in GLOBAL_TENSORS.items():
        if kind != "copy":
            state = (*path[:-1], KERNEL_STATE, SITE_OF_WEIGHT[path[-1]])
            yield hf_name.removesuffix(".weight"), state, None, path, kind


def _pick(array: Any, index: int | None) -> np.ndarray:
    array = np.asarray(jax.device_get(array), np.float32)
    return array if index is None else array[index]


def _num_layers(experiment) -> int:
    return int(experiment.config.model.num_layers)


def export_peft(run: str | os.PathLike, out: str | os.PathLike, *, step: int | None = None) -> pathlib.Path:
    """Writes the adapters of LoRA run `run` (its latest checkpoint, or `step`) as a PEFT adapter directory."""
    from safetensors.numpy import save_file

    loaded = load_model(run, step=step)
    settings = loaded.experiment.settings.get("lora")
    if settings is None:
        raise PeftAdapterError(f"Run {loaded.source} does not use the lora plugin; it has no adapters to export.")
    tensors, modules = {}, []
    for module, state, index, _, _ in _modules(loaded.params, _num_layers(loaded.experiment)):
        pair = _get(loaded.params, state)
        if pair is None or A not in pair:
            continue
        a, b = _pick(pair[A], index), _pick(pair[B], index)
        tensors[f"{PREFIX}{module}.lora_A.weight"] = np.ascontiguousarray(a.T)
        tensors[f"{PREFIX}{module}.lora_B.weight"] = np.ascontiguousarray(b.reshape(b.shape[0], -1).T)
        modules.append(module)
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": settings.rank, "lora_alpha": settings.alpha,
        "lora_dropout": settings.dropout, "target_modules": sorted(modules), "bias": "none",
        "fan_in_fan_out": False, "inference_mode": True, "use_rslora": False, "init_lora_weights": True,
        "modules_to_save": None, "base_model_name_or_path": None,
    }
    (out / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n", "utf-8")
    return out


def _raw_config(run: str | os.PathLike) -> dict:
    """The run's experiment as YAML data to resolve again: `experiment.yaml` if the run has one (an
    import's), else its saved `config.yaml` without the resolved marker."""
    run_dir = locate_run(run).run_dir
    source = run_dir / "experiment.yaml"
    raw = yaml.safe_load((source if source.is_file() else run_dir / "config.yaml").read_text("utf-8"))
    raw.pop("resolved_by", None)
    raw.pop("init_from", None)  # A saved config is already merged onto its base run: never merged again.
    return raw


def _load_raw(raw: dict, run_dir: str | os.PathLike):
    """The experiment of `raw` whose `trainer.run_dir` is `run_dir` (the new run's, so `axcore train` writes there)."""
    raw = dict(raw, trainer={**(raw.get("trainer") or {}), "run_dir": str(pathlib.Path(run_dir).resolve())})
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "experiment.yaml"
        path.write_text(yaml.safe_dump(raw, sort_keys=False), "utf-8")
        return load_experiment(path)


def _target_regex(modules: list[str]) -> str:
    """The lora target selecting PEFT `target_modules` by short name (`q_proj` -> `q`, `lm_head`)."""
    return "|".join(sorted({m.split(".")[-1].removesuffix("_proj") for m in modules}))


def import_peft(base_run: str | os.PathLike, adapter_dir: str | os.PathLike, out: str | os.PathLike) -> pathlib.Path:
    """A LoRA run directory `out` of base run `base_run`'s latest parameters plus the PEFT adapter in `adapter_dir`."""
    from safetensors.numpy import load_file

    adapter_dir = pathlib.Path(adapter_dir)
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        if not (adapter_dir / name).is_file():
            raise PeftAdapterError(f"'{adapter_dir / name}' is missing; pass a PEFT adapter directory (save_pretrained).")
    config = json.loads((adapter_dir / CONFIG_NAME).read_text("utf-8"))
    if config.get("peft_type") != "LORA" or config.get("use_rslora") or config.get("fan_in_fan_out"):
        raise PeftAdapterError(f"'{adapter_dir / CONFIG_NAME}': only plain LoRA adapters import (peft_type LORA, "
                               f"no rslora, no fan_in_fan_out); got peft_type {config.get('peft_type')!r}.")
    tensors = load_file(str(adapter_dir / WEIGHTS_NAME))
    modules = sorted({k.removeprefix(PREFIX).rsplit(".lora_", 1)[0] for k in tensors})
    rank = int(config["r"])
    settings = {"rank": rank, "alpha": float(config["lora_alpha"]), "dropout": float(config.get("lora_dropout") or 0.0),
                "target": _target_regex(modules)}
    experiment, params, base = _with_fresh_adapters(base_run, settings, out)
    found = {}
    for module, state, index, _, _ in _modules(params, _num_layers(experiment)):
        found[module] = (state, index)
    for key, value in tensors.items():
        module, which = key.removeprefix(PREFIX).rsplit(".lora_", 1)
        pair = _get(params, found[module][0]) if module in found else None
        if pair is None or A not in pair:
            raise PeftAdapterError(f"'{adapter_dir / WEIGHTS_NAME}': tensor {key} names no projection of base run "
                                   f"{base.source}; the adapter was trained for another base model.")
        state, index = found[module]
        name, target = (A, "a") if which.startswith("A") else (B, "b")
        current = pair[name] if index is None else pair[name][index]
        value = np.asarray(value, np.float32)
        # PEFT's layout: lora_A [rank, in] = a^T; lora_B [out, rank] = b as [rank, out], transposed.
        needed = (current.shape[1], current.shape[0]) if target == "a" else (math.prod(current.shape[1:]), current.shape[0])
        if value.shape != needed:
            raise PeftAdapterError(
                f"'{adapter_dir / WEIGHTS_NAME}': tensor {key} has shape {list(value.shape)}, but base run "
                f"{base.source} with lora rank {rank} needs {list(needed)}; the adapter was trained for another "
                f"base model."
            )
        new = value.T if target == "a" else value.T.reshape(current.shape)
        if index is None:
            pair[name] = new.astype(current.dtype)
        else:
            pair[name] = np.array(pair[name]).copy()
            pair[name][index] = new
    save_model(experiment, params, out)
    copy_kept(base_run, out)  # The import's Hugging Face metadata (hf/).
    return pathlib.Path(out)


def _with_fresh_adapters(base_run: str | os.PathLike, settings: dict, out: str | os.PathLike):
    """`(experiment, params, base)`: base run `base_run` with the lora plugin of `settings` (run directory `out`), its
    parameters the base's latest ones plus freshly initialised adapters (A Kaiming-uniform, B = 0)."""
    raw = _raw_config(base_run)
    raw["plugins"] = [*[p for p in raw.get("plugins", []) if p != "lora"], "lora"]
    raw["lora"] = settings
    base = load_model(base_run)
    experiment = _load_raw(raw, out)
    model = experiment.config.model.instantiate(name="model", registries=experiment.registries)
    params = jax.device_get(model.initialize(jax.random.key(experiment.config.trainer.seed)))
    return experiment, _overlay(params, jax.device_get(base.params), model.parameter_specs()), base


def init(base_run: str | os.PathLike, out: str | os.PathLike, settings: dict) -> pathlib.Path:
    """A LoRA run directory `out`: base run `base_run`'s latest parameters plus fresh adapters of `settings`
    (the `lora:` section: rank, alpha, dropout, target; missing keys keep their defaults)."""
    settings = dict(settings)
    quantized = settings.get("base_format", "float") != "float"
    if settings.get("checkpoint") == "adapters":  # The frozen base is read from the base run, or OUT/base (QLoRA).
        settings["base_run"] = str(pathlib.Path(out if quantized else base_run).resolve() / ("base" if quantized else ""))
    experiment, params, _ = _with_fresh_adapters(base_run, settings, out)
    if settings.get("checkpoint") == "adapters" and quantized:
        _save_base(experiment, params, pathlib.Path(settings["base_run"]))
    save_model(experiment, params, out)
    copy_kept(base_run, out)  # The import's Hugging Face metadata (hf/), for the exports of what this run becomes.
    return pathlib.Path(out)


def _save_base(experiment: Any, params: Any, base_dir: pathlib.Path) -> None:
    """Writes the frozen parameters of `params` (the adapters left out) as step 0 of `base_dir/checkpoints`."""
    from axcore.checkpoint.plugin import BACKENDS
    from axcore.trainer.resume import params_only_metadata

    from axcore_lora.checkpoint import split_params

    _, frozen = split_params(params)
    settings = experiment.config.trainer.checkpoint.backend_settings
    backend = BACKENDS[settings["inner"]](base_dir / "checkpoints", async_save=False, **settings["inner_settings"])
    try:
        backend.save(0, {"params": jax.tree.map(jax.numpy.asarray, frozen)},
                     params_only_metadata(0, experiment.config.trainer.seed))
        backend.wait()
    finally:
        backend.close()


def _overlay(params: Any, base: Any, specs: Any) -> Any:
    """`params` with every leaf that `base` has at the same path replaced by base's; a float base weight
    where `specs` declares a quantized one (QLoRA, `lora.base_format`) is quantized first."""
    if isinstance(params, dict):
        return {k: _overlay(v, base[k], specs[k]) if isinstance(base, dict) and k in base else v
                for k, v in params.items()}
    base = np.asarray(base)
    if quantized_init(specs) is not None and base.dtype != params.dtype:
        return quantize_as(specs, base)
    return base


def merged_weight(weight: np.ndarray, contract: tuple[int, ...], a: np.ndarray, b: np.ndarray, scale: float) -> np.ndarray:
    """`weight + (a @ b) * scale` in the weight's layout (`a` `[in, r]`, `b` `[r, *out_dims]`), float32."""
    weight = np.asarray(weight, np.float32)
    free = [i for i in range(weight.ndim) if i not in contract]
    delta = (a @ b.reshape(b.shape[0], -1)) * np.float32(scale)
    delta = delta.reshape(*[weight.shape[i] for i in contract], *[weight.shape[i] for i in free])
    order = [*contract, *free]
    return weight + np.transpose(delta, [order.index(i) for i in range(weight.ndim)])


def merge(run: str | os.PathLike, out: str | os.PathLike, *, step: int | None = None) -> pathlib.Path:
    """Writes LoRA run `run`'s model with the adapters folded into the weights, as a run without the lora plugin
    (`axcore_lora.checkpoint.plain_config`: whatever `init_from` the run was trained with), with the import's
    `hf/` metadata; `out` is written through a temporary directory, complete or absent."""
    if pathlib.Path(out).exists():
        raise PeftAdapterError(f"{pathlib.Path(out).absolute()} already exists; choose a new run directory or remove it.")
    loaded = load_model(run, step=step)
    settings = loaded.experiment.settings.get("lora")
    if settings is None:
        raise PeftAdapterError(f"Run {loaded.source} does not use the lora plugin; there is nothing to merge.")
    scale = settings.alpha / settings.rank
    params = _dequantized(jax.device_get(loaded.params), loaded.model.parameter_specs())
    for _, state, index, weight_path, kind in _modules(params, _num_layers(loaded.experiment)):
        pair = _get(params, state)
        if pair is None or A not in pair:
            continue
        parent = _get(params, weight_path[:-1])
        contract = CONTRACT[kind]
        weight = np.asarray(parent[weight_path[-1]], np.float32)
        if index is None:
            parent[weight_path[-1]] = merged_weight(weight, contract, _pick(pair[A], None), _pick(pair[B], None), scale)
        else:
            weight = weight.copy()
            weight[index] = merged_weight(weight[index], contract, _pick(pair[A], index), _pick(pair[B], index), scale)
            parent[weight_path[-1]] = weight
    params = _drop_adapters(params)
    experiment = _load_raw(plain_config(_raw_config(run)), out)
    # The import's Hugging Face metadata (hf/) goes along, so the merged run exports like the import.
    return publish_run(out, lambda tmp: (save_model(experiment, params, tmp), copy_kept(loaded.source, tmp)))


def _dequantized(params: Any, specs: Any) -> Any:
    """`params` with every quantized base weight (QLoRA) as float32 values in the declared layout."""
    if isinstance(params, dict):
        return {k: _dequantized(v, specs[k]) for k, v in params.items()}
    return dequantize_as(specs, params) if quantized_init(specs) is not None else params


def _drop_adapters(tree: Any) -> Any:
    """`tree` without lora pairs (and kernel_state entries left empty)."""
    if not isinstance(tree, dict):
        return tree
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict) and A in v:
            continue
        v = _drop_adapters(v)
        if isinstance(v, dict) and not v:
            continue
        out[k] = v
    return out
