"""`axcore convert hf-to-axcore HF_DIR OUT` and `axcore convert axcore-to-hf RUN OUT`.

hf-to-axcore reads a Hugging Face model directory (config.json + safetensors),
finds the converter registered for its `model_type` (hook
`axcore_register_model_converters`) and writes OUT, a run directory:

    OUT/experiment.yaml         the experiment that builds the architecture (edit and train it)
    OUT/config.yaml, config.txt the resolved experiment, as `axcore train` saves it (run_dir: OUT)
    OUT/checkpoints/0/          a committed parameters-only checkpoint, step 0: the imported
                                parameters (float32) and no optimizer state (`save_model`);
                                training initializes the optimizer when it first resumes
    OUT/hf/                     the source config.json, tokenizer files and chat template
                                (chat_template.jinja), kept for export (`axcore_hf.kept`)

so `axcore train OUT/config.yaml` fine-tunes from it and `axcore generate OUT` /
`axcore eval OUT` load it. Tensors holding NaN or infinite values are refused, naming
the tensor (`--allow-nonfinite` imports them). axcore-to-hf restores a run's latest (or
`--step`) parameters and writes config.json + model.safetensors (or shards of at most
`--max-shard-size` plus model.safetensors.index.json) in `--dtype` (default: the
dtype recorded at import, else float32), over the import's config.json and with its
tokenizer files, also for a run made from the import (init_from, lora init/merge). A
LoRA run is refused (merge it first). Both write into a temporary directory beside
OUT and rename it, so OUT is never left half-written.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import sys
import tempfile
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import yaml

from axcore.checkpoint.interop import ConversionError, ModelConverter
from axcore.errors import AxcoreError, did_you_mean
from axcore.experiment import load_experiment, search_plugins
from axcore.inference.run_loading import load_model, locate_run, save_model
from axcore.placement.layout import config_path
from axcore.plugin.loading import PluginRequest, installed_entry_points

from axcore_hf import files
from axcore_hf.kept import KEPT_DIR, KEPT_FILES, kept_dir
from axcore_hf.llama import first_layer
from axcore_hf.patterns import pattern_of, scanned_decoder

# The plugin providing the `hf` tokenizer (plugins/tokenizers), used when HF_DIR has a tokenizer.json.
TOKENIZER_PLUGIN = "hf_tokenizer"
# The plugin whose runs hold adapters beside the base weights (plugins/lora): merged before an export.
ADAPTER_PLUGIN = "lora"
# Config paths that do not change what a model computes from its parameters (ignored when checking an export).
NUMERICALLY_IRRELEVANT = {"param_dtype", "compute_dtype", "param_init", "kernels", "op_extras", "remat_policy",
                          "unroll", "kernel", "dropout_rate", "z_loss_scale",
                          "load_balance_loss_weight", "router_z_loss_weight"}  # The last two: training-only MoE losses.
# Rotary fields that matter only under some `scaling` (ignored when checking an export under another).
SCALING_FIELDS = {"scaling_factor", "original_max_len", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow"}


def find_converter(model_type: Any, where: str) -> ModelConverter:
    """The converter registered for `model_type` by a built-in or installed plugin."""
    search = search_plugins("model_converters", name=str(model_type))
    entry = search.found.get(str(model_type))
    if entry is None:
        known = sorted(search.found)
        broken = f"; plugins that could not be searched: {', '.join(sorted(search.broken))}" if search.broken else ""
        raise ConversionError(
            f"{where}: model_type {model_type!r} has no converter{did_you_mean(str(model_type), known)}; registered: "
            f"{', '.join(known) or 'none'}{broken}. Install a plugin that registers it (hook "
            f"axcore_register_model_converters)."
        )
    return entry.value


def _experiment_name(hf_dir: pathlib.Path) -> str:
    name = "".join(c if c.isalnum() or c in "._-" else "-" for c in hf_dir.resolve().name).strip("._-")
    return f"hf-{name}"[:100]


# -- Import ---------------------------------------------------------------------------


def hf_to_axcore(
    hf_dir: str | os.PathLike,
    out: str | os.PathLike,
    *,
    scan: bool = False,
    seq_len: int | None = None,
    allow_nonfinite: bool = False,
) -> pathlib.Path:
    """Imports the Hugging Face model in `hf_dir` into a new run directory `out` (module docstring).

    Args:
        hf_dir: directory with config.json and model.safetensors (or shards + index).
        out: the run directory to create; must not exist.
        scan: build the decoder as a `repeated_transformer` (lax.scan over stacked layers).
        seq_len: `input.seq_len` of the experiment; default min(256, max_position_embeddings).
        allow_nonfinite: import tensors holding NaN or infinite values (refused by default).

    Raises:
        ConversionError: missing files, unknown model_type, unsupported fields, shape mismatches,
            NaN or infinite values (unless `allow_nonfinite`); nothing is written then.
    """
    hf_dir, out = pathlib.Path(hf_dir), pathlib.Path(out).absolute()
    config = files.read_config(hf_dir)
    where = str(hf_dir / files.CONFIG_FILE)
    if "model_type" not in config:
        raise ConversionError(f"{where}: 'model_type' is missing; it names the model family (e.g. llama).")
    converter = find_converter(config["model_type"], where)
    data = {"name": _experiment_name(hf_dir), **converter.experiment(config, where)}
    if scan:
        data["model"]["decoder"] = scanned_decoder(data["model"]["decoder"], data["model"]["num_layers"], where)
    max_len = config.get("max_position_embeddings")
    data["input"] = {"seq_len": seq_len or min(256, max_len if isinstance(max_len, int) and max_len > 0 else 256)}
    data["trainer"] = {"run_dir": str(out)}
    tokenizer = _tokenizer_section(hf_dir, out / KEPT_DIR)
    if tokenizer is not None:  # The checkpoint's own tokenizer, kept in OUT/hf/ (plugin hf_tokenizer).
        data["plugins"].append(TOKENIZER_PLUGIN)
        data["tokenizer"] = tokenizer
    tensors = files.read_tensors(hf_dir)  # Before anything is written: a bad file leaves nothing behind.
    if not allow_nonfinite:
        _check_finite(tensors, hf_dir)
    tmp = files.fresh_dir(out)
    try:
        (tmp / KEPT_DIR).mkdir()
        files.write_config(tmp / KEPT_DIR, {**config, "axcore_source_dtype": _stored_dtype(config, tensors)})
        for name in KEPT_FILES:  # The tokenizer and its chat template (chat_template.jinja, where transformers puts it).
            if (hf_dir / name).is_file():
                shutil.copyfile(hf_dir / name, tmp / KEPT_DIR / name)
        source = tmp / "experiment.yaml"
        header = (f"# Imported from {hf_dir.resolve()} (model_type {config['model_type']}) by "
                  f"`axcore convert hf-to-axcore`.\n# Fine-tune: axcore train {out / 'config.yaml'}\n")
        source.write_text(header + yaml.safe_dump(data, sort_keys=False), "utf-8")
        # The tokenizer is read from the temporary copy until OUT exists; the saved configs name OUT's.
        here = [f"tokenizer.path={tmp / 'hf' / 'tokenizer.json'}"] if tokenizer else []
        experiment = load_experiment(source, here)
        model = experiment.config.model.instantiate(name="model", registries=experiment.registries)
        params = converter.params_from_outside(tensors, config, model.parameter_specs(), where)
        save_model(experiment, params, tmp)
        if tokenizer is not None:
            experiment.config.tokenizer.path = tokenizer["path"]
            experiment.save(tmp)
        files.publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    count = sum(int(np.prod(t.shape)) for t in tensors.values())
    print(f"Imported {config['model_type']} from {hf_dir} ({count:,} parameters) into {out}: experiment.yaml, "
          f"config.yaml, checkpoints/ (step 0).")
    return out


def _tokenizer_section(hf_dir: pathlib.Path, kept: pathlib.Path) -> dict[str, Any] | None:
    """`tokenizer: {type: hf, path: OUT/hf/tokenizer.json, add_bos}` when HF_DIR has a tokenizer.json and the
    hf_tokenizer plugin is installed; None otherwise (the experiment keeps the default tokenizer)."""
    if not (hf_dir / "tokenizer.json").is_file() or TOKENIZER_PLUGIN not in installed_entry_points():
        return None
    add_bos = False
    try:
        settings = json.loads((hf_dir / "tokenizer_config.json").read_text("utf-8"))
        add_bos = bool(settings["add_bos_token"])
    except (OSError, ValueError, KeyError, TypeError):  # No setting: does the file's template start with BOS?
        try:
            post = json.loads((hf_dir / "tokenizer.json").read_text("utf-8")).get("post_processor") or {}
            single = post.get("single") or [{}] if post.get("type") == "TemplateProcessing" else [{}]
            add_bos = "SpecialToken" in single[0]
        except (OSError, ValueError, AttributeError, TypeError, IndexError):
            add_bos = False
    return {"type": "hf", "path": str(kept / "tokenizer.json"), "add_bos": add_bos}


def _check_finite(tensors: Mapping[str, np.ndarray], hf_dir: pathlib.Path) -> None:
    """Raises ConversionError naming the first tensor (by name) that holds a NaN or an infinite value."""
    for name in sorted(tensors):
        tensor = tensors[name]
        if tensor.dtype.kind in "iub":
            continue  # Integer and boolean tensors (quantization codes, indices) are always finite.
        finite = np.isfinite(tensor)
        if not finite.all():
            nans = int(np.isnan(tensor).sum())
            raise ConversionError(
                f"{hf_dir}: tensor '{name}' holds {nans} NaN and {finite.size - int(finite.sum()) - nans} infinite "
                f"values (of {finite.size}); the checkpoint is damaged: re-download or re-save it, or pass "
                f"--allow-nonfinite to import it as it is."
            )


def _stored_dtype(config: Mapping[str, Any], tensors: Mapping[str, np.ndarray]) -> str:
    """The checkpoint's dtype: config.json's `dtype`/`torch_dtype`, else that of its tensors."""
    named = config.get("dtype") or config.get("torch_dtype")
    if isinstance(named, str) and named.removeprefix("torch.") in files.DTYPES:
        return named.removeprefix("torch.")
    kinds = {str(t.dtype) for t in tensors.values()}
    return kinds.pop() if len(kinds) == 1 and next(iter(kinds), "") in files.DTYPES else "float32"


# -- Export ---------------------------------------------------------------------------


def axcore_to_hf(
    run: str | os.PathLike,
    out: str | os.PathLike,
    *,
    step: int | None = None,
    dtype: str | None = None,
    max_shard_size: str | None = None,
    model_type: str | None = None,
) -> pathlib.Path:
    """Exports the parameters of a run's checkpoint as a Hugging Face model directory `out` (module docstring).

    The config.json starts from the import's (`axcore_hf.kept.kept_dir`: the run's own `hf/`, or that of
    the run it was made from), whose tokenizer files and chat template are copied too.

    Raises:
        ConversionError: the model cannot be expressed in the target family's config.json, or the run
            trains adapters (a LoRA run: `axcore lora merge` it first); nothing is written then.
        AxcoreError: the run or checkpoint cannot be loaded (RunLoadError, CheckpointError).
    """
    out = pathlib.Path(out).absolute()
    if out.exists():
        raise ConversionError(f"{out} already exists; choose a new output directory or remove it.")
    _refuse_adapters(run)  # Before the (slow) restore.
    loaded = load_model(run, step=step)
    where = f"run {loaded.source}"
    kept = kept_dir(loaded.source)
    base = files.read_config(kept) if kept is not None else {}
    recorded = base.pop("axcore_source_dtype", None)
    if model_type is None:
        model_type = base.get("model_type") or ("mistral" if _uses_sliding_window(loaded.experiment) else "llama")
    converter = find_converter(model_type, where)
    config = converter.outside_config(loaded.experiment, base, where)
    _check_expressible(converter, config, loaded.experiment, where)
    dtype = dtype or recorded or "float32"
    np_dtype = files.dtype_of(dtype, "--dtype")
    config["dtype" if "dtype" in base else "torch_dtype"] = dtype
    params = jax.tree.map(np.asarray, jax.device_get(loaded.params))
    tensors = {name: t.astype(np_dtype) for name, t in converter.params_to_outside(params, config).items()}
    limit = files.parse_size(max_shard_size) if max_shard_size else None
    tmp = files.fresh_dir(out)
    try:
        files.write_config(tmp, config)
        written = files.write_tensors(tmp, tensors, limit)
        for name in KEPT_FILES if kept is not None else ():
            if (kept / name).is_file():
                shutil.copyfile(kept / name, tmp / name)
        files.publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"Exported step {loaded.step} of {loaded.source} as {model_type} ({dtype}) into {out}: "
          f"config.json, {', '.join(written)}.")
    return out


def _refuse_adapters(run: str | os.PathLike) -> None:
    """Raises ConversionError if the run lists the lora plugin: a config.json model has no place for its adapters,
    so the export would be the bare base model."""
    run_dir = locate_run(run).run_dir
    try:
        plugins = (yaml.safe_load(config_path(run_dir).read_text("utf-8")) or {}).get("plugins") or []
    except (OSError, yaml.YAMLError, AttributeError):
        return  # Loading the run names the problem.
    names = {PluginRequest.parse(p).name for p in plugins if isinstance(p, str)}
    if ADAPTER_PLUGIN in names:
        raise ConversionError(
            f"Run {run_dir} trains LoRA adapters (plugin {ADAPTER_PLUGIN}), which a Hugging Face config.json has no "
            f"place for: exporting it would write the bare base model. Fold them into the weights with `axcore lora "
            f"merge {run} MERGED` and export MERGED, or write the adapters alone with `axcore lora export-peft`."
        )


def _uses_sliding_window(experiment: Any) -> bool:
    """Whether the run's (first) attention layer has a sliding window (then it exports as Mistral)."""
    layer = first_layer(experiment.to_dict()["model"]["decoder"], "the run's config")
    return layer["self_attention"].get("sliding_window") is not None


