"""One reader/writer conformance suite, run for every shard format.

``ReaderWriterSuite`` holds the checks every format must pass (read back, unpack, verify,
determinism, manifest consistency); ``TestTar`` and ``TestHDF5`` bind it to a format with
``shard_format`` and add what only that format promises (WebDataset, GNU tar and DALI read
tar shards; plain h5py reads HDF5 shards).
"""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import sys
import tarfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import h5py
import numpy as np
import pytest
from trees import read_tree, write_tree

from shardio.format.checksum import file_xxh3_128
from shardio.format.keys import decode_component, split_name
from shardio.format.manifest import parse_manifest
from shardio.format.spec import (
    FORMAT_VERSION,
    INDEX_FILENAME,
    MANIFEST_FILENAME,
    REPORT_FILENAME,
    SHARD_DIR,
)
from shardio.packing.run import PackOptions, PackResult, pack
from shardio.read.reader import ShardReader
from shardio.tools.unpack import unpack_dataset
from shardio.tools.verify import verify_dataset


def _pattern(size: int, seed: int) -> bytes:
    """Deterministic, non-repeating-looking bytes (no randomness: failures must reproduce)."""
    return bytes((i * 131 + seed * 71 + (i >> 8) * 7) % 256 for i in range(size))


CLASS_DIRS = (b"cat", "dog \u00f1".encode(), b"raw\xff")

# Relative path (raw bytes) -> content. Class-dirs layout, so every sample gets a label.
TREE: dict[bytes, bytes] = {
    b"cat/empty.bin": b"",
    b"cat/five.kib.jpeg": _pattern(5 * 1024, 1),
    b"cat/x.JPEG": _pattern(513, 2),
    b"cat/x.jpeg": _pattern(511, 3),
    b"cat/x.json": b'{"caption": "a cat"}\n',
    b"cat/several.dots.in.name.txt": _pattern(100, 4),
    b"cat/no_extension": _pattern(7, 5),
    b"cat/.hidden": _pattern(1, 6),
    b"cat/.hidden.cfg": b"k=v\n",
    b"cat/trailing.": _pattern(512, 7),
    b"cat/UPPER.PNG": _pattern(1000, 8),
    "dog \u00f1/with space.jpeg".encode(): _pattern(300, 9),
    "dog \u00f1/caf\u00e9 \u65e5\u672c.jpeg".encode(): _pattern(1500, 10),
    "dog \u00f1/%41 percent.bin".encode(): _pattern(42, 11),
    # A key over 100 bytes once encoded: the tar writer needs a pax header for it.
    ("dog \u00f1/" + "\u00e9" * 60 + ".jpeg").encode(): _pattern(64, 12),
    b"raw\xff/\xff\xfe latin.jpeg": _pattern(2048, 13),
    b"raw\xff/\xe9t\xe9.bin": _pattern(333, 14),
    b"raw\xff/big.bin": _pattern(20_000, 15),  # larger than a shard: gets its own
    b"raw\xff/one": b"\x00",
}

SHARD_SIZE_BYTES = 8192


@dataclass(frozen=True)
class SourceTree:
    """A source tree on disk and what it holds."""

    root: str
    files: dict[bytes, bytes]
    classes: tuple[bytes, ...]


def dataset_files(root: str | Path) -> dict[str, bytes]:
    """Every file of a packed dataset as relative path -> content."""
    return {os.fsdecode(k): v for k, v in read_tree(root).items()}


@pytest.fixture(scope="session")
def source_tree(tmp_path_factory: pytest.TempPathFactory) -> SourceTree:
    root = tmp_path_factory.mktemp("conformance-src")
    write_tree(root, TREE)
    return SourceTree(str(root), dict(TREE), tuple(sorted(CLASS_DIRS)))


@dataclass(frozen=True)
class Packed:
    """A dataset packed from the source tree."""

    root: str
    result: PackResult


def pack_tree(src: str, dst: Path, shard_format: str, *, workers: int = 1) -> Packed:
    options = PackOptions(
        shard_format=shard_format,
        shard_size_bytes=SHARD_SIZE_BYTES,
        workers=workers,
        durable=False,
    )
    return Packed(str(dst), pack(src, str(dst), options))


