"""``dtlib plan``: the JSON keys other tools read, the table, pins, nothing-fits, and bad input
(one line on stderr, exit 2)."""
import json

import pytest

from dtlib.analytic.hardware import cluster
from dtlib.analytic.layout import Parallelism
from dtlib.analytic.presets import get_preset
from dtlib.cli import main
from dtlib.cli.plan import MOE_CAVEAT
from dtlib.plan.steptime import TERMS, StepOptions, step_time
from dtlib.plan.training import training_plan

KEYS = {"dp", "tp", "pp", "cp", "ep", "etp", "virtual_stages", "micro_batch", "microbatches", "zero", "schedule", "recompute",
        "sequence_parallel", "step_time_s", "tokens_per_s", "model_tflops_per_gpu", "hardware_tflops_per_gpu",
        "mfu", "memory_per_gpu_bytes", "breakdown", "compute_split", "recompute_layers",
        "account_for_embedding_and_loss", "activation_offload_layers", "offload", "recompute_modules",
        "first_stage_layers", "last_stage_layers", "pipeline_layout", "memory_stage", "band"}


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_json_has_the_issue_keys_and_a_training_plan(capsys):
    code, out, _ = run(capsys, "plan", "--model", "capstone-10b", "--gpus", "128", "--global-batch", "1024",
                       "--tokens", "1T", "--top", "3", "--json")
    d = json.loads(out)
    assert code == 0 and {"configs", "searched", "search_seconds", "training"} <= set(d)
    assert len(d["configs"]) == 3 and all(set(c) == KEYS for c in d["configs"])
    assert all(set(c["breakdown"]) == set(TERMS) for c in d["configs"])
    assert d["searched"] > 1000 and 0 < d["search_seconds"] < 30
    # where the numbers come from: the compute model and its fitted efficiencies
    assert d["efficiency"] is None and d["clock_scale"] == 1.0 and "GEMM shapes" in d["efficiency_source"]
    assert all(c["breakdown"]["compute"] == pytest.approx(sum(c["compute_split"].values()), rel=1e-12)
               for c in d["configs"])
    best = d["configs"][0]
    expected = training_plan(tokens=1e12, tokens_per_step=1024 * 4096, step_time=best["step_time_s"], gpus=128)
    assert d["training"]["days"] == pytest.approx(expected.days) and d["training"]["cost_usd"] == pytest.approx(expected.cost_usd)


def test_all_layout_flags_evaluate_one_configuration(capsys):
    code, out, _ = run(capsys, "plan", "--model", "llama3-8b", "--gpus", "16", "--global-batch", "32",
                       "--tp", "2", "--pp", "2", "--dp", "4", "--cp", "1", "--ep", "1", "--virtual-stages", "1",
                       "--micro-batch", "1", "--zero", "1", "--recompute", "selective", "--sequence-parallel",
                       "--json")
    d = json.loads(out)
    assert code == 0 and d["searched"] == 1 and len(d["configs"]) == 1
    layout = Parallelism(dp=4, tp=2, pp=2, zero=1, recompute="selective", sequence_parallel=True,
                         micro_batch_size=1, num_microbatches=8)
    expected = step_time(get_preset("llama3-8b"), layout, cluster("h100-sxm", 2, 8))
    assert d["configs"][0]["step_time_s"] == pytest.approx(expected.step_time, rel=1e-12)
    assert d["configs"][0]["mfu"] == pytest.approx(expected.mfu, rel=1e-12)


