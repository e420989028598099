"""The input pipeline of a placed experiment: pipelines per data shard, checkpointed state, data_wait.

Below the trainer (which checkpoints the state and meters the wait) and inference (whose
`axcore eval` reads the experiment's eval split through `input_pipeline`).

- `input_pipeline(...)`: the experiment's `InputConfig` pipeline for this process's data
  shards (`axcore.data.device_loader.shard_layout`).
- `gather_input_state(state)`: every process's pipeline state merged into one (each
  process holds its own shards' states), for the checkpoint metadata's "input" (process 0
  writes it; the backend's metadata checksum verifies it).
- `restore_input_state(pipeline, state, layout)`: a resumed process takes its shards'
  states; a checkpoint cut into another number of data shards is refused in one line.
- `DataWaitMeter`: `train/data_wait` (seconds per step the loop waited for its next
  batch) and `train/data_wait_fraction` (its share of the step time), with one warning
  line on the run's stream when the loader, not the step, is the bottleneck.
"""

from __future__ import annotations

from typing import Any, TextIO

from axcore.data import DataError, Split
from axcore.data.device_loader import ShardLayout
from axcore.platform.distributed import allgather_json

# Share of the step time spent waiting for data above which DataWaitMeter warns.
DATA_WAIT_WARN_FRACTION = 0.1
# Logging intervals not judged at the start of a run (compilation, the first reads).
DATA_WAIT_SKIP_INTERVALS = 1


def input_pipeline(input_config: Any, split: Split, tokenizer: Any, vocab_size: int | None, layout: ShardLayout,
                   *, component: str | None = None) -> Any:
    """`input_config`'s pipeline of `split` for the shards of `layout` (rows `[layout.local_rows, seq_len]`);
    `component`: only that mixture component's rows (`InputConfig.make_pipeline`)."""
    return input_config.make_pipeline(
        split, tokenizer, vocab_size=vocab_size, shards=list(layout.shards), num_shards=layout.num_shards,
        component=component,
    )


def merge_input_states(states: list[dict]) -> dict:
    """Pipeline states of disjoint data shards (one per process) as one state holding every shard."""
    merged = dict(states[0])
    shards: dict[str, Any] = {}
    for one in states:
        shards.update(one.get("shards", {}))
    merged["shards"] = dict(sorted(shards.items(), key=lambda kv: int(kv[0])))
    return merged


def gather_input_state(state: dict) -> dict:
    """Every process's pipeline state (a collective: all processes call it) merged into one."""
    return merge_input_states(allgather_json(state))


def restore_input_state(pipeline: Any, state: Any, layout: ShardLayout, where: str) -> None:
    """Continues `pipeline` from a checkpoint's merged input `state`.

    Raises:
        DataError: the state was cut into another number of data shards, or lacks a
            shard this process reads (one line, naming `where`, the checkpoint).
    """
    if not isinstance(state, dict) or "shards" not in state:
        raise DataError(
            f"The input state in {where} is not a sharded pipeline state (it holds {str(state)[:80]}); it was "
            f"written by an older axcore: start a new run directory, or restore only its parameters."
        )
    saved = int(state.get("num_shards", -1))
    if saved != layout.num_shards:
        raise DataError(
            f"The checkpoint {where} cut the batch into {saved} data shards, this run into {layout.num_shards}; "
            f"set input.data_shards={saved} (any process count whose rows are whole shards resumes exactly)."
        )
    try:
        pipeline.set_state(state)  # Also refuses a state that lacks one of this process's shards.
    except DataError as e:
        raise DataError(f"The input state in {where}: {e}") from None


class DataWaitMeter:
    """Per logging interval: data_wait metrics, and one warning line when data is the bottleneck."""

    def __init__(self, stream: TextIO, threshold: float = DATA_WAIT_WARN_FRACTION,
                 skip_intervals: int = DATA_WAIT_SKIP_INTERVALS):
        self.stream, self.threshold, self.skip = stream, threshold, skip_intervals
        self.intervals = 0
        self.warned = False

    def interval(self, wait_s: float, steps: int, step_time: float, first: int, last: int) -> dict[str, float]:
        """Metrics of `steps` steps (`first`..`last`) of `step_time` s each that waited `wait_s` s in all."""
        per_step = wait_s / max(steps, 1)
        fraction = per_step / step_time if step_time > 0 else 0.0
        self.intervals += 1
        if not self.warned and self.intervals > self.skip and fraction > self.threshold:
            self.warned = True
            print(
                f"Warning: the input pipeline is the bottleneck: steps {first}..{last} waited {per_step * 1e3:.1f} ms "
                f"per step for data ({fraction:.0%} of {step_time * 1e3:.1f} ms); use prepared shards (axcore "
                f"prepare), raise input.prefetch, or lighten packing.",
                file=self.stream,
            )
        return {"train/data_wait": per_step, "train/data_wait_fraction": fraction}


__all__ = ["DataWaitMeter", "gather_input_state", "input_pipeline", "merge_input_states", "restore_input_state"]
