"""Bounded soaks on loopback: 10% of the requests cancelled mid-stream, 10% malformed.

Over the rule engine, 100 requests from 16 concurrent clients; over the REAL engine (a tiny
random Llama, `axcore serve`'s app), 500 requests from 32 clients, as issue 36 asks. Every
good request's text equals its answer alone (the rule, or the same engine running that
request by itself before the soak), every bad one gets a 4xx JSON error body, every
cancelled one is aborted in the engine, and no request, KV block or waiting count is left.
"""

import asyncio
import json
import random
import time
from pathlib import Path

import httpx
import pytest

from rule_engine import ADAPTER, BASE, LiveServer, RuleEngine, expected

MALFORMED = [
    {"prompt": "a", "temperature": "hot"}, {"prompt": "a", "top_p": 2}, {"prompt": []}, {"max_tokens": 3},
    {"prompt": "a", "model": "missing"}, {"prompt": "a", "n": 0}, {"prompt": [1, 999]}, {"prompt": "a", "seed": 1.5},
]


def shuffled_kinds(count: int, rng: random.Random) -> list[str]:
    """`count` job kinds in a random order: 10% "cancel", 10% "bad", the rest "good"."""
    kinds = ["cancel"] * (count // 10) + ["bad"] * (count // 10)
    kinds += ["good"] * (count - len(kinds))
    rng.shuffle(kinds)
    return kinds


def plan(count: int, seed: int = 0) -> list[dict]:
    """`count` requests: kind "good" (streamed or not, base or adapter), "cancel" or "bad"."""
    rng = random.Random(seed)
    kinds = shuffled_kinds(count, rng)
    jobs = []
    for i, kind in enumerate(kinds):
        prompt = "".join(rng.choice("abcdefghij") for _ in range(rng.randint(1, 12)))
        if kind == "bad":
            jobs.append({"kind": kind, "body": MALFORMED[i % len(MALFORMED)]})
            continue
        model = rng.choice([BASE, ADAPTER])
        tokens = 10_000 if kind == "cancel" else rng.randint(1, 24)
        stream = kind == "cancel" or rng.random() < 0.5
        jobs.append({"kind": kind, "prompt": prompt, "model": model, "tokens": tokens, "stream": stream,
                     "body": {"prompt": prompt, "model": model, "max_tokens": tokens, "stream": stream}})
    return jobs


async def one(client: httpx.AsyncClient, job: dict) -> str | None:
    """Runs a job; returns its text (good), None (cancelled), or checks its error body (bad)."""
    if not job["body"].get("stream"):
        response = await client.post("/v1/completions", json=job["body"])
        if job["kind"] == "bad":
            assert 400 <= response.status_code < 500 and set(response.json()["error"]) >= {"message", "param"}
            return None
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]
    text = []
    async with client.stream("POST", "/v1/completions", json=job["body"]) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            text.append(json.loads(line[6:])["choices"][0]["text"])
            if job["kind"] == "cancel" and len(text) == 3:
                return None  # Leaving the block closes the connection mid-stream.
    return "".join(text)


async def clients(url: str, jobs: list[dict], concurrency: int) -> list:
    queue = list(enumerate(jobs))
    results: list = [None] * len(jobs)

    async def worker():
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            while queue:
                i, job = queue.pop()
                results[i] = await one(client, job)

    await asyncio.gather(*[worker() for _ in range(concurrency)])
    return results


def test_soak_100_requests_16_clients_cancelled_and_malformed_ones_leave_nothing_behind():
    jobs = plan(100)
    with LiveServer(RuleEngine(step_s=0.002, num_blocks=10_000)) as live:
        results = asyncio.run(clients(live.url, jobs, 16))
        for job, text in zip(jobs, results):
            if job["kind"] == "good":
                assert text == expected(job["prompt"], job["tokens"], 0, None if job["model"] == BASE else ADAPTER)[0]
        end = time.monotonic() + 20
        while live.engine.live and time.monotonic() < end:
            time.sleep(0.01)
        engine = live.engine
        assert not engine.live and engine.waiting == 0 and engine.stats().kv_blocks_used == 0
        assert len(engine.aborted) == sum(job["kind"] == "cancel" for job in jobs) == 10
        assert len(engine.finished) == sum(job["kind"] == "good" for job in jobs) == 80
        assert live.app.state.serving.admission.pending == 0


