"""Communication hooks: fp16/bf16, top-k with error feedback, PowerSGD (vs PyTorch's powerSGD_hook)."""
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

from dtlib.launcher import launch
from dtlib.models import MnistCNN
from dtlib.parallel import (BucketedDDP, GradBucket, PowerSGDState, TopKState, allreduce_hook,
                            bf16_compress_hook, fp16_compress_hook, powersgd_hook, powersgd_plan,
                            topk_hook)
from dtlib.viz.comm import plot_compression_tradeoff

TIMEOUT = 60


def _bucket(shapes, rank, step=0):
    """A bucket over fresh parameters, its buffer filled with this rank's 'gradient'."""
    params = [nn.Parameter(torch.zeros(s)) for s in shapes]
    bucket = GradBucket(0, params, [f"p{i}" for i in range(len(shapes))], is_last=True)
    return _refill(bucket, rank, step)


def _refill(bucket, rank, step):
    """This rank's 'gradient' of ``step`` in the bucket (hooks overwrite it with the average)."""
    bucket.reset()  # its log lists this step's collectives only
    g = torch.Generator().manual_seed(10 * rank + step)
    bucket.buffer().copy_(torch.randn(bucket.buffer().numel(), generator=g))
    return bucket


def _residual(state, bucket):
    """The bucket's error-feedback memory, gathered from the per-parameter residuals."""
    return torch.cat([state.errors[p] for p in bucket.parameters()])


def _mean_over_ranks(t):
    everyone = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, t)
    return torch.stack(everyone).mean(0)


def _casts(rank, world_size):
    out = {}
    for name, hook, tol in [("fp16", fp16_compress_hook, 2e-3), ("bf16", bf16_compress_hook, 2e-2),
                            ("none", allreduce_hook, 1e-6)]:
        bucket = _bucket([(16, 8), (8,)], rank)
        expected = _mean_over_ranks(bucket.buffer().clone())
        got = hook(None, bucket).wait()
        out[name] = (torch.allclose(got, expected, atol=tol, rtol=tol), bucket.comm)
    return out


def test_fp16_and_bf16_halve_the_bytes_and_keep_the_average():
    numel = 16 * 8 + 8
    for res in launch(_casts, 2, timeout=TIMEOUT):
        for name, (ok, comm) in res.items():
            assert ok, name
            elem = 4 if name == "none" else 2
            assert comm == [("all_reduce", numel, elem)], name


def _topk(rank, world_size, ratio):
    state = TopKState(ratio=ratio)
    shapes = [(32, 16), (16,)]
    old_err = torch.zeros(32 * 16 + 16)
    checks = []
    bucket = _bucket(shapes, rank)  # the same parameters every step: residuals are per parameter
    for step in range(3):
        _refill(bucket, rank, step)
        wanted = bucket.buffer().clone() + old_err  # gradient + what was held back last time
        got = topk_hook(state, bucket).wait()
        new_err = _residual(state, bucket)
        # error feedback loses nothing: average sent + average kept = average wanted
        checks.append(torch.allclose(got + _mean_over_ranks(new_err), _mean_over_ranks(wanted), atol=1e-5))
        checks.append(int((new_err != 0).sum()) == wanted.numel() - math.ceil(ratio * wanted.numel()))
        old_err = new_err.clone()
    return checks, bucket.comm


def test_topk_error_feedback_conserves_the_gradient():
    numel = 32 * 16 + 16
    for checks, comm in launch(_topk, 2, args=(0.1,), timeout=TIMEOUT):
        assert all(checks), checks
        k = math.ceil(0.1 * numel)
        assert comm == [("all_gather", k, 4), ("all_gather", k, 4)]  # fp32 values + int32 indices


def _topk_full(rank, world_size):
    bucket = _bucket([(8, 4)], rank)
    expected = _mean_over_ranks(bucket.buffer().clone())
    return torch.allclose(topk_hook(TopKState(ratio=1.0), bucket).wait(), expected, atol=1e-6)


def test_topk_with_ratio_one_is_exact():
    assert launch(_topk_full, 3, timeout=TIMEOUT) == [True] * 3


