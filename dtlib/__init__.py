"""dtlib: learn and plan distributed training of large models by running it.

Start here: ``dtlib.launch`` (N ranks from a notebook cell), ``dtlib.data``, ``dtlib.models``,
``dtlib.memory`` / ``dtlib.flops`` / ``dtlib.comm`` (the arithmetic), ``dtlib.parallel`` (toy but
correct DDP, ZeRO, FSDP, tensor and pipeline parallelism).
"""
from dtlib.launcher import LaunchError, LaunchTimeoutError, RankFailedError, launch

__all__ = ["launch", "LaunchError", "RankFailedError", "LaunchTimeoutError"]
__version__ = "0.1.0"
