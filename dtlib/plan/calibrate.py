"""``dtlib calibrate``: measure the machine the plan is for, and write what it found as a profile.

On every rank at once (gloo ranks on this CPU via :func:`dtlib.launch`, or torchrun's ranks on
GPUs over NCCL), so that ranks sharing cores or a memory bus are measured sharing them:

* **GEMMs**: the shapes the planner itself asks for when it times the model
  (:func:`planned_gemm_shapes` records every ``(M, N, K, batch)`` that
  :func:`dtlib.plan.gemm.gemm_time` receives from :func:`dtlib.plan.steptime.step_time` for the
  given tensor-parallel sizes and micro-batches), each timed as ``torch.matmul`` in the run's dtype;
* **attention**: ``F.scaled_dot_product_attention`` forward + backward, causal, at the model's
  shape, kept as the FlashAttention efficiency the planner uses (its matmul work at the measured
  GEMM peak over the measured time, :func:`dtlib.plan.measured.attention_efficiency`);
* **elementwise bandwidth**: ``torch.add(a, b, out=c)`` on one micro-batch's activation tensor
  (bytes read + written over time, STREAM's "Add" count, McCalpin 1995), at that size, so the
  per-kernel cost of small tensors is in it;
* **the fixed cost per kernel**: forward + backward of a chain of operators on a one-element
  tensor over the ATen operators counted in it (:func:`_kernel_cost`): on CPU ranks eager
  PyTorch's dispatcher and autograd cost per operator, the planner's ``launch`` term per kernel;
* **memory-bound work of a step** (CPU ranks): one step of the model as ``dtlib train`` builds it
  (:class:`dtlib.models.TinyGPT`, AdamW, cross-entropy) on every rank at once, each alone, its
  forward + backward and its optimizer step timed apart (the first repeats per micro-batch, the
  second once per step), and the operators one layer dispatches counted (the planner's kernels
  per layer for this model; with several ranks, also the operators ``dtlib.parallel.FSDP`` adds to a
  layer under ZeRO-3, :func:`_zero3_layer_kernels`). The forward + backward less the planner's GEMMs (from the GEMMs,
  timed in the same rounds as the step) and kernel costs, over the bytes the planner counts for its ``elementwise``
  term, gives that term's bandwidth; the optimizer step over the ``optimizer`` term's bytes
  gives the optimizer's (:func:`dtlib.plan.measured.memory_bound_bandwidth`; the ``add`` figure
  where they cannot be told);
* **collectives**: all-reduce, reduce-scatter, all-gather, all-to-all, broadcast and p2p per
  message size, nccl-tests' way (``doc/PERFORMANCE.md``: time = the slowest rank's, algbw = S / t,
  busbw = algbw x the collective's factor), within a node and, with several nodes, across them
  (one rank per node).

Every time is the ``statistic`` (default the median; or the minimum or the mean,
:data:`dtlib.analytic.timing.STATISTICS`) of ``repeats`` calls after a warm-up, the slowest rank's (a
collective's sizes taken in rounds, one call of each per round, :func:`_summaries`), on one of :data:`CLOCKS`:
``wall`` (``time.perf_counter``, after ``torch.cuda.synchronize`` on a GPU) or ``cpu``, the
process's CPU time over all its threads (``time.process_time``; default on CPU ranks): on a machine
that other jobs load, wall time measures them too, while CPU time counts only the work of the call
itself (gloo's threads included), what it costs on a core of its own. The profile (JSON,
:data:`FORMAT`) carries the machine, the versions, the date and every figure with its unit;
:mod:`dtlib.plan.measured` reads it for ``dtlib plan --calibration``.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import platform
import socket
import time
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import dtlib
from dtlib.analytic import validate
from dtlib.analytic.comm import COLLECTIVES
from dtlib.analytic.config import TransformerConfig
from dtlib.analytic.hardware import Cluster, Link
from dtlib.analytic.layout import Parallelism
from dtlib.analytic.measured import BUS_FACTORS, MeasuredAccelerator
from dtlib.analytic.timing import STATISTICS, summarise
from dtlib.parallel.collectives import all_gather_into, reduce_scatter_into
from dtlib.plan.measured import FORMAT, memory_bound_bandwidth
from dtlib.plan.steptime import StepOptions, step_time

__all__ = ["planned_gemm_shapes", "calibrate", "message_sizes", "DTYPES", "CLOCKS"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


class _Recorder(MeasuredAccelerator):
    """A device that answers every GEMM with 0 s and keeps its shape: what the planner asks for."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "seen", set())

    def gemm_seconds(self, m: Any, n: Any, k: Any, batch: Any = 1) -> Any:
        arrays = np.broadcast_arrays(*(np.asarray(x, dtype=float) for x in (m, n, k, batch)))
        for shape in zip(*(a.ravel() for a in arrays)):
            if min(shape) > 0:
                self.seen.add(tuple(int(round(x)) for x in shape))
        return np.zeros(arrays[0].shape) if arrays[0].ndim else 0.0


