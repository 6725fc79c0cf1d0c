"""What a checkpoint may hold: only what ``torch.load(weights_only=True)`` loads back.

A state that the safe loader refuses (an ``argparse.Namespace``, a numpy ``Generator``, a
class of the training script) would be saved and reported intact, then skipped by every load:
the job would restart from step 0. So a save walks the state first (its structure, never the
bytes of a tensor) and refuses, in one line naming the key and the type, anything the loader
would refuse. numpy arrays and scalars of plain dtypes (``np.random.get_state()``,
``np.float64`` losses) are kept: loading allows exactly them (:func:`allowed_globals`), in a
fresh process too.
"""

from __future__ import annotations

import contextlib
import io
import reprlib
import threading
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

from shardio.errors import UsageError

__all__ = ["allowed_globals", "check_loadable", "safe_loading"]

_MAX_DEPTH = 200  # pickle itself gives up near 1,000 nested containers
_PLAIN = (type(None), bool, int, float, complex, str, bytes, bytearray)
# numpy dtypes loaded back: bool, integers, floats, complex, bytes, str, dates. Not object
# (its items are any Python object) nor void (structured records).
_NUMPY_CODES = "?bBhHiIlLqQpPefdgFDGSUMm"
_HINT = (
    "save tensors, numbers, strings, numpy arrays, and lists, tuples and dicts of them "
    "(an argparse.Namespace as vars(args), a numpy Generator as .bit_generator.state, "
    "a dataclass as dataclasses.asdict(...))"
)
_loading = threading.Lock()


def allowed_globals() -> list[Any]:
    """What ``torch.load(weights_only=True)`` needs allowed to load numpy arrays and scalars
    of plain dtypes, and empty bytes (pickled as ``bytes()``, which torch refuses alone)."""
    try:
        import numpy as np
    except ImportError:
        return [bytes]
    reconstruct = np.zeros(1).__reduce__()[0]
    scalar = np.float64(0).__reduce__()[0]
    kinds = {type(np.dtype(code)) for code in _NUMPY_CODES}
    return [
        bytes,
        np.ndarray,
        np.dtype,
        reconstruct,
        scalar,
        *sorted(kinds, key=lambda k: k.__name__),
    ]


@contextlib.contextmanager
def safe_loading() -> Iterator[None]:
    """Within it, ``torch.load(weights_only=True)`` also loads numpy arrays and scalars of
    plain dtypes, and empty bytes. What the caller allowed itself stays allowed after it
    (only what this adds is removed); loads in it are one at a time."""
    import torch.serialization

    with _loading:
        present = set(map(id, torch.serialization.get_safe_globals()))
        added = [g for g in allowed_globals() if id(g) not in present]
        with torch.serialization.safe_globals(added):
            yield


def check_loadable(value: Any, root: str) -> None:
    """Refuse ``value`` unless ``torch.load(weights_only=True)`` loads it back.

    Walks containers, not tensor data: the cost is one visit per value, then one small
    trial load of what is not plain (container types, numpy dtypes and scalars).

    Raises:
        UsageError: one line naming the key path (from ``root``), the type, and what
            to save instead.
    """
    skeleton = _Walk(root).skeleton(value)
    if skeleton is None:
        return
    buf = io.BytesIO()
    try:
        import torch

        torch.save(skeleton, buf)
        buf.seek(0)
        with safe_loading():
            torch.load(buf, weights_only=True)
    except Exception as exc:  # the walk let through something this torch refuses
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(
            f"{root} holds a value torch.load(weights_only=True) would refuse ({first}): {_HINT}"
        ) from exc


# A key path, built only when a value is refused: (parent, key, how) or the root's name.
_Path = Any


def _render(path: _Path) -> str:
    parts: list[str] = []
    while isinstance(path, tuple):
        path, key, how = path
        parts.append(f"[{reprlib.repr(key)}]" if how == "item" else f" ({how})")
    text = str(path) + "".join(reversed(parts))
    return text if len(text) <= 200 else f"{text[:100]}...{text[-90:]}"


