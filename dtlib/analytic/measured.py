"""A measured device and a measured link: what ``dtlib calibrate`` found, in the planner's types.

:class:`MeasuredAccelerator` is an :class:`~dtlib.analytic.hardware.Accelerator` that also holds
the seconds of the GEMMs measured on the machine (:mod:`dtlib.plan.calibrate`). Its
:meth:`~MeasuredAccelerator.gemm_seconds` answers :func:`dtlib.plan.gemm.gemm_time` in place of
the tile/wave model and the fitted efficiency: a measured shape exactly, another one at the
throughput interpolated between the measured shapes (inverse-distance weighting, Shepard 1968,
of log throughput over the distance in log M, log N, log K, log batch), times its own FLOPs.
Its ``memory_bandwidth`` is the measured elementwise bandwidth, ``optimizer_bytes_per_s`` (where
measured) the bandwidth of the optimizer's update, timed on its own, and ``kernel_launch_s`` the
measured fixed cost per kernel.

:class:`MeasuredLink` is a :class:`~dtlib.analytic.hardware.Link` that holds each collective's bus
bandwidth per message size as nccl-tests reports it (``doc/PERFORMANCE.md``: busbw = algbw x
2(n-1)/n for all-reduce, (n-1)/n for reduce-scatter, all-gather and all-to-all, 1 for broadcast
and p2p). :meth:`~MeasuredLink.seconds` answers :func:`dtlib.analytic.comm.collective_time`:
``S x factor(n) / busbw(S)``, each size's time first capped at every larger size's (a larger
message never takes less time: this drops a loaded machine's upward spikes), busbw interpolated linearly in log S - log busbw between measured
sizes; below the smallest size the smallest size's time (latency-bound), above the largest the
largest's busbw (bandwidth-bound). nccl-tests' busbw is the figure meant not to depend on the
rank count, so a group of another size is timed with its own factor and the measured busbw.
Its ``bandwidth`` and ``latency`` (the largest size's busbw, the smallest size's all-reduce
time over its 2(n-1) ring steps) serve the code that only knows an alpha-beta link.

Pure numpy, no torch: the profile is read by :mod:`dtlib.plan.measured`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from dtlib.analytic import validate
from dtlib.analytic.hardware import Accelerator, Link

__all__ = ["MeasuredAccelerator", "MeasuredLink", "BUS_FACTORS"]

# nccl-tests doc/PERFORMANCE.md, "Summary": busbw / algbw for n ranks
BUS_FACTORS = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
               "all_gather": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
               "broadcast": lambda n: 1.0 + 0 * n, "p2p": lambda n: 1.0 + 0 * n}


@dataclass(frozen=True)
class MeasuredAccelerator(Accelerator):
    """An accelerator whose GEMMs were timed: ``gemms`` holds ``(m, n, k, batch, seconds)`` rows;
    ``measured_dtype`` is the precision they ran in (its rate also answers the planner's bf16
    reference: the device computes every matmul in it); ``optimizer_bytes_per_s``: the optimizer
    step's measured bandwidth (None: ``memory_bandwidth``)."""
    gemms: tuple[tuple[float, float, float, float, float], ...] = ()
    measured_dtype: str = "fp32"
    optimizer_bytes_per_s: float | None = None

    @property
    def optimizer_bandwidth(self) -> float:
        return self.optimizer_bytes_per_s or self.memory_bandwidth

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.optimizer_bytes_per_s is not None:
            validate.number("optimizer_bytes_per_s", self.optimizer_bytes_per_s)
        if not self.gemms:
            raise ValueError(f"{self.name}: a measured accelerator needs at least one timed GEMM")
        for row in self.gemms:
            validate.array("gemms", np.asarray(row, dtype=float))  # every size and time > 0

    def gemm_seconds(self, m: Any, n: Any, k: Any, batch: Any = 1) -> Any:
        """Seconds of ``batch`` GEMMs ``M x K`` by ``K x N`` (arrays broadcast; 0 where any size is 0)."""
        m, n, k, batch = (np.asarray(x, dtype=float) for x in (m, n, k, batch))
        table = np.asarray(self.gemms, dtype=float)
        points = np.log(table[:, :4])
        rate = np.log(2 * np.prod(table[:, :4], axis=1) / table[:, 4])
        shape = np.broadcast(m, n, k, batch).shape
        work = 2 * m * n * k * batch
        query = np.stack([np.broadcast_to(np.log(np.maximum(x, 1e-30)), shape) for x in (m, n, k, batch)], -1)
        distance = np.sqrt(((query[..., None, :] - points) ** 2).sum(-1))
        exact = distance < 1e-9
        weights = np.where(exact.any(-1, keepdims=True), exact * 1.0, 1.0 / np.maximum(distance, 1e-9) ** 2)
        throughput = np.exp((weights * rate).sum(-1) / weights.sum(-1))
        t = np.where(work > 0, work / throughput, 0.0)
        return float(t) if t.ndim == 0 else t


@dataclass(frozen=True)
class MeasuredLink(Link):
    """A link whose collectives were timed: ``busbw`` holds ``(op, bytes, busbw B/s)`` rows."""
    busbw: tuple[tuple[str, float, float], ...] = ()

    def __post_init__(self) -> None:
        for op, nbytes, bw in self.busbw:
            validate.one_of("op", op, BUS_FACTORS)
            validate.number("bytes", nbytes)
            validate.number("busbw", bw)

    @property
    def ops(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(op for op, _, _ in self.busbw))

    def seconds(self, op: str, nbytes: Any, ranks: Any) -> Any:
        """Seconds of one ``op`` call on ``nbytes`` (nccl-tests' S) over ``ranks`` (0 for one rank)."""
        rows = sorted((s, bw) for o, s, bw in self.busbw if o == op)
        S, n = np.asarray(nbytes, dtype=float), np.asarray(ranks, dtype=float)
        # one rank, or a node of one rank (nothing measured: the link joins no two ranks), takes no time
        if not self.busbw or (op != "p2p" and np.all(n <= 1)):
            return 0.0 if np.ndim(S * n) == 0 else np.zeros(np.broadcast(S, n).shape)
        if not rows:
            raise ValueError(f"the calibration profile's link {self.name!r} has no {op} measured; "
                             f"measured: {', '.join(self.ops)}")
        sizes, bws = (np.asarray(col, dtype=float) for col in zip(*rows))
        # a larger message never takes less time: each size's time is at most any larger one's
        # (drops the upward spikes a loaded machine adds to single sizes)
        times = np.minimum.accumulate((sizes / bws)[::-1])[::-1]
        sizes, bws = np.log(sizes), np.log(sizes / times)
        logs = np.log(np.maximum(S, 1.0))
        bw = np.exp(np.interp(logs, sizes, bws))
        # below the smallest size: its time (busbw proportional to S)
        bw = np.where(logs < sizes[0], np.exp(bws[0]) * np.maximum(S, 1.0) / np.exp(sizes[0]), bw)
        factor = BUS_FACTORS[op](np.maximum(n, 1))
        t = np.where((n <= 1) & (op != "p2p"), 0.0, S * factor / bw)
        t = np.where(S > 0, t, 0.0)
        return float(t) if t.ndim == 0 else t
