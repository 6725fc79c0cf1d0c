"""The suite's own pytest plugin (loaded by tests/conftest.py): which tests are fast, the
groups of tests on real components, progress lines and the run's report.

- **Fast or slow, derived.** ``tests/durations.json`` holds each test's measured time (set-up,
  call and tear-down) from a whole ``make test`` on the 2-core test machine, and each module's
  shared (module-scoped) fixtures' set-up time; ``make test-durations`` refreshes it. A test is
  marked ``slow`` unless it is recorded under :data:`FAST_LIMIT_S` in a module whose shared
  fixtures are too: a new test, or one that grew, is out of ``make test-fast`` until the
  record says otherwise (``scripts/suite.py`` lists the ones the record has not seen or that
  now run over the limit), so a slow test never joins the fast selection silently.
- **Groups.** The groups of tests that need something beyond Python: the header says what each
  needs and whether this machine has it, the summary how many of each ran, were skipped (with
  the first reason) or deselected. Under SHARDIO_PFS=required (the MooseFS bed, tests/pfs),
  SHARDIO_SLURM=required (the one-host SLURM cluster, tests/slurm) or
  SHARDIO_PROMETHEUS=required (a Prometheus server and promtool), as in CI, a run that
  collected tests of that group fails unless every one of them ran: a skip, or a session that
  ran none of them, would let CI pass without ever touching the real component. A selection
  (-k, -m, a file) that collects no test of a group is not held to it.
- **Progress.** Under ``SHARDIO_TEST_PROGRESS=LABEL`` (``scripts/suite.py`` sets it) the dots
  give way to a line every :data:`PROGRESS_EVERY_S` seconds (done/total, failures, the module
  running) and a line at once for each failure.
- **Report.** Under ``SHARDIO_TEST_REPORT=PATH`` the session writes, at its end, each test's
  time and outcome, each group's counts and the wall time as JSON (``scripts/suite.py``
  prints the summary, the slowest tests and the budget from it).
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import shutil
import tempfile
import time
from typing import Any

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
DURATIONS = REPO / "tests" / "durations.json"
# A test recorded under this many seconds (set-up + call + tear-down) is in ``make test-fast``.
FAST_LIMIT_S = 0.2
PROGRESS_EVERY_S = 20.0


_REWRITE = "`git checkout tests/durations.json` or `make test-durations` rewrites it"


class RecordError(ValueError):
    """tests/durations.json is not a record."""


class Record:
    """The measured times: each test's own seconds, and each module's shared fixtures'.

    A test's own time is its set-up, call and tear-down less the module-, class- or
    package-scoped fixtures it happened to set up first; those count for the module
    (``shared``), paid once by whichever of its tests runs first in any selection.
    """

    def __init__(self, own: dict[str, float], shared: dict[str, float]) -> None:
        self.own = own
        self.shared = shared

    @classmethod
    def load(cls, path: pathlib.Path = DURATIONS) -> Record:
        """The record in ``path`` (none: nothing is fast).

        Raises:
            RecordError: the file is not a record (one line naming it).
        """
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return cls({}, {})
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise RecordError(f"{path}: not a durations record ({exc}): {_REWRITE}") from None
        try:
            own = {
                f"{module}::{name}": float(seconds)
                for module, tests in data["tests"].items()
                for name, seconds in tests.items()
            }
            shared = {m: float(s) for m, s in data.get("shared", {}).items()}
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise RecordError(
                f"{path}: not a durations record ({type(exc).__name__}: {exc}): {_REWRITE}"
            ) from None
        return cls(own, shared)

    def is_fast(self, nodeid: str) -> bool:
        """Recorded, under :data:`FAST_LIMIT_S`, in a module without costly shared fixtures."""
        seconds = self.own.get(nodeid)
        module = nodeid.split("::", 1)[0]
        return (
            seconds is not None
            and seconds < FAST_LIMIT_S
            and self.shared.get(module, 0.0) < FAST_LIMIT_S
        )


@pytest.hookimpl(tryfirst=True)  # before -m selects on ``slow``
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        record = Record.load(config.rootpath / DURATIONS.relative_to(REPO))
    except RecordError as exc:
        raise pytest.UsageError(str(exc)) from None
    for item in items:
        if not record.is_fast(item.nodeid):
            item.add_marker(pytest.mark.slow)


# --------------------------------------------------------------------------- groups
_GROUPS = {
    "pfs": ("SHARDIO_PFS", "the MooseFS bed must run in CI"),
    "slurm": ("SHARDIO_SLURM", "the SLURM cluster must run in CI"),
    "prometheus": ("SHARDIO_PROMETHEUS", "Prometheus and promtool must run in CI"),
}
SHOWN = ("gpu", "dali", "pfs", "slurm", "prometheus")
_REQUIRED = tuple(m for m, (var, _) in _GROUPS.items() if os.environ.get(var, "") == "required")
_collected = pytest.StashKey[dict[str, int]]()
_marked = pytest.StashKey[dict[str, set[str]]]()
_ran = pytest.StashKey[dict[str, set[str]]]()
_skipped = pytest.StashKey[dict[str, list[tuple[str, str]]]]()
_deselected = pytest.StashKey[dict[str, int]]()  # by group, and _ALL: every test
_ALL = "*"
_problems = pytest.StashKey[list[str]]()
_times = pytest.StashKey[dict[str, list[Any]]]()
_progress = pytest.StashKey["_Progress"]()
_CONFIG: dict[str, pytest.Config] = {}  # the session's config, for the report hooks


def _have(*names: str) -> bool:
    return all(shutil.which(n) is not None for n in names)


def group_needs() -> dict[str, str]:
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
                     "needs root and moosefs-*: make test installs them as root")
        + var("pfs"),
        "slurm": state(root and _have("slurmctld", "slurmd", "munged", "srun"),
                       "needs root, slurm-wlm and munge: make test installs them as root")
        + var("slurm"),
        "prometheus": state(_have("prometheus", "promtool"),
                            "needs prometheus (promtool): make test installs it as root")
        + var("prometheus"),
    }  # fmt: skip


def pytest_report_header(config: pytest.Config) -> list[str]:
    needs = group_needs()
    return ["shardio test groups:"] + [f"  {m:<10} {needs[m]}" for m in SHOWN]


def pytest_deselected(items: list[pytest.Item]) -> None:
    config = _CONFIG.get("config")
    if config is None:
        return
    counts = config.stash.setdefault(_deselected, dict.fromkeys(SHOWN, 0))
    counts[_ALL] = counts.get(_ALL, 0) + len(items)
    for item in items:
        for marker in SHOWN:
            if item.get_closest_marker(marker) is not None:
                counts[marker] += 1


def pytest_collection_finish(session: pytest.Session) -> None:
    config = session.config
    # By marker, not keyword: a test named after a group (test_bench_pfs) is not in it.
    config.stash[_marked] = {
        m: {item.nodeid for item in session.items if item.get_closest_marker(m) is not None}
        for m in SHOWN
    }
    config.stash[_collected] = {m: len(ids) for m, ids in config.stash[_marked].items()}
    config.stash.setdefault(_deselected, dict.fromkeys(SHOWN, 0))
    if hasattr(config, "workerinput"):  # an xdist worker: the controller counts
        config.workeroutput["shardio_groups"] = {  # type: ignore[attr-defined]
            "collected": config.stash[_collected],
            "deselected": config.stash[_deselected],
        }
        config.workeroutput["shardio_fixtures"] = _fixture_times  # type: ignore[attr-defined]
    progress = config.stash.get(_progress, None)
    if progress is not None:
        progress.total = len(session.items)


def _start_counting(config: pytest.Config) -> None:
    config.stash.setdefault(_marked, {m: set() for m in SHOWN})
    config.stash.setdefault(_collected, dict.fromkeys(SHOWN, 0))
    config.stash.setdefault(_deselected, dict.fromkeys(SHOWN, 0))
    config.stash[_ran] = {m: set() for m in SHOWN}
    config.stash[_skipped] = {m: [] for m in SHOWN}
    config.stash[_times] = {}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node: Any, ids: list[str]) -> None:
    progress = _CONFIG["config"].stash.get(_progress, None)
    if progress is not None:
        progress.total = max(progress.total, len(ids))


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """An xdist worker's collection counts (each worker collects the whole selection)."""
    config = _CONFIG["config"]
    output = getattr(node, "workeroutput", {})
    for name, (count, seconds) in output.get("shardio_fixtures", {}).items():
        entry = _fixture_times.setdefault(name, [0, 0.0])
        entry[0] += count
        entry[1] += seconds
    counts = output.get("shardio_groups")
    if not counts:
        return
    for key, stash in (("collected", _collected), ("deselected", _deselected)):
        mine = config.stash[stash]
        for marker, n in counts[key].items():
            mine[marker] = max(mine.get(marker, 0), n)


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr).splitlines()[-1] if longrepr else ""


