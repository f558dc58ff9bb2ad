"""Pipeline stages as Megatron-LM builds them: each rank's chunks, layers, MoE layers and the
micro-batches it holds at its activation peak.

Layer placement follows Megatron-Core core_v0.16.1 (``get_num_layers_to_build`` in
``transformer_block.py``, ``get_transformer_layer_offset`` in ``transformer_layer.py``): virtual
stage ``j`` spans every rank in order, rank ``r`` holding its ``1/virtual_stages`` share of its
layers there. The first rank's share is ``first_stage_layers`` and the last's
``last_stage_layers`` when given (``--decoder-first/last-pipeline-num-layers``), the middle ranks
share the rest evenly; with ``account_for_embedding_and_loss`` the embedding and the loss take one
slot each of an even split of ``layers + 2`` (the first chunk of the first rank and the last chunk
of the last rank hold one layer fewer). ``tests/test_stages.py`` compares this with Megatron-Core's
own functions.

Every function takes scalars or numpy arrays (``rank`` too), so the memory model evaluates a few
candidate ranks per layout of a search at once (:func:`candidate_ranks`), and
:func:`pipeline_stages` lists every stage of one layout.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from dtlib.analytic import validate
from dtlib.analytic.config import TransformerConfig, moe_layer_count
from dtlib.analytic.layout import SCHEDULES, Parallelism, chunks_per_rank

__all__ = ["Stage", "pipeline_stages", "megatron_layout_string", "chunk_layers", "mtp_in_chunk", "rank_layers",
           "dualpipe_stages", "dualpipev_chunks", "holds_ends",
           "stored_on_rank", "candidate_ranks",
           "on_structures", "distinct_rows"]


def _shares(layers, pp, virtual_stages, first_stage_layers, last_stage_layers, balanced):
    """Slots (layers, + the embedding and the loss when ``balanced``) of the first, a middle and
    the last rank, over all their chunks."""
    first, last = np.asarray(first_stage_layers), np.asarray(last_stage_layers)
    uneven = (first > 0) | (last > 0)
    middle_ranks = np.maximum(pp - (first > 0) - (last > 0), 1)
    k = (layers - first - last) // middle_ranks
    even = (layers + 2 * balanced) // pp
    return (np.where(uneven, np.where(first > 0, first, k), even), np.where(uneven, k, even),
            np.where(uneven, np.where(last > 0, last, k), even))


def chunk_layers(n: dict[str, Any], rank: Any, chunk: Any, balanced: Any = False) -> tuple[Any, Any]:
    """Layer indices ``[start, stop)`` of model chunk ``chunk`` (virtual stage) of pipeline rank
    ``rank``; ``n``: the layout and model numbers (``layers pp virtual_stages first_stage_layers
    last_stage_layers``; the last two 0 when not given)."""
    L, pp, v = n["layers"], n["pp"], n["virtual_stages"]
    decoders = n.get("layout_decoders")
    if decoders is not None:  # an explicit layout string (dtlib.analytic.pipeline_layout): its own counts
        offsets = np.concatenate([[0], np.cumsum(decoders)])
        g = np.clip(chunk * pp + rank, 0, len(decoders) - 1)
        return offsets[g], offsets[g] + np.asarray(decoders)[g]
    b = np.asarray(balanced, dtype=int)
    F, K, Lst = _shares(L, pp, v, n.get("first_stage_layers", 0), n.get("last_stage_layers", 0), b)
    size = np.where(rank == 0, F, np.where(rank == pp - 1, Lst, K)) // v
    slot = chunk * ((L + 2 * b) // v) + np.where(rank == 0, 0, F // v + (rank - 1) * (K // v))
    # a layout string: chunk g = chunk x pp + rank of the pp x v holds q slots, one more among the first r
    g, chunks = chunk * pp + rank, pp * v
    q, r = (L + 2 * b) // chunks, (L + 2 * b) % chunks
    spread = np.asarray(n.get("pipeline_layout", 0)) > 0
    slot = np.where(spread, g * q + np.minimum(g, r), slot)
    size = np.where(spread, q + (g < r), size)
    return np.clip(slot - b, 0, L), np.clip(slot + size - b, 0, L)


def _moe_between(n: dict[str, Any], start: Any, stop: Any) -> Any:
    """MoE layers among layers ``[start, stop)`` (dense-first layers, then every ``moe_layer_freq``-th)."""
    args = (n.get("experts", 0), n.get("dense_layers", 0), n.get("moe_layer_freq", 1))
    return moe_layer_count(stop, *args) - moe_layer_count(start, *args)


def _chunks(n: dict[str, Any]) -> int:
    return int(np.max(n["virtual_stages"]))


def mtp_in_chunk(n: dict[str, Any], rank: Any, chunk: Any) -> Any:
    """MTP layers (DeepSeek-V3 Sec. 2.2) of chunk ``chunk`` of rank ``rank``: where an explicit layout
    string puts them (``layout_mtp``), else all ``mtp_layers`` in the last chunk of the last rank, with
    the loss (Megatron-Core 0.16 builds them on the last pipeline stage)."""
    placed = n.get("layout_mtp")
    if placed is not None:
        return np.asarray(placed)[np.clip(chunk * n["pp"] + rank, 0, len(placed) - 1)]
    return (rank == n["pp"] - 1) * (chunk == n["virtual_stages"] - 1) * n.get("mtp_layers", 0)


def dualpipe_stages(rank: Any, pp: Any) -> tuple[Any, Any]:
    """The two pipeline stages DualPipe places on rank ``rank`` (DeepSeek-V3 report, Sec. 3.2.1;
    deepseek-ai/DualPipe 3da1bbe ``DualPipe.step``): the forward direction's stage ``rank`` and the
    reverse direction's ``pp-1-rank``, returned as (the one in the model's first half, its mirror).
    Ranks ``r`` and ``pp-1-r`` hold the same two stages: two copies of every stage's parameters."""
    half = np.minimum(rank, pp - 1 - rank)
    return half, pp - 1 - half


