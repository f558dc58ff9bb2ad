"""Accelerators, links and clusters, each figure with its source.

Peaks are *dense* tensor-core throughput (no 2:4 sparsity), in FLOP/s; ``fp32`` is the non-tensor
FP32 rate, ``tf32`` the dense TF32 tensor-core rate and ``fp4`` the dense FP4 rate (Blackwell,
CDNA 4; None elsewhere). Datasheets that quote "with sparsity" figures only are halved (dense =
sparse / 2), and rack or 8-GPU board totals are divided by the GPU count; each source says which. Memory sizes are the marketed capacity read
as GiB (HBM stacks are binary-sized; e.g. an "80GB" H100 reports ~79.6 GiB usable). Link bandwidth
is *per GPU, per direction* (what nccl-tests' busbw approaches); latency is NCCL's per-hop model.
NVLink is taken at what NCCL's own topology model gives a GPU (:data:`NCCL_NVLINK_BW_PER_LINK` x its
links), not at the datasheet's signalling rate: about 80% of it (A100 240 of 300 GB/s, H100 370.8 of
450, B200 721.8 of 900), as DeepEP measures on NVLink 5 (726-740 GB/s).

A :class:`Cluster`'s ``gpus_per_node`` is the size of its NVLink (scale-up) domain: 8 for a DGX/HGX
board, 72 for a GB200/GB300 NVL72 rack. :data:`SYSTEMS` names whole systems (GPU, domain size,
links, NICs), so ``cluster(system="gb200-nvl72", nodes=4)`` is four racks.

The local CPU can be measured (with torch, so outside this torch-free core) and added:
``add_accelerator(dtlib.measure.measure_cpu())``.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from dtlib.analytic import validate
from dtlib.analytic.units import GiB, TFLOPS

__all__ = ["Accelerator", "KERNEL_LAUNCH_S", "FLOPS_PER_EXP", "NVFP4_GPUS", "MATMUL_DTYPES", "matmul_peak", "Link", "Cluster", "System",
           "ACCELERATORS", "GB200_SUSTAINED_CLOCK", "CDNA3_PEAK_CLOCK_MHZ", "MI300X_SUSTAINED_CLOCK",
           "MI325X_SUSTAINED_CLOCK", "LINKS", "NCCL_NVLINK_BW_PER_LINK", "SYSTEMS", "COMPUTE_DTYPES", "get_gpu", "get_link", "get_system", "add_accelerator",
           "cluster", "catalogue_name", "replace_nodes"]

COMPUTE_DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8", "fp4")
# A GPU kernel's floor beside its work: NVIDIA measured null kernels at about 3 us on recent hardware
# and software (N. Juffa, NVIDIA developer forums, "Too much time for kernel launch latency", 2022:
# https://forums.developer.nvidia.com/t/too-much-time-for-kernel-launch-latency/233645/3, "the launch
# overhead of null kernels ... about 3 microseconds ... a new speed of light")
KERNEL_LAUNCH_S = 3e-6
T = TFLOPS


@dataclass(frozen=True)
class Accelerator:
    """One device: dense peaks (FLOP/s; None = unsupported), memory (bytes), HBM bandwidth (B/s);
    ``sms``: streaming multiprocessors (AMD: compute units), the unit a GEMM's tiles are scheduled
    on in waves (:mod:`dtlib.plan.gemm`); ``tdp_w``: board power at which the peaks hold (a lower
    power limit lowers the clock, :func:`dtlib.plan.gemm.clock_scale`); ``flops_per_exp``: dense
    BF16 tensor-core FLOPs an SM does in the time its special-function units do one exponential
    (softmax's cost in attention, :data:`FLOPS_PER_EXP`). None where not published.
    ``kernel_launch_s``: the fixed cost of one kernel beside its work (:mod:`dtlib.plan.launches`):
    :data:`KERNEL_LAUNCH_S` for a GPU, measured on the machine by ``dtlib calibrate``.
    ``sustained_clock``: the share of the clock its peaks are quoted at that the SMs hold under a
    sustained matmul at the TDP, where that differs from the catalogue's convention (1: a datasheet
    quoting a clock the part sustains; GB200: :data:`GB200_SUSTAINED_CLOCK`; MI300X and MI325X, whose
    peaks are at their peak engine clock: :data:`MI300X_SUSTAINED_CLOCK`, :data:`MI325X_SUSTAINED_CLOCK`);
    it scales the tensor cores and the special-function units, never the memory, and never the peak an
    MFU is quoted against."""
    name: str
    peaks: dict[str, float | None]
    memory_bytes: int
    memory_bandwidth: float
    source: str
    sms: int | None = None
    tdp_w: float | None = None
    flops_per_exp: float | None = None
    kernel_launch_s: float = KERNEL_LAUNCH_S
    sustained_clock: float = 1.0

    def __post_init__(self) -> None:
        validate.number("kernel_launch_s", self.kernel_launch_s, minimum=0, exclusive=False)
        validate.number("sustained_clock", self.sustained_clock, maximum=1)

    @property
    def optimizer_bandwidth(self) -> float:
        """B/s of the optimizer's memory-bound update: the HBM bandwidth (a calibrated device measures its own)."""
        return self.memory_bandwidth

    @property
    def exp_rate(self) -> float | None:
        """Exponentials per second the special-function units sustain (None: not known)."""
        return None if self.flops_per_exp is None else self.peak("bf16") / self.flops_per_exp

    def peak(self, dtype: str = "bf16") -> float:
        """Dense peak FLOP/s for ``dtype`` (one of :data:`COMPUTE_DTYPES`)."""
        if dtype not in COMPUTE_DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; valid: {', '.join(COMPUTE_DTYPES)}")
        value = self.peaks.get(dtype)
        if value is None:
            supported = [d for d in COMPUTE_DTYPES if self.peaks.get(d)]
            raise ValueError(f"{self.name} has no {dtype} peak; supported: {', '.join(supported)}")
        return value


