"""The peer watch (`axcore.platform.peer_watch`) trusts only the job's own processes.

In one process: process 0's end (`PeerWatch.serve`) with its loss handler replaced by a
recorder, and raw sockets or a real peer end (`PeerWatch.connect`) talking to it. The
HMACs a test sends are computed here from the documented formula
(HMAC-SHA256(secret, b"hello|" + nonce + b"|" + id)), not with the module's helper.
Checked: an authenticated peer is registered and its close is a loss (so the checks
below can fail); a wrong secret, a replayed hello, `hello 1`, `bye`, garbage, an
over-long line, silence past the timeout and connections over the limit are closed,
never registered, never a loss; the bound address is the coordinator's, never a
wildcard.

In two processes (`peer_watch_worker.py`, joined through `jax.distributed` on
127.0.0.1): a stranger that reaches process 0's port and sends all of the above stops
neither process; the port listens on 127.0.0.1 only (read from /proc, and refused on the
machine's other address); so does JAX's coordinator service on the coordinator's port
(JAX's own default is every interface).
"""

import hashlib
import hmac
import ipaddress
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from axcore.platform import peer_watch
from axcore.platform.peer_watch import PeerWatch
from axcore.testing import host_devices_env

SECRET = bytes(range(32))
# Seconds a test waits for something that should happen at once.
PROMPT = 3.0
# Seconds the two-process job may take to start (JAX import, jax.distributed, the watch).
START_TIMEOUT = 120
# Seconds it may take to finish once told to.
FINISH_TIMEOUT = 60


def _hello_mac(secret: bytes, nonce: bytes, process: int) -> bytes:
    return hmac.new(secret, b"hello|" + nonce + b"|" + str(process).encode(), hashlib.sha256).hexdigest().encode()


def _read_line(sock: socket.socket, timeout: float = PROMPT) -> bytes:
    """One line from `sock` (without its newline), or b"" if the other end closed first."""
    sock.settimeout(timeout)
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(4096)
        if not chunk:
            return b""
        data += chunk
    return data[:-1]


def _closed_by_other_end(sock: socket.socket, timeout: float = PROMPT) -> bool:
    sock.settimeout(timeout)
    try:
        while sock.recv(4096):
            pass
    except (ConnectionResetError, BrokenPipeError):
        pass
    except TimeoutError:
        return False
    return True


class Server:
    """Process 0's end of a 3-process job's watch, in a thread; `losses` records what it took for a loss."""

    def __init__(self, host="127.0.0.1"):
        self.watch = PeerWatch(0, 3, SECRET)
        self.losses = []
        self.watch.lost = lambda lost, how: self.losses.append(lost)
        self.host, self.port = self.watch.listen(host)
        threading.Thread(target=self.watch.serve, daemon=True).start()

    def stranger(self) -> tuple[socket.socket, bytes]:
        """A raw connection and the nonce of the challenge it received."""
        sock = socket.create_connection((self.host, self.port), timeout=PROMPT)
        words = _read_line(sock).split()
        assert len(words) == 2 and words[0] == b"challenge", words
        return sock, words[1]

    def wait_for(self, predicate) -> bool:
        deadline = time.monotonic() + PROMPT
        while not predicate() and time.monotonic() < deadline:
            time.sleep(0.01)
        return predicate()


@pytest.fixture
def server():
    return Server()


def test_a_real_peer_is_registered_and_its_loss_seen(server):
    peer = PeerWatch(1, 3, SECRET)
    peer.connect(server.host, server.port)  # Raises unless process 0's welcome proves the secret.
    assert server.wait_for(lambda: 1 in server.watch.peers)
    peer.leader.close()
    assert server.wait_for(lambda: server.losses == [1])


def test_an_independently_computed_hello_is_accepted_and_bye_is_no_loss(server):
    sock, nonce = server.stranger()
    sock.sendall(b"hello 2 peernonce " + _hello_mac(SECRET, nonce, 2) + b"\n")
    expected = hmac.new(SECRET, b"welcome|peernonce|2", hashlib.sha256).hexdigest().encode()
    assert _read_line(sock) == b"welcome " + expected
    assert server.wait_for(lambda: 2 in server.watch.peers)
    sock.sendall(b"bye\n")
    assert _closed_by_other_end(sock)
    assert server.wait_for(lambda: 2 not in server.watch.peers)
    time.sleep(0.2)
    assert server.losses == []


