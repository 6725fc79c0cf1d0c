"""Batch buffers of the training process, reused once nothing views the batch they held.

A batch read in the training process itself (``num_workers=0``) needs a buffer of its
payload's size. A fresh one is faulted in page by page by the reads (about a sixth of the CPU
an in-process epoch spends, measured on 110 KB samples); these are kept and read into again.

A buffer is handed out as a tensor over a fresh ndarray over a memoryview of its bytes (the
ring transport's way, :meth:`~shardio.runtime.transport.BatchRing.slot_view`): numpy
collapses chains of views only down to such an array, so every column, tensor, memoryview or
array taken from the batch keeps that array alive, and the buffer is free again only when the
last of them is gone. A caller that keeps every batch gets fresh buffers, as without reuse.
"""

from __future__ import annotations

import threading
import weakref

import numpy as np
import torch

__all__ = ["MAX_KEPT_BYTES", "ReusedBuffers"]

MAX_KEPT_BYTES = 256 << 20  # a larger batch's buffer is not kept (a few huge samples)


def _grown(nbytes: int) -> int:
    """A kept buffer's size for a batch of ``nbytes``: an eighth more (a batch of 64
    samples of 110 KB varies by about 4%), within :data:`MAX_KEPT_BYTES`."""
    return min(nbytes + nbytes // 8, MAX_KEPT_BYTES)


def _release(free: list[bool], order: list[int], index: int) -> None:
    free[index] = True
    order.append(index)


class ReusedBuffers:
    """Up to ``keep`` buffers, each reused once nothing views the batch it held.

    Args:
        keep: buffers kept (the batch the caller holds, the one being read, one more).
    """

    def __init__(self, keep: int = 3) -> None:
        self.keep = keep
        self._bytes: list[bytearray] = []
        self._free: list[bool] = []
        self._freed: list[int] = []  # buffers in the order they were freed (may repeat)
        self._lock = threading.Lock()  # a loader may read on more than one thread

    def allocate(self, nbytes: int) -> torch.Tensor:
        """A contiguous uint8 tensor of exactly ``nbytes`` (the ``allocate`` of
        :func:`~shardio.runtime.batch.read_batch`)."""
        if nbytes > MAX_KEPT_BYTES:  # not kept for the loader's life: a fresh one
            return torch.empty(nbytes, dtype=torch.uint8)
        with self._lock:
            index = self._claim(nbytes)
        if index is None:
            return torch.empty(nbytes, dtype=torch.uint8)
        owner = np.frombuffer(memoryview(self._bytes[index])[:nbytes], np.uint8)
        weakref.finalize(owner, _release, self._free, self._freed, index).atexit = False
        return torch.from_numpy(owner)

    def _claim(self, nbytes: int) -> int | None:
        # The buffer freed last first: its pages are the likeliest still in the CPU's cache.
        while self._freed:
            index = self._freed.pop()
            if self._free[index]:
                break
        else:
            if len(self._bytes) >= self.keep:
                return None
            index = len(self._bytes)
            self._bytes.append(bytearray(_grown(nbytes)))
            self._free.append(True)
        if len(self._bytes[index]) < nbytes:
            # Batches of a run are about one size: grown with room to spare, so that the
            # next a little larger one fits (each growth is a fresh buffer, faulted in).
            self._bytes[index] = bytearray(_grown(nbytes))
        self._free[index] = False
        return index
