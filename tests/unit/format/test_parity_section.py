"""The manifest's parity section (format 3): round trip, and every malformed section refused
with a message naming the field (a hand-edited or damaged manifest must not rebuild shards
from the wrong files)."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
from manifests import HASH, sample_manifest, seal_document

from shardio.errors import FormatError
from shardio.format.manifest import Manifest, parse_manifest
from shardio.format.parity import ParityFile, ParityGroup, ParitySection, cells_path, parity_path

SIZES = (10240, 4096)  # the shards of sample_manifest()


def _section(k: int = 1, m: int = 1, **overrides: Any) -> ParitySection:
    groups = []
    for g, first in enumerate(range(0, 2, k)):
        count = min(k, 2 - first)
        longest = max(SIZES[first : first + count])
        groups.append(
            ParityGroup(
                first_shard=first,
                num_shards=count,
                parity=tuple(
                    ParityFile(path=parity_path(g, j), size_bytes=longest, xxh3_128=HASH)
                    for j in range(m)
                ),
                cells=ParityFile(path=cells_path(g), size_bytes=48, xxh3_128=HASH[::-1]),
            )
        )
    fields: dict[str, Any] = {"k": k, "m": m, "cell_bytes": 4096, "backend": "isa_l_rs_vand",
                              "groups": tuple(groups)}  # fmt: skip
    fields.update(overrides)
    return ParitySection(**fields)


def _with_parity(section: ParitySection | None = None) -> Manifest:
    return sample_manifest(parity=section if section is not None else _section(2, 1))


def _doc() -> dict[str, Any]:
    return copy.deepcopy(_with_parity().to_json())


def _fails(doc: Any) -> str:
    with pytest.raises(FormatError) as info:
        parse_manifest(seal_document(doc), where="m.json")
    return str(info.value)


@pytest.mark.parametrize(("k", "m"), [(1, 1), (2, 1), (2, 2), (3, 2)])
def test_round_trip(k: int, m: int) -> None:
    manifest = _with_parity(_section(k, m))
    parsed = parse_manifest(manifest.dumps())
    assert parsed == manifest
    assert parsed.parity is not None and parsed.parity.scheme == f"{k}+{m}"
    assert parsed.parity.group_of(1) == 1 // k
    assert parsed.parity.total_bytes == sum(f.size_bytes for f in parsed.parity.files())


def test_the_json_form() -> None:
    doc = _doc()["parity"]
    assert list(doc) == ["scheme", "k", "m", "cell_bytes", "backend", "total_bytes", "groups"]
    assert doc["groups"][0] == {
        "first_shard": 0,
        "num_shards": 2,
        "parity": [{"path": "parity/group-000000.p0", "size_bytes": 10240, "xxh3_128": HASH}],
        "cells": {"path": "parity/group-000000.cells", "size_bytes": 48, "xxh3_128": HASH[::-1]},
    }


def _edit(path: str, value: Any) -> dict[str, Any]:
    doc = _doc()
    target = doc
    keys = path.split(".")
    for key in keys[:-1]:
        target = target[int(key)] if isinstance(target, list) else target[key]
    last = keys[-1]
    if value is KeyError:
        del target[last]
    elif isinstance(target, list):
        target[int(last)] = value
    else:
        target[last] = value
    return doc


@pytest.mark.parametrize(
    ("path", "value", "needle"),
    [
        ("parity", KeyError, "missing field 'parity'"),
        ("parity", [], "parity must be an object or null"),
        ("parity.k", 0, "does not match k=0"),
        ("parity.k", True, "wrong type"),
        ("parity.m", 3, "does not match"),
        ("parity.scheme", "3+1", "does not match k=2, m=1"),
        ("parity.cell_bytes", 4097, "cell_bytes 4097 is out of range"),
        ("parity.cell_bytes", 1 << 40, "out of range"),
        ("parity.cell_bytes", 64 << 20, "needs more than 256 MiB per row"),
        ("parity.backend", "jerasure_rs_cauchy", "unknown to this shardio"),
        ("parity.total_bytes", 1, "total_bytes does not match"),
        ("parity.groups", {}, "wrong type"),
        ("parity.groups.0", "x", "must be an object"),
        ("parity.groups.0.first_shard", 1, "does not follow groups of 2"),
        ("parity.groups.0.num_shards", 1, "cover 1 shards, the manifest lists 2"),
        ("parity.groups.0.num_shards", 3, "does not follow groups of 2"),
        ("parity.groups.0.parity", [], "has 0 parity files, not 1"),
        ("parity.groups.0.parity.0.size_bytes", -1, "out of range"),
        ("parity.groups.0.parity.0.xxh3_128", "X" * 32, "32 lower-case hex digits"),
        ("parity.groups.0.parity.0.path", "../escape", "should be 'parity/group-000000.p0'"),
        ("parity.groups.0.parity.0.path", "/abs/p0", "should be"),
        ("parity.groups.0.parity.0.path", "shards/shard-000000.tar", "should be"),
        ("parity.groups.0.parity.0.path", "pack-report.json", "should be"),
        ("parity.groups.0.cells.path", "parity/group-000000.p0", "should be"),
        ("parity.groups.0.cells.path", "index.bin", "should be"),
        ("parity.groups.0.cells", None, "wrong type"),
    ],
)
def test_a_malformed_section_is_refused_naming_the_field(
    path: str, value: Any, needle: str
) -> None:
    message = _fails(_edit(path, value))
    assert needle in message, message
    assert message.startswith("m.json")


def test_a_parity_file_not_as_long_as_its_longest_shard_is_refused() -> None:
    doc = _doc()
    doc["parity"]["groups"][0]["parity"][0]["size_bytes"] = 4096
    doc["parity"]["total_bytes"] -= 10240 - 4096
    assert "its group's longest shard is 10240" in _fails(doc)
    with pytest.raises(FormatError, match="parity scheme 3\\+4 is out of range"):
        dataclasses.replace(_section(2, 1), k=3, m=4)


def test_a_group_beyond_the_shards_is_refused() -> None:
    doc = _doc()
    doc["parity"]["groups"].append(copy.deepcopy(doc["parity"]["groups"][0]))
    doc["parity"]["groups"][1]["first_shard"] = 2
    doc["parity"]["groups"][1]["parity"][0]["path"] = "parity/group-000001.p0"
    doc["parity"]["groups"][1]["cells"]["path"] = "parity/group-000001.cells"
    doc["parity"]["total_bytes"] += doc["parity"]["groups"][1]["cells"]["size_bytes"] + 10240
    assert "lists shards the manifest does not have" in _fails(doc)


def test_parity_needs_format_3() -> None:
    with pytest.raises(FormatError, match="parity needs format 3"):
        sample_manifest(parity=_section(2, 1), format_version=2)
    doc = _doc()
    doc["format_version"] = 2  # a format-2 reader's view: the field is simply not read
    parsed = parse_manifest(seal_document(doc))
    assert parsed.parity is None and parsed.format_version == 2


def test_null_parity_is_a_dataset_without_parity() -> None:
    manifest = sample_manifest()
    assert manifest.parity is None
    assert parse_manifest(manifest.dumps()) == manifest


def test_a_tampered_section_fails_the_manifest_checksum() -> None:
    data = _with_parity().dumps().replace(b'"num_shards": 2,\n', b'"num_shards": 1,\n', 1)
    with pytest.raises(FormatError, match="checksum mismatch"):
        parse_manifest(data)


def test_entries_are_frozen() -> None:
    section = _section(2, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        section.k = 3  # type: ignore[misc]
