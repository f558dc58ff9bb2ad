"""The isolated verdict: a submission's points, decided by a process that never runs its top-level code.

A verdict process is forked, per submission, from a parent that has run the MASTER's setup cells
(imports, ``checks``, data: :func:`prepare`, in :mod:`dtlib.grading.prefork`); it reads, on stdin,
the autograder zip and the submission's answer cells per question (:func:`question_cells`), then
runs otter's own test files with an environment in which every name a test asks for that the
setup does not define is a stand-in for the learner's object:

* a function becomes a :class:`LearnerCallable`: called inside a rank (a process the check forked)
  it runs the learner's function there; called in this process it is sent, with its arguments, to
  a forked worker that runs it and answers with data;
* a class becomes a stand-in class with the same trusted bases (``torch.autograd.Function``,
  ``nn.Module``) whose static and class methods, and whose instances, are the learner's own, made
  in the process that uses them;
* any other value is computed in a forked child and sent back as data.

Learner code runs only in forked children: each first closes this process's report pipe, and this
process is not dumpable (``PR_SET_DUMPABLE``), so no child can trace it or open its files through
``/proc``. Everything a child sends back is read as JSON or with ``torch.load(weights_only=True)``
(plain containers, numbers, strings, tensors and dtlib's data classes; :func:`dtlib.grading.transfer.decode`) and ranks' results
through :func:`dtlib.launcher.set_result_codec` the same way: no pickle a learner wrote is ever
loaded here. The report (scores and the first failure per question) is one JSON object on stdout.
"""
from __future__ import annotations

import ctypes
import importlib
import inspect
import json
import os
import re
import select
import signal
import struct
import sys
import types
import zipfile
from typing import Any

import nbformat

from dtlib.grading import on_import
from dtlib.grading.transfer import decode, encode, stand_in_error

__all__ = ["question_cells", "setup_sources", "LearnerCallable", "learner_objects", "prepare", "load_torch", "judge",
           "main"]

_CHECK_CALL = re.compile(r"""grader\.check\(\s*["'](\w+)["']\s*\)""")
_CALL_TIMEOUT = 120.0  # seconds one call of a learner function may take in the worker
_MAX_REPLY = 256 << 20

_VERDICT_PID: int | None = None   # this process, once main() runs: learner code never runs here
_REPORT_FD: int | None = None     # the report pipe, closed in every learner child
_SETUP: dict[str, Any] = {}       # the master's setup namespace (trusted)
_CELLS: dict[str, list[str]] = {}  # question -> the submission's answer cells
_LEARNER: dict[str, dict] = {}    # question -> namespace after the answer cells, in a learner child


# ---- which cells answer which question -------------------------------------------------------
def setup_sources(master: nbformat.NotebookNode) -> list[str]:
    """The master's code cells before its first ``# BEGIN QUESTION`` (imports, checks, data)."""
    sources = []
    for cell in master.cells:
        if cell.cell_type == "raw" and cell.source.lstrip().startswith("# BEGIN QUESTION"):
            break
        if cell.cell_type == "code":
            sources.append(cell.source)
    return sources


def question_cells(nb: nbformat.NotebookNode, questions: list[str], setup: list[str]) -> dict[str, list[str]]:
    """``{question: code cells}``: every code cell before the question's ``grader.check`` cell, as
    a notebook run would have executed them (a later answer may use an earlier one's helper).
    Check cells, copies of the master's setup cells and otter's init cell are left out (the
    verdict runs the master's setup). A question whose check cell was deleted gets the cells
    before the next check cell that is there (or all of them)."""
    skip = {s.strip() for s in setup}
    order = {q: i for i, q in enumerate(questions)}
    found: dict[str, list[str]] = {}
    so_far: list[str] = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        called = [q for q in _CHECK_CALL.findall(cell.source) if q in order]
        for q in called:
            for m in questions[:order[q] + 1]:
                found.setdefault(m, list(so_far))
        if not called and cell.source.strip() not in skip and "otter.Notebook(" not in cell.source:
            so_far.append(cell.source)
    return {q: found.get(q, so_far) for q in questions}


# ---- learner children ------------------------------------------------------------------------
def _in_verdict() -> bool:
    return os.getpid() == _VERDICT_PID


def _become_learner() -> None:
    """First thing in a child that will run learner code: let go of the report pipe."""
    global _REPORT_FD
    if _REPORT_FD is not None:
        try:
            os.close(_REPORT_FD)
        except OSError:
            pass
        _REPORT_FD = None


