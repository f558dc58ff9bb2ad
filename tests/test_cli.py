"""The ``dtlib`` command line, and the table of bad inputs: each gives a ValueError saying what is
wrong and what would be valid, and the command line prints one line and exits 2."""
import argparse
import json
import re
import subprocess
import sys

import pytest

from dtlib.cli import build_parser, main
from dtlib.cli.args import layout_from_args, plain
from dtlib.cli.train import header, summary_text
from dtlib.analytic.comm import collective_time, hierarchical_time
from dtlib.analytic.config import TransformerConfig
from dtlib.analytic.hardware import cluster
from dtlib.analytic.flops import flops_report
from dtlib.analytic.memory import GiB, memory_per_gpu
from dtlib.models import get_preset
from dtlib.measure import measure_cpu
from dtlib.analytic.layout import Parallelism, in_flight
from dtlib.analytic.precision import precision
from dtlib.analytic.vectorised import memory_batch


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_memory_table_and_json(capsys):
    code, out, _ = run(capsys, "memory", "--model", "llama3-8b", "--gpus", "8", "--zero", "3")
    assert code == 0 and "optimizer" in out and "GiB" in out and "h100-sxm memory" in out
    code, out, _ = run(capsys, "memory", "--model", "llama3-8b", "--gpus", "8", "--zero", "3", "--json")
    per_gpu = json.loads(out)["per_gpu"]
    # the API with the CLI's defaults: today's convention, the megatron stack and its precision
    expected = memory_per_gpu("llama3-8b", Parallelism(dp=8, zero=3), precision="bf16-mixed")
    assert per_gpu["total"] == expected.total and per_gpu["activations"] == expected.activations
    assert per_gpu["parameters"] + per_gpu["gradients"] + per_gpu["optimizer"] == expected.model_states


def test_memory_with_a_bare_parameter_count_has_null_activations(capsys):
    code, out, _ = run(capsys, "memory", "--params", "7.5B", "--dp", "64", "--zero", "1",
                       "--convention", "zero", "--json")
    per_gpu = json.loads(out)["per_gpu"]
    assert code == 0 and per_gpu["activations"] is None
    assert per_gpu["total"] / 1e9 == pytest.approx(31.4, abs=0.05)  # ZeRO paper


def test_custom_shape_and_options(capsys):
    code, out, _ = run(capsys, "memory", "--layers", "4", "--hidden", "256", "--heads", "8",
                       "--kv-heads", "2", "--ffn", "1024", "--vocab", "1000", "--seq", "128",
                       "--activation", "swiglu", "--tp", "2", "--pp", "2", "--dp", "2",
                       "--schedule", "interleaved", "--virtual-stages", "2", "--microbatches", "4",
                       "--sequence-parallel", "--recompute", "selective", "--precision", "fp16-mixed",
                       "--grad-dtype", "fp32", "--optimizer", "sgd-momentum", "--zero", "1",
                       "--offload", "optimizer", "--overhead", "1GiB", "--json")
    d = json.loads(out)
    assert code == 0 and d["per_gpu"]["overhead"] == GiB and d["cpu_per_gpu"] > 0


def test_flops_json_gives_korthikanti_mfu(capsys):
    code, out, _ = run(capsys, "flops", "--model", "megatron-22b", "--tp", "8", "--micro-batch", "4",
                       "--gpu", "a100-80gb", "--step-time", "1.10", "--recompute", "selective", "--json")
    d = json.loads(out)
    assert code == 0 and 100 * d["mfu"] == pytest.approx(41.5, abs=0.2)
    assert d["model_flops_per_step"] == flops_report(get_preset("megatron-22b"), 4)["model_flops_per_step"]
    assert d["hardware_flops_per_step"] > d["model_flops_per_step"]
    code, out, _ = run(capsys, "flops", "--model", "llama3-8b", "--batch", "16", "--attention-flops", "causal")
    assert code == 0 and "model FLOPs per step" in out and "\nMFU" not in out  # no step time


