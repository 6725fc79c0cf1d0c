"""A stale lease mutex (a killed claim's) is broken by one waiter only (issue 32).

Two waiters that find the same stale mutex at once must not both end up holding it: the
first would remove it and take a new one, which the second, acting on what it saw before,
must not remove in turn.
"""

from __future__ import annotations

import os
import pathlib
import threading
import time
from typing import Any

import pytest

from shardio.checkpoint import lease
from shardio.checkpoint.naming import Identity, this_host


def _stale_mutex(directory: pathlib.Path) -> str:
    path = directory / ".shardio-owner.lock"
    path.mkdir(parents=True)
    old = time.time() - 10 * lease._MUTEX_STALE_S
    os.utime(path, (old, old))
    return str(path)


def test_two_waiters_breaking_one_stale_mutex_never_both_hold_it(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mutex = _stale_mutex(tmp_path)
    both_saw_it = threading.Barrier(2, timeout=5)
    seen: set[int] = set()
    real_lstat, real_rmdir, real_read_owner = os.lstat, os.rmdir, lease.read_owner

    def lstat(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        result = real_lstat(path, *args, **kwargs)
        if os.fspath(path) == mutex and threading.get_ident() not in seen:
            seen.add(threading.get_ident())
            both_saw_it.wait()  # each waiter has found it stale before either acts
        return result

    def rmdir(path: Any, *args: Any, **kwargs: Any) -> None:
        if os.fspath(path) == mutex and threading.current_thread().name == "waiter-1":
            time.sleep(0.1)  # the slower waiter acts after the other took a new mutex
        real_rmdir(path, *args, **kwargs)

    inside, most = [0], [0]
    guard = threading.Lock()

    def read_owner(directory: str) -> lease.Owner | None:  # runs under the mutex
        with guard:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        time.sleep(0.3)
        with guard:
            inside[0] -= 1
        return real_read_owner(directory)

    monkeypatch.setattr(os, "lstat", lstat)
    monkeypatch.setattr(os, "rmdir", rmdir)
    monkeypatch.setattr(lease, "read_owner", read_owner)
    identity = Identity(rank=0, world_size=1, hosts=(this_host(),), job_id="nojob")
    errors: list[BaseException] = []

    def claim() -> None:
        try:
            lease.claim(str(tmp_path), identity)
        except BaseException as exc:  # reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=claim, name=f"waiter-{i}") for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads) and errors == []
    assert most[0] == 1  # one holder at a time
    assert not os.path.lexists(mutex)  # released; nothing of the breaking left behind
    assert sorted(os.listdir(tmp_path)) == [lease.LEASE_NAME]
    owner = lease.read_owner(str(tmp_path))
    assert owner is not None and owner.pid == os.getpid()


def test_a_guard_left_by_a_killed_breaker_is_broken_once_stale(tmp_path: pathlib.Path) -> None:
    mutex = _stale_mutex(tmp_path)
    guard = pathlib.Path(f"{mutex}.break")
    guard.mkdir()
    old = time.time() - 10 * lease._MUTEX_STALE_S
    os.utime(guard, (old, old))
    identity = Identity(rank=0, world_size=1, hosts=(this_host(),), job_id="nojob")
    began = time.monotonic()
    lease.claim(str(tmp_path), identity)
    assert time.monotonic() - began < 10
    assert sorted(os.listdir(tmp_path)) == [lease.LEASE_NAME]


def test_a_fresh_mutex_is_waited_for_not_broken(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mutex = tmp_path / ".shardio-owner.lock"
    mutex.mkdir()
    monkeypatch.setattr(lease, "_MUTEX_WAIT_S", 0.3)
    identity = Identity(rank=0, world_size=1, hosts=(this_host(),), job_id="nojob")
    with pytest.raises(lease.CheckpointError, match="is held by a claim"):
        lease.claim(str(tmp_path), identity)
    assert mutex.is_dir() and not os.path.lexists(f"{mutex}.break")
