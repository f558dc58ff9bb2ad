"""Monitoring and integrity in dtlib train: a bit flipped on one rank is caught at the next
checksum and that rank named; metrics go to JSON lines and TensorBoard; alerts fire on spikes."""
import math
import os

import pytest
import torch

from dtlib.monitor import Alarm, read_metrics
from dtlib.resilience.integrity import checksum, compare, flip_bit
from dtlib.trainer import TrainConfig, run

SMALL = dict(layers=1, hidden=32, heads=4, seq=16, steps=6)


def test_flip_bit_changes_one_bit_silently():
    t = torch.ones(4)
    before = checksum([t])
    flip_bit(t, index=2, bit=16)
    assert checksum([t]) != before
    assert t[2].item() == pytest.approx(1.0, rel=0.01) and t[2].item() != 1.0 and math.isfinite(t[2].item())
    flip_bit(t, index=2, bit=16)
    assert checksum([t]) == before


def test_compare_names_the_minority_and_admits_a_tie():
    assert compare({0: "a", 1: "a", 2: "b"}) == {"diverged": [2], "majority": "a"}
    assert compare({0: "a", 1: "a"}) == {"diverged": [], "majority": "a"}
    assert compare({0: "a", 1: "b"}) == {"diverged": [0, 1], "majority": None}


@pytest.mark.parametrize("layout, rank", [(dict(dp=3), 1), (dict(dp=3), 0), (dict(dp=2, tp=2), 3)])
def test_a_flipped_bit_is_caught_at_the_next_checksum_and_its_rank_named(layout, rank, tmp_path):
    """Flip after step 2 on ``rank``; checksums every 2 steps (after steps 1, 3, 5): step 1 is clean,
    step 3 names ``rank`` (and only it), and so does step 5 (the difference stays)."""
    out = run(TrainConfig(**SMALL, **layout, checksum_every=2, flip_bit_step=2, flip_bit_rank=rank,
                          metrics=str(tmp_path / "m.jsonl")), timeout=60)
    if layout.get("tp") == 2:  # dp2 x tp2: rank 3's replica is rank 1 -- two copies, no majority
        assert out["integrity"][0] == {"step": 3, "diverged": [1, 3], "ambiguous": True}
    else:
        assert out["integrity"] == [{"step": 3, "diverged": [rank], "ambiguous": False},
                                    {"step": 5, "diverged": [rank], "ambiguous": False}]
    records = read_metrics(str(tmp_path / "m.jsonl"))
    assert [r.get("diverged") for r in records][:4] == [None, [], None, out["integrity"][0]["diverged"]]


def test_no_flip_no_divergence_and_metrics_in_both_sinks(tmp_path):
    out = run(TrainConfig(**SMALL, dp=2, checksum_every=1, metrics=str(tmp_path / "m.jsonl"),
                          tensorboard=str(tmp_path / "tb")), timeout=60)
    assert out["integrity"] == []
    records = read_metrics(str(tmp_path / "m.jsonl"))
    assert [r["step"] for r in records] == list(range(6))
    assert [r["loss"] for r in records] == out["losses"]
    assert all(r["grad_norm"] > 0 for r in records)
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(tmp_path / "tb"))


@pytest.fixture(scope="module")
def one_process_norms(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("norms") / "one.jsonl")
    run(TrainConfig(**{**SMALL, "layers": 2}, num_microbatches=2, optimizer="sgd", metrics=path), timeout=60)
    return [r["grad_norm"] for r in read_metrics(path)]


@pytest.mark.parametrize("layout", [dict(dp=2), dict(dp=2, zero=1), dict(dp=2, zero=3), dict(tp=2, num_microbatches=2),
                                    dict(pp=2, num_microbatches=2)], ids=str)
def test_grad_norm_is_the_global_norm_whatever_the_layout(layout, one_process_norms, tmp_path):
    """Replicated gradients count once, shards once each, TP-replicated weights once: every layout
    reports the norm of one process on the same global batch."""
    path = str(tmp_path / "m.jsonl")
    out = run(TrainConfig(**{**SMALL, "layers": 2}, **layout, optimizer="sgd", metrics=path), timeout=60)
    assert [r["grad_norm"] for r in read_metrics(path)] == pytest.approx(one_process_norms, rel=1e-4)
    assert out["alerts"] == []


def test_alarm_fires_on_a_spike_not_on_noise():
    alarm = Alarm("loss", factor=1.5, window=5, warmup=3)
    assert [alarm(v) for v in (3.0, 2.9, 2.8, 2.7, 2.75)] == [None] * 5
    line = alarm(6.0)
    assert line.startswith("loss 6 > 1.5 x the median 2.8")
    assert alarm(2.6) is None  # the spike does not raise the bar (median)
    assert Alarm("grad_norm", 2.0, warmup=1)(float("nan")) is None  # still warming up
    a = Alarm("grad_norm", 2.0, warmup=1)
    a(1.0)
    assert a(float("inf")) is not None


def test_a_gradient_explosion_raises_the_alerts(tmp_path):
    """--spike-step 5 multiplies the gradients by 1000: the grad-norm alert fires at step 5, and the
    loss of the next step (after SGD's huge update) fires the loss alert; no alert before."""
    out = run(TrainConfig(**{**SMALL, "steps": 8}, dp=2, optimizer="sgd", lr=0.05, spike_step=5,
                          metrics=str(tmp_path / "m.jsonl")), timeout=60)
    first = {a["alert"].split()[0]: a["step"] for a in reversed(out["alerts"])}
    assert first == {"grad_norm": 5, "loss": 6}, out["alerts"]
    assert read_metrics(str(tmp_path / "m.jsonl"))[5]["alerts"][0].startswith("grad_norm")


@pytest.mark.parametrize("changes, message", [
    (dict(spike_step=1, zero=2, dp=2), "--spike-step scales the gradients"),
    (dict(checksum_every=1, zero=3, dp=2), "--zero 3"),
    (dict(flip_bit_step=9, steps=3), "flip_bit_step must be an integer from 0 to 2"),
    (dict(flip_bit_rank=0), "--flip-bit-rank needs --flip-bit-step"),
    (dict(flip_bit_step=0, flip_bit_rank=2, dp=2), "flip_bit_rank must be an integer from 0 to 1"),
])
def test_bad_monitoring_options(changes, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**changes).check()