def _outcome(report: pytest.TestReport) -> str:
    if hasattr(report, "wasxfail"):
        return "xfailed" if report.skipped else "xpassed"
    if report.when != "call" and report.failed:
        return "error"
    return report.outcome


_GROUPS_PROPERTY = "shardio_groups"
_SHARED_PROPERTY = "shardio_shared_s"
_SHARED_SCOPES = ("module", "class", "package")
_shared_now: list[float] = [0.0]  # shared fixtures' set-up seconds of the test setting up
_shared_depth = [0]  # a shared fixture that requests another is timed once, outermost


# Set-up seconds of every fixture broader than a test (the beds, clusters, packed datasets):
# {"scope name": [times set up, seconds]}, summed over xdist workers into the report.
_fixture_times: dict[str, list[float]] = {}


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef: Any, request: Any) -> Any:
    if fixturedef.scope == "function":
        return (yield)
    outermost = fixturedef.scope in _SHARED_SCOPES and not _shared_depth[0]
    _shared_depth[0] += outermost
    start = time.perf_counter()
    try:
        return (yield)
    finally:
        seconds = time.perf_counter() - start
        _shared_depth[0] -= outermost
        entry = _fixture_times.setdefault(f"{fixturedef.scope} {fixturedef.argname}", [0, 0.0])
        entry[0] += 1
        entry[1] += seconds
        if outermost:
            _shared_now[0] += seconds
        elif fixturedef.scope == "session" and _shared_depth[0]:
            # Paid once per session, whichever test asks first: not the module's.
            _shared_now[0] -= seconds


