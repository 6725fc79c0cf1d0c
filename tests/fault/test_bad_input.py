"""Bad input through the CLI: bad paths, odd files, malformed manifests, a full disk.

Every user error must end with rc != 0, exactly one ``shardio: error:`` line on stderr and
no traceback; files that cannot be packed are skipped, listed with their reason, and
``--strict`` turns the first one into an error.
"""

from __future__ import annotations

import errno
import json
import os
import pathlib
import shutil
import stat
import subprocess
import tarfile

import pytest
from trees import tree_files

from shardio.errors import StorageError
from shardio.format.document import encode_document
from shardio.packing.run import PackOptions, pack

W1 = ("--workers", "1", "--no-progress")  # one worker, no progress bar


# --------------------------------------------------------------------------- helpers


def temp_files(root: pathlib.Path) -> list[str]:
    return sorted(p.name for p in root.rglob("*") if ".shardio-tmp-" in p.name)


@pytest.fixture
def tiny_tree(tmp_path: pathlib.Path) -> pathlib.Path:
    """Two classes, four small files."""
    src = tmp_path / "tiny"
    for cls in ("cat", "dog"):
        (src / cls).mkdir(parents=True)
        for i in range(2):
            (src / cls / f"{cls}_{i}.jpg").write_bytes(os.urandom(3000 + i))
    return src


# --------------------------------------------------------------------------- paths


def test_missing_src(tmp_path: pathlib.Path, run_cli, assert_cli_error) -> None:
    src = tmp_path / "nope"
    result = run_cli("pack", src, tmp_path / "ds")
    assert_cli_error(result, str(src), "does not exist")
    assert not (tmp_path / "ds").exists()


def test_src_is_a_file(tmp_path: pathlib.Path, run_cli, assert_cli_error) -> None:
    src = tmp_path / "file.jpg"
    src.write_bytes(b"x" * 100)
    result = run_cli("pack", src, tmp_path / "ds")
    assert_cli_error(result, str(src), "not a directory")
    assert not (tmp_path / "ds").exists()


def test_empty_src(tmp_path: pathlib.Path, run_cli, assert_cli_error) -> None:
    src = tmp_path / "empty"
    (src / "train" / "n01").mkdir(parents=True)  # directories, but no file
    result = run_cli("pack", src, tmp_path / "ds")
    assert_cli_error(result, str(src), "no files")
    assert not (tmp_path / "ds" / "manifest.json").exists()


def test_error_lines_carry_no_errno_prefix(
    tmp_path: pathlib.Path, run_cli, assert_cli_error
) -> None:
    """One clear line: not ``shardio: error: [Errno 2] source ... is not a directory``."""
    (tmp_path / "file").write_bytes(b"x")
    for src in (tmp_path / "nope", tmp_path / "file"):
        line = assert_cli_error(run_cli("pack", src, tmp_path / "ds"))
        assert "[Errno" not in line, line


def test_dst_inside_src(tiny_tree: pathlib.Path, run_cli, assert_cli_error) -> None:
    before = tree_files(tiny_tree)
    result = run_cli("pack", tiny_tree, tiny_tree / "cat" / "out")
    assert result.rc == 2
    assert_cli_error(result, "inside the source")
    assert tree_files(tiny_tree) == before
    assert not (tiny_tree / "cat" / "out").exists()


def test_src_inside_dst(tmp_path: pathlib.Path, run_cli, assert_cli_error) -> None:
    src = tmp_path / "data" / "src"
    (src / "a").mkdir(parents=True)
    (src / "a" / "x.jpg").write_bytes(b"x" * 10)
    result = run_cli("pack", src, tmp_path / "data")
    assert result.rc == 2
    assert_cli_error(result, "inside the destination")


