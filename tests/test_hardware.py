"""Hardware catalogue: every figure sourced and plausible, look-ups explain bad names, clusters,
entries added (the measured local CPU: test_measure.py)."""
import pytest

from dtlib.analytic.hardware import (ACCELERATORS, catalogue_name, COMPUTE_DTYPES, LINKS, Accelerator, Cluster, add_accelerator,
                                     cluster, get_gpu, get_link)

REQUIRED = {"a100-40gb", "a100-80gb", "h100-sxm", "h100-pcie", "h200", "b200", "mi300x"}


def test_catalogue_covers_the_required_parts_with_sources():
    assert REQUIRED <= set(ACCELERATORS)
    assert {"nvlink3", "nvlink4", "nvlink5", "pcie4", "pcie5", "ib-hdr", "ib-ndr", "ib-xdr", "roce-400g"} <= set(LINKS)
    for acc in ACCELERATORS.values():
        assert acc.source and acc.memory_bytes > 0 and acc.memory_bandwidth > 0
    for link in LINKS.values():
        assert link.source and link.bandwidth > 0 and 0 < link.latency < 1e-4


@pytest.mark.parametrize("name", sorted(REQUIRED))
def test_peaks_are_ordered_as_the_hardware(name):
    acc = get_gpu(name)
    assert acc.peak("bf16") == acc.peak("fp16") > acc.peak("tf32") > acc.peak("fp32")
    if acc.peaks["fp8"]:
        assert acc.peak("fp8") == pytest.approx(2 * acc.peak("bf16"), rel=0.01)


def test_published_datasheet_figures():
    assert get_gpu("a100-80gb").peak("bf16") == 312e12          # A100 datasheet, dense
    assert get_gpu("h100-sxm").peak("bf16") == pytest.approx(989.5e12, rel=1e-3)  # 1979 sparse / 2
    assert get_gpu("mi300x").memory_bytes == 192 * 2 ** 30
    # MI325X: the MI300X's compute and scale-up with 256 GB of HBM3E at 6 TB/s (Bekman's table)
    mi325x, mi300x = get_gpu("mi325x"), get_gpu("mi300x")
    assert mi325x.peaks == mi300x.peaks and mi325x.memory_bytes == 256 * 2 ** 30 and mi325x.memory_bandwidth == 6e12
    assert cluster("mi325x").intra.name == "infinity-fabric"
    assert get_link("ib-ndr").bandwidth == 50e9                # 400 Gb/s
    # NVLink as NCCL's topology model sees it (src/graph/topo.h): links x per-link GB/s, ~80% of the
    # datasheet's signalling rate (H100: 900 GB/s bidirectional = 18 links x 25 GB/s per direction)
    assert get_link("nvlink4").bandwidth == pytest.approx(18 * 20.6e9)
    assert get_link("nvlink3").bandwidth == pytest.approx(12 * 20.0e9)
    assert get_link("nvlink5").bandwidth == pytest.approx(18 * 40.1e9)


def test_amds_cdna3_parts_are_timed_at_the_clock_amd_measured_under_a_matmul():
    """AMD quotes CDNA 3 peaks at the 2,100 MHz peak engine clock (304 CUs x 2,048 BF16 FLOPs per CU and
    clock, ROCm's MI300 microarchitecture page) and measured its MAF GEMMs' median clock far below it
    (ROCm blogs, "Measuring Max-Achievable FLOPs - Part 2", Table 1): at that clock the BF16 MAF is the
    post's "software efficiency of up to 94%" on both parts, which a misread clock would not give."""
    from dtlib.analytic.hardware import CDNA3_PEAK_CLOCK_MHZ, MI300X_SUSTAINED_CLOCK, MI325X_SUSTAINED_CLOCK
    from dtlib.plan.gemm import clock_scale, gemm_time

    assert CDNA3_PEAK_CLOCK_MHZ == pytest.approx(2100, abs=0.5)
    for name, clock, maf_bf16 in (("mi300x", MI300X_SUSTAINED_CLOCK, 708e12), ("mi325x", MI325X_SUSTAINED_CLOCK, 843e12)):
        gpu = get_gpu(name)
        assert gpu.sustained_clock == clock and clock_scale(gpu) == clock
        assert round(maf_bf16 / (gpu.peak("bf16") * clock), 2) == 0.94, name
    assert MI325X_SUSTAINED_CLOCK * 2100 == pytest.approx(1447, abs=1)
    # the step's GEMMs run at that clock; the peak an MFU is quoted against stays the datasheet's
    mi325x = get_gpu("mi325x")
    held = gemm_time(8192, 8192, 8192, mi325x, clock=clock_scale(mi325x))
    assert held == pytest.approx(gemm_time(8192, 8192, 8192, mi325x) / MI325X_SUSTAINED_CLOCK)
    assert mi325x.peak("bf16") == pytest.approx(1307.4e12)
    # CDNA 4 has no such measurement here: the datasheet's clock
    assert get_gpu("mi355x").sustained_clock == 1 == get_gpu("mi350x").sustained_clock


