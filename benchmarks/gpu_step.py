"""GPU step time: axcore against hand-written JAX on a ~1B Llama-shaped decoder (issue 10, item 6).

    python -m benchmarks.gpu_step [--attention auto|xla|cudnn ...] [--batch B] [--seq T] [--layers L]
    python -m benchmarks.gpu_step --smoke          # tiny model on CPU, 2 rounds (CI); numbers mean nothing

The model (`benchmarks.llama_jax.LlamaShape`; full size vocab 32768, d 2048, 16
layers, 16 heads, 8 kv heads, SwiGLU hidden 5632, sequence 2048, batch 8: 0.89B
parameters): pre-RMSNorm (eps 1e-5), rotate-half RoPE (theta 500000), grouped-query
causal attention, SwiGLU, untied head, no learned absolute positions; bfloat16
compute with float32 master weights and AdamW state (lr 3e-3 constant, b1 0.9,
b2 0.95, eps 1e-8, weight decay 0.1 off the norm scales, clipping at global norm 1).
Two contenders, each a full train step (forward, backward, AdamW, state donated):

- `axcore`: `load_experiment(None, ["plugins=[rope,swiglu]", ...])` with the shape,
  `model.compute_dtype=bfloat16` and the rope/norm settings as overrides, the real
  `TrainStep.init_state()` and `TrainStep.compiled_train_step()`;
- `pure_jax`: `benchmarks.llama_jax`, started from a copy of axcore's initial
  parameters, with the hyperparameters and weight-decay mask read from axcore's
  resolved experiment and parameter specs.

`--attention` (one or more phases): `auto` (default) runs whatever kernel axcore
selects and the same implementation in pure JAX; `xla` or `cudnn` forces it for both
(axcore: `model.decoder.layer.self_attention.kernel=<name>`; the `cudnn` kernel is the
`axcore-gpu` plugin's). Each phase runs in a fresh child process (clean peak-memory
counters, device memory freed between phases); a phase that runs out of device
memory is retried at half the batch (`--no-oom-retry` to stop). Inside a phase both
steps are compiled ahead of time from abstract shapes, then each contender runs its
first step, the first-step losses must agree (relative difference <= 1e-2, the
bfloat16 tolerance; the phase fails otherwise), and after `--warmup` steps the
contenders alternate for `--rounds` rounds of `--steps-per-round` steps each (a
round's steps are dispatched back to back and timed together, blocking on the last
loss, as a training loop runs them; the step time is that time over the count).

FLOPs of one step (L layers, d model, H heads, K kv heads, h = d/H, F SwiGLU hidden,
V vocab, B batch, T sequence), model FLOPs only (a rematerialised forward would not count):

    N_matmul  = L (d H h + 2 d K h + H h d + 3 d F) + d V   (q, k, v, o, gate, up, down; head;
                                                            the embedding gather is not counted)
    dense     = 6 N_matmul B T                              (2 forward + 4 backward per weight and token)
    attention = 6 L B T^2 H h                               (q.k^T and p.v: 4 B T^2 H h forward per
                                                            layer, x3 with backward, halved for the
                                                            causal mask: 12 L B T^2 H h * 0.5)
    MFU       = (dense + attention) / step time / peak

The JSON also gives the full-square count (attention 12 L B T^2 H h), as issue 10's table
used. Peak: dense (no sparsity) bfloat16 tensor-core FLOP/s from NVIDIA's data sheets,
matched on the device kind (`PEAK_BF16_TFLOPS`), or `--peak-tflops`; on CPU MFU is null.
What the result holds per contender, and how each peak memory is measured: `benchmarks.gpu_step_result`.

Results: `benchmarks/results/gpu_step_<attention>.json` (smoke: a temporary folder;
`--results-dir` to choose), each naming the machine (device kind, JAX version), and a
printed table. Full mode refuses to run on CPU (a 1B model there takes hours).
Environment of the children: `XLA_PYTHON_CLIENT_MEM_FRACTION=0.9` unless set (JAX's
0.75 default leaves 60 GB of 80 to two resident states); smoke adds
`--xla_backend_optimization_level=0` to XLA_FLAGS like `benchmarks.run --smoke`.
Both are recorded in the JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import pathlib
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

from benchmarks.gpu_step_result import device_memory, phase_result
from benchmarks.llama_jax import SMOKE_SHAPE, LlamaShape
from benchmarks.step_accounting import LOSS_RTOL, table

# First-step losses of the two contenders: same parameters and batch, bfloat16 compute.
ATTENTIONS = ("auto", "xla", "cudnn")
OOM_EXIT = 3
SMOKE_XLA_FLAG = "--xla_backend_optimization_level=0"
MEM_FRACTION = "0.9"


class BenchmarkError(Exception):
    """A phase cannot run as asked (message says why and what to do)."""


# -- One phase (runs in a child process) -------------------------------------------------


def axcore_overrides(shape: LlamaShape, args: argparse.Namespace, attention: str, plugins: list[str]) -> list[str]:
    """`--set` overrides giving axcore's default experiment the benchmark model and learner."""
    overrides = [
        f"plugins=[{','.join(plugins)}]",
        "trainer.learner.schedule.type=constant",
        "trainer.learner.schedule.warmup_steps=0",
        f"model.vocab_size={shape.vocab}",
        f"model.dim={shape.dim}",
        f"model.num_layers={shape.layers}",
        "model.compute_dtype=bfloat16",
        f"model.decoder.layer.self_attention.num_heads={shape.heads}",
        f"model.decoder.layer.self_attention.num_kv_heads={shape.kv_heads}",
        f"model.decoder.layer.feed_forward.hidden_dim={shape.ffn}",
        f"model.decoder.layer.norm.eps={args.norm_eps}",
        f"model.final_norm.eps={args.norm_eps}",
        f"rope.theta={args.rope_theta}",
        f"input.seq_len={shape.seq}",
        f"input.batch_size={shape.batch}",
    ]
    if attention != "auto":
        overrides.append(f"model.decoder.layer.self_attention.kernel={attention}")
    return overrides


