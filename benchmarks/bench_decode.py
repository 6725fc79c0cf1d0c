"""End-to-end decode: from JPEG files to batches of 224x224 uint8 tensors, shardio and peers.

One run, on one generated ImageNet-like tree (bench_pack's, ``--files`` JPEGs of ~110 KB
mean) and one tar pack of it (``shardio pack --format tar``, made once under ``--workdir``
and reused while its stamp stands), measures a training input loop that decodes every JPEG
and makes a ResNet-style input: resize the shorter side to 256, center-crop 224x224, a
``uint8`` CHW tensor, in batches of 64 (``[64, 3, 224, 224]``), with 2 DataLoader workers:

1. ``shardio``: ``ShardDataset(pack, decode=<decode+crop>).loader(batch_size=64,
   num_workers=2)``;
2. ``shardio-dali-cpu``: ``shardio.dali.loader(pack, decode="cpu", crop=224,
   num_threads=2, device_id=None)``: shardio reads and verifies, DALI decodes on the CPU and
   makes a random resized crop (``fn.random_resized_crop``; ``(B, 224, 224, 3)``), in the
   training process;
   ``dali-cpu``: DALI alone over the same tar shards and their ``.idx`` files
   (``fn.readers.webdataset`` + ``fn.decoders.image(device="cpu")`` + ``fn.resize`` +
   ``fn.crop_mirror_normalize``: the resize + center crop of the other rows), unverified;
3. ``wds``: webdataset's ``WebDataset`` over the same tar shards, same decode+crop, in 2
   DataLoader workers;
4. ``loose``: the original tree, a map-style Dataset (``open().read()`` + the same
   decode+crop), 2 DataLoader workers.

Configurations 1, 3 and 4 run the same Python function: Pillow's ``Image.open(...)
.convert("RGB")``, ``resize`` (bilinear) and ``crop``, then ``torch.from_numpy``. DALI
decodes with its own libjpeg-turbo and resizes with its own kernels. Each configuration runs
in its own child process (imports before the clock; the READY/GO handshake of bench_read
lets a cold run drop the caches after them), round-robin over ``--repeat-cold`` cold and
``--repeat-warm`` warm rounds. The child reports images, wall time and its CPU time
(``getrusage`` of itself and of its reaped workers), so the section gives images/s, images/s
per core used (2 workers + the main process) and per CPU-second. The section "## End-to-end
decode to 224x224" of benchmarks/RESULTS.md gets the medians. Not a test: it measures and
reports, and asserts nothing about speed.

Usage::

    sudo .venv/bin/python benchmarks/bench_decode.py [--files 5000] [--repeat-warm 3]
        [--repeat-cold 2] [--only NAME,...] [--no-write]
"""

from __future__ import annotations

import argparse
import datetime
import glob
import io
import json
import multiprocessing
import os
import resource
import shlex
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV_BIN = os.path.dirname(sys.executable)
ME = os.path.abspath(__file__)
SECTION = "## End-to-end decode to 224x224"
PEER_UNAVAILABLE = 3  # exit code of a child whose library cannot be imported
BOTH = ("cold", "warm")
WARM = ("warm",)
RESIZE = 256  # the shorter side, before the center crop (torchvision's Resize(256))
CROP = 224
CONTENDED = 0.5  # others' CPU (cores) from which a run is named as slowed by other load


# --------------------------------------------------------------------------------------------
# The transform every PIL configuration runs (module level: DataLoader workers call it).
# --------------------------------------------------------------------------------------------


def decode_crop(data: bytes) -> Any:
    """JPEG bytes to a ``uint8`` CHW tensor of CROP x CROP: Pillow decode to RGB, resize the
    shorter side to RESIZE (bilinear), center crop. What torchvision's ``Resize(256)`` +
    ``CenterCrop(224)`` + ``PILToTensor()`` do, without torchvision."""
    import numpy as np
    import torch
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        rgb = img.convert("RGB")
    width, height = rgb.size
    scale = RESIZE / min(width, height)
    size = (max(RESIZE, round(width * scale)), max(RESIZE, round(height * scale)))
    rgb = rgb.resize(size, Image.Resampling.BILINEAR)
    left, top = (size[0] - CROP) // 2, (size[1] - CROP) // 2
    rgb = rgb.crop((left, top, left + CROP, top + CROP))
    return torch.from_numpy(np.array(rgb, dtype=np.uint8)).permute(2, 0, 1)  # HWC -> CHW


