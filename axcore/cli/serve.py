"""`axcore serve RUN_OR_HF_DIR`: an OpenAI-compatible HTTP server over the inference engine (`axcore.serving`).

Binds 127.0.0.1:8000 unless told otherwise; a host that is not a loopback address is
refused without `--allow-remote`. With `--api-key KEY` (or AXCORE_API_KEY) every `/v1`
request must send `Authorization: Bearer KEY`. Past `--max-waiting` requests without an
output yet, new ones get a 429. SIGTERM (or Ctrl-C) stops accepting connections, lets
the requests in flight finish (at most `--drain-timeout` seconds when given), then exits.
Each `--lora NAME=PATH` (repeatable) holds the adapter run PATH (a LoRA run of this base)
resident: `/v1/models` lists it after the base, and a request's `model: NAME` selects it.

The arguments are checked before the model loads, so a bad flag costs nothing.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

from axcore.cli.common import one_run

# Where the API key comes from when --api-key is not given (a key on the command line shows in `ps`).
API_KEY_ENV = "AXCORE_API_KEY"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's arguments (`axcore serve --help`)."""
    parser.add_argument("run", metavar="RUN_OR_HF_DIR", help="run directory (or one step's directory) to serve")
    # More paths (a shell glob matching several runs): refused with one line naming them.
    parser.add_argument("more_runs", nargs="*", help=argparse.SUPPRESS)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; a non-loopback "
                        "address needs --allow-remote)")
    parser.add_argument("--port", type=int, default=8000, help="port to bind (default 8000)")
    parser.add_argument("--allow-remote", action="store_true", help="allow a --host other machines can reach")
    parser.add_argument("--api-key", metavar="KEY", help=f"key every /v1 request must send as 'Authorization: "
                        f"Bearer KEY' (default: ${API_KEY_ENV} if set, else none)")
    parser.add_argument("--max-waiting", type=int, default=256, metavar="N",
                        help="requests without an output yet, at most; more get a 429 (default 256)")
    parser.add_argument("--default-max-tokens", type=int, default=256, metavar="N",
                        help="new tokens of a chat reply whose request sets no max_tokens (default 256)")
    parser.add_argument("--drain-timeout", type=float, metavar="S",
                        help="at shutdown, wait at most S seconds for running requests (default: until they end)")
    parser.add_argument("--served-model-name", metavar="NAME",
                        help="the base model's name in /v1/models and `model` (default: the run directory's name)")
    parser.add_argument("--lora", dest="adapters", action="append", default=[], metavar="NAME=PATH",
                        help="serve the adapter run PATH (a LoRA run of this base) as model NAME; repeatable")
    parser.add_argument("--max-seqs", type=int, metavar="N",
                        help="sequences the engine runs at once, its rows per step (default 16)")
    parser.add_argument("--kv-cache-gib", type=float, metavar="G",
                        help="GiB of paged KV cache over all attention layers (default 1)")
    parser.add_argument("--max-tokens-per-step", type=int, metavar="N",
                        help="tokens an engine step feeds, decodes and prefill chunks together; at least "
                        "--max-seqs (default 256)")
    parser.add_argument("--precompile", action="store_true",
                        help="compile the engine's step programs (one per ragged row bucket) before taking "
                        "requests: a slower start, no compile stalling the first requests of each size")
    parser.add_argument("--chat-template", metavar="FILE", help="jinja2 chat template (default: the run's)")
    parser.add_argument("--step", type=int, metavar="S", help="checkpoint step (default: the latest committed)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE",
                        help="override a value of the run's config, e.g. --set mesh.mesh_shape=[-1]")
    parser.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                        help="uvicorn's log level (default info)")


def check_arguments(args: argparse.Namespace) -> None:
    """ServeError naming the first bad flag (before anything loads)."""
    from axcore.serving.server import ServeError, check_host

    if not 0 <= args.port <= 65535:
        raise ServeError(f"--port must be in 0..65535, got {args.port}.")
    if args.max_waiting < 1:
        raise ServeError(f"--max-waiting must be >= 1, got {args.max_waiting}.")
    if args.default_max_tokens < 1:
        raise ServeError(f"--default-max-tokens must be >= 1, got {args.default_max_tokens}.")
    if args.drain_timeout is not None and args.drain_timeout < 0:
        raise ServeError(f"--drain-timeout must be >= 0 seconds, got {args.drain_timeout}.")
    if args.api_key is not None and not args.api_key.strip():
        raise ServeError("--api-key is empty; give a key, or leave the flag out to serve without one.")
    check_host(args.host, args.allow_remote)
    check_engine_arguments(args)
    from axcore.engine.adapters import parse_adapters

    parse_adapters(args.adapters, args.served_model_name)


