"""The run directory's layout: the names of what `axcore train` writes there, stated once.

    <run_dir>/config.yaml        the resolved experiment (`config_path`; `axcore train` and run loading read it)
    <run_dir>/config.txt         the same as flat `path = value` lines, for people
    <run_dir>/checkpoints/       one directory per committed step, named by the backend (`checkpoints_path`;
                                 `CheckpointBackend.step_of` parses a name)
    <run_dir>/.lock              held while a process trains in the directory
    <run_dir>/FAILED             written when a run stops on an error
    <run_dir>/INTERRUPTED        written when Ctrl-C stopped a run (says what was saved, how to resume)

Every module that names these parts imports them from here (the trainer's run directory,
resume and existing-run checks, run loading, the importers of the hf and lora plugins).
Pure names and path joins: nothing here touches the file system.
"""

from __future__ import annotations

import os
import pathlib

# The resolved experiment, written when a run starts.
CONFIG_FILE = "config.yaml"
# The resolved experiment as flat `path = value` lines, for people (`Experiment.save`).
CONFIG_TEXT_FILE = "config.txt"
# The directory of the checkpoint backend (one entry per saved step).
CHECKPOINTS_DIR = "checkpoints"
# The lock file of a run directory in use.
LOCK_FILE = ".lock"
# Marks a run that stopped on an error.
FAILED_FILE = "FAILED"
# Marks a run stopped by Ctrl-C; holds the line saying what was saved and how to resume.
INTERRUPTED_FILE = "INTERRUPTED"


def config_path(run_dir: str | os.PathLike) -> pathlib.Path:
    """`<run_dir>/config.yaml`: the run's resolved experiment."""
    return pathlib.Path(run_dir) / CONFIG_FILE


def checkpoints_path(run_dir: str | os.PathLike) -> pathlib.Path:
    """`<run_dir>/checkpoints`: the directory the run's checkpoint backend writes."""
    return pathlib.Path(run_dir) / CHECKPOINTS_DIR


__all__ = ["CHECKPOINTS_DIR", "CONFIG_FILE", "CONFIG_TEXT_FILE", "FAILED_FILE", "INTERRUPTED_FILE", "LOCK_FILE", "checkpoints_path",
           "config_path"]