def packed_sample(sample: dict[str, Any]) -> dict[str, Any]:
    """shardio's ``decode=`` callable and webdataset's ``map``: a sample dict (``__key__``,
    ``jpeg`` bytes, ``cls``) to ``{"__key__": key, "image": tensor, "cls": int}`` (shardio's
    loader counts delivered samples by ``__key__``, so a decoder keeps it)."""
    return {
        "__key__": sample["__key__"],
        "image": decode_crop(bytes(sample["jpeg"])),
        "cls": int(sample["cls"]),
    }


# --------------------------------------------------------------------------------------------
# Configurations.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    """One measured configuration."""

    name: str
    label: str
    data: str  # pack | tree: what it reads
    caches: tuple[str, ...]
    processes: str  # what runs the decoding: the "cores used" of the per-core figure
    cores: int


JOBS = [
    Job(
        "shardio",
        "shardio `ShardDataset(decode=...)`, tar",
        "pack",
        BOTH,
        "2 workers + main",
        3,
    ),
    Job(
        "shardio-dali-cpu",
        "shardio.dali `loader(decode='cpu', crop=224)`, tar",
        "pack",
        WARM,
        "2 DALI threads + main",
        3,
    ),
    Job(
        "dali-cpu",
        "DALI alone, CPU decoding (`fn.readers.webdataset`)",
        "pack",
        WARM,
        "2 DALI threads + main",
        3,
    ),
    Job("wds", "webdataset `WebDataset` (tar shards)", "pack", WARM, "2 workers + main", 3),
    Job("loose", "loose files, map-style Dataset", "tree", BOTH, "2 workers + main", 3),
]
BY_NAME = {j.name: j for j in JOBS}


# --------------------------------------------------------------------------------------------
# The children: ``bench_decode.py _child NAME DATA RESULT [--handshake]``. Each ``_prep_*``
# imports what it needs (not timed) and returns a ``start`` callable that builds the dataset
# and loader (timed) and returns (batches, images_of) with ``images_of(batch)`` the batch's
# ``[n, 3, 224, 224]`` uint8 tensor.
# --------------------------------------------------------------------------------------------

Batches = tuple[Iterable[Any], Callable[[Any], Any]]


def _prep_shardio(args: argparse.Namespace) -> Callable[[], Batches]:
    from shardio import ShardDataset

    def start() -> Batches:
        ds = ShardDataset(args.data, decode=packed_sample, seed=args.seed)
        loader = ds.loader(batch_size=args.batch_size, num_workers=args.workers)
        return loader, lambda b: b["image"]

    return start


def _shards(data: str) -> tuple[list[str], list[str]]:
    tars = sorted(glob.glob(os.path.join(data, "shards", "*.tar")))
    return tars, [t[: -len(".tar")] + ".idx" for t in tars]


def _prep_dali(args: argparse.Namespace) -> Callable[[], Batches]:
    try:
        from nvidia.dali import fn, pipeline_def, types
        from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy
    except Exception as exc:
        print(f"DALI unavailable: {exc!r}", file=sys.stderr)
        sys.exit(PEER_UNAVAILABLE)

    def start() -> Batches:
        tars, idxs = _shards(args.data)

        @pipeline_def(batch_size=args.batch_size, num_threads=args.workers, device_id=None)
        def pipe() -> Any:
            # Labels are not read: a tar member ``cls`` is ASCII of varying length, which
            # DALI cannot batch into a tensor; they cost nothing next to the images.
            jpeg = fn.readers.webdataset(
                paths=tars, index_paths=idxs, ext=["jpeg"], random_shuffle=False, name="reader"
            )
            images = fn.decoders.image(jpeg, device="cpu", output_type=types.RGB)
            images = fn.resize(images, resize_shorter=RESIZE, interp_type=types.INTERP_LINEAR)
            return fn.crop_mirror_normalize(
                images, crop=(CROP, CROP), dtype=types.UINT8, output_layout="CHW"
            )

        p = pipe()
        p.build()
        it = DALIGenericIterator(
            [p],
            ["image"],
            reader_name="reader",
            last_batch_policy=LastBatchPolicy.PARTIAL,
            auto_reset=False,
        )
        return it, lambda b: b[0]["image"]

    return start


def _prep_shardio_dali(args: argparse.Namespace) -> Callable[[], Batches]:
    try:
        # DALI's operators and PyTorch plugin (what shardio.dali imports when it builds a
        # pipeline and a loader) are imported here, before the clock.
        import nvidia.dali.fn
        import nvidia.dali.plugin.pytorch  # noqa: F401

        import shardio.dali as sd
    except Exception as exc:
        print(f"DALI or shardio.dali unavailable: {exc!r}", file=sys.stderr)
        sys.exit(PEER_UNAVAILABLE)

    def start() -> Batches:
        loader = sd.loader(
            args.data,
            batch_size=args.batch_size,
            num_threads=args.workers,
            device_id=None,
            decode="cpu",
            crop=CROP,
            seed=args.seed,
        )
        return loader, lambda b: b["data"]

    return start


