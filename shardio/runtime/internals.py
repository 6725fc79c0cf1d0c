"""The private names of torch's DataLoader and of multiprocessing that shardio relies on: the
only module that reaches them.

Each is listed in :data:`REQUIRED`; ``tests/unit/runtime/test_internals.py`` checks the
installed torch and Python for every one and fails naming the one missing. At run time a
missing name is never skipped in silence: each accessor logs one warning naming it and the
feature that stops (bounded worker shutdown, the stall watch's wake-up, the SIGCHLD watch
across epochs, the short multiprocessing directory).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing.process
from typing import Any

logger = logging.getLogger(__name__)

# (where, name, what stops without it). "iterator" is a multi-process DataLoader iterator.
REQUIRED: tuple[tuple[str, str, str], ...] = (
    ("iterator", "_workers", "bounded worker shutdown and the check of kept workers"),
    ("iterator", "_worker_pids_set", "the SIGCHLD watch of workers across epochs"),
    ("iterator", "_shutdown_workers", "stopping workers the DataLoader's way"),
    ("iterator", "_data_queue", "waking a training loop when the stall watch fires"),
    ("iterator", "_rcvd_idx", "waking a training loop when the stall watch fires"),
    ("torch.utils.data._utils.signal_handling", "_set_worker_pids", "the SIGCHLD watch"),
    ("torch.utils.data._utils.signal_handling", "_remove_worker_pids", "the SIGCHLD watch"),
    ("multiprocessing.process", "_children", "exiting without waiting for a stuck worker"),
    ("multiprocessing.process.BaseProcess", "_parent_pid", "reaping an abandoned worker"),
    ("multiprocessing.process.BaseProcess", "_config", "the short multiprocessing directory"),
)
_warned: set[str] = set()


def _missing(name: str) -> None:
    if name in _warned:
        return
    _warned.add(name)
    what = next((w for _, n, w in REQUIRED if n == name), "a shardio feature")
    logger.warning("this torch/Python has no %s: %s is off", name, what)


def _signal_handling() -> Any:
    from torch.utils.data._utils import signal_handling

    return signal_handling


# -- the DataLoader iterator's workers ------------------------------------------------------
def workers(batches: Any) -> list[Any]:
    """The worker processes of a DataLoader iterator (none for a single-process one)."""
    found = getattr(batches, "_workers", None)
    if found is None:
        if hasattr(batches, "_shutdown_workers"):  # a multi-process iterator without it
            _missing("_workers")
        return []
    return list(found)


def replace_workers(batches: Any, handles: list[Any]) -> None:
    """Swap the iterator's worker handles for ``handles`` (a new list: another thread may be
    iterating the old one)."""
    batches._workers = handles


def shutdown(batches: Any) -> bool:
    """Shut the iterator's workers down the DataLoader's way; False when it cannot."""
    method = getattr(batches, "_shutdown_workers", None)
    if method is None:
        if hasattr(batches, "_workers"):
            _missing("_shutdown_workers")
        return False
    method()
    return True


def unwatch(batches: Any) -> None:
    """Take the iterator's workers off torch's SIGCHLD watch (their death must not raise
    "DataLoader worker ... killed by signal" in the training loop)."""
    if not getattr(batches, "_worker_pids_set", False):
        return
    remove = getattr(_signal_handling(), "_remove_worker_pids", None)
    if remove is None:
        _missing("_remove_worker_pids")
        return
    with contextlib.suppress(RuntimeError):  # already removed
        remove(id(batches))
    batches._worker_pids_set = False


def watch(batches: Any, pids: tuple[int, ...]) -> None:
    """Put the iterator's workers back on torch's SIGCHLD watch."""
    set_pids = getattr(_signal_handling(), "_set_worker_pids", None)
    if set_pids is None:
        _missing("_set_worker_pids")
        return
    set_pids(id(batches), pids)
    batches._worker_pids_set = True


def wake(batches: Any, item: Any) -> bool:
    """Hand the iterator ``item`` in place of the batch it waits for; False when it cannot
    (then its ``next()`` returns at its next look at the workers)."""
    queue = getattr(batches, "_data_queue", None)
    index = getattr(batches, "_rcvd_idx", None)
    if queue is None or index is None:
        _missing("_data_queue" if queue is None else "_rcvd_idx")
        return False
    queue.put((index, item))
    return True


# -- multiprocessing -------------------------------------------------------------------------
def forget_child(process: Any) -> None:
    """Stop counting ``process`` as a child: multiprocessing's exit handler joins every child
    without a bound."""
    children = getattr(multiprocessing.process, "_children", None)
    if not isinstance(children, set):
        _missing("_children")
        return
    children.discard(process)


def parent_pid(process: Any) -> int | None:
    """The pid of the process that started ``process`` (only it may join it)."""
    pid = getattr(process, "_parent_pid", None)
    if pid is None:
        _missing("_parent_pid")
    return pid


def mp_config() -> dict[str, Any]:
    """This process's multiprocessing configuration (where its temporary directory is)."""
    config = getattr(multiprocessing.process.current_process(), "_config", None)
    if not isinstance(config, dict):
        _missing("_config")
        return {}
    return config
