"""Checks for the memory exercise (where the memory goes).

Each check calls the learner's function on many configurations (a few hand-picked, teaching ones
first, then random ones), compares it with :mod:`dtlib` (the tested reference), and on the first
difference names the configuration, the term that is wrong and, for the classic mistakes, why:

* q1 :func:`check_zero_paper`, :func:`check_model_state_bytes` -- model states per GPU
  (:func:`dtlib.analytic.memory.memory_per_gpu` on a bare parameter count; Rajbhandari et al. 2020, Sec. 5);
* q2 :func:`check_layer_activation_bytes` -- activations of one GPT layer
  (:func:`dtlib.analytic.activations.layer_bytes`; Korthikanti et al. 2022, Table 2);
* q3 :func:`check_first_stage_activations` -- pipeline micro-batches in flight on the first stage
  (:func:`dtlib.analytic.layout.in_flight`, :func:`dtlib.analytic.layout.stage_layers`).

The ``reference_*`` functions are the answers written with :mod:`dtlib` (no formula is repeated
here); the tests run every check against them and against the classic mistakes.
"""
from __future__ import annotations

import math
import random
import re
from typing import Any, Callable, Iterator

from dtlib.analytic.activations import layer_bytes
from dtlib.analytic.memory import GB, memory_per_gpu
from dtlib.analytic.layout import Parallelism, in_flight, stage_layers
from dtlib.analytic.precision import CONVENTIONS, Precision
from dtlib.grading.hint_policy import MAX_FIRST_LINE

__all__ = ["reference_model_state_bytes", "reference_layer_activation_bytes",
           "reference_first_stage_activations", "check_zero_paper", "check_model_state_bytes",
           "check_layer_activation_bytes", "check_first_stage_activations", "TERMS"]

TERMS = ("parameters", "gradients", "optimizer")
_REL = 1e-9


# ---- the answers, written with dtlib ----------------------------------------------------------
def reference_model_state_bytes(params: float, prec: Precision, zero: int, dp: int, tp: int = 1,
                                pp: int = 1) -> dict[str, float]:
    """Bytes of parameters, gradients and optimizer states on one GPU (q1)."""
    m = memory_per_gpu(params, Parallelism(dp=dp, tp=tp, pp=pp, zero=zero), precision=prec)
    return {t: getattr(m, t) for t in TERMS}


def reference_layer_activation_bytes(s: int, b: int, h: int, a: int, t: int = 1,
                                     sequence_parallel: bool = False, recompute: str = "none") -> float:
    """Bytes one GPT layer keeps for backward, per micro-batch, on one GPU (q2): 16-bit
    activations, 1-byte dropout masks, multi-head attention, FFN 4h (the paper's setting)."""
    return float(layer_bytes(s, b, h, a, a, 4 * h, tp=t, sequence_parallel=sequence_parallel,
                             recompute=recompute))


def reference_first_stage_activations(per_layer: float, layers: int, pp: int, num_microbatches: int,
                                      schedule: str) -> float:
    """Peak activation bytes on the first pipeline stage (q3)."""
    first_layers, _ = stage_layers(layers, pp)
    first_in_flight, _ = in_flight(schedule, pp, num_microbatches)
    return float(per_layer * first_layers * first_in_flight)


# ---- helpers ----------------------------------------------------------------------------------
def _close(got: Any, want: float) -> bool:
    try:
        return math.isclose(float(got), float(want), rel_tol=_REL, abs_tol=1e-6)
    except (TypeError, ValueError):
        return False


def _number(got: Any, what: str, where: str) -> float:
    if got is None:
        raise AssertionError(f"{what} returned None for {where}: fill in the function and return a "
                             "number of bytes")
    if isinstance(got, bool):
        raise AssertionError(f"{what} returned a bool ({got}) for {where}: return a number of bytes")
    try:
        return float(got)
    except (TypeError, ValueError):
        raise AssertionError(f"{what} returned {got!r} for {where}: return a number of bytes") from None


def _diagnose(got: float, want: float, candidates: list[tuple[float, str]]) -> str:
    """The first known mistake whose value equals ``got``, else a unit hint or ''."""
    for value, hint in candidates:
        if not _close(value, want) and _close(got, value):
            return hint
    if want and (_close(got * 2 ** 30, want) or _close(got * GB, want)):
        return "return bytes, not GiB or GB"
    return ""


