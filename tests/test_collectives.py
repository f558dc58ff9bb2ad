"""Ring collectives from send/recv and the hierarchical all-reduce, against torch.distributed."""
import pytest
import torch
import torch.distributed as dist
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch

from dtlib.analytic.comm import bytes_sent_per_rank
from dtlib.launcher import RankFailedError, launch
from dtlib.parallel import collectives as C
from dtlib.viz.comm import plot_bandwidth
from dtlib.viz.ring import plot_ring_all_reduce

TIMEOUT = 30
SIZES = [0, 1, 3, 7, 64, 1001]  # includes sizes < world size and not divisible by it


def _inputs(rank, numel, dtype):
    g = torch.Generator().manual_seed(1000 * rank + numel)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=g, dtype=torch.float64).to(dtype)
    return torch.randint(-50, 50, (numel,), generator=g, dtype=dtype)


def _check_against_dist(rank, world_size):
    """Returns a list of (case, ok) so the test names the failing case."""
    results = []
    for dtype in (torch.float32, torch.float64, torch.int64):
        for numel in SIZES:
            x = _inputs(rank, numel, dtype)
            expected = x.clone()
            dist.all_reduce(expected)  # the backend's own
            # floats: the ring adds in another order than gloo; integers must match exactly
            tol = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float64: dict(rtol=1e-12, atol=1e-12),
                   torch.int64: dict(rtol=0, atol=0)}[dtype]
            got = C.ring_all_reduce(x.clone())
            results.append((f"all_reduce {dtype} {numel}", torch.allclose(got, expected, **tol)))
            # this rank's chunk, as torch.tensor_split would cut it
            chunk = C.ring_reduce_scatter(x)
            mine = torch.tensor_split(expected, world_size)[rank]
            results.append((f"reduce_scatter {dtype} {numel}", torch.allclose(chunk, mine, **tol)))
            results.append((f"input untouched {numel}", torch.equal(x, _inputs(rank, numel, dtype))))
            gathered = C.ring_all_gather(torch.tensor_split(x, world_size)[rank], numel)
            everyone = [torch.empty_like(x) for _ in range(world_size)]
            dist.all_gather(everyone, x)
            ref = torch.cat([torch.tensor_split(e, world_size)[r] for r, e in enumerate(everyone)])
            results.append((f"all_gather {dtype} {numel}", torch.equal(gathered, ref)))
    # 2-D, non-contiguous, MAX and AVG
    m = _inputs(rank, 35, torch.float32).view(5, 7).t()
    expected = m.clone()
    dist.all_reduce(expected)
    got = C.ring_all_reduce(m.clone())
    results.append(("non-contiguous", torch.allclose(got, expected, atol=1e-5)))
    got = C.ring_all_reduce(m.clone(), op=dist.ReduceOp.AVG)
    results.append(("avg", torch.allclose(got, expected / world_size, atol=1e-5)))
    for name, op in (("max", dist.ReduceOp.MAX), ("min", dist.ReduceOp.MIN)):
        expected = m.clone()
        dist.all_reduce(expected, op=op)
        results.append((name, torch.equal(C.ring_all_reduce(m.clone(), op=op), expected)))
    expected = m.clone()
    dist.all_reduce(expected, op=dist.ReduceOp.PRODUCT)
    got = C.ring_all_reduce(m.clone(), op=dist.ReduceOp.PRODUCT)
    results.append(("product", torch.allclose(got, expected, rtol=1e-5, atol=0)))
    return results


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_ring_collectives_equal_torch_distributed(world_size):
    for rank_results in launch(_check_against_dist, world_size, timeout=TIMEOUT):
        failed = [case for case, ok in rank_results if not ok]
        assert not failed, failed


OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX,
       "product": dist.ReduceOp.PRODUCT}


def _same(got, expected):
    if expected.is_floating_point():  # float64: only the order of the operations differs
        return torch.allclose(got, expected, rtol=1e-12, atol=1e-12)
    return torch.equal(got, expected)


