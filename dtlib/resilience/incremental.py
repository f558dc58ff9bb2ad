"""Incremental checkpoints: a full checkpoint every ``full_every`` saves, and in between only what
changed since that full one, as lossless deltas. A resume is bit-identical to loading a full one.

Check-N-Run (Eisenman et al. 2022, NSDI, "Check-N-Run: a Checkpointing System for Training Deep
Learning Recommendation Models") saves only the embedding rows a training interval touched
(differential checkpoints, Sec. 4.1) against the last full checkpoint, so a restore reads one full
and one delta -- never a chain -- and the full one is re-taken when the deltas grow. It adds
quantisation (lossy); this module stays lossless, so a resume equals the uninterrupted run:

* every tensor is split into chunks of ``chunk`` elements; a chunk whose bits equal the full
  checkpoint's is not written at all (frozen layers, embedding rows no token used, optimizer
  state of parameters that got no gradient);
* a chunk that changed is stored as ``new XOR full`` (as integers of the same width) compressed with
  zlib: a small update leaves the sign, the exponent and the top mantissa bits unchanged, so the
  XOR starts with zero bits that compress (Chen et al. 2020, "On Efficient Constructions of
  Checkpoints", LC-checkpoint, delta-encode the same way); a tensor whose XOR does not compress
  (Adam's moments change in every bit) is stored as its changed chunks, raw.

What it saves depends on what changes: dense training with AdamW changes every parameter and
moment at every step, so only the XOR's compression is left (lesson 12 measures it); frozen
layers, embedding rows no batch touched (Check-N-Run's case) and small updates save the most.

Each rank saves its own state (its shard of the layout); loading needs the same layout. Files:
``DIR/incr-step00000004/rank0.pt``, written to a temporary name and renamed, so a file that exists
is complete, then its record ``rank0.json``: kind, base step, size and sha256 of the ``.pt`` (and
of its base's, for a delta), and what the caller adds (``info``: the trainer's run configuration).
A step is complete when every rank's file and record are there.

Verified on load, as the DCP checkpoints' manifest is (:func:`verify_step`): a file whose size or
sha256 differs from its record -- a flipped byte, a truncated write -- or a delta whose base
changed is a :class:`~dtlib.resilience.checkpoint.CheckpointError` naming the file, never a
silent load (a flipped byte in one rank's file would otherwise leave the data-parallel replicas
holding different weights). :meth:`IncrementalCheckpointer.load` then takes the newest step that
verifies and lists the ones it skipped; the trainer picks the newest step every rank verifies.
"""
from __future__ import annotations

import json
import os
import re
import zlib
from typing import Any, Callable

import torch

from dtlib.analytic import validate
from dtlib.resilience.checkpoint import CheckpointError, file_sha256

__all__ = ["IncrementalCheckpointer", "TrainerCheckpointer", "encode_delta", "apply_delta", "state_bytes",
           "complete_steps", "step_dir", "verify_step", "read_record", "check_options"]

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers of the same width, flat (a view where possible)."""
    t = t.detach().contiguous().cpu().reshape(-1)
    return t if t.dtype == torch.bool else t.view(_INT[t.element_size()])


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    """Bytes of the tensors' data."""
    return sum(t.numel() * t.element_size() for t in state.values())


def encode_delta(new: torch.Tensor, base: torch.Tensor, chunk: int = 256) -> dict[str, Any]:
    """``new`` against ``base`` (same shape and dtype): the indices of the chunks that changed and
    their XOR, zlib-compressed."""
    if new.shape != base.shape or new.dtype != base.dtype:
        raise ValueError(f"a delta needs the same shape and dtype: {tuple(new.shape)} {new.dtype} vs "
                         f"{tuple(base.shape)} {base.dtype}")
    a, b = _bits(new), _bits(base)
    x = a ^ b
    n = x.numel()
    pad = (-n) % chunk
    xs = torch.cat([x, x.new_zeros(pad)]).view(-1, chunk) if n else x.view(0, chunk)
    changed = torch.nonzero(xs.ne(0).any(dim=1)).flatten()
    payload = zlib.compress(xs[changed].numpy().tobytes(), 6) if len(changed) else b""
    last = len(changed) and int(changed[-1]) == xs.shape[0] - 1
    valid = len(changed) * chunk - (pad if last else 0)  # the padding of the last chunk is not stored
    raw = len(payload) >= valid * x.element_size()
    if raw:  # the XOR did not compress (most bits changed): the new chunks as they are
        a_pad = torch.cat([a, a.new_zeros(pad)]).view(-1, chunk)
        payload = a_pad[changed].reshape(-1)[:valid].numpy().tobytes()
    # a uint8 tensor, not bytes: torch.save pickles bytes with protocol 2, as latin-1 text (up to 2x)
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else torch.zeros(0, dtype=torch.uint8)
    return {"chunks": changed.to(torch.int32), "xor": data, "raw": raw, "numel": n, "chunk": chunk}


