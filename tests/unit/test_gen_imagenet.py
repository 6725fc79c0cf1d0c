"""Tests for scripts/gen_imagenet.py, the synthetic ImageNet-like tree generator."""

from __future__ import annotations

import importlib.util
import pathlib
import re
import subprocess
import sys
from types import ModuleType

import pytest
from PIL import Image

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "gen_imagenet.py"
SYNSET_RE = re.compile(r"^n\d{8}$")


def _load_script() -> ModuleType:
    """Import scripts/gen_imagenet.py by path (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location("gen_imagenet", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being created
    spec.loader.exec_module(module)
    return module


gen = _load_script()


def _files(root: pathlib.Path) -> list[pathlib.Path]:
    """All files under ``root``, sorted by path."""
    return sorted(path for path in root.rglob("*") if path.is_file())


def test_layout_splits_and_counts(tmp_path: pathlib.Path) -> None:
    """Files land in OUT/<split>/<synset>/<synset>_<n>.JPEG, spread as documented."""
    out = tmp_path / "tree"
    result = gen.generate(out, files=200, classes=4, mean_kb=20, seed=3)

    assert sorted(child.name for child in out.iterdir()) == ["train", "val"]
    train = sorted(child.name for child in (out / "train").iterdir())
    val = sorted(child.name for child in (out / "val").iterdir())
    assert len(train) == 4
    assert train == val
    assert all(SYNSET_RE.match(name) for name in train)

    files = _files(out)
    assert len(files) == 200
    assert result.files == 200
    assert result.classes == 4
    assert result.bytes == sum(path.stat().st_size for path in files)
    assert result.seconds >= 0
    for path in files:
        synset = path.parent.name
        assert re.fullmatch(rf"{synset}_\d+\.JPEG", path.name), path
    val_files = [path for path in files if path.parts[-3] == "val"]
    assert len(val_files) == 4 * 3  # 5% of 50 per class, rounded half up
    names = [path.name for path in files]
    assert len(set(names)) == len(names)  # numbers are unique within a class across splits


def test_files_decode_as_jpeg(tmp_path: pathlib.Path) -> None:
    """Sampled files decode with Pillow as RGB JPEGs carrying their name in a comment."""
    gen.generate(tmp_path / "tree", files=200, classes=4, mean_kb=20, seed=1)
    files = _files(tmp_path / "tree")
    for path in files[::37]:
        with Image.open(path) as image:
            image.load()
            assert image.format == "JPEG"
            assert image.mode == "RGB"
            assert min(image.size) >= 100
            comment = image.info.get("comment", b"")
            assert path.name.encode() in comment


def test_deterministic(tmp_path: pathlib.Path) -> None:
    """The same arguments give byte-identical trees; another seed gives other synsets."""
    first = tmp_path / "a"
    second = tmp_path / "b"
    gen.generate(first, files=200, classes=4, mean_kb=20, seed=7)
    gen.generate(second, files=200, classes=4, mean_kb=20, seed=7)
    first_files = _files(first)
    second_files = _files(second)
    assert [path.relative_to(first) for path in first_files] == [
        path.relative_to(second) for path in second_files
    ]
    for left, right in zip(first_files, second_files, strict=True):
        assert left.read_bytes() == right.read_bytes(), left
    contents = [path.read_bytes() for path in first_files]
    assert len(set(contents)) == len(contents)  # every file is unique

    other = tmp_path / "c"
    gen.generate(other, files=200, classes=4, mean_kb=20, seed=8)
    assert sorted(child.name for child in (other / "train").iterdir()) != sorted(
        child.name for child in (first / "train").iterdir()
    )


def test_mean_size_near_request(tmp_path: pathlib.Path) -> None:
    """The mean file size is close to the requested one and sizes vary."""
    out = tmp_path / "tree"
    result = gen.generate(out, files=400, classes=4, mean_kb=110)
    sizes = [path.stat().st_size for path in _files(out)]
    assert len(sizes) == 400
    mean_kb = sum(sizes) / len(sizes) / 1000
    assert 110 * 0.75 <= mean_kb <= 110 * 1.25
    assert result.mean_kb == pytest.approx(mean_kb)
    assert min(sizes) >= 2000
    assert max(sizes) > 2 * min(sizes)  # sizes vary


def test_single_split(tmp_path: pathlib.Path) -> None:
    """A single split still writes OUT/<split>/..."""
    out = tmp_path / "tree"
    result = gen.generate(out, files=10, classes=2, mean_kb=10, splits=("train",))
    assert [child.name for child in out.iterdir()] == ["train"]
    assert len(_files(out / "train")) == 10
    assert result.files == 10


def test_refuses_non_empty_dir(tmp_path: pathlib.Path) -> None:
    """generate() refuses a non-empty output directory and leaves it alone."""
    (tmp_path / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="not empty"):
        gen.generate(tmp_path, files=10, classes=2, mean_kb=10)
    assert [path.name for path in tmp_path.iterdir()] == ["keep.txt"]


def test_rejects_bad_arguments(tmp_path: pathlib.Path) -> None:
    """Out-of-range arguments raise ValueError."""
    with pytest.raises(ValueError, match="at least classes"):
        gen.generate(tmp_path / "a", files=3, classes=4, mean_kb=10)
    with pytest.raises(ValueError, match="val_fraction"):
        gen.generate(tmp_path / "b", files=10, classes=2, mean_kb=10, val_fraction=1.0)
    with pytest.raises(ValueError, match="at least one split"):
        gen.generate(tmp_path / "c", files=10, classes=2, mean_kb=10, splits=())


def test_cli_non_empty_out_exits_2(tmp_path: pathlib.Path) -> None:
    """The CLI reports a non-empty OUT in one stderr line and exits 2."""
    (tmp_path / "keep.txt").write_text("x")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path), "--files", "10", "--classes", "2"],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert "not empty" in proc.stderr
    assert proc.stdout == ""


def test_cli_writes_tree_and_summary(tmp_path: pathlib.Path) -> None:
    """The CLI writes the tree and prints one summary line."""
    out = tmp_path / "tree"
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            str(out),
            "--files",
            "20",
            "--classes",
            "2",
            "--mean-kb",
            "15",
            "--splits",
            "train",
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.strip().splitlines()) == 1
    assert len(_files(out / "train")) == 20
