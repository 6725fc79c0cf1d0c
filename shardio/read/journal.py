"""The repair journal: one JSON line per recovery event, appended by every reading process.

An operator reads it to see exactly which samples were retried, re-staged, rebuilt or
substituted, and why. Lines are written with one ``write`` on a descriptor opened with
``O_APPEND``, so the lines of many workers and ranks on one node never interleave; each line
is kept under 4 KiB. The file is opened without following a symlink and must be a regular
file; the journal never truncates or rewrites it.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import stat
import time
from typing import Any

from shardio.errors import StorageError

__all__ = ["JOURNAL_NAME", "RepairJournal", "read_journal"]

logger = logging.getLogger(__name__)

JOURNAL_NAME = "repairs.jsonl"  # beside a staging area's records: DEST/.shardio-stage/
_MAX_LINE = 4000  # below PIPE_BUF, so one append stays one line
_MAX_FIELD = 600  # long error texts are cut
_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class RepairJournal:
    """Append recovery events to a JSON-lines file.

    Args:
        path: the journal file (created with mode 0644 if missing).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._host = socket.gethostname()

    def append(self, event: dict[str, Any]) -> None:
        """Write one event as one line (time, host and pid added).

        Raises:
            StorageError: the journal is a symlink, not a regular file, or cannot be written.
        """
        record: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "host": self._host,
            "pid": os.getpid(),
        }
        for key, value in event.items():
            long_text = isinstance(value, str) and len(value) > _MAX_FIELD
            record[key] = value[:_MAX_FIELD] + "..." if long_text else value
        line = json.dumps(record, ensure_ascii=True, default=str)
        if len(line) >= _MAX_LINE:
            line = json.dumps({k: record[k] for k in ("time", "host", "pid", "event")})
        try:
            fd = os.open(self.path, _FLAGS, 0o644)
        except OSError as exc:
            why = "is a symlink" if exc.errno == errno.ELOOP else exc.strerror
            raise StorageError(exc.errno, f"cannot open repair journal {self.path}: {why}") from exc
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise StorageError(
                    errno.EINVAL, f"repair journal {self.path} is not a regular file"
                )
            os.write(fd, (line + "\n").encode("ascii"))
        except StorageError:
            raise
        except OSError as exc:
            raise StorageError(
                exc.errno, f"cannot write repair journal {self.path}: {exc.strerror}"
            ) from exc
        finally:
            os.close(fd)

    def __repr__(self) -> str:
        return f"RepairJournal({self.path!r})"


def read_journal(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The events of a journal, oldest first (a torn last line is skipped)."""
    events = []
    with open(path, encoding="ascii", errors="replace") as fh:
        for line in fh:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict):
                events.append(event)
    return events
