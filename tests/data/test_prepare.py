"""`axcore prepare`: the same shards for 1 and 2 workers, tokens equal to an independent encode, resume after a
kill, chat loss masks, and one-line errors for bad inputs. Corpora are generated here (a few hundred KB)."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from axcore.cli import main
from axcore.data import DataError, prepare as prepare_module
from axcore.data.prepare import plan_units, prepare
from axcore.data.shards import PreparedShards

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "café", "naïve", "übung", "42,", "end."]


def _texts(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 120))) for _ in range(count)]


def _write_jsonl(path, texts, field="text"):
    with open(path, "w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({field: text, "id": 1}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Two JSONL files (about 250 KB in all) and their texts in order."""
    root = tmp_path_factory.mktemp("corpus")
    a, b = _texts(1, 700), _texts(2, 300)
    _write_jsonl(root / "a.jsonl", a)
    _write_jsonl(root / "b.jsonl", b)
    return root, a + b


@pytest.fixture(scope="module")
def bpe_file(tmp_path_factory):
    """A byte-level BPE tokenizer.json (vocab 300) trained here on generated text; nothing downloaded."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_texts(3, 500), trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return str(path)


def _hf_config(path):
    tokenizer = pytest.importorskip("axcore_tokenizers.tokenizer")
    return tokenizer.HFTokenizer.default_config().set(path=path)


def _files(directory) -> dict[str, bytes]:
    return {name: open(os.path.join(directory, name), "rb").read() for name in sorted(os.listdir(directory))}


def _documents(directory) -> list[np.ndarray]:
    shards = PreparedShards(str(directory))
    return [shards.document(i)["tokens"] for i in range(shards.num_documents)]


SMALL = 0.04  # MB per shard: the corpus makes about 6 shards.


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_one_and_two_workers_write_identical_shards_holding_each_documents_tokens(tmp_path, corpus, bpe_file, tokenizer):
    root, texts = corpus
    config = None if tokenizer == "bytes" else _hf_config(bpe_file)
    one = prepare([str(root)], str(tmp_path / "one"), tokenizer=config, workers=1, shard_size_mb=SMALL)
    two = prepare([str(root / "*.jsonl")], str(tmp_path / "two"), tokenizer=config, workers=2, shard_size_mb=SMALL)
    assert len(one["shards"]) >= 4 and one == two
    assert _files(tmp_path / "one") == _files(tmp_path / "two")
    if tokenizer == "bytes":
        expected = [list(t.encode("utf-8")) for t in texts]
    else:
        import tokenizers

        reference = tokenizers.Tokenizer.from_file(bpe_file)  # Independent of axcore's HFTokenizer.
        expected = [reference.encode(t, add_special_tokens=False).ids for t in texts]
    got = _documents(tmp_path / "two")
    assert len(got) == len(expected) == one["documents"]
    for want, have in zip(expected, got):
        assert have.tolist() == want
    assert one["tokens"] == sum(map(len, expected))
    assert one["dtype"] == "uint16" and one["loss_mask"] is False


def test_units_depend_on_the_input_alone_and_cut_at_line_starts(corpus):
    root, _ = corpus
    files = [str(root / "a.jsonl"), str(root / "b.jsonl")]
    units = plan_units(files, "jsonl", "text", 50_000)
    assert units == plan_units(files, "jsonl", "text", 50_000)
    covered = {f: 0 for f in files}
    for unit in units:
        assert 50_000 <= unit["bytes"] < 50_000 + 2_000 or unit is units[-1]
        for piece in unit["pieces"]:
            assert piece["start"] == covered[piece["path"]]  # Contiguous, in order, nothing skipped.
            covered[piece["path"]] = piece["end"]
            data = open(piece["path"], "rb").read()
            assert piece["start"] == 0 or data[piece["start"] - 1 : piece["start"]] == b"\n"
    assert covered == {f: os.path.getsize(f) for f in files}


class _Killed(Exception):
    """Stands for the process dying."""


def test_resume_after_a_failure_redoes_only_unfinished_shards(tmp_path, corpus, monkeypatch):
    root, _ = corpus
    reference = prepare([str(root)], str(tmp_path / "ref"), workers=1, shard_size_mb=SMALL)
    real_write = prepare_module.write_shard
    calls = []
    resumed = False

    def failing_write(directory, name, tokens, offsets, loss_mask, extra):
        calls.append(name)
        if len(calls) == 3 and not resumed:  # Killed while writing the third shard: a partial file under its final name, no done.json.
            open(os.path.join(directory, f"{name}.tokens.npy"), "wb").write(b"\x93NUMPY partial")
            open(os.path.join(directory, f"{name}.offsets.npy.tmp-1"), "wb").write(b"partial")
            raise _Killed
        return real_write(directory, name, tokens, offsets, loss_mask, extra)

    monkeypatch.setattr(prepare_module, "write_shard", failing_write)
    out = tmp_path / "out"
    with pytest.raises(_Killed):
        prepare([str(root)], str(out), workers=1, shard_size_mb=SMALL)
    assert not (out / "index.json").exists() and not (out / "shard-00002.done.json").exists()
    with pytest.raises(DataError, match="has no index.json"):
        PreparedShards(str(out))
    finished = {n: os.stat(out / f"{n}.tokens.npy").st_mtime_ns for n in ("shard-00000", "shard-00001")}
    calls.clear()
    resumed = True
    index = prepare([str(root)], str(out), workers=1, shard_size_mb=SMALL)
    assert calls[0] == "shard-00002" and "shard-00000" not in calls and "shard-00001" not in calls
    assert {n: os.stat(out / f"{n}.tokens.npy").st_mtime_ns for n in finished} == finished
    assert index == reference
    assert _files(out) == _files(tmp_path / "ref")  # The leftover temporary file is gone too.


_KILLABLE = """
import sys
from axcore_tokenizers.tokenizer import HFTokenizer
from axcore.data.prepare import prepare
corpus, output, tokenizer_file, workers = sys.argv[1:]
config = HFTokenizer.default_config().set(path=tokenizer_file)
prepare([corpus], output, tokenizer=config, workers=int(workers), shard_size_mb=0.05)
"""


def test_killed_run_restarted_gives_the_same_shards(tmp_path, bpe_file):
    """A real SIGKILL of a prepare process (2 workers) after some shards are done; the restart finishes them."""
    _hf_config(bpe_file)  # Skips without the plugin.
    corpus = _write_jsonl(tmp_path / "c.jsonl", _texts(5, 4000))  # About 1 MB, 30 shards: slow enough to kill halfway.
    out = tmp_path / "out"
    process = subprocess.Popen(
        [sys.executable, "-c", _KILLABLE, corpus, str(out), bpe_file, "2"], start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        if out.exists() and len([n for n in os.listdir(out) if n.endswith(".done.json")]) >= 2:
            break
        time.sleep(0.01)
    assert process.poll() is None, "prepare ended before it could be killed"
    os.killpg(process.pid, signal.SIGKILL)  # The process and its workers.
    process.wait()
    done = [n for n in os.listdir(out) if n.endswith(".done.json")]
    assert len(done) >= 2 and not (out / "index.json").exists()
    config = _hf_config(bpe_file)
    index = prepare([corpus], str(out), tokenizer=config, workers=1, shard_size_mb=0.05)
    reference = prepare([corpus], str(tmp_path / "ref"), tokenizer=config, workers=1, shard_size_mb=0.05, verify=True)
    assert len(done) < len(index["shards"]) and index["shards"] == reference["shards"]
    PreparedShards(str(out)).verify()
    mine, theirs = _files(out), _files(tmp_path / "ref")
    assert mine.keys() == theirs.keys()
    for name in mine:
        if name not in ("prepare.json", "index.json"):  # Those two name the output directory's path.
            assert mine[name] == theirs[name], name


def test_experiment_tokenizer(tmp_path, corpus, bpe_file):
    """`--experiment` builds the experiment's tokenizer: the shards carry its fingerprint."""
    from axcore.experiment import load_experiment

    root, _ = corpus
    overrides = ["plugins=[hf_tokenizer]", f"tokenizer={{type: hf, path: {bpe_file}}}", "model.vocab_size=300"]
    _hf_config(bpe_file)
    sets = [word for o in overrides for word in ("--set", o)]
    assert main(["prepare", str(root / "b.jsonl"), "-o", str(tmp_path / "out"), "--experiment", "default", *sets]) == 0
    fingerprint = load_experiment("default", overrides).config.tokenizer.instantiate().fingerprint()
    shards = PreparedShards(str(tmp_path / "out"))
    shards.check_tokenizer(fingerprint, "test")
    assert shards.fingerprint["name"] == "HFTokenizer" and shards.fingerprint["vocab_size"] == 300