# The real engine's soak: prompts and lengths from small pools, so each distinct request is run alone once first.
PROMPTS = ["a", "Hello", "The cat", "xyzzy", "Once upon", "0123456789", "axcore", "Soak it", "q", "lorem ipsum"]
LENGTHS = (3, 8, 16)
SEEDS = (None, 1)  # None: greedy; 1: drawn at temperature 1 with that seed.


def engine_plan(count: int, name: str, seed: int = 1) -> list[dict]:
    """`count` jobs for the real engine: good ones from the pools (streamed or not), cancels of 48 tokens, bad."""
    rng = random.Random(seed)
    kinds = shuffled_kinds(count, rng)
    jobs = []
    for i, kind in enumerate(kinds):
        if kind == "bad":
            jobs.append({"kind": kind, "body": MALFORMED[i % len(MALFORMED)]})
            continue
        key = (rng.choice(PROMPTS), 48 if kind == "cancel" else rng.choice(LENGTHS), rng.choice(SEEDS))
        body = {"prompt": key[0], "model": name, "max_tokens": key[1], "stream": kind == "cancel" or rng.random() < 0.5,
                "temperature": 0 if key[2] is None else 1.0, "seed": key[2], "ignore_eos": True}
        jobs.append({"kind": kind, "key": key, "body": body})
    return jobs


def resident_bytes() -> int:
    """This process's resident memory (Linux /proc)."""
    status = Path("/proc/self/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1]) * 1024


@pytest.mark.slow  # Compiles the engine's programs, then 500 requests (about 60-120 s on 2 loaded cores).
def test_soak_500_requests_32_clients_on_the_real_engine(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("axcore_hf")
    import live_server
    from tiny_llama import VOCAB, tiny_llama_run

    from axcore.engine import EngineConfig
    from axcore.engine.requests import GenerationRequest, SamplingParams
    from axcore.inference import load_engine
    from axcore.serving import TextFrontend

    _, run = tiny_llama_run(tmp_path)
    config = EngineConfig(block_size=16, num_blocks=160, max_seqs=32, max_tokens_per_step=64, max_model_len=64,
                          batch_buckets=(32,), token_buckets=(16, 64))
    engine = load_engine(str(run), config=config)
    jobs = engine_plan(500, engine.name)
    alone = {}
    for key in sorted({job["key"] for job in jobs if job["kind"] == "good"}, key=str):
        prompt, tokens, seed = key
        params = SamplingParams(max_tokens=tokens, temperature=0.0 if seed is None else 1.0, seed=seed,
                                ignore_eos=True)
        (out,) = engine.generate([GenerationRequest(f"alone-{len(alone)}", engine.tokenizer.encode(prompt), params)])
        alone[key] = out.choices[0].text
    aborted = []
    abort = engine.abort
    engine.abort = lambda rid: aborted.append(rid) or abort(rid)  # Counts the streams closed early.
    before = resident_bytes()
    with live_server.LiveServer(engine, TextFrontend(engine.tokenizer, None, vocab_size=VOCAB)) as live:
        results = asyncio.run(clients(live.url, jobs, 32))
        assert live.app.state.serving.admission.pending == 0
    grown = resident_bytes() - before
    engine.close()
    for job, text in zip(jobs, results):
        if job["kind"] == "good":
            assert text == alone[job["key"]], job
    stats = engine.stats()
    assert (stats.kv_blocks_used, stats.running, stats.waiting) == (0, 0, 0) and not engine.has_unfinished()
    assert len(aborted) >= sum(job["kind"] == "cancel" for job in jobs) == 50
    assert grown < 256 << 20, f"resident memory grew by {grown >> 20} MiB over the soak"
