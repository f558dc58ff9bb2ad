"""Per-learner CPU and memory limits, enforced by the kernel: one cgroup per single-user server.

JupyterHub's ``Spawner.cpu_limit`` and ``Spawner.mem_limit`` are only advice to the spawner
(its docs: "only enforced if the spawner supports it"); ``LocalProcessSpawner`` ignores them. Here
each learner's server joins a cgroup of its own before it runs, so the server, its kernels and
every rank they launch share one budget:

* CPU: a CFS quota of ``cpu_limit`` cores (cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` over
  ``cpu.cfs_period_us``: the kernel's "CFS Bandwidth Control", Documentation/scheduler/sched-bwc.rst);
* memory: ``mem_limit`` bytes for the whole tree (v2 ``memory.max``, v1 ``memory.limit_in_bytes``);
  past it the kernel reclaims, then its OOM killer ends a process of that learner only;
* tasks: at most ``tasks_limit`` processes and threads at once (``pids.max``, where the ``pids``
  controller is there), so a fork bomb stops at the learner's own cap.

The groups are made under the hub's own cgroup of each controller (the place a service manager
delegates), named ``dtlib-workshop-<user>``. Where no cgroup can be made (not root, cgroups
read-only, a v2 hierarchy whose controllers are not delegated), :func:`make_group` returns a group
with no paths and :func:`join` falls back to ``RLIMIT_AS`` = ``mem_limit`` per process, a weaker
guarantee: each process of the learner may use that much address space (not the tree in all),
``RLIMIT_NPROC`` = ``tasks_limit`` counts all processes of the learner's uid (root is exempt), and
the CPU is not capped (the server only runs at a lower priority, ``nice`` 10).
"""
from __future__ import annotations

import os
import resource
import signal
import time
from dataclasses import dataclass

CFS_PERIOD_US = 100_000  # the kernel's default period (sched-bwc.rst); the quota is cores x this


@dataclass(frozen=True)
class Group:
    """A learner's cgroups (one per controller hierarchy; none when cgroups are unavailable)."""
    paths: tuple[str, ...]
    version: int  # 1 or 2; 0 when no cgroup could be made
    mem_limit: int | None
    tasks_limit: int | None = None

    @property
    def enforced(self) -> str:
        """What this group guarantees, in one line (for the hub's log and the instructor)."""
        if self.version:
            return f"cgroup v{self.version}: CPU quota, memory and task limits for the learner's whole process tree"
        return "no writable cgroup: RLIMIT_AS per process and nice 10, CPU not capped"


def _mounts() -> dict[str, str]:
    """Mount point of each v1 controller (``cpu``, ``memory``...) and of v2 (key ``""``)."""
    found = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            kind, options = fields[fields.index("-") + 1], fields[-1].split(",")
            if kind == "cgroup2":
                found.setdefault("", fields[4])
            elif kind == "cgroup":
                for option in options:
                    found.setdefault(option, fields[4])
    return found


def _own(controller: str) -> str:
    """This process's cgroup in the hierarchy of ``controller`` (``""``: the v2 hierarchy)."""
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if controllers.split(",") == [""] and not controller or controller in controllers.split(","):
                return path
    raise OSError(f"this process is in no {controller or 'v2'} cgroup")


def _write(path: str, name: str, value: str) -> None:
    with open(os.path.join(path, name), "w") as f:
        f.write(value)


def locate(user: str) -> Group:
    """Where ``user``'s cgroups are, or would be (no limits read; version 0 without cgroups).
    Hybrid machines (v1 ``cpu`` and ``memory`` mounted beside an empty v2) use v1."""
    mounts = _mounts() if os.path.exists("/proc/self/mountinfo") else {}
    name = f"dtlib-workshop-{user}"
    if "cpu" in mounts and "memory" in mounts:
        kinds = ("cpu", "memory", "pids") if "pids" in mounts else ("cpu", "memory")
        return Group(tuple(os.path.join(mounts[k], _own(k).lstrip("/"), name) for k in kinds), 1, None)
    if "" in mounts:
        return Group((os.path.join(mounts[""], _own("").lstrip("/"), name),), 2, None)
    return Group((), 0, None)


def _create(version: int, paths: tuple[str, ...], cpu_limit: float | None, mem_limit: int | None,
            tasks_limit: int | None) -> None:
    quota = round(cpu_limit * CFS_PERIOD_US) if cpu_limit else None
    if version == 2:  # the parent must hand the controllers down (EBUSY where it holds processes)
        _write(os.path.dirname(paths[0]), "cgroup.subtree_control", "+cpu +memory")
        try:
            _write(os.path.dirname(paths[0]), "cgroup.subtree_control", "+pids")
        except OSError:  # a kernel without the pids controller: the other two still hold
            pass
    for path in paths:
        os.makedirs(path, exist_ok=True)
    if version == 1:
        cpu, memory = paths[:2]
        _write(cpu, "cpu.cfs_period_us", str(CFS_PERIOD_US))
        _write(cpu, "cpu.cfs_quota_us", str(quota or -1))
        _write(memory, "memory.limit_in_bytes", str(mem_limit or -1))
    else:
        _write(paths[0], "cpu.max", f"{quota or 'max'} {CFS_PERIOD_US}")
        _write(paths[0], "memory.max", str(mem_limit or "max"))
    if os.path.exists(os.path.join(paths[-1], "pids.max")):
        _write(paths[-1], "pids.max", str(tasks_limit or "max"))


