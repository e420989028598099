"""Stopping every process of a multi-process job, with a clear message, when one of them dies.

Without this, a process whose peer died waits in a collective until JAX's coordination
service misses the peer's heartbeats (`DistributedSettings.heartbeat_timeout`, 100 s by
default), then aborts (SIGABRT, a C++ stack trace, a core dump where they are enabled)
with "Terminating process because the JAX distributed service detected fatal errors".

Here process 0 listens on a TCP port and every other process keeps one authenticated
connection to it. A process that dies, however it dies, has its connections closed by
the operating system, so its loss is seen at once:

* process 0 sees a peer's connection close: it tells the other processes which one was
  lost, prints the message and exits with `PEER_LOST_EXIT`;
* another process hears of the loss from process 0, or sees process 0's connection close
  (process 0 died; JAX's own abort for a dead coordinator may come first): the same.

A process that ends in an orderly way (exit, `sys.exit`, an error that Python reports)
says goodbye first (atexit), so its peers do not take its end for a loss. A silent loss
(a host powered off, the network cut) closes no connection: JAX's heartbeat timeout
still catches it. If the watch cannot be set up, a warning says so and training goes on
without it.

What is bound: one address, never the wildcard: the coordinator host's (the host the
other processes reach process 0 at; a name is resolved, IPv4 first; 127.0.0.1 for a
loopback or unspecified coordinator), any free port. Where that address is not one of
this machine's (a load balancer's name), or the coordinator host is unknown (Slurm: JAX
reads it from the node list, which names process 0's node), the address this machine's
host name resolves to. The chosen address and port are logged at INFO.

How peers authenticate: process 0 draws a 32-byte secret per job; it reaches the others,
with the address, through a broadcast over the job's own devices
(`multihost_utils.broadcast_one_to_all`), never through this port. On each connection
process 0 sends `challenge <nonce>`; the peer answers `hello <id> <its nonce>
<HMAC-SHA256(secret, hello|nonce|id)>`; process 0 checks it (`hmac.compare_digest`),
registers the peer and answers `welcome <HMAC-SHA256(secret, welcome|its nonce|id)>`,
which the peer checks before it trusts anything from process 0 (`lost N`, `bye`).

What a stranger that reaches the port can do: hold at most `MAX_PENDING` connections
open for `AUTH_TIMEOUT` seconds each, each buffering at most `_MAX_LINE` bytes; more are
closed at once. A connection that sends anything but a valid hello, sends a line longer
than `_MAX_LINE`, or is silent for `AUTH_TIMEOUT`, is closed and forgotten: it is never a
peer, its lines change nothing, its close is no loss. Flooding the port while the job
starts can keep a real peer from connecting; that peer then trains unwatched (a warning
says so; JAX's heartbeat still applies). It cannot stop the job, mark a process lost,
or learn the secret. An attacker who can read the job's own collective traffic (gloo
over TCP on CPU) sees the secret, as it sees the model's gradients.
"""

from __future__ import annotations

import atexit
import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import selectors
import socket
import sys
import threading
import time

from axcore.platform import exit_hooks

logger = logging.getLogger(__name__)

# Exit status of a process stopped because a peer was lost (EX_TEMPFAIL: retrying may work).
PEER_LOST_EXIT = 75
# Bytes of the broadcast that carry process 0's HOST|PORT (the job's secret follows them).
_ADDRESS_BYTES = 256
# Bytes of the job's secret, drawn by process 0.
_SECRET_BYTES = 32
# Seconds a process waits for process 0 to accept its connection and to answer its hello.
_CONNECT_TIMEOUT = 30.0
# Seconds process 0 gives a new connection to authenticate before closing it.
AUTH_TIMEOUT = 5.0
# Unauthenticated connections process 0 holds at once; further ones are closed at once.
MAX_PENDING = 32
# Longest line either end reads (bytes); an unauthenticated sender of a longer one is dropped.
_MAX_LINE = 256
# Seconds process 0 gives the others to stop on its notice before it exits itself.
_NOTICE_GRACE = 2.0

_watch: PeerWatch | None = None


def _message(lost: int, num_processes: int, me: int, how: str) -> str:
    return (
        f"axcore: error: lost process {lost} of this {num_processes}-process job ({how}); stopping process {me} "
        f"too (exit status {PEER_LOST_EXIT}). Restart all {num_processes} processes with the same run directory: "
        f"training resumes from the last committed checkpoint."
    )


def _stop(text: str) -> None:
    """Prints `text` on stderr, runs `exit_hooks` (the run directory's clean-up) and ends the process at once
    (other threads may be stuck in a collective)."""
    try:
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
        exit_hooks.run_all(text.removeprefix("axcore: error: "))
    finally:
        os._exit(PEER_LOST_EXIT)


