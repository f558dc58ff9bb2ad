"""Mixture of experts: routing, capacity and the load-balancing loss by hand; expert parallelism
on 2 and 4 ranks equals the single-process MoE (same routing, same dropped tokens) in outputs and
gradients; the all-to-alls counted."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dtlib.launcher import launch
from dtlib.measure import CollectiveCounter
from dtlib.models.gpt import MLP, tiny_gpt_config
from dtlib.models.moe import MoE, route
from dtlib.parallel.expert import ExpertParallelMoE, all_to_all

TIMEOUT = 60
# float32, same sums in another order (tokens regrouped by rank, top-k outputs added in another
# order): expert gradients sum ~64 token terms of size ~10 (a summed squared error), so ~1e-6;
# a wrong weight, a token sent to the wrong expert or a missing backward is off by > 1e-1
ATOL = 1e-5


def test_capacity_drops_later_tokens():
    # 8 tokens all preferring expert 0, then expert 1: capacity = ceil(1.0 * 8 * 2 / 4) = 4
    logits = torch.tensor([[4.0, 3.0, 0.0, 0.0]]).repeat(8, 1)[None]
    r = route(logits, top_k=2, capacity_factor=1.0)
    assert r.keep[:, 0].tolist() == [True] * 4 + [False] * 4  # first choices, in token order
    assert r.keep[:, 1].tolist() == [True] * 4 + [False] * 4
    assert r.dropped == 8 and r.load(4).tolist() == [4, 4, 0, 0]
    assert route(logits, 2, None).dropped == 0
    # second choices queue behind all first choices (GShard): token 0's second choice (expert 0)
    # loses to token 2's first choice; token-major order would keep it
    mixed = torch.tensor([[[3.0, 5.0, 0.0, 0.0]] * 2 + [[5.0, 3.0, 0.0, 0.0]] * 2])  # 4 tokens
    r = route(mixed, top_k=2, capacity_factor=0.5)  # capacity ceil(0.5 * 4 * 2 / 4) = 1
    assert r.keep.tolist() == [[True, False], [False, False], [True, False], [False, False]]


def test_load_balancing_loss():
    e = 4
    uniform = torch.zeros(1, 8, e)  # P_i = 1/E; top-1 of ties is expert 0 -> f_0 = 1
    assert route(uniform, 1, None).aux_loss.item() == pytest.approx(e * 1.0 * 0.25)
    # perfectly balanced: each expert gets 2 tokens with probability ~1 -> E * sum(1/E * 1/E) = 1
    balanced = (torch.eye(e) * 30).repeat(2, 1)[None]
    assert route(balanced, 1, None).aux_loss.item() == pytest.approx(1.0, rel=1e-6)


def test_moe_equals_per_token_loop():
    torch.manual_seed(0)
    cfg = tiny_gpt_config(hidden=16, heads=2, moe_experts=4, moe_top_k=2)
    moe = MoE(16, 4, 2, lambda: MLP(cfg), capacity_factor=1.0)
    x = torch.randn(3, 8, 16)
    y = moe(x)
    probs = F.softmax(moe.router(x), -1)
    routing = moe.last_routing
    expect = torch.zeros(24, 16)
    flat = x.reshape(24, 16)
    for t in range(24):
        for k in range(2):
            if routing.keep[t, k]:
                e = routing.experts[t, k].item()
                expect[t] += probs.reshape(24, 4)[t, e] * moe.experts[e](flat[t])
    torch.testing.assert_close(y.reshape(24, 16), expect, atol=1e-6, rtol=0)
    assert 0 < routing.dropped < 48  # the capacity factor of 1.0 bites on random routing


def _ep_vs_single(rank, world_size, capacity_factor):
    cfg = tiny_gpt_config(hidden=16, heads=2, moe_experts=4, moe_top_k=2)
    torch.manual_seed(0)
    ref = MoE(16, 4, 2, lambda: MLP(cfg), capacity_factor)
    inputs = [torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(r)) for r in range(world_size)]
    targets = [torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(100 + r)) for r in range(world_size)]
    # single process: every rank's tokens (each sequence its own routing group), summed losses
    ref_out = [ref(x) for x in inputs]
    sum(((o - t) ** 2).sum() for o, t in zip(ref_out, targets)).backward()
    ref_router_grad = torch.autograd.grad(((ref(inputs[rank]) - targets[rank]) ** 2).sum(), ref.router.weight)[0]
    results = {}
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    for ep, group in ((4, None), (2, pairs[rank // 2])):
        torch.manual_seed(0)
        moe = ExpertParallelMoE(MoE(16, 4, 2, lambda: MLP(cfg), capacity_factor), group)
        # with ep=2 the pair {0,1} (or {2,3}) sees only its own ranks' tokens
        members = list(range(world_size)) if ep == 4 else [rank // 2 * 2, rank // 2 * 2 + 1]
        with CollectiveCounter() as counter:
            out = moe(inputs[rank])
        ((out - targets[rank]) ** 2).sum().backward()
        if ep == 4:
            expect_out = ref_out[rank]
            expert_ref = {n: p.grad for n, p in ref.named_parameters()}
        else:  # reference restricted to the pair's tokens
            pair_ref = MoE(16, 4, 2, lambda: MLP(cfg), capacity_factor)
            pair_ref.load_state_dict(ref.state_dict())
            expect_out = pair_ref(inputs[rank])
            sum(((pair_ref(inputs[m]) - targets[m]) ** 2).sum() for m in members).backward()
            expert_ref = {n: p.grad for n, p in pair_ref.named_parameters()}
        errors = {"out": (out - expect_out).abs().max().item(),
                  "router": (moe.router.weight.grad - ref_router_grad).abs().max().item()}
        for name, p in moe.named_parameters():
            if name.startswith("experts."):
                errors[name] = (p.grad - expert_ref[name]).abs().max().item()
        kept = int(moe.last_routing.keep.sum())
        results[ep] = {"errors": errors, "experts": sorted({n.split(".")[1] for n, _ in moe.named_parameters()
                                                            if n.startswith("experts.")}),
                       "alltoall": [n for c, n in counter.calls if c == "all_to_all"], "kept": kept,
                       "dropped": moe.last_routing.dropped}
    return results


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_expert_parallel_equals_single_process(capacity_factor):
    everything = launch(_ep_vs_single, 4, args=(capacity_factor,), timeout=TIMEOUT)
    for rank, results in enumerate(everything):
        for ep, res in results.items():
            assert max(res["errors"].values()) < ATOL, (rank, ep, res["errors"])
            local = 4 // ep
            first = rank % ep * local
            assert res["experts"] == [str(e) for e in range(first, first + local)]
            # forward: counts (4 experts x int64), dispatch (this rank's kept rows x 16 floats),
            # combine (the rows its experts received)
            counts, dispatch, _ = res["alltoall"]
            assert counts == 4 * 8 and dispatch == res["kept"] * 16 * 4
            if capacity_factor is None:
                assert res["dropped"] == 0 and res["kept"] == 2 * 8 * 2
    for ep, groups in ((4, [[0, 1, 2, 3]]), (2, [[0, 1], [2, 3]])):
        for g in groups:  # what the group dispatched is what its experts sent back
            assert sum(everything[r][ep]["alltoall"][1] for r in g) == sum(everything[r][ep]["alltoall"][2] for r in g)


def _uneven(rank, world_size):
    # rank r holds r + 2 rows 10r, 10r+1, ...; its first row goes to rank 0, the rest to rank 1
    x = (10.0 * rank + torch.arange(rank + 2.0)).view(-1, 1).requires_grad_()
    input_splits = [1, rank + 1]
    output_splits = [1, 1] if rank == 0 else [1, 2]
    y = all_to_all(x, output_splits, input_splits)
    (y * (rank + 1)).sum().backward()  # rank 1's rows count twice
    return y.detach().view(-1).tolist(), x.grad.view(-1).tolist()


def test_uneven_all_to_all_and_its_backward():
    (y0, g0), (y1, g1) = launch(_uneven, 2, timeout=TIMEOUT)
    assert y0 == [0.0, 10.0] and y1 == [1.0, 11.0, 12.0]
    assert g0 == [1.0, 2.0] and g1 == [1.0, 2.0, 2.0]
