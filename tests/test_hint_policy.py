"""The hint policy (dtlib.grading.hint_policy) catches what issue 28 found, and covers every
exercise: tests/conftest.py applies it to every check that tests/test_checks_*.py provoke (the
classic wrong answers), tests/test_grading.py to every hint an unsolved exercise shows."""
import importlib
import pkgutil

import dtlib.grading.checks
from dtlib import grading
from dtlib.grading import hint_policy

CAPSTONE = grading.masters_dir() / "10_capstone.ipynb"
OLD_Q2_HINT = ("exposed_time(grad_bytes=1e+09, ...) returned None, expected 0.0026 s. There are n = ceil(grad_bytes / "
               "bucket_bytes) buckets ...: max(n * t(bucket) - backward, t(bucket)).")


def test_the_solution_s_expressions_are_forbidden_but_not_what_the_question_states():
    fragments = hint_policy.solution_fragments(CAPSTONE)
    assert "max(n*one-backward,one)" in fragments and "math.ceil(grad_bytes/bucket_bytes)" in fragments
    rank_grid = hint_policy.solution_fragments(grading.masters_dir() / "09_3d_parallel.ipynb")
    assert "tp_rank=rank%tp" in rank_grid
    # Q1's question states rank = tp_rank + tp * (dp_rank + dp * pp_rank): naming it gives nothing away
    assert not any("tp*(dp_rank" in f for f in rank_grid)


def test_issue_28_s_hints_break_it():
    found = hint_policy.violations(OLD_Q2_HINT, "capstone", CAPSTONE)
    assert any("HINT_FORBIDDEN" in v for v in found), found
    best = "MFU near the best: predicted MFU 35.1% vs 39%; the best layout is dp=128 tp=1 pp=1 cp=1 v=1"
    assert hint_policy.violations(best, "capstone", CAPSTONE)
    momentum = "rank 0's new global parameters are off by 0.1: delta = g - p, ..., then p.copy_(g)"
    assert hint_policy.violations(momentum, "local_sgd", grading.masters_dir() / "11_beyond_synchronous.ipynb")
    assert hint_policy.violations("x" * (hint_policy.MAX_FIRST_LINE + 1), "capstone", CAPSTONE)
    assert hint_policy.violations("", "capstone", CAPSTONE) == ["the first line is empty"]


def test_a_hint_that_names_the_mistake_passes():
    ok = ("with a long backward the last bucket is still exposed (bullet 3), not 0: exposed_time(1e+09, 2.5e+07, "
          "backward=1, t) returned 0, expected 0.0026 s\nt(bytes) = 0.0001 s + bytes / 1e+10 B/s; 40 buckets")
    assert hint_policy.violations(ok, "capstone", CAPSTONE) == []
    # the traceback of a learner's rank may follow a blank line: it is theirs, not the hint
    assert hint_policy.violations("your function raised on rank 1: ValueError: x\n\nmax(n*one-backward,one)",
                                  "capstone", CAPSTONE) == []


def test_every_checks_module_belongs_to_an_exercise():
    """So the policy covers it: its master is found (a new exercise, e.g. frameworks, included)."""
    masters = grading.masters()
    for info in pkgutil.iter_modules(dtlib.grading.checks.__path__):
        importlib.import_module(f"dtlib.grading.checks.{info.name}")
        assert hint_policy.master_of(info.name, masters) is not None, info.name
