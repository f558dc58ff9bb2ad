"""NaiveDDP / BucketedDDP: same numbers as one process and as PyTorch DDP; buckets; overlap."""
import copy
import io
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dtlib.launcher import launch
from dtlib.models import MnistCNN, TinyGPT, tiny_gpt_config
from dtlib.parallel import BucketedDDP, NaiveDDP
from dtlib.analytic.units import MiB
from dtlib.viz.timeline import plot_overlap_timeline
from workloads import loss_fn, make_batches

TIMEOUT = 60


# ---- models and data (seeded: identical on every rank and in the reference) ----------------------
def _model(kind, seed=0):
    torch.manual_seed(seed)
    if kind == "cnn":
        return MnistCNN()
    return TinyGPT(tiny_gpt_config(layers=2, hidden=32, heads=2, vocab=64, seq=16,
                                   tied_embeddings=True))


def _batches(kind, steps, batch):
    return make_batches(kind, steps, batch, seed=123)


def _make_ddp(name, model, bucket_mb):
    return NaiveDDP(model) if name == "naive" else BucketedDDP(model, bucket_size_mb=bucket_mb)


def _train_like_single_process(rank, world_size, kind, configs, steps=3, batch=8):
    data = _batches(kind, steps, batch)
    # SGD with momentum: linear in the gradient, so float rounding differences stay at 1e-7
    # (Adam divides by sqrt(v) and turns a rounding difference in a ~0 gradient into a step)
    ref = _model(kind)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for x, y in data:  # one process, full batch
        ref_opt.zero_grad()
        loss_fn(ref, x, y).backward()
        ref_opt.step()
    out = {}
    for name, bucket_mb, accum in configs:
        # ranks other than 0 start elsewhere: construction must broadcast rank 0's weights
        model = _model(kind, seed=0 if rank == 0 else 100 + rank)
        ddp = _make_ddp(name, model, bucket_mb)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        for x, y in data:
            xs, ys = torch.tensor_split(x, world_size)[rank], torch.tensor_split(y, world_size)[rank]
            opt.zero_grad()
            micro = list(zip(torch.tensor_split(xs, accum), torch.tensor_split(ys, accum)))
            for i, (mx, my) in enumerate(micro):
                if i < accum - 1:
                    with ddp.no_sync():
                        (loss_fn(ddp, mx, my) / accum).backward()
                else:
                    (loss_fn(ddp, mx, my) / accum).backward()
            ddp.finish_gradient_synchronization()
            opt.step()
        diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
        out[(name, bucket_mb, accum)] = (diff, len(ddp.buckets))
        ddp.remove_hooks()
    return out


CONFIGS = [("naive", None, 1), ("bucketed", 25.0, 1), ("bucketed", 0.01, 1), ("bucketed", 0.001, 1),
           ("naive", None, 2), ("bucketed", 0.01, 2)]


@pytest.mark.parametrize("kind", ["cnn", "gpt"])
def test_k_steps_equal_single_process_full_batch(kind):
    results = launch(_train_like_single_process, 2, args=(kind, CONFIGS), timeout=TIMEOUT)
    for config, (diff, n_buckets) in results[0].items():
        assert diff < 2e-6, (config, diff)
        assert results[1][config][0] < 2e-6
    # the bucket sizes really produced different bucketings
    counts = {cfg: nb for cfg, (_, nb) in results[0].items() if cfg[2] == 1}
    assert counts[("bucketed", 25.0, 1)] == 1
    assert counts[("bucketed", 0.001, 1)] > counts[("bucketed", 0.01, 1)] > 1


def test_four_ranks_equal_single_process():
    results = launch(_train_like_single_process, 4,
                     args=("cnn", [("bucketed", 0.01, 1), ("bucketed", 0.01, 2)], 2, 8), timeout=TIMEOUT)
    assert all(diff < 2e-6 for r in results for diff, _ in r.values()), results


# ---- buckets ---------------------------------------------------------------------------------
class Chain(nn.Module):
    """Four bias-free 256x256 layers (256 KiB each), registered in the order given by ``order``
    but always *used* as l0 -> l1 -> l2 -> l3."""

    def __init__(self, order=(0, 1, 2, 3)):
        super().__init__()
        torch.manual_seed(0)
        for i in order:
            self.add_module(f"l{i}", nn.Linear(256, 256, bias=False))

    def forward(self, x):
        for i in range(4):
            x = torch.tanh(getattr(self, f"l{i}")(x))
        return x