def select_attention(experiment, trainer, shape: LlamaShape, attention: str) -> str:
    """The attention kernel axcore runs for the benchmark's problem (as its layers ask the registry)."""
    import jax
    import numpy as np

    from axcore.errors import AxcoreError
    from axcore.kernels import ATTENTION, AttentionProblem
    from axcore.layers.attention import QKV_AXES
    from axcore.platform.sharding import activation_spec

    kernels = experiment.registries.kernels
    names = sorted(k.name for k in kernels.candidates(ATTENTION))
    if attention != "auto" and attention not in names:
        raise BenchmarkError(
            f"--attention {attention}: no attention kernel named '{attention}' is registered (registered: "
            f"{', '.join(names)}). The 'cudnn' kernel comes from the GPU plugin: pip install ./axcore_gpu, with "
            f"JAX for CUDA (e.g. pip install 'jax[cuda12]')."
        )
    dtype = np.dtype(experiment.config.model.compute_dtype)
    q = jax.ShapeDtypeStruct((shape.batch, shape.seq, shape.heads, shape.head_dim), dtype)
    kv = jax.ShapeDtypeStruct((shape.batch, shape.seq, shape.kv_heads, shape.head_dim), dtype)
    rules = experiment.config.mesh.axis_rules or {}
    inputs = (("q", q), ("kv", kv), ("kv", kv))
    specs = tuple(activation_spec(QKV_AXES[which], a.shape, rules, trainer.step.mesh) for which, a in inputs)
    scale = 1.0 / math.sqrt(shape.head_dim)
    problem = AttentionProblem.of(q, kv, mesh=trainer.step.mesh, input_specs=specs, scale=scale, causal=True, site="bench")
    try:
        return kernels.select(ATTENTION, problem, requested=None if attention == "auto" else attention).name
    except AxcoreError as e:
        raise BenchmarkError(f"--attention {attention}: {e}") from e


