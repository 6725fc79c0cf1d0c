"""ShardWriter: datasets written from code, read back by shardio, webdataset, h5py and DALI.

Real tar and HDF5 files on the real filesystem; parts written by real processes and joined by
the real ``shardio merge``; a writer killed with SIGKILL; ENOSPC on a real 3 MiB tmpfs.
"""

from __future__ import annotations

import gc
import json
import os
import pathlib
import signal
import subprocess
import sys
import tarfile
import time
import warnings
from typing import Any

import h5py
import pytest

from shardio import ShardWriter, verify_dataset
from shardio.errors import FormatError, PackError, StorageError, UsageError
from shardio.read.reader import ShardReader
from shardio.storage.runner import CommandResult

SHARDIO = [sys.executable, "-m", "shardio"]


def _cli(*args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*SHARDIO, *map(str, args)], capture_output=True, text=True, timeout=120, check=False
    )


def _samples(n: int, *, seed: int = 0, labelled: bool = True) -> list[dict[str, Any]]:
    out = []
    for i in range(n):
        sample: dict[str, Any] = {
            "__key__": f"img/{seed}-{i:05d}",
            "jpeg": bytes((i * 7 + seed + j) % 256 for j in range(300 + 37 * (i % 11))),
            "txt": f"caption {i} ünï",
        }
        if labelled:
            sample["cls"] = i % 5
        out.append(sample)
    return out


def _read_all(path: pathlib.Path) -> dict[str, dict[str, Any]]:
    with ShardReader(str(path)) as ds:
        return {ds.key(i): ds.read_sample(i) for i in range(len(ds))}