def _fail(where: str, term: str, want: float, got: float, hint: str) -> AssertionError:
    """The likely mistake first (one line), the case and both numbers on the next; never the
    formula (dtlib.grading.hint_policy)."""
    shown = f"{got:,.0f}" if abs(got) >= 1 else f"{got:.6g}"
    numbers = f"{term} should be {want:,.0f} bytes, yours is {shown}"
    if hint:
        return AssertionError(f"{term}: {hint}\n{where}: {numbers}")
    # a mistake the checks cannot name: the first line (all the learner sees at first) carries the
    # case with the numbers, its precision breakdown dropped if the line would be too long
    case = where if len(where) + len(numbers) <= MAX_FIRST_LINE - 70 else re.sub(r" \([^)]*\)", "", where)
    return AssertionError(f"{numbers} for {case}: re-read the question's description of this term\n{where}")


# ---- q1: model states ------------------------------------------------------------------------
def _prec_name(prec: Precision) -> str:
    for name, p in CONVENTIONS.items():
        if p == prec:
            return name
    return prec.name


def _state_where(params: float, prec: Precision, zero: int, dp: int, tp: int, pp: int) -> str:
    return (f"params={params:,.0f}, precision {_prec_name(prec)!r} (param {prec.param:g} + grad "
            f"{prec.grad:g} + master {prec.master:g} + grad_copy {prec.grad_copy:g} + states "
            f"{prec.states:g} bytes/param), zero={zero}, dp={dp}, tp={tp}, pp={pp}")


def _state_candidates(term: str, params: float, prec: Precision, zero: int, dp: int, tp: int,
                      pp: int) -> list[tuple[float, str]]:
    """The values the classic mistakes give for ``term``, with their explanation."""
    stage = {"parameters": 3, "gradients": 2, "optimizer": 1}[term]
    per_param = {"parameters": prec.param, "gradients": prec.grad, "optimizer": prec.optimizer}[term]
    mp = tp * pp
    sharded = zero >= stage
    shard = dp if sharded else 1
    c: list[tuple[float, str]] = []
    if sharded:
        c.append((per_param * params / mp / (dp * mp),
                  f"you divided by the total GPU count dp*tp*pp = {dp * mp} after splitting over "
                  f"tp*pp: ZeRO shards the {term} over the data-parallel group only (dp = {dp}); "
                  "the tensor- and pipeline-parallel ranks already hold different parameters"))
        c.append((per_param * params / dp,
                  "you forgot that tensor and pipeline parallelism split the model: each GPU starts "
                  "from params / (tp*pp), and ZeRO divides that by dp"))
        c.append((per_param * params / mp,
                  f"ZeRO stage {zero} shards the {term} over dp (stage 1: optimizer; 2: + gradients; "
                  "3: + parameters; each stage keeps the sharding of the previous ones): divide by dp"))
    else:
        c.append((per_param * params / mp / dp,
                  f"at ZeRO stage {zero} the {term} are not sharded (they are from stage {stage}): "
                  "every data-parallel rank holds a full copy"))
        c.append((per_param * params,
                  "you forgot that tensor and pipeline parallelism split the model: each GPU holds "
                  "params / (tp*pp)"))
    if term == "optimizer" and prec.master == prec.grad_copy > 0:
        c.append(((prec.master + prec.states) * params / mp / shard,
                  f"one {prec.master:g}-byte fp32 copy per parameter is missing: the optimizer owns "
                  "both the fp32 master weights (prec.master) and Megatron's fp32 gradient copy "
                  "(prec.grad_copy), besides Adam's states"))
    if term == "optimizer":
        c.append(((prec.grad_copy + prec.states) * params / mp / shard,
                  f"you forgot the fp32 master copy of the weights (prec.master = {prec.master:g} "
                  "bytes/param): mixed-precision training keeps it in the optimizer (Micikevicius "
                  "et al. 2018), and ZeRO stage 1 shards it with Adam's states"))
        c.append((prec.states * params / mp / shard,
                  f"the optimizer owns more than Adam's states ({prec.states:g} bytes/param): add "
                  f"the fp32 master weights (prec.master = {prec.master:g}) and any fp32 gradient "
                  f"copy (prec.grad_copy = {prec.grad_copy:g})"))
        c.append(((prec.master + prec.states) * params / mp / shard,
                  f"you left out Megatron's fp32 gradient copy (prec.grad_copy = {prec.grad_copy:g} "
                  "bytes/param), which the optimizer owns"))
        c.append((prec.total * params / mp / shard,
                  "the optimizer term is the optimizer's bytes only (master + grad_copy + states), "
                  "not the whole bytes/param"))
    if term == "gradients":
        c.append((prec.param * params / mp / shard,
                  f"gradients take prec.grad = {prec.grad:g} bytes/param (Megatron keeps fp32 "
                  "gradients), not prec.param"))
    return c