def planned_gemm_shapes(model: TransformerConfig, tp: Sequence[int], micro_batch: Sequence[int],
                        options: StepOptions = StepOptions()) -> list[tuple[int, int, int, int]]:
    """Every ``(M, N, K, batch)`` GEMM the planner times for ``model`` at each tensor-parallel size
    of ``tp`` and micro-batch of ``micro_batch`` (forward, both backward GEMMs, attention's
    batched GEMMs without FlashAttention, the LM head), sorted."""
    recorder = _Recorder("recorder", {"bf16": 1.0, "fp8": 1.0}, 0, 1.0, "records GEMM shapes",
                         gemms=((1, 1, 1, 1, 1),))
    for t in tp:
        validate.divisor("tp", t, model.heads, "heads")
        link = Link("none", 1.0, 0.0, "unused")
        cluster = Cluster(recorder, 1, t, link, link)
        for b in micro_batch:
            step_time(model, Parallelism(tp=t, micro_batch_size=b), cluster, options=options)
    return sorted(recorder.seen)


def message_sizes(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    """``min_bytes``, x ``factor``, ... up to ``max_bytes`` (nccl-tests' -b, -e, -f)."""
    validate.integer("min_bytes", min_bytes, minimum=4)
    validate.integer("max_bytes", max_bytes, minimum=min_bytes)
    validate.integer("factor", factor, minimum=2)
    sizes, s = [], min_bytes
    while s <= max_bytes:
        sizes.append(s)
        s *= factor
    return sizes


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _summary(fn: Callable[[], Any], repeats: int, device: torch.device, clock: str = "wall",
             statistic: str = "median") -> float:
    """``statistic`` over ``repeats`` calls (after one warm-up) of the slowest rank's time on ``clock``."""
    return _summaries([fn], repeats, device, clock, statistic)[0]


def _summaries(fns: Sequence[Callable[[], Any]], repeats: int, device: torch.device,
               clock: str = "wall", statistic: str = "median") -> list[float]:
    """For each of ``fns``, ``statistic`` (:data:`dtlib.analytic.timing.STATISTICS`) over ``repeats`` calls
    (after one warm-up each) of the slowest rank's time on ``clock``, the calls taken in rounds (one
    of each function per round): a spell of interference (another job on the cores, a descheduled
    peer) then costs every function a few of its calls rather than one function all of its calls,
    and a median or a minimum keeps it out."""
    now = CLOCKS[clock]
    for fn in fns:
        fn()
    _sync(device)
    times = torch.zeros(len(fns), repeats, dtype=torch.float64)
    for i in range(repeats):
        for j, fn in enumerate(fns):
            if dist.is_initialized():
                dist.barrier()
            start = now()
            fn()
            _sync(device)
            times[j, i] = max(now() - start, 1e-9)
    if dist.is_initialized():
        times = times.to(device)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)  # a step waits for its slowest rank
    return [summarise(row, statistic) for row in times.cpu().tolist()]


def _gemm(m: int, n: int, k: int, batch: int, dtype: torch.dtype, device: torch.device) -> Callable[[], Any]:
    """One ``torch.matmul`` of ``batch`` ``M x K`` by ``K x N`` operands, allocated now."""
    a = torch.randn(batch, m, k, dtype=dtype, device=device)
    b = torch.randn(batch, k, n, dtype=dtype, device=device)
    a, b = (a[0], b[0]) if batch == 1 else (a, b)
    return lambda: torch.matmul(a, b)


