"""The bed itself: a file written through the mount lives in chunks on the chunkservers."""

from __future__ import annotations

import os


def test_a_file_on_the_bed_is_stored_in_chunks(pfs_bed, pfs_dir):
    data = os.urandom(3 << 20)
    (pfs_dir / "blob").write_bytes(data)
    assert (pfs_dir / "blob").read_bytes() == data
    chunks = pfs_bed.chunk_files(pfs_dir / "blob")
    assert chunks, "mfsfileinfo named no chunk copy on the chunkservers' disks"
    assert pfs_bed.stats()["master.packets_sent"] > 0
