"""Golden datasets (tests/data/format_v1, _v2, _v3): every later shardio must read them.

The expectations below are literal on purpose: they describe files on disk that must stay
readable forever, not whatever today's generator happens to write. If a test here fails after
a code change, the change broke compatibility with datasets users already have.
"""

from __future__ import annotations

import importlib.util
import json
import os
import tarfile
from pathlib import Path
from types import ModuleType

import h5py
import pytest

from shardio.format.manifest import load_manifest
from shardio.read.reader import ShardReader
from shardio.tools.unpack import unpack_dataset
from shardio.tools.verify import verify_dataset

DATA = Path(__file__).resolve().parents[2] / "data"
GOLDEN = DATA / "format_v3"  # what today's shardio writes (with parity 2+1)
VERSIONS = {"format_v1": 1, "format_v2": 2, "format_v3": 3}


@pytest.fixture(params=sorted(VERSIONS))
def golden(request: pytest.FixtureRequest) -> Path:
    """Each golden set: every later shardio must read every one of them."""
    return DATA / str(request.param)


FORMATS = ["tar", "hdf5"]

KEYS = ["cat/0001", "cat/img%202%2Ev1", "dog/0003", "dog/no_ext"]
LABELS = [0, 0, 1, 1]
SAMPLES = {
    "cat/0001": {
        "bin": bytes((i * 31 + 7) % 256 for i in range(300)),
        "json": b'{"id": 1, "note": "golden"}\n',
        "cls": 0,
    },
    "cat/img%202%2Ev1": {"bin": b"", "cls": 0},
    "dog/0003": {"bin": bytes((i * 17 + 3) % 256 for i in range(450)), "cls": 1},
    "dog/no_ext": {"noext": b"no extension\n" * 10, "cls": 1},
}
MEMBER_ORDER = [["bin", "json", "cls"], ["bin", "cls"], ["bin", "cls"], ["noext", "cls"]]
TREE = {
    b"cat/0001.bin": SAMPLES["cat/0001"]["bin"],
    b"cat/0001.json": SAMPLES["cat/0001"]["json"],
    b"cat/img 2.v1.BIN": b"",
    b"dog/0003.bin": SAMPLES["dog/0003"]["bin"],
    b"dog/no_ext": SAMPLES["dog/no_ext"]["noext"],
}
SHARD_SAMPLES = [2, 2]