@dataclass(frozen=True)
class Link:
    """An interconnect: bandwidth per GPU per direction (B/s) and per-hop latency (s);
    ``in_network_reduction``: its switches reduce (InfiniBand SHARP, NCCL's CollNet), so an
    all-reduce sends each byte up once and receives the sum once (:func:`dtlib.analytic.comm.nccl_time`).
    ``mesh_peers``: 0 for a switched link (NVSwitch, a NIC), whose ``bandwidth`` is each GPU's whatever
    the group; k for a full mesh with one link to each of k peers (AMD Infinity Fabric, xGMI), whose
    ``bandwidth`` is one link's: a group of n GPUs on it moves data over its n-1 links at once
    (:meth:`group_bandwidth`), a point-to-point send over one."""
    name: str
    bandwidth: float
    latency: float
    source: str
    in_network_reduction: bool = False
    mesh_peers: int = 0

    def group_bandwidth(self, ranks: Any) -> Any:
        """B/s per GPU and direction a collective over ``ranks`` GPUs of this link sees: ``bandwidth``
        on a switch; on a full mesh one link per peer in the group, at most ``mesh_peers`` (RCCL runs a
        ring per link, ``rccl/src/graph``; AMD, "Understanding RCCL Bandwidth and xGMI Performance on
        AMD Instinct MI300X", ROCm blog 2025-03-02)."""
        if not self.mesh_peers:
            return self.bandwidth
        return self.bandwidth * np.clip(np.asarray(ranks, dtype=float) - 1, 1, self.mesh_peers)


# Dense BF16 tensor-core FLOPs per SM and clock over exponentials (MUFU.EX2) per SM and clock: 16
# exponentials per clock and SM on compute capability 8.x, 9.0 and 10.0 (CUDA C++ Programming Guide,
# "Arithmetic Instructions" throughput table, base-2 exponential) against 2,048 (A100: 312 TFLOPS /
# (108 SMs x 1.41 GHz)), 4,096 (Hopper: "989 TFLOPS of FP16 matmul but only 3.9 TFLOPS of special
# functions", Shah et al. 2024, FlashAttention-3, Sec. 3.1) and 8,192 (Blackwell B200/GB200, Zadouri,
# Dao et al. 2025, FlashAttention-4: the exponential, not the matmul, bounds attention's forward at
# head dimension 128); Blackwell Ultra (B300/GB300) doubles the special-function units' exponential
# throughput ("2x attention-layer acceleration", NVIDIA, "Inside NVIDIA Blackwell Ultra", 2025).
FLOPS_PER_EXP = {"ampere": 2048 / 16, "hopper": 4096 / 16, "blackwell": 8192 / 16, "blackwell-ultra": 8192 / 32}


def _acc(name, fp32, tf32, bf16, fp16, fp8, mem_gib, bw_tb, source, sms=None, tdp_w=None, fp4=None,
         arch=None, sustained_clock=1.0) -> Accelerator:
    peaks = {"fp32": fp32 * T, "tf32": tf32 and tf32 * T, "bf16": bf16 and bf16 * T,
             "fp16": fp16 * T, "fp8": fp8 and fp8 * T, "fp4": fp4 and fp4 * T}
    return Accelerator(name, peaks, int(mem_gib * GiB), bw_tb * 1e12, source, sms, tdp_w,
                       FLOPS_PER_EXP[arch] if arch else None, sustained_clock=sustained_clock)


