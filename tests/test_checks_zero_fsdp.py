"""Lesson 4's graded checks accept a correct ZeRO-1 and reject the classic mistakes with a message
naming the cause; the lesson's measurements match dtlib.analytic.memory / dtlib.analytic.comm; its plots build."""
from collections import Counter

import pytest
import torch
import torch.distributed as dist

from dtlib.grading.checks import zero_fsdp as checks
from dtlib.models import TinyGPT, tiny_gpt_config
from dtlib.viz import zero as viz
from dtlib.experiments import zero as experiments


# ---- q1 ----------------------------------------------------------------------------------------------
def shard_params(params, world_size):
    load = [0] * world_size
    owners = [0] * len(params)
    for i in sorted(range(len(params)), key=lambda i: -params[i].numel()):
        rank = load.index(min(load))
        owners[i] = rank
        load[rank] += params[i].numel()
    return owners


def test_shard_check_accepts_greedy_and_rejects_mistakes():
    checks.check_shard_params(shard_params)  # the hand-written greedy, not the check's own reference
    with pytest.raises(AssertionError, match="balance by size, not by count"):
        checks.check_shard_params(lambda ps, n: [i % n for i in range(len(ps))])  # round-robin
    with pytest.raises(AssertionError, match="returned None"):
        checks.check_shard_params(lambda ps, n: None)
    with pytest.raises(AssertionError, match="one rank in"):
        checks.check_shard_params(lambda ps, n: [n] * len(ps))
    with pytest.raises(AssertionError, match="deterministic"):
        checks.check_shard_params(lambda ps, n, calls=[]: (calls.append(1), shard_params(ps, n)[::-1]
                                                          if len(calls) % 2 else shard_params(ps, n))[1])


# ---- q2 ----------------------------------------------------------------------------------------------
class ZeRO1:
    def __init__(self, params, lr=1e-3, weight_decay=0.01):
        self.params = list(params)
        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        self.owners = shard_params(self.params, self.world_size)
        mine = [p for p, owner in zip(self.params, self.owners) if owner == self.rank]
        self.optimizer = torch.optim.AdamW(mine, lr=lr, weight_decay=weight_decay)

    @torch.no_grad()
    def step(self):
        self.optimizer.step()
        for p, owner in zip(self.params, self.owners):
            dist.broadcast(p.data, src=owner)


class FullOnEveryRank(ZeRO1):  # right numbers, no saving
    def __init__(self, params, lr=1e-3, weight_decay=0.01):
        super().__init__(params, lr, weight_decay)
        self.optimizer = torch.optim.AdamW(self.params, lr=lr, weight_decay=weight_decay)


class NoBroadcast(ZeRO1):
    @torch.no_grad()
    def step(self):
        self.optimizer.step()


class AveragesWeights(ZeRO1):
    @torch.no_grad()
    def step(self):
        self.optimizer.step()
        for p in self.params:
            dist.all_reduce(p.data)
            p.data /= self.world_size


class OwnerOnlyBroadcasts(ZeRO1):  # a collective only one rank calls: hangs
    @torch.no_grad()
    def step(self):
        self.optimizer.step()
        for p, owner in zip(self.params, self.owners):
            if owner == self.rank:
                dist.broadcast(p.data, src=owner)


class WrongHyperparameters(ZeRO1):
    def __init__(self, params, lr=1e-3, weight_decay=0.01):
        super().__init__(params, lr, weight_decay)
        self.optimizer = torch.optim.Adam(self.optimizer.param_groups[0]["params"], lr=lr)


class Stub:
    def __init__(self, params, lr=1e-3, weight_decay=0.01):
        ...

    def step(self):
        ...


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_zero1_check_accepts_the_solution(world_size):
    checks.check_zero1(ZeRO1, world_size=world_size)


@pytest.mark.parametrize("cls,message", [
    (FullOnEveryRank, "every rank steps the full optimizer"),
    (NoBroadcast, "never changed on rank"),
    (AveragesWeights, "don't average the weights"),
    (WrongHyperparameters, "differs from unsharded AdamW by"),
    (Stub, "no inner torch optimizer"),
])
def test_zero1_check_rejects_classic_mistakes(cls, message):
    with pytest.raises(AssertionError, match=message):
        checks.check_zero1(cls, world_size=2)


def test_zero1_check_reports_a_hang():
    with pytest.raises(AssertionError, match="hung.*every rank"):
        checks.check_zero1(OwnerOnlyBroadcasts, world_size=2, timeout=5)


def test_state_per_rank_is_about_one_nth():
    report = checks.zero1_state_per_rank(ZeRO1, world_size=4)
    assert sum(report["per_rank"]) == report["unsharded"]
    assert max(report["per_rank"]) < report["unsharded"] / 2
    with pytest.raises(AssertionError, match="raised on rank"):
        checks.zero1_state_per_rank(lambda params, **kw: 1 / 0, world_size=2)