def test_non_empty_dst_is_refused_and_left_untouched(
    tiny_tree: pathlib.Path, tmp_path: pathlib.Path, run_cli, assert_cli_error
) -> None:
    dst = tmp_path / "ds"
    (dst / "results").mkdir(parents=True)
    (dst / "notes.txt").write_text("precious")
    (dst / "results" / "run1.csv").write_text("1,2,3")
    before = tree_files(dst)
    result = run_cli("pack", tiny_tree, dst)
    assert result.rc == 2
    assert_cli_error(result, str(dst), "not empty", "--resume", "--force")
    assert tree_files(dst) == before
    assert sorted(p.name for p in dst.iterdir()) == ["notes.txt", "results"]


def test_force_into_a_directory_that_is_not_a_dataset_is_refused(
    tiny_tree: pathlib.Path, tmp_path: pathlib.Path, run_cli, assert_cli_error
) -> None:
    """--force replaces a shardio dataset only: files merely named like shardio's (a
    manifest.json, index.bin, shards/shard-*) are the user's and stay, byte for byte."""
    dst = tmp_path / "ds"
    (dst / "shards").mkdir(parents=True)
    (dst / "notes.txt").write_text("precious")
    (dst / "manifest.json").write_text('{"mine": true}')
    (dst / "index.bin").write_bytes(b"my index")
    (dst / "shards" / "shard-000000.tar").write_bytes(b"my tar")
    before = tree_files(dst)
    result = run_cli("pack", tiny_tree, dst, "--force", "--no-progress")
    assert result.rc == 2
    assert_cli_error(result, str(dst / "manifest.json"), "will not remove anything")
    assert tree_files(dst) == before


def test_dst_already_a_dataset(
    small_tree: pathlib.Path, tmp_path: pathlib.Path, run_cli, assert_cli_error, packed_small
) -> None:
    dst = tmp_path / "ds"
    shutil.copytree(packed_small("tar", "256KiB", 1)[0], dst)
    old = tree_files(dst)
    old_shards = sorted(p.name for p in (dst / "shards").iterdir())
    assert len(old_shards) > 20

    # Without --force: refused, and the dataset is untouched.
    result = run_cli("pack", small_tree, dst, "--shard-size", "1MiB", "--no-progress")
    assert result.rc == 2
    assert_cli_error(result, str(dst), "already holds a shardio dataset", "--force")
    assert tree_files(dst) == old

    # --resume of a complete dataset: nothing to do, nothing lost.
    result = run_cli("pack", small_tree, dst, "--shard-size", "256KiB", "--resume")
    assert tree_files(dst) == old

    # --force: a new dataset, and none of the old shards are left.
    rc, _, err = run_cli(
        "pack",
        small_tree,
        dst,
        "--shard-size",
        "1MiB",
        "--force",
        *W1,
    )
    assert rc == 0, err
    man = json.loads((dst / "manifest.json").read_text())
    listed = {s["path"].split("/")[-1] for s in man["shards"]}
    listed |= {s["dali_index"].split("/")[-1] for s in man["shards"]}
    assert sorted(p.name for p in (dst / "shards").iterdir()) == sorted(listed)
    assert len(man["shards"]) < len(old_shards) // 2
    assert man["options"]["shard_size_bytes"] == 1024**2
    rc, _, err = run_cli("verify", dst, *W1)
    assert rc == 0, err


def test_dst_is_a_file(
    tiny_tree: pathlib.Path, tmp_path: pathlib.Path, run_cli, assert_cli_error
) -> None:
    dst = tmp_path / "ds"
    dst.write_text("not a directory")
    result = run_cli("pack", tiny_tree, dst, "--no-progress")
    assert_cli_error(result, str(dst))
    assert dst.read_text() == "not a directory"


def test_resume_with_nothing_to_resume_packs(
    tiny_tree: pathlib.Path, tmp_path: pathlib.Path, run_cli
) -> None:
    dst = tmp_path / "ds"
    rc, out, err = run_cli("pack", tiny_tree, dst, "--resume", *W1)
    assert rc == 0, err
    assert "reused" not in out
    rc, _, err = run_cli("verify", dst, *W1)
    assert rc == 0, err