def make_group(user: str, cpu_limit: float | None, mem_limit: int | None, tasks_limit: int | None = None) -> Group:
    """The cgroups for ``user``'s server, limits set (``None``/0: unlimited), or the fallback."""
    if cpu_limit is not None and not cpu_limit >= 0:
        raise ValueError(f"cpu_limit must be >= 0 cores (0: unlimited), got {cpu_limit}")
    if mem_limit is not None and not mem_limit >= 0:
        raise ValueError(f"mem_limit must be >= 0 bytes (0: unlimited), got {mem_limit}")
    if tasks_limit is not None and not tasks_limit >= 0:
        raise ValueError(f"tasks_limit must be >= 0 processes and threads (0: unlimited), got {tasks_limit}")
    if os.geteuid() == 0:
        where = locate(user)
        try:
            if where.version:
                _create(where.version, where.paths, cpu_limit, mem_limit, tasks_limit)
                return Group(where.paths, where.version, mem_limit, tasks_limit)
        except OSError:
            pass
    return Group((), 0, mem_limit, tasks_limit)


def join(group: Group) -> None:
    """Put the calling process in ``group`` (a ``preexec_fn``: after fork, before exec, as root)."""
    for path in group.paths:
        _write(path, "cgroup.procs", str(os.getpid()))
    if not group.version:
        if group.mem_limit:
            resource.setrlimit(resource.RLIMIT_AS, (group.mem_limit, group.mem_limit))
        if group.tasks_limit:
            resource.setrlimit(resource.RLIMIT_NPROC, (group.tasks_limit, group.tasks_limit))
        os.nice(10)


def pids(group: Group) -> list[int]:
    """The processes in ``group`` now (empty for the fallback, which has no group to read)."""
    found: set[int] = set()
    for path in group.paths:
        try:
            with open(os.path.join(path, "cgroup.procs")) as f:
                found.update(int(line) for line in f if line.strip())
        except FileNotFoundError:
            pass
    return sorted(found)


def enforced(group: Group) -> tuple[float | None, int | None, int | None]:
    """``(cores, bytes, tasks)`` the kernel enforces on ``group`` now, read back from its cgroup
    files (``None``: unlimited, or no cgroup)."""
    values: dict[str, str] = {}
    for path in group.paths:
        for name in ("cpu.max", "memory.max", "cpu.cfs_quota_us", "cpu.cfs_period_us", "memory.limit_in_bytes",
                     "pids.max"):
            if os.path.exists(os.path.join(path, name)):
                with open(os.path.join(path, name)) as f:
                    values[name] = f.read().strip()
    if "cpu.max" in values:
        quota, period = values["cpu.max"].split()
        memory = values["memory.max"]
    else:
        quota, period = values.get("cpu.cfs_quota_us", "-1"), values.get("cpu.cfs_period_us", "1")
        memory = values.get("memory.limit_in_bytes", "-1")
    cores = None if quota in ("max", "-1") else int(quota) / int(period)
    # v1 reports "no limit" as the largest page-aligned value (PAGE_COUNTER_MAX pages)
    limit = None if memory in ("max", "-1") or int(memory) >= 2**62 else int(memory)
    tasks = values.get("pids.max", "max")
    return cores, limit, None if tasks == "max" else int(tasks)


def peak_memory(group: Group) -> int | None:
    """The most memory (bytes) the group's processes held at once, where the kernel records it."""
    for path in group.paths:
        for name in ("memory.peak", "memory.max_usage_in_bytes"):
            if os.path.exists(os.path.join(path, name)):
                with open(os.path.join(path, name)) as f:
                    return int(f.read())
    return None


def remove(group: Group, wait: float = 5.0) -> list[str]:
    """SIGKILL whatever is still in ``group`` (a kernel or a rank the server left), then remove
    it; returns the cgroups that could not be removed within ``wait`` seconds."""
    deadline = time.monotonic() + wait
    left = list(group.paths)
    while left and time.monotonic() < deadline:
        for pid in pids(group):  # a process may fork between the list and the kill: loop
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for path in list(left):
            try:
                os.rmdir(path)  # refused (EBUSY) until its killed processes have been reaped
                left.remove(path)
            except FileNotFoundError:
                left.remove(path)
            except OSError:
                time.sleep(0.05)
    return left