def _bucket_layouts(rank, world_size, caps_mb):
    out = {}
    for cap in caps_mb:
        ddp = BucketedDDP(Chain(), bucket_size_mb=cap)
        params = list(reversed(list(ddp.module.parameters())))  # order of readiness
        torch_buckets = dist._compute_bucket_assignment_by_size(params, [int(cap * MiB)])[0]
        out[cap] = ([b["params"] for b in ddp.bucket_summary()],
                    [[f"l{3 - i}.weight" for i in b] for b in torch_buckets])
        ddp.remove_hooks()
    return out


def test_number_of_buckets_for_a_given_size():
    # 4 x 256 KiB gradients; a bucket closes once it holds >= the cap (PyTorch's rule)
    caps = [0.25, 0.5, 0.6, 1.0, 25.0]
    layouts = launch(_bucket_layouts, 2, args=(caps,), timeout=TIMEOUT)[0]
    expected = {0.25: [["l3.weight"], ["l2.weight"], ["l1.weight"], ["l0.weight"]],
                0.5: [["l3.weight", "l2.weight"], ["l1.weight", "l0.weight"]],
                0.6: [["l3.weight", "l2.weight", "l1.weight"], ["l0.weight"]],
                1.0: [["l3.weight", "l2.weight", "l1.weight", "l0.weight"]],
                25.0: [["l3.weight", "l2.weight", "l1.weight", "l0.weight"]]}
    for cap in caps:
        ours, torchs = layouts[cap]
        assert ours == expected[cap], cap
        assert ours == torchs, cap  # same assignment as torch.distributed's own function


def _rebuild(rank, world_size):
    ddp = BucketedDDP(Chain(order=(3, 2, 1, 0)), bucket_size_mb=0.25)  # registered backwards
    before = [b["params"] for b in ddp.bucket_summary()]
    ddp(torch.randn(4, 256)).sum().backward()
    ddp.finish_gradient_synchronization()
    after = [b["params"] for b in ddp.bucket_summary()]
    return before, after


def test_buckets_are_rebuilt_in_reverse_order_of_use():
    before, after = launch(_rebuild, 2, timeout=TIMEOUT)[0]
    # first guess: reverse of registration (l3 registered first -> bucketed last)
    assert before == [["l0.weight"], ["l1.weight"], ["l2.weight"], ["l3.weight"]]
    # after one iteration: the order gradients really became ready (l3 was used last)
    assert after == [["l3.weight"], ["l2.weight"], ["l1.weight"], ["l0.weight"]]


# ---- overlap --------------------------------------------------------------------------------
def _overlap(rank, world_size, name):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.Tanh()) for _ in range(6)])
    ddp = _make_ddp(name, model, 0.5)  # ~1 MiB per layer: one bucket per layer
    calls = []  # independent of our record: when the backend's all_reduce was really called
    real = dist.all_reduce

    def spy(tensor, *args, **kwargs):
        calls.append(time.perf_counter())
        return real(tensor, *args, **kwargs)

    last_grad = []  # the first layer's weight gets its gradient last in backward
    model[0][0].weight.register_post_accumulate_grad_hook(lambda p: last_grad.append(time.perf_counter()))
    x = torch.randn(256, 512)
    for _ in range(2):  # the second iteration runs on the rebuilt buckets
        calls.clear()
        last_grad.clear()
        dist.all_reduce = spy
        try:
            ddp(x).square().mean().backward()
        finally:
            dist.all_reduce = real
        ddp.finish_gradient_synchronization()
    rec = ddp.last_record
    return {"n_buckets": len(ddp.buckets), "calls_before_end": sum(t < last_grad[0] for t in calls),
            "n_calls": len(calls), "issued_before_backward_end": rec.overlapped_buckets,
            "ready_before_issue": all(r <= i for r, i in zip(rec.bucket_ready, rec.bucket_issued)),
            "record": rec}