def dualpipev_chunks(rank: Any, pp: Any) -> tuple[tuple[Any, int], tuple[Any, int]]:
    """The two chunks DualPipeV places on rank ``rank`` (deepseek-ai/DualPipe 3da1bbe ``DualPipeV``;
    torchtitan's "v" style): stages ``rank`` and ``2 pp - 1 - rank`` of ``2 pp``, as (rank, chunk) in
    the round-robin numbering of :func:`chunk_layers` (stage ``chunk x pp + rank``)."""
    return (rank, 0), (pp - 1 - rank, 1)


def holds_ends(rank: Any, pp: Any, schedule: str = "1f1b") -> tuple[Any, Any]:
    """Whether pipeline rank ``rank`` holds the embedding and the LM head: the first and the last
    rank; DualPipe's ranks 0 and pp-1 (each holds stage 0 and stage pp-1); DualPipeV's rank 0 (stages
    0 and 2 pp - 1 of its V)."""
    if schedule == "dualpipe":
        both = np.minimum(rank, pp - 1 - rank) == 0
        return both, both
    if schedule == "dualpipev":
        return rank == 0, rank == 0
    return rank == 0, rank == pp - 1


def rank_layers(n: dict[str, Any], rank: Any, balanced: Any = False, schedule: str = "1f1b") -> dict[str, Any]:
    """Layers, MoE layers and MTP layers of pipeline rank ``rank``, over all its chunks (DualPipe:
    over both its stages, :func:`dualpipe_stages`; DualPipeV: its V's two, :func:`dualpipev_chunks`)."""
    if schedule == "dualpipe":
        first, mirror = (rank_layers(n, r, balanced) for r in dualpipe_stages(rank, n["pp"]))
        return {k: first[k] + mirror[k] for k in first}
    if schedule == "dualpipev":
        layers = moe = mtp = 0
        for where, chunk in dualpipev_chunks(rank, n["pp"]):
            start, stop = chunk_layers(n, where, chunk, balanced)
            layers, moe = layers + stop - start, moe + _moe_between(n, start, stop)
            mtp = mtp + mtp_in_chunk(n, where, chunk)
        return {"layers": layers, "moe_layers": moe, "mtp": mtp}
    layers = moe = mtp = 0
    for j in range(_chunks(n)):
        start, stop = chunk_layers(n, rank, j, balanced)
        here = j < n["virtual_stages"]
        layers = layers + here * (stop - start)
        moe = moe + here * _moe_between(n, start, stop)
        mtp = mtp + here * mtp_in_chunk(n, rank, j)
    return {"layers": layers, "moe_layers": moe, "mtp": mtp}


