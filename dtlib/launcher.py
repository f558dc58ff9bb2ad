"""Start N ranks from a notebook cell or a script, with a real ``torch.distributed`` process group.

``launch(fn, world_size)`` runs ``fn(rank, world_size, *args)`` in ``world_size`` processes and
returns their results in rank order. It exists because ``torch.multiprocessing.spawn`` cannot
start a function defined in a notebook cell (the child re-imports ``__main__``, which a notebook
does not have). Here:

* on Linux with the gloo backend the workers are *forked*, so notebook-defined functions just work
  and start in milliseconds (torch is already imported);
* elsewhere, and for NCCL (CUDA cannot be used after fork), the workers are *spawned* and the
  function travels by value with ``cloudpickle``;
* every launch hosts its own ``TCPStore`` on a port the OS picks, so launches never collide
  (started after the ranks are forked, and its port sent to them through a pipe);
* a rank that raises, hangs or is interrupted brings the whole launch down, and a launching
  process that dies (a restarted kernel) takes its ranks with it: no process is left.

The same worker code runs unchanged under ``torchrun``: call :func:`run_from_env` (or
:func:`init_from_env`) from the script, as PyTorch's own examples do with ``env://``.

About 620 lines, over the usual 400: starting, watching (a slow rank told from a stuck one by its
CPU time) and tearing down the ranks share the
workdir, the pipes and the result/error files (and their optional data-only codec, see
:func:`set_result_codec`); split, each part would need the others' file formats.
"""
from __future__ import annotations

from dtlib.extras import require

require("course", "torch", "cloudpickle", feature=__name__)

import contextlib
import errno
import faulthandler
import json
import multiprocessing as mp
import os
import pickle
import re
import resource
import shutil
import signal
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Sequence

import cloudpickle
import torch
import torch.distributed as dist

from dtlib.analytic import validate

__all__ = [
    "launch",
    "LaunchError",
    "RankFailedError",
    "LaunchTimeoutError",
    "resolve_backend",
    "init_from_env",
    "run_from_env",
    "under_torchrun",
    "get_device",
    "set_result_codec",
]

_OUTPUT_MODES = ("rank0", "all", "none")


class LaunchError(RuntimeError):
    """Base class for failures of a launched group of ranks."""


class RankFailedError(LaunchError):
    """A rank raised; ``rank`` is the first rank that failed, ``rank_traceback`` its traceback."""

    def __init__(self, message: str, rank: int, rank_traceback: str):
        super().__init__(message)
        self.rank = rank
        self.rank_traceback = rank_traceback


class LaunchTimeoutError(LaunchError):
    """Some ranks did not finish in time; ``unfinished`` lists them, ``slow`` those of them that
    were still computing at the end (their CPU time grew: slow, not stuck)."""

    def __init__(self, message: str, unfinished: list[int], slow: list[int] | None = None):
        super().__init__(message)
        self.unfinished = unfinished
        self.slow = list(slow or [])


def _gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_backend(backend: str, world_size: int) -> str:
    """``"auto"`` -> NCCL with one GPU per rank when enough GPUs exist, otherwise gloo on CPU."""
    if backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', got {backend!r}")
    gpus = _gpu_count()
    if backend == "auto":
        return "nccl" if gpus >= world_size and dist.is_nccl_available() else "gloo"
    if backend == "nccl" and gpus < world_size:
        raise ValueError(
            f"backend='nccl' needs one GPU per rank, but world_size={world_size} and only {gpus} "
            f"GPU(s) are visible; use world_size <= {gpus} or backend='gloo' (CPU)"
        )
    return backend


