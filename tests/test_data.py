"""dtlib.data: the IDX parser on files the tests write, the fallback, and sharding."""
import gzip
import hashlib

import numpy as np
import pytest
import torch

from dtlib import data
from dtlib.data import IdxFormatError, global_batches, read_idx, shard_batch, shard_indices, write_idx


@pytest.mark.parametrize("suffix", ["", ".gz"])
@pytest.mark.parametrize("dtype", [np.uint8, np.int32, np.float32])
def test_idx_round_trip(tmp_path, suffix, dtype):
    arr = (np.arange(2 * 3 * 4) * 3).reshape(2, 3, 4).astype(dtype)
    path = tmp_path / f"a{suffix}"
    write_idx(path, arr)
    out = read_idx(path)
    assert out.dtype == arr.dtype and out.shape == arr.shape and np.array_equal(out, arr)


def test_idx_header_layout_matches_lecun_spec(tmp_path):
    write_idx(tmp_path / "l", np.array([7, 2, 1], dtype=np.uint8))
    raw = (tmp_path / "l").read_bytes()
    assert raw == bytes([0, 0, 0x08, 1, 0, 0, 0, 3, 7, 2, 1])


def test_idx_bad_files_give_clear_errors(tmp_path):
    good = tmp_path / "good"
    write_idx(good, np.zeros((4, 28, 28), np.uint8))
    (tmp_path / "trunc").write_bytes(good.read_bytes()[:-10])
    with pytest.raises(IdxFormatError, match="truncated or corrupt"):
        read_idx(tmp_path / "trunc")
    (tmp_path / "notidx").write_bytes(b"PK\x03\x04hello")
    with pytest.raises(IdxFormatError, match="not an IDX file"):
        read_idx(tmp_path / "notidx")
    (tmp_path / "badtype").write_bytes(bytes([0, 0, 0x42, 1, 0, 0, 0, 1, 0]))
    with pytest.raises(IdxFormatError, match="unknown IDX data type 0x42"):
        read_idx(tmp_path / "badtype")
    noisy = tmp_path / "noisy"
    write_idx(noisy, np.random.default_rng(0).integers(0, 256, (4, 28, 28), dtype=np.uint8))
    (tmp_path / "bad.gz").write_bytes(gzip.compress(noisy.read_bytes())[:500])
    with pytest.raises(IdxFormatError, match="corrupt or truncated"):
        read_idx(tmp_path / "bad.gz")


def _fake_mnist(folder, n=12):
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    imgs = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, n).astype(np.uint8)
    write_idx(folder / "t10k-images-idx3-ubyte.gz", imgs)
    write_idx(folder / "t10k-labels-idx1-ubyte", labels)
    return imgs, labels


def test_load_mnist_from_torchvision_layout(tmp_path, capsys):
    imgs, labels = _fake_mnist(tmp_path / "MNIST" / "raw")
    d = data.load_mnist("test", root=tmp_path, download=False)
    assert "using MNIST from" in capsys.readouterr().out
    assert d.images.shape == (12, 1, 28, 28) and d.labels.tolist() == labels.tolist()
    expected = (torch.from_numpy(imgs[0].astype(np.float32)) / 255 - data.MNIST_MEAN) / data.MNIST_STD
    assert torch.allclose(d.images[0, 0], expected)


def test_load_mnist_mismatched_files_is_an_error(tmp_path):
    _fake_mnist(tmp_path)
    write_idx(tmp_path / "t10k-labels-idx1-ubyte", np.zeros(5, np.uint8))
    with pytest.raises(IdxFormatError, match="expected images"):
        data.load_mnist("test", root=tmp_path, download=False)