def test_lookups_list_valid_names():
    assert get_gpu(" H100-SXM ") is ACCELERATORS["h100-sxm"]
    with pytest.raises(ValueError, match="unknown GPU 'v100'; valid: a100-40gb"):
        get_gpu("v100")
    with pytest.raises(ValueError, match="unknown link"):
        get_link("ethernet")
    with pytest.raises(ValueError, match="has no fp8 peak; supported: fp32, tf32, bf16, fp16"):
        get_gpu("a100-40gb").peak("fp8")
    with pytest.raises(ValueError, match="unknown dtype 'int4'; valid: " + ", ".join(COMPUTE_DTYPES)):
        get_gpu("h100-sxm").peak("int4")


def test_cluster_shares_nics():
    c = cluster("h100-sxm", nodes=4, gpus_per_node=8)
    assert c.world_size == 32 and c.intra.name == "nvlink4" and c.nics_per_node == 8
    assert c.inter_bandwidth_per_gpu == get_link("ib-ndr").bandwidth
    assert cluster("h100-sxm", 4, 8, nics_per_node=2).inter_bandwidth_per_gpu == 50e9 / 4
    assert cluster("mi300x").intra.name == "infinity-fabric"
    with pytest.raises(ValueError, match="nodes must be an integer >= 1, got 0"):
        Cluster(get_gpu("h100-sxm"), 0, 8, get_link("nvlink4"), get_link("ib-ndr"))


def test_added_entries_need_a_source():
    with pytest.raises(ValueError, match="needs a source"):
        add_accelerator(Accelerator("x", {"fp32": 1.0}, 1, 1.0, ""))


@pytest.mark.parametrize("device, entry", [
    ("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100-sxm"), ("NVIDIA H100 PCIe", "h100-pcie"),
    ("NVIDIA A100-SXM4-40GB", "a100-40gb"), ("NVIDIA A100-SXM4-80GB", "a100-80gb"), ("NVIDIA B200", "b200"),
    ("AMD Instinct MI300X", "mi300x"), ("AMD Instinct MI325X", "mi325x"), ("Tesla T4", None),
])
def test_catalogue_name_from_the_driver_name(device, entry):
    assert catalogue_name(device) == entry


def test_amd_mesh_uses_one_link_per_peer():
    """MI300X's xGMI: a full mesh of 8, ~48 GB/s usable a link (AMD ROCm blog, 2025-03-02). A collective
    over n GPUs of the node moves data over n-1 links; a point-to-point send over one; NVSwitch does not
    depend on the group."""
    from dtlib.analytic.comm import algbw, bus_factor, collective_time
    xgmi, nvlink = get_link("infinity-fabric"), get_link("nvlink4")
    size = 2 ** 30
    for n, links in ((2, 1), (4, 3), (8, 7)):
        busbw = algbw(size, collective_time("all_reduce", size, n, xgmi)) * bus_factor("all_reduce", n)
        assert busbw == pytest.approx(links * 48e9, rel=0.01)
        on_nvlink = algbw(size, collective_time("all_reduce", size, n, nvlink)) * bus_factor("all_reduce", n)
        assert on_nvlink == pytest.approx(370.8e9, rel=0.01)
    assert size / collective_time("p2p", size, 2, xgmi) == pytest.approx(48e9, rel=0.01)
    assert get_link("infinity-fabric-4").group_bandwidth(8) == pytest.approx(7 * 76.8e9 * 0.75)
