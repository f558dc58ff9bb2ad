"""The software stack as an input (issue 26, item 4): each stack's defaults are cited, applied
when a StepOptions field is left None, overridden when given, and shown by ``dtlib plan``."""
import json
from dataclasses import fields

import pytest

from dtlib.analytic.comm import collective_time
from dtlib.analytic.hardware import cluster, get_gpu
from dtlib.analytic.layout import Parallelism
from dtlib.analytic.presets import get_preset
from dtlib.cli import main
from dtlib.analytic.stacks import FA2_ON_HOPPER
from dtlib.plan.calibration import ATTENTION_EFFICIENCY
from dtlib.analytic.stacks import DEFAULT_STACK, STACKS, Stack, get_stack
from dtlib.plan.steptime import StepOptions, resolve, step_time

MODEL = get_preset("llama3-8b")
C = cluster("h100-sxm", 2, 8)
TP_LAYOUT = Parallelism(dp=4, tp=4, num_microbatches=4, sequence_parallel=True, zero=1)
SETTINGS = ("tp_overlap", "dp_overlap", "cp_overlap", "attention_kernel", "fused_elementwise", "fused_swiglu",
            "fp8_saves_inputs", "fp8_recipe", "expert_loop", "precision", "grad_reduce", "moe_dispatcher",
            "tp_overlap_input_grads")


def test_every_default_names_its_setting():
    assert set(STACKS) == {"megatron", "torchtitan", "deepspeed", "fsdp"} and DEFAULT_STACK == "megatron"
    for stack in STACKS.values():
        assert set(stack.sources) == set(SETTINGS), stack.name
        assert all(len(text) > 20 for text in stack.sources.values()), stack.name
    # the settings quoted are the frameworks' own names
    assert "tp_comm_overlap" in STACKS["megatron"].sources["tp_overlap"]
    assert "overlap_grad_reduce" in STACKS["megatron"].sources["dp_overlap"]
    assert "grad_reduce_in_fp32 = False" in STACKS["megatron"].sources["grad_reduce"]
    assert "mixed_precision_reduce = 'float32'" in STACKS["torchtitan"].sources["grad_reduce"]
    assert "selective" not in STACKS["torchtitan"].sources["tp_overlap"]
    assert "enable_async_tensor_parallel" in STACKS["torchtitan"].sources["tp_overlap"]
    assert "overlap_comm" in STACKS["deepspeed"].sources["dp_overlap"]
    assert "BACKWARD_PRE" in STACKS["fsdp"].sources["dp_overlap"]


def test_stack_defaults_apply_and_explicit_values_override():
    assert StepOptions().stack == "megatron"
    for name, stack in STACKS.items():
        filled, dropout = resolve(StepOptions(stack=name))
        assert (filled.tp_overlap, filled.cp_overlap, filled.fused_elementwise, filled.precision) == \
               (stack.tp_overlap, stack.cp_overlap, stack.fused_elementwise, stack.precision), name
        assert filled.flash_attention is True and dropout is False  # today's convention, every stack
    # DeepSpeed's overlap_comm depends on the ZeRO stage: left to the step time
    assert resolve(StepOptions(stack="deepspeed"))[0].dp_overlap is None
    mine = resolve(StepOptions(stack="megatron", tp_overlap=0.25, fused_elementwise=False, precision="zero"))[0]
    assert (mine.tp_overlap, mine.fused_elementwise, mine.precision) == (0.25, False, "zero")


def test_tp_overlap_of_the_stack_and_its_override_in_the_step_time():
    megatron = step_time(MODEL, TP_LAYOUT, C)
    titan = step_time(MODEL, TP_LAYOUT, C, options=StepOptions(stack="torchtitan"))
    exposed = step_time(MODEL, TP_LAYOUT, C, options=StepOptions(stack="megatron", tp_overlap=0.0))
    # overlap hides the layers' collectives and the output layer's, never the embedding's reduce-scatter
    # + all-gather (SP) or the loss's 3 all-reduces of fp32 statistics (dtlib.plan.vocab_parallel)
    tokens, m, tp = TP_LAYOUT.micro_batch_size * MODEL.seq, TP_LAYOUT.num_microbatches, TP_LAYOUT.tp
    act = tokens * MODEL.hidden * 2
    unhidden = m * (collective_time("reduce_scatter", act, tp, C.intra) + collective_time("all_gather", act, tp, C.intra)
                    + 3 * collective_time("all_reduce", 4 * tokens, tp, C.intra))
    assert megatron.breakdown["tp_comm"] == pytest.approx(unhidden, rel=1e-12)
    assert 0 < unhidden < titan.breakdown["tp_comm"] == exposed.breakdown["tp_comm"]
    half = step_time(MODEL, TP_LAYOUT, C, options=StepOptions(tp_overlap=0.5))
    assert half.breakdown["tp_comm"] == pytest.approx(unhidden + (exposed.breakdown["tp_comm"] - unhidden) / 2,
                                                      rel=1e-12)


