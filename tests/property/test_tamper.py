"""Any change to manifest.json or index.bin: a clear ShardioError, or exactly the packed samples.

Hypothesis mutates random bytes (flips, overwrites, insertions, deletions, truncation) of a
packed dataset's manifest or index, then opens it, reads every sample, verifies and unpacks it.
Each must either raise a ShardioError or give back exactly what was packed: never a wrong
sample, a hang, or another exception type.
"""

from __future__ import annotations

import shutil
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from trees import read_tree, write_tree

from shardio.errors import ShardioError
from shardio.packing.run import PackOptions, pack
from shardio.read.reader import ShardReader
from shardio.tools.unpack import unpack_dataset
from shardio.tools.verify import verify_dataset

# An ImageNet-style tree (labels), several members per sample, a non-UTF-8 name, 3 shards.
TREE = {
    b"cat/a.jpg": b"A" * 700,
    b"cat/a.json": b'{"a": 1}',
    b"cat/b.jpg": bytes(range(256)) * 3,
    b"cat/c d.jpg": b"",
    b"dog/\xffe.jpg": b"E" * 1500,
    b"dog/f.jpg": b"F" * 2000,
    b"dog/f.txt": b"text",
    b"emu/g.jpg": b"G" * 3000,
}
FILES = ["manifest.json", "index.bin"]


@pytest.fixture(scope="module", params=["tar", "hdf5"])
def packed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tamper")
    write_tree(root / "src", TREE)
    dst = root / "ds"
    pack(
        str(root / "src"),
        str(dst),
        PackOptions(shard_format=request.param, shard_size_bytes=4096, workers=1, durable=False),
    )
    return dst


def _expected(ds: ShardReader) -> list[dict[str, Any]]:
    return [ds.read_sample(i) for i in range(len(ds))]


@contextmanager
def _no_hang(seconds: int) -> Iterator[None]:
    def fail(signum: int, frame: object) -> None:
        raise TimeoutError(f"hung for {seconds} s on a tampered dataset")

    old = signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _mutate(data: bytes, edits: list[tuple[str, int, int]]) -> bytes:
    out = bytearray(data)
    for kind, where, value in edits:
        pos = where % (len(out) + 1)
        if kind == "flip" and pos < len(out):
            out[pos] ^= 1 << (value % 8)
        elif kind == "set" and pos < len(out):
            out[pos] = value % 256
        elif kind == "insert":
            out[pos:pos] = bytes([value % 256])
        elif kind == "delete":
            del out[pos : pos + 1 + value % 8]
        elif kind == "truncate":
            del out[pos:]
        elif kind == "big" and pos + 8 <= len(out):  # a huge u64 (size, offset, count)
            out[pos : pos + 8] = (2**63 + value).to_bytes(8, "little")
    return bytes(out)


EDITS = st.lists(
    st.tuples(
        st.sampled_from(["flip", "flip", "set", "insert", "delete", "truncate", "big"]),
        st.integers(0, 1 << 20),
        st.integers(0, 255),
    ),
    min_size=1,
    max_size=4,
)


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(name=st.sampled_from(FILES), edits=EDITS)
def test_tampered_metadata_is_refused_or_harmless(
    packed: Path, tmp_path_factory: pytest.TempPathFactory, name: str, edits: list[Any]
) -> None:
    with ShardReader(packed) as ds:
        expected = _expected(ds)
    work = tmp_path_factory.mktemp("case")
    ds_dir = work / "ds"
    shutil.copytree(packed, ds_dir)
    target = ds_dir / name
    original = target.read_bytes()
    mutated = _mutate(original, edits)
    target.write_bytes(mutated)
    with _no_hang(20):
        try:
            with ShardReader(ds_dir) as ds:
                got = _expected(ds)
            assert got == expected, "a tampered dataset handed over different samples"
        except ShardioError as exc:
            assert "\n" not in str(exc)
        try:
            report = verify_dataset(ds_dir)
        except ShardioError:
            pass
        else:
            assert report.ok == (mutated == original), "verify judged a tampered file wrongly"
        try:
            unpack_dataset(ds_dir, work / "out")
        except ShardioError:
            assert not (work / "out").exists() or not any((work / "out").iterdir())
        else:
            assert read_tree(work / "out") == TREE
    shutil.rmtree(work)
