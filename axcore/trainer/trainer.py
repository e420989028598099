"""The training loop: jit-compiled steps with explicit shardings, eval, checkpoints, logs.

Train state (a plain dict, so every checkpoint backend can store it):
`{"params", "opt_state", "step": int32 [], "prng_key": uint32 key data}`. The step's
randomness is `fold_in(prng_key, step)`, and the input pipeline's state after the last
consumed batch (every process's data shards, gathered; `axcore.trainer.inputs`) is
saved with each checkpoint, so a resumed run computes exactly what an uninterrupted one
would have. Batches come from `axcore.data.device_loader.DeviceLoader`: each process
builds only its own rows in a background thread; `train/data_wait` is the time the loop
waited for them. Parameters are stored in their `param_dtype` (float32 by default, also
when the model computes in bfloat16), and so is the optimizer state unless the
optimizer says otherwise.

Steps run asynchronously: the host reads metrics back from the device (a "fetch")
only every `log_every` steps and at eval, checkpoint and last steps. A fetch writes
one metrics record (the values of that step, with `step_time` and `tokens_per_sec`
averaged over the steps since the previous fetch), updates the progress display, and
checks the loss and gradient norm of every step since the previous fetch: a
non-finite one stops the run with NonFiniteLossError naming that step, before any
checkpoint of a later state is saved.
"""

from __future__ import annotations

import dataclasses
import datetime
import io
import math
import pathlib
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils

from axcore.data import Split
from axcore.data.device_loader import DeviceLoader, shard_layout
from axcore.data.schema import BATCH_SCHEMA
from axcore.distributed import is_primary
from axcore.errors import AxcoreError, ConfigError
from axcore.experiment import Experiment
from axcore.kernels import describe_kernel_choices, op_environment, record_kernel_choices
from axcore.module import functional
from axcore.observe import MultiWriter, ProgressBar, plot_loss_curve
from axcore.observe.factories import JsonlWriterFactory
from axcore.sharding import batch_sharding, check_batch_size, make_mesh, parameter_shardings, resolve_rules
from axcore.trainer.config import make_checkpoint_backend
from axcore.trainer.evaluate import EvalTotals, accumulate_step, run_evaluation
from axcore.trainer.inputs import DataWaitMeter, gather_input_state, input_pipeline, restore_input_state
from axcore.trainer.memory_check import check_compiled_memory, check_state_memory
from axcore.generation import Generator, Sampling
from axcore.trainer.interrupt import InterruptGuard, RunInterrupted, abort, interrupted, resume_command
from axcore.trainer.run_dir import RunDirectory, RunDirectoryError
from axcore.trainer.learner import (
    apply_state_updates,
    build_optimizer,
    overwrite_with_gradient_mask,
    trainable_mask,
)


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


def _run_timestamp() -> str:
    """UTC time for a default run directory name; process 0's in a multi-process job, so all agree."""
    now = int(datetime.datetime.now(datetime.timezone.utc).timestamp())
    if jax.process_count() > 1:
        now = int(multihost_utils.broadcast_one_to_all(np.int64(now)))
    return f"{datetime.datetime.fromtimestamp(now, datetime.timezone.utc):%Y%m%d-%H%M%S}"


def opt_state_shardings(opt_state: Any, params: Any, param_shardings: Any, trainable: Any, replicated: Any) -> Any:
    """Shardings of the optimizer state: a parameter's sharding for state shaped like it, else replicated.

    State trees shaped like the parameter tree (all of it, or only the `trainable`
    leaves, as masked optimizers keep it) are matched leaf by leaf; a leaf with its
    parameter's shape (e.g. Adam's moments) is sharded like it, any other leaf (a
    count, Adafactor's factored rows) is `replicated`. Works on abstract trees
    (`jax.eval_shape` outputs) and with shardings of an `AbstractMesh`.
    """
    pairs = list(zip(jax.tree.leaves(params), jax.tree.leaves(param_shardings), strict=True))
    masked = jax.tree.map(lambda t, p: p if t else optax.MaskedNode(), trainable, params)
    flags = jax.tree.leaves(trainable)
    like_params = {
        jax.tree.structure(params): pairs,
        jax.tree.structure(masked): [pair for pair, t in zip(pairs, flags) if t],
    }

    def is_params_like(x):
        return jax.tree.structure(x) in like_params

    def assign(x):
        if not is_params_like(x):
            return replicated
        leaves = [
            sharding if leaf.shape == param.shape else replicated
            for leaf, (param, sharding) in zip(jax.tree.leaves(x), like_params[jax.tree.structure(x)])
        ]
        return jax.tree.unflatten(jax.tree.structure(x), leaves)

    return jax.tree.map(assign, opt_state, is_leaf=is_params_like)


