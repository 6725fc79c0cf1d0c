"""save and load_latest: atomic, verified, falling back past damage, never deleting."""

from __future__ import annotations

import os
import pathlib
import sys

import pytest
import torch
from checkpointing import JOB, assert_state, state_of

from shardio.checkpoint import load_latest, save
from shardio.checkpoint.audit import latest_intact, verify_checkpoints
from shardio.errors import CheckpointError, NoCheckpointError, UsageError


def _files(path: str) -> list[pathlib.Path]:
    return sorted(pathlib.Path(path).glob("checkpoint_*_rank*.pt*"))


def test_round_trip(ckdir: pathlib.Path) -> None:
    path = save(state_of(3), ckdir, kind="full", step=3, environ=JOB)
    assert path is not None and os.path.basename(path).startswith("checkpoint_")
    assert "_1001_full_step000000000000003" in path
    assert sorted(os.listdir(path)) == sorted(["manifest.json", _files(path)[0].name])
    ck = load_latest(ckdir)
    assert (ck.path, ck.kind, ck.step, ck.skipped) == (path, "full", 3, [])
    assert_state(ck.state, 3)


@pytest.mark.parametrize("compression", ["zstd", "none", "auto"])
def test_compression_choices(ckdir: pathlib.Path, compression: str) -> None:
    path = save(state_of(1, mib=1), ckdir, step=1, environ=JOB, compression=compression)
    (f,) = _files(path)
    assert f.name.endswith(".zst") == (compression in ("zstd", "auto"))  # 1 MiB: small
    ck = load_latest(ckdir)
    assert_state(ck.state, 1, mib=1)
    m = ck.manifest
    assert m.files[0].compression == ("zstd" if compression == "auto" else compression)
    if compression == "none":
        assert m.size_bytes == m.raw_bytes
    else:
        assert m.size_bytes < m.raw_bytes  # fp32 noise still compresses a little


def test_a_plain_state_compresses_well(ckdir: pathlib.Path) -> None:
    state = {"history": [{"epoch": i, "consumed": i * 1000, "spec": "order=random"}
                         for i in range(2000)]}  # fmt: skip
    save(state, ckdir, step=1, environ=JOB)
    m = load_latest(ckdir).manifest
    assert m.raw_bytes / m.size_bytes > 2.5  # torch's pickle is compact already


def test_newest_by_step_across_jobs(ckdir: pathlib.Path) -> None:
    save(state_of(5), ckdir, step=5, environ={"SLURM_JOB_ID": "1"})
    save(state_of(9), ckdir, step=9, environ={"SLURM_JOB_ID": "2"})  # the retried job
    save(state_of(7), ckdir, kind="light", step=7, environ={"SLURM_JOB_ID": "2"})
    assert load_latest(ckdir).step == 9
    assert load_latest(ckdir, kind="light").step == 7


def test_the_same_step_twice_never_overwrites(ckdir: pathlib.Path) -> None:
    first = save(state_of(4), ckdir, step=4, environ=JOB)
    second = save(state_of(5), ckdir, step=4, environ=JOB)  # a retry saving step 4 again
    assert first != second and second.endswith("-2")
    assert_state(load_latest(ckdir).state, 5)  # the later commit of the same step wins
    assert os.path.isdir(first)


@pytest.mark.parametrize("damage", ["flip", "truncate", "remove", "manifest", "no-manifest",
                                    "fifo", "symlink"])  # fmt: skip
