"""The 0.2 renames: each old spelling still works for one release, warns naming the new one,
and gives what the new one gives; both spellings at once are refused (CHANGELOG.md)."""

from __future__ import annotations

import os

import pytest

from shardio import ShardWriter, UsageError
from shardio.read.reader import ShardReader
from shardio.staging import StageOptions, stage_dataset

torch = pytest.importorskip("torch")

from shardio import ShardDataset  # noqa: E402  (after the torch check)


@pytest.fixture(scope="module")
def staged(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("deprecations")
    src, area = os.fspath(root / "src"), os.fspath(root / "area")
    with ShardWriter(src, shard_size="64KiB") as writer:
        for i in range(50):
            writer.write({"__key__": f"{i:03d}", "bin": bytes([i]) * 300, "cls": i % 2})
    stage_dataset(src, area, StageOptions())
    return src, area


def test_cache_is_the_old_name_of_stage(staged: tuple[str, str]) -> None:
    src, area = staged
    new = ShardDataset(src, stage=area, shuffle=False)
    with pytest.warns(
        DeprecationWarning, match=r"ShardDataset\(cache=\.\.\.\) .* ShardDataset\(stage="
    ):
        old = ShardDataset(src, cache=area, shuffle=False)
    assert old.stage == new.stage == area
    assert old[3]["bin"] == new[3]["bin"] == bytes([3]) * 300
    assert old.packed.cache_root == new.packed.cache_root is not None
    with pytest.raises(UsageError, match=r"give stage= only"):
        ShardDataset(src, stage=area, cache=area)
    with pytest.warns(DeprecationWarning, match=r"ShardReader\(cache=\.\.\.\)"):
        reader = ShardReader(src, cache=area)
    with reader:
        assert reader.resolver.cache_root is not None


def test_the_dali_face_takes_stage_and_warns_on_cache(staged: tuple[str, str]) -> None:
    pytest.importorskip("nvidia.dali")
    from shardio import dali

    src, area = staged
    made = dali.pipeline(src, batch_size=5, device_id=None, stage=area, exts=("bin",))
    assert made.options.stage == area
    with pytest.warns(DeprecationWarning, match=r"pipeline\(cache=\.\.\.\)"):
        old = dali.pipeline(src, batch_size=5, device_id=None, cache=area, exts=("bin",))
    assert old.options.stage == area


def test_no_metaclass_type_and_isinstance_tell_the_truth(staged: tuple[str, str]) -> None:
    from shardio.runtime.resilient import ResilientDataset

    src, _area = staged
    ds = ShardDataset(src, recovery="skip")
    assert type(ds) is ShardDataset and type(ShardDataset) is type
    with pytest.warns(DeprecationWarning, match="ResilientDataset"):
        old = ResilientDataset(ShardDataset(src), policy="skip")
    assert type(old) is ShardDataset and old.recovery_policy is not None
    with pytest.raises(TypeError):
        isinstance(ds, ResilientDataset)  # type: ignore[arg-type]  # a function, not a class


def test_dali_options_take_cache_as_the_old_name_of_stage(staged: tuple[str, str]) -> None:
    from shardio.dali._pipeline import DALIOptions

    _src, area = staged
    with pytest.warns(DeprecationWarning, match=r"DALIOptions\(cache=\.\.\.\)"):
        options = DALIOptions(batch_size=4, device_id=None, cache=area)
    assert options.stage == area == DALIOptions(batch_size=4, device_id=None, stage=area).stage
    with pytest.raises(UsageError, match="give stage= only"):
        DALIOptions(batch_size=4, device_id=None, cache=area, stage=area)