def _powersgd_exact_and_conserving(rank, world_size):
    out = {}
    # rank >= min(n, m): the low-rank approximation is exact (min_compression_rate=0 forces it)
    bucket = _bucket([(6, 4), (5,)], rank)
    expected = _mean_over_ranks(bucket.buffer().clone())
    state = PowerSGDState(rank=4, start_iter=0, min_compression_rate=0, error_feedback=False,
                          warm_start=False)
    out["full rank exact"] = torch.allclose(powersgd_hook(state, bucket).wait(), expected, atol=1e-5)
    # rank 1 with error feedback: average sent + average kept = average wanted, every step
    # (steps 0 and 1 are plain all-reduces: start_iter must be > 1, as in PyTorch)
    state = PowerSGDState(rank=1, start_iter=2)
    old_err = torch.zeros(20 * 10 + 10)
    conserved = []
    bucket = _bucket([(20, 10), (10,)], rank)
    for step in range(5):
        _refill(bucket, rank, step)
        wanted = bucket.buffer().clone() + old_err
        got = powersgd_hook(state, bucket).wait()
        err = _residual(state, bucket) if step >= 2 else torch.zeros_like(old_err)
        conserved.append(torch.allclose(got + _mean_over_ranks(err), _mean_over_ranks(wanted), atol=1e-5))
        old_err = err.clone()
    out["conserved"] = all(conserved) and old_err.abs().sum() > 0
    out["comm"] = bucket.comm
    return out


def test_powersgd_is_exact_at_full_rank_and_error_feedback_conserves():
    for out in launch(_powersgd_exact_and_conserving, 2, timeout=TIMEOUT):
        assert out["full rank exact"] and out["conserved"]
        # the 20x10 matrix goes as P (20x1) and Q (10x1); the 10-vector uncompressed
        assert sorted(out["comm"]) == sorted([("all_reduce", 10, 4), ("all_reduce", 20, 4),
                                              ("all_reduce", 10, 4)])


