"""Running the app under uvicorn: the loopback rule, and a shutdown that drains.

`check_host` refuses a host that is not a loopback address unless remote clients are
allowed explicitly (`--allow-remote`): a model server answers anyone who can reach it.
`DrainingServer` is uvicorn's server whose exit (SIGTERM, SIGINT, or `handle_exit`
called by a test) first marks the app as draining (`/health` answers 503 and new `/v1`
requests get a 503), then lets uvicorn close the listening socket and wait for the
requests in flight, streams included, to finish before the process exits.
"""

from __future__ import annotations

import ipaddress
import socket

import uvicorn

from axcore.errors import AxcoreError


class ServeError(AxcoreError):
    """Bad `axcore serve` arguments (host, port, bounds)."""


def is_loopback(host: str) -> bool:
    """Whether every address `host` (an IP address or a name) resolves to is a loopback one."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError as e:
        raise ServeError(f"--host '{host}' does not resolve ({e}); give an IP address such as 127.0.0.1.") from None
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def check_host(host: str, allow_remote: bool) -> None:
    """ServeError unless `host` is a loopback address or `allow_remote`."""
    if not allow_remote and not is_loopback(host):
        raise ServeError(
            f"--host '{host}' is not a loopback address: anyone who can reach it could use the model; add "
            f"--allow-remote (and --api-key KEY) to serve other machines, or bind 127.0.0.1."
        )


class DrainingServer(uvicorn.Server):
    """uvicorn's server; on exit it first sets `app.state.serving.draining`, then drains as uvicorn does."""

    def __init__(self, config: uvicorn.Config, state):
        super().__init__(config)
        self.serving_state = state

    def handle_exit(self, sig, frame) -> None:
        self.serving_state.draining = True
        super().handle_exit(sig, frame)


def make_server(app, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
                drain_timeout_s: float | None = None) -> DrainingServer:
    """A server for `app` (made by `create_app`); `drain_timeout_s` bounds the wait for running requests
    at shutdown (None: as long as they take)."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="off",
                            timeout_graceful_shutdown=drain_timeout_s)
    return DrainingServer(config, app.state.serving)
