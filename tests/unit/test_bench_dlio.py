"""benchmarks/dlio/dlio_parts.py: what the DLIO benchmark and its plug-in do without DLIO.

dlio-benchmark is never installed for the tests (benchmarks/dlio/install.sh makes its own
venv); these check the plug-in's pure path on a real pack of a DLIO-shaped tree (the same
bytes and arrays as DLIO's readers get, a damaged shard caught), the parsing of DLIO's
``summary.json`` (tests/data/dlio/summary.json: captured from a run, host details removed),
the overrides and the tables.
"""

from __future__ import annotations

import io
import json
import pathlib
import sys

import numpy as np
import pytest

import shardio
from shardio import ShardDataset
from shardio.errors import ChecksumMismatchError

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "dlio"))

import dlio_parts  # noqa: E402

SUMMARY = ROOT / "tests" / "data" / "dlio" / "summary.json"


def _dlio_tree(root: pathlib.Path) -> pathlib.Path:
    """Files as DLIO's generators write them: npz with an ``x`` array, a grey JPEG, HDF5."""
    import h5py
    from PIL import Image

    train = root / "data" / "train"
    (train / "sub").mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(3):
        np.savez(train / f"img_{i}_of_3.npz", x=rng.integers(0, 255, (8, 8, 2), dtype=np.uint8))
    Image.fromarray(rng.integers(0, 255, (16, 16), dtype=np.uint8)).save(
        train / "sub" / "img_0.jpeg", format="JPEG"
    )
    with h5py.File(train / "img_0.hdf5", "w") as fh:
        fh.create_dataset("records", data=rng.integers(0, 255, (2, 4, 4), dtype=np.uint8))
    return train


def _read(ds: ShardDataset, index: dict[str, int], split: pathlib.Path, name: str, fmt: str):
    key = dlio_parts.sample_key(str(split), str(split / name))
    return dlio_parts.parse_file(fmt, dlio_parts.member_bytes(ds[index[key]], key))


def test_the_plug_in_path_gives_what_dlio_s_readers_get(tmp_path: pathlib.Path) -> None:
    from PIL import Image

    train = _dlio_tree(tmp_path)
    shardio.pack(str(train), str(tmp_path / "packed"), shardio.PackOptions(labels="none"))
    ds = ShardDataset(str(tmp_path / "packed"), shuffle=False)
    index = {ds.packed.key(i): i for i in range(len(ds))}
    assert set(index) == {"img_0_of_3", "img_1_of_3", "img_2_of_3", "sub/img_0", "img_0"}
    for i in range(3):
        name = f"img_{i}_of_3.npz"
        got = _read(ds, index, train, name, "npz")
        want = np.load(train / name, allow_pickle=True)["x"]  # NPZReader.open
        for s in range(2):
            assert np.array_equal(dlio_parts.take_sample("npz", got, s), want[..., s])
    jpeg = _read(ds, index, train, "sub/img_0.jpeg", "jpeg")
    assert np.array_equal(jpeg, np.asarray(Image.open(train / "sub" / "img_0.jpeg")))
    h5 = _read(ds, index, train, "img_0.hdf5", "hdf5")
    import h5py

    with h5py.File(train / "img_0.hdf5", "r") as fh:
        assert np.array_equal(dlio_parts.take_sample("hdf5", h5, 1), fh["records"][1])
    h5.close()
    ds.close()


def test_a_damaged_shard_raises_instead_of_handing_dlio_bytes(tmp_path: pathlib.Path) -> None:
    train = _dlio_tree(tmp_path)
    shardio.pack(str(train), str(tmp_path / "packed"), shardio.PackOptions(labels="none"))
    shards = sorted((tmp_path / "packed" / "shards").rglob("*.tar"))
    shard = next(s for s in shards if b"\x93NUMPY" in s.read_bytes())
    raw = bytearray(shard.read_bytes())
    at = raw.find(b"\x93NUMPY")  # inside an npz member's payload
    raw[at + 200] ^= 0xFF
    shard.write_bytes(bytes(raw))
    ds = ShardDataset(str(tmp_path / "packed"), shuffle=False)
    with pytest.raises(ChecksumMismatchError):
        for i in range(len(ds)):
            ds[i]
    ds.close()


