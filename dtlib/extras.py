"""Which optional part of dtlib ("extra") provides which import, and the one-line error when it is missing.

``pip install dtlib`` is the analytic core, the planner and the command line (numpy only). What
runs ranks, draws or grades needs an extra (see ``pyproject.toml``'s ``[project.optional-dependencies]``,
kept equal to :data:`EXTRAS` by ``tests/test_packaging.py``)::

    pip install 'dtlib[course]'      # the lessons, the trainer, the widgets, grading
    pip install 'dtlib[frameworks]'  # DeepSpeed, Megatron-Core, JAX, Ray Train (lesson 13)

Code that needs an extra calls :func:`require` first; a missing import then raises
:class:`MissingExtra` (an ``ImportError``) whose message is one line naming the extra, e.g.
``dtlib.parallel needs torch: pip install 'dtlib[course]'``. The ``dtlib`` command prints that
line and exits 2; Jupyter shows that line instead of a traceback.
"""
from __future__ import annotations

import importlib.util
import sys

__all__ = ["EXTRAS", "MissingExtra", "require", "extra_of", "missing"]

# extra -> {import name: distribution on PyPI}. `site` and `workshop` (the website and the
# JupyterHub server) and `test` are tools, not imports of dtlib: they live in pyproject.toml only.
EXTRAS: dict[str, dict[str, str]] = {
    "course": {"torch": "torch", "matplotlib": "matplotlib", "ipywidgets": "ipywidgets",
               "jupyterlab": "jupyterlab", "ipykernel": "ipykernel", "tqdm": "tqdm", "sklearn": "scikit-learn",
               "cloudpickle": "cloudpickle", "torchft": "torchft", "tensorboard": "tensorboard",
               "otter": "otter-grader"},
    "frameworks": {"deepspeed": "deepspeed", "megatron.core": "megatron-core", "jax": "jax", "ray": "ray[train]",
                   "torchtitan": "torchtitan"},
}


class MissingExtra(ModuleNotFoundError):
    """``feature`` needs ``module``, which the extra ``extra`` installs; the message says so in one line."""

    def __init__(self, feature: str, module: str, extra: str) -> None:
        self.feature, self.module, self.extra = feature, module, extra
        super().__init__(f"{feature} needs {module}: pip install 'dtlib[{extra}]'", name=module)

    def for_feature(self, feature: str) -> MissingExtra:
        """The same missing import, said for ``feature`` (``dtlib train`` rather than ``dtlib.trainer``)."""
        return MissingExtra(feature, self.module, self.extra)

    def _render_traceback_(self) -> list[str]:
        # IPython (and so every Jupyter kernel) shows these lines instead of the traceback
        return [f"{type(self).__name__}: {self}"]


def _installed(module: str) -> bool:
    parts = module.split(".")
    for i in range(1, len(parts) + 1):  # None in sys.modules blocks the import of it and below
        if sys.modules.get(".".join(parts[:i]), True) is None:
            return False
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a missing parent package (megatron), a module without spec
        return False


def require(extra: str, *imports: str, feature: str = "this") -> None:
    """Raise :class:`MissingExtra` unless ``imports`` (default: every import of ``extra``) can be
    imported; nothing is imported, so this costs no start-up time."""
    if extra not in EXTRAS:
        raise ValueError(f"extra must be one of {', '.join(EXTRAS)}, got {extra!r}")
    unknown = [m for m in imports if m not in EXTRAS[extra]]
    if unknown:
        raise ValueError(f"imports must be among dtlib[{extra}]'s ({', '.join(EXTRAS[extra])}), got {unknown}")
    for module in imports or EXTRAS[extra]:
        if not _installed(module):
            raise MissingExtra(feature, module, extra)


def _provider(module: str) -> tuple[str, str] | None:
    """``(extra, import name)`` of the extra that installs ``module`` or its package."""
    for extra, provided in EXTRAS.items():
        for name in provided:
            if module == name or module.startswith(name + ".") or name.startswith(module + "."):
                return extra, name
    return None


def extra_of(module: str) -> str | None:
    """The extra that installs the top-level package of ``module`` (``torch.distributed`` ->
    ``course``), or ``None`` if no extra does."""
    found = _provider(module)
    return found[0] if found else None


def missing(exc: ModuleNotFoundError, feature: str) -> MissingExtra | None:
    """``exc`` said as :class:`MissingExtra` for ``feature`` if an extra installs the module it
    misses and that extra's package is not installed (an import that no :func:`require` guarded);
    ``None`` otherwise (no extra's module, or one missing from an installed package: a version
    mismatch, not a missing extra). One already said for a command (``dtlib train --launcher
    ray``) keeps its words."""
    if isinstance(exc, MissingExtra):
        return exc if exc.feature.startswith(feature) else exc.for_feature(feature)
    found = _provider(exc.name or "")
    if found is None or _installed(found[1]):
        return None
    return MissingExtra(feature, found[1], found[0])
