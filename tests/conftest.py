"""Fixtures shared by every test directory: a small ImageNet-like tree and a CLI runner."""

from __future__ import annotations

import importlib.util
import logging
import os
import pathlib
import subprocess
import sys
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import NamedTuple

import pytest
from fakebins import fake_path

# Fast or slow (from tests/durations.json), the real-component groups, progress and the run's
# report: tests/suite_plugin.py.
pytest_plugins = ["suite_plugin"]

REPO = pathlib.Path(__file__).resolve().parents[1]
GEN_SCRIPT = REPO / "scripts" / "gen_imagenet.py"

# The tree of the ``small_tree`` fixture: 300 JPEG files, 4 classes, train/val, ~6 MB.
SMALL_TREE_FILES = 300
SMALL_TREE_CLASSES = 4
SMALL_TREE_MEAN_KB = 20


def load_generator() -> ModuleType:
    """Import scripts/gen_imagenet.py by path (scripts/ is not a package)."""
    name = "gen_imagenet"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, GEN_SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while being created
    spec.loader.exec_module(module)
    return module


class CliResult(NamedTuple):
    """What one ``python -m shardio`` run returned."""

    rc: int
    stdout: str
    stderr: str


def cli_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a CLI subprocess: this one without SLURM or fake-command knobs."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "SHARDIO_FAKE_")) and k != "PYTHONWARNINGS"
    }
    env["PYTHONUNBUFFERED"] = "1"
    if extra:
        env.update(extra)
    return env


def run_shardio(
    *args: str | os.PathLike[str],
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    timeout: float = 120.0,
) -> CliResult:
    """Run ``python -m shardio ARGS`` in a subprocess; return (rc, stdout, stderr).

    ``env`` entries are added to (not substituted for) the cleaned environment.
    """
    proc = subprocess.run(
        [sys.executable, "-m", "shardio", *map(os.fspath, args)],
        capture_output=True,
        text=True,
        encoding="utf-8",
        errors="replace",
        env=cli_env(env),
        cwd=cwd,
        timeout=timeout,
        check=False,
    )
    return CliResult(proc.returncode, proc.stdout, proc.stderr)


def run_shardio_here(*args: str | os.PathLike[str]) -> CliResult:
    """Run ``shardio ARGS`` in this process (``shardio.cli.main.main``), its output captured:
    for the many options refused before any work, where a process of its own adds only its
    start-up (a quarter of a CPU-second). Each such test also runs a case through
    :func:`run_shardio`, the real command."""
    import contextlib
    import io

    from shardio.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level  # main() configures logging: put back
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = main([os.fspath(a) for a in args])
            except SystemExit as exc:  # argparse's own refusals (exit 2), as `python -m` ends
                rc = exc.code if isinstance(exc.code, int) else 1
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    return CliResult(rc, out.getvalue(), err.getvalue())


RunCli = Callable[..., CliResult]


@pytest.fixture(scope="session")
def run_cli() -> RunCli:
    """``run_cli(*args, env=None, cwd=None, timeout=120)`` -> CliResult(rc, stdout, stderr)."""
    return run_shardio


@pytest.fixture(scope="session")
def run_cli_here() -> RunCli:
    """``run_cli_here(*args)`` -> CliResult: the command in this process (a usage error)."""
    return run_shardio_here


@pytest.fixture(scope="session")
def small_tree(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A read-only-by-convention ImageNet-like tree: 300 files, 4 classes, ~20 KB each.

    Shared by the whole session: tests that change a source tree copy it first.
    """
    out = tmp_path_factory.mktemp("small_tree") / "src"
    load_generator().generate(
        out, files=SMALL_TREE_FILES, classes=SMALL_TREE_CLASSES, mean_kb=SMALL_TREE_MEAN_KB
    )
    return out


def _assert_one_error_line(result: CliResult, *needles: str) -> str:
    """Check a failed run: rc != 0, exactly one stderr line ``shardio: error: ...``, no
    traceback, and each needle in that line. Returns the line."""
    assert result.rc != 0, f"expected a failure, got rc 0: {result.stdout!r}"
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, f"expected one stderr line, got {lines!r}"
    line = lines[0]
    assert line.startswith("shardio: error: "), line
    for needle in needles:
        assert needle in line, f"{needle!r} not in {line!r}"
    return line


@pytest.fixture(scope="session")
def assert_cli_error() -> Callable[..., str]:
    """``assert_cli_error(result, *needles)``: one ``shardio: error:`` line, rc != 0, no
    traceback, every needle in the line; returns the line."""
    return _assert_one_error_line


PackedSmall = Callable[..., tuple[pathlib.Path, CliResult]]


@pytest.fixture(scope="session")
def packed_small(small_tree: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> PackedSmall:
    """``packed_small(fmt="tar", shard_size="256KiB", workers=1)`` -> (dataset, pack result).

    The small tree packed through the CLI once per combination for the whole session.
    Read-only by convention: copy a dataset before damaging it.
    """
    cache: dict[tuple[str, str, int], tuple[pathlib.Path, CliResult]] = {}

    def get(
        fmt: str = "tar", shard_size: str = "256KiB", workers: int = 1
    ) -> tuple[pathlib.Path, CliResult]:
        key = (fmt, shard_size, workers)
        if key not in cache:
            dst = tmp_path_factory.mktemp(f"packed-{fmt}-{shard_size}-w{workers}") / "ds"
            result = run_shardio(
                "pack", small_tree, dst, "--format", fmt, "--shard-size", shard_size,
                "--workers", str(workers), "--no-progress",
            )  # fmt: skip
            assert result.rc == 0, result.stderr
            cache[key] = (dst, result)
        return cache[key]

    return get


@pytest.fixture
def small_tmpfs(tmp_path: pathlib.Path):
    """A 3 MiB tmpfs mounted at tmp_path/mnt (needs root; skipped when mount fails)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=3M", "tmpfs", str(mnt)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {proc.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, check=False)


@pytest.fixture
def lustre_env(tmp_path: pathlib.Path) -> tuple[dict[str, str], pathlib.Path]:
    """Environment with the recording fake lfs first on PATH, and its log path."""
    log = tmp_path / "lfs.log"
    env = {
        "PATH": f"{fake_path('lfs')}{os.pathsep}{os.environ.get('PATH', '')}",
        "SHARDIO_FAKE_LOG": str(log),
        "SHARDIO_FAKE_LFS_TARS": "1",  # each call records the shards there at call time
    }
    return env, log
