"""multiprocessing's temporary directory, kept short enough for its Unix sockets.

A DataLoader worker hands a batch's tensors to the training process through a Unix socket
(torch's ``file_descriptor`` sharing: multiprocessing's resource sharer) named in
multiprocessing's temporary directory, under ``$TMPDIR``. A long ``$TMPDIR`` (a job's private
directory on a cluster) makes that name longer than a socket address holds (108 bytes): the
bind fails in the worker's feeder thread, the batch is lost, and the training process waits
for it. Python 3.13 falls back to a short directory by itself; :func:`ensure_short` does the
same before workers start (forked ones inherit it) and in a worker started by pickling.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

_SUN_PATH_MAX = 107  # the bytes of sockaddr_un.sun_path, less its NUL
# What multiprocessing adds: "/pymp-XXXXXXXX" for its directory, "/listener-XXXXXXXX" (and a
# few bytes of margin) for a socket in it.
_DIR_NAME = len("/pymp-xxxxxxxx")
_SOCKET_NAME = len("/listener-xxxxxxxx") + 4
_SHORT_BASES = ("/tmp", "/var/tmp", "/dev/shm")


def ensure_short() -> str | None:
    """Point multiprocessing's temporary directory at a short base when ``$TMPDIR`` is too
    long for a socket's name in it; return the new directory (removed at exit), or None when
    nothing needed changing or no short base is writable."""
    if sys.version_info >= (3, 13):
        return None  # multiprocessing.util.get_temp_dir does it
    import multiprocessing.util

    from shardio.runtime.internals import mp_config

    config = mp_config()
    current = config.get("tempdir")
    if current is not None:
        if len(os.fsencode(current)) + _SOCKET_NAME <= _SUN_PATH_MAX:
            return None
    elif len(os.fsencode(tempfile.gettempdir())) + _DIR_NAME + _SOCKET_NAME <= _SUN_PATH_MAX:
        return None
    for base in _SHORT_BASES:
        if os.path.isdir(base) and os.access(base, os.W_OK | os.X_OK):
            try:
                short = tempfile.mkdtemp(prefix="pymp-", dir=base)
            except OSError:
                continue
            break
    else:
        return None
    multiprocessing.util.Finalize(
        None, shutil.rmtree, args=(short,), kwargs={"ignore_errors": True}, exitpriority=-100
    )
    config["tempdir"] = short
    return short
