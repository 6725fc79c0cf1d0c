"""The exactly-once audit's digest and the epoch's plan (shardio.order.digest, .epochplan)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from shardio.order.digest import Digest, dataset_salt, mix_ids
from shardio.order.epochplan import plan_span
from shardio.order.ranks import RankInfo
from shardio.order.spec import OrderSpec
from shardio.order.streams import rank_stream

SALT = dataset_salt("test-dataset")
SIZES = [7, 5, 9, 3, 6]  # 30 samples


def test_digest_ignores_order_and_adds_up_in_parts() -> None:
    ids = np.arange(1000)
    shuffled = np.random.default_rng(1).permutation(ids)
    whole = Digest.of(ids, SALT)
    assert whole == Digest.of(shuffled, SALT)
    assert Digest.of(shuffled[:300], SALT) + Digest.of(shuffled[300:], SALT) == whole
    assert whole - Digest.of(ids[:10], SALT) == Digest.of(ids[10:], SALT)
    assert Digest.from_list(whole.to_list()) == whole
    assert Digest.of([], SALT) == Digest()


def test_digest_catches_a_miss_a_duplicate_and_a_swap() -> None:
    ids = np.arange(100)
    whole = Digest.of(ids, SALT)
    assert Digest.of(ids[1:], SALT).count == 99  # a miss
    duplicate = np.r_[ids[:-1], 0]  # 99 missing, 0 twice: the same count
    assert Digest.of(duplicate, SALT).count == whole.count
    assert Digest.of(duplicate, SALT) != whole
    swapped = np.r_[ids[:-1], 100]
    assert Digest.of(swapped, SALT) != whole
    # A pair of duplicates cancels in the xor, not in the sum.
    assert Digest.of(np.r_[ids, 5, 5], SALT).total != whole.total


def test_another_dataset_never_matches() -> None:
    ids = np.arange(50)
    assert Digest.of(ids, SALT) != Digest.of(ids, dataset_salt("another"))
    assert not np.intersect1d(mix_ids(ids, SALT), mix_ids(ids, dataset_salt("x"))).size


def _brute(spec: OrderSpec, layout: RankInfo, bs: int, drop_last: bool) -> Digest:
    """What the ranks of ``layout`` deliver in a whole epoch, read from their streams."""
    out = Digest()
    for r in range(layout.world_size):
        got = rank_stream(SIZES, spec, 1, layout.with_rank(r)).materialise()
        out += Digest.of(got[: len(got) // bs * bs] if drop_last else got, SALT)
    return out


CASES = [
    case
    for case in itertools.product(
        ["sequential", "random", "shard-local"], [None, "node"], [False, True], [1, 3, 4], [2]
    )
    if not (case[1] and case[3] % case[4])  # a node split needs whole nodes
]


@pytest.mark.parametrize(("order", "partition", "spec_drop", "world", "per_node"), CASES)
def test_plan_is_the_epoch_delivered_from_any_resume_point(
    order: str, partition: str | None, spec_drop: bool, world: int, per_node: int
) -> None:
    kw = {"partition": partition} if partition else {}
    spec = OrderSpec(order=order, seed=3, drop_last=spec_drop, **kw)
    layout = RankInfo(world_size=world, ranks_per_node=per_node if partition else 0)
    for bs, drop_last in ((1, False), (4, True), (3, False)):
        plan0 = plan_span(SIZES, spec, 1, layout, consumed=0, history=[], batch_size=bs,
                          drop_last=drop_last, identify=lambda v: v, salt=SALT)  # fmt: skip
        assert plan0.prefix == Digest()
        assert plan0.expected == _brute(spec, layout, bs, drop_last)
        # Every sample once, plus the padding, less the cuts.
        assert plan0.expected.count == 30 + plan0.padding - plan0.cut
        for consumed in (world * 2, world * 5):
            plan = plan_span(
                SIZES, spec, 1, layout, consumed=consumed, history=[], batch_size=1,
                drop_last=False, identify=lambda v: v, salt=SALT,
            )  # fmt: skip
            rest = Digest()
            for r in range(world):
                rest += Digest.of(
                    rank_stream(SIZES, spec, 1, layout.with_rank(r), consumed=consumed)
                    .materialise(), SALT)  # fmt: skip
            assert plan.prefix + rest == plan.expected


def test_plan_of_an_elastic_resume_three_to_two_ranks() -> None:
    spec = OrderSpec(order="random", seed=5)
    three, two = RankInfo(world_size=3), RankInfo(world_size=2)
    delivered = Digest()
    for r in range(3):  # 4 steps each under 3 ranks: the global prefix of 12 positions
        delivered += Digest.of(rank_stream(SIZES, spec, 0, three.with_rank(r)).take(0, 4), SALT)
    plan = plan_span(SIZES, spec, 0, two, consumed=12, history=[], batch_size=1,
                     drop_last=False, identify=lambda v: v, salt=SALT)  # fmt: skip
    assert plan.prefix == delivered
    for r in range(2):
        delivered += Digest.of(
            rank_stream(SIZES, spec, 0, two.with_rank(r), consumed=12).materialise(), SALT
        )
    assert delivered == plan.expected
    assert plan.expected == Digest.of(np.arange(30), SALT)  # 30 = 12 + 2 * 9: no padding


def test_plan_is_computed_in_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    import shardio.order.epochplan as epochplan

    spec = OrderSpec(order="random", seed=1)
    layout = RankInfo(world_size=3)
    args = {"consumed": 0, "history": [], "batch_size": 4, "drop_last": False,
            "identify": lambda v: v, "salt": SALT}  # fmt: skip
    whole = plan_span(SIZES, spec, 2, layout, **args)
    monkeypatch.setattr(epochplan, "_CHUNK", 4)
    assert plan_span(SIZES, spec, 2, layout, **args) == whole
