"""The rank grid: which rank holds which piece of the model, and who talks to whom.

A layout of ``dp x tp x pp x cp`` ranks numbers them as Megatron-LM does
(``megatron/core/parallel_state.py``, ``RankGenerator`` with the default ``order="tp-cp-ep-dp-pp"``):
the tensor-parallel index varies fastest, then context, then data, and the pipeline stage is
outermost::

    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

so the ranks of one TP group are consecutive and share a node (TP talks at every layer, it needs
NVLink), while the PP groups, which send one activation per micro-batch, span the most distance.

Expert parallelism is *carved out* of the ``dp x cp`` ranks of a stage, as Megatron-core's second
``RankGenerator`` does (``expert_decoder_rank_generator``: ``tp=expert_tp, ep=ep,
dp=world/(tp*ep*pp), cp=1``): in the MoE layers, the same ranks are seen as ``ep`` (faster) x
``edp`` (expert-data-parallel replicas of one expert shard). Attention runs over CP and DP, the
experts over EP and EDP, on the same GPUs.

:class:`ParallelLayout` is pure (``coordinates`` and ``groups`` need no process);
:func:`build_groups` is the one place that turns it into ``torch.distributed`` process groups.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dtlib.analytic import validate

__all__ = ["ParallelLayout", "AXES", "ProcessGroups", "build_groups", "check_partition"]

# every group kind a layout defines, fastest-varying axis first; "dp_cp" is Megatron's
# data-parallel group *with* context parallelism (the ranks that all-reduce dense gradients),
# "edp" the expert-data-parallel group (ranks holding the same experts)
AXES = ("tp", "cp", "dp", "pp", "dp_cp", "ep", "edp")


@dataclass(frozen=True)
class ParallelLayout:
    """Data (dp), tensor (tp), pipeline (pp), context (cp) and expert (ep) parallel sizes.

    ``dp * tp * pp * cp`` is the world size; ``ep`` divides ``dp * cp`` (Megatron-core carves the
    expert-parallel ranks out of the data- and context-parallel ones, so it adds no rank).
    """
    dp: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "cp", "ep"):
            validate.integer(name, getattr(self, name))
        if (self.dp * self.cp) % self.ep:
            replicas = self.dp * self.cp
            raise ValueError(f"expert parallel size ep={self.ep} must divide dp x cp = {replicas} "
                             f"(experts are sharded over the data- and context-parallel ranks); "
                             f"valid ep: {validate.divisors(replicas)}")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def edp(self) -> int:
        """Expert-data-parallel size: replicas of each expert shard (Megatron-core's
        ``expert_data_parallel_size = world / (expert_tp * ep * pp)``, with expert_tp = tp)."""
        return self.dp * self.cp // self.ep

    def validate(self, world_size: int) -> "ParallelLayout":
        """Raise a one-line ValueError unless the layout fills exactly ``world_size`` ranks."""
        validate.integer("world_size", world_size)
        if self.world_size != world_size:
            model_parallel = self.tp * self.pp * self.cp
            hint = (f"dp = {world_size // model_parallel}" if world_size % model_parallel == 0
                    else f"a world size that is a multiple of tp x pp x cp = {model_parallel}")
            raise ValueError(f"dp x tp x pp x cp = {self.dp}x{self.tp}x{self.pp}x{self.cp} = "
                             f"{self.world_size} but the world size is {world_size}; use {hint}")
        return self

    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in 0..{self.world_size - 1}, got {rank!r}")

    def coordinates(self, rank: int) -> dict[str, int]:
        """``{"tp", "cp", "dp", "pp", "ep", "edp"}`` indices of ``rank`` (pure arithmetic)."""
        self._check_rank(rank)
        tp_rank, rest = rank % self.tp, rank // self.tp
        cp_rank, rest = rest % self.cp, rest // self.cp
        dp_rank, pp_rank = rest % self.dp, rest // self.dp
        # the expert view renumbers the dp x cp ranks of a stage, ep fastest (Megatron-core)
        replica = cp_rank + self.cp * dp_rank
        return {"tp": tp_rank, "cp": cp_rank, "dp": dp_rank, "pp": pp_rank,
                "ep": replica % self.ep, "edp": replica // self.ep}

    def rank(self, tp: int = 0, cp: int = 0, dp: int = 0, pp: int = 0) -> int:
        """The rank at the given coordinates (the inverse of :meth:`coordinates`)."""
        for name, value, size in (("tp", tp, self.tp), ("cp", cp, self.cp), ("dp", dp, self.dp),
                                  ("pp", pp, self.pp)):
            if not 0 <= value < size:
                raise ValueError(f"{name} coordinate must be in 0..{size - 1}, got {value}")
        return tp + self.tp * (cp + self.cp * (dp + self.dp * pp))

    @property
    def groups(self) -> dict[str, list[list[int]]]:
        """For each kind in :data:`AXES`, the list of groups (each a sorted list of ranks): ranks
        that differ only in that coordinate (``dp_cp``: in dp and cp; ``ep``/``edp``: in the expert
        view of dp x cp)."""
        keys = {
            "tp": ("cp", "dp", "pp"), "cp": ("tp", "dp", "pp"), "dp": ("tp", "cp", "pp"),
            "pp": ("tp", "cp", "dp"), "dp_cp": ("tp", "pp"),
            "ep": ("tp", "pp", "edp"), "edp": ("tp", "pp", "ep"),
        }
        out: dict[str, list[list[int]]] = {}
        coords = [self.coordinates(r) for r in range(self.world_size)]
        for kind, fixed in keys.items():
            by_key: dict[tuple[int, ...], list[int]] = {}
            for r, c in enumerate(coords):
                by_key.setdefault(tuple(c[f] for f in fixed), []).append(r)
            out[kind] = sorted(by_key.values())
        return out

    def groups_of(self, rank: int) -> dict[str, list[int]]:
        """The ranks of each group kind that ``rank`` belongs to."""
        self._check_rank(rank)
        return {kind: next(g for g in gs if rank in g) for kind, gs in self.groups.items()}

    def describe(self) -> str:
        return f"dp{self.dp} x tp{self.tp} x pp{self.pp} x cp{self.cp}" + (f" (ep{self.ep})" if self.ep > 1 else "")


@dataclass
class ProcessGroups:
    """This rank's process group for each kind in :data:`AXES` (``None`` where the group is the
    rank alone), the layout and this rank's coordinates."""
    layout: ParallelLayout
    rank: int
    coords: dict[str, int]
    ranks: dict[str, list[int]]
    handles: dict[str, Any]

    def __getitem__(self, kind: str) -> Any:
        return self.handles[kind]

    def size(self, kind: str) -> int:
        return len(self.ranks[kind])


