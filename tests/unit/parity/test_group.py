"""encode_group / rebuild_group on real files: every loss pattern of up to M files of a group
(data, parity, mixed; a short group; unequal sizes) rebuilds byte-identical files; M + 1
losses write nothing; a damaged survivor is never used to publish a wrong file; faults of
the opener reach the caller; memory stays a few rows whatever the shard size."""

from __future__ import annotations

import itertools
import os
import pathlib
import random

import pytest

pytest.importorskip("pyeclib")

import xxhash

from shardio.errors import IntegrityError, StorageError, UsageError
from shardio.parity.codec import ParityCodec
from shardio.parity.group import encode_group, rebuild_group
from shardio.read.faults import Fault, FaultyOpener

CELL = 4096


def _digest(path: pathlib.Path) -> str:
    return xxhash.xxh3_128_hexdigest(path.read_bytes())


def _group(tmp_path: pathlib.Path, sizes: list[int], k: int, m: int):  # type: ignore[no-untyped-def]
    rng = random.Random(sum(sizes) + k)
    data = []
    for i, size in enumerate(sizes):
        path = tmp_path / f"shard-{i:06d}.tar"
        path.write_bytes(rng.randbytes(size))
        data.append(path)
    parity = [tmp_path / f"parity-{j:06d}.bin" for j in range(m)]
    codec = ParityCodec(k, m, CELL)
    written = encode_group([str(p) for p in data], sizes, [str(p) for p in parity], codec)
    files = {i: p for i, p in enumerate(data)} | {k + j: p for j, p in enumerate(parity)}
    digests = {i: _digest(p) for i, p in files.items()}
    assert [d for _, d in written] == [digests[k + j] for j in range(m)]
    assert all(s == max(sizes) for s, _ in written)  # as long as the longest data file
    return codec, data, parity, files, digests


@pytest.mark.parametrize(
    ("sizes", "k", "m"),
    [
        ([3 * CELL + 17, CELL, 2 * CELL + 1, 5], 4, 2),  # unequal sizes, none a whole cell
        ([10_000, 20_000], 4, 2),  # a short group: two data files of four
        ([CELL] * 3, 3, 3),
    ],
)
def test_every_loss_of_up_to_m_files_rebuilds_them_byte_for_byte(
    tmp_path: pathlib.Path, sizes: list[int], k: int, m: int
) -> None:
    codec, data, parity, files, digests = _group(tmp_path, sizes, k, m)
    original = {i: p.read_bytes() for i, p in files.items()}
    for count in range(1, m + 1):
        for gone in itertools.combinations(sorted(files), count):
            for i in gone:
                files[i].unlink()
            written = rebuild_group(
                [str(p) for p in data], sizes, [str(p) for p in parity], codec,
                {i: digests[i] for i in gone}, durable=False,
            )  # fmt: skip
            assert sorted(written) == sorted(gone)
            assert {i: files[i].read_bytes() for i in files} == original, gone


def test_more_losses_than_parity_write_nothing(tmp_path: pathlib.Path) -> None:
    sizes = [CELL * 2, CELL, CELL + 3]
    codec, data, parity, files, digests = _group(tmp_path, sizes, 3, 1)
    files[0].unlink()
    files[1].unlink()
    with pytest.raises(IntegrityError, match=r"2 files of one group lost.*beyond"):
        rebuild_group(
            [str(p) for p in data], sizes, [str(p) for p in parity], codec,
            {0: digests[0], 1: digests[1]},
        )  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        p.name for p in [data[2], *parity]
    )  # no temp file, nothing published


def test_a_damaged_survivor_never_publishes_a_wrong_file(tmp_path: pathlib.Path) -> None:
    """A flipped byte in the parity file used: the rebuilt data file does not match its
    checksum, so it is not published; the good files are not written."""
    sizes = [CELL * 3, CELL * 3]
    codec, data, parity, _files, digests = _group(tmp_path, sizes, 2, 1)
    flipped = bytearray(parity[0].read_bytes())
    flipped[CELL + 7] ^= 0x40
    parity[0].write_bytes(flipped)
    kept = data[1].stat().st_mtime_ns
    data[0].unlink()
    with pytest.raises(IntegrityError, match="does not match its manifest checksum"):
        rebuild_group(
            [str(p) for p in data], sizes, [str(p) for p in parity], codec, {0: digests[0]}
        )
    assert not data[0].exists()
    assert data[1].stat().st_mtime_ns == kept
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([data[1].name, parity[0].name])


