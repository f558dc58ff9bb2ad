"""The argument types every ``dtlib`` subcommand shares: the parser that turns usage errors into
one line, and sizes, counts, positive numbers and catalogue names, each checked by
:mod:`dtlib.analytic.validate` so that a bad flag gets the API's message with the flag's name."""
from __future__ import annotations

import argparse
import re
from typing import Any, Callable

from dtlib.analytic import validate
from dtlib.analytic.activations import check_recompute_modules
from dtlib.analytic.hardware import get_gpu, get_system


def plain(text: str) -> str:
    """Help text without reST markup: a module docstring used as ``--help`` reads
    ``dtlib.plan``, not ``:mod:`dtlib.plan```; ``:func:`~a.b.c``` shows ``c`` as Sphinx does."""
    text = re.sub(r":[a-z]+:`~[\w.]*?(\w+)`", r"\1", text)
    text = re.sub(r":[a-z]+:`([^`]+)`", r"\1", text)
    return re.sub(r"``([^`]+)``", r"\1", text)


class Parser(argparse.ArgumentParser):
    """argparse, but usage errors become ValueError (one line, exit 2, like every bad input), and
    help without reST markup (:func:`plain`), for every subcommand at once."""

    def format_help(self) -> str:
        return plain(super().format_help())

    def error(self, message: str) -> None:  # type: ignore[override]
        # "argument --tp: must be an integer >= 1, got '0'" -> "--tp must be ...": the wording of
        # dtlib.analytic.validate, with the flag where Python names the parameter
        message = re.sub(r"^argument (\S+): must be ", r"\1 must be ", message)
        raise ValueError(f"{message} (see '{self.prog} --help')")


# Python parameters whose flag is not "--" + name with "-" for "_" (see flag_of).
_FLAGS = {"nbytes": "--bytes", "overhead_bytes": "--overhead", "largest_layer_params": "--largest-layer",
          "micro_batch_size": "--micro-batch", "num_microbatches": "--microbatches"}


def flag_of(name: str) -> str:
    """The command-line flag of a Python parameter: ``step_time`` -> ``--step-time`` (a flag
    already, ``--top-k``, stays as it is)."""
    if name.startswith("-"):
        return name
    return _FLAGS.get(name, "--" + name.replace("_", "-"))


_BYTES = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
          "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}
_COUNTS = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}  # 7B = 7 billion parameters


def checked(check: Callable[[], Any], text: str) -> Any:
    """Run a :mod:`dtlib.analytic.validate` check for an argparse ``type``; argparse names the flag."""
    try:
        return check()
    except validate.InvalidArgument as exc:
        raise argparse.ArgumentTypeError(f"must be {exc.requirement}, got {text!r}") from None


def _parse(text: str, units: dict[str, float], example: str, positive: bool = False) -> float:
    """A finite number with a unit; never negative, and > 0 when ``positive``."""
    m = re.fullmatch(r"\s*([-+]?[0-9.]+(?:e[+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text), re.IGNORECASE)
    if not m or m.group(2).lower() not in units:
        raise argparse.ArgumentTypeError(f"cannot read {text!r}; write e.g. {example}")
    try:
        value = float(m.group(1)) * units[m.group(2).lower()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"cannot read {text!r}; write e.g. {example}") from None
    return checked(lambda: validate.number("value", value, minimum=0, exclusive=positive), text)


def parse_size(text: str) -> float:
    """Bytes >= 0: ``"1e9"``, ``"512MiB"``, ``"4GB"``."""
    return _parse(text, _BYTES, "1e9, 512MiB, 4GB")


def parse_count(text: str) -> float:
    """A count >= 0: ``"7e9"``, ``"7B"`` (billions), ``"350M"``."""
    return _parse(text, _COUNTS, "7e9, 7B, 350M")


def parameter_count(text: str) -> float:
    """``--params``: a count > 0."""
    return _parse(text, _COUNTS, "7e9, 7B, 350M", positive=True)


def seconds(text: str) -> float:
    """``--step-time``: seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"cannot read {text!r}; write seconds, e.g. 1.5") from None
    return checked(lambda: validate.number("value", value), text)


def positive_int(text: str) -> int:
    """An integer >= 1 (sizes, counts, widths): checked here, before any division by it."""
    try:
        value = int(str(text).strip())
    except ValueError:
        value = str(text)  # not an integer: validate says what is expected
    return checked(lambda: validate.integer("value", value), text)


def gpu_name(text: str) -> str:
    """``--gpu``'s argparse type: a catalogue name (:data:`dtlib.analytic.hardware.ACCELERATORS`),
    else "unknown GPU ...; valid: ..." (argparse puts the flag in front)."""
    try:
        return get_gpu(text).name
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def system_name(text: str) -> str:
    """``--system``'s argparse type: a :data:`dtlib.analytic.hardware.SYSTEMS` name."""
    try:
        return get_system(text).name
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def bounded_float(requirement: str, ok: Callable[[float], bool]) -> Callable[[str], float]:
    """An argparse ``type``: a number for which ``ok`` holds (NaN never does), else the error
    "must be <requirement>, got 'text'" (argparse puts the flag in front)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {requirement}, got {text!r}")
        return value
    return parse


def join_negative_values(argv: list[str]) -> list[str]:
    """``--params -7B`` -> ``--params=-7B``: argparse takes a value starting with '-' for an
    option unless it looks like a plain number, so a negative size would be reported as a
    missing argument instead of a negative one."""
    out: list[str] = []
    for tok in argv:
        if out and re.match(r"^-\.?[0-9]", tok) and re.fullmatch(r"--[a-z][a-z0-9-]*", out[-1]):
            out[-1] = f"{out[-1]}={tok}"
        else:
            out.append(tok)
    return out




def non_negative_int(text: str) -> int:
    """An integer >= 0 (counts that may be zero: experts, seed, checkpoint interval)."""
    try:
        value = int(str(text).strip())
    except ValueError:
        value = str(text)
    return checked(lambda: validate.integer("value", value, minimum=0), text)


def positive_float(text: str, exclusive: bool = True) -> float:
    """A finite number > 0 (learning rate, capacity factor, timeout)."""
    try:
        value = float(text)
    except ValueError:
        value = str(text)
    return checked(lambda: validate.number("value", value, minimum=0, exclusive=exclusive), text)


def non_negative_float(text: str) -> float:
    """A finite number >= 0 (0 turns an option off: the heartbeat)."""
    return positive_float(text, exclusive=False)


# ---- shared options -------------------------------------------------------------------------------
def expert_count(text: str) -> int:
    """``--experts``: 0 (dense) or an integer >= 2 (one expert is a dense MLP with a router)."""
    value = non_negative_int(text)
    if value == 1:
        raise argparse.ArgumentTypeError(f"must be 0 (dense) or an integer >= 2, got {text!r}")
    return value


def recompute_modules(text: str) -> tuple[str, ...]:
    """``--recompute-modules``' argparse type: comma-separated
    :data:`~dtlib.analytic.activations.RECOMPUTE_MODULES` names, else "unknown ...; valid: ..."
    (argparse puts the flag in front)."""
    names = tuple(name.strip() for name in str(text).split(",") if name.strip())
    try:
        return check_recompute_modules(names)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).replace("recompute_modules: ", "")) from None
