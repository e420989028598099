"""Where the GPU train step spends its time: a device-timeline profile of `gpu_step`'s contenders.

    python -m benchmarks.gpu_profile [--attention auto|xla|cudnn] [--contender axcore pure_jax] [--steps 3]
                                     [--top 40] [--no-command-buffers] [gpu_step's shape flags: --batch ...]
    python -m benchmarks.gpu_profile --smoke   # tiny model on CPU, 1 step each (CI); numbers mean nothing

Builds the contenders exactly as `benchmarks.gpu_step` does (its `setup_axcore`, its
`_compile` of axcore's real `Trainer` step and of the `benchmarks.llama_jax` step,
both ahead of time), runs `--warmup` steps of each, times `--steps` steps outside any
trace (wall time per step), then records `--steps` more steps of each contender under
`jax.profiler.trace` (one trace each) and reads the `*.xplane.pb` itself with the
small protobuf wire-format decoder in `benchmarks.xplane` (no tensorboard, xprof or generated classes).

Per contender it reports, per step: the device's busy time (union of all kernel
intervals on the device plane's stream lines; on CPU, the XLA op events of the host
plane), the idle time between kernels (first kernel to last, less busy: launch and
synchronisation overhead, inter-step gaps included) with a histogram of gap sizes and
the largest gaps, the time from dispatching the first traced step to its first kernel
(lead) and from the last kernel to the host holding the loss (tail), the top `--top`
kernels by total time, a summary by category (gemm, attention, fusion, collective,
memcpy, other), and the kernels mapped to the compiled step's HLO instructions (by
their `hlo_op` stat, or by name: XLA's own kernels are named after their instruction),
grouped across layers by what runs, result shape, forward/backward (a `transpose(` in
the `op_name`) and source line (the HLO's stack frames), which says which part of the
model a fusion or GEMM is. XLA runs the GPU step as a CUDA graph (command buffer),
whose kernels all carry `hlo_op=command_buffer_N`: cuBLAS and cuDNN kernels then map
to no instruction, and XLA's kernels map by name, where identical fusions that share
one compiled kernel all count under its first instruction (its source line and
fwd/bwd); `--no-command-buffers` (adds `--xla_gpu_enable_command_buffer=`
to XLA_FLAGS) runs them one by one so every kernel maps, at a slightly different cost.

JSON: `--results-dir` (default benchmarks/results) / `gpu_profile_<attention>.json`;
smoke: a temporary folder. One process, one attention setting (no OOM retry: pass a
smaller `--batch`). Smoke adds `--xla_backend_optimization_level=0` to XLA_FLAGS as
`gpu_step --smoke` does (set before JAX starts); full mode sets
`XLA_PYTHON_CLIENT_MEM_FRACTION=0.9` unless set.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import pathlib
import re
import sys
import tempfile
import time
from typing import Any

from benchmarks.xplane import parse_xspace

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


def device_events(planes: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]], dict[str, int]]:
    """(plane name, kernel/op events, event count per line) of the first GPU device plane, else the host's XLA ops."""
    gpu = [p for p in planes if p["name"].startswith("/device:GPU")]
    if gpu and any(line["events"] for p in gpu for line in p["lines"]):
        plane = next(p for p in gpu if any(line["events"] for line in p["lines"]))
        lines = [line for line in plane["lines"] if line["name"].startswith("Stream")] or [
            line for line in plane["lines"] if line["name"] not in DERIVED_LINES
        ]
        events = [dict(e, line=line["name"]) for line in lines for e in line["events"]]
    else:  # CPU (or a GPU trace without kernels): XLA's thunks, the events with an hlo_op stat, on any thread.
        plane = next((p for p in planes if p["name"] == "/host:CPU"), {"name": "none", "lines": []})
        if gpu:
            plane = dict(plane, name=f"{plane['name']} (the GPU plane has no events: host thunk times, not kernels)")
        events = [dict(e, line=line["name"]) for line in plane["lines"] for e in line["events"] if "hlo_op" in e["stats"]]
    counts = {line["name"]: len(line["events"]) for line in plane["lines"]}
    events = [dict(e, abs_start_ns=plane.get("base_ns", 0) + e["start_ps"] / 1000) for e in events]
    return plane["name"], [e for e in events if e["duration_ps"] > 0 or e["name"]], counts