def _gemm_rows(shapes: list[tuple[int, int, int, int]], seconds: Sequence[float]) -> list[dict[str, Any]]:
    return [{"m": m, "n": n, "k": k, "batch": batch, "seconds": t, "flops_per_s": 2 * m * n * k * batch / t}
            for (m, n, k, batch), t in zip(shapes, seconds)]


def _gemms(shapes: list[tuple[int, int, int, int]], dtype: torch.dtype, repeats: int,
           device: torch.device, clock: str, statistic: str = "median") -> list[dict[str, Any]]:
    """Each shape timed on its own (one shape's operands held at a time: a GPU's shapes can be large)."""
    return _gemm_rows(shapes, [_summary(_gemm(*shape, dtype, device), repeats, device, clock, statistic)
                               for shape in shapes])


def _attention(model: TransformerConfig, micro_batch: int, dtype: torch.dtype, repeats: int,
               device: torch.device, clock: str, statistic: str = "median") -> dict[str, Any]:
    head_dim = model.hidden // model.heads
    q, k, v = (torch.randn(micro_batch, model.heads, model.seq, head_dim, dtype=dtype, device=device,
                           requires_grad=True) for _ in range(3))

    def forward_backward() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    return {"micro_batch_size": micro_batch, "heads": model.heads, "seq": model.seq, "head_dim": head_dim,
            "causal": True, "seconds": _summary(forward_backward, repeats, device, clock, statistic)}


def _elementwise(elements: int, dtype: torch.dtype, repeats: int, device: torch.device,
                 clock: str, statistic: str = "median") -> dict[str, Any]:
    a, b, c = (torch.randn(elements, dtype=dtype, device=device) for _ in range(3))
    seconds = _summary(lambda: torch.add(a, b, out=c), repeats, device, clock, statistic)
    moved = 3 * elements * a.element_size()  # two read, one written
    return {"bytes": moved, "seconds": seconds, "bytes_per_s": moved / seconds}


