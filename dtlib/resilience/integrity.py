"""Data integrity across replicas: checksums of the parameters every data-parallel replica should
hold bit for bit, compared every N steps, naming a replica that silently diverged.

Why: a GPU can compute a wrong result without any error ("silent data corruption"; Dixit et al.
2021, "Silent Data Corruptions at Scale", Meta; the Llama 3 paper, Sec. 3.3.4, counts 6 of its 419
interruptions as silent data corruption). Under data parallelism every replica applies the same
averaged gradient, so their parameters stay identical bit for bit; a flipped bit on one replica
stays (the same update is added on every replica) and a checksum shows it at the next comparison.

Which ranks should agree: those with the same tensor/pipeline coordinates (``tp``, ``pp``): the
``dp x cp`` ranks of Megatron's ``dp_cp`` group, which hold the same parameter shards with ZeRO 0-2
(ZeRO-3/FSDP shards parameters over them, so there is nothing to compare). The majority checksum
of a group is taken as right; with two replicas a disagreement cannot say which one is wrong, and
both are named.
"""
from __future__ import annotations

import hashlib
from collections import Counter
from typing import Any, Iterable

import torch
import torch.distributed as dist

__all__ = ["checksum", "compare", "replica_report", "flip_bit"]


def checksum(tensors: Iterable[torch.Tensor]) -> str:
    """SHA-256 of the tensors' raw bytes, in the given order (every bit counts, no conversion)."""
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().contiguous().cpu()
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def compare(checksums: dict[int, str]) -> dict[str, Any]:
    """One group of replicas: ``{rank: checksum}`` -> ``{"diverged": [ranks], "majority": checksum or
    None}``. The most common checksum wins when it is held by more ranks than any other; with a
    tie (two replicas that differ) there is no majority and every rank outside the largest... is
    named: all of them."""
    counts = Counter(checksums.values()).most_common()
    if len(counts) == 1:
        return {"diverged": [], "majority": counts[0][0]}
    if counts[0][1] == counts[1][1]:  # a tie: no way to tell which replica is right
        return {"diverged": sorted(checksums), "majority": None}
    majority = counts[0][0]
    return {"diverged": sorted(r for r, c in checksums.items() if c != majority), "majority": majority}


def replica_report(params: Iterable[torch.Tensor], key: Any, group: Any = None) -> dict[str, Any]:
    """A collective over ``group`` (default: the world): every rank contributes the checksum of its
    ``params`` and its replica ``key`` (ranks with the same key must hold the same bits, e.g. their
    ``(tp, pp)`` coordinates). Returns, on every rank, ``{"diverged": [ranks], "groups": {key:
    {rank: checksum}}, "ambiguous": [keys with no majority]}``."""
    mine = (dist.get_rank() if dist.is_initialized() else 0, key, checksum(params))
    if dist.is_initialized():
        everyone: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
    else:
        everyone = [mine]
    groups: dict[Any, dict[int, str]] = {}
    for rank, k, c in everyone:
        groups.setdefault(k, {})[rank] = c
    diverged, ambiguous = [], []
    for k, sums in groups.items():
        result = compare(sums)
        diverged += result["diverged"]
        if result["diverged"] and result["majority"] is None:
            ambiguous.append(k)
    return {"diverged": sorted(diverged), "groups": groups, "ambiguous": ambiguous}


def flip_bit(t: torch.Tensor, index: int = 0, bit: int = 16) -> None:
    """Flip bit ``bit`` of element ``index`` of the float32 tensor ``t`` in place (a fault drill:
    bit 16 of a float32's 23-bit mantissa changes the value by about 0.4%: silent, no NaN)."""
    if t.dtype != torch.float32:
        raise ValueError(f"flip_bit needs a float32 tensor, got {t.dtype}")
    if not 0 <= bit < 32:
        raise ValueError(f"bit must be in 0..31, got {bit}")
    with torch.no_grad():
        flat = t.data.view(-1).view(torch.int32)
        flat[index] ^= (1 << bit) if bit < 31 else -(1 << 31)
