"""Many configurations at once: arrays in, arrays out (for the planner).

These functions run the *same* formulas as the scalar path — :func:`dtlib.analytic.memory.per_gpu_bytes`,
:func:`dtlib.analytic.flops.step_flops`, the validity rules of :data:`dtlib.analytic.layout.RULES` — on numpy
arrays. Numeric fields (layout sizes, ZeRO stage, batch split, model widths) may be arrays and
broadcast together; categorical options (recompute, schedule, offload, precision) are scalars, so a
planner loops over their few values and vectorises the rest.

Invalid configurations raise ``ValueError`` naming the first bad index (``on_invalid="raise"``),
or come back as NaN with ``valid == False`` (``on_invalid="nan"``).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from dtlib.analytic import validate
from dtlib.analytic.flops import shape_of, step_flops, utilization
from dtlib.analytic.hardware import Accelerator
from dtlib.analytic.memory import memory_options, model_numbers, per_gpu_bytes
from dtlib.analytic.presets import activation_convention
from dtlib.analytic.stacks import get_stack
from dtlib.analytic.config import TransformerConfig, moe_layer_count, sliding_layer_count
from dtlib.analytic.layout import OFFLOAD, RECOMPUTE_OPTIONS, SCHEDULES, broken_rules
from dtlib.analytic.precision import Precision, get_precision

__all__ = ["memory_batch", "flops_batch", "layout_arrays"]

_LAYOUT_DEFAULTS = dict(dp=1, tp=1, pp=1, cp=1, ep=1, etp=1, zero=0, sequence_parallel=False,
                        virtual_stages=1, micro_batch_size=1, num_microbatches=1, first_stage_layers=0,
                        last_stage_layers=0, pipeline_layout=0)
_SAFE = dict(_LAYOUT_DEFAULTS, shard_size=1, gpus=None, layers=1, hidden=1, heads=1, kv_heads=1,
             ffn=1, moe_ffn=1, head_dim=1, vocab=1, seq=1, params=1.0, largest_layer=0.0,
             moe_layers=0, dense_layers=0, moe_layer_freq=1, sliding_layers=0)  # one dense layer


def _derived(cfg: "TransformerConfig | None", arrays: dict[str, Any]) -> dict[str, Any]:
    """``arrays`` plus the config numbers derived from the sizes they replace, as
    :meth:`TransformerConfig.with_` derives them: a default head size (hidden // heads) follows new
    ``hidden``/``heads``, the counts of MoE and sliding layers follow new ``layers``."""
    out = dict(arrays)
    given = {k for k, v in arrays.items() if v is not None}
    if cfg is None:
        return out
    if ({"hidden", "heads"} & given and "head_dim" not in given and not cfg.kv_lora_rank
            and cfg.head_dim == cfg.hidden // cfg.heads):
        hidden = np.asarray(arrays.get("hidden") if "hidden" in given else cfg.hidden)
        heads = np.asarray(arrays.get("heads") if "heads" in given else cfg.heads)
        out["head_dim"] = hidden // np.maximum(heads, 1)
    if "layers" in given:
        layers = np.asarray(arrays["layers"])
        out.setdefault("moe_layers", moe_layer_count(layers, cfg.moe_experts, cfg.moe_dense_layers,
                                                     cfg.moe_layer_freq))
        out.setdefault("sliding_layers", sliding_layer_count(layers, cfg.sliding_window,
                                                             cfg.global_attention_every))
    return out


def layout_arrays(cfg: "TransformerConfig | None", arrays: dict[str, Any], schedule: str = "1f1b",
                  offload: str = "none", on_invalid: str = "raise",
                  balanced: bool = False) -> tuple[dict[str, Any], np.ndarray]:
    """Broadcast ``arrays`` over the config's and the layout defaults; check every rule
    (``balanced``: the layouts account for the embedding and the loss in the pipeline split).

    Returns the numbers (invalid rows replaced by safe values so the formulas stay finite) and the
    boolean ``valid`` array.
    """
    validate.one_of("on_invalid", on_invalid, ("raise", "nan"))
    n: dict[str, Any] = dict(_LAYOUT_DEFAULTS)
    if cfg is not None:
        n.update(model_numbers(cfg))
    unknown = set(arrays) - set(_SAFE) - set(n)
    if unknown:
        raise ValueError(f"unknown fields {sorted(unknown)}; valid: {sorted(set(_SAFE) | set(n))}")
    n.update({k: v for k, v in _derived(cfg, arrays).items() if v is not None})
    n.setdefault("shard_size", np.asarray(n["dp"]) * np.asarray(n["cp"]))
    keys = [k for k, v in n.items() if v is not None]
    shaped = np.broadcast_arrays(*(np.asarray(n[k]) for k in keys))
    n = dict(zip(keys, (np.array(a) for a in shaped)), **{k: None for k, v in n.items() if v is None})
    n["sequence_parallel"] = n["sequence_parallel"].astype(bool)
    shape = shaped[0].shape
    valid = np.ones(shape, dtype=bool)
    for ok, message, fields in broken_rules(n, schedule, offload, balanced):
        ok = np.broadcast_to(ok, shape)
        if on_invalid == "raise" and not ok.all():
            i = tuple(int(j) for j in np.argwhere(~ok)[0]) if ok.ndim else ()
            raise ValueError(f"configuration {i}: " + message(**{f: n[f][i].item() for f in fields}))
        valid &= ok
    if not valid.all():  # keep the arithmetic finite on rows that come back as NaN anyway
        # the safe row must itself follow the schedule's rules (interleaving: v >= 2, pp >= 2, m
        # a multiple of pp), since bubble_fraction and in_flight check them on the whole array
        # (DualPipe: pp even, m even and >= 2 pp; DualPipeV: v = 2, m >= 2 pp)
        pipeline = {"interleaved": dict(virtual_stages=2, pp=2, num_microbatches=2),
                    "dualpipe": dict(pp=2, num_microbatches=4),
                    "dualpipev": dict(virtual_stages=2, pp=2, num_microbatches=4)}.get(schedule, {})
        safe = dict(_SAFE, **pipeline)
        for k, v in n.items():
            if v is not None and safe.get(k) is not None:
                n[k] = np.where(valid, v, safe[k])
    return n, valid


def _nan_where_invalid(out: dict[str, Any], valid: np.ndarray) -> dict[str, Any]:
    for k, v in out.items():
        if isinstance(v, np.ndarray) and v.dtype.kind in "fi" and k != "stage":
            out[k] = np.where(valid, v.astype(float), np.nan)
    out["valid"] = valid
    return out


def memory_batch(cfg: "TransformerConfig | None" = None, *, precision: "Precision | str" = "zero",
                 recompute: str = "none", schedule: str = "1f1b", offload: str = "none",
                 dropout: bool | None = None, flash_attention: bool | None = None,
                 convention: str | None = None, stack: "str | None" = None, dtype: str = "bf16",
                 mask_bytes: float = 1, logits_bytes: float = 4,
                 norm_saved: float = 1, overhead_bytes: float = 0.0, on_invalid: str = "raise",
                 **arrays: Any) -> dict[str, np.ndarray]:
    """:func:`dtlib.analytic.memory.memory_per_gpu` over arrays: bytes per component on the most loaded GPU
    (the same activation convention and stack arguments).

    Without ``cfg`` pass ``params=`` (bare counts; activations come back as None).
    """
    for name, value, valid in (("recompute", recompute, RECOMPUTE_OPTIONS), ("schedule", schedule, SCHEDULES),
                               ("offload", offload, OFFLOAD)):
        validate.one_of(name, value, valid)
    counted, _ = activation_convention(convention, flash_attention, dropout)
    for name, value in (("overhead_bytes", overhead_bytes), ("mask_bytes", mask_bytes),
                        ("logits_bytes", logits_bytes), ("norm_saved", norm_saved)):
        validate.array(name, value, minimum=0, exclusive=False)
    if cfg is None and arrays.get("params") is None:
        raise ValueError("give a model config or params= (parameter counts)")
    n, valid = layout_arrays(cfg, arrays, schedule, offload, on_invalid)
    out = per_gpu_bytes(n, get_precision(precision), recompute=recompute, schedule=schedule,
                        offload=offload, **memory_options(counted, get_stack(stack), dtype), mask_bytes=mask_bytes,
                        logits_bytes=logits_bytes, norm_saved=norm_saved, overhead_bytes=overhead_bytes)
    out = {k: (None if v is None else np.broadcast_to(np.asarray(v, float), valid.shape).copy())
           for k, v in out.items()}
    return _nan_where_invalid(out, valid)


def flops_batch(cfg: TransformerConfig, *, batch: Any, step_time: Any = None, gpus: Any = None,
                gpu: "str | Accelerator" = "h100-sxm", dtype: str = "bf16", recompute: str = "none",
                attention: str = "full", count_logits: bool = True, **arrays: Any) -> dict[str, np.ndarray]:
    """:func:`dtlib.analytic.flops.flops_report` over arrays (``batch`` sequences per step, ``seq`` and
    model widths may be arrays); MFU/HFU when ``step_time`` and ``gpus`` are given."""
    shape = shape_of(cfg)
    unknown = set(arrays) - set(shape)
    if unknown:
        raise ValueError(f"unknown fields {sorted(unknown)}; valid: {sorted(shape)}")
    shape.update(_derived(cfg, arrays))
    validate.array("batch", batch, integer=True, minimum=1, exclusive=False)
    batch = np.asarray(batch)
    f = step_flops(batch * np.asarray(shape["seq"]), recompute=recompute, attention=attention,
                   count_logits=count_logits, **shape)
    out = {"model_flops_per_step": np.asarray(f["model"], float),
           "hardware_flops_per_step": np.asarray(f["hardware"], float)}
    if step_time is not None:
        if gpus is None:
            raise ValueError("MFU needs gpus as well as step_time")
        out["mfu"] = utilization(out["model_flops_per_step"], np.asarray(step_time), np.asarray(gpus), gpu, dtype)
        out["hfu"] = utilization(out["hardware_flops_per_step"], np.asarray(step_time), np.asarray(gpus), gpu, dtype)
    return out
