"""kill -9 in the middle of ``shardio pack``, then ``--resume``.

Real SIGKILLs of a real ``python -m shardio pack`` subprocess, at several moments (polled on
the files the pack publishes), plus SIGKILLs the process sends itself at exact points (a
driver script patches one function to kill the process there). After each kill: nothing
half-written has a final name, no manifest exists, and ``--resume`` produces a dataset
byte-identical to an uninterrupted pack, reusing the shards whose records were published.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest
from killing import kill_session, run_then_kill, session_pids

SHARD_SIZE = "256KiB"  # the small tree (300 files x ~20 KB) packs into ~27 shards
TIMEOUT_S = 60.0


# --------------------------------------------------------------------------- helpers


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SHARDIO_"))}


def pack_argv(src: pathlib.Path, dst: pathlib.Path, *extra: str, workers: str = "1") -> list[str]:
    return [
        sys.executable, "-m", "shardio", "pack", str(src), str(dst),
        "--shard-size", SHARD_SIZE, "--workers", workers, "--no-progress", *extra,
    ]  # fmt: skip


def dataset_files(dst: pathlib.Path) -> dict[str, bytes]:
    """Every file under dst (hidden ones included), by relative path, with its bytes."""
    return {
        p.relative_to(dst).as_posix(): p.read_bytes() for p in sorted(dst.rglob("*")) if p.is_file()
    }


def _count(folder: pathlib.Path, pattern: str) -> int:
    try:
        return sum(1 for _ in folder.glob(pattern))
    except FileNotFoundError:
        return 0


def shards_at_least(dst: pathlib.Path, k: int, suffix: str = ".tar") -> Callable[[], bool]:
    shards = dst / "shards"

    def check() -> bool:
        try:
            names = os.listdir(shards)
        except FileNotFoundError:
            return False
        return sum(1 for n in names if n.startswith("shard-") and n.endswith(suffix)) >= k

    return check


@dataclass(frozen=True)
class Killed:
    finished: bool  # the pack completed before the kill landed
    shards: int  # shard files published when it died
    records: int  # done-records published when it died (each one a reusable shard)


def run_and_kill(argv: list[str], dst: pathlib.Path, until: Callable[[], bool]) -> Killed:
    """Start ``argv`` in a session of its own, poll until ``until()`` holds, then SIGKILL
    every process of the session (the pack and its workers), as SLURM's scancel does."""
    finished = run_then_kill(argv, until, env=_env(), timeout_s=TIMEOUT_S, poll_s=0.0002)
    return Killed(
        finished=finished,
        shards=_count(dst / "shards", "shard-*.tar") + _count(dst / "shards", "shard-*.h5"),
        records=_count(dst / ".shardio-work" / "frag", "shard-*.json"),
    )


def assert_complete_tar(path: pathlib.Path) -> None:
    data = path.read_bytes()
    assert len(data) >= 1024, path
    assert len(data) % 512 == 0, f"{path}: {len(data)} bytes is not a multiple of 512"
    assert data[-1024:] == bytes(1024), f"{path}: no end-of-archive blocks"
    with tarfile.open(path) as tf:
        members = tf.getmembers()
    assert members, path
    assert len(members) % 2 == 0, path  # a jpeg and a cls member per sample


def check_killed_state(dst: pathlib.Path, killed: Killed, ref: dict[str, bytes], run_cli) -> None:
    """Nothing half-written has a final name; what is published equals the reference."""
    if killed.finished:
        rc, _, err = run_cli("verify", dst, "--workers", "1", "--no-progress")
        assert rc == 0, err
        return
    assert not (dst / "manifest.json").exists()
    for p in sorted((dst / "shards").glob("shard-*")) if (dst / "shards").exists() else []:
        if p.suffix == ".tar":
            assert_complete_tar(p)
        elif p.suffix == ".h5":
            import h5py

            with h5py.File(p, "r") as f:
                assert f["data"].shape[0] >= int(f.attrs["blob_bytes"])
        assert p.read_bytes() == ref[f"shards/{p.name}"], f"{p.name} differs from the reference"
    frag = dst / ".shardio-work" / "frag"
    for p in sorted(frag.glob("shard-*.json")) if frag.exists() else []:
        assert list((dst / "shards").glob(p.stem + ".*")), f"record {p.name} without its shard"


