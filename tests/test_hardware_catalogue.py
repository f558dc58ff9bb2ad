"""Today's parts and systems: GB200/GB300 (NVL72), B300, H800, H20, MI355X, MI350X with their datasheet
figures, the system presets (``cluster(system=...)``, ``dtlib plan --system``), an NVL72 rack as
one NVLink domain, and the CLI's names and errors."""
import json

import pytest

from dtlib.analytic.config import TransformerConfig
from dtlib.analytic.hardware import (ACCELERATORS, COMPUTE_DTYPES, LINKS, SYSTEMS, catalogue_name, cluster, get_gpu,
                                     get_link, get_system)
from dtlib.analytic.layout import Parallelism
from dtlib.analytic.presets import get_preset
from dtlib.analytic.units import GiB
from dtlib.cli import main
from dtlib.plan.gemm import FLASH_BACKWARD, transformer_compute
from dtlib.plan.moe import expert_grid
from dtlib.plan.steptime import StepOptions, step_time

NEW = ("gb200", "gb300", "b300", "h800", "h20", "mi355x", "mi350x")


@pytest.mark.parametrize("name", NEW)
def test_new_parts_have_sourced_consistent_peaks(name):
    acc = get_gpu(name)
    assert acc.source and acc.sms and acc.tdp_w and acc.memory_bandwidth > 1e12
    assert acc.memory_bytes % GiB == 0  # marketed GB read as GiB, the module's convention
    # every one of these datasheets gives FP16 = BF16 and FP8 = 2 x BF16 (dense)
    assert acc.peak("bf16") == acc.peak("fp16") > acc.peak("fp32")
    assert acc.peak("fp8") == pytest.approx(2 * acc.peak("bf16"), rel=1e-3)
    if acc.peaks["tf32"]:
        assert acc.peak("bf16") == pytest.approx(2 * acc.peak("tf32"), rel=0.03)  # B300: 1.1 of 2.25 PFLOPS


def test_datasheet_figures_and_their_derivations():
    gb200 = get_gpu("gb200")
    # GB200 NVL72 datasheet: 720 PFLOPS FP8 per rack with sparsity -> per GPU = rack / 72, dense = sparse / 2
    assert gb200.peak("fp8") == pytest.approx(720e15 / 72 / 2)
    assert gb200.peak("fp4") == pytest.approx(2 * gb200.peak("fp8"))
    assert gb200.memory_bytes == 186 * GiB and gb200.tdp_w == 1200
    # Blackwell Ultra: FP4 15 PFLOPS dense, 1.5 x GB200's; the other peaks as GB200 (GB300) or B200 (B300)
    assert get_gpu("gb300").peak("fp4") == pytest.approx(1.5 * gb200.peak("fp4"))
    assert get_gpu("gb300").peak("bf16") == gb200.peak("bf16") and get_gpu("gb300").memory_bytes == 279 * GiB
    assert get_gpu("b300").peak("bf16") == get_gpu("b200").peak("bf16") and get_gpu("b300").memory_bytes == 270 * GiB
    # H800: the H100 SXM die, same tensor peaks and memory; only NVLink (and FP64) cut
    h800, h100 = get_gpu("h800"), get_gpu("h100-sxm")
    assert h800.peaks == h100.peaks and h800.memory_bytes == h100.memory_bytes and h800.sms == h100.sms
    assert get_link("nvlink-h800").bandwidth == pytest.approx(8 * 20.6e9)  # 400 GB/s bidirectional: 8 of H100's 18 links
    assert cluster("h800").intra.name == "nvlink-h800" and cluster("h800").intra.bandwidth < cluster("h100-sxm").intra.bandwidth
    # H20: 148 TFLOPS BF16 dense, 15% of an H100, with more memory (96 GB at 4 TB/s)
    assert get_gpu("h20").peak("bf16") == pytest.approx(148e12) and get_gpu("h20").memory_bytes > h100.memory_bytes
    # MI355X: 288 GB, no TF32 peak listed for CDNA 4
    mi = get_gpu("mi355x")
    assert mi.memory_bytes == 288 * GiB and cluster("mi355x").intra.name == "infinity-fabric-4"
    with pytest.raises(ValueError, match="mi355x has no tf32 peak; supported: fp32, bf16, fp16, fp8, fp4"):
        mi.peak("tf32")


