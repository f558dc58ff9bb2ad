"""Gang scheduling of several training jobs on one cluster: first-fit vs topology-aware, simulated.

A distributed training job needs all its GPUs at once (*gang* scheduling: a rank that starts
alone waits at the first collective); Jeon et al. 2019, "Analysis of Large-Scale Multi-Tenant GPU
Clusters for DNN Training Workloads" (Microsoft's Philly traces, USENIX ATC) found the two costs
simulated here: jobs queue while enough GPUs are free but scattered (*fragmentation*), and a job
spread over more nodes or racks than it needs runs slower (its collectives cross slower links).
Slurm's ``--switches`` and ``topology.conf`` and Kubernetes gang schedulers (Volcano, Kueue
``PodGroup``/topology-aware scheduling) exist for exactly this.

The simulation is plain Python (an event loop over start and finish times), FIFO with no
backfilling: the head of the queue blocks the jobs behind it, as gang schedulers without
reservations do.

* ``"first-fit"``: the lowest-numbered free GPUs, wherever they are;
* ``"topology"``: the fewest nodes (a job that fits in one node goes on the fullest node with room:
  best fit), then the fewest racks; it never spreads a job over more nodes than it needs while
  waiting could avoid it, unless ``spread_after`` seconds of waiting have passed.

A job on more nodes (racks) than the minimum runs ``spread_slowdown`` (``rack_slowdown``) times as
long.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from dtlib.analytic import validate
from dtlib.plan.placement import ClusterSpec

__all__ = ["Job", "Scheduled", "POLICIES", "simulate", "allocate", "summary"]

POLICIES = ("first-fit", "topology")


@dataclass(frozen=True)
class Job:
    """``gpus`` GPUs for ``duration`` seconds (on the fewest nodes), submitted at ``arrival``."""
    name: str
    gpus: int
    duration: float
    arrival: float = 0.0

    def __post_init__(self) -> None:
        validate.integer("gpus", self.gpus)
        validate.number("duration", self.duration)
        validate.number("arrival", self.arrival, exclusive=False)


@dataclass
class Scheduled:
    """Where and when a job ran: its GPUs, start, end, wait, and nodes/racks spanned."""
    job: Job
    gpus: list[int]
    start: float
    end: float
    nodes: int
    racks: int
    slowdown: float = 1.0
    extra: dict = field(default_factory=dict)

    @property
    def wait(self) -> float:
        return self.start - self.job.arrival


def _min_nodes(job: Job, c: ClusterSpec) -> int:
    return -(-job.gpus // c.gpus_per_node)


def _min_racks(job: Job, c: ClusterSpec) -> int:
    return -(-_min_nodes(job, c) // c.nodes_per_rack)


def allocate(job: Job, free: set[int], cluster: ClusterSpec, policy: str) -> list[int] | None:
    """The GPUs ``policy`` gives ``job`` out of ``free`` now, or None (it waits)."""
    if len(free) < job.gpus:
        return None
    if policy == "first-fit":
        return sorted(free)[:job.gpus]
    c = cluster
    per_node: dict[int, list[int]] = {}
    for g in sorted(free):
        per_node.setdefault(c.node(g), []).append(g)
    if job.gpus <= c.gpus_per_node:  # one node: the fullest node with room (best fit)
        fits = [n for n, gs in per_node.items() if len(gs) >= job.gpus]
        if not fits:
            return None
        best = min(fits, key=lambda n: (len(per_node[n]), n))
        return per_node[best][:job.gpus]
    # several nodes: whole free nodes, inside the fewest racks (the rack with the fewest free whole
    # nodes that still holds the job first: best fit again)
    need = _min_nodes(job, c)
    whole = [n for n, gs in per_node.items() if len(gs) == c.gpus_per_node]
    by_rack: dict[int, list[int]] = {}
    for n in whole:
        by_rack.setdefault(n // c.nodes_per_rack, []).append(n)
    fits = [r for r, ns in by_rack.items() if len(ns) >= need]
    if fits:
        r = min(fits, key=lambda r: (len(by_rack[r]), r))
        nodes = by_rack[r][:need]
    elif len(whole) >= need:  # the fewest racks: fullest racks first
        nodes = []
        for r in sorted(by_rack, key=lambda r: (-len(by_rack[r]), r)):
            nodes += by_rack[r][:need - len(nodes)]
            if len(nodes) == need:
                break
    else:
        return None
    return [g for n in nodes for g in per_node[n]][:job.gpus]


def simulate(jobs: Sequence[Job], cluster: ClusterSpec, policy: str = "first-fit",
             spread_slowdown: float = 1.5, rack_slowdown: float = 1.2,
             spread_after: float | None = None) -> list[Scheduled]:
    """Run ``jobs`` (FIFO by arrival, then by their order) on ``cluster`` under ``policy``; every
    job's placement and times, in the order they started. ``spread_after``: with ``"topology"``, a
    job that has waited that long takes first-fit GPUs (None: it waits for a compact placement)."""
    validate.one_of("policy", policy, POLICIES)
    validate.number("spread_slowdown", spread_slowdown, minimum=1, exclusive=False)
    validate.number("rack_slowdown", rack_slowdown, minimum=1, exclusive=False)
    for j in jobs:
        if j.gpus > cluster.gpus:
            raise ValueError(f"job {j.name} needs {j.gpus} GPUs; the cluster has {cluster.gpus}")
    queue = sorted(jobs, key=lambda j: j.arrival)  # stable: ties keep the given order
    free = set(range(cluster.gpus))
    running: list[Scheduled] = []
    done: list[Scheduled] = []
    now = 0.0
    while queue or running:
        # start what can start now, in FIFO order (no backfill: the head blocks the rest)
        while queue and queue[0].arrival <= now:
            job = queue[0]
            how = policy
            if policy == "topology" and spread_after is not None and now - job.arrival >= spread_after:
                how = "first-fit"
            gpus = allocate(job, free, cluster, how)
            if gpus is None:
                break
            queue.pop(0)
            nodes = len({cluster.node(g) for g in gpus})
            racks = len({cluster.rack(g) for g in gpus})
            slow = (spread_slowdown if nodes > _min_nodes(job, cluster) else 1.0) * \
                   (rack_slowdown if racks > _min_racks(job, cluster) else 1.0)
            s = Scheduled(job, gpus, now, now + job.duration * slow, nodes, racks, slow)
            s.extra["free_at_start"] = len(free)
            free -= set(gpus)
            running.append(s)
        # next event: a finish, or an arrival
        events = [s.end for s in running] + ([queue[0].arrival] if queue and queue[0].arrival > now else [])
        if not events:
            raise RuntimeError("the scheduler is stuck: a job can never be placed")  # pragma: no cover
        now = min(events)
        for s in [s for s in running if s.end <= now]:
            running.remove(s)
            free |= set(s.gpus)
            done.append(s)
    return sorted(done, key=lambda s: (s.start, s.job.name))


def summary(schedule: Sequence[Scheduled], cluster: ClusterSpec) -> dict[str, float]:
    """``makespan``, ``mean_wait``, ``mean_completion`` (end - arrival), ``spread_jobs`` (on more
    nodes than needed), ``utilisation`` (GPU-seconds busy / GPUs x makespan) and
    ``idle_while_waiting``: GPU-seconds left free while some job waited (the fragmentation cost)."""
    makespan = max(s.end for s in schedule)
    busy = sum(len(s.gpus) * (s.end - s.start) for s in schedule)
    # free GPU-seconds during intervals in which some job was queued
    times = sorted({0.0, makespan} | {s.start for s in schedule} | {s.end for s in schedule}
                   | {s.job.arrival for s in schedule})
    idle = 0.0
    for a, b in zip(times, times[1:]):
        mid = (a + b) / 2
        waiting = any(s.job.arrival <= mid < s.start for s in schedule)
        if waiting:
            used = sum(len(s.gpus) for s in schedule if s.start <= mid < s.end)
            idle += (cluster.gpus - used) * (b - a)
    n = len(schedule)
    return {"makespan": makespan, "mean_wait": sum(s.wait for s in schedule) / n,
            "mean_completion": sum(s.end - s.job.arrival for s in schedule) / n,
            "spread_jobs": sum(s.slowdown > 1 for s in schedule), "utilisation": busy / (cluster.gpus * makespan),
            "idle_while_waiting": idle}
