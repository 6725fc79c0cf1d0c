"""The shared resume comparison fails, and says where, when a resume is not exact."""

from __future__ import annotations

import pytest
from resuming import assert_resumed_exactly, saved, take


def test_an_exact_resume_passes_and_a_repeat_or_a_loss_is_named() -> None:
    whole = list("abcdef")
    assert_resumed_exactly(list("abc"), list("def"), whole)
    with pytest.raises(AssertionError, match=r"position 3 .*twice: \['c'\].*never delivered: \[\]"):
        assert_resumed_exactly(list("abc"), list("cdef"), whole)
    with pytest.raises(AssertionError, match=r"never delivered: \['d'\]"):
        assert_resumed_exactly(list("abc"), list("ef"), whole)


def test_take_closes_the_iteration_and_saved_goes_through_json() -> None:
    closed = []

    def batches():
        try:
            yield from ({"__key__": [f"{i}a", f"{i}b"]} for i in range(5))
        finally:
            closed.append(True)

    class Loader:
        def __iter__(self):
            return batches()

    assert take(Loader(), 2) == ["0a", "0b", "1a", "1b"]
    assert closed == [True]
    assert saved({"epoch": 1, "history": ((0, 1, 2),)}) == {"epoch": 1, "history": [[0, 1, 2]]}
