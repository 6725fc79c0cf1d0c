"""Optional extras that are not installed: one error naming the extra to install (a
MissingExtraError, which is both a UsageError and an ImportError), never a bare
ModuleNotFoundError. Each case runs in a subprocess where the module cannot be imported."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest


def _run(code: str, env: dict[str, str] | None = None) -> list[str]:
    full = {**os.environ, **(env or {})}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        check=False, capture_output=True, text=True, timeout=120, env=full,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


_CATCH = """
def report(call):
    from shardio.errors import MissingExtraError
    try:
        call()
    except ImportError as exc:
        print(type(exc).__name__, isinstance(exc, MissingExtraError), exc)
    else:
        print("no error")
"""


def test_import_shardio_dali_without_dali_names_the_extra() -> None:
    out = _run(
        "import sys\nsys.modules['nvidia.dali'] = None\n" + _CATCH + "\n"
        "report(lambda: __import__('shardio.dali'))\n"
    )
    assert out == [
        "MissingExtraError True shardio.dali needs NVIDIA DALI: pip install nvidia-dali-cuda120"
    ]


def test_a_broken_dali_install_names_the_extra_and_the_cause(tmp_path: Path) -> None:
    stub = tmp_path / "stub" / "nvidia" / "dali"
    stub.mkdir(parents=True)
    (stub.parent / "__init__.py").write_text("")
    (stub / "__init__.py").write_text("raise ImportError('libcudart.so.12: cannot open')\n")
    path = os.pathsep.join(p for p in (str(tmp_path / "stub"), os.environ.get("PYTHONPATH")) if p)
    out = _run(
        _CATCH + "\nimport shardio.dali\n"
        f"report(lambda: shardio.dali.pipeline({str(tmp_path / 'ds')!r}, batch_size=2))\n",
        env={"PYTHONPATH": path},
    )
    assert out == [
        "MissingExtraError True shardio.dali needs NVIDIA DALI: pip install nvidia-dali-cuda120 "
        "(libcudart.so.12: cannot open)"
    ]


@pytest.mark.parametrize(
    ("blocked", "call", "message"),
    [
        (
            "prometheus_client",
            "lambda: __import__('shardio.metrics').metrics.PrometheusExporter(lambda: None)",
            "PrometheusExporter needs prometheus_client: pip install prometheus-client",
        ),
        (
            "matplotlib",
            "lambda: __import__('shardio.bench.plot').bench.plot.require_matplotlib()",
            "--plot needs matplotlib: pip install matplotlib",
        ),
    ],
)
def test_other_extras_name_theirs(blocked: str, call: str, message: str) -> None:
    out = _run(f"import sys\nsys.modules[{blocked!r}] = None\n" + _CATCH + f"\nreport({call})\n")
    assert out == [f"MissingExtraError True {message}"]


@pytest.mark.parametrize(
    "name", ["ShardDataset", "ShardLoader", "GPUPrefetcher", "ResilientDataset", "MixedDataset"]
)
def test_torch_side_names_without_torch_name_the_extra(name: str) -> None:
    out = _run(
        "import sys\nsys.modules['torch'] = None\n" + _CATCH + "\n"
        f"import shardio\nreport(lambda: getattr(shardio, {name!r}))\n"
        "print(shardio.ShardReader.__name__)  # the torch-free names still load\n"
    )
    assert out == [
        f"MissingExtraError True shardio.{name} needs PyTorch: pip install torch",
        "ShardReader",
    ]


@pytest.mark.parametrize("decode", ["pil", "torch"])
def test_image_decoding_without_pillow_names_the_extra(decode: str) -> None:
    out = _run(
        "import sys\nsys.modules['PIL'] = None\nsys.modules['PIL.Image'] = None\n" + _CATCH + "\n"
        "from shardio.runtime.decode import make_decoder\n"
        f"report(lambda: make_decoder({decode!r}))\n"
    )
    assert out == [f"MissingExtraError True decode={decode!r} needs Pillow: pip install pillow"]


def test_every_extra_hint_names_what_pyproject_installs() -> None:
    """The hint names the packages of pyproject's extras, never ``shardio[...]``: that name on
    the package index belongs to another project."""
    import pathlib
    import tomllib

    from shardio.errors import EXTRA_PACKAGES, MissingExtraError

    root = pathlib.Path(__file__).resolve().parents[3]
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    for extra, package in EXTRA_PACKAGES.items():
        names = [re.split(r"[<>=!~\[ ;]", req, maxsplit=1)[0].lower() for req in extras[extra]]
        assert names == [package], (extra, names)
        assert "shardio[" not in str(MissingExtraError("x", extra))
    assert set(extras) - {"dev", "bench", "dlio"} == set(EXTRA_PACKAGES)
