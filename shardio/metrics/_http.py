"""The exporter's HTTP server: one thread per request, each bounded in time, closed at once.

A scrape is served in a thread of its own (``shardio-metrics-http-request``), so a client
that connects and sends nothing, or reads the response a byte at a time, holds only its own
thread, and only for :data:`REQUEST_TIMEOUT_S` in all (a deadline over every read and write
of the request, not a timeout per call that a trickling client could renew forever). At most
:data:`MAX_REQUESTS` are served at once; a connection past that is closed unanswered.
:meth:`MetricsServer.stop` shuts the listening socket and every open connection down and
joins the threads with a timeout, so it returns in bounded time whatever the clients do.
"""

from __future__ import annotations

import contextlib
import io
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

__all__ = ["MAX_REQUESTS", "REQUEST_TIMEOUT_S", "CountedBody", "MetricsServer"]

logger = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 10.0  # a whole request: reading it, building and sending the response
MAX_REQUESTS = 16  # requests served at once (Prometheus sends one per scrape)
STOP_TIMEOUT_S = 2.0  # stop() waits this long, in all, for the threads to end


class _DeadlineIO(io.RawIOBase):
    """A connected socket as a raw stream whose every read and write shares one deadline."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        super().__init__()
        self._sock = sock
        self._deadline = deadline

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def _arm(self) -> None:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"a metrics request took more than {REQUEST_TIMEOUT_S:g} s")
        self._sock.settimeout(left)

    def readinto(self, buffer: Any) -> int:
        self._arm()
        return self._sock.recv_into(buffer)

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        total = len(view)
        while view:
            self._arm()
            view = view[self._sock.send(view) :]
        return total


class _Handler(WSGIRequestHandler):
    def setup(self) -> None:
        self.connection = self.request
        raw = _DeadlineIO(self.connection, time.monotonic() + REQUEST_TIMEOUT_S)
        self.rfile = io.BufferedReader(raw)
        self.wfile = io.BufferedWriter(raw)

    def log_message(self, fmt: str, *args: Any) -> None:
        logger.debug("metrics http: " + fmt, *args)


class MetricsServer(ThreadingMixIn, WSGIServer):
    """A WSGI server for the metrics app (see the module docstring).

    Args:
        address: (host, port) to listen on.
        family: the socket family of ``host`` (``socket.AF_INET`` or ``AF_INET6``).
        app: the WSGI application.
    """

    daemon_threads = True
    block_on_close = False  # stop() joins with a timeout instead
    allow_reuse_address = True
    timeout = 0.2  # seconds the serving loop waits for a connection before it looks again

    def __init__(
        self, address: tuple[str, int], family: int, app: Callable[..., Any]
    ) -> None:  # fmt: skip
        self.address_family = family  # read by the base class when it makes the socket
        self._lock = threading.Lock()
        self._open: dict[socket.socket, threading.Thread] = {}
        self._stopping = False
        self._halt = threading.Event()
        super().__init__(address, _Handler)
        self.set_app(app)
        self._loop: threading.Thread | None = None

    def start(self, name: str) -> None:
        """Serve from a daemon thread named ``name``."""
        loop = threading.Thread(target=self._serve, name=name, daemon=True)
        loop.start()
        self._loop = loop

    def _serve(self) -> None:
        # handle_request() waits at most `timeout` for a connection, so the loop sees
        # stop() soon (socketserver's shutdown() would wait without a bound).
        while not self._halt.is_set():
            try:
                self.handle_request()
            except OSError:  # the listening socket was closed under us: stopping
                if self._halt.is_set():
                    return
                raise

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._lock:
            if self._stopping or len(self._open) >= MAX_REQUESTS:
                busy = True
            else:
                busy = False
                thread = threading.Thread(
                    target=self.process_request_thread,
                    args=(request, client_address),
                    name="shardio-metrics-http-request",
                    daemon=True,
                )
                self._open[request] = thread
        if busy:
            logger.debug(
                "metrics http: %d requests in flight; closing %s", MAX_REQUESTS, client_address
            )
            self.shutdown_request(request)
            return
        thread.start()

    def shutdown_request(self, request: Any) -> None:
        with self._lock:
            self._open.pop(request, None)
        super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that stalled or went away: not the job's problem (the base class prints).
        logger.debug("metrics http: request from %s failed", client_address, exc_info=True)

    def stop(self) -> None:
        """Stop listening, cut every open connection, join the threads (bounded in time)."""
        deadline = time.monotonic() + STOP_TIMEOUT_S
        self._halt.set()
        if self._loop is not None:
            self._loop.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            self._stopping = True
            open_now = list(self._open.items())
        for sock, _ in open_now:
            with contextlib.suppress(OSError):  # its thread's next read or write fails
                sock.shutdown(socket.SHUT_RDWR)
        self.server_close()
        for _, thread in open_now:
            if thread.ident is not None:
                thread.join(max(0.0, deadline - time.monotonic()))
        left = [t.name for _, t in open_now if t.is_alive()]
        if left or (self._loop is not None and self._loop.is_alive()):
            logger.warning("metrics http: %d threads still ending after close", len(left) + 1)


class CountedBody:
    """A WSGI response body that calls ``done`` once the server sent it (its close())."""

    def __init__(self, body: Iterable[bytes], done: Callable[[], None]) -> None:
        self._body = body
        self._done = done

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._body)

    def close(self) -> None:
        self._done()
