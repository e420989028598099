"""`axcore train` on prepared shards checks them: a flipped byte inside a shard's data (which sizes and
headers do not show) and a truncated shard are each refused in one line naming the file, exit 2, no
traceback, no step trained on it; the intact corpus trains. Each run is a subprocess, as a user runs it."""

import json
import os
import random
import subprocess
import sys

import pytest

from axcore.data.prepare import prepare
from axcore.testing import TINY_OVERRIDES

pytestmark = pytest.mark.slow

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "end."]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A prepared corpus of one shard (byte tokens, as the default experiment's tokenizer)."""
    root = tmp_path_factory.mktemp("shards")
    rng = random.Random(0)
    with open(root / "a.jsonl", "w") as f:
        for _ in range(200):
            f.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 60)))}) + "\n")
    index = prepare([str(root / "a.jsonl")], str(root / "data"), workers=1)
    assert len(index["shards"]) == 1
    return root / "data"


def _train(data, run_dir):
    overrides = [
        *TINY_OVERRIDES, f"trainer.run_dir={run_dir}", "trainer.max_steps=2", "trainer.eval_every=0",
        "trainer.sample.num_tokens=4", f"input.source={{type: prepared, paths: [{data}]}}",
    ]
    command = [sys.executable, "-m", "axcore.cli", "train", "default", *(a for o in overrides for a in ("--set", o))]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu"})


def _copy(corpus, tmp_path):
    copy = tmp_path / "data"
    copy.mkdir()
    for entry in corpus.iterdir():
        (copy / entry.name).write_bytes(entry.read_bytes())
    return copy


def _assert_refused(result, file):
    errors = [line for line in result.stderr.splitlines() if line.startswith("axcore: error:")]
    assert result.returncode == 2, result.stderr[-3000:]
    assert len(errors) == 1 and f"'{file}'" in errors[0], result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "step 1/" not in result.stdout + result.stderr, result.stderr[-3000:]


def test_a_flipped_byte_in_a_shard_is_refused_naming_it(tmp_path, corpus):
    data = _copy(corpus, tmp_path)
    tokens = data / "shard-00000.tokens.npy"
    raw = bytearray(tokens.read_bytes())
    raw[len(raw) // 2] ^= 0x01  # Inside the token data: size and header still match.
    tokens.write_bytes(bytes(raw))
    result = _train(data, tmp_path / "run")
    _assert_refused(result, tokens)
    assert "does not match its sha256" in result.stderr


def test_a_truncated_shard_is_refused_naming_it(tmp_path, corpus):
    data = _copy(corpus, tmp_path)
    tokens = data / "shard-00000.tokens.npy"
    tokens.write_bytes(tokens.read_bytes()[:-10])
    result = _train(data, tmp_path / "run")
    _assert_refused(result, tokens)
    assert "truncated" in result.stderr


def test_the_intact_corpus_trains(tmp_path, corpus):
    result = _train(corpus, tmp_path / "run")
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "run" / "metrics.jsonl").exists()
