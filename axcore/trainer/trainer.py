"""The training loop: jit-compiled steps with explicit shardings, eval, checkpoints, logs.

Train state (a plain dict, so every checkpoint backend can store it):
`{"params", "opt_state", "step": int32 [], "prng_key": uint32 key data}`. The step's
randomness is `fold_in(prng_key, step)`, and the input iterator's position is saved
with each checkpoint, so a resumed run computes exactly what an uninterrupted one
would have.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import pathlib
import sys
import time
from typing import Any, TextIO

import jax
import jax.numpy as jnp
import numpy as np
import optax
import yaml

from axcore.data import ByteTokenizer, Split
from axcore.errors import AxcoreError
from axcore.experiment import Experiment
from axcore.module import functional
from axcore.observe import JsonlWriter, MultiWriter, ProgressBar, TensorBoardWriter, plot_loss_curve
from axcore.sharding import batch_sharding, make_mesh, parameter_shardings
from axcore.trainer.learner import build_optimizer
from axcore.trainer.sampling import sample_tokens


class NonFiniteLossError(AxcoreError):
    """The training loss became NaN or infinite."""


@dataclasses.dataclass
class TrainResult:
    run_dir: pathlib.Path
    # Steps completed (including those of a resumed run).
    step: int
    # Last training loss, or None if no step ran.
    train_loss: float | None
    # Held-out cross-entropy (nats per token) of the last evaluation, or None.
    eval_loss: float | None
    # Text sampled at the end ("" if disabled).
    sample: str


def _flatten_scalars(tree: dict, prefix: str) -> dict[str, jax.Array]:
    out = {}
    for key, value in tree.items():
        name = f"{prefix}/{key}"
        if isinstance(value, dict):
            out.update(_flatten_scalars(value, name))
        else:
            out[name] = jnp.mean(value)  # Stacked (scanned) summaries are averaged.
    return out


class Trainer:
    """Runs an `Experiment`'s training job."""

    def __init__(self, experiment: Experiment, *, stream: TextIO | None = None, out: TextIO | None = None):
        self.experiment = experiment
        self.cfg = experiment.config
        # Progress and logs.
        self.stream = stream or sys.stderr
        # Results (the sample).
        self.out = out or sys.stdout
        self.run_dir = pathlib.Path(
            self.cfg.trainer.run_dir
            or f"runs/{self.cfg.name}-{datetime.datetime.now(datetime.timezone.utc):%Y%m%d-%H%M%S}"
        )
        self.mesh = make_mesh(self.cfg.mesh.mesh_shape, self.cfg.mesh.mesh_axis_names)
        self.model = self.cfg.model.instantiate(name="model", registries=experiment.registries)
        specs = self.model.parameter_specs()
        tcfg = self.cfg.trainer
        self.optimizer, self.schedule = build_optimizer(tcfg.learner, specs, tcfg.max_steps)
        self.batch_sharding = batch_sharding(self.mesh)
        param_shardings = parameter_shardings(specs, self.cfg.mesh.axis_rules or {}, self.mesh)
        self.state_shardings = self._state_shardings(param_shardings)

    # -- State ------------------------------------------------------------------------

    def _init_state(self, key_data: jax.Array) -> dict:
        params = self.model.initialize(jax.random.wrap_key_data(key_data))
        return {
            "params": params,
            "opt_state": self.optimizer.init(params),
            "step": jnp.zeros((), jnp.int32),
            "prng_key": key_data,
        }

    def _state_shardings(self, param_shardings: Any) -> dict:
        replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        key_data = jax.random.key_data(jax.random.key(0))
        abstract = jax.eval_shape(self._init_state, key_data)
        opt = optax.tree_map_params(
            self.optimizer,
            lambda _, sharding: sharding,
            abstract["opt_state"],
            param_shardings,
            transform_non_params=lambda _: replicated,
        )
        return {"params": param_shardings, "opt_state": opt, "step": replicated, "prng_key": replicated}

    def abstract_state(self) -> dict:
        """The train state as ShapeDtypeStructs carrying their target shardings."""
        key_data = jax.random.key_data(jax.random.key(0))
        abstract = jax.eval_shape(self._init_state, key_data)
        return jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, self.state_shardings
        )

    def init_state(self) -> dict:
        key_data = jax.random.key_data(jax.random.key(self.cfg.trainer.seed))
        return jax.jit(self._init_state, out_shardings=self.state_shardings)(key_data)

    # -- Steps ------------------------------------------------------------------------

    def _train_step(self, state: dict, batch: dict) -> tuple[dict, dict]:
        key = jax.random.fold_in(jax.random.wrap_key_data(state["prng_key"]), state["step"])

        def loss_fn(params):
            (loss, metrics), collection = functional(self.model, params, (batch,), key, True)
            return loss, (metrics, collection.summaries)

        (loss, (metrics, summaries)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
        updates, opt_state = self.optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        new_state = dict(state, params=params, opt_state=opt_state, step=state["step"] + 1)
        finite = jnp.isfinite(loss) & jnp.all(jnp.stack([jnp.all(jnp.isfinite(p)) for p in jax.tree.leaves(params)]))
        out = {
            "loss": loss,
            "grad_norm": optax.tree.norm(grads),
            "learning_rate": self.schedule(state["step"]),
            "finite": finite.astype(jnp.float32),
        }
        out.update(metrics)
        out.update(_flatten_scalars(summaries, "summaries"))
        return new_state, out

    def _eval_step(self, params: dict, batch: dict) -> dict:
        (_, metrics), _ = functional(self.model, params, (batch,), None, False)
        return {"xent_sum": metrics["cross_entropy"] * metrics["num_tokens"], "tokens": metrics["num_tokens"]}

    def compiled_train_step(self):
        """The jitted train step (state donated, explicit in/out shardings)."""
        return jax.jit(
            self._train_step,
            in_shardings=(self.state_shardings, self.batch_sharding),
            out_shardings=(self.state_shardings, None),
            donate_argnums=0,
        )

    def evaluate(self, eval_step, params: dict, iterator) -> float:
        """Token-weighted held-out cross-entropy over the first `eval_batches` batches."""
        iterator.set_state({"epoch": 0, "position": 0})  # The same held-out batches every time.
        xent, tokens = 0.0, 0.0
        for _, batch in zip(range(self.cfg.trainer.eval_batches), iterator):
            result = eval_step(params, jax.device_put(batch, self.batch_sharding))
            xent += float(result["xent_sum"])
            tokens += float(result["tokens"])
        return xent / max(tokens, 1.0)

    # -- The run ----------------------------------------------------------------------

    def _save_config(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        data = self.experiment.to_dict()
        (self.run_dir / "config.yaml").write_text(yaml.safe_dump(data, sort_keys=False), "utf-8")
        (self.run_dir / "config.txt").write_text(self.experiment.flat(), "utf-8")

    def run(self) -> TrainResult:
        tcfg = self.cfg.trainer
        self._save_config()
        factory = self.experiment.registries.checkpoint_backends[tcfg.checkpoint.backend]
        backend = factory(
            self.run_dir / "checkpoints",
            keep_last_n=tcfg.checkpoint.keep_last_n,
            async_save=tcfg.checkpoint.async_save,
        )
        train_iter = self.cfg.input.make_iterator(Split.TRAIN)
        eval_iter = self.cfg.input.make_iterator(Split.EVAL) if tcfg.eval_every else None
        state, start = None, 0
        if tcfg.checkpoint.resume and backend.latest_step() is not None:
            state, metadata = backend.restore(self.abstract_state())
            train_iter.set_state(metadata["input"])
            start = int(state["step"])
            print(f"Resumed from step {start} in {self.run_dir}", file=self.stream)
        if state is None:
            state = self.init_state()
        train_step = self.compiled_train_step()
        eval_step = jax.jit(self._eval_step)
        writer = MultiWriter([JsonlWriter(self.run_dir / "metrics.jsonl"), TensorBoardWriter(self.run_dir / "tensorboard")])
        progress = ProgressBar(tcfg.max_steps, stream=self.stream, log_every=tcfg.log_every, start_step=start)
        tokens_per_step = self.cfg.input.batch_size * self.cfg.input.seq_len
        train_loss = eval_loss = None
        try:
            for step in range(start + 1, tcfg.max_steps + 1):
                batch = jax.device_put(next(train_iter), self.batch_sharding)
                t0 = time.perf_counter()
                state, metrics = train_step(state, batch)
                metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
                step_time = time.perf_counter() - t0
                train_loss = metrics["loss"]
                if not metrics.pop("finite"):
                    backend.wait()
                    what = f"loss {train_loss}" if not math.isfinite(train_loss) else "non-finite parameters"
                    raise NonFiniteLossError(
                        f"Training diverged at step {step} ({what}); the run stopped. The last "
                        f"good checkpoint is step {backend.latest_step()} in {self.run_dir / 'checkpoints'}; "
                        f"lower trainer.learner.learning_rate or check the data."
                    )
                record = {f"train/{k}": v for k, v in metrics.items()}
                record["train/tokens_per_sec"] = tokens_per_step / step_time
                record["train/step_time"] = step_time
                if tcfg.eval_every and (step % tcfg.eval_every == 0 or step == tcfg.max_steps):
                    eval_loss = self.evaluate(eval_step, state["params"], eval_iter)
                    record["eval/loss"] = eval_loss
                writer.write(step, record)
                progress.update(step, train_loss, tokens_per_step / step_time, step_time)
                every = tcfg.checkpoint.every_n_steps
                if (every and step % every == 0) or step == tcfg.max_steps:
                    backend.save(step, state, {"input": train_iter.state(), "step": step})
            backend.wait()
        finally:
            progress.close()
            writer.close()
            backend.close()
        if (self.run_dir / "metrics.jsonl").exists():
            plot_loss_curve(self.run_dir / "metrics.jsonl", self.run_dir / "loss.png")
        sample = self._sample(state["params"])
        return TrainResult(self.run_dir, int(state["step"]), train_loss, eval_loss, sample)

    def _sample(self, params: dict) -> str:
        scfg = self.cfg.trainer.sample
        if scfg.num_bytes <= 0:
            return ""
        tokenizer = ByteTokenizer()
        tokens = sample_tokens(
            self.model,
            params,
            tokenizer.encode(scfg.prompt),
            scfg.num_bytes,
            window=self.cfg.input.seq_len,
            temperature=scfg.temperature,
            prng_key=jax.random.key(self.cfg.trainer.seed),
        )
        text = scfg.prompt + tokenizer.decode(np.asarray(tokens))
        print(f"Sample:\n{text}", file=self.out)
        return text
