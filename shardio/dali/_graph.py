"""The DALI graphs: the verified external source or DALI's own tar reader, then decoding.

The only module of shardio that imports ``nvidia.dali`` at its top; it is imported by
:mod:`shardio.dali` when a pipeline is built.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from shardio.errors import MissingExtraError

try:
    from nvidia.dali import fn as _fn
    from nvidia.dali import math as _math
    from nvidia.dali import types as _types
    from nvidia.dali.pipeline import Pipeline as _Pipeline
except ImportError as exc:  # absent, or a broken install (a CUDA library missing)
    raise MissingExtraError(
        "shardio.dali needs NVIDIA DALI", "dali", None if exc.name == "nvidia.dali" else str(exc)
    ) from exc

# DALI's stubs cover only part of its API (types.INT64, fn.constant, Pipeline.build are not
# typed): used untyped here, checked by the tests.
fn: Any = _fn
dmath: Any = _math
types: Any = _types
Pipeline: Any = _Pipeline

__all__ = ["READER_NAME", "build_external", "build_reader"]

READER_NAME = "reader"
# Decimal digits a cls member may hold (an int64 class index has at most 19).
_MAX_LABEL_DIGITS = 19


def _pipeline(
    *, batch_size: int, num_threads: int, device_id: int | None, depth: int, seed: int
) -> Any:
    return Pipeline(
        batch_size=batch_size,
        num_threads=num_threads,
        device_id=device_id,
        prefetch_queue_depth=depth,
        seed=seed,
    )


def _decode(data: Any, *, decode: str | None, crop: int | None, seed: int) -> Any:
    """Decoded (and randomly resized-cropped) RGB images, or the bytes as they are."""
    if decode is None:
        return data
    images = fn.decoders.image(data, device=decode, output_type=types.RGB)
    if crop is not None:
        # ResNet-style: a random area and aspect ratio, resized to crop x crop.
        images = fn.random_resized_crop(images, size=[crop, crop], seed=seed)
    return images


def ascii_to_int(cls: Any) -> Any:
    """A cls member's ASCII decimal digits as one int64 per sample, inside the graph."""
    digits = fn.pad(fn.cast(cls, dtype=types.INT64) - 48, fill_value=0, shape=[_MAX_LABEL_DIGITS])
    count = fn.cast(cls.shape(), dtype=types.INT64)  # shape (1,): the digits of this sample
    place = count - 1 - types.Constant(np.arange(_MAX_LABEL_DIGITS, dtype=np.int64))
    weight = dmath.pow(types.Constant(np.int64(10)), dmath.max(place, 0)) * (place >= 0)
    return fn.reductions.sum(digits * weight, axes=[0])


def build_external(
    source: Callable[[Any], Any],
    *,
    batch_size: int,
    num_threads: int,
    device_id: int | None,
    depth: int,
    seed: int,
    decode: str | None,
    crop: int | None,
) -> Any:
    """A built pipeline fed by ``source`` (batch mode, with ``BatchInfo``) in this thread."""
    pipe = _pipeline(
        batch_size=batch_size, num_threads=num_threads, device_id=device_id, depth=depth, seed=seed
    )
    with pipe:
        data, label = fn.external_source(
            source=source,
            num_outputs=2,
            batch=True,
            batch_info=True,
            parallel=False,
            dtype=[types.UINT8, types.INT64],
        )
        pipe.set_outputs(_decode(data, decode=decode, crop=crop, seed=seed), label)
    pipe.build()
    return pipe


def build_reader(
    paths: Sequence[str],
    index_paths: Sequence[str],
    *,
    exts: Sequence[str],
    labelled: bool,
    batch_size: int,
    num_threads: int,
    device_id: int | None,
    depth: int,
    seed: int,
    shard_id: int,
    num_shards: int,
    shuffle: bool,
    decode: str | None,
    crop: int | None,
) -> Any:
    """A built pipeline on DALI's ``fn.readers.webdataset``: DALI reads the bytes itself.

    Nothing here checks them against shardio's xxh3-64. Files are read, not mapped
    (``dont_use_mmap``): a fault of the filesystem is then a DALI error, not SIGBUS. The
    last batch of a rank's shard is padded (``pad_last_batch``) by repeating its last sample.
    """
    pipe = _pipeline(
        batch_size=batch_size, num_threads=num_threads, device_id=device_id, depth=depth, seed=seed
    )
    with pipe:
        outputs = fn.readers.webdataset(
            paths=list(paths),
            index_paths=list(index_paths),
            ext=[";".join(exts), "cls"] if labelled else [";".join(exts)],
            missing_component_behavior="error",
            num_shards=num_shards,
            shard_id=shard_id,
            pad_last_batch=True,
            random_shuffle=shuffle,
            seed=seed,
            dont_use_mmap=True,
            name=READER_NAME,
        )
        if labelled:
            data, cls = outputs
            label = ascii_to_int(cls)
        else:
            data = outputs[0] if isinstance(outputs, list | tuple) else outputs
            label = fn.constant(idata=-1, shape=[], dtype=types.INT64)
        pipe.set_outputs(_decode(data, decode=decode, crop=crop, seed=seed), label)
    pipe.build()
    return pipe