def _check_states(fn: Callable, params: float, prec: Precision, zero: int, dp: int, tp: int,
                  pp: int) -> None:
    where = _state_where(params, prec, zero, dp, tp, pp)
    got = fn(params, prec, zero, dp, tp, pp)
    if got is None:
        raise AssertionError(f"model_state_bytes returned None for {where}: fill in the function "
                             "and return a dict with keys 'parameters', 'gradients', 'optimizer'")
    if not hasattr(got, "keys") or not set(TERMS) <= set(got.keys()):
        raise AssertionError(f"return a dict with keys {list(TERMS)} (bytes on one GPU), got {got!r}")
    want = reference_model_state_bytes(params, prec, zero, dp, tp, pp)
    for term in TERMS:
        value = _number(got[term], f"model_state_bytes(...)[{term!r}]", where)
        if not _close(value, want[term]):
            candidates = _state_candidates(term, params, prec, zero, dp, tp, pp)
            raise _fail(where, term, want[term], value, _diagnose(value, want[term], candidates))


def check_zero_paper(fn: Callable) -> None:
    """ZeRO paper (Rajbhandari et al. 2020, Fig. 1): 7.5B parameters, 64 GPUs, 2+2+12 bytes/param:
    120 / 31.4 / 16.6 / 1.9 GB of model states per GPU at stages 0 / 1 / 2 / 3."""
    for zero in range(4):
        _check_states(fn, 7.5e9, CONVENTIONS["zero"], zero, 64, 1, 1)


def _state_configs(trials: int, seed: int) -> Iterator[tuple]:
    # teaching cases first: each adds one idea (grad copy, fp32 grads, TP, PP, no mixed precision)
    yield 8.03e9, CONVENTIONS["megatron-bf16"], 2, 16, 1, 1
    yield 7.5e9, CONVENTIONS["megatron-fp16"], 1, 64, 1, 1
    yield 70.6e9, CONVENTIONS["zero"], 1, 16, 8, 1
    yield 70.6e9, CONVENTIONS["megatron-bf16"], 3, 4, 8, 2
    yield 1.3e9, CONVENTIONS["fp32"], 2, 8, 1, 4
    rng = random.Random(seed)
    precs = list(CONVENTIONS.values())
    for _ in range(trials):
        yield (rng.randrange(10 ** 6, 10 ** 12), rng.choice(precs), rng.randrange(4),
               rng.choice([1, 2, 4, 8, 16, 32, 64, 128, 512]), rng.choice([1, 2, 4, 8]),
               rng.choice([1, 2, 4, 8, 16]))


def check_model_state_bytes(fn: Callable, trials: int = 200, seed: int = 3) -> None:
    """``fn(params, prec, zero, dp, tp, pp)`` -> ``{'parameters', 'gradients', 'optimizer'}`` bytes
    per GPU equals :func:`dtlib.analytic.memory.memory_per_gpu` on every precision convention, ZeRO stage
    and dp/tp/pp layout tried."""
    for config in _state_configs(trials, seed):
        _check_states(fn, *config)


# ---- q2: activations of one layer ------------------------------------------------------------
def _layer_where(s: int, b: int, h: int, a: int, t: int, sp: bool, recompute: str) -> str:
    return f"s={s}, b={b}, h={h}, a={a}, t={t}, sequence_parallel={sp}, recompute={recompute!r}"


