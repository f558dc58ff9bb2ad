"""DualPipe and DualPipeV as pipeline schedules (DeepSeek-V3 report, Sec. 3.2.1 and Table 2;
deepseek-ai/DualPipe 3da1bbe): their rules, a rank's two stages, the micro-batches in flight and the
bubble replayed from the upstream schedules' steps and from PyTorch's own DualPipeV order, and what the
planner, torchtitan's split and the other emitters do with them."""
from __future__ import annotations

import numpy as np
import pytest

from dtlib.analytic.presets import get_preset
from dtlib.analytic.comm import bubble_fraction
from dtlib.analytic.hardware import cluster
from dtlib.analytic.layout import Parallelism, in_flight
from dtlib.analytic.memory import rank_parameters
from dtlib.analytic.stages import dualpipe_stages, rank_layers, stored_on_rank
from dtlib.plan.emit import megatron, torchtitan
from dtlib.plan.search import search
from dtlib.plan.stages import slowest_stage
from dtlib.plan.steptime import StepOptions, step_time


@pytest.mark.parametrize("layout, match", [
    (dict(pp=3, num_microbatches=6), "dualpipe schedule needs an even pp >= 2"),
    (dict(pp=1, num_microbatches=2), "dualpipe schedule needs an even pp >= 2"),
    (dict(pp=4, num_microbatches=9), "even num_microbatches >= 2 x pp = 8"),
    (dict(pp=4, num_microbatches=6), r"even num_microbatches >= 2 x pp = 8 \(.*\), got 6"),
    (dict(pp=4, num_microbatches=8, virtual_stages=2), "virtual_stages=2 needs schedule='interleaved'"),
])
def test_dualpipe_rules_name_the_value_and_the_valid_range(layout, match):
    with pytest.raises(ValueError, match=match):
        Parallelism(schedule="dualpipe", **layout)
    with pytest.raises(ValueError, match=match):
        bubble_fraction(layout["pp"], layout["num_microbatches"], layout.get("virtual_stages", 1), "dualpipe")


def test_a_rank_holds_its_stage_and_the_mirror_one():
    assert [tuple(int(x) for x in dualpipe_stages(r, 8)) for r in range(8)] == [
        (0, 7), (1, 6), (2, 5), (3, 4), (3, 4), (2, 5), (1, 6), (0, 7)]


def _upstream_peak(pp: int, rank: int) -> tuple[int, int]:
    """The forwards in flight of each phase at the rank's peak, replayed from the step counts of
    ``DualPipe.step`` (steps 1-3, then step 4's first forward): phase 0 is the rank's first-half stage."""
    half, hr = pp // 2, min(rank, pp - 1 - rank)
    held, peak = [0, 0], (0, 0)
    events = [(0, +1)] * ((half - hr - 1) * 2)            # step 1: nF0
    events += [(0, +1), (1, +1)] * (hr + 1)                # step 2: nF0F1
    events += [(1, -1), (1, +1)] * (half - hr - 1)         # step 3: nB1W1F1
    events += [(0, +1), (1, -1), (1, +1), (0, -1)]         # step 4's first F0 B1 F1 B0
    for phase, change in events:
        held[phase] += change
        if sum(held) > sum(peak):
            peak = (held[0], held[1])
    return peak


@pytest.mark.parametrize("pp", [2, 4, 8, 16])
def test_micro_batches_in_flight_match_the_upstream_schedule(pp):
    layers = 4 * pp  # four layers a stage
    n = dict(layers=layers, pp=pp, virtual_stages=1, num_microbatches=4 * pp)
    for rank in range(pp):
        first, mirror = _upstream_peak(pp, rank)
        held = stored_on_rank("dualpipe", n, rank)
        assert int(held["rest"]) == 4 * (first + mirror) == 4 * (pp + 1)  # Table 2: PP + 1 on every rank
        assert int(held["embedding"]) == (pp if rank in (0, pp - 1) else 0)
        assert int(held["output"]) == (1 if rank in (0, pp - 1) else 0)
    # 1F1B's first rank holds pp micro-batches of one stage: DualPipe's ranks hold one more stage-micro-batch
    assert int(stored_on_rank("1f1b", n, 0)["rest"]) == 4 * pp
    first, last = in_flight("dualpipe", pp, 4 * pp)
    assert float(first) == float(last) == (pp + 1) / 2  # in units of the rank's two stages