def pytest_runtest_setup(item: pytest.Item) -> None:
    _shared_now[0] = 0.0


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: Any) -> Any:
    """Each report names its test's groups (by marker), for an xdist controller."""
    report = yield
    groups = [m for m in SHOWN if item.get_closest_marker(m) is not None]
    if groups:
        report.user_properties.append((_GROUPS_PROPERTY, groups))
    if report.when == "setup" and _shared_now[0]:
        report.user_properties.append((_SHARED_PROPERTY, round(_shared_now[0], 4)))
    return report


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    config = _CONFIG.get("config")
    if config is None or _ran not in config.stash or hasattr(config, "workerinput"):
        return
    # Each test's time (set-up + call + tear-down) and outcome (the worst of its phases).
    entry = config.stash[_times].setdefault(report.nodeid, [0.0, "passed", 0.0])
    entry[0] += report.duration
    entry[2] += float(dict(report.user_properties).get(_SHARED_PROPERTY, 0.0))
    outcome = _outcome(report)
    counts = report.when == "call" or outcome != "passed"
    if counts and (entry[1] in ("passed", "skipped") or outcome in ("failed", "error")):
        entry[1] = outcome
    for marker in SHOWN:
        if report.nodeid not in config.stash[_marked][marker]:
            # Under xdist the controller learns a test's groups from its reports.
            if marker not in dict(report.user_properties).get(_GROUPS_PROPERTY, ()):
                continue
            config.stash[_marked][marker].add(report.nodeid)
        if report.skipped and not hasattr(report, "wasxfail"):  # an xfail did run
            config.stash[_skipped][marker].append((report.nodeid, _skip_reason(report)))
        elif report.when == "call":
            config.stash[_ran][marker].add(report.nodeid)
    progress = config.stash.get(_progress, None)
    if progress is not None:
        progress.report(report)


def pytest_configure(config: pytest.Config) -> None:
    _CONFIG["config"] = config
    config.addinivalue_line("markers", "slow: not recorded under 0.2 s (tests/durations.json)")
    _start_counting(config)
    label = os.environ.get("SHARDIO_TEST_PROGRESS", "")
    if label and not hasattr(config, "workerinput"):  # the xdist controller or a plain run
        config.stash[_progress] = _Progress(config, label)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    if hasattr(config, "workerinput") or config.option.collectonly:
        return
    problems = []
    for marker in _REQUIRED:
        var, why = _GROUPS[marker]
        collected = max(config.stash[_collected][marker], len(config.stash[_marked][marker]))
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
    if problems:
        config.stash[_problems] = problems
        if session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
    _write_report(session)