def _layer_configs(parallel: bool, trials: int, seed: int) -> Iterator[tuple]:
    # teaching cases first: one GPU, then each idea of Korthikanti's Table 2 on its own
    yield 2048, 1, 4096, 32, 1, False, "none"
    yield 2048, 4, 6144, 64, 1, False, "selective"
    yield 2048, 4, 6144, 64, 1, False, "full"
    if parallel:
        yield 2048, 4, 6144, 64, 8, False, "none"       # the paper's 22B setting
        yield 2048, 4, 6144, 64, 8, True, "none"
        yield 2048, 4, 6144, 64, 8, False, "selective"
        yield 2048, 4, 6144, 64, 8, True, "selective"
        yield 2048, 4, 6144, 64, 8, False, "full"
        yield 2048, 4, 6144, 64, 8, True, "full"
    rng = random.Random(seed)
    for _ in range(trials):
        a = rng.choice([8, 16, 32, 64, 96, 128])
        t = rng.choice([1, 2, 4, 8]) if parallel else 1
        yield (rng.choice([512, 1024, 2048, 4096, 8192]), rng.randrange(1, 17), a * rng.choice([64, 128]),
               a, t, parallel and rng.random() < 0.5, rng.choice(["none", "selective", "full"]))


def _check_layer(fn: Callable, s: int, b: int, h: int, a: int, t: int, sp: bool, recompute: str) -> None:
    where = _layer_where(s, b, h, a, t, sp, recompute)
    what = "layer_activation_bytes"
    got = _number(fn(s, b, h, a, t, sp, recompute), what, where)
    want = reference_layer_activation_bytes(s, b, h, a, t, sp, recompute)
    if _close(got, want):
        return
    # Only the attention scores grow with the head count a: doubling a splits the learner's
    # answer into the score term and the rest, so the message can name the wrong term.
    got_scores = _number(fn(s, b, h, 2 * a, t, sp, recompute), what, where) - got
    want_scores = reference_layer_activation_bytes(s, b, h, 2 * a, t, sp, recompute) - want
    got_rest, want_rest = got - got_scores, want - want_scores
    sbh, scores = s * b * h, 5 * a * s * s * b
    if not _close(got_scores, want_scores):
        if recompute == "none":
            candidates = [
                (0.0, "the attention-score term 5*a*s^2*b/t is missing: the s x s softmax output, "
                      "its dropout mask and the dropout output are kept for every head (Korthikanti "
                      "et al. 2022, Sec. 4.1)"),
                (scores / t / t, "you divided the attention-score term by t twice: tensor parallelism "
                                 "already splits the scores by heads, and sequence parallelism does not "
                                 "touch them (it splits only the 10*s*b*h outside the TP regions)"),
                (scores, "tensor parallelism splits the heads, so each GPU keeps 5*a*s^2*b/t of "
                         "scores: divide by t"),
                (2 * a * s * s * b / t, "keep all three s x s tensors: softmax output (2 bytes), "
                                        "dropout mask (1 byte) and dropout output (2 bytes)"),
            ]
        else:
            what_kept = ("selective recompute drops exactly this term: QK^T, softmax, dropout and "
                         "attention over V are recomputed in backward (Sec. 5)" if recompute == "selective"
                         else "full recompute keeps only each layer's input")
            candidates = [(got_scores, what_kept)]
        raise _fail(where, "the attention scores (the term that grows with a)", want_scores,
                    got_scores, _diagnose(got_scores, want_scores, candidates))
    if recompute == "full":
        candidates = [
            (2 * sbh / t, "without sequence parallelism every TP rank keeps the whole layer input: "
                          "2*s*b*h, not divided by t"),
            (2 * sbh, "with sequence parallelism the kept layer input is split over the sequence: "
                      "2*s*b*h/t"),
            (34 * sbh / (t if sp else 1), "full recompute keeps only each layer's input (2 bytes "
                                          "per element), not the 34*s*b*h of the whole layer"),
        ]
    else:
        candidates = [
            (34 * sbh / t, "without sequence parallelism, the 10*s*b*h outside the tensor-parallel "
                           "regions (layer-norm inputs, residual dropout masks) is replicated on every "
                           "TP rank: only the 24*s*b*h inside attention and MLP is divided by t"),
            (sbh * (10 + 24 / t), "with sequence parallelism the 10*s*b*h outside the TP regions is "
                                  "split over the sequence too: s*b*h*34/t"),
            (34 * sbh, "tensor parallelism splits the 24*s*b*h inside attention and MLP: divide "
                       "that part by t"),
        ]
    raise _fail(where, "the s*b*h terms", want_rest, got_rest, _diagnose(got_rest, want_rest, candidates))


