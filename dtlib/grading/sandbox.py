"""Walls around a process that runs a learner's code: its own user, its own network, hard limits.

Each submission is executed, and judged, by child processes started with :func:`child_setup` as
their ``preexec_fn``. In that child, before Python or any learner code runs:

* ``resource.setrlimit`` caps CPU seconds, address space, file size and the number of processes
  (``RLIMIT_NPROC`` counts every process of the user, which is why each submission gets a user of
  its own);
* ``unshare(CLONE_NEWNET)`` gives it a network namespace whose only interface is a fresh loopback
  (the ranks and the Jupyter kernel talk over 127.0.0.1; nothing else is reachable);
* when the grader runs as root it drops to an unprivileged user id of its own (no name needed),
  so it cannot write the course checkout, another submission's folder or the grader's files, nor
  signal or trace their processes; :func:`kill_user` then ends everything that user started,
  double-forked escapees included.

What the OS refuses is skipped and named by :func:`isolation`, which the grader prints.
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import functools
import os
import resource
import signal
import socket
import struct
import sys
import sysconfig
import time
from dataclasses import dataclass

__all__ = ["Limits", "Mounts", "isolation", "child_setup", "kill_user", "submission_user", "chown_tree",
           "process_group_cap", "remove_group", "kill_group", "sweep_groups"]

_CLONE_NEWNET = 0x40000000  # <linux/sched.h>
_CLONE_NEWNS = 0x00020000
_MS_RDONLY, _MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 0x1, 0x20, 0x1000, 0x4000, 0x40000  # <linux/mount.h>
_SIOCSIFFLAGS = 0x8914      # <linux/sockios.h>
_IFF_UP, _IFF_LOOPBACK, _IFF_RUNNING = 0x1, 0x8, 0x40
# Unprivileged user ids handed to submissions: far above any system or login user (login.defs
# ends at 60000), below the 32-bit (uid_t)-1 that means "no change".
_FIRST_UID = 3_000_000_000


@dataclass(frozen=True)
class Limits:
    """Per-process limits of a learner's processes (``RLIMIT_*``); ``processes`` is per user."""
    cpu_seconds: int = 600
    memory_bytes: int = 8 << 30   # address space: torch alone maps ~2 GiB
    file_bytes: int = 256 << 20   # any file written, logs and notebook outputs included
    processes: int = 512          # threads count too: torch, gloo and the kernel start dozens


def _netns_available() -> bool:
    return hasattr(os, "fork") and os.geteuid() == 0 and os.path.exists("/proc/self/ns/net")


def _usable_by_others(path: str) -> bool:
    """Whether any user may reach ``path`` (every folder above it searchable by others)."""
    real = os.path.realpath(path)
    folders = [real] if os.path.isdir(real) else []
    parent = os.path.dirname(real)
    while True:
        folders.append(parent)
        if parent == os.path.dirname(parent):
            break
        parent = os.path.dirname(parent)
    return all(os.stat(f).st_mode & 0o001 for f in folders) and bool(os.stat(real).st_mode & 0o004)


@functools.lru_cache(maxsize=1)
def _can_drop_user() -> bool:
    """Root, and the interpreter, its libraries and dtlib reachable by an unprivileged user."""
    if os.name != "posix" or os.geteuid() != 0:
        return False
    import dtlib

    needed = [sys.executable, sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"],
              os.path.dirname(dtlib.__file__)]
    return all(_usable_by_others(p) for p in needed)


def isolation() -> str:
    """One line: what walls this machine gives each submission (printed by the grader)."""
    parts = ["own temporary folder", "CPU/memory/file-size limits"]
    weak = []
    group = process_group_cap(f"dtlib-grade-probe-{os.getpid()}", 1)
    remove_group(group)
    if group or _can_drop_user():
        parts.append("process-count cap (" + ("pids cgroup" if group else "RLIMIT_NPROC") + ")")
    else:
        weak.append("no process-count cap (needs root: a user of its own or a pids cgroup): "
                    "a fork bomb is not contained")
    if _can_drop_user():
        parts.append("own unprivileged user per submission (cannot write the checkout or other submissions)")
    elif os.name == "posix" and os.geteuid() == 0:
        weak.append(f"submissions run as root: the interpreter ({sys.executable}) or dtlib is not "
                    "readable by other users (e.g. under /root), so no unprivileged user can run it; "
                    "install Python and the course where every user can read them")
    else:
        weak.append("grader not root: submissions run as your user and could read or write your files")
    if _netns_available():
        parts.append("no network (own network namespace, loopback only)")
        parts.append("course checkout read-only, other submissions, masters and solutions hidden (own mount namespace)")
    else:
        weak.append("network reachable, checkout writable, other submissions and masters readable "
                    "(namespaces need root)")
    line = "isolation: " + ", ".join(parts)
    return line + ("; weaker than intended (warning): " + "; ".join(weak) if weak else "")


def submission_user(index: int) -> int | None:
    """The user id for the ``index``-th learner process group of a batch, or ``None`` (not root)."""
    return _FIRST_UID + index if _can_drop_user() else None


