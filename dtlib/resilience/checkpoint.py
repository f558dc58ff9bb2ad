"""Sharded, atomic, asynchronous checkpoints that load on another layout (torch.distributed.checkpoint).

One checkpoint is a directory ``step00000012/`` written by DCP (``torch.distributed.checkpoint``:
one ``__<rank>_0.distcp`` file per rank plus ``.metadata``) and a ``manifest.json`` from rank 0:
the step, the data position, the layout it was written with, every parameter's shape, the
optimizer's hyper-parameters, and each file's size and sha256.

* **What is saved, as the layout holds it.** Every parameter and its optimizer state in its full
  shape, as chunks each rank writes for the part it holds (:mod:`dtlib.resilience.chunks`): the
  whole tensor when it is replicated (one process, DDP: DCP writes one copy), a slab under tensor
  parallelism, a box of whole rows under :class:`~dtlib.parallel.FSDP` (its dim-0 shards, model
  and optimizer), the boxes of a flat shard under :class:`~dtlib.parallel.ShardedOptimizer`
  (ZeRO-1/2: optimizer), only its stages' or its
  experts' tensors under pipeline or expert parallelism (``owned``). DCP's planner reads any
  other split back: FSDP on 4 ranks loads on 2, dp2 x tp2 loads on dp4, tp2 x pp2 on one process
  (resharding).
* **Every RNG** (torch CPU and CUDA, Python's ``random``, NumPy) of every rank, under the rank's own
  key; restored when the world size is the same (another world has other ranks: it is reseeded
  by the caller and :meth:`Checkpointer.load` says so).
* **Atomic**: DCP writes into ``.tmp-step00000012/``; once every rank's data is there rank 0 checks
  and fingerprints the files, writes ``manifest.json`` last, renames the directory to
  ``step00000012`` and points ``latest`` at it (a write-then-``os.replace``). A process killed
  while saving leaves a ``.tmp-`` directory that loading ignores and the next save removes.
* **Asynchronous** (``async_save=True``): ``dcp.async_save`` copies the state to CPU memory and
  returns; the files are written by a background thread, which then publishes the checkpoint. Its
  collectives run on a process group of their own (on gloo they otherwise interleave with training's
  and crash: ``Received data size doesn't match``). :attr:`Checkpointer.blocking_seconds` records
  how long each save held the training loop.
* **Retention**: after a checkpoint is published, older ones are deleted except the last
  ``keep_last`` and every ``milestone_every``-th step: a checkpoint is only ever deleted once a
  newer one is complete.
* **Errors name the file**: a missing, truncated or corrupt file, a missing manifest, or a
  checkpoint of another model raise :class:`CheckpointError` naming the file and what is wrong,
  before anything is loaded (never a silent partial load).

Follows ``torch.distributed.checkpoint`` (save/async_save/load, ``FileSystemWriter``) and the
conventions of torchtitan's ``CheckpointManager`` (step directories, keep-latest-k, async with a
separate gloo group). ``dtlib train --checkpoint-dir/--checkpoint-every/--resume`` saves through it.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import pickle
import random
import re
import shutil
import threading
import time
import warnings
from concurrent.futures import Future
from typing import Any, Callable, Iterator

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from dtlib.analytic import validate
from dtlib.outputs import check_output_file
from dtlib.resilience import chunks

__all__ = ["Checkpointer", "CheckpointError", "checkpoint_steps", "latest_checkpoint", "read_manifest",
           "verify_files", "check_model", "to_torch", "rng_state", "set_rng_state", "file_sha256"]

FORMAT = 2  # 2: tensors in their full shapes (1 stored them flattened)
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step(\d{8})$")


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """DCP warns "torch.distributed is disabled" even when one process passes no_dist=True on purpose."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded: the message names the file and what is wrong."""