def test_table_lists_the_top_layouts_with_their_breakdown(capsys):
    code, out, _ = run(capsys, "plan", "--layers", "8", "--hidden", "1024", "--heads", "16", "--seq", "1024",
                       "--gpus", "8", "--global-batch", "64", "--top", "2", "--tokens", "10B")
    assert code == 0
    lines = out.splitlines()
    assert "searched in" in lines[0] and "stack megatron" in lines[0]
    assert lines[1] == "placement: 1 x 8-GPU NVLink domain, 8 of the job's GPUs in each; groups within 8 consecutive ranks stay on NVLink"
    assert lines[2].startswith("stack megatron: TP overlap 1")
    assert lines[3] == ("assumed: grad reduce bf16 (Megatron-Core DistributedDataParallelConfig.grad_reduce_in_fp32 = "
                        "False), TP overlap 1 (CommOverlapConfig(tp_comm_overlap=True) in Megatron-Bridge's performance "
                        "recipes); --grad-reduce-dtype, --tp-overlap change them")
    assert lines[4].startswith("activations counted as") and lines[5].startswith("where the numbers come from:")
    assert lines[6].startswith("columns: ") and lines[7].split()[:3] == ["#", "dp", "tp"]
    assert "etp" not in lines[6] and "etp" not in lines[7].split()  # a dense model: no expert columns
    assert lines[8].startswith(" 1") and lines[9].startswith(" 2") and "breakdown" in lines[11]
    # a toy model does far less work per GPU than any published run: no band, and why
    assert lines[10].startswith("error band of #1: step ") and "not covered: work per GPU 8.3e+12 FLOP" in lines[10]
    assert lines[12].split() == list(TERMS) and "training 1e+10 tokens" in out


def test_nothing_fits_explains_and_exits_1(capsys):
    code, out, err = run(capsys, "plan", "--model", "llama3-405b", "--gpus", "8", "--global-batch", "8")
    assert code == 1 and err == "" and "nothing fits: the smallest memory per GPU found is" in out
    code, out, _ = run(capsys, "plan", "--model", "llama3-405b", "--gpus", "8", "--global-batch", "8", "--json")
    d = json.loads(out)
    assert code == 1 and d["configs"] == [] and d["training"] is None and "nothing fits" in d["why"]