def apply_delta(base: torch.Tensor, delta: dict[str, Any]) -> torch.Tensor:
    """``base`` with ``delta`` applied: the saved tensor, bit for bit."""
    chunk, n = delta["chunk"], delta["numel"]
    b = _bits(base).clone()
    pad = (-n) % chunk
    bs = torch.cat([b, b.new_zeros(pad)]).view(-1, chunk)
    if len(delta["chunks"]):
        payload = delta["xor"].numpy().tobytes()
        data = bytearray(payload if delta["raw"] else zlib.decompress(payload))
        flat = torch.frombuffer(data, dtype=bs.dtype) if data else bs.new_zeros(0)
        xs = torch.cat([flat, flat.new_zeros(len(delta["chunks"]) * chunk - flat.numel())]).view(-1, chunk)
        idx = delta["chunks"].long()
        if delta["raw"]:
            bs[idx] = xs
        else:
            bs[idx] ^= xs
    out = bs.reshape(-1)[:n]
    return (out if base.dtype == torch.bool else out.view(base.dtype)).view(base.shape).clone()


def step_dir(directory: str, step: int) -> str:
    """The folder of step ``step``'s files (every rank's file and record)."""
    # not "stepNNNNNNNN": that is the full (DCP) checkpoints' name in the same --checkpoint-dir
    return os.path.join(directory, f"incr-step{step:08d}")


def _file(directory: str, step: int, rank: int, suffix: str = ".pt") -> str:
    return os.path.join(step_dir(directory, step), f"rank{rank}{suffix}")


def complete_steps(directory: str, world_size: int) -> list[int]:
    """Steps whose every rank file and record are written, oldest first."""
    if not os.path.isdir(directory):
        return []
    out = []
    for name in os.listdir(directory):
        m = re.fullmatch(r"incr-step(\d{8})", name)
        if m and all(os.path.exists(_file(directory, int(m.group(1)), r, suffix))
                     for r in range(world_size) for suffix in (".pt", ".json")):
            out.append(int(m.group(1)))
    return sorted(out)


def read_record(directory: str, step: int, rank: int) -> dict[str, Any]:
    """The record ``rank{rank}.json`` of ``step``; CheckpointError naming it if absent or unreadable."""
    path = _file(directory, step, rank, ".json")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} is missing or not valid JSON ({e}): the checkpoint of step {step} "
                              "is incomplete or corrupt") from None


def verify_step(directory: str, step: int, rank: int) -> dict[str, Any]:
    """Rank ``rank``'s file of ``step`` (and, for a delta, its base's) has the size and sha256 its
    record says, and the base is the one the delta was written against; returns the record.
    CheckpointError naming the first file that is missing, truncated or corrupt."""
    record = read_record(directory, step, rank)
    path = _file(directory, step, rank)
    if not os.path.exists(path):
        raise CheckpointError(f"{path} is missing (its record {os.path.basename(path)[:-3]}.json is there)")
    size = os.path.getsize(path)
    if size != record["bytes"]:
        raise CheckpointError(f"{path} is truncated or overwritten: {size} bytes, its record says {record['bytes']}")
    if file_sha256(path) != record["sha256"]:
        raise CheckpointError(f"{path} is corrupt: its sha256 differs from its record's")
    if record["kind"] == "delta":
        base = verify_step(directory, record["base"], rank)
        if base["kind"] != "full" or base["sha256"] != record["base_sha256"]:
            raise CheckpointError(f"{path} is a delta against another {_file(directory, record['base'], rank)} "
                                  "than the one there now (its base was overwritten)")
    return record


