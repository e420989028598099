"""The Hugging Face metadata an import keeps (`RUN/hf/`), found again for every run made from it.

`axcore convert hf-to-axcore` keeps the source's `config.json` (plus the dtype its tensors
were stored in) and tokenizer files in `OUT/hf/`; `axcore convert axcore-to-hf` writes them
back, so an export keeps what the model's math does not decide (`max_position_embeddings`,
bos/eos/pad ids, `model_type`, the tokenizer and its chat template).

Runs made from an import carry it too: `axcore lora init`, `import-peft` and `merge` copy
it into their output (`copy_kept`), and for a run made by `axcore train` with `init_from`
(which knows nothing of Hugging Face) `kept_dir` follows the run's saved config back to
where it came from: `init_from`, then `lora.base_run` (adapter-only checkpoints), then the
directory of the `tokenizer.path` when that is a kept `hf/` directory.
"""

from __future__ import annotations

import os
import pathlib
import shutil
from typing import Any

import yaml

from axcore.errors import AxcoreError
from axcore.inference.run_loading import locate_run
from axcore.placement.layout import CONFIG_FILE as RUN_CONFIG_FILE

# A run's directory of kept Hugging Face files, and the files kept (besides config.json).
KEPT_DIR = "hf"
KEPT_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json", "tokenizer.model",
    "chat_template.jinja", "chat_template.json",
)
CONFIG_FILE = "config.json"
# Runs followed back at most (a longer chain is a cycle or a mistake).
MAX_HOPS = 32


def _saved_config(run_dir: pathlib.Path) -> dict[str, Any]:
    """The run's saved config.yaml (else experiment.yaml) as plain data; {} when unreadable."""
    for name in (RUN_CONFIG_FILE, "experiment.yaml"):
        try:
            data = yaml.safe_load((run_dir / name).read_text("utf-8"))
        except (OSError, yaml.YAMLError, UnicodeDecodeError):
            continue
        if isinstance(data, dict):
            return data
    return {}


def _candidates(run_dir: pathlib.Path, saved: dict[str, Any]) -> list[pathlib.Path]:
    """The runs `run_dir` was made from, most direct first, as the saved config names them."""
    out = []
    base = saved.get("init_from")
    if isinstance(base, str) and base:
        path = pathlib.Path(os.path.expanduser(base))
        # Relative paths were relative to where `axcore train` ran; the run's parent is the usual place.
        out += [path] if path.is_absolute() else [path, run_dir.parent / path]
    lora = saved.get("lora")
    if isinstance(lora, dict) and isinstance(lora.get("base_run"), str) and lora["base_run"]:
        out.append(pathlib.Path(lora["base_run"]))
    return out


def kept_dir(run_dir: str | os.PathLike) -> pathlib.Path | None:
    """The kept `hf/` directory of run `run_dir` or of the run it was made from (module docstring); None if none.

    `run_dir` may also be its `checkpoints/` or a step directory. Only a directory holding a
    `config.json` counts.
    """
    try:
        run_dir = locate_run(run_dir).run_dir
    except AxcoreError:
        pass  # Followed as it is (a missing run has nothing kept).
    todo, seen = [pathlib.Path(run_dir)], set()
    tokenizer_dirs: list[pathlib.Path] = []
    while todo and len(seen) < MAX_HOPS:
        run = todo.pop(0)
        try:
            key = run.resolve()
        except OSError:
            continue
        if key in seen or not key.is_dir():
            continue
        seen.add(key)
        if (key / KEPT_DIR / CONFIG_FILE).is_file():
            return key / KEPT_DIR
        saved = _saved_config(key)
        todo += _candidates(key, saved)
        path = (saved.get("tokenizer") or {}).get("path") if isinstance(saved.get("tokenizer"), dict) else None
        if isinstance(path, str) and path:
            tokenizer_dirs.append(pathlib.Path(os.path.expanduser(path)).parent)
    for directory in tokenizer_dirs:  # Last: the tokenizer says where it came from, not the model.
        if directory.name == KEPT_DIR and (directory / CONFIG_FILE).is_file():
            return directory
    return None


def copy_kept(source_run: str | os.PathLike, out: str | os.PathLike) -> pathlib.Path | None:
    """Copies the kept `hf/` directory of `source_run` (`kept_dir`) to `out/hf/`; returns it (None: nothing kept)."""
    found = kept_dir(source_run)
    if found is None:
        return None
    target = pathlib.Path(out) / KEPT_DIR
    target.mkdir(parents=True, exist_ok=True)
    for name in (CONFIG_FILE, *KEPT_FILES):
        if (found / name).is_file():
            shutil.copyfile(found / name, target / name)
    return target