def _expect(samples: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out = {}
    for s in samples:
        want = {k: (v.encode() if isinstance(v, str) else v) for k, v in s.items()}
        out[s["__key__"]] = want
    return out


def _same(got: dict[str, dict[str, Any]], samples: list[dict[str, Any]]) -> None:
    want = _expect(samples)
    assert set(got) == set(want)
    for key, sample in want.items():
        for ext, value in sample.items():
            if ext == "__key__":
                continue
            assert got[key][ext] == value, (key, ext)


@pytest.mark.parametrize("fmt", ["tar", "hdf5"])
def test_written_dataset_verifies_and_reads_back(tmp_path: pathlib.Path, fmt: str) -> None:
    samples = _samples(240)
    out = tmp_path / "out"
    with ShardWriter(out, format=fmt, shard_size="32KiB") as w:
        for s in samples:
            w.write(s)
    report = verify_dataset(str(out))
    assert report.ok, report
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["labels"] == {"layout": "writer", "classes": ["0", "1", "2", "3", "4"]}
    assert manifest["num_samples"] == 240
    assert len(manifest["shards"]) > 3  # cut at the shard size
    got = _read_all(out)
    _same(got, samples)
    # dataset order is write order
    with ShardReader(str(out)) as ds:
        assert [ds.key(i) for i in range(len(ds))] == [s["__key__"] for s in samples]
    assert not (out / ".shardio-work").exists()
    proc = _cli("verify", out)
    assert proc.returncode == 0, proc.stderr


def test_tar_shards_read_by_webdataset_and_tarfile(tmp_path: pathlib.Path) -> None:
    wds = pytest.importorskip("webdataset")
    samples = _samples(50)
    out = tmp_path / "out"
    with ShardWriter(out, shard_size="16KiB") as w:
        for s in samples:
            w.write(s)
    urls = sorted(str(p) for p in (out / "shards").glob("*.tar"))
    got = {}
    # webdataset leaves its tar stream to the garbage collector: collect it here
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        dataset = wds.WebDataset(urls, shardshuffle=False, empty_check=False)
        for sample in dataset:
            got[sample["__key__"]] = sample
        del dataset
        gc.collect()
    assert set(got) == {s["__key__"] for s in samples}
    for s in samples:
        g = got[s["__key__"]]
        assert g["jpeg"] == s["jpeg"]
        assert g["txt"] == s["txt"].encode()
        assert int(g["cls"]) == s["cls"]
    with tarfile.open(urls[0]) as tf:
        names = tf.getnames()
    assert names[:3] == ["img/0-00000.jpeg", "img/0-00000.txt", "img/0-00000.cls"]


@pytest.mark.parametrize("fmt", ["tar", "hdf5"])
def test_the_samples_of_a_pack_written_again_are_the_same_dataset(
    tmp_path: pathlib.Path, fmt: str
) -> None:
    from trees import write_tree

    from shardio.packing.run import PackOptions, pack

    files = {
        f"c{i % 3}/f {i}.{ext}".encode(): bytes([i, len(ext)]) * (50 + 90 * i)
        for i in range(40)
        for ext in ("jpeg", "json")
    }
    src = write_tree(tmp_path / "src", files)
    packed = tmp_path / "packed"
    pack(src, str(packed), PackOptions(shard_format=fmt, shard_size_bytes=16384, durable=False))
    with ShardReader(str(packed)) as ds:
        samples = [ds.read_sample(i) for i in range(len(ds))]
        keys = [ds.key(i) for i in range(len(ds))]
        classes = ds.manifest.classes
    written = tmp_path / "written"
    with ShardWriter(written, format=fmt, shard_size=16384, classes=classes) as w:
        for key, sample in zip(keys, samples, strict=True):
            w.write({**sample, "__key__": key})
    a = json.loads((packed / "manifest.json").read_text())
    b = json.loads((written / "manifest.json").read_text())
    assert [s["num_samples"] for s in a["shards"]] == [s["num_samples"] for s in b["shards"]]
    assert b["labels"]["classes"] == a["labels"]["classes"]
    if fmt == "tar":  # byte for byte: the same members, headers and padding
        assert [s["xxh3_128"] for s in a["shards"]] == [s["xxh3_128"] for s in b["shards"]]
        for shard in a["shards"]:
            idx = shard["dali_index"]
            assert (packed / idx).read_bytes() == (written / idx).read_bytes()
    assert _read_all(written) == _read_all(packed)


def test_hdf5_shards_read_by_plain_h5py(tmp_path: pathlib.Path) -> None:
    samples = _samples(20)
    out = tmp_path / "out"
    with ShardWriter(out, format="hdf5", shard_size="1MiB") as w:
        for s in samples:
            w.write(s)
    (shard,) = sorted((out / "shards").glob("*.h5"))
    with h5py.File(shard, "r") as f:
        keys = [k.decode() for k in f["sample_key"][:]]
        assert keys == [s["__key__"] for s in samples]
        assert list(f["sample_label"][:]) == [s["cls"] for s in samples]
        first = int(f["sample_first_member"][3])
        off, size = int(f["member_offset"][first]), int(f["member_size"][first])
        assert bytes(f["data"][off : off + size]) == samples[3]["jpeg"]


def test_dali_reads_written_shards(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("nvidia.dali")
    import shardio.dali as sdali

    samples = _samples(64)
    out = tmp_path / "out"
    with ShardWriter(out, shard_size="16KiB") as w:
        for s in samples:
            w.write(s)
    loader = sdali.loader(out, batch_size=16, device_id=None, shuffle=False, num_shards=1,
                          shard_id=0, num_threads=1)  # fmt: skip
    data, labels = [], []
    for batch in loader:
        data += [bytes(t.numpy()) for t in batch["data"]]
        labels += batch["label"].tolist()
    assert data == [s["jpeg"] for s in samples]
    assert labels == [s["cls"] for s in samples]


def test_shard_dataset_reads_written_shards(tmp_path: pathlib.Path) -> None:
    from shardio import ShardDataset

    samples = _samples(30)
    out = tmp_path / "out"
    with ShardWriter(out, classes=["cat", "dog", "eel", "fox", "gnu"]) as w:
        for s in samples:
            w.write({**s, "cls": ["cat", "dog", "eel", "fox", "gnu"][s["cls"]]})
    ds = ShardDataset(out, order="sequential")
    try:
        assert ds.classes == ("cat", "dog", "eel", "fox", "gnu")
        got = [ds[i] for i in range(len(ds))]
    finally:
        ds.close()
    assert [g["__key__"] for g in got] == [s["__key__"] for s in samples]
    assert [g["cls"] for g in got] == [s["cls"] for s in samples]
    assert [g["jpeg"] for g in got] == [s["jpeg"] for s in samples]


def test_nothing_is_visible_until_close(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "out"
    w = ShardWriter(out, shard_size="8KiB")
    for s in _samples(100):
        w.write(s)
    assert not (out / "manifest.json").exists()
    assert list((out / "shards").iterdir()) == []  # full shards wait in the work folder
    proc = _cli("verify", out)
    assert proc.returncode != 0
    result = w.close()
    assert result.merged and result.num_samples == 100 and result.num_shards > 5
    assert len(list((out / "shards").glob("*.tar"))) == result.num_shards


def test_an_exception_in_the_block_leaves_nothing(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="boom"), ShardWriter(out, shard_size="8KiB") as w:
        for s in _samples(50):
            w.write(s)
        raise RuntimeError("boom")
    assert not out.exists()
    keep = tmp_path / "mine"
    keep.mkdir()
    (keep / "shards").mkdir()
    with pytest.raises(RuntimeError), ShardWriter(keep, shard_size="8KiB") as w:
        for s in _samples(50):
            w.write(s)
        raise RuntimeError("boom")
    assert keep.is_dir()  # the user made it: left, emptied of what shardio wrote
    assert sorted(p.name for p in keep.rglob("*") if p.is_file()) == []


def test_refused_samples_say_why_and_write_nothing(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "out"
    with ShardWriter(out) as w:
        w.write({"__key__": "a", "jpg": b"x", "cls": 1})
        bad = [
            ({"__key__": "a", "jpg": b"y", "cls": 1}, "duplicate key 'a'"),
            ({"__key__": "b", "__url__": b"y", "cls": 1}, "reserved"),
            ({"__key__": "b.jpg", "jpg": b"y", "cls": 1}, "not a shardio key"),
            ({"__key__": "b c", "jpg": b"y", "cls": 1}, "not a shardio key"),
            ({"__key__": "/b", "jpg": b"y", "cls": 1}, "not a shardio key"),
            ({"__key__": "b", "j pg": b"y", "cls": 1}, "not an extension"),
            ({"__key__": "b", "seg.png": b"y", "cls": 1}, "no dot"),
            ({"__key__": "b", "jpg": 3, "cls": 1}, "give bytes"),
            ({"__key__": "b", "jpg": b"y"}, "no 'cls' label"),
            ({"__key__": "b", "jpg": b"y", "cls": -1}, "out of range"),
            ({"__key__": "b", "jpg": b"y", "cls": True}, "int class index"),
            ({"__key__": "b", "jpg": b"y", "cls": "dog"}, "not a class index"),
            ({"__key__": "b", "jpg": b"y", "cls": 2**31}, "out of range"),
            ({"__key__": "b", "cls": 1}, "no member"),
            ({"jpg": b"y"}, "no __key__"),
            ({"__key__": 5, "jpg": b"y"}, "must be a str"),
            ("not a dict", "give a dict"),
            ({"__key__": "k" * 2000, "jpg": b"y", "cls": 1}, "longer than 1024"),
        ]
        for sample, message in bad:
            with pytest.raises(UsageError, match=message) as info:
                w.write(sample)  # type: ignore[arg-type]
            assert "\n" not in str(info.value)
        w.write({"__key__": "b", "jpg": bytearray(b"z"), "cls": "3"})
    got = _read_all(out)
    assert set(got) == {"a", "b"}
    assert got["b"]["jpg"] == b"z" and got["b"]["cls"] == 3


@pytest.mark.parametrize("fmt", ["tar", "hdf5"])
def test_a_str_member_utf8_cannot_write_is_a_one_line_format_error(
    tmp_path: pathlib.Path, fmt: str
) -> None:
    """A lone surrogate (os.fsdecode of a non-UTF-8 name) names the sample and the member,
    writes nothing, and the writer goes on."""
    out = tmp_path / "out"
    with ShardWriter(out, format=fmt) as w:
        w.write({"__key__": "a", "txt": "fine"})
        for value in ("\udcff", "ok " + os.fsdecode(b"\xe9t\xe9")):
            with pytest.raises(FormatError, match=r"sample 'b': member 'txt' is a str") as info:
                w.write({"__key__": "b", "jpg": b"y", "txt": value})
            assert "\n" not in str(info.value)
            assert isinstance(info.value.__cause__, UnicodeEncodeError)
        w.write({"__key__": "b", "txt": "caf\u00e9"})
    got = _read_all(out)
    assert got == {
        "a": {"__key__": "a", "txt": b"fine"},
        "b": {"__key__": "b", "txt": "caf\u00e9".encode()},
    }


@pytest.mark.parametrize("fmt", ["tar", "hdf5"])
def test_close_inside_the_with_block_is_not_an_error(tmp_path: pathlib.Path, fmt: str) -> None:
    """close() is idempotent: the block's end closes again and returns the same result, so
    a published dataset is not reported failed."""
    out = tmp_path / "out"
    with ShardWriter(out, format=fmt, shard_size="8KiB") as w:
        for s in _samples(30):
            w.write(s)
        first = w.close()
        assert w.close() is first
    assert first.merged and first.num_samples == 30
    assert w.close() is first
    with pytest.raises(UsageError, match="is closed: cannot write"):
        w.write(_samples(1, seed=9)[0])
    assert verify_dataset(str(out)).ok
    _same(_read_all(out), _samples(30))
    # An exception after close() inside the block leaves the published dataset alone.
    out2 = tmp_path / "out2"
    with pytest.raises(RuntimeError, match="after"), ShardWriter(out2, format=fmt) as w2:
        w2.write(_samples(1)[0])
        w2.close()
        raise RuntimeError("after close")
    assert verify_dataset(str(out2)).ok


def test_unlabelled_then_labelled_is_refused(tmp_path: pathlib.Path) -> None:
    with ShardWriter(tmp_path / "out") as w:
        w.write({"__key__": "a", "jpg": b"x"})
        with pytest.raises(UsageError, match="first sample had none"):
            w.write({"__key__": "b", "jpg": b"x", "cls": 0})
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["labels"]["layout"] == "none"


def test_caller_reusing_its_buffer_changes_nothing(tmp_path: pathlib.Path) -> None:
    buf = bytearray(b"first")
    with ShardWriter(tmp_path / "out") as w:
        w.write({"__key__": "a", "bin": buf})
        buf[:] = b"SECND"
        w.write({"__key__": "b", "bin": memoryview(buf)})
        buf[:] = b"third"
    got = _read_all(tmp_path / "out")
    assert got["a"]["bin"] == b"first" and got["b"]["bin"] == b"SECND"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"format": "zip"}, "invalid format"),
        ({"shard_size": "1KiB"}, "too small"),
        ({"shard_size": "lots"}, "invalid size"),
        ({"shard_size": 1.5}, "must be an integer"),
        ({"part": 2, "num_parts": 2}, "part must be at most 1"),
        ({"num_parts": 0}, "at least 1"),
        ({"num_parts": 10**6}, "at most 9999"),
        ({"classes": "abc"}, "list of class names"),
        ({"classes": []}, "empty"),
        ({"classes": ["a", "a"]}, "twice"),
        ({"stripe": "many"}, "stripe"),
        ({"overwrite": "yes"}, "True or False"),
    ],
)
def test_bad_options_are_one_line(tmp_path: pathlib.Path, kwargs: dict[str, Any], message: str):
    with pytest.raises(UsageError, match=message) as info:
        ShardWriter(tmp_path / "out", **kwargs)
    assert "\n" not in str(info.value)
    assert not (tmp_path / "out").exists()


