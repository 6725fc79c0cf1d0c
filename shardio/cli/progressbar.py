"""Render progress snapshots as a one-line bar on a terminal, or periodic log lines."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from shardio.metrics.progress import ProgressSnapshot
from shardio.units import format_duration, format_size

__all__ = ["ProgressBar"]


class ProgressBar:
    """A progress callback that draws ``label  files  bytes  rate  ETA``.

    On a terminal the line is redrawn in place; elsewhere (a SLURM log) a line is written
    every ``log_interval_s`` seconds. Used as a context manager, a run that ends in an
    error or a Ctrl-C erases the half-drawn line, so that the one line saying so stands
    alone instead of being appended to the bar.
    """

    def __init__(
        self,
        label: str,
        *,
        unit: str = "files",
        stream: TextIO | None = None,
        log_interval_s: float = 30.0,
    ) -> None:
        self.label = label
        self.unit = unit
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.log_interval_s = log_interval_s
        self._last_log = time.monotonic()
        self._stopped = False  # the stream failed: nothing more is drawn
        self._drawn = False  # a line is on the terminal without its newline

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_exc: object) -> None:
        if exc_type is not None and self._drawn:
            self._write("\r\033[K")  # back to the line's start, erase to its end
            self._drawn = False

    def __call__(self, snap: ProgressSnapshot) -> None:
        seconds = snap.elapsed_s if snap.elapsed_s > 0 else 0.0
        if snap.bytes_total or snap.bytes_done:
            done, total = snap.bytes_done, snap.bytes_total
            rate = done / seconds if seconds else 0.0
            amount = f"{format_size(done)}/{format_size(total)}  {format_size(rate)}/s"
        else:  # nothing is read (verify --quick): a rate of files, not "0 B/s"
            done, total = snap.files_done, snap.files_total
            rate = done / seconds if seconds else 0.0
            amount = f"{rate:,.0f} {self.unit}/s"
        remaining = total - done
        eta = format_duration(remaining / rate) if rate > 0 and remaining > 0 else "--"
        frac = done / total if total else 1.0
        width = 24
        filled = int(width * min(frac, 1.0))
        bar = "#" * filled + "-" * (width - filled)
        line = (
            f"{self.label} [{bar}] {snap.files_done:,}/{snap.files_total:,} {self.unit}  "
            f"{amount}  ETA {eta}"
        )
        if self.tty:
            self._write("\r" + line + ("\n" if snap.final else ""))
            self._drawn = not snap.final
        elif not snap.final and time.monotonic() - self._last_log >= self.log_interval_s:
            self._last_log = time.monotonic()
            self._write(line + "\n")

    def _write(self, text: str) -> None:
        # A progress line is never worth failing the work for: if the stream is gone (a
        # closed pipe, a hung-up terminal), stop drawing and let the pack or copy finish.
        if self._stopped:
            return
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):
            self._stopped = True
