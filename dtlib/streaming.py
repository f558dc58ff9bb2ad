"""A streaming, sharded token dataset: shards on disk, one global sample order whatever the number of
ranks and workers, a resumable position, and prefetching.

The design follows MosaicML Streaming (``streaming.StreamingDataset``, docs "Main concepts",
"Shuffling" and "Elastic determinism"): samples live in shards with an index; the *global* order of
an epoch is a function of the seed and the epoch only; each step takes the next ``global_batch``
positions of that order and every data-parallel replica its contiguous slice; the state to resume
is one number, the samples consumed so far. Because the state is global, a run resumed on another
number of ranks goes on from the same position: every sample exactly once (Mosaic's "elastic
determinism"; torchdata's ``StatefulDataLoader`` saves per-worker iterator state instead, which
is why resuming it on another world size is not exact).

Why not ``mosaicml-streaming`` itself: its wheel requires boto3, google-cloud-storage, the Azure and
OCI SDKs, paramiko, transformers and torchvision (version 0.13) -- minutes of install for CI and a
torchvision that must match the pinned CPU torch. WebDataset streams tar shards in a per-worker
order and resumes by skipping, not by position. The format here is MDS-like and small: ``.npy``
shards of fixed-length samples (``seq + 1`` byte tokens each: inputs and next-token targets) and
an ``index.json`` with every shard's sample count and sha256.

Integrity: a shard is checked against ``index.json``'s sha256 when a rank first opens it (lazily,
as Mosaic checks a shard's hash when it is first used, ``validate_hash``); a flipped byte or a
truncated file is a ValueError naming the shard, before its samples are trained on. The cost is
one extra sequential read of each shard a rank opens, once per run: ``benchmarks/
bench_streaming_verify.py`` measured a 67 MB shard at 0.11 s (sha256 at 0.6 GB/s on a busy
2-core machine), against 1.5 s to read its samples once; checking every shard at open instead
would make a rank pay for shards it never reads. ``verify=False`` skips it.

Order (Mosaic's ``py1s`` shuffle, simplified): the shards' order is shuffled, then the samples
inside each shard, with a generator seeded by (seed, epoch) -- reads stay shard-local.
"""
from __future__ import annotations

from dtlib.extras import require

require("course", "torch", feature=__name__)

import json
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Sequence

import numpy as np
import torch

from dtlib.analytic import validate
from dtlib.resilience.checkpoint import file_sha256
from dtlib.outputs import check_output_dir

__all__ = ["write_shards", "ShardedTokens", "epoch_order", "replica_positions", "check_shards", "check_options",
           "log_samples", "read_sample_log", "FORMAT"]

FORMAT = "dtlib-shards-1"
INDEX = "index.json"


def write_shards(directory: str, tokens: Any, seq: int, samples_per_shard: int = 256) -> dict[str, Any]:
    """Cut ``tokens`` (1-D ints < 256) into non-overlapping samples of ``seq + 1`` tokens (sample
    ``i`` starts at ``i x seq``) and write them as shards of ``samples_per_shard``; returns the index."""
    validate.integer("seq", seq)
    validate.integer("samples_per_shard", samples_per_shard)
    t = np.asarray(tokens.numpy() if isinstance(tokens, torch.Tensor) else tokens)
    if t.ndim != 1 or t.size and (t.min() < 0 or t.max() > 255):
        raise ValueError("tokens must be a 1-D array of byte tokens (0..255)")
    n = (len(t) - 1) // seq
    if n < 1:
        raise ValueError(f"seq={seq} is longer than the {len(t)} tokens given")
    check_output_dir("directory", directory)
    samples = np.stack([t[i * seq:i * seq + seq + 1] for i in range(n)]).astype(np.uint8)
    os.makedirs(directory, exist_ok=True)
    shards = []
    for k, start in enumerate(range(0, n, samples_per_shard)):
        name = f"shard.{k:05d}.npy"
        path = os.path.join(directory, name)
        np.save(path, samples[start:start + samples_per_shard])
        digest = file_sha256(path)
        shards.append({"file": name, "samples": int(len(samples[start:start + samples_per_shard])), "sha256": digest})
    index = {"format": FORMAT, "seq": seq, "samples": n, "shards": shards}
    with open(os.path.join(directory, INDEX), "w") as f:
        json.dump(index, f, indent=1)
    return index