def _ms(ps: float) -> float:
    return ps / 1e9


def timeline(events: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    """Busy time (union of intervals), idle gaps between busy segments, their histogram and the largest."""
    if not events:
        return {"span_ms_per_step": 0.0, "busy_ms_per_step": 0.0, "idle_ms_per_step": 0.0, "gaps": [], "largest_gaps": []}
    ordered = sorted(events, key=lambda e: e["start_ps"])
    segments = []  # [start, end, first event name, name of the event that ends last]
    for e in ordered:
        start, end = e["start_ps"], e["start_ps"] + e["duration_ps"]
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
        inside = [g for g, _, _ in gaps if lo * 1e6 <= g < hi * 1e6]
        label = f"{lo}-{hi} us" if hi != float("inf") else f">= {lo} us"
        buckets.append({"range": label, "count_per_step": len(inside) / steps, "ms_per_step": _ms(sum(inside)) / steps})
    largest = sorted(gaps, reverse=True)[:6]
    return {
        "span_ms_per_step": _ms(span) / steps,
        "busy_ms_per_step": _ms(busy) / steps,
        "idle_ms_per_step": _ms(span - busy) / steps,
        "kernel_sum_ms_per_step": _ms(sum(e["duration_ps"] for e in events)) / steps,
        "busy_segments_per_step": len(segments) / steps,
        "gaps": buckets,
        "largest_gaps": [{"us": g / 1e6, "after": a[:100], "before": b[:100]} for g, a, b in largest],
    }


def summarize_profile(events: list[dict[str, Any]], steps: int, hlo: dict[str, dict[str, str]], top: int) -> dict[str, Any]:
    """Kernels, HLO instructions, model scopes and categories by total time per step; the timeline."""
    total = sum(e["duration_ps"] for e in events) or 1
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
        cats[cat] += e["duration_ps"]
        cat_counts[cat] += 1
        k = kernels[e["name"]]
        k[0], k[1] = k[0] + e["duration_ps"], k[1] + 1
        if op:
            k[2].add(op)
            o = ops[op]
            o[0], o[1] = o[0] + e["duration_ps"], o[1] + 1
            o[2].add(e["name"])
            scopes[scope_of(info)] += e["duration_ps"]

    def row(name: str, ps: int, count: int) -> dict[str, Any]:
        return {"name": name, "count_per_step": count / steps, "ms_per_step": _ms(ps) / steps, "share": ps / total}

    top_kernels = []
    for name, (ps, count, hlo_ops) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]:
        r = row(name, ps, count)
        first = hlo.get(min(hlo_ops)) if hlo_ops else None
        r.update(category=category(name, first), hlo_ops=sorted(hlo_ops)[:5], num_hlo_ops=len(hlo_ops))
        top_kernels.append(r)
    # The same computation in every layer is one group: category, what runs, result shape, fwd/bwd, source, primitive.
    groups: dict[str, list] = collections.defaultdict(lambda: [0, 0, set()])
    for name, (ps, count, names) in ops.items():
        info = hlo.get(name)
        if info is None:
            continue
        primitive = info.get("op_name", "").rsplit("/", 1)[-1]
        what = info.get("target") or info.get("opcode", "?")
        key = (f"{category(min(names), info):9} {what} {info.get('shape', '')} | {scope_of(info)} | "
               f"{primitive}")
        g = groups[key]
        g[0], g[1] = g[0] + ps, g[1] + count
        g[2].add(name)
    top_groups = [dict(row(key, ps, count), instructions=len(names), example=min(names))
                  for key, (ps, count, names) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]]
    top_ops = []
    for name, (ps, count, names) in sorted(ops.items(), key=lambda kv: -kv[1][0])[:top]:
        info = hlo.get(name, {})
        r = row(name, ps, count)
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
        "scopes": [{"scope": s, "ms_per_step": _ms(ps) / steps, "share": ps / total} for s, ps in scopes.most_common(top)],
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
    data = pathlib.Path(path).read_bytes()
    keep = lambda name: name.startswith(("/device:GPU", "/host:CPU", "Task Environment"))  # noqa: E731
    planes = parse_xspace(data, keep=keep)
    plane_name, events, line_counts = device_events(planes)
    summary = summarize_profile(events, steps, hlo, top)
    # The session normalizes line timestamps to its start, which "Task Environment" keeps (ns since the epoch).
    start_ns = next((p["stats"].get("profile_start_time") for p in planes if p["name"] == "Task Environment"), None)
    if window_ns and events and isinstance(start_ns, int):
        first = start_ns + min(e["abs_start_ns"] for e in events)
        last = start_ns + max(e["abs_start_ns"] + e["duration_ps"] / 1000 for e in events)
        summary["timeline"].update(lead_ms=(first - window_ns[0]) / 1e6, tail_ms=(window_ns[1] - last) / 1e6,
                                   window_ms=(window_ns[1] - window_ns[0]) / 1e6)
    stat_keys = collections.Counter(k for e in events for k in e["stats"])
    modules = collections.defaultdict(list)
    for plane in planes:
        if plane["name"] == plane_name:
            for line in plane["lines"]:
                if line["name"] == "XLA Modules":
                    for e in line["events"]:
                        modules[e["name"]].append(_ms(e["duration_ps"]))
    summary.update(
        file=path, file_bytes=len(data), plane=plane_name, lines=line_counts, event_stat_keys=dict(stat_keys.most_common(20)),
        hlo_op_values=dict(collections.Counter(str(e["stats"].get("hlo_op")) for e in events).most_common(5)),
        xla_modules={n: {"count": len(d), "mean_ms": sum(d) / len(d)} for n, d in modules.items()},
        parse_s=time.perf_counter() - start,
    )
    return summary