_NV_A100 = "NVIDIA A100 Tensor Core GPU datasheet (2021), SXM column, dense"
_NV_H100 = "NVIDIA H100 Tensor Core GPU datasheet (2023), dense = half the 'with sparsity' figures"
# SM counts and board power: NVIDIA A100 Tensor Core GPU Architecture whitepaper (2020), Table 3
# (108 SMs, 400 W SXM4); NVIDIA H100 Tensor Core GPU Architecture whitepaper (2022), Table 3
# (H100 SXM5 132 SMs, 700 W; H100 PCIe 114 SMs, 350 W); H200 datasheet (700 W, the H100 SXM die);
# HGX B200 datasheet (1000 W per GPU; 148 SMs: Chips and Cheese, "Nvidia's B200: Keeping the CUDA
# Juggernaut Rolling", 2025 -- 74 of 80 SMs enabled per die, two dies; not an NVIDIA figure);
# AMD CDNA 3 white paper (MI300X: 304 compute units, 750 W).
_SMS = "; SMs and TDP: vendor architecture whitepapers (see dtlib.analytic.hardware)"
_GB200 = ("NVIDIA GB200 NVL72 datasheet (2024), 'Individual Blackwell GPU' column: FP8 10, BF16 5, TF32 2.5 PFLOPS "
          "with sparsity -> dense = sparse / 2 (the rack's 720 PFLOPS FP8 / 72 agrees), FP32 80 TFLOPS, FP4 20 PFLOPS "
          "sparse; 186 GB HBM3E at 8 TB/s per GPU; TDP configurable up to 1,200 W; 148 SMs as the B200 die "
          "(not an NVIDIA figure, not confirmed for GB200 from a text read here)")
_GB300 = ("NVIDIA GB300 NVL72 datasheet (2025) as quoted per GPU, dense, by Verda (ex-DataCrunch), 'NVIDIA GB300 "
          "NVL72: GPU Architecture & Performance' (2025): FP4 15, FP8 5, BF16 2.5, TF32 1.25 PFLOPS, FP32 80 "
          "TFLOPS, 279 GB HBM3E (the rack's 20 TB / 72), 8 TB/s, 1.4 kW; 160 SMs from NVIDIA's 'Inside "
          "Blackwell Ultra' blog (2025), not confirmed from a text read here")
_B300 = ("NVIDIA HGX B300 datasheet (2025) as quoted per GPU, dense, by the same Verda post (2025): FP4 14, FP8 4.5, "
         "BF16 2.25, TF32 1.1 PFLOPS, FP32 75 TFLOPS, 270 GB HBM3E, 7.7 TB/s, 1.1 kW; 160 SMs as GB300 (not "
         "confirmed from a text read here)")
_H800 = ("NVIDIA H800 SXM (2023): the H100 SXM5 die with NVLink cut to 400 GB/s bidirectional and FP64 cut; "
         "tensor peaks, 80 GB HBM3 at 3.35 TB/s, 132 SMs and 700 W as the H100 SXM datasheet (2023, dense = "
         "sparse / 2); NVIDIA's H800 datasheet itself was not read here (secondary: philisun.com 'NVIDIA H800 "
         "vs H100', 2025)")
_H20 = ("NVIDIA H20 (2024, for China): 148 TFLOPS FP16/BF16 dense, TF32 74, FP32 44, INT8 296 TOPS, 96 GB HBM3 at "
        "4.0 TB/s, 400 W, NVLink 900 GB/s, as quoted from NVIDIA's product brief by secondary sources "
        "(willitrunai.com, zangshuxian.com); FP8 = 2 x BF16 = 296 as on every Hopper part (derived); 78 SMs "
        "from a Geekbench 6 listing (not an NVIDIA figure); NVIDIA's own brief not read here")
_MI355X = ("AMD Instinct MI355X data sheet (2025), dense matrix: FP16/BF16 2,516.6, FP8 5,033.2, FP4 10,066.3 TFLOPS "
           "(the 'up to 10 PFLOPS FP4 / 20.1 with sparsity' of The Register and Tom's Hardware, 2025), FP32 "
           "157.3 TFLOPS vector; 288 GB HBM3E at 8 TB/s, 1,400 W; 256 CUs = 8 XCDs x 32 (AMD at ISSCC 2026); no "
           "TF32 peak listed for CDNA 4 (None); the exact TFLOPS digits were not confirmed from a text read here")
_MI325X = ("AMD Instinct MI325X (2024): the MI300X's compute (CDNA 3, 304 CUs; dense matrix FP16/BF16 1,307.4, FP8 "
           "2,614.9, TF32 653.7, FP32 163.4 TFLOPS) with 256 GB HBM3E at 6.0 TB/s and 1,000 W, as S. Bekman, 'Machine "
           "Learning Engineering', compute/accelerator/README.md tabulates it from AMD's specification page "
           "(stas00/ml-engineering 744d01e: 'MI325X is the same compute as MI300X, but has more memory and more "
           "power'); AMD's page itself not read here")
