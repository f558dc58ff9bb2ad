"""Pipeline schedules as data: closed forms of the bubble and of the activations in flight, the
validator's messages, and PyTorch's own schedule validator and dry-run simulator as oracles."""
import pytest

from dtlib.parallel import Action, schedule, simulate, validate
from dtlib.analytic.layout import in_flight

A = Action
SIZES = [(p, m) for p in (1, 2, 3, 4) for m in (1, 2, 3, 4, 8)]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", SIZES)
@pytest.mark.parametrize("t_f,t_b", [(1.0, 2.0), (1.0, 1.0), (0.3, 0.5)])
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m(name, p, m, t_f, t_b):
    # Narayanan et al. 2021, Sec. 2.2.1: bubble time fraction (p-1)/m, whatever the F/B costs
    t = simulate(schedule(name, p, m), t_f, t_b)
    assert t.bubble_ratio == pytest.approx((p - 1) / m)
    assert t.makespan == pytest.approx((m + p - 1) * (t_f + t_b))
    assert t.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("p,m", [(2, 2), (2, 4), (2, 8), (3, 6), (4, 4), (4, 8), (4, 12)])
@pytest.mark.parametrize("v", [2, 3, 4])
def test_interleaved_bubble_is_p_minus_1_over_vm(p, m, v):
    t = simulate(schedule("interleaved", p, m, v), 1.0, 2.0)
    assert t.bubble_ratio == pytest.approx((p - 1) / (v * m))


@pytest.mark.parametrize("p,m", [(2, 2), (2, 8), (3, 3), (3, 9), (4, 4), (4, 8)])
@pytest.mark.parametrize("t_f,t_b,t_w", [(1.0, 1.0, 1.0), (1.0, 2.0, 1.0), (1.0, 1.0, 0.5), (2.0, 1.0, 1.0)])
def test_zb_h1_bubble(p, m, t_f, t_b, t_w):
    # Qi et al. 2023, Sec. 3.1: each rank idles (p-1)(t_F + t_B - t_W) (m >= p, t_W <= t_F), against
    # 1F1B's (p-1)(t_F + t_B + t_W) for the same work
    zb = simulate(schedule("zb-h1", p, m), t_f, t_b, t_w)
    one = simulate(schedule("1f1b", p, m), t_f, t_b, t_w)
    assert zb.idle == pytest.approx([(p - 1) * (t_f + t_b - t_w)] * p)
    assert one.idle == pytest.approx([(p - 1) * (t_f + t_b + t_w)] * p)
    assert sum(zb.busy) == pytest.approx(sum(one.busy))  # equal work


@pytest.mark.parametrize("p,m", SIZES)
def test_in_flight_gpipe_1f1b_zb(p, m):
    assert simulate(schedule("gpipe", p, m)).peak_in_flight == [m] * p
    one = simulate(schedule("1f1b", p, m)).peak_in_flight
    assert one == [min(p - r, m) for r in range(p)]
    # first and last rank as dtlib.analytic.layout.in_flight has them (lesson 3's memory formula)
    assert (one[0], one[-1]) == tuple(int(x) for x in in_flight("1f1b", p, m)) or p == 1
    zb = simulate(schedule("zb-h1", p, m), 1, 1, 1).peak_in_flight
    assert max(zb) <= max(one)


@pytest.mark.parametrize("p,m", [(2, 2), (2, 4), (2, 8), (3, 6), (4, 4), (4, 8)])
@pytest.mark.parametrize("v", [2, 3])
def test_in_flight_interleaved_is_megatron_warmup_plus_one(p, m, v):
    peak = simulate(schedule("interleaved", p, m, v)).peak_in_flight
    # Megatron-LM forward_backward_pipelining_with_interleaving: warm-up (p-r-1)*2 + (v-1)*p
    assert peak == [min(m * v, (p - r - 1) * 2 + (v - 1) * p + 1) for r in range(p)]
    first, last = in_flight("interleaved", p, m, v)  # in units of a rank's whole share
    assert (peak[0] / v, peak[-1] / v) == pytest.approx((float(first), float(last)))


def test_p2p_latency_delays_each_hop():
    p, m, c = 4, 3, 0.25
    t = simulate(schedule("gpipe", p, m), 1.0, 2.0, t_p2p=c)
    # forward crosses p-1 links on the way down, the backward p-1 on the way up
    assert t.makespan == pytest.approx((m + p - 1) * 3.0 + 2 * (p - 1) * c)


def test_every_schedule_runs_each_pass_once_in_order():
    for name, p, m, v in [("gpipe", 3, 5, 1), ("1f1b", 3, 5, 1), ("zb-h1", 3, 5, 1), ("interleaved", 3, 6, 2)]:
        actions = schedule(name, p, m, v)
        kinds = "FBW" if name == "zb-h1" else "FB"
        for ops in actions:
            assert sorted(ops) == sorted(A(k, i, c) for k in kinds for i in range(m) for c in range(v))
        validate(actions)