class IncrementalCheckpointer:
    """One rank's incremental checkpoints of a ``{name: tensor}`` state (plus picklable ``meta``).

    ``full_every``: every ``full_every``-th save is full (1: always full, the baseline); ``chunk``:
    elements per delta chunk. ``written`` lists ``(step, kind, bytes)`` per save; ``full_bytes`` what
    a full save of the same state takes; ``skipped`` the errors of the newer steps the last
    :meth:`load` passed over."""

    def __init__(self, directory: str, rank: int = 0, world_size: int = 1, full_every: int = 4, chunk: int = 256):
        self.directory = os.fspath(directory)
        self.rank, self.world_size = rank, world_size
        self.full_every = validate.integer("full_every", full_every)
        self.chunk = validate.integer("chunk", chunk)
        self.base: dict[str, torch.Tensor] | None = None
        self.base_step: int | None = None
        self.base_sha256: str | None = None
        self.saves_since_full = 0
        self.written: list[tuple[int, str, int]] = []
        self.skipped: list[str] = []
        os.makedirs(self.directory, exist_ok=True)

    def save(self, step: int, state: dict[str, torch.Tensor], meta: Any = None, sweep: bool = True,
             info: dict[str, Any] | None = None) -> tuple[str, int]:
        """Save ``state`` as step ``step``: full or delta; returns (kind, bytes written). ``info``
        (JSON) goes into the step's record, readable without loading the tensors. After a full
        save the older files go (``sweep``; with several ranks call :meth:`sweep` once every rank's
        file of this step is written, so a crash in between leaves a complete older step)."""
        state = {k: v.detach().cpu().clone() for k, v in state.items()}
        full = self.base is None or self.saves_since_full + 1 >= self.full_every or set(state) != set(self.base) \
            or any(state[k].shape != self.base[k].shape or state[k].dtype != self.base[k].dtype for k in state)
        if full:
            payload = {"kind": "full", "step": step, "tensors": state, "meta": meta}
        else:
            deltas = {k: encode_delta(v, self.base[k], self.chunk) for k, v in state.items()}
            payload = {"kind": "delta", "step": step, "base": self.base_step, "deltas": deltas, "meta": meta,
                       "dtypes": {k: v.dtype for k, v in state.items()}, "shapes": {k: v.shape for k, v in state.items()}}
        path = _file(self.directory, step, self.rank)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(payload, path + ".tmp")
        os.replace(path + ".tmp", path)
        size, digest = os.path.getsize(path), file_sha256(path)
        record = {"step": step, "kind": payload["kind"], "base": None if full else self.base_step,
                  "bytes": size, "sha256": digest, "base_sha256": None if full else self.base_sha256,
                  "info": info or {}}
        record_path = _file(self.directory, step, self.rank, ".json")
        with open(record_path + ".tmp", "w") as f:  # the record last: the file it describes is complete
            json.dump(record, f)
        os.replace(record_path + ".tmp", record_path)
        if full:
            self.base, self.base_step, self.base_sha256, self.saves_since_full = state, step, digest, 0
            if sweep:
                self.sweep()
        else:
            self.saves_since_full += 1
        kind = payload["kind"]
        self.written.append((step, kind, size))
        return kind, size

    def sweep(self) -> None:
        """This rank's files older than the last full save: not needed any more (a step folder
        goes with the last rank's files)."""
        for s in complete_steps(self.directory, 0):  # every step directory
            if self.base_step is not None and s < self.base_step:
                for suffix in (".pt", ".json"):
                    path = _file(self.directory, s, self.rank, suffix)
                    if os.path.exists(path):
                        os.remove(path)
                try:
                    os.rmdir(step_dir(self.directory, s))
                except OSError:  # another rank's files are still there: the last rank removes it
                    pass

    def verified_steps(self) -> tuple[list[int], dict[int, str]]:
        """(steps every rank has written whose file of this rank verifies, oldest first; the error
        of each one that does not)."""
        good, errors = [], {}
        for s in complete_steps(self.directory, self.world_size):
            try:
                verify_step(self.directory, s, self.rank)
                good.append(s)
            except CheckpointError as e:
                errors[s] = str(e)
        return good, errors

    def latest(self) -> int | None:
        """The newest step every rank has written (whose files this rank has not verified yet)."""
        steps = complete_steps(self.directory, self.world_size)
        return steps[-1] if steps else None

    def load(self, step: int | None = None) -> tuple[int, dict[str, torch.Tensor], Any] | None:
        """(step, state, meta) of ``step``, or of the newest complete step whose files verify
        (``skipped`` lists why newer ones did not); None if there is none. CheckpointError naming
        the file if ``step`` -- or, by default, every complete step -- fails to verify."""
        if step is None:
            good, errors = self.verified_steps()
            if not good and errors:
                raise CheckpointError(errors[max(errors)])
            if not good:
                return None
            step = good[-1]
            self.skipped = [errors[s] for s in sorted(errors, reverse=True) if s > step]
        record = verify_step(self.directory, step, self.rank)
        payload = torch.load(_file(self.directory, step, self.rank), weights_only=False)
        if payload["kind"] == "full":
            state = payload["tensors"]
            self.base, self.base_step, self.base_sha256 = state, step, record["sha256"]
        else:
            base = torch.load(_file(self.directory, payload["base"], self.rank), weights_only=False)
            state = {k: apply_delta(base["tensors"][k], d) for k, d in payload["deltas"].items()}
            self.base, self.base_step, self.base_sha256 = base["tensors"], payload["base"], record["base_sha256"]
        self.saves_since_full = 0 if payload["kind"] == "full" else self.full_every  # next save: full
        return step, state, payload["meta"]