def _group_lines(config: pytest.Config) -> list[str]:
    needs = group_needs()
    lines = []
    for marker in SHOWN:
        ran = len(config.stash[_ran][marker])
        skipped = config.stash[_skipped][marker]
        deselected = config.stash[_deselected][marker]
        line = f"  {marker:<10} {ran} ran, {len(skipped)} skipped, {deselected} deselected"
        if skipped:
            line += f" (first skip: {skipped[0][1][:120]})"
        elif not ran:
            line += f"; here: {needs[marker]}"
        lines.append(line)
    return lines


def _write_report(session: pytest.Session) -> None:
    path = os.environ.get("SHARDIO_TEST_REPORT", "")
    if not path:
        return
    config = session.config
    skipped: dict[str, str] = {}
    for marker in SHOWN:
        for nodeid, reason in config.stash[_skipped][marker]:
            skipped.setdefault(nodeid, reason)
    report = {
        "wall_s": round(time.monotonic() - _START[0], 1),
        "exitstatus": int(session.exitstatus),
        "collected": session.testscollected,
        "deselected": config.stash[_deselected].get(_ALL, 0),
        "groups": {
            marker: {
                "ran": len(config.stash[_ran][marker]),
                "skipped": len(config.stash[_skipped][marker]),
                "deselected": config.stash[_deselected][marker],
                "first_skip": (config.stash[_skipped][marker] or [("", "")])[0][1],
            }
            for marker in SHOWN
        },
        "group_lines": _group_lines(config),
        "problems": config.stash.get(_problems, []),
        "fixtures": {
            name: [int(count), round(seconds, 3)]
            for name, (count, seconds) in sorted(_fixture_times.items())
            if seconds >= 0.01
        },
        # nodeid: [seconds, outcome, seconds of shared fixtures it set up]
        "tests": {
            nodeid: [round(seconds, 3), outcome, round(shared, 3)]
            for nodeid, (seconds, outcome, shared) in config.stash[_times].items()
        },
    }
    # A new file beside it, then renamed over it: a link at either name is replaced, never
    # followed.
    fd, tmp = tempfile.mkstemp(prefix=".report-", dir=os.path.dirname(os.path.abspath(path)))
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=0, sort_keys=True)
    os.replace(tmp, path)


_START = [time.monotonic()]


def pytest_sessionstart(session: pytest.Session) -> None:
    _START[0] = time.monotonic()


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    if not config.option.collectonly and not hasattr(config, "workerinput"):
        terminalreporter.write_line("shardio test groups:")
        for line in _group_lines(config):
            terminalreporter.write_line(line)
    for problem in config.stash.get(_problems, []):
        terminalreporter.write_line(problem, red=True)


# --------------------------------------------------------------------------- progress
class _Progress:
    """A line every PROGRESS_EVERY_S seconds in place of the dots, and one per failure."""

    def __init__(self, config: pytest.Config, label: str) -> None:
        self.config = config
        self.label = label[:20]
        self.total = 0
        self.done: set[str] = set()
        self.failed = 0
        self.skipped = 0
        self.start = time.monotonic()
        self.last = self.start

    def _write(self, text: str, **markup: bool) -> None:
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is None:
            return
        elapsed = int(time.monotonic() - self.start)
        reporter.ensure_newline()
        stamp = f"{elapsed // 60:02d}:{elapsed % 60:02d}"
        reporter.write_line(f"[{self.label} {stamp}] {text}", **markup)

    def report(self, report: pytest.TestReport) -> None:
        finished = report.when == "teardown"
        if report.failed:
            phase = "" if report.when == "call" else f" (in {report.when})"
            self._write(f"FAILED {report.nodeid}{phase}", red=True)
            self.failed += 1
        elif report.skipped and report.when != "teardown" and not hasattr(report, "wasxfail"):
            self.skipped += 1
        if finished:
            self.done.add(report.nodeid)
        now = time.monotonic()
        if finished and now - self.last >= PROGRESS_EVERY_S:
            self.last = now
            module = report.nodeid.split("::", 1)[0]
            self._write(
                f"{len(self.done)}/{self.total} done, {self.failed} failed, "
                f"{self.skipped} skipped; now {module}"
            )


@pytest.hookimpl(wrapper=True)
def pytest_report_teststatus(report: pytest.TestReport, config: pytest.Config) -> Any:
    result = yield
    if _progress not in config.stash or not isinstance(result, tuple):
        return result
    category, _letter, _word = result
    return category, "", ""  # the progress lines stand for the dots
