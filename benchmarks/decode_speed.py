"""Decoding speed: the inference engine's paged KV-cache decoding against re-running the full window for every token.

    python -m benchmarks.decode_speed [--model default|1b] [--batch 1 8] [--new-tokens N] [--rounds R]
    python -m benchmarks.decode_speed --smoke       # tiny model, 2 rounds (CI); numbers mean nothing

Contenders, each generating `--new-tokens` greedy tokens after a prompt of
`--prompt-len` tokens for every row of a batch, alternately in one process:

- `engine`: `axcore.engine.Engine` run offline as `axcore generate` runs it
  (`axcore.engine.offline`: the batch's prompts prefilled, then one token per row per
  engine step against the paged KV cache, each step one compiled program of a bucket
  shape, the scheduler and sampler on the host between steps);
- `full_window`: what the end-of-run sampler did before: for every new token, the
  model's `logits` over a fixed `[batch, window]` buffer (one compilation; the model is
  causal, so positions after the cursor do not matter), argmax at the cursor, the
  token written back on the host. `window` = the experiment's `input.seq_len`.

Both start from the same random parameters (speed does not depend on their values),
and their greedy tokens must agree (checked on the first round; bfloat16 models may
differ after a near-tie, which is reported, not failed). Reported: generated tokens per
second (batch x new tokens / wall time, compile excluded), medians over the rounds and
the median of per-round speed-ups.

Models: `default` is the default experiment (4 layers, d 256, byte vocabulary, learned
positions, window 256); `1b` is the ~1B Llama-shaped decoder of `benchmarks.gpu_step`
(bfloat16 compute, rope + swiglu, window 2048), for a GPU.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from benchmarks.common import alternate, pairwise_ratio, summarize, write_result

SMOKE = ["model.num_layers=1", "model.dim=32", "model.decoder.layer.self_attention.num_heads=2", "input.seq_len=32"]


def one_b_overrides() -> list[str]:
    """The ~1B decoder of `benchmarks.gpu_step` (`LlamaShape` defaults), bfloat16 compute."""
    from benchmarks.llama_jax import LlamaShape

    s = LlamaShape()
    return [
        "plugins=[rope, swiglu]", f"model.vocab_size={s.vocab}", f"model.dim={s.dim}", f"model.num_layers={s.layers}",
        "model.compute_dtype=bfloat16", f"model.decoder.layer.self_attention.num_heads={s.heads}",
        f"model.decoder.layer.self_attention.num_kv_heads={s.kv_heads}",
        f"model.decoder.layer.feed_forward.hidden_dim={s.ffn}", "rope.theta=500000", f"input.seq_len={s.seq}",
    ]


def full_window_decoder(model, window: int):
    """The re-run contender: `decode(params, prompts, num_new) -> tokens [batch, num_new]`."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from axcore.module import functional

    @jax.jit
    def next_tokens(params, buffer, cursor):
        logits, _ = functional(model, params, (buffer,), None, False, method="logits")
        return jnp.argmax(jax.lax.dynamic_index_in_dim(logits, cursor - 1, axis=1, keepdims=False), axis=-1)

    def decode(params, prompts: np.ndarray, num_new: int) -> np.ndarray:
        batch, length = prompts.shape
        buffer = np.zeros((batch, window), np.int32)
        buffer[:, :length] = prompts
        out = np.zeros((batch, num_new), np.int32)
        for i in range(num_new):
            cursor = length + i
            out[:, i] = np.asarray(next_tokens(params, buffer, cursor))
            if cursor < window:
                buffer[:, cursor] = out[:, i]
        return out

    return decode


def engine_decoder(model, params, prompts, num_new: int):
    """The engine contender: `decode() -> tokens [batch, num_new]` on one offline engine (programs compiled
    on the first call), greedy, end-of-sequence ignored."""
    import numpy as np

    from axcore.engine.engine import Engine
    from axcore.engine.offline import offline_config, run_requests
    from axcore.engine.requests import GenerationRequest, SamplingParams

    engine = Engine(model, params, config=offline_config(model, [len(p) for p in prompts], num_new))
    sampling = SamplingParams(max_tokens=num_new, temperature=0.0, ignore_eos=True)
    calls = iter(range(1 << 30))

    def decode() -> np.ndarray:
        call = next(calls)
        requests = [GenerationRequest(f"{call}-{i}", p.tolist(), sampling) for i, p in enumerate(prompts)]
        return np.array([out.choices[0].token_ids for out in run_requests(engine, requests)], np.int32)

    return decode


