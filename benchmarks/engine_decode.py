"""The engine's continuous batching at different batch settings: the same prompts, greedy, in one process.

    python -m benchmarks.engine_decode RUN_DIR [--prompts 32] [--new-tokens 64] [--max-seqs 32 8 1] [--rounds 3]

A batch of `--prompts` prompts (prefixes of one English sentence, 8 to 99 characters long,
seeded) is decoded greedily for `--new-tokens` tokens each (end-of-sequence ignored) by
`axcore.engine.Engine.generate` (continuous batching over the paged KV cache, 16-token
blocks) on the run's parameters, once per `--max-seqs` setting (the rows a step runs at
most: with fewer rows than prompts, prompts wait and join the running batch as others
finish; 1 decodes them one after another). Two warm-up calls each (they compile the
shapes of a cold cache and of the prompts found in the prefix cache, as in every later round), then
`--rounds` rounds that alternate the settings; medians of wall seconds and the output
tokens per second are printed as JSON, with how many prompts' tokens agree with the
first setting's (they should all: greedy decoding does not depend on the batch). Until
2026-11-29 this compared the engine against the fixed-batch dense-cache `Generator`, since
removed (one decoding path); `decode_speed.py` compares the engine against re-running the
full window. Not the serving benchmark issue 36 asks for (a length mix, concurrency
levels, vLLM).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

SENTENCE = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, "
            "must be in want of a wife. ")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.engine_decode", description=__doc__.splitlines()[0])
    parser.add_argument("run", help="a run directory (axcore train or axcore convert output)")
    parser.add_argument("--prompts", type=int, default=32, help="prompts decoded at once")
    parser.add_argument("--new-tokens", type=int, default=64, help="greedy tokens per prompt")
    parser.add_argument("--max-seqs", type=int, nargs="+", default=None,
                        help="rows per engine step, one contender each (default: --prompts and 8)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per contender, alternated")
    args = parser.parse_args(argv)

    from axcore.engine import Engine, EngineConfig
    from axcore.engine.requests import GenerationRequest, SamplingParams
    from axcore.inference.run_loading import load_model

    loaded = load_model(args.run)
    tokenizer = loaded.experiment.config.tokenizer.instantiate()
    rng = np.random.default_rng(0)
    prompts = [tokenizer.encode(SENTENCE[: int(rng.integers(8, 100))]) for _ in range(args.prompts)]
    settings = args.max_seqs or [args.prompts, 8]
    engines = {f"max_seqs_{n}": Engine(loaded.model, loaded.params, tokenizer, name="bench",
                                       config=EngineConfig(num_blocks=2048, block_size=16, max_seqs=n))
               for n in settings}
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)

    def runner(engine):
        def run(round_: int):
            requests = [GenerationRequest(f"{round_}-{i}", p, params) for i, p in enumerate(prompts)]
            start = time.perf_counter()
            outputs = engine.generate(requests)
            return time.perf_counter() - start, [list(o.choices[0].token_ids) for o in outputs]
        return run

    contenders = {name: runner(engine) for name, engine in engines.items()}
    for fn in contenders.values():
        for warm_up in (-2, -1):  # Compiles: the first call's shapes, then those of prompts found in the prefix cache.
            fn(warm_up)
    seconds: dict[str, list[float]] = {name: [] for name in contenders}
    tokens: dict[str, list] = {}
    for round_ in range(args.rounds):
        for name, fn in contenders.items():
            elapsed, tokens[name] = fn(round_)
            seconds[name].append(elapsed)
    new_tokens = args.prompts * args.new_tokens
    first = next(iter(contenders))
    result = {
        "prompts": args.prompts, "new_tokens": args.new_tokens, "rounds": args.rounds,
        "median_s": {name: statistics.median(s) for name, s in seconds.items()},
        "tokens_per_s": {name: new_tokens / statistics.median(s) for name, s in seconds.items()},
        "same_tokens": {name: sum(a == b for a, b in zip(tokens[first], tokens[name])) for name in contenders},
        "compiled_programs": {name: engine.stats().compiled_programs for name, engine in engines.items()},
    }
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
