"""The shape every framework run shares, and the comparison the side-by-side tests rely on."""
import numpy as np
import pytest

from dtlib.frameworks.common import FrameworkRun, compare, token_batches


def _run(name, losses, w):
    return FrameworkRun(name, "dp2", losses, {"w": np.asarray(w, dtype=np.float64)})


def test_compare_reports_the_largest_loss_and_parameter_difference():
    got = compare(_run("a", [1.0, 0.5], [1.0, 2.0, 3.0]), _run("b", [1.0, 0.25], [1.0, 2.5, 3.0]))
    assert got == {"max_loss_diff": 0.25, "max_param_diff": 0.5}


@pytest.mark.parametrize("change, message", [
    (lambda r: r.losses.append(0.1), "ran 3 steps"),
    (lambda r: r.params.pop("w"), "missing \\['w'\\]"),
    (lambda r: r.params.__setitem__("w", np.ones(4)), "shape"),
])
def test_compare_refuses_runs_that_are_not_comparable(change, message):
    run = _run("a", [1.0, 0.5], [1.0, 2.0, 3.0])
    change(run)
    with pytest.raises(ValueError, match=message):
        compare(run, _run("b", [1.0, 0.5], [1.0, 2.0, 3.0]))


def test_token_batches_are_the_same_for_every_caller_and_in_range():
    a = token_batches(3, 4, 8, vocab=50, seed=1)
    assert a.shape == (3, 4, 9) and a.min() >= 0 and a.max() < 50
    assert np.array_equal(a, token_batches(3, 4, 8, vocab=50, seed=1))
    assert not np.array_equal(a, token_batches(3, 4, 8, vocab=50, seed=2))


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_token_batches_name_the_bad_argument(bad):
    with pytest.raises(ValueError, match="global_batch must be a positive integer"):
        token_batches(2, bad, 8, vocab=50)
