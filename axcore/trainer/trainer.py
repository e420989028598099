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

The loop itself (`Trainer._steps`) only loads batches and dispatches steps; everything
else runs in hooks (`axcore.trainer.hooks`), registered in the `loop_hooks` registry the
way a plugin registers its own: the loop's own (`axcore.trainer.builtin_hooks`: the
watchdog beat, the metrics fetch and its checks, progress, evaluation, the metrics
writers, checkpointing, the Ctrl-C check), then the callbacks (`axcore.trainer.callbacks`:
by default the loss plot and the end-of-run sample, then those of plugins). When the
loop stops early (Ctrl-C, an error), the hooks' `on_run_stopped` run instead of
`on_run_end` (the loss plot of the steps logged so far).
"""

from __future__ import annotations

import dataclasses
import datetime
import io
import pathlib
import sys
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, TextIO

import jax
import numpy as np
from jax.experimental import multihost_utils

from axcore.checkpoint import checkpoint_log_file, save_reports_to
from axcore.data import Split
from axcore.errors import one_line
from axcore.layers.pipeline import pipeline_plans
from axcore.observe import MultiWriter, ProgressLog
from axcore.placement.backend import make_checkpoint_backend
from axcore.placement.evaluate import check_evaluable
from axcore.placement.inputs import DataWaitMeter, input_pipeline, restore_input_state
from axcore.placement.layout import checkpoints_path
from axcore.platform import exit_hooks
from axcore.platform.distributed import is_primary
from axcore.trainer.builtin_hooks import NonFiniteLossError
from axcore.trainer.callbacks import Callback
from axcore.trainer.existing_run import lock_run_directory, remove_interrupted_pruning
from axcore.trainer.hooks import SAMPLE, Hooks, RunView, loop_hooks, run_stopped
from axcore.trainer.interrupt import InterruptGuard, RunInterrupted, abort, interrupted, resume_command
from axcore.trainer.memory_check import check_state_memory
from axcore.trainer.run_dir import RunDirectory
from axcore.trainer.step import TrainStep

if TYPE_CHECKING:  # The trainer is given a loaded experiment; it never loads one.
    from axcore.experiment.loading import Experiment


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



@dataclasses.dataclass
class Dispatched:
    """One step the loop dispatched (`Trainer._steps` yields these)."""

    # The step number (1-based; a resumed run continues from its restored step).
    step: int
    # The train state after the step, on the devices (not yet computed: steps run asynchronously).
    state: dict
    # The step's metrics on the device (loss, grad_norm, ...), shape [] each.
    metrics: dict
    # The input pipeline's state after the step's batch.
    input_state: Any
    # time.perf_counter() before its batch was taken.
    started: float


class Trainer:
    """Runs an `Experiment`'s training job around its `TrainStep` (`self.step`).

    The step object holds the mesh, the model, the tokenizer, the shardings and the
    jitted steps (`trainer.step.model`, `trainer.step.compiled_train_step()` ...); `run()`
    takes its train step from `self.step.compiled_train_step()`, so a benchmark may
    replace that attribute of the step object to wrap it.
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
        `callbacks`: the hooks after the loop's own (`axcore.trainer.callbacks`); None = the
        registered ones (loss plot, end-of-run sample, then the plugins').
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
        # The loop's own hooks and the callbacks after them, from the `loop_hooks` registry (axcore.trainer.hooks).
        self.loop_hooks, registered = loop_hooks(experiment.registries.loop_hooks)
        # Called in order after the loop's own hooks (axcore.trainer.callbacks); append to add one.
        self.callbacks: list[Callback] = list(registered if callbacks is None else callbacks)

    # -- The run ----------------------------------------------------------------------

    def _save_config(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if is_primary():  # config.yaml loads back as it ran (see Experiment.save).
            self.experiment.save(self.run_dir)

    def _compile_train_step(self):
        """`compiled_train_step()`, compiled ahead (which fills JAX's cache for its first call).

        Logs the kernel each op got and refuses (MemoryEstimateError) a step whose
        estimated per-device peak exceeds the device's memory, before anything is allocated.
        """
        compiled = self.step.compile(self.step.compiled_train_step())
        for op, kernels in compiled.kernels.items():
            print(f"Kernel for {op}: {kernels}", file=self.stream)
        print(f"Compiled the train step in {compiled.seconds:.1f} s", file=self.stream)
        mesh = self.step.mesh
        mesh_axes = dict(zip(mesh.axis_names, mesh.devices.shape))
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
        check_evaluable(self.cfg, self.step.tokenizer)  # An eval split with no document is refused before training.
        if tcfg.check_memory:  # First: a batch too big for host memory is refused before any of it is built.
            check_state_memory(self.step.abstract_state(), self.step.mesh, self.cfg.input.batch_size * self.cfg.input.seq_len)
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
            train_pipeline = input_pipeline(self.cfg.input, Split.TRAIN, self.step.tokenizer, vocab, self.step.shard_layout)
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
        """Restores or initializes the state, opens the run's services, runs the steps through the hooks."""
        tcfg = self.cfg.trainer
        run = RunView(self.cfg, self.run_dir, self.step, self.stream, self.out, checkpoints=backend,
                      writer=MultiWriter([]), interrupt=self._interrupt)
        hooks = Hooks([*self.loop_hooks, *self.callbacks])
        from axcore.trainer.watchdog import Watchdog  # Hang detection: armed by the first beat (step compiled).

        run.watchdog = Watchdog.for_run(tcfg.watchdog, self.run_dir, jax.process_index(), jax.process_count())
        stopped = None
        try:
            run.state, run.start_step = self._restored_state(backend, train_pipeline)
            run.step = run.start_step
            # Metrics of steps after the restored one (logged before a crash) are dropped: they are redone.
            if tcfg.metrics_writers and is_primary():  # TensorBoard's writer imports for seconds.
                print(f"Opening the metrics writers ({len(tcfg.metrics_writers)})...", file=self.stream)
            for writer_cfg in tcfg.metrics_writers if is_primary() else []:
                run.writer.writers.append(writer_cfg.instantiate().create_resumed(self.run_dir, run.start_step))
            if run.state is None and self.cfg.init_from is not None:  # Fine-tuning another run: its parameters.
                from axcore.trainer.resume import init_from_run

                run.state = init_from_run(self.step, self.cfg.init_from, lambda line: print(line, file=self.stream))
            if run.state is None:
                print("Initialising the parameters...", file=self.stream)  # Compiles and runs the init: seconds.
                run.state = self.step.init_state()
            hooks.run_start(run)
            self._say_input(f"Input: process {jax.process_index()} reads data shards {list(self.step.shard_layout.shards)} "
                            f"of {self.step.shard_layout.num_shards} ({self.step.shard_layout.local_rows} of "
                            f"{self.cfg.input.batch_size} rows per batch)")
            run.input_state = train_pipeline.state()  # Before the loader's thread owns the pipeline.
            run.loader = self.step.loader(train_pipeline, "The training batch")
            run.data_wait = DataWaitMeter(self.stream)
            run.progress = ProgressLog(tcfg.max_steps, stream=self.stream, log_every=tcfg.log_every,
                                       start_step=run.start_step)
            self._interrupt.install()
            fetched = True
            for dispatched in self._steps(run, train_step, hooks):
                if fetched:  # Step time counts from the first step after a fetch (eval and saving excluded).
                    run.interval_start = dispatched.started
                run.step, run.state, run.step_metrics = dispatched.step, dispatched.state, dispatched.metrics
                run.input_state, run.last = dispatched.input_state, dispatched.step == tcfg.max_steps
                fetched = hooks.step(run)
                if fetched:
                    hooks.fetch(run)
            run.watchdog.beat(activity="waiting for checkpoint writes")
            run.say("Waiting for the checkpoint writes...")
            backend.wait()
            self._say_input(f"Input: process {jax.process_index()} read {self._read[0]} rows, {self._read[1]} tokens "
                            f"(steps {run.start_step + 1}..{tcfg.max_steps})")
        except BaseException as error:
            stopped = error
            raise
        finally:
            self._close(run, hooks, stopped)
        hooks.run_end(run)
        return TrainResult(self.run_dir, int(run.state["step"]), run.metrics.get("train/loss"), run.eval_loss,
                           run.results.get(SAMPLE, ""))

    def _steps(self, run: RunView, train_step, hooks: Hooks) -> Iterator[Dispatched]:
        """Loads each batch (the hooks' `next_batch`, else the loader's) and dispatches its step, from the step
        after `run.start_step` to `trainer.max_steps`."""
        self._read = [0, 0]  # Rows and non-padding tokens of the batches this process's steps consumed.
        state = run.state
        for step in range(run.start_step + 1, self.cfg.trainer.max_steps + 1):
            started = time.perf_counter()
            run.state = state  # The state this step updates, for a hook's next_batch.
            loaded = hooks.next_batch(run)
            self._read[0], self._read[1] = self._read[0] + loaded.rows, self._read[1] + loaded.tokens
            state, metrics = train_step(state, loaded.batch)
            yield Dispatched(step, state, metrics, loaded.state, started)

    def _restored_state(self, backend, train_pipeline) -> tuple[dict | None, int]:
        """`(state, step)` restored as `trainer.checkpoint` says (resume, restore_step), else `(None, 0)`."""
        ckpt = self.cfg.trainer.checkpoint
        if ckpt.restore_step is not None or (ckpt.resume and backend.latest_step() is not None):
            # Falls back to the latest step that verifies; a parameters-only step (an import) gets a fresh optimizer.
            from axcore.trainer.resume import restore_train_state

            report = lambda line: print(line, file=self.stream)  # noqa: E731
            started = time.perf_counter()
            state, metadata, params_only = restore_train_state(self.step, backend, ckpt.restore_step, report)
            start = int(state["step"])
            where = f"step {start} in {self.run_dir / 'checkpoints'}"
            if not params_only:  # An import has no input position: its data starts from the beginning.
                restore_input_state(train_pipeline, metadata["input"], self.step.shard_layout, where)
            fresh = "parameters only, optimizer state initialized; " if params_only else ""
            print(
                f"Resumed from step {start} in {self.run_dir} ({fresh}restored in {time.perf_counter() - started:.2f} s)",
                file=self.stream,
            )
            return state, start
        return None, 0

    def _say_input(self, line: str) -> None:
        """Every process says which rows it reads (process 0 on the run's stream, the others on stderr)."""
        print(line, file=self.stream if is_primary() else sys.stderr)

    def _close(self, run: RunView, hooks: Hooks, stopped: BaseException | None) -> None:
        """Closes the run's services; after an early stop, the hooks' `on_run_stopped` (metrics are flushed)."""
        self._interrupt.uninstall()
        run.watchdog.stop()  # Nothing fires after training.
        if run.loader is not None:
            run.loader.close()
        if run.progress is not None:
            run.progress.close()
        run.writer.close()
        run.checkpoints.close()
        if stopped is not None:  # E.g. the loss plot of the steps logged so far.
            run_stopped(run, stopped, hooks.hooks, lambda line: print(line, file=self.stream))


__all__ = ["NonFiniteLossError", "TrainResult", "Trainer"]
