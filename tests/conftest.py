"""Fixtures shared by every test directory: a small ImageNet-like tree and a CLI runner."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any, NamedTuple

import pytest
from fakebins import fake_path

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


RunCli = Callable[..., CliResult]


@pytest.fixture(scope="session")
def run_cli() -> RunCli:
    """``run_cli(*args, env=None, cwd=None, timeout=120)`` -> CliResult(rc, stdout, stderr)."""
    return run_shardio


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


# --------------------------------------------------------------------------- slow modules
# Unit-test modules whose tests start processes (DataLoader workers, gloo ranks, SIGKILLed
# children, strace, pytest or the CLI in a subprocess: 0.3 s a test or more), marked ``slow``
# here, in one place, so that ``make test-fast`` (``-m "not slow"``) stays under a minute on
# two cores. ``make test`` runs them all.
_SLOW_MODULES = frozenset(
    {
        "tests/unit/cache/test_area_faults.py",
        "tests/unit/cache/test_capacity.py",
        "tests/unit/cache/test_clean_journal.py",
        "tests/unit/cache/test_concurrent.py",
        "tests/unit/cache/test_kill.py",
        "tests/unit/cache/test_make.py",
        "tests/unit/cache/test_partition.py",
        "tests/unit/cache/test_verify_area.py",
        "tests/unit/checkpoint/test_distributed.py",
        "tests/unit/metrics/test_first_report.py",
        "tests/unit/runtime/test_distributed.py",
        "tests/unit/runtime/test_epoch_syscalls.py",
        "tests/unit/runtime/test_fd_limit.py",
        "tests/unit/runtime/test_kill_resume.py",
        "tests/unit/runtime/test_metrics.py",
        "tests/unit/runtime/test_persistent.py",
        "tests/unit/runtime/test_provenance_mmap.py",
        "tests/unit/runtime/test_ring.py",
        "tests/unit/runtime/test_scale.py",
        "tests/unit/runtime/test_shm_full.py",
        "tests/unit/runtime/test_sigbus.py",
        "tests/unit/runtime/test_syscalls.py",
        "tests/unit/runtime/test_torture.py",
        "tests/unit/runtime/test_torture_parity.py",
        "tests/unit/test_bench_gpu.py",
        "tests/unit/test_bench_pfs.py",
        "tests/unit/test_gen_imagenet.py",
        "tests/unit/test_pfs_required.py",
    }
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        try:
            rel = pathlib.Path(str(item.path)).resolve().relative_to(REPO).as_posix()
        except ValueError:  # a test tree outside the checkout (tests of this conftest)
            continue
        if rel in _SLOW_MODULES:
            item.add_marker(pytest.mark.slow)


# --------------------------------------------------------------------------- groups
# The groups of tests that need something beyond Python: ``make test`` says in its header what
# each needs and whether this machine has it, and in its summary how many of each ran, were
# skipped (with the first reason) or deselected. Each group on a real component also has a
# variable: under SHARDIO_PFS=required (the MooseFS bed, tests/pfs), SHARDIO_SLURM=required
# (the one-host SLURM cluster, tests/slurm) or SHARDIO_PROMETHEUS=required (a Prometheus
# server and promtool), as in CI, a run that collected tests of that group fails unless every
# one of them ran: a skip, or a session that ran none of them, would let CI pass without ever
# touching the real component. A selection (-k, -m, a file) that collects no test of a group is
# not held to it.
_GROUPS = {
    "pfs": ("SHARDIO_PFS", "the MooseFS bed must run in CI"),
    "slurm": ("SHARDIO_SLURM", "the SLURM cluster must run in CI"),
    "prometheus": ("SHARDIO_PROMETHEUS", "Prometheus and promtool must run in CI"),
}
_SHOWN = ("gpu", "dali", "pfs", "slurm", "prometheus")
_REQUIRED = tuple(m for m, (var, _) in _GROUPS.items() if os.environ.get(var, "") == "required")
_collected = pytest.StashKey[dict[str, int]]()
_marked = pytest.StashKey[dict[str, set[str]]]()
_ran = pytest.StashKey[dict[str, set[str]]]()
_skipped = pytest.StashKey[dict[str, list[tuple[str, str]]]]()
_deselected = pytest.StashKey[dict[str, int]]()
_problems = pytest.StashKey[list[str]]()
_CONFIG: dict[str, pytest.Config] = {}  # the session's config, for the report hook


def _have(*names: str) -> bool:
    import shutil

    return all(shutil.which(n) is not None for n in names)


def _group_needs() -> dict[str, str]:
    """What each group needs, and whether this machine has it (the report header)."""
    root = os.geteuid() == 0
    dali = importlib.util.find_spec("nvidia") is not None and (
        importlib.util.find_spec("nvidia.dali") is not None
    )
    gpu = os.path.exists("/dev/nvidiactl") or os.path.isdir("/proc/driver/nvidia")

    def state(ok: bool, why: str) -> str:
        return "available" if ok else f"unavailable ({why})"

    def var(marker: str) -> str:
        name = _GROUPS[marker][0]
        value = os.environ.get(name, "")
        return f", {name}={value}" if value else ""

    return {
        "gpu": state(gpu, "no NVIDIA device") + " -- run with pytest -m gpu",
        "dali": state(dali, "nvidia-dali not installed: make install-dev"),
        "pfs": state(root and _have("mfsmaster", "mfschunkserver", "mfsmount"),
                     "needs root and moosefs-*; scripts/pfs/moosefs.sh installs them")
        + var("pfs"),
        "slurm": state(root and _have("slurmctld", "slurmd", "munged", "srun"),
                       "needs root, slurm-wlm and munge")
        + var("slurm"),
        "prometheus": state(_have("prometheus", "promtool"), "needs prometheus (promtool)")
        + var("prometheus"),
    }  # fmt: skip


def pytest_report_header(config: pytest.Config) -> list[str]:
    needs = _group_needs()
    return ["shardio test groups:"] + [f"  {m:<10} {needs[m]}" for m in _SHOWN]


def pytest_deselected(items: list[pytest.Item]) -> None:
    config = _CONFIG.get("config")
    if config is None:
        return
    counts = config.stash.setdefault(_deselected, dict.fromkeys(_SHOWN, 0))
    for item in items:
        for marker in _SHOWN:
            if item.get_closest_marker(marker) is not None:
                counts[marker] += 1


def pytest_collection_finish(session: pytest.Session) -> None:
    config = session.config
    # By marker, not keyword: a test named after a group (test_bench_pfs) is not in it.
    config.stash[_marked] = {
        m: {item.nodeid for item in session.items if item.get_closest_marker(m) is not None}
        for m in _SHOWN
    }
    config.stash[_collected] = {m: len(ids) for m, ids in config.stash[_marked].items()}
    config.stash[_ran] = {m: set() for m in _SHOWN}
    config.stash[_skipped] = {m: [] for m in _SHOWN}
    config.stash.setdefault(_deselected, dict.fromkeys(_SHOWN, 0))


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr).splitlines()[-1] if longrepr else ""


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    config = _CONFIG.get("config")
    if config is None or _ran not in config.stash:
        return
    for marker in _SHOWN:
        if report.nodeid not in config.stash[_marked][marker]:
            continue
        if report.skipped and not hasattr(report, "wasxfail"):  # an xfail did run
            config.stash[_skipped][marker].append((report.nodeid, _skip_reason(report)))
        elif report.when == "call":
            config.stash[_ran][marker].add(report.nodeid)


def pytest_configure(config: pytest.Config) -> None:
    _CONFIG["config"] = config


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    if not _REQUIRED or config.option.collectonly or _collected not in config.stash:
        return
    problems = []
    for marker in _REQUIRED:
        var, why = _GROUPS[marker]
        collected = config.stash[_collected][marker]
        if not collected:
            continue
        skipped = [nodeid for nodeid, _ in config.stash[_skipped][marker]]
        ran = len(config.stash[_ran][marker])
        if skipped:
            shown = ", ".join(skipped[:5]) + (" ..." if len(skipped) > 5 else "")
            problem = f"{len(skipped)} {marker} test(s) skipped: {shown}"
        elif ran == 0:
            problem = f"{collected} {marker} test(s) collected but none ran"
        else:
            continue
        problems.append(f"{var}=required: {problem} ({why})")
    if not problems:
        return
    config.stash[_problems] = problems
    if session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    if _collected in config.stash and not config.option.collectonly:
        terminalreporter.write_line("shardio test groups:")
        needs = _group_needs()
        for marker in _SHOWN:
            ran = len(config.stash[_ran][marker])
            skipped = config.stash[_skipped][marker]
            deselected = config.stash[_deselected][marker]
            line = f"  {marker:<10} {ran} ran, {len(skipped)} skipped, {deselected} deselected"
            if skipped:
                line += f" (first skip: {skipped[0][1][:120]})"
            elif not ran:
                line += f"; here: {needs[marker]}"
            terminalreporter.write_line(line)
    for problem in config.stash.get(_problems, []):
        terminalreporter.write_line(problem, red=True)
