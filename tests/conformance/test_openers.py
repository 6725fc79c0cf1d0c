"""What every opener must do: the POSIX one, the fault-injecting one (with no fault armed) and
the deadline one around each; and the PFS read strategies over each of them.

Every byte the read side takes (training reads, verify, repair, the staging copy) goes through
an opener, so a new one (an object-store fetcher, a Lustre-aware one) is added to OPENERS
here and must pass all of this: the same bytes at every offset, short reads only at the end,
a kernel copy that leaves the source's position alone, the errors of POSIX (a missing file,
a symlink refused with ``nofollow``, a FIFO that never blocks, a closed descriptor), and a
copy that works after pickling and in a forked child.
"""

from __future__ import annotations

import errno
import os
import pathlib
import pickle
import random
import threading
from collections.abc import Callable
from typing import Any

import pytest

from shardio.read.deadline import DeadlineOpener
from shardio.read.faults import FaultyOpener
from shardio.storage.opener import Opener, PosixOpener, read_fully

OPENERS: dict[str, Callable[[], Opener]] = {
    "posix": PosixOpener,
    "faulty-unarmed": lambda: FaultyOpener([]),
    "deadline(posix)": lambda: DeadlineOpener(PosixOpener(), timeout_s=30.0),
    "deadline(faulty-unarmed)": lambda: DeadlineOpener(FaultyOpener([]), timeout_s=30.0),
}
SIZE = 3 * (1 << 20) + 12_345  # more than one copy chunk of a buffered copy, not aligned


@pytest.fixture(params=sorted(OPENERS), name="opener")
def _opener(request: pytest.FixtureRequest) -> Opener:
    return OPENERS[request.param]()


@pytest.fixture(name="data_file")
def _data_file(tmp_path: pathlib.Path) -> tuple[str, bytes]:
    data = random.Random(7).randbytes(SIZE)
    path = tmp_path / "shard-000000.tar"
    path.write_bytes(data)
    return os.fspath(path), data


