"""The epoch cursor: where one rank stands in an epoch, and its versioned, validated state.

Torch-free. An :class:`EpochCursor` holds the order spec, the shards' sizes, the rank layout
(given, or detected when asked), the epoch and the global positions of the epoch delivered
so far, with the layouts an elastic resume went through. It is the one owner of the
position: ShardDataset's direct iteration and ShardLoader advance it as they hand samples to
the training loop, and its :meth:`state` is what they save. :meth:`stream` gives the rest of
this rank's epoch (lazily, chunk by chunk).

The state (a dict of plain values) is versioned: version 1 (an older shardio, whose orders
were computed otherwise) loads at an epoch boundary or in sequential order, where both
agree; versions 2 and 3 load except mid-epoch of a node partition (``node`` or ``rotating``),
whose node shares the rendezvous deal of version 4 changed (:mod:`shardio.order.partition`);
version 4 is written now. It records the layout's node names (``node_keys``: SLURM's hosts,
or null for numbered nodes) and each earlier layout's, since the deal, hence what each rank
of a layout read, depends on them: a job resumed on other hosts, or on the same hosts
renumbered, takes out what every rank of each earlier layout consumed and shares the rest.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from shardio._check import require_int
from shardio.errors import UsageError
from shardio.order.ranks import RankInfo, detect_ranks
from shardio.order.spec import OrderSpec
from shardio.order.streams import EarlierLayout, RankStream, rank_stream

__all__ = ["STATE_VERSION", "EpochCursor", "parse_state"]

STATE_VERSION = 4  # 2: the order spec, ranks per node and the layouts of the epoch so far;
# 3: rotating partitions computed directly from the epoch (their owners of epoch >= 1 differ);
# 4: node partitions dealt by rendezvous over the nodes' names, recorded (every share differs)
# The integers a state holds, with the least value each may take.
_STATE_INTS = {
    "version": 0,
    "epoch": 0,
    "num_samples": 0,
    "consumed": 0,
    "world_size": 1,
    "ranks_per_node": 1,
}
_MAX_KEYS = 1 << 20  # node names a state may record (MAX_NODES of the stager)
_STREAMS_KEPT = 8  # rank streams of recent positions kept (each is cheap to rebuild)


class EpochCursor:
    """One rank's position in an epoch of an order over shards of the given sizes.

    Args:
        spec: the order.
        shard_sizes: samples per shard, in manifest order.
        ranks: the rank layout; None: detected each time it is asked (torch.distributed,
            then the launcher's environment).
    """

    def __init__(self, spec: OrderSpec, shard_sizes: Any, *, ranks: RankInfo | None = None) -> None:
        if not isinstance(spec, OrderSpec):
            raise UsageError(f"spec must be an OrderSpec, got {type(spec).__name__}")
        if ranks is not None and not isinstance(ranks, RankInfo):
            raise UsageError(f"ranks must be a RankInfo, got {type(ranks).__name__}")
        self.spec = spec
        self.shard_sizes = np.array(shard_sizes, dtype=np.int64)
        self.num_samples = int(self.shard_sizes.sum())
        self._ranks = ranks
        self.epoch = 0
        self.consumed = 0  # global positions of this epoch delivered
        self.history: list[EarlierLayout] = []  # earlier layouts of this epoch
        # This process read the epoch to its end (not saved: a state loaded at the end of an
        # epoch stays there); the next iteration reads the epoch again.
        self.ended = False
        self._streams: dict[tuple[Any, ...], RankStream] = {}
        self._order: tuple[int, np.ndarray[Any, Any]] | None = None

    def copy(self) -> EpochCursor:
        """An independent cursor at the same place."""
        other = EpochCursor(self.spec, self.shard_sizes, ranks=self._ranks)
        other.epoch, other.consumed, other.history = self.epoch, self.consumed, list(self.history)
        other.ended = self.ended
        return other

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_streams"], state["_order"] = {}, None  # rebuilt where needed
        return state

    # -- the layout and the epoch ------------------------------------------------------------
    def ranks(self) -> RankInfo:
        """The rank layout (detected at call time unless given)."""
        return self._ranks if self._ranks is not None else detect_ranks()

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch; a new epoch starts at its beginning.

        Raises:
            UsageError: ``epoch`` is not an integer >= 0.
        """
        epoch = require_int(epoch, "epoch", minimum=0)
        if epoch != self.epoch:
            self.epoch = epoch
            self.consumed = 0
            self.history = []
            self.ended = False
            self._streams.clear()

    def place(self, epoch: int, consumed: int) -> None:
        """Put the cursor at ``consumed`` positions of ``epoch`` (an epoch without elastic
        history: what a loader's persistent workers are told at each epoch's start)."""
        self.epoch = require_int(epoch, "epoch", minimum=0)
        self.consumed = require_int(consumed, "consumed", minimum=0)
        self.history = []
        self.ended = False
        self._streams.clear()

    def rewind(self) -> None:
        """Back to the start of the epoch (read it again)."""
        self.consumed = 0
        self.history = []
        self.ended = False
        self._streams.clear()

    def finish(self) -> None:
        """An iteration of this process read the rest of the epoch: the next one reads the
        epoch again (as a DataLoader does) unless :meth:`set_epoch` chooses another."""
        self.ended = True

    def begin(self) -> None:
        """At an iteration's start: an epoch this process finished is read again."""
        if self.ended:
            self.rewind()

    def advance(self, positions: int) -> None:
        """``positions`` more global positions were handed to training (a rank that
        delivers n samples moves the epoch n times the world size)."""
        self.consumed += require_int(positions, "positions", minimum=0)

    # -- what the rank reads -----------------------------------------------------------------
    def stream(self, *, consumed: int | None = None) -> RankStream:
        """What this rank reads in the rest of the epoch after ``consumed`` global positions
        (default: the cursor's), computed chunk by chunk (no array of the whole epoch)."""
        if consumed is not None:
            consumed = require_int(consumed, "consumed", minimum=0)
        done = self.consumed if consumed is None else consumed
        layout = self.ranks()
        key = (self.epoch, done, layout, tuple(self.history))
        found = self._streams.get(key)
        if found is None:
            found = rank_stream(
                self.shard_sizes, self.spec, self.epoch, layout, consumed=done,
                history=self.history,
            )  # fmt: skip
            if len(self._streams) >= _STREAMS_KEPT:
                self._streams.clear()
            self._streams[key] = found
        return found

    def samples_per_rank(self) -> int:
        """Samples each rank reads in a whole epoch (of the layout now)."""
        if not self.spec.partitioned and not self.history:
            world = self.ranks().world_size
            n = self.num_samples
            return n // world if self.spec.drop_last else -(-n // world)
        return self.stream(consumed=0).steps

    def epoch_order(self) -> np.ndarray[Any, np.dtype[np.int64]]:
        """The global sample order of the epoch, as one array (8 bytes a sample).

        Raises:
            UsageError: the order is node-partitioned: each node has an order of its own.
        """
        if self.spec.partitioned:
            raise UsageError(
                f"partition={self.spec.partition!r} has no global order: each node reads its "
                "own shards (use rank_indices() or rank_stream())"
            )
        if self._order is None or self._order[0] != self.epoch:
            whole = rank_stream(
                self.shard_sizes, self.spec.with_(drop_last=False), self.epoch, RankInfo()
            )
            self._order = (self.epoch, whole.materialise())
        return self._order[1]

    # -- state -------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """The position, as plain values (what a checkpoint saves)."""
        layout = self.ranks()
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "spec": self.spec.to_dict(),
            "num_samples": self.num_samples,
            "consumed": min(self.consumed, self.num_samples),
            "world_size": layout.world_size,
            "ranks_per_node": layout.node_size,
            "node_keys": _keys_list(layout.node_keys),
            "history": [[w, r, c, _keys_list(k)] for w, r, c, k in self.history],
        }

    def load(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state`, also with another number of ranks or nodes.

        Without a partition, the consumed prefix of the epoch's global order is done, so the
        rest is shared out among the ranks now. With a node partition, what each rank of the
        saved layout (ranks, ranks per node and node names) consumed is taken out and the rest
        shared out under the layout now (recorded in the state, so a later resume honours
        every layout of the epoch).

        Raises:
            UsageError: the state is malformed (a key missing, of the wrong type or out of
                range), of another version, or of another order or dataset size.
        """
        values = parse_state(state)
        mismatch = self.spec.differences(values["spec"])
        if mismatch:
            raise UsageError(
                f"state was saved with another order ({'; '.join(mismatch)}; this dataset, "
                "then the state): cannot resume"
            )
        if values["num_samples"] != self.num_samples:
            raise UsageError(
                f"state was saved with num_samples={values['num_samples']!r}, this dataset has "
                f"{self.num_samples!r}: cannot resume"
            )
        layout = self.ranks()
        history = [tuple(h) for h in values["history"]]
        consumed = values["consumed"]
        saved = (values["world_size"], values["ranks_per_node"], values["node_keys"])
        same = saved == (layout.world_size, layout.node_size, layout.node_keys)
        if self.spec.partitioned and not same and consumed > 0:
            history.append((saved[0], saved[1], consumed, saved[2]))
            consumed = 0
        self.epoch = values["epoch"]
        self.consumed = consumed
        self.history = history
        self.ended = False
        self._streams.clear()


def parse_state(state: object) -> dict[str, Any]:
    """The fields of a saved state, each checked for presence, type and range.

    Raises:
        UsageError: naming the first field that is wrong.
    """
    if not isinstance(state, Mapping):
        raise UsageError(f"ShardDataset state must be a dict, got {type(state).__name__}")
    if "version" not in state:
        raise UsageError("ShardDataset state lacks 'version': cannot resume")
    version = state["version"]
    if version == 1 and type(version) is int:
        state = _upgrade_v1(state)
        version = STATE_VERSION
    if type(version) is not int or version not in (2, 3, STATE_VERSION):
        raise UsageError(f"unsupported ShardDataset state version {version!r}")
    missing = [k for k in (*_STATE_INTS, "spec", "history") if k not in state]
    if missing:
        raise UsageError(f"ShardDataset state lacks {', '.join(map(repr, missing))}: cannot resume")
    values: dict[str, Any] = {
        key: require_int(state[key], f"state {key!r}", minimum=least)
        for key, least in _STATE_INTS.items()
    }
    if values["consumed"] > values["num_samples"]:
        raise UsageError(
            f"state 'consumed' is {values['consumed']}, more than its {values['num_samples']} "
            "samples"
        )
    values["spec"] = OrderSpec.from_dict(state["spec"])
    values["node_keys"] = _parse_keys(state.get("node_keys"), "state 'node_keys'")
    history = state["history"]
    if not isinstance(history, list) or not all(
        isinstance(h, list | tuple) and len(h) in (3, 4) for h in history
    ):
        raise UsageError(
            "state 'history' must be a list of [world_size, ranks_per_node, consumed, node_keys]"
        )
    values["history"] = [
        (
            require_int(h[0], "state history world_size", minimum=1),
            require_int(h[1], "state history ranks_per_node", minimum=1),
            require_int(h[2], "state history consumed", minimum=0),
            _parse_keys(h[3] if len(h) == 4 else None, "state history node_keys"),
        )
        for h in history
    ]
    for what, world, per_node, keys in [
        ("state", values["world_size"], values["ranks_per_node"], values["node_keys"]),
        *(("state history", w, r, k) for w, r, _, k in values["history"]),
    ]:
        if keys is not None and len(keys) * per_node != world:
            raise UsageError(
                f"{what} records {len(keys)} node name(s) for {world} ranks of {per_node} a "
                "node: cannot resume"
            )
    spec = values["spec"]
    mid_epoch = values["consumed"] > 0 or bool(values["history"])
    if version < STATE_VERSION and spec.partitioned and mid_epoch:
        raise UsageError(
            f"this state was saved mid-epoch (epoch {values['epoch']}) of a "
            f"partition={spec.partition} order by an older shardio, whose deal gave other node "
            "shares: resume from the start of the epoch (load it after setting its 'consumed' "
            "to 0 and 'history' to []) or finish the epoch with the older release"
        )
    return values


def _keys_list(keys: tuple[str, ...] | None) -> list[str] | None:
    return None if keys is None else list(keys)


def _parse_keys(value: object, what: str) -> tuple[str, ...] | None:
    """A state's node names: null (numbered nodes) or a list of distinct non-empty names.

    Raises:
        UsageError: anything else, naming ``what``.
    """
    if value is None:
        return None
    if (
        not isinstance(value, list)
        or len(value) > _MAX_KEYS
        or not all(isinstance(k, str) and 0 < len(k) <= 255 for k in value)
        or len(set(value)) != len(value)
    ):
        raise UsageError(f"{what} must be null or a list of distinct node names")
    return tuple(value)


def _upgrade_v1(state: Mapping[str, Any]) -> dict[str, Any]:
    """A version-1 state in the form of version 2, where the two orders agree."""
    for key in ("seed", "order", "window_shards", "consumed", "world_size"):
        if key not in state:
            raise UsageError(f"ShardDataset state lacks {key!r}: cannot resume")
    if state["consumed"] != 0 and state["order"] != "sequential":
        raise UsageError(
            "this state was saved mid-epoch by an older shardio, whose shuffled orders differ "
            "from this one's: resume from the start of the epoch (load it after setting "
            "its 'consumed' to 0) or finish the epoch with the older release"
        )
    spec = {
        "order": state["order"],
        "seed": state["seed"],
        "window_shards": state["window_shards"],
    }
    return {
        **state,
        "version": STATE_VERSION,
        "spec": spec,
        "ranks_per_node": state["world_size"],
        "history": [],
    }
