"""Step-time overhead: axcore's real train step against pure JAX and Flax NNX.

One decoder (vocab 256, d_model 256, 4 layers, 4 heads, FFN 1024 exact GELU, seq 256,
batch 8, float32, RoPE, pre-RMSNorm, untied head, AdamW with clipping and weight
decay masked off norm scales, constant learning rate), four ways:

- `axcore`: `load_experiment(None, ["plugins=[rope]", ...])`, `TrainStep.init_state()`
  and `TrainStep.compiled_train_step()`, exactly what `axcore train` runs;
- `axcore_scan`: the same through the built-in `scan` experiment (lax.scan stack);
- `pure_jax`: `benchmarks.pure_jax_model`;
- `flax_nnx`: `benchmarks.flax_model` (skipped with a note when flax is missing).

Every contender starts from axcore's initial parameters (copied into its own
layout) and trains on the same batches of the default corpus, so their losses
must agree step by step (the same math); their parameter counts must be equal.
After warm-up the contenders run one step each per round (A B C D A B C D ...);
the result holds each one's median step time and the median of per-round ratios
to pure JAX. Target: axcore / pure JAX <= 1.02.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib.util
import os
import pathlib
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import pure_jax_model as pure
from benchmarks.common import alternate, pairwise_ratio, summarize, timed, write_result
from benchmarks.pure_jax_model import SMOKE_SHAPE, Hyper, ModelShape

TARGET_RATIO = 1.02
# Relative loss difference allowed between contenders after the timed steps.
LOSS_RTOL = 1e-4


def axcore_overrides(shape: ModelShape) -> list[str]:
    """`--set` overrides giving axcore's experiment the benchmark shape and a constant learning rate."""
    return [
        "plugins=[rope]",
        "trainer.learner.schedule.type=constant",
        "trainer.learner.schedule.warmup_steps=0",
        f"model.vocab_size={shape.vocab}",
        f"model.dim={shape.dim}",
        f"model.num_layers={shape.layers}",
        f"model.decoder.layer.self_attention.num_heads={shape.heads}",
        f"model.decoder.layer.feed_forward.hidden_dim={shape.ffn}",
        f"input.seq_len={shape.seq}",
        f"input.batch_size={shape.batch}",
    ]


def hyper_of(experiment) -> Hyper:
    """The contenders' hyperparameters, read from axcore's resolved experiment (so they match)."""
    cfg = experiment.config
    learner = cfg.trainer.learner
    norm = cfg.model.decoder.layer.norm
    return Hyper(
        learning_rate=learner.learning_rate,
        b1=learner.optimizer.b1,
        b2=learner.optimizer.b2,
        eps=learner.optimizer.eps,
        weight_decay=learner.weight_decay,
        max_grad_norm=learner.max_grad_norm,
        rope_theta=experiment.settings["rope"].theta,
        norm_eps=norm.eps,
    )


@dataclasses.dataclass
class Contender:
    """One implementation: `step(batch)` runs one train step on its own state and returns the loss."""

    name: str
    step: Callable[[dict], jax.Array]
    num_params: int
    # `() -> jax.stages.Compiled` of its jitted step (for HLO statistics).
    compiled: Callable[[], Any]
    # Puts a host batch where this contender's step expects it.
    place: Callable[[dict], dict] = lambda batch: {k: jnp.asarray(v) for k, v in batch.items()}
    # axcore contenders: their Trainer, and `() -> the live train state`.
    trainer: Any = None
    state: Callable[[], dict] | None = None


def _abstract_batch(shape: ModelShape) -> dict[str, jax.ShapeDtypeStruct]:
    ids = jax.ShapeDtypeStruct((shape.batch, shape.seq), jnp.int32)
    return {"input_ids": ids, "target_labels": ids}


def _zero_batch(shape: ModelShape) -> dict[str, np.ndarray]:
    ids = np.zeros((shape.batch, shape.seq), np.int32)
    return {"input_ids": ids, "target_labels": ids}


def _axcore_contender(name: str, trainer, state: dict, shape: ModelShape) -> Contender:
    step_fn = trainer.step.compiled_train_step()
    holder = {"state": state}

    def step(batch):
        holder["state"], metrics = step_fn(holder["state"], batch)
        return metrics["loss"]

    return Contender(
        name,
        step,
        pure.num_params(state["params"]),
        # Lowered on the live state, so it hits the cache of the first call (no second compile).
        lambda: step_fn.lower(holder["state"], jax.device_put(_zero_batch(shape), trainer.step.batch_sharding)).compile(),
        place=lambda batch: jax.device_put(batch, trainer.step.batch_sharding),
        trainer=trainer,
        state=lambda: holder["state"],
    )


