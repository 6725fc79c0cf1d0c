"""Shared helpers of the benchmarks: cold caches, timed child processes, results tables.

Every measured configuration runs as its own child process, so imports, start-up and
memory are charged to the configuration that needs them and nothing leaks between runs.
Nothing here asserts on timings: the benchmarks measure and report, they never fail on speed.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import hashlib
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import metadata
from typing import Any, TypeVar

__all__ = [
    "ChildRun",
    "CodeState",
    "back_free_memory",
    "hold_bench_lock",
    "child_handshake",
    "drop_caches",
    "select_named",
    "warm_up",
    "ensure_tree",
    "first_line",
    "import_streaming",
    "loadavg",
    "code_line",
    "code_state",
    "fmt_ratio",
    "machine_lines",
    "markdown_table",
    "median",
    "package_version",
    "path_bytes",
    "remove_path",
    "results_header",
    "run_child",
    "tree_payload",
    "update_section",
]

MiB = 1024**2
RESULTS_TITLE = "# shardio benchmark results"
T = TypeVar("T")


def drop_caches() -> bool:
    """Write back dirty pages and drop the page, dentry and inode caches.

    Returns:
        True if the caches were dropped (root), False if not permitted: the run is then
        "warm" and the results must say so.
    """
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("3\n")
    except OSError:
        return False
    return True


@dataclass(frozen=True)
class ChildRun:
    """One timed child process."""

    argv: tuple[str, ...]
    wall_s: float
    returncode: int
    max_rss_bytes: int  # largest single process of the tree (kernel's ru_maxrss)
    peak_tree_rss_bytes: int  # largest sampled sum of RSS over the process tree
    stderr_tail: str
    ready_s: float | None = None  # spawn to the child's READY line (handshake runs only)
    user_s: float = 0.0  # CPU time of the child and the descendants it reaped (wait4)
    sys_s: float = 0.0
    timed_out: bool = False  # killed (with its process group) after ``timeout_s``


def child_pids(pid: int) -> list[int]:
    """The live children of ``pid`` (forked DataLoader workers are), from every thread's
    ``/proc/PID/task/TID/children``."""
    kids: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return kids
    for tid in tids:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/children") as fh:
            kids.extend(int(p) for p in fh.read().split())
    return sorted(set(kids))


def _rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


def _tree_rss_bytes(root: int) -> int:
    total, stack, seen = 0, [root], set()
    while stack:
        pid = stack.pop()
        if pid in seen:
            continue
        seen.add(pid)
        total += _rss_bytes(pid)
        stack.extend(child_pids(pid))
    return total


class _TreeSampler:
    """Samples the summed RSS of a process tree from /proc while it runs."""

    def __init__(self, pid: int, interval_s: float) -> None:
        self._pid = pid
        self._interval_s = interval_s
        self._stop = threading.Event()
        self.peak_bytes = 0
        self._thread = threading.Thread(target=self._run, name="bench-rss", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_bytes = max(self.peak_bytes, _tree_rss_bytes(self._pid))
            self._stop.wait(self._interval_s)

    def __enter__(self) -> _TreeSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def run_child(
    argv: Sequence[str],
    *,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    sample_interval_s: float = 0.1,
    on_ready: Callable[[], None] | None = None,
    timeout_s: float | None = None,
) -> ChildRun:
    """Run ``argv`` as a child process (stdout discarded) and measure it.

    With ``on_ready``, the child is expected to print ``READY`` on stdout once it has done
    what should not be measured against the data (interpreter start-up, imports) and then to
    wait for a line on stdin: the parent calls ``on_ready()`` (e.g. :func:`drop_caches`) and
    answers ``GO``. Pages the child has mapped (its libraries) survive a cache drop, so the
    child then reads its data cold while its code stays loaded. Use :func:`child_handshake`
    in the child.

    Wall time is time.perf_counter around spawn-to-reap, so interpreter start-up and imports
    count. ``max_rss_bytes`` is the kernel's ru_maxrss from wait4 (the largest single process
    among the child and the descendants it reaped); ``peak_tree_rss_bytes`` sums the RSS of
    all live processes of the tree, sampled every ``sample_interval_s`` (shared pages count
    once per process, so it is an upper bound for parallel workers).

    With ``timeout_s``, the child runs in a session of its own and its whole process group
    (DataLoader workers included) is killed with SIGKILL after that many seconds; the result
    then has ``timed_out`` set (a benchmark on a faulty filesystem must end, never hang).
    """
    start = time.perf_counter()
    handshake = on_ready is not None
    proc = subprocess.Popen(
        list(argv),
        env=env,
        cwd=cwd,
        stdin=subprocess.PIPE if handshake else None,
        stdout=subprocess.PIPE if handshake else subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=timeout_s is not None,
    )
    killed = threading.Event()

    def kill() -> None:
        killed.set()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)

    timer = threading.Timer(timeout_s, kill) if timeout_s is not None else None
    if timer is not None:
        timer.daemon = True
        timer.start()
    stderr_chunks: list[bytes] = []

    def drain() -> None:
        if proc.stderr is not None:
            stderr_chunks.append(proc.stderr.read())

    reader = threading.Thread(target=drain, name="bench-stderr", daemon=True)
    reader.start()
    ready_s: float | None = None
    out_reader: threading.Thread | None = None
    with _TreeSampler(proc.pid, sample_interval_s) as sampler:
        if handshake and proc.stdin is not None and proc.stdout is not None:
            line = proc.stdout.readline()  # b"" if the child died before getting ready
            if line.strip() == b"READY":
                ready_s = time.perf_counter() - start
                assert on_ready is not None
                on_ready()
                try:
                    proc.stdin.write(b"GO\n")
                    proc.stdin.close()
                except BrokenPipeError:
                    pass
            out = proc.stdout
            out_reader = threading.Thread(target=out.read, name="bench-stdout", daemon=True)
            out_reader.start()
        _, status, rusage = os.wait4(proc.pid, 0)
    wall_s = time.perf_counter() - start
    if timer is not None:
        timer.cancel()
    proc.returncode = os.waitstatus_to_exitcode(status)
    reader.join()
    if out_reader is not None:
        out_reader.join()
    for stream in (proc.stdin, proc.stdout, proc.stderr):  # no ResourceWarning at collection
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.close()
    stderr = b"".join(stderr_chunks).decode(errors="replace")
    return ChildRun(
        argv=tuple(argv),
        wall_s=wall_s,
        returncode=proc.returncode,
        max_rss_bytes=rusage.ru_maxrss * 1024,
        peak_tree_rss_bytes=max(sampler.peak_bytes, rusage.ru_maxrss * 1024),
        stderr_tail=stderr[-2000:],
        ready_s=ready_s,
        user_s=rusage.ru_utime,
        sys_s=rusage.ru_stime,
        timed_out=killed.is_set(),
    )


def child_handshake() -> None:
    """Child side of ``run_child(..., on_ready=...)``: say READY, wait for the parent's GO."""
    sys.stdout.write("READY\n")
    sys.stdout.flush()
    sys.stdin.readline()