class _Walk:
    """One walk of a state: checks each value, and builds the skeleton to trial-load.

    The skeleton keeps what the loader must be shown (each container's type, numpy arrays
    emptied, numpy scalars) and leaves out what is known to load (plain values, tensors):
    a list of a million ints costs one visit each, not a million-item trial.
    """

    def __init__(self, root: str) -> None:
        import torch

        self.torch = torch
        self.root = root
        self.done: dict[int, Any] = {}  # id -> skeleton of a container already walked
        self.open: set[int] = set()  # the containers on the way to the current value
        self.known = {
            *_PLAIN, torch.dtype, torch.device, torch.Size, torch.layout, torch.memory_format,
        }  # fmt: skip
        self.tensors = (torch.Tensor, torch.nn.Parameter)
        self.layouts = {
            torch.strided, torch.sparse_coo, torch.sparse_csr, torch.sparse_csc,
            torch.sparse_bsr, torch.sparse_bsc,
        }  # fmt: skip
        try:
            import numpy as np
        except ImportError:
            self.np: Any = None
        else:
            self.np = np
            self.np_kinds = {type(np.dtype(code)) for code in _NUMPY_CODES}
            self.np_shown: set[tuple[type, Any]] = set()

    def refuse(self, path: _Path, value: Any, why: str = "") -> UsageError:
        kind = type(value)
        name = kind.__qualname__ if kind.__module__ == "builtins" else (
            f"{kind.__module__}.{kind.__qualname__}"
        )  # fmt: skip
        what = why or "torch.load(weights_only=True) refuses it"
        return UsageError(f"cannot save {_render(path)} ({name}): {what}: {_HINT}")

    def skeleton(self, value: Any, path: _Path = None, depth: int = 0) -> Any:
        """None when ``value`` is known to load, else what the trial load is to be shown."""
        path = self.root if path is None else path
        kind = type(value)
        if kind in self.known:
            return None
        if isinstance(value, self.torch.Tensor):
            self.tensor(value, path)
            return None
        if self.np is not None and isinstance(value, (self.np.ndarray, self.np.generic)):
            return self.numpy(value, path)
        if kind not in (dict, OrderedDict, list, tuple, set):
            raise self.refuse(path, value)
        if depth >= _MAX_DEPTH:
            raise UsageError(
                f"cannot save {_render(path)}: containers nested more than {_MAX_DEPTH} deep"
            )
        key = id(value)
        if key in self.open:
            raise UsageError(f"cannot save {_render(path)}: it contains itself (a cycle)")
        if key in self.done:
            return self.done[key]
        self.open.add(key)
        try:
            inner = self.container(value, path, depth + 1)
        finally:
            self.open.discard(key)
        out = inner or None  # the five container types load: only their items may not
        self.done[key] = out
        return out

    def container(self, value: Any, path: _Path, depth: int) -> list[Any]:
        """The skeletons of ``value``'s items that the trial load is to be shown."""
        known, out = self.known, []
        if isinstance(value, dict):
            for k, v in value.items():
                if type(k) not in known:
                    out.append(self.skeleton(k, ((path, k, "item"), None, "a key"), depth))
                if type(v) not in known:
                    out.append(self.skeleton(v, (path, k, "item"), depth))
        elif isinstance(value, set):
            out = [self.skeleton(v, (path, None, "an item"), depth) for v in value]
        else:
            for i, v in enumerate(value):
                if type(v) not in known:
                    out.append(self.skeleton(v, (path, i, "item"), depth))
        return [item for item in out if item is not None]

    def tensor(self, value: Any, path: _Path) -> None:
        if type(value) not in self.tensors:
            why = "torch.load(weights_only=True) refuses tensor subclasses"
            raise self.refuse(path, value, why)
        if value.layout not in self.layouts:
            raise self.refuse(path, value, f"a tensor of layout {value.layout} cannot be saved")

    def numpy(self, value: Any, path: _Path) -> Any:
        np = self.np
        if type(value.dtype) not in self.np_kinds:
            raise self.refuse(
                path, value, f"torch.load(weights_only=True) refuses dtype {value.dtype}"
            )
        if isinstance(value, np.ndarray) and type(value) is not np.ndarray:
            raise self.refuse(path, value)  # a subclass (masked array, matrix)
        shown = (type(value), value.dtype)  # what loading depends on: one sample of each
        if shown in self.np_shown:
            return None
        self.np_shown.add(shown)
        return np.empty(0, dtype=value.dtype) if isinstance(value, np.ndarray) else value
