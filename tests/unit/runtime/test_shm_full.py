"""A full /dev/shm (a container's 64 MiB default) ends the epoch with one StorageError that
names /dev/shm, its size and free space and what to do: never a worker traceback, never a
training loop left waiting for a batch torch failed to send.

The loop runs in a child in a private mount namespace (``unshare -m``) whose /dev/shm is a
1 MiB tmpfs, so that torch's own shm_open really finds no room and the machine's /dev/shm
is never filled. Skipped where no mount namespace can be made.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import shutil
import subprocess
import sys
from collections.abc import Callable

import pytest

from shardio.packing.run import PackOptions, pack

TIMEOUT_S = 60
SHM_SIZE = "1m"


def _namespace_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = f"mount -t tmpfs -o size={SHM_SIZE} tmpfs /dev/shm && df /dev/shm"
    try:
        done = subprocess.run(
            ["unshare", "-m", "sh", "-c", probe], capture_output=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or not _namespace_works(),
    reason="needs a private mount namespace with a tmpfs on /dev/shm (unshare -m, root)",
)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """600 random files of 3-7 KB: a batch of 64 is about 320 KiB, a third of the tmpfs."""
    base = tmp_path_factory.mktemp("shm-full")
    rng = random.Random(5)
    for i in range(600):
        file = base / "tree" / f"c{i % 4}" / f"f{i:04d}.bin"
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_bytes(rng.randbytes(rng.randrange(3000, 7000)))
    pack(
        os.fspath(base / "tree"),
        os.fspath(base / "ds"),
        PackOptions(shard_size_bytes=64 * 1024, durable=False),
    )
    return base / "ds"


@pytest.mark.parametrize(
    ("transport", "decode"),
    [("ring", "none"), ("shm", "none"), ("ring", "tensor")],
    ids=["ring", "shm", "decoded-tensors"],
)
def test_full_dev_shm_is_one_storage_error(
    dataset: pathlib.Path,
    scripts_dir: pathlib.Path,
    child_env: Callable[..., dict[str, str]],
    transport: str,
    decode: str,
) -> None:
    script = scripts_dir / "shm_full.py"
    command = (
        f"mount -t tmpfs -o size={SHM_SIZE} tmpfs /dev/shm && "
        f"exec {sys.executable} {script} {dataset} {transport} {decode}"
    )
    try:
        done = subprocess.run(
            ["unshare", "-m", "sh", "-c", command],
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            env=child_env(),
            check=False,
        )
    except subprocess.TimeoutExpired as exc:  # torch dropped a batch it could not send
        pytest.fail(f"the epoch never ended on a full /dev/shm: {str(exc.stderr)[-2000:]}")
    assert done.returncode == 0, done.stderr
    outcome = json.loads(done.stdout.strip().splitlines()[-1])
    assert outcome.get("type") == "StorageError", outcome
    assert outcome["module"] == "shardio.errors"
    message = outcome["message"]
    assert "\n" not in message
    assert message.startswith("shared memory is full: /dev/shm (1.0 MiB, ")
    assert " free) has no room for " in message
    assert "--shm-size" in message
    assert "fewer workers" in message
    assert "transport='mmap'" in message
    # No worker traceback, no traceback of torch's queue feeder thread, on the way.
    assert "Traceback" not in done.stderr, done.stderr
