"""Checks for the profiling exercise: reading three saved profiles, and MFU from a step time.

* :data:`SAVED_PROFILES` - three 4-rank step breakdowns (seconds per step of each part), as
  ``dtlib.profile`` reports them; :func:`check_diagnosis` compares the learner's
  ``{"A": {"bottleneck": kind, "fix": letter}, ...}`` with what :func:`dtlib.profile.diagnose`
  finds first, and names the evidence to look at when the answer is wrong. :data:`FIX_MENU`
  lists the fixes by letter.
* :func:`check_mfu` - the learner's ``mfu(step_time, batch, seq, params, layers, hidden, gpus,
  peak)`` against the PaLM convention (Chowdhery et al. 2022, App. B: ``6N + 12 L H Q T``
  training FLOPs per token, H x Q = hidden), :func:`dtlib.analytic.flops.palm_flops_per_token`
  and :func:`~dtlib.analytic.flops.utilization`, on several models; the classic mistakes
  (forward only, no attention, the GPUs forgotten, per sequence instead of per token) are named.
"""
from __future__ import annotations

import math
from typing import Any, Callable

from dtlib.analytic.flops import palm_flops_per_token, utilization
from dtlib.analytic.hardware import Accelerator, get_gpu
from dtlib.profile import FIXES, KINDS, diagnose

__all__ = ["SAVED_PROFILES", "FIX_MENU", "check_diagnosis", "check_mfu", "MFU_CASES"]


def _profile(rows: dict[int, dict[str, float]], mfu: float, hfu: float) -> dict[str, Any]:
    breakdown = {}
    for rank, parts in rows.items():
        row = {p: parts.get(p, 0.0) for p in ("compute", "exposed_comm", "bubble", "data", "optimizer",
                                              "other", "overlapped_comm", "host_gaps")}
        row["step"] = sum(row[p] for p in ("compute", "exposed_comm", "bubble", "data", "optimizer", "other"))
        breakdown[rank] = row
    return {"breakdown": breakdown, "step_time": max(r["step"] for r in breakdown.values()),
            "mfu": mfu, "hfu": hfu}


# A: three ranks wait in their all-reduce while rank 2 sits idle: a straggler, not the network.
# B: every rank spends a third of the step in the data loader.
# C: 4 pipeline stages wait for their neighbours more than half of the step.
SAVED_PROFILES: dict[str, dict[str, Any]] = {
    "A": _profile({0: {"compute": 0.210, "exposed_comm": 0.270, "optimizer": 0.01, "other": 0.004},
                   1: {"compute": 0.205, "exposed_comm": 0.276, "optimizer": 0.01, "other": 0.003},
                   2: {"compute": 0.212, "exposed_comm": 0.012, "optimizer": 0.01, "other": 0.260},
                   3: {"compute": 0.208, "exposed_comm": 0.273, "optimizer": 0.01, "other": 0.005}},
                  mfu=0.21, hfu=0.21),
    "B": _profile({r: {"compute": 0.30, "exposed_comm": 0.02, "data": 0.17, "optimizer": 0.01,
                       "other": 0.01, "overlapped_comm": 0.05} for r in range(4)}, mfu=0.28, hfu=0.28),
    "C": _profile({r: {"compute": 0.12, "bubble": 0.19 + 0.01 * r, "optimizer": 0.005,
                       "other": 0.01} for r in range(4)}, mfu=0.15, hfu=0.15),
}
# letters in an order unrelated to KINDS, so the position gives nothing away
FIX_MENU: dict[str, str] = {letter: FIXES[kind] for letter, kind in zip(
    "abcdef", ("launch", "bubble", "recompute", "straggler", "communication", "input"))}
_EVIDENCE = {
    "communication": "compare exposed_comm across ranks: communication is the bottleneck only if "
                     "even the rank that waits least waits long",
    "straggler": "one rank has little exposed_comm but a lot of 'other' (busy elsewhere) while the "
                 "others wait in their collectives for it",
    "input": "look at the 'data' column: the step waits for the loader",
    "bubble": "look at the 'bubble' column: stages wait for their neighbours (pipeline)",
    "launch": "look at host_gaps: time between operators inside forward/backward",
    "recompute": "compare HFU with MFU: a gap means work done twice",
}


