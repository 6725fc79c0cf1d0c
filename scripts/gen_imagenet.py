"""Generate a small ImageNet-like directory tree of real, decodable JPEG files.

The tree looks like an ImageNet extract::

    OUT/train/n01234567/n01234567_1.JPEG
    OUT/val/n01234567/n01234567_48.JPEG

It is used by ``make demo``, the benchmarks and the tests, so it has to be fast and
deterministic. Encoding tens of thousands of JPEGs would be slow, so the script encodes a
small pool of distinct images once (smooth random pictures with some texture and grain,
varied sizes and qualities) and writes every file as one pool image plus JPEG comment (COM)
segments that carry the file's name and a random payload. Every file is therefore unique,
is a valid JPEG that Pillow and libjpeg decode, and has a size drawn from a lognormal
distribution whose mean is ``--mean-kb`` (1 KB = 1000 bytes).

The same arguments always give a byte-identical tree (for a given Pillow/libjpeg build).

Usage::

    python scripts/gen_imagenet.py OUT [--files 20000] [--classes 100] [--mean-kb 110]
        [--splits train,val] [--val-fraction 0.05] [--seed 0] [--quiet]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import io
import math
import pathlib
import sys
import time
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
from PIL import Image

__all__ = ["GenerateResult", "generate", "main"]

KB = 1000
"""Bytes in the kilobyte that ``mean_kb`` is measured in."""

POOL_SIZE = 96
"""Number of distinct encoded images the files are made from."""

SIZE_SIGMA = 0.55
"""Shape (sigma of the underlying normal) of the lognormal file-size distribution."""

_SOI = b"\xff\xd8"
_COM = b"\xff\xfe"
_APP0 = b"\xff\xe0"
_MAX_SEGMENT_DATA = 65533  # a segment's 16-bit length counts itself (2 bytes) and its data
_MIN_PAYLOAD = 16
_NAME_PREFIX = b"shardio synthetic imagenet file "
_SYNSET_LOW = 1_000_000  # synsets look like ImageNet's: n01440764 ... n15075141
_SYNSET_HIGH = 16_000_000
_BASE_SIZE = (300, 200, 600, 450)  # smallest and largest pool image at the default mean
_DEFAULT_MEAN_KB = 110.0
_QUALITY_RANGE = (8, 95)


@dataclasses.dataclass(frozen=True)
class GenerateResult:
    """Summary of a generated tree.

    Attributes:
        files: Number of JPEG files written.
        bytes: Total size of the files written, in bytes.
        classes: Number of class (synset) directories per split.
        seconds: Wall-clock time the generation took.
    """

    files: int
    bytes: int
    classes: int
    seconds: float

    @property
    def mean_kb(self) -> float:
        """Mean file size in KB (1000 bytes); 0.0 for an empty tree."""
        return self.bytes / self.files / KB if self.files else 0.0


@dataclasses.dataclass(frozen=True)
class _Entry:
    """A run of files of one class in one split."""

    split: str
    synset: str
    first_index: int
    count: int


def generate(
    out: pathlib.Path,
    *,
    files: int,
    classes: int,
    mean_kb: float,
    splits: Sequence[str] = ("train", "val"),
    val_fraction: float = 0.05,
    seed: int = 0,
) -> GenerateResult:
    """Write an ImageNet-like tree of JPEG files under ``out``.

    Files are spread evenly over ``classes`` synsets (the first ``files % classes`` classes
    get one more). Within a class, every split other than the main one (``train`` when
    listed, else the first split) receives ``val_fraction`` of the class's files (rounded
    half up, at least one when ``val_fraction > 0`` and the class has room); the main split
    gets the rest. With a single split, it gets every file. File numbers run from 1
    per class across all splits, main split first.

    Args:
        out: Output directory; must be missing or empty.
        files: Total number of files, at least ``classes``.
        classes: Number of synsets, at least 1.
        mean_kb: Requested mean file size in KB (1000 bytes), at least 1.
        splits: Split directory names, e.g. ``("train", "val")``.
        val_fraction: Fraction of each class's files in each non-main split, in [0, 1).
        seed: Seed of every random choice; the same arguments give the same bytes.

    Returns:
        What was written.

    Raises:
        ValueError: An argument is out of range.
        FileExistsError: ``out`` exists and is not an empty directory.
    """
    start = time.perf_counter()
    split_names = _check_args(
        files=files,
        classes=classes,
        mean_kb=mean_kb,
        splits=splits,
        val_fraction=val_fraction,
        seed=seed,
    )
    _check_out(out)

    synset_seq, size_seq, payload_seq = np.random.SeedSequence(seed).spawn(3)
    synsets = _synsets(classes, np.random.default_rng(synset_seq))
    entries = _plan(files, synsets, split_names, val_fraction)
    pool = _pool(seed, float(mean_kb))
    pool_sizes = np.array([len(body) for body in pool], dtype=np.int64)

    size_rng = np.random.default_rng(size_seq)
    targets = _target_sizes(files, mean_kb * KB, size_rng)
    budgets = targets - _overhead_bound(synsets, split_names, entries)
    order = np.argsort(pool_sizes, kind="stable")
    sorted_sizes = pool_sizes[order]
    # Largest pool image that leaves room for the comment; the smallest one if none does.
    slots = np.searchsorted(sorted_sizes, budgets, side="right") - 1
    choice = order[np.clip(slots, 0, len(pool) - 1)]

    payload_rng = np.random.default_rng(payload_seq)
    max_payload = int(max(int(np.max(targets - pool_sizes[choice])), 0)) + _MIN_PAYLOAD
    blob_size = max_payload + (1 << 20)
    # Random bytes below 0xFF: high entropy like real scan data, and no marker-like pairs.
    blob = payload_rng.integers(0, 0xFF, size=blob_size, dtype=np.uint8).tobytes()
    offsets = payload_rng.integers(0, blob_size - max_payload, size=files)

    total = 0
    written = 0
    for entry in entries:
        class_dir = out / entry.split / entry.synset
        class_dir.mkdir(parents=True, exist_ok=True)
        for number in range(entry.first_index, entry.first_index + entry.count):
            name = f"{entry.synset}_{number}.JPEG"
            body = pool[int(choice[written])]
            label = b"%s%s/%s/%s\n" % (
                _NAME_PREFIX,
                entry.split.encode(),
                entry.synset.encode(),
                name.encode(),
            )
            payload_len = max(int(targets[written]) - len(body) - _com_overhead(label), 0)
            payload_len = max(payload_len, _MIN_PAYLOAD)
            offset = int(offsets[written])
            data = _with_comment(body, label + blob[offset : offset + payload_len])
            with (class_dir / name).open("wb") as handle:
                handle.write(data)
            total += len(data)
            written += 1

    return GenerateResult(
        files=written, bytes=total, classes=classes, seconds=time.perf_counter() - start
    )


def _check_args(
    *,
    files: int,
    classes: int,
    mean_kb: float,
    splits: Sequence[str],
    val_fraction: float,
    seed: int,
) -> tuple[str, ...]:
    """Validate ``generate``'s arguments and return the split names, main split first."""
    if classes < 1:
        raise ValueError(f"classes must be at least 1, got {classes}")
    if classes > _SYNSET_HIGH - _SYNSET_LOW:
        raise ValueError(f"classes must be at most {_SYNSET_HIGH - _SYNSET_LOW}, got {classes}")
    if files < classes:
        raise ValueError(f"files ({files}) must be at least classes ({classes})")
    if not math.isfinite(mean_kb) or mean_kb < 1:
        raise ValueError(f"mean_kb must be at least 1, got {mean_kb}")
    if seed < 0:
        raise ValueError(f"seed must be non-negative, got {seed}")
    names = tuple(splits)
    if not names:
        raise ValueError("splits must name at least one split")
    for name in names:
        if not name or name in (".", "..") or "/" in name or "\\" in name:
            raise ValueError(f"invalid split name {name!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate split names in {list(names)}")
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if (len(names) - 1) * val_fraction >= 1:
        raise ValueError(
            f"val_fraction {val_fraction} leaves no files for the main split "
            f"with {len(names)} splits"
        )
    main_split = "train" if "train" in names else names[0]
    return (main_split, *(name for name in names if name != main_split))


