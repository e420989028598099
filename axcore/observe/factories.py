"""Registered metrics writers: configs that build a `MetricsWriter` for a run directory.

A metrics writer registered through `axcore_register_metrics_writers` is a
`MetricsWriterFactory`, a `Configurable` whose `create(run_dir)` returns a
`MetricsWriter`; `trainer.metrics_writers` lists them as `{type: <name>, ...}`. The
built-ins are `jsonl` (`metrics.jsonl` in the run directory) and `tensorboard`
(`tensorboard/`). This file imports neither hookspecs nor the plugin manager
(hookspecs validate registrations against `MetricsWriterFactory`).
"""

from __future__ import annotations

import pathlib
from typing import Annotated

from axcore.config import Configurable, Positive
from axcore.observe.writers import JsonlWriter, MetricsWriter, TensorBoardWriter, drop_records_after


class MetricsWriterFactory(Configurable):
    """Base of registered metrics writers: a config and `create(run_dir)`."""

    class Config(Configurable.Config):
        """Configures MetricsWriterFactory."""

    def create(self, run_dir: pathlib.Path) -> MetricsWriter:
        """A writer for the run in `run_dir` (created on first use if it does not exist)."""
        raise NotImplementedError(f"{type(self).__name__} must implement create(run_dir).")

    def create_resumed(self, run_dir: pathlib.Path, step: int) -> MetricsWriter:
        """A writer for a run resumed from checkpoint `step`: records of later steps (written before an
        interruption, and about to be redone) are dropped first. The default calls `create(run_dir)`."""
        return self.create(run_dir)


class JsonlWriterFactory(MetricsWriterFactory):
    """`JsonlWriter` of `<run_dir>/metrics.jsonl` (the loss plot is drawn from it)."""

    # File name inside the run directory.
    FILENAME = "metrics.jsonl"

    class Config(MetricsWriterFactory.Config):
        """Configures JsonlWriterFactory."""

        # fsync after every write, so a machine crash loses nothing written (slower).
        fsync: bool = False

    def create(self, run_dir: pathlib.Path) -> MetricsWriter:
        return JsonlWriter(pathlib.Path(run_dir) / self.FILENAME, fsync=self._config.fsync)

    def create_resumed(self, run_dir: pathlib.Path, step: int) -> MetricsWriter:
        drop_records_after(pathlib.Path(run_dir) / self.FILENAME, step)
        return self.create(run_dir)


class TensorBoardWriterFactory(MetricsWriterFactory):
    """`TensorBoardWriter` of `<run_dir>/tensorboard`."""

    class Config(MetricsWriterFactory.Config):
        """Configures TensorBoardWriterFactory."""

        # Event files reach the disk at least this often, in seconds.
        flush_secs: Annotated[float, Positive] = 10.0

    def create(self, run_dir: pathlib.Path) -> MetricsWriter:
        return TensorBoardWriter(pathlib.Path(run_dir) / "tensorboard", flush_secs=self._config.flush_secs)

    def create_resumed(self, run_dir: pathlib.Path, step: int) -> MetricsWriter:
        # TensorBoard's own rule: a "session start" event at step s+1 hides the earlier events of steps > s.
        return TensorBoardWriter(
            pathlib.Path(run_dir) / "tensorboard", flush_secs=self._config.flush_secs, purge_step=step + 1 if step else None
        )


# Registered names of the built-in metrics writers.
METRICS_WRITERS = {"jsonl": JsonlWriterFactory, "tensorboard": TensorBoardWriterFactory}