# MI350X: the MI355X die (CDNA 4, 256 CUs, 288 GB HBM3E at 8 TB/s), air-cooled at 1,000 W with a 2.2 GHz peak
# engine clock against the MI355X's 1,400 W and 2.4 GHz (AMD at Hot Chips 2025, as reported by Wccftech, "AMD's
# Instinct MI350 ... Hot Chips 2025", 2025-08-26). Same CUs doing the same operations per clock: its dense peaks
# are the MI355X's x 2.2 / 2.4 (FP16/BF16 2,306.9, FP8 4,613.8, FP4 9,227.4, FP32 vector 144.2 TFLOPS), which the
# 8-GPU MI350X platform's 18.5 / 37 / 74 PFLOPS FP16 / FP8 / FP4 (kontronn.com, "AMD unveils new Instinct MI350",
# 2025) / 8 confirm to 0.3%, as does "4.61 PFLOPS FP16 with sparsity" in gangliao.me's table ("AMD GPU
# architecture deep dive", 2026: MI350X 256 CUs, 288 GB, 8 TB/s, 1000 W). AMD's data sheet itself not read here.
MI350X_CLOCK_RATIO = 2.2 / 2.4
_MI350X = ("AMD Instinct MI350X (2025): the MI355X's dense peaks x 2.2 / 2.4 GHz (Hot Chips 2025), agreeing with "
           "the 8-GPU platform's 18.5 / 37 / 74 PFLOPS FP16 / FP8 / FP4 / 8 to 0.3%; 288 GB HBM3E at 8 TB/s, 1,000 W "
           "TBP, 256 CUs; AMD's data sheet itself not read here (docs/hardware.md)")
# GB200's datasheet peaks are its tensor throughput at its maximum SM clock: 148 SMs x 8,192 dense BF16
# FLOPs per clock (FLOPS_PER_EXP) x 2,062 MHz = 2.50 PFLOPS. B200's (the same die) are at 1,856 MHz
# (2.25 PFLOPS / (148 x 8,192)), 94.4% of its maximum 1,965 MHz: a clock it holds. Maximum SM clocks as
# nvidia-smi reports them, and the maximum achievable matmul FLOPS (MAMF: the best of a shape sweep,
# same method on both) from S. Bekman, "Machine Learning Engineering", compute/accelerator/README.md,
# "Clock speed" and "Maximum Achievable Matmul FLOPS comparison table" (stas00/ml-engineering 744d01e):
# GB200 over B200 sustains 1,822 / 1,745 = 1.044x in BF16 and 3,615.6 / 3,432.5 = 1.053x in FP8, as
# its maximum clock is 2,062 / 1,965 = 1.049x -- not the datasheets' 1.111x. So both parts hold the
# same share of their maximum clock under a matmul, and GB200 is timed at B200's: 1,856 / 1,965 of the
# clock its peaks are quoted at. GB300 has no such measurement (its clocks are not disclosed): 1.
B200_PEAK_CLOCK_MHZ = 2250e12 / (148 * 8192) / 1e6
GB200_SUSTAINED_CLOCK = B200_PEAK_CLOCK_MHZ / 1965.0
# AMD's CDNA 3 peaks are quoted at the peak engine clock: BF16 1,307.4 TFLOPS = 304 CUs x 2,048 dense FLOPs per
# CU and clock (ROCm documentation, "AMD Instinct MI300 series microarchitecture", peak-performance table) x
# 2,100 MHz, the "Peak Engine Clock" of AMD's MI300X and MI325X specifications (Bekman's "Clock speed" table,
# 744d01e). Under a sustained matmul at their TDP they run far below it: AMD measured the median clock of its
# Max-Achievable-FLOPs GEMMs (hipBLASLt, normally distributed data, warmed up, cold caches) at 1,207 MHz (MI300X)
# and 1,447 MHz (MI325X) in BF16, 1,230 and 1,464 MHz in FP8 (B. Sander et al., "Measuring Max-Achievable FLOPs -
# Part 2", ROCm blogs, 2025-02-28, Table 1; ROCm/rocm-blogs d957560). The catalogue keeps one clock per part,
# BF16's (FP8's is 1-2% higher). Check: 708 and 843 TFLOPS BF16 MAF over the peak at these clocks are 94% for
# both, the "software efficiency of up to 94%" the same post states. Those runs used a low-toggle input
# pattern (trig_float), on which AMD later says the part holds a higher clock than on real data: an upper
# bound (docs/hardware.md). CDNA 4 (MI355X, MI350X): no such measurement read here, 1.
CDNA3_PEAK_CLOCK_MHZ = 1307.4e12 / (304 * 2048) / 1e6
MI300X_SUSTAINED_CLOCK = 1207 / CDNA3_PEAK_CLOCK_MHZ
MI325X_SUSTAINED_CLOCK = 1447 / CDNA3_PEAK_CLOCK_MHZ
ACCELERATORS: dict[str, Accelerator] = {a.name: a for a in [
    _acc("a100-40gb", 19.5, 156, 312, 312, None, 40, 1.555, _NV_A100 + _SMS, 108, 400, arch="ampere"),
    _acc("a100-80gb", 19.5, 156, 312, 312, None, 80, 2.039, _NV_A100 + _SMS, 108, 400, arch="ampere"),
    _acc("h100-sxm", 67, 494.5, 989.5, 989.5, 1979, 80, 3.35, _NV_H100 + ", H100 SXM" + _SMS, 132, 700, arch="hopper"),
    _acc("h100-pcie", 51, 378, 756.5, 756.5, 1513, 80, 2.0, _NV_H100 + ", H100 PCIe" + _SMS, 114, 350, arch="hopper"),
    _acc("h200", 67, 494.5, 989.5, 989.5, 1979, 141, 4.8,
         "NVIDIA H200 Tensor Core GPU datasheet (2024), H200 SXM, dense" + _SMS, 132, 700, arch="hopper"),
    _acc("b200", 75, 1125, 2250, 2250, 4500, 180, 8.0,
         "NVIDIA HGX B200 datasheet (2024): per-GPU = HGX 8-GPU figures / 8, dense = sparse / 2 (FP4: 18 "
         "PFLOPS sparse per GPU -> 9 dense, the datasheet's 'Individual Blackwell GPU' column)" + _SMS, 148, 1000,
         fp4=9000, arch="blackwell"),
    _acc("mi300x", 163.4, 653.7, 1307.4, 1307.4, 2614.9, 192, 5.3,
         "AMD Instinct MI300X data sheet (2023), dense matrix peaks" + _SMS, 304, 750,
         sustained_clock=MI300X_SUSTAINED_CLOCK),
    # today's parts: the sources say where a figure is derived and which ones were not read here
    _acc("gb200", 80, 1250, 2500, 2500, 5000, 186, 8.0, _GB200, 148, 1200, fp4=10000, arch="blackwell",
         sustained_clock=GB200_SUSTAINED_CLOCK),
    _acc("gb300", 80, 1250, 2500, 2500, 5000, 279, 8.0, _GB300, 160, 1400, fp4=15000, arch="blackwell-ultra"),
    _acc("b300", 75, 1100, 2250, 2250, 4500, 270, 7.7, _B300, 160, 1100, fp4=14000, arch="blackwell-ultra"),
    _acc("h800", 67, 494.5, 989.5, 989.5, 1979, 80, 3.35, _H800, 132, 700, arch="hopper"),
    # no exponential rate: its tensor peak is cut to 148 TFLOPS while its special-function units
    # probably are not, so Hopper's ratio does not hold, and no figure of its own was found
    _acc("h20", 44, 74, 148, 148, 296, 96, 4.0, _H20, 78, 400),
    _acc("mi325x", 163.4, 653.7, 1307.4, 1307.4, 2614.9, 256, 6.0, _MI325X, 304, 1000,
         sustained_clock=MI325X_SUSTAINED_CLOCK),
    _acc("mi355x", 157.3, None, 2516.6, 2516.6, 5033.2, 288, 8.0, _MI355X, 256, 1400, fp4=10066.3),
    _acc("mi350x", *(x and x * MI350X_CLOCK_RATIO for x in (157.3, None, 2516.6, 2516.6, 5033.2)), 288, 8.0, _MI350X,
         256, 1000, fp4=10066.3 * MI350X_CLOCK_RATIO),
]}