@dataclasses.dataclass
class Contender:
    """One compiled train step with its own state; `run(n)` runs its next n steps (batch i for step i)."""

    name: str
    # (state, batch) -> (state, loss), the state donated.
    step: Callable[[Any, Any], tuple[Any, Any]]
    state: Any
    batches: list
    num_params: int
    compiled: Any
    jaxpr: Any
    compile_s: dict[str, float]
    attention: str
    losses: list = dataclasses.field(default_factory=list)

    def run(self, count: int) -> float:
        """Seconds per step of `count` steps, blocking on the last loss only."""
        start = time.perf_counter()
        for _ in range(count):
            self.state, loss = self.step(self.state, self.batches[len(self.losses)])
            self.losses.append(loss)
        self.losses[-1].block_until_ready()
        return (time.perf_counter() - start) / count


def _compile(jitted, *abstract) -> tuple[Any, Any, dict[str, float]]:
    """(compiled, jaxpr, seconds) of `jitted` for abstract arguments."""
    start = time.perf_counter()
    traced = jitted.trace(*abstract)
    lowered = traced.lower()
    mid = time.perf_counter()
    compiled = lowered.compile()
    return compiled, traced.jaxpr, {"trace_lower": mid - start, "compile": time.perf_counter() - mid}


def _log(phase: str, message: str) -> None:
    print(f"[gpu_step {phase}] {message}", file=sys.stderr, flush=True)


@dataclasses.dataclass
class Setup:
    """axcore's side of a phase, and what the pure-JAX contender takes from it."""

    # The phase's --attention value.
    attention: str
    experiment: Any
    trainer: Any
    hyper: Any
    plugins: list[str]
    kernel: str
    pure_attention: str
    # Weight decay per parameter, in the pure-JAX layout.
    mask: dict[str, Any]
    compute_dtype: Any
    notes: list[str]


def setup_axcore(args: argparse.Namespace, shape: LlamaShape, attention: str) -> Setup:
    """axcore's experiment and trainer, the attention kernels of both contenders, and the decay mask."""
    import jax
    import numpy as np

    from axcore.experiment import load_experiment
    from axcore.plugin.loading import installed_entry_points
    from axcore.trainer.trainer import Trainer
    from benchmarks import llama_jax
    from benchmarks.step_time import hyper_of

    # The GPU plugin is listed when installed, so its kernels are registered on any platform.
    plugins = ["rope", "swiglu"] + (["gpu"] if "gpu" in installed_entry_points() else [])
    from axcore.errors import AxcoreError

    try:  # A forced kernel no plugin registers is a config error at load.
        experiment = load_experiment(None, axcore_overrides(shape, args, attention, plugins))
    except AxcoreError as e:
        raise BenchmarkError(f"--attention {attention}: {e}") from e
    cfg, hyper, notes = experiment.config, hyper_of(experiment), []
    if cfg.model.final_norm.eps != hyper.norm_eps:
        raise BenchmarkError(f"final norm eps {cfg.model.final_norm.eps} != layer norm eps {hyper.norm_eps}")
    trainer = Trainer(experiment)
    kernel = select_attention(experiment, trainer, shape, attention)
    pure_attention = kernel if kernel in ("xla", "cudnn") else "xla"
    if pure_attention != kernel:
        notes.append(f"axcore selected attention kernel '{kernel}', which pure JAX lacks; pure JAX runs 'xla'.")
    specs = trainer.step.model.parameter_specs()
    leaves = jax.tree.leaves(specs, is_leaf=lambda x: hasattr(x, "weight_decay_scale"))
    scales = {s.weight_decay_scale for s in leaves}
    if not scales <= {0.0, 1.0}:
        raise BenchmarkError(f"weight_decay_scale values {sorted(scales)}: optax's mask takes only 0 or 1")
    mask = llama_jax.from_axcore(specs, lambda spec, _: spec.weight_decay_scale > 0)
    compute_dtype = np.dtype(cfg.model.compute_dtype)
    return Setup(attention, experiment, trainer, hyper, plugins, kernel, pure_attention, mask, compute_dtype, notes)


