"""Every registered widget builds headlessly, and changing a control recomputes and redraws."""
import importlib
import pkgutil
import re
from pathlib import Path

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


def test_every_lesson_widget_is_registered_and_every_registered_widget_is_shown():
    """The registry (what these tests build) and the lessons (what learners see) hold the same
    widgets, so no lesson widget goes untested and none is dead code."""
    root = Path(__file__).resolve().parents[1]
    shown = set()
    for nb in (root / "notebooks").glob("*.ipynb"):
        for line in nb.read_text().split("\\n"):
            m = re.search(r"from dtlib\.widgets\.\w+ import ([\w, ]+)", line)
            if m:
                shown |= {name.strip() for name in m.group(1).split(",")}
    registered = {builder.__name__ for builder in REGISTRY.values()}
    assert shown == registered, (f"in a lesson but not registered: {shown - registered}; "
                                 f"registered but in no lesson: {registered - shown}")


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_widget_updates_when_each_control_changes(name):
    """Each control, moved away from the default, recomputes a valid result and redraws; the first
    control (the one that matters most, see docs/authoring.md) always changes the result."""
    explorer = REGISTRY[name]()
    assert explorer.updates == 1 and explorer.error is None and explorer.result is not None
    default = repr(explorer.result)
    for i, (label, control) in enumerate(explorer.controls.items()):
        original, updates = control.value, explorer.updates
        control.value = _other_value(control)
        assert explorer.updates > updates, f"changing {label!r} did not recompute"
        assert explorer.error is None, f"{label!r} led to an invalid setting: {explorer.error}"
        assert i > 0 or repr(explorer.result) != default, f"the result did not change with {label!r}"
        assert explorer.figure is not None and explorer.figure.axes, "nothing was drawn"
        assert "image/png" in explorer.out.outputs[0]["data"], "the picture was not shown"
        control.value = original


def test_scaling_widget_measures_every_world_size_up_to_the_slider():
    from dtlib.data import load_mnist

    explorer = REGISTRY["scaling"](load_mnist("train", verbose=False).subset(512))
    explorer.controls["max_ranks"].value = 3
    assert sorted(explorer.result["throughput"]) == [1, 2, 3]
    assert explorer.result["efficiency"][1] == pytest.approx(1.0)  # N=1 is the reference


def test_explorer_shows_the_figure_and_reports_bad_settings():
    from matplotlib.figure import Figure

    from dtlib.widgets.base import Explorer

    def compute(n):
        if n < 0:
            raise ValueError("n must be >= 0")
        return n

    def plot(n):
        fig = Figure()
        fig.add_subplot().bar([0], [n])
        return fig

    explorer = Explorer({"n": W.IntSlider(value=1, min=-1, max=3)}, compute, plot)
    shown = explorer.out.outputs
    assert len(shown) == 1 and "image/png" in shown[0]["data"]
    explorer.controls["n"].value = -1  # an invalid setting: a message, never a broken widget
    assert explorer.error == "n must be >= 0" and "n must be >= 0" in explorer.out.outputs[0]["text"]
    explorer.controls["n"].value = 2
    assert explorer.result == 2 and "image/png" in explorer.out.outputs[0]["data"]


def test_explorer_output_carries_its_figure_for_static_pages(monkeypatch):
    """A notebook saved after running holds the widget's view *and* its default figure as a PNG,
    so a page without a widget manager (the course website) shows the picture; an invalid setting
    leaves only the view and its text."""
    import base64
    import io

    from matplotlib.figure import Figure
    from matplotlib.image import imread

    import dtlib.widgets.base as base

    def plot(n):
        fig = Figure(figsize=(2, 2))
        fig.add_subplot().bar([0], [n])
        return fig

    shown = []
    monkeypatch.setattr(base, "display", lambda obj, raw=False: shown.append((obj, raw)))
    def compute(n):
        if n < 0:
            raise ValueError("n must be >= 0")
        return n

    explorer = base.Explorer({"n": W.IntSlider(value=1, min=-1, max=3)}, compute, plot)
    explorer._ipython_display_()
    (bundle, raw), = shown
    assert raw and bundle["application/vnd.jupyter.widget-view+json"]["model_id"] == explorer.widget.model_id
    pixels = imread(io.BytesIO(base64.b64decode(bundle["image/png"])))
    assert pixels.shape[0] > 50 and pixels.min() < pixels.max()  # a drawn figure, not a blank
    explorer.controls["n"].value = -1
    explorer._ipython_display_()
    assert "image/png" not in shown[-1][0] and "text/plain" in shown[-1][0]


def test_widget_defaults_match_the_lessons_numbers():
    """A widget opens on the lesson's own setting, so its first picture repeats the lesson's numbers
    (lesson 11's link was 20 MB/s in the text and 10 MB/s in the widget)."""
    from dtlib.experiments.local_sgd import Run
    from dtlib.widgets.local_sgd import diloco_explorer

    assert diloco_explorer().controls["bandwidth_mb_s"].value * 1e6 == Run().bandwidth


def test_checkpoint_widget_opens_on_the_lessons_mtbf():
    """Lesson 08 prints Llama 3's per-GPU MTBF (a failure every 3.09 h at 16,384 GPUs); the widget
    opened on it rounded (3.06 h)."""
    from dtlib.analytic.reliability import LLAMA3_GPU_MTBF_HOURS
    from dtlib.widgets.resilience import checkpoint_interval_explorer

    assert checkpoint_interval_explorer().controls["gpu_mtbf_hours"].value == LLAMA3_GPU_MTBF_HOURS


def test_memory_calculator_offers_only_valid_tensor_parallel_sizes():
    """Lesson 3's TP dropdown offered 16, invalid for every model listed (8 KV heads): each offered
    size is valid for some model, and 16 is invalid for all of them."""
    from dtlib.widgets.memory import calculator_compute, memory_calculator

    explorer = memory_calculator()
    settings = dict(explorer.values())
    valid = {}
    for tp in (*explorer.controls["tp"].options, 16):
        for model in explorer.controls["model"].options:
            try:
                calculator_compute(**dict(settings, tp=tp, model=model, dp=1))
                valid[tp] = True
            except ValueError:
                valid.setdefault(tp, False)
    assert valid == {1: True, 2: True, 4: True, 8: True, 16: False}


def test_alpha_beta_widget_names_the_log_step_algorithm_for_what_it_is():
    """collective_time's latency-optimal all-reduce is Rabenseifner's halving-doubling, not a tree
    (issue 38): the widget's legend and title say so."""
    from dtlib.widgets.communication import _alpha_beta_plot, _alpha_beta_result

    fig = _alpha_beta_plot(_alpha_beta_result(8, "nvlink4", 2 ** 20))
    labels = [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]
    assert "halving-doubling, 8 ranks" in labels and not any("tree" in label for label in labels)
    assert "(halving-doubling)" in fig.axes[0].get_title() + "".join(t.get_text() for t in fig.texts)


def test_compression_widget_keeps_its_accuracy_axis_whatever_the_run():
    """Issue 38: the axis rescaled with every change, so a 1-point difference filled the plot."""
    from dtlib.widgets.compression import _compression_plot

    rows = [{"method": "none (fp32 all-reduce)", "bytes_per_step": 4e5, "accuracy": 0.885},
            {"method": "PowerSGD rank 2", "bytes_per_step": 2e4, "accuracy": 0.879}]
    limits = {_compression_plot({"rows": rows[:n], "steps": 40, "fewer_bytes": {}}).axes[0].get_ylim() for n in (1, 2)}
    assert limits == {(0.0, 100.0)}
