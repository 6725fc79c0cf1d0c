"""What a mix is made of: its sources told apart, its id, and its saved state checked.

A :class:`~shardio.runtime.mixed.MixedDataset` is one dataset to the model, so its sources
must be distinct datasets (:func:`refuse_repeats`), its id (:func:`mix_dataset_id`) stands
for its seed, sources, weights and label map, and its position (:class:`MixPosition`, the
mix's cursor) saves what the mix is made of with it and refuses a state of another mix.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import xxhash

from shardio.errors import UsageError
from shardio.order.mix import MixCursor
from shardio.order.spec import OrderSpec
from shardio.runtime.labels import described

if TYPE_CHECKING:
    from shardio.runtime.dataset import ShardDataset

__all__ = ["MIXED_STATE_VERSION", "MixMakeup", "MixPosition", "mix_dataset_id", "refuse_repeats"]

MIXED_STATE_VERSION = 1


class MixMakeup(Protocol):
    """What a mix is made of (MixedDataset has it)."""

    @property
    def sources(self) -> tuple[ShardDataset, ...]: ...

    @property
    def source_names(self) -> tuple[str, ...]: ...

    @property
    def weights(self) -> tuple[float, ...]: ...

    @property
    def counts(self) -> tuple[int, ...]: ...

    @property
    def seed(self) -> int: ...

    @property
    def classes(self) -> tuple[str, ...] | None: ...

    @property
    def remaps_labels(self) -> bool: ...


class MixPosition(MixCursor):
    """The mix's cursor, whose state is the mix's: what it is made of goes along, and is
    checked when a state is loaded (what a loader's ``state_dict`` gives)."""

    def __init__(self, spec: OrderSpec, total: int, mix: MixMakeup) -> None:
        super().__init__(spec, total, [ds.cursor for ds in mix.sources])
        self.mix = mix

    def state(self) -> dict[str, Any]:
        mix = self.mix
        return {
            "version": MIXED_STATE_VERSION,
            "kind": "mixed",
            "sources": _identity(mix),
            "cursor": super().state(),
            "classes": list(mix.classes) if mix.classes is not None else None,
        }

    def load(self, state: Mapping[str, Any]) -> None:
        _check_state(self.mix, state)
        super().load(state.get("cursor"))  # type: ignore[arg-type]


def refuse_repeats(datasets: Sequence[ShardDataset]) -> None:
    """Refuse a dataset given twice (as two objects, a recovering copy, a staging area of it
    or a byte-for-byte copy): its samples would be drawn twice an epoch.

    Raises:
        UsageError: naming both sources and the dataset.
    """
    seen: list[tuple[str | None, str]] = []
    for s, ds in enumerate(datasets):
        resolver = ds.packed.resolver
        ident = resolver.identity()
        real = os.path.realpath(resolver.source_root)
        for t, (other_id, other_real) in enumerate(seen):
            if (
                ident.dataset_id is not None and ident.dataset_id == other_id
            ) or real == other_real:
                raise UsageError(
                    f"source {s} of the mix is the same dataset as source {t} "
                    f"({ident.describe()}): its samples would be drawn twice an epoch; give "
                    "each dataset once, with the sum of its weights"
                )
        seen.append((ident.dataset_id, real))


def mix_dataset_id(mix: MixMakeup) -> str | None:
    """The xxh3-128 of the mix's seed, its sources' dataset ids and weights, and the label
    map given as ``classes=``; None when a source's id is unknown."""
    parts = [
        (ds.packed.resolver.dataset_id, weight)
        for ds, weight in zip(mix.sources, mix.weights, strict=True)
    ]
    if not all(isinstance(found, str) for found, _ in parts):
        return None
    what: list[Any] = ["mix", mix.seed, parts]
    if mix.remaps_labels:  # (the id of a mix without classes= is unchanged)
        what.append(list(mix.classes or ()))
    return xxhash.xxh3_128_hexdigest(json.dumps(what).encode())


def _identity(mix: MixMakeup) -> list[dict[str, Any]]:
    """Each source as a state records it (plain values)."""
    return [
        {
            "name": name,
            "weight": weight,
            "draws": count,
            "num_samples": ds.num_samples,
            "spec": ds.spec.to_dict(),
            "dataset_id": ds.packed.resolver.dataset_id,
        }
        for name, weight, count, ds in zip(
            mix.source_names, mix.weights, mix.counts, mix.sources, strict=True
        )
    ]


def _check_state(mix: MixMakeup, state: Mapping[str, Any]) -> None:
    """Refuse a state of another mix (see ``MixedDataset.load_state_dict``)."""
    if not isinstance(state, Mapping) or state.get("kind") != "mixed":
        raise UsageError("not the state of a MixedDataset (no 'kind': 'mixed')")
    if state.get("version") != MIXED_STATE_VERSION:
        raise UsageError(f"unsupported MixedDataset state version {state.get('version')!r}")
    saved = state.get("sources")
    mine = _identity(mix)
    if not isinstance(saved, list) or len(saved) != len(mine):
        raise UsageError(
            f"state was saved for a mix of {len(saved) if isinstance(saved, list) else '?'} "
            f"sources, this mix has {len(mine)}: cannot resume"
        )
    for s, (theirs, ours) in enumerate(zip(saved, mine, strict=True)):
        if not isinstance(theirs, Mapping):
            raise UsageError(f"state 'sources'[{s}] must be a dict")
        differ = [
            k
            for k in ours
            if k != "name" and theirs.get(k) != ours[k] and not _unknown_id(k, theirs, ours)
        ]
        if differ:
            raise UsageError(
                f"state was saved for another mix: source {s} differs in "
                f"{', '.join(differ)}: cannot resume"
            )
    mine_classes = list(mix.classes) if mix.classes is not None else None
    if "classes" in state and state["classes"] != mine_classes:  # absent: an older state
        raise UsageError(
            "state was saved for a mix whose labels mean other classes "
            f"({described(state['classes'])}; this mix: {described(mine_classes)}): "
            "cannot resume"
        )


def _unknown_id(key: str, theirs: Mapping[str, Any], ours: Mapping[str, Any]) -> bool:
    """A dataset id that one side could not tell (None) does not count as a difference."""
    return key == "dataset_id" and (theirs.get(key) is None or ours[key] is None)
