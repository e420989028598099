"""Several LoRA adapters resident in the inference engine, one per request (`LoraDot.stack_adapters`).

`stack_adapters(base, adapters)` turns a base run and LoRA runs of it (`{name: LoadedModel}`,
`axcore.inference.load_adapters` loads them) into ONE model and parameter tree the
engine serves every adapter and the base from. At each adapted site the kernel state
holds every adapter stacked on a slot axis (after any stacked-layer axes):

    lora_a      [S, in, R]          slot 0 zeros (the base), slot i + 1 the i-th adapter's A
    lora_b      [S, R, *out_dims]   B likewise
    lora_scale  [S]                 alpha / rank of each slot (0 for the base)

with S = N + 1 and R the largest rank among the adapters at that site: a smaller rank
is padded with zero columns of A and zero rows of B, which add exactly nothing, and an
adapter that does not target the site has zeros there. `LoraDot` then computes, per batch
row r of slot s_r (`axcore.kernels.adapter_rows`), `y = x . w + (x @ A[s_r]) @ B[s_r] * scale[s_r]`.

The model is the first adapter run's (its `lora.target` widened to every adapter's
target, so each adapted site runs `LoraDot`); the frozen weights are the adapter runs',
which must be the same in every run and, for a float base (`lora.base_format: float`),
equal to the base run's, else the adapters belong to another base (LoraConfigError). With
a QLoRA base (int8 / nf4) every adapter must store the same quantized base (same format,
`quantize` and target), and base requests run on that quantized base.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from axcore.config import replace

from axcore_lora.checkpoint import merge_params, split_params
from axcore_lora.kernel import EXTRA, SCALE, A, B, LoraConfigError


def stack_adapters(base: Any, adapters: dict[str, Any]) -> tuple[Any, Any]:
    """`(model, params)` serving `base` (a LoadedModel) and every LoRA run of `adapters` (module docstring)."""
    settings = {}
    for name, loaded in adapters.items():
        settings[name] = loaded.experiment.settings.get("lora")
        if settings[name] is None:
            raise LoraConfigError(f"--lora {name}={loaded.source}: the run does not use the lora plugin, so it has no "
                                  "adapters; pass a LoRA run (axcore lora init / import-peft / a trained one).")
    split = {name: split_params(loaded.params) for name, loaded in adapters.items()}
    first = next(iter(adapters))
    frozen = split[first][1]
    for name, (_, theirs) in split.items():
        _check_same(theirs, frozen, f"--lora {name}={adapters[name].source}: its frozen base differs from that of "
                    f"--lora {first}={adapters[first].source}; serve adapters of one base (and one lora.base_format) "
                    "together")
    if settings[first].base_format == "float":
        _check_same(frozen, base.params, f"--lora {first}={adapters[first].source}: its frozen weights differ from "
                    f"base run {base.source}'s; pass the base run the adapters were trained on")
    stacked = stack_pairs([split[name][0] for name in adapters], [settings[name] for name in adapters])
    return _model(adapters[first], {s.target for s in settings.values()}), merge_params(stacked, frozen)


def _check_same(tree: Any, reference: Any, problem: str) -> None:
    """LoraConfigError(`problem`) unless `tree` and `reference` have the same structure, shapes and values."""
    if jax.tree.structure(tree) != jax.tree.structure(reference):
        raise LoraConfigError(f"{problem} (other parameters).")
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(tree), jax.tree.leaves(reference)):
        if np.shape(a) != np.shape(b) or not np.array_equal(np.asarray(a), np.asarray(b)):
            raise LoraConfigError(f"{problem} (parameter {jax.tree_util.keystr(path)}).")


def _model(loaded: Any, targets: set[str]) -> Any:
    """The first adapter run's model, its `lora.target` widened to select every target's sites."""
    if len(targets) == 1:
        return loaded.model
    target = "|".join(f"(?:{t})" for t in sorted(targets))

    def widen(_path, model):
        extras = dict(model.op_extras)
        extras["dot"] = {**extras["dot"], EXTRA: {**extras["dot"][EXTRA], "target": target}}
        return model.set(op_extras=extras)

    config = replace(loaded.experiment.config, lambda path, _node: path == "model", widen)
    return config.model.instantiate(name="model", registries=loaded.experiment.registries)


def _pairs(tree: Any, path: tuple = ()) -> dict[tuple, dict]:
    """Path (of keys) -> the dict holding `lora_a` / `lora_b`, for every adapted site of an adapter tree."""
    if not isinstance(tree, dict):
        return {}
    if A in tree:
        return {path: tree}
    found = {}
    for key, value in tree.items():
        found.update(_pairs(value, (*path, key)))
    return found


def stack_pairs(trees: list[Any], settings: list[Any]) -> dict:
    """The adapters' trees (`split_params`' adapter side, one per adapter) stacked slot by slot (module docstring)."""
    sites = {}
    for i, tree in enumerate(trees):
        for path, pair in _pairs(tree).items():
            sites.setdefault(path, {})[i] = pair
    out: dict = {}
    for path, pairs in sites.items():
        node = out
        for key in path:
            node = node.setdefault(key, {})
        node.update(_stack_site(pairs, settings, len(trees) + 1))
    return out


def _stack_site(pairs: dict[int, dict], settings: list[Any], slots: int) -> dict[str, np.ndarray]:
    """One site's `lora_a`, `lora_b`, `lora_scale` stacked over `slots` (adapter i in slot i + 1, zeros elsewhere)."""
    some = next(iter(pairs.values()))
    a0, b0 = np.asarray(some[A]), np.asarray(some[B])
    depth = a0.ndim - 2  # Stacked-layer axes before the pair's own [in, rank] / [rank, *out].
    lead = a0.shape[:depth]
    rank = max(np.shape(p[A])[-1] for p in pairs.values())
    a = np.zeros((*lead, slots, a0.shape[-2], rank), a0.dtype)
    b = np.zeros((*lead, slots, rank, *b0.shape[depth + 1:]), b0.dtype)
    scale = np.zeros((*lead, slots), np.float32)
    every = (slice(None),) * depth
    for i, pair in pairs.items():
        r = np.shape(pair[A])[-1]
        a[(*every, i + 1, slice(None), slice(0, r))] = np.asarray(pair[A])
        b[(*every, i + 1, slice(0, r))] = np.asarray(pair[B])
        scale[(*every, i + 1)] = float(settings[i].alpha) / r
    return {A: a, B: b, SCALE: scale}