# ---- random number generators -------------------------------------------------------------------
def rng_state() -> dict[str, Any]:
    """Every RNG this process draws from: torch CPU (and CUDA), Python's ``random``, NumPy."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---- the directory ------------------------------------------------------------------------------
def _step_dir(directory: str, step: int) -> str:
    return os.path.join(directory, f"step{step:08d}")


def checkpoint_steps(directory: str) -> list[int]:
    """Steps of the complete checkpoints in ``directory`` (those with a manifest), in order."""
    if not os.path.isdir(directory):
        return []
    steps = []
    for name in os.listdir(directory):
        m = _STEP_DIR.match(name)
        if m and os.path.exists(os.path.join(directory, name, MANIFEST)):
            steps.append(int(m.group(1)))
    return sorted(steps)


def latest_checkpoint(directory: str) -> str | None:
    """The newest complete checkpoint's path, or None."""
    steps = checkpoint_steps(directory)
    return _step_dir(directory, steps[-1]) if steps else None


def read_manifest(path: str) -> dict[str, Any]:
    """The manifest of checkpoint ``path`` (a step directory); CheckpointError if absent or unreadable."""
    file = os.path.join(path, MANIFEST)
    if not os.path.exists(file):
        raise CheckpointError(f"{file} is missing: {path} is not a complete checkpoint (a save that "
                              "did not finish, or not a dtlib checkpoint)")
    try:
        with open(file) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{file} is not valid JSON ({e}): the checkpoint is corrupt") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{file} holds a JSON {type(manifest).__name__}, not a manifest: "
                              "the checkpoint is corrupt")
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{file} has format {manifest.get('format')!r}, this dtlib reads {FORMAT}")
    return manifest