def chown_tree(path: str, uid: int | None) -> None:
    """Give ``path`` (a submission's own folder) and what is inside it to ``uid``."""
    if uid is None:
        return
    for root, dirs, files in os.walk(path):
        for name in [root, *[os.path.join(root, n) for n in dirs + files]]:
            os.chown(name, uid, uid, follow_symlinks=False)


def _loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sH", b"lo", _IFF_UP | _IFF_LOOPBACK | _IFF_RUNNING))


_PIDS_ROOTS = ("/sys/fs/cgroup/pids", "/sys/fs/cgroup")  # cgroup v1's pids hierarchy, or v2's


def process_group_cap(name: str, processes: int) -> str | None:
    """A fresh ``pids`` cgroup allowing ``processes`` tasks, or ``None`` where none can be made.

    ``RLIMIT_NPROC`` does not bind root (the kernel exempts it), so a grader that cannot drop to
    an unprivileged user caps fork bombs with the cgroup's ``pids.max`` instead."""
    for root in _PIDS_ROOTS:
        if os.geteuid() != 0 or not os.path.exists(os.path.join(root, "cgroup.procs")):
            continue
        if root == "/sys/fs/cgroup" and not os.path.exists(os.path.join(root, "cgroup.controllers")):
            continue
        path = os.path.join(root, name)
        try:
            os.makedirs(path, exist_ok=True)
            with open(os.path.join(path, "pids.max"), "w") as f:
                f.write(str(processes))
            return path
        except OSError:
            continue
    return None


def remove_group(path: str | None) -> None:
    """Remove a cgroup made by :func:`process_group_cap` (its processes must be gone)."""
    if path:
        try:
            os.rmdir(path)
        except OSError:
            pass


@dataclass(frozen=True)
class Mounts:
    """Folders a learner's process must not see (``hidden``) or change (``read_only``)."""
    hidden: tuple[str, ...] = ()
    read_only: tuple[str, ...] = ()


def sweep_groups(prefix: str, wait: float = 60.0) -> None:
    """Kill and remove every cgroup whose name starts with ``prefix`` (a batch's leftovers: a fork
    bomb's orphans may outlive its row's own cleanup on a loaded machine)."""
    deadline = time.monotonic() + wait
    for root in _PIDS_ROOTS:
        for name in (os.listdir(root) if os.path.isdir(root) else []):
            path = os.path.join(root, name)
            while name.startswith(prefix) and os.path.isdir(path) and time.monotonic() < deadline:
                kill_group(path)
                remove_group(path)
                time.sleep(0.1)


def child_setup(limits: Limits, uid: int | None, mounts: Mounts = Mounts(), group: str | None = None) -> None:
    """``preexec_fn`` of a learner's process: new session, limits, own network, own user, and an
    empty read-only folder mounted over each of ``mounts.hidden`` (other submissions, masters,
    solutions), ``mounts.read_only`` (the course checkout) bound read-only,
    inside the ``group`` cgroup of :func:`process_group_cap`."""
    os.setsid()
    if group:
        with open(os.path.join(group, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    if _netns_available():
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.unshare(_CLONE_NEWNET) == 0:
            _loopback_up()
        hide, readonly = mounts.hidden, mounts.read_only
        if (hide or readonly) and libc.unshare(_CLONE_NEWNS) == 0:
            # private first, so these mounts never reach the grader's own view of the disk
            libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None)
            for path in readonly:  # the course checkout: readable, never writable
                libc.mount(path.encode(), path.encode(), None, _MS_BIND | _MS_REC, None)
                libc.mount(None, path.encode(), None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY, None)
            for path in hide:
                libc.mount(b"tmpfs", path.encode(), b"tmpfs", _MS_RDONLY, b"size=4k")
    for what, value in ((resource.RLIMIT_CPU, limits.cpu_seconds), (resource.RLIMIT_AS, limits.memory_bytes),
                        (resource.RLIMIT_FSIZE, limits.file_bytes), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(what, (value, value))
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        # After setuid, RLIMIT_NPROC counts the processes of this submission's user only (for
        # the grader's own user it would count all of theirs; root ignores it).
        resource.setrlimit(resource.RLIMIT_NPROC, (limits.processes, limits.processes))


def kill_group(path: str | None) -> None:
    """SIGKILL every process in the cgroup ``path`` (what a submission left running)."""
    if not path:
        return
    for _ in range(5):  # a fork bomb may spawn between two rounds; pids.max bounds it
        try:
            with open(os.path.join(path, "cgroup.procs")) as f:
                pids = [int(line) for line in f if line.strip()]
        except OSError:
            return
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def kill_user(uid: int | None) -> None:
    """SIGKILL every process of ``uid`` (``kill(-1)`` from a child running as that user)."""
    if uid is None:
        return
    pid = os.fork()
    if pid == 0:
        try:
            os.setgid(uid)
            os.setuid(uid)
            for _ in range(3):  # a fork bomb may spawn between two rounds
                try:
                    os.kill(-1, signal.SIGKILL)
                except OSError as exc:
                    if exc.errno != errno.ESRCH:
                        raise
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
