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
        "import shardio.read.packed, shardio.packing.run\n"
        "print('LOADED', sorted(m for m in sys.modules if m.startswith('shardio.parity.')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert "ERR shardio parity needs pyeclib: pip install 'shardio[parity]'" in out
    assert "LOADED ['shardio.parity.codec']" in out  # the reader and packer load none of it
