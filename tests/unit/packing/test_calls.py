"""Tests for the count of metadata calls a pack makes on its source tree: what the scan and
the writers report matches the tree, ``--part`` runs add up to a whole pack, the counts
reach the part records, the pack report and the CLI summary."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from trees import write_tree

from shardio.errors import FormatError
from shardio.packing.calls import SourceCalls
from shardio.packing.merge import merge_parts
from shardio.packing.run import PackOptions, pack
from shardio.packing.scan import list_tree, resolve_samples
from shardio.packing.workfiles import PartRecord, ShardRecord

CLASSES = 3
PER_CLASS = 7


def _tree(root: Path) -> tuple[str, int]:
    """3 class directories of 7 files (two samples of two files each among them), a symlink
    to a file, a broken symlink, a FIFO and a hidden file outside the layout.

    Returns:
        (SRC, number of regular files plus the symlink to a file: the files packed).
    """
    files = {}
    for c in range(CLASSES):
        for i in range(PER_CLASS):
            files[f"c{c}/s{i}.bin".encode()] = bytes([c]) * (100 + 37 * i)
        files[f"c{c}/s0.txt".encode()] = b"caption"  # a second member of sample s0
    files[b".hidden/x.bin"] = b"not in the label layout"
    src = write_tree(root / "src", files)
    os.symlink("../c0/s1.bin", os.path.join(src, "c1", "link.bin"))
    os.symlink("missing.bin", os.path.join(src, "c2", "broken.bin"))
    os.mkfifo(os.path.join(src, "c2", "pipe.bin"))
    return src, CLASSES * (PER_CLASS + 1) + 1


# Directories: SRC, c0, c1, c2, .hidden. Entries: 4 under SRC, 8+1 / 8+2 / 8+... below.
DIRS = 5
ENTRIES = 4 + 3 * (PER_CLASS + 1) + 3 + 1
STATTED = 3 * (PER_CLASS + 1) + 3  # every listed file in the layout; not the hidden one


def test_the_scan_counts_directories_entries_and_one_stat_per_file(tmp_path: Path) -> None:
    src, _ = _tree(tmp_path)
    calls = SourceCalls()
    listing = list_tree(src, calls=calls)
    assert (calls.dirs_listed, calls.entries_seen, calls.stat_calls) == (DIRS, ENTRIES, 0)
    samples, skipped = resolve_samples(src, listing, listing.groups, calls=calls)
    files = sum(len(s.files) for s in samples)
    assert calls.stat_calls == files + len(skipped) == STATTED
    assert (calls.opens, calls.fstat_calls) == (0, 0)


def test_a_scan_of_some_groups_stats_only_their_files(tmp_path: Path) -> None:
    src, _ = _tree(tmp_path)
    listing = list_tree(src)
    counts = []
    for part in range(3):
        calls = SourceCalls()
        _first, groups = listing.part(part, 3)
        resolve_samples(src, listing, groups, calls=calls)
        counts.append(calls.stat_calls)
        assert calls.stat_calls == sum(len(g.entries) for g in groups)
    assert sum(counts) == STATTED


def test_a_pack_reports_its_calls_in_the_result_and_the_pack_report(tmp_path: Path) -> None:
    src, packed = _tree(tmp_path)
    dst = tmp_path / "out"
    result = pack(src, str(dst), PackOptions(workers=2, shard_size_bytes=4096, durable=False))
    assert result.num_files == packed
    calls = result.source_calls
    assert calls == SourceCalls(
        dirs_listed=DIRS, entries_seen=ENTRIES, stat_calls=STATTED, opens=packed, fstat_calls=0
    )
    assert result.num_shards > 2  # the opens of several worker processes add up
    report = json.loads((dst / "pack-report.json").read_text())
    assert report["source_calls"] == {"total": calls.to_json(), "parts": [calls.to_json()]}
    assert result.merged is not None
    assert result.merged.source_calls == calls


def test_streamed_files_are_opened_once_and_fstat_checked(tmp_path: Path) -> None:
    src, packed = _tree(tmp_path)
    options = PackOptions(durable=False, stream_threshold_bytes=300)  # files > 300 B stream
    result = pack(src, str(tmp_path / "out"), options)
    streamed = sum(1 for i in range(PER_CLASS) if 100 + 37 * i > 300) * CLASSES
    streamed += 1 if 100 + 37 * 1 > 300 else 0  # the symlink to c0/s1.bin
    assert streamed > 0
    assert result.source_calls.opens == packed
    assert result.source_calls.fstat_calls == streamed


def test_part_runs_add_up_to_a_whole_pack(tmp_path: Path) -> None:
    src, packed = _tree(tmp_path)
    whole = pack(src, str(tmp_path / "whole"), PackOptions(durable=False)).source_calls
    dst = tmp_path / "parts"
    parts = [
        pack(src, str(dst), PackOptions(part=i, num_parts=3, durable=False)).source_calls
        for i in range(3)
    ]
    for calls in parts:  # every part lists the whole tree, and stats only its own files
        assert (calls.dirs_listed, calls.entries_seen) == (whole.dirs_listed, whole.entries_seen)
        assert 0 < calls.stat_calls < whole.stat_calls
    assert sum(c.stat_calls for c in parts) == whole.stat_calls == STATTED
    assert sum(c.opens for c in parts) == whole.opens == packed
    merged = merge_parts(str(dst), durable=False)
    assert list(merged.part_calls) == parts
    total = merged.source_calls
    assert total.dirs_listed == 3 * whole.dirs_listed
    assert (total.stat_calls, total.opens) == (whole.stat_calls, whole.opens)
    report = json.loads((dst / "pack-report.json").read_text())
    assert report["source_calls"]["parts"] == [c.to_json() for c in parts]
    assert report["source_calls"]["total"] == total.to_json()


def test_a_resume_counts_only_the_opens_of_the_shards_it_writes(tmp_path: Path) -> None:
    src, _ = _tree(tmp_path)
    dst = tmp_path / "out"
    options = PackOptions(shard_size_bytes=4096, durable=False)
    first = pack(src, str(dst), options)
    # A finished dataset: --resume scans (to compare) and opens nothing.
    again = pack(src, str(dst), PackOptions(shard_size_bytes=4096, durable=False, resume=True))
    assert again.reused_shards == first.num_shards
    assert again.source_calls.stat_calls == first.source_calls.stat_calls
    assert again.source_calls.opens == 0


def test_records_without_counts_load_as_zeros_and_bad_counts_are_refused() -> None:
    doc = {
        "fingerprint": "0" * 32,
        "seq": 0,
        "path": "shards/shard-000000.tar",
        "size_bytes": 1,
        "num_samples": 1,
        "num_members": 1,
        "data_bytes": 1,
        "xxh3_128": "f" * 32,
        "dali_index": None,
        "index_size_bytes": 1,
        "index_xxh3_128": "e" * 32,
        "skipped": [],
    }
    assert ShardRecord.from_json(doc, "rec").source_calls == SourceCalls()
    counted = ShardRecord.from_json({**doc, "source_calls": {"opens": 5}}, "rec")
    assert counted.source_calls == SourceCalls(opens=5)
    assert ShardRecord.from_json(counted.to_json(), "rec") == counted
    for bad in ({"opens": -1}, {"opens": "5"}, [5]):
        with pytest.raises(FormatError, match="source_calls"):
            ShardRecord.from_json({**doc, "source_calls": bad}, "rec")
    assert "source_calls" in PartRecord.__dataclass_fields__


def test_source_calls_add_up() -> None:
    a = SourceCalls(dirs_listed=1, entries_seen=2, stat_calls=3, opens=4, fstat_calls=5)
    b = a.copy()
    b.add(a)
    assert b == SourceCalls(dirs_listed=2, entries_seen=4, stat_calls=6, opens=8, fstat_calls=10)
    assert a.stat_calls == 3  # the copy is independent
    assert SourceCalls.total([a, a, SourceCalls()]) == b
    assert SourceCalls.from_json(b.to_json(), "x") == b


CALLS_LINE = re.compile(
    r"([\d,]+) directory listings \(([\d,]+) entries[^)]*\), ([\d,]+) stat "
    r"calls, ([\d,]+) opens, ([\d,]+) fstat"
)


def _numbers(line: str) -> list[int]:
    m = CALLS_LINE.search(line)
    assert m, line
    return [int(g.replace(",", "")) for g in m.groups()]


def test_the_cli_prints_the_counts_of_pack_and_merge(tmp_path: Path, run_cli) -> None:
    src, packed = _tree(tmp_path)
    dst = tmp_path / "out"
    lines = []
    for i in range(2):
        rc, out, err = run_cli("pack", src, dst, "--part", f"{i}/2", "--no-progress")
        assert rc == 0, err
        (line,) = [x for x in out.splitlines() if x.startswith("source calls:")]
        assert "each part lists the whole tree" in line
        lines.append(_numbers(line))
    rc, out, err = run_cli("merge", dst, "--no-progress")
    assert rc == 0, err
    (line,) = [x for x in out.splitlines() if x.startswith("source calls of the 2 part(s):")]
    total = _numbers(line)
    assert total == [a + b for a, b in zip(*lines, strict=True)]
    assert total[2:] == [STATTED, packed, 0]
    report = json.loads((dst / "pack-report.json").read_text())
    assert list(report["source_calls"]["total"].values()) == total
