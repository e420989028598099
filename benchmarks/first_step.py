"""Time to the first step does not grow with the corpus (issue 22).

Writes two prepared-shard datasets with A's shard writer (`axcore.data.shards`), laid
out as `axcore prepare` lays them out (index.json with the bytes tokenizer's
fingerprint and `vocab_size`, `shard-NNNNN.{tokens,offsets}.npy` + `done.json`):
a small one (`--small-mib`, default 20 MiB of uint16 token ids, one shard) and a large
one (`--large-mib`, default 2048 MiB = 1 Gi tokens, in shards of `--shard-mib`, default
128 MiB = 64 Mi tokens, so 16 shards). Token ids are drawn uniformly from the 256 byte
ids with NumPy (tokenizing 2 GB of text would take far longer than the measurement);
document lengths are log-normal (median 2,048 tokens, sigma 0.7, clipped to
16..32,768), seeded per shard. `--data-dir DIR` keeps the datasets in DIR/small and
DIR/large and reuses them when their index.json describes the same data (a killed
write resumes shard by shard, like `axcore prepare`).

Then runs `axcore train` (the console script of this environment) on the default
experiment with

    --set input.source.type=prepared --set input.source.paths=[DIR]
    --set trainer.max_steps=1 --set trainer.run_dir=<fresh temp dir>
    --set trainer.sample.num_tokens=0

alternating small / large (`--rounds`, default 5, after one untimed warm-up run of
each), and measures for each run:

- time to the first step: from just before the process is started to the moment the
  parent reads the trainer's progress line `step 1/1 ...` on the child's stdout
  (printed as soon as step 1 completes, before the end-of-run evaluation and the final
  checkpoint; PYTHONUNBUFFERED=1). It includes Python and JAX start-up, building the
  experiment, opening the source, compiling the step and running it. The total wall
  time of the process is reported beside it.
- peak memory: the child's `ru_maxrss` from `os.wait4` (that process alone, for the
  whole run, including evaluation and the checkpoint).

Targets: the medians of the two differ by less than 20% in time and by less than
200 MB (10^6 bytes) in peak memory. The files are in the page cache (just written or
read by the warm-up), which is the usual case on a training host that re-reads the
same corpus; a cold cache adds the reads of index.json, the .npy headers and the
offsets files actually touched.

    python -m benchmarks.first_step                       # 2 GiB set written once (~1 min) + ~5 min of runs
    python -m benchmarks.first_step --quick               # 2 MiB vs 40 MiB, 1 round: checks that it works
    python -m benchmarks.first_step --data-dir /tmp/fs    # keep and reuse the datasets
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from benchmarks.common import axcore_command, summarize, write_result

NAME = "first_step"
MIB = 1 << 20
# Targets (issue 22): relative difference of the median time to the first step, and
# difference of the median peak RSS (large minus small), in bytes.
TIME_TARGET = 0.20
MEMORY_TARGET_BYTES = 200e6
# Document lengths in tokens: log-normal around a median, clipped.
LENGTH_MEDIAN, LENGTH_SIGMA, LENGTH_MIN, LENGTH_MAX = 2048, 0.7, 16, 32_768
_FIRST_STEP = re.compile(rb"^step 1/\d+ ")
_COMPILED = re.compile(rb"Compiled the train step in ([0-9.]+) s")




def _document_lengths(rng: np.random.Generator, tokens: int) -> np.ndarray:
    """int64 [d]: log-normal document lengths summing to exactly `tokens` (the last one cut)."""
    parts, total = [], 0
    while total < tokens:
        draw = rng.lognormal(np.log(LENGTH_MEDIAN), LENGTH_SIGMA, size=max(1024, tokens // LENGTH_MEDIAN))
        draw = np.clip(draw, LENGTH_MIN, LENGTH_MAX).astype(np.int64)
        parts.append(draw)
        total += int(draw.sum())
    lengths = np.concatenate(parts)
    ends = np.cumsum(lengths)
    count = int(np.searchsorted(ends, tokens)) + 1  # The first `count` documents reach `tokens`.
    lengths = lengths[:count]
    lengths[-1] -= int(ends[count - 1]) - tokens
    return lengths[lengths > 0]


def write_dataset(directory: str, total_tokens: int, shard_tokens: int, seed: int = 0) -> dict[str, Any]:
    """Writes (or reuses) a prepared-shard dataset of `total_tokens` uint16 byte ids in `directory`.

    Returns `{"seconds", "reused", "shards", "documents", "tokens", "bytes"}`. A dataset
    whose index.json records the same description is reused as is; finished shards of
    an interrupted write are kept (their done.json describes the same unit).
    """
    from axcore.data.shards import (
        INDEX_FILE,
        PreparedShards,
        foreign_entries,
        read_done,
        remove_temporary_files,
        shard_name,
        token_dtype,
        write_index,
        write_shard,
    )
    from axcore.data.tokenizer import ByteTokenizer

    tokenizer = ByteTokenizer()
    dtype = token_dtype(tokenizer.vocab_size)
    description = {
        "total_tokens": int(total_tokens), "shard_tokens": int(shard_tokens), "seed": int(seed),
        "ids": f"uniform 0..{tokenizer.vocab_size - 1}",
        "lengths": f"lognormal(median {LENGTH_MEDIAN}, sigma {LENGTH_SIGMA}) clipped {LENGTH_MIN}..{LENGTH_MAX}",
    }
    start = time.perf_counter()
    os.makedirs(directory, exist_ok=True)
    reused = False
    index_path = os.path.join(directory, INDEX_FILE)
    if os.path.exists(index_path):
        with open(index_path, encoding="utf-8") as f:
            reused = json.load(f).get("benchmark") == description
        if not reused:
            os.remove(index_path)  # Another description: rewrite (index.json goes first, so nothing looks finished).
    if not reused:
        foreign = foreign_entries(directory)
        if foreign:
            raise RuntimeError(f"{directory} holds files that are not prepared shards ({foreign[:3]}); "
                               f"use another --data-dir.")
        remove_temporary_files(directory)
        count = -(-total_tokens // shard_tokens)
        for entry in os.listdir(directory):  # Shards beyond `count` from an earlier, larger description.
            if entry.startswith("shard-") and int(entry[6:].split(".")[0]) >= count:
                os.remove(os.path.join(directory, entry))
        records, done = [], 0
        for i in range(count):
            n = min(shard_tokens, total_tokens - done)
            unit = {"benchmark": NAME, "shard": i, **description}
            record = read_done(directory, shard_name(i), unit)
            if record is None:
                rng = np.random.default_rng([seed, i])
                lengths = _document_lengths(rng, n)
                offsets = np.zeros(len(lengths) + 1, np.int64)
                np.cumsum(lengths, out=offsets[1:])
                ids = rng.integers(0, tokenizer.vocab_size, size=n, dtype=dtype)
                record = write_shard(directory, shard_name(i), ids, offsets, None, unit)
                del ids
            records.append(record)
            done += n
        write_index(directory, tokenizer.fingerprint(), dtype, False, records, [], "benchmarks/first_step.py",
                    {"vocab_size": int(tokenizer.vocab_size), "benchmark": description})
    shards = PreparedShards(directory)  # Cheap checks (headers, offsets ends); also what training opens.
    files = [os.path.join(directory, f"{shard_name(i)}.{kind}.npy") for i in range(shards.num_shards)
             for kind in ("tokens", "offsets")]
    return {
        "seconds": time.perf_counter() - start,
        "reused": reused,
        "shards": shards.num_shards,
        "documents": shards.num_documents,
        "tokens": shards.num_tokens,
        "bytes": sum(os.path.getsize(f) for f in files),
    }


# Smoke runs train a 1-layer, width-64 model on short rows: the same path, a fraction of the compile.
SMOKE_OVERRIDES = ("model.num_layers=1", "model.dim=64", "input.batch_size=2", "input.seq_len=32")


def train_once(data_dir: str, env: dict[str, str], overrides: tuple[str, ...] = ()) -> dict[str, Any]:
    """One `axcore train` run with max_steps=1 on `data_dir`, in a fresh run directory (plus `overrides`).

    Returns `{"first_step_s", "wall_s", "peak_rss_bytes", "compile_s", "step_time_s", "data_wait_s"}`.
    """
    run_dir = tempfile.mkdtemp(prefix="axcore-first-step-run-")
    argv = axcore_command() + [
        "train", "default",
        "--set", "input.source.type=prepared",
        "--set", f"input.source.paths={json.dumps([data_dir])}",
        "--set", "trainer.max_steps=1",
        "--set", f"trainer.run_dir={json.dumps(run_dir)}",
        "--set", "trainer.sample.num_tokens=0",
        *(arg for override in overrides for arg in ("--set", override)),
    ]
    try:
        start = time.perf_counter()
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        first_step, output, pending = None, bytearray(), b""
        while chunk := os.read(proc.stdout.fileno(), 65536):
            now = time.perf_counter()
            output += chunk
            lines = re.split(rb"[\r\n]", pending + chunk)
            pending = lines.pop()
            if first_step is None and any(_FIRST_STEP.match(line) for line in lines):
                first_step = now - start
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        proc.stdout.close()
        text = output.decode("utf-8", "replace")
        if proc.returncode != 0 or first_step is None:
            raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode} without a 'step 1/' line:\n{text[-3000:]}")
        metrics = {}
        with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
            for line in f:
                record = json.loads(line)
                if record.get("step") == 1 and "train/step_time" in record:
                    metrics = record
        compiled = _COMPILED.search(output)
        return {
            "first_step_s": first_step,
            "wall_s": wall,
            "peak_rss_bytes": usage.ru_maxrss * 1024,  # Linux: KiB.
            "compile_s": float(compiled.group(1)) if compiled else None,
            "step_time_s": metrics.get("train/step_time"),
            "data_wait_s": metrics.get("train/data_wait"),
        }
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def run(smoke: bool = False, results_dir: pathlib.Path | None = None, *, rounds: int | None = None,
        small_mib: float | None = None, large_mib: float | None = None, shard_mib: float | None = None,
        data_dir: str | None = None, warmup: bool | None = None) -> dict[str, Any]:
    """Writes the two datasets, alternates the train runs, writes first_step.json; returns the result."""
    rounds = rounds or (1 if smoke else 5)
    small_mib = small_mib or (2 if smoke else 20)
    large_mib = large_mib or (40 if smoke else 2048)
    shard_mib = shard_mib or (8 if smoke else 128)
    warmup = (not smoke) if warmup is None else warmup
    overrides = SMOKE_OVERRIDES if smoke else ()
    load_before = _load()
    owned = data_dir is None
    root = data_dir or tempfile.mkdtemp(prefix="axcore-first-step-data-")
    try:
        sizes = {"small": small_mib, "large": large_mib}
        datasets = {}
        for name, mib in sizes.items():
            tokens, shard_tokens = int(mib * MIB) // 2, int(shard_mib * MIB) // 2
            datasets[name] = write_dataset(os.path.join(root, name), tokens, shard_tokens)
            d = datasets[name]
            print(f"[{name}] {d['bytes'] / MIB:.0f} MiB, {d['shards']} shards, {d['documents']:,} documents, "
                  f"{d['tokens']:,} tokens: {'reused' if d['reused'] else 'written'} in {d['seconds']:.1f} s",
                  file=sys.stderr, flush=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if warmup:  # Untimed: OS file cache, .pyc files, any persistent compilation cache.
            for name in sizes:
                train_once(os.path.join(root, name), env, overrides)
        runs: dict[str, list[dict]] = {name: [] for name in sizes}
        for r in range(rounds):
            for name in sizes:
                result = train_once(os.path.join(root, name), env, overrides)
                runs[name].append(result)
                print(f"round {r + 1}/{rounds} {name}: first step {result['first_step_s']:.2f} s, wall "
                      f"{result['wall_s']:.2f} s, peak RSS {result['peak_rss_bytes'] / 1e6:.0f} MB", file=sys.stderr,
                      flush=True)
    finally:
        if owned:
            shutil.rmtree(root, ignore_errors=True)
    load_after = _load()

    def column(name: str, key: str) -> list[float]:
        return [r[key] for r in runs[name] if r[key] is not None]

    summary = {
        name: {key: summarize(column(name, key)) for key in runs[name][0] if column(name, key)} for name in sizes
    }
    t_small, t_large = summary["small"]["first_step_s"]["median"], summary["large"]["first_step_s"]["median"]
    m_small, m_large = summary["small"]["peak_rss_bytes"]["median"], summary["large"]["peak_rss_bytes"]["median"]
    ratio = t_large / t_small
    per_round = summarize([b["first_step_s"] / a["first_step_s"] for a, b in zip(runs["small"], runs["large"])])
    memory_diff = m_large - m_small
    targets = {
        "first_step_time_ratio": {
            "target": f"within {1 - TIME_TARGET:.2f}..{1 + TIME_TARGET:.2f}",
            "value": ratio,
            "metric": f"median time to the first step, {large_mib:g} MiB / {small_mib:g} MiB corpus",
            "met": abs(ratio - 1) < TIME_TARGET,
        },
        "peak_rss_difference_mb": {
            "target": f"< {MEMORY_TARGET_BYTES / 1e6:.0f} MB",
            "value": memory_diff / 1e6,
            "metric": f"median peak RSS of `axcore train`, {large_mib:g} MiB minus {small_mib:g} MiB corpus (MB)",
            "met": abs(memory_diff) < MEMORY_TARGET_BYTES,
        },
    }
    data = {
        "smoke": smoke,
        "setup": {
            "command": " ".join(axcore_command()) + " train default --set input.source.type=prepared "
            "--set input.source.paths=[DIR] --set trainer.max_steps=1 --set trainer.run_dir=TMP "
            "--set trainer.sample.num_tokens=0" + "".join(f" --set {o}" for o in overrides),
            "rounds": rounds,
            "warmup": warmup,
            "first_step": "process start -> the parent reads the 'step 1/1' progress line on the child's stdout",
            "peak_rss": "os.wait4 ru_maxrss of the train process (whole run)",
            "load_average_before": load_before,
            "load_average_after": load_after,
        },
        "datasets": {name: {"mib": sizes[name], **datasets[name]} for name in sizes},
        "results": summary,
        "first_step_ratio_per_round": per_round,
        "targets": targets,
        "raw": runs,
    }
    write_result(NAME, data, results_dir=results_dir)
    return data


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.first_step", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", "--smoke", action="store_true", dest="smoke",
                        help="2 MiB vs 40 MiB, 1 round, no warm-up: checks that it works; numbers mean little")
    parser.add_argument("--rounds", type=int, help="alternated rounds (default 5; quick 1)")
    parser.add_argument("--small-mib", type=float, help="small corpus, MiB of uint16 tokens (default 20)")
    parser.add_argument("--large-mib", type=float, help="large corpus, MiB of uint16 tokens (default 2048)")
    parser.add_argument("--shard-mib", type=float, help="MiB of tokens per shard (default 128)")
    parser.add_argument("--data-dir", help="keep the datasets in DATA_DIR/{small,large} and reuse them")
    parser.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up run of each")
    parser.add_argument("--results-dir", type=pathlib.Path,
                        help="where first_step.json goes (default benchmarks/results)")
    args = parser.parse_args(argv)
    data = run(args.smoke, args.results_dir, rounds=args.rounds, small_mib=args.small_mib, large_mib=args.large_mib,
               shard_mib=args.shard_mib, data_dir=args.data_dir, warmup=False if args.no_warmup else None)
    res = data["results"]
    print("\n| corpus | shards | documents | time to first step, median (s) | wall (s) | peak RSS median (MB) |")
    print("|---|---|---|---|---|---|")
    for name in ("small", "large"):
        d = data["datasets"][name]
        print(f"| {d['mib']:g} MiB | {d['shards']} | {d['documents']:,} | {res[name]['first_step_s']['median']:.2f} "
              f"(p10 {res[name]['first_step_s']['p10']:.2f}, p90 {res[name]['first_step_s']['p90']:.2f}) | "
              f"{res[name]['wall_s']['median']:.2f} | {res[name]['peak_rss_bytes']['median'] / 1e6:.0f} |")
    for key, t in data["targets"].items():
        print(f"{key}: {t['value']:.3f} (target {t['target']}): {'PASS' if t['met'] else 'MISS'}")
    print(f"per-round time ratio: median {data['first_step_ratio_per_round']['median']:.3f}; load average before "
          f"{data['setup']['load_average_before']}, after {data['setup']['load_average_after']}; "
          f"large set written in {data['datasets']['large']['seconds']:.1f} s"
          f"{' (reused)' if data['datasets']['large']['reused'] else ''}")


if __name__ == "__main__":
    main()
