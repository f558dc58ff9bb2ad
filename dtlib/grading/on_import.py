"""Run a function the moment a module is first imported (a post-import hook), wherever that happens.

The verdicts' parent (:func:`dtlib.grading.verdict.prepare`) imports torch and the launcher only
when the master needs them: a torch-free master's verdicts never pay for them. What must hold
whenever they are loaded (torch single-threaded before any fork, since libgomp is not fork-safe;
ranks' results read with the data-only codec, never unpickled) is therefore set the moment they
are imported, be it by the master's setup, a test, a check or a reply that holds a tensor, in the
parent or in a forked verdict. A finder first on ``sys.meta_path`` (Python's import system,
PEP 451: ``find_spec`` then ``exec_module``) wraps the module's loader for that one import; it is
the mechanism of ``wrapt.register_post_import_hook`` and PEP 369's import hooks.
"""
from __future__ import annotations

import importlib.abc
import sys
from types import ModuleType
from typing import Callable

__all__ = ["when_imported"]


def when_imported(name: str, then: Callable[[ModuleType], None]) -> None:
    """Call ``then(module)`` once module ``name`` is loaded: now if it is, else right after its
    first import has run the module's code, before the importing statement gets the module."""
    if name in sys.modules:
        then(sys.modules[name])
    else:
        sys.meta_path.insert(0, _Hook(name, then))


class _Hook(importlib.abc.MetaPathFinder):
    """Finds ``name`` with the other finders and runs ``then`` after its loader has executed it."""

    def __init__(self, name: str, then: Callable[[ModuleType], None]):
        self.name, self.then = name, then

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name or self not in sys.meta_path:
            return None
        sys.meta_path.remove(self)  # once: the other finders locate it, and a re-import finds it loaded
        spec = None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find else None
            if spec is not None:
                break
        if spec is None:
            return None
        if spec.loader is None or isinstance(spec.loader, type):  # a namespace package, a built-in
            raise ImportError(f"{fullname} is not loaded from a file: no hook can run after it", name=fullname)
        run = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            try:
                run(module)
            except BaseException:
                sys.meta_path.insert(0, self)  # it did not load: the next import tries again
                raise
            self.then(module)
        spec.loader.exec_module = exec_module  # this import's own loader object
        return spec