# ---- the trainer's incremental checkpoints (dtlib train --incremental) ----------------------------
def check_options(config: Any) -> None:
    """One-line ValueErrors for ``--incremental`` and ``--full-every``."""
    validate.integer("full_every", config.full_every)
    if config.incremental:
        if not config.checkpoint_dir:
            raise ValueError("--incremental needs --checkpoint-dir to save into")
        if config.zero != 0:
            raise ValueError("--incremental saves each rank's own model and optimizer state: use --zero 0")
        if config.async_checkpoint:
            raise ValueError("--incremental writes synchronously: drop --async-checkpoint")


class TrainerCheckpointer:
    """What :func:`dtlib.trainer.train` uses instead of
    :class:`~dtlib.resilience.checkpoint.Checkpointer` with ``--incremental``: the same ``save``
    and ``load`` calls, each rank's model and optimizer state (and CPU RNG) saved through an
    :class:`IncrementalCheckpointer`. A resume needs the layout that saved (no resharding)."""

    def __init__(self, directory: str, full_every: int = 4):
        import torch.distributed as dist
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if distributed else 0
        self.world_size = dist.get_world_size() if distributed else 1
        self.distributed = distributed
        self.directory = os.fspath(directory)
        self.inner = IncrementalCheckpointer(self.directory, self.rank, self.world_size, full_every)
        self.blocking_seconds: list[float] = []
        self.full_bytes: int | None = None

    @property
    def written(self) -> list[tuple[int, str, int]]:
        return self.inner.written

    def _barrier(self) -> None:
        if self.distributed:
            import torch.distributed as dist
            dist.barrier()

    def save(self, step: int, model: Any, optimizer: Any = None, data_position: Any = None,
             layout: dict[str, Any] | None = None, extra: dict[str, Any] | None = None, owned: Any = None) -> None:
        import time
        start = time.perf_counter()
        state = {f"model.{k}": v for k, v in model.state_dict().items()}
        other: dict[str, Any] = {}
        sd = optimizer.state_dict()
        for pid, st in sd["state"].items():
            for k, v in st.items():
                if torch.is_tensor(v):
                    state[f"optim.{pid}.{k}"] = v
                else:
                    other.setdefault(pid, {})[k] = v
        state["rng.cpu"] = torch.get_rng_state()
        self.full_bytes = state_bytes(state)
        meta = {"param_groups": sd["param_groups"], "optim_other": other, "data_position": data_position,
                "layout": layout, "extra": extra or {}, "world_size": self.world_size}
        info = {"data_position": data_position, "layout": layout, "extra": extra or {}, "world_size": self.world_size}
        self.inner.save(step, state, meta, sweep=False, info=info)
        self._barrier()  # every rank's file written: the step is complete
        self.inner.sweep()
        self.blocking_seconds.append(time.perf_counter() - start)

    def load(self, model: Any, optimizer: Any = None, owned: Any = None,
             check: Callable[[dict[str, Any], str], None] | None = None) -> dict[str, Any] | None:
        """Load the newest step whose files verify on every rank (a collective: all ranks load the
        same step); ``skipped`` in the result lists the newer steps' errors. None if there is no
        complete step; CheckpointError naming a file if none verifies. ``check(extra, path)`` runs
        before the state is loaded into ``model`` and ``optimizer`` (it raises to refuse)."""
        good, errors = self.inner.verified_steps()
        if self.distributed:
            import torch.distributed as dist
            parts: list[Any] = [None] * self.world_size
            dist.all_gather_object(parts, (good, errors))
            good = sorted(set.intersection(*(set(g) for g, _ in parts)))
            errors = {s: e for _, errs in parts for s, e in errs.items()}
        if not good and errors:
            raise CheckpointError(errors[max(errors)])
        if not good:
            return None
        skipped = [errors[s] for s in sorted(errors, reverse=True) if s > good[-1]]
        step, state, meta = self.inner.load(good[-1])
        if meta["world_size"] != self.world_size:
            raise ValueError(f"--incremental checkpoints resume on the layout that saved them: "
                             f"{meta['world_size']} ranks saved, {self.world_size} load")
        path = _file(self.directory, step, self.rank)
        if check is not None:
            check(meta["extra"], path)
        model.load_state_dict({k[len("model."):]: v for k, v in state.items() if k.startswith("model.")})
        opt_state: dict[Any, dict[str, Any]] = {}
        for k, v in state.items():
            if k.startswith("optim."):
                _, pid, name = k.split(".", 2)
                opt_state.setdefault(int(pid), {})[name] = v
        for pid, rest in meta["optim_other"].items():
            opt_state.setdefault(int(pid), {}).update(rest)
        optimizer.load_state_dict({"state": opt_state, "param_groups": meta["param_groups"]})
        torch.set_rng_state(state["rng.cpu"])
        return dict(step=step, data_position=meta["data_position"], extra=meta["extra"], layout=meta["layout"],
                    world_size=meta["world_size"], path=path, rng_restored=True, skipped=skipped)

    def close(self) -> None:
        pass
