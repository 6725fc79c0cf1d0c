"""Tests for the reversible mapping of source names to WebDataset keys and extensions."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardio.format.keys import decode_component, encode_component, split_name

ODD_NAMES = [
    b"plain",
    b"several.dots.in.it",
    b"with space",
    b"  leading and trailing  ",
    "caf\u00e9 \u65e5\u672c".encode(),
    b"latin1-\xe9-not-utf8-\xff\xfe",
    b"100%",
    b"%41",  # must not decode to "A"
    b"tab\tnew\nline",
    b".hidden",
    b"trailing.",
    b"\x01\x7f\x80",
    bytes(range(1, 256)),
]


@pytest.mark.parametrize("raw", ODD_NAMES)
def test_round_trip_and_no_dot_or_space(raw: bytes) -> None:
    encoded = encode_component(raw)
    assert decode_component(encoded) == raw
    assert "." not in encoded
    assert " " not in encoded
    assert "/" not in encoded
    assert encoded.isascii()
    assert encoded.isprintable()


def test_safe_characters_stay_readable() -> None:
    assert encode_component(b"n01440764_10026") == "n01440764_10026"
    assert encode_component(b"a-b+c,d=e@f~g") == "a-b+c,d=e@f~g"


def test_unsafe_bytes_are_upper_case_percent_escapes() -> None:
    assert encode_component(b"a.b") == "a%2Eb"
    assert encode_component(b"a b") == "a%20b"
    assert encode_component(b"100%") == "100%25"
    assert encode_component(b"\xff") == "%FF"
    assert encode_component("\u00e9".encode()) == "%C3%A9"


def test_distinct_inputs_give_distinct_keys() -> None:
    encoded = [encode_component(n) for n in ODD_NAMES]
    assert len(set(encoded)) == len(ODD_NAMES)


def test_slash_is_escaped_unless_kept() -> None:
    assert encode_component(b"train/n01 x/a.b") == "train%2Fn01%20x%2Fa%2Eb"
    kept = encode_component(b"train/n01 x/a.b", keep_slash=True)
    assert kept == "train/n01%20x/a%2Eb"
    assert decode_component(kept) == b"train/n01 x/a.b"


@pytest.mark.parametrize("raw", [b"a/b", b"\xff/\xfe.x/y z", b"deep/er/still/deeper"])
def test_keep_slash_round_trip(raw: bytes) -> None:
    encoded = encode_component(raw, keep_slash=True)
    assert encoded.count("/") == raw.count(b"/")
    assert "." not in encoded and " " not in encoded
    assert decode_component(encoded) == raw


@given(st.binary(max_size=64))
def test_round_trip_any_bytes(raw: bytes) -> None:
    encoded = encode_component(raw)
    assert decode_component(encoded) == raw
    assert not set(encoded) & {".", " ", "/", "\0"}


@given(st.lists(st.binary(min_size=1, max_size=16).filter(lambda b: b"/" not in b), max_size=4))
def test_keep_slash_round_trip_any_bytes(parts: list[bytes]) -> None:
    raw = b"/".join(parts)
    assert decode_component(encode_component(raw, keep_slash=True)) == raw


@pytest.mark.parametrize(
    ("name", "stem", "ext"),
    [
        (b"a.jpg", b"a", b"jpg"),
        (b"a.b.c.JPEG", b"a.b.c", b"JPEG"),
        (b"noext", b"noext", b""),
        (b".hidden", b".hidden", b""),
        (b".hidden.txt", b".hidden", b"txt"),
        (b"trailing.", b"trailing.", b""),
        (b"two..dots", b"two.", b"dots"),
        (b"..x", b".", b"x"),
        (b"..", b"..", b""),
        (b"a b.c d", b"a b", b"c d"),
        (b"\xff.\xfe", b"\xff", b"\xfe"),
    ],
)
def test_split_name(name: bytes, stem: bytes, ext: bytes) -> None:
    assert split_name(name) == (stem, ext)
