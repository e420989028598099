"""The input pipeline alone: tokens/s per core from prepared shards, with each packing.

Writes prepared shards (A's `axcore.data.shards` writer, uint16, documents of
log-normal lengths, median ~600 tokens, like web text) once into a temporary
directory, then pulls TRAIN batches (`input.batch_size` x `input.seq_len`) from
`InputConfig.make_pipeline` for each packing (first_fit, best_fit, concat, none),
alternated round by round. `prefetch=0` keeps all the work on the calling thread, so
"per core" is tokens over the process's CPU seconds (`time.process_time`), and the
wall rate is reported beside it. Tokens are non-padding input tokens (what training
consumes); packing efficiency = those over all row slots.

Target: >= 1 M tokens/s per core with packing (first_fit, the default).

    python -m benchmarks.data_loader [--smoke] [--tokens 20000000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile
import time

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from benchmarks.common import summarize, write_result

NAME = "data_loader"
PACKINGS = ("first_fit", "best_fit", "concat", "none")


def write_corpus(directory: pathlib.Path, tokens: int, seed: int = 0) -> str:
    """Prepared shards of about `tokens` tokens (documents of log-normal lengths), 8 shards."""
    from axcore.data import ByteTokenizer
    from axcore.data.shards import write_index, write_shard

    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(600), 1.0, size=int(tokens / 900) + 8), 2, 60_000).astype(np.int64)
    records = []
    for s, part in enumerate(np.array_split(lengths, 8)):
        offsets = np.concatenate([[0], np.cumsum(part)]).astype(np.int64)
        ids = rng.integers(0, 256, size=int(offsets[-1]), dtype=np.uint16)
        records.append(write_shard(str(directory), f"shard-{s:05d}", ids, offsets, None, {}))
    write_index(str(directory), ByteTokenizer().fingerprint(), np.uint16, False, records, [], "benchmarks/data_loader.py")
    return str(directory)


def pull(pipeline, batches: int) -> tuple[float, float, int, float]:
    """(wall s, CPU s, non-padding tokens, packing efficiency) of `batches` batches."""
    pipeline.stats()
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(batches):
        next(pipeline)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    stats = pipeline.stats()
    return wall, cpu, int(stats["data/tokens"]), stats["data/packing_efficiency"]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny corpus, one round (checks that it runs)")
    parser.add_argument("--tokens", type=int, default=20_000_000, help="corpus size in tokens")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, default=40, help="batches per round and packing")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--results-dir", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)
    if args.smoke:
        args.tokens, args.rounds, args.batches = 300_000, 1, 3

    from axcore.data import InputConfig, Prepared, Split

    with tempfile.TemporaryDirectory(prefix="axcore-data-loader-") as tmp:
        start = time.perf_counter()
        path = write_corpus(pathlib.Path(tmp), args.tokens)
        write_s = time.perf_counter() - start
        pipelines = {}
        for packing in PACKINGS:
            cfg = InputConfig(
                source=Prepared.default_config().set(paths=[path]), batch_size=args.batch_size, seq_len=args.seq_len,
                packing=packing, prefetch=0,
            )
            pipelines[packing] = cfg.make_pipeline(Split.TRAIN, vocab_size=256)
            pull(pipelines[packing], 2)  # Warm up (first maps, first packing group).
        rounds: dict[str, list[tuple[float, float, int, float]]] = {p: [] for p in PACKINGS}
        for _ in range(args.rounds):
            for packing, pipeline in pipelines.items():
                rounds[packing].append(pull(pipeline, args.batches))
        for pipeline in pipelines.values():
            pipeline.close()

    results = {}
    for packing, runs in rounds.items():
        results[packing] = {
            "tokens_per_cpu_s": summarize([t / c for _, c, t, _ in runs]),
            "tokens_per_wall_s": summarize([t / w for w, _, t, _ in runs]),
            "packing_efficiency": summarize([e for *_, e in runs]),
        }
    per_core = results["first_fit"]["tokens_per_cpu_s"]["median"]
    data = {
        "settings": {**vars(args), "results_dir": None, "corpus_write_s": write_s},
        "results": results,
        "targets": {"first_fit_tokens_per_core_s": {"value": per_core, "target": 1_000_000, "met": per_core >= 1_000_000}},
    }
    out = write_result(NAME, data, results_dir=args.results_dir)
    for packing, r in results.items():
        print(
            f"{packing:9s} {r['tokens_per_cpu_s']['median'] / 1e6:6.2f} M tokens/s per core "
            f"({r['tokens_per_wall_s']['median'] / 1e6:5.2f} M/s wall), packing efficiency "
            f"{r['packing_efficiency']['median']:.3f}"
        )
    print(f"wrote {out}")
    return data


if __name__ == "__main__":
    main()