class _Operators(TorchDispatchMode):
    """Counts the ATen operators dispatched inside it: in eager PyTorch each is a call through the
    dispatcher, its fixed cost (and on a GPU a kernel launch at most) whatever its work. Operators of
    the namespaces in ``skip`` (``c10d``: the collectives, timed by figures of their own) are not counted."""

    def __init__(self, skip: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.count, self.skip = 0, skip

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.count += func.namespace not in self.skip
        return func(*args, **(kwargs or {}))


def _counted(fn: Callable[[], Any], skip: tuple[str, ...] = ()) -> int:
    with _Operators(skip) as ops:
        fn()
    return ops.count


# operators in the chain _kernel_cost times: enough that one call's own overhead is small beside them
CHAIN = 32


def _kernel_cost(repeats: int, device: torch.device, clock: str, statistic: str = "median") -> dict[str, Any]:
    """The fixed cost of one operator: forward + backward of :data:`CHAIN` multiplications of a
    one-element tensor (the "overhead" regime, where an operator's time does not depend on its
    work: H. He, "Making Deep Learning Go Brrrr From First Principles", 2022, "Overhead"), over the
    ATen operators counted in it (forward, the autograd engine's backward), as the planner counts
    kernels (each forward kernel's backward two more, :data:`dtlib.plan.eager.PASSES`)."""
    w = torch.ones(1, device=device, requires_grad=True)

    def chain() -> None:
        y = w
        for _ in range(CHAIN):
            y = y * 1.0001
        y.backward()

    seconds = _summary(chain, repeats, device, clock, statistic)
    operators = _counted(chain)
    return {"operators": operators, "seconds": seconds, "seconds_per_kernel": seconds / operators}


def _one_rank_step(model: TransformerConfig, micro_batch: int, repeats: int, clock: str,
                   shapes: Sequence[tuple[int, int, int, int]] = (), dtype: torch.dtype = torch.float32,
                   statistic: str = "median") -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One training step of ``model`` (TinyGPT, AdamW, cross-entropy, fp32 as ``dtlib train``) on
    ``micro_batch`` sequences, on this rank alone (no collective): the seconds of its forward +
    backward and of its optimizer step, timed apart, and the ATen operators one
    transformer layer dispatches forward and backward (counted, :class:`_Operators`); and the GEMM
    rows of ``shapes``, timed in the same rounds (:func:`_summaries`): the planner subtracts its GEMMs
    from the forward + backward (:func:`dtlib.plan.measured.memory_bound_bandwidth`), and two figures
    taken minutes apart on a loaded machine would put the interference of one minute into the
    difference."""
    from dtlib.models import TinyGPT

    torch.manual_seed(0)
    net = TinyGPT(model)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    tokens = torch.randint(0, model.vocab, (micro_batch, model.seq + 1))
    x, y = tokens[:, :-1], tokens[:, 1:]

    def forward_backward() -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(net(x).flatten(0, 1), y.flatten()).backward()

    cpu = torch.device("cpu")
    # the optimizer steps on the gradients of the backward just before it in its round
    gemms = [_gemm(*shape, dtype, cpu) for shape in shapes]
    seconds, optimizer, *timed = _summaries([forward_backward, opt.step, *gemms], repeats, cpu, clock, statistic)
    hidden = torch.randn(micro_batch, model.seq, model.hidden, requires_grad=True)
    block = net.blocks[0]
    out: list[torch.Tensor] = []
    forward = _counted(lambda: out.append(block(hidden)))
    backward = _counted(lambda: out[0].sum().backward())
    return ({"micro_batch_size": micro_batch, "threads": torch.get_num_threads(),
             "forward_backward_seconds": seconds, "optimizer_seconds": optimizer, "seconds": seconds + optimizer,
             "layer_forward_kernels": forward, "layer_backward_kernels": backward}, _gemm_rows(list(shapes), timed))


def _zero3_layer_kernels(model: TransformerConfig, micro_batch: int) -> int:
    """The ATen operators ``dtlib.parallel.FSDP`` (``dtlib train --zero 3``) adds to one micro-batch's
    forward + backward of a TinyGPT layer that is a unit of its own: its two gathers' copy-out and
    views, the gradients' concatenation, rank-major copy and division, the used-parameter flags and
    the shard gradients. The layer's count under FSDP less its count alone, the collectives (``c10d``)
    left out: their own figures time them. A collective over all ranks (FSDP's gathers)."""
    from dtlib.models import TinyGPT
    from dtlib.parallel.fsdp import FSDP

    torch.manual_seed(0)
    layer = TinyGPT(model).blocks[0]
    hidden = torch.randn(micro_batch, model.seq, model.hidden, requires_grad=True)
    alone = _counted(lambda: layer(hidden).sum().backward())
    layer.zero_grad(set_to_none=True)  # FSDP shards the parameters; gradients of the full ones would not fit
    sharded = FSDP(layer)
    return _counted(lambda: sharded(hidden).sum().backward(), skip=("c10d",)) - alone


def _numel(nbytes: int, n: int) -> int:
    """float32 elements of a buffer of about ``nbytes`` that splits into ``n`` equal shards."""
    return max(nbytes // 4 // n * n, n)


def _collective(op: str, nbytes: int, ranks: list[int], group: Any, device: torch.device) -> Callable[[], Any]:
    """One call of ``op`` on ``nbytes`` (nccl-tests' S) in ``group`` of ``ranks``."""
    n, me = len(ranks), dist.get_rank()
    numel = _numel(nbytes, n)
    full = torch.randn(numel, device=device)
    shard = torch.randn(numel // n, device=device)
    if op == "all_reduce":
        return lambda: dist.all_reduce(full, group=group)
    if op == "reduce_scatter":
        return lambda: reduce_scatter_into(shard, full, group=group)
    if op == "all_gather":
        return lambda: all_gather_into(full, shard, group=group)
    if op == "all_to_all":
        out = torch.empty_like(full)
        return lambda: dist.all_to_all_single(out, full, group=group)
    if op == "broadcast":
        return lambda: dist.broadcast(full, src=ranks[0], group=group)
    # p2p: pairs (0, 1), (2, 3), ... of the group; one send and its receive; an odd rank out waits
    index = ranks.index(me)
    peer = index ^ 1
    if peer >= n:
        return lambda: None
    if index % 2 == 0:
        return lambda: dist.send(full, ranks[peer], group=group)
    return lambda: dist.recv(full, ranks[peer], group=group)


def _collectives(sizes: list[int], groups: list[list[int]], handles: list[Any], repeats: int,
                 device: torch.device, clock: str, statistic: str = "median") -> dict[str, Any]:
    """Each collective per size in the group of this rank, all groups at once; the sizes of one
    collective are timed in rounds (:func:`_summaries`), their buffers all held at once (about 4/3 of
    the largest size with the default factor 4)."""
    me = dist.get_rank()
    mine = next(i for i, g in enumerate(groups) if me in g)
    ranks, group = groups[mine], handles[mine]
    rows = []
    for op in COLLECTIVES:
        if op == "p2p" and len(ranks) < 2:
            continue
        # every size in each round (barriers over the world: every group alike)
        calls = [_collective(op, nbytes, ranks, group, device) for nbytes in sizes]
        timed = _summaries(calls, repeats, device, clock, statistic)
        for nbytes, seconds in zip(sizes, timed):
            size = _numel(nbytes, len(ranks)) * 4
            factor = float(BUS_FACTORS[op](len(ranks)))
            rows.append({"op": op, "bytes": size, "seconds": seconds, "algbw_bytes_per_s": size / seconds,
                         "busbw_bytes_per_s": size / seconds * factor})
    return {"ranks": len(ranks), "groups": len(groups), "rows": rows}


def _machine(world_size: int, nodes: int, device: torch.device) -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    if gpu:
        memory = torch.cuda.get_device_properties(device).total_memory
    else:  # the ranks of a node share its RAM
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (world_size // nodes)
    return {"hostname": socket.gethostname(), "cpu": cpu, "cpu_cores": os.cpu_count(),
            "gpu": gpu, "gpu_count": torch.cuda.device_count() if gpu else 0, "device": device.type,
            "ranks": world_size, "nodes": nodes, "ranks_per_node": world_size // nodes,
            "memory_bytes_per_rank": memory}


def _worker(rank: int, world_size: int, model: TransformerConfig, shapes: list[tuple[int, int, int, int]],
            micro_batch: int, middle: int, dtype: str, sizes: list[int], repeats: int, per_node: int,
            clock: str, statistic: str, measure_step: bool) -> dict[str, Any]:
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    torch.manual_seed(rank)
    nodes = world_size // per_node
    intra = [list(range(i * per_node, (i + 1) * per_node)) for i in range(nodes)]
    inter = [list(range(i, world_size, per_node)) for i in range(per_node)]
    # every rank creates every group, in the same order (torch.distributed.new_group's rule)
    intra_handles = [dist.new_group(g) for g in intra]
    inter_handles = [dist.new_group(g) for g in inter] if nodes > 1 else []
    torch_dtype = DTYPES[dtype]
    # CPU ranks time the one-rank step and the GEMMs in the same rounds (_one_rank_step)
    timing = (repeats, device, clock, statistic)
    step, gemm = (_one_rank_step(model, middle, repeats, clock, shapes, torch_dtype, statistic) if measure_step
                  else (None, _gemms(shapes, torch_dtype, *timing)))
    out = {"gemm": gemm,
           "attention": _attention(model, micro_batch, torch_dtype, *timing),
           "elementwise": _elementwise(micro_batch * model.seq * model.hidden, torch_dtype, *timing),
           # one rank per node (one GPU): no collective inside it to measure
           "intra": (_collectives(sizes, intra, intra_handles, *timing) if per_node > 1
                     else {"ranks": 1, "groups": nodes, "rows": []}),
           "inter": _collectives(sizes, inter, inter_handles, *timing) if nodes > 1 else None,
           "step": step,
           "zero3_layer_kernels": _zero3_layer_kernels(model, middle) if measure_step and world_size > 1 else None,
           "kernel": _kernel_cost(*timing),
           "threads_per_rank": torch.get_num_threads()}
    return out if rank == 0 else {}


def calibrate(model: TransformerConfig, nproc: int = 2, *, tp: Sequence[int] | None = None,
              micro_batch: Sequence[int] = (1, 2, 4), dtype: str | None = None, min_bytes: int = 1024,
              max_bytes: int = 16 * 2 ** 20, factor: int = 4, repeats: int = 7,
              options: StepOptions = StepOptions(flash_attention=False), clock: str | None = None,
              statistic: str = "median", ranks_per_node: int | None = None, measure_step: bool = True,
              timeout: float = 600.0) -> dict[str, Any]:
    """Measure this machine on ``nproc`` ranks (or, under torchrun, on torchrun's ranks) for
    ``model``, and return the profile (:data:`FORMAT`; see the module docstring). ``tp`` (default:
    1 and every divisor of ``nproc`` that divides the heads) and ``micro_batch`` choose the GEMM
    shapes; ``options`` the planner's conventions they are recorded under (default explicit
    attention, as ``dtlib train``'s TinyGPT); ``dtype`` (default fp32 on CPU, bf16 on CUDA) the
    precision they run in; ``min_bytes`` .. ``max_bytes`` by ``factor`` the message sizes;
    ``clock`` one of :data:`CLOCKS` (default ``cpu`` on CPU ranks, ``wall`` on GPUs); ``statistic``
    how a figure's ``repeats`` become one (:data:`dtlib.analytic.timing.STATISTICS`: default ``median``;
    ``min`` keeps only the least disturbed call, the estimator for a loaded machine);
    ``ranks_per_node``: the ranks of ``nproc`` taken as one node (default all; fewer groups them
    into nodes on this machine, to exercise the measurement across nodes), under torchrun its
    ``LOCAL_WORLD_SIZE``; ``measure_step``: time one-rank steps of ``model`` as TinyGPT for the
    memory-bound bandwidth (CPU ranks only; a preset's full model may not fit a CPU rank)."""
    from dtlib.launcher import run_from_env, under_torchrun

    validate.integer("nproc", nproc, minimum=1)
    validate.integer("repeats", repeats, minimum=3)
    validate.one_of("statistic", statistic, STATISTICS)
    for b in micro_batch:
        validate.integer("micro_batch", b)
    torchrun = under_torchrun()
    world = int(os.environ["WORLD_SIZE"]) if torchrun else nproc
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world)) if torchrun else (ranks_per_node or nproc)
    validate.divisor("ranks_per_node", per_node, world, "ranks")
    gpu = torchrun and torch.cuda.is_available()
    dtype = dtype or ("bf16" if gpu else "fp32")
    validate.one_of("dtype", dtype, DTYPES)
    clock = clock or ("wall" if gpu else "cpu")
    validate.one_of("clock", clock, CLOCKS)
    if gpu and clock == "cpu":
        raise ValueError("clock 'cpu' times the host, not the GPU's kernels: use clock 'wall' on GPUs")
    tp = tuple(tp) if tp else tuple(t for t in range(1, per_node + 1) if per_node % t == 0 and model.heads % t == 0)
    shapes = planned_gemm_shapes(model, tp, micro_batch, options)
    sizes = message_sizes(min_bytes, max_bytes, factor)
    # the middle micro-batch for the step: per-operator costs do not scale with bytes, so one
    # bandwidth fits the micro-batches around the one it was measured at best
    middle = sorted(micro_batch)[len(micro_batch) // 2]
    args = (model, shapes, max(micro_batch), middle, dtype, sizes, repeats, per_node, clock, statistic,
            measure_step and not gpu)
    if torchrun:
        found = run_from_env(_worker, *args, timeout=timeout)
    else:
        found = dtlib.launch(_worker, nproc, args=args, timeout=timeout, output="none")[0]
    if not found:  # a torchrun rank other than 0
        return {}
    zero3 = found.pop("zero3_layer_kernels")
    if found["step"]:
        found["step"]["zero3_layer_kernels"] = zero3
        found["step"].update(memory_bound_bandwidth(model, options, found["step"], found["gemm"],
                                                    found["kernel"]["seconds_per_kernel"]))
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    machine = _machine(world, world // per_node, device)
    machine["threads_per_rank"] = found.pop("threads_per_rank")  # a rank's, as dtlib.launch set it
    return {"format": FORMAT, "machine": machine,
            "versions": {"torch": torch.__version__, "dtlib": dtlib.__version__, "python": platform.python_version()},
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "backend": "nccl" if gpu else "gloo", "dtype": dtype, "clock": clock, "statistic": statistic,
            "tp": list(tp), "micro_batch": list(micro_batch), "repeats": repeats,
            "model_config": dataclasses.asdict(model), "options": dataclasses.asdict(options),
            "units": {"seconds": f"s ({clock} clock), {statistic} of repeats of the slowest rank", "bytes": "B (nccl-tests' S)",
                      "flops_per_s": "FLOP/s (2 M N K batch / seconds)", "bytes_per_s": "B/s",
                      "busbw_bytes_per_s": "B/s, nccl-tests bus bandwidth", "algbw_bytes_per_s": "B/s, S / seconds"},
            **found}