def samples_by_key(root: str) -> dict[str, dict[str, Any]]:
    """Every sample of a dataset as key -> {ext: bytes or label, ...}."""
    with ShardReader(root) as ds:
        return {ds.key(i): ds.read_sample(i) for i in range(len(ds))}


class ReaderWriterSuite:
    """Checks every shard format must pass. Subclasses set ``shard_format``."""

    shard_format: ClassVar[str]
    suffix: ClassVar[str]

    @pytest.fixture(scope="class")
    @classmethod
    def packed(cls, source_tree: SourceTree, tmp_path_factory: pytest.TempPathFactory) -> Packed:
        dst = tmp_path_factory.mktemp(f"packed-{cls.shard_format}")
        return pack_tree(source_tree.root, dst, cls.shard_format)

    # --- reading --------------------------------------------------------------------

    def test_every_member_reads_back_the_source_bytes(
        self, packed: Packed, source_tree: SourceTree
    ) -> None:
        seen: dict[bytes, bytes] = {}
        with ShardReader(packed.root) as ds:
            index = ds.index
            for i in range(len(ds)):
                sample = ds.read_sample(i)
                assert sample["__key__"] == ds.key(i)
                for m in index.sample_member_range(i):
                    ext = index.exts[int(index.members[m]["ext_id"])]
                    path = index.member_path(m)
                    if path:
                        assert sample[ext] == source_tree.files[path], path
                        assert path not in seen
                        seen[path] = sample[ext]
                    else:
                        assert ext == "cls"
                        assert sample[ext] == int(index.samples[i]["label"])
        assert seen == source_tree.files

    def test_samples_group_files_by_directory_and_stem(
        self, packed: Packed, source_tree: SourceTree
    ) -> None:
        with ShardReader(packed.root) as ds:
            index = ds.index
            keys = [ds.key(i) for i in range(len(ds))]
            for i, key in enumerate(keys):
                assert "." not in key and " " not in key
                assert key.isascii()
                paths = [index.member_path(m) for m in index.sample_member_range(i)]
                for path in filter(None, paths):
                    folder, name = path.rsplit(b"/", 1)
                    assert decode_component(key) == folder + b"/" + split_name(name)[0]
        assert len(set(keys)) == len(keys)
        stems = {
            (p.rsplit(b"/", 1)[0], split_name(p.rsplit(b"/", 1)[1])[0]) for p in source_tree.files
        }
        assert len(keys) == len(stems)
        assert keys == sorted(keys, key=decode_component)

    def test_labels_follow_the_class_directories(
        self, packed: Packed, source_tree: SourceTree
    ) -> None:
        with ShardReader(packed.root) as ds:
            assert ds.manifest.label_layout == "class-dirs"
            assert ds.manifest.classes == tuple(os.fsdecode(c) for c in source_tree.classes)
            for i in range(len(ds)):
                path = ds.index.member_path(ds.index.sample_member_range(i)[0])
                label = source_tree.classes.index(path.split(b"/")[0])
                assert int(ds.index.samples[i]["label"]) == label
                assert ds.read_sample(i)["cls"] == label

    def test_case_variants_of_an_extension_are_distinct_members(self, packed: Packed) -> None:
        sample = samples_by_key(packed.root)["cat/x"]
        assert set(sample) == {"__key__", "jpeg", "jpeg_1", "json", "cls"}
        assert sample["jpeg"] == TREE[b"cat/x.JPEG"]
        assert sample["jpeg_1"] == TREE[b"cat/x.jpeg"]

    def test_cls_source_files_of_an_unlabelled_tree_read_back_as_bytes(
        self, tmp_path: Path
    ) -> None:
        # Without labels, a source file may carry the cls extension itself; it is data, not a
        # label (docs/format.md: path_length 0 marks the synthesised cls member).
        files = {b"x.cls": b"not a number", b"x.jpg": b"jpeg", b"deeper/y.CLS": b""}
        src = write_tree(tmp_path / "src", files)
        dst = tmp_path / "out"
        pack(src, str(dst), PackOptions(shard_format=self.shard_format, durable=False))
        samples = samples_by_key(str(dst))
        assert samples == {
            "deeper/y": {"__key__": "deeper/y", "cls": b""},
            "x": {"__key__": "x", "cls": b"not a number", "jpg": b"jpeg"},
        }

    # --- round trips ----------------------------------------------------------------

    def test_unpack_restores_the_tree_byte_for_byte(
        self, packed: Packed, source_tree: SourceTree, tmp_path: Path
    ) -> None:
        out = tmp_path / "restored"
        result = unpack_dataset(packed.root, out)
        restored = read_tree(out)
        assert restored.keys() == source_tree.files.keys()
        for path, data in source_tree.files.items():
            assert restored[path] == data, path
        assert result.files == len(source_tree.files)
        assert result.bytes == sum(map(len, source_tree.files.values()))

    def test_verify_passes(self, packed: Packed) -> None:
        report = verify_dataset(packed.root)
        assert report.ok, report.problems
        assert report.damaged_samples == ()
        assert report.shards_checked == packed.result.num_shards
        assert report.bytes_checked == packed.result.total_bytes

    @pytest.mark.parametrize("workers", [1, 2])
    def test_pack_is_deterministic(
        self, packed: Packed, source_tree: SourceTree, tmp_path: Path, workers: int
    ) -> None:
        again = pack_tree(source_tree.root, tmp_path / "again", self.shard_format, workers=workers)
        first, second = dataset_files(packed.root), dataset_files(again.root)
        assert sorted(first) == sorted(second)
        for name in first:
            assert first[name] == second[name], f"{name} differs between two packs"

    # --- what is on disk ------------------------------------------------------------

    def test_dataset_holds_only_final_files(self, packed: Packed) -> None:
        names = sorted(dataset_files(packed.root))
        shards = [f"{SHARD_DIR}/shard-{i:06d}" for i in range(packed.result.num_shards)]
        expected = [INDEX_FILENAME, MANIFEST_FILENAME, REPORT_FILENAME]
        expected += [s + self.suffix for s in shards]
        if self.shard_format == "tar":
            expected += [s + ".idx" for s in shards]
        assert names == sorted(expected)

    def test_manifest_matches_the_shards_on_disk(
        self, packed: Packed, source_tree: SourceTree
    ) -> None:
        root = Path(packed.root)
        data = (root / MANIFEST_FILENAME).read_bytes()
        manifest = parse_manifest(data)
        assert manifest.dumps() == data
        assert manifest.format_version == FORMAT_VERSION == 3
        assert manifest.shard_format == self.shard_format
        assert manifest.options["shard_size_bytes"] == SHARD_SIZE_BYTES
        index_path = root / manifest.index.path
        assert manifest.index.size_bytes == index_path.stat().st_size
        assert manifest.index.xxh3_128 == file_xxh3_128(index_path)
        with ShardReader(packed.root) as ds:
            shard_of_sample = ds.index.samples["shard"]
            assert manifest.num_samples == len(ds)
            assert manifest.num_members == len(ds.index.members)
            # data_bytes counts the packed files, not the label members shardio adds.
            assert manifest.data_bytes == sum(map(len, source_tree.files.values()))
            assert ds.index.n_shards == len(manifest.shards)
            assert np.all(np.diff(shard_of_sample.astype(np.int64)) >= 0)
            first = 0
            for i, shard in enumerate(manifest.shards):
                path = root / shard.path
                assert shard.path == f"{SHARD_DIR}/shard-{i:06d}{self.suffix}"
                assert shard.size_bytes == path.stat().st_size
                assert shard.xxh3_128 == file_xxh3_128(path)
                assert shard.first_sample == first
                assert shard.num_samples == int(np.count_nonzero(shard_of_sample == i))
                assert shard.num_samples > 0
                first += shard.num_samples
                if self.shard_format == "tar":
                    assert shard.dali_index == f"{SHARD_DIR}/shard-{i:06d}.idx"
                else:
                    assert shard.dali_index is None
        assert manifest.total_bytes == packed.result.total_bytes
        assert packed.result.num_files == len(source_tree.files)
        assert packed.result.skipped == ()
        assert packed.result.oversized == ("raw%FF/big",)
        assert len(manifest.shards) > 2  # the shard size was chosen to cut several

    def test_member_ranges_stay_inside_their_shard(self, packed: Packed) -> None:
        with ShardReader(packed.root) as ds:
            for i in range(len(ds)):
                shard = ds.manifest.shards[int(ds.index.samples[i]["shard"])]
                for m in ds.index.sample_member_range(i):
                    rec = ds.index.members[m]
                    assert int(rec["offset"]) + int(rec["size"]) <= shard.size_bytes


