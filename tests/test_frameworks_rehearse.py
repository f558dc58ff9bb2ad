"""``--rehearse``'s numerics verdict (:mod:`dtlib.frameworks.rehearse`): PASS only for the parallel
dimensions the shrunk run exercised, never for one it dropped (pure: no framework runs here;
tests/test_frameworks_emit.py runs DeepSpeed, Megatron-Core and JAX)."""
import pytest

from dtlib.analytic.layout import Parallelism
from dtlib.analytic.presets import get_preset
from dtlib.frameworks.rehearse import RUNS, SHRUNK_AWAY, coverage, shrink_for, verdict


def _covered(framework, layout, model=None):
    shrunk, _, _ = shrink_for(framework, layout)
    return coverage(framework, layout, shrunk, model)


def test_tp8_pp8_under_deepspeed_rehearses_dp_and_zero_only():
    """DeepSpeed's runner here runs one data-parallel group x ZeRO: tp and pp never run, so a
    passing run says PASS for dp x zero and names tp and pp as not rehearsed."""
    layout = Parallelism(dp=2, tp=8, pp=8, zero=1, num_microbatches=8)
    rehearsed, why_not = _covered("deepspeed", layout)
    assert rehearsed == ["dp", "zero"]
    assert list(why_not) == ["tp", "pp"] and why_not["tp"] == RUNS["deepspeed"][1]
    kind, text = verdict(True, rehearsed, list(why_not))
    assert kind == "partial" and text == "PASS for dp x zero; tp, pp not rehearsed"


def test_tp8_pp8_at_zero_0_under_deepspeed_is_not_a_pass_of_anything_planned():
    """The issue's case: dp 1 x tp 8 x pp 8 runs one rank at ZeRO-0; the verdict is PASS for one
    process only, every planned dimension listed as not rehearsed."""
    layout = Parallelism(tp=8, pp=8, sequence_parallel=True, num_microbatches=8)
    rehearsed, why_not = _covered("deepspeed", layout)
    assert rehearsed == [] and list(why_not) == ["tp", "pp", "sp"]
    assert verdict(True, rehearsed, list(why_not)) == ("partial", "PASS for one process; tp, pp, sp not rehearsed")


def test_an_expert_parallel_moe_plan_under_megatron_names_ep_and_moe_as_not_rehearsed():
    """Megatron-Core's runner here trains a dense 4-layer GPT: expert parallelism and the MoE
    layers themselves are not rehearsed, whatever the losses say."""
    model = get_preset("mixtral-8x7b")
    layout = Parallelism(dp=8, tp=2, ep=8, num_microbatches=8)
    rehearsed, why_not = _covered("megatron", layout, model)
    assert rehearsed == ["dp", "tp"]
    assert list(why_not) == ["ep", "moe"] and "dense" in why_not["moe"]
    kind, text = verdict(True, rehearsed, list(why_not))
    assert kind == "partial" and "PASS for dp x tp; ep, moe not rehearsed" == text


def test_a_dimension_the_runner_keeps_but_the_shrink_drops_says_so():
    """Four dimensions need 16 ranks at size 2: the shrink drops cp first (dtlib.trainer.shrink)."""
    layout = Parallelism(dp=4, tp=4, pp=2, cp=2, num_microbatches=8)
    rehearsed, why_not = _covered("megatron", layout)
    assert "cp" in why_not and "cp" not in rehearsed
    assert why_not["cp"] == RUNS["megatron"][1]  # the runner has no cp, so its reason, not the shrink's
    rehearsed, why_not = coverage("megatron", Parallelism(dp=2, tp=2, pp=2), Parallelism(dp=2, tp=2))
    assert rehearsed == ["dp", "tp"] and why_not == {"pp": SHRUNK_AWAY}


def test_a_run_that_exercised_everything_planned_passes_and_a_wrong_one_fails():
    layout = Parallelism(dp=2, tp=2, pp=2, num_microbatches=4)
    rehearsed, why_not = _covered("megatron", layout)
    assert rehearsed == ["dp", "tp", "pp"] and why_not == {}
    assert verdict(True, rehearsed, []) == ("pass", "PASS for dp x tp x pp")
    assert verdict(False, rehearsed, ["zero"]) == ("fail", "FAIL for dp x tp x pp")