def get_device() -> torch.device:
    """The device this rank should compute on: ``cuda:{LOCAL_RANK}`` under NCCL, else CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def _default_start_method(backend: str) -> str:
    # fork keeps notebook-defined functions and costs no re-import of torch; it is unsafe once
    # CUDA is initialised and unavailable/unsafe on macOS and Windows, where spawn is used.
    if sys.platform.startswith("linux") and backend == "gloo" and not torch.cuda.is_initialized():
        return "fork"
    return "spawn"


_prewarmed = False

# How ranks send results and errors back: cloudpickle by default. A caller that must not unpickle
# what a rank wrote (a grader whose ranks run untrusted code) installs a data-only codec instead.
_codec: tuple[Callable[[Any], bytes], Callable[[bytes], Any]] | None = None


def set_result_codec(encode: Callable[[Any], bytes] | None,
                     decode: Callable[[bytes], Any] | None = None) -> None:
    """Send rank results with ``encode`` (in the rank) and read them with ``decode`` (here), and
    rank errors as JSON text (type name, message, traceback) instead of pickled exceptions.

    For callers whose ranks run code they do not trust: a pickle a rank wrote can run anything
    when read. ``set_result_codec(None)`` restores cloudpickle.
    """
    global _codec
    if (encode is None) != (decode is None):
        raise ValueError("set_result_codec needs both encode and decode, or neither")
    _codec = None if encode is None else (encode, decode)


def _prewarm_before_fork() -> None:
    """Pay, once in the parent, for lazy imports every rank would otherwise repeat after fork.

    Building the first ``torch.optim`` optimizer of a process imports ``torch._dynamo`` (seconds);
    forked ranks inherit the parent's modules, so importing it here makes every launch start fast.
    """
    global _prewarmed
    if not _prewarmed:
        torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0)
        _prewarmed = True


def _to_cpu(obj: Any) -> Any:
    """Move tensors in (nested) results to CPU so the caller never needs a GPU to read them."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def _die_with_parent(parent_pid: int) -> None:
    """End this rank if the launching process dies (a killed kernel must not leave ranks behind).

    Linux: the kernel sends SIGKILL on the parent's death (``prctl(PR_SET_PDEATHSIG)``, as
    torchrun's workers do); elsewhere a daemon thread polls the parent's pid.
    """
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    else:
        import threading

        def watch() -> None:
            while os.getppid() == parent_pid:
                time.sleep(0.5)
            os._exit(1)

        threading.Thread(target=watch, daemon=True).start()
    if os.getppid() != parent_pid:  # the parent died before the guard was in place
        os._exit(1)


_WHERE_SIGNAL = signal.SIGUSR1  # "write your stacks": faulthandler in each rank

# A launch whose ranks are still computing at its deadline is slow, not stuck (a busy machine runs
# the same work in more seconds): its deadline moves on while their CPU time grows, up to this many
# times the timeout. Ranks that wait (a collective a peer never calls) use no CPU and stop at the
# first deadline.
SLOW_GRACE = 3.0
_PROGRESS_WINDOW_S = 1.0  # CPU time must grow within this window to count as progress