def test_keys_and_members_are_checked(tmp_path: pathlib.Path) -> None:
    split = tmp_path / "train"
    assert dlio_parts.sample_key(str(split), str(split / "a" / "b.npz")) == "a/b"
    for outside in (tmp_path / "valid" / "x.npz", split, tmp_path / "train2" / "x.npz"):
        with pytest.raises(ValueError, match="not a file under"):
            dlio_parts.sample_key(str(split), str(outside))
    with pytest.raises(ValueError, match="returned sample 'b'"):
        dlio_parts.member_bytes({"__key__": "b", "npz": b"x"}, "a")
    with pytest.raises(ValueError, match="2 members"):
        dlio_parts.member_bytes({"__key__": "a", "npz": b"x", "json": b"{}"}, "a")
    assert dlio_parts.member_bytes({"__key__": "a", "__label__": 3, "npz": b"x"}, "a") == b"x"
    with pytest.raises(ValueError, match="format 'csv'"):
        dlio_parts.parse_file("csv", b"")
    buf = io.BytesIO()
    np.save(buf, np.zeros(3))  # an npz that is not one: np.load gives an array, not a zip
    with pytest.raises((ValueError, TypeError, IndexError)):
        dlio_parts.parse_file("npz", buf.getvalue())


def test_dlio_summary_is_parsed_and_a_broken_one_named(tmp_path: pathlib.Path) -> None:
    figures = dlio_parts.read_summary(str(SUMMARY))
    metric = json.loads(SUMMARY.read_text())["metric"]
    assert figures.samples_per_s == metric["train_throughput_mean_samples_per_second"] > 0
    assert figures.au_percent == metric["train_au_mean_percentage"]
    assert figures.au_expectation == "success"
    bad = tmp_path / "summary.json"
    for text in ("{", '{"metric": {}}', "[]", '{"metric": {"train_au_mean_percentage": "x"}}'):
        bad.write_text(text)
        with pytest.raises(ValueError, match=f"{bad}: not a DLIO summary"):
            dlio_parts.read_summary(str(bad))
    with pytest.raises(ValueError, match="not a DLIO summary"):
        dlio_parts.read_summary(str(tmp_path / "missing.json"))


def test_overrides_name_the_reader_and_the_computation() -> None:
    w = dlio_parts.WORKLOADS["resnet50"]
    assert w.computation_time_s == pytest.approx(0.435 * w.batch_size / 400)
    base = dlio_parts.dlio_overrides(w, "/d", read_threads=2)
    assert base[0] == "workload=resnet50_a100"
    assert "++workload.train.computation_time=0.0348" in base
    assert "++workload.workflow.train=True" in base
    assert not any("reader_classname" in a for a in base)
    plug = dlio_parts.dlio_overrides(
        w, "/d", read_threads=2, computation_time_s=0.0, reader_classname="m.C", generate=True
    )
    assert "++workload.reader.reader_classname=m.C" in plug
    assert "++workload.train.computation_time=0.0" in plug
    assert "++workload.workflow.generate_data=True" in plug
    with pytest.raises(ValueError, match="read_threads"):
        dlio_parts.dlio_overrides(w, "/d", read_threads=-1)
    with pytest.raises(ValueError, match="computation time"):
        dlio_parts.Workload(**{**w.__dict__, "computation_time_s": float("nan")})


def test_tables_give_ratios_and_show_failed_runs() -> None:
    def rec(reader: str, sps: float | None, *, fs: str = "local", compute: bool = False):
        figures = dlio_parts.DlioFigures(50.0, sps, 1.0, "fail") if sps else None
        return dlio_parts.RunRecord(
            workload="unet3d", fs=fs, reader=reader, compute=compute, figures=figures,
            wall_s=2.0, cpu_s=3.0, mds_requests=None if fs == "local" else 40,
            error="" if sps else "exit 1: boom",
        )  # fmt: skip

    runs = [
        rec("dlio", 100.0),
        rec("shardio", 150.0),
        rec("null", 400.0),
        rec("dlio", 50.0, fs="bed"),
        rec("shardio", None, fs="bed"),
    ]
    text = dlio_parts.render_tables(runs, {"unet3d": 20})
    rows = [line for line in text.splitlines() if line.startswith("| local") or "| bed" in line]
    assert len(rows) == 5
    assert "| 150 | 50.0 | 1.0 | 1.50x | 0.38x | 150.00 | - | 2.0 |" in rows[1]
    assert "| 400 |" in rows[2] and "| 4.00x | - |" in rows[2]
    assert "| 50 |" in rows[3] and "| 2000.0 |" in rows[3]  # 40 requests for 20 samples
    assert "failed: exit 1: boom" in rows[4]
    assert "2,500 µs per sample" in text
