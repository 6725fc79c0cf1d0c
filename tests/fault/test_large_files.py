"""Large source files stream through the writer: memory stays flat, and a file whose size
changes during the pack is rolled back out of the shard and reported (or, under --strict,
fails the pack)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import xxhash

from shardio.errors import PackError
from shardio.format.index import Index
from shardio.packing import scan
from shardio.packing.run import PackOptions, pack

MiB = 1024 * 1024

# Packs through the Python API in a fresh interpreter and prints its own peak RSS.
PEAK_RSS = r"""
import sys
from shardio.packing.run import PackOptions, pack
src, dst, fmt = sys.argv[1:4]
pack(src, dst, PackOptions(shard_format=fmt, shard_size_bytes=64 << 20, durable=False,
                           fs_type="local"))
for line in open("/proc/self/status"):
    if line.startswith("VmHWM:"):
        print(int(line.split()[1]) * 1024)
"""


def _peak_rss(src: pathlib.Path, dst: pathlib.Path, fmt: str) -> int:
    proc = subprocess.run(
        [sys.executable, "-c", PEAK_RSS, str(src), str(dst), fmt],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return int(proc.stdout.strip().splitlines()[-1])


def _hash_slice(path: pathlib.Path, offset: int, size: int) -> int:
    hasher = xxhash.xxh3_64()
    with open(path, "rb") as fh:
        fh.seek(offset)
        left = size
        while left:
            chunk = fh.read(min(left, 8 * MiB))
            assert chunk, "the shard ends inside the member"
            hasher.update(chunk)
            left -= len(chunk)
    return hasher.intdigest()


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["tar", "hdf5"])
def test_a_file_larger_than_memory_allows_packs_in_flat_memory(
    fmt: str, tmp_path: pathlib.Path
) -> None:
    size = 512 * MiB
    small = tmp_path / "small"
    (small / "c").mkdir(parents=True)
    (small / "c" / "a.bin").write_bytes(b"x" * 1000)
    baseline = _peak_rss(small, tmp_path / "ds-small", fmt)

    src = tmp_path / "src"
    (src / "c").mkdir(parents=True)
    (src / "c" / "a.bin").write_bytes(b"x" * 1000)
    huge = src / "c" / "huge.bin"
    with open(huge, "wb") as fh:
        fh.write(b"head")
    os.truncate(huge, size)  # sparse: a large file that costs no disk to make
    dst = tmp_path / "ds"
    peak = _peak_rss(src, dst, fmt)
    assert peak - baseline < 64 * MiB, f"peak RSS grew by {(peak - baseline) // MiB} MiB"
    assert peak < size // 2

    expected = xxhash.xxh3_64()
    expected.update(b"head")
    zeros = bytes(8 * MiB)
    left = size - 4
    while left:
        expected.update(zeros[: min(left, len(zeros))])
        left -= min(left, len(zeros))
    index = Index.open(dst / "index.bin")
    try:
        [m] = [m for m in range(len(index.members)) if index.member_path(m) == b"c/huge.bin"]
        rec = index.members[m]
        shard = dst / "shards" / f"shard-000001.{'tar' if fmt == 'tar' else 'h5'}"
        assert int(rec["size"]) == size
        assert int(rec["xxh3_64"]) == expected.intdigest()
        assert _hash_slice(shard, int(rec["offset"]), size) == expected.intdigest()
    finally:
        index.close()


@pytest.fixture
def tree(tmp_path: pathlib.Path) -> pathlib.Path:
    src = tmp_path / "src"
    (src / "c").mkdir(parents=True)
    for name, n in (("a.bin", 3000), ("b.bin", 20_000), ("b.json", 40), ("d.bin", 5000)):
        (src / "c" / name).write_bytes(os.urandom(n))
    return src


def _lie_about(monkeypatch: pytest.MonkeyPatch, rel: bytes, planned: int) -> None:
    """Make the scan plan ``rel`` at ``planned`` bytes: as if it changed after the stat."""
    real = scan._classify

    def classify(path: bytes, kind: str) -> tuple[int, int, str | None]:
        size, mtime, reason = real(path, kind)
        return (planned, mtime, reason) if path.endswith(rel) else (size, mtime, reason)

    monkeypatch.setattr(scan, "_classify", classify)


@pytest.mark.parametrize("fmt", ["tar", "hdf5"])
@pytest.mark.parametrize("delta", [-1000, +1000])
@pytest.mark.parametrize("streamed", [True, False])
def test_a_file_that_changes_size_is_skipped_and_reported(
    fmt: str,
    delta: int,
    streamed: bool,
    tree: pathlib.Path,
    tmp_path: pathlib.Path,
    monkeypatch: pytest.MonkeyPatch,
    run_cli,
) -> None:
    threshold = 4096 if streamed else 1 << 24
    options = PackOptions(
        shard_format=fmt, durable=False, fs_type="local", stream_threshold_bytes=threshold
    )
    _lie_about(monkeypatch, b"c/b.bin", 20_000 + delta)
    dst = tmp_path / "ds"
    result = pack(str(tree), str(dst), options)
    monkeypatch.undo()
    reason = "changed size during the pack (planned"
    assert [(s.path, s.reason[: len(reason)]) for s in result.skipped] == [(b"c/b.bin", reason)]
    assert result.num_files == 3
    rc, _, err = run_cli("verify", dst, "--workers", "1", "--no-progress")
    assert rc == 0, err
    out = tmp_path / "out"
    rc, _, err = run_cli("unpack", dst, out)
    assert rc == 0, err
    restored = {p.name: p.read_bytes() for p in (out / "c").iterdir()}
    expected = {p.name: p.read_bytes() for p in (tree / "c").iterdir() if p.name != "b.bin"}
    assert restored == expected
    if fmt == "tar":  # rolled back to the byte: the same shard as a tree without the file
        (tree / "c" / "b.bin").unlink()
        ref = tmp_path / "ref"
        pack(str(tree), str(ref), options)
        shard = "shards/shard-000000.tar"
        assert (dst / shard).read_bytes() == (ref / shard).read_bytes()


def test_strict_fails_on_a_file_that_changes_size(
    tree: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _lie_about(monkeypatch, b"c/b.bin", 19_000)
    options = PackOptions(durable=False, strict=True, stream_threshold_bytes=4096)
    dst = tmp_path / "ds"
    with pytest.raises(PackError, match=r"c/b\.bin: changed size during the pack"):
        pack(str(tree), str(dst), options)
    assert not (dst / "manifest.json").exists()
    assert not list(dst.rglob("*.shardio-tmp-*"))
