"""shardio: pack small files into checksummed shards and feed them fast to PyTorch and DALI.

Public API (torch-side names load lazily, so packing never imports torch)::

    from shardio import pack, PackOptions, verify_dataset, repair_dataset, PackedDataset
    from shardio import ShardDataset, ResilientDataset   # import torch on first use
    from shardio import OrderSpec, EpochStager           # the order spec; stage epochs ahead
"""

from __future__ import annotations

from typing import Any

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
    "OrderSpec",
    "PackError",
    "PackOptions",
    "PackResult",
    "PackedDataset",
    "RankInfo",
    "ReadStalledError",
    "RecoveryPolicy",
    "ResilientDataset",
    "SampleDecodeError",
    "SampleUnavailableError",
    "ShardDataset",
    "ShardLoader",
    "ShardioError",
    "SourceError",
    "StorageError",
    "StorageUnavailableError",
    "UsageError",
    "VerifyReport",
    "__version__",
    "merge_parts",
    "pack",
    "repair_dataset",
    "unpack_dataset",
    "verify_dataset",
]

# Names whose module imports torch: without it, one line naming the extra.
_NEEDS_TORCH = frozenset({"ShardDataset", "ShardLoader", "GPUPrefetcher", "ResilientDataset"})

_LAZY = {
    "PackOptions": "shardio.packing.run",
    "PackResult": "shardio.packing.run",
    "pack": "shardio.packing.run",
    "merge_parts": "shardio.packing.merge",
    "PackedDataset": "shardio.read.packed",
    "ShardDataset": "shardio.runtime.dataset",
    "ShardLoader": "shardio.runtime.loader",
    "RankInfo": "shardio.order.ranks",
    "GPUPrefetcher": "shardio.runtime.prefetch",
    "RecoveryPolicy": "shardio.read.recovery",
    "ResilientDataset": "shardio.runtime.resilient",
    "VerifyReport": "shardio.verify",
    "verify_dataset": "shardio.verify",
    "unpack_dataset": "shardio.unpack",
    "repair_dataset": "shardio.repair",
    "OrderSpec": "shardio.order.spec",
    "EpochStager": "shardio.cache.ahead",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'shardio' has no attribute {name!r}")
    import importlib

    try:
        imported = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if name in _NEEDS_TORCH and exc.name is not None and exc.name.split(".")[0] == "torch":
            raise MissingExtraError(f"shardio.{name} needs PyTorch", "torch") from exc
        raise
    value = getattr(imported, name)
    globals()[name] = value
    return value