@pytest.mark.parametrize("name", ["naive", "bucketed"])
def test_communication_starts_before_backward_ends(name):
    out = launch(_overlap, 2, args=(name,), timeout=TIMEOUT)[0]
    nb = out["n_buckets"]
    assert nb == (12 if name == "naive" else 6)
    assert out["n_calls"] == nb
    # every bucket except the one holding the first layer was sent while backward still ran
    assert out["calls_before_end"] >= nb - 2
    assert out["issued_before_backward_end"] >= nb - 2
    assert out["ready_before_issue"]
    (ax,) = plot_overlap_timeline({name: out["record"]}).axes  # the run's timeline, drawn
    assert ax.get_title().endswith(f"{out['record'].overlapped_buckets}/{nb} buckets issued before backward ended")
    assert [t.get_text() for t in ax.get_yticklabels()][:nb] == [f"bucket {b}" for b in reversed(range(nb))]


# ---- what is averaged --------------------------------------------------------------------------
def _what_is_averaged(rank, world_size):
    model = nn.Linear(6, 3)
    torch.manual_seed(100 + rank)  # each rank starts from different weights ...
    nn.init.normal_(model.weight)
    ddp = BucketedDDP(model)
    w0 = model.weight.detach().clone()  # ... until construction broadcasts rank 0's
    everyone = [torch.empty_like(w0) for _ in range(world_size)]
    dist.all_gather(everyone, w0)
    xs = [torch.randn(4, 6, generator=torch.Generator().manual_seed(r)) for r in range(world_size)]
    ddp(xs[rank]).pow(2).sum().backward()
    ddp.finish_gradient_synchronization()
    # the expected gradient, computed here: the mean of each rank's local gradient
    local = []
    for x in xs:
        w = w0.clone().requires_grad_(True)
        F.linear(x, w, model.bias.detach()).pow(2).sum().backward()
        local.append(w.grad)
    return {"same_start": all(torch.equal(e, everyone[0]) for e in everyone),
            "grad_is_mean": torch.allclose(model.weight.grad, torch.stack(local).mean(0), atol=1e-6),
            "grad_differs_from_local": not torch.allclose(model.weight.grad, local[rank]),
            "weights_untouched": torch.equal(model.weight.detach(), w0)}


def test_gradients_not_weights_are_averaged():
    for out in launch(_what_is_averaged, 2, timeout=TIMEOUT):
        assert out == {"same_start": True, "grad_is_mean": True, "grad_differs_from_local": True,
                       "weights_untouched": True}


def _no_sync_is_silent(rank, world_size):
    ddp = BucketedDDP(Chain(), bucket_size_mb=0.25)
    calls = []
    real = dist.all_reduce
    dist.all_reduce = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
    try:
        with ddp.no_sync():
            ddp(torch.randn(2, 256)).sum().backward()
        inside = len(calls)
        ddp(torch.randn(2, 256)).sum().backward()
        ddp.finish_gradient_synchronization()
    finally:
        dist.all_reduce = real
    return inside, len(calls) - inside


def test_no_sync_communicates_only_on_the_last_micro_batch():
    assert launch(_no_sync_is_silent, 2, timeout=TIMEOUT) == [(0, 4), (0, 4)]


# ---- frozen, unused, used-on-some-ranks, tied ----------------------------------------------------
class Odd(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(10, 8)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.extra = nn.Linear(8, 8)      # used only when asked (on some ranks only)
        self.never = nn.Linear(8, 8)      # never used
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, idx, use_extra):
        h = torch.relu(self.frozen(self.emb(idx)))
        if use_extra:
            h = h + self.extra(h)
        return self.head(h)


