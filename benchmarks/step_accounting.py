"""What a GPU train step costs and runs: model FLOPs, peak FLOP/s by device, the dtype of every matmul,
and the printed summary table.

Used by `benchmarks.gpu_step` (the formulas are stated in its docstring).
"""

from __future__ import annotations

import collections
import re
from typing import Any

from benchmarks.llama_jax import LlamaShape

# The targets, first-step loss agreement, and a GiB.
TARGET_MFU = 0.55
TARGET_RATIO = 1.05
LOSS_RTOL = 1e-2
GIB = 2**30

# Dense bfloat16 tensor-core peak, TFLOP/s, NVIDIA data sheets (no sparsity). First match in
# the lower-cased device kind wins, so the specific H100 variants come before "h100" (SXM).
PEAK_BF16_TFLOPS = (
    ("h100 pcie", 756.0),
    ("h100 nvl", 835.0),
    ("h100", 989.0),
    ("h200", 989.0),
    ("a100", 312.0),
    ("b200", 2250.0),
)
PEAK_SOURCE = "NVIDIA data sheets (H100/H200 SXM 989, H100 PCIe 756, H100 NVL 835, A100 312, B200 2250), dense bf16"

# -- FLOPs and peak ----------------------------------------------------------------------


def flops_per_step(shape: LlamaShape) -> dict[str, Any]:
    """Model FLOPs of one train step (formula in the module docstring)."""
    tokens = shape.batch * shape.seq
    dense = 6 * shape.num_params_matmul() * tokens
    full = 12 * shape.layers * shape.batch * shape.seq**2 * shape.heads * shape.head_dim
    return {
        "formula": "6 * N_matmul * B * T + 6 * L * B * T^2 * H * h  (causal attention = half of 12 L B T^2 H h); "
        "N_matmul = L (d H h + 2 d K h + H h d + 3 d F) + d V",
        "num_params_matmul": shape.num_params_matmul(),
        "dense": dense,
        "attention_causal": full // 2,
        "total": dense + full // 2,
        "attention_full_square": full,
        "total_full_square": dense + full,
    }


def peak_tflops(device_kind: str, platform: str, override: float | None) -> tuple[float | None, str]:
    """(peak dense bf16 TFLOP/s or None, where it came from)."""
    if override is not None:
        return override, "--peak-tflops"
    if platform != "gpu":
        return None, f"no peak for platform {platform}"
    kind = device_kind.lower()
    for key, value in PEAK_BF16_TFLOPS:
        if key in kind:
            return value, PEAK_SOURCE
    return None, f"device kind {device_kind!r} is not in PEAK_BF16_TFLOPS; pass --peak-tflops"


# -- Matmul dtypes -----------------------------------------------------------------------

_SHORT = {"bfloat16": "bf16", "float16": "f16", "float32": "f32", "float64": "f64", "int8": "s8", "int32": "s32"}
_INSTR = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<type>.*?)\s(?P<op>[a-z][\w\-]*)\((?P<args>[^)]*)\)(?P<attrs>.*)$"
)
_ARRAY = re.compile(r"([a-z]\w*)\[([\d,]*)\]")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')


def jaxpr_dots(closed_jaxpr) -> dict[str, int]:
    """Counts of the `dot_general`s of a traced step by `lhs x rhs -> out` dtype (every call counted)."""
    from jax.extend.core import jaxprs_in_params

    counts: collections.Counter = collections.Counter()

    def walk(jaxpr, times: int) -> None:
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                lhs, rhs = (_SHORT.get(v.aval.dtype.name, v.aval.dtype.name) for v in eqn.invars)
                out = eqn.outvars[0].aval.dtype.name
                counts[f"{lhs} x {rhs} -> {_SHORT.get(out, out)}"] += times
            inner = times * eqn.params.get("length", 1) if eqn.primitive.name == "scan" else times
            for sub in jaxprs_in_params(eqn.params):
                walk(sub, inner)

    walk(closed_jaxpr.jaxpr, 1)
    return dict(counts.most_common())


