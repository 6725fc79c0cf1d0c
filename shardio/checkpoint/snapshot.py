"""A copy of the training state in host memory: what an asynchronous save writes from.

The training step pays for this copy and nothing else: tensors are copied to the CPU (into
pinned memory, with non-blocking copies and one synchronisation, when they live on a CUDA
device), everything else is deep-copied, so training can go on changing its tensors in place
while the copy is compressed and written. A tensor found twice (tied weights) is copied once
and stays one tensor in the copy.
"""

from __future__ import annotations

import copy
import typing
from collections.abc import Iterator
from typing import Any

__all__ = ["copied_tensors", "estimate_ratio", "snapshot_bytes", "to_host"]


def to_host(state: Any, buffers: list[Any] | None = None) -> Any:
    """A deep copy of ``state`` whose tensors are CPU tensors owned by the copy.

    Args:
        state: the state.
        buffers: the tensors of an earlier copy no longer in use (in the order this
            function made them, see :func:`copied_tensors`): a tensor of the same shape and
            dtype is copied into its buffer, not into new memory (whose first touch of every
            page costs as much as the copy).
    """
    import torch

    memo: dict[int, Any] = {}
    cuda_copied = False
    spare = list(buffers or [])
    pin = torch.cuda.is_available()

    def copy_tensor(t: torch.Tensor) -> torch.Tensor:
        nonlocal cuda_copied
        key = id(t)
        if key in memo:
            return typing.cast("torch.Tensor", memo[key])
        src = t.detach()
        n = len(memo)
        if src.layout != torch.strided:  # sparse: its indices and values, copied anew
            memo[key] = src.to("cpu", copy=True)
            return typing.cast("torch.Tensor", memo[key])
        old = spare[n] if n < len(spare) else None
        if (
            old is not None
            and old.layout == torch.strided
            and old.shape == src.shape
            and old.dtype == src.dtype
            and old.is_contiguous()
            and (src.device.type == "cpu" or old.is_pinned() == pin)
        ):
            out = old
        elif src.device.type == "cpu":
            out = torch.empty_like(src, memory_format=torch.contiguous_format)
        else:
            out = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=pin)
        out.copy_(src, non_blocking=src.device.type == "cuda")
        cuda_copied = cuda_copied or src.device.type == "cuda"
        memo[key] = out
        return typing.cast("torch.Tensor", out)

    def walk(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return copy_tensor(value)
        if type(value) is dict:
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, dict):
            return _rebuild_mapping(value, walk)
        if isinstance(value, list):
            return [walk(v) for v in value]
        if isinstance(value, tuple):
            items = [walk(v) for v in value]
            return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
        return copy.deepcopy(value)

    out = walk(state)
    if cuda_copied:
        torch.cuda.synchronize()
    return out


def _tensors(state: Any) -> Iterator[Any]:
    """The tensors in ``state`` (in dicts, lists and tuples), in the order :func:`to_host`
    meets them, each as often as it is found (in each container once)."""
    import torch

    stack = [state]
    seen: set[int] = set()  # each container once: a state that contains itself ends
    while stack:
        value = stack.pop()
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (dict, list, tuple)):
            if id(value) in seen:
                continue
            seen.add(id(value))
            items = value.values() if isinstance(value, dict) else value
            stack.extend(reversed(list(items)))


def copied_tensors(copy_of_state: Any) -> list[Any]:
    """The tensors of a copy :func:`to_host` made, in the order it made them (each once):
    the ``buffers`` of the next copy."""
    seen: dict[int, Any] = {}
    for t in _tensors(copy_of_state):
        seen.setdefault(id(t), t)
    return list(seen.values())


def _rebuild_mapping(value: dict[Any, Any], walk: Any) -> Any:
    """An OrderedDict or other dict subclass, rebuilt with its items copied."""
    rebuilt = copy.copy(value)
    for key in list(rebuilt.keys()):
        rebuilt[key] = walk(value[key])
    return rebuilt


def snapshot_bytes(state: Any) -> int:
    """The bytes of the tensors in ``state`` (each storage once): the size to plan for."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for t in _tensors(state):
        for part in _dense_parts(t):
            storage = part.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
    return total


def _dense_parts(t: Any) -> list[Any]:
    """The strided tensors that hold ``t``'s bytes: itself, or a sparse tensor's indices
    and values."""
    import torch

    layout = t.layout
    if layout == torch.strided:
        return [t]
    if layout == torch.sparse_coo:
        whole = t if t.is_coalesced() else t.coalesce()  # an estimate: the coalesced size
        return [whole.indices(), whole.values()]
    if layout in (torch.sparse_csr, torch.sparse_bsr):
        return [t.crow_indices(), t.col_indices(), t.values()]
    if layout in (torch.sparse_csc, torch.sparse_bsc):
        return [t.ccol_indices(), t.row_indices(), t.values()]
    return []  # refused before it is saved (see loadable)


_SAMPLE_BYTES = 256 << 10  # from each tensor sampled
_SAMPLED_TENSORS = 32


def estimate_ratio(state: Any, *, level: int) -> float:
    """How much Zstandard at ``level`` would shrink the tensors of ``state``, from samples:
    up to 256 KiB from the middle of each of the largest tensors of every dtype (32 in all),
    each dtype's ratio applied to all of that dtype's bytes (fp32 and bf16 weights compress
    very differently; the plain values of a real state are too small to matter)."""
    import torch

    from shardio.checkpoint.codec import load_zstandard

    by_dtype: dict[Any, list[tuple[int, Any]]] = {}
    parts = (p for t in _tensors(state) for p in _dense_parts(t))
    for t in {id(t): t for t in parts}.values():
        by_dtype.setdefault(t.dtype, []).append((t.numel() * t.element_size(), t))
    total = sum(size for group in by_dtype.values() for size, _ in group)
    if total < (4 << 20):  # small: compressing it costs nothing worth measuring
        return 4.0
    compressor = load_zstandard().ZstdCompressor(level=level)
    per_dtype = max(2, _SAMPLED_TENSORS // len(by_dtype))
    packed = 0.0
    for group in by_dtype.values():
        group.sort(key=lambda item: item[0], reverse=True)
        raw_sampled = packed_sampled = 0
        for _, t in group[:per_dtype]:
            flat = t.detach().reshape(-1)
            count = max(1, min(flat.numel(), _SAMPLE_BYTES // max(1, flat.element_size())))
            start = (flat.numel() - count) // 2
            try:
                piece = flat[start : start + count].contiguous().cpu()
                data = piece.view(torch.uint8).numpy().tobytes()
            except (RuntimeError, TypeError):  # a dtype without a byte view: count as raw
                continue
            raw_sampled += len(data)
            packed_sampled += len(compressor.compress(data))
        ratio = raw_sampled / packed_sampled if packed_sampled else 1.0
        packed += sum(size for size, _ in group) / ratio
    return float(total / packed) if packed else 1.0