def test_existing_dataset_foreign_files_and_symlinks_are_left_alone(tmp_path: pathlib.Path):
    out = tmp_path / "out"
    with ShardWriter(out) as w:
        w.write({"__key__": "a", "jpg": b"x"})
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    with pytest.raises(UsageError, match="already holds a shardio dataset"):
        ShardWriter(out, overwrite=True).open()
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(UsageError, match="not empty"):
        ShardWriter(foreign).open()
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt"]
    linked = tmp_path / "linked"
    linked.mkdir()
    target = tmp_path / "elsewhere"
    target.mkdir()
    (linked / "shards").symlink_to(target)
    with pytest.raises(UsageError, match=r"symlink|not a directory"):
        ShardWriter(linked).open()
    assert list(target.iterdir()) == []


def test_oversized_sample_gets_its_own_shard(tmp_path: pathlib.Path) -> None:
    with ShardWriter(tmp_path / "out", shard_size="8KiB") as w:
        w.write({"__key__": "small", "bin": b"x" * 100})
        w.write({"__key__": "big", "bin": b"y" * 20000})
        w.write({"__key__": "after", "bin": b"z" * 100})
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert [s["num_samples"] for s in manifest["shards"]] == [1, 1, 1]
    report = json.loads((tmp_path / "out" / "pack-report.json").read_text())
    assert report["oversized"] == ["big"]


