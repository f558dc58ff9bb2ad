"""Lesson 12's graded checks: the reference assignment and placement pass; the classic mistakes fail
with the message that names them."""
import pytest

from dtlib.grading.checks import data_cluster as checks


def positions(consumed, global_batch, rank, world_size):
    per = global_batch // world_size
    return list(range(consumed + rank * per, consumed + (rank + 1) * per))


def strided(consumed, global_batch, rank, world_size):  # also exact: any partition of the next batch
    return list(range(consumed + rank, consumed + global_batch, world_size))


def ignores_consumed(consumed, global_batch, rank, world_size):
    per = global_batch // world_size
    return list(range(rank * per, (rank + 1) * per))


def four_ranks_forever(consumed, global_batch, rank, world_size):
    per = global_batch // 4
    return list(range(consumed + rank * per, consumed + (rank + 1) * per))


def overlapping(consumed, global_batch, rank, world_size):
    per = global_batch // world_size
    return list(range(consumed + rank, consumed + rank + per))


def unfinished(consumed, global_batch, rank, world_size):
    ...  # the exercise's stub: returns None


def test_reference_assignments_pass():
    checks.check_assignment(positions)
    checks.check_assignment(strided)


@pytest.mark.parametrize("wrong, message", [
    (ignores_consumed, "start from consumed"),
    (four_ranks_forever, "never read.*use world_size, not a fixed number of ranks"),
    (overlapping, "read by more than one rank"),
    (unfinished, r"returned None: replace the \.\.\. with your code"),
    (lambda *a: ..., r"returned Ellipsis: replace the \.\.\. with your code"),
])
def test_assignment_mistakes_are_named(wrong, message):
    with pytest.raises(AssertionError, match=message):
        checks.check_assignment(wrong)


def place(rank, dp, tp, pp, gpus_per_node):
    if gpus_per_node % tp:
        raise ValueError(f"tp={tp} does not divide {gpus_per_node} GPUs per node")
    c = checks.job_coordinates(rank, dp, tp, pp)
    return c["tp"] + tp * (c["dp"] + dp * c["pp"])


def identity(rank, dp, tp, pp, gpus_per_node):
    if gpus_per_node % tp:
        raise ValueError("no")
    return rank


def forgets_pp(rank, dp, tp, pp, gpus_per_node):
    if gpus_per_node % tp:
        raise ValueError("no")
    c = checks.job_coordinates(rank, dp, tp, pp)
    return c["tp"] + tp * c["dp"]


def never_raises(rank, dp, tp, pp, gpus_per_node):
    c = checks.job_coordinates(rank, dp, tp, pp)
    return c["tp"] + tp * (c["dp"] + dp * c["pp"])


def test_reference_placement_passes():
    checks.check_placement(place)


@pytest.mark.parametrize("wrong, message", [
    (identity, "the TP group of ranks .* sits on nodes"),
    (forgets_pp, "two ranks on GPU"),
    (never_raises, "raise ValueError when tp does not divide gpus_per_node"),
    (lambda *a: ..., r"place returned Ellipsis: replace"),
    (lambda *a: None, r"place returned None: replace"),
])
def test_placement_mistakes_are_named(wrong, message):
    with pytest.raises(AssertionError, match=message):
        checks.check_placement(wrong)


def test_a_raising_answer_is_reported():
    def broken(*args):
        raise KeyError("oops")
    with pytest.raises(AssertionError, match="raised KeyError"):
        checks.check_assignment(broken)
