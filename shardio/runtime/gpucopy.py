"""Copying batches to a GPU: the device chosen, a batch laid out in reused pinned host
arenas, and the batch rebuilt from views of its one device buffer.

What :class:`~shardio.runtime.prefetch.GPUPrefetcher` copies with (its module describes
the arenas' reuse, the streams and the memory held): :class:`HostStaging` lays every CPU
tensor and :class:`~shardio.runtime.batch.ByteColumn` of a batch out in one of its arenas
(64-byte aligned), :func:`fill_views` rebuilds the batch around the device copy of that
arena (a ByteColumn becomes a :class:`DeviceByteColumn`), :func:`await_copy` waits for a
copy to land.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import torch

from shardio.errors import UsageError
from shardio.order.ranks import detect_ranks
from shardio.runtime.batch import ByteColumn, MappedColumn

__all__ = [
    "Arena",
    "DeviceByteColumn",
    "HostStaging",
    "await_copy",
    "double_pinning",
    "fill_views",
    "resolve_device",
]

logger = logging.getLogger(__name__)

_ALIGN = 64  # bytes: any dtype's view of the arena starts aligned
_GROWTH = 1.25  # an arena grows to this times the batch that did not fit
_GRAIN = 64 * 1024  # arena sizes are multiples of this


class DeviceByteColumn:
    """One payload field of a batch on the device: a uint8 tensor plus host offsets.

    ``col.tensor(i)`` is sample i's bytes as a device tensor (a view); ``col[i]`` is the same,
    or None where the sample lacks this field.

    Attributes:
        data: uint8 tensor on the device holding the column, samples in order.
        offsets: int64 ndarray (host) of n + 1 offsets into ``data``; ``offsets[0] == 0``.
        present: bool ndarray (host), False where a sample lacks this field.
    """

    def __init__(
        self, data: torch.Tensor, offsets: np.ndarray[Any, Any], present: np.ndarray[Any, Any]
    ) -> None:
        self.data = data
        self.offsets = offsets
        self.present = present

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def tensor(self, i: int) -> torch.Tensor:
        """Sample i's bytes as a uint8 view of ``data`` (on the device)."""
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i %= len(self)
        return self.data[int(self.offsets[i]) : int(self.offsets[i + 1])]

    def __getitem__(self, i: int) -> torch.Tensor | None:
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        return self.tensor(i) if self.present[i % len(self)] else None

    def __iter__(self) -> Iterator[torch.Tensor | None]:
        return (self[i] for i in range(len(self)))

    def __repr__(self) -> str:
        return f"DeviceByteColumn(n={len(self)}, bytes={self.data.numel()}, {self.data.device})"


# -- host staging: a batch laid out in one reused arena ------------------------------------------
@dataclasses.dataclass(frozen=True)
class _TensorSlot:
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class _ColumnSlot:
    offset: int
    nbytes: int
    offsets: np.ndarray[Any, Any]
    present: np.ndarray[Any, Any]


@dataclasses.dataclass(frozen=True)
class _Node:
    """A container holding at least one slot: rebuilt around the device views."""

    kind: type[Any]
    keys: tuple[Any, ...] | None  # a mapping's keys, else None
    items: tuple[Any, ...]


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _plan(obj: Any, copies: list[tuple[int, Any]], cursor: int) -> tuple[Any, int]:
    """(template, new cursor): ``obj`` with its tensors and columns replaced by arena slots.

    ``copies`` gets (offset, source) for each slot. Unchanged parts are ``obj`` itself.
    """
    if isinstance(obj, torch.Tensor):
        if obj.device.type != "cpu" or obj.layout != torch.strided:
            return obj, cursor  # already elsewhere, or not a plain dense tensor: carried
        copies.append((cursor, obj))
        end = cursor + obj.numel() * obj.element_size()
        return _TensorSlot(cursor, obj.dtype, tuple(obj.shape)), _aligned(end)
    if isinstance(obj, ByteColumn):
        nbytes = _column_nbytes(obj)
        offsets = np.asarray(obj.offsets, dtype=np.int64)
        copies.append((cursor, obj))
        slot = _ColumnSlot(cursor, nbytes, offsets - offsets[0], np.asarray(obj.present))
        return slot, _aligned(cursor + nbytes)
    if isinstance(obj, Mapping):
        keys = tuple(obj)
        items, cursor, changed = _plan_items([obj[k] for k in keys], copies, cursor)
        return (_Node(type(obj), keys, items) if changed else obj), cursor
    if isinstance(obj, (list, tuple)):
        items, cursor, changed = _plan_items(obj, copies, cursor)
        return (_Node(type(obj), None, items) if changed else obj), cursor
    return obj, cursor


def _plan_items(
    values: Iterable[Any], copies: list[tuple[int, Any]], cursor: int
) -> tuple[tuple[Any, ...], int, bool]:
    items = []
    changed = False
    for value in values:
        item, cursor = _plan(value, copies, cursor)
        changed = changed or item is not value
        items.append(item)
    return tuple(items), cursor, changed


def _column_nbytes(col: ByteColumn) -> int:
    if isinstance(col, MappedColumn):
        return int(col.sizes.sum())
    return int(col.offsets[-1]) - int(col.offsets[0])


