"""Fixtures of the staging tests: packed sources (read-only, guarded), and staging checks.

Every source dataset here is session-scoped and must never change: an autouse fixture
compares each one's listing, sizes, mtimes and xxh3-128 after every test with what it was
when it was packed. Tests stage into their own ``tmp_path`` and damage only staged copies.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import pytest

from shardio.format.checksum import file_xxh3_128
from shardio.format.manifest import Manifest, load_manifest
from shardio.packing.run import PackOptions, pack
from shardio.read.reader import ShardReader
from shardio.storage.atomic import is_temp_name

SCRIPTS = pathlib.Path(__file__).resolve().parent / "scripts"
STAGE_DIR = ".shardio-stage"

# Variables of the job around the test run that would change what `stage` selects.
_JOB_ENV_PREFIXES = ("SLURM_", "SHARDIO_")
_JOB_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PYTHONWARNINGS", "MAKEFLAGS", "MFLAGS")

Snapshot = dict[str, tuple[int, int, int, int, int]]


def snapshot(root: pathlib.Path) -> Snapshot:
    """Every file under root (hidden ones included): relative path -> (size, mtime, ctime,
    inode, mode). The ctime moves with any write, rename over, chmod or utime (a process
    cannot set it back), so a file whose bytes changed cannot match, without hashing every
    source after every test."""
    out: Snapshot = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            rel = os.path.relpath(path, root)
            out[rel] = (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_mode)
    return out


_GUARDED: dict[pathlib.Path, Snapshot] = {}


@dataclasses.dataclass(frozen=True, repr=False)
class Source:
    """A packed source dataset and what its samples hold.

    Attributes:
        path: the dataset directory (never modified by any test).
        manifest: its manifest.
        payload: sample key -> the source file's bytes.
        label: sample key -> class index.
        keys: sample keys in dataset order.
        shard_of_sample: shard number of each sample, in dataset order.
    """

    path: pathlib.Path
    manifest: Manifest
    payload: Mapping[str, bytes]
    label: Mapping[str, int]
    keys: tuple[str, ...]
    shard_of_sample: tuple[int, ...]

    def __repr__(self) -> str:
        return f"Source({self.path.name}, {len(self.keys)} samples, {self.num_shards} shards)"

    @property
    def num_shards(self) -> int:
        return len(self.manifest.shards)

    @property
    def rels(self) -> list[str]:
        """Relative shard paths, in dataset order."""
        return [s.path for s in self.manifest.shards]

    def size_of(self, rels: Sequence[str] | set[str]) -> int:
        by_rel = {s.path: s.size_bytes for s in self.manifest.shards}
        return sum(by_rel[r] for r in rels)

    def staged(self, dest: pathlib.Path) -> set[str]:
        """Shards of this dataset present under their final names in dest."""
        return {s.path for s in self.manifest.shards if (dest / s.path).exists()}

    def stamped(self, dest: pathlib.Path) -> set[str]:
        """Shards with a verification stamp in dest."""
        ok = dest / STAGE_DIR / "ok"
        return {s.path for s in self.manifest.shards if (ok / stamp_name(s.path)).exists()}

    def assert_staged_ok(self, dest: pathlib.Path, expected: set[str] | None = None) -> None:
        """Every staged shard hashes to the manifest (and equals the source bytes' hash);
        with ``expected``, exactly those shards are staged. DALI indexes beside them equal
        the source's; the staged index and manifest are right."""
        staged = self.staged(dest)
        if expected is not None:
            assert staged == expected, (
                f"staged {len(staged)} shards, expected {len(expected)}: "
                f"extra {sorted(staged - expected)[:5]}, missing {sorted(expected - staged)[:5]}"
            )
        for entry in self.manifest.shards:
            if entry.path not in staged:
                continue
            got = file_xxh3_128(dest / entry.path)
            assert got == entry.xxh3_128, f"staged {entry.path} does not verify"
            if entry.dali_index is not None:
                idx = dest / entry.dali_index
                assert idx.exists(), f"no DALI index beside staged {entry.path}"
                assert idx.read_bytes() == (self.path / entry.dali_index).read_bytes(), (
                    f"staged {entry.dali_index} differs from the source's"
                )
        assert file_xxh3_128(dest / self.manifest.index.path) == self.manifest.index.xxh3_128
        local = load_manifest(dest / "manifest.json")
        assert local.staged_from == os.path.abspath(self.path)
        assert local.shards == self.manifest.shards

    def check_sample(self, sample: Mapping[str, Any]) -> str:
        """Assert one raw sample (``ds[i]``) holds the source's bytes; return its key."""
        key = sample["__key__"]
        assert set(sample) == {"__key__", "bin", "cls"}, sorted(sample)
        assert sample["bin"] == self.payload[key], f"bytes of {key} differ from the source"
        assert sample["cls"] == self.label[key], key
        return str(key)

    def samples_in(self, rel: str) -> list[int]:
        shard = self.rels.index(rel)
        return [i for i, s in enumerate(self.shard_of_sample) if s == shard]


def stamp_name(rel: str) -> str:
    return rel.replace("/", "__") + ".json"


def temp_files(root: pathlib.Path) -> list[str]:
    """shardio temp files anywhere under root (hidden folders included)."""
    return sorted(
        os.path.relpath(os.path.join(d, n), root)
        for d, _, names in os.walk(root)
        for n in names
        if is_temp_name(n)
    )


def write_tree(out: pathlib.Path, *, files: int, size_bytes: int, seed: int) -> None:
    """``files`` incompressible files in 4 class directories, sizes around size_bytes."""
    rng = random.Random(seed)
    for i in range(files):
        folder = out / f"class{i % 4}"
        folder.mkdir(parents=True, exist_ok=True)
        size = size_bytes + rng.randrange(-size_bytes // 8, size_bytes // 8 + 1)
        (folder / f"f{i:05d}.bin").write_bytes(rng.randbytes(size))


def _load_source(tree: pathlib.Path, dataset: pathlib.Path) -> Source:
    with ShardReader(dataset) as ds:
        classes = ds.manifest.classes
        assert classes is not None
        keys = tuple(ds.key(i) for i in range(len(ds)))
        shard_of = tuple(int(s) for s in ds.index.samples["shard"])
        manifest = ds.manifest
    payload, label = {}, {}
    for file in tree.rglob("*.bin"):
        key = file.relative_to(tree).as_posix()[: -len(".bin")]
        payload[key] = file.read_bytes()
        label[key] = classes.index(file.parent.name)
    assert set(payload) == set(keys)
    return Source(dataset, manifest, payload, label, keys, shard_of)


MakeSource = Callable[..., Source]


@pytest.fixture(scope="session")
def make_source(tmp_path_factory: pytest.TempPathFactory) -> MakeSource:
    """``make_source(name, files=, size_bytes=, shard_size_bytes=, fmt="tar", seed=0)`` ->
    Source: a packed dataset at ``.../<name>``, built once per session and guarded."""
    cache: dict[tuple[Any, ...], Source] = {}

    def get(
        name: str,
        *,
        files: int,
        size_bytes: int,
        shard_size_bytes: int,
        fmt: str = "tar",
        seed: int = 0,
    ) -> Source:
        ident = (name, files, size_bytes, shard_size_bytes, fmt, seed)
        if ident not in cache:
            base = tmp_path_factory.mktemp(f"src-{name}")
            write_tree(base / "tree", files=files, size_bytes=size_bytes, seed=seed)
            dataset = base / name
            pack(
                os.fspath(base / "tree"),
                os.fspath(dataset),
                PackOptions(shard_format=fmt, shard_size_bytes=shard_size_bytes, durable=False),
            )
            _GUARDED[dataset] = snapshot(dataset)
            cache[ident] = _load_source(base / "tree", dataset)
        return cache[ident]

    return get


@pytest.fixture(scope="session")
def big_src(make_source: MakeSource) -> Source:
    """320 files of ~128 KiB in 1 MiB tar shards: 40+ shards, ~40 MiB, 7 samples a shard."""
    src = make_source("bigds", files=320, size_bytes=128 * 1024, shard_size_bytes=1 << 20)
    assert src.num_shards >= 40
    return src


@pytest.fixture(scope="session")
def tiny_src(make_source: MakeSource) -> Source:
    """96 files of ~1.5 KiB in 8 KiB tar shards: ~48 shards of about 2 samples each, so
    that the nodes of a job need different shards."""
    src = make_source("tinyds", files=96, size_bytes=1536, shard_size_bytes=8192, seed=1)
    assert src.num_shards >= 40
    return src


@pytest.fixture(autouse=True)
def _sources_unchanged() -> Iterator[None]:
    """No test may modify a source dataset: compare listing + hashes after every test."""
    yield
    for path, before in _GUARDED.items():
        after = snapshot(path)
        changed = sorted(set(before) ^ set(after)) + sorted(
            k for k in set(before) & set(after) if before[k] != after[k]
        )
        assert not changed, f"source {path} was modified: {changed[:5]}"


def job_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a child: no SLURM/rank/SHARDIO variables of the test run's job."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(_JOB_ENV_PREFIXES) and k not in _JOB_ENV
    }
    env["PYTHONUNBUFFERED"] = "1"
    if extra:
        env.update(extra)
    return env


@pytest.fixture(scope="session")
def child_env() -> Callable[..., dict[str, str]]:
    """``child_env(extra=None)``: a clean environment for stage subprocesses."""
    return job_env


def wrapper_argv(*args: str | os.PathLike[str]) -> list[str]:
    """argv of ``python -m shardio ARGS`` run through scripts/stage_wrapper.py (barrier,
    slow copies, a held temp file: see the script)."""
    return [sys.executable, os.fspath(SCRIPTS / "stage_wrapper.py"), *map(os.fspath, args)]


@pytest.fixture(scope="session")
def stage_wrapper() -> Callable[..., list[str]]:
    """``stage_wrapper(*args)`` -> argv running ``shardio ARGS`` through the test wrapper."""
    return wrapper_argv


def wait_for(cond: Callable[[], bool], proc: subprocess.Popen[Any], timeout_s: float) -> bool:
    """Poll ``cond`` until it holds (True) or proc exits / the timeout passes (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        if proc.poll() is not None:
            return cond()
        time.sleep(0.002)
    return False


@pytest.fixture(scope="session")
def poll() -> Callable[..., bool]:
    """``poll(cond, proc, timeout_s)``: wait until cond() holds or proc ends."""
    return wait_for


@pytest.fixture(scope="session")
def helpers() -> Any:
    """Module-level helpers (temp_files, stamp_name, snapshot) for the test modules."""

    class _Helpers:
        temp_files = staticmethod(temp_files)
        stamp_name = staticmethod(stamp_name)
        snapshot = staticmethod(snapshot)

    return _Helpers


@pytest.fixture
def ro_mount(tmp_path: pathlib.Path) -> Iterator[Callable[[pathlib.Path], pathlib.Path]]:
    """``ro_mount(path)`` -> a read-only bind mount of ``path`` (a node disk remounted
    read-only after an I/O error); unmounted after the test. Skips unless root can mount
    (chmod does not stop root)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("a read-only bind mount needs root and mount(8)")
    mounted: list[pathlib.Path] = []

    def mount(path: pathlib.Path) -> pathlib.Path:
        point = tmp_path / f"ro-{len(mounted)}"
        point.mkdir()
        for argv in (
            ["mount", "--bind", str(path), str(point)],
            ["mount", "-o", "remount,ro,bind", str(point)],
        ):
            proc = subprocess.run(argv, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                if argv[1] == "-o":
                    subprocess.run(["umount", "-l", str(point)], check=False)
                pytest.skip(f"cannot make a read-only bind mount: {proc.stderr.strip()}")
            if argv[1] == "--bind":
                mounted.append(point)
        return point

    yield mount
    for point in reversed(mounted):
        subprocess.run(["umount", "-l", str(point)], check=False)
