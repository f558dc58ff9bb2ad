"""How a training run is laid out on GPUs, and the rules that make a layout possible.

:class:`Parallelism` gathers the knobs shared by :mod:`dtlib.analytic.memory`, :mod:`dtlib.analytic.flops` and
:mod:`dtlib.analytic.comm`. The validity rules live once, in :data:`RULES`: each is a vectorisable predicate
plus a message saying what is wrong and what would be valid. The scalar path raises the first broken
rule; :mod:`dtlib.analytic.vectorised` evaluates the same predicates on arrays.

About 550 lines: the layout and its rules are one concept; the rules are data the scalar and the
vectorised paths both read, so splitting them off would leave the dataclass without its checks.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from typing import Any

import numpy as np

from dtlib.analytic import validate
from dtlib.analytic.activations import check_recompute_modules
from dtlib.analytic.config import SHAPE_RULES
from dtlib.analytic.pipeline_layout import PipelineLayout, check_alone, layout_numbers

__all__ = ["Parallelism", "fsdp", "FSDP_STRATEGIES", "SCHEDULES", "RECOMPUTE", "RECOMPUTE_OPTIONS", "OFFLOAD",
           "RULES", "check_layout", "broken_rules", "check_pipeline", "stage_layers", "in_flight", "chunks_per_rank",
           "megatron_split", "split_problem", "pipeline_split"]

SCHEDULES = ("gpipe", "1f1b", "interleaved", "dualpipe", "dualpipev")
# what the search tries; "op" (torchtitan's per-op selective checkpointing, dtlib.analytic.activations)
# is a layout one can give, not one the planner proposes
RECOMPUTE = ("none", "selective", "full")
RECOMPUTE_OPTIONS = RECOMPUTE + ("op",)
OFFLOAD = ("none", "optimizer", "params")


@dataclass(frozen=True)
class Parallelism:
    """A layout: data (dp), tensor (tp), pipeline (pp), context (cp) and expert (ep) parallel sizes,
    ZeRO stage, sequence parallelism, pipeline schedule, batch split and recompute/offload choices.

    ``micro_batch_size`` is sequences per micro-batch per model replica; ``num_microbatches`` is micro-batches
    per step (pipeline micro-batches, or gradient-accumulation steps when ``pp == 1``).
    ``shard_size`` (default: all ``dp*cp`` replicas) shards ZeRO/FSDP state over fewer ranks, as
    FSDP's HYBRID_SHARD does within a node. ``ep`` is carved out of ``tp x cp x dp`` (Megatron-Core's
    MoE parallel folding), not only out of ``dp`` as in DeepSpeed-MoE.
    ``etp`` splits each expert's matrices (Megatron-Core ``--expert-tensor-parallel-size``; its
    expert grid etp x ep x expert-dp spans the same ranks as tp x cp x dp, so etp x ep must divide
    them: ``parallel_state.initialize_model_parallel``). Default 1: experts are not tensor-split
    (Megatron-Core's own default is etp = tp; today's MoE recipes set 1).

    ``recompute_layers`` (Megatron-LM ``--recompute-method block --recompute-num-layers N``,
    ``TransformerBlock._checkpointed_forward``): the first N layers of every model chunk (a
    pipeline stage, or each of its ``virtual_stages`` chunks) are fully recomputed and keep only
    their input; the others store what ``recompute`` says (``none``, ``selective`` or ``op``).
    None or 0: no layer fully recomputed; N >= the chunk's layers: ``recompute="full"``.
    ``account_for_embedding_and_loss`` (Megatron-LM ``--account-for-embedding-in-pipeline-split
    --account-for-loss-in-pipeline-split``; Llama 3 paper, Sec. 3.3.2): the embedding and the loss
    each take one layer's slot, so the first and the last model chunk hold one layer fewer.
    ``activation_offload_layers`` (Megatron-Core ``--cpu-offloading --cpu-offloading-num-layers N``,
    Transformer Engine ``get_cpu_offload_context``; DeepSpeed ``activation_checkpointing.
    cpu_checkpointing`` offloads every layer's checkpoint): the activations N layers of each chunk
    keep move to CPU memory, and one layer's are on the GPU again while its backward runs.
    ``first_stage_layers`` / ``last_stage_layers`` (Megatron-LM ``--decoder-first-pipeline-num-layers``
    / ``--decoder-last-pipeline-num-layers``, Megatron-Core ``num_layers_in_first/last_pipeline_stage``):
    an uneven split, the layers of the first / last pipeline rank (all its chunks), the other ranks
    sharing the rest evenly; None: Megatron's even split. ``pipeline_layout`` (Megatron-LM
    ``--pipeline-model-parallel-layout``, a string naming every chunk's layers,
    :func:`dtlib.analytic.stages.megatron_layout_string`): the layers (and, when
    ``account_for_embedding_and_loss``, the embedding and the loss) spread over the pp x
    virtual_stages chunks as evenly as they go, the earlier chunks taking the remainder; any number
    of chunks up to the layers; or the string itself (``"Et*3|(tt|)*29m|L"``,
    :mod:`dtlib.analytic.pipeline_layout`): every chunk as it names it, ``virtual_stages`` = its chunks /
    pp, checked against the model's layers and MTP layers by :meth:`check_model`.
    :func:`megatron_split` picks the first/last counts,
    :func:`split_problem` says which splits Megatron accepts.
    ``recompute_modules`` (Megatron-Core ``--recompute-granularity selective --recompute-modules``,
    :data:`~dtlib.analytic.activations.RECOMPUTE_MODULES`): the submodules whose stored tensors the
    layers not fully recomputed drop and rebuild in backward
    (:func:`~dtlib.analytic.activations.recompute_module_bytes`); with ``recompute`` ``none`` or
    ``selective`` only.
    """
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    zero: int = 0
    sequence_parallel: bool = False
    schedule: str = "1f1b"
    virtual_stages: int = 1
    micro_batch_size: int = 1
    num_microbatches: int = 1
    recompute: str = "none"
    offload: str = "none"
    shard_size: int | None = None
    recompute_layers: int | None = None
    account_for_embedding_and_loss: bool = False
    activation_offload_layers: int | None = None
    recompute_modules: tuple[str, ...] = ()
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    pipeline_layout: bool | str = False

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "cp", "ep", "etp", "virtual_stages", "micro_batch_size", "num_microbatches"):
            validate.integer(name, getattr(self, name))
        validate.integer("zero", self.zero, minimum=0, maximum=3)
        if self.shard_size is not None:
            validate.integer("shard_size", self.shard_size)
        validate.boolean("sequence_parallel", self.sequence_parallel)
        validate.boolean("account_for_embedding_and_loss", self.account_for_embedding_and_loss)
        if isinstance(self.pipeline_layout, str):
            self._check_explicit_layout()
        else:
            validate.boolean("pipeline_layout", self.pipeline_layout)
        for name, valid in (("schedule", SCHEDULES), ("recompute", RECOMPUTE_OPTIONS), ("offload", OFFLOAD)):
            validate.one_of(name, getattr(self, name), valid)
        for name in ("first_stage_layers", "last_stage_layers"):
            if getattr(self, name) is not None:
                validate.integer(name, getattr(self, name))
        if self.activation_offload_layers is not None:
            validate.integer("activation_offload_layers", self.activation_offload_layers, minimum=0)
        if self.recompute_layers is not None:
            validate.integer("recompute_layers", self.recompute_layers, minimum=0)
            if self.recompute == "full":
                raise ValueError(f"recompute_layers={self.recompute_layers} recomputes part of the layers, "
                                 f"but recompute='full' recomputes all of them; give recompute 'none', "
                                 f"'selective' or 'op' for the other layers")
        object.__setattr__(self, "recompute_modules", check_recompute_modules(self.recompute_modules, self.recompute))
        check_layout(self.numbers(), self.schedule, self.offload, self.account_for_embedding_and_loss)

    def _check_explicit_layout(self) -> None:
        """A layout string fixes the chunks: ``virtual_stages`` = chunks / pp, and no other split flag
        (Megatron-Core ``TransformerConfig.__post_init__``)."""
        v = self.explicit_layout.virtual_stages(self.pp)
        if self.virtual_stages != v:
            raise validate.InvalidArgument(
                "virtual_stages", f"{v} (the pipeline layout's {v * self.pp} chunks / pp {self.pp})", self.virtual_stages)
        check_alone(first_stage_layers=self.first_stage_layers, last_stage_layers=self.last_stage_layers,
                    account_for_embedding_and_loss=self.account_for_embedding_and_loss)

    @property
    def explicit_layout(self) -> "PipelineLayout | None":
        """The parsed layout string (:mod:`dtlib.analytic.pipeline_layout`), None without one."""
        return PipelineLayout(self.pipeline_layout) if isinstance(self.pipeline_layout, str) else None

    def check_model(self, model: Any) -> None:
        """A layout string names the model's layers and MTP layers (``model``: a TransformerConfig)."""
        if self.explicit_layout is not None:
            self.explicit_layout.check(self.pp, model.layers, getattr(model, "mtp_layers", 0))

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def sharded_over(self) -> int:
        """Ranks ZeRO/FSDP shard over: ``shard_size``, or all ``dp*cp`` replicas by default."""
        return self.dp * self.cp if self.shard_size is None else self.shard_size

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step."""
        return self.dp * self.micro_batch_size * self.num_microbatches

    def numbers(self, **extra: Any) -> dict[str, Any]:
        """The numeric fields (what the formulas and :data:`RULES` read), plus ``extra``."""
        d = {k: v for k, v in asdict(self).items() if k not in _OPTIONS}
        d["sequence_parallel"] = bool(self.sequence_parallel)
        d["shard_size"] = self.sharded_over
        # 0: not set (Megatron's None), so the rules and formulas read plain integers
        d["first_stage_layers"] = self.first_stage_layers or 0
        d["last_stage_layers"] = self.last_stage_layers or 0
        # 0: Megatron's split flags, 1: a layout string spreading the layers, 2: one given explicitly
        d["pipeline_layout"] = 2 if isinstance(self.pipeline_layout, str) else int(self.pipeline_layout)
        d.update(layout_numbers(self.explicit_layout))
        d.update(extra)
        return d

    def with_(self, **changes: Any) -> "Parallelism":
        return replace(self, **changes)


# categorical options, passed to the formulas as scalars (not in Parallelism.numbers())
_OPTIONS = ("schedule", "recompute", "offload", "recompute_layers", "account_for_embedding_and_loss",
            "activation_offload_layers", "recompute_modules")


# PyTorch FSDP ShardingStrategy -> (ZeRO stage, hybrid?) (torch.distributed.fsdp docs; Zhao et al.
# 2023, "PyTorch FSDP", Sec. 3.2): hybrid strategies shard within a group and replicate across groups.
FSDP_STRATEGIES = {"FULL_SHARD": (3, False), "SHARD_GRAD_OP": (2, False), "NO_SHARD": (0, False),
                   "HYBRID_SHARD": (3, True), "_HYBRID_SHARD_ZERO2": (2, True)}


def fsdp(strategy: str, dp: int, shard_size: int | None = None, **layout: Any) -> Parallelism:
    """The :class:`Parallelism` of an FSDP sharding strategy over ``dp`` ranks; hybrid strategies
    shard within ``shard_size`` ranks (typically the GPUs of a node)."""
    key = strategy.upper()
    if key not in FSDP_STRATEGIES:
        raise ValueError(f"unknown FSDP strategy {strategy!r}; valid: {', '.join(FSDP_STRATEGIES)}")
    zero, hybrid = FSDP_STRATEGIES[key]
    if hybrid and shard_size is None:
        raise ValueError(f"{key} shards within a group: give shard_size (e.g. GPUs per node)")
    return Parallelism(dp=dp, zero=zero, shard_size=shard_size if hybrid else None, **layout)


Rule = validate.Rule

# Megatron-LM's pipeline split, core_v0.16.1: without uneven stages the layers (+1 for the
# embedding, +1 for the loss with --account-for-*-in-pipeline-split) split evenly over pp ranks and
# each rank's share over its virtual_stages chunks (``validate_args`` in
# ``megatron/training/arguments.py``; ``get_num_layers_to_build`` in
# ``megatron/core/transformer/transformer_block.py``). With --decoder-first/last-pipeline-num-layers
# (``TransformerConfig.__post_init__``, "Uneven PP"): each given count > 0 and a multiple of
# virtual_stages, the middle ranks share the rest evenly, in a multiple of virtual_stages each, and
# there are middle layers exactly when there are middle ranks; never with --account-for-*. Llama 3
# 405B's 126 layers + 2 in 16 x 8 one-layer chunks: the first chunk holds the embedding alone (Sec. 3.3.2).
# With --pipeline-model-parallel-layout any chunk may hold any layers (``PipelineParallelLayerLayout.
# validate_layer_layout`` checks only that every layer, the embedding first and the loss last, is
# named once), and no other split flag may be given (``TransformerConfig.__post_init__``).
_SPLIT_FIELDS = ("layers", "pp", "virtual_stages", "first_stage_layers", "last_stage_layers", "pipeline_layout")


def _split_valid(layers, pp, virtual_stages, first_stage_layers, last_stage_layers, pipeline_layout=0,
                 balanced=False):
    """Vectorised: Megatron-LM accepts this pipeline split (0: first/last stage layers not given;
    ``pipeline_layout``: placed by a layout string, every chunk holding a layer or the embedding/loss)."""
    first, last, v = np.asarray(first_stage_layers), np.asarray(last_stage_layers), np.asarray(virtual_stages)
    even = (layers + 2 * bool(balanced)) % (pp * v) == 0
    middle_ranks = pp - (first > 0) - (last > 0)
    middle = layers - first - last
    middle_ok = np.where(middle_ranks > 0, (middle > 0) & (middle % np.maximum(middle_ranks * v, 1) == 0),
                         middle == 0)
    uneven = (pp >= 2) & (first % v == 0) & (last % v == 0) & middle_ok & (not balanced)
    split = np.where((first > 0) | (last > 0), uneven, even)
    spread = (first == 0) & (last == 0) & (pp * v <= layers + 2 * bool(balanced))
    # 2: an explicit string, checked against the model by PipelineLayout.check
    return np.where(np.asarray(pipeline_layout) == 2, True, np.where(np.asarray(pipeline_layout) > 0, spread, split))


def split_problem(layers: int, pp: int, virtual_stages: int = 1, first_stage_layers: int = 0,
                  last_stage_layers: int = 0, pipeline_layout: int = 0, balanced: bool = False) -> str | None:
    """What Megatron-LM refuses in this pipeline split (one line naming the fields and the valid
    values), or None when it accepts it. 0 or None: first/last stage layers not given."""
    first, last, v = first_stage_layers or 0, last_stage_layers or 0, virtual_stages
    if bool(_split_valid(layers, pp, v, first, last, pipeline_layout, balanced)):
        return None
    given = (f"first_stage_layers={first}, " if first else "") + (f"last_stage_layers={last}, " if last else "")
    if pipeline_layout and (first or last):
        return (f"pipeline_layout (--pipeline-model-parallel-layout) cannot be combined with {given.rstrip(', ')} "
                f"(Megatron-Core TransformerConfig); give one or the other")
    if pipeline_layout:
        return (f"pipeline_layout: pp={pp} x virtual_stages={v} = {pp * v} chunks exceed the {layers} layers"
                f"{' + the embedding and the loss' if balanced else ''}; valid: pp x virtual_stages "
                f"<= {layers + 2 * bool(balanced)}")
    if (first or last) and balanced:
        return (f"{given}an uneven pipeline split, cannot be combined with account_for_embedding_and_loss "
                f"(Megatron-Core TransformerConfig); give one or the other")
    what = "" if first or last else (" + the embedding and the loss" if balanced else "")
    if pp * v > layers + 2 * bool(balanced):
        return (f"pipeline stages pp={pp} x virtual stages {v} exceed the {layers} layers{what}; valid: "
                f"pp x virtual_stages <= {layers + 2 * bool(balanced)} with pipeline_layout, dividing "
                f"{layers + 2 * bool(balanced)} otherwise (Megatron-LM)")
    suggestion = megatron_split(layers, pp, v, balanced)
    hint = ("no even or first/last split of these sizes is valid; valid pp x virtual_stages divide "
            f"{layers + 2 * balanced}, or pipeline_layout=True (a layout string)" if suggestion is None else
            "valid: first_stage_layers={}, last_stage_layers={} (Megatron-LM --decoder-first/last-pipeline-"
            "num-layers; None: not given)".format(*(x or None for x in suggestion)))
    return (f"pipeline split: {given}{layers} layers{what} over pp={pp} x virtual_stages={v} is not a split "
            f"Megatron-LM accepts (even: layers divisible by pp x virtual_stages; uneven: first/last "
            f"stage layers multiples of virtual_stages, the rest even over the middle ranks); {hint}")


@lru_cache(maxsize=4096)
def megatron_split(layers: int, pp: int, virtual_stages: int = 1, balanced: bool = False) -> tuple[int, int] | None:
    """The pipeline split Megatron-LM accepts with the fewest layers on its busiest rank, as
    ``(first_stage_layers, last_stage_layers)``: ``(0, 0)`` when the even split is valid, the
    uneven counts otherwise (0 for one not given: that rank is a middle one), None when no split
    is valid. Ties go to the lighter first and last ranks (they also hold the embedding and the
    LM head with the loss), then the lighter last one."""
    layers, pp, v = int(layers), int(pp), int(virtual_stages)
    if _split_valid(layers, pp, v, 0, 0, 0, balanced):
        return 0, 0
    if balanced or pp < 2:
        return None
    best, choice = None, None
    for first in range(0, layers + 1, v):
        for last in range(0, layers - first + 1, v):
            middle_ranks = pp - (first > 0) - (last > 0)
            middle = layers - first - last
            # _split_valid's uneven rule, in plain integers (this loop runs per (layers, pp, v))
            if not (first or last) or (middle % (middle_ranks * v) or not middle if middle_ranks else middle):
                continue
            k = middle // middle_ranks if middle_ranks else 0
            ends = (first or k, last or k)
            key = (max(k, *ends), max(ends), ends[1], (first > 0) + (last > 0))
            if best is None or key < best:
                best, choice = key, (first, last)
    return choice


@lru_cache(maxsize=4096)
def pipeline_split(layers: int, pp: int, virtual_stages: int = 1, balanced: bool = False) -> dict[str, int] | None:
    """The split the planner gives a layout (:class:`Parallelism`'s ``first_stage_layers``,
    ``last_stage_layers``, ``pipeline_layout``; 0 for not given): the one with the fewest layers on
    its busiest rank among Megatron-LM's even split, its first/last-stage flags
    (:func:`megatron_split`) and a layout string spreading the layers as evenly as the chunks allow,
    preferred in that order when equal; None when none is valid."""
    layers, pp, v = int(layers), int(pp), int(virtual_stages)
    options = []
    flags = megatron_split(layers, pp, v, balanced)
    if flags is not None:
        first, last = flags
        middle_ranks = pp - (first > 0) - (last > 0)
        k = (layers - first - last) // middle_ranks if middle_ranks else 0
        busiest = max(k, first or k, last or k) if first or last else -(-(layers + 2 * balanced) // pp)
        options.append((busiest, dict(first_stage_layers=first, last_stage_layers=last, pipeline_layout=0)))
    if pp * v <= layers + 2 * balanced:
        q, r = divmod(layers + 2 * balanced, pp * v)
        busiest = sum(q + (j * pp < r) for j in range(v))  # rank 0: the earlier chunks take the remainder
        options.append((busiest, dict(first_stage_layers=0, last_stage_layers=0, pipeline_layout=1)))
    return min(options, key=lambda o: o[0])[1] if options else None


def _split_rule(balanced: bool) -> "Rule":
    return (_SPLIT_FIELDS,
            lambda **k: _split_valid(**k, balanced=balanced),
            lambda **k: split_problem(**k, balanced=balanced))


_STAGES_RULE, _BALANCED_STAGES_RULE = _split_rule(False), _split_rule(True)


# (fields needed, predicate -> True where valid, message). Predicates use only arithmetic and
# comparisons so they work on numpy arrays; a rule is skipped when one of its fields is absent.
RULES: list[Rule] = [
    *[validate.rule(f) for f in ("dp", "tp", "pp", "cp", "ep", "etp", "virtual_stages", "micro_batch_size",
                                 "num_microbatches", "shard_size", "layers", "hidden", "heads",
                                 "kv_heads", "ffn", "vocab", "seq")],
    validate.rule("params", integer=False, minimum=0, exclusive=True),  # a bare parameter count
    validate.rule("largest_layer", integer=False, minimum=0),
    *SHAPE_RULES,
    validate.rule("zero", minimum=0, maximum=3),
    # Megatron-Core splits heads, query groups and every ColumnParallelLinear's output over tp
    # (``divide`` asserts in attention.py, mlp.py; SharedExpertMLP is an MLP over the TP group)
    (("heads", "tp"), lambda heads, tp: heads % tp == 0,
     lambda heads, tp: f"tensor parallel size tp={tp} must divide the {heads} attention heads; "
                       f"valid tp: {validate.divisors(heads)}"),
    (("kv_heads", "tp"), lambda kv_heads, tp: kv_heads % tp == 0,
     lambda kv_heads, tp: f"tensor parallel size tp={tp} must divide the {kv_heads} KV heads (kv_heads, "
                          f"Megatron's query groups); valid tp: {validate.divisors(kv_heads)}"),
    (("ffn", "tp"), lambda ffn, tp: ffn % tp == 0,
     lambda ffn, tp: f"tensor parallel size tp={tp} must divide the FFN width {ffn} (ffn); "
                     f"valid tp: {validate.divisors(ffn)}"),
    (("moe_ffn", "shared_experts", "tp"), lambda moe_ffn, shared_experts, tp: (moe_ffn * shared_experts) % tp == 0,
     lambda moe_ffn, shared_experts, tp: f"tensor parallel size tp={tp} must divide the shared-expert width "
                                         f"moe_ffn x shared_experts = {moe_ffn * shared_experts} (Megatron-Core "
                                         f"--moe-shared-expert-intermediate-size, split over tp by SharedExpertMLP); "
                                         f"valid tp: {validate.divisors(moe_ffn * shared_experts)}"),
    _STAGES_RULE,
    (("seq", "cp"), lambda seq, cp: seq % cp == 0,
     lambda seq, cp: f"context parallel size cp={cp} must divide the sequence length {seq}; "
                     f"valid cp: {validate.divisors(seq)}"),
    (("seq", "cp", "tp", "sequence_parallel"),
     lambda seq, cp, tp, sequence_parallel: ~np.asarray(sequence_parallel, bool) | ((seq // cp) % tp == 0),
     lambda seq, cp, tp, sequence_parallel: f"sequence parallelism splits the {seq // cp} tokens per "
                                            f"context shard over tp={tp}; tp must divide {seq // cp}"),
    (("experts", "ep"), lambda experts, ep: (ep == 1) | ((experts > 0) & (experts % np.maximum(ep, 1) == 0)),
     lambda experts, ep: (f"expert parallel size ep={ep} must divide experts={experts}; valid ep: "
                          f"{validate.divisors(experts)}") if experts > 0 else
                         f"expert parallel size ep={ep} needs an MoE model; use ep=1 for a dense model"),
    (("experts", "etp"), lambda experts, etp: (etp == 1) | (experts > 0),
     lambda experts, etp: f"expert tensor parallel size etp={etp} needs an MoE model; use etp=1 "
                          f"for a dense model"),
    (("moe_ffn", "etp"), lambda moe_ffn, etp: moe_ffn % etp == 0,
     lambda moe_ffn, etp: f"expert tensor parallel size etp={etp} must divide moe_ffn={moe_ffn} (the "
                          f"expert FFN width); valid etp: {validate.divisors(moe_ffn)}"),
    (("dp", "tp", "cp", "ep", "etp"), lambda dp, tp, cp, ep, etp: (dp * tp * cp) % (ep * etp) == 0,
     lambda dp, tp, cp, ep, etp: f"ep x etp = {ep}x{etp} must divide the {dp * tp * cp} GPUs of a "
                                 f"pipeline stage (dp x tp x cp; Megatron-Core's expert grid); "
                                 f"valid ep x etp: {validate.divisors(dp * tp * cp)}"),
    (("dp", "cp", "shard_size"), lambda dp, cp, shard_size: (dp * cp) % shard_size == 0,
     lambda dp, cp, shard_size: f"shard_size={shard_size} must divide the {dp * cp} replicas "
                                 f"(dp x cp); valid: {validate.divisors(dp * cp)}"),
    (("gpus", "dp", "tp", "pp", "cp"), lambda gpus, dp, tp, pp, cp: dp * tp * pp * cp == gpus,
     lambda gpus, dp, tp, pp, cp: f"dp x tp x pp x cp = {dp}x{tp}x{pp}x{cp} = {dp * tp * pp * cp} "
                                  f"but there are {gpus} GPUs; e.g. dp = {gpus}/(tp*pp*cp) = "
                                  f"{gpus / (tp * pp * cp):g}"),
]

# rules that depend on the categorical options (checked with the option as a Python value).
# Interleaving (Narayanan et al. 2021, Sec. 2.2) as Megatron-LM implements it: the interleaved
# schedule runs only with virtual_pipeline_model_parallel_size > 1 (``get_forward_backward_func``
# falls back to plain 1F1B otherwise), only with pipeline_model_parallel_size > 1
# (``parallel_state.initialize_model_parallel``: "pipeline-model-parallel size should be greater
# than 1 with interleaved schedule"), and only when the micro-batches are a multiple of pp
# (``forward_backward_pipelining_with_interleaving``).
_OPTION_RULES: dict[str, list[Rule]] = {
    "interleaved": [
        (("virtual_stages",), lambda virtual_stages: virtual_stages >= 2,
         lambda virtual_stages: f"the interleaved schedule needs virtual_stages >= 2, got "
                                f"{virtual_stages} (Megatron-LM interleaves only with "
                                f"virtual_pipeline_model_parallel_size > 1); use schedule='1f1b' "
                                f"for one chunk per rank"),
        (("pp",), lambda pp: pp >= 2,
         lambda pp: f"the interleaved schedule needs pipeline parallelism, pp >= 2, got pp={pp} "
                    f"(Megatron-LM); use schedule='1f1b' without a pipeline"),
        (("num_microbatches", "pp"), lambda num_microbatches, pp: num_microbatches % pp == 0,
         lambda num_microbatches, pp: f"the interleaved schedule needs num_microbatches "
                                  f"({num_microbatches}) to be a multiple of pp={pp} (Megatron-LM); "
                                  f"valid: {pp}, {2 * pp}, {3 * pp}, ..."),
    ],
    "not-interleaved": [
        (("virtual_stages",), lambda virtual_stages: virtual_stages == 1,
         lambda virtual_stages: f"virtual_stages={virtual_stages} needs schedule='interleaved'; "
                                f"use 1 otherwise"),
    ],
    # DualPipe (DeepSeek-V3 report, Sec. 3.2.1) as deepseek-ai/DualPipe 3da1bbe runs it (``DualPipe.step``:
    # "assert num_ranks % 2 == 0", "num_chunks % 2 == 0 and num_chunks >= num_ranks * 2"): micro-batches
    # enter from both ends of the pipeline, half each
    "dualpipe": [
        (("pp",), lambda pp: (pp >= 2) & (pp % 2 == 0),
         lambda pp: f"the dualpipe schedule needs an even pp >= 2 (its two directions pair rank r with "
                    f"rank pp-1-r; deepseek-ai/DualPipe), got pp={pp}"),
        (("num_microbatches", "pp"), lambda num_microbatches, pp: (num_microbatches % 2 == 0)
         & (num_microbatches >= 2 * pp),
         lambda num_microbatches, pp: f"the dualpipe schedule needs an even num_microbatches >= 2 x pp = "
                                      f"{2 * pp} (half enter from each end; deepseek-ai/DualPipe), got "
                                      f"{num_microbatches}"),
    ],
    # DualPipeV, DualPipe cut in half (Sea AI Lab; deepseek-ai/DualPipe 3da1bbe ``DualPipeV.step``: "num_chunks
    # >= num_ranks * 2"): 2 pp stages in a V, rank r holding stages r and 2 pp - 1 - r (torchtitan's "v" style:
    # "v schedules assume 2 stages per rank", pipeline_parallel.py at b5bcd76)
    "dualpipev": [
        (("virtual_stages",), lambda virtual_stages: virtual_stages == 2,
         lambda virtual_stages: f"the dualpipev schedule runs 2 chunks per rank (a V: stages r and 2 pp - 1 - r), "
                                f"virtual_stages must be 2, got {virtual_stages}"),
        (("pp",), lambda pp: pp >= 2,
         lambda pp: f"the dualpipev schedule needs pipeline parallelism, pp >= 2, got pp={pp}"),
        (("num_microbatches", "pp"), lambda num_microbatches, pp: num_microbatches >= 2 * pp,
         lambda num_microbatches, pp: f"the dualpipev schedule needs num_microbatches >= 2 x pp = {2 * pp} "
                                      f"(deepseek-ai/DualPipe), got {num_microbatches}"),
    ],
    "params": [(("zero",), lambda zero: zero == 3,
                lambda zero: f"offloading parameters needs ZeRO stage 3 (params sharded), got {zero}")],
    "optimizer": [(("zero",), lambda zero: zero >= 1,
                   lambda zero: f"offloading the optimizer needs ZeRO stage >= 1 (ZeRO-Offload), got {zero}")],
}


def _rules_for(schedule: str, offload: str, balanced: bool = False) -> list[Rule]:
    chunked = schedule in ("interleaved", "dualpipev")
    extra = list(_OPTION_RULES[schedule] if chunked else _OPTION_RULES["not-interleaved"])
    extra += _OPTION_RULES["dualpipe"] if schedule == "dualpipe" else []
    extra += _OPTION_RULES.get(offload, [])
    rules = [_BALANCED_STAGES_RULE if balanced and r is _STAGES_RULE else r for r in RULES]
    return rules + extra


def broken_rules(numbers: dict[str, Any], schedule: str = "1f1b", offload: str = "none", balanced: bool = False):
    """Yield ``(valid_mask, message_fn, fields)`` for every applicable rule (arrays or scalars);
    ``balanced``: Parallelism.account_for_embedding_and_loss (two more pipeline slots)."""
    for fields, ok, message in _rules_for(schedule, offload, balanced):
        if all(f in numbers and numbers[f] is not None for f in fields):
            with np.errstate(divide="ignore", invalid="ignore"):  # x % 0 on rows already invalid
                valid = np.asarray(ok(**{f: numbers[f] for f in fields}))
            yield valid, message, fields


def check_layout(numbers: dict[str, Any], schedule: str = "1f1b", offload: str = "none",
                 balanced: bool = False) -> None:
    """Raise ValueError for the first rule that ``numbers`` break (scalars, or arrays: the message
    shows the first bad element)."""
    for valid, message, fields in broken_rules(numbers, schedule, offload, balanced):
        if not (valid.all() if valid.ndim else valid):
            first = tuple(np.argwhere(~valid)[0]) if valid.ndim else ()
            raise ValueError(message(**{f: np.broadcast_to(numbers[f], valid.shape)[first].item()
                                        for f in fields}))


def chunks_per_rank(schedule: str, virtual_stages: Any) -> Any:
    """Model chunks a pipeline rank runs: ``virtual_stages`` for the interleaved schedule and
    DualPipeV (2, its V), 1 for the others (DualPipe's two stages are whole stages, each run by half
    the micro-batches)."""
    return virtual_stages if schedule in ("interleaved", "dualpipev") else 1 + 0 * np.asarray(virtual_stages)


def check_pipeline(pp: Any, num_microbatches: Any, virtual_stages: Any = 1, schedule: str = "1f1b") -> None:
    """The rules of :data:`RULES` that a pipeline schedule alone must follow (sizes >= 1; the
    interleaved schedule's v >= 2, pp >= 2, m a multiple of pp; DualPipe's even pp >= 2 and even
    m >= 2 pp; DualPipeV's v = 2, pp >= 2, m >= 2 pp; v = 1 otherwise)."""
    validate.one_of("schedule", schedule, SCHEDULES)
    check_layout({"pp": pp, "num_microbatches": num_microbatches, "virtual_stages": virtual_stages},
                 schedule)


# ---- pipeline bookkeeping (scalars or arrays) ----------------------------------------------------
def stage_layers(layers: Any, pp: Any, virtual_stages: Any = 1, balanced: Any = False) -> tuple[Any, Any]:
    """Layers on the first and on the last pipeline rank. Uneven splits give the extra layers to
    the first ranks (conservative for memory); each rank holds ``virtual_stages`` chunks.
    ``balanced`` (Parallelism.account_for_embedding_and_loss): the embedding and the loss each
    count as one layer in the split, and the chunks holding them get one layer fewer (Megatron-LM
    ``get_num_layers_to_build`` with ``account_for_embedding/loss_in_pipeline_split``)."""
    extra = _where(balanced, 2, 0)
    chunks = pp * virtual_stages
    first = virtual_stages * -(-(layers + extra) // chunks) - extra // 2
    last = virtual_stages * ((layers + extra) // chunks) - extra // 2
    single = pp == 1  # one rank holds the embedding and the loss: both slots are its own
    return _where(single, layers, first), _where(single, layers, last)


def _where(cond: Any, a: Any, b: Any) -> Any:
    return np.where(cond, a, b) if isinstance(cond, np.ndarray) or isinstance(a, np.ndarray) \
        or isinstance(b, np.ndarray) else (a if cond else b)


def in_flight(schedule: str, pp: Any, num_microbatches: Any, virtual_stages: Any = 1) -> tuple[Any, Any]:
    """Micro-batches whose activations the first and last pipeline ranks hold at the peak, in units
    of "the rank's whole share of layers".

    GPipe (Huang et al. 2019) keeps all m; 1F1B (Narayanan et al. 2021, Sec. 2.2) keeps min(m, p) on
    the first rank and 1 on the last; interleaved 1F1B keeps, on rank r, (p-r-1)*2 + (v-1)*p + 1
    model chunks (Megatron-LM ``schedules.py`` warm-up count), i.e. 1 + (p-1)/(p*v) of the rank's
    layers on rank 0 (Korthikanti et al. 2022, Sec. 4.2.3); it needs v >= 2 (with v = 1 the
    warm-up count is not 1F1B's, and Megatron-LM runs plain 1F1B instead), so v < 2 raises.
    DualPipe (DeepSeek-V3 report, Table 2) keeps p + 1 stage-micro-batches on every rank, whose share
    is two stages (stage r and stage p-1-r): (p + 1)/2 of it, first and last rank alike; DualPipeV
    2p + 1 chunk-micro-batches of its two half-share chunks on every rank, (2p + 1)/2.
    Without pipelining (p = 1) one micro-batch is in flight at a time.
    """
    validate.one_of("schedule", schedule, SCHEDULES)
    check_layout({"virtual_stages": virtual_stages}, schedule)
    m, p, v = num_microbatches, pp, virtual_stages
    if schedule == "gpipe":
        first, last = m, m
    elif schedule == "1f1b":
        first, last = np.minimum(m, p), 1
    elif schedule == "dualpipe":
        first = last = (p + 1) / 2
    elif schedule == "dualpipev":
        first = last = (2 * p + 1) / 2
    else:
        chunks = np.minimum(m * v, 2 * (p - 1) + (v - 1) * p + 1)
        first, last = chunks / v, np.minimum(m * v, (v - 1) * p + 1) / v
    no_pipeline = p == 1
    return np.where(no_pipeline, 1, first), np.where(no_pipeline, 1, last)
