"""Walls around a process that runs a learner's code: its own user, its own network, hard limits.

Each submission is executed, and judged, by child processes started with :func:`child_setup` as
their ``preexec_fn``. In that child, before Python or any learner code runs:

* ``resource.setrlimit`` caps CPU seconds, address space, file size and the number of processes
  (``RLIMIT_NPROC`` counts every process of the user, which is why each submission gets a user of
  its own);
* ``unshare(CLONE_NEWNET)`` gives it a network namespace whose only interface is a fresh loopback
  (the ranks and the Jupyter kernel talk over 127.0.0.1; nothing else is reachable);
* ``unshare(CLONE_NEWNS)`` gives it a mount namespace: the checkout read-only, the other
  submissions, masters, solutions and git history hidden, a folder other users cannot enter
  (``/root``, where the interpreter may live) replaced by an empty one with only what the child
  needs bound back read-only (:func:`reach_plan`), and a private size-limited tmpfs over each of
  :data:`SCRATCH` (``/tmp``, ``/var/tmp``, ``/dev/shm``) that vanishes with it;
* its environment is an allow-list of the grader's (:func:`minimal_env`), its umask 077;
* when the grader runs as root it drops to an unprivileged user id of its own (no name needed),
  so it cannot write the course checkout, another submission's folder or the grader's files, nor
  signal or trace their processes;
* it joins cgroups that cap its processes (``pids``), count their CPU time (``cpuacct``, read by
  the grader to stop it after a budget of CPU seconds), cap their memory together and weigh
  their CPU share; :mod:`dtlib.grading.cgroups` ends everything in them at the end of the row
  (``cgroup.kill`` on v2, the freezer on v1), double-forked escapees included, and only where
  no cgroup could be made does :func:`kill_user` (``kill(-1)`` as its user) do it.

What the OS refuses is skipped and named by :func:`isolation`, which the grader prints.

Every wall is set up in one child-side sequence (:func:`child_setup`: namespaces, mounts, tmpfs,
cgroups, limits, then the user), whose order matters and is read top to bottom here; the cgroups
themselves, the per-row files and the CSV live apart (``cgroups``, ``rowfiles``, ``grades_csv``).
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
from dataclasses import dataclass

from dtlib.grading import cgroups

__all__ = ["Limits", "Mounts", "SCRATCH", "SYSTEM", "allow_plan", "ENV_NAMES", "ENV_PREFIXES", "minimal_env",
           "isolation", "child_setup", "kill_user", "submission_user", "chown_tree"]

SCRATCH = ("/tmp", "/var/tmp", "/dev/shm")  # shared by every user: each child gets its own
# The machine's system folders, seen as they are: programs, libraries, their configuration,
# devices, the kernel's views. Every other folder at the root of the file system (home folders,
# /opt, /srv, /mnt, /var, /run, wherever a checkout or a copy of the course lies) is replaced in a
# child's view by an empty one with only what the child needs bound back read-only: an
# allow-list (:func:`allow_plan`), not a list of hiding places.
SYSTEM = ("/usr", "/etc", "/dev", "/proc", "/sys", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_MS_NOSUID, _MS_NODEV = 0x2, 0x4
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
    # private tmpfs mounts over the shared scratch folders (see SCRATCH), each this large at most
    # (tmpfs pages are memory): what a row writes there vanishes with its processes
    scratch_bytes: int = 256 << 20
    # all of a child's processes together (memory cgroup, tmpfs included): above memory_bytes, so one
    # process meets RLIMIT_AS (a MemoryError it may catch) before the OOM killer
    group_memory_bytes: int = 10 << 30


# The grader's environment variables a learner's process gets (an allow-list: instructor secrets
# such as tokens and keys never reach it): where the interpreter and packages are, the locale,
# thread counts, the frameworks' own settings, the course's (``DTLIB_``).
ENV_NAMES = ("PATH", "PYTHONPATH", "VIRTUAL_ENV", "HOME", "LANG", "LANGUAGE", "TZ", "TERM",
             "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
ENV_PREFIXES = ("LC_", "OMP_", "MKL_", "OPENBLAS_", "CUDA_", "NCCL_", "GLOO_", "TORCH", "PYTORCH_", "JAX_",
                "XLA_", "DTLIB_")


def minimal_env() -> dict[str, str]:
    """The grader's environment, only the variables of :data:`ENV_NAMES` and :data:`ENV_PREFIXES`."""
    return {k: v for k, v in os.environ.items() if k in ENV_NAMES or k.startswith(ENV_PREFIXES)}


def _netns_available() -> bool:
    return hasattr(os, "fork") and os.geteuid() == 0 and os.path.exists("/proc/self/ns/net")


