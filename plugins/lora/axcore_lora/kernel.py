"""LoRA's arithmetic: a `dot` kernel whose per-site state is the adapter pair (A, B).

At a targeted site with weight w (x's trailing dims contracted with w's `contract` dims,
`in` their product, `out` the product of w's other dims), PEFT's formula:

    y = x . w + (dropout(x) @ A @ B) * (alpha / rank)

with x's contracted dims flattened to `[..., in]`, `A` of shape `[in, rank]` (PEFT's
`lora_A.weight` transposed) and `B` of shape `[rank, *out_dims]` (PEFT's `lora_B.weight`
transposed, its output dims unflattened like w's). Initialised as PEFT does: A
Kaiming-uniform with a = sqrt(5), i.e. uniform in `+-1/sqrt(in)`, and B = 0, so a fresh
model computes exactly its base's logits (adding 0.0 changes no float).

How it reaches the sites without a layer change: the plugin's config transform sets
`model.op_extras: {dot: {lora: {...settings}}}`, which every layer inherits, so every
`dot` problem carries the `lora` extra. The reference `xla` kernel declines problems
with extras it does not know; `lora` (priority 60) takes the targeted sites and
declares `lora_a` / `lora_b` as its state (`kernel_state/<site>/lora_a`, trainable),
`lora_base` (priority 60) takes the other sites and computes the plain dot. Either
replaces any other dot kernel (fp8, ...) on the model: LoRA runs in the reference
arithmetic. The base weights are frozen by `trainer.learner.trainable` (set to
`/lora_[ab]$`), so they get no gradient and no optimizer state.

A site is targeted when `target` fully matches its short name (the last component of
its path, without `_proj`: `q`, `k`, `v`, `o`, `gate`, `up`, `down`, `lm_head`) or its
path below the model (e.g. `decoder.layer0.self_attention.q_proj`, a Linear's `.dot`
dropped).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Annotated, Any

import jax
import jax.numpy as jnp
import numpy as np

from axcore import AxcoreError, ConfigBase
from axcore.config import NonNegative, Positive
from axcore.kernels import DotProblem, Support, current_adapter_rows, reference_dot, unknown_extras
from axcore.module import current_context
from axcore.params import ParameterSpec, constant, fold_in_name

from axcore_lora import quant

# Key of the settings in `op_extras.dot`.
EXTRA = "lora"
# The adapter pair's names under `kernel_state/<site>`.
A, B = "lora_a", "lora_b"
# With several adapters stacked for the inference engine (`axcore_lora.serving`): each slot's alpha / rank.
SCALE = "lora_scale"
# Values of one dequantized chunk of a QLoRA base weight (1 MiB in float32; `quantized_dot`).
CHUNK_ELEMENTS = 2**18


class LoraConfigError(AxcoreError):
    """A LoRA setting does not fit the model (names the field and what to do)."""


class LoraSettings(ConfigBase):
    """Settings of the lora plugin (the experiment's `lora:` section)."""

    # Rank of each adapter (columns of A, rows of B); at most the projection's smaller side.
    rank: Annotated[int, Positive] = 8
    # Scale numerator: the adapter's product is multiplied by alpha / rank (PEFT's lora_alpha).
    alpha: Annotated[float, Positive] = 16.0
    # Dropout rate on the adapter's input in training (PEFT's lora_dropout); 0 disables it.
    dropout: Annotated[float, NonNegative] = 0.0
    # Regex fully matching a site's short name (q, k, v, o, gate, up, down, lm_head) or its path below the model.
    target: str = "q|k|v|o|gate|up|down"
    # Storage of the targeted projections' frozen base weights: float (the layer's own), int8 or nf4 (QLoRA).
    base_format: str = "float"
    # Which sites' base base_format stores: targets (the adapted ones) or all (every dot site but a tied head).
    quantize: str = "targets"
    # What checkpoints hold: full (every parameter) or adapters (the adapters, optimizer state etc.; the base
    # read back from base_run).
    checkpoint: str = "full"
    # With checkpoint: adapters, the run directory (or checkpoints/) whose params are exactly the frozen parameters.
    base_run: str | None = None


def site_path(site: str) -> str:
    """A dot problem's site below the model: `model.decoder.layer0.mlp.up_proj.dot` -> `decoder.layer0.mlp.up_proj`."""
    parts = site.split(".")
    if parts and parts[0] == "model":
        parts = parts[1:]
    if len(parts) > 1 and parts[-1] == "dot":
        parts = parts[:-1]
    return ".".join(parts)


def short_name(site: str) -> str:
    """The last component of `site_path(site)` without a `_proj` suffix (`q`, `gate`, `lm_head`)."""
    last = site_path(site).split(".")[-1]
    return last.removesuffix("_proj")


def is_target(target: str, site: str) -> bool:
    """Whether regex `target` fully matches the site's short name or its path below the model."""
    return re.fullmatch(target, short_name(site)) is not None or re.fullmatch(target, site_path(site)) is not None


def lora_sites(sites: list[str], target: str) -> list[str]:
    """The sites of `sites` (dot problems' `site`) that `target` selects."""
    return [s for s in sites if is_target(target, s)]


@dataclasses.dataclass(frozen=True)
class KaimingUniform:
    """Initializer of A: uniform in +-1/sqrt(fan_in), PEFT's `kaiming_uniform_(a=sqrt(5))` (hashable)."""

    fan_in: int

    def __call__(self, key, shape, dtype):
        bound = 1.0 / math.sqrt(self.fan_in)
        return jax.random.uniform(key, shape, jnp.float32, -bound, bound).astype(dtype)


def _settings(problem: DotProblem) -> dict[str, Any] | None:
    return problem.extras.get(EXTRA)


def base_format(problem: DotProblem) -> str:
    """How the site's base weight is stored: `base_format` at a targeted site (or any but a tied head, `attend`,
    with `quantize: all`), else float."""
    settings = _settings(problem)
    fmt = settings.get("base_format", "float")
    if settings.get("quantize", "targets") == "all":
        return "float" if short_name(problem.site) == "attend" else fmt
    return fmt if is_target(settings["target"], problem.site) else "float"


def stored_weight_spec(problem: DotProblem, spec: ParameterSpec) -> ParameterSpec | None:
    """The frozen base weight's stored form (`base_format` int8 / nf4, `axcore_lora.quant`); None: the float weight."""
    fmt = base_format(problem)
    if fmt == "float":
        return None
    shape = quant.stored_shape(fmt, problem.in_dim, math.prod(problem.out_dims))
    init = quant.QuantizedInit(spec.initializer, problem.w_shape, problem.contract, fmt)
    return ParameterSpec(shape, np.dtype(np.uint8), init, (None, None), weight_decay_scale=0.0, trainable=False)


def base_dot(problem: DotProblem, x: jax.Array, w: jax.Array, fmt: str) -> jax.Array:
    """x . w for the base weight `w` as stored: the reference dot of a float weight, or (int8 / nf4) the
    stored weight dequantized to the compute dtype as `[out, in]` and contracted with x's trailing dims
    (`quantized_dot`)."""
    if fmt == "float":
        return reference_dot(problem, x, w)
    k, out = len(problem.contract), math.prod(problem.out_dims)
    lead = x.shape[: x.ndim - k]
    x2 = x.reshape(*lead, problem.in_dim).astype(problem.compute_dtype)
    y = quantized_dot(fmt, problem.in_dim, out, np.dtype(problem.compute_dtype), np.dtype(problem.output_dtype), x2, w)
    return y.reshape(*lead, *problem.out_dims)


def row_chunks(fmt: str, in_dim: int, out: int) -> int:
    """Into how many equal chunks of output rows `quantized_dot` splits an `[out, in]` weight stored in `fmt`: the
    fewest, at least 2 (XLA folds a loop of one trip into straight code), whose chunk has at most `CHUNK_ELEMENTS`
    values, each chunk whole rows and (nf4) whole blocks of `quant.BLOCK`; else the most such chunks there are
    (1 when none: an nf4 weight whose rows straddle blocks)."""
    splits = [n for n in range(1, out + 1)
              if out % n == 0 and (n == 1 or fmt != "nf4" or out // n * in_dim % quant.BLOCK == 0)]
    return next((n for n in splits if n >= 2 and out // n * in_dim <= CHUNK_ELEMENTS), splits[-1])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def quantized_dot(fmt: str, in_dim: int, out: int, compute_dtype: Any, output_dtype: Any, x2: jax.Array,
                  w: jax.Array) -> jax.Array:
    """`x2 [..., in] @ dequantize(w)^T -> [..., out]` in `output_dtype`, `w` stored in `fmt` (`axcore_lora.quant`).

    The whole float weight never exists: a loop dequantizes `row_chunks` chunks of output rows
    one at a time (in the compute dtype) and contracts each with x2, in the forward pass and
    again in the backward, which keeps only the stored bytes `w` as its residual. Dequantized
    whole, XLA computes every layer's float weight at the start of the step (they depend on
    parameters only) and keeps it for the input's gradient, so a float copy of the whole
    quantized base lives across the step, which undoes QLoRA's saving (an optimization barrier
    does not stop this on CPU, where XLA drops barriers before scheduling). The cotangent is
    rounded to the compute dtype first, as `wide_result` does; the frozen integer `w` gets
    no gradient (float0).
    """
    n = row_chunks(fmt, in_dim, out)

    def one(chunk):
        rows = quant.dequantize(fmt, chunk, in_dim, out // n, compute_dtype)
        return jnp.einsum("...i,oi->...o", x2, rows, preferred_element_type=output_dtype).astype(output_dtype)

    y = jax.lax.map(one, w.reshape(n, -1, w.shape[-1]))  # [n, ..., out // n]
    return jnp.moveaxis(y, 0, -2).reshape(*x2.shape[:-1], out)


def _quantized_dot_fwd(fmt, in_dim, out, compute_dtype, output_dtype, x2, w):
    return quantized_dot(fmt, in_dim, out, compute_dtype, output_dtype, x2, w), w


def _quantized_dot_bwd(fmt, in_dim, out, compute_dtype, output_dtype, w, g):
    del output_dtype
    n = row_chunks(fmt, in_dim, out)
    g = jnp.moveaxis(g.astype(compute_dtype).reshape(*g.shape[:-1], n, out // n), -2, 0)  # [n, ..., out // n]

    def add(dx, chunk_and_g):
        chunk, g_chunk = chunk_and_g
        rows = quant.dequantize(fmt, chunk, in_dim, out // n, compute_dtype)
        return dx + jnp.einsum("...o,oi->...i", g_chunk, rows, preferred_element_type=compute_dtype), None

    dx = jnp.zeros((*g.shape[1:-1], in_dim), compute_dtype)
    dx, _ = jax.lax.scan(add, dx, (w.reshape(n, -1, w.shape[-1]), g))
    return dx, np.zeros(w.shape, jax.dtypes.float0)


quantized_dot.defvjp(_quantized_dot_fwd, _quantized_dot_bwd)


def _site_support(problem: DotProblem, targeted: bool) -> Support:
    """Whether the lora extra is on and the site is (`targeted`) or is not a lora target."""
    settings = _settings(problem)
    if settings is None:
        return Support(False, "no lora extra (the lora plugin is not enabled)")
    if is_target(settings["target"], problem.site) != targeted:
        return Support(False, f"site {problem.site} {'is not' if targeted else 'is'} a lora target")
    return unknown_extras(problem, [EXTRA])


class LoraDot:
    """The `dot` of a targeted site plus its adapter (module docstring); state `lora_a`, `lora_b`."""

    name = "lora"
    priority = 60

    def is_supported(self, problem: DotProblem) -> Support:
        return _site_support(problem, targeted=True)

    def state_specs(self, problem: DotProblem) -> dict[str, ParameterSpec]:
        settings = _settings(problem)
        rank, out = int(settings["rank"]), math.prod(problem.out_dims)
        if rank > min(problem.in_dim, out):
            raise LoraConfigError(
                f"'lora.rank' ({rank}) is larger than projection {site_path(problem.site)} "
                f"([{problem.in_dim} -> {out}]); use a rank of at most {min(problem.in_dim, out)}."
            )
        axes = problem.w_axes
        in_axis = axes[problem.contract[0]] if axes is not None and len(problem.contract) == 1 else None
        out_axes = tuple(axes[i] for i in range(len(problem.w_shape)) if i not in problem.contract) if axes else None
        return {
            A: ParameterSpec((problem.in_dim, rank), problem.w_dtype, KaimingUniform(problem.in_dim), (in_axis, None)),
            B: ParameterSpec(
                (rank, *problem.out_dims), problem.w_dtype, constant(0.0),
                None if out_axes is None else (None, *out_axes),
            ),
        }

    def weight_spec(self, problem: DotProblem, spec: ParameterSpec) -> ParameterSpec | None:
        return stored_weight_spec(problem, spec)

    def stack_adapters(self, base: Any, adapters: dict[str, Any]) -> tuple[Any, Any]:
        """The inference engine's hook (`axcore.engine.adapters`): `(model, params)` serving base run `base` and
        the LoRA runs `adapters` (`{name: LoadedModel}`) per request (`axcore_lora.serving.stack_adapters`)."""
        from axcore_lora.serving import stack_adapters  # Deferred: the engine's side only.

        return stack_adapters(base, adapters)

    def __call__(self, problem: DotProblem, x: jax.Array, w: jax.Array, *, state: dict) -> tuple[jax.Array, None]:
        settings = _settings(problem)
        y = base_dot(problem, x, w, base_format(problem))
        k = len(problem.contract)
        lead = x.shape[: x.ndim - k]
        h = x.reshape(*lead, problem.in_dim).astype(problem.compute_dtype)
        rate = float(settings["dropout"])
        ctx = current_context()
        if rate > 0 and ctx is not None and ctx.is_training and ctx.prng_key is not None:
            keep = jax.random.bernoulli(fold_in_name(ctx.prng_key, f"lora_dropout.{problem.site}"), 1.0 - rate, h.shape)
            h = jnp.where(keep, h / (1.0 - rate), 0).astype(h.dtype)
        if SCALE in state:  # Several adapters stacked by slot, one per batch row (`stacked_delta`).
            delta = stacked_delta(problem, h, state)
            return y + delta.reshape(*lead, *problem.out_dims).astype(y.dtype), None
        a = state[A].astype(problem.compute_dtype)
        b = state[B].astype(problem.compute_dtype).reshape(a.shape[1], -1)
        delta = (h @ a) @ b * (float(settings["alpha"]) / a.shape[1])
        return y + delta.reshape(*lead, *problem.out_dims).astype(y.dtype), None


def stacked_delta(problem: DotProblem, h: jax.Array, state: dict) -> jax.Array:
    """The adapters' term of a site whose state stacks S adapter slots (the inference engine's, `axcore_lora.serving`):
    `lora_a [S, in, R]`, `lora_b [S, R, *out_dims]`, `lora_scale [S]` (slot 0 zeros: the base). Row r of the batch
    uses slot `current_adapter_rows()[r]` (`axcore.kernels.adapter_rows`):

        delta[r] = (h[r] @ A[slot_r]) @ B[slot_r] * scale[slot_r]

    `h [rows, ..., in]` (the rows are the call's batch rows) -> `[rows, ..., out]` in the compute dtype.
    """
    rows = current_adapter_rows()
    if rows is None:
        raise LoraConfigError(f"site {site_path(problem.site)} holds stacked adapters ({SCALE}) but the model call "
                              "gives no adapter per row; run it through the inference engine (axcore.engine.Engine).")
    a = state[A].astype(problem.compute_dtype)[rows]  # [rows, in, R]
    b = state[B].astype(problem.compute_dtype)[rows].reshape(rows.shape[0], a.shape[2], -1)  # [rows, R, out]
    scale = state[SCALE].astype(problem.compute_dtype)[rows]  # [rows]
    h3 = h.reshape(rows.shape[0], -1, h.shape[-1])
    delta = jnp.einsum("bnr,bro->bno", jnp.einsum("bni,bir->bnr", h3, a), b) * scale[:, None, None]
    return delta.reshape(*h.shape[:-1], b.shape[-1])


class LoraBaseDot:
    """The plain `dot` of a site the lora target does not select (the reference declines the lora extra)."""

    name = "lora_base"
    priority = 60

    def is_supported(self, problem: DotProblem) -> Support:
        return _site_support(problem, targeted=False)

    def weight_spec(self, problem: DotProblem, spec: ParameterSpec) -> ParameterSpec | None:
        return stored_weight_spec(problem, spec)  # With quantize: all, untargeted sites are stored quantized too.

    def __call__(self, problem: DotProblem, x: jax.Array, w: jax.Array) -> jax.Array:
        return base_dot(problem, x, w, base_format(problem))
