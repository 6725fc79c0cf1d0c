"""The public API: every name in shardio.__all__ resolves to what its docs promise."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

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


def test_a_renamed_name_warns_and_gives_the_new_one() -> None:
    """PackedDataset became ShardReader in 0.2: the old name warns and is the same class."""
    with pytest.warns(
        DeprecationWarning, match=r"shardio\.PackedDataset .* use shardio\.ShardReader"
    ):
        old = shardio.PackedDataset  # type: ignore[attr-defined]
    assert old is shardio.ShardReader
    assert "PackedDataset" not in shardio.__all__ and "PackedDataset" not in dir(shardio)


def test_the_old_staging_package_warns_and_forwards() -> None:
    code = (
        "import warnings\n"
        "warnings.simplefilter('error', DeprecationWarning)\n"
        "try:\n"
        "    import shardio.cache\n"
        "except DeprecationWarning as exc:\n"
        "    print(exc)\n"
        "warnings.simplefilter('ignore', DeprecationWarning)\n"
        "import shardio.cache, shardio.staging\n"
        "assert shardio.cache.stage_dataset is shardio.staging.stage_dataset\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "shardio.cache is deprecated" in out.stdout and "shardio.staging" in out.stdout


def test_the_distribution_is_named_apart_from_the_import_and_versioned_once() -> None:
    """The package index's "shardio" is another project: the distribution is shardio-hpc,
    the import and the command stay shardio, and pyproject's version is shardio's."""
    import pathlib
    import tomllib

    root = pathlib.Path(__file__).resolve().parents[2]
    project = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert project["name"] == "shardio-hpc"
    assert project["version"] == shardio.__version__
    assert project["scripts"]["shardio"].startswith("shardio.")