class Backwards(nn.Module):
    """Four 16x16 layers registered l3, l2, l1, l0 but used l0 -> l3: with one bucket per layer,
    bucket 0 holds l0 at first and l3 once BucketedDDP has rebuilt the buckets in arrival order."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        for i in (3, 2, 1, 0):
            self.add_module(f"l{i}", nn.Linear(16, 16, bias=False))

    def forward(self, x):
        for i in range(4):
            x = torch.tanh(getattr(self, f"l{i}")(x))
        return x


def _error_feedback_after_rebuild(rank, world_size):
    """Per parameter, with the buckets rebuilt after step 0: top-k must eventually send each
    parameter exactly the sum of its own gradients; PowerSGD must conserve every step."""
    g = torch.Generator().manual_seed(rank)
    xs = [torch.randn(4, 16, generator=g) for _ in range(8)]
    out = {}
    for name, state, hook in [("topk", TopKState(ratio=0.25), topk_hook),
                              ("powersgd", PowerSGDState(rank=1, start_iter=2), powersgd_hook)]:
        model, twin = Backwards(), Backwards()  # twin: the local gradients, uncompressed
        ddp = BucketedDDP(model, bucket_size_mb=1e-4)  # one bucket per layer
        ddp.register_comm_hook(state, hook)
        sent = [torch.zeros_like(p) for p in model.parameters()]
        true = [torch.zeros_like(p) for p in model.parameters()]
        old_err = {p: torch.zeros(p.numel()) for p in model.parameters()}
        step_gaps = []
        for step, x in enumerate(xs):
            # top-k: 3 real steps, then zero gradients until every residual has been sent
            scale = 0.0 if name == "topk" and step >= 3 else 1.0
            model.zero_grad()
            twin.zero_grad()
            (ddp(x).square().sum() * scale).backward()
            ddp.finish_gradient_synchronization()
            (twin(x).square().sum() * scale).backward()
            for s, t, p, q in zip(sent, true, model.parameters(), twin.parameters()):
                s += p.grad
                t += q.grad
                err = state.errors.get(p, torch.zeros(p.numel()))
                # sent + (mean) residual - (mean) (gradient + last residual), for this parameter
                gap = p.grad.reshape(-1) + _mean_over_ranks(err) - _mean_over_ranks(
                    q.grad.reshape(-1) + old_err[p])
                step_gaps.append(gap.abs().max().item())
                old_err[p] = err.clone()
        out[name] = {"step": max(step_gaps), "rebuilt": ddp.bucket_summary()[0]["params"] == ["l3.weight"],
                     "total": max((s - _mean_over_ranks(t)).abs().max().item() for s, t in zip(sent, true)),
                     "residual_left": max(e.abs().max().item() for e in state.errors.values())}
    return out


def test_error_feedback_follows_parameters_when_buckets_are_rebuilt():
    for out in launch(_error_feedback_after_rebuild, 2, timeout=TIMEOUT):
        for name in ("topk", "powersgd"):
            assert out[name]["rebuilt"], out  # bucket 0 changed from l0 to l3 after step 0
            assert out[name]["step"] < 1e-5, out  # per parameter: sent + residual = gradient + last residual
        # top-k flushed everything it held back, each parameter got the sum of its own gradients
        assert out["topk"]["residual_left"] == 0.0 and out["topk"]["total"] < 1e-5, out
        assert out["powersgd"]["residual_left"] > 0  # PowerSGD really held something back


def test_powersgd_plan_compresses_only_what_pays():
    # n x m sent as (n + m) r numbers, only if that is < n m / 2
    assert powersgd_plan([(20, 10), (10,), (4, 4), (8, 1, 3, 3), (64, 784), ()], rank=2) == \
        [2, None, None, 2, 2, None]  # 4x4: 16 < 2*(4+4)*2; conv 8x9: 72 > 68
    assert powersgd_plan([(4, 4)], rank=8, min_compression_rate=0) == [4]  # capped at min(n, m)


def _warm_start(rank, world_size, warm):
    # the same gradient every step: warm-started power iteration converges to the best rank-1
    g = torch.Generator().manual_seed(rank)
    u, v = torch.randn(40, 3, generator=g), torch.randn(3, 30, generator=g)
    matrix = u @ torch.diag(torch.tensor([5.0, 2.0, 1.0])) @ v
    target = _mean_over_ranks(matrix.reshape(-1)).view(40, 30)
    s = torch.linalg.svdvals(target)
    best = s[1:].square().sum().sqrt().item()  # Eckart-Young: error of the best rank-1
    state = PowerSGDState(rank=1, start_iter=2, error_feedback=False, warm_start=warm)
    bucket = GradBucket(0, [nn.Parameter(torch.zeros(40, 30))], ["w"], is_last=True)
    errors = []
    for step in range(10):
        bucket.buffer().copy_(matrix.reshape(-1))
        got = powersgd_hook(state, bucket).wait().view(40, 30)
        if step >= 2:  # compressed from start_iter on
            errors.append((got - target).norm().item())
    return errors, best


def test_warm_start_converges_to_the_best_low_rank_approximation():
    warm, best = launch(_warm_start, 2, args=(True,), timeout=TIMEOUT)[0]
    cold, _ = launch(_warm_start, 2, args=(False,), timeout=TIMEOUT)[0]
    assert warm[-1] <= 1.01 * best  # warm start: power iteration across steps
    assert warm[-1] < warm[0]
    assert min(cold) > 1.01 * best  # a fresh random Q every step never gets there


def _vs_torch(rank, world_size, error_feedback, warm_start, steps=6):
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(16, 1, 28, 28, generator=g), torch.randint(0, 10, (16,), generator=g))
            for _ in range(steps)]
    torch.manual_seed(0)
    ours_model = MnistCNN()
    torch.manual_seed(0)
    torch_model = MnistCNN()
    ours = BucketedDDP(ours_model)
    ours.register_comm_hook(PowerSGDState(rank=2, start_iter=2, error_feedback=error_feedback,
                                          warm_start=warm_start), powersgd_hook)
    theirs = nn.parallel.DistributedDataParallel(torch_model)
    theirs.register_comm_hook(torch_powersgd.PowerSGDState(
        process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=2,
        use_error_feedback=error_feedback, warm_start=warm_start), torch_powersgd.powerSGD_hook)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (ours, theirs)]
    diffs = []
    for x, y in data:
        x, y = torch.tensor_split(x, world_size)[rank], torch.tensor_split(y, world_size)[rank]
        for opt in opts:
            opt.zero_grad()
        F.cross_entropy(ours(x), y).backward()
        ours.finish_gradient_synchronization()
        F.cross_entropy(theirs(x), y).backward()
        diffs.append(max((a.grad - b.grad).abs().max().item()
                         for a, b in zip(ours_model.parameters(), torch_model.parameters())))
        for opt in opts:
            opt.step()
    return diffs


@pytest.mark.parametrize("error_feedback,warm_start", [(True, True), (False, False)])
def test_powersgd_matches_pytorchs_powersgd_hook(error_feedback, warm_start):
    # same random Q (numpy RandomState seeds), same layout: the same gradients step after step
    for diffs in launch(_vs_torch, 2, args=(error_feedback, warm_start), timeout=TIMEOUT):
        assert max(diffs) < 1e-5, diffs


def _train(rank, world_size, which, steps=25):
    g = torch.Generator().manual_seed(0)
    centers = torch.randn(10, 1, 28, 28, generator=g)
    labels = torch.randint(0, 10, (steps, 32), generator=g)
    torch.manual_seed(0)
    model = MnistCNN()
    ddp = BucketedDDP(model)
    hooks = {"fp16": (None, fp16_compress_hook), "topk": (TopKState(ratio=0.05), topk_hook),
             "powersgd": (PowerSGDState(rank=2, start_iter=2), powersgd_hook)}
    if which in hooks:
        ddp.register_comm_hook(*hooks[which])
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for y in labels:
        x = centers[y] + 0.5 * torch.randn(32, 1, 28, 28, generator=g)
        x, y = torch.tensor_split(x, world_size)[rank], torch.tensor_split(y, world_size)[rank]
        opt.zero_grad()
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        ddp.finish_gradient_synchronization()
        opt.step()
        losses.append(loss.item())
    y_test = torch.randint(0, 10, (200,), generator=g)
    with torch.no_grad():
        pred = model(centers[y_test] + 0.5 * torch.randn(200, 1, 28, 28, generator=g)).argmax(1)
    return losses, ddp.last_record.wire_bytes, (pred == y_test).float().mean().item()


def test_compressed_training_still_learns_with_fewer_bytes():
    _, base_bytes, base_accuracy = launch(_train, 2, args=("none",), timeout=TIMEOUT)[0]
    assert base_accuracy > 0.9
    rows = []
    for which in ("fp16", "topk", "powersgd"):
        losses, wire, accuracy = launch(_train, 2, args=(which,), timeout=TIMEOUT)[0]
        assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5, which
        assert accuracy > 0.8, which
        assert wire < base_bytes, which
        rows.append({"method": which, "bytes_per_step": wire, "accuracy": accuracy})
    fig = plot_compression_tradeoff(rows)
    (ax,) = fig.axes  # one point per method at (bytes per step, accuracy in %)
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["fp16", "topk", "powersgd"]
    points = [xy for c in ax.containers for xy in (c.lines[0].get_xdata()[0], c.lines[0].get_ydata()[0])]
    assert points == pytest.approx([xy for r in rows for xy in (r["bytes_per_step"], 100 * r["accuracy"])])


def test_bad_hook_settings():
    with pytest.raises(ValueError, match="ratio must be a finite number > 0 and <= 1, got 0"):
        TopKState(ratio=0)
    with pytest.raises(ValueError, match="error_feedback must be True or False, got 'no'"):
        TopKState(error_feedback="no")
    with pytest.raises(ValueError, match="rank must be an integer >= 1, got 0"):
        PowerSGDState(rank=0)
    with pytest.raises(ValueError, match="rank must be an integer >= 1, got 0"):
        powersgd_plan([(4, 4)], rank=0)
    with pytest.raises(ValueError, match="seed must be an integer from 0 to 4294967295, got -1"):
        PowerSGDState(seed=-1)
    with pytest.raises(ValueError, match="min_compression_rate must be a finite number >= 0, got nan"):
        PowerSGDState(min_compression_rate=float("nan"))
    # PyTorch's rule: error feedback / warm start only from the third iteration on
    for kwargs in ({"start_iter": 1}, {"start_iter": 0, "error_feedback": False},
                   {"start_iter": 1, "warm_start": False}):
        with pytest.raises(ValueError, match=r"start_iter must be > 1 with error_feedback or warm_start"):
            PowerSGDState(**kwargs)
    assert PowerSGDState(start_iter=0, error_feedback=False, warm_start=False).start_iter == 0
    assert PowerSGDState(start_iter=2).start_iter == 2

    def late(rank, world_size):
        ddp = BucketedDDP(nn.Linear(2, 2))
        ddp(torch.ones(1, 2)).sum().backward()
        ddp.finish_gradient_synchronization()
        try:
            ddp.register_comm_hook(None, fp16_compress_hook)
        except RuntimeError as e:
            return str(e)

    assert "before the first forward" in launch(late, 2, timeout=TIMEOUT)[0]


def test_compression_method_names_used_by_the_lesson_widget():
    from dtlib.experiments.communication import COMPRESSION_METHODS, compression_method, compression_runs

    assert compression_method("fp16 cast") is COMPRESSION_METHODS["fp16 cast"]
    make_state, hook = compression_method("PowerSGD rank 8")
    assert hook is powersgd_hook and make_state().rank == 8 and make_state().start_iter == 10
    make_state, hook = compression_method("top-k 0.5% + error feedback")
    assert hook is topk_hook and make_state().ratio == pytest.approx(0.005)
    with pytest.raises(ValueError, match="rank must be >= 1"):
        compression_method("PowerSGD rank 0")
    with pytest.raises(ValueError, match=r"top-k share must be in \(0, 100\]"):
        compression_method("top-k 150% + error feedback")
    with pytest.raises(ValueError, match="unknown method 'PowerSGD'"):
        compression_method("PowerSGD")
    with pytest.raises(ValueError, match=r"unknown methods \['PowerSGD'\]"):
        compression_runs(["fp16 cast", "PowerSGD"])  # refused before any rank starts
    with pytest.raises(ValueError, match="rank must be >= 1"):
        compression_runs(["PowerSGD rank 0"])
