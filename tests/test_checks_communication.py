"""Lesson 2's graded checks accept correct answers (dtlib's own and the hand-written solution) and
reject the classic mistakes with a message that names the cause; its experiments and plots work."""
import pytest
import torch
import torch.distributed as dist
from matplotlib.figure import Figure

from dtlib.grading.checks import communication as checks
from dtlib.grading.ddp_witness import witness_ddp
from dtlib.grading.ring_witness import witness_ring
from dtlib.analytic.comm import collective_time
from dtlib.analytic.hardware import Link
from dtlib.parallel import assign_buckets, ring_all_reduce
from dtlib.analytic.units import MiB
from dtlib.viz import charts, comm as viz, ring as viz_ring
from dtlib.viz.timeline import plot_overlap_timeline
from dtlib.experiments import communication as experiments



# ---- q1: ring all-reduce, as a learner writes it -------------------------------------------------
def ring(tensor, split=None, all_gather=True):
    """The solution; ``split`` replaces the chunking, ``all_gather=False`` drops phase 2."""
    n, r = dist.get_world_size(), dist.get_rank()
    flat = tensor.view(-1)
    chunks = flat.tensor_split(n) if split is None else split(flat, n)
    right, left = (r + 1) % n, (r - 1) % n
    for s in range(n - 1):
        mine = chunks[(r - s - 2) % n]
        incoming = torch.empty_like(mine)
        for req in [dist.isend(chunks[(r - s - 1) % n], right), dist.irecv(incoming, left)]:
            req.wait()
        mine += incoming
    for s in range(n - 1 if all_gather else 0):
        for req in [dist.isend(chunks[(r - s) % n], right), dist.irecv(chunks[(r - s - 1) % n], left)]:
            req.wait()
    return tensor