def _load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_golden", DATA / "make_golden.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _files(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.mark.parametrize("shard_format", FORMATS)
def test_manifest(golden: Path, shard_format: str) -> None:
    manifest = load_manifest(golden / shard_format / "manifest.json")
    assert manifest.format_version == VERSIONS[golden.name]
    assert manifest.shard_format == shard_format
    assert manifest.num_samples == 4
    assert manifest.num_members == 9
    assert manifest.classes == ("cat", "dog")
    assert manifest.label_layout == "class-dirs"
    assert [s.num_samples for s in manifest.shards] == SHARD_SAMPLES
    assert [s.first_sample for s in manifest.shards] == [0, 2]
    suffix = ".tar" if shard_format == "tar" else ".h5"
    assert [s.path for s in manifest.shards] == [f"shards/shard-00000{i}{suffix}" for i in range(2)]


@pytest.mark.parametrize("shard_format", FORMATS)
def test_samples_read_back_exactly(golden: Path, shard_format: str) -> None:
    with ShardReader(golden / shard_format) as ds:
        assert len(ds) == 4
        assert [ds.key(i) for i in range(4)] == KEYS
        assert ds.index.samples["label"].tolist() == LABELS
        assert ds.index.samples["shard"].tolist() == [0, 0, 1, 1]
        for i, key in enumerate(KEYS):
            sample = ds.read_sample(i)
            assert sample == {"__key__": key, **SAMPLES[key]}
            exts = [
                ds.index.exts[int(ds.index.members[m]["ext_id"])]
                for m in ds.index.sample_member_range(i)
            ]
            assert exts == MEMBER_ORDER[i]


@pytest.mark.parametrize("shard_format", FORMATS)
def test_verify_passes(golden: Path, shard_format: str) -> None:
    report = verify_dataset(golden / shard_format)
    assert report.ok, report.problems
    assert report.shards_checked == 2


@pytest.mark.parametrize("shard_format", FORMATS)
def test_unpack_restores_the_original_tree(golden: Path, shard_format: str, tmp_path: Path) -> None:
    unpack_dataset(golden / shard_format, tmp_path / "out")
    restored = {
        os.fsencode(p.relative_to(tmp_path / "out").as_posix()): p.read_bytes()
        for p in (tmp_path / "out").rglob("*")
        if p.is_file()
    }
    assert restored == TREE


def test_tar_shards_hold_webdataset_members(golden: Path) -> None:
    names = []
    for i in range(2):
        with tarfile.open(golden / "tar" / "shards" / f"shard-00000{i}.tar") as tf:
            names.append(tf.getnames())
    assert names == [
        [
            "cat/0001.bin",
            "cat/0001.json",
            "cat/0001.cls",
            "cat/img%202%2Ev1.bin",
            "cat/img%202%2Ev1.cls",
        ],
        ["dog/0003.bin", "dog/0003.cls", "dog/no_ext.noext", "dog/no_ext.cls"],
    ]
    assert (golden / "tar" / "shards" / "shard-000001.idx").read_bytes() == (
        b"v1.2 2\n"
        b"bin 512 450 dog/0003.bin cls 1536 1 dog/0003.cls\n"
        b"noext 2560 130 dog/no_ext.noext cls 3584 1 dog/no_ext.cls\n"
    )


def test_hdf5_shards_read_with_plain_h5py(golden: Path) -> None:
    keys, members = [], {}
    for i in range(2):
        with h5py.File(golden / "hdf5" / "shards" / f"shard-00000{i}.h5", "r") as f:
            assert f.attrs["shardio_format_version"] == 1
            shard_keys = [k.decode() for k in f["sample_key"][:]]
            keys += shard_keys
            blob, exts = f["data"], [e.decode() for e in f["member_ext"][:]]
            for s, key in enumerate(shard_keys):
                first = int(f["sample_first_member"][s])
                for m in range(first, first + int(f["sample_num_members"][s])):
                    off, size = int(f["member_offset"][m]), int(f["member_size"][m])
                    members[(key, exts[m])] = bytes(blob[off : off + size])
    assert keys == KEYS
    expected = {
        (key, ext): (b"%d" % value if ext == "cls" else value)
        for key, sample in SAMPLES.items()
        for ext, value in sample.items()
    }
    assert members == expected


def test_generator_reproduces_the_golden_files(tmp_path: Path) -> None:
    _load_generator().build(tmp_path)
    for shard_format in FORMATS:
        golden, fresh = _files(GOLDEN / shard_format), _files(tmp_path / shard_format)
        assert sorted(fresh) == sorted(golden)
        # created_by names the shardio release, which may change without a format change.
        manifests = [json.loads(d["manifest.json"]) for d in (golden, fresh)]
        for doc in manifests:
            doc.pop("created_by")
            doc.pop("manifest_xxh3_128", None)  # covers created_by
        assert manifests[0] == manifests[1], f"{shard_format}: manifest.json changed"
        # The document's checksum covers created_by: the fresh one is checked against its own
        # bytes (load_manifest), then both release-dependent values are taken from the golden
        # file so that the rest compares byte for byte.
        load_manifest(tmp_path / shard_format / "manifest.json")
        for field in ("created_by", "manifest_xxh3_128"):
            theirs, ours = (json.loads(d["manifest.json"]).get(field) for d in (golden, fresh))
            if ours is not None and theirs is not None:
                fresh["manifest.json"] = fresh["manifest.json"].replace(
                    json.dumps(ours).encode(), json.dumps(theirs).encode(), 1
                )
        # pack-report.json is a report for people, not read back: newer releases add fields
        # (the source's metadata call counts); the golden fields must stay as they are.
        reports = [json.loads(d.pop("pack-report.json")) for d in (golden, fresh)]
        assert {k: v for k, v in reports[1].items() if k in reports[0]} == reports[0], (
            f"{shard_format}: pack-report.json changed its golden fields"
        )
        for name, data in golden.items():
            assert fresh[name] == data, (
                f"{shard_format}/{name}: regenerating the golden dataset gave different bytes. "
                "The on-disk format changed: bump FORMAT_VERSION and add a new format_vN set "
                "instead of regenerating format_v3."
            )


@pytest.mark.parametrize("shard_format", FORMATS)
def test_format_3_parity_is_read_and_rebuilds_a_lost_shard(
    shard_format: str, tmp_path: Path
) -> None:
    """The golden parity (2+1, one group) is what every later shardio must rebuild from."""
    pytest.importorskip("pyeclib")
    import shutil

    from shardio.tools.repair import repair_dataset

    manifest = load_manifest(GOLDEN / shard_format / "manifest.json")
    assert manifest.parity is not None
    assert manifest.parity.scheme == "2+1"
    assert manifest.parity.cell_bytes == {"tar": 8192, "hdf5": 20480}[shard_format]
    assert [g.num_shards for g in manifest.parity.groups] == [2]
    assert verify_dataset(GOLDEN / shard_format).parity_checked == 2
    copy = tmp_path / "ds"
    shutil.copytree(GOLDEN / shard_format, copy)
    suffix = ".tar" if shard_format == "tar" else ".h5"
    (copy / "shards" / f"shard-000001{suffix}").unlink()
    report = repair_dataset(copy)
    assert report.status == "repaired"
    assert _files(copy) == _files(GOLDEN / shard_format) | {"parity/.locks/group-000000.lock": b""}
