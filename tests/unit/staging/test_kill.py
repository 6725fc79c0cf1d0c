"""SIGKILL in the middle of ``shardio stage``, then a rerun.

The stager runs through scripts/stage_wrapper.py, which slows each verified copy (so the
kill lands mid-staging) or blocks just before publishing one copy (so the kill leaves a
complete temp file behind, as a kill in the middle of a write does). After the kill, nothing
under a final name is half-written; the rerun completes, verifies everything, copies only
what was not complete, and leaves no temp file.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess

from shardio.format.checksum import file_xxh3_128

SUMMARY = re.compile(r"copied (\d+) .*already staged and verified (\d+), replaced (\d+)", re.DOTALL)
MIN_STAMPS = 5


def _start(argv, env):
    return subprocess.Popen(
        argv,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def _kill(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


def _assert_final_names_complete(src, dest) -> None:
    """Every file under a final name in dest is complete: shards hash to the manifest,
    DALI indexes and the index equal the source's."""
    for entry in src.manifest.shards:
        path = dest / entry.path
        if path.exists():
            assert file_xxh3_128(path) == entry.xxh3_128, f"half-written {entry.path}"
        if entry.dali_index is not None and (dest / entry.dali_index).exists():
            assert (dest / entry.dali_index).read_bytes() == (
                src.path / entry.dali_index
            ).read_bytes(), f"half-written {entry.dali_index}"
    index = dest / src.manifest.index.path
    if index.exists():
        assert file_xxh3_128(index) == src.manifest.index.xxh3_128, "half-written index"


def _holding(src, dest, helpers) -> bool:
    """The wrapper holds the 3rd copy: 2 shards published, one complete temp copy on disk."""
    if len(src.staged(dest)) != 2:
        return False
    temps = helpers.temp_files(dest / "shards")
    sizes = {s.size_bytes for s in src.manifest.shards}
    if len(temps) != 1:
        return False
    try:  # a DALI index's temp can be published between the listing and this look
        return os.path.getsize(dest / "shards" / temps[0]) in sizes
    except FileNotFoundError:
        return False


def _stamps(dest) -> int:
    try:
        return sum(1 for n in os.listdir(dest / ".shardio-stage" / "ok") if n.endswith(".json"))
    except FileNotFoundError:
        return 0


def test_sigkill_mid_stage_then_rerun_copies_only_the_rest(
    big_src, tmp_path, stage_wrapper, child_env, poll, run_cli, helpers
):
    dest = tmp_path / "stage"
    argv = stage_wrapper("stage", big_src.path, dest, "--streams", "1", "--no-progress")
    proc = _start(argv, child_env({"STAGE_TEST_DELAY_S": "0.05"}))
    try:
        reached = poll(lambda: _stamps(dest) >= MIN_STAMPS, proc, 60)
    finally:
        _kill(proc)
    assert reached, "the stager made no progress"
    assert proc.returncode == -signal.SIGKILL, "the stager finished before the kill"
    stamps_before = _stamps(dest)
    total = big_src.num_shards
    assert MIN_STAMPS <= stamps_before < total
    _assert_final_names_complete(big_src, dest)

    rc, out, err = run_cli("stage", big_src.path, dest, "--no-progress")
    assert rc == 0, err
    m = SUMMARY.search(out)
    assert m is not None, out
    copied, present, replaced = map(int, m.groups())
    assert replaced == 0, out
    assert copied + present == total, out
    assert copied <= total - stamps_before, f"{stamps_before} stamped before the kill: {out}"
    assert present >= stamps_before, out
    big_src.assert_staged_ok(dest, set(big_src.rels))
    assert helpers.temp_files(dest) == [], "temp files left after the rerun"

    # A third run has nothing to do.
    rc, out, err = run_cli("stage", big_src.path, dest, "--no-progress")
    assert rc == 0, err
    assert "copied 0 " in out and f"already staged and verified {total}," in out, out


def test_sigkill_while_a_copy_is_a_temp_file(
    big_src, tmp_path, stage_wrapper, child_env, poll, run_cli, helpers
):
    """Killed with a complete copy still under its temp name: the temp never shows under a
    final name, and the rerun (or --clean) does not leave it behind on the node's disk."""
    dest = tmp_path / "stage"
    argv = stage_wrapper("stage", big_src.path, dest, "--streams", "1", "--no-progress")
    proc = _start(argv, child_env({"STAGE_TEST_HOLD_AT": "3"}))
    try:
        reached = poll(lambda: _holding(big_src, dest, helpers), proc, 60)
    finally:
        _kill(proc)
    assert reached, "the stager never wrote a temp copy"
    held = helpers.temp_files(dest)
    assert len(held) == 1, held
    assert len(big_src.staged(dest)) == 2, "only the copies before the held one are published"
    _assert_final_names_complete(big_src, dest)

    rc, out, err = run_cli("stage", big_src.path, dest, "--no-progress")
    assert rc == 0, err
    m = SUMMARY.search(out)
    assert m is not None, out
    copied, present, _ = map(int, m.groups())
    assert (copied, present) == (big_src.num_shards - 2, 2), out
    big_src.assert_staged_ok(dest, set(big_src.rels))
    assert helpers.temp_files(dest) == [], "the killed run's temp copy is still on disk"


def test_clean_after_a_killed_stage_removes_everything(
    big_src, tmp_path, stage_wrapper, child_env, poll, run_cli, helpers
):
    """The job epilogue (`stage --clean`) after a killed prologue leaves nothing of shardio's."""
    dest = tmp_path / "stage"
    dest.mkdir()
    argv = stage_wrapper("stage", big_src.path, dest, "--streams", "1", "--no-progress")
    proc = _start(argv, child_env({"STAGE_TEST_HOLD_AT": "3"}))
    try:
        assert poll(lambda: _holding(big_src, dest, helpers), proc, 60)
        (dest / "notes.txt").write_text("not shardio's")  # a user's file in the area
    finally:
        _kill(proc)
    rc, out, err = run_cli("stage", "--clean", dest)
    assert rc == 0, err
    assert "removed 2 staged shard(s)" in out, out
    assert sorted(os.listdir(dest)) == ["notes.txt"], sorted(
        os.path.relpath(os.path.join(d, n), dest) for d, _, ns in os.walk(dest) for n in ns
    )
