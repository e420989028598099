"""Stopping every process of a multi-process job, with a clear message, when one of them dies.

Without this, a process whose peer died waits in a collective until JAX's coordination
service misses the peer's heartbeats (`DistributedSettings.heartbeat_timeout`, 100 s by
default), then aborts (SIGABRT, a C++ stack trace, a core dump where they are enabled)
with "Terminating process because the JAX distributed service detected fatal errors".

Here process 0 listens on a TCP port (any free one, on all interfaces; its address
reaches the others through a broadcast right after the job is joined) and every other
process keeps one connection to it. A process that dies, however it dies, has its
connections closed by the operating system, so its loss is seen at once:

* process 0 sees a peer's connection close: it tells the other processes which one was
  lost, prints the message and exits with `PEER_LOST_EXIT`;
* another process hears of the loss from process 0, or sees process 0's connection close
  (process 0 died; JAX's own abort for a dead coordinator may come first): the same.

A process that ends in an orderly way (exit, `sys.exit`, an error that Python reports)
says goodbye first (atexit), so its peers do not take its end for a loss. A silent loss
(a host powered off, the network cut) closes no connection: JAX's heartbeat timeout
still catches it. If the watch cannot be set up, a warning says so and training goes on
without it.
"""

from __future__ import annotations

import atexit
import logging
import os
import selectors
import socket
import sys
import threading
import time

logger = logging.getLogger(__name__)

# Exit status of a process stopped because a peer was lost (EX_TEMPFAIL: retrying may work).
PEER_LOST_EXIT = 75
# Bytes of the broadcast that carries process 0's HOST:PORT.
_ADDRESS_BYTES = 256
# Seconds a process waits for process 0's port to accept its connection.
_CONNECT_TIMEOUT = 30.0
# Seconds process 0 gives the others to stop on its notice before it exits itself.
_NOTICE_GRACE = 2.0

_watch: _Watch | None = None


def _message(lost: int, num_processes: int, me: int, how: str) -> str:
    return (
        f"axcore: error: lost process {lost} of this {num_processes}-process job ({how}); stopping process {me} "
        f"too (exit status {PEER_LOST_EXIT}). Restart all {num_processes} processes with the same run directory: "
        f"training resumes from the last committed checkpoint."
    )


def _stop(text: str) -> None:
    """Prints `text` on stderr and ends the process at once (other threads may be stuck in a collective)."""
    try:
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
    finally:
        os._exit(PEER_LOST_EXIT)