def _check_out(out: pathlib.Path) -> None:
    """Raise ``FileExistsError`` unless ``out`` is missing or an empty directory."""
    if out.is_dir():
        if any(out.iterdir()):
            raise FileExistsError(f"output directory {out} is not empty")
    elif out.exists():
        raise FileExistsError(f"output path {out} exists and is not a directory")


def _synsets(classes: int, rng: np.random.Generator) -> list[str]:
    """Draw ``classes`` distinct ImageNet-style synset ids (``n`` + 8 digits), sorted."""
    ids = rng.choice(_SYNSET_HIGH - _SYNSET_LOW, size=classes, replace=False) + _SYNSET_LOW
    return [f"n{int(value):08d}" for value in np.sort(ids)]


def _plan(
    files: int, synsets: Sequence[str], splits: Sequence[str], val_fraction: float
) -> list[_Entry]:
    """Spread ``files`` over classes and splits; ``splits[0]`` is the main split."""
    base, extra = divmod(files, len(synsets))
    others = len(splits) - 1
    per_split: dict[str, list[_Entry]] = {split: [] for split in splits}
    for index, synset in enumerate(synsets):
        count = base + (1 if index < extra else 0)
        held_out = 0
        if others:
            held_out = math.floor(count * val_fraction + 0.5)
            if val_fraction > 0:
                held_out = max(held_out, 1)
            held_out = min(held_out, (count - 1) // others)
        main_count = count - others * held_out
        per_split[splits[0]].append(_Entry(splits[0], synset, 1, main_count))
        first = main_count + 1
        for split in splits[1:]:
            per_split[split].append(_Entry(split, synset, first, held_out))
            first += held_out
    return [entry for split in splits for entry in per_split[split] if entry.count]


def _target_sizes(files: int, mean_bytes: float, rng: np.random.Generator) -> npt.NDArray[np.int64]:
    """Draw lognormal file sizes, clipped to a few KB .. 5x the mean, with the given mean."""
    low, high = _size_bounds(mean_bytes)
    sizes = rng.lognormal(0.0, SIZE_SIGMA, size=files)
    sizes *= mean_bytes / float(np.mean(sizes))
    for _ in range(8):  # clipping moves the mean; rescale until it settles
        sizes = np.clip(sizes, low, high)
        sizes *= mean_bytes / float(np.mean(sizes))
    return np.rint(np.clip(sizes, low, high)).astype(np.int64)


def _size_bounds(mean_bytes: float) -> tuple[float, float]:
    """Smallest and largest file size for a requested mean."""
    low = min(max(0.04 * mean_bytes, 3 * KB), 0.5 * mean_bytes)
    return low, 5.0 * mean_bytes


def _com_overhead(label: bytes) -> int:
    """Bytes a comment adds beyond its payload: markers, lengths and the label."""
    return 4 + len(label)


def _overhead_bound(
    synsets: Sequence[str], splits: Sequence[str], entries: Sequence[_Entry]
) -> int:
    """Upper bound of the comment bytes a file needs besides its padding."""
    longest = max(len(split) for split in splits) + max(len(s) for s in synsets)
    digits = len(str(max(entry.first_index + entry.count for entry in entries)))
    label = len(_NAME_PREFIX) + longest + len(synsets[0]) + digits + len("//_.JPEG\n")
    return 4 + label + _MIN_PAYLOAD


def _with_comment(body: bytes, comment: bytes) -> bytes:
    """Insert ``comment`` into JPEG ``body`` as COM segments after SOI (and a JFIF APP0).

    The comment goes after the JFIF APP0 segment when the image starts with one, so that
    the file stays a conforming JFIF file; it is split into several segments when it is
    longer than one segment can hold.
    """
    insert_at = 2
    if body[2:4] == _APP0:
        insert_at = 4 + int.from_bytes(body[4:6], "big")
    parts = [body[:insert_at]]
    for start in range(0, len(comment), _MAX_SEGMENT_DATA):
        chunk = comment[start : start + _MAX_SEGMENT_DATA]
        parts.append(_COM + (len(chunk) + 2).to_bytes(2, "big") + chunk)
    parts.append(body[insert_at:])
    return b"".join(parts)


@functools.lru_cache(maxsize=4)
def _pool(seed: int, mean_kb: float) -> tuple[bytes, ...]:
    """Encode ``POOL_SIZE`` distinct JPEGs whose sizes cover the file-size range.

    Pool image ``j`` aims at a size spaced log-uniformly between the smallest file size and
    the 99.9th percentile of the size distribution; larger pictures with more texture go to
    larger targets, and the JPEG quality is bisected to land just under each target.

    Args:
        seed: Seed of the pictures.
        mean_kb: Requested mean file size in KB.

    Returns:
        The encoded images, each starting with SOI.
    """
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0x1A6E]))
    mean_bytes = mean_kb * KB
    low, high = _size_bounds(mean_bytes)
    median = mean_bytes * math.exp(-(SIZE_SIGMA**2) / 2)
    top = min(high, median * math.exp(2.33 * SIZE_SIGMA))
    goals = np.geomspace(low * 0.9, top, POOL_SIZE)
    scale = min(max(math.sqrt(mean_kb / _DEFAULT_MEAN_KB), 0.5), 3.0)
    min_w, min_h, max_w, max_h = (max(16, round(v * scale)) for v in _BASE_SIZE)
    grain = rng.standard_normal((max_h * 2, max_w * 2, 3), dtype=np.float32)

    pool: list[bytes] = []
    for index, goal in enumerate(goals):
        u = index / (POOL_SIZE - 1)
        share = float(np.clip(u + rng.normal(0.0, 0.15), 0.0, 1.0))
        width = round(min_w + (max_w - min_w) * share)
        height = round(min_h + (max_h - min_h) * share)
        if rng.random() < 0.15:  # some portrait pictures, like ImageNet
            width, height = height, width
        detail = 2.0 + 60.0 * u**1.7 * float(rng.uniform(0.8, 1.2))
        picture = _picture(width, height, detail, grain, rng)
        progressive = bool(rng.random() < 0.1)
        pool.append(_encode_near(picture, int(goal), progressive))
    return tuple(pool)