def test_text_and_parquet_inputs(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    texts = _texts(6, 50)
    (tmp_path / "txt").mkdir()
    for i, text in enumerate(texts[:3]):
        (tmp_path / "txt" / f"{i}.txt").write_text(text, encoding="utf-8")
    prepare([str(tmp_path / "txt")], str(tmp_path / "t"), format="text", workers=1)
    assert [d.tolist() for d in _documents(tmp_path / "t")] == [list(t.encode()) for t in texts[:3]]
    pq.write_table(pa.table({"body": texts}), tmp_path / "p.parquet", row_group_size=7)
    index = prepare([str(tmp_path / "p.parquet")], str(tmp_path / "p"), format="parquet", field="body", shard_size_mb=0.001, workers=1)
    assert len(index["shards"]) > 1
    assert [d.tolist() for d in _documents(tmp_path / "p")] == [list(t.encode()) for t in texts]


def test_chat_shards_carry_the_loss_mask(tmp_path):
    from axcore.data.chat import DEFAULT_TEMPLATE, ChatTemplate, render_chat
    from axcore.data.tokenizer import ByteTokenizer

    records = [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
        [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}, {"role": "user", "content": "x"},
         {"role": "assistant", "content": "y"}],
    ]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in records))
    index = prepare([str(path)], str(tmp_path / "out"), format="chat", workers=1)
    assert index["loss_mask"] is True and index["chat"]["train_on"] == "assistant"
    shards = PreparedShards(str(tmp_path / "out"))
    template = ChatTemplate(DEFAULT_TEMPLATE)
    for i, messages in enumerate(records):
        got = shards.document(i)
        want = render_chat(messages, ByteTokenizer(), template, where="test")
        np.testing.assert_array_equal(got["tokens"], want["tokens"])
        np.testing.assert_array_equal(got["loss_mask"], want["loss_mask"])
        text = bytes(got["tokens"].astype(np.uint8)).decode()
        weighted = bytes(got["tokens"][got["loss_mask"] == 1].astype(np.uint8)).decode()
        replies = [m["content"] + "<|end|>" for m in messages if m["role"] == "assistant"]
        assert weighted == "".join(replies) and text.startswith("<|")  # Only the replies carry weight.


