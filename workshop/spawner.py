"""The workshop's spawners: each learner's server in cgroups of its own, the course in its home.

Two ways to run learners' servers, both JupyterHub's local-process spawners with
:mod:`workshop.limits` added (``Spawner.cpu_limit`` / ``mem_limit`` enforced, everything a learner
started killed when their server stops):

* :class:`WorkshopSpawner` (the default, for a room): ``LocalProcessSpawner``, each learner a
  system account of their own (its uid: they cannot read or signal each other's files and
  processes);
* :class:`SharedAccountSpawner` (tests, CI, a one-person trial): ``SimpleLocalProcessSpawner``,
  every server under the hub's own account, each in its own home folder ``homes/<user>``.
  JupyterHub's docs call it insecure: no isolation between users beyond the cgroups. It creates
  no system accounts, which is why CI (root, a throw-away container) uses it.

Each server gets ``TMPDIR=~/.tmp`` so the ranks' scratch folders (``dtlib.launch``'s
``mkdtemp``) of different learners never share a folder, and the folder is emptied on stop.
Rank rendezvous needs nothing per learner: every ``dtlib.launch`` asks the OS for a free port.
"""
from __future__ import annotations

import os
import pwd
import shutil
import stat
from pathlib import Path

from jupyterhub.spawner import LocalProcessSpawner, SimpleLocalProcessSpawner
from traitlets import Integer, default

from workshop import limits

ROOT = Path(__file__).resolve().parents[1]
COURSE = ("notebooks", "exercises")  # copied into each learner's home (lessons, graded exercises)
FIRST_LESSON = "notebooks/00_collectives.ipynb"


def _owner(spawner) -> tuple[int, int] | None:
    """The uid/gid a learner's files belong to (``None``: the hub's own account)."""
    if isinstance(spawner, SimpleLocalProcessSpawner):
        return None
    entry = pwd.getpwnam(spawner.user.name)
    return entry.pw_uid, entry.pw_gid


def _home(spawner) -> Path:
    if isinstance(spawner, SimpleLocalProcessSpawner):
        return Path(spawner.home_dir)
    return Path(pwd.getpwnam(spawner.user.name).pw_dir)


def install_course(spawner) -> None:
    """``Spawner.pre_spawn_hook``: copy each folder of :data:`COURSE` into the learner's home,
    unless it is there already (a learner's work is never overwritten), owned by the learner.

    Design note: ``dtlib course DIR`` (the course from an installed package) does the same from
    the wheel's package data; replacing the copy below by that command changes nothing else."""
    home, owner = _home(spawner), _owner(spawner)
    home.mkdir(parents=True, exist_ok=True)
    made = []
    for folder in COURSE:
        if not os.path.lexists(home / folder):
            shutil.copytree(ROOT / folder, home / folder, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
            made.append(home / folder)
    if not os.path.lexists(home / ".tmp"):
        (home / ".tmp").mkdir(mode=0o700)
        made.append(home / ".tmp")
    if owner:  # only what was just made here: never a path the learner could have pointed elsewhere
        for top in made:
            for path in [top, *top.rglob("*")]:
                os.chown(path, *owner, follow_symlinks=False)


def empty_scratch(spawner) -> None:
    """Delete what is in the learner's ``~/.tmp`` (their ranks' scratch folders), as root but
    never through a symlink: the folder is opened with ``O_NOFOLLOW`` and emptied relative to it,
    so a learner who replaced it by a link to another folder deletes nothing outside their own."""
    try:
        fd = os.open(_home(spawner) / ".tmp", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:  # gone, or a link: nothing of ours to empty
        return
    try:
        for name in os.listdir(fd):
            if stat.S_ISDIR(os.lstat(name, dir_fd=fd).st_mode):
                shutil.rmtree(name, dir_fd=fd)
            else:
                os.unlink(name, dir_fd=fd)
    finally:
        os.close(fd)


class WorkshopSpawner(LocalProcessSpawner):
    """A learner's server as their own system account, in their own cgroups
    (:mod:`workshop.limits`), with its own scratch folder."""

    _group: limits.Group | None = None
    tasks_limit = Integer(4096, config=True, help="""Most processes and threads a learner's server may
        run at once (its kernels and ranks included; torch, gloo and Jupyter start dozens of threads
        each); 0: no cap. Stops a fork bomb at the learner's own cgroup.""")

    def _limits(self) -> limits.Group:
        if self._group is None:  # after a hub restart too: the same name finds the same groups
            self._group = limits.make_group(self.user.name, self.cpu_limit, self.mem_limit, self.tasks_limit)
        return self._group

    def make_preexec_fn(self, name):
        inner, group = super().make_preexec_fn(name), self._limits()

        def preexec() -> None:
            limits.join(group)  # as root, before the parent's preexec drops to the learner's uid
            inner()

        return preexec

    def get_env(self):
        env = super().get_env()
        env["TMPDIR"] = str(_home(self) / ".tmp")
        return env

    async def start(self):
        self.log.info("%s's limits: %s cores, %s bytes, %s tasks; %s", self.user.name, self.cpu_limit or "no cap",
                      self.mem_limit or "no cap", self.tasks_limit or "no cap", self._limits().enforced)
        return await super().start()

    async def stop(self, now=False):
        await super().stop(now)
        left = limits.remove(self._limits())
        if left:
            self.log.warning("%s's cgroups %s still hold processes after SIGKILL", self.user.name, left)
        self._group = None
        empty_scratch(self)


class SharedAccountSpawner(WorkshopSpawner, SimpleLocalProcessSpawner):
    """A learner's server as the hub's account in ``homes/<user>``, in their own cgroups (tests, CI)."""

    @default("home_dir_template")
    def _homes_beside_the_hub(self):
        return os.path.abspath("homes/{username}")  # the hub's working folder holds its state too

    def get_args(self):
        # the single-user server refuses to run as root unless told (the hub runs as root in CI)
        return super().get_args() + (["--ServerApp.allow_root=True"] if os.geteuid() == 0 else [])