def test_two_copies_of_every_stage_and_both_ends_on_the_outer_ranks():
    model = get_preset("llama3-8b")
    n = dict(Parallelism(pp=4, num_microbatches=8, schedule="dualpipe").numbers(), **model.numbers())
    n.update(first_stage_layers=0, last_stage_layers=0)
    for rank, mirror in ((0, 3), (1, 2)):
        one = [rank_parameters(n, r) for r in (rank, mirror)]
        both = rank_parameters(n, rank, schedule="dualpipe")
        assert both["dense"] == pytest.approx(one[0]["dense"] + one[1]["dense"])
        assert rank_layers(n, rank, schedule="dualpipe")["layers"] == 2 * model.layers // 4
    total = sum(rank_parameters(n, r, schedule="dualpipe")["dense"] for r in range(4))
    assert total == pytest.approx(2 * sum(rank_parameters(n, r)["dense"] for r in range(4)))


def test_a_micro_batch_runs_one_of_the_two_stages():
    n = dict(layers=80, pp=8, virtual_stages=1, num_microbatches=32)
    unit = {"dense_layer": 1.0, "moe_layer": 1.0, "head": 1.2, "attention_layer": 0.0}
    one, dual = (slowest_stage(n, unit, schedule=s) for s in ("1f1b", "dualpipe"))
    assert float(one["gemm"]) == pytest.approx(10 + 1.2) and int(one["rank"]) == 7
    # ranks 0 and 7 run stage 0 (embedding) for half the micro-batches, stage 7 (head) for the other half
    assert float(dual["gemm"]) == pytest.approx(10 + 0.6) and float(dual["embedding"]) == 0.5


def test_bubble_is_the_reports_formula():
    # Table 2 with F = 1, B = 2 (full backward), W = 1, F&B = F + B: (PP/2 - 1)(F&B + B - 3W) = 2 (PP/2 - 1)
    # against 1F1B's (PP - 1)(F + B), over m (F + B) of work
    for pp, m in ((8, 20), (16, 120)):
        assert bubble_fraction(pp, m, schedule="dualpipe") == pytest.approx((pp / 2 - 1) * 2 / (3 * m))
        assert bubble_fraction(pp, m, schedule="1f1b") == pytest.approx((pp - 1) / m)
    # no weight gradients split off (W = 0): F&B + B = F + 2B
    assert bubble_fraction(8, 16, schedule="dualpipe", weight_share=0) == pytest.approx(3 * (1 / 3 + 4 / 3) / 16)
    # the count holds for W <= B only: replayed with W > B the schedule idles more (tests below)
    with pytest.raises(ValueError, match="weight_share must be .*<= 0.333"):
        bubble_fraction(8, 16, schedule="dualpipe", weight_share=0.5)
    with pytest.raises(ValueError, match="forward_share must be"):
        bubble_fraction(8, 16, 2, schedule="dualpipev", forward_share=0)


def test_step_time_keeps_the_work_and_shrinks_the_bubble():
    model = get_preset("llama3-70b")
    where = cluster("h100-sxm", 32, 8)
    times = {}
    for schedule in ("1f1b", "dualpipe"):
        layout = Parallelism(dp=4, tp=8, pp=8, num_microbatches=32, micro_batch_size=1, schedule=schedule,
                             sequence_parallel=True, zero=1)
        times[schedule] = step_time(model, layout, where, options=StepOptions(stack="megatron")).breakdown
    one, dual = times["1f1b"], times["dualpipe"]
    # 80 layers over 8 stages: the same layers a micro-batch, but 1F1B's last rank adds the whole LM head
    assert dual["compute"] < one["compute"]
    # (p/2 - 1)(2 - f - 3w) / (p - 1): 2/7 of 1F1B's with W a third of the work, 5/7 with none split off;
    # here W is the weight-gradient GEMMs' share of work that also holds TP communication and elementwise
    assert 2 / 7 * one["pp_bubble"] * 0.95 < dual["pp_bubble"] < 0.4 * one["pp_bubble"]
    # two copies to update: the first stage's and the last's on rank 0, where 1F1B's busiest holds one of them
    assert 1.5 * one["optimizer"] < dual["optimizer"] < 2 * one["optimizer"]