def check_partition(kind: str, groups: list[list[int]], world_size: int, size: int) -> None:
    """Raise a one-line ValueError unless ``groups`` splits ranks 0..world_size-1 into groups of
    ``size`` ranks, each rank in exactly one."""
    flat = sorted(r for g in groups for r in g)
    if flat != list(range(world_size)):
        raise ValueError(f"the {kind} groups {groups} must hold every rank 0..{world_size - 1} exactly once")
    if any(len(g) != size for g in groups):
        raise ValueError(f"the {kind} groups {groups} must each hold {kind}={size} ranks")


def build_groups(layout: ParallelLayout, rank: int | None = None, backend: str | None = None,
                 override: dict[str, list[list[int]]] | None = None) -> ProcessGroups:
    """Create every group of ``layout`` with ``dist.new_group`` (a collective: every rank calls it
    for every group, in the same order, as Megatron's ``initialize_model_parallel`` does) and keep
    the ones ``rank`` belongs to. Groups of one rank become ``None`` so callers can skip them.
    ``override`` replaces some kinds' groups (e.g. groups a learner computed), checked to
    partition the ranks."""
    import torch.distributed as dist

    if rank is None:
        rank = dist.get_rank()
    layout.validate(dist.get_world_size())
    all_groups = dict(layout.groups)
    for kind, groups in (override or {}).items():
        if kind not in all_groups:
            raise ValueError(f"unknown group kind {kind!r}; valid: {', '.join(AXES)}")
        check_partition(kind, groups, layout.world_size, len(all_groups[kind][0]))
        all_groups[kind] = sorted(sorted(g) for g in groups)
    handles: dict[str, Any] = {}
    ranks: dict[str, list[int]] = {}
    for kind, kind_groups in all_groups.items():
        for members in kind_groups:
            group = dist.new_group(members, backend=backend) if len(members) > 1 else None
            if rank in members:
                handles[kind], ranks[kind] = group, members
    return ProcessGroups(layout, rank, layout.coordinates(rank), ranks, handles)
