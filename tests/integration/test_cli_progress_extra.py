"""Progress of ``shardio unpack`` and ``shardio merge``, and the pack-time layout in inspect.

The progress callbacks of :func:`unpack_dataset` and :func:`merge_parts` end with a snapshot
whose totals are what was unpacked or merged; the CLI draws a bar when stderr is a terminal
(a real pseudo-terminal here) and nothing with ``--no-progress``. ``shardio inspect`` shows
the stripe layout the manifest recorded at pack time (packed with the recording fake ``lfs``)
beside the filesystem it runs on now, and says "not recorded" when the manifest has none.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import select
import shutil
import subprocess
import sys
import time

import pytest
from trees import tree_files

from shardio.errors import ChecksumMismatchError
from shardio.format.manifest import load_manifest
from shardio.metrics.progress import ProgressSnapshot
from shardio.packing.merge import merge_parts
from shardio.tools.unpack import unpack_dataset

GOLDEN_V1 = pathlib.Path(__file__).resolve().parents[1] / "data" / "format_v1" / "tar"
W1 = ("--workers", "1", "--no-progress")


# --------------------------------------------------------------------------- helpers


def run_on_tty(*args: str | os.PathLike[str], timeout_s: float = 120.0) -> tuple[int, str, str]:
    """Run ``python -m shardio ARGS`` with stderr on a pseudo-terminal, as a person would.

    Returns (exit code, stdout, what reached the terminal).
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SHARDIO_FAKE_"))}
    env.pop("PYTHONWARNINGS", None)
    master, slave = os.openpty()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "shardio", *map(os.fspath, args)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=slave,
            env=env,
        )
    finally:
        os.close(slave)  # the child holds its own copy: EIO on read once it is gone
    tty = bytearray()
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            assert time.monotonic() < deadline, f"shardio {args} did not finish"
            ready, _, _ = select.select([master], [], [], 0.2)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every writer of the terminal has closed it
                break
            if not data:
                break
            tty += data
        assert proc.stdout is not None
        out = proc.stdout.read().decode("utf-8", "replace")
        rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    return rc, out, tty.decode("utf-8", "replace")


def final_of(snaps: list[ProgressSnapshot]) -> ProgressSnapshot:
    """The one final snapshot, which must be the last."""
    assert snaps, "the progress callback was never called"
    assert [s.final for s in snaps].count(True) == 1, snaps
    assert snaps[-1].final
    return snaps[-1]


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """Twelve small files in two classes, of different sizes."""
    src = tmp_path_factory.mktemp("tree") / "src"
    for cls in ("cat", "dog"):
        (src / cls).mkdir(parents=True)
        for i in range(6):
            (src / cls / f"{cls}_{i}.jpg").write_bytes(os.urandom(2000 + 700 * i))
    return src


@pytest.fixture(scope="module")
def packed(tree: pathlib.Path, tmp_path_factory: pytest.TempPathFactory, run_cli) -> pathlib.Path:
    """The tree packed into several 8 KiB shards; read-only by convention."""
    dst = tmp_path_factory.mktemp("packed") / "ds"
    rc, _, err = run_cli("pack", tree, dst, "--shard-size", "8KiB", *W1)
    assert rc == 0, err
    return dst


@pytest.fixture(scope="module")
def parts(tree: pathlib.Path, tmp_path_factory: pytest.TempPathFactory, run_cli) -> pathlib.Path:
    """The tree packed as parts 0/2 and 1/2, not merged; copy before merging."""
    dst = tmp_path_factory.mktemp("parts") / "ds"
    for part in ("0/2", "1/2"):
        rc, _, err = run_cli("pack", tree, dst, "--part", part, "--shard-size", "8KiB", *W1)
        assert rc == 0, err
    assert not (dst / "manifest.json").exists()
    return dst


