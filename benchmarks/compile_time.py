"""Compile time: time to first train step for 4, 16 and 64 layers, unrolled and scanned.

Every measurement runs in a fresh Python process (JAX_PLATFORMS=cpu, persistent
compilation cache disabled), so no in-memory or on-disk cache helps. The worker
process builds the experiment (`load_experiment("default" | "scan")` with
`model.num_layers=N`) and a `Trainer`, then measures, with `time.perf_counter`:

- init state: `jax.jit(trainer.step._init_state, out_shardings=...)` (what
  `TrainStep.init_state` runs) split into lower (trace + MLIR), XLA compile, and
  execution;
- train step: `TrainStep.compiled_train_step()` on the real state and a real batch,
  split into lower, XLA compile and the first execution (blocked on);

plus the number and total duration of XLA backend compilations in each phase, from
`jax.monitoring` events. Time to first step = train-step lower + compile + first
execution. The target compares "compile" = lower + XLA compile of the train step
(execution time grows with depth by design, compile time should not when scanned):
scanned 64 layers <= 1.5x scanned 4 layers.

Contenders (variant x layers) are alternated round by round; each subprocess has a
timeout, and a timed-out measurement is reported as such.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import pathlib
import subprocess
import sys
import time
from typing import Any

if __package__ in (None, ""):  # Run as a script (the worker): make `benchmarks` importable.
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from benchmarks.common import pairwise_ratio, summarize, write_result

NAME = "compile_time"
VARIANTS = {"unrolled": "default", "scanned": "scan"}
FULL_LAYERS = (4, 16, 64)
SMOKE_LAYERS = (1, 2)
# Tiny model for smoke mode (the full run uses the default d=256, seq 256, batch 8 model).
SMOKE_OVERRIDES = (
    "model.dim=32",
    "model.decoder.layer.feed_forward.hidden_dim=64",
    "input.seq_len=16",
    "input.batch_size=2",
)
# Smoke mode only checks that the benchmark runs, so it compiles without LLVM
# optimization (about 5x faster on this 2-core machine); the full run uses XLA's defaults.
SMOKE_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
TARGET_RATIO = 1.5
_RESULT_PREFIX = "COMPILE_TIME_RESULT "


# -- the worker (one measurement, in its own process) -------------------------------------


def _worker(variant: str, layers: int, smoke: bool) -> dict[str, Any]:
    t_start = time.perf_counter()
    import jax

    jax.config.update("jax_enable_compilation_cache", False)
    jax.config.update("jax_compilation_cache_dir", None)
    import jax.monitoring

    from axcore.data import Split
    from axcore.experiment import load_experiment
    from axcore.trainer.trainer import Trainer

    t_imported = time.perf_counter()
    compiles: list[float] = []
    traces: list[float] = []

    def listener(event: str, duration: float, **_: Any) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(duration)
        elif event == "/jax/core/compile/jaxpr_trace_duration":
            traces.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listener)

    def phase(fn):
        n_c, n_t = len(compiles), len(traces)
        t0 = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - t0, compiles[n_c:], traces[n_t:]

    overrides = [f"model.num_layers={layers}", *(SMOKE_OVERRIDES if smoke else ())]
    (trainer, setup_s, setup_c, _) = phase(lambda: Trainer(load_experiment(VARIANTS[variant], overrides)))

    # Init state, as TrainStep.init_state runs it, split into its parts.
    key_data = jax.random.key_data(jax.random.key(trainer.cfg.trainer.seed))
    init_jit = jax.jit(trainer.step._init_state, out_shardings=trainer.step.state_shardings)
    init_lowered, init_lower_s, init_lower_c, init_lower_t = phase(lambda: init_jit.lower(key_data))
    init_compiled, init_compile_s, init_compile_c, _ = phase(init_lowered.compile)
    state, init_exec_s, _, _ = phase(lambda: jax.block_until_ready(init_compiled(key_data)))

    # Train step on the real state and a real batch.
    batch = jax.device_put(next(trainer.cfg.input.make_iterator(Split.TRAIN)), trainer.step.batch_sharding)
    step_jit = trainer.step.compiled_train_step()
    lowered, lower_s, lower_c, lower_t = phase(lambda: step_jit.lower(state, batch))
    compiled, compile_s, compile_c, _ = phase(lowered.compile)
    (_, metrics), exec_s, _, _ = phase(lambda: jax.block_until_ready(compiled(state, batch)))
    n_params = sum(x.size for x in jax.tree.leaves(trainer.step.model.abstract_parameters()))
    return {
        "variant": variant,
        "layers": layers,
        "parameters": int(n_params),
        "import_s": t_imported - t_start,
        "setup_s": setup_s,  # load_experiment + Trainer() (includes eval_shape of the init).
        "setup_xla_compiles": len(setup_c),
        "init_lower_s": init_lower_s,
        "init_lower_jaxpr_traces": len(init_lower_t),
        "init_compile_s": init_compile_s,
        "init_xla_compiles": len(init_lower_c) + len(init_compile_c),
        "init_exec_s": init_exec_s,
        "init_total_s": init_lower_s + init_compile_s + init_exec_s,
        "step_lower_s": lower_s,
        "step_lower_jaxpr_traces": len(lower_t),
        "step_compile_s": compile_s,
        "step_xla_compiles": len(lower_c) + len(compile_c),
        "step_first_exec_s": exec_s,
        "step_compile_total_s": lower_s + compile_s,
        "time_to_first_step_s": lower_s + compile_s + exec_s,
        "process_total_s": time.perf_counter() - t_start,
        "loss": float(metrics["loss"]),
    }


# -- the driver ---------------------------------------------------------------------------


def _measure(variant: str, layers: int, smoke: bool, timeout_s: float) -> dict[str, Any]:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    if smoke:
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {SMOKE_XLA_FLAGS}".strip()
    cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), "--worker", variant, str(layers)]
    if smoke:
        cmd.append("--smoke")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return {"variant": variant, "layers": layers, "timed_out": True, "timeout_s": timeout_s}
    wall = time.perf_counter() - t0
    for line in proc.stdout.splitlines():
        if line.startswith(_RESULT_PREFIX):
            result = json.loads(line[len(_RESULT_PREFIX):])
            result["subprocess_wall_s"] = wall
            return result
    raise RuntimeError(
        f"compile_time worker {variant}/{layers} failed (rc {proc.returncode}):\n"
        f"stdout: {proc.stdout[-1000:]}\nstderr: {proc.stderr[-3000:]}"
    )


_SUMMARIZED = (
    "init_lower_s", "init_compile_s", "init_exec_s", "init_total_s", "step_lower_s", "step_compile_s",
    "step_first_exec_s", "step_compile_total_s", "time_to_first_step_s", "setup_s", "process_total_s",
)


def run(smoke: bool = False, results_dir: pathlib.Path | None = None, *, rounds: int | None = None,
        timeout_s: float | None = None) -> dict[str, Any]:
    """Measures every (variant, layers) in fresh processes, alternated; writes compile_time.json."""
    layer_counts = SMOKE_LAYERS if smoke else FULL_LAYERS
    rounds = rounds or (1 if smoke else 3)
    timeout_s = timeout_s or (120.0 if smoke else 600.0)
    contenders = [(v, n) for n in layer_counts for v in VARIANTS]
    raw: dict[str, list[dict]] = {f"{v}/{n}": [] for v, n in contenders}
    timed_out: set[str] = set()
    if smoke:
        # Smoke mode only checks that everything runs: two workers at a time.
        with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
            futures = [(f"{v}/{n}", pool.submit(_measure, v, n, smoke, timeout_s)) for _ in range(rounds) for v, n in contenders]
            for key, future in futures:
                raw[key].append(future.result())
                if raw[key][-1].get("timed_out"):
                    timed_out.add(key)
    else:
        for _ in range(rounds):
            for v, n in contenders:
                key = f"{v}/{n}"
                if key in timed_out:  # Do not spend another full timeout on it.
                    continue
                result = _measure(v, n, smoke, timeout_s)
                raw[key].append(result)
                if result.get("timed_out"):
                    timed_out.add(key)

    table: dict[str, dict[str, Any]] = {}
    for key, results in raw.items():
        ok = [r for r in results if not r.get("timed_out")]
        entry: dict[str, Any] = {"runs": len(results), "timed_out": key in timed_out}
        if ok:
            entry["parameters"] = ok[0]["parameters"]
            entry["step_xla_compiles"] = ok[0]["step_xla_compiles"]
            entry["init_xla_compiles"] = ok[0]["init_xla_compiles"]
            entry["init_lower_jaxpr_traces"] = ok[0]["init_lower_jaxpr_traces"]
            entry["step_lower_jaxpr_traces"] = ok[0]["step_lower_jaxpr_traces"]
            for field in _SUMMARIZED:
                entry[field] = summarize([r[field] for r in ok])
        table[key] = entry

    def med(key: str, field: str) -> float | None:
        entry = table.get(key, {})
        return entry[field]["median"] if field in entry else None

    lo, hi = layer_counts[0], layer_counts[-1]
    scaling: dict[str, Any] = {}
    for v in VARIANTS:
        for field in ("step_compile_total_s", "step_compile_s", "time_to_first_step_s", "init_total_s", "init_compile_s"):
            ok_hi = [r for r in raw[f"{v}/{hi}"] if not r.get("timed_out")]
            ok_lo = [r for r in raw[f"{v}/{lo}"] if not r.get("timed_out")]
            # Round i of both was measured in the same round of the alternation.
            pairs = list(zip(ok_hi, ok_lo)) if len(ok_hi) == len(ok_lo) else []
            scaling[f"{v}/{field}/{hi}_over_{lo}"] = (
                {**pairwise_ratio([a[field] for a, _ in pairs], [b[field] for _, b in pairs]),
                 "ratio_of_medians": med(f"{v}/{hi}", field) / med(f"{v}/{lo}", field)}
                if pairs else None
            )
    entry = scaling[f"scanned/step_compile_total_s/{hi}_over_{lo}"]
    ratio = None if entry is None else entry["median"]
    targets = {
        f"scanned_compile_{hi}_over_{lo}_layers": {
            "target": f"<= {TARGET_RATIO}",
            "metric": "train-step lower + XLA compile, scanned: median over rounds of the per-round ratio",
            "value": ratio,
            "met": ratio is not None and ratio <= TARGET_RATIO,
        }
    }
    data = {
        "smoke": smoke,
        "setup": {
            "model": "default d=256, 4 heads, FFN 1024, vocab 256" if not smoke else f"tiny: {', '.join(SMOKE_OVERRIDES)}",
            "seq_len": 16 if smoke else 256,
            "batch_size": 2 if smoke else 8,
            "layers": list(layer_counts),
            "variants": {v: f"load_experiment({e!r})" for v, e in VARIANTS.items()},
            "rounds": rounds,
            "order": "fresh process per measurement; contenders alternated round by round"
            + (f"; smoke: two processes at a time, XLA_FLAGS={SMOKE_XLA_FLAGS}" if smoke else ", one process at a time"),
            "subprocess_timeout_s": timeout_s,
            "notes": "each measurement in a fresh process, JAX_PLATFORMS=cpu, persistent compilation cache off; "
            "time_to_first_step = train-step lower + XLA compile + first execution",
        },
        "results": table,
        "scaling": scaling,
        "targets": targets,
        "raw": raw,
    }
    write_result(NAME, data, results_dir=results_dir)
    return data


if __name__ == "__main__":
    if len(sys.argv) >= 4 and sys.argv[1] == "--worker":
        out = _worker(sys.argv[2], int(sys.argv[3]), smoke="--smoke" in sys.argv[4:])
        print(_RESULT_PREFIX + json.dumps(out), flush=True)
    else:
        print(json.dumps(run(smoke="--smoke" in sys.argv)["targets"], indent=2))