def test_mi350x_against_its_cited_figures():
    """MI350X: the MI355X die at 2.2 GHz and 1,000 W (Hot Chips 2025) against 2.4 GHz and 1,400 W; the
    8-GPU platform's 18.5 / 37 / 74 PFLOPS FP16 / FP8 / FP4 (dense) / 8 agree with its peaks."""
    mi350, mi355 = get_gpu("mi350x"), get_gpu("mi355x")
    for dtype, platform in (("bf16", 18.5e15), ("fp16", 18.5e15), ("fp8", 37e15), ("fp4", 74e15)):
        assert 8 * mi350.peak(dtype) == pytest.approx(platform, rel=3e-3), dtype
        assert mi350.peak(dtype) / mi355.peak(dtype) == pytest.approx(2.2 / 2.4, rel=1e-12)
    assert mi350.peak("bf16") == pytest.approx(2306.9e12, abs=0.05e12)  # 2,516.6 x 2.2 / 2.4
    assert mi350.peak("fp32") == pytest.approx(144.2e12, abs=0.05e12) and mi350.peaks["tf32"] is None
    assert (mi350.memory_bytes, mi350.memory_bandwidth, mi350.tdp_w, mi350.sms) == (288 * GiB, 8e12, 1000, 256)
    assert cluster("mi350x").intra.name == "infinity-fabric-4" and catalogue_name("AMD Instinct MI350X") == "mi350x"


def test_cli_accepts_mi350x(capsys):
    code, out, _ = run(capsys, "plan", "--model", "llama3-8b", "--gpu", "mi350x", "--gpus", "8", "--global-batch",
                       "64", "--precision", "fp8", "--top", "1", "--json")
    assert code == 0 and json.loads(out)["gpu"] == "mi350x" and json.loads(out)["configs"]
    code, out, _ = run(capsys, "memory", "--model", "llama3-8b", "--gpu", "mi350x", "--dp", "8", "--json")
    assert code == 0 and json.loads(out)["gpu"] == {"name": "mi350x", "memory": 288 * GiB, "fits": True}
    code, out, _ = run(capsys, "flops", "--model", "llama3-8b", "--gpu", "mi350x", "--batch", "8", "--dtype", "fp4",
                       "--json")
    assert code == 0 and json.loads(out)["peak_flops_per_gpu"] == pytest.approx(74e15 / 8, rel=3e-3)


def test_fp4_is_a_compute_dtype_only_where_the_part_has_it():
    assert COMPUTE_DTYPES[-1] == "fp4"
    with pytest.raises(ValueError, match="h100-sxm has no fp4 peak; supported: fp32, tf32, bf16, fp16, fp8$"):
        get_gpu("h100-sxm").peak("fp4")


def test_unknown_names_list_the_valid_ones():
    with pytest.raises(ValueError, match="unknown GPU 'gb201'; valid: .*gb200, gb300, b300, h800, h20, mi325x, mi355x"):
        get_gpu("gb201")
    with pytest.raises(ValueError, match="unknown system 'nvl72'; valid: .*gb200-nvl72, gb300-nvl72"):
        get_system("nvl72")


@pytest.mark.parametrize("device, entry", [
    ("NVIDIA GB200", "gb200"), ("NVIDIA GB300", "gb300"), ("NVIDIA B300 SXM6 AC", "b300"), ("NVIDIA B200", "b200"),
    ("NVIDIA H800", "h800"), ("NVIDIA H20", "h20"), ("NVIDIA H200", "h200"), ("AMD Instinct MI355X", "mi355x"),
])
def test_driver_names_of_the_new_parts(device, entry):
    assert catalogue_name(device) == entry