def _mac(secret: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 of the `|`-joined parts, in hex (the parts are words of one line: no `|` inside)."""
    return hmac.new(secret, b"|".join(parts), hashlib.sha256).hexdigest().encode()


def _bind_candidates(coordinator_host: str | None) -> list[tuple[int, tuple]]:
    """(family, socket address with port 0) to try in order; never a wildcard address."""
    hosts = [h.strip("[]") for h in (coordinator_host, socket.gethostname()) if h]
    candidates = []
    for host in dict.fromkeys(hosts):
        try:
            infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
        except OSError:
            continue
        for family, _, _, _, address in sorted(infos, key=lambda info: info[0] != socket.AF_INET):
            if ipaddress.ip_address(address[0].split("%")[0]).is_unspecified:  # "0.0.0.0" reaches this host only.
                family, address = socket.AF_INET, ("127.0.0.1", 0)
            candidates.append((family, address))
    return candidates


class _Conn:
    """Process 0's end of one connection: a stranger until a valid hello names its process."""

    def __init__(self, sock: socket.socket, nonce: bytes):
        self.sock = sock
        self.nonce = nonce  # The challenge sent to it.
        self.deadline = time.monotonic() + AUTH_TIMEOUT  # To authenticate by.
        self.buffer = b""
        self.process: int | None = None  # Its process id, once authenticated.


class PeerWatch:
    def __init__(self, process_id: int, num_processes: int, secret: bytes = b""):
        self.process_id = process_id
        self.num_processes = num_processes
        self.secret = secret
        self.closing = False
        self.lock = threading.Lock()
        self.peers: dict[int, socket.socket] = {}  # Process 0: the authenticated peers by process id.
        self.server: socket.socket | None = None
        self.leader: socket.socket | None = None  # Other processes: the connection to process 0.
        self.buffer = b""  # Other processes: what process 0 sent past the last full line.

    # -- process 0 ---------------------------------------------------------------------------

    def listen(self, coordinator_host: str | None) -> tuple[str, int]:
        """Listens on the coordinator host's address (see the module docstring); -> (address, port)."""
        error: OSError | None = None
        for family, address in _bind_candidates(coordinator_host):
            server = socket.socket(family, socket.SOCK_STREAM)
            try:
                server.bind(address)
                server.listen()
                server.setblocking(False)  # A connection reset before `accept` must not block it.
            except OSError as e:  # Not an address of this machine.
                server.close()
                error = e
                continue
            self.server = server
            host, port = socket.getnameinfo(server.getsockname(), socket.NI_NUMERICHOST | socket.NI_NUMERICSERV)
            return host, int(port)
        raise OSError(f"no address of {coordinator_host or socket.gethostname()!r} to listen on ({error})")

    def serve(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self.server, selectors.EVENT_READ, None)
        while True:
            now = time.monotonic()
            strangers = []
            for conn in [k.data for k in selector.get_map().values() if k.data is not None and k.data.process is None]:
                if conn.deadline <= now:  # Did not authenticate in time: closed, forgotten.
                    self.drop(selector, conn)
                else:
                    strangers.append(conn)
            deadlines = [conn.deadline - now for conn in strangers]
            for key, _ in selector.select(min(deadlines) if deadlines else None):
                if key.data is None:
                    self.accept(selector, len(strangers))
                else:
                    self.read(selector, key.data)

    def accept(self, selector: selectors.BaseSelector, strangers: int) -> None:
        try:
            sock, _ = self.server.accept()
        except OSError:
            return
        conn = _Conn(sock, secrets.token_hex(16).encode())
        try:
            if strangers >= MAX_PENDING:
                raise OSError("too many unauthenticated connections")
            sock.sendall(b"challenge " + conn.nonce + b"\n")
        except OSError:
            sock.close()
            return
        selector.register(sock, selectors.EVENT_READ, conn)

    def read(self, selector: selectors.BaseSelector, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(4096)
        except OSError:
            data = b""
        if not data:
            self.drop(selector, conn)
            if conn.process is not None and not self.closing:
                self.lost(conn.process, "its connection closed: it exited or was killed without finishing")
            return
        conn.buffer += data
        while b"\n" in conn.buffer:
            line, conn.buffer = conn.buffer.split(b"\n", 1)
            words = line.split()
            if conn.process is None and not self.authenticate(conn, words):
                self.drop(selector, conn)  # Anything but a valid hello: closed, forgotten.
                return
            if conn.process is not None and words == [b"bye"]:  # An orderly end: its closing is no loss.
                self.drop(selector, conn)
                return
        if len(conn.buffer) > _MAX_LINE:  # A line too long: a stranger is dropped, a peer's line ignored.
            if conn.process is None:
                self.drop(selector, conn)
            conn.buffer = b""

    def authenticate(self, conn: _Conn, words: list[bytes]) -> bool:
        """Checks `hello <id> <nonce> <mac>`; if valid, registers the peer and answers `welcome <mac>`."""
        if len(words) != 4 or words[0] != b"hello" or not words[1].isdigit() or len(words[1]) > 9:
            return False
        process, peer_nonce = int(words[1]), words[2]
        me = str(process).encode()
        if not 0 < process < self.num_processes:
            return False
        if not hmac.compare_digest(words[3], _mac(self.secret, b"hello", conn.nonce, me)):
            return False
        try:
            conn.sock.sendall(b"welcome " + _mac(self.secret, b"welcome", peer_nonce, me) + b"\n")
        except OSError:
            return False
        conn.process = process
        with self.lock:
            self.peers[process] = conn.sock
        return True

    def drop(self, selector: selectors.BaseSelector, conn: _Conn) -> None:
        if conn.process is not None:
            with self.lock:
                if self.peers.get(conn.process) is conn.sock:
                    del self.peers[conn.process]
        selector.unregister(conn.sock)
        conn.sock.close()

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
        """Connects to process 0 and authenticates both ways; raises OSError if either fails."""
        self.leader = socket.create_connection((host, port), timeout=_CONNECT_TIMEOUT)
        try:
            words = self.next_line()
            if words is None or len(words) != 2 or words[0] != b"challenge":
                raise OSError("process 0 sent no challenge")
            nonce, me = secrets.token_hex(16).encode(), str(self.process_id).encode()
            self.leader.sendall(b" ".join([b"hello", me, nonce, _mac(self.secret, b"hello", words[1], me)]) + b"\n")
            words = self.next_line()
            if words is None or len(words) != 2 or words[0] != b"welcome":
                raise OSError("process 0 did not accept this process")
            if not hmac.compare_digest(words[1], _mac(self.secret, b"welcome", nonce, me)):
                raise OSError("the answer on process 0's port does not know the job's secret")
        except BaseException:
            self.leader.close()
            raise
        self.leader.settimeout(None)

    def next_line(self) -> list[bytes] | None:
        """The next line from process 0, split into words; None once the connection is closed."""
        while b"\n" not in self.buffer:
            try:
                data = self.leader.recv(4096)
            except OSError:
                data = b""
            if not data or len(self.buffer) > _MAX_LINE:
                return None
            self.buffer += data
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line.split()

    def follow(self) -> None:
        while True:
            words = self.next_line()
            if words is None:
                if not self.closing:
                    _stop(_message(0, self.num_processes, self.process_id, "process 0, the coordinator, is gone"))
                return
            if words == [b"bye"]:  # Process 0 ended in an orderly way: its closing is no loss.
                return
            if len(words) == 2 and words[0] == b"lost" and words[1].isdigit() and not self.closing:
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


def _broadcast(address: str, secret: bytes) -> tuple[str, bytes]:
    """Process 0's `address` and `secret` on every process (a broadcast over the job's devices)."""
    import numpy as np
    from jax.experimental import multihost_utils

    buffer = np.zeros(_ADDRESS_BYTES + _SECRET_BYTES, np.uint8)
    raw = address.encode()[:_ADDRESS_BYTES]
    buffer[: len(raw)] = np.frombuffer(raw, np.uint8)
    buffer[_ADDRESS_BYTES:] = np.frombuffer(secret, np.uint8)
    received = bytes(np.asarray(multihost_utils.broadcast_one_to_all(buffer)).astype(np.uint8))
    return received[:_ADDRESS_BYTES].rstrip(b"\0").decode(), received[_ADDRESS_BYTES:]


def start(process_id: int, num_processes: int, coordinator_host: str | None) -> None:
    """Starts watching the job's processes (after `jax.distributed.initialize`, on every process).

    `coordinator_host`: the host the others reach process 0 at (None: its host name); process
    0 listens on that address only. Never raises: if the watch cannot be set up, logs a
    warning and returns.
    """
    global _watch
    if _watch is not None or num_processes <= 1:
        return
    watch = PeerWatch(process_id, num_processes)
    try:
        address, secret = "", bytes(_SECRET_BYTES)
        if process_id == 0:
            host, port = watch.listen(coordinator_host)
            address, secret = f"{host}|{port}", secrets.token_bytes(_SECRET_BYTES)
        address, watch.secret = _broadcast(address, secret)
        host, port = address.rsplit("|", 1)
        if process_id == 0:
            threading.Thread(target=watch.serve, name="axcore-peer-watch", daemon=True).start()
        else:
            watch.connect(host, int(port))
            threading.Thread(target=watch.follow, name="axcore-peer-watch", daemon=True).start()
    except Exception as e:  # The watch is a convenience; never stop training for it.
        logger.warning(
            "Not watching the job's other processes (%s); a lost process is then noticed only after the "
            "heartbeat timeout.",
            " ".join(str(e).split())[:200],
        )
        return
    _watch = watch
    atexit.register(watch.goodbye)
    logger.info("Watching the job's %d processes for a lost one (process 0 listens on %s port %s).",
                num_processes, host, port)


__all__ = ["PEER_LOST_EXIT", "start"]
