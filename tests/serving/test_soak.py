"""A bounded soak on loopback: 100 requests from 16 concurrent clients, 10% cancelled mid-stream, 10% malformed.

Every good request's text equals its answer alone (the rule, computed without the server),
every bad one gets a 4xx JSON error body, every cancelled one is aborted in the engine, and
no request is left in the engine or the server's waiting count.
"""

import asyncio
import json
import random
import time

import httpx

from rule_engine import ADAPTER, BASE, LiveServer, RuleEngine, expected

MALFORMED = [
    {"prompt": "a", "temperature": "hot"}, {"prompt": "a", "top_p": 2}, {"prompt": []}, {"max_tokens": 3},
    {"prompt": "a", "model": "missing"}, {"prompt": "a", "n": 0}, {"prompt": [1, 999]}, {"prompt": "a", "seed": 1.5},
]


def plan(count: int, seed: int = 0) -> list[dict]:
    """`count` requests: kind "good" (streamed or not, base or adapter), "cancel" or "bad"."""
    rng = random.Random(seed)
    kinds = ["cancel"] * (count // 10) + ["bad"] * (count // 10)
    kinds += ["good"] * (count - len(kinds))
    rng.shuffle(kinds)
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