def _relevant(data: Any) -> Any:
    """Config data without the fields that do not change the model's math (NUMERICALLY_IRRELEVANT)."""
    if isinstance(data, list):
        return [_relevant(v) for v in data]
    if not isinstance(data, Mapping):
        return data
    skip = set(NUMERICALLY_IRRELEVANT)
    if data.get("type") == "rotary" and data.get("scaling") != "yarn":
        skip |= {"beta_fast", "beta_slow"} | (SCALING_FIELDS if data.get("scaling") == "none" else set())
    return {k: _relevant(v) for k, v in data.items() if k not in skip}


def _differences(a: Any, b: Any, path: str) -> list[str]:
    """`path.field is X (the exported config.json gives Y)` for each leaf where `a` and `b` differ."""
    if isinstance(a, list) != isinstance(b, list):  # A per-layer list against one layer config.
        items, single = (a, b) if isinstance(a, list) else (b, a)
        return [d for i, item in enumerate(items) for d in _differences(item, single, f"{path}[{i}]")]
    if isinstance(a, list):
        return _differences(dict(enumerate(a)), dict(enumerate(b)), path)
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        keys = sorted(set(a) | set(b), key=lambda k: (k != "type", str(k)))  # A different component first.
        return [d for k in keys for d in _differences(a.get(k), b.get(k), f"{path}.{k}")]
    return [] if a == b else [f"{path} is {a!r} (the exported config.json gives {b!r})"]


