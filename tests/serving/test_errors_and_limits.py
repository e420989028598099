"""Raw HTTP against a live server: OpenAI error bodies (400/401/404/429), cancellation on disconnect, /metrics."""

import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from axcore.serving import ServerSettings

from rule_engine import BASE, LiveServer, RuleEngine


def wait_for(condition, what: str, limit_s: float = 20.0) -> None:
    """Polls `condition()` until true; fails naming `what` after `limit_s` (a bound, not a timing check)."""
    end = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < end, f"never: {what}"
        time.sleep(0.01)


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


@pytest.fixture(scope="module")
def live():
    with LiveServer(RuleEngine()) as server:
        yield server


BAD = [  # (endpoint, body, the field the 400 names)
    ("completions", {"prompt": "a", "n": "two"}, "n"),
    ("completions", {"prompt": "a", "max_tokens": -1}, "max_tokens"),
    ("completions", {"prompt": "a", "temperature": -0.5}, "temperature"),
    ("completions", {"prompt": "a", "presence_penalty": 3}, "presence_penalty"),
    ("completions", {"prompt": "a", "logprobs": 21}, "logprobs"),
    ("completions", {"prompt": "a", "stop": [""]}, "stop"),
    ("completions", {"prompt": [1, 500]}, "prompt"),
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", {"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": "a", "suffix": "z"}, "suffix"),
    ("completions", {"n": 1}, "prompt"),
    ("chat/completions", {"messages": [{"role": "user", "content": "a"}], "logprobs": True, "top_logprobs": 30},
     "top_logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ("chat/completions", {"messages": [{"role": "user", "content": "a"}]}, "messages"),  # No chat template.
]


@pytest.mark.parametrize("endpoint,body,field", BAD)
def test_a_bad_request_gets_a_400_naming_the_field(live, endpoint, body, field):
    error = error_of(httpx.post(f"{live.url}/v1/{endpoint}", json=body), 400)
    assert (error["param"], error["type"]) == (field, "invalid_request_error") and error["code"] is None
    assert error["message"]


def test_malformed_json_unknown_model_and_route(live):
    assert error_of(httpx.post(f"{live.url}/v1/completions", content=b"{x", headers={
        "content-type": "application/json"}), 400)["message"].startswith("The request body is not valid JSON")
    error = error_of(httpx.post(f"{live.url}/v1/completions", json={"prompt": "a", "model": "gpt-9"}), 404)
    assert error["param"] == "model" and "gpt-9" in error["message"] and BASE in error["message"]
    assert error_of(httpx.get(f"{live.url}/v1/nothing"), 404)["param"] is None


def test_the_api_key_is_enforced_on_v1_only():
    with LiveServer(RuleEngine(), ServerSettings(api_key="s3cret")) as live:
        body = {"prompt": "a", "max_tokens": 1}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            error = error_of(httpx.post(f"{live.url}/v1/completions", json=body, headers=headers), 401)
            assert error["code"] == "invalid_api_key"
        assert error_of(httpx.get(f"{live.url}/v1/models"), 401)
        ok = httpx.post(f"{live.url}/v1/completions", json=body, headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "b"
        assert httpx.get(f"{live.url}/health").json() == {"status": "ok"}
        assert live.engine.requests.keys() == {ok.json()["id"] + "-0"}  # The refused ones never reached it.


def test_past_max_waiting_a_request_gets_a_429_and_the_held_ones_finish():
    hold = threading.Event()
    with LiveServer(RuleEngine(hold=hold), ServerSettings(max_waiting=2)) as live:
        answers = []
        threads = [threading.Thread(target=lambda: answers.append(httpx.post(
            f"{live.url}/v1/completions", json={"prompt": "a", "max_tokens": 2}, timeout=30))) for _ in range(2)]
        for t in threads:
            t.start()
        wait_for(lambda: live.engine.waiting == 2, "two requests held")
        error = error_of(httpx.post(f"{live.url}/v1/completions", json={"prompt": "a"}), 429)
        assert "2" in error["message"] and "--max-waiting" in error["message"]
        hold.set()
        for t in threads:
            t.join(30)
        assert [a.json()["choices"][0]["text"] for a in answers] == ["bc", "bc"]
        assert httpx.post(f"{live.url}/v1/completions", json={"prompt": "a", "max_tokens": 1}).status_code == 200


def test_a_client_that_disconnects_mid_stream_aborts_its_request():
    with LiveServer(RuleEngine(step_s=0.01)) as live:
        body = {"prompt": "a", "max_tokens": 10_000, "stream": True}
        with httpx.stream("POST", f"{live.url}/v1/completions", json=body, timeout=30) as response:
            events = response.iter_lines()
            first = next(line for line in events if line.startswith("data: "))
            next(line for line in events if line.startswith("data: "))
        assert '"text": "b"' in first
        wait_for(lambda: len(live.engine.aborted) == 1, "the engine saw the abort")
        assert not live.engine.live and not live.engine.finished
        assert live.engine.generation_tokens < 10_000


def test_a_client_that_leaves_while_its_request_waits_aborts_it():
    hold = threading.Event()
    with LiveServer(RuleEngine(hold=hold), ServerSettings(disconnect_poll_s=0.02)) as live:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{live.url}/v1/completions", json={"prompt": "a"}, timeout=0.3)
        wait_for(lambda: len(live.engine.aborted) == 1, "the engine saw the abort")
        assert live.engine.waiting == 0 and not live.engine.live
        assert live.app.state.serving.admission.pending == 0


def metrics(live) -> dict[str, float]:
    """{sample name (labels appended): value} of /metrics, parsed by prometheus_client's parser."""
    response = httpx.get(f"{live.url}/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return {s.name + "".join(f"{{{k}={v}}}" for k, v in sorted(s.labels.items())): s.value
            for family in text_string_to_metric_families(response.text) for s in family.samples}


def test_metrics_count_tokens_requests_and_latencies():
    with LiveServer(RuleEngine(num_blocks=100)) as live:
        lengths = [(3, 4), (5, 1), (2, 6)]  # (prompt tokens, max_tokens)
        for prompt, new in lengths:
            assert httpx.post(f"{live.url}/v1/completions", json={"prompt": "x" * prompt, "max_tokens": new}).is_success
        two = httpx.post(f"{live.url}/v1/completions", json={"prompt": "yy", "max_tokens": 3, "n": 2}).json()
        assert two["usage"]["completion_tokens"] == 6
        got = metrics(live)
        assert got["axcore_prompt_tokens_total"] == sum(p for p, _ in lengths) + 2
        assert got["axcore_generation_tokens_total"] == sum(n for _, n in lengths) + 6
        assert got["axcore_time_to_first_token_seconds_count"] == 4  # One per engine request.
        # One per token after each choice's first: (4-1) + 0 + (6-1) for n=1, 2 * (3-1) for n=2.
        assert got["axcore_inter_token_latency_seconds_count"] == 3 + 0 + 5 + 4
        assert got['axcore_inter_token_latency_seconds_bucket{le=+Inf}'] == 12
        assert (got["axcore_kv_blocks_used"], got["axcore_kv_blocks_free"]) == (0, 100)
        assert got["axcore_requests_waiting"] == got["axcore_sequences_running"] == 0
        assert got["axcore_server_pending_requests"] == 0 and got["axcore_prefix_cache_hit_rate"] == 0


def test_metrics_show_a_running_request_and_its_blocks():
    with LiveServer(RuleEngine(step_s=0.01, block_size=4)) as live:
        body = {"prompt": "abcdef", "max_tokens": 10_000, "stream": True, "n": 2}
        with httpx.stream("POST", f"{live.url}/v1/completions", json=body, timeout=30) as response:
            lines = response.iter_lines()  # Held: dropping it closes the connection.
            next(line for line in lines if line.startswith("data: "))
            got = metrics(live)
            assert got["axcore_sequences_running"] == 2
            assert got["axcore_kv_blocks_used"] >= 2 * 2  # ceil((6 + t) / 4) blocks for each of 2 choices.
        wait_for(lambda: not live.engine.live, "the request aborted")
        assert metrics(live)["axcore_kv_blocks_used"] == 0
