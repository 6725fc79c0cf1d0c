"""One reader set-up for every face that reads a packed dataset (the torch layer, DALI).

:func:`set_up_reader` chooses the read strategy and resolves the read deadline with one
``statfs`` of the dataset (each is a metadata-server request on a parallel filesystem), and
wraps the opener in the deadline; :meth:`ReaderSetup.open` opens the
:class:`~shardio.read.reader.ShardReader` through it. ``ShardDataset`` and
``shardio.dali`` both read through it, so the same path gets the same deadline and strategy.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from shardio.read.deadline import DeadlineOpener
from shardio.read.reader import ShardReader
from shardio.read.strategy import StrategyChoice, choose_strategy
from shardio.read.timeouts import hold_for, resolve_read_timeout
from shardio.read.unavailable import UnavailableShards
from shardio.storage.opener import Opener

__all__ = ["ReaderSetup", "set_up_reader", "with_deadline"]


@dataclass(frozen=True, kw_only=True)
class ReaderSetup:
    """How a dataset is read: chosen once, in the process that opens it first.

    Attributes:
        path: the dataset directory.
        choice: the read strategy, the filesystem it was chosen for, and why.
        read_timeout_s: the read deadline in force (0: none).
        opener: the opener every read goes through (under the deadline when there is one).
    """

    path: str
    choice: StrategyChoice
    read_timeout_s: float
    opener: Opener | None

    def open(self, **kwargs: Any) -> ShardReader:
        """The packed dataset, read through :attr:`opener` on the filesystem described
        (``kwargs``: ShardReader's other arguments, ``fs=None`` to describe it again)."""
        return ShardReader(self.path, **{"opener": self.opener, "fs": self.choice.fs, **kwargs})


def set_up_reader(
    path: str | os.PathLike[str],
    *,
    read_strategy: str | None = None,
    read_timeout_s: float | None = None,
    opener: Opener | None = None,
) -> ReaderSetup:
    """Choose the strategy and the deadline for the dataset at ``path`` (one ``statfs``) and
    wrap ``opener`` in the deadline.

    Args:
        path: the dataset directory.
        read_strategy: "local", "pfs", "auto" or None (see
            :func:`~shardio.read.strategy.choose_strategy`).
        read_timeout_s: seconds a read may stall; None: the filesystem's default; 0: none
            (see :func:`~shardio.read.timeouts.resolve_read_timeout`).
        opener: the opener to wrap (None: plain POSIX reads).

    Raises:
        UsageError: a bad strategy name or deadline.
    """
    root = os.fspath(path)
    choice = choose_strategy(root, read_strategy)
    timeout = resolve_read_timeout(root, read_timeout_s, fs=choice.fs)
    return ReaderSetup(
        path=root,
        choice=choice,
        read_timeout_s=timeout,
        opener=with_deadline(opener, timeout, scope=root),
    )


def with_deadline(
    opener: Opener | None, timeout_s: float, *, scope: str | os.PathLike[str] | None = None
) -> Opener | None:
    """``opener`` bounded by ``timeout_s`` (0: ``opener`` itself), its stalled paths held on
    the node under ``scope`` (the dataset's directory: every process reading it shares the
    holds). An opener already bounded is re-bounded, not wrapped twice."""
    if not timeout_s:
        return opener
    if isinstance(opener, DeadlineOpener):
        opener = opener.inner
    key = os.path.realpath(scope) if scope is not None else None
    registry = UnavailableShards(key, hold_s=hold_for(timeout_s))
    return DeadlineOpener(opener, timeout_s=timeout_s, registry=registry)