class TestTar(ReaderWriterSuite):
    shard_format = "tar"
    suffix = ".tar"

    @staticmethod
    def _shard_members(packed: Packed) -> list[list[tuple[str, int, int, bytes]]]:
        """Per shard, the members the index promises: (name, offset, size, bytes)."""
        out: list[list[tuple[str, int, int, bytes]]] = []
        with ShardReader(packed.root) as ds:
            out = [[] for _ in ds.manifest.shards]
            for i in range(len(ds)):
                shard = int(ds.index.samples[i]["shard"])
                sample = ds.read_sample(i, verify=True)
                for m in ds.index.sample_member_range(i):
                    rec = ds.index.members[m]
                    ext = ds.index.exts[int(rec["ext_id"])]
                    value = sample[ext]
                    data = b"%d" % value if ext == "cls" else value
                    out[shard].append(
                        (f"{ds.key(i)}.{ext}", int(rec["offset"]), int(rec["size"]), data)
                    )
        return out

    def test_tarfile_lists_key_dot_ext_members(self, packed: Packed) -> None:
        expected = self._shard_members(packed)
        for i, members in enumerate(expected):
            path = Path(packed.root, SHARD_DIR, f"shard-{i:06d}.tar")
            with tarfile.open(path) as tf:
                infos = tf.getmembers()
                assert [t.name for t in infos] == [name for name, _, _, _ in members]
                for info, (_, offset, size, data) in zip(infos, members, strict=True):
                    assert info.isreg()
                    assert (info.offset_data, info.size) == (offset, size)
                    fh = tf.extractfile(info)
                    assert fh is not None and fh.read() == data

    def test_gnu_tar_lists_the_same_members(self, packed: Packed) -> None:
        tar = shutil.which("tar")
        if tar is None:
            pytest.skip("no tar on PATH")
        version = subprocess.run([tar, "--version"], capture_output=True, text=True, check=False)
        if "GNU tar" not in version.stdout:
            pytest.skip("tar on PATH is not GNU tar")
        expected = self._shard_members(packed)
        for i, members in enumerate(expected):
            path = Path(packed.root, SHARD_DIR, f"shard-{i:06d}.tar")
            listed = subprocess.run(
                [tar, "-tf", str(path)], capture_output=True, text=True, check=True
            )
            assert listed.stderr == ""
            assert listed.stdout.splitlines() == [name for name, _, _, _ in members]

    def test_webdataset_yields_the_same_samples(self, packed: Packed) -> None:
        wds = pytest.importorskip("webdataset")
        expected = samples_by_key(packed.root)
        urls = sorted(str(p) for p in Path(packed.root, SHARD_DIR).glob("*.tar"))
        got: list[dict[str, Any]] = []
        # webdataset 1.0 leaves its tar stream for the garbage collector; collect it here so
        # the ResourceWarning neither fails this test nor leaks into a later one.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            dataset = wds.WebDataset(urls, shardshuffle=False)
            got = [
                {k: v for k, v in s.items() if k not in ("__url__", "__local_path__")}
                for s in dataset
            ]
            del dataset
            gc.collect()
        assert [s["__key__"] for s in got] == list(expected)
        for sample in got:
            want = expected[sample["__key__"]]
            assert set(sample) == set(want)
            for ext, data in want.items():
                if ext == "cls":
                    assert sample[ext] == str(data).encode()
                else:
                    assert sample[ext] == data

    def test_dali_index_equals_wds2idx(self, packed: Packed, tmp_path: Path) -> None:
        wds2idx = Path(sys.executable).parent / "wds2idx"
        if not wds2idx.exists():
            pytest.skip("DALI's wds2idx is not installed")
        for i in range(packed.result.num_shards):
            shard = Path(packed.root, SHARD_DIR, f"shard-{i:06d}.tar")
            theirs = tmp_path / f"{i}.idx"
            subprocess.run(
                [sys.executable, str(wds2idx), str(shard), str(theirs)],
                capture_output=True,
                check=True,
            )
            ours = shard.with_suffix(".idx").read_bytes()
            assert ours == theirs.read_bytes(), f"{shard.name}: .idx differs from wds2idx"

    @pytest.mark.dali
    def test_dali_webdataset_reader_returns_the_same_bytes(self, tmp_path: Path) -> None:
        pytest.importorskip("nvidia.dali")
        from nvidia.dali import fn, pipeline_def

        # DALI's "error" behaviour needs every sample to have a jpeg, so this tree differs.
        files = {
            b"a/0 zero.jpeg": b"",
            b"a/1.v2.jpeg": _pattern(700, 21),
            b"a/2.jpeg": _pattern(4000, 22),
            b"b/\xff.jpeg": _pattern(9, 23),
            b"b/4.jpeg": _pattern(3000, 24),
        }
        src = write_tree(tmp_path / "src", files)
        dst = tmp_path / "out"
        pack(src, str(dst), PackOptions(shard_size_bytes=8192, durable=False))
        expected = samples_by_key(str(dst))
        shards = sorted(Path(dst, SHARD_DIR).glob("*.tar"))
        assert len(shards) > 1

        @pipeline_def(batch_size=len(files), num_threads=1, device_id=None)
        def pipeline() -> Any:
            jpeg, cls = fn.readers.webdataset(
                paths=[str(p) for p in shards],
                index_paths=[str(p.with_suffix(".idx")) for p in shards],
                ext=["jpeg", "cls"],
                missing_component_behavior="error",
                name="reader",
            )
            return jpeg, cls

        pipe = pipeline()
        pipe.build()
        assert pipe.epoch_size("reader") == len(files)
        jpegs, labels = pipe.run()
        got = [
            (bytes(np.array(jpegs.at(i))), bytes(np.array(labels.at(i)))) for i in range(len(files))
        ]
        assert got == [(s["jpeg"], str(s["cls"]).encode()) for s in expected.values()]