def _worker(rank: int, world_size: int, backend: str, port_conn: Any, timeout: float,
            workdir: str, payload: Any, parent_pid: int) -> None:
    """Body of one rank: redirect output, join the process group, run ``fn``, report back."""
    os.setpgrp()  # own process group, so the parent can kill this rank *and* anything it started
    _die_with_parent(parent_pid)
    log = open(os.path.join(workdir, f"out{rank}.txt"), "w", buffering=1)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    # When the parent gives up on this rank it asks (SIGUSR1) where the rank is: every thread's
    # Python stack goes into its output, which the timeout error then shows.
    faulthandler.register(_WHERE_SIGNAL, file=log, all_threads=True)
    timeout = SLOW_GRACE * timeout  # collectives and the store may wait as long as the parent does
    code = 1
    try:
        fn, args = cloudpickle.loads(payload) if isinstance(payload, bytes) else payload
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                          LOCAL_WORLD_SIZE=str(world_size))
        # A forked child must not enter an OpenMP parallel region the parent's thread pool has
        # used (libgomp is not fork-safe: it deadlocks), so forked ranks run single-threaded,
        # as DataLoader workers do. Spawned ranks share the cores instead of oversubscribing.
        forked = not isinstance(payload, bytes)
        torch.set_num_threads(1 if forked else max(1, (os.cpu_count() or 1) // world_size))
        if backend == "nccl":
            torch.cuda.set_device(rank)
        if not port_conn.poll(timeout):
            raise TimeoutError("the launcher never sent the rendezvous port")
        store = dist.TCPStore("127.0.0.1", port_conn.recv(), world_size, is_master=False,
                              timeout=timedelta(seconds=timeout))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout))
        # gloo's full-mesh connect can return on one rank while a peer is still finishing its
        # side; a rank whose fn then returns at once would close the socket under that peer
        # ("Connection closed by peer"). Wait on the store until every rank has joined.
        store.set(f"dtlib/joined/{rank}", "1")
        store.wait([f"dtlib/joined/{r}" for r in range(world_size)])
        result = fn(rank, world_size, *args)
        try:
            blob = (_codec[0] if _codec else cloudpickle.dumps)(_to_cpu(result))
        except Exception as exc:
            raise TypeError(f"rank {rank} returned a value that cannot be sent back to the caller "
                            f"({type(result).__name__}): {exc}") from exc
        _atomic_write(os.path.join(workdir, f"result{rank}.pkl"), blob)
        code = 0
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the caller
        # Written before the group is torn down, so the root cause carries the earliest time.
        if _codec:
            report = {"time": time.time(), "traceback": traceback.format_exc(),
                      "type": type(exc).__name__, "message": str(exc)}
            _atomic_write(os.path.join(workdir, f"error{rank}.json"), json.dumps(report).encode())
        else:
            try:
                exc_blob = cloudpickle.dumps(exc)
            except Exception:
                exc_blob = None
            report = (time.time(), traceback.format_exc(), exc_blob)
            _atomic_write(os.path.join(workdir, f"error{rank}.pkl"), pickle.dumps(report))
    finally:
        faulthandler.unregister(_WHERE_SIGNAL)
        if dist.is_initialized():
            dist.destroy_process_group()
        log.flush()
        os._exit(code)  # skip atexit handlers inherited from the parent (e.g. the notebook's)


def _atomic_write(path: str, data: bytes) -> None:
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(path + ".tmp", path)


class _OutputPump:
    """Copies rank 0's output to the caller's ``sys.stdout`` while the ranks run."""

    def __init__(self, workdir: str):
        self.path = os.path.join(workdir, "out0.txt")
        self.offset = 0

    def pump(self, whole_lines_only: bool = True) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return
        # While ranks run, emit whole lines only, so a line is never split between two reads.
        end = chunk.rfind(b"\n") + 1 if whole_lines_only else len(chunk)
        if end:
            sys.stdout.write(chunk[:end].decode(errors="replace"))
            sys.stdout.flush()
            self.offset += end

    def flush_rest(self) -> None:
        self.pump(whole_lines_only=False)


def _read_output(workdir: str, rank: int) -> str:
    try:
        with open(os.path.join(workdir, f"out{rank}.txt"), "rb") as f:
            return f.read().decode(errors="replace")
    except FileNotFoundError:
        return ""


def _kill(procs: Sequence[mp.process.BaseProcess]) -> None:
    for p in procs:
        if p.pid is None:
            continue
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if p.is_alive():
            p.kill()
    for p in procs:
        if p.pid is not None:
            p.join(5)


# The longest launch a timeout may ask for: no lesson or test needs more than a week.
MAX_TIMEOUT = 7 * 24 * 3600.0


def _validate(fn: Callable, world_size: int, args: Sequence, timeout: float, output: str) -> None:
    """Every argument checked in the caller's process, before any rank is forked."""
    if not callable(fn):
        raise TypeError(f"fn must be callable as fn(rank, world_size, *args), got {type(fn).__name__}")
    validate.integer("world_size", world_size)
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"args must be a tuple of extra arguments for fn, got {type(args).__name__}")
    validate.number("timeout", timeout, maximum=MAX_TIMEOUT)  # seconds; True is not 1 s
    validate.one_of("output", output, _OUTPUT_MODES)