def _functional_contender(name: str, params: Any, optimizer, step_fn, shape: ModelShape) -> Contender:
    """A contender whose jitted step is `(params, opt_state, batch) -> (params, opt_state, loss)`."""
    holder = {"params": params, "opt_state": optimizer.init(params)}

    def step(batch):
        holder["params"], holder["opt_state"], loss = step_fn(holder["params"], holder["opt_state"], batch)
        return loss

    def compiled():
        abstract = jax.eval_shape(lambda: (holder["params"], holder["opt_state"]))
        return step_fn.lower(*abstract, _abstract_batch(shape)).compile()

    return Contender(name, step, pure.num_params(params), compiled)


def flax_available() -> bool:
    return importlib.util.find_spec("flax") is not None


def build_contenders(shape: ModelShape, *, with_scan: bool = True, with_flax: bool = True) -> tuple[dict[str, Contender], Any]:
    """The contenders, all starting from axcore's initial parameters; and axcore's experiment."""
    from axcore.experiment import load_experiment
    from axcore.trainer.trainer import Trainer

    experiment = load_experiment(None, axcore_overrides(shape))
    hyper = hyper_of(experiment)
    trainer = Trainer(experiment)
    state = trainer.step.init_state()
    initial = pure.from_axcore(state["params"])  # Copies, before axcore's step donates its state.
    contenders = {"axcore": _axcore_contender("axcore", trainer, state, shape)}
    if with_scan:
        scan_trainer = Trainer(load_experiment("scan", axcore_overrides(shape)))
        stacked = {
            **{k: v for k, v in state["params"].items() if k != "decoder"},
            "decoder": {"layer": jax.tree.map(lambda *xs: jnp.stack(xs), *state["params"]["decoder"].values())},
        }
        stacked = jax.tree.map(jnp.array, stacked)
        scan_state = dict(scan_trainer.step.init_state(), params=stacked, opt_state=scan_trainer.step.optimizer.init(stacked))
        scan_state = jax.device_put(scan_state, scan_trainer.step.state_shardings)
        contenders["axcore_scan"] = _axcore_contender("axcore_scan", scan_trainer, scan_state, shape)
    params = jax.tree.map(jnp.array, initial)
    optimizer = pure.make_optimizer(params, hyper)
    contenders["pure_jax"] = _functional_contender("pure_jax", params, optimizer, pure.make_train_step(optimizer, shape, hyper), shape)
    if with_flax and flax_available():
        from flax import nnx

        from benchmarks import flax_model

        model = flax_model.Decoder(shape, hyper, nnx.Rngs(0))
        flax_model.load_pure_params(model, initial)
        _, fparams, foptimizer, fstep = flax_model.functional_step(model, hyper)
        contenders["flax_nnx"] = _functional_contender("flax_nnx", fparams, foptimizer, fstep, shape)
    return contenders, experiment


def corpus_batches(experiment, n: int) -> list[dict]:
    """The first `n` training batches of axcore's input pipeline (host arrays)."""
    from axcore.data import Split

    iterator = experiment.config.input.make_iterator(Split.TRAIN)
    return [next(iterator) for _ in range(n)]


_INSTR = re.compile(r"^\s+(?:ROOT )?%[\w.\-]+ = \S+ ([\w\-]+)\(")


def hlo_summary(compiled) -> dict[str, Any]:
    """XLA's cost analysis and the entry computation's op counts of a compiled step."""
    text = compiled.as_text()
    entry = text[text.index("\nENTRY") :]
    entry = entry[: entry.index("\n}")]
    ops = collections.Counter()
    for line in entry.splitlines():
        m = _INSTR.match(line)
        if m and m.group(1) not in ("parameter", "constant", "tuple", "get-tuple-element", "bitcast"):
            ops[m.group(1)] += 1
    fusion_kinds = collections.Counter(
        re.sub(r"\.\d+$", "", m.group(1)) for m in re.finditer(r"^\s+%([\w.\-]+) = \S+ fusion\(", entry, re.MULTILINE)
    )
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return {
        "xla_flops": float(cost.get("flops", 0.0)),
        "xla_bytes_accessed": float(cost.get("bytes accessed", 0.0)),
        "xla_transcendentals": float(cost.get("transcendentals", 0.0)),
        "entry_ops": sum(ops.values()),
        "entry_op_counts": dict(ops.most_common()),
        "fusion_kinds": dict(fusion_kinds.most_common(12)),
    }


