"""Verdict processes forked from one parent that has already imported everything and run the
master's setup: what a verdict costs is the checks, not Python's start.

A fresh ``python -m dtlib.grading.verdict`` per submission spent about 4 of its 6 CPU seconds
(lesson 01) importing torch (and ``torch._dynamo``, which the launcher pre-warms), otter, nbformat
and scikit-learn, and running the master's setup cells, the same for every submission of a batch.
Once per batch a :class:`Forker` is made the verdicts' parent: it imports them (torch only if the
master's setup does: :func:`dtlib.grading.verdict.prepare`), runs the master's setup cells
(trusted: the instructor's) and then forks one verdict process per submission, on request. The
batch hands it the verdict's stdin, stdout and log as file descriptors (``SCM_RIGHTS``); the
forked verdict walls itself off (:func:`sandbox.child_setup`: session, cgroup, namespaces, limits,
its own user) before it reads the submission's cells, so the parent never holds a submission's
code and never runs any. This is the zygote of Android and of Python's own ``multiprocessing``
``forkserver``, with the setup done once.

The execution of each notebook (otter's grader, which starts the Jupyter kernel) is forked the
same way from the batch's first parent, ``python -P -m dtlib.grading.prefork``, which has only
imported otter's grader: a fresh ``python -m dtlib.grading.batch`` per submission spent 4 to 6 of
its 10 seconds (the tiny course) starting Python and importing otter, nbconvert and the kernel
machinery. That parent runs no setup and holds nothing of the course: it never sees a learner's
code either (the kernel, started by the forked child, is a fresh interpreter). The verdicts'
parent is forked from it too, before it runs the setup, so that Python's start, otter and dtlib's
grading modules are paid once per batch, not twice (about 1 CPU second: the whole verdicts'
parent of a torch-free master).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from concurrent.futures import Future
from dataclasses import asdict
from pathlib import Path

from dtlib.grading import rowfiles, sandbox

__all__ = ["Forker", "Starting", "serve"]

_MAX_REQUEST = 1 << 20
# What an execution parent imports once (otter.api imports some of it only when it first grades).
_EXECUTION_MODULES = ("otter.api", "otter.run.run_autograder", "otter.execute", "nbclient", "nbconvert",
                      "jupyter_client.manager", "ipykernel.kernelspec")


class Forker:
    """A batch's pre-imported parent: of its executions, or of its verdicts (forked from the first)."""

    def __init__(self, cwd: Path, log: Path, timeout: float, setup: list[str] | None = None,
                 zygote: Forker | None = None):
        """Start the executions' parent, which imports otter's grader in ``cwd``; or, given the
        master's ``setup`` cells, fork the verdicts' parent from that one (``zygote``), which runs
        them there (``cwd``: the verdicts' folder, the same). Either writes its output to ``log``
        and must be ready within ``timeout`` seconds."""
        if (setup is None) != (zygote is None):
            raise ValueError("a verdicts' parent needs the master's setup and the executions' parent to fork it from")
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)  # one message per request
        self._sock, self._lock, self.cwd = mine, threading.Lock(), cwd
        self._proc: subprocess.Popen | None = None
        self.torch = False  # a verdicts' parent: load torch before the next fork (verdict.load_torch)
        with rowfiles.open_private(log) as out:
            if zygote is not None:
                self.pid = self._fork_from(zygote, setup, theirs.fileno(), out.fileno())
            else:
                argv = [sys.executable, "-P", "-m", "dtlib.grading.prefork", str(theirs.fileno())]
                self._proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, cwd=cwd,
                                              pass_fds=(theirs.fileno(),), start_new_session=True,
                                              # its children's memory (/proc/self/environ) is this env
                                              env=sandbox.minimal_env())
                self.pid = self._proc.pid
        theirs.close()
        self._sock.settimeout(timeout)
        try:
            ready = self._sock.recv(16)
        except OSError:
            ready = b""
        self._sock.settimeout(None)
        if ready != b"ready":
            lines = [s for s in rowfiles.read_tail(log, 20000).splitlines() if s.strip()]
            self.close()
            raise RuntimeError(("the master's setup cells failed in the verdict's parent: " if setup is not None
                                else "otter's grader could not be imported: ")
                               + (lines[-1] if lines else "no output"))

    @staticmethod
    def _fork_from(zygote: Forker, setup: list[str], sock: int, log: int) -> int:
        """Have ``zygote`` fork the verdicts' parent (its socket ``sock``, its output ``log``) and
        send it the master's setup cells through a pipe (they may be larger than a request);
        returns its pid."""
        read, write = os.pipe()
        try:
            with zygote._lock:
                socket.send_fds(zygote._sock, [json.dumps({"parent": True}).encode()], [sock, read, log])
                reply = zygote._sock.recv(64)
        finally:
            os.close(read)
        if not reply:
            os.close(write)
            raise RuntimeError("the executions' parent ended")
        try:
            with open(write, "wb") as pipe:
                pipe.write(json.dumps(setup).encode())
        except BrokenPipeError:
            pass  # it ended at once: the wait for its "ready" says why
        return int(reply)

    def start(self, fds: list[int], cwd: Path, env: dict[str, str], limits: sandbox.Limits,
              uid: int | None, mounts: sandbox.Mounts, groups: tuple[str, ...], argv: list[str] | None = None) -> int:
        """Fork one verdict process, or (the executions' parent, ``argv``: the autograder zip, the
        notebook and the report to write) one execution, with these descriptors as its 0, 1, 2
        (an execution's fourth, its 3, is written ``ok`` when it succeeded and closes when it
        ends) and walls, in ``cwd`` (entered after the walls are up: a folder hidden from it
        stays hidden); returns its pid (the leader of its own session: :func:`os.killpg` ends it
        and what it started)."""
        request = {"cwd": str(cwd), "env": env, "limits": asdict(limits), "uid": uid,
                   "mounts": asdict(mounts), "groups": list(groups), "argv": argv, "torch": self.torch}
        with self._lock:
            socket.send_fds(self._sock, [json.dumps(request).encode()], fds)
            reply = self._sock.recv(64)
        if not reply:
            raise RuntimeError("the pre-imported parent ended")
        return int(reply)

    def close(self) -> None:
        """End the parent at once: it holds nothing to save, and leaving Python with torch
        imported took it seconds (its forked children are ended by their own cgroups). The
        executions' parent is ended with its process group, the verdicts' parent included; the
        verdicts' parent ends itself when its socket closes."""
        self._sock.close()
        if self._proc is not None:
            try:
                os.killpg(self._proc.pid, signal.SIGKILL)  # not yet waited for: its group id is still its own
            except ProcessLookupError:
                pass
            self._proc.wait()