def resume_and_check(
    src: pathlib.Path,
    dst: pathlib.Path,
    ref: dict[str, bytes],
    run_cli,
    *,
    reused: int | None,
    workers: str = "1",
    extra: tuple[str, ...] = (),
) -> None:
    rc, out, err = run_cli(*pack_argv(src, dst, *extra, "--resume", workers=workers)[3:])
    assert rc == 0, err
    assert "Traceback" not in err
    if reused is None:
        pass  # a dataset that was already complete: no claim about the summary
    elif reused:
        assert f"reused {reused} verified shard(s) from the interrupted pack" in out, out
    else:
        assert "reused" not in out, out
    # Byte-identical to the (verified) uninterrupted pack, so it verifies too.
    got = dataset_files(dst)
    assert sorted(got) == sorted(ref), "file sets differ: " + repr(set(got) ^ set(ref))
    for name, data in ref.items():
        assert got[name] == data, f"{name} differs from the uninterrupted pack"


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def reference(packed_small, run_cli) -> dict[str, bytes]:
    """The files of an uninterrupted pack of the small tree."""
    dst, result = packed_small("tar", SHARD_SIZE, 1)
    assert result.rc == 0, result.stderr
    rc, _, err = run_cli("verify", dst, "--workers", "1", "--no-progress")
    assert rc == 0, err
    files = dataset_files(dst)
    assert sum(1 for n in files if n.endswith(".tar")) >= 20
    return files


# --------------------------------------------------------------------------- real kills


@pytest.mark.parametrize("moment", ["work-dir", "1", "5", "12"])
def test_kill_then_resume_is_byte_identical(
    moment: str, small_tree: pathlib.Path, tmp_path: pathlib.Path, reference, run_cli
) -> None:
    dst = tmp_path / "ds"
    if moment == "work-dir":
        until = (dst / ".shardio-work").exists
    else:
        until = shards_at_least(dst, int(moment))
    killed = run_and_kill(pack_argv(small_tree, dst), dst, until)
    check_killed_state(dst, killed, reference, run_cli)
    if killed.finished:
        pytest.skip("the pack finished before the kill landed")
    if moment.isdigit():
        assert killed.shards >= int(moment)
    resume_and_check(small_tree, dst, reference, run_cli, reused=killed.records)


def test_kill_with_two_workers_then_resume(
    small_tree: pathlib.Path, tmp_path: pathlib.Path, reference, run_cli
) -> None:
    dst = tmp_path / "ds"
    killed = run_and_kill(pack_argv(small_tree, dst, workers="2"), dst, shards_at_least(dst, 8))
    check_killed_state(dst, killed, reference, run_cli)
    if killed.finished:
        pytest.skip("the pack finished before the kill landed")
    # Temp files of the two in-flight shards may be left; resume must clear them.
    resume_and_check(small_tree, dst, reference, run_cli, reused=killed.records, workers="2")


