"""GPU step variants: axcore's train step in several configurations, alternated in one process (issue 27).

    python -m benchmarks.gpu_variants [--contenders bf16 packed_xla packed_pallas fp8 ...]
        [--layers L --dim D ...] [--rounds R] [--steps-per-round S] [--loss-steps N]
    python -m benchmarks.gpu_variants --smoke      # tiny model on CPU (CI); numbers mean nothing

The model is `benchmarks.gpu_step`'s (0.89B Llama shape, bfloat16 compute, float32
master weights and AdamW state; every dimension settable from the command line as
there). Each contender is axcore's real `Trainer` step built from that experiment plus
its own overrides (`VARIANTS`), with its own state on the device; all are compiled
first, then run their first step, then alternate for `--rounds` rounds of
`--steps-per-round` steps (dispatched back to back, timed together, blocking on the
last loss). Reported per contender: median step time (p10/p90), tokens/s, MFU (causal
attention counted as half, as `gpu_step`), the ratio to the first contender (median
of per-round ratios), the median host time of one step call over the step time (how
far the plain loop runs ahead), the compiled matmuls by dtype (fp8 GEMMs show as
`f8e4m3fn`), the attention custom calls, and peak memory of the process.

Batches: byte tokens of the embedded corpus (`axcore/data/corpus`), so the loss
curves mean something. Packed contenders (`packed_*`) get the same tokens cut into
documents of exponentially distributed length (mean `--doc-mean`, at least 16), with
`segment_ids` (1-based per row) and `positions` restarting at each document, and
labels of -1 on each document's last token. `--loss-steps N` continues the contenders
named by `--loss-contenders` (default bf16 and fp8) to N steps on fresh corpus batches
and records every loss (for "fp8 within 1% of bf16 after 300 steps").

Contenders (`VARIANTS`): see the table in the code; `--pallas-options` sets the Pallas
attention kernel's block sizes for the run (block_q,block_k,block_q_backward,
block_k_backward,num_warps,num_stages). Results: `benchmarks/results/gpu_variants.json`
(`--tag` adds a suffix) and a printed table.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import pathlib
import sys
import time
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from benchmarks.gpu_attention import segments as document_segments
from benchmarks.gpu_step import add_shape_arguments
from benchmarks.llama_jax import LlamaShape

# name -> (extra plugins, extra overrides, packed batches). Overrides apply after gpu_step's.
ATTN = "model.decoder.layer.self_attention.kernel"
VARIANTS: dict[str, tuple[list[str], list[str], bool]] = {
    "bf16": ([], [], False),  # Whatever axcore selects (cuDNN attention on a GPU).
    "bf16_xla": ([], [f"{ATTN}=xla"], False),
    "packed_auto": ([], [], True),  # Packed documents, the kernel axcore selects for segment ids.
    "packed_xla": ([], [f"{ATTN}=xla"], True),
    "packed_pallas": ([], [f"{ATTN}=pallas"], True),
    "bf16_pallas": ([], [f"{ATTN}=pallas"], False),
    "fp8": (["fp8"], [], False),
}
NORM_KERNEL_KEYS = ("model.decoder.layer.norm.kernels.rms_norm", "model.final_norm.kernels.rms_norm")


def _variant(name: str) -> tuple[list[str], list[str], bool]:
    """The contender `name`: a VARIANTS entry, or `norm_<kernel>` (every RMSNorm forced to that kernel)."""
    if name in VARIANTS:
        return VARIANTS[name]
    if name.startswith("norm_"):
        kernel = name.removeprefix("norm_")
        return [], [f"{key}={kernel}" for key in NORM_KERNEL_KEYS], False
    raise SystemExit(f"--contenders: unknown contender '{name}' (known: {', '.join(VARIANTS)}, norm_<kernel>)")


def corpus_tokens() -> Any:
    """The embedded corpus as byte token ids (int32), all books concatenated."""
    import numpy as np

    folder = pathlib.Path(__file__).resolve().parent.parent / "axcore" / "data" / "corpus"
    data = b"".join(p.read_bytes() for p in sorted(folder.glob("*.txt")))
    return np.frombuffer(data, np.uint8).astype(np.int32)


def make_batches(tokens, shape: LlamaShape, count: int, seed: int, doc_mean: float | None) -> list[dict]:
    """`count` batches of random corpus windows; with `doc_mean`, cut into packed documents."""
    import numpy as np

    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(count):
        starts = rng.integers(0, len(tokens) - shape.seq - 1, shape.batch)
        rows = np.stack([tokens[s:s + shape.seq + 1] for s in starts])
        batch = {"input_ids": rows[:, :-1], "target_labels": rows[:, 1:].copy()}
        if doc_mean:
            segments = document_segments(rng, shape.batch, shape.seq, doc_mean)
            starts = np.diff(segments, axis=1, prepend=0) != 0  # A document's first token.
            index = np.broadcast_to(np.arange(shape.seq), segments.shape)
            positions = index - np.maximum.accumulate(np.where(starts, index, 0), axis=1)
            ends = np.concatenate([starts[:, 1:], np.ones((shape.batch, 1), bool)], axis=1)
            batch["target_labels"][ends] = -1  # No label across a document boundary.
            batch["segment_ids"], batch["positions"] = segments, positions.astype(np.int32)
        batches.append(batch)
    return batches


@dataclasses.dataclass
class Variant:
    """One contender: its compiled step, state, batches and what it measured."""

    name: str
    trainer: Any
    compiled: Any
    compile_s: float
    state: Any
    packed: bool
    kernel_choices: dict
    losses: list = dataclasses.field(default_factory=list)
    host_call_s: list = dataclasses.field(default_factory=list)

    def run(self, batches: list, count: int) -> float:
        """Seconds per step of the next `count` steps (batch i for step i), blocking on the last loss."""
        start, first = time.perf_counter(), len(self.losses)
        for i in range(count):
            called = time.perf_counter()
            self.state, metrics = self.compiled(self.state, batches[(first + i) % len(batches)])
            self.host_call_s.append(time.perf_counter() - called)
            self.losses.append(metrics["loss"])
        self.losses[-1].block_until_ready()
        return (time.perf_counter() - start) / count


def set_pallas_options(experiment, options: str | None) -> None:
    """Gives the registered Pallas attention kernel the block sizes `bq,bk,bqb,bkb,warps,stages`."""
    if not options:
        return
    names = ("block_q", "block_k", "block_q_backward", "block_k_backward", "num_warps", "num_stages")
    values = dict(zip(names, (int(v) for v in options.split(","))))
    for kernel in experiment.registries.kernels.candidates("attention"):
        if kernel.name == "pallas":
            kernel.options.update(values)


def build(name: str, args: argparse.Namespace, shape: LlamaShape) -> Variant:
    """Loads, compiles and initializes contender `name`."""
    import jax
    import jax.numpy as jnp

    from axcore.experiment import load_experiment
    from axcore.kernels import record_kernel_choices
    from axcore.plugin.loading import installed_entry_points
    from axcore.trainer.trainer import Trainer
    from benchmarks.gpu_step import axcore_overrides

    plugins, overrides, packed = _variant(name)
    base = ["rope", "swiglu"] + (["gpu"] if "gpu" in installed_entry_points() else [])
    settings = axcore_overrides(shape, args, "auto", base + plugins) + overrides
    settings += [f"trainer.learner.learning_rate={args.learning_rate}"]
    experiment = load_experiment(None, settings)
    set_pallas_options(experiment, args.pallas_options)
    trainer = Trainer(experiment)
    ids = jax.ShapeDtypeStruct((shape.batch, shape.seq), jnp.int32, sharding=trainer.step.batch_sharding)
    fields = ("input_ids", "target_labels") + (("segment_ids", "positions") if packed else ())
    started = time.perf_counter()
    with record_kernel_choices() as choices:
        compiled = trainer.step.compiled_train_step().trace(trainer.step.abstract_state(), dict.fromkeys(fields, ids)).lower().compile()
    seconds = time.perf_counter() - started
    return Variant(name, trainer, compiled, seconds, trainer.step.init_state(), packed, _plain(choices))


def _plain(choices: Any) -> dict:
    """{op: {kernel: number of distinct sites}} of a `record_kernel_choices()` record."""
    return {op: {kernel: len(set(sites)) for kernel, sites in kernels.items()} for op, kernels in choices.items()}


def run(args: argparse.Namespace) -> dict[str, Any]:
    import jax

    from benchmarks.common import alternate
    from benchmarks.gpu_step import shape_of
    from benchmarks.gpu_step_result import device_memory

    shape = shape_of(args)
    if not args.smoke and jax.default_backend() == "cpu":
        raise SystemExit("full mode needs a GPU; use --smoke")
    tokens = corpus_tokens()
    total = args.warmup + args.rounds * args.steps_per_round
    plain = make_batches(tokens, shape, total, 0, None)
    packed = make_batches(tokens, shape, total, 0, args.doc_mean)
    variants, failed = {}, {}
    for name in args.contenders:
        print(f"[gpu_variants] building {name} ...", file=sys.stderr, flush=True)
        try:
            variants[name] = build(name, args, shape)
        except Exception as e:  # A contender that cannot build is reported, the others run.
            failed[name] = f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"
            print(f"[gpu_variants]   failed: {failed[name]}", file=sys.stderr, flush=True)
    on_device = {name: jax.device_put(packed if v.packed else plain, v.trainer.step.batch_sharding) for name, v in variants.items()}
    memory = {"after_builds": device_memory()}
    for name, v in variants.items():
        v.run(on_device[name], args.warmup)
    timed = {name: functools.partial(v.run, on_device[name], args.steps_per_round) for name, v in variants.items()}
    times = alternate(timed, args.rounds)
    memory["after_timing"] = device_memory()
    data = summary(args, shape, variants, times, failed, memory)
    save(args, data)  # Saved now: the loss curves below take longest and must not lose the timings.

    loss_curves = {}
    if args.loss_steps:
        more = make_batches(tokens, shape, args.loss_steps, 1, None)
        for name in [n for n in args.loss_contenders if n in variants and not variants[n].packed]:
            v = variants[name]
            v.losses.clear()
            for i in range(0, args.loss_steps, 50):
                chunk = more[i:i + 50]  # Steps i.. take chunk[0..]: i is a multiple of the chunk's 50.
                v.run(jax.device_put(chunk, v.trainer.step.batch_sharding), len(chunk))
            loss_curves[name] = [float(x) for x in jax.device_get(v.losses)]
    data["loss_curves"] = loss_curves
    if {"bf16", "fp8"} <= set(loss_curves):
        b, f = loss_curves["bf16"], loss_curves["fp8"]
        tail = lambda c: sum(c[-20:]) / len(c[-20:])  # noqa: E731
        data["fp8_loss_rel_diff_last20"] = abs(tail(f) - tail(b)) / tail(b)
    save(args, data)
    return data


def save(args: argparse.Namespace, data: dict[str, Any]) -> None:
    from benchmarks.common import write_result

    write_result("gpu_variants" + (f"_{args.tag}" if args.tag else ""), data, results_dir=args.results_dir)
    print(table(data), flush=True)


def summary(args, shape: LlamaShape, variants: dict, times: dict, failed: dict, memory: dict) -> dict[str, Any]:
    """The result payload of the timed rounds (module docstring)."""
    import jax

    from benchmarks.common import pairwise_ratio, summarize
    from benchmarks.step_accounting import flops_per_step, hlo_matmuls, peak_tflops

    flops = flops_per_step(shape)
    peak, _ = peak_tflops(jax.devices()[0].device_kind, jax.default_backend(), args.peak_tflops)
    first = next(iter(variants), None)
    results = {}
    for name, v in variants.items():
        step = summarize(times[name])
        text = v.compiled.as_text()
        hlo = hlo_matmuls(text)
        save_program(args, name, text)
        host = sorted(v.host_call_s[args.warmup:])
        results[name] = {
            "overrides": _variant(name)[:2],
            "packed": v.packed,
            "kernels": v.kernel_choices,
            "compile_s": v.compile_s,
            "step_time_s": step,
            "tokens_per_s": shape.batch * shape.seq / step["median"],
            "mfu": None if peak is None else flops["total"] / step["median"] / (peak * 1e12),
            "ratio_to_first": pairwise_ratio(times[name], times[first]),
            "host_call_over_step": host[len(host) // 2] / step["median"] if host else None,
            "matmuls": hlo.get("matmuls"),
            "custom_calls": hlo.get("custom_calls"),
            "program": program_shape(text),
        }
    data = {
        "smoke": args.smoke,
        "model": {**dataclasses.asdict(shape), "num_params": shape.num_params()},
        "rounds": args.rounds,
        "steps_per_round": args.steps_per_round,
        "doc_mean": args.doc_mean,
        "pallas_options": args.pallas_options,
        "learning_rate": args.learning_rate,
        "peak_tflops": peak,
        "contenders": results,
        "failed": failed,
        "loss_curves": {},
        "memory": memory,
    }
    return data


def program_shape(text: str) -> dict[str, int]:
    """What the host launches per step, from the compiled HLO: the entry computation's
    instructions (each a thunk: a kernel, a library call or a command buffer) by kind."""
    import re

    entry = text[text.find("\nENTRY "):]
    body = entry[:entry.find("\n}")]
    kinds = re.findall(r"^\s+\S+ = \S+ (\w[\w-]*)\(", body, re.M)
    counts: dict[str, int] = {}
    for kind in kinds:
        counts[kind] = counts.get(kind, 0) + 1
    counts["command_buffer_calls"] = len(re.findall(r"calls=%?command_buffer", body))
    counts["while"] = len(re.findall(r" while\(", text))
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def save_program(args: argparse.Namespace, name: str, text: str) -> None:
    """The compiled HLO of contender `name`, gzipped beside the results (gpu_hlo_<name>.txt.gz)."""
    import gzip

    folder = args.results_dir or pathlib.Path(__file__).resolve().parent / "results"
    folder.mkdir(parents=True, exist_ok=True)
    suffix = f"_{args.tag}" if args.tag else ""
    (folder / f"gpu_hlo_{name}{suffix}.txt.gz").write_bytes(gzip.compress(text.encode()))


def table(data: dict[str, Any]) -> str:
    lines = ["| contender | step s (p10-p90) | tokens/s | MFU | / first | host call / step | attention calls |", "|---|---|---|---|---|---|---|"]
    for name, r in data["contenders"].items():
        s = r["step_time_s"]
        mfu = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        fmha = sum(n for t, n in (r["custom_calls"] or {}).items() if "fmha" in t or "triton" in t.lower())
        lines.append(
            f"| {name} | {s['median']:.4f} ({s['p10']:.4f}-{s['p90']:.4f}) | {r['tokens_per_s']:,.0f} | {mfu} | "
            f"{r['ratio_to_first']['median']:.3f} | {r['host_call_over_step']:.2f} | {fmha} |"
        )
    for name, error in data["failed"].items():
        lines.append(f"| {name} | failed: {error[:120]} | | | | | |")
    if "fp8_loss_rel_diff_last20" in data:
        lines.append(f"fp8 vs bf16 loss (mean of last 20 steps): rel diff {data['fp8_loss_rel_diff_last20']:.4f}")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_variants", description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU (CI); numbers mean nothing")
    p.add_argument("--contenders", nargs="+", default=["bf16", "packed_xla", "packed_pallas", "fp8"])
    add_shape_arguments(p)
    p.add_argument("--warmup", type=int, default=3, help="steps per contender before timing (default 3)")
    p.add_argument("--rounds", type=int, default=5, help="alternated timed rounds (default 5)")
    p.add_argument("--steps-per-round", type=int, default=10, help="steps per contender and round (default 10)")
    p.add_argument("--doc-mean", type=float, default=512.0, help="mean document length of packed batches")
    p.add_argument("--learning-rate", type=float, default=3e-4, help="peak (constant) learning rate")
    p.add_argument("--loss-steps", type=int, default=0, help="continue --loss-contenders to this many steps")
    p.add_argument("--loss-contenders", nargs="+", default=["bf16", "fp8"])
    p.add_argument("--pallas-options", help="Pallas attention bq,bk,bqb,bkb,warps,stages for this run")
    p.add_argument("--rope-theta", type=float, default=500000.0)
    p.add_argument("--norm-eps", type=float, default=1e-5)
    p.add_argument("--peak-tflops", type=float)
    p.add_argument("--tag", help="suffix of the result file's name")
    p.add_argument("--results-dir", type=pathlib.Path)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.smoke:
        args.rounds, args.steps_per_round, args.warmup = 1, 1, 1
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