def _larger_worlds(rank, world_size):
    """Every op on 5 or 6 ranks, sizes below and not divisible by the world size; at 6 ranks the
    two-level all-reduce with 3 nodes of 2 and 2 nodes of 3."""
    results = []
    for dtype in (torch.float64, torch.int64):  # ints in [-50, 50]: a product of 6 fits int64
        for numel in (0, 1, 4, 7, 1001):
            x = _inputs(rank, numel, dtype)
            for name, op in OPS.items():
                expected = x.clone()
                dist.all_reduce(expected, op=op)
                results.append((f"all_reduce {name} {dtype} {numel}",
                                _same(C.ring_all_reduce(x.clone(), op=op), expected)))
                results.append((f"reduce_scatter {name} {dtype} {numel}",
                                _same(C.ring_reduce_scatter(x, op=op),
                                      torch.tensor_split(expected, world_size)[rank])))
            everyone = [torch.empty_like(x) for _ in range(world_size)]
            dist.all_gather(everyone, x)
            ref = torch.cat([torch.tensor_split(e, world_size)[r] for r, e in enumerate(everyone)])
            gathered = C.ring_all_gather(torch.tensor_split(x, world_size)[rank], numel)
            results.append((f"all_gather {dtype} {numel}", torch.equal(gathered, ref)))
    if world_size == 6:
        for node_size in (2, 3):
            for numel in (1, 5, 1001):
                x = _inputs(rank, numel, torch.float64)
                for name in ("sum", "min"):
                    expected = x.clone()
                    dist.all_reduce(expected, op=OPS[name])
                    got = C.hierarchical_all_reduce(x.clone(), node_size, op=OPS[name])
                    results.append((f"hierarchical {name} node_size {node_size} {numel}",
                                    _same(got, expected)))
    return results


@pytest.mark.parametrize("world_size", [5, 6])
def test_ring_and_hierarchical_on_five_and_six_ranks(world_size):
    for rank_results in launch(_larger_worlds, world_size, timeout=TIMEOUT):
        failed = [case for case, ok in rank_results if not ok]
        assert not failed, failed
        assert len(rank_results) == 2 * 5 * (2 * len(OPS) + 1) + (12 if world_size == 6 else 0)


def _hierarchical(rank, world_size):
    out = {}
    for node_size in (1, 2, 4):
        for numel in (1, 5, 1000):
            x = _inputs(rank, numel, torch.float32)
            expected = x.clone()
            dist.all_reduce(expected)
            got = C.hierarchical_all_reduce(x.clone(), node_size)
            out[(node_size, numel)] = torch.allclose(got, expected, atol=1e-5)
        avg = C.hierarchical_all_reduce(x.clone(), node_size, op=dist.ReduceOp.AVG)
        out[(node_size, "avg")] = torch.allclose(avg, expected / world_size, atol=1e-5)
    try:
        C.hierarchical_all_reduce(torch.ones(4), 3)
        out["bad node_size"] = "no error"
    except ValueError as e:
        out["bad node_size"] = str(e)
    return out


def test_hierarchical_all_reduce_equals_all_reduce():
    for res in launch(_hierarchical, 4, timeout=TIMEOUT):
        assert "node_size must be a divisor of the world size 4 (1, 2, 4), got 3" in res.pop("bad node_size")
        assert all(res.values()), res


