"""Fixtures of the runtime tests: small packed datasets (tar and hdf5) and their source bytes.

Every dataset here is session-scoped and read-only by convention: a test that damages one
copies it first (``corrupt_copy``).
"""

from __future__ import annotations

import collections
import dataclasses
import importlib.util
import os
import pathlib
import shutil
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import ModuleType
from typing import Any

import pytest
import torch

from shardio.packing.run import PackOptions, pack
from shardio.read.reader import ShardReader
from shardio.runtime.batch import ByteColumn

REPO = pathlib.Path(__file__).resolve().parents[3]
SCRIPTS = pathlib.Path(__file__).resolve().parent / "scripts"

NUM_FILES = 600
NUM_CLASSES = 6
MEAN_KB = 5  # files of about 2-8 KB
SHARD_SIZE_BYTES = 256 * 1024
FORMATS = ("tar", "hdf5")

# Variables that make detect_ranks() see a multi-rank job; tests pass ranks explicitly or run
# with these removed so a SLURM allocation around the test run cannot change the results.
RANK_ENV = (
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def _load_generator() -> ModuleType:
    """Import scripts/gen_imagenet.py by path (scripts/ is not a package)."""
    name = "gen_imagenet"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / "gen_imagenet.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a child process: no rank variables, no warning overrides."""
    env = {k: v for k, v in os.environ.items() if k not in RANK_ENV and k != "PYTHONWARNINGS"}
    env["PYTHONUNBUFFERED"] = "1"
    env["OMP_NUM_THREADS"] = "1"
    if extra:
        env.update(extra)
    return env


@dataclasses.dataclass(frozen=True, repr=False)
class Packed:
    """One packed dataset and what its samples must hold.

    Attributes:
        path: the dataset directory.
        fmt: "tar" or "hdf5".
        source: the source tree.
        keys: sample keys in dataset order.
        payload: key -> the source file's bytes.
        label: key -> class index.
        shard_of: key -> shard number.
        shard_sizes: samples per shard.
    """

    path: pathlib.Path
    fmt: str
    source: pathlib.Path
    keys: tuple[str, ...]
    payload: Mapping[str, bytes]
    label: Mapping[str, int]
    shard_of: Mapping[str, int]
    shard_sizes: tuple[int, ...]

    def __repr__(self) -> str:
        # Short: pytest prints fixtures in failure reports, and the payloads are megabytes.
        return f"Packed({self.fmt}, {len(self.keys)} samples, {self.num_shards} shards)"

    @property
    def num_shards(self) -> int:
        return len(self.shard_sizes)

    def check_sample(self, sample: Mapping[str, Any]) -> str:
        """Assert one raw sample dict is right (types and bytes); return its key."""
        key = sample["__key__"]
        assert isinstance(key, str)
        assert set(sample) == {"__key__", "jpeg", "cls"}, sorted(sample)
        assert isinstance(sample["jpeg"], bytes)
        assert sample["jpeg"] == self.payload[key], key
        assert type(sample["cls"]) is int
        assert sample["cls"] == self.label[key], key
        return key

    def check_batch(self, batch: Mapping[str, Any]) -> list[str]:
        """Assert one raw batch is right (types, bytes, labels); return its keys."""
        assert set(batch) == {"__key__", "jpeg", "cls"}, sorted(batch)
        keys = batch["__key__"]
        assert isinstance(keys, list)
        assert all(isinstance(k, str) for k in keys)
        cls = batch["cls"]
        assert isinstance(cls, torch.Tensor)
        assert cls.dtype == torch.int64
        assert cls.shape == (len(keys),)
        jpeg = batch["jpeg"]
        assert isinstance(jpeg, ByteColumn)
        assert len(jpeg) == len(keys)
        for i, key in enumerate(keys):
            assert bytes(jpeg[i]) == self.payload[key], f"bytes of {key} differ"
            assert int(cls[i]) == self.label[key], key
        return list(keys)

    def member_of(self, key: str) -> tuple[str, int, int]:
        """(shard file, offset, size) of the jpeg member of ``key``."""
        with ShardReader(self.path) as ds:
            sample = self.keys.index(key)
            rec = ds.index.samples[sample]
            for m in ds.index.sample_member_range(sample):
                if ds.index.exts[int(ds.index.members[m]["ext_id"])] == "jpeg":
                    member = ds.index.members[m]
                    return (
                        ds.shard_path(int(rec["shard"])),
                        int(member["offset"]),
                        int(member["size"]),
                    )
        raise AssertionError(f"{key} has no jpeg member")

    def assert_exactly_once(self, keys: Sequence[str]) -> None:
        """Every sample of the dataset appears exactly once in ``keys``, nothing else does."""
        counts = collections.Counter(keys)
        dupes = sorted(k for k, n in counts.items() if n > 1)
        missing = set(self.keys) - set(counts)
        extra = set(counts) - set(self.keys)
        assert not dupes, f"{len(dupes)} key(s) delivered twice, e.g. {dupes[:3]}"
        assert not missing, f"{len(missing)} key(s) never delivered, e.g. {sorted(missing)[:3]}"
        assert not extra, f"{len(extra)} unknown key(s), e.g. {sorted(extra)[:3]}"
        assert len(keys) == len(self.keys)

    @staticmethod
    def keys_of(batches: Iterable[Mapping[str, Any]]) -> list[str]:
        """The keys of a sequence of batches, in order."""
        return [k for b in batches for k in b["__key__"]]


def _read_tree(src: pathlib.Path, dataset: pathlib.Path, fmt: str) -> Packed:
    with ShardReader(dataset) as ds:
        classes = ds.manifest.classes
        assert classes is not None
        keys = tuple(ds.key(i) for i in range(len(ds)))
        shard_of = {k: int(ds.index.samples[i]["shard"]) for i, k in enumerate(keys)}
        shard_sizes = tuple(s.num_samples for s in ds.manifest.shards)
    payload: dict[str, bytes] = {}
    label: dict[str, int] = {}
    for file in src.rglob("*"):
        if file.is_file():
            rel = file.relative_to(src).as_posix()
            key = rel.rsplit(".", 1)[0]
            payload[key] = file.read_bytes()
            label[key] = classes.index(file.parent.name)
    assert set(payload) == set(keys), "the dataset's keys are not the source files"
    return Packed(
        path=dataset,
        fmt=fmt,
        source=src,
        keys=keys,
        payload=payload,
        label=label,
        shard_of=shard_of,
        shard_sizes=shard_sizes,
    )


@pytest.fixture(scope="session")
def runtime_tree(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """600 JPEG files of about 2-8 KB in 6 classes (one split), read-only by convention."""
    src = tmp_path_factory.mktemp("runtime-tree") / "src"
    _load_generator().generate(
        src, files=NUM_FILES, classes=NUM_CLASSES, mean_kb=MEAN_KB, splits=("train",), seed=3
    )
    return src


PackTree = Callable[..., Packed]


@pytest.fixture(scope="session")
def pack_tree(tmp_path_factory: pytest.TempPathFactory) -> PackTree:
    """``pack_tree(src, fmt, shard_size_bytes)`` -> Packed, cached for the session."""
    cache: dict[tuple[str, str, int], Packed] = {}

    def get(src: pathlib.Path, fmt: str, shard_size_bytes: int = SHARD_SIZE_BYTES) -> Packed:
        ident = (os.fspath(src), fmt, shard_size_bytes)
        if ident not in cache:
            dst = tmp_path_factory.mktemp(f"rt-{fmt}-{shard_size_bytes}") / "ds"
            pack(
                os.fspath(src),
                os.fspath(dst),
                PackOptions(shard_format=fmt, shard_size_bytes=shard_size_bytes, durable=False),
            )
            cache[ident] = _read_tree(src, dst, fmt)
        return cache[ident]

    return get


@pytest.fixture(scope="session")
def packed_tar(runtime_tree: pathlib.Path, pack_tree: PackTree) -> Packed:
    """The 600-sample tree in 256 KiB tar shards (about 16 shards)."""
    packed = pack_tree(runtime_tree, "tar")
    assert packed.num_shards >= 8
    return packed


@pytest.fixture(scope="session")
def packed_hdf5(runtime_tree: pathlib.Path, pack_tree: PackTree) -> Packed:
    """The 600-sample tree in 256 KiB hdf5 shards."""
    packed = pack_tree(runtime_tree, "hdf5")
    assert packed.num_shards >= 8
    return packed


@pytest.fixture(params=FORMATS)
def packed(request: pytest.FixtureRequest) -> Packed:
    """The 600-sample dataset, once per shard format."""
    return request.getfixturevalue(f"packed_{request.param}")


@pytest.fixture
def corrupt_copy(tmp_path: pathlib.Path) -> Callable[[Packed, str], tuple[Packed, str, int]]:
    """``corrupt_copy(packed, key)`` -> (copy, shard file, offset): a copy of the dataset with
    one byte flipped in the middle of ``key``'s jpeg member."""

    def make(packed: Packed, key: str) -> tuple[Packed, str, int]:
        dst = tmp_path / f"corrupt-{packed.fmt}"
        shutil.copytree(packed.path, dst)
        copy = dataclasses.replace(packed, path=dst)
        shard, offset, size = copy.member_of(key)
        where = offset + size // 2
        with open(shard, "r+b") as fh:
            fh.seek(where)
            byte = fh.read(1)
            fh.seek(where)
            fh.write(bytes([byte[0] ^ 0x5A]))
        return copy, shard, where

    return make


@pytest.fixture(autouse=True)
def _single_rank_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run every test as a single rank, whatever job the test run itself sits in."""
    for name in RANK_ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="session")
def child_env() -> Callable[..., dict[str, str]]:
    """``child_env(extra=None)``: the environment of a child process (no rank variables)."""
    return clean_env


@pytest.fixture(scope="session")
def scripts_dir() -> pathlib.Path:
    """tests/unit/runtime/scripts: the programs the process-level tests run."""
    return SCRIPTS