def run(smoke: bool = False, results_dir: pathlib.Path | None = None) -> dict[str, Any]:
    shape = SMOKE_SHAPE if smoke else ModelShape()
    load_start = os.getloadavg()
    warmup, rounds = (1, 2) if smoke else (3, 30)
    contenders, experiment = build_contenders(shape)
    counts = {name: c.num_params for name, c in contenders.items()}
    assert len(set(counts.values())) == 1, f"parameter counts differ: {counts}"
    batches = corpus_batches(experiment, warmup + rounds)
    placed = {name: [c.place(b) for b in batches] for name, c in contenders.items()}
    losses: dict[str, list[jax.Array]] = {name: [] for name in contenders}

    def step_of(name: str) -> Callable[[], float]:
        contender = contenders[name]

        def one() -> float:
            batch = placed[name][len(losses[name])]
            loss = None

            def call():
                nonlocal loss
                loss = contender.step(batch)
                loss.block_until_ready()

            seconds = timed(call)
            losses[name].append(loss)
            return seconds

        return one

    fns = {name: step_of(name) for name in contenders}
    compile_s = {name: timed(fn) for name, fn in fns.items()}  # The first call compiles.
    alternate(fns, warmup - 1)
    times = alternate(fns, rounds)
    curves = {name: [float(x) for x in values] for name, values in losses.items()}
    ref = np.asarray(curves["pure_jax"])
    rel = {name: float(np.max(np.abs(np.asarray(c) - ref) / np.abs(ref))) for name, c in curves.items()}
    step_stats = {name: summarize(t) for name, t in times.items()}
    ratios = {f"{name}/pure_jax": pairwise_ratio(times[name], times["pure_jax"]) for name in contenders if name != "pure_jax"}
    hlo = {name: hlo_summary(c.compiled()) for name, c in contenders.items()}
    notes = []
    if "flax_nnx" not in contenders:
        notes.append("flax is not installed (pip install -e '.[benchmark]'); the Flax NNX contender was skipped.")
    result = {
        "smoke": smoke,
        "load_average_1min": {"start": load_start[0], "end": os.getloadavg()[0]},
        "model": dataclasses.asdict(shape),
        "hyper": dataclasses.asdict(hyper_of(experiment)),
        "num_params": counts,
        "warmup_steps": warmup,
        "rounds": rounds,
        "compile_and_first_step_s": compile_s,
        "step_time_s": step_stats,
        "ratios": ratios,
        "targets": {
            key: {
                "metric": "median of per-round step-time ratios",
                "target": f"<= {TARGET_RATIO}",
                "value": ratios[key]["median"],
                "met": ratios[key]["median"] <= TARGET_RATIO,
            }
            for key in ("axcore/pure_jax", "axcore_scan/pure_jax")
        },
        "final_loss": {name: c[-1] for name, c in curves.items()},
        "loss_max_rel_diff_vs_pure": rel,
        "losses_agree": all(v <= LOSS_RTOL for v in rel.values()),
        "loss_curves": curves,
        "hlo": hlo,
        "notes": notes,
    }
    result["headlines"] = headlines(result)
    write_result("step_time", result, results_dir=results_dir)
    return result


def headlines(result: dict) -> list[dict[str, Any]]:
    """Rows of the summary table."""
    steps, ratios = result["step_time_s"], result["ratios"]
    rows = [
        {"metric": f"{name} step time (median s)", "value": round(s["median"], 4)} for name, s in steps.items()
    ]
    for key, r in ratios.items():
        row = {"metric": f"{key} (median of per-round ratios)", "value": round(r["median"], 4)}
        if key in ("axcore/pure_jax", "axcore_scan/pure_jax"):
            row.update(target=f"<= {TARGET_RATIO}", passed=r["median"] <= TARGET_RATIO)
        rows.append(row)
    rows.append(
        {
            "metric": f"losses agree after {len(result['loss_curves']['pure_jax'])} steps (max rel. diff)",
            "value": f"{max(result['loss_max_rel_diff_vs_pure'].values()):.1e}",
            "target": f"<= {LOSS_RTOL:g}",
            "passed": result["losses_agree"],
        }
    )
    return rows
