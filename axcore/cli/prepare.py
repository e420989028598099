"""`axcore prepare`: its arguments and its run (the work itself is `axcore.data.prepare`).

    axcore prepare INPUT... --output DIR [--format text|jsonl|parquet|chat] [--field NAME]
                   [--experiment EXPERIMENT [--set PATH=VALUE ...] | --tokenizer bytes]
                   [--workers N] [--shard-size-mb MB] [--verify]
                   [--chat-template FILE] [--train-on assistant|all]

The tokenizer is the experiment's (`--experiment`, built the way `axcore train` builds
it, so training accepts the shards' fingerprint) or a built-in one by name (`bytes`,
the default). This module imports nothing heavy until the command runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

# Default input megabytes per shard (a 200 MB corpus gives 4 shards, so 2 workers both work).
DEFAULT_SHARD_SIZE_MB = 64.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds `axcore prepare`'s arguments to `parser`."""
    parser.add_argument("inputs", nargs="+", metavar="INPUT", help="files, directories or globs ('data/*.jsonl', 'data/**')")
    parser.add_argument("--output", "-o", required=True, metavar="DIR", help="the dataset directory (new, empty, or this run's to resume)")
    parser.add_argument(
        "--format", choices=("text", "jsonl", "parquet", "chat"), default="jsonl",
        help="text: a file is a document; jsonl: a line's FIELD; parquet: the column FIELD; chat: JSONL of messages (default: jsonl)",
    )
    parser.add_argument("--field", metavar="NAME", help="JSONL key or Parquet column (default: text; chat: messages)")
    tokenizer = parser.add_mutually_exclusive_group()
    tokenizer.add_argument(
        "--experiment", metavar="EXPERIMENT",
        help="use this experiment's tokenizer (YAML file or built-in name; with --set overrides), as training does",
    )
    tokenizer.add_argument("--tokenizer", default=None, metavar="NAME", help="a built-in tokenizer by name (default: bytes)")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE",
        help="override a value of --experiment's config, e.g. --set tokenizer.add_eos=true (repeatable)",
    )
    parser.add_argument("--workers", type=int, metavar="N", help="worker processes (default: every core)")
    parser.add_argument(
        "--shard-size-mb", type=float, default=DEFAULT_SHARD_SIZE_MB, metavar="MB",
        help=f"input megabytes per shard (default: {DEFAULT_SHARD_SIZE_MB:g})",
    )
    parser.add_argument("--verify", action="store_true", help="check the sha256 of every file at the end")
    parser.add_argument("--chat-template", metavar="FILE", help="chat: a jinja2 template file (default: the tokenizer's)")
    parser.add_argument(
        "--train-on", choices=("assistant", "all"), default="assistant",
        help="chat: which tokens carry loss (default: assistant replies only)",
    )


def _tokenizer_config(args):
    """The tokenizer's config: the experiment's, or a built-in tokenizer's by name."""
    from axcore.errors import ConfigError

    if args.experiment is not None:
        from axcore.experiment.loading import load_experiment

        return load_experiment(args.experiment, args.overrides, objects=getattr(args, "objects", None)).config.tokenizer
    if args.overrides:
        raise ConfigError("--set applies to --experiment's config; name the experiment whose tokenizer to use.")
    from axcore.data.tokenizer import TOKENIZERS

    name = args.tokenizer or "bytes"
    if name not in TOKENIZERS:
        raise ConfigError(
            f"--tokenizer {name!r} is not a built-in tokenizer ({', '.join(sorted(TOKENIZERS))}); for a plugin's tokenizer "
            f"(e.g. a tokenizer.json) pass --experiment with an experiment whose `tokenizer:` names it."
        )
    return TOKENIZERS[name].default_config()


def run(args: argparse.Namespace) -> int:
    """Runs `axcore prepare`; prints one summary line on stdout, progress on stderr."""
    from axcore.data.prepare import prepare

    started = time.monotonic()
    index = prepare(
        args.inputs,
        args.output,
        format=args.format,
        field=args.field,
        tokenizer=_tokenizer_config(args),
        workers=args.workers,
        shard_size_mb=args.shard_size_mb,
        verify=args.verify,
        chat_template=args.chat_template,
        train_on=args.train_on,
        stream=sys.stderr,
    )
    tokenizer = index["tokenizer"]
    print(
        f"prepared '{os.path.abspath(args.output)}': {index['documents']:,} documents, {index['tokens']:,} tokens in "
        f"{len(index['shards'])} shards ({index['dtype']}, tokenizer {tokenizer['name']} vocab {tokenizer['vocab_size']})"
        f"{', verified' if args.verify else ''} in {time.monotonic() - started:.1f} s"
    )
    return 0
