"""The sample order: one frozen spec, lazy epoch orders, node partitions, rank streams.

Torch-free. :class:`OrderSpec` describes the order (the same defaults everywhere);
:class:`EpochOrder` evaluates an epoch's order position by position;
:func:`rank_stream` gives what one rank reads, resumable and elastic; :class:`EpochCursor`
is one rank's position in an epoch and its saved state; :func:`node_shares`
says which node owns which shard (what ``shardio stage --node`` copies). The spec imports no
numpy (a job prologue starts faster); the rest loads on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardio._lazy import lazy_face

if TYPE_CHECKING:
    from shardio.order.cursor import EpochCursor
    from shardio.order.orders import EpochOrder
    from shardio.order.ranks import RankInfo, detect_ranks
    from shardio.order.spec import (
        MODE_ORDERS,
        ORDERS,
        PARTITIONS,
        OrderSpec,
        check_order,
        default_order,
    )
    from shardio.order.streams import (
        RankStream,
        node_shares,
        rank_stream,
        samples_per_rank,
    )

__all__ = [
    "MODE_ORDERS",
    "ORDERS",
    "PARTITIONS",
    "EpochCursor",
    "EpochOrder",
    "OrderSpec",
    "RankInfo",
    "RankStream",
    "check_order",
    "default_order",
    "detect_ranks",
    "node_shares",
    "rank_stream",
    "samples_per_rank",
]

_LAZY = {
    "EpochCursor": "shardio.order.cursor",
    "MODE_ORDERS": "shardio.order.spec",
    "ORDERS": "shardio.order.spec",
    "PARTITIONS": "shardio.order.spec",
    "OrderSpec": "shardio.order.spec",
    "check_order": "shardio.order.spec",
    "default_order": "shardio.order.spec",
    "EpochOrder": "shardio.order.orders",
    "RankInfo": "shardio.order.ranks",
    "detect_ranks": "shardio.order.ranks",
    "RankStream": "shardio.order.streams",
    "node_shares": "shardio.order.streams",
    "rank_stream": "shardio.order.streams",
    "samples_per_rank": "shardio.order.streams",
}


__getattr__, __dir__ = lazy_face(__name__, _LAZY)