def test_fallback_is_real_bundled_digits(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(data, "CACHE_DIR", tmp_path / "empty")
    monkeypatch.delenv("DTLIB_MNIST_DIR", raising=False)
    monkeypatch.setenv("DTLIB_OFFLINE", "1")
    train, test = data.load_mnist("train"), data.load_mnist("test")
    assert "scikit-learn bundled 8x8 digits" in capsys.readouterr().out
    assert len(train) + len(test) == 1797 and train.images.shape[1:] == (1, 28, 28)
    assert set(train.labels.tolist()) == set(range(10))
    with pytest.raises(ValueError, match="split must be one of"):
        data.load_mnist("validation")


@pytest.mark.parametrize("n, world", [(10, 3), (12, 4), (5, 8), (0, 2), (7, 1)])
def test_shards_are_disjoint_covering_and_balanced(n, world):
    shards = [shard_indices(n, r, world, epoch=3, seed=1) for r in range(world)]
    flat = torch.cat(shards).tolist()
    assert sorted(flat) == list(range(n))  # covering and disjoint
    sizes = [len(s) for s in shards]
    assert max(sizes) - min(sizes) <= 1


def test_shards_deterministic_per_epoch_and_reshuffled_across_epochs():
    a = shard_indices(100, 1, 4, epoch=0, seed=7)
    assert torch.equal(a, shard_indices(100, 1, 4, epoch=0, seed=7))
    assert not torch.equal(a, shard_indices(100, 1, 4, epoch=1, seed=7))
    with pytest.raises(ValueError, match="0 <= rank < world_size"):
        shard_indices(10, 4, 4)


def test_global_batches_split_into_rank_slices():
    batches = global_batches(50, 16, epoch=0)
    assert len(batches) == 3 and all(len(b) == 16 for b in batches)
    assert len(global_batches(50, 16, drop_last=False)) == 4
    parts = [shard_batch(batches[0], r, 3) for r in range(3)]
    assert torch.equal(torch.cat(parts), batches[0]) and [len(p) for p in parts] == [6, 5, 5]


def _gz_mnist(tmp_path):
    """The four published file names, holding small fake MNIST, and their SHA-256 digests."""
    src = tmp_path / "served"
    src.mkdir()
    rng = np.random.default_rng(1)
    for split, n in (("train", 20), ("test", 8)):
        images, labels = data.MNIST_FILES[split]
        write_idx(src / f"{images}.gz", rng.integers(0, 256, (n, 28, 28), dtype=np.uint8))
        write_idx(src / f"{labels}.gz", rng.integers(0, 10, n).astype(np.uint8))
    files = {p.name: p.read_bytes() for p in src.iterdir()}
    return files, {name: hashlib.sha256(blob).hexdigest() for name, blob in files.items()}


@pytest.fixture
def online(monkeypatch, tmp_path):
    """A reachable 'network' whose mirrors serve the files in ``served`` (what the test sets)."""
    monkeypatch.delenv("DTLIB_OFFLINE", raising=False)
    monkeypatch.delenv("DTLIB_MNIST_DIR", raising=False)
    monkeypatch.setattr(data, "_offline_checked", None)
    monkeypatch.setattr(data, "CACHE_DIR", tmp_path / "cache")
    monkeypatch.setattr(data, "_network_reachable", lambda host, timeout=2.0: True)
    files, digests = _gz_mnist(tmp_path)
    monkeypatch.setattr(data, "MNIST_SHA256", digests)
    served = {"files": files, "fetched": []}

    def fetch(url):
        served["fetched"].append(url)
        blob = served["files"][url.rsplit("/", 1)[1]]
        if isinstance(blob, Exception):
            raise blob
        return blob

    monkeypatch.setattr(data, "_fetch", fetch)
    return served


def test_download_is_verified_cached_and_loaded(online, tmp_path, capsys):
    d = data.load_mnist("train")
    assert len(d) == 20 and "using MNIST from" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == sorted(data.MNIST_SHA256)
    n = len(online["fetched"])
    data.load_mnist("test")  # cached: nothing fetched again
    assert len(online["fetched"]) == n == 4


def test_download_with_a_wrong_digest_is_an_error_and_keeps_nothing(online, tmp_path):
    name = "train-images-idx3-ubyte.gz"
    online["files"][name] = online["files"][name][:-10]  # a truncated / tampered file
    with pytest.raises(IdxFormatError, match="SHA-256 mismatch"):
        data.load_mnist("train")
    assert not (tmp_path / "cache" / name).exists()


def test_http_failure_falls_back_to_the_bundled_digits(online, capsys):
    import urllib.error

    online["files"]["train-labels-idx1-ubyte.gz"] = urllib.error.URLError("403 Forbidden")
    d = data.load_mnist("train")
    out = capsys.readouterr().out
    assert "failed" in out and "scikit-learn bundled" in out and len(d) == 1437


def test_unreachable_network_falls_back_fast(monkeypatch, tmp_path, capsys):
    import time

    monkeypatch.delenv("DTLIB_OFFLINE", raising=False)
    monkeypatch.delenv("DTLIB_MNIST_DIR", raising=False)
    monkeypatch.setattr(data, "_offline_checked", None)
    monkeypatch.setattr(data, "CACHE_DIR", tmp_path / "cache")
    monkeypatch.setattr(data, "MNIST_MIRRORS", ("https://127.0.0.1/mnist/",))  # nothing listens
    t0 = time.monotonic()
    d = data.load_mnist("test")
    # no waiting out urlopen's 30 s timeout on a mirror that refuses (a bound, not a speed)
    assert time.monotonic() - t0 < 25 and "scikit-learn bundled" in capsys.readouterr().out
    assert len(d) == 360


def test_mnist_dir_from_the_environment(monkeypatch, tmp_path, capsys):
    _fake_mnist(tmp_path / "mine")
    monkeypatch.setattr(data, "CACHE_DIR", tmp_path / "empty")
    monkeypatch.setenv("DTLIB_MNIST_DIR", str(tmp_path / "mine"))
    assert len(data.load_mnist("test", download=False)) == 12
    assert str(tmp_path / "mine") in capsys.readouterr().out
