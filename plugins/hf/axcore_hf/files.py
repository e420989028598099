"""Reading and writing Hugging Face model directories: config.json and safetensors (single or sharded).

A directory holds `config.json` and either `model.safetensors` or a sharded set
`model-00001-of-0000N.safetensors` ... with `model.safetensors.index.json`
(`{"metadata": {"total_size": bytes}, "weight_map": {tensor name: shard file}}`).
Tensors are read and written through safetensors' NumPy API; bfloat16 is
`ml_dtypes.bfloat16` (which JAX ships), so bf16 tensors pass through bit for bit.
"""

from __future__ import annotations

import json
import os
import pathlib
import tempfile
from collections.abc import Mapping
from typing import Any

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from axcore.checkpoint.interop import ConversionError

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# NumPy dtypes by the names Hugging Face configs use (`torch_dtype` / `dtype`).
DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16)}


def read_config(directory: pathlib.Path) -> dict[str, Any]:
    """`directory/config.json` as a dict.

    Raises:
        ConversionError: the directory or file is missing, or the file is not a JSON object.
    """
    path = directory / CONFIG_FILE
    if not directory.is_dir():
        raise ConversionError(
            f"{directory} is not a directory; pass a Hugging Face model directory (config.json, *.safetensors)."
        )
    try:
        data = json.loads(path.read_text("utf-8"))
    except FileNotFoundError:
        raise ConversionError(f"{path} does not exist; a Hugging Face model directory needs its config.json.") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConversionError(f"{path} is not readable JSON ({type(e).__name__}: {e}); fix or re-download it.") from None
    if not isinstance(data, dict):
        raise ConversionError(f"{path} holds {type(data).__name__}, not a JSON object; fix or re-download it.")
    return data


def _tensor_files(directory: pathlib.Path) -> dict[pathlib.Path, list[str] | None]:
    """Safetensors file -> the tensor names the index assigns it (None: all of a single file)."""
    index = directory / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text("utf-8"))["weight_map"]
            assert isinstance(weight_map, dict)
        except (OSError, ValueError, KeyError, TypeError, AssertionError) as e:
            raise ConversionError(
                f"{index} has no readable 'weight_map' ({type(e).__name__}: {e}); fix or re-download it."
            ) from None
        files: dict[pathlib.Path, list[str] | None] = {}
        for name, file in weight_map.items():
            files.setdefault(directory / str(file), []).append(name)
        return files
    if (directory / SINGLE_FILE).exists():
        return {directory / SINGLE_FILE: None}
    raise ConversionError(
        f"{directory} has neither {SINGLE_FILE} nor {INDEX_FILE}; only safetensors checkpoints are read "
        f"(convert a pytorch_model.bin with transformers' save_pretrained(safe_serialization=True))."
    )


def read_tensors(directory: pathlib.Path) -> dict[str, np.ndarray]:
    """Every tensor of the directory's safetensors file(s): `{name: array}` in its stored dtype.

    Raises:
        ConversionError: a file is missing or unreadable, or the index names a tensor its shard lacks.
    """
    out: dict[str, np.ndarray] = {}
    for path, names in _tensor_files(directory).items():
        if not path.exists():
            raise ConversionError(f"{path}, named in {directory / INDEX_FILE}, does not exist; re-download the model.")
        try:
            with safe_open(str(path), framework="np") as f:
                available = set(f.keys())
                for name in names if names is not None else sorted(available):
                    if name not in available:
                        raise ConversionError(
                            f"{directory / INDEX_FILE} puts tensor '{name}' in {path.name}, which lacks it; "
                            f"re-download the model."
                        )
                    out[name] = f.get_tensor(name)
        except (SafetensorError, OSError, TypeError, ValueError) as e:
            raise ConversionError(f"{path} is not a readable safetensors file ({type(e).__name__}: {e}).") from None
    return out


def parse_size(text: str) -> int:
    """'5GB', '200MB', '10KiB' or a byte count -> bytes (decimal units, like transformers' max_shard_size)."""
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}
    upper = text.strip().upper()
    for unit, factor in units.items():
        if upper.endswith(unit) and upper[: -len(unit)].strip().replace(".", "", 1).isdigit():
            return int(float(upper[: -len(unit)]) * factor)
    if upper.isdigit():
        return int(upper)
    raise ConversionError(f"--max-shard-size {text!r} is not a size; write e.g. 5GB, 200MB or a number of bytes.")


def write_tensors(directory: pathlib.Path, tensors: Mapping[str, np.ndarray], max_shard_bytes: int | None) -> list[str]:
    """Writes `tensors` as one `model.safetensors`, or as shards of at most `max_shard_bytes` plus an index.

    Tensors go into shards in name order; a tensor larger than the limit gets a shard
    of its own. Returns the names of the files written.
    """
    names = sorted(tensors)
    shards: list[list[str]] = [[]]
    size = 0
    for name in names:
        nbytes = tensors[name].nbytes
        if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    metadata = {"format": "pt"}  # transformers refuses safetensors files without it.
    if len(shards) == 1:
        save_file({n: np.ascontiguousarray(tensors[n]) for n in names}, str(directory / SINGLE_FILE), metadata=metadata)
        return [SINGLE_FILE]
    files, weight_map = [], {}
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: np.ascontiguousarray(tensors[n]) for n in shard}, str(directory / file), metadata=metadata)
        files.append(file)
        weight_map.update({n: file for n in shard})
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", "utf-8")
    return [*files, INDEX_FILE]


def write_config(directory: pathlib.Path, config: Mapping[str, Any]) -> None:
    (directory / CONFIG_FILE).write_text(json.dumps(dict(config), indent=2, sort_keys=True) + "\n", "utf-8")


def dtype_of(name: str, where: str) -> np.dtype:
    """The NumPy dtype of a Hugging Face dtype name (`bfloat16`, `float32`, `float16`)."""
    name = name.removeprefix("torch.")
    if name not in DTYPES:
        raise ConversionError(f"{where}: dtype {name!r} is not supported; use one of {', '.join(DTYPES)}.")
    return DTYPES[name]


def fsync_tree(directory: pathlib.Path) -> None:
    """Flushes every file under `directory` to disk (before it is renamed into place)."""
    for root, _, files in os.walk(directory):
        for file in files:
            with open(os.path.join(root, file), "rb") as f:
                os.fsync(f.fileno())


def fresh_dir(out: pathlib.Path) -> pathlib.Path:
    """A new temporary directory beside `out` (same filesystem, so `publish` can rename it into place).

    Raises:
        ConversionError: `out` exists.
    """
    if out.exists():
        raise ConversionError(f"{out} already exists; choose a new output directory or remove it.")
    out.parent.mkdir(parents=True, exist_ok=True)
    return pathlib.Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))


def publish(tmp: pathlib.Path, out: pathlib.Path) -> None:
    """Renames the finished temporary directory `tmp` (`fresh_dir`) to `out`: it appears complete or not at all."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp made it private; OUT gets the usual permissions.
    fsync_tree(tmp)
    os.rename(tmp, out)