def _odd(rank, world_size, find_unused):
    g = torch.Generator().manual_seed(7)
    idx = torch.randint(0, 10, (world_size, 5), generator=g)
    use = [r == 0 for r in range(world_size)]  # only rank 0 uses `extra`
    ref = Odd()
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=0.1)
    model = Odd()
    ddp = BucketedDDP(model, bucket_size_mb=1e-4, find_unused_parameters=find_unused)
    opt = torch.optim.AdamW(ddp.parameters(), lr=0.1)
    frozen0 = model.frozen.weight.detach().clone()
    for _ in range(2):
        opt_ref.zero_grad()
        losses = [F.cross_entropy(ref(idx[r], use[r]), idx[r]) for r in range(world_size)]
        (sum(losses) / world_size).backward()
        opt.zero_grad()
        F.cross_entropy(ddp(idx[rank], use[rank]), idx[rank]).backward()
        try:
            ddp.finish_gradient_synchronization()
        except RuntimeError as e:
            return str(e)
        grads_ok = all(p.grad is None and q.grad is None
                       or p.grad is not None and q.grad is not None
                       and torch.allclose(p.grad, q.grad, atol=1e-6)
                       for p, q in zip(model.parameters(), ref.parameters()))
        opt_ref.step()
        opt.step()
    return {"grads_match": grads_ok,
            "never_grad_none": model.never.weight.grad is None,
            "extra_has_grad": model.extra.weight.grad is not None,
            "frozen_unchanged": torch.equal(model.frozen.weight, frozen0),
            "params_match": all(torch.allclose(p, q, atol=1e-6)
                                for p, q in zip(model.parameters(), ref.parameters())),
            "order": [n for n, _ in ddp.named_parameters()]
                     == ["module." + n for n, _ in model.named_parameters()]}


def test_frozen_unused_partly_used_and_tied_parameters():
    for out in launch(_odd, 2, args=(True,), timeout=TIMEOUT):
        assert all(out.values()), out
    messages = launch(_odd, 2, args=(False,), timeout=TIMEOUT)
    assert all("find_unused_parameters=True" in m and "never.weight" in m for m in messages)


# ---- side by side with torch.nn.parallel.DistributedDataParallel -----------------------------
def _side_by_side(rank, world_size, steps=4):
    data = _batches("cnn", steps, 12)
    ours, theirs = _model("cnn"), _model("cnn")
    ddp = BucketedDDP(ours, bucket_size_mb=0.05)
    tddp = nn.parallel.DistributedDataParallel(theirs, bucket_cap_mb=0.05)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ddp, tddp)]
    grad_diffs = []
    for x, y in data:
        xs, ys = torch.tensor_split(x, world_size)[rank], torch.tensor_split(y, world_size)[rank]
        for opt in opts:
            opt.zero_grad()
        loss_fn(ddp, xs, ys).backward()
        ddp.finish_gradient_synchronization()
        loss_fn(tddp, xs, ys).backward()
        grad_diffs.append(max((a.grad - b.grad).abs().max().item()
                              for a, b in zip(ours.parameters(), theirs.parameters())))
        for opt in opts:
            opt.step()
    param_diff = max((a - b).abs().max().item() for a, b in zip(ours.parameters(), theirs.parameters()))
    return grad_diffs, param_diff


@pytest.mark.parametrize("world_size", [2, 3])
def test_same_gradients_as_torch_ddp_in_the_same_run(world_size):
    for grad_diffs, param_diff in launch(_side_by_side, world_size, timeout=TIMEOUT):
        assert max(grad_diffs) < 1e-6 and param_diff < 1e-6, (grad_diffs, param_diff)


def _state_at_construction(rank, world_size, name):
    torch.manual_seed(rank)  # different weights on every rank ...
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6))
    bn = model[1]
    with torch.no_grad():  # ... and different BatchNorm statistics (buffers)
        bn.running_mean.fill_(rank + 1.0)
        bn.running_var.fill_(10.0 * (rank + 1))
        bn.num_batches_tracked.fill_(rank + 7)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    # broadcast_buffers=False: only the construction can have synchronised them (no forward here)
    (NaiveDDP if name == "naive" else BucketedDDP)(model, broadcast_buffers=False)
    return before, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("name", ["naive", "bucketed"])
def test_construction_broadcasts_parameters_and_buffers_from_rank_0(name):
    results = launch(_state_at_construction, 3, args=(name,), timeout=TIMEOUT)
    rank0_before = results[0][0]
    assert {"1.running_mean", "1.running_var", "1.num_batches_tracked"} <= set(rank0_before)
    for rank, (before, after) in enumerate(results):
        if rank:  # the inputs really differed
            assert not torch.equal(before["1.running_mean"], rank0_before["1.running_mean"])
            assert not torch.equal(before["0.weight"], rank0_before["0.weight"])
        assert all(torch.equal(after[k], rank0_before[k]) for k in rank0_before), rank


