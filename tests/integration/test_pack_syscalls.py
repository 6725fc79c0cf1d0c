"""The metadata calls a pack reports, checked against strace: every stat and open of the
source tree that the kernel sees is one the pack counted, and none is made twice."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
from stracing import STRACE, run_traced
from trees import write_tree

OPEN_CALLS = {"open", "openat", "openat2"}
STAT_CALLS = {"stat", "lstat", "fstat", "newfstatat", "fstatat64", "statx"}
TRACED = ",".join(sorted(OPEN_CALLS | STAT_CALLS))
CLASSES, PER_CLASS = 4, 25
STREAM_THRESHOLD = 2048  # files above it are streamed (opened, then fstat'ed)

SYSCALL = re.compile(r"^\d+\s+(?P<name>\w+)\((?P<args>.*)$")
QUOTED = re.compile(r'"((?:[^"\\]|\\.)*)"')
FD_PATH = re.compile(r"^(?:AT_FDCWD|\d+)<([^>]*)>")

SCRIPT = r"""
import json, sys
from shardio.packing.run import PackOptions, pack
options = PackOptions(workers=2, shard_size_bytes=16384, durable=False,
                      stream_threshold_bytes=int(sys.argv[3]))
result = pack(sys.argv[1], sys.argv[2], options)
print(json.dumps({"calls": result.source_calls.to_json(), "files": result.num_files}))
"""


def _tree(root: Path) -> tuple[str, int]:
    files = {}
    for c in range(CLASSES):
        for i in range(PER_CLASS):
            size = 3000 if i == 0 else 50 + 13 * i  # one streamed file per class
            files[f"class{c}/f{i:03d}.bin".encode()] = bytes([i]) * size
    src = write_tree(root / "src", files)
    os.symlink("f001.bin", os.path.join(src, "class0", "link.bin"))
    os.symlink("nowhere.bin", os.path.join(src, "class1", "broken.bin"))
    os.mkfifo(os.path.join(src, "class2", "pipe.bin"))
    return os.path.realpath(src), CLASSES * PER_CLASS + 1


def _calls(log: str, root: str) -> dict[str, list[str]]:
    """Sort the traced calls on SRC and below: opens of directories and of files, stats of
    SRC itself (the argument checks), stats by path below it (the scan's) and fstats of
    open descriptors (directories' and files')."""
    inside = root + "/"
    kinds = ("open_dir", "open", "stat_src", "stat", "fstat_dir", "fstat")
    out: dict[str, list[str]] = {k: [] for k in kinds}
    for line in log.splitlines():
        m = SYSCALL.match(line)
        if not m or m.group("name") not in OPEN_CALLS | STAT_CALLS:
            continue
        args = m.group("args")
        quoted = QUOTED.findall(args)
        path = quoted[0] if quoted else ""
        fd = FD_PATH.match(args)
        if path.startswith("/") or (path and fd is None):
            target = path
        elif fd is not None:  # relative to a descriptor (or "" with AT_EMPTY_PATH: fstat)
            target = os.path.join(fd.group(1), path) if path else fd.group(1)
        else:
            continue
        if target != root and not target.startswith(inside):
            continue
        if m.group("name") in OPEN_CALLS:
            out["open_dir" if "O_DIRECTORY" in args else "open"].append(target)
        elif path:
            out["stat_src" if target == root else "stat"].append(target)
        else:
            out["fstat_dir" if os.path.isdir(target) else "fstat"].append(target)
    return out


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, list[str]], dict]:
    if not os.path.exists(STRACE) and shutil.which("strace") is None:
        pytest.skip("strace is not installed (CI installs it): cannot count syscalls")
    work = tmp_path_factory.mktemp("pack-strace")
    src, _ = _tree(work)
    log = work / "strace.log"
    text, reported = run_traced(
        ["-c", SCRIPT, src, str(work / "out"), str(STREAM_THRESHOLD)],
        log=log,
        traced=TRACED,
        string_limit=512,
    )
    return _calls(text, src), reported


def test_the_reported_stat_calls_are_the_stats_strace_sees_one_per_file(traced) -> None:
    seen, reported = traced
    calls = reported["calls"]
    listed = CLASSES * PER_CLASS + 3  # the regular files, the two symlinks and the FIFO
    assert calls["stat_calls"] == len(seen["stat"]) == listed
    assert len(set(seen["stat"])) == len(seen["stat"]), "a source file was stat'ed twice"
    dirs = [p for p in seen["stat"] if os.path.isdir(p) and not os.path.islink(p)]
    assert dirs == [], "a directory was stat'ed by path"
    assert len(seen["stat_src"]) <= 6  # checking the argument: a few, whatever the tree


def test_each_directory_is_listed_once_with_one_fstat_by_the_c_library(traced) -> None:
    seen, reported = traced
    calls = reported["calls"]
    assert calls["dirs_listed"] == CLASSES + 1
    assert sorted(seen["open_dir"]) == sorted(set(seen["open_dir"]))
    assert len(seen["open_dir"]) == calls["dirs_listed"]
    assert sorted(seen["fstat_dir"]) == sorted(seen["open_dir"])  # opendir's own fstat
    assert calls["entries_seen"] == CLASSES + CLASSES * PER_CLASS + 3


def test_each_packed_file_is_opened_once_and_only_streamed_ones_are_fstated(traced) -> None:
    seen, reported = traced
    calls = reported["calls"]
    assert reported["files"] == CLASSES * PER_CLASS + 1
    assert calls["opens"] == len(seen["open"]) == reported["files"]
    assert len(set(seen["open"])) == len(seen["open"]), "a source file was opened twice"
    assert not any(p.endswith("pipe.bin") for p in seen["open"]), "the FIFO was opened"
    assert calls["fstat_calls"] == len(seen["fstat"]) == CLASSES
    assert all(os.path.getsize(p) > STREAM_THRESHOLD for p in seen["fstat"])