class Trainer:
    """Runs an `Experiment`'s training job.

    Shardings (`axcore.sharding`): parameters by their logical axes under `axis_rules`,
    optimizer state like its parameter (`opt_state_shardings`), step and key
    replicated, batches split over the batch's mesh axes; the train step is jitted
    with these as in and out shardings, and layers add activation constraints.
    """

    def __init__(
        self,
        experiment: Experiment,
        *,
        stream: TextIO | None = None,
        out: TextIO | None = None,
        devices: Sequence[Any] | None = None,
        command: Sequence[str] | None = None,
    ):
        """`devices`: the devices of the mesh (`mesh.mesh_shape` over them); None = all of JAX's.

        `command`: the words that started the run (`axcore train ...`), repeated in the
        resume line after Ctrl-C; None = resume from the run directory's config.yaml.
        """
        self.experiment = experiment
        self.command = command
        self.cfg = experiment.config
        # Progress and logs (only process 0 of a multi-process job shows them).
        self.stream = stream or sys.stderr if is_primary() else io.StringIO()
        # Results (the sample).
        self.out = out or sys.stdout if is_primary() else io.StringIO()
        self.run_dir = pathlib.Path(self.cfg.trainer.run_dir or f"runs/{self.cfg.name}-{_run_timestamp()}")
        self.mesh = make_mesh(self.cfg.mesh.mesh_shape, self.cfg.mesh.mesh_axis_names, devices)
        # Logical -> mesh axes: the mesh rule's axis_rules over axcore.sharding.DEFAULT_AXIS_RULES.
        self.axis_rules = resolve_rules(self.cfg.mesh.axis_rules)
        self.model = self.cfg.model.instantiate(name="model", registries=experiment.registries)
        BATCH_SCHEMA.check_accepted(self.model.accepted_batch_fields(), f"model ({type(self.model).__name__})")
        # Tokenizes text sources and the end-of-run sample.
        self.tokenizer = self.cfg.tokenizer.instantiate()
        model_vocab = self.cfg.model.vocab_size if "vocab_size" in self.cfg.model.keys() else None
        if isinstance(model_vocab, int) and self.tokenizer.vocab_size > model_vocab:
            raise ConfigError(
                f"The tokenizer ({type(self.tokenizer).__name__}) has {self.tokenizer.vocab_size} token ids but "
                f"model.vocab_size is {model_vocab}; set model.vocab_size to at least {self.tokenizer.vocab_size}."
            )
        specs = self.model.parameter_specs()
        tcfg = self.cfg.trainer
        # Whether each parameter is trainable (a tree like the parameters, of Python bools).
        self.trainable = trainable_mask(specs)
        # Whether each (non-trainable) parameter's new value is the step's gradient of it.
        self.overwrite_with_gradient = overwrite_with_gradient_mask(specs)
        self.optimizer, self.schedule = build_optimizer(tcfg.learner, specs, tcfg.max_steps)
        # Batches `[batch, ...]`: the batch dim split over the mesh axes of logical axis "batch" (data, fsdp).
        check_batch_size(self.cfg.input.batch_size, self.mesh, self.axis_rules)
        self.batch_sharding = batch_sharding(self.mesh, self.axis_rules)
        # The data shards this process reads (ConfigError when input.data_shards does not fit the layout).
        self.shard_layout = shard_layout(
            self.batch_sharding, (self.cfg.input.batch_size, self.cfg.input.seq_len), self.cfg.input.data_shards
        )
        # Raises ConfigError naming a parameter whose dims do not divide their mesh axes.
        param_shardings = parameter_shardings(specs, self.axis_rules, self.mesh)
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
        opt = self._opt_state_shardings(abstract["opt_state"], abstract["params"], param_shardings, replicated)
        return {"params": param_shardings, "opt_state": opt, "step": replicated, "prng_key": replicated}

    def _opt_state_shardings(self, opt_state: Any, params: Any, param_shardings: Any, replicated: Any) -> Any:
        """Shardings of the optimizer state (see `opt_state_shardings`)."""
        return opt_state_shardings(opt_state, params, param_shardings, self.trainable, replicated)

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

    def _op_environment(self):
        """Makes the mesh and axis rules visible to the kernels of ops traced inside."""
        return op_environment(self.mesh, self.axis_rules, instance_type=self.cfg.mesh.instance_type)

    def _batch_gradients(self, params: dict, batch: dict, key: jax.Array) -> tuple:
        """`(loss, metrics, summaries, state_updates, raw_grads)` of one (micro)batch.

        `raw_grads` holds, for overwrite-with-gradient leaves, their new values (a kernel's
        custom VJP returns them as the cotangent), and the gradient for every other leaf.
        """
        owg = self.overwrite_with_gradient

        def loss_fn(params):
            # Non-trainable parameters (kernel state) get no gradient, except those whose gradient is
            # their new value (overwrite_with_gradient: a kernel's custom VJP returns it as the cotangent).
            params = jax.tree.map(lambda t, o, p: p if t or o else jax.lax.stop_gradient(p), self.trainable, owg, params)
            (loss, metrics), collection = functional(self.model, params, (batch,), key, True)
            return loss, (metrics, collection.summaries, collection.state_updates)

        (loss, (metrics, summaries, state_updates)), raw_grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        return loss, metrics, summaries, state_updates, raw_grads

    def _accumulated_gradients(self, params: dict, batch: dict, key: jax.Array) -> tuple:
        """`_batch_gradients` over `trainer.microbatches` microbatches, combined as one batch would be.

        Microbatch i holds rows i, i + m, i + 2m, ... of the batch, so each device keeps
        its own rows (no resharding). Loss, gradients and metrics are averaged weighted by
        each microbatch's `num_tokens` (equal weights if the model reports none), so the
        result is the full batch's up to float rounding; `num_tokens` is summed;
        summaries are averaged; overwrite-with-gradient values are combined by elementwise
        maximum (amax histories see the largest value of the step); state updates are the
        last microbatch's.
        """
        m = self.cfg.trainer.microbatches
        if m == 1:
            return self._batch_gradients(params, batch, key)
        spec = self.batch_sharding.spec
        micro_sharding = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec(None, *spec))

        def split(x):
            x = x.reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1)
            return jax.lax.with_sharding_constraint(x, micro_sharding)

        micro = jax.tree.map(split, batch)
        owg = self.overwrite_with_gradient

        def one(i, microbatch):
            loss, metrics, summaries, updates, grads = self._batch_gradients(params, microbatch, jax.random.fold_in(key, i))
            weight = metrics["num_tokens"].astype(jnp.float32) if "num_tokens" in metrics else jnp.float32(1.0)
            return weight, loss, metrics, summaries, updates, grads

        shapes = jax.eval_shape(one, 0, jax.tree.map(lambda x: x[0], micro))
        zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)
        # Overwrite-with-gradient leaves start at -inf: their combination is a maximum.
        init_grads = jax.tree.map(lambda o, g: jnp.full_like(g, -jnp.inf) if o else g, owg, zeros[5])

        def body(acc, xs):
            weight, loss, metrics, summaries, updates, grads = one(*xs)
            acc_weight, acc_loss, acc_metrics, acc_summaries, _, acc_grads = acc
            metrics = {
                k: acc_metrics[k] + (v if k == "num_tokens" else weight * v.astype(acc_metrics[k].dtype))
                for k, v in metrics.items()
            }
            summaries = jax.tree.map(lambda a, v: a + v / m, acc_summaries, summaries)
            grads = jax.tree.map(
                lambda o, a, g: jnp.maximum(a, g) if o else a + (weight * g).astype(a.dtype), owg, acc_grads, grads
            )
            return (acc_weight + weight, acc_loss + weight * loss, metrics, summaries, updates, grads), None

        init = (zeros[0], zeros[1], zeros[2], zeros[3], zeros[4], init_grads)
        (total, loss, metrics, summaries, updates, grads), _ = jax.lax.scan(body, init, (jnp.arange(m), micro))
        metrics = {k: v if k == "num_tokens" else (v / total).astype(v.dtype) for k, v in metrics.items()}
        grads = jax.tree.map(lambda o, g: g if o else (g / total).astype(g.dtype), owg, grads)
        return loss / total, metrics, summaries, updates, grads

    def _train_step(self, state: dict, batch: dict) -> tuple[dict, dict]:
        with self._op_environment():
            key = jax.random.fold_in(jax.random.wrap_key_data(state["prng_key"]), state["step"])
            owg = self.overwrite_with_gradient
            loss, metrics, summaries, state_updates, raw_grads = self._accumulated_gradients(
                state["params"], batch, key
            )
            # Overwrite-with-gradient "gradients" are new values, not gradients: zero for the optimizer
            # (which freezes them anyway), the clipping norm and the logged gradient norm.
            grads = jax.tree.map(lambda o, g: jnp.zeros_like(g) if o else g, owg, raw_grads)
            updates, opt_state = self.optimizer.update(grads, state["opt_state"], state["params"])
            params = optax.apply_updates(state["params"], updates)
            # The optimizer never touches non-trainable leaves; their new values are the step's state updates.
            params = jax.tree.map(lambda t, new, old: new if t else old, self.trainable, params, state["params"])
            params = apply_state_updates(params, state_updates, self.trainable)
            # Last (it wins over a forward state update): an overwrite-with-gradient leaf's new value is its gradient.
            params = jax.tree.map(lambda o, p, g: g.astype(p.dtype) if o else p, owg, params, raw_grads)
        new_state = dict(state, params=params, opt_state=opt_state, step=state["step"] + 1)
        out = {
            "loss": loss,
            "grad_norm": optax.tree.norm(grads),
            "learning_rate": self.schedule(state["step"]),
        }
        out.update(metrics)
        out.update(_flatten_scalars(summaries, "summaries"))
        return new_state, out

    def _eval_step(self, params: dict, batch: dict) -> dict:
        with self._op_environment():
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

    def compiled_eval_step(self):
        """`(params, batch, totals) -> totals`, jitted: adds a batch's weighted cross-entropy and weights on device."""
        return jax.jit(
            accumulate_step(self._eval_step),
            in_shardings=(self.state_shardings["params"], self.batch_sharding, None),
            donate_argnums=2,
        )

    def eval_loader(self, pipeline: Any = None) -> DeviceLoader:
        """The eval split (one pass, in order) of this process's data shards, on the devices; `pipeline`
        replaces it (host batches of this process's rows)."""
        if pipeline is None:
            vocab = self.cfg.model.vocab_size if "vocab_size" in self.cfg.model.keys() else None
            pipeline = input_pipeline(self.cfg.input, Split.EVAL, self.tokenizer, vocab, self.shard_layout)
        shape = (self.cfg.input.batch_size, self.cfg.input.seq_len)
        return DeviceLoader(pipeline, self.batch_sharding, shape, local_rows=self.shard_layout.local_rows,
                            where="The eval split's batch")

    def evaluate(self, params: dict, max_batches: int | None = None, *, eval_step=None, loader=None) -> EvalTotals:
        """Held-out loss of `params` (axcore.trainer.evaluate): the eval split from its start, at most
        `max_batches` batches (None: `trainer.eval_batches`; 0: the whole split)."""
        if max_batches is None:
            max_batches = self.cfg.trainer.eval_batches
        eval_step = eval_step or self.compiled_eval_step()
        loader = loader or self.eval_loader()
        try:
            return run_evaluation(eval_step, params, loader, max_batches)
        finally:
            loader.close()

    # -- The run ----------------------------------------------------------------------

    def _save_config(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if is_primary():  # config.yaml loads back as it ran (see Experiment.save).
            self.experiment.save(self.run_dir)

    def _check_finite(self, steps: list[int], checks: list[tuple[float, float]], backend) -> None:
        """Raises NonFiniteLossError at the first step whose loss or gradient norm is not finite."""
        for step, (loss, grad_norm) in zip(steps, checks):
            if math.isfinite(loss) and math.isfinite(grad_norm):
                continue
            backend.wait()
            latest = backend.latest_step()
            kept = (
                f"The last good checkpoint is step {latest} in {self.run_dir / 'checkpoints'}"
                if latest is not None
                else "No checkpoint was saved before it"
            )
            raise NonFiniteLossError(
                f"Training diverged at step {step} (loss {loss}, gradient norm {grad_norm}); the run stopped. "
                f"{kept}; lower trainer.learner.learning_rate or check the data."
            )

    def _abstract_batch(self) -> dict:
        return BATCH_SCHEMA.shapes(self.cfg.input.batch_size, self.cfg.input.seq_len, self.batch_sharding)

    def _compile_train_step(self):
        """The jitted train step, compiled ahead (which fills JAX's cache for its first call).

        Logs the kernel each op got and refuses (MemoryEstimateError) a step whose
        estimated per-device peak exceeds the device's memory, before anything is allocated.
        """
        train_step = self.compiled_train_step()
        started = time.perf_counter()
        with record_kernel_choices() as choices:
            compiled = train_step.lower(self.abstract_state(), self._abstract_batch()).compile()
        for op, kernels in describe_kernel_choices(choices).items():
            print(f"Kernel for {op}: {kernels}", file=self.stream)
        print(f"Compiled the train step in {time.perf_counter() - started:.1f} s", file=self.stream)
        if self.cfg.trainer.check_memory:
            check_compiled_memory(compiled, self.mesh)
        return train_step

    def _lock_run_dir(self) -> RunDirectory:
        """Creates and locks the run directory (process 0 holds the lock for the whole job)."""
        run_dir = RunDirectory(self.run_dir)
        error = None
        if is_primary():
            try:
                run_dir.acquire()
            except RunDirectoryError as e:
                error = e
        if jax.process_count() > 1:  # Every process stops when process 0 could not lock.
            ok = multihost_utils.broadcast_one_to_all(np.int32(error is None))
            if not int(ok) and error is None:
                error = RunDirectoryError(f"Process 0 could not lock the run directory '{self.run_dir}'; see its log.")
        if error is not None:
            raise error
        return run_dir

    def run(self) -> TrainResult:
        """Trains; see the module docstring.

        Everything the user's input can break is checked before the run directory is
        created: the data (files, token ids against the vocabulary as batches are read),
        the memory estimate of the compiled step. The directory is then locked for this
        run (a second run on it gets RunDirectoryError naming the holder). A run that
        fails before its directory holds a committed checkpoint removes the directory
        it created; otherwise it leaves a FAILED file with the error.
        """
        tcfg = self.cfg.trainer
        vocab = self.cfg.model.vocab_size if "vocab_size" in self.cfg.model.keys() else None
        if tcfg.check_memory:  # First: a batch too big for host memory is refused before any of it is built.
            check_state_memory(self.abstract_state(), self.mesh, self.cfg.input.batch_size * self.cfg.input.seq_len)
        # This process's data shards only; read in a background thread once training starts.
        train_pipeline = input_pipeline(self.cfg.input, Split.TRAIN, self.tokenizer, vocab, self.shard_layout)
        train_step = self._compile_train_step()
        run_dir = self._lock_run_dir()
        backend = None
        # Ctrl-C in the training loop saves the step and stops (single process; see axcore/trainer/interrupt.py).
        self._interrupt = InterruptGuard(jax.process_count() == 1, on_abort=lambda: self._abort(run_dir, backend))
        try:
            self._save_config()
            backend = make_checkpoint_backend(tcfg.checkpoint, self.experiment.registries, self.run_dir / "checkpoints")
            return self._train(backend, train_step, train_pipeline)
        except KeyboardInterrupt as e:  # Marked INTERRUPTED, not FAILED; the error's line says how to resume.
            raise self._interrupted(run_dir, e) from None
        except BaseException as e:
            if is_primary():
                # Anything in checkpoints/ (even an unfinished save) keeps the directory, marked FAILED.
                committed = self._has_checkpoint()
                print(run_dir.fail(" ".join(str(e).split()) or type(e).__name__, committed=committed), file=self.stream)
            raise
        finally:
            run_dir.release()

    def _has_checkpoint(self) -> bool:
        """Whether checkpoints/ holds anything (even an unfinished save), which keeps the run directory."""
        checkpoints = self.run_dir / "checkpoints"
        return checkpoints.is_dir() and any(checkpoints.iterdir())

    def _interrupted(self, run_dir: RunDirectory, error: KeyboardInterrupt) -> RunInterrupted:
        """Marks the run INTERRUPTED (see axcore/trainer/interrupt.py); the error to raise."""
        resume = resume_command(self.command, self.run_dir, bool(self.cfg.trainer.run_dir))
        return interrupted(run_dir, error, self._has_checkpoint(), resume, jax.process_count() > 1, is_primary())

    def _abort(self, run_dir: RunDirectory, backend) -> None:
        """A second Ctrl-C: marks the run and says what it resumes from; InterruptGuard then exits (status 130)."""
        resume = resume_command(self.command, self.run_dir, bool(self.cfg.trainer.run_dir))
        abort(run_dir, backend, self._has_checkpoint(), resume, is_primary())

    def _train(self, backend, train_step, train_pipeline) -> TrainResult:
        tcfg = self.cfg.trainer
        writer = MultiWriter([])
        progress = loader = None
        from axcore.trainer.watchdog import Watchdog  # Hang detection: armed by the first beat (step compiled).

        watchdog = Watchdog.for_run(tcfg.watchdog, self.run_dir, jax.process_index(), jax.process_count())
        try:
            state, start = None, 0
            ckpt = tcfg.checkpoint
            if ckpt.restore_step is not None or (ckpt.resume and backend.latest_step() is not None):
                # Falls back to the latest step that verifies; a parameters-only step (an import) gets a fresh optimizer.
                from axcore.trainer.resume import restore_train_state

                report = lambda line: print(line, file=self.stream)  # noqa: E731
                started = time.perf_counter()
                state, metadata, params_only = restore_train_state(self, backend, ckpt.restore_step, report)
                start = int(state["step"])
                where = f"step {start} in {self.run_dir / 'checkpoints'}"
                if not params_only:  # An import has no input position: its data starts from the beginning.
                    restore_input_state(train_pipeline, metadata["input"], self.shard_layout, where)
                fresh = "parameters only, optimizer state initialized; " if params_only else ""
                print(
                    f"Resumed from step {start} in {self.run_dir} ({fresh}restored in {time.perf_counter() - started:.2f} s)",
                    file=self.stream,
                )
            # Metrics of steps after the restored one (logged before a crash) are dropped: they are redone.
            for writer_cfg in tcfg.metrics_writers if is_primary() else []:
                writer.writers.append(writer_cfg.instantiate().create_resumed(self.run_dir, start))
            if state is None:
                state = self.init_state()
            eval_step = self.compiled_eval_step()
            layout = self.shard_layout
            # Every process says which rows it reads (process 0 on the run's stream, the others on stderr).
            say_input = lambda line: print(line, file=self.stream if is_primary() else sys.stderr)  # noqa: E731
            say_input(
                f"Input: process {jax.process_index()} reads data shards {list(layout.shards)} of {layout.num_shards} "
                f"({layout.local_rows} of {self.cfg.input.batch_size} rows per batch)"
            )
            read = [0, 0]  # Rows and non-padding tokens of the batches this process's steps consumed.
            shape = (self.cfg.input.batch_size, self.cfg.input.seq_len)
            input_state = train_pipeline.state()  # Before the loader's thread owns the pipeline.
            loader = DeviceLoader(train_pipeline, self.batch_sharding, shape, local_rows=layout.local_rows,
                                  where="The training batch")
            data_wait = DataWaitMeter(self.stream)
            progress = ProgressBar(tcfg.max_steps, stream=self.stream, log_every=tcfg.log_every, start_step=start)
            tokens_per_step = self.cfg.input.batch_size * self.cfg.input.seq_len
            train_loss = eval_loss = None
            # Loss and gradient norm (on the device) of each step since the last fetch.
            unchecked: list[tuple[int, tuple[jax.Array, jax.Array]]] = []
            interval_start, fetched_step = time.perf_counter(), start
            self._interrupt.install()
            for step in range(start + 1, tcfg.max_steps + 1):
                loaded = next(loader)
                input_state = loaded.state  # The pipeline's state after the last batch a step consumed.
                read[0], read[1] = read[0] + loaded.rows, read[1] + loaded.tokens
                state, metrics = train_step(state, loaded.batch)
                watchdog.beat(step)
                unchecked.append((step, (metrics["loss"], metrics["grad_norm"])))
                last = step == tcfg.max_steps
                stop = self._interrupt.requested  # Ctrl-C: this step is fetched, checked and saved, then the run stops.
                evaluate = bool(tcfg.eval_every) and (step % tcfg.eval_every == 0 or last)
                every = tcfg.checkpoint.every_n_steps
                save = bool(every and step % every == 0) or last or stop
                if not (step % tcfg.log_every == 0 or evaluate or save or last):
                    continue  # No host sync: the device runs ahead.
                checks, metrics = jax.device_get(([c for _, c in unchecked], metrics))
                steps = step - fetched_step
                step_time = (time.perf_counter() - interval_start) / steps
                self._check_finite([s for s, _ in unchecked], [(float(a), float(b)) for a, b in checks], backend)
                unchecked, fetched_step = [], step
                record = {f"train/{k}": float(v) for k, v in metrics.items()}
                record["train/tokens_per_sec"] = tokens_per_step / step_time
                record["train/step_time"] = step_time
                record.update(data_wait.interval(loader.take_wait(), steps, step_time, step - steps + 1, step))
                record.update(loader.stats())  # Packing efficiency, tokens per mixture component.
                train_loss = record["train/loss"]
                progress.update(step, train_loss, tokens_per_step / step_time, step_time)
                if evaluate:
                    watchdog.beat(step, "eval")
                    result = self.evaluate(state["params"], eval_step=eval_step)
                    eval_loss = result.loss
                    record["eval/loss"], record["eval/tokens"] = result.loss, result.tokens
                    self._say(
                        f"eval at step {step}: loss {result.loss:.4f} over {int(result.tokens)} tokens "
                        f"({result.batches} batches{'' if result.complete else ', trainer.eval_batches'})"
                    )
                writer.write(step, record)
                if save:
                    watchdog.beat(step, "checkpoint save")
                    backend.save(step, state, {"input": gather_input_state(input_state), "step": step})
                if stop:
                    backend.wait()  # Committed (a second Ctrl-C aborts the wait and the save).
                    raise RunInterrupted(step=step, saved=True)
                interval_start = time.perf_counter()  # Eval and saving do not count as step time.
                watchdog.beat(step)
            watchdog.beat(activity="waiting for checkpoint writes")
            backend.wait()
            say_input(f"Input: process {jax.process_index()} read {read[0]} rows, {read[1]} tokens (steps {start + 1}.."
                      f"{tcfg.max_steps})")
        finally:
            self._interrupt.uninstall()
            watchdog.stop()  # Nothing fires after training.
            if loader is not None:
                loader.close()
            if progress is not None:
                progress.close()
            writer.close()
            backend.close()
        metrics_file = self.run_dir / JsonlWriterFactory.FILENAME
        if metrics_file.exists() and is_primary():
            plot_loss_curve(
                metrics_file, self.run_dir / "loss.png", run_name=self.run_dir.name, experiment=self.cfg.name,
                token_unit=self.tokenizer.token_unit,
            )
        sample = self._sample(state["params"])
        return TrainResult(self.run_dir, int(state["step"]), train_loss, eval_loss, sample)

    def _say(self, line: str) -> None:
        """One line on the run's stream, below a progress line redrawn on a terminal."""
        isatty = getattr(self.stream, "isatty", None)
        print(("\n" if isatty is not None and isatty() else "") + line, file=self.stream)

    def _sample(self, params: dict) -> str:
        scfg = self.cfg.trainer.sample
        if scfg.num_tokens <= 0:
            return ""
        tokenizer = self.tokenizer
        eos = getattr(tokenizer, "eos_id", None)
        prompt, num_tokens = np.asarray(tokenizer.encode(scfg.prompt)), scfg.num_tokens
        limit = self.model.max_cache_len()  # Learned input positions end at their max_len.
        if limit is not None and len(prompt) + num_tokens > limit:
            prompt = prompt[-(limit - 1):] if len(prompt) >= limit else prompt
            num_tokens = limit - len(prompt)
            print(
                f"Sample: {num_tokens} of trainer.sample.num_tokens={scfg.num_tokens} tokens, as the model's "
                f"learned positions end at {limit}.",
                file=self.out,
            )
        if len(prompt) == 0:
            return ""
        generator = Generator(
            self.model,
            max_new_tokens=num_tokens,
            sampling=Sampling(scfg.temperature, scfg.top_k, scfg.top_p),
            stop_tokens=() if eos is None else (eos,),
        )
        with self._op_environment():
            [tokens] = generator(params, [prompt], jax.random.key(self.cfg.trainer.seed))
        text = scfg.prompt + tokenizer.decode(np.asarray(tokens))
        print(f"Sample:\n{text}", file=self.out)
        return text