def test_comm_single_collective_and_model_volumes(capsys):
    code, out, _ = run(capsys, "comm", "--collective", "all_reduce", "--bytes", "1GiB", "--ranks", "8",
                       "--link", "nvlink4", "--json")
    d = json.loads(out)  # one node: the flat rows run on the intra-node link
    assert code == 0 and d["algorithms"]["ring"]["time"] == collective_time("all_reduce", GiB, 8, "nvlink4")
    assert d["nodes"] == 1 and "hierarchical" not in d and d["notes"] == []
    code, out, _ = run(capsys, "comm", "--model", "llama3-70b", "--tp", "8", "--pp", "4", "--gpus", "64",
                       "--microbatches", "8")
    assert code == 0 and "tp_activations" in out and "pp_activations" in out and "dp_grad_all_reduce" in out


@pytest.mark.parametrize("nbytes", ["256MiB", "1GiB", "8GiB"])
def test_comm_flat_rows_spanning_nodes_run_at_the_inter_node_link(capsys, nbytes):
    """16 ranks at 8 GPUs per node span 2 nodes: a flat ring's slowest hop is the InfiniBand one, so
    it is timed on ib-ndr (NCCL's model for rings over nodes is bounded by the network bandwidth),
    and the hierarchical all-reduce, which sends only S/8 per GPU across nodes, beats it."""
    code, out, _ = run(capsys, "comm", "--bytes", nbytes, "--ranks", "16", "--link", "nvlink4", "--json")
    d = json.loads(out)
    S = d["bytes"]
    ring = d["algorithms"]["ring"]["time"]
    assert code == 0 and d["nodes"] == 2 and d["link"] == "ib-ndr" and d["link_bandwidth"] == 50e9
    assert ring == collective_time("all_reduce", S, 16, "ib-ndr")
    assert ring > collective_time("all_reduce", S, 16, "nvlink4") * 5  # not one NVLink domain
    assert d["algorithms"]["ring"]["busbw"] <= 50e9  # cannot beat the NIC
    assert ring >= d["hierarchical"]["total"]
    assert d["hierarchical"] == hierarchical_time("all_reduce", S, cluster("h100-sxm", 2, 8, "nvlink4", "ib-ndr"))
    code, out, _ = run(capsys, "comm", "--bytes", nbytes, "--ranks", "16")
    assert "flat ring (bounded by ib-ndr)" in out and "hierarchical ring" in out and "2 nodes" in out
    # ranks that are not whole nodes: flat rows still bounded by the network, no hierarchical row
    code, out, _ = run(capsys, "comm", "--bytes", nbytes, "--ranks", "12", "--json")
    d = json.loads(out)
    assert d["algorithms"]["ring"]["time"] == collective_time("all_reduce", S, 12, "ib-ndr")
    assert "hierarchical" not in d and "not whole nodes of 8" in d["notes"][-1]


def test_zero3_with_a_bare_parameter_count_says_the_gather_buffer_is_missing(capsys):
    argv = ["memory", "--params", "7B", "--dp", "8", "--zero", "3"]
    code, out, _ = run(capsys, *argv)
    assert code == 0 and "ZeRO-3 gather buffer is counted as 0" in out and "--largest-layer" in out
    code, out, _ = run(capsys, *argv, "--json")
    d = json.loads(out)
    assert d["per_gpu"]["temporary"] == 0 and any("--largest-layer" in n for n in d["notes"])
    code, out, _ = run(capsys, *argv, "--largest-layer", "200M", "--json")
    d = json.loads(out)
    assert d["per_gpu"]["temporary"] > 0 and not any("gather buffer" in n for n in d["notes"])


def test_zero_and_explicit_defaults_are_not_replaced(capsys):
    shape = ["memory", "--layers", "2", "--hidden", "64", "--heads", "4", "--json"]
    code, out, _ = run(capsys, *shape)
    default = json.loads(out)["per_gpu"]["parameters"]
    code, out, _ = run(capsys, *shape, "--vocab", "50257", "--seq", "2048")
    assert code == 0 and json.loads(out)["per_gpu"]["parameters"] == default  # the documented defaults
    code, out, _ = run(capsys, *shape, "--vocab", "1000")
    assert json.loads(out)["per_gpu"]["parameters"] < default
    code, out, _ = run(capsys, "flops", "--model", "llama3-8b", "--batch", "3", "--json")
    assert code == 0 and json.loads(out)["tokens_per_step"] == 3 * 8192


