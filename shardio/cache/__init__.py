"""Deprecated: the staging package is :mod:`shardio.staging` (this name goes in shardio 0.3).

``import shardio.cache`` warns (``DeprecationWarning``); its public names are those of
:mod:`shardio.staging`, loaded on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from shardio._deprecated import warn_renamed

# 3: the importing line (warnings skips the import machinery's frames).
warn_renamed("the package shardio.cache", "shardio.staging", stacklevel=3)


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return getattr(importlib.import_module("shardio.staging"), name)
