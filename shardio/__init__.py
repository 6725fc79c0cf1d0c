"""shardio: pack small files into checksummed shards and feed them fast to PyTorch and DALI.

Public API (torch-side names load lazily, so packing never imports torch)::

    from shardio import pack, PackOptions, verify_dataset, repair_dataset, ShardReader
    from shardio import ShardWriter                      # write shards from code
    from shardio import inspect_dataset                  # what `shardio inspect` shows
    from shardio import ShardDataset, RecoveryPolicy     # import torch on first use
    from shardio import OrderSpec, EpochStager           # the order spec; stage epochs ahead
"""

from __future__ import annotations

from shardio._lazy import lazy_face
from shardio._version import __version__
from shardio.errors import (
    ChecksumMismatchError,
    CommandNotFoundError,
    FormatError,
    IntegrityError,
    MissingExtraError,
    PackError,
    ReadStalledError,
    SampleDecodeError,
    SampleUnavailableError,
    ShardioError,
    SourceError,
    StorageError,
    StorageUnavailableError,
    UsageError,
)

__all__ = [
    "ChecksumMismatchError",
    "CommandNotFoundError",
    "EpochStager",
    "FormatError",
    "GPUPrefetcher",
    "IntegrityError",
    "MissingExtraError",
    "MixedDataset",
    "OrderSpec",
    "PackError",
    "PackOptions",
    "PackResult",
    "RankInfo",
    "ReadStalledError",
    "RecoveryPolicy",
    "SampleDecodeError",
    "SampleUnavailableError",
    "ShardDataset",
    "ShardLoader",
    "ShardReader",
    "ShardWriter",
    "ShardioError",
    "SourceError",
    "StorageError",
    "StorageUnavailableError",
    "UsageError",
    "VerifyReport",
    "WriteResult",
    "__version__",
    "add_parity",
    "drop_parity",
    "inspect_dataset",
    "merge_parts",
    "pack",
    "repair_dataset",
    "unpack_dataset",
    "verify_dataset",
]

# Names whose module imports torch: without it, one line naming the extra.
_NEEDS_TORCH = frozenset(
    {"ShardDataset", "ShardLoader", "GPUPrefetcher", "ResilientDataset", "MixedDataset"}
)

_LAZY = {
    "PackOptions": "shardio.packing.run",
    "PackResult": "shardio.packing.run",
    "pack": "shardio.packing.run",
    "merge_parts": "shardio.packing.merge",
    "ShardWriter": "shardio.packing.writer",
    "WriteResult": "shardio.packing.writer",
    "ShardReader": "shardio.read.reader",
    "ShardDataset": "shardio.runtime.dataset",
    "ShardLoader": "shardio.runtime.loader",
    "RankInfo": "shardio.order.ranks",
    "GPUPrefetcher": "shardio.runtime.prefetch",
    "RecoveryPolicy": "shardio.read.recovery",
    "ResilientDataset": "shardio.runtime.resilient",
    "MixedDataset": "shardio.runtime.mixed",
    "VerifyReport": "shardio.tools.verify_report",
    "verify_dataset": "shardio.tools.verify",
    "unpack_dataset": "shardio.tools.unpack",
    "repair_dataset": "shardio.tools.repair",
    "inspect_dataset": "shardio.tools.inspect",
    "add_parity": "shardio.tools.parity",
    "drop_parity": "shardio.tools.parity",
    "OrderSpec": "shardio.order.spec",
    "EpochStager": "shardio.staging.ahead",
}


def _missing(name: str, exc: ModuleNotFoundError) -> BaseException | None:
    if name in _NEEDS_TORCH and exc.name is not None and exc.name.split(".")[0] == "torch":
        return MissingExtraError(f"shardio.{name} needs PyTorch", "torch")
    return None


# Renamed in 0.2; each old name warns (DeprecationWarning) and goes in 0.3 (CHANGELOG.md).
_RENAMED = {"PackedDataset": "ShardReader"}

__getattr__, __dir__ = lazy_face(__name__, _LAZY, on_missing=_missing, renamed=_RENAMED)