def test_unpack_into_a_non_empty_directory(
    packed_small, tmp_path: pathlib.Path, run_cli, assert_cli_error
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    result = run_cli("unpack", packed_small("tar", "1MiB", 1)[0], out)
    assert result.rc == 2
    assert_cli_error(result, str(out), "not empty")
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert (out / "keep.txt").read_text() == "mine"


def test_resume_and_force_together(
    tiny_tree: pathlib.Path, tmp_path: pathlib.Path, run_cli, assert_cli_error
) -> None:
    result = run_cli("pack", tiny_tree, tmp_path / "ds", "--resume", "--force")
    assert result.rc == 2
    assert_cli_error(result, "--resume", "--force")
    assert not (tmp_path / "ds" / "manifest.json").exists()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("--format", "zip"), "invalid choice"),
        (("--stripe", "lots"), "'lots'"),
        (("--fs-type", "ntfs"), "'ntfs'"),
        (("--labels", "maybe"), "invalid choice"),
    ],
)
def test_bad_options(
    args: tuple[str, ...],
    needle: str,
    tiny_tree: pathlib.Path,
    tmp_path: pathlib.Path,
    run_cli,
) -> None:
    result = run_cli("pack", tiny_tree, tmp_path / "ds", *args)
    assert result.rc == 2
    assert "Traceback" not in result.stderr
    assert needle in result.stderr
    assert not (tmp_path / "ds" / "manifest.json").exists()


# --------------------------------------------------------------------------- odd files


@pytest.fixture
def odd_tree(tmp_path: pathlib.Path) -> tuple[pathlib.Path, dict[str, str]]:
    """A class-dir tree with regular files and every kind of file that cannot be packed.

    Returns (src, {relative path: expected skip reason}); the device file only where
    mknod is permitted.
    """
    src = tmp_path / "odd"
    a, b = src / "a", src / "b"
    a.mkdir(parents=True)
    b.mkdir()
    for i in range(6):
        (a / f"img_{i}.jpg").write_bytes(os.urandom(5000 + 37 * i))
        (b / f"img_{i}.jpg").write_bytes(os.urandom(7000 + 11 * i))
    (a / "empty.jpg").write_bytes(b"")
    (b / "huge.bin").write_bytes(os.urandom(100_000))  # larger than the 64 KiB shard size
    (a / "link_to_file.jpg").symlink_to(a / "img_0.jpg")  # followed: packed as a file
    skipped = {
        "a/broken.jpg": "broken symlink",
        "a/loop.jpg": "symlink loop",
        "b/dirlink": "symlink to a directory (not followed)",
        "b/pipe.jpg": "FIFO (named pipe)",
    }
    (a / "broken.jpg").symlink_to(src / "does-not-exist.jpg")
    (a / "loop.jpg").symlink_to(a / "loop.jpg")
    (b / "dirlink").symlink_to(a, target_is_directory=True)
    os.mkfifo(b / "pipe.jpg")
    try:
        os.mknod(b / "null.dev", 0o600 | stat.S_IFCHR, os.makedev(1, 3))
        skipped["b/null.dev"] = "device file"
    except OSError:
        pass  # no permission for device files here: that case is skipped
    return src, skipped


