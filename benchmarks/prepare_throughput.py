"""`axcore prepare` throughput per core against the `tokenizers` library's own `encode_batch` (issue 22).

Generates a seeded JSONL corpus (`--mb`, default 200 MB; words drawn from a fixed
vocabulary of made-up words), trains a byte-level BPE `tokenizer.json` (`--vocab`,
default 4,096) on a sample of it with `tokenizers`, then alternates, `--rounds`
times (default 3):

- prepare: `axcore.data.prepare.prepare(..., workers=1)` with the hf_tokenizer plugin's
  `HFTokenizer` on that file, in a fresh process (timed inside it around the call:
  reading and parsing the JSONL, encoding, writing and hashing the shards; not
  Python's start-up);
- encode_batch: `tokenizers.Tokenizer.encode_batch` over the same texts (already in
  memory, in batches of 256, ids taken out of each encoding) in a fresh process with
  `TOKENIZERS_PARALLELISM=false`: one thread, as prepare's worker has.

Both run on one core, so tokens/s is per core. Prints the medians and the median of
the per-round ratios (target: prepare >= 80% of encode_batch).

    python -m benchmarks.prepare_throughput            # 200 MB, several minutes
    python -m benchmarks.prepare_throughput --mb 20    # a quick run
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile

_PREPARE = """
import json, sys, time
from axcore_tokenizers.tokenizer import HFTokenizer
from axcore.data.prepare import prepare
corpus, output, tokenizer_file = sys.argv[1:]
config = HFTokenizer.default_config().set(path=tokenizer_file)
start = time.perf_counter()
index = prepare([corpus], output, tokenizer=config, workers=1)
print(json.dumps({"seconds": time.perf_counter() - start, "tokens": index["tokens"], "documents": index["documents"]}))
"""

_ENCODE_BATCH = """
import json, sys, time
import tokenizers
corpus, tokenizer_file = sys.argv[1:]
with open(corpus, encoding="utf-8") as f:
    texts = [json.loads(line)["text"] for line in f]
tokenizer = tokenizers.Tokenizer.from_file(tokenizer_file)
start = time.perf_counter()
tokens = 0
for i in range(0, len(texts), 256):
    for encoding in tokenizer.encode_batch(texts[i : i + 256], add_special_tokens=False):
        tokens += len(encoding.ids)
print(json.dumps({"seconds": time.perf_counter() - start, "tokens": tokens, "documents": len(texts)}))
"""


def make_corpus(path: str, megabytes: float, seed: int = 0) -> int:
    """Writes a JSONL corpus of about `megabytes` MB (`{"text": ...}` per line); returns the document count."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    vocabulary = ["".join(rng.choice(letters) for _ in range(rng.randint(1, 10))) for _ in range(20_000)]
    weights = [1.0 / (rank + 1) for rank in range(len(vocabulary))]  # Zipf-like word frequencies.
    target = int(megabytes * 1e6)
    written = documents = 0
    with open(path, "w", encoding="utf-8") as f:
        while written < target:
            words = rng.choices(vocabulary, weights, k=rng.randint(50, 1500))
            sentences = [" ".join(words[i : i + 12]).capitalize() + "." for i in range(0, len(words), 12)]
            line = json.dumps({"text": " ".join(sentences)}) + "\n"
            f.write(line)
            written += len(line)
            documents += 1
    return documents


def make_tokenizer(corpus: str, path: str, vocab_size: int) -> None:
    """Trains a byte-level BPE tokenizer.json on the first ~5 MB of the corpus."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    sample = []
    with open(corpus, encoding="utf-8") as f:
        size = 0
        for line in f:
            sample.append(json.loads(line)["text"])
            size += len(line)
            if size > 5e6:
                break
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(sample, trainer)
    tok.save(path)


def _run(code: str, *args: str) -> dict:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, check=False)
    if out.returncode:
        raise RuntimeError(out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(megabytes: float = 200.0, rounds: int = 3, vocab_size: int = 4096) -> dict:
    """Measures both contenders alternately; returns tokens/s per core (medians) and the ratio."""
    with tempfile.TemporaryDirectory(prefix="axcore-prepare-bench-") as tmp:
        corpus = os.path.join(tmp, "corpus.jsonl")
        tokenizer_file = os.path.join(tmp, "tokenizer.json")
        documents = make_corpus(corpus, megabytes)
        make_tokenizer(corpus, tokenizer_file, vocab_size)
        rates: dict[str, list[float]] = {"prepare": [], "encode_batch": []}
        tokens: dict[str, int] = {}
        for r in range(rounds):
            output = os.path.join(tmp, f"out{r}")
            for name, result in (
                ("prepare", functools.partial(_run, _PREPARE, corpus, output, tokenizer_file)),
                ("encode_batch", functools.partial(_run, _ENCODE_BATCH, corpus, tokenizer_file)),
            ):
                measured = result()
                rates[name].append(measured["tokens"] / measured["seconds"])
                tokens[name] = measured["tokens"]
                print(f"round {r}: {name}: {measured['tokens']:,} tokens in {measured['seconds']:.1f} s", file=sys.stderr)
            subprocess.run(["rm", "-rf", output], check=False)
        if tokens["prepare"] != tokens["encode_batch"]:
            raise RuntimeError(f"token counts differ: prepare {tokens['prepare']}, encode_batch {tokens['encode_batch']}")
        ratios = [a / b for a, b in zip(rates["prepare"], rates["encode_batch"])]
        return {
            "megabytes": megabytes,
            "documents": documents,
            "tokens": tokens["prepare"],
            "vocab_size": vocab_size,
            "rounds": rounds,
            "prepare_tokens_per_s_per_core": statistics.median(rates["prepare"]),
            "encode_batch_tokens_per_s_per_core": statistics.median(rates["encode_batch"]),
            "ratio_median": statistics.median(ratios),
            "target_ratio": 0.8,
            "passed": statistics.median(ratios) >= 0.8,
        }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=200.0, help="corpus size in MB (default 200)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    parser.add_argument("--vocab", type=int, default=4096, help="BPE vocabulary size (default 4096)")
    args = parser.parse_args(argv)
    result = run(args.mb, args.rounds, args.vocab)
    print(
        f"{result['megabytes']:g} MB, {result['documents']:,} documents, {result['tokens']:,} tokens, "
        f"vocab {result['vocab_size']}, {result['rounds']} rounds (medians):\n"
        f"  axcore prepare (1 worker):        {result['prepare_tokens_per_s_per_core']:,.0f} tokens/s per core\n"
        f"  tokenizers encode_batch (1 thread): {result['encode_batch_tokens_per_s_per_core']:,.0f} tokens/s per core\n"
        f"  ratio: {result['ratio_median']:.2f} (target >= {result['target_ratio']}) "
        f"{'PASS' if result['passed'] else 'MISS'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
