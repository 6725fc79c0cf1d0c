"""encode_group / rebuild_group on real files: every loss pattern of up to M files of a group
(data, parity, mixed; a short group; unequal sizes) rebuilds byte-identical files; more than
M losses write nothing; the cell table makes a flipped byte a known loss (a damaged survivor
is passed over, damage spread over more than M files is still rebuilt row by row); without
the table a damaged survivor never publishes a wrong file; faults of the opener reach the
caller; memory stays a few rows whatever the shard size."""

from __future__ import annotations

import itertools
import os
import pathlib
import random

import pytest

pytest.importorskip("pyeclib")

import xxhash

from shardio.errors import IntegrityError, StorageError, UsageError
from shardio.parity.cells import CellTable
from shardio.parity.codec import ParityCodec
from shardio.parity.group import GroupFiles, encode_group, rebuild_group
from shardio.read.faults import Fault, FaultyOpener

CELL = 4096


def _digest(path: pathlib.Path) -> str:
    return xxhash.xxh3_128_hexdigest(path.read_bytes())


class Group:
    """A group of random data files with its parity and cell table written."""

    def __init__(self, tmp_path: pathlib.Path, sizes: list[int], k: int, m: int) -> None:
        rng = random.Random(sum(sizes) + k)
        self.k, self.m, self.sizes = k, m, sizes
        self.data = []
        for i, size in enumerate(sizes):
            path = tmp_path / f"shard-{i:06d}.tar"
            path.write_bytes(rng.randbytes(size))
            self.data.append(path)
        self.parity = [tmp_path / f"group.p{j}" for j in range(m)]
        self.cells = tmp_path / "group.cells"
        self.codec = ParityCodec(k, m, CELL)
        self.data_digests = [_digest(p) for p in self.data]
        self.encoded = encode_group(self.spec(), self.codec)
        self.paths = {i: p for i, p in enumerate(self.data)} | {
            k + j: p for j, p in enumerate(self.parity)
        }
        self.digests = {i: _digest(p) for i, p in self.paths.items()}
        self.original = {i: p.read_bytes() for i, p in self.paths.items()}

    def spec(self) -> GroupFiles:
        return GroupFiles(
            data=[str(p) for p in self.data],
            sizes=self.sizes,
            digests=self.data_digests,
            parity=[str(p) for p in self.parity],
            cells=str(self.cells),
        )

    def table(self) -> CellTable:
        rows = -(-max(self.sizes) // CELL)
        return CellTable.loads(
            self.cells.read_bytes(), k=self.k, m=self.m, num_data=len(self.data),
            cell_bytes=CELL, rows=rows, where=str(self.cells),
        )  # fmt: skip

    def rebuild(self, lost: list[int], *, table: bool = True, **kw):  # type: ignore[no-untyped-def]
        return rebuild_group(
            self.spec(), self.codec, {i: self.digests[i] for i in lost},
            table=self.table() if table else None, durable=False, **kw,
        )  # fmt: skip

    def flip(self, index: int, offset: int) -> None:
        path = self.paths[index]
        raw = bytearray(path.read_bytes())
        raw[offset] ^= 0x01
        path.write_bytes(raw)

    def current(self) -> dict[int, bytes]:
        return {i: p.read_bytes() for i, p in self.paths.items()}


def test_encode_records_the_parity_and_the_table(tmp_path: pathlib.Path) -> None:
    g = Group(tmp_path, [3 * CELL + 17, CELL, 2 * CELL + 1], 3, 2)
    assert [d for _, d in g.encoded.parity] == [g.digests[3], g.digests[4]]
    assert all(s == max(g.sizes) for s, _ in g.encoded.parity)  # the longest data file's
    assert g.encoded.cells == (g.cells.stat().st_size, _digest(g.cells))
    table = g.table()
    assert table.rows == 4 and table.digests.shape == (4, 5)
    cell = g.data[1].read_bytes()[:CELL]
    assert table.matches(0, 1, cell) and not table.matches(1, 1, cell)


@pytest.mark.parametrize("table", [True, False], ids=["cells", "no-cells"])
@pytest.mark.parametrize(
    ("sizes", "k", "m"),
    [
        ([3 * CELL + 17, CELL, 2 * CELL + 1, 5], 4, 2),  # unequal sizes, none a whole cell
        ([10_000, 20_000], 4, 2),  # a short group: two data files of four
        ([CELL] * 3, 3, 3),
        ([0, 0], 2, 1),  # empty shards: empty parity
    ],
)
def test_every_loss_of_up_to_m_files_rebuilds_them_byte_for_byte(
    tmp_path: pathlib.Path, sizes: list[int], k: int, m: int, table: bool
) -> None:
    g = Group(tmp_path, sizes, k, m)
    for count in range(1, m + 1):
        for gone in itertools.combinations(sorted(g.paths), count):
            for i in gone:
                g.paths[i].unlink()
            written = g.rebuild(list(gone), table=table)
            assert sorted(written) == sorted(gone)
            assert g.current() == g.original, gone


def test_more_losses_than_parity_write_nothing(tmp_path: pathlib.Path) -> None:
    g = Group(tmp_path, [CELL * 2, CELL, CELL + 3], 3, 1)
    g.data[0].unlink()
    g.data[1].unlink()
    for table in (True, False):
        with pytest.raises(IntegrityError, match=r"2 files of one group lost.*beyond"):
            g.rebuild([0, 1], table=table)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        p.name for p in [g.data[2], *g.parity, g.cells]
    )  # no temp file, nothing published


