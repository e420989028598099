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

- `export_peft(run, out)`: the adapters of a LoRA run's checkpoint -> `out/`. Of a QLoRA
  run (`lora.base_format` int8 / nf4) it warns, and writes `out/README.md` saying, that
  the adapters belong to the quantized base (`quantized_base_note`).
- `import_peft(base_run, adapter_dir, out)`: a base run (e.g. `axcore convert
  hf-to-axcore`'s) plus a PEFT adapter -> a LoRA run directory `out` (parameters only, step
  0; `axcore train out/config.yaml` fine-tunes it further). Refused in one line
  (`PeftAdapterError`), before anything is written, when the adapter's files do not pass
  `axcore_lora.peft_files` (schema, tensors' names, dtypes, pairs, ranks, finite values),
  or `target_modules` or a tensor names a module the base has no projection for, or a
  tensor has another shape than the base's projection (an adapter trained for another base).
- `init(base_run, out, settings)`: a base run plus fresh adapters (B = 0: the base's logits)
  -> a LoRA run directory `out` to fine-tune with `axcore train out/config.yaml`.
- `merge(run, out)`: the base model with every adapter folded in,
  `w + (lora_a @ lora_b) * alpha / rank` in w's layout, as a plain run directory (no
  lora plugin), which `axcore convert axcore-to-hf` exports to Hugging Face.
"""

from __future__ import annotations

import json
import logging
import math
import os
import pathlib
import tempfile
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
import yaml

from axcore.experiment import load_experiment
from axcore.inference.run_loading import load_model, locate_run, save_model
from axcore.placement.layout import checkpoints_path, config_path

from axcore_hf.kept import copy_kept
from axcore_lora.checkpoint import plain_config, publish_run
from axcore_lora.kernel import A, B
from axcore_lora.peft_files import CONFIG_NAME, PREFIX, WEIGHTS_NAME, Adapter, PeftAdapterError, read_adapter, selects
from axcore_lora.quant import dequantize_as, quantize_as, quantized_init

logger = logging.getLogger(__name__)
# A layer's weight name -> the dot site it feeds (attention's own sites; a Linear's `dot`).
SITE_OF_WEIGHT = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj", "weight": "dot"}
KERNEL_STATE = "kernel_state"
# How each lora.base_format stores a base weight (axcore_lora.quant), for the export's note.
QUANT_FORMS = {"int8": "int8 codes with a float32 absmax scale per output channel",
               "nf4": "NF4 blocks of 64 with a float32 absmax each, as bitsandbytes' nf4 without double quantization"}
# The weight dims each Hugging Face layout kind (axcore_hf.llama) contracts.
CONTRACT = {"in_proj": (0,), "out_proj": (0, 1), "linear": (0,)}


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
    if settings.base_format != "float":
        note = quantized_base_note(loaded.source, settings)
        (out / "README.md").write_text(f"# LoRA adapters exported by axcore\n\n{note}\n", "utf-8")
        logger.warning("axcore: warning: %s", note)
    return out


def quantized_base_note(run: Any, settings: Any) -> str:
    """What base a QLoRA run's (`lora.base_format` int8 / nf4) exported adapters belong to, and how to use them."""
    which = "every projection" if settings.quantize == "all" else f"the projections lora.target {settings.target!r} selects"
    return (
        f"run {run} was trained against a {settings.base_format}-quantized base ({which} stored "
        f"{settings.base_format}, lora.base_format), so these adapters belong to that quantized base, not to the float "
        f"model it was quantized from: loaded on the float base in PEFT its logits differ. Use them on the base "
        f"quantized the same way (axcore_lora.quant: {QUANT_FORMS[settings.base_format]}), or run axcore lora merge "
        f"{run} OUT to fold them into the dequantized base and export that."
    )


def _raw_config(run: str | os.PathLike) -> dict:
    """The run's experiment as YAML data to resolve again: `experiment.yaml` if the run has one (an
    import's), else its saved `config.yaml` without the resolved marker."""
    run_dir = locate_run(run).run_dir
    source = run_dir / "experiment.yaml"
    raw = yaml.safe_load((source if source.is_file() else config_path(run_dir)).read_text("utf-8"))
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
    """A LoRA run directory `out` of base run `base_run`'s latest parameters plus the PEFT adapter in `adapter_dir`.

    Everything is checked before `out` is written (`PeftAdapterError`, one line): the adapter's files
    (`axcore_lora.peft_files.read_adapter`), then against the base: every `target_modules` entry and every
    tensor names a projection of the base, the tensors are exactly the modules the config selects, and
    each has the base projection's shape."""
    adapter = read_adapter(adapter_dir)
    weights = pathlib.Path(adapter_dir) / WEIGHTS_NAME
    base = load_model(base_run)
    _check_modules(adapter, pathlib.Path(adapter_dir), base)
    rank = adapter.config["r"]
    settings = {"rank": rank, "alpha": float(adapter.config["lora_alpha"]),
                "dropout": float(adapter.config.get("lora_dropout") or 0.0), "target": _target_regex(list(adapter.pairs))}
    experiment, params, base = _with_fresh_adapters(base_run, settings, out, base=base)
    found = {module: (state, index) for module, state, index, _, _ in _modules(params, _num_layers(experiment))}
    for module, (a, b) in adapter.pairs.items():
        state, index = found[module]
        pair = _get(params, state)
        for name, value, key in ((A, a, "lora_A"), (B, b, "lora_B")):
            current = pair[name] if index is None else pair[name][index]
            # PEFT's layout: lora_A [rank, in] = a^T; lora_B [out, rank] = b as [rank, out], transposed.
            needed = (current.shape[1], current.shape[0]) if name == A else \
                (math.prod(current.shape[1:]), current.shape[0])
            if value.shape != needed:
                raise PeftAdapterError(
                    f"'{weights}': tensor {PREFIX}{module}.{key}.weight has shape {list(value.shape)}, but base run "
                    f"{base.source} with lora rank {rank} needs {list(needed)}; the adapter was trained for another "
                    f"base model."
                )
            new = value.T if name == A else value.T.reshape(current.shape)
            if index is None:
                pair[name] = new.astype(current.dtype)
            else:
                pair[name] = np.array(pair[name]).copy()
                pair[name][index] = new
    save_model(experiment, params, out)
    copy_kept(base_run, out)  # The import's Hugging Face metadata (hf/).
    return pathlib.Path(out)


def _check_modules(adapter: Adapter, adapter_dir: pathlib.Path, base: Any) -> None:
    """`PeftAdapterError` unless every target_modules entry and every tensor's module is a projection of `base`
    (a loaded run) and the tensors are exactly the modules the config selects (PEFT's rule)."""
    present = [m for m, _, _, weight, _ in _modules(base.params, _num_layers(base.experiment))
               if _get(base.params, weight) is not None]
    names = sorted({m.split(".")[-1] for m in present})
    targets = adapter.config["target_modules"]
    config_file, weights = adapter_dir / CONFIG_NAME, adapter_dir / WEIGHTS_NAME
    for entry in [targets] if isinstance(targets, str) else targets:
        if not any(selects({"target_modules": [entry] if isinstance(targets, list) else targets}, m) for m in present):
            raise PeftAdapterError(
                f"'{config_file}': target_modules entry {entry!r} names no projection of base run {base.source} "
                f"(its projections: {', '.join(names)}); the adapter was trained for another model."
            )
    for module in adapter.pairs:
        if module not in present:
            raise PeftAdapterError(f"'{weights}': tensor {PREFIX}{module}.lora_A.weight names no projection of base "
                                   f"run {base.source}; the adapter was trained for another base model.")
        if not selects(adapter.config, module):
            raise PeftAdapterError(f"'{weights}': tensor {PREFIX}{module}.lora_A.weight is a module that "
                                   f"target_modules ({json.dumps(targets)}) does not select; the config and the "
                                   f"weights do not belong together.")
    missing = [m for m in present if selects(adapter.config, m) and m not in adapter.pairs]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise PeftAdapterError(f"'{weights}' has no lora_A/lora_B tensors for {missing[0]}{more}, which target_modules "
                               f"({json.dumps(targets)}) selects; the file is incomplete.")


def _with_fresh_adapters(base_run: str | os.PathLike, settings: dict, out: str | os.PathLike, *, base: Any = None):
    """`(experiment, params, base)`: base run `base_run` (`base`: it loaded already) with the lora plugin of
    `settings` (run directory `out`), its parameters the base's latest ones plus freshly initialised adapters
    (A Kaiming-uniform, B = 0)."""
    raw = _raw_config(base_run)
    raw["plugins"] = [*[p for p in raw.get("plugins", []) if p != "lora"], "lora"]
    raw["lora"] = settings
    base = base or load_model(base_run)
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
    from axcore.placement.backend import params_only_metadata

    from axcore_lora.checkpoint import split_params

    _, frozen = split_params(params)
    settings = experiment.config.trainer.checkpoint.backend_settings
    backend = BACKENDS[settings["inner"]](checkpoints_path(base_dir), async_save=False, **settings["inner_settings"])
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
