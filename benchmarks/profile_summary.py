"""Summaries of a `jax.profiler.trace`: where a compiled step spends its device time.

Reads the trace's `*.xplane.pb` through JAX's public reader, `jax.profiler.ProfileData`
(no tensorboard, xprof or protobuf decoding here), takes the kernels of the first GPU
device plane (or, on CPU, XLA's thunks on the host plane), and summarizes them: busy time,
idle gaps, kernels, categories, and the kernels mapped to the compiled step's HLO
instructions (`hlo_instructions` of `compiled.as_text()`). Used by `benchmarks.gpu_profile`.

Event dicts (what `device_events` returns and `summarize_profile` takes):
{"name": str, "start_ns": float, "duration_ns": float, "stats": {stat name: value}, "line": str},
`start_ns` on the trace's one clock (ns since the session's start, as `ProfileEvent.start_ns`).
Stats are the event's own (`ProfileEvent.stats`; ProfileData does not expose event-metadata
stats): on GPU kernels `hlo_op`, `hlo_module`, `program_id`, `correlation_id`, `kernel_details`, ...
(XLA's CUPTI collector writes them on the event), on CPU thunks `hlo_op`, `hlo_module`, ...
"""

from __future__ import annotations

import collections
import pathlib
import re
import time
from typing import Any

# -- The compiled step's HLO: what each instruction is ------------------------------------------

