"""The CLI under an ordinary ``en_US.UTF-8`` locale, where Python's stdout is strict UTF-8.

Under CI's ``C.UTF-8`` (and any locale Python coerces) stdio uses ``surrogateescape``, which
hides the bug: a non-UTF-8 file name, decoded to lone surrogates, crashed every print of it
with UnicodeEncodeError under en_US.UTF-8. The locale is built into a private directory
(``LOCPATH``) when the system lacks it, so the test needs no root and changes nothing.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
from trees import read_tree

LOCALE = "en_US.UTF-8"
W1 = ("--workers", "1", "--no-progress")


def _system_has_locale() -> bool:
    try:
        out = subprocess.run(
            ["locale", "-a"], capture_output=True, text=True, check=True, timeout=30
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return False
    return any(line.lower().replace("-", "") == "en_us.utf8" for line in out.split())


@pytest.fixture(scope="module")
def en_us_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment of a CLI run under en_US.UTF-8 (no UTF-8 mode, no I/O encoding)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("LC_", "SLURM_", "SHARDIO_FAKE_"))
        and k not in {"LANG", "LANGUAGE", "PYTHONUTF8", "PYTHONIOENCODING", "PYTHONWARNINGS"}
    }
    env.update(LC_ALL=LOCALE, LANG=LOCALE)
    if not _system_has_locale():
        localedef = shutil.which("localedef")
        if localedef is None:
            pytest.skip("localedef (Debian: libc-bin) is not installed: cannot build en_US.UTF-8")
        locpath = tmp_path_factory.mktemp("locales")
        proc = subprocess.run(
            [localedef, "-i", "en_US", "-f", "UTF-8", os.fspath(locpath / LOCALE)],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        if not (locpath / LOCALE / "LC_CTYPE").exists():
            pytest.skip(
                "localedef could not build en_US.UTF-8 (Debian: install `locales` for "
                f"/usr/share/i18n/locales/en_US): {proc.stderr.strip()[-200:]}"
            )
        env["LOCPATH"] = os.fspath(locpath)
    # The point of the test: stdout really is strict here (not coerced, not UTF-8 mode).
    probe = subprocess.run(
        [sys.executable, "-c", "import sys; print(sys.stdout.encoding, sys.stdout.errors)"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    assert probe.stdout.split() == ["utf-8", "strict"], probe.stdout
    return env


def run_en_us(env: dict[str, str], *args: str | bytes | os.PathLike[str]) -> tuple[int, str, str]:
    proc = subprocess.run(
        [sys.executable, "-m", "shardio", *args],
        capture_output=True,
        env=env,
        timeout=300,
        check=False,
    )
    out = proc.stdout.decode("utf-8", "replace")
    err = proc.stderr.decode("utf-8", "replace")
    assert "Traceback" not in err, err
    assert "UnicodeEncodeError" not in err, err
    return proc.returncode, out, err


def test_commands_print_non_utf8_names_under_en_us(
    en_us_env: dict[str, str], tmp_path: pathlib.Path
) -> None:
    """pack (a non-UTF-8 FIFO skipped and reported), inspect (a non-UTF-8 class and DST),
    verify, ls, ls --paths and unpack (into a non-UTF-8 OUT): exit 0, no traceback."""
    base = os.fsencode(tmp_path)
    src = os.path.join(base, b"src")
    files = {
        b"caf\xe9/latin1-\xe9.jpg": os.urandom(300),
        b"caf\xe9/plain.jpg": os.urandom(300),
        b"dog/\xff\xfe.jpg": os.urandom(300),
        "dog/\u00fcml\u00e4ut.jpg".encode(): os.urandom(300),
    }
    for rel, data in files.items():
        path = os.path.join(src, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as fh:
            fh.write(data)
    os.mkfifo(os.path.join(src, b"dog/pipe-\xe9.jpg"))  # skipped, and named in the summary
    dst = os.path.join(base, b"ds-\xe9")

    rc, out, err = run_en_us(en_us_env, "pack", src, dst, *W1)
    assert rc == 0, err
    assert "skipped 1 file(s)" in out
    skipped = [line for line in out.splitlines() if "pipe-" in line]
    assert len(skipped) == 1, out
    assert skipped[0].isascii()  # the byte is escaped, the same under every locale
    assert "\\" in skipped[0]
    assert "FIFO" in skipped[0]

    rc, out, err = run_en_us(en_us_env, "inspect", dst)
    assert rc == 0, err
    assert "ds-\\udce9" in out
    assert "caf\\xe9" in out  # the class name: its byte, as the pack summary shows it
    rc, out, err = run_en_us(en_us_env, "inspect", dst, "--json")
    assert rc == 0, err
    assert json.loads(out)["samples"] == len(files)

    rc, out, err = run_en_us(en_us_env, "verify", dst, *W1)
    assert (rc, err) == (0, "")
    assert out.startswith("OK: verified")

    rc, out, err = run_en_us(en_us_env, "ls", dst)
    assert rc == 0, err
    assert len(out.splitlines()) == len(files)

    proc = subprocess.run(
        [sys.executable, "-m", "shardio", "ls", dst, "--paths"],
        capture_output=True,
        env=en_us_env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == sorted(files)  # raw bytes, unchanged

    restored = os.path.join(base, b"restored-\xe9")
    rc, out, err = run_en_us(en_us_env, "unpack", dst, restored)
    assert rc == 0, err
    assert out.startswith(f"unpacked {len(files)} files")
    assert "restored-\\udce9" in out
    assert read_tree(restored) == files


def test_errors_and_usage_mistakes_naming_non_utf8_paths(
    en_us_env: dict[str, str], tmp_path: pathlib.Path
) -> None:
    missing = os.path.join(os.fsencode(tmp_path), b"gone-\xe9")
    rc, _, err = run_en_us(en_us_env, "verify", missing, *W1)
    assert rc == 1
    assert err.splitlines() == [
        f"shardio: error: {tmp_path}/gone-\\udce9: no such directory "
        "(a dataset is a directory with a manifest)"
    ]

    rc, _, err = run_en_us(en_us_env, "pack", missing, b"x", "--shard-size", b"1\xe9B")
    assert rc == 2
    assert len(err.splitlines()) == 1
    assert err.startswith("shardio: error: ")
