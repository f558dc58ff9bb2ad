"""Parameters that receive no gradient on some or all ranks: FSDP keeps ``.grad = None`` where no
rank used one (as one process), and the sample-weighted gradient average never sums one
parameter's gradient into another's when ranks skip different ones."""
import pytest
import torch
import torch.distributed as dist
from torch import nn

from dtlib.launcher import launch
from dtlib.parallel import FSDP, weighted_average_gradients

TIMEOUT = 60
STEPS = 3
# float32 sums in another order (reduce-scatter vs one process's batch): ~1e-7 relative
TOL = 1e-6


class Routed(nn.Module):
    """A trunk, a main head, an auxiliary head used only when asked, and three same-sized
    "experts" picked per sample by ``route`` (an expert no sample picks is never called, as in an
    MoE layer that received no token)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk, self.head, self.aux = nn.Linear(4, 8), nn.Linear(8, 1), nn.Linear(8, 1)
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x, route, use_aux):
        h = torch.tanh(self.trunk(x))
        mixed = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            rows = (route == e).nonzero(as_tuple=True)[0]
            if len(rows):
                mixed = mixed.index_add(0, rows, expert(h[rows]))
        out = self.head(h + mixed)
        return out + self.aux(h) if use_aux else out


def _data():
    """(x, y, route) per step for 8 samples: ranks 0 and 1 take samples 0-3 and 4-7. Step 0: rank 0
    routes to expert 0, rank 1 to expert 1; later steps: expert 0 only. Expert 2: never."""
    g = torch.Generator().manual_seed(3)
    out = []
    for step in range(STEPS):
        route = torch.tensor([0] * 4 + [1 if step == 0 else 0] * 4)
        out.append((torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g), route))
    return out


def _loss(model, x, y, route, step):
    return ((model(x, route, use_aux=step == 0) - y) ** 2).mean()


UNEQUAL_ROUTE = torch.tensor([0] * 3 + [1] * 5)  # step 0 of the unequal batches: 3 samples, then 5


def _single(make_opt, first_route=None):
    """One process on all 8 samples (sample-weighted = the plain mean over the batch)."""
    model = Routed()
    opt = make_opt(model.parameters())
    for step, (x, y, route) in enumerate(_data()):
        route = first_route if step == 0 and first_route is not None else route
        opt.zero_grad()
        _loss(model, x, y, route, step).backward()
        opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}


def _fsdp(rank, world):
    model = Routed()
    fsdp = FSDP(model)
    opt = torch.optim.AdamW(fsdp.parameters(), lr=1e-2)  # decays any parameter with a gradient
    grads_none = []
    for step, (x, y, route) in enumerate(_data()):
        opt.zero_grad()
        rows = slice(4 * rank, 4 * rank + 4)
        _loss(fsdp, x[rows], y[rows], route[rows], step).backward()
        grads_none.append({n: p.grad is None for n, p in fsdp.module.named_parameters()})
        opt.step()
    return fsdp.gather_full_params(), grads_none


def test_fsdp_parameter_without_gradient_keeps_grad_none_like_one_process():
    ref = _single(lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    for full, grads_none in launch(_fsdp, 2, timeout=TIMEOUT):
        # the auxiliary head trains at step 0 only; expert 1 only at step 0 (on rank 1's samples);
        # expert 2 never: their .grad is None when no rank used them, as in one process
        assert not grads_none[0]["aux.weight"] and grads_none[1]["aux.weight"] and grads_none[2]["aux.weight"]
        assert not grads_none[0]["experts.1.weight"] and grads_none[1]["experts.1.weight"]
        assert all(g["experts.2.weight"] and g["experts.2.bias"] for g in grads_none)
        assert not any(g["trunk.weight"] or g["experts.0.weight"] for g in grads_none)
        worst = max((full[n] - ref[n]).abs().max().item() for n in ref)
        assert worst < TOL, worst


def _weighted(rank, world):
    """Unequal batches (3 and 5 samples) on two ranks that route to different experts of the same
    size: rank 0 only expert 0, rank 1 only expert 1 (at step 0)."""
    model = Routed()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    rows = slice(0, 3) if rank == 0 else slice(3, 8)
    for step, (x, y, route) in enumerate(_data()):
        route = UNEQUAL_ROUTE if step == 0 else route
        opt.zero_grad()
        _loss(model, x[rows], y[rows], route[rows], step).backward()
        weighted_average_gradients(model, rows.stop - rows.start)
        opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}


def test_weighted_average_keeps_each_parameters_gradient_apart():
    ref = _single(lambda ps: torch.optim.SGD(ps, lr=0.5), UNEQUAL_ROUTE)
    first, second = launch(_weighted, 2, timeout=TIMEOUT)
    assert all(torch.equal(first[n], second[n]) for n in first)  # the replicas stay equal
    worst = max((first[n] - ref[n]).abs().max().item() for n in ref)
    assert worst < TOL, worst
    assert torch.equal(first["experts.2.weight"], Routed().experts[2].weight)  # never used, never moved