def test_odd_files_are_skipped_listed_and_reported(
    odd_tree: tuple[pathlib.Path, dict[str, str]],
    tmp_path: pathlib.Path,
    run_cli,
) -> None:
    src, skipped = odd_tree
    dst = tmp_path / "ds"
    rc, out, err = run_cli(
        "pack",
        src,
        dst,
        "--shard-size",
        "64KiB",
        *W1,
        timeout=30,
    )
    assert rc == 0, err
    assert "Traceback" not in err

    # The summary names every skipped file and its reason (at most 5 are shown; we have 5).
    assert f"skipped {len(skipped)} file(s), listed in {dst}/pack-report.json:" in out, out
    for path, reason in skipped.items():
        assert f"  {path}: {reason}" in out, (path, out)
    assert "1 sample(s) larger than --shard-size got a shard each" in out

    report = json.loads((dst / "pack-report.json").read_text())
    assert sorted((s["path"], s["reason"]) for s in report["skipped"]) == sorted(skipped.items())
    assert report["oversized"] == ["b/huge"]

    # The oversized file is alone in its shard.
    man = json.loads((dst / "manifest.json").read_text())
    big = [s for s in man["shards"] if s["size_bytes"] > 64 * 1024]
    assert len(big) == 1
    assert big[0]["num_samples"] == 1
    with tarfile.open(dst / big[0]["path"]) as tf:
        assert tf.getnames() == ["b/huge.bin", "b/huge.cls"]

    rc, _, err = run_cli("verify", dst, *W1)
    assert rc == 0, err

    # Unpack: every packable file comes back (the file symlink as a regular file, the
    # zero-byte file as an empty file), and nothing that was skipped.
    out_dir = tmp_path / "restored"
    rc, _, err = run_cli("unpack", dst, out_dir)
    assert rc == 0, err
    expected = tree_files(src)
    expected["a/link_to_file.jpg"] = (src / "a" / "img_0.jpg").read_bytes()
    assert tree_files(out_dir) == expected
    assert (out_dir / "a" / "empty.jpg").stat().st_size == 0
    for path in skipped:
        assert not os.path.lexists(out_dir / path)


@pytest.mark.parametrize("kind", ["broken", "fifo", "device"])
def test_strict_turns_a_skip_into_an_error(
    kind: str, tiny_tree: pathlib.Path, tmp_path: pathlib.Path, run_cli, assert_cli_error
) -> None:
    bad = tiny_tree / "dog" / "dog_9.jpg"
    if kind == "broken":
        bad.symlink_to(tmp_path / "gone")
        reason = "broken symlink"
    elif kind == "fifo":
        os.mkfifo(bad)
        reason = "FIFO"
    else:
        try:
            os.mknod(bad, 0o600 | stat.S_IFCHR, os.makedev(1, 3))
        except OSError:
            pytest.skip("cannot create a device file here")
        reason = "device file"
    dst = tmp_path / "ds"
    result = run_cli("pack", tiny_tree, dst, "--strict", "--no-progress", timeout=30)
    assert result.rc != 0
    assert_cli_error(result, "dog/dog_9.jpg", reason)
    assert not (dst / "manifest.json").exists()
    assert not list((dst / "shards").glob("shard-*")) if (dst / "shards").exists() else True

    # Without --strict the same tree packs (skipping the file) into the same DST.
    rc, out, err = run_cli("pack", tiny_tree, dst, "--no-progress", "--resume", timeout=30)
    assert rc == 0, err
    assert "dog/dog_9.jpg" in out


def test_a_failed_strict_pack_does_not_poison_dst(
    tiny_tree: pathlib.Path, tmp_path: pathlib.Path, run_cli
) -> None:
    """After a --strict refusal, the plain command (no --resume) works on the same DST."""
    os.mkfifo(tiny_tree / "dog" / "pipe.jpg")
    dst = tmp_path / "ds"
    assert run_cli("pack", tiny_tree, dst, "--strict", timeout=30).rc != 0
    rc, _, err = run_cli("pack", tiny_tree, dst, "--no-progress", timeout=30)
    assert rc == 0, err