def test_a_peer_without_the_secret_is_refused(server):
    peer = PeerWatch(1, 3, bytes(32))
    with pytest.raises(OSError, match="did not accept"):
        peer.connect(server.host, server.port)
    time.sleep(0.2)
    assert (server.watch.peers, server.losses) == ({}, [])


@pytest.mark.parametrize(
    "line",
    [
        b"hello 1",
        b"hello 1 n " + b"0" * 64,  # A wrong HMAC.
        b"bye",
        b"lost 1",
        b"\x00\xff garbage \xfe",
        b"x" * 100_000,  # An over-long line, no newline.
        "hello 1 n {replayed}",  # A valid HMAC, for another connection's nonce.
        "hello 0 n {mac0}",  # Valid HMACs for ids that are not peers.
        "hello 3 n {mac3}",
    ],
)
def test_a_stranger_changes_nothing(server, line):
    earlier, earlier_nonce = server.stranger()
    earlier.close()
    sock, nonce = server.stranger()
    if isinstance(line, str):
        macs = {"replayed": _hello_mac(SECRET, earlier_nonce, 1), "mac0": _hello_mac(SECRET, nonce, 0)}
        macs["mac3"] = _hello_mac(SECRET, nonce, 3)
        line = line.format(**{k: v.decode() for k, v in macs.items()}).encode()
    try:
        sock.sendall(line if line.startswith(b"x") else line + b"\n")
    except (ConnectionResetError, BrokenPipeError):  # Process 0 closed it mid-way: the limit works.
        pass
    assert _closed_by_other_end(sock)
    time.sleep(0.2)
    assert (server.watch.peers, server.losses) == ({}, [])
    # The watch still serves: a real peer still gets in.
    peer = PeerWatch(1, 3, SECRET)
    peer.connect(server.host, server.port)
    assert server.wait_for(lambda: 1 in server.watch.peers)


def test_a_silent_stranger_is_closed_after_the_timeout(monkeypatch, server):
    monkeypatch.setattr(peer_watch, "AUTH_TIMEOUT", 0.5)
    start = time.monotonic()
    sock, _ = server.stranger()
    assert _closed_by_other_end(sock, timeout=PROMPT)
    assert 0.4 <= time.monotonic() - start < PROMPT
    assert (server.watch.peers, server.losses) == ({}, [])


def test_connections_over_the_limit_are_closed_at_once(server):
    held = [server.stranger()[0] for _ in range(peer_watch.MAX_PENDING)]
    extra = socket.create_connection((server.host, server.port), timeout=PROMPT)
    assert _read_line(extra) == b""  # Closed without a challenge.
    for sock in held:
        sock.close()
    peer = PeerWatch(2, 3, SECRET)
    deadline = time.monotonic() + PROMPT
    while True:  # Room again once process 0 has seen them go.
        try:
            peer.connect(server.host, server.port)
            break
        except OSError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    assert server.wait_for(lambda: 2 in server.watch.peers)
    assert server.losses == []


def test_a_false_process_0_is_not_trusted():
    fake = socket.create_server(("127.0.0.1", 0))

    def answer():
        conn, _ = fake.accept()
        conn.sendall(b"challenge abc\n")
        _read_line(conn)
        conn.sendall(b"welcome " + b"0" * 64 + b"\nlost 2\n")

    threading.Thread(target=answer, daemon=True).start()
    peer = PeerWatch(1, 3, SECRET)
    with pytest.raises(OSError, match="does not know the job's secret"):
        peer.connect("127.0.0.1", fake.getsockname()[1])
    fake.close()


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "0.0.0.0", "203.0.113.7", None])
def test_the_bound_address_is_the_coordinators_never_a_wildcard(host):
    watch = PeerWatch(0, 2)
    address, port = watch.listen(host)
    bound = watch.server.getsockname()
    watch.server.close()
    assert address == bound[0] and port == bound[1]
    if host in ("127.0.0.1", "localhost", "0.0.0.0"):
        assert address == "127.0.0.1"
    else:  # None, or an address not on this machine: this machine's host name's address.
        assert address in {a[4][0] for a in socket.getaddrinfo(socket.gethostname(), 0, type=socket.SOCK_STREAM)}
    assert address not in ("0.0.0.0", "::")