def _picture(
    width: int,
    height: int,
    detail: float,
    grain: npt.NDArray[np.float32],
    rng: np.random.Generator,
) -> Image.Image:
    """Draw a smooth random RGB picture: gradient, upscaled noise octaves and grain."""
    colors = rng.uniform(0.0, 255.0, size=(2, 3)).astype(np.float32)
    xs = np.linspace(0.0, float(rng.uniform(-1, 1)), width, dtype=np.float32)
    ys = np.linspace(0.0, float(rng.uniform(-1, 1)), height, dtype=np.float32)
    ramp = ys[:, None] + xs[None, :]
    ramp -= ramp.min()
    ramp /= max(float(ramp.max()), 1e-6)
    pixels = colors[0] + (colors[1] - colors[0]) * ramp[..., None]
    pixels *= 0.6
    pixels += 50.0
    for cells, amplitude in ((3, 45.0), (12, 30.0), (48, 18.0)):
        small_w = max(2, round(cells * width / max(width, height)))
        small_h = max(2, round(cells * height / max(width, height)))
        noise = rng.integers(0, 256, size=(small_h, small_w, 3), dtype=np.uint8)
        smooth = Image.fromarray(noise, "RGB").resize((width, height), Image.Resampling.BICUBIC)
        pixels += (np.asarray(smooth, dtype=np.float32) - 128.0) * (amplitude / 128.0)
    top = int(rng.integers(0, grain.shape[0] - height + 1))
    left = int(rng.integers(0, grain.shape[1] - width + 1))
    patch = grain[top : top + height, left : left + width]
    pixels += patch[..., :1] * detail + patch * (detail * 0.35)
    return Image.fromarray(np.clip(pixels, 0.0, 255.0).astype(np.uint8), "RGB")


