"""What lesson 09 runs: ring attention and MoE dispatch on real ranks, and the CP memory sweep."""
import pytest

from dtlib.experiments import parallel3d as experiments


def test_ring_attention_run_reports_balance_and_traffic():
    zigzag = experiments.ring_attention_run(cp=2, seq=16)
    contiguous = experiments.ring_attention_run(cp=2, seq=16, zigzag=False)
    assert max(zigzag["error"], contiguous["error"]) < 1e-5
    assert zigzag["work"] == [68, 68] and contiguous["work"] == [1 + 2 + 3 + 4 + 5 + 6 + 7 + 8, 136 - 36]
    # forward: cp - 1 hops of K and V; backward: cp - 1 hops of K, V and their gradients + 1 home
    assert zigzag["sends"] == [1 + 2, 1 + 2]


def test_moe_dispatch_run_accounts_for_every_token():
    run = experiments.moe_dispatch_run(ep=2, experts=4, top_k=2, capacity_factor=None)
    assert run["dropped"] == 0 and sum(run["load"]) == run["assignments"] == 2 * 4 * 16 * 2
    assert [sum(row) for row in run["sent_to"]] == [4 * 16 * 2] * 2
    tight = experiments.moe_dispatch_run(ep=2, experts=4, top_k=2, capacity_factor=0.5)
    assert tight["dropped"] > 0 and sum(tight["load"]) == tight["assignments"] - tight["dropped"]
    assert max(tight["load"]) <= 2 * 4 * 16 * 2 * 0.5 / 4  # capacity per sequence x sequences


def test_activation_memory_scales_with_one_over_cp():
    seqs = [8192, 32768]
    out = experiments.activation_memory_vs_seq("llama3-8b", seqs, cps=[1, 2, 4])
    for i in range(len(seqs)):
        assert out[1][i] == pytest.approx(2 * out[2][i]) == pytest.approx(4 * out[4][i])
    assert out[1][1] == pytest.approx(4 * out[1][0])  # linear in s without the s^2 scores