def stored_on_rank(schedule: str, n: dict[str, Any], rank: Any, balanced: Any = False,
                   recompute_layers: int | None = None) -> dict[str, Any]:
    """What rank ``rank`` holds at its activation peak, counted chunk by chunk: ``full`` and
    ``rest``, layer x micro-batch pairs whose layer is fully recomputed (the first
    ``recompute_layers`` of each chunk, Megatron's block method) or stores its activations;
    ``moe_share``, the share of those pairs in MoE layers; ``embedding`` and ``output``, the
    micro-batches in flight of the chunk holding the embedding (rank 0) or the loss (the last rank).

    Chunk-forwards in flight follow Megatron-LM's schedules (``schedules.py``): GPipe all m; 1F1B
    ``min(m, pp - rank)`` (the warm-up ``pp - rank - 1`` plus the first steady one); interleaved
    ``min(m v, 2(pp - rank - 1) + (v - 1) pp + 1)`` chunk-forwards, forward ``k`` running chunk
    ``(k mod pp v) // pp`` (``get_model_chunk_id``); DualPipe and DualPipeV :func:`_stored_two`; no pipeline: 1.
    """
    validate.one_of("schedule", schedule, SCHEDULES)
    m, p = n["num_microbatches"], n["pp"]
    if schedule == "dualpipe":
        first, mirror = dualpipe_stages(rank, p)
        return _stored_two(n, ((first, 0, p - first), (mirror, 0, first + 1)), first == 0, balanced, recompute_layers)
    if schedule == "dualpipev":  # DualPipeV.step's steps 1-3 and step 4's first forward, as DualPipe's
        (own, _), (mirror, _) = dualpipev_chunks(rank, p)
        return _stored_two(n, ((own, 0, 2 * p - rank), (mirror, 1, rank + 1)), rank == 0, balanced,
                           recompute_layers, chunks=2)
    v = chunks_per_rank(schedule, n["virtual_stages"])
    if schedule == "gpipe":
        total = m * v
    elif schedule == "1f1b":
        total = np.minimum(m, p - rank)
    else:
        total = np.minimum(m * v, 2 * (p - rank - 1) + (v - 1) * p + 1)
    total = np.where(p == 1, 1, total)

    def in_chunk(chunk: Any) -> Any:
        """Forwards among the first ``total`` that run ``chunk`` (groups of p per chunk)."""
        groups, left = total // (p * v), total % (p * v)
        return groups * p + np.clip(left - chunk * p, 0, p)

    nv = dict(n, virtual_stages=v)
    recomputed = 0 if recompute_layers is None else recompute_layers
    full = pairs = moe = 0
    for j in range(_chunks(nv)):
        start, stop = chunk_layers(nv, rank, j, balanced)
        held = (j < v) * in_chunk(j)
        full = full + held * np.minimum(recomputed, stop - start)
        # an MTP layer stores what a transformer layer of its kind stores
        mtp = mtp_in_chunk(nv, rank, j)
        pairs = pairs + held * (stop - start + mtp)
        moe = moe + held * (_moe_between(n, start, stop) + mtp * n.get("mtp_moe", 0))
    return {"full": full, "rest": pairs - full, "moe_share": moe / np.maximum(pairs, 1),
            "embedding": np.where(rank == 0, in_chunk(0), 0), "output": np.where(rank == p - 1, in_chunk(v - 1), 0)}


