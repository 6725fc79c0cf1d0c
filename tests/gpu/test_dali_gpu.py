"""shardio.dali on a GPU: nvJPEG ("mixed") decoding matches CPU decoding within JPEG tolerance.

Skipped without CUDA; the module imports cleanly on a machine without a GPU or without DALI.
"""

from __future__ import annotations

import importlib.util
import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from shardio.packing.run import PackOptions, pack

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.dali,
    pytest.mark.skipif(importlib.util.find_spec("nvidia") is None, reason="needs nvidia-dali"),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

NUM_IMAGES = 48
CLASSES = ("ant", "bee", "cat")


def _picture(i: int) -> bytes:
    """A smooth RGB picture with some texture, its own size, as JPEG (deterministic)."""
    rng = np.random.default_rng(i)
    h, w = 40 + 8 * (i % 7), 56 + 4 * (i % 5)
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([x * 255 // w, y * 255 // h, (x + y) * 127 // (h + w)], axis=-1)
    noise = rng.integers(0, 24, size=(h, w, 3))
    out = io.BytesIO()
    Image.fromarray((base + noise).clip(0, 255).astype(np.uint8)).save(out, "JPEG", quality=90)
    return out.getvalue()


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """48 JPEGs in 3 class directories, packed into several tar shards."""
    root = tmp_path_factory.mktemp("dali-gpu")
    for i in range(NUM_IMAGES):
        cls = root / "src" / CLASSES[i % len(CLASSES)]
        cls.mkdir(parents=True, exist_ok=True)
        (cls / f"{i:03d}.jpeg").write_bytes(_picture(i))
    pack(
        str(root / "src"), str(root / "ds"), PackOptions(shard_size_bytes=64 * 1024, durable=False)
    )
    return root / "ds"


def _batches(path: Path, **kwargs: Any) -> list[dict[str, Any]]:
    import shardio.dali

    with shardio.dali.loader(path, batch_size=16, shuffle=False, **kwargs) as loader:
        return [{"data": [t.cpu() for t in b["data"]], "label": b["label"].cpu()} for b in loader]


def test_mixed_decoding_matches_cpu_decoding(dataset: Path) -> None:
    cpu = _batches(dataset, decode="cpu")
    gpu = _batches(dataset, decode="mixed", device_id=0)
    assert len(cpu) == len(gpu) == NUM_IMAGES // 16
    for a, b in zip(cpu, gpu, strict=True):
        assert torch.equal(a["label"], b["label"])
        for x, y in zip(a["data"], b["data"], strict=True):
            assert x.shape == y.shape and y.dtype == torch.uint8
            diff = (x.to(torch.int16) - y.to(torch.int16)).abs()
            # libjpeg-turbo and nvJPEG differ in IDCT and chroma upsampling only.
            assert diff.float().mean() < 3.0
            assert diff.max() <= 64


def test_mixed_decoding_with_crop_gives_cuda_batches(dataset: Path) -> None:
    import shardio.dali

    with shardio.dali.loader(
        dataset, batch_size=16, decode="mixed", device_id=0, crop=32
    ) as loader:
        batches = list(loader)
    assert len(batches) == NUM_IMAGES // 16
    for batch in batches:
        images = batch["data"]
        assert images.is_cuda and images.dtype == torch.uint8
        assert images.shape == (16, 32, 32, 3)


def test_unverified_reader_decodes_on_the_gpu(dataset: Path) -> None:
    import shardio.dali

    with pytest.warns(shardio.dali.UnverifiedReadWarning):
        loader = shardio.dali.loader(
            dataset, batch_size=16, decode="mixed", device_id=0, crop=32, verify=False
        )
    with loader:
        labels = sorted(int(v) for batch in loader for v in batch["label"])
    assert labels == sorted(i % len(CLASSES) for i in range(NUM_IMAGES))