def test_search_proposes_dualpipe_only_when_asked():
    model, where = get_preset("llama3-70b"), cluster("h100-sxm", 32, 8)
    free = search(model, where, 256, fixed=dict(tp=8), top=20)
    assert {c["schedule"] for c in free.configs} <= {"1f1b", "interleaved"}
    asked = search(model, where, 256, fixed=dict(tp=8, schedule="dualpipe"), top=20)
    assert asked.configs and {c["schedule"] for c in asked.configs} == {"dualpipe"}
    for c in asked.configs:
        assert c["pp"] % 2 == 0 and c["microbatches"] % 2 == 0 and c["microbatches"] >= 2 * c["pp"]
        assert c["virtual_stages"] == 1


def test_emitters_refuse_dualpipe():
    model = get_preset("llama3-70b")
    layout = Parallelism(dp=4, tp=8, pp=8, num_microbatches=32, schedule="dualpipe", sequence_parallel=True, zero=1)
    assert any("dualpipe" in why for why in megatron.unsupported_here(layout, model, "bf16"))
    assert any("DualPipeV" in why for why in torchtitan.unsupported_here(layout, model, "bf16"))
    assert not any("dualpipe" in why for why in megatron.unsupported_here(layout.with_(schedule="1f1b"), model, "bf16"))


def test_cli_refuses_an_odd_pipeline_before_anything_runs(capsys):
    from dtlib.cli import main
    code = main(["memory", "--model", "llama3-8b", "--gpus", "24", "--pp", "3", "--schedule", "dualpipe",
                 "--microbatches", "6"])
    err = capsys.readouterr().err
    assert code == 2 and "dualpipe schedule needs an even pp >= 2" in err and "Traceback" not in err


def test_the_plan_table_says_which_schedule_was_pinned(capsys):
    from dtlib.cli import main
    args = ["plan", "--model", "llama3-70b", "--gpus", "64", "--global-batch", "64", "--tp", "8", "--pp", "4",
            "--top", "1"]
    assert main(args + ["--schedule", "dualpipe"]) == 0
    assert "schedule: dualpipe (pinned with --schedule)" in capsys.readouterr().out
    assert main(args) == 0
    assert "pinned with --schedule" not in capsys.readouterr().out