def _count_bytes_sent(rank, world_size, numel, node_size):
    """Patch isend to count the bytes this rank sends, and to whom."""
    sent = {}
    real = dist.isend

    def counting(tensor, dst, *args, **kwargs):
        sent[dst] = sent.get(dst, 0) + tensor.numel() * tensor.element_size()
        return real(tensor, dst, *args, **kwargs)

    dist.isend = counting
    try:
        C.ring_all_reduce(torch.ones(numel))
        ring = dict(sent)
        sent.clear()
        C.hierarchical_all_reduce(torch.ones(numel), node_size)
    finally:
        dist.isend = real
    node = rank // node_size
    across = sum(b for dst, b in sent.items() if dst // node_size != node)
    return sum(ring.values()), across


def test_ring_sends_what_the_cost_model_says():
    world, numel, node_size = 4, 4096, 2
    nbytes = numel * 4
    for ring, across in launch(_count_bytes_sent, world, args=(numel, node_size), timeout=TIMEOUT):
        assert ring == bytes_sent_per_rank("all_reduce", nbytes, world)  # 2(n-1)/n S
        # hierarchical: only the 1/node_size shard crosses nodes, all-reduced among the nodes
        assert across == bytes_sent_per_rank("all_reduce", nbytes / node_size, world // node_size)


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_ring_schedule_and_progress(n):
    for phase in ("reduce_scatter", "all_gather"):
        for step in C.ring_schedule(n, phase):
            assert sorted(s for s, _, _ in step) == list(range(n))  # everyone sends once
            assert sorted(d for _, d, _ in step) == list(range(n))  # and receives once
            assert all(d == (s + 1) % n for s, d, _ in step)
    everyone = frozenset(range(n))
    after_rs = C.ring_progress(n, n - 1)
    assert all(after_rs[r][r] == everyone for r in range(n))  # rank r owns reduced chunk r
    if n > 1:
        assert all(after_rs[r][c] != everyone for r in range(n) for c in range(n) if c != r)
    done = C.ring_progress(n, 2 * (n - 1))
    assert all(cell == everyone for row in done for cell in row)
    with pytest.raises(ValueError, match=rf"steps must be an integer from 0 to {2 * (n - 1)}, got {2 * n}"):
        C.ring_progress(n, 2 * n)


def _bad_inputs(rank, world_size):
    errors = {}
    only_rank0 = dist.new_group([0])  # every rank must take part in creating it
    for name, call in {
        "not member": lambda: C.ring_all_reduce(torch.ones(4), group=only_rank0) if rank else None,
        "meta device": lambda: C.ring_all_reduce(torch.ones(4, device="meta")),
        "op": lambda: C.ring_all_reduce(torch.ones(4), op=dist.ReduceOp.BAND),
        "avg int": lambda: C.ring_all_reduce(torch.ones(4, dtype=torch.int64), op=dist.ReduceOp.AVG),
        "shard size": lambda: C.ring_all_gather(torch.ones(3), numel=10),
        "not tensor": lambda: C.ring_all_reduce([1.0, 2.0]),
    }.items():
        try:
            call()
            errors[name] = None
        except (ValueError, TypeError) as e:
            errors[name] = f"{type(e).__name__}: {e}"
    return errors


def test_bad_input_gives_clear_errors():
    errors, errors1 = launch(_bad_inputs, 2, timeout=TIMEOUT)
    assert errors["not member"] is None and "not a member" in errors1["not member"]
    assert "CPU tensors" in errors["meta device"]
    assert "op must be one of" in errors["op"]
    assert "floating-point" in errors["avg int"]
    assert "shard_bounds" in errors["shard size"] and errors["shard size"].startswith("ValueError")
    assert errors["not tensor"].startswith("TypeError")
    with pytest.raises(ValueError, match="phase must be one of 'reduce_scatter', 'all_gather', got 'all_to_all'"):
        C.ring_schedule(2, "all_to_all")
    with pytest.raises(ValueError, match="world_size must be an integer >= 1, got 0"):
        C.ring_schedule(0, "all_gather")


def _ring_cells(fig, n):
    """{(rank, chunk): inputs summed} read back from the cell labels "k/n" of the ring plot."""
    (ax,) = fig.axes
    cells = {}
    for t in ax.texts:
        if t.get_text().endswith(f"/{n}"):
            x, y = t.get_position()
            cells[(n - 1 - int(y), int(x))] = int(t.get_text().split("/")[0])
    return cells


def test_ring_plot_shows_the_all_reduce_progress():
    n = 4
    arrows = lambda fig: sum(isinstance(p, FancyArrowPatch) for p in fig.axes[0].patches)
    start, end_rs, done = (plot_ring_all_reduce(n, s) for s in (0, n - 1, 2 * (n - 1)))
    assert _ring_cells(start, n) == {(r, c): 1 for r in range(n) for c in range(n)}
    assert arrows(start) == n  # every rank sends one chunk per step
    # after the reduce-scatter each rank holds 1, 2, ..., n inputs in its chunks, and each chunk
    # is complete on exactly one rank
    cells = _ring_cells(end_rs, n)
    assert all(sorted(cells[(r, c)] for c in range(n)) == list(range(1, n + 1)) for r in range(n))
    assert sorted(c for (r, c), k in cells.items() if k == n) == list(range(n))
    assert arrows(end_rs) == n
    assert _ring_cells(done, n) == {(r, c): n for r in range(n) for c in range(n)}
    assert arrows(done) == 0 and "done" in done.axes[0].get_title()


def test_plots_return_figures():
    rows = [{"impl": i, "bytes": b, "busbw": b / 1e-3, "algbw": b / 2e-3}
            for i in ("ring", "gloo") for b in (1024, 4096)]
    fig = plot_bandwidth(rows)
    assert isinstance(fig, Figure) and len(fig.axes[0].lines) == 2
    three = [{**r, "collective": c} for c in ("all_reduce", "reduce_scatter", "all_gather") for r in rows]
    fig = plot_bandwidth(three, "algbw")  # one panel per collective, as bench_collectives plots
    assert [ax.get_title() for ax in fig.axes] == ["all_reduce", "reduce_scatter", "all_gather"]
    assert all(len(ax.lines) == 2 for ax in fig.axes)
    with pytest.raises(ValueError):
        plot_bandwidth(rows, metric="latency")


def test_failure_in_a_ring_is_reported_not_hung():
    # a rank that skips the collective must surface as an error within the timeout
    def worker(rank, world_size):
        if rank == 1:
            raise RuntimeError("rank 1 gave up")
        C.ring_all_reduce(torch.ones(8))

    with pytest.raises(RankFailedError, match="rank 1 gave up"):
        launch(worker, 2, timeout=TIMEOUT)