def test_piping_into_head_prints_no_traceback():
    """The reader closes the pipe first (as ``| head -1`` does once it has its line)."""
    r = subprocess.run(f"{sys.executable} -m dtlib.cli memory --model llama3-8b --json | head -c 1",
                       shell=True, capture_output=True, text=True, timeout=60)
    assert r.stdout == "{" and "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr, r.stderr
    p = subprocess.Popen([sys.executable, "-m", "dtlib.cli", "comm", "--model", "llama3-70b", "--tp", "8",
                          "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # nobody reads: every write fails with EPIPE
    _, err = p.communicate(timeout=60)
    assert p.returncode == 1 and b"Traceback" not in err, err


def test_memory_help_explains_the_activation_convention(capsys):
    assert main(["memory", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "s x s scores" in out and "--convention korthikanti-2022" in out and "--no-flash-attention" in out
    assert "FlashAttention" in out and "--stack" in out and "--recompute-layers" in out
    assert main(["memory", "--model", "llama3-8b", "--recompute", "selective", "--no-dropout"]) == 0


def test_python_dash_m_and_help():
    r = subprocess.run([sys.executable, "-m", "dtlib.cli", "memory", "--model", "llama3-8b", "--json"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "per_gpu" in json.loads(r.stdout)
    assert main(["--help"]) == 0
    assert {"memory", "flops", "comm"} <= set(build_parser()._subparsers._group_actions[0].choices)


BAD_CLI = [
    (["comm", "--bytes", "1GiB", "--ranks", "8", "--tp", "2", "--zero", "3"],
     "--tp, --zero: layout and precision options describe a model, not a single collective"),
    (["memory", "--model", "llama3-8b", "--tp", "3"], "tp=3 must divide the 32 attention heads; valid tp: 1, 2, 4, 8"),
    (["memory", "--model", "llama3-8b", "--tp", "16"], "must divide the 8 KV heads"),
    (["memory", "--model", "llama3-8b", "--pp", "40"], "exceed the 32 layers"),
    (["memory", "--model", "llama3-8b", "--gpus", "8", "--tp", "8", "--dp", "2"], "= 16 but there are 8 GPUs"),
    (["memory", "--model", "llama3-8b", "--gpus", "12", "--tp", "8"], "not divisible by tp\\*pp\\*cp = 8"),
    (["memory", "--model", "llama3-8b", "--cp", "3"], "cp=3 must divide the sequence length 8192"),
    (["memory", "--layers", "0", "--hidden", "64", "--heads", "4"], "--layers must be an integer >= 1, got '0'"),
    (["memory", "--layers", "2", "--hidden", "-64", "--heads", "4"], "--hidden must be an integer >= 1, got '-64'"),
    (["memory", "--layers", "2", "--hidden", "64", "--heads", "5"], "hidden \\(64\\) must be divisible by heads"),
    (["memory", "--layers", "2", "--hidden", "64"], "needs all of --layers, --hidden and --heads"),
    (["memory"], "give exactly one of --model"),
    (["memory", "--model", "llama3-8b", "--params", "7e9"], "give exactly one of"),
    (["memory", "--model", "gpt5"], "unknown model preset 'gpt5'; valid presets: gpt3-175b"),
    (["memory", "--model", "llama3-8b", "--gpu", "v100"], "unknown GPU 'v100'; valid: a100-40gb"),
    (["memory", "--params", "0"], "--params must be a finite number > 0, got '0'"),
    (["memory", "--params", "-5"], "--params must be a finite number > 0, got '-5'"),
    (["memory", "--params", "7GB"], "cannot read '7GB'"),
    (["memory", "--model", "llama3-8b", "--micro-batch", "0"], "--micro-batch must be an integer >= 1, got '0'"),
    (["memory", "--model", "llama3-8b", "--zero", "5"], "invalid choice: '?5'? \\(choose from 0, 1, 2, 3\\)"),
    (["memory", "--model", "llama3-8b", "--zero", "2", "--offload", "params"], "needs ZeRO stage 3"),
    (["memory", "--model", "llama3-8b", "--virtual-stages", "2"], "needs schedule='interleaved'"),
    (["memory", "--model", "llama3-8b", "--pp", "4", "--schedule", "interleaved", "--virtual-stages", "2",
      "--microbatches", "6"], "multiple of pp=4"),
    (["memory", "--model", "llama3-8b", "--dp", "2", "--ep", "2"], "needs an MoE model"),
    (["flops", "--model", "llama3-8b", "--step-time", "-1"], "--step-time must be a finite number > 0, got '-1'"),
    (["flops", "--model", "llama3-8b", "--tp", "3"], "valid tp: 1, 2, 4, 8"),
    (["flops", "--model", "llama3-8b", "--gpus", "8", "--dp", "2"], "= 2 but there are 8 GPUs"),
    (["comm", "--model", "llama3-8b", "--pp", "64"], "exceed the 32 layers"),
    (["flops", "--params", "7e9"], "needs seq"),
    (["flops", "--model", "llama3-8b", "--gpu", "a100-80gb", "--dtype", "fp8", "--step-time", "1"], "no fp8 peak"),
    (["comm", "--collective", "all_reduce", "--bytes", "1GiB"], "needs --bytes and --ranks"),
    (["comm", "--bytes", "1GiB", "--ranks", "0"], "--ranks must be an integer >= 1, got '0'"),
    (["comm", "--bytes", "1GiB", "--ranks", "8", "--link", "nvlink9"], "unknown link 'nvlink9'; valid: nvlink3"),
    (["comm", "--bytes", "12parsecs", "--ranks", "2"], "cannot read '12parsecs'; write e.g. 1e9, 512MiB"),
    (["comm", "--bytes", "1.2.3", "--ranks", "2"], "cannot read '1.2.3'"),
    (["comm", "--collective", "gossip", "--bytes", "1", "--ranks", "2"], "invalid choice: 'gossip'"),
    ([], "required: command"),
    # zero or negative sizes: rejected before anything divides by them
    *[([cmd, "--model", "llama3-8b", f"--{size}", value], f"--{size} must be an integer >= 1, got '{value}'")
      for cmd in ("memory", "flops", "comm") for size in ("tp", "pp", "cp", "ep", "dp") for value in ("0", "-2")],
    (["memory", "--model", "llama3-8b", "--gpus", "-8"], "--gpus must be an integer >= 1, got '-8'"),
    (["memory", "--model", "llama3-8b", "--gpus", "0"], "--gpus must be an integer >= 1, got '0'"),
    (["flops", "--model", "llama3-8b", "--gpus", "0"], "--gpus must be an integer >= 1, got '0'"),
    (["memory", "--model", "llama3-8b", "--gpus", "4", "--tp", "8"], "--gpus 4 is not divisible by tp\\*pp\\*cp = 8"),
    (["comm", "--bytes", "1GB", "--ranks", "16", "--gpus-per-node", "0"], "--gpus-per-node must be an integer >= 1"),
    (["comm", "--bytes", "1GB", "--ranks", "-16"], "--ranks must be an integer >= 1, got '-16'"),
    (["comm", "--bytes", "1GB", "--ranks", "16", "--inter-link", "carrier-pigeon"], "unknown link 'carrier-pigeon'"),
    (["memory", "--model", "llama3-8b", "--virtual-stages", "0"], "--virtual-stages must be an integer >= 1"),
    (["memory", "--model", "llama3-8b", "--microbatches", "0"], "--microbatches must be an integer >= 1"),
    # zero values are errors, not "use the default"
    (["memory", "--layers", "2", "--hidden", "64", "--heads", "4", "--vocab", "0"], "--vocab must be an integer >= 1, got '0'"),
    (["memory", "--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "0"], "--seq must be an integer >= 1, got '0'"),
    (["flops", "--model", "llama3-8b", "--seq", "0"], "--seq must be an integer >= 1, got '0'"),
    (["flops", "--model", "llama3-8b", "--batch", "0"], "--batch must be an integer >= 1, got '0'"),
    (["flops", "--model", "llama3-8b", "--batch", "-4"], "--batch must be an integer >= 1, got '-4'"),
    (["memory", "--model", "llama3-8b", "--overhead=-1GiB"], "--overhead must be a finite number >= 0, got '-1GiB'"),
    (["memory", "--params", "7B", "--zero", "3", "--largest-layer=-1M"], "--largest-layer must be a finite number >= 0"),
    (["comm", "--bytes=-1GB", "--ranks", "2"], "--bytes must be a finite number >= 0, got '-1GB'"),
    (["comm", "--bytes", "0", "--ranks", "2"], "--bytes must be a finite number > 0, got 0"),
    # options that would be silently ignored
    (["memory", "--model", "llama3-8b", "--vocab", "1000"], "--vocab only describe a custom shape"),
    (["memory", "--params", "7B", "--kv-heads", "8", "--activation", "swiglu"], "--kv-heads, --activation only describe"),
    (["comm", "--model", "llama3-8b", "--bytes", "1GB"], "give either --bytes and --ranks .* or a model .*, not both"),
    (["comm", "--model", "llama3-8b", "--ranks", "8"], "not both"),
    # the interleaved schedule: Megatron-LM needs v >= 2, pp >= 2 and m a multiple of pp
    (["memory", "--model", "llama3-8b", "--pp", "4", "--microbatches", "8", "--schedule", "interleaved"],
     "interleaved schedule needs virtual_stages >= 2, got 1"),
    (["memory", "--model", "llama3-8b", "--schedule", "interleaved", "--virtual-stages", "2"], "needs pipeline parallelism, pp >= 2"),
    (["flops", "--model", "llama3-8b", "--pp", "4", "--schedule", "interleaved"], "virtual_stages >= 2"),
    (["comm", "--model", "llama3-8b", "--pp", "4", "--microbatches", "8", "--schedule", "interleaved"], "virtual_stages >= 2"),
]


@pytest.mark.parametrize("argv,message", BAD_CLI)
def test_bad_input_prints_one_line_and_exits_2(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("dtlib: error: ")
    assert re.search(message, err), err


BAD_API = [
    (lambda: Parallelism(dp=0), "dp must be an integer >= 1, got 0"),
    (lambda: Parallelism(zero=4), "zero must be an integer from 0 to 3, got 4"),
    (lambda: Parallelism(schedule="zigzag"), "schedule must be one of 'gpipe', '1f1b', 'interleaved', 'dualpipe', 'dualpipev', got 'zigzag'"),
    (lambda: Parallelism(recompute="some"), "recompute must be one of"),
    (lambda: Parallelism(dp=4, shard_size=3), "shard_size=3 must divide the 4 replicas"),
    (lambda: Parallelism(dp=2.0), "dp must be an integer >= 1, got 2.0"),
    (lambda: memory_per_gpu("llama3-8b", Parallelism(tp=3)), "valid tp: 1, 2, 4, 8"),
    (lambda: memory_per_gpu("llama3-8b", Parallelism(dp=4), gpus=8), "= 4 but there are 8 GPUs"),
    (lambda: memory_per_gpu(-1), "params must be a finite number > 0, got -1"),
    (lambda: memory_per_gpu("llama3-8b", seq=0), "seq must be an integer >= 1, got 0"),
    (lambda: memory_per_gpu("llama3-8b", precision="int3"), "unknown precision 'int3'; valid: zero"),
    (lambda: memory_per_gpu(7e9, Parallelism(dp=2, ep=2)), "bare parameter count cannot be split"),
    (lambda: precision("fp32", grad_dtype="bf16"), "fp32 training has fp32 gradients"),
    (lambda: flops_report(get_preset("llama3-8b"), batch=0), "batch must be an integer >= 1, got 0"),
    (lambda: flops_report(get_preset("llama3-8b"), batch=1, gpu="tpu"), "unknown GPU 'tpu'"),
    (lambda: Parallelism(pp=4, num_microbatches=8, schedule="interleaved"), "interleaved schedule needs virtual_stages >= 2"),
    (lambda: Parallelism(virtual_stages=2, schedule="interleaved"), "interleaved schedule needs pipeline parallelism"),
    (lambda: in_flight("interleaved", 4, 8, 1), "interleaved schedule needs virtual_stages >= 2, got 1"),
    (lambda: memory_batch(get_preset("llama3-8b"), schedule="interleaved", pp=4, num_microbatches=8),
     "configuration \\(\\): the interleaved schedule needs virtual_stages >= 2"),
    (lambda: layout_from_args(argparse.Namespace(tp=0, pp=1, cp=1, ep=1, dp=None, gpus=8, gpus_per_node=8)),
     "^tp must be an integer >= 1, got 0"),
    (lambda: layout_from_args(argparse.Namespace(tp=1, pp=1, cp=1, ep=1, dp=None, gpus=-8, gpus_per_node=8)),
     "^gpus must be an integer >= 1, got -8"),
    (lambda: measure_cpu(n=16, repeats=1, copy_bytes=1024), "copy_bytes must be an integer >= 1048576, got 1024"),
]


@pytest.mark.parametrize("call,message", BAD_API)
def test_bad_input_raises_a_helpful_value_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# ---- what a new user hits first (issue 8, section 5) ---------------------------------------------
def test_version(capsys):
    import dtlib
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"dtlib {dtlib.__version__}"


def test_model_as_a_positional_argument_and_presets_in_help(capsys):
    _, positional, _ = run(capsys, "memory", "llama3-8b", "--gpus", "8", "--json")
    _, flag, _ = run(capsys, "memory", "--model", "llama3-8b", "--gpus", "8", "--json")
    assert positional == flag and json.loads(positional)["per_gpu"]["activations"] > 0
    _, positional, _ = run(capsys, "comm", "llama3-8b", "--tp", "2", "--gpus", "8", "--json")
    _, flag, _ = run(capsys, "comm", "--model", "llama3-8b", "--tp", "2", "--gpus", "8", "--json")
    assert positional == flag and "tp_activations" in json.loads(positional)["volumes"]
    code, _, err = run(capsys, "memory", "llama3-8b", "--model", "gpt3-175b")
    assert code == 2 and "two models given" in err
    assert main(["memory", "--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert all(name in help_text for name in ("gpt3-175b", "llama3-8b", "llama3-405b", "capstone-10b"))


def test_gpu_count_suggestion_satisfies_every_rule(capsys):
    # tp=3 cannot split 32 heads: suggesting --gpus 9 (a multiple of 3) only moved the error
    code, _, err = run(capsys, "memory", "--model", "llama3-8b", "--gpus", "8", "--tp", "3")
    assert code == 2 and "no GPU count fixes this layout: tensor parallel size tp=3 must divide the 32" in err
    code, _, err = run(capsys, "memory", "--model", "llama3-8b", "--gpus", "9", "--tp", "2")
    suggested = re.search(r"the next valid count is --gpus (\d+)", err).group(1)
    assert suggested == "10" and run(capsys, "memory", "--model", "llama3-8b", "--gpus", suggested, "--tp", "2")[0] == 0


def test_huge_numbers_print_without_float_noise(capsys):
    code, out, _ = run(capsys, "memory", "--params", "1e30")
    assert code == 0 and "1.863e+21 GiB  (2e+30 B)" in out
    assert not re.search(r"\d{17,}", out.replace(",", ""))  # no digits beyond a double's precision


def test_every_model_is_counted_with_todays_kernels_unless_asked(capsys):
    """FlashAttention-style attention (no s^2 scores: selective recompute's footprint) and no
    dropout for presets and custom shapes alike, said in the output; --convention korthikanti-2022
    gives the paper's GPT counting."""
    code, out, _ = run(capsys, "memory", "--model", "llama3-8b", "--gpus", "8")
    assert code == 0 and "recompute=none" in out and "stack=megatron" in out
    assert "convention 'today': FlashAttention-style attention" in out and "no dropout" in out
    _, out, _ = run(capsys, "memory", "--model", "llama3-8b", "--gpus", "8", "--json")
    today = memory_per_gpu("llama3-8b", Parallelism(dp=8), precision="megatron-bf16")
    selective = memory_per_gpu("llama3-8b", Parallelism(dp=8, recompute="selective"), precision="megatron-bf16")
    assert json.loads(out)["per_gpu"]["activations"] == today.activations == selective.activations
    _, out, _ = run(capsys, "memory", "--model", "llama3-8b", "--gpus", "8", "--convention", "korthikanti-2022",
                    "--json")
    paper = memory_per_gpu("llama3-8b", Parallelism(dp=8), precision="megatron-bf16", convention="korthikanti-2022")
    d = json.loads(out)
    assert d["per_gpu"]["activations"] == paper.activations > 8 * today.activations
    assert any("'korthikanti-2022': explicit attention" in note for note in d["notes"])
    # a custom GPT shape gets today's kernels too (it used to get the paper's convention)
    _, out, _ = run(capsys, "memory", "--layers", "4", "--hidden", "512", "--heads", "8", "--json")
    custom = TransformerConfig(layers=4, hidden=512, heads=8, vocab=50257, seq=2048)
    assert json.loads(out)["per_gpu"]["activations"] == memory_per_gpu(custom, precision="megatron-bf16").activations


# ---- issue 28: the command line as a platform engineer reads it ---------------------------------
def _subcommands() -> list[str]:
    return list(build_parser()._subparsers._group_actions[0].choices)


def test_top_level_help_describes_every_subcommand(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    description = out.split("positional arguments:")[0]
    for name in _subcommands():  # each has a line of its own in the description
        assert re.search(rf"^  {name}\s+\w", description, re.M), name


def test_help_has_no_sphinx_markup(capsys):
    for name in _subcommands():
        assert main([name, "--help"]) == 0
        out = capsys.readouterr().out
        assert not re.search(r":[a-z]+:`|``", out), (name, re.findall(r".*(?::[a-z]+:`|``).*", out))
    assert main(["plan", "--help"]) == 0
    assert "(dtlib.plan)" in capsys.readouterr().out
    assert plain(":func:`~dtlib.plan.search.search` and :mod:`dtlib.plan`, ``--json``") == \
        "search and dtlib.plan, --json"


@pytest.mark.parametrize("old,new", [("bf16-mixed", "bf16"), ("fp16-mixed", "fp16")])
def test_one_precision_vocabulary_old_spellings_still_accepted(capsys, old, new):
    base = ["memory", "--model", "llama3-8b", "--json"]
    assert main(base + ["--precision", old]) == 0
    with_old = capsys.readouterr().out
    assert main(base + ["--precision", new]) == 0
    assert capsys.readouterr().out == with_old
    assert main(["memory", "--help"]) == 0
    assert "{bf16,fp16,fp32,fp8,nvfp4}" in capsys.readouterr().out


def test_precision_outside_a_subcommand_s_range_names_it(capsys):
    assert main(["comm", "--model", "llama3-8b", "--precision", "fp8"]) == 2
    assert "--precision must be one of bf16, fp16, fp32 (or the old spelling bf16-mixed, fp16-mixed), got 'fp8'" \
        in capsys.readouterr().err


def test_memory_names_the_pipeline_stage_next_to_zero(capsys):
    assert main(["memory", "--model", "llama3-8b", "--tp", "2", "--pp", "4", "--dp", "2", "--zero", "1"]) == 0
    title = capsys.readouterr().out.splitlines()[0]
    assert "pipeline stage 3 of 0-3" in title and "zero=1" in title and "(stage" not in title
    assert main(["memory", "--model", "llama3-8b", "--dp", "2", "--zero", "1"]) == 0
    assert "stage" not in capsys.readouterr().out.splitlines()[0]  # one stage: nothing to say


def test_train_summary_says_what_ran_and_which_peak():
    summary = {"model": {"layers": 2, "hidden": 32, "heads": 4, "seq": 16, "parameters": 42880},
               "layout": {"dp": 2, "tp": 1, "pp": 1, "cp": 1, "ep": 1}, "losses": [5.5, 5.4], "first_step": 0,
               "global_batch": 4, "world_size": 2, "backend": "gloo", "tokens_per_s": 1000.0, "mfu": 0.0281,
               "mfu_peak": "this CPU's measured fp32 matmul peak (100.0 GFLOP/s, shared by all ranks)",
               "params_sha256": "0" * 64}
    lines = summary_text(summary, as_json=False).splitlines()
    assert lines[0] == ("TinyGPT (2 layers, hidden 32, 4 heads, 42,880 parameters), 2 steps of 4 sequences x 16 "
                        "tokens on 2 ranks (dp=2 tp=1 pp=1 cp=1 ep=1), backend gloo")
    assert "1,000 tokens/s, MFU 2.81% of this CPU's measured fp32 matmul peak (100.0 GFLOP/s" in lines[3]
    assert "from step 3" in header({**summary, "first_step": 2})
