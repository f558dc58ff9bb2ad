"""Lesson 3's graded checks accept the correct answers (dtlib's and the hand-written formulas of the
solution) and reject the classic mistakes with a message naming the term and the cause; the
lesson's plots build."""
import math
import re

import pytest

from dtlib.grading.checks import memory as checks
from dtlib.analytic.memory import GB, GiB
from dtlib.analytic.precision import CONVENTIONS


def _fails_naming(message: str, call) -> None:
    """``call()`` fails with a message holding every ``.*``-separated part of ``message``: the
    verdict comes first, the case (``s=..., t=...``) on the next line."""
    with pytest.raises(AssertionError) as info:
        call()
    text = str(info.value)
    assert all(re.search(part, text) for part in message.split(".*")), text



# ---- the solution's formulas, as a learner writes them -----------------------------------------
def states(params, prec, zero, dp, tp=1, pp=1, *, optimizer=None, divide=None, stage_shift=0,
           mp_split=True):
    """Correct by default; the keyword arguments inject one mistake at a time."""
    base = params / (tp * pp) if mp_split else params
    group = dp if divide is None else divide
    opt = prec.master + prec.grad_copy + prec.states if optimizer is None else optimizer(prec)
    z = zero + stage_shift
    return {"parameters": prec.param * base / (group if z >= 3 else 1),
            "gradients": prec.grad * base / (group if z >= 2 else 1),
            "optimizer": opt * base / (group if z >= 1 else 1)}


def layer(s, b, h, a, t=1, sequence_parallel=False, recompute="none", *, score_div=None,
          outside_div=None, inside_div=None, keep_scores=False, full_div=None):
    sp = t if sequence_parallel else 1
    if recompute == "full":
        return 2 * s * b * h / (sp if full_div is None else full_div(t, sp))
    rest = s * b * h * (10 / (sp if outside_div is None else outside_div(t, sp))
                        + 24 / (t if inside_div is None else inside_div(t, sp)))
    scores = 5 * a * s * s * b / (t if score_div is None else score_div(t, sp))
    return rest + (scores if recompute == "none" or keep_scores else 0)


def first_stage(per_layer, layers, pp, num_microbatches, schedule, *, flight=None, split=None):
    lf = math.ceil(layers / pp) if split is None else split(layers, pp)
    if flight is not None:
        n = flight(pp, num_microbatches, schedule)
    elif pp == 1:
        n = 1
    else:
        n = num_microbatches if schedule == "gpipe" else min(num_microbatches, pp)
    return per_layer * lf * n


# ---- q1 -------------------------------------------------------------------------------------
def test_model_state_checks_accept_the_hand_written_formula():
    # the checks compare against dtlib's reference; the learner's side is the hand-written formula
    checks.check_zero_paper(states)
    checks.check_model_state_bytes(states)


def test_reference_reproduces_the_zero_paper():
    got = [sum(checks.reference_model_state_bytes(7.5e9, CONVENTIONS["zero"], z, 64).values()) / GB
           for z in range(4)]
    assert got == pytest.approx([120, 31.4, 16.6, 1.9], abs=0.05)


@pytest.mark.parametrize("mistake,message", [
    (dict(divide="total"), r"optimizer .*total GPU count dp\*tp\*pp = 128.*data-parallel group only"),
    (dict(optimizer=lambda p: p.grad_copy + p.states), r"optimizer .*forgot the fp32 master copy"),
    (dict(optimizer=lambda p: p.states), r"optimizer .*(forgot the fp32 master copy|more than Adam)"),
    (dict(optimizer=lambda p: p.total), r"optimizer .*not the whole bytes/param"),
    (dict(stage_shift=1), r"at ZeRO stage \d the (gradients|parameters) are not sharded \(they are from stage"),
    (dict(stage_shift=-1), r"ZeRO stage \d shards the (optimizer|gradients) over dp"),
    (dict(mp_split=False), r"parameters .*tensor and pipeline parallelism split the model"),
])
def test_model_state_check_names_the_classic_mistakes(mistake, message):
    if mistake.get("divide") == "total":
        def fn(params, prec, zero, dp, tp, pp):
            return states(params, prec, zero, dp, tp, pp, divide=dp * tp * pp)
    else:
        def fn(params, prec, zero, dp, tp, pp):
            return states(params, prec, zero, dp, tp, pp, **mistake)
    _fails_naming(message, lambda: checks.check_model_state_bytes(fn))