def drops_remainder(tensor):  # chunks of numel // n: the last numel % n elements never move
    return ring(tensor, split=lambda flat, n: [flat[i * (flat.numel() // n):(i + 1) * (flat.numel() // n)]
                                               for i in range(n)])


def reduce_scatter_only(tensor):
    return ring(tensor, all_gather=False)


def builtin(tensor):
    dist.all_reduce(tensor)


def to_everyone(tensor):  # correct sums, but (n-1) x S bytes from every rank
    n, r = dist.get_world_size(), dist.get_rank()
    bufs = {p: torch.empty_like(tensor) for p in range(n) if p != r}
    reqs = [q for p, b in bufs.items() for q in (dist.isend(tensor, p), dist.irecv(b, p))]
    for q in reqs:
        q.wait()
    for b in bufs.values():
        tensor += b


def blocking_sends(tensor):  # every rank blocks in send: deadlock
    n, r = dist.get_world_size(), dist.get_rank()
    buf = torch.empty_like(tensor)
    dist.send(tensor, (r + 1) % n)
    dist.recv(buf, (r - 1) % n)


def reshapes(tensor):
    tensor.view(dist.get_world_size(), -1)
    return tensor


def test_ring_check_accepts_dtlib_and_the_solution():
    checks.check_ring_all_reduce(ring_all_reduce)
    checks.check_ring_all_reduce(ring)


@pytest.mark.parametrize("fn,message", [
    (drops_remainder, "correct when the size divides by the world size"),
    (reduce_scatter_only, "reduce-scatter phase alone"),
    (builtin, "point-to-point messages only"),
    (to_everyone, "a ring sends each rank's neighbour"),
    (reshapes, "raised on rank .*tensor_split"),
    (lambda t: None, "unchanged: nothing was summed"),
    (lambda t: t.sum(), "in its original shape"),
])
def test_ring_check_rejects_classic_mistakes(fn, message):
    with pytest.raises(AssertionError, match=message):
        checks.check_ring_all_reduce(fn)


def ring_one_chunk_later(tensor):
    """The same ring, each step one chunk later than the lesson's schedule (also correct)."""
    n, r = dist.get_world_size(), dist.get_rank()
    chunks = tensor.view(-1).tensor_split(n)
    right, left = (r + 1) % n, (r - 1) % n
    for s in range(n - 1):
        incoming = torch.empty_like(chunks[(r - s - 1) % n])
        for req in [dist.isend(chunks[(r - s) % n], right), dist.irecv(incoming, left)]:
            req.wait()
        chunks[(r - s - 1) % n].add_(incoming)
    for s in range(n - 1):
        for req in [dist.isend(chunks[(r - s + 1) % n], right), dist.irecv(chunks[(r - s) % n], left)]:
            req.wait()
    return tensor


def test_the_checks_own_rank_in_the_ring_takes_any_offset_of_the_schedule():
    for n in (2, 3):
        assert witness_ring(ring_one_chunk_later, n, checks._rank_input) is None
    assert "more than one chunk" in witness_ring(to_everyone, 3, checks._rank_input)


def test_the_witnesses_words_follow_the_hint_policy(monkeypatch):
    """Every kind of record a witness leaves, at the longest (4 ranks, the smaller bucket cap)."""
    from dtlib import grading
    from dtlib.grading import hint_policy
    from dtlib.grading import ddp_witness, ring_witness

    master = hint_policy.master_of("communication", grading.masters())
    waits = [{"waiting": "reduce-scatter step 2"}, {"waiting": "all-gather step 2"}, {}]
    ddp_waits = [{"waiting": "bucket 3's all-reduce (16512 elements) in step 2", "hint": hint}
                 for hint in (ddp_witness.HINT_ONE_PER_BUCKET, ddp_witness.HINT_DO_NOT_BLOCK)]
    for module, records, judge in (
            (ring_witness, waits, lambda: witness_ring(None, 4, None)),
            (ddp_witness, [*ddp_waits, {}], lambda: witness_ddp(None, 64 / 1024, checks.ddp_model, []))):
        for record in records:
            monkeypatch.setattr(module, "run_with_witness", lambda *a, record=record: (record, RuntimeError()))
            assert hint_policy.violations(judge(), "communication", master) == []


def test_ring_check_reports_a_deadlock():
    with pytest.raises(AssertionError, match="deadlock.*non-blocking"):
        checks.check_ring_all_reduce(blocking_sends, world_sizes=(3,), shapes=((12,),), timeout=5)


# ---- q2: buckets -----------------------------------------------------------------------------------
def make_buckets(params, cap_bytes, forward=False, strict=False, keep_last=True):
    order = range(len(params)) if forward else reversed(range(len(params)))
    buckets, current, size = [], [], 0
    for i in order:
        nbytes = params[i].numel() * params[i].element_size()
        if strict and current and size + nbytes > cap_bytes:  # never exceed the cap: not PyTorch's rule
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += nbytes
        if size >= cap_bytes:
            buckets.append(current)
            current, size = [], 0
    if current and keep_last:
        buckets.append(current)
    return buckets


def test_bucket_check_accepts_the_solution_and_matches_assign_buckets():
    checks.check_make_buckets(make_buckets)
    four = [torch.empty(256, 256) for _ in range(4)]
    assert make_buckets(four, 600 * 1024) == [[3, 2, 1], [0]]
    assert [[3 - i for i in b] for b in assign_buckets(four[::-1], 600 * 1024)] == [[3, 2, 1], [0]]


@pytest.mark.parametrize("kwargs,message", [
    ({"forward": True}, "walk params in reverse order"),
    ({"strict": True}, "a bucket closes at the wrong parameter"),
    ({"keep_last": False}, "did you forget the last"),
])
def test_bucket_check_rejects_classic_mistakes(kwargs, message):
    with pytest.raises(AssertionError, match=message):
        checks.check_make_buckets(lambda p, c: make_buckets(p, c, **kwargs))
    with pytest.raises(AssertionError, match="returned None"):
        checks.check_make_buckets(lambda p, c: None)


# ---- q3: the learner's bucketed DDP -----------------------------------------------------------------
class MiniDDP:
    """The exercise's class with the solution filled in; subclasses inject one mistake each."""

    def __init__(self, model, bucket_cap_mb=25.0):
        self.model, self.world_size = model, dist.get_world_size()
        for t in model.state_dict().values():
            dist.broadcast(t, src=0)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.buckets = [[self.params[i] for i in b]
                        for b in make_buckets(self.params, int(bucket_cap_mb * MiB))]
        self.where, self.flat = {}, []
        for b, params in enumerate(self.buckets):
            offset = 0
            for p in params:
                self.where[p] = (b, offset)
                offset += p.numel()
            self.flat.append(torch.zeros(offset))
        self.reset()
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._grad_ready)

    def reset(self):
        self.missing = [len(params) for params in self.buckets]
        self.works = [None] * len(self.buckets)

    def __call__(self, *inputs):
        return self.model(*inputs)

    def _copy_in(self, p, scale):
        b, offset = self.where[p]
        self.flat[b][offset:offset + p.numel()].copy_(p.grad.reshape(-1) * scale)
        self.missing[b] -= 1
        return b

    def _grad_ready(self, p):
        b = self._copy_in(p, 1 / self.world_size)
        if self.missing[b] == 0:
            self.works[b] = dist.all_reduce(self.flat[b], async_op=True)

    def finish(self):
        for b, params in enumerate(self.buckets):
            if self.works[b] is not None:
                self.works[b].wait()
            for p in params:
                _, offset = self.where[p]
                p.grad.copy_(self.flat[b][offset:offset + p.numel()].view_as(p))
        self.reset()


class OtherOrderInside(MiniDDP):
    """The order inside a bucket is free: the same buckets, each laid out first parameter first."""

    def __init__(self, model, bucket_cap_mb=25.0):
        super().__init__(model, bucket_cap_mb)
        self.buckets = [params[::-1] for params in self.buckets]
        self.where = {p: (b, sum(q.numel() for q in params[:k]))
                      for b, params in enumerate(self.buckets) for k, p in enumerate(params)}


def test_the_checks_own_rank_beside_ddp_takes_any_order_inside_a_bucket():
    for cap_mb in (64 / 1024, 25.0):
        assert witness_ddp(OtherOrderInside, cap_mb, checks.ddp_model, checks._ddp_batches(2, 16, 128)) is None
    assert "not its gradients divided" in witness_ddp(
        NoDivide, 25.0, checks.ddp_model, checks._ddp_batches(2, 16, 128))


class NoDivide(MiniDDP):  # its gradients added as they are: neither the mean nor the sum's half
    def _grad_ready(self, p):
        b = self._copy_in(p, 0.5 / self.world_size)
        if self.missing[b] == 0:
            self.works[b] = dist.all_reduce(self.flat[b], async_op=True)


class Blocking(MiniDDP):
    def _grad_ready(self, p):
        b = self._copy_in(p, 1 / self.world_size)
        if self.missing[b] == 0:
            dist.all_reduce(self.flat[b])


class AllAtTheEnd(MiniDDP):
    def _grad_ready(self, p):
        self._copy_in(p, 1 / self.world_size)

    def finish(self):
        for b in range(len(self.buckets)):
            self.works[b] = dist.all_reduce(self.flat[b], async_op=True)
        super().finish()


class Summed(MiniDDP):
    def _grad_ready(self, p):
        b = self._copy_in(p, 1.0)
        if self.missing[b] == 0:
            self.works[b] = dist.all_reduce(self.flat[b], async_op=True)


class NoCopyBack(MiniDDP):
    def finish(self):
        for w in self.works:
            w.wait()
        self.reset()


class PerParameter(MiniDDP):
    def _grad_ready(self, p):
        self.works.append(dist.all_reduce(p.grad.div_(self.world_size), async_op=True))

    def finish(self):
        for w in self.works:
            if w is not None:
                w.wait()
        self.reset()


class WaitsInHook(MiniDDP):
    def _grad_ready(self, p):
        b = self._copy_in(p, 1 / self.world_size)
        if self.missing[b] == 0:  # async, but waited for at once: no overlap
            self.works[b] = dist.all_reduce(self.flat[b], async_op=True)
            self.works[b].wait()


class NeverWaits(MiniDDP):
    def finish(self):
        self.works = [None] * len(self.works)  # drops the work objects unwaited
        super().finish()


class Stub(MiniDDP):
    def _grad_ready(self, p):
        ...

    def finish(self):
        ...


def test_ddp_check_accepts_the_solution():
    checks.check_bucketed_ddp(MiniDDP)


@pytest.mark.parametrize("cls,message", [
    (Blocking, "blocking: pass async_op=True"),
    (AllAtTheEnd, "issued after backward\\(\\) returned"),
    (Summed, "summed over ranks, not averaged"),
    (NoCopyBack, "different weights from rank 0"),
    (PerParameter, "one per parameter"),
    (Stub, "issued no all_reduce"),
    (WaitsInHook, "waited for before backward\\(\\) returned"),
    (NeverWaits, "never waited for"),
])
def test_ddp_check_rejects_classic_mistakes(cls, message):
    with pytest.raises(AssertionError, match=message):
        checks.check_bucketed_ddp(cls)


def test_learners_timeline_is_drawn_with_the_lesson_plot():
    rec = checks.record_timeline(MiniDDP, bucket_cap_mb=1.0, layers=3, width=512, batch=16)
    assert len(rec.bucket_issued) == 3 and rec.overlapped_buckets == 3
    assert all(d is not None and d >= i for i, d in zip(rec.bucket_issued, rec.bucket_done))
    fig = plot_overlap_timeline({"mine": rec})
    assert len(fig.axes) == 1 and "mine" in fig.axes[0].get_title()
    with pytest.raises(AssertionError, match="raised on rank"):
        checks.record_timeline(lambda model, cap: 1 / 0)


# ---- the lesson's experiments and plots ---------------------------------------------------------------
def test_fit_alpha_beta_recovers_the_model():
    link = Link("x", bandwidth=2e9, latency=5e-5, source="test")
    rows = [{"impl": "a", "bytes": s, "seconds": collective_time("all_reduce", s, 4, link), "world_size": 4}
            for s in (1024, 65536, 2 ** 20, 2 ** 24)]
    fit = experiments.fit_alpha_beta(rows, "a")
    assert fit.latency == pytest.approx(5e-5, rel=1e-6) and fit.bandwidth == pytest.approx(2e9, rel=1e-6)
    # what the lesson prints: 1.0 on the line, 3.0 where a time took three times the model's
    assert experiments.measured_over_model(rows, "a", fit) == pytest.approx({r["bytes"]: 1.0 for r in rows})
    slow = [{**r, "seconds": 3 * r["seconds"]} if r["bytes"] == 1024 else r for r in rows]
    assert experiments.measured_over_model(slow, "a", fit)[1024] == pytest.approx(3.0)
    with pytest.raises(ValueError, match="two sizes"):
        experiments.fit_alpha_beta(rows, "b")
    with pytest.raises(ValueError, match="do not grow"):
        experiments.fit_alpha_beta([{**r, "seconds": 1.0 / (i + 1)} for i, r in enumerate(rows)], "a")


def test_time_all_reduce_rows_follow_nccl_tests():
    rows = experiments.time_all_reduce([4096, 65536], world_size=2, iters=3)
    assert {r["impl"] for r in rows} == {"ring (dtlib, send/recv)", "built-in (dist.all_reduce)"}
    for r in rows:  # 2 ranks: busbw = algbw x 2(n-1)/n = algbw
        assert r["algbw"] == pytest.approx(r["bytes"] / r["seconds"])
        assert r["busbw"] == pytest.approx(r["algbw"])
        assert r["statistic"] == "min" and r["iterations"] == 9  # 3 x iters below 1/3 MiB
    with pytest.raises(ValueError, match="sizes"):
        experiments.time_all_reduce([])
    with pytest.raises(ValueError, match="statistic"):  # before any rank starts
        experiments.time_all_reduce([4096], statistic="p99")


def test_the_fastest_iteration_is_what_load_disturbs_least():
    # a quiet 2 ms collective, three iterations delayed by a descheduled rank: the minimum is the
    # quiet time; the median moves once most iterations are delayed, the mean with every delay
    times = [0.002, 0.002, 0.009, 0.002, 0.015, 0.030]
    assert experiments.summarise(times) == 0.002
    assert experiments.summarise(times, "median") == pytest.approx(0.0055)
    assert experiments.summarise(times, "mean") == pytest.approx(0.06 / 6)
    busy = [0.002, 0.011, 0.009, 0.012, 0.015, 0.030]
    assert experiments.summarise(busy) == 0.002 and experiments.summarise(busy, "median") == pytest.approx(0.0115)
    with pytest.raises(ValueError, match="statistic"):
        experiments.summarise(times, "max")
    with pytest.raises(ValueError, match="at least one"):
        experiments.summarise([])


def test_overlap_records_count_buckets_and_time_each_all_reduce_to_its_completion():
    runs = experiments.overlap_records({"naive": None, "one": 25.0, "small": 1.0}, layers=3, batch=16,
                                       warmup=1, repeats=3)
    assert [len(runs[k]["buckets"]) for k in ("naive", "one", "small")] == [6, 1, 3]
    for run in runs.values():
        assert len(run["records"]) == len(run["left_after_backward"]) == 3
        assert sorted(run["left_after_backward"])[1] == run["record"].left_after_backward  # the median repeat
        for rec in run["records"]:
            # completed after issued, and at the latest when the code had waited for it
            assert all(i <= c <= d for i, c, d in zip(rec.bucket_issued, rec.bucket_completed, rec.bucket_done))
    assert all(left >= 0 for run in runs.values() for left in run["left_after_backward"])
    with pytest.raises(ValueError, match="repeats"):
        experiments.overlap_records({"one": 25.0}, repeats=0)


def test_compression_runs_report_bytes_and_accuracy():
    from dtlib.data import load_mnist
    train, test = load_mnist("train", verbose=False).subset(128), load_mnist("test", verbose=False).subset(64)
    rows = experiments.compression_runs(["none (fp32 all-reduce)", "fp16 cast", "PowerSGD rank 1"], steps=12,
                                        train=train, test=test, seeds=2)
    wire = {r["method"]: r["bytes_per_step"] for r in rows}
    assert wire["fp16 cast"] == pytest.approx(wire["none (fp32 all-reduce)"] / 2)
    assert wire["PowerSGD rank 1"] < wire["none (fp32 all-reduce)"] / 10
    assert all(0 <= r["accuracy"] <= 1 and len(r["losses"]) == 12 for r in rows)
    for r in rows:  # two seeds: their mean and sample spread
        a, b = r["accuracies"]
        assert r["accuracy"] == pytest.approx((a + b) / 2) and r["accuracy_std"] == pytest.approx(abs(a - b) / 2 ** 0.5)
    one = experiments.compression_runs(["none (fp32 all-reduce)"], steps=12, train=train, test=test, seed=1)[0]
    assert one["accuracies"] == [rows[0]["accuracies"][1]] and one["accuracy_std"] == 0.0  # seeds 0, 1: the second is seed 1
    with pytest.raises(ValueError, match="unknown methods"):
        experiments.compression_runs(["gzip"])
    with pytest.raises(ValueError, match="seeds"):
        experiments.compression_runs(["fp16 cast"], seeds=0)


def test_plots_build():
    ring = viz_ring.plot_ring_steps(3)  # 2(n-1) steps of the ring, one panel each, ranks drawn in each
    assert len(ring.axes) >= 2 * (3 - 1) and all(ax.patches or ax.texts for ax in ring.axes if ax.axison)
    sizes = [1024, 2 ** 20]
    measured = [{"impl": "x", "bytes": 1024, "seconds": 1e-4},
                {"impl": "x", "bytes": 2 ** 20, "seconds": 2e-3}]
    fig = viz.plot_alpha_beta(sizes, {"m": [1e-4, 1e-3]}, 2, measured=measured, mark=1024)
    assert len(fig.axes) == 2
    curves = charts.plot_curves([1, 2], {"a": [1.0, 2.0], "b": [2.0, 3.0]}, "x", "y", logx=True)
    assert [line.get_label() for line in curves.axes[0].get_lines()] == ["a", "b"]
    assert list(curves.axes[0].get_lines()[1].get_ydata()) == [2.0, 3.0]
    with pytest.raises(ValueError, match="between 2 and 8"):
        viz_ring.plot_ring_steps(9)
    with pytest.raises(ValueError, match="2 values for 3"):
        charts.plot_curves([1, 2, 3], {"a": [1.0, 2.0]}, "x", "y")
    with pytest.raises(ValueError, match="nothing to plot"):
        viz.plot_alpha_beta(sizes, {}, 2)
