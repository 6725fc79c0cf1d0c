"""A long $TMPDIR (a job's private directory) must not lose batches: DataLoader workers send
tensors through Unix sockets named in multiprocessing's temporary directory, and a name
longer than a socket address holds failed in the worker's feeder thread while the training
process waited for the batch forever (found under pytest-xdist, whose TMPDIRs are long)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

SCRIPT = """
import sys, tempfile
from shardio import ShardDataset
# "shm": a fresh segment per batch, sent as torch sends tensors (a descriptor through a
# socket), as the ring does when its slots are all held
ds = ShardDataset(sys.argv[1], seed=0, transport="shm")
loader = ds.loader(batch_size=16, num_workers=2, multiprocessing_context=sys.argv[2])
seen = sum(len(batch["__key__"]) for batch in loader)
print(seen, len(ds), len(tempfile.gettempdir()))
"""


@pytest.fixture
def long_tmpdir(tmp_path: pathlib.Path) -> pathlib.Path:
    path = tmp_path / ("d" * 60) / ("e" * 60)
    path.mkdir(parents=True)
    assert len(os.fsencode(path)) > 120
    return path


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_workers_deliver_every_batch_under_a_long_tmpdir(
    packed_small, long_tmpdir: pathlib.Path, context: str
) -> None:
    dataset, _ = packed_small()
    env = dict(os.environ, TMPDIR=str(long_tmpdir))
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(dataset), context],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    seen, samples, tmpdir_length = map(int, proc.stdout.split())
    assert tmpdir_length > 120  # the user's TMPDIR itself is left as it was
    assert seen == samples == 300
    assert "AF_UNIX path too long" not in proc.stderr
    # multiprocessing's short directory is removed at exit; the long one holds nothing.
    assert list(long_tmpdir.iterdir()) == []


def test_a_short_tmpdir_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    from shardio.runtime import mptemp

    monkeypatch.setattr(mptemp.tempfile, "gettempdir", lambda: "/tmp")
    import multiprocessing.process

    config = multiprocessing.process.current_process()._config  # type: ignore[attr-defined]
    before = config.get("tempdir")
    assert mptemp.ensure_short() is None
    assert config.get("tempdir") == before
