"""Mixtral and Qwen3-MoE (Hugging Face) <-> axcore: Llama layers whose feed-forward is sparse.

Both families are Llama (`axcore_hf.LlamaConverter`: GQA, RoPE, RMSNorm, untied or tied
head) with the MLP of every layer replaced by a sparse MoE block, in axcore the `moe`
plugin's `mixture_of_experts` with `every: 1`, SwiGLU experts (plugin `swiglu`) and no
token dropped (`capacity_factor: null`: HF processes every routed token). Routing is
softmax over all experts, top-k, then:

| family    | gates of the k experts                                 | axcore `moe.gates` | attention   |
|-----------|--------------------------------------------------------|--------------------|-------------|
| mixtral   | renormalized to sum to 1 (= softmax over the k logits) | renormalized       | Llama (+ sliding_window) |
| qwen3_moe | renormalized if `norm_topk_prob`, else the probabilities | renormalized / probabilities | Llama + QK-norm (RMSNorm per head, before RoPE) (+ sliding_window if use_sliding_window) |

A sliding window, where set, applies to every layer (as in Mistral; Qwen3-MoE has no
`max_window_layers`).

Tensors besides Llama's attention and norms (`axcore_hf.llama`'s table), with
E experts, d = hidden_size, I = the expert size, B = the block (`block_sparse_moe`
in Mixtral, `mlp` in Qwen3-MoE) and (g, u, o) = the expert projection names
(`w1, w3, w2` in Mixtral, `gate_proj, up_proj, down_proj` in Qwen3-MoE):

| Hugging Face                                  | axcore, per layer                                   |
|-----------------------------------------------|-----------------------------------------------------|
| model.layers.i.B.gate.weight `[E, d]`         | feed_forward/router `[d, E]`                        |
| model.layers.i.B.experts.j.g.weight `[I, d]`  | feed_forward/expert/gate_proj/weight `[E, d, I]`, row j |
| model.layers.i.B.experts.j.u.weight `[I, d]`  | feed_forward/expert/up_proj/weight `[E, d, I]`, row j   |
| model.layers.i.B.experts.j.o.weight `[d, I]`  | feed_forward/expert/down_proj/weight `[E, I, d]`, row j |
| model.layers.i.self_attn.q_norm.weight `[h]`  | self_attention/q_norm/scale `[h]` (Qwen3-MoE)        |
| model.layers.i.self_attn.k_norm.weight `[h]`  | self_attention/k_norm/scale `[h]` (Qwen3-MoE)        |

This is the per-expert layout of checkpoints on the Hub (transformers 5 fuses the
experts in memory and writes them back per expert). Every mapping is a transpose
and a reshape, so float32/bfloat16/float16 tensors round-trip bit for bit.

Refused (one line naming the field): router jitter (`router_jitter_noise`), dense
layers among the sparse ones (`mlp_only_layers`, `decoder_sparse_step` != 1),
shared experts (`shared_expert_intermediate_size`), and everything `LlamaConverter` refuses (biases, other
activations, rope types).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from axcore.checkpoint.interop import ConversionError

from axcore_hf.llama import (
    GLOBAL_TENSORS,
    LAYER_TENSORS,
    QK_NORM_TENSORS,
    LlamaConverter,
    first_layer,
    from_hf,
    hf_shape,
    layer_slots,
    to_hf,
    unplaced_tensors,
)

# axcore names of the three SwiGLU projections of an expert, in HF's (gate, up, down) order.
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
# Llama's per-layer tensors that are not its dense MLP (attention and the two norms).
ATTENTION_TENSORS = {name: entry for name, entry in LAYER_TENSORS.items() if not name.startswith("mlp.")}


# The two names transformers gives the number of experts (its attribute_map makes them one field).
EXPERT_COUNT_FIELDS = ("num_local_experts", "num_experts")


def _refuse_if(test: Callable[[Any], bool], why: str) -> Callable[[Any], str | None]:
    return lambda value: why if value is not None and test(value) else None


@dataclasses.dataclass(frozen=True)
class MoEFamily:
    """What distinguishes one sparse-MoE Llama family's config.json and tensor names."""

    # The Hugging Face model_type (config.json) the converter is registered under.
    model_type: str
    # The HF architecture name written to an exported config.json.
    architecture: str
    # Module of the sparse block inside a layer (`model.layers.i.<block>.gate.weight`).
    block: str
    # HF names of an expert's gate, up and down projections (`<block>.experts.j.<name>.weight`).
    expert_names: tuple[str, str, str]
    # config.json field with the number of experts, written on export unless the source used the other
    # name (transformers reads `num_experts` and `num_local_experts` as one another).
    num_experts_field: str
    # config.json field with each expert's hidden size.
    expert_size_field: str
    # Whether attention has QK-norm (`self_attn.q_norm` / `k_norm`, RMSNorm with rms_norm_eps).
    qk_norm: bool
    # config.json field that must be true for `sliding_window` to window every layer's attention;
    # None: `sliding_window` applies whenever set (as in Mistral).
    window_switch: str | None
    # config.json's `norm_topk_prob` when it is absent (true: gates renormalized); None: the family always
    # renormalizes and has no such field.
    norm_topk_prob: bool | None
    # config.json field -> a check returning why its value cannot be imported (None: fine).
    refused: Mapping[str, Callable[[Any], str | None]]
    # Fields written on export with these values (what `refused` accepts).
    exported: Mapping[str, Any]
    # Fields of Llama's config.json the family does not have (dropped on export).
    not_fields: tuple[str, ...]


