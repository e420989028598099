"""The real `axcore serve` app over an engine, under uvicorn on 127.0.0.1 (a free port) in a thread.

    with LiveServer(engine, TextFrontend(tokenizer, None, vocab_size=256)) as server:
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")...
"""

from __future__ import annotations

import socket
import threading
import time

from axcore.serving import ServerSettings, TextFrontend, create_app, make_server


class LiveServer:
    """The app over `engine` and `frontend` under uvicorn on 127.0.0.1 (a free port) in a thread; a context manager."""

    def __init__(self, engine, frontend: TextFrontend, settings: ServerSettings | None = None):
        self.engine = engine
        self.app = create_app(engine, frontend, settings or ServerSettings())
        self.server = make_server(self.app, log_level="warning")
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind(("127.0.0.1", 0))
        self.port = self.socket.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        while not self.server.started:
            assert self.thread.is_alive(), "the server thread died"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(30)
        self.socket.close()