def check_diagnosis(answers: Any, profile: str | None = None) -> None:
    """``answers[name] = {"bottleneck": one of KINDS, "fix": a letter of FIX_MENU}`` for A, B, C;
    only ``answers[profile]`` is judged when ``profile`` is given (one point per profile: the
    three diagnoses are independent)."""
    if not isinstance(answers, dict) or set(answers) != set(SAVED_PROFILES):
        raise AssertionError(f"answers must be a dict with keys {sorted(SAVED_PROFILES)}, e.g. "
                             "{'A': {'bottleneck': ..., 'fix': ...}, ...}")
    for name in [profile] if profile else SAVED_PROFILES:
        if name not in SAVED_PROFILES:
            raise ValueError(f"profile must be one of {sorted(SAVED_PROFILES)}, got {name!r}")
        answer = answers[name]
        if not isinstance(answer, dict) or not {"bottleneck", "fix"} <= set(answer):
            raise AssertionError(f"answers[{name!r}] must be a dict with 'bottleneck' and 'fix'")
        kind, fix = answer["bottleneck"], answer["fix"]
        if kind not in KINDS:
            raise AssertionError(f"profile {name}: bottleneck {kind!r} is not one of {KINDS}")
        truth = diagnose(SAVED_PROFILES[name])[0].kind
        if kind != truth:
            hint = _EVIDENCE[truth] if kind != "communication" else _EVIDENCE["communication"]
            raise AssertionError(f"profile {name}: not {kind!r}; {hint}")
        if fix not in FIX_MENU:
            raise AssertionError(f"profile {name}: fix must be one letter of FIX_MENU "
                                 f"({', '.join(FIX_MENU)}), got {fix!r}")
        if FIX_MENU[fix] != FIXES[truth]:
            raise AssertionError(f"profile {name}: fix {fix!r} does not address a {truth} "
                                 f"bottleneck (it says: {FIX_MENU[fix][:60]}...)")


# (step_time s, batch sequences, seq, non-embedding params, layers, hidden, gpus, GPU)
MFU_CASES = [(6.0, 512, 8192, 7.5e9, 32, 4096, 64, "h100-sxm"),
             (1.2, 256, 2048, 1.3e9, 24, 2048, 8, "a100-80gb"),
             (0.35, 16, 1024, 85e6, 12, 768, 1, "h100-sxm")]


def _reference(step_time, batch, seq, params, layers, hidden, gpus, peak) -> float:
    per_token = palm_flops_per_token(params, layers, 1, hidden, seq)  # H x Q = hidden
    acc = Accelerator("exercise", {"bf16": peak}, 0, 0.0, "the peak the exercise passes")
    return utilization(per_token * batch * seq, step_time, gpus, acc, "bf16")


def check_mfu(fn: Callable[..., float]) -> None:
    """``fn(step_time, batch, seq, params, layers, hidden, gpus, peak)`` -> MFU (a fraction)."""
    for step_time, batch, seq, params, layers, hidden, gpus, gpu in MFU_CASES:
        peak = get_gpu(gpu).peak("bf16")
        args = (step_time, batch, seq, params, layers, hidden, gpus, peak)
        got = fn(*args)
        want = _reference(*args)
        where = f"mfu{args}"
        if got is None or not isinstance(got, (int, float)) or not math.isfinite(got):
            raise AssertionError(f"{where} returned {got!r}: return the MFU as a number, e.g. 0.4")
        if math.isclose(got, want, rel_tol=1e-6):
            continue
        tokens = batch * seq
        forward_only = (2 * params + 4 * layers * hidden * seq) * tokens / (step_time * gpus * peak)
        no_attention = 6 * params * tokens / (step_time * gpus * peak)
        if math.isclose(got, want * 100, rel_tol=1e-6):
            raise AssertionError(f"{where} = {got:.4g}: return a fraction (0.4), not a percentage")
        if math.isclose(got, forward_only, rel_tol=1e-6):
            raise AssertionError(f"{where}: you counted the forward pass only; a training step is "
                                 "forward + backward (see the FLOPs per token in Q2)")
        if math.isclose(got, no_attention, rel_tol=1e-6):
            raise AssertionError(f"{where}: the attention term is missing from the FLOPs per token "
                                 "(QK^T and AV; see Q2)")
        if math.isclose(got, want * gpus, rel_tol=1e-6) and gpus > 1:
            raise AssertionError(f"{where}: the step ran on {gpus} GPUs: divide by all the GPUs' peak")
        if math.isclose(got, want / seq, rel_tol=1e-6):
            raise AssertionError(f"{where}: the FLOPs are per token: count every token of the step")
        raise AssertionError(f"{where} = {got:.4g}, expected {want:.4g}: re-read Q2's FLOPs per token "
                             "and what MFU compares them with")