MIXTRAL = MoEFamily(
    model_type="mixtral",
    architecture="MixtralForCausalLM",
    block="block_sparse_moe",
    expert_names=("w1", "w3", "w2"),
    num_experts_field="num_local_experts",
    expert_size_field="intermediate_size",
    qk_norm=False,
    window_switch=None,
    norm_topk_prob=None,
    refused={"router_jitter_noise": _refuse_if(lambda v: v != 0, "router jitter is not implemented (set it to 0)")},
    exported={"router_jitter_noise": 0.0},
    not_fields=("attention_bias", "mlp_bias"),
)
QWEN3_MOE = MoEFamily(
    model_type="qwen3_moe",
    architecture="Qwen3MoeForCausalLM",
    block="mlp",
    expert_names=("gate_proj", "up_proj", "down_proj"),
    num_experts_field="num_experts",
    expert_size_field="moe_intermediate_size",
    qk_norm=True,
    window_switch="use_sliding_window",
    norm_topk_prob=False,
    refused={
        "mlp_only_layers": _refuse_if(bool, "dense layers among the sparse ones are not implemented"),
        "decoder_sparse_step": _refuse_if(lambda v: v != 1, "only every layer sparse (1) is implemented"),
        "shared_expert_intermediate_size": _refuse_if(bool, "shared experts are not implemented"),
    },
    exported={"decoder_sparse_step": 1, "mlp_only_layers": []},
    not_fields=("mlp_bias",),
)


def _positive_int(config: Mapping[str, Any], name: str, where: str) -> int:
    value = config.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        need = "is missing" if value is None else f"is {value!r}"
        raise ConversionError(f"{where}: '{name}' {need}; it must be a positive integer.")
    return value


def _num_experts(config: Mapping[str, Any], family: MoEFamily, where: str) -> int:
    """config.json's number of experts, under either of its names (`num_experts`, `num_local_experts`)."""
    name = next((n for n in EXPERT_COUNT_FIELDS if config.get(n) is not None), family.num_experts_field)
    return _positive_int(config, name, where)