def measure(model_name: str, batch: int, args: argparse.Namespace) -> dict[str, Any]:
    import jax
    import numpy as np

    from axcore.experiment import load_experiment
    from axcore.trainer.trainer import Trainer

    overrides = SMOKE if args.smoke else (one_b_overrides() if model_name == "1b" else [])
    experiment = load_experiment(None, [*overrides, f"input.batch_size={batch}"])
    trainer = Trainer(experiment, stream=sys.stderr)
    model = trainer.step.model
    window = experiment.config.input.seq_len
    if args.prompt_len + args.new_tokens > window:
        raise SystemExit(f"--prompt-len + --new-tokens must fit the window {window}.")
    with trainer.step.op_environment():
        params = jax.jit(model.initialize)(jax.random.key(0))
        prompts = np.random.default_rng(0).integers(0, experiment.config.model.vocab_size, (batch, args.prompt_len))
        prompts = prompts.astype(np.int32)
        engine = engine_decoder(model, params, prompts, args.new_tokens)
        rerun = full_window_decoder(model, window)
        first = {"engine": engine(), "full_window": rerun(params, prompts, args.new_tokens)}
        agree = float(np.mean(first["engine"] == first["full_window"]))

        def timed_engine() -> float:
            start = time.perf_counter()
            engine()
            return time.perf_counter() - start

        def timed_rerun() -> float:
            start = time.perf_counter()
            rerun(params, prompts, args.new_tokens)
            return time.perf_counter() - start

        times = alternate({"engine": timed_engine, "full_window": timed_rerun}, args.rounds)
    tokens = batch * args.new_tokens
    result: dict[str, Any] = {"batch": batch, "window": window, "tokens_agree": agree}
    for name, series in times.items():
        result[name] = {"seconds": summarize(series), "tokens_per_s": tokens / summarize(series)["median"]}
    result["speedup"] = pairwise_ratio(times["full_window"], times["engine"])
    return result


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.decode_speed", description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny model, 2 rounds (CI); numbers mean nothing")
    p.add_argument("--model", choices=("default", "1b"), default="default", help="default experiment or the ~1B decoder")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="batch sizes, one measurement each (default 1 8)")
    p.add_argument("--prompt-len", type=int, default=16, help="prompt tokens per row (default 16)")
    p.add_argument("--new-tokens", type=int, default=200, help="generated tokens per row (default 200)")
    p.add_argument("--rounds", type=int, default=5, help="alternated rounds (default 5)")
    p.add_argument("--results-dir", type=pathlib.Path, help="for the JSON (default benchmarks/results)")
    return p


def run(smoke: bool = False, results_dir: pathlib.Path | None = None, argv: list[str] | None = None) -> dict[str, Any]:
    args = parser().parse_args(argv or [])
    if smoke:
        args.smoke, args.rounds, args.new_tokens, args.prompt_len, args.batch = True, 2, 8, 4, [1, 2]
    rows = [measure(args.model, b, args) for b in args.batch]
    headlines = []
    for row in rows:
        headlines.append({
            "metric": f"{args.model}, batch {row['batch']}: engine tokens/s (full-window re-run tokens/s)",
            "value": f"{row['engine']['tokens_per_s']:.0f} ({row['full_window']['tokens_per_s']:.0f})",
        })
        headlines.append({"metric": f"{args.model}, batch {row['batch']}: speed-up (median of rounds)",
                          "value": round(row["speedup"]["median"], 2)})
    data = {"smoke": smoke, "model": args.model, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
            "rounds": args.rounds, "rows": rows, "headlines": headlines}
    name = "decode_speed" if args.model == "default" else f"decode_speed_{args.model}"
    write_result(name, data, results_dir=results_dir)
    return data


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    data = run(args.smoke, args.results_dir, argv)
    for line in data["headlines"]:
        print(f"{line['metric']}: {line['value']}")
    for row in data["rows"]:
        print(f"batch {row['batch']}: greedy tokens agree {row['tokens_agree']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
