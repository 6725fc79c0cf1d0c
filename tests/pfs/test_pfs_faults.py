"""Dead data servers on the real MooseFS bed: a stopped chunkserver (before and during an
epoch, one copy and two), a chunk's bytes flipped on a chunkserver's disk, the master
restarted mid-epoch, the mount gone, and SIGKILL during a stall then resume.

Each epoch runs in a subprocess with a timeout (a read blocked on a dead chunkserver sits in
an uninterruptible FUSE wait: even SIGKILL ends the process only once the client gives up),
writes what it delivered as JSON, and checks every delivered member against the digests
taken before the fault. Figures (epoch time, stalls, samples lost) are printed.
"""

from __future__ import annotations

import collections
import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import xxhash
from mfsbed import Bed, forget_bed_holds, wait_for

from shardio.read.reader import ShardReader

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "pfs" / "moosefs.sh"
_EPOCH_TIMEOUT_S = 200
_TIMEOUT_S = 5  # read_timeout_s of the runs

_EPOCH = textwrap.dedent(
    """
    import json, os, subprocess, sys, time
    import xxhash
    from shardio import RecoveryPolicy, ShardDataset, ShardLoader
    args = json.loads(sys.argv[1])
    truth = json.load(open(args["truth"]))
    policy = args["policy"] and RecoveryPolicy(policy=args["policy"], journal=args["journal"])
    ds = ShardDataset(args["root"], mode=args["mode"], seed=1, read_timeout_s=args["timeout"],
                      recovery=policy or None)
    loader = ShardLoader(ds, batch_size=8, num_workers=args["workers"])
    if args.get("state"):
        loader.load_state_dict(args["state"])
    began, keys, bad, error, batches = time.monotonic(), [], 0, None, 0
    out = {}
    try:
        for batch in loader:
            batches += 1
            names = list(batch["__key__"])
            for field, column in batch.items():
                if field in ("__key__", "cls"):
                    continue
                for key, value in zip(names, column):
                    bad += xxhash.xxh3_64_hexdigest(bytes(value)) != truth[key][field]
            keys += names
            if args.get("save"):
                with open(args["save"] + ".tmp", "w") as f:
                    json.dump({"state": loader.state_dict(), "keys": keys}, f)
                os.replace(args["save"] + ".tmp", args["save"])
            if batches == args.get("after", -1):
                for cmd in args["run"]:
                    subprocess.run(cmd, timeout=60, check=True, capture_output=True)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    counters = loader.metrics().counters
    epoch_s = time.monotonic() - began
    loader.close()  # bounded even with workers stuck in a dead server's reads
    out.update(keys=keys, bad=bad, error=error, epoch_s=epoch_s, counters=dict(counters),
               close_s=time.monotonic() - began - epoch_s)
    with open(args["out"] + ".tmp", "w") as f:
        json.dump(out, f)
    os.replace(args["out"] + ".tmp", args["out"])
    sys.stdout.flush()
    os._exit(0)  # not waiting for I/O threads a dead server still holds
    """
)


