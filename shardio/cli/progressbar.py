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
    every ``log_interval_s`` seconds.
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

    def __call__(self, snap: ProgressSnapshot) -> None:
        rate = snap.bytes_done / snap.elapsed_s if snap.elapsed_s > 0 else 0.0
        remaining = snap.bytes_total - snap.bytes_done
        eta = format_duration(remaining / rate) if rate > 0 and remaining > 0 else "--"
        frac = (
            snap.bytes_done / snap.bytes_total
            if snap.bytes_total
            else (snap.files_done / snap.files_total if snap.files_total else 1.0)
        )
        width = 24
        filled = int(width * min(frac, 1.0))
        bar = "#" * filled + "-" * (width - filled)
        line = (
            f"{self.label} [{bar}] {snap.files_done:,}/{snap.files_total:,} {self.unit}  "
            f"{format_size(snap.bytes_done)}/{format_size(snap.bytes_total)}  "
            f"{format_size(rate)}/s  ETA {eta}"
        )
        if self.tty:
            self._write("\r" + line + ("\n" if snap.final else ""))
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
