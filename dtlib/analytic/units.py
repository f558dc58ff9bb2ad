"""Byte and rate units, defined once.

Binary units (KiB, MiB, GiB: powers of 1024) for memory, as PyTorch's memory stats and
``bucket_cap_mb`` count it; decimal units (GB: 10^9) for bandwidth, as nccl-tests reports GB/s.
"""
from __future__ import annotations

__all__ = ["KiB", "MiB", "GiB", "TiB", "GB", "TFLOPS", "binary_unit", "format_bytes"]

KiB, MiB, GiB, TiB = 2 ** 10, 2 ** 20, 2 ** 30, 2 ** 40
GB = 1e9
TFLOPS = 1e12

_BINARY = ((TiB, "TiB"), (GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB"))


def binary_unit(nbytes: float) -> tuple[int, str]:
    """The largest binary unit not above ``nbytes``: ``(size, name)``, e.g. ``(2**20, "MiB")``."""
    for size, name in _BINARY:
        if nbytes >= size:
            return size, name
    return 1, "B"


def format_bytes(nbytes: float, digits: int = 3) -> str:
    """``nbytes`` in its binary unit with ``digits`` significant digits, e.g. ``"1.5 GiB"``."""
    size, name = binary_unit(nbytes)
    return f"{nbytes / size:.{digits}g} {name}"