# ---- the lesson's measurements ---------------------------------------------------------------------------
def test_measured_bytes_per_rank_match_the_prediction():
    cfg = tiny_gpt_config(layers=2, hidden=64, heads=4)
    out = experiments.measure_zero_stages(world_size=2, cfg=cfg, steps=2, batch=4)
    n_params = sum(p.numel() for p in TinyGPT(cfg).parameters())
    for z, r in out.items():
        for rank in r["per_rank"]:
            for part in ("parameters", "gradients", "optimizer"):
                # equal up to the padding of flat buffers to a multiple of N (a few elements)
                assert abs(rank[part] - r["predicted"][part]) <= 8 * 2 * 8, (z, part)
        assert r["max_diff_vs_ddp"] < 1e-5
    assert out[0]["per_rank"][0]["optimizer"] == 8 * n_params
    ops = {z: Counter(op for op, _ in r["calls"]) for z, r in out.items()}
    assert ops[0] == {"all_reduce": 1}
    assert ops[1] == {"all_reduce": 1, "all_gather": 1}  # DDP + gather: 1.5x the prediction
    assert ops[2] == {"reduce_scatter": 1, "all_gather": 1}
    # 3 units, gathered twice each; one small all-reduce of a flag per parameter (which ones a
    # backward reached: the others keep grad None, as in one process)
    assert ops[3] == {"all_gather": 6, "reduce_scatter": 3, "all_reduce": 1}
    for z in (0, 2, 3):
        assert out[z]["sent"] == pytest.approx(out[z]["predicted"]["sent"], rel=1e-3)
    assert out[1]["sent"] == pytest.approx(1.5 * out[1]["predicted"]["sent"], rel=1e-3)
    fig = viz.plot_zero_stages(out)
    left, right = fig.axes
    parts = ("parameters", "gradients", "optimizer")
    # left: one stacked bar per rank and stage, in a power-of-1024 unit; one dashed prediction each
    measured = [rank[p] for z in out for rank in out[z]["per_rank"] for p in parts]
    heights = [p.get_height() for p in left.patches]
    unit = sum(measured) / sum(heights)
    assert min(abs(unit - 1024 ** k) for k in range(4)) < 1e-6 * unit
    assert [h * unit for h in heights] == pytest.approx(measured)
    assert len(left.collections) == len(out)
    assert [t.get_text() for t in left.get_legend().get_texts()] == [*parts, "predicted"]
    labels = [t.get_text() for t in left.get_xticklabels()]
    assert len(labels) == 4 and labels[0].startswith("DDP")
    assert all(f"ZeRO-{z}" in labels[z] for z in (1, 2, 3))
    # right: measured and predicted bytes sent, side by side for each stage
    assert [t.get_text() for t in right.get_legend().get_texts()] == ["measured", "predicted"]
    sent = [p.get_height() for p in right.patches]
    assert len(sent) == 2 * len(out)
    assert [m / p for m, p in zip(sent[:4], sent[4:])] == pytest.approx(
        [out[z]["sent"] / out[z]["predicted"]["sent"] for z in out], rel=1e-6)


def test_predictions_follow_the_zero_paper():
    # Rajbhandari et al. 2020, Fig. 1: 7.5B parameters, 64 GPUs, 2 + 2 + 12 bytes
    pred = experiments.predict_zero_stages(7.5e9, 64, prec="zero")
    totals = [sum(p[k] for k in ("parameters", "gradients", "optimizer")) / 1e9 for p in pred.values()]
    assert totals == pytest.approx([120, 31.4, 16.6, 1.9], abs=0.05)
    assert "sent" not in pred[0]  # a bare parameter count has no shape to price communication
    shaped = experiments.predict_zero_stages("llama3-8b", 8, prec="zero")
    assert shaped[3]["sent"] == pytest.approx(1.5 * shaped[0]["sent"])


def test_fsdp_next_to_fully_shard():
    cmp = experiments.compare_fully_shard(world_size=2, cfg=tiny_gpt_config(layers=2, hidden=64, heads=4),
                                          steps=2, batch=4)
    assert cmp["max_param_diff"] < 1e-5
    assert cmp["ours"]["sharded_param_bytes"] == pytest.approx(cmp["torch"]["SHARDED_PARAM"], rel=0.05)
    assert cmp["ours"]["peak_unsharded_bytes"] == pytest.approx(cmp["torch"]["UNSHARDED_PARAM"], rel=0.05)


def test_plots_build_and_refuse_empty_input():
    per_rank = {"DDP": [{"parameters": 4.0, "gradients": 4.0, "optimizer": 8.0}] * 2}
    fig = viz.plot_stage_costs(per_rank, predicted={"DDP": per_rank["DDP"][0]},
                               sent={"DDP": {"measured": 1.0, "predicted": 1.0}}, gpu_memory=20.0)
    assert len(fig.axes) == 2
    fig = viz.plot_side_by_side({"a": {"x": 1.0, "y": 2.0}, "b": {"x": 3.0}}, scale=1.0)
    (ax,) = fig.axes  # bars grouped by key, one series per inner key (a missing value is 0)
    assert [p.get_height() for p in ax.patches] == [1.0, 3.0, 2.0, 0.0]  # series x, then y
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["x", "y"]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["a", "b"]
    with pytest.raises(ValueError, match="nothing to plot"):
        viz.plot_stage_costs({})
    with pytest.raises(ValueError, match="nothing to plot"):
        viz.plot_side_by_side({})
