"""Where a job's GPUs sit: how many NVLink domains it spans and how many of its GPUs share each.

The step-time model needs one number, the GPUs of the job per NVLink domain (``Cluster.gpus_per_node``):
a group whose ranks stay inside it runs on NVLink, a larger one crosses the NICs. A DGX/HGX board
is allocated whole (8 GPUs), so a job is a whole number of boards or fits in one. An NVL72 rack is
72 GPUs on one NVLink domain in 18 compute trays of 4 GPUs (NVIDIA GB200 NVL72 / GB300 NVL72
datasheets: 36 Grace CPUs and 72 GPUs, two CPUs and four GPUs a tray), and schedulers hand it out by
tray: SLURM's topology/block plugin places a job in blocks of equal segments, 64-GPU segments
on NVL72 racks being the common choice since 64 keeps powers of two (NVIDIA's DGX GB200 user guide
and Megatron-Bridge's GB200 recipes run 64- and 128-GPU jobs). :func:`segments` therefore accepts
any multiple of the tray on such a domain and places it in equal segments, the largest that fit a
domain: 128 GPUs are two 64-GPU segments, 144 two full racks, 200 five 40-GPU segments.
"""
from __future__ import annotations

from dataclasses import dataclass

from dtlib.analytic import validate

__all__ = ["NVL72_DOMAIN", "NVL72_TRAY", "Placement", "allocation_unit", "segments"]

NVL72_DOMAIN = 72   # GPUs in one NVL72 rack's NVLink domain
NVL72_TRAY = 4      # GPUs per compute tray of an NVL72 rack


@dataclass(frozen=True)
class Placement:
    """``domains`` NVLink domains of ``domain_size`` GPUs, ``gpus_per_domain`` of the job's in each."""
    gpus: int
    domain_size: int
    domains: int
    gpus_per_domain: int

    @property
    def idle_per_domain(self) -> int:
        return self.domain_size - self.gpus_per_domain

    def describe(self) -> str:
        kind = "NVL72 rack" if self.domain_size == NVL72_DOMAIN else f"{self.domain_size}-GPU NVLink domain"
        idle = f" ({self.idle_per_domain} idle or another job's)" if self.idle_per_domain else ""
        return (f"placement: {self.domains} x {kind}, {self.gpus_per_domain} of the job's GPUs in each{idle}; "
                f"groups within {self.gpus_per_domain} consecutive ranks stay on NVLink")


def allocation_unit(domain_size: int) -> int:
    """GPUs a scheduler hands out at once on a domain of ``domain_size``: a tray of an NVL72 rack, else
    the whole domain (a DGX/HGX board)."""
    return NVL72_TRAY if domain_size == NVL72_DOMAIN else domain_size


def segments(gpus: int, domain_size: int) -> Placement:
    """The job of ``gpus`` on domains of ``domain_size``: within one domain when it fits (any count), else
    equal segments of the largest multiple of :func:`allocation_unit` that divides ``gpus`` and fits a
    domain. Raises ValueError naming ``--gpus`` when no such segment exists."""
    validate.integer("gpus", gpus)
    validate.integer("gpus_per_node", domain_size)
    if gpus <= domain_size:
        return Placement(gpus, domain_size, 1, gpus)
    unit = allocation_unit(domain_size)
    fitting = [s for s in range(unit, domain_size + 1, unit) if gpus % s == 0]
    if not fitting:
        valid = (f"multiples of {unit} (the NVL72 rack's compute tray), placed in equal segments of at most "
                 f"{domain_size}" if unit < domain_size else f"multiples of {domain_size}")
        raise ValueError(f"--gpus {gpus} is not a whole number of allocation units of --gpus-per-node "
                         f"{domain_size}; valid: {valid} (or at most {domain_size})")
    size = max(fitting)
    return Placement(gpus, domain_size, gpus // size, size)