def check_layer_activation_bytes(fn: Callable, parallel: bool = True, trials: int = 200,
                                 seed: int = 7) -> None:
    """``fn(s, b, h, a, t, sequence_parallel, recompute)`` equals
    :func:`dtlib.analytic.activations.layer_bytes` for a GPT layer (Korthikanti et al. 2022, Table 2);
    ``parallel=False`` tries one GPU only (t=1, no sequence parallelism)."""
    for config in _layer_configs(parallel, trials, seed):
        _check_layer(fn, *config)


# ---- q3: micro-batches in flight on the first pipeline stage ----------------------------------
def _pipeline_configs(trials: int, seed: int) -> Iterator[tuple]:
    # teaching cases first: no pipeline, GPipe, 1F1B with m > p, 1F1B with m < p, an uneven split
    yield 1e9, 24, 1, 8, "gpipe"
    yield 1e9, 24, 4, 12, "gpipe"
    yield 1e9, 24, 4, 12, "1f1b"
    yield 1e9, 24, 8, 4, "1f1b"
    yield 1e9, 30, 4, 8, "1f1b"
    rng = random.Random(seed)
    for _ in range(trials):
        pp = rng.choice([1, 2, 3, 4, 8, 16])
        yield (float(rng.randrange(10 ** 6, 10 ** 10)), rng.randrange(pp, 129), pp,
               rng.randrange(1, 65), rng.choice(["gpipe", "1f1b"]))


def check_first_stage_activations(fn: Callable, trials: int = 200, seed: int = 11) -> None:
    """``fn(per_layer, layers, pp, num_microbatches, schedule)`` equals per-layer bytes x layers on the
    first stage x micro-batches in flight there (:func:`dtlib.analytic.layout.in_flight`)."""
    for per_layer, layers, pp, m, schedule in _pipeline_configs(trials, seed):
        where = f"per_layer={per_layer:,.0f}, layers={layers}, pp={pp}, num_microbatches={m}, schedule={schedule!r}"
        got = _number(fn(per_layer, layers, pp, m, schedule), "first_stage_activations", where)
        want = reference_first_stage_activations(per_layer, layers, pp, m, schedule)
        if _close(got, want):
            continue
        lf = -(-layers // pp)
        flight = want / (per_layer * lf)
        candidates = [
            (per_layer * layers / pp * flight, f"{layers} layers do not split evenly over {pp} stages: "
                                               f"the first stage holds ceil(layers/pp) = {lf}"),
            (per_layer * (layers // pp) * flight, f"the first stage gets the extra layers of an uneven "
                                                  f"split: ceil(layers/pp) = {lf}, not floor"),
            (per_layer * layers * flight, "each stage holds only its own layers: ceil(layers/pp)"),
        ]
        if pp == 1:
            candidates.append((per_layer * lf * m, "without pipeline parallelism (pp=1) the "
                               "micro-batches are gradient-accumulation steps run one after the "
                               "other: 1 in flight"))
        elif schedule == "gpipe":
            candidates += [(per_layer * lf * min(m, pp), "GPipe runs all m forwards before the first "
                            "backward, so the first stage holds all m micro-batches (Huang et al. 2019)"),
                           (per_layer * lf, "GPipe keeps every micro-batch's activations until its "
                            "backward: m in flight")]
        else:
            candidates += [(per_layer * lf * m, "1F1B starts backward after at most p forwards and "
                            "then alternates one forward, one backward: the first stage holds "
                            "min(m, p) micro-batches (Narayanan et al. 2021, Sec. 2.2)"),
                           (per_layer * lf * pp, f"there are only m = {m} micro-batches, fewer than "
                            f"the p = {pp} the warm-up would start: min(m, p)"),
                           (per_layer * lf, "the first stage of 1F1B holds min(m, p) micro-batches "
                            "(the last stage holds 1)")]
        raise _fail(where, "the first stage's activations", want, got, _diagnose(got, want, candidates))