def test_progress_lines(tmp_path, corpus):
    import io

    root, _ = corpus
    stream = io.StringIO()
    prepare([str(root)], str(tmp_path / "out"), workers=1, shard_size_mb=SMALL, stream=stream)
    last = stream.getvalue().strip().splitlines()[-1]
    assert last.startswith("prepare: ") and "1,000 documents" in last and "tokens" in last
    assert "MB/s" in last and "ETA" in last


def test_the_command_says_its_plan_and_its_verification(tmp_path, corpus):
    # A subprocess, as a user runs it: the plan comes first, and the sha256 pass (seconds on a large
    # dataset) is announced before it starts, both on stderr; stdout keeps the one summary line.
    root, _ = corpus
    argv = [sys.executable, "-m", "axcore.cli", "prepare", str(root), "-o", str(tmp_path / "out"), "--workers", "1",
            "--shard-size-mb", str(SMALL), "--verify"]
    files = sorted(p for p in root.rglob("*") if p.is_file())
    first = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    err = first.stderr.splitlines()
    shards = len(PreparedShards(str(tmp_path / "out")).index["shards"])
    megabytes = sum(p.stat().st_size for p in files) / 1e6
    assert err[0] == (f"prepare: {len(files)} files, {megabytes:.1f} MB in {shards} shards (0 done before), "
                      f"tokenizer ByteTokenizer, 1 worker")
    assert err[-1] == f"prepare: verifying the {shards} shards and the index (sha256)..."
    assert len(first.stdout.splitlines()) == 1 and "verified" in first.stdout
    again = subprocess.run(argv, capture_output=True, text=True, timeout=300)  # Already prepared: verified only.
    assert again.returncode == 0, again.stderr
    assert again.stderr.splitlines() == [
        f"prepare: {tmp_path / 'out'} is already prepared from these inputs; verifying its files (sha256)..."]


