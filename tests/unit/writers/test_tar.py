"""Tests for the tar shard writer, its ustar headers and its DALI index."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest

from shardio.errors import StorageError
from shardio.format.checksum import file_xxh3_128, member_xxh3_64
from shardio.writers.tar import TarShardWriter, dali_index_text, ustar_header


def _parse_one(header: bytes, data: bytes = b"") -> tarfile.TarInfo:
    pad = b"\0" * (-len(data) % 512)
    stream = io.BytesIO(header + data + pad + b"\0" * 1024)
    with tarfile.open(fileobj=stream, mode="r:") as tf:
        [info] = tf.getmembers()
        if data:
            extracted = tf.extractfile(info)
            assert extracted is not None
            assert extracted.read() == data
    return info


@pytest.mark.parametrize(
    "name",
    [
        b"k.jpg",
        b"a" * 96 + b".jpg",  # exactly 100 bytes: fills the name field, no NUL
        b"d" * 120 + b"/" + b"f" * 60 + b".jpg",  # fits by moving the directory to prefix
        b"p" * 155 + b"/" + b"n" * 96 + b".jpg",  # longest prefix, longest base
    ],
)
def test_ustar_header_is_one_block(name: bytes) -> None:
    header = ustar_header(name, 3)
    assert len(header) == 512
    info = tarfile.TarInfo.frombuf(header, "ascii", "strict")  # validates the checksum
    assert info.name == name.decode()
    assert info.size == 3
    assert info.mode == 0o644
    assert info.mtime == 0
    assert (info.uid, info.gid, info.uname, info.gname) == (0, 0, "", "")
    assert info.type == tarfile.REGTYPE
    assert header[257:265] == b"ustar\x0000"
    assert _parse_one(header, b"abc").name == name.decode()


@pytest.mark.parametrize(
    "name",
    [
        b"x" * 101 + b".jpg",  # no slash to split at
        b"d" * 10 + b"/" + b"f" * 101 + b".jpg",  # base too long
        b"p" * 160 + b"/" + b"f.jpg",  # prefix too long
        b"a/" * 200 + b"k.cls",
    ],
)
def test_long_names_get_a_pax_header(name: bytes) -> None:
    header = ustar_header(name, 5)
    assert len(header) > 512
    assert len(header) % 512 == 0
    assert b"path=" + name in header
    info = _parse_one(header, b"12345")
    assert info.name == name.decode()
    assert info.size == 5
    assert info.mtime == 0


def test_sizes_of_8_gib_and_more_get_a_pax_header() -> None:
    size = 8 * 1024**3
    header = ustar_header(b"big.bin", size)
    assert b" size=8589934592\n" in header
    with tarfile.open(fileobj=io.BytesIO(header), mode="r:") as tf:
        info = tf.next()  # reads the headers only; the data is not there
    assert info is not None
    assert info.name == "big.bin"
    assert info.size == size
    assert info.offset_data == len(header)


def test_headers_are_reproducible() -> None:
    assert ustar_header(b"a/b.c", 10) == ustar_header(b"a/b.c", 10)
    assert ustar_header(b"x" * 300, 10) == ustar_header(b"x" * 300, 10)


def _members(*items: tuple[str, bytes]) -> list[tuple[str, bytes, int]]:
    return [(ext, data, member_xxh3_64(data)) for ext, data in items]


def test_writer_produces_a_readable_tar(tmp_path: Path) -> None:
    path = str(tmp_path / "shard.tar")
    writer = TarShardWriter(path, durable=False)
    big = os.urandom(9 * 1024 * 1024)  # larger than one write batch
    samples = [
        ("a/x", _members(("jpg", b"1234"), ("cls", b"3"))),
        ("a/empty", _members(("txt", b""))),
        ("b/big", _members(("bin", big))),
    ] + [(f"c/{i:04d}", _members(("t", bytes([i % 256]) * i))) for i in range(300)]
    placed = [writer.add_sample(key, 0, m) for key, m in samples]
    assert not os.path.exists(path)  # nothing under the final name before finish
    size, digest = writer.finish()
    assert os.listdir(tmp_path) == ["shard.tar"]
    assert size == os.path.getsize(path)
    assert size % 512 == 0
    assert digest == file_xxh3_128(path)

    with tarfile.open(path) as tf:
        infos = tf.getmembers()
        expected = [(f"{key}.{ext}", data) for key, ms in samples for ext, data, _ in ms]
        assert [i.name for i in infos] == [n for n, _ in expected]
        offsets = [p for ps in placed for p in ps]
        for info, (_, data), (off, length) in zip(infos, expected, offsets, strict=True):
            assert (info.offset_data, info.size) == (off, length)
            assert length == len(data)
            fh = tf.extractfile(info)
            assert fh is not None and fh.read() == data
    with open(path, "rb") as fh:
        fh.seek(-1024, os.SEEK_END)
        assert fh.read() == b"\0" * 1024
    assert [k for k, _ in writer.samples] == [k for k, _ in samples]


def test_abort_leaves_nothing(tmp_path: Path) -> None:
    path = str(tmp_path / "shard.tar")
    writer = TarShardWriter(path, durable=False)
    writer.add_sample("k", 0, _members(("a", b"x" * 10)))
    assert len(os.listdir(tmp_path)) == 1  # the hidden temp file
    writer.abort()
    writer.abort()
    assert os.listdir(tmp_path) == []


def test_unwritable_directory_names_the_shard(tmp_path: Path) -> None:
    path = str(tmp_path / "missing-dir" / "shard.tar")
    with pytest.raises(StorageError) as info:
        TarShardWriter(path)
    assert path in str(info.value)


def test_dali_index_text() -> None:
    text = dali_index_text(
        [("a/x", [("jpg", 512, 4), ("cls", 1536, 1)]), ("b%20y", [("noext", 2560, 0)])]
    )
    assert text == (b"v1.2 2\njpg 512 4 a/x.jpg cls 1536 1 a/x.cls\nnoext 2560 0 b%20y.noext\n")
    assert dali_index_text([]) == b"v1.2 0\n"


# --- streamed members ------------------------------------------------------------------


class FakeSource:
    """A ``readinto`` over bytes that may end early, run on, or fail after some bytes."""

    def __init__(self, data: bytes, *, fail_after: int | None = None, chunk: int = 3000):
        self.data, self.pos, self.fail_after, self.chunk = data, 0, fail_after, chunk

    def __call__(self, view: memoryview) -> int:
        if self.fail_after is not None and self.pos >= self.fail_after:
            raise OSError(5, "Input/output error")
        n = min(len(view), self.chunk, len(self.data) - self.pos)
        view[:n] = self.data[self.pos : self.pos + n]
        self.pos += n
        return n


def _tar_with(tmp_path: Path, name: str, middle) -> tuple[bytes, list]:
    """A shard with a small member, ``middle(writer)``, then another small member."""
    path = tmp_path / name
    writer = TarShardWriter(str(path), durable=False)
    writer.begin_sample("s/a", 0)
    writer.add_member("txt", b"first", member_xxh3_64(b"first"))
    result = middle(writer)
    writer.add_member("cls", b"3", member_xxh3_64(b"3"))
    writer.end_sample()
    size, digest = writer.finish()
    data = path.read_bytes()
    assert (size, digest) == (len(data), file_xxh3_128(path))  # hasher state stays true
    return data, [result, writer.samples]


def test_streamed_member_equals_an_in_memory_one(tmp_path: Path) -> None:
    payload = os.urandom(20_000)
    streamed, (placed, samples) = _tar_with(
        tmp_path, "s.tar", lambda w: w.add_stream("bin", len(payload), FakeSource(payload))
    )
    whole, (placed_whole, samples_whole) = _tar_with(
        tmp_path,
        "w.tar",
        lambda w: w.add_member("bin", payload, member_xxh3_64(payload)),
    )
    assert streamed == whole
    assert placed == (*placed_whole, member_xxh3_64(payload))
    assert samples == samples_whole


@pytest.mark.parametrize(
    "source",
    [
        lambda p: FakeSource(p[:-100]),  # shorter than planned
        lambda p: FakeSource(p + b"more"),  # longer than planned
        lambda p: FakeSource(p, fail_after=9000),  # EIO half-way
    ],
    ids=["shorter", "longer", "eio"],
)
def test_a_changed_stream_is_rolled_back(tmp_path: Path, source) -> None:
    from shardio.writers.base import SourceChangedError

    payload = os.urandom(20_000)
    reasons = []

    def middle(writer: TarShardWriter) -> None:
        with pytest.raises(SourceChangedError) as info:
            writer.add_stream("bin", len(payload), source(payload))
        reasons.append(info.value.reason)

    rolled_back, (_, samples) = _tar_with(tmp_path, "r.tar", middle)
    without, (_, samples_without) = _tar_with(tmp_path, "n.tar", lambda w: None)
    assert rolled_back == without  # not a byte of the member or its header is left
    assert samples == samples_without
    assert "changed size during the pack" in reasons[0] or "unreadable" in reasons[0]
    with tarfile.open(tmp_path / "r.tar") as tf:
        assert tf.getnames() == ["s/a.txt", "s/a.cls"]


def test_finish_twice_returns_the_same_and_changes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "shard.tar"
    writer = TarShardWriter(str(path), durable=False)
    writer.add_sample("k", 0, _members(("a", b"x" * 10)))
    first = writer.finish()
    data = path.read_bytes()
    assert writer.finish() == first  # not EBADF, not a second end-of-archive
    assert path.read_bytes() == data and first == (len(data), file_xxh3_128(str(path)))
    writer.abort()  # after finish: the published shard stays
    assert path.read_bytes() == data
