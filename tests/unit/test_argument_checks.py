"""shardio._check: one checker per kind of value, one limit per kind."""

from __future__ import annotations

import math

import numpy as np
import pytest

from shardio._check import MAX_SECONDS, require_seconds
from shardio.errors import UsageError


@pytest.mark.parametrize("good", [0, 0.25, 5, MAX_SECONDS, np.float64(1.5)])
def test_seconds_in_range_pass_as_float(good: object) -> None:
    value = require_seconds(good, "timeout_s")
    assert isinstance(value, float) and value == float(good)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "bad", [True, "5", None, math.nan, math.inf, -1, MAX_SECONDS + 1, 10**400, b"1"]
)
def test_seconds_refused_in_one_line_naming_the_option(bad: object) -> None:
    with pytest.raises(UsageError, match=r"^timeout_s must be") as info:
        require_seconds(bad, "timeout_s")
    assert "\n" not in str(info.value)


def test_positive_refuses_zero() -> None:
    assert require_seconds(0, "x") == 0.0
    with pytest.raises(UsageError, match="more than 0"):
        require_seconds(0, "x", positive=True)


def test_every_seconds_option_uses_the_one_limit() -> None:
    """A day passes and a day and a second fails in each place that takes a duration."""
    from shardio.metrics.export import PeriodicReporter
    from shardio.read.recovery import RecoveryPolicy
    from shardio.read.timeouts import check_read_timeout

    assert check_read_timeout(MAX_SECONDS) == MAX_SECONDS
    assert RecoveryPolicy(backoff_s=MAX_SECONDS, max_backoff_s=MAX_SECONDS).backoff_s == MAX_SECONDS
    for make in (
        check_read_timeout,
        lambda s: RecoveryPolicy(backoff_s=s),
        lambda s: RecoveryPolicy(budget_s=s),
        lambda s: PeriodicReporter(lambda: None, interval_s=s),
    ):
        with pytest.raises(UsageError, match="at most a day"):
            make(MAX_SECONDS + 1)