def _stored_two(n: dict[str, Any], places: tuple, ends: Any, balanced: Any, recompute_layers: int | None,
                chunks: int = 1) -> dict[str, Any]:
    """:func:`stored_on_rank` for DualPipe and DualPipeV (deepseek-ai/DualPipe 3da1bbe ``step``):
    ``places`` are the rank's two (rank, chunk, forwards held) in the round-robin numbering of
    ``chunks`` chunks per rank. DualPipe (``h = pp/2``, ``hr`` the rank's first-half stage): steps 1-3
    leave ``2h - hr - 1`` forwards of that stage and ``hr + 1`` of its mirror in flight, step 4's
    first forward adds one: ``pp - hr`` and ``hr + 1``, pp + 1 in all (the report's Table 2). DualPipeV
    the same with ``pp`` for ``h`` and the rank for ``hr``: ``2 pp - r`` and ``r + 1``. The embedding's
    stage and the loss's are on the ranks where ``ends`` (the first chunk's count and 1)."""
    p = n["pp"]
    recomputed = 0 if recompute_layers is None else recompute_layers
    nv = dict(n, virtual_stages=chunks + 0 * np.asarray(p))
    full = pairs = moe = 0
    for where, chunk, held in places:
        start, stop = chunk_layers(nv, where, chunk, balanced)
        mtp = mtp_in_chunk(nv, where, chunk)
        full = full + held * np.minimum(recomputed, stop - start)
        pairs = pairs + held * (stop - start + mtp)
        moe = moe + held * (_moe_between(n, start, stop) + mtp * n.get("mtp_moe", 0))
    return {"full": full, "rest": pairs - full, "moe_share": moe / np.maximum(pairs, 1),
            "embedding": np.where(ends, places[0][2], 0), "output": np.where(ends, 1, 0)}


# the numbers a rank's layers and micro-batches depend on: a search's many layouts share few of them
_STRUCTURE = ("layers", "pp", "virtual_stages", "num_microbatches", "first_stage_layers", "last_stage_layers",
              "pipeline_layout", "experts", "dense_layers", "moe_layer_freq", "mtp_layers", "mtp_moe")


def on_structures(function: Callable[[dict[str, Any]], list[dict[str, Any]]], n: dict[str, Any]) -> list[dict[str, Any]]:
    """``function(n)`` evaluated once per distinct pipeline structure (:data:`_STRUCTURE`) of the
    layouts in ``n`` and spread back over them: the same numbers, computed on a few rows."""
    shape = np.broadcast(*(np.asarray(n.get(k, 0)) for k in _STRUCTURE)).shape
    if not shape:
        return function(n)
    columns = [np.broadcast_to(np.asarray(n.get(k, 0)), shape).ravel() for k in _STRUCTURE]
    first, where = distinct_rows(columns)
    few = function(dict(n, **{k: c[first] for k, c in zip(_STRUCTURE, columns)}))
    return [{k: np.broadcast_to(np.asarray(v), first.shape)[where].reshape(shape) for k, v in d.items()}
            for d in few]