def test_attention_kernel_scales_the_fitted_efficiency_on_hopper_only():
    titan, megatron = STACKS["torchtitan"], STACKS["megatron"]
    assert titan.attention_scale(get_gpu("h100-sxm")) == FA2_ON_HOPPER
    assert titan.attention_scale(get_gpu("a100-80gb")) == 1.0 == megatron.attention_scale(get_gpu("h100-sxm"))
    layout = Parallelism(dp=16)
    for gpu, slower in (("h100-sxm", True), ("a100-80gb", False)):
        c = cluster(gpu, 2, 8)
        fa3 = step_time(MODEL, layout, c).breakdown["compute"]
        fa2 = step_time(MODEL, layout, c, options=StepOptions(stack="torchtitan")).breakdown["compute"]
        given = step_time(MODEL, layout, c, options=StepOptions(stack="torchtitan",
                                                                attention_efficiency=ATTENTION_EFFICIENCY))
        # the GEMMs are the same physics: only the attention kernel's efficiency differs
        assert given.breakdown["compute"] == pytest.approx(fa3, rel=1e-12)
        assert (fa2 > fa3) is slower and (fa2 == pytest.approx(fa3, rel=1e-12)) is not slower


def test_deepspeed_overlaps_dp_communication_with_zero3_only():
    layout = Parallelism(dp=16, zero=1, num_microbatches=1)
    for zero, hidden in ((1, False), (3, True)):
        r = step_time(MODEL, layout.with_(zero=zero), C, options=StepOptions(stack="deepspeed"))
        assert (r.breakdown["dp_comm"] < r.dp_comm_unhidden) is hidden, zero
        if not hidden:
            assert r.breakdown["dp_comm"] == r.dp_comm_unhidden


def test_bad_stack_names_the_valid_ones(capsys):
    with pytest.raises(ValueError, match="unknown stack 'nemo'; valid: megatron, torchtitan, deepspeed, fsdp"):
        StepOptions(stack="nemo")
    with pytest.raises(ValueError, match="tp_overlap must be"):
        Stack(**{**{f.name: getattr(STACKS["fsdp"], f.name) for f in fields(Stack)}, "tp_overlap": 2.0})
    assert get_stack() is STACKS["megatron"] and get_stack(STACKS["fsdp"]) is STACKS["fsdp"]
    assert main(["plan", "--model", "llama3-8b", "--gpus", "8", "--global-batch", "8", "--stack", "nemo"]) == 2
    assert "--stack: invalid choice: 'nemo'" in capsys.readouterr().err


def test_plan_shows_the_stack_and_takes_overrides(capsys):
    base = ["plan", "--model", "llama3-8b", "--gpus", "16", "--global-batch", "16", "--tp", "4", "--pp", "1",
            "--cp", "1", "--zero", "1", "--micro-batch", "1", "--recompute", "none", "--sequence-parallel"]
    assert main(base + ["--stack", "torchtitan"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "stack torchtitan" in out[0] and out[2].startswith("stack torchtitan: TP overlap 0, DP overlap 1.0")
    assert "attention fa2, eager elementwise, precision fsdp-mixed" in out[2]
    assert main(base + ["--stack", "torchtitan", "--json"]) == 0
    exposed = json.loads(capsys.readouterr().out)["configs"][0]["breakdown"]["tp_comm"]
    assert main(base + ["--stack", "torchtitan", "--tp-overlap", "1", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["assumed"]["stack"] == "torchtitan" and d["assumed"]["tp_overlap"] == 1.0
    # all hidden but each block's backward input-gradient reduce-scatter, a sum of GEMMs in torchtitan's Llama
    # (separate wq/wk/wv and w1/w3: Stack.tp_overlap_input_grads; a quarter of the layers' TP traffic without
    # recompute), and the embedding's and the loss's collectives, which have no GEMM beside them
    assert exposed / 4 < d["configs"][0]["breakdown"]["tp_comm"] < exposed / 3
    # Megatron-Core's fused linear_qkv / linear_fc1 make each input gradient one GEMM: hidden too
    megatron = {}
    for overlap in ("0", "1"):
        assert main(base + ["--stack", "megatron", "--tp-overlap", overlap, "--json"]) == 0
        megatron[overlap] = json.loads(capsys.readouterr().out)["configs"][0]["breakdown"]["tp_comm"]
    assert 0 < megatron["1"] < megatron["0"] / 10