def _copy_into(arena: torch.Tensor, offset: int, source: Any) -> None:
    """Copy one tensor or column into ``arena`` at ``offset`` (the only copy it gets)."""
    if isinstance(source, torch.Tensor):
        nbytes = source.numel() * source.element_size()
        arena[offset : offset + nbytes].view(source.dtype).view(source.shape).copy_(source)
    elif isinstance(source, MappedColumn):
        dst = arena.numpy()
        for i in range(len(source)):
            view = source[i]
            if view is not None and len(view):
                dst[offset : offset + len(view)] = np.frombuffer(view, dtype=np.uint8)
                offset += len(view)
    else:
        first, last = int(source.offsets[0]), int(source.offsets[-1])
        arena[offset : offset + last - first].copy_(source.buffer[first:last])


def fill_views(template: Any, data: torch.Tensor) -> Any:
    """The batch ``template`` (from :meth:`HostStaging.stage`) describes, its slots made
    views of ``data`` (the device copy of the arena)."""
    if isinstance(template, _TensorSlot):
        nbytes = int(np.prod(template.shape, dtype=np.int64)) * template.dtype.itemsize
        view = data[template.offset : template.offset + nbytes]
        return view.view(template.dtype).view(template.shape)
    if isinstance(template, _ColumnSlot):
        view = data[template.offset : template.offset + template.nbytes]
        return DeviceByteColumn(view, template.offsets, template.present)
    if isinstance(template, _Node):
        items = [fill_views(item, data) for item in template.items]
        if template.keys is not None:
            pairs = dict(zip(template.keys, items, strict=True))
            try:
                return template.kind(pairs)
            except TypeError:  # a mapping type that cannot be built from a dict
                return pairs
        if hasattr(template.kind, "_fields"):  # a namedtuple
            return template.kind(*items)
        return template.kind(items)
    return template


@dataclasses.dataclass
class Arena:
    """A reused host buffer and the event after the last copy out of it."""

    buffer: torch.Tensor  # uint8, pinned on CUDA
    event: Any = None  # torch.cuda.Event recorded after the last copy out of it


class HostStaging:
    """``sets`` reused host arenas, taken in turn; a batch is laid out in one of them.

    Args:
        sets: arenas (depth + 1: the copy of one may be in flight while the others fill).
        pin: allocate pinned memory (needs CUDA).
    """

    def __init__(self, *, sets: int, pin: bool) -> None:
        self.pin = pin
        self.arenas = [Arena(torch.empty(0, dtype=torch.uint8)) for _ in range(sets)]
        self.allocations = 0
        self._turn = 0

    def stage(self, batch: Any) -> tuple[Any, Arena, int]:
        """(template, arena, bytes used): ``batch`` copied into the next arena."""
        copies: list[tuple[int, Any]] = []
        template, nbytes = _plan(batch, copies, 0)
        arena = self.arenas[self._turn]
        self._turn = (self._turn + 1) % len(self.arenas)
        if arena.event is not None:
            arena.event.synchronize()  # its last host-to-device copy has finished
            arena.event = None
        if arena.buffer.numel() < nbytes:
            size = -(-int(nbytes * _GROWTH) // _GRAIN) * _GRAIN
            arena.buffer = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
            self.allocations += 1
        for offset, source in copies:
            _copy_into(arena.buffer, offset, source)
        return template, arena, nbytes

    def stats(self) -> dict[str, int]:
        """``arenas``, ``allocations`` made and ``bytes`` held."""
        return {
            "arenas": len(self.arenas),
            "allocations": self.allocations,
            "bytes": sum(a.buffer.numel() for a in self.arenas),
        }


def resolve_device(device: str | torch.device) -> torch.device:
    """The device of ``device``: "auto" is this local rank's GPU (the CPU without CUDA);
    a CUDA device asked for by name must exist."""
    if device == "auto":
        if not torch.cuda.is_available():
            logger.info("GPUPrefetcher: no CUDA device; batches stay on the CPU")
            return torch.device("cpu")
        # bind.sh narrows CUDA_VISIBLE_DEVICES to the rank's GPU (then index 0); otherwise
        # the local ranks of a node take the GPUs in turn.
        return torch.device("cuda", detect_ranks().local_rank % torch.cuda.device_count())
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise UsageError(f"invalid device {device!r}: {exc}") from exc
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise UsageError(f"GPUPrefetcher copies to cuda or cpu, not {dev.type!r}")
    if not torch.cuda.is_available():
        raise UsageError(
            f"device {str(device)!r}: CUDA is not available to this process (no GPU, a CPU "
            "build of torch, or CUDA_VISIBLE_DEVICES empty); pass device='auto' to fall back "
            "to the CPU, or device='cpu'"
        )
    count = torch.cuda.device_count()
    if dev.index is not None and not 0 <= dev.index < count:
        raise UsageError(f"device {str(device)!r}: this process sees {count} CUDA device(s)")
    return dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device())


def await_copy(event: Any) -> int:
    """Wait on the host until ``event`` (recorded after a batch's copy) is reached; return
    the nanoseconds waited (0 when the copy had landed)."""
    if event.query():
        return 0
    began = time.perf_counter_ns()
    event.synchronize()
    return time.perf_counter_ns() - began


def double_pinning(loader: Any, device: torch.device) -> str | None:
    """Why the loader's batches would be pinned twice, or None."""
    if device.type != "cuda" or getattr(loader, "pin_memory", False) is not True:
        return None
    return (
        "GPUPrefetcher: the loader pins its batches (pin_memory=True) and the prefetcher "
        "copies them into pinned arenas again; pass pin_memory=False to the loader"
    )
