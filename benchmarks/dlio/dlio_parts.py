"""The parts of the DLIO benchmark that need no DLIO: scaled workloads, keys, parsing, tables.

benchmarks/dlio/run.py (the runner) and benchmarks/dlio/shardio_reader.py (the plug-in that
DLIO loads) share these; tests/unit/test_bench_dlio.py checks them without dlio-benchmark.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DATASET_ENV",
    "WORKLOADS",
    "DlioFigures",
    "RunRecord",
    "Workload",
    "dlio_overrides",
    "member_bytes",
    "parse_file",
    "read_summary",
    "render_tables",
    "sample_key",
    "take_sample",
]

# The directory holding one shardio dataset per DLIO split (``train/``, ``valid/``); set by
# the runner for the plug-in, which runs in DLIO's DataLoader workers.
DATASET_ENV = "SHARDIO_DLIO_DATASET"

# DLIO's formats whose files the plug-in parses as DLIO's own reader of that format does.
FORMATS = ("jpeg", "png", "npz", "hdf5")


@dataclass(frozen=True, kw_only=True)
class Workload:
    """One DLIO workload as run here: DLIO's config, scaled to a 2-core machine.

    ``config`` is the workload file shipped with dlio-benchmark 2.0.0 (``workload=NAME``);
    every other field is a ``++workload...`` override; ``scaling`` says what changed and why.
    """

    name: str
    config: str
    fmt: str
    files: int
    record_length: int
    record_length_stdev: int
    record_length_resize: int
    batch_size: int
    computation_time_s: float
    scaling: str

    def __post_init__(self) -> None:
        if self.fmt not in FORMATS:
            raise ValueError(f"workload {self.name}: unknown format {self.fmt!r}")
        if self.files < 1 or self.batch_size < 1 or self.record_length < 1:
            raise ValueError(f"workload {self.name}: files, batch size, record length >= 1")
        if not self.computation_time_s >= 0:
            raise ValueError(f"workload {self.name}: computation time must be >= 0")


# resnet50_a100.yaml: batch 400, 0.435 s per batch (1.09 ms per sample), tfrecord read by
# TensorFlow, 1,251 samples of ~114.7 KB per file. unet3d_a100.yaml: batch 7, 0.636 s per
# batch, one npz sample per file of 146.6 MB (stdev 68.3 MB), resized to 2 MiB.
_UNET3D_SCALE = 1024**2 / 146600628  # samples of 1 MiB instead of 146.6 MB

WORKLOADS: dict[str, Workload] = {
    "resnet50": Workload(
        name="resnet50",
        config="resnet50_a100",
        fmt="jpeg",
        files=2048,
        record_length=114660,
        record_length_stdev=0,
        record_length_resize=150528,
        batch_size=32,
        computation_time_s=round(0.435 * 32 / 400, 6),
        scaling=(
            "`resnet50_a100`: JPEG files of one 114.7 KB sample each read by PyTorch "
            "(the config's tfrecord needs TensorFlow), 2,048 samples (not 1,024 x 1,251), "
            "batch 32 (not 400) with the computation time per batch scaled by 32/400 to "
            "0.0348 s (the same 1.09 ms per sample as on an A100)"
        ),
    ),
    "unet3d": Workload(
        name="unet3d",
        config="unet3d_a100",
        fmt="npz",
        files=512,
        record_length=1024**2,
        record_length_stdev=round(68341808 * _UNET3D_SCALE),
        record_length_resize=round(2097152 * _UNET3D_SCALE),
        batch_size=7,
        computation_time_s=round(0.636 * _UNET3D_SCALE, 6),
        scaling=(
            "`unet3d_a100`: 512 npz samples of 1 MiB (stdev 0.47 MiB) instead of 168 of "
            "146.6 MB (stdev 68.3 MB); batch 7 as in the config; the computation time per "
            "batch (0.636 s), the stdev and `record_length_resize` scaled by the same "
            f"1/{1 / _UNET3D_SCALE:.0f} (0.00455 s per batch: the same time per byte)"
        ),
    ),
}


def dlio_overrides(
    w: Workload,
    data_folder: str,
    *,
    read_threads: int,
    computation_time_s: float | None = None,
    reader_classname: str | None = None,
    generate: bool = False,
    output_dir: str | None = None,
) -> list[str]:
    """The DLIO command-line overrides of one run (or of the data generation)."""
    if read_threads < 0:
        raise ValueError(f"read_threads must be >= 0, not {read_threads}")
    compute = w.computation_time_s if computation_time_s is None else computation_time_s
    args = [
        f"workload={w.config}",
        "++workload.framework=pytorch",
        "++workload.reader.data_loader=pytorch",
        f"++workload.dataset.format={w.fmt}",
        f"++workload.dataset.data_folder={data_folder}",
        f"++workload.dataset.num_files_train={w.files}",
        "++workload.dataset.num_files_eval=0",
        "++workload.dataset.num_samples_per_file=1",
        f"++workload.dataset.record_length={w.record_length}",
        f"++workload.dataset.record_length_stdev={w.record_length_stdev}",
        f"++workload.dataset.record_length_resize={w.record_length_resize}",
        f"++workload.reader.batch_size={w.batch_size}",
        f"++workload.reader.read_threads={read_threads}",
        f"++workload.train.computation_time={compute}",
        "++workload.train.epochs=1",
        "++workload.workflow.checkpoint=False",
        "++workload.workflow.evaluation=False",
        f"++workload.workflow.generate_data={generate}",
        f"++workload.workflow.train={not generate}",
    ]
    if reader_classname:
        args.append(f"++workload.reader.reader_classname={reader_classname}")
    if output_dir:
        args.append(f"hydra.run.dir={output_dir}")
    return args


def sample_key(split_dir: str, filename: str) -> str:
    """The shardio key of a DLIO file: its path under the split's directory, no extension.

    ``shardio pack DATA/train OUT --labels none`` keys ``DATA/train/img_3_of_8.npz`` as
    ``img_3_of_8`` (the member is named ``npz``).
    """
    rel = os.path.relpath(os.path.normpath(filename), os.path.normpath(split_dir))
    if rel == "." or rel.startswith(".." + os.sep) or rel == ".." or os.path.isabs(rel):
        raise ValueError(f"{filename}: not a file under DLIO's split directory {split_dir}")
    stem, _ext = os.path.splitext(rel)
    return stem


def member_bytes(sample: dict[str, Any], key: str) -> bytes | memoryview:
    """The one payload of a shardio sample read for DLIO file ``key``, its key checked."""
    got = sample.get("__key__")
    if got != key:
        raise ValueError(f"{key}: shardio returned sample {got!r} instead")
    payload = [v for k, v in sample.items() if not k.startswith("__")]
    if len(payload) != 1:
        raise ValueError(f"{key}: {len(payload)} members; a DLIO file packs as exactly one")
    data = payload[0]
    if not isinstance(data, (bytes, memoryview)):
        raise ValueError(f"{key}: member is {type(data).__name__}, not bytes (decode=None)")
    return data


def parse_file(fmt: str, data: bytes | memoryview) -> Any:
    """A DLIO file's bytes parsed as DLIO 2.0.0's own reader of ``fmt`` parses the file.

    JPEG/PNG: ``np.asarray(PIL.Image.open(...))`` (ImageReader.open); npz: the ``x`` array
    (NPZReader.open; without pickles); HDF5: the open ``h5py.File`` (HDF5Reader.open).
    """
    buf = io.BytesIO(data)
    if fmt in {"jpeg", "png"}:
        import numpy as np
        from PIL import Image

        return np.asarray(Image.open(buf))
    if fmt == "npz":
        import numpy as np

        with np.load(buf, allow_pickle=False) as npz:
            return npz["x"]
    if fmt == "hdf5":
        import h5py

        return h5py.File(buf, "r")
    raise ValueError(f"format {fmt!r}: the plug-in reads {', '.join(FORMATS)}")


def take_sample(fmt: str, parsed: Any, sample_index: int) -> Any:
    """Sample ``sample_index`` of a parsed file, as DLIO's reader's ``get_sample`` takes it."""
    if fmt in {"jpeg", "png"}:
        return parsed  # one image per file
    if fmt == "npz":
        return parsed[..., sample_index]
    if fmt == "hdf5":
        return parsed["records"][sample_index]
    raise ValueError(f"format {fmt!r}: the plug-in reads {', '.join(FORMATS)}")


@dataclass(frozen=True)
class DlioFigures:
    """What DLIO reports for a run in its ``summary.json``."""

    au_percent: float
    samples_per_s: float
    io_mb_per_s: float
    au_expectation: str


def read_summary(path: str) -> DlioFigures:
    """The training figures of DLIO's ``summary.json`` (means over the run's epochs)."""
    try:
        with open(path, encoding="utf-8") as fh:
            metric = json.load(fh)["metric"]
        return DlioFigures(
            au_percent=float(metric["train_au_mean_percentage"]),
            samples_per_s=float(metric["train_throughput_mean_samples_per_second"]),
            io_mb_per_s=float(metric["train_io_mean_MB_per_second"]),
            au_expectation=str(metric.get("train_au_meet_expectation", "")),
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not a DLIO summary ({type(exc).__name__}: {exc})") from exc


@dataclass(frozen=True, kw_only=True)
class RunRecord:
    """One DLIO run of the runner: where, which reader, and what it measured."""

    workload: str
    fs: str  # "local" or "bed"
    reader: str  # "dlio", "shardio" or "null"
    compute: bool  # the scaled computation time (True) or none (I/O bound)
    figures: DlioFigures | None
    wall_s: float
    cpu_s: float
    mds_requests: int | None  # master.packets_sent during the run (bed only)
    error: str = ""


READER_LABELS = {
    "dlio": "DLIO's own reader",
    "shardio": "shardio plug-in (ShardDataset, verified)",
    "null": "no I/O (preallocated sample)",
}


def _find(
    runs: Sequence[RunRecord], workload: str, fs: str, reader: str, compute: bool
) -> RunRecord | None:
    for r in runs:
        if (r.workload, r.fs, r.reader, r.compute) == (workload, fs, reader, compute):
            return r
    return None


def render_tables(runs: Sequence[RunRecord], samples: dict[str, int]) -> str:
    """One markdown table per workload: every run of this invocation, with the ratios to
    DLIO's own reader (samples/s) and to DLIO with no I/O at all (its own cost)."""
    out: list[str] = []
    for workload in dict.fromkeys(r.workload for r in runs):
        n = samples[workload]
        null = _find(runs, workload, "local", "null", False)
        floor = null.figures.samples_per_s if null and null.figures else 0.0
        out += [
            f"**{workload}** ({n:,} samples, one epoch, cold: caches dropped before each run)",
            "",
            "| filesystem | reader | computation | samples/s | AU % | MB/s (DLIO) "
            "| vs DLIO's reader | vs no I/O | CPU s / 1k samples | MDS requests / 1k samples "
            "| wall s |",
            "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in (r for r in runs if r.workload == workload):
            comp = "scaled" if r.compute else "none"
            if r.figures is None:
                out.append(
                    f"| {r.fs} | {READER_LABELS[r.reader]} | {comp} | failed: {r.error} "
                    "| | | | | | | |"
                )
                continue
            f = r.figures
            peer = _find(runs, workload, r.fs, "dlio", r.compute)
            vs_dlio = (
                f"{f.samples_per_s / peer.figures.samples_per_s:.2f}x"
                if peer and peer.figures and r.reader != "dlio"
                else "-"
            )
            vs_null = f"{f.samples_per_s / floor:.2f}x" if floor and r.reader != "null" else "-"
            mds = "-" if r.mds_requests is None else f"{r.mds_requests * 1000 / n:.1f}"
            out.append(
                f"| {r.fs} | {READER_LABELS[r.reader]} | {comp} | {f.samples_per_s:,.0f} "
                f"| {f.au_percent:.1f} | {f.io_mb_per_s:,.1f} | {vs_dlio} | {vs_null} "
                f"| {r.cpu_s * 1000 / n:.2f} | {mds} | {r.wall_s:.1f} |"
            )
        if floor:
            out += [
                "",
                f"DLIO's own cost here: {floor:,.0f} samples/s with no I/O and no computation "
                f"({1e6 / floor:,.0f} µs per sample of DLIO's loop, DataLoader workers and "
                "collation of the resized sample).",
            ]
        out.append("")
    return "\n".join(out).rstrip() + "\n"
