"""torch's and multiprocessing's private names live in shardio/runtime/internals.py only, and
the installed torch and Python have every one of them: a torch that renames one fails here,
naming it, instead of a feature going quietly off."""

from __future__ import annotations

import importlib
import logging
import multiprocessing
import pathlib
import re

import pytest
from torch.utils.data import DataLoader

from shardio.runtime import internals

SHARDIO = pathlib.Path(internals.__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def iterator():
    """A real multi-process DataLoader iterator."""
    batches = iter(DataLoader(list(range(8)), batch_size=2, num_workers=1))
    try:
        yield batches
    finally:
        batches._shutdown_workers()


def _owner(where: str, batches: object) -> object:
    if where == "iterator":
        return batches
    if where == "multiprocessing.process.BaseProcess":
        return multiprocessing.Process()
    return importlib.import_module(where)


@pytest.mark.parametrize(("where", "name", "what"), internals.REQUIRED, ids=lambda v: v)
def test_the_installed_torch_and_python_have_each_private_name(iterator, where, name, what):
    owner = _owner(where, iterator)
    assert hasattr(owner, name), f"{where} has no {name}: {what} would stop working"


def test_no_other_module_reaches_them() -> None:
    # an attribute access (x._workers) or a name in quotes (getattr(x, "_workers"))
    names = {name for _, name, _ in internals.REQUIRED}
    reach = re.compile(r"(?:\.|[\"'])(" + "|".join(sorted(names)) + r")\b|\bsignal_handling\b")
    found = []
    for path in sorted(SHARDIO.rglob("*.py")):
        if path == pathlib.Path(internals.__file__).resolve():
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for match in reach.finditer(line):
                found.append(f"{path.relative_to(SHARDIO)}:{number}: {match.group(0)}")
    # shardio/_pool.py's own self._workers (a worker count) is its own, not torch's
    # and its ._config is multiprocessing's process config (the temp dir of its sockets)
    found = [
        f
        for f in found
        if not (f.startswith("_pool.py:") and f.endswith((": ._workers", ": ._config")))
    ]
    assert found == []


def test_a_missing_name_is_said_once_never_skipped_in_silence(
    caplog: pytest.LogCaptureFixture,
) -> None:
    internals._warned.discard("_data_queue")
    with caplog.at_level(logging.WARNING, logger="shardio.runtime.internals"):
        assert internals.wake(object(), "item") is False
        assert internals.wake(object(), "item") is False
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1
    assert "_data_queue" in lines[0] and "stall watch" in lines[0]


def test_the_accessors_work_on_a_real_iterator(iterator) -> None:
    workers = internals.workers(iterator)
    assert len(workers) == 1 and workers[0].is_alive()
    assert iterator._worker_pids_set
    internals.unwatch(iterator)
    assert not iterator._worker_pids_set
    internals.watch(iterator, tuple(w.pid for w in workers))
    assert iterator._worker_pids_set
    assert isinstance(internals.mp_config(), dict)
