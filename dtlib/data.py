"""Data for the lessons: real MNIST (IDX files), a bundled fallback, and sharding across ranks.

Where MNIST comes from, in order:
1. IDX files (raw or ``.gz``) in ``root``, ``$DTLIB_MNIST_DIR``, ``~/.cache/dtlib/mnist``, or
   torchvision's layout (``<dir>/MNIST/raw``);
2. a download into ``~/.cache/dtlib/mnist`` with SHA-256 verification, if the network answers
   within a couple of seconds (set ``DTLIB_OFFLINE=1`` to skip it);
3. otherwise scikit-learn's bundled handwritten digits (UCI, 1,797 8x8 images), upsampled to
   28x28 so every model and lesson runs unchanged. A one-line note always says which is in use.

The IDX format is LeCun et al.'s (http://yann.lecun.com/exdb/mnist/): a magic number
``0x00 0x00 <dtype> <ndim>``, ``ndim`` big-endian int32 sizes, then the data.
"""
from __future__ import annotations

from dtlib.extras import require

require("course", "torch", feature=__name__)

import gzip
import hashlib
import os
import socket
import struct
import threading
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

__all__ = [
    "Digits", "IdxFormatError", "read_idx", "write_idx", "load_mnist",
    "shard_indices", "global_batches", "shard_batch",
]

# (images, labels) file stems per split, and SHA-256 of the published .gz files
# (the digests torchvision's and TFDS's checksum lists carry).
MNIST_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
MNIST_SHA256 = {
    "train-images-idx3-ubyte.gz": "440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609",
    "train-labels-idx1-ubyte.gz": "3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c",
    "t10k-images-idx3-ubyte.gz": "8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6",
    "t10k-labels-idx1-ubyte.gz": "f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6",
}
MNIST_MIRRORS = ("https://ossci-datasets.s3.amazonaws.com/mnist/",
                 "https://storage.googleapis.com/cvdf-datasets/mnist/")
# Per-pixel mean/std of the MNIST training set, as in pytorch/examples mnist/main.py.
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081
CACHE_DIR = Path.home() / ".cache" / "dtlib" / "mnist"

_IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
_offline_checked: bool | None = None  # remember an unreachable network for this process


class IdxFormatError(ValueError):
    """An IDX file is corrupt, truncated, or not an IDX file."""


@dataclass
class Digits:
    """Images ``[N, 1, 28, 28]`` (float32, normalised), labels ``[N]`` (int64), and where they came from."""

    images: torch.Tensor
    labels: torch.Tensor
    source: str

    def __len__(self) -> int:
        return len(self.labels)

    def subset(self, n: int) -> "Digits":
        """The first ``n`` examples (deterministic), for quick demos."""
        return Digits(self.images[:n], self.labels[:n], self.source)


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Parse an IDX file (optionally gzip-compressed) into a numpy array, validating its size."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            data = f.read()
    except (OSError, EOFError) as exc:
        raise IdxFormatError(f"{path}: cannot read ({exc}); the file is corrupt or truncated, "
                             "delete it to download it again") from exc
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise IdxFormatError(f"{path}: not an IDX file (the first two bytes must be zero)")
    dtype_code, ndim = data[2], data[3]
    if dtype_code not in _IDX_DTYPES:
        raise IdxFormatError(f"{path}: unknown IDX data type 0x{dtype_code:02x}; valid: "
                             + ", ".join(f"0x{k:02x}" for k in _IDX_DTYPES))
    header = 4 + 4 * ndim
    if len(data) < header:
        raise IdxFormatError(f"{path}: truncated header ({len(data)} bytes, need {header})")
    shape = struct.unpack(f">{ndim}i", data[4:header])
    dtype = np.dtype(_IDX_DTYPES[dtype_code])
    expected = header + int(np.prod(shape)) * dtype.itemsize
    if len(data) != expected:
        raise IdxFormatError(f"{path}: header says shape {shape} ({expected} bytes in all) but the "
                             f"file has {len(data)} bytes: it is truncated or corrupt")
    return np.frombuffer(data, dtype=dtype, offset=header).reshape(shape).astype(dtype.newbyteorder("="))


def write_idx(path: str | os.PathLike, array: np.ndarray) -> None:
    """Write ``array`` as an IDX file (gzip-compressed if the name ends in ``.gz``)."""
    codes = {np.dtype(v).newbyteorder("="): k for k, v in _IDX_DTYPES.items()}
    array = np.asarray(array)
    if array.dtype not in codes:
        raise ValueError(f"cannot store dtype {array.dtype} in IDX; valid: {sorted(map(str, codes))}")
    big = array.astype(np.dtype(array.dtype).newbyteorder(">"))
    blob = bytes([0, 0, codes[array.dtype], array.ndim]) + struct.pack(f">{array.ndim}i", *array.shape)
    blob += big.tobytes()
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wb") as f:
        f.write(blob)


def _candidate_dirs(root: str | os.PathLike | None) -> list[Path]:
    dirs = [Path(root)] if root else []
    if os.environ.get("DTLIB_MNIST_DIR"):
        dirs.append(Path(os.environ["DTLIB_MNIST_DIR"]))
    dirs.append(CACHE_DIR)
    return [d for base in dirs for d in (base, base / "MNIST" / "raw")]


def _find(stem: str, dirs: list[Path]) -> Path | None:
    for d in dirs:
        for name in (stem, stem + ".gz"):
            if (d / name).is_file():
                return d / name
    return None