# ---- copies and pickling ---------------------------------------------------------------------------
def _copies_and_pickles(rank, world_size):
    data = _batches("cnn", 3, 8)
    model = _model("cnn")
    ddp = BucketedDDP(model, bucket_size_mb=0.05)

    def step(wrapper, x, y):
        wrapper.module.zero_grad()
        loss_fn(wrapper, x, y).backward()
        wrapper.finish_gradient_synchronization()
        return [p.grad.clone() for p in wrapper.module.parameters()]

    x, y = (t.tensor_split(world_size)[rank] for t in data[0])
    step(ddp, x, y)  # buckets now rebuilt
    ema = copy.deepcopy(model)  # e.g. an EMA or reference copy of the wrapped model
    ema_ddp = BucketedDDP(ema, bucket_size_mb=0.05)  # a copy is a new module: it can be wrapped
    saved_model, saved_ddp = io.BytesIO(), io.BytesIO()
    torch.save(model, saved_model)
    torch.save(ddp, saved_ddp)
    saved_model.seek(0)
    saved_ddp.seek(0)
    loaded_model = torch.load(saved_model, weights_only=False)
    loaded_ddp = torch.load(saved_ddp, weights_only=False)  # hooks re-registered on unpickling
    same_state = all(torch.equal(a, b) for a, b in zip(loaded_model.state_dict().values(),
                                                       model.state_dict().values()))
    x, y = (t.tensor_split(world_size)[rank] for t in data[1])
    grads = {name: step(w, x, y) for name, w in [("ddp", ddp), ("ema", ema_ddp), ("loaded", loaded_ddp)]}
    loss_fn(loaded_model, x, y).backward()  # the saved plain model: this rank's local gradient
    local = [p.grad for p in loaded_model.parameters()]
    equal = lambda a, b: all(torch.equal(p, q) for p, q in zip(a, b))  # noqa: E731
    return {"same_state": same_state, "ema_equal": equal(grads["ema"], grads["ddp"]),
            "loaded_equal": equal(grads["loaded"], grads["ddp"]),
            "averaged": not equal(grads["ddp"], local),  # the ranks' data differ: not the local grad
            "buckets": loaded_ddp.bucket_summary() == ddp.bucket_summary(),
            "no_attribute": not any(k.startswith("_dtlib") for k in vars(model))}


def test_wrapped_model_can_be_copied_wrapped_again_and_saved():
    for out in launch(_copies_and_pickles, 2, timeout=TIMEOUT):
        assert all(out.values()), out


# ---- misuse ---------------------------------------------------------------------------------------
def _misuse(rank, world_size):
    errors = {}
    for cap in (0, -1.0, "25", True, float("nan"), float("inf")):  # inf was a raw OverflowError
        try:
            BucketedDDP(nn.Linear(2, 2), bucket_size_mb=cap)
        except ValueError as e:
            errors[repr(cap)] = str(e)
    try:
        BucketedDDP("not a module")
    except TypeError as e:
        errors["module"] = str(e)
    frozen = nn.Linear(2, 2).requires_grad_(False)
    try:
        BucketedDDP(frozen)
    except ValueError as e:
        errors["frozen"] = str(e)
    model = nn.Linear(2, 2)
    ddp = BucketedDDP(model)
    try:
        BucketedDDP(model)
    except ValueError as e:
        errors["twice"] = str(e)
    ddp(torch.ones(1, 2)).sum().backward()  # ... and no finish_gradient_synchronization()
    try:
        ddp(torch.ones(1, 2))
    except RuntimeError as e:
        errors["forgot finish"] = str(e)
    return errors


def test_bad_input_gives_clear_errors():
    errors = launch(_misuse, 2, timeout=TIMEOUT)[0]
    for cap in ("0", "-1.0", "'25'", "True", "nan", "inf"):
        assert "bucket_size_mb must be a finite number > 0" in errors[cap], cap
    assert "torch.nn.Module" in errors["module"]
    assert "no parameter that requires a gradient" in errors["frozen"]
    assert "already wrapped" in errors["twice"]
    assert "finish_gradient_synchronization()" in errors["forgot finish"]
