"""Lesson 5's graded checks accept correct f, g and a column-then-row MLP (written here by hand,
not taken from dtlib.parallel.tensor) and reject the classic mistakes with a message naming the
cause; the lesson's picture builds and shows the ranks."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dtlib.grading.checks import tensor_parallel as checks


# ---- q1: f and g -------------------------------------------------------------------------------------
class F_(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class G_(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        out = x.clone()
        dist.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad


class FNoReduce(F_):
    @staticmethod
    def backward(ctx, grad):
        return grad


class FAverage(F_):
    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad / dist.get_world_size()


class FReduceForward(F_):  # the all-reduce in the wrong direction
    @staticmethod
    def forward(ctx, x):
        out = x.clone()
        dist.all_reduce(out)
        return out


class GIdentity(G_):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)


class GReduceBackward(G_):
    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


@pytest.mark.parametrize("world_size", [2, 4])
def test_f_and_g_accepts_the_conjugate_pair(world_size):
    checks.check_f_and_g(F_, G_, world_size=world_size)


@pytest.mark.parametrize("f, g, match", [
    (FNoReduce, G_, "the backward of f must all-reduce the input gradient"),
    (FAverage, G_, "f's backward averaged the gradients: sum them"),
    (FReduceForward, G_, "f's forward all-reduced its input"),
    (F_, GIdentity, "g returned its input unchanged: g must all-reduce"),
    (F_, GReduceBackward, "g's backward is not the identity"),
    (F_, int, "g must be a subclass of torch.autograd.Function"),
])
def test_f_and_g_rejects_classic_mistakes(f, g, match):
    with pytest.raises(AssertionError, match=match):
        checks.check_f_and_g(f, g, world_size=2)


# ---- q2: the parallel MLP ------------------------------------------------------------------------------
def parallel_mlp(x, up, down, rank, world_size):
    w1 = up.weight.chunk(world_size, 0)[rank]
    b1 = up.bias.chunk(world_size, 0)[rank]
    w2 = down.weight.chunk(world_size, 1)[rank]
    hidden = F.gelu(F.linear(F_.apply(x), w1, b1))
    return G_.apply(F.linear(hidden, w2)) + down.bias


def bias_before_reduce(x, up, down, rank, world_size):
    w1, b1 = up.weight.chunk(world_size, 0)[rank], up.bias.chunk(world_size, 0)[rank]
    hidden = F.gelu(F.linear(F_.apply(x), w1, b1))
    return G_.apply(F.linear(hidden, down.weight.chunk(world_size, 1)[rank], down.bias))


def without_f(x, up, down, rank, world_size):
    w1, b1 = up.weight.chunk(world_size, 0)[rank], up.bias.chunk(world_size, 0)[rank]
    return G_.apply(F.linear(F.gelu(F.linear(x, w1, b1)), down.weight.chunk(world_size, 1)[rank])) + down.bias


def without_g(x, up, down, rank, world_size):
    w1, b1 = up.weight.chunk(world_size, 0)[rank], up.bias.chunk(world_size, 0)[rank]
    return F.linear(F.gelu(F.linear(F_.apply(x), w1, b1)), down.weight.chunk(world_size, 1)[rank]) + down.bias


def row_split_up(x, up, down, rank, world_size):  # splits the wrong dimension of up
    w1 = up.weight.chunk(world_size, 1)[rank]
    return G_.apply(F.linear(F.gelu(F.linear(F_.apply(x), w1)), down.weight)) + down.bias


@pytest.mark.parametrize("world_size", [2, 4])
def test_parallel_mlp_accepts_column_then_row(world_size):
    checks.check_parallel_mlp(parallel_mlp, world_size=world_size)


@pytest.mark.parametrize("fn, match", [
    (bias_before_reduce, r"off by \(world_size - 1\) x down.bias"),
    (without_f, "enter the parallel region with f"),
    (without_g, "leave the parallel region with g"),
    (row_split_up, r"raised on rank 0: RuntimeError: mat1 and mat2 .* Keep up's output features"),
    (lambda x, up, down, rank, world_size: None, "parallel_mlp returned NoneType"),
])
def test_parallel_mlp_rejects_classic_mistakes(fn, match):
    with pytest.raises(AssertionError, match=match):
        checks.check_parallel_mlp(fn, world_size=2)


def test_column_row_picture_shows_one_block_per_rank():
    from dtlib.viz.tensor import plot_column_row_split
    for tp in (2, 4):
        ax = plot_column_row_split(tp).axes[0]
        labels = [t.get_text() for t in ax.texts]
        assert labels.count("X") == 1 and labels.count("Z") == 1
        assert sorted(t for t in labels if t.startswith("r") and t[1:].isdigit()) \
            == sorted([f"r{r}" for r in range(tp)] * 2)  # each rank: a block of A and one of B
        assert [t.get_text() for t in ax.get_legend().get_texts()] == [f"rank {r}" for r in range(tp)]
    with pytest.raises(ValueError, match="tp must be an integer in 1..8"):
        plot_column_row_split(0)