def distinct_rows(columns: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The first index of each distinct row of equal-length ``columns`` and, per row, which
    distinct row it is (numpy's ``unique(axis=...)`` sorts rows as records, far slower than
    combining each column's codes into one integer as done here)."""
    key = np.zeros(len(columns[0]), dtype=np.int64)
    for c in columns:
        values, code = np.unique(c, return_inverse=True)
        if (int(key.max()) + 1) * len(values) > 2 ** 40:  # re-code before the key could overflow
            key = np.unique(key, return_inverse=True)[1].reshape(-1)
        key = key * len(values) + code.reshape(-1)
    _, first, where = np.unique(key, return_index=True, return_inverse=True)
    return first, where.reshape(-1)


def candidate_ranks(n: dict[str, Any], balanced: Any = False, schedule: str = "1f1b") -> list[Any]:
    """The ranks among which the most loaded one is: the first (embedding, most micro-batches in
    flight), the last (LM head and loss), and the middle ranks where the layer mix changes: rank 1
    and the first middle rank past the dense-first layers and the one after it (with
    ``moe_layer_freq > 1`` the two phases of the MoE pattern). Middle ranks hold equal layer counts
    and, the further down the pipeline, fewer micro-batches, so among those with one mix the first
    is the heaviest. Each entry is a rank per layout (arrays broadcast). With an explicit layout
    string (``layout_decoders``: any rank may hold any layers) every rank is a candidate. DualPipe's
    ranks hold two stages each (ranks r and pp-1-r the same two) and DualPipeV's two chunks of a V:
    every rank of the first half, or every rank, is a candidate."""
    pp = np.asarray(n["pp"])
    if schedule in ("dualpipe", "dualpipev"):
        mirrored = schedule == "dualpipe"
        top = np.maximum(pp // 2 if mirrored else pp, 1) - 1
        return [np.minimum(r + 0 * pp, top) for r in range(int(np.max(top)) + 1)]
    if n.get("layout_decoders") is not None:
        return [r + 0 * pp for r in range(int(np.max(pp)))]
    F, K, _ = _shares(n["layers"], pp, n["virtual_stages"], n.get("first_stage_layers", 0),
                      n.get("last_stage_layers", 0), np.asarray(balanced, dtype=int))
    v, b = n["virtual_stages"], np.asarray(balanced, dtype=int)
    dense = np.asarray(n.get("dense_layers", 0))
    # the first rank whose first chunk starts at or after the dense-first layers
    past = dense + b - F // v
    moe_rank = 1 + np.maximum(-(-past // np.maximum(K // v, 1)), 0)
    # with a layout string chunk r starts at r q + min(r, rem) slots: at or before this rank
    q = (n["layers"] + 2 * b) // (pp * v)
    moe_rank = np.where(np.asarray(n.get("pipeline_layout", 0)) > 0, -(-(dense + b) // (q + 1)), moe_rank)
    # a dense model's middle ranks differ only in micro-batches in flight: rank 1 has the most
    mixes = ((moe_rank,) if np.any(dense) else ()) + ((moe_rank + 1,) if np.any(n.get("moe_layer_freq", 1) > 1) else ())
    moe_model = np.any(n.get("experts", 0))
    middle = [np.clip(r, 1, np.maximum(pp - 2, 1)) for r in (1 + 0 * pp,) + (mixes if moe_model else ())]
    return [0 * pp, pp - 1] + [np.where(pp > 2, r, 0) for r in middle]


@dataclass(frozen=True)
class Stage:
    """One pipeline rank: its layer indices (chunk by chunk), how many are MoE layers, and whether it
    holds the embedding and the LM head with the loss."""
    rank: int
    chunks: tuple[tuple[int, ...], ...]
    moe_layers: int
    embedding: bool
    loss: bool

    @property
    def layers(self) -> int:
        return sum(len(c) for c in self.chunks)


def pipeline_stages(model: TransformerConfig, layout: Parallelism) -> list[Stage]:
    """Every pipeline rank of ``layout`` training ``model``, as Megatron-LM builds it (the split is
    checked by :data:`dtlib.analytic.layout.RULES` when the layout is made)."""
    n = layout.numbers(**model.numbers())
    layout.check_model(model)
    balanced = layout.account_for_embedding_and_loss
    out = []
    for r in range(layout.pp):
        # DualPipe: the rank's two stages (dualpipe_stages), each a whole 1F1B stage; DualPipeV: its V
        places = ([(int(s), 0) for s in dualpipe_stages(r, layout.pp)] if layout.schedule == "dualpipe"
                  else list(dualpipev_chunks(r, layout.pp)) if layout.schedule == "dualpipev"
                  else [(r, j) for j in range(layout.virtual_stages)])
        chunks = tuple(tuple(range(*map(int, chunk_layers(n, rank, j, balanced)))) for rank, j in places)
        moe = sum(int(_moe_between(n, c[0], c[-1] + 1)) for c in chunks if c)
        embedding, loss = holds_ends(r, layout.pp, layout.schedule)
        out.append(Stage(rank=r, chunks=chunks, moe_layers=moe, embedding=bool(embedding), loss=bool(loss)))
    return out


def megatron_layout_string(model: TransformerConfig, layout: Parallelism) -> str:
    """Megatron-LM's ``--pipeline-model-parallel-layout`` for ``layout``'s split: the pp x
    virtual_stages chunks in Megatron's order (virtual stage by virtual stage, ranks in order,
    ``PipelineParallelLayerLayout``), ``|`` between chunks, ``E`` the embedding first, ``t`` a
    decoder layer, ``L`` the loss last (core_v0.16.1 ``pipeline_parallel_layer_layout.py``)."""
    if isinstance(layout.pipeline_layout, str):  # given explicitly: Megatron reads it as it is
        return layout.pipeline_layout
    stages = pipeline_stages(model, layout)
    chunks = []
    for j in range(layout.virtual_stages):
        for stage in stages:
            ends = ("E" if j == 0 and stage.embedding else "", "L" if j == layout.virtual_stages - 1 and stage.loss else "")
            chunks.append(ends[0] + "t" * len(stage.chunks[j]) + ends[1])
    return "|".join(chunks)