def test_with_the_table_a_damaged_survivor_is_passed_over(tmp_path: pathlib.Path) -> None:
    """4+2, one data file lost and a flipped byte in the first parity file: the cell table
    says that cell is bad, the second parity file is read instead, the rebuild is exact."""
    g = Group(tmp_path, [CELL * 3] * 4, 4, 2)
    g.data[2].unlink()
    g.flip(4, CELL + 7)
    g.rebuild([2])
    assert g.data[2].read_bytes() == g.original[2]
    assert g.parity[0].read_bytes() != g.original[4]  # not asked for: never written


def test_damage_spread_over_more_files_than_parity_is_rebuilt_row_by_row(
    tmp_path: pathlib.Path,
) -> None:
    """3+1 with a flipped byte in three files, each in another row: no row has more than
    one bad cell, so all three are rebuilt exactly (whole-file parity could not)."""
    g = Group(tmp_path, [CELL * 3] * 3, 3, 1)
    g.flip(0, 5)
    g.flip(1, CELL + 5)
    g.flip(3, 2 * CELL + 5)  # the parity file
    g.rebuild([0, 1, 3])
    assert g.current() == g.original
    with pytest.raises(IntegrityError, match="beyond"):
        g.rebuild([0, 1], table=False)  # no table: more than M files cannot be rebuilt


def test_two_bad_cells_in_one_row_of_a_1_parity_group_is_beyond_repair(
    tmp_path: pathlib.Path,
) -> None:
    g = Group(tmp_path, [CELL * 2] * 3, 3, 1)
    g.flip(0, CELL + 1)
    g.flip(2, CELL + 2)
    before = g.current()
    with pytest.raises(IntegrityError, match=r"row 1 \(bytes 4,096\+\) has only 2 good cells"):
        g.rebuild([0, 2])
    assert g.current() == before


def test_a_corrupted_parity_file_never_repairs_a_good_data_file(tmp_path: pathlib.Path) -> None:
    """Without the table, a flipped byte in the parity file used makes the rebuilt data file
    fail its checksum: it is not published, and the good files are not touched."""
    g = Group(tmp_path, [CELL * 3, CELL * 3], 2, 1)
    g.flip(2, CELL + 7)
    kept = g.data[1].stat().st_mtime_ns
    g.data[0].unlink()
    with pytest.raises(IntegrityError, match="does not match its manifest checksum"):
        g.rebuild([0], table=False)
    assert not g.data[0].exists()
    assert g.data[1].stat().st_mtime_ns == kept
    with pytest.raises(IntegrityError, match="only 1 good cells"):
        g.rebuild([0])  # with the table: the bad parity cell is known, too few are left


def test_a_survivor_of_the_wrong_size_is_refused_without_the_table(tmp_path: pathlib.Path) -> None:
    g = Group(tmp_path, [CELL * 2, CELL * 2, CELL], 3, 1)
    g.data[0].unlink()
    with open(g.data[1], "r+b") as fh:
        fh.truncate(CELL)
    with pytest.raises(IntegrityError, match="is 4,096 bytes, expected 8,192"):
        g.rebuild([0], table=False)
    with pytest.raises(IntegrityError, match="only 2 good cells"):
        g.rebuild([0])  # with it: row 1 of the short file is a bad cell


def test_only_k_survivors_are_read(tmp_path: pathlib.Path) -> None:
    """Data files first, parity only for what is missing: the second parity file is unread."""
    g = Group(tmp_path, [CELL * 2] * 4, 4, 2)
    g.data[2].unlink()
    opener = FaultyOpener([Fault(kind="missing", path=g.parity[1].name)])
    g.rebuild([2], opener=opener)
    assert opener.fired == [0]  # never opened
    assert g.data[2].read_bytes() == g.original[2]


