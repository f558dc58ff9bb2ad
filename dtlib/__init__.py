"""dtlib: learn and plan distributed training of large models by running it.

Start here: ``dtlib.launch`` (N ranks from a notebook cell), ``dtlib.data``, ``dtlib.models``,
``dtlib.analytic`` (memory, FLOPs, communication: the arithmetic, no processes) and
``dtlib.parallel`` (toy but correct DDP, ZeRO and FSDP, written from scratch).
"""
from typing import Any

__all__ = ["launch", "LaunchError", "RankFailedError", "LaunchTimeoutError"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # The launcher (and torch) load on first use, so that the analytic core and the CLI import
    # nothing heavy: `import dtlib.analytic` works without torch.
    if name in __all__:
        from dtlib.extras import MissingExtra
        try:
            from dtlib import launcher
        except MissingExtra as exc:  # said for what was asked: "dtlib.launch needs torch: ..."
            raise exc.for_feature(f"dtlib.{name}") from None
        return getattr(launcher, name)
    raise AttributeError(f"module 'dtlib' has no attribute {name!r}")
