"""Communicate every H steps instead of every step: local SGD and DiLoCo, on a process group.

Synchronous data parallelism all-reduces the gradients after *every* backward. Over a slow link
(across data centres, over the internet) that all-reduce dominates. Two schemes talk less:

* **Local SGD** (Stich 2019, "Local SGD Converges Fast and Communicates Little", ICLR; Lin et al.
  2020, "Don't Use Large Mini-Batches, Use Local SGD", ICLR): every rank takes ``H`` optimizer
  steps on its own data, then the *parameters* are averaged. With ``H = 1`` and plain SGD this is
  exactly synchronous data parallelism: all replicas start equal, so
  ``mean_r(p - lr g_r) = p - lr mean_r(g_r)``.
* **DiLoCo** (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of Language
  Models", Algorithm 1): the ``H`` local steps use an *inner* optimizer (AdamW); then each rank's
  *pseudo-gradient* ``delta_r = theta_global - theta_r`` (how far it moved) is averaged, and an
  *outer* optimizer (SGD with Nesterov momentum, lr 0.7, momentum 0.9 in the paper) steps the
  global parameters along it. An outer SGD of learning rate 1 without momentum sets
  ``theta_global <- theta_global - mean_r(theta_global - theta_r) = mean_r(theta_r)``: local SGD.

Both send the model once every ``H`` steps, so ``1/H`` of synchronous DP's bytes (the same
all-reduce, fewer of them). Both hook the inner optimizer's ``step`` like torchft's
``torchft.local_sgd.LocalSGD`` / ``DiLoCo`` (which they are tested against), so a training loop
does not change::

    with DiLoCo(model, inner_opt, outer_opt, sync_every=H) as diloco:
        for x, y in batches:
            loss_fn(model(x), y).backward(); inner_opt.step(); inner_opt.zero_grad()

The inner optimizer's state (AdamW's moments) stays local to each rank, as in the paper.
"""
from __future__ import annotations

from types import TracebackType
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from dtlib.analytic import validate
from dtlib.analytic.comm import bytes_sent_per_rank
from dtlib.parallel.collectives import all_reduce_coalesced

__all__ = ["LocalSGD", "DiLoCo", "average_parameters", "outer_nesterov_step"]


def _world(group: Any) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _average_(tensors: list[torch.Tensor], group: Any) -> int:
    """All-reduce ``tensors`` in place to their mean over the group, as one flat buffer (one
    message, as a bucketed DDP would send); returns the payload's bytes."""
    return all_reduce_coalesced(tensors, group, divisor=_world(group))


@torch.no_grad()
def average_parameters(model: nn.Module, group: Any = None) -> int:
    """Replace every parameter by its mean over the ranks of ``group``; returns the bytes averaged."""
    return _average_([p.data for p in model.parameters()], group)


class _EveryH:
    """What LocalSGD and DiLoCo share: a step counter on the inner optimizer and the traffic."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, sync_every: int,
                 group: Any, on_sync: Callable[[int], None] | None):
        self.model, self.optimizer, self.group, self.on_sync = model, optimizer, group, on_sync
        self.sync_every = validate.integer("sync_every", sync_every, minimum=1)
        self.local_step = 0
        self.syncs = 0
        self.payload_bytes = 0   # bytes handed to all_reduce (what each rank holds and sends)
        self.bytes_sent = 0.0    # bytes each rank puts on the wire with a ring all-reduce
        self._hook: Any = None

    def __enter__(self) -> "_EveryH":
        # after every inner step, as torchft does: the training loop is left untouched
        self._hook = self.optimizer.register_step_post_hook(lambda *_: self._after_step())
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        return False

    def _after_step(self) -> None:
        self.local_step += 1
        if self.local_step >= self.sync_every:
            self.sync()
            self.local_step = 0

    def _count(self, nbytes: int) -> None:
        self.syncs += 1
        self.payload_bytes += nbytes
        self.bytes_sent += float(bytes_sent_per_rank("all_reduce", nbytes, _world(self.group)))
        if self.on_sync is not None:  # e.g. the emulated slow link's sleep for these bytes
            self.on_sync(nbytes)

    def sync(self) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs besides the model and the inner optimizer (saved by the caller,
        per rank: between syncs the replicas differ): the inner steps since the last sync (a
        resume mid-round syncs at the same step as the uninterrupted run) and the traffic
        counters."""
        return {"local_step": self.local_step, "syncs": self.syncs, "payload_bytes": self.payload_bytes,
                "bytes_sent": self.bytes_sent}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (after the model and the inner optimizer are loaded)."""
        missing = sorted({"local_step", "syncs", "payload_bytes", "bytes_sent"} - set(state))
        if missing:
            raise ValueError(f"state is missing {missing}: pass what state_dict() returned")
        self.local_step = validate.integer("local_step", state["local_step"], minimum=0,
                                           maximum=self.sync_every - 1)
        self.syncs, self.payload_bytes, self.bytes_sent = state["syncs"], state["payload_bytes"], state["bytes_sent"]


class LocalSGD(_EveryH):
    """Average the parameters every ``sync_every`` optimizer steps (Stich 2019; Lin et al. 2020).

    Use as a context manager around the training loop (the average runs inside
    ``optimizer.step()``), or call :meth:`sync` yourself. ``syncs``, ``payload_bytes`` and
    ``bytes_sent`` (ring all-reduce, per rank) count the traffic; ``on_sync(nbytes)``, if given,
    runs after every all-reduce (the lesson sleeps there to emulate a slow link).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, sync_every: int,
                 group: Any = None, on_sync: Callable[[int], None] | None = None):
        super().__init__(model, optimizer, sync_every, group, on_sync)

    def __enter__(self) -> "LocalSGD":
        super().__enter__()
        return self

    def sync(self) -> None:
        self._count(average_parameters(self.model, self.group))


