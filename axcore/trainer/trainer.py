"""The training loop: run directory, checkpoints, metrics, interrupts, the watchdog, callbacks.

`Trainer(experiment).run()` trains. The step math (train state, shardings, the jitted
train and eval steps, the objective and gradient accumulation) is the `TrainStep` it
holds (`axcore.trainer.step`, `trainer.step`); this module owns what a run adds around
it. The step's randomness is `fold_in(prng_key, step)`, and the input pipeline's state
after the last consumed batch (every process's data shards, gathered;
`axcore.placement.inputs`) is saved with each checkpoint, so a resumed run computes
exactly what an uninterrupted one would have. Batches come from
`axcore.data.device_loader.DeviceLoader`: each process builds only its own rows in a
background thread; `train/data_wait` is the time the loop waited for them.

Steps run asynchronously: the host reads metrics back from the device (a "fetch")
only every `log_every` steps and at eval, checkpoint and last steps. A fetch writes
one metrics record (the values of that step, with `step_time` and `tokens_per_sec`
averaged over the steps since the previous fetch), updates the progress display, and
checks the loss and gradient norm of every step since the previous fetch: a
non-finite one stops the run with NonFiniteLossError naming that step, before any
checkpoint of a later state is saved.

The host stays at most one step ahead of the device: after dispatching step s it
waits (reading nothing back) until step s-1 has finished, so the device always has
the next step queued and never idles for the host, while a Ctrl-C (a flag set by the
signal handler, `axcore.trainer.interrupt.InterruptGuard`, which the loop reads as it
dispatches each step) stops the run at the step after the one the device was running
when the key came, not at the next fetch (up to `log_every` steps already dispatched).

After the last step the loop calls its callbacks (`axcore.trainer.callbacks`: by
default the loss plot and the end-of-run sample); when the loop stops early (Ctrl-C,
an error), their `on_run_stopped` (the loss plot of the steps logged so far).
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
from typing import TYPE_CHECKING, Any, TextIO

import jax
import numpy as np
from jax.experimental import multihost_utils

from axcore.checkpoint import checkpoint_log_file, save_reports_to
from axcore.data import Split
from axcore.data.device_loader import DeviceLoader
from axcore.errors import AxcoreError, one_line
from axcore.layers.pipeline import pipeline_plans
from axcore.observe import MultiWriter, ProgressLog
from axcore.placement.backend import make_checkpoint_backend
from axcore.placement.evaluate import EvalProgress, EvalTotals, check_evaluable, describe, eval_metrics, evaluate_input
from axcore.placement.inputs import DataWaitMeter, gather_input_state, input_pipeline, restore_input_state
from axcore.placement.layout import checkpoints_path
from axcore.platform import exit_hooks
from axcore.platform.distributed import is_primary
from axcore.trainer.callbacks import SAMPLE, Callback, RunEnd, default_callbacks, run_stopped, sample_text
from axcore.trainer.existing_run import lock_run_directory, remove_interrupted_pruning
from axcore.trainer.interrupt import InterruptGuard, RunInterrupted, abort, interrupted, resume_command
from axcore.trainer.memory_check import check_state_memory
from axcore.trainer.run_dir import RunDirectory
from axcore.trainer.step import TrainStep

if TYPE_CHECKING:  # The trainer is given a loaded experiment; it never loads one.
    from axcore.experiment.loading import Experiment


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
    # Whether the run directory was already finished (its step at trainer.max_steps or beyond): nothing ran.
    already_finished: bool = False


def _run_timestamp() -> str:
    """UTC time for a default run directory name; process 0's in a multi-process job, so all agree."""
    now = int(datetime.datetime.now(datetime.timezone.utc).timestamp())
    if jax.process_count() > 1:
        now = int(multihost_utils.broadcast_one_to_all(np.int64(now)))
    return f"{datetime.datetime.fromtimestamp(now, datetime.timezone.utc):%Y%m%d-%H%M%S}"



