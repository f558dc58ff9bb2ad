"""Incremental checkpoints: deltas are lossless (bit for bit), smaller than a full save when only
part of the state changed, and a dtlib train resume from them equals a full-checkpoint resume."""
import os

import pytest
import torch

from dtlib.resilience.incremental import IncrementalCheckpointer, apply_delta, encode_delta, state_bytes
from dtlib.trainer import TrainConfig, run


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.uint8])
def test_delta_round_trip_is_bit_identical(dtype):
    g = torch.Generator().manual_seed(0)
    base = (torch.randn(5000, generator=g) * 100).to(dtype)
    new = base.clone()
    new[17] = new[17] + 1
    new[4999] = 0
    if dtype.is_floating_point:
        new[100] = float("nan")
        new[101] = -0.0
    d = encode_delta(new, base, chunk=1024)
    assert d["chunks"].tolist() == [0, 4]  # elements 17, 100, 101 in chunk 0; 4999 in chunk 4
    back = apply_delta(base, d)
    assert back.dtype == dtype and torch.equal(back.view(-1).view(torch.uint8), new.view(-1).view(torch.uint8))


def test_unchanged_state_writes_no_chunk_and_half_frozen_writes_less(tmp_path):
    g = torch.Generator().manual_seed(0)
    state = {"frozen": torch.randn(20000, generator=g), "trained": torch.randn(20000, generator=g)}
    ck = IncrementalCheckpointer(str(tmp_path), full_every=4)
    assert ck.save(0, state)[0] == "full"
    _, same = ck.save(1, state)  # nothing changed since the full save: no chunk, a few hundred bytes
    state["trained"] = state["trained"] - 1e-3 * torch.randn(20000, generator=g)
    kind, delta = ck.save(2, state)
    assert kind == "delta"
    full = ck.written[0][2]
    assert same < 0.02 * full
    assert delta < 0.6 * full  # only half the state changed, and its XOR compresses
    step, loaded, _ = IncrementalCheckpointer(str(tmp_path)).load()
    assert step == 2 and all(torch.equal(loaded[k], state[k]) for k in state)
    assert ck.save(3, state)[0] == "delta"
    assert ck.save(4, state)[0] == "full"  # every 4th save after a full one is full; older files go
    assert [s for s in sorted(os.listdir(tmp_path)) if os.listdir(tmp_path / s)] == ["incr-step00000004"]
    assert state_bytes(state) == 160000


SMALL = dict(layers=1, hidden=32, heads=4, seq=16, dp=2, checkpoint_every=1, resume=True)


def test_incremental_resume_is_bit_identical_to_a_full_checkpoint_resume(tmp_path):
    """dp2 AdamW: 4 steps with checkpoints every step, stopped, resumed to step 7 -- once from
    incremental checkpoints (full every 3 saves: the resume loads a delta), once from full DCP
    checkpoints; both end with the uninterrupted run's parameters."""
    straight = run(TrainConfig(**{**SMALL, "checkpoint_every": 0, "resume": False}, steps=7), timeout=60)
    results = {}
    for name, extra in (("incremental", dict(incremental=True, full_every=3)), ("full", {})):
        d = str(tmp_path / name)
        run(TrainConfig(**SMALL, **extra, checkpoint_dir=d, steps=5), timeout=60)
        results[name] = run(TrainConfig(**SMALL, **extra, checkpoint_dir=d, steps=7), timeout=60)
        assert "resumed at step 5" in results[name]["resumed"]
    assert results["incremental"]["params_sha256"] == results["full"]["params_sha256"] == straight["params_sha256"]
    inc = run(TrainConfig(**SMALL, incremental=True, full_every=3, checkpoint_dir=str(tmp_path / "b"), steps=4),
              timeout=60)
    kinds = [w["kind"] for w in inc["checkpoint_bytes"]]
    assert kinds == ["full", "delta", "delta", "full"]
    full_b = [w["bytes"] for w in inc["checkpoint_bytes"] if w["kind"] == "full"]
    delta_b = [w["bytes"] for w in inc["checkpoint_bytes"] if w["kind"] == "delta"]
    assert max(delta_b) < min(full_b)
    assert results["incremental"]["checkpoint_bytes"], "the resumed run checkpoints again"


def test_incremental_options_are_checked():
    with pytest.raises(ValueError, match="--incremental needs --checkpoint-dir"):
        TrainConfig(incremental=True).check()
    with pytest.raises(ValueError, match="use --zero 0"):
        TrainConfig(incremental=True, checkpoint_dir="x", dp=2, zero=1).check()
    with pytest.raises(ValueError, match="full_every must be"):
        TrainConfig(full_every=0).check()


def test_incremental_resume_on_another_world_size_is_refused(tmp_path):
    d = str(tmp_path)
    run(TrainConfig(**SMALL, incremental=True, checkpoint_dir=d, steps=2), timeout=60)
    with pytest.raises(Exception, match="resume on the layout that saved them"):
        run(TrainConfig(**{**SMALL, "dp": 1}, incremental=True, checkpoint_dir=d, steps=3), timeout=60)
