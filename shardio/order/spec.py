"""OrderSpec: the one frozen description of the sample order, shared by every part of a job.

ShardDataset, the loader's state dict, ``shardio stage``, the CLI and the job scripts take the
same spec with the same defaults, so a staged node cache and the training job that reads it
cannot disagree unless the user asks for it (``stage`` records the spec in its plan; a dataset
that reads the area with another spec says so). Written as a string for the command line and
job scripts::

    random                               the defaults, with order random
    order=shard-local,seed=7,window=4,partition=node,drop_last=1
    order=random,partition=rotating,rotate=0.25

Fields:
    order       ``random`` (default), ``shard-local`` or ``sequential``
                (:mod:`shardio.order.orders`); ``shuffle=False`` means sequential.
    seed        the order is a pure function of (seed, epoch): an integer in [0, 2**64).
    window      shards per shuffle window of ``shard-local`` (default 4).
    partition   ``none`` (default): every rank reads from the whole dataset (ranks take
                interleaved positions of one global order). ``node``: shards are dealt to
                nodes once, by a seeded, sample-balanced partition, and each node's ranks read
                only their node's shards (shuffled every epoch), so a node stages about 1/N of
                the dataset. ``rotating``: as ``node``, and every epoch a fraction ``rotate``
                of each node's shards changes owner (better mixing; the stager fetches the
                next epoch's shards ahead).
    rotate      for ``rotating``: the share of each node's shards that moves per epoch.
    drop_last   cut each rank's epoch to equal counts instead of padding by repeating.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from shardio._check import require_int
from shardio.errors import UsageError

__all__ = [
    "MODE_ORDERS",
    "ORDERS",
    "PARTITIONS",
    "SEED_LIMIT",
    "resolve_spec",
    "OrderSpec",
    "check_order",
    "default_order",
]

ORDERS = ("random", "shard-local", "sequential")
PARTITIONS = ("none", "node", "rotating")
SEED_LIMIT = 2**64
# The one default order per ShardDataset mode: map-style random access reads anywhere anyway;
# streaming keeps its reads within a few shards.
MODE_ORDERS = {"map": "random", "stream": "shard-local"}
_KEYS = {
    "order": "order",
    "seed": "seed",
    "window": "window_shards",
    "window_shards": "window_shards",
    "partition": "partition",
    "rotate": "rotate",
    "drop_last": "drop_last",
}


def check_order(order: str) -> None:
    """Raise UsageError unless ``order`` is one of ORDERS."""
    if order not in ORDERS:
        raise UsageError(f"invalid order {order!r}: choose one of {', '.join(ORDERS)}")


def default_order(mode: str = "map") -> str:
    """The default order of ``mode`` ("map" or "stream"): the same for stage and training."""
    if mode not in MODE_ORDERS:
        raise UsageError(f"invalid mode {mode!r}: choose one of {', '.join(MODE_ORDERS)}")
    return MODE_ORDERS[mode]


def _whole(value: object, what: str, least: int, limit: int | None = None) -> int:
    """``value`` as an int in [least, limit) (the one checker, naming the spec)."""
    top = limit - 1 if limit is not None else None
    return require_int(value, f"order spec: {what}", minimum=least, maximum=top)


@dataclass(frozen=True, kw_only=True)
class OrderSpec:
    """How samples are ordered and shared out, epoch after epoch (see the module docstring).

    Raises:
        UsageError: a field is out of range.
    """

    order: str = "random"
    seed: int = 0
    window_shards: int = 4
    partition: str = "none"
    rotate: float = 0.25
    drop_last: bool = False

    def __post_init__(self) -> None:
        if self.order not in ORDERS:
            raise UsageError(f"invalid order {self.order!r}: choose one of {', '.join(ORDERS)}")
        if self.partition not in PARTITIONS:
            raise UsageError(
                f"invalid partition {self.partition!r}: choose one of {', '.join(PARTITIONS)}"
            )
        object.__setattr__(self, "seed", _whole(self.seed, "seed", 0, SEED_LIMIT))
        object.__setattr__(self, "window_shards", _whole(self.window_shards, "window", 1))
        rotate = self.rotate
        if (
            isinstance(rotate, bool)
            or not isinstance(rotate, int | float)
            or not math.isfinite(rotate)
            or not 0.0 <= rotate <= 1.0
        ):
            raise UsageError(f"order spec: rotate must be a fraction in [0, 1], got {rotate!r}")
        object.__setattr__(self, "rotate", float(rotate))
        if not isinstance(self.drop_last, bool):
            raise UsageError(f"order spec: drop_last must be a bool, got {self.drop_last!r}")

    @property
    def partitioned(self) -> bool:
        """Whether ranks read only their node's shards (``node`` or ``rotating``)."""
        return self.partition != "none"

    def with_(self, **changes: Any) -> OrderSpec:
        """A copy with ``changes`` (checked)."""
        return replace(self, **changes)

    # -- text (command line, job scripts) ------------------------------------------------
    @classmethod
    def parse(cls, text: str, base: OrderSpec | None = None) -> OrderSpec:
        """The spec ``text`` describes, over ``base`` (the defaults by default).

        ``text`` is an order name, or comma-separated ``key=value`` pairs (keys: order,
        seed, window, partition, rotate, drop_last).

        Raises:
            UsageError: an unknown key or a bad value.
        """
        spec = base if base is not None else cls()
        text = text.strip()
        if not text:
            return spec
        if "=" not in text and "," not in text:
            return spec.with_(order=text)
        changes: dict[str, Any] = {}
        for item in text.split(","):
            key, sep, value = item.partition("=")
            key, value = key.strip(), value.strip()
            if not sep or key not in _KEYS:
                raise UsageError(
                    f"order spec {text!r}: {item!r} is not one of "
                    "order=, seed=, window=, partition=, rotate=, drop_last="
                )
            changes[_KEYS[key]] = _parse_value(_KEYS[key], value, text)
        return spec.with_(**changes)

    def __str__(self) -> str:
        parts = [
            f"order={self.order}",
            f"seed={self.seed}",
            f"window={self.window_shards}",
            f"partition={self.partition}",
        ]
        if self.partition == "rotating":
            parts.append(f"rotate={self.rotate:g}")
        parts.append(f"drop_last={int(self.drop_last)}")
        return ",".join(parts)

    # -- JSON (state dicts, staging plans) ---------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The spec as JSON-ready values."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: object) -> OrderSpec:
        """The spec :meth:`to_dict` wrote.

        Raises:
            UsageError: not such a dict.
        """
        if not isinstance(data, Mapping):
            raise UsageError(f"order spec must be a dict, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise UsageError(f"order spec: unknown keys {sorted(map(str, unknown))}")
        try:
            return cls(**{str(k): v for k, v in data.items()})
        except TypeError as exc:
            raise UsageError(f"order spec: {exc}") from exc

    def differences(self, other: OrderSpec) -> list[str]:
        """``field: this != other`` for each field that differs (what a mismatch reports)."""
        out = []
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if f.name == "rotate" and "rotating" not in (self.partition, other.partition):
                continue
            if mine != theirs:
                out.append(f"{f.name} {mine!r} != {theirs!r}")
        return out


def _parse_value(field: str, value: str, text: str) -> Any:
    try:
        if field in ("seed", "window_shards"):
            return int(value, 0)
        if field == "rotate":
            return float(value)
        if field == "drop_last":
            lowered = value.lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
    except ValueError:
        raise UsageError(f"order spec {text!r}: bad value {value!r} for {field}") from None
    return value


def resolve_spec(
    mode: str,
    order: str | OrderSpec | None,
    *,
    shuffle: bool = True,
    seed: int | None = None,
    window_shards: int | None = None,
    drop_last: bool | None = None,
) -> OrderSpec:
    """The order spec of a reader's arguments (ShardDataset's, DALI's): ``order`` as a spec,
    a spec string (``"order=random,partition=node"``) or None (the mode's default order),
    with the loose ``seed``, ``window_shards`` and ``drop_last`` over OrderSpec's defaults;
    ``shuffle=False`` reads in sequential order.

    Raises:
        UsageError: a value is invalid, or a loose value is given beside an OrderSpec.
    """
    if mode not in MODE_ORDERS:
        raise UsageError(f"invalid mode {mode!r}: choose one of {', '.join(MODE_ORDERS)}")
    loose = {"seed": seed, "window_shards": window_shards, "drop_last": drop_last}
    given: dict[str, Any] = {k: v for k, v in loose.items() if v is not None}
    if isinstance(order, OrderSpec):
        if given:
            raise UsageError(
                f"give {', '.join(sorted(given))} in the OrderSpec, not beside it "
                f"(OrderSpec(..., {next(iter(sorted(given)))}=...))"
            )
        spec = order
    elif order is not None and not isinstance(order, str):
        raise UsageError(
            f"order must be an order name, a spec string or an OrderSpec, got "
            f"{type(order).__name__}"
        )
    else:
        if "seed" in given:
            given["seed"] = require_int(given["seed"], "seed", minimum=0)
            if given["seed"] >= SEED_LIMIT:
                raise UsageError(f"seed must be below 2**64, got {given['seed']}")
        if "window_shards" in given:
            given["window_shards"] = require_int(given["window_shards"], "window_shards", minimum=1)
        if "drop_last" in given:
            given["drop_last"] = bool(given["drop_last"])
        base = OrderSpec(order=default_order(mode), **given)
        spec = OrderSpec.parse(order, base) if isinstance(order, str) else base
    if not shuffle:
        spec = spec.with_(order="sequential")
    return spec