def _readable_by_others(path: str) -> bool:
    """Whether any user may read ``path`` itself (``o+r``, and ``o+x`` for a folder)."""
    mode = os.stat(path).st_mode
    return bool(mode & 0o004) and (not os.path.isdir(path) or bool(mode & 0o001))


def _blocker(path: str) -> str | None:
    """The topmost folder above ``path`` that other users cannot pass (no ``o+x``, e.g. ``/root``)."""
    parts = os.path.realpath(path).split("/")
    for i in range(2, len(parts)):
        folder = "/".join(parts[:i])
        if not os.stat(folder).st_mode & 0o001:
            return folder
    return None


def interpreter_paths() -> tuple[str, ...]:
    """What a child needs to run this Python: the venv, the base install (``pyvenv.cfg``'s home,
    ``sys.base_prefix``: e.g. pyenv's or uv's under ``/root``), the real executable's folder and
    every folder on ``sys.path`` (site-packages, an editable install's checkout)."""
    import dtlib

    found = [sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix,
             os.path.dirname(os.path.realpath(sys.executable)), os.path.dirname(os.path.dirname(dtlib.__file__)),
             *[p for p in sys.path if p]]
    return tuple(dict.fromkeys(os.path.realpath(p) for p in found if os.path.exists(p)))