class Trainer:
    """Runs an `Experiment`'s training job around its `TrainStep` (`self.step`).

    The step's public pieces are available here too (`mesh`, `model`, `tokenizer`,
    `batch_sharding`, `shard_layout`, `state_shardings`, `abstract_state()`,
    `init_state()`, `compiled_eval_step()`); `run()` takes its train step from
    `self.compiled_train_step()`, so a benchmark may replace that attribute to wrap it.
    """

    def __init__(
        self,
        experiment: Experiment,
        *,
        stream: TextIO | None = None,
        out: TextIO | None = None,
        devices: Sequence[Any] | None = None,
        command: Sequence[str] | None = None,
        callbacks: Sequence[Callback] | None = None,
    ):
        """`devices`: the devices of the mesh (`mesh.mesh_shape` over them); None = all of JAX's.

        `command`: the words that started the run (`axcore train ...`), repeated in the
        resume line after Ctrl-C; None = resume from the run directory's config.yaml.
        `callbacks`: called after the last step (`axcore.trainer.callbacks`); None = the
        defaults (loss plot, end-of-run sample).
        """
        self.experiment = experiment
        self.command = command
        self.cfg = experiment.config
        # Progress and logs (only process 0 of a multi-process job shows them).
        self.stream = stream or sys.stderr if is_primary() else io.StringIO()
        # Results (the sample).
        self.out = out or sys.stdout if is_primary() else io.StringIO()
        self.run_dir = pathlib.Path(self.cfg.trainer.run_dir or f"runs/{self.cfg.name}-{_run_timestamp()}")
        # State, shardings and the jitted steps (axcore.trainer.step).
        self.step = TrainStep(experiment, devices=devices)
        # Called in order after the last step (axcore.trainer.callbacks); append to add one.
        self.callbacks: list[Callback] = list(default_callbacks() if callbacks is None else callbacks)

    # -- The step's pieces ------------------------------------------------------------

    mesh = property(lambda self: self.step.mesh, doc="The run's device mesh.")
    axis_rules = property(lambda self: self.step.axis_rules, doc="Logical -> mesh axes.")
    model = property(lambda self: self.step.model, doc="The root module.")
    tokenizer = property(lambda self: self.step.tokenizer, doc="Tokenizes text sources and the sample.")
    objective = property(lambda self: self.step.objective, doc="The loss the step differentiates.")
    optimizer = property(lambda self: self.step.optimizer, doc="The learner's optax transformation.")
    schedule = property(lambda self: self.step.schedule, doc="Step -> learning rate.")
    trainable = property(lambda self: self.step.trainable, doc="Whether each parameter is trainable.")
    batch_sharding = property(lambda self: self.step.batch_sharding, doc="Sharding of `[batch, ...]` batches.")
    shard_layout = property(lambda self: self.step.shard_layout, doc="The data shards this process reads.")
    state_shardings = property(lambda self: self.step.state_shardings, doc="Shardings of the train state.")

    def abstract_state(self) -> dict:
        """The train state as ShapeDtypeStructs carrying their target shardings."""
        return self.step.abstract_state()

    def init_state(self) -> dict:
        """The initial train state, placed with its shardings."""
        return self.step.init_state()

    def _init_state(self, key_data: jax.Array) -> dict:
        return self.step._init_state(key_data)

    def op_environment(self):
        """The op environment (mesh, axis rules, platform) the model's kernels are chosen under."""
        return self.step.op_environment()

    def compiled_train_step(self):
        """The jitted train step (state donated, explicit in/out shardings); `run()` calls this."""
        return self.step.compiled_train_step()

    def compiled_eval_step(self):
        """`(params, batch, totals) -> totals`, jitted: adds a batch's weighted cross-entropy and weights on device."""
        return self.step.compiled_eval_step()

    def eval_loader(self, pipeline: Any = None) -> DeviceLoader:
        """The eval split (one pass, in order) of this process's data shards, on the devices; `pipeline`
        replaces it (host batches of this process's rows)."""
        if pipeline is None:
            vocab = self.cfg.model.vocab_size if "vocab_size" in self.cfg.model.keys() else None
            pipeline = input_pipeline(self.cfg.input, Split.EVAL, self.tokenizer, vocab, self.shard_layout)
        return self.step.loader(pipeline, "The eval split's batch")

    def evaluate(self, params: dict, max_batches: int | None = None, *, eval_step=None, loader=None,
                 progress=None) -> EvalTotals:
        """Held-out loss of `params` (axcore.placement.evaluate): the eval split from its start (a mixture's
        components each alone, the total token-weighted), at most `max_batches` batches (None:
        `trainer.eval_batches`; 0: the whole split). `loader` replaces the split (one stream);
        `progress(component, budget)`: a per-batch callback or None (`EvalProgress.for_stream`)."""
        if max_batches is None:
            max_batches = self.cfg.trainer.eval_batches
        if loader is not None:
            tick = progress(None, max_batches) if progress is not None else None
            return self.step.evaluate(params, loader, max_batches, eval_step=eval_step, progress=tick)
        return evaluate_input(self.step, params, Split.EVAL, max_batches, eval_step=eval_step, progress=progress)

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


    def _compile_train_step(self):
        """`compiled_train_step()`, compiled ahead (which fills JAX's cache for its first call).

        Logs the kernel each op got and refuses (MemoryEstimateError) a step whose
        estimated per-device peak exceeds the device's memory, before anything is allocated.
        """
        compiled = self.step.compile(self.compiled_train_step())
        for op, kernels in compiled.kernels.items():
            print(f"Kernel for {op}: {kernels}", file=self.stream)
        print(f"Compiled the train step in {compiled.seconds:.1f} s", file=self.stream)
        mesh_axes = dict(zip(self.mesh.axis_names, self.mesh.devices.shape))
        for plan in pipeline_plans(self.cfg.model, mesh_axes):
            print(f"Pipeline {plan.describe()}", file=self.stream)
        return compiled.step

    def _cleanup(self, run_dir: RunDirectory, claimed: bool, message: str, keep: bool = False) -> str | None:
        """After a failure (process 0): an unclaimed directory is given up as it was (removed if this run
        created it); a claimed one is marked FAILED, or removed if this run created it and it holds no
        checkpoint and not `keep` (`RunDirectory.fail`). Returns what was done, or None."""
        if not is_primary():
            return None
        if not claimed:
            run_dir.abandon()
            return None
        return run_dir.fail(message, committed=keep or self._has_checkpoint())

    def run(self) -> TrainResult:
        """Trains; see the module docstring.

        The run directory is locked first, before anything is compiled or written (a
        second run on it gets RunDirectoryError naming the holder), and checked
        (axcore/trainer/existing_run.py): a directory holding another run (a different
        plugin list, or a model with other parameters) is refused and left as it was; a
        finished one (at `trainer.max_steps` already) returns at once with
        `already_finished` set, compiling nothing. Everything the user's input can break
        is then checked before the directory is claimed (its earlier marks cleared,
        config.yaml written): the data (files, token ids against the vocabulary as
        batches are read), the memory estimate of the compiled step, an eval split with
        nothing held out (`check_evaluable`, before the lock); a failure there leaves an
        existing directory as it was and removes one this run created. After
        the claim every failure removes the directory this run created if it holds no
        checkpoint, and otherwise leaves a FAILED file with the error; an immediate exit
        (a lost peer's, the watchdog's: `axcore.platform.exit_hooks`) always leaves
        FAILED with its line and keeps the directory, whose logs (the watchdog's stacks)
        explain it. An evaluation that fails saves its step first, so what was trained
        is kept.
        """
        tcfg = self.cfg.trainer
        vocab = self.cfg.model.vocab_size if "vocab_size" in self.cfg.model.keys() else None
        check_evaluable(self.cfg, self.tokenizer)  # An eval split with no document is refused before training.
        if tcfg.check_memory:  # First: a batch too big for host memory is refused before any of it is built.
            check_state_memory(self.abstract_state(), self.mesh, self.cfg.input.batch_size * self.cfg.input.seq_len)
        run_dir, finished = lock_run_directory(self.run_dir, self.experiment, self.step, self.stream)
        if finished is not None:
            print(f"Run directory {self.run_dir} is already finished at step {finished} (trainer.max_steps "
                  f"{tcfg.max_steps}); nothing to train. To train on, raise trainer.max_steps.", file=self.stream)
            return TrainResult(self.run_dir, finished, None, None, "", already_finished=True)
        claimed = [False]
        unregister = exit_hooks.register(lambda line: self._cleanup(run_dir, claimed[0], line, keep=True))
        backend = None
        # Ctrl-C in the training loop saves the step and stops (single process; see axcore/trainer/interrupt.py).
        self._interrupt = InterruptGuard(jax.process_count() == 1, on_abort=lambda: self._abort(run_dir, backend))
        try:
            # This process's data shards only; read in a background thread once training starts.
            train_pipeline = input_pipeline(self.cfg.input, Split.TRAIN, self.tokenizer, vocab, self.shard_layout)
            train_step = self._compile_train_step()
            if is_primary():
                run_dir.claim()
            claimed[0] = True
            self._save_config()
            backend = make_checkpoint_backend(tcfg.checkpoint, self.experiment.registries, checkpoints_path(self.run_dir))
            if is_primary():  # Before restoring: what a kill during pruning left is never restored or listed.
                remove_interrupted_pruning(backend, lambda line: print(line, file=self.stream))
            # Orbax's own reports of a failed save go to this file; the console gets the error's one line.
            with save_reports_to(checkpoint_log_file(self.run_dir, jax.process_index(), jax.process_count())):
                return self._train(backend, train_step, train_pipeline)
        except KeyboardInterrupt as e:  # Marked INTERRUPTED, not FAILED; the error's line says how to resume.
            if not claimed[0]:
                self._cleanup(run_dir, False, "")
                raise
            raise self._interrupted(run_dir, e) from None
        except BaseException as e:
            # Anything in checkpoints/ (even an unfinished save) keeps the directory, marked FAILED.
            done = self._cleanup(run_dir, claimed[0], one_line(e) or type(e).__name__)
            if done is not None:
                print(done, file=self.stream)
            raise
        finally:
            unregister()
            run_dir.release()

    def _has_checkpoint(self) -> bool:
        """Whether checkpoints/ holds anything (even an unfinished save), which keeps the run directory."""
        checkpoints = checkpoints_path(self.run_dir)
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
        progress = loader = stopped = None
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
            if tcfg.metrics_writers and is_primary():  # TensorBoard's writer imports for seconds.
                print(f"Opening the metrics writers ({len(tcfg.metrics_writers)})...", file=self.stream)
            for writer_cfg in tcfg.metrics_writers if is_primary() else []:
                writer.writers.append(writer_cfg.instantiate().create_resumed(self.run_dir, start))
            if state is None and self.cfg.init_from is not None:  # Fine-tuning another run: its parameters.
                from axcore.trainer.resume import init_from_run

                state = init_from_run(self, self.cfg.init_from, lambda line: print(line, file=self.stream))
            if state is None:
                print("Initialising the parameters...", file=self.stream)  # Compiles and runs the init: seconds.
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
            progress = ProgressLog(tcfg.max_steps, stream=self.stream, log_every=tcfg.log_every, start_step=start)
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
                if len(unchecked) > 1:  # One step ahead at most (module docstring); step s is queued meanwhile.
                    unchecked[-2][1][0].block_until_ready()
                last = step == tcfg.max_steps
                stop = self._interrupt.requested  # Ctrl-C: this step is fetched, checked and saved, then the run stops.
                evaluate = bool(tcfg.eval_every) and (step % tcfg.eval_every == 0 or last)
                every = tcfg.checkpoint.every_n_steps
                save = bool(every and step % every == 0) or last or stop
                if not (step % tcfg.log_every == 0 or evaluate or save or last):
                    continue  # No value fetch: the device works on the queued step meanwhile.
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
                    try:
                        result = self._evaluate_at(step, state["params"], eval_step, watchdog)
                    except Exception:  # This step's training is saved (the run directory kept) before the error stops it.
                        writer.write(step, record)
                        self._save_before_failing(step, state, input_state, backend)
                        raise
                    eval_loss = result.loss
                    record.update(eval_metrics(result))
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
            self._say("Waiting for the checkpoint writes...")
            backend.wait()
            say_input(f"Input: process {jax.process_index()} read {read[0]} rows, {read[1]} tokens (steps {start + 1}.."
                      f"{tcfg.max_steps})")
        except BaseException as error:
            stopped = error
            raise
        finally:
            self._interrupt.uninstall()
            watchdog.stop()  # Nothing fires after training.
            if loader is not None:
                loader.close()
            if progress is not None:
                progress.close()
            writer.close()
            backend.close()
            if stopped is not None:  # Metrics are flushed: e.g. the loss plot of the steps logged so far.
                run_stopped(RunEnd(self, state), stopped, self.callbacks, lambda line: print(line, file=self.stream))
        run = RunEnd(self, state)
        for callback in self.callbacks:
            callback.on_run_end(run)
        return TrainResult(self.run_dir, int(state["step"]), train_loss, eval_loss, run.results.get(SAMPLE, ""))

    def _save_before_failing(self, step: int, state: dict, input_state: dict, backend) -> None:
        """Saves and commits step `step` after a failed evaluation; a failing save is one line, never the error."""
        try:
            backend.save(step, state, {"input": gather_input_state(input_state), "step": step})
            backend.wait()
        except Exception as e:
            print(f"Step {step} could not be saved after the failed evaluation: {one_line(e)}", file=self.stream)

    def _evaluate_at(self, step: int, params: dict, eval_step, watchdog) -> EvalTotals:
        """The evaluation of step `step` (`trainer.eval_batches`), its line on the run's stream; progress lines
        for a long one, and every batch beats the watchdog."""
        watchdog.beat(step, "eval")
        progress = EvalProgress(self.stream, f"eval at step {step}", on_batch=lambda: watchdog.beat(step, "eval"))
        result = self.evaluate(params, eval_step=eval_step, progress=progress.for_stream)
        self._say(f"eval at step {step}: {describe(result, f'trainer.eval_batches={self.cfg.trainer.eval_batches}')}")
        return result

    def _say(self, line: str) -> None:
        """One line on the run's stream, below a progress line redrawn on a terminal."""
        isatty = getattr(self.stream, "isatty", None)
        print(("\n" if isatty is not None and isatty() else "") + line, file=self.stream)

    def _sample(self, params: dict) -> str:
        """The end-of-run sample of `params` (`axcore.trainer.callbacks.sample_text` with `trainer.sample`)."""
        return sample_text(self.step, params, self.cfg.trainer.sample, self.out, self.cfg.trainer.seed)


__all__ = ["NonFiniteLossError", "TrainResult", "Trainer"]
