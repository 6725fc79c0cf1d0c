"""The mix's schedule, evaluated position by position: the same as the merge of every draw
by time that earlier releases built whole, at any position, without the epoch's arrays."""

from __future__ import annotations

import random
import tracemalloc

import numpy as np
import pytest

from shardio.errors import UsageError
from shardio.order.cursor import EpochCursor
from shardio.order.mix import MixOrder, MixSchedule, mix_counts, mix_schedule
from shardio.order.spec import OrderSpec


def merged(counts: list[int], seed: int, epoch: int, phases=None):
    """The schedule as earlier releases computed it: every draw's time, merged by a stable
    argsort (the reference that the lazy schedule must equal, and saved states rely on)."""
    if phases is None:
        phases = np.random.Generator(np.random.PCG64([seed, epoch])).random(len(counts))
    spans = [(np.arange(c, dtype=np.float64) + phases[s]) / c for s, c in enumerate(counts) if c]
    order = np.argsort(np.concatenate(spans or [np.empty(0)]), kind="stable")
    source = np.repeat(np.arange(len(counts), dtype=np.int32), counts)[order]
    draw = np.concatenate([np.arange(c, dtype=np.int64) for c in counts])[order]
    return source, draw


def _cases() -> list[list[int]]:
    rng = random.Random(7)
    cases = [[200, 86], [1], [1, 1], [0, 3, 0, 4], [1, 5000], [7, 7, 7, 7], [3, 6, 9, 12, 15]]
    for _ in range(60):
        n = rng.randrange(1, 7)
        cases.append(
            [rng.choice([0, 1, 2, rng.randrange(1, 40), rng.randrange(1, 3000)]) for _ in range(n)]
        )
    return [c for c in cases if sum(c)]


def test_the_lazy_schedule_equals_the_merge_of_every_draw():
    for counts in _cases():
        _check_schedule(counts)


def _check_schedule(counts: list[int]) -> None:
    rng = random.Random(sum(counts))
    for seed, epoch in ((0, 0), (rng.randrange(2**64), rng.randrange(1000))):
        source, draw = merged(counts, seed, epoch)
        got = mix_schedule(counts, seed, epoch)
        assert got[0].dtype == np.int32 and got[1].dtype == np.int64
        assert np.array_equal(got[0], source) and np.array_equal(got[1], draw)
        schedule = MixSchedule(counts, seed, epoch)
        picked = np.array(rng.sample(range(sum(counts)), min(25, sum(counts))))
        one_by_one = [schedule.take([p]) for p in picked.tolist()]
        assert [(int(s[0]), int(d[0])) for s, d in one_by_one] == list(
            zip(source[picked].tolist(), draw[picked].tolist(), strict=True)
        )


@pytest.mark.parametrize("counts", [[4, 4], [4, 8, 2], [3, 6, 9], [5, 5, 5, 5, 5]])
def test_draws_at_the_same_time_go_to_the_lower_source_first(counts):
    """Equal phases put draws of several sources at exactly one time: the lower source
    first, as the stable merge did."""
    schedule = MixSchedule(counts, 0, 0)
    schedule._phase = np.full(len(counts), 0.5)  # forcing exact ties
    schedule._phase_sum = 0.5 * len(counts)
    source, draw = merged(counts, 0, 0, phases=np.full(len(counts), 0.5))
    got = schedule.take(np.arange(sum(counts)))
    assert np.array_equal(got[0], source) and np.array_equal(got[1], draw)


def test_positions_outside_the_mix_are_refused():
    schedule = MixSchedule([3, 4], 0, 0)
    for bad in (-1, 7, 10**12):
        with pytest.raises(IndexError, match=f"position {bad} out of range for a mix of 7"):
            schedule.take([0, bad])
    assert [a.size for a in schedule.take([])] == [0, 0]


def test_the_mix_order_takes_each_source_draw_from_its_own_epoch_order():
    specs = [OrderSpec(order="random", seed=3), OrderSpec(order="shard-local", seed=4)]
    sizes = [[50, 50, 30], [10, 90, 20, 40]]
    counts = [120, 64]
    mix = MixOrder(counts, 9, 2, list(zip(sizes, specs, strict=True)))
    source, index = mix.take(np.arange(sum(counts)))
    for s in range(2):
        cursor = EpochCursor(specs[s], sizes[s])
        cursor.set_epoch(2)
        assert index[source == s].tolist() == cursor.epoch_order()[: counts[s]].tolist()


def test_a_mix_of_two_huge_sources_costs_nothing_of_their_size():
    """2 x 10^10 samples: positions anywhere in the epoch are located in small memory (the
    merge of every draw would need hundreds of GB)."""
    sizes = np.full(100_000, 100_000)  # 10^10 samples a source, no data anywhere
    spec = OrderSpec(order="random", seed=1)
    tracemalloc.start()
    try:
        mix = MixOrder([10**10, 10**10], 0, 0, [(sizes, spec), (sizes, spec)])
        ends = mix.take([0, 1, 10**10, 2 * 10**10 - 1])
        middle = mix.take(np.arange(10**10, 10**10 + 4096))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 2**20, peak
    mixed_draws = MixSchedule([10**10, 10**10], 0, 0).take([0, 1, 2 * 10**10 - 1])[1]
    assert sorted(ends[0].tolist()[:2]) == [0, 1]  # each source's first draw comes first
    assert mixed_draws.tolist() == [0, 0, 10**10 - 1]
    # Each source's draw k is its epoch order's k-th sample: its first is sample order[0].
    first = [mix.orders[s].take([0])[0] for s in ends[0].tolist()[:2]]
    assert ends[1].tolist()[:2] == first
    assert np.bincount(middle[0], minlength=2).tolist() in (
        [2048, 2048],
        [2047, 2049],
        [2049, 2047],
    )
    assert len(set(middle[1][middle[0] == 0].tolist())) == (middle[0] == 0).sum()


def test_a_schedule_is_a_pure_function_of_seed_and_epoch_in_every_process():
    counts = [1000, 333, 7]
    first = MixSchedule(counts, 5, 1).take(np.arange(1340))
    again = MixSchedule(counts, 5, 1).take(np.arange(1340))
    other = MixSchedule(counts, 5, 2).take(np.arange(1340))
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))
    assert not np.array_equal(first[0], other[0])


def test_a_mix_beyond_what_float64_times_can_order_is_refused():
    assert sum(mix_counts([2**52, 2**52], [0.5, 0.5])) == 2**53
    with pytest.raises(UsageError, match=r"draw about \d+ samples an epoch, more than the"):
        mix_counts([2**60, 2**60], [0.5, 0.5])