# -- Contenders (built by gpu_step's own functions) -----------------------------------------------

CONTENDERS = ("axcore", "pure_jax")
NO_COMMAND_BUFFERS = "--xla_gpu_enable_command_buffer="


def build(args: argparse.Namespace, batches_needed: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """({name: gpu_step.Contender}, info) for `args.contender`, compiled ahead as `gpu_step.run_phase` does."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks import gpu_step, llama_jax
    from benchmarks.pure_jax_model import make_optimizer

    shape = gpu_step.shape_of(args)
    attention = args.attention[0]
    s = gpu_step.setup_axcore(args, shape, attention)
    trainer = s.trainer
    if not args.smoke and jax.default_backend() == "cpu" and not args.allow_cpu:
        raise gpu_step.BenchmarkError("full mode needs a GPU; use --smoke or --allow-cpu.")
    if jax.device_count() != 1:
        raise gpu_step.BenchmarkError(f"{jax.device_count()} devices are visible; use one (CUDA_VISIBLE_DEVICES=0).")
    _log(f"attention: axcore '{s.kernel}', pure JAX '{s.pure_attention}'; plugins {s.plugins}")
    ids = jax.ShapeDtypeStruct((shape.batch, shape.seq), jnp.int32)
    abstract = trainer.abstract_state()
    rng = np.random.default_rng(0)
    tokens = [rng.integers(0, shape.vocab, (shape.batch, shape.seq + 1), dtype=np.int32) for _ in range(batches_needed)]
    batches = [{"input_ids": t[:, :-1], "target_labels": t[:, 1:]} for t in tokens]
    contenders, info = {}, {"axcore_kernel": s.kernel, "pure_jax_attention": s.pure_attention, "notes": list(s.notes),
                            "shape": {**shape.__dict__}}
    if "axcore" in args.contender:
        ax_ids = jax.ShapeDtypeStruct(ids.shape, ids.dtype, sharding=trainer.batch_sharding)
        _log("compiling axcore's train step ...")
        ax_compiled = gpu_step._compile(trainer.compiled_train_step(), abstract, {"input_ids": ax_ids, "target_labels": ax_ids})
    if "pure_jax" in args.contender:
        pure_abstract = llama_jax.from_axcore(
            abstract["params"], lambda a, new: jax.ShapeDtypeStruct(gpu_step._reshaped(a.shape, new), a.dtype)
        )
        optimizer = make_optimizer(pure_abstract, s.hyper, mask=s.mask)
        jitted = llama_jax.make_train_step(optimizer, shape, s.hyper, s.pure_attention, s.compute_dtype)
        _log("compiling the pure-JAX train step ...")
        opt_abstract = jax.eval_shape(optimizer.init, pure_abstract)
        pure_compiled = gpu_step._compile(jitted, pure_abstract, opt_abstract, {"input_ids": ids, "target_labels": ids})
    state = trainer.init_state()
    initial = llama_jax.from_axcore(state["params"], llama_jax.host_copy) if "pure_jax" in args.contender else None
    if "axcore" in args.contender:

        def axcore_step(state, batch):
            state, metrics = ax_compiled[0](state, batch)
            return state, metrics["loss"]

        contenders["axcore"] = gpu_step.Contender(
            "axcore", axcore_step, state, [jax.device_put(b, trainer.batch_sharding) for b in batches],
            llama_jax.num_params(state["params"]), *ax_compiled, s.kernel,
        )
    del state
    if initial is not None:

        def pure_step(state, batch):
            params, opt_state, loss = pure_compiled[0](*state, batch)
            return (params, opt_state), loss

        params = jax.device_put(initial)
        del initial
        contenders["pure_jax"] = gpu_step.Contender(
            "pure_jax", pure_step, (params, jax.jit(optimizer.init)(params)), [jax.device_put(b) for b in batches],
            llama_jax.num_params(params), *pure_compiled, s.pure_attention,
        )
        del params
    return contenders, info


def _log(message: str) -> None:
    print(f"[gpu_profile] {message}", file=sys.stderr, flush=True)


def profile_contender(c: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Wall time per step (untraced), then `--steps` steps under jax.profiler.trace, summarized."""
    import jax

    wall = [c.run(args.steps) for _ in range(2)]
    directory = tempfile.mkdtemp(prefix=f"axcore-gpu-profile-{c.name}-")
    with jax.profiler.trace(directory):
        window = [time.time_ns()]
        traced = c.run(args.steps)
        window.append(time.time_ns())
    files = sorted(glob.glob(f"{directory}/**/*.xplane.pb", recursive=True))
    hlo = hlo_instructions(c.compiled.as_text())
    out = {"steps": args.steps, "wall_ms_per_step": [w * 1e3 for w in wall], "traced_wall_ms_per_step": traced * 1e3,
           "trace_dir": directory, "hlo_instructions": len(hlo), "losses": [float(x) for x in c.losses]}
    if not files:
        return {**out, "error": f"no .xplane.pb under {directory}"}
    try:
        out["profile"] = profile_file(files[-1], args.steps, hlo, args.top, tuple(window))
    except Exception as e:  # noqa: BLE001 -- the other contender's profile still prints; the JSON says what failed.
        out["error"] = f"parsing {files[-1]}: {type(e).__name__}: {e}"
    return out


# -- Report ---------------------------------------------------------------------------------------


def _short(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def report(name: str, r: dict[str, Any], top: int) -> list[str]:
    """The compact table of one contender."""
    wall = min(r["wall_ms_per_step"])
    lines = [f"== {name}: wall {wall:.2f} ms/step (untraced, min of {len(r['wall_ms_per_step'])}; "
             f"traced {r['traced_wall_ms_per_step']:.2f})"]
    if "profile" not in r:
        return lines + [f"   ERROR: {r.get('error')}"]
    p, t = r["profile"], r["profile"]["timeline"]
    lines.append(f"   plane {p['plane']}: {p['events']} events ({p['events_with_hlo_op']} with hlo_op), "
                 f"{p['distinct_kernels']} kernels, parsed in {p['parse_s']:.1f} s; lines: "
                 + ", ".join(f"{_short(k, 28)}={v}" for k, v in list(p["lines"].items())[:8]))
    lines.append(f"   per step: busy {t['busy_ms_per_step']:.2f} ms ({t['busy_ms_per_step'] / wall:.1%} of wall), "
                 f"kernel sum {t.get('kernel_sum_ms_per_step', 0):.2f}, span {t['span_ms_per_step']:.2f}, "
                 f"idle in span {t['idle_ms_per_step']:.2f} ms, outside span {wall - t['span_ms_per_step']:.2f} ms")
    if "lead_ms" in t:
        lines.append(f"   traced window {t['window_ms']:.2f} ms for {r.get('steps', '?')} step(s): dispatch to first kernel "
                     f"{t['lead_ms']:.2f} ms, last kernel to result on host {t['tail_ms']:.2f} ms "
                     f"(in a loop that runs ahead both overlap other steps)")
    lines.append(f"   event stats: {', '.join(list(p['event_stat_keys'])[:8])}; hlo_op values: "
                 + ", ".join(f"{_short(k, 24)}={v}" for k, v in list(p["hlo_op_values"].items())[:3]))
    lines.append("   gaps/step: " + "; ".join(f"{g['range']}: {g['count_per_step']:.0f} = {g['ms_per_step']:.2f} ms"
                                               for g in t["gaps"]))
    for g in t["largest_gaps"][:4]:
        lines.append(f"     gap {g['us']:9.1f} us after {_short(g['after'], 45)} before {_short(g['before'], 45)}")
    lines.append("   categories: " + "; ".join(f"{c} {v['ms_per_step']:.2f} ms {v['share']:.1%} (n={v['count_per_step']:.0f})"
                                              for c, v in p["categories"].items() if v["count_per_step"]))
    if p["xla_modules"]:
        lines.append("   XLA modules: " + "; ".join(f"{_short(n, 40)} x{d['count']} {d['mean_ms']:.2f} ms"
                                                   for n, d in list(p["xla_modules"].items())[:4]))
    lines.append("   top kernels          ms/step  share  n/step  cat        kernel [hlo ops]")
    for k in p["top_kernels"][:top]:
        ops = ",".join(k["hlo_ops"][:2]) + ("+" if k["num_hlo_ops"] > 2 else "")
        lines.append(f"   {k['ms_per_step']:28.3f} {k['share']:6.1%} {k['count_per_step']:7.1f}  {k['category']:10} "
                     f"{_short(k['name'], 60)} [{_short(ops, 30)}]")
    if p["top_op_groups"]:
        m = p.get("mapped_by", {})
        lines.append(f"   top HLO op groups (alike across layers); kernels mapped by hlo_op {m.get('hlo_op', 0)}, by kernel "
                     f"name {m.get('kernel_name', 0)}, unmapped {m.get('none', 0)}"
                     + (" (by name: identical fusions share one kernel, counted under its first instruction)"
                        if m.get("kernel_name") else ""))
        lines.append("      ms/step  share  n/step  #ops  category what result-shape | fwd/bwd source | primitive")
        for g in p["top_op_groups"][: max(1, top // 2)]:
            lines.append(f"   {g['ms_per_step']:10.3f} {g['share']:6.1%} {g['count_per_step']:7.1f} {g['instructions']:5d}  "
                         f"{_short(g['name'], 110)}")
        scopes = [f"{_short(s['scope'], 60)} {s['ms_per_step']:.2f} ms {s['share']:.0%}" for s in p["scopes"][:9]]
        lines.append("   by source line (fwd/bwd from op_name):")
        lines += ["     " + "; ".join(scopes[i : i + 3]) for i in range(0, len(scopes), 3)]
    return lines


# -- Command line ---------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    """gpu_step's parser (shape flags, --attention, --warmup, --results-dir, ...) with this module's flags."""
    from benchmarks import gpu_step

    p = gpu_step.parser()
    p.prog, p.description = "python -m benchmarks.gpu_profile", __doc__.splitlines()[0]
    p.add_argument("--contender", nargs="+", choices=CONTENDERS, default=list(CONTENDERS), help="which to profile")
    p.add_argument("--steps", type=int, help="steps timed and steps traced per contender (default 3; smoke 1)")
    p.add_argument("--top", type=int, default=40, help="kernels and HLO ops listed per contender (default 40)")
    p.add_argument("--no-command-buffers", action="store_true",
                   help=f"add {NO_COMMAND_BUFFERS} to XLA_FLAGS: no CUDA graphs, so every kernel's hlo_op names its "
                   "instruction (cuBLAS/cuDNN calls included); launch gaps then differ from the default's")
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = parser()
    args = p.parse_args(argv)
    if len(args.attention) != 1:
        p.error("--attention takes one value here (one process, one profile)")
    args.steps = args.steps or (1 if args.smoke else 3)
    args.warmup = args.warmup or (1 if args.smoke else 3)
    if args.steps < 1 or args.warmup < 1 or args.top < 1:
        p.error("--steps, --warmup and --top must be at least 1")
    return args


def run(argv: list[str]) -> dict[str, Any]:
    """Builds, warms up, times and profiles the contenders; writes the JSON; prints the table; returns the result."""
    from benchmarks import gpu_step
    from benchmarks.common import RESULTS, write_result

    args = parse_args(argv)
    # Before JAX starts its backend (the flags are read then), as gpu_step's children get them.
    for key, value in gpu_step._child_env(args.smoke).items():
        if os.environ.get(key) != value:
            os.environ[key] = value
    if args.no_command_buffers and NO_COMMAND_BUFFERS not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {NO_COMMAND_BUFFERS}".strip()
    import jax

    start = time.perf_counter()
    contenders, info = build(args, args.warmup + 3 * args.steps)
    for c in contenders.values():  # Warm-up, the first step included.
        c.run(args.warmup)
    _log("first losses: " + ", ".join(f"{n} {float(c.losses[0]):.4f}" for n, c in contenders.items()))
    results = {}
    for name, c in contenders.items():
        _log(f"profiling {name} ({args.steps} steps) ...")
        results[name] = profile_contender(c, args)
    attention = args.attention[0]
    payload = {"smoke": args.smoke, "attention": attention, **info, "steps": args.steps, "warmup": args.warmup,
               "no_command_buffers": args.no_command_buffers,
               "env": {k: os.environ.get(k) for k in gpu_step.ENV_KEYS}, "contenders": results,
               "device_kind": jax.devices()[0].device_kind, "seconds": time.perf_counter() - start}
    results_dir = args.results_dir or (pathlib.Path(tempfile.mkdtemp(prefix="axcore-gpu-profile-")) if args.smoke else RESULTS)
    path = write_result(f"gpu_profile_{attention}", payload, results_dir=results_dir)
    shape = info["shape"]
    print(f"gpu_profile [{attention}] {payload['device_kind']} jax {jax.__version__}: batch {shape['batch']} seq "
          f"{shape['seq']} layers {shape['layers']} dim {shape['dim']}; axcore kernel {info['axcore_kernel']}, pure JAX "
          f"{info['pure_jax_attention']}; {args.steps} traced step(s) each")
    for name, r in results.items():
        print("\n".join(report(name, r, args.top)))
    print(f"JSON: {path}")
    payload["path"] = str(path)
    return payload


def main(argv: list[str] | None = None) -> int:
    result = run(sys.argv[1:] if argv is None else argv)
    return 1 if any("error" in r for r in result["contenders"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