def test_a_survivor_of_the_wrong_size_is_refused_not_read(tmp_path: pathlib.Path) -> None:
    sizes = [CELL * 2, CELL * 2, CELL]
    codec, data, parity, _files, digests = _group(tmp_path, sizes, 3, 1)
    data[0].unlink()
    with open(data[1], "r+b") as fh:
        fh.truncate(CELL)
    with pytest.raises(IntegrityError, match="is 4,096 bytes, expected 8,192: count it lost"):
        rebuild_group(
            [str(p) for p in data], sizes, [str(p) for p in parity], codec, {0: digests[0]}
        )


def test_only_k_survivors_are_read(tmp_path: pathlib.Path) -> None:
    """Data files first, parity only for what is missing: the second parity file is unread."""
    sizes = [CELL * 2] * 4
    codec, data, parity, _files, digests = _group(tmp_path, sizes, 4, 2)
    data[2].unlink()
    opener = FaultyOpener([Fault(kind="missing", path=parity[1].name)])
    rebuild_group(
        [str(p) for p in data], sizes, [str(p) for p in parity], codec, {2: digests[2]},
        opener=opener,
    )  # fmt: skip
    assert opener.fired == [0]  # never opened
    assert _digest(data[2]) == digests[2]


def test_a_read_fault_of_a_survivor_is_the_callers_error(tmp_path: pathlib.Path) -> None:
    sizes = [CELL * 2] * 3
    codec, data, parity, _files, digests = _group(tmp_path, sizes, 3, 1)
    data[0].unlink()
    opener = FaultyOpener([Fault(kind="eio", path=data[1].name)])
    with pytest.raises(OSError, match="injected EIO"):
        rebuild_group(
            [str(p) for p in data], sizes, [str(p) for p in parity], codec, {0: digests[0]},
            opener=opener,
        )  # fmt: skip
    assert not data[0].exists()


def test_a_fifo_in_place_of_a_data_file_is_refused_at_once(tmp_path: pathlib.Path) -> None:
    sizes = [CELL, CELL]
    good = tmp_path / "a.tar"
    good.write_bytes(os.urandom(CELL))
    fifo = tmp_path / "b.tar"
    os.mkfifo(fifo)
    with pytest.raises(StorageError, match="FIFO"):
        encode_group(
            [str(good), str(fifo)], sizes, [str(tmp_path / "p.bin")], ParityCodec(2, 1, CELL)
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.tar", "b.tar"]


def test_bad_groups_are_usage_errors(tmp_path: pathlib.Path) -> None:
    codec = ParityCodec(2, 1, CELL)
    with pytest.raises(UsageError, match="1 to 2 data files"):
        encode_group(["a", "b", "c"], [1, 1, 1], ["p"], codec)
    with pytest.raises(UsageError, match="1 parity files"):
        encode_group(["a"], [1], ["p", "q"], codec)
    with pytest.raises(UsageError, match="no file of this group"):
        rebuild_group(["a"], [1], ["p"], codec, {1: "0" * 32})  # index 1: absent in a short group


def test_memory_is_a_few_rows_whatever_the_shard_size(tmp_path: pathlib.Path) -> None:
    """Encode and rebuild stream row by row: the peak of Python allocations stays near
    (K + M) cells, not the shard size."""
    import tracemalloc

    cell, size = 64 << 10, 16 << 20
    data = []
    for i in range(3):
        path = tmp_path / f"d{i}.tar"
        with open(path, "wb") as fh:
            for _ in range(size // (1 << 20)):
                fh.write(os.urandom(1 << 20))
        data.append(path)
    parity = [tmp_path / "p0.bin", tmp_path / "p1.bin"]
    codec = ParityCodec(3, 2, cell)
    tracemalloc.start()
    try:
        written = encode_group([str(p) for p in data], [size] * 3, [str(p) for p in parity], codec)
        peak_encode = tracemalloc.get_traced_memory()[1]
        want = _digest(data[1])
        data[1].unlink()
        tracemalloc.reset_peak()
        rebuild_group(
            [str(p) for p in data], [size] * 3, [str(p) for p in parity], codec, {1: want},
            durable=False,
        )  # fmt: skip
        peak_rebuild = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [s for s, _ in written] == [size, size]
    assert _digest(data[1]) == want
    bound = 20 * cell  # a row in, a row out, the copies pyeclib makes: far below 16 MiB
    assert peak_encode < bound and peak_rebuild < bound, (peak_encode, peak_rebuild)