def test_a_failing_survivor_is_replaced_by_another(tmp_path: pathlib.Path) -> None:
    """EIO on one survivor: it counts lost from there on, the other parity file stands in."""
    g = Group(tmp_path, [CELL * 2] * 3, 3, 2)
    g.data[0].unlink()
    opener = FaultyOpener([Fault(kind="eio", path=g.data[1].name)])
    g.rebuild([0], opener=opener)
    assert g.data[0].read_bytes() == g.original[0]


def test_a_read_fault_beyond_the_parity_is_reported(tmp_path: pathlib.Path) -> None:
    g = Group(tmp_path, [CELL * 2] * 3, 3, 1)
    g.data[0].unlink()
    opener = FaultyOpener([Fault(kind="eio", path=g.data[1].name)])
    with pytest.raises(IntegrityError, match="injected EIO"):
        g.rebuild([0], opener=opener)
    assert not g.data[0].exists()


def test_out_writes_elsewhere_and_leaves_the_bad_file(tmp_path: pathlib.Path) -> None:
    g = Group(tmp_path, [CELL * 2] * 3, 3, 1)
    g.flip(1, 9)
    other = tmp_path / "elsewhere.tar"
    written = g.rebuild([1], out={1: str(other)})
    assert written == {1: str(other)}
    assert other.read_bytes() == g.original[1]
    assert g.data[1].read_bytes() != g.original[1]


def test_encode_refuses_a_data_file_that_does_not_match_its_checksum(
    tmp_path: pathlib.Path,
) -> None:
    g = Group(tmp_path, [CELL * 2] * 3, 3, 1)
    for p in (*g.parity, g.cells):
        p.unlink()
    g.flip(1, 3)
    with pytest.raises(IntegrityError, match="does not match its manifest checksum"):
        encode_group(g.spec(), g.codec)
    assert not g.parity[0].exists() and not g.cells.exists()


def test_a_fifo_in_place_of_a_data_file_is_refused_at_once(tmp_path: pathlib.Path) -> None:
    good = tmp_path / "a.tar"
    good.write_bytes(os.urandom(CELL))
    fifo = tmp_path / "b.tar"
    os.mkfifo(fifo)
    spec = GroupFiles([str(good), str(fifo)], [CELL, CELL], ["0" * 32] * 2,
                      [str(tmp_path / "p")], str(tmp_path / "c"))  # fmt: skip
    with pytest.raises(StorageError, match="FIFO"):
        encode_group(spec, ParityCodec(2, 1, CELL))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.tar", "b.tar"]


def test_bad_groups_are_usage_errors(tmp_path: pathlib.Path) -> None:
    codec = ParityCodec(2, 1, CELL)
    z = "0" * 32
    with pytest.raises(UsageError, match="1 to 2 data files"):
        encode_group(GroupFiles(["a", "b", "c"], [1, 1, 1], [z] * 3, ["p"], "c"), codec)
    with pytest.raises(UsageError, match="1 parity files"):
        encode_group(GroupFiles(["a"], [1], [z], ["p", "q"], "c"), codec)
    with pytest.raises(UsageError, match="one xxh3-128 per data file"):
        encode_group(GroupFiles(["a"], [1], [], ["p"], "c"), codec)
    with pytest.raises(UsageError, match="no file of this group"):  # 1: absent in a short group
        rebuild_group(GroupFiles(["a"], [1], [z], ["p"], "c"), codec, {1: z}, table=None)


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
    digests = [_digest(p) for p in data]
    parity = [str(tmp_path / "p0"), str(tmp_path / "p1")]
    spec = GroupFiles([str(p) for p in data], [size] * 3, digests, parity, str(tmp_path / "c"))
    codec = ParityCodec(3, 2, cell)
    tracemalloc.start()
    try:
        written = encode_group(spec, codec)
        peak_encode = tracemalloc.get_traced_memory()[1]
        data[1].unlink()
        table = CellTable.loads((tmp_path / "c").read_bytes(), k=3, m=2, num_data=3,
                                cell_bytes=cell, rows=size // cell, where="c")  # fmt: skip
        tracemalloc.reset_peak()
        rebuild_group(spec, codec, {1: digests[1]}, table=table, durable=False)
        peak_rebuild = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [s for s, _ in written.parity] == [size, size]
    assert _digest(data[1]) == digests[1]
    bound = 20 * cell + (2 << 20)  # a row in, a row out, pyeclib's copies, the digest rows
    assert peak_encode < bound and peak_rebuild < bound, (peak_encode, peak_rebuild)
