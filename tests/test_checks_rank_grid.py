"""The 3D-parallelism exercise's checks accept Megatron-LM's order and reject the classic mistakes
with a message naming the cause."""
import pytest

from dtlib.grading.checks import rank_grid as checks


def coordinates(rank, dp, tp, pp):
    return (rank // tp) % dp, rank % tp, rank // (tp * dp)


def groups(dp, tp, pp):
    ranks = range(dp * tp * pp)
    out = {"tp": {}, "dp": {}, "pp": {}}
    for r in ranks:
        d, t, p = coordinates(r, dp, tp, pp)
        out["tp"].setdefault((d, p), []).append(r)
        out["dp"].setdefault((t, p), []).append(r)
        out["pp"].setdefault((t, d), []).append(r)
    return {k: list(v.values()) for k, v in out.items()}


def test_coordinates_accepts_megatron_order():
    checks.check_coordinates(coordinates)


@pytest.mark.parametrize("wrong, message", [
    (lambda r, dp, tp, pp: (r % dp, (r // dp) % tp, r // (tp * dp)), "tp_rank is wrong"),  # dp fastest
    (lambda r, dp, tp, pp: ((r // tp) % dp, r % tp, (r // tp) % pp), "pp_rank is wrong; the pipeline stage is outermost"),
    (lambda r, dp, tp, pp: (r // (tp * pp), r % tp, (r // tp) % pp), "pp_rank is wrong"),  # pp before dp
    (lambda r, dp, tp, pp: (r // (tp * pp), r % tp, r // (tp * dp)), "dp_rank is wrong"),
    (lambda r, dp, tp, pp: None, "returned None"),
    (lambda r, dp, tp, pp: (r % tp, r // tp), "return three numbers"),
])
def test_coordinates_rejects_mistakes(wrong, message):
    with pytest.raises(AssertionError, match=message):
        checks.check_coordinates(wrong)


def test_groups_accepts_megatron_order():
    checks.check_groups(groups, train=False)


@pytest.mark.parametrize("wrong, message", [
    (lambda dp, tp, pp: {**groups(dp, tp, pp), "tp": groups(dp, tp, pp)["dp"]}, "your tp groups"),
    (lambda dp, tp, pp: {k: v for k, v in groups(dp, tp, pp).items() if k != "pp"}, 'no "pp" entry'),
    (lambda dp, tp, pp: [], "return a dict"),
    (lambda dp, tp, pp: {**groups(dp, tp, pp), "dp": [list(range(dp * tp * pp))]}, "your dp groups"),
])
def test_groups_rejects_mistakes(wrong, message):
    with pytest.raises(AssertionError, match=message):
        checks.check_groups(wrong, train=False)


def test_training_with_the_learners_groups():
    got = checks.train_with_groups(groups)
    assert len(got["losses"]) == 2
    # groups that partition the ranks but swap TP and DP: training no longer equals one process
    with pytest.raises(AssertionError, match="differ from one process|failed on rank"):
        checks.train_with_groups(lambda dp, tp, pp: {**groups(dp, tp, pp), "tp": groups(dp, tp, pp)["dp"],
                                                     "dp": groups(dp, tp, pp)["tp"]})


def test_groups_built_on_wrong_coordinates_say_fix_q1_first():
    """Issue 28, item 9: Q2's hint blamed the tp groups when the mistake was Q1's coordinate order."""
    def dp_fastest(r, dp, tp, pp):
        return r % dp, (r // dp) % tp, r // (tp * dp)

    def groups_from(coords):
        def fn(dp, tp, pp):
            out = {"tp": {}, "dp": {}, "pp": {}}
            for r in range(dp * tp * pp):
                d, t, p = coords(r, dp, tp, pp)
                out["tp"].setdefault((d, p), []).append(r)
                out["dp"].setdefault((t, p), []).append(r)
                out["pp"].setdefault((t, d), []).append(r)
            return {k: list(v.values()) for k, v in out.items()}
        return fn

    for train in (False, True):
        with pytest.raises(AssertionError) as info:
            checks.check_groups(groups_from(dp_fastest), dp_fastest, train=train)
        assert str(info.value).startswith("your groups are wrong, and so is coordinates (Q1)")
        assert "fix Q1 first" in str(info.value) and "your tp groups" not in str(info.value)
    # right groups pass even if the learner's coordinates are wrong (they did not use them)
    checks.check_groups(groups, dp_fastest, train=False)
    # with Q1 right, a wrong group is still named
    with pytest.raises(AssertionError, match="your tp groups"):
        checks.check_groups(lambda dp, tp, pp: {**groups(dp, tp, pp), "tp": groups(dp, tp, pp)["dp"]},
                            coordinates, train=False)
