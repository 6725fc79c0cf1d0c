"""Every fenced block of the README and the docs site, run as a reader would run it.

A page is read top to bottom; its blocks run in order, in one directory of their own, each in
a fresh process: Python blocks with this interpreter (``DeprecationWarning`` an error), shell
blocks with ``bash -eu`` (no pipefail: ``tar -tvf X | head`` ends as it does for a reader),
``console`` blocks as the ``$ `` lines they show (each
other line must appear in what they print). ``json``, ``yaml`` and ``toml`` blocks must parse;
``text`` blocks are output shown to the reader, not code. A block without a language fails.

The directory looks like a checkout: ``scripts``, ``examples``, ``benchmarks`` and ``.venv``
linked to this one, ``Makefile`` and ``pyproject.toml`` copied with their times (so ``make
install`` finds the install done), and ``imagenet/``: a small ImageNet-like tree of real
JPEGs (``train/`` and ``val/``, 4 classes), the data every example starts from. ``shardio``
and ``python`` are this checkout's (its venv first on ``PATH``).

HTML comments, invisible on GitHub and on the site, steer a block:

- ``<!-- test: exit=3 fakes=lfs,beegfs-ctl timeout=120 -->`` right before a block (blank lines
  between are fine): the exit status it must end with (default 0); the recording fakes of
  tools that cannot run here (tests/fakebin: ``lfs``, ``beegfs-ctl``, ``beeond``, ...) first
  on ``PATH``; its time limit in seconds (default 300). ``by=wheel-smoke``: the block installs
  shardio, and scripts/wheel_smoke.sh runs it (in a fresh venv, in the unpacked sdist)
  instead of this runner. ``by=ci``: the block is commands that .ci/run runs (``make test``
  cannot run inside itself); each must be a line of .ci/run.
- ``<!-- test-setup:`` newline, shell lines, ``-->``: run (bash) before the next block, in the
  same directory, e.g. to damage a shard that the next block repairs.
- ``<!-- test-page: needs=slurm -->`` anywhere on a page: the page runs in tests/slurm, under
  the real one-host SLURM cluster (``sbatch``, ``srun`` and ``SLURM_CONF`` in its environment),
  not in tests/docs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import tomllib

REPO = pathlib.Path(__file__).resolve().parents[1]
FAKEBIN = REPO / "tests" / "fakebin"
# The pages whose blocks run: the README and every page of the site.
PAGES_GLOB = "docs/**/*.md"
RUN_LANGS = ("python", "sh", "bash", "console")
PARSE_LANGS = ("json", "yaml", "toml")
SHOWN_LANGS = ("text",)
KNOWN_KEYS = ("exit", "fakes", "timeout", "by")

_FENCE = re.compile(r"^(?P<indent>[ ]*)(?P<ticks>```+)(?P<info>[^`\n]*)$")
_DIRECTIVE = re.compile(r"^\s*<!--\s*test:(?P<body>.*?)-->\s*$")
_SETUP_OPEN = re.compile(r"^\s*<!--\s*test-setup:\s*$")
_PAGE = re.compile(r"<!--\s*test-page:(?P<body>.*?)-->")


class PageError(ValueError):
    """A page whose blocks or comments the runner cannot read."""


@dataclasses.dataclass
class Block:
    page: str
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    options: dict[str, str]
    setup: str  # shell lines of a test-setup comment before it ("" when none)

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


@dataclasses.dataclass
class Page:
    name: str
    blocks: list[Block]
    needs: set[str]


def pages() -> list[str]:
    """The README and every Markdown page under docs/, relative to the checkout."""
    found = ["README.md"]
    found += sorted(str(p.relative_to(REPO)) for p in REPO.glob(PAGES_GLOB))
    return found


def needs(name: str) -> set[str]:
    """What a page's ``test-page`` comment says it needs (read without parsing its blocks, so
    a page the runner cannot read still gets its test, which then fails naming the problem)."""
    text = (REPO / name).read_text(encoding="utf-8")
    return {w.partition("=")[2] for m in _PAGE.finditer(text) for w in m.group("body").split()}


def _options(body: str, where: str) -> dict[str, str]:
    options = {}
    for word in shlex.split(body):
        key, sep, value = word.partition("=")
        if not sep or key not in KNOWN_KEYS:
            raise PageError(f"{where}: unknown test option {word!r} (known: {KNOWN_KEYS})")
        options[key] = value
    return options


def parse(name: str, text: str | None = None) -> Page:
    """The blocks of one page, with the comments that steer them."""
    if text is None:
        text = (REPO / name).read_text(encoding="utf-8")
    lines = text.splitlines()
    needs: set[str] = set()
    for match in _PAGE.finditer(text):
        for word in shlex.split(match.group("body")):
            key, _, value = word.partition("=")
            if key != "needs" or value not in ("slurm",):
                raise PageError(f"{name}: test-page takes needs=slurm, not {word!r}")
            needs.add(value)
    blocks: list[Block] = []
    pending: dict[str, str] = {}
    setup = ""
    i = 0
    while i < len(lines):
        line = lines[i]
        if _SETUP_OPEN.match(line):
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "-->"), None)
            if end is None:
                raise PageError(f"{name}:{i + 1}: a test-setup comment that never ends")
            setup = "\n".join(lines[i + 1 : end]) + "\n"
            i = end + 1
            continue
        directive = _DIRECTIVE.match(line)
        if directive:
            pending = _options(directive.group("body"), f"{name}:{i + 1}")
            i += 1
            continue
        fence = _FENCE.match(line)
        if fence:
            indent, ticks = fence.group("indent"), fence.group("ticks")
            info = fence.group("info").strip()
            lang = info.split()[0].strip("{}.") if info else ""
            body = []
            j = i + 1
            while j < len(lines) and lines[j].strip() != ticks:
                body.append(lines[j][len(indent) :] if lines[j].startswith(indent) else lines[j])
                j += 1
            if j == len(lines):
                raise PageError(f"{name}:{i + 1}: a code block that never ends")
            if lang not in RUN_LANGS + PARSE_LANGS + SHOWN_LANGS:
                raise PageError(
                    f"{name}:{i + 1}: a block in {lang or 'no language'}: give it one of "
                    f"{RUN_LANGS + PARSE_LANGS + SHOWN_LANGS}"
                )
            blocks.append(Block(name, i + 1, lang, "\n".join(body) + "\n", pending, setup))
            pending, setup = {}, ""
            i = j + 1
            continue
        if line.strip() and pending:
            raise PageError(f"{name}:{i + 1}: a test comment not followed by a code block")
        i += 1
    if pending or setup:
        raise PageError(f"{name}: a test comment at the end, with no block after it")
    return Page(name, blocks, needs)


def make_world(root: pathlib.Path, data: pathlib.Path) -> pathlib.Path:
    """A directory that looks like a checkout with the example data (a copy of ``data``)."""
    home = root / "work"
    home.mkdir(parents=True)
    for name in ("scripts", "examples", "benchmarks", ".venv"):
        if (REPO / name).exists():
            (home / name).symlink_to(REPO / name)
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy2(REPO / name, home / name)
    shutil.copytree(data, home / "imagenet", symlinks=True)
    return home


def make_data(root: pathlib.Path) -> pathlib.Path:
    """The example data: 96 real JPEGs of 4 classes in train/ and val/ (about 2 KB each)."""
    out = root / "imagenet"
    subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gen_imagenet.py"), str(out), "--files", "96",
         "--classes", "4", "--mean-kb", "2", "--val-fraction", "0.25", "--quiet"],
        check=True, timeout=120,
    )  # fmt: skip
    return out


def _env(block: Block, home: pathlib.Path, extra: dict[str, str]) -> dict[str, str]:
    bindir = str(pathlib.Path(sys.executable).parent)
    path = [bindir, os.environ.get("PATH", "")]
    fakes = [f for f in block.options.get("fakes", "").split(",") if f]
    for tool in fakes:
        if not (FAKEBIN / tool).is_dir():
            raise PageError(f"{block.where}: no fake of {tool!r} in tests/fakebin")
    path[:0] = [str(FAKEBIN / tool) for tool in fakes]
    env = {**os.environ, **extra}
    env.update(
        PATH=os.pathsep.join(path),
        PYTHONWARNINGS="error::DeprecationWarning",
        SHARDIO_FAKE_LOG=str(home.parent / "fakes.log"),
        HOME=str(home),
        COLUMNS="80",  # argparse wraps help to the terminal: the width the pages show
    )
    env.pop("PYTHONPATH", None)
    return env


def _console(code: str) -> tuple[str, list[str]]:
    """A console block's commands (the ``$ `` lines, ``\\`` continued) and expected lines."""
    commands, expected = [], []
    lines = code.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("$ "):
            command = line[2:]
            while command.endswith("\\") and i + 1 < len(lines):
                i += 1
                command += "\n" + lines[i]
            commands.append(command)
        elif line.strip() and line.strip() != "...":
            expected.append(line.strip())
        i += 1
    return "\n".join(commands) + "\n", expected