def _encode_near(picture: Image.Image, goal: int, progressive: bool) -> bytes:
    """Encode ``picture`` at the highest quality whose size is at most ``goal`` bytes.

    Falls back to the lowest quality tried when even that is larger than ``goal``.
    """
    low, high = _QUALITY_RANGE
    best = _encode(picture, low, progressive)
    if len(best) > goal:
        return best
    while low < high:  # invariant: quality ``low`` fits and ``best`` holds it
        middle = (low + high + 1) // 2
        data = _encode(picture, middle, progressive)
        if len(data) <= goal:
            low, best = middle, data
        else:
            high = middle - 1
    return best


def _encode(picture: Image.Image, quality: int, progressive: bool) -> bytes:
    """Encode ``picture`` as a baseline or progressive JPEG at ``quality``."""
    buffer = io.BytesIO()
    picture.save(buffer, "JPEG", quality=quality, progressive=progressive)
    return buffer.getvalue()


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(
        description="Generate a small ImageNet-like tree of real JPEG files."
    )
    parser.add_argument("out", type=pathlib.Path, help="output directory (missing or empty)")
    parser.add_argument("--files", type=int, default=20000, help="total files (default 20000)")
    parser.add_argument("--classes", type=int, default=100, help="number of synsets (default 100)")
    parser.add_argument(
        "--mean-kb", type=float, default=110.0, help="mean file size in KB (default 110)"
    )
    parser.add_argument(
        "--splits", default="train,val", help="comma-separated splits (default train,val)"
    )
    parser.add_argument(
        "--val-fraction",
        type=float,
        default=0.05,
        help="fraction of each class in each non-train split (default 0.05)",
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--quiet", action="store_true", help="print nothing on success")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status.

    Args:
        argv: Arguments without the program name; ``sys.argv[1:]`` when None.

    Returns:
        0 on success, 2 on a usage error or a non-empty output directory.
    """
    args = _parse_args(argv)
    splits = [name.strip() for name in str(args.splits).split(",") if name.strip()]
    out: pathlib.Path = args.out
    try:
        result = generate(
            out,
            files=args.files,
            classes=args.classes,
            mean_kb=args.mean_kb,
            splits=splits,
            val_fraction=args.val_fraction,
            seed=args.seed,
        )
    except (ValueError, OSError) as error:
        print(f"gen_imagenet: error: {error}", file=sys.stderr)
        return 2
    if not args.quiet:
        print(
            f"gen_imagenet: wrote {result.files} files in {result.classes} classes "
            f"({','.join(splits)}) to {out}: {result.bytes / KB**2:.1f} MB, "
            f"mean {result.mean_kb:.1f} KB, {result.seconds:.1f}s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
