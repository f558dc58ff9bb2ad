"""The pipeline exercise's checks accept a correct 1F1B generator and reject the classic mistakes
with a message naming the cause."""
import pytest

from dtlib.grading.checks import pipeline_parallel as checks
from dtlib.parallel import Action


def one_f_one_b(stages, microbatches, warmup=lambda p, r, m: min(p - r - 1, m), cooldown=True):
    """Hand-written 1F1B (Narayanan et al. 2021, Sec. 2.2.1); ``warmup`` and ``cooldown`` let the
    tests plant the classic mistakes."""
    out = []
    for r in range(stages):
        w = warmup(stages, r, microbatches)
        ops = [Action("F", i) for i in range(w)]
        for i in range(microbatches - w):
            ops += [Action("F", w + i), Action("B", i)]
        if cooldown:
            ops += [Action("B", i) for i in range(microbatches - w, microbatches)]
        out.append(ops)
    return out


def gpipe(stages, microbatches):
    return [[Action("F", i) for i in range(microbatches)] + [Action("B", i) for i in range(microbatches)]
            for _ in range(stages)]


def backward_too_early(stages, microbatches):
    out = one_f_one_b(stages, microbatches)
    for ops in out:  # steady state runs the backward of the micro-batch it has not yet sent forward
        for k in range(len(ops) - 1):
            if ops[k].kind == "F" and ops[k + 1].kind == "B":
                ops[k], ops[k + 1] = ops[k + 1], ops[k]
                break
    return out


def test_check_accepts_1f1b():
    checks.check_one_f_one_b(one_f_one_b)


@pytest.mark.parametrize("fn,message", [
    (lambda p, m: None, "returned None"),
    (lambda p, m: one_f_one_b(p, m)[:-1], "return one list of actions per rank"),
    (lambda p, m: [[("F", 0)]] * p, "use Action"),
    (gpipe, r"rank 0 holds 8 micro-batches at once \(all of them: that is GPipe\)"),
    (lambda p, m: one_f_one_b(p, m, warmup=lambda p, r, m: min(p - r, m)),
     "rank 0 holds 5 micro-batches at once, 1F1B at most min"),
    (lambda p, m: one_f_one_b(p, m, warmup=lambda p, r, m: min(r, m)), "deadlock; the warm-up is longest on rank 0"),
    (lambda p, m: one_f_one_b(p, m, warmup=lambda p, r, m: p - r - 1), "cap the warm-up at m"),
    (lambda p, m: one_f_one_b(p, m, cooldown=False), "rank 0 never runs backward of micro-batch 5"),
    (backward_too_early, "rank 3 runs backward of micro-batch 0 before its forward"),
])
def test_check_rejects_classic_mistakes(fn, message):
    with pytest.raises(AssertionError, match=message):
        checks.check_one_f_one_b(fn)


def test_on_ranks_accepts_1f1b_and_rejects_before_launching():
    checks.check_one_f_one_b_on_ranks(one_f_one_b, world_size=4, microbatches=4)
    with pytest.raises(AssertionError, match="that is GPipe"):
        checks.check_one_f_one_b_on_ranks(gpipe)