RUNNERS = {"wheel-smoke": REPO / "scripts" / "wheel_smoke.sh", "ci": REPO / ".ci" / "run"}


def commands(code: str) -> list[str]:
    """A shell block's commands, comments and blank lines dropped."""
    found = []
    for line in code.splitlines():
        command = line.split(" #", 1)[0].strip()
        if command and not command.startswith("#"):
            found.append(command)
    return found


def _check_runner(block: Block, by: str) -> None:
    """A block another runner runs: that runner exists and really runs it."""
    if by not in RUNNERS:
        raise PageError(f"{block.where}: by={by!r}: the runners are {sorted(RUNNERS)}")
    script = RUNNERS[by].read_text(encoding="utf-8")
    if by == "wheel-smoke":
        assert "by=wheel-smoke" in script, f"{block.where}: wheel_smoke.sh no longer runs it"
        return
    lines = [line.strip() for line in script.splitlines() if not line.strip().startswith("#")]
    for command in commands(block.code):
        assert any(line.endswith(command) or f"{command} " in line for line in lines), (
            f"{block.where}: .ci/run does not run {command!r}"
        )


def run_block(block: Block, home: pathlib.Path, extra_env: dict[str, str] | None = None) -> str:
    """Run one block in ``home``; raise AssertionError with its output when it fails."""
    env = _env(block, home, extra_env or {})
    if block.setup:
        done = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", block.setup],
            cwd=home, env=env, capture_output=True, text=True, timeout=300, check=False,
        )  # fmt: skip
        assert done.returncode == 0, f"{block.where}: its test-setup failed:\n{done.stderr}"
    if block.lang in SHOWN_LANGS:
        return ""
    if block.lang == "json":
        try:
            json.loads(block.code)
        except ValueError as exc:
            raise AssertionError(f"{block.where}: not JSON: {exc}") from None
        return ""
    if block.lang == "yaml":
        import yaml

        yaml.safe_load(block.code)
        return ""
    if block.lang == "toml":
        tomllib.loads(block.code)
        return ""
    by = block.options.get("by")
    if by is not None:
        _check_runner(block, by)
        return ""
    expected: list[str] = []
    if block.lang == "python":
        script = home.parent / f"block-{block.line}.py"
        script.write_text(block.code, encoding="utf-8")
        argv = [sys.executable, str(script)]
    else:
        code = block.code
        if block.lang == "console":
            code, expected = _console(code)
        argv = ["bash", "-eu", "-c", code]
    want = int(block.options.get("exit", "0"))
    timeout = float(block.options.get("timeout", "300"))
    try:
        done = subprocess.run(
            argv, cwd=home, env=env, capture_output=True, text=True, timeout=timeout,
            stdin=subprocess.DEVNULL, check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{block.where}: still running after {timeout:g} s") from None
    output = done.stdout + done.stderr
    assert done.returncode == want, (
        f"{block.where}: {block.lang} block exited {done.returncode}, not {want}:\n{output[-4000:]}"
    )
    for line in expected:
        assert line in output, f"{block.where}: the output lacks {line!r}:\n{output[-4000:]}"
    return output


def run_page(
    page: Page, root: pathlib.Path, data: pathlib.Path, extra_env: dict[str, str] | None = None
) -> pathlib.Path:
    """Run every block of a page in order in a fresh checkout-like directory under ``root``."""
    home = make_world(root, data)
    for block in page.blocks:
        run_block(block, home, extra_env)
    return home