_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = (.+?) ([a-z][a-z0-9\-]*)\((.*)$")


def _stack_frames(hlo_text: str) -> dict[str, str]:
    """Stack frame id -> "file.py:line function" from the HLO text's FileNames/FunctionNames/FileLocations/StackFrames."""
    sections: dict[str, dict[str, str]] = {}
    current = None
    for line in hlo_text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = sections.setdefault(line, {})
        elif current is not None and (m := re.match(r"^(\d+) (.*)$", line)):
            current[m.group(1)] = m.group(2)
        elif line.strip():
            current = None
    files, functions = sections.get("FileNames", {}), sections.get("FunctionNames", {})
    out = {}
    for frame, text in sections.get("StackFrames", {}).items():
        location = re.search(r"file_location_id=(\d+)", text)
        loc = sections.get("FileLocations", {}).get(location.group(1) if location else "", "")
        f, fn, ln = (re.search(rf"\b{k}=(\d+)", loc) for k in ("file_name_id", "function_name_id", "line"))
        name = files.get(f.group(1), "?").strip('"') if f else "?"
        function = functions.get(fn.group(1), "").strip('"') if fn else ""
        out[frame] = f"{'/'.join(name.split('/')[-2:])}:{ln.group(1) if ln else '?'} {function}"
    return out


def hlo_instructions(hlo_text: str) -> dict[str, dict[str, str]]:
    """Instruction name -> {"opcode", "shape", "target" (custom-call target, fusion kind and GEMM backend),
    "op_name", "source" (the innermost stack frame: "dir/file.py:line function")}."""
    frames, out = _stack_frames(hlo_text), {}
    for line in hlo_text.splitlines():
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        name, shape, opcode, rest = m.groups()
        target = ""
        if t := re.search(r'custom_call_target="([^"]*)"', rest):
            target = t.group(1)
        elif opcode == "fusion":
            kind = re.search(r"kind=(\w+)", rest)
            target = kind.group(1) if kind else ""
            if b := re.search(r'"kind":"(__[\w$]+)"', rest):  # Triton/cuBLAS/cuDNN GEMM fusions name their backend.
                target = f"{target} {b.group(1)}"
        op_name = re.search(r'op_name="([^"]*)"', rest)
        frame = re.search(r"stack_frame_id=(\d+)", rest)
        out[name] = {"opcode": opcode, "shape": re.sub(r"\{[^}]*\}", "", shape)[:60], "target": target,
                     "op_name": op_name.group(1) if op_name else "",
                     "source": frames.get(frame.group(1), "") if frame else ""}
    return out


def scope_of(info: dict[str, str] | None) -> str:
    """Which part of the model an instruction comes from: "fwd"/"bwd" (a `transpose(` in its op_name) and its source.

    {"op_name": "jit(step)/transpose(jvp())/dot_general", "source": "layers/basic.py:80 __call__"} ->
    "bwd layers/basic.py:80 __call__"; without a source, the op_name less its jit(...) prefix.
    """
    if not info or not (info.get("op_name") or info.get("source")):
        return "?"
    op_name = info.get("op_name", "")
    direction = "bwd" if "transpose(" in op_name else "fwd"
    where = info.get("source") or re.sub(r"^jit\([^)]*\)/", "", op_name)
    return f"{direction} {where[:70]}"


# -- Device timeline analysis ---------------------------------------------------------------------

CATEGORIES = ("gemm", "attention", "fusion", "collective", "memcpy", "other")
# Lines of a GPU device plane that the profiler derives from the kernels (counting them would double count).
DERIVED_LINES = ("XLA Modules", "XLA Ops", "Steps", "XLA TraceMe", "Framework Name Scope", "Framework Ops",
                 "Source code", "TensorFlow Name Scope", "TensorFlow Ops", "Launch Stats")
GAP_BUCKETS_US = (5, 20, 100, 1000)


def category(kernel: str, hlo: dict[str, str] | None) -> str:
    """One of CATEGORIES from the kernel's name and, where known, its HLO instruction.

    Every cuDNN kernel counts as attention (the step's only cuDNN calls are its fused attention).
    """
    k = kernel.lower()
    what = " ".join((hlo or {}).get(key, "") for key in ("opcode", "target")).lower()
    if any(s in k for s in ("fmha", "sdpa", "flash", "attention", "attn", "cudnn")) or "fmha" in what:
        return "attention"
    if any(s in k for s in ("nccl", "all-reduce", "allreduce", "all-gather", "allgather", "reduce-scatter",
                            "reducescatter", "all-to-all", "collective")) or any(
        s in what for s in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")):
        return "collective"
    if any(s in k for s in ("memcpy", "memset")) or what.startswith(("copy-start", "copy-done")):
        return "memcpy"
    if (hlo or {}).get("target") == "kCustom" and (hlo or {}).get("op_name", "").endswith("dot_general"):
        return "gemm"  # XLA:CPU's library (YNNPACK/oneDNN) dot fusions.
    if any(s in k for s in ("gemm", "cublas", "cutlass", "xmma", "nvjet", "gemv", "matmul", "dot", "wgmma",
                            "ynn_dot")) or any(s in what for s in ("gemm", "cublas", "dot", "convolution")):
        return "gemm"
    if any(s in k for s in ("fusion", "loop_", "input_", "wrapped_", "reduce", "transpose", "convert", "copy",
                            "triton", "concatenate", "dynamic")) or (hlo or {}).get("opcode") in ("fusion", "copy"):
        return "fusion"
    return "other"


def _stats(stats: Any) -> dict[str, Any]:
    """A ProfileEvent's or ProfilePlane's (name, value) stat pairs as a dict (pairs with no known name dropped)."""
    return {k: v for k, v in stats if k is not None}


def _events(line: Any) -> list[dict[str, Any]]:
    """The events of one ProfileLine as event dicts (the module docstring)."""
    return [{"name": e.name, "start_ns": e.start_ns, "duration_ns": e.duration_ns, "stats": _stats(e.stats),
             "line": line.name} for e in line.events]


def device_events(profile: Any) -> tuple[str, list[dict[str, Any]], dict[str, int]]:
    """(plane name, kernel/op events, event count per line) of a `jax.profiler.ProfileData`.

    The first GPU device plane with events: its stream lines ("Stream #..."), else its lines less the
    DERIVED_LINES. Else (CPU, or a GPU trace without kernels) the "/host:CPU" plane's events that carry an
    `hlo_op` stat (XLA's thunks), on any thread. Events with no duration and no name are dropped.
    """
    planes = list(profile.planes)
    gpu = [p for p in planes if p.name.startswith("/device:GPU")]
    plane, name, events, counts = None, "none", [], {}
    for p in gpu:
        per_line = {line.name: _events(line) for line in p.lines}
        if any(per_line.values()):
            streams = [n for n in per_line if n.startswith("Stream")] or [n for n in per_line if n not in DERIVED_LINES]
            plane, name, counts = p, p.name, {n: len(v) for n, v in per_line.items()}
            events = [e for n in streams for e in per_line[n]]
            break
    if plane is None:  # CPU (or a GPU trace without kernels): XLA's thunks, the events with an hlo_op stat.
        host = next((p for p in planes if p.name == "/host:CPU"), None)
        if host is not None:
            name = host.name
            for line in host.lines:
                all_events = _events(line)
                counts[line.name] = len(all_events)
                events += [e for e in all_events if "hlo_op" in e["stats"]]
        if gpu:
            name = f"{name} (the GPU plane has no events: host thunk times, not kernels)"
    return name, [e for e in events if e["duration_ns"] > 0 or e["name"]], counts


def _ms(ns: float) -> float:
    return ns / 1e6


def timeline(events: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    """Busy time (union of intervals), idle gaps between busy segments, their histogram and the largest."""
    if not events:
        return {"span_ms_per_step": 0.0, "busy_ms_per_step": 0.0, "idle_ms_per_step": 0.0, "gaps": [], "largest_gaps": []}
    ordered = sorted(events, key=lambda e: e["start_ns"])
    segments = []  # [start, end, first event name, name of the event that ends last]
    for e in ordered:
        start, end = e["start_ns"], e["start_ns"] + e["duration_ns"]
        if segments and start <= segments[-1][1]:
            if end > segments[-1][1]:
                segments[-1][1], segments[-1][3] = end, e["name"]
        else:
            segments.append([start, end, e["name"], e["name"]])
    busy = sum(s[1] - s[0] for s in segments)
    span = segments[-1][1] - segments[0][0]
    gaps = [(b[0] - a[1], a[3], b[2]) for a, b in zip(segments, segments[1:])]
    edges = (0, *GAP_BUCKETS_US, float("inf"))
    buckets = []
    for lo, hi in zip(edges, edges[1:]):
        inside = [g for g, _, _ in gaps if lo * 1e3 <= g < hi * 1e3]
        label = f"{lo}-{hi} us" if hi != float("inf") else f">= {lo} us"
        buckets.append({"range": label, "count_per_step": len(inside) / steps, "ms_per_step": _ms(sum(inside)) / steps})
    largest = sorted(gaps, reverse=True)[:6]
    return {
        "span_ms_per_step": _ms(span) / steps,
        "busy_ms_per_step": _ms(busy) / steps,
        "idle_ms_per_step": _ms(span - busy) / steps,
        "kernel_sum_ms_per_step": _ms(sum(e["duration_ns"] for e in events)) / steps,
        "busy_segments_per_step": len(segments) / steps,
        "gaps": buckets,
        "largest_gaps": [{"us": g / 1e3, "after": a[:100], "before": b[:100]} for g, a, b in largest],
    }


def summarize_profile(events: list[dict[str, Any]], steps: int, hlo: dict[str, dict[str, str]], top: int) -> dict[str, Any]:
    """Kernels, HLO instructions, model scopes and categories by total time per step; the timeline."""
    total = sum(e["duration_ns"] for e in events) or 1
    kernels: dict[str, list] = collections.defaultdict(lambda: [0, 0, set()])
    ops: dict[str, list] = collections.defaultdict(lambda: [0, 0, set()])
    scopes, cats = collections.Counter(), collections.Counter()
    cat_counts, mapped = collections.Counter(), collections.Counter()
    for e in events:
        op = e["stats"].get("hlo_op")
        if isinstance(op, str) and op in hlo:
            mapped["hlo_op"] += 1
        else:
            # Inside a CUDA graph every kernel's hlo_op is the command buffer; XLA's own kernels are named after
            # their instruction, "." as "_" (loop_add_fusion_3 is loop_add_fusion.3). Library kernels stay unmapped.
            by_name = next((n for n in (e["name"], re.sub(r"_(\d+)$", r".\1", e["name"])) if n in hlo), None)
            mapped["kernel_name" if by_name else "none"] += 1
            op = by_name or op
        info = hlo.get(op) if op else None
        cat = category(e["name"], info)
        cats[cat] += e["duration_ns"]
        cat_counts[cat] += 1
        k = kernels[e["name"]]
        k[0], k[1] = k[0] + e["duration_ns"], k[1] + 1
        if op:
            k[2].add(op)
            o = ops[op]
            o[0], o[1] = o[0] + e["duration_ns"], o[1] + 1
            o[2].add(e["name"])
            scopes[scope_of(info)] += e["duration_ns"]

    def row(name: str, ns: int, count: int) -> dict[str, Any]:
        return {"name": name, "count_per_step": count / steps, "ms_per_step": _ms(ns) / steps, "share": ns / total}

    top_kernels = []
    for name, (ns, count, hlo_ops) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]:
        r = row(name, ns, count)
        first = hlo.get(min(hlo_ops)) if hlo_ops else None
        r.update(category=category(name, first), hlo_ops=sorted(hlo_ops)[:5], num_hlo_ops=len(hlo_ops))
        top_kernels.append(r)
    # The same computation in every layer is one group: category, what runs, result shape, fwd/bwd, source, primitive.
    groups: dict[str, list] = collections.defaultdict(lambda: [0, 0, set()])
    for name, (ns, count, names) in ops.items():
        info = hlo.get(name)
        if info is None:
            continue
        primitive = info.get("op_name", "").rsplit("/", 1)[-1]
        what = info.get("target") or info.get("opcode", "?")
        key = (f"{category(min(names), info):9} {what} {info.get('shape', '')} | {scope_of(info)} | "
               f"{primitive}")
        g = groups[key]
        g[0], g[1] = g[0] + ns, g[1] + count
        g[2].add(name)
    top_groups = [dict(row(key, ns, count), instructions=len(names), example=min(names))
                  for key, (ns, count, names) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]]
    top_ops = []
    for name, (ns, count, names) in sorted(ops.items(), key=lambda kv: -kv[1][0])[:top]:
        info = hlo.get(name, {})
        r = row(name, ns, count)
        r.update(category=category(min(names), info or None), opcode=info.get("opcode", "?"), target=info.get("target", ""),
                 shape=info.get("shape", ""), op_name=info.get("op_name", ""), source=info.get("source", ""),
                 kernels=sorted(names)[:3])
        top_ops.append(r)
    return {
        "events": len(events),
        "events_with_hlo_op": sum(c for _, c, _ in ops.values()),
        "categories": {c: {"ms_per_step": _ms(cats[c]) / steps, "share": cats[c] / total,
                           "count_per_step": cat_counts[c] / steps} for c in CATEGORIES},
        "timeline": timeline(events, steps),
        "top_kernels": top_kernels,
        "top_hlo_ops": top_ops,
        "top_op_groups": top_groups,
        "mapped_by": dict(mapped),
        "scopes": [{"scope": s, "ms_per_step": _ms(ns) / steps, "share": ns / total} for s, ns in scopes.most_common(top)],
        "distinct_kernels": len(kernels),
        "distinct_hlo_ops": len(ops),
    }


def profile_file(path: str, steps: int, hlo: dict[str, dict[str, str]], top: int,
                 window_ns: tuple[int, int] | None = None) -> dict[str, Any]:
    """Reads one `.xplane.pb` and summarizes its device (or CPU) timeline.

    `window_ns`: the host's `time.time_ns()` just before the first traced step was dispatched and just after
    its last loss was ready (the profiler stamps events on the same clock): gives the lead (dispatch to first
    kernel) and the tail (last kernel to the host seeing the result).
    """
    start = time.perf_counter()
    from jax.profiler import ProfileData  # Here, not at import: importing this module starts no JAX.

    data = pathlib.Path(path).read_bytes()  # A missing file raises OSError, a corrupt one RuntimeError.
    profile = ProfileData.from_serialized_xspace(data)
    plane_name, events, line_counts = device_events(profile)
    summary = summarize_profile(events, steps, hlo, top)
    # The session normalizes line timestamps to its start, which "Task Environment" keeps (ns since the epoch).
    environment = profile.find_plane_with_name("Task Environment")
    start_ns = _stats(environment.stats).get("profile_start_time") if environment is not None else None
    if window_ns and events and isinstance(start_ns, int):
        first = start_ns + min(e["start_ns"] for e in events)
        last = start_ns + max(e["start_ns"] + e["duration_ns"] for e in events)
        summary["timeline"].update(lead_ms=(first - window_ns[0]) / 1e6, tail_ms=(window_ns[1] - last) / 1e6,
                                   window_ms=(window_ns[1] - window_ns[0]) / 1e6)
    stat_keys = collections.Counter(k for e in events for k in e["stats"])
    modules = collections.defaultdict(list)
    plane = profile.find_plane_with_name(plane_name)
    for line in plane.lines if plane is not None else ():
        if line.name == "XLA Modules":
            for e in line.events:
                modules[e.name].append(_ms(e.duration_ns))
    summary.update(
        file=path, file_bytes=len(data), plane=plane_name, lines=line_counts, event_stat_keys=dict(stat_keys.most_common(20)),
        hlo_op_values=dict(collections.Counter(str(e["stats"].get("hlo_op")) for e in events).most_common(5)),
        xla_modules={n: {"count": len(d), "mean_ms": sum(d) / len(d)} for n, d in modules.items()},
        parse_s=time.perf_counter() - start,
    )
    return summary
