"""The checks every public function of dtlib runs on the numbers it is given: one place, one wording.

A bad value raises :class:`InvalidArgument` (a ``ValueError``) whose one-line message names the
argument and the valid range, e.g. ``params must be a finite number > 0, got nan``. Python
functions name their parameters; the command line re-words the same error with its flag
(``--step-time`` for ``step_time``) through :attr:`InvalidArgument.name` (``dtlib.cli``).

* :func:`integer` - a count or a size: a real integer (not ``True``, not ``2.0``) in a range, never
  above 2**53 (:data:`MAX_INTEGER`) unless the check names its own maximum;
* :func:`number` - a finite real number in a range (never NaN or infinite);
* :func:`boolean` - ``True`` or ``False`` itself (``'no'`` is an error, not a truthy string);
* :func:`one_of` - one of a few names;
* :func:`divisor` - a group size that must divide a whole (ranks per node of the world size);
* :func:`array` - :func:`integer` or :func:`number` on every element of an array (first bad one named);
* :func:`rule` - the same integer/number checks as a vectorisable layout rule
  (:data:`dtlib.analytic.layout.RULES`), for the numpy path of :mod:`dtlib.analytic.vectorised`.

Pure Python and numpy: no torch, so the analytic core, the CLI and the launcher can all use it.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Iterable

import numpy as np

__all__ = ["InvalidArgument", "MAX_INTEGER", "integer", "number", "boolean", "one_of", "divisor", "divisors",
           "divisors_of", "rule", "array", "requirement"]


class InvalidArgument(ValueError):
    """A bad argument: ``name`` (the parameter), ``requirement`` (what is valid) and ``value``."""

    def __init__(self, name: str, requirement: str, value: Any):
        self.name, self.requirement, self.value = name, requirement, value
        super().__init__(f"{name} must be {requirement}, got {_show(value)}")

    def renamed(self, name: str) -> "InvalidArgument":
        """The same error for another name (the command line's flag)."""
        return InvalidArgument(name, self.requirement, self.value)


def _show(value: Any) -> str:
    if isinstance(value, (bool, np.bool_)):
        return repr(bool(value))
    if isinstance(value, (float, np.floating)):
        return repr(float(value))  # 2.0 stays 2.0: the message must show why it is not an integer
    if isinstance(value, (int, np.integer)):
        digits = str(int(value))
        return digits if len(digits) <= 20 else f"an integer of {len(digits)} digits"
    return repr(value)


def _bound(x: float) -> str:
    """A range's bound as written: 604800, 1048576, 0.5 (no exponent for whole numbers)."""
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else f"{x:g}"


def requirement(*, integer: bool = False, minimum: float | None = None, exclusive: bool = False,
                maximum: float | None = None) -> str:
    """The words for a range: ``"an integer >= 1"``, ``"a finite number > 0"``,
    ``"an integer from 0 to 3"``, ``"a finite number > 0 and <= 604800"``."""
    kind = "an integer" if integer else "a finite number"
    if integer and minimum is not None and maximum is not None:
        return f"{kind} from {_bound(minimum)} to {_bound(maximum)}"
    bounds = []
    if minimum is not None:
        bounds.append(f"{'>' if exclusive else '>='} {_bound(minimum)}")
    if maximum is not None:
        bounds.append(f"<= {_bound(maximum)}")
    return f"{kind} {' and '.join(bounds)}" if bounds else kind


def _in_range(x: Any, minimum: float | None, exclusive: bool, maximum: float | None) -> Any:
    """Elementwise on arrays: ``x`` lies in the range (NaN never does)."""
    ok = np.isfinite(x) if x.dtype.kind == "f" else np.ones(x.shape, dtype=bool)
    if minimum is not None:
        ok = ok & ((x > minimum) if exclusive else (x >= minimum))
    if maximum is not None:
        ok = ok & (x <= maximum)
    return ok


def _in_range_scalar(x: float, minimum: float | None, exclusive: bool, maximum: float | None) -> bool:
    if minimum is not None and (x <= minimum if exclusive else x < minimum):
        return False
    return maximum is None or x <= maximum


def _scalar_ok(x: int | float, integer: bool, minimum: float | None, exclusive: bool,
               maximum: float | None) -> bool:
    """A Python int or float lies in the range (and is whole, for ``integer``)."""
    if type(x) is float and not (math.isfinite(x) and (not integer or x.is_integer())):
        return False
    return _in_range_scalar(x, minimum, exclusive, maximum)


def _is_int(value: Any) -> bool:
    """A Python or numpy integer, not a bool (Python ints have no NaN or infinity)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


# The largest count or size an integer argument may have when its check names no maximum: float64
# holds every integer up to 2**53 exactly, and the analytic core computes in int64 and float64 arrays,
# so a larger one (a 20-digit --seq) would overflow numpy or lose digits instead of meaning anything.
MAX_INTEGER = 2 ** 53


def _cap(integer: bool, maximum: float | None) -> float | None:
    """The maximum a check applies: its own, else :data:`MAX_INTEGER` for integers."""
    return MAX_INTEGER if integer and maximum is None else maximum


def _beyond_cap(value: Any) -> bool:
    """Some element of ``value`` is a number above :data:`MAX_INTEGER` (Python ints of any size too)."""
    if isinstance(value, (bool, np.bool_, str)):
        return False
    if isinstance(value, int):
        return value > MAX_INTEGER
    try:
        x = np.asarray(value, dtype=float)
    except (TypeError, ValueError, OverflowError):
        return False
    return bool((x[np.isfinite(x)] > MAX_INTEGER).any())


def _need(integer: bool, minimum: float | None, exclusive: bool, maximum: float | None, value: Any) -> str:
    """The requirement an error states: the check's own range, and 2**53 when ``value`` broke that cap."""
    if integer and maximum is None and _beyond_cap(value):
        return f"{requirement(integer=True, minimum=minimum, exclusive=exclusive)} and <= 2**53 = {MAX_INTEGER}"
    return requirement(integer=integer, minimum=minimum, exclusive=exclusive, maximum=maximum)


def integer(name: str, value: Any, *, minimum: int | None = 1, maximum: int | None = None) -> int:
    """``value`` as an ``int``, if it is an integer (Python or numpy, not bool) in the range;
    without a ``maximum``, at most :data:`MAX_INTEGER` (2**53)."""
    if _is_int(value) and _in_range_scalar(int(value), minimum, False, _cap(True, maximum)):
        return int(value)
    raise InvalidArgument(name, _need(True, minimum, False, maximum, value), value)


def number(name: str, value: Any, *, minimum: float | None = 0, exclusive: bool = True,
           maximum: float | None = None) -> float:
    """``value`` as a ``float``, if it is a finite real number (not bool) in the range;
    by default ``> 0``."""
    if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_)):
        try:
            as_float = float(value)
        except OverflowError:  # an int beyond float range, e.g. 10**400
            as_float = math.inf
        if math.isfinite(as_float) and _in_range_scalar(as_float, minimum, exclusive, maximum):
            return as_float
    raise InvalidArgument(name, requirement(minimum=minimum, exclusive=exclusive, maximum=maximum), value)


