"""Names and manifests of checkpoints: what they carry, what the parser refuses."""

from __future__ import annotations

import copy
import json

import pytest

from shardio.checkpoint.manifest import CheckpointManifest, RankFile, parse_manifest
from shardio.checkpoint.naming import (
    Identity,
    check_step,
    clean_host,
    dir_name,
    is_checkpoint_name,
    is_rank_file_name,
    job_id_from,
    rank_file_name,
    temp_dir_name,
)
from shardio.errors import FormatError, UsageError


def _identity(rank: int = 0, world: int = 1, job: str = "4242") -> Identity:
    return Identity(rank=rank, world_size=world, hosts=tuple(f"node{r}" for r in range(world)),
                    job_id=job)  # fmt: skip


def test_names_carry_host_job_kind_step_and_rank() -> None:
    ident = _identity(rank=1, world=2)
    assert dir_name(ident, "full", 1200) == "checkpoint_node0_4242_full_step000000000001200"
    assert dir_name(ident, "full", 1200, attempt=1).endswith("step000000000001200-2")
    name = rank_file_name(ident.host, ident.job_id, "light", 7, ident.rank, zstd=True)
    assert name == "checkpoint_node1_4242_light_step000000000000007_rank00001.pt.zst"
    assert is_rank_file_name(name) and is_checkpoint_name(dir_name(ident, "light", 7))
    assert temp_dir_name(ident, "full", 3, "0123456789abcdef").startswith(".checkpoint_4242_")


@pytest.mark.parametrize(
    ("raw", "clean"),
    [("node01", "node01"), ("gpu_node-3", "gpu-node-3"), ("../../etc", "etc"), ("", "host"),
     ("é" * 90, "host"), ("a" * 100, "a" * 63)],
)  # fmt: skip
def test_host_names_are_cleaned(raw: str, clean: str) -> None:
    assert clean_host(raw) == clean


@pytest.mark.parametrize("value", ["", "../x", "1 2", "a/b", "x" * 65, "_1", "١٢"])
def test_a_malformed_slurm_job_id_is_refused(value: str) -> None:
    with pytest.raises(UsageError, match="SLURM_JOB_ID"):
        job_id_from({"SLURM_JOB_ID": value})


def test_job_id_outside_slurm() -> None:
    assert job_id_from({}) == "nojob"
    assert job_id_from({"SLURM_JOB_ID": "123456"}) == "123456"


@pytest.mark.parametrize("step", [-1, 1.0, True, "3", 10**15, 2**80, None])
def test_bad_steps_are_refused(step: object) -> None:
    with pytest.raises(UsageError, match="step"):
        check_step(step)


def test_numpy_steps_are_taken() -> None:
    np = pytest.importorskip("numpy")
    assert check_step(np.int64(5)) == 5


def _manifest() -> CheckpointManifest:
    f = RankFile(
        rank=0, host="node0", name=rank_file_name("node0", "4242", "full", 9, 0, zstd=True),
        size_bytes=10, raw_bytes=20, xxh3_128="0" * 32, compression="zstd", has_state=True,
        has_loader=False,
    )  # fmt: skip
    return CheckpointManifest(
        kind="full", step=9, job_id="4242", world_size=1, per_rank=False, saved_at_ns=5,
        token="0123456789abcdef", files=(f,), loader={"epoch": 1}, shardio_version="0",
    )  # fmt: skip


def test_manifest_round_trip() -> None:
    doc = json.loads(_manifest().to_bytes())
    assert parse_manifest(doc, "m") == _manifest()


def _resealed(doc: dict) -> dict:
    from shardio.checkpoint.manifest import _seal  # the test forges a valid seal

    doc = copy.deepcopy(doc)
    doc["seal"] = _seal(doc)
    return doc


def test_an_edited_manifest_fails_its_seal() -> None:
    doc = json.loads(_manifest().to_bytes())
    doc["step"] = 10
    with pytest.raises(FormatError, match="seal"):
        parse_manifest(doc, "m")


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (lambda d: d["files"][0].update(name="../../etc/passwd"), "not a checkpoint file"),
        (lambda d: d["files"][0].update(name=rank_file_name("node0", "4242", "full", 9, 1,
                                                           zstd=True)), "not this rank"),
        (lambda d: d["files"][0].update(size_bytes=-1), "out of range"),
        (lambda d: d["files"][0].update(xxh3_128="zz"), "hex"),
        (lambda d: d["files"][0].update(compression="lz4"), "compression"),
        (lambda d: d.update(world_size=2), "2 ranks"),
        (lambda d: d.update(kind="huge"), "kind"),
        (lambda d: d.update(step=True), "wrong type"),
        (lambda d: d.update(job_id="../x"), "job id"),
        (lambda d: d.update(version=2), "version"),
        (lambda d: d.update(loader={"epoch": "1"}), "loader"),
    ],
)  # fmt: skip
def test_the_parser_refuses_malformed_fields(edit, needle: str) -> None:
    doc = json.loads(_manifest().to_bytes())
    edit(doc)
    with pytest.raises(FormatError, match=needle):
        parse_manifest(_resealed(doc), "m")