def test_striping_goes_through_the_runner(tmp_path: pathlib.Path) -> None:
    calls: list[tuple[str, ...]] = []

    def runner(argv: Any, *, timeout_s: float = 60.0) -> CommandResult:
        calls.append(tuple(argv))
        if argv[:2] == ["lfs", "df"] or tuple(argv[:2]) == ("lfs", "df"):
            out = "fs-OST0000_UUID 10 1 9 10% /mnt[OST:0]\nfs-OST0001_UUID 10 1 9 10% /mnt[OST:1]\n"
            return CommandResult(argv=tuple(argv), returncode=0, stdout=out, stderr="")
        return CommandResult(argv=tuple(argv), returncode=0, stdout="", stderr="")

    out = tmp_path / "out"
    with ShardWriter(out, fs_type="lustre", stripe="4x1MiB", runner=runner) as w:
        w.write({"__key__": "a", "bin": b"x"})
    setstripes = [c for c in calls if c[:2] == ("lfs", "setstripe")]
    # the staging folder (where shards are created) and the shard folder
    assert [c[-1] for c in setstripes] == [
        str(out / ".shardio-work" / "write-0000-of-0001"),
        str(out / "shards"),
    ]
    assert all(c[2:4] == ("-c", "4") for c in setstripes)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["layout"]["action"] == "applied"


