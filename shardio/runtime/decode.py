"""Decoders for sample fields: raw bytes (default), PIL images, uint8 tensors, or a callable.

:func:`decode_sample` runs a decoder on one sample and turns any failure into a
:class:`~shardio.errors.SampleDecodeError` naming the dataset, shard and sample, which
a dataset's ``recovery=`` policy handles like an unreadable sample.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

from shardio.errors import MissingExtraError, SampleDecodeError, ShardioError, UsageError

__all__ = ["IMAGE_EXTS", "Decoder", "decode_sample", "make_decoder"]

IMAGE_EXTS = frozenset({"jpg", "jpeg", "png", "ppm", "pgm", "bmp", "webp", "gif", "tif", "tiff"})

Decoder = Callable[[dict[str, Any]], dict[str, Any]]

# Longest part of a decoder's message kept in a SampleDecodeError (one line, bounded).
_MAX_REASON = 300


class _FieldDecodeError(Exception):
    """A built-in decoder failed on field ``ext`` (the cause is chained)."""

    def __init__(self, ext: str) -> None:
        super().__init__(ext)
        self.ext = ext


def _pil(sample: dict[str, Any]) -> dict[str, Any]:
    from PIL import Image

    out = dict(sample)
    for ext, value in sample.items():
        if ext in IMAGE_EXTS and value is not None:
            try:
                with Image.open(io.BytesIO(bytes(value))) as img:
                    out[ext] = img.convert("RGB")
            except Exception as exc:  # PIL raises OSError, ValueError, SyntaxError, ...
                raise _FieldDecodeError(ext) from exc
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


def _require_pillow(decode: str) -> None:
    """Refuse a built-in image decoder at once, in one line, when Pillow is missing."""
    try:
        import PIL.Image  # noqa: F401 - only whether it imports
    except ImportError as exc:
        raise MissingExtraError(f"decode={decode!r} needs Pillow", "decode") from exc


def make_decoder(decode: str | Decoder | None) -> Decoder | None:
    """Return the decoder for ``decode``: None, "pil", "torch" or a callable on a sample dict."""
    if decode is None or decode == "bytes":
        return None
    if decode in ("pil", "torch"):
        _require_pillow(decode)
        return _pil if decode == "pil" else _torch
    if callable(decode):
        return decode
    raise UsageError(f"invalid decode {decode!r}: use None, 'pil', 'torch' or a callable")


def decode_sample(
    decoder: Decoder,
    sample: dict[str, Any],
    *,
    dataset: str,
    shard: str,
    index: int,
) -> dict[str, Any]:
    """``decoder(sample)``, its failure raised as one :class:`SampleDecodeError`.

    A :class:`MemoryError` passes through (the process is short of memory, not the sample
    bad), and so does a ShardioError the decoder raised on purpose.

    Args:
        decoder: the decoder.
        sample: the sample dict (``__key__`` and checked bytes per extension).
        dataset: the dataset directory, for the message.
        shard: the shard holding the sample, as the manifest names it.
        index: the sample's index in the dataset.

    Raises:
        SampleDecodeError: the decoder raised; the message names the sample, its shard, the
            dataset, the field when known and the decoder's own reason; the original is the
            ``__cause__``.
    """
    try:
        return decoder(sample)
    except (MemoryError, ShardioError):
        raise
    except Exception as exc:
        field = exc.ext if isinstance(exc, _FieldDecodeError) else None
        cause = exc.__cause__ if isinstance(exc, _FieldDecodeError) and exc.__cause__ else exc
        try:
            told = str(cause)
        except Exception:  # a decoder's exception whose message itself fails
            told = "(its message could not be read)"
        reason = f"{type(cause).__name__}: {told}".replace("\n", " ")
        if len(reason) > _MAX_REASON:
            reason = reason[: _MAX_REASON - 3] + "..."
        key = str(sample.get("__key__", "?"))
        what = f"field {field!r} of sample {key!r}" if field else f"sample {key!r}"
        raise SampleDecodeError(
            f"cannot decode {what} (shard {shard} of dataset {dataset}; its bytes match their "
            f"checksum): {reason}",
            dataset=dataset,
            shard=shard,
            key=key,
            sample=index,
            field=field,
        ) from cause