def boolean(name: str, value: Any) -> bool:
    """``value`` if it is ``True`` or ``False`` (numpy's too); strings and numbers are errors."""
    if not isinstance(value, (bool, np.bool_)):
        raise InvalidArgument(name, "True or False", value)
    return bool(value)


def one_of(name: str, value: Any, choices: Iterable[Any]) -> Any:
    """``value`` if it is one of ``choices``."""
    choices = tuple(choices)
    if value not in choices:
        raise InvalidArgument(name, f"one of {', '.join(map(repr, choices))}", value)
    return value


def divisors_of(n: int) -> list[int]:
    """Every divisor of ``1 <= n <= 2**53``, ascending. The candidates up to sqrt(n) are tested a
    million at a time with numpy, each found one with its cofactor: 2**53 GPUs take about a second,
    where a Python loop to ``n`` would never end."""
    n = integer("n", n)
    small: list[int] = []
    root = math.isqrt(n)
    for start in range(1, root + 1, _CHUNK):
        d = np.arange(start, min(start + _CHUNK, root + 1), dtype=np.int64)
        small.extend(d[n % d == 0].tolist())
    large = [n // d for d in reversed(small) if d * d != n]
    return small + large


_CHUNK = 2 ** 20


def divisors(n: int, limit: int = 12) -> str:
    """The divisors of ``n`` as a message shows them: ``"1, 2, 4"`` (the first ``limit``, then ``...``);
    beyond 2**53 (a product of sizes in a message) ``"the divisors of n"``."""
    if int(n) > MAX_INTEGER:
        return f"the divisors of {n}"
    found = divisors_of(int(n))
    return ", ".join(map(str, found[:limit])) + (", ..." if len(found) > limit else "")


def divisor(name: str, value: Any, whole: int, what: str) -> int:
    """``value`` as an ``int``, if it is an integer >= 1 that divides ``whole``; ``what`` names the
    whole in the message: ``node_size must be a divisor of the world size 4 (1, 2, 4), got 3``."""
    if _is_int(value) and value >= 1 and whole % int(value) == 0:
        return int(value)
    raise InvalidArgument(name, f"a divisor of {what} {whole} ({divisors(whole)})", value)


Rule = tuple[tuple[str, ...], Callable[..., Any], Callable[..., str]]


def rule(field: str, *, integer: bool = True, minimum: float | None = 1, exclusive: bool = False,
         maximum: float | None = None) -> Rule:
    """A layout rule ``(fields, predicate, message)`` checking ``field`` elementwise, with the
    same wording as :func:`integer` / :func:`number` (predicates must work on numpy arrays)."""
    bound = _cap(integer, maximum)

    def ok(**n: Any) -> Any:
        x = n[field]
        if type(x) in (int, float):  # plain Python: numpy per scalar costs more than the formulas
            return _scalar_ok(x, integer, minimum, exclusive, bound)
        x = np.asarray(x)
        if x.dtype.kind not in "iuf":  # bool, strings, objects: never a size
            return np.zeros(x.shape, dtype=bool)
        valid = _in_range(x, minimum, exclusive, bound)
        if not integer or x.dtype.kind != "f":
            return valid
        whole = np.where(valid, x, 0)  # NaN and inf rows are already invalid
        return valid & (np.floor(whole) == whole)

    def message(**n: Any) -> str:
        return f"{field} must be {_need(integer, minimum, exclusive, maximum, n[field])}, got {_show(n[field])}"

    return (field,), ok, message


def array(name: str, value: Any, *, integer: bool = False, minimum: float | None = 0,
          exclusive: bool = True, maximum: float | None = None) -> None:
    """Check every element of ``value`` (a scalar or an array) as :func:`rule` does; the error
    shows the first bad element (by default a finite number > 0)."""
    if type(value) in (int, float):  # the common scalar case, without numpy
        if _scalar_ok(value, integer, minimum, exclusive, _cap(integer, maximum)):
            return
        bad = value
    else:
        valid = np.asarray(rule(name, integer=integer, minimum=minimum, exclusive=exclusive,
                                maximum=maximum)[1](**{name: value}))
        if valid.all():  # booleans never are: their dtype is not a number's
            return
        bad = np.asarray(value)[tuple(np.argwhere(~valid)[0])] if valid.ndim else value
    raise InvalidArgument(name, _need(integer, minimum, exclusive, maximum, bad), bad)