def test_an_unnamed_mistake_shows_its_case_on_the_first_line():
    """Only the first line shows before the details: numbers there need the configuration beside them."""
    with pytest.raises(AssertionError) as info:
        checks.check_model_state_bytes(lambda *a: {k: 1.37 * v for k, v in states(*a).items()})
    first = str(info.value).splitlines()[0]
    assert re.search(r"should be [\d,]+ bytes, yours is [\d,]+ for params=[\d,]+, precision .*dp=\d+", first), first
    assert first.endswith("re-read the question's description of this term") and len(first) <= 300


def test_megatron_grad_copy_and_fp32_gradients_are_checked():
    _fails_naming("zero=1, dp=64.*fp32 copy per parameter is missing", lambda: checks.check_model_state_bytes(lambda *a: states(*a, optimizer=lambda p: p.master + p.states)))
    _fails_naming("gradients .*prec.grad = 4", lambda: checks.check_model_state_bytes(
            lambda params, prec, zero, dp, tp, pp: {**states(params, prec, zero, dp, tp, pp),
                                                    "gradients": states(params, prec, zero, dp, tp, pp)[
                                                        "gradients"] * prec.param / prec.grad}))


def test_model_state_check_rejects_stubs_and_bad_returns():
    _fails_naming("returned None .*fill in the function", lambda: checks.check_zero_paper(lambda *a: None))
    _fails_naming("return a dict with keys", lambda: checks.check_zero_paper(lambda *a: 16 * a[0]))
    _fails_naming("return bytes, not GiB or GB", lambda: checks.check_zero_paper(lambda *a: {k: v / GiB for k, v in states(*a).items()}))
    _fails_naming("params=7,500,000,000.*zero=0, dp=64", lambda: checks.check_zero_paper(lambda *a: {k: 0.0 for k in checks.TERMS}))


# ---- q2 -------------------------------------------------------------------------------------
def test_layer_checks_accept_the_hand_written_formula():
    checks.check_layer_activation_bytes(layer, parallel=False)
    checks.check_layer_activation_bytes(layer)


def test_reference_reduces_to_korthikanti_22b():
    per_layer = checks.reference_layer_activation_bytes(2048, 4, 6144, 64, 8)
    assert 48 * per_layer / GiB == pytest.approx(59.25, rel=1e-12)
    per_layer = checks.reference_layer_activation_bytes(2048, 4, 6144, 64, 8, True, "selective")
    assert 48 * per_layer / GiB == pytest.approx(9.5625, rel=1e-12)


@pytest.mark.parametrize("mistake,parallel,message", [
    (dict(score_div=lambda t, sp: math.inf), False, r"attention-score term .*5\*a\*s\^2\*b/t is missing"),
    (dict(score_div=lambda t, sp: t * sp), True, r"sequence_parallel=True.*divided the attention-score term by t twice"),
    (dict(score_div=lambda t, sp: 1), True, r"t=8.*heads, so each GPU keeps 5\*a\*s\^2\*b/t"),
    (dict(keep_scores=True), False, r"recompute='selective'.*selective recompute drops exactly this term"),
    (dict(outside_div=lambda t, sp: t), True, r"sequence_parallel=False.*10\*s\*b\*h outside .*replicated"),
    (dict(outside_div=lambda t, sp: 1), True, r"sequence_parallel=True.*split over the sequence too"),
    (dict(inside_div=lambda t, sp: 1), True, r"24\*s\*b\*h inside attention and MLP: divide"),
    (dict(full_div=lambda t, sp: t), True, r"recompute='full'.*every TP rank keeps the whole layer input"),
    (dict(full_div=lambda t, sp: 1), True, r"recompute='full'.*kept layer input is split"),
])
def test_layer_check_names_the_classic_mistakes(mistake, parallel, message):
    _fails_naming(message, lambda: checks.check_layer_activation_bytes(lambda *a: layer(*a, **mistake), parallel=parallel))


