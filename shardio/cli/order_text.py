"""Shuffle quality as ``shardio inspect --order``/``--orders`` and ``shardio bench`` print it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardio.units import format_size

if TYPE_CHECKING:
    from shardio.order.quality import QualityReport
    from shardio.tools.shuffle import OrderComparison

__all__ = ["comparison_text", "report_text"]

_LEGEND = (
    "entropy: label entropy per batch over the dataset's (1.00: as mixed as the dataset),",
    "  mean (5th percentile); shards/batch, /window: distinct shards read by a batch and by",
    "  {window} consecutive batches; switches: shard changes between consecutive samples per",
    "  batch (0: sequential reads); rho: delivery vs storage order (1: sequential, about 0:",
    "  shuffled); memory: what the order holds (computed position by position);",
    "  partition=node: random within each node's shards, one rank per node",
)


def _entropy(report: QualityReport) -> str:
    if report.label_entropy is None or report.label_entropy_p5 is None:
        return "no labels"
    return f"{report.label_entropy:.2f} ({report.label_entropy_p5:.2f})"


def _rho(report: QualityReport) -> str:
    return "n/a" if report.rho is None else f"{report.rho:.3f}"


def _measured(report: QualityReport) -> str:
    if report.sampled:
        return f"{report.batches_measured:,} of {report.batches:,} batches measured (sampled)"
    return f"all {report.batches:,} batches measured"


def report_text(report: QualityReport, batch_size: int) -> list[str]:
    """The lines of one order's quality (``inspect --order``)."""
    nodes = f" on {report.nodes} nodes, one rank each" if report.nodes else ""
    lines = [
        f"order          {report.order}{nodes}",
        f"epoch          {report.epoch}, batches of {batch_size:,}: {_measured(report)}",
    ]
    if report.label_entropy is None or report.label_entropy_p5 is None:
        lines.append("label entropy  no labels")
    else:
        lines.append(
            f"label entropy  {report.label_entropy:.2f} of the dataset's per batch "
            f"(p5 {report.label_entropy_p5:.2f}; 1.00 = as mixed as the dataset)"
        )
        if report.entropy_ceiling is not None and report.entropy_ceiling < 0.995:
            lines.append(
                f"               a batch of {batch_size:,} holds at most "
                f"{report.entropy_ceiling:.2f}: more classes than it has samples"
            )
    lines += [
        f"shards         {report.shards_per_batch:.2f} distinct per batch (min "
        f"{report.shards_per_batch_min}), {report.shards_per_window:.2f} per window of "
        f"{report.window_batches} batches",
        f"shard switches {report.switches_per_batch:.2f} per batch (0: sequential reads)",
        f"storage order  rho={_rho(report)} (1: sequential, about 0: shuffled)",
    ]
    if report.memory_bytes is not None:
        array = ""
        if report.epoch_samples:
            array = f"; as an array {format_size(8 * report.epoch_samples)}"
        lines.append(
            f"memory         {format_size(report.memory_bytes)} (computed position by "
            f"position{array})"
        )
    return lines


def comparison_text(found: OrderComparison, batch_size: int, epoch: int) -> list[str]:
    """The standard orders side by side (``inspect --orders``)."""
    classes = f"{found.classes} classes" if found.classes else "no labels"
    lines = [
        f"orders of {found.path}: {found.samples:,} samples in {found.shards:,} shards, "
        f"{classes}; epoch {epoch}, batches of {batch_size:,}",
        f"{'order':<25}{'entropy (p5)':<13}{'shards/batch':>12}{'/window':>8}"
        f"{'switches':>9}{'rho':>8}{'memory':>9}",
    ]
    window = 0
    for name, r in found.reports:
        label = f"{name}, {found.nodes} nodes" if r.nodes else name
        memory = format_size(r.memory_bytes) if r.memory_bytes is not None else "-"
        lines.append(
            f"{label:<25}{_entropy(r):<13}{r.shards_per_batch:>12.2f}"
            f"{r.shards_per_window:>8.2f}{r.switches_per_batch:>9.2f}{_rho(r):>8}{memory:>9}"
        )
        window = r.window_batches
    sampled = [r for _, r in found.reports if r.sampled]
    if sampled:
        lines.append(f"({_measured(sampled[0])} per order)")
    lines += [line.format(window=window) for line in _LEGEND]
    return lines
