"""The CLI against a hostile user: closed pipes, bugs behind the library, odd destinations.

Every failure ends as one stderr line and a non-zero exit; a reader that goes away early
(``shardio ls DS | head``) ends the command quietly with exit 0.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from shardio.cli.progressbar import ProgressBar
from shardio.metrics.progress import ProgressSnapshot

W1 = ("--workers", "1", "--no-progress")
NUM_FILES = 3000  # ~110-byte paths: ~330 KB of `ls` output, five times a pipe's buffer


def cli_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SHARDIO_FAKE_"))}
    env.pop("PYTHONWARNINGS", None)
    return env


@pytest.fixture(scope="module")
def big_listing(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A dataset whose ``ls`` output is far larger than a pipe holds."""
    base = tmp_path_factory.mktemp("listing")
    src = base / "src"
    for c in range(3):
        (src / f"class_{c}").mkdir(parents=True)
    for i in range(NUM_FILES):
        (src / f"class_{i % 3}" / f"{'long_name_' * 9}{i:05d}.jpg").write_bytes(b"%d" % i)
    dst = base / "ds"
    proc = subprocess.run(
        [sys.executable, "-m", "shardio", "pack", src, dst, "--shard-size", "1MiB", *W1],
        capture_output=True,
        env=cli_env(),
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return dst


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    base = tmp_path_factory.mktemp("tiny")
    src = base / "src"
    (src / "a").mkdir(parents=True)
    for i in range(4):
        (src / "a" / f"{i}.bin").write_bytes(os.urandom(2000))
    dst = base / "ds"
    proc = subprocess.run(
        [sys.executable, "-m", "shardio", "pack", src, dst, "--shard-size", "4KiB", *W1],
        capture_output=True,
        env=cli_env(),
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return dst


def run_into_closed_pipe(*args: str | os.PathLike[str]) -> tuple[int, bytes]:
    """Run the CLI with stdout a pipe whose reader is already gone; return (rc, stderr)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "shardio", *map(os.fspath, args)],
            stdout=write_end,
            stderr=subprocess.PIPE,
            env=cli_env(),
            timeout=120,
            check=False,
        )
    finally:
        os.close(write_end)
    return proc.returncode, proc.stderr


def run_patched(code: str, *args: str | os.PathLike[str]) -> subprocess.CompletedProcess[str]:
    """Run ``main(args)`` in a fresh interpreter after ``code`` patched the library."""
    program = f"import sys\n{code}\nfrom shardio.cli.main import main\nsys.exit(main(sys.argv[1:]))"
    return subprocess.run(
        [sys.executable, "-c", program, *map(os.fspath, args)],
        capture_output=True,
        text=True,
        env=cli_env(),
        timeout=120,
        check=False,
    )


# -------------------------------------------------------------------------- closed pipes


@pytest.mark.parametrize("paths", [False, True])
def test_ls_into_head_ends_quietly(big_listing: pathlib.Path, paths: bool) -> None:
    """The packing guide's ``shardio ls DS | head``: exit 0, nothing on stderr (no "Broken pipe",
    no "Exception ignored")."""
    args = [sys.executable, "-m", "shardio", "ls", os.fspath(big_listing)]
    if paths:
        args.append("--paths")
    ls = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=cli_env())
    assert ls.stdout is not None and ls.stderr is not None
    head = subprocess.Popen(["head", "-1"], stdin=ls.stdout, stdout=subprocess.PIPE)
    ls.stdout.close()  # head holds the only read end: when it exits, the pipe is closed
    first, _ = head.communicate(timeout=120)
    err = ls.stderr.read()
    ls.stderr.close()
    assert ls.wait(timeout=120) == 0, err
    assert err == b""
    assert head.returncode == 0
    assert first.startswith(b"class_0/long_name_")
    assert first.endswith(b"00000.jpg\n" if paths else b"00000\n")


@pytest.mark.parametrize(
    "args",
    [("ls",), ("ls", "--paths"), ("inspect",), ("inspect", "--json"), ("verify", *W1)],
    ids=" ".join,
)
def test_output_into_a_closed_pipe_ends_quietly(tiny: pathlib.Path, args: tuple[str, ...]) -> None:
    """Small outputs fail only when flushed at the end: that too must be quiet."""
    rc, err = run_into_closed_pipe(args[0], tiny, *args[1:])
    assert (rc, err) == (0, b"")


def test_closed_pipe_keeps_the_exit_code_of_a_damaged_verify(
    tiny: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    damaged = tmp_path / "ds"
    shutil.copytree(tiny, damaged)
    shard = sorted((damaged / "shards").glob("*.tar"))[0]
    data = bytearray(shard.read_bytes())
    data[700] ^= 0xFF  # inside the first member
    shard.write_bytes(bytes(data))
    rc, err = run_into_closed_pipe("verify", damaged, "--json", "--workers", "1")
    assert (rc, err) == (3, b"")


def test_a_broken_pipe_that_is_not_stdout_is_an_error(tiny: pathlib.Path) -> None:
    code = (
        "import shardio.tools.verify\n"
        "def broken(*a, **k):\n"
        "    raise BrokenPipeError(32, 'Broken pipe')\n"
        "shardio.tools.verify.verify_dataset = broken"
    )
    proc = run_patched(code, "verify", tiny, *W1)
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == ["shardio: error: Broken pipe"]


def test_a_closed_progress_stream_does_not_stop_the_work() -> None:
    class Gone:
        writes = 0

        def isatty(self) -> bool:
            return True

        def write(self, text: str) -> int:
            Gone.writes += 1
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self) -> None:
            raise BrokenPipeError(32, "Broken pipe")

    bar = ProgressBar("packing", stream=Gone())  # type: ignore[arg-type]
    for done in range(3):
        bar(ProgressSnapshot(done, done * 10, 3, 30, 1.0, final=done == 2))
    assert Gone.writes == 1  # tried once, then stopped drawing


# ------------------------------------------------------------------------ the last resort


def test_an_unexpected_exception_is_one_internal_error_line(tiny: pathlib.Path) -> None:
    code = (
        "import shardio.tools.verify\n"
        "def bug(*a, **k):\n"
        "    raise RuntimeError('boom')\n"
        "shardio.tools.verify.verify_dataset = bug"
    )
    proc = run_patched(code, "verify", tiny, *W1)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert proc.stderr.splitlines() == [
        "shardio: internal error: RuntimeError: boom "
        "(rerun with -v for the traceback; please report it)"
    ]

    proc = run_patched(code, "-v", "verify", tiny, *W1)
    assert proc.returncode == 1
    assert proc.stderr.startswith("Traceback (most recent call last):")
    assert "in bug" in proc.stderr
    assert proc.stderr.splitlines()[-1] == (
        "shardio: internal error: RuntimeError: boom (please report it)"
    )


def test_a_pack_error_is_one_line(tmp_path: pathlib.Path) -> None:
    """What a killed pack worker becomes (shardio.packing.run turns BrokenProcessPool into
    PackError): one error line."""
    code = (
        "import shardio.packing.run\n"
        "from shardio.errors import PackError\n"
        "def killed(*a, **k):\n"
        "    raise PackError('a pack worker died (killed by signal 9, out of memory?)')\n"
        "shardio.packing.run.pack = killed"
    )
    (tmp_path / "src").mkdir()
    proc = run_patched(code, "pack", tmp_path / "src", tmp_path / "ds", *W1)
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        "shardio: error: a pack worker died (killed by signal 9, out of memory?)"
    ]


# ----------------------------------------------------------------------- odd destinations


def test_errors_naming_a_path_with_a_newline_stay_one_line(
    tmp_path: pathlib.Path, run_cli, assert_cli_error
) -> None:
    result = run_cli("verify", tmp_path / "two\nlines", *W1)
    assert result.rc == 1
    assert_cli_error(result, "two\\nlines")


def test_a_terminal_escape_in_a_path_is_shown_escaped(
    tmp_path: pathlib.Path, run_cli, assert_cli_error
) -> None:
    # A file name may hold an escape sequence; printed raw it would recolour or rewrite the
    # user's terminal.
    result = run_cli("verify", tmp_path / "x\x1b[2Jy", *W1)
    assert result.rc == 1
    assert "\x1b" not in result.stderr
    assert_cli_error(result, "x\\x1b[2Jy")


def test_unpack_below_a_file_is_one_line(
    tiny: pathlib.Path, tmp_path: pathlib.Path, run_cli, assert_cli_error
) -> None:
    (tmp_path / "file").write_bytes(b"mine")
    result = run_cli("unpack", tiny, tmp_path / "file" / "out")
    assert result.rc == 1
    line = assert_cli_error(result, f"{tmp_path / 'file' / 'out'}", "Not a directory")
    assert "b'" not in line
    assert (tmp_path / "file").read_bytes() == b"mine"


def test_unpack_into_the_current_directory_is_refused(
    tiny: pathlib.Path, tmp_path: pathlib.Path, run_cli, assert_cli_error
) -> None:
    """Renaming the tree onto the cwd would leave the shell in a deleted directory."""
    result = run_cli("unpack", tiny, ".", cwd=tmp_path)
    assert result.rc == 2
    assert_cli_error(result, "current directory")
    assert os.listdir(tmp_path) == []


def test_unpack_into_an_empty_name_is_refused(
    tiny: pathlib.Path, tmp_path: pathlib.Path, run_cli, assert_cli_error
) -> None:
    result = run_cli("unpack", tiny, "", cwd=tmp_path)
    assert result.rc == 2
    assert_cli_error(result, "empty")
    assert os.listdir(tmp_path) == []


def test_unpack_twice_into_the_same_out(
    tiny: pathlib.Path, tmp_path: pathlib.Path, run_cli, assert_cli_error
) -> None:
    out = tmp_path / "out"
    assert run_cli("unpack", tiny, out).rc == 0
    before = sorted(p.name for p in out.rglob("*"))
    result = run_cli("unpack", tiny, out)
    assert result.rc == 2
    assert_cli_error(result, str(out), "not empty")
    assert sorted(p.name for p in out.rglob("*")) == before
    assert sorted(os.listdir(tmp_path)) == ["out"]