_NCCL_LAT = "latency: NCCL src/graph/tuning.cc hwLat, Ring/Simple protocol"
# GB/s per NVLink link and direction in NCCL's topology model, by compute capability (NCCL
# src/graph/topo.h SM80_NVLINK_BW, SM90_NVLINK_BW, SM100_NVLINK_BW at commit 5067397, 2026; topo.cc
# ncclTopoNVLinkBw): the bandwidth NCCL's graph search builds its rings and trees on, below the
# link's signalling rate (25 GB/s per direction for NVLink 3 and 4, 50 for NVLink 5). DeepEP measures
# 726-740 GB/s on NVLink 5 at EP 8 (README, V2 at 0297fc8) against NCCL's 18 x 40.1 = 721.8.
NCCL_NVLINK_BW_PER_LINK = {"sm80": 20.0e9, "sm90": 20.6e9, "sm100": 40.1e9}
_NCCL_NVL = ("bandwidth: NCCL's topology model, {links} links x {per:g} GB/s (src/graph/topo.h {sm}, NVIDIA/nccl "
             "5067397) = {bw:g} GB/s per direction, of the datasheet's {peak}; ")


def _nvlink(name: str, links: int, sm: str, datasheet: str) -> Link:
    """An NVLink generation as NCCL sees it: ``links`` links at NCCL's per-link bandwidth."""
    per = NCCL_NVLINK_BW_PER_LINK[sm]
    source = _NCCL_NVL.format(links=links, per=per / 1e9, sm=sm.upper() + "_NVLINK_BW",
                              bw=links * per / 1e9, peak=datasheet)
    return Link(name, links * per, 3.4e-6, source + _NCCL_LAT)