def file_sha256(path: str) -> str:
    """SHA-256 of a file's bytes (read in 1 MiB blocks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fingerprint(path: str) -> dict[str, dict[str, Any]]:
    return {name: {"bytes": os.path.getsize(os.path.join(path, name)), "sha256": file_sha256(os.path.join(path, name))}
            for name in sorted(os.listdir(path)) if name != MANIFEST}


def verify_files(path: str, manifest: dict[str, Any] | None = None, checksums: bool = True) -> None:
    """Every file the manifest lists is there, with its size (and sha256): CheckpointError naming
    the first that is missing, truncated or corrupt."""
    manifest = manifest or read_manifest(path)
    for name, want in manifest["files"].items():
        file = os.path.join(path, name)
        if not os.path.exists(file):
            raise CheckpointError(f"{file} is missing (a shard of the checkpoint written by "
                                  f"{manifest['world_size']} ranks)")
        size = os.path.getsize(file)
        if size != want["bytes"]:
            raise CheckpointError(f"{file} is truncated or overwritten: {size} bytes, the manifest "
                                  f"says {want['bytes']}")
        if checksums and file_sha256(file) != want["sha256"]:
            raise CheckpointError(f"{file} is corrupt: its sha256 differs from the manifest's")


def check_model(path: str, manifest: dict[str, Any], shapes: dict[str, list[int]],
                 everyone: dict[str, list[int]]) -> None:
    """``shapes`` (this rank's full shapes by name) are saved with the same shapes, and every saved
    name is in ``everyone`` (all ranks' names): CheckpointError naming the manifest otherwise."""
    saved = manifest["shapes"]
    missing, unexpected = sorted(set(shapes) - set(saved)), sorted(set(saved) - set(everyone))
    wrong = [f"{k}: {saved[k]} saved, {shapes[k]} here" for k in shapes if k in saved and saved[k] != shapes[k]]
    if missing or unexpected or wrong:
        raise CheckpointError(f"{os.path.join(path, MANIFEST)} is from an incompatible model: "
                              f"missing {missing[:3]}, unexpected {unexpected[:3]}, shapes {wrong[:3]}")


# ---- the checkpointer ---------------------------------------------------------------------------
class Checkpointer:
    """Save and load a run's state in ``directory`` (every rank calls every method).

    Args:
        directory: where step directories go (shared by all ranks).
        keep_last: complete checkpoints always kept (the newest ones), >= 1.
        milestone_every: also keep every checkpoint whose step is a multiple of this (0: none).
        async_save: write in the background (``dcp.async_save`` on a process group of its own).
        verify: check sizes and sha256 of every file before loading.
    """

    def __init__(self, directory: str, keep_last: int = 2, milestone_every: int = 0,
                 async_save: bool = False, verify: bool = True):
        self.directory = os.fspath(directory)
        self.keep_last = validate.integer("keep_last", keep_last, minimum=1)
        self.milestone_every = validate.integer("milestone_every", milestone_every, minimum=0)
        self.async_save = validate.boolean("async_save", async_save)
        self.verify = validate.boolean("verify", verify)
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.blocking_seconds: list[float] = []
        self._pending: Future | None = None
        self._published = threading.Event()
        self._published.set()
        self._error: BaseException | None = None
        # async collectives must not interleave with training's on the default group (gloo)
        self._group = dist.new_group(backend="gloo") if self.async_save and self.distributed else None
        if self.rank == 0:
            os.makedirs(self.directory, exist_ok=True)

    # ---- saving ----------------------------------------------------------------------------------
    def save(self, step: int, model: nn.Module, optimizer: Any = None, data_position: Any = None,
             layout: dict[str, Any] | None = None, extra: dict[str, Any] | None = None,
             owned: Callable[[str], bool] | None = None) -> None:
        """Checkpoint ``step`` (a collective). ``data_position`` and ``extra`` must be JSON.
        ``owned(name)`` says which of the model's state-dict entries this rank holds and saves
        (pipeline parallelism: its stages'); default all."""
        import torch.distributed.checkpoint as dcp
        validate.integer("step", step, minimum=0)
        start = time.perf_counter()
        self.wait()  # one save in flight at a time
        spans, shapes = self._spans(model, owned)
        optim, optim_spans = chunks.optimizer_spans(optimizer, spans) if optimizer is not None else (None, [])
        state = chunks.state_dict(spans, optim, optim_spans)
        blob = io.BytesIO()
        pickle.dump(rng_state(), blob)
        blob.seek(0)
        state[f"rng.rank{self.rank}"] = blob
        manifest = {"format": FORMAT, "step": step, "data_position": data_position, "extra": extra or {},
                    "world_size": self.world_size, "layout": layout or _describe(model, optimizer),
                    "shapes": self._everyone(shapes), "optimizer": _hyperparameters(optim)}
        final = _step_dir(self.directory, step)
        tmp = os.path.join(self.directory, f".tmp-step{step:08d}")
        if self.rank == 0:
            self._sweep(keep=None)
            os.makedirs(tmp)
        self._barrier()
        if self.async_save:
            self._published.clear()
            with _quiet():
                self._pending = dcp.async_save(state, checkpoint_id=tmp, process_group=self._group,
                                               planner=chunks.SavePlanner(), async_stager=chunks.CPUStager(),
                                               no_dist=not self.distributed)
            if self.rank == 0:
                self._pending.add_done_callback(lambda f: self._finish(f, tmp, final, manifest))
            else:
                self._published.set()
            self.blocking_seconds.append(time.perf_counter() - start)
            return
        with _quiet():
            dcp.save(state, checkpoint_id=tmp, planner=chunks.SavePlanner(), no_dist=not self.distributed)
        if self.rank == 0:
            self._publish(tmp, final, manifest)
        self._barrier()  # save() returned => the checkpoint is published
        self.blocking_seconds.append(time.perf_counter() - start)

    def _spans(self, model: nn.Module, owned: Callable[[str], bool] | None) -> tuple[list, dict[str, list[int]]]:
        """This rank's spans (those it owns) and the full shapes of every name its model has."""
        spans = chunks.model_spans(model)
        shapes = {seg.name: list(seg.full_shape) for s in spans for seg in s.segments}
        if owned is not None:
            spans = [s for s in spans if all(owned(seg.name) for seg in s.segments)]
        return spans, shapes

    def _everyone(self, shapes: dict[str, list[int]]) -> dict[str, list[int]]:
        """The full shapes of every rank's names (expert parallelism: each rank has its experts)."""
        if not self.distributed:
            return shapes
        parts: list[Any] = [None] * self.world_size
        dist.all_gather_object(parts, shapes, group=self._group)
        return {name: shape for part in parts for name, shape in part.items()}

    def _finish(self, future: Future, tmp: str, final: str, manifest: dict[str, Any]) -> None:
        try:
            future.result()
            self._publish(tmp, final, manifest)
        except BaseException as e:  # surfaced by the next wait()/save()
            self._error = e
        finally:
            self._published.set()

    def _publish(self, tmp: str, final: str, manifest: dict[str, Any]) -> None:
        """Rank 0, once every rank's files are written: manifest last, rename, ``latest``, retention."""
        manifest = {**manifest, "files": _fingerprint(tmp), "written_at": time.time()}
        with open(os.path.join(tmp, MANIFEST), "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(final):  # the same step saved again (a resumed run): replace it
            shutil.rmtree(final)
        os.rename(tmp, final)
        latest = os.path.join(self.directory, "latest")
        with open(latest + ".tmp", "w") as f:
            f.write(os.path.basename(final))
        os.replace(latest + ".tmp", latest)
        self._sweep(keep=manifest["step"])

    def _sweep(self, keep: int | None) -> None:
        """Remove leftovers of interrupted saves and, after ``keep`` was published, the
        checkpoints retention does not keep."""
        for name in os.listdir(self.directory):
            if name.startswith(".tmp-step") and (self._pending is None or self._pending.done()):
                shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
        if keep is None:
            return
        steps = checkpoint_steps(self.directory)
        kept = set(steps[-self.keep_last:]) | {keep}
        if self.milestone_every:
            kept |= {s for s in steps if s % self.milestone_every == 0}
        for s in steps:
            if s not in kept and s < keep:
                shutil.rmtree(_step_dir(self.directory, s), ignore_errors=True)

    def wait(self) -> None:
        """Block until the save in flight (if any) is written and published."""
        if self._pending is not None:
            self._pending.result()
            self._published.wait()
            self._pending = None
        if self._error is not None:
            error, self._error = self._error, None
            raise CheckpointError(f"the background save into {self.directory} failed: {error}") from error

    def _barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self._group)

    # ---- loading ---------------------------------------------------------------------------------
    def load(self, model: nn.Module, optimizer: Any = None, step: int | None = None,
             owned: Callable[[str], bool] | None = None,
             check: Callable[[dict[str, Any], str], None] | None = None) -> dict[str, Any] | None:
        """Load the newest complete checkpoint (or ``step``) into ``model``/``optimizer`` in place,
        on this layout whatever the saving one was; restore this rank's RNGs if the world size is
        the same. ``owned`` as for :meth:`save`; ``check(extra, path)`` runs before anything is
        loaded (it raises to refuse the checkpoint). Returns the manifest's ``step``,
        ``data_position``, ``extra``, ``layout`` and ``world_size``, the ``path`` and
        ``rng_restored`` (None if there is no checkpoint yet)."""
        import torch.distributed.checkpoint as dcp
        self.wait()
        if step is None:
            path = latest_checkpoint(self.directory)
            if path is None:
                return None
        else:
            path = _step_dir(self.directory, validate.integer("step", step, minimum=0))
            if not os.path.isdir(path):
                raise CheckpointError(f"{path} does not exist; complete checkpoints: "
                                      f"{checkpoint_steps(self.directory)}")
        manifest = read_manifest(path)
        if self.verify:
            verify_files(path, manifest)
        if check is not None:
            check(manifest["extra"], path)
        spans, shapes = self._spans(model, owned)
        check_model(path, manifest, shapes, self._everyone(shapes))
        optim, optim_spans = (None, [])
        if optimizer is not None:
            optim, optim_spans = chunks.optimizer_spans(optimizer, spans)
            _materialise_state(optim)
            _set_hyperparameters(optim, manifest["optimizer"], path)
        state = chunks.state_dict(spans, optim, optim_spans)
        same_world = manifest["world_size"] == self.world_size
        if same_world:
            state[f"rng.rank{self.rank}"] = io.BytesIO()
        try:
            with torch.no_grad(), _quiet():
                dcp.load(state, checkpoint_id=path, planner=chunks.LoadPlanner(), no_dist=not self.distributed)
        except Exception as e:  # DCP's own errors carry no file name: add it
            raise CheckpointError(f"loading {path} failed: {str(e).splitlines()[-1] if str(e) else e!r}") from e
        if same_world:
            blob = state[f"rng.rank{self.rank}"]
            blob.seek(0)
            set_rng_state(pickle.load(blob))
        return dict(step=manifest["step"], data_position=manifest["data_position"], extra=manifest["extra"],
                    layout=manifest["layout"], world_size=manifest["world_size"], path=path,
                    rng_restored=same_world)

    def close(self) -> None:
        """Wait for the save in flight and release the background group."""
        self.wait()
        if self._group is not None:
            dist.destroy_process_group(self._group)
            self._group = None


def _describe(model: nn.Module, optimizer: Any) -> dict[str, Any]:
    """The layout a checkpoint was written with, when the caller does not say."""
    from dtlib.parallel.fsdp import FSDP
    from dtlib.parallel.zero import ShardedOptimizer
    world = dist.get_world_size() if dist.is_initialized() else 1
    if isinstance(model, FSDP):
        kind = "fsdp"
    elif isinstance(optimizer, ShardedOptimizer):
        kind = f"zero{optimizer.stage}"
    else:
        kind = "replicated"
    return {"kind": kind, "model": type(chunks.inner(model)).__name__, "world_size": world}


def _hyperparameters(optim: Any) -> dict[str, Any] | None:
    if optim is None:
        return None
    groups = [{k: v for k, v in g.items() if k != "params" and isinstance(v, (int, float, bool, str, list, tuple))
               and not isinstance(v, torch.Tensor)} for g in optim.param_groups]
    return {"class": type(optim).__name__, "param_groups": groups}


def _set_hyperparameters(optim: Any, saved: dict[str, Any] | None, path: str) -> None:
    """The learning rate and friends as they were (a scheduler may have changed them)."""
    if saved is None:
        raise CheckpointError(f"{os.path.join(path, MANIFEST)} holds no optimizer state")
    if saved["class"] != type(optim).__name__ or len(saved["param_groups"]) != len(optim.param_groups):
        raise CheckpointError(f"{os.path.join(path, MANIFEST)} holds a {saved['class']} with "
                              f"{len(saved['param_groups'])} param groups; this is a {type(optim).__name__} "
                              f"with {len(optim.param_groups)}")
    for group, values in zip(optim.param_groups, saved["param_groups"]):
        for k, v in values.items():
            group[k] = tuple(v) if isinstance(group.get(k), tuple) else v


@torch.no_grad()
def _materialise_state(optim: torch.optim.Optimizer) -> None:
    """Create the optimizer's state tensors (they appear at the first step) so DCP can load into
    them: one step on zero gradients with a learning rate of 0 changes no parameter (as
    ``torch.distributed.checkpoint.state_dict._init_optim_state``); the loaded values replace it."""
    params = [p for g in optim.param_groups for p in g["params"]]
    if all(p in optim.state and optim.state[p] for p in params):
        return
    lrs = [g["lr"] for g in optim.param_groups]
    grads = [p.grad for p in params]
    for g in optim.param_groups:
        g["lr"] = 0.0
    for p in params:
        p.grad = torch.zeros_like(p)
    optim.step()
    for p, grad in zip(params, grads):
        p.grad = grad
    for g, lr in zip(optim.param_groups, lrs):
        g["lr"] = lr


def to_torch(path: str, out: str) -> dict[str, Any]:
    """Convert checkpoint ``path`` (a step directory, or a directory of them: the newest) into one
    ``torch.save`` file with the parameters in their real shapes: ``{"model", "optimizer",
    "step", "data_position", "layout"}``. Uses DCP's ``dcp_to_torch_save``; no process group."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    check_output_file("out", out)
    if not os.path.exists(os.path.join(path, MANIFEST)) and checkpoint_steps(path):
        path = latest_checkpoint(path)
    manifest = read_manifest(path)
    verify_files(path, manifest)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    flat_file = out + ".flat.tmp"
    try:
        dcp_to_torch_save(path, flat_file)
        flat = torch.load(flat_file, weights_only=False)
    finally:
        if os.path.exists(flat_file):
            os.remove(flat_file)
    model = {k[len("model."):]: v for k, v in flat.items() if k.startswith("model.")}
    optimizer: dict[str, dict[str, Any]] = {}
    for k, v in flat.items():
        if k.startswith("optim."):
            name, key = k[len("optim."):].rsplit(".", 1)
            optimizer.setdefault(name, {})[key] = v
    result = {"model": model, "optimizer": optimizer, "step": manifest["step"],
              "data_position": manifest["data_position"], "layout": manifest["layout"]}
    torch.save(result, out)
    return result
