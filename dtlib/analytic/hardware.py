"""Accelerators, links and clusters, each figure with its source.

Peaks are *dense* tensor-core throughput (no 2:4 sparsity), in FLOP/s; ``fp32`` is the non-tensor
FP32 rate and ``tf32`` the dense TF32 tensor-core rate. Memory sizes are the marketed capacity read
as GiB (HBM stacks are binary-sized; e.g. an "80GB" H100 reports ~79.6 GiB usable). Link bandwidth
is *per GPU, per direction* (what nccl-tests' busbw approaches); latency is NCCL's per-hop model.

The local CPU can be measured (with torch, so outside this torch-free core) and added:
``add_accelerator(dtlib.measure.measure_cpu())``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from dtlib.analytic import validate
from dtlib.analytic.units import GiB, TFLOPS

__all__ = ["Accelerator", "Link", "Cluster", "ACCELERATORS", "LINKS", "COMPUTE_DTYPES", "get_gpu",
           "get_link", "add_accelerator", "cluster"]

COMPUTE_DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")
T = TFLOPS


@dataclass(frozen=True)
class Accelerator:
    """One device: dense peaks (FLOP/s; None = unsupported), memory (bytes), HBM bandwidth (B/s);
    ``sms``: streaming multiprocessors (AMD: compute units), the unit a GEMM's tiles are scheduled
    on in waves (:mod:`dtlib.plan.gemm`); ``tdp_w``: board power at which the peaks hold (a lower
    power limit lowers the clock, :func:`dtlib.plan.gemm.clock_scale`). None where not published."""
    name: str
    peaks: dict[str, float | None]
    memory_bytes: int
    memory_bandwidth: float
    source: str
    sms: int | None = None
    tdp_w: float | None = None

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
    """An interconnect: bandwidth per GPU per direction (B/s) and per-hop latency (s)."""
    name: str
    bandwidth: float
    latency: float
    source: str


def _acc(name, fp32, tf32, bf16, fp16, fp8, mem_gib, bw_tb, source, sms=None, tdp_w=None) -> Accelerator:
    peaks = {"fp32": fp32 * T, "tf32": tf32 and tf32 * T, "bf16": bf16 and bf16 * T,
             "fp16": fp16 * T, "fp8": fp8 and fp8 * T}
    return Accelerator(name, peaks, int(mem_gib * GiB), bw_tb * 1e12, source, sms, tdp_w)


_NV_A100 = "NVIDIA A100 Tensor Core GPU datasheet (2021), SXM column, dense"
_NV_H100 = "NVIDIA H100 Tensor Core GPU datasheet (2023), dense = half the 'with sparsity' figures"
# SM counts and board power: NVIDIA A100 Tensor Core GPU Architecture whitepaper (2020), Table 3
# (108 SMs, 400 W SXM4); NVIDIA H100 Tensor Core GPU Architecture whitepaper (2022), Table 3
# (H100 SXM5 132 SMs, 700 W; H100 PCIe 114 SMs, 350 W); H200 datasheet (700 W, the H100 SXM die);
# HGX B200 datasheet (1000 W per GPU; 148 SMs: Chips and Cheese, "Nvidia's B200: Keeping the CUDA
# Juggernaut Rolling", 2025 -- 74 of 80 SMs enabled per die, two dies; not an NVIDIA figure);
# AMD CDNA 3 white paper (MI300X: 304 compute units, 750 W).
_SMS = "; SMs and TDP: vendor architecture whitepapers (see dtlib.analytic.hardware)"
ACCELERATORS: dict[str, Accelerator] = {a.name: a for a in [
    _acc("a100-40gb", 19.5, 156, 312, 312, None, 40, 1.555, _NV_A100 + _SMS, 108, 400),
    _acc("a100-80gb", 19.5, 156, 312, 312, None, 80, 2.039, _NV_A100 + _SMS, 108, 400),
    _acc("h100-sxm", 67, 494.5, 989.5, 989.5, 1979, 80, 3.35, _NV_H100 + ", H100 SXM" + _SMS, 132, 700),
    _acc("h100-pcie", 51, 378, 756.5, 756.5, 1513, 80, 2.0, _NV_H100 + ", H100 PCIe" + _SMS, 114, 350),
    _acc("h200", 67, 494.5, 989.5, 989.5, 1979, 141, 4.8,
         "NVIDIA H200 Tensor Core GPU datasheet (2024), H200 SXM, dense" + _SMS, 132, 700),
    _acc("b200", 75, 1125, 2250, 2250, 4500, 180, 8.0,
         "NVIDIA HGX B200 datasheet (2024): per-GPU = HGX 8-GPU figures / 8, dense = sparse / 2" + _SMS, 148, 1000),
    _acc("mi300x", 163.4, 653.7, 1307.4, 1307.4, 2614.9, 192, 5.3,
         "AMD Instinct MI300X data sheet (2023), dense matrix peaks" + _SMS, 304, 750),
]}

_NCCL_LAT = "latency: NCCL src/graph/tuning.cc hwLat, Ring/Simple protocol"
LINKS: dict[str, Link] = {l.name: l for l in [
    Link("nvlink3", 300e9, 3.4e-6, "NVIDIA A100 datasheet: NVLink 600 GB/s bidirectional; " + _NCCL_LAT),
    Link("nvlink4", 450e9, 3.4e-6, "NVIDIA H100 datasheet: NVLink 900 GB/s bidirectional; " + _NCCL_LAT),
    Link("nvlink5", 900e9, 3.4e-6, "NVIDIA HGX B200 datasheet: NVLink 1.8 TB/s bidirectional; " + _NCCL_LAT),
    Link("infinity-fabric", 64e9, 3.4e-6,
         "AMD MI300X data sheet: 7 x 128 GB/s links, 64 GB/s per direction to each peer; NCCL NVLink latency as proxy"),
    Link("pcie4", 32e9, 5.7e-6, "PCI-SIG PCIe 4.0 x16: 16 GT/s x 16 lanes, 128b/130b ~ 31.5 GB/s per direction; " + _NCCL_LAT),
    Link("pcie5", 64e9, 5.7e-6, "PCI-SIG PCIe 5.0 x16: 32 GT/s x 16 lanes ~ 63 GB/s per direction; " + _NCCL_LAT),
    Link("ib-hdr", 25e9, 14e-6, "NVIDIA ConnectX-6 HDR InfiniBand: 200 Gb/s per port; " + _NCCL_LAT.replace("Ring", "Net Ring")),
    Link("ib-ndr", 50e9, 14e-6, "NVIDIA ConnectX-7 NDR InfiniBand: 400 Gb/s per port; " + _NCCL_LAT.replace("Ring", "Net Ring")),
    Link("ib-xdr", 100e9, 14e-6, "NVIDIA ConnectX-8 XDR InfiniBand: 800 Gb/s per port; " + _NCCL_LAT.replace("Ring", "Net Ring")),
    Link("roce-400g", 50e9, 14e-6, "400 GbE RoCEv2 NIC (e.g. ConnectX-7 Ethernet): 400 Gb/s per port; " + _NCCL_LAT.replace("Ring", "Net Ring")),
]}


def _lookup(kind: str, table: dict, name: str):
    key = name.strip().lower()
    if key not in table:
        raise ValueError(f"unknown {kind} {name!r}; valid: {', '.join(table)}")
    return table[key]


def get_gpu(name: str) -> Accelerator:
    """The catalogue entry called ``name`` (case-insensitive)."""
    return _lookup("GPU", ACCELERATORS, name)


# substrings of the CUDA device name (torch.cuda.get_device_name) -> catalogue entry, most specific
# first: "NVIDIA H100 80GB HBM3" is the SXM part, "NVIDIA H100 PCIe" the PCIe one
_DEVICE_NAMES = (("h200", "h200"), ("h100 pcie", "h100-pcie"), ("h100", "h100-sxm"), ("b200", "b200"),
                 ("a100-sxm4-40gb", "a100-40gb"), ("a100-pcie-40gb", "a100-40gb"), ("a100", "a100-80gb"),
                 ("mi300x", "mi300x"))


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


def cluster(gpu: str = "h100-sxm", nodes: int = 1, gpus_per_node: int = 8, intra: str | None = None,
            inter: str = "ib-ndr", nics_per_node: int = 0) -> Cluster:
    """A :class:`Cluster` from catalogue names; ``intra`` defaults to the GPU's usual link."""
    acc = get_gpu(gpu)
    default_intra = {"a100": "nvlink3", "h100-sxm": "nvlink4", "h200": "nvlink4", "b200": "nvlink5",
                     "mi300x": "infinity-fabric", "h100-pcie": "pcie5"}
    if intra is None:
        intra = next((v for k, v in default_intra.items() if acc.name.startswith(k)), "pcie4")
    return Cluster(acc, nodes, gpus_per_node, get_link(intra), get_link(inter), nics_per_node)