def _learner_namespace(question: str) -> dict:
    """The setup namespace after the question's answer cells, in this (learner) process. A cell
    that raises is skipped, as in a notebook run with errors allowed."""
    if question not in _LEARNER:
        _become_learner()
        from IPython.core.inputtransformer2 import TransformerManager

        ns = dict(_SETUP)
        ns.setdefault("get_ipython", _ipython(ns))
        for source in _CELLS.get(question, []):
            try:
                exec(compile(TransformerManager().transform_cell(source), "<answer cell>", "exec"), ns)
            except BaseException:  # noqa: BLE001 - SystemExit and KeyboardInterrupt included
                continue
        _LEARNER[question] = ns
    return _LEARNER[question]


def _ipython(ns: dict):
    """``get_ipython`` for answer cells run on ``ns``: what IPython's transformer turns ``%%time``,
    ``%matplotlib inline`` and ``!echo`` into calls (``run_cell_magic``, ``run_line_magic``,
    ``system``) needs a shell, made on first use, whose namespace is ``ns``, as in Jupyter's kernel."""
    shell = None

    def get_ipython():
        nonlocal shell
        if shell is None:
            from IPython.core.interactiveshell import InteractiveShell
            from traitlets.config import Config

            class Shell(InteractiveShell):
                def enable_gui(self, gui=None):  # no event loop here: figures are never shown
                    pass

            config = Config()
            config.HistoryManager.enabled = False  # no sqlite file in the child's home
            shell = Shell(user_ns=ns, config=config)
        return shell
    return get_ipython


def _fork_learner(body) -> tuple[int, int]:
    """Fork a child that runs ``body(write_fd)`` as learner code; returns (pid, read_fd)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        _become_learner()
        code = 0
        try:  # torch, if loaded, is single-threaded already (see prepare)
            devnull = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(devnull, fd)
            body(write)
        except BaseException:  # noqa: BLE001
            code = 1
        finally:
            os._exit(code)
    os.close(write)
    return pid, read


def _send(fd: int, blob: bytes) -> None:
    data = struct.pack("<Q", len(blob)) + blob
    while data:
        data = data[os.write(fd, data):]


def _receive(fd: int, timeout: float) -> bytes | None:
    """One length-prefixed message, or ``None`` if the child ended or took too long."""
    head = _read_exact(fd, 8, timeout)
    if head is None:
        return None
    size = struct.unpack("<Q", head)[0]
    if size > _MAX_REPLY:
        return None
    return _read_exact(fd, size, timeout)


def _read_exact(fd: int, size: int, timeout: float) -> bytes | None:
    chunks, got = [], 0
    while got < size:
        ready, _, _ = select.select([fd], [], [], timeout)
        if not ready:
            return None
        chunk = os.read(fd, min(size - got, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _end(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    os.waitpid(pid, 0)


class _Worker:
    """A forked learner child that answers calls of the question's functions, one at a time."""

    def __init__(self, question: str):
        self.requests, child_reads = os.pipe()[::-1]
        self.question = question

        def serve(write: int) -> None:
            import cloudpickle

            os.close(self.requests)
            ns = _learner_namespace(question)
            while True:
                request = _receive(child_reads, 1e9)
                if request is None:
                    return
                name, attr, args, kwargs = cloudpickle.loads(request)  # sent by the verdict
                try:
                    target = ns.get(name)
                    value = getattr(target, attr)(*args, **kwargs) if attr else target(*args, **kwargs)
                    reply = {"ok": True, "value": value}
                    blob = encode(reply)
                except BaseException as exc:  # noqa: BLE001
                    blob = encode({"ok": False, "type": type(exc).__name__, "message": str(exc)})
                _send(write, blob)

        self.pid, self.replies = _fork_learner(serve)
        os.close(child_reads)

    def call(self, name: str, attr: str | None, args: tuple, kwargs: dict) -> Any:
        import cloudpickle

        try:
            _send(self.requests, cloudpickle.dumps((name, attr, args, kwargs)))
        except (BrokenPipeError, OSError):
            raise AssertionError(f"{name} ended the process it ran in (exit, or a crash)") from None
        blob = _receive(self.replies, _CALL_TIMEOUT)
        if blob is None:
            raise AssertionError(f"{name} did not return within {_CALL_TIMEOUT:g} s, or ended its process")
        reply = decode(blob)
        if not reply.get("ok"):
            raise stand_in_error(str(reply.get("type")), str(reply.get("message")))
        return reply.get("value")

    def close(self) -> None:
        _end(self.pid)
        os.close(self.requests)
        os.close(self.replies)


_WORKERS: dict[str, _Worker] = {}


class LearnerCallable:
    """Stands for the learner's function ``name`` of ``question``; pickles as those two strings."""

    def __init__(self, question: str, name: str):
        self.question, self.name = question, name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _in_verdict():
            if self.question not in _WORKERS:
                _WORKERS[self.question] = _Worker(self.question)
            return _WORKERS[self.question].call(self.name, None, args, kwargs)
        return _learner_namespace(self.question)[self.name](*args, **kwargs)

    def __repr__(self) -> str:
        return f"<learner's {self.name}>"


