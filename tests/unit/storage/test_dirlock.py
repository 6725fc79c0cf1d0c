"""The directory lock of writers (pack, merge, repair): one at a time, never blocking."""

from __future__ import annotations

import pathlib

import pytest

from shardio.errors import StorageError, UsageError
from shardio.storage.dirlock import lock_directory


def _take(path: pathlib.Path, **kwargs: object) -> None:
    with lock_directory(str(path), **kwargs):  # type: ignore[arg-type]
        pass


def test_exclusive_refuses_any_other_and_shared_admits_shared(tmp_path: pathlib.Path) -> None:
    with (
        lock_directory(str(tmp_path), shared=True),
        lock_directory(str(tmp_path), shared=True),
        pytest.raises(UsageError, match=f"another shardio pack is writing to {tmp_path}"),
    ):
        _take(tmp_path, shared=False)
    with (
        lock_directory(str(tmp_path), shared=False),
        pytest.raises(UsageError, match="a repair is writing to"),
    ):
        _take(tmp_path, shared=True, busy="a repair is writing to")
    _take(tmp_path, shared=False)  # released: free again


def test_a_missing_path_or_a_file_is_a_storage_error(tmp_path: pathlib.Path) -> None:
    (tmp_path / "file").write_text("x")
    for bad in (tmp_path / "missing", tmp_path / "file"):
        with pytest.raises(StorageError, match=f"cannot open {bad}"):
            _take(bad, shared=False)


def test_a_directory_replaced_while_locking_is_refused(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shardio.storage.dirlock as dirlock

    target = tmp_path / "ds"
    target.mkdir()
    real = dirlock.fcntl.flock

    def replaced(fd: int, op: int) -> None:  # another process renamed a new one in place
        real(fd, op)
        target.rename(tmp_path / "old")
        target.mkdir()

    monkeypatch.setattr(dirlock.fcntl, "flock", replaced)
    with pytest.raises(UsageError, match="retry"), lock_directory(str(target), shared=False):
        pass