class _Watch:
    def __init__(self, process_id: int, num_processes: int):
        self.process_id = process_id
        self.num_processes = num_processes
        self.closing = False
        self.lock = threading.Lock()
        self.peers: dict[int, socket.socket] = {}  # Process 0: the others' connections by process id.
        self.server: socket.socket | None = None
        self.leader: socket.socket | None = None  # Other processes: the connection to process 0.

    # -- process 0 ---------------------------------------------------------------------------

    def listen(self) -> int:
        if socket.has_dualstack_ipv6():
            self.server = socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True)
        else:
            self.server = socket.create_server(("", 0))
        return self.server.getsockname()[1]

    def serve(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self.server, selectors.EVENT_READ, None)
        buffers: dict[socket.socket, bytes] = {}
        ids: dict[socket.socket, int] = {}
        while True:
            for key, _ in selector.select():
                sock = key.fileobj
                if sock is self.server:
                    conn, _ = self.server.accept()
                    buffers[conn] = b""
                    selector.register(conn, selectors.EVENT_READ, None)
                    continue
                try:
                    data = sock.recv(4096)
                except OSError:
                    data = b""
                if data:
                    buffers[sock] += data
                    while b"\n" in buffers[sock]:
                        line, buffers[sock] = buffers[sock].split(b"\n", 1)
                        words = line.decode(errors="replace").split()
                        if words[:1] == ["hello"] and len(words) == 2 and words[1].isdigit():
                            ids[sock] = int(words[1])
                            with self.lock:
                                self.peers[ids[sock]] = sock
                        elif words == ["bye"]:  # An orderly end: its closing is no loss.
                            selector.unregister(sock)
                            with self.lock:
                                self.peers.pop(ids.get(sock, -1), None)
                            sock.close()
                            break
                    continue
                selector.unregister(sock)
                sock.close()
                if sock in ids and not self.closing:
                    self.lost(ids[sock], "its connection closed: it exited or was killed without finishing")

    def lost(self, lost: int, how: str) -> None:
        """Process 0: tells the others which process was lost, gives them a moment to stop, stops."""
        with self.lock:
            others = [s for pid, s in self.peers.items() if pid != lost]
        notice = f"lost {lost}\n".encode()
        for sock in others:
            try:
                sock.sendall(notice)
            except OSError:
                pass
        deadline = time.monotonic() + _NOTICE_GRACE
        for sock in others:  # Each closes its end when it stops (or is gone already).
            try:
                sock.settimeout(max(0.0, deadline - time.monotonic()))
                while sock.recv(4096):
                    pass
            except OSError:
                pass
        _stop(_message(lost, self.num_processes, self.process_id, how))

    # -- other processes ---------------------------------------------------------------------

    def connect(self, host: str, port: int) -> None:
        self.leader = socket.create_connection((host, port), timeout=_CONNECT_TIMEOUT)
        self.leader.settimeout(None)
        self.leader.sendall(f"hello {self.process_id}\n".encode())

    def follow(self) -> None:
        buffer = b""
        while True:
            try:
                data = self.leader.recv(4096)
            except OSError:
                data = b""
            if not data:
                if not self.closing:
                    _stop(_message(0, self.num_processes, self.process_id, "process 0, the coordinator, is gone"))
                return
            buffer += data
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                words = line.decode(errors="replace").split()
                if words == ["bye"]:  # Process 0 ended in an orderly way: its closing is no loss.
                    return
                if words[:1] == ["lost"] and len(words) == 2 and not self.closing:
                    _stop(_message(int(words[1]), self.num_processes, self.process_id, "reported by process 0"))

    # -- both ----------------------------------------------------------------------------------

    def goodbye(self) -> None:
        """At an orderly exit: no longer watch, and tell the others this end is no loss."""
        self.closing = True
        with self.lock:
            socks = [self.leader] if self.leader is not None else list(self.peers.values())
        for sock in socks:
            try:
                sock.sendall(b"bye\n")
            except OSError:
                pass


def _broadcast_address(address: str) -> str:
    """Process 0's `address` on every process (a broadcast over the job's devices)."""
    import numpy as np
    from jax.experimental import multihost_utils

    buffer = np.zeros(_ADDRESS_BYTES, np.uint8)
    raw = address.encode()[:_ADDRESS_BYTES]
    buffer[: len(raw)] = np.frombuffer(raw, np.uint8)
    received = np.asarray(multihost_utils.broadcast_one_to_all(buffer))
    return bytes(received.astype(np.uint8)).rstrip(b"\0").decode()


def start(process_id: int, num_processes: int, coordinator_host: str | None) -> None:
    """Starts watching the job's processes (after `jax.distributed.initialize`, on every process).

    `coordinator_host`: the host the others reach process 0 at (None: its host name).
    Never raises: if the watch cannot be set up, logs a warning and returns.
    """
    global _watch
    if _watch is not None or num_processes <= 1:
        return
    watch = _Watch(process_id, num_processes)
    try:
        address = ""
        if process_id == 0:
            address = f"{coordinator_host or socket.gethostname()}|{watch.listen()}"
        address = _broadcast_address(address)
        if process_id == 0:
            threading.Thread(target=watch.serve, name="axcore-peer-watch", daemon=True).start()
        else:
            host, port = address.rsplit("|", 1)
            watch.connect(host, int(port))
            threading.Thread(target=watch.follow, name="axcore-peer-watch", daemon=True).start()
    except Exception as e:  # noqa: BLE001 - the watch is a convenience; never stop training for it.
        logger.warning(
            "Not watching the job's other processes (%s); a lost process is then noticed only after the "
            "heartbeat timeout.",
            " ".join(str(e).split())[:200],
        )
        return
    _watch = watch
    atexit.register(watch.goodbye)
    logger.info("Watching the job's %d processes for a lost one.", num_processes)


__all__ = ["PEER_LOST_EXIT", "start"]