# -- parts, kills, full disks --------------------------------------------------------------------

_PART_SCRIPT = """
import sys
from shardio import ShardWriter
out, part, n, fmt = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
with ShardWriter(out, format=fmt, shard_size="16KiB", part=part, num_parts=n,
                 classes=["a", "b", "c"]) as w:
    for i in range(part, 90, n):
        w.write({"__key__": f"k{i:04d}", "bin": bytes([i % 256]) * (200 + i), "cls": i % 3})
"""


@pytest.mark.parametrize("fmt", ["tar", "hdf5"])
def test_parallel_writers_then_merge(tmp_path: pathlib.Path, fmt: str) -> None:
    out = tmp_path / "out"
    procs = [
        subprocess.Popen([sys.executable, "-c", _PART_SCRIPT, str(out), str(p), "3", fmt])
        for p in range(3)
    ]
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0]
    assert not (out / "manifest.json").exists()
    proc = _cli("merge", out)
    assert proc.returncode == 0, proc.stderr
    assert verify_dataset(str(out)).ok
    got = _read_all(out)
    assert set(got) == {f"k{i:04d}" for i in range(90)}
    for i in range(90):
        assert got[f"k{i:04d}"]["bin"] == bytes([i % 256]) * (200 + i)
        assert got[f"k{i:04d}"]["cls"] == i % 3