@torch.no_grad()
def outer_nesterov_step(params: list[torch.Tensor], global_params: list[torch.Tensor],
                        momentum_buffers: list[torch.Tensor], lr: float, momentum: float,
                        group: Any = None) -> int:
    """DiLoCo's outer step written out (Douillard et al. 2023, Algorithm 1, lines 8-12).

    ``params``: this rank's parameters after its H inner steps; ``global_params``: the parameters
    every rank started the round from (updated in place); ``momentum_buffers``: the outer
    optimizer's state (zeros at first, updated in place). Equal to ``torch.optim.SGD(lr,
    momentum, nesterov=True)`` stepping on the averaged pseudo-gradient. Returns the bytes averaged.
    """
    lr = validate.number("lr", lr)
    momentum = validate.number("momentum", momentum, minimum=0, exclusive=False, maximum=1)
    deltas = [g - p for p, g in zip(params, global_params)]   # pseudo-gradient: how far we moved
    nbytes = _average_(deltas, group)                          # the only communication of a round
    for p, g, buf, d in zip(params, global_params, momentum_buffers, deltas):
        buf.mul_(momentum).add_(d)            # b <- mu b + delta           (torch.optim.SGD's buffer)
        g.sub_(lr * (d + momentum * buf))     # Nesterov: look ahead along the new momentum
        p.copy_(g)                            # every rank starts the next round from the same point
    return nbytes


class DiLoCo(_EveryH):
    """DiLoCo (Douillard et al. 2023, Algorithm 1): ``sync_every`` inner steps of
    ``inner_optimizer`` on each rank, then ``outer_optimizer`` (built on ``model.parameters()``,
    e.g. ``SGD(lr=0.7, momentum=0.9, nesterov=True)``) steps the global parameters along the
    averaged pseudo-gradient ``theta_global - theta_rank``.

    The parameters are broadcast from rank 0 at construction, so every rank starts from the same
    global copy (as DDP does). Counters as :class:`LocalSGD`.

    Checkpoints: :meth:`state_dict` adds the global parameters (the anchor every rank's
    pseudo-gradient is measured from) and the outer optimizer's state (Nesterov's momentum) to
    the step counter. A resume rebuilds the model, the optimizers and ``DiLoCo`` (whose
    construction broadcasts rank 0's parameters), then loads each rank's own model and inner
    optimizer state and :meth:`load_state_dict`: mid-round it goes on bit for bit (without it the
    anchor would be rank 0's drifted parameters).
    """

    def __init__(self, model: nn.Module, inner_optimizer: torch.optim.Optimizer,
                 outer_optimizer: torch.optim.Optimizer, sync_every: int, group: Any = None,
                 on_sync: Callable[[int], None] | None = None):
        super().__init__(model, inner_optimizer, sync_every, group, on_sync)
        self.outer_optimizer = outer_optimizer
        with torch.no_grad():
            if _world(group) > 1:
                for p in model.parameters():
                    dist.broadcast(p.data, src=dist.get_global_rank(group, 0) if group else 0,
                                   group=group)
            # the global parameters live apart from the model (torchft keeps them on the CPU)
            self.global_params = [p.detach().clone() for p in model.parameters()]

    def __enter__(self) -> "DiLoCo":
        super().__enter__()
        return self

    def state_dict(self) -> dict[str, Any]:
        """The step counter and traffic (as :class:`LocalSGD`'s), ``global_params`` (the anchor, in
        ``model.parameters()`` order) and ``outer_optimizer``'s state dict; tensors are references,
        as ``nn.Module.state_dict`` returns (``torch.save`` or ``copy.deepcopy`` them)."""
        return {**super().state_dict(), "global_params": list(self.global_params),
                "outer_optimizer": self.outer_optimizer.state_dict()}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` after the rebuilt model and inner optimizer are loaded: the
        anchor the constructor took from rank 0's parameters is replaced by the saved one."""
        anchor = state.get("global_params")
        if anchor is None or "outer_optimizer" not in state:
            raise ValueError("state is missing 'global_params' or 'outer_optimizer': pass what "
                             "DiLoCo.state_dict() returned")
        if len(anchor) != len(self.global_params) or any(a.shape != g.shape for a, g in zip(anchor, self.global_params)):
            raise ValueError(f"global_params holds {[tuple(a.shape) for a in anchor][:4]}..., this model's parameters "
                             f"are {[tuple(g.shape) for g in self.global_params][:4]}...: another model")
        super().load_state_dict(state)
        for g, a in zip(self.global_params, anchor):
            g.copy_(a)
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])

    @torch.no_grad()
    def sync(self) -> None:
        params = list(self.model.parameters())
        deltas = [g - p.data for p, g in zip(params, self.global_params)]
        self._count(_average_(deltas, self.group))
        # go back to the global parameters and let the outer optimizer step them along the mean
        # pseudo-gradient, used as a gradient (it points from where we went back to where we were)
        for p, g, d in zip(params, self.global_params, deltas):
            p.data.copy_(g)
            p.grad = d
        self.outer_optimizer.step()
        self.outer_optimizer.zero_grad(set_to_none=True)
        for p, g in zip(params, self.global_params):
            g.copy_(p.data)
