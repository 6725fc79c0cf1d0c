"""Lazy package faces: a package's public names load their module on first use.

A package face that imported its submodules eagerly would load them into every process that
imports any one of them (a DataLoader worker reading one shard would load the stager, the
Prometheus exporter and an HTTP server). A face lists its names instead::

    __getattr__, __dir__ = lazy_face(__name__, {"stage_dataset": "shardio.staging.stage"})

and names them under ``if TYPE_CHECKING:`` for type checkers. A renamed name stays one
release in ``renamed`` (old name -> new name): it loads the new one and warns.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

from shardio._deprecated import warn_renamed

__all__ = ["lazy_face"]


def lazy_face(
    package: str,
    names: Mapping[str, str],
    *,
    on_missing: Callable[[str, ModuleNotFoundError], BaseException | None] | None = None,
    renamed: Mapping[str, str] | None = None,
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of a package whose ``names`` load lazily.

    Args:
        package: the package's ``__name__``.
        names: public name -> the module that defines it.
        on_missing: called when a name's module (or a module it imports) is not installed;
            may return the exception to raise instead (one line naming the extra).
        renamed: old name -> its new name in ``names``; the old one warns
            (``DeprecationWarning``) at each use and is not listed by ``dir()``.
    """
    table = dict(names)
    aliases = dict(renamed or {})

    def attribute(name: str) -> Any:
        if name in aliases:
            new = aliases[name]
            warn_renamed(f"{package}.{name}", f"{package}.{new}")
            return getattr(sys.modules[package], new)
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        try:
            imported = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            replaced = on_missing(name, exc) if on_missing is not None else None
            if replaced is not None:
                raise replaced from exc
            raise
        value = getattr(imported, name)
        vars(sys.modules[package])[name] = value  # the next access is a plain lookup
        return value

    def names_listed() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(table))

    return attribute, names_listed
