"""The lora plugin: `plugins: [lora]` puts low-rank adapters on the targeted `dot` sites and freezes the rest.

The transform (1) sets `model.op_extras.dot.lora` to the settings, so the plugin's `lora`
kernel takes the targeted sites (its state: the adapters) and `lora_base` the others
(`axcore_lora.kernel`), and (2) sets `trainer.learner.trainable` to `/lora_[ab]$`, so
only the adapters train: the base weights get no gradient and no optimizer state. It
builds the model's parameter shapes once (nothing allocated) to refuse a target that
selects no site; a rank larger than a targeted projection is refused when the
experiment is validated. Both in one line naming the field. With `base_format: int8`
or `nf4` (QLoRA) the targeted sites' frozen base weights are stored quantized
(`axcore_lora.quant`) and dequantized inside the matmul.

The command `axcore lora` exports and imports PEFT adapter directories and writes the
merged model (`axcore_lora.peft`).
"""

from __future__ import annotations

import pathlib
import re

import axcore
from axcore.config import replace
from axcore.kernels import DOT, op_environment, record_kernel_decisions
from axcore.trainer import CheckpointConfig, LearnerConfig

from axcore_lora import commands
from axcore_lora.checkpoint import NAME, lora_adapters
from axcore_lora.kernel import (
    EXTRA,
    LoraBaseDot,
    LoraConfigError,
    LoraDot,
    LoraSettings,
    lora_sites,
    short_name,
    site_path,
)
from axcore_lora.quant import FORMATS

# `trainer.learner.trainable` under LoRA: the adapters only.
ADAPTERS = r"/lora_[ab]$"


@axcore.hookimpl
def axcore_settings_config():
    return LoraSettings()


@axcore.hookimpl
def axcore_register_kernels(register):
    register(DOT, LoraDot())
    register(DOT, LoraBaseDot())


@axcore.hookimpl
def axcore_register_checkpoint_backends(register):
    register(NAME, lora_adapters)


@axcore.hookimpl
def axcore_register_commands(register):
    register("lora", commands.run, add_arguments=commands.add_arguments,
             help="LoRA adapters: export/import PEFT adapter directories, write the merged model")


def dot_sites(config, registries) -> list[str]:
    """Every `dot` call site of the config's model (builds its parameter shapes; allocates nothing)."""
    instance = config.mesh.instance_type
    platform = instance.split("-")[0] if instance else "cpu"
    with op_environment(None, config.mesh.axis_rules, platform=platform), record_kernel_decisions() as decisions:
        config.model.instantiate(name="model", registries=registries).parameter_specs()
    return [d.site for d in decisions if d.op == DOT.name]


@axcore.hookimpl
def axcore_transform_config(config, settings, registries):
    try:
        re.compile(settings.target)
    except re.error as e:
        raise LoraConfigError(f"'lora.target' ({settings.target!r}) is not a regular expression: {e}.") from None
    if settings.base_format not in FORMATS:
        raise LoraConfigError(
            f"'lora.base_format' ({settings.base_format!r}) is not a base format; use one of {', '.join(FORMATS)}."
        )
    if settings.quantize not in ("targets", "all"):
        raise LoraConfigError(f"'lora.quantize' ({settings.quantize!r}) is not targets or all.")
    sites = dot_sites(config, registries)
    if not lora_sites(sites, settings.target):
        names = sorted({short_name(s) for s in sites})
        raise LoraConfigError(
            f"'lora.target' ({settings.target!r}) matches no projection of the model; its dot sites are "
            f"{', '.join(names)} (or a path such as {sites[0].removeprefix('model.') if sites else '?'})."
        )
    tied = [s for s in lora_sites(sites, settings.target) if short_name(s) == "attend"]
    if settings.base_format != "float" and tied:
        raise LoraConfigError(
            f"'lora.target' ({settings.target!r}) selects the tied output head {site_path(tied[0])}, whose weight is the "
            f"embedding table the input lookup reads too, so 'lora.base_format' {settings.base_format} cannot store it "
            f"quantized; leave it out of the target or untie the head (model.lm_head)."
        )
    lora = {"rank": settings.rank, "alpha": settings.alpha, "dropout": settings.dropout, "target": settings.target}
    if settings.base_format != "float":  # QLoRA: the targeted (or all) sites' frozen base stored quantized.
        lora.update(base_format=settings.base_format, quantize=settings.quantize)

    def add_extra(_path, model):
        extras = dict(model.op_extras or {})
        extras["dot"] = {**(extras.get("dot") or {}), EXTRA: lora}
        return model.set(op_extras=extras)

    config = replace(config, lambda path, _node: path == "model", add_extra)
    config = replace(config, LearnerConfig, lambda _, c: c.set(trainable=ADAPTERS))
    return adapter_checkpoints(config, settings)


def adapter_checkpoints(config, settings):
    """With `lora.checkpoint: adapters`, the run's checkpoint backend wrapped by `lora_adapters`
    (`axcore_lora.checkpoint`), `lora.base_run` made absolute; else `config` itself."""
    if settings.checkpoint not in ("full", "adapters"):
        raise LoraConfigError(f"'lora.checkpoint' ({settings.checkpoint!r}) is not full or adapters.")
    if settings.checkpoint == "full":
        return config
    if not settings.base_run:
        raise LoraConfigError(
            "'lora.checkpoint' is adapters but 'lora.base_run' is not set; set it to the run directory holding the "
            "frozen parameters (the base run of axcore lora init, or the OUT/base that lora init --adapters-only writes)."
        )

    def wrap(_path, ckpt):
        if ckpt.backend == NAME:  # Already wrapped (a saved config).
            return ckpt
        wrapped = {"inner": ckpt.backend, "inner_settings": dict(ckpt.backend_settings),
                   "base_run": str(pathlib.Path(settings.base_run).resolve())}
        return ckpt.set(backend=NAME, backend_settings=wrapped)

    return replace(config, CheckpointConfig, wrap)
