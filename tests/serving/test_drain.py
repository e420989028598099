"""SIGTERM drains: a server process stops accepting, finishes the stream in flight, then exits; draining refuses."""

import os
import pathlib
import signal
import subprocess
import sys

import httpx
import pytest

from rule_engine import LiveServer, RuleEngine, expected

HERE = pathlib.Path(__file__).parent
# The server in a process of its own (uvicorn installs its signal handlers in the main thread only).
SERVER = f"""
import socket, sys
sys.path[:0] = [{str(HERE)!r}, {str(HERE.parent / 'helpers')!r}]
from rule_engine import RuleEngine, VOCAB
from axcore.data.tokenizer import ByteTokenizer
from axcore.serving import TextFrontend, create_app, make_server
sock = socket.socket()
sock.bind(("127.0.0.1", 0))
app = create_app(RuleEngine(step_s=0.02), TextFrontend(ByteTokenizer(), vocab_size=VOCAB))
server = make_server(app, log_level="warning")
print(sock.getsockname()[1], flush=True)
server.run(sockets=[sock])
"""


def test_sigterm_lets_the_running_stream_finish_then_the_process_exits():
    process = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True, env=os.environ)
    try:
        url = f"http://127.0.0.1:{int(process.stdout.readline())}"
        body = {"prompt": "a", "max_tokens": 40, "stream": True}
        for _ in range(500):  # Until uvicorn listens (the port is bound before it starts).
            try:
                httpx.get(f"{url}/health", timeout=5)
                break
            except httpx.ConnectError:
                pass
        texts = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as response:
            lines = response.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    texts.append(line)
                    if len(texts) == 2:
                        process.send_signal(signal.SIGTERM)
                if line == "data: [DONE]":
                    break
        assert len(texts) == 40 and '"finish_reason": "length"' in texts[-1]
        assert "".join(httpx.Response(200, content=t[6:]).json()["choices"][0]["text"] for t in texts) == (
            expected("a", 40)[0])
        assert process.wait(30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once drained.
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health", timeout=5)
    finally:
        process.kill()
        process.wait()


def test_while_draining_health_and_new_requests_answer_503():
    with LiveServer(RuleEngine()) as live:
        live.app.state.serving.draining = True
        assert httpx.get(f"{live.url}/health").status_code == 503
        response = httpx.post(f"{live.url}/v1/completions", json={"prompt": "a"})
        assert response.status_code == 503 and response.json()["error"]["code"] == "draining"
        assert not live.engine.requests
