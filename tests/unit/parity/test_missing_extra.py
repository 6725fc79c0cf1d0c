"""Without pyeclib, parity is one line naming the extra; packing and reading never need it."""

from __future__ import annotations

import subprocess
import sys


def test_without_pyeclib_the_codec_names_the_extra() -> None:
    code = (
        "import sys\n"
        "sys.modules['pyeclib'] = None  # as if not installed\n"
        "from shardio.errors import MissingExtraError\n"
        "from shardio.parity import ParityCodec\n"
        "try:\n"
        "    ParityCodec(2, 1, 4096)\n"
        "except MissingExtraError as exc:\n"
        "    print('ERR', exc)\n"
        "import shardio.read.reader, shardio.packing.run\n"
        "print('LOADED', sorted(m for m in sys.modules if m.startswith('shardio.parity.')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert "ERR shardio parity needs pyeclib: pip install pyeclib" in out
    assert "LOADED ['shardio.parity.codec']" in out  # the reader and packer load none of it


def test_pack_parity_without_pyeclib_says_so_in_one_line_and_writes_nothing(
    tmp_path: object,
) -> None:
    import pathlib

    root = pathlib.Path(str(tmp_path))
    (root / "src" / "a").mkdir(parents=True)
    (root / "src" / "a" / "x.bin").write_bytes(b"x" * 100)
    code = (
        "import sys\n"
        "sys.modules['pyeclib'] = None  # as if not installed\n"
        "from shardio.cli.main import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    run = [sys.executable, "-c", code]
    out = subprocess.run(
        [*run, "pack", str(root / "src"), str(root / "ds"), "--parity", "2+1", "--no-progress"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert out.returncode == 2, out  # a missing extra is the user's to install
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "shardio: error: shardio parity needs pyeclib: pip install pyeclib"
    ), out.stderr
    assert not (root / "ds").exists()