def _network_reachable(host: str, timeout: float = 2.0) -> bool:
    """True if ``host:443`` accepts a connection within ``timeout`` s (DNS included: run in a thread)."""
    ok: list[bool] = []

    def probe() -> None:
        try:
            socket.create_connection((host, 443), timeout=timeout).close()
            ok.append(True)
        except OSError:
            pass

    t = threading.Thread(target=probe, daemon=True)
    t.start()
    t.join(timeout + 0.5)
    return bool(ok)


def _fetch(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read()


def _download(dest: Path) -> bool:
    """Fetch the four .gz files into ``dest``, verifying SHA-256; False if no mirror could serve them.

    A mirror that is unreachable or fails mid-way is skipped for the next one. A file whose digest
    differs is never kept; if no mirror served the right files, that is an error (not a silent
    fallback), since it means tampering or a broken mirror.
    """
    global _offline_checked
    if os.environ.get("DTLIB_OFFLINE") or _offline_checked is False:
        return False
    mismatch = None
    for mirror in MNIST_MIRRORS:
        if not _network_reachable(mirror.split("/")[2]):
            continue
        dest.mkdir(parents=True, exist_ok=True)
        try:
            for name, digest in MNIST_SHA256.items():
                target = dest / name
                if target.exists() and _sha256(target) == digest:
                    continue
                blob = _fetch(mirror + name)
                if hashlib.sha256(blob).hexdigest() != digest:
                    mismatch = f"{mirror + name}: SHA-256 mismatch; the mirror served a different file"
                    break
                tmp = target.with_suffix(".part")
                tmp.write_bytes(blob)
                os.replace(tmp, target)  # never leave a half-written file under the real name
            else:
                return True
        except OSError as exc:  # URLError, HTTPError and timeouts are OSErrors
            print(f"dtlib.data: download from {mirror} failed ({exc}); trying the next source")
    if mismatch:
        raise IdxFormatError(mismatch + ". Download MNIST by hand into $DTLIB_MNIST_DIR.")
    _offline_checked = False
    return False


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _normalise(images_uint8: np.ndarray) -> torch.Tensor:
    x = torch.from_numpy(images_uint8.astype(np.float32) / 255.0).unsqueeze(1)
    return (x - MNIST_MEAN) / MNIST_STD


def _sklearn_digits(split: str) -> Digits:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = torch.from_numpy(bunch.images.astype(np.float32) / 16.0).unsqueeze(1)  # [N,1,8,8] in [0,1]
    images = torch.nn.functional.interpolate(images, size=(28, 28), mode="bilinear", align_corners=False)
    labels = torch.from_numpy(bunch.target.astype(np.int64))
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    cut = int(0.8 * len(labels))  # a fixed 80/20 train/test split
    idx = order[:cut] if split == "train" else order[cut:]
    return Digits((images[idx] - MNIST_MEAN) / MNIST_STD, labels[idx],
                  f"scikit-learn bundled 8x8 digits upsampled to 28x28 ({split}: {len(idx)} images)")


def load_mnist(split: str = "train", root: str | os.PathLike | None = None, download: bool = True,
               verbose: bool = True) -> Digits:
    """Load MNIST ``split`` ("train" or "test"); see the module docstring for where it looks."""
    if split not in MNIST_FILES:
        raise ValueError(f"split must be one of {sorted(MNIST_FILES)}, got {split!r}")
    dirs = _candidate_dirs(root)
    stems = MNIST_FILES[split]
    paths = [_find(s, dirs) for s in stems]
    if None in paths and download and _download(CACHE_DIR):
        paths = [_find(s, dirs) for s in stems]
    if None in paths:
        data = _sklearn_digits(split)
    else:
        images, labels = read_idx(paths[0]), read_idx(paths[1])
        if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
            raise IdxFormatError(f"{paths[0]} / {paths[1]}: expected images [N,28,28] and labels "
                                 f"[N], got {images.shape} and {labels.shape}")
        data = Digits(_normalise(images), torch.from_numpy(labels.astype(np.int64)),
                      f"MNIST from {paths[0].parent} ({split}: {len(labels)} images)")
    if verbose:
        print(f"dtlib.data: using {data.source}")
    return data


def shard_indices(n: int, rank: int, world_size: int, epoch: int = 0, seed: int = 0,
                  shuffle: bool = True) -> torch.Tensor:
    """Indices of rank ``rank``'s shard of ``n`` examples for ``epoch``.

    Like ``torch.utils.data.DistributedSampler`` (same permutation per epoch on every rank, then
    every ``world_size``-th index), but without padding: shards are disjoint and together cover
    the dataset exactly; their sizes differ by at most one when ``n % world_size != 0``.
    """
    _check_rank(rank, world_size)
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    order = (torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)) if shuffle
             else torch.arange(n))
    return order[rank::world_size]


def global_batches(n: int, batch_size: int, epoch: int = 0, seed: int = 0, shuffle: bool = True,
                   drop_last: bool = True) -> list[torch.Tensor]:
    """The single-process order of mini-batches for an epoch: what data-parallel ranks split."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    order = shard_indices(n, 0, 1, epoch, seed, shuffle)
    batches = list(order.split(batch_size))
    if drop_last and batches and len(batches[-1]) < batch_size:
        batches.pop()
    return batches


def shard_batch(batch: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous slice of a global batch (sizes differ by at most one)."""
    _check_rank(rank, world_size)
    return torch.tensor_split(batch, world_size)[rank]


def _check_rank(rank: int, world_size: int) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need world_size >= 1 and 0 <= rank < world_size, got rank={rank}, "
                         f"world_size={world_size}")