@pytest.mark.parametrize("actions,message", [
    ([[A("F", 0), A("F", 1), A("B", 0), A("B", 1)], [A("F", 0), A("B", 0), A("B", 1), A("F", 1)]],
     "rank 1 runs backward of micro-batch 1 before its forward"),
    ([[A("F", 0), A("B", 0), A("W", 0)], [A("F", 0), A("W", 0), A("B", 0)]],
     "rank 1 runs weight-gradient of micro-batch 0 before its backward"),
    ([[A("F", 0), A("F", 0), A("B", 0)], [A("F", 0), A("B", 0)]], "rank 0 runs forward of micro-batch 0 twice"),
    # rank 1 receives micro-batch 1 that rank 0 never sends
    ([[A("F", 0), A("B", 0)], [A("F", 0), A("F", 1), A("B", 0), A("B", 1)]],
     "rank 0 never runs forward of micro-batch 1"),
    ([[A("F", 0), A("B", 0), A("W", 0)], [A("F", 0), A("B", 0)]], "rank 1 never runs weight-gradient"),
    # rank 0 waits for the gradient of micro-batch 0 before sending micro-batch 1, which rank 1 wants first
    ([[A("F", 0), A("B", 0), A("F", 1), A("B", 1)], [A("F", 1), A("F", 0), A("B", 0), A("B", 1)]],
     "deadlock: rank 0 waits to receive the gradient for backward of micro-batch 0 from rank 1"),
])
def test_validator_rejects_with_the_reason(actions, message):
    with pytest.raises(ValueError, match=message):
        validate(actions)
    with pytest.raises(ValueError, match=message):
        simulate(actions)


@pytest.mark.parametrize("call,message", [
    (lambda: schedule("pipedream", 2, 4), "schedule name must be one of"),
    (lambda: schedule("interleaved", 4, 6, 2), "multiple of pp=4"),
    (lambda: schedule("interleaved", 2, 4, 1), "virtual_stages >= 2"),
    (lambda: schedule("1f1b", 2, 4, 2), "virtual_stages=2 needs schedule='interleaved'"),
    (lambda: schedule("gpipe", 0, 4), "stages must be an integer >= 1, got 0"),
    (lambda: schedule("gpipe", 2, 0), "microbatches must be an integer >= 1, got 0"),
    (lambda: schedule("gpipe", 2, 2.5), "microbatches must be an integer >= 1, got 2.5"),
    (lambda: simulate(schedule("gpipe", 2, 2), t_forward=-1), "t_forward must be a finite time >= 0"),
    (lambda: simulate(schedule("gpipe", 2, 2), t_p2p=float("nan")), "t_p2p must be a finite time"),
])
def test_bad_arguments_are_one_line_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def _to_torch(actions, p):
    from torch.distributed.pipelining.schedules import _Action, _ComputationType as T
    split = any(a.kind == "W" for ops in actions for a in ops)
    kind = {"F": T.FORWARD, "B": T.BACKWARD_INPUT if split else T.FULL_BACKWARD, "W": T.BACKWARD_WEIGHT}
    return {r: [_Action(a.chunk * p + r, kind[a.kind], a.microbatch) for a in ops]
            for r, ops in enumerate(actions)}


@pytest.mark.parametrize("name,p,m,v", [("gpipe", 4, 3, 1), ("1f1b", 4, 8, 1), ("1f1b", 4, 2, 1),
                                        ("zb-h1", 4, 8, 1), ("interleaved", 4, 8, 2),
                                        ("interleaved", 2, 4, 3)])
def test_torch_validator_and_dry_run_accept_our_schedules(name, p, m, v):
    from torch.distributed.pipelining.schedules import (_add_send_recv, _simulate_comms_compute,
                                                        _validate_schedule)
    order = _to_torch(schedule(name, p, m, v), p)
    assert _validate_schedule(order, p, p * v, m) == {s: s % p for s in range(p * v)}
    with_comms = _add_send_recv(order, lambda s: s % p, p * v)
    _simulate_comms_compute(with_comms, lambda s: s % p, p * v)  # raises "Schedule is not progressing"


def test_torch_dry_run_agrees_on_a_deadlock():
    from torch.distributed.pipelining.schedules import _add_send_recv
    bad = [[A("F", 0), A("B", 0), A("F", 1), A("B", 1)], [A("F", 1), A("F", 0), A("B", 0), A("B", 1)]]
    with pytest.raises(AssertionError, match="can't schedule sends/recvs"):  # torch's own words
        _add_send_recv(_to_torch(bad, 2), lambda s: s % 2, 2)