def remove_path(path: str) -> None:
    """Delete a file or a directory tree if it exists."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)


def path_bytes(path: str) -> int:
    """Total size of the regular files at ``path`` (a file or a tree)."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            full = os.path.join(root, name)
            if os.path.isfile(full) and not os.path.islink(full):
                total += os.path.getsize(full)
    return total


def tree_payload(path: str) -> tuple[int, int]:
    """Return (number of regular files, total bytes) of a source tree."""
    count = total = 0
    for root, _, files in os.walk(path):
        for name in files:
            st = os.lstat(os.path.join(root, name))
            count += 1
            total += st.st_size
    return count, total


def median(values: Sequence[float]) -> float:
    """Median of a non-empty sequence."""
    return statistics.median(values)


def fmt_ratio(value: float) -> str:
    """Format a ratio such as 1.27x."""
    return f"{value:.2f}x"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Render a GitHub-flavoured markdown table (numbers right-aligned)."""

    def align(col: int) -> str:
        cells = [r[col] for r in rows if r[col] not in ("", "-", "n/a")]
        numeric = bool(cells) and all(re.match(r"^[\d.,x%+-]+", c) for c in cells)
        return "---:" if numeric else "---"

    lines = [
        "| " + " | ".join(header) + " |",
        "| " + " | ".join(align(i) for i in range(len(header))) + " |",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def package_version(name: str) -> str:
    """Installed version of a distribution, or "not installed"."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def first_line(argv: Sequence[str]) -> str:
    try:
        out = subprocess.run(list(argv), capture_output=True, text=True, check=False).stdout
    except OSError:
        return "unknown"
    return out.splitlines()[0].strip() if out else "unknown"


def machine_lines(workdir: str) -> list[str]:
    """Describe the machine: CPUs, memory, filesystem of ``workdir``, kernel, CPU model."""
    mem_kib = 0
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemTotal:"):
                mem_kib = int(line.split()[1])
    cpu = "unknown"
    with open("/proc/cpuinfo") as fh:
        for line in fh:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    fs = first_line(["stat", "-f", "-c", "%T", workdir])
    try:
        out = subprocess.run(
            ["df", "--output=source", workdir], capture_output=True, text=True, check=False
        ).stdout.splitlines()
        device = out[1].strip() if len(out) > 1 else "unknown"
    except OSError:
        device = "unknown"
    return [
        f"- CPUs: {os.cpu_count()} (`nproc` {len(os.sched_getaffinity(0))}), {cpu}",
        f"- RAM: {mem_kib / 1024**2:.1f} GiB",
        f"- Workdir filesystem: `{fs}` (`stat -f -c %T`; ext2/ext3 is also ext4's magic) "
        f"on {device}",
        f"- Kernel: {platform.release()}; Python {platform.python_version()}",
    ]