class TestHDF5(ReaderWriterSuite):
    shard_format = "hdf5"
    suffix = ".h5"

    def test_plain_h5py_reads_every_member(self, packed: Packed, source_tree: SourceTree) -> None:
        with ShardReader(packed.root) as ds:
            index = ds.index
            for s, shard in enumerate(ds.manifest.shards):
                first, count = shard.first_sample, shard.num_samples
                with h5py.File(Path(packed.root, shard.path), "r") as f:
                    blob = f["data"]
                    keys = [k.decode() for k in f["sample_key"][:]]
                    assert keys == [ds.key(i) for i in range(first, first + count)]
                    labels = index.samples["label"][first : first + count]
                    assert f["sample_label"][:].tolist() == labels.tolist()
                    member_ids = [
                        m for i in range(first, first + count) for m in index.sample_member_range(i)
                    ]
                    exts = [e.decode() for e in f["member_ext"][:]]
                    offsets, sizes = f["member_offset"][:], f["member_size"][:]
                    assert len(exts) == len(member_ids)
                    assert f["sample_num_members"][:].tolist() == [
                        int(index.samples[i]["n_members"]) for i in range(first, first + count)
                    ]
                    for j, m in enumerate(member_ids):
                        rec = index.members[m]
                        assert exts[j] == index.exts[int(rec["ext_id"])]
                        assert int(sizes[j]) == int(rec["size"])
                        assert int(rec["offset"]) == blob.id.get_offset() + int(offsets[j])
                        data = bytes(blob[int(offsets[j]) : int(offsets[j]) + int(sizes[j])])
                        assert f["member_xxh3_64"][j] == rec["xxh3_64"]
                        path = index.member_path(m)
                        if path:
                            assert data == source_tree.files[path], (s, path)
                        else:
                            assert exts[j] == "cls"
                            assert int(data) in range(len(source_tree.classes))

    def test_blob_is_contiguous_and_aligned(self, packed: Packed) -> None:
        for shard in sorted(Path(packed.root, SHARD_DIR).glob("*.h5")):
            with h5py.File(shard, "r") as f:
                blob = f["data"]
                assert blob.chunks is None, shard.name
                assert blob.compression is None
                assert blob.id.get_offset() is not None
                assert blob.id.get_offset() % 4096 == 0, (
                    f"{shard.name}: data at {blob.id.get_offset()}"
                )
