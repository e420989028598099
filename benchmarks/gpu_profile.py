"""Where the GPU train step spends its time: a device-timeline profile of `gpu_step`'s contenders.

    python -m benchmarks.gpu_profile [--attention auto|xla|cudnn] [--contender axcore pure_jax] [--steps 3]
                                     [--top 40] [--no-command-buffers] [gpu_step's shape flags: --batch ...]
    python -m benchmarks.gpu_profile --smoke   # tiny model on CPU, 1 step each (CI); numbers mean nothing

Builds the contenders exactly as `benchmarks.gpu_step` does (its `setup_axcore`, its
`_compile` of axcore's real `Trainer` step and of the `benchmarks.llama_jax` step,
both ahead of time), runs `--warmup` steps of each, times `--steps` steps outside any
trace (wall time per step), then records `--steps` more steps of each contender under
`jax.profiler.trace` (one trace each) and reads the `*.xplane.pb` through
`jax.profiler.ProfileData` (`benchmarks.profile_summary`; no tensorboard or xprof).

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
import glob
import os
import pathlib
import sys
import tempfile
import time
from typing import Any

from benchmarks.profile_summary import hlo_instructions, profile_file

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
    abstract = trainer.step.abstract_state()
    rng = np.random.default_rng(0)
    tokens = [rng.integers(0, shape.vocab, (shape.batch, shape.seq + 1), dtype=np.int32) for _ in range(batches_needed)]
    batches = [{"input_ids": t[:, :-1], "target_labels": t[:, 1:]} for t in tokens]
    contenders, info = {}, {"axcore_kernel": s.kernel, "pure_jax_attention": s.pure_attention, "notes": list(s.notes),
                            "shape": {**shape.__dict__}}
    if "axcore" in args.contender:
        ax_ids = jax.ShapeDtypeStruct(ids.shape, ids.dtype, sharding=trainer.step.batch_sharding)
        _log("compiling axcore's train step ...")
        ax_compiled = gpu_step._compile(trainer.step.compiled_train_step(), abstract, {"input_ids": ax_ids, "target_labels": ax_ids})
    if "pure_jax" in args.contender:
        pure_abstract = llama_jax.from_axcore(
            abstract["params"], lambda a, new: jax.ShapeDtypeStruct(gpu_step._reshaped(a.shape, new), a.dtype)
        )
        optimizer = make_optimizer(pure_abstract, s.hyper, mask=s.mask)
        jitted = llama_jax.make_train_step(optimizer, shape, s.hyper, s.pure_attention, s.compute_dtype)
        _log("compiling the pure-JAX train step ...")
        opt_abstract = jax.eval_shape(optimizer.init, pure_abstract)
        pure_compiled = gpu_step._compile(jitted, pure_abstract, opt_abstract, {"input_ids": ids, "target_labels": ids})
    state = trainer.step.init_state()
    initial = llama_jax.from_axcore(state["params"], llama_jax.host_copy) if "pure_jax" in args.contender else None
    if "axcore" in args.contender:

        def axcore_step(state, batch):
            state, metrics = ax_compiled[0](state, batch)
            return state, metrics["loss"]

        contenders["axcore"] = gpu_step.Contender(
            "axcore", axcore_step, state, [jax.device_put(b, trainer.step.batch_sharding) for b in batches],
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
    except Exception as e:  # The other contender's profile still prints; the JSON says what failed.
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
    from benchmarks.gpu_step_result import ENV_KEYS

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
               "env": {k: os.environ.get(k) for k in ENV_KEYS}, "contenders": results,
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
