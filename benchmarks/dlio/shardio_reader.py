"""DLIO reader plug-ins: a shardio dataset read through ShardDataset, and a reader without I/O.

DLIO 2.0.0 loads a custom reader named by ``++workload.reader.reader_classname=MODULE.CLASS``
(a subclass of its ``FormatReader``) instead of its reader of the format; its PyTorch data
loader makes one reader per DataLoader worker (``read_threads``) in the worker, and asks it
for a global sample index, which DLIO's own maps turn into (file name, sample in the file).

- :class:`ShardioReader` reads that file's bytes from the shardio dataset packed from DLIO's
  data tree (``shardio pack DATA/train DIR/train --labels none``; DIR in the
  ``SHARDIO_DLIO_DATASET`` environment variable), every byte verified (xxh3-64, the default),
  its key checked, and parses them as DLIO's own reader of the format parses the file (a
  JPEG decoded by PIL, an npz's array loaded): the same work as DLIO's reader but the I/O.
- :class:`NullReader` does no I/O at all and hands DLIO its preallocated sample, as every
  DLIO reader finally does: what DLIO itself costs per sample here.

benchmarks/dlio/run.py puts this directory on DLIO's PYTHONPATH.
"""

from __future__ import annotations

import os
from typing import Any

from dlio_benchmark.common.constants import MODULE_DATA_READER
from dlio_benchmark.reader.reader_handler import FormatReader
from dlio_benchmark.utils.utility import Profile
from dlio_parts import DATASET_ENV, member_bytes, parse_file, sample_key, take_sample

from shardio import ShardDataset
from shardio.order import RankInfo

dlp = Profile(MODULE_DATA_READER)


class _IndexBased(FormatReader):
    """DLIO's index-based reader protocol, the parts both readers here share."""

    def next(self) -> Any:
        yield from super().next()

    def read_index(self, image_idx: int, step: int) -> Any:
        return super().read_index(image_idx, step)

    def finalize(self) -> Any:
        return super().finalize()

    def is_index_based(self) -> bool:
        return True

    def is_iterator_based(self) -> bool:
        return True


class ShardioReader(_IndexBased):
    """DLIO's files, read from a shardio dataset through ``ShardDataset`` (verified)."""

    @dlp.log_init
    def __init__(self, dataset_type: Any, thread_index: int, epoch: int) -> None:
        super().__init__(dataset_type, thread_index)
        root = os.environ.get(DATASET_ENV, "")
        if not root:
            raise RuntimeError(f"{DATASET_ENV} is not set: the directory of the shardio splits")
        split = str(dataset_type)  # DLIO's DatasetType prints as "train" / "valid"
        self._fmt = self._args.format.value
        self._split_dir = os.path.join(self._args.data_folder, split)
        # DLIO numbers samples globally and splits them among its ranks itself: the whole
        # dataset in dataset order, whatever the rank environment says.
        self._ds = ShardDataset(os.path.join(root, split), shuffle=False, ranks=RankInfo())
        packed = self._ds.packed
        self._index = {packed.key(i): i for i in range(len(self._ds))}

    @dlp.log
    def open(self, filename: str) -> Any:
        super().open(filename)
        key = sample_key(self._split_dir, filename)
        try:
            sample = self._ds[self._index[key]]
        except KeyError:
            raise RuntimeError(f"{filename}: no sample {key!r} in the shardio dataset") from None
        return parse_file(self._fmt, member_bytes(sample, key))

    @dlp.log
    def close(self, filename: str) -> None:
        parsed = self.open_file_map.get(filename)
        if self._fmt == "hdf5" and parsed is not None:
            parsed.close()
        super().close(filename)

    @dlp.log
    def get_sample(self, filename: str, sample_index: int) -> None:
        super().get_sample(filename, sample_index)
        image = take_sample(self._fmt, self.open_file_map[filename], sample_index)
        dlp.update(image_size=image.nbytes)

    @dlp.log
    def read_index(self, image_idx: int, step: int) -> Any:
        dlp.update(step=step)
        return super().read_index(image_idx, step)

    @dlp.log
    def finalize(self) -> Any:
        return super().finalize()


class NullReader(_IndexBased):
    """No I/O: each sample is DLIO's preallocated one (DLIO's own cost per sample)."""

    @dlp.log_init
    def __init__(self, dataset_type: Any, thread_index: int, epoch: int) -> None:
        super().__init__(dataset_type, thread_index)

    def open(self, filename: str) -> Any:
        return None

    def close(self, filename: str) -> None:
        pass

    def get_sample(self, filename: str, sample_index: int) -> None:
        pass
