"""inspect_dataset: the library function behind ``shardio inspect`` (the CLI prints it)."""

from __future__ import annotations

import json
import pathlib

import pytest
from trees import write_tree

from shardio.errors import FormatError
from shardio.packing.run import PackOptions, pack
from shardio.tools.inspect import CLASSES_SHOWN, inspect_dataset


def _pack(tmp_path: pathlib.Path, classes: int) -> pathlib.Path:
    tree = {
        f"c{c:02d}/{i}.jpg".encode(): bytes([c, i]) * 1500 for c in range(classes) for i in range(3)
    }
    src = tmp_path / "src"
    write_tree(src, tree)
    dst = tmp_path / "out"
    pack(src, dst, PackOptions(shard_size_bytes=4096, workers=1))
    return dst


def test_inspect_describes_what_was_packed(tmp_path: pathlib.Path) -> None:
    dst = _pack(tmp_path, classes=7)
    info = inspect_dataset(dst)
    assert info.manifest.num_samples == 21
    assert info.extensions == ("cls", "jpg")
    doc = info.to_json()
    json.dumps(doc)  # plain JSON
    assert doc["samples"] == 21 and doc["shards"] == len(info.manifest.shards) > 1
    assert doc["classes"] == 7
    assert [c["name"] for c in doc["label_map"]["first"]] == [
        f"c{c:02d}" for c in range(CLASSES_SHOWN)
    ]
    assert doc["filesystem"] == info.read_choice.fs.name
    assert doc["read_strategy"]["name"] == info.read_choice.strategy.name


def test_inspect_agrees_with_the_cli(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from shardio.cli.main import main

    dst = _pack(tmp_path, classes=2)
    assert main(["inspect", "--json", str(dst)]) == 0
    assert json.loads(capsys.readouterr().out) == inspect_dataset(str(dst)).to_json()


def test_inspect_of_a_directory_that_is_no_dataset_names_it(tmp_path: pathlib.Path) -> None:
    with pytest.raises(FormatError, match=str(tmp_path)):
        inspect_dataset(tmp_path)