def _bounded(call: Callable[[], Any], seconds: float = 10.0) -> Any:
    """``call()`` in a thread; fails the test if it has not returned in ``seconds``."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = call()
        except BaseException as exc:  # handed back to the test
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"the call blocked for more than {seconds} s"
    if "error" in out:
        raise out["error"]
    return out.get("value")


def test_ranges_read_are_the_file_bytes(opener: Opener, data_file: tuple[str, bytes]) -> None:
    path, data = data_file
    fd = opener.open(path)
    try:
        assert opener.size(fd) == len(data)
        st = os.stat(path)
        assert opener.identity(fd) == (st.st_dev, st.st_ino)
        rng = random.Random(1)
        for _ in range(50):
            offset = rng.randrange(len(data))
            length = rng.randrange(1, 70_000)
            buf = memoryview(bytearray(length))
            got = read_fully(opener, fd, buf, offset)
            assert got == min(length, len(data) - offset)
            assert bytes(buf[:got]) == data[offset : offset + got]
        tail = memoryview(bytearray(100))
        assert opener.pread_into(fd, tail, len(data)) == 0  # at the end: 0, not an error
        assert opener.pread_into(fd, tail, len(data) + 10**9) == 0
        opener.advise(fd, 0, len(data))  # advice never fails on a regular file
    finally:
        opener.close(fd)


def test_copy_into_copies_exactly_and_leaves_the_source_position(
    opener: Opener, data_file: tuple[str, bytes], tmp_path: pathlib.Path
) -> None:
    path, data = data_file
    out_path = tmp_path / "copy"
    fd = opener.open(path)
    out = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        total = 0
        while True:
            n = opener.copy_into(fd, out, total, 1 << 20)
            assert 0 <= n <= 1 << 20
            if n == 0:
                break
            total += n
            assert os.lseek(out, 0, os.SEEK_CUR) == total  # the target's position advanced
        assert os.lseek(fd, 0, os.SEEK_CUR) == 0  # the source's did not
        assert opener.copy_into(fd, out, 10, 5) == 5  # bounded by count
    finally:
        opener.close(fd)
        os.close(out)
    assert out_path.read_bytes() == data + data[10:15]


def test_a_missing_file_is_an_oserror_naming_it(opener: Opener, tmp_path: pathlib.Path) -> None:
    missing = os.fspath(tmp_path / "gone.tar")
    with pytest.raises(OSError) as info:
        opener.open(missing)
    assert info.value.errno == errno.ENOENT
    assert "gone.tar" in str(info.value)


def test_nofollow_refuses_a_symlink_and_plain_open_follows_it(
    opener: Opener, data_file: tuple[str, bytes], tmp_path: pathlib.Path
) -> None:
    path, data = data_file
    link = tmp_path / "link.tar"
    link.symlink_to(path)
    with pytest.raises(OSError) as info:
        opener.open(os.fspath(link), nofollow=True)
    assert info.value.errno == errno.ELOOP
    fd = opener.open(os.fspath(link))
    try:
        assert opener.size(fd) == len(data)
    finally:
        opener.close(fd)


def _open_and_read(opener: Opener, path: pathlib.Path) -> None:
    """Open ``path`` and read from it (bounded in time); the OSError of either is raised."""

    def attempt() -> None:
        fd = opener.open(os.fspath(path))
        try:
            opener.pread_into(fd, memoryview(bytearray(10)), 0)
        finally:
            opener.close(fd)

    _bounded(attempt)


def test_a_fifo_never_blocks(opener: Opener, tmp_path: pathlib.Path) -> None:
    """Nobody writes to the FIFO: an open or read that waited for a writer would hang."""
    fifo = tmp_path / "shard-000001.tar"
    os.mkfifo(fifo)
    with pytest.raises(OSError) as info:
        _open_and_read(opener, fifo)
    assert info.value.errno == errno.ESPIPE


def test_a_directory_is_an_oserror(opener: Opener, tmp_path: pathlib.Path) -> None:
    with pytest.raises(OSError) as info:
        _open_and_read(opener, tmp_path)
    assert info.value.errno == errno.EISDIR


def test_a_closed_descriptor_is_an_oserror(opener: Opener, data_file: tuple[str, bytes]) -> None:
    path, _data = data_file
    fd = opener.open(path)
    opener.close(fd)
    with pytest.raises(OSError) as info:
        opener.pread_into(fd, memoryview(bytearray(10)), 0)
    assert info.value.errno == errno.EBADF


def test_map_is_the_file_bytes_and_none_when_empty(
    opener: Opener, data_file: tuple[str, bytes], tmp_path: pathlib.Path
) -> None:
    path, data = data_file
    mapped = opener.map(path)
    assert mapped is not None
    try:
        assert mapped[:] == data
    finally:
        mapped.close()
    empty = tmp_path / "empty.tar"
    empty.write_bytes(b"")
    assert opener.map(os.fspath(empty)) is None


def test_a_pickled_copy_reads_the_same(opener: Opener, data_file: tuple[str, bytes]) -> None:
    path, data = data_file
    copy: Opener = pickle.loads(pickle.dumps(opener))
    fd = copy.open(path)
    try:
        buf = memoryview(bytearray(len(data)))
        assert read_fully(copy, fd, buf, 0) == len(data)
        assert bytes(buf) == data
    finally:
        copy.close(fd)


def test_a_forked_child_reads_through_the_parents_opener(
    opener: Opener, data_file: tuple[str, bytes]
) -> None:
    """A DataLoader or verify worker forked after the parent read through the opener."""
    path, data = data_file
    fd = opener.open(path)  # the parent used it first (threads started, descriptors known)
    opener.pread_into(fd, memoryview(bytearray(10)), 0)
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: read the file through the inherited opener, report
        code = 1
        try:
            buf = memoryview(bytearray(len(data)))
            got = read_fully(opener, fd, buf, 0)
            code = 0 if got == len(data) and bytes(buf) == data else 2
        finally:
            os.write(wfd, bytes([code]))
            os._exit(0)
    os.close(wfd)
    try:
        status = _bounded(lambda: os.read(rfd, 1), 30.0)
        assert status == b"\x00", "the child read other bytes, or failed"
    finally:
        os.close(rfd)
        os.waitpid(pid, 0)
        opener.close(fd)


@pytest.mark.parametrize("strategy", ["local", "pfs"])
def test_a_read_strategy_over_the_opener_delivers_the_same_batches(
    opener: Opener, strategy: str, tmp_path: pathlib.Path
) -> None:
    """The PFS read strategy (coalesced requests on I/O threads) and the local one (one pread
    per member) give the bytes ``read_sample`` gives, through every opener."""
    from trees import write_tree

    from shardio.packing.run import PackOptions, pack
    from shardio.read.reader import ShardReader
    from shardio.read.strategy import choose_strategy
    from shardio.runtime.batch import read_batch

    tree = {f"c{i % 3}/{i:03d}.jpg".encode(): os.urandom(500 + 37 * i) for i in range(60)}
    write_tree(tmp_path / "src", tree)
    root = tmp_path / "out"
    pack(tmp_path / "src", root, PackOptions(shard_size_bytes=8192, workers=1))
    chosen = choose_strategy(root, strategy).strategy
    with ShardReader(root) as plain:
        expected = [plain.read_sample(i) for i in range(len(plain))]
    with ShardReader(root, opener=opener, read_strategy=chosen) as ds:
        order = random.Random(3).sample(range(len(ds)), len(ds))
        for start in range(0, len(order), 16):
            indices = order[start : start + 16]
            batch = read_batch(ds, indices, verify=True, shared=False)
            for row, sample in enumerate(indices):
                want = expected[sample]
                assert batch["__key__"][row] == want["__key__"]
                assert bytes(batch["jpg"][row]) == want["jpg"]
                assert int(batch["cls"][row]) == want["cls"]


# Direct byte reads left outside the opener, each with why: none of them reads a shard.
_DIRECT_READS_ALLOWED = {
    ("shardio.staging.protocol", "_read_stamp"): "a stamp of a staged copy",
    ("shardio.staging.clean", "_copy_out"): "the repair journal, kept before a clean",
    ("shardio.staging.copy", "_staged_equals"): "a small file compared whole (DALI index)",
    ("shardio.read.unavailable", "_read_small"): "the node's registry of unavailable shards",
    ("shardio.read.faults", "map"): "anonymous memory for the faulted bytes",
    ("shardio.read.reader", "first_member_cached"): "one byte's page-cache residency, not used",
}
_READ_CALLS = {
    ("os", "read"), ("os", "pread"), ("os", "preadv"), ("os", "readv"),
    ("os", "copy_file_range"), ("os", "sendfile"), ("mmap", "mmap"),
}  # fmt: skip


def test_no_shard_byte_is_read_outside_the_opener() -> None:
    """The read side, the tools and the staging copy call no read primitive themselves."""
    import ast

    package = pathlib.Path(__file__).resolve().parents[2] / "shardio"
    found = []
    for folder in ("read", "tools", "runtime", "dali", "cache"):
        for path in sorted((package / folder).rglob("*.py")):
            module = "shardio." + ".".join(path.relative_to(package).with_suffix("").parts)
            tree = ast.parse(path.read_text(), os.fspath(path))
            for func in ast.walk(tree):
                if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
                    continue
                for node in ast.walk(func):
                    call = node.func if isinstance(node, ast.Call) else None
                    if (
                        isinstance(call, ast.Attribute)
                        and isinstance(call.value, ast.Name)
                        and (call.value.id, call.attr) in _READ_CALLS
                        and (module, func.name) not in _DIRECT_READS_ALLOWED
                    ):
                        found.append(f"{module}.{func.name}: {call.value.id}.{call.attr}")
    assert not found, f"read through the opener instead: {sorted(set(found))}"