def reach_plan(paths: tuple[str, ...]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """``((blocker, (path, ...)), ...)``: for each topmost folder other users cannot pass, the
    paths under it a child must reach. :func:`child_setup` mounts an empty tmpfs (0755) over the
    blocker in the child's own mount namespace and binds each path back, read-only, at its own
    place, so the child's unprivileged user reaches exactly these and nothing else of the
    blocker (e.g. the rest of ``/root``)."""
    plan: dict[str, list[str]] = {}
    for path in sorted(dict.fromkeys(os.path.realpath(p) for p in paths if os.path.exists(p))):
        blocker = _blocker(path)
        if blocker is None:
            continue
        outer = next((b for b in plan if blocker == b or blocker.startswith(b + "/")), blocker)
        under = plan.setdefault(outer, [])
        if not any(path == p or path.startswith(p + "/") for p in under):  # sorted: parents first
            under.append(path)
    return tuple((blocker, tuple(under)) for blocker, under in plan.items())


def allow_plan(paths: tuple[str, ...], root: str = "/") -> tuple[tuple[str, tuple[str, ...]], ...]:
    """``((folder, (path, ...)), ...)``: each folder at ``root`` that is neither :data:`SYSTEM`
    nor ``/tmp`` (a scratch folder of its own) with the ``paths`` under it a child must reach
    (:func:`child_setup` mounts an empty tmpfs over the folder and binds those back read-only;
    ``/var/tmp`` gets its private tmpfs after that). A folder that is itself needed stays whole."""
    needed = {os.path.realpath(p) for p in paths if os.path.exists(p)}
    plan = []
    for name in sorted(os.listdir(root)):
        top = os.path.join(root, name)
        if top in SYSTEM or top == "/tmp" or os.path.islink(top) or not os.path.isdir(top) or top in needed:
            continue
        plan.append((top, _under(tuple(needed), top)))
    return tuple(plan)


def _top_files(root: str = "/") -> tuple[str, ...]:
    """Plain files at the root of the file system (a container's description, an installer):
    each is covered by an empty one in a child's view."""
    return tuple(os.path.join(root, n) for n in sorted(os.listdir(root))
                 if os.path.isfile(os.path.join(root, n)) and not os.path.islink(os.path.join(root, n)))


@functools.lru_cache(maxsize=1)
def _can_drop_user() -> bool:
    """Root, its own mount namespace for each child (to reach an interpreter under ``/root``),
    and the interpreter, its libraries and dtlib readable by other users where they are."""
    if os.name != "posix" or os.geteuid() != 0 or not _netns_available() or not os.path.exists("/proc/self/ns/mnt"):
        return False
    return all(_readable_by_others(p) for p in interpreter_paths())


def isolation(mounts: Mounts | None = None, cpu_time: float | None = None) -> str:
    """One line: what walls this machine gives each submission with ``mounts`` and a CPU budget
    of ``cpu_time`` seconds (printed by the grader)."""
    parts = ["own temporary folder (files 0600, umask 077)", "CPU/memory/file-size limits per process",
             "minimal environment (an allow-list of variables)"]
    weak = []
    probe = f"dtlib-grade-probe-{os.getpid()}"
    group = cgroups.process_group_cap(probe, 1)
    counter = cgroups.cpu_account(probe) if cpu_time else None
    memory, weight = cgroups.memory_cap(probe, Limits().group_memory_bytes), cgroups.cpu_weight(probe)
    made = tuple(dict.fromkeys(g for g in (group, counter, memory, weight, cgroups.freezer(probe)) if g))
    cleanup = cgroups.cleanup_method(made)
    for path in made:
        cgroups.remove_group(path)
    if cpu_time:
        if counter:
            parts.append(f"{cpu_time:g} CPU seconds per child for all its processes together (CPU-accounting cgroup)")
        else:
            weak.append(f"{cpu_time:g} CPU seconds per process only (no CPU-accounting cgroup: needs root)")
    if memory:
        parts.append(f"{Limits().group_memory_bytes >> 30} GiB of memory per child for all its processes (memory cgroup)")
    else:
        weak.append("no memory cap for all of a child's processes together (no memory cgroup: needs root)")
    if weight:
        parts.append("equal CPU weight per child, however many processes it runs (cpu cgroup)")
    else:
        weak.append("no CPU weight per child (no cpu cgroup: needs root): a row of many processes slows its neighbours")
    if cleanup:
        parts.append(f"a child ended with everything it started by {cleanup}")
    elif _can_drop_user():
        parts.append("a child ended with everything it started by kill(-1) as its own user (no cgroup could be made)")
    else:
        weak.append("a child ended by killing its session only (no cgroup, no user of its own: needs root): "
                    "a process that left the session may outlive its row")
    if group or _can_drop_user():
        parts.append("process-count cap (" + ("pids cgroup" if group else "RLIMIT_NPROC") + ")")
    else:
        weak.append("no process-count cap (needs root: a user of its own or a pids cgroup): "
                    "a fork bomb is not contained")
    if _can_drop_user():
        parts.append(f"own unprivileged user per submission, unique among the graders on this machine "
                     f"(uid {_FIRST_UID}+, no groups: cannot write the "
                     "checkout or other submissions, read root's files or signal root's processes)")
    elif os.name == "posix" and os.geteuid() == 0:
        weak.append(f"submissions run as root: no mount namespace, or the interpreter ({sys.executable}), its "
                    "libraries or dtlib are not readable by other users, so no unprivileged user can run it; "
                    "install Python and the course where every user can read them")
    else:
        weak.append("grader not root: submissions run as your user and could read or write your files")
    if _netns_available():
        parts.append("no network (own network namespace, loopback only)")
        mounts = mounts or Mounts()
        kept = sorted({p for _, paths in allow_plan(interpreter_paths() + mounts.reach + mounts.read_only)
                       for p in paths})
        parts.append(f"of the file system only the system folders ({', '.join(SYSTEM)}) and, read-only, "
                     f"{', '.join(kept)} (own mount namespace: every other folder at / is empty)")
        parts.append("course checkout read-only, other submissions, masters and solutions hidden, and the git "
                     "history, masters and solutions of every checkout of the course's repository (own mount namespace)")
        parts.append(f"private {', '.join(SCRATCH)} ({Limits().scratch_bytes >> 20} MiB tmpfs each, gone with the "
                     "child; of the shared /tmp only the row's own folder)")
    else:
        weak.append("network reachable, checkout writable, other submissions, masters and git history readable, "
                    "/tmp shared (namespaces need root)")
    line = "isolation: " + ", ".join(parts)
    return line + ("; weaker than intended (warning): " + "; ".join(weak) if weak else "")


_USERS_PER_BATCH = 1 << 20  # 2 per row: 524,288 rows; 1,234 batches at once below 2**32 - 2
_SLOTS = ("/run/dtlib-grading", "/var/lib/dtlib-grading")  # root's own: no learner can hold a slot


@functools.lru_cache(maxsize=1)
def _batch_slot() -> int:
    """This grader process's block of user ids, unique among the graders running on the machine:
    the first ``slot-N.lock`` in :data:`_SLOTS` it can ``flock``, held until the process ends (the
    kernel releases the lock then, even after a crash). Two batches graded at once once shared
    their users, and each ended the other's rows with ``kill(-1)``."""
    for folder in _SLOTS:
        try:
            os.makedirs(folder, mode=0o700, exist_ok=True)
            info = os.lstat(folder)
            if info.st_uid != 0 or info.st_mode & 0o022 or not os.path.isdir(folder) or os.path.islink(folder):
                continue
        except OSError:
            continue
        for slot in range((0xFFFF_FFFE - _FIRST_UID) // _USERS_PER_BATCH):
            fd = os.open(os.path.join(folder, f"slot-{slot}.lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return slot  # fd stays open: the lock is held while this process lives
            except BlockingIOError:
                os.close(fd)
    raise RuntimeError(f"no free block of submission users: cannot create or lock a slot in {' or '.join(_SLOTS)}")


def submission_user(index: int) -> int | None:
    """The user id for the ``index``-th learner process group of this grader process, unique on the
    machine (:func:`_batch_slot`), or ``None`` (not root)."""
    if not _can_drop_user():
        return None
    if not 0 <= index < _USERS_PER_BATCH:
        raise ValueError(f"submission index must be in [0, {_USERS_PER_BATCH}), got {index}")
    return _FIRST_UID + _batch_slot() * _USERS_PER_BATCH + index


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


@dataclass(frozen=True)
class Mounts:
    """Folders a learner's process must not see (``hidden``) or change (``read_only``), and those
    it must reach as its unprivileged user (``reach``: the submission's folder, the course; the
    interpreter is always added)."""
    hidden: tuple[str, ...] = ()
    read_only: tuple[str, ...] = ()
    reach: tuple[str, ...] = ()


def child_setup(limits: Limits, uid: int | None, mounts: Mounts = Mounts(), groups: tuple[str, ...] = ()) -> None:
    """``preexec_fn`` of a learner's process: new session, limits, own network, own user, and an
    empty read-only folder mounted over each of ``mounts.hidden`` (other submissions, masters,
    solutions), ``mounts.read_only`` (the course checkout) bound read-only, inside the ``groups``
    cgroups (:mod:`dtlib.grading.cgroups`)."""
    os.setsid()
    for group in groups:
        with open(os.path.join(group, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    if _netns_available():
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.unshare(_CLONE_NEWNET) == 0:
            _loopback_up()
        hide, readonly = mounts.hidden, mounts.read_only
        needed = interpreter_paths() + mounts.reach + readonly
        # the allow-list at /, then any folder closed to other users inside a system folder
        plan = allow_plan(needed) + tuple((b, p) for b, p in reach_plan(needed) if b.startswith(SYSTEM))
        scratch = [folder for folder in SCRATCH if os.path.isdir(folder)]
        if libc.unshare(_CLONE_NEWNS) == 0:
            # private first, so these mounts never reach the grader's own view of the disk
            libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None)
            for blocker, paths in plan:
                _reach(libc, blocker, paths, read_only=True)
            for path in _top_files():
                libc.mount(b"/dev/null", path.encode(), None, _MS_BIND, None)
            for folder in scratch:  # a private tmpfs; of the shared one, only what it needs
                os.makedirs(folder, exist_ok=True)  # /var/tmp, inside the empty /var
                _reach(libc, folder, _under(needed, folder), read_only=False, size=limits.scratch_bytes)
            for path in readonly:  # the course checkout: readable, never writable
                libc.mount(path.encode(), path.encode(), None, _MS_BIND | _MS_REC, None)
                libc.mount(None, path.encode(), None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY, None)
            for path in hide:  # a folder: an empty read-only one over it; a file (a worktree's .git): empty
                if os.path.isdir(path):
                    libc.mount(b"tmpfs", path.encode(), b"tmpfs", _MS_RDONLY, b"size=4k")
                elif os.path.exists(path):
                    libc.mount(b"/dev/null", path.encode(), None, _MS_BIND, None)
            try:  # a cwd entered before the mounts would still lead, by "..", to the shared /tmp
                os.chdir(os.getcwd())
            except OSError:
                os.chdir("/")
    os.umask(0o077)  # what a learner's process creates is its own
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


def _under(paths: tuple[str, ...], folder: str) -> tuple[str, ...]:
    """The outermost of ``paths`` (real paths) strictly under ``folder``, parents first."""
    inside = sorted(p for p in dict.fromkeys(os.path.realpath(p) for p in paths if os.path.exists(p))
                    if p.startswith(folder.rstrip("/") + "/"))
    outer: list[str] = []
    for path in inside:
        if not any(path.startswith(p + "/") for p in outer):
            outer.append(path)
    return tuple(outer)


def _reach(libc: ctypes.CDLL, blocker: str, paths: tuple[str, ...], read_only: bool,
           size: int = 64 << 10) -> None:
    """Mount an empty tmpfs over ``blocker`` (0755, or 1777 like ``/tmp`` when it is not read-only)
    and bind each of ``paths`` (under it) back, read-only if ``read_only``."""
    held = [os.open(p, os.O_PATH | os.O_CLOEXEC) for p in paths]  # reachable after the tmpfs hides them
    try:
        options = f"mode={'0755' if read_only else '1777'},size={size}".encode()
        if libc.mount(b"tmpfs", blocker.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, options) != 0:
            raise OSError(ctypes.get_errno(), f"cannot mount a tmpfs over {blocker}")
        for path, fd in zip(paths, held):
            if os.path.isdir(f"/proc/self/fd/{fd}"):
                os.makedirs(path, mode=0o755, exist_ok=True)
            else:
                os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
                open(path, "w").close()
            source = f"/proc/self/fd/{fd}".encode()
            if libc.mount(source, path.encode(), None, _MS_BIND | _MS_REC, None) != 0:
                raise OSError(ctypes.get_errno(), f"cannot bind {path}")
            if read_only:
                libc.mount(None, path.encode(), None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY, None)
    finally:
        for fd in held:
            os.close(fd)


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
