"""scripts/pfs/moosefs.sh refuses what it must before it creates anything: a wrong command or
count, a directory that is not empty or holds no bed, a path the mount table would escape,
a chunkserver the bed does not have. (The bed itself is exercised by tests/pfs/.)"""

from __future__ import annotations

import pathlib
import subprocess

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "pfs" / "moosefs.sh"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60, check=False
    )


def listing(root: pathlib.Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))


def test_usage_without_arguments_or_with_an_unknown_command(tmp_path: pathlib.Path) -> None:
    for argv in ((), ("up",), ("frobnicate", str(tmp_path / "b"))):
        proc = run(*argv)
        assert proc.returncode == 2, proc
        assert "moosefs.sh up DIR" in proc.stderr
    assert listing(tmp_path) == []


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--chunkservers", "0"], "--chunkservers takes 1 to 8"),
        (["--chunkservers", "9"], "--chunkservers takes 1 to 8"),
        (["--chunkservers", "99999999999999999999"], "--chunkservers takes 1 to 8"),
        (["--ioretries", "123456789012345678901"], "--ioretries takes 1 to 1000"),
        (["--goal", "0"], "--goal takes 1 to 9"),
        (["--chunkservers", "two"], "counts must be whole numbers"),
        (["--ioretries", "-1"], "counts must be whole numbers"),
        (["--goal", "1;reboot"], "counts must be whole numbers"),
        (["--chunkservers"], ""),
        (["--bogus", "1"], "moosefs.sh up DIR"),
    ],
)
def test_up_refuses_bad_counts_before_creating_anything(
    tmp_path: pathlib.Path, extra: list[str], needle: str
) -> None:
    bed = tmp_path / "bed"
    proc = run("up", str(bed), *extra)
    assert proc.returncode != 0
    assert needle in proc.stderr
    assert not bed.exists()


def test_up_refuses_a_directory_that_is_not_empty(tmp_path: pathlib.Path) -> None:
    (tmp_path / "mine.txt").write_text("the user's")
    proc = run("up", str(tmp_path))
    assert proc.returncode == 1
    assert "is not empty" in proc.stderr
    assert listing(tmp_path) == ["mine.txt"]


@pytest.mark.parametrize("name", ["a b", "tab\there", "back\\slash", "new\nline"])
def test_up_refuses_a_path_the_mount_table_would_escape(tmp_path: pathlib.Path, name: str) -> None:
    proc = run("up", str(tmp_path / name))
    assert proc.returncode == 1
    assert "must not contain whitespace or a backslash" in proc.stderr
    assert listing(tmp_path) == []


@pytest.mark.parametrize("command", ["down", "status", "stop-cs", "start-master", "exec"])
def test_commands_on_a_directory_without_a_bed_touch_nothing(
    tmp_path: pathlib.Path, command: str
) -> None:
    (tmp_path / "etc").mkdir()  # looks like a bed's, is not one
    (tmp_path / "etc" / "keep.cfg").write_text("x")
    proc = run(command, str(tmp_path), "1")
    assert proc.returncode == 1
    assert "holds no bed" in proc.stderr
    assert listing(tmp_path) == ["etc", "etc/keep.cfg"]
