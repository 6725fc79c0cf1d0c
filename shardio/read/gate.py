"""Which calls on a file may go now: none while it is held unavailable, none behind a slow one.

On a dead server each request holds a client thread until the client gives up (a FUSE client
has a few), so a call on a file held after a stall is refused at once, and a call on a file
with a data call in flight for more than :attr:`CallGate.slow_s` (in this process, or in
another process of the node: :meth:`UnavailableShards.suspected`) waits for it rather than
send another request after it. :class:`~shardio.read.deadline.DeadlineOpener` asks it before
each call.
"""

from __future__ import annotations

import errno
import time

from shardio.errors import ReadStalledError
from shardio.read.inflight import InFlightCalls
from shardio.read.unavailable import UnavailableShards

__all__ = ["CallGate"]

_GATE_TICK_S = 0.02  # how often a call held back by a slow one looks again


class CallGate:
    """The held and slow files of one opener's calls.

    Attributes:
        registry: where stalled paths are held unavailable (node-wide).
        timeout_s: the opener's deadline.
        inflight: this process's data calls in flight, by path.
        held_fails: calls refused at once: their path was held unavailable.
    """

    def __init__(self, registry: UnavailableShards, timeout_s: float) -> None:
        self.registry = registry
        self.timeout_s = timeout_s
        self.inflight = InFlightCalls()
        self.held_fails = 0

    @property
    def slow_s(self) -> float:
        """How long a data call may run before its file counts as not answering promptly:
        a tenth of the deadline, at most half a second (a healthy read takes milliseconds)."""
        return min(0.5, self.timeout_s / 10)

    def slow(self, path: str | None = None) -> bool:
        """Whether a data call of this process (on ``path``, when given) has run longer
        than :attr:`slow_s`."""
        return self.inflight.oldest_ns(path) > int(self.slow_s * 1e9)

    def refuse_held(self, path: str, what: str) -> None:
        """A ReadStalledError ("not attempted") when ``path`` is held unavailable."""
        left = self.registry.held(path) if path else None
        if left is not None:
            self.held_fails += 1
            raise ReadStalledError(
                errno.ETIMEDOUT,
                f"{what}: not attempted, {path} is held unavailable for {left:.0f} s more "
                f"after a read of it stalled for {self.timeout_s:g} s or failed",
            )

    def wait(self, path: str, what: str) -> None:
        """Wait while a data call on ``path`` (of this process, or of another process of the
        node) has been in flight for more than :attr:`slow_s`, so that a dead file gets about
        one request per node, not one per sample. The wait ends when that call returns, or
        when its deadline holds the path (this call is then refused), or after ``timeout_s``
        (a ReadStalledError)."""
        if not path:
            return
        began = time.monotonic()
        while self.slow(path) or self.registry.suspected(path):
            self.refuse_held(path, what)
            waited = time.monotonic() - began
            if waited >= self.timeout_s:
                stalled = ReadStalledError(
                    errno.ETIMEDOUT,
                    f"{what}: not attempted, a call on {path} has not answered for "
                    f"{self.timeout_s:g} s",
                )
                stalled.waited_s = waited
                raise stalled
            time.sleep(min(_GATE_TICK_S, self.timeout_s - waited))