# The bases a learner's class may have (module, qualified name as ``cls.__module__`` and
# ``__qualname__`` give them): the exercises subclass nothing or torch.autograd.Function; the rest
# are the torch classes a learner's answer would reasonably build on.
TRUSTED_BASES = frozenset({
    ("builtins", "object"),
    ("torch.autograd.function", "Function"),
    ("torch.nn.modules.module", "Module"),
    ("torch.nn.modules.linear", "Linear"),
    ("torch.nn.modules.sparse", "Embedding"),
    ("torch.optim.optimizer", "Optimizer"),
    ("torch.utils.data.dataset", "Dataset"),
})


def _trusted_base(module: str, qualname: str) -> type:
    """The class a base names, if it is one of :data:`TRUSTED_BASES`; refused otherwise, before
    anything is imported (a base naming ``dtlib.__main__`` once made the verdict run dtlib's CLI).
    Only then is its module, one of torch's own, imported (if the master's setup has not)."""
    if (module, qualname) not in TRUSTED_BASES:
        raise ValueError(f"base class {module}.{qualname} is not one of the allowed bases "
                         f"({', '.join(sorted(f'{m}.{q}' for m, q in TRUSTED_BASES))})")
    obj = getattr(importlib.import_module(module), qualname, None)
    if not isinstance(obj, type):
        raise ValueError(f"base class {module}.{qualname} is not loaded in the verdict")
    return obj


def _stand_in_class(question: str, name: str, bases: list[list[str]], statics: dict[str, str]) -> type:
    """A class with the learner class's trusted bases whose instances, static and class methods are
    the learner's own, made in the (learner) process that uses them."""
    real = lambda: _learner_namespace(question)[name]  # noqa: E731

    def new(cls, *args, **kwargs):
        if _in_verdict():
            raise AssertionError(f"{name} is only instantiated in the ranks")
        return real()(*args, **kwargs)

    body: dict[str, Any] = {"__new__": new, "__module__": "learner"}
    for attr, kind in statics.items():
        if not (isinstance(attr, str) and attr.isidentifier() and not attr.startswith("__")):
            continue
        def delegate(*args, _attr=attr, **kwargs):
            if _in_verdict():
                raise AssertionError(f"{name}.{_attr} is only called in the ranks")
            return getattr(real(), _attr)(*args, **kwargs)
        body[attr] = staticmethod(delegate) if kind == "static" else classmethod(
            lambda cls, *a, _d=delegate, **k: _d(*a, **k))
    resolved = tuple(_trusted_base(*pair) for pair in bases if pair != ("builtins", "object")) or (object,)
    return types.new_class(name, resolved, exec_body=lambda ns: ns.update(body))


def _describe(question: str, names: list[str]) -> dict:
    """In a learner child: what each name is after the answer cells (kinds and data only)."""
    ns = _learner_namespace(question)
    out = {}
    for name in names:
        if name not in ns:
            out[name] = {"kind": "missing"}
        elif isinstance(ns[name], type):
            cls = ns[name]
            statics = {k: ("static" if isinstance(v, staticmethod) else "class")
                       for k, v in vars(cls).items()
                       if isinstance(v, (staticmethod, classmethod)) and not k.startswith("__")}
            out[name] = {"kind": "class", "statics": statics,
                         "bases": [[b.__module__, b.__qualname__] for b in cls.__bases__]}
        elif callable(ns[name]):
            out[name] = {"kind": "callable"}
        else:
            out[name] = {"kind": "value", "value": ns[name]}
    return out


def learner_objects(question: str, names: list[str], timeout: float = _CALL_TIMEOUT) -> tuple[dict, list[str]]:
    """Stand-ins for ``names`` of ``question`` (see module doc) and what could not be received."""
    pid, read = _fork_learner(lambda write: _send(write, encode(_describe(question, names))))
    try:
        blob = _receive(read, timeout)
    finally:
        _end(pid)
        os.close(read)
    if blob is None:
        return {}, [f"the answer cells of {question} ended their process or did not finish"]
    try:
        described = decode(blob)
    except Exception as exc:  # noqa: BLE001
        return {}, [f"{question}: the answer could not be received as data ({exc})"]
    objects, problems = {}, []
    for name in names:
        info = described.get(name, {}) if isinstance(described, dict) else {}
        kind = info.get("kind") if isinstance(info, dict) else None
        try:
            if kind == "callable":
                objects[name] = LearnerCallable(question, name)
            elif kind == "class":
                bases = [(str(m), str(q)) for m, q in info["bases"]]
                objects[name] = _stand_in_class(question, name, bases, dict(info["statics"]))
            elif kind == "value":
                objects[name] = info["value"]
        except Exception as exc:  # noqa: BLE001 - a malformed description is the learner's loss
            problems.append(f"{question}: {name} could not be received ({type(exc).__name__}: {exc})")
    return objects, problems


