"""The capstone's checks: the reference answers pass, and each classic mistake fails with a
message that names it."""
import math

import pytest

from dtlib.analytic.layout import Parallelism
from dtlib.analytic.reliability import LLAMA3_GPU_MTBF_HOURS
from dtlib.grading.checks import capstone as checks

GOOD = Parallelism(dp=64, tp=2, num_microbatches=16, zero=1, recompute="selective", sequence_parallel=True)


def test_q1_a_good_layout_passes_every_check():
    for check in (checks.check_layout_is_the_job, checks.check_layout_is_feasible, checks.check_layout_is_fast):
        check(GOOD)


@pytest.mark.parametrize("layout,check,message", [
    (..., checks.check_layout_is_the_job, "my_layout must be a dtlib.analytic.layout.Parallelism"),
    (GOOD.with_(num_microbatches=8), checks.check_layout_is_the_job, "global batch: dp x micro_batch_size x num_microbatches = 64 x 1 x 8 = 512"),
    (Parallelism(dp=32, tp=2, num_microbatches=32), checks.check_layout_is_the_job, "uses the cluster: dp x tp x pp x cp = 64"),
    (Parallelism(dp=128, micro_batch_size=8, num_microbatches=1), checks.check_layout_is_feasible, "fits memory:"),
    (Parallelism(dp=8, tp=4, pp=4, micro_batch_size=16, num_microbatches=8, zero=1, recompute="full",
                 sequence_parallel=True), checks.check_layout_is_feasible, "pipeline bubble: (p-1)/(v m) = 37.5%"),
    (Parallelism(dp=16, tp=8, num_microbatches=64, zero=1, recompute="selective", sequence_parallel=True),
     checks.check_layout_is_fast, "MFU near the best: predicted MFU 47.3%"),  # TP overlapped (megatron stack); 64 micro-batches of 1: launch-bound
    (Parallelism(dp=8, tp=16, num_microbatches=128), checks.check_layout_is_the_job, "not a valid layout of capstone-10b: tensor parallel size tp=16 must divide the 40 attention heads"),
])
def test_q1_mistakes_fail_with_their_reason(layout, check, message):
    with pytest.raises(AssertionError, match=None) as info:
        check(layout)
    assert message in str(info.value)


def test_q2_reference_passes_and_mistakes_fail():
    checks.check_teaching_cases(checks.reference_exposed_time)
    checks.check_exposed_time(checks.reference_exposed_time)

    def hides_everything(g, b, backward, t):
        n = math.ceil(g / b)
        return max(n * t(g / n) - backward, 0)

    def one_all_reduce(g, b, backward, t):
        return max(t(g) - backward, t(b))

    def floor_buckets(g, b, backward, t):
        n = max(int(g // b), 1)
        return max(n * t(g / n) - backward, t(g / n))

    for wrong, message in ((hides_everything, "the last bucket is still exposed (bullet 3), not 0"),
                           (one_all_reduce, "each of the 1,000 buckets pays the latency"),
                           (floor_buckets, "1e9 bytes in 3e8-byte buckets is 4 buckets")):
        with pytest.raises(AssertionError) as info:
            checks.check_teaching_cases(wrong)
        assert message in str(info.value)
    with pytest.raises(AssertionError, match="raised ZeroDivisionError"):
        checks.check_teaching_cases(lambda g, b, backward, t: 1 / 0)


def _report():
    r = checks.reference_report()
    return {k: r[k] for k in checks.REPORT_KEYS}


def test_q3_reference_passes():
    checks.check_report_consistent(_report())
    checks.check_report_matches_dtlib(_report())


@pytest.mark.parametrize("change,check,message", [
    (dict(failures_per_day=24 / LLAMA3_GPU_MTBF_HOURS), checks.check_report_consistent, "failures_per_day = "),
    (dict(checkpoint_interval_min=None), checks.check_report_consistent, "report['checkpoint_interval_min'] must be a number"),
    ("interval_in_seconds", checks.check_report_consistent, "checkpoint_interval_min = "),
    ("cost_at_3", checks.check_report_consistent, "cost_usd = "),
    (dict(switches=96), checks.check_report_matches_dtlib, "switches = 96 is not dtlib's fat-tree"),
    ("days_doubled", checks.check_report_matches_dtlib, "is not the run time of the planner's best layout"),
    ("days_doubled", checks.check_report_consistent, "gpu_hours = "),
])
def test_q3_mistakes_fail_with_their_reason(change, check, message):
    r = _report()
    if change == "interval_in_seconds":
        r["checkpoint_interval_min"] *= 60
    elif change == "cost_at_3":
        r["cost_usd"] = r["gpu_hours"] * 3.0
    elif change == "days_doubled":
        r["days"] *= 2
    else:
        r.update(change)
    with pytest.raises(AssertionError) as info:
        check(r)
    assert message in str(info.value)


def test_q3_a_missing_report_says_what_to_fill():
    with pytest.raises(AssertionError, match="report must be a dict with keys switches"):
        checks.check_report_consistent(...)
    with pytest.raises(AssertionError, match="report lacks goodput"):
        checks.check_report_consistent({k: 1.0 for k in checks.REPORT_KEYS if k != "goodput"})


# Issue 28, item 2: the hints name the mistake without handing over the answer.
def _hint(check, answer) -> str:
    with pytest.raises(AssertionError) as info:
        check(answer)
    return str(info.value)


@pytest.mark.parametrize("answer", [lambda g, b, backward, t: None, lambda g, b, backward, t: t(g)],
                         ids=["unfilled", "one all-reduce"])
def test_q2_hint_is_one_line_without_the_formula(answer):
    for check in (checks.check_teaching_cases, checks.check_exposed_time):
        text = _hint(check, answer)
        first = text.splitlines()[0]
        assert "max(" not in text and "n * t(" not in text and "t(bucket)" not in text, text
        assert len(first) <= 300, first
    assert _hint(checks.check_teaching_cases, lambda g, b, backward, t: None).startswith(
        "exposed_time(1e+09, 2.5e+07, backward=1, t) returned None: fill in exposed_time")


def test_q1_hint_of_a_slow_layout_does_not_name_the_best_layout():
    slow = Parallelism(dp=16, tp=8, num_microbatches=64, zero=1, recompute="selective", sequence_parallel=True)
    text = _hint(checks.check_layout_is_fast, slow)
    assert "MFU near the best" in text and "the largest cost after compute is" in text
    assert "best layout is" not in text and "dp=" not in text, text


def test_q3_hints_do_not_give_the_numbers():
    want = checks.reference_report()
    assert str(want["switches"]) not in _hint(checks.check_report_matches_dtlib, {**_report(), "switches": 96})
    assert f"{want['days']:.6g}" not in _hint(checks.check_report_matches_dtlib,
                                             {**_report(), "days": 2 * want["days"]})