def run_phase(args: argparse.Namespace, attention: str) -> dict[str, Any]:
    """Builds, checks and times both contenders for one attention setting; returns the result."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks import llama_jax
    from benchmarks.common import alternate
    from benchmarks.pure_jax_model import make_optimizer

    shape = shape_of(args)
    log = lambda message: _log(attention, message)  # noqa: E731
    # axcore first: `load_experiment` sees the backend uninitialised, as under `axcore train` (a platform
    # plugin may set XLA flags there; they then hold for both contenders, which share this process).
    s = setup_axcore(args, shape, attention)
    trainer = s.trainer
    if not args.smoke and jax.default_backend() == "cpu" and not args.allow_cpu:
        raise BenchmarkError("full mode needs a GPU (the 1B model takes hours on CPU); use --smoke or --allow-cpu.")
    if jax.device_count() != 1:
        raise BenchmarkError(
            f"{jax.device_count()} devices are visible; this benchmark compares steps on one device "
            f"(e.g. CUDA_VISIBLE_DEVICES=0)."
        )
    log(f"attention: axcore '{s.kernel}', pure JAX '{s.pure_attention}'; axcore plugins {s.plugins}")

    # Both steps compiled from abstract inputs before any state exists (autotuning scratch comes first).
    ids = jax.ShapeDtypeStruct((shape.batch, shape.seq), jnp.int32)
    abstract = trainer.step.abstract_state()
    ax_ids = jax.ShapeDtypeStruct(ids.shape, ids.dtype, sharding=trainer.step.batch_sharding)
    log("compiling axcore's train step ...")
    ax_compiled = _compile(trainer.step.compiled_train_step(), abstract, {"input_ids": ax_ids, "target_labels": ax_ids})
    log(f"  {ax_compiled[2]}")
    pure_abstract = llama_jax.from_axcore(
        abstract["params"], lambda a, new: jax.ShapeDtypeStruct(_reshaped(a.shape, new), a.dtype)
    )
    optimizer = make_optimizer(pure_abstract, s.hyper, mask=s.mask)
    jitted = llama_jax.make_train_step(optimizer, shape, s.hyper, s.pure_attention, s.compute_dtype)
    log("compiling the pure-JAX train step ...")
    opt_abstract = jax.eval_shape(optimizer.init, pure_abstract)
    pure_compiled = _compile(jitted, pure_abstract, opt_abstract, {"input_ids": ids, "target_labels": ids})
    log(f"  {pure_compiled[2]}")
    memory = {"after_compiles": device_memory()}

    # The same random token batches for both, in the same order.
    rng = np.random.default_rng(0)
    tokens = [
        rng.integers(0, shape.vocab, (shape.batch, shape.seq + 1), dtype=np.int32)
        for _ in range(args.warmup + args.rounds * args.steps_per_round)
    ]
    batches = [{"input_ids": t[:, :-1], "target_labels": t[:, 1:]} for t in tokens]

    # axcore first, alone on the device: its state, a host copy of its initial parameters, its first step.
    state = trainer.step.init_state()
    initial = llama_jax.from_axcore(state["params"], llama_jax.host_copy)  # Before its step donates the state.

    def axcore_step(state, batch):
        state, metrics = ax_compiled[0](state, batch)
        return state, metrics["loss"]

    axcore = Contender(
        "axcore", axcore_step, state, [jax.device_put(b, trainer.step.batch_sharding) for b in batches],
        llama_jax.num_params(state["params"]), *ax_compiled, s.kernel,
    )
    del state
    axcore.run(1)
    memory["after_axcore_first_step"] = device_memory()

    def pure_step(state, batch):
        params, opt_state, loss = pure_compiled[0](*state, batch)
        return (params, opt_state), loss

    params = jax.device_put(initial)
    del initial
    pure = Contender(
        "pure_jax", pure_step, (params, jax.jit(optimizer.init)(params)), [jax.device_put(b) for b in batches],
        llama_jax.num_params(params), *pure_compiled, s.pure_attention,
    )
    del params
    if pure.num_params != axcore.num_params:
        raise BenchmarkError(f"parameter counts differ: axcore {axcore.num_params}, pure JAX {pure.num_params}")
    pure.run(1)
    memory["after_pure_first_step"] = device_memory()
    log(f"first-step losses: axcore {float(axcore.losses[0])}, pure JAX {float(pure.losses[0])}")

    # Warm-up, then alternated timed rounds of `steps_per_round` steps each.
    contenders = {"axcore": axcore, "pure_jax": pure}
    alternate({name: functools.partial(c.run, 1) for name, c in contenders.items()}, args.warmup - 1)
    log(f"timing {args.rounds} rounds of {args.steps_per_round} step(s) per contender ...")
    timed = {name: functools.partial(c.run, args.steps_per_round) for name, c in contenders.items()}
    times = alternate(timed, args.rounds)
    return phase_result(args, shape, s, contenders, times, memory)


def _reshaped(shape: tuple[int, ...], new: tuple[int, ...] | None) -> tuple[int, ...]:
    """`new` (None: `shape` itself) with its -1 resolved against the size of `shape`."""
    if new is None:
        return tuple(shape)
    size, known = math.prod(shape), math.prod(d for d in new if d != -1)
    return tuple(size // known if d == -1 else d for d in new)


# -- Command line and phases ---------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_step", description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny model, 2 rounds, CPU is fine (CI); numbers mean nothing")
    p.add_argument("--attention", nargs="+", choices=ATTENTIONS, default=["auto"], help="one phase each (default auto)")
    add_shape_arguments(p)
    p.add_argument("--warmup", type=int, help="steps per contender before timing, the first one included (default 3)")
    p.add_argument("--rounds", type=int, help="alternated timed rounds (default 10; smoke 2)")
    p.add_argument("--steps-per-round", type=int, help="steps per contender and round, timed together (default 3)")
    p.add_argument("--rope-theta", type=float, default=500000.0, help="rope.theta (default 500000, as Llama 3)")
    p.add_argument("--norm-eps", type=float, default=1e-5, help="RMSNorm eps of every norm (default 1e-5, as Llama)")
    p.add_argument("--peak-tflops", type=float, help="the device's peak in TFLOP/s (default: PEAK_BF16_TFLOPS)")
    p.add_argument("--results-dir", type=pathlib.Path, help="for the JSON (default benchmarks/results; smoke: temp)")
    p.add_argument("--no-oom-retry", dest="oom_retry", action="store_false", help="no retry at half the batch on OOM")
    p.add_argument("--allow-cpu", action="store_true", help="run the full model even on CPU")
    p.add_argument("--phase", choices=ATTENTIONS, help=argparse.SUPPRESS)  # Internal: run this one phase here.
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    args = parser().parse_args(argv)
    defaults = (1, 2, 1) if args.smoke else (3, 10, 3)
    for field, default in zip(("warmup", "rounds", "steps_per_round"), defaults):
        if getattr(args, field) is None:
            setattr(args, field, default)
    if args.warmup < 1 or args.rounds < 1 or args.steps_per_round < 1:
        parser().error("--warmup, --rounds and --steps-per-round must be at least 1")
    return args


def add_shape_arguments(p: argparse.ArgumentParser) -> None:
    """`--vocab`, `--dim`, ... one per `LlamaShape` field; unset ones come from the full or smoke shape (`shape_of`)."""
    for f in dataclasses.fields(LlamaShape):
        p.add_argument(f"--{f.name.replace('_', '-')}", type=int, help=f"model {f.name} (default: the full/smoke shape's)")


def shape_of(args: argparse.Namespace) -> LlamaShape:
    base = SMOKE_SHAPE if args.smoke else LlamaShape()
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(LlamaShape) if getattr(args, f.name) is not None}
    return dataclasses.replace(base, **given)


def phase_main(args: argparse.Namespace) -> int:
    """Child process: one phase, its JSON written (also on failure); exit OOM_EXIT when out of device memory."""
    from benchmarks.common import write_result

    name = f"gpu_step_{args.phase}"
    try:
        result = run_phase(args, args.phase)
    except Exception as e:  # Recorded in the phase's JSON for the parent; the exit status says it.
        message = f"{type(e).__name__}: {e}"
        oom = "RESOURCE_EXHAUSTED" in message or "out of memory" in message.lower()
        if not isinstance(e, BenchmarkError):
            traceback.print_exc()
        print(f"gpu_step: phase {args.phase} failed: {message.splitlines()[0]}", file=sys.stderr)
        row = {"metric": f"[{args.phase}] phase", "value": "OOM" if oom else "FAILED", "passed": False}
        failed = {
            "smoke": args.smoke,
            "attention": {"requested": args.phase},
            "model": dataclasses.asdict(shape_of(args)),
            "error": message[:4000],
            "oom": oom,
            "headlines": [row],
        }
        write_result(name, failed, results_dir=args.results_dir)
        return OOM_EXIT if oom else 1
    write_result(name, result, results_dir=args.results_dir)
    if not result["first_step_losses_agree"]:
        diff = result["first_step_loss_rel_diff"]
        print(f"gpu_step: first-step losses differ by {diff:.2e} (> {LOSS_RTOL}); see the JSON", file=sys.stderr)
        return 1
    return 0


def _child_env(smoke: bool) -> dict[str, str]:
    env = dict(os.environ)
    if smoke and "xla_backend_optimization_level" not in env.get("XLA_FLAGS", ""):
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {SMOKE_XLA_FLAG}".strip()
    if not smoke:
        env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", MEM_FRACTION)
    return env


def run(smoke: bool = False, results_dir: pathlib.Path | None = None, argv: list[str] | None = None) -> dict[str, Any]:
    """Runs each requested phase in a child process; returns `{"phases": {attention: result}, "failed": [...]}`."""
    from benchmarks.common import RESULTS

    argv = list(argv or []) + (["--smoke"] if smoke and "--smoke" not in (argv or []) else [])
    args = parse_args(argv)
    if results_dir is None:
        results_dir = args.results_dir or RESULTS
        if args.smoke and args.results_dir is None:
            results_dir = pathlib.Path(tempfile.mkdtemp(prefix="axcore-gpu-step-"))
    results_dir.mkdir(parents=True, exist_ok=True)
    env, root = _child_env(args.smoke), pathlib.Path(__file__).resolve().parent.parent
    phases, failed = {}, []
    for attention in dict.fromkeys(args.attention):
        path = results_dir / f"gpu_step_{attention}.json"
        batch, reduced = shape_of(args).batch, []
        while True:
            path.unlink(missing_ok=True)  # Never read an older run's file as this one's.
            extra = ["--phase", attention, "--batch", str(batch), "--results-dir", str(results_dir)]
            command = [sys.executable, "-m", "benchmarks.gpu_step", *argv, *extra]
            _log(attention, f"batch {batch}: python {' '.join(command[1:])}")
            code = subprocess.run(command, env=env, cwd=root, check=False).returncode
            if code != OOM_EXIT or not args.oom_retry or batch == 1:
                break
            reduced.append(batch)
            batch //= 2
        if not path.exists():
            data = {"error": f"the phase wrote no result (exit status {code})"}
        else:
            data = json.loads(path.read_text())
            if reduced:
                data["batch_reduced_from"] = reduced
                data.setdefault("notes", []).append(f"out of device memory at batch {reduced}; ran at batch {batch}.")
                path.write_text(json.dumps(data, indent=2) + "\n")
        if code != 0:
            failed.append(attention)
        phases[attention] = data
    print(table(phases))
    print(f"Results: {results_dir}", file=sys.stderr)
    return {"phases": phases, "failed": failed, "results_dir": str(results_dir)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.phase is not None:
        return phase_main(args)
    return 1 if run(argv=argv)["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