def test_a_part_starting_while_another_publishes_its_state_is_not_refused(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race a parallel write hit under load: part 1 looked for state records before
    part 0 published its own, then found the work directory no longer bare and called the
    destination foreign ("not empty ('.shardio-work', ...)")."""
    from shardio.packing import dest

    donor = tmp_path / "donor"
    with ShardWriter(donor, part=0, num_parts=2, classes=["a"]) as w:
        w.write({"__key__": "k0", "bin": b"x", "cls": 0})
        record = next((donor / ".shardio-work").glob("state*"))
        state_bytes, state_name = record.read_bytes(), record.name
    out = tmp_path / "out"
    (out / ".shardio-work").mkdir(parents=True)
    real_listdir = os.listdir

    def listdir(path: Any) -> list[str]:
        names = real_listdir(path)
        if pathlib.Path(path) == out / ".shardio-work" and not names:
            # part 0 publishes its state record just after this listing
            (out / ".shardio-work" / state_name).write_bytes(state_bytes)
        return names

    monkeypatch.setattr(dest.os, "listdir", listdir)
    state = dest.inspect_dst(str(out))
    assert state.kind != "foreign", state.why
    monkeypatch.undo()
    with ShardWriter(out, part=1, num_parts=2, classes=["a"]) as w:
        w.write({"__key__": "k1", "bin": b"y", "cls": 0})


def test_parts_with_the_same_key_are_not_merged(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "out"
    for part in (0, 1):
        with ShardWriter(out, part=part, num_parts=2) as w:
            w.write({"__key__": f"only{part}", "bin": b"x"})
            w.write({"__key__": "same", "bin": b"y"})
    proc = _cli("merge", out)
    assert proc.returncode != 0
    assert "key 'same' was written by two parts" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not (out / "manifest.json").exists()
    # the part is written again, and then the merge goes through
    with ShardWriter(out, part=1, num_parts=2, overwrite=True) as w:
        w.write({"__key__": "other", "bin": b"y"})
    proc = _cli("merge", out)
    assert proc.returncode == 0, proc.stderr
    assert set(_read_all(out)) == {"only0", "same", "other"}


def test_parts_need_one_label_map_and_one_set_of_options(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "out"
    with ShardWriter(out, part=0, num_parts=2) as w:
        with pytest.raises(UsageError, match="give classes="):
            w.write({"__key__": "a", "bin": b"x", "cls": 0})
        w.write({"__key__": "a", "bin": b"x"})
    with pytest.raises(PackError, match="other options"):
        ShardWriter(out, part=1, num_parts=2, format="hdf5").open()
    with pytest.raises(UsageError, match="split into 2 part"):
        ShardWriter(out, part=0, num_parts=3).open()


def test_two_writers_of_one_part_at_once_are_refused(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "out"
    first = ShardWriter(out, part=0, num_parts=2)
    first.open()
    try:
        with pytest.raises(UsageError, match="another ShardWriter is writing part 0/2"):
            ShardWriter(out, part=0, num_parts=2, overwrite=True).open()
        with pytest.raises(UsageError, match="another shardio pack or ShardWriter"):
            ShardWriter(out).open()  # one part: an exclusive lock
    finally:
        first.abort()


_KILL_SCRIPT = """
import os, sys
from shardio import ShardWriter
w = ShardWriter(sys.argv[1], format=sys.argv[2], shard_size="8KiB")
for i in range(10**9):
    w.write({"__key__": f"k{i:07d}", "bin": os.urandom(700)})
    if i == 200:
        print("written", flush=True)
"""


@pytest.mark.parametrize("fmt", ["tar", "hdf5"])
def test_killed_writer_leaves_no_dataset_and_overwrite_starts_over(
    tmp_path: pathlib.Path, fmt: str
) -> None:
    out = tmp_path / "out"
    with subprocess.Popen(
        [sys.executable, "-c", _KILL_SCRIPT, str(out), fmt], stdout=subprocess.PIPE, text=True
    ) as proc:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "written"
        time.sleep(0.2)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert not (out / "manifest.json").exists()
    assert list((out / "shards").iterdir()) == []
    verify = _cli("verify", out)
    assert verify.returncode != 0
    with pytest.raises(UsageError, match="pass overwrite=True"):
        ShardWriter(out, format=fmt).open()
    with ShardWriter(out, format=fmt, overwrite=True, shard_size="8KiB") as w:
        for i in range(30):
            w.write({"__key__": f"n{i}", "bin": b"x" * i})
    assert verify_dataset(str(out)).ok
    assert set(_read_all(out)) == {f"n{i}" for i in range(30)}
    work = out / ".shardio-work"
    assert not work.exists()


def test_no_space_left_is_a_clear_error_and_leaves_nothing(small_tmpfs: pathlib.Path) -> None:
    out = small_tmpfs / "out"
    with (
        pytest.raises(StorageError, match=r"(?i)no space left on device") as info,
        ShardWriter(out, shard_size="256KiB") as w,
    ):
        for i in range(100):
            w.write({"__key__": f"k{i}", "bin": os.urandom(100_000)})
    assert str(out) in str(info.value)
    assert not out.exists()


def test_empty_write_publishes_nothing(tmp_path: pathlib.Path) -> None:
    with pytest.raises(UsageError, match="no sample was written"), ShardWriter(tmp_path / "out"):
        pass
    assert not (tmp_path / "out").exists()
