"""The public API: every name in shardio.__all__ resolves to what its docs promise."""

from __future__ import annotations

import subprocess
import sys
import types

import shardio


def test_pack_is_the_function_whatever_was_imported_first() -> None:
    # `from shardio import PackOptions, pack` once bound the submodule shardio.pack; the
    # packing modules now live in shardio.packing, so `pack` is the function in every order.
    code = (
        "import shardio.packing.run, shardio.packing.merge\n"
        "from shardio import PackOptions, pack, merge_parts\n"
        "assert callable(pack) and pack.__name__ == 'pack', pack\n"
        "assert callable(merge_parts), merge_parts\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"


def test_every_public_name_resolves_and_none_is_a_module() -> None:
    assert shardio.__all__ == sorted(shardio.__all__)
    for name in shardio.__all__:
        value = getattr(shardio, name)
        assert not isinstance(value, types.ModuleType), name
