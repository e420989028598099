"""`axcore eval RUN --tasks a,b`: lm-evaluation-harness's tasks on a run's checkpoint.

    results = evaluate_tasks("runs/x", ["hellaswag"], num_fewshot=0, limit=100)
    print(results_table(results))

The tasks are looked up first (lm-eval's built-in tasks plus the YAML files under
`include_path`), so an unknown name is refused before the checkpoint is loaded; then
lm-eval's `simple_evaluate` runs them on an `AxcoreLM` (`axcore.inference.lm_eval_model`)
built from the run. The result is lm-eval's own dict (`results`, `groups`, `configs`,
`versions`, `n-shot`, ...), whose metrics are lm-eval's (`acc,none`, `acc_norm,none`, ...).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from axcore.errors import did_you_mean
from axcore.inference.lm_eval_model import LmEvalError, import_lm_eval, register


def split_tasks(text: str) -> list[str]:
    """`"a, b,c"` -> `["a", "b", "c"]`; LmEvalError when no name is given."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise LmEvalError(f"--tasks {text!r} names no task; give lm-eval task names separated by commas.")
    return names


def task_manager(names: Sequence[str] = (), include_path: str | os.PathLike | None = None) -> Any:
    """lm-eval's TaskManager over its built-in tasks and `include_path` (a directory of task YAMLs); over
    `include_path` alone when every one of `names` is found there (indexing lm-eval's ~15,000 built-in task
    files takes half a minute on a small machine)."""
    import_lm_eval()
    from lm_eval.tasks import TaskManager

    if include_path is None:
        return TaskManager()
    if not os.path.isdir(include_path):
        raise LmEvalError(f"--include-path '{include_path}' is not a directory; pass the directory holding "
                          f"the task YAML files.")
    local = TaskManager(include_path=os.fspath(include_path), include_defaults=False)
    if names and all(local.match_tasks([name]) for name in names):
        return local
    return TaskManager(include_path=os.fspath(include_path))


def check_tasks(manager: Any, names: Sequence[str], include_path: str | os.PathLike | None = None) -> None:
    """LmEvalError naming the first of `names` (globs allowed) that matches no task, group or tag of `manager`."""
    for name in names:
        if not manager.match_tasks([name]):
            where = f" nor under --include-path {include_path}" if include_path else ""
            raise LmEvalError(f"Unknown lm-eval task '{name}' (--tasks): not one of lm-eval's tasks{where}"
                              f"{did_you_mean(name, manager.all_tasks)}; `lm-eval ls tasks` (older lm-eval: `lm_eval --tasks list`) lists them, and "
                              f"--include-path DIR adds a directory of task YAMLs.")


def evaluate_tasks(
    run: str | os.PathLike,
    tasks: Sequence[str],
    *,
    num_fewshot: int | None = None,
    limit: float | None = None,
    include_path: str | os.PathLike | None = None,
    batch_size: int | None = None,
    step: int | None = None,
    overrides: Sequence[str] = (),
    log_samples: bool = False,
    manager: Any = None,
) -> dict:
    """lm-eval's results of `tasks` on the checkpoint of `run` (module docstring).

    Args:
        run: a run directory, its checkpoints/ or one step's directory.
        tasks: lm-eval task, group or tag names (globs allowed).
        num_fewshot: examples in each prompt (None: each task's default).
        limit: documents per task (a value below 1: that fraction of them); None = all.
        include_path: a directory of task YAMLs added to lm-eval's own.
        batch_size: rows per forward pass (default 8).
        step, overrides: as `load_model`'s.
        log_samples: keep each document's requests and responses (`samples`).
        manager: a TaskManager to use instead of building one (tests).

    Raises:
        LmEvalError: lm-eval not installed, an unknown task, bad --num-fewshot/--limit/--include-path.
    """
    if num_fewshot is not None and num_fewshot < 0:
        raise LmEvalError(f"--num-fewshot must be >= 0, got {num_fewshot}.")
    if limit is not None and limit <= 0:
        raise LmEvalError(f"--limit must be > 0 (a count of documents, or a fraction below 1), got {limit}.")
    manager = manager if manager is not None else task_manager(tasks, include_path)
    check_tasks(manager, tasks, include_path)
    import lm_eval

    model = register()(run=os.fspath(run), step=step, overrides=list(overrides), batch_size=batch_size or 8)
    limit = int(limit) if limit is not None and limit >= 1 else limit
    return lm_eval.simple_evaluate(model=model, tasks=list(tasks), num_fewshot=num_fewshot, limit=limit,
                                   task_manager=manager, log_samples=log_samples)


def results_table(results: dict) -> str:
    """lm-eval's markdown table of the task metrics (and of the groups' where tasks form groups)."""
    from lm_eval.utils import make_table

    table = make_table(results)
    if results.get("groups"):
        table += "\n" + make_table(results, "groups")
    return table


def results_json(results: dict) -> str:
    """`results` as JSON (values lm-eval leaves unserialisable, e.g. numpy numbers, made plain)."""
    from lm_eval.utils import handle_non_serializable

    return json.dumps(results, indent=2, default=handle_non_serializable)


__all__ = ["check_tasks", "evaluate_tasks", "results_json", "results_table", "split_tasks", "task_manager"]