def _pack(bed: Bed, small_tree: pathlib.Path, name: str) -> pathlib.Path:
    """Pack the small tree into a directory of goal 2 (every chunk on both chunkservers)."""
    parent = bed.mount / name
    parent.mkdir()
    bed.admin("mfssetgoal", "2", str(parent))
    root = parent / "ds"
    proc = subprocess.run(
        [sys.executable, "-m", "shardio", "pack", str(small_tree), str(root),
         "--shard-size", "256KiB", "--no-progress"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    # MooseFS makes the second copies in the background after the write: a server stopped
    # before then would take the only copy of some files (the manifest, a shard), which the
    # tests count as safe (seen in CI: the dataset's open stalled; a "two-copy" shard lost).
    files = [p for p in root.rglob("*") if p.is_file()]
    wait_for(lambda: all(len(bed.copies(p)) == 2 for p in files), "two copies of every file")
    return root


def _one_copy(bed: Bed, root: pathlib.Path, shards: list[int]) -> dict[int, int]:
    """Leave one copy of each of ``shards``; return shard -> the chunkserver that holds it."""
    paths = {s: root / "shards" / f"shard-{s:06d}.tar" for s in shards}
    for path in paths.values():
        bed.admin("mfssetgoal", "1", str(path))
    wait_for(lambda: all(len(bed.copies(p)) == 1 for p in paths.values()), "one copy each")
    return {s: bed.copies(p)[0] for s, p in paths.items()}


def _truth(root: pathlib.Path, out: pathlib.Path) -> tuple[list[str], list[int]]:
    """Digests of every member (read before any fault); keys and shards by sample."""
    digests: dict[str, dict[str, str]] = {}
    with ShardReader(root) as ds:
        shards = [ds.shard_of(i) for i in range(len(ds))]
        keys = [ds.key(i) for i in range(len(ds))]
        for i in range(len(ds)):
            sample = ds.read_sample(i)
            digests[keys[i]] = {
                k: xxhash.xxh3_64_hexdigest(v) for k, v in sample.items() if isinstance(v, bytes)
            }
    out.write_text(json.dumps(digests))
    return keys, shards


def _truth_from_tree(
    tree: pathlib.Path, root: pathlib.Path, out: pathlib.Path
) -> tuple[list[str], list[int]]:
    """As :func:`_truth`, but the digests from the source tree: nothing is read through the
    mount (the MooseFS client caches what it read, which would hide a chunkserver stopped
    later)."""
    digests: dict[str, dict[str, str]] = {}
    for path in tree.rglob("*"):
        if path.is_file():
            key = str(path.relative_to(tree).with_suffix(""))
            ext = path.suffix.lower().lstrip(".")
            digests.setdefault(key, {})[ext] = xxhash.xxh3_64_hexdigest(path.read_bytes())
    out.write_text(json.dumps(digests))
    with ShardReader(root) as ds:
        return [ds.key(i) for i in range(len(ds))], [ds.shard_of(i) for i in range(len(ds))]


def _drop_caches() -> None:
    os.sync()
    pathlib.Path("/proc/sys/vm/drop_caches").write_text("3\n")
    forget_bed_holds()  # holds of an earlier run of the same path must not help this one


def _epoch(tmp_path: pathlib.Path, **args: Any) -> dict[str, Any]:
    out = tmp_path / f"epoch-{time.monotonic_ns()}.json"
    spec = {"timeout": _TIMEOUT_S, "policy": "skip", "workers": 2, "mode": "map",
            "journal": str(tmp_path / "repairs.jsonl"), "out": str(out), **args}  # fmt: skip
    spec = {k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in spec.items()}
    timeout = spec.pop("process_timeout", _EPOCH_TIMEOUT_S)
    wait_exit = spec.pop("wait_exit", True)
    if wait_exit:
        proc = subprocess.run(
            [sys.executable, "-c", _EPOCH, json.dumps(spec)],
            timeout=timeout, check=False, capture_output=True, text=True,
        )  # fmt: skip
        returncode, stderr = proc.returncode, proc.stderr
    else:
        # The result is what is tested, not the exit: a process that held a dead server's
        # file ends only when the FUSE client answers its closes (minutes with the client's
        # default retries); the bed's teardown ends the client, and with it that wait.
        err = tmp_path / f"epoch-{time.monotonic_ns()}.err"
        with open(err, "w") as stream:
            child = subprocess.Popen(
                [sys.executable, "-c", _EPOCH, json.dumps(spec)],
                stdout=subprocess.DEVNULL, stderr=stream,
            )  # fmt: skip
        end = time.monotonic() + timeout
        while not out.exists() and child.poll() is None and time.monotonic() < end:
            time.sleep(0.2)
        if child.poll() is None:
            child.kill()
            # Reaped once the bed's teardown ends the client the kill waits on.
            threading.Thread(target=child.wait, name="epoch-reaper", daemon=True).start()
        returncode, stderr = child.returncode, err.read_text(errors="replace")
    assert out.exists(), f"the epoch process wrote no result (exit {returncode}):\n{stderr[-4000:]}"
    result: dict[str, Any] = json.loads(out.read_text())
    c = result["counters"]
    print(
        f"\n[{spec['mode']} w{spec['workers']}] epoch {result['epoch_s']:.1f} s, samples "
        f"{len(result['keys'])}, stalls {c['stalls']} ({c['stall_ms'] / 1000:.1f} s lost), "
        f"held fails {c['held_fails']}, substitutes {c['substitutes']}, error {result['error']}"
    )
    return result


def _journal(tmp_path: pathlib.Path) -> list[dict[str, Any]]:
    path = tmp_path / "repairs.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _mount_pids(mount: pathlib.Path) -> list[str]:
    """The mfsmount process of ``mount`` (it renames itself "mfsmount (mounted on: MOUNT)")."""
    found = []
    for proc in pathlib.Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if cmd.startswith("mfsmount") and (
            f"mounted on: {mount})" in cmd or f"mfsmount {mount} " in cmd
        ):
            found.append(proc.name)
    return found


@pytest.fixture
def fault_bed(private_bed: Callable[..., Bed]) -> Bed:
    # ioretries 3: the client itself gives up on a dead chunk within seconds (ENXIO), so the
    # FUSE threads a dead chunk's requests hold are freed soon (with 30 retries they are held
    # for minutes and the whole mount stalls; see docs/guides/healing.md).
    return private_bed(chunkservers=2, ioretries=3, goal=1)


@pytest.mark.parametrize("mode", ["map", "stream"])
def test_a_stopped_chunkserver_costs_its_shards_not_the_epoch(
    fault_bed: Bed, small_tree: pathlib.Path, tmp_path: pathlib.Path, mode: str
) -> None:
    root = _pack(fault_bed, small_tree, "dead")
    keys, shards = _truth(root, tmp_path / "truth.json")
    where = _one_copy(fault_bed, root, [3, 9, 15, 21])
    dead_cs = max(set(where.values()), key=list(where.values()).count)
    dead = {s for s, cs in where.items() if cs == dead_cs}
    lost = {k for k, s in zip(keys, shards, strict=True) if s in dead}
    fault_bed.stop_chunkserver(dead_cs)
    _drop_caches()
    result = _epoch(tmp_path, root=root, truth=tmp_path / "truth.json", mode=mode)
    assert result["error"] is None
    assert result["bad"] == 0  # every delivered byte is the packed one
    assert len(result["keys"]) == len(keys)
    assert not lost & set(result["keys"])
    assert result["counters"]["substitutes"] == len(lost)
    skips = {e["key"] for e in _journal(tmp_path) if e["event"] == "skip"}
    assert skips == lost  # journaled
    assert result["epoch_s"] < _EPOCH_TIMEOUT_S


def test_with_two_copies_a_stopped_chunkserver_costs_no_sample(
    fault_bed: Bed, small_tree: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    root = _pack(fault_bed, small_tree, "goal2")
    keys, _ = _truth(root, tmp_path / "truth.json")
    shards = list((root / "shards").glob("*.tar"))
    wait_for(lambda: all(len(fault_bed.copies(p)) == 2 for p in shards), "two copies each")
    fault_bed.stop_chunkserver(1)
    _drop_caches()
    result = _epoch(tmp_path, root=root, truth=tmp_path / "truth.json")
    assert result["error"] is None and result["bad"] == 0
    assert sorted(result["keys"]) == sorted(keys)
    assert result["counters"]["substitutes"] == 0


def test_a_chunkserver_stopped_during_the_epoch(
    fault_bed: Bed, small_tree: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    root = _pack(fault_bed, small_tree, "during")
    keys, shards = _truth_from_tree(small_tree, root, tmp_path / "truth.json")
    where = _one_copy(fault_bed, root, list(range(10, 27, 2)))
    dead_cs = max(set(where.values()), key=list(where.values()).count)
    _drop_caches()
    stop = [str(SCRIPT), "stop-cs", str(fault_bed.root), str(dead_cs)]
    result = _epoch(
        tmp_path, root=root, truth=tmp_path / "truth.json", mode="stream", workers=0,
        after=1,
        run=[stop, ["sleep", "2"], ["sh", "-c", "sync; echo 3 > /proc/sys/vm/drop_caches"]],
    )  # fmt: skip
    assert result["error"] is None and result["bad"] == 0
    assert len(result["keys"]) == len(keys)
    dead = {s for s, cs in where.items() if cs == dead_cs}
    events = [e for e in _journal(tmp_path) if e["event"] == "skip"]
    skips = {e["key"] for e in events}
    if not skips:  # seen once in five runs: every later read was served from a cache
        pytest.xfail("the chunkserver stop was not felt by the rest of the epoch")
    assert result["counters"]["substitutes"] == len(events)
    lost_shards = {shards[keys.index(k)] for k in skips}
    assert lost_shards <= dead, f"shards lost that had a live copy: {sorted(lost_shards - dead)}"
    # A sample whose own read failed after the stop is delivered after it only where it was
    # drawn earlier as another's substitute, its bytes read then from a cache of the client
    # and checked (seen in CI: 37 substitutes, some drawn from a dead shard before it was
    # held). Every delivered byte is the packed one (bad == 0 above).
    drawn = collections.Counter(e["substitute_key"] for e in events)
    delivered = collections.Counter(result["keys"])
    leaked = sorted(k for k in skips if delivered[k] != drawn[k])
    assert not leaked, f"lost samples delivered other than as substitutes: {leaked[:5]}"


def test_flipped_chunk_bytes_on_a_chunkserver_disk(
    fault_bed: Bed, small_tree: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    root = _pack(fault_bed, small_tree, "flip")
    keys, _shards = _truth(root, tmp_path / "truth.json")
    cs = _one_copy(fault_bed, root, [4])[4]
    (found,) = [f for c, f in fault_bed.chunk_files(root / "shards" / "shard-000004.tar")]
    del cs
    with open(found, "r+b") as f:  # well past the chunk header (a few KiB), in a data block
        f.seek(8192 + 70_000)
        byte = f.read(1)
        f.seek(8192 + 70_000)
        f.write(bytes([byte[0] ^ 0xFF]))
    _drop_caches()
    result = _epoch(tmp_path, root=root, truth=tmp_path / "truth.json")
    assert result["error"] is None and result["bad"] == 0
    assert len(result["keys"]) == len(keys)
    events = _journal(tmp_path)
    print("flip events:", [(e["event"], e.get("error", "")[-80:]) for e in events][:3])
    # The client's CRC check (an error after retries) or shardio's xxh3 catches it; either
    # way only samples of that shard may be substituted.
    assert all(e["shard"] == "shards/shard-000004.tar" for e in events if e["event"] == "skip")


def test_the_master_restarted_mid_epoch(
    fault_bed: Bed, small_tree: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    root = _pack(fault_bed, small_tree, "master")
    keys, _ = _truth(root, tmp_path / "truth.json")
    _drop_caches()
    bed = str(fault_bed.root)
    restart = [
        [str(SCRIPT), "stop-master", bed],
        ["sleep", "3"],
        [str(SCRIPT), "start-master", bed],
    ]
    result = _epoch(
        tmp_path, root=root, truth=tmp_path / "truth.json", after=3, run=restart, workers=2
    )
    assert result["bad"] == 0
    assert result["error"] is None, result["error"]
    assert len(result["keys"]) == len(keys)


def test_the_mount_gone_is_a_typed_error_in_bounded_time(
    fault_bed: Bed, small_tree: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    root = _pack(fault_bed, small_tree, "gone")
    _truth(root, tmp_path / "truth.json")
    # Cold: the loader holds every shard open from before the kill, and FUSE serves what the
    # page cache holds even with its daemon gone (verified bytes all the same).
    _drop_caches()
    pids = _mount_pids(fault_bed.mount)
    assert pids
    kill = [["kill", "-9", *pids]]
    result = _epoch(
        tmp_path, root=root, truth=tmp_path / "truth.json", policy=None, after=2, run=kill
    )
    assert result["bad"] == 0
    assert result["error"] is not None
    assert result["error"].startswith(("StorageUnavailableError", "ReadStalledError"))
    assert "Transport endpoint is not connected" in result["error"] or "stalled" in result["error"]


def test_sigkill_during_a_stall_then_resume_exactly(
    fault_bed: Bed, small_tree: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    root = _pack(fault_bed, small_tree, "kill")
    keys, _ = _truth(root, tmp_path / "truth.json")
    truth = tmp_path / "truth.json"
    expected = _epoch(tmp_path, root=root, truth=truth, policy=None, workers=0)["keys"]
    where = _one_copy(fault_bed, root, list(range(27)))
    dead_cs = max(set(where.values()), key=list(where.values()).count)
    _drop_caches()
    save = tmp_path / "state.json"
    out = tmp_path / "killed.json"
    stop = [str(SCRIPT), "stop-cs", str(fault_bed.root), str(dead_cs)]
    # No deadline: after the chunkserver stops (at batch 3) the run blocks in a read.
    spec = {"root": str(root), "truth": str(truth), "mode": "map", "workers": 2,
            "timeout": 0, "policy": None, "journal": None, "out": str(out),
            "save": str(save), "after": 3, "run": [stop]}  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-c", _EPOCH, json.dumps(spec)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_for(
            lambda: save.exists() and len(json.loads(save.read_text())["keys"]) >= 24,
            "three batches",
            timeout_s=120,
        )
        time.sleep(4)  # stalled on a dead chunk by now (no deadline: it would wait minutes)
    finally:
        proc.send_signal(signal.SIGKILL)
    fault_bed.start_chunkserver(dead_cs)
    saved = json.loads(save.read_text())
    done = len(saved["keys"])
    assert saved["keys"] == expected[:done]
    rest = _epoch(tmp_path, root=root, truth=truth, policy=None, state=saved["state"], workers=2)
    assert rest["error"] is None and rest["bad"] == 0
    assert rest["keys"] == expected[done:]
    proc.wait(timeout=_EPOCH_TIMEOUT_S)
    assert len(keys) == len(expected)


_OPEN_INDEX = textwrap.dedent(
    """
    import os, sys, time
    from shardio import ShardDataset
    from shardio.read.reader import ShardReader
    began = time.monotonic()
    try:
        if len(sys.argv) > 2:
            ShardDataset(sys.argv[1], read_timeout_s=float(sys.argv[2]))
        else:
            with ShardReader(sys.argv[1]) as ds:
                ds.index.records(list(range(len(ds))))  # touch every page of the tables
        print("opened")
    except Exception as exc:
        print(f"{type(exc).__name__}: {exc}")
    print(f"after {time.monotonic() - began:.2f} s", flush=True)
    os._exit(0)  # not waiting for an abandoned read a dead server still holds
    """
)


def test_an_index_on_a_dead_chunkserver_is_an_error_at_open_not_sigbus(
    fault_bed: Bed, small_tree: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    root = _pack(fault_bed, small_tree, "deadindex")
    index = root / "index.bin"
    # What the open reads before the index (the manifest, ...) on both servers: the goal-2
    # copies are made in the background after the write.
    others = [p for p in root.iterdir() if p.is_file() and p != index]
    wait_for(lambda: all(len(fault_bed.copies(p)) == 2 for p in others), "two copies")
    fault_bed.admin("mfssetgoal", "1", str(index))
    wait_for(lambda: len(fault_bed.copies(index)) == 1, "one copy of the index")
    (holder,) = fault_bed.copies(index)
    fault_bed.stop_chunkserver(holder)
    _drop_caches()
    # A mapped index would fault its pages in from the dead server: SIGBUS, the process gone.
    proc = subprocess.run(
        [sys.executable, "-c", _OPEN_INDEX, str(root)],
        capture_output=True, text=True, timeout=_EPOCH_TIMEOUT_S, check=False,
    )  # fmt: skip
    print(proc.stdout)
    assert proc.returncode == 0, f"killed by signal {-proc.returncode}: {proc.stderr[-2000:]}"
    assert proc.stdout.startswith("StorageError: cannot read index"), proc.stdout + proc.stderr
    assert str(index) in proc.stdout
    # Under a read deadline shorter than the client's retries, the open is abandoned at the
    # deadline (the index is read outside the opener, under its deadline).
    _drop_caches()
    proc = subprocess.run(
        [sys.executable, "-c", _OPEN_INDEX, str(root), "0.2"],
        capture_output=True, text=True, timeout=_EPOCH_TIMEOUT_S, check=False,
    )  # fmt: skip
    print(proc.stdout)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith(
        f"ReadStalledError: opening the dataset {root} (its manifest and index) stalled for 0.2 s"
    ), proc.stdout + proc.stderr


@pytest.fixture
def default_retries_bed(private_bed: Callable[..., Bed]) -> Bed:
    # The client's own default: mfsioretries 30 (about 2 minutes per read of a dead chunk),
    # and libfuse's 10 threads, each held that long by a request to the dead chunkserver.
    return private_bed(chunkservers=2, ioretries=30, goal=1)


@pytest.mark.slow
def test_a_dead_chunkserver_with_default_client_retries_costs_deadlines_not_minutes(
    default_retries_bed: Bed, small_tree: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    bed = default_retries_bed
    parent = bed.mount / "default"
    parent.mkdir()
    bed.admin("mfssetgoal", "1", str(parent))  # each shard on one chunkserver, spread
    root = parent / "ds"
    proc = subprocess.run(
        [sys.executable, "-m", "shardio", "pack", str(small_tree), str(root),
         "--shard-size", "800KiB", "--no-progress"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    shard_files = sorted((root / "shards").glob("*.tar"))
    # The manifest, index and .idx files on both servers: only shards are lost.
    others = [p for p in root.rglob("*") if p.is_file() and p not in shard_files]
    for path in others:
        bed.admin("mfssetgoal", "2", str(path))
    wait_for(lambda: all(len(bed.copies(p)) == 2 for p in others), "two copies of the tables")
    where = {p: bed.copies(p)[0] for p in shard_files}
    dead_cs = max((1, 2), key=list(where.values()).count)
    # Half the shards lost, wherever MooseFS put them (it may put all on one server): those
    # of the server to stop beyond half get a second copy first.
    on_dead = [p for p in shard_files if where[p] == dead_cs]
    spared = on_dead[len(shard_files) // 2 :]
    for path in spared:
        bed.admin("mfssetgoal", "2", str(path))
    wait_for(lambda: all(len(bed.copies(p)) == 2 for p in spared), "two copies of the spared")
    dead = {f"shards/{p.name}" for p in on_dead if p not in spared}
    truth = tmp_path / "truth.json"
    keys, shards = _truth_from_tree(small_tree, root, truth)
    with ShardReader(root) as ds:
        names = [s.path for s in ds.manifest.shards]
    lost = {k for k, s in zip(keys, shards, strict=True) if names[s] in dead}
    bed.stop_chunkserver(dead_cs)
    _drop_caches()
    result = _epoch(
        tmp_path, root=root, truth=truth, mode="map", workers=2, process_timeout=400,
        wait_exit=False,
    )  # fmt: skip
    c = result["counters"]
    bound = 3 * _TIMEOUT_S * len(dead) + 30 + 10  # + the healthy epoch (about 1 s here)
    print(
        f"dead shards {len(dead)}/{len(shard_files)}, epoch {result['epoch_s']:.1f} s "
        f"(bound {bound} s), close {result['close_s']:.1f} s, restarts {c['worker_restarts']}"
    )
    assert result["error"] is None, result["error"]
    assert result["epoch_s"] < bound
    assert result["close_s"] < 10
    assert result["bad"] == 0  # every delivered byte is the packed one
    assert len(result["keys"]) == len(keys)
    events = [e for e in _journal(tmp_path) if e["event"] == "skip"]
    assert c["substitutes"] == len(events)
    assert lost <= {e["key"] for e in events}  # each lost sample substituted, journaled
    # No sample is delivered twice, nor a lost one at all, except as a counted substitute.
    drawn = collections.Counter(e["substitute_key"] for e in events)
    skipped = collections.Counter(e["key"] for e in events)
    delivered = collections.Counter(result["keys"])
    extra = {k: n for k, n in delivered.items() if n > drawn[k] + (skipped[k] == 0)}
    assert not extra, f"delivered more often than drawn: {sorted(extra)[:5]}"