# the share of an xGMI link's rate RCCL moves: 48 of 64 GB/s on MI300X (AMD ROCm blog, 2025-03-02)
XGMI_USABLE = 48 / 64
LINKS: dict[str, Link] = {l.name: l for l in [
    _nvlink("nvlink3", 12, "sm80", "NVIDIA A100 datasheet: NVLink 600 GB/s bidirectional, 12 links"),
    _nvlink("nvlink4", 18, "sm90", "NVIDIA H100 datasheet: NVLink 900 GB/s bidirectional, 18 links"),
    _nvlink("nvlink5", 18, "sm100", "NVIDIA HGX B200 datasheet: NVLink 1.8 TB/s bidirectional, 18 links"),
    _nvlink("nvlink-h800", 8, "sm90", "NVIDIA H800 SXM (2023): NVLink 400 GB/s bidirectional, 8 links (secondary "
            "sources; NVIDIA's datasheet not read here)"),
    # a full mesh of 8: one link to each of 7 peers, at the 75% of the link rate that AMD measures RCCL to reach
    # (CRC and protocol overhead: "approximately 48 GB/s per link" of xGMI's 64 on MI300X, ROCm blog
    # "Understanding RCCL Bandwidth and xGMI Performance on AMD Instinct MI300X", 2025-03-02)
    Link("infinity-fabric-4", 76.8e9 * XGMI_USABLE, 3.4e-6,
         "AMD MI355X / MI350X data sheets (2025): 7 x 153.6 GB/s bidirectional Infinity Fabric links, one per "
         "peer of 8 -> 76.8 GB/s per direction per link (derived; not confirmed from a text read here), x 0.75 "
         "usable as AMD measures on MI300X's xGMI (ROCm blog, 2025-03-02) = 57.6 GB/s per link; NCCL NVLink "
         "latency as proxy", mesh_peers=7),
    Link("infinity-fabric", 64e9 * XGMI_USABLE, 3.4e-6,
         "AMD MI300X data sheet: 7 x 128 GB/s links, 64 GB/s per direction to each peer; 'approximately 48 GB/s "
         "per link' usable (AMD, 'Understanding RCCL Bandwidth and xGMI Performance on AMD Instinct MI300X', "
         "ROCm blog 2025-03-02); NCCL NVLink latency as proxy", mesh_peers=7),
    Link("pcie4", 32e9, 5.7e-6, "PCI-SIG PCIe 4.0 x16: 16 GT/s x 16 lanes, 128b/130b ~ 31.5 GB/s per direction; " + _NCCL_LAT),
    Link("pcie5", 64e9, 5.7e-6, "PCI-SIG PCIe 5.0 x16: 32 GT/s x 16 lanes ~ 63 GB/s per direction; " + _NCCL_LAT),
    Link("ib-hdr", 25e9, 14e-6, "NVIDIA ConnectX-6 HDR InfiniBand: 200 Gb/s per port; " + _NCCL_LAT.replace("Ring", "Net Ring")),
    Link("ib-ndr", 50e9, 14e-6, "NVIDIA ConnectX-7 NDR InfiniBand: 400 Gb/s per port; " + _NCCL_LAT.replace("Ring", "Net Ring")),
    Link("ib-xdr", 100e9, 14e-6, "NVIDIA ConnectX-8 XDR InfiniBand: 800 Gb/s per port; " + _NCCL_LAT.replace("Ring", "Net Ring")),
    # a fabric option: the same NICs on switches with in-network reduction (NVIDIA Quantum-2 / Quantum-X800
    # SHARPv3, used by NCCL's CollNet through the SHARP plugin, NCCL_COLLNET_ENABLE=1)
    Link("ib-ndr-sharp", 50e9, 14e-6, "NVIDIA ConnectX-7 NDR 400 Gb/s on Quantum-2 switches with SHARPv3 in-network "
         "reduction (NCCL CollNet, NCCL_COLLNET_ENABLE=1); " + _NCCL_LAT.replace("Ring", "Net Ring"), True),
    Link("ib-xdr-sharp", 100e9, 14e-6, "NVIDIA ConnectX-8 XDR 800 Gb/s on Quantum-X800 switches with SHARPv4 in-network "
         "reduction (NCCL CollNet); " + _NCCL_LAT.replace("Ring", "Net Ring"), True),
    Link("roce-400g", 50e9, 14e-6, "400 GbE RoCEv2 NIC (e.g. ConnectX-7 Ethernet): 400 Gb/s per port; " + _NCCL_LAT.replace("Ring", "Net Ring")),
]}


# NVFP4 (E2M1 elements, an E4M3 scale per 16, an FP32 scale per tensor) is NVIDIA's format: Blackwell's tensor
# cores run it at the FP4 rate (NVIDIA 2025, "Pretraining Large Language Models with NVFP4", arXiv:2509.25149,
# Table 1; Transformer Engine's NVFP4BlockScaling recipe: "Blackwell and later (SM 10.0+)"). CDNA 4's FP4
# (MI355X, MI350X) is OCP MXFP4 (32-element blocks, E8M0 scales), which TE's NVFP4 recipe does not run.
NVFP4_GPUS = ("b200", "gb200", "b300", "gb300")
# the matmul precisions of training (dtlib.plan.steptime.DTYPES) -> the catalogue peak their GEMMs run at
MATMUL_DTYPES = {"bf16": "bf16", "fp8": "fp8", "nvfp4": "fp4"}