@pytest.fixture
def unmerged(parts: pathlib.Path, tmp_path: pathlib.Path) -> pathlib.Path:
    dst = tmp_path / "ds"
    shutil.copytree(parts, dst)
    return dst


# --------------------------------------------------------------------------- unpack


def test_unpack_progress_ends_with_the_totals_unpacked(
    packed: pathlib.Path, tree: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    snaps: list[ProgressSnapshot] = []
    result = unpack_dataset(packed, tmp_path / "out", progress=snaps.append)
    final = final_of(snaps)
    files = tree_files(tree)
    assert result.files == len(files) == final.files_done == final.files_total
    assert result.bytes == sum(map(len, files.values())) == final.bytes_done == final.bytes_total
    for s in snaps:
        assert (s.files_total, s.bytes_total) == (final.files_total, final.bytes_total)
        assert 0 <= s.files_done <= s.files_total and 0 <= s.bytes_done <= s.bytes_total


def test_a_failed_unpack_sends_no_final_snapshot(
    packed: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    damaged = tmp_path / "ds"
    shutil.copytree(packed, damaged)
    shard = sorted((damaged / "shards").glob("*.tar"))[-1]
    data = bytearray(shard.read_bytes())
    data[600] ^= 0xFF  # inside the first member
    shard.write_bytes(bytes(data))
    snaps: list[ProgressSnapshot] = []
    with pytest.raises(ChecksumMismatchError):
        unpack_dataset(damaged, tmp_path / "out", progress=snaps.append)
    assert not any(s.final for s in snaps)
    assert not (tmp_path / "out").exists()


def test_unpack_draws_progress_on_a_terminal(packed: pathlib.Path, tmp_path: pathlib.Path) -> None:
    rc, out, tty = run_on_tty("unpack", packed, tmp_path / "out")
    assert rc == 0, tty
    assert "unpacking [" in tty
    assert "12/12 files" in tty  # the final line: everything done
    assert out.startswith("unpacked 12 files"), out  # the summary, unchanged, on stdout


def test_unpack_no_progress_draws_nothing(packed: pathlib.Path, tmp_path: pathlib.Path) -> None:
    rc, out, tty = run_on_tty("unpack", packed, tmp_path / "out", "--no-progress")
    assert (rc, tty) == (0, "")
    assert out.startswith("unpacked 12 files"), out


# --------------------------------------------------------------------------- merge


def test_merge_progress_ends_with_the_totals_merged(unmerged: pathlib.Path) -> None:
    snaps: list[ProgressSnapshot] = []
    result = merge_parts(str(unmerged), progress=snaps.append)
    final = final_of(snaps)
    man = result.manifest
    assert len(man.shards) > 2  # both parts hold shards
    assert final.files_done == final.files_total == len(man.shards)
    assert final.bytes_done == final.bytes_total == man.total_bytes
    assert man.total_bytes == sum(p.stat().st_size for p in (unmerged / "shards").glob("*.tar"))


def test_merge_draws_progress_on_a_terminal(unmerged: pathlib.Path) -> None:
    shards = len(list((unmerged / "shards").glob("*.tar")))
    rc, out, tty = run_on_tty("merge", unmerged)
    assert rc == 0, tty
    assert "merging [" in tty
    assert f"{shards}/{shards} shards" in tty
    assert out.startswith(f"merged 2 parts into {unmerged}: 12 samples"), out


def test_merge_no_progress_draws_nothing(unmerged: pathlib.Path) -> None:
    rc, out, tty = run_on_tty("merge", unmerged, "--no-progress")
    assert (rc, tty) == (0, "")
    assert out.startswith("merged 2 parts"), out


# --------------------------------------------------------------------------- inspect


def _layout_lines(out: str) -> list[str]:
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("stripe layout "))
    return lines[at : at + 2]


def test_inspect_shows_the_layout_recorded_at_pack_time(
    tree: pathlib.Path, tmp_path: pathlib.Path, run_cli, lustre_env
) -> None:
    env, log = lustre_env
    dst = tmp_path / "ds"
    rc, _, err = run_cli(
        "pack", tree, dst, "--fs-type", "lustre", "--stripe", "8x4MiB", *W1, env=env
    )
    assert (rc, err) == (0, ""), err
    assert "setstripe" in log.read_text()  # the fake really set it
    rc, out, err = run_cli("inspect", dst)
    assert (rc, err) == (0, ""), err
    at_pack, now = _layout_lines(out)
    assert at_pack == (
        "stripe layout at pack time:   lustre, stripe count 8, stripe size 4 MiB (set by shardio)"
    )
    assert now.startswith("              filesystem now: "), now  # where inspect runs
    assert "lustre" not in now  # pytest's tmp_path is on no Lustre

    rc, out, err = run_cli("inspect", dst, "--json")
    assert (rc, err) == (0, ""), err
    info = json.loads(out)
    recorded = json.loads((dst / "manifest.json").read_text())["layout"]
    assert info["pack_layout"] == recorded
    assert info["pack_layout"]["stripe"] == "8x4MiB"
    assert info["filesystem"] != "lustre"


def test_inspect_shows_a_layout_shardio_could_not_set(
    tree: pathlib.Path, tmp_path: pathlib.Path, run_cli, lustre_env
) -> None:
    env, _ = lustre_env
    env["SHARDIO_FAKE_RC"] = "1"
    dst = tmp_path / "ds"
    rc, _, err = run_cli(
        "pack", tree, dst, "--fs-type", "lustre", "--stripe", "4x1MiB", *W1, env=env
    )
    assert rc == 0, err
    rc, out, err = run_cli("inspect", dst)
    assert (rc, err) == (0, ""), err
    at_pack = _layout_lines(out)[0]
    assert at_pack.startswith(
        "stripe layout at pack time:   lustre, the filesystem's default layout: "
        "shardio could not set one (lfs setstripe -c 4 -S 1M"
    ), at_pack
    assert "set by shardio" not in at_pack


def test_inspect_says_not_recorded_for_an_empty_layout(
    packed: pathlib.Path, tmp_path: pathlib.Path, run_cli
) -> None:
    dst = tmp_path / "ds"
    shutil.copytree(packed, dst)
    man = load_manifest(dst / "manifest.json")
    assert man.layout  # today's pack records one
    (dst / "manifest.json").write_bytes(dataclasses.replace(man, layout={}).dumps())
    rc, _, err = run_cli("verify", dst, "--no-progress")
    assert rc == 0, err  # still a valid dataset, its manifest checksum right
    rc, out, err = run_cli("inspect", dst)
    assert (rc, err) == (0, ""), err
    assert _layout_lines(out)[0] == "stripe layout at pack time:   not recorded"
    rc, out, err = run_cli("inspect", dst, "--json")
    assert (rc, err) == (0, ""), err
    assert json.loads(out)["pack_layout"] is None


def test_inspect_reads_an_older_manifest_without_a_layout(tmp_path: pathlib.Path, run_cli) -> None:
    dst = tmp_path / "v1"
    shutil.copytree(GOLDEN_V1, dst)
    rc, out, err = run_cli("inspect", dst)
    assert (rc, err) == (0, ""), err
    assert _layout_lines(out)[0] == "stripe layout at pack time:   local, no striping"

    doc = json.loads((dst / "manifest.json").read_text())
    assert doc["format_version"] == 1  # no checksum of its own: the key can go
    del doc["layout"]
    (dst / "manifest.json").write_text(json.dumps(doc, indent=1) + "\n")
    rc, out, err = run_cli("inspect", dst)
    assert (rc, err) == (0, ""), err
    assert _layout_lines(out)[0] == "stripe layout at pack time:   not recorded"
    rc, out, err = run_cli("inspect", dst, "--json")
    assert (rc, err) == (0, ""), err
    assert json.loads(out)["pack_layout"] is None