# ---- the verdict process ---------------------------------------------------------------------
def _test_files(autograder_zip: str) -> list:
    from otter.test_files import ExceptionTestFile

    tests = []
    with zipfile.ZipFile(autograder_zip) as zf:
        for path in sorted(zf.namelist()):
            if path.startswith("tests/") and path.endswith(".py"):
                tests.append(ExceptionTestFile.from_string(zf.read(path).decode(), path=path))
    return tests


def _asked_for(test) -> list[str]:
    names = []
    for case in test.test_cases:
        for param in inspect.signature(case.body.test_func).parameters:
            if param not in names and param != "env":
                names.append(param)
    return names


def prepare(setup: list[str]) -> None:
    """Import what every verdict needs and run the MASTER's setup cells (trusted), once, in the
    parent the verdicts are forked from (:mod:`dtlib.grading.prefork`).

    Torch and the launcher are imported only if the setup imports them (every lesson's does; a
    torch-free master's, such as the test suite's tiny course, does not): what must hold once they
    are in is set the moment they are imported, here or later in a verdict (a test, a check, a
    reply holding a tensor: :mod:`dtlib.grading.on_import`). Then the launcher is pre-warmed,
    so that the ranks of every verdict start without importing ``torch._dynamo`` each."""
    import cloudpickle  # noqa: F401 - imported here so no verdict pays for it
    import otter.test_files  # noqa: F401
    from IPython.core.inputtransformer2 import TransformerManager  # noqa: F401

    from dtlib.grading import feedback  # noqa: F401

    # Forked processes must not enter an OpenMP region the parent's pool has used (libgomp is not
    # fork-safe, see dtlib.launcher): the verdicts and everything they fork stay single-threaded.
    on_import.when_imported("torch", lambda torch: torch.set_num_threads(1))
    # No pickle a rank wrote is ever loaded here: ranks' results come back as data.
    on_import.when_imported("dtlib.launcher", lambda launcher: launcher.set_result_codec(encode, decode))
    _SETUP.update({"__name__": "__main__"})
    for source in setup:
        exec(compile(source, "<master setup cell>", "exec"), _SETUP)
    if "torch" in sys.modules:
        load_torch()


def load_torch() -> None:
    """Import torch and pre-warm the launcher, in the verdicts' parent: after :func:`prepare` when
    the master's setup imported torch, or once a verdict of a torch-free setup needed it anyway (its
    report says ``torch``: a reply holding a tensor or a dtlib data class), so that the next
    verdicts inherit them instead of importing them each (:mod:`dtlib.grading.prefork`)."""
    from dtlib import launcher

    launcher._prewarm_before_fork()


def judge(autograder_zip: str, cells: dict[str, list[str]]) -> dict:
    """Scores and the first failure of each question (runs in the verdict process, after
    :func:`prepare`)."""
    from dtlib.grading import feedback

    _CELLS.update(cells)
    report: dict = {"scores": {}, "failures": {}, "problems": []}
    for test in _test_files(autograder_zip):
        names = [n for n in _asked_for(test) if n not in _SETUP]
        objects, problems = learner_objects(test.name, names)
        report["problems"] += problems
        env = {**_SETUP, **objects}
        try:
            test.run(env)
        finally:
            worker = _WORKERS.pop(test.name, None)
            if worker:
                worker.close()
        report["scores"][test.name] = float(test.score)
        failed = [r for r in test.test_case_results if not r.passed]
        if failed:
            report["failures"][test.name] = feedback.hint(failed[0].message)
    return report


def main() -> None:
    """In a verdict process forked (and walled off) after :func:`prepare`: read the job from
    stdin, write the report to stdout (the only thing written there)."""
    global _VERDICT_PID, _REPORT_FD
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 0: no ptrace, no /proc/<pid>/fd
    _VERDICT_PID = os.getpid()
    _REPORT_FD = os.dup(1)
    os.set_inheritable(_REPORT_FD, False)
    os.dup2(2, 1)  # prints of the checks and otter go to the log, never into the report
    job = json.loads(sys.stdin.read())
    report = judge(job["autograder_zip"], job["cells"])
    report["torch"] = "torch" in sys.modules  # needed: the batch has the parent load it (load_torch)
    os.write(_REPORT_FD, json.dumps(report).encode())
    os.close(_REPORT_FD)