def _layers_only(model: Mapping[str, Any]) -> dict[str, Any]:
    """Model config data with the decoder reduced to its layer config(s) (stacked, scanned or a scanned block)
    and its per-layer attention pattern (`layer_types`, `attention_types`), if any."""
    stack = model["decoder"]
    if isinstance(stack["layer"], Mapping) and stack["layer"].get("type") == "stacked_transformer":
        stack = stack["layer"]
    types, attention_types = pattern_of(model["decoder"], model["num_layers"])  # A scanned block's over the depth.
    pattern = {"layer_types": types, "attention_types": attention_types or None}
    return {**model, "decoder": {"layer": stack["layer"], **pattern}}


def _check_expressible(converter: ModelConverter, config: dict, experiment: Any, where: str) -> None:
    """Raises ConversionError if the exported config.json would build a different model than the run's."""
    mine = experiment.to_dict()
    rebuilt = {"name": "export-check", "tokenizer": mine["tokenizer"]}
    rebuilt.update(converter.experiment(config, "exported config.json"))
    if TOKENIZER_PLUGIN in mine["plugins"]:  # It provides the run's tokenizer and touches nothing else.
        rebuilt["plugins"] = [*rebuilt["plugins"], TOKENIZER_PLUGIN]
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "experiment.yaml"
        path.write_text(yaml.safe_dump(rebuilt, sort_keys=False), "utf-8")
        other = load_experiment(path).to_dict()["model"]
    found = _differences(_relevant(_layers_only(mine["model"])), _relevant(_layers_only(other)), "model")
    if found:
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise ConversionError(
            f"{where}: the model cannot be written as a {config.get('model_type')} config.json: {found[0]}{more}; "
            f"only Llama-family architectures export."
        )