def test_zero_byte_only_tree(tmp_path: pathlib.Path, run_cli) -> None:
    src = tmp_path / "zeros"
    (src / "c").mkdir(parents=True)
    for i in range(3):
        (src / "c" / f"z{i}.txt").write_bytes(b"")
    dst = tmp_path / "ds"
    rc, out, err = run_cli("pack", src, dst, "--no-progress")
    assert rc == 0, err
    assert " samples in 1 tar shard (" in out, out  # one shard: "shard", not "shards"
    rc, _, err = run_cli("verify", dst, *W1)
    assert rc == 0, err
    out_dir = tmp_path / "restored"
    rc, _, err = run_cli("unpack", dst, out_dir)
    assert rc == 0, err
    assert tree_files(out_dir) == {f"c/z{i}.txt": b"" for i in range(3)}


def test_skipped_report_path_of_a_dst_given_with_a_slash(tmp_path: pathlib.Path, run_cli) -> None:
    """``pack SRC out/`` names ``out/pack-report.json``, not ``out//pack-report.json``."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_bytes(b"a")
    (src / "gone.txt").symlink_to("nowhere")
    dst = f"{tmp_path / 'ds'}/"
    rc, out, err = run_cli("pack", src, dst, "--no-progress")
    assert rc == 0, err
    assert f"skipped 1 file(s), listed in {tmp_path / 'ds'}/pack-report.json:" in out, out
    assert "//" not in out, out


# --------------------------------------------------------------------------- manifests


@pytest.fixture(scope="module")
def good_dataset(packed_small) -> pathlib.Path:
    return packed_small("tar", "1MiB", 1)[0]


def _broken_copy(good: pathlib.Path, tmp_path: pathlib.Path, kind: str) -> tuple[pathlib.Path, str]:
    dst = tmp_path / "ds"
    shutil.copytree(good, dst)
    manifest = dst / "manifest.json"
    doc = json.loads(manifest.read_text())

    def write(doc: dict) -> None:  # re-sealed, so the edit itself is what is caught
        doc["manifest_xxh3_128"] = "0" * 32  # the value the checksum is computed over
        manifest.write_bytes(encode_document(doc))

    if kind == "garbage":
        manifest.write_bytes(b"{not json at all\n\x00\xff")
        needle = "not valid JSON"
    elif kind == "version-99":
        doc["format_version"] = 99
        write(doc)
        needle = "unsupported format_version 99"
    elif kind == "missing-field":
        del doc["num_samples"]
        write(doc)
        needle = "num_samples"
    elif kind == "not-shardio":
        manifest.write_text(json.dumps({"format": "webdataset"}))
        needle = "not a shardio manifest"
    elif kind == "escaping-path":
        doc["shards"][0]["path"] = "../../etc/passwd"
        write(doc)
        needle = "../../etc/passwd"
    elif kind == "no-manifest":
        manifest.unlink()
        needle = "no manifest"
    else:
        raise AssertionError(kind)
    return dst, needle


MANIFEST_CASES = [
    (kind, command)
    for kind in ("garbage", "version-99", "missing-field", "not-shardio", "escaping-path")
    for command in ("verify", "inspect")
] + [
    (kind, command)
    for kind in ("garbage", "version-99", "no-manifest")
    for command in ("ls", "unpack")
]


@pytest.mark.parametrize(("kind", "command"), MANIFEST_CASES)
def test_malformed_manifest(
    kind: str,
    command: str,
    good_dataset: pathlib.Path,
    tmp_path: pathlib.Path,
    run_cli,
    assert_cli_error,
) -> None:
    dst, needle = _broken_copy(good_dataset, tmp_path, kind)
    args = [command, dst]
    if command == "unpack":
        args.append(tmp_path / "out")
    if command == "verify":
        args += ["--workers", "1", "--no-progress"]
    result = run_cli(*args)
    assert result.rc != 0
    assert_cli_error(result, str(dst / "manifest.json"), needle)
    if command == "unpack":
        assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_verify_of_a_missing_dataset(tmp_path: pathlib.Path, run_cli, assert_cli_error) -> None:
    result = run_cli("verify", tmp_path / "nothing")
    assert result.rc != 0
    assert_cli_error(result, str(tmp_path / "nothing"))


# --------------------------------------------------------------------------- ENOSPC


@pytest.mark.parametrize(("fmt", "workers"), [("tar", "1"), ("tar", "2"), ("hdf5", "1")])
def test_enospc_on_a_full_tmpfs(
    fmt: str,
    workers: str,
    small_tree: pathlib.Path,
    small_tmpfs: pathlib.Path,
    run_cli,
    assert_cli_error,
    packed_small,
) -> None:
    args = ("--format", fmt, "--shard-size", "512KiB", "--workers", workers, "--no-progress")
    reference = tree_files(packed_small(fmt, "512KiB", 1)[0])
    suffix = {"tar": ".tar", "hdf5": ".h5"}[fmt]

    dst = small_tmpfs / "ds"
    result = run_cli("pack", small_tree, dst, *args)  # ~6 MB into 3 MiB
    assert result.rc == 1
    line = assert_cli_error(result, "no space left")
    assert str(dst) in line
    assert not (dst / "manifest.json").exists()
    assert temp_files(small_tmpfs) == []
    published = sorted((dst / "shards").glob("shard-*"))
    assert any(p.suffix == suffix for p in published), "nothing was published before ENOSPC"
    for p in published:
        assert p.read_bytes() == reference[f"shards/{p.name}"], f"{p.name} damaged"

    # Room again: --resume finishes the pack, byte-identical to the reference.
    remount = subprocess.run(
        ["mount", "-o", "remount,size=32M", str(small_tmpfs)], capture_output=True, check=False
    )
    if remount.returncode != 0:
        return
    rc, out, err = run_cli("pack", small_tree, dst, *args, "--resume")
    assert rc == 0, err
    assert "reused" in out
    got = tree_files(dst)
    man, ref_man = json.loads(got.pop("manifest.json")), json.loads(reference["manifest.json"])
    assert man.pop("layout")["fs_type"] == "tmpfs"  # the reference is on another filesystem
    ref_man.pop("layout")
    man.pop("manifest_xxh3_128")  # covers the layout too
    ref_man.pop("manifest_xxh3_128")
    assert man == ref_man
    assert got == {k: v for k, v in reference.items() if k != "manifest.json"}


def test_enospc_in_process_names_the_shard(
    small_tree: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shardio.writers.tar as tar_writer

    real_writev = os.writev
    calls = {"n": 0}

    def writev(fd: int, buffers: list[bytes]) -> int:
        calls["n"] += 1
        if calls["n"] == 4:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_writev(fd, buffers)

    monkeypatch.setattr(tar_writer.os, "writev", writev)
    dst = tmp_path / "ds"
    with pytest.raises(StorageError) as info:
        pack(
            str(small_tree),
            str(dst),
            PackOptions(shard_size_bytes=256 * 1024, workers=1, durable=False),
        )
    monkeypatch.undo()
    exc = info.value
    assert exc.errno == errno.ENOSPC
    shard = str(dst / "shards" / "shard-000003.tar")
    assert shard in str(exc)
    assert "no space left" in str(exc)
    assert temp_files(dst) == []
    assert not (dst / "manifest.json").exists()
    assert sorted(p.name for p in (dst / "shards").glob("*.tar")) == [
        f"shard-{i:06d}.tar" for i in range(3)
    ]
    for i in range(3):
        with tarfile.open(dst / "shards" / f"shard-{i:06d}.tar") as tf:
            assert tf.getnames()


# --------------------------------------------------------------------------- labels, names


def test_a_stray_ds_store_keeps_labels_and_is_reported(
    tiny_tree: pathlib.Path, tmp_path: pathlib.Path, run_cli
) -> None:
    (tiny_tree / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1")
    dst = tmp_path / "ds"
    rc, out, err = run_cli("pack", tiny_tree, dst, *W1)
    assert rc == 0, err
    assert "labels: 2 classes (class-dirs)" in out, out
    assert "  .DS_Store: hidden file outside the class-dirs label layout" in out, out
    report = json.loads((dst / "pack-report.json").read_text())
    assert report["skipped"] == [
        {"path": ".DS_Store", "reason": "hidden file outside the class-dirs label layout"}
    ]
    man = json.loads((dst / "manifest.json").read_text())
    assert man["labels"] == {"layout": "class-dirs", "classes": ["cat", "dog"]}


def test_the_summary_says_why_there_are_no_labels(
    tiny_tree: pathlib.Path, tmp_path: pathlib.Path, run_cli
) -> None:
    (tiny_tree / "README.txt").write_text("about this data")
    rc, out, err = run_cli("pack", tiny_tree, tmp_path / "ds", *W1)
    assert rc == 0, err
    assert (
        "labels: none (files at different depths, e.g. README.txt; --labels none silences this)"
        in out
    ), out
    rc, out, err = run_cli("pack", tiny_tree, tmp_path / "ds2", "--labels", "none", *W1)
    assert rc == 0, err
    assert "labels: none (--labels none)" in out, out


def test_reserved_webdataset_extensions_do_not_replace_the_key(
    tmp_path: pathlib.Path, run_cli
) -> None:
    """``x.__key__`` would overwrite the sample's key in a WebDataset reader; it becomes
    member ``%5F_key__`` and unpacks back to the original name."""
    src = tmp_path / "src"
    src.mkdir()
    files = {"x.jpg": b"image", "x.__key__": b"not a key", "y.__url__": b"u", "y.txt": b"t"}
    for name, data in files.items():
        (src / name).write_bytes(data)
    dst = tmp_path / "ds"
    rc, _, err = run_cli("pack", src, dst, *W1)
    assert rc == 0, err
    [shard] = sorted((dst / "shards").glob("*.tar"))
    with tarfile.open(shard) as tf:
        names = tf.getnames()
    assert names == ["x.%5F_key__", "x.jpg", "y.%5F_url__", "y.txt"]
    keys: dict[str, list[str]] = {}
    for name in names:  # as WebDataset groups members: key before the first dot
        key, _, ext = name.partition(".")
        keys.setdefault(key, []).append(ext)
        assert not ext.startswith("__")
    assert sorted(keys) == ["x", "y"]
    rc, out, _ = run_cli("ls", dst)
    assert out.split() == ["x", "y"]
    restored = tmp_path / "restored"
    rc, _, err = run_cli("unpack", dst, restored)
    assert rc == 0, err
    assert tree_files(restored) == files


def test_enospc_during_parity_add_is_one_line_and_resumes(
    small_tree: pathlib.Path, small_tmpfs: pathlib.Path, run_cli, assert_cli_error
) -> None:
    """Room for the shards but not for their parity (1+1 doubles them): one line naming a
    parity file, the manifest as it was, no temp file; with room again the add resumes."""
    pytest.importorskip("pyeclib")
    subprocess.run(["mount", "-o", "remount,size=9M", str(small_tmpfs)], check=True)
    dst = small_tmpfs / "ds"
    assert run_cli("pack", small_tree, dst, "--shard-size", "512KiB", "--workers", "1",
                   "--no-progress").rc == 0  # fmt: skip
    before = (dst / "manifest.json").read_bytes()
    result = run_cli("parity", "add", dst, "--parity", "1+1", "--workers", "2")
    line = assert_cli_error(result, "no space left on device while writing", str(dst / "parity"))
    assert result.rc == 1, line
    assert (dst / "manifest.json").read_bytes() == before
    assert temp_files(small_tmpfs) == []
    subprocess.run(["mount", "-o", "remount,size=32M", str(small_tmpfs)], check=True)
    result = run_cli("parity", "add", dst, "--parity", "1+1", "--workers", "2")
    assert result.rc == 0, result.stderr
    assert run_cli("verify", dst, "--workers", "1", "--no-progress").rc == 0