def test_kill_of_the_main_process_leaves_no_worker_behind(
    small_tree: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """kill -9 of the pack process alone (the OOM killer, a user's kill -9): its worker
    processes must not keep running and writing into DST, nor hang around forever."""
    dst = tmp_path / "ds"
    proc = subprocess.Popen(
        pack_argv(small_tree, dst, workers="2"), stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, env=_env(), start_new_session=True,
    )  # fmt: skip
    try:
        until = shards_at_least(dst, 5)
        deadline = time.monotonic() + TIMEOUT_S
        while proc.poll() is None and not until():
            assert time.monotonic() < deadline
            time.sleep(0.0002)
        if proc.poll() is not None:
            pytest.skip("the pack finished before the kill landed")
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 3
        while session_pids(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = session_pids(proc.pid)
        cmdlines = [pathlib.Path(f"/proc/{p}/cmdline").read_bytes()[:80] for p in left]
        assert not left, f"processes left running 3 s after the kill: {cmdlines}"
    finally:
        kill_session(proc.pid)


def test_kill_hdf5_pack_then_resume(
    small_tree: pathlib.Path, tmp_path: pathlib.Path, packed_small, run_cli
) -> None:
    ref_dst, _ = packed_small("hdf5", SHARD_SIZE, 1)
    reference = dataset_files(ref_dst)
    dst = tmp_path / "ds"
    argv = pack_argv(small_tree, dst, "--format", "hdf5")
    killed = run_and_kill(argv, dst, shards_at_least(dst, 6, ".h5"))
    check_killed_state(dst, killed, reference, run_cli)
    if killed.finished:
        pytest.skip("the pack finished before the kill landed")
    assert killed.shards >= 6
    resume_and_check(
        small_tree, dst, reference, run_cli, reused=killed.records, extra=("--format", "hdf5")
    )


def test_kill_during_resume_then_resume_again(
    small_tree: pathlib.Path, tmp_path: pathlib.Path, reference, run_cli
) -> None:
    dst = tmp_path / "ds"
    first = run_and_kill(pack_argv(small_tree, dst), dst, shards_at_least(dst, 4))
    if first.finished:
        pytest.skip("the pack finished before the kill landed")
    second = run_and_kill(
        pack_argv(small_tree, dst, "--resume"), dst, shards_at_least(dst, first.shards + 6)
    )
    check_killed_state(dst, second, reference, run_cli)
    if second.finished:
        pytest.skip("the resumed pack finished before the kill landed")
    assert second.records >= first.records
    resume_and_check(small_tree, dst, reference, run_cli, reused=second.records)


def _flip(path: pathlib.Path, offset: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0x01]))


def test_resume_rewrites_a_corrupted_published_shard(
    small_tree: pathlib.Path, tmp_path: pathlib.Path, reference, run_cli
) -> None:
    dst = tmp_path / "ds"
    killed = run_and_kill(pack_argv(small_tree, dst), dst, shards_at_least(dst, 6))
    if killed.finished:
        pytest.skip("the pack finished before the kill landed")
    assert killed.records >= 3
    _flip(dst / "shards/shard-000001.tar", 4000)  # inside a member
    os.truncate(dst / "shards/shard-000002.tar", 10_000)  # size no longer matches the record

    rc, out, err = run_cli(*pack_argv(small_tree, dst, "--resume")[3:])
    assert rc == 0, err
    assert f"reused {killed.records - 2} verified shard(s)" in out, out
    assert "shard shards/shard-000001.tar is damaged: writing it again" in err, err
    rc, _, err = run_cli("verify", dst, "--workers", "1", "--no-progress")
    assert rc == 0, err
    assert dataset_files(dst) == reference


def test_resume_refuses_a_changed_source_or_changed_options(
    small_tree: pathlib.Path, tmp_path: pathlib.Path, run_cli, assert_cli_error
) -> None:
    """Each change (a file added, removed or grown; another --shard-size) makes --resume
    fail with one line and change nothing; --force then starts over."""
    src = tmp_path / "src"
    shutil.copytree(small_tree, src)
    dst = tmp_path / "ds"
    killed = run_and_kill(pack_argv(src, dst), dst, shards_at_least(dst, 5))
    if killed.finished:
        pytest.skip("the pack finished before the kill landed")
    interrupted = dataset_files(dst)
    files = sorted((src / "train").rglob("*.JPEG"))
    added = files[0].parent / "extra_1.JPEG"
    removed, grown = files[-1], files[-2]
    aside = tmp_path / "aside.JPEG"
    grown_stat = grown.stat()

    def add() -> None:
        added.write_bytes(files[0].read_bytes())

    def unadd() -> None:
        added.unlink()

    def remove() -> None:
        removed.rename(aside)

    def unremove() -> None:
        aside.rename(removed)

    def grow() -> None:
        with open(grown, "ab") as fh:
            fh.write(b"more")

    def ungrow() -> None:
        os.truncate(grown, grown_stat.st_size)
        os.utime(grown, ns=(grown_stat.st_atime_ns, grown_stat.st_mtime_ns))

    resume = pack_argv(src, dst, "--resume")[3:]
    other_size = [a if a != SHARD_SIZE else "512KiB" for a in resume]
    cases = [
        ("a file added", add, unadd, resume),
        ("a file removed", remove, unremove, resume),
        ("a file grown", grow, ungrow, resume),
        ("another --shard-size", lambda: None, lambda: None, other_size),
    ]
    for what, change, undo, argv in cases:
        change()
        try:
            result = run_cli(*argv)
            assert result.rc == 1, f"{what}: {result}"
            assert_cli_error(result, "the source or the options changed", str(dst))
            assert dataset_files(dst) == interrupted, f"{what}: the failed resume wrote"
        finally:
            undo()

    # --force starts over from the changed source.
    add()
    rc, _, err = run_cli(*pack_argv(src, dst, "--force")[3:])
    assert rc == 0, err
    rc, _, err = run_cli("verify", dst, "--workers", "1", "--no-progress")
    assert rc == 0, err
    rc, out, _ = run_cli("ls", dst)
    assert len(out.splitlines()) == 301


