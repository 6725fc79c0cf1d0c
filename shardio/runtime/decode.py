"""Decoders for sample fields: raw bytes (default), PIL images, uint8 tensors, or a callable."""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

from shardio.errors import UsageError

__all__ = ["IMAGE_EXTS", "Decoder", "make_decoder"]

IMAGE_EXTS = frozenset({"jpg", "jpeg", "png", "ppm", "pgm", "bmp", "webp", "gif", "tif", "tiff"})

Decoder = Callable[[dict[str, Any]], dict[str, Any]]


def _pil(sample: dict[str, Any]) -> dict[str, Any]:
    from PIL import Image

    out = dict(sample)
    for ext, value in sample.items():
        if ext in IMAGE_EXTS and value is not None:
            with Image.open(io.BytesIO(bytes(value))) as img:
                out[ext] = img.convert("RGB")
    return out


def _torch(sample: dict[str, Any]) -> dict[str, Any]:
    import numpy as np
    import torch

    out = _pil(sample)
    for ext, value in sample.items():
        if ext in IMAGE_EXTS and value is not None:
            arr = np.asarray(out[ext], dtype=np.uint8)
            out[ext] = torch.from_numpy(arr.copy()).permute(2, 0, 1)  # CHW, uint8
    return out


def make_decoder(decode: str | Decoder | None) -> Decoder | None:
    """Return the decoder for ``decode``: None, "pil", "torch" or a callable on a sample dict."""
    if decode is None or decode == "bytes":
        return None
    if decode == "pil":
        return _pil
    if decode == "torch":
        return _torch
    if callable(decode):
        return decode
    raise UsageError(f"invalid decode {decode!r}: use None, 'pil', 'torch' or a callable")
