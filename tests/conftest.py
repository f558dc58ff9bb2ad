"""Every check's message that a test provokes (tests/test_checks_*.py build the classic wrong
answers) must follow the hint policy (:mod:`dtlib.grading.hint_policy`): each ``check_*`` of the
checks module a test uses is wrapped, and a message that breaks a rule fails the test."""
import functools
import importlib
import pkgutil

import pytest

import dtlib.grading.checks
from dtlib import grading
from dtlib.grading import hint_policy


@functools.lru_cache(maxsize=None)
def _master(slug: str):
    return hint_policy.master_of(slug, grading.masters())


def _policed(check, slug: str, master):
    @functools.wraps(check)
    def wrapper(*args, **kwargs):
        try:
            return check(*args, **kwargs)
        except AssertionError as exc:
            broken = hint_policy.violations(str(exc), slug, master)
            if broken:
                pytest.fail(f"{slug}.{check.__name__}'s hint breaks the hint policy ({'; '.join(broken)}):\n"
                            f"{str(exc)[:600]}", pytrace=False)
            raise
    return wrapper


@pytest.fixture(autouse=True)
def hint_policy_on_checks(request, monkeypatch):
    """Wrap the checks when the test module is one of tests/test_checks_*.py."""
    if not request.module.__name__.split(".")[-1].startswith("test_checks_"):
        yield
        return
    for info in pkgutil.iter_modules(dtlib.grading.checks.__path__):
        module = importlib.import_module(f"dtlib.grading.checks.{info.name}")
        master = _master(info.name)
        for name in dir(module):
            if name.startswith("check_") and callable(getattr(module, name)):
                monkeypatch.setattr(module, name, _policed(getattr(module, name), info.name, master))
    yield