def _leaf(tree: Mapping, path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _shapes(tree: Any) -> Any:
    return {k: _shapes(v) for k, v in tree.items()} if isinstance(tree, Mapping) else tuple(tree.shape)


@dataclasses.dataclass(frozen=True)
class MoEConverter:
    """An `axcore.checkpoint.interop.ModelConverter` for one `MoEFamily` (module docstring)."""

    # The family converted.
    family: MoEFamily

    @property
    def llama(self) -> LlamaConverter:
        """The dense converter this one extends (its attention, norms, RoPE and embeddings)."""
        f = self.family
        return LlamaConverter(model_type=f.model_type, architecture=f.architecture, sliding_window=True)

    # -- Configs ----------------------------------------------------------------------

    def experiment(self, config: Mapping[str, Any], where: str) -> dict[str, Any]:
        """config.json data -> experiment data: Llama's, plus `plugins: [..., moe]`, `moe:` and QK-norm."""
        f = self.family
        for name, check in f.refused.items():
            why = check(config.get(name))
            if why:
                raise ConversionError(f"{where}: '{name}' is {config[name]!r}; {why}, so it cannot be imported.")
        num_experts = _num_experts(config, f, where)
        top_k = _positive_int(config, "num_experts_per_tok", where)
        if top_k > num_experts:
            raise ConversionError(
                f"{where}: 'num_experts_per_tok' ({top_k}) exceeds the number of experts ({num_experts})."
            )
        expert_size = _positive_int(config, f.expert_size_field, where)
        # Llama's (Mistral's) reading, with the expert size as its MLP size and a switched-off window left out.
        dense = {**config, "intermediate_size": expert_size}
        if f.window_switch is not None and not config.get(f.window_switch, False):
            dense["sliding_window"] = None
        data = self.llama.experiment(dense, where)
        layer = data["model"]["decoder"]["layer"]
        if f.qk_norm:
            norm = dict(layer["norm"])  # rms_norm with rms_norm_eps, over each head's head_dim.
            layer["self_attention"].update(q_norm=norm, k_norm=dict(norm))
        renormalize = f.norm_topk_prob is None or bool(config.get("norm_topk_prob", f.norm_topk_prob))
        data["plugins"].append("moe")
        data["moe"] = {
            "every": 1,
            "num_experts": num_experts,
            "top_k": top_k,
            "gates": "renormalized" if renormalize else "probabilities",
            "capacity_factor": None,  # Dropless, as HF: every routed token reaches its experts.
        }
        return data

    def outside_config(self, experiment: Any, base: Mapping[str, Any], where: str) -> dict[str, Any]:
        """The resolved experiment -> config.json data (architecture fields over `base`).

        Fields the family cannot express (a dense layer, capacity dropping, other gates) are
        caught by the export's check that this config.json rebuilds the run's model.
        """
        f = self.family
        out = self.llama.outside_config(experiment, base, where)
        moe = first_layer(experiment.to_dict()["model"]["decoder"], where)["feed_forward"]
        if moe.get("type") != "mixture_of_experts":
            raise ConversionError(
                f"{where}: model.decoder...feed_forward is {moe.get('type')!r}; a {f.architecture} has a "
                f"mixture_of_experts (plugin moe, every: 1) in every layer."
            )
        for name in f.not_fields:
            out.pop(name, None)
        count = next((n for n in EXPERT_COUNT_FIELDS if n in base), f.num_experts_field)
        out.update({count: moe["num_experts"], "num_experts_per_tok": moe["top_k"], **f.exported})
        if f.expert_size_field != "intermediate_size":  # Then that one sizes dense layers (none here): kept.
            out[f.expert_size_field] = moe["hidden_dim"]
            out["intermediate_size"] = base.get("intermediate_size", moe["hidden_dim"])
        if f.norm_topk_prob is not None:
            out["norm_topk_prob"] = moe["gates"] == "renormalized"
        if f.window_switch is not None:
            out[f.window_switch] = out["sliding_window"] is not None
        return out

    # -- Parameters -------------------------------------------------------------------

    def layer_tensors(self, num_experts: int) -> dict[str, tuple[tuple[str, ...], str, int | None]]:
        """HF suffix after `model.layers.i.` -> (axcore path inside a layer, layout kind, expert row or None)."""
        f = self.family
        table = {name: (path, kind, None) for name, (path, kind) in ATTENTION_TENSORS.items()}
        if f.qk_norm:
            table.update({name: (path, kind, None) for name, (path, kind) in QK_NORM_TENSORS.items()})
        table[f"{f.block}.gate.weight"] = (("feed_forward", "router"), "linear", None)
        for j in range(num_experts):
            for hf_name, ours in zip(f.expert_names, EXPERT_PROJECTIONS):
                path = ("feed_forward", "expert", ours, "weight")
                table[f"{f.block}.experts.{j}.{hf_name}.weight"] = (path, "linear", j)
        return table

    def params_from_outside(self, tensors: Mapping[str, Any], config: Mapping[str, Any], template: Any, where: str) -> dict:
        """HF tensors -> axcore params (float32 NumPy) shaped like `template` (a tree with `.shape` leaves)."""
        shapes = _shapes(template)
        num_layers = _positive_int(config, "num_hidden_layers", where)
        num_experts = _num_experts(config, self.family, where)
        params: dict = {}
        used: set[str] = set()

        def take(name: str, kind: str, shape: tuple[int, ...]) -> np.ndarray:
            if name not in tensors:
                raise ConversionError(f"{where}: tensor '{name}' is missing from the safetensors files; re-download it.")
            if tuple(tensors[name].shape) != hf_shape(kind, shape):
                raise ConversionError(
                    f"{where}: tensor '{name}' has shape {list(tensors[name].shape)} but config.json implies "
                    f"{list(hf_shape(kind, shape))}; the config and the weights disagree."
                )
            used.add(name)
            return from_hf(kind, tensors[name], shape)

        def put(path: tuple[str, ...], rows: tuple[int, ...], name: str, kind: str) -> None:
            full = _leaf(shapes, path)
            node = params
            for key in path[:-1]:
                node = node.setdefault(key, {})
            if not rows:
                node[path[-1]] = take(name, kind, full)
                return
            if path[-1] not in node:
                node[path[-1]] = np.empty(full, np.float32)
            stacked = node[path[-1]]
            stacked[rows] = take(name, kind, full[len(rows):])

        for name, (path, kind) in GLOBAL_TENSORS.items():
            if path[0] in shapes:
                put(path, (), name, kind)
        table = self.layer_tensors(num_experts)
        for i, (prefix, index) in enumerate(layer_slots(shapes["decoder"], num_layers)):
            for suffix, (path, kind, expert) in table.items():
                rows = tuple(r for r in (index, expert) if r is not None)
                put(prefix + path, rows, f"model.layers.{i}.{suffix}", kind)
        extra = unplaced_tensors(tensors, used, tied="lm_head" not in shapes)
        if extra:
            raise ConversionError(
                f"{where}: tensors {extra} have no place in the "
                f"{self.family.architecture} config.json describes (per-expert tensors are expected); they cannot "
                f"be imported."
            )
        return params

    def params_to_outside(self, params: Any, config: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """axcore params -> HF tensors (float32), by the tables in the module docstring."""
        out: dict[str, np.ndarray] = {}
        for name, (path, kind) in GLOBAL_TENSORS.items():
            if path[0] in params:
                out[name] = to_hf(kind, _leaf(params, path))
        num_layers = _positive_int(config, "num_hidden_layers", "config.json")
        table = self.layer_tensors(_num_experts(config, self.family, "config.json"))
        for i, (prefix, index) in enumerate(layer_slots(params["decoder"], num_layers)):
            for suffix, (path, kind, expert) in table.items():
                rows = tuple(r for r in (index, expert) if r is not None)
                out[f"model.layers.{i}.{suffix}"] = to_hf(kind, np.asarray(_leaf(params, prefix + path))[rows])
        return out