# -- The command ----------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of `axcore convert`: two sub-commands."""
    sub = parser.add_subparsers(dest="direction", required=True, metavar="DIRECTION")
    imp = sub.add_parser("hf-to-axcore", help="import a Hugging Face model directory as an axcore run directory")
    imp.add_argument("hf_dir", metavar="HF_DIR", help="directory with config.json and *.safetensors")
    imp.add_argument("out", metavar="OUT", help="run directory to create (must not exist)")
    imp.add_argument("--scan", action="store_true", help="scan the decoder layers (repeated_transformer)")
    imp.add_argument("--seq-len", type=int, default=None, help="input.seq_len (default min(256, max_position_embeddings))")
    imp.add_argument("--allow-nonfinite", action="store_true",
                     help="import tensors holding NaN or infinite values (default: refused, naming the tensor)")
    exp = sub.add_parser("axcore-to-hf", help="export a run's checkpoint as a Hugging Face model directory")
    exp.add_argument("run", metavar="RUN_OR_CKPT", help="run directory, its checkpoints/ or one step's directory")
    exp.add_argument("out", metavar="OUT", help="directory to create (must not exist)")
    exp.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    exp.add_argument("--dtype", choices=sorted(files.DTYPES), default=None,
                     help="tensor dtype (default: the dtype recorded at import, else float32)")
    exp.add_argument("--max-shard-size", default=None, help="shard above this size, e.g. 5GB (default: one file)")
    exp.add_argument("--model-type", default=None, help="HF model_type (default: recorded at import, else llama/mistral)")


def run(args: argparse.Namespace) -> int:
    """Runs `axcore convert`; bad input raises an AxcoreError (one line, exit 2)."""
    try:
        if args.direction == "hf-to-axcore":
            hf_to_axcore(args.hf_dir, args.out, scan=args.scan, seq_len=args.seq_len,
                         allow_nonfinite=args.allow_nonfinite)
        else:
            axcore_to_hf(args.run, args.out, step=args.step, dtype=args.dtype, max_shard_size=args.max_shard_size,
                         model_type=args.model_type)
    except AxcoreError:
        raise
    except OSError as e:  # Disk full, permissions: one line naming the file.
        raise ConversionError(f"{e.filename or args.out}: {e.strerror or e}.") from None
    sys.stdout.flush()
    return 0


__all__ = ["axcore_to_hf", "find_converter", "hf_to_axcore"]