def launch(fn: Callable[..., Any], world_size: int = 2, args: Sequence[Any] = (),
           backend: str = "auto", timeout: float = 60.0, output: str = "rank0",
           start_method: str | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return results in rank order.

    Args:
        fn: the per-rank function; may be defined in a notebook cell.
        world_size: number of ranks (processes).
        args: extra arguments, sent to every rank (they must be picklable by cloudpickle).
        backend: ``"auto"`` (NCCL if there is a GPU per rank, else gloo), ``"gloo"`` or ``"nccl"``.
        timeout: seconds the whole launch may take while its ranks wait; ranks still computing
            at the deadline (their CPU time growing) are slow, not stuck, and get up to
            ``SLOW_GRACE`` x ``timeout`` (also the collective timeout inside the ranks).
        output: ``"rank0"`` shows rank 0's prints live; ``"all"`` also shows the other ranks'
            output afterwards, each line prefixed with ``[rank k]``; ``"none"`` shows nothing.
        start_method: ``"fork"`` or ``"spawn"``; default: fork on Linux with gloo, else spawn.

    Raises:
        RankFailedError: a rank raised (the message names it and carries its traceback).
        LaunchTimeoutError: ranks still running after ``timeout`` seconds, stuck (no CPU used in
            the last second), or still computing after ``SLOW_GRACE`` x ``timeout``: the message
            says which ("stuck" or "slow") and where each rank was.
        KeyboardInterrupt: re-raised after every rank has been stopped.
    """
    _validate(fn, world_size, args, timeout, output)
    backend = resolve_backend(backend, world_size)
    start_method = start_method or _default_start_method(backend)
    if start_method not in ("fork", "spawn", "forkserver"):
        raise ValueError(f"start_method must be 'fork', 'spawn' or 'forkserver', got {start_method!r}")
    if start_method == "fork":
        # Forked children inherit the objects themselves: nothing to pickle (a big dataset in
        # args or in fn's closure would otherwise be serialised only to be thrown away).
        payload: Any = (fn, tuple(args))
        _prewarm_before_fork()
    else:
        try:
            payload = cloudpickle.dumps((fn, tuple(args)))
        except Exception as exc:
            raise TypeError(
                f"an argument of launch() cannot be sent to a worker process ({exc}); pass only "
                "picklable values (tensors, numbers, strings, containers, functions, modules' classes)"
            ) from exc

    ctx = mp.get_context(start_method)
    pipes = _pipes(ctx, world_size)
    workdir = tempfile.mkdtemp(prefix="dtlib-launch-")
    procs = [ctx.Process(target=_worker, name=f"dtlib-rank{r}",
                         args=(r, world_size, backend, pipes[r][0], timeout, workdir, payload,
                               os.getpid()))
             for r in range(world_size)]
    pump = _OutputPump(workdir) if output != "none" else None
    store = None
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        for p in procs:
            p.start()
        # The store's server thread is started only after every fork: a child forked while that
        # thread holds a lock can deadlock before running a line of its own (seen with gloo).
        store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True,
                              wait_for_workers=False, timeout=timedelta(seconds=timeout))
        for _, writer in pipes:
            writer.send(store.port)
        _wait(procs, workdir, timeout, pump)
        if pump:
            pump.flush_rest()
        if output == "all":
            for r in range(1, world_size):
                for line in _read_output(workdir, r).splitlines():
                    print(f"[rank {r}] {line}")
        return [_read_result(workdir, r, procs[r].exitcode) for r in range(world_size)]
    finally:
        _kill(procs)
        del store
        shutil.rmtree(workdir, ignore_errors=True)


def _pipes(ctx: Any, world_size: int) -> list[tuple[Any, Any]]:
    """One pipe a rank (the store's port goes through it); past the open-file limit, a clear error
    instead of ``OSError: Too many open files``, with every pipe made so far closed."""
    pipes: list[tuple[Any, Any]] = []
    try:
        for _ in range(world_size):
            pipes.append(ctx.Pipe(duplex=False))
    except OSError as exc:
        for reader, writer in pipes:
            reader.close()
            writer.close()
        if exc.errno != errno.EMFILE:
            raise
        limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        raise ValueError(f"world_size {world_size} needs {2 * world_size} pipe ends in this process, past its "
                         f"open-file limit of {limit} (ulimit -n): launch fewer ranks on this machine") from None
    return pipes


def _read_result(workdir: str, rank: int, exitcode: int | None) -> Any:
    """Rank ``rank``'s return value; a rank that ended without writing one (``os._exit(0)`` in
    ``fn``, or a process killed between its result and its exit) is a clear error."""
    try:
        with open(os.path.join(workdir, f"result{rank}.pkl"), "rb") as f:
            return _codec[1](f.read()) if _codec else cloudpickle.load(f)
    except FileNotFoundError:
        raise RankFailedError(
            f"rank {rank} exited (code {exitcode}) without returning a result: did fn call "
            "os._exit() (or exit the process another way) before returning?", rank, "") from None


def _cpu_ticks(pid: int | None) -> int | None:
    """User + system CPU time of process ``pid`` and its threads, in clock ticks (``/proc/<pid>/stat``
    fields 14 and 15, proc(5)); None where /proc cannot say (another OS, a process gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # the command name may hold spaces
        return int(fields[11]) + int(fields[12])
    except (OSError, ValueError, IndexError):
        return None


def _wait(procs: Sequence[mp.process.BaseProcess], workdir: str, timeout: float,
          pump: _OutputPump | None) -> None:
    start = time.monotonic()
    deadline, last_chance = start + timeout, start + SLOW_GRACE * timeout
    sample = (start, [_cpu_ticks(p.pid) for p in procs])
    while True:
        if pump:
            pump.pump()
        codes = [p.exitcode for p in procs]
        if all(c == 0 for c in codes):
            return
        failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            time.sleep(0.2)  # let peers that failed because of this rank report too
            _raise_first_failure(procs, workdir, pump)
        now = time.monotonic()
        if now - sample[0] >= _PROGRESS_WINDOW_S or now > deadline:
            ticks = [_cpu_ticks(p.pid) for p in procs]
            unfinished = [r for r, c in enumerate(codes) if c is None]
            slow = [r for r in unfinished if None not in (ticks[r], sample[1][r]) and ticks[r] > sample[1][r]]
            if now > deadline:
                if slow and now < last_chance:
                    deadline = min(last_chance, now + _PROGRESS_WINDOW_S)
                else:
                    raise _timeout_error(procs, workdir, timeout, now - start, codes, slow)
            sample = (now, ticks)
        time.sleep(0.01)


def _timeout_error(procs: Sequence[mp.process.BaseProcess], workdir: str, timeout: float, elapsed: float,
                   codes: list[int | None], slow: list[int]) -> LaunchTimeoutError:
    unfinished = [r for r, c in enumerate(codes) if c is None]
    for r in unfinished:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(procs[r].pid, _WHERE_SIGNAL)
    time.sleep(0.3)  # faulthandler writes from its signal handler, at once
    done = [r for r, c in enumerate(codes) if c == 0]
    where = "".join(f"\n--- where rank {r} was ---\n{_stuck_at(workdir, r)}" for r in unfinished)
    if slow:
        verdict = (f"ranks {unfinished} did not finish within {timeout:g} s (finished: {done}), and ranks {slow} "
                   f"were still computing after {elapsed:.0f} s (their CPU time kept growing): slow, not stuck. "
                   "A busy machine runs the same work in more seconds; raise `timeout` if it is simply long.\n")
    else:
        verdict = (f"ranks {unfinished} did not finish within {timeout:g} s (finished: {done}) and used no CPU "
                   f"in their last {_PROGRESS_WINDOW_S:g} s: stuck, waiting. A rank that skips a collective, or "
                   "calls them in a different order, waits forever for its peers.\n")
    return LaunchTimeoutError(verdict + where, unfinished, slow)


def _stuck_at(workdir: str, rank: int, limit: int = 1500) -> str:
    """The Python stacks faulthandler wrote for a rank when the launch gave up on it, innermost
    frames first."""
    out = _read_output(workdir, rank)
    dump = re.search(r"^(?:Current thread|Thread) 0x", out, re.M)
    return (out[dump.start():dump.start() + limit] if dump else out[-limit:]) or "(no output)\n"


def _lost_peer(error_line: str) -> bool:
    """Whether a rank's error is gloo's transport losing a peer ("Connection closed by peer",
    "Connection reset by peer") rather than a failure of its own."""
    return "closed by peer" in error_line or "reset by peer" in error_line


def _raise_first_failure(procs: Sequence[mp.process.BaseProcess], workdir: str,
                         pump: _OutputPump | None) -> None:
    reports = {}
    for r, p in enumerate(procs):
        path = os.path.join(workdir, f"error{r}.pkl")
        if _codec and os.path.exists(path[:-3] + "json"):
            reports[r] = _json_report(path[:-3] + "json")
        elif os.path.exists(path) and not _codec:
            with open(path, "rb") as f:
                reports[r] = pickle.load(f)
        elif p.exitcode not in (None, 0):
            reports[r] = (time.time(), f"rank {r} died with exit code {p.exitcode} "
                                       "(killed by a signal or out of memory?)\n", None)
    _kill(procs)
    if pump:
        pump.flush_rest()
    # The earliest error is the cause; later ones are usually peers losing their connection.
    rank = min(reports, key=lambda r: reports[r][0])
    _, tb, exc_blob = reports[rank]
    cause = exc_blob if isinstance(exc_blob, BaseException) else None
    if isinstance(exc_blob, bytes):
        try:
            cause = cloudpickle.loads(exc_blob)
        except Exception:
            cause = None
    last_line = tb.strip().splitlines()[-1] if tb.strip() else "unknown error"
    others = sorted(set(reports) - {rank})
    finished = [r for r, p in enumerate(procs) if p.exitcode == 0 and r not in reports]
    what = last_line
    if finished and _lost_peer(last_line):
        # The transport's error ("Connection closed by peer ... GLHF!") is not the cause: a peer
        # returned without calling the collective. Say that first; the transport's words stay in
        # the traceback below, not chained ahead of this message.
        what = (f"it waited in a collective that ranks {finished} never called (they had "
                "already returned): every rank must call the same collectives in the same order")
        cause = None
    message = (f"rank {rank} of {len(procs)} failed: {what}"
               + (f" (ranks {others} failed after it)" if others else "")
               + f"\n\n--- traceback of rank {rank} ---\n{tb}")
    tail = _read_output(workdir, rank)[-2000:]
    if rank != 0 and tail.strip():
        message += f"\n--- last output of rank {rank} ---\n{tail}"
    raise RankFailedError(message, rank, tb) from cause


def _json_report(path: str) -> tuple[float, str, BaseException | None]:
    """A rank's error written as JSON (see :func:`set_result_codec`): its time, its traceback and
    a stand-in exception of the same type name and message (never the rank's own object)."""
    try:
        with open(path, "rb") as f:
            report = json.loads(f.read(1 << 20))
        name = str(report["type"])
        kind = type(name if name.isidentifier() else "RankError", (Exception,), {})
        return float(report["time"]), str(report["traceback"]), kind(str(report["message"]))
    except Exception:  # a rank that wrote garbage there still failed
        return time.time(), "the rank's error report was unreadable\n", None


_TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def under_torchrun() -> bool:
    """Whether this process was started by torchrun (its env:// variables are set)."""
    return all(k in os.environ for k in _TORCHRUN_VARIABLES)


def init_from_env(backend: str = "auto", timeout: float = 1800.0) -> tuple[int, int, torch.device]:
    """Join the process group described by torchrun's environment (``env://`` rendezvous).

    Returns ``(rank, world_size, device)``; the device is ``cuda:{LOCAL_RANK}`` under NCCL.
    """
    validate.number("timeout", timeout, maximum=MAX_TIMEOUT)
    missing = [k for k in _TORCHRUN_VARIABLES if k not in os.environ]
    if missing:
        raise RuntimeError(
            f"environment variables {missing} are not set: this process was not started by "
            "torchrun. Run `torchrun --nproc_per_node=N script.py`, or use dtlib.launch(fn, N) "
            "from Python or a notebook."
        )
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    backend = resolve_backend(backend, local_world)
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend, init_method="env://", timeout=timedelta(seconds=timeout))
    return rank, world_size, get_device()


def run_from_env(fn: Callable[..., Any], *args: Any, backend: str = "auto",
                 timeout: float = 1800.0) -> Any:
    """Under torchrun: initialise from the environment, run ``fn(rank, world_size, *args)``, clean up."""
    rank, world_size, _ = init_from_env(backend, timeout)
    try:
        return fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()