def test_layer_check_full_recompute_and_stubs():
    def keeps_everything(s, b, h, a, t, sp, recompute):
        return layer(s, b, h, a, t, sp, "selective" if recompute == "full" else recompute)
    _fails_naming("keeps only each layer's input", lambda: checks.check_layer_activation_bytes(keeps_everything, parallel=False))
    _fails_naming("returned None", lambda: checks.check_layer_activation_bytes(lambda *a: None, parallel=False))
    _fails_naming("s=2048, b=1, h=4096, a=32, t=1", lambda: checks.check_layer_activation_bytes(lambda *a: 2 * layer(*a), parallel=False))


# ---- q3 -------------------------------------------------------------------------------------
def test_pipeline_check_accepts_the_hand_written_formula():
    checks.check_first_stage_activations(first_stage)


@pytest.mark.parametrize("mistake,message", [
    (dict(flight=lambda p, m, s: m), r"pp=1.*gradient-accumulation steps .*1 in flight"),
    (dict(flight=lambda p, m, s: 1 if p == 1 else min(m, p)), r"schedule='gpipe'.*GPipe runs all m forwards"),
    (dict(flight=lambda p, m, s: 1 if p == 1 else m), r"schedule='1f1b'.*min\(m, p\) micro-batches"),
    (dict(flight=lambda p, m, s: 1 if p == 1 else (m if s == "gpipe" else p)), r"only m = 4 micro-batches"),
    (dict(split=lambda l, p: l / p), r"layers=30, pp=4.*do not split evenly"),
    (dict(split=lambda l, p: l // p), r"ceil\(layers/pp\) = 8, not floor"),
])
def test_pipeline_check_names_the_classic_mistakes(mistake, message):
    _fails_naming(message, lambda: checks.check_first_stage_activations(lambda *a: first_stage(*a, **mistake)))


# ---- the lesson's plots -----------------------------------------------------------------------
def test_memory_plots_build_figures():
    from dtlib.viz import memory as viz
    figs = [
        viz.plot_bytes_per_param(CONVENTIONS),
        viz.plot_memory_curves([1, 2, 4], {"a": [GiB, 2 * GiB, 4 * GiB], "b": [GiB] * 3},
                               xlabel="x", gpu_memory=80 * GiB, gpu_name="H100"),
        viz.plot_recompute_tradeoff({"stored": {"saved_bytes": 6e7, "step_seconds": 0.3},
                                     "recomputed": {"saved_bytes": 5e6, "step_seconds": 0.45}}),
        viz.plot_predicted_vs_measured({"parameters": 10.0, "activations": 100.0},
                                       {"parameters": 10.0, "activations": 98.0}),
    ]
    bars, curves, tradeoff, versus = figs
    # what each byte per parameter holds: the stacked widths add up to the convention's total
    rows = {}
    for patch in bars.axes[0].patches:
        rows.setdefault(round(patch.get_y(), 6), []).append(patch.get_width())
    totals = sorted(round(sum(w), 9) for w in rows.values())
    assert totals == sorted(CONVENTIONS[n].total for n in CONVENTIONS)
    assert {CONVENTIONS["zero"].total, CONVENTIONS["megatron-bf16"].total} == {16, 18}  # 2+2+12, 2+4+4+8
    # memory curves in GiB, the GPU's memory as a dashed reference line with its label
    assert [list(line.get_ydata()) for line in curves.axes[0].get_lines()[:2]] == [[1, 2, 4], [1, 1, 1]]
    assert any("H100: 80 GiB" in t.get_text() for t in curves.axes[0].texts)
    assert [p.get_height() for p in tradeoff.axes[0].patches] == pytest.approx([6e7 / 2 ** 20, 5e6 / 2 ** 20])
    assert [p.get_height() for p in tradeoff.axes[1].patches] == pytest.approx([300, 450])
    assert [t.get_text() for t in versus.axes[0].texts] == ["+0.0%", "+2.0%"]
    with pytest.raises(ValueError, match="same components"):
        viz.plot_predicted_vs_measured({"a": 1.0}, {"b": 1.0})
    with pytest.raises(ValueError, match="one value per x"):
        viz.plot_memory_curves([1, 2], {"a": [1.0]})