def test_resume_after_a_same_size_edit_of_the_source_fails_clearly(
    small_tree: pathlib.Path, tmp_path: pathlib.Path, run_cli, assert_cli_error
) -> None:
    """A file rewritten in place with the same size (new content, new mtime) is a changed
    source too: reusing the shard that holds the old bytes would mix two versions."""
    src = tmp_path / "src"
    shutil.copytree(small_tree, src)
    dst = tmp_path / "ds"
    killed = run_and_kill(pack_argv(src, dst), dst, shards_at_least(dst, 5))
    if killed.finished:
        pytest.skip("the pack finished before the kill landed")
    first = sorted((src / "train").rglob("*.JPEG"))[0]  # packed into shard-000000
    data = bytearray(first.read_bytes())
    data[-10] ^= 0xFF
    first.write_bytes(bytes(data))
    os.utime(first, ns=(time.time_ns(), time.time_ns() + 10**9))

    result = run_cli(*pack_argv(src, dst, "--resume")[3:])
    assert result.rc == 1, "resume reused shards holding the old bytes: " + result.stdout
    assert_cli_error(result, "the source or the options changed")


# --------------------------------------------------------------------------- exact kill points

# Runs the CLI with one function patched to SIGKILL the process at an exact point.
DRIVER = r"""
import os, signal, sys

def die():
    os.kill(os.getpid(), signal.SIGKILL)

point = sys.argv[1]
if point == "mid-shard-write":
    real_writev, calls = os.writev, [0]
    def writev(fd, buffers):
        calls[0] += 1
        if calls[0] == 4:  # the 4th shard: half of it reaches the temp file
            real_writev(fd, [bytes(memoryview(buffers[0])[:200])])
            die()
        return real_writev(fd, buffers)
    os.writev = writev
elif point == "shard-published-no-record":
    import shardio.packing.write as pack
    real_idx, calls = pack.dali_index_text, [0]
    def dali_index_text(samples):
        calls[0] += 1
        if calls[0] == 4:  # the 4th shard is published, its .idx and record are not
            die()
        return real_idx(samples)
    pack.dali_index_text = dali_index_text
elif point == "mid-index-write":
    import shardio.packing.merge as merge
    def merge_indexes(fh, parts, *, n_shards):
        fh.write(b"SHRDIDX\0 half an index")
        fh.flush()
        die()
    merge.merge_indexes = merge_indexes
elif point == "after-manifest":
    import shardio.packing.merge as merge
    def remove_work_dir(dst, **kwargs):
        die()
    merge.remove_work_dir = remove_work_dir
else:
    raise SystemExit(f"unknown kill point {point}")

from shardio.cli.main import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.parametrize(
    ("point", "reused"),
    [
        ("mid-shard-write", 3),
        ("shard-published-no-record", 3),
        ("mid-index-write", 27),
        ("after-manifest", None),
    ],
)
def test_kill_at_exact_point_then_resume(
    point: str,
    reused: int | None,
    small_tree: pathlib.Path,
    tmp_path: pathlib.Path,
    reference,
    run_cli,
) -> None:
    dst = tmp_path / "ds"
    n_shards = sum(1 for n in reference if n.endswith(".tar"))
    if reused is not None:
        reused = min(reused, n_shards)
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, point, *pack_argv(small_tree, dst)[3:]],
        capture_output=True, env=_env(), timeout=TIMEOUT_S, check=False,
    )  # fmt: skip
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    if point != "after-manifest":
        killed = Killed(
            False,
            _count(dst / "shards", "shard-*.tar"),
            _count(dst / ".shardio-work/frag", "shard-*.json"),
        )
        check_killed_state(dst, killed, reference, run_cli)
    else:
        assert (dst / "manifest.json").exists()
        assert (dst / ".shardio-work").exists()
    resume_and_check(small_tree, dst, reference, run_cli, reused=reused)


# --------------------------------------------------------------------------- finished datasets


def test_resume_of_a_finished_dataset_checks_source_and_options(
    small_tree: pathlib.Path, tmp_path: pathlib.Path, run_cli, assert_cli_error
) -> None:
    """--resume on a complete dataset is a no-op only if the tree and options still give
    the plan recorded in its manifest; otherwise it refuses and changes nothing."""
    src = tmp_path / "src"
    shutil.copytree(small_tree, src)
    dst = tmp_path / "ds"
    rc, _, err = run_cli(*pack_argv(src, dst)[3:])
    assert rc == 0, err
    packed = dataset_files(dst)

    rc, out, err = run_cli(*pack_argv(src, dst, "--resume")[3:])
    assert rc == 0, err
    assert f"{dst} was already complete: nothing to resume" in out
    assert dataset_files(dst) == packed

    files = sorted((src / "train").rglob("*.JPEG"))
    edited = files[3]
    data = bytearray(edited.read_bytes())
    data[-5] ^= 0xFF
    stat_before = edited.stat()

    def same_size_edit() -> None:
        edited.write_bytes(bytes(data))
        os.utime(edited, ns=(time.time_ns(), stat_before.st_mtime_ns + 10**9))

    def undo_edit() -> None:
        data[-5] ^= 0xFF
        edited.write_bytes(bytes(data))
        os.utime(edited, ns=(stat_before.st_atime_ns, stat_before.st_mtime_ns))

    added = files[0].parent / "extra_1.JPEG"
    resume = pack_argv(src, dst, "--resume")[3:]
    cases = [
        ("a file added", lambda: added.write_bytes(b"new"), added.unlink, resume),
        ("a same-size edit", same_size_edit, undo_edit, resume),
        ("another --shard-size", lambda: None, lambda: None, [*resume, "--shard-size", "1MiB"]),
        ("another --format", lambda: None, lambda: None, [*resume, "--format", "hdf5"]),
        ("another split", lambda: None, lambda: None, [*resume, "--part", "0/2"]),
    ]
    for what, change, undo, argv in cases:
        change()
        try:
            result = run_cli(*argv)
            assert result.rc == 1, f"{what}: {result}"
            assert_cli_error(result, "the source or the options changed since", str(dst))
            assert dataset_files(dst) == packed, f"{what}: the refused resume wrote"
        finally:
            undo()
    rc, _, err = run_cli(*resume)
    assert rc == 0, err


def test_resume_of_a_dataset_that_recorded_no_plan_refuses(
    tmp_path: pathlib.Path, small_tree: pathlib.Path, run_cli, assert_cli_error
) -> None:
    """A format-1 dataset has no pack fingerprints: --resume cannot check it."""
    golden = pathlib.Path(__file__).resolve().parents[1] / "data" / "format_v1" / "tar"
    dst = tmp_path / "ds"
    shutil.copytree(golden, dst)
    before = dataset_files(dst)
    result = run_cli("pack", small_tree, dst, "--resume", "--no-progress")
    assert result.rc == 1
    assert_cli_error(result, str(dst), "cannot check", "--force")
    assert dataset_files(dst) == before