def check_shards(directory: str, seq: int | None = None) -> dict[str, Any]:
    """The index of a shard directory; a one-line ValueError naming the problem (for ``--data``)."""
    path = os.path.join(directory, INDEX)
    if not os.path.exists(path):
        raise ValueError(f"--data {directory}: no {INDEX} there (write shards with "
                         f"dtlib.streaming.write_shards(directory, tokens, seq))")
    with open(path) as f:
        index = json.load(f)
    if index.get("format") != FORMAT:
        raise ValueError(f"--data {directory}: {INDEX} is not a {FORMAT} index")
    for s in index["shards"]:
        if not os.path.exists(os.path.join(directory, s["file"])):
            raise ValueError(f"--data {directory}: shard {s['file']} is missing")
    if seq is not None and index["seq"] != seq:
        raise ValueError(f"--data {directory} holds samples of seq={index['seq']} tokens; --seq is {seq}")
    return index


def epoch_order(shard_sizes: Sequence[int], seed: int, epoch: int) -> np.ndarray:
    """The global order of one epoch: sample ids (0..N-1), shards shuffled then samples within each
    shard, seeded by (seed, epoch) only -- no rank, no world size, no worker count."""
    rng = np.random.default_rng([seed, epoch])
    starts = np.concatenate([[0], np.cumsum(shard_sizes)[:-1]]).astype(np.int64)
    out = []
    for k in rng.permutation(len(shard_sizes)):
        out.append(starts[k] + rng.permutation(shard_sizes[k]))
    return np.concatenate(out) if out else np.zeros(0, np.int64)


def replica_positions(consumed: int, global_batch: int, dp_rank: int, dp: int) -> list[int]:
    """Global positions that data-parallel replica ``dp_rank`` of ``dp`` reads in the step that
    starts after ``consumed`` samples: its contiguous slice of the next ``global_batch`` positions
    (the same slice the trainer's built-in data takes). A function of global numbers only, so the
    assignment stays exact when ``dp`` changes between two steps."""
    if global_batch % dp:
        raise ValueError(f"global_batch {global_batch} must be a multiple of dp {dp}")
    per = global_batch // dp
    return list(range(consumed + dp_rank * per, consumed + (dp_rank + 1) * per))