# -- two processes --------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(pid: int) -> list[tuple[str, int]]:
    """(local address, port) of every listening TCP socket that process `pid` holds, from /proc."""
    inodes = set()
    for fd in pathlib.Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = []
    for table in ("tcp", "tcp6"):
        for row in pathlib.Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = row.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN.
                continue
            hex_address, hex_port = local.split(":")
            raw = bytes.fromhex(hex_address)
            # /proc prints each 32-bit word of the address in host (little-endian) order.
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
            address = socket.inet_ntop(family, raw)
            mapped = ipaddress.ip_address(address).ipv4_mapped if family == socket.AF_INET6 else None
            # An IPv6 socket bound to ::ffff:127.0.0.1 (as gRPC binds) listens on 127.0.0.1 only.
            found.append((str(mapped) if mapped else address, int(hex_port, 16)))
    return found


def _other_address() -> str | None:
    """An address of this machine other than loopback (the one a route out would use), if any."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("203.0.113.1", 9))  # No packet is sent: this only picks the route.
        except OSError:
            return None
        address = s.getsockname()[0]
    return None if address.startswith("127.") else address


def _attack(host: str, port: int) -> list[str]:
    """What a local stranger tries on process 0's port; -> what each connection received first."""
    received = []
    for line in [b"hello 1\n", b"hello 1 n " + b"0" * 64 + b"\n", b"bye\n", b"\x00\xff garbage\n", b"y" * 100_000]:
        sock = socket.create_connection((host, port), timeout=PROMPT)  # Raises if the port is not reached.
        received.append(_read_line(sock).split()[0].decode())
        try:
            sock.sendall(line)
        except (ConnectionResetError, BrokenPipeError):
            pass
        assert _closed_by_other_end(sock), line[:20]
        sock.close()
    silent = socket.create_connection((host, port), timeout=PROMPT)
    received.append(_read_line(silent).split()[0].decode())
    assert _closed_by_other_end(silent, timeout=peer_watch.AUTH_TIMEOUT + PROMPT)
    return received


@pytest.mark.slow
def test_a_stranger_on_the_port_stops_neither_process_and_both_ports_listen_on_the_coordinator_only(tmp_path):
    coordinator = f"127.0.0.1:{_free_port()}"
    done = tmp_path / "done"
    worker = pathlib.Path(__file__).with_name("peer_watch_worker.py")
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "JOB", "AXCORE_"))}
    env = host_devices_env(1, base)
    paths = [tmp_path / f"process{i}.log" for i in range(2)]
    procs = []
    try:
        for i, path in enumerate(paths):
            with open(path, "w") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, str(worker), coordinator, str(i), str(done)], env=env, stdout=log,
                    stderr=subprocess.STDOUT, start_new_session=True,
                ))
        deadline = time.monotonic() + START_TIMEOUT
        pattern = re.compile(r"process 0 listens on (\S+) port (\d+)")
        while not all(pattern.search(p.read_text()) for p in paths):
            assert time.monotonic() < deadline, paths[0].read_text()[-3000:]
            for i, proc in enumerate(procs):
                assert proc.poll() is None, paths[i].read_text()[-3000:]
            time.sleep(0.1)
        host, port = pattern.search(paths[0].read_text()).groups()
        port = int(port)
        assert host == "127.0.0.1"
        # Independently of the log: process 0's listening sockets on the watch's port and on the
        # coordinator's (JAX's coordination service), from /proc.
        coordinator_port = int(coordinator.rsplit(":", 1)[1])
        listening = _listening(procs[0].pid)
        assert [a for a in listening if a[1] == port] == [("127.0.0.1", port)]
        assert [a for a in listening if a[1] == coordinator_port] == [("127.0.0.1", coordinator_port)], listening
        other = _other_address()
        if other is not None:
            for refused in (port, coordinator_port):
                with pytest.raises(ConnectionRefusedError):
                    socket.create_connection((other, refused), timeout=PROMPT).close()

        assert _attack(host, port) == ["challenge"] * 6  # Every connection reached the watch.
        time.sleep(1.0)  # A loss would have stopped both within about a second.
        for i, proc in enumerate(procs):
            assert proc.poll() is None, paths[i].read_text()[-3000:]
        done.touch()
        for proc in procs:
            proc.wait(timeout=FINISH_TIMEOUT)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    texts = [p.read_text() for p in paths]
    for i, proc in enumerate(procs):
        assert proc.returncode == 0, texts[i][-3000:]
        assert "lost process" not in texts[i], texts[i][-3000:]
    rounds = [int(re.search(r"rounds: (\d+)", t).group(1)) for t in texts]
    assert rounds[0] == rounds[1] > 0, rounds