class Starting:
    """A :class:`Forker` still starting in another thread: :meth:`start` waits until it is ready
    (or raises why it could not start). The batch's rows begin as soon as the executions' parent
    is ready; the verdicts' parent (otter, the checks, the master's setup: up to seconds more) finishes
    starting while the first rows' executions run."""

    def __init__(self, future: Future):
        self._future = future

    @property
    def cwd(self) -> Path:
        return self._future.result().cwd

    def start(self, *args, **kwargs) -> int:
        """:meth:`Forker.start`, once the parent is ready."""
        return self._future.result().start(*args, **kwargs)

    def load_torch(self) -> None:
        """Have the parent import torch before it forks the next verdict (a verdict needed it)."""
        self._future.result().torch = True


def _child(request: dict, fds: list[int]) -> None:
    """In the forked child: take the descriptors, wall off, then run the verdict or the execution."""
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the parent ignores it; the checks wait for ranks
        for target, fd in enumerate(fds):
            os.dup2(fd, target, inheritable=target < 3)  # the status descriptor: never the kernel's
            os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        import tempfile

        tempfile.tempdir = None  # TMPDIR is this child's own folder now
        mounts = sandbox.Mounts(**{k: tuple(v) for k, v in request["mounts"].items()})
        sandbox.child_setup(sandbox.Limits(**request["limits"]), request["uid"], mounts, tuple(request["groups"]))
        os.chdir(request["cwd"])
        if request["argv"]:
            from dtlib.grading import execution

            execution.grade_in_child(*map(Path, request["argv"]))
            os.write(3, b"ok")
        else:
            from dtlib.grading import verdict

            verdict.main()
        code = 0
    except BaseException:  # noqa: BLE001 - the log says why; the batch sees no report
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _verdicts_parent(fds: list[int]) -> None:
    """In a child of the executions' parent: become the verdicts' parent (its socket, the pipe
    that brings the master's setup cells, its log), run the setup and serve; never returns."""
    sock, setup_pipe, log = fds
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the setup may wait for its own children
        for target in (1, 2):
            os.dup2(log, target)
        os.close(log)
        with open(setup_pipe, "rb") as pipe:
            setup = json.loads(pipe.read())
        from dtlib.grading import verdict

        verdict.prepare(setup)
        _serve(socket.socket(fileno=sock), "verdict")
        code = 0
    except BaseException:  # noqa: BLE001 - the log says why; the batch sees no "ready"
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # at once: no interpreter teardown with torch imported


def serve(fd: int) -> None:
    """The executions' parent: import otter's grader, then fork per request (an execution, or
    once per batch the verdicts' parent, which then runs the master's setup and forks verdicts)."""
    import importlib

    for module in _EXECUTION_MODULES:
        importlib.import_module(module)
    _serve(socket.socket(fileno=fd), "execute")


def _serve(sock: socket.socket, kind: str) -> None:
    """Say ready, then fork one child per request until the batch closes the socket."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the children
    sock.sendall(b"ready")
    while True:
        message, fds, _, _ = socket.recv_fds(sock, _MAX_REQUEST, 4)
        if not message:
            return
        request = json.loads(message)
        if kind == "verdict" and request.get("torch"):
            from dtlib.grading import verdict

            verdict.load_torch()  # once: a verdict of this master needed torch; the next ones inherit it
        pid = os.fork()
        if pid == 0:
            sock.close()
            if kind == "execute" and request.get("parent"):
                _verdicts_parent(fds)
            _child(request, fds)
        for received in fds:
            os.close(received)
        sock.sendall(str(pid).encode())


if __name__ == "__main__":
    serve(int(sys.argv[1]))