class ShardedTokens:
    """Samples of a shard directory in the global order, read by ``workers`` threads, with the next
    step's rows read ahead by ``prefetch`` (0: read when asked). ``delay``: seconds each read sleeps
    (a slow-storage drill the profiler's ``input`` finding shows). ``consumed``: the resumable
    position (samples consumed by all replicas together). ``verify``: check each shard's sha256
    against the index when it is first opened (see the module doc)."""

    def __init__(self, directory: str, seed: int = 0, workers: int = 0, prefetch: int = 0, delay: float = 0.0,
                 verify: bool = True):
        self.directory = directory
        self.verify = validate.boolean("verify", verify)
        self.index = check_shards(directory)
        self.seed = seed
        self.sizes = [s["samples"] for s in self.index["shards"]]
        self.samples = int(sum(self.sizes))
        self.seq = self.index["seq"]
        self.workers = validate.integer("workers", workers, minimum=0)
        self.prefetch = validate.integer("prefetch", prefetch, minimum=0)
        self.delay = validate.number("delay", delay, exclusive=False)
        self.consumed = 0
        self._orders: dict[int, np.ndarray] = {}
        self._shards: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()
        self._starts = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        self._pool = ThreadPoolExecutor(self.workers) if self.workers else None
        self._ahead = ThreadPoolExecutor(1) if self.prefetch else None
        self._pending: dict[tuple, Future] = {}

    # ---- order and reading ----------------------------------------------------------------------
    def sample_ids(self, positions: Sequence[int]) -> list[int]:
        """The sample id at each global position (epoch ``p // N``, its order's ``p % N``-th)."""
        out = []
        for p in positions:
            epoch = p // self.samples
            with self._lock:
                if epoch not in self._orders:
                    self._orders = {epoch: epoch_order(self.sizes, self.seed, epoch)}  # keep one epoch
                order = self._orders[epoch]
            out.append(int(order[p % self.samples]))
        return out

    def _shard(self, k: int) -> np.ndarray:
        with self._lock:
            if k not in self._shards:
                shard = self.index["shards"][k]
                path = os.path.join(self.directory, shard["file"])
                if self.verify and file_sha256(path) != shard["sha256"]:
                    raise ValueError(f"{path} is corrupt or truncated: its sha256 differs from {INDEX}'s "
                                     "(write the shards again)")
                self._shards[k] = np.load(path, mmap_mode="r")
            return self._shards[k]

    def _read_one(self, sample: int) -> np.ndarray:
        k = int(np.searchsorted(self._starts, sample, side="right") - 1)
        return np.array(self._shard(k)[sample - self._starts[k]])

    def read(self, ids: Sequence[int]) -> np.ndarray:
        """Samples ``ids`` as ``[len(ids), seq + 1]`` (workers each read a contiguous part; the rows
        come back in the order asked, so the result does not depend on the worker count)."""
        if self.delay:
            time.sleep(self.delay)
        if self._pool is None or len(ids) < 2:
            rows = [self._read_one(i) for i in ids]
        else:
            parts = np.array_split(np.asarray(ids), self.workers)
            futures = [self._pool.submit(lambda part: [self._read_one(int(i)) for i in part], p) for p in parts]
            rows = [r for f in futures for r in f.result()]
        return np.stack(rows) if rows else np.zeros((0, self.seq + 1), np.uint8)

    def _rows(self, consumed: int, global_batch: int, dp_rank: int, dp: int) -> tuple[np.ndarray, list[int]]:
        ids = self.sample_ids(replica_positions(consumed, global_batch, dp_rank, dp))
        return self.read(ids), ids

    # ---- what the trainer calls -------------------------------------------------------------------
    def batch(self, global_batch: int, dp_rank: int, dp: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """This replica's rows of the next global batch as (inputs, targets, sample ids); advances
        ``consumed`` by ``global_batch`` and, with ``prefetch``, starts reading the next step's."""
        key = (self.consumed, global_batch, dp_rank, dp)
        future = self._pending.pop(key, None)
        rows, ids = future.result() if future is not None else self._rows(*key)
        self._pending.clear()
        self.consumed += global_batch
        if self._ahead is not None:
            nxt = (self.consumed, global_batch, dp_rank, dp)
            self._pending[nxt] = self._ahead.submit(self._rows, *nxt)
        t = torch.from_numpy(rows.astype(np.int64))
        return t[:, :-1], t[:, 1:], ids

    def state_dict(self) -> dict[str, Any]:
        return {"consumed": self.consumed, "seed": self.seed, "samples": self.samples}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["samples"] != self.samples or state["seed"] != self.seed:
            raise ValueError(f"the saved data state is for {state['samples']} samples and seed {state['seed']}; "
                             f"this dataset has {self.samples} and seed {self.seed}")
        self.consumed = int(state["consumed"])
        self._pending.clear()

    def close(self) -> None:
        for pool in (self._pool, self._ahead):
            if pool is not None:
                pool.shutdown(wait=True)


# ---- dtlib train --data ---------------------------------------------------------------------------
def check_options(config: Any) -> None:
    """One-line ValueErrors for ``--data`` and its options (before any process starts)."""
    validate.integer("data_workers", config.data_workers, minimum=0)
    validate.integer("prefetch", config.prefetch, minimum=0)
    validate.number("data_delay", config.data_delay, exclusive=False)
    if config.data is not None:
        check_shards(config.data, config.seq)
    elif config.sample_log or config.data_delay:
        raise ValueError("--sample-log and --data-delay need --data (a shard directory)")


def log_samples(directory: str, rank: int, step: int, ids: Sequence[int]) -> None:
    """Append one line ``{"step", "rank", "attempt", "ids"}`` to ``directory/rank{rank}.jsonl``
    (``attempt``: torchrun's restart count), so a test can check every sample was seen once."""
    os.makedirs(directory, exist_ok=True)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    with open(os.path.join(directory, f"rank{rank}.jsonl"), "a") as f:
        f.write(json.dumps({"step": step, "rank": rank, "attempt": attempt, "ids": list(map(int, ids))}) + "\n")


def read_sample_log(directory: str) -> dict[int, list[int]]:
    """Per step, the sample ids trained on: the last attempt that ran the step (an attempt that
    died redoes the steps after its checkpoint), all ranks' ids of that attempt in rank order."""
    records = []
    for name in sorted(os.listdir(directory)):
        if name.endswith(".jsonl"):
            with open(os.path.join(directory, name)) as f:
                records += [json.loads(line) for line in f if line.strip()]
    last = {}
    for r in records:
        last[r["step"]] = max(last.get(r["step"], -1), r["attempt"])
    out: dict[int, list[int]] = {}
    for r in sorted(records, key=lambda r: (r["step"], r["rank"])):
        if r["attempt"] == last[r["step"]]:
            out.setdefault(r["step"], []).extend(r["ids"])
    return out
