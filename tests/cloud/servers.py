"""Real storage servers on 127.0.0.1 for the cloud tests, and a TCP proxy in front of them that injects faults."""
import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Callable, List, Optional, Tuple

# Every test loop below is bounded by these (the servers are local; nothing leaves 127.0.0.1).
START_TIMEOUT_S = 60.0
HOST = "127.0.0.1"


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on (at the moment of the call)."""
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


class ServerProcess:
    """A server started as a subprocess, waited for until ``probe_path`` answers over HTTP, stopped by
    :meth:`stop`."""

    def __init__(self, name: str, command: List[str], port: int, probe_path: str = "/"):
        self.name, self.command, self.port, self.probe_path = name, command, port, probe_path
        self.process: Optional[subprocess.Popen] = None
        self.log_path: Optional[str] = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self, log_dir: str) -> "ServerProcess":
        self.log_path = os.path.join(log_dir, f"{self.name}.log")
        log = open(self.log_path, "wb")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                        stdin=subprocess.DEVNULL)
        log.close()
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode} at start: {self.log_tail()}")
            try:
                urllib.request.urlopen(self.url + self.probe_path, timeout=2).close()
                return self
            except urllib.error.HTTPError:  # it answers, even if with an error status
                return self
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"{self.name} did not answer on {self.url} within {START_TIMEOUT_S} s: {self.log_tail()}")

    def log_tail(self) -> str:
        if self.log_path and os.path.exists(self.log_path):
            with open(self.log_path, "rb") as handle:
                return handle.read()[-3000:].decode("utf-8", "replace")
        return ""

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)


def start_server(make, log_dir: str, tries: int = 3) -> ServerProcess:
    """``make(port).start(log_dir)`` on a free port, trying another port if one was taken meanwhile."""
    for attempt in range(1, tries + 1):
        try:
            return make(free_port()).start(log_dir)
        except RuntimeError:
            if attempt == tries:
                raise


def moto_server(port: int) -> ServerProcess:
    """moto's standalone S3 (and SES) server."""
    command = [sys.executable, "-c", "from moto.server import main; main()", "-H", HOST, "-p", str(port)]
    return ServerProcess("moto_server", command, port, "/moto-api/")


def gcs_emulator(port: int) -> ServerProcess:
    """gcp-storage-emulator, keeping its data in memory."""
    command = [sys.executable, "-m", "gcp_storage_emulator", "start", "--host", HOST, "--port", str(port),
               "--in-memory"]
    return ServerProcess("gcp-storage-emulator", command, port, "/storage/v1/b")


