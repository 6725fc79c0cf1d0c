"""One sample read on its own (``ds[i]``): what a batch of one holds, without array work.

:func:`~shardio.runtime.batch.read_batch` lays a batch out with a few dozen numpy calls,
which a batch of 64 shares but a single sample pays alone (about 80 us of the 106 us a
``ds[i]`` took on 110 KB samples). :func:`read_one` reads the same members, checked the same
way (:meth:`~shardio.read.reader.ShardReader.read_members_into`), into the same dict.
"""

from __future__ import annotations

from typing import Any

from shardio.format.spec import LABEL_EXT
from shardio.read.deadline import into_fresh_buffers
from shardio.read.reader import ShardReader

__all__ = ["read_one"]


def read_one(ds: ShardReader, sample: int, *, verify: bool = True) -> dict[str, Any]:
    """Sample ``sample`` as a dict: ``__key__``, ``cls`` as an int (labelled datasets),
    bytes per extension (fields by name), as a batch of one from ``read_batch`` gives it.

    Raises:
        ChecksumMismatchError: a member's bytes differ from the index.
        StorageError: a shard is missing or short.
    """
    index = ds.index
    rec = index.records([sample])[0]  # its shard's records checked first
    shard, first = int(rec["shard"]), int(rec["first_member"])
    exts = index.exts
    labelled = ds.manifest.classes is not None
    label_id = exts.index(LABEL_EXT) if labelled and LABEL_EXT in exts else -1
    members = index.members[first : first + int(rec["n_members"])]
    wanted: list[tuple[str, int, int]] = []  # (extension, member row, size)
    for row, (ext_id, path_length, size) in enumerate(
        zip(
            members["ext_id"].tolist(),
            members["path_length"].tolist(),
            members["size"].tolist(),
            strict=True,
        )
    ):
        if ext_id == label_id and path_length == 0:
            continue  # the label shardio synthesised: in the index already
        wanted.append((exts[ext_id], first + row, size))
    wanted.sort(key=lambda item: item[0])

    def read() -> list[bytearray]:  # fresh buffers each time (into_fresh_buffers)
        buffers = [bytearray(size) for _, _, size in wanted]
        ds.read_members_into(
            [row for _, row, _ in wanted],
            [shard] * len(wanted),
            [sample] * len(wanted),
            [memoryview(buf) for buf in buffers],
            verify=verify,
        )
        return buffers

    buffers = into_fresh_buffers(read)
    ds.metrics.add("samples", 1)
    out: dict[str, Any] = {"__key__": index.keys([sample])[0]}
    if labelled:
        out[LABEL_EXT] = int(rec["label"])
    for (ext, _, _), buf in zip(wanted, buffers, strict=True):
        out[ext] = bytes(buf)
    return out