@dataclass(frozen=True)
class CodeState:
    """The code measured: git commit, uncommitted changes, a digest of each source file."""

    head: str
    dirty: bool
    files: dict[str, str]

    def describe(self) -> str:
        """One line: commit, clean or not, and a digest over all the package's sources."""
        digest = hashlib.sha256("".join(f"{k}{v}" for k, v in sorted(self.files.items())).encode())
        state = "with uncommitted changes" if self.dirty else "clean"
        return f"commit {self.head} (sources {state}; sha256 {digest.hexdigest()[:12]})"

    def changed(self, later: CodeState) -> list[str]:
        """Source files that differ between this state and ``later``."""
        names = set(self.files) | set(later.files)
        return sorted(n for n in names if self.files.get(n) != later.files.get(n))


def code_line(before: CodeState, after: CodeState, path_name: str) -> str:
    """The "Code:" line of a results section: what was measured, and a warning naming the
    sources that changed while the benchmark ran (``path_name``: "read", "pack", ...)."""
    line = f"Code: {before.describe()}."
    changed = before.changed(after)
    if changed:
        line += (
            f" **shardio sources changed during the run** ({', '.join(changed)}; end state "
            f"{after.describe()}): rerun if these files are on the {path_name} path."
        )
    return line


def code_state(repo: str, package: str = "shardio") -> CodeState:
    """Snapshot the package's Python sources (others may edit them while a benchmark runs)."""
    head = first_line(["git", "-C", repo, "rev-parse", "--short", "HEAD"])
    try:
        dirty = subprocess.run(
            ["git", "-C", repo, "status", "--porcelain", "--", package],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
    except OSError:
        dirty = ""
    files: dict[str, str] = {}
    for root, dirs, names in os.walk(os.path.join(repo, package)):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(f for f in names if f.endswith(".py")):
            full = os.path.join(root, name)
            with open(full, "rb") as fh:
                files[os.path.relpath(full, repo)] = hashlib.sha256(fh.read()).hexdigest()
    return CodeState(head=head, dirty=bool(dirty), files=files)


def update_section(path: str, heading: str, body: str, header_lines: Sequence[str]) -> None:
    """Write ``heading`` + ``body`` into the markdown file at ``path``, replacing only that
    section (up to the next ``## `` heading); the file header (everything before the first
    ``## ``) is rewritten from ``header_lines``; other sections are kept as they are.
    """
    text = ""
    if os.path.exists(path):
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    sections = re.split(r"(?m)^(?=## )", text)
    rest = list(sections[1:]) if text else []
    new_section = heading.rstrip() + "\n\n" + body.strip() + "\n\n"
    replaced = False
    for i, sec in enumerate(rest):
        if sec.splitlines()[0].strip() == heading.strip():
            rest[i] = new_section
            replaced = True
    if not replaced:
        rest.append(new_section)
    header = "\n".join(header_lines).strip() + "\n\n"
    out = header + "".join(s if s.endswith("\n\n") else s.rstrip("\n") + "\n\n" for s in rest)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(out.rstrip("\n") + "\n")


def publish(body: str, heading: str, args: Any) -> None:
    """Print a benchmark's section and write it into ``args.out`` (RESULTS.md) unless
    ``args.no_write``; the file header comes from ``args.workdir``'s machine."""
    print(body)
    if not args.no_write:
        update_section(args.out, heading, body, results_header(args.workdir))
        print(f"updated {args.out}", file=sys.stderr)


def results_header(workdir: str) -> list[str]:
    """Header of RESULTS.md: what the file is and the machine the figures come from."""
    return [
        RESULTS_TITLE,
        "",
        "Written by the scripts in `benchmarks/` (see benchmarks/README.md); each script "
        "rewrites only its own `##` section. Machine of the latest run "
        f"({datetime.date.today().isoformat()}):",
        "",
        *machine_lines(workdir),
    ]


def back_free_memory(nbytes: int) -> float:
    """Write ``nbytes`` of anonymous memory once and free it; return the seconds it took.

    Virtual machines that hand free memory back to their host (free page reporting, a
    balloon) make the first use of a freed page fault on the host. Right after a cache drop,
    a copy then pays that fault for every page-cache page it fills, and the same ``cp -r``
    measured 1.4 to 5.5 s depending on how much memory the host had taken back meanwhile.
    Touching the memory a run will use just before it starts gives every configuration the
    same backed memory, as on a physical node. A no-op cost where memory is never taken back.
    """
    start = time.perf_counter()
    block = b"\x01" * nbytes  # filled, so every page is touched
    del block  # freed: returned to the kernel, still backed by the host for a while
    return time.perf_counter() - start


_LOCK_FDS: list[int] = []


def hold_bench_lock(workdir: str) -> None:
    """Take ``workdir``'s benchmark lock for the rest of this process, waiting for any other
    benchmark script that holds it: two never measure at once (one would disturb the other's
    cold runs). The kernel releases it when the process exits, however it exits."""
    os.makedirs(workdir, exist_ok=True)
    fd = os.open(os.path.join(workdir, ".bench.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print(f"waiting for another benchmark ({workdir}/.bench.lock)", file=sys.stderr, flush=True)
        fcntl.flock(fd, fcntl.LOCK_EX)
    _LOCK_FDS.append(fd)


def loadavg() -> str:
    """The 1, 5 and 15 minute load averages, as in /proc/loadavg."""
    with open("/proc/loadavg") as fh:
        return " ".join(fh.read().split()[:3])


def ensure_tree(
    repo: str, workdir: str, *, files: int, classes: int, mean_kb: float, regen: bool = False
) -> str:
    """The generated ImageNet-like tree under ``workdir`` (the one bench_pack.py makes):
    ``tree-f<files>-kb<mean>-c<classes>``, generated by scripts/gen_imagenet.py unless its
    ``.done`` stamp exists (generation is deterministic). Returns its path."""
    src = os.path.join(workdir, f"tree-f{files}-kb{mean_kb:g}-c{classes}")
    stamp = src + ".done"
    if os.path.exists(stamp) and not regen:
        return src
    remove_path(src)
    remove_path(stamp)
    argv = [
        sys.executable,
        os.path.join(repo, "scripts", "gen_imagenet.py"),
        src,
        "--files",
        str(files),
        "--classes",
        str(classes),
        "--mean-kb",
        f"{mean_kb:g}",
        "--quiet",
    ]
    print("generating", shlex.join(argv), file=sys.stderr)
    run = run_child(argv)
    if run.returncode != 0:
        raise SystemExit(f"generating the tree failed:\n{run.stderr_tail}")
    with open(stamp, "w") as fh:
        fh.write(shlex.join(argv) + "\n")
    return src


def import_streaming() -> None:
    """Make ``streaming.base...`` importable without running ``streaming/__init__``.

    ``import streaming`` imports ``streaming.vision``, which needs torchvision; the only
    torchvision wheel reachable here is a CUDA build that fails to load beside the CPU torch
    (or none is installed). The writer and ``streaming.base.dataset.StreamingDataset`` need
    neither, so when ``import streaming`` fails the package is registered without its
    ``__init__`` and ``streaming.base`` (which imports torch, as for any user) is imported
    normally. Call it in the child process that uses streaming only.

    Raises:
        ImportError: mosaicml-streaming is not installed.
    """
    import importlib.util

    spec = importlib.util.find_spec("streaming")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("mosaicml-streaming is not installed")
    try:
        import streaming  # noqa: F401 - a working install needs no detour
    except Exception:  # a broken torchvision raises RuntimeError, not ImportError
        for name in [m for m in sys.modules if m == "streaming" or m.startswith("streaming.")]:
            del sys.modules[name]
        pkg = types.ModuleType("streaming")
        pkg.__path__ = list(spec.submodule_search_locations)
        pkg.__spec__ = spec
        sys.modules["streaming"] = pkg


def warm_up(*paths: str) -> None:
    """Read every file under each of ``paths`` so that it sits in the page cache."""
    buf = bytearray(16 * MiB)
    view = memoryview(buf)
    for path in paths:
        for root, _, files in os.walk(path):
            for name in files:
                with open(os.path.join(root, name), "rb", buffering=0) as fh:
                    while fh.readinto(view):
                        pass


def select_named(parser: Any, only: str, items: Sequence[T]) -> list[T]:
    """The ``items`` whose ``.name`` is in the comma-separated ``only`` (all when empty);
    an unknown name is a usage error through ``parser``."""
    if not only:
        return list(items)
    names = [item.name for item in items]  # type: ignore[attr-defined]
    wanted = set(only.split(","))
    unknown = wanted - set(names)
    if unknown:
        parser.error(f"unknown --only names {sorted(unknown)}; known: {', '.join(names)}")
    return [item for item in items if item.name in wanted]  # type: ignore[attr-defined]