def _prep_wds(args: argparse.Namespace) -> Callable[[], Batches]:
    try:
        import webdataset as wds
    except ImportError as exc:
        print(f"webdataset unavailable: {exc}", file=sys.stderr)
        sys.exit(PEER_UNAVAILABLE)
    from torch.utils.data import DataLoader, default_collate

    def start() -> Batches:
        tars, _ = _shards(args.data)
        ds = (
            wds.WebDataset(tars, shardshuffle=False, empty_check=False)
            .map(packed_sample)
            .batched(args.batch_size, collation_fn=default_collate)
        )
        loader = DataLoader(ds, batch_size=None, num_workers=args.workers)
        return loader, lambda b: b["image"]

    return start


def _prep_loose(args: argparse.Namespace) -> Callable[[], Batches]:
    import torch
    from torch.utils.data import DataLoader, Dataset

    class LooseImages(Dataset):  # type: ignore[type-arg]
        """What torchvision's ImageFolder does: walk the tree once, then read and transform
        each file by index."""

        def __init__(self, root: str) -> None:
            self.files: list[tuple[str, str]] = []
            for dirpath, dirnames, filenames in os.walk(root):
                dirnames.sort()
                cls = os.path.basename(dirpath)
                self.files.extend((os.path.join(dirpath, f), cls) for f in sorted(filenames))
            self.classes = {c: i for i, c in enumerate(sorted({c for _, c in self.files}))}

        def __len__(self) -> int:
            return len(self.files)

        def __getitem__(self, i: int) -> dict[str, Any]:
            path, cls = self.files[i]
            with open(path, "rb") as fh:
                data = fh.read()
            return {"__key__": path, "image": decode_crop(data), "cls": self.classes[cls]}

    def start() -> Batches:
        loader = DataLoader(
            LooseImages(args.data),
            batch_size=args.batch_size,
            shuffle=True,
            num_workers=args.workers,
            generator=torch.Generator().manual_seed(args.seed),
        )
        return loader, lambda b: b["image"]

    return start


_PREPS: dict[str, Callable[[argparse.Namespace], Callable[[], Batches]]] = {
    "shardio": _prep_shardio,
    "shardio-dali-cpu": _prep_shardio_dali,
    "dali-cpu": _prep_dali,
    "wds": _prep_wds,
    "loose": _prep_loose,
}


