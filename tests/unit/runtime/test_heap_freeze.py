"""Workers start from a frozen heap (start_batches); the training process's stays as it was."""

from __future__ import annotations

import gc

from torch.utils.data import DataLoader, Dataset

from shardio.runtime.workers import start_batches


class _FreezeCount(Dataset[int]):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> int:
        return gc.get_freeze_count()


def _counts(loader: DataLoader[int]) -> list[int]:
    return [int(x) for batch in start_batches(loader, forks=True) for x in batch]


def test_forked_workers_hold_the_inherited_heap_frozen() -> None:
    assert gc.get_freeze_count() == 0
    loader = DataLoader(_FreezeCount(), batch_size=2, num_workers=2, multiprocessing_context="fork")
    counts = _counts(loader)
    assert len(counts) == 4 and min(counts) > 1000  # torch's objects, at least
    assert gc.get_freeze_count() == 0  # unfrozen here at once


def test_a_heap_the_caller_froze_stays_frozen() -> None:
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        loader = DataLoader(
            _FreezeCount(), batch_size=2, num_workers=1, multiprocessing_context="fork"
        )
        # frozen objects freed since are no longer counted
        assert min(_counts(loader)) > frozen * 0.9
        assert gc.get_freeze_count() > frozen * 0.9
    finally:
        gc.unfreeze()


def test_no_fork_no_freeze_and_no_walk_of_the_frozen_heap(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A loader with no workers (or persistent ones already running) is just iterated:
    ``gc.get_freeze_count`` walks every frozen object (13 ms an epoch with torch imported)."""
    import shardio.runtime.workers as workers

    calls: list[str] = []
    monkeypatch.setattr(workers.gc, "get_freeze_count", lambda: calls.append("count") or 0)
    monkeypatch.setattr(workers.gc, "freeze", lambda: calls.append("freeze"))
    loader = DataLoader(list(range(4)), batch_size=2, num_workers=0)  # type: ignore[arg-type]
    assert len(list(start_batches(loader, forks=False))) == 2
    assert calls == []


def test_workers_inherit_numpy_random_from_the_training_process() -> None:
    """torch's worker loop seeds numpy's generator, which imports numpy.random in each
    worker unless the training process already has it (on a cold node, from disk)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from torch.utils.data import DataLoader\n"
        "from shardio.runtime.workers import start_batches\n"
        "assert 'numpy.random' not in sys.modules\n"
        "loader = DataLoader(list(range(4)), batch_size=2, num_workers=1, "
        "multiprocessing_context='fork')\n"
        "assert len(list(start_batches(loader, forks=True))) == 2\n"
        "print('numpy.random' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.split() == ["True"]
