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
    (lambda r, dp, tp, pp: (r % dp, (r // dp) % tp, r // (tp * dp)), "tp_rank = rank % tp"),  # dp fastest
    (lambda r, dp, tp, pp: ((r // tp) % dp, r % tp, (r // tp) % pp), "pp_rank = rank // \\(tp \\* dp\\)"),
    (lambda r, dp, tp, pp: (r // (tp * pp), r % tp, (r // tp) % pp), "pp_rank = rank"),  # pp before dp
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