def test_systems_are_whole_clusters():
    for s in SYSTEMS.values():
        assert s.source and s.gpu in ACCELERATORS and s.intra in LINKS and s.inter in LINKS
    rack = cluster(system="gb200-nvl72", nodes=2)
    assert (rack.gpu.name, rack.gpus_per_node, rack.world_size, rack.intra.name) == ("gb200", 72, 144, "nvlink5")
    assert rack.nics_per_node == 72 and rack.inter_bandwidth_per_gpu == get_link("ib-ndr").bandwidth
    assert cluster(system="gb300-nvl72").inter.name == "ib-xdr"  # ConnectX-8, 800 Gb/s per GPU
    # explicit arguments override the preset: a 64-GPU segment of each rack, another NIC
    seg = cluster(system="gb200-nvl72", nodes=4, gpus_per_node=64, inter="ib-xdr")
    assert (seg.world_size, seg.gpu.name, seg.intra.name, seg.inter.name) == (256, "gb200", "nvlink5", "ib-xdr")
    assert cluster(system="dgx-h100", nodes=3) == cluster("h100-sxm", 3, 8, "nvlink4", "ib-ndr")
    # GB200 and GB300 come as NVL72 racks: alone, the GPU name brings the rack's domain and NICs
    assert cluster("gb300", 2) == cluster(system="gb300-nvl72", nodes=2)
    assert cluster("gb200", 1, 8).gpus_per_node == 8  # an explicit domain still wins


def test_nvl72_keeps_a_tp_x_ep_group_of_64_on_nvlink():
    """etp 8 x ep 8 = 64 consecutive GPUs (Megatron-Core's expert grid, dtlib.plan.moe): inside one
    NVL72 domain the expert all-to-all runs on NVLink 5; on 8-GPU nodes the same group spans 8
    nodes and its all-to-all crosses the NICs."""
    moe = TransformerConfig(name="moe", layers=4, hidden=4096, heads=32, vocab=32000, seq=4096,
                            moe_experts=64, moe_top_k=2)
    layout = Parallelism(dp=16, tp=8, ep=8, etp=8, micro_batch_size=1, num_microbatches=2)
    options = StepOptions(efficiency=0.5)
    rack = step_time(moe, layout, cluster(system="gb200-nvl72", nodes=2, gpus_per_node=64), options=options)
    boards = step_time(moe, layout, cluster("gb200", 16, 8, "nvlink5", "ib-ndr"), options=options)
    assert rack.breakdown["ep_comm"] > 0
    # the 8 EP ranks of a group sit 8 apart (stride etp): all in one 64-GPU segment of the rack,
    # one per 8-GPU board
    assert expert_grid(tp=8, cp=1, dp=16, ep=8, etp=8, gpus_per_node=64)["ep_local"] == 8
    assert expert_grid(tp=8, cp=1, dp=16, ep=8, etp=8, gpus_per_node=8)["ep_local"] == 1
    assert boards.breakdown["ep_comm"] > 1.5 * rack.breakdown["ep_comm"]
    assert rack.breakdown["compute"] == boards.breakdown["compute"]


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_plan_system_and_memory_gpu(capsys):
    code, out, _ = run(capsys, "plan", "--model", "llama3-8b", "--system", "gb200-nvl72", "--gpus", "144",
                       "--global-batch", "144", "--top", "1", "--json")
    d = json.loads(out)
    assert code == 0 and d["gpu"] == "gb200" and d["configs"]
    assert (d["system"], d["gpus_per_node"], d["intra_link"], d["inter_link"]) == ("gb200-nvl72", 72, "nvlink5", "ib-ndr")
    code, out, _ = run(capsys, "plan", "--model", "llama3-8b", "--gpu", "gb200", "--gpus-per-node", "72",
                       "--gpus", "144", "--global-batch", "144", "--top", "1", "--json")
    assert code == 0 and json.loads(out)["gpu"] == "gb200"
    code, out, _ = run(capsys, "memory", "--model", "llama3-8b", "--gpu", "gb200", "--dp", "8", "--json")
    assert code == 0 and json.loads(out)["gpu"]["memory"] == 186 * GiB