@pytest.mark.parametrize("argv,message", [
    (["--gpus", "8", "--global-batch", "8"], "give exactly one of --model"),
    (["--model", "llama3-8b", "--global-batch", "8"], "the following arguments are required: --gpus"),
    (["--model", "llama3-8b", "--gpus", "0", "--global-batch", "8"], "--gpus must be an integer >= 1"),
    (["--model", "llama3-8b", "--gpus", "8", "--global-batch", "-4"], "--global-batch must be an integer >= 1"),
    (["--model", "llama3-8b", "--gpus", "12", "--global-batch", "8"], "--gpus 12 is not a whole number of allocation units of --gpus-per-node 8"),
    (["--model", "llama3-8b", "--gpus", "8", "--global-batch", "8", "--gpu", "v100"], "unknown GPU 'v100'"),
    (["--model", "llama3-8b", "--gpus", "8", "--global-batch", "8", "--gpu", "a100-80gb", "--precision", "fp8"],
     "a100-80gb has no fp8 peak"),
    (["--model", "llama3-8b", "--gpus", "8", "--global-batch", "8", "--precision", "fp4"], "--precision must be one of bf16, fp8"),
    (["--model", "llama3-8b", "--gpus", "8", "--global-batch", "8", "--efficiency", "1.2"], "--efficiency must be a number in (0, 1]"),
    (["--model", "llama3-8b", "--gpus", "8", "--global-batch", "8", "--power-limit", "-5"], "--power-limit must be watts > 0"),
    (["--model", "llama3-8b", "--gpus", "8", "--global-batch", "8", "--gemm-efficiency", "0"], "--gemm-efficiency must be a number in (0, 1]"),
    (["--model", "llama3-8b", "--gpus", "8", "--global-batch", "8", "--price-per-gpu-hour", "nan"], "--price-per-gpu-hour must be dollars > 0"),
    (["--model", "llama3-8b", "--gpus", "8", "--global-batch", "8", "--tokens", "-1T"], "--tokens"),
    (["--model", "llama3-8b", "--gpus", "8", "--global-batch", "8", "--top", "0"], "--top must be an integer >= 1"),
    (["--model", "llama3-8b", "--gpus", "8", "--global-batch", "8", "--tp", "3"], "tp x pp x cp = 3 must divide the 8 GPUs"),
    (["--model", "llama3-8b", "--gpus", "8", "--global-batch", "8", "--tp", "8", "--pp", "1", "--cp", "1",
      "--ep", "2"], "expert parallel size ep=2 needs an MoE model"),
    (["--params", "7B", "--gpus", "8", "--global-batch", "8"], "plan needs a model shape"),
    (["--model", "llama3-8b", "--gpus", "8", "--global-batch", "8", "--oversubscription", "0.5"], "--oversubscription must be a finite number >= 1"),
    (["--model", "qwen3-30b-a3b", "--gpus", "8", "--global-batch", "8", "--ep-overlap", "1.5"],
     "--ep-overlap must be a number in [0, 1], got '1.5'"),
    (["--model", "qwen3-30b-a3b", "--gpus", "8", "--global-batch", "8", "--moe-imbalance", "0.9"],
     "--moe-imbalance must be a finite number >= 1, got '0.9'"),
    (["--model", "qwen3-30b-a3b", "--gpus", "8", "--global-batch", "8", "--moe-imbalance", "17"],  # 128 experts, top 8
     "--moe-imbalance must be between 1 and experts / top_k = 16 (the busiest expert gets each token at most once)"),
    (["--model", "qwen3-30b-a3b", "--gpus", "8", "--global-batch", "8", "--capacity-factor", "1.25",
      "--moe-imbalance", "2"], "--moe-imbalance sets the busiest expert's load under dropless routing"),
    (["--model", "llama3-8b", "--gpus", "8", "--global-batch", "8", "--ep-overlap", "0.5"],
     "--ep-overlap applies to MoE models; llama3-8b is dense"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    code, out, err = run(capsys, "plan", *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("dtlib: error: ") and message in err


def test_a_positional_model_is_the_same_as_model(capsys):
    _, by_flag, _ = run(capsys, "plan", "--model", "llama3-8b", "--gpus", "8", "--global-batch", "16", "--json")
    _, positional, _ = run(capsys, "plan", "llama3-8b", "--gpus", "8", "--global-batch", "16", "--json")
    a, b = json.loads(by_flag), json.loads(positional)
    assert a["configs"] == b["configs"] and a["searched"] == b["searched"]


def test_power_limit_and_efficiency_flags_change_compute_and_say_so(capsys):
    base = ["plan", "--model", "llama3-8b", "--gpus", "8", "--global-batch", "8", "--dp", "8", "--tp", "1",
            "--pp", "1", "--cp", "1", "--micro-batch", "1", "--zero", "3", "--recompute", "full", "--seq", "2048",
            "--json"]
    full = json.loads(run(capsys, *base)[1])
    capped = json.loads(run(capsys, *base, "--power-limit", "500")[1])
    assert capped["clock_scale"] == pytest.approx((500 / 700) ** (1 / 3)) and "500 W" in capped["efficiency_source"]
    assert capped["configs"][0]["breakdown"]["compute"] > full["configs"][0]["breakdown"]["compute"]
    flat = json.loads(run(capsys, *base, "--efficiency", "0.5")[1])
    assert flat["efficiency"] == 0.5 and "--efficiency 0.5" in flat["efficiency_source"]
    code, out, _ = run(capsys, *base[:-1])
    assert code == 0 and out.splitlines()[5].startswith("where the numbers come from: compute from GEMM shapes")


def test_a_gb200_plan_says_it_runs_at_the_clock_gb200_sustains(capsys):
    """docs/hardware.md, "The clock a part sustains": GB200 is timed at 0.944 of its datasheet clock, and
    the plan says so; a power cap multiplies it."""
    from dtlib.analytic.hardware import GB200_SUSTAINED_CLOCK
    base = ["plan", "--model", "llama3-8b", "--gpus", "8", "--gpu", "gb200", "--global-batch", "8", "--top", "1",
            "--json"]
    d = json.loads(run(capsys, *base)[1])
    assert d["clock_scale"] == pytest.approx(GB200_SUSTAINED_CLOCK) and 0.94 < GB200_SUSTAINED_CLOCK < 0.95
    assert "clock x0.944 (the clock it sustains" in d["efficiency_source"]
    capped = json.loads(run(capsys, *base, "--power-limit", "1000")[1])
    assert capped["clock_scale"] == pytest.approx(GB200_SUSTAINED_CLOCK * (1000 / 1200) ** (1 / 3))


def test_the_table_says_what_it_assumed_and_what_its_columns_are(capsys):
    """Issue 28: the header lacked the sequence length and the precision; m, mb, v, sp were unexplained."""
    code, out, _ = run(capsys, "plan", "--model", "llama3-8b", "--gpus", "16", "--global-batch", "64", "--top", "1")
    lines = out.splitlines()
    assert code == 0 and "global batch 64 sequences of 8,192 tokens, bf16 matmuls" in lines[0]
    legend = next(line for line in lines if line.startswith("columns:"))
    for column in ("v: virtual stages", "mb: micro-batch size", "m: micro-batches per step", "sp: sequence parallelism",
                   "zero: ZeRO stage"):
        assert column in legend, column
    code, out, _ = run(capsys, "plan", "--model", "llama3-8b", "--gpus", "16", "--global-batch", "64", "--top", "1",
                       "--precision", "bf16-mixed", "--json")  # the memory command's old spelling
    d = json.loads(out)
    assert code == 0 and d["seq"] == 8192 and d["precision"] == "bf16"


# one Qwen3-30B-A3B layout on 16 H100s: 8 experts of 128 per rank, 4 micro-batches
QWEN_LAYOUT = ["--model", "qwen3-30b-a3b", "--gpus", "16", "--global-batch", "64", "--dp", "16", "--tp", "1",
               "--pp", "1", "--cp", "1", "--ep", "8", "--etp", "1", "--virtual-stages", "1", "--micro-batch", "1",
               "--zero", "1", "--recompute", "none", "--no-sequence-parallel"]


def test_an_moe_plan_says_how_far_to_trust_its_step_time(capsys):
    """The validation's largest misses are MoE runs, mostly timed too fast: an MoE plan says so (text
    and JSON), a dense plan does not."""
    code, out, _ = run(capsys, "plan", *QWEN_LAYOUT)
    assert code == 0 and out.rstrip().splitlines()[-1].startswith("caveat: published mixture-of-experts runs")
    assert json.loads(run(capsys, "plan", *QWEN_LAYOUT, "--json")[1])["caveats"] == [MOE_CAVEAT]
    code, out, _ = run(capsys, "plan", "--model", "llama3-8b", "--gpus", "16", "--global-batch", "64", "--top", "1")
    assert code == 0 and "caveat" not in out


def test_fp8_recipe_sets_the_per_expert_launches(capsys):
    """--fp8-recipe is StepOptions.fp8_recipe: with Megatron-Core's per-expert loop, current scaling
    launches 18 kernels per expert and MoE layer, MXFP8 10 (dtlib.plan.moe.EXPERT_LAUNCHES)."""
    layout = Parallelism(dp=16, ep=8, zero=1, num_microbatches=4)
    hgx = cluster("h100-sxm", 2, 8)
    steps = {}
    for recipe in ("current", "mxfp8"):
        code, out, _ = run(capsys, "plan", *QWEN_LAYOUT, "--precision", "fp8", "--fp8-recipe", recipe, "--json")
        d = json.loads(out)
        expected = step_time(get_preset("qwen3-30b-a3b"), layout, hgx, options=StepOptions(dtype="fp8", fp8_recipe=recipe))
        assert code == 0 and d["assumed"]["fp8_recipe"] == recipe
        steps[recipe] = d["configs"][0]["step_time_s"]
        assert steps[recipe] == pytest.approx(expected.step_time, rel=1e-12)
    assert steps["current"] > steps["mxfp8"]


def test_moe_flags_set_the_step_options_and_the_table_shows_etp(capsys):
    """--ep-overlap and --moe-imbalance are StepOptions.ep_overlap / moe_imbalance; an MoE table adds
    the etp column after ep, and the header says the two values."""
    layout = Parallelism(dp=16, ep=8, zero=1, num_microbatches=4)
    hgx = cluster("h100-sxm", 2, 8)
    code, out, _ = run(capsys, "plan", *QWEN_LAYOUT, "--ep-overlap", "0.5", "--moe-imbalance", "2", "--json")
    d = json.loads(out)
    expected = step_time(get_preset("qwen3-30b-a3b"), layout, hgx,
                         options=StepOptions(ep_overlap=0.5, moe_imbalance=2.0))
    (c,) = d["configs"]
    assert code == 0 and d["experts"] == 128 and c["etp"] == 1
    assert d["assumed"]["ep_overlap"] == 0.5 and d["assumed"]["moe_imbalance"] == 2.0
    assert c["step_time_s"] == pytest.approx(expected.step_time, rel=1e-12)
    assert c["breakdown"]["ep_comm"] == pytest.approx(expected.breakdown["ep_comm"], rel=1e-12)
    default = json.loads(run(capsys, "plan", *QWEN_LAYOUT, "--json")[1])["configs"][0]
    balanced = step_time(get_preset("qwen3-30b-a3b"), layout, hgx, options=StepOptions(moe_imbalance=2.0))
    # half the all-to-alls hidden: the exposed EP time is half the default's at the same imbalance, but for
    # the dispatcher's metadata step before them, which nothing hides (all that --ep-overlap 1 leaves here)
    before = step_time(get_preset("qwen3-30b-a3b"), layout, hgx,
                       options=StepOptions(ep_overlap=1.0, moe_imbalance=2.0)).breakdown["ep_comm"]
    assert 0 < before < balanced.breakdown["ep_comm"] / 10
    assert c["breakdown"]["ep_comm"] == pytest.approx((balanced.breakdown["ep_comm"] - before) / 2 + before,
                                                      rel=1e-12)
    # --moe-dispatcher flex: the probabilities ride with the tokens, no all-to-all of their own
    flex = json.loads(run(capsys, "plan", *QWEN_LAYOUT, "--moe-dispatcher", "flex", "--json")[1])
    assert default["breakdown"]["ep_comm"] > flex["configs"][0]["breakdown"]["ep_comm"]
    assert flex["assumed"]["moe_dispatcher"] == "flex" and d["assumed"]["moe_dispatcher"] == "alltoall"
    assert default["breakdown"]["ep_comm"] < balanced.breakdown["ep_comm"]  # imbalance 1 sends less
    code, out, _ = run(capsys, "plan", *QWEN_LAYOUT, "--moe-imbalance", "2")
    lines = out.splitlines()
    assert code == 0 and "EP overlap 0, expert imbalance 2, alltoall dispatcher," in lines[2]
    assert "etp: expert tensor parallel size" in lines[6]
    header, row = lines[7].split(), lines[8].split()
    assert header[:8] == ["#", "dp", "tp", "pp", "cp", "ep", "etp", "v"] and row[:8] == ["1", "16", "1", "1", "1", "8", "1", "1"]


def test_every_plan_prints_its_band_and_the_json_carries_it(capsys):
    """Step time and throughput with the held-out band of comparable published runs, 3 significant figures."""
    argv = ("plan", "--model", "llama3-8b", "--gpus", "16", "--global-batch", "64", "--top", "2")
    code, out, _ = run(capsys, *argv, "--json")
    best = json.loads(out)["configs"][0]
    step, tokens = best["band"]["step_time_s"], best["band"]["tokens_per_s"]
    assert code == 0 and set(best["band"]) == {"step_time_s", "tokens_per_s"}
    for b in (step, tokens):
        assert set(b) == {"low", "high", "count", "regime", "covered", "reason", "method"}
        assert b["covered"] and b["count"] >= 8 and b["regime"].startswith("megatron, hopper, dense")
    assert step["low"] <= best["step_time_s"] <= step["high"] and tokens["low"] <= best["tokens_per_s"] <= tokens["high"]
    assert tokens["low"] == pytest.approx(best["tokens_per_s"] * best["step_time_s"] / step["high"], rel=1e-12)
    code, out, _ = run(capsys, *argv)
    line = next(x for x in out.splitlines() if x.startswith("error band of #1"))
    percent = f"{100 * (step['low'] / best['step_time_s'] - 1):+.0f}% .. {100 * (step['high'] / best['step_time_s'] - 1):+.0f}%"
    assert f"step {best['step_time_s']:.3g} s ({percent}, {step['count']} runs: {step['regime']};" in line
    row = out.splitlines()[8].split()
    rounded = float(f"{best['tokens_per_s']:.3g}")  # 3 significant figures, written out with separators
    assert row[12] == f"{best['step_time_s']:.3g}" and row[13] == f"{rounded:,.0f}"


def test_a_plan_the_validation_does_not_cover_says_so(capsys):
    code, out, _ = run(capsys, "plan", "--model", "llama3-8b", "--gpus", "64", "--global-batch", "8", "--top", "1",
                       "--gpu", "h100-sxm", "--json")
    band = json.loads(out)["configs"][0]["band"]["step_time_s"]
    assert code == 0 and not band["covered"] and band["low"] is None
    assert "work per GPU 5.9e+13 FLOP per step is outside the 2.2e+14..4.8e+16 of the 78 validated hopper runs" == band["reason"]
    # AMD's two runs: covered, with the band of every family's runs, which holds their own misses
    code, out, _ = run(capsys, "plan", "--model", "llama3-8b", "--gpus", "16", "--global-batch", "64", "--top", "1",
                       "--gpu", "mi355x", "--json")
    band = json.loads(out)["configs"][0]["band"]["step_time_s"]
    assert code == 0 and band["covered"] and band["regime"].endswith("holding the 2 amd runs' own misses")


def test_the_band_method_and_coverage_are_options(capsys):
    argv = ("plan", "--model", "llama3-8b", "--gpus", "16", "--global-batch", "64", "--top", "1", "--json")
    bands = {}
    for extra in ((), ("--band-method", "range"), ("--band-coverage", "0.5")):
        code, out, _ = run(capsys, *argv, *extra)
        bands[extra] = json.loads(out)["configs"][0]["band"]["step_time_s"]
    default, widest, narrow = bands.values()
    assert default["method"] == "10th-90th percentiles" and widest["method"] == "min-max"
    assert widest["low"] <= default["low"] <= narrow["low"] and narrow["high"] <= default["high"] <= widest["high"]
    assert narrow["high"] - narrow["low"] < default["high"] - default["low"]
    for flag, value in (("--band-coverage", "0"), ("--band-coverage", "1.5"), ("--band-method", "normal")):
        code, out, err = run(capsys, *argv, flag, value)
        assert code == 2 and out == "" and flag in err and len(err.strip().splitlines()) == 1


def test_gradient_reduction_and_tp_overlap_are_stated_choices(capsys):
    """Issue 37: the plan says in which dtype it reduced gradients and how much TP communication it
    hid, and where each default comes from; --grad-reduce-dtype fp32 (Megatron-LM's script, NeMo)
    doubles the gradient bytes: more memory and a longer exposed DP reduce."""
    base = ["plan", "--model", "llama3-8b", "--gpus", "16", "--global-batch", "32", "--dp", "8", "--tp", "2",
            "--pp", "1", "--micro-batch", "1", "--zero", "1", "--recompute", "none", "--dp-overlap", "0", "--json"]
    bf16, fp32 = (json.loads(run(capsys, *base, *extra)[1]) for extra in ([], ["--grad-reduce-dtype", "fp32"]))
    assert bf16["assumed"]["grad_reduce_dtype"] == "bf16" and "grad_reduce_in_fp32 = False" in bf16["assumed"]["grad_reduce_source"]
    assert fp32["assumed"]["grad_reduce_dtype"] == "fp32" and fp32["assumed"]["grad_reduce_source"] == "--grad-reduce-dtype"
    a, b = bf16["configs"][0], fp32["configs"][0]
    # ZeRO 1: the reduce-scatter of the gradients doubles, the all-gather of the bf16 parameters does not
    assert 1.3 < b["breakdown"]["dp_comm"] / a["breakdown"]["dp_comm"] < 1.5
    # the gradient buffer: 2 more bytes per parameter on the GPU (8B / tp 2)
    assert b["memory_per_gpu_bytes"] - a["memory_per_gpu_bytes"] == pytest.approx(2 * 8.03e9 / 2, rel=0.02)
    off = json.loads(run(capsys, *base, "--tp-overlap", "0")[1])
    assert off["assumed"]["tp_overlap"] == 0 and off["assumed"]["tp_overlap_source"] == "--tp-overlap"
    assert off["configs"][0]["breakdown"]["tp_comm"] > a["breakdown"]["tp_comm"]
    code, _, err = run(capsys, "plan", "--model", "llama3-8b", "--gpus", "8", "--global-batch", "8",
                       "--grad-reduce-dtype", "fp16")
    assert code == 2 and "--grad-reduce-dtype" in err and "fp32" in err