def hlo_matmuls(text: str) -> dict[str, Any]:
    """The matmuls of an optimized HLO module by kind and dtypes, its matmul shapes, and its custom calls.

    Kinds: `dot`, `convolution`, `cublas` (custom calls whose target names cuBLAS or a gemm).
    A while loop's body counts once (the benchmark's stacks are unrolled).
    """
    types: dict[str, str] = {}
    found = []
    custom: collections.Counter = collections.Counter()
    for line in text.splitlines():
        m = _INSTR.match(line)
        if not m:
            continue
        types[m["name"]] = m["type"]
        op, kind = m["op"], None
        if op in ("dot", "convolution"):
            kind = op
        elif op == "custom-call":
            target = _TARGET.search(m["attrs"])
            target = target.group(1) if target else "?"
            custom[target] += 1
            if "cublas" in target or "gemm" in target or "matmul" in target:
                kind = "cublas"
        if kind:
            found.append((kind, m["type"], [a.strip() for a in m["args"].split(", ")][:2]))

    def array(type_text: str) -> tuple[str, str]:
        a = _ARRAY.search(type_text)
        return (a.group(1), a.group(2)) if a else ("?", "")

    def operand(arg: str) -> tuple[str, str]:
        inline = _ARRAY.match(arg)
        return (inline.group(1), inline.group(2)) if inline else array(types.get(arg.lstrip("%"), ""))

    by_dtype: collections.Counter = collections.Counter()
    by_shape: collections.Counter = collections.Counter()
    for kind, out_type, args in found:
        (lt, ls), (rt, rs), (ot, os_) = operand(args[0]), operand(args[1] if len(args) > 1 else ""), array(out_type)
        by_dtype[f"{kind} {lt} x {rt} -> {ot}"] += 1
        by_shape[f"{kind} {lt}[{ls}] x {rt}[{rs}] -> {ot}[{os_}]"] += 1
    return {
        "matmuls": dict(by_dtype.most_common()),
        "matmul_shapes": dict(by_shape.most_common(60)),
        "custom_calls": dict(custom.most_common()),
    }


# -- Summary rows and the printed table ---------------------------------------------------------------------



def _percent(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def table(phases: dict[str, dict[str, Any]]) -> str:
    """The printed summary: a row per phase and contender, then each contender's matmul dtypes."""
    lines = [
        "| attention (axcore / pure) | contender | batch | step (s) | p10-p90 | tokens/s | MFU | MFU full square "
        "| peak GiB | axcore/pure | first loss |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    dots = []
    for attention, data in phases.items():
        if "contenders" not in data:
            lines.append(f"| {attention} | FAILED: {str(data.get('error', '?')).splitlines()[0][:120]} |||||||||")
            continue
        kernel = f"{attention} ({data['attention']['axcore_kernel']} / {data['attention']['pure_jax']})"
        for name, c in data["contenders"].items():
            s, peak = c["step_time_s"], c["peak_bytes_in_use"]
            gib = "-" if peak is None else f"{peak / GIB:.2f}{'' if c['peak_bytes_exact'] else '*'}"
            ratio = f"{data['ratio_axcore_over_pure_jax']['median']:.3f}" if name == "axcore" else ""
            lines.append(
                f"| {kernel} | {name} | {data['model']['batch']} | {s['median']:.4f} | {s['p10']:.4f}-{s['p90']:.4f} "
                f"| {c['tokens_per_s']:,.0f} | {_percent(c['mfu'])} | {_percent(c['mfu_full_square'])} | {gib} "
                f"| {ratio} | {c['first_step_loss']:.5f} |"
            )
            d = c["dots"]
            dots.append(f"{attention} {name}: requested {d['requested']}; compiled {d['matmuls']}; "
                        f"custom calls {d['custom_calls']}")
    notes = ["", "Matmul dtypes (lhs x rhs -> out: count):", *dots, "(peak GiB with *: an upper bound; see docstring)"]
    return "\n".join(lines + notes)


def headlines(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Summary rows (benchmarks.run's SUMMARY.md format)."""
    tag = f"[{result['attention']['requested']}: {result['attention']['axcore_kernel']}]"
    rows = []
    for name, c in result["contenders"].items():
        rows.append({"metric": f"{tag} {name} step (median s)", "value": round(c["step_time_s"]["median"], 4)})
        rows.append({"metric": f"{tag} {name} tokens/s", "value": round(c["tokens_per_s"])})
        row = {"metric": f"{tag} {name} MFU (causal half)", "value": None if c["mfu"] is None else round(c["mfu"], 4)}
        if c["mfu"] is not None and not result["smoke"]:
            row.update(target=f">= {TARGET_MFU}", passed=c["mfu"] >= TARGET_MFU)
        rows.append(row)
        gib = None if c["peak_bytes_in_use"] is None else round(c["peak_bytes_in_use"] / GIB, 2)
        rows.append({"metric": f"{tag} {name} peak device memory (GiB)", "value": gib})
    ratio = result["ratio_axcore_over_pure_jax"]["median"]
    rows.append({"metric": f"{tag} axcore / pure JAX (median of per-round ratios)", "value": round(ratio, 4),
                 "target": f"<= {TARGET_RATIO}", "passed": ratio <= TARGET_RATIO})
    rows.append({"metric": f"{tag} first-step losses (rel. diff)", "value": f"{result['first_step_loss_rel_diff']:.1e}",
                 "target": f"<= {LOSS_RTOL:g}", "passed": result["first_step_losses_agree"]})
    return rows