@pytest.mark.parametrize("argv, message", [
    (["plan", "--model", "llama3-8b", "--gpu", "gb201", "--gpus", "8", "--global-batch", "8"],
     "argument --gpu: unknown GPU 'gb201'; valid: a100-40gb"),
    (["plan", "--model", "llama3-8b", "--system", "nvl72", "--gpus", "8", "--global-batch", "8"],
     "argument --system: unknown system 'nvl72'; valid: dgx-a100"),
    (["plan", "--model", "llama3-8b", "--inter-link", "ib-qdr", "--gpus", "8", "--global-batch", "8"],
     "argument --inter-link: unknown link 'ib-qdr'; valid: nvlink3"),
    (["plan", "--model", "llama3-8b", "--system", "gb200-nvl72", "--gpus", "258", "--global-batch", "8"],
     "--gpus 258 is not a whole number of allocation units of --gpus-per-node 72; valid: multiples of 4 (the NVL72 "
     "rack's compute tray), placed in equal segments of at most 72 (or at most 72)"),
    (["memory", "--model", "llama3-8b", "--gpu", "gb2"], "argument --gpu: unknown GPU 'gb2'"),
])
def test_bad_names_name_the_flag(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and message in err


def test_exponential_throughput_per_architecture():
    """The special-function units' exponentials: 16 per SM and clock against 2,048 / 4,096 / 8,192 dense
    BF16 FLOPs (Ampere, Hopper, Blackwell); Blackwell Ultra doubles the units. Hopper's comes to
    FlashAttention-3's '3.9 TFLOPS of special functions' for 989 TFLOPS of matmul."""
    assert get_gpu("h100-sxm").exp_rate == pytest.approx(3.9e12, rel=0.01)
    assert get_gpu("a100-80gb").flops_per_exp == 128 and get_gpu("h200").flops_per_exp == 256
    assert get_gpu("b200").flops_per_exp == get_gpu("gb200").flops_per_exp == 512
    assert get_gpu("gb300").flops_per_exp == get_gpu("b300").flops_per_exp == 256
    assert get_gpu("gb300").exp_rate == pytest.approx(2 * get_gpu("gb200").exp_rate, rel=1e-12)
    assert get_gpu("mi300x").exp_rate is None  # not published: no exponential term
    assert get_gpu("h20").exp_rate is None  # its tensor peak is cut, its units perhaps not: no ratio


def test_attention_pays_for_its_exponentials_most_at_small_head_dimension():
    """Per score, the forward's matmuls are 4 x head_dim FLOPs and the softmax one exponential (one more
    backward): on a GB200 (512 FLOPs per exponential) head dim 128 spends as long on exponentials as
    on matmuls forward, head dim 64 twice as long; GB300's doubled units halve that part."""
    n = get_preset("llama3-8b").numbers() | Parallelism(dp=1).numbers()
    seconds = {}
    for gpu, head_dim in (("gb200", 128), ("gb200", 64), ("gb300", 128), ("gb300", 64)):
        shape = n | {"head_dim": head_dim, "heads": 4096 // head_dim}
        g = get_gpu(gpu)
        seconds[gpu, head_dim] = transformer_compute(shape, g, recompute="none", dtype="bf16", flash_attention=True,
                                                     gemm_efficiency=0.5, attention_efficiency=1.0)["attention"]
        matmul_fwd = 4 * head_dim / g.peak("bf16")
        exp = 1 / g.exp_rate
        per_score = (matmul_fwd + exp) + (FLASH_BACKWARD * matmul_fwd + exp)
        scores = shape["layers"] * shape["heads"] * shape["seq"] * shape["seq"] / 2  # causal, one micro-batch
        assert seconds[gpu, head_dim] == pytest.approx(scores * per_score, rel=1e-9), (gpu, head_dim)
    # equal FLOPs at either head dimension: the smaller one pays more exponentials per FLOP
    assert seconds["gb200", 64] > seconds["gb200", 128] > seconds["gb300", 128]
