"""What comes back from a process that ran a learner's code: data, never code.

A learner child sends its answers with :func:`encode`; the verdict reads them with :func:`decode`.
Plain data (``None``, booleans, ints, floats and strings, in lists and string-keyed dicts: what
JSON holds exactly) travels as JSON, so a torch-free exercise's verdict never imports torch.
Anything else travels as ``torch.save`` bytes and is read with ``torch.load(weights_only=True)``,
which builds only containers, numbers, strings and tensors, plus the globals it names that are
dtlib's own data classes (dataclasses, named tuples, enums outside ``dtlib.grading``, in modules
already imported: a name never imports anything) or numpy's scalar, array and number dtype
classes (named one by one), each checked by name before loading. A pickle can run any code when
loaded; neither of these can.
"""
from __future__ import annotations

import builtins
import dataclasses
import enum
import importlib
import io
import json
import sys
import warnings
from typing import Any

__all__ = ["encode", "decode", "stand_in_error"]


# ---- data-only transfer ----------------------------------------------------------------------
_JSON = b"J"  # the first byte of a JSON reply; torch.save's start with b"PK" (a zip) or a pickle's b"\x80"
_PLAIN_DEPTH = 32  # deeper plain data goes by torch.save (json's recursion is the interpreter's)


def _plain(obj: Any, depth: int = _PLAIN_DEPTH) -> bool:
    """Whether JSON gives ``obj`` back exactly: these exact types (a bool is not an int, a numpy
    float or a tuple would come back as something else), string keys, at most ``depth`` deep."""
    kind = type(obj)
    if kind in (type(None), bool, int, float, str):
        return True
    if depth == 0:
        return False
    if kind is list:
        return all(_plain(v, depth - 1) for v in obj)
    return kind is dict and all(type(k) is str and _plain(v, depth - 1) for k, v in obj.items())


def encode(obj: Any) -> bytes:
    """What a learner child sends back: JSON for plain data (:func:`_plain`), else ``torch.save``
    bytes of ``obj``."""
    if _plain(obj):
        try:
            return _JSON + json.dumps(obj).encode()
        except ValueError:  # an int of more digits than Python converts to text: torch.save keeps it
            pass
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


# numpy's scalars and arrays (a learner's float is often a numpy one): the globals
# torch's weights_only documentation lists for them.
_NUMPY = {"numpy._core.multiarray.scalar", "numpy.core.multiarray.scalar", "numpy.dtype",
          "numpy._core.multiarray._reconstruct", "numpy.core.multiarray._reconstruct", "numpy.ndarray"}
# numpy's dtype classes of numbers (numpy >= 1.25 pickles a dtype by its class): named one by one,
# never "any attribute of numpy.dtypes" (objects, strings and voids are not numbers).
_NUMPY_DTYPES = {f"numpy.dtypes.{name}DType" for name in (
    "Bool", "Int8", "Int16", "Int32", "Int64", "UInt8", "UInt16", "UInt32", "UInt64",
    "Float16", "Float32", "Float64", "Complex64", "Complex128")}


def _data_class(qualified: str) -> Any:
    """A dtlib data class named in a learner's reply (dataclass, named tuple or enum), or one of
    numpy's scalar and array globals; anything else is refused."""
    module, _, name = qualified.rpartition(".")
    if qualified in _NUMPY or qualified in _NUMPY_DTYPES:
        return getattr(importlib.import_module(module), name)
    if not module.startswith("dtlib.") or module.startswith("dtlib.grading"):
        raise ValueError(f"refusing to load {qualified}: only data and dtlib's data classes come back")
    # only a module the verdict has imported itself: naming one (dtlib.__main__) must not run it
    obj = getattr(sys.modules.get(module), name, None)
    if not (isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, (tuple, enum.Enum)))):
        raise ValueError(f"refusing to load {qualified}: not a data class")
    return obj


def _numpy_globals() -> list[Any]:
    """numpy's array, scalar and dtype globals (data only: torch's weights_only documentation lists
    them as safe), allowed in every reply: exercise 13's Megatron replies (dicts of float32 arrays)
    once failed to load with only the ones the scan had named."""
    return [_data_class(name) for name in sorted(_NUMPY | _NUMPY_DTYPES) if _importable(name)]


def _importable(qualified: str) -> bool:
    module, _, name = qualified.rpartition(".")
    try:  # numpy 2 has numpy._core; numpy 1 numpy.core (numpy 2 still answers to it, deprecated)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return hasattr(importlib.import_module(module), name)
    except ImportError:
        return False


def decode(blob: bytes) -> Any:
    """Read what a learner child sent: JSON, or ``torch.load(weights_only=True)`` with numpy's data
    globals and the dtlib data classes it names (checked one by one before loading); anything else
    is refused."""
    if blob[:1] == _JSON:
        return json.loads(blob[1:])
    import torch

    needed = torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(blob))
    allowed = [_data_class(name) for name in needed] + _numpy_globals()
    with torch.serialization.safe_globals(allowed):
        return torch.load(io.BytesIO(blob), weights_only=True)


def stand_in_error(name: str, message: str) -> BaseException:
    """An exception of the learner's type name (a builtin one when it is a builtin name)."""
    kind = getattr(builtins, name, None)
    if not (isinstance(kind, type) and issubclass(kind, Exception)):
        kind = type(name if name.isidentifier() else "LearnerError", (Exception,), {})
    return kind(message)