def _cpu_s() -> float:
    """CPU seconds (user + system) of this process and of the children it has reaped."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        ru = resource.getrusage(who)
        total += ru.ru_utime + ru.ru_stime
    return total


def _live_children() -> int:
    multiprocessing.active_children()  # reaps the workers that have exited
    count = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/children") as fh:
                count += len(fh.read().split())
        except OSError:
            continue
    return count


def _child(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench_decode.py _child")
    parser.add_argument("name", choices=sorted(_PREPS))
    parser.add_argument("data")
    parser.add_argument("result")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--handshake", action="store_true")
    args = parser.parse_args(argv)
    start = _PREPS[args.name](args)  # imports: not timed
    import numpy  # noqa: F401 - the transform's imports, before the clock
    import PIL.Image  # noqa: F401
    import torch

    if args.handshake:
        common.child_handshake()  # the parent drops the caches here for a cold run
    cpu0, t0 = _cpu_s(), time.perf_counter()
    batches, images_of = start()
    samples = pixel_sum = 0
    shapes: set[tuple[int, ...]] = set()
    dtypes: set[str] = set()
    t_first: float | None = None
    batch: Any = None
    for batch in batches:
        images = images_of(batch)
        samples += int(images.shape[0])
        shapes.add(tuple(images.shape[1:]))
        dtypes.add(str(images.dtype))
        # The loop's use of the batch: a sum over every pixel, which must agree between the
        # configurations that run the same transform (it does not depend on the order).
        pixel_sum += int(images.sum(dtype=torch.int64))
        if t_first is None:
            t_first = time.perf_counter()
    del batch, batches, images_of  # the loaders shut their workers down at the epoch's end
    live = _live_children()
    t_end, cpu_end = time.perf_counter(), _cpu_s()
    with open(args.result, "w") as fh:
        json.dump(
            {
                "samples": samples,
                "time_s": t_end - t0,
                "cpu_s": cpu_end - cpu0,
                "first_batch_s": (t_first or t_end) - t0,
                "pixel_sum": pixel_sum,
                "shapes": sorted(list(s) for s in shapes),
                "dtypes": sorted(dtypes),
                "live_children": live,
            },
            fh,
        )
    return 0


# --------------------------------------------------------------------------------------------
# The data: the tree and its tar pack.
# --------------------------------------------------------------------------------------------


@dataclass
class Data:
    """Paths and facts of the prepared data."""

    tree: str
    pack: str
    num_samples: int
    payload: int
    shard_bytes: list[int]
    dims: tuple[int, int, int, int]  # smallest and largest width, smallest and largest height
    backed_bytes: int  # memory touched and freed before each run (common.back_free_memory)
    commands: dict[str, str] = field(default_factory=dict)


def _shell(argv: Sequence[str]) -> str:
    return shlex.join(argv).replace(REPO + "/", "")


def _prepare(args: argparse.Namespace, src: str) -> Data:
    from shardio.read.reader import ShardReader

    base = os.path.join(
        args.workdir,
        f"decode-f{args.files}-kb{args.mean_kb:g}-c{args.classes}-s{args.shard_size}",
    )
    os.makedirs(base, exist_ok=True)
    pack = os.path.join(base, "tar")
    pack_argv = [os.path.join(VENV_BIN, "shardio"), "pack", src, pack, "--format", "tar"]
    pack_argv += ["--shard-size", args.shard_size, "--no-progress"]
    if args.regen or not os.path.exists(pack + ".done"):
        common.remove_path(pack)
        common.remove_path(pack + ".done")
        print("preparing", _shell(pack_argv), file=sys.stderr)
        run = common.run_child(pack_argv)
        if run.returncode != 0:
            raise SystemExit(f"packing failed:\n{run.stderr_tail}")
        with open(pack + ".done", "w") as fh:
            fh.write(_shell(pack_argv) + "\n")
    with ShardReader(pack) as ds:
        shard_bytes = [int(s.size_bytes) for s in ds.manifest.shards]
        num_samples = len(ds)
    count, payload = common.tree_payload(src)
    if count != num_samples:
        raise SystemExit(f"the pack holds {num_samples} samples, the tree {count} files")
    from PIL import Image

    widths, heights = [], []
    for root, _, files in os.walk(src):
        for name in files:
            with Image.open(os.path.join(root, name)) as img:  # reads the header only
                widths.append(img.size[0])
                heights.append(img.size[1])
    return Data(
        tree=src,
        pack=pack,
        num_samples=num_samples,
        payload=payload,
        shard_bytes=shard_bytes,
        dims=(min(widths), max(widths), min(heights), max(heights)),
        backed_bytes=sum(shard_bytes) + 512 * common.MiB,  # the epoch's pages and batches
        commands={"pack": _shell(pack_argv)},
    )


def _busy_s() -> float:
    """CPU seconds the whole machine has spent busy since boot (/proc/stat: all but idle and
    iowait), to tell how much CPU other processes took during a run."""
    with open("/proc/stat") as fh:
        fields = [int(x) for x in fh.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _wait_quiet(limit_s: float, threshold: float = 0.3) -> float:
    """Wait (up to ``limit_s``) until the machine is idle: less than ``threshold`` cores busy
    over one second. Other sessions share this machine; starting a run while they compute
    takes CPU from it. Returns the seconds waited."""
    start = time.perf_counter()
    while True:
        busy0, t0 = _busy_s(), time.perf_counter()
        time.sleep(1.0)
        busy = (_busy_s() - busy0) / (time.perf_counter() - t0)
        waited = time.perf_counter() - start
        if busy < threshold or waited >= limit_s:
            return waited


# --------------------------------------------------------------------------------------------
# Measuring.
# --------------------------------------------------------------------------------------------


@dataclass
class Run:
    """One timed run."""

    time_s: float  # in the child: building the loader + the epoch, until its workers exited
    wall_s: float  # spawn to reap
    cpu_s: float  # in the child over time_s: itself + its reaped workers (user + system)
    samples: int
    first_batch_s: float
    pixel_sum: int
    shapes: list[list[int]]
    dtypes: list[str]
    live_children: int
    max_rss: int
    tree_rss: int
    others: float  # cores busy outside the child's process tree over its wall (other load)


@dataclass
class Outcome:
    """All runs of one configuration."""

    job: Job
    warm: list[Run] = field(default_factory=list)
    cold: list[Run] = field(default_factory=list)
    status: str = "ok"  # ok | failed | unavailable
    note: str = ""

    def runs(self, cache: str) -> list[Run]:
        return self.warm if cache == "warm" else self.cold

    def time(self, cache: str) -> float | None:
        runs = self.runs(cache)
        return common.median([r.time_s for r in runs]) if runs else None

    def rate(self, cache: str) -> float | None:
        """Images/s: median images over median time."""
        runs, t = self.runs(cache), self.time(cache)
        if not runs or not t:
            return None
        return common.median([r.samples for r in runs]) / t

    def busy(self, cache: str) -> float | None:
        """Cores busy: median of CPU s / s over the runs."""
        runs = self.runs(cache)
        return common.median([r.cpu_s / r.time_s for r in runs]) if runs else None

    def per_cpu_s(self, cache: str) -> float | None:
        """Images per CPU-second: median over the runs."""
        runs = self.runs(cache)
        return common.median([r.samples / r.cpu_s for r in runs if r.cpu_s]) if runs else None


def _child_argv(job: Job, data: Data | None, result: str, args: argparse.Namespace) -> list[str]:
    """The command of a job (with placeholders when ``data`` is None)."""
    if data is None:
        where = "TREE" if job.data == "tree" else "PACK"
    else:
        where = data.tree if job.data == "tree" else data.pack
    argv = [sys.executable, ME, "_child", job.name, where, result]
    argv += ["--batch-size", str(args.batch_size), "--workers", str(args.workers)]
    argv += ["--seed", str(args.seed)]
    return [*argv, "--handshake"]


def _measure(
    o: Outcome, cache: str, data: Data, args: argparse.Namespace, cold_ok: list[bool]
) -> None:
    job = o.job
    if cache == "warm":
        common.warm_up(data.tree if job.data == "tree" else data.pack)
        common.back_free_memory(data.backed_bytes)  # cold runs: after the drop

    def drop() -> None:
        cold_ok[0] = common.drop_caches() and cold_ok[0]
        common.back_free_memory(data.backed_bytes)

    result_path = os.path.join(args.workdir, f"decode-result-{job.name}.json")
    common.remove_path(result_path)
    if args.quiet_wait > 0:
        waited = _wait_quiet(args.quiet_wait)
        if waited > 1.5:
            print(f"waited {waited:.0f} s for the machine to be idle", file=sys.stderr)
    busy0 = _busy_s()
    run = common.run_child(
        _child_argv(job, data, result_path, args),
        on_ready=drop if cache == "cold" else (lambda: None),
    )
    others = max(0.0, _busy_s() - busy0 - run.user_s - run.sys_s) / run.wall_s
    result: dict[str, Any] = {}
    if run.returncode == 0 and os.path.exists(result_path):
        with open(result_path) as fh:
            result = json.load(fh)
    common.remove_path(result_path)
    if not result:
        o.status = "unavailable" if run.returncode == PEER_UNAVAILABLE else "failed"
        o.note = f"exit {run.returncode}: " + " ".join(run.stderr_tail.strip().splitlines()[-3:])
        print(f"[{cache}] {job.name:10s} {o.status}: {o.note}", file=sys.stderr)
        return
    got = Run(
        time_s=result["time_s"],
        wall_s=run.wall_s,
        cpu_s=result["cpu_s"],
        samples=result["samples"],
        first_batch_s=result["first_batch_s"],
        pixel_sum=result["pixel_sum"],
        shapes=result["shapes"],
        dtypes=result["dtypes"],
        live_children=result["live_children"],
        max_rss=run.max_rss_bytes,
        tree_rss=run.peak_tree_rss_bytes,
        others=others,
    )
    o.runs(cache).append(got)
    print(
        f"[{cache}] {job.name:10s} {got.time_s:7.3f} s {got.samples / got.time_s:7.0f} images/s "
        f"cores busy {got.cpu_s / got.time_s:.2f} others {others:.2f} n={got.samples}",
        file=sys.stderr,
    )


# --------------------------------------------------------------------------------------------
# Reporting.
# --------------------------------------------------------------------------------------------


def _spread(runs: Sequence[Run]) -> str:
    times = [r.time_s for r in runs]
    return f"{common.median(times):.2f} ({min(times):.2f}-{max(times):.2f})"


def _get(outcomes: Sequence[Outcome], name: str) -> Outcome | None:
    for o in outcomes:
        if o.job.name == name and o.status == "ok":
            return o
    return None


def _throughput_table(outcomes: Sequence[Outcome], cache: str) -> str:
    ref = _get(outcomes, "shardio")
    ref_rate = ref.rate(cache) if ref else None
    rows = []
    for o in outcomes:
        if cache not in o.job.caches:
            continue
        row = [o.job.label]
        runs = o.runs(cache) if o.status == "ok" else []
        rate = o.rate(cache) if runs else None
        if rate is None:
            rows.append([*row, o.status if o.status != "ok" else "-", *["-"] * 8])
            continue
        busy, per_cpu = o.busy(cache), o.per_cpu_s(cache)
        first = common.median([r.first_batch_s for r in runs])
        rows.append(
            [
                *row,
                _spread(runs),
                f"{rate:,.0f}",
                f"{rate / o.job.cores:,.0f} (÷{o.job.cores}: {o.job.processes})",
                f"{busy:.2f}" if busy is not None else "-",
                f"{per_cpu:,.0f}" if per_cpu is not None else "-",
                common.fmt_ratio(rate / ref_rate) if ref_rate else "-",
                f"{first:.2f}",
                f"{common.median([r.tree_rss for r in runs]) / common.MiB:,.0f}",
                f"{common.median([r.others for r in runs]):.2f}",
            ]
        )
    header = [
        "configuration",
        f"{cache} s, median (min-max)",
        "images/s",
        "images/s per core used",
        "cores busy (CPU s / s)",
        "images per CPU-second",
        "vs shardio",
        "first batch s",
        "peak RSS, process tree MiB",
        "others' CPU (cores)",
    ]
    return common.markdown_table(header, rows)


def _checks_table(outcomes: Sequence[Outcome], data: Data) -> tuple[str, list[str]]:
    rows, notes = [], []
    for o in outcomes:
        runs = o.warm + o.cold
        if o.status != "ok" or not runs:
            rows.append([o.job.label, o.status, "-", "-", "-"])
            continue
        counts = sorted({r.samples for r in runs})
        shapes = sorted({"x".join(map(str, s)) for r in runs for s in r.shapes})
        dtypes = sorted({d for r in runs for d in r.dtypes})
        sums = sorted({r.pixel_sum for r in runs})
        rows.append(
            [
                o.job.label,
                ", ".join(map(str, counts)),
                ", ".join(f"`{d}`" for d in dtypes) + " " + ", ".join(shapes),
                ", ".join(f"{s:,}" for s in sums),
                str(max(r.live_children for r in runs)),
            ]
        )
        if counts != [data.num_samples]:
            notes.append(
                f"- {o.job.label}: delivered {counts} images (the tree has {data.num_samples})"
            )
        if any(r.live_children for r in runs):
            notes.append(
                f"- {o.job.label}: workers still alive when the CPU time was read (their CPU "
                "time is missing from it)"
            )
    pil = [_get(outcomes, n) for n in ("shardio", "wds", "loose")]
    pil_sums = {r.pixel_sum for o in pil if o for r in o.warm + o.cold}
    if len(pil_sums) > 1:
        notes.append(
            "- the configurations that run the same Pillow transform disagree on the pixel "
            "sum: they did not deliver the same images"
        )
    header = ["configuration", "images per epoch", "image dtype, shape", "pixel sum"]
    header.append("workers alive at the end")
    return common.markdown_table(header, rows), notes


def _report(
    outcomes: Sequence[Outcome], data: Data, args: argparse.Namespace, info: dict[str, Any]
) -> str:
    warm_table = _throughput_table(outcomes, "warm")
    cold_table = _throughput_table(outcomes, "cold")
    checks_table, check_notes = _checks_table(outcomes, data)
    notes = [f"- {o.job.label}: {o.status} — {o.note}" for o in outcomes if o.status != "ok"]
    notes += check_notes
    contended = [
        f"{o.job.name} {cache} #{i + 1} ({r.others:.2f})"
        for o in outcomes
        for cache in ("cold", "warm")
        for i, r in enumerate(o.runs(cache))
        if r.others >= CONTENDED
    ]
    if contended:
        notes.append(
            f"- runs during which other processes took {CONTENDED:g} core or more (slower "
            "than they would be alone; they count in the medians): " + ", ".join(contended)
        )
    raw = []
    for o in outcomes:
        for cache in ("cold", "warm"):
            if o.runs(cache):
                raw.append(
                    f"- {o.job.name} {cache}: "
                    + ", ".join(
                        f"{r.time_s:.2f}/{r.cpu_s:.1f}/{r.wall_s:.1f}/{r.others:.2f}"
                        for r in o.runs(cache)
                    )
                )
    cache_line = (
        "cold runs: `sync; echo 3 > /proc/sys/vm/drop_caches` after the child's imports, just "
        "before it starts the clock"
        if info["cold"]
        else "**cold runs are not cold**: dropping caches was not permitted (not root)"
    )
    versions = ", ".join(
        f"{n} {common.package_version(n)}"
        for n in ("shardio", "torch", "numpy", "pillow", "webdataset", "nvidia-dali-cuda120")
        if common.package_version(n) != "not installed"
    )
    if "nvidia-dali" not in versions:
        versions += f", DALI {info['dali_version']}"
    argv = [".venv/bin/python", "benchmarks/bench_decode.py", "--files", str(args.files)]
    argv += ["--repeat-warm", str(args.repeat_warm), "--repeat-cold", str(args.repeat_cold)]
    if args.only:
        argv += ["--only", args.only]
    children = sorted({_shell(_child_argv(o.job, None, "RESULT", args)) for o in outcomes})
    shard_mb = [b / 1e6 for b in data.shard_bytes]
    parts = [
        f"Run {info['started']}; {versions}.",
        "",
        info["code"],
        "",
        f"Data: the bench_pack tree (`scripts/gen_imagenet.py --files {args.files} --classes "
        f"{args.classes} --mean-kb {args.mean_kb:g}`), {data.num_samples} JPEGs ("
        f"{data.dims[0]}-{data.dims[1]} pixels wide, {data.dims[2]}-{data.dims[3]} high), "
        f"{data.payload / 1e9:.3f} GB, packed once with `{data.commands['pack']}` into "
        f"{len(data.shard_bytes)} tar shards ({min(shard_mb):.1f}-{max(shard_mb):.1f} MB each, "
        "with the `.idx` files DALI reads). Every configuration delivers one epoch as batches "
        f"of {args.batch_size} `uint8` images of {CROP}x{CROP}, and the training loop sums "
        "every pixel of each batch (the sum does not depend on the order: a check that rows "
        "running the same transform delivered the same images).",
        "",
        "Transform: shardio, webdataset and loose files run the same Python function in "
        f"{args.workers} DataLoader workers (`decode_crop` in benchmarks/bench_decode.py: "
        "Pillow's `Image.open(...).convert('RGB')`, resize of the shorter side to "
        f"{RESIZE} (bilinear), center crop {CROP}x{CROP}, `torch.from_numpy` as CHW; batches "
        "collated by `torch.stack`), so their pixel sums must agree. DALI alone runs the same "
        "steps with its own decoder (libjpeg-turbo) and resize kernel (antialiased linear), so "
        "its pixels differ slightly. shardio.dali's `crop=` is a ResNet training crop, "
        "`fn.random_resized_crop` (a random area of 8-100% and aspect ratio, resized to "
        f"{CROP}x{CROP}, HWC): less resizing work than resize + center crop, and other pixels. "
        f"Decoding happens in {args.workers} DataLoader workers (Pillow rows) or in "
        f"{args.workers} DALI threads of the training process (DALI rows).",
        "",
        "- shardio: `ShardDataset(PACK, decode=packed_sample, seed=0).loader(batch_size=B, "
        f"num_workers={args.workers})` (map mode, random order, every member verified; "
        "`packed_sample` wraps `decode_crop` and keeps `__key__`, which the loader counts; "
        "decoded samples cross from the workers as torch's pickled batches, not the ring).",
        "- shardio.dali: `shardio.dali.loader(PACK, batch_size=B, num_threads="
        f"{args.workers}, device_id=None, decode='cpu', crop={CROP}, seed=0)` (its default "
        "`verify=True`: shardio reads and checks every member in one Python thread of the "
        "training process and feeds `fn.external_source`, in ShardDataset's random order; "
        "`fn.decoders.image(device='cpu')` + `fn.random_resized_crop`; batches `(B, "
        f"{CROP}, {CROP}, 3)` through `DALIGenericIterator`).",
        "- DALI alone: `fn.readers.webdataset(paths=<tars>, index_paths=<the pack's .idx "
        "files>, ext=['jpeg'], random_shuffle=False)` → `fn.decoders.image(device='cpu', "
        f"output_type=RGB)` → `fn.resize(resize_shorter={RESIZE}, interp_type=LINEAR)` → "
        f"`fn.crop_mirror_normalize(crop=({CROP}, {CROP}), dtype=UINT8, output_layout='CHW')` "
        f"in `pipeline_def(batch_size=B, num_threads={args.workers}, device_id=None)`, "
        "through `DALIGenericIterator(..., reader_name='reader', last_batch_policy=PARTIAL)`; "
        "nothing verified, labels not read (a tar `cls` member is ASCII of varying length).",
        "- webdataset: `WebDataset(<tars>, shardshuffle=False).map(packed_sample)"
        ".batched(B, collation_fn=default_collate)` in `DataLoader(batch_size=None, "
        f"num_workers={args.workers})` (each worker reads its share of the shards in order).",
        "- loose files: a map-style Dataset over the tree (walked once; `open().read()` then "
        f"`decode_crop`), `DataLoader(batch_size=B, shuffle=True, num_workers={args.workers})`.",
        "",
        "Each configuration is its own child process; runs are round-robin over the "
        f"configurations, {args.repeat_cold} cold then {args.repeat_warm} warm rounds "
        f"interleaved (cold: shardio and loose files only); {cache_line}. Warm runs follow a "
        "read of all the files the configuration reads. Before every run "
        f"{data.backed_bytes / 2**30:.1f} GiB of memory is touched and freed (after the drop "
        "for cold runs; see `back_free_memory` in benchmarks/common.py). Time = building "
        "the dataset and loader + the epoch, from after the imports until the workers have "
        "exited. CPU = `getrusage(RUSAGE_SELF)` + `getrusage(RUSAGE_CHILDREN)` (the reaped "
        "workers) over the same interval, user + system; cores busy = CPU s / s; images/s "
        "per core used = images/s divided by the processes or threads that decode and batch "
        "(2 workers or 2 DALI threads, plus the training process; shardio.dali's read thread "
        "shares the training process's interpreter and is not counted); images per "
        "CPU-second = images / CPU s, whatever ran. This machine has "
        f"{os.cpu_count()} CPUs, so 3 busy processes share 2 cores and cores busy cannot "
        "exceed 2. Others' CPU = the machine's busy CPU time (/proc/stat) during the child's "
        "life minus the child's own (`wait4`), over its wall: the cores other processes took "
        "from the run (other sessions share this machine; a run with others' CPU near 1 had "
        "half the machine). Images per CPU-second is the figure least moved by that load. "
        f"Before each run the script waits (up to {args.quiet_wait:g} s) for less than 0.3 "
        "cores busy over one second. "
        f"Load average before / after: {info['load'][0]} / {info['load'][1]}; measuring took "
        f"{info['elapsed']:.0f} s.",
        "",
        "### Warm cache",
        "",
        warm_table,
        "",
        "### Cold cache",
        "",
        cold_table,
        "",
        "### Checks",
        "",
        checks_table,
        "",
        "Not measured here: DALI's `mixed` (GPU, nvJPEG) decoding and the GPU prefetcher rows "
        "need a GPU machine, and no GPU was lent to this task.",
    ]
    if notes:
        parts += ["", "Notes:", "", *notes]
    parts += [
        "",
        "Raw runs (measured s / CPU s / process wall s / others' CPU in cores), in run order:",
        "",
        *raw,
        "",
        "Reproduce (root, for drop_caches):",
        "",
        "```",
        shlex.join(argv),
        "```",
        "",
        "Each child (PACK = the tar pack, TREE = the generated tree):",
        "",
        "```",
        *children,
        "```",
    ]
    return "\n".join(parts)


# --------------------------------------------------------------------------------------------
# Main.
# --------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """Run the decode benchmark and update RESULTS.md."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_child"]:
        return _child(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=5000)
    parser.add_argument("--mean-kb", type=float, default=110.0)
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--repeat-warm", type=int, default=3)
    parser.add_argument("--repeat-cold", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shard-size", default="20MiB")
    parser.add_argument(
        "--quiet-wait",
        type=float,
        default=30.0,
        help="before each run, wait up to this many seconds for the machine to be idle",
    )
    parser.add_argument("--workdir", default=os.path.join(REPO, ".bench"))
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "RESULTS.md"))
    parser.add_argument(
        "--only", default="", help=f"comma-separated configuration names ({', '.join(BY_NAME)})"
    )
    parser.add_argument("--regen", action="store_true", help="regenerate the tree and the pack")
    parser.add_argument("--no-write", action="store_true", help="do not update RESULTS.md")
    args = parser.parse_args(argv)
    args.workdir = os.path.abspath(args.workdir)
    os.makedirs(args.workdir, exist_ok=True)
    common.hold_bench_lock(args.workdir)

    jobs = list(JOBS)
    jobs = common.select_named(parser, args.only, jobs)
    try:
        from nvidia.dali import __version__ as dali_version
    except Exception:
        dali_version = "not installed"

    src = common.ensure_tree(
        REPO,
        args.workdir,
        files=args.files,
        classes=args.classes,
        mean_kb=args.mean_kb,
        regen=args.regen,
    )
    data = _prepare(args, src)
    outcomes = [Outcome(j) for j in jobs]

    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    load_before = common.loadavg()
    code_before = common.code_state(REPO)
    t0 = time.perf_counter()
    cold_ok = [True]
    for rnd in range(max(args.repeat_warm, args.repeat_cold)):
        for cache, repeat in (("cold", args.repeat_cold), ("warm", args.repeat_warm)):
            if rnd >= repeat:
                continue
            for o in outcomes:
                if o.status == "ok" and cache in o.job.caches:
                    _measure(o, cache, data, args, cold_ok)
    elapsed = time.perf_counter() - t0
    print(f"measured in {elapsed:.0f} s", file=sys.stderr)
    info = {
        "started": started,
        "load": (load_before, common.loadavg()),
        "elapsed": elapsed,
        "cold": cold_ok[0],
        "code": common.code_line(code_before, common.code_state(REPO), "decode"),
        "dali_version": dali_version,
    }
    body = _report(outcomes, data, args, info)
    common.publish(body, SECTION, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