class FaultyProxy:
    """A TCP proxy on 127.0.0.1 in front of a server, with faults switched on by the test:

    - ``drop_next(n)``: the next ``n`` connections are closed at once (a connection reset);
    - ``delay_s``: each chunk forwarded waits this long (a slow network);
    - ``cut_after_bytes``: once that many request bytes have gone through, every connection is closed and new
      ones are dropped (the network goes down in the middle of an upload);
    - ``reset_once_after_bytes``: once that many request bytes have gone through, the connection carrying the
      next bytes is reset, once (one request of an upload fails midway; the network stays up);
    - ``reset_once_matching``: the connection whose request bytes next contain this pattern is reset before they
      are forwarded, once, ignoring case (e.g. one part of an upload fails before reaching the server);
    - ``lose_answer_once_matching``: the request whose bytes next contain this pattern (ignoring case) reaches the
      server whole, but the server's answer to it does not reach the client: its connection is closed once the
      answer comes, once (the server did the work, the client never learns it: an upload's last answer lost);
      ``after_answer_lost``, when set, is called (on the proxy's thread) after the server answered and before
      the client's connection is closed (e.g. to change the bucket at that exact moment);
    - ``replace_in_answer_once``: ``(old, new)``: the first answer read that contains ``old`` has it replaced by
      ``new``, once (e.g. another status line);
    - ``corrupt_once_matching``: in the request bytes forwarded after this pattern (ignoring case) was seen, the
      last byte of the next read is flipped, once (data corrupted in transit, beyond TCP's checksum);
    - ``hold()`` / ``release()``: nothing is forwarded between the two (a network stalled for as long as the test
      needs, so "still uploading" holds however fast or slow the machine is). A hold ends by itself after
      ``HOLD_LIMIT_S``, so a test that forgets to release fails instead of hanging.
    """

    HOLD_LIMIT_S = 120.0

    def __init__(self, upstream_port: int):
        self.upstream_port = upstream_port
        self.delay_s = 0.0
        self.cut_after_bytes: Optional[int] = None
        self.reset_once_after_bytes: Optional[int] = None
        self.reset_once_matching: Optional[bytes] = None
        self.lose_answer_once_matching: Optional[bytes] = None
        self.corrupt_once_matching: Optional[bytes] = None
        self.after_answer_lost: Optional[Callable[[], None]] = None
        self.replace_in_answer_once: Optional[Tuple[bytes, bytes]] = None
        self.resets = 0
        self.answers_lost = 0
        self.corrupted = 0
        self.forwarded_bytes = 0
        self.dropped = 0
        self._drop = 0
        self._down = False
        self._lock = threading.Lock()
        self._open = threading.Event()
        self._open.set()
        self._sockets: List[socket.socket] = []
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((HOST, 0))
        self._listener.listen(32)
        self.port = self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def hold(self) -> None:
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    def drop_next(self, connections: int) -> None:
        with self._lock:
            self._drop = connections

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                refuse = self._down or self._drop > 0
                if self._drop > 0:
                    self._drop -= 1
                if refuse:
                    self.dropped += 1
            if refuse:
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                client.close()  # linger 0: the client sees a reset
                continue
            try:
                upstream = socket.create_connection((HOST, self.upstream_port), timeout=10)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets += [client, upstream]
            connection = {"lose_answer": False, "corrupt": False}  # the faults due on this connection
            threading.Thread(target=self._pump, args=(client, upstream, True, connection), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False, connection), daemon=True).start()

    def _pump(self, source: socket.socket, target: socket.socket, request: bool, connection: dict) -> None:
        tail = b""  # the end of the bytes before, for a pattern split between two reads
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                self._open.wait(self.HOLD_LIMIT_S)
                if self.delay_s:
                    time.sleep(self.delay_s)
                if not request and connection["lose_answer"]:  # the answer is dropped, the client's side closed
                    with self._lock:
                        self.answers_lost += 1
                    if self.after_answer_lost is not None:
                        self.after_answer_lost()
                    with contextlib.suppress(OSError):
                        target.shutdown(socket.SHUT_RDWR)  # the client's side closed, no answer (and wakes its pump)
                    return
                if not request:
                    with self._lock:
                        replace = self.replace_in_answer_once
                        if replace and replace[0] in data:
                            data, self.replace_in_answer_once = data.replace(*replace, 1), None
                if request:
                    data = self._faults_of_request(data, tail, connection)
                    with self._lock:
                        self.forwarded_bytes += len(data)
                        cut = self.cut_after_bytes is not None and self.forwarded_bytes > self.cut_after_bytes
                        if cut:
                            self._down = True
                        reset = self.reset_once_after_bytes is not None \
                            and self.forwarded_bytes > self.reset_once_after_bytes
                        if reset:
                            self.reset_once_after_bytes = None
                        pattern = self.reset_once_matching
                        if pattern and pattern.lower() in (tail + data).lower():  # header names: any case
                            reset, self.reset_once_matching = True, None
                        self.resets += reset
                        tail = (tail + data)[-64:]
                    if cut:
                        self._close_all()
                        return
                    if reset:  # these bytes never reach the server: its request is cut short
                        with contextlib.suppress(OSError):
                            target.shutdown(socket.SHUT_RDWR)  # wakes the pump of the answers
                        with contextlib.suppress(OSError):
                            source.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                            source.close()  # linger 0: the client sees a reset
                        return
                target.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, target):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def _faults_of_request(self, data: bytes, tail: bytes, connection: dict) -> bytes:
        """``data`` as forwarded, marking ``connection`` for the faults its bytes call for (patterns of at most 64
        bytes, ``tail`` being the 64 bytes read before)."""
        with self._lock:
            seen = (tail + data).lower()
            lose = self.lose_answer_once_matching
            if lose and lose.lower() in seen:
                connection["lose_answer"], self.lose_answer_once_matching = True, None
            corrupt = self.corrupt_once_matching
            if corrupt and corrupt.lower() in seen:
                connection["corrupt"], self.corrupt_once_matching = True, None
                # The pattern's own read is left whole when it ends it (headers first, the body next).
                if seen.endswith(corrupt.lower()) or seen.endswith(b"\r\n\r\n"):
                    return data
            if connection["corrupt"]:
                connection["corrupt"] = False
                self.corrupted += 1
                return data[:-1] + bytes([data[-1] ^ 0xFF])
        return data

    def _close_all(self) -> None:
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()

    def close(self) -> None:
        """Stop accepting, close every connection, and wait for the accepting thread to end (closing the listener
        alone does not wake an ``accept`` blocked in another thread)."""
        self._open.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._listener.close()
        self._close_all()
        self._thread.join(timeout=10)