def _error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()  # Progress lines, then the error.
    assert err[-1].startswith("axcore: error: ") and all(line.startswith("prepare: ") for line in err[:-1])
    return err[-1]


def test_bad_inputs_are_one_line_errors(tmp_path, capsys, corpus):
    root, _ = corpus
    out = str(tmp_path / "out")
    assert "INPUT[0]: '" in _error(capsys, ["prepare", str(tmp_path / "missing.jsonl"), "-o", out])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n' * 300 + '{"txt": "b"}\n' + '{"text": "a"}\n' * 10)  # Line 301, in a later shard.
    argv = ["prepare", str(bad), "-o", out + "1", "--workers", "2", "--shard-size-mb", "0.001"]
    assert f"JSONL file '{bad}' line 301 has no field 'text'" in _error(capsys, argv)  # Raised in a worker.
    assert not os.path.exists(os.path.join(out + "1", "index.json"))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert f"'{empty}' is empty" in _error(capsys, ["prepare", str(empty), "-o", out + "2"])
    blank = tmp_path / "blank.jsonl"
    blank.write_text('{"text": ""}\n\n')
    assert "hold no documents" in _error(capsys, ["prepare", str(blank), "-o", out + "3"])
    assert not os.path.exists(os.path.join(out + "3", "index.json"))
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    assert "holds other files (notes.txt)" in _error(capsys, ["prepare", str(root), "-o", str(other)])
    assert "is a file" in _error(capsys, ["prepare", str(root), "-o", str(other / "notes.txt")])
    assert "not a built-in tokenizer" in _error(capsys, ["prepare", str(root), "-o", out, "--tokenizer", "hf"])


def test_resume_with_other_arguments_is_refused(tmp_path, corpus, capsys, bpe_file):
    root, _ = corpus
    out = str(tmp_path / "out")
    assert main(["prepare", str(root), "-o", out, "--shard-size-mb", "1", "--workers", "1"]) == 0
    capsys.readouterr()
    err = _error(capsys, ["prepare", str(root), "-o", out, "--shard-size-mb", "2"])
    assert "was prepared with different shard_size_mb" in err
    with pytest.raises(DataError, match="was prepared with different tokenizer"):
        prepare([str(root)], out, tokenizer=_hf_config(bpe_file), shard_size_mb=1)
    with pytest.raises(DataError, match="was prepared with different chat, field, input_format;"):
        prepare([str(root)], out, format="chat", shard_size_mb=1)
    # The same arguments again: already prepared, nothing rewritten.
    before = os.stat(os.path.join(out, "index.json")).st_mtime_ns
    assert main(["prepare", str(root), "-o", out, "--shard-size-mb", "1", "--verify"]) == 0
    assert os.stat(os.path.join(out, "index.json")).st_mtime_ns == before