def _dualpipe_programs(p: int, m: int, v_shape: bool = False) -> list[list[tuple]]:
    """Each rank's program as deepseek-ai/DualPipe 3da1bbe ``DualPipe.step`` (``DualPipeV.step`` with
    ``v_shape``: the same eight steps with the ranks for DualPipe's half ranks and all m micro-batches
    for its half) runs it: ("F", phase), ("B", phase, weight gradient deferred), ("W",) and ("FB",
    forward phase, backward phase) for two chunks run overlapped; phase 0 is the rank's first stage
    (DualPipe: in the model's first half; DualPipeV: the V's way down), 1 the other."""
    ranks, micro = (p, m) if v_shape else (p // 2, m // 2)
    programs = []
    for r in range(p):
        h = r if v_shape else min(r, p - 1 - r)
        ops: list[tuple] = [("F", 0)] * ((ranks - h - 1) * 2)                       # step 1: nF0
        ops += [("F", 0), ("F", 1)] * (h + 1)                                       # step 2: nF0F1
        ops += [("B", 1, True), ("W",), ("F", 1)] * (ranks - h - 1)                 # step 3: nB1W1F1
        ops += [("FB", 0, 1), ("FB", 1, 0)] * (micro - 2 * ranks + h + 1)           # step 4: nF0B1F1B0
        ops += [("B", 1, False), ("FB", 1, 0)] * (ranks - h - 1)                    # step 5: nB1F1B0
        deferred = False
        for i in range(h + 1):                                                      # step 6: nB1B0
            deferred = deferred or (i == (h + 1) // 2 and h % 2 == 1)
            ops.append(("B", 1, deferred))
            deferred = deferred or (i == (h + 1) // 2 and h % 2 == 0)
            ops.append(("B", 0, deferred))
        ops += [("W",), ("B", 0, True)] * (ranks - h - 1)                           # step 7: nWB0
        ops += [("W",)] * (h + 1)                                                   # step 8: nW
        programs.append(ops)
    return programs


def _idle(programs: list[list[list[tuple]]]) -> list[float]:
    """Each rank's idle time when every rank runs its program in order, each op a list of parts
    ``(needs, seconds, done)`` run back to back (two chunks overlapped cost their sum): an op starts
    when its rank is free and every part's ``needs`` (keys of earlier ``done`` parts) have finished;
    transfers are free."""
    p = len(programs)
    finished: dict[tuple, float] = {}
    free, busy, pc = [0.0] * p, [0.0] * p, [0] * p
    progress = True
    while progress:
        progress = False
        for r in range(p):
            while pc[r] < len(programs[r]):
                parts = programs[r][pc[r]]
                needs = [key for part in parts for key in part[0]]
                if any(key not in finished for key in needs):
                    break
                work = sum(part[1] for part in parts)
                end = max([free[r]] + [finished[key] for key in needs]) + work
                finished.update({part[2]: end for part in parts if part[2] is not None})
                free[r], busy[r], pc[r], progress = end, busy[r] + work, pc[r] + 1, True
    assert pc == [len(ops) for ops in programs], "the schedule deadlocked"
    return [max(free) - busy[r] for r in range(p)]


def _dualpipe_idle(p: int, m: int, f: float, b: float, w: float, v_shape: bool = False) -> list[float]:
    """:func:`_idle` of the replayed upstream programs with a stage's forward ``f``, input-gradient
    backward ``b`` and weight gradient ``w`` per micro-batch: every action waits for its
    neighbour's (the stage before, forward; after, backward). DualPipe: direction 0 enters at rank
    0, direction 1 at rank p-1, p stages each; DualPipeV: one direction down and back up the V of 2p."""
    half, last = p // 2, 2 * p - 1 if v_shape else p - 1

    def place(r: int, phase: int) -> tuple[int, int]:
        if v_shape:
            return 0, (r if phase == 0 else 2 * p - 1 - r)
        hr = min(r, p - 1 - r)
        return (phase if r < half else 1 - phase), (hr if phase == 0 else p - 1 - hr)

    programs = []
    for r, ops in enumerate(_dualpipe_programs(p, m, v_shape)):
        count = {("F", 0): 0, ("F", 1): 0, ("B", 0): 0, ("B", 1): 0}  # micro-batches in program order

        def part(kind: str, phase: int, deferred: bool = False) -> tuple:
            d, s = place(r, phase)
            i = count[kind, phase]
            count[kind, phase] += 1
            if kind == "F":
                return ([("F", d, i, s - 1)] if s else []), f, ("F", d, i, s)
            return ([("B", d, i, s + 1)] if s < last else [("F", d, i, s)]), b + (0 if deferred else w), ("B", d, i, s)

        programs.append([[part("F", op[1]), part("B", op[2])] if op[0] == "FB" else
                         [part(op[0], *op[1:])] if op[0] != "W" else [([], w, None)] for op in ops])
    return _idle(programs)


@pytest.mark.parametrize("p, m", [(4, 8), (8, 20), (16, 32)])
@pytest.mark.parametrize("f, b, w", [(1.0, 1.0, 1.0), (1.0, 1.5, 0.5), (1.0, 2.0, 0.0)])
def test_bubble_is_the_replayed_schedule_idle_time(p, m, f, b, w):
    """Every rank of the replayed upstream schedules idles what bubble_fraction says, in units of its
    m micro-batches of work (DualPipe: F + B a micro-batch, each running one of the rank's stages;
    DualPipeV: both its chunks, 2 (F + B)), F&B costing F + B (overlap hides communication, not compute)."""
    per_stage = f + b + w
    shares = dict(forward_share=f / per_stage, weight_share=w / per_stage)
    dual = bubble_fraction(p, m, schedule="dualpipe", **shares) * m * per_stage
    assert _dualpipe_idle(p, m, f, b, w) == pytest.approx([dual] * p)
    v = bubble_fraction(p, m, 2, schedule="dualpipev", **shares) * m * 2 * per_stage
    assert _dualpipe_idle(p, m, f, b, w, v_shape=True) == pytest.approx([v] * p)


def test_pipeline_stages_lists_both_stages_of_a_rank():
    from dtlib.analytic.stages import pipeline_stages
    model = get_preset("llama3-8b")  # 32 layers: 4 a stage over pp 8
    stages = pipeline_stages(model, Parallelism(pp=8, num_microbatches=16, schedule="dualpipe"))
    assert stages[0].chunks == (tuple(range(0, 4)), tuple(range(28, 32)))
    assert stages[7].chunks == stages[0].chunks and stages[0].embedding and stages[0].loss and stages[7].loss
    assert stages[3].chunks == (tuple(range(12, 16)), tuple(range(16, 20))) and not stages[3].embedding


@pytest.mark.parametrize("layout, match", [
    (dict(pp=4, num_microbatches=8, virtual_stages=1), "dualpipev schedule runs 2 chunks per rank .* got 1"),
    (dict(pp=4, num_microbatches=8, virtual_stages=3), "virtual_stages must be 2, got 3"),
    (dict(pp=1, num_microbatches=8, virtual_stages=2), "dualpipev schedule needs pipeline parallelism, pp >= 2"),
    (dict(pp=4, num_microbatches=7, virtual_stages=2), "num_microbatches >= 2 x pp = 8 .*, got 7"),
])
def test_dualpipev_rules(layout, match):
    with pytest.raises(ValueError, match=match):
        Parallelism(schedule="dualpipev", **layout)
    Parallelism(schedule="dualpipev", pp=3, num_microbatches=6, virtual_stages=2)  # an odd pp is fine


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_dualpipev_holds_its_v_and_what_its_steps_keep(pp):
    """Rank r holds stages r and 2pp-1-r of 2pp; DualPipeV.step's steps 1-3 and step 4's first forward
    keep 2pp-r and r+1 of them in flight (2pp+1 chunk-micro-batches on every rank)."""
    layers = 2 * pp * 3  # three layers a stage
    n = dict(layers=layers, pp=pp, virtual_stages=2, num_microbatches=4 * pp)
    for rank in range(pp):
        assert rank_layers(n, rank, schedule="dualpipev")["layers"] == 6
        held = [0, 0]
        peak = 0
        for op in _dualpipe_programs(pp, 4 * pp, v_shape=True)[rank]:
            for kind, phase in ((("F", op[1]), ("B", op[2])) if op[0] == "FB" else ((op[0], op[1]),) if op[0] != "W" else ()):
                held[phase] += 1 if kind == "F" else -1
                peak = max(peak, sum(held))
        stored = stored_on_rank("dualpipev", n, rank)
        assert peak == 2 * pp + 1 and int(stored["rest"]) == 3 * (2 * pp + 1)
        assert int(stored["embedding"]) == (2 * pp if rank == 0 else 0)
    assert float(in_flight("dualpipev", pp, 4 * pp, 2)[0]) == (2 * pp + 1) / 2


def test_torchtitan_takes_the_emitted_dualpipev_and_splits_it_as_planned():
    """The emitted TOML names torchtitan's DualPipeV; torchtitan's own split (generate_llm_fqn_per_model_part)
    makes 2 pp stages, and its "v" placement (pipeline_parallel.py: rank r runs stages r and
    num_stages-1-r) gives every rank the layers dtlib planned for it."""
    from dtlib.analytic.stages import pipeline_stages
    from dtlib.frameworks import torchtitan_check
    from dtlib.plan.emit import emit
    try:
        torchtitan_check.import_torchtitan()
    except ImportError as exc:
        pytest.skip(str(exc))
    model = get_preset("llama3-8b")
    layout = Parallelism(dp=2, pp=4, virtual_stages=2, num_microbatches=8, schedule="dualpipev", zero=3)
    out = emit("torchtitan", layout, model, layout.global_batch)
    assert not out.unsupported
    built = torchtitan_check.check_torchtitan_job(out.text)
    assert built["job"].parallelism.pipeline_parallel_schedule == "DualPipeV"
    stages = built["stages"]
    assert len(stages) == 8 and "tok_embeddings" in stages[0] and "output" in stages[7]

    def layers_of(names: list[str]) -> tuple[int, ...]:
        return tuple(int(name.split(".")[1]) for name in names if name.startswith("layers."))

    planned = pipeline_stages(model, layout)
    for rank in range(4):
        assert planned[rank].chunks == (layers_of(stages[rank]), layers_of(stages[7 - rank]))
    assert planned[0].embedding and planned[0].loss and not planned[3].loss
    assert any("dualpipev" in why for why in megatron.unsupported_here(layout, model, "bf16"))


def test_rehearsal_shrinks_dualpipe_to_a_schedule_dtlib_train_runs():
    from dtlib.trainer.shrink import shrink_layout
    one, lines = shrink_layout(Parallelism(dp=4, pp=8, num_microbatches=32, schedule="dualpipe"))
    assert one.schedule == "1f1b" and "schedule dualpipe -> 1f1b: dtlib train runs gpipe, 1f1b" in " ".join(lines)
    v, lines = shrink_layout(Parallelism(dp=4, pp=8, num_microbatches=32, schedule="dualpipev", virtual_stages=2))
    assert (v.schedule, v.virtual_stages) == ("interleaved", 2) and "dualpipev -> interleaved" in " ".join(lines)


def _pytorch_dualpipev_idle(p: int, m: int, f: float, b: float, w: float) -> list[float]:
    """:func:`_idle` of PyTorch's own DualPipeV order (``ScheduleDualPipeV``'s
    ``_calculate_single_rank_operations``, the order its runtime executes) with the costs of
    :func:`_dualpipe_idle`: F, I (input gradient), W, B (both) per stage, an OVERLAP_F_B pair their sum."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    order = object.__new__(schedules.ScheduleDualPipeV)  # its order needs only the group and the micro-batches
    order.pp_group_size, order._n_microbatches = p, m
    cost = {"F": f, "I": b, "W": w, "B": b + w}

    def part(a) -> tuple:
        kind, s, i = a.computation_type.value, a.stage_index, a.microbatch_index
        needs = ([("F", s - 1, i)] if s else []) if kind == "F" else [("I", s, i)] if kind == "W" else \
            [("I", s + 1, i)] if s < 2 * p - 1 else [("F", s, i)]
        return needs, cost[kind], ("I" if kind == "B" else kind, s, i)  # a full backward is the input gradient too

    return _idle([[[part(a) for a in (op.sub_actions or (op,))] for op in order._calculate_single_rank_operations(r)]
                  for r in range(p)])


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (8, 20)])
@pytest.mark.parametrize("f, b, w", [(1.0, 1.0, 1.0), (1.0, 1.5, 0.5), (1.0, 2.0, 0.0)])
def test_pytorchs_dualpipev_idles_what_the_plan_says(p, m, f, b, w):
    """PyTorch's ScheduleDualPipeV (what torchtitan's DualPipeV runs), timed: with W = B every rank
    idles bubble_fraction("dualpipev") of its work, as the upstream DualPipeV does; with W < B up to
    one stage's forward less (its order runs the last weight gradients between the input gradients),
    so the plan's bubble is an upper bound by at most that."""
    per_stage = f + b + w
    expected = bubble_fraction(p, m, 2, schedule="dualpipev", forward_share=f / per_stage,
                               weight_share=w / per_stage) * m * 2 * per_stage
    idle = _pytorch_dualpipev_idle(p, m, f, b, w)
    if w == b:
        assert idle == pytest.approx([expected] * p)
    assert all(expected - f - 1e-9 <= x <= expected + 1e-9 for x in idle)
    assert idle[0] < expected or w == b  # the difference is real, not rounding


def test_every_distinct_rank_is_a_memory_and_time_candidate():
    """A DualPipe rank's load is its pair of stages, DualPipeV's its V: no rank can be skipped as
    1F1B's middle ranks are (fewer micro-batches further down)."""
    from dtlib.analytic.stages import candidate_ranks
    n = dict(layers=61, pp=np.array([4, 16]), virtual_stages=np.array([1, 1]), num_microbatches=np.array([8, 32]))
    ranks = candidate_ranks(n, schedule="dualpipe")
    assert [list(r) for r in ranks] == [[min(r, 1), r] for r in range(8)]
    assert [int(r) for r in candidate_ranks(dict(n, pp=6, virtual_stages=2), schedule="dualpipev")] == list(range(6))
