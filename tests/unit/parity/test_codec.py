"""ParityCodec: every loss pattern of up to M cells of a row rebuilds byte for byte; M + 1
are refused; the scheme and the cell size are checked."""

from __future__ import annotations

import itertools
import os
import pickle

import pytest

pytest.importorskip("pyeclib")

from shardio.errors import IntegrityError, UsageError
from shardio.parity.codec import ParityCodec, parse_scheme

CELL = 4096


@pytest.mark.parametrize(("k", "m"), [(1, 1), (4, 2), (10, 2), (6, 3)])
def test_every_loss_of_up_to_m_cells_rebuilds_them_exactly(k: int, m: int) -> None:
    codec = ParityCodec(k, m, CELL)
    data = [os.urandom(CELL) for _ in range(k)]
    row = data + codec.encode(data)
    for lost in range(1, m + 1):
        for gone in itertools.combinations(range(k + m), lost):
            cells = [None if i in gone else c for i, c in enumerate(row)]
            assert codec.rebuild(cells) == {i: row[i] for i in gone}, gone


def test_more_losses_than_parity_are_beyond_repair() -> None:
    codec = ParityCodec(4, 2, CELL)
    data = [os.urandom(CELL) for _ in range(4)]
    row: list[bytes | None] = [*data, *codec.encode(data)]
    row[0] = row[2] = row[5] = None
    with pytest.raises(IntegrityError, match="more than the 2 parity can rebuild"):
        codec.rebuild(row)


def test_only_the_wanted_cells_are_rebuilt_from_k_present() -> None:
    codec = ParityCodec(4, 2, CELL)
    data = [os.urandom(CELL) for _ in range(4)]
    parity = codec.encode(data)
    row = [None, data[1], data[2], data[3], parity[0], None]  # parity 1 not read
    assert codec.rebuild(row, wanted=[0]) == {0: data[0]}
    with pytest.raises(UsageError, match="missing indices"):
        codec.rebuild(row, wanted=[1])


def test_a_zero_row_has_zero_parity() -> None:
    """What lets parity files stop at the group's longest data file."""
    codec = ParityCodec(5, 2, CELL)
    assert codec.encode([bytes(CELL)] * 5) == [bytes(CELL)] * 2


def test_the_codec_pickles() -> None:
    codec = pickle.loads(pickle.dumps(ParityCodec(3, 1, 8192)))
    data = [os.urandom(8192) for _ in range(3)]
    assert codec.rebuild([None, *data[1:], *codec.encode(data)]) == {0: data[0]}


@pytest.mark.parametrize(
    ("text", "expected"), [("10+2", (10, 2)), (" 4+1 ", (4, 1)), ("64+16", (64, 16))]
)
def test_schemes_parse(text: str, expected: tuple[int, int]) -> None:
    assert parse_scheme(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        *("", "10", "10+", "+2", "0+1", "10+0", "2+3", "65+1", "10+17", "1e1+2"),
        "\u0661\u0660+\u0662",  # Arabic-Indic digits: ASCII only
        12,
        None,
    ],
)
def test_bad_schemes_are_one_line_errors(text: object) -> None:
    with pytest.raises(UsageError, match="parity scheme"):
        parse_scheme(text)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((0, 1, CELL), "K"),
        ((4, 0, CELL), "M"),
        ((2, 3, CELL), "at most the data shards"),
        ((4, 2, 1000), "at least 4096"),
        ((4, 2, 4096 + 512), "multiple of 4 KiB"),
        ((4, 2, 1 << 40), "at most"),
        ((4.0, 2, CELL), "integer"),
    ],
)
def test_bad_codec_arguments_are_refused(args: tuple[object, ...], match: str) -> None:
    with pytest.raises(UsageError, match=match):
        ParityCodec(*args)  # type: ignore[arg-type]


def test_a_cell_of_another_size_is_refused() -> None:
    codec = ParityCodec(2, 1, CELL)
    with pytest.raises(UsageError, match="a cell is 4096 bytes"):
        codec.encode([bytes(CELL), bytes(100)])
