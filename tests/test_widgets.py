"""Every registered widget builds headlessly, and changing a control recomputes and redraws."""
import importlib
import pkgutil

import ipywidgets as W
import pytest

import dtlib.widgets
from dtlib.widgets import REGISTRY

for _mod in pkgutil.iter_modules(dtlib.widgets.__path__):
    importlib.import_module(f"dtlib.widgets.{_mod.name}")


def _other_value(control):
    if isinstance(control, (W.Dropdown, W.ToggleButtons, W.RadioButtons, W.SelectionSlider)):
        values = [v if not isinstance(v, tuple) else v[1] for v in control.options]
        return next(v for v in values if v != control.value)
    if isinstance(control, W.Checkbox):
        return not control.value
    if isinstance(control, (W.IntSlider, W.FloatSlider, W.FloatLogSlider, W.BoundedIntText, W.BoundedFloatText)):
        return control.max if control.value != control.max else control.min
    raise TypeError(f"no rule to change a {type(control).__name__}")


def test_widgets_are_registered():
    assert len(REGISTRY) >= 2


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_widget_updates_when_a_control_changes(name):
    explorer = REGISTRY[name]()
    assert explorer.updates == 1 and explorer.result is not None
    before = repr(explorer.result)
    control = next(iter(explorer.controls.values()))
    control.value = _other_value(control)
    assert explorer.updates == 2, "changing a control did not recompute"
    assert repr(explorer.result) != before, "the result did not change with the control"
    assert explorer.figure is not None and explorer.figure.axes, "nothing was drawn"