def test_damage_in_the_newest_falls_back_to_the_one_before(
    ckdir: pathlib.Path, damage: str, tmp_path: pathlib.Path
) -> None:
    save(state_of(1), ckdir, step=1, environ=JOB)
    newest = save(state_of(2), ckdir, step=2, environ=JOB)
    (f,) = _files(newest)
    manifest = pathlib.Path(newest, "manifest.json")
    if damage == "flip":
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0x01
        f.write_bytes(bytes(data))
    elif damage == "truncate":
        os.truncate(f, f.stat().st_size // 2)
    elif damage == "remove":
        f.unlink()
    elif damage == "manifest":
        manifest.write_text(manifest.read_text().replace('"step": 2', '"step": 3'))
    elif damage == "no-manifest":
        manifest.unlink()
    elif damage == "fifo":
        f.unlink()
        os.mkfifo(f)
    elif damage == "symlink":  # the right bytes, but not a file shardio wrote there
        moved = tmp_path / "elsewhere"
        f.rename(moved)
        f.symlink_to(moved)
    before = sorted(p.name for p in pathlib.Path(newest).iterdir())
    ck = load_latest(ckdir)
    assert ck.step == 1
    assert_state(ck.state, 1)
    assert [p for p, _ in ck.skipped] == [newest]
    assert sorted(p.name for p in pathlib.Path(newest).iterdir()) == before  # nothing deleted
    # The command line agrees, without torch.
    found, skipped = latest_intact(str(ckdir))
    assert found.path != newest and [p for p, _ in skipped] == [newest]


def test_nothing_intact_raises_with_every_reason(ckdir: pathlib.Path) -> None:
    with pytest.raises(NoCheckpointError, match="no checkpoint in"):
        load_latest(ckdir)
    only = save(state_of(1), ckdir, step=1, environ=JOB)
    (f,) = _files(only)
    os.truncate(f, 10)
    with pytest.raises(CheckpointError, match="none loads") as info:
        load_latest(ckdir)
    assert not isinstance(info.value, NoCheckpointError)  # one exists: never a fresh start
    assert os.path.basename(only) in str(info.value) and "bytes" in str(info.value)
    assert f.exists()  # the only one is never deleted, damaged or not


def test_a_symlinked_checkpoint_directory_is_not_followed(
    ckdir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    other = tmp_path / "other"
    save(state_of(1), ckdir, step=1, environ=JOB)
    forged = save(state_of(8), other, step=8, environ=JOB)
    os.symlink(forged, ckdir / os.path.basename(forged))
    assert load_latest(ckdir).step == 1


class Custom:
    """An object torch.load(weights_only=True) refuses."""


def test_a_state_weights_only_refuses_says_so(
    ckdir: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shardio.checkpoint import writing

    # A save refuses such a state now (test_save_state_types.py): one from an older version.
    monkeypatch.setattr(writing, "check_payload", lambda payload: None)
    save({"obj": Custom()}, ckdir, step=1, environ=JOB)
    monkeypatch.undo()
    with pytest.raises(CheckpointError, match="weights_only=False") as info:
        load_latest(ckdir)
    assert not isinstance(info.value, NoCheckpointError)  # it exists: never a fresh start


def test_keep_prunes_only_old_checkpoints_of_that_kind(ckdir: pathlib.Path) -> None:
    light = save(state_of(0), ckdir, kind="light", step=0, environ=JOB)
    paths = [save(state_of(s), ckdir, step=s, environ=JOB, keep=2) for s in range(1, 5)]
    assert not os.path.exists(paths[0]) and not os.path.exists(paths[1])
    assert all(os.path.isdir(p) for p in paths[2:]) and os.path.isdir(light)


def test_prune_leaves_a_file_it_did_not_write(ckdir: pathlib.Path) -> None:
    old = save(state_of(1), ckdir, step=1, environ=JOB)
    pathlib.Path(old, "notes.txt").write_text("mine")
    save(state_of(2), ckdir, step=2, environ=JOB, keep=1)
    assert not os.path.exists(old)
    (left,) = [p for p in ckdir.iterdir() if p.name.startswith(".checkpoint")]
    assert sorted(os.listdir(left)) == ["notes.txt"]


def test_verify_reports_damage(ckdir: pathlib.Path) -> None:
    save(state_of(1), ckdir, step=1, environ=JOB)
    bad = save(state_of(2), ckdir, step=2, environ=JOB)
    (f,) = _files(bad)
    os.truncate(f, 3)
    items = verify_checkpoints(str(ckdir))
    assert [i.intact for i in items] == [False, True]
    assert verify_checkpoints(bad)[0].problems


def test_loader_state_rides_and_resumes(ckdir: pathlib.Path, packed_small) -> None:
    from shardio import ShardDataset

    ds_path = packed_small("tar", "256KiB", 1)[0]

    def loader():
        return ShardDataset(ds_path, seed=3).loader(batch_size=8, num_workers=0)

    def keys(batch):
        return list(batch["__key__"])

    first = loader()
    it = iter(first)
    for _ in range(5):
        next(it)
    save({"w": torch.ones(3)}, ckdir, step=5, loader=first, environ=JOB)
    rest = [k for b in it for k in keys(b)]
    again = loader()
    ck = load_latest(ckdir, loader=again)
    assert ck.loader_state is not None and ck.manifest.loader["consumed"] == 40
    assert [k for b in again for k in keys(b)] == rest


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [({"kind": "heavy"}, "kind"), ({"step": -1}, "step"), ({"level": 40}, "level"),
     ({"compression": "gzip"}, "compression"), ({"keep": 0}, "keep"),
     ({"stripe": "9x9x9"}, "stripe"), ({"commit_timeout_s": float("nan")}, "commit_timeout_s"),
     ({"threads": -1}, "threads"), ({"environ": {"SLURM_JOB_ID": "a/b"}}, "SLURM_JOB_ID"),
     ({"verify": "no"}, "verify must be True or False"),
     ({"write_timout_s": 5}, "unknown checkpoint option 'write_timout_s': the options are")],
)  # fmt: skip
def test_bad_arguments_are_refused_in_one_line(ckdir: pathlib.Path, kwargs, needle) -> None:
    args = {"kind": "full", "step": 1, "environ": JOB, **kwargs}
    with pytest.raises(UsageError, match=needle):
        save({"x": 1}, ckdir, **args)
    assert not ckdir.exists() or not any(ckdir.iterdir())


def test_a_file_where_the_directory_should_be(tmp_path: pathlib.Path) -> None:
    target = tmp_path / "file"
    target.write_text("x")
    with pytest.raises(CheckpointError, match="cannot create"):
        save({"x": 1}, target, step=1, environ=JOB)
    assert target.read_text() == "x"


def test_a_state_torch_cannot_save_is_a_clear_error(ckdir: pathlib.Path) -> None:
    save(state_of(1), ckdir, step=1, environ=JOB)
    with pytest.raises(UsageError, match=r"cannot save state\['f'\] \(function\)"):
        save({"f": lambda: 1}, ckdir, step=2, environ=JOB)
    saved = [p.name for p in ckdir.iterdir() if "checkpoint" in p.name]  # not the lease
    assert saved == [os.path.basename(load_latest(ckdir).path)]


@pytest.mark.parametrize(("dtype", "compressed"), [(torch.float32, False), (torch.bfloat16, True)])
def test_auto_compresses_what_pays(ckdir: pathlib.Path, dtype, compressed: bool) -> None:
    state = {"w": torch.randn(4 << 20).to(dtype)}  # 16 or 8 MiB of trained-like values
    path = save(state, ckdir, step=1, environ=JOB)
    (f,) = _files(path)
    assert f.name.endswith(".zst") == compressed
    assert torch.equal(load_latest(ckdir).state["w"], state["w"])


def test_a_position_in_another_dataset_is_not_resumed(ckdir: pathlib.Path, packed_small) -> None:
    from shardio import ShardDataset

    def loader(fmt: str):
        return ShardDataset(packed_small(fmt, "256KiB", 1)[0], seed=3).loader(
            batch_size=8, num_workers=0
        )

    tar = loader("tar")
    next(iter(tar))
    save({"w": torch.ones(1)}, ckdir, step=1, loader=tar, environ=JOB)
    other = loader("hdf5")  # the same files, as many samples, the same order: another dataset
    with pytest.raises(UsageError, match="another dataset"):
        load_latest(ckdir, loader=other)
    assert other.state_dict()["consumed"] == 0
    assert load_latest(ckdir, loader=loader("tar")).loader_state["consumed"] == 8


def test_striped_on_lustre_by_pack_s_layout_code(ckdir: pathlib.Path) -> None:
    """A recording fake runner stands in for ``lfs`` (no Lustre here): the checkpoint's temp
    directory gets the layout ``pack`` plans for a file of the state's size."""
    from shardio.storage.runner import CommandResult

    calls: list[tuple[str, ...]] = []

    def runner(argv, *, timeout_s: float = 60.0) -> CommandResult:
        calls.append(tuple(argv))
        out = "".join(f"fs-OST{i:04x}_UUID 1 1 1 1% /mnt/fs[OST:{i}]\n" for i in range(16))
        return CommandResult(argv=tuple(argv), returncode=0, stdout=out, stderr="")

    path = save(state_of(1, mib=4), ckdir, step=1, environ=JOB, fs_type="lustre",
                runner=runner)  # fmt: skip
    setstripe = [c for c in calls if c[:2] == ("lfs", "setstripe")]
    assert len(setstripe) == 1
    assert setstripe[0][-1].startswith(str(ckdir / ".checkpoint_1001_full_step"))
    assert "-c" in setstripe[0] and "-S" in setstripe[0]
    assert_state(load_latest(ckdir).state, 1, mib=4)
    assert path is not None


def test_without_the_checkpoint_extra(ckdir: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from shardio.errors import MissingExtraError

    first = save({"w": torch.zeros(1 << 20).to(torch.bfloat16)}, ckdir, step=1, environ=JOB)
    assert _files(first)[0].name.endswith(".zst")
    monkeypatch.setitem(sys.modules, "zstandard", None)  # as if not installed
    with pytest.raises(MissingExtraError, match=r"pip install zstandard"):
        save({"w": 1}, ckdir, step=2, environ=JOB, compression="zstd")
    raw = save({"w": torch.zeros(1 << 20)}, ckdir, step=3, environ=JOB)  # auto: written raw
    assert not _files(raw)[0].name.endswith(".zst")
    assert load_latest(ckdir).step == 3
    import shutil

    shutil.rmtree(raw)
    with pytest.raises(CheckpointError, match=r"pip install zstandard") as info:
        load_latest(ckdir)  # the compressed one cannot be read without the extra: said so
    assert not isinstance(info.value, NoCheckpointError)  # never "none": a fresh start


def test_auto_weighs_each_dtype_by_its_bytes() -> None:
    from shardio.checkpoint.snapshot import estimate_ratio

    # Many fp32 tensors larger than the bf16 ones: the bf16 are sampled too, at their share.
    state = {f"t{i}": torch.randn(1 << 20) if i % 4 else torch.randn(1 << 20).bfloat16()
             for i in range(80)}  # fmt: skip
    fp32, bf16 = 60 * 4, 20 * 2  # MiB
    expected = (fp32 + bf16) / (fp32 / 1.08 + bf16 / 1.29)
    assert estimate_ratio(state, level=1) == pytest.approx(expected, rel=0.03)


@pytest.mark.parametrize(
    "env", [{"RANK": "1", "WORLD_SIZE": "4"}, {"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}]
)
def test_one_rank_of_many_without_a_process_group_is_refused(ckdir: pathlib.Path, env) -> None:
    with pytest.raises(UsageError, match=r"torch\.distributed is not initialized"):
        save({"w": 1}, ckdir, step=1, environ={**JOB, **env})
    assert not ckdir.exists()


def test_options_and_their_fields_together_are_refused(ckdir: pathlib.Path) -> None:
    from shardio.checkpoint import SaveOptions

    with pytest.raises(UsageError, match="not both"):
        save({"w": 1}, ckdir, step=1, environ=JOB, options=SaveOptions(), level=3)