def matmul_peak(gpu: Accelerator, dtype: str) -> float:
    """Dense peak FLOP/s of ``gpu``'s GEMMs in ``dtype``: a :data:`COMPUTE_DTYPES` name, or ``nvfp4``
    (the FP4 peak, on the :data:`NVFP4_GPUS` only: else an error naming ``--precision``)."""
    if dtype != "nvfp4":
        return gpu.peak(dtype)
    if gpu.name not in NVFP4_GPUS or not gpu.peaks.get("fp4"):
        fp4 = " (its FP4 is MXFP4, not NVFP4)" if gpu.peaks.get("fp4") else ""
        raise validate.InvalidArgument(
            "precision", f"bf16{' or fp8' if gpu.peaks.get('fp8') else ''} on {gpu.name}{fp4}: nvfp4 needs "
                         f"NVIDIA Blackwell FP4 tensor cores ({', '.join(NVFP4_GPUS)})", dtype)
    return gpu.peak("fp4")


def _lookup(kind: str, table: dict, name: str):
    key = name.strip().lower()
    if key not in table:
        raise ValueError(f"unknown {kind} {name!r}; valid: {', '.join(table)}")
    return table[key]


def get_gpu(name: str) -> Accelerator:
    """The catalogue entry called ``name`` (case-insensitive)."""
    return _lookup("GPU", ACCELERATORS, name)


# substrings of the CUDA device name (torch.cuda.get_device_name) -> catalogue entry, most specific
# first: "NVIDIA H100 80GB HBM3" is the SXM part, "NVIDIA H100 PCIe" the PCIe one; "h200" before "h20",
# "gb200" before "b200" (each name contains the next)
_DEVICE_NAMES = (("h200", "h200"), ("h100 pcie", "h100-pcie"), ("h100", "h100-sxm"), ("h800", "h800"),
                 ("h20", "h20"), ("gb200", "gb200"), ("gb300", "gb300"), ("b200", "b200"), ("b300", "b300"),
                 ("a100-sxm4-40gb", "a100-40gb"), ("a100-pcie-40gb", "a100-40gb"), ("a100", "a100-80gb"),
                 ("mi300x", "mi300x"), ("mi325x", "mi325x"), ("mi355x", "mi355x"), ("mi350x", "mi350x"))


def catalogue_name(device_name: str) -> str | None:
    """The catalogue entry of a GPU from the name its driver reports (e.g. ``"NVIDIA H200"`` ->
    ``"h200"``), or None for a GPU the catalogue does not have."""
    key = device_name.lower()
    return next((entry for part, entry in _DEVICE_NAMES if part in key), None)


def get_link(name: str) -> Link:
    """The link called ``name`` (case-insensitive)."""
    return _lookup("link", LINKS, name)


def add_accelerator(acc: Accelerator) -> Accelerator:
    """Add (or replace) an entry of the catalogue, e.g. the measured local CPU."""
    if not acc.source:
        raise ValueError(f"accelerator {acc.name!r} needs a source (datasheet or measurement)")
    ACCELERATORS[acc.name.lower()] = acc
    return acc


@dataclass(frozen=True)
class Cluster:
    """``nodes`` x ``gpus_per_node`` accelerators; ``intra`` links GPUs in a node, ``inter`` is one
    NIC's link and ``nics_per_node`` NICs share the node's inter-node traffic."""
    gpu: Accelerator
    nodes: int
    gpus_per_node: int
    intra: Link
    inter: Link
    nics_per_node: int = field(default=0)

    def __post_init__(self) -> None:
        validate.integer("nodes", self.nodes)
        validate.integer("gpus_per_node", self.gpus_per_node)
        validate.integer("nics_per_node", self.nics_per_node, minimum=0)
        if self.nics_per_node == 0:  # default: one NIC per GPU (DGX/HGX A100, H100 layout)
            object.__setattr__(self, "nics_per_node", self.gpus_per_node)

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def inter_bandwidth_per_gpu(self) -> float:
        """Inter-node bandwidth per GPU when all GPUs of a node talk at once (NICs shared)."""
        return self.inter.bandwidth * min(self.nics_per_node, self.gpus_per_node) / self.gpus_per_node