def check_engine_arguments(args: argparse.Namespace) -> None:
    """ServeError naming the first bad engine flag (--max-seqs, --kv-cache-gib, --max-tokens-per-step)."""
    from axcore.serving.server import ServeError

    if args.max_seqs is not None and args.max_seqs < 1:
        raise ServeError(f"--max-seqs must be >= 1, got {args.max_seqs}.")
    if args.kv_cache_gib is not None and not (args.kv_cache_gib > 0 and math.isfinite(args.kv_cache_gib)):
        raise ServeError(f"--kv-cache-gib must be a positive number of GiB, got {args.kv_cache_gib}.")
    if args.max_tokens_per_step is not None and args.max_tokens_per_step < 1:
        raise ServeError(f"--max-tokens-per-step must be >= 1, got {args.max_tokens_per_step}.")
    config = engine_config(args)
    if config.max_tokens_per_step < config.max_seqs:
        raise ServeError(f"--max-tokens-per-step {config.max_tokens_per_step} is below --max-seqs "
                         f"{config.max_seqs} (every running sequence needs a token per step); raise it or lower "
                         "--max-seqs.")


def engine_config(args: argparse.Namespace):
    """The `EngineConfig` of the engine flags (the defaults where a flag is not given or `args` lacks it)."""
    from axcore.engine.config import EngineConfig

    gib = getattr(args, "kv_cache_gib", None)  # Namespaces built by callers may lack the engine flags.
    fields = {"max_seqs": getattr(args, "max_seqs", None), "max_tokens_per_step": getattr(args, "max_tokens_per_step",
                                                                                          None),
              "kv_cache_bytes": None if gib is None else int(gib * (1 << 30))}
    return EngineConfig(**{name: value for name, value in fields.items() if value is not None})


def build_engine(path: str, args: argparse.Namespace):
    """The inference engine (`axcore.engine.Engine`, an `EngineClient`) serving the run directory `path`:
    its parameters (the step `--step`, else the latest committed), its tokenizer, the `EngineConfig` of the
    engine flags (`engine_config`), and the adapters of `--lora`."""
    from axcore.engine.adapters import parse_adapters
    from axcore.inference.run_loading import load_engine

    return load_engine(path, step=args.step, overrides=args.overrides, objects=args.objects,
                       name=args.served_model_name, config=engine_config(args),
                       adapters=parse_adapters(args.adapters, args.served_model_name))


def load_frontend(path: str, args: argparse.Namespace):
    """The run's tokenizer and chat template (`--chat-template`, else the template it trained with, else its
    tokenizer's; none: chat requests get a 400) as the server's `TextFrontend`."""
    from axcore.data.chat import ChatTemplate
    from axcore.data.sources import ChatFiles
    from axcore.inference.run_loading import load_run_experiment
    from axcore.serving.text import TextFrontend

    experiment, _ = load_run_experiment(path, args.overrides, objects=args.objects)
    tokenizer = experiment.config.tokenizer.instantiate()
    template = None
    if args.chat_template is not None:
        template = ChatTemplate.from_file(args.chat_template, field="--chat-template")
    else:
        for _, _, source, where in experiment.config.input.components():
            if isinstance(source, ChatFiles.Config):  # As the run's chat data was rendered.
                template = ChatTemplate.for_tokenizer(tokenizer, source.template, field=f"{where}.template")
                break
        else:
            if tokenizer.chat_template is not None:
                template = ChatTemplate.for_tokenizer(tokenizer)
    return TextFrontend(tokenizer, template, vocab_size=experiment.config.model.vocab_size)


def run(args: argparse.Namespace) -> int:
    """Checks the flags, builds the engine, serves until SIGTERM; returns 0."""
    args.run = one_run(args)
    if args.api_key is None:
        args.api_key = os.environ.get(API_KEY_ENV) or None
    check_arguments(args)
    engine = build_engine(args.run, args)
    if args.precompile:
        started = time.perf_counter()
        keys = engine.precompile()
        print(f"axcore serve: compiled {len(keys)} step programs in {time.perf_counter() - started:.1f} s",
              file=sys.stderr, flush=True)
    frontend = load_frontend(args.run, args)
    from axcore.serving.app import ServerSettings, create_app
    from axcore.serving.server import make_server

    settings = ServerSettings(max_waiting=args.max_waiting, api_key=args.api_key,
                              default_max_tokens=args.default_max_tokens)
    app = create_app(engine, frontend, settings)
    server = make_server(app, host=args.host, port=args.port, log_level=args.log_level,
                         drain_timeout_s=args.drain_timeout)
    server.run()
    return 0
