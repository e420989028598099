"""Security promises (docs/reliability.md): no code runs from a config, checkpoint or run
file, and names cannot reach outside the directory they were given.

- No unsafe deserializer anywhere in axcore, its hardware packages or its plugins
  (a scan of the source: pickle, marshal, yaml.load with a full loader, numpy's
  allow_pickle, eval/exec of anything but our own annotations).
- Components are resolved by registered name only: an import path or a Python
  callable's name is an unknown component.
- `name` cannot contain a path; checkpoints refuse an array name that would escape
  their directory, even with a matching checksum.
"""

from __future__ import annotations

import json
import pathlib
import re
import zlib

import jax.numpy as jnp
import numpy as np
import pytest

from axcore import cli
from axcore.checkpoint import CheckpointError, TensorStoreBackend
from axcore.errors import UnknownComponentError
from axcore.experiment import load_experiment

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCES = [
    p
    for d in ("axcore", "axcore_gpu", "axcore_cpu", "axcore_tpu", "axcore_neuron", "plugins")
    for p in (ROOT / d).rglob("*.py")
    if "build" not in p.parts and ".egg-info" not in str(p)
]

# Calls that would run code or build arbitrary objects from bytes a user or a file supplies.
UNSAFE = {
    r"\bimport pickle\b|\bpickle\.load": "pickle",
    r"\bmarshal\.loads?\b": "marshal",
    r"\b(cloudpickle|dill)\b": "cloudpickle/dill",
    r"\byaml\.(load|load_all|unsafe_load|full_load)\(": "yaml.load without the safe loader",
    r"yaml\.(Unsafe|Full)?Loader\b": "a non-safe YAML loader",
    r"allow_pickle\s*=\s*True": "numpy allow_pickle",
    r"\bexec\(": "exec",
    r"\b__import__\(": "__import__",
}
# The one eval: config annotations of our own classes (axcore/config/base.py, field_types).
ALLOWED_EVAL = {ROOT / "axcore" / "config" / "base.py"}


def test_the_scan_sees_the_sources():
    assert len(SOURCES) > 100
    assert ROOT / "axcore" / "config" / "safe_yaml.py" in SOURCES


@pytest.mark.parametrize("pattern, what", list(UNSAFE.items()))
def test_no_unsafe_deserialization_anywhere(pattern, what):
    offenders = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in SOURCES
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(pattern, line) and not line.lstrip().startswith("#")
    ]
    assert not offenders, f"{what} in {offenders}"


def test_eval_is_used_only_on_our_own_annotations():
    offenders = [
        str(p.relative_to(ROOT))
        for p in SOURCES
        if p not in ALLOWED_EVAL and re.search(r"(?<![.\w])eval\(", p.read_text())
    ]
    assert not offenders


@pytest.mark.parametrize(
    "override",
    [
        "model.type=os.system",
        "model.decoder.layer.norm.type=axcore.layers.basic.RMSNorm",
        "trainer.learner.optimizer.type=builtins.eval",
        "input.source.type=subprocess.Popen",
    ],
)
def test_components_are_registered_names_never_import_paths(override):
    with pytest.raises(UnknownComponentError, match="registered|No "):
        load_experiment("default", [override])


@pytest.mark.parametrize("name", ["../../etc", "a/b", "/abs", ".hidden", "x" * 101, "nul\x00l"])
def test_names_cannot_hold_a_path(name, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", "default", "--set", f"name={json.dumps(name)}"]) == 2
    assert "'name' must be 1-100 letters, digits" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_checkpoint_cannot_point_outside_its_directory(tmp_path):
    """A crafted index naming `../..` (with a checksum that matches) is refused, never read."""
    secret = tmp_path / "outside"
    directory = tmp_path / "ckpt"
    state = {"w": jnp.arange(16, dtype=jnp.float32)}
    with TensorStoreBackend(directory, async_save=False) as backend:
        backend.save(1, state, {"step": 1})
        backend.save(2, state, {"step": 2})
    # A valid array elsewhere, which the crafted index points at.
    with TensorStoreBackend(secret, async_save=False) as other:
        other.save(1, {"w": jnp.full(16, 7.0, jnp.float32)}, {"step": 1})
    step_dir = directory / "step_00000002"
    index = json.loads((step_dir / "index.json").read_text())
    escape = "../../../outside/step_00000001/arrays/w"
    index["arrays"][0]["name"] = escape
    text = json.dumps(index)
    (step_dir / "index.json").write_text(text)
    marker = json.loads((step_dir / "COMMITTED").read_text())
    marker["index_crc32"] = zlib.crc32(text.encode())
    (step_dir / "COMMITTED").write_text(json.dumps(marker))
    target = {"w": jnp.zeros(16, jnp.float32)}
    with TensorStoreBackend(directory) as backend:
        with pytest.raises(CheckpointError, match="is not one this backend writes") as raised:
            backend.restore(target, 2)
        assert "\n" not in str(raised.value)
        restored, metadata = backend.restore(target, 1)  # The intact step is unaffected.
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.arange(16, dtype=np.float32))