# the usual scale-up link of each part
_DEFAULT_INTRA = {"a100-40gb": "nvlink3", "a100-80gb": "nvlink3", "h100-sxm": "nvlink4", "h200": "nvlink4", "h800": "nvlink-h800",
                  "h20": "nvlink4", "gb200": "nvlink5", "gb300": "nvlink5", "b200": "nvlink5", "b300": "nvlink5",
                  "mi300x": "infinity-fabric", "mi325x": "infinity-fabric", "mi355x": "infinity-fabric-4",
                  "mi350x": "infinity-fabric-4",
                  "h100-pcie": "pcie5"}


@dataclass(frozen=True)
class System:
    """A named system: its GPU, the NVLink domain size (``gpus_per_node``), the scale-up link, one
    NIC's link and the NICs per domain."""
    name: str
    gpu: str
    gpus_per_node: int
    intra: str
    inter: str
    nics_per_node: int
    source: str


_DGX = "NVIDIA DGX {} user guide / datasheet: {} GPUs on NVSwitch, {} x {} compute-fabric NICs ({})"
SYSTEMS: dict[str, System] = {s.name: s for s in [
    System("dgx-a100", "a100-80gb", 8, "nvlink3", "ib-hdr", 8,
           _DGX.format("A100", 8, 8, "ConnectX-6 200 Gb/s", "2020")),
    System("dgx-h100", "h100-sxm", 8, "nvlink4", "ib-ndr", 8,
           _DGX.format("H100", 8, 8, "ConnectX-7 400 Gb/s", "2023")),
    System("dgx-b200", "b200", 8, "nvlink5", "ib-ndr", 8,
           _DGX.format("B200", 8, 8, "ConnectX-7 400 Gb/s", "2024")),
    System("dgx-b300", "b300", 8, "nvlink5", "ib-xdr", 8,
           _DGX.format("B300", 8, 8, "ConnectX-8 800 Gb/s", "2025; not confirmed from a text read here")),
    System("hgx-h800", "h800", 8, "nvlink-h800", "ib-ndr", 8,
           "DeepSeek-V3 Technical Report (2024), Sec. 3.1: 8 H800 per node on NVLink/NVSwitch, InfiniBand "
           "across nodes; 8 x 400 Gb/s ConnectX-7 per node as DeepSeek's ISCA 2025 'Insights into DeepSeek-V3' "
           "describes (not read here)"),
    System("gb200-nvl72", "gb200", 72, "nvlink5", "ib-ndr", 72,
           "NVIDIA GB200 NVL72 datasheet (2024): 72 Blackwell GPUs in one NVLink 5 domain (130 TB/s = 72 x 1.8 "
           "TB/s); DGX GB200 (2024): one ConnectX-7 400 Gb/s NIC per GPU"),
    System("gb300-nvl72", "gb300", 72, "nvlink5", "ib-xdr", 72,
           "NVIDIA GB300 NVL72 datasheet (2025): 72 Blackwell Ultra GPUs in one NVLink 5 domain (130 TB/s); "
           "one ConnectX-8 SuperNIC 800 Gb/s per GPU"),
]}


# parts that come as NVL72 racks: ``cluster(gpu)`` defaults to the rack's domain, links and NICs
_RACK_ONLY = {"gb200": "gb200-nvl72", "gb300": "gb300-nvl72"}


def get_system(name: str) -> System:
    """The system preset called ``name`` (case-insensitive)."""
    return _lookup("system", SYSTEMS, name)


def cluster(gpu: str | None = None, nodes: int = 1, gpus_per_node: int | None = None, intra: str | None = None,
            inter: str | None = None, nics_per_node: int | None = None, system: str | None = None) -> Cluster:
    """A :class:`Cluster` from catalogue names; ``intra`` defaults to the GPU's usual link.

    ``system`` (a :data:`SYSTEMS` name) fills in the GPU, ``gpus_per_node`` (the NVLink domain),
    both links and the NICs; any of them given explicitly overrides it (e.g. ``gpus_per_node=64``:
    a 64-GPU segment of each NVL72 rack). Without a system: an H100 SXM, 8 per node, NDR
    InfiniBand, one NIC per GPU; a GB200 or GB300 alone defaults to its NVL72 rack."""
    if system is None and gpu is not None and get_gpu(gpu).name in _RACK_ONLY:
        system = _RACK_ONLY[get_gpu(gpu).name]  # sold only as NVL72 racks: their domain and NICs by default
    s = get_system(system) if system is not None else System("", "h100-sxm", 8, "", "ib-ndr", 0, "")
    acc = get_gpu(s.gpu if gpu is None else gpu)
    g = s.gpus_per_node if gpus_per_node is None else gpus_per_node
    if intra is None:
        intra = s.intra if system is not None and gpu is None else _DEFAULT_INTRA.get(acc.name, "pcie4")
    nics = s.nics_per_node if nics_per_node is None else nics_per_node
    return Cluster(acc, nodes, g, get_link(intra), get_link(s.inter if inter is None else inter), nics)


def replace_nodes(c: Cluster, nodes: int) -> Cluster:
    """``c`` with ``nodes`` nodes (NVLink domains), everything else the same."""
    return replace(c, nodes=nodes)
